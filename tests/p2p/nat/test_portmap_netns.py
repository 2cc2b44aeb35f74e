"""Port mapping against a real miniupnpd: a home router in a namespace lab
(:class:`bench.netns_lab.UPnPRouterLab`) that speaks UPnP IGD and NAT-PMP.

A mapping made by each protocol forwards the router's outside port to the home host (a
connection from outside reaches a listener at home), and deleting it closes the port again.
A standalone node at home (``python -m p2p.dht serve``) maps its port at start, advertises the
mapped address first, is public, and is reachable there from outside; on exit the mapping is
gone. With ``--no-port-mapping`` it stays private.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.netns_lab import UPnPRouterLab, unavailable_reason

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parents[3]
_why = unavailable_reason("nft", "miniupnpd")
skip = pytest.mark.skipif(_why is not None, reason=_why or "")

MAP_AND_PROBE = """
import json, socket, sys, trio
from p2p.nat.portmap import PortMapConfig, PortMapper

async def main(protocol):
    listener = socket.socket()
    listener.bind(("0.0.0.0", 4011))
    listener.listen(1)
    mapper = PortMapper(4011, PortMapConfig(protocols=(protocol,), lease=600))
    mapping = await mapper.request()
    mapper.mapping = mapping
    print(json.dumps({"ip": mapping.external_ip, "port": mapping.external_port,
                      "lease": mapping.lease}), flush=True)
    sys.stdin.readline()  # the test connects from outside now
    listener.settimeout(10)
    conn, peer = listener.accept()
    conn.sendall(b"home")
    conn.close()
    sys.stdin.readline()
    await mapper.delete()
    print(json.dumps({"deleted": True}), flush=True)

trio.run(main, sys.argv[1])
"""


def _in(lab: UPnPRouterLab, ns: str, *argv: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", lab.ns(ns), *argv],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        text=True,
        **kw,
    )


def _connect_from_outside(lab: UPnPRouterLab, port: int) -> str:
    code = (
        "import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), 5);"
        "print(s.recv(16).decode())"
    )
    done = subprocess.run(
        ["ip", "netns", "exec", lab.ns("pub"), sys.executable, "-c", code,
         lab.router_wan_ip, str(port)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return done.stdout.strip() or done.stderr.strip()[-300:]


@skip
@pytest.mark.parametrize("protocol", ["natpmp", "pcp", "upnp"])
def test_a_mapping_forwards_the_outside_port_home_and_deleting_closes_it(protocol) -> None:
    with UPnPRouterLab() as lab:
        proc = _in(
            lab, "home", sys.executable, "-c", MAP_AND_PROBE, protocol,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-3000:] + lab.daemon_log()[-2000:]
            got = json.loads(line)
            assert got == {"ip": lab.router_wan_ip, "port": 4011, "lease": 600}
            assert "dnat" in lab.redirects() and "4011" in lab.redirects()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert _connect_from_outside(lab, 4011) == "home"
            proc.stdin.write("delete\n")
            proc.stdin.flush()
            assert json.loads(proc.stdout.readline()) == {"deleted": True}
            assert "4011" not in lab.redirects()
            assert _connect_from_outside(lab, 4011) != "home"
        finally:
            proc.kill()
            proc.wait(10)


def _serve(lab: UPnPRouterLab, ns: str, *args: str) -> tuple[subprocess.Popen, list[str]]:
    proc = _in(
        lab, ns, sys.executable, "-m", "p2p.dht", "serve", "--config", "fast", *args,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    first = proc.stdout.readline().strip()
    if not first:
        proc.kill()
        raise AssertionError(proc.stderr.read()[-3000:])
    lines = [first]
    time.sleep(0.3)  # the rest of the addresses are printed at once
    import select

    while select.select([proc.stdout], [], [], 0.2)[0]:
        line = proc.stdout.readline().strip()
        if not line:
            break
        lines.append(line)
    return proc, lines


@skip
def test_a_standalone_node_behind_the_router_maps_its_port_and_is_public() -> None:
    with UPnPRouterLab() as lab:
        boot, boot_addrs = _serve(
            lab, "pub", "--listen", f"/ip4/{lab.pub_ip}/tcp/4001", "--force-reachability", "public"
        )
        home = None
        try:
            home, addrs = _serve(
                lab, "home", "--listen", "/ip4/0.0.0.0/tcp/4101", "--initial-peers", boot_addrs[0],
                "-v",
            )  # fmt: skip
            peer = addrs[0].rsplit("/p2p/", 1)[1]
            # the mapped address first: what peers dial
            assert addrs[0] == f"/ip4/{lab.router_wan_ip}/tcp/4101/p2p/{peer}", addrs
            assert "4101" in lab.redirects()
            # an outside peer reaches it there: a store through it lands on both nodes
            stored = subprocess.run(
                ["ip", "netns", "exec", lab.ns("pub"), sys.executable, "-m", "p2p.dht", "store",
                 "k", '"v"', "--ttl", "60", "--initial-peers", addrs[0], "--config", "fast"],
                capture_output=True, text=True, timeout=60, cwd=ROOT,
                env={"PYTHONPATH": str(ROOT)},
            )  # fmt: skip
            assert stored.returncode == 0 and "stored on 2 nodes" in stored.stdout, stored.stderr
            home.send_signal(signal.SIGTERM)
            assert home.wait(20) == 0
            err = home.stderr.read()
            assert "reachability public" in err, err[-2000:]
            assert "4101" not in lab.redirects()  # the mapping went with it
        finally:
            for p in (home, boot):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait(10)


@skip
def test_without_port_mapping_the_node_stays_private() -> None:
    with UPnPRouterLab() as lab:
        boot, boot_addrs = _serve(
            lab, "pub", "--listen", f"/ip4/{lab.pub_ip}/tcp/4001", "--force-reachability", "public"
        )
        home = None
        try:
            home, addrs = _serve(
                lab, "home", "--listen", "/ip4/0.0.0.0/tcp/4101", "--initial-peers", boot_addrs[0],
                "--no-port-mapping",
            )  # fmt: skip
            assert not any(lab.router_wan_ip in a and "p2p-circuit" not in a for a in addrs), addrs
            assert "4101" not in lab.redirects()
        finally:
            for p in (home, boot):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait(10)
