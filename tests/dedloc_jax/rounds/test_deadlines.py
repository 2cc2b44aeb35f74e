"""Every deadline of a round, from the predictions it follows (dedloc_jax.rounds.deadlines)."""

from __future__ import annotations

import pytest

from dedloc_jax.averaging import GroupSpec, Member
from dedloc_jax.averaging.bandwidth import UNMEASURED_DOWNLOAD_BPS, UNMEASURED_UPLOAD_BPS
from dedloc_jax.rounds.deadlines import Deadlines, averaging_timeout, matchmaking_window


def test_deadlines_follow_predictions() -> None:
    assert matchmaking_window(0.5, 0.01) > matchmaking_window(0.1, 0.01)
    assert matchmaking_window(0.0, 0.0) == 0.2
    slow = averaging_timeout(lp_bound_seconds=30.0, rtt=0.05)
    fast = averaging_timeout(lp_bound_seconds=0.1, rtt=0.001)
    assert slow > 30.0 and fast == 5.0
    with pytest.raises(ValueError):
        averaging_timeout(-1.0, 0.0)


def test_one_deadlines_object_follows_the_window_and_the_group_links() -> None:

    base = Deadlines(window=1.0)
    assert base.max_wait == 15.0 and base.member_wait == 6.0
    assert base.registration_ttl > base.join_timeout > base.relocate_interval > base.max_wait
    assert Deadlines(window=2.0).max_wait > base.max_wait
    # six unmeasured members (slow home links) and 6M float32 parameters: far above 5 s
    members = tuple(
        Member(f"p{i}", "node", UNMEASURED_UPLOAD_BPS, UNMEASURED_DOWNLOAD_BPS, 1.0)
        for i in range(6)
    )
    bound = GroupSpec(members, b"g").lower_bound(6_000_000 * 4)
    d = base.for_group(bound, rtt=0.05)
    assert d.lp_bound == bound > 30.0 and d.averaging > 3 * bound
    assert d.cross_wait >= 2 * d.averaging + 2 * d.max_wait
    assert base.for_group(bound, 0.05, override=7.0).averaging == 7.0
