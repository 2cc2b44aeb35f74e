import random

import pytest
import trio

from dedloc_jax.averaging import BandwidthMeter, LinkLocks, install_probe, probe
from p2p.sim import SimNetwork
from p2p.testing import host_of, open_sim_nodes, run_sim


def test_meter_publishes_the_windowed_max_of_its_samples_and_override_wins():
    meter = BandwidthMeter(window=100.0)
    assert meter.upload_bps is None and not meter.measured and meter.stale(now=0.0)
    meter.record("up", 3000, 1.0, at=0.0)
    meter.record("up", 1000, 1.0, at=10.0)  # a slow partner held this one back
    assert meter.figures(now=10.0).upload_bps == 3000
    assert meter.figures(now=10.0).upload_age == 0.0  # the newest sample's age
    meter.record("up", 0, 1.0, at=20.0)  # an empty or instant transfer says nothing
    meter.record("up", 10, 0.0, at=20.0)
    meter.record("up", 10, float("nan"), at=20.0)
    assert meter.figures(now=20.0).upload_bps == 3000
    # past the window the fast sample expires: a link that got slower shows
    assert meter.figures(now=105.0).upload_bps == 1000
    # everything expired: the latest sample stays published, stale and aged
    f = meter.figures(now=500.0)
    assert f.upload_bps == 1000 and f.upload_age == 490.0 and meter.stale(now=500.0)
    meter.record("down", 500, 2.0, at=499.0)
    meter.record("up", 800, 1.0, at=499.0)
    assert meter.figures(now=500.0).download_bps == 250 and not meter.stale(now=500.0)
    meter.upload_override = 1e9
    assert meter.figures(now=500.0)[0::2] == (1e9, 0.0)
    with pytest.raises(ValueError):
        meter.record("sideways", 1, 1.0)


def test_gauge_counts_only_time_with_data_queued():
    meter = BandwidthMeter(min_sample_bytes=1)
    up = meter.gauge("up")
    up.sent(1000, 0.0, 0.0)  # filling an empty buffer: no link time seen yet
    up.sent(1000, 0.0, 1.0)  # blocked: the buffer is full from t=1 on
    up.sent(500, 1.0, 1.5)
    up.sent(500, 1.5, 2.0)
    up.sent(300, 2.0, 2.0)  # did not block: the tail stays out
    up.close()
    down = meter.gauge("down")
    down.received(100, 5.0)  # the first arrival only opens the span
    down.received(400, 6.0)
    down.close()
    other = meter.gauge("down")  # a concurrent stream: spans merge, bytes add
    other.received(100, 5.5)
    other.received(200, 7.0)
    other.close()
    meter.flush()
    f = meter.figures(now=7.0)
    assert f.upload_bps == pytest.approx(1000.0)  # 1000 bytes over 1 s, not 3300 over 2
    assert f.download_bps == pytest.approx(600 / 2.0)


@pytest.mark.parametrize("nbytes", [4 << 20, 256 << 10])
def test_probe_measures_simulated_links(nbytes):
    # 256 KiB goes in 16 KiB messages, four to each 64 KiB the simulator delivers at once:
    # the ones read with the first must not count as timed.
    meter = BandwidthMeter()

    async def main() -> None:
        net = SimNetwork(seed=0)
        async with (
            open_sim_nodes(net, 1, upload_bps=2e6, download_bps=8e6) as (a,),
            open_sim_nodes(net, 1, upload_bps=50e6, download_bps=50e6) as (b,),
        ):
            install_probe(b, LinkLocks())
            a.peerstore.add_addrs(b.peer_id, b.addrs)
            await probe(a, b.peer_id, meter, locks=LinkLocks(), nbytes=nbytes)

    run_sim(main)
    # a's uplink (2 MB/s) and downlink (8 MB/s) are the bottlenecks of each direction
    assert meter.upload_bps == pytest.approx(2e6, rel=0.05)
    if nbytes >= 1 << 20:
        assert meter.download_bps == pytest.approx(8e6, rel=0.1)


def test_probe_skips_a_partner_it_cannot_reach_and_the_server_rejects_oversized_asks():
    from dedloc_jax.averaging import measure_links
    from dedloc_jax.averaging.bandwidth import PROBE_PROTOCOL
    from p2p.identity import Identity

    meter = BandwidthMeter()
    refused = []

    async def main() -> None:
        net = SimNetwork(seed=0)
        async with (
            open_sim_nodes(net, 1, upload_bps=2e6, download_bps=8e6) as (a,),
            open_sim_nodes(net, 1, upload_bps=50e6, download_bps=50e6) as (b,),
        ):
            install_probe(b, LinkLocks())
            a.peerstore.add_addrs(b.peer_id, b.addrs)
            nobody = Identity.generate().peer_id
            async with a.open_stream(b.peer_id, PROBE_PROTOCOL) as ms:
                await ms.send({"up": 1 << 40})  # more than a probe may ask for
                try:
                    await ms.receive()
                except Exception as e:  # the server reset the stream
                    refused.append(e)
            peers = [nobody, b.peer_id]
            await measure_links(a, peers, meter, locks=LinkLocks(), nbytes=2 << 20, timeout=30.0)

    run_sim(main)
    assert refused
    assert meter.upload_bps == pytest.approx(2e6, rel=0.1)
    assert meter.download_bps == pytest.approx(8e6, rel=0.1)


def test_the_upload_goes_to_the_partners_that_accept_when_the_first_ones_are_busy():
    """Partners whose downlinks other probes hold answer busy once ours waited its turn. The
    upload must go to the first partners that accept, not to the first two by position: when
    those two were busy, the uplink went unmeasured (at the start of a 12-peer run, most peers'
    probes did so, and an unmeasured uplink entered the LP as a placeholder)."""
    from dedloc_jax.averaging import measure_links

    meter = BandwidthMeter()

    async def main() -> None:
        net = SimNetwork(seed=0)
        async with (
            open_sim_nodes(net, 1, upload_bps=2e6, download_bps=8e6) as (a,),
            open_sim_nodes(net, 3, upload_bps=50e6, download_bps=50e6) as partners,
        ):
            locks = [LinkLocks() for _ in partners]
            for b, own in zip(partners, locks, strict=True):
                install_probe(b, own)
                a.peerstore.add_addrs(b.peer_id, b.addrs)
            async with locks[0]["down"], locks[1]["down"]:
                peers = [b.peer_id for b in partners]
                await measure_links(
                    a, peers, meter, locks=LinkLocks(), nbytes=2 << 20, timeout=30.0
                )

    run_sim(main)
    assert meter.upload_bps == pytest.approx(2e6, rel=0.1)
    assert meter.download_bps is not None


def test_twelve_peers_probing_at_once_measure_downlinks_five_times_their_uplinks():
    """Every peer of a run probes when it joins, so probes meet. A partner that declined every
    other probe while one used it left most downlinks unmeasured (187 of 210 probes of a
    12-peer run found every partner busy; downlinks read 0.05-0.66 of the truth): partners now
    queue probes per direction of their link. A downlink wider than every partner's uplink
    together cannot be filled: its figure is what they sent, marked as a lower bound. Each
    peer probes twice, as ``LinkKeeper.keep_measured`` does when a peer joins."""
    from dedloc_jax.averaging import measure_links

    mbit = 1e6 / 8
    ups = [(10, 25, 50, 100)[i % 4] * mbit for i in range(12)]
    meters = [BandwidthMeter() for _ in ups]

    async def main() -> None:
        net = SimNetwork(seed=0)
        async with open_sim_nodes(net, len(ups), latency=0.02) as nodes:
            locks = [LinkLocks() for _ in nodes]
            for node, up, meter, own in zip(nodes, ups, meters, locks, strict=True):
                install_probe(node, own, meter)
                net.set_bandwidth(host_of(net, node), up, 5 * up)
                for other in nodes:
                    if other is not node:
                        node.peerstore.add_addrs(other.peer_id, other.addrs)
            async with trio.open_nursery() as nursery:
                for i, node in enumerate(nodes):
                    partners = [p.peer_id for p in nodes if p is not node]
                    random.Random(i).shuffle(partners)
                    nursery.start_soon(twice, node, partners, meters[i], locks[i])

    async def twice(node, partners, meter, locks) -> None:  # as a joining peer does
        for _ in range(2):
            await measure_links(node, partners, meter, locks=locks, max_peers=11, timeout=240.0)

    run_sim(main)
    for i, (meter, up) in enumerate(zip(meters, ups, strict=True)):
        f = meter.figures(now=0.0)
        others = sum(ups) - up
        assert f.upload_bps == pytest.approx(up, rel=0.2), (i, f)
        if others > 5 * up:  # the partners together can fill it: measured
            assert f.download_bps == pytest.approx(5 * up, rel=0.2), (i, f)
            assert not meter.bounded("down", now=0.0), i
        else:  # they cannot: what they sent, marked
            assert f.download_bps == pytest.approx(others, rel=0.2), (i, f)
            assert meter.bounded("down", now=0.0), i
