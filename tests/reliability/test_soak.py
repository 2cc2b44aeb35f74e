"""Simulator soak: many peers, many epochs, churn, a healing partition and slow links.

Each peer trains on the simulated network in virtual time (MockClock): it accumulates
micro-batches until the collaboration reaches the target, then averages. During the run peers
leave (some gracefully at an epoch boundary, some killed at a random moment, mid-averaging
included), new peers join at the current epoch without state, a partition splits the network
and heals, and a few hosts have slow uplinks. The checks: the collaboration keeps stepping
(the epochs are done, most of them averaged in a group), members of one group end the epoch
with bit-identical finite averages, and nothing hangs (the run has a virtual-time bound).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import pytest
import trio

from dedloc_jax.collaboration import open_collaboration
from dedloc_jax.config import CollaborationConfig
from p2p.dht import DHTConfig
from p2p.node import NodeConfig, open_node
from p2p.testing import SimNetwork, run_sim, sim_identity

MICRO = 4
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SoakPlan:
    peers: int  # at the start
    joiners: int  # join later, at the current epoch, without state
    epochs: int
    size: int = 2000  # floats per vector
    graceful_leavers: int = 2
    killed: int = 2
    slow: int = 3  # hosts with a slow uplink
    partition: int = 4  # peers cut off from the rest for a while
    seed: int = 0
    max_virtual_time: float = 3600.0
    locate_ttl: float = 10.0  # peers publish often: stores reuse the key's nearest nodes
    max_group_size: int = 64


@dataclass
class Log:
    rows: list[dict] = field(default_factory=list)
    resyncs: int = 0
    joined_at: int | None = None
    left: bool = False


def _grad(peer: int, epoch: int, step: int, size: int) -> np.ndarray:
    return np.random.default_rng([peer, epoch, step]).normal(size=(size,)).astype(np.float32)


def run_soak(plan: SoakPlan) -> tuple[list[Log], dict]:
    config = CollaborationConfig.local_demo(40 * plan.peers).replace(
        max_refresh=1.0, max_group_size=plan.max_group_size
    )
    n_all = plan.peers + plan.joiners
    rng = np.random.default_rng(plan.seed)
    rates = rng.uniform(10.0, 40.0, size=n_all)
    # Roles among the initial peers (peer 0, the bootstrap, stays to the end).
    order = rng.permutation(np.arange(1, plan.peers))
    graceful = {
        int(p): int(rng.integers(1, plan.epochs - 1)) for p in order[: plan.graceful_leavers]
    }
    cut = plan.graceful_leavers + plan.killed
    killed = {
        int(p): int(rng.integers(1, plan.epochs - 1)) for p in order[plan.graceful_leavers : cut]
    }
    partitioned = [int(p) for p in order[cut : cut + plan.partition]]
    slow = {int(p) for p in rng.choice(np.arange(1, n_all), size=plan.slow, replace=False)}
    join_epochs = sorted(int(e) for e in rng.integers(1, max(2, plan.epochs - 2), plan.joiners))
    events: dict = {"kills": 0, "joins": 0, "partitioned_at": None, "healed_at": None}
    events["dht_shutdown_errors"] = 0

    async def main() -> list[Log]:
        net = SimNetwork(seed=plan.seed)
        logs = [Log() for _ in range(n_all)]
        hosts = [
            net.add_host(
                f"peer{i}",
                latency=float(rng.uniform(0.005, 0.05)),
                upload_bps=2e5 if i in slow else float("inf"),
            )
            for i in range(n_all)
        ]
        bootstrap: list[str] = []
        bootstrap_ready = trio.Event()
        epoch_reached: dict[int, trio.Event] = defaultdict(trio.Event)

        async def peer(i: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
            await peer_run(i, task_status)

        async def peer_run(i: int, task_status) -> None:
            host = hosts[i]
            log = logs[i]
            with trio.CancelScope() as scope:
                async with (
                    open_node(
                        sim_identity(net, i),
                        transport=host.transport,
                        listen=[host.listen_addr],
                        config=NodeConfig.testing(),
                    ) as node,
                    open_collaboration(
                        node,
                        "soak",
                        initial_peers=bootstrap,
                        config=config,
                        dht_config=DHTConfig.fast().with_(locate_ttl=plan.locate_ttl),
                    ) as core,
                ):
                    if i == 0:
                        bootstrap.append(str(node.addrs[0]))
                        bootstrap_ready.set()
                    specs: list = []
                    form_group = core.matchmaker.form_group

                    async def spy(*args, **kwargs):
                        spec = await form_group(*args, **kwargs)
                        specs.append(spec)
                        return spec

                    core.matchmaker.form_group = spy
                    task_status.started()
                    epoch = 0
                    if i >= plan.peers:  # a joiner: no state, starts at the current epoch
                        await trio.sleep(2.0)
                        epoch = core.tracker.current_estimate().epoch
                        log.joined_at = epoch
                    while epoch < plan.epochs:
                        if graceful.get(i) == epoch:
                            log.left = True
                            return
                        if killed.get(i) == epoch:
                            async with trio.open_nursery() as kn:

                                async def kill_later() -> None:
                                    await trio.sleep(float(rng.uniform(0.0, 3.0)))
                                    net.kill(host)
                                    events["kills"] += 1
                                    log.left = True
                                    scope.cancel()

                                kn.start_soon(kill_later)
                                epoch = await step(i, core, epoch, specs)
                            continue
                        epoch = await step(i, core, epoch, specs)
                        if i == 0:
                            logger.info(
                                "soak: epoch %d reached at %.1f virtual s",
                                epoch,
                                trio.current_time(),
                            )
                            # every epoch up to here: a peer that fell behind skips some
                            for e in range(epoch + 1):
                                epoch_reached[e].set()

        async def step(i: int, core, epoch: int, specs: list) -> int:
            log = logs[i]
            acc = np.zeros(plan.size, np.float32)
            samples = 0
            k = 0
            while True:
                await trio.sleep(MICRO / rates[i])
                acc += _grad(i, epoch, k, plan.size) * MICRO
                samples += MICRO
                k += 1
                if core.report(epoch, samples, MICRO):
                    break
                current = core.tracker.current_estimate().epoch
                if current > epoch:  # fell behind (partition, slow link): skip ahead
                    log.resyncs += 1
                    return current
            mean = acc / samples
            n_specs = len(specs)
            outcome = await core.average(epoch, [mean], samples)
            spec = specs[-1] if len(specs) > n_specs else None
            log.rows.append(
                {
                    "epoch": epoch,
                    "group": outcome.group_size,
                    "digest": None if spec is None else spec.digest,
                    "got": outcome.gradients[0],
                    "sent": mean,
                }
            )
            return epoch + 1

        async def partitioner() -> None:
            start, end = plan.epochs // 3, plan.epochs // 3 + max(2, plan.epochs // 6)
            await epoch_reached[start].wait()
            cut_off = [hosts[p] for p in partitioned]
            rest = [h for j, h in enumerate(hosts) if j not in partitioned]
            net.partition(cut_off, rest)
            events["partitioned_at"] = start
            await epoch_reached[end].wait()
            net.heal()
            events["healed_at"] = end

        async def joiner(i: int, at_epoch: int) -> None:
            await epoch_reached[at_epoch].wait()
            events["joins"] += 1
            await peer(i)

        async with trio.open_nursery() as nursery:
            await nursery.start(peer, 0)
            await bootstrap_ready.wait()
            for i in range(1, plan.peers):
                nursery.start_soon(peer, i)
            for j, at in enumerate(join_epochs):
                nursery.start_soon(joiner, plan.peers + j, at)
            nursery.start_soon(partitioner)
        events["virtual_seconds"] = trio.current_time()
        return logs

    logs = run_sim(main, seed=plan.seed, timeout=plan.max_virtual_time)
    return logs, events


def check_soak(plan: SoakPlan, logs: list[Log], events: dict) -> dict:
    # The collaboration kept stepping: the bootstrap peer reached the end, averaging nearly
    # every epoch (it may skip one it fell behind in, e.g. a round that outlasted the others'),
    # most of them in a group.
    done = [r["epoch"] for r in logs[0].rows]
    assert done == sorted(set(done)) and done[-1] == plan.epochs - 1, done
    assert len(done) >= plan.epochs - max(1, plan.epochs // 10), done
    grouped = sum(r["group"] > 1 for r in logs[0].rows)
    assert grouped >= plan.epochs * 2 // 3, f"only {grouped} of {plan.epochs} epochs averaged"
    assert events["kills"] == plan.killed and events["joins"] == plan.joiners
    assert events["healed_at"] is not None
    # Members of one group end the epoch with the same (finite) average, bit for bit.
    groups: dict[tuple[int, bytes], list[np.ndarray]] = defaultdict(list)
    for log in logs:
        for r in log.rows:
            assert np.isfinite(r["got"]).all()
            if r["group"] > 1:
                groups[(r["epoch"], r["digest"])].append(r["got"])
    for (epoch, _digest), vectors in groups.items():
        for v in vectors:
            assert v.tobytes() == vectors[0].tobytes(), f"divergent average at epoch {epoch}"
    # Joiners took part after joining.
    for log in logs[plan.peers :]:
        assert log.joined_at is not None and any(r["group"] > 1 for r in log.rows)
    return {
        "groups": len(groups),
        "grouped_epochs": grouped,
        "resyncs": sum(log.resyncs for log in logs),
    }


def test_soak_small() -> None:
    plan = SoakPlan(peers=6, joiners=2, epochs=6, graceful_leavers=1, killed=1, slow=1, partition=2)
    logs, events = run_soak(plan)
    check_soak(plan, logs, events)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak_200_peers() -> None:
    """200 peers in groups of at most 16 (Moshpit-style, as a run of this size would use).
    About 40 minutes on one core (2026-11-29: 2375 s), so 8 epochs, not the hundreds that
    issue #10 asks for: each virtual second of 200 peers still costs ~10 s of CPU in the
    full-stack simulator. Fails as of 2026-11-29 (issue #10 open): the bootstrap peer fell
    behind in three partition epochs (its rounds lost shares) and averaged only 5 of 8."""
    plan = SoakPlan(
        peers=180, joiners=20, epochs=8, size=1000, graceful_leavers=10, killed=10, slow=20,
        partition=40, max_virtual_time=50_000.0, max_group_size=16,
    )  # fmt: skip
    logs, events = run_soak(plan)
    check_soak(plan, logs, events)


def test_dht_closing_during_a_value_lookup_does_not_crash() -> None:
    from p2p.dht import open_dht
    from p2p.dht.records import Record, pack_value
    from p2p.dht.traverse import LookupResult
    from p2p.testing import open_sim_nodes

    async def main() -> None:
        net = SimNetwork(seed=0)
        answered = trio.Event()
        async with (
            open_sim_nodes(net, 1, config=NodeConfig.testing()) as (node,),
            trio.open_nursery() as outer,
        ):
            async with open_dht(node, config=DHTConfig.fast()) as dht:
                record = Record("k", None, pack_value(1), dht.now() + 60, None)

                async def lookup_answered_as_the_dht_closes(*args, **kwargs):
                    await answered.wait()
                    return LookupResult([], records={node.peer_id: [record]})

                dht.find_nearest = lookup_answered_as_the_dht_closes
                outer.start_soon(dht.get, "k")
                await trio.sleep(1)
                answered.set()  # the lookup's answer arrives just as the DHT closes
            outer.cancel_scope.cancel()

    try:
        run_sim(main)
    except BaseExceptionGroup as group:  # unwrap what escaped the nurseries
        leaves = []
        stack = [group]
        while stack:
            g = stack.pop()
            for e in g.exceptions:
                (stack if isinstance(e, BaseExceptionGroup) else leaves).append(e)
        raise leaves[0] from None
