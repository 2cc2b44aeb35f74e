"""The meter measures this peer's own links in the simulator (asymmetric, concurrent rounds)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from dedloc_jax.averaging import (
    AllReduceConfig,
    AveragingService,
    BandwidthMeter,
    GroupSpec,
    LinkLocks,
    Member,
    all_reduce,
    install_probe,
    measure_links,
)
from p2p.sim import SimNetwork
from p2p.testing import host_of, open_sim_nodes, run_sim

MBIT = 1e6 / 8


def _measure(n: int, size: int, *, probe: bool) -> tuple[list, list, list]:
    """Uplinks 10/25/50/100 Mbit/s in turn, downlinks 100; peers probe as they join (partners
    with the widest published uplinks first), then two rounds each of two groups at once
    (halves and the whole), every link measured by its own peer's meter."""
    ups = [(10, 25, 50, 100)[i % 4] * MBIT for i in range(n)]
    downs = [100 * MBIT] * n
    meters = [BandwidthMeter() for _ in range(n)]

    async def main() -> None:
        net = SimNetwork(seed=0)
        async with open_sim_nodes(net, n) as nodes:
            services = [AveragingService(node, AllReduceConfig.internet()) for node in nodes]
            locks = [LinkLocks() for _ in nodes]
            for i, node in enumerate(nodes):
                install_probe(node, locks[i])
                net.set_bandwidth(host_of(net, node), ups[i], downs[i])
            for a in nodes:
                for b in nodes:
                    if a is not b:
                        a.peerstore.add_addrs(b.peer_id, b.addrs)
            if probe:
                for i, node in enumerate(nodes):
                    others = sorted(
                        (j for j in range(n) if j != i),
                        key=lambda j: -(meters[j].upload_bps or 0.0),
                    )
                    partners = [nodes[j].peer_id for j in others]
                    await measure_links(node, partners, meters[i], locks=locks[i])
            rng = np.random.default_rng(0)
            for r in range(2):
                groups = [list(range(0, n, 2)), list(range(1, n, 2)), list(range(n))]
                async with trio.open_nursery() as nursery:
                    for g, group in enumerate(groups):
                        spec = GroupSpec(
                            tuple(
                                Member(str(nodes[i].peer_id), "node", ups[i], downs[i], 1.0)
                                for i in group
                            ),
                            f"round{r}.{g}".encode(),
                        )
                        for i in group:
                            vec = rng.standard_normal(size).astype(np.float32)
                            nursery.start_soon(
                                lambda i=i, spec=spec, vec=vec: all_reduce(
                                    services[i], spec, vec, 1.0, codec="fp16", meter=meters[i]
                                )
                            )

    run_sim(main)
    return meters, ups, downs


@pytest.mark.parametrize("n", [4, 16])
def test_measured_links_are_within_20_percent(n):
    meters, ups, downs = _measure(n, 1_000_000, probe=True)
    for i, (m, up, down) in enumerate(zip(meters, ups, downs, strict=True)):
        f = m.figures()
        assert f.upload_bps == pytest.approx(up, rel=0.2), (i, f)
        assert f.download_bps == pytest.approx(down, rel=0.2), (i, f)


def test_rounds_alone_give_lower_bounds_of_the_links():
    """Without a probe the figures come from rounds only: bounded by the true links (the old
    meter divided by first-to-last send time and read the 10 Mbit/s uplink as 50), and the
    uplinks, which the rounds fill, within a factor two."""
    meters, ups, downs = _measure(4, 3_000_000, probe=False)
    for i, (m, up, down) in enumerate(zip(meters, ups, downs, strict=True)):
        f = m.figures()
        assert f.upload_bps is not None and f.download_bps is not None, (i, f)
        assert 0.5 * up <= f.upload_bps <= 1.05 * up, (i, f)
        assert f.download_bps <= 1.05 * down, (i, f)
