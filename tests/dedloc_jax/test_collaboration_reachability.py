"""A peer's averaging mode follows its reachability mid-run (simulator, NAT = unreachable host).

Four peers detect their reachability (``p2p.nat``) and nobody offers a relay, so a peer that
loses its inbound path has none at all. Peer 3 starts public (a node that reduces a share),
loses reachability after two epochs (its averaging mode must turn to client by the next
round), then gets it back (node again). Every round must still complete with all four peers
and bit-identical means.
"""

from __future__ import annotations

import numpy as np
import trio

from dedloc_jax.config import CollaborationConfig
from p2p.nat import NATConfig
from p2p.testing import SimNetwork, host_of, run_sim
from tests.dedloc_jax.simcollab import open_sim_collaboration

MICRO = 4
TARGET = 160
RATES = [10.0, 20.0, 10.0, 10.0]
PHASES = [("node", True), ("client", False), ("node", True)]  # peer 3: expected mode, reachable
EPOCHS_PER_PHASE = 2
ROAMER = 3


def _grad(peer: int, epoch: int, step: int) -> np.ndarray:
    return np.random.default_rng([peer, epoch, step]).normal(size=(500,)).astype(np.float32)


def test_averaging_mode_follows_reachability_and_rounds_still_complete() -> None:
    # robust=False: compared with the plain weighted mean (open runs default to CenteredClip)
    config = CollaborationConfig.local_demo(TARGET)
    config = config.replace(
        progress=config.progress.replace(max_refresh=1.0),
        defence=config.defence.replace(robust=False),
    )
    nat_config = NATConfig.testing().replace(offer_relay=False)
    n = len(RATES)
    logs: list[list[dict]] = [[] for _ in range(n)]
    waited: list[float | None] = []

    async def main() -> None:
        net = SimNetwork(seed=3)
        async with open_sim_collaboration(
            net, n, config=config, nat=True, nat_config=nat_config, modes=[None] * n, latency=0.01
        ) as cores:
            phase_done = [trio.Semaphore(0) for _ in PHASES]
            go = [trio.Event() for _ in PHASES]
            go[0].set()

            async def peer(i: int) -> None:
                core = cores[i]
                epoch = 0
                for p in range(len(PHASES)):
                    await go[p].wait()
                    for _ in range(EPOCHS_PER_PHASE):
                        acc = np.zeros(500, np.float32)
                        samples = step = 0
                        while True:
                            await trio.sleep(MICRO / RATES[i])
                            acc += _grad(i, epoch, step) * MICRO
                            samples += MICRO
                            step += 1
                            if core.report(epoch, samples, MICRO):
                                break
                        mean = acc / samples
                        out = await core.average(epoch, [mean], samples)
                        logs[i].append(
                            {
                                "sent": mean,
                                "samples": samples,
                                "got": out.gradients[0],
                                "group": out.group_size,
                                "complete": out.complete,
                                "mode": core.history[-1].mode,
                            }
                        )
                        epoch += 1
                    phase_done[p].release()

            async def controller() -> None:
                roamer = cores[ROAMER]
                for p, (mode, reachable) in enumerate(PHASES):
                    if p:
                        for _ in range(n):
                            await phase_done[p - 1].acquire()
                        host_of(net, roamer.node).reachable = reachable
                        start = trio.current_time()
                        with trio.move_on_after(600):
                            while roamer.mode != mode:
                                await trio.sleep(1)
                        waited.append(trio.current_time() - start if roamer.mode == mode else None)
                        go[p].set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(controller)
                for i in range(n):
                    nursery.start_soon(peer, i)

    run_sim(main, timeout=7200)
    print(f"virtual seconds until the mode followed each change: {waited}")
    # the mode followed each change (seconds of virtual time it took; None: it never did)
    assert all(w is not None for w in waited), waited
    expected_modes = [mode for mode, _ in PHASES for _ in range(EPOCHS_PER_PHASE)]
    assert [row["mode"] for row in logs[ROAMER]] == expected_modes
    assert all(row["mode"] == "node" for log in logs[:ROAMER] for row in log)
    for epoch in range(len(expected_modes)):
        rows = [log[epoch] for log in logs]
        assert all(r["complete"] and r["group"] == n for r in rows), (epoch, rows)
        total = sum(r["samples"] for r in rows)
        expected = sum(r["sent"] * r["samples"] for r in rows) / total
        for r in rows:
            assert r["got"].tobytes() == rows[0]["got"].tobytes()  # bit-identical
            np.testing.assert_allclose(r["got"], expected, rtol=1e-5, atol=1e-6)
