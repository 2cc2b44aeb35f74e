"""Refresh delays in a large collaboration: the replicas' read load stays bounded."""

from __future__ import annotations

import pytest

from dedloc_jax.progress import PeerProgress, estimate_collaboration, refresh_delay


def _estimate(peers: int, samples_each: int, rate: float = 100.0):
    records = [PeerProgress(f"p{i}", 0, samples_each, rate, 0.0) for i in range(peers)]
    return estimate_collaboration(records, now=0.0, target_batch_size=1000)


def test_the_shortest_delay_grows_with_the_number_of_peers() -> None:
    near_small, near_big = (
        _estimate(10, 99),
        _estimate(200, 4),
    )  # both due in a fraction of a second
    assert refresh_delay(near_small, min_delay=0.1, max_delay=5.0, crowd=20) == 0.1
    delay = refresh_delay(near_big, min_delay=0.1, max_delay=5.0, crowd=20)
    assert delay == pytest.approx(0.1 * 200 / 20)
    # ... never beyond max_delay, and without a crowd size it is the plain rule
    assert refresh_delay(near_big, min_delay=0.1, max_delay=0.5, crowd=20) == 0.5
    assert refresh_delay(near_big, min_delay=0.1, max_delay=5.0) == 0.1
    # far from the target the delay is max_delay either way
    far = _estimate(200, 0, rate=0.01)
    assert refresh_delay(far, min_delay=0.1, max_delay=5.0, crowd=20) == 5.0
    with pytest.raises(ValueError):
        refresh_delay(far, min_delay=0.1, max_delay=5.0, crowd=-1)
