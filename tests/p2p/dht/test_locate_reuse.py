"""Stores of one key reuse the nearest nodes found by a recent lookup (``locate_ttl``)."""

from __future__ import annotations

import trio

from p2p.dht import DHTConfig
from p2p.dht.ids import key_id, node_id
from p2p.dht.records import decode_view
from p2p.testing import run_sim, sim_identity

from .swarm import TEST_CONFIG, dht_swarm

CONFIG = TEST_CONFIG.replace(locate_ttl=10.0)


def test_a_frequent_writer_skips_the_lookup_until_a_target_fails_or_the_ttl_ends() -> None:
    async def main() -> None:
        async with dht_swarm(26, seed=7, config=CONFIG, silent_failures=True) as swarm:
            writer, reader = swarm.dhts[3], swarm.dhts[20]
            finds = writer.protocol.stats

            async def store(n: int):
                before = finds["dht.find"]
                res = await writer.store("progress", {"n": n}, writer.now() + 600)
                return res, finds["dht.find"] - before

            first, looked = await store(1)
            assert looked > 0 and first.stored >= CONFIG.replication - 1
            second, looked = await store(2)
            assert looked == 0  # the same targets as the first store, no lookup
            assert second.stored == first.stored
            assert (await reader.get("progress")).value == {"n": 2}
            # a target dies: the store to it fails, it is banned, and the next store looks again
            target = next(
                i for i, d in enumerate(swarm.dhts) if d is not writer and "progress" in d.storage
            )
            swarm.net.kill(swarm.hosts[target])
            third, looked = await store(3)
            assert looked == 0 and third.failed == 1
            fourth, looked = await store(4)
            assert looked > 0 and fourth.failed == 0
            assert fourth.stored >= CONFIG.replication - 2
            await trio.sleep(CONFIG.locate_ttl + 1)  # stale: looked up again
            _, looked = await store(5)
            assert looked > 0
            assert (await reader.get("progress")).value == {"n": 5}

    run_sim(main)


def test_a_whole_read_locates_the_key_for_the_next_store_and_repairs_only_when_asked() -> None:
    async def main() -> None:
        async with dht_swarm(26, seed=8, config=CONFIG) as swarm:
            writer, reader = swarm.dhts[2], swarm.dhts[17]
            await writer.store("state", {"e": 1}, writer.now() + 600, subkey="w", replicas=2)
            holders = [d for d in swarm.dhts if "state" in d.storage]
            assert 1 <= len(holders) <= 2
            stats = reader.protocol.stats
            before = stats["dht.store"]
            assert (await reader.get("state", quorum=0, repair=False))["w"].value == {"e": 1}
            await trio.sleep(1.0)  # repairs would run in the background now
            assert stats["dht.store"] == before
            assert [d for d in swarm.dhts if "state" in d.storage] == holders
            # The whole read found the key's nearest nodes: a store of it needs no lookup.
            finds = stats["dht.find"]
            await reader.store("state", {"e": 2}, reader.now() + 600, subkey="r")
            assert stats["dht.find"] == finds
            # By default a read gives the nodes that lack records what they miss.
            await reader.get("state", quorum=0)
            await trio.sleep(1.0)
            assert len([d for d in swarm.dhts if "state" in d.storage]) > len(holders)

    run_sim(main)


def test_by_default_stores_reuse_the_lookup_and_a_failed_target_drops_it_after_its_ban() -> None:
    """The default (1800 s) outlives a failed target's short ban: the failure itself makes the
    next store look the key up again, not the ban."""
    config = TEST_CONFIG  # the fast preset's default locate_ttl
    assert config.locate_ttl > 10 * config.blacklist_base

    async def main() -> None:
        async with dht_swarm(26, seed=7, config=config, silent_failures=True) as swarm:
            writer = swarm.dhts[3]
            stats = writer.protocol.stats

            async def store(n: int):
                before = stats["dht.find"]
                res = await writer.store("progress", {"n": n}, writer.now() + 600)
                return res, stats["dht.find"] - before

            await store(1)
            _, looked = await store(2)
            assert looked == 0
            target = next(
                i for i, d in enumerate(swarm.dhts) if d is not writer and "progress" in d.storage
            )
            swarm.net.kill(swarm.hosts[target])
            failed, looked = await store(3)
            assert looked == 0 and failed.failed == 1
            await trio.sleep(config.blacklist_base + 1)  # its first ban is over
            again, looked = await store(4)
            assert looked > 0 and again.failed == 0

    run_sim(main)


def test_a_node_heard_from_since_the_lookup_and_nearer_the_key_makes_the_store_look_again() -> None:
    """A newcomer nearest the key gets the next store directly, not only the stale records
    of its handoff until the remembered lookup ends."""

    async def main() -> None:
        async with dht_swarm(26, seed=9) as swarm:
            writer = swarm.dhts[4]
            newcomer_id = node_id(sim_identity(swarm.net, 26).peer_id)
            key = next(
                f"k{n}"
                for n in range(10_000)
                if all(
                    newcomer_id ^ key_id(f"k{n}") < node_id(d.peer_id) ^ key_id(f"k{n}")
                    for d in swarm.dhts
                )
            )
            stats = writer.protocol.stats
            await writer.store(key, 1, writer.now() + 600)
            newcomer = await swarm.add(26, [str(writer.node.addrs[0])], config=TEST_CONFIG)
            await trio.sleep(5.0)  # joined, and heard of by the writer
            assert newcomer.peer_id in writer.routing
            before = stats["dht.find"]
            await writer.store(key, 2, writer.now() + 600)
            assert stats["dht.find"] > before
            assert decode_view(newcomer.storage.get(key, newcomer.now())).value == 2
            # and with nothing new heard of, the next store reuses this lookup
            before = stats["dht.find"]
            await writer.store(key, 3, writer.now() + 600)
            assert stats["dht.find"] == before

    run_sim(main)


def test_renewals_ten_minutes_apart_reuse_one_lookup_for_half_an_hour() -> None:
    """A record renewed every 10 minutes (a DiLoCo peer's progress far from its outer step)
    is stored to the nodes its last lookup found for ``locate_ttl`` (30 minutes by default):
    only churn (a failed store, a nearer node) looks again sooner. At 10 minutes every renewal
    looked the key up: 5% of a 40-peer DiLoCo run's bytes."""
    config = TEST_CONFIG.replace(locate_ttl=DHTConfig().locate_ttl)

    async def main() -> None:
        async with dht_swarm(26, seed=7, config=config) as swarm:
            writer = swarm.dhts[3]
            stats = writer.protocol.stats
            looked = []
            for n in range(4):
                before = stats["dht.find"]
                res = await writer.store("progress", {"n": n}, writer.now() + 1800)
                assert res.stored
                looked.append(stats["dht.find"] - before > 0)
                await trio.sleep(620)
            assert looked == [True, False, False, True]

    run_sim(main)
