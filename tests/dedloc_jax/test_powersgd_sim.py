"""PowerSGD rounds of four simulated peers over the real stack (matchmaking, butterfly all-reduce
with verified rounds): both phases in one group, every member the same mean, equal to the NumPy
reference round of the four contributions with their sample weights and error feedback."""

from __future__ import annotations

import numpy as np
import trio

from dedloc_jax import PowerSGD
from dedloc_jax.powersgd import initial_q, reference_round
from p2p.testing import SimNetwork
from tests.dedloc_jax.simcollab import open_sim_collaboration
from tests.dedloc_jax.test_diloco_sim import CONFIG, MICRO, _run

SHAPES = [(16, 12), (12,), (6, 5, 4)]
CFG = PowerSGD(rank=2, seed=4, codec="none")  # exact factors: the reference's means


def _run_rounds(late_q: float = 0.0) -> tuple[list[list], list[list]]:
    """Two epochs of PowerSGD rounds of four peers; ``late_q``: peer 3 starts every phase Q
    that many seconds after its phase P ended (as a member still checking phase P does)."""
    config = CONFIG.replace(defence=CONFIG.defence.replace(robust=False, verify=True))
    plan = CFG.plan(SHAPES)
    rng = np.random.default_rng(0)
    grads = [
        [[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(4)]
        for _ in range(2)
    ]
    got: list[list] = [[], []]  # per epoch: (peer, samples, outcome)

    async def main() -> None:
        net = SimNetwork(seed=11)
        async with open_sim_collaboration(net, 4, config=config, latency=0.01) as cores:
            if late_q:
                rounds = cores[3].rounds
                honest = rounds.all_reduce

                async def late(*args, **kwargs):
                    if kwargs.get("round_id") is not None:  # phase Q
                        await trio.sleep(late_q)
                    return await honest(*args, **kwargs)

                object.__setattr__(rounds, "all_reduce", late)

            async def peer(i: int) -> None:
                q = initial_q(CFG, SHAPES)
                errors = [np.zeros(SHAPES[j], np.float32) for j in plan.compressed]
                for epoch in range(2):
                    samples = 0
                    while True:
                        await trio.sleep(0.05 * (i + 1))  # unequal paces: unequal weights
                        samples += MICRO
                        if cores[i].report(epoch, samples, MICRO):
                            break
                    ms = list(grads[epoch][i])
                    for k, j in enumerate(plan.compressed):
                        ms[j] = ms[j] + errors[k]
                    sent = [*ms, *q, np.int32(len(ms))]
                    out = await cores[i].average(epoch, sent, samples, codec=CFG)
                    got[epoch].append((i, samples, out))
                    c = len(q)
                    n = len(SHAPES)
                    q, errors = out.gradients[n : n + c], out.gradients[n + c :]

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(peer, i)

    _run(main)
    return grads, got


def test_four_peers_average_both_phases_in_one_group_like_the_reference() -> None:
    grads, got = _run_rounds()
    plan = CFG.plan(SHAPES)
    q_ref = [a.astype(np.float64) for a in initial_q(CFG, SHAPES)]
    errors_ref = [[np.zeros(SHAPES[j]) for j in plan.compressed] for _ in range(4)]
    for epoch in range(2):
        rows = sorted(got[epoch], key=lambda r: r[0])
        assert all(o.group_size == 4 and o.complete for _, _, o in rows)
        first = rows[0][2].gradients[: len(SHAPES)]
        for _, _, o in rows[1:]:  # every member holds the same mean
            for a, b in zip(o.gradients[: len(SHAPES)], first, strict=True):
                assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        weights = [s for _, s, _ in rows]
        mean, errors_ref, q_ref = reference_round(CFG, grads[epoch], errors_ref, q_ref, weights)
        for a, b in zip(first, mean, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        for (_, _, o), want in zip(rows, errors_ref, strict=True):
            for a, b in zip(o.gradients[len(SHAPES) + len(q_ref) :], want, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_member_that_starts_phase_q_late_is_still_averaged() -> None:
    """Phase Q starts when each member's phase P ended: 4 s apart here. Before phase Q's
    reducers waited for that spread, they stopped collecting parts 2.5 s after their own start
    (half the 5 s timeout of its small vector) and every round failed its phase Q."""
    _, got = _run_rounds(late_q=4.0)
    for epoch in range(2):
        assert all(o.group_size == 4 and o.complete for _, _, o in got[epoch]), [
            (o.group_size, o.complete) for _, _, o in got[epoch]
        ]
