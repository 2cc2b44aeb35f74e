from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dedloc_jax.rounds.grouping import assign_groups, group_count, group_of, group_seed

peer_sets = st.sets(st.text("abcdefgh0123456789", min_size=4, max_size=8), max_size=300)


@given(peer_sets, st.integers(1, 40), st.integers(0, 2**32))
def test_every_peer_in_exactly_one_capped_group(peers, cap, seed) -> None:
    groups = assign_groups(list(peers), max_group_size=cap, seed=seed)
    members = [p for g in groups for p in g]
    assert sorted(members) == sorted(peers)
    assert all(1 <= len(g) <= cap for g in groups)
    if len(peers) <= cap:
        assert len(groups) == min(1, len(peers))  # everyone together while they fit
    else:  # a few more groups than needed (hash buckets can come out empty)
        assert -(-len(peers) // cap) <= len(groups) <= group_count(len(peers), cap)


@given(peer_sets, st.integers(1, 40), st.integers(0, 2**32), st.randoms())
def test_same_set_gives_same_groups_whatever_the_order(peers, cap, seed, rnd) -> None:
    order = list(peers)
    rnd.shuffle(order)
    assert assign_groups(order, max_group_size=cap, seed=seed) == assign_groups(
        sorted(peers), max_group_size=cap, seed=seed
    )


def test_200_peers_cap_32_and_regrouping_across_epochs() -> None:
    peers = [f"peer{i:03d}" for i in range(200)]
    g1 = assign_groups(peers, max_group_size=32, seed=group_seed("run", 1))
    g2 = assign_groups(peers, max_group_size=32, seed=group_seed("run", 2))
    assert len(g1) == group_count(200, 32) == 8 and all(len(g) <= 32 for g in g1)
    assert g1 != g2  # regrouped each epoch
    assert group_of("peer007", g1) is not None and group_of("nobody", g1) is None
    assert group_seed("run", 1) == group_seed("run", 1) != group_seed("other", 1)


def _leaders(groups: list[list[str]]) -> dict[str, str]:
    return {p: g[0] for g in groups for p in g}


def test_views_that_miss_a_peer_agree_on_everyone_elses_group_and_leader() -> None:
    """Readers of the registrations may each miss a peer or two. Each other peer must keep its
    group and leader, or the leader waits for members that went to another leader."""
    import random

    rng = random.Random(0)
    peers = [f"peer{i:03d}" for i in range(200)]
    seed = group_seed("run", 7)
    full = assign_groups(peers, max_group_size=16, seed=seed)
    kept = []
    for _ in range(50):
        missing = set(rng.sample(peers, 2))
        view = assign_groups([p for p in peers if p not in missing], max_group_size=16, seed=seed)
        same = _leaders(view)
        leaders = _leaders(full)
        others = [p for p in peers if p not in missing and leaders[p] not in missing]
        kept.append(sum(same[p] == leaders[p] for p in others) / len(others))
    assert min(kept) >= 0.85, min(kept)
    assert sum(kept) / len(kept) >= 0.97, sum(kept) / len(kept)


def test_views_of_different_sizes_still_agree_on_most_leaders() -> None:
    """At start-up (or after a partition) readers may count 150 or 180 registrations, and so
    a different number of groups: most peers must still agree on their leader."""
    peers = [f"peer{i:03d}" for i in range(180)]
    seed = group_seed("run", 3)
    small = _leaders(assign_groups(peers[:150], max_group_size=16, seed=seed))
    large = _leaders(assign_groups(peers, max_group_size=16, seed=seed))
    assert group_count(150, 16) < group_count(180, 16)
    same = sum(small[p] == large[p] for p in peers[:150]) / 150
    assert same >= 0.5, same  # 0.54 here; reshuffling the whole set kept 0.15


def test_a_partial_view_sized_for_the_whole_epoch_puts_its_peers_where_the_full_view_does() -> None:
    """A reader that saw only 30 of 180 registrations counts 3 groups on its own, and its
    peers then lead groups nobody else is in. Sized for the 180 peers the progress table
    shows, it puts each of its 30 in the group (and under the leader, when the leader is among
    them) of the full view, but for the odd peer a full bucket of the full view passed on."""
    import random

    peers = [f"peer{i:03d}" for i in range(180)]
    seed = group_seed("run", 11)
    full = assign_groups(peers, max_group_size=16, seed=seed)
    seen = random.Random(1).sample(peers, 30)
    alone = assign_groups(seen, max_group_size=16, seed=seed)
    sized = assign_groups(seen, max_group_size=16, seed=seed, population=180)
    assert len(alone) <= 3 < len(sized)

    def agree(view: list[list[str]]) -> float:
        """The share of the seen peers grouped with the same seen peers as in the full view."""

        def mates(groups: list[list[str]], p: str) -> set[str]:
            return next(set(g) & set(seen) for g in groups if p in g)

        return sum(mates(view, p) == mates(full, p) for p in seen) / len(seen)

    assert agree(sized) >= 0.75 and agree(alone) < 0.2, (agree(sized), agree(alone))  # 0.83, 0
    assert assign_groups(peers, max_group_size=16, seed=seed, population=10) == full  # at least n
