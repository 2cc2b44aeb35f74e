"""One averaging round, the same for trainers and aux peers: form the group, all-reduce in it,
and, when the epoch has several groups, average across them.

Every averaging failure (:class:`AllReduceError`, :class:`GroupError`, also wrapped by a
round's nursery) ends in :meth:`Rounds.all_reduce` as a result that says why; anything else
propagates.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from dedloc_jax.averaging import (
    AllReduceConfig,
    AllReduceError,
    AllReduceResult,
    BandwidthMeter,
    GroupError,
    GroupSpec,
    Member,
    all_reduce,
    install,
)
from dedloc_jax.bans import Bans
from dedloc_jax.round.across import AcrossGroups, averaged_weight, broadcast, representative
from dedloc_jax.round.deadlines import Deadlines
from dedloc_jax.round.gather import SparseGather
from dedloc_jax.round.matchmaking import Matchmaker
from dedloc_jax.topk import TopK, decode, pack, unpack

log = logging.getLogger(__name__)

NO_GROUP = "no group formed in time (nobody else registered for this epoch)"


def _vector_bytes(arrays: Sequence[np.ndarray]) -> int:
    """The bytes one member sends: every array as float32."""
    return sum(int(np.asarray(a).size) * 4 for a in arrays)


@dataclass(frozen=True)
class Rounds:
    """A peer's round machinery, made once with the peer: its node, matchmaker and round
    across groups, the meter its all-reduces feed, and what it reads anew each round."""

    node: Any
    matchmaker: Matchmaker
    across: AcrossGroups
    meter: BandwidthMeter
    member: Callable[[float], Member]
    """This peer's member entry now (mode, measured links), bringing a weight."""
    dht_latency: Callable[[], float]
    averaging_timeout: float | None = None
    """A user-set all-reduce timeout (None: from the group's LP bound)."""
    robust_tau: float | None = None
    """CenteredClip's fixed radius for this run (None: derived from the parts)."""
    robust: bool = False
    """Whether reducers use CenteredClip (``robust_tau`` set implies it)."""
    verify: bool = False
    """Whether every member checks every reducer's result (:mod:`~dedloc_jax.averaging.audit`)."""
    bans: Bans | None = None
    """Where caught liars go (and are published); None: nobody is banned."""
    gather: SparseGather | None = None
    """The all-gather of sparse payloads (``codec`` a :class:`~dedloc_jax.TopK`)."""

    def all_reduce_config(self) -> AllReduceConfig | None:
        """The node's all-reduce settings with this run's robust aggregation and checks."""
        robust = self.robust or self.robust_tau is not None
        if not robust and not self.verify:
            return None
        return install(self.node).config.replace(
            robust=robust, robust_tau=self.robust_tau, verify=self.verify
        )

    def deadlines(self, spec: GroupSpec, arrays: Sequence[np.ndarray]) -> Deadlines:
        """The round's deadlines: the matchmaking window's and the group's LP bound's."""
        return self.matchmaker.deadlines.for_group(
            spec.lower_bound(_vector_bytes(arrays)),
            self.dht_latency(),
            override=self.averaging_timeout,
        )

    def cross_wait(self, spec: GroupSpec | None, arrays: Sequence[np.ndarray]) -> float:
        """How long a member waits for its representative's round across groups."""
        if spec is None:
            return self.matchmaker.deadlines.cross_wait
        return self.deadlines(spec, arrays).cross_wait

    async def all_reduce(
        self, spec: GroupSpec, arrays: Sequence[np.ndarray], weight: float, codec: str
    ) -> tuple[AllReduceResult | None, str]:
        """The all-reduce of ``arrays`` (``weight`` samples) in ``spec``, or None and why it
        failed (an averaging error, also one the round's nursery wrapped); anything else
        propagates."""
        try:
            result = await all_reduce(
                self.node,
                spec,
                list(arrays),
                weight,
                codec=codec,
                timeout=self.deadlines(spec, arrays).averaging,
                meter=self.meter,
                config=self.all_reduce_config(),
            )
        except (AllReduceError, GroupError) as e:
            return None, str(e)
        except BaseExceptionGroup as group:
            return None, str(_only_averaging(group))
        if self.bans is not None:
            for accusation in result.accusations:
                self.bans.convict(accusation)
            with trio.move_on_after(self.dht_latency() * 4 + 5.0):
                await self.bans.publish()
                await self.bans.refresh()
        return result, ""


@dataclass(frozen=True)
class RoundResult:
    """What one round gave a peer."""

    average: list[np.ndarray]
    """The mean this peer steps with: its own arrays when no group averaged."""
    group_size: int
    """Members of the group behind the mean (1: none)."""
    complete: bool
    """Whether the mean is the whole epoch's (every group's, when there were several)."""
    reason: str
    """Why the round fell short ("" when complete in a group)."""
    group: GroupSpec | None = None
    """The level-0 group whose all-reduce succeeded (None: none formed, or it failed)."""
    error: str | None = None
    """The level-0 all-reduce's failure, if it failed."""
    across: bool = False
    """Whether the epoch's groups were averaged across (the leader saw several groups)."""


def _only_averaging(group: BaseExceptionGroup) -> BaseExceptionGroup:
    """The averaging failures a round's nursery wrapped in a group (e.g. a share lost even
    after repair); anything else in the group is re-raised."""
    failed, rest = group.split((AllReduceError, GroupError))
    if rest is not None or failed is None:
        raise group
    return failed


async def average_round(
    rounds: Rounds,
    epoch: int,
    me: Member,
    arrays: Sequence[np.ndarray],
    *,
    codec: str,
    target: float,
    expected: set[str],
    on_averaged: Callable[[GroupSpec], None] | None = None,
) -> RoundResult:
    """Average ``arrays`` (``me.weight`` samples; an aux peer's are a template of zeros) with
    a group for ``epoch``, sent in ``codec``. Registration closes as soon as every
    ``expected`` peer is in (or later while the registered samples fall short of
    ``target``). ``on_averaged(spec)`` runs once the group's all-reduce succeeded, before any
    round across groups. The peer takes no part in the epoch's rounds afterwards."""
    if isinstance(codec, TopK):
        return await _sparse_round(rounds, epoch, me, arrays, codec, target, expected, on_averaged)
    matchmaker = rounds.matchmaker
    started = trio.current_time()
    spec = await matchmaker.form_group(epoch, me, target=target, expected=expected)
    own = [np.asarray(a) for a in arrays]
    result = RoundResult(own, 1, False, NO_GROUP)
    if spec is not None:
        result = await _in_group(
            rounds, epoch, spec, me, arrays, codec, target, started, on_averaged
        )
    elif matchmaker.needs_cross(epoch) and me.sends:  # alone among several groups
        mean, size, whole = await _across(rounds, epoch, None, own, me.weight, codec, target=target)
        reason = "alone in our group, and the round across groups failed"
        result = RoundResult(mean, size, whole, reason, across=True)
    matchmaker.decline(epoch)  # no-ops if it took part in the round across groups
    rounds.across.close(epoch)
    if result.complete:
        reason = "" if result.group_size > 1 else "averaged with no other peer"
        result = dataclasses.replace(result, reason=reason)
    return result


async def _in_group(
    rounds: Rounds,
    epoch: int,
    spec: GroupSpec,
    me: Member,
    arrays: Sequence[np.ndarray],
    codec: str,
    target: float,
    started: float,
    on_averaged: Callable[[GroupSpec], None] | None,
) -> RoundResult:
    """The level-0 all-reduce in ``spec``, then the round across groups if the leader saw
    several groups. An aux member's template of zeros stands in for the mean it holds none
    of."""
    own = [np.asarray(a) for a in arrays]
    try:
        deadlines = rounds.deadlines(spec, arrays)
    except GroupError as e:  # a spec without a share split: as a failed all-reduce
        averaged, failure = None, str(e)
    else:
        log.info(
            "epoch %d: group of %d after %.1f s, LP bound %.1f s, timeout %.1f s",
            epoch,
            len(spec.members),
            trio.current_time() - started,
            deadlines.lp_bound,
            deadlines.averaging,
        )
        averaged, failure = await rounds.all_reduce(spec, arrays, me.weight, codec)
    if averaged is None:
        return RoundResult(own, 1, False, f"the all-reduce failed: {failure}", error=failure)
    if on_averaged is not None:
        on_averaged(spec)
    mean = [np.asarray(a) for a in averaged.average] if me.sends else own
    size = len(spec.members)
    if not rounds.matchmaker.needs_cross(epoch):
        return RoundResult(mean, size, True, "", spec)
    weight = averaged_weight(spec, averaged) if me.sends else 0.0
    mean, _, whole = await _across(rounds, epoch, spec, mean, weight, codec, target=target)
    missed = "the round across groups missed some of them"
    return RoundResult(mean, size, whole, missed, spec, None, True)


async def _across(
    rounds: Rounds,
    epoch: int,
    spec: GroupSpec | None,
    mean: list[np.ndarray],
    weight: float,
    codec: str,
    *,
    target: float,
) -> tuple[list[np.ndarray], int, bool]:
    """The mean across this epoch's groups (see :mod:`dedloc_jax.round.across`), the size of
    the level-1 group (1 when this peer did not represent its group there) and whether
    that is the whole epoch's mean; ``mean`` itself when it failed."""
    me = str(rounds.node.peer_id)
    rep = me if spec is None else representative(spec)
    wait = rounds.cross_wait(spec, mean)
    rounds.across.begin(wait)
    size = 1
    if rep == me:
        ok, whole, found = False, False, None
        try:
            found = await represent(rounds, epoch, mean, weight, codec, target=target)
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
    out = await broadcast(
        rounds.node,
        spec,
        mean,
        source=rep == me,
        codec=codec,
        timeout=rounds.deadlines(spec, mean).averaging,
    )
    if out is None:  # the representative holds the mean across groups all the same
        return mean, 1, rep == me and whole
    return out, size, whole


async def represent(
    rounds: Rounds,
    epoch: int,
    mean: list[np.ndarray],
    weight: float,
    codec: str,
    *,
    target: float,
) -> tuple[list[np.ndarray], int, bool] | None:
    """As its group's representative, average ``mean`` (``weight`` samples) with the other
    groups' representatives: the result, how many there were and whether every
    representative our leader's partition named took part (else the mean is partial), or
    None."""
    me = rounds.member(weight)
    others = rounds.matchmaker.representatives(epoch) - {me.peer_id}
    spec = await rounds.matchmaker.form_group(epoch, me, target=target, expected=others, level=1)
    if spec is None:
        return None
    averaged, failure = await rounds.all_reduce(spec, mean, weight, codec)
    if averaged is None:
        log.warning("averaging across groups at epoch %d failed: %s", epoch, failure)
        return None
    members = {m.peer_id for m in spec.members}
    whole = others <= members
    if not whole:
        log.info(
            "epoch %d: %d of the groups' representatives missed the round across groups",
            epoch,
            len(others - members),
        )
    return [np.asarray(a) for a in averaged.average], len(spec.members), whole


async def _sparse_round(
    rounds: Rounds,
    epoch: int,
    me: Member,
    arrays: Sequence[np.ndarray],
    cfg: TopK,
    target: float,
    expected: set[str],
    on_averaged: Callable[[GroupSpec], None] | None,
) -> RoundResult:
    """A round of sparse payloads: ``arrays`` are (offsets, codes, scales, size) of
    :func:`dedloc_jax.topk.encode`; the group all-gathers them (no reducers: ARCHITECTURE.md
    says why) and the result is the dense mean. One group only: an epoch split into several
    groups steps with its group's mean, incomplete."""
    if rounds.gather is None:
        raise ValueError("this peer has no sparse gather: TopK needs a CollaborationPeer")
    offsets, codes, scales, size = (np.asarray(a) for a in arrays)
    n = int(size)
    data = pack(cfg, unpack(cfg, pack(cfg, (offsets, codes, scales), n), n), n)
    own = [decode(cfg, unpack(cfg, data, n), n)]
    spec = await rounds.matchmaker.form_group(epoch, me, target=target, expected=expected)
    result = RoundResult(own, 1, False, NO_GROUP)
    if spec is not None:
        # each member downloads every other payload: as a butterfly moving half of that
        volume = len(spec.members) * cfg.payload_bytes(n) // 2
        timeout = rounds.matchmaker.deadlines.for_group(
            spec.lower_bound(volume), rounds.dht_latency(), override=rounds.averaging_timeout
        ).averaging
        got = await rounds.gather.gather(
            spec, cfg, data if me.sends else None, n, me.weight, timeout=timeout
        )
        if got.complete and on_averaged is not None:
            on_averaged(spec)
        reason = "" if got.complete else "some members' sparse payloads never came"
        if got.complete and rounds.matchmaker.needs_cross(epoch):
            reason = "several groups: sparse payloads are gathered within a group only"
        result = RoundResult([got.mean], len(got.included), not reason, reason, spec)
    rounds.matchmaker.decline(epoch)
    rounds.across.close(epoch)
    if result.complete and result.group_size == 1:
        result = dataclasses.replace(result, reason="averaged with no other peer")
    return result
