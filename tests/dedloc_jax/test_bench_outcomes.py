"""bench.collaboration counts round outcomes: a run whose rounds fail reports it."""

from __future__ import annotations

import argparse

from bench.collaboration import simulate
from dedloc_jax.config import CollaborationConfig, ProgressConfig, RoundConfig


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        peers=6,
        params=20_000,
        epochs=3,
        target=128,
        micro=4,
        churn_per_hour=0.0,
        seed=0,
        payload_scale=1,
    )


def test_a_healthy_run_counts_every_round_complete() -> None:
    out = simulate(_args(), overlap=False)
    assert out["complete_fraction"] == 1.0 and out["averaged_fraction"] == 1.0
    assert out["compute_fraction"] > 0.5
    # Rounds take at least the LP's bound: no blocking run computes more than the ceiling.
    assert out["compute_fraction"] <= out["compute_ceiling"] < 1.0
    assert out["bandwidth_error"] is not None


def test_a_run_whose_rounds_fail_reports_no_complete_round_and_no_useful_compute() -> None:
    """Every all-reduce times out at once (the timeout forced to a microsecond): every peer
    steps alone. The old figure, all time spent computing, reads 0.97 for this run."""
    config = CollaborationConfig(
        target_batch_size=128,
        rounds=RoundConfig(codec="fp16", averaging_timeout=1e-6),
        progress=ProgressConfig(max_refresh=5.0),
    )
    out = simulate(_args(), overlap=True, config=config)
    assert out["epochs"] >= 3
    assert out["complete_fraction"] == 0.0
    assert out["averaged_fraction"] == 0.0
    assert out["compute_fraction"] == 0.0
    assert out["raw_compute_fraction"] > 0.5


def test_the_time_weighted_compute_fraction_counts_a_peer_gone_before_its_first_round_by_time() -> (
    None
):
    """With hour-long rounds (DiLoCo) a peer may leave before its first round ended: its
    computing is cut off, and only its 2 s of joining remain. The mean over peers counts it
    as a zero like any other peer; the time-weighted figure counts it for those 2 s."""
    from bench.collaboration import EpochOutcome, PeerStats, outcome_figures

    def peer(name: str, joined: float, left: float, useful: float, cut_off: float) -> PeerStats:
        p = PeerStats(name, "node", 4.0, 1e6, 5e6, joined=joined, left=left, cut_off=cut_off)
        if useful:
            p.epochs.append(EpochOutcome(0, left, 4000, useful, 2, True))
        p.compute = useful + cut_off
        return p

    stayed = [peer("a", 0.0, 1000.0, 990.0, 0.0), peer("b", 0.0, 1000.0, 990.0, 0.0)]
    gone = peer("c", 0.0, 500.0, 0.0, 498.0)
    out = outcome_figures([*stayed, gone], stayed, 4000, 1000, overlap=False)
    assert out["compute_fraction"] == round((0.99 + 0.99 + 0.0) / 3, 4)
    assert out["weighted_compute_fraction"] == round(1980 / 2002, 4)


def test_adaptive_sends_sahajberts_leaves_in_int8_but_the_small_ones() -> None:
    """The benchmark's sahajBERT-shaped leaves: 18,105,474 values at full size, of which
    adaptive sends 99.7% (the matrices of 65,536 values or more) in int8."""
    import math

    from bench.collaboration import SAHAJBERT_SHAPES, model_leaves
    from dedloc_jax.averaging.leaf_codecs import LeafCodecs, leaf_codec_names

    sizes = [math.prod(s) for s in SAHAJBERT_SHAPES]
    assert sum(sizes) == 18_105_474
    names = leaf_codec_names("adaptive", SAHAJBERT_SHAPES)
    in_int8 = sum(n for n, c in zip(sizes, names, strict=True) if c == "int8")
    assert 0.997 < in_int8 / sum(sizes) < 0.998
    plan = LeafCodecs.of_shapes("adaptive", SAHAJBERT_SHAPES)
    assert 1.0 < plan.wire_bytes((0, plan.size), 1 << 16) / plan.size < 1.02
    small = model_leaves(20_000, seed=0)  # scaled: same leaves, first dimensions shrunk
    assert [a.shape[1:] for a in small] == [s[1:] for s in SAHAJBERT_SHAPES]
    assert 0.9 < sum(a.size for a in small) / 20_000 < 1.3
