"""A PowerSGD round (:class:`dedloc_jax.PowerSGD`): one group, two all-reduces.

The group is formed once; phase P all-reduces every compressed leaf's ``M Q`` with the
uncompressed leaves, phase Q every ``M^T P`` (:mod:`dedloc_jax.powersgd` has the arithmetic).
Both go through :meth:`Averager.all_reduce` with the same group and weights, so the LP's split,
repair, CenteredClip and verification apply to each, and each phase's timeout follows the LP
bound of its own bytes (:func:`wire_bytes` is both phases' total). Phase Q's round ID is
derived from the group's digest: the service keeps a finished round's ID for a while.

What the transform sends is ``[*M, *Q, leaves]``; what it gets back ``[*mean, *Q, *error]``.
A round that averaged with nobody hands back the peer's own ``M`` as the mean, its ``Q``
unchanged and zero errors (a round skipped, ``on_no_group="skip"``, zero means only).
One group only: an epoch split into several groups steps with its group's mean, incomplete
(a low-rank mean of two groups is not the low-rank mean of the whole).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence

import numpy as np
import trio

from dedloc_jax.averaging import GroupSpec, Member
from dedloc_jax.averaging.leaf_codecs import LeafCodecs
from dedloc_jax.averaging.partition import share_bounds
from dedloc_jax.history import RoundOutcome
from dedloc_jax.powersgd import LowRankPlan, PowerSGD, unpack_leaf_count
from dedloc_jax.rounds.average import NO_GROUP, Averager, RoundTerms
from dedloc_jax.rounds.deadlines import Deadlines

log = logging.getLogger(__name__)


def phase_q_id(spec: GroupSpec) -> bytes:
    """Phase Q's round ID: another than phase P's (the group's digest), the same for all."""
    return hashlib.sha256(spec.digest + b"/powersgd-q").digest()


def wire_bytes(plan: LowRankPlan, parts: Sequence[int], chunk_elems: int) -> int:
    """Bytes of one member's two phases on the wire, as a round with share ``parts`` cuts
    them (what the deadlines model and the benchmarks count)."""
    total = 0
    for shapes in (plan.phase_p_shapes(), plan.q_shapes()):
        if shapes:
            codecs = LeafCodecs.of_shapes(plan.cfg.codec, shapes)
            total += codecs.wire_bytes(share_bounds(codecs.size, parts), chunk_elems)
    return total


def _alone(plan: LowRankPlan, ms: list[np.ndarray], qs: list[np.ndarray]) -> list[np.ndarray]:
    """What a round that averaged with nobody hands back: own M, Q unchanged, zero errors."""
    return [*ms, *qs, *(np.zeros_like(ms[i]) for i in plan.compressed)]


def _phase_p_spread(
    rounds: Averager, this: RoundTerms, spec: GroupSpec, sent_p: Sequence[np.ndarray]
) -> float:
    """How far apart members may end phase P, so start phase Q: its all-reduce's timeout, the
    verification's statements and the convictions' publishing after it. (Without it, phase Q's
    reducers of a 40-peer run stopped collecting parts half its 5 s timeout after their own
    start, before members still checking phase P began: most rounds failed.)"""
    config = rounds.all_reduce_config() or rounds.service.config
    spread = rounds.deadlines(this.deadlines, spec, sent_p, this.codec).averaging
    if rounds.verify:
        spread += config.verify_timeout or config.stall_timeout
    return spread + rounds.convict_seconds


async def powersgd_round(
    rounds: Averager,
    epoch: int,
    me: Member,
    arrays: Sequence[np.ndarray],
    cfg: PowerSGD,
    *,
    deadlines: Deadlines,
    target: float,
    expected: set[str],
    on_averaged: Callable[[GroupSpec], None] | None = None,
) -> RoundOutcome:
    """Average ``[*M, *Q, leaves]`` (``me.weight`` samples) in two phases with a group for
    ``epoch`` (see the module docstring); as :func:`~.average.average_round` otherwise."""
    count = unpack_leaf_count(arrays)
    plan = cfg.plan([tuple(np.shape(a)) for a in arrays[:count]])
    ms, qs = plan.unpack_sent(arrays)
    started = trio.current_time()
    spec = await rounds.group(epoch, me, target=target, expected=expected, deadlines=deadlines)
    this = RoundTerms(epoch, deadlines, cfg.codec, target, me.mode)
    result = this.outcome(_alone(plan, ms, qs), 1, False, NO_GROUP)
    if spec is not None:
        result = await _two_phases(rounds, this, spec, me, plan, ms, qs)
        if result.group is not None and on_averaged is not None:
            on_averaged(spec)
    rounds.matchmaker.decline(epoch)
    rounds.across.close(epoch)
    if result.complete and result.group_size == 1:
        result = dataclasses.replace(result, reason="averaged with no other peer")
    return dataclasses.replace(result, seconds=trio.current_time() - started)


async def _two_phases(
    rounds: Averager,
    this: RoundTerms,
    spec: GroupSpec,
    me: Member,
    plan: LowRankPlan,
    ms: list[np.ndarray],
    qs: list[np.ndarray],
) -> RoundOutcome:
    """Phases P and Q in ``spec``; a failure of either is the round's (own M, as alone)."""
    c = len(plan.compressed)
    codec = plan.cfg.codec
    log.debug(  # every round: a user reads the trainer's epoch line, not these
        "epoch %d: PowerSGD group of %d, %d of %d leaves at rank %d",
        this.epoch,
        len(spec.members),
        c,
        len(plan.shapes),
        plan.cfg.rank,
    )
    started = trio.current_time()
    sent_p = plan.phase_p(ms, qs)
    got, failure = await rounds.all_reduce(
        spec,
        sent_p,
        me.weight,
        codec,
        this.deadlines,
        adopt=False,  # (after phase Q)
    )
    if got is None:
        reason = f"phase P failed: {failure}"
        return this.outcome(_alone(plan, ms, qs), 1, False, reason, error=failure)
    phase_p_end = trio.current_time()
    mean_p = [np.asarray(a, np.float32) for a in got.average]
    ps, local_qs = plan.phase_q(ms, mean_p[:c])
    mean_qs: list[np.ndarray] = []
    if c:
        late = _phase_p_spread(rounds, this, spec, sent_p)
        got_q, failure = await rounds.all_reduce(
            spec,
            local_qs,
            me.weight,
            codec,
            this.deadlines,
            round_id=phase_q_id(spec),
            late_start=late,
        )
        if got_q is None:
            reason = f"phase Q failed: {failure}"
            return this.outcome(_alone(plan, ms, qs), 1, False, reason, error=failure)
        mean_qs = [np.asarray(a, np.float32) for a in got_q.average]
    mean, errors = plan.finish(ms, ps, mean_qs, mean_p[c:])
    next_q = plan.next_q(mean_qs)
    log.debug(
        "epoch %d: PowerSGD phases P and Q took %.1f s and %.1f s",
        this.epoch,
        phase_p_end - started,
        trio.current_time() - phase_p_end,
    )
    size = len(spec.members)
    if rounds.matchmaker.needs_cross(this.epoch):
        reason = "several groups: a PowerSGD round averages within one group"
        return this.outcome([*mean, *next_q, *errors], size, False, reason, group=spec)
    return this.outcome([*mean, *next_q, *errors], size, True, "", group=spec)
