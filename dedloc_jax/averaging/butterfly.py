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

import hashlib
import logging
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import trio

from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.node import Node
from p2p.rpc import CallContext, MessageStream

from . import audit, wire
from .allreduce_plan import AllReducePlan, Holdings
from .audit import Accusation
from .bandwidth import BandwidthMeter, Gauge
from .changes import Changes
from .chunk_codecs import Codec, is_finite
from .config import AllReduceConfig
from .errors import FAILURES, AllReduceError, BadContributionError, ShareLostError, is_failure
from .group import GroupSpec
from .leaf_codecs import LeafCodecs
from .partition import flatten, unflatten
from .reducer import Reducer
from .repair import Repair, expect_done, receive_finals, send_finals
from .verify import NO_HASH, Statement, make_hello, parse_signed_hello
from .weighing import kept_of

logger = logging.getLogger(__name__)

# ---- results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShareResult:
    """One share of the result: owner, range, and which members each chunk range includes."""

    owner: str
    start: int
    stop: int
    segments: tuple[tuple[int, int, frozenset[str]], ...]
    repaired: bool
    dropped: bool = False
    """Its result failed the group's check (:mod:`.audit`) and could not be recomputed: every
    member holds zeros there."""
    recomputed: bool = False
    """Its result failed the group's check: every member recomputed it from the revealed
    parts without the convicted peer's (:mod:`.audit`)."""

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
    accusations: tuple[Accusation, ...] = ()
    """Peers this member caught lying in the round, with evidence (verified rounds only)."""
    kept: Mapping[str, float] = field(default_factory=dict)
    """Per sender, the fraction of its values the aggregate weighed (verified rounds only:
    :func:`.weighing.kept_fractions`; empty otherwise)."""

    @property
    def contributors(self) -> tuple[frozenset[str], ...]:
        """Per share: the members included in all of it."""
        return tuple(s.contributors for s in self.shares)


# ---- the service a node runs ----------------------------------------------------------------


class AveragingService:
    """A node's all-reduce: its rounds and the stream handlers of the protocol, registered on
    construction (once per node, before any round starts: a peer may dial us as soon as it
    starts its own side of the round). ``config``: the rounds' settings unless a round passes
    its own; ``admit(peer)``, awaited before serving any stream, raises unless the peer may take
    part (a private run's :meth:`~dedloc_jax.access.AccessGuard.admit`; None: anyone)."""

    def __init__(
        self,
        node: Node,
        config: AllReduceConfig = AllReduceConfig(),
        *,
        admit: Callable[[PeerID], Awaitable[None]] | None = None,
    ) -> None:
        self.node = node
        self.config = config
        self._rounds: dict[bytes, AllReduceState] = {}
        self._started: dict[bytes, trio.Event] = {}
        self._finished: OrderedDict[bytes, tuple[float, AllReduceState]] = OrderedDict()
        self._admit = admit
        node.add_stream_handler(wire.PROTOCOL, self._handle_exchange)
        node.add_stream_handler(wire.REPAIR_PROTOCOL, self._handle_repair)
        node.add_stream_handler(audit.VERIFY_PROTOCOL, self._handle_verify)
        node.add_handler(audit.STATEMENT_PROTOCOL, self._handle_statement)

    def _open(self, rnd: AllReduceState) -> None:
        if rnd.round_id in self._rounds:
            raise AllReduceError("a round with this id is already running on this node")
        self._rounds[rnd.round_id] = rnd
        self._started.pop(rnd.round_id, trio.Event()).set()

    def _close(self, rnd: AllReduceState) -> None:
        self._rounds.pop(rnd.round_id, None)
        rnd.finish()
        now = trio.current_time()
        self._finished[rnd.round_id] = (now + self.config.linger, rnd)
        while self._finished and (
            len(self._finished) > 2 or next(iter(self._finished.values()))[0] < now
        ):
            self._finished.popitem(last=False)

    async def _find(self, round_id: bytes) -> AllReduceState:
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

    async def _hello(
        self, ctx: CallContext, ms: MessageStream
    ) -> tuple[AllReduceState, wire.Hello]:
        if self._admit is not None:
            await self._admit(ctx.remote_peer)
        with trio.move_on_after(self.config.stall_timeout):
            hello = wire.parse_hello(await ms.receive())
            rnd = await self._find(hello.round_id)
            return rnd, rnd.check_hello(hello, ctx.remote_peer)
        raise BadContributionError("no hello in time")

    async def _handle_exchange(self, ctx: CallContext, ms: MessageStream) -> None:
        rnd, hello = await self._hello(ctx, ms)
        if rnd.reducer is None or hello.share != -1:
            raise BadContributionError("this member reduces no share")
        await rnd.reducer.serve(hello, ms)

    async def _handle_verify(self, ctx: CallContext, ms: MessageStream) -> None:
        if self._admit is not None:
            await self._admit(ctx.remote_peer)
        with trio.move_on_after(self.config.stall_timeout):
            msg = await ms.receive()
            if not isinstance(msg, dict) or not isinstance(msg.get("r"), bytes):
                raise BadContributionError("expected a verify hello")
            rnd = await self._find(msg["r"])
            if not rnd.is_sender:
                raise BadContributionError("this member holds no result to verify")
            await audit.serve(rnd, ms, ctx.remote_peer)
            return
        raise BadContributionError("verify request stalled")

    async def _handle_statement(self, ctx: CallContext, request: Any) -> dict:
        if self._admit is not None:
            await self._admit(ctx.remote_peer)
        round_id = request.get("r") if isinstance(request, dict) else None
        if not isinstance(round_id, bytes):
            raise BadContributionError("expected a statement of a round")
        rnd = None
        with trio.move_on_after(self.config.stall_timeout):
            rnd = await self._find(round_id)
        if rnd is None or not rnd.is_sender:  # (not started in time, or nothing to verify)
            raise BadContributionError("this member holds no result of that round to verify")
        return await audit.answer(rnd, request, ctx.remote_peer)

    async def _handle_repair(self, ctx: CallContext, ms: MessageStream) -> None:
        rnd, hello = await self._hello(ctx, ms)
        if hello.share not in rnd.chunks:
            raise BadContributionError(f"bad share {hello.share} to repair")
        await rnd.serve_repair(hello, ms)


# ---- one round ------------------------------------------------------------------------------


class AllReduceState:
    """State of one all-reduce round on one member (sender, reducer and repair roles)."""

    def __init__(
        self,
        service: AveragingService,
        plan: AllReducePlan,
        vec: np.ndarray | None,
        meter: BandwidthMeter | None,
    ) -> None:
        self.plan, self.holdings = plan, Holdings(plan, vec)
        self.service, self.node, self.meter = service, service.node, meter
        me, config = plan.me, plan.config
        self.spec, self.me, self.codec, self.config = plan.spec, me, plan.codec, config
        self.round_id, self.members, self.senders = plan.round_id, plan.members, plan.senders
        self.is_sender, self.size, self.weight = plan.is_sender, plan.size, plan.weight
        self.abstain, self.bounds, self.reducers = plan.abstain, plan.bounds, list(plan.reducers)
        self.chunks = plan.chunks
        self.deadline, self.exchange_at = plan.deadline, plan.exchange_at
        held = self.holdings  # the same objects: the roles write them, the audit reads them
        self.out, self.held, self.masks, self.taus = held.out, held.held, held.masks, held.taus
        self.result_sigs, self.result_bytes = held.result_sigs, held.result_bytes
        self.result_digests = held.result_digests
        self.reducer_keys, self.aux_statements = held.reducer_keys, held.aux_statements
        self.settled = {j: trio.Event() for j in self.reducers}
        self.ok = dict.fromkeys(self.reducers, False)
        self.repaired: set[int] = set()
        self.failed_peers: set[int] = set()
        self.repairs: dict[int, Repair] = {}
        # Verification (config.verify): our commitments (hash per encoded part).
        self.part_hashes = {j: [NO_HASH] * len(self.chunks[j]) for j in self.reducers}
        # The encoded parts we sent (lossy codecs): the statement's figures and a reveal are
        # about exactly these bytes, and encoding them again cost a tenth of a round's CPU.
        self.part_data: dict[int, list[Any]] = {
            j: [None] * len(self.chunks[j]) for j in self.reducers
        }
        self.statements: dict[int, Statement] = {}
        # The shares whose results we still waited for when a member asked for our statement
        # at its check (fixed on the first such answer; our statement lists them), and those
        # other members named so to us: every member recomputes them without the namer's part.
        self.declared: frozenset[int] | None = None
        self.notices: dict[int, frozenset[int]] = {}
        # The result digests of each share we stated (its results root's), kept past the
        # round's end: a member whose root differs asks for them to convict an equivocator.
        self.received: dict[int, list[bytes]] = {}
        # The digests and signatures a member sent with its request for ours, by (member,
        # share): how a client, whom nobody dials, shows us its results.
        self.shown: dict[tuple[int, int], tuple[list[bytes], list[bytes]]] = {}
        # What we sign before any part (a verified round): whether we contribute. It opens
        # each of our exchanges; as a reducer we count ourselves on it.
        self.signed_hello: dict | None = None
        if config.verify and self.is_sender:
            own = 0.0 if self.abstain else self.weight
            self.signed_hello = make_hello(
                self.node.identity, self.round_id, self.spec.digest, me, own
            )
            self.holdings.hellos[me] = self.signed_hello
        self.statement_changes = Changes()
        self.verify_timeout = config.verify_timeout or config.stall_timeout
        # (member, [client,] share) we revealed; ("results", member, share): digests we sent
        self.reveals: set[tuple[object, ...]] = set()
        # Parts of a failed share that clients (whom nobody can dial) pushed to us, by (client,
        # share): we judge with them and relay them to other clients.
        self.pushed: dict[tuple[int, int], list[bytes]] = {}
        self.push_changes = Changes()
        self.keep_vec = False  # a check failed: keep our parts for those who ask to see them
        # Busy time per stream feeds the meter; without one, a throwaway meter gets it.
        self._meter = meter if meter is not None else BandwidthMeter()
        self.reducer = (
            Reducer(plan, held, self.commit_part, self.node.identity, self._meter)
            if me in self.chunks
            else None
        )
        self.finished = False
        # Streams to reducers still opening: parts wait until all are open (see _send_parts).
        self._opening = {j for j in self.reducers if j != me} if self.is_sender else set()
        self._all_open = trio.Event()
        if not self._opening:
            self._all_open.set()

    def finish(self) -> None:
        """The round ended here: keep only what a late repair reads (the result and its
        contributor masks). The vector (maybe a private copy of the caller's tree), the
        reducer's buffers and any repair's share-sized buffers go."""
        self.finished = True
        if not self.keep_vec:
            self.vec = None
            self.part_data = {}
        self.reducer = None
        self.repairs = {}
        self.result_bytes.clear()
        self.result_digests.clear()

    # -- helpers ------------------------------------------------------------------------------
    @property
    def vec(self) -> np.ndarray | None:
        """Our contribution (None on an aux peer and once the round is over)."""
        return self.holdings.vec

    @vec.setter
    def vec(self, value: np.ndarray | None) -> None:
        self.holdings.vec = value

    def name(self, i: int) -> str:
        return self.plan.name(i)

    def bounded_weight(self, s: int, stated: float) -> float:
        return self.plan.bounded_weight(s, stated)

    def commit_part(self, j: int, k: int, part: np.ndarray) -> np.ndarray:
        """Commit to our part of chunk ``k`` of share ``j`` (hash of its encoding); returns
        the values the reducer gets."""
        a, b = self.share_slice(j, k)
        codec = self.codec.at(a, b)
        data = codec.encode(part)
        self._commit(j, k, data)
        return codec.decode(data, part.size)

    def _commit(self, j: int, k: int, data: Any) -> None:
        self.part_hashes[j][k] = hashlib.sha256(data).digest()
        if not self.codec.lossless:
            self.part_data[j][k] = data

    def sent_part(self, j: int, k: int) -> Any:
        """The encoded bytes of our part of chunk ``k`` of share ``j``, as committed."""
        data = self.part_data.get(j, [None] * (k + 1))[k]
        if data is None:  # lossless (the encoding is the values), or never sent
            assert self.vec is not None
            a, b = self.share_slice(j, k)
            data = self.codec.at(a, b).encode(self.vec[a:b])
        return data

    def sent_values(self, j: int, k: int) -> np.ndarray:
        """Our part of chunk ``k`` of share ``j`` as its reducer decoded it."""
        a, b = self.share_slice(j, k)
        if self.codec.lossless:
            assert self.vec is not None
            return self.vec[a:b]
        return self.codec.at(a, b).decode(self.sent_part(j, k), b - a)

    def share_slice(self, j: int, k: int) -> tuple[int, int]:
        return self.plan.share_slice(j, k)

    def gauge(self, direction: str) -> Gauge:
        return self._meter.gauge(direction)

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
            self.signed_hello if share == -1 else None,
        )

    def check_hello(self, h: wire.Hello, remote: PeerID) -> wire.Hello:
        """Reject a stream whose opener is not who it claims or disagrees on the round; the
        hello to go by (a verified exchange's: weight and abstention as signed)."""
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
        if not self.config.verify or h.share != -1:
            return h
        signed = parse_signed_hello(
            h.signed,
            round_id=self.round_id,
            digest=self.spec.digest,
            members=[m.peer_id for m in self.members],
        )
        if signed.sender != h.sender:
            raise BadContributionError(f"{remote}'s signed hello names another member")
        return replace(h, weight=signed.weight, abstain=not signed.weight > 0, signed=signed.wire)

    # -- the local side -------------------------------------------------------------------------
    async def run(self) -> None:
        with trio.move_on_at(self.deadline):
            async with trio.open_nursery() as nursery:
                if self.reducer is not None:
                    nursery.start_soon(self._reduce, self.reducer)
                if self.is_sender:
                    for j in self.reducers:
                        if j != self.me:
                            nursery.start_soon(self._exchange, j)
                        nursery.start_soon(self._settle, j)

    async def _reduce(self, reducer: Reducer) -> None:
        await reducer.run()
        self.ok[self.me] = reducer.kept
        self.settled[self.me].set()

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
                    self._opened(j)
                    # One task sends on a stream at a time: the ack waits until the last part's
                    # send returned (it can return after the reducer already answered it).
                    sent = trio.Event()
                    async with trio.open_nursery() as inner:
                        if self.abstain:
                            sent.set()
                        else:
                            inner.start_soon(self._send_parts, ms, j, sent)
                        ok = await self._receive_results(ms, j, sent)
                        inner.cancel_scope.cancel()
            if not ok:
                logger.warning("reducer %s stalled or stopped before committing", self.name(j))
        except BaseException as e:
            if not is_failure(e):
                raise
            logger.warning("exchange with reducer %s failed: %r", self.name(j), e)
        finally:
            self._opened(j)
            if not ok:
                self.failed_peers.add(j)
            self.ok[j] = ok
            self.settled[j].set()

    def _opened(self, j: int) -> None:
        self._opening.discard(j)
        if not self._opening:
            self._all_open.set()

    async def _send_parts(self, ms: MessageStream, j: int, sent: trio.Event) -> None:
        """Send our part of reducer ``j``'s share, once every stream of ours is open (within
        half the stall timeout): parts sent while other streams still open take the uplink their
        handshakes need, and on a slow uplink a stream then opened after the reducer's stall
        timeout (in bench.collaboration, 21 s for a 14 KB/s uplink and 8 reducers)."""
        assert self.vec is not None
        with trio.move_on_after(self.config.stall_timeout / 2):
            await self._all_open.wait()
        gauge = self.gauge("up")
        try:
            for k in range(len(self.chunks[j])):
                a, b = self.share_slice(j, k)
                data = self.codec.at(a, b).encode(self.vec[a:b])
                if self.config.verify:
                    self._commit(j, k, data)
                t = trio.current_time()
                await ms.send(wire.part(k, data))
                gauge.sent(len(data), t, trio.current_time())
        except P2PError as e:  # the receiving side sees the same failure and reports it
            logger.debug("sending to %s stopped: %s", self.name(j), e)
        finally:
            gauge.close()
            sent.set()

    async def _receive_results(self, ms: MessageStream, j: int, sent: trio.Event) -> bool:
        gauge = self.gauge("down")
        try:
            return await self._receive_results_into(ms, j, sent, gauge)
        finally:
            gauge.close()

    async def _receive_results_into(
        self, ms: MessageStream, j: int, sent: trio.Event, gauge: Gauge
    ) -> bool:
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
            codec = self.codec.at(a, b)
            data = wire.parse_chunk(msg, k, codec.encoded_size(b - a))
            mask = wire.parse_contributors(msg, self.senders)
            tau = wire.parse_tau(msg)
            sig = wire.parse_sig(msg)
            signed = b""
            if self.config.verify:  # refused unless its reducer signed it (before decoding)
                signed = audit.check_signed(self, j, k, data, mask, tau, sig, msg)
            codec.decode_into(data, self.out[a:b])
            if not is_finite(self.out[a:b]):
                raise BadContributionError("non-finite result")
            gauge.received(len(data), trio.current_time())
            self.masks[j].append(mask)
            self.taus[j].append(tau)
            self.result_sigs[j].append(sig)
            if self.config.verify:  # evidence, should this reducer be caught
                self.result_bytes[j].append(bytes(data))
                self.result_digests[j].append((mask, tau, signed))
            self.held[j] = k + 1
            if k + 1 == n_chunks:
                await sent.wait()
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
            except FAILURES as e:
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
                        await ms.send(wire.part(k, self.codec.at(a, b).encode(self.vec[a:b])))
                await ms.send(wire.simple("done"))
                values, masks = await receive_finals(ms, self.plan, j)
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

    def repair(self, j: int) -> Repair:
        if j not in self.repairs:
            dead = self.reducer.dead if self.reducer is not None else frozenset()
            self.repairs[j] = Repair(self.plan, self.holdings, j, dead)
        return self.repairs[j]

    # -- repair (coordinator side, serving a participant) -------------------------------------
    async def serve_repair(self, h: wire.Hello, ms: MessageStream) -> None:
        j, n_chunks = h.share, len(self.chunks[h.share])
        if not 0 <= h.held <= n_chunks:
            raise BadContributionError("bad held count")
        if self.is_sender and j in self.settled:
            with trio.move_on_at(self.deadline):
                await self.settled[j].wait()
        holds = self.is_sender and self.held[j] == n_chunks
        if self.finished and not holds:
            raise BadContributionError(f"the round is over here, without share {j}")
        if holds and j not in self.repairs:
            await ms.send(wire.need((0, 0), (0, 0)))
            await expect_done(ms)
            assert self.out is not None
            a, b = self.bounds[j], self.bounds[j + 1]
            await send_finals(ms, self.plan, j, self.out[a:b], self.masks[j])
            return
        rep = self.repair(j)
        async with trio.open_nursery() as nursery:
            if rep.claim():
                nursery.start_soon(rep.drive)  # runs to its end even if this participant fails
            try:
                await rep.serve(h, ms)
            except FAILURES as e:
                logger.warning("repair participant %s failed: %s", self.name(h.sender), e)


# ---- entry point ----------------------------------------------------------------------------


async def all_reduce(
    service: AveragingService,
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
    the other members of ``group``, on ``service``'s node (``config``: None, the service's);
    returns within ``timeout`` seconds.

    Aux members pass a template tree of the right shapes (its values are ignored) and get
    ``average=None``. Raises :class:`ShareLostError` if some share could neither be received nor
    repaired in time, and :class:`AllReduceError` if no contribution at all was averaged.
    ``round_id`` defaults to the group's digest (a new group per round). ``codec``: a
    compression's name (a codec for every leaf, or a per-leaf policy such as ``adaptive``:
    :mod:`.leaf_codecs`), or one :class:`~.chunk_codecs.Codec` for the whole vector.
    """
    cfg = config or service.config
    me = group.index_of(service.node.peer_id)
    member = group.members[me]
    vec, spec = flatten(tree)
    # str: a compression (a codec or a per-leaf policy), planned from the leaves' shapes
    plan = (
        LeafCodecs.plan(codec, spec)
        if isinstance(codec, str)
        else LeafCodecs.uniform(codec, spec.size)
    )
    w = member.weight if weight is None else float(weight)
    if not math.isfinite(w) or w < 0:
        raise ValueError(f"weight must be finite and >= 0, got {weight!r}")
    if not is_finite(vec) and member.sends:
        logger.warning("round: local contribution has non-finite values; abstaining")
    rid = round_id if round_id is not None else group.digest
    rnd = AllReduceState(
        service, AllReducePlan.build(group, me, vec, w, plan, cfg, rid, timeout), vec, meter
    )
    if not member.sends:
        rnd.vec = None
    service._open(rnd)
    verdict = None
    try:
        await rnd.run()
        if cfg.verify and member.sends and all(rnd.ok[j] for j in rnd.reducers):
            verdict = await audit.audit(rnd)
    finally:
        service._close(rnd)
    if meter is not None:
        meter.flush()
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
                rnd.name(j),
                rnd.bounds[j],
                rnd.bounds[j + 1],
                tuple(segments),
                j in rnd.repaired,
                verdict is not None and j in verdict.dropped,
                verdict is not None and j in verdict.recomputed,
            )
        )
    assert rnd.out is not None
    accusations = verdict.accusations if verdict is not None else ()
    kept = kept_of(rnd) if verdict is not None else {}
    return AllReduceResult(unflatten(rnd.out, spec), rnd.out, tuple(shares), accusations, kept)
