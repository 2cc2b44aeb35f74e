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
from dataclasses import dataclass

from p2p.dht.records import (
    KeyState,
    Record,
    View,
    key_owned,
    record_size,
    slot_owner,
    view_records,
)


@dataclass(frozen=True)
class WriterQuotas:
    """What one writer (the peer an ``[owner:ID]`` marker names, proven by its signature) may
    hold in one store, so that no writer can fill a key that others share, or the node.

    Unowned subkeys have no provable writer: together they get a share of each key
    (``max_unowned_subkeys``), so junk cannot take the room of signed subkeys.
    """

    subkeys_per_key: int = 64
    bytes_per_key: int = 1 << 20
    records_per_node: int = 4096
    bytes_per_node: int = 16 << 20
    max_unowned_subkeys: int = 1024


class LocalStorage:
    def __init__(
        self,
        max_keys: int = 100_000,
        max_subkeys: int = 10_000,
        lru: bool = False,
        max_bytes: int = 256 << 20,
        quotas: WriterQuotas = WriterQuotas(),
    ) -> None:
        self.max_keys = max_keys
        self.max_subkeys = max_subkeys
        self.max_bytes = max_bytes
        self.lru = lru
        self.quotas = quotas
        self.nbytes = 0  # approximate bytes held by all keys
        self.writers: dict[str, list[int]] = {}  # owner -> [slots, bytes] over all keys
        self._purged_at = float("-inf")
        self._data: OrderedDict[str, KeyState] = OrderedDict()
        self._received: dict[str, float] = {}  # key -> last time a STORE brought it
        self.incarnation = os.urandom(8)
        self.seq = 0  # the number of the latest change, over all keys
        self._changed: dict[str, dict[str | None, int]] = {}  # key -> slot -> change number

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def refusal(self, rec: Record, now: float) -> str | None:
        """Why ``rec`` may not take a slot here (told to the writer), or None.

        A record replacing its own slot is charged only for the bytes it adds.
        """
        state = self._live(rec.key, now)
        slots = state.subs if state is not None else {}
        old = (state.plain if rec.subkey is None else slots.get(rec.subkey)) if state else None
        if rec.subkey is None and state is not None and state.owned_subs and not key_owned(rec.key):
            return (
                f"key {rec.key!r:.80} holds {state.owned_subs} signed subkeys: a plain "
                "value may not replace them (write your own [owner:ID] subkey)"
            )
        owner = slot_owner(rec.key, rec.subkey)
        q = self.quotas
        if owner is None:
            if old is None and rec.subkey is not None and state is not None:
                unowned = len(slots) - state.owned_subs
                if unowned >= q.max_unowned_subkeys:
                    return (
                        f"key {rec.key!r:.80} holds {unowned} unsigned subkeys, the most "
                        "allowed (signed [owner:ID] subkeys still have room)"
                    )
            return None
        if old is None and rec.subkey is not None and len(slots) >= self.max_subkeys:
            return f"key {rec.key!r:.80} holds {len(slots)} subkeys, the most allowed"
        added = record_size(rec) - (record_size(old) if old is not None else 0)
        mine = state.by_owner.get(owner, [0, 0]) if state is not None else [0, 0]
        new_slot = old is None
        total = self.writers.get(owner, [0, 0])
        over = (new_slot and total[0] >= q.records_per_node) or total[1] + added > q.bytes_per_node
        if over and now >= self._purged_at + 1.0:
            # records expire lazily: count only live ones before refusing (purging at most
            # once a second, so a writer at its quota cannot make every store scan the node)
            self._purged_at = now
            self.purge(now)
            total = self.writers.get(owner, [0, 0])
        if new_slot and mine[0] >= q.subkeys_per_key:
            return f"writer {owner:.16} holds {mine[0]} slots of key {rec.key!r:.80} (quota)"
        if mine[1] + added > q.bytes_per_key:
            return f"writer {owner:.16} would hold over {q.bytes_per_key} bytes of one key"
        if new_slot and total[0] >= q.records_per_node:
            return f"writer {owner:.16} holds {total[0]} records on this node (quota)"
        if total[1] + added > q.bytes_per_node:
            return f"writer {owner:.16} would hold over {q.bytes_per_node} bytes on this node"
        return None

    def offer(self, rec: Record, now: float) -> bool | str:
        """Apply a record: True when it is part of the key's visible value afterwards, False
        when it is outdated (or the store is full), the reason when refused."""
        if rec.expiration <= now:
            return False
        reason = self.refusal(rec, now)
        if reason is not None:
            return reason
        return self._store(rec, now)

    def store(self, rec: Record, now: float) -> bool:
        """Apply a record; True when it is part of the key's visible value afterwards."""
        return self.offer(rec, now) is True

    def _store(self, rec: Record, now: float) -> bool:
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
            state = self._data[rec.key] = KeyState(ledger=self.writers)
        elif self.lru:
            self._data.move_to_end(rec.key)
        before = state.nbytes
        held = state.apply(rec, self.max_subkeys)
        self.nbytes += state.nbytes - before
        if state.plain is None and not state.subs:
            state.release()
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

    def slot_records(self, key: str, now: float) -> list[Record]:
        """The live record of each slot of ``key`` (superseded ones included: what a reader
        that merges them holds)."""
        state = self._live(key, now)
        return [] if state is None else state.records()

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
            state.release()
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
