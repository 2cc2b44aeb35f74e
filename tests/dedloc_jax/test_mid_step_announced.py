"""Peers that check mid-step whether to average announce it (``PeerProgress.poll``), and a
round matchmakes eagerly only when every peer it expects does (dedloc_jax.rounds.stepping)."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from dedloc_jax.config import CollaborationConfig
from dedloc_jax.progress import PeerProgress
from dedloc_jax.validators import PROGRESS
from p2p.testing import SimNetwork, run_sim
from tests.dedloc_jax.simcollab import open_sim_collaboration

MICRO = 4
EPOCHS = 4


@pytest.mark.parametrize("mixed", [False, True], ids=["all-check-mid-step", "one-does-not"])
def test_a_round_is_eager_only_when_every_expected_peer_announces_its_poll(mixed: bool) -> None:
    """The eager matchmaking and the poll-sized window were on only for peers configured
    with ``RoundConfig.mid_step_poll``: a default ``collaborative(mid_step=True)`` peer,
    which checks mid-step at the default poll, never got them. Such a peer now announces its
    poll in its record. A peer that decides between micro-steps only (here peer 2, when
    ``mixed``) announces none, and the rounds that expect it keep the old path: it would
    register up to a micro-step after the others. Either way every round averages the three."""
    config = CollaborationConfig.local_demo(48)
    config = config.replace(progress=config.progress.replace(max_refresh=1.0))
    mid_step = [True, True, not mixed]

    async def main() -> dict:
        out: dict = {"eager": [], "groups": [], "polls": {}}
        async with open_sim_collaboration(
            SimNetwork(seed=5), 3, config=config, latency=0.01
        ) as cores:
            for i, core in enumerate(cores):
                plan = core.matchmaker.plan_group

                async def spy(*args, _plan=plan, _i=i, **kwargs):
                    if kwargs.get("level", 0) == 0:
                        out["eager"].append((_i, args[0], kwargs["deadlines"].eager))
                    return await _plan(*args, **kwargs)

                core.matchmaker.plan_group = spy

            async def train(i: int) -> None:
                epoch = 0
                while epoch < EPOCHS:
                    samples = 0
                    while True:
                        await trio.sleep(MICRO / (8.0 + 4 * i))
                        samples += MICRO
                        if cores[i].report(epoch, samples, MICRO, whole_steps=mid_step[i]):
                            break
                    grad = np.full(8, float(i + 1), np.float32)
                    outcome = await cores[i].average(epoch, [grad], samples)
                    out["groups"].append((epoch, outcome.group_size, outcome.complete))
                    epoch = outcome.epoch

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(train, i)
            ids = [str(c.node.peer_id) for c in cores]
            out["polls"] = {j: cores[0].tracker.records[ids[j]].poll for j in (1, 2)}
        return out

    out = run_sim(main, seed=5)
    assert out["groups"] and all(g == 3 and c for _, g, c in out["groups"]), out["groups"]
    assert out["polls"] == {1: config.rounds.poll, 2: None if mixed else config.rounds.poll}
    later = [eager for _, epoch, eager in out["eager"] if epoch >= 1]  # (records read by then)
    assert len(later) >= 3 * (EPOCHS - 1)
    assert all(later) if not mixed else not any(later), out["eager"]


def test_a_progress_record_announces_a_bounded_poll() -> None:
    """The poll is an untrusted claim: every DHT node's validator and every reader bound it."""
    record = PeerProgress("p", 3, 8, 1.0, 0.0, poll=0.25).to_record()
    assert record["poll"] == 0.25 and PROGRESS.check(record, "r") is None
    assert PeerProgress.from_record("p", record).poll == 0.25
    assert "poll" not in PeerProgress("p", 3, 8, 1.0, 0.0).to_record()
    for bad in (0.0, -1.0, 1e9, float("nan"), True, "0.25"):
        assert PROGRESS.check({**record, "poll": bad}, "r") is not None
        with pytest.raises(ValueError):
            PeerProgress.from_record("p", {**record, "poll": bad})
