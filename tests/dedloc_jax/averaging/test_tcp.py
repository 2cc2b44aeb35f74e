"""The all-reduce over real TCP sockets on loopback (several nodes in one process, real clock).

Processes would only add start-up time here; ``python -m bench.allreduce`` runs one process per
peer and checks that they end with identical bits.
"""

from contextlib import AsyncExitStack

import numpy as np
import trio

from dedloc_jax.averaging import AllReduceConfig, AveragingService, GroupSpec, Member, all_reduce
from dedloc_jax.averaging.errors import AveragingError
from p2p.identity import Identity
from p2p.node import NodeConfig, open_node

from .helpers import check_survivors, make_tree


async def _open_nodes(stack: AsyncExitStack, n: int) -> list:
    nodes = []
    for i in range(n):
        node = await stack.enter_async_context(
            open_node(Identity.from_seed(f"tcp-test/{i}".encode()), config=NodeConfig.testing())
        )
        nodes.append(node)
    for a in nodes:
        for b in nodes:
            if a is not b:
                a.peerstore.add_addrs(b.peer_id, b.addrs)
    return nodes


def test_round_over_tcp_with_a_client_is_exact_and_identical():
    modes = ["node", "node", "node", "client"]
    rng = np.random.default_rng(0)
    trees = [make_tree(rng, [(64, 33), (1000,)]) for _ in modes]
    weights = [1.0, 2.0, 3.0, 4.0]
    outcome: list = [None] * len(modes)
    cfg = AllReduceConfig.testing().replace(chunk_elems=512, stall_timeout=10.0)

    async def main() -> list[str]:
        async with AsyncExitStack() as stack:
            nodes = await _open_nodes(stack, len(modes))
            services = [AveragingService(node, cfg) for node in nodes]
            members = tuple(Member(str(n.peer_id), m) for n, m in zip(nodes, modes, strict=True))
            spec = GroupSpec(members, b"tcp")

            async def one(i: int) -> None:
                outcome[i] = await all_reduce(
                    services[i], spec, trees[i], weights[i], codec="fp16", timeout=30, config=cfg
                )

            async with trio.open_nursery() as nursery:
                for i in range(len(nodes)):
                    nursery.start_soon(one, i)
            client = nodes[3]
            peers = client.connected_peers()
            assert len(peers) == 3  # it reached every reducer...
            assert all(client.connection_to(p).outbound for p in peers)  # ...dialing them all
            return [m.peer_id for m in members]

    names = trio.run(main)
    results = check_survivors(outcome, trees, weights, names, rtol=0, atol=1e-2)
    assert len(results) == 4
    assert all(s.contributors == frozenset(names) for s in results[0].shares)


def test_peer_leaving_mid_round_over_tcp_leaves_identical_results():
    modes = ["node", "node", "node"]
    rng = np.random.default_rng(1)
    trees = [make_tree(rng, [(1024, 1024)]) for _ in modes]
    weights = [1.0, 1.0, 1.0]
    outcome: list = [None] * len(modes)
    cfg = AllReduceConfig.testing().replace(chunk_elems=1 << 15, stall_timeout=10.0)
    victim_identity = Identity.from_seed(b"tcp-test/victim")

    async def main() -> list[str]:
        async with AsyncExitStack() as stack:
            nodes = await _open_nodes(stack, 2)
            members = tuple(
                Member(str(p), "node")
                for p in (nodes[0].peer_id, nodes[1].peer_id, victim_identity.peer_id)
            )
            spec = GroupSpec(members, b"tcp-leave")

            async def one(service: AveragingService, i: int) -> None:
                try:
                    outcome[i] = await all_reduce(
                        service, spec, trees[i], weights[i], codec="none", timeout=30, config=cfg
                    )
                except AveragingError as e:
                    outcome[i] = e

            async def victim(task_status=trio.TASK_STATUS_IGNORED) -> None:
                with trio.CancelScope() as scope:
                    async with open_node(victim_identity, config=NodeConfig.testing()) as node:
                        service = AveragingService(node, cfg)
                        for other in nodes:
                            node.peerstore.add_addrs(other.peer_id, other.addrs)
                        task_status.started((service, scope))
                        await one(service, 2)

            async with trio.open_nursery() as nursery:
                services = [AveragingService(node, cfg) for node in nodes]
                service, victim_scope = await nursery.start(victim)
                for node in nodes:
                    node.peerstore.add_addrs(victim_identity.peer_id, service.node.addrs)
                for i, own in enumerate(services):
                    nursery.start_soon(one, own, i)
                while not any(sum(r.held.values()) for r in service._rounds.values()):
                    await trio.sleep(0.001)  # until the victim holds some results
                victim_scope.cancel()  # then its node shuts down, mid-round
            return [m.peer_id for m in members]

    names = trio.run(main)
    assert outcome[2] is None
    results = check_survivors(outcome, trees, weights, names)
    assert len(results) == 2
