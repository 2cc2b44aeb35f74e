"""One averaging round, the same for trainers and aux peers: form the group, all-reduce in it,
and, when the epoch has several groups, average across them.

Every averaging failure (:class:`AllReduceError`, :class:`GroupError`, also wrapped by a
round's nursery) ends in :meth:`Averager.all_reduce` as a result that says why; anything else
propagates.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import trio

from dedloc_jax.averaging import (
    AllReduceConfig,
    AllReduceError,
    AllReduceResult,
    AveragingService,
    GroupError,
    GroupSpec,
    Member,
    all_reduce,
)
from dedloc_jax.averaging.leaf_codecs import LeafCodecs
from dedloc_jax.averaging.links import LinkKeeper
from dedloc_jax.averaging.partition import share_bounds
from dedloc_jax.bans import Bans
from dedloc_jax.history import RoundOutcome
from dedloc_jax.rounds.across import AcrossGroups, averaged_weight, broadcast_codec, cross_average
from dedloc_jax.rounds.claims import weightless
from dedloc_jax.rounds.deadlines import Deadlines
from dedloc_jax.rounds.early import EarlyGroups
from dedloc_jax.rounds.gather import SparseGather
from dedloc_jax.rounds.matchmaking import Matchmaker
from dedloc_jax.rounds.wire import member_for
from dedloc_jax.topk import TopK, decode, pack, unpack
from p2p.node import Node

log = logging.getLogger(__name__)

NO_GROUP = "no group formed in time (nobody else registered for this epoch)"


def wire_bytes(arrays: Sequence[np.ndarray], codec: str, spec: GroupSpec, chunk_elems: int) -> int:
    """The bytes of one member's vector on the wire: the arrays in ``codec`` as ``spec``'s
    round cuts them into shares and chunks (the encoded parts' sizes, exactly)."""
    shapes = [tuple(np.shape(a)) for a in arrays]
    plan = LeafCodecs.of_shapes(codec, shapes)
    return plan.wire_bytes(share_bounds(plan.size, spec.share_parts()), chunk_elems)


class PeerTable(Protocol):
    """What a round reads anew from the peer's progress tracker
    (:class:`~dedloc_jax.tracker.ProgressTracker`)."""

    mode: str
    """How this peer takes part now ("node", "client", "aux")."""
    dht_latency: float
    """Smoothed seconds per DHT read."""

    def weighed(self, void: set[str], counted: set[str]) -> None:
        """A verified round weighed nothing of ``void``'s contributions and something of
        ``counted``'s: the sample claims of the first stop counting, the others' count again
        (:func:`~dedloc_jax.rounds.claims.weightless`)."""


@dataclass(frozen=True)
class Averager:
    """A peer's round machinery, made once with the peer: its node's all-reduce service,
    matchmaker and round across groups, its links (whose meter its all-reduces feed), and the
    progress table it reads anew each round."""

    service: AveragingService
    matchmaker: Matchmaker
    across: AcrossGroups
    links: LinkKeeper
    table: PeerTable
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
    early: EarlyGroups | None = None
    """Groups formed ahead of the target (None: each when its round begins)."""

    @property
    def node(self) -> Node:
        return self.service.node

    def member(self, weight: float) -> Member:
        """This peer's member entry now: its mode and measured links, bringing ``weight``."""
        up, down = self.links.bandwidth()
        return member_for(str(self.node.peer_id), self.table.mode, up, down, weight)

    async def group(
        self,
        epoch: int,
        me: Member,
        *,
        target: float,
        expected: set[str],
        deadlines: Deadlines,
    ) -> GroupSpec | None:
        """``epoch``'s level-0 group (None: go alone), planned ahead of the target if that
        began (:meth:`EarlyGroups.group`); ``me``: what we bring now."""
        if self.early is None:
            return await self.matchmaker.form_group(
                epoch, me, target=target, expected=expected, deadlines=deadlines
            )
        return await self.early.group(
            epoch, me, target=target, expected=expected, deadlines=deadlines
        )

    def all_reduce_config(self) -> AllReduceConfig | None:
        """The node's all-reduce settings with this run's robust aggregation and checks."""
        robust = self.robust or self.robust_tau is not None
        if not robust and not self.verify:
            return None
        return self.service.config.replace(
            robust=robust, robust_tau=self.robust_tau, verify=self.verify
        )

    def deadlines(
        self, base: Deadlines, spec: GroupSpec, arrays: Sequence[np.ndarray], codec: str
    ) -> Deadlines:
        """The round's deadlines: ``base``'s (the matchmaking window's) and the group's LP
        bound's for the vector's bytes in ``codec``."""
        chunk = self.service.config.chunk_elems
        return base.for_group(
            spec.lower_bound(wire_bytes(arrays, codec, spec, chunk)),
            self.table.dht_latency,
            override=self.averaging_timeout,
        )

    async def all_reduce(
        self,
        spec: GroupSpec,
        arrays: Sequence[np.ndarray],
        weight: float,
        codec: str,
        deadlines: Deadlines,
        *,
        round_id: bytes | None = None,
        late_start: float = 0.0,
        adopt: bool = True,
        weighs: bool = True,
    ) -> tuple[AllReduceResult | None, str]:
        """The all-reduce of ``arrays`` (``weight`` samples) in ``spec``, or None and why it
        failed (an averaging error, also one the round's nursery wrapped); anything else
        propagates. ``round_id``: None, the group's digest (a second all-reduce in the same
        group names another). ``late_start``: how far apart members may start it (a second
        all-reduce starts when each member's first ended): reducers wait that much longer
        for parts (the timeout grows by it over ``collect_fraction``). ``adopt``: read
        others' bans after it (:meth:`convict`); False between two all-reduces of a round.
        ``weighs``: its senders' own contributions are weighed (level 0: the verdicts go to
        the table; False across groups, where a sender brings its group's mean)."""
        config = self.all_reduce_config()
        timeout = self.deadlines(deadlines, spec, arrays, codec).averaging
        if late_start > 0:
            timeout += late_start / (config or self.service.config).collect_fraction
        try:
            result = await all_reduce(
                self.service,
                spec,
                list(arrays),
                weight,
                codec=codec,
                timeout=timeout,
                meter=self.links.meter,
                config=config,
                round_id=round_id,
            )
        except (AllReduceError, GroupError) as e:
            return None, str(e)
        except BaseExceptionGroup as group:
            return None, str(_only_averaging(group))
        await self.convict(result, adopt=adopt)
        if weighs:
            self.table.weighed(*weightless(result.kept))
        return result, ""

    @property
    def convict_seconds(self) -> float:
        """The longest :meth:`convict` takes after an all-reduce."""
        return 0.0 if self.bans is None else self.table.dht_latency * 4 + 5.0

    async def convict(self, result: AllReduceResult, *, adopt: bool = True) -> None:
        """Ban the peers a round caught lying, publish it, and (``adopt``) adopt others'
        proven bans. Between PowerSGD's phases a member reading the bans (a DHT read, up to
        0.3 s at 40 peers) began phase Q that much later, and every reducer waited for it."""
        if self.bans is not None:
            for accusation in result.accusations:
                self.bans.convict(accusation)
            with trio.move_on_after(self.convict_seconds):
                await self.bans.publish()
                if adopt:
                    await self.bans.refresh()


def _only_averaging(group: BaseExceptionGroup) -> BaseExceptionGroup:
    """The averaging failures a round's nursery wrapped in a group (e.g. a share lost even
    after repair); anything else in the group is re-raised."""
    failed, rest = group.split((AllReduceError, GroupError))
    if rest is not None or failed is None:
        raise group
    return failed


async def average_round(
    rounds: Averager,
    epoch: int,
    me: Member,
    arrays: Sequence[np.ndarray],
    *,
    deadlines: Deadlines,
    codec: str,
    target: float,
    expected: set[str],
    on_averaged: Callable[[GroupSpec], None] | None = None,
) -> RoundOutcome:
    """Average ``arrays`` (``me.weight`` samples; an aux peer's are a template of zeros) with
    a group for ``epoch``, sent in ``codec``, within ``deadlines`` (the round's matchmaking
    window; the all-reduce's follow from the group). Registration closes as soon as every
    ``expected`` peer is in (or later while the registered samples fall short of
    ``target``). ``on_averaged(spec)`` runs once the group's all-reduce succeeded, before any
    round across groups. The peer takes no part in the epoch's rounds afterwards. The
    outcome holds the mean (this peer's own arrays when no group averaged); its
    ``collab_samples`` is left to the caller."""
    if isinstance(codec, TopK):
        return await _sparse_round(
            rounds, epoch, me, arrays, codec, target, expected, on_averaged, deadlines
        )
    matchmaker = rounds.matchmaker
    started = trio.current_time()
    spec = await rounds.group(epoch, me, target=target, expected=expected, deadlines=deadlines)
    own = [np.asarray(a) for a in arrays]
    this = RoundTerms(epoch, deadlines, codec, target, me.mode)
    result = this.outcome(own, 1, False, NO_GROUP)
    if spec is not None:
        result = await _in_group(rounds, this, spec, me, arrays, started, on_averaged)
    elif matchmaker.needs_cross(epoch) and me.sends:  # alone among several groups
        # the representatives we averaged with are our mates (they vouch for us, we for them)
        mean, size, whole = await cross_average(
            rounds, this, None, own, me.weight, deadlines, on_averaged
        )
        reason = "alone in our group, and the round across groups failed"
        result = this.outcome(mean, size, whole, reason, across=True)
    matchmaker.decline(epoch)  # no-ops if it took part in the round across groups
    rounds.across.close(epoch)
    reason = result.reason
    if result.complete:
        reason = "" if result.group_size > 1 else "averaged with no other peer"
    return dataclasses.replace(result, reason=reason, seconds=trio.current_time() - started)


@dataclass(frozen=True)
class RoundTerms:
    """What every stage of one round shares: the epoch, the window's deadlines, the codec, the
    target and how this peer takes part."""

    epoch: int
    deadlines: Deadlines
    codec: str
    target: float
    mode: str

    def outcome(
        self, mean: list[np.ndarray], size: int, complete: bool, reason: str, **rest: Any
    ) -> RoundOutcome:
        """This round's outcome (its time is set once it ends)."""
        return RoundOutcome(self.epoch, size, complete, 0.0, 0.0, reason, self.mode, mean, **rest)


async def _in_group(
    rounds: Averager,
    this: RoundTerms,
    spec: GroupSpec,
    me: Member,
    arrays: Sequence[np.ndarray],
    started: float,
    on_averaged: Callable[[GroupSpec], None] | None,
) -> RoundOutcome:
    """The level-0 all-reduce in ``spec``, then the round across groups if the leader saw
    several groups. An aux member's template of zeros stands in for the mean it holds none
    of."""
    epoch = this.epoch
    own = [np.asarray(a) for a in arrays]
    try:
        deadlines = rounds.deadlines(this.deadlines, spec, arrays, this.codec)
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
        averaged, failure = await rounds.all_reduce(
            spec, arrays, me.weight, this.codec, this.deadlines
        )
    if averaged is None:
        return this.outcome(own, 1, False, f"the all-reduce failed: {failure}", error=failure)
    if on_averaged is not None:
        on_averaged(spec)
    mean = [np.asarray(a) for a in averaged.average] if me.sends else own
    size = len(spec.members)
    if not rounds.matchmaker.needs_cross(epoch):
        return this.outcome(mean, size, True, "", group=spec)
    weight = averaged_weight(spec, averaged) if me.sends else 0.0
    # the round across groups is timed in the broadcast's codec (no fewer bytes than ours)
    across = rounds.deadlines(this.deadlines, spec, arrays, broadcast_codec(this.codec))
    mean, _, whole = await cross_average(rounds, this, spec, mean, weight, across)
    missed = "the round across groups missed some of them"
    return this.outcome(mean, size, whole, missed, group=spec, across=True)


async def _sparse_round(
    rounds: Averager,
    epoch: int,
    me: Member,
    arrays: Sequence[np.ndarray],
    cfg: TopK,
    target: float,
    expected: set[str],
    on_averaged: Callable[[GroupSpec], None] | None,
    deadlines: Deadlines,
) -> RoundOutcome:
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
    started = trio.current_time()
    spec = await rounds.group(epoch, me, target=target, expected=expected, deadlines=deadlines)
    this = RoundTerms(epoch, deadlines, "topk", target, me.mode)
    result = this.outcome(own, 1, False, NO_GROUP)
    if spec is not None:
        # each member downloads every other payload: as a butterfly moving half of that
        volume = len(spec.members) * cfg.payload_bytes(n) // 2
        timeout = deadlines.for_group(
            spec.lower_bound(volume), rounds.table.dht_latency, override=rounds.averaging_timeout
        ).averaging
        robust = rounds.robust or rounds.robust_tau is not None
        got = await rounds.gather.gather(
            spec, cfg, data if me.sends else None, n, me.weight, timeout=timeout, robust=robust
        )
        if got.complete and on_averaged is not None:
            on_averaged(spec)
        reason = "" if got.complete else "some members' sparse payloads never came"
        if got.complete and rounds.matchmaker.needs_cross(epoch):
            reason = "several groups: sparse payloads are gathered within a group only"
        result = this.outcome([got.mean], len(got.included), not reason, reason, group=spec)
    rounds.matchmaker.decline(epoch)
    rounds.across.close(epoch)
    if result.complete and result.group_size == 1:
        result = dataclasses.replace(result, reason="averaged with no other peer")
    return dataclasses.replace(result, seconds=trio.current_time() - started)
