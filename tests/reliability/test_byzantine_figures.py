"""bench.byzantine --processes' clean cost: side by side, robust to one stall and to drift."""

import numpy as np
import pytest

from bench.byzantine_processes import HONEST, PERIOD, _alternating, loss_cost


def _steps(first: int, spans: int, on_cost: float, stall: int | None, partial: int | None):
    """Step events of a run whose epochs take 1 s (drifting +2% a span) off and ``on_cost`` s
    on; epoch ``stall`` takes 10 s and epoch ``partial`` is averaged by a group of 3."""
    t, rows = 0.0, [{"epoch": first, "t": 0.0, "group": HONEST + 1}]
    for e in range(first + 1, first + 1 + spans * PERIOD):
        span = (e - 1 - first) // PERIOD
        dt = (1.0 + 0.02 * span) * (on_cost if span % 2 else 1.0)
        dt = 10.0 if e == stall else dt
        t += dt
        rows.append({"epoch": e, "t": t, "group": HONEST if e == partial else HONEST + 1})
    return rows


def test_the_clean_cost_is_each_defended_span_against_its_neighbours():
    got = _alternating(_steps(10, 9, 1.03, None, None), 10)
    assert got["time_ratio"] == pytest.approx(1.03, abs=2e-3)  # the drift cancels
    assert got["time_ratio_pairs"] == 4
    assert got["epochs_incomplete"] == 0


def test_one_stalled_round_and_a_partial_group_do_not_move_it():
    """A 10 s round among 1 s ones moved the mean-based figure by ~20%; a round that a member
    missed is another round's cost and is not counted."""
    got = _alternating(_steps(10, 9, 1.03, stall=17, partial=23), 10)
    assert got["time_ratio"] == pytest.approx(1.03, abs=2e-2)
    assert got["time_ratio_of_means"] > 1.15  # the figure before
    assert got["epochs_incomplete"] == 1


def test_the_cpu_an_epoch_costs_is_summed_over_the_trainers_side_by_side():
    """Wall time swings with the machine's load; the CPU each trainer spent an epoch (its
    events' ``cpu``) far less: ``cpu_ratio`` sets it on against off, all trainers summed."""
    trainers = []
    for i in range(HONEST + 1):
        rows = _steps(10, 9, 1.5 if i == 0 else 1.0, stall=None, partial=None)  # wall: noise
        cpu = 0.0
        for r in rows:
            on = (r["epoch"] - 1 - 10) // PERIOD % 2 == 1 and r["epoch"] > 10
            cpu += (0.2 + 0.01 * i) * (1.04 if on else 1.0) if r["epoch"] > 10 else 0.0
            r["cpu"] = cpu
        trainers.append(rows)
    got = _alternating(trainers[0], 10, trainers[1:])
    assert got["cpu_ratio"] == pytest.approx(1.04, abs=1e-3)
    assert got["cpu_ratio_pairs"] == got["time_ratio_pairs"] == 4
    assert got["time_ratio"] == pytest.approx(1.5, abs=0.05)  # trainer 0's wall clock


def test_each_ratio_comes_with_an_interval_of_its_median():
    """The quartiles say how far one pair strays (0.987-1.099 in a clean run of 17 pairs):
    whether the figure itself is within 5% needs the median's own interval."""
    got = _alternating(_steps(10, 41, 1.03, None, None), 10)
    low, high = got["time_ratio_ci95"]
    assert low <= got["time_ratio"] <= high
    assert low == pytest.approx(1.03, abs=5e-3) and high == pytest.approx(1.03, abs=5e-3)


def _curve(seed: int, scale: float, last: int = 150) -> dict:
    """A run's losses: one smooth curve times ``scale``, each epoch off by 1% (sd), as one
    micro-batch's loss is."""
    rng = np.random.default_rng(seed)
    losses = {e: scale * (5.0 + 3.0 / e**0.5) * (1 + 0.01 * rng.standard_normal()) for e in
              range(1, last + 1)}  # fmt: skip
    return {"losses": losses, "last_epoch": last}


def test_the_clean_loss_cost_reads_each_run_off_its_fitted_curve():
    """Two runs of the same curve drew other batches: their last three epochs' means differ
    by up to 1.5% (loss_ratio 1.0134 in a clean run), the fitted curves by a few tenths."""
    means, fits = [], []
    for seed in range(20):
        got = loss_cost(_curve(2 * seed, 1.0), _curve(2 * seed + 1, 1.0))
        means.append(got["loss_ratio"])
        fits.append(got["loss_ratio_fit"])
        assert got["loss_ratio_fit_sd"] < 0.005
    assert max(abs(f - 1) for f in fits) < 0.006
    assert max(abs(m - 1) for m in means) > 2 * max(abs(f - 1) for f in fits)
    assert loss_cost(_curve(0, 1.02), _curve(1, 1.0))["loss_ratio_fit"] == pytest.approx(
        1.02, abs=0.006
    )
