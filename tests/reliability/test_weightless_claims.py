"""A peer whose contribution weighs nothing counts no samples toward the target (simulator,
virtual time; and the pure rule behind it)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from dedloc_jax.averaging.group import Member
from dedloc_jax.averaging.verify import ShareFigures, Statement
from dedloc_jax.averaging.weighing import kept_fractions
from dedloc_jax.config import CollaborationConfig
from dedloc_jax.rounds.claims import MIN_KEPT, weightless
from p2p.testing import SimNetwork, run_sim
from tests.dedloc_jax.simcollab import open_sim_collaboration

PEERS = 4
HOSTILE = 3
DIM = 300
BATCH = 8
EPOCHS = 6


def _run(attack: str | None) -> tuple[list[int], int, list[set[str]]]:
    """Per epoch, the samples the honest peers stepped with; the target; each honest peer's
    void set at the end."""
    target = PEERS * BATCH * 4
    config = CollaborationConfig.local_demo(target)
    assert config.robust_on and config.verify_on  # the open-run defaults
    rng = np.random.default_rng(5)
    truth = rng.standard_normal(DIM).astype(np.float32)
    fed = [0] * EPOCHS
    void: list[set[str]] = []

    async def main() -> None:
        net = SimNetwork(seed=7)
        async with open_sim_collaboration(net, PEERS, config=config, latency=0.01) as cores:

            async def peer(i: int) -> None:
                core = cores[i]
                for epoch in range(EPOCHS):
                    samples = 0
                    while True:
                        await trio.sleep(0.1)
                        samples += BATCH
                        if core.report(epoch, samples, BATCH):
                            break
                    g = truth + 0.3 * rng.standard_normal(DIM).astype(np.float32)
                    weight = samples
                    if i == HOSTILE and attack == "sign_flip":
                        g = g * np.float32(-1000.0)
                    if i == HOSTILE and attack == "free_rider":
                        weight = 0
                    if i != HOSTILE:
                        fed[epoch] += samples
                    await core.average(epoch, [g], weight)

            async with trio.open_nursery() as nursery:
                for i in range(PEERS):
                    nursery.start_soon(peer, i)
            void.extend(set(cores[i].tracker.void) for i in range(PEERS) if i != HOSTILE)

    run_sim(main, seed=7)
    return fed, target, void


@pytest.mark.parametrize("attack", ["sign_flip", "free_rider"])
def test_a_peer_whose_gradient_weighs_nothing_counts_no_samples_toward_the_target(attack):
    """One of four sends -1000 x its gradient (or weight 0) but reports its samples: its part
    weighs nothing, yet its samples counted toward every epoch, and the honest peers stepped
    with 3/4 of the target each epoch (bench.byzantine's sign_flip and free_rider cost). From
    the epoch after the first round, its claims count 0: the honest peers feed the target."""
    fed, target, void = _run(attack)
    # (before: 96 of 128 each epoch, the hostile peer's quarter counted)
    assert min(fed[2:]) >= 0.95 * target, (fed, target)
    assert all(len(v) == 1 for v in void)  # every honest peer marked the hostile one


def test_honest_peers_count_each_other_whole():
    """A clean run: nobody is marked (every part weighs)."""
    _, _, void = _run(None)
    assert void == [set()] * (PEERS - 1)


def _statement(sender: int, weight: float, norms: list[float]) -> Statement:
    n = len(norms)
    figs = ShareFigures(bytes(32), np.zeros(n), np.asarray(norms, np.float64), bytes(32))
    return Statement(b"r", b"g", sender, weight, bytes(32), {0: figs}, {})


def test_a_part_clipped_by_chance_keeps_counting_an_outlier_does_not():
    """Chunk norms 1, 1, 3 (clipped by CenteredClip: over the radius of 2 upper medians, but
    within verify.OUTLIER's 5 radii) and 1000 (a -1000x part): the third keeps its weight,
    the fourth keeps nothing; a member that signed weight 0 for its registered weight keeps
    nothing either, and a sender in no checked chunk gets no verdict."""
    members = [Member(f"p{i}", "node", 1e6, 1e6, 8.0) for i in range(5)]
    norms = [[1.0, 1.0], [1.0, 1.0], [3.0, 3.0], [1000.0, 1000.0], [0.0, 0.0]]
    statements = {i: _statement(i, 8.0, norms[i]) for i in range(4)}
    statements[4] = _statement(4, 0.0, norms[4])
    chunks = [(0, k, frozenset(range(4)), 10) for k in range(2)]
    kept = kept_fractions(members, statements, chunks, True, None)
    assert kept == {"p0": 1.0, "p1": 1.0, "p2": 1.0, "p3": 0.0, "p4": 0.0}
    assert weightless(kept) == ({"p3", "p4"}, {"p0", "p1", "p2"})
    # half its values outliers: still counted (the odd chunk an honest batch alone touched)
    statements[2] = _statement(2, 8.0, [1.0, 1000.0])
    statements[3] = _statement(3, 8.0, [1000.0, 1.0])
    kept = kept_fractions(members[:4], statements, chunks, True, None)
    assert kept["p2"] == kept["p3"] == 0.5 >= MIN_KEPT
    # a plain mean (private run) weighs every part
    assert kept_fractions(members[:4], statements, chunks, False, None)["p3"] == 1.0
