"""DHT records, their serialization, ordering and merge rules (pure).

A record is ``(key, subkey, value, expiration, proof)``: ``value`` is the msgpack encoding of
any msgpack-able object, ``expiration`` an absolute DHT time (seconds), ``subkey`` is None for
a plain value or names one entry of a dictionary value, and ``proof`` is None or the writer's
32-byte Ed25519 public key followed by its 64-byte signature (see :mod:`p2p.dht.validation`).

Merge rules (the same on every node, so replicas converge whatever the order of arrival):
- a record replaces another of the same (key, subkey) when it expires later; equal expirations
  are broken by the larger value bytes, so every node keeps the same winner;
- a key shows its plain value when no subkey expires after it, otherwise the subkeys that expire
  after the plain value (all of them when there is none): later expiration always wins.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgpack

from p2p.identity import PeerID

OWNER_MARKER_RE = re.compile(r"\[owner:([^\]]*)\]")


@dataclass(frozen=True, slots=True)
class Record:
    key: str
    subkey: str | None
    value: bytes
    expiration: float
    proof: bytes | None = None

    def sort_key(self) -> tuple[float, bytes]:
        return (self.expiration, self.value)

    def newer_than(self, other: Record) -> bool:
        return self.sort_key() > other.sort_key()

    def same_as(self, other: Record) -> bool:
        return self.sort_key() == other.sort_key()

    def decoded(self) -> Any:
        return unpack_value(self.value)


# What a reader sees of one key: a plain record, or a dictionary of subkey -> record.
View: TypeAlias = "Record | dict[str, Record]"


@dataclass(frozen=True, slots=True)
class ValueWithExpiration:
    """What ``get`` returns for a plain value, and for each subkey of a dictionary value."""

    value: Any
    expiration: float


def decode_view(view: View | None) -> ValueWithExpiration | dict[str, ValueWithExpiration] | None:
    """Readers' form of a view: decoded values with their expirations."""
    if view is None:
        return None
    if isinstance(view, Record):
        return ValueWithExpiration(view.decoded(), view.expiration)
    return {s: ValueWithExpiration(r.decoded(), r.expiration) for s, r in sorted(view.items())}


def pack_value(value: Any) -> bytes:
    """Serialize a value; raises TypeError for something msgpack cannot encode."""
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"DHT values must be msgpack-able: {e}") from None


def unpack_value(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def signing_payload(key: str, subkey: str | None, value: bytes, expiration: float) -> bytes:
    """The bytes an owner signs: every field that decides what readers see."""
    return msgpack.packb(
        ["p2p-dht-record/v1", key, subkey, value, float(expiration)], use_bin_type=True
    )


def owner_marker(peer: PeerID) -> str:
    """The text that, inside a key or subkey, reserves it to ``peer`` (writes must be signed)."""
    return f"[owner:{peer.to_base58()}]"


def owner_markers(text: str | None) -> list[str]:
    """The base58 peer IDs named by owner markers in ``text`` (not yet validated)."""
    return OWNER_MARKER_RE.findall(text) if text else []


@functools.lru_cache(maxsize=1 << 14)
def slot_owner(key: str, subkey: str | None) -> str | None:
    """The owner (base58) a record of this slot is charged to: the subkey's marker, else the
    key's; None for an unowned slot. Validation has made sure that every marker is signed."""
    names = owner_markers(subkey) or owner_markers(key)
    return names[0] if names else None


def key_owned(key: str) -> bool:
    """Whether the key itself is reserved to one writer (who may then write anything in it)."""
    return slot_owner(key, None) is not None


@dataclass
class KeyState:
    """Everything held for one key: the newest plain record and the newest record per subkey.

    Superseded slots are kept (not deleted) so that the visible value is a function of the
    set of records received, whatever their order: replicas converge.
    """

    plain: Record | None = None
    subs: dict[str, Record] = field(default_factory=dict)
    nbytes: int = 0  # approximate memory held (values, subkeys, proofs)
    soonest: float = math.inf  # no slot expires before this (a lower bound)
    owned_subs: int = 0  # subkeys with an owner marker (signed)
    owned_key: bool = False  # the key itself names an owner (set by the first record)
    by_owner: dict[str, list[int]] = field(default_factory=dict)
    """owner (base58) -> [slots, bytes] this key holds for that writer."""
    ledger: dict[str, list[int]] | None = None
    """The same, summed over every key of a store (shared with the store), or None."""

    def _charge(self, rec: Record, sign: int, size: int) -> None:
        """Account a slot taken (sign 1), given back (-1) or resized (0, ``size`` the delta)."""
        self.nbytes += size
        owner = slot_owner(rec.key, rec.subkey)
        if owner is None:
            return
        if sign and rec.subkey is not None and owner_markers(rec.subkey):
            self.owned_subs += sign
        for table in (self.by_owner, self.ledger):
            if table is None:
                continue
            entry = table.setdefault(owner, [0, 0])
            entry[0] += sign
            entry[1] += size
            if entry[0] <= 0:
                del table[owner]

    def apply(self, rec: Record, max_subkeys: int) -> bool:
        """Take ``rec`` into its slot if newer; True when it is now part of the visible value."""
        if self.plain is None and not self.subs:
            self.owned_key = key_owned(rec.key)
        if rec.subkey is None:
            if self.plain is None:
                self.plain = rec
                self._charge(rec, 1, record_size(rec))
            elif rec.newer_than(self.plain):
                self._charge(rec, 0, record_size(rec) - record_size(self.plain))
                self.plain = rec
            elif not rec.same_as(self.plain):
                return False
        else:
            old = self.subs.get(rec.subkey)
            if old is None:
                if len(self.subs) >= max_subkeys:
                    return False
                self.subs[rec.subkey] = rec
                self._charge(rec, 1, record_size(rec))
            elif rec.newer_than(old):
                self.subs[rec.subkey] = rec
                self._charge(rec, 0, record_size(rec) - record_size(old))
            elif not rec.same_as(old):
                return False
        self.soonest = min(self.soonest, rec.expiration)
        return self.visible(rec)

    def _shields(self) -> bool:
        """Whether signed subkeys are immune to the plain value: anyone may write the plain
        value of an unowned key, so it must not hide what owners signed (one long-lived
        junk value would blank a run's progress table for days)."""
        return self.owned_subs > 0 and not self.owned_key

    def view(self) -> View | None:
        """A plain value wins when no subkey expires after it; otherwise the subkeys that do,
        and, in an unowned key, every signed subkey whatever the plain value."""
        plain = self.plain
        shields = self._shields()
        if (
            plain is not None
            and not shields
            and all(r.expiration <= plain.expiration for r in self.subs.values())
        ):
            return plain
        floor = plain.expiration if plain is not None else float("-inf")
        subs = {
            s: r
            for s, r in self.subs.items()
            if r.expiration > floor or (shields and owner_markers(s))
        }
        return subs or None

    def visible(self, rec: Record) -> bool:
        """Whether ``rec`` is part of :meth:`view`, without building it: a subkey's record is
        when it is held and outlives the plain value (building the view for each store made
        a key with hundreds of subkeys cost the square of their number)."""
        if rec.subkey is None:
            view = self.view()
            return isinstance(view, Record) and (view is rec or view.same_as(rec))
        held = self.subs.get(rec.subkey)
        if held is None or not held.same_as(rec):
            return False
        if self.plain is None or held.expiration > self.plain.expiration:
            return True
        return bool(owner_markers(rec.subkey)) and self._shields()

    def records(self) -> list[Record]:
        """The record of every slot (expired ones included until dropped)."""
        return [r for r in (self.plain, *self.subs.values()) if r is not None]

    def held(self) -> int:
        """How many slots hold a record (expired ones included until dropped)."""
        return len(self.subs) + (self.plain is not None)

    def lapsing(self, now: float) -> bool:
        """Whether some slot has expired by ``now`` (a scan only once :attr:`soonest` passed,
        and :meth:`drop_expired` then moves that bound up)."""
        if now < self.soonest:
            return False
        return any(r.expiration <= now for r in (self.plain, *self.subs.values()) if r is not None)

    def expired(self, now: float) -> list[Record]:
        """The records of the slots that have expired by ``now``."""
        if now < self.soonest:
            return []
        return [
            r for r in (self.plain, *self.subs.values()) if r is not None and r.expiration <= now
        ]

    def drop(self, records: list[Record]) -> None:
        """Forget the slots these records hold (a slot since refreshed is kept)."""
        if not records:
            return  # (a follower calls this on every read, mostly with nothing)
        for rec in records:
            if rec.subkey is None:
                if self.plain is rec:
                    self._charge(rec, -1, -record_size(rec))
                    self.plain = None
            elif self.subs.get(rec.subkey) is rec:
                self._charge(rec, -1, -record_size(self.subs.pop(rec.subkey)))
        self._reset_soonest()

    def release(self) -> None:
        """Give every slot back to the shared ledger (the whole key is being forgotten)."""
        if self.ledger is not None:
            for owner, (slots, nbytes) in self.by_owner.items():
                entry = self.ledger.get(owner)
                if entry is not None:
                    entry[0] -= slots
                    entry[1] -= nbytes
                    if entry[0] <= 0:
                        del self.ledger[owner]
        self.by_owner.clear()

    def drop_expired(self, now: float) -> bool:
        """Forget expired slots; True when nothing is left."""
        if now >= self.soonest:
            expired = self.expired(now)
            if expired:
                self.drop(expired)
            else:
                self._reset_soonest()  # the bound was low: move it up
        return self.plain is None and not self.subs

    def _reset_soonest(self) -> None:
        self.soonest = min(
            (r.expiration for r in (self.plain, *self.subs.values()) if r is not None),
            default=math.inf,
        )


def record_size(rec: Record) -> int:
    """Approximate bytes a stored record holds (for the store's memory bound)."""
    return 100 + len(rec.key) + len(rec.subkey or "") + len(rec.value) + len(rec.proof or b"")


def view_records(view: View | None) -> list[Record]:
    if view is None:
        return []
    return [view] if isinstance(view, Record) else list(view.values())


def merge_views(records: list[Record], max_subkeys: int = 1 << 30) -> View | None:
    """The value readers see after receiving ``records`` (in any order)."""
    state = KeyState()
    for rec in records:
        state.apply(rec, max_subkeys)
    return state.view()
