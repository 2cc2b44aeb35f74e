"""A round's plan, checked without sockets: whom a peer expects, the state a peer says it steps
from, which peers it may average with, and its group."""

from __future__ import annotations

import pytest

from dedloc_jax.averaging.errors import GroupError
from dedloc_jax.progress import PeerProgress
from dedloc_jax.rounds.plan import (
    expected_peers,
    leader_order,
    plan_groups,
    representatives,
    same_state,
    state_to_follow,
)
from dedloc_jax.rounds.wire import state_from_wire

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


def _at(peer: str, epoch: int, *, averages: bool = True) -> PeerProgress:
    return PeerProgress(peer, epoch, 0, 1.0, 0.0, averages=averages)


def test_a_peer_expects_those_at_its_epoch_and_its_last_mates() -> None:
    records = {
        "p": _at("p", 3),
        "follower": _at("follower", 3, averages=False),  # follows the run, never registers
        "mate": _at("mate", 2),  # averaged with us into 3; we read its report of 2
        "old": _at("old", 2),
    }
    assert expected_peers(records, (-1, frozenset()), "me", 3) == {"p"}
    mates = (3, frozenset({"mate", "me", "unread"}))  # "unread": no report of it at all
    assert expected_peers(records, mates, "me", 3) == {"p", "mate"}
    assert expected_peers(records, mates, "me", 4) == set()  # mates of another epoch


def test_the_plan_groups_one_lineage_and_waits_for_expected_mates() -> None:
    states = {"a": A, "b": A, "c": B, "d": None}
    modes = {"me": "node", "a": "node", "b": "aux", "c": "node", "d": "client"}
    plan = plan_groups(
        "me",
        A,
        ["a", "b", "c", "d"],
        states,
        modes,
        planned={"me", "a", "b", "c", "d", "e"},
        expected={"a", "e"},
        seed=1,
        cap=8,
        level=0,
    )
    assert plan.apart == {"c"}  # another state
    assert len(plan.groups) == 1 and set(plan.groups[0]) == set(plan.mine) == {"me", "a", "b", "d"}
    assert plan.mine[-1] == "d"  # said no state, and a client: it leads last
    assert plan.late == {"e"}  # expected, in our group, not registered
    level1 = plan_groups(
        "me", A, ["a"], {}, modes, planned={"me"}, expected={"z"}, seed=1, cap=8, level=1
    )
    assert level1.late == {"z"} and set(level1.mine) == {"me", "a"}


def test_a_group_is_represented_by_its_first_member_that_sends() -> None:
    modes = {"x": "aux", "y": "node", "z": "aux"}
    assert representatives([["x", "y"], ["z"], ["w"]], modes) == {"y", "w"}


def test_a_late_registration_moves_no_other_peer_to_another_group() -> None:
    """Six planned peers, groups of at most 3, one registering after the others planned:
    every other peer's group is the one it has once that peer registers, without it. The
    plan used to group the registered peers alone, and a group over the cap passes its
    highest ranks on: at epoch 3, with peer0 late, peer4 took the seat in peer5's group that
    peer0's view gave peer0, the leader waited for four (peer0 late), took the first two to
    join and refused peer0 as full (capped soak seed 2: a peer alone at epoch 0)."""
    from dedloc_jax.rounds.grouping import group_seed

    ids = [f"peer{i}" for i in range(6)]

    def mine(me: str, registered: set[str], epoch: int) -> set[str]:
        return set(
            plan_groups(
                me,
                None,
                registered - {me},
                {},
                {},
                planned=set(ids),
                expected=set(ids) - {me},
                seed=group_seed("run", epoch),
                cap=3,
                level=0,
            ).mine
        )

    for epoch in range(40):
        for late in ids:
            for me in set(ids) - {late}:
                before = mine(me, set(ids) - {late}, epoch)
                assert before == mine(me, set(ids), epoch) - {late}, (epoch, late, me)
