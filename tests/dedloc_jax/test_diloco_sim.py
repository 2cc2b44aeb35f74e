"""``diloco`` peers in the simulator: faults, a newcomer and a partition end on one lineage.

Each simulated peer runs the library's :func:`dedloc_jax.diloco.diloco` transform (eagerly)
on a small linear model, over a :class:`~dedloc_jax.peer.CollaborationPeer`, and keeps
in step with :func:`dedloc_jax.state.keeping.keep_in_step_async` after every micro-step, serving and
loading its state with the library's own flattening (``share_state``/``sync_state``). After
each scenario every live peer must hold one lineage: bit-identical outer parameters, outer
optimizer state and epoch.

The transform calls its host synchronously, and a trio task cannot block on the averaging:
:class:`SimHost` answers ``report_progress`` from ``core.report`` (synchronous), and
``average_gradients`` raises :class:`_Averaging` with what it was handed; the loop awaits
``core.average`` with it and replays the same micro-step, whose averaging then returns that
outcome. An eager update is a pure function of its inputs and the host's answers, so the
replay computes the same pseudo-gradient (asserted) and applies the outer step once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import trio

from dedloc_jax.config import (
    CollaborationConfig,
    DefenceConfig,
    ProgressConfig,
    ReachabilityConfig,
)
from dedloc_jax.diloco import DiLoCoState, diloco, outer_params_after_step
from dedloc_jax.host import AveragingOutcome
from dedloc_jax.opening import open_collaboration
from dedloc_jax.state.keeping import KeepConfig, StepKeeper, keep_in_step_async
from dedloc_jax.state.training import share_state, sync_state
from p2p.dht import DHTClock, DHTConfig
from p2p.node import NodeConfig
from p2p.testing import SimNetwork, host_of, open_sim_nodes, run_sim
from tests.dedloc_jax.simcollab import open_sim_collaboration

DIM, MICRO, PACE = 6, 4, 0.25
TARGET = 64  # samples per outer step: four micro-steps per peer with four peers
# progress read often enough that an outer step's computing (about a virtual second) spans
# several reads, as a real run's does: a newcomer then finds an epoch it can join
CONFIG = CollaborationConfig(
    target_batch_size=TARGET, progress=ProgressConfig(min_refresh=0.1, max_refresh=0.5)
)
TRUE_W = np.linspace(-1.0, 1.0, DIM, dtype=np.float32)
# keep_in_step's timings shortened to outer steps of a few virtual seconds (as bench.soak's)
KEEP = KeepConfig(fork_check_after=1.0, fork_recheck=5.0, fork_hold=30.0, load_timeout=30.0)
LINGER = 40.0  # virtual s a finished peer keeps serving and keeping in step


class _Averaging(Exception):
    """What ``average_gradients`` was handed, for the loop to await ``core.average`` with."""

    def __init__(self, epoch: int, arrays: list[np.ndarray], samples: int, codec: str | None):
        super().__init__(epoch)
        self.epoch, self.arrays, self.samples, self.codec = epoch, arrays, samples, codec


class SimHost:
    """The host ``diloco`` calls, over a simulated core (see the module docstring)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.outcome: AveragingOutcome | None = None  # set while replaying a micro-step
        self.sent: list[np.ndarray] | None = None

    def report_progress(self, epoch: int, samples: int, batch_size: int) -> bool:
        if self.outcome is not None:
            return True  # the replay of the micro-step that reported "step"
        return self.core.report(epoch, samples, batch_size)

    def average_gradients(
        self, epoch: int, gradients: Sequence[np.ndarray], samples: int, *, codec=None
    ) -> AveragingOutcome:
        if self.outcome is None:
            raise _Averaging(epoch, [np.array(g) for g in gradients], samples, codec)
        for got, sent in zip(gradients, self.sent or [], strict=True):
            assert np.asarray(got).tobytes() == sent.tobytes(), "the replay differs"
        return self.outcome


class _Served:
    """Where ``share_state`` hands the arrays it would serve."""

    def share_state(self, arrays: list[np.ndarray], epoch: int) -> None:
        self.arrays, self.epoch = arrays, epoch


class _Loaded:
    """A state loaded by ``keep_in_step_async``, for ``sync_state`` to fill pytrees with."""

    def __init__(self, epoch: int, arrays: list[np.ndarray]) -> None:
        self.got = (epoch, arrays)

    def load_state(self, *, timeout: float = 0.0) -> tuple[int, list[np.ndarray]]:
        return self.got


def served(params: Any, state: DiLoCoState) -> tuple[list[np.ndarray], int]:
    """The arrays and epoch this peer serves (outer parameters and outer state)."""
    out = _Served()
    share_state(out, params, state)
    return out.arrays, out.epoch


@jax.jit
def _grad(params: dict, x: jax.Array, y: jax.Array) -> dict:
    return jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))(params)


class Peer:
    """One volunteer: the diloco transform over its core, and its keeper."""

    def __init__(self, core: Any, seed: int) -> None:
        self.core = core
        self.host = SimHost(core)
        self.tx = diloco(optax.adam(0.05), self.host, target_batch_size=TARGET)
        self.keeper = StepKeeper(KEEP)
        self.rng = np.random.default_rng(seed)
        self.params = {"w": jnp.zeros(DIM, jnp.float32), "b": jnp.zeros((), jnp.float32)}
        self.state: DiLoCoState = self.tx.init(self.params)
        self.in_round = False  # inside core.average
        self.done = False

    @property
    def epoch(self) -> int:
        return int(self.state.epoch)

    async def keep(self) -> None:
        """keep_in_step, as :func:`dedloc_jax.keep_in_step` does it for JAX pytrees."""
        self.params = outer_params_after_step(self.params, self.state)
        if not self.keeper.due(trio.current_time(), self.epoch, self.core.behind):
            return  # the cheap path: nothing to serve, check or load
        arrays, epoch = served(self.params, self.state)
        loads = self.keeper.loads
        got, at = await keep_in_step_async(
            self.core, self.keeper, arrays, epoch, bool(self.state.complete)
        )
        if self.keeper.loads != loads:
            self.params, self.state, _ = sync_state(_Loaded(at, got), self.params, self.state)

    async def micro_step(self) -> None:
        x = self.rng.normal(size=(MICRO, DIM)).astype(np.float32)
        grads = _grad(self.params, x, x @ TRUE_W)
        try:
            updates, state = self.tx.update(grads, self.state, self.params, batch_size=MICRO)
        except _Averaging as a:
            self.in_round = True
            outcome = await self.core.average(a.epoch, a.arrays, a.samples, codec=a.codec)
            self.in_round = False
            self.host.outcome, self.host.sent = outcome, a.arrays
            try:
                updates, state = self.tx.update(grads, self.state, self.params, batch_size=MICRO)
            finally:
                self.host.outcome = self.host.sent = None
        self.params, self.state = optax.apply_updates(self.params, updates), state

    async def train(self, outer_steps: int, others: Sequence[Peer] = ()) -> None:
        """Micro-steps until ``outer_steps`` outer steps, keeping in step after each; then
        serves and keeps in step while ``others`` train (for up to LINGER virtual s)."""
        await self.keep()  # a newcomer loads the run's state here
        while self.epoch < outer_steps:
            await trio.sleep(PACE)
            await self.micro_step()
            await self.keep()
        self.done = True
        finished = trio.current_time()
        while trio.current_time() - finished < LINGER:
            if trio.current_time() - finished > 10.0 and all(p.done for p in others):
                break
            await trio.sleep(1.0)
            await self.keep()

    def lineage(self) -> tuple[int, bytes]:
        arrays, epoch = served(outer_params_after_step(self.params, self.state), self.state)
        return epoch, b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def _assert_one_lineage(peers: Sequence[Peer], outer_steps: int) -> None:
    lineages = [p.lineage() for p in peers]
    assert [e for e, _ in lineages] == [outer_steps] * len(peers)
    assert len({blob for _, blob in lineages}) == 1, "live peers hold different lineages"
    first = peers[0].state
    momentum = jax.tree.leaves(first.outer_state)
    assert any(np.any(np.asarray(m) != 0) for m in momentum)  # the outer state is not empty
    for p in peers[1:]:  # the same, spelled out: outer parameters and outer optimizer state
        for mine, theirs in zip(
            jax.tree.leaves((p.state.outer_params, p.state.outer_state)),
            jax.tree.leaves((first.outer_params, first.outer_state)),
            strict=True,
        ):
            assert np.asarray(mine).tobytes() == np.asarray(theirs).tobytes()


def _run(main: Any) -> Any:
    """``main`` in virtual time (a MockClock), the scheduler seeded, bounded in virtual time."""
    return run_sim(main, seed=0, timeout=600.0)


def test_a_peer_killed_mid_averaging_leaves_one_lineage() -> None:
    """Four peers; peer 3 is killed while its group averages outer step 1 (the group formed
    with it). The three others end on one lineage, and averaged together afterwards."""
    config = CONFIG
    outer_steps, victim, kill_at = 4, 3, 1
    killed: dict[str, Any] = {}

    async def main() -> list[Peer]:
        net = SimNetwork(seed=1)
        async with open_sim_collaboration(net, 4, config=config, latency=0.01) as cores:
            peers = [Peer(core, seed=i) for i, core in enumerate(cores)]
            core = cores[victim]
            join_group = core.matchmaker.join_group  # (also of groups planned ahead)

            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()

                async def kill_soon() -> None:
                    await trio.sleep(0.005)  # into the all-reduce
                    killed["in_round"] = peers[victim].in_round
                    net.kill(host_of(net, core.node))
                    scope.cancel()

                async def spy(planned: Any, *args: Any, **kwargs: Any) -> Any:
                    spec = await join_group(planned, *args, **kwargs)
                    if planned.slot[0] == kill_at and spec is not None and not killed:
                        killed["group"] = len(spec.members)
                        nursery.start_soon(kill_soon)
                    return spec

                core.matchmaker.join_group = spy

                async def doomed() -> None:
                    with scope:
                        await peers[victim].train(outer_steps)

                nursery.start_soon(doomed)
                for p in peers[:victim]:
                    nursery.start_soon(p.train, outer_steps, peers[:victim])
            return peers

    peers = _run(main)
    assert killed.get("in_round") and killed["group"] > 1  # killed inside a formed group
    assert peers[victim].epoch == kill_at
    live = peers[:victim]
    _assert_one_lineage(live, outer_steps)
    last = [p.core.history[-1] for p in live]  # the last round: the survivors, together
    assert all(h.group_size == len(live) and h.complete for h in last), last


def test_a_newcomer_loads_the_outer_state_and_joins_the_next_outer_steps() -> None:
    """Three peers train; a fourth joins after outer step 1, loads the run's outer state
    (parameters and Nesterov momentum) and averages with them to the end: one lineage."""
    config = CONFIG
    outer_steps = 4

    async def main() -> tuple[list[Peer], Peer]:
        net = SimNetwork(seed=2)
        async with open_sim_collaboration(net, 3, config=config, latency=0.01) as cores:
            peers = [Peer(core, seed=i) for i, core in enumerate(cores)]
            first = [str(cores[0].node.addrs[0])]
            everyone = list(peers)

            async def newcomer(task_status=trio.TASK_STATUS_IGNORED) -> None:
                while min(p.epoch for p in peers) < 1:
                    await trio.sleep(0.1)
                async with (
                    open_sim_nodes(net, 1, config=NodeConfig.testing(), latency=0.01) as nodes,
                    open_collaboration(
                        nodes[0],
                        "run",
                        initial_peers=first,
                        config=config.replace(reachability=ReachabilityConfig(detect=False)),
                        dht_config=DHTConfig.fast(),
                        dht_clock=DHTClock(trio.current_time),
                    ) as core,
                ):
                    late = Peer(core, seed=9)
                    everyone.append(late)
                    await late.train(outer_steps, peers)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(newcomer)
                for p in peers:
                    nursery.start_soon(p.train, outer_steps, everyone)
            return peers, everyone[-1]

    peers, late = _run(main)
    assert late is not peers[-1] and late.keeper.loads >= 1
    joined = [h for h in late.core.history if h.group_size == 4 and h.complete]
    assert joined, late.core.history  # it averaged with all three after loading
    _assert_one_lineage([*peers, late], outer_steps)


def test_a_two_epoch_partition_heals_to_one_lineage() -> None:
    """Peers {0, 1, 2} and {3, 4} take two outer steps apart, then the network heals: the
    minority loads the majority's outer state and all five end on one lineage."""
    config = CONFIG
    outer_steps = 6
    split: dict[str, int] = {}

    async def main() -> list[Peer]:
        net = SimNetwork(seed=0)
        async with open_sim_collaboration(net, 5, config=config, latency=0.01) as cores:
            peers = [Peer(core, seed=i) for i, core in enumerate(cores)]
            hosts = [host_of(net, core.node) for core in cores]

            async def partition() -> None:
                while min(p.epoch for p in peers) < 1:
                    await trio.sleep(0.1)
                net.partition(hosts[:3], hosts[3:])
                split["at"] = start = max(p.epoch for p in peers)
                while peers[0].epoch < start + 2 or peers[3].epoch < start + 2:
                    await trio.sleep(0.1)
                net.heal()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(partition)
                for p in peers:
                    nursery.start_soon(p.train, outer_steps, peers)
            return peers

    peers = _run(main)
    apart = {
        (i, h.epoch, h.group_size)
        for i, p in enumerate(peers)
        for h in p.core.history
        if split["at"] <= h.epoch < split["at"] + 2
    }
    assert (3, split["at"], 2) in apart and (0, split["at"], 3) in apart  # two sides averaged
    assert sum(p.keeper.forks for p in peers[3:]) >= 1  # the minority loaded the majority's
    _assert_one_lineage(peers, outer_steps)


def test_a_sign_flipping_peer_counts_no_samples_toward_the_outer_step() -> None:
    """One of four sends -1000 x its pseudo-gradient under the open-run defences: its part
    weighs nothing, and from the outer step after the first its samples count 0 toward the
    target, so the honest peers' steps hold the whole target (72 samples of 64 each; before,
    48: its quarter counted at every step)."""
    config = CONFIG.replace(defence=DefenceConfig(robust=True, verify=True))
    outer_steps = 4
    fed: dict[int, int] = {}

    async def main() -> None:
        net = SimNetwork(seed=3)
        async with open_sim_collaboration(net, 4, config=config, latency=0.01) as cores:
            peers = [Peer(core, seed=i) for i, core in enumerate(cores)]
            for i, core in enumerate(cores):
                average = core.average

                async def hooked(epoch, arrays, samples, _i=i, _average=average, **kw):
                    if _i == 3:  # the flipper
                        arrays = [np.float32(-1000.0) * a for a in arrays]
                    else:
                        fed[epoch] = fed.get(epoch, 0) + samples
                    return await _average(epoch, arrays, samples, **kw)

                core.average = hooked
            async with trio.open_nursery() as nursery:
                for p in peers:
                    nursery.start_soon(p.train, outer_steps, peers)

    _run(main)
    assert min(fed[e] for e in range(1, outer_steps)) >= 0.95 * TARGET, fed
