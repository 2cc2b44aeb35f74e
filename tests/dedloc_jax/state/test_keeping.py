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
from dedloc_jax.state.keeping import (
    FAILED,
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


def test_requests_of_different_kinds_never_compare_equal() -> None:
    assert Serve() != ForkLost() and Load(5) != NewerServed(5) and Load(1) != Sleep(1)
    assert [Serve(), ForkLost()] != [ForkLost(), Serve()]


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
    assert failed.load_failures == 1 and failed.loads == 0 and failed.epoch == 0


def test_a_newcomer_asks_the_downloads_choice_of_a_state_ahead_that_no_record_backs() -> None:
    """Only a coordinator's copy is left once every trainer left: the table backs no epoch
    of it (an aux peer claims no samples), and newcomers served their own epoch 0 for good.
    The first call asks the download's choice (defended by our roots' trust) instead."""

    def obs(announced: int | None) -> Observation:
        return Observation(0.0, 0, True, False, None, False, announced)

    resumed = StepKeeper()
    assert _requests(resumed, obs(60), [True, 60]) == [NewerServed(0, strict=True), Load(None)]
    assert resumed.epoch == 60 and resumed.loads == 1
    refused = StepKeeper()  # the choice names nothing newer (a stranger's made-up state)
    assert _requests(refused, obs(60), [False]) == [NewerServed(0, strict=True), Serve()]
    assert refused.epoch == 0
    first = StepKeeper()  # nothing announced: nothing asked
    assert _requests(first, obs(None), []) == [Serve()]


def test_a_history_less_peer_asks_again_until_it_loads_steps_or_fails_a_few_downloads() -> None:
    """Its first call saw no state ahead (a progress read that failed, the coordinator's record
    not read yet) and served its own epoch-0 state: it asked once and never again, and with no
    trainer around nothing else looked. It asks the download's choice again each
    ``fresh_recheck`` while a state ahead is announced, until it loaded or stepped, or
    ``lost_loads`` downloads failed (a stranger's made-up states)."""
    config = KeepConfig(fork_check_after=1e9)  # (no fork check in the way)
    wait = config.fresh_recheck + 0.5

    def obs(now: float, announced: int | None, epoch: int = 0) -> Observation:
        return Observation(now, epoch, True, False, None, False, announced)

    late = StepKeeper(config)
    assert _requests(late, obs(0.0, None), []) == [Serve()]
    assert not late.due(1.0, 0, False)  # paced
    assert _requests(late, obs(1.0, 6), []) == []
    assert late.due(wait, 0, False)
    assert _requests(late, obs(wait, 6), [True, 6]) == [NewerServed(0, strict=True), Load(None)]
    assert late.epoch == 6 and late.loads == 1
    assert _requests(late, obs(3 * wait, 9, epoch=6), []) == []  # loaded: done
    refused = StepKeeper(config)  # the choice names nothing newer: asked again later
    _requests(refused, obs(0.0, None), [])
    assert _requests(refused, obs(wait, 6), [False]) == [NewerServed(0, strict=True)]
    assert _requests(refused, obs(2 * wait, 6), [False]) == [NewerServed(0, strict=True)]
    stepped = StepKeeper(config)  # its own step: its own lineage from then on
    _requests(stepped, obs(0.0, None), [])
    assert _requests(stepped, obs(wait, 6, epoch=1), [None, False]) == [Serve(), ForkLost()]
    assert _requests(stepped, obs(3 * wait, 6, epoch=1), []) == []
    hostile = StepKeeper(config)  # downloads that fail: lost_loads of them, then no more
    _requests(hostile, obs(0.0, None), [])
    for k in range(1, config.lost_loads + 1):
        got = _requests(hostile, obs(k * wait, 6), [True, FAILED])
        assert got == [NewerServed(0, strict=True), Load(None)]
    assert _requests(hostile, obs(10 * wait, 6), []) == []
    assert hostile.epoch == 0 and hostile.load_failures == config.lost_loads


def test_after_a_step_it_serves_then_checks_an_epoch_too_short_to_have_been_checked() -> None:
    config = KeepConfig()
    keeper = StepKeeper(config)
    _requests(keeper, _obs(now=0.0), [])
    # 1 s into the epoch, before its check was due: the new state is served, then checked
    assert _requests(keeper, _obs(now=1.0, epoch=1), [None, False]) == [Serve(), ForkLost()]
    assert keeper.checked
    # checked during the epoch: a step only serves
    now = 1.0 + config.fork_check_after + 0.1
    assert _requests(keeper, _obs(now=now, epoch=1), [False]) == [ForkLost()]
    assert _requests(keeper, _obs(now=now + 1.0, epoch=2), []) == [Serve()]
    assert not keeper.checked and keeper.loads == 0


def test_a_lone_step_is_one_warning_the_rounds_not_the_keepers_too(caplog) -> None:
    """A mate killed -9: its record lives on (60-90 s), and each epoch the round warns that it
    stepped without the whole collaboration, naming why. The keeper repeated it, a second
    WARNING per epoch (32 in 30 s of a README volunteer run); what it does next is INFO."""
    import logging

    keeper = StepKeeper()
    _requests(keeper, _obs(now=0.0), [])
    with caplog.at_level(logging.INFO, logger="dedloc_jax.state.keeping"):
        _requests(keeper, _obs(now=2.0, epoch=1, complete=False), [None, None])
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [(logging.INFO, "epoch 1: stepped without the whole collaboration; "
                                   "checking our lineage")]  # fmt: skip


def test_lone_steps_in_a_row_say_checking_our_lineage_once(caplog) -> None:
    """After a mate's kill -9 the peer steps alone every epoch until the mate's record lapses:
    the keeper said "checking our lineage" at INFO at each (12 lines in one README run, next
    to the round's one WARNING). Now at INFO for the first of a run of such steps, DEBUG for
    the next, INFO again after a whole step; each still checks."""
    import logging

    keeper = StepKeeper()
    _requests(keeper, _obs(now=0.0), [])
    with caplog.at_level(logging.DEBUG, logger="dedloc_jax.state.keeping"):
        for epoch in (1, 2, 3):
            _requests(keeper, _obs(now=2.0 * epoch, epoch=epoch, complete=False), [None, None])
        _requests(keeper, _obs(now=8.0, epoch=4), [None, None])
        _requests(keeper, _obs(now=10.0, epoch=5, complete=False), [None, None])
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "lineage" in r.getMessage()]
    line = "stepped without the whole collaboration; checking our lineage"
    assert said == [
        (logging.INFO, f"epoch 1: {line}"),
        (logging.DEBUG, f"epoch 2: {line}"),
        (logging.DEBUG, f"epoch 3: {line}"),
        (logging.INFO, f"epoch 5: {line}"),
    ], said


def test_after_a_lone_step_it_waits_for_a_verdict_without_blocking_then_loads() -> None:
    """A step without the whole collaboration while others train: serve ours, and ask the
    fork check at once and every fork_poll seconds while it cannot tell (the others still
    average), never sleeping; when it still cannot tell after fork_patience, load all the
    same (this peer is the likely odd one out)."""
    config = KeepConfig()
    keeper = StepKeeper(config)
    _requests(keeper, _obs(now=0.0), [])
    checked = _requests(keeper, _obs(now=0.5, epoch=1), [None, False])  # with everyone
    lone = _requests(keeper, _obs(now=2.0, epoch=2, complete=False), [None, None])
    assert checked == [Serve(), ForkLost()] and lone == [Serve(), ForkLost()]
    assert not keeper.checked
    assert not keeper.due(2.0 + config.fork_poll / 2, 2, behind=False)
    now = 2.0 + config.fork_poll
    assert keeper.due(now, 2, behind=False)
    assert _requests(keeper, _obs(now=now, epoch=2), [None]) == [ForkLost()]
    end = 2.0 + config.fork_patience
    assert _requests(keeper, _obs(now=end, epoch=2), [None, 3]) == [ForkLost(), Load(None)]
    assert keeper.epoch == 3 and keeper.loads == keeper.forks == 1
    # alone in a run of one: served, nothing to check until its time
    solo = StepKeeper(config)
    _requests(solo, _obs(now=0.0, others=False), [])
    _requests(solo, _obs(now=0.5, epoch=1, others=False), [None, False])
    alone = _requests(solo, _obs(now=1.0, epoch=2, complete=False, others=False), [])
    assert alone == [Serve()] and not solo.due(1.5, 2, behind=False)


def test_a_lone_step_that_won_keeps_its_state_and_an_undecided_check_counts_as_not_lost() -> None:
    config = KeepConfig()
    keeper = StepKeeper(config)
    _requests(keeper, _obs(now=0.0), [])
    _requests(keeper, _obs(now=0.5, epoch=1), [None, False])
    lone = _requests(keeper, _obs(now=1.0, epoch=2, complete=False), [None, None])
    assert lone == [Serve(), ForkLost()]
    assert _requests(keeper, _obs(now=2.0, epoch=2), [False]) == [ForkLost()]  # ours won
    assert keeper.checked and keeper.loads == 0
    # asked again fork_check_after into the epoch (the others' states have landed by then)
    assert not keeper.due(1.0 + config.fork_check_after - 0.1, 2, behind=False)
    assert keeper.due(1.0 + config.fork_check_after, 2, behind=False)
    # an ordinary epoch whose check never could tell: "not lost" once patience ran out
    _requests(keeper, _obs(now=10.0, epoch=3), [None, None])
    late = _obs(now=10.0 + config.fork_patience, epoch=3)
    assert _requests(keeper, late, [None]) == [ForkLost()]
    assert keeper.checked and keeper.epoch == 3 and keeper.loads == 0


def test_a_peer_held_after_a_lone_step_waits_for_the_verdict_within_fork_hold() -> None:
    """With fork_hold, a call after a step without the whole collaboration polls the check
    (sleeping fork_poll between asks) until it tells, and loads the winner's state before
    the loop trains on; past fork_hold into the epoch it stops waiting (and asks again at
    later calls, as without it)."""
    config = KeepConfig(fork_hold=3.0)
    keeper = StepKeeper(config)
    _requests(keeper, _obs(now=0.0), [])
    _requests(keeper, _obs(now=0.5, epoch=1), [None, False])
    got = _requests(keeper, _obs(now=2.0, epoch=2, complete=False), [None, None, 3.0, True, 2])
    assert got == [Serve(), ForkLost(), Sleep(config.fork_poll), ForkLost(), Load(None)]
    assert keeper.loads == keeper.forks == 1 and keeper.epoch == 2
    # with everyone: no waiting
    assert _requests(keeper, _obs(now=9.0, epoch=3), [None, None]) == [Serve(), ForkLost()]
    undecided = _requests(
        keeper, _obs(now=10.0, epoch=4, complete=False), [None, None, 11.0, None, 13.0, None]
    )
    poll = Sleep(config.fork_poll)
    assert undecided == [Serve(), ForkLost(), poll, ForkLost(), poll, ForkLost()]
    assert not keeper.checked and keeper.due(13.0 + config.fork_poll, 4, behind=False)


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
    lost = _requests(keeper, _obs(now=first + config.fork_recheck + 0.1, epoch=2), [True, 2])
    assert lost == [ForkLost(), Load(None)] and keeper.forks == 1


def test_a_lost_fork_check_loads_with_retries_and_behind_looks_for_a_newer_state() -> None:
    config = KeepConfig()
    keeper = StepKeeper(config)
    _requests(keeper, _obs(now=0.0, epoch=5), [])
    assert not keeper.due(1.0, 5, behind=False)  # nothing due: the cheap path
    assert keeper.due(config.fork_check_after + 0.1, 5, behind=False)
    t = config.fork_check_after + 0.1
    got = _requests(keeper, _obs(now=t, epoch=5), [True, FAILED, t + 1, FAILED, t + 2, FAILED])
    retries = [Sleep(config.retry), Load(None)] * (config.lost_loads - 1)
    assert got == [ForkLost(), Load(None), *retries]
    assert keeper.load_failures == config.lost_loads and keeper.loads == 0
    assert not keeper.due(config.fork_check_after + 1.0, 5, behind=False)
    # behind: at most once per behind_recheck, and only when a newer state is served
    now = config.fork_check_after + 2.0
    assert _requests(keeper, _obs(now=now, epoch=5, behind=True), [False]) == [NewerServed(5)]
    assert not keeper.due(now + 0.5, 5, behind=True)
    later = _requests(keeper, _obs(now=now + 1.5, epoch=5, behind=True), [True, 9])
    assert later == [NewerServed(5), Load(None)] and keeper.epoch == 9
    assert keeper.resyncs == 1 and keeper.forks == 0


def test_a_lost_fork_check_loads_the_winners_state_even_when_it_is_older() -> None:
    """Our lineage lost to one whose newest state is older than ours (the winner was slower,
    or restarted, while we stepped alone): we load it, whatever its epoch. Refusing it (as a
    load with min_epoch did) left the winner, which never loads a lineage it beat, and us
    stepping alone for as long as we stayed ahead (issue 45: 17 epochs to 2 minutes)."""
    config = KeepConfig()
    keeper = StepKeeper(config)
    _requests(keeper, _obs(now=0.0, epoch=9), [])
    t = config.fork_check_after + 0.1
    assert _requests(keeper, _obs(now=t, epoch=9), [True, 5]) == [ForkLost(), Load(None)]
    assert keeper.epoch == 5 and keeper.loads == keeper.forks == 1


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
                    (seed, h.epoch, h.reason)
                    for h in core.history
                    if h.group_size != 2 or not h.complete
                )

    async def main() -> None:
        for seed in range(20):
            await one_run(seed)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert lone == []


@pytest.mark.parametrize("seed", [0, 2])
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


def test_a_loaded_state_is_served_at_once_under_its_donors_digest() -> None:
    """Peers 0 and 1 serve one state of epoch 3, peer 2 another: peer 2's lineage lost.
    Once it loaded theirs, it serves theirs (its table record names it, and its own fork
    check asks of it): a peer that went on serving the lost state until its next step found
    it lost at every check, and loaded again each time."""
    config = CollaborationConfig(target_batch_size=64)

    async def main() -> None:
        net = SimNetwork(seed=3)
        async with open_sim_collaboration(net, 3, config=config, latency=0.01) as cores:
            ours = np.arange(SIZE, dtype=np.float32)
            for i, core in enumerate(cores):
                await core.share_state([ours if i < 2 else -ours], 3)
            await trio.sleep(5 * config.progress.max_refresh)  # every table names every state
            winner = cores[0].state_server.latest
            assert cores[2].fork_verdict() is True
            epoch, arrays = await cores[2].load_state(timeout=30.0, min_epoch=3)
            assert epoch == 3 and arrays[0].tobytes() == ours.tobytes()
            served = cores[2].state_server.latest
            assert winner is not None and served is not None
            assert served.digest == winner.digest
            assert cores[2].tracker.served is not None
            assert cores[2].tracker.served[:2] == (3, winner.digest)
            assert cores[2].fork_verdict() is False
            held = cores[2].state_server.held(winner.digest)  # what it hands on when asked
            assert held is not None and held[1][0].tobytes() == ours.tobytes()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
