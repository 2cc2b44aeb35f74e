"""Matchmaking ahead of the target (:class:`EarlyGroups`): the slow part of matchmaking runs
while the peer still computes, and the round averages as soon as the target is reached.

A blocking peer used to stop at the target, then spend a whole matchmaking (registration,
waiting for the others' registrations, joins: 7.5 s of a 40-peer run's 28.6 s epochs) before
its all-reduce. hivemind and DeDLOC begin matchmaking when the progress tracker's ETA falls
below the expected matchmaking time; so does a peer here (:meth:`EarlyGroups.due`), with the
time its last matchmakings took. What runs ahead is
:meth:`~dedloc_jax.rounds.matchmaking.Matchmaker.plan_group`: registering (with the samples
we expect to hold at the target, which only tells others whether to wait for more) and reading
the others' registrations, until the groups are planned. The join, which carries the samples
a member holds, waits for the target (:meth:`~dedloc_jax.rounds.matchmaking.Matchmaker.
join_group`): the leader forms the group once it reached the target itself and every planned
member joined, and answers all of them at once, so the spec's weights are the samples each
member averages and the members begin the all-reduce together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import trio

from dedloc_jax.averaging import GroupSpec, Member
from dedloc_jax.bans import Bans
from dedloc_jax.rounds.deadlines import Deadlines
from dedloc_jax.rounds.matchmaking import Matchmaker, PlannedGroup

log = logging.getLogger(__name__)

LEAD_MARGIN = 1.25
"""How much earlier than its last matchmakings took a peer begins the next one."""
SMOOTHING = 0.5
"""Weight of the newest matchmaking in the expected matchmaking time."""


@dataclass
class _Early:
    """One epoch's matchmaking begun ahead of the target."""

    deadlines: Deadlines
    began: float
    done: trio.Event = field(default_factory=trio.Event)
    planned: PlannedGroup | None = None
    error: Exception | None = None


class EarlyGroups:
    """A peer's groups planned ahead of the target, and how long its matchmakings take.

    :meth:`run` must run (a task of the peer) for :meth:`begin` to start anything; without
    it every group forms when the round begins (:meth:`group`), as before."""

    def __init__(self, matchmaker: Matchmaker, bans: Bans | None = None) -> None:
        self.matchmaker = matchmaker
        self.bans = bans  # others' bans are read before planning (left out of our group)
        self._nursery: trio.Nursery | None = None
        self._epochs: dict[int, _Early] = {}
        self._seconds: float | None = None  # smoothed seconds to plan a group

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Host the matchmakings begun ahead of the target (until cancelled)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def lead(self, deadlines: Deadlines) -> float:
        """How long before the target to begin: one window (how far apart peers notice the
        ETA, a micro-step and a table read each) plus the expected planning time (a window
        before any was measured) with a margin, within the longest registration wait. (With
        the measured time alone, a matchmaking that found everyone at once shrank the lead
        below a micro-step: the next epoch, a peer went from "not due" to "ready" in one step,
        and the others waited for its late registration.)"""
        expected = deadlines.window if self._seconds is None else self._seconds
        return min(deadlines.max_wait, deadlines.window + LEAD_MARGIN * expected)

    def due(self, epoch: int, eta: float, deadlines: Deadlines) -> bool:
        """Whether to begin ``epoch``'s matchmaking now, ``eta`` seconds before its target."""
        return (
            self._nursery is not None
            and epoch not in self._epochs
            and 0 < eta <= self.lead(deadlines)
        )

    def began(self, epoch: int) -> Deadlines | None:
        """The deadlines of ``epoch``'s matchmaking if it began ahead of the target."""
        early = self._epochs.get(epoch)
        return None if early is None else early.deadlines

    def begin(
        self,
        epoch: int,
        me: Member,
        *,
        target: float,
        expected: set[str],
        deadlines: Deadlines,
    ) -> None:
        """Begin planning ``epoch``'s group now (``me.weight``: the samples we expect to hold
        at the target); :meth:`group` joins it."""
        if self._nursery is None or epoch in self._epochs:
            return
        for old in [e for e in self._epochs if e < epoch]:
            self._drop(old)
        early = _Early(deadlines, trio.current_time())
        self._epochs[epoch] = early
        log.debug("epoch %d: matchmaking ahead of the target, weight %.0f", epoch, me.weight)

        async def plan() -> None:
            try:
                if self.bans is not None:
                    # Here, not only after the round, where a read held up this peer's
                    # return to computing (REFRESH bounds how often either reads).
                    with trio.move_on_after(deadlines.window):
                        await self.bans.refresh()
                early.planned = await self.matchmaker.plan_group(
                    epoch, me, target=target, expected=expected, deadlines=deadlines, ahead=True
                )
                self._measured(trio.current_time() - early.began)
            except Exception as e:  # noqa: BLE001 - the round re-raises it (group())
                early.error = e
            finally:
                early.done.set()

        self._nursery.start_soon(plan)

    async def group(
        self,
        epoch: int,
        me: Member,
        *,
        target: float,
        expected: set[str],
        deadlines: Deadlines,
    ) -> GroupSpec | None:
        """``epoch``'s group, or None to go alone, with ``me`` (the samples we hold now): the
        one planned ahead of the target, else one formed now."""
        early = self._epochs.pop(epoch, None)
        if early is None:
            return await self.matchmaker.form_group(
                epoch, me, target=target, expected=expected, deadlines=deadlines
            )
        await early.done.wait()
        if early.error is not None:
            raise early.error
        if early.planned is None:
            return None
        if early.planned.mine == (self.matchmaker.peer_id,):
            # Alone ahead of the target: matchmake now, as at the target, so a peer that was
            # not there to plan with (a restarted newcomer, not waited for) has the window to
            # register.
            return await self.matchmaker.form_group(
                epoch, me, target=target, expected=expected, deadlines=deadlines
            )
        return await self.matchmaker.join_group(early.planned, me, reread=True)

    def _measured(self, seconds: float) -> None:
        old = self._seconds
        self._seconds = seconds if old is None else (1 - SMOOTHING) * old + SMOOTHING * seconds

    def _drop(self, epoch: int) -> None:
        """Forget ``epoch``'s early matchmaking: the peer never stepped at it (it moved on)."""
        self._epochs.pop(epoch)
        self.matchmaker.decline(epoch)
