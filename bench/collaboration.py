"""A sahajBERT-shaped collaboration in the simulator: how much of their time peers compute.

40 peers (by default) train a model of 18M parameters toward a 4096-sample target, on the
simulated network in virtual time: GPU throughputs spread 10x like volunteers' (lognormal),
home links (asymmetric, 10-100 Mbit/s up, 5x that down), a quarter of the peers client-only
(behind NAT: they accept no connections), fp16 on the wire, and a few peers leaving and others
joining per hour. Everything above the simulated sockets is the real stack: secure channel,
mux, DHT, progress tracker, matchmaking and butterfly all-reduce of real 18M-value vectors.

Reported (last line, JSON): ``compute_fraction`` (mean over trainers of compute time / time in
the run) and ``epoch_time_ratio`` (mean epoch time / ideal, where ideal = target / summed
throughput + the load-balancing LP's bound on the averaging round).

    python -m bench.collaboration [--peers 40] [--params 18000000] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
from dataclasses import dataclass, field

import numpy as np
import trio

from dedloc_jax.averaging import Member, solve_shares
from dedloc_jax.collaboration import CollaborationCore, open_collaboration
from dedloc_jax.config import CollaborationConfig
from p2p.dht import DHTClock, DHTConfig
from p2p.node import NodeConfig, open_node
from p2p.testing import SimNetwork, run_sim, sim_identity

MBIT = 1e6 / 8  # bytes per second


@dataclass
class PeerStats:
    name: str
    mode: str
    rate: float  # samples per second
    up: float
    down: float
    joined: float = 0.0
    started: trio.Event = field(default_factory=trio.Event)
    left: float | None = None
    compute: float = 0.0
    epochs: list[tuple[int, float]] = field(default_factory=list)  # (epoch, time it ended)


def _draw_peers(n: int, rng: random.Random) -> list[PeerStats]:
    peers = []
    for i in range(n):
        rate = min(10.0, max(1.0, rng.lognormvariate(np.log(3.0), 0.6)))
        up = rng.uniform(10, 100) * MBIT
        mode = "client" if i % 4 == 3 else "node"
        peers.append(PeerStats(f"p{i}", mode, rate, up, 5 * up))
    return peers


async def _peer(
    net: SimNetwork,
    stats: PeerStats,
    index: int,
    first: list[str],
    config: CollaborationConfig,
    vector: np.ndarray,
    micro: int,
    epochs: int,
    done: trio.Event,
) -> None:
    host = net.add_host(
        stats.name,
        upload_bps=stats.up,
        download_bps=stats.down,
        latency=0.02,
        reachable=stats.mode != "client",
    )
    listen = [] if stats.mode == "client" else [host.listen_addr]
    async with (
        open_node(
            sim_identity(net, index),
            transport=host.transport,
            listen=listen,
            config=NodeConfig.bulk(),
        ) as node,
        open_collaboration(
            node,
            "sahajbert-sim",
            initial_peers=first if index else [],
            config=config,
            mode=stats.mode,
            dht_config=DHTConfig.fast(),
            dht_clock=DHTClock(trio.current_time),
        ) as core,
    ):
        if index == 0:
            first.append(str(node.addrs[0]))
        stats.joined = trio.current_time()
        stats.started.set()
        await _train(core, stats, vector, micro, epochs, done)


async def _train(
    core: CollaborationCore,
    stats: PeerStats,
    vector: np.ndarray,
    micro: int,
    epochs: int,
    done: trio.Event,
) -> None:
    epoch = core.estimate.epoch
    while not done.is_set():
        samples = 0
        while True:
            step = micro / stats.rate
            await trio.sleep(step)
            stats.compute += step
            samples += micro
            if core.report(epoch, samples, micro):
                break
            if core.estimate.epoch > epoch:  # we fell behind (joined late): move on
                epoch = core.estimate.epoch
                samples = 0
        outcome = await core.average(epoch, [vector], samples)
        stats.epochs.append((epoch, trio.current_time()))
        epoch = outcome.epoch
        if epoch >= epochs:
            done.set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=40)
    parser.add_argument("--params", type=int, default=18_000_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--target", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--churn-per-hour", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    rng = random.Random(args.seed)
    peers = _draw_peers(args.peers, rng)
    config = CollaborationConfig(target_batch_size=args.target, codec="fp16", max_refresh=5.0)
    vector = np.random.default_rng(args.seed).normal(size=args.params).astype(np.float32)
    vector.setflags(write=False)

    async def run() -> list[PeerStats]:
        net = SimNetwork(seed=args.seed)
        first: list[str] = []
        done = trio.Event()
        everyone = list(peers)
        async with trio.open_nursery() as nursery:
            scopes: dict[str, trio.CancelScope] = {}

            async def start(stats: PeerStats, index: int) -> None:
                with trio.CancelScope() as scope:
                    scopes[stats.name] = scope
                    await _peer(
                        net, stats, index, first, config, vector, args.micro, args.epochs, done
                    )

            await nursery.start(_started, start, peers[0], 0)
            for i, stats in enumerate(peers[1:], start=1):
                nursery.start_soon(start, stats, i)

            async def churn() -> None:
                index = len(peers)
                while args.churn_per_hour > 0:
                    await trio.sleep(rng.expovariate(args.churn_per_hour / 3600))
                    alive = [p for p in everyone[1:] if p.left is None and p.name in scopes]
                    if not alive:
                        continue
                    victim = rng.choice(alive)
                    victim.left = trio.current_time()
                    scopes[victim.name].cancel()
                    net.kill(victim.name)
                    newcomer = _draw_peers(index + 1, rng)[-1]
                    newcomer.name = f"p{index}"
                    everyone.append(newcomer)
                    nursery.start_soon(start, newcomer, index)
                    index += 1

            nursery.start_soon(churn)
            await done.wait()
            end = trio.current_time()
            for p in everyone:
                if p.left is None:
                    p.left = end
            nursery.cancel_scope.cancel()
        return everyone

    everyone = run_sim(run, seed=args.seed)

    trainers = [p for p in everyone if p.left is not None and p.left > p.joined]
    fractions = [p.compute / (p.left - p.joined) for p in trainers if p.left > p.joined]
    ends = sorted({t for p in everyone for _, t in p.epochs})
    per_epoch: dict[int, float] = {}
    for p in everyone:
        for e, t in p.epochs:
            per_epoch[e] = max(per_epoch.get(e, 0.0), t)
    times = [per_epoch[e] for e in sorted(per_epoch)]
    epoch_times = [b - a for a, b in zip(times, times[1:], strict=False)]
    total_rate = sum(p.rate for p in peers)
    members = [Member(p.name, p.mode, p.up, p.down, 1.0) for p in peers]
    lp_bound = solve_shares(members).lower_bound(2 * args.params)  # fp16 on the wire
    ideal = args.target / total_rate + lp_bound
    mean_epoch = statistics.mean(epoch_times) if epoch_times else float("nan")
    print(
        f"{args.peers} peers ({sum(p.mode == 'client' for p in peers)} clients), "
        f"{args.params:,} params, target {args.target}, {len(per_epoch)} epochs"
    )
    print(f"summed throughput {total_rate:.1f} samples/s; LP averaging bound {lp_bound:.2f} s")
    print(f"epoch times (virtual s): {[round(t, 1) for t in epoch_times]}; ideal {ideal:.1f} s")
    print(f"peers that joined/left by churn: {len(everyone) - len(peers)}")
    print(f"compute fraction: mean {statistics.mean(fractions):.3f}, min {min(fractions):.3f}")
    print(
        json.dumps(
            {
                "compute_fraction": round(statistics.mean(fractions), 4),
                "epoch_time_ratio": round(mean_epoch / ideal, 4),
                "epoch_seconds": round(mean_epoch, 3),
                "ideal_epoch_seconds": round(ideal, 3),
                "lp_bound_seconds": round(lp_bound, 3),
                "peers": args.peers,
                "params": args.params,
                "epochs": len(per_epoch),
                "churned": len(everyone) - len(peers),
                "virtual_seconds": round(ends[-1], 1) if ends else 0.0,
            }
        )
    )


async def _started(start, stats: PeerStats, index: int, *, task_status=trio.TASK_STATUS_IGNORED):
    """Start the first peer and report once its address is known (others bootstrap from it)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(start, stats, index)
        await stats.started.wait()
        task_status.started()


if __name__ == "__main__":
    main()
