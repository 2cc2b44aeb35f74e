"""Lineages and the fork choice (pure: no network)."""

from __future__ import annotations

from dedloc_jax.state.lineage import (
    LINEAGE,
    Announcement,
    fork_choice,
    fork_verdict,
    lineage_counts,
    losing_peers,
    on_minority_fork,
)
from p2p.identity import Identity, PeerID


def _pid() -> PeerID:
    return Identity.generate().peer_id


def test_the_lineage_more_peers_hold_wins_and_one_side_of_a_tie_moves() -> None:
    a, b = b"\x01" * 32, b"\x02" * 32
    # 3 others hold b at epoch 5, 1 other holds a (2 with us): a loses.
    assert on_minority_fork({(5, b): 3, (5, a): 1}, 5, a)
    assert not on_minority_fork({(5, a): 1, (5, b): 2}, 5, b)  # the majority stays
    # 1 against 1 (one other peer and us): the smaller digest stays, the larger moves.
    assert not on_minority_fork({(5, b): 1}, 5, a)
    assert on_minority_fork({(5, a): 1}, 5, b)
    # other epochs are not forks (being behind is the tracker's business)
    assert not on_minority_fork({(6, b): 9, (4, b): 9}, 5, a)
    assert not on_minority_fork({}, 5, a)


def test_a_lineage_counts_the_peers_that_moved_on_from_it() -> None:
    a, b, c = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    pid = _pid()
    moved_on = [Announcement(pid, 8, c, (b,)), Announcement(pid, 9, c, (c, b, a))]
    # Both descend from b at epoch 7; the second also from a at epoch 6.
    assert lineage_counts(moved_on, 7) == {(7, b): 2}
    assert lineage_counts(moved_on, 6) == {(6, a): 1}
    assert lineage_counts(moved_on, 3) == {}  # further back than announcements name
    # We and one other peer hold a at epoch 7, three moved on from b: a lost.
    held = [Announcement(pid, 7, a)]
    counts = lineage_counts([*held, *moved_on, Announcement(pid, 10, c, (c, c, b))], 7)
    assert on_minority_fork(counts, 7, a)
    assert not on_minority_fork(counts, 7, b)


def _side(n: int, epoch: int, chain: list[bytes]) -> list[Announcement]:
    """n peers at ``epoch`` holding chain[-1], descended from the rest (oldest first)."""
    lineage = tuple(reversed(chain[:-1]))[:LINEAGE]
    return [Announcement(_pid(), epoch, chain[-1], lineage) for _ in range(n)]


def _digests(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, k]) * 16 for k in range(n)]


def test_after_a_heal_the_side_one_epoch_ahead_finds_it_lost_at_the_fork() -> None:
    """Both sides share epochs 4 and 5, forked at 6; the small side reached epoch 9, the big
    one is still at 8. Counting only at epoch 9 the small side cannot lose (nobody else holds
    9); counting at the fork (epoch 6) it does, and the big side does not. A peer that loaded
    the small side's state names no lineage: it loses with the side it copied."""
    shared = _digests(0, 2)
    big = [*shared, *_digests(1, 3)]  # epochs 4..8
    small = [*shared, *_digests(2, 4)]  # epochs 4..9
    announced = [*_side(6, 8, big), *_side(2, 9, small)]
    me_small = small[-1], tuple(reversed(small[:-1]))
    # A copy of the small side's state (loaded: no lineage, no vote) loses with that side.
    assert fork_verdict(announced, 9, me_small[0]) is True
    assert fork_verdict(announced, 9, *me_small) is True
    me_big = big[-1], tuple(reversed(big[:-1]))
    assert fork_verdict(announced, 8, *me_big) is False
    # A lost fork older than any peer still at it does not hide a newer one: we (big side)
    # also split at epoch 8 from 8 peers of our side (6 others and us hold ours).
    split = [*big[:-1], b"\x09" * 32]
    assert fork_verdict([*announced, *_side(8, 8, split)], 8, *me_big) is True


def test_the_fork_choice_follows_the_side_more_peers_hold_not_the_newest_epoch() -> None:
    shared = _digests(0, 2)
    big = [*shared, *_digests(1, 3)]  # epochs 4..8
    small = [*shared, *_digests(2, 4)]  # epochs 4..9
    announced = [*_side(6, 8, big), *_side(2, 9, small)]
    assert fork_choice(announced) == (8, big[-1])
    # A peer that loaded the small side's state names no lineage: it is on that side too.
    loaded = Announcement(_pid(), 9, small[-1])
    assert fork_choice([*announced, loaded, loaded]) == (8, big[-1])
    # Without a fork: the newest state, the one most peers announce (of as many, the
    # smaller digest), once as many peers reached its epoch as still announce older ones:
    # the first peer to step may have stepped alone.
    one = [*shared, *_digests(1, 3)]
    other = [*one[:-1], b"\x00" * 32]
    assert fork_choice([*_side(3, 7, one[:-1]), *_side(1, 8, one)]) == (7, one[-2])
    assert fork_choice([*_side(3, 7, one[:-1]), *_side(3, 8, one)]) == (8, one[-1])
    assert fork_choice([*_side(4, 6, one[:-2]), *_side(2, 7, one[:-1]), *_side(2, 8, one)]) == (
        7,
        one[-2],
    )
    assert fork_choice([*_side(2, 8, one), *_side(1, 8, other)]) == (8, one[-1])
    assert fork_choice([*_side(1, 8, one), *_side(1, 8, other)]) == (8, other[-1])
    assert fork_choice([]) is None
    # The big side wins at the fork even when the small one has more peers at epoch 9.
    more = [*_side(3, 8, big), *_side(2, 9, small), *_side(1, 7, big[:-1])]
    assert fork_choice(more) == (8, big[-1])


def test_a_check_cannot_tell_while_the_others_still_announce_older_epochs() -> None:
    a, b = b"\x01" * 32, b"\x02" * 32
    pid = _pid()
    behind = [Announcement(pid, 6, a), Announcement(pid, 6, a)]
    assert fork_verdict(behind, 7, b) is None  # they are still averaging epoch 6
    assert fork_verdict([], 7, b) is False  # nobody else at all: nothing to lose to
    assert fork_verdict([*behind, Announcement(pid, 7, b)], 7, b) is False
    assert fork_verdict([*behind, Announcement(pid, 8, a, (a,))], 7, b) is True
    # Most peers still average epoch 6: the first of them at epoch 7 decide nothing, whichever
    # way a 1-1 count would go (a < b < c).
    c = b"\x03" * 32
    behind3 = [*behind, Announcement(pid, 6, a)]
    assert fork_verdict([*behind3, Announcement(pid, 7, a)], 7, b) is None
    assert fork_verdict([*behind3, Announcement(pid, 7, c)], 7, b) is None
    two = [Announcement(pid, 7, a), Announcement(pid, 8, c, (a,))]
    assert fork_verdict([*behind3, *two], 7, b) is True  # 2 of 7 against our 1


def test_the_peers_of_a_lineage_the_fork_choice_leaves_are_named() -> None:
    shared = _digests(0, 2)
    big = [*shared, *_digests(1, 3)]  # epochs 4..8
    small = [*shared, *_digests(2, 4)]  # epochs 4..9, forked at 6
    bigs, smalls = _side(6, 8, big), _side(2, 9, small)
    loaded = Announcement("loaded", 9, small[-1])  # took the small side's state: no lineage
    assert losing_peers([*bigs, *smalls, loaded]) == {str(a.peer) for a in (*smalls, loaded)}
    # One lineage, at several epochs (peers still stepping): nobody loses.
    assert losing_peers([*bigs, *_side(3, 7, big[:-1])]) == set()
    assert losing_peers(bigs) == set() and losing_peers([]) == set()


def test_a_side_further_ahead_than_a_lineage_names_loses_after_a_long_partition() -> None:
    """The sides forked long ago and name no common epoch: the small side came back six
    epochs ahead (a 200-peer soak, after a 33-epoch cut). No fork can be counted, yet the
    small side must lose, and its epoch must not lead the big side (which then stopped)."""
    big = _digests(1, 20)  # epochs 1..20
    small = _digests(2, 26)  # epochs 1..26, another lineage
    bigs, smalls = _side(6, 20, big), _side(2, 26, small)
    loaded = Announcement("loaded", 26, small[-1])  # took the small side's state
    announced = [*bigs, *smalls, loaded]
    assert fork_choice(announced) == (20, big[-1])
    assert losing_peers(announced) == {str(a.peer) for a in (*smalls, loaded)}
    assert fork_verdict(announced, 26, small[-1], tuple(reversed(small[:-1]))) is True
    assert fork_verdict(announced, 20, big[-1], tuple(reversed(big[:-1]))) is False
    # A peer of the big side's lineage as far ahead as a lineage names is kept (its check
    # waits for the others), and so is one of another lineage that ahead, until it is counted
    # at the fork, where it loses.
    ahead = _side(1, 20 + LINEAGE, [*big, *_digests(3, LINEAGE)])
    assert losing_peers([*bigs, *ahead]) == set()
    assert fork_verdict(bigs, 20 + LINEAGE, ahead[0].digest, ahead[0].lineage) is None
    assert fork_choice([*bigs, *ahead]) == (20, big[-1])
    other = _side(1, 20 + LINEAGE, [*big[:-1], *_digests(4, LINEAGE + 1)])
    assert losing_peers([*bigs, *other]) == {str(other[0].peer)}
    assert fork_verdict(bigs, 20 + LINEAGE, other[0].digest, other[0].lineage) is True


def test_copies_do_not_outvote_a_survivor_that_stepped_alone_past_the_lineage_window() -> None:
    """Issue 45: a pair's survivor A stepped alone to epoch 42 while the other restarted. The
    killed peer's announcement (epoch 37, it lives until it expires), the restarted peer's copy
    of that state and the coordinator's checkpoint copy outvoted A, which then refused the
    older state: both sides stepped alone. Copies are no votes; two lone states too far apart
    to count at a fork: the newer wins, and the copies lose with the older."""
    chain = _digests(5, 42)  # epochs 1..42 of one lineage
    a = _side(1, 42, chain)[0]
    killed = _side(1, 37, chain[:37])[0]
    restarted = Announcement("restarted", 37, chain[36])  # loaded: names no lineage
    checkpoint = Announcement("coordinator", 30, chain[29], votes=False)
    announced = [killed, restarted, checkpoint]
    assert fork_choice([a, *announced]) == (42, a.digest)
    assert fork_verdict(announced, 42, a.digest, a.lineage) is False
    assert losing_peers([a, *announced]) == {str(killed.peer), "restarted"}
    assert fork_verdict([a, killed, checkpoint], 37, chain[36]) is True  # the restarted copy


def test_of_two_lone_peers_split_at_a_fork_the_loser_is_told_even_when_it_is_ahead() -> None:
    """Two peers forked at epoch 6 (each stepped alone); the one the tie-break leaves went on
    alone to epoch 9 while the other is at 7. Both agree which lineage goes on, whatever the
    epochs, and the choice names the winner's (older) state for the loser to load."""
    shared = _digests(0, 5)  # epochs 1..5
    x, y = [*shared, *_digests(1, 2)], [*shared, *_digests(2, 4)]  # to 7 and to 9
    px, py = _side(1, 7, x)[0], _side(1, 9, y)[0]
    winner, loser = (px, py) if x[5] < y[5] else (py, px)
    assert fork_choice([px, py]) == (winner.epoch, winner.digest)
    assert fork_verdict([winner], loser.epoch, loser.digest, loser.lineage) is True
    assert fork_verdict([loser], winner.epoch, winner.digest, winner.lineage) is False


def test_the_state_a_peer_behind_loads_counts_its_own_vote() -> None:
    """Issue 46 (the capped soak at seed 6): after a heal the minority's peer A had stepped to
    epoch 6, while the majority's B and we, its mate, held epoch 5 (forked from A at 4; the
    majority's other peers held copies, which do not vote). Our fork check counted us: 2 to 1,
    we stay. The choice of the state to load counted only the others: 1 to 1, A won the tie by
    its smaller digest, and we, behind A's epoch, loaded the state our check had just beaten
    (the bootstrap skipped epochs 5 and 6). It counts our state as the check does."""
    import trio
    import trio.testing

    from dedloc_jax.state.local import LocalState
    from dedloc_jax.state.vouching import VouchBook

    shared, (a4, a5, a6), (b4, b5) = b"\x09" * 32, _digests(1, 3), _digests(2, 2)
    assert a4 < b4  # the minority wins a 1-1 tie at the fork
    minority = Announcement(_pid(), 6, a6, (a5, a4, shared), vouched=True)
    mate = Announcement(_pid(), 5, b5, (b4, shared), vouched=True)
    assert fork_choice([minority, mate]) == (6, a6)  # the choice without our vote

    class Latest:
        epoch, digest = 5, b5

    class Server:
        latest, lineage, vouched = Latest(), (b4, shared), True

    class Tracker:
        mode = "node"

        def announcements(self) -> list[Announcement]:
            return [minority, mate]

    class DHT:
        async def get(self, key, **kwargs):  # noqa: ANN001, ANN003, ANN202
            return None  # the state key's read finds nothing more than the table

    class Node:
        peer_id = _pid()

    state = LocalState(
        Node(), DHT(), "run", Server(), Tracker(), VouchBook(), rpc_timeout=1.0, renew_every=1.0
    )  # type: ignore[arg-type]
    assert state.fork_verdict() is False  # our check: we hold the majority's lineage
    newest = trio.run(state.newest_epoch, clock=trio.testing.MockClock(autojump_threshold=0))
    assert newest == 5  # nothing newer to load on it


def test_copies_break_a_tie_between_sides_as_many_voters_hold() -> None:
    """Issue 46 (the capped soak, seeds 6 and 9): after a heal the majority's peers that had
    stepped without the whole collaboration held copies (loaded states name no lineage, and
    vote for none), so the majority's voters tied with the minority's and the smaller digest
    won: every peer of the majority loaded the minority's state. A copy counts, on the side
    of a voter that holds its state or descends from it, to break such a tie."""
    shared = b"\x09" * 32
    (m3, m4), (b3, b4) = _digests(1, 2), _digests(2, 2)
    assert m3 < b3  # the minority would win the tie by digest
    minority = Announcement(_pid(), 4, m4, (m3, shared), vouched=True)
    majority = Announcement(_pid(), 4, b4, (b3, shared), vouched=True)
    copy = Announcement(_pid(), 4, b4, (), vouched=True)  # loaded the majority's state
    assert fork_choice([minority, majority, copy]) == (4, b4)
    assert fork_verdict([majority, copy], 4, m4, (m3, shared), vouched=True) is True
    assert fork_verdict([minority, copy], 4, b4, (b3, shared), vouched=True) is False
    # An unvouched copy (a Sybil's, or a newcomer's that never averaged) breaks no tie.
    sybil = Announcement(_pid(), 4, m4, ())
    assert fork_choice([minority, majority, copy, sybil, sybil]) == (4, b4)
    assert fork_choice([minority, majority, Announcement(_pid(), 4, m4, (), vouched=True)]) == (
        4,
        m4,
    )


def test_the_fork_check_agrees_with_the_fork_choice_after_an_earlier_fork() -> None:
    """Issue 46 (the capped soak at seed 9): the sides of a healed partition forked at epoch
    3, where ours won; at epoch 5 our side's two groups held two states while the minority's
    two peers held one. The check counted every announcement at epoch 5, the minority's too
    (its side lost at 3): 2 against our 1, lost; the fork choice named our state. The peer
    loaded its own state and stepped on, alone, forever. It loses where the choice's walk
    leaves its side."""
    shared = b"\x09" * 32
    (f3, f4, o5, x5), (m3, m4, m5) = _digests(1, 4), _digests(2, 3)
    assert f3 < m3 and o5 < x5  # ours wins both forks (by digest)
    ours = (f4, f3, shared)
    mate = Announcement(_pid(), 5, x5, ours, vouched=True)  # the other group of our side
    minority = [Announcement(_pid(), 5, m5, (m4, m3, shared), vouched=True) for _ in range(2)]
    us = Announcement(_pid(), 5, o5, ours, vouched=True)
    assert fork_choice([mate, *minority, us]) == (5, o5)
    assert fork_verdict([mate, *minority], 5, o5, ours, vouched=True) is False
    assert fork_verdict([us, *minority], 5, x5, ours, vouched=True) is True  # the mate's


def test_a_state_loaded_then_stepped_from_names_its_ancestors() -> None:
    """Issue 46 (the capped soak at seed 9): a peer that loaded a state, then stepped, named
    only the loaded state as its lineage, so it counted at no fork before its load: the
    healed partition's majority, most of it such peers, lost to the minority's two at the
    partition's fork. The ancestors the announcements name for the loaded state follow it."""
    import numpy as np

    from dedloc_jax.state.chunks import pack_state
    from dedloc_jax.state.local import ancestry_of
    from dedloc_jax.state.serving import StateServer

    shared, (b3, b4) = b"\x09" * 32, _digests(2, 2)
    loaded, _ = pack_state([np.ones(4, np.float32)], 5, chunk_bytes=4096)
    donors = [
        Announcement(_pid(), 5, loaded.digest, (b4,)),  # knows one ancestor
        Announcement(_pid(), 6, b"\x07" * 32, (loaded.digest, b4, b3, shared)),  # moved on
        Announcement(_pid(), 5, b"\x08" * 32, (b4, b3, shared)),  # another state of 5
    ]
    ancestry = ancestry_of(donors, 5, loaded.digest)
    assert ancestry == (b4, b3, shared)
    server = StateServer(None, None, "run", chunk_bytes=4096, ttl=lambda: 60.0)  # type: ignore[arg-type]
    server.hold(loaded, [np.ones(4, np.float32)], ancestry)
    assert server.lineage == ()  # a copy names none (no vote) while it holds it
    server.set_state([np.full(4, 2.0, np.float32)], 6)
    assert server.lineage == (loaded.digest, b4, b3, shared)
