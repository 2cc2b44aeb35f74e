"""Far from the target (diloco's outer steps, hours apart) peers read and publish progress
rarely; near it as often as before."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import trio

from dedloc_jax.config import CollaborationConfig, LinkConfig
from dedloc_jax.progress import CollaborationEstimate, refresh_delay
from dedloc_jax.state import state_key
from p2p.testing import SimNetwork, run_sim
from tests.dedloc_jax.simcollab import open_sim_collaboration

RATE = 4.0  # samples per second per peer


def _estimate(eta: float) -> CollaborationEstimate:
    return CollaborationEstimate(
        epoch=0,
        samples=0.0,
        samples_per_second=1.0,
        eta=eta,
        num_peers=2,
        num_clients=0,
        target=100,
    )


def test_reads_follow_a_tenth_of_a_far_eta_and_half_of_a_near_one() -> None:
    def delay(eta: float) -> float:
        return refresh_delay(_estimate(eta), min_delay=0.25, max_delay=5.0, idle_delay=60.0)

    assert delay(1.0) == 0.5  # near: half the ETA, as without idle_delay
    assert delay(30.0) == 5.0  # DeDLOC epochs: as before
    assert delay(599.0) == 5.0
    assert delay(600.0) == 60.0  # far (idle_after, 600 s, or more): a tenth of the ETA ...
    assert delay(7200.0) == 60.0  # ... up to idle_delay
    assert refresh_delay(
        _estimate(1000.0), min_delay=0.25, max_delay=5.0, idle_delay=300.0
    ) == pytest.approx(100.0)
    assert delay(math.inf) == 5.0  # nothing to predict from: as before


def test_a_peer_far_from_the_target_reads_and_publishes_a_few_times_a_minute_at_most() -> None:
    """Two peers train toward a step about 40 minutes away. Between minutes 12 and 22 (past
    their first idle_after) each reads the table at most twice a minute and publishes at
    most once every two minutes
    (before: a read every 5 s and a publish every 20 s); in the last minute before the
    target it reads as often as before (at least every 5 s)."""
    target = int(2 * RATE * 2400)
    config = CollaborationConfig(target_batch_size=target, links=LinkConfig(measure=False))
    reads: list[list[float]] = [[], []]
    publishes: list[list[float]] = [[], []]
    ready_at: list[float] = []

    async def main() -> float:
        net = SimNetwork(seed=0)
        async with open_sim_collaboration(net, 2, config=config, latency=0.02) as cores:
            start = trio.current_time()
            for i, core in enumerate(cores):
                tracker = core.tracker
                fetch, publish = tracker.fetch, tracker.publish

                async def timed_fetch(*, fetch=fetch, i=i):
                    reads[i].append(trio.current_time() - start)
                    return await fetch()

                async def timed_publish(*, publish=publish, i=i):
                    publishes[i].append(trio.current_time() - start)
                    return await publish()

                tracker.fetch, tracker.publish = timed_fetch, timed_publish

            async def train(core) -> None:
                samples = 0
                while True:
                    samples += 4
                    if core.report(0, samples, 4):
                        ready_at.append(trio.current_time() - start)
                        return
                    await trio.sleep(4 / RATE)

            async with trio.open_nursery() as nursery:
                for core in cores:
                    nursery.start_soon(train, core)
            return start

    run_sim(main, seed=0)
    assert len(ready_at) == 2
    for i in range(2):
        far_reads = [t for t in reads[i] if 720 <= t < 1320]
        far_publishes = [t for t in publishes[i] if 720 <= t < 1320]
        assert len(far_reads) <= 20, far_reads
        assert len(far_publishes) <= 5, far_publishes
        near = sorted(t for t in reads[i] if ready_at[i] - 60 <= t <= ready_at[i])
        gaps = [b - a for a, b in zip([ready_at[i] - 60, *near], near, strict=False)]
        assert near and max(gaps) <= 6.5, gaps  # max_refresh and a read's own time
    # the step came about when the peers' samples reached the target, not later
    assert max(ready_at) <= 2400 + 30


@pytest.mark.slow
def test_a_peer_far_from_the_target_renews_its_state_announcement_rarely_and_keeps_it_live() -> (
    None
):
    """Two peers that serve a state train toward a step about 40 minutes away. Between minutes
    12 and 22 each renews its state announcement at most 5 times (before: every 20 s, about
    30), and the other peer finds both announcements live throughout."""
    target = int(2 * RATE * 2400)
    config = CollaborationConfig(target_batch_size=target, links=LinkConfig(measure=False))
    stores: list[list[float]] = [[], []]
    live: list[int] = []

    async def main() -> None:
        net = SimNetwork(seed=0)
        async with open_sim_collaboration(net, 2, config=config, latency=0.02) as cores:
            start = trio.current_time()
            for i, core in enumerate(cores):
                server = core.state_server
                announce = server.announce

                async def timed_announce(*, announce=announce, i=i):
                    stores[i].append(trio.current_time() - start)
                    return await announce()

                server.announce = timed_announce
                await core.share_state([np.full(8, i, np.float32)], 0)

            async def train(core) -> None:
                samples = 0
                while not core.report(0, samples, 4):
                    samples += 4
                    await trio.sleep(4 / RATE)

            async def check() -> None:
                for _ in range(20):
                    await trio.sleep(60.0)
                    view = await cores[0].dht.get(state_key(cores[0].run_id), latest=True)
                    live.append(len(view or {}))

            async with trio.open_nursery() as nursery:
                for core in cores:
                    nursery.start_soon(train, core)
                nursery.start_soon(check)

    run_sim(main, seed=0)
    for i in range(2):
        far = [t for t in stores[i] if 720 <= t < 1320]
        assert 1 <= len(far) <= 5, far
    assert live == [2] * 20, live


@pytest.mark.slow
def test_far_from_the_target_the_table_is_looked_up_about_once_per_record_lifetime() -> None:
    """Six peers (enough that the table has its full set of holders) train toward a step
    about 40 minutes away: between minutes 12 and 22 each looks the table's nearest nodes up
    at most 3 times (before: at every read past 30 s, about 10)."""
    peers = 6
    target = int(peers * RATE * 2400)
    config = CollaborationConfig(target_batch_size=target, links=LinkConfig(measure=False))
    relocations: list[int] = []

    async def main() -> None:
        net = SimNetwork(seed=0)
        async with open_sim_collaboration(net, peers, config=config, latency=0.02) as cores:
            start = trio.current_time()

            async def train(core) -> None:
                samples = 0
                while not core.report(0, samples, 4):
                    samples += 4
                    await trio.sleep(4 / RATE)

            async def count() -> None:
                await trio.sleep_until(start + 720)
                before = [c.tracker._follower.stats["relocations"] for c in cores]
                await trio.sleep_until(start + 1320)
                for c, b in zip(cores, before, strict=True):
                    relocations.append(c.tracker._follower.stats["relocations"] - b)

            async with trio.open_nursery() as nursery:
                for core in cores:
                    nursery.start_soon(train, core)
                nursery.start_soon(count)

    run_sim(main, seed=0)
    assert len(relocations) == peers and max(relocations) <= 3, relocations


def test_hours_from_the_target_a_peer_renews_its_record_rarely_and_it_stays_live() -> None:
    """A step two hours away: our record lives up to idle_ttl (30 min, within half the ETA),
    renewed at a third of that: between minutes 20 and 80 each peer publishes 9 times (with
    the former 10-minute idle_ttl: 20), and the other's record is live throughout."""
    target = int(2 * RATE * 7200)
    config = CollaborationConfig(target_batch_size=target, links=LinkConfig(measure=False))
    publishes: list[list[float]] = [[], []]
    live: list[int] = []

    async def main() -> None:
        net = SimNetwork(seed=1)
        async with open_sim_collaboration(net, 2, config=config, latency=0.02) as cores:
            start = trio.current_time()
            for i, core in enumerate(cores):
                publish = core.tracker.publish

                async def timed_publish(*, publish=publish, i=i):
                    publishes[i].append(trio.current_time() - start)
                    return await publish()

                core.tracker.publish = timed_publish

            async def train(core) -> None:
                samples = 0
                while True:
                    samples += 4
                    core.report(0, samples, 4)
                    await trio.sleep(4 / RATE)

            async def watch() -> None:
                await trio.sleep(1200)
                while trio.current_time() - start < 4800:
                    live.append((await cores[0].tracker.fetch()).num_peers)
                    await trio.sleep(97)

            with trio.move_on_after(4800):
                async with trio.open_nursery() as nursery:
                    for core in cores:
                        nursery.start_soon(train, core)
                    nursery.start_soon(watch)

    run_sim(main, seed=1)
    for i in range(2):
        window = [t for t in publishes[i] if 1200 <= t < 4800]
        assert 3 <= len(window) <= 10, window
    assert live and min(live) == 2, live


@functools.cache
def _two_hours_from_the_step() -> tuple[list[list[tuple[float, float]]], list[list[float]]]:
    """Two peers at a steady rate toward a step two hours away, for 80 minutes: each one's
    publishes (time, record lifetime) and progress reads (time)."""
    target = int(2 * RATE * 7200)
    config = CollaborationConfig(target_batch_size=target, links=LinkConfig(measure=False))
    publishes: list[list[tuple[float, float]]] = [[], []]
    reads: list[list[float]] = [[], []]

    async def main() -> None:
        net = SimNetwork(seed=1)
        async with open_sim_collaboration(net, 2, config=config, latency=0.02) as cores:
            start = trio.current_time()
            for i, core in enumerate(cores):
                tracker = core.tracker
                publish, fetch = tracker.publish, tracker.fetch

                async def timed_publish(*, publish=publish, i=i, tracker=tracker):
                    await publish()
                    publishes[i].append((trio.current_time() - start, tracker._published_ttl))

                async def timed_fetch(*, fetch=fetch, i=i):
                    reads[i].append(trio.current_time() - start)
                    return await fetch()

                tracker.publish, tracker.fetch = timed_publish, timed_fetch

            async def train(core) -> None:
                samples = 0
                while True:
                    samples += 4
                    core.report(0, samples, 4)
                    await trio.sleep(4 / RATE)

            with trio.move_on_after(4800):
                async with trio.open_nursery() as nursery:
                    for core in cores:
                        nursery.start_soon(train, core)

    run_sim(main, seed=1)
    return publishes, reads


def test_hours_from_the_target_a_steady_record_is_not_published_before_its_renewal() -> None:
    """Between minutes 20 and 80 nothing about a record changes that matters to the others'
    ETA, so it is published only when due for renewal (a third of its lifetime after the
    last). Before, the extrapolation error (a reader extrapolates a record for seconds only)
    republished it every ~420 s of 600."""
    publishes, _ = _two_hours_from_the_step()
    for i in range(2):
        window = [(t, ttl) for t, ttl in publishes[i] if 1200 <= t < 4800]
        assert len(window) >= 3, window
        for (t0, ttl), (t1, _) in zip(window, window[1:], strict=False):
            assert t1 - t0 >= 0.95 * ttl / 3, window
