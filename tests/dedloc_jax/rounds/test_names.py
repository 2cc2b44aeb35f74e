"""The round package's classes before issue #47 renamed them still import, with a warning."""

import importlib

import pytest

import dedloc_jax.rounds as rounds

# The deprecated names and what they now are.
DEPRECATED = {"Rounds": "Averager", "RoundContext": "PeerSide"}


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_an_old_name_imports_the_renamed_class_and_warns(old: str) -> None:
    with pytest.warns(DeprecationWarning, match=DEPRECATED[old]):
        cls = getattr(importlib.import_module("dedloc_jax.rounds"), old)
    assert cls is getattr(rounds, DEPRECATED[old])


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        rounds.NoSuchThing  # noqa: B018
