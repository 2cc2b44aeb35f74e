"""This peer's own upload and download rates, as the load-balancing LP gets them.

Model. Every transfer this peer makes is slowed by its own link, by the other end's link or by
other flows sharing either, never sped up beyond its own link; so the rate a transfer achieved
*while it had data queued* is a lower bound of this peer's link in that direction. The meter
keeps such lower bounds as samples and publishes, per direction, the largest sample of the last
``window`` seconds (a windowed max filter): a round in which a slow partner held us back does not
drag the figure down, and a link that got slower is seen once its older, faster samples expire.

Samples come from two sources:

* rounds (:class:`Gauge`): per stream, a send that blocked means the stream's buffers were full,
  so the bytes written from the first blocked send's return to the last blocked send's return
  left in that time (buffer occupancy is the same, full, at both ends); a download stream's
  bytes after its first chunk arrived over the time to its last. Busy spans of one direction,
  across all streams and rounds, are merged, and each merged span is one sample: its bytes over
  its length. Time when nothing was queued (waiting for a slow peer's results) never counts.
* an active probe (:func:`measure_links`) when a peer joins or its figure has expired: a few MB
  sent to, then fetched from, a couple of peers at once (several partners together can fill a
  downlink that each one's uplink alone cannot).

A user-supplied override replaces the measurement in its direction.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import weakref
from collections import deque
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import trio

from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.rpc import CallContext, MessageStream

logger = logging.getLogger(__name__)

PROBE_PROTOCOL = "dedloc/bwprobe/2"
MAX_PROBE_BYTES = 16 << 20
_PROBE_CHUNK = 32 << 10  # small, so that a slow partner's first message arrives early


def _chunk_for(nbytes: int) -> int:
    """Probe message size: at most 32 KiB, and at least 16 messages per transfer (the rate
    is timed from the first message on)."""
    return max(1024, min(_PROBE_CHUNK, nbytes // 16))


UNMEASURED_UPLOAD_BPS = 10e6 / 8
"""What a member with no figure counts as (bytes/s): a home uplink of 10 Mbit/s, so that a
round's deadlines assume a slow member until it is measured instead of an infinitely fast one."""
UNMEASURED_DOWNLOAD_BPS = 25e6 / 8


class LinkFigures(NamedTuple):
    """Published rates (bytes/s; None when unknown) and their age (seconds; inf when unknown,
    NaN when read outside trio). An overridden direction has age 0."""

    upload_bps: float | None
    download_bps: float | None
    upload_age: float
    download_age: float


@dataclass
class BandwidthMeter:
    """Windowed max of lower-bound rate samples per direction, in bytes/s (see the module)."""

    window: float = 600.0
    """Seconds a sample counts; after that the figure is stale and a probe should renew it."""
    upload_override: float | None = None
    download_override: float | None = None
    min_sample_bytes: int = 256 << 10
    """Busy spans that moved fewer bytes say too little (one buffer's worth) to be samples."""
    block_seconds: float = 1e-3
    """A send that took longer than this blocked: the stream's buffers were full."""
    _samples: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    _spans: dict[str, list[tuple[float, float, int]]] = field(default_factory=dict)
    _last: dict[str, tuple[float, float]] = field(default_factory=dict)

    @staticmethod
    def _check(direction: str) -> None:
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")

    @staticmethod
    def _now() -> float:
        try:
            return trio.current_time()
        except RuntimeError:  # outside trio (a training thread reading the figures)
            return math.nan

    def record(
        self, direction: str, nbytes: int, seconds: float, *, at: float | None = None
    ) -> None:
        """Fold one sample: ``nbytes`` moved in ``direction`` over ``seconds`` of busy link."""
        self._check(direction)
        if nbytes <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        rate = nbytes / seconds
        if not math.isfinite(rate):
            return
        now = self._now() if at is None else at
        q = self._samples.setdefault(direction, deque())
        q.append((now, rate))
        self._last[direction] = (now, rate)
        self._expire(direction, now)

    def _expire(self, direction: str, now: float) -> None:
        q = self._samples.get(direction)
        if q and math.isfinite(now):
            while len(q) > 1 and q[0][0] < now - self.window:
                q.popleft()

    def _estimate(self, direction: str, now: float) -> tuple[float, float] | None:
        """(rate, age): the max over the window; the latest sample alone once all expired."""
        self._expire(direction, now)
        q = self._samples.get(direction)
        if not q:
            return None
        fresh = [(t, r) for t, r in q if not math.isfinite(now) or t >= now - self.window]
        if not fresh:
            t, r = self._last[direction]
            return r, (now - t) if math.isfinite(now) else math.inf
        t, r = max(fresh, key=lambda s: s[1])
        newest = max(t for t, _ in fresh)
        return r, now - newest  # NaN outside trio: no clock to age it by

    def figures(self, now: float | None = None) -> LinkFigures:
        now = self._now() if now is None else now
        out: list[Any] = []
        for direction, override in (("up", self.upload_override), ("down", self.download_override)):
            if override is not None:
                out.append((override, 0.0))
                continue
            est = self._estimate(direction, now)
            out.append((None, math.inf) if est is None else est)
        return LinkFigures(out[0][0], out[1][0], out[0][1], out[1][1])

    @property
    def upload_bps(self) -> float | None:
        return self.figures().upload_bps

    @property
    def download_bps(self) -> float | None:
        return self.figures().download_bps

    @property
    def measured(self) -> bool:
        f = self.figures()
        return f.upload_bps is not None and f.download_bps is not None

    def stale(self, now: float | None = None) -> bool:
        """Whether a direction lacks a figure of the last ``window`` seconds (probe then)."""
        f = self.figures(now)
        return not (f.upload_age <= self.window and f.download_age <= self.window)

    # -- busy spans from rounds ----------------------------------------------------------------
    def gauge(self, direction: str) -> Gauge:
        """A tracker for one stream's transfers in ``direction``; close it when the stream ends."""
        self._check(direction)
        return Gauge(self, direction)

    def _span(self, direction: str, start: float, end: float, nbytes: int) -> None:
        if end > start and nbytes > 0:
            self._spans.setdefault(direction, []).append((start, end, nbytes))

    def flush(self) -> None:
        """Merge the spans closed so far into samples (a round calls this when it ends)."""
        for direction, spans in self._spans.items():
            spans.sort()
            merged: list[list[float]] = []
            for a, b, n in spans:
                if merged and a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                    merged[-1][2] += n
                else:
                    merged.append([a, b, n])
            spans.clear()
            for a, b, n in merged:
                if n >= self.min_sample_bytes:
                    self.record(direction, int(n), b - a, at=b)


class Gauge:
    """Busy time of one stream in one direction (see the module docstring for the rule)."""

    __slots__ = ("meter", "direction", "start", "end", "nbytes", "pending")

    def __init__(self, meter: BandwidthMeter, direction: str) -> None:
        self.meter, self.direction = meter, direction
        self.start: float | None = None
        self.end = -math.inf
        self.nbytes = 0  # bytes up to ``end``
        self.pending = 0  # upload: bytes written since the last blocked send

    def sent(self, nbytes: int, started: float, ended: float) -> None:
        """One send of ``nbytes`` that was called at ``started`` and returned at ``ended``."""
        blocked = ended - started > self.meter.block_seconds
        if self.start is None:
            if blocked:  # the buffers just became full: the span starts here
                self.start = self.end = ended
            return
        self.pending += nbytes
        if blocked:
            self.nbytes += self.pending
            self.pending = 0
            self.end = ended

    def received(self, nbytes: int, at: float) -> None:
        """``nbytes`` arrived at ``at`` (the first arrival only opens the span)."""
        if self.start is None:
            self.start = self.end = at
            return
        self.nbytes += nbytes
        self.end = at

    def close(self) -> None:
        if self.start is not None:
            self.meter._span(self.direction, self.start, self.end, self.nbytes)
        self.start, self.nbytes, self.pending = None, 0, 0


# -- the active probe ----------------------------------------------------------------------------


# Nodes probing or serving a probe now: such a node declines to serve another, since two
# probes through one link read each other's traffic as a slow link.
_BUSY: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


class _Busy:
    def __init__(self, node: Any) -> None:
        self.node = node

    def __enter__(self) -> None:
        _BUSY[self.node] = _BUSY.get(self.node, 0) + 1

    def __exit__(self, *exc: object) -> None:
        _BUSY[self.node] -= 1


async def _serve_probe(node: Any, ctx: CallContext, ms: MessageStream) -> None:
    """Other side of a probe: receive what the prober uploads, then send what it asks for."""
    request = await ms.receive()
    if not isinstance(request, dict):
        raise ValueError("malformed probe request")
    up = request.get("up")
    if not (isinstance(up, int) and not isinstance(up, bool) and 0 <= up <= MAX_PROBE_BYTES):
        raise ValueError("probe size out of range")
    if _BUSY.get(node):
        await ms.send({"busy": True})
        return
    await ms.send({"ok": True})
    await _serve_transfers(node, ms, up)


async def _serve_transfers(node: Any, ms: MessageStream, up: int) -> None:
    """Busy while bytes flow only: the prober uploads to its partners one after the other
    and asks each for its download at the end, and a partner busy all that time declined
    most other probes."""
    got = after_first = 0
    first = last = trio.current_time()
    with _Busy(node) if up else contextlib.nullcontext():
        while got < up:
            msg = await ms.receive()
            if not isinstance(msg, bytes) or got + len(msg) > up:
                raise ValueError("probe payload must be bytes of the announced size")
            last = trio.current_time()
            if got:
                after_first += len(msg)
            else:
                first = last
            got += len(msg)
    # What arrived after the first message, over the time it took: the rate without the
    # request's round trip and the first message's latency.
    await ms.send({"got": got, "bytes": after_first, "seconds": last - first})
    ask = await ms.receive()
    down = ask.get("down") if isinstance(ask, dict) else None
    if not (isinstance(down, int) and not isinstance(down, bool) and 0 <= down <= MAX_PROBE_BYTES):
        raise ValueError("probe size out of range")
    chunk = _chunk_for(down)
    payload = os.urandom(chunk)
    sent = 0
    with _Busy(node):
        while sent < down:
            n = min(chunk, down - sent)
            await ms.send(payload[:n])
            sent += n


def install_probe(node: Any) -> None:
    """Answer other peers' probes (idempotent per node is up to the caller)."""
    node.add_stream_handler(PROBE_PROTOCOL, functools.partial(_serve_probe, node))


async def measure_links(
    node: Any,
    peers: Sequence[PeerID],
    meter: BandwidthMeter,
    *,
    nbytes: int = 4 << 20,
    max_peers: int = 3,
    upload_peers: int = 2,
    timeout: float = 60.0,
) -> LinkFigures:
    """Probe this peer's links with about ``2 * nbytes`` of traffic and record both rates.

    Upload: ``nbytes`` split among the first ``upload_peers`` partners, one after the other
    (each a sample: one partner's downlink is usually wider than our uplink). Download: the first
    ``max_peers`` partners send ``nbytes`` between them at once, and the rate counts until the
    first of them finished, while all were sending (several uplinks together can fill a downlink
    none of them fills alone). Pass ``peers`` best first (widest known uplinks). Each figure is
    a lower bound. Partners that fail are left out; raises :class:`ValueError` when none
    answered. Call it when joining a run, or when ``meter.stale()``.
    """
    chosen = list(peers)[:max_peers]
    if not chosen:
        raise ValueError("no peer to probe")
    payload = os.urandom(_PROBE_CHUNK)
    with trio.fail_after(timeout):
        async with AsyncExitStack() as stack:
            streams: list[MessageStream] = []
            for peer in chosen:
                try:
                    cm = node.open_stream(peer, PROBE_PROTOCOL, timeout=timeout)
                    streams.append(await stack.enter_async_context(cm))
                except Exception as e:  # a partner that cannot be reached is skipped
                    logger.info("probe partner %s unreachable: %r", peer, e)
            if not streams:
                raise ValueError("no probe partner answered")
            # Busy (declining others' probes) only while our transfers run: busy while it
            # dialed its partners too, a node that probed was busy most of the time, and at
            # the start of a 12-peer run 101 of 112 probes found every partner busy.
            stack.enter_context(_Busy(node))
            uploaders = max(1, min(upload_peers, len(streams)))
            each_up = max(1, min(MAX_PROBE_BYTES, nbytes // uploaders))
            alive: list[MessageStream] = []
            uploaded = 0
            for ms in streams:
                # The upload goes to the first partners that accept (a busy one is skipped):
                # by position, a busy first partner left the uplink unmeasured.
                size = each_up if uploaded < uploaders else 0
                try:
                    seconds = await _upload(ms, size, payload)
                except (P2PError, ValueError) as e:  # this partner is left out
                    logger.info("probe upload failed: %r", e)
                    continue
                alive.append(ms)
                if size:
                    uploaded += 1
                    meter.record("up", size, seconds)
            streams = alive
            if not streams:
                raise ValueError("no probe partner took part")
            each_down = max(1, min(MAX_PROBE_BYTES, nbytes // len(streams)))
            arrivals: list[tuple[float, int]] = []
            started: list[float] = []  # per stream, its first message's arrival
            first_done: list[float] = []

            async def download(ms: MessageStream) -> None:
                n = 0
                while n < each_down:
                    try:
                        msg = await ms.receive()
                    except P2PError as e:  # a partner lost: the others still measure
                        logger.info("probe download failed: %r", e)
                        return
                    if not isinstance(msg, bytes):
                        ms.reset("probe payload must be bytes")
                        return
                    now = trio.current_time()
                    if n == 0:
                        started.append(now)
                    n += len(msg)
                    arrivals.append((now, len(msg)))
                if not first_done:
                    first_done.append(trio.current_time())

            t1 = trio.current_time()
            asked = []
            for ms in streams:
                try:
                    await ms.send({"down": each_down})
                    asked.append(ms)
                except P2PError as e:
                    logger.info("probe request failed: %r", e)
            async with trio.open_nursery() as phase:
                for ms in asked:
                    phase.start_soon(download, ms)
    # From when every partner's data flowed to when the first one finished: all were sending.
    if not first_done:
        raise ValueError("no probe partner sent everything")
    # (If a slow partner's first message came after a fast one finished, from the request on.)
    begin, end = max(started), first_done[0]
    if begin >= end:
        begin = t1
    meter.record("down", sum(n for t, n in arrivals if begin < t <= end), end - begin, at=end)
    figures = meter.figures()
    logger.info(
        "probed %d peers: up %.3g B/s, down %.3g B/s",
        len(streams),
        figures.upload_bps or 0.0,
        figures.download_bps or 0.0,
    )
    return figures


async def _upload(ms: MessageStream, size: int, payload: bytes) -> float:
    """Send ``size`` probe bytes on ``ms``; the seconds they took to arrive."""
    await ms.send({"up": size})
    answer = await ms.receive()
    if not isinstance(answer, dict) or answer.get("ok") is not True:
        raise ValueError("the partner is busy with another probe")
    t0 = trio.current_time()
    sent = 0
    chunk = _chunk_for(size)
    while sent < size:
        n = min(chunk, size - sent)
        await ms.send(payload[:n])
        sent += n
    reply = await ms.receive()
    if not isinstance(reply, dict) or reply.get("got") != size:
        raise ValueError("a probe partner did not receive everything")
    return _upload_seconds(reply, size, trio.current_time() - t0)


def _upload_seconds(reply: dict, size: int, own: float) -> float:
    """Seconds ``size`` bytes took to upload: the partner's timing of what arrived after its
    first message (which leaves out the round trip), trusted up to twice our own rate (a
    partner could claim anything; our own timing is a lower bound of the rate)."""
    nbytes, seconds = reply.get("bytes"), reply.get("seconds")
    if not (
        isinstance(nbytes, int)
        and isinstance(seconds, float)
        and 0 < nbytes <= size
        and math.isfinite(seconds)
        and seconds > 0
    ):
        return own
    return max(seconds * size / nbytes, own / 2)


async def probe(
    node: Any, peer: PeerID, meter: BandwidthMeter, *, nbytes: int = 4 << 20, timeout: float = 30.0
) -> BandwidthMeter:
    """Probe the links against one peer (see :func:`measure_links`)."""
    await measure_links(node, [peer], meter, nbytes=nbytes, max_peers=1, timeout=timeout)
    return meter
