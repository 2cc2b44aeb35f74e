"""Test helper: a swarm of DHT nodes on the simulated network (real nodes, virtual time)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from p2p.dht import DHT, DHTClock, DHTConfig, RecordValidator, open_dht
from p2p.dht.ids import node_id
from p2p.node import open_node
from p2p.sim import SimHost, SimNetwork
from p2p.testing import sim_identity

# Long refresh/republish intervals keep background lookups out of the way of what a test
# measures; tests of maintenance override them.
TEST_CONFIG = DHTConfig.fast().replace(refresh_interval=3600.0, republish_interval=3600.0)


@dataclass
class Swarm:
    net: SimNetwork
    dhts: list[DHT] = field(default_factory=list)
    hosts: list[SimHost] = field(default_factory=list)
    nursery: trio.Nursery | None = None

    def brute_force_nearest(self, target: int, k: int, alive_only: bool = True) -> list:
        pairs = zip(self.dhts, self.hosts, strict=True)
        peers = [d.peer_id for d, h in pairs if h.alive or not alive_only]
        return sorted(peers, key=lambda p: node_id(p) ^ target)[:k]

    async def add(
        self,
        i: int,
        initial: Sequence[str],
        *,
        config: DHTConfig,
        client_mode: bool = False,
        skew: float = 0.0,
        validators: Sequence[RecordValidator] = (),
        latency: float = 0.005,
        host: SimHost | None = None,
    ) -> DHT:
        """Start node ``i`` (on ``host`` or a new one) and join it through ``initial``."""
        if host is None:
            host = self.net.add_host(f"n{i}", latency=latency, reachable=not client_mode)

        async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
            ident = sim_identity(self.net, i)
            async with (
                open_node(ident, transport=host.transport, listen=[host.listen_addr]) as node,
                open_dht(
                    node,
                    initial_peers=initial,
                    config=config,
                    client_mode=client_mode,
                    validators=validators,
                    clock=DHTClock(lambda: trio.current_time() + skew),
                ) as dht,
            ):
                task_status.started(dht)
                await trio.sleep_forever()

        return await self.nursery.start(run)


@asynccontextmanager
async def dht_swarm(
    n: int,
    *,
    seed: int = 0,
    config: DHTConfig = TEST_CONFIG,
    batch: int = 8,
    silent_failures: bool = False,
    skews: Sequence[float] | None = None,
    validators: Sequence[RecordValidator] = (),
) -> AsyncIterator[Swarm]:
    """``n`` DHT nodes; each joins through a random earlier node, ``batch`` at a time."""
    rng = random.Random(seed)
    swarm = Swarm(SimNetwork(seed, silent_failures=silent_failures))
    async with trio.open_nursery() as nursery:
        swarm.nursery = nursery

        def skew(i: int) -> float:
            return skews[i] if skews is not None else 0.0

        swarm.hosts.append(swarm.net.add_host("n0", latency=0.005))
        swarm.dhts.append(
            await swarm.add(
                0, [], config=config, skew=skew(0), validators=validators, host=swarm.hosts[0]
            )
        )
        for start in range(1, n, batch):
            members = range(start, min(n, start + batch))
            hosts = {j: swarm.net.add_host(f"n{j}", latency=0.005) for j in members}
            # each member of a batch joins, concurrently, through a random node already in
            vias = {j: str(rng.choice(swarm.dhts).node.addrs[0]) for j in members}
            joined: dict[int, DHT] = {}

            async def join(j: int, addr: str, host: SimHost, joined: dict[int, DHT]) -> None:
                joined[j] = await swarm.add(
                    j, [addr], config=config, skew=skew(j), validators=validators, host=host
                )

            async with trio.open_nursery() as joins:
                for j in members:
                    joins.start_soon(join, j, vias[j], hosts[j], joined)
            swarm.hosts.extend(hosts[j] for j in members)
            swarm.dhts.extend(joined[j] for j in members)
        try:
            yield swarm
        finally:
            # resetting every connection first makes the nodes' shutdown cheap
            for host in swarm.net.hosts.values():
                if host.alive:
                    swarm.net.kill(host)
            nursery.cancel_scope.cancel()
