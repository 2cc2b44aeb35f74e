"""A node's local record store (pure: time is passed in).

Keys hold a :class:`~p2p.dht.records.KeyState` (plain record and/or subkey records; see
:mod:`p2p.dht.records` for the merge rules). Expired records are never returned; they are
dropped lazily and by :meth:`LocalStorage.purge`. The same class serves as the cache of values
seen along lookup paths, with ``lru=True``: a full cache forgets its least recently used key
instead of refusing new ones.

Every change of a record slot (a key's plain record, or one subkey) gets the next number of a
per-store sequence; :meth:`LocalStorage.changes` answers "what changed since number n", which
lets a reader that polls a big, often-updated dictionary (a run's progress table) fetch only
what is new (``dht.changes``, :class:`p2p.dht.follow.KeyFollower`). The store's random
``incarnation`` tells a reader when numbers restarted (a restarted node).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator

from p2p.dht.records import KeyState, Record, View, record_size, view_records


class LocalStorage:
    def __init__(
        self,
        max_keys: int = 100_000,
        max_subkeys: int = 10_000,
        lru: bool = False,
        max_bytes: int = 256 << 20,
    ) -> None:
        self.max_keys = max_keys
        self.max_subkeys = max_subkeys
        self.max_bytes = max_bytes
        self.lru = lru
        self.nbytes = 0  # approximate bytes held by all keys
        self._data: OrderedDict[str, KeyState] = OrderedDict()
        self._received: dict[str, float] = {}  # key -> last time a STORE brought it
        self.incarnation = os.urandom(8)
        self.seq = 0  # the number of the latest change, over all keys
        self._changed: dict[str, dict[str | None, int]] = {}  # key -> slot -> change number

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def store(self, rec: Record, now: float) -> bool:
        """Apply a record; True when it is part of the key's visible value afterwards."""
        if rec.expiration <= now:
            return False
        state = self._live(rec.key, now)
        if state is None and len(self._data) >= self.max_keys:
            self.purge(now)
            if len(self._data) >= self.max_keys and not self._evict_lru(rec.key):
                return False
        if self.nbytes + record_size(rec) > self.max_bytes:
            self.purge(now)
            while self.nbytes + record_size(rec) > self.max_bytes:
                if not self._evict_lru(rec.key):
                    return False
            state = self._live(rec.key, now)
        if state is None:
            state = self._data[rec.key] = KeyState()
        elif self.lru:
            self._data.move_to_end(rec.key)
        before = state.nbytes
        held = state.apply(rec, self.max_subkeys)
        self.nbytes += state.nbytes - before
        if state.plain is None and not state.subs:
            del self._data[rec.key]
        elif (state.plain if rec.subkey is None else state.subs.get(rec.subkey)) is rec:
            self.seq += 1  # the slot took this record
            self._changed.setdefault(rec.key, {})[rec.subkey] = self.seq
        if held:
            self._received[rec.key] = now
        return held

    def changes(
        self, key: str, since: int, now: float, max_bytes: int, max_records: int = 1 << 30
    ) -> tuple[list[Record], int]:
        """Live records of ``key`` whose slot changed after change number ``since``, oldest
        change first, about ``max_bytes`` of them at most (one at least); and the number to
        ask from next time (the store's current one once everything was returned)."""
        state = self._live(key, now)
        changed = self._changed.get(key)
        if state is None or not changed:
            return [], self.seq
        out: list[Record] = []
        size = 0
        for n, slot in sorted((n, slot) for slot, n in changed.items() if n > since):
            rec = state.plain if slot is None else state.subs.get(slot)
            if rec is None:
                continue  # expired meanwhile
            size += record_size(rec)
            if out and (size > max_bytes or len(out) == max_records):
                return out, n - 1
            out.append(rec)
        return out, self.seq

    def _evict_lru(self, keep: str) -> bool:
        """In a cache, forget the least recently used key (not ``keep``); False otherwise."""
        if not self.lru:
            return False
        for key in self._data:
            if key != keep:
                self.remove(key)
                return True
        return False

    def get(self, key: str, now: float) -> View | None:
        """The visible value of ``key`` (a dictionary is a fresh copy)."""
        state = self._live(key, now)
        if state is None:
            return None
        if self.lru:
            self._data.move_to_end(key)
        return state.view()

    def remove(self, key: str) -> bool:
        """Forget a key (a node that lost its data, or an operator clearing it)."""
        self._received.pop(key, None)
        self._changed.pop(key, None)
        state = self._data.pop(key, None)
        if state is not None:
            self.nbytes -= state.nbytes
        return state is not None

    def last_received(self, key: str) -> float | None:
        return self._received.get(key)

    def held_keys(self) -> list[str]:
        return list(self._data)

    def records(self, now: float) -> Iterator[Record]:
        """Every visible live record (republishing and handing values to new nodes)."""
        for key in list(self._data):
            state = self._live(key, now)
            if state is not None:
                yield from view_records(state.view())

    def purge(self, now: float) -> int:
        """Drop expired records; returns how many keys disappeared."""
        gone = 0
        for key in list(self._data):
            if self._live(key, now) is None:
                gone += 1
        return gone

    def _live(self, key: str, now: float) -> KeyState | None:
        state = self._data.get(key)
        if state is None:
            return None
        before = state.nbytes
        empty = state.drop_expired(now)
        self.nbytes += state.nbytes - before
        if empty:
            del self._data[key]
            self._received.pop(key, None)
            self._changed.pop(key, None)
            return None
        if before != state.nbytes:  # slots expired: forget their change numbers
            changed = self._changed.get(key)
            if changed:
                for slot in [s for s in changed if s is not None and s not in state.subs]:
                    del changed[slot]
                if None in changed and state.plain is None:
                    del changed[None]
        return state
