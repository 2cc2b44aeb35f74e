"""The others' progress at one instant (:class:`ProgressSnapshot`), taken in the trio thread
so that the training thread decides without a hop."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dedloc_jax.progress import estimate_collaboration

if TYPE_CHECKING:
    from dedloc_jax.tracker import ProgressTracker


@dataclass(frozen=True)
class ProgressSnapshot:
    """The others' progress at one instant: lets a training thread decide without a hop."""

    epoch: int
    others_samples: float
    others_samples_per_second: float
    at: float
    """time.monotonic() of the snapshot: real time on purpose, since the training thread
    (outside trio, so without trio's or a MockClock's time) reads it; only the host-side
    Collaboration takes snapshots, never a simulated peer."""
    max_extrapolation: float
    others_waiting: bool = False  # see CollaborationEstimate.ready
    target: float = math.inf  # samples per step (inf: not known yet)
    fresh: bool = True  # the table was read after this peer's first report
    behind: bool = False  # the collaboration is at a newer epoch than this peer
    others_train: bool = False  # the table names another peer that computes gradients
    newest_served: int | None = None  # the newest epoch another peer serves a state of
    missed: bool = False  # the round of ``epoch`` began without us (CollaborationPeer.report)
    eta: float = math.inf  # seconds from ``at`` until the target, extrapolated
    committed_others: float = 0.0  # the others' samples in whole micro-steps (committed)
    committed_waiting: bool = False  # others_waiting, of the committed estimate
    # the newest epoch another peer serves a state of, backed or not (see
    # ProgressTracker.newest_announced: a newcomer asks the download's choice about it)
    newest_announced: int | None = None

    def ready(self, epoch: int, samples: int, *, whole_steps: bool = False) -> bool:
        """Whether to average now; ``whole_steps``: on the others' whole micro-steps as of the
        snapshot (``ProgressTracker.committed_estimate``, not extrapolated: they count only
        once a micro-step ends), the decision a peer that averages mid-step makes."""
        if self.missed and epoch == self.epoch:
            return False
        if whole_steps:
            if not self.fresh or self.epoch > epoch:
                return False
            waiting = self.committed_waiting and epoch == self.epoch
            return waiting or samples + self.committed_others >= self.target
        return self.fresh and self.reached(epoch, samples)

    def lands_within(self, seconds: float) -> bool:
        """Whether half the ETA falls within ``seconds`` from now (the ETA runs long as it
        runs out: records that stopped below the extrapolation stretch it)."""
        return (self.eta - max(0.0, time.monotonic() - self.at)) / 2 <= seconds

    def reached(self, epoch: int, samples: int) -> bool:
        """Whether the target is reached, fresh table or not."""
        if self.epoch > epoch:
            return False
        if self.others_waiting and epoch == self.epoch:
            return True
        elapsed = min(max(0.0, time.monotonic() - self.at), self.max_extrapolation)
        others = self.others_samples + elapsed * self.others_samples_per_second
        return samples + others >= self.target


def others_train(tracker: ProgressTracker) -> bool:
    """Whether the progress table names another peer that computes gradients (one that left
    the run, its record no longer averaging, does not)."""
    me = tracker.peer_id
    return any(pid != me and r.mode != "aux" and r.averages for pid, r in tracker.records.items())


def take_snapshot(
    tracker: ProgressTracker,
    now: float,
    *,
    max_extrapolation: float,
    missed: int | None,
    whole_steps: bool = False,
) -> ProgressSnapshot:
    """What the other peers hold now (``now``: DHT time), for deciding outside the trio
    thread; ``missed``: the epoch whose round began without us (None: none); ``whole_steps``:
    with the committed estimate's figures too (a peer that averages mid-step)."""
    me = tracker.peer_id
    others = [r for pid, r in tracker.projected().items() if pid != me]
    target = tracker.target
    target = math.inf if target is None else target
    est = estimate_collaboration(
        [*others, tracker.own_progress()],
        now=now,
        target_batch_size=target,
        max_extrapolation=max_extrapolation,
        me=me,
        proven=tracker.proven,
    )
    return ProgressSnapshot(
        est.epoch,
        est.others_samples,
        est.others_samples_per_second,
        time.monotonic(),
        max_extrapolation,
        est.others_waiting,
        target,
        tracker.table_fresh,
        est.epoch > tracker.epoch,
        others_train(tracker),
        tracker.newest_served(),
        missed is not None and missed == est.epoch,
        est.eta,
        *_committed(tracker, whole_steps),
        tracker.newest_announced(),
    )


def _committed(tracker: ProgressTracker, whole_steps: bool) -> tuple[float, bool]:
    """The committed estimate's others' samples and whether they all wait (none asked for:
    nothing committed, nobody waiting)."""
    if not whole_steps:
        return 0.0, False
    est = tracker.committed_estimate()
    return est.others_samples, est.others_waiting
