"""The butterfly over real tbf-shaped links in network namespaces (root only; slow: three
processes import JAX, then average a vector that takes seconds on a 20 Mbit/s uplink)."""

import pytest

from bench.netns_lab import unavailable_reason

pytestmark = [pytest.mark.netns, pytest.mark.slow]


@pytest.fixture(scope="module")
def lab_ok():
    reason = unavailable_reason("tc")
    if reason is not None:
        pytest.skip(reason)


def test_lp_split_beats_equal_split_on_shaped_links(lab_ok):
    from bench.allreduce_netns import run_netns

    # 4 MB per peer: the 20 Mbit/s peer needs >= 1.6 s to upload it; an equal split makes it
    # also send a third of the results to two peers (model: 4/3 of the LP's time)
    result = run_netns([20.0, 40.0, 80.0], 100.0, size=1_000_000, rounds=1)
    assert result["identical"]
    assert result["max_abs_error"] < 1e-5
    # the LP got the shaped rates: the slowest peer's own upload already sets the bound, so it
    # reduces nothing, and faster peers never own less than slower ones
    fractions = result["lp_fractions"]
    assert fractions[0] == 0.0
    assert fractions == sorted(fractions)
    # generous: protocol and TCP/IP overheads are ~8%; a broken split or pipeline is >= 30%
    assert result["lp_seconds"] < result["equal_seconds"]
    assert result["lp_vs_bound"] < 1.5


def test_meters_measure_tbf_shaped_links_within_20_percent(lab_ok):
    """Nothing typed in: peers probe as they join and rounds feed their meters; every figure
    lands within 20% of the shaped rate (tbf gives ~96% of it), and the LP on them gives the
    slowest peer no share, as it would on the true rates. (Every peer's partners together can
    fill its downlink here; with uplinks 10/25/50/100 the 100 Mbit/s peer's partners send 85
    at most, and its downlink reads 80-83.)"""
    from bench.allreduce_netns import run_measured

    result = run_measured([10.0, 50.0, 100.0, 100.0], 100.0, size=500_000, rounds=1, warmup=1)
    for key, true in (
        ("measured_up_mbps", "true_up_mbps"),
        ("measured_down_mbps", "true_down_mbps"),
    ):
        for got, want in zip(result[key], result[true], strict=True):
            assert abs(got / want - 1) <= 0.2, (key, result[key], result[true])
    assert result["lp_fractions"][0] == 0.0
