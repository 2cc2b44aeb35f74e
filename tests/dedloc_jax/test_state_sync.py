from __future__ import annotations

import numpy as np
import pytest
import trio

from dedloc_jax.state_sync import (
    StateServer,
    StateSyncError,
    download_state,
    on_minority_fork,
    state_forked,
)
from p2p.testing import SimNetwork, host_of, run_sim
from tests.dedloc_jax.simcollab import open_sim_dhts


def _state(epoch: int) -> list[np.ndarray]:
    rng = np.random.default_rng(epoch)
    return [rng.normal(size=(300, 70)).astype(np.float32), np.array(epoch, np.int32)]


def _servers(peers, donors: range) -> list[StateServer]:
    servers = []
    for node, dht in (peers[i] for i in donors):
        server = StateServer(node, dht, "run", chunk_bytes=4096, ttl=60.0)
        server.register()
        servers.append(server)
    return servers


def test_newcomer_downloads_from_several_donors_and_survives_one_leaving() -> None:
    async def main() -> None:
        net = SimNetwork(seed=2)
        # 50 kB/s links: the 84 kB state takes seconds, so a donor can die mid-transfer.
        async with open_sim_dhts(net, 5, upload_bps=50_000, download_bps=200_000) as peers:
            servers = _servers(peers, range(3))
            for server in servers:
                server.set_state(_state(4), epoch=4)
                await server.announce()
            newcomer_node, newcomer_dht = peers[4]
            async with trio.open_nursery() as nursery:

                async def kill_a_donor() -> None:
                    await trio.sleep(0.5)
                    net.kill(host_of(net, peers[1][0]))

                nursery.start_soon(kill_a_donor)
                epoch, arrays, used = await download_state(
                    newcomer_node, newcomer_dht, "run", timeout=120.0, request_timeout=5.0
                )
            assert epoch == 4
            for got, want in zip(arrays, _state(4), strict=True):
                assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
            assert used >= 2  # chunks came from several donors
            assert servers[1].chunks_served > 0  # the killed donor had served some
            assert sum(s.chunks_served for s in servers) >= arrays[0].nbytes // 4096

    run_sim(main)


def test_a_lying_donor_is_detected_and_honest_donors_finish() -> None:
    async def main() -> None:
        net = SimNetwork(seed=3)
        async with open_sim_dhts(net, 4) as peers:
            servers = _servers(peers, range(3))
            for server in servers:
                server.set_state(_state(2), epoch=2)
                await server.announce()
            # Donor 0 corrupts every chunk it serves but keeps the honest manifest.
            digest = servers[0].latest.digest
            manifest, buffer = servers[0]._snapshots[digest]
            servers[0]._snapshots[digest] = (manifest, bytes(b ^ 0xFF for b in buffer))
            epoch, arrays, _ = await download_state(peers[3][0], peers[3][1], "run", timeout=60)
            assert epoch == 2 and arrays[0].tobytes() == _state(2)[0].tobytes()

    run_sim(main)


def test_no_donor_is_a_clear_error() -> None:
    async def main() -> None:
        net = SimNetwork(seed=4)
        async with open_sim_dhts(net, 2) as peers:
            with pytest.raises(StateSyncError, match="no peer announces"):
                await download_state(peers[1][0], peers[1][1], "run", timeout=30)

    run_sim(main)


def test_the_lineage_more_peers_hold_wins_and_one_side_of_a_tie_moves() -> None:
    a, b = b"\x01" * 32, b"\x02" * 32
    # 3 others hold b at epoch 5, 1 other holds a (2 with us): a loses.
    assert on_minority_fork({(5, b): 3, (5, a): 1}, 5, a)
    assert not on_minority_fork({(5, a): 1, (5, b): 2}, 5, b)  # the majority stays
    # 1 against 1 (one other peer and us): the smaller digest stays, the larger moves.
    assert not on_minority_fork({(5, b): 1}, 5, a)
    assert on_minority_fork({(5, a): 1}, 5, b)
    # other epochs are not forks (being behind is the tracker's business)
    assert not on_minority_fork({(6, b): 9, (4, b): 9}, 5, a)
    assert not on_minority_fork({}, 5, a)


def test_after_a_healed_partition_the_minority_side_finds_its_state_lost() -> None:
    """Two sides announce different states of one epoch; the side fewer peers hold finds it
    lost (state_forked), the other does not, and a download picks the winner's state."""

    async def main() -> None:
        net = SimNetwork(seed=4)
        async with open_sim_dhts(net, 6) as peers:
            servers = _servers(peers, range(5))
            for i, server in enumerate(servers):
                server.set_state(_state(7 if i < 3 else 8), epoch=7)
                await server.announce()
            theirs, ours = servers[0].latest, servers[4].latest
            assert theirs is not None and ours is not None and theirs.digest != ours.digest
            for i, server in enumerate(servers):
                node, dht = peers[i]
                lost = await state_forked(node, dht, "run", 7, server.latest.digest)
                assert lost == (i >= 3), i
            node, dht = peers[5]
            epoch, arrays, _ = await download_state(node, dht, "run", timeout=60.0)
            assert epoch == 7 and arrays[0].tobytes() == _state(7)[0].tobytes()

    run_sim(main)
