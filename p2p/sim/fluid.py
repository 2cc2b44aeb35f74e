"""Max-min fair bandwidth sharing of the simulated links, as a fluid model.

Each host has an uplink and a downlink (bytes per second, possibly infinite). A *flow* is one
direction of one connection and crosses two links: the sender's uplink and the receiver's
downlink. While a flow has bytes queued it is *active*, and the active flows share each link
max-min fairly (progressive filling), recomputed only for the connected group of links whose
set of active flows changed. Bytes move in chunks: a chunk's last byte leaves at an exact virtual
time computed from the piecewise-constant rates, and the engine fires that completion then.

Rate changes within one instant are batched: they mark links dirty and one reallocation runs
before virtual time moves on (when a thousand flows start together, that is one pass, not a
thousand).

This gives the textbook figures the tests check: n bytes over an idle path take
n / min(up, down); k backlogged flows through one bottleneck get 1/k of it each; capacity a
flow cannot use (it is limited elsewhere) goes to the others. Pure logic, no trio.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable

from p2p.sim.engine import Engine, Event

CHUNK = 64 * 1024
"""Largest chunk a flow transmits at once: the granularity of delivery and of fair sharing."""

ChunkSink = Callable[[bytes, float], None]


class Link:
    """One direction of a host's access link; ``flows`` holds its active flows in order."""

    __slots__ = ("name", "cap", "flows", "seq")

    def __init__(self, name: str, cap: float, seq: int) -> None:
        if not cap > 0:
            raise ValueError(f"link capacity must be positive bytes/s, got {cap!r}")
        self.name = name
        self.cap = float(cap)
        self.flows: dict[Flow, None] = {}
        self.seq = seq

    def __repr__(self) -> str:
        return f"Link({self.name}, {self.cap:g} B/s, {len(self.flows)} flows)"


class Flow:
    """Bytes from one uplink to one downlink; ``sink(payload, t)`` gets each finished chunk."""

    __slots__ = (
        "up",
        "down",
        "sink",
        "chunks",
        "head_rem",
        "rate",
        "t_update",
        "active",
        "event",
        "queued",
        "tail_len",
    )

    def __init__(self, up: Link, down: Link, sink: ChunkSink) -> None:
        self.up = up
        self.down = down
        self.sink = sink
        # untransmitted chunks, each a list of byte pieces; chunks[0] is in transmission
        self.chunks: deque[list[bytes]] = deque()
        self.head_rem = 0.0  # bytes of chunks[0] left at t_update
        self.rate = 0.0
        self.t_update = 0.0
        self.active = False
        self.event: Event | None = None
        self.queued = 0  # untransmitted bytes
        self.tail_len = 0  # bytes in chunks[-1]

    def __repr__(self) -> str:
        return f"Flow({self.up.name}->{self.down.name}, rate={self.rate:g}, queued={self.queued})"


class FluidNet:
    """The links and flows of one simulated network, driven by an :class:`Engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._link_seq = 0
        self._dirty: dict[Link, None] = {}
        self.reallocations = 0
        engine.defer_to(self.has_pending, self.flush)

    def has_pending(self) -> bool:
        """Whether rates must be recomputed before time moves on."""
        return bool(self._dirty)

    def flush(self) -> bool:
        """Recompute the rates of every group of links touched this instant."""
        if not self._dirty:
            return False
        seeds = tuple(self._dirty)
        self._dirty.clear()
        self._reallocate(seeds, self.engine.now)
        return True

    def new_link(self, name: str, cap: float) -> Link:
        self._link_seq += 1
        return Link(name, cap, self._link_seq)

    def enqueue(self, flow: Flow, payload: bytes) -> None:
        """Queue ``payload`` (at most :data:`CHUNK` bytes) for transmission starting now."""
        n = len(payload)
        if n == 0:
            return
        now = self.engine.now
        if not flow.active:
            if flow.up.cap == math.inf and flow.down.cap == math.inf:
                flow.sink(payload, now)
                return
            flow.chunks.append([payload])
            flow.queued = n
            flow.tail_len = n
            flow.head_rem = float(n)
            flow.rate = 0.0
            flow.t_update = now
            flow.active = True
            flow.up.flows[flow] = None
            flow.down.flows[flow] = None
            self._mark(flow.up, flow.down)
            return
        flow.queued += n
        # coalesce small writes into a tail chunk that has not started transmitting
        if len(flow.chunks) > 1 and flow.tail_len + n <= CHUNK:
            flow.chunks[-1].append(payload)
            flow.tail_len += n
        else:
            flow.chunks.append([payload])
            flow.tail_len = n

    def clear(self, flow: Flow) -> None:
        """Drop everything queued on ``flow`` (the connection was reset)."""
        flow.chunks.clear()
        flow.queued = 0
        if flow.active:
            self._deactivate(flow)

    def set_capacity(self, link: Link, cap: float) -> None:
        if not cap > 0:
            raise ValueError(f"link capacity must be positive bytes/s, got {cap!r}")
        link.cap = float(cap)
        self._mark(link)

    # -- internals -------------------------------------------------------------------------

    def _mark(self, *links: Link) -> None:
        """Note links whose flows changed; the first mark of an instant tells the engine's
        owner (through ``on_new_head``) that work is due now."""
        was_clean = not self._dirty
        for link in links:
            self._dirty[link] = None
        if was_clean and self.engine.on_new_head is not None:
            self.engine.on_new_head()

    def _deactivate(self, flow: Flow) -> None:
        del flow.up.flows[flow]
        del flow.down.flows[flow]
        self._mark(flow.up, flow.down)
        flow.active = False
        flow.rate = 0.0
        if flow.event is not None:
            flow.event.cancel()
            flow.event = None

    def _schedule(self, flow: Flow) -> None:
        if flow.event is not None:
            flow.event.cancel()
        if flow.rate == math.inf:
            t_done = flow.t_update
        else:
            t_done = flow.t_update + flow.head_rem / flow.rate
        flow.event = self.engine.at(t_done, self._complete, flow)

    def _complete(self, flow: Flow) -> None:
        t = self.engine.now
        flow.event = None
        pieces = flow.chunks.popleft()
        payload = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        flow.queued -= len(payload)
        if flow.chunks:
            flow.head_rem = float(sum(map(len, flow.chunks[0])))
            flow.t_update = t
            self._schedule(flow)
        else:
            self._deactivate(flow)
        flow.sink(payload, t)

    def _reallocate(self, seeds: tuple[Link, ...], t: float) -> None:
        """Recompute max-min fair rates for the links connected to ``seeds`` through flows."""
        self.reallocations += 1
        links: dict[Link, None] = {}
        flows: dict[Flow, None] = {}
        stack = list(seeds)
        while stack:
            link = stack.pop()
            if link in links:
                continue
            links[link] = None
            for f in link.flows:
                if f not in flows:
                    flows[f] = None
                    stack.append(f.up)
                    stack.append(f.down)
        if not flows:
            return
        # progressive filling: repeatedly saturate the link offering the smallest fair share
        rem: dict[Link, float] = {}
        cnt: dict[Link, int] = {}
        ver: dict[Link, int] = {}
        heap: list[tuple[float, int, int, Link]] = []
        for link in links:
            if link.cap != math.inf and link.flows:
                rem[link] = link.cap
                cnt[link] = len(link.flows)
                ver[link] = 0
                heap.append((link.cap / len(link.flows), link.seq, 0, link))
        heapq.heapify(heap)
        new_rate: dict[Flow, float] = {}
        while heap:
            share, _, v, link = heapq.heappop(heap)
            if ver[link] != v:
                continue
            ver[link] = -1  # saturated
            for f in link.flows:
                if f in new_rate:
                    continue
                new_rate[f] = share
                other = f.down if f.up is link else f.up
                ov = ver.get(other)
                if ov is None or ov < 0:
                    continue
                rem[other] -= share
                cnt[other] -= 1
                ver[other] = ov + 1
                if cnt[other] > 0:
                    heapq.heappush(
                        heap, (max(rem[other], 0.0) / cnt[other], other.seq, ov + 1, other)
                    )
        for f in flows:
            r = new_rate.get(f, math.inf)
            if r == f.rate or (r != math.inf and abs(r - f.rate) <= 1e-12 * r):
                continue  # unchanged up to rounding: keep the scheduled completion
            if 0.0 < f.rate < math.inf:
                f.head_rem = max(0.0, f.head_rem - f.rate * (t - f.t_update))
            elif f.rate == math.inf:
                f.head_rem = 0.0
            f.t_update = t
            f.rate = r
            self._schedule(f)
