"""Every kind of node of a public run at once, on paths like the Internet's (issue #31's "done").

In :class:`bench.netns_lab.InternetLab`, where every router silently drops packets to private
addresses beyond its LAN:

* a standalone JAX-free node (``python -m p2p.dht serve``) on a host with a public address,
* the coordinator on a cloud VM behind 1:1 NAT, started with ``--announce PUBLIC_IP`` (an aux
  peer, as the sahajBERT coordinator is),
* four volunteers at home: behind a cone NAT and behind a symmetric NAT, both with no port
  mapping (they take relay reservations), behind a router running miniupnpd (it maps a port
  and is public), and behind a cone NAT taking no relay (a client that only sends).

All join through the standalone node, stay up, and average small vectors for a few epochs:
every round must complete with all five averaging peers and leave the same bits on every
volunteer, the weighted mean of what they sent.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bench.netns_lab import ROOT, InternetLab, unavailable_reason

pytestmark = [pytest.mark.netns, pytest.mark.slow]

_why = unavailable_reason("nft", "miniupnpd")

EPOCHS = 4
SIZE = 1 << 16  # float32 values: 256 KiB per peer and round
IDLE = 40.0  # seconds: keepalives (every 15 s) and a re-check (every 20-120 s) pass
VOLUNTEERS = {
    "h1": "cone NAT",
    "h2": "symmetric NAT",
    "h3": "miniupnpd router",
    "h4": "cone NAT, no relay taken",
}
MEMBERS = len(VOLUNTEERS) + 1  # and the aux coordinator


class Lines:
    """Every line a process prints, read by a thread as it comes (several events can arrive
    in one read, which a select on the pipe then never reports again)."""

    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc = proc
        self.log = log
        self.queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.queue.put(line.strip())
        self.queue.put(None)

    def next(self, timeout: float) -> str:
        try:
            line = self.queue.get(timeout=timeout)
        except queue.Empty:
            line = None
        if line is None:
            tail = self.log.read_text()[-3000:]
            raise AssertionError(f"no output within {timeout} s (exit {self.proc.poll()}):\n{tail}")
        return line

    def event(self, name: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            line = self.next(max(0.0, deadline - time.monotonic()))
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("event") == name:
                return msg


def _send(proc: subprocess.Popen, line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


@pytest.mark.skipif(_why is not None, reason=_why or "")
def test_a_standalone_node_a_coordinator_and_nated_volunteers_join_stay_up_and_average(
    tmp_path: Path,
) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    logs: dict[str, Path] = {}
    started = time.monotonic()

    with InternetLab(drop_private=True) as lab:
        lines: dict[str, Lines] = {}

        def spawn(host: str, *argv: str) -> subprocess.Popen:
            logs[host] = tmp_path / f"{host}.log"
            proc = lab.spawn(host, [sys.executable, "-m", *argv], log=str(logs[host]), env=env)
            lines[host] = Lines(proc, logs[host])
            return proc

        standalone = spawn("pub", "p2p.dht", "serve", "--listen", f"/ip4/{lab.pub_ip}/tcp/4001")
        boot = lines["pub"].next(60)
        assert boot.startswith(f"/ip4/{lab.pub_ip}/tcp/4001/p2p/")

        peer_args = ["tests.p2p.nat.netns_world_peer", "--size", str(SIZE)]
        peer_args += ["--epochs", str(EPOCHS)]
        coordinator = spawn(
            "vm", *peer_args, "coordinator", "--index", "0", "--listen", "/ip4/0.0.0.0/tcp/4002",
            "--announce", f"/ip4/{lab.cloud_ip}/tcp/4002", "--boot", boot,
        )  # fmt: skip
        coord = lines["vm"].event("ready", 180)
        # only the announced address is advertised, and the 1:1 NAT forwards it: public
        assert coord["addrs"] == [f"/ip4/{lab.cloud_ip}/tcp/4002/p2p/{coord['peer']}"]
        assert coord["reachability"] == "public" and coord["mode"] == "aux"
        join = [boot, coord["addrs"][0]]

        procs = {}
        for i, host in enumerate(VOLUNTEERS, start=1):
            procs[host] = spawn(
                host, *peer_args, "volunteer", "--index", str(i),
                "--listen", f"/ip4/{lab.home_ip(host)}/tcp/4003", "--boot", *join,
                *(["--no-relay"] if host == "h4" else []),
            )  # fmt: skip
        ready = {host: lines[host].event("ready", 180) for host in procs}
        for host in ("h1", "h2"):  # no port mapping: private, reachable through relays
            r = ready[host]
            assert r["reachability"] == "private" and r["role"] == "relayed", r
            assert r["dht_client"] is True and r["mapping"] is None, r
            # the standalone node serves as a relay (and so does the coordinator)
            assert sorted(a.split("/p2p-circuit")[0] for a in r["relayed"]) == sorted(join), r
            assert r["mode"] == "node"  # a relayed peer reduces a share
        h4 = ready["h4"]  # no inbound path at all: a client that only sends
        assert h4["reachability"] == "private" and h4["role"] == "client", h4
        assert h4["mode"] == "client" and h4["relayed"] == [] and h4["dht_client"] is True, h4
        h3 = ready["h3"]
        router = f"/ip4/{lab.router_ip('r3')}/tcp/"
        assert h3["mapping"] is not None and h3["mapping"][1].startswith(router), h3
        assert h3["reachability"] == "public" and h3["role"] == "public", h3
        assert h3["addrs"][0].startswith(router) and h3["mode"] == "node", h3
        assert "prerouting_miniupnpd" in lab.redirects() and "dnat" in lab.redirects()

        for p in procs.values():
            _send(p, "go")
        rounds = {host: [] for host in procs}
        for host in procs:
            for _ in range(EPOCHS):
                rounds[host].append(lines[host].event("round", 300))
            lines[host].event("done", 60)
        for epoch in range(EPOCHS):
            rows = {host: rounds[host][epoch] for host in procs}
            assert all(r["epoch"] == epoch for r in rows.values()), rows
            # every round with every averaging peer: the volunteers and the aux coordinator
            assert all(r["complete"] and r["group"] == MEMBERS for r in rows.values()), rows
            assert rows["h4"]["mode"] == "client"
            assert len({r["sha256"] for r in rows.values()}) == 1, rows  # the same bits
            total = sum(r["samples"] for r in rows.values())
            sent = sum(np.array(r["sent"], np.float64) * r["samples"] for r in rows.values())
            np.testing.assert_allclose(rows["h1"]["got"], sent / total, rtol=1e-5, atol=1e-6)

        # all still up and serving; the run's table holds every volunteer
        assert standalone.poll() is None and coordinator.poll() is None
        assert all(p.poll() is None for p in procs.values())
        reports = {}
        for host, p in [("vm", coordinator), *procs.items()]:
            _send(p, "report")
            reports[host] = lines[host].event("report", 60)
        volunteers = {ready[h]["peer"] for h in procs}
        assert volunteers <= set(reports["vm"]["table"])
        for host in ("h1", "h2"):
            assert reports[host]["role"] == "relayed" and reports[host]["mode"] == "node"
        assert reports["h3"]["role"] == "public" and reports["h3"]["mapping"] is not None
        assert reports["h3"]["dht_client"] is False and reports["vm"]["dht_client"] is False
        # idle for longer than a keepalive interval and a reachability re-check: still up,
        # the NATed ones still reachable through their relays
        time.sleep(IDLE)
        assert all(p.poll() is None for p in [standalone, coordinator, *procs.values()])
        for host in ("h1", "h2"):
            _send(procs[host], "report")
            later = lines[host].event("report", 60)
            assert later["role"] == "relayed" and later["relayed"], later
            assert later["dht_client"] is True and later["mode"] == "node", later
        h1_h2 = reports["h1"]["conns"].get(ready["h2"]["peer"])
        summary = {
            "seconds": round(time.monotonic() - started, 1),
            "rounds_complete_with_all": EPOCHS,
            "roles": {h: (r["role"], r["mode"], r["mapping"]) for h, r in reports.items()},
            "h1_to_h2": h1_h2,
            "punched": {h: reports[h]["punched"] for h in procs},
            "dropped_private": {r: lab.dropped(r) for r in ("r1", "r2", "r3", "r4")},
        }
        print(json.dumps(summary))
        if h1_h2 is not None:  # the symmetric NAT defeats hole punching: still relayed
            assert "/p2p-circuit/" in h1_h2

        for p in [*procs.values(), coordinator]:
            _send(p, "quit")
        for host, p in [*procs.items(), ("vm", coordinator)]:
            assert p.wait(timeout=60) == 0, logs[host].read_text()[-3000:]
        standalone.send_signal(signal.SIGINT)
        assert standalone.wait(timeout=30) == 0, logs["pub"].read_text()[-3000:]
