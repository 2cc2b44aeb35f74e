"""Robust aggregation reached from the collaboration: ``DefenceConfig.robust_tau``.

The averaging-level bound is shown in ``tests/dedloc_jax/averaging/test_robust.py``; here the
option travels from the collaboration's config into every all-reduce round (and into the repair
of a share whose reducer died), so one peer sending scaled gradients stays bounded.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from dedloc_jax.averaging import AllReduceConfig
from dedloc_jax.averaging.robust import cap_weights
from dedloc_jax.config import CollaborationConfig, DefenceConfig
from p2p.testing import SimNetwork, host_of, run_sim
from tests.dedloc_jax.averaging.helpers import run_round
from tests.dedloc_jax.simcollab import open_sim_collaboration

DIM = 1000
TAU = 5.0


def _honest(rng: np.random.Generator, truth: np.ndarray) -> np.ndarray:
    return (truth + 0.05 * rng.standard_normal(DIM)).astype(np.float32)


def _collaboration_round(robust_tau: float | None) -> tuple[list[dict], list[np.ndarray]]:
    """Five peers average once; peer 4 sends its gradient scaled by 10^4."""
    # robust_tau None: the plain mean (an open run's default is CenteredClip, derived radius)
    config = CollaborationConfig.local_demo(5 * 8).replace(
        defence=DefenceConfig(robust_tau=robust_tau, robust=robust_tau is not None)
    )
    truth = np.random.default_rng(1).standard_normal(DIM).astype(np.float32)
    sent = []
    for i in range(5):
        g = _honest(np.random.default_rng([2, i]), truth)
        sent.append(g * np.float32(1e4) if i == 4 else g)

    async def main() -> list[dict]:
        net = SimNetwork(seed=3)
        logs: list[dict] = [{} for _ in range(5)]
        async with open_sim_collaboration(net, 5, config=config, latency=0.01) as cores:

            async def peer(i: int) -> None:
                core, samples = cores[i], 0
                while True:
                    await trio.sleep(0.1)
                    samples += 4
                    if core.report(0, samples, 4):
                        break
                outcome = await core.average(0, [sent[i]], samples)
                logs[i] = {
                    "got": outcome.gradients[0],
                    "group": outcome.group_size,
                    "samples": samples,
                }

            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(peer, i)
        return logs

    return run_sim(main, seed=3), sent


def test_config_rejects_a_non_positive_robust_tau() -> None:
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="robust_tau"):
            CollaborationConfig(defence=DefenceConfig(robust_tau=bad))
    assert CollaborationConfig(defence=DefenceConfig(robust_tau=1.0)).defence.robust_tau == 1.0


def test_collaboration_with_robust_tau_bounds_a_peer_sending_scaled_gradients() -> None:
    logs, sent = _collaboration_round(TAU)
    assert all(log["group"] == 5 for log in logs), [log["group"] for log in logs]
    got = logs[0]["got"]
    assert all(log["got"].tobytes() == got.tobytes() for log in logs)  # still in step
    # Weights are the samples, capped at 2x their median; the honest peers' weighted mean is
    # what the group should get, and CenteredClip keeps the scaled peer (weight share beta)
    # within beta / (1 - beta) x tau of it in each chunk: here each of the 5 reducers' shares
    # is one chunk, so within sqrt(5) times that over the whole vector.
    w = cap_weights([log["samples"] for log in logs])
    beta = w[4] / w.sum()
    honest = np.average(np.asarray(sent[:4], np.float64), axis=0, weights=w[:4])
    err = float(np.linalg.norm(got.astype(np.float64) - honest))
    assert err <= np.sqrt(5) * beta / (1 - beta) * TAU * 1.01, (err, beta)
    plain, _ = _collaboration_round(None)
    # Without the option the same peer drags the average away by orders of magnitude more.
    assert float(np.linalg.norm(plain[0]["got"].astype(np.float64) - honest)) > 100 * TAU


def test_repair_of_a_dead_reducers_share_is_robust_too() -> None:
    """A reducer dies mid-round; the survivors re-reduce its share with CenteredClip."""
    rng = np.random.default_rng(4)
    dim, tau, chunk = 2000, 1.0, 16
    truth = rng.standard_normal(dim).astype(np.float32)
    vecs = [(truth + 0.01 * rng.standard_normal(dim)).astype(np.float32) for _ in range(5)]
    honest = np.mean(np.asarray([v for i, v in enumerate(vecs) if i not in (1, 4)]), axis=0)
    vecs[4] = vecs[4] * np.float32(1e4)  # the scaled peer

    async def kill_reducer_1(net, nodes, scopes) -> None:
        await trio.sleep(0.4)  # the fault-free round takes about 1.5 s here
        net.kill(host_of(net, nodes[1]))
        scopes[1].cancel()

    cfg = AllReduceConfig.testing().replace(chunk_elems=chunk, robust_tau=tau)
    outcome, _, names = run_round(
        ["node"] * 5,
        [{"g": v} for v in vecs],
        [1.0] * 5,
        config=cfg,
        bandwidth=[(1e4, 1e4)] * 5,
        fault=kill_reducer_1,
    )
    results = [o for o in outcome if o is not None and not isinstance(o, Exception)]
    assert len(results) == 4, outcome
    assert all(r.vector.tobytes() == results[0].vector.tobytes() for r in results)
    lost = next(s for s in results[0].shares if s.owner == names[1])
    assert lost.repaired
    got = results[0].vector.astype(np.float64)
    rebuilt = 0
    for a, b, who in lost.segments:
        if names[1] in who:
            continue  # reduced by the dead reducer before it died (robustly, as configured)
        rebuilt += b - a
        for x in range(a, b, chunk):
            y = min(x + chunk, b)
            # honest members: 3 of 4 contributors (the dead one excluded), weight share 1/4
            err = np.linalg.norm(got[x:y] - honest[x:y])
            assert err <= tau / 3 + 0.05, (x, err)
    assert rebuilt > 0  # some chunks really were re-reduced by the repair
