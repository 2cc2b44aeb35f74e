"""Averaging across capped groups: one mean for the whole epoch.

Above ``max_group_size`` peers, matchmaking splits an epoch's peers into several groups, and each
group's all-reduce yields that group's mean only. Groups that average apart apply different
updates, so their parameters part. Hence a second level:

1. Each group's *representative* (its first member that sends a vector; aux peers hold none)
   forms one more group at the same epoch with the other groups' representatives (level 1,
   uncapped: about ``n / max_group_size`` members) and averages the group means there, each
   weighted by the samples its group averaged.
2. It then tells its group whether that worked (``collab.cross``). If it did, the group runs one
   more all-reduce in which only the representative contributes (weight 1, the others abstain):
   a broadcast over the butterfly, so the representative uploads the vector once and every
   member reduces a share, as in the first round.

Every member of every group then holds the same vector. The broadcast uses an element-wise
codec (int8, and adaptive's int8 leaves, become fp16): int8 scales depend on each group's
chunking, and groups must not round the same global mean differently. If anything fails, a
group keeps its own mean; the fork rule (:func:`dedloc_jax.state.lineage.on_minority_fork`)
later puts its peers back on the lineage most peers hold.

A level-1 group that lacks a representative the leader's partition named (it died, or came
late and formed a second level-1 group with other late ones) holds the mean of only some groups:
its members learn that the mean is *partial* and check the fork before training on it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from dedloc_jax.averaging import (
    AllReduceConfig,
    AllReduceError,
    AllReduceResult,
    AveragingService,
    GroupError,
    all_reduce,
)
from dedloc_jax.averaging.group import GroupSpec
from dedloc_jax.averaging.leaf_codecs import elementwise
from dedloc_jax.rounds.slots import Slots
from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.node import Node
from p2p.rpc import CallContext

if TYPE_CHECKING:  # the round's machinery runs this module's side of it
    from dedloc_jax.rounds.average import Averager, RoundTerms
    from dedloc_jax.rounds.deadlines import Deadlines

log = logging.getLogger(__name__)

CROSS = "collab.cross"
"""Asked by a group member of its representative: did the round across groups work?"""


def representative(spec: GroupSpec) -> str | None:
    """The member that carries the group's mean across groups: the first that sends."""
    return next((m.peer_id for m in spec.members if m.sends), None)


def averaged_weight(spec: GroupSpec, result: AllReduceResult) -> float:
    """The samples behind a group's mean: the weights of the members included in every share
    (a member lost on one share and repaired away counts for none)."""
    included = frozenset.intersection(*result.contributors) if result.contributors else frozenset()
    return float(sum(m.weight for m in spec.members if m.peer_id in included))


def broadcast_codec(codec: str) -> str:
    """An element-wise codec for the broadcast: every group must round the mean alike."""
    return elementwise(codec)


def broadcast_spec(spec: GroupSpec) -> GroupSpec:
    """The broadcast's group: ``spec`` with the representative weighing 1 and every other
    member 0, since a sender counts for its spec weight (:func:`~dedloc_jax.averaging.verify.
    counted_weight`): with its group's samples as weight, the mean came back as (w x) / w,
    rounded differently in each group."""
    rep = representative(spec)
    members = tuple(
        dataclasses.replace(m, weight=1.0 if m.peer_id == rep else 0.0) for m in spec.members
    )
    return GroupSpec(members, spec.group_id, spec.parts)


def broadcast_round(spec: GroupSpec) -> bytes:
    """The broadcast's round ID: not the group's first round (its digest)."""
    return spec.digest + b":across"


class AcrossGroups:
    """One peer's side of the level-1 round: as a representative, it records in the slot's
    record whether the round across groups produced a mean for its group; as a member, it asks
    its representative. ``slots`` are shared with the peer's matchmaker; ``admit``: as
    :attr:`~dedloc_jax.rounds.context.PeerSide.admit`."""

    def __init__(
        self,
        node: Node,
        slots: Slots,
        *,
        admit: Callable[[PeerID, str | None], Awaitable[None]] | None = None,
    ) -> None:
        self.node = node
        self.slots = slots
        self.admit = admit
        self._wait = 60.0  # how long a member's question may wait: the last round's (begin)

    def register(self) -> None:
        self.node.add_handler(CROSS, self._handle)

    def begin(self, wait: float) -> None:
        """This peer's part in a round across groups begins: a member's question waits up to
        ``wait`` seconds for the outcome (that round's matchmaking and two all-reduces)."""
        self._wait = wait

    def settle(self, epoch: int, ok: bool, whole: bool = True) -> None:
        """As representative: whether this epoch's group mean was averaged across groups, and
        whether with every group's representative (``whole``; else the mean is partial)."""
        record = self.slots[(epoch, 1)]
        record.ok = ok
        record.whole = ok and whole
        record.settled.set()

    def close(self, epoch: int) -> None:
        """This peer is done with ``epoch``: a member still asking hears no (e.g. our first
        round failed, so we never represented the group)."""
        record = self.slots.get((epoch, 1))
        if record is None or record.ok is None:
            self.settle(epoch, False)

    async def _handle(self, ctx: CallContext, request: Any) -> Any:
        if not isinstance(request, dict) or not isinstance(request.get("epoch"), int):
            raise ValueError("a cross query is a map with an integer epoch")
        if self.admit is not None:
            await self.admit(ctx.remote_peer, None)
        epoch = request["epoch"]
        with trio.move_on_after(self._wait):
            await self.slots.asked((epoch, 1)).settled.wait()
        record = self.slots.get((epoch, 1))  # (pruned meanwhile: no outcome to tell)
        if record is None or not record.ok:
            return {"ok": False, "whole": False}
        return {"ok": True, "whole": record.whole}

    async def ask(self, rep: str, epoch: int, timeout: float) -> tuple[bool, bool]:
        """As member: whether ``rep`` holds a mean across groups (False if unreachable), and
        whether that mean is the whole epoch's (every group's representative took part)."""
        try:
            answer = await self.node.call(
                PeerID.from_base58(rep), CROSS, {"epoch": epoch}, timeout=timeout
            )
        except P2PError as e:
            log.info("representative %s of epoch %d did not answer: %s", rep, epoch, e)
            return False, False
        if not isinstance(answer, dict) or answer.get("ok") is not True:
            return False, False
        return True, answer.get("whole") is True


async def broadcast(
    service: AveragingService,
    spec: GroupSpec,
    arrays: Sequence[np.ndarray],
    *,
    source: bool,
    codec: str,
    timeout: float,
    config: AllReduceConfig | None = None,
) -> AllReduceResult | None:
    """Hand the representative's ``arrays`` to every member of ``spec``: the round's result
    (None on failure). ``config``: the run's all-reduce settings, so that in an open run each
    share of the broadcast is verified like any round's (a reducer returning anything but the
    representative's values is caught and its share recomputed from them).

    Members other than the source pass their own arrays only for the shapes; aux members get
    no average either way."""
    try:
        result = await all_reduce(
            service,
            broadcast_spec(spec),
            list(arrays),
            1.0 if source else 0.0,
            codec=broadcast_codec(codec),
            timeout=timeout,
            round_id=broadcast_round(spec),
            config=config,
        )
    except (AllReduceError, GroupError) as e:
        log.warning("the broadcast of the mean across groups failed: %s", e)
        return None
    except BaseExceptionGroup as group:
        failed, rest = group.split((AllReduceError, GroupError))
        if rest is not None or failed is None:
            raise
        log.warning("the broadcast of the mean across groups failed: %s", failed)
        return None
    return result


async def cross_average(
    rounds: Averager,
    this: RoundTerms,
    spec: GroupSpec | None,
    mean: list[np.ndarray],
    weight: float,
    deadlines: Deadlines,
    on_averaged: Callable[[GroupSpec], None] | None = None,
) -> tuple[list[np.ndarray], int, bool]:
    """The mean across this epoch's groups (see above), the size of the level-1 group (1 when
    this peer did not represent its group there) and whether that is the whole epoch's mean;
    ``mean`` itself when it failed. ``deadlines``: those of our group ``spec`` (of the round's
    window alone when we are in none). ``on_averaged(level_1_spec)`` runs when a peer alone in
    its group (``spec`` None) averaged across groups: those are the peers it averaged with."""
    epoch = this.epoch
    me = str(rounds.node.peer_id)
    rep = me if spec is None else representative(spec)
    wait = deadlines.cross_wait  # for the representative's round across groups
    rounds.across.begin(wait)
    size = 1
    if rep == me:
        ok, whole, found = False, False, None
        try:
            found = await represent(
                rounds, this, mean, weight, on_averaged if spec is None else None
            )
            ok = found is not None
            if found is not None:
                mean, size, whole = found
        finally:
            rounds.across.settle(epoch, ok, whole)
        if found is None:
            return mean, 1, False
        if spec is None:
            return mean, size, whole
    else:
        rounds.matchmaker.decline(epoch)
        ok, whole = (False, False) if rep is None else await rounds.across.ask(rep, epoch, wait)
        if not ok:
            return mean, 1, False
    assert spec is not None  # a peer alone represents itself, and returned above
    sent = await broadcast(
        rounds.service,
        spec,
        mean,
        source=rep == me,
        codec=this.codec,
        timeout=deadlines.averaging,
        config=rounds.all_reduce_config(),
    )
    if sent is not None:
        await rounds.convict(sent)
    out = None if sent is None or sent.average is None else [np.asarray(a) for a in sent.average]
    if out is None:  # the representative holds the mean across groups all the same
        return mean, 1, rep == me and whole
    return out, size, whole


async def represent(
    rounds: Averager,
    this: RoundTerms,
    mean: list[np.ndarray],
    weight: float,
    on_averaged: Callable[[GroupSpec], None] | None = None,
) -> tuple[list[np.ndarray], int, bool] | None:
    """As its group's representative, average ``mean`` (``weight`` samples) with the other
    groups' representatives: the result, how many there were and whether every
    representative our leader's partition named took part (else the mean is partial), or
    None. ``on_averaged(spec)`` runs once that all-reduce succeeded."""
    epoch = this.epoch
    me = rounds.member(weight)
    others = rounds.matchmaker.representatives(epoch) - {me.peer_id}
    spec = await rounds.matchmaker.form_group(
        epoch, me, target=this.target, expected=others, level=1, deadlines=this.deadlines
    )
    if spec is None:
        return None
    # (a representative sends its group's mean: its group weighed its own gradient)
    averaged, failure = await rounds.all_reduce(
        spec, mean, weight, this.codec, this.deadlines, weighs=False
    )
    if averaged is None:
        log.warning("averaging across groups at epoch %d failed: %s", epoch, failure)
        return None
    if on_averaged is not None:
        on_averaged(spec)
    members = {m.peer_id for m in spec.members}
    whole = others <= members
    if not whole:
        log.info(
            "epoch %d: %d of the groups' representatives missed the round across groups",
            epoch,
            len(others - members),
        )
    return [np.asarray(a) for a in averaged.average], len(spec.members), whole
