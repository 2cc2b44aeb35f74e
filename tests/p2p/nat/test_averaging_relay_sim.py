"""Averaging through a relay on the simulator (the namespace lab's test, without root).

Two peers behind NAT (no inbound path but a reservation on the relay) and the public relay
average over several rounds; the NATed pair can only reach each other through the relay,
whose small circuit budget forces renewals between rounds. Every member must hold the same
bits after each round.
"""

from __future__ import annotations

import hashlib
from contextlib import AsyncExitStack

import numpy as np
import trio

from p2p.nat import RelayConfig, RelayService, attach, circuit_addr
from p2p.node import NodeConfig, open_node
from p2p.testing import SimNetwork, run_sim, sim_identity

SIZE = 1 << 18  # float32 values: 1 MB per peer and round
ROUNDS = 4


def _vector(i: int) -> np.ndarray:
    return np.random.default_rng(500 + i).standard_normal(SIZE, dtype=np.float32)


def test_nated_peers_average_bit_identically_through_a_renewed_relay():
    from dedloc_jax.averaging import AveragingService, GroupSpec, Member, all_reduce
    from dedloc_jax.averaging.partition import FRACTION_GRID

    digests: list[set[str]] = []
    out: dict = {}

    async def main():
        net = SimNetwork(seed=5)
        async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
            nodes, services = [], []
            for i in range(3):
                host = net.add_host(f"h{i}", reachable=i == 0, upload_bps=50e6, download_bps=50e6)
                node = await stack.enter_async_context(
                    open_node(
                        sim_identity(net, i),
                        transport=host.transport,
                        listen=[host.listen_addr],
                        config=NodeConfig.testing().replace(call_timeout=60.0),
                    )
                )
                services.append(AveragingService(node))
                nodes.append(node)
            relay, a, b = nodes
            limits = RelayConfig.testing().replace(
                max_circuit_bytes=4 << 20, max_circuits_per_peer=4
            )
            service = RelayService(relay, limits)
            service.register()
            for n in (a, b):
                await nursery.start(attach(n).listen, relay.addrs[0], n.accept_inbound)
            a.peerstore.add_addrs(b.peer_id, [circuit_addr(relay.addrs[0], b.peer_id)])
            b.peerstore.add_addrs(a.peer_id, [circuit_addr(relay.addrs[0], a.peer_id)])
            third = FRACTION_GRID // 3
            spec = GroupSpec(
                tuple(
                    Member(str(n.peer_id), "node", weight=float(i + 1)) for i, n in enumerate(nodes)
                ),
                b"relay",
                (third, third, FRACTION_GRID - 2 * third),
            )
            for rnd in range(ROUNDS):
                results = [None] * 3

                async def one(i: int, rnd: int = rnd, results: list = results) -> None:
                    res = await all_reduce(
                        services[i],
                        spec,
                        {"g": _vector(i)},
                        codec="none",
                        timeout=600.0,
                        round_id=f"r{rnd}".encode(),
                    )
                    results[i] = res.vector

                async with trio.open_nursery() as group:
                    for i in range(3):
                        group.start_soon(one, i)
                digests.append({hashlib.sha256(v.tobytes()).hexdigest() for v in results})
                out["mean"] = results[1]
            conn = a.connection_to(b.peer_id)
            out["a_to_b"] = str(conn.remote_addr) if conn is not None else None
            out["cuts"] = dict(service.stats.cuts)
            out["renewed"] = attach(a).renewed + attach(b).renewed
            out["relayed"] = service.stats.bytes_relayed
            nursery.cancel_scope.cancel()

    run_sim(main, timeout=3600)
    assert [len(d) for d in digests] == [1] * ROUNDS  # the same bits on every member
    expected = sum(_vector(i).astype(np.float64) * (i + 1) for i in range(3)) / 6.0
    np.testing.assert_allclose(out["mean"], expected, rtol=1e-5, atol=1e-5)
    assert "/p2p-circuit/" in out["a_to_b"]  # the NATed pair went through the relay
    assert out["relayed"] > ROUNDS * SIZE  # several circuit budgets in all ...
    assert out["cuts"] == {} and out["renewed"] >= 1  # ... renewed, never cut
