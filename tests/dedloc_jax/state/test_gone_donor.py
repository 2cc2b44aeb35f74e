"""A donor that left: its offer lives in the DHT (and its record in the progress table) until
it lapses; a newcomer that found it unreachable once does not ask it again."""

from __future__ import annotations

import logging

import numpy as np
import trio
import trio.testing

from dedloc_jax.config import CollaborationConfig
from dedloc_jax.state.download import GoneDonors
from dedloc_jax.state.keeping import StepKeeper, keep_in_step_async
from dedloc_jax.state.lineage import Announcement
from p2p.testing import SimNetwork, host_of
from tests.dedloc_jax.simcollab import open_sim_collaboration


def test_a_newcomer_drops_a_gone_donors_offer_after_one_failure(caplog) -> None:
    """Peer 0 serves the run's state of epoch 3 and is killed; its offer and record stay for a
    record's lifetime. The newcomer (peer 1) is behind, and retried the download about once
    a second until they lapsed (60 INFO lines a minute, a dial each): it tries once, then
    waits quietly at its own state, and loads the state a live peer (peer 2) announces."""
    config = CollaborationConfig(target_batch_size=10**6)

    async def main() -> dict:
        net = SimNetwork(seed=1)
        async with open_sim_collaboration(net, 3, config=config, latency=0.01) as cores:
            gone, newcomer, live = cores
            gone.report(3, 4, 4)
            await gone.share_state([np.ones(8, np.float32)], 3)
            await trio.sleep(5 * config.progress.max_refresh)  # the newcomer's table names it
            assert newcomer.behind
            net.kill(host_of(net, gone.node))
            keeper = StepKeeper()
            params, epoch, samples = [np.zeros(8, np.float32)], 0, 0
            with trio.move_on_after(40.0):  # within the record's lifetime
                while True:
                    await trio.sleep(0.25)
                    newcomer.report(epoch, samples := samples + 4, 4)
                    params, epoch = await keep_in_step_async(newcomer, keeper, params, epoch, False)
            out = {"failures": keeper.load_failures, "epoch": epoch, "behind": newcomer.behind}
            live.report(5, 4, 4)
            await live.share_state([np.full(8, 5.0, np.float32)], 5)
            with trio.move_on_after(20.0):
                while epoch != 5:
                    await trio.sleep(0.25)
                    newcomer.report(epoch, samples := samples + 4, 4)
                    params, epoch = await keep_in_step_async(newcomer, keeper, params, epoch, False)
            out["then"] = (epoch, params[0][0])
            return out

    with caplog.at_level(logging.INFO, logger="dedloc_jax"):
        out = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    noise = [r.getMessage() for r in caplog.records if r.name.startswith("dedloc_jax.state")]
    assert out["behind"]  # the gone peer's record still names epoch 3
    assert out["epoch"] == 0
    assert out["failures"] <= 1, noise
    assert len(noise) <= 4, noise
    assert out["then"] == (5, 5.0)  # a live peer's state is loaded at once


def test_a_dropped_offer_counts_again_once_its_peer_announces_anew_or_after_the_hold() -> None:
    async def main() -> None:
        gone = GoneDonors(lambda: 60.0)
        a, b = Announcement("A", 3, b"a3"), Announcement("B", 3, b"a3")
        gone.drop("A", 3, b"a3")
        assert gone.offers([a, b]) == [b]
        assert gone.offers([Announcement("A", 4, b"a4")]) == [Announcement("A", 4, b"a4")]
        await trio.sleep(59.0)
        assert gone.offers([a]) == []
        await trio.sleep(2.0)
        assert gone.offers([a]) == [a]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
