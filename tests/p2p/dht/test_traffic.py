"""The DHT's requests are tallied by message and purpose (p2p.dht.traffic)."""

from __future__ import annotations

import trio

from p2p.dht import DHTConfig
from p2p.dht.ids import node_id
from p2p.dht.traffic import key_kind, purpose
from p2p.testing import run_sim

from .swarm import TEST_CONFIG, dht_swarm


def test_key_kinds_blank_numbers_and_owners() -> None:
    assert key_kind("run.group.17.x") == "run.group.#.x"
    assert key_kind("nat.addrs.[owner:QmAbc9]") == "nat.addrs.[]"


def test_requests_are_tallied_by_purpose_or_key() -> None:
    async def main() -> None:
        async with dht_swarm(12, seed=3, config=TEST_CONFIG) as swarm:
            writer = swarm.dhts[4]
            traffic = writer.protocol.traffic
            traffic.bytes.clear()
            traffic.requests.clear()
            await writer.store("run.group.3", {"n": 1}, writer.now() + 600)
            # a store names its key's kind; its lookup says what it located
            assert traffic.bytes["dht.store/run.group.#"] > 0
            assert traffic.bytes["dht.find/locate run.group.#"] > 0
            with purpose("mine"):
                await writer.store("other", {"n": 2}, writer.now() + 600)
            assert traffic.bytes["dht.store/mine"] > 0
            assert "dht.store/other" not in traffic.bytes
            await writer.maintain()  # nothing stale yet: no refresh lookups, no republish
            assert set(traffic.requests) <= {
                "dht.store/run.group.#",
                "dht.find/locate run.group.#",
                "dht.store/mine",
                "dht.find/mine",
                "dht.ping/refresh",
            }

    run_sim(main)


def test_empty_stale_buckets_share_one_lookup_of_our_own_id() -> None:
    """In a 40-node swarm with small buckets, the buckets near a node's ID are empty: once
    stale, they are refreshed by one lookup of its own ID, not one lookup each; the buckets
    that hold nodes still get one each, and the table loses nothing."""
    lookups: list[int] = []

    async def main() -> None:
        config = TEST_CONFIG.replace(
            k=4, replication=4, refresh_interval=100.0, maintenance_interval=1e6
        )
        async with dht_swarm(40, seed=5, config=config) as swarm:
            await trio.sleep(101)
            now = trio.current_time()
            dht = max(
                swarm.dhts,
                key=lambda d: sum(1 for b in d.routing.stale_buckets(now, 100.0) if not b.peers),
            )
            stale = dht.routing.stale_buckets(now, config.refresh_interval)
            empty = sum(1 for b in stale if not b.peers)
            assert empty >= 2, empty
            known = len(dht.routing)
            find_nearest = dht.find_nearest

            async def counted(target, *args, **kwargs):
                lookups.append(target)
                return await find_nearest(target, *args, **kwargs)

            dht.find_nearest = counted
            await dht.maintain()
            assert len(lookups) == len(stale) - empty + 1, (len(lookups), len(stale), empty)
            assert len(dht.routing) >= known
            assert dht.protocol.traffic.requests["dht.find/refresh"] > 0
            assert not dht.routing.stale_buckets(trio.current_time(), 100.0)

    run_sim(main)


def test_a_lookup_for_a_few_nodes_asks_each_for_no_more() -> None:
    """A store to 6 replicas (a progress record, a relay advert) looked up the key's nearest
    with answers of k (20) contacts each, of which it keeps a beam of 6: each answer now
    carries the beam, and the lookup still finds the key's nearest nodes. A full lookup still
    gets k per answer."""
    from p2p.dht.ids import key_id

    async def main() -> None:
        async with dht_swarm(40, seed=5, config=TEST_CONFIG) as swarm:
            reader = swarm.dhts[7]
            sizes: list[int] = []
            send = reader._batcher._send

            async def counting(contact, queries, *count):
                answers = await send(contact, queries, *count)
                sizes.extend(len(contacts) for contacts, _ in answers or ())
                return answers

            reader._batcher._send = counting
            for key in ("progress", "nat.relays", "run.group.3"):
                target = key_id(key)
                found = await reader.find_nearest(target, key, count=6)
                expected = [p for p in swarm.brute_force_nearest(target, 7) if p != reader.peer_id]
                assert [c.peer for c in found.nearest] == expected[:6]
            assert sizes and max(sizes) <= 6
            sizes.clear()
            await reader.find_nearest(key_id("progress"), "progress")
            assert max(sizes) == TEST_CONFIG.k

    run_sim(main)


def test_a_bucket_refresh_is_a_small_lookup_and_keeps_the_table() -> None:
    """A stale bucket's refresh looks up a random ID of its range for alpha nodes: each
    answer carries 2 * alpha contacts, not k (a full lookup per bucket every refresh was most
    of an idle node's bytes). The buckets are fresh afterwards and the table lost nothing;
    dead nodes the refresh met left it."""

    async def main() -> None:
        config = TEST_CONFIG.replace(refresh_interval=100.0, maintenance_interval=1e6)
        async with dht_swarm(40, seed=5, config=config) as swarm:
            for host in swarm.hosts[30:]:
                swarm.net.kill(host)
            await trio.sleep(101)
            dht = swarm.dhts[3]
            dead = {d.peer_id for d in swarm.dhts[30:]}
            sizes: list[int] = []
            send = dht._batcher._send

            async def counting(contact, queries, *count):
                answers = await send(contact, queries, *count)
                sizes.extend(len(contacts) for contacts, _ in answers or ())
                return answers

            dht._batcher._send = counting
            live_before = {e.peer for e in dht.routing.peers()} - dead
            assert dht.routing.stale_buckets(trio.current_time(), config.refresh_interval)
            await dht.maintain()
            assert sizes and max(sizes) <= 2 * config.alpha, sizes
            assert not dht.routing.stale_buckets(trio.current_time(), config.refresh_interval)
            assert live_before <= {e.peer for e in dht.routing.peers()}
            assert dht.protocol.stats["failures"] > 0  # it met dead nodes, and banned them

    run_sim(main)


def test_republish_skips_records_that_expire_before_the_next_one() -> None:
    """A held record that no STORE brought for the republish interval is re-sent to the
    nearest nodes, unless it expires before the next republish would come: that one is its
    writer's to renew (relay adverts, progress reports), and re-sending it cost a lookup and
    a store to every replica per key and interval."""
    config = TEST_CONFIG.replace(
        replication=3, get_quorum=0, republish_interval=300.0, maintenance_interval=10.0
    )

    async def main() -> None:
        async with dht_swarm(16, seed=13, config=config) as swarm:
            now = trio.current_time()
            await swarm.dhts[0].store("lasting", "v", now + 3600)
            await swarm.dhts[0].store("brief", "v", now + 500)
            for key in ("lasting", "brief"):
                holders = [d for d in swarm.dhts if key in d.storage]
                assert len(holders) == 3
                for d in holders[1:]:  # two replicas lose their data
                    d.storage.remove(key)
            await trio.sleep(320)  # the survivors' republish
            assert sum("lasting" in d.storage for d in swarm.dhts) >= 3
            assert sum("brief" in d.storage for d in swarm.dhts) == 1
            assert sum(d.protocol.stats["republished"] for d in swarm.dhts) >= 1

    run_sim(main)


def test_an_idle_swarm_under_the_fast_preset_costs_little_upkeep() -> None:
    """The preset runs use (``DHTConfig.fast``) refreshes a bucket no lookup went through
    for 10 minutes and republishes hourly: over an hour, an idle 16-node swarm holding a few
    long-lived records spends under 40 B/s per node on upkeep (26 measured; refreshing every
    2 minutes and republishing every 5, it spent 363)."""
    config = DHTConfig.fast()

    async def main() -> None:
        async with dht_swarm(16, seed=3, config=config) as swarm:
            for i, d in enumerate(swarm.dhts[:5]):
                await d.store(f"kept{i}", "v", trio.current_time() + 3 * 3600)
            await trio.sleep(300)
            before = sum(sum(d.protocol.traffic.bytes.values()) for d in swarm.dhts)
            await trio.sleep(3700)
            after = sum(sum(d.protocol.traffic.bytes.values()) for d in swarm.dhts)
            per_node = (after - before) / len(swarm.dhts) / 3700
            assert per_node < 40, per_node
            for i in range(5):  # still there
                assert (await swarm.dhts[-1 - i].get(f"kept{i}")).value == "v"

    run_sim(main)


def test_a_small_network_greets_its_initial_peers_once_per_refresh_interval() -> None:
    """A table short of k may mean a node is being cut off, so maintenance greets the
    initial peers: in a network smaller than k + 1 nodes it always is, and greeting at every
    maintenance pinged them every 10 s. Now once per refresh interval, and at once when the
    table shrinks."""
    config = DHTConfig.fast()

    async def main() -> None:
        async with dht_swarm(8, seed=3, config=config) as swarm:
            dht = swarm.dhts[5]
            pings = dht.protocol.traffic.requests
            await trio.sleep(30)
            before = pings["dht.ping/refresh"]
            await trio.sleep(config.refresh_interval)
            assert pings["dht.ping/refresh"] - before <= 2 * len(dht.initial_peers)
            before = pings["dht.ping/refresh"]
            swarm.net.kill(swarm.hosts[6])
            swarm.net.kill(swarm.hosts[7])
            with trio.move_on_after(120):  # a lookup meets the dead ones: they leave the table
                while len(dht.routing) > 5:
                    await dht.find_nearest(node_id(swarm.dhts[6].peer_id))
                    await trio.sleep(5)
            assert len(dht.routing) <= 5
            await trio.sleep(2 * config.maintenance_interval)
            assert pings["dht.ping/refresh"] > before

    run_sim(main)


def test_a_node_cut_off_from_everyone_greets_again_until_it_is_back() -> None:
    """A node partitioned from the rest drops every contact that keeps failing; its table
    shrinks no more once empty, so it greeted its initial peers again only a refresh interval
    later, and after the heal it stayed a DHT of its own that long (two pairs of trainers
    that averaged apart never read each other's records: issue 46). A greeting that reached
    nobody is now tried again at every maintenance."""
    config = DHTConfig.fast()

    async def main() -> None:
        async with dht_swarm(6, seed=2, config=config) as swarm:
            cut, dht = swarm.hosts[5], swarm.dhts[5]
            assert len(dht.routing) >= 3
            swarm.net.partition([cut], swarm.hosts[:5])
            for _ in range(30):  # lookups meet failures: the contacts leave the table
                await dht.find_nearest(node_id(swarm.dhts[0].peer_id))
                await trio.sleep(2.0)
            assert len(dht.routing) == 0
            swarm.net.heal()
            healed = trio.current_time()
            while len(dht.routing) < 3 and trio.current_time() - healed < 300.0:
                await trio.sleep(5.0)
            back = trio.current_time() - healed
            print(f"back in the DHT {back:.0f} s after the heal")
            assert len(dht.routing) >= 3
            assert back < config.refresh_interval / 2

    run_sim(main)
