"""Every deadline of a round, from the predictions it follows (dedloc_jax.rounds.deadlines)."""

from __future__ import annotations

from types import SimpleNamespace

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


def test_peers_that_check_mid_step_get_a_window_of_their_poll_not_the_slowest_step() -> None:
    """A 1 sample/s peer's 4 s micro-step made a 6.35 s window at 40 peers, and the group
    waited two of them for a peer the churn had killed. Peers that ask, inside a micro-step,
    whether to average announce their poll (``PeerProgress.poll``); when we and every peer
    the round expects do, all notice the target a poll apart: the window counts the longest
    poll, and the matchmaking is eager. A peer that does not announce one (it looks between
    micro-steps only) keeps the old window: it would register up to a micro-step late."""
    from dedloc_jax.config import CollaborationConfig, RoundConfig
    from dedloc_jax.progress import PeerProgress
    from dedloc_jax.rounds.stepping import Stepper

    def record(poll: float | None, mode: str = "node") -> PeerProgress:
        return PeerProgress("x", 3, 8, 1.0, 0.0, mode, poll=poll)

    tracker = SimpleNamespace(dht_latency=0.05, poll=None, peer_id="me", records={})
    est = SimpleNamespace(max_step_interval=4.0)
    config = CollaborationConfig(target_batch_size=4096)
    refresh = config.progress.min_refresh

    def deadlines(expected=("me", "a", "b")) -> Deadlines:
        return Stepper(None, tracker, None, config).deadlines(est, expected)  # type: ignore[arg-type]

    old = matchmaking_window(refresh, 0.05, 4.0)
    assert deadlines().window == old and not deadlines().eager
    tracker.poll = 0.25  # we check mid-step; b does not say, c has no record
    tracker.records = {"a": record(0.25), "b": record(None)}
    assert deadlines().window == old and not deadlines().eager
    assert deadlines(("a", "c")).window == old
    tracker.records["b"] = record(0.5)
    quick = deadlines()
    assert quick.eager and quick.window == matchmaking_window(refresh, 0.05, 0.5) < old / 2
    tracker.records["c"] = record(None, mode="aux")  # computes no micro-steps: not counted
    assert deadlines(("a", "b", "c")) == quick
    tracker.poll = None  # we ourselves look between micro-steps only
    assert deadlines().window == old and not deadlines().eager
    # a run whose micro-steps are shorter than the poll keeps their spread
    tracker.poll, est.max_step_interval = 0.25, 0.1
    assert deadlines().window == matchmaking_window(refresh, 0.05, 0.1)
    with pytest.raises(ValueError):
        RoundConfig(mid_step_poll=0.0)
