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
  sent to a couple of peers one after the other, then fetched from several at once (several
  partners together can fill a downlink that each one's uplink alone cannot).

Probe protocol (``PROBE_PROTOCOL``, one stream per partner, any number of transfers): the prober
sends ``{"hold": "down"|"up", "wait": s}``; the partner queues for that direction of its link
(one lock per node and direction, so no two probes share a link, while a partner sending to one
prober still receives from another) up to ``s`` seconds, then answers ``{"busy": True}`` or
``{"held": True, "up_bps": its published uplink}``; then ``{"up": n}`` and n bytes (answered
with the partner's timing) or ``{"down": n}`` (answered with n bytes); n = 0 lets it go.

A downlink wider than the probe partners' uplinks together cannot be measured by them: its
figure is what they sent, published as it is and marked (:meth:`BandwidthMeter.bounded`).

A user-supplied override replaces the measurement in its direction.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
from collections import deque
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import trio

from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.node import Node
from p2p.rpc import CallContext, MessageStream

logger = logging.getLogger(__name__)

PROBE_PROTOCOL = "dedloc/bwprobe/3"
MAX_PROBE_BYTES = 16 << 20
_PROBE_CHUNK = 32 << 10  # small, so that a slow partner's first message arrives early
_SAME_DELIVERY = 1e-4  # seconds: messages read this soon after the first arrived with it


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
    _samples: dict[str, deque[tuple[float, float, bool]]] = field(default_factory=dict)
    _spans: dict[str, list[tuple[float, float, int]]] = field(default_factory=dict)
    _last: dict[str, tuple[float, float, bool]] = field(default_factory=dict)

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
        self,
        direction: str,
        nbytes: int,
        seconds: float,
        *,
        at: float | None = None,
        lower_bound: bool = False,
    ) -> None:
        """Fold one sample: ``nbytes`` moved in ``direction`` over ``seconds`` of busy link.
        ``lower_bound``: the other ends, not this link, may have set the rate."""
        self._check(direction)
        if nbytes <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        rate = nbytes / seconds
        if not math.isfinite(rate):
            return
        now = self._now() if at is None else at
        q = self._samples.setdefault(direction, deque())
        q.append((now, rate, lower_bound))
        self._last[direction] = (now, rate, lower_bound)
        self._expire(direction, now)

    def _expire(self, direction: str, now: float) -> None:
        q = self._samples.get(direction)
        if q and math.isfinite(now):
            while len(q) > 1 and q[0][0] < now - self.window:
                q.popleft()

    def _best(self, direction: str, now: float) -> tuple[float, float, bool] | None:
        """The published sample (time, rate, lower bound): the max over the window; the latest
        sample alone once all expired."""
        self._expire(direction, now)
        q = self._samples.get(direction)
        if not q:
            return None
        fresh = [s for s in q if not math.isfinite(now) or s[0] >= now - self.window]
        if not fresh:
            return self._last[direction]
        return max(fresh, key=lambda s: s[1])

    def _estimate(self, direction: str, now: float) -> tuple[float, float] | None:
        """(rate, age) of the published figure."""
        best = self._best(direction, now)
        if best is None:
            return None
        q = self._samples[direction]
        fresh = [t for t, _, _ in q if not math.isfinite(now) or t >= now - self.window]
        if not fresh:
            t = best[0]
            return best[1], (now - t) if math.isfinite(now) else math.inf
        return best[1], now - max(fresh)  # NaN outside trio: no clock to age it by

    def bounded(self, direction: str, now: float | None = None) -> bool:
        """Whether the published figure of ``direction`` is only a lower bound: its probe's
        partners sent as fast as their published uplinks, so they, not this link, may have set
        the rate (a downlink wider than the partners' uplinks together cannot be measured by
        them), and no measured sample of the window came within 10% of it. Such a figure is
        still the one published: no set of peers moved more."""
        self._check(direction)
        if (self.upload_override if direction == "up" else self.download_override) is not None:
            return False
        now = self._now() if now is None else now
        best = self._best(direction, now)
        if best is None or not best[2]:
            return False
        # A measured sample near the bounded max confirms it (two probes of the same link).
        fresh = [s for s in self._samples[direction] if not s[2] and s[0] >= now - self.window]
        return not any(rate >= 0.9 * best[1] for _, rate, _ in fresh)

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


MAX_QUEUE_WAIT = 30.0
"""Longest a partner queues a probe for its link before answering busy (seconds)."""
MAX_HOLD = 120.0
"""Longest a partner keeps its link held for a prober that has not started its transfer."""
_PARTNER_MARGIN = 1.5
"""Download partners until their published uplinks add up to this times our downlink figure."""
_MAX_TRANSFERS = 64
_BOUND_FRACTION = 0.7
_MIN_SPAN_MESSAGES = 32
"""A download at this fraction of its partners' summed uplinks may be limited by them."""


class LinkLocks:
    """One lock per direction of a node's link, made once per node and shared by the probes it
    answers and those it runs. A probe transfer holds the sender's "up" and the receiver's
    "down" while its bytes flow, so no two probes share a link (each would read the other's
    traffic as a slow link), while a node sending to one prober can still receive from
    another. A partner queues a probe for a while before answering busy; every wait is
    bounded, so probes cannot deadlock, and a prober that did not get its partners retries
    later."""

    def __init__(self) -> None:
        self._locks = {"up": trio.Lock(), "down": trio.Lock()}

    def __getitem__(self, direction: str) -> trio.Lock:
        return self._locks[direction]


def _size(msg: Any, key: str) -> int:
    n = msg.get(key) if isinstance(msg, dict) else None
    if not (isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_PROBE_BYTES):
        raise ValueError("probe size out of range")
    return n


async def _serve_probe(
    locks: LinkLocks, meter: BandwidthMeter | None, ctx: CallContext, ms: MessageStream
) -> None:
    """Other side of a probe: per transfer, a hold of one direction of our link (queued up to
    the prober's ``wait``), then the transfer itself (of nothing when the prober gave up)."""
    transfers = 0
    async for request in ms:
        direction = request.get("hold") if isinstance(request, dict) else None
        wait = request.get("wait") if isinstance(request, dict) else None
        if direction not in ("up", "down") or not isinstance(wait, (int, float)):
            raise ValueError("malformed probe request")
        transfers += 1
        if transfers > _MAX_TRANSFERS:
            raise ValueError("too many probe transfers on one stream")
        lock = locks[direction]
        held = False
        with trio.move_on_after(min(MAX_QUEUE_WAIT, max(0.0, float(wait)))):
            await lock.acquire()
            held = True
        if not held:
            await ms.send({"busy": True})
            continue
        try:
            published = meter.figures().upload_bps if meter is not None else None
            await ms.send({"held": True, "up_bps": published})
            with trio.fail_after(MAX_HOLD):
                ask = await ms.receive()
            if direction == "down":  # the prober uploads to us
                await _receive_upload(ms, _size(ask, "up"))
            else:
                await _send_download(ms, _size(ask, "down"))
        finally:
            lock.release()


async def _receive_upload(ms: MessageStream, up: int) -> None:
    got = after_first = 0
    first = last = trio.current_time()
    while got < up:
        msg = await ms.receive()
        if not isinstance(msg, bytes) or got + len(msg) > up:
            raise ValueError("probe payload must be bytes of the announced size")
        last = trio.current_time()
        if not got:
            first = last
        elif last - first > _SAME_DELIVERY:
            after_first += len(msg)
        got += len(msg)
    # What arrived after the first delivery, over the time it took: the rate without the
    # request's round trip and the first message's latency. Messages read with the first one
    # were on their way before it (one TCP burst, one simulator chunk) and count with it.
    await ms.send({"got": got, "bytes": after_first, "seconds": last - first})


async def _send_download(ms: MessageStream, down: int) -> None:
    chunk = _chunk_for(down)
    payload = os.urandom(chunk)
    sent = 0
    while sent < down:
        n = min(chunk, down - sent)
        await ms.send(payload[:n])
        sent += n


def install_probe(node: Node, locks: LinkLocks, meter: BandwidthMeter | None = None) -> None:
    """Answer other peers' probes, holding ``locks`` (the node's) and telling them our
    published uplink from ``meter`` (once per node)."""
    node.add_stream_handler(PROBE_PROTOCOL, functools.partial(_serve_probe, locks, meter))


class _Partner:
    __slots__ = ("peer", "ms", "failed")

    def __init__(self, peer: PeerID, ms: MessageStream) -> None:
        self.peer, self.ms, self.failed = peer, ms, False


async def _hold(partner: _Partner, direction: str, wait: float) -> dict | None:
    """Ask ``partner`` to hold its link's ``direction`` for us: its answer, None when busy."""
    await partner.ms.send({"hold": direction, "wait": wait})
    answer = await partner.ms.receive()
    if not isinstance(answer, dict) or not (answer.get("held") is True or answer.get("busy")):
        raise ValueError("malformed probe answer")
    return answer if answer.get("held") is True else None


async def _take(
    locks: LinkLocks,
    own: str,
    partners: Sequence[_Partner],
    theirs: str,
    wait: float,
    enough: float | None = None,
) -> tuple[list[tuple[_Partner, dict]], contextlib.ExitStack]:
    """Hold our link's ``own`` direction, then ask every partner at once to hold its
    ``theirs``, each queued up to ``wait``; of those held, keep the widest published uplinks
    until they add up to ``enough`` and let the others go. Returns the partners held (with
    their answers) and a stack that releases our own lock; nothing when our own link stays
    busy for ``wait``. Asked one after the other, each partner held waited for the next ones
    and held up other probes meanwhile."""
    mine = contextlib.ExitStack()
    lock = locks[own]
    got = False
    with trio.move_on_after(wait):
        await lock.acquire()
        got = True
    if not got:
        return [], mine
    mine.callback(lock.release)
    held: list[tuple[_Partner, dict]] = []

    async def ask(partner: _Partner) -> None:
        try:
            answer = await _hold(partner, theirs, wait)
        except (P2PError, ValueError) as e:
            logger.info("probe partner %s failed: %r", partner.peer, e)
            partner.failed = True  # not asked again
            return
        if answer is not None:
            held.append((partner, answer))

    try:
        async with trio.open_nursery() as nursery:
            for partner in partners:
                nursery.start_soon(ask, partner)
        if enough is not None:
            held.sort(key=lambda h: -_up(h[1]))
            total, keep = 0.0, 0
            while keep < len(held) and total < enough:
                total += _up(held[keep][1])
                keep += 1
            await _release(held[keep:], theirs)
            del held[keep:]
    except BaseException:
        mine.close()  # held partners release theirs when our streams close
        raise
    return held, mine


def _up(answer: dict) -> float:
    up = answer.get("up_bps")
    return up if _rate(up) else 0.0


async def _release(held: Sequence[tuple[_Partner, dict]], theirs: str) -> None:
    """Let held partners go: a transfer of nothing."""
    for partner, _ in held:
        try:
            await partner.ms.send({"up" if theirs == "down" else "down": 0})
        except P2PError:
            partner.failed = True


def _rate(x: Any) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


async def measure_links(
    node: Node,
    peers: Sequence[PeerID],
    meter: BandwidthMeter,
    *,
    locks: LinkLocks,
    nbytes: int = 4 << 20,
    max_peers: int = 3,
    upload_peers: int = 2,
    timeout: float = 60.0,
    queue: float = 2.0,
) -> LinkFigures:
    """Probe this peer's links with about ``2 * nbytes`` of traffic and record both rates.

    Upload: ``nbytes`` split among ``upload_peers`` partners, one after the other (each a
    sample: one partner's downlink is usually wider than our uplink). Download: partners send
    ``nbytes`` between them at once, and the rate counts until the first of them finished,
    while all were sending (several uplinks together can fill a downlink none of them fills
    alone); partners are held until their published uplinks add up to 1.5 times our downlink
    figure (all ``max_peers`` while we have none). A partner whose link another probe uses
    queues ours up to ``queue`` seconds, then answers busy; a phase that did not get its
    partners lets go of what it holds and tries again after a random, growing backoff. When
    the download reached the partners' summed uplinks, the figure may be theirs, not ours: it
    is recorded as a lower bound (:meth:`BandwidthMeter.bounded`).
    ``locks``: the node's (those its probe server holds, :func:`install_probe`).
    Raises :class:`ValueError` when no partner answered. Call it when joining a run, or when
    ``meter.stale()``.
    """
    chosen = list(peers)[:max_peers]
    if not chosen:
        raise ValueError("no peer to probe")
    payload = os.urandom(_PROBE_CHUNK)
    rng = random.Random(str(node.peer_id))
    start = trio.current_time()
    with trio.fail_after(timeout):
        async with AsyncExitStack() as streams:
            partners: list[_Partner] = []
            for peer in chosen:
                try:
                    cm = node.open_stream(peer, PROBE_PROTOCOL, timeout=timeout)
                    partners.append(_Partner(peer, await streams.enter_async_context(cm)))
                except Exception as e:  # a partner that cannot be reached is skipped
                    logger.info("probe partner %s unreachable: %r", peer, e)
            if not partners:
                raise ValueError("no probe partner answered")
            uploaders = max(1, min(upload_peers, len(partners)))
            each_up = max(1, min(MAX_PROBE_BYTES, nbytes // uploaders))
            used: set[int] = set()
            backoff = queue
            # The upload goes to the first partners that accept; busy ones are asked again
            # after a random backoff, for up to half the time.
            while len(used) < uploaders and trio.current_time() < start + timeout / 2:
                for i, partner in enumerate(partners):
                    if len(used) >= uploaders or i in used or partner.failed:
                        continue
                    held, own = await _take(locks, "up", [partner], "down", queue)
                    with own:
                        if not held:
                            continue
                        try:
                            seconds = await _upload(partner.ms, each_up, payload)
                        except (P2PError, ValueError) as e:  # this partner is left out
                            logger.info("probe upload failed: %r", e)
                            partner.failed = True
                            continue
                    used.add(i)
                    meter.record("up", each_up, seconds)
                if len(used) >= uploaders or all(p.failed for p in partners):
                    break
                await trio.sleep(rng.uniform(0, backoff))
                backoff = min(2 * backoff, timeout / 8)
            await _measure_download(
                node, locks, partners, meter, nbytes, queue, start + 0.75 * timeout
            )
    figures = meter.figures()
    logger.info(
        "probed %d peers: up %.3g B/s, down %.3g B/s%s",
        len(partners),
        figures.upload_bps or 0.0,
        figures.download_bps or 0.0,
        " (a lower bound)" if meter.bounded("down") else "",
    )
    return figures


async def _measure_download(
    node: Node,
    locks: LinkLocks,
    partners: Sequence[_Partner],
    meter: BandwidthMeter,
    nbytes: int,
    queue: float,
    until: float,
) -> None:
    """Download phases until one measured our downlink rather than the partners' uplinks.

    Each phase holds the partners that are free (queued up to ``queue``) until their
    published uplinks add up to 1.5 times our figure; one that did not get enough lets go of
    them (holding some while waiting for the rest held up every other probe) and tries again
    after a random, growing backoff. A phase whose rate reached its partners' summed uplinks
    (a lower bound) asks for more partners the next time, until the partners we know cannot
    add up to more or ``until``; after that, what we hold goes."""
    rng = random.Random(str(node.peer_id))
    published: dict[int, Any] = {}  # partner index -> its published uplink
    backoff = queue
    down = meter.figures().download_bps
    enough = _PARTNER_MARGIN * down if down else None
    while True:
        candidates = [p for p in partners if not p.failed]
        held, own = await _take(locks, "down", candidates, "up", queue, enough)
        for partner, answer in held:
            published[id(partner)] = answer.get("up_bps")
        total = sum(u for _, a in held if _rate(u := a.get("up_bps")))
        pause = rng.uniform(0, backoff)
        late = trio.current_time() + pause > until
        if held and (late or enough is None or total >= enough or len(held) == len(candidates)):
            with own:
                rate, bound = await _download(held, nbytes)
            if rate is not None:
                meter.record("down", rate[0], rate[1], at=rate[2], lower_bound=bound)
            if rate is None or not bound or late or len(held) == len(candidates):
                return  # measured, out of time, or no partner left to add
            # The partners set the rate: more of them next time, if there are more to have.
            enough = _PARTNER_MARGIN * max(total, meter.figures().download_bps or 0.0)
            known = [published.get(id(p)) for p in partners if not p.failed]
            if all(_rate(u) for u in known) and sum(known) < enough:
                return  # every partner together sends less: the lower bound stands
        else:
            own.close()
            await _release(held, "up")
            if late:
                return
        await trio.sleep(pause)
        backoff = min(2 * backoff, 8 * queue)


async def _download(
    held: Sequence[tuple[_Partner, dict]], nbytes: int
) -> tuple[tuple[int, float, float] | None, bool]:
    """Fetch ``nbytes`` from the held partners at once: (bytes, seconds, end) of the span from
    when all of them were sending to the end (None when none sent everything), and whether
    that rate reached their summed published uplinks, or one published none (then the rate
    may be theirs, a lower bound of ours)."""
    if not held:
        return None, False
    # Shares in proportion to the partners' published uplinks (the mean for one that published
    # none), so that partners that set the pace send for about as long: with equal shares a fast
    # partner finished before a slow one's first bytes came, and the span of all was empty.
    ups = [a.get("up_bps") for _, a in held]
    known = [u for u in ups if _rate(u)]
    mean = sum(known) / len(known) if known else 1.0
    weights = [u if _rate(u) else mean for u in ups]
    shares = [max(1, min(MAX_PROBE_BYTES, int(nbytes * w / sum(weights)))) for w in weights]
    arrivals: list[tuple[float, int, int]] = []  # (time, bytes, stream)
    started: list[float] = []  # per stream, its first message's arrival
    done: list[float] = []  # per stream that sent everything, when it finished

    async def download(ms: MessageStream, each_down: int, k: int) -> None:
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
            arrivals.append((now, len(msg), k))
        done.append(trio.current_time())

    t1 = trio.current_time()
    asked = []
    for (partner, _), share in zip(held, shares, strict=True):
        try:
            await partner.ms.send({"down": share})
            asked.append((partner.ms, share))
        except P2PError as e:
            logger.info("probe request failed: %r", e)
    async with trio.open_nursery() as phase:
        for k, (ms, share) in enumerate(asked):
            phase.start_soon(download, ms, share, k)
    if not done:
        return None, False
    # From when every partner's data flowed to when one of them finished, the best rate over
    # spans of at least 32 messages: until the first finish all send, so our link is filled
    # or all of them are at their limit; after it the rest may not fill it; and a span of a
    # few messages read up to 1.3x the truth. If a partner's first message came after another
    # had finished, from the request on.
    begin = max(started)
    if begin >= min(done):
        begin = t1
    best: tuple[float, int, float] = (-1.0, 0, 0.0)
    # Each stream's first message after ``begin`` was partly on its way before: half of it
    # counts (counted whole, 1 KB messages of 8 partners read a downlink 1.1-1.5x the truth).
    first: dict[int, int] = {}
    for t, n, k in arrivals:
        if t > begin and k not in first:
            first[k] = n
    early = sum(first.values()) // 2
    for end in sorted(done):
        within = [n for t, n, _ in arrivals if begin < t <= end]
        moved = sum(within) - early
        if end > begin and (len(within) >= _MIN_SPAN_MESSAGES or end == max(done)):
            best = (moved / (end - begin), moved, end)
            break
    _, nbytes_in, end = best
    if nbytes_in <= 0:  # no time passed (an instant link): nothing to tell
        return None, False
    # A lower bound unless the partners' published uplinks could have sent clearly more (a
    # partner that published none could have been the limit too).
    bound = len(known) < len(ups) or nbytes_in / (end - begin) >= _BOUND_FRACTION * sum(known)
    return (nbytes_in, end - begin, end), bound


async def _upload(ms: MessageStream, size: int, payload: bytes) -> float:
    """Send ``size`` probe bytes on ``ms`` (held); the seconds they took to arrive."""
    await ms.send({"up": size})
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
    node: Node,
    peer: PeerID,
    meter: BandwidthMeter,
    *,
    locks: LinkLocks,
    nbytes: int = 4 << 20,
    timeout: float = 30.0,
) -> BandwidthMeter:
    """Probe the links against one peer (see :func:`measure_links`)."""
    await measure_links(
        node, [peer], meter, locks=locks, nbytes=nbytes, max_peers=1, timeout=timeout
    )
    return meter
