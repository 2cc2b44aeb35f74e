"""Issue 46, item 3: a member's stated links and weight buy it no more than a few typical
members' share (the leader bounds them before the load-balancing LP)."""

from __future__ import annotations

import logging

from bench.attacks_progress import LIE_BPS
from dedloc_jax.averaging.group import FRACTION_GRID, GroupSpec, Member
from dedloc_jax.progress import CLAIM_CAP
from dedloc_jax.rounds.claims import bound_claims, excess_weight


def _share(members: list[Member], peer: str) -> float:
    spec = GroupSpec(tuple(members)).with_parts()
    return spec.share_parts()[spec.index_of(peer)] / FRACTION_GRID


def test_a_member_claiming_1e15_bytes_per_second_gets_a_bounded_share() -> None:
    honest = [Member(f"h{i}", "node", 1e7, 1e7, 100.0) for i in range(3)]
    liar = Member("liar", "node", LIE_BPS, LIE_BPS, float(1 << 53))
    plain = _share([*honest, liar], "liar")
    bounded_members = bound_claims([*honest, liar], me="h0")
    bounded = _share(bounded_members, "liar")
    print(f"the liar's share: {plain:.3f} taken at its word, {bounded:.3f} bounded")
    assert plain > 0.9  # the LP believed it: nearly the whole vector on the liar
    assert bounded <= 0.26  # counted as the group's median member's links
    got = {m.peer_id: m for m in bounded_members}["liar"]
    assert got.upload_bps == got.download_bps == 1e7
    assert got.weight == CLAIM_CAP * 100.0
    # slower links are kept as they are, and so are the leader's own figures
    spread = [Member("a", "node", 1e6, 1e6, 10.0), Member("b", "node", 1e7, 1e7, 40.0)]
    spread.append(Member("c", "node", 3e6, 3e6, 20.0))
    kept = bound_claims(spread, me="b")
    assert kept[0] == spread[0] and kept[1] == spread[1]
    own = bound_claims([liar, *honest], me="liar")[0]  # the leader's links are its own
    assert (own.upload_bps, own.download_bps, own.weight) == (LIE_BPS, LIE_BPS, 4 * 100.0)


def test_an_honest_peer_that_fed_most_of_the_target_counts_whole() -> None:
    # Two peers of a target of 64: one fed it nearly alone while the other was compiling (the
    # README DiLoCo example in CI: 64 samples counted as 48, and the run left its replay).
    fast, slow = Member("fast", "node", 1e7, 1e7, 64.0), Member("slow", "node", 1e7, 1e7, 12.0)
    assert bound_claims([slow, fast], me="slow")[1].weight == CLAIM_CAP * 12.0  # medians only
    assert bound_claims([slow, fast], me="slow", share=64 / 2)[1] == fast
    # a liar still weighs no more than CLAIM_CAP equal shares of the target
    liar = Member("liar", "node", 1e7, 1e7, float(1 << 53))
    got = bound_claims([slow, fast, liar], me="slow", share=64 / 3)[2]
    assert got.weight == max(CLAIM_CAP * 64 / 3, CLAIM_CAP * 64.0)  # median 64


def test_a_follower_refuses_a_spec_in_which_the_leader_wrote_itself_an_unbounded_weight() -> None:
    """Members count the spec's weights, and the leader kept its own as it stated: a liar
    leading wrote 2**53 for itself and its vector was the group's mean. The leader now bounds
    itself by the rule every member checks; an honest leader's spec passes. A member that
    refuses the spec counts the leader as gone (it falls back to the next member in rank)."""
    import pytest
    import trio

    from dedloc_jax.rounds.context import PeerSide
    from dedloc_jax.rounds.following import Joining, LeaderGone, follow

    honest = [Member(f"h{i}", "node", 1e7, 1e7, 100.0) for i in range(2)]
    liar = Member("liar", "node", 1e7, 1e7, float(1 << 53))
    assert excess_weight([liar, *honest], share=64.0) is not None
    bounded = bound_claims([liar, *honest], me="liar", share=64.0)
    assert excess_weight(bounded, share=64.0) is None
    # the README DiLoCo pair (64 against 12 of a target of 64) keeps the rule as the leader
    # bounds it, even where the follower expects twice the peers the leader did
    pair = bound_claims([Member("fast", "node", 1e7, 1e7, 64.0), honest[0]], me="fast", share=32)
    assert excess_weight(pair, share=16.0) is None

    class Node:
        addrs: list = []

        def __init__(self, spec: GroupSpec) -> None:
            self.spec = spec

        async def call(self, *args, **kwargs) -> dict:
            return {"ok": True, "spec": self.spec.to_bytes()}

    def joined(members: list[Member]) -> GroupSpec | None:
        j = Joining(
            Node(GroupSpec(tuple(members))),  # type: ignore[arg-type]
            (3, 0),
            honest[0],
            PeerSide(),
            1.0,
            learn=lambda p, r: None,
            choose=lambda p: None,
            cross=lambda c: None,
            share=64.0,
        )
        return trio.run(follow, j, "11111111111111111111111111111111")

    with pytest.raises(LeaderGone):
        joined([liar, *honest])
    assert joined(bounded) is not None


def test_an_honest_member_faster_than_the_median_is_bounded_quietly(caplog) -> None:
    """Trainers on loopback: a mate measured at 7.9e7 B/s up against the median's 2.15e7, or
    1.54e8 down against 2.02e7, is bounded in every round, and each round logged it at INFO
    (15 and 18 lines in 30-epoch runs). Only a bounded weight or an implausible link claim
    (a liar's) is INFO."""
    me = Member("me", "node", 2.15e7, 2.02e7, 48.0)
    fast = Member("fast", "node", 7.9e7, 1.54e8, 48.0)
    client = Member("client", "client", 1e7, 5e7, 48.0)
    with caplog.at_level(logging.DEBUG, logger="dedloc_jax.rounds.claims"):
        bounded = bound_claims([me, fast], me="me")
    assert bounded[1].upload_bps == 2.15e7  # still bounded
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    caplog.clear()
    liar = Member("liar", "node", LIE_BPS, LIE_BPS, 48.0)
    with caplog.at_level(logging.DEBUG, logger="dedloc_jax.rounds.claims"):
        bound_claims([me, liar, client], me="me")
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "liar" in caplog.records[0].getMessage()
    caplog.clear()
    heavy = Member("heavy", "node", 2e7, 2e7, 48.0 * 100)  # weighs 100 typical members
    with caplog.at_level(logging.DEBUG, logger="dedloc_jax.rounds.claims"):
        bound_claims([me, heavy, client], me="me")
    assert [r.levelno for r in caplog.records if "heavy" in r.getMessage()] == [logging.INFO]
