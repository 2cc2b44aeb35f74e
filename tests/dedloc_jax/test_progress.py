from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dedloc_jax.progress import (
    PeerProgress,
    ThroughputMeter,
    estimate_collaboration,
    refresh_delay,
)


def _p(pid: str, epoch: int, samples: int, sps: float, time: float, mode: str = "node"):
    return PeerProgress(pid, epoch, samples, sps, time, mode)


def test_global_epoch_ignores_clients_and_sums_peers_at_that_epoch() -> None:
    records = [
        _p("a", 5, 100, 10.0, 0.0),
        _p("b", 5, 50, 5.0, 0.0),
        _p("c", 4, 900, 50.0, 0.0),  # behind: does not count toward epoch 5
        _p("d", 9, 10, 1.0, 0.0, mode="client"),  # a client cannot raise the epoch
    ]
    est = estimate_collaboration(records, now=2.0, target_batch_size=400)
    assert est.epoch == 5
    assert est.samples == pytest.approx(100 + 20 + 50 + 10)
    assert est.samples_per_second == pytest.approx(15.0)
    assert est.eta == pytest.approx((400 - 180) / 15.0)
    assert est.num_peers == 4 and est.num_clients == 1
    assert not est.ready


def test_ready_when_target_reached_and_extrapolation_is_capped() -> None:
    records = [_p("a", 1, 10, 100.0, 0.0)]
    est = estimate_collaboration(records, now=1e6, target_batch_size=10_000, max_extrapolation=5)
    assert est.samples == pytest.approx(510)
    est = estimate_collaboration(records, now=2.0, target_batch_size=100)
    assert est.ready and est.eta == 0.0


def test_ready_once_every_other_contributor_waits_for_us() -> None:
    """The others stopped on an estimate that overshot (600 of 1000 samples): the straggler
    averages now instead of filling the gap alone, but not while another peer still computes
    or when the waiting one is at an older epoch."""

    def waiting(pid: str, epoch: int = 2) -> PeerProgress:
        return PeerProgress(pid, epoch, 300, 0.0, 0.0, waiting=True)

    me = _p("me", 2, 40, 10.0, 0.0)
    est = estimate_collaboration(
        [waiting("a"), waiting("b"), me], now=0.0, target_batch_size=1000, me="me"
    )
    assert est.samples < est.target and est.others_waiting and est.ready and est.eta == 0.0
    computing = _p("c", 2, 100, 10.0, 0.0)
    est = estimate_collaboration(
        [waiting("a"), waiting("b"), computing, me], now=0.0, target_batch_size=1000, me="me"
    )
    assert not est.others_waiting and not est.ready
    # A peer that has not started the epoch yet (no samples, no rate) does not hold us back.
    idle = _p("d", 2, 0, 0.0, 0.0)
    est = estimate_collaboration([waiting("a"), idle, me], now=0.0, target_batch_size=1000, me="me")
    assert est.ready
    # Waiting at an older epoch is not waiting for this one; nor is our own record.
    est = estimate_collaboration(
        [waiting("a", epoch=1), me], now=0.0, target_batch_size=1000, me="me"
    )
    assert not est.ready
    mine = PeerProgress("me", 2, 40, 0.0, 0.0, waiting=True)
    assert not estimate_collaboration([mine], now=0.0, target_batch_size=1000, me="me").ready


def test_no_throughput_means_infinite_eta() -> None:
    est = estimate_collaboration([_p("a", 0, 0, 0.0, 0.0)], now=0.0, target_batch_size=8)
    assert math.isinf(est.eta)
    assert estimate_collaboration([], now=0.0, target_batch_size=8).epoch == 0


@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),
            st.integers(0, 1000),
            st.floats(0, 100),
            st.sampled_from(["node", "client", "aux"]),
        ),
        max_size=20,
    ),
    st.floats(0, 100),
)
def test_estimate_is_monotone_in_time(rows, now) -> None:
    records = [_p(str(i), e, s, r, 0.0, m) for i, (e, s, r, m) in enumerate(rows)]
    a = estimate_collaboration(records, now=now, target_batch_size=5000)
    b = estimate_collaboration(records, now=now + 1.0, target_batch_size=5000)
    assert b.epoch == a.epoch
    assert b.samples >= a.samples
    assert b.eta <= a.eta


def test_record_round_trip_and_rejection_of_malformed_records() -> None:
    p = _p("a", 3, 7, 1.5, 12.0, "aux")
    assert PeerProgress.from_record("a", p.to_record()) == p
    waiting = PeerProgress("a", 3, 7, 0.0, 12.0, waiting=True)
    assert PeerProgress.from_record("a", waiting.to_record()).waiting
    older = {k: v for k, v in p.to_record().items() if k != "waiting"}
    assert not PeerProgress.from_record("a", older).waiting  # records of older peers parse
    serving = PeerProgress("a", 3, 7, 0.0, 12.0, state=(3, b"d" * 32, (b"c" * 32, b"b" * 32)))
    assert PeerProgress.from_record("a", serving.to_record()) == serving
    assert "state" not in p.to_record()  # nothing served yet: the record stays as it was
    follower = PeerProgress("a", 3, 0, 0.0, 12.0, "aux", averages=False)
    assert not PeerProgress.from_record("a", follower.to_record()).averages
    assert "averages" not in p.to_record() and PeerProgress.from_record("a", older).averages
    alone = PeerProgress("a", 3, 0, 0.0, 12.0, alone=True)
    assert PeerProgress.from_record("a", alone.to_record()).alone
    assert "alone" not in p.to_record() and not PeerProgress.from_record("a", older).alone
    bad = [
        None,
        [],
        {"epoch": 1},
        {**p.to_record(), "epoch": "3"},
        {**p.to_record(), "epoch": -1},
        {**p.to_record(), "sps": float("nan")},
        {**p.to_record(), "mode": "boss"},
        {**p.to_record(), "samples": True},
        {**p.to_record(), "waiting": 1},
        {**p.to_record(), "averages": 0},
        {**p.to_record(), "alone": "yes"},
        {**p.to_record(), "state": [3, b"d"]},
        {**p.to_record(), "state": [3, "d", []]},
        {**p.to_record(), "state": [-1, b"d", []]},
        {**p.to_record(), "state": [3, b"d", [b"a"] * 5]},  # more ancestors than named
        {**p.to_record(), "state": [3, b"d" * 65, []]},
        {**p.to_record(), "state": [3, b"d", [b""]]},
        {**p.to_record(), "state": [3, b"d", [7]]},
        {**p.to_record(), "state": {"epoch": 3}},
    ]
    for record in bad:
        with pytest.raises(ValueError):
            PeerProgress.from_record("a", record)


def test_refresh_delay_shrinks_near_the_target() -> None:
    far = estimate_collaboration([_p("a", 0, 0, 1.0, 0.0)], now=0.0, target_batch_size=1000)
    near = estimate_collaboration([_p("a", 0, 990, 1.0, 0.0)], now=0.0, target_batch_size=1000)
    assert refresh_delay(far, min_delay=0.5, max_delay=30) == 30
    assert refresh_delay(near, min_delay=0.5, max_delay=30) == 5
    with pytest.raises(ValueError):
        refresh_delay(far, min_delay=2, max_delay=1)


def test_throughput_meter_tracks_rate_and_decays_when_idle() -> None:
    meter = ThroughputMeter(half_life=10.0)
    meter.update(0, 0.0)
    for t in range(1, 50):
        meter.update(8, float(t))
    assert meter.samples_per_second == pytest.approx(8.0)
    meter.update(0, 80.0)  # a long pause
    assert meter.samples_per_second < 8.0


def test_the_rate_follows_epochs_shorter_than_a_measurable_span() -> None:
    """Epochs of 16 micro-steps of 5 ms (the README's two peers) are shorter than `min_span`
    and the meter pauses at each step: their samples still count, over the time they took.
    Before, the rate of the first (slow, loaded) span stayed: a mate at ~800 samples/s was
    extrapolated at 15 and each epoch overshot its target by up to 75%."""
    meter = ThroughputMeter(half_life=10.0)
    meter.update(0, 0.0)
    meter.update(15, 1.0)  # a slow start: 15 samples/s
    t = 1.0
    for _ in range(20):
        meter.pause()  # averaging
        t += 0.5
        meter.update(0, t)
        for _ in range(16):
            t += 0.005
            meter.update(4, t)
    assert meter.samples_per_second > 400  # (20 x 64 + 15) / (20 x 0.08 + 1) = 498


def test_a_waiting_record_keeps_its_rate_but_is_not_extrapolated() -> None:
    """A peer that averages publishes `waiting` with the rate it trains at: nobody counts
    samples it is not feeding, and its mates know its pace once it trains again."""
    waiting = PeerProgress("a", 3, 40, 500.0, 0.0, waiting=True)
    training = PeerProgress("b", 3, 10, 100.0, 0.0)
    est = estimate_collaboration([waiting, training], now=0.1, target_batch_size=100)
    assert est.samples == pytest.approx(40 + 10 + 0.1 * 100.0)
    assert est.samples_per_second == 100.0


def test_a_mates_samples_are_bounded_by_its_rate_and_the_time_since_the_epoch_began() -> None:
    """A peer that averaged with us (proven: its claims counted up to CLAIM_CAP medians, or an
    equal share of the target) claimed that cap at each epoch's first moment, with an honest
    rate; it now counts for at most PLAUSIBLE x its rate x the time since the epoch began,
    which we saw (it stepped into it with us). Honest mates count whole."""
    began = {"a": 100.0, "b": 100.0, "liar": 100.0}
    target = 400

    def records(t: float, liar_samples: int):
        honest = [_p(p, 5, int(10.0 * (t - 100.0)), 10.0, t) for p in ("me", "a", "b")]
        return [*honest, _p("liar", 5, liar_samples, 10.0, t)]

    at_start = estimate_collaboration(
        records(100.5, 300), now=100.5, target_batch_size=target, me="me", began=began
    )
    unbounded = estimate_collaboration(
        records(100.5, 300), now=100.5, target_batch_size=target, me="me"
    )
    assert unbounded.samples == pytest.approx(3 * 5 + target / 4)  # a share for free
    assert at_start.samples == pytest.approx(3 * 5 + 2 * 10.0 * 0.5)
    later = estimate_collaboration(
        records(110.0, 300), now=110.0, target_batch_size=target, me="me", began=began
    )
    assert later.samples == pytest.approx(3 * 100 + 2 * 10.0 * 10.0)  # not 4 x 100
    honest = estimate_collaboration(
        records(110.0, 100), now=110.0, target_batch_size=target, me="me", began=began
    )
    assert honest.samples == pytest.approx(400)  # an honest mate counts whole
    waiting = estimate_collaboration(
        [*records(110.0, 0)[:3], PeerProgress("liar", 5, 300, 10.0, 110.0, "node", waiting=True)],
        now=110.0,
        target_batch_size=target,
        me="me",
        began=began,
    )
    assert waiting.samples == pytest.approx(3 * 100 + 200)  # waiting is no way around it


def test_void_peers_count_nothing_and_our_own_samples_still_close_the_target() -> None:
    """Peers whose contribution weighed nothing (rounds.claims.weightless) add neither samples
    nor rate, nor keep us from the straggler's shortcut; if every other peer is void, the
    epoch closes on our own samples alone (no stall)."""
    records = [_p("me", 3, 40, 10.0, 0.0), _p("b", 3, 40, 10.0, 0.0), _p("c", 3, 40, 10.0, 0.0)]
    whole = estimate_collaboration(records, now=0.0, target_batch_size=100, me="me")
    assert whole.samples == pytest.approx(120) and whole.ready
    some = estimate_collaboration(
        records, now=0.0, target_batch_size=100, me="me", void={"c"}.__contains__
    )
    assert some.samples == pytest.approx(80) and some.samples_per_second == pytest.approx(20)
    assert not some.ready
    alone = estimate_collaboration(
        records, now=3.0, target_batch_size=100, me="me", void={"b", "c"}.__contains__
    )
    assert alone.samples == pytest.approx(70) and alone.others_samples == 0.0
    assert alone.eta == pytest.approx(3.0)  # our own rate closes it
    later = estimate_collaboration(
        records, now=6.0, target_batch_size=100, me="me", void=lambda pid: True
    )
    assert later.ready  # (void never applies to ourselves)


def test_newcomers_few_samples_do_not_cap_a_peer_that_trained_the_whole_epoch() -> None:
    """A long epoch with churn (bench.collaboration's 12-peer DiLoCo stand-in, seed 1, at
    35,089 s): six peers stepped into the epoch together, one of them fast (180k samples);
    seven newcomers joined late and hold little. Every peer's samples were capped at
    CLAIM_CAP x the median of all thirteen (30k, a newcomer's): the fast peer counted 120k in
    every view but its own, saw the target alone, stepped alone, and the others (its samples
    gone from their table) never reached it. The typical peer is now one that entered the
    epoch with a group: every view counts the same samples and agrees on the target."""
    olds = {"fast": 180_000, "o1": 95_000, "o2": 65_000, "o3": 59_000, "o4": 58_000}
    olds["o5"] = 57_000
    news = {"n1": 30_000, "n2": 29_000, "n3": 15_000, "n4": 11_000, "n5": 10_000}
    news |= {"n6": 4_000, "n7": 700}
    rates = {"fast": 10.0} | dict.fromkeys([*olds, *news][1:], 3.0)
    records = [
        PeerProgress(p, 1, s, rates[p], 100.0, alone=p in news) for p, s in (olds | news).items()
    ]
    target = 600_000  # the records hold 613,700
    views = {}
    for me in [*olds, *news]:
        # an old peer averaged with the old ones; a newcomer with nobody (all count whole)
        proven = olds.__contains__ if me in olds else None
        est = estimate_collaboration(
            records, now=100.0, target_batch_size=target, me=me, proven=proven
        )
        views[me] = est.samples
    print(f"views of the samples: {sorted(set(views.values()))}")
    assert all(v == pytest.approx(613_700) for v in views.values())  # each counts it whole
    # A newcomer's claim still counts as one typical peer at most in an old peer's view.
    liar = PeerProgress("liar", 1, 2**53, 3.0, 100.0, alone=True)
    est = estimate_collaboration(
        [*records, liar], now=100.0, target_batch_size=10**9, me="o1", proven=olds.__contains__
    )
    assert est.samples == pytest.approx(613_700 + 59_000)


def test_a_newcomer_counts_itself_and_other_newcomers_as_the_runs_members_count_them() -> None:
    """A fast newcomer that joined early in a long epoch holds twice a typical peer's
    samples. The run's members count it as one typical peer (it never averaged with them);
    it counted itself whole, and so did every other newcomer (having averaged with nobody,
    they count everyone whole): newcomers saw the target first and waited or stepped without
    the rest. A record that entered the epoch alone while others entered it with a group now
    counts as one typical peer in every view, its own included."""
    olds = dict.fromkeys(["o1", "o2", "o3", "o4", "o5"], 50_000)
    news = {"fast": 100_000, "n1": 20_000, "n2": 10_000}
    records = [PeerProgress(p, 1, s, 3.0, 100.0, alone=p in news) for p, s in (olds | news).items()]
    views = {}
    for me in [*olds, *news]:
        proven = olds.__contains__ if me in olds else None
        est = estimate_collaboration(
            records, now=100.0, target_batch_size=10**6, me=me, proven=proven
        )
        views[me] = est.samples
    print(f"views of the samples: {sorted(set(views.values()))}")
    assert all(v == pytest.approx(5 * 50_000 + 50_000 + 30_000) for v in views.values())
    # With no group at the epoch (a run's first), every record counts whole.
    first = [PeerProgress(r.peer_id, 0, r.samples, 3.0, 100.0, alone=True) for r in records]
    est = estimate_collaboration(first, now=100.0, target_batch_size=10**6, me="fast")
    assert est.samples == pytest.approx(5 * 50_000 + 130_000)
