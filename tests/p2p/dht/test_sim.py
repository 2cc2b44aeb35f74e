"""The DHT on the simulated network (real nodes and secure channels, virtual time).

Sizes: a real node on the simulator costs ~0.2 s of CPU to start and join (secure handshakes
with its ~30 routing-table peers), and up to 3x more wall time when the 2 cores are shared, so
the default suite uses 64 nodes for lookup accuracy and 12-30 node swarms elsewhere; the
500-node accuracy test is marked slow.
"""

from __future__ import annotations

import random
import statistics

import pytest
import trio

from p2p.dht import (
    BootstrapError,
    Int,
    InvalidRecordError,
    Record,
    SchemaValidator,
    Struct,
    open_dht,
    owner_marker,
)
from p2p.dht.ids import key_id, node_id, random_id
from p2p.dht.records import pack_value
from p2p.dht.validation import sign_record
from p2p.dht.wire import Contact
from p2p.node import open_node
from p2p.testing import run_sim

from .swarm import TEST_CONFIG, dht_swarm


async def _lookup_accuracy(
    n: int, lookups: int, seed: int, counts: tuple[int | None, ...] = (None,)
) -> dict[int | None, tuple[float, float, float, float]]:
    """Per lookup count: top-1 hit rate, overlap with the true nearest, mean rounds and mean
    FIND messages. Every count looks up the same targets from the same nodes of one swarm."""
    out = {}
    async with dht_swarm(n, seed=seed) as swarm:
        for count in counts:
            rng = random.Random(seed)
            top1, overlaps, rounds, messages = [], [], [], []
            k = TEST_CONFIG.k if count is None else count
            for _ in range(lookups):
                dht = rng.choice(swarm.dhts)
                target = random_id(rng=rng)
                res = await dht.find_nearest(target, count=count)
                got = [c.peer for c in res.nearest][:k]
                truth = [p for p in swarm.brute_force_nearest(target, k + 1) if p != dht.peer_id]
                truth = truth[:k]
                top1.append(got[:1] == truth[:1])
                overlaps.append(len(set(got) & set(truth)) / len(truth))
                rounds.append(res.rounds)
                messages.append(res.messages)
            out[count] = (
                statistics.mean(top1),
                statistics.mean(overlaps),
                statistics.mean(rounds),
                statistics.mean(messages),
            )
    return out


@pytest.fixture(scope="module")
def lookups_64() -> dict[int | None, tuple[float, float, float, float]]:
    """20 lookups on one 64-node swarm, for all k and for 6 nodes (one swarm: it is the cost)."""
    return run_sim(_lookup_accuracy, 64, 20, 1, (None, 6))


def test_lookups_find_the_true_k_nearest(lookups_64) -> None:
    top1, overlap, rounds, _ = lookups_64[None]
    assert top1 >= 0.95, top1
    assert overlap >= 0.95, overlap
    assert rounds >= 1


def test_a_lookup_for_fewer_nodes_finds_them_with_fewer_messages(lookups_64) -> None:
    """Stores to 6 replicas and followers of 3 holders look up only as many nodes as they use."""
    full = lookups_64[None]
    top1, overlap, _, messages = lookups_64[6]
    assert top1 >= 0.95, top1
    assert overlap >= 0.95, overlap
    assert messages < full[3] / 2, (messages, full[3])


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_lookups_find_the_true_k_nearest_500() -> None:
    top1, overlap, _, _ = run_sim(_lookup_accuracy, 500, 50, 2)[None]
    assert top1 >= 0.95, top1
    assert overlap >= 0.9, overlap


def test_value_survives_30_percent_of_nodes_dying() -> None:
    async def main() -> None:
        rng = random.Random(3)
        async with dht_swarm(30, seed=3, silent_failures=True) as swarm:
            keys = {f"key-{i}": {"i": i, "blob": bytes(range(i))} for i in range(6)}
            for key, value in keys.items():
                res = await rng.choice(swarm.dhts).store(key, value, trio.current_time() + 3600)
                assert res.stored >= TEST_CONFIG.replication * 0.9
            victims = rng.sample(range(len(swarm.dhts)), k=9)  # 30%
            for v in victims:
                swarm.net.kill(swarm.hosts[v])
            alive = [d for i, d in enumerate(swarm.dhts) if i not in victims]
            for key, value in keys.items():
                got = await rng.choice(alive).get(key)
                assert got is not None and got.value == value, key

    run_sim(main)


def test_partition_heals() -> None:
    async def main() -> None:
        async with dht_swarm(24, seed=4) as swarm:
            a, b = swarm.hosts[:12], swarm.hosts[12:]
            side_a, side_b = swarm.dhts[:12], swarm.dhts[12:]
            swarm.net.partition(a, b)
            res = await side_a[3].store("made-in-a", "hello", trio.current_time() + 3600)
            assert res.stored >= 1
            assert (await side_a[7].get("made-in-a")).value == "hello"
            assert await side_b[5].get("made-in-a") is None  # B cannot see A's nodes
            await trio.sleep(30)
            swarm.net.heal()
            # bans of unreachable peers expire (at most blacklist_max), then lookups cross again
            await trio.sleep(TEST_CONFIG.blacklist_max + 1)
            got = await side_b[5].get("made-in-a")
            assert got is not None and got.value == "hello"
            # the two halves form one DHT again: lookups from B find the global nearest
            target = key_id("made-in-a")
            res = await side_b[9].find_nearest(target)
            truth = [p for p in swarm.brute_force_nearest(target, 21) if p != side_b[9].peer_id]
            found = {c.peer for c in res.nearest}
            assert len(found & set(truth[:20])) >= 19
            assert found & {d.peer_id for d in side_a}

    run_sim(main)


def test_expired_values_disappear() -> None:
    async def main() -> None:
        async with dht_swarm(14, seed=5) as swarm:
            writer, reader = swarm.dhts[2], swarm.dhts[13]
            await writer.store("short", 1, writer.now() + 30)
            await writer.store("long", 2, writer.now() + 300)
            assert (await reader.get("short")).value == 1
            await trio.sleep(31)
            assert await reader.get("short") is None
            assert (await reader.get("long")).value == 2
            await trio.sleep(TEST_CONFIG.maintenance_interval + 1)  # purge ran everywhere
            assert all("short" not in d.storage for d in swarm.dhts)
            assert any("long" in d.storage for d in swarm.dhts)

    run_sim(main)


PROGRESS = SchemaValidator("progress", Struct({"epoch": Int(min=0), "samples": Int(min=0)}))


def test_subkeys_merge_and_schema_refusals_reach_the_writer() -> None:
    async def main() -> None:
        async with dht_swarm(16, seed=6, validators=[PROGRESS]) as swarm:
            now = trio.current_time()
            writers = swarm.dhts[:5]
            for i, d in enumerate(writers):
                sub = owner_marker(d.peer_id)
                await d.store("progress", {"epoch": 1, "samples": i}, now + 100, subkey=sub)
            first = owner_marker(writers[0].peer_id)
            await writers[0].store("progress", {"epoch": 2, "samples": 7}, now + 200, subkey=first)
            got = await swarm.dhts[15].get("progress")
            assert set(got) == {owner_marker(d.peer_id) for d in writers}
            assert got[owner_marker(writers[0].peer_id)].value == {"epoch": 2, "samples": 7}
            assert got[owner_marker(writers[3].peer_id)].value == {"epoch": 1, "samples": 3}
            # an older update of a subkey loses
            await writers[0].store("progress", {"epoch": 0, "samples": 0}, now + 150, subkey=first)
            got = await swarm.dhts[11].get("progress")
            assert got[owner_marker(writers[0].peer_id)].value["epoch"] == 2
            # invalid values: refused locally...
            with pytest.raises(InvalidRecordError, match="samples below 0"):
                await writers[1].store(
                    "progress",
                    {"epoch": 1, "samples": -1},
                    now + 100,
                    subkey=owner_marker(writers[1].peer_id),
                )
            # ...and by every remote node, whose reason the writer sees
            lax = swarm.dhts[12]
            lax.validators.validators = lax.validators.validators[:2]  # a node without the schema
            bad = lax.make_record(
                "progress", {"epoch": "x", "samples": 1}, now + 100, owner_marker(lax.peer_id)
            )
            (res,) = await lax.store_records([bad])
            assert len(res.refused) == len(swarm.dhts) - 1
            assert all("schema of 'progress'" in r for r in res.refused.values())
            lax_sub = owner_marker(lax.peer_id)
            assert all(lax_sub not in d.storage.get("progress", d.now()) for d in swarm.dhts[:12])
            # when nobody at all holds it, the store raises with the reason
            lax.protocol.client_mode = lax.client_mode = True
            with pytest.raises(InvalidRecordError, match="value.epoch must be an integer"):
                await lax.store_records([bad])

    run_sim(main)


def test_forged_writes_to_a_signed_subkey_are_refused_everywhere() -> None:
    async def main() -> None:
        async with dht_swarm(16, seed=7) as swarm:
            owner, thief = swarm.dhts[4], swarm.dhts[9]
            sub = owner_marker(owner.peer_id)
            now = trio.current_time()
            await owner.store("progress", {"epoch": 3}, now + 100, subkey=sub)
            forgeries = [
                Record("progress", sub, pack_value({"epoch": 99}), now + 500),  # unsigned
                sign_record(
                    Record("progress", sub, pack_value({"epoch": 99}), now + 500),
                    thief.node.identity,
                ),  # signed by the wrong key
                Record(
                    "progress",
                    sub,
                    pack_value({"epoch": 99}),
                    now + 500,
                    (await owner.get_view("progress"))[sub].proof,
                ),  # replayed signature
            ]
            with pytest.raises(InvalidRecordError):
                await thief.store("progress", {"epoch": 99}, now + 500, subkey=sub)
            honest = [d for d in swarm.dhts if d is not thief]
            for forged in forgeries:
                for d in honest:
                    contact = Contact(d.peer_id, tuple(d.node.addrs))
                    answers = await thief.protocol.store(contact, [forged])
                    assert isinstance(answers[0], str), answers  # a reason, not stored
            # a malicious node answering FIND with a forged record: readers drop it
            thief.storage.store(forgeries[0], thief.now())
            for d in random.Random(0).sample(honest, 5):
                got = await d.get("progress")
                assert got[sub].value == {"epoch": 3}
            for d in honest:
                held = d.storage.get("progress", d.now())
                assert held is None or held[sub].decoded() == {"epoch": 3}

    run_sim(main)


def test_client_mode_queries_but_never_enters_routing_tables() -> None:
    async def main() -> None:
        async with dht_swarm(12, seed=8) as swarm:
            client = await swarm.add(
                99, [str(swarm.dhts[0].node.addrs[0])], config=TEST_CONFIG, client_mode=True
            )
            res = await client.store("from-client", [1, 2, 3], trio.current_time() + 60)
            assert res.stored == 12
            assert (await swarm.dhts[6].get("from-client")).value == [1, 2, 3]
            assert (await client.get("from-client")).value == [1, 2, 3]
            assert all(client.peer_id not in d.routing for d in swarm.dhts)
            assert "from-client" not in client.storage

    run_sim(main)


def test_bootstrap_fails_clearly_when_no_initial_peer_answers() -> None:
    async def main() -> None:
        async with dht_swarm(2, seed=9) as swarm:
            host = swarm.net.add_host("lonely")
            dead = swarm.hosts[1]
            addr = str(swarm.dhts[1].node.addrs[0])
            swarm.net.kill(dead)
            async with open_node(transport=host.transport, listen=[host.listen_addr]) as node:
                with pytest.raises(BootstrapError, match="none of the 1 initial peers answered"):
                    async with open_dht(node, initial_peers=[addr], config=TEST_CONFIG):
                        pass

    run_sim(main)


def test_bootstrapping_from_a_dht_client_says_it_serves_no_requests() -> None:
    """A `serve` node behind a NAT became a DHT client: naming it as the initial peer fails
    with why (it serves no DHT requests; a public node is needed), not a bare "no answer"."""

    async def main() -> None:
        async with dht_swarm(2, seed=9) as swarm:
            behind_nat = swarm.dhts[1]
            behind_nat.set_client_mode(True)
            addr = str(behind_nat.node.addrs[0])
            host = swarm.net.add_host("newcomer")
            async with open_node(transport=host.transport, listen=[host.listen_addr]) as node:
                with pytest.raises(BootstrapError, match="serves no DHT requests.*public one"):
                    async with open_dht(node, initial_peers=[addr], config=TEST_CONFIG):
                        pass

    run_sim(main)


def test_concurrent_gets_of_one_key_share_one_search_and_stores_batch_keys() -> None:
    async def main() -> None:
        async with dht_swarm(12, seed=10) as swarm:
            d = swarm.dhts[3]
            await swarm.dhts[8].store("shared", "v", trio.current_time() + 60)
            before = len(d.lookups)
            results = []

            async def get() -> None:
                results.append(await d.get("shared"))

            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(get)
            assert len(d.lookups) == before + 1
            assert [r.value for r in results] == ["v"] * 5
            # several keys in one store: one STORE message per target node
            sent = d.protocol.stats["dht.store"]
            recs = [d.make_record(f"batch-{i}", i, d.now() + 60) for i in range(6)]
            results = await d.store_records(recs)
            assert all(r.stored == 12 for r in results)
            assert d.protocol.stats["dht.store"] - sent <= len(swarm.dhts) - 1

    run_sim(main)


def test_clock_skew_is_corrected_by_the_median() -> None:
    async def main() -> None:
        rng = random.Random(11)
        skews = [rng.uniform(-2, 2) for _ in range(15)]
        skews[5] = 500.0  # one node with a clock far ahead
        skews[6] = -300.0
        async with dht_swarm(12, seed=11, skews=skews) as swarm:
            for d in swarm.dhts:  # talk to everyone so every node has samples
                await d.find_nearest(random_id(rng=rng))
            truth = trio.current_time()
            assert abs(swarm.dhts[5].now() - truth) < 3
            assert abs(swarm.dhts[6].now() - truth) < 3
            await swarm.dhts[5].store("skewed", "x", swarm.dhts[5].now() + 60)
            await trio.sleep(50)
            assert (await swarm.dhts[0].get("skewed")).value == "x"
            await trio.sleep(15)
            assert await swarm.dhts[0].get("skewed") is None

    run_sim(main)


def test_new_nodes_receive_values_they_are_now_nearest_to() -> None:
    async def main() -> None:
        async with dht_swarm(10, seed=12) as swarm:
            await swarm.dhts[0].store("handoff", 42, trio.current_time() + 600)
            joined = []
            for i in range(10, 24):
                joined.append(
                    await swarm.add(i, [str(swarm.dhts[i % 10].node.addrs[0])], config=TEST_CONFIG)
                )
                swarm.dhts.append(joined[-1])
            await trio.sleep(5)
            kid = key_id("handoff")
            nearest_new = sorted(joined, key=lambda d: node_id(d.peer_id) ^ kid)[:5]
            assert sum("handoff" in d.storage for d in nearest_new) >= 4

    run_sim(main)


def test_republish_restores_lost_replicas_and_gets_cache_along_the_path() -> None:
    config = TEST_CONFIG.replace(
        replication=3, get_quorum=0, republish_interval=30.0, maintenance_interval=10.0
    )

    async def main() -> None:
        async with dht_swarm(16, seed=13, config=config) as swarm:
            await swarm.dhts[0].store("kept", "v", trio.current_time() + 3600)
            holders = [d for d in swarm.dhts if "kept" in d.storage]
            assert len(holders) == 3
            for d in holders[1:]:  # two replicas lose their data
                d.storage.remove("kept")
            await trio.sleep(45)  # the survivor's republish puts them back
            assert sum("kept" in d.storage for d in swarm.dhts) >= 3
            # a full lookup caches the value at the nearest node past the replicas
            reader = next(d for d in swarm.dhts if "kept" not in d.storage)
            assert (await reader.get("kept")).value == "v"
            await trio.sleep(1)
            assert any("kept" in d.cache for d in swarm.dhts)

    run_sim(main)
