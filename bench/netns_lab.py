"""Real-network labs: Linux network namespaces joined by veth pairs and bridges, with NAT routers
(nftables), shaped links (tc tbf) and a UPnP/NAT-PMP home router (miniupnpd).

One :class:`Lab` holds what every topology shares: namespaces named ``<prefix><name>`` (a
per-process prefix, so parallel runs do not collide), veth pairs created straight inside their
namespaces (nothing touches the host's), the processes and the daemon started in them, and a
teardown that always runs (deleting a namespace takes its interfaces, bridge, qdiscs and rules
with it). The topologies:

* :class:`NetnsLab`: two homes behind NAT routers (cone, or symmetric with ``fully_random``)
  and a public host on one WAN; what the NAT tests under ``tests/p2p/nat`` run in.
* :class:`ShapedLab`: one namespace per peer on a bridge, links shaped with tbf
  (``bench.allreduce_netns``).
* :class:`UPnPRouterLab`: one home behind a router running miniupnpd.
* :class:`InternetLab`: every kind of path at once (public host, cloud VM, cone, symmetric and
  UPnP homes).

Home routers masquerade their LAN and accept no unsolicited inbound connection (established and
related traffic only, as home routers do). With ``drop_private`` a router silently drops packets
to private addresses beyond its own LAN, as the Internet does: a dial to another site's LAN
address hangs until its timeout instead of failing at once.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (the ``PYTHONPATH`` and working directory of lab processes)."""
CLONE_NEWNET = 0x40000000
_PACKAGES = {"ip": "iproute2", "tc": "iproute2", "nft": "nftables", "miniupnpd": "miniupnpd"}


def unavailable_reason(*tools: str) -> str | None:
    """Why a lab needing ``tools`` (besides ``ip``: ``tc``, ``nft``, ``miniupnpd``) cannot run
    here (not Linux, not root, a tool missing, nftables not working in a namespace), or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return f"the namespace lab needs root (ip netns{''.join(', ' + t for t in tools)})"
    for tool in ("ip", *tools):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"'{tool}' not found (install the {_PACKAGES.get(tool, tool)} package)"
    probe = f"d4probe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        if "nft" in tools:
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


def enter_namespace(name: str) -> None:
    """Move the calling thread (call it before starting others) into namespace ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def read_event(proc: subprocess.Popen, event: str, timeout: float, log: Path | None = None) -> dict:
    """The next JSON line of ``proc`` naming ``event`` (other lines are skipped)."""
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


# ---- router rules --------------------------------------------------------------------------------
def home_router_rules(*, symmetric: bool = False) -> str:
    """nftables rules of a home router: masquerade towards ``wan0`` (keeping source ports where
    it can: a cone NAT that TCP hole punching gets through; ``symmetric``: a new external port
    per connection), and no unsolicited inbound connection."""
    random = " fully-random" if symmetric else ""
    return f"""
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


def drop_private_rules(wan: str) -> str:
    """nftables rules that silently drop, and count (:meth:`Lab.dropped`), packets leaving
    ``wan0`` for private addresses outside the lab's WAN ``<wan>.0/24``."""
    return f"""
define private = {{ 10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16 }}
table ip internet {{
    chain forward {{
        type filter hook forward priority filter - 10; policy accept;
        oifname "wan0" ip daddr != {wan}.0/24 ip daddr $private counter drop
    }}
}}
"""


def miniupnpd_rules() -> str:
    """nftables rules of a home router running miniupnpd: masquerade towards ``wan0``, no
    unsolicited inbound connection, except the forwards miniupnpd adds (its nftables build adds
    them to chains "miniupnpd", "prerouting_miniupnpd" and "postrouting_miniupnpd" of table
    inet "filter", jumped to from the router's own)."""
    return """
table inet filter {
    chain miniupnpd { }
    chain prerouting_miniupnpd { }
    chain postrouting_miniupnpd { }
    chain prerouting {
        type nat hook prerouting priority dstnat; policy accept;
        jump prerouting_miniupnpd
    }
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        jump postrouting_miniupnpd
        oifname "wan0" masquerade
    }
    chain input {
        type filter hook input priority filter; policy accept;
        iifname "wan0" ct state new drop
    }
    chain forward {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan0" oifname "wan0" accept
        jump miniupnpd
    }
}
"""


def miniupnpd_config(workdir: str, lan: str, *, natpmp: bool = True, upnp: bool = True) -> str:
    """miniupnpd.conf for a router with ``wan0`` outside and ``lan0`` on ``<lan>.0/24``."""
    return "\n".join(
        [
            "ext_ifname=wan0",
            "listening_ip=lan0",
            "http_port=5000",
            f"enable_natpmp={'yes' if natpmp else 'no'}",
            f"enable_upnp={'yes' if upnp else 'no'}",
            "secure_mode=yes",
            "system_uptime=no",
            "min_lifetime=60",
            "max_lifetime=86400",
            "uuid=3a5f0c1e-7b2d-4e8f-9a6b-0d1c2e3f4a5b",
            f"lease_file={workdir}/leases",
            f"allow 1024-65535 {lan}.0/24 1024-65535",
            "deny 0-65535 0.0.0.0/0 0-65535",
            "",
        ]
    )


def start_miniupnpd(ns: str, workdir: str, config: str, *, natpmp: bool, upnp: bool):
    """Start miniupnpd in namespace ``ns`` (logs in ``workdir``); returns once it listens."""
    conf = os.path.join(workdir, "miniupnpd.conf")
    with open(conf, "w") as f:
        f.write(config)
    log = open(os.path.join(workdir, "miniupnpd.log"), "w")  # noqa: SIM115
    daemon = subprocess.Popen(
        ["ip", "netns", "exec", ns, "miniupnpd", "-d", "-f", conf,
         "-P", os.path.join(workdir, "pid")],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    log.close()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise RuntimeError(f"miniupnpd exited: {_tail(workdir)}")
        out = subprocess.run(
            ["ip", "netns", "exec", ns, "ss", "-lntu"], capture_output=True, text=True
        ).stdout
        if (":5000" in out or not upnp) and (":5351" in out or not natpmp):
            return daemon
        time.sleep(0.1)
    daemon.kill()
    raise RuntimeError(f"miniupnpd did not start: {_tail(workdir)}")


def stop_daemon(daemon: subprocess.Popen | None) -> None:
    if daemon is None or daemon.poll() is not None:
        return
    daemon.terminate()
    try:
        daemon.wait(timeout=5)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait(timeout=5)


def _tail(workdir: str) -> str:
    try:
        with open(os.path.join(workdir, "miniupnpd.log")) as f:
            return f.read()[-2000:]
    except OSError:
        return ""


# ---- what every lab shares -----------------------------------------------------------------------
class Lab:
    """Namespaces, the links between them, and the processes and daemon started in them; a
    context manager that tears everything down. Subclasses build their topology in
    :meth:`build` (a failed build tears down what it made)."""

    PREFIX = "d4"

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix or f"{self.PREFIX}{os.getpid() % 100000}"
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.daemon: subprocess.Popen | None = None
        self.workdir: str | None = None

    def ns(self, name: str) -> str:
        """The full name of the lab's namespace ``name``."""
        return f"{self.prefix}{name}"

    def build(self) -> None:
        raise NotImplementedError

    def setup(self) -> Self:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> Self:
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- building --
    def _run(self, *argv: str, stdin: str | None = None) -> None:
        done = subprocess.run(list(argv), capture_output=True, text=True, input=stdin)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")

    def _in(self, name: str, *argv: str, stdin: str | None = None) -> None:
        self._run("ip", "netns", "exec", self.ns(name), *argv, stdin=stdin)

    def _add_ns(self, name: str) -> None:
        self._run("ip", "netns", "add", self.ns(name))
        self.namespaces.append(self.ns(name))
        self._in(name, "ip", "link", "set", "lo", "up")

    def _veth(self, a: str, if_a: str, b: str, if_b: str) -> None:
        # both ends are created straight inside their namespaces: nothing touches the host's
        self._run(
            "ip", "link", "add", if_a, "netns", self.ns(a), "type", "veth",
            "peer", "name", if_b, "netns", self.ns(b),
        )  # fmt: skip

    def _addr(self, name: str, iface: str, cidr: str) -> None:
        self._in(name, "ip", "addr", "add", cidr, "dev", iface)
        self._in(name, "ip", "link", "set", iface, "up")

    def _add_bridge(self, name: str) -> None:
        """Namespace ``name`` holding bridge ``br0``."""
        self._add_ns(name)
        self._in(name, "ip", "link", "add", "br0", "type", "bridge")
        self._in(name, "ip", "link", "set", "br0", "up")

    def _attach(self, bridge: str, port: str, name: str, iface: str) -> None:
        """A veth from ``name``'s ``iface`` to port ``port`` of ``bridge``'s ``br0``."""
        self._veth(bridge, port, name, iface)
        self._in(bridge, "ip", "link", "set", port, "master", "br0")
        self._in(bridge, "ip", "link", "set", port, "up")

    def _home(
        self, router: str, host: str, wan_ip: str, lan: str, rules: str, drop_private: str | None
    ) -> None:
        """Router ``router`` on the ``wan`` bridge at ``wan_ip``, and ``host`` at ``<lan>.2``
        behind it (``<lan>.1``) with ``rules``; ``drop_private``: the lab's WAN prefix, and
        foreign private destinations are routed to the WAN's first host and dropped there."""
        self._add_ns(router)
        self._add_ns(host)
        self._attach("wan", f"{router}port", router, "wan0")
        self._addr(router, "wan0", f"{wan_ip}/24")
        self._veth(router, "lan0", host, "eth0")
        self._addr(router, "lan0", f"{lan}.1/24")
        self._addr(host, "eth0", f"{lan}.2/24")
        self._in(host, "ip", "route", "add", "default", "via", f"{lan}.1")
        self._in(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self._in(router, "nft", "-f", "-", stdin=rules)
        if drop_private is not None:
            gateway = f"{drop_private}.10"
            self._in(router, "ip", "route", "add", "10.0.0.0/8", "via", gateway, "dev", "wan0")
            self._in(router, "nft", "-f", "-", stdin=drop_private_rules(drop_private))

    # -- reading --
    def dropped(self, router: str) -> int:
        """Packets ``router`` silently dropped towards foreign private addresses."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.ns(router), "nft", "list", "table", "ip", "internet"],
            capture_output=True,
            text=True,
        )
        found = re.search(r"counter packets (\d+)", done.stdout)
        return int(found.group(1)) if found else 0

    def _redirects(self, router: str) -> str:
        """The forwards miniupnpd added on ``router`` (as nft lists them)."""
        return subprocess.run(
            ["ip", "netns", "exec", self.ns(router), "nft", "list", "chain", "inet", "filter",
             "prerouting_miniupnpd"],
            capture_output=True, text=True,
        ).stdout  # fmt: skip

    def daemon_log(self) -> str:
        if self.workdir is None:
            return ""
        try:
            with open(os.path.join(self.workdir, "miniupnpd.log")) as f:
                return f.read()
        except OSError:
            return ""

    # -- processes --
    def spawn(
        self,
        host: str,
        argv: Sequence[str],
        *,
        log: str | Path,
        env: dict | None = None,
        cwd: str | Path | None = None,
    ) -> subprocess.Popen:
        """Start ``argv`` in ``host``'s namespace: stdin and stdout piped (text), stderr to
        the file ``log``; killed by :meth:`close` if still running."""
        err = open(log, "w")  # noqa: SIM115 - closed right below, the child keeps its copy
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), *argv],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        err.close()
        self.procs.append(proc)
        return proc

    def spawn_module(self, host: str, *args: str, log: str | Path) -> subprocess.Popen:
        """Start ``python -m <args>`` of this repository in ``host``'s namespace (see
        :meth:`spawn`)."""
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        return self.spawn(host, [sys.executable, "-m", *args], log=log, env=env, cwd=ROOT)

    def close(self) -> None:
        """Kill the processes and the daemon, delete every namespace and the work directory."""
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
        stop_daemon(self.daemon)
        self.daemon = None
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


# ---- two homes behind NATs -----------------------------------------------------------------------
class NetnsLab(Lab):
    """Two homes behind NAT routers and a public host on one WAN::

        [pub] 10.77.0.10 ─┐
                          ├─ br0 in [wan]   (10.77.0.0/24)
        [r1]  10.77.0.11 ─┤                 [r1] masquerades 10.77.1.0/24 -> 10.77.0.11
        [r2]  10.77.0.12 ─┘                 [r2] masquerades 10.77.2.0/24 -> 10.77.0.12
        [h1] 10.77.1.2 (via r1)   [h2] 10.77.2.2 (via r2)

    h1 and h2 can dial out but nobody can dial them. ``fully_random=True`` makes both NATs
    symmetric; ``drop_private=True`` makes the routers drop foreign private destinations.
    """

    PREFIX = "d4n"
    WAN = "10.77.0"

    def __init__(
        self, *, fully_random: bool = False, drop_private: bool = False, prefix: str | None = None
    ) -> None:
        super().__init__(prefix)
        self.fully_random = fully_random
        self.drop_private = drop_private

    def build(self) -> None:
        self._add_bridge("wan")
        self._add_ns("pub")
        self._attach("wan", "pubport", "pub", "eth0")
        self._addr("pub", "eth0", f"{self.WAN}.10/24")
        rules = home_router_rules(symmetric=self.fully_random)
        drop = self.WAN if self.drop_private else None
        for n in (1, 2):
            self._home(f"r{n}", f"h{n}", f"{self.WAN}.1{n}", f"10.77.{n}", rules, drop)


# ---- shaped links --------------------------------------------------------------------------------
SUBNET = "10.78.0"


def peer_ip(i: int) -> str:
    """Address of peer ``i`` on the shaped lab's bridge."""
    return f"{SUBNET}.{10 + i}"


def tbf_args(mbit: float) -> list[str]:
    """tc arguments of a tbf shaper at ``mbit`` Mbit/s (10^6 bit/s).

    The bucket holds ~4 ms of traffic and at least 64 KiB, so one GSO segment from veth fits
    (tbf would otherwise split or drop it); the queue holds 100 ms, enough for TCP to keep the
    link busy without sliding into heavy bufferbloat.
    """
    rate = mbit * 1e6 / 8  # bytes/s
    burst = max(64 * 1024, int(rate * 0.004))
    limit = max(2 * burst, int(rate * 0.1))
    return ["tbf", "rate", f"{int(mbit * 1000)}kbit", "burst", str(burst), "limit", str(limit)]


class ShapedLab(Lab):
    """N peer namespaces on one bridge with tbf-shaped links::

        [<prefix>h0] 10.78.0.10 eth0 ──tbf up── p0 ─┐
        [<prefix>h1] 10.78.0.11 eth0 ──tbf up── p1 ─┼─ br0 in [<prefix>br]
        ...                                           ┘

    Each peer's uplink is a tbf qdisc on its ``eth0`` (egress of the namespace); its downlink,
    when given, is a tbf qdisc on its bridge port ``p<i>`` (egress of the bridge towards the
    peer). No delay is added anywhere (on this kernel there is no netem, and delaying outgoing
    packets collapses TCP). Processes join a namespace with :func:`enter_namespace` (``setns``),
    so a ``multiprocessing`` child keeps its pipe to the parent.
    """

    PREFIX = "d4l"

    def __init__(
        self,
        uplinks_mbit: Sequence[float],
        downlinks_mbit: Sequence[float | None] | None = None,
        prefix: str | None = None,
    ) -> None:
        super().__init__(prefix)
        self.uplinks = list(uplinks_mbit)
        self.downlinks = list(downlinks_mbit or [None] * len(self.uplinks))
        if len(self.downlinks) != len(self.uplinks):
            raise ValueError("one downlink per uplink")

    def host(self, i: int) -> str:
        """Namespace name of peer ``i``."""
        return self.ns(f"h{i}")

    @property
    def bridge_ns(self) -> str:
        return self.ns("br")

    def build(self) -> None:
        self._add_bridge("br")
        for i, (up, down) in enumerate(zip(self.uplinks, self.downlinks, strict=True)):
            h, port = f"h{i}", f"p{i}"
            self._add_ns(h)
            self._attach("br", port, h, "eth0")
            self._addr(h, "eth0", f"{peer_ip(i)}/24")
            self._in(h, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf_args(up))
            if down is not None:
                self._in("br", "tc", "qdisc", "add", "dev", port, "root", *tbf_args(down))


# ---- a home router with UPnP IGD and NAT-PMP (miniupnpd) -----------------------------------------
UPNP_WAN = "11.79.0"
"""The UPnP lab's outside network. miniupnpd maps nothing on a router whose outside address is
private or reserved (as behind carrier-grade NAT), so this one is public-looking; it exists
only inside the lab's namespaces, which have no route anywhere else."""
UPNP_LAN = "10.79.1"


class UPnPRouterLab(Lab):
    """One home behind a NAT router that runs miniupnpd (UPnP IGD + NAT-PMP), and one public
    host outside::

        [pub] 11.79.0.10 ── wan0 11.79.0.1 [rt] lan0 10.79.1.1 ── 10.79.1.2 [home]

    The router masquerades the home and accepts no unsolicited inbound connection, except on
    ports that miniupnpd maps (its nftables chains are jumped to from the router's own).
    """

    PREFIX = "d4u"

    def __init__(self, prefix: str | None = None, *, natpmp: bool = True, upnp: bool = True):
        super().__init__(prefix)
        self.natpmp = natpmp
        self.upnp = upnp

    @property
    def pub_ip(self) -> str:
        return f"{UPNP_WAN}.10"

    @property
    def router_wan_ip(self) -> str:
        return f"{UPNP_WAN}.1"

    @property
    def home_ip(self) -> str:
        return f"{UPNP_LAN}.2"

    def _link(self, a: str, if_a: str, ip_a: str, b: str, if_b: str, ip_b: str) -> None:
        self._veth(a, if_a, b, if_b)
        self._addr(a, if_a, ip_a)
        self._addr(b, if_b, ip_b)

    def build(self) -> None:
        for name in ("pub", "rt", "home"):
            self._add_ns(name)
        self._link("pub", "eth0", f"{self.pub_ip}/24", "rt", "wan0", f"{self.router_wan_ip}/24")
        self._link("rt", "lan0", f"{UPNP_LAN}.1/24", "home", "eth0", f"{self.home_ip}/24")
        self._in("home", "ip", "route", "add", "default", "via", f"{UPNP_LAN}.1")
        self._in("rt", "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self._in("rt", "nft", "-f", "-", stdin=miniupnpd_rules())
        self.workdir = tempfile.mkdtemp(prefix="upnplab")
        config = miniupnpd_config(self.workdir, UPNP_LAN, natpmp=self.natpmp, upnp=self.upnp)
        self.daemon = start_miniupnpd(
            self.ns("rt"), self.workdir, config, natpmp=self.natpmp, upnp=self.upnp
        )

    def redirects(self) -> str:
        """The router's port-forwarding rules as nft lists them (what miniupnpd added)."""
        return self._redirects("rt")


# ---- every kind of path at once ------------------------------------------------------------------
WORLD_WAN = "11.80.0"
"""The world lab's Internet: public-looking (miniupnpd maps nothing behind a private outside
address), reachable only inside the lab's namespaces."""


class InternetLab(Lab):
    """The paths volunteers and organisers really take, side by side on one WAN. Every router
    but the cloud's is a home router; with ``drop_private`` every router silently drops packets
    to private addresses beyond its own LAN (a dial to them hangs)::

        [pub]   11.80.0.10                                 a host with a public address
        [cloud] 11.80.0.20 1:1 NAT     [vm] 10.80.5.2      a cloud VM (every port forwarded)
        [r1]    11.80.0.11 cone NAT    [h1] 10.80.1.2      home, no port mapping
        [r2]    11.80.0.12 symmetric   [h2] 10.80.2.2      home, a new port per connection
        [r3]    11.80.0.13 miniupnpd   [h3] 10.80.3.2      home router that maps ports
        [r4]    11.80.0.14 cone NAT    [h4] 10.80.4.2      home, no port mapping

    Hosts are named ``pub``, ``vm``, ``h1``..``h4``; :meth:`spawn` starts a process in one.
    """

    PREFIX = "d4w"
    HOMES = {"r1": ("cone", 1), "r2": ("symmetric", 2), "r3": ("upnp", 3), "r4": ("cone", 4)}
    CLOUD_LAN = 5

    def __init__(self, *, drop_private: bool = True, prefix: str | None = None) -> None:
        super().__init__(prefix)
        self.drop_private = drop_private

    @property
    def pub_ip(self) -> str:
        return f"{WORLD_WAN}.10"

    @property
    def cloud_ip(self) -> str:
        """The VM's public address (forwarded 1:1 to :attr:`vm_ip`)."""
        return f"{WORLD_WAN}.20"

    @property
    def vm_ip(self) -> str:
        return f"10.80.{self.CLOUD_LAN}.2"

    def home_ip(self, host: str) -> str:
        return f"10.80.{host[1:]}.2"

    def router_ip(self, router: str) -> str:
        return f"{WORLD_WAN}.1{router[1:]}"

    def _cloud_rules(self) -> str:
        return f"""
table ip nat {{
    chain prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname "wan0" ip daddr {self.cloud_ip} dnat to {self.vm_ip}
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan0" ip saddr {self.vm_ip} snat to {self.cloud_ip}
    }}
}}
"""

    def build(self) -> None:
        self._add_bridge("wan")
        self._add_ns("pub")
        self._attach("wan", "pubport", "pub", "eth0")
        self._addr("pub", "eth0", f"{self.pub_ip}/24")
        drop = WORLD_WAN if self.drop_private else None
        cloud_lan = f"10.80.{self.CLOUD_LAN}"
        self._home("cloud", "vm", self.cloud_ip, cloud_lan, self._cloud_rules(), drop)
        for router, (kind, lan) in self.HOMES.items():
            rules = (
                miniupnpd_rules()
                if kind == "upnp"
                else home_router_rules(symmetric=kind == "symmetric")
            )
            self._home(router, f"h{lan}", self.router_ip(router), f"10.80.{lan}", rules, drop)
        self.workdir = tempfile.mkdtemp(prefix="worldlab")
        self.daemon = start_miniupnpd(
            self.ns("r3"),
            self.workdir,
            miniupnpd_config(self.workdir, "10.80.3"),
            natpmp=True,
            upnp=True,
        )

    def redirects(self) -> str:
        """The forwards miniupnpd added on ``r3`` (as nft lists them)."""
        return self._redirects("r3")
