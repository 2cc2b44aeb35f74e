"""The Kademlia routing table: k-buckets over the ID space, split when they hold our own ID.

Pure logic: no I/O, time is passed in. Each bucket keeps its peers least-recently-seen first.
When a full bucket cannot split, the newcomer goes to the bucket's replacement cache and the
least-recently-seen peer is returned to the caller, who pings it (ping-before-evict): if it
answers it is refreshed (:meth:`RoutingTable.add_or_update`), otherwise it is removed
(:meth:`RoutingTable.remove`) and the freshest replacement takes its place. Old peers that
still answer are kept, which is what makes Kademlia resist flooding with new IDs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from p2p.dht.ids import ID_BITS
from p2p.identity import PeerID


@dataclass
class PeerEntry:
    """One known peer: its ID, dialable addresses and when we last heard from it."""

    peer: PeerID
    id: int
    addrs: tuple[Any, ...] = ()  # Multiaddr objects (opaque here)
    last_seen: float = 0.0


@dataclass
class KBucket:
    """Peers whose IDs fall in ``[lo, hi)``; ``peers`` is ordered least-recently-seen first.

    Dictionaries are keyed by the peer ID's raw digest (bytes cache their hash).
    """

    lo: int
    hi: int
    depth: int
    peers: OrderedDict[bytes, PeerEntry] = field(default_factory=OrderedDict)
    replacements: OrderedDict[bytes, PeerEntry] = field(default_factory=OrderedDict)
    last_updated: float = 0.0

    def covers(self, ident: int) -> bool:
        return self.lo <= ident < self.hi


class RoutingTable:
    """k-buckets with splitting, least-recently-seen eviction and replacement caches."""

    def __init__(self, local_id: int, k: int = 20, replacement_cache_size: int = 20) -> None:
        self.local_id = local_id
        self.k = k
        self.replacement_cache_size = replacement_cache_size
        self.buckets: list[KBucket] = [KBucket(0, 1 << ID_BITS, 0)]
        self._index: dict[bytes, KBucket] = {}

    # --- lookups -------------------------------------------------------------------------
    def bucket_for(self, ident: int) -> KBucket:
        """The bucket whose range holds ``ident`` (buckets are sorted and contiguous)."""
        lo, hi = 0, len(self.buckets)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.buckets[mid].lo <= ident:
                lo = mid
            else:
                hi = mid
        return self.buckets[lo]

    def __contains__(self, peer: object) -> bool:
        return isinstance(peer, PeerID) and peer.digest in self._index

    def __len__(self) -> int:
        return len(self._index)

    def get(self, peer: PeerID) -> PeerEntry | None:
        bucket = self._index.get(peer.digest)
        return bucket.peers[peer.digest] if bucket is not None else None

    def peers(self) -> list[PeerEntry]:
        return [e for bucket in self.buckets for e in bucket.peers.values()]

    def nearest(
        self, target: int, count: int | None = None, exclude: Iterable[PeerID] = ()
    ) -> list[PeerEntry]:
        """The ``count`` (default k) known peers nearest to ``target`` by XOR distance.

        Only the buckets that can hold them are read (a handful, not the whole table): a
        bucket is an aligned block of IDs, so XOR with the target maps it to an aligned block
        of distances, disjoint from every other bucket's. Visiting buckets by the low end of
        that block visits them in distance order; once ``count`` peers are gathered, no later
        bucket can hold a nearer one.
        """
        count = self.k if count is None else count
        if count <= 0:
            return []
        skip = {p.digest for p in exclude}

        def held(bucket: KBucket) -> list[PeerEntry]:
            if skip:
                return [e for key, e in bucket.peers.items() if key not in skip]
            return list(bucket.peers.values())

        entries = held(self.bucket_for(target))  # distances from 0: always the first block
        if len(entries) < count:
            entries = []
            for bucket in sorted(self.buckets, key=lambda b: _block_distance(b, target)):
                entries += held(bucket)
                if len(entries) >= count:
                    break
        entries.sort(key=lambda e: e.id ^ target)
        del entries[count:]
        return entries

    # --- updates -------------------------------------------------------------------------
    def add_or_update(
        self, peer: PeerID, ident: int, addrs: Iterable[Any] = (), now: float = 0.0
    ) -> PeerEntry | None:
        """Record that ``peer`` was heard from.

        Returns None when the peer is now in the table (refreshed or added), or the
        least-recently-seen entry of its full bucket: the caller should ping that one and
        call :meth:`remove` if it does not answer (the newcomer waits in the replacement cache).
        """
        if ident == self.local_id:
            return None
        addrs = tuple(addrs)
        key = peer.digest
        bucket = self._index.get(key)
        if bucket is not None:
            entry = bucket.peers.pop(key)
            if addrs:
                entry.addrs = addrs
            entry.last_seen = now
            bucket.peers[key] = entry
            bucket.last_updated = now
            return None
        while True:
            bucket = self.bucket_for(ident)
            if len(bucket.peers) < self.k:
                bucket.replacements.pop(key, None)
                bucket.peers[key] = PeerEntry(peer, ident, addrs, now)
                bucket.last_updated = now
                self._index[key] = bucket
                return None
            if bucket.covers(self.local_id) and bucket.depth < ID_BITS:
                self._split(bucket)
                continue
            old = bucket.replacements.pop(key, None)
            entry = PeerEntry(peer, ident, addrs or (old.addrs if old else ()), now)
            bucket.replacements[key] = entry
            while len(bucket.replacements) > self.replacement_cache_size:
                bucket.replacements.popitem(last=False)
            return next(iter(bucket.peers.values()))

    def remove(self, peer: PeerID) -> bool:
        """Forget a peer that stopped answering; its bucket's freshest replacement moves in."""
        key = peer.digest
        bucket = self._index.pop(key, None)
        if bucket is None:
            return any(b.replacements.pop(key, None) is not None for b in self.buckets)
        del bucket.peers[key]
        if bucket.replacements:
            rkey, repl = bucket.replacements.popitem(last=True)
            bucket.peers[rkey] = repl
            self._index[rkey] = bucket
        return True

    def _split(self, bucket: KBucket) -> None:
        mid = (bucket.lo + bucket.hi) // 2
        left = KBucket(bucket.lo, mid, bucket.depth + 1, last_updated=bucket.last_updated)
        right = KBucket(mid, bucket.hi, bucket.depth + 1, last_updated=bucket.last_updated)
        for pid, entry in bucket.peers.items():
            target = left if entry.id < mid else right
            target.peers[pid] = entry
            self._index[pid] = target
        for pid, entry in bucket.replacements.items():
            (left if entry.id < mid else right).replacements[pid] = entry
        i = self.buckets.index(bucket)
        self.buckets[i : i + 1] = [left, right]
        # a replacement may now fit in a half that has room
        for half in (left, right):
            while half.replacements and len(half.peers) < self.k:
                rkey, repl = half.replacements.popitem(last=True)
                half.peers[rkey] = repl
                self._index[rkey] = half

    # --- maintenance ---------------------------------------------------------------------
    def stale_buckets(self, now: float, max_age: float) -> list[KBucket]:
        """Buckets not updated for ``max_age`` seconds: look up a random ID in each to refresh."""
        return [b for b in self.buckets if now - b.last_updated >= max_age]

    def touch_bucket(self, ident: int, now: float) -> None:
        """Mark the bucket holding ``ident`` as refreshed (after a lookup of that ID)."""
        self.bucket_for(ident).last_updated = now


def _block_distance(bucket: KBucket, target: int) -> int:
    """The smallest XOR distance from ``target`` to any ID the bucket covers."""
    low_bits = ID_BITS - bucket.depth
    return ((bucket.lo ^ target) >> low_bits) << low_bits
