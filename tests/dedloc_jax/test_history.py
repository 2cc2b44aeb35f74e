"""The record of a round (:class:`RoundOutcome`) and the old name of its view."""

from __future__ import annotations

import collections
import dataclasses
import json
import warnings

import numpy as np
import pytest

import dedloc_jax
from dedloc_jax.history import RoundOutcome
from dedloc_jax.host import AveragingOutcome, HostCalls


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


def test_a_record_a_host_builds_needs_only_the_epoch_the_group_and_the_mean() -> None:
    h = RoundOutcome(3, 2, average=[np.ones(2, np.float32)])
    assert (h.epoch, h.next_epoch, h.group_size, h.complete, h.reason, h.mode) == (
        3,
        4,
        2,
        True,
        "",
        "node",
    )


class _Host:
    """A host whose averaging answers ``outcome(epoch, gradients)``."""

    def __init__(self, outcome) -> None:
        self.outcome = outcome

    def report_progress(self, epoch: int, samples: int, batch_size: int) -> bool:
        return True

    def average_gradients(self, epoch, gradients, samples):
        return self.outcome(epoch, [np.asarray(g) * 2 for g in gradients])


def _handed_back(outcome) -> tuple:
    calls = HostCalls(_Host(outcome))
    *avg, epoch, group_size, complete, taken = calls.average(
        np.int32(5), np.int32(8), np.ones(3, np.float32)
    )
    return [a.tolist() for a in avg], int(epoch), int(group_size), int(complete), int(taken)


def test_the_transforms_get_the_epoch_after_the_step_from_a_round_record() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new way warns of nothing
        got = _handed_back(lambda epoch, g: RoundOutcome(epoch, 2, average=g))
        view = AveragingOutcome.of(RoundOutcome(5, 2, False, reason="r", average=[]))
        assert (view.next_epoch, view.group_size, view.complete, view.reason) == (6, 2, False, "r")
        assert view.record.epoch == 5
    assert got == ([[2.0, 2.0, 2.0]], 6, 2, 1, 8)


def test_the_old_averaging_outcome_still_works_and_warns() -> None:
    """``dedloc_jax.AveragingOutcome`` was a NamedTuple whose ``epoch`` is the epoch after the
    step: built, read and returned by a host as before, it gives what it gave, and warns."""
    with pytest.warns(DeprecationWarning, match="RoundOutcome"):
        old = dedloc_jax.AveragingOutcome([np.zeros(2)], 4, 3)
    with pytest.warns(DeprecationWarning, match="next_epoch"):
        assert old.epoch == 4
    with pytest.warns(DeprecationWarning, match="average"):
        assert old.gradients[0].tolist() == [0.0, 0.0]
    with pytest.warns(DeprecationWarning):
        gradients, epoch, group_size, complete = old
    assert (epoch, group_size, complete, old.record.epoch, old.next_epoch) == (4, 3, True, 3, 4)
    assert old._fields == ("gradients", "epoch", "group_size", "complete")
    with pytest.warns(DeprecationWarning):
        assert old[1] == 4
    with pytest.warns(DeprecationWarning):
        got = _handed_back(lambda epoch, g: dedloc_jax.AveragingOutcome(g, epoch + 1, 2))
    assert got == ([[2.0, 2.0, 2.0]], 6, 2, 1, 8)
    # a host's own record of the old fields (a NamedTuple like the old one)
    Old = collections.namedtuple("Old", "gradients epoch group_size")
    with pytest.warns(DeprecationWarning, match="RoundOutcome"):
        got = _handed_back(lambda epoch, g: Old(g, epoch + 1, 1))
    assert got == ([[2.0, 2.0, 2.0]], 6, 1, 0, 8)
