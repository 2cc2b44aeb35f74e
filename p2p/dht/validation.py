"""Pluggable record validators: signed (owned) records and value schemas.

Every record a node accepts, from a local ``store`` call, a STORE request, or a FIND answer,
goes through :class:`ValidatorChain`. A validator raises :class:`InvalidRecordError` with a
reason; a STORE answers that reason to the writer, and a FIND answer with an invalid record
has that record dropped.

Owned records: a key or subkey containing ``[owner:<peer-id-base58>]`` (see
:func:`p2p.dht.records.owner_marker`) can only be written by that peer. Its record carries a
proof = the owner's raw Ed25519 public key (32 bytes) + signature (64 bytes) over
:func:`p2p.dht.records.signing_payload` ``(key, subkey, value, expiration)``; the public key must
hash to the named peer ID. The collaboration stores its progress reports under one key with
subkey ``owner_marker(peer_id)``, so nobody can overwrite another peer's report. Replaying an old
signed record is harmless: it expires before the owner's newer one and loses the merge.

The same signed record reaches a node many times (every read of a key with many owned subkeys
brings all of them, from several replicas, then repairs and caches send them on), so verdicts
are kept in a bounded :class:`VerifiedSignatures` cache keyed by the exact signed bytes: public
key, signature and payload. A changed value, expiration, key or subkey is a different payload
and is verified afresh, so the cache saves work without accepting anything new.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from p2p.dht.errors import InvalidRecordError
from p2p.dht.records import Record, owner_markers, pack_value, signing_payload, unpack_value
from p2p.errors import IdentityError
from p2p.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, PeerID, verify_signature

PROOF_BYTES = PUBLIC_KEY_BYTES + SIGNATURE_BYTES


@runtime_checkable
class RecordValidator(Protocol):
    def validate(self, record: Record) -> None:
        """Raise InvalidRecordError(reason) when the record must be refused."""


def record_owner(record: Record) -> PeerID | None:
    """The peer named by the record's owner markers, or None; malformed markers are refused."""
    names = set(owner_markers(record.key)) | set(owner_markers(record.subkey))
    if not names:
        return None
    if len(names) > 1:
        raise InvalidRecordError("key and subkey name different owners")
    (name,) = names
    try:
        return _owner_id(name)
    except IdentityError:
        raise InvalidRecordError(f"malformed owner marker {name!r:.80}") from None


@functools.lru_cache(maxsize=4096)
def _owner_id(name: str) -> PeerID:
    """Parsed owner names (the same few recur in every record; base58 is slow in Python)."""
    return PeerID.from_base58(name)


def sign_record(record: Record, identity: Identity) -> Record:
    """The record with a proof made by ``identity``."""
    sig = identity.sign(signing_payload(record.key, record.subkey, record.value, record.expiration))
    return Record(
        record.key, record.subkey, record.value, record.expiration, identity.public_key + sig
    )


class VerifiedSignatures:
    """A bounded LRU of Ed25519 verdicts, keyed by (public key, signature, signed payload).

    Verification is a pure function of those bytes, so a verdict can be reused by any node in
    the process (the simulator runs hundreds in one). Wrong verdicts are kept too: a replayed
    forgery costs a dictionary lookup instead of a verification.
    """

    def __init__(self, max_entries: int = 1 << 16) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be positive")
        self.max_entries = max_entries
        self._verdicts: OrderedDict[tuple[bytes, bytes, bytes], bool] = OrderedDict()
        # Several collaborations in one process run their trio loops in their own bridge
        # threads and share this cache.
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._verdicts)

    def verify(self, public_key: bytes, signature: bytes, payload: bytes) -> bool:
        ident = (public_key, signature, payload)
        with self._lock:
            ok = self._verdicts.get(ident)
            if ok is not None:
                self.hits += 1
                self._verdicts.move_to_end(ident)
                return ok
            self.misses += 1
        ok = verify_signature(public_key, signature, payload)
        with self._lock:
            self._verdicts[ident] = ok
            if len(self._verdicts) > self.max_entries:
                self._verdicts.popitem(last=False)
        return ok


# One per process: each verdict is checked once whichever node meets the record first.
SHARED_SIGNATURES = VerifiedSignatures()


class SignatureValidator:
    """Owned keys/subkeys need a valid signature of their owner (always on)."""

    def __init__(self, verdicts: VerifiedSignatures | None = None) -> None:
        self.verdicts = SHARED_SIGNATURES if verdicts is None else verdicts

    def validate(self, record: Record) -> None:
        owner = record_owner(record)
        if owner is None:
            return
        proof = record.proof
        if proof is None:
            raise InvalidRecordError(f"record owned by {owner} is not signed")
        if len(proof) != PROOF_BYTES:
            raise InvalidRecordError("malformed signature proof")
        pub, sig = proof[:PUBLIC_KEY_BYTES], proof[PUBLIC_KEY_BYTES:]
        if not owner.matches(pub):
            raise InvalidRecordError(f"record owned by {owner} is signed by another key")
        payload = signing_payload(record.key, record.subkey, record.value, record.expiration)
        if not self.verdicts.verify(pub, sig, payload):
            raise InvalidRecordError(f"bad signature on record owned by {owner}")


@dataclass(frozen=True)
class LimitsValidator:
    """Basic field bounds every record must meet (the node's own limits)."""

    max_key_chars: int = 512
    max_value_bytes: int = 256 * 1024

    def validate(self, record: Record) -> None:
        if not record.key or len(record.key) > self.max_key_chars:
            raise InvalidRecordError(f"key must have 1..{self.max_key_chars} characters")
        if record.subkey is not None and len(record.subkey) > self.max_key_chars:
            raise InvalidRecordError(f"subkey longer than {self.max_key_chars} characters")
        if len(record.value) > self.max_value_bytes:
            raise InvalidRecordError(f"value larger than {self.max_value_bytes} bytes")
        if not math.isfinite(record.expiration):
            raise InvalidRecordError("expiration must be finite")
        if record.proof is not None and len(record.proof) != PROOF_BYTES:
            raise InvalidRecordError("malformed signature proof")
        try:
            unpack_value(record.value)
        except (ValueError, TypeError, RecursionError) as e:  # msgpack's errors, bad map keys
            raise InvalidRecordError(f"value is not valid msgpack: {e!r:.100}") from None


# --- schemas ---------------------------------------------------------------------------------
class Spec(Protocol):
    def check(self, value: Any, path: str) -> str | None:
        """None when ``value`` fits, otherwise a reason."""


@dataclass(frozen=True)
class AnyValue:
    def check(self, value: Any, path: str) -> str | None:
        return None


@dataclass(frozen=True)
class Int:
    min: int | None = None
    max: int | None = None

    def check(self, value: Any, path: str) -> str | None:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{path} must be an integer"
        return _bounds(value, self.min, self.max, path)


@dataclass(frozen=True)
class Float:
    """A finite number (integers accepted)."""

    min: float | None = None
    max: float | None = None

    def check(self, value: Any, path: str) -> str | None:
        if not isinstance(value, int | float) or isinstance(value, bool):
            return f"{path} must be a number"
        if not math.isfinite(value):
            return f"{path} must be finite"
        return _bounds(value, self.min, self.max, path)


@dataclass(frozen=True)
class Bool:
    def check(self, value: Any, path: str) -> str | None:
        return None if isinstance(value, bool) else f"{path} must be a boolean"


@dataclass(frozen=True)
class Str:
    max_len: int = 1024

    def check(self, value: Any, path: str) -> str | None:
        if not isinstance(value, str):
            return f"{path} must be a string"
        return f"{path} longer than {self.max_len}" if len(value) > self.max_len else None


@dataclass(frozen=True)
class Bytes:
    max_len: int = 65536

    def check(self, value: Any, path: str) -> str | None:
        if not isinstance(value, bytes):
            return f"{path} must be bytes"
        return f"{path} longer than {self.max_len}" if len(value) > self.max_len else None


@dataclass(frozen=True)
class OneOf:
    """One of a few fixed values (e.g. a mode name)."""

    choices: tuple[Any, ...]

    def check(self, value: Any, path: str) -> str | None:
        if any(type(value) is type(c) and value == c for c in self.choices):
            return None
        return f"{path} must be one of {', '.join(map(repr, self.choices))}"


@dataclass(frozen=True)
class Optional:
    inner: Spec

    def check(self, value: Any, path: str) -> str | None:
        return None if value is None else self.inner.check(value, path)


@dataclass(frozen=True)
class ListOf:
    item: Spec
    max_len: int = 1024

    def check(self, value: Any, path: str) -> str | None:
        if not isinstance(value, list):
            return f"{path} must be a list"
        if len(value) > self.max_len:
            return f"{path} has more than {self.max_len} items"
        for i, v in enumerate(value):
            if (reason := self.item.check(v, f"{path}[{i}]")) is not None:
                return reason
        return None


@dataclass(frozen=True)
class Tuple:
    """A list of fixed length whose items fit ``items`` in order (msgpack has no tuples)."""

    items: tuple[Spec, ...]

    def check(self, value: Any, path: str) -> str | None:
        if not isinstance(value, list) or len(value) != len(self.items):
            return f"{path} must be a list of {len(self.items)} items"
        for i, (v, spec) in enumerate(zip(value, self.items, strict=True)):
            if (reason := spec.check(v, f"{path}[{i}]")) is not None:
                return reason
        return None


_FIELD_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


@dataclass(frozen=True)
class Struct:
    """A map with named fields; ``optional`` fields may be missing.

    Fields it does not name are refused, except, with ``newer`` > 0, up to that many whose
    names are short lower-case identifiers and whose values pack to ``newer_bytes`` at most in
    all: fields a newer version of the record added. A node of this version then stores and
    passes on a newer peer's record (readers ignore what they do not know) where a strict
    schema kept it off every older node; the bounds keep it from carrying bulk or markup."""

    fields: Mapping[str, Spec]
    optional: frozenset[str] = field(default_factory=frozenset)
    newer: int = 0
    newer_bytes: int = 512

    def check(self, value: Any, path: str) -> str | None:
        if not isinstance(value, dict):
            return f"{path} must be a map"
        extra = [k for k in value if k not in self.fields]
        if extra and (reason := self._newer(value, extra, path)) is not None:
            return reason
        for name, spec in self.fields.items():
            if name not in value:
                if name in self.optional:
                    continue
                return f"{path}.{name} is missing"
            if (reason := spec.check(value[name], f"{path}.{name}")) is not None:
                return reason
        return None

    def _newer(self, value: dict, extra: list[Any], path: str) -> str | None:
        unknown = f"{path} has unknown field {str(extra[0])[:64]!r}"
        if len(extra) > self.newer:
            return unknown if self.newer == 0 else f"{unknown} (over {self.newer} unknown)"
        for k in extra:
            if not isinstance(k, str) or _FIELD_NAME.fullmatch(k) is None:
                return f"{path} has a field named {str(k)[:64]!r}, not a lower-case identifier"
        size = sum(len(pack_value(value[k])) for k in extra)
        if size > self.newer_bytes:
            return f"{path}'s unknown fields take {size} bytes (over {self.newer_bytes})"
        return None


def _bounds(value: float, lo: float | None, hi: float | None, path: str) -> str | None:
    if lo is not None and value < lo:
        return f"{path} below {lo}"
    if hi is not None and value > hi:
        return f"{path} above {hi}"
    return None


@dataclass(frozen=True)
class SchemaValidator:
    """Values of keys starting with ``prefix`` (each subkey's value too) must fit ``spec``."""

    prefix: str
    spec: Spec

    def validate(self, record: Record) -> None:
        if not record.key.startswith(self.prefix):
            return
        try:
            value = unpack_value(record.value)
        except (ValueError, TypeError) as e:  # msgpack errors; unhashable map keys
            raise InvalidRecordError(f"value is not valid msgpack: {e}") from None
        if (reason := self.spec.check(value, "value")) is not None:
            raise InvalidRecordError(f"schema of {self.prefix!r}: {reason}")


@dataclass(frozen=True)
class KeySchema:
    """Records of the keys that ``pattern`` matches whole must fit ``spec``; with
    ``owned_subkeys`` each must also be a subkey with an owner marker (so signed by the peer it
    names): a plain value or an unsigned subkey there is refused, whatever it holds.

    The reason names the key and the offending field, since it travels back to the writer
    (``DHT.store``, the CLI). Keys that do not match are left to other validators."""

    name: str
    pattern: str
    spec: Spec
    owned_subkeys: bool = True
    # Seconds a record of these keys may live (None: the DHT's max_ttl): a record stored once
    # by a peer that then left must not outlive the run's use of it by days.
    max_ttl: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", re.compile(self.pattern))

    def lifetime(self, record: Record) -> float | None:
        """The longest lifetime this schema allows ``record`` (None: no bound of its own)."""
        if self.max_ttl is None or self._regex.fullmatch(record.key) is None:  # type: ignore[attr-defined]
            return None
        return self.max_ttl

    def validate(self, record: Record) -> None:
        if self._regex.fullmatch(record.key) is None:  # type: ignore[attr-defined]
            return
        if self.owned_subkeys and (record.subkey is None or record_owner(record) is None):
            raise InvalidRecordError(
                f"{self.name} {record.key[:80]!r}: only signed subkeys of their owners "
                "(subkey with an [owner:ID] marker) are accepted"
            )
        try:
            value = unpack_value(record.value)
        except (ValueError, TypeError, RecursionError) as e:
            raise InvalidRecordError(f"value is not valid msgpack: {e!r:.100}") from None
        if (reason := self.spec.check(value, "value")) is not None:
            raise InvalidRecordError(f"{self.name} {record.key[:80]!r}: {reason}")


class ValidatorChain:
    """Limits, then signatures, then the user's validators, in order."""

    def __init__(
        self,
        validators: Iterable[RecordValidator] = (),
        *,
        limits: LimitsValidator | None = None,
    ) -> None:
        self.validators: Sequence[RecordValidator] = (
            limits or LimitsValidator(),
            SignatureValidator(),
            *validators,
        )

    def validate(self, record: Record) -> None:
        for v in self.validators:
            v.validate(record)

    def reason(self, record: Record) -> str | None:
        try:
            self.validate(record)
        except InvalidRecordError as e:
            return e.reason
        return None

    def lifetime_reason(self, record: Record, now: float, max_ttl: float) -> str | None:
        """Why ``record`` lives too long at ``now`` (None: it does not): its expiration is
        further ahead than ``max_ttl`` or than a validator's own bound (``lifetime``)."""
        limit = max_ttl
        for v in self.validators:
            bound = getattr(v, "lifetime", None)
            got = bound(record) if bound is not None else None
            if got is not None:
                limit = min(limit, got)
        if record.expiration > now + limit:
            return f"expiration more than {limit:.0f} s ahead"
        return None
