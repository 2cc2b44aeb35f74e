"""Incremental reads: ``LocalStorage.changes`` (pure), ``dht.changes`` and ``KeyFollower``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.dht.records import Record, merge_views, pack_value, record_size, view_records
from p2p.dht.storage import LocalStorage
from p2p.dht.wire import Limits, held_to_wire, parse_changes_request, parse_changes_response
from p2p.errors import ProtocolError
from p2p.testing import run_sim

from .swarm import TEST_CONFIG, dht_swarm


def rec(value, exp: float, subkey: str | None = None, key: str = "k") -> Record:
    return Record(key, subkey, pack_value(value), exp)


# --- LocalStorage.changes ------------------------------------------------------------------
def test_changes_since_a_number_are_what_was_stored_after_it() -> None:
    s = LocalStorage()
    s.store(rec(1, 100, "a"), 0)
    s.store(rec(1, 100, "b"), 0)
    everything, cursor = s.changes("k", 0, 0, 1 << 20)
    assert [r.subkey for r in everything] == ["a", "b"]
    assert s.changes("k", cursor, 0, 1 << 20) == ([], cursor)
    s.store(rec(2, 101, "a"), 1)  # newer: a change
    s.store(rec(1, 100, "b"), 1)  # the same record again: no change
    s.store(rec(0, 99, "b"), 1)  # older: refused, no change
    s.store(rec(1, 100, "c", key="other"), 1)  # another key
    changed, cursor2 = s.changes("k", cursor, 1, 1 << 20)
    assert [(r.subkey, r.decoded()) for r in changed] == [("a", 2)]
    assert cursor2 > cursor
    assert s.changes("k", cursor2, 1, 1 << 20)[0] == []


def test_changes_skip_expired_records_and_respect_the_byte_limit() -> None:
    s = LocalStorage()
    for i in range(10):
        s.store(rec("x" * 100, 50 if i == 3 else 100, f"s{i}"), 0)
    size = record_size(rec("x" * 100, 100, "s0"))
    first, cursor = s.changes("k", 0, 0, 2 * size + size // 2)  # two fit
    assert [r.subkey for r in first] == ["s0", "s1"]
    rest, cursor = s.changes("k", cursor, 60, 1 << 20)  # s3 expired at 50
    assert [r.subkey for r in rest] == [f"s{i}" for i in range(2, 10) if i != 3]
    assert s.changes("k", cursor, 60, 1 << 20)[0] == []
    one, _ = s.changes("k", 0, 60, 1)  # always at least one
    assert len(one) == 1
    two, _ = s.changes("k", 0, 60, 1 << 20, max_records=2)
    assert len(two) == 2


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([None, "a", "b", "c"]), st.integers(1, 30)),
        min_size=1,
        max_size=30,
    ),
    st.integers(0, 30),
)
def test_a_reader_of_changes_sees_what_a_reader_of_everything_sees(writes, split) -> None:
    """Reading all, then the changes after a cut, merges to the store's current value."""
    s = LocalStorage()
    seen: list[Record] = []
    cursor = 0
    for i, (subkey, exp) in enumerate(writes):
        s.store(rec(i, float(exp), subkey), 0)
        if i == split:
            got, cursor = s.changes("k", cursor, 0, 1 << 20)
            seen += got
    got, cursor = s.changes("k", cursor, 0, 1 << 20)
    seen += got
    assert merge_views(seen) == s.get("k", 0)


def test_changes_wire_rejects_malformed_cursors_and_records() -> None:
    assert parse_changes_request({"key": "k", "since": None}) == ("k", None, None)
    for bad in (
        {"key": "k", "since": None, "held": b"x" * 19},
        {"key": "k", "since": None, "held": "text"},
        {"key": "k", "since": None, "held": held_to_wire([rec(1, float("inf"), "s")])},
        {"key": "", "since": None},
        {"key": "k", "since": [b"12345678"]},
        {"key": "k", "since": [b"short", 1]},
        {"key": "k", "since": [b"12345678", -1]},
        {"key": "k", "since": [b"12345678", True]},
        ["not a map"],
    ):
        with pytest.raises(ProtocolError):
            parse_changes_request(bad)
    many = held_to_wire([rec(1, 9.0, str(i)) for i in range(3)])
    with pytest.raises(ProtocolError):
        parse_changes_request({"key": "k", "since": None, "held": many}, max_held=2)
    _, _, held = parse_changes_request({"key": "k", "since": None, "held": many}, max_held=3)
    assert [h.expiration for _, h in held] == [9.0] * 3 and len({s for s, _ in held}) == 3
    good_cursor = [b"12345678", 5]
    records, cursor, same = parse_changes_response(
        {"time": 0.0, "records": [["s", pack_value(1), 9.0, None]], "cursor": good_cursor},
        "k",
        Limits(),
        2,
    )
    assert records[0].subkey == "s" and cursor.number == 5 and same == [False, False]
    _, _, same = parse_changes_response(
        {"records": [], "cursor": good_cursor, "same": bytes([0b101, 0b1])}, "k", Limits(), 9
    )
    assert same == [True, False, True] + [False] * 5 + [True]
    for bad in (
        {"records": [["s", pack_value(1), 9.0]], "cursor": good_cursor},
        {"records": [["s", pack_value(1), float("nan"), None]], "cursor": good_cursor},
        {"records": "x", "cursor": good_cursor},
        {"records": [], "cursor": None},
        {"records": [], "cursor": good_cursor, "same": b"\x00\x00"},
        {"records": [], "cursor": good_cursor, "same": 3},
    ):
        with pytest.raises(ProtocolError):
            parse_changes_response(bad, "k", Limits())


# --- KeyFollower on the simulated network --------------------------------------------------
def test_a_follower_reads_what_a_get_reads_and_then_only_the_changes() -> None:
    async def main() -> None:
        async with dht_swarm(24, seed=3, silent_failures=True) as swarm:
            writers = swarm.dhts[:12]
            reader = swarm.dhts[20]
            follower = reader.follow("table")

            async def write_all(n: int, who=writers) -> None:
                async with trio.open_nursery() as nursery:
                    for w in who:
                        nursery.start_soon(
                            lambda w=w: w.store("table", n, w.now() + 600, subkey=str(w.peer_id))
                        )

            await write_all(1)
            first = await follower.get()
            assert first == await reader.get("table")
            assert len(first) == 12
            assert follower.stats["relocations"] == 1
            full = follower.stats["records"]
            assert full >= 12  # every record, from each holder
            assert (await follower.get()) == first
            assert follower.stats["records"] == full  # nothing changed, nothing sent
            await write_all(2, who=writers[:2])
            second = await follower.get()
            assert second == await reader.get("table")
            assert sorted(v.value for v in second.values()) == [1] * 10 + [2] * 2
            assert follower.stats["records"] - full <= 2 * len(follower.holders)
            assert follower.stats["relocations"] == 1

    run_sim(main)


def test_a_follower_replaces_a_dead_holder_and_drops_forged_records() -> None:
    async def main() -> None:
        async with dht_swarm(24, seed=5, silent_failures=True) as swarm:
            owner = swarm.dhts[2]
            follower = swarm.dhts[21].follow("table")
            await owner.store("table", 1, owner.now() + 600, subkey="plain-subkey")
            assert (await follower.get())["plain-subkey"].value == 1
            by_peer = {d.peer_id: (d, h) for d, h in zip(swarm.dhts, swarm.hosts, strict=True)}
            # a holder goes away: the next read finds another and still sees the value
            dead = follower.holders[0]
            swarm.net.kill(by_peer[dead][1])
            await owner.store("table", 2, owner.now() + 600, subkey="plain-subkey")
            for _ in range(follower.sweep_every):  # a sweep asks every holder
                assert (await follower.get())["plain-subkey"].value == 2
            assert dead not in follower.holders
            # a holder serves a forged owner-reserved record (put straight into its store)
            holder = by_peer[follower.holders[0]][0]
            victim = owner.peer_id
            forged = Record("table", f"[owner:{victim.to_base58()}]", pack_value(666), 10**6)
            holder.storage.store(forged, holder.now())
            for _ in range(follower.sweep_every):  # the holder is asked within a sweep
                got = await follower.get()
                assert f"[owner:{victim.to_base58()}]" not in got
            assert follower.stats["invalid"] >= 1
            assert got["plain-subkey"].value == 2

    run_sim(main)


def test_a_restarted_store_is_read_in_full_again() -> None:
    async def main() -> None:
        async with dht_swarm(12, seed=9) as swarm:
            w = swarm.dhts[1]
            follower = swarm.dhts[10].follow("table")
            await w.store("table", 1, w.now() + 600, subkey="a")
            assert set(await follower.get()) == {"a"}
            for d in swarm.dhts:  # every node loses its data and its change numbers
                if d.peer_id in follower.holders:
                    records = view_records(d.storage.get("table", d.now()))
                    d.storage.remove("table")
                    d.storage.incarnation = b"restart!"
                    d.storage.seq = 0
                    for r in records:
                        d.storage.store(r, d.now())
            before = follower.stats["records"]
            assert set(await follower.get()) == {"a"}
            assert follower.stats["records"] > before  # sent again, not taken as known

    run_sim(main)


def test_follow_rejects_bad_settings() -> None:
    async def main() -> None:
        async with dht_swarm(2) as swarm:
            with pytest.raises(ValueError):
                swarm.dhts[0].follow("k", holders=0)
            with pytest.raises(ValueError):
                swarm.dhts[0].follow("k", relocate_interval=0)
            with pytest.raises(ValueError):
                swarm.dhts[0].follow("k", sweep_every=0)

    assert TEST_CONFIG.get_quorum >= 1
    run_sim(main)


def test_a_get_with_quorum_zero_reads_a_dictionary_split_over_the_nearest_nodes() -> None:
    """Subkeys of one key can sit on different nodes (each side of a healed partition stored
    on the nodes it could reach). ``quorum=0`` asks every nearest node and merges them all."""
    from p2p.dht.ids import distance, key_id, node_id

    async def main() -> None:
        async with dht_swarm(24, seed=9) as swarm:
            writer, reader = swarm.dhts[0], swarm.dhts[23]
            await writer.store("split", 1, writer.now() + 600, subkey="a")
            target = key_id("split")
            nearest = sorted(swarm.dhts, key=lambda d: distance(node_id(d.peer_id), target))
            far = nearest[writer.config.replication - 1]  # the last of the key's holders
            far.storage.store(Record("split", "b", pack_value(2), far.now() + 600), far.now())
            whole = await reader.get("split", quorum=0)
            assert whole["a"].value == 1 and whole["b"].value == 2

    run_sim(main)


def test_a_sweep_reads_a_record_that_only_another_holder_has() -> None:
    """Between sweeps a follower asks one holder; a record stored on another holder only (its
    writer's view of the nearest nodes differed) is missed until ``sweep`` asks them all."""

    async def main() -> None:
        async with dht_swarm(24, seed=5) as swarm:
            reader = swarm.dhts[21]
            follower = reader.follow("regs", holders=3, sweep_every=100)
            assert await follower.get() is None  # the first read locates and sweeps
            assert len(follower.holders) == 3
            asked = follower.holders[follower._pick % 3]
            other = next(
                d for d in swarm.dhts if d.peer_id in follower.holders and d.peer_id != asked
            )
            other.storage.store(Record("regs", "x", pack_value(1), other.now() + 600), other.now())
            assert await follower.get() is None  # asked the one holder, which lacks it
            assert (await follower.get(sweep=True))["x"].value == 1

    run_sim(main)


def test_a_follower_keeps_its_holders_when_a_lookup_finds_far_nodes_or_none_answers() -> None:
    """A lookup on a busy network may return one far node, which writers do not store on: a
    relocation keeps the nearer holders that still answer. A read on which no holder answers
    (our link, or a cut) keeps them too: after the cut the reader sees the writers' updates
    again. A reader that replaced its holders lost the whole table (a 200-peer simulation)."""
    from p2p.dht.ids import key_id, node_id

    async def main() -> None:
        async with dht_swarm(24, seed=7) as swarm:
            writer, reader = swarm.dhts[0], swarm.dhts[23]
            follower = reader.follow("table")
            await writer.store("table", 1, writer.now() + 600, subkey="a")
            assert (await follower.get())["a"].value == 1
            nearest = list(follower.holders)
            target = key_id("table")
            find_nearest = reader.find_nearest
            farthest = max((d.peer_id for d in swarm.dhts), key=lambda p: node_id(p) ^ target)
            itself = (await find_nearest(node_id(farthest), count=1)).nearest[:1]
            assert itself and itself[0].peer not in nearest  # a node far from the key

            async def far_only(_target, count):  # noqa: ANN001, ANN202
                return replace(await find_nearest(_target, count=count), nearest=itself)

            reader.find_nearest = far_only
            reader._located.clear()
            follower._located_at = -float("inf")  # relocate at the next read
            await writer.store("table", 2, writer.now() + 600, subkey="a")
            assert (await follower.get())["a"].value == 2
            assert follower.holders == nearest  # the far node ranks last: not followed

            others = [h for h in swarm.hosts if h is not swarm.hosts[23]]
            swarm.net.partition([swarm.hosts[23]], others)
            assert (await follower.get(sweep=True))["a"].value == 2  # nobody answered
            assert follower.stats["all_failed"] >= 1 and follower.holders == nearest
            swarm.net.heal()
            await writer.store("table", 3, writer.now() + 600, subkey="a")
            assert (await follower.get(sweep=True))["a"].value == 3

            # Cut again; after the heal the next relocation finds only the far node. The
            # holders failed while every one failed (our fault): asked again, they answer and
            # stay. (Ranked last, they gave way to far nodes, and a slow peer's table froze.)
            swarm.net.partition([swarm.hosts[23]], others)
            assert (await follower.get(sweep=True))["a"].value == 3
            swarm.net.heal()
            reader._located.clear()
            follower._located_at = -float("inf")
            await writer.store("table", 4, writer.now() + 600, subkey="a")
            assert (await follower.get())["a"].value == 4
            assert follower.holders == nearest

    run_sim(main)


def test_a_follower_moves_to_nearer_holders_its_routing_table_learns_of() -> None:
    """Holders located while the network was small (a run's first peer locates the key among
    a handful of nodes) are not where writers that join later store: once its routing table
    names a nearer node, the follower relocates at its next sweep, not at its relocation
    interval. (A 20-peer simulation's first peer read a frozen table for 30 s.)"""
    from p2p.dht.ids import key_id

    async def main() -> None:
        async with dht_swarm(6, seed=11) as swarm:
            reader = swarm.dhts[0]
            follower = reader.follow("table", relocate_interval=1000.0, sweep_every=2)
            assert await follower.get() is None
            early = set(follower.holders)
            for i in range(6, 30):  # the run grows; newcomers join through the first peer
                d = await swarm.add(i, [str(reader.node.addrs[0])], config=TEST_CONFIG)
                swarm.dhts.append(d)
                swarm.hosts.append(swarm.net.hosts[f"n{i}"])
            nearest = swarm.brute_force_nearest(key_id("table"), follower.wanted)
            assert not set(nearest) <= early  # the early holders are no longer the nearest
            writer = swarm.dhts[-1]
            await writer.store("table", 1, writer.now() + 600, subkey="a", replicas=3)
            got = None
            for _ in range(2):  # within one sweep
                got = await follower.get()
            assert got is not None and got["a"].value == 1
            assert follower.holders == nearest
            assert follower.stats["relocations"] == 2

    run_sim(main)


def test_a_follower_asks_every_holder_before_a_record_lapses() -> None:
    """Between sweeps a read asks one holder. When that one lacks the writer's refresh (a far
    node writers do not store on), the record must not lapse on its word: the read asks the
    other holders first. (A 200-peer simulation's reader lost its whole table that way.)"""

    async def main() -> None:
        async with dht_swarm(24, seed=5) as swarm:
            reader = swarm.dhts[21]
            follower = reader.follow("regs", holders=3, sweep_every=100)
            assert await follower.get() is None  # the first read locates and sweeps
            asked = follower.holders[follower._pick % 3]
            others = [d for d in swarm.dhts if d.peer_id in follower.holders and d.peer_id != asked]
            for d in others:
                d.storage.store(Record("regs", "x", pack_value(1), d.now() + 5), d.now())
            assert (await follower.get(sweep=True))["x"].value == 1
            for d in others:  # the writer's refresh reaches the holders it knows
                d.storage.store(Record("regs", "x", pack_value(2), d.now() + 600), d.now())
            await trio.sleep(6)  # the version read has expired
            got = await follower.get()
            assert got is not None and got["x"].value == 2
            assert follower.stats["polls"] >= 4  # one holder, then all of them

    run_sim(main)


def test_a_follower_whose_view_lapsed_looks_the_key_up_again() -> None:
    """Holders that answer but no longer get the writers' stores (far nodes) let the view
    lapse, once ``lapse_grace`` passed, even when all are asked; the follower then looks the
    key up afresh at once, rather than at its next relocation, and reads the writers' records
    from the nearest nodes."""
    from p2p.dht.ids import key_id, node_id

    async def main() -> None:
        async with dht_swarm(24, seed=7) as swarm:
            writer, reader = swarm.dhts[0], swarm.dhts[23]
            follower = reader.follow("table", relocate_interval=1000.0)
            for sub in "abcdef":
                await writer.store("table", 1, writer.now() + 5, subkey=sub, replicas=3)
            assert len(await follower.get()) == 6
            nearest = set(follower.holders)
            target = key_id("table")
            far = sorted(swarm.dhts, key=lambda d: node_id(d.peer_id) ^ target)[-3:]
            assert not nearest & {d.peer_id for d in far} and reader not in far
            found = await reader.find_nearest(node_id(far[0].peer_id), count=8)
            contacts = [c for c in found.nearest if c.peer in {d.peer_id for d in far}]
            assert contacts
            follower._holders = contacts  # holders that answer, but writers store elsewhere
            follower._cursors = {c.peer: None for c in contacts}
            for sub in "abcdef":
                await writer.store("table", 2, writer.now() + 600, subkey=sub, replicas=3)
            await trio.sleep(6)  # the versions read have expired
            held = await follower.get()  # only nodes that never sent the key's records answer:
            assert held is not None and len(held) == 6  # that says nothing of the writers
            await trio.sleep(follower.lapse_grace)
            assert await follower.get() is None  # every holder was asked: nothing
            assert follower.stats["collapses"] == 1
            got = await follower.get()
            assert got is not None and {s: v.value for s, v in got.items()} == dict.fromkeys(
                "abcdef", 2
            )
            assert set(follower.holders) & nearest

    run_sim(main)


def test_a_follower_cut_off_keeps_its_view_until_it_hears_from_a_holder_again() -> None:
    """A reader that hears from none of the holders that sent it records (its own link is
    saturated, or a cut) cannot tell that the writers left: its records lapse only
    ``lapse_grace`` seconds past their expiry. Heard from, holders make them lapse on time.
    (A slow peer whose table lapsed that way took itself for the only peer left.)"""

    async def main() -> None:
        async with dht_swarm(24, seed=7) as swarm:
            writer, reader = swarm.dhts[0], swarm.dhts[23]
            follower = reader.follow("table", lapse_grace=20.0)
            for sub in "abcd":
                await writer.store("table", 1, writer.now() + 10, subkey=sub, replicas=3)
            assert len(await follower.get()) == 4
            others = [h for h in swarm.hosts if h is not swarm.hosts[23]]
            swarm.net.partition([swarm.hosts[23]], others)
            await trio.sleep(15)  # expired at the holders; the reader hears nothing
            held = await follower.get(sweep=True)
            assert held is not None and sorted(held) == list("abcd")
            assert follower.stats["all_failed"] >= 1
            await trio.sleep(20)  # now past expiry + lapse_grace
            assert await follower.get() is None
            swarm.net.heal()
            await writer.store("table", 2, writer.now() + 5, subkey="e", replicas=3)
            got = await follower.get(sweep=True)
            assert got is not None and got["e"].value == 2
            await trio.sleep(6)  # the holders answer, and the record expired: it lapses
            assert await follower.get(sweep=True) is None

    run_sim(main)


def test_a_holder_speaks_only_for_the_records_it_sent() -> None:
    """A holder that answers makes an expired record lapse on time only when it sent us that
    record: a far node that holds a few of the key's records (a writer's lookup found it)
    says nothing of the others, which then lapse ``lapse_grace`` past their expiry. (Letting
    any holder that had sent some record speak for all, a slow peer's table of 183 records
    dwindled to its own record within a minute.)"""
    from p2p.dht.ids import key_id, node_id

    async def main() -> None:
        async with dht_swarm(24, seed=7) as swarm:
            writer, reader = swarm.dhts[0], swarm.dhts[23]
            follower = reader.follow("table", relocate_interval=1000.0, lapse_grace=20.0)
            for sub in "abcd":
                await writer.store("table", 1, writer.now() + 5, subkey=sub, replicas=3)
            assert len(await follower.get()) == 4
            target = key_id("table")
            far = sorted(swarm.dhts, key=lambda d: node_id(d.peer_id) ^ target)[-3:]
            assert reader not in far and not set(follower.holders) & {d.peer_id for d in far}
            found = await reader.find_nearest(node_id(far[0].peer_id), count=8)
            contacts = [c for c in found.nearest if c.peer in {d.peer_id for d in far}]
            assert len(contacts) >= follower.wanted
            for d in far:  # a newer "a" reached the far nodes, and only "a"
                d.storage.store(Record("table", "a", pack_value(2), d.now() + 8), d.now())
            follower._holders = contacts
            follower._cursors = {c.peer: None for c in contacts}
            await trio.sleep(6)  # b, c and d expired; the far nodes answer without them
            held = await follower.get(sweep=True)
            assert held is not None and sorted(held) == list("abcd") and held["a"].value == 2
            await trio.sleep(3)  # "a" expired, and the nodes that sent it answer: it lapses
            held = await follower.get(sweep=True)
            assert held is not None and sorted(held) == list("bcd")
            await trio.sleep(18)  # b, c and d are now lapse_grace past their expiry
            assert await follower.get(sweep=True) is None

    run_sim(main)


def test_a_sweep_does_not_refetch_what_the_one_holder_sent() -> None:
    """A sweep asks the other holders with their cursors from the last sweep: each resent
    every update the one holder had sent since (the largest DHT item of a 12-peer DiLoCo run,
    14.0 MB of 56.6). Told what the reader holds, they send only newer records; a newer record
    that only another holder has still arrives at the sweep."""

    async def main() -> None:
        async with dht_swarm(24, seed=3, silent_failures=True) as swarm:
            writers = swarm.dhts[:12]
            reader = swarm.dhts[20]
            follower = reader.follow("table", holders=3, sweep_every=4, relocate_interval=1e4)
            for w in writers:
                await w.store("table", 0, w.now() + 600, subkey=str(w.peer_id))
            assert len(await follower.get()) == 12
            before, updates = follower.stats["records"], 0
            for n in range(1, 9):  # two sweeps
                for w in writers[:3]:
                    await w.store("table", n, w.now() + 600, subkey=str(w.peer_id))
                    updates += 1
                view = await follower.get()
            assert view == await reader.get("table")
            assert sorted(v.value for v in view.values()) == [0] * 9 + [8] * 3
            assert follower.stats["records"] - before == updates  # each update once
            # a newer record on a holder the follower asks only in sweeps
            asked = follower.holders[follower._pick % 3]
            other = next(
                d for d in swarm.dhts if d.peer_id in follower.holders and d.peer_id != asked
            )
            sub = str(writers[5].peer_id)
            other.storage.store(Record("table", sub, pack_value(9), other.now() + 900), other.now())
            for _ in range(follower.sweep_every):
                view = await follower.get()
            assert view[sub].value == 9

    run_sim(main)


def test_a_holder_that_holds_our_record_speaks_for_it_without_resending_it() -> None:
    """A sweep's holders no longer resend the records we hold; they name those they hold the
    same, and that counts as having sent them: when the one holder that sent a record is gone,
    the others' answers after its expiry still drop it on time (not ``lapse_grace`` later)."""

    async def main() -> None:
        async with dht_swarm(24, seed=7, silent_failures=True) as swarm:
            writer, reader = swarm.dhts[0], swarm.dhts[23]
            follower = reader.follow(
                "table", holders=3, sweep_every=2, relocate_interval=1e4, lapse_grace=100.0
            )
            assert await follower.get() is None  # read 0: locates, sweeps
            await writer.store("table", 1, writer.now() + 5, subkey="a")
            assert (await follower.get())["a"].value == 1  # read 1: the one holder sent it
            sent = follower.stats["records"]
            assert (await follower.get())["a"].value == 1  # read 2: a sweep
            assert follower.stats["records"] == sent  # nobody resent it
            by_peer = {d.peer_id: h for d, h in zip(swarm.dhts, swarm.hosts, strict=True)}
            swarm.net.kill(by_peer[follower.holders[follower._pick % 3]])
            await trio.sleep(6)
            assert await follower.get() is None

    run_sim(main)


def test_a_follower_reads_holders_that_predate_held() -> None:
    """A node that predates ``held`` ignores it and answers without ``same``: the reader
    still reads every record (fetching some twice, as before)."""
    from p2p.dht.wire import CHANGES

    async def main() -> None:
        async with dht_swarm(24, seed=3, silent_failures=True) as swarm:
            for d in swarm.dhts:

                async def old(ctx, req, proto=d.protocol):
                    req = {k: v for k, v in req.items() if k != "held"}
                    resp = await proto.handle_changes(ctx, req)
                    assert "same" not in resp
                    return resp

                d.node.remove_handler(CHANGES)
                d.node.add_handler(CHANGES, old)
            writers = swarm.dhts[:6]
            follower = swarm.dhts[20].follow("table", holders=3, sweep_every=2)
            for n in range(4):
                for w in writers[: 6 - n]:
                    await w.store("table", n, w.now() + 600, subkey=str(w.peer_id))
                view = await follower.get()
                assert view == await swarm.dhts[20].get("table")
            assert sorted(v.value for v in view.values()) == [0, 1, 2, 3, 3, 3]

    run_sim(main)
