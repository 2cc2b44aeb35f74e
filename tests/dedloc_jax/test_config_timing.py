from __future__ import annotations

import pytest

from dedloc_jax.config import CollaborationConfig
from dedloc_jax.timing import averaging_timeout, matchmaking_window


def test_presets_and_validation() -> None:
    assert CollaborationConfig.sahajbert().target_batch_size == 4096
    demo = CollaborationConfig.local_demo(32)
    assert demo.target_batch_size == 32 and demo.codec == "none"
    assert demo.replace(max_group_size=4).max_group_size == 4
    for bad in (
        {"target_batch_size": 0},
        {"max_group_size": 0},
        {"codec": "zip"},
        {"min_refresh": 2.0, "max_refresh": 1.0},
        {"averaging_timeout": -1.0},
    ):
        with pytest.raises(ValueError):
            CollaborationConfig(**bad)


def test_deadlines_follow_predictions() -> None:
    assert matchmaking_window(0.5, 0.01) > matchmaking_window(0.1, 0.01)
    assert matchmaking_window(0.0, 0.0) == 0.2
    slow = averaging_timeout(lp_bound_seconds=30.0, rtt=0.05)
    fast = averaging_timeout(lp_bound_seconds=0.1, rtt=0.001)
    assert slow > 30.0 and fast == 5.0
    with pytest.raises(ValueError):
        averaging_timeout(-1.0, 0.0)
