"""Local storage, merge rules, validators and the DHT clock (pure)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.dht.clock import DHTClock
from p2p.dht.errors import InvalidRecordError
from p2p.dht.records import Record, merge_views, owner_marker, pack_value
from p2p.dht.storage import LocalStorage
from p2p.dht.validation import (
    Bool,
    Float,
    Int,
    ListOf,
    SchemaValidator,
    Str,
    Struct,
    ValidatorChain,
    sign_record,
)
from p2p.identity import Identity


def rec(key: str, value, exp: float, subkey: str | None = None) -> Record:
    return Record(key, subkey, pack_value(value), exp)


def test_later_expiration_replaces_earlier() -> None:
    s = LocalStorage()
    assert s.store(rec("k", 1, 10.0), now=0)
    assert not s.store(rec("k", 2, 5.0), now=0)  # older: refused
    assert s.get("k", 0).decoded() == 1
    assert s.store(rec("k", 3, 20.0), now=0)
    assert s.get("k", 0).decoded() == 3
    assert s.store(rec("k", 3, 20.0), now=0)  # the same record again: held


def test_ties_break_deterministically() -> None:
    a, b = rec("k", "a", 10.0), rec("k", "b", 10.0)
    s1, s2 = LocalStorage(), LocalStorage()
    s1.store(a, 0), s1.store(b, 0)
    s2.store(b, 0), s2.store(a, 0)
    assert s1.get("k", 0) == s2.get("k", 0)


def test_expired_values_disappear() -> None:
    s = LocalStorage()
    assert not s.store(rec("k", 1, 5.0), now=6.0)  # already expired
    s.store(rec("k", 1, 10.0), now=0)
    s.store(rec("d", 1, 10.0, subkey="a"), now=0)
    s.store(rec("d", 2, 20.0, subkey="b"), now=0)
    assert s.get("k", 9.9) is not None
    assert s.get("k", 10.0) is None
    assert set(s.get("d", 15.0)) == {"b"}
    assert s.purge(25.0) == 1 and len(s) == 0


def test_subkeys_merge_and_plain_values_interact() -> None:
    s = LocalStorage()
    s.store(rec("d", 1, 10.0, subkey="a"), 0)
    s.store(rec("d", 2, 12.0, subkey="b"), 0)
    s.store(rec("d", 3, 11.0, subkey="a"), 0)
    d = s.get("d", 0)
    assert {k: r.decoded() for k, r in d.items()} == {"a": 3, "b": 2}
    assert not s.store(rec("d", "plain", 11.5), 0)  # does not outlive every subkey
    assert s.store(rec("d", "plain", 13.0), 0)
    assert s.get("d", 0).decoded() == "plain"
    assert not s.store(rec("d", 9, 12.0, subkey="c"), 0)  # older than the plain value
    assert s.store(rec("d", 9, 14.0, subkey="c"), 0)
    assert set(s.get("d", 0)) == {"c"}  # only subkeys newer than the plain value show
    assert s.get("d", 13.5)["c"].decoded() == 9


def test_limits_refuse_new_keys_and_subkeys() -> None:
    s = LocalStorage(max_keys=2, max_subkeys=2)
    assert s.store(rec("a", 1, 10), 0) and s.store(rec("b", 1, 10), 0)
    assert not s.store(rec("c", 1, 10), 0)
    assert s.store(rec("c", 1, 20), 11)  # after the others expired, room again
    s2 = LocalStorage(max_subkeys=2)
    assert s2.store(rec("d", 1, 10, "x"), 0) and s2.store(rec("d", 1, 10, "y"), 0)
    assert not s2.store(rec("d", 1, 10, "z"), 0)


def test_lru_cache_evicts_least_recently_used() -> None:
    c = LocalStorage(max_keys=2, lru=True)
    c.store(rec("a", 1, 10), 0), c.store(rec("b", 1, 10), 0)
    c.get("a", 0)
    assert c.store(rec("c", 1, 10), 0)
    assert c.get("b", 0) is None and c.get("a", 0) is not None


records_st = st.builds(
    rec,
    st.just("k"),
    st.integers(0, 3),
    st.integers(1, 6).map(float),
    st.sampled_from([None, "x", "y"]),
)


@settings(max_examples=100, deadline=None)
@given(st.lists(records_st, max_size=12), st.randoms(use_true_random=False))
def test_merge_is_order_independent(records: list[Record], rnd) -> None:
    """Replicas receiving the same records in any order converge to the same state."""

    shuffled = list(records)
    rnd.shuffle(shuffled)
    s1, s2 = LocalStorage(), LocalStorage()
    for r in records:
        s1.store(r, now=0.0)
    for r in shuffled:
        s2.store(r, now=0.0)
    assert s1.get("k", 0.0) == s2.get("k", 0.0) == merge_views(records)


@settings(max_examples=200, deadline=None)
@given(st.lists(records_st, max_size=12), st.lists(st.integers(0, 7).map(float), max_size=4))
def test_a_store_says_whether_the_record_is_visible_and_expiry_forgets_exactly(
    records: list[Record], nows: list[float]
) -> None:
    """``apply`` answers without building the view, and ``drop_expired`` skips its scan
    while nothing can have expired: both must agree with the view built from scratch."""
    from p2p.dht.records import KeyState, view_records

    state = KeyState()
    for r in records:
        shown = state.apply(r, max_subkeys=64)
        assert shown == any(
            v is r or v.same_as(r) and v.subkey == r.subkey for v in view_records(state.view())
        ), r
    for now in sorted(nows):
        before = [r for r in view_records(state.view()) if r.expiration > now]
        empty = state.drop_expired(now)
        after = view_records(state.view())
        assert all(r.expiration > now for r in after)
        assert sorted(after, key=Record.sort_key) == sorted(before, key=Record.sort_key)
        assert empty == (state.plain is None and not state.subs)


def test_signed_subkeys() -> None:
    owner, thief = Identity.from_seed(b"owner"), Identity.from_seed(b"thief")
    chain = ValidatorChain()
    sub = owner_marker(owner.peer_id)
    good = sign_record(rec("progress", {"epoch": 1}, 10.0, sub), owner)
    chain.validate(good)
    with pytest.raises(InvalidRecordError, match="not signed"):
        chain.validate(rec("progress", {"epoch": 1}, 10.0, sub))
    with pytest.raises(InvalidRecordError, match="another key"):
        chain.validate(sign_record(rec("progress", {"epoch": 9}, 10.0, sub), thief))
    # the owner's signature does not cover a changed value or expiration
    tampered = Record(good.key, good.subkey, pack_value({"epoch": 9}), 10.0, good.proof)
    assert "bad signature" in chain.reason(tampered)
    longer = Record(good.key, good.subkey, good.value, 99.0, good.proof)
    assert "bad signature" in chain.reason(longer)
    # owner markers in the key itself; two different owners; garbage markers
    chain.validate(sign_record(rec(f"state{sub}", 1, 10.0), owner))
    two = rec(f"x{owner_marker(thief.peer_id)}", 1, 10.0, sub)
    assert "different owners" in chain.reason(sign_record(two, owner))
    assert "malformed owner" in chain.reason(rec("x[owner:0OIl]", 1, 10.0))
    # unowned keys need no signature
    chain.validate(rec("free", 1, 10.0, "anything"))


def test_schema_validator() -> None:
    spec = Struct(
        {"epoch": Int(min=0), "sps": Float(min=0), "client": Bool(), "name": Str(8)},
        optional=frozenset({"name"}),
    )
    chain = ValidatorChain([SchemaValidator("progress", spec)])
    chain.validate(rec("progress", {"epoch": 3, "sps": 1.5, "client": False}, 10))
    chain.validate(rec("other", "anything", 10))
    bad = [
        ({"epoch": -1, "sps": 1.0, "client": False}, "epoch below 0"),
        ({"epoch": 1, "sps": float("nan"), "client": False}, "finite"),
        ({"epoch": 1, "sps": 1.0}, "client is missing"),
        ({"epoch": 1, "sps": 1.0, "client": 1}, "boolean"),
        ({"epoch": True, "sps": 1.0, "client": False}, "integer"),
        ({"epoch": 1, "sps": 1.0, "client": False, "x": 1}, "unknown field"),
        ({"epoch": 1, "sps": 1.0, "client": False, "name": "x" * 9}, "longer"),
        ([1, 2], "must be a map"),
    ]
    for value, reason in bad:
        assert reason in (chain.reason(rec("progress", value, 10)) or ""), value
    raw = Record("progress", None, b"\xc1", 10.0)  # not msgpack
    assert "msgpack" in chain.reason(raw)
    lists = ValidatorChain([SchemaValidator("l", ListOf(Int(), max_len=2))])
    assert lists.reason(rec("l", [1, 2, 3], 10)) is not None
    assert lists.reason(rec("l", [1, "a"], 10)) is not None
    assert lists.reason(rec("l", [1, 2], 10)) is None


def test_limits() -> None:
    chain = ValidatorChain()
    assert "key" in chain.reason(rec("", 1, 10))
    assert "larger" in chain.reason(Record("k", None, b"\x00" * 300_000, 10.0))
    assert "finite" in chain.reason(rec("k", 1, float("inf")))
    assert "proof" in chain.reason(Record("k", None, msgpack.packb(1), 10.0, b"x"))


def test_clock_uses_median_offset() -> None:
    local = [1000.0]
    clock = DHTClock(lambda: local[0], samples=5, max_skew=100)
    assert clock.now() == 1000.0
    # three honest peers ~ +2 s, one liar at +90 s, one garbage reading
    for i, off in enumerate([2.0, 2.2, 1.8, 90.0]):
        clock.observe(f"p{i}", 1000.0 + off + 0.05, sent=1000.0, received=1000.1)
    clock.observe("bad", 1e12, sent=1000.0, received=1000.1)
    clock.observe("nan", float("nan"), sent=1000.0, received=1000.1)
    clock.observe("str", "x", sent=1000.0, received=1000.1)
    assert clock.now() == pytest.approx(1002.0, abs=0.01)
    # only the last `samples` peers count; a peer's new reading replaces its old one
    for i in range(5):
        clock.observe(f"q{i}", 1000.0 - 3.0, 1000.0, 1000.0)
    assert clock.now() == pytest.approx(997.0, abs=1e-9) or clock.offset == -3.0


def test_memory_bound_refuses_or_evicts() -> None:
    big = 10_000
    s = LocalStorage(max_bytes=3 * big)
    assert s.store(Record("a", None, b"x" * big, 10.0), 0)
    assert s.store(Record("b", None, b"x" * big, 10.0), 0)
    assert not s.store(Record("c", None, b"x" * big, 10.0), 0)  # storage refuses
    assert s.store(Record("c", None, b"x" * big, 20.0), 11.0)  # expired ones made room
    assert 0 < s.nbytes <= 3 * big
    # replacing a record accounts the difference; removal gives it back
    assert s.store(Record("c", None, b"y" * 10, 30.0), 11.0)
    assert s.nbytes < big
    s.remove("c")
    assert s.nbytes == 0
    cache = LocalStorage(max_bytes=3 * big, lru=True)
    for key in "abcd":
        assert cache.store(Record(key, None, b"x" * big, 10.0), 0)  # the cache evicts
    assert cache.get("a", 0) is None and cache.get("d", 0) is not None
    assert cache.nbytes <= 3 * big
