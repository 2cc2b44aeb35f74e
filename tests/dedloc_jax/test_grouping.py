from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dedloc_jax.grouping import assign_groups, group_of, group_seed

peer_sets = st.sets(st.text("abcdefgh0123456789", min_size=4, max_size=8), max_size=300)


@given(peer_sets, st.integers(1, 40), st.integers(0, 2**32))
def test_every_peer_in_exactly_one_capped_group(peers, cap, seed) -> None:
    groups = assign_groups(list(peers), max_group_size=cap, seed=seed)
    members = [p for g in groups for p in g]
    assert sorted(members) == sorted(peers)
    assert all(1 <= len(g) <= cap for g in groups)
    if groups:
        assert max(map(len, groups)) - min(map(len, groups)) <= 1  # balanced


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
    assert len(g1) == 7 and all(len(g) <= 32 for g in g1)
    assert g1 != g2  # regrouped each epoch
    assert group_of("peer007", g1) is not None and group_of("nobody", g1) is None
    assert group_seed("run", 1) == group_seed("run", 1) != group_seed("other", 1)
