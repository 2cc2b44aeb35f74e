"""The averaging history's entry type."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dedloc_jax.history import RoundOutcome


def test_an_outcome_is_frozen_and_serialises_to_the_keys_of_the_history_json() -> None:
    h = RoundOutcome(3, 2, False, 1.5, 96.0, "no group formed in time", "node")
    assert list(h.to_dict()) == [
        "epoch",
        "group_size",
        "complete",
        "seconds",
        "collab_samples",
        "reason",
        "mode",
    ]
    assert RoundOutcome(**json.loads(json.dumps(h.to_dict()))) == h
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.epoch = 4  # type: ignore[misc]
