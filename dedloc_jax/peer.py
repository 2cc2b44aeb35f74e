"""A peer's membership in a collaboration: :class:`CollaborationPeer`, the async (trio) side.

:func:`open_collaboration` runs, on a p2p node, everything a peer needs: the DHT, the progress
tracker, matchmaking, the butterfly all-reduce and the state server.
:class:`dedloc_jax.collaboration.Collaboration` runs the same in one background trio thread for
ordinary Python (the JAX training loop).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from dedloc_jax.access import PrivateRun
from dedloc_jax.averaging import (
    BandwidthMeter,
    GroupSpec,
    LinkFigures,
    Member,
    install,
    install_probe,
    measure_links,
)
from dedloc_jax.averaging.bandwidth import UNMEASURED_DOWNLOAD_BPS, UNMEASURED_UPLOAD_BPS
from dedloc_jax.bans import Bans
from dedloc_jax.config import CollaborationConfig
from dedloc_jax.history import RoundOutcome
from dedloc_jax.host import AveragingOutcome
from dedloc_jax.progress import CollaborationEstimate, estimate_collaboration, refresh_delay
from dedloc_jax.round.across import AcrossGroups
from dedloc_jax.round.average import Rounds, average_round
from dedloc_jax.round.context import RoundContext
from dedloc_jax.round.deadlines import Deadlines, matchmaking_window
from dedloc_jax.round.gather import SparseGather
from dedloc_jax.round.matchmaking import Matchmaker
from dedloc_jax.round.plan import expected_peers
from dedloc_jax.round.slots import Slots
from dedloc_jax.round.wire import member_for
from dedloc_jax.state import (
    Announcement,
    StateServer,
    download_manifest_state,
    find_donors,
    fork_verdict,
)
from dedloc_jax.state.vouching import VouchBook
from dedloc_jax.tracker import ProgressTracker
from dedloc_jax.validators import run_validators
from p2p.dht import DHTClock, DHTConfig, open_dht
from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr
from p2p.nat import NATConfig, NATManager, open_nat

log = logging.getLogger(__name__)


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

    def ready(self, epoch: int, samples: int) -> bool:
        if self.missed and epoch == self.epoch:
            return False
        return self.fresh and self.reached(epoch, samples)

    def reached(self, epoch: int, samples: int) -> bool:
        """Whether the target is reached, fresh table or not."""
        if self.epoch > epoch:
            return False
        if self.others_waiting and epoch == self.epoch:
            return True
        elapsed = min(max(0.0, time.monotonic() - self.at), self.max_extrapolation)
        others = self.others_samples + elapsed * self.others_samples_per_second
        return samples + others >= self.target


class CollaborationPeer:
    """The trio side of a collaboration; use :func:`open_collaboration`."""

    def __init__(
        self,
        node: Any,
        dht: Any,
        run_id: str,
        config: CollaborationConfig,
        mode: str,
        nat: NATManager | None = None,
        *,
        admit: Callable[[PeerID, str | None], Awaitable[None]] | None = None,
    ):
        """``admit``: a private run's access guard (:meth:`~dedloc_jax.access.AccessGuard.
        admit`), which every handler of the peer's calls first; None in an open run."""
        self.node = node
        self.nat = nat  # reachability and role (p2p.nat); None when config.nat is off
        self.dht = dht
        self.run_id = run_id
        self.config = config
        self.mode = mode
        self.bans = Bans(node, dht, run_id)
        self.vouches = VouchBook()
        self.tracker = ProgressTracker(
            dht, run_id, config, mode, banned=self.bans.is_banned, vouched=self.vouches.vouched
        )
        self.state_server = StateServer(
            node,
            dht,
            run_id,
            chunk_bytes=config.state_chunk_bytes,
            ttl=self.tracker.record_ttl,
            admit=admit,
            mates=self._mates_into,
            book=self.vouches,
        )
        context = RoundContext(
            moved_on=self._moved_on,
            epoch_over=lambda epoch: self.tracker.current_estimate().epoch > epoch,
            # Peers average only with peers that step from the same state (or do not say).
            state_of=self.state_server.head_at,
            banned=self.bans.is_banned,
            admit=admit,
        )
        slots = Slots()
        self.matchmaker = Matchmaker(
            node, dht, run_id, max_group_size=config.max_group_size, context=context, slots=slots
        )
        self.across = AcrossGroups(node, slots, admit=admit)
        self.meter = BandwidthMeter(
            upload_override=config.upload_bps, download_override=config.download_bps
        )
        self.rounds = Rounds(
            node,
            self.matchmaker,
            self.across,
            self.meter,
            member=self._member,
            dht_latency=lambda: self.tracker.dht_latency,
            averaging_timeout=config.averaging_timeout,
            robust_tau=config.robust_tau,
            robust=config.robust_on,
            verify=config.verify_on,
            bans=self.bans,
            gather=SparseGather(node, admit=admit),
        )
        self.epoch = 0
        self.history: list[RoundOutcome] = []  # one entry per averaging step
        # The epoch of our first report toward it, and whether its round began without us
        self._first_report_epoch: int | None = None
        self._missed = False
        self._averaging = 0  # rounds of ours in progress (no link probe meanwhile)

    # --- progress ------------------------------------------------------------------------
    def report(self, epoch: int, samples: int, batch_size: int) -> bool:
        """Record a micro-step; True when this peer should average now.

        With delayed updates a peer reports toward ``epoch`` + 1 while the round of ``epoch``
        is in flight (:meth:`average` in a background task); those samples count once the
        round ends, and until then this returns False."""
        self.epoch = max(self.epoch, epoch)
        self.tracker.report(epoch, samples, batch_size)
        if self.tracker.epoch != epoch:
            return False  # our round of the previous epoch is in flight
        est = self.tracker.current_estimate()
        if est.epoch > epoch:
            return False  # behind: never contribute gradients of an old epoch
        if epoch != self._first_report_epoch:
            self._first_report_epoch = epoch
            self._missed = self._round_began_without_us(epoch, est)
        if self._missed:
            return False  # until the others move on (we are then behind)
        # Not before a table read that began after our first report: peers that opened with
        # us may be missing from the one read at opening, and we would step without them.
        return est.ready and self.tracker.table_fresh

    def _round_began_without_us(self, epoch: int, est: CollaborationEstimate) -> bool:
        """At our first report toward ``epoch``: whether every other peer that contributes to
        it already waits in its round, none averaged with us into it, and each stopped before
        our record of the epoch was stored (so none expects us). Such a peer (a newcomer, one
        that loaded the state late) cannot join that round: trying, it stepped alone, on a
        lineage of its own. It waits for the epoch to end and goes on from the others' state
        instead."""
        if not est.others_waiting or est.epoch != epoch:
            return False
        into, mates = self.tracker.mates
        if into == epoch and mates:
            return False
        # Peers that stopped after our record of the epoch was stored expect us (it was in
        # their table), and their leader holds the group open for us: join it.
        waiting = [
            r.time
            for pid, r in self.tracker.contenders().items()
            if pid != self.tracker.peer_id and r.epoch == epoch and r.waiting
        ]
        if waiting and self.tracker.stored_since(epoch) <= min(waiting):
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

    def use_target(self, target: int) -> None:
        """Train toward ``target`` samples per step (what ``collaborative`` was given)."""
        self.tracker.use_target(target)

    @property
    def target(self) -> int | None:
        """Samples per step: this peer's, or the run's when it sets none (an aux peer)."""
        return self.tracker.target

    @property
    def estimate(self) -> CollaborationEstimate:
        return self.tracker.current_estimate()

    def snapshot(self) -> ProgressSnapshot:
        """What the other peers hold now, for deciding outside the trio thread."""
        me = self.tracker.peer_id
        others = [r for pid, r in self.tracker.projected().items() if pid != me]
        cap = self.config.max_refresh * 2 if self.config.extrapolate else 0.0
        target = self.target
        target = math.inf if target is None else target
        est = estimate_collaboration(
            [*others, self.tracker.own_progress()],
            now=self.dht.now(),
            target_batch_size=target,
            max_extrapolation=cap,
            me=me,
        )
        return ProgressSnapshot(
            est.epoch,
            est.others_samples,
            est.others_samples_per_second,
            time.monotonic(),
            cap,
            est.others_waiting,
            target,
            self.tracker.table_fresh,
            est.epoch > self.tracker.epoch,
            self.others_train(),
            self.tracker.newest_served(),
            self._missed and self._first_report_epoch == est.epoch,
        )

    @property
    def behind(self) -> bool:
        return self.tracker.current_estimate().epoch > self.tracker.epoch

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

    def _target_or_zero(self) -> float:
        """The target for matchmaking's "registered samples fall short" rule (0: unknown)."""
        return float(self.target or 0)

    def others_train(self) -> bool:
        """Whether the progress table names another peer that computes gradients."""
        me = self.tracker.peer_id
        return any(pid != me and r.mode != "aux" for pid, r in self.tracker.records.items())

    def _moved_on(self, peer: str, epoch: int) -> bool:
        record = self.tracker.records.get(peer)
        return record is not None and record.epoch > epoch

    # --- averaging -----------------------------------------------------------------------
    def _bandwidth(self) -> tuple[float, float]:
        """Measured (or overridden) link speeds; an unmeasured one counts as a slow home link,
        so that deadlines computed from it are long enough (see
        :class:`~dedloc_jax.round.deadlines.Deadlines`)."""
        f = self.meter.figures()
        up = self.config.unmeasured_upload_bps or UNMEASURED_UPLOAD_BPS
        down = self.config.unmeasured_download_bps or UNMEASURED_DOWNLOAD_BPS
        return f.upload_bps or up, f.download_bps or down

    @property
    def links(self) -> LinkFigures:
        """This peer's published link figures: measured up and down (bytes/s), their age."""
        return self.meter.figures()

    async def probe_links(self, *, nbytes: int = 4 << 20, max_peers: int = 8) -> LinkFigures:
        """Measure this peer's links against a few peers of the run whose progress we read
        (reachable ones, in a per-peer random order): on joining, or when ``meter.stale()``."""
        me = str(self.node.peer_id)
        rng = random.Random(me)
        peers = sorted(
            pid for pid, r in self.tracker.records.items() if pid != me and r.mode != "client"
        )
        rng.shuffle(peers)
        if not peers:
            return self.meter.figures()
        return await measure_links(
            self.node,
            [PeerID.from_base58(p) for p in peers],
            self.meter,
            nbytes=nbytes,
            max_peers=max_peers,
            timeout=self.config.rpc_timeout * 6,
        )

    async def keep_links_measured(
        self,
        *,
        nbytes: int | None = None,
        poll: float = 5.0,
        probes: int = 2,
        lead: float | None = None,
    ) -> None:
        """Probe this peer's links once other peers are known and the next averaging is less
        than ``lead`` seconds away (None: a quarter of the meter's window), ``probes`` times
        at random moments ``poll`` to ``3 * poll`` apart, and again before each later
        averaging whose round would find the figure stale; ``open_collaboration`` runs it in
        the background when ``config.measure_links`` (``nbytes``: ``config.probe_bytes``
        unless given). Probes of peers that start together contend for the same links and
        read low; the figure is their max, so one probe that ran alone suffices.

        Only a round uses the figure, so probes wait for one (with diloco's outer steps hours
        apart, probing at every expiry would send more than the averaging). Within ``lead`` of
        the round the new figure lasts through it even if it comes later than predicted. A
        peer that sees no rate at all (nothing to predict from) probes on joining. A client
        reduces nothing, so it probes nothing (while it is one, see
        :meth:`follow_reachability`)."""
        rng = random.Random(str(self.node.peer_id))
        nbytes = self.config.probe_bytes if nbytes is None else nbytes
        lead = self.meter.window / 4 if lead is None else lead
        done = 0
        while True:
            await trio.sleep(rng.uniform(poll, 3 * poll) if done else rng.uniform(0, poll))
            known = any(pid != str(self.node.peer_id) for pid in self.tracker.records)
            eta = self.tracker.current_estimate().eta
            f = self.meter.figures()
            stale = max(f.upload_age, f.download_age) + eta > self.meter.window  # at the round
            due = eta < lead and stale or done < probes and (eta < lead or math.isinf(eta))
            # Not while we average: the round's traffic and the probe's would slow each other.
            if known and due and self.mode != "client" and not self._averaging:
                try:
                    figures = await self.probe_links(nbytes=nbytes)
                except (ValueError, trio.TooSlowError, P2PError) as e:
                    log.info("probing our links failed: %r", e)
                else:
                    # A probe counts once it measured both ways (partners may all be busy
                    # when we upload, and the uplink went unmeasured for a whole window).
                    if figures.upload_bps is not None and figures.download_bps is not None:
                        done += 1
            if done >= probes and not due and math.isfinite(eta):
                await trio.sleep(min(self.meter.window / 4, max(0.0, eta - lead)))

    async def follow_reachability(self) -> None:
        """Keep the averaging mode in step with :attr:`nat`'s role, from now on (a background
        task, like the DHT's mode): a peer with no inbound path at all (``nat.client_mode``)
        takes part as a client, which only dials out; any other one, relayed included, as a
        node that reduces a share. A change applies from the next round."""
        nat = self.nat
        if nat is None:
            raise RuntimeError("follow_reachability needs a collaboration opened with config.nat")
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
        sent in ``codec`` (None: ``config.codec``; every member of a round must use one)."""
        self._averaging += 1
        try:
            return await self._average(epoch, arrays, samples, codec)
        finally:
            self._averaging -= 1

    async def _average(
        self, epoch: int, arrays: Sequence[np.ndarray], samples: int, codec: str | None
    ) -> AveragingOutcome:
        est = self.tracker.current_estimate()
        self.matchmaker.use_deadlines(Deadlines(window=self._window(est)))
        await self.tracker.freeze()  # others must not extrapolate our samples any further
        me = self.rounds.member(float(samples))
        started = trio.current_time()

        def mates(spec: GroupSpec) -> None:
            """The next epoch's round expects the peers we averaged with (expected_peers)."""
            self.tracker.expect_mates(epoch + 1, (m.peer_id for m in spec.members))

        got = await average_round(
            self.rounds,
            epoch,
            me,
            arrays,
            codec=codec or self.config.codec,
            target=self._target_or_zero(),
            expected=self._peers_at(epoch),
            on_averaged=mates,
        )
        complete, reason = got.complete, got.reason
        in_group = got.group is not None and not got.across
        if in_group and complete and self._stepped_without(got.group, epoch):
            # Peers outside our leader's one group already moved past this epoch: they
            # averaged apart (we came late), so ours is not the epoch's mean.
            complete, reason = False, "others stepped without our group"
        if reason:
            # A run of one peer steps alone by design: that is no news.
            level = logging.WARNING if self.others_train() else logging.INFO
            log.log(
                level,
                "epoch %d: stepped without the whole collaboration (group of %d): %s",
                epoch,
                got.group_size,
                reason,
            )
        result = got.average
        if got.group_size == 1 and self.config.on_no_group == "skip":
            result = [np.zeros_like(np.asarray(a)) for a in result]
        self.epoch = epoch + 1
        # A peer that serves its state serves the new one next (share_state): one record.
        self.tracker.set_epoch(self.epoch, state_follows=self.state_server.latest is not None)
        self.history.append(
            RoundOutcome(
                epoch=epoch,
                group_size=got.group_size,
                complete=complete,
                seconds=trio.current_time() - started,
                collab_samples=est.samples,
                reason=reason,
                mode=me.mode,
            )
        )
        return AveragingOutcome(result, self.epoch, got.group_size, complete)

    def _peers_at(self, epoch: int) -> set[str]:
        """Who should register for ``epoch``, from the progress table and our last group (see
        :func:`~dedloc_jax.round.plan.expected_peers`)."""
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
            if not est.ready:
                await trio.sleep(
                    refresh_delay(
                        est,
                        min_delay=self.config.min_refresh,
                        max_delay=self.config.max_refresh,
                        idle_delay=self.config.idle_refresh,
                        idle_eta=self.tracker.settled_eta(),
                        idle_after=self.config.idle_after,
                    )
                )
                continue
            epoch = est.epoch
            self.matchmaker.use_deadlines(Deadlines(window=self._window(est)))
            me = self.rounds.member(0.0)  # (mode "aux")
            got = await average_round(
                self.rounds,
                epoch,
                me,
                template,
                codec=self.config.codec,
                target=self._target_or_zero(),
                expected=self._peers_at(epoch),
            )
            if got.group is not None:
                rounds += 1
            elif got.error is not None:
                log.warning("aux averaging at epoch %d failed: %s", epoch, got.error)
            self.epoch = epoch + 1
            self.tracker.set_epoch(self.epoch)
        return rounds

    def _member(self, weight: float) -> Member:
        """This peer's member entry now: its mode and measured links, bringing ``weight``."""
        up, down = self._bandwidth()
        return member_for(str(self.node.peer_id), self.mode, up, down, weight)

    def _window(self, est: CollaborationEstimate) -> float:
        """This round's matchmaking window: the configured one, else the predicted one."""
        return self.config.matchmaking_time or matchmaking_window(
            self.config.min_refresh, self.tracker.dht_latency, est.max_step_interval
        )

    # --- state ---------------------------------------------------------------------------
    async def share_state(self, arrays: Sequence[np.ndarray], epoch: int) -> None:
        manifest = self.state_server.set_state(arrays, epoch)
        self.tracker.serve(epoch, manifest.digest, self.state_server.lineage)
        await self.state_server.announce()

    async def load_state(
        self, *, timeout: float = 60.0, min_epoch: int | None = None
    ) -> tuple[int, list[np.ndarray]]:
        """Download the state the fork choice names, train on it from now on (our epoch
        becomes its epoch) and serve it (the fork checks, ours and the others', count the
        state a peer serves). ``min_epoch``: raise :class:`StaleStateError` instead when that
        state is older; nothing changes then (a caller that keeps its own state must keep its
        own epoch and lineage too, or its fork check counts it on the others' lineage)."""
        manifest, arrays, donors = await download_manifest_state(
            self.node,
            self.dht,
            self.run_id,
            timeout=timeout,
            request_timeout=self.config.rpc_timeout,
            extra=self._table_states(),
            min_epoch=min_epoch,
            local=self.state_server.held,
            book=self.vouches,
        )
        epoch = manifest.epoch
        self.state_server.hold(manifest, arrays)
        log.info("loaded the state of epoch %d from %d donors", epoch, donors)
        self.epoch = epoch
        self.tracker.set_epoch(epoch)
        self.tracker.serve(epoch, manifest.digest, self.state_server.lineage)
        await self.state_server.announce()
        return epoch, arrays

    async def newest_state_epoch(self) -> int | None:
        """The epoch of the state a download would bring (the newest on the lineage most
        peers hold, :func:`~dedloc_jax.state.lineage.fork_choice`), or None (nobody announces
        one): whether a download would bring anything newer, for one DHT read. The tracker's
        epoch alone cannot tell: after a healed partition, the side that lost may be ahead."""
        found = await find_donors(
            self.node, self.dht, self.run_id, self._table_states(), self.vouches
        )
        return None if found is None else found[0]

    def _table_states(self) -> list[Announcement]:
        """The states the progress table names (every other peer's, as last read)."""
        return self.tracker.announcements()

    async def on_minority_fork(self, *, patience: float = 0.0, undecided: bool = False) -> bool:
        """Whether the state we serve lost to another lineage (one more peers hold, see
        :func:`~dedloc_jax.state.lineage.fork_verdict`): then load theirs. Ask once the others
        announced the epoch's state, e.g. when ready to average; ``patience``: seconds to keep
        asking (each second) while it cannot tell (also while the table names no state);
        ``undecided``: the answer when it still cannot tell then. A peer whose round missed
        part of the epoch passes True: it is most likely the odd one out.

        It counts the states the progress table names (every peer publishes the state it
        serves with its progress, and follows the table anyway): it reads nothing from the DHT."""
        deadline = trio.current_time() + patience
        while True:
            verdict = self.fork_verdict()
            left = deadline - trio.current_time()
            if verdict is not None:
                return verdict
            if left <= 0:
                log.info("the fork check could not tell within %.0f s", patience)
                return undecided
            await trio.sleep(min(1.0, left))

    def fork_verdict(self) -> bool | None:
        """:meth:`on_minority_fork` asked once, without waiting: None while it cannot tell
        (most peers still average the epoch, or the table names no state)."""
        latest = self.state_server.latest
        if latest is None or self.mode == "aux":
            return False  # we serve nothing, or a copy (no vote): nothing to lose
        table = self._table_states()
        # An empty table (a read that failed, records that lapsed in a cut) cannot tell.
        if not table:
            return None
        server = self.state_server
        return fork_verdict(table, latest.epoch, latest.digest, server.lineage, server.vouched)

    def _mates_into(self, epoch: int) -> frozenset[str]:
        """The peers that averaged with us into ``epoch`` (named in our vouch of its state)."""
        into, peers = self.tracker.mates
        return peers if into == epoch else frozenset()

    async def _announce_state(self) -> None:
        """Keep our announcement from expiring: renew it at a third of its lifetime. Each step
        announces the new state, so only the time since the last announcement counts: with
        epochs shorter than a third of the TTL, this never stores anything."""
        server = self.state_server
        while True:
            if trio.current_time() < server.renew_at:
                await trio.sleep_until(server.renew_at)
                continue
            await server.announce()
            if trio.current_time() >= server.renew_at:
                await trio.sleep(self.config.progress_ttl / 3)  # nothing to announce, or failed


@asynccontextmanager
async def open_collaboration(
    node: Any,
    run_id: str,
    *,
    initial_peers: Sequence[str | Multiaddr] = (),
    config: CollaborationConfig = CollaborationConfig(),
    mode: str | None = None,
    dht_config: DHTConfig = DHTConfig(),
    dht_clock: DHTClock | None = None,
    nat_config: NATConfig | None = None,
) -> AsyncIterator[CollaborationPeer]:
    """Join (or start, with no initial peers) the collaboration ``run_id`` on ``node``.

    With ``config.nat`` the node first finds out whether it is reachable (``p2p.nat``, with
    ``nat_config``; None: the defaults): a peer behind NAT keeps relay reservations and
    advertises relayed addresses, and one with no inbound path at all takes part as a client.
    Unless a mode is forced, the averaging mode follows reachability for the whole run (see
    :meth:`CollaborationPeer.follow_reachability`), as the DHT's mode does.
    """
    forced_mode = mode or config.mode
    mode = forced_mode
    # Made here, not by the DHT, so that a private run's policy reads DHT time from the start.
    clock = dht_clock or DHTClock(
        samples=dht_config.clock_samples, max_skew=dht_config.max_clock_skew
    )
    private = PrivateRun.for_config(
        node, run_id, config.owner_public_key, config.invitation, clock.now
    )
    async with AsyncExitStack() as stack:
        if config.nat:
            forced = {"client": True, "node": False, "aux": False}.get(mode or "")
            nat_config = nat_config or NATConfig()
            if forced is not None:
                nat_config = nat_config.replace(force_client_mode=forced)
            if not config.port_mapping:
                nat_config = nat_config.replace(port_mapping=None)
            nat = await stack.enter_async_context(
                open_nat(node, peers=initial_peers, config=nat_config)
            )
            mode = mode or ("client" if nat.client_mode else "node")
        else:
            nat = None
            mode = mode or ("node" if node.addrs else "client")
        dht = await stack.enter_async_context(
            open_dht(
                node,
                initial_peers=initial_peers,
                config=dht_config,
                client_mode=mode == "client" or (nat is not None and nat.dht_client_mode),
                clock=clock,
                # who may write first (a stranger is told that), then what a record holds
                validators=[
                    *(private.validators if private is not None else ()),
                    *(run_validators(run_id) if config.record_schemas else ()),
                ],
            )
        )
        if nat is not None:
            nat.use_dht(dht)
        if private is not None:
            dht = private.attach(dht)
        admit = private.guard.admit if private is not None else None
        core = CollaborationPeer(node, dht, run_id, config, mode, nat, admit=admit)
        averaging = install(node)
        if admit is not None:
            averaging.guard_with(admit)
        install_probe(node, core.meter)
        core.matchmaker.register()
        core.across.register()
        core.rounds.gather.register()
        core.state_server.register()
        nursery = await stack.enter_async_context(trio.open_nursery())
        await nursery.start(core.tracker.run)
        nursery.start_soon(core._announce_state)
        if nat is not None and forced_mode is None:
            nursery.start_soon(core.follow_reachability)
        if config.measure_links and (mode != "client" or forced_mode is None):
            nursery.start_soon(core.keep_links_measured)
        try:
            yield core
        finally:
            nursery.cancel_scope.cancel()
