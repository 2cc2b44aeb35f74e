"""Deterministic assignment of an epoch's peers to averaging groups.

Matchmaking gathers, through the DHT, the peers that want to average at an epoch. Every peer
then runs :func:`assign_groups` on the set it saw; peers that saw the same set get the same
groups without another round of messages. Groups are capped (Moshpit-style) and reshuffled every
epoch from a seed both sides can compute, so averages mix across groups over epochs.

Peers do not always see the same set: a registration can reach some readers a moment after
others, or not at all (a partition, a dead replica). So a peer's group and its leader depend on
that peer's own hash and the number of groups, not on the rest of the set, and a different
number of groups moves only a few peers (consistent hashing): two views that differ by a few
peers agree on nearly everyone else's group and leader (a reshuffle of the whole set would
move nearly everyone when a view misses one peer).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

HEADROOM = 1.25
"""More groups than strictly needed (n * HEADROOM / cap), so that hashing rarely fills one."""


def group_seed(run_id: str, epoch: int) -> int:
    """A seed every peer derives identically for ``(run_id, epoch)``."""
    digest = hashlib.sha256(f"{run_id}\x00{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _rank(seed: int, peer: str) -> int:
    """The peer's place in this epoch's order: uniform in [0, 2**64)."""
    digest = hashlib.sha256(seed.to_bytes(8, "big") + peer.encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _bucket(key: int, buckets: int) -> int:
    """Jump consistent hashing (Lamping and Veach, 2014): a bucket in [0, buckets) such that
    going from b to b + 1 buckets moves only a 1/(b + 1) share of the keys (into the new one).
    Views that count a different number of groups then still agree on most peers' groups."""
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & 0xFFFFFFFFFFFFFFFF
        j = int((b + 1) * ((1 << 31) / ((key >> 33) + 1)))
    return b


def group_count(n: int, max_group_size: int) -> int:
    """How many groups ``n`` peers form: one while they fit, else with headroom."""
    if n <= max_group_size:
        return 1 if n else 0
    return math.ceil(n * HEADROOM / max_group_size)


def assign_groups(
    peers: Sequence[str], *, max_group_size: int, seed: int, population: int = 0
) -> list[list[str]]:
    """Split ``peers`` into groups of at most ``max_group_size``.

    A peer's group is the hash bucket of its rank; a bucket over the cap keeps its lowest
    ranks and passes the others to the groups with the most room. Each group is in rank
    order: its first member is the leader. The result depends only on the *set* of peers and
    the seed (the input order is ignored).

    ``population``: how many peers to size the groups for when ``peers`` may be only part of
    them (a view of the registrations that misses some). Every peer of an epoch sees nearly
    the same progress table, but registrations reach readers over a few seconds, and a view
    of 30 of 180 registrations counted 3 groups where the others counted 15: its peers then
    led groups nobody else was in.
    """
    if max_group_size < 1:
        raise ValueError("max_group_size must be at least 1")
    unique = set(peers)
    n_groups = group_count(max(len(unique), population), max_group_size) if unique else 0
    if not n_groups:
        return []
    rank = {p: _rank(seed, p) for p in unique}
    groups: list[list[str]] = [[] for _ in range(n_groups)]
    overflow: list[str] = []
    for p in sorted(unique, key=lambda p: (rank[p], p)):
        g = groups[_bucket(rank[p], n_groups)]
        (g if len(g) < max_group_size else overflow).append(p)
    for p in overflow:  # in rank order, each to the emptiest group (the first of equals)
        min(groups, key=len).append(p)
    return [g for g in groups if g]


def group_of(peer: str, groups: Sequence[Sequence[str]]) -> list[str] | None:
    """The group that holds ``peer``, or None."""
    for g in groups:
        if peer in g:
            return list(g)
    return None
