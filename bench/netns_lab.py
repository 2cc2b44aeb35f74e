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
