"""One averaging step of a peer and what it leaves behind (:class:`Stepper`): the round's
deadlines from the peer's predictions, the round, then the bookkeeping (whether the mean is
the epoch's, the tracker's epoch, the next round's mates, the history)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import trio

from dedloc_jax.averaging import GroupSpec
from dedloc_jax.config import CollaborationConfig
from dedloc_jax.history import RoundOutcome
from dedloc_jax.powersgd import PowerSGD, unpack_leaf_count
from dedloc_jax.progress import CollaborationEstimate
from dedloc_jax.rounds.average import Averager, average_round
from dedloc_jax.rounds.deadlines import Deadlines, matchmaking_window
from dedloc_jax.rounds.lowrank import powersgd_round
from dedloc_jax.snapshot import others_train
from dedloc_jax.state.serving import StateServer

if TYPE_CHECKING:
    from dedloc_jax.tracker import ProgressTracker

log = logging.getLogger(__name__)


class Stepper:
    """A peer's averaging steps: ``rounds`` runs them, ``tracker`` learns where each left the
    peer, ``server`` tells whether a new state follows; one :class:`RoundOutcome` per step in
    :attr:`history`."""

    def __init__(
        self,
        rounds: Averager,
        tracker: ProgressTracker,
        server: StateServer,
        config: CollaborationConfig,
    ) -> None:
        self.rounds = rounds
        self.tracker = tracker
        self.server = server
        self.config = config
        self.history: list[RoundOutcome] = []  # one entry per averaging step
        self.absences = Absences(tracker)

    def poll(self, expected: Iterable[str]) -> float | None:
        """The longest poll that we and each ``expected`` peer announce (seconds between
        checks inside a micro-step whether to average: :attr:`PeerProgress.poll`), None when
        one of us announces none or has no record (aux peers compute no micro-steps: they
        do not count). The claim is untrusted: a peer that announces a poll and checks only
        between long micro-steps notices the target late and loses its own place in the
        round, nobody else's."""
        tracker = self.tracker
        polls = [tracker.poll]
        for peer in expected:
            record = tracker.records.get(peer) if peer != tracker.peer_id else None
            if peer != tracker.peer_id and (record is None or record.mode != "aux"):
                polls.append(None if record is None else record.poll)
        return None if None in polls else max(p for p in polls if p is not None)

    def deadlines(self, est: CollaborationEstimate, expected: Iterable[str] = ()) -> Deadlines:
        """This round's deadlines: the configured matchmaking window, else the predicted one.
        When we and every ``expected`` peer check mid-step (:meth:`poll`), we notice the
        target a poll apart, not the slowest peer's micro-step: the window counts the poll,
        and the matchmaking is eager (:class:`~dedloc_jax.rounds.matchmaking.Matchmaker`).
        Otherwise a peer that looks only between micro-steps would miss the short window."""
        config = self.config
        step = est.max_step_interval
        poll = self.poll(expected)
        if poll is not None:
            step = min(step, poll)
        return Deadlines(
            window=config.rounds.matchmaking_time
            or matchmaking_window(config.progress.min_refresh, self.tracker.dht_latency, step),
            eager=poll is not None,
        )

    def match_early(
        self,
        epoch: int,
        samples: int,
        est: CollaborationEstimate,
        expected: Callable[[], set[str]],
    ) -> None:
        """Begin ``epoch``'s matchmaking now if its target is nearer than a matchmaking takes
        (:mod:`~dedloc_jax.rounds.early`); we keep computing meanwhile. Our weight in the group
        is the samples we expect to hold at the target; ``expected()``: whom to wait for."""
        early = self.rounds.early
        if early is None or not self.config.rounds.match_early:
            return
        deadlines = self.deadlines(est, expected())
        if not early.due(epoch, est.eta, deadlines):
            return
        rate = self.tracker.own_progress().samples_per_second
        me = self.rounds.member(float(samples) + max(0.0, rate) * est.eta)
        target = float(self.tracker.target or 0)
        early.begin(epoch, me, target=target, expected=expected(), deadlines=deadlines)

    async def step(
        self,
        epoch: int,
        arrays: Sequence[np.ndarray],
        samples: int,
        *,
        codec: str | PowerSGD | None,
        expected: set[str],
    ) -> RoundOutcome:
        """Average ``arrays`` (weight ``samples``) with ``epoch``'s group, waiting for the
        ``expected`` peers, then move the tracker to the next epoch: the round's record, with
        the mean to step with in ``average``."""
        tracker = self.tracker
        est = tracker.current_estimate()
        early = self.rounds.early
        # a matchmaking begun ahead of the target keeps its deadlines
        deadlines = (early and early.began(epoch)) or self.deadlines(est, expected)
        async with trio.open_nursery() as nursery:
            # Others must not extrapolate our samples any further. In an eager round (every
            # peer checks mid-step) we register meanwhile: the store is on the last peer's
            # path; elsewhere the store comes first.
            if not deadlines.eager:
                await tracker.freeze()
            else:
                nursery.start_soon(tracker.freeze)
            got = await self._round(epoch, arrays, samples, codec, deadlines, expected)
        complete, reason = self._judge(epoch, got)
        result = got.average
        if got.group_size == 1 and self.config.rounds.on_no_group == "skip":
            # the mean's shapes (PowerSGD's [*mean, *Q, *error]: its Q is kept)
            kept = len(result) if not isinstance(codec, PowerSGD) else unpack_leaf_count(arrays)
            zeros = [np.zeros_like(np.asarray(a)) for a in result[:kept]]
            result = [*zeros, *result[kept:]]
        outcome = dataclasses.replace(
            got, complete=complete, reason=reason, collab_samples=est.samples, average=result
        )
        # A peer that serves its state serves the new one next (share_state): one record.
        tracker.set_epoch(outcome.next_epoch, state_follows=self.server.latest is not None)
        self.history.append(dataclasses.replace(outcome, average=None, group=None))  # (kept)
        return outcome

    async def _round(
        self,
        epoch: int,
        arrays: Sequence[np.ndarray],
        samples: int,
        codec: str | PowerSGD | None,
        deadlines: Deadlines,
        expected: set[str],
    ) -> RoundOutcome:
        tracker = self.tracker
        me = self.rounds.member(float(samples))

        def mates(spec: GroupSpec) -> None:
            """The next epoch's round expects the peers we averaged with (expected_peers)."""
            tracker.expect_mates(epoch + 1, (m.peer_id for m in spec.members))

        if isinstance(codec, PowerSGD):  # two phases in one group
            got = await powersgd_round(
                self.rounds,
                epoch,
                me,
                arrays,
                codec,
                deadlines=deadlines,
                target=float(tracker.target or 0),
                expected=expected,
                on_averaged=mates,
            )
        else:
            got = await average_round(
                self.rounds,
                epoch,
                me,
                arrays,
                deadlines=deadlines,
                codec=codec or self.config.rounds.codec,
                target=float(tracker.target or 0),
                expected=expected,
                on_averaged=mates,
            )
        return got

    def _judge(self, epoch: int, got: RoundOutcome) -> tuple[bool, str]:
        """Whether the round's mean is the whole epoch's, and why not (logged)."""
        complete, reason = got.complete, got.reason
        in_group = got.group is not None and not got.across
        if in_group and complete and self._stepped_without(got.group, epoch):
            # Peers outside our leader's one group already moved past this epoch: they
            # averaged apart (we came late), so ours is not the epoch's mean.
            complete, reason = False, "others stepped without our group"
        members = set() if got.group is None else {m.peer_id for m in got.group.members}
        self.absences.settle(epoch, members)
        if reason:
            if others_train(self.tracker):
                cause = "alone" if got.group_size == 1 else reason
                level, without = self.absences.judge(members, cause)
            else:  # a run of one peer steps alone by design: that is no news (said once)
                level, without = self.absences.alone(), ""
            log.log(
                level,
                "epoch %d: stepped without the whole collaboration (group of %d): %s%s",
                epoch,
                got.group_size,
                reason,
                without,
            )
        return complete, reason

    def _stepped_without(self, spec: GroupSpec, epoch: int) -> bool:
        """Whether a peer that trains, outside ``spec``, averaged into a newer epoch than
        ``epoch``: a group averaged apart from ours. One that got there alone (a step alone, a
        newcomer that moved on) does not count: it holds no other mean and loads the
        collaboration's state, which our group already holds. Nor does a peer on a lineage the
        collaboration left."""
        members = {m.peer_id for m in spec.members}
        return any(
            r.epoch > epoch and not r.alone and r.mode != "aux" and pid not in members
            for pid, r in self.tracker.contenders().items()
        )

    async def lend(
        self, est: CollaborationEstimate, template: Sequence[np.ndarray], expected: set[str]
    ) -> RoundOutcome:
        """An aux peer's round at ``est.epoch``: reduce a share of the others' arrays
        (``template``: their shapes), then move the tracker to the next epoch."""
        epoch = est.epoch
        early = self.rounds.early
        got = await average_round(
            self.rounds,
            epoch,
            self.rounds.member(0.0),  # (mode "aux")
            template,
            deadlines=(early and early.began(epoch)) or self.deadlines(est, expected),
            codec=self.config.rounds.codec,
            target=float(self.tracker.target or 0),
            expected=expected,
        )
        if got.group is None and got.error is not None:
            log.warning("aux averaging at epoch %d failed: %s", epoch, got.error)
        self.tracker.set_epoch(epoch + 1)
        return got


class Absences:
    """The training peers our steps went without, each warned of once. A mate killed -9
    keeps a record that says it trains until the record lapses (20-90 s), and the one that
    trains on stepped alone every epoch meanwhile with a WARNING each time (16 in one
    README run). Now: one WARNING naming the peers missing, DEBUG while the same peers are
    missing for the same cause, one INFO line when one is back in our group or its record is
    gone. A new cause, a newly missing peer, or a step short with nobody missing (a failure
    among the members) still warns."""

    def __init__(self, tracker: ProgressTracker) -> None:
        self.tracker = tracker
        # peer -> (the cause warned of, its record's epoch then, whether it moved on since);
        # bounded by the progress table (settle forgets the peers it no longer holds)
        self._warned: dict[str, tuple[str, int, bool]] = {}
        self._alone = False  # the last step was a lone peer's, said at INFO already

    def alone(self) -> int:
        """The level of a step while no other peer trains: INFO the first time, DEBUG while
        it stays alone (a trainer whose mates stopped logged it every epoch)."""
        level = logging.DEBUG if self._alone else logging.INFO
        self._alone = True
        return level

    def missing(self, members: set[str]) -> dict[str, int]:
        """The other training peers outside ``members``, each with its record's epoch."""
        me = self.tracker.peer_id
        return {
            pid: r.epoch
            for pid, r in self.tracker.records.items()
            if pid != me and pid not in members and r.mode != "aux" and r.averages
        }

    def judge(self, members: set[str], cause: str) -> tuple[int, str]:
        """The level of a step short of the whole collaboration, and the line's tail naming
        whom it went without; remembers them as warned of for ``cause``. A missing peer's
        record that moved on since the first warning (it trains apart, not stopped) is news
        once more."""
        self._alone = False
        missing = self.missing(members)
        fresh = not missing
        for p, e in missing.items():
            was = self._warned.get(p)
            first = e if was is None or was[0] != cause else was[1]
            now = (cause, first, e > first)
            fresh = fresh or was != now
            self._warned[p] = now
        if not missing:
            return logging.WARNING, ""
        names = ", ".join(f"{p[:8]} (its record at epoch {e})" for p, e in sorted(missing.items()))
        if not fresh:
            return logging.DEBUG, f"; without {names}"
        return logging.WARNING, (
            f"; without {names}: not repeated while it stays missing (until it is back or"
            " its record lapses)"
        )

    def settle(self, epoch: int, members: set[str]) -> None:
        """Forget, with one INFO line each, the peers warned of that are back in our group
        (``members``) or whose records are gone (it left, or its record lapsed)."""
        records = self.tracker.records
        if len(members) > 1:
            self._alone = False
        for p in list(self._warned):
            back = p in members
            gone = p not in records or not records[p].averages
            if back or gone:
                del self._warned[p]
                log.info(
                    "epoch %d: peer %s %s",
                    epoch,
                    p[:8],
                    "is back in our group" if back else "left the progress table: not missed",
                )
