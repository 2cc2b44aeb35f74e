"""Matchmaking ahead of the target (rounds/early.py), four simulated peers over the real stack
in virtual time: the group forms while the peers compute, and each round averages at once
when the target is reached, with every member's mean bit-identical."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

from dedloc_jax.config import CollaborationConfig, ProgressConfig
from p2p.testing import SimNetwork, run_sim
from tests.dedloc_jax.simcollab import open_sim_collaboration

PEERS, MICRO, TARGET, EPOCHS = 4, 4, 320, 3
CONFIG = CollaborationConfig(
    target_batch_size=TARGET, progress=ProgressConfig(min_refresh=0.1, max_refresh=0.5)
)
CONFIG = CONFIG.replace(rounds=CONFIG.rounds.replace(match_early=True))


def _run(config: CollaborationConfig) -> dict[str, Any]:
    """``EPOCHS`` blocking rounds of four peers at unequal paces: per (peer, epoch), when its
    report first said ready, when its matchmaking began and found the group, when its
    all-reduce began, and what it got back."""
    seen: dict[str, Any] = {"ready": {}, "match": {}, "planned": {}, "reduce": {}, "out": {}}

    async def main() -> None:
        net = SimNetwork(seed=3)
        async with open_sim_collaboration(net, PEERS, config=config, latency=0.01) as cores:
            for i, core in enumerate(cores):
                _watch(i, core, seen)

            async def peer(i: int) -> None:
                for epoch in range(EPOCHS):
                    samples = 0
                    while True:
                        await trio.sleep(0.2 + 0.05 * i)
                        samples += MICRO
                        if cores[i].report(epoch, samples, MICRO):
                            break
                    seen["ready"][i, epoch] = trio.current_time()
                    grad = np.full(8, float(i + 1), np.float32)
                    out = await cores[i].average(epoch, [grad], samples)
                    seen["out"][i, epoch] = (samples, out)

            async with trio.open_nursery() as nursery:
                for i in range(PEERS):
                    nursery.start_soon(peer, i)

    run_sim(main, seed=0, timeout=600.0)
    return seen


def _watch(i: int, core: Any, seen: dict[str, Any]) -> None:
    """Record when peer ``i`` begins matchmaking, has planned its group and begins its
    all-reduce."""
    matchmaker, rounds = core.matchmaker, core.rounds
    form_group, all_reduce = matchmaker.form_group, rounds.all_reduce
    plan_group = getattr(matchmaker, "plan_group", None)  # (before: form_group did it all)

    async def watched_form_group(epoch: int, *args: Any, **kwargs: Any) -> Any:
        seen["match"].setdefault((i, epoch), trio.current_time())
        spec = await form_group(epoch, *args, **kwargs)
        seen["planned"].setdefault((i, epoch), trio.current_time())
        return spec

    async def watched_plan_group(epoch: int, *args: Any, **kwargs: Any) -> Any:
        seen["match"].setdefault((i, epoch), trio.current_time())
        planned = await plan_group(epoch, *args, **kwargs)
        seen["planned"][i, epoch] = trio.current_time()
        return planned

    async def watched_all_reduce(spec: Any, *args: Any, **kwargs: Any) -> Any:
        epoch = next(e for (p, e) in seen["match"] if p == i and (p, e) not in seen["reduce"])
        seen["reduce"][i, epoch] = trio.current_time()
        return await all_reduce(spec, *args, **kwargs)

    matchmaker.form_group = watched_form_group
    if plan_group is not None:
        matchmaker.plan_group = watched_plan_group
    object.__setattr__(rounds, "all_reduce", watched_all_reduce)


def test_the_group_forms_before_the_target_and_the_round_averages_at_it() -> None:
    """Before: each peer began matchmaking only after its report said ready and averaged a
    window or more later. Now registering and planning the group end before the target; the
    joins wait for it, so the spec weighs the samples each member holds and the all-reduce
    begins as soon as the last member reached the target, never before."""
    seen = _run(CONFIG)
    for epoch in range(EPOCHS):
        outs = [seen["out"][i, epoch] for i in range(PEERS)]
        assert all(o.group_size == PEERS and o.complete for _, o in outs), [
            (o.group_size, o.complete, o.reason) for _, o in outs
        ]
        first = outs[0][1].gradients[0]
        assert all(np.asarray(o.gradients[0]).tobytes() == first.tobytes() for _, o in outs)
        samples = [s for s, _ in outs]
        assert sum(samples) >= TARGET  # averaged once the target was reached
        # the mean weighs each member's gradient (i + 1) by the samples it held at the step
        want = sum(s * (i + 1) for i, s in enumerate(samples)) / sum(samples)
        np.testing.assert_allclose(first, want, rtol=1e-3)
        last = max(seen["ready"][i, epoch] for i in range(PEERS))
        for i in range(PEERS):
            ready = seen["ready"][i, epoch]
            assert seen["match"][i, epoch] < ready, (i, epoch)  # began while computing
            assert seen["planned"][i, epoch] <= ready, (i, epoch)  # planned by the target
            assert ready <= seen["reduce"][i, epoch] <= last + 0.5, (i, epoch)


def test_with_match_early_off_matchmaking_begins_at_the_target() -> None:
    config = CONFIG.replace(rounds=CONFIG.rounds.replace(match_early=False))
    seen = _run(config)
    for epoch in range(EPOCHS):
        assert all(seen["out"][i, epoch][1].complete for i in range(PEERS))
        for i in range(PEERS):
            assert seen["match"][i, epoch] >= seen["ready"][i, epoch]
