from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from dedloc_jax.config import CollaborationConfig, ProgressConfig
from dedloc_jax.tracker import ProgressTracker
from p2p.testing import SimNetwork, run_sim
from tests.dedloc_jax.simcollab import open_sim_dhts


def _config(max_refresh: float = 1.0, progress_ttl: float = 10.0) -> CollaborationConfig:
    return CollaborationConfig.local_demo(target_batch_size=500).replace(
        progress=ProgressConfig(min_refresh=0.25, max_refresh=max_refresh, ttl=progress_ttl)
    )


async def _start_trackers(
    nursery: trio.Nursery, peers: list, config: CollaborationConfig, modes: list[str]
) -> list[ProgressTracker]:
    """A running tracker of run "run" on each of ``peers`` (node, dht), in ``modes``."""
    trackers = []
    for (_, dht), mode in zip(peers, modes, strict=True):
        tracker = ProgressTracker(dht, "run", config, mode)
        await nursery.start(tracker.run)
        trackers.append(tracker)
    return trackers


def test_peers_see_each_others_progress_and_the_global_epoch() -> None:
    config = _config()

    async def main() -> None:
        net = SimNetwork(seed=1)
        async with open_sim_dhts(net, 6, latency=0.005) as peers, trio.open_nursery() as nursery:
            trackers = await _start_trackers(nursery, peers, config, ["node"] * 5 + ["client"])
            # Peers 0-4 process 10 samples per second each for 10 seconds; peer 5 is a client.
            for _ in range(10):
                for tracker in trackers:
                    tracker.report(0, tracker.samples + 10, 10)
                await trio.sleep(1.0)
            await trio.sleep(2 * config.progress.max_refresh)
            for tracker in trackers:
                est = tracker.current_estimate()
                assert est.num_peers == 6 and est.num_clients == 1
                # 6 peers x 100 samples, plus a little extrapolation since their last report.
                assert 600 <= est.samples <= 600 + 6 * 10 * 3
                assert est.ready
            # A peer at a newer epoch raises the global epoch once it serves the state of it
            # (one of five alone, with no state, stands for nobody); a client cannot.
            trackers[5].set_epoch(7)
            trackers[1].set_epoch(1)
            await trio.sleep(3 * config.progress.max_refresh)
            assert trackers[0].current_estimate().epoch == 0
            trackers[1].serve(1, b"d1", ())
            await trio.sleep(3 * config.progress.max_refresh)
            assert trackers[0].current_estimate().epoch == 1
            nursery.cancel_scope.cancel()

    run_sim(main)


@pytest.mark.parametrize("seed", [3])
def test_estimate_reaches_target_near_true_sum(seed: int) -> None:
    """Throughputs spread over 10x; the estimate tracks the true sum within a refresh."""
    config = CollaborationConfig.local_demo(target_batch_size=2_000)
    config = config.replace(progress=config.progress.replace(max_refresh=1.0))

    async def main() -> None:
        net = SimNetwork(seed=seed)
        rates = [5, 10, 15, 25, 50, 50, 20, 35]
        async with (
            open_sim_dhts(net, len(rates), latency=0.01) as peers,
            trio.open_nursery() as nursery,
        ):
            trackers = await _start_trackers(nursery, peers, config, ["node"] * len(rates))
            while True:
                for tracker, rate in zip(trackers, rates, strict=True):
                    tracker.report(0, tracker.samples + rate, rate)
                await trio.sleep(1.0)
                true_sum = sum(tr.samples for tr in trackers)
                est = trackers[0].current_estimate()
                assert abs(est.samples - true_sum) <= 2 * sum(rates) * config.progress.max_refresh
                if est.ready:
                    break
            assert true_sum >= config.target_batch_size - 2 * sum(rates)
            nursery.cancel_scope.cancel()

    run_sim(main, seed=seed)


def test_samples_toward_the_next_epoch_count_once_the_round_in_flight_ends() -> None:
    """Delayed updates: while this peer averages epoch 2 it trains toward epoch 3; others keep
    seeing its final epoch-2 record (waiting: not extrapolated), and its epoch-3 samples
    survive the round."""
    config = CollaborationConfig.local_demo(target_batch_size=100)

    async def main() -> None:
        net = SimNetwork(seed=2)
        async with open_sim_dhts(net, 1) as peers:
            tracker = ProgressTracker(peers[0][1], "run", config, "node")
            tracker.set_epoch(2)
            for samples in (10, 20, 30):
                await trio.sleep(1.0)
                tracker.report(2, samples, 10)
            await tracker.freeze()
            for samples in (10, 20):
                await trio.sleep(1.0)
                tracker.report(3, samples, 10)
            mine = tracker.own_progress()
            assert (mine.epoch, mine.samples, mine.waiting) == (2, 30, True)
            tracker.set_epoch(3)
            mine = tracker.own_progress()
            assert (mine.epoch, mine.samples) == (3, 20)
            assert mine.samples_per_second > 0  # still training: the rate was never paused
            tracker.set_epoch(5)  # a jump (e.g. a state download) drops them
            assert (tracker.epoch, tracker.samples) == (5, 0)

    run_sim(main)


def test_a_malformed_progress_record_is_ignored_until_its_owner_writes_a_good_one() -> None:
    from dedloc_jax.tracker import progress_key
    from p2p.dht.records import owner_marker

    config = _config()

    async def main() -> None:
        net = SimNetwork(seed=2)
        async with open_sim_dhts(net, 3, latency=0.005) as peers:
            tracker = ProgressTracker(peers[0][1], "run", config, "node")
            honest = ProgressTracker(peers[1][1], "run", config, "node")
            honest.report(0, 40, 10)
            await honest.publish()
            bad = peers[2][1]

            async def write(value: object) -> None:
                mine = owner_marker(bad.peer_id)
                await bad.store(progress_key("run"), value, bad.now() + 10.0, subkey=mine)

            await write({"epoch": "three", "samples": 5})
            await tracker.fetch()
            assert set(tracker.records) == {honest.peer_id}
            await tracker.fetch()  # read again: still ignored, the honest one still there
            assert set(tracker.records) == {honest.peer_id}
            good = {"epoch": 0, "samples": 30, "sps": 1.0, "time": bad.now(), "mode": "node"}
            await write(good)
            honest.report(0, 60, 10)
            await honest.publish()
            await tracker.fetch()
            assert tracker.records[str(bad.peer_id)].samples == 30
            assert tracker.records[honest.peer_id].samples == 60

    run_sim(main)


@asynccontextmanager
async def _two_trackers(
    seed: int, config: CollaborationConfig
) -> AsyncIterator[tuple[ProgressTracker, ProgressTracker, trio.Nursery]]:
    """Two trackers of one run on a simulated DHT (not started) and a nursery to run them."""
    net = SimNetwork(seed=seed)
    async with open_sim_dhts(net, 2, latency=0.005) as peers, trio.open_nursery() as nursery:
        yield (
            ProgressTracker(peers[0][1], "run", config, "node"),
            ProgressTracker(peers[1][1], "run", config, "node"),
            nursery,
        )


def test_the_served_state_travels_with_progress_and_is_published_at_once() -> None:
    config = _config(max_refresh=5.0, progress_ttl=60.0)

    async def main() -> None:
        async with _two_trackers(3, config) as (a, b, nursery):
            for tracker in (a, b):
                await nursery.start(tracker.run)
            await trio.sleep(6.0)
            assert b.states() == [] and a.states() == []  # nothing served yet
            with pytest.raises(ValueError, match="ancestors"):
                a.serve(5, b"d" * 32, (b"c" * 32,) * 5)  # refused here, not at each publish
            a.serve(5, b"d" * 32, (b"c" * 32,))
            b.serve(5, b"e" * 32, ())
            # one read of the others later; a periodic publish would come at ttl / 3 = 20 s
            await trio.sleep(config.progress.max_refresh + 1.0)
            assert b.states() == [(a.peer_id, 5, b"d" * 32, (b"c" * 32,))]
            assert a.states() == [(b.peer_id, 5, b"e" * 32, ())]  # never our own
            nursery.cancel_scope.cancel()

    run_sim(main)


def test_a_step_and_the_state_it_serves_go_out_in_one_store() -> None:
    config = _config(max_refresh=5.0, progress_ttl=60.0)

    async def main() -> None:
        async with _two_trackers(4, config) as (a, b, nursery):
            stores = []
            publish = a.publish

            async def counted() -> None:
                stores.append((a.epoch, a.served))
                await publish()

            a.publish = counted  # type: ignore[method-assign]
            for tracker in (a, b):
                await nursery.start(tracker.run)
            a.serve(0, b"0" * 32, ())
            await trio.sleep(2.0)
            stores.clear()
            # The state comes a moment after the step: one store carries both.
            a.set_epoch(1, state_follows=True)
            await trio.sleep(config.progress.min_refresh / 2)
            a.serve(1, b"1" * 32, (b"0" * 32,))
            await trio.sleep(2.0)
            assert stores == [(1, (1, b"1" * 32, (b"0" * 32,)))]
            # Without the hint, the epoch goes out at once and the state after it.
            stores.clear()
            a.set_epoch(2)
            await trio.sleep(config.progress.min_refresh / 2)
            a.serve(2, b"2" * 32, (b"1" * 32,))
            await trio.sleep(2.0)
            assert [epoch for epoch, _ in stores] == [2, 2] and stores[0][1][0] == 1
            # A state that never comes holds the new epoch back only min_refresh seconds.
            a.set_epoch(3, state_follows=True)
            await trio.sleep(config.progress.min_refresh + 0.1)
            assert stores[-1] == (3, (2, b"2" * 32, (b"1" * 32,)))
            await trio.sleep(config.progress.max_refresh + 1.0)
            assert b.records[a.peer_id].epoch == 3
            nursery.cancel_scope.cancel()

    run_sim(main)


def test_peers_on_a_lineage_that_lost_do_not_lead_the_epoch() -> None:
    """After a heal: three peers on lineage A at epoch 8, two on lineage B (forked at epoch 6)
    already at epoch 9. B lost the count, so the collaboration is at epoch 8: counting B's
    epoch stopped A's peers (behind, with no newer state on their side to load)."""
    config = _config(max_refresh=1.0, progress_ttl=60.0)
    a = [bytes([1, k]) * 16 for k in range(5)]  # epochs 4..8
    b = [*a[:2], *(bytes([2, k]) * 16 for k in range(4))]  # epochs 4..9

    async def main() -> None:
        net = SimNetwork(seed=5)
        async with open_sim_dhts(net, 5, latency=0.005) as peers, trio.open_nursery() as nursery:
            trackers = [ProgressTracker(dht, "run", config, "node") for _, dht in peers]
            for i, tracker in enumerate(trackers):
                side, epoch = (a, 8) if i < 3 else (b, 9)
                tracker.set_epoch(epoch)
                tracker.serve(epoch, side[-1], tuple(reversed(side[:-1]))[:4])
                await nursery.start(tracker.run)
            for _ in range(4):
                for tracker in trackers:
                    tracker.report(tracker.epoch, tracker.samples + 10, 10)
                await trio.sleep(1.0)
            losers = {trackers[3].peer_id, trackers[4].peer_id}
            for tracker in trackers[:3]:
                assert tracker.losers == losers
                assert set(tracker.contenders()) == set(trackers[i].peer_id for i in range(3))
                est = tracker.current_estimate()
                assert est.epoch == 8 and est.num_peers == 3
            # A loser counts itself (it must not average with the winners at their epoch),
            # not the other loser: its epoch has its samples alone until it loads A's state.
            est = trackers[3].current_estimate()
            assert trackers[3].losers == {trackers[4].peer_id}
            assert est.epoch == 9 and est.samples < 2 * 40
            nursery.cancel_scope.cancel()

    run_sim(main)


def test_a_failed_read_keeps_the_last_progress_table() -> None:
    """A read that fails (its lookup raised) says nothing about the others: the table it had
    stays. Wiped, it would tell a peer whose round had just failed that nobody else trains,
    and the peer would keep its own parameters."""
    from p2p.errors import P2PError

    config = _config()

    async def main() -> None:
        net = SimNetwork(seed=1)
        async with open_sim_dhts(net, 3, latency=0.005) as peers, trio.open_nursery() as nursery:
            trackers = [ProgressTracker(dht, "run", config, "node") for _, dht in peers]
            for tracker in trackers:
                await nursery.start(tracker.run)
                tracker.report(0, 10, 10)
            await trio.sleep(3 * config.progress.max_refresh)
            reader = trackers[0]
            assert len(reader.records) == 3

            async def failing_read(**_: object) -> None:
                raise P2PError("lookup failed")

            reader._follower.read = failing_read
            est = await reader.fetch()
            assert len(reader.records) == 3 and est.num_peers == 3
            nursery.cancel_scope.cancel()

    run_sim(main)


def test_the_target_is_the_transforms_and_peers_that_disagree_are_named(caplog) -> None:
    """With no target configured, a tracker trains toward the one the transform gives and
    publishes it; another one later is a ValueError naming both; a peer that sets
    none (an aux peer) follows the trainers' target; a trainer warns about a peer that trains
    toward another target, naming both values."""
    import logging

    config = CollaborationConfig.local_demo(target_batch_size=None)
    config = config.replace(progress=config.progress.replace(max_refresh=1.0))

    async def main() -> None:
        net = SimNetwork(seed=2)
        async with open_sim_dhts(net, 3, latency=0.005) as peers, trio.open_nursery() as nursery:
            trackers = await _start_trackers(nursery, peers, config, ["node", "node", "aux"])
            assert trackers[0].target is None
            trackers[0].use_target(128)
            trackers[1].use_target(96)
            with pytest.raises(ValueError, match="96.*128|128.*96"):
                trackers[0].use_target(96)
            for tracker in trackers[:2]:
                tracker.report(0, 8, 8)
            await trio.sleep(3 * config.progress.max_refresh)
            assert trackers[0].current_estimate().target == 128
            assert trackers[2].target in (96, 128)  # the trainers' (here they disagree)
            nursery.cancel_scope.cancel()

    with caplog.at_level(logging.WARNING, logger="dedloc_jax.tracker"):
        run_sim(main)
    named = [r.getMessage() for r in caplog.records if "target_batch_size" in r.getMessage()]
    assert any("96" in m and "128" in m for m in named)


def test_a_collaboration_configured_with_another_target_refuses_the_transforms() -> None:
    import optax

    import dedloc_jax

    collab = dedloc_jax.Collaboration("t", config=CollaborationConfig(target_batch_size=4096))
    with pytest.raises(ValueError, match="128.*4096"):
        dedloc_jax.collaborative(optax.sgd(0.1), collab, target_batch_size=128)
    dedloc_jax.collaborative(optax.sgd(0.1), collab, target_batch_size=4096)  # agrees: fine


def test_an_epoch_nobody_backs_neither_leads_nor_offers_a_download() -> None:
    """Issue 46: three peers at epoch 5 serve its state; a fourth record claims epoch 6 and a
    state of it. It stands for nobody: the epoch stays 5 and no peer looks for a newer state.
    Once two of the three step to 6 (serving it), the third follows them."""
    from p2p.dht.records import owner_marker

    config = _config(max_refresh=1.0, progress_ttl=60.0)

    async def main() -> None:
        net = SimNetwork(seed=6)
        async with open_sim_dhts(net, 4, latency=0.005) as peers, trio.open_nursery() as nursery:
            trackers = [ProgressTracker(dht, "run", config, "node") for _, dht in peers[:3]]
            for tracker in trackers:
                tracker.set_epoch(5)
                tracker.serve(5, b"five", ())
                await nursery.start(tracker.run)
            liar = peers[3][1]
            claim = {"epoch": 6, "samples": 0, "sps": 0.0, "time": liar.now(), "mode": "node"}
            claim["state"] = [6, b"made-up", []]
            await liar.store(
                "run.progress", claim, liar.now() + 60.0, subkey=owner_marker(liar.peer_id)
            )
            for _ in range(3):
                for tracker in trackers:
                    tracker.report(tracker.epoch, tracker.samples + 10, 10)
                await trio.sleep(1.0)
            for tracker in trackers:
                assert tracker.unbacked == {str(liar.peer_id)}
                assert tracker.current_estimate().epoch == 5
                assert tracker.newest_served() == 5
            for tracker in trackers[:2]:
                tracker.set_epoch(6)
                tracker.serve(6, b"six", (b"five",))
            await trio.sleep(3.0)
            assert trackers[2].current_estimate().epoch == 6
            assert trackers[2].newest_served() == 6
            nursery.cancel_scope.cancel()

    run_sim(main)


def test_a_banned_peers_progress_and_state_count_for_nothing() -> None:
    """A peer banned for lying in a round (dedloc_jax.bans) kept hurrying epochs with inflated
    sample claims and, serving a state of a newer epoch, pulled the estimate (and newest
    served) to it. Its record is dropped from the table as soon as it is banned."""
    config = _config()

    async def main() -> None:
        net = SimNetwork(seed=11)
        async with open_sim_dhts(net, 5, latency=0.005) as peers, trio.open_nursery() as nursery:
            banned: set[str] = set()
            honest = [
                ProgressTracker(dht, "run", config, "node", banned=banned.__contains__)
                for _, dht in peers[:3]
            ]
            blind = ProgressTracker(peers[3][1], "run", config, "node")  # nobody banned
            liar = ProgressTracker(peers[4][1], "run", config, "node")
            for tracker in [*honest, blind, liar]:
                await nursery.start(tracker.run)
            for _ in range(8):  # 3 honest peers at 10 samples/s: 240 of the 500
                for tracker in [*honest, blind]:
                    tracker.report(0, tracker.samples + 10, 10)
                liar.report(0, liar.samples + 10**6, 10)
                await trio.sleep(1.0)
            await trio.sleep(2 * config.progress.max_refresh)
            # the liar counts as four typical peers: the epoch is all but closed
            assert honest[0].current_estimate().samples >= 500
            banned.add(liar.peer_id)  # between two reads: counts at once
            for tracker in honest:
                est = tracker.current_estimate()
                assert est.num_peers == 4 and est.samples < 500
                assert liar.peer_id not in tracker.contenders()
            # It jumps ahead and serves a state of that epoch: the blind peer follows it.
            liar.set_epoch(1)
            liar.serve(1, b"x" * 32, ())
            await trio.sleep(3 * config.progress.max_refresh)
            assert blind.newest_served() == 1 and blind.current_estimate().epoch == 1
            for tracker in honest:
                assert tracker.newest_served() is None
                assert tracker.current_estimate().epoch == 0
                assert tracker.chosen_epoch is None and tracker.announcements() == []
            nursery.cancel_scope.cancel()

    run_sim(main)


def test_a_sweep_asked_for_goes_to_the_next_read_only() -> None:
    """A peer that sees others waiting at its epoch while it is not ready has its next read
    ask every holder (``sweep_next_read``): at 40 peers one peer's holder lacked 11 peers'
    newer records for 12 s, and the peer stopped 16 s after the others."""
    config = _config()

    async def main() -> None:
        net = SimNetwork(seed=1)
        async with open_sim_dhts(net, 3, latency=0.005) as peers, trio.open_nursery() as nursery:
            trackers = [ProgressTracker(dht, "run", config, "node") for _, dht in peers]
            for tracker in trackers:
                await nursery.start(tracker.run)
                tracker.report(0, 10, 10)
            await trio.sleep(3 * config.progress.max_refresh)
            reader = trackers[0]
            read = reader._follower.read
            sweeps: list[bool] = []

            async def spy(**kwargs: object) -> object:
                sweeps.append(bool(kwargs.get("sweep")))
                return await read(**kwargs)

            reader._follower.read = spy
            await reader.fetch()
            assert sweeps and not any(sweeps)
            before = len(sweeps)
            reader.sweep_next_read()
            await reader.fetch()
            await reader.fetch()
            # (the tracker's own reads run too: the first read after the call sweeps, once)
            assert sweeps[before:] == [True] + [False] * (len(sweeps) - before - 1)
            assert len(sweeps) - before >= 2
            assert len(reader.records) == 3
            nursery.cancel_scope.cancel()

    run_sim(main)
