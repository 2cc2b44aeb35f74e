"""Writers that try to blank or fill keys others own: a plain value shadowing signed subkeys,
one writer filling a key or a node, unsigned junk locking owners out. Each is refused with
the real reason, locally (the store), over the network (``DHT.store``) and in every merge."""

from __future__ import annotations

import random

import pytest
import trio

from p2p.dht import InvalidRecordError, Record, owner_marker
from p2p.dht.records import merge_views, pack_value
from p2p.dht.storage import LocalStorage, WriterQuotas
from p2p.dht.validation import sign_record
from p2p.identity import Identity
from p2p.testing import run_sim

from .swarm import dht_swarm

WEEK = 7 * 24 * 3600.0


def owned(ident: Identity, key: str, value, expiration: float, tag: str = "") -> Record:
    sub = owner_marker(ident.peer_id) + tag
    return sign_record(Record(key, sub, pack_value(value), expiration), ident)


def test_a_plain_value_never_hides_signed_subkeys_in_any_order() -> None:
    a, b = Identity.from_seed(b"a"), Identity.from_seed(b"b")
    reports = [owned(a, "run.progress", {"epoch": 3}, 60), owned(b, "run.progress", 4, 50)]
    junk = Record("run.progress", None, pack_value("x"), WEEK)
    for order in range(6):
        records = [*reports, junk]
        random.Random(order).shuffle(records)
        view = merge_views(records)
        assert isinstance(view, dict) and sorted(view) == sorted(r.subkey for r in reports)
    # a store holding the reports refuses the junk and says why
    s = LocalStorage()
    for r in reports:
        assert s.offer(r, 0) is True
    why = s.offer(junk, 0)
    assert isinstance(why, str) and "signed subkeys" in why
    # the owners' next reports are taken (not "outdated")
    assert s.offer(owned(a, "run.progress", {"epoch": 4}, 120), 10) is True
    # a plain value of a key nobody signs in still works as before
    assert s.offer(Record("run.config", None, pack_value(1), 100), 0) is True


def test_one_writer_cannot_fill_a_key_or_the_node() -> None:
    q = WriterQuotas(subkeys_per_key=3, bytes_per_key=10_000, records_per_node=5)
    s = LocalStorage(quotas=q)
    greedy, newcomer = Identity.from_seed(b"g"), Identity.from_seed(b"n")
    for i in range(3):
        assert s.offer(owned(greedy, "k", i, 100, f"#{i}"), 0) is True
    why = s.offer(owned(greedy, "k", 3, 100, "#3"), 0)
    assert isinstance(why, str) and "quota" in why and "slots of key" in why
    assert s.offer(owned(greedy, "k", 9, 200, "#0"), 0) is True  # refreshing its own: fine
    for i in range(2):
        assert s.offer(owned(greedy, f"other{i}", i, 100), 0) is True
    why = s.offer(owned(greedy, "other2", 0, 100), 0)
    assert isinstance(why, str) and "on this node" in why
    assert s.offer(owned(newcomer, "k", 1, 100), 0) is True  # others keep their room
    big = WriterQuotas(bytes_per_key=2_000)
    s2 = LocalStorage(quotas=big)
    assert s2.offer(owned(greedy, "k", b"x" * 1500, 100), 0) is True
    why = s2.offer(owned(greedy, "k", b"x" * 1500, 100, "#2"), 0)
    assert isinstance(why, str) and "bytes of one key" in why
    # expiry gives the quota back
    assert s.offer(owned(greedy, "other2", 0, 300), 250) is True


def test_unsigned_junk_subkeys_cannot_lock_owners_out() -> None:
    s = LocalStorage(max_subkeys=50, quotas=WriterQuotas(max_unowned_subkeys=10))
    for i in range(10):
        assert s.offer(Record("nat.relays", f"junk{i}", pack_value(i), WEEK), 0) is True
    why = s.offer(Record("nat.relays", "junk10", pack_value(0), WEEK), 0)
    assert isinstance(why, str) and "unsigned subkeys" in why
    relay = Identity.from_seed(b"relay")
    assert s.offer(owned(relay, "nat.relays", ["/ip4/1.2.3.4/tcp/1"], 100), 0) is True


def test_shadowing_through_dht_store_is_refused_with_the_reason() -> None:
    async def main() -> None:
        async with dht_swarm(12, seed=11) as swarm:
            owners, attacker = swarm.dhts[:3], swarm.dhts[7]
            now = trio.current_time()
            for i, d in enumerate(owners):
                res = await d.store(
                    "run.progress", {"epoch": i}, now + 60, subkey=owner_marker(d.peer_id)
                )
                assert res.ok
            with pytest.raises(InvalidRecordError, match="signed subkeys"):
                await attacker.store("run.progress", "x", now + 600_000)
            got = await swarm.dhts[5].get("run.progress")
            assert isinstance(got, dict) and len(got) == 3
            # owners' re-stores still land
            d = owners[0]
            res = await d.store(
                "run.progress", {"epoch": 9}, now + 120, subkey=owner_marker(d.peer_id)
            )
            assert res.ok and res.outdated == 0
            got = await swarm.dhts[6].get("run.progress")
            assert got[owner_marker(d.peer_id)].value == {"epoch": 9}

    run_sim(main)
