"""State download when the newest state's only donor is dead (found by ``bench.chaos``).

A donor killed (SIGKILL, crash) leaves its announcement in the DHT until it expires. When that
was the newest announced state, a newcomer must not fail until then: it takes the newest state
that another announcing peer holds now.
"""

from __future__ import annotations

import numpy as np
import trio

from dedloc_jax.state.download import download_state
from dedloc_jax.state.serving import StateServer
from p2p.testing import SimNetwork, host_of, run_sim
from tests.dedloc_jax.simcollab import open_sim_dhts


def _state(epoch: int) -> list[np.ndarray]:
    rng = np.random.default_rng(epoch)
    return [rng.normal(size=(50, 40)).astype(np.float32), np.array(epoch, np.int32)]


def test_newest_donor_dead_newcomer_takes_the_newest_live_state() -> None:
    async def main() -> None:
        net = SimNetwork(seed=4)
        async with open_sim_dhts(net, 4, latency=0.01) as peers:
            servers = []
            for i, epoch in ((1, 5), (2, 4)):  # peer 1 serves epoch 5, peer 2 epoch 4
                node, dht = peers[i]
                server = StateServer(node, dht, "run", chunk_bytes=4096, ttl=lambda: 60.0)
                server.register()
                server.set_state(_state(epoch), epoch=epoch)
                await server.announce()
                servers.append(server)
            await trio.sleep(1.0)
            net.kill(host_of(net, peers[1][0]))  # its announcement stays for 60 s
            node, dht = peers[3]
            epoch, arrays, used = await download_state(
                node, dht, "run", timeout=30.0, request_timeout=2.0
            )
            assert epoch == 4 and used == 1
            for got, want in zip(arrays, _state(4), strict=True):
                assert got.tobytes() == want.tobytes()

    run_sim(main, seed=4)
