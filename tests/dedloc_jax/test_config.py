from __future__ import annotations

import pytest

from dedloc_jax.config import CollaborationConfig


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
