"""keep_in_step's policy (StepKeeper), and peers that keep in step with it in the simulator.

The policy is tested request by request; the simulated peers train a small linear model with
nothing but ``core.report``, ``core.average`` and :func:`keep_in_step_async` in their loop.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from dedloc_jax.config import CollaborationConfig
from dedloc_jax.keeping import (
    FAILED,
    STALE,
    ForkLost,
    KeepConfig,
    Load,
    NewerServed,
    Observation,
    Serve,
    Sleep,
    StepKeeper,
    keep_in_step_async,
)
from p2p.testing import SimNetwork, host_of
from tests.dedloc_jax.simcollab import open_sim_collaboration


def _requests(keeper: StepKeeper, obs: Observation, answers: list) -> list:
    """The requests of one plan, answering them in order with ``answers``."""
    plan = keeper.plan(obs)
    seen = []
    try:
        request = next(plan)
        while True:
            seen.append(request)
            request = plan.send(answers.pop(0) if answers else None)
    except StopIteration:
        return seen


def _obs(now=0.0, epoch=0, complete=True, others=True, newest=None, behind=False):
    return Observation(now, epoch, complete, others, newest, behind)


def test_a_newcomer_loads_a_newer_state_and_a_first_peer_serves_its_own() -> None:
    newcomer = StepKeeper()
    assert _requests(newcomer, _obs(newest=7), [7]) == [Load(None)]
    assert newcomer.epoch == 7 and newcomer.loads == 1
    first = StepKeeper()
    assert _requests(first, _obs(newest=None), []) == [Serve()]
    same = StepKeeper()  # others at our epoch: nothing to load (it would drop our gradients)
    assert _requests(same, _obs(newest=0), []) == [Serve()]
    failed = StepKeeper()  # nobody could serve it: ours, served
    assert _requests(failed, _obs(newest=3), [FAILED]) == [Load(None), Serve()]


def test_after_a_step_it_serves_and_after_a_lone_step_it_loads_the_others() -> None:
    keeper = StepKeeper()
    _requests(keeper, _obs(now=0.0), [])
    # a step with everyone, 1 s into the epoch: the fork check comes first (none was made)
    assert _requests(keeper, _obs(now=1.0, epoch=1), [False]) == [ForkLost(), Serve()]
    # a step alone while others train: wait for their states, load theirs (not older)
    lone = _requests(keeper, _obs(now=2.0, epoch=2, complete=False), [False, None, 2])
    assert lone == [ForkLost(), Sleep(KeepConfig().settle), Load(2)]
    assert keeper.loads == 1
    # theirs is older: keep ours, and serve it
    lone = _requests(keeper, _obs(now=3.0, epoch=3, complete=False), [False, None, STALE])
    assert lone == [ForkLost(), Sleep(KeepConfig().settle), Load(3), Serve()]
    # alone in a run of one: nothing to load
    alone = _requests(keeper, _obs(now=4.0, epoch=4, complete=False, others=False), [False])
    assert alone == [ForkLost(), Serve()]


def test_the_fork_check_repeats_until_the_epoch_ends() -> None:
    """After a healed partition the side that lost may answer "not lost" at first (its table
    still holds only its own side): the check is asked again every fork_recheck seconds."""
    config = KeepConfig()
    keeper = StepKeeper(config)
    _requests(keeper, _obs(now=0.0, epoch=2), [])
    first = config.fork_check_after + 0.1
    assert not keeper.due(config.fork_check_after / 2, 2, behind=False)
    assert _requests(keeper, _obs(now=first, epoch=2), [False]) == [ForkLost()]
    assert not keeper.due(first + config.fork_recheck / 2, 2, behind=False)
    assert keeper.due(first + config.fork_recheck + 0.1, 2, behind=False)


def test_a_lost_fork_check_loads_with_retries_and_behind_looks_for_a_newer_state() -> None:
    config = KeepConfig()
    keeper = StepKeeper(config)
    _requests(keeper, _obs(now=0.0, epoch=5), [])
    assert not keeper.due(1.0, 5, behind=False)  # nothing due: the cheap path
    assert keeper.due(config.fork_check_after + 0.1, 5, behind=False)
    got = _requests(
        keeper,
        _obs(now=config.fork_check_after + 0.1, epoch=5),
        [True, FAILED, None, FAILED, None, FAILED],
    )
    retries = [Sleep(config.retry), Load(5)] * (config.lost_loads - 1)
    assert got == [ForkLost(), Load(5), *retries, Serve()]
    assert not keeper.due(config.fork_check_after + 1.0, 5, behind=False)
    # behind: at most once per behind_recheck, and only when a newer state is served
    now = config.fork_check_after + 2.0
    assert _requests(keeper, _obs(now=now, epoch=5, behind=True), [False]) == [NewerServed(5)]
    assert not keeper.due(now + 0.5, 5, behind=True)
    later = _requests(keeper, _obs(now=now + 1.5, epoch=5, behind=True), [True, 9])
    assert later == [NewerServed(5), Load(None)] and keeper.epoch == 9


# --- peers in the simulator ---------------------------------------------------------------
MICRO, LR, SIZE = 4, 0.05, 8
TRUE_W = np.linspace(-1.0, 1.0, SIZE, dtype=np.float32)


async def _train(
    core, keeper: StepKeeper, seed: int, epochs: int, pace: float, start: float = 0.0
) -> np.ndarray:
    """A peer's loop: gradients of a linear model, core.report/average, keep_in_step; it
    begins ``start`` seconds after the call (its first micro-step: compiling, say)."""
    await trio.sleep(start)
    rng = np.random.default_rng(seed)
    params = np.zeros(SIZE, np.float32)
    epoch, complete = 0, False
    (params,), epoch = await keep_in_step_async(core, keeper, [params], epoch, complete)
    acc, samples = np.zeros(SIZE, np.float32), 0
    while epoch < epochs:
        await trio.sleep(pace)
        x = rng.normal(size=(MICRO, SIZE)).astype(np.float32)
        grad = 2 * x.T @ (x @ params - x @ TRUE_W) / MICRO
        acc += grad * MICRO
        samples += MICRO
        if core.report(epoch, samples, MICRO):
            out = await core.average(epoch, [acc / samples], samples)
            params = params - np.float32(LR) * np.asarray(out.gradients[0], np.float32)
            epoch, complete = out.epoch, out.complete and out.group_size > 1
            acc[:], samples = 0.0, 0
        loads = keeper.loads
        (params,), epoch = await keep_in_step_async(core, keeper, [params], epoch, complete)
        if keeper.loads != loads:  # loaded the run's state: our gradients are of another
            acc[:], samples = 0.0, 0
    return params


def test_twenty_two_peer_runs_with_short_targets_all_average() -> None:
    """Peer 0 opens first and reads a table without peer 1; peer 1 starts training up to
    0.4 s later. With a target of 32 samples and 1 ms micro-steps neither may step alone:
    every step of every run averages both."""
    config = CollaborationConfig(target_batch_size=32)
    lone = []

    async def one_run(seed: int) -> None:
        net = SimNetwork(seed=seed)
        async with open_sim_collaboration(net, 2, config=config, latency=0.005) as cores:
            keepers = [StepKeeper(), StepKeeper()]
            async with trio.open_nursery() as nursery:
                for i, core in enumerate(cores):
                    start = 0.02 * seed * i
                    nursery.start_soon(_train, core, keepers[i], 10 * seed + i, 4, 0.001, start)
            for core in cores:
                lone.extend(
                    (seed, h["epoch"], h["reason"])
                    for h in core.history
                    if h["group_size"] != 2 or not h["complete"]
                )

    async def main() -> None:
        for seed in range(20):
            await one_run(seed)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert lone == []


@pytest.mark.parametrize("seed", [0])
def test_a_healed_partition_of_two_epochs_ends_on_one_lineage(seed: int) -> None:
    """Peers {0, 1, 2} and {3, 4} train apart for two epochs, then the network heals: with
    keep_in_step alone in their loop, every peer ends on one set of parameters."""
    config = CollaborationConfig(target_batch_size=64)
    epochs = 12

    async def main() -> tuple[list, list]:
        net = SimNetwork(seed=seed)
        async with open_sim_collaboration(net, 5, config=config, latency=0.01) as cores:
            keepers = [StepKeeper() for _ in cores]
            finals: list = [None] * len(cores)
            hosts = [host_of(net, core.node) for core in cores]

            async def peer(i: int) -> None:
                finals[i] = await _train(cores[i], keepers[i], i, epochs, 0.05)
                await trio.sleep(30.0)  # keep serving the final state for the others

            async def partition() -> None:
                while min(c.epoch for c in cores) < 2:
                    await trio.sleep(0.1)
                net.partition(hosts[:3], hosts[3:])
                start = cores[0].epoch
                while cores[0].epoch < start + 2 or cores[3].epoch < start + 2:
                    await trio.sleep(0.1)
                net.heal()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(partition)
                for i in range(len(cores)):
                    nursery.start_soon(peer, i)
            return finals, [core.epoch for core in cores]

    finals, ended = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert ended == [epochs] * 5
    for w in finals[1:]:
        np.testing.assert_array_equal(w, finals[0])
