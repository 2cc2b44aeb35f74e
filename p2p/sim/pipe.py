"""One direction of a simulated connection: fluid flow, propagation delay, receive buffer.

Bytes written by the sender enter a fluid :class:`~p2p.sim.fluid.Flow`; each finished chunk
lands on the "wire" with a delivery time (completion + one-way latency, never before the
previous chunk, so a latency change cannot reorder bytes) and becomes readable then. The
sender may have at most ``buffer_bytes`` written but neither read by the receiver nor in
propagation, so a slow reader back-pressures the writer like a socket buffer, while bytes on the
wire (up to twice the path's bandwidth-delay product, as TCP autotuning allows) never count,
so the buffer does not cap throughput on a long fat path.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from p2p.sim.fluid import CHUNK, Flow

if TYPE_CHECKING:
    import trio

    from p2p.sim.network import SimHost, SimNetwork

_EOF = None


class Pipe:
    """Sender -> receiver bytes with TCP-like ordering, EOF and reset semantics."""

    __slots__ = (
        "net",
        "src",
        "dst",
        "flow",
        "wire",
        "head_off",
        "unread",
        "eof_sent",
        "broken",
        "recv_waiter",
        "send_waiter",
        "last_deliver",
        "bytes_delivered",
        "inflight",
    )

    def __init__(self, net: SimNetwork, src: SimHost, dst: SimHost) -> None:
        self.net = net
        self.src = src
        self.dst = dst
        self.flow = Flow(src.uplink, dst.downlink, self._on_chunk)
        self.wire: deque[tuple[float, bytes | None]] = deque()
        self.head_off = 0
        self.unread = 0
        self.eof_sent = False
        self.broken: str | None = None
        self.recv_waiter: trio.CancelScope | None = None
        self.send_waiter: trio.CancelScope | None = None
        self.last_deliver = -math.inf
        self.bytes_delivered = 0
        self.inflight = 0  # bytes landed on the wire whose delivery time is still ahead

    # -- sender side -----------------------------------------------------------------------

    def inflight_allowance(self) -> float:
        """Bytes in propagation that do not count against the buffer: 2x the path's BDP."""
        bottleneck = min(self.src.uplink.cap, self.dst.downlink.cap)
        if bottleneck == math.inf:
            return self.net.max_inflight_bytes
        return 2 * bottleneck * self.net.latency(self.src, self.dst)

    def send_space(self) -> int:
        counted = self.unread - min(self.inflight, self.inflight_allowance())
        return int(self.net.buffer_bytes - counted)

    def wake_threshold(self) -> int:
        return min(self.net.buffer_bytes // 2, CHUNK)

    def write(self, view: memoryview) -> int:
        """Queue as much of ``view`` as the window allows now; returns the bytes taken."""
        space = self.send_space()
        if space <= 0:
            return 0
        n = min(space, len(view))
        fluid = self.net.fluid
        for i in range(0, n, CHUNK):
            fluid.enqueue(self.flow, bytes(view[i : min(i + CHUNK, n)]))
        self.unread += n
        return n

    def write_eof(self) -> None:
        if self.eof_sent or self.broken is not None:
            return
        self.eof_sent = True
        if not self.flow.active:
            self._land(_EOF, self.net.engine.now)

    # -- receiver side ---------------------------------------------------------------------

    @property
    def waiter(self) -> trio.CancelScope | None:
        """The blocked reader, whom a delivery event wakes (see ``SimNetwork._refresh_keeper``)."""
        return self.recv_waiter

    def readable(self, now: float) -> bool:
        return bool(self.wire) and self.wire[0][0] <= now

    def at_eof(self) -> bool:
        return bool(self.wire) and self.wire[0][1] is _EOF

    def read(self, now: float, max_bytes: int) -> bytes:
        """Take up to ``max_bytes`` of the bytes delivered by ``now`` (caller checked readable)."""
        out: list[bytes] = []
        taken = 0
        wire = self.wire
        while wire and taken < max_bytes:
            t, payload = wire[0]
            if t > now or payload is _EOF:
                break
            avail = len(payload) - self.head_off
            want = max_bytes - taken
            if avail <= want:
                out.append(payload if self.head_off == 0 else payload[self.head_off :])
                wire.popleft()
                self.head_off = 0
                taken += avail
            else:
                out.append(payload[self.head_off : self.head_off + want])
                self.head_off += want
                taken += want
        self.unread -= taken
        # wake a blocked writer only for a worthwhile amount of space (TCP's silly-window
        # avoidance), so one-byte reads do not turn a transfer into one-byte chunks
        if self.send_waiter is not None and self.send_space() >= self.wake_threshold():
            self.send_waiter.cancel()
        return out[0] if len(out) == 1 else b"".join(out)

    # -- faults ----------------------------------------------------------------------------

    def reset(self, reason: str) -> None:
        """Break this direction: queued and unread bytes are lost, waiters wake up."""
        if self.broken is not None:
            return
        self.broken = reason
        self.net.fluid.clear(self.flow)
        self.wire.clear()
        self.head_off = 0
        self.unread = 0
        self.inflight = 0
        self.wake_all()

    def wake_all(self) -> None:
        if self.recv_waiter is not None:
            self.recv_waiter.cancel()
        if self.send_waiter is not None:
            self.send_waiter.cancel()

    # -- internals -------------------------------------------------------------------------

    def _on_chunk(self, payload: bytes, t: float) -> None:
        self._land(payload, t)
        if self.eof_sent and not self.flow.active:
            self._land(_EOF, t)

    def _land(self, payload: bytes | None, t: float) -> None:
        net = self.net
        deliver = max(t + net.latency(self.src, self.dst), self.last_deliver)
        self.last_deliver = deliver
        self.wire.append((deliver, payload))
        n = 0
        if payload is not None:
            n = len(payload)
            self.bytes_delivered += n
            net.stats.bytes += len(payload)
            net.stats.chunks += 1
            if net.trace is not None:
                net.trace.append((deliver, "bytes", self.src.name, self.dst.name, len(payload)))
        if deliver <= net.engine.now:
            self._arrive(0)
        else:
            self.inflight += n
            net.engine.at(deliver, self._arrive, n, owner=self)
            # bytes now in propagation stop counting against the buffer: the writer may go on
            if self.send_waiter is not None and self.send_space() >= self.wake_threshold():
                self.send_waiter.cancel()

    def _arrive(self, n: int) -> None:
        if self.broken is not None:
            return
        self.inflight -= n
        if self.recv_waiter is not None:
            self.recv_waiter.cancel()
