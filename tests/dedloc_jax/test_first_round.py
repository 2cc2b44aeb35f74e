"""The first round of a realistic run completes for every member, before any measurement."""

from __future__ import annotations

import numpy as np
import trio

from dedloc_jax.config import CollaborationConfig
from p2p.testing import SimNetwork, host_of, run_sim
from tests.dedloc_jax.simcollab import open_sim_collaboration

MBIT = 1e6 / 8
PARAMS = 6_000_000


def test_first_round_of_6_peers_x_6m_parameters_completes_for_every_member() -> None:
    """Home uplinks (10-100 Mbit/s) and nothing measured yet: the round's timeout must follow
    what such links need (about 16 s for the 10 Mbit/s peers' traffic), not a bound computed
    from placeholder rates of 1e12 B/s (0 s, hence the 5 s minimum: 4 of 6 stepped alone)."""
    ups = [10, 25, 50, 100, 10, 25]
    config = CollaborationConfig.local_demo(48)
    config = config.replace(
        rounds=config.rounds.replace(codec="fp16"),
        progress=config.progress.replace(max_refresh=1.0),
    )
    outcomes: list = [None] * len(ups)

    async def main() -> None:
        net = SimNetwork(seed=0)
        async with open_sim_collaboration(net, len(ups), config=config, latency=0.02) as cores:
            for core, up in zip(cores, ups, strict=True):
                net.set_bandwidth(host_of(net, core.node), up * MBIT, 100 * MBIT)

            async def peer(i: int) -> None:
                core = cores[i]
                samples = 0
                while not core.report(0, samples := samples + 4, 4):
                    await trio.sleep(0.5)
                grad = np.random.default_rng(i).standard_normal(PARAMS).astype(np.float32)
                outcomes[i] = await core.average(0, [grad], samples)

            async with trio.open_nursery() as nursery:
                for i in range(len(ups)):
                    nursery.start_soon(peer, i)

    run_sim(main, seed=0)
    assert [o.group_size for o in outcomes] == [len(ups)] * len(ups)
    assert all(o.complete for o in outcomes)
    first = outcomes[0].gradients[0]
    assert all(np.array_equal(o.gradients[0], first) for o in outcomes)
