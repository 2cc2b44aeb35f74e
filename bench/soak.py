"""Simulator soak: many peers, many epochs, churn, a healing partition and slow links.

Run ``python -m bench.soak [--peers 200] [--epochs 200] [--group 16] [--seed 0]
[--report-every 10]``.

Each peer trains on the simulated network in virtual time (MockClock): it accumulates
micro-batches (random vectors standing in for gradients) until the collaboration reaches the
target, averages, applies the average to its parameters (SGD) and serves them as its state.
During the run peers leave (some gracefully at an epoch boundary, some killed at a random
moment, mid-averaging included), new peers join and download the state from others, a
partition splits the network for a sixth of the epochs and heals, and a tenth of the hosts have
slow uplinks. Each peer keeps in step with the library's policy, as the sahajBERT trainer does:
:func:`dedloc_jax.state.keeping.keep_in_step_async` after every micro-step and step (a
newcomer loads the run's state; a peer that fell behind, stepped alone while others trained, or
whose lineage lost a fork check loads the winner's), with its timings shortened to the
simulation's epochs and a peer that stepped alone waiting for its check before it trains on
(``KEEP``). Figures:

- ``epochs``: epochs the bootstrap peer (peer 0, never leaves) completed; ``averaged``: in how
  many of them it averaged (it may skip one it fell behind in); ``grouped``: how many in a
  group of more than one;
- ``groups``: distinct averaging groups seen; ``divergences``: groups whose members ended the
  epoch with different averages (bit for bit) while each believed it held the whole epoch's
  mean; ``incomplete``: averages a peer knew missed part of the epoch (it averaged alone, or
  its group's round across groups failed; it then loads the others' state); ``nans``:
  non-finite averages;
- ``kills``, ``joins``, ``resyncs`` (a peer fell behind), ``state_loads`` (states downloaded)
  and ``state_load_failures``;
- ``params_agreed``: epochs after which every peer that went on training held the same
  parameters; ``param_versions_max``: the most versions that coexisted after an epoch;
  ``params_in_sync`` (mean) and ``params_in_sync_min``: the share of the peers that went on
  holding the epoch's most common version (one that fell behind and loaded a newer state
  counts as out of sync). The parameters a peer holds after an epoch are the ones it trains
  the next epoch on: once the next epoch's fork check answered (after loading the winning
  lineage's state if its own lost), else those it averages that epoch with;
- ``left_behind``: peers still training when the bootstrap peer left (peers that finished
  serve their state until the others finish, for up to ``END_LINGER`` virtual s);
- ``virtual_seconds``, ``wall_seconds``, ``epoch_wall_seconds`` (mean wall time per epoch).

Every ``--report-every`` epochs (10) it prints the figures so far (``soak: so far {...}``, with
``params_apart``: the epochs after which peers held different parameters outside the
partition), so a run cut short still shows how far it held. The last line is one JSON object.
``tests/reliability/test_soak.py`` runs short plans.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import trio

from bench.soak_figures import check_soak, partial_figures, summarize
from dedloc_jax.config import CollaborationConfig
from dedloc_jax.opening import open_collaboration
from dedloc_jax.state import KeepConfig, StepKeeper, keep_in_step_async
from p2p.dht import DHTClock, DHTConfig
from p2p.node import NodeConfig, open_node
from p2p.testing import SimNetwork, run_sim, sim_identity

MICRO = 4
LR = 0.01  # the soak's optimizer: plain SGD on the averaged gradient
LINGER = 10.0  # virtual s a peer that finished serves its state before leaving, at least
# and longer while others still train, up to this: a peer whose last rounds outlasted the
# others' (at 200 peers, two slow hosts averaged their next-to-last epoch for 40 s, alone)
# then finds no state to load, and trains the rest of the run on a lineage of its own
END_LINGER = 120.0
# keep_in_step's timings for epochs of a few virtual seconds (a real run's last longer). The
# patience: at 200 peers a round often takes more than 10 s, and a peer that stepped alone
# and stopped asking sooner kept its own lineage for an epoch. The hold: a peer that stepped
# alone waits for the check rather than train on its own state (without it, at 60 peers,
# a peer held other parameters than the rest after epochs 3 and 4, before any partition).
KEEP = KeepConfig(
    fork_check_after=1.0,
    fork_recheck=5.0,
    fork_patience=30.0,
    fork_hold=30.0,
    lost_loads=5,
    load_timeout=30.0,
)
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
    match_early: bool | None = None  # RoundConfig.match_early (None: its default)


@dataclass
class Log:
    rows: list[dict] = field(default_factory=list)
    keeper: StepKeeper = field(default_factory=lambda: StepKeeper(KEEP))  # its figures count
    joined_at: int | None = None
    left: bool = False

    @property
    def resyncs(self) -> int:  # fell behind while a newer state was served
        return self.keeper.resyncs

    @property
    def loads(self) -> int:  # states downloaded (joining, behind, a lost lineage)
        return self.keeper.loads

    @property
    def forks(self) -> int:  # of them, after our lineage lost a fork check
        return self.keeper.forks

    @property
    def load_failures(self) -> int:
        return self.keeper.load_failures


def settle(log: Log, params: np.ndarray, *, at_round: bool = False) -> None:
    """Record what the peer's last epoch left it training on: the parameters it holds once
    the next epoch's fork check answered (after loading the winning lineage's, if ours
    lost), or ``at_round`` (the check had not answered yet) those it averages with; None
    when it left that lineage for a state of another epoch: a newer one (it fell behind), or
    an older one (its side of a healed partition stepped ahead and lost: it trains that epoch
    again, so the parameters it holds are not those of the epoch after the row's, which its
    row was compared with). The first that applies counts."""
    if not log.rows or log.rows[-1]["settled"]:
        return
    row, keeper = log.rows[-1], log.keeper
    if keeper.epoch is not None and keeper.epoch != row["epoch"] + 1:
        row["settled"], row["params"] = True, None
    elif keeper.checked or at_round:
        row["settled"], row["params"] = True, hashlib.sha256(params.tobytes()).digest()


def _grad(peer: int, epoch: int, step: int, size: int) -> np.ndarray:
    return np.random.default_rng([peer, epoch, step]).normal(size=(size,)).astype(np.float32)


def run_soak(
    plan: SoakPlan, on_epoch: Callable[[int, list[Log], dict], None] | None = None
) -> tuple[list[Log], dict]:
    """Run ``plan``; ``on_epoch(epoch, logs, events)`` is called as the bootstrap peer
    reaches each epoch (synchronously, in the simulation: it must not block; ``events`` then
    holds ``virtual_seconds``, the current virtual time). A long run reports with it what it
    showed so far, which a run cut short (a machine that goes away) would otherwise lose."""
    config = CollaborationConfig.local_demo(40 * plan.peers)
    config = config.replace(
        progress=config.progress.replace(max_refresh=1.0),
        rounds=config.rounds.replace(max_group_size=plan.max_group_size),
    )
    if plan.match_early is not None:
        config = config.replace(rounds=config.rounds.replace(match_early=plan.match_early))
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
    events["left_behind"] = 0

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
        training: dict[int, int] = {}  # peer -> the epoch it trains now

        active: set[int] = set()  # peers still training (not finished, left or killed)

        async def peer(i: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
            active.add(i)
            try:
                await peer_run(i, task_status)
            finally:
                active.discard(i)

        async def peer_run(i: int, task_status) -> None:
            host = hosts[i]
            log = logs[i]
            with trio.CancelScope() as scope:
                async with (
                    open_node(
                        sim_identity(net, i),
                        transport=host.transport,
                        listen=[host.listen_addr],
                        config=NodeConfig.testing().replace(idle_timeout=120.0),
                    ) as node,
                    open_collaboration(
                        node,
                        "soak",
                        initial_peers=bootstrap,
                        config=config,
                        dht_config=DHTConfig.fast().replace(locate_ttl=plan.locate_ttl),
                        # Virtual time, like everything here: with the wall clock, expiry and
                        # extrapolation ran at the machine's speed, and no run repeated.
                        dht_clock=DHTClock(trio.current_time),
                    ) as core,
                ):
                    if i == 0:
                        bootstrap.append(str(node.addrs[0]))
                        bootstrap_ready.set()
                    # The groups of representatives (level 1) this peer averaged with across
                    # groups; its level-0 group is the round's (outcome.group), however it
                    # formed (at the target or planned ahead of it: no form_group call).
                    specs: list = []
                    form_group = core.matchmaker.form_group

                    async def spy(*args, **kwargs):
                        spec = await form_group(*args, **kwargs)
                        if kwargs.get("level", 0) == 1:
                            specs.append(spec)
                        return spec

                    core.matchmaker.form_group = spy
                    task_status.started()
                    params = np.zeros(plan.size, np.float32)  # every initial peer: same start
                    if i >= plan.peers:  # a joiner: keep_in_step loads the run's state
                        await trio.sleep(2.0)
                    epoch, params = await keep(core, log, params, 0)
                    if i >= plan.peers:
                        log.joined_at = epoch
                    while epoch < plan.epochs:
                        training[i] = epoch
                        # At its epoch, or the first after it (a peer that fell behind and
                        # loaded a newer state may skip it).
                        if graceful.get(i, plan.epochs) <= epoch:
                            log.left = True
                            return
                        if killed.get(i, plan.epochs) <= epoch:
                            async with trio.open_nursery() as kn:

                                async def kill_later() -> None:
                                    await trio.sleep(float(rng.uniform(0.0, 3.0)))
                                    net.kill(host)
                                    events["kills"] += 1
                                    log.left = True
                                    scope.cancel()

                                kn.start_soon(kill_later)
                                epoch, params = await step(i, core, epoch, specs, params)
                            continue
                        epoch, params = await step(i, core, epoch, specs, params)
                        if i == 0:
                            logger.info(
                                "soak: epoch %d reached at %.1f virtual s",
                                epoch,
                                trio.current_time(),
                            )
                            # every epoch up to here: a peer that fell behind skips some
                            for e in range(epoch + 1):
                                epoch_reached[e].set()
                            if on_epoch is not None:
                                events["virtual_seconds"] = trio.current_time()
                                on_epoch(epoch, logs, events)
                    active.discard(i)
                    # Done: keep serving the final state a while, for a peer that stepped
                    # alone in the last epoch and loads it (as the trainer lingers), and keep
                    # in step as in every epoch (its fork check settles what it ends on).
                    finished = trio.current_time()
                    while (waited := trio.current_time() - finished) < END_LINGER:
                        if waited >= LINGER and not active and log.keeper.checked:
                            break
                        epoch, params = await keep(core, log, params, epoch)
                        await trio.sleep(1.0)
                    settle(log, params, at_round=True)
                    if i == 0:
                        events["left_behind"] = len(active)

        async def keep(
            core, log: Log, params: np.ndarray, epoch: int, complete: bool = True
        ) -> tuple[int, np.ndarray]:
            """:func:`keep_in_step_async` with the peer's keeper; records what it settles."""
            (held,), epoch = await keep_in_step_async(core, log.keeper, [params], epoch, complete)
            params = np.asarray(held, np.float32)
            settle(log, params)
            return epoch, params

        async def step(
            i: int, core, epoch: int, specs: list, params: np.ndarray
        ) -> tuple[int, np.ndarray]:
            """One epoch: micro-steps until the collaboration reaches the target (keeping in
            step after each), the round, and keeping in step after the step."""
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
                loads = log.keeper.loads
                now_at, params = await keep(core, log, params, epoch)
                if now_at != epoch:  # fell behind: loaded a newer state
                    return now_at, params
                if log.keeper.loads != loads:
                    # Our lineage lost: we hold the winner's state of this epoch now, and
                    # start the epoch's gradients over (as the trainer does).
                    acc[:] = 0.0
                    samples = 0
            settle(log, params, at_round=True)  # what we train this epoch on
            mean = acc / samples
            n_specs = len(specs)
            outcome = await core.average(epoch, [mean], samples)
            # The group whose average this peer got: its level-0 group; when it was alone
            # there, the group of representatives it averaged with across groups. (Read from
            # form_group alone, a group planned ahead of the target went unnamed, and the
            # two sides of a partition counted as one group holding two averages.)
            across = specs[n_specs:]
            spec = outcome.group or (across[-1] if across else None)
            params = params - np.float32(LR) * np.asarray(outcome.average[0], np.float32)
            log.rows.append(
                {
                    "epoch": epoch,
                    "group": outcome.group_size,
                    "complete": outcome.complete,
                    "digest": None if spec is None else spec.digest,
                    "got": outcome.average[0],
                    "sent": mean,
                    "params": hashlib.sha256(params.tobytes()).digest(),
                    "settled": False,
                }
            )
            # Serve the new state; after a step without the whole collaboration, check our
            # lineage at once and load the winner's (the library's policy, as the trainer's).
            complete = outcome.complete and outcome.group_size > 1
            return await keep(core, log, params, epoch + 1, complete)

        async def partitioner() -> None:
            start, end = plan.epochs // 3, plan.epochs // 3 + max(2, plan.epochs // 6)
            await epoch_reached[start].wait()
            cut_off = [hosts[p] for p in partitioned]
            rest = [h for j, h in enumerate(hosts) if j not in partitioned]
            net.partition(cut_off, rest)
            events["partitioned_at"] = start
            await epoch_reached[end].wait()
            net.heal()
            # The newest epoch any peer trains: the side that stepped faster apart is ahead,
            # and it trained those epochs apart too (it notices the heal only once the DHT
            # shows it the other side's progress).
            alive = [e for j, e in training.items() if not logs[j].left]
            events["healed_at"] = max([end, *alive])

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


def plan_for(peers: int, epochs: int, *, group: int, size: int, seed: int) -> SoakPlan:
    """The shape of the 200-peer soak at any size: a tenth join later, a twentieth leave
    gracefully and a twentieth are killed, a fifth are partitioned, a tenth are slow."""
    return SoakPlan(
        peers=peers - peers // 10,
        joiners=peers // 10,
        epochs=epochs,
        size=size,
        graceful_leavers=max(1, peers // 20),
        killed=max(1, peers // 20),
        slow=max(1, peers // 10),
        partition=max(2, peers // 5),
        seed=seed,
        max_virtual_time=1e6,
        max_group_size=group,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.soak")
    p.add_argument("--peers", type=int, default=200)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--group", type=int, default=16, help="max_group_size (Moshpit-style cap)")
    p.add_argument("--size", type=int, default=1000, help="floats per averaged vector")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--report-every",
        type=int,
        default=10,
        help="print the figures so far every this many epochs (0: never)",
    )
    args = p.parse_args(argv)
    if args.peers < 10 or args.epochs < 6:
        p.error("need at least 10 peers and 6 epochs")
    logging.basicConfig(level=logging.ERROR)
    started = time.perf_counter()

    class _Progress(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            print(f"[{time.perf_counter() - started:8.1f} s] {record.getMessage()}", flush=True)

    logger.setLevel(logging.INFO)
    logger.addHandler(_Progress())
    logger.propagate = False
    plan = plan_for(args.peers, args.epochs, group=args.group, size=args.size, seed=args.seed)

    def report(epoch: int, logs: list[Log], events: dict) -> None:
        if args.report_every and epoch % args.report_every == 0:
            figures = partial_figures(plan, logs, events)
            figures["wall_seconds"] = round(time.perf_counter() - started, 1)
            logger.info("soak: so far %s", json.dumps(figures))

    logs, events = run_soak(plan, report)
    wall = time.perf_counter() - started
    out = summarize(plan, logs, events)
    try:
        check_soak(plan, logs, events)
        out["check"] = "ok"
    except AssertionError as e:
        out["check"] = f"failed: {e}"
    out["wall_seconds"] = round(wall, 1)
    out["epoch_wall_seconds"] = round(wall / max(1, out["epochs"]), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
