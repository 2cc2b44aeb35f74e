"""Groups that formed apart come back to one lineage (issue 46, item 4, "in step").

A coordinator (an aux peer, the root every trainer joined through) and four trainers; the two
pairs cannot reach each other from the run's start, so each pair averages alone and vouches
only for itself. Before, after the network healed each pair counted only its own vouched
states in the fork choice (the other pair's signers trace to none of its mates): both won in
their own view, and the run trained two models for good. Now a peer also counts the peers its
roots trust, above its own mates' (:mod:`dedloc_jax.state.vouching`): every peer that joined
through the coordinator sees the same voters, one pair loses and loads the other's state, and
the four average in one group. Sybils minting vouches for each other on a forged lineage,
more of them than either pair, still never vote.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import numpy as np
import pytest
import trio

from dedloc_jax.progress import MAX_LINEAGE
from dedloc_jax.state.keeping import StepKeeper, keep_in_step_async
from dedloc_jax.state.serving import state_key
from dedloc_jax.state.vouching import sign_vouch
from dedloc_jax.tracker import progress_key
from p2p.dht import DHTClock, DHTConfig, open_dht
from p2p.dht.records import owner_marker
from p2p.errors import P2PError
from p2p.node import NodeConfig
from p2p.testing import SimNetwork, host_of, open_sim_nodes, run_sim, sim_identity
from tests.dedloc_jax.state.test_two_peers import LR, MICRO, SIZE, TRUE_W, _coordinator, _open_peer

COMPILE = 5.0  # virtual seconds before a trainer's first micro-step
APART = 25.0  # the pairs cannot reach each other until then
WATCH = 35.0  # then they can, for this long
MERGED = 20.0  # every step this long after the heal is one of a group of 4
SYBILS = 3  # more than either pair


def _fake(epoch: int) -> bytes:
    return bytes([0xEE]) * 24 + epoch.to_bytes(8, "big")


async def _sybils(net: SimNetwork, bootstrap: Any, ahead_of: Any) -> None:
    """SYBILS fresh identities, joined through the coordinator, announce a made-up state one
    epoch ahead of the run, on one made-up lineage, each carrying the others' vouches naming
    it (a signature costs nothing), in both records, until cancelled."""
    names = [f"sybil{k}" for k in range(SYBILS)]
    async with (
        open_sim_nodes(net, SYBILS, config=NodeConfig.testing(), names=names) as nodes,
        AsyncExitStack() as stack,
    ):
        dhts = [
            await stack.enter_async_context(
                open_dht(
                    node,
                    initial_peers=[str(bootstrap.addrs[0])],
                    config=DHTConfig.fast(),
                    clock=DHTClock(trio.current_time),
                )
            )
            for node in nodes
        ]
        mates = [str(n.peer_id) for n in nodes]
        while True:
            epoch = ahead_of() + 1
            lineage = [_fake(epoch - k) for k in range(1, MAX_LINEAGE + 1)]
            minted = [sign_vouch(n.identity, "run", epoch, _fake(epoch), mates) for n in nodes]
            for dht in dhts:
                vouches = [v.to_wire() for v in minted if str(dht.peer_id) in v.mates]
                state = {
                    "epoch": epoch,
                    "digest": _fake(epoch),
                    "lineage": lineage,
                    "addrs": [],
                    "vouches": vouches,
                }
                progress = {
                    "epoch": epoch,
                    "samples": 0,
                    "sps": 16.0,
                    "time": dht.now(),
                    "mode": "node",
                    "state": [epoch, _fake(epoch), lineage],
                }
                for key, value in ((state_key("run"), state), (progress_key("run"), progress)):
                    try:
                        await dht.store(
                            key, value, dht.now() + 30.0, subkey=owner_marker(dht.peer_id)
                        )
                    except P2PError:
                        pass
            await trio.sleep(0.5)


def _run(root_side: bool, sybils: bool, seed: int = 0) -> dict:
    """The run above; ``root_side``: the coordinator is cut off from the second pair too (it
    then trusts only the first pair's signers), else it reaches both pairs."""
    steps: list[tuple[float, int, int, int]] = []  # (time, trainer, epoch, group size)
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
            cnode, ccore = await _open_peer(net, sim_identity(net, 100), [], "aux", stack)
            initial = [str(cnode.addrs[0])]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_coordinator, ccore)
                for i in range(4):
                    nursery.start_soon(trainer, net, i, initial, cores)
                while any(c is None for c in cores):
                    await trio.sleep(0.1)
                hosts = [host_of(net, c.node) for c in cores]
                first = [*hosts[:2], host_of(net, cnode)] if root_side else hosts[:2]
                net.partition(first, hosts[2:])  # (before anyone's first micro-step)
                await trio.sleep(APART)
                out["apart"] = {i: finals.get(i) for i in range(4)}
                net.heal()
                out["healed_at"] = trio.current_time()
                if sybils:
                    nursery.start_soon(_sybils, net, cnode, lambda: max(c.epoch for c in cores))
                await trio.sleep(WATCH)
                out["verdicts"] = [c.fork_verdict() for c in cores]
                out["chosen"] = [c.tracker.chosen_epoch for c in cores]
                out["digests"] = [c.state_server.latest.digest for c in cores]
                out["sybils_seen"] = sum(
                    a.digest[:24] == bytes([0xEE]) * 24
                    for c in cores
                    for a in c.tracker.announcements()
                )
                nursery.cancel_scope.cancel()

    run_sim(main, seed=seed)
    return out


@pytest.mark.parametrize(
    "root_side,sybils",
    [
        # (about 12 s of CPU each: the simplest case runs with the slow tests)
        pytest.param(False, False, id="root-reaches-both", marks=pytest.mark.slow),
        pytest.param(True, False, id="root-on-one-side"),
        pytest.param(False, True, id="sybil-clique"),
    ],
)
def test_pairs_that_averaged_apart_from_the_start_merge_after_the_heal(
    root_side: bool, sybils: bool
) -> None:
    out = _run(root_side, sybils)
    steps, finals, healed = out["steps"], out["finals"], out["healed_at"]
    apart = [(i, e, size) for t, i, e, size in steps if t < healed]
    after = [(t - healed, i, e, size) for t, i, e, size in steps if t >= healed]
    print("apart:", sorted({(i, size) for i, _, size in apart}))
    print("after (s since heal, trainer, epoch, group):", [(round(t, 1), *r) for t, *r in after])
    # The pairs did average apart, and trained different models.
    assert apart and all(size <= 2 for _, _, size in apart)
    assert {i for i, _, size in apart if size == 2} == {0, 1, 2, 3}
    held = out["apart"]
    assert held[0] is not None and held[2] is not None and held[0][1] != held[2][1]
    # Within MERGED virtual seconds (about 17 epochs) the four average in one group again,
    # and stay there; they end on one state.
    late = [r for r in after if r[0] >= MERGED]
    assert {i for _, i, _, _ in late} == {0, 1, 2, 3}
    assert all(size == 4 for *_, size in late), [r for r in late if r[3] != 4]
    epochs = sorted(epoch for epoch, _ in finals.values())
    assert len(finals) == 4 and epochs[-1] - epochs[0] <= 1, epochs
    for e in set(epochs):
        assert len({p for epoch, p in finals.values() if epoch == e}) == 1, e
    # Sybils (announced in every table) never won a fork choice nor led anyone to their state.
    assert out["sybils_seen"] >= (4 * SYBILS if sybils else 0)
    assert not any(d[:24] == bytes([0xEE]) * 24 for d in out["digests"])
    assert all(c is None or c <= epochs[-1] for c in out["chosen"]), out["chosen"]
    assert not any(out["verdicts"]), out["verdicts"]
