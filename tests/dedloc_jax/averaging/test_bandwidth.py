import pytest

from dedloc_jax.averaging import BandwidthMeter, install_probe, probe
from p2p.sim import SimNetwork
from p2p.testing import open_sim_nodes, run_sim


def test_meter_smooths_samples_and_override_wins():
    meter = BandwidthMeter(alpha=0.5)
    assert meter.upload_bps is None and not meter.measured
    meter.record("up", 1000, 1.0)
    assert meter.upload_bps == 1000
    meter.record("up", 3000, 1.0)
    assert meter.upload_bps == pytest.approx(2000)
    meter.record("up", 0, 1.0)  # an empty transfer says nothing
    meter.record("up", 10, 0.0)
    assert meter.upload_bps == pytest.approx(2000)
    meter.record("down", 500, 2.0)
    assert meter.download_bps == 250 and meter.measured
    meter.upload_override = 1e9
    assert meter.upload_bps == 1e9
    with pytest.raises(ValueError):
        meter.record("sideways", 1, 1.0)


def test_probe_measures_simulated_links():
    meter = BandwidthMeter()

    async def main() -> None:
        net = SimNetwork(seed=0)
        async with (
            open_sim_nodes(net, 1, upload_bps=2e6, download_bps=8e6) as (a,),
            open_sim_nodes(net, 1, upload_bps=50e6, download_bps=50e6) as (b,),
        ):
            install_probe(b)
            a.peerstore.add_addrs(b.peer_id, b.addrs)
            await probe(a, b.peer_id, meter, nbytes=4 << 20)

    run_sim(main)
    # a's uplink (2 MB/s) and downlink (8 MB/s) are the bottlenecks of each direction
    assert meter.upload_bps == pytest.approx(2e6, rel=0.1)
    assert meter.download_bps == pytest.approx(8e6, rel=0.1)
