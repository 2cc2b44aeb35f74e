"""The DHT's RPC messages: building them, and checking every field of what peers send.

Everything that arrives from the network is untrusted: these parsers check types, sizes and
counts and raise :class:`p2p.errors.ProtocolError` with a reason (a handler that raises it
answers the caller with an error; a bad response counts as a failed request).

Requests (msgpack maps) all carry ``client`` (bool: a client-mode sender is never added to
routing tables) and ``addrs`` (the sender's listen addresses, text multiaddrs):

- ``dht.ping``:  {} -> {"time"}
- ``dht.store``: {"records": [[key, subkey|None, value, expiration, proof|None, cache], ...]}
  -> {"time", "results": [True | False | reason, ...]}  (False: a newer record is held)
- ``dht.find``:  {"queries": [target, ...], "count"?: n}, a target being a 32-byte node ID
  (FIND_NODE) or a key text (FIND_VALUE: nearest nodes to the key's ID plus the held records);
  ``count`` (optional, else the responder's k) caps the nearest nodes per answer: a lookup
  for a few replicas needs no more (a node that predates it answers k)
  -> {"time", "results": [[peers, records|None], ...]}, peers = [[peer_id, [addr, ...]], ...],
  records = [[subkey|None, value, expiration, proof|None], ...]
- ``dht.changes``: {"key", "since": [incarnation, number] | None, "held"?: bytes} -> {"time",
  "records", "cursor": [incarnation, number], "same"?: bytes}: the held records of ``key``
  that changed after change ``number`` of the store ``incarnation`` (all of them for None or
  another incarnation). ``held`` (optional) lists the reader's records, one
  :data:`HELD_ENTRY_BYTES` entry each (see :func:`held_to_wire`): of those changes, only the
  records newer than the reader's (or of another value) come back, and ``same`` is a bitmap
  of the entries the responder holds identically (entry i: bit i % 8 of byte i // 8). A node
  that predates ``held`` ignores it and sends every change; a reader that gets no ``same``
  takes it as "none".

Every response carries ``time``, the responder's raw local clock (see :mod:`p2p.dht.clock`).
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

from p2p.dht.ids import ID_BYTES
from p2p.dht.records import Record
from p2p.errors import IdentityError, MultiaddrError, ProtocolError
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr

PING = "dht.ping"
STORE = "dht.store"
FIND = "dht.find"
CHANGES = "dht.changes"
INCARNATION_BYTES = 8

MAX_ADDR_CHARS = 512
MAX_KEY_CHARS = 512
MAX_PROOF_BYTES = 96
HELD_ENTRY_BYTES = 20  # slot digest (8), expiration (big-endian double, 8), value digest (4)


class Cursor(NamedTuple):
    """Where a reader of ``dht.changes`` stands in one node's store."""

    incarnation: bytes
    number: int


@dataclass(frozen=True)
class Limits:
    max_addrs: int = 8
    max_records: int = 64
    max_queries: int = 64
    max_peers: int = 64  # peers per FIND result
    max_subkeys: int = 10_000  # records per FIND result
    max_value_bytes: int = 256 * 1024


class Contact(NamedTuple):
    """A peer and the addresses it can be dialed at (a named tuple: lookups make many)."""

    peer: PeerID
    addrs: tuple[str, ...] = ()  # text multiaddrs ending in /p2p/<peer>


# --- small checkers ------------------------------------------------------------------------
def _map(msg: Any, what: str) -> dict:
    if not isinstance(msg, dict):
        raise ProtocolError(f"{what} must be a map")
    return msg


def _list(value: Any, what: str, max_len: int) -> list:
    if not isinstance(value, list):
        raise ProtocolError(f"{what} must be a list")
    if len(value) > max_len:
        raise ProtocolError(f"{what} has {len(value)} items (limit {max_len})")
    return value


def _text(value: Any, what: str, max_len: int = MAX_KEY_CHARS, *, empty: bool = False) -> str:
    if not isinstance(value, str) or len(value) > max_len or (not empty and not value):
        raise ProtocolError(f"{what} must be text of 1..{max_len} characters")
    return value


def _time(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ProtocolError(f"{what} must be a finite number")
    return float(value)


def _bytes(value: Any, what: str, max_len: int) -> bytes:
    if not isinstance(value, bytes) or len(value) > max_len:
        raise ProtocolError(f"{what} must be at most {max_len} bytes")
    return value


def _peer_id(value: Any) -> PeerID:
    if not isinstance(value, bytes) or len(value) != 32:
        raise ProtocolError("peer ID must be 32 bytes")
    peer = _peer_cache.get(value)
    if peer is None:
        if len(_peer_cache) >= _CACHE_SIZE:
            _peer_cache.clear()
        peer = _peer_cache[value] = PeerID(value)
    return peer


_addr_cache: dict[str, tuple[Multiaddr, PeerID | None]] = {}
_peer_cache: dict[bytes, PeerID] = {}
_CACHE_SIZE = 8192


def _parsed(text: str) -> tuple[Multiaddr, PeerID | None]:
    """Parse and validate an address, remembering it (the same addresses recur in every FIND
    answer); returns the address to hand to a peer store, and the peer its ``/p2p/`` part
    names. A direct address is handed over without its ``/p2p/`` part (which the peer store
    drops anyway, after decoding it once more); a relayed one whole."""
    hit = _addr_cache.get(text)
    if hit is not None:
        return hit
    try:
        addr = Multiaddr.parse(text)
        named = addr.peer_id
    except (MultiaddrError, IdentityError) as e:
        raise ProtocolError(f"bad address {text[:80]!r}: {e}") from None
    if named is not None and not addr.is_relayed:
        try:
            addr = addr.transport_part()
        except MultiaddrError:
            pass  # nothing to dial: the peer store refuses it, as before
    if len(_addr_cache) >= _CACHE_SIZE:
        _addr_cache.clear()
    hit = _addr_cache[text] = (addr, named)
    return hit


def store_addrs(addrs: tuple[str, ...]) -> list[Multiaddr]:
    """Addresses that :func:`parse_addrs` accepted, parsed (once) for a peer store."""
    return [_parsed(a)[0] for a in addrs]


def parse_addrs(value: Any, peer: PeerID | None, max_addrs: int) -> tuple[str, ...]:
    """Text multiaddrs of ``peer`` (each ending in its ``/p2p/`` ID): each must parse and
    name no other peer."""
    out = []
    for text in _list(value, "addrs", max_addrs):
        # an address seen before passed these checks already (the common case: look it up)
        hit = _addr_cache.get(text) if type(text) is str else None
        if hit is None or len(text) > MAX_ADDR_CHARS:
            hit = _parsed(_text(text, "address", MAX_ADDR_CHARS))
        named = hit[1]
        if peer is not None:
            if named is None:
                text = f"{text}/p2p/{peer.to_base58()}"
            elif named.digest != peer.digest:
                raise ProtocolError("address names another peer")
        out.append(text)
    return tuple(out)


# --- requests ------------------------------------------------------------------------------
def request(client: bool, addrs: tuple[str, ...], **body: Any) -> dict:
    return {"client": client, "addrs": list(addrs), **body}


def parse_sender(msg: Any, sender: PeerID, limits: Limits) -> tuple[bool, tuple[Multiaddr, ...]]:
    """(client flag, addresses) of a request's sender."""
    msg = _map(msg, "request")
    client = msg.get("client", False)
    if not isinstance(client, bool):
        raise ProtocolError("client must be a boolean")
    return client, parse_addrs(msg.get("addrs", []), sender, limits.max_addrs)


def record_to_wire(rec: Record, cache: bool = False) -> list:
    return [rec.key, rec.subkey, rec.value, rec.expiration, rec.proof, cache]


def parse_store_request(msg: Any, limits: Limits) -> list[tuple[Record, bool]]:
    items = _list(_map(msg, "request").get("records"), "records", limits.max_records)
    out = []
    for item in items:
        if not isinstance(item, list) or len(item) != 6:
            raise ProtocolError("a record is [key, subkey, value, expiration, proof, cache]")
        key, subkey, value, exp, proof, cache = item
        if not isinstance(cache, bool):
            raise ProtocolError("cache must be a boolean")
        out.append((_record(key, subkey, value, exp, proof, limits), cache))
    return out


def _record(key: Any, subkey: Any, value: Any, exp: Any, proof: Any, limits: Limits) -> Record:
    return Record(
        _text(key, "key"),
        None if subkey is None else _text(subkey, "subkey", empty=True),
        _bytes(value, "value", limits.max_value_bytes),
        _time(exp, "expiration"),
        None if proof is None else _bytes(proof, "proof", MAX_PROOF_BYTES),
    )


def parse_find_request(msg: Any, limits: Limits) -> tuple[list[int | str], int | None]:
    """Targets: an int node ID (FIND_NODE) or a key text (FIND_VALUE); and how many nearest
    contacts the sender wants per target (None: the responder's k)."""
    out: list[int | str] = []
    body = _map(msg, "request")
    count = body.get("count")
    if count is not None and (
        isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= limits.max_peers
    ):
        raise ProtocolError(f"count must be an integer in 1..{limits.max_peers}")
    for q in _list(body.get("queries"), "queries", limits.max_queries):
        if isinstance(q, bytes) and len(q) == ID_BYTES:
            out.append(int.from_bytes(q, "big"))
        elif isinstance(q, str):
            out.append(_text(q, "key"))
        else:
            raise ProtocolError("a query is a 32-byte ID or a key")
    return out, count


def query_to_wire(q: int | str) -> bytes | str:
    return q if isinstance(q, str) else q.to_bytes(ID_BYTES, "big")


# --- responses -----------------------------------------------------------------------------
def response(now: float, **body: Any) -> dict:
    return {"time": now, **body}


def parse_time(msg: Any) -> float:
    return _time(_map(msg, "response").get("time"), "time")


def parse_store_response(msg: Any, count: int) -> list[bool | str]:
    results = _list(_map(msg, "response").get("results"), "results", count)
    if len(results) != count:
        raise ProtocolError("one result per record expected")
    out: list[bool | str] = []
    for r in results:
        if isinstance(r, bool):
            out.append(r)
        elif isinstance(r, str):
            out.append(r[:500])
        else:
            raise ProtocolError("a store result is a boolean or a reason")
    return out


def find_result_to_wire(peers: list[Contact], records: list[Record] | None) -> list:
    return [
        [[c.peer.digest, list(c.addrs)] for c in peers],
        None if records is None else [[r.subkey, r.value, r.expiration, r.proof] for r in records],
    ]


def parse_find_response(
    msg: Any, queries: list[int | str], limits: Limits
) -> list[tuple[list[Contact], list[Record] | None]]:
    results = _list(_map(msg, "response").get("results"), "results", len(queries))
    if len(results) != len(queries):
        raise ProtocolError("one result per query expected")
    out = []
    for q, res in zip(queries, results, strict=True):
        if not isinstance(res, list) or len(res) != 2:
            raise ProtocolError("a find result is [peers, records]")
        contacts = []
        for item in _list(res[0], "peers", limits.max_peers):
            if not isinstance(item, list) or len(item) != 2:
                raise ProtocolError("a peer is [peer_id, addrs]")
            pid = _peer_id(item[0])
            contacts.append(Contact(pid, parse_addrs(item[1], pid, limits.max_addrs)))
        records = None
        if res[1] is not None:
            if not isinstance(q, str):
                raise ProtocolError("records answered to a node query")
            records = []
            for item in _list(res[1], "records", limits.max_subkeys):
                if not isinstance(item, list) or len(item) != 4:
                    raise ProtocolError("a record is [subkey, value, expiration, proof]")
                records.append(_record(q, *item, limits))
        out.append((contacts, records))
    return out


# --- dht.changes ---------------------------------------------------------------------------
class Held(NamedTuple):
    """One record a reader holds, as it names it in ``dht.changes``."""

    expiration: float
    tag: bytes  # a digest of the value


def slot_digest(subkey: str | None) -> bytes:
    """8 bytes naming a slot of a key (the plain value's differs from every subkey's)."""
    raw = b"\x00" if subkey is None else b"\x01" + subkey.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=8).digest()


def held_entry(rec: Record) -> tuple[bytes, Held]:
    return slot_digest(rec.subkey), Held(
        rec.expiration, hashlib.blake2b(rec.value, digest_size=4).digest()
    )


def held_to_wire(records: list[Record]) -> bytes:
    """The ``held`` field naming ``records`` (one per slot), in their order."""
    out = bytearray()
    for rec in records:
        slot, held = held_entry(rec)
        out += slot + struct.pack(">d", held.expiration) + held.tag
    return bytes(out)


def parse_held(value: Any, max_entries: int) -> list[tuple[bytes, Held]]:
    if not isinstance(value, bytes) or len(value) % HELD_ENTRY_BYTES:
        raise ProtocolError(f"held must be bytes, {HELD_ENTRY_BYTES} per entry")
    if len(value) > max_entries * HELD_ENTRY_BYTES:
        raise ProtocolError(f"held names over {max_entries} records")
    out = []
    for i in range(0, len(value), HELD_ENTRY_BYTES):
        (exp,) = struct.unpack_from(">d", value, i + 8)
        if not math.isfinite(exp):
            raise ProtocolError("a held expiration must be finite")
        out.append((value[i : i + 8], Held(exp, value[i + 16 : i + HELD_ENTRY_BYTES])))
    return out


def parse_changes_request(
    msg: Any, max_held: int = 10_000
) -> tuple[str, Cursor | None, list[tuple[bytes, Held]] | None]:
    body = _map(msg, "request")
    key = _text(body.get("key"), "key")
    since = body.get("since")
    held = body.get("held")
    return (
        key,
        None if since is None else _cursor(since),
        None if held is None else parse_held(held, max_held),
    )


def _cursor(value: Any) -> Cursor:
    if not isinstance(value, list) or len(value) != 2:
        raise ProtocolError("a cursor is [incarnation, number]")
    incarnation, number = value
    if not isinstance(incarnation, bytes) or len(incarnation) != INCARNATION_BYTES:
        raise ProtocolError(f"a cursor's incarnation must be {INCARNATION_BYTES} bytes")
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < 1 << 63:
        raise ProtocolError("a cursor's number must be a non-negative integer")
    return Cursor(incarnation, number)


def changes_to_wire(records: list[Record], cursor: Cursor, same: list[bool] | None = None) -> dict:
    body: dict[str, Any] = {
        "records": [[r.subkey, r.value, r.expiration, r.proof] for r in records],
        "cursor": [cursor.incarnation, cursor.number],
    }
    if same is not None:
        bits = bytearray((len(same) + 7) // 8)
        for i, yes in enumerate(same):
            if yes:
                bits[i // 8] |= 1 << (i % 8)
        body["same"] = bytes(bits)
    return body


def parse_changes_response(
    msg: Any, key: str, limits: Limits, held: int = 0
) -> tuple[list[Record], Cursor, list[bool]]:
    """The records, the next cursor, and for each of the ``held`` entries the request named,
    whether the responder holds that very record (all False from a node that predates it)."""
    body = _map(msg, "response")
    records = []
    for item in _list(body.get("records"), "records", limits.max_subkeys):
        if not isinstance(item, list) or len(item) != 4:
            raise ProtocolError("a record is [subkey, value, expiration, proof]")
        records.append(_record(key, *item, limits))
    bits = body.get("same")
    if bits is None:
        same = [False] * held
    else:
        if not isinstance(bits, bytes) or len(bits) != (held + 7) // 8:
            raise ProtocolError(f"same must be a bitmap of {held} entries")
        same = [bool(bits[i // 8] >> (i % 8) & 1) for i in range(held)]
    return records, _cursor(body.get("cursor")), same
