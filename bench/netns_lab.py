"""A shaped-link lab: one network namespace per peer on a bridge, each uplink shaped with tbf.

Topology (every address private, every interface inside namespaces this lab creates)::

    [<prefix>h0] 10.78.0.10 eth0 ──tbf up── p0 ─┐
    [<prefix>h1] 10.78.0.11 eth0 ──tbf up── p1 ─┼─ br0 in [<prefix>br]
    ...                                           ┘

Each peer's uplink is a tbf qdisc on its ``eth0`` (egress of the namespace); its downlink, when
given, is a tbf qdisc on its bridge port ``p<i>`` (egress of the bridge towards the peer). No
delay is added anywhere (on this kernel there is no netem, and delaying outgoing packets
collapses TCP). Processes join a namespace with :func:`enter_namespace` (``setns``), so a
``multiprocessing`` child keeps its pipe to the parent. Names carry a per-process prefix so
parallel runs do not collide; :meth:`ShapedLab.close` deletes every namespace it made.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

CLONE_NEWNET = 0x40000000
SUBNET = "10.78.0"


def unavailable_reason() -> str | None:
    """Why the lab cannot run here (not Linux, not root, no ``ip``/``tc``), or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "the shaped-link lab needs root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found (install the iproute2 package)"
    probe = f"d4lprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def peer_ip(i: int) -> str:
    """Address of peer ``i`` on the lab's bridge."""
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


class ShapedLab:
    """N peer namespaces on one bridge with tbf-shaped links; a context manager."""

    def __init__(
        self,
        uplinks_mbit: Sequence[float],
        downlinks_mbit: Sequence[float | None] | None = None,
        prefix: str | None = None,
    ) -> None:
        self.uplinks = list(uplinks_mbit)
        self.downlinks = list(downlinks_mbit or [None] * len(self.uplinks))
        if len(self.downlinks) != len(self.uplinks):
            raise ValueError("one downlink per uplink")
        self.prefix = prefix or f"d4l{os.getpid() % 100000}"
        self.namespaces: list[str] = []

    def host(self, i: int) -> str:
        """Namespace name of peer ``i``."""
        return f"{self.prefix}h{i}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}br"

    def _run(self, *argv: str) -> None:
        done = subprocess.run(list(argv), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")

    def _in(self, ns: str, *argv: str) -> None:
        self._run("ip", "netns", "exec", ns, *argv)

    def _add_ns(self, ns: str) -> None:
        self._run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        self._in(ns, "ip", "link", "set", "lo", "up")

    def setup(self) -> ShapedLab:
        try:
            br = self.bridge_ns
            self._add_ns(br)
            self._in(br, "ip", "link", "add", "br0", "type", "bridge")
            self._in(br, "ip", "link", "set", "br0", "up")
            for i, (up, down) in enumerate(zip(self.uplinks, self.downlinks, strict=True)):
                h, port = self.host(i), f"p{i}"
                self._add_ns(h)
                # both ends are created straight inside their namespaces: nothing on the host
                self._run(
                    "ip", "link", "add", "eth0", "netns", h, "type", "veth",
                    "peer", "name", port, "netns", br,
                )  # fmt: skip
                self._in(br, "ip", "link", "set", port, "master", "br0")
                self._in(br, "ip", "link", "set", port, "up")
                self._in(h, "ip", "addr", "add", f"{peer_ip(i)}/24", "dev", "eth0")
                self._in(h, "ip", "link", "set", "eth0", "up")
                self._in(h, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf_args(up))
                if down is not None:
                    self._in(br, "tc", "qdisc", "add", "dev", port, "root", *tbf_args(down))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Delete every namespace made (their interfaces, bridge and qdiscs go with them)."""
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()

    def __enter__(self) -> ShapedLab:
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- a home router with UPnP IGD and NAT-PMP (miniupnpd) ------------------------------------
UPNP_WAN = "11.79.0"
"""The UPnP lab's outside network. miniupnpd maps nothing on a router whose outside address is
private or reserved (as behind carrier-grade NAT), so this one is public-looking; it exists
only inside the lab's namespaces, which have no route anywhere else."""
UPNP_LAN = "10.79.1"


def miniupnpd_unavailable() -> str | None:
    """Why the UPnP router lab cannot run here, or None."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    for tool, package in (("nft", "nftables"), ("miniupnpd", "miniupnpd")):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"'{tool}' not found (install the {package} package)"
    return None


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
    import time

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


class UPnPRouterLab:
    """One home behind a NAT router that runs miniupnpd (UPnP IGD + NAT-PMP), and one public
    host outside; a context manager.

    ::

        [pub] 11.79.0.10 ── wan0 11.79.0.1 [rt] lan0 10.79.1.1 ── 10.79.1.2 [home]

    The router masquerades the home and accepts no unsolicited inbound connection, except on
    ports that miniupnpd maps (its nftables chains are jumped to from the router's own).
    """

    def __init__(self, prefix: str | None = None, *, natpmp: bool = True, upnp: bool = True):
        self.prefix = prefix or f"d4u{os.getpid() % 100000}"
        self.natpmp = natpmp
        self.upnp = upnp
        self.namespaces: list[str] = []
        self.daemon: subprocess.Popen | None = None
        self.workdir: str | None = None

    def ns(self, name: str) -> str:
        return f"{self.prefix}{name}"

    @property
    def pub_ip(self) -> str:
        return f"{UPNP_WAN}.10"

    @property
    def router_wan_ip(self) -> str:
        return f"{UPNP_WAN}.1"

    @property
    def home_ip(self) -> str:
        return f"{UPNP_LAN}.2"

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

    def _link(self, a: str, if_a: str, ip_a: str, b: str, if_b: str, ip_b: str) -> None:
        self._run(
            "ip", "link", "add", if_a, "netns", self.ns(a), "type", "veth",
            "peer", "name", if_b, "netns", self.ns(b),
        )  # fmt: skip
        for name, iface, cidr in ((a, if_a, ip_a), (b, if_b, ip_b)):
            self._in(name, "ip", "addr", "add", cidr, "dev", iface)
            self._in(name, "ip", "link", "set", iface, "up")

    def _rules(self) -> str:
        return miniupnpd_rules()

    def _config(self) -> str:
        assert self.workdir is not None
        return miniupnpd_config(self.workdir, UPNP_LAN, natpmp=self.natpmp, upnp=self.upnp)

    def setup(self) -> UPnPRouterLab:
        import tempfile

        try:
            for name in ("pub", "rt", "home"):
                self._add_ns(name)
            self._link("pub", "eth0", f"{self.pub_ip}/24", "rt", "wan0", f"{self.router_wan_ip}/24")
            self._link("rt", "lan0", f"{UPNP_LAN}.1/24", "home", "eth0", f"{self.home_ip}/24")
            self._in("home", "ip", "route", "add", "default", "via", f"{UPNP_LAN}.1")
            self._in("rt", "sysctl", "-qw", "net.ipv4.ip_forward=1")
            self._in("rt", "nft", "-f", "-", stdin=self._rules())
            self.workdir = tempfile.mkdtemp(prefix="upnplab")
            self.daemon = start_miniupnpd(
                self.ns("rt"), self.workdir, self._config(), natpmp=self.natpmp, upnp=self.upnp
            )
        except BaseException:
            self.close()
            raise
        return self

    def daemon_log(self) -> str:
        if self.workdir is None:
            return ""
        try:
            with open(os.path.join(self.workdir, "miniupnpd.log")) as f:
                return f.read()
        except OSError:
            return ""

    def redirects(self) -> str:
        """The router's port-forwarding rules as nft lists them (what miniupnpd added)."""
        return subprocess.run(
            ["ip", "netns", "exec", self.ns("rt"), "nft", "list", "chain", "inet", "filter",
             "prerouting_miniupnpd"],
            capture_output=True, text=True,
        ).stdout  # fmt: skip

    def close(self) -> None:
        stop_daemon(self.daemon)
        self.daemon = None
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> UPnPRouterLab:
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- every kind of path at once --------------------------------------------------------------
WORLD_WAN = "11.80.0"
"""The world lab's Internet: public-looking (miniupnpd maps nothing behind a private outside
address), reachable only inside the lab's namespaces."""


class InternetLab:
    """The paths volunteers and organisers really take, side by side on one WAN; a context
    manager. Every router but the cloud's is a home router (masquerade, no unsolicited
    inbound connection); with ``drop_private`` every router silently drops packets to private
    addresses beyond its own LAN, as the Internet does (a dial to them hangs)::

        [pub]   11.80.0.10                                 a host with a public address
        [cloud] 11.80.0.20 1:1 NAT     [vm] 10.80.5.2      a cloud VM (every port forwarded)
        [r1]    11.80.0.11 cone NAT    [h1] 10.80.1.2      home, no port mapping
        [r2]    11.80.0.12 symmetric   [h2] 10.80.2.2      home, a new port per connection
        [r3]    11.80.0.13 miniupnpd   [h3] 10.80.3.2      home router that maps ports
        [r4]    11.80.0.14 cone NAT    [h4] 10.80.4.2      home, no port mapping

    Hosts are named ``pub``, ``vm``, ``h1``..``h3``; :meth:`spawn` starts a process in one.
    """

    HOMES = {"r1": ("cone", 1), "r2": ("symmetric", 2), "r3": ("upnp", 3), "r4": ("cone", 4)}
    CLOUD_LAN = 5

    def __init__(self, *, drop_private: bool = True, prefix: str | None = None) -> None:
        self.prefix = prefix or f"d4w{os.getpid() % 100000}"
        self.drop_private = drop_private
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.daemon: subprocess.Popen | None = None
        self.workdir: str | None = None

    def ns(self, name: str) -> str:
        return f"{self.prefix}{name}"

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

    def _link(self, a: str, if_a: str, b: str, if_b: str) -> None:
        self._run(
            "ip", "link", "add", if_a, "netns", self.ns(a), "type", "veth",
            "peer", "name", if_b, "netns", self.ns(b),
        )  # fmt: skip

    def _addr(self, name: str, iface: str, cidr: str) -> None:
        self._in(name, "ip", "addr", "add", cidr, "dev", iface)
        self._in(name, "ip", "link", "set", iface, "up")

    def _on_wan(self, name: str, iface: str, ip: str) -> None:
        self._link("wan", f"{name}port", name, iface)
        self._in("wan", "ip", "link", "set", f"{name}port", "master", "br0")
        self._in("wan", "ip", "link", "set", f"{name}port", "up")
        self._addr(name, iface, f"{ip}/24")

    def _router(self, router: str, host: str, lan: int, rules: str) -> None:
        self._add_ns(router)
        self._add_ns(host)
        self._on_wan(router, "wan0", f"{WORLD_WAN}.{20 if lan == self.CLOUD_LAN else 10 + lan}")
        self._link(router, "lan0", host, "eth0")
        self._addr(router, "lan0", f"10.80.{lan}.1/24")
        self._addr(host, "eth0", f"10.80.{lan}.2/24")
        self._in(host, "ip", "route", "add", "default", "via", f"10.80.{lan}.1")
        self._in(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self._in(router, "nft", "-f", "-", stdin=rules)
        if self.drop_private:
            # private destinations beyond the LAN go out by the default route and die there
            self._in(router, "ip", "route", "add", "10.0.0.0/8", "via", self.pub_ip)
            self._in(router, "nft", "-f", "-", stdin=_DROP_PRIVATE)

    @staticmethod
    def _home_rules(kind: str) -> str:
        if kind == "upnp":
            return miniupnpd_rules()
        random = " fully-random" if kind == "symmetric" else ""
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

    def setup(self) -> InternetLab:
        import tempfile

        try:
            self._add_ns("wan")
            self._in("wan", "ip", "link", "add", "br0", "type", "bridge")
            self._in("wan", "ip", "link", "set", "br0", "up")
            self._add_ns("pub")
            self._on_wan("pub", "eth0", self.pub_ip)
            self._router("cloud", "vm", self.CLOUD_LAN, self._cloud_rules())
            for router, (kind, lan) in self.HOMES.items():
                self._router(router, f"h{lan}", lan, self._home_rules(kind))
            self.workdir = tempfile.mkdtemp(prefix="worldlab")
            self.daemon = start_miniupnpd(
                self.ns("r3"),
                self.workdir,
                miniupnpd_config(self.workdir, "10.80.3"),
                natpmp=True,
                upnp=True,
            )
        except BaseException:
            self.close()
            raise
        return self

    def dropped(self, router: str) -> int:
        """Packets ``router`` silently dropped towards foreign private addresses."""
        import re

        done = subprocess.run(
            ["ip", "netns", "exec", self.ns(router), "nft", "list", "table", "ip", "internet"],
            capture_output=True,
            text=True,
        )
        found = re.search(r"counter packets (\d+)", done.stdout)
        return int(found.group(1)) if found else 0

    def redirects(self) -> str:
        """The forwards miniupnpd added on ``r3`` (as nft lists them)."""
        return subprocess.run(
            ["ip", "netns", "exec", self.ns("r3"), "nft", "list", "chain", "inet", "filter",
             "prerouting_miniupnpd"],
            capture_output=True, text=True,
        ).stdout  # fmt: skip

    def spawn(self, host: str, argv: Sequence[str], *, log: str, env: dict | None = None):
        """Start ``argv`` in ``host``'s namespace: stdin and stdout piped (text), stderr to
        the file ``log``; killed by :meth:`close` if still running."""
        err = open(log, "w")  # noqa: SIM115 - closed right below, the child keeps its copy
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), *argv],
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
            for pipe in (proc.stdin, proc.stdout):
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

    def __enter__(self) -> InternetLab:
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.close()


_DROP_PRIVATE = """
define private = { 10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16 }
table ip internet {
    chain forward {
        type filter hook forward priority filter - 10; policy accept;
        oifname "wan0" ip daddr $private counter drop
    }
}
"""
