"""Peers of a collaboration measure their own links once they see each other."""

from __future__ import annotations

import pytest
import trio

from dedloc_jax.config import CollaborationConfig
from p2p.testing import SimNetwork, host_of, run_sim
from tests.dedloc_jax.simcollab import open_sim_collaboration

MBIT = 1e6 / 8


@pytest.mark.slow
def test_keep_links_measured_probes_once_peers_are_known() -> None:
    """Peers that report no rate yet (nothing predicts their next round) probe on joining."""
    ups = [10, 50, 100, 100]  # every peer's partners together can fill its downlink
    config = CollaborationConfig.local_demo(10_000)
    config = config.replace(progress=config.progress.replace(max_refresh=1.0))
    figures: list = []

    async def main() -> None:
        net = SimNetwork(seed=0)
        async with open_sim_collaboration(net, len(ups), config=config, latency=0.02) as cores:
            for core, up in zip(cores, ups, strict=True):
                net.set_bandwidth(host_of(net, core.node), up * MBIT, 100 * MBIT)
            assert all(core.links.upload_bps is None for core in cores)
            async with trio.open_nursery() as nursery:
                for core in cores:
                    core.report(0, 4, 4)  # a progress record: the others see this peer
                    nursery.start_soon(core.link_keeper.keep_measured)
                await trio.sleep(120)
                figures.extend(core.links for core in cores)
                nursery.cancel_scope.cancel()

    run_sim(main, seed=0)
    for f, up in zip(figures, ups, strict=True):
        assert f.upload_bps == pytest.approx(up * MBIT, rel=0.2), f
        assert f.download_bps == pytest.approx(100 * MBIT, rel=0.2), f
        assert f.upload_age < 120


@pytest.mark.slow
def test_a_stale_figure_is_not_probed_again_while_no_averaging_is_in_sight() -> None:
    """With rare averaging (diloco's outer steps) probing every meter window would send more
    than the averaging: a stale figure waits until the next averaging is near."""
    config = CollaborationConfig.local_demo(10_000)
    probed_at: list[float] = []
    stale: list[bool] = []

    async def main() -> float:
        net = SimNetwork(seed=0)
        async with open_sim_collaboration(net, 2, config=config, latency=0.02) as cores:
            for core in cores:
                core.meter.window = 60.0  # figures expire after a minute (600 s by default)
                probe = core.link_keeper.probe

                async def timed(*, probe=probe, **kw):
                    probed_at.append(trio.current_time())
                    return await probe(**kw)

                core.link_keeper.probe = timed
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                for core in cores:
                    core.report(0, 4, 4)  # one report: no rate, no averaging in sight
                    nursery.start_soon(core.link_keeper.keep_measured)
                await trio.sleep(4 * cores[0].meter.window)
                stale.extend(core.meter.stale() for core in cores)
                nursery.cancel_scope.cancel()
            return start

    start = run_sim(main, seed=0)
    assert stale == [True, True]  # the figures expired ...
    assert probed_at and max(probed_at) - start < 30  # ... and only the first probes ran


def test_a_peer_does_not_probe_its_links_while_it_averages() -> None:
    """A probe during our own round slows the round and reads the links the round fills as
    slow: keep_links_measured waits until the round is over."""
    config = CollaborationConfig.local_demo(10_000)
    probed_at: list[float] = []
    round_over: list[float] = []

    async def main() -> None:
        net = SimNetwork(seed=0)
        async with open_sim_collaboration(net, 2, config=config, latency=0.02) as cores:
            core = cores[0]
            probe = core.link_keeper.probe

            async def timed(**kw):
                probed_at.append(trio.current_time())
                return await probe(**kw)

            core.link_keeper.probe = timed
            release = trio.Event()

            async def fake_round(*args, **kwargs):
                await release.wait()

            core._average = fake_round  # a round that lasts until released
            async with trio.open_nursery() as nursery:
                for c in cores:
                    c.report(0, 4, 4)
                nursery.start_soon(core.average, 0, [], 4)
                await trio.sleep(0)
                nursery.start_soon(core.link_keeper.keep_measured)
                await trio.sleep(60)
                round_over.append(trio.current_time())
                release.set()
                await trio.sleep(60)
                nursery.cancel_scope.cancel()

    run_sim(main, seed=0)
    assert probed_at and min(probed_at) >= round_over[0]


def test_peers_far_from_their_first_round_probe_only_as_it_nears() -> None:
    """Only a round uses the figure: peers that join ten minutes of computing before their
    first round (diloco's outer steps are hours apart) probe within the lead before it, not
    on joining (which then cost a probe per peer more for each round, and one per window)."""
    # (the collaboration's own prober off: this one starts once the peers report a rate)
    config = CollaborationConfig.local_demo(4_000)
    config = config.replace(links=config.links.replace(measure=False))
    probed_at: list[float] = []
    eta_at_start: list[float] = []
    lead = 150.0  # the default: a quarter of the meter's 600 s window

    async def main() -> float:
        net = SimNetwork(seed=0)
        async with open_sim_collaboration(net, 2, config=config, latency=0.02) as cores:
            for core in cores:
                probe = core.link_keeper.probe

                async def timed(*, probe=probe, **kw):
                    probed_at.append(trio.current_time())
                    return await probe(**kw)

                core.link_keeper.probe = timed

            async def train(core) -> None:
                samples = 0
                while True:  # 4 samples/s each: the target is 500 s away
                    samples += 4
                    core.report(0, samples, 4)
                    await trio.sleep(1.0)

            async with trio.open_nursery() as nursery:
                for core in cores:
                    nursery.start_soon(train, core)
                await trio.sleep(5)
                start = trio.current_time()
                eta_at_start.append(cores[0].tracker.current_estimate().eta)
                for core in cores:
                    nursery.start_soon(core.link_keeper.keep_measured)
                await trio.sleep(600)
                nursery.cancel_scope.cancel()
            return start

    start = run_sim(main, seed=0)
    assert eta_at_start[0] > 400
    assert probed_at, "the peers never probed"
    # (without the rule both peers probe within 20 s of starting)
    assert min(probed_at) - start > eta_at_start[0] - lead - 60
    assert min(probed_at) - start < eta_at_start[0]  # ... and before the round


def test_a_probe_asks_no_peer_whose_record_says_it_left(monkeypatch) -> None:
    """A trainer that left cleanly publishes a last record that averages no more, which lives
    on for its TTL: probes kept choosing it and logged "probe partner ... unreachable" after
    every clean leave. It is no partner now; an aux peer (which never averages) still is."""
    from types import SimpleNamespace

    from dedloc_jax.averaging import links
    from dedloc_jax.progress import PeerProgress
    from p2p import Identity

    me, stays, left, aux = (str(Identity.generate().peer_id) for _ in range(4))
    records = {
        me: PeerProgress(me, 3, 0, 1.0, 0.0),
        stays: PeerProgress(stays, 3, 0, 1.0, 0.0),
        left: PeerProgress(left, 3, 0, 0.0, 0.0, averages=False),
        aux: PeerProgress(aux, 3, 0, 0.0, 0.0, mode="aux", averages=False),
    }
    asked: list[str] = []

    async def measure(node, peers, meter, **kw):
        asked.extend(str(p) for p in peers)
        return meter.figures()

    monkeypatch.setattr(links, "measure_links", measure)
    keeper = links.LinkKeeper(
        SimpleNamespace(peer_id=me),  # type: ignore[arg-type]
        links.BandwidthMeter(),
        links.LinkLocks(),
        SimpleNamespace(records=records, mode="node"),  # type: ignore[arg-type]
        probe_bytes=1,
        rpc_timeout=1.0,
    )
    trio.run(keeper.probe)
    assert sorted(asked) == sorted([stays, aux])
