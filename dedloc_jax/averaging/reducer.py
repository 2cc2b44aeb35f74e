"""The reducer role of a round: accumulate parts, finalise chunks in order, stream them back.

A reducer waits for each chunk until every expected sender delivered it; a sender that stalls
(no progress for ``stall_timeout``), dies, or sends a malformed or non-finite chunk is excluded
from that chunk on. It commits (tells receivers they may keep its values) only once every live
receiver acked, and keeps its own copy only if someone else holds it too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from p2p.errors import P2PError
from p2p.rpc import MessageStream

from . import wire
from .changes import Changes
from .chunk_codecs import is_finite
from .errors import BadContributionError, CodecError
from .robust import centered_clip
from .verify import (
    CLIP_SLACK,
    chunk_terms,
    clips,
    derived_tau,
    make_statement,
    part_norm,
    result_claim,
    result_digest,
    robust_weights,
)

if TYPE_CHECKING:
    from p2p.identity import Identity

    from .allreduce_plan import AllReducePlan, Holdings
    from .bandwidth import BandwidthMeter, Gauge

logger = logging.getLogger(__name__)

CLIP_TOL = CLIP_SLACK / 10
"""CenteredClip iterates until its step is below this fraction of the radius: well inside
the slack a verifier allows (:data:`.verify.CLIP_SLACK`)."""


class Reducer:
    """The reducer role: accumulate parts, finalise chunks in order, stream them back.

    It reads the round's ``plan``, writes the chunks it finalises into our ``holdings`` (when
    we are a sender), takes our own parts through ``commit_part`` (share, chunk, values ->
    the values as the codec carries them, committed to in a verified round), signs its results
    with ``identity`` and reports its streams' busy time to ``meter``. After :meth:`run`,
    ``kept`` says whether we may keep our own share's result (someone else holds it too)."""

    def __init__(
        self,
        plan: AllReducePlan,
        holdings: Holdings,
        commit_part: Callable[[int, int, np.ndarray], np.ndarray],
        identity: Identity,
        meter: BandwidthMeter,
    ) -> None:
        self.plan, self.holdings = plan, holdings
        self._commit_part, self.identity, self.meter = commit_part, identity, meter
        self.kept = False
        rnd = plan
        j = plan.me
        self.start = rnd.bounds[j]
        self.chunks = rnd.chunks[j]
        n = len(self.chunks)
        widest = max((b - a for a, b in self.chunks), default=0)
        # Memory is a fixed number of chunks whatever the share: chunk k accumulates in slot
        # k % window, a sender more than ``window`` chunks ahead of the oldest unfinished
        # chunk is not read (its stream back-pressures it), and an encoded result is dropped
        # once every receiver was sent it.
        self.window = max(1, rnd.config.window_chunks)
        self.acc = np.zeros((min(self.window, max(n, 1)), widest), np.float32)
        self.scratch = np.empty(widest, np.float32)
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
        self.enc: dict[int, bytes] = {}  # finalised chunks some receiver was not sent yet
        self.sent: dict[int, int] = {}  # per receiver, how many result chunks it was sent
        self.final_masks: list[frozenset[int]] = []
        self.commit: frozenset[int] | None = None
        self.last_sent: dict[int, float] = {}
        self.gauges: dict[int, Gauge] = {}  # per sender: busy time of its parts' stream
        self.sent_all_at: dict[int, float] = {}
        self.changes = Changes()  # anything the collecting loop re-checks (parts, acks, deaths)
        # What the result streams wait for: a chunk finalised, the commit, a receiver dropped.
        # Kept apart from ``changes`` so a part arriving does not wake every result stream of
        # the group (that was quadratic in the group size per chunk).
        self.results = Changes()
        # Robust mode buffers each chunk's parts (sender -> values) and their norms until it
        # is finalised; it accumulates the weighted sum as the plain mean does all the same,
        # which is CenteredClip's result whenever no part lies outside the radius.
        self.robust = rnd.config.robust_mode
        self.parts: list[dict[int, np.ndarray]] = [{} for _ in range(n)] if self.robust else []
        self.norms: list[dict[int, float]] = [{} for _ in range(n)] if self.robust else []
        self.taus: list[float | None] = [None] * n  # CenteredClip's radius per chunk
        self.sigs: list[bytes | None] = [None] * n  # our signature of each result chunk
        # An aux reducer's statement (it swaps none), sent with its first result chunk.
        self.statement: dict | None = None
        self.own = rnd.is_sender and not rnd.abstain
        if self.own:
            assert holdings.vec is not None
            self.wsum[:] = rnd.weight
            for m in self.cmask:
                m.add(j)
            for k in range(n) if self.robust else ():
                self.parts[k][j] = self._own_part(k)
                self.norms[k][j] = part_norm(self.parts[k][j])
        for k in range(min(self.window, n)):
            self._open_slot(k)

    def _slot(self, k: int) -> np.ndarray:
        a, b = self.chunks[k]
        return self.acc[k % len(self.acc), : b - a]

    def _own_part(self, k: int) -> np.ndarray:
        """Our own part of chunk ``k``: as is, or, when results are verified, as the codec
        carries everyone else's (so our statement's figures are about what we aggregated)."""
        a, b = self.chunks[k]
        vec = self.holdings.vec
        assert vec is not None
        part = vec[self.start + a : self.start + b]
        if self.plan.config.verify:
            return self._commit_part(self.plan.me, k, part)
        return part

    def _open_slot(self, k: int) -> None:
        """Start chunk ``k``'s accumulator: our own contribution, or zeros."""
        slot = self._slot(k)
        if self.own:
            own = self.parts[k][self.plan.me] if self.robust else self._own_part(k)
            np.multiply(own, np.float32(self.plan.weight), out=slot)
        else:
            slot[:] = 0.0

    def exclude(self, s: int, why: str) -> None:
        if s in self.expected:
            self.expected.discard(s)
            logger.warning(
                "round %s: excluding %s from chunk %d on: %s",
                self.plan.round_id.hex()[:8],
                self.plan.name(s),
                self.next_k.get(s, 0),
                why,
            )
        if s not in self.seen:
            self.receivers.discard(s)
            self.results.notify()
        self.changes.notify()

    def _died(self, s: int, why: str) -> None:
        self.dead.add(s)
        self.exclude(s, why)
        self.receivers.discard(s)
        self.changes.notify()
        self.results.notify()

    async def run(self) -> None:
        r, stall = self.plan, self.plan.config.stall_timeout
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
            await self._room_for(k)
            self._finalise(k)
            if self.robust:  # CenteredClip takes CPU per chunk: let the streams run between
                await trio.lowlevel.checkpoint()
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
                self.results.notify()
            if not laggards:
                await self.changes.wait(min([r.exchange_at, *due.values()]))
        self.commit = frozenset(self.acked & self.receivers)
        self.changes.notify()
        self.results.notify()
        # Keeping our own share is safe only if someone else holds it too; otherwise we repair
        # it like any receiver would (and relay our copy if we can).
        self.kept = bool(self.commit) or not self.initial_receivers
        if not self.kept:
            logger.warning("round %s: nobody acked our share; repairing it", r.round_id.hex()[:8])

    async def _room_for(self, k: int) -> None:
        """Wait until chunk ``k``'s result fits the window: every receiver was sent the result
        ``window`` chunks before it (a receiver that makes no progress is dropped)."""
        r = self.plan
        while self.enc and min(self.enc) <= k - self.window:
            now = trio.current_time()
            behind = [s for s in self.receivers if self.sent.get(s, 0) <= k - self.window]
            if now >= r.exchange_at:
                laggards = behind
            else:
                laggards = [s for s in behind if now >= self._progress_due(s)]
            for s in laggards:
                logger.warning(
                    "round %s: receiver %s made no progress; dropping it",
                    r.round_id.hex()[:8],
                    r.name(s),
                )
                self.receivers.discard(s)
                self.results.notify()
            self._release()
            if not laggards and self.enc and min(self.enc) <= k - self.window:
                due = [self._progress_due(s) for s in behind]
                await self.changes.wait(min([r.exchange_at, *due]))

    def _release(self) -> None:
        """Drop the encoded results every remaining receiver was sent."""
        upto = min((self.sent.get(s, 0) for s in self.receivers), default=self.done)
        for k in [k for k in self.enc if k < upto]:
            del self.enc[k]

    def _progress_due(self, s: int) -> float:
        """When receiver ``s`` counts as stalled: no send to it completed, or no ack after all."""
        stall = self.plan.config.stall_timeout
        last = self.last_sent.get(s, self.last.get(s, self.plan.deadline))
        done = self.sent_all_at.get(s)
        return min(last + stall, done + stall) if done is not None else last + stall

    def _finalise(self, k: int) -> None:
        r = self.plan
        a, b = self.chunks[k]
        avg = self._slot(k)  # averaged in place: the accumulator of this chunk is done
        self._aggregate(k, avg)
        codec = r.codec.at(self.start + a, self.start + b)
        data = codec.encode(avg)
        if not codec.lossless:
            codec.decode_into(data, avg)  # use exactly what the receivers will decode
        mask = frozenset(self.cmask[k])
        self.final_masks.append(mask)
        held = self.holdings
        if held.out is not None:
            out = held.out[self.start + a : self.start + b]
            out[:] = avg
            held.masks[r.me].append(mask)
            held.taus[r.me].append(self.taus[k])
            held.held[r.me] = k + 1
            if codec.lossless:  # a view of the slot, which the next chunk reuses
                data = codec.encode(out)
        elif isinstance(data, memoryview):
            data = bytes(data)
        self.enc[k] = data
        if r.config.verify:  # signed, so a conviction can name these bytes as ours
            cfg = r.config
            terms = chunk_terms(
                self.start + a, self.start + b, codec.name, cfg.robust_mode, cfg.robust_tau
            )
            rdigest = result_digest(
                r.round_id, r.spec.digest, r.me, k, data, mask, self.taus[k], terms
            )
            self.sigs[k] = self.identity.sign(
                result_claim(r.round_id, r.spec.digest, r.me, k, rdigest)
            )
            held.result_sigs[r.me].append(self.sigs[k])
            held.reducer_keys[r.me] = self.identity.public_key
            if k == 0 and not r.is_sender:
                # As an aux reducer, the signed hellos we counted on, signed by us: who counts
                # a member that signed none is convicted (chunk 0's senders are all it counts).
                self.statement = make_statement(
                    self.identity, r.round_id, r.spec.digest, r.me, 0.0, bytes(32), {},
                    list(held.hellos.values()),
                )  # fmt: skip
            held.result_bytes[r.me].append(bytes(data))
            held.result_digests[r.me].append((mask, self.taus[k], rdigest))
        self.done = k + 1
        if not self.receivers:
            self._release()
        if k + self.window < len(self.chunks):
            self._open_slot(k + self.window)
        self.changes.notify()
        self.results.notify()

    def _aggregate(self, k: int, avg: np.ndarray) -> None:
        """Chunk ``k``'s aggregate, in place of its accumulator ``avg``."""
        if self.robust and self.parts[k]:
            self._robust_finalise(k, avg)
        elif self.wsum[k] > 0:
            np.divide(avg, np.float32(self.wsum[k]), out=avg)

    def _robust_finalise(self, k: int, out: np.ndarray) -> None:
        """CenteredClip over the chunk's buffered parts (weights capped) into ``out``, which
        holds their weighted sum: the weighted mean is the answer, without a pass over the
        parts, when the weights stand and every part lies within the radius of the mean
        (``|x_i| + |mean| <= tau`` by the triangle inequality, else measured)."""
        r = self.plan
        parts, norms_of = self.parts[k], self.norms[k]
        self.parts[k], self.norms[k] = {}, {}
        senders = sorted(parts)
        own = r.weight if r.is_sender and not r.abstain else 0.0
        raw = [own if s == r.me else self.weights[s] for s in senders]
        total = float(sum(raw))
        if not clips(True, r.config.robust_tau, len(senders)):
            np.divide(out, np.float32(max(total, 1e-300)), out=out)  # the plain mean
            return
        norms = [norms_of[s] for s in senders]
        weights = robust_weights(raw, norms, r.config.robust_tau)
        tau = r.config.robust_tau or derived_tau(norms)
        self.taus[k] = tau
        if np.array_equal(weights, raw) and total > 0:
            np.divide(out, np.float32(total), out=out)
            mean_bound = sum(w * n for w, n in zip(raw, norms, strict=True)) / total
            if all(
                n + mean_bound <= tau or _within(parts[s], out, tau)
                for s, n in zip(senders, norms, strict=True)
            ):
                return
        values = [parts[s] for s in senders]
        out[:] = centered_clip(values, weights, tau, r.config.robust_iters, tol=CLIP_TOL)

    async def serve(self, h: wire.Hello, ms: MessageStream) -> None:
        s = h.sender
        if s in self.seen or s not in self.receivers:
            raise BadContributionError(f"{self.plan.name(s)} connected twice or too late")
        self.seen.add(s)
        # Checked by AllReduceState.check_hello; h's weight is the signed one.
        if h.signed is not None:
            self.holdings.hellos[s] = h.signed
        self.gauges[s] = self.meter.gauge("down")
        self.weights[s] = self.plan.bounded_weight(s, h.weight)  # not what it says, unbounded
        self.last[s] = trio.current_time()
        if h.abstain or self.weights[s] <= 0:
            self.exclude(s, "abstains (no or non-finite contribution)")
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_results, s, ms)
                await self._receive_parts(s, ms)
                if s not in self.acked or s in self.dead:
                    nursery.cancel_scope.cancel()
        finally:  # also when the connection's death cancels this handler
            self.gauges[s].close()
            if s not in self.acked:
                self._died(s, "stream ended before its ack")

    async def _receive_parts(self, s: int, ms: MessageStream) -> None:
        r = self.plan
        try:
            with trio.move_on_at(r.deadline):
                while True:
                    while self.next_k.get(s, 0) >= self.done + self.window:
                        await self.results.wait(r.deadline)  # its slot is still in use
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
        raw = msg.get("d") if isinstance(msg, dict) else None
        self.gauges[s].received(len(raw) if isinstance(raw, bytes) else 0, self.last[s])
        if s not in self.expected:
            return  # excluded earlier: its late parts are ignored
        a, b = self.chunks[k]
        if k >= self.done + self.window:
            raise BadContributionError("part beyond the reducer's window")
        scratch = self.scratch[: b - a]
        try:
            codec = self.plan.codec.at(self.start + a, self.start + b)
            data = wire.parse_chunk(msg, k, codec.encoded_size(b - a))
            if self.robust and not codec.lossless:  # kept until finalisation
                values = codec.decode(data, b - a)
            else:
                values = codec.decode_view(data, scratch)  # no copy when lossless
        except (BadContributionError, CodecError) as e:
            self.exclude(s, f"malformed chunk {k}: {e}")
            return
        if not is_finite(values):
            self.exclude(s, f"non-finite values in chunk {k}")
            return
        w = self.weights[s]
        if self.robust:  # kept for finalisation (a lossless view holds the message's bytes)
            self.parts[k][s] = values
            self.norms[k][s] = part_norm(values)
        if w != 1.0:
            values = np.multiply(values, np.float32(w), out=scratch)
        self._slot(k)[:] += values
        self.wsum[k] += w
        self.cmask[k].add(s)
        self.changes.notify()

    async def _send_results(self, s: int, ms: MessageStream) -> None:
        gauge = self.meter.gauge("up")
        try:
            await self._send_results_to(s, ms, gauge)
        except P2PError as e:
            self._died(s, f"sending results failed: {e}")
        finally:
            gauge.close()

    async def _send_results_to(self, s: int, ms: MessageStream, gauge: Gauge) -> None:
        r = self.plan
        heartbeat = r.config.stall_timeout / 3
        k = 0
        while True:
            while k < self.done:
                if s not in self.receivers:  # dropped: its results may be released already
                    return
                data = self.enc[k]
                t = trio.current_time()
                # The first signed chunk carries our key: a member checks every signature on
                # receipt, and names the key in any conviction of ours.
                first = k == 0 and self.sigs[k] is not None
                key = self.identity.public_key if first else None
                await ms.send(
                    wire.result(
                        k, data, self.final_masks[k], tau=self.taus[k], sig=self.sigs[k],
                        key=key, statement=self.statement if first else None,
                    )
                )  # fmt: skip
                k += 1
                self.last_sent[s] = trio.current_time()
                gauge.sent(len(data), t, self.last_sent[s])
                self.sent[s] = k
                if len(self.enc) >= self.window:  # the collecting loop may wait for room
                    self._release()
                    self.changes.notify()
                if k == len(self.chunks):
                    self.sent_all_at[s] = self.last_sent[s]
                    self.changes.notify()
            if self.commit is not None and k == self.done == len(self.chunks):
                break
            if s not in self.receivers:
                return
            if not await self.results.wait(trio.current_time() + heartbeat):
                await ms.send(wire.simple("hb"))
                self.last_sent[s] = trio.current_time()
        if s in self.commit:
            await ms.send(wire.simple("commit"))
        else:
            ms.reset("no ack in time")


def _within(part: np.ndarray, center: np.ndarray, tau: float) -> bool:
    """Whether ``|part - center| <= tau`` (float64 sum of float32 differences)."""
    dev = np.subtract(part, center, dtype=np.float32)
    return float(np.einsum("i,i->", dev, dev, dtype=np.float64)) <= tau * tau
