"""What matchmaking peers send each other, checked without sockets: the state a peer says it
steps from, and which peers it may average with."""

from __future__ import annotations

import pytest

from dedloc_jax.averaging.errors import GroupError
from dedloc_jax.matchmaking_wire import leader_order, same_state, state_from_wire, state_to_follow

A, B = b"a" * 32, b"b" * 32


def test_a_state_digest_is_checked_on_the_wire() -> None:
    assert state_from_wire(None) is None
    assert state_from_wire(A) == A
    for bad in (b"", b"x" * 65, "a" * 32, 7, [A]):
        with pytest.raises(GroupError):
            state_from_wire(bad)


def test_only_peers_on_one_state_average_together_unless_one_did_not_say() -> None:
    assert same_state(A, A)
    assert not same_state(A, B)
    assert same_state(None, A) and same_state(B, None) and same_state(None, None)


def test_a_stateless_peer_follows_the_state_most_registered_peers_step_from() -> None:
    assert state_to_follow(A, {"p": B, "q": B}) == A  # ours, if we have one
    assert state_to_follow(None, {"p": B, "q": B, "r": A, "s": None}) == B
    assert state_to_follow(None, {"p": B, "r": A}) == A  # a tie: the smaller digest
    assert state_to_follow(None, {"p": None}) is None


def test_a_peer_that_names_its_state_leads_before_one_that_does_not() -> None:
    states = {"x": None, "y": A, "z": A}
    assert leader_order(["x", "y", "z"], states) == ["y", "z", "x"]
    assert leader_order(["x", "w"], {}) == ["x", "w"]  # nobody said: rank order stands
    # clients (no inbound path) lead last, within peers that stated and within those that did not
    modes = {"y": "client", "x": "client"}
    assert leader_order(["x", "y", "z"], states, modes) == ["z", "y", "x"]
    assert leader_order(["x", "w"], {}, {"x": "client", "w": "node"}) == ["w", "x"]
