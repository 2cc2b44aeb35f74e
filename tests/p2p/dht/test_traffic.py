"""The DHT's requests are tallied by message and purpose (p2p.dht.traffic)."""

from __future__ import annotations

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
