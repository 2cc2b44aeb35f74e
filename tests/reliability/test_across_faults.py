"""The round across capped groups when a representative dies before it (dedloc_jax.rounds.across,
dedloc_jax.rounds.average)."""

from __future__ import annotations

import numpy as np
import trio

from dedloc_jax.config import CollaborationConfig, DefenceConfig
from dedloc_jax.rounds import across
from p2p.testing import SimNetwork, host_of, run_sim
from tests.dedloc_jax.simcollab import open_sim_collaboration

PEERS = 7
SAMPLES = [8, 12, 16, 20, 24, 28, 32]


def test_a_representative_that_dies_leaves_its_group_with_its_own_mean(monkeypatch) -> None:
    """The first representative to reach the round across groups dies there. Its group's
    members cannot reach it: they keep their group's mean (bit-identical among them) and do
    not hang; every other peer gets the mean of the remaining groups, and knows it is partial
    (not the epoch's mean: a group is missing), so that it checks the fork before training."""
    # robust=False: compared with the plain weighted mean (open runs default to CenteredClip)
    config = CollaborationConfig.local_demo(sum(SAMPLES))
    config = config.replace(
        rounds=config.rounds.replace(max_group_size=3), defence=DefenceConfig(robust=False)
    )
    represent = across.represent
    died: list[str] = []

    async def represent_or_die(rounds, *args, **kwargs):
        if not died:
            died.append(str(rounds.node.peer_id))
            net.kill(host_of(net, rounds.node))
            return None
        return await represent(rounds, *args, **kwargs)

    monkeypatch.setattr(across, "represent", represent_or_die)
    net = SimNetwork(seed=3)
    sent = [np.random.default_rng(i).normal(size=500).astype(np.float32) for i in range(PEERS)]
    got: list[np.ndarray | None] = [None] * PEERS
    complete: list[bool | None] = [None] * PEERS

    async def main() -> None:
        async with open_sim_collaboration(net, PEERS, config=config, latency=0.01) as cores:

            async def peer(i: int) -> None:
                core = cores[i]
                while not core.report(0, SAMPLES[i], SAMPLES[i]):
                    await trio.sleep(0.5)
                with trio.fail_after(600):
                    outcome = await core.average(0, [sent[i]], SAMPLES[i])
                got[i] = outcome.gradients[0]
                complete[i] = outcome.complete

            async with trio.open_nursery() as nursery:
                for i in range(PEERS):
                    nursery.start_soon(peer, i)

    run_sim(main, seed=3)
    assert len(died) == 1
    versions: dict[bytes, list[int]] = {}
    for i, g in enumerate(got):
        assert g is not None and np.isfinite(g).all()
        versions.setdefault(g.tobytes(), []).append(i)
    assert len(versions) == 2, [len(v) for v in versions.values()]
    small, rest = sorted(versions.values(), key=len)
    assert 1 <= len(small) <= 3 and len(rest) == PEERS - len(small), (small, rest)
    assert complete == [False] * PEERS, complete

    def mean_of(peers: list[int]) -> np.ndarray:
        total = sum(SAMPLES[i] for i in peers)
        return sum(sent[i] * SAMPLES[i] for i in peers) / total

    np.testing.assert_allclose(got[small[0]], mean_of(small), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[rest[0]], mean_of(rest), rtol=1e-5, atol=1e-6)
