"""Progress of a collaboration: per-peer records and the collaboration-wide estimate.

Each peer publishes a :class:`PeerProgress` in the DHT (one signed subkey per peer under the
run's progress key). Every peer reads all records and, with :func:`estimate_collaboration`,
extrapolates how many samples the collaboration has accumulated toward the current epoch and
when it will reach the target. Pure logic: no I/O, times are passed in.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MODES = ("node", "client", "aux")


@dataclass(frozen=True, slots=True)
class PeerProgress:
    """One peer's report: it holds ``samples`` samples toward ``epoch`` as of ``time``."""

    peer_id: str
    epoch: int
    samples: int
    samples_per_second: float
    time: float
    mode: str = "node"
    step_interval: float = 0.0  # smoothed seconds between this peer's micro-steps
    # It stopped accumulating for ``epoch`` and waits in matchmaking for the round.
    waiting: bool = False
    # The state it serves: (epoch, digest, lineage: the digests it descends from, newest
    # first). Fork checks count lineages over this table, which every peer already follows,
    # instead of reading every state announcement again (see dedloc_jax.state.serving).
    state: tuple[int, bytes, tuple[bytes, ...]] | None = None
    # It joins averaging rounds. False for an aux-mode peer that only follows the run (a
    # coordinator): groups must not wait for it to register.
    averages: bool = True
    # The samples per step it trains toward (None: it does not say, e.g. an aux peer that
    # follows the run). Peers of one run that disagree are told so (the tracker warns).
    target: int | None = None
    # It entered ``epoch`` without averaging with another peer (a step alone, a newcomer, a
    # peer that moved on without stepping): its record is no sign that a group of the epoch
    # before averaged apart from ours (CollaborationPeer._stepped_without).
    alone: bool = False
    # Its last verified round's outcome: (epoch, the senders it checked, those of them whose
    # contribution weighed nothing), so that peers outside its group learn whom to weigh as 0
    # (a quorum of a group's members must agree: dedloc_jax.rounds.claims.reported_void).
    outcome: tuple[int, tuple[str, ...], tuple[str, ...]] | None = None
    # Seconds between its checks inside a micro-step whether to average (None: it checks
    # between micro-steps only). An untrusted claim: it only shortens the rounds that expect
    # it (rounds/stepping.py), so a liar that notices the target late loses its own place.
    poll: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.epoch < 0 or self.samples < 0:
            raise ValueError("epoch and samples must be non-negative")
        if not math.isfinite(self.samples_per_second) or self.samples_per_second < 0:
            raise ValueError("samples_per_second must be finite and non-negative")
        if not math.isfinite(self.time):
            raise ValueError("time must be finite")
        if not math.isfinite(self.step_interval) or self.step_interval < 0:
            raise ValueError("step_interval must be finite and non-negative")
        if self.state is not None:
            check_state(self.state)
        if self.target is not None and not (
            isinstance(self.target, int)
            and not isinstance(self.target, bool)
            and 0 < self.target <= MAX_TARGET
        ):
            raise ValueError(f"target must be an integer in 1..{MAX_TARGET}")
        if self.outcome is not None:
            check_outcome(self.outcome)
        if self.poll is not None and not (
            isinstance(self.poll, float) and MIN_POLL <= self.poll <= MAX_POLL
        ):
            raise ValueError(f"poll must be a number of seconds in [{MIN_POLL}, {MAX_POLL}]")

    def to_record(self) -> dict[str, Any]:
        """The msgpack-able value stored in the DHT (the peer ID is the subkey)."""
        return {
            "epoch": self.epoch,
            "samples": self.samples,
            "sps": self.samples_per_second,
            "time": self.time,
            "mode": self.mode,
            "interval": self.step_interval,
            "waiting": self.waiting,
            **({} if self.state is None else {"state": _state_record(self.state)}),
            **({} if self.averages else {"averages": False}),
            **({} if self.target is None else {"target": self.target}),
            **({"alone": True} if self.alone else {}),
            **({} if self.outcome is None else {"outcome": _outcome_record(self.outcome)}),
            **({} if self.poll is None else {"poll": self.poll}),
        }

    @classmethod
    def from_record(cls, peer_id: str, record: Any) -> PeerProgress:
        """Parse a record read from the DHT; raises ValueError on anything malformed."""
        if not isinstance(record, dict):
            raise ValueError("a progress record is a map")
        try:
            epoch, samples = record["epoch"], record["samples"]
            sps, time, mode = record["sps"], record["time"], record["mode"]
        except KeyError as e:
            raise ValueError(f"progress record misses {e}") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, samples)):
            raise ValueError("epoch and samples must be integers")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (sps, time)):
            raise ValueError("sps and time must be numbers")
        if not isinstance(mode, str):
            raise ValueError("mode must be text")
        interval = record.get("interval", 0.0)
        if not isinstance(interval, int | float) or isinstance(interval, bool):
            raise ValueError("interval must be a number")
        waiting = record.get("waiting", False)
        if not isinstance(waiting, bool):
            raise ValueError("waiting must be true or false")
        averages = record.get("averages", True)
        if not isinstance(averages, bool):
            raise ValueError("averages must be true or false")
        state = record.get("state")
        if state is not None:
            if not (isinstance(state, list) and len(state) == 3 and isinstance(state[2], list)):
                raise ValueError("state must be [epoch, digest, [lineage digests]]")
            state = (state[0], state[1], tuple(state[2]))
        target = record.get("target")
        if target is not None and (not isinstance(target, int) or isinstance(target, bool)):
            raise ValueError("target must be an integer")
        alone = record.get("alone", False)
        if not isinstance(alone, bool):
            raise ValueError("alone must be true or false")
        outcome = record.get("outcome")
        if outcome is not None:
            if not (
                isinstance(outcome, list)
                and len(outcome) == 3
                and isinstance(outcome[1], list)
                and isinstance(outcome[2], list)
            ):
                raise ValueError("outcome must be [epoch, [senders], [weightless senders]]")
            outcome = (outcome[0], tuple(outcome[1]), tuple(outcome[2]))
        poll = record.get("poll")
        if poll is not None and (not isinstance(poll, int | float) or isinstance(poll, bool)):
            raise ValueError("poll must be a number")
        return cls(
            peer_id,
            epoch,
            samples,
            float(sps),
            float(time),
            mode,
            float(interval),
            waiting,
            state,
            averages,
            target,
            alone,
            outcome,
            None if poll is None else float(poll),
        )


MIN_POLL, MAX_POLL = 1e-3, 60.0  # seconds between checks inside a micro-step a record names
MAX_TARGET = 1 << 53  # samples per step a record may name (exact in a float)
MAX_OUTCOME = 64  # senders a round's outcome names (a group's; larger groups are cut)
MAX_PEER_CHARS = 64  # characters of a peer ID as text
MAX_LINEAGE = 4  # ancestors a state names (dedloc_jax.state.lineage.LINEAGE)
MAX_DIGEST = 64


def check_state(state: Any) -> None:
    """Raise ValueError unless ``state`` is a valid (epoch, digest, lineage)."""
    epoch, digest, lineage = state
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ValueError("the state's epoch must be a non-negative integer")
    if not isinstance(lineage, tuple) or len(lineage) > MAX_LINEAGE:
        raise ValueError(f"a state names at most {MAX_LINEAGE} ancestors")
    for d in (digest, *lineage):
        if not isinstance(d, bytes) or not 0 < len(d) <= MAX_DIGEST:
            raise ValueError(f"a state digest is 1 to {MAX_DIGEST} bytes")


def check_outcome(outcome: Any) -> None:
    """Raise ValueError unless ``outcome`` is a valid (epoch, senders, weightless senders):
    at most :data:`MAX_OUTCOME` peer IDs each, the weightless among the senders."""
    epoch, senders, void = outcome
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ValueError("the outcome's epoch must be a non-negative integer")
    for names in (senders, void):
        if not isinstance(names, tuple) or len(names) > MAX_OUTCOME:
            raise ValueError(f"an outcome names at most {MAX_OUTCOME} senders")
        if not all(isinstance(n, str) and 0 < len(n) <= MAX_PEER_CHARS for n in names):
            raise ValueError("an outcome names peers by their IDs")
    if not set(void) <= set(senders):
        raise ValueError("an outcome's weightless senders are among its senders")


def _outcome_record(outcome: tuple[int, tuple[str, ...], tuple[str, ...]]) -> list[Any]:
    epoch, senders, void = outcome
    return [epoch, list(senders), list(void)]


def _state_record(state: tuple[int, bytes, tuple[bytes, ...]]) -> list[Any]:
    epoch, digest, lineage = state
    return [epoch, digest, list(lineage)]


@dataclass(frozen=True, slots=True)
class CollaborationEstimate:
    """What a peer believes about the collaboration at time ``now``."""

    epoch: int  # the global epoch: highest epoch among trainers (mode "node")
    samples: float  # samples accumulated toward ``epoch``, extrapolated to now
    samples_per_second: float  # summed throughput of the peers at ``epoch``
    eta: float  # seconds until ``samples`` reaches the target (0 when reached)
    num_peers: int  # peers that reported (any epoch)
    num_clients: int
    target: int
    max_step_interval: float = 0.0  # slowest micro-step among peers at ``epoch``
    # Every other peer that contributes to ``epoch`` stopped and waits for the round.
    others_waiting: bool = False
    # What ``samples`` and ``samples_per_second`` hold of the peers other than ``me``.
    others_samples: float = 0.0
    others_samples_per_second: float = 0.0

    @property
    def ready(self) -> bool:
        """Time to average: the target is reached, or everyone else already waits for us.
        The others stop on their own estimate, which extrapolates rates and may overshoot
        (e.g. a peer paused to load state while others counted its samples): then the
        samples still missing can only come from the peers that still compute, so a lone
        straggler averages at once instead of filling the gap while every group waits."""
        return self.samples >= self.target or self.others_waiting


@dataclass(frozen=True)
class _Claims:
    """How much of a peer's progress record :func:`estimate_collaboration` counts (its
    arguments of the same names); ours counts as stated."""

    now: float
    max_extrapolation: float
    rate_cap: float
    me: str | None
    proven: Callable[[str], bool] | None
    began: Mapping[str, float] | None
    void: Callable[[str], bool] | None

    def unproven(self, r: PeerProgress) -> bool:
        return self.proven is not None and r.peer_id != self.me and not self.proven(r.peer_id)

    def voided(self, r: PeerProgress) -> bool:
        return self.void is not None and r.peer_id != self.me and self.void(r.peer_id)

    def rate(self, r: PeerProgress) -> float:
        if r.peer_id == self.me:
            return r.samples_per_second
        if self.voided(r):
            return 0.0
        cap = self.rate_cap / CLAIM_CAP if self.unproven(r) else self.rate_cap
        return min(r.samples_per_second, cap)

    def held(self, r: PeerProgress) -> float:
        if self.voided(r):
            return 0.0
        if r.waiting:  # a waiting peer's rate is its pace when it trains, not now
            return self.plausible(r, r.samples)
        elapsed = min(max(0.0, self.now - r.time), self.max_extrapolation)
        return self.plausible(r, r.samples + elapsed * self.rate(r))

    def plausible(self, r: PeerProgress, samples: float) -> float:
        # A mate's samples are bounded by its counted rate and the time since the epoch began
        # (which we saw: it stepped with us): a peer that averaged with the run claimed its
        # whole cap (an equal share of the target) at each epoch's first moment.
        began = self.began
        start = began.get(r.peer_id) if began is not None and r.peer_id != self.me else None
        # (a mate that states no rate trains at the median peer's)
        cap = self.rate_cap
        per = self.rate(r) or (cap / CLAIM_CAP if math.isfinite(cap) else 0.0)
        if start is None or not per > 0:
            return samples
        return min(samples, PLAUSIBLE * per * max(0.0, self.now - start))


def estimate_collaboration(
    records: Iterable[PeerProgress],
    *,
    now: float,
    target_batch_size: int,
    max_extrapolation: float = 60.0,
    me: str | None = None,
    proven: Callable[[str], bool] | None = None,
    began: Mapping[str, float] | None = None,
    void: Callable[[str], bool] | None = None,
) -> CollaborationEstimate:
    """Sum the progress of the peers at the global epoch, extrapolated to ``now``.

    A report older than ``max_extrapolation`` seconds is extrapolated by that much at most, so
    one stale record cannot claim a whole batch on its own. ``me``: the peer asking, left
    out when telling whether all the others wait (:attr:`CollaborationEstimate.ready`).
    ``proven``: whether a peer has averaged with the run (None: every peer has); the claims
    of one that has not, and of one that entered the epoch alone while others entered it with
    a group, count at most as the median peer's (:data:`CLAIM_CAP` times it for the others;
    ours counts whole, but as a newcomer's when we are one: the others count it so); the
    median is of the peers that entered the epoch with a group, when any did. ``began``: when
    some peers began the epoch, as we saw it (our mates, who stepped into it with us); their
    samples count for at most :data:`PLAUSIBLE` times what their counted rate makes in the
    time since. ``void``: whether a peer's samples and rate count for nothing (its
    contribution to a round weighed nothing: :func:`dedloc_jax.rounds.claims.weightless`);
    ours always count, so an epoch closes on our own samples if every other peer is void.
    """
    records = list(records)
    # Only trainers move the epoch: clients may lag or lie about it, aux peers follow.
    trainers = [r for r in records if r.mode == "node"]
    epoch = max((r.epoch for r in (trainers or records)), default=0)
    at_epoch = [r for r in records if r.epoch == epoch]
    rate_cap = claim_cap(r.samples_per_second for r in at_epoch if r.mode != "aux")

    claims = _Claims(now, max_extrapolation, rate_cap, me, proven, began, void)
    unproven, voided, rate, held = claims.unproven, claims.voided, claims.rate, claims.held

    # The samples bound counts peers that have none yet and never falls below an equal share of
    # the target, so it only grows with time: an estimate must not shrink while peers train.
    counted = [(held(r), r.alone) for r in at_epoch if r.mode != "aux" and not voided(r)]
    share = target_batch_size / max(1, len(counted))
    # The typical peer is one that trained since the epoch began: the median of those that
    # entered it with a group (records not ``alone``), when any did. Newcomers (alone) hold
    # only what they computed since they joined: counted in, they pulled the median down and
    # capped honest peers that trained the whole epoch, so views of the target disagreed.
    grouped = [h for h, alone in counted if not alone]
    typical = grouped or [h for h, _ in counted]
    median = statistics.median_low(typical) if typical else math.inf
    samples_cap = max(CLAIM_CAP * median, share)
    samples = 0.0
    sps = 0.0
    interval = 0.0
    waiting = computing = 0
    own = own_rate = 0.0
    for r in at_epoch:
        if r.peer_id != me:
            waiting += r.waiting
            # (a void peer's samples would not count: nobody waits for them)
            computing += (
                not r.waiting and not voided(r) and (r.samples > 0 or r.samples_per_second > 0)
            )
        # Our own count is exact; every other one is a claim, bounded by the median peer's.
        # A peer that never averaged with the run (a fresh identity: it costs nothing) counts
        # as one typical peer at most: a record of 2**53 samples counted as four and closed
        # epochs at half the honest samples (bench.byzantine's claim_samples). So does a
        # record that entered the epoch alone while others entered it with a group (a
        # newcomer, unproven to the run's members) in every view, ours included: a newcomer
        # that counted itself and other newcomers whole saw the target before the rest.
        newcomer = grouped and r.alone
        cap = min(median, samples_cap) if unproven(r) or newcomer else samples_cap
        counts = min(held(r), cap) if r.peer_id != me or newcomer else held(r)
        if r.peer_id == me:
            own, own_rate = counts, rate(r)
        samples += counts
        if not r.waiting:
            sps += rate(r)
        interval = max(interval, r.step_interval)
    others_waiting = waiting > 0 and computing == 0
    remaining = max(0.0, target_batch_size - samples)
    if remaining == 0 or others_waiting:
        eta = 0.0
    elif sps > 0:
        eta = remaining / sps
    else:
        eta = math.inf
    return CollaborationEstimate(
        epoch=epoch,
        samples=samples,
        samples_per_second=sps,
        eta=eta,
        num_peers=len(records),
        num_clients=sum(1 for r in records if r.mode == "client"),
        target=target_batch_size,
        max_step_interval=interval,
        others_waiting=others_waiting,
        others_samples=samples - own,
        others_samples_per_second=sps - own_rate,
    )


CLAIM_CAP = 4.0
"""No other peer's rate or samples count for more than this many times the median peer's: one
record claiming 2**53 samples closed every epoch at once; now it counts as four typical peers
(honest throughputs 10x apart, 3.3x the median at most, are counted whole)."""


PLAUSIBLE = 2.0
"""A mate's samples count for at most this many times its counted rate times the time since
its epoch began: a smoothed rate lags a peer that speeds up, and never by 2x."""


def claim_cap(values: Iterable[float]) -> float:
    """``CLAIM_CAP`` times the lower median of the positive ``values`` (inf when none is
    positive: nothing to bound by). The lower median, so that with two peers one claim cannot
    raise its own bound."""
    positive = [v for v in values if v > 0]
    if not positive:
        return math.inf
    return CLAIM_CAP * statistics.median_low(positive)


def backed_epoch(epochs: Sequence[int]) -> int | None:
    """The newest epoch that more than half of ``epochs`` reached (None: none given). A claim
    beyond it stands for a minority: one record alone cannot move a run of several peers."""
    ordered = sorted(epochs, reverse=True)
    return ordered[len(ordered) // 2] if ordered else None


IDLE_FRACTION = 0.1  # of the ETA, between reads far from the target


def refresh_delay(
    estimate: CollaborationEstimate,
    *,
    min_delay: float,
    max_delay: float,
    crowd: int = 0,
    idle_delay: float | None = None,
    idle_eta: float | None = None,
    idle_after: float = 600.0,
) -> float:
    """How long to wait before re-reading the DHT: often near the target, rarely far from it.

    Every peer reads the same key from the same few replicas, and each read carries every
    peer's record, so the replicas' work grows as the square of the number of peers. With
    ``crowd`` > 0 and more peers than that, the shortest delay grows in proportion (up to
    ``max_delay``): the replicas then see about ``crowd / min_delay`` reads per second whatever
    the collaboration's size, and extrapolating the others' rates covers the longer gaps.

    With ``idle_delay``, a target ``idle_after`` seconds away or more is read every
    ``IDLE_FRACTION`` of the ETA (``idle_eta`` when given: a lower bound that the moments
    after a step do not inflate), up to ``idle_delay``: otherwise a step hours away (diloco)
    is read every ``max_delay``, and the reads are most of the run's traffic. Nearer
    the target (every DeDLOC epoch) nothing changes.
    """
    if not min_delay <= max_delay:
        raise ValueError("min_delay must not exceed max_delay")
    if crowd < 0:
        raise ValueError("crowd must be non-negative")
    if crowd and estimate.num_peers > crowd:
        min_delay = min(max_delay, min_delay * estimate.num_peers / crowd)
    delay = min(max(estimate.eta / 2, min_delay), max_delay)
    far = estimate.eta if idle_eta is None else min(idle_eta, estimate.eta)
    if idle_delay is not None and idle_after <= far < math.inf:
        delay = max(delay, min(far * IDLE_FRACTION, idle_delay))
    return delay


class ThroughputMeter:
    """Smoothed samples per second of this peer, from its micro-step events.

    Samples over time, both sums decayed with the same half-life: each span weighs as long as
    it lasted, so one slow span (a stall under load, the first steps) counts for its duration
    only. (An average of rates seeded with the first one kept a 15 samples/s stall for 10 s of
    training: a mate at 250 samples/s was extrapolated at 15, and epochs overshot by 75%.)
    Time not training that was not paused counts as slow time: the rate decays.
    """

    def __init__(self, half_life: float = 30.0, min_span: float = 0.2) -> None:
        if half_life <= 0 or min_span < 0:
            raise ValueError("half_life must be positive and min_span non-negative")
        self._half_life = half_life
        self._min_span = min_span
        self._last_time: float | None = None
        self._samples = 0.0  # decayed sum of samples ...
        self._seconds = 0.0  # ... and of the time they took
        self._observed = 0.0
        self._pooled_at = -math.inf  # time of the last pooled update

    @property
    def samples_per_second(self) -> float:
        return self._samples / self._seconds if self._seconds > 0 else 0.0

    def pause(self) -> None:
        """Forget the time since the last update (e.g. an averaging round is not training);
        the samples pooled since the last span count over the time they took. (Epochs shorter
        than ``min_span`` were dropped whole: a rate measured once at start never changed.)"""
        if self._last_time is not None and self._pooled_at > self._last_time:
            self._add(self._observed, self._pooled_at - self._last_time)
        self._last_time = None
        self._observed = 0.0

    def update(self, samples: int, now: float) -> float:
        """Record ``samples`` processed since the previous call, at time ``now``."""
        if self._last_time is None:
            self._last_time = now
            return self.samples_per_second
        dt = now - self._last_time
        if dt <= 0 or dt < self._min_span:
            # Too short to measure (the first steps after a pause are bursty): pool them.
            self._observed += samples
            self._pooled_at = max(self._pooled_at, now)
            return self.samples_per_second
        self._add(samples + self._observed, dt)
        self._observed = 0.0
        self._last_time = now
        return self.samples_per_second

    def _add(self, samples: float, seconds: float) -> None:
        decay = 0.5 ** (seconds / self._half_life)
        self._samples = self._samples * decay + samples
        self._seconds = self._seconds * decay + seconds
