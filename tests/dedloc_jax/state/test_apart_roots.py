"""Pairs that joined through different roots, each trusting only its own pair, and averaged
apart come back to one lineage (issue 46, item 4, "in step").

Two coordinators (aux peers), each a first peer (no initial peers of its own) and the root one
pair of trainers joined through; a third aux peer (a volunteer's dashboard, say) joined through
both, the one link between the two halves of the DHT. The halves, each a coordinator and its
pair, cannot reach each other nor the bridge from the run's start (before anyone trained), then
can. Each coordinator trusts on first use the signers it read first, its own pair. Before,
after the heal each pair counted only its own vouched states and won in its own view: the run
trained two models for good. Now the bridge introduced the two first peers to each other
before either trusted anyone (co-founders, :meth:`VouchBook.cofound`); each takes the other's
trust as its own, both pairs are endorsed in every view, and one loses and loads the other's
state. Sybils joined through a coordinator after that, minting vouches on a forged lineage, are
no co-founders' and never vote.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import numpy as np
import pytest
import trio

from dedloc_jax.state.keeping import StepKeeper, keep_in_step_async
from p2p.testing import SimNetwork, host_of, run_sim, sim_identity
from tests.dedloc_jax.state.test_apart import APART, COMPILE, MERGED, SYBILS, WATCH, _sybils
from tests.dedloc_jax.state.test_two_peers import LR, MICRO, SIZE, TRUE_W, _coordinator, _open_peer

FORGED = bytes([0xEE]) * 24  # (the Sybils' digests begin so: test_apart._fake)


def run_apart_roots(sybils: bool = False, seed: int = 0, watch: float = WATCH) -> dict:
    """The run above; ``sybils``: SYBILS fresh identities join through the first coordinator
    at the heal. Returns the steps (time, trainer, epoch, group size), when the network
    healed, each trainer's final (epoch, parameters), fork verdict and served digest."""
    steps: list[tuple[float, int, int, int]] = []
    finals: dict[int, tuple[int, bytes]] = {}
    out: dict = {"steps": steps, "finals": finals}

    async def trainer(net: SimNetwork, i: int, initial: list[str], cores: list) -> None:
        async with AsyncExitStack() as stack:
            _, core = await _open_peer(net, sim_identity(net, 200 + i), initial, "node", stack)
            cores[i] = core
            keeper, rng = StepKeeper(), np.random.default_rng(i)
            params, epoch, complete = np.zeros(SIZE, np.float32), 0, False
            (params,), epoch = await keep_in_step_async(core, keeper, [params], epoch, complete)
            await trio.sleep(COMPILE)
            acc, samples = np.zeros(SIZE, np.float32), 0
            while True:
                await trio.sleep(0.05)
                x = rng.normal(size=(MICRO, SIZE)).astype(np.float32)
                acc += 2 * x.T @ (x @ params - x @ TRUE_W)
                samples += MICRO
                if core.report(epoch, samples, MICRO):
                    out_ = await core.average(epoch, [acc / samples], samples)
                    params = params - np.float32(LR) * np.asarray(out_.average[0], np.float32)
                    steps.append((trio.current_time(), i, epoch, out_.group_size))
                    epoch, complete = out_.next_epoch, out_.complete and out_.group_size > 1
                    acc[:], samples = 0.0, 0
                loads = keeper.loads
                (params,), epoch = await keep_in_step_async(core, keeper, [params], epoch, complete)
                if keeper.loads != loads:
                    acc[:], samples = 0.0, 0
                finals[i] = (epoch, params.tobytes())

    async def main() -> None:
        net = SimNetwork(seed=seed)
        cores: list = [None] * 4
        async with AsyncExitStack() as stack:
            tops = [
                await _open_peer(net, sim_identity(net, 100 + k), [], "aux", stack)
                for k in range(2)
            ]
            addrs = [str(node.addrs[0]) for node, _ in tops]
            bridge, _ = await _open_peer(net, sim_identity(net, 110), addrs, "aux", stack)
            async with trio.open_nursery() as nursery:
                for _, top in tops:
                    nursery.start_soon(_coordinator, top)
                for i in range(4):
                    nursery.start_soon(trainer, net, i, [addrs[i // 2]], cores)
                while any(c is None for c in cores):
                    await trio.sleep(0.1)
                hosts = [host_of(net, c.node) for c in cores]
                sides = [
                    [*hosts[:2], host_of(net, tops[0][0])],
                    [*hosts[2:], host_of(net, tops[1][0])],
                ]
                net.partition(*sides)  # (before anyone's first micro-step)
                net.partition([host_of(net, bridge)], sides[0] + sides[1])
                await trio.sleep(APART)
                out["apart"] = {i: finals.get(i) for i in range(4)}
                net.heal()
                out["healed_at"] = trio.current_time()
                if sybils:
                    ahead = lambda: max(c.epoch for c in cores)  # noqa: E731
                    nursery.start_soon(_sybils, net, tops[0][0], ahead)
                await trio.sleep(watch)
                out["verdicts"] = [c.fork_verdict() for c in cores]
                out["chosen"] = [c.tracker.chosen_epoch for c in cores]
                out["digests"] = [c.state_server.latest.digest for c in cores]
                out["sybils_seen"] = sum(
                    a.digest[:24] == FORGED for c in cores for a in c.tracker.announcements()
                )
                nursery.cancel_scope.cancel()

    run_sim(main, seed=seed)
    return out


@pytest.mark.parametrize(
    "sybils",
    [
        pytest.param(False, id="bridged"),
        # (about 15 s of CPU each: the Sybils' variant runs with the slow tests)
        pytest.param(True, id="bridged-sybils", marks=pytest.mark.slow),
    ],
)
def test_pairs_joined_through_different_roots_merge_after_the_heal(sybils: bool) -> None:
    out = run_apart_roots(sybils)
    steps, finals, healed = out["steps"], out["finals"], out["healed_at"]
    apart = [(i, e, size) for t, i, e, size in steps if t < healed]
    after = [(t - healed, i, e, size) for t, i, e, size in steps if t >= healed]
    print("apart:", sorted({(i, size) for i, _, size in apart}))
    print("after (s since heal, trainer, epoch, group):", [(round(t, 1), *r) for t, *r in after])
    # The pairs averaged apart and trained different models.
    assert {i for i, _, size in apart if size == 2} == {0, 1, 2, 3}
    assert all(size <= 2 for _, _, size in apart)
    held = out["apart"]
    assert held[0] is not None and held[2] is not None and held[0][1] != held[2][1]
    # Within MERGED virtual seconds of the heal the four average in one group, and stay
    # there; they end on one state.
    late = [r for r in after if r[0] >= MERGED]
    assert {i for _, i, _, _ in late} == {0, 1, 2, 3}
    assert all(size == 4 for *_, size in late), [r for r in late if r[3] != 4]
    epochs = sorted(epoch for epoch, _ in finals.values())
    assert len(finals) == 4 and epochs[-1] - epochs[0] <= 1, epochs
    for e in set(epochs):
        assert len({p for epoch, p in finals.values() if epoch == e}) == 1, e
    assert not any(out["verdicts"]), out["verdicts"]
    # Sybils (announced in every table) never won a fork choice nor led anyone to their state.
    assert out["sybils_seen"] >= (4 * SYBILS if sybils else 0)
    assert not any(d[:24] == FORGED for d in out["digests"])
    assert all(c is None or c <= epochs[-1] for c in out["chosen"]), out["chosen"]
