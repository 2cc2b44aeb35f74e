"""A peer's membership in a collaboration: :class:`CollaborationPeer`, the async (trio) side.

It keeps what it reports, when it is ready to average, its epoch and its mode; its parts
are built and handed to it by :func:`dedloc_jax.opening.open_collaboration`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import numpy as np
import trio

from dedloc_jax.averaging import LinkFigures
from dedloc_jax.bans import Bans
from dedloc_jax.config import CollaborationConfig
from dedloc_jax.host import AveragingOutcome
from dedloc_jax.progress import CollaborationEstimate, refresh_delay
from dedloc_jax.rounds.plan import expected_peers
from dedloc_jax.rounds.stepping import Stepper
from dedloc_jax.run_dht import RunDHT
from dedloc_jax.snapshot import ProgressSnapshot, others_train, take_snapshot
from dedloc_jax.state.local import LocalState
from dedloc_jax.tracker import ProgressTracker
from p2p.nat import NATManager
from p2p.node import Node

log = logging.getLogger(__name__)

LEAVE_TIMEOUT = 5.0
"""Seconds a leaving peer tries to store its last progress record (the DHT may be gone)."""


class CollaborationPeer:
    """The trio side of a collaboration; use :func:`~dedloc_jax.opening.open_collaboration`.

    Its parts, built there: ``tracker`` (progress), ``bans``, ``state`` (what it serves and
    loads; ``state_server`` answers downloads), ``stepper`` (its averaging steps, over
    ``rounds``: matchmaker, round across groups and ``link_keeper``, whose ``meter`` the
    all-reduces feed)."""

    def __init__(
        self,
        node: Node,
        dht: RunDHT,
        config: CollaborationConfig,
        mode: str,
        *,
        tracker: ProgressTracker,
        bans: Bans,
        state: LocalState,
        stepper: Stepper,
        nat: NATManager | None = None,
    ):
        self.node = node
        self.nat = (
            nat  # reachability and role (p2p.nat); None when config.reachability.detect is off
        )
        self.dht = dht
        self.run_id = tracker.run_id
        self.config = config
        self.mode = mode
        self.tracker = tracker
        self.bans = bans
        self.state = state
        self.state_server = state.server
        self.stepper = stepper
        self.rounds = stepper.rounds
        self.matchmaker = self.rounds.matchmaker
        self.across = self.rounds.across
        self.link_keeper = self.rounds.links
        self.meter = self.link_keeper.meter
        self.history = stepper.history  # one RoundOutcome per averaging step
        self.epoch = 0
        # The epoch of our first report toward it, and whether its round began without us
        self._first_report_epoch: int | None = None
        self._missed = False

    # --- progress ------------------------------------------------------------------------
    def report(
        self, epoch: int, samples: int, batch_size: int, *, whole_steps: bool = False
    ) -> bool:
        """Record a micro-step; True when this peer should average now.

        With delayed updates a peer reports toward ``epoch`` + 1 while the round of ``epoch``
        is in flight (:meth:`average` in a background task); those samples count once the
        round ends, and until then this returns False. ``whole_steps``: decide as :meth:`due`
        does, for a peer that also asks it inside its micro-steps (its mates too may average
        mid-step, without their micro-steps in flight); its record announces the poll."""
        self.epoch = max(self.epoch, epoch)
        poll = self.config.rounds.poll if whole_steps else None
        self.tracker.report(epoch, samples, batch_size, poll=poll)
        return self._due(epoch, samples, whole_steps=whole_steps)

    def due(self, epoch: int) -> bool:
        """Between micro-steps: whether this peer should average now toward ``epoch`` with
        the samples of its last report, the decision :meth:`report` makes, without recording
        a micro-step. A peer whose micro-step is long asks it when its ETA says the target
        lands before its micro-step ends: it averages then what it accumulated, and the
        micro-step in flight counts toward the next epoch (otherwise every other peer waited
        for it up to a whole micro-step)."""
        if self.tracker.epoch != epoch or self.tracker.samples <= 0:
            return False  # (nothing to average yet)
        due = self._due(epoch, self.tracker.samples, whole_steps=True)
        if due:
            self.tracker.compute_through_round()
        return due

    def _due(self, epoch: int, samples: int, *, whole_steps: bool = False) -> bool:
        """:meth:`report`'s decision after recording ``samples`` toward ``epoch``; with
        ``whole_steps`` (:meth:`due`) on the samples every peer holds in whole micro-steps
        (:meth:`~dedloc_jax.tracker.ProgressTracker.committed_estimate`), what the round
        then averages if the others, too, average their micro-steps in flight next epoch."""
        if self.tracker.epoch != epoch:
            return False  # our round of the previous epoch is in flight
        tracker = self.tracker
        est = tracker.committed_estimate() if whole_steps else tracker.current_estimate()
        if est.epoch > epoch:
            return False  # behind: never contribute gradients of an old epoch
        if epoch != self._first_report_epoch:
            self._first_report_epoch = epoch
            self._missed = self._round_began_without_us(epoch, est)
        if self._missed and not self._others_at(epoch):
            # The round we skipped is over and no trainer's record is left at our epoch or
            # later: its peers are gone and will not move on. Go on at the epoch, step at the
            # target.
            log.warning(
                "epoch %d: the round we skipped ended, no peer is left at it: going on", epoch
            )
            self._missed = False
        if self._missed:
            return False  # until the others move on (we are then behind)
        # Not before a table read that began after our first report: peers that opened with
        # us may be missing from the one read at opening, and we would step without them.
        if not self.tracker.table_fresh:
            return False
        if not est.ready and self.mode != "aux":  # the group forms while we compute
            self.stepper.match_early(epoch, samples, est, lambda: self._peers_at(epoch))
        if whole_steps and not est.ready and self._others_wait_at(epoch):
            # Others stopped and we are not ready: our table may be stale (the one holder a
            # read asks may lack newer records), so the next read asks every holder.
            tracker.sweep_next_read()
        return est.ready

    def _others_at(self, epoch: int) -> bool:
        """Whether another trainer's record, of one that left included, is at ``epoch`` or
        later: one that went on and left serves the state to go on from until it closes."""
        me = self.tracker.peer_id
        return any(
            r.epoch >= epoch and r.mode != "aux" and pid != me
            for pid, r in self.tracker.records.items()
        )

    def _others_wait_at(self, epoch: int) -> bool:
        """Whether another peer at ``epoch`` waits for its round in our table."""
        me = self.tracker.peer_id
        return any(
            r.epoch == epoch and r.waiting and pid != me
            for pid, r in self.tracker.contenders().items()
        )

    def _round_began_without_us(self, epoch: int, est: CollaborationEstimate) -> bool:
        """At our first report toward ``epoch``: whether every other peer that contributes to
        it already waits in its round, none averaged with us into it, and each stopped before
        our record of the epoch was stored (so none expects us). Such a peer (a newcomer, one
        that loaded the state late) cannot join that round: trying, it stepped alone, on a
        lineage of its own. It waits for the epoch to end and goes on from the others' state
        instead."""
        if not est.others_waiting or est.epoch != epoch:
            return False
        if self.tracker.mates[0] == epoch and self.tracker.mates[1]:
            return False
        # Peers that stopped after our record of the epoch was stored expect us (it was in
        # their table), and their leader holds the group open for us: join it.
        waiting = self.tracker.waiting_since(epoch)
        if waiting and self.tracker.stored_since(epoch) <= min(waiting):
            return False
        # One peer alone that stopped under a window ago expects nobody: it takes registrations
        # a whole window from then, so join it (a time ahead of ours, a mere claim: skip).
        window = self.stepper.deadlines(est).window
        if len(waiting) == 1 and 0 <= self.dht.now() - waiting[0] < window:
            return False
        log.info("epoch %d: its round began before our first micro-step; skipping it", epoch)
        return True

    async def read_fresh_table(self) -> None:
        """Wait, within the DHT request timeout, for a progress read that began after our
        first report: before it, a peer that reached the target by its own count cannot tell
        whether it is alone."""
        if not await self.tracker.read_fresh_table(self.config.rpc_timeout):
            log.info(
                "no progress read within %.0f s: deciding on the table at hand",
                self.config.rpc_timeout,
            )

    @property
    def estimate(self) -> CollaborationEstimate:
        return self.tracker.current_estimate()

    def snapshot(self, *, whole_steps: bool = False) -> ProgressSnapshot:
        """What the other peers hold now, for deciding outside the trio thread (``whole_steps``:
        with the committed estimate's figures, for a peer that averages mid-step)."""
        progress = self.config.progress
        cap = progress.max_refresh * 2 if progress.extrapolate else 0.0
        missed = self._first_report_epoch if self._missed else None
        return take_snapshot(
            self.tracker,
            self.dht.now(),
            max_extrapolation=cap,
            missed=missed,
            whole_steps=whole_steps,
        )

    @property
    def behind(self) -> bool:
        return self.tracker.current_estimate().epoch > self.tracker.epoch

    def leaving_note(self) -> str | None:
        """What a peer that leaves before it ever averaged says: its samples are in no step
        (a toy loop can end within the round it skipped), and what it waited for."""
        if self.history or self.tracker.samples <= 0 or self.mode == "aux":
            return None
        epoch, est = self.tracker.epoch, self.tracker.current_estimate()
        if self._missed:
            why = f"epoch {epoch}'s round began before our first micro-step: we waited for it"
        elif est.epoch > epoch:
            why = f"the collaboration is at epoch {est.epoch}: we waited to load its state"
        else:
            why = f"the collaboration had {est.samples:.0f} of its {est.target} samples"
        return (
            f"leaving before this peer averaged once: its {self.tracker.samples} samples of "
            f"epoch {epoch} are in no step ({why})"
        )

    def others_train(self) -> bool:
        """Whether the progress table names another peer that computes gradients."""
        return others_train(self.tracker)

    @property
    def links(self) -> LinkFigures:
        """This peer's published link figures: measured up and down (bytes/s), their age."""
        return self.link_keeper.figures()

    async def follow_reachability(self) -> None:
        """Keep the averaging mode in step with :attr:`nat`'s role, from now on (a background
        task, like the DHT's mode): a peer with no inbound path at all (``nat.client_mode``)
        takes part as a client, which only dials out; any other one, relayed included, as a
        node that reduces a share. A change applies from the next round."""
        nat = self.nat
        if nat is None:
            raise RuntimeError(
                "follow_reachability needs a collaboration opened with config.reachability.detect"
            )
        while True:
            mode = "client" if nat.client_mode else "node"
            if mode != self.mode:
                log.info("averaging mode %s -> %s (role %s)", self.mode, mode, nat.role.value)
                self.mode = mode
                self.tracker.mode = mode
            await nat.wait_changed()

    async def average(
        self, epoch: int, arrays: Sequence[np.ndarray], samples: int, *, codec: str | None = None
    ) -> AveragingOutcome:
        """Form a group for ``epoch`` and average ``arrays`` (weight ``samples``) with it,
        sent in ``codec`` (None: ``config.rounds.codec``; every member of a round must use one):
        the round's :class:`~dedloc_jax.history.RoundOutcome` (the mean in ``average``), seen
        through :class:`~dedloc_jax.host.AveragingOutcome`, whose old names keep working."""
        with self.link_keeper.averaging():
            return await self._average(epoch, arrays, samples, codec)

    async def _average(
        self, epoch: int, arrays: Sequence[np.ndarray], samples: int, codec: str | None
    ) -> AveragingOutcome:
        expected = self._peers_at(epoch)
        outcome = await self.stepper.step(epoch, arrays, samples, codec=codec, expected=expected)
        self.epoch = outcome.next_epoch
        return AveragingOutcome.of(outcome)

    def _peers_at(self, epoch: int) -> set[str]:
        """Who should register for ``epoch``, from the progress table and our last group (see
        :func:`~dedloc_jax.rounds.plan.expected_peers`)."""
        into, mates = self.tracker.mates  # (without us)
        return expected_peers(self.tracker.records, (into, mates), str(self.node.peer_id), epoch)

    async def run_aux(self, template: Sequence[np.ndarray], *, epochs: int | None = None) -> int:
        """Serve as an auxiliary peer: join every averaging round and reduce a share.

        An aux peer has no accelerator and computes no gradients; it brings its bandwidth.
        ``template`` gives the shapes and dtypes of the averaged arrays (values unused).
        Returns after ``epochs`` rounds (never, when None); returns the rounds joined.
        """
        if self.mode != "aux":
            raise RuntimeError("run_aux needs a collaboration opened with mode='aux'")
        template = [np.zeros(np.shape(a), np.asarray(a).dtype) for a in template]
        self.tracker.join_averaging()
        rounds = 0
        while epochs is None or rounds < epochs:
            est = await self.tracker.fetch()
            if est.epoch > self.tracker.epoch:
                self.tracker.set_epoch(est.epoch)
            if not est.ready:  # trainers plan their groups ahead of the target: so do we
                peers = functools.partial(self._peers_at, est.epoch)
                self.stepper.match_early(est.epoch, 0, est, peers)
                await trio.sleep(self._refresh_delay(est))
                continue
            got = await self.stepper.lend(est, template, self._peers_at(est.epoch))
            rounds += got.group is not None
            self.epoch = est.epoch + 1
        return rounds

    def _refresh_delay(self, est: CollaborationEstimate) -> float:
        config = self.config.progress
        return refresh_delay(
            est,
            min_delay=config.min_refresh,
            max_delay=config.max_refresh,
            idle_delay=config.idle_refresh,
            idle_eta=self.tracker.settled_eta(),
            idle_after=config.idle_after,
        )

    # --- state (LocalState; loading also moves this peer's epoch) ---------------------------
    async def leave(self) -> None:
        """Tell the run that this peer leaves (its progress record says it averages no more),
        within :data:`LEAVE_TIMEOUT` seconds; the peer still serves until it closes."""
        with trio.move_on_after(LEAVE_TIMEOUT):
            await self.tracker.leave()

    async def share_state(self, arrays: Sequence[np.ndarray], epoch: int) -> None:
        await self.state.share(arrays, epoch)

    async def load_state(
        self, *, timeout: float = 60.0, min_epoch: int | None = None
    ) -> tuple[int, list[np.ndarray]]:
        """:meth:`LocalState.load`; our epoch becomes the loaded state's."""
        epoch, arrays = await self.state.load(timeout=timeout, min_epoch=min_epoch)
        self.epoch = epoch
        return epoch, arrays

    async def newest_state_epoch(self) -> int | None:
        return await self.state.newest_epoch()

    async def on_minority_fork(self, *, patience: float = 0.0, undecided: bool = False) -> bool:
        return await self.state.on_minority_fork(patience=patience, undecided=undecided)

    def fork_verdict(self) -> bool | None:
        return self.state.fork_verdict()
