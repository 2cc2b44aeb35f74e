"""The routing table against brute force on random IDs."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.dht.ids import ID_BITS, MAX_ID, common_prefix_len, key_id, node_id
from p2p.dht.routing import RoutingTable
from p2p.identity import PeerID

ids = st.integers(min_value=0, max_value=MAX_ID)


def pid(ident: int) -> PeerID:
    return PeerID(ident.to_bytes(32, "big"))


def check_invariants(table: RoutingTable, inserted: set[int]) -> None:
    buckets = table.buckets
    assert buckets[0].lo == 0 and buckets[-1].hi == 1 << ID_BITS
    for a, b in zip(buckets, buckets[1:], strict=False):
        assert a.hi == b.lo
    held = set()
    for b in buckets:
        assert len(b.peers) <= table.k
        for e in b.peers.values():
            assert b.covers(e.id)
            held.add(e.id)
        # no removal happened: a bucket holds every inserted peer of its range, up to k
        in_range = [i for i in inserted if b.covers(i)]
        assert len(b.peers) == min(table.k, len(in_range))
    assert held <= inserted
    assert len(table) == len(held)


@settings(max_examples=60, deadline=None)
@given(local=ids, peers=st.lists(ids, min_size=0, max_size=150, unique=True), target=ids)
def test_table_matches_brute_force(local: int, peers: list[int], target: int) -> None:
    k = 4
    table = RoutingTable(local, k=k)
    inserted = set()
    for i, p in enumerate(peers):
        if p == local:
            continue
        table.add_or_update(pid(p), p, now=float(i))
        inserted.add(p)
    check_invariants(table, inserted)
    held = [e.id for e in table.peers()]
    for count in (1, k, 3 * k):
        got = [e.id for e in table.nearest(target, count)]
        assert got == sorted(held, key=lambda i: i ^ target)[:count]
    # excluding peers (a FIND never answers the asker itself) reads further buckets if needed
    skipped = set(sorted(held, key=lambda i: i ^ target)[: k + 1 : 2])
    for count in (1, k, 3 * k):
        got = [e.id for e in table.nearest(target, count, exclude=[pid(i) for i in skipped])]
        assert got == sorted(set(held) - skipped, key=lambda i: i ^ target)[:count]


@settings(max_examples=40, deadline=None)
@given(local=ids, peers=st.lists(ids, min_size=1, max_size=120, unique=True))
def test_closest_to_self_are_always_kept(local: int, peers: list[int]) -> None:
    """The bucket holding our own ID always splits, so peers sharing the longest prefixes stay."""
    k = 3
    table = RoutingTable(local, k=k)
    others = [p for p in peers if p != local]
    for p in others:
        table.add_or_update(pid(p), p)
    best = max((common_prefix_len(local, p) for p in others), default=None)
    if best is not None:
        deepest = [p for p in others if common_prefix_len(local, p) == best]
        for p in deepest[:k]:
            assert pid(p) in table


def test_lrs_eviction_with_ping_before_evict() -> None:
    rng = random.Random(1)
    local = 0
    table = RoutingTable(local, k=2, replacement_cache_size=2)
    # four peers in the far half (top bit 1): cannot split, bucket holds 2
    far = [(1 << 255) | rng.getrandbits(200) for _ in range(4)]
    assert table.add_or_update(pid(far[0]), far[0], now=1) is None
    assert table.add_or_update(pid(far[1]), far[1], now=2) is None
    lrs = table.add_or_update(pid(far[2]), far[2], now=3)
    assert lrs is not None and lrs.peer == pid(far[0])  # least recently seen is returned
    assert pid(far[2]) not in table
    # the LRS answered the ping: it is refreshed, the newcomer stays a replacement
    assert table.add_or_update(pid(far[0]), far[0], now=4) is None
    lrs = table.add_or_update(pid(far[3]), far[3], now=5)
    assert lrs is not None and lrs.peer == pid(far[1])
    # far[1] does not answer: removed, the freshest replacement (far[3]) moves in
    assert table.remove(pid(far[1]))
    assert pid(far[3]) in table and pid(far[1]) not in table
    assert pid(far[2]) not in table
    assert table.remove(pid(far[0]))
    assert pid(far[2]) in table


def test_update_moves_to_tail_and_keeps_addrs() -> None:
    table = RoutingTable(0, k=3)
    a, b = 1 << 255, (1 << 255) + 1
    table.add_or_update(pid(a), a, ["/ip4/1.2.3.4/tcp/1"], now=1)
    table.add_or_update(pid(b), b, now=2)
    table.add_or_update(pid(a), a, now=3)
    bucket = table.bucket_for(a)
    assert [e.peer for e in bucket.peers.values()] == [pid(b), pid(a)]
    assert table.get(pid(a)).addrs == ("/ip4/1.2.3.4/tcp/1",)
    assert table.get(pid(a)).last_seen == 3


def test_stale_buckets_and_refresh() -> None:
    table = RoutingTable(0, k=1)
    for i in range(1, 6):
        table.add_or_update(pid(1 << (250 + i % 5)), 1 << (250 + i % 5), now=float(i))
    assert len(table.buckets) > 1
    stale = table.stale_buckets(now=100.0, max_age=50.0)
    assert stale == table.buckets
    ident = stale[0].lo
    table.touch_bucket(ident, 100.0)
    assert table.bucket_for(ident) not in table.stale_buckets(now=100.0, max_age=50.0)


def test_ids() -> None:
    p = PeerID(bytes(range(32)))
    assert node_id(p) == int.from_bytes(bytes(range(32)), "big")
    assert key_id("a") != key_id("b") and 0 <= key_id("a") <= MAX_ID
    assert common_prefix_len(5, 5) == ID_BITS
    assert common_prefix_len(0, 1 << 255) == 0
