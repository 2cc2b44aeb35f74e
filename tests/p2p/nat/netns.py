"""A real-network lab: Linux network namespaces, veth pairs, a bridge, and NAT routers.

Topology (every address private, every interface inside namespaces this lab creates)::

    [pub] 10.77.0.10 ─┐
                      ├─ br0 in [wan]   (10.77.0.0/24)
    [r1]  10.77.0.11 ─┤                 [r1] masquerades 10.77.1.0/24 -> 10.77.0.11
    [r2]  10.77.0.12 ─┘                 [r2] masquerades 10.77.2.0/24 -> 10.77.0.12
    [h1] 10.77.1.2 (via r1)   [h2] 10.77.2.2 (via r2)

The routers accept no new inbound connections (only established/related traffic goes in;
unsolicited SYNs are dropped, as home routers do), so h1 and h2 can dial out but nobody can
dial them. Masquerade keeps source ports where it can: a cone NAT that TCP hole punching
gets through. ``fully_random=True`` gives
symmetric NATs (a new external port per connection). ``drop_private=True`` makes the routers
behave like the Internet towards private addresses that are not their own: packets to them
are dropped silently (not rejected), so a dial to another site's LAN address hangs until its
timeout instead of failing at once. Names carry a per-process prefix so
parallel runs do not collide; :meth:`NetnsLab.close` deletes everything (namespaces take
their interfaces, bridge and rules with them) and kills the processes started in them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def unavailable_reason() -> str | None:
    """Why the lab cannot run here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "the namespace lab needs root (ip netns, nft)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"'{tool}' not found (install the {package} package)"
    probe = f"nsprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        nft = subprocess.run(
            ["ip", "netns", "exec", probe, "nft", "add", "table", "ip", "probe"],
            capture_output=True,
            text=True,
        )
        if nft.returncode != 0:
            return f"nftables does not work in a namespace: {nft.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class NetnsLab:
    """Creates the topology above; use as a context manager (always torn down)."""

    def __init__(
        self, *, fully_random: bool = False, drop_private: bool = False, prefix: str | None = None
    ) -> None:
        self.prefix = prefix or f"d4n{os.getpid() % 100000}"
        self.fully_random = fully_random
        self.drop_private = drop_private
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def ns(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def _run(self, *argv: str) -> None:
        done = subprocess.run(list(argv), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")

    def _in(self, ns: str, *argv: str) -> None:
        self._run("ip", "netns", "exec", self.ns(ns), *argv)

    def _add_ns(self, name: str) -> None:
        self._run("ip", "netns", "add", self.ns(name))
        self.namespaces.append(self.ns(name))
        self._in(name, "ip", "link", "set", "lo", "up")

    def _veth(self, ns_a: str, if_a: str, ns_b: str, if_b: str) -> None:
        # both ends are created straight inside their namespaces: nothing touches the host's
        self._run(
            "ip", "link", "add", if_a, "netns", self.ns(ns_a), "type", "veth",
            "peer", "name", if_b, "netns", self.ns(ns_b),
        )  # fmt: skip

    def _addr(self, ns: str, iface: str, cidr: str) -> None:
        self._in(ns, "ip", "addr", "add", cidr, "dev", iface)
        self._in(ns, "ip", "link", "set", iface, "up")

    def _router(self, name: str, wan_ip: str, lan_net: int) -> None:
        """A NAT router ``name`` and its host ``h<n>`` behind it."""
        host = "h" + name[1:]
        self._add_ns(name)
        self._add_ns(host)
        self._veth("wan", f"{name}port", name, "wan0")
        self._in("wan", "ip", "link", "set", f"{name}port", "master", "br0")
        self._in("wan", "ip", "link", "set", f"{name}port", "up")
        self._addr(name, "wan0", f"{wan_ip}/24")
        self._veth(name, "lan0", host, "eth0")
        self._addr(name, "lan0", f"10.77.{lan_net}.1/24")
        self._addr(host, "eth0", f"10.77.{lan_net}.2/24")
        self._in(host, "ip", "route", "add", "default", "via", f"10.77.{lan_net}.1")
        self._in(name, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        random = " fully-random" if self.fully_random else ""
        rules = f"""
table ip nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan0" masquerade{random}
    }}
}}
table ip filter {{
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "wan0" ct state new drop
    }}
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan0" oifname "wan0" accept
    }}
}}
"""
        self._nft(name, rules)
        if self.drop_private:
            self._drop_foreign_private(name)

    def _drop_foreign_private(self, name: str) -> None:
        """Router ``name`` forwards private destinations beyond its LAN towards the WAN (as a
        default route would) and drops them there silently, counting them (:meth:`dropped`)."""
        self._in(name, "ip", "route", "add", "10.0.0.0/8", "via", "10.77.0.10", "dev", "wan0")
        self._nft(
            name,
            """
define private = { 10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16 }
table ip internet {
    chain forward {
        type filter hook forward priority filter - 10; policy accept;
        oifname "wan0" ip daddr != 10.77.0.0/24 ip daddr $private counter drop
    }
}
""",
        )

    def dropped(self, name: str) -> int:
        """Packets router ``name`` silently dropped towards foreign private addresses."""
        import re

        done = subprocess.run(
            ["ip", "netns", "exec", self.ns(name), "nft", "list", "table", "ip", "internet"],
            capture_output=True,
            text=True,
        )
        found = re.search(r"counter packets (\d+)", done.stdout)
        return int(found.group(1)) if found else 0

    def _nft(self, ns: str, rules: str) -> None:
        done = subprocess.run(
            ["ip", "netns", "exec", self.ns(ns), "nft", "-f", "-"],
            input=rules,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"nft in {ns} failed: {done.stderr.strip()}")

    def setup(self) -> NetnsLab:
        try:
            self._add_ns("wan")
            self._in("wan", "ip", "link", "add", "br0", "type", "bridge")
            self._in("wan", "ip", "link", "set", "br0", "up")
            self._add_ns("pub")
            self._veth("wan", "pubport", "pub", "eth0")
            self._in("wan", "ip", "link", "set", "pubport", "master", "br0")
            self._in("wan", "ip", "link", "set", "pubport", "up")
            self._addr("pub", "eth0", "10.77.0.10/24")
            self._router("r1", "10.77.0.11", 1)
            self._router("r2", "10.77.0.12", 2)
        except BaseException:
            self.close()
            raise
        return self

    def spawn(self, ns: str, *args: str, log: Path) -> subprocess.Popen:
        """Start ``python -m <args>`` in namespace ``ns``: stdout piped, stderr to ``log``."""
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        err = open(log, "w")  # noqa: SIM115 - closed right below, the child keeps its copy
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(ns), sys.executable, "-m", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        err.close()
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a stuck process
                pass
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        self.procs.clear()
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()

    def __enter__(self) -> NetnsLab:
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_event(proc: subprocess.Popen, event: str, timeout: float, log: Path | None = None) -> dict:
    """The next JSON line of ``proc`` naming ``event`` (other lines are skipped)."""
    import json
    import selectors
    import time

    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                break
            line = proc.stdout.readline()
            if not line:
                break
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("event") == event:
                return msg
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"no {event!r} event within {timeout} s (exit {proc.poll()}):\n{tail}")
