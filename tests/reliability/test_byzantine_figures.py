"""bench.byzantine --processes' clean cost: side by side, robust to one stall and to drift."""

import pytest

from bench.byzantine_processes import HONEST, PERIOD, _alternating


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
