"""The cache of verified signatures saves verifications without accepting anything new."""

from __future__ import annotations

import pytest

from p2p.dht.errors import InvalidRecordError
from p2p.dht.records import Record, owner_marker, pack_value
from p2p.dht.validation import (
    SignatureValidator,
    ValidatorChain,
    VerifiedSignatures,
    sign_record,
)
from p2p.identity import Identity


def _signed(owner: Identity, value: object, expiration: float = 10.0) -> Record:
    rec = Record("run.progress", owner_marker(owner.peer_id), pack_value(value), expiration)
    return sign_record(rec, owner)


def test_a_record_seen_again_is_not_verified_again() -> None:
    verdicts = VerifiedSignatures()
    chain = ValidatorChain([])
    chain.validators = (chain.validators[0], SignatureValidator(verdicts))
    good = _signed(Identity.from_seed(b"owner"), {"epoch": 1})
    for _ in range(5):  # a copy from the wire: equal bytes, new objects
        chain.validate(Record(good.key, good.subkey, bytes(good.value), 10.0, bytes(good.proof)))
    assert (verdicts.misses, verdicts.hits) == (1, 4)


@pytest.mark.parametrize("field", ["value", "expiration", "subkey", "key", "proof"])
def test_a_tampered_record_with_a_cached_signature_is_refused(field: str) -> None:
    verdicts = VerifiedSignatures()
    validator = SignatureValidator(verdicts)
    owner = Identity.from_seed(b"owner")
    good = _signed(owner, {"epoch": 1})
    validator.validate(good)  # its verdict is now cached
    changed = {
        "value": Record(good.key, good.subkey, pack_value({"epoch": 9}), 10.0, good.proof),
        "expiration": Record(good.key, good.subkey, good.value, 99.0, good.proof),
        "subkey": Record(good.key, good.subkey + "x", good.value, 10.0, good.proof),
        "key": Record("other" + good.subkey, None, good.value, 10.0, good.proof),
        "proof": Record(good.key, good.subkey, good.value, 10.0, good.proof[:-1] + b"\x00"),
    }[field]
    with pytest.raises(InvalidRecordError, match="bad signature"):
        validator.validate(changed)
    with pytest.raises(InvalidRecordError, match="bad signature"):  # and again, from the cache
        validator.validate(changed)
    validator.validate(good)  # the genuine record still passes


def test_the_cache_is_bounded_and_keeps_recent_verdicts() -> None:
    verdicts = VerifiedSignatures(max_entries=3)
    owner = Identity.from_seed(b"owner")
    validator = SignatureValidator(verdicts)
    records = [_signed(owner, {"epoch": i}) for i in range(5)]
    for rec in records:
        validator.validate(rec)
    assert len(verdicts) == 3
    validator.validate(records[-1])
    assert verdicts.hits == 1
    validator.validate(records[0])  # evicted: verified afresh, and still valid
    assert verdicts.misses == 6
    with pytest.raises(ValueError):
        VerifiedSignatures(max_entries=0)
