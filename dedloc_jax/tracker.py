"""The progress tracker: publish this peer's progress, read everyone's, keep an estimate.

Each peer writes one signed subkey (``[owner:<peer-id>]``) under ``<run_id>.progress``; nobody
else can overwrite it, and it expires ``progress_ttl`` seconds after the peer's last report, so
a vanished peer stops counting. Reads happen every :func:`~dedloc_jax.progress.refresh_delay`
seconds: rarely far from the target, often near it, and less often in a large collaboration;
each read fetches only the records changed since the last one (:mod:`p2p.dht.follow`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable

import trio

from dedloc_jax.config import CollaborationConfig
from dedloc_jax.progress import (
    MAX_OUTCOME,
    MAX_POLL,
    MIN_POLL,
    CollaborationEstimate,
    PeerProgress,
    ThroughputMeter,
    backed_epoch,
    check_state,
    estimate_collaboration,
    refresh_delay,
)
from dedloc_jax.rounds.claims import counting_reporters, reported_void
from dedloc_jax.run_dht import RunDHT
from dedloc_jax.state import Announcement, fork_choice, losing_peers
from p2p.dht import InvalidRecordError, follower_replicas
from p2p.dht.records import Record, owner_marker, owner_markers
from p2p.errors import P2PError

log = logging.getLogger(__name__)

MAX_LOGGED = 4096  # peers remembered as logged for an unbacked epoch (then forgotten)
OUTCOME_EPOCHS = 4  # epochs of others' round outcomes kept (a record holds only its last)


def _first_time(said: set[str], pid: str) -> bool:
    """Whether ``pid`` is new to ``said`` (then remembered): a line said once per peer. Bounded
    by :data:`MAX_LOGGED`: peer IDs made up by the thousand only make it forget."""
    if pid in said:
        return False
    if len(said) >= MAX_LOGGED:
        said.clear()
    said.add(pid)
    return True


def progress_key(run_id: str) -> str:
    return f"{run_id}.progress"


class ProgressTracker:
    """Owned by a collaboration; :meth:`run` is its background task.

    ``banned``: whether a peer is banned (:meth:`dedloc_jax.bans.Bans.is_banned`); a banned
    peer's record is dropped from the table, so it neither counts toward the batch nor moves
    the epoch, the fork choice or the newest served state (None: nobody is banned).
    ``failed``: when our download of a peer's offer (epoch, digest) failed, while that offer
    is dropped (:meth:`~dedloc_jax.state.download.GoneDonors.failed_at`; see
    :meth:`_stranger_backs`)."""

    def __init__(
        self,
        dht: RunDHT,
        run_id: str,
        config: CollaborationConfig,
        mode: str,
        *,
        banned: Callable[[str], bool] | None = None,
        vouched: Callable[[str], bool] | None = None,
        endorsed: Callable[[str], bool] | None = None,
        failed: Callable[[str, int, bytes], float | None] | None = None,
    ) -> None:
        self.dht = dht
        self._banned, self._failed = banned, failed
        # Whether another peer vouched it averaged with a peer (a VouchBook's; the records
        # carry no vouches): the fork choice counts only vouched states while any is; and
        # whether our roots trust it (endorsed ones outrank those: state.vouching).
        self.vouched = vouched
        self.endorsed = endorsed
        self.run_id = run_id
        self.config = config
        self.mode = mode
        # Whether we join averaging rounds: an aux peer only from run_aux on (one that just
        # follows the run, like a coordinator, is then not waited for in matchmaking).
        self.averages = mode != "aux"
        self.peer_id = str(dht.peer_id)
        self.epoch = 0
        self.samples = 0
        self.meter = ThroughputMeter(half_life=10.0)
        self.records: dict[str, PeerProgress] = {}
        # Samples per step: the config's, else the transform's (use_target), else the run's.
        self._target: int | None = config.target_batch_size
        self._warned_targets: set[tuple[str, int]] = set()
        # A peer decides it is alone only on a table read that began after its first report
        # (see table_fresh): the table read when it opened may predate peers that opened with it.
        self._first_report_at: float | None = None
        self._read_started_at = -math.inf  # trio time the last successful read began
        self._read = trio.Event()  # set by each successful read
        self.estimate = estimate_collaboration([], now=0.0, target_batch_size=math.inf)
        self._wake = trio.Event()
        self._published_at = -math.inf
        self._published_ttl = config.progress.ttl  # how long our last record lives
        self._published_epoch = -1
        # (epoch, DHT time): when our first record of that epoch was stored (see stored_since)
        self._epoch_stored: tuple[int, float] = (-1, math.inf)
        self._frozen = False
        self.step_interval = 0.0
        self._last_report: float | None = None
        self._report_time = dht.now()  # DHT-clock time our samples were counted at
        self._batch = 0  # samples of the last micro-batch
        self._published: PeerProgress | None = None
        self._pending: tuple[int, int, float] | None = None  # (epoch, samples, time)
        self.dht_latency = 0.05  # smoothed seconds per DHT read, for deadlines
        # Reads fetch only the records changed since the last one (p2p.dht.follow): every
        # peer reads the table about once a second, and each read of the whole table grows
        # with the number of peers.
        self._follower = dht.follow(progress_key(run_id))
        self._parsed: dict[str, tuple[Record, PeerProgress | None]] = {}  # subkey -> last read
        self.served: tuple[int, bytes, tuple[bytes, ...]] | None = None  # see serve()
        self._state_due: float | None = None  # see set_epoch(state_follows=True)
        # Peers whose served state is on a lineage the fork choice leaves: see contenders().
        self.losers: frozenset[str] = frozenset()
        self._fork_input: tuple = ()
        # The epoch of the state the fork choice names in the table (None: none served): a
        # claim of an epoch up to it is backed by a state a download would bring.
        self.chosen_epoch: int | None = None
        self._chosen: tuple[int, bytes] | None = None  # that state (epoch, digest), held by:
        self._chosen_holders: frozenset[str] = frozenset()
        self._trained: dict[str, int] = {}  # peer -> the first epoch it was read training at
        self._renewed: dict[str, float] = {}  # peer -> when we last read a new record of it
        self._unconfirmed: dict[str, tuple[int, float]] = {}  # see _stranger_backs
        # Peers whose epoch nobody backs (see contenders), and those already logged.
        self.unbacked: frozenset[str] = frozenset()
        self._unbacked_input: tuple = ()
        self._unbacked_table: dict[str, PeerProgress] | None = None
        self._unbacked_logged: set[str] = set()
        self._unbacked_since: dict[str, float] = {}  # one epoch ahead: since when (not logged)
        self._unbacked_noted: set[str] = set()  # one epoch ahead: said at INFO
        # (epoch, peers): who averaged with us into ``epoch``; and the DHT time of our first
        # report in it (None: none yet), from which their samples are extrapolated
        self.mates: tuple[int, frozenset[str]] = (-1, frozenset())
        # Every peer that averaged with us (-> the epoch it averaged into), oldest first:
        # see proven.
        self._averaged_with: dict[str, int] = {}
        self._mates_began: float | None = None
        # DHT time we stepped after a round that our micro-step went on through (else -inf)
        self._stepped_at = -math.inf
        self._through_round = False  # see compute_through_round
        self._sweep = False  # see sweep_next_read
        self.poll: float | None = None  # announced: see report
        self._rates: dict[str, float] = {}  # each peer's last non-zero published rate
        # Peers whose samples count for nothing: see weighed; the epoch of the newest verdict
        # on each peer we took (ours or a quorum's, see _take_outcomes); and our last verified
        # round's outcome (published: others outside our group learn from it).
        self.void: set[str] = set()
        self._verdicts: dict[str, tuple[int, bool]] = {}  # peer -> (epoch, ours)
        self.outcome: tuple[int, tuple[str, ...], tuple[str, ...]] | None = None
        self._reporters: set[str] = set()  # peers a counting outcome counted (see above)
        # (reporter, epoch) -> its outcome of that epoch, as read (the last OUTCOME_EPOCHS)
        self._outcomes: dict[tuple[str, int], tuple[int, tuple[str, ...], tuple[str, ...]]] = {}

    # --- the target ------------------------------------------------------------------------
    def use_target(self, target: int) -> None:
        """Train toward ``target`` samples per step and publish it; ValueError if this peer
        already trains toward another (configured, or given before)."""
        if not isinstance(target, int) or isinstance(target, bool) or target <= 0:
            raise ValueError(f"target_batch_size must be a positive integer, got {target!r}")
        if self._target is not None and self._target != target:
            raise ValueError(
                f"target_batch_size {target} differs from the {self._target} this peer "
                "already trains toward: one target per peer"
            )
        if self._target != target:
            self._target = target
            self._wake.set()

    @property
    def target(self) -> int | None:
        """This peer's target, or (a peer that sets none) the one most trainers publish."""
        if self._target is not None:
            return self._target
        named = Counter(
            r.target for r in self.records.values() if r.target is not None and r.mode != "aux"
        )
        return named.most_common(1)[0][0] if named else None

    def _check_targets(self) -> None:
        """Warn (once per peer and value) about peers that train toward another target."""
        if self._target is None:
            return
        for pid, r in self.records.items():
            if r.target is None or r.target == self._target or pid == self.peer_id:
                continue
            if (pid, r.target) not in self._warned_targets:
                self._warned_targets.add((pid, r.target))
                log.warning(
                    "peer %s trains toward target_batch_size %d, this peer toward %d: "
                    "every peer of a run must use the same target",
                    pid,
                    r.target,
                    self._target,
                )

    @property
    def table_fresh(self) -> bool:
        """Whether the progress table was read after this peer's first report (before that,
        peers that opened at the same time may be missing from it)."""
        first = self._first_report_at
        return first is not None and self._read_started_at >= first

    async def read_fresh_table(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) for a table read that began after our first
        report; whether one came."""
        with trio.move_on_after(timeout):
            while not self.table_fresh:
                read = self._read
                self._wake.set()
                await read.wait()
        return self.table_fresh

    def _rates_unknown(self) -> bool:
        """Whether a peer that trains at our epoch (we included) has no rate yet: the
        estimate cannot extrapolate it, so the table must be read often."""
        if self._first_report_at is None:
            return False
        own = self.own_progress()
        peers = [*(r for r in self.contenders().values() if r.peer_id != self.peer_id), own]
        return any(
            r.epoch == own.epoch and r.averages and not r.waiting and r.samples_per_second == 0
            for r in peers
            if r.mode != "aux"
        )

    # --- called by the collaboration (inside the trio loop) -------------------------------
    def report(
        self, epoch: int, samples: int, batch_size: int, *, poll: float | None = None
    ) -> None:
        """Record local progress; wakes the publisher when the peer moves to a new epoch
        (and on its first report, so that it reads the table at once). ``poll``: the seconds
        between this peer's checks inside its micro-steps whether to average (None: it checks
        between micro-steps only), announced in our record (:attr:`PeerProgress.poll`)."""
        now = trio.current_time()
        if poll is not None and not MIN_POLL <= poll <= MAX_POLL:
            poll = None  # (a record cannot name it: announce none)
        if poll != self.poll:
            self.poll = poll
            self._wake.set()
        if self._first_report_at is None:
            self._first_report_at = now
            self._wake.set()
        self.meter.update(batch_size, now)
        if self._last_report is not None:
            dt = now - self._last_report
            self.step_interval = (
                dt if self.step_interval == 0 else 0.7 * self.step_interval + 0.3 * dt
            )
        self._last_report = now
        self._batch = batch_size
        if self._frozen and epoch > self.epoch:
            # Delayed updates: we keep training for the next epoch while this one's round is
            # in flight. Others go on seeing our final record until the round ends.
            self._pending = (epoch, samples, self.dht.now())
            return
        self._report_time = self.dht.now()
        new_epoch = epoch != self.epoch
        self.epoch, self.samples = epoch, samples
        if self._mates_began is None and self.mates[0] == epoch:
            # we (and they) began computing one micro-batch before this first report
            # (not before our step when our micro-step went on through the round: it began
            # before the step, our blocking mates at it)
            rate = self.rate
            began = self._report_time - (self._batch / rate if rate > 0 else 0.0)
            self._mates_began = max(began, self._stepped_at)
        if new_epoch:
            self._wake.set()

    def compute_through_round(self) -> None:
        """The round we begin now runs while our micro-step in flight goes on (we average the
        samples we held before it; see :meth:`dedloc_jax.peer.CollaborationPeer.due`): its
        time is training time, so the next report measures that micro-step whole. (Paused,
        a peer that averaged mid-micro-step every epoch never measured a rate, and the others
        counted it at theirs: 20-30 samples/s for a 1 sample/s peer.)"""
        self._through_round = True

    def join_averaging(self) -> None:
        """An aux peer starts joining rounds: published at once, so that groups wait for it."""
        if not self.averages:
            self.averages = True
            self._wake.set()

    def set_epoch(self, epoch: int, *, state_follows: bool = False) -> None:
        """Move to ``epoch``: with the samples reported toward it while the previous round
        was in flight (delayed updates), else with none, and then the time spent averaging
        was not training time.

        ``state_follows``: the peer is about to serve the state it stepped to (:meth:`serve`);
        the publisher then waits for it (up to ``min_refresh`` seconds) and stores both in one
        record, instead of one store for the epoch and another for the state."""
        pending, self._pending = self._pending, None
        through, self._through_round = self._through_round, False
        self._frozen = False
        self._stepped_at = self.dht.now() if through else -math.inf
        if pending is not None and pending[0] == epoch:
            self.epoch, self.samples, self._report_time = pending
        else:
            self.epoch, self.samples = epoch, 0
            if not through:
                self.meter.pause()
                self._last_report = None
            self._report_time = self.dht.now()
        self._state_due = (
            trio.current_time() + self.config.progress.min_refresh if state_follows else None
        )
        self._wake.set()

    def serve(self, epoch: int, digest: bytes, lineage: tuple[bytes, ...]) -> None:
        """The state we now serve (its epoch, digest and lineage): published at once, since
        the others' fork checks count it. Raises ValueError for a malformed state (it would
        fail every publish)."""
        state = (epoch, digest, tuple(lineage))
        check_state(state)
        if state != self.served:
            self.served = state
            self._wake.set()

    def states(self) -> list[tuple[str, int, bytes, tuple[bytes, ...]]]:
        """(peer, epoch, digest, lineage) of every other peer's served state, as last read."""
        return [
            (pid, *r.state)
            for pid, r in self.records.items()
            if r.state and pid != self.peer_id and not self._is_banned(pid)
        ]

    def announcements(self) -> list[Announcement]:
        """:meth:`states` as the fork choice counts them: an aux peer's state (a coordinator's
        checkpoint) is a copy it serves, not a vote (:attr:`Announcement.votes`)."""
        return [
            Announcement(
                pid,
                *r.state,
                votes=r.mode != "aux",
                vouched=self._vouched(pid),
                endorsed=self.endorsed is not None and self.endorsed(pid),
            )
            for pid, r in self.records.items()
            if r.state and pid != self.peer_id and not self._is_banned(pid)
        ]

    def _vouched(self, pid: str) -> bool:
        return self.vouched is not None and self.vouched(pid)

    def newest_served(self) -> int | None:
        """The newest epoch another peer serves a state of, among peers whose epoch someone
        backs (see :meth:`backed_ceiling`): a made-up state in an unbacked record must not
        send a peer to download."""
        self._drop_banned()
        self._find_unbacked()
        return max(
            (
                r.state[0]
                for pid, r in self.records.items()
                if r.state and pid != self.peer_id and pid not in self.unbacked
            ),
            default=None,
        )

    def newest_announced(self) -> int | None:
        """The newest epoch another peer serves a state of, backed or not: a newcomer asks
        the download's choice about it (a coordinator's copy backs no epoch here)."""
        self._drop_banned()
        return max(
            (r.state[0] for pid, r in self.records.items() if r.state and pid != self.peer_id),
            default=None,
        )

    def _is_banned(self, peer: str) -> bool:
        return self._banned is not None and peer != self.peer_id and self._banned(peer)

    def _drop_banned(self) -> None:
        """Drop the records of peers banned since the last read (a ban lands mid-round, and
        the liar must stop counting at once, not at our next read)."""
        if self._banned is None or not any(map(self._is_banned, self.records)):
            return
        self.records = {p: r for p, r in self.records.items() if not self._is_banned(p)}
        self._find_losers()

    def contenders(self) -> dict[str, PeerProgress]:
        """The records of the peers on the lineage the collaboration follows (and of those
        that serve no state yet): only they move its epoch and count toward its batch.

        After a healed partition the side that lost may be ahead, and the winners, "behind"
        with no newer state to load, must not wait for it: the losers are left out until their
        own fork check moves them."""
        self._drop_banned()
        self._find_unbacked()
        left_out = self.losers | self.unbacked
        if not left_out:
            return self.records
        return {pid: r for pid, r in self.records.items() if pid not in left_out}

    def backed_ceiling(self) -> int:
        """The newest epoch a claim may name and count: ours; the one more than half of the
        trainers reached (others', and ours once we train and serve a state: a newcomer's
        epoch 0 says nothing); or the epoch of the state the fork choice names. A record
        ahead of all three (one peer's ``epoch: 2**53 - 1``, stored once, stopped every
        trainer, which waited to be "behind" no more) stands for nobody and is left out."""
        trainers = {
            pid: r
            for pid, r in self.records.items()
            if pid != self.peer_id and r.mode == "node" and pid not in self.losers
        }
        # While any trainer's state is vouched, only those count (Sybil identities that never
        # averaged with the run would otherwise make up "more than half").
        vouched = [r for pid, r in trainers.items() if r.state and self._vouched(pid)]
        counted = [r.epoch for r in vouched or trainers.values()]
        if self.served is not None and self.mode == "node":
            counted.append(self.epoch)
        quorum = backed_epoch(counted)
        return max(self.epoch, -1 if quorum is None else quorum, self._chosen_backed() or -1)

    def _chosen_backed(self) -> int | None:
        """:attr:`chosen_epoch` when a peer whose word counts holds that state: ours, or an
        averaged-with, vouched-for or endorsed peer's; before we averaged with anyone, one we
        saw train at it or before, until a download refutes it (:meth:`_stranger_backs`).
        A state only strangers announce is no backing otherwise:
        bench.byzantine's keep_leading (a made-up state one epoch ahead, the only one
        announced where trainers serve none) was chosen, lifted the ceiling, and every honest
        peer waited, "behind", at epoch 3 for good."""
        if self.chosen_epoch is None:
            return None
        backers, epoch = self._chosen_holders, self.chosen_epoch
        endorsed = self.endorsed
        if (
            self.peer_id in backers
            or any(p in self._averaged_with or self._vouched(p) for p in backers)
            or (endorsed is not None and any(map(endorsed, backers)))
        ):
            return epoch
        # Having averaged with nobody (a run's start, a newcomer), a peer we saw train (claim
        # samples) at it or before backs it, for a while; keep_leading's claimer claims none.
        if not self._averaged_with and any(map(self._stranger_backs, sorted(backers))):
            return epoch
        return None

    def _stranger_backs(self, holder: str) -> bool:
        """Whether ``holder`` of the chosen state, a peer we have no word on, backs its epoch
        for us, who averaged with nobody yet: one we saw train at it or before (a donor, an
        honest step) does, until a download of it fails while it still publishes (it is here
        and did not serve what it claims), or for a record's lifetime when no download
        confirms it. A donor that left (failed, and no record of it read since) backs it
        until its record lapses. One attacker that kept one epoch ahead with a made-up state
        and claimed samples there held every peer at a run's start, "behind", for good
        (tests/dedloc_jax/test_leading_claimer.py)."""
        assert self._chosen is not None
        epoch, digest = self._chosen
        if self._trained.get(holder, epoch + 1) > epoch:
            return False
        failed = None if self._failed is None else self._failed(holder, epoch, digest)
        if failed is not None:
            return self._renewed.get(holder, -math.inf) <= failed
        # The clock (holder -> the epoch it first backed unconfirmed, since when) runs per
        # holder, not per state: one that names another digest or epoch at each republish
        # starts none anew. It starts anew once we reached the epoch it backed (we loaded
        # that state, or the run got there): a donor's next state is news again.
        now = trio.current_time()
        held = self._unconfirmed.get(holder)
        if held is None or self.epoch >= held[0]:
            held = self._unconfirmed[holder] = (epoch, now)
            while len(self._unconfirmed) > MAX_LOGGED:
                del self._unconfirmed[next(iter(self._unconfirmed))]
        return now - held[1] < self.config.progress.ttl

    def _find_unbacked(self) -> None:
        """Recount :attr:`unbacked` when the table, our epoch or the states changed."""
        key = (self.epoch, self.served is not None, self._chosen_backed(), self.losers)
        if key == self._unbacked_input and self._unbacked_table is self.records:
            return
        self._unbacked_input, self._unbacked_table = key, self.records
        ceiling = self.backed_ceiling()
        unbacked = {
            pid: r.epoch
            for pid, r in self.records.items()
            if pid != self.peer_id and r.epoch > ceiling
        }
        now = trio.current_time()
        ahead = {
            pid: self._unbacked_since.get(pid, now)
            for pid, epoch in unbacked.items()
            if epoch == ceiling + 1
        }
        for pid in sorted(ahead.keys() - self._unbacked_since.keys() - self._unbacked_noted):
            # Said at INFO when first left out: a claim that keeps one epoch ahead moves with
            # the run, its wait restarting at every step, so the WARNING below may never come.
            _first_time(self._unbacked_noted, pid)
            log.info(
                "ignoring peer %s's progress at epoch %d for now: most trainers are at %d or "
                "before and no state of it is served (said once per peer)",
                pid,
                unbacked[pid],
                ceiling,
            )
        self._unbacked_since = ahead
        undecided = self._undecided()
        for pid, epoch in sorted(unbacked.items()):
            # One epoch ahead is also a round's member whose record landed before its mates'
            # (a coordinator warned of each trainer in healthy runs): said once it lasts.
            since = self._unbacked_since.get(pid)
            if since is not None and now - since < self.config.progress.ttl:
                continue
            if undecided and self.records[pid].state and pid not in self._unbacked_logged:
                # While our keeper may still load it, the download's choice decides about its
                # state, not this table: said at INFO; the WARNING once we have decided.
                if _first_time(self._unbacked_noted, pid):
                    log.info(
                        "peer %s serves a state of epoch %d that no progress record backs "
                        "(most trainers are at %d or before): the download's choice decides",
                        pid,
                        epoch,
                        ceiling,
                    )
                continue
            if _first_time(self._unbacked_logged, pid):
                log.warning(
                    "ignoring peer %s's progress at epoch %d: most trainers are at %d or "
                    "before and no state of it is served (logged once per peer)",
                    pid,
                    epoch,
                    ceiling,
                )
        self.unbacked = frozenset(unbacked)

    def _undecided(self) -> bool:
        """Whether our keeper may still take the run's state instead of ours: we serve none
        yet, or our initial one (epoch 0, no lineage), and averaged with nobody."""
        served = self.served
        return not self._averaged_with and (served is None or (served[0] == 0 and not served[2]))

    def expect_mates(self, epoch: int, peers: Iterable[str]) -> None:
        """``peers`` averaged with us into ``epoch``: they are expected in its round (the
        collaboration's ``_peers_at``), and until their own record of it is read they count as
        having started it when we did (see :meth:`projected`)."""
        self.mates = (epoch, frozenset(peers) - {self.peer_id})
        self._mates_began = None
        for peer in self.mates[1]:
            self._averaged_with.pop(peer, None)
            self._averaged_with[peer] = epoch
        while len(self._averaged_with) > MAX_LOGGED:
            del self._averaged_with[next(iter(self._averaged_with))]

    def weighed(self, void: set[str], counted: set[str]) -> None:
        """A verified round we took part in weighed nothing of ``void``'s contributions and
        something of ``counted``'s: the first count no samples until a round shows them
        weighing again (:mod:`dedloc_jax.rounds.claims`). One that claims no samples at our
        epoch (a newcomer averaging with weight 0) lied about nothing and is not marked.
        The verdicts go into our next record (:attr:`outcome`)."""
        marked = set()
        for peer in void - {self.peer_id}:
            r = self.records.get(peer)
            if r is None or r.epoch != self.epoch or r.samples > 0:
                marked.add(peer)
        for peer in marked | (counted - {self.peer_id}):
            self._verdict(peer, self.epoch, peer in marked, True)
        senders = sorted(marked) + sorted(counted - marked - {self.peer_id})
        senders = senders[:MAX_OUTCOME]
        self.outcome = (self.epoch, tuple(senders), tuple(p for p in senders if p in marked))

    def _verdict(self, peer: str, epoch: int, void: bool, ours: bool) -> None:
        """Take a verdict on ``peer`` from a round of ``epoch`` (``ours``: one we took part
        in), unless we hold a newer one, or our own of the same epoch (we checked it)."""
        held, held_ours = self._verdicts.get(peer, (-1, False))
        if held > epoch or (held == epoch and held_ours and not ours):
            return
        self._verdicts.pop(peer, None)
        self._verdicts[peer] = (epoch, ours)
        while len(self._verdicts) > MAX_LOGGED:
            del self._verdicts[next(iter(self._verdicts))]
        if void and peer not in self.void:
            log.info(
                "peer %s's contribution weighed nothing at epoch %d (%s): its samples count 0 "
                "and its registrations weigh 0",
                peer,
                epoch,
                "in our round" if ours else "as its group's quorum reported",
            )
            self.void.add(peer)
            while len(self.void) > MAX_LOGGED:
                self.void.pop()
        elif not void:
            self.void.discard(peer)

    def weightless(self, peer: str) -> bool:
        """Whether ``peer``'s contribution weighed nothing in its newest round we know of (see
        :meth:`weighed` and :func:`~dedloc_jax.rounds.claims.reported_void`)."""
        return peer in self.void

    def _take_outcomes(self) -> None:
        """Take the verdicts a quorum of the table's reporters agree on
        (:func:`~dedloc_jax.rounds.claims.reported_void`): a peer whose contribution weighed
        nothing in another group counts for nothing here too. Reporters must be proven (a
        fresh identity's word costs nothing), or counted in a counting one's outcome (now or
        before: remembered), and not weightless themselves."""
        for pid, r in self.records.items():
            # (an outcome of an epoch ahead of ours and the reporter's own is no round yet)
            outcome = r.outcome
            if (
                outcome is not None
                and pid != self.peer_id
                and outcome[0] <= min(r.epoch, self.epoch + 1)
            ):
                self._outcomes[(pid, outcome[0])] = outcome
        for key in [k for k in self._outcomes if k[1] < self.epoch - OUTCOME_EPOCHS]:
            del self._outcomes[key]
        while len(self._outcomes) > MAX_LOGGED:
            del self._outcomes[next(iter(self._outcomes))]
        if not self._outcomes or not self._averaged_with:
            return  # (having averaged with nobody, we cannot tell a reporter from a Sybil)
        outcomes = [(reporter, outcome) for (reporter, _), outcome in self._outcomes.items()]
        counting, named = counting_reporters(
            outcomes, lambda r: self.proven(r) or r in self._reporters, self.void
        )
        for peer in named - self._reporters:
            if len(self._reporters) >= MAX_LOGGED:
                self._reporters.clear()
            self._reporters.add(peer)
        for peer, (epoch, void) in reported_void(outcomes, counting).items():
            if peer != self.peer_id:
                self._verdict(peer, epoch, void, False)

    def proven(self, peer: str) -> bool:
        """Whether ``peer``'s claims count in full: it averaged with us, or another peer
        vouched that it averaged with them, or we have averaged with nobody yet (then nobody
        is proven and everyone counts, as at a run's start)."""
        return not self._averaged_with or peer in self._averaged_with or self._vouched(peer)

    def projected(self) -> dict[str, PeerProgress]:
        """The contenders' records as the estimate counts them. Two predictions fill the gap
        until a read shows the truth (an epoch of fast micro-steps can end before the next
        read):

        - a peer that averaged with us into our epoch, still read at the epoch before or with
          no sample counted in it yet, started this one when we did (our first micro-step in
          it), at its last known rate;
        - a peer at our epoch that reports samples but no rate yet (it just started) trains at
          our rate."""
        records = dict(self.contenders())
        into, mates = self.mates
        began = self._mates_began
        for pid in mates if began is not None else ():
            r = records.get(pid)
            if r is not None and r.epoch == into and r.samples == 0 and not r.waiting:
                # it stepped but has not counted a sample: stamped at its step, before the
                # pause that follows one (serving, loading, compiling), as ours was
                records[pid] = dataclasses.replace(r, time=max(r.time, began))
            elif r is not None and r.epoch == into - 1:
                # (its last record is the frozen one it published while averaging, with the
                # rate it trains at; one that never published a rate trains at ours, as below)
                rate = r.samples_per_second or self._rates.get(pid, 0.0) or self.rate
                records[pid] = dataclasses.replace(
                    r, epoch=into, samples=0, samples_per_second=rate, time=began, waiting=False
                )
        rate = 0.0 if self._frozen else self.rate
        if rate > 0:
            for pid, r in records.items():
                if (
                    pid != self.peer_id
                    and r.epoch == self.epoch
                    and r.samples > 0
                    and r.samples_per_second == 0
                    and not r.waiting
                    and r.mode != "aux"
                ):
                    records[pid] = dataclasses.replace(r, samples_per_second=rate)
        return records

    @property
    def rate(self) -> float:
        """Our samples per second: the smoothed meter, or, before it has a span long enough to
        measure (an epoch of millisecond micro-steps may be shorter), the last micro-batch
        over the smoothed time between micro-steps."""
        rate = self.meter.samples_per_second
        if rate == 0 and self.step_interval > 0:
            rate = self._batch / self.step_interval
        return rate

    def _find_losers(self) -> None:
        """Recount :attr:`losers` when the served states changed (most reads change none)."""
        announced = self.announcements()
        key = (tuple(announced), self.served)  # (ranks too: an answer of our roots moves them)
        if key == self._fork_input:
            return
        self._fork_input = key
        if self.served is not None:
            announced.append(Announcement(self.peer_id, *self.served, votes=self.mode != "aux"))
        self.losers = frozenset(losing_peers(announced) - {self.peer_id})
        chosen = fork_choice(announced) if announced else None
        self.chosen_epoch = None if chosen is None else chosen[0]
        self._chosen = chosen
        self._chosen_holders = frozenset(
            str(a.peer) for a in announced if chosen == (a.epoch, a.digest)
        )

    async def freeze(self) -> None:
        """Publish that this peer stopped accumulating (it is averaging): ``waiting``, with
        the rate it trains at (readers extrapolate no waiting record; the rate is what its
        mates count it at once it trains again, before their next read)."""
        self._frozen = True
        await self.publish()

    async def leave(self) -> None:
        """Publish that this peer leaves the run: it joins no more rounds and brings no
        samples, so that nobody waits for it in matchmaking, counts samples it will never
        send, or warns that the run steps without it while its record lives on."""
        self.averages = False
        self.samples = 0
        self.meter = ThroughputMeter(half_life=10.0)
        self.step_interval = 0.0
        self._frozen = False
        await self.publish()

    def own_progress(self) -> PeerProgress:
        """Our record, stamped with the time our samples were counted (not the time we
        publish), so that others extrapolate from the right instant."""
        return PeerProgress(
            self.peer_id,
            self.epoch,
            self.samples,
            self.rate,
            self._report_time,
            self.mode,
            self.step_interval,
            waiting=self._frozen,
            state=self.served,
            averages=self.averages,
            target=self._target,
            alone=not (self.mates[0] == self.epoch and self.mates[1]),
            outcome=self.outcome,
            poll=self.poll,
        )

    def waiting_since(self, epoch: int) -> list[float]:
        """When each other contender that waits in ``epoch``'s round stopped (its record's
        time, DHT time)."""
        return [
            r.time
            for pid, r in self.contenders().items()
            if pid != self.peer_id and r.epoch == epoch and r.waiting
        ]

    def stored_since(self, epoch: int) -> float:
        """DHT time by which our first record of ``epoch`` was stored (inf: none yet): a peer
        that read the table after it knows that we train toward ``epoch``."""
        stored_epoch, at = self._epoch_stored
        return at if stored_epoch == epoch else math.inf

    def published_error(self) -> float:
        """How far (in samples) others' extrapolation of our last published record is from
        what we hold now; inf when they hold none for this epoch."""
        pub = self._published
        if pub is None or pub.epoch != self.epoch or pub.time > self._report_time:
            return math.inf
        elapsed = min(self._report_time - pub.time, self.max_extrapolation)
        return abs(pub.samples + pub.samples_per_second * elapsed - self.samples)

    @property
    def max_extrapolation(self) -> float:
        """Seconds a record is extrapolated at most (so a dead peer's claims stay bounded)."""
        progress = self.config.progress
        return progress.max_refresh * 2 if progress.extrapolate else 0.0

    def current_estimate(self) -> CollaborationEstimate:
        """The estimate extrapolated to now, with this peer's own progress exact."""
        records = self.projected()
        records[self.peer_id] = self.own_progress()
        return self._estimate(records, self.dht.now())

    def committed_estimate(self) -> CollaborationEstimate:
        """The estimate counting whole micro-steps only: each other computing peer's record
        extrapolated by the micro-steps it completed since (at its step interval and rate),
        ours as reported. It is what the peers hold if each averaged now what it accumulated,
        leaving its micro-step in flight to the next epoch (``CollaborationPeer.due``). A
        mid-step decision takes this one, not :meth:`current_estimate`, which also counts the
        fractions of micro-steps in flight: the epoch must still reach the target."""
        now = self.dht.now()
        records = self.projected()
        records[self.peer_id] = dataclasses.replace(self.own_progress(), time=now)
        for pid, r in records.items():
            if pid == self.peer_id or r.waiting:
                continue
            # (a peer whose step interval we do not know yet counts what it reported)
            elapsed = min(max(0.0, now - r.time), self.max_extrapolation)
            steps = math.floor(elapsed / r.step_interval) if r.step_interval > 0 else 0
            done = round(steps * r.step_interval * r.samples_per_second)  # (whole batches)
            records[pid] = dataclasses.replace(r, samples=r.samples + done, time=now)
        return self._estimate(records, now)

    def _estimate(self, records: dict[str, PeerProgress], now: float) -> CollaborationEstimate:
        """The collaboration's estimate from ``records`` (ours among them) at DHT time ``now``,
        under this peer's bounds on the others' claims."""
        target = self.target
        return estimate_collaboration(
            records.values(),
            now=now,
            target_batch_size=math.inf if target is None else target,
            max_extrapolation=self.max_extrapolation,
            me=self.peer_id,
            proven=self.proven,
            began=self._began(),
            void=self.void.__contains__,
        )

    def _began(self) -> dict[str, float]:
        """When our mates began our epoch: when we did (they stepped into it with us)."""
        into, mates = self.mates
        if self._mates_began is None or into != self.epoch:
            return {}
        return dict.fromkeys(mates, self._mates_began)

    # --- DHT I/O -----------------------------------------------------------------------
    def settled_eta(self) -> float:
        """The ETA if every peer we know trained toward our epoch at its last known rate: just
        after a step, while few peers have entered the new epoch, the estimate's ETA is long,
        and reading or renewing rarely then overshot (test_collaboration's 10x spread). Zero
        during our first ``idle_after`` seconds: peers that join with us are not in the table
        yet, and a first peer alone in it would otherwise read every ``idle_refresh``."""
        first = self._first_report_at
        if first is None or trio.current_time() - first < self.config.progress.idle_after:
            return 0.0
        est = self.current_estimate()
        rates = {**{p: self._rates.get(p, 0.0) for p in self.records}, self.peer_id: self.rate}
        total = sum(rates.values())
        remaining = max(0.0, est.target - est.samples)
        return min(est.eta, remaining / total if total > 0 else math.inf)

    def record_ttl(self) -> float:
        """How long our next record lives: ``progress_ttl``, or at ``idle_after`` or more
        from the target up to half the (settled) ETA within ``idle_ttl``, so that a peer that
        vanishes still expires before the step while one that stays renews its record rarely."""
        eta = self.settled_eta()
        progress = self.config.progress
        if not progress.idle_after <= eta < math.inf:
            return progress.ttl
        return max(progress.ttl, min(eta / 2, progress.idle_ttl))

    def _relocate_interval(self) -> float:
        """How long the table's nearest nodes found by a lookup are followed: the follower's
        30 s, or far from the target (rare reads) our record's lifetime: holders change only
        with churn, and a failed holder or a nearer node relocates the follower at once."""
        eta = self.settled_eta()
        default = self._follower.relocate_interval
        if not self.config.progress.idle_after <= eta < math.inf:
            return default
        return max(default, self.record_ttl())

    async def publish(self) -> None:
        me = self.own_progress()
        ttl = self.record_ttl()
        try:
            await self.dht.store(
                progress_key(self.run_id),
                me.to_record(),
                self.dht.now() + ttl,
                subkey=owner_marker(self.dht.peer_id),
                replicas=follower_replicas(self.dht.config),
            )
            self._published_at = trio.current_time()
            self._published_ttl = ttl
            if me.epoch != self._epoch_stored[0]:
                self._epoch_stored = (me.epoch, self.dht.now())
            self._published_epoch = me.epoch
            self._published = me
        except (P2PError, InvalidRecordError) as e:
            log.warning("could not publish progress: %s", e)

    def sweep_next_read(self) -> None:
        """Read the table now, asking every holder, not one (for a peer that sees the epoch's
        round forming and is not ready: see ``CollaborationPeer.due``; asked again only once
        that read began, so at most one read per call)."""
        if not self._sweep:
            self._sweep = True
            self._wake.set()

    async def fetch(self) -> CollaborationEstimate:
        started = trio.current_time()
        sweep, self._sweep = self._sweep, False
        try:
            view = await self._follower.read(
                sweep=sweep, relocate_interval=self._relocate_interval()
            )
        except P2PError as e:
            # Keep the last table: an empty one says nobody else trains, and a peer whose
            # round failed would then keep its own parameters instead of loading the others'.
            log.warning("could not read progress (keeping the last table): %s", e)
            return self.current_estimate()
        self.dht_latency += 0.2 * (trio.current_time() - started - self.dht_latency)
        records: dict[str, PeerProgress] = {}
        parsed: dict[str, tuple[Record, PeerProgress | None]] = {}
        if isinstance(view, dict):
            for subkey, rec in sorted(view.items()):
                # Most records did not change since the last read: parse only the new ones.
                known = self._parsed.get(subkey)
                progress = (
                    known[1] if known is not None and known[0] is rec else _parse(subkey, rec)
                )
                parsed[subkey] = (rec, progress)
                newer = known is None or rec.newer_than(known[0])  # (not another replica's)
                if newer and progress is not None:  # its peer publishes: see _stranger_backs
                    self._renewed.pop(progress.peer_id, None)
                    self._renewed[progress.peer_id] = started
                if progress is not None and not self._is_banned(progress.peer_id):
                    records[progress.peer_id] = progress
        self._parsed = parsed
        self.records = records
        for pid, r in records.items():  # who trains, since which epoch (_chosen_backed)
            if r.mode == "node" and r.samples > 0 and pid not in self._trained:
                self._trained[pid] = r.epoch
        while len(self._trained) > MAX_LOGGED:
            del self._trained[next(iter(self._trained))]
        while len(self._renewed) > MAX_LOGGED:
            del self._renewed[next(iter(self._renewed))]
        self._rates = {
            pid: r.samples_per_second or self._rates.get(pid, 0.0) for pid, r in records.items()
        }
        self._read_started_at = started
        self._read.set()  # wakes those waiting for this read
        self._read = trio.Event()
        self._check_targets()
        self._take_outcomes()
        self._find_losers()
        self.estimate = self.current_estimate()
        return self.estimate

    async def refresh(self) -> CollaborationEstimate:
        await self.publish()
        return await self.fetch()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.refresh()
        task_status.started()
        while True:
            if self._frozen:
                # Averaging: our record is final (rate zero) and set_epoch wakes us when the
                # round ends, so a slow pace saves the DHT from every peer polling at once.
                delay = self.config.progress.max_refresh
            else:
                est = self.current_estimate()
                if self._rates_unknown():  # nothing to extrapolate from: read as if near
                    est = dataclasses.replace(est, eta=0.0)
                delay = refresh_delay(
                    est,
                    min_delay=self.config.progress.min_refresh,
                    max_delay=self.config.progress.max_refresh,
                    crowd=self.dht.config.replication,  # readers the key's replicas serve
                    idle_delay=self.config.progress.idle_refresh,
                    idle_eta=self.settled_eta(),
                    idle_after=self.config.progress.idle_after,
                )
            with trio.move_on_after(delay):
                await self._wake.wait()
            self._wake = trio.Event()
            due, self._state_due = self._state_due, None
            if due is not None and not self._serving_our_epoch():
                with trio.move_on_at(due):  # the state we stepped to is due any moment
                    await self._wake.wait()
                self._wake = trio.Event()
            if self._should_publish():
                await self.publish()
            await self.fetch()

    def _serving_our_epoch(self) -> bool:
        return self.served is not None and self.served[0] == self.epoch

    def _should_publish(self) -> bool:
        """Publishing is the costly half (a store goes to many DHT nodes), so we publish only
        what others need: a new epoch or served state at once; our rate once it is first
        known; and whenever their extrapolation of our record is off by more than what matters
        at their distance from the target (half a micro-batch near it, a fifth of what we will
        still add before it far from it: the others' ETA is then off by a fifth at most).
        Otherwise only often enough that the record does not expire (:meth:`record_ttl`).
        (Readers extrapolate a record for seconds only, so its error grows with our rate: an
        error bound by what we add before the renewal published hours from the step every
        ~400 s, its renewal due every 600 s: 6.5 of 13 MB of a 12-peer DiLoCo run's stores.)"""
        if self._published_epoch != self.epoch or self._published is None:
            return True
        if self._published.state != self.served or self._published.averages != self.averages:
            return True
        if self._published.target != self._target:
            return True
        if trio.current_time() - self._published_at > self._published_ttl / 3:
            return True
        if self._frozen:
            return False  # freeze() published our final record
        rate = self.rate
        if self._published.samples_per_second == 0 and rate > 0:
            return True
        eta = self.estimate.eta
        if self._published_ttl <= self.config.progress.ttl:  # (near: as DeDLOC always was)
            eta = min(eta, self._published_ttl)
        return self.published_error() > max(self._batch / 2, rate * eta / 5)


def _parse(subkey: str, rec: Record) -> PeerProgress | None:
    """One peer's progress record, or None (malformed: logged and ignored)."""
    names = owner_markers(subkey)
    if len(names) != 1:
        return None
    try:
        return PeerProgress.from_record(names[0], rec.decoded())
    except ValueError as e:
        log.info("ignoring malformed progress of %s: %s", names[0], e)
        return None
