"""Deterministic assignment of an epoch's peers to averaging groups.

Matchmaking gathers, through the DHT, the peers that want to average at an epoch. Every peer
then runs :func:`assign_groups` on the set it saw; peers that saw the same set get the same
groups without another round of messages. Groups are capped (Moshpit-style) and reshuffled every
epoch from a seed both sides can compute, so averages mix across groups over epochs.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence


def group_seed(run_id: str, epoch: int) -> int:
    """A seed every peer derives identically for ``(run_id, epoch)``."""
    digest = hashlib.sha256(f"{run_id}\x00{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def assign_groups(peers: Sequence[str], *, max_group_size: int, seed: int) -> list[list[str]]:
    """Split ``peers`` into groups of at most ``max_group_size``, as evenly as possible.

    The result depends only on the *set* of peers and the seed: the input order is ignored.
    Each group is sorted, so its first member (the leader) is well defined.
    """
    if max_group_size < 1:
        raise ValueError("max_group_size must be at least 1")
    unique = sorted(set(peers))
    if not unique:
        return []
    random.Random(seed).shuffle(unique)
    n_groups = -(-len(unique) // max_group_size)
    groups = [sorted(unique[i::n_groups]) for i in range(n_groups)]
    return sorted(groups, key=lambda g: g[0])


def group_of(peer: str, groups: Sequence[Sequence[str]]) -> list[str] | None:
    """The group that holds ``peer``, or None."""
    for g in groups:
        if peer in g:
            return list(g)
    return None
