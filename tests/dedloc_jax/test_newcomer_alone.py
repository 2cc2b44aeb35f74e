"""A newcomer that skipped the round under way, whose peers then left, goes on by itself."""

from __future__ import annotations

import logging

import numpy as np
import trio

from dedloc_jax.config import CollaborationConfig
from p2p.dht import DHTClock, DHTConfig
from p2p.node import NodeConfig
from p2p.testing import SimNetwork, host_of, open_sim_nodes, run_sim
from tests.dedloc_jax.simcollab import open_sim_collaboration

MICRO = 4


def test_a_newcomer_whose_skipped_rounds_peers_left_steps_by_itself(caplog) -> None:
    """The README's own-code block in a toy loop: the run's first peers reach the target in
    a few micro-steps and average as a newcomer joins, so the newcomer skips that round; then
    they are gone. The newcomer waited for "the others to move on" forever (a real run: 215 s
    at epoch 2, 17,220 micro-batches fed, never a step, nothing above INFO): once no other
    peer is at its epoch it goes on, says so in a WARNING, and steps when it reaches the
    target."""
    from dedloc_jax.opening import open_collaboration

    config = CollaborationConfig.local_demo(48)
    links = {"latency": 0.01, "upload_bps": 2e6, "download_bps": 8e6}

    async def main() -> dict:
        net = SimNetwork(seed=5)
        out: dict = {"outcomes": [], "missed": False, "due": None}
        async with open_sim_collaboration(net, 3, config=config, **links) as cores:

            async def train(i: int) -> None:
                samples = 0
                while not cores[i].report(0, samples := samples + MICRO, MICRO):
                    await trio.sleep(MICRO / 8.0)
                out["outcomes"].append(await cores[i].average(0, [np.ones(5, np.float32)], 1))

            async def newcomer() -> None:
                while not all(c.tracker._frozen for c in cores):  # all three average
                    await trio.sleep(0.05)
                async with (
                    open_sim_nodes(net, 1, config=NodeConfig.testing(), **links) as (node,),
                    open_collaboration(
                        node,
                        "run",
                        initial_peers=[str(cores[0].node.addrs[0])],
                        config=config.replace(mode="node"),
                        dht_config=DHTConfig.fast(),
                        dht_clock=DHTClock(trio.current_time),
                    ) as core,
                ):
                    samples = 0
                    with trio.move_on_after(600):
                        while True:
                            await trio.sleep(MICRO / 8.0)
                            if core.report(0, samples := samples + MICRO, MICRO):
                                out["due"] = (core.tracker.epoch, samples)
                                break
                            missed = core.snapshot().missed is not None
                            if missed and not out["missed"]:
                                out["note"] = core.leaving_note()
                            out["missed"] |= missed
                            if missed and len(out["outcomes"]) == 3 and not out.get("killed"):
                                for c in cores:  # they averaged and are gone (a toy loop)
                                    net.kill(host_of(net, c.node))
                                out["killed"] = True

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(train, i)
                nursery.start_soon(newcomer)
        return out

    with caplog.at_level(logging.WARNING, logger="dedloc_jax.peer"):
        out = run_sim(main, seed=5)
    assert len(out["outcomes"]) == 3 and out.get("killed")
    assert out["missed"]  # it joined while their round ran, and skipped it
    # Had its loop ended then, leaving would have said why its samples are in no step.
    assert "leaving before this peer averaged once" in out["note"]
    assert "epoch 0's round began before our first micro-step" in out["note"]
    assert out["due"] is not None and out["due"][0] == 0  # it went on (never, before)
    assert out["due"][1] >= 48  # by its own samples, once the others' records lapsed
    assert any("no peer is left at it" in r.getMessage() for r in caplog.records)


def test_a_newcomer_joins_only_a_lone_peer_that_stopped_under_a_window_ago() -> None:
    """The skip rule's narrowing (peer.py): at its first report toward an epoch whose every
    other contributor already waits without having seen it, a newcomer joins when one peer
    waits, alone, and stopped under a matchmaking window ago (it expects nobody, so its
    gathering still takes registrations: a restarted newcomer skipped every round of a lone
    survivor, 9 lone steps); it still skips one that stopped earlier, one whose time is ahead
    of ours (a claim), and two or more waiting peers (they close as soon as both registered:
    joining then forked the newcomer)."""
    from dedloc_jax.progress import CollaborationEstimate, PeerProgress

    config = CollaborationConfig.local_demo(48)

    async def main() -> dict[str, bool]:
        net = SimNetwork(seed=5)
        async with open_sim_collaboration(net, 1, config=config, latency=0.01) as (core,):
            await trio.sleep(5.0)
            est = CollaborationEstimate(1, 48.0, 0.0, 0.0, 2, 0, 48, others_waiting=True)
            window = core.stepper.deadlines(est).window
            now = core.dht.now()

            def skips(*stopped: float) -> bool:
                core.tracker.records = {
                    f"p{i}": PeerProgress(f"p{i}", 1, 48, 8.0, now - ago, waiting=True)
                    for i, ago in enumerate(stopped)
                }
                return core._round_began_without_us(1, est)

            return {
                "recent": skips(0.2 * window),
                "earlier": skips(1.5 * window),
                "ahead": skips(-1.0),
                "two": skips(0.2 * window, 0.1 * window),
            }

    out = run_sim(main, seed=5)
    assert out == {"recent": False, "earlier": True, "ahead": True, "two": True}
