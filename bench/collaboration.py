"""A sahajBERT-shaped collaboration in the simulator: how much of their time peers compute.

40 peers (by default) train a model of 18M parameters toward a 4096-sample target, on the
simulated network in virtual time: GPU throughputs spread 10x like volunteers' (lognormal),
home links (asymmetric, 10-100 Mbit/s up, 5x that down), a quarter of the peers client-only
(behind NAT: they accept no connections), fp16 on the wire, and a few peers leaving and others
joining per hour. Everything above the simulated sockets is the real stack: secure channel,
mux, DHT, progress tracker, matchmaking and butterfly all-reduce of real vectors.

By default peers use DeDLOC's delayed parameter update (``--mode overlap``): the round of
epoch t runs in the background while the peer computes toward t + 1, and its result is applied
one step late; ``--mode blocking`` stops computing while matchmaking and averaging, and
``--mode both`` runs both on the same peers, links and churn, one after the other.

Payload scale (``--payload-scale S``): the simulator moves, encrypts and reduces real bytes,
which costs CPU in proportion to the vector. With S > 1 the peers average ``params / S``
values over links S times slower, so every transfer of the averaging takes the time it would
take with the full vector; what is not faithful is that the (small) DHT and matchmaking
messages also travel S times slower. The JSON says ``simulated_params`` (the model the times
stand for) and ``actual_params`` (the vector moved).

Reported (last line, JSON): ``compute_fraction`` (mean over peers of compute time / time in
the run, from joining to the end or leaving) and ``epoch_time_ratio`` (mean epoch time /
ideal, where ideal = target / summed throughput + the load-balancing LP's bound on the
averaging round; with overlap the round is hidden, so the ratio can go below 1).

    python -m bench.collaboration [--peers 40] [--params 18000000] [--epochs 3]
        [--payload-scale S] [--mode overlap|blocking|both]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
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
PAYLOAD_SCALE = 1


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
    # (epoch, time its round ended here, samples this peer contributed)
    epochs: list[tuple[int, float, int]] = field(default_factory=list)


def _draw_peers(n: int, rng: random.Random, scale: int = 1) -> list[PeerStats]:
    """Volunteers: GPU throughputs lognormal within 1-10 samples/s, home uplinks 10-100
    Mbit/s with 5x that down (divided by the payload scale), every fourth peer a client."""
    peers = []
    for i in range(n):
        rate = min(10.0, max(1.0, rng.lognormvariate(np.log(3.0), 0.6)))
        up = rng.uniform(10, 100) * MBIT / scale
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
    overlap: bool,
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
        await _train(core, stats, vector, micro, epochs, done, overlap)


async def _train(
    core: CollaborationCore,
    stats: PeerStats,
    vector: np.ndarray,
    micro: int,
    epochs: int,
    done: trio.Event,
    overlap: bool,
) -> None:
    """Accumulate micro-batches until the collaboration reaches the target, then average.

    With ``overlap`` (DeDLOC's delayed parameter update) the round of epoch t runs as a
    background task while this peer goes on computing toward t + 1; its result would be
    applied one step late. Without it the peer stops computing while it matchmakes and
    averages. (While the round of t runs, ``core.report`` counts toward t + 1 and answers
    False; a round longer than an epoch of computing would overshoot the next target.)
    """
    epoch = core.estimate.epoch
    samples = 0
    in_flight: list[trio.Event] = []  # the round of the previous epoch, while it runs

    async def average(at: int, contributed: int, finished: trio.Event) -> None:
        try:
            await core.average(at, [vector], contributed)
            stats.epochs.append((at, trio.current_time(), contributed))
            if at + 1 >= epochs:
                done.set()
        finally:
            finished.set()

    async with trio.open_nursery() as nursery:
        while not done.is_set():
            step = micro / stats.rate
            await trio.sleep(step)
            stats.compute += step
            samples += micro
            if in_flight and in_flight[0].is_set():
                in_flight.clear()
            if core.report(epoch, samples, micro):
                finished = trio.Event()
                if overlap:
                    in_flight.append(finished)
                    nursery.start_soon(average, epoch, samples, finished)
                else:
                    await average(epoch, samples, finished)
                epoch, samples = epoch + 1, 0
            elif (
                not in_flight and core.estimate.epoch > epoch
            ):  # we fell behind (joined late): move on
                epoch, samples = core.estimate.epoch, 0
        nursery.cancel_scope.cancel()


def simulate(args: argparse.Namespace, *, overlap: bool) -> dict[str, float | None]:
    """One run of the collaboration (same peers, links and churn for a given seed)."""
    rng = random.Random(args.seed)
    peers = _draw_peers(args.peers, rng, args.payload_scale)
    config = CollaborationConfig(target_batch_size=args.target, codec="fp16", max_refresh=5.0)
    actual = max(1, args.params // args.payload_scale)
    vector = np.random.default_rng(args.seed).normal(size=actual).astype(np.float32)
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
                        net,
                        stats,
                        index,
                        first,
                        config,
                        vector,
                        args.micro,
                        args.epochs,
                        done,
                        overlap,
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
                    newcomer = _draw_peers(index + 1, rng, args.payload_scale)[-1]
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

    wall = time.perf_counter()
    everyone = run_sim(run, seed=args.seed)
    wall = time.perf_counter() - wall

    trainers = [p for p in everyone if p.left is not None and p.left > p.joined]
    fractions = [p.compute / (p.left - p.joined) for p in trainers]
    ends = sorted({t for p in everyone for _, t, _ in p.epochs})
    contributed: dict[int, int] = {}
    ended: dict[int, list[float]] = {}
    for p in everyone:
        for e, t, n in p.epochs:
            contributed[e] = contributed.get(e, 0) + n
            ended.setdefault(e, []).append(t)
    # An epoch ends when its peers' rounds end: the median, which one straggler (a round
    # that timed out, a newcomer) cannot move.
    per_epoch = {e: statistics.median(ts) for e, ts in ended.items()}
    times = [per_epoch[e] for e in sorted(per_epoch)]
    epoch_times = [b - a for a, b in zip(times, times[1:], strict=False)]
    total_rate = sum(p.rate for p in peers)
    # The LP bound in real units: the scaled links carry the scaled vector in the same time.
    members = [Member(p.name, p.mode, p.up, p.down, 1.0) for p in peers]
    lp_bound = solve_shares(members).lower_bound(2 * actual)  # fp16 on the wire
    ideal = args.target / total_rate + lp_bound
    mean_epoch = statistics.mean(epoch_times) if epoch_times else float("nan")
    mode = "overlapped (delayed update)" if overlap else "blocking"
    print(f"--- {mode}: {len(per_epoch)} epochs in {wall:.0f} s of wall time")
    print(f"summed throughput {total_rate:.1f} samples/s; LP averaging bound {lp_bound:.2f} s")
    print(f"epoch times (virtual s): {[round(t, 1) for t in epoch_times]}; ideal {ideal:.1f} s")
    print(f"peers that joined/left by churn: {len(everyone) - len(peers)}")
    print(f"compute fraction: mean {statistics.mean(fractions):.3f}, min {min(fractions):.3f}")
    return {
        "compute_fraction": round(statistics.mean(fractions), 4),
        "min_compute_fraction": round(min(fractions), 4),
        "epoch_time_ratio": round(mean_epoch / ideal, 4),
        # samples averaged per epoch / target (> 1: computed past the target), over all but
        # the last epoch, whose rounds the end of the run cuts off
        "samples_per_target": round(
            statistics.mean(n for e, n in contributed.items() if e < max(contributed))
            / args.target,
            4,
        )
        if len(contributed) > 1
        else None,
        "epoch_seconds": round(mean_epoch, 3),
        "ideal_epoch_seconds": round(ideal, 3),
        "lp_bound_seconds": round(lp_bound, 3),
        "epochs": len(per_epoch),
        "churned": len(everyone) - len(peers),
        "virtual_seconds": round(ends[-1], 1) if ends else 0.0,
        "wall_seconds": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=40)
    parser.add_argument("--params", type=int, default=18_000_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--target", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--churn-per-hour", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--payload-scale",
        type=int,
        default=PAYLOAD_SCALE,
        help="average params/S values over links S times slower (same transfer times)",
    )
    parser.add_argument(
        "--mode",
        choices=("overlap", "blocking", "both"),
        default="overlap",
        help="delayed parameter update (default), peers that stop to average, or both",
    )
    args = parser.parse_args()
    if args.payload_scale < 1:
        parser.error("--payload-scale must be at least 1")
    logging.basicConfig(level=logging.ERROR)
    print(
        f"{args.peers} peers ({sum(i % 4 == 3 for i in range(args.peers))} clients), "
        f"{args.params:,} params simulated as {max(1, args.params // args.payload_scale):,} "
        f"over links {args.payload_scale}x slower, target {args.target}"
    )
    modes = ["overlap", "blocking"] if args.mode == "both" else [args.mode]
    results = {m: simulate(args, overlap=m == "overlap") for m in modes}
    out: dict[str, object] = dict(results[modes[0]])
    out.update(
        mode=modes[0],
        peers=args.peers,
        simulated_params=args.params,
        actual_params=max(1, args.params // args.payload_scale),
        payload_scale=args.payload_scale,
    )
    if len(modes) == 2:
        out["blocking"] = results["blocking"]
    print(json.dumps(out))


async def _started(start, stats: PeerStats, index: int, *, task_status=trio.TASK_STATUS_IGNORED):
    """Start the first peer and report once its address is known (others bootstrap from it)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(start, stats, index)
        await stats.started.wait()
        task_status.started()


if __name__ == "__main__":
    main()
