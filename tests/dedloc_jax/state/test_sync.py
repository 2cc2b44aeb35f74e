from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import trio

from dedloc_jax.state.chunks import NonFiniteStateError, pack_state
from dedloc_jax.state.download import (
    StateSyncError,
    download_manifest_state,
    download_state,
    find_donors,
)
from dedloc_jax.state.lineage import LINEAGE, Announcement
from dedloc_jax.state.serving import StateServer, state_forked
from p2p.identity import Identity, PeerID
from p2p.testing import SimNetwork, host_of, run_sim
from tests.dedloc_jax.simcollab import open_sim_dhts


def _state(epoch: int) -> list[np.ndarray]:
    rng = np.random.default_rng(epoch)
    return [rng.normal(size=(300, 70)).astype(np.float32), np.array(epoch, np.int32)]


def _pid() -> PeerID:
    return Identity.generate().peer_id


def _servers(peers, donors: range) -> list[StateServer]:
    servers = []
    for node, dht in (peers[i] for i in donors):
        server = StateServer(node, dht, "run", chunk_bytes=4096, ttl=lambda: 60.0)
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


def test_a_non_finite_state_is_never_served_nor_loaded() -> None:
    """A diverged state (a NaN in it) spreads to every peer that trains on it: a peer refuses
    to serve one (and keeps serving its last finite state), and a download of one that a
    donor serves anyway (an older version, a liar) loads nothing."""

    async def main() -> None:
        net = SimNetwork(seed=5)
        async with open_sim_dhts(net, 3) as peers:
            honest, liar = _servers(peers, range(2))
            honest.set_state(_state(3), epoch=3)
            diverged = _state(4)
            diverged[0][5, 7] = np.nan
            with pytest.raises(NonFiniteStateError, match="epoch 4 holds a NaN"):
                honest.set_state(diverged, epoch=4)
            assert honest.latest.epoch == 3  # still serving epoch 3
            # bfloat16 (ml_dtypes) arrays are checked too
            with pytest.raises(NonFiniteStateError):
                honest.set_state([diverged[0].astype(jnp.bfloat16)], epoch=4)
            # the liar serves the diverged state behind the checks
            manifest, buffer = pack_state(diverged, 4, chunk_bytes=4096)
            liar._snapshots[manifest.digest] = (manifest, buffer)
            liar.latest = manifest
            await liar.announce()
            with pytest.raises(StateSyncError, match="epoch 4 is not finite"):
                await download_state(peers[2][0], peers[2][1], "run", timeout=60)

    run_sim(main)


def test_no_donor_is_a_clear_error() -> None:
    async def main() -> None:
        net = SimNetwork(seed=4)
        async with open_sim_dhts(net, 2) as peers:
            with pytest.raises(StateSyncError, match="no peer announces"):
                await download_state(peers[1][0], peers[1][1], "run", timeout=30)

    run_sim(main)


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


def test_a_download_chooses_over_the_progress_table_states_too() -> None:
    """Two peers announce state X of epoch 7 on the state key; three serve Y but only one
    announcement of Y reached the key (the reader missed the others'). Counted with the states
    the progress table names (``extra``), Y wins, and it downloads Y from its holders."""

    async def main() -> None:
        net = SimNetwork(seed=5)
        async with open_sim_dhts(net, 6) as peers:
            servers = _servers(peers, range(5))
            for i, server in enumerate(servers):
                server.set_state(_state(70 if i < 2 else 71), epoch=7)
                if i <= 2:
                    await server.announce()
            node, dht = peers[5]
            x, y = servers[0].latest, servers[2].latest
            assert x is not None and y is not None
            assert (await find_donors(node, dht, "run"))[:2] == (7, x.digest)
            table = [Announcement(str(peers[i][0].peer_id), 7, y.digest) for i in (2, 3, 4)]
            epoch, digest, donors = await find_donors(node, dht, "run", table)
            assert (epoch, digest) == (7, y.digest)
            assert set(donors) == {peers[i][0].peer_id for i in (2, 3, 4)}
            manifest, arrays, _ = await download_manifest_state(node, dht, "run", extra=table)
            assert manifest.digest == y.digest
            assert arrays[0].tobytes() == _state(71)[0].tobytes()

    run_sim(main)


def test_the_lineage_follows_steps_and_restarts_at_a_loaded_state() -> None:
    async def main() -> None:
        net = SimNetwork(seed=5)
        async with open_sim_dhts(net, 2) as peers:
            (server,) = _servers(peers, range(1))
            digests = [server.set_state(_state(e), epoch=e).digest for e in range(6)]
            assert server.lineage == tuple(digests[4::-1][:LINEAGE])
            server.set_state(_state(5), epoch=5)  # the same state again: same lineage
            assert server.lineage == tuple(digests[4::-1][:LINEAGE])
            server.set_state(_state(50), epoch=5)  # another state of our epoch: unknown
            assert server.lineage == ()
            server.adopt(5, b"\x07" * 32)  # downloaded: the next step descends from it
            server.set_state(_state(6), epoch=6)
            assert server.lineage == (b"\x07" * 32,)
            server.set_state(_state(9), epoch=9)  # a jump: not a step from what we held
            assert server.lineage == ()

    run_sim(main)


def test_a_late_check_loses_to_the_peers_that_stepped_on_from_the_other_lineage() -> None:
    """Three peers on lineage x stepped to epoch 8 (their announcements of epoch 7 are gone),
    two still serve lineage y at epoch 7: y lost, though at epoch 7 alone it leads 2 to 0."""

    async def main() -> None:
        net = SimNetwork(seed=6)
        async with open_sim_dhts(net, 6) as peers:
            servers = _servers(peers, range(5))
            for i, server in enumerate(servers):
                server.set_state(_state(7 if i < 3 else 70), epoch=7)
                if i < 3:
                    server.set_state(_state(8), epoch=8)
                await server.announce()
            y = servers[3].latest
            assert y is not None and y.epoch == 7
            for i in (3, 4):
                node, dht = peers[i]
                assert await state_forked(node, dht, "run", 7, y.digest), i
            node, dht = peers[0]
            assert servers[0].lineage and not await state_forked(
                node, dht, "run", 8, servers[0].latest.digest
            )

    run_sim(main)


def test_a_patient_check_waits_for_the_others_to_announce_our_epoch() -> None:
    """We stepped alone and ask at once: the others still serve epoch 6. An impatient check
    says not lost; a patient one waits until they announce epoch 7, and finds ours lost."""

    async def main() -> None:
        net = SimNetwork(seed=7)
        async with open_sim_dhts(net, 5) as peers:
            servers = _servers(peers, range(4))
            for server in servers[:3]:
                server.set_state(_state(6), epoch=6)
                await server.announce()
            ours = servers[3].set_state(_state(60), epoch=7)
            await servers[3].announce()
            node, dht = peers[3]
            assert not await state_forked(node, dht, "run", 7, ours.digest)

            async def step_later() -> None:
                await trio.sleep(3.0)
                for server in servers[:3]:
                    server.set_state(_state(7), epoch=7)
                    await server.announce()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(step_later)
                started = trio.current_time()
                assert await state_forked(node, dht, "run", 7, ours.digest, patience=10.0)
                assert 3.0 <= trio.current_time() - started < 10.0

    run_sim(main)
