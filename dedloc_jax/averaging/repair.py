"""Repair of a share whose reducer failed: the coordinator's side and the final transfer.

The coordinator waits for the survivors (each sends how many leading chunks of the share it
holds), relays the longest prefix any of them holds, re-reduces the rest from their own
vectors, and sends every participant the same float32 values. It acts only with a majority
of the group's senders present, so no member ever ends a round with a value nobody else
holds, and two sides of a partition cannot both re-reduce a share. In robust mode it
re-reduces with CenteredClip like a reducer does, so killing a reducer cannot bring back the
plain mean.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence, Set
from typing import TYPE_CHECKING

import numpy as np
import trio

from p2p.rpc import MessageStream

from . import wire
from .changes import Changes
from .chunk_codecs import is_finite
from .errors import BadContributionError, ShareLostError
from .robust import centered_clip
from .verify import clips, derived_tau, part_norm, robust_weights

if TYPE_CHECKING:
    from .allreduce_plan import AllReducePlan, Holdings

logger = logging.getLogger(__name__)
F32 = np.dtype("<f4")  # the wire's float32 byte order, whatever the host's


class Repair:
    """Coordinator state for re-reducing share ``j`` of the round (``plan``) from the survivors:
    our own part comes from ``holdings``, so does the prefix we hold; ``dead``: the senders
    our reducer saw die (not waited for)."""

    def __init__(self, plan: AllReducePlan, holdings: Holdings, j: int, dead: Set[int]) -> None:
        self.plan, self.holdings, self.j, self.dead = plan, holdings, j, dead
        rnd = plan
        self.n_chunks = len(rnd.chunks[j])
        self.length = rnd.bounds[j + 1] - rnd.bounds[j]
        self.joined: dict[int, wire.Hello] = {}
        self.delivered: set[int] = set()
        self.route: tuple[int, int, int] | None = None  # (holder, relay from, prefix H)
        self.acc = np.zeros(self.length, np.float32)
        self.wsum = np.zeros(self.n_chunks, np.float64)
        self.cmask: list[set[int]] = [set() for _ in range(self.n_chunks)]
        # Robust mode keeps each chunk's parts (sender -> values) for CenteredClip.
        self.robust = rnd.config.robust_mode
        self.parts: list[dict[int, np.ndarray]] = [{} for _ in range(self.n_chunks)]
        self.weights: dict[int, float] = {}
        self.base = np.zeros(self.length, np.float32)  # relayed prefix values
        self.base_masks: list[frozenset[int] | None] = [None] * self.n_chunks
        self.values: np.ndarray | None = None
        self.masks: tuple[frozenset[int], ...] = ()
        self.changes = Changes()
        self.planned = trio.Event()
        self.ready = trio.Event()
        self._claimed = False

    def claim(self) -> bool:
        first = not self._claimed
        self._claimed = True
        return first

    def _own_held(self) -> int:
        return self.holdings.held.get(self.j, 0) if self.plan.is_sender else 0

    async def drive(self) -> None:
        r, j, held_now = self.plan, self.j, self.holdings
        try:
            expected = set(r.senders) - {j, r.me} - self.dead
            while not expected <= set(self.joined) and trio.current_time() < r.join_at:
                await self.changes.wait(r.join_at)
            # A majority of the group's senders, or nothing: at most one side of a partition
            # has one, so the other fails the round instead of reducing a different value.
            present = len(self.joined) + (1 if r.is_sender else 0)
            if not self.joined or 2 * present <= len(r.senders):
                logger.warning(
                    "repair of share %d: %d of %d senders present, not a majority; giving up",
                    j,
                    present,
                    len(r.senders),
                )
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
            self.route = (holder, relay_from, prefix)
            if held_now.out is not None:
                a = r.bounds[j]
                for k in range(min(own, prefix)):
                    x, y = r.chunks[j][k]
                    self.base[x:y] = held_now.out[a + x : a + y]
                    self.base_masks[k] = held_now.masks[j][k]
            vec = held_now.vec
            if r.is_sender and not r.abstain and vec is not None:  # None: our round ended
                for k in range(prefix, self.n_chunks):
                    x, y = r.chunks[j][k]
                    own = vec[r.bounds[j] + x : r.bounds[j] + y]
                    self.acc[x:y] = own * np.float32(r.weight)
                    self.wsum[k] = r.weight
                    self.cmask[k].add(r.me)
                    if self.robust:
                        self.parts[k][r.me] = own
                        self.weights[r.me] = r.weight
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
                if self.robust and self.parts[k]:
                    avg = self._robust(k)
                codec = r.codec.at(r.bounds[j] + x, r.bounds[j] + y)
                data = codec.encode(avg.astype(np.float32, copy=False))
                values[x:y] = codec.decode(data, y - x)
                masks.append(frozenset(self.cmask[k]))
            self.values, self.masks = values, tuple(masks)
        finally:
            self.planned.set()
            self.ready.set()

    def _robust(self, k: int) -> np.ndarray:
        """CenteredClip over chunk ``k``'s parts, with weights capped as a reducer does."""
        r = self.plan
        senders = sorted(self.parts[k])
        values = [self.parts[k][s] for s in senders]
        if not clips(True, r.config.robust_tau, len(senders)):
            raw = np.asarray([self.weights[s] for s in senders], np.float64)
            mean = (raw @ np.asarray(values, np.float64)) / max(float(raw.sum()), 1e-300)
            return mean.astype(np.float32)
        norms = [part_norm(v) for v in values]
        weights = robust_weights([self.weights[s] for s in senders], norms, r.config.robust_tau)
        tau = r.config.robust_tau or derived_tau(norms)
        out = centered_clip(values, weights, tau, r.config.robust_iters)
        return out.astype(np.float32)

    async def serve(self, h: wire.Hello, ms: MessageStream) -> None:
        s, r = h.sender, self.plan
        if self.route is None and s not in self.joined:
            self.joined[s] = h
            self.changes.notify()
        await self.planned.wait()
        if self.route is None or s not in self.joined:  # failed, or a latecomer: send finals only
            await ms.send(wire.need((0, 0), (0, 0)))
            await expect_done(ms)
        else:
            holder, relay_from, prefix = self.route
            relay = (relay_from, prefix) if s == holder else (0, 0)
            parts = (
                (prefix, self.n_chunks)
                if not h.abstain and r.bounded_weight(s, h.weight) > 0
                else (0, 0)
            )
            await ms.send(wire.need(relay, parts))
            with trio.move_on_at(r.data_at):
                await self._receive_data(s, h, ms, relay, parts)
                self.delivered.add(s)
                self.changes.notify()
        await self.ready.wait()
        if self.values is None:
            await ms.send(wire.simple("err", e="share could not be repaired"))
            return
        await send_finals(ms, r, self.j, self.values, self.masks)

    async def _receive_data(
        self,
        s: int,
        h: wire.Hello,
        ms: MessageStream,
        relay: tuple[int, int],
        parts: tuple[int, int],
    ) -> None:
        r, j = self.plan, self.j
        for k in range(*relay):
            x, y = r.chunks[j][k]
            msg = await ms.receive()
            if wire.kind_of(msg) != "held":
                raise BadContributionError("expected held chunk")
            data = wire.parse_chunk(msg, k, 4 * (y - x))
            mask = wire.parse_contributors(msg, r.senders)
            values = np.frombuffer(data, F32).astype(np.float32)
            if not is_finite(values):
                raise BadContributionError("non-finite relayed chunk")
            self.base[x:y] = values
            self.base_masks[k] = mask
        for k in range(*parts):
            x, y = r.chunks[j][k]
            msg = await ms.receive()
            if wire.kind_of(msg) != "part":
                raise BadContributionError("expected part")
            codec = r.codec.at(r.bounds[j] + x, r.bounds[j] + y)
            data = wire.parse_chunk(msg, k, codec.encoded_size(y - x))
            values = codec.decode(data, y - x)
            if not is_finite(values):
                logger.warning("repair: non-finite chunk %d from %s excluded", k, r.name(s))
                continue
            if self.ready.is_set():
                return
            w = r.bounded_weight(s, h.weight)  # as in the round: not what it says, unbounded
            self.acc[x:y] += values * np.float32(w)
            self.wsum[k] += w
            self.cmask[k].add(s)
            if self.robust:
                self.parts[k][s] = values
                self.weights[s] = w
        await expect_done(ms)


async def expect_done(ms: MessageStream) -> None:
    if wire.kind_of(await ms.receive()) != "done":
        raise BadContributionError("expected done")


async def send_finals(
    ms: MessageStream, r: AllReducePlan, j: int, values: np.ndarray, masks: Sequence[frozenset[int]]
) -> None:
    for k, (x, y) in enumerate(r.chunks[j]):
        await ms.send(wire.result(k, values[x:y].astype(F32).tobytes(), masks[k], "final"))
    await ms.send(wire.simple("end"))


async def receive_finals(
    ms: MessageStream, r: AllReducePlan, j: int
) -> tuple[np.ndarray, list[frozenset[int]]]:
    values = np.zeros(r.bounds[j + 1] - r.bounds[j], np.float32)
    masks = []
    for k, (x, y) in enumerate(r.chunks[j]):
        msg = await ms.receive()
        if wire.kind_of(msg) == "err":
            raise ShareLostError(f"coordinator could not repair share {j}", shares=(j,))
        data = wire.parse_chunk(msg, k, 4 * (y - x))
        chunk = np.frombuffer(data, F32).astype(np.float32)
        if not is_finite(chunk):
            raise BadContributionError("non-finite repaired chunk")
        values[x:y] = chunk
        masks.append(wire.parse_contributors(msg, r.senders))
    if wire.kind_of(await ms.receive()) != "end":
        raise BadContributionError("expected end")
    return values, masks
