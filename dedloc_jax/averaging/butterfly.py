"""Butterfly all-reduce of a pytree over p2p message streams, with repair of lost shares.

Roles (see :mod:`.group`): every sender (node or client) dials every reducer that owns a
non-empty share, sends its slice of that share chunk by chunk, and receives the reduced chunks
back on the same stream, so clients only dial out and aux peers never dial. A reducer folds each
arriving chunk into a float32 accumulator (no per-sender buffering), and as soon as a chunk has
every expected contribution it averages, encodes it once and streams the same bytes to every
receiver, using the decoded bytes itself: all members hold identical bits.

Completion: a receiver acks once it holds all chunks of a share; the reducer sends ``commit``
only after every live receiver acked. A member keeps a reducer's values only with a commit, so
if a reducer dies before committing, every survivor holds a prefix of its chunks and all of
them join the repair of that share: the first live reducer after it (cyclic order) becomes the
coordinator, relays the longest prefix any survivor holds, re-reduces the remaining chunks from
the survivors' own vectors, and sends the same float32 values to all of them.

Exclusion is per chunk: a sender that dies, stalls, or sends a malformed or non-finite chunk is
left out from that chunk on; every result chunk carries the set of members it includes.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.rpc import CallContext, MessageStream

from . import wire
from .bandwidth import BandwidthMeter
from .codecs import Codec, get_codec, is_finite
from .config import AllReduceConfig
from .errors import AllReduceError, BadContributionError, CodecError, ShareLostError
from .group import GroupSpec
from .partition import chunk_bounds, flatten, share_bounds, unflatten

logger = logging.getLogger(__name__)

_F32 = np.dtype("<f4")
_FAILURES = (P2PError, BadContributionError, CodecError)


def _is_failure(e: BaseException) -> bool:
    """Whether ``e`` (possibly a group from a nursery) consists only of a peer's failures."""
    if isinstance(e, BaseExceptionGroup):
        return all(_is_failure(x) for x in e.exceptions)
    return isinstance(e, _FAILURES)


# ---- results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShareResult:
    """One share of the result: owner, range, and which members each chunk range includes."""

    owner: str
    start: int
    stop: int
    segments: tuple[tuple[int, int, frozenset[str]], ...]
    repaired: bool

    @property
    def contributors(self) -> frozenset[str]:
        """Members whose contribution is included in the whole share."""
        sets = [s for _, _, s in self.segments]
        return frozenset.intersection(*sets) if sets else frozenset()


@dataclass(frozen=True)
class AllReduceResult:
    """The averaged pytree (``None`` on aux peers), its flat vector, and per-share provenance."""

    average: Any
    vector: np.ndarray | None
    shares: tuple[ShareResult, ...]

    @property
    def contributors(self) -> tuple[frozenset[str], ...]:
        """Per share: the members included in all of it."""
        return tuple(s.contributors for s in self.shares)


# ---- the service a node runs ----------------------------------------------------------------


class AveragingService:
    """Per-node registry of rounds and the two stream handlers of the protocol."""

    def __init__(self, node: Any, config: AllReduceConfig) -> None:
        self.node = node
        self.config = config
        self._rounds: dict[bytes, _Round] = {}
        self._started: dict[bytes, trio.Event] = {}
        self._finished: OrderedDict[bytes, tuple[float, _Round]] = OrderedDict()
        node.add_stream_handler(wire.PROTOCOL, self._handle_exchange)
        node.add_stream_handler(wire.REPAIR_PROTOCOL, self._handle_repair)

    def _open(self, rnd: _Round) -> None:
        if rnd.round_id in self._rounds:
            raise AllReduceError("a round with this id is already running on this node")
        self._rounds[rnd.round_id] = rnd
        self._started.pop(rnd.round_id, trio.Event()).set()

    def _close(self, rnd: _Round) -> None:
        self._rounds.pop(rnd.round_id, None)
        now = trio.current_time()
        self._finished[rnd.round_id] = (now + self.config.linger, rnd)
        while self._finished and (
            len(self._finished) > 4 or next(iter(self._finished.values()))[0] < now
        ):
            self._finished.popitem(last=False)

    async def _find(self, round_id: bytes) -> _Round:
        """The round, waiting (bounded) for it to start here if a peer started it first."""
        if round_id in self._rounds:
            return self._rounds[round_id]
        if round_id in self._finished:
            return self._finished[round_id][1]
        if round_id not in self._started and len(self._started) >= self.config.max_pending_rounds:
            raise BadContributionError("too many announced rounds not started here")
        event = self._started.setdefault(round_id, trio.Event())
        try:
            with trio.move_on_after(self.config.stall_timeout):
                await event.wait()
        finally:
            if not event.is_set() and self._started.get(round_id) is event:
                del self._started[round_id]
        if round_id not in self._rounds:
            raise BadContributionError("unknown round")
        return self._rounds[round_id]

    async def _hello(self, ctx: CallContext, ms: MessageStream) -> tuple[_Round, wire.Hello]:
        with trio.move_on_after(self.config.stall_timeout):
            hello = wire.parse_hello(await ms.receive())
            rnd = await self._find(hello.round_id)
            rnd.check_hello(hello, ctx.remote_peer)
            return rnd, hello
        raise BadContributionError("no hello in time")

    async def _handle_exchange(self, ctx: CallContext, ms: MessageStream) -> None:
        rnd, hello = await self._hello(ctx, ms)
        if rnd.reducer is None or hello.share != -1:
            raise BadContributionError("this member reduces no share")
        await rnd.reducer.serve(hello, ms)

    async def _handle_repair(self, ctx: CallContext, ms: MessageStream) -> None:
        rnd, hello = await self._hello(ctx, ms)
        if hello.share not in rnd.chunks:
            raise BadContributionError(f"bad share {hello.share} to repair")
        await rnd.serve_repair(hello, ms)


_SERVICES: weakref.WeakKeyDictionary[Any, AveragingService] = weakref.WeakKeyDictionary()


def install(node: Any, config: AllReduceConfig | None = None) -> AveragingService:
    """Register the all-reduce handlers on ``node`` (idempotent). Do it before any round starts:
    a peer may dial us as soon as it starts its own side of the round."""
    service = _SERVICES.get(node)
    if service is None:
        service = AveragingService(node, config or AllReduceConfig())
        _SERVICES[node] = service
    return service


# ---- one round ------------------------------------------------------------------------------


class _Changes:
    """A broadcast "something changed" signal for tasks that re-check a condition."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self, until: float) -> bool:
        """Wait for a change until ``until``; True if one happened."""
        event = self._event
        with trio.move_on_at(until):
            await event.wait()
        return event.is_set()


class _Round:
    """State of one all-reduce round on one member (sender, reducer and repair roles)."""

    def __init__(
        self,
        service: AveragingService,
        spec: GroupSpec,
        me: int,
        vec: np.ndarray | None,
        weight: float,
        codec: Codec,
        config: AllReduceConfig,
        round_id: bytes,
        timeout: float,
        meter: BandwidthMeter | None,
    ) -> None:
        self.service, self.node, self.spec, self.me = service, service.node, spec, me
        self.codec, self.config, self.round_id, self.meter = codec, config, round_id, meter
        self.members = spec.members
        self.senders = frozenset(spec.senders)
        self.is_sender = self.members[me].sends
        self.vec = vec
        self.size = int(vec.size) if vec is not None else 0
        self.weight = float(weight)
        self.abstain = (
            (not self.is_sender) or self.weight <= 0 or (vec is not None and not is_finite(vec))
        )
        self.bounds = share_bounds(self.size, spec.share_parts())
        self.reducers = [j for j in range(len(self.members)) if self.bounds[j + 1] > self.bounds[j]]
        self.chunks = {
            j: chunk_bounds(self.bounds[j + 1] - self.bounds[j], config.chunk_elems)
            for j in self.reducers
        }
        self.out = np.zeros(self.size, np.float32) if self.is_sender else None
        self.held = dict.fromkeys(self.reducers, 0)
        self.masks: dict[int, list[frozenset[int]]] = {j: [] for j in self.reducers}
        self.settled = {j: trio.Event() for j in self.reducers}
        self.ok = dict.fromkeys(self.reducers, False)
        self.repaired: set[int] = set()
        self.failed_peers: set[int] = set()
        self.repairs: dict[int, _Repair] = {}
        t0 = trio.current_time()
        self.deadline = t0 + timeout
        self.collect_at = t0 + config.collect_fraction * timeout
        self.exchange_at = t0 + config.exchange_fraction * timeout
        self.join_at = t0 + config.join_fraction * timeout
        self.data_at = t0 + config.data_fraction * timeout
        self.reducer = _Reducer(self) if me in self.chunks else None
        self.traffic = {"up": [0, math.inf, -math.inf], "down": [0, math.inf, -math.inf]}

    # -- helpers ------------------------------------------------------------------------------
    def name(self, i: int) -> str:
        return self.members[i].peer_id

    def share_slice(self, j: int, k: int) -> tuple[int, int]:
        a, b = self.chunks[j][k]
        return self.bounds[j] + a, self.bounds[j] + b

    def count(self, direction: str, nbytes: int) -> None:
        rec = self.traffic[direction]
        now = trio.current_time()
        rec[0] += nbytes
        rec[1] = min(rec[1], now)
        rec[2] = max(rec[2], now)

    def hello(self, share: int = -1) -> wire.Hello:
        return wire.Hello(
            self.round_id,
            self.spec.digest,
            self.me,
            0.0 if self.abstain else self.weight,
            self.size,
            self.codec.name,
            self.abstain,
            share,
            self.held.get(share, 0) if share >= 0 else 0,
        )

    def check_hello(self, h: wire.Hello, remote: PeerID) -> None:
        """Reject a stream whose opener is not who it claims or disagrees on the round."""
        if h.digest != self.spec.digest:
            raise BadContributionError("group spec digest differs")
        if not 0 <= h.sender < len(self.members) or self.name(h.sender) != str(remote):
            raise BadContributionError(f"{remote} claims to be member {h.sender}")
        if not self.members[h.sender].sends:
            raise BadContributionError(f"{remote} is an aux peer and sends nothing")
        if h.size != self.size or h.codec != self.codec.name:
            raise BadContributionError(
                f"{remote}: vector of {h.size} values in {h.codec}, expected {self.size} in "
                f"{self.codec.name}"
            )

    # -- the local side -------------------------------------------------------------------------
    async def run(self) -> None:
        with trio.move_on_at(self.deadline):
            async with trio.open_nursery() as nursery:
                if self.reducer is not None:
                    nursery.start_soon(self.reducer.run)
                if self.is_sender:
                    for j in self.reducers:
                        if j != self.me:
                            nursery.start_soon(self._exchange, j)
                        nursery.start_soon(self._settle, j)

    async def _settle(self, j: int) -> None:
        await self.settled[j].wait()
        if not self.ok[j]:
            await self._repair(j)

    async def _exchange(self, j: int) -> None:
        ok = False
        try:
            with trio.move_on_at(self.exchange_at):
                peer = PeerID.from_base58(self.name(j))
                async with self.node.open_stream(
                    peer, wire.PROTOCOL, timeout=self.config.stall_timeout
                ) as ms:
                    await ms.send(wire.hello(self.hello()))
                    async with trio.open_nursery() as inner:
                        if not self.abstain:
                            inner.start_soon(self._send_parts, ms, j)
                        ok = await self._receive_results(ms, j)
                        inner.cancel_scope.cancel()
            if not ok:
                logger.warning("reducer %s stalled or stopped before committing", self.name(j))
        except BaseException as e:
            if not _is_failure(e):
                raise
            logger.warning("exchange with reducer %s failed: %r", self.name(j), e)
        finally:
            if not ok:
                self.failed_peers.add(j)
            self.ok[j] = ok
            self.settled[j].set()

    async def _send_parts(self, ms: MessageStream, j: int) -> None:
        assert self.vec is not None
        try:
            for k in range(len(self.chunks[j])):
                a, b = self.share_slice(j, k)
                data = self.codec.encode(self.vec[a:b])
                await ms.send(wire.part(k, data))
                self.count("up", len(data))
        except P2PError as e:  # the receiving side sees the same failure and reports it
            logger.debug("sending to %s stopped: %s", self.name(j), e)

    async def _receive_results(self, ms: MessageStream, j: int) -> bool:
        assert self.out is not None
        n_chunks = len(self.chunks[j])
        while True:
            with trio.move_on_after(2 * self.config.stall_timeout) as scope:
                msg = await ms.receive()
            if scope.cancelled_caught:
                return False
            kind = wire.kind_of(msg)
            if kind == "hb":
                continue
            if kind == "commit":
                return self.held[j] == n_chunks
            if kind != "res" or self.held[j] >= n_chunks:
                raise BadContributionError(f"unexpected {kind!r} from reducer {self.name(j)}")
            k = self.held[j]
            a, b = self.share_slice(j, k)
            data = wire.parse_chunk(msg, k, self.codec.encoded_size(b - a))
            mask = wire.parse_contributors(msg, self.senders)
            self.codec.decode_into(data, self.out[a:b])
            if not is_finite(self.out[a:b]):
                raise BadContributionError("non-finite result")
            self.count("down", len(data))
            self.masks[j].append(mask)
            self.held[j] = k + 1
            if k + 1 == n_chunks:
                await ms.send(wire.simple("ack"))

    # -- repair (participant side) ------------------------------------------------------------
    def coordinators(self, j: int) -> list[int]:
        """Candidate coordinators for share ``j``: the reducers after it, in cyclic order."""
        pos = self.reducers.index(j)
        return [c for c in self.reducers[pos + 1 :] + self.reducers[:pos]]

    async def _repair(self, j: int) -> None:
        for c in self.coordinators(j):
            if c in self.failed_peers:
                continue
            try:
                if c == self.me:
                    ok = await self._coordinate(j)
                else:
                    ok = await self._request_repair(c, j)
            except _FAILURES as e:
                logger.warning("repair of share %d via %s failed: %s", j, self.name(c), e)
                self.failed_peers.add(c)
                continue
            if ok:
                self.ok[j] = True
                self.repaired.add(j)
            return

    async def _request_repair(self, c: int, j: int) -> bool:
        assert self.out is not None
        n_chunks = len(self.chunks[j])
        peer = PeerID.from_base58(self.name(c))
        with trio.move_on_at(self.deadline):
            async with self.node.open_stream(
                peer, wire.REPAIR_PROTOCOL, timeout=self.config.stall_timeout
            ) as ms:
                await ms.send(wire.hello(self.hello(share=j)))
                held_rng, parts_rng = wire.parse_need(await ms.receive(), n_chunks)
                for k in range(*held_rng):
                    if k >= self.held[j]:
                        raise BadContributionError("coordinator asked for chunks we do not hold")
                    a, b = self.share_slice(j, k)
                    await ms.send(wire.result(k, self.out[a:b].tobytes(), self.masks[j][k], "held"))
                if not self.abstain:
                    assert self.vec is not None
                    for k in range(*parts_rng):
                        a, b = self.share_slice(j, k)
                        await ms.send(wire.part(k, self.codec.encode(self.vec[a:b])))
                await ms.send(wire.simple("done"))
                values, masks = await _receive_finals(ms, self, j)
                a, b = self.bounds[j], self.bounds[j + 1]
                self.out[a:b] = values
                self.masks[j] = masks
                self.held[j] = n_chunks
                return True
        return False

    async def _coordinate(self, j: int) -> bool:
        """Repair share ``j`` as its coordinator, being a participant ourselves."""
        if self.held[j] == len(self.chunks[j]):
            return True  # we hold all of it: those who lack it get our copy
        rep = self.repair(j)
        async with trio.open_nursery() as nursery:
            if rep.claim():
                nursery.start_soon(rep.drive)
            await rep.ready.wait()
        if rep.values is None:
            return False
        assert self.out is not None
        self.out[self.bounds[j] : self.bounds[j + 1]] = rep.values
        self.masks[j] = list(rep.masks)
        self.held[j] = len(self.chunks[j])
        return True

    def repair(self, j: int) -> _Repair:
        if j not in self.repairs:
            self.repairs[j] = _Repair(self, j)
        return self.repairs[j]

    # -- repair (coordinator side, serving a participant) -------------------------------------
    async def serve_repair(self, h: wire.Hello, ms: MessageStream) -> None:
        j, n_chunks = h.share, len(self.chunks[h.share])
        if not 0 <= h.held <= n_chunks:
            raise BadContributionError("bad held count")
        if self.is_sender and j in self.settled:
            with trio.move_on_at(self.deadline):
                await self.settled[j].wait()
        if self.is_sender and self.held[j] == n_chunks and j not in self.repairs:
            await ms.send(wire.need((0, 0), (0, 0)))
            await _expect_done(ms)
            assert self.out is not None
            a, b = self.bounds[j], self.bounds[j + 1]
            await _send_finals(ms, self, j, self.out[a:b], self.masks[j])
            return
        rep = self.repair(j)
        async with trio.open_nursery() as nursery:
            if rep.claim():
                nursery.start_soon(rep.drive)  # runs to its end even if this participant fails
            try:
                await rep.serve(h, ms)
            except _FAILURES as e:
                logger.warning("repair participant %s failed: %s", self.name(h.sender), e)


class _Reducer:
    """The reducer role: accumulate parts, finalise chunks in order, stream them back."""

    def __init__(self, rnd: _Round) -> None:
        self.r = rnd
        j = rnd.me
        self.start = rnd.bounds[j]
        self.chunks = rnd.chunks[j]
        n = len(self.chunks)
        self.acc = np.zeros(rnd.bounds[j + 1] - self.start, np.float32)
        self.scratch = np.empty(max((b - a for a, b in self.chunks), default=0), np.float32)
        self.wsum = np.zeros(n, np.float64)
        self.cmask: list[set[int]] = [set() for _ in range(n)]
        self.expected = {s for s in rnd.senders if s != j}
        self.receivers = set(self.expected)
        self.initial_receivers = frozenset(self.receivers)
        self.weights: dict[int, float] = {}
        self.next_k: dict[int, int] = {}
        t0 = trio.current_time()
        self.last = dict.fromkeys(self.expected, t0)
        self.seen: set[int] = set()
        self.acked: set[int] = set()
        self.dead: set[int] = set()
        self.done = 0
        self.enc: list[bytes] = []
        self.final_masks: list[frozenset[int]] = []
        self.commit: frozenset[int] | None = None
        self.last_sent: dict[int, float] = {}
        self.sent_all_at: dict[int, float] = {}
        self.changes = _Changes()
        if rnd.is_sender and not rnd.abstain:
            assert rnd.vec is not None
            self.acc[:] = rnd.vec[self.start : rnd.bounds[j + 1]] * np.float32(rnd.weight)
            self.wsum[:] = rnd.weight
            for m in self.cmask:
                m.add(j)

    def exclude(self, s: int, why: str) -> None:
        if s in self.expected:
            self.expected.discard(s)
            logger.warning(
                "round %s: excluding %s from chunk %d on: %s",
                self.r.round_id.hex()[:8],
                self.r.name(s),
                self.next_k.get(s, 0),
                why,
            )
        if s not in self.seen:
            self.receivers.discard(s)
        self.changes.notify()

    def _died(self, s: int, why: str) -> None:
        self.dead.add(s)
        self.exclude(s, why)
        self.receivers.discard(s)
        self.changes.notify()

    async def run(self) -> None:
        r, stall = self.r, self.r.config.stall_timeout
        for k in range(len(self.chunks)):
            while True:
                missing = [s for s in self.expected if self.next_k.get(s, 0) <= k]
                if not missing:
                    break
                now = trio.current_time()
                if now >= r.collect_at:
                    for s in missing:
                        self.exclude(s, "collection deadline passed")
                    break
                stalled = [s for s in missing if now >= self.last[s] + stall]
                for s in stalled:
                    self.exclude(s, f"no progress for {stall} s")
                if not stalled:
                    await self.changes.wait(
                        min([r.collect_at] + [self.last[s] + stall for s in missing])
                    )
            self._finalise(k)
        # Commit once every live receiver acked; drop receivers that stop making progress.
        while not self.receivers <= self.acked:
            now = trio.current_time()
            if now >= r.exchange_at:
                break
            waiting = self.receivers - self.acked
            due = {s: self._progress_due(s) for s in waiting}
            laggards = [s for s, t in due.items() if now >= t]
            for s in laggards:
                logger.warning(
                    "round %s: receiver %s made no progress; not waiting for its ack",
                    r.round_id.hex()[:8],
                    r.name(s),
                )
                self.receivers.discard(s)
            if not laggards:
                await self.changes.wait(min([r.exchange_at, *due.values()]))
        self.commit = frozenset(self.acked & self.receivers)
        self.changes.notify()
        # Keeping our own share is safe only if someone else holds it too; otherwise we repair
        # it like any receiver would (and relay our copy if we can).
        r.ok[r.me] = bool(self.commit) or not self.initial_receivers
        if not r.ok[r.me]:
            logger.warning("round %s: nobody acked our share; repairing it", r.round_id.hex()[:8])
        r.settled[r.me].set()

    def _progress_due(self, s: int) -> float:
        """When receiver ``s`` counts as stalled: no send to it completed, or no ack after all."""
        stall = self.r.config.stall_timeout
        last = self.last_sent.get(s, self.last.get(s, self.r.deadline))
        done = self.sent_all_at.get(s)
        return min(last + stall, done + stall) if done is not None else last + stall

    def _finalise(self, k: int) -> None:
        r = self.r
        a, b = self.chunks[k]
        avg = self.acc[a:b]  # averaged in place: the accumulator of this chunk is done
        if self.wsum[k] > 0:
            np.divide(avg, np.float32(self.wsum[k]), out=avg)
        data = r.codec.encode(avg)
        if not r.codec.lossless:
            r.codec.decode_into(data, avg)  # use exactly what the receivers will decode
        mask = frozenset(self.cmask[k])
        self.enc.append(data)
        self.final_masks.append(mask)
        if r.out is not None:
            r.out[self.start + a : self.start + b] = avg
            r.masks[r.me].append(mask)
            r.held[r.me] = k + 1
        self.done = k + 1
        self.changes.notify()

    async def serve(self, h: wire.Hello, ms: MessageStream) -> None:
        s = h.sender
        if s in self.seen or s not in self.receivers:
            raise BadContributionError(f"{self.r.name(s)} connected twice or too late")
        self.seen.add(s)
        self.weights[s] = h.weight
        self.last[s] = trio.current_time()
        if h.abstain or h.weight <= 0:
            self.exclude(s, "abstains (no or non-finite contribution)")
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_results, s, ms)
                await self._receive_parts(s, ms)
                if s not in self.acked or s in self.dead:
                    nursery.cancel_scope.cancel()
        finally:  # also when the connection's death cancels this handler
            if s not in self.acked:
                self._died(s, "stream ended before its ack")

    async def _receive_parts(self, s: int, ms: MessageStream) -> None:
        r = self.r
        try:
            with trio.move_on_at(r.deadline):
                while True:
                    msg = await ms.receive()
                    kind = wire.kind_of(msg)
                    if kind == "ack":
                        if self.done < len(self.chunks):
                            raise BadContributionError("ack before all results were sent")
                        self.acked.add(s)
                        self.changes.notify()
                    elif kind == "part":
                        self._accept_part(s, msg)
                    else:
                        raise BadContributionError(f"unexpected {kind!r}")
        except P2PError as e:
            if s not in self.acked:
                self._died(s, f"stream ended: {e}")
        except (BadContributionError, CodecError) as e:
            self._died(s, f"protocol violation: {e}")
            ms.reset("protocol violation")

    def _accept_part(self, s: int, msg: Any) -> None:
        k = self.next_k.get(s, 0)
        if k >= len(self.chunks):
            raise BadContributionError("more parts than chunks")
        self.next_k[s] = k + 1
        self.last[s] = trio.current_time()
        if s not in self.expected:
            return  # excluded earlier: its late parts are ignored
        a, b = self.chunks[k]
        scratch = self.scratch[: b - a]
        try:
            data = wire.parse_chunk(msg, k, self.r.codec.encoded_size(b - a))
            values = self.r.codec.decode_view(data, scratch)  # no copy when lossless
        except (BadContributionError, CodecError) as e:
            self.exclude(s, f"malformed chunk {k}: {e}")
            return
        if not is_finite(values):
            self.exclude(s, f"non-finite values in chunk {k}")
            return
        w = self.weights[s]
        if w != 1.0:
            values = np.multiply(values, np.float32(w), out=scratch)
        self.acc[a:b] += values
        self.wsum[k] += w
        self.cmask[k].add(s)
        self.r.count("down", len(data))
        self.changes.notify()

    async def _send_results(self, s: int, ms: MessageStream) -> None:
        try:
            await self._send_results_to(s, ms)
        except P2PError as e:
            self._died(s, f"sending results failed: {e}")

    async def _send_results_to(self, s: int, ms: MessageStream) -> None:
        r = self.r
        heartbeat = r.config.stall_timeout / 3
        k = 0
        while True:
            while k < self.done:
                await ms.send(wire.result(k, self.enc[k], self.final_masks[k]))
                r.count("up", len(self.enc[k]))
                k += 1
                self.last_sent[s] = trio.current_time()
                if k == len(self.chunks):
                    self.sent_all_at[s] = self.last_sent[s]
                    self.changes.notify()
            if self.commit is not None and k == self.done == len(self.chunks):
                break
            if s not in self.receivers:
                return
            if not await self.changes.wait(trio.current_time() + heartbeat):
                await ms.send(wire.simple("hb"))
                self.last_sent[s] = trio.current_time()
        if s in self.commit:
            await ms.send(wire.simple("commit"))
        else:
            ms.reset("no ack in time")


class _Repair:
    """Coordinator state for re-reducing one lost share from the survivors."""

    def __init__(self, rnd: _Round, j: int) -> None:
        self.r, self.j = rnd, j
        self.n_chunks = len(rnd.chunks[j])
        self.length = rnd.bounds[j + 1] - rnd.bounds[j]
        self.joined: dict[int, wire.Hello] = {}
        self.delivered: set[int] = set()
        self.plan: tuple[int, int, int] | None = None  # (holder, relay from, prefix H)
        self.acc = np.zeros(self.length, np.float32)
        self.wsum = np.zeros(self.n_chunks, np.float64)
        self.cmask: list[set[int]] = [set() for _ in range(self.n_chunks)]
        self.base = np.zeros(self.length, np.float32)  # relayed prefix values
        self.base_masks: list[frozenset[int] | None] = [None] * self.n_chunks
        self.values: np.ndarray | None = None
        self.masks: tuple[frozenset[int], ...] = ()
        self.changes = _Changes()
        self.planned = trio.Event()
        self.ready = trio.Event()
        self._claimed = False

    def claim(self) -> bool:
        first = not self._claimed
        self._claimed = True
        return first

    def _own_held(self) -> int:
        return self.r.held.get(self.j, 0) if self.r.is_sender else 0

    async def drive(self) -> None:
        r, j = self.r, self.j
        try:
            dead = r.reducer.dead if r.reducer is not None else set()
            expected = set(r.senders) - {j, r.me} - dead
            while not expected <= set(self.joined) and trio.current_time() < r.join_at:
                await self.changes.wait(r.join_at)
            if not self.joined:  # alone we could only make up a private value: refuse
                logger.warning("repair of share %d: no other member joined; giving up", j)
                return
            held = {s: h.held for s, h in self.joined.items()}
            own = self._own_held()
            if r.is_sender:
                held[r.me] = own
            prefix = max(held.values(), default=0)
            holder = (
                min((s for s, v in held.items() if v == prefix), key=lambda s: (s != r.me, s))
                if held
                else r.me
            )
            relay_from = own if holder != r.me else prefix
            self.plan = (holder, relay_from, prefix)
            if r.out is not None:
                a = r.bounds[j]
                for k in range(min(own, prefix)):
                    x, y = r.chunks[j][k]
                    self.base[x:y] = r.out[a + x : a + y]
                    self.base_masks[k] = r.masks[j][k]
            if r.is_sender and not r.abstain:
                assert r.vec is not None
                for k in range(prefix, self.n_chunks):
                    x, y = r.chunks[j][k]
                    self.acc[x:y] = r.vec[r.bounds[j] + x : r.bounds[j] + y] * np.float32(r.weight)
                    self.wsum[k] = r.weight
                    self.cmask[k].add(r.me)
            self.planned.set()
            while not set(self.joined) <= self.delivered and trio.current_time() < r.data_at:
                await self.changes.wait(r.data_at)
            if any(m is None for m in self.base_masks[:prefix]):
                logger.warning("repair of share %d: the holder of its prefix did not deliver", j)
                return
            values = self.base.copy()
            masks = list(self.base_masks[:prefix])
            for k in range(prefix, self.n_chunks):
                x, y = r.chunks[j][k]
                total = np.float32(self.wsum[k]) if self.wsum[k] > 0 else np.float32(1)
                avg = self.acc[x:y] / total
                data = r.codec.encode(avg.astype(np.float32, copy=False))
                values[x:y] = r.codec.decode(data, y - x)
                masks.append(frozenset(self.cmask[k]))
            self.values, self.masks = values, tuple(masks)
        finally:
            self.planned.set()
            self.ready.set()

    async def serve(self, h: wire.Hello, ms: MessageStream) -> None:
        s, r = h.sender, self.r
        if self.plan is None and s not in self.joined:
            self.joined[s] = h
            self.changes.notify()
        await self.planned.wait()
        if self.plan is None or s not in self.joined:  # failed, or a latecomer: send finals only
            await ms.send(wire.need((0, 0), (0, 0)))
            await _expect_done(ms)
        else:
            holder, relay_from, prefix = self.plan
            relay = (relay_from, prefix) if s == holder else (0, 0)
            parts = (prefix, self.n_chunks) if not h.abstain and h.weight > 0 else (0, 0)
            await ms.send(wire.need(relay, parts))
            with trio.move_on_at(r.data_at):
                await self._receive_data(s, h, ms, relay, parts)
                self.delivered.add(s)
                self.changes.notify()
        await self.ready.wait()
        if self.values is None:
            await ms.send(wire.simple("err", e="share could not be repaired"))
            return
        await _send_finals(ms, r, self.j, self.values, self.masks)

    async def _receive_data(
        self,
        s: int,
        h: wire.Hello,
        ms: MessageStream,
        relay: tuple[int, int],
        parts: tuple[int, int],
    ) -> None:
        r, j = self.r, self.j
        for k in range(*relay):
            x, y = r.chunks[j][k]
            msg = await ms.receive()
            if wire.kind_of(msg) != "held":
                raise BadContributionError("expected held chunk")
            data = wire.parse_chunk(msg, k, 4 * (y - x))
            mask = wire.parse_contributors(msg, r.senders)
            values = np.frombuffer(data, _F32).astype(np.float32)
            if not is_finite(values):
                raise BadContributionError("non-finite relayed chunk")
            self.base[x:y] = values
            self.base_masks[k] = mask
        for k in range(*parts):
            x, y = r.chunks[j][k]
            msg = await ms.receive()
            if wire.kind_of(msg) != "part":
                raise BadContributionError("expected part")
            data = wire.parse_chunk(msg, k, r.codec.encoded_size(y - x))
            values = r.codec.decode(data, y - x)
            if not is_finite(values):
                logger.warning("repair: non-finite chunk %d from %s excluded", k, r.name(s))
                continue
            if self.ready.is_set():
                return
            self.acc[x:y] += values * np.float32(h.weight)
            self.wsum[k] += h.weight
            self.cmask[k].add(s)
        await _expect_done(ms)


async def _expect_done(ms: MessageStream) -> None:
    if wire.kind_of(await ms.receive()) != "done":
        raise BadContributionError("expected done")


async def _send_finals(
    ms: MessageStream, r: _Round, j: int, values: np.ndarray, masks: Sequence[frozenset[int]]
) -> None:
    for k, (x, y) in enumerate(r.chunks[j]):
        await ms.send(wire.result(k, values[x:y].astype(_F32).tobytes(), masks[k], "final"))
    await ms.send(wire.simple("end"))


async def _receive_finals(
    ms: MessageStream, r: _Round, j: int
) -> tuple[np.ndarray, list[frozenset[int]]]:
    values = np.zeros(r.bounds[j + 1] - r.bounds[j], np.float32)
    masks = []
    for k, (x, y) in enumerate(r.chunks[j]):
        msg = await ms.receive()
        if wire.kind_of(msg) == "err":
            raise ShareLostError(f"coordinator could not repair share {j}", shares=(j,))
        data = wire.parse_chunk(msg, k, 4 * (y - x))
        chunk = np.frombuffer(data, _F32).astype(np.float32)
        if not is_finite(chunk):
            raise BadContributionError("non-finite repaired chunk")
        values[x:y] = chunk
        masks.append(wire.parse_contributors(msg, r.senders))
    if wire.kind_of(await ms.receive()) != "end":
        raise BadContributionError("expected end")
    return values, masks


# ---- entry point ----------------------------------------------------------------------------


async def all_reduce(
    node: Any,
    group: GroupSpec,
    tree: Any,
    weight: float | None = None,
    *,
    codec: str | Codec = "fp16",
    timeout: float = 120.0,
    round_id: bytes | None = None,
    config: AllReduceConfig | None = None,
    meter: BandwidthMeter | None = None,
) -> AllReduceResult:
    """Average ``tree`` (weighted by ``weight``, default the member's weight in ``group``) with
    the other members of ``group``; returns within ``timeout`` seconds.

    Aux members pass a template tree of the right shapes (its values are ignored) and get
    ``average=None``. Raises :class:`ShareLostError` if some share could neither be received nor
    repaired in time, and :class:`AllReduceError` if no contribution at all was averaged.
    ``round_id`` defaults to the group's digest (a new group per round).
    """
    service = install(node, config)
    cfg = config or service.config
    me = group.index_of(node.peer_id)
    member = group.members[me]
    codec_ = get_codec(codec) if isinstance(codec, str) else codec
    vec, spec = flatten(tree)
    w = member.weight if weight is None else float(weight)
    if not math.isfinite(w) or w < 0:
        raise ValueError(f"weight must be finite and >= 0, got {weight!r}")
    if not is_finite(vec) and member.sends:
        logger.warning("round: local contribution has non-finite values; abstaining")
    rnd = _Round(
        service,
        group,
        me,
        vec,
        w,
        codec_,
        cfg,
        round_id if round_id is not None else group.digest,
        timeout,
        meter,
    )
    if not member.sends:
        rnd.vec = None
    service._open(rnd)
    try:
        await rnd.run()
    finally:
        service._close(rnd)
    if meter is not None:
        for direction, (nbytes, first, last) in rnd.traffic.items():
            if nbytes and last > first:
                meter.record(direction, nbytes, last - first)
    if not member.sends:
        return AllReduceResult(None, None, ())
    missing = tuple(j for j in rnd.reducers if not rnd.ok[j])
    if missing:
        raise ShareLostError(
            f"shares {[group.members[j].peer_id for j in missing]} were lost", shares=missing
        )
    shares = []
    for j in rnd.reducers:
        segments = []
        for k, mask in enumerate(rnd.masks[j]):
            a, b = rnd.share_slice(j, k)
            names = frozenset(rnd.name(i) for i in mask)
            if not names:
                raise AllReduceError(f"nothing was averaged for values {a}..{b}")
            if segments and segments[-1][2] == names and segments[-1][1] == a:
                segments[-1] = (segments[-1][0], b, names)
            else:
                segments.append((a, b, names))
        shares.append(
            ShareResult(
                rnd.name(j), rnd.bounds[j], rnd.bounds[j + 1], tuple(segments), j in rnd.repaired
            )
        )
    assert rnd.out is not None
    return AllReduceResult(unflatten(rnd.out, spec), rnd.out, tuple(shares))
