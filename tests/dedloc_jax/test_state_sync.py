from __future__ import annotations

import numpy as np
import pytest
import trio

from dedloc_jax.state_sync import (
    LINEAGE,
    Announcement,
    StateServer,
    StateSyncError,
    download_manifest_state,
    download_state,
    find_donors,
    fork_choice,
    fork_verdict,
    lineage_counts,
    on_minority_fork,
    state_forked,
)
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


def test_a_lineage_counts_the_peers_that_moved_on_from_it() -> None:
    a, b, c = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    pid = _pid()
    moved_on = [Announcement(pid, 8, c, (b,)), Announcement(pid, 9, c, (c, b, a))]
    # Both descend from b at epoch 7; the second also from a at epoch 6.
    assert lineage_counts(moved_on, 7) == {(7, b): 2}
    assert lineage_counts(moved_on, 6) == {(6, a): 1}
    assert lineage_counts(moved_on, 3) == {}  # further back than announcements name
    # We and one other peer hold a at epoch 7, three moved on from b: a lost.
    held = [Announcement(pid, 7, a)]
    counts = lineage_counts([*held, *moved_on, Announcement(pid, 10, c, (c, c, b))], 7)
    assert on_minority_fork(counts, 7, a)
    assert not on_minority_fork(counts, 7, b)


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


def _side(n: int, epoch: int, chain: list[bytes]) -> list[Announcement]:
    """n peers at ``epoch`` holding chain[-1], descended from the rest (oldest first)."""
    lineage = tuple(reversed(chain[:-1]))[:LINEAGE]
    return [Announcement(_pid(), epoch, chain[-1], lineage) for _ in range(n)]


def _digests(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, k]) * 16 for k in range(n)]


def test_after_a_heal_the_side_one_epoch_ahead_finds_it_lost_at_the_fork() -> None:
    """Both sides share epochs 4 and 5, forked at 6; the small side reached epoch 9, the big
    one is still at 8. Counting only at epoch 9 the small side cannot lose (nobody else holds
    9); counting at the fork (epoch 6) it does, and the big side does not."""
    shared = _digests(0, 2)
    big = [*shared, *_digests(1, 3)]  # epochs 4..8
    small = [*shared, *_digests(2, 4)]  # epochs 4..9
    announced = [*_side(6, 8, big), *_side(2, 9, small)]
    me_small = small[-1], tuple(reversed(small[:-1]))
    assert fork_verdict(announced, 9, me_small[0]) is None  # its epoch alone: cannot tell
    assert fork_verdict(announced, 9, *me_small) is True
    me_big = big[-1], tuple(reversed(big[:-1]))
    assert fork_verdict(announced, 8, *me_big) is False
    # A lost fork older than any peer still at it does not hide a newer one: we (big side)
    # also split at epoch 8 from 8 peers of our side (6 others and us hold ours).
    split = [*big[:-1], b"\x09" * 32]
    assert fork_verdict([*announced, *_side(8, 8, split)], 8, *me_big) is True


def test_the_fork_choice_follows_the_side_more_peers_hold_not_the_newest_epoch() -> None:
    shared = _digests(0, 2)
    big = [*shared, *_digests(1, 3)]  # epochs 4..8
    small = [*shared, *_digests(2, 4)]  # epochs 4..9
    announced = [*_side(6, 8, big), *_side(2, 9, small)]
    assert fork_choice(announced) == (8, big[-1])
    # A peer that loaded the small side's state names no lineage: it is on that side too.
    loaded = Announcement(_pid(), 9, small[-1])
    assert fork_choice([*announced, loaded, loaded]) == (8, big[-1])
    # Without a fork: the newest state, the one most peers announce (of as many, the
    # smaller digest); peers still at older epochs do not hold it back.
    one = [*shared, *_digests(1, 3)]
    other = [*one[:-1], b"\x00" * 32]
    assert fork_choice([*_side(3, 7, one[:-1]), *_side(1, 8, one)]) == (8, one[-1])
    assert fork_choice([*_side(2, 8, one), *_side(1, 8, other)]) == (8, one[-1])
    assert fork_choice([*_side(1, 8, one), *_side(1, 8, other)]) == (8, other[-1])
    assert fork_choice([]) is None
    # The big side wins at the fork even when the small one has more peers at epoch 9.
    more = [*_side(3, 8, big), *_side(2, 9, small), *_side(1, 7, big[:-1])]
    assert fork_choice(more) == (8, big[-1])


def test_a_check_cannot_tell_while_the_others_still_announce_older_epochs() -> None:
    a, b = b"\x01" * 32, b"\x02" * 32
    pid = _pid()
    behind = [Announcement(pid, 6, a), Announcement(pid, 6, a)]
    assert fork_verdict(behind, 7, b) is None  # they are still averaging epoch 6
    assert fork_verdict([], 7, b) is False  # nobody else at all: nothing to lose to
    assert fork_verdict([*behind, Announcement(pid, 7, b)], 7, b) is False
    assert fork_verdict([*behind, Announcement(pid, 8, a, (a,))], 7, b) is True
    # Most peers still average epoch 6: the first of them at epoch 7 decide nothing, whichever
    # way a 1-1 count would go (a < b < c).
    c = b"\x03" * 32
    behind3 = [*behind, Announcement(pid, 6, a)]
    assert fork_verdict([*behind3, Announcement(pid, 7, a)], 7, b) is None
    assert fork_verdict([*behind3, Announcement(pid, 7, c)], 7, b) is None
    two = [Announcement(pid, 7, a), Announcement(pid, 8, c, (a,))]
    assert fork_verdict([*behind3, *two], 7, b) is True  # 2 of 7 against our 1


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
