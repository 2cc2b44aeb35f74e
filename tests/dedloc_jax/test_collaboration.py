from __future__ import annotations

import numpy as np
import trio

from dedloc_jax.config import CollaborationConfig
from p2p.testing import SimNetwork, run_sim
from tests.dedloc_jax.simcollab import open_sim_collaboration

MICRO = 4


def _grad(peer: int, epoch: int, step: int) -> np.ndarray:
    return np.random.default_rng([peer, epoch, step]).normal(size=(1000,)).astype(np.float32)


def _run(
    rates: list[float],
    epochs: int,
    target: int,
    seed: int = 0,
    modes: list[str] | None = None,
) -> list[list[dict]]:
    """Peers with throughputs ``rates`` (samples/s) train until ``epochs`` steps are done;
    aux peers (rate ignored) only help average."""
    config = CollaborationConfig.local_demo(target).replace(max_refresh=1.0)

    async def main() -> list[list[dict]]:
        net = SimNetwork(seed=seed)
        logs: list[list[dict]] = [[] for _ in rates]
        async with open_sim_collaboration(
            net, len(rates), config=config, latency=0.01, modes=modes
        ) as cores:

            async def peer(i: int) -> None:
                core, rate = cores[i], rates[i]
                if core.mode == "aux":
                    rounds = await core.run_aux([np.zeros(1000, np.float32)], epochs=epochs)
                    logs[i].append({"aux_rounds": rounds})
                    return
                for epoch in range(epochs):
                    acc = np.zeros(1000, np.float32)
                    samples = 0
                    step = 0
                    while True:
                        await trio.sleep(MICRO / rate)
                        acc += _grad(i, epoch, step) * MICRO
                        samples += MICRO
                        step += 1
                        if core.report(epoch, samples, MICRO):
                            break
                    mean = acc / samples
                    outcome = await core.average(epoch, [mean], samples)
                    logs[i].append(
                        {
                            "epoch": epoch,
                            "samples": samples,
                            "sent": mean,
                            "got": outcome.gradients[0],
                            "group": outcome.group_size,
                        }
                    )

            async with trio.open_nursery() as nursery:
                for i in range(len(rates)):
                    nursery.start_soon(peer, i)
        return logs

    return run_sim(main, seed=seed)


def test_peers_with_10x_spread_step_together_on_the_target() -> None:
    rates = [4.0, 8.0, 12.0, 20.0, 40.0]
    target = 400
    logs = _run(rates, epochs=3, target=target)
    for epoch in range(3):
        rows = [log[epoch] for log in logs]
        assert all(r["group"] == len(rates) for r in rows)
        total = sum(r["samples"] for r in rows)
        # Reached the target, overshooting by at most a couple of micro-batches per peer.
        assert target <= total <= target + 2 * MICRO * len(rates)
        expected = sum(r["sent"] * r["samples"] for r in rows) / total
        for r in rows:
            assert r["got"].tobytes() == rows[0]["got"].tobytes()  # bit-identical
            np.testing.assert_allclose(r["got"], expected, rtol=1e-5, atol=1e-6)


def test_clients_and_aux_peers_take_part() -> None:
    rates = [10.0, 20.0, 10.0, 0.0]
    modes = ["node", "node", "client", "aux"]
    logs = _run(rates, epochs=2, target=160, modes=modes)
    assert logs[3] == [{"aux_rounds": 2}]
    for epoch in range(2):
        rows = [log[epoch] for log in logs[:3]]
        assert all(r["group"] == 4 for r in rows)  # the aux peer is in every group
        total = sum(r["samples"] for r in rows)
        expected = sum(r["sent"] * r["samples"] for r in rows) / total
        for r in rows:
            assert r["got"].tobytes() == rows[0]["got"].tobytes()
            np.testing.assert_allclose(r["got"], expected, rtol=1e-5, atol=1e-6)
