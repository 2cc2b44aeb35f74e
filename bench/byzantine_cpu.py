"""CPU of a defended clean round against a plain one, side by side in one process:
``python -m bench.byzantine_cpu [--peers 4] [--size 80000] [--rounds 30] [--profile FILE]``.

``--peers`` TCP nodes on loopback in this process average ``--size`` float32 values (the tiny
sahajBERT run's order, its codec ``none``), alternating plain rounds and defended ones
(CenteredClip with a derived radius, verified results); a round's CPU is this process's, all
members together, so the machine's other load hardly moves it. Only rounds that every member
completed with every sender in every share count. Prints each mode's median and the overhead;
the last line is one JSON object (``plain_cpu_ms``, ``defended_cpu_ms``, ``overhead_cpu_ms``,
``cpu_ratio``, ``complete`` of ``rounds`` per mode). ``--profile FILE`` dumps a cProfile of the
defended rounds only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import AsyncExitStack
from typing import Any

import numpy as np


async def _rounds(args: argparse.Namespace, profiler: Any) -> dict[str, list[float]]:
    import trio

    from dedloc_jax.averaging import (
        AllReduceConfig,
        AveragingService,
        GroupSpec,
        Member,
        all_reduce,
    )
    from p2p.identity import Identity
    from p2p.node import NodeConfig, open_node

    plain = AllReduceConfig.internet().replace(stall_timeout=10.0)
    defended = plain.replace(robust=True, verify=True)
    rng = np.random.default_rng(0)
    vecs = [rng.standard_normal(args.size, dtype=np.float32) for _ in range(args.peers)]
    cpu: dict[str, list[float]] = {"plain": [], "defended": []}
    async with AsyncExitStack() as stack:
        nodes = []
        for i in range(args.peers):
            ident = Identity.from_seed(f"bench-byzantine-cpu/{i}".encode())
            nodes.append(await stack.enter_async_context(open_node(ident, config=NodeConfig())))
        for a in nodes:
            for b in nodes:
                if a is not b:
                    a.peerstore.add_addrs(b.peer_id, b.addrs)
        names = [str(n.peer_id) for n in nodes]
        spec = GroupSpec(tuple(Member(p, "node") for p in names), b"bench-byzantine-cpu")
        services = [AveragingService(n, plain) for n in nodes]  # a round passes its config
        for r in range(2 * (args.rounds + args.warm)):
            mode = ("plain", "defended")[r % 2]
            config = defended if mode == "defended" else plain
            outcome: list[Any] = [None] * args.peers

            async def one(
                i: int, config: Any = config, r: int = r, outcome: list = outcome
            ) -> None:
                try:
                    outcome[i] = await all_reduce(
                        services[i], spec, {"g": vecs[i]}, 1.0 + i, codec="none",
                        timeout=60, round_id=f"cpu/{r}".encode(), config=config,
                    )  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a failed round counts as incomplete
                    outcome[i] = e

            profiling = profiler is not None and mode == "defended" and r >= 2 * args.warm
            if profiling:
                profiler.enable()
            c0 = time.process_time()
            async with trio.open_nursery() as nursery:
                for i in range(args.peers):
                    nursery.start_soon(one, i)
            spent = time.process_time() - c0
            if profiling:
                profiler.disable()
            full = frozenset(names)
            complete = all(
                not isinstance(o, Exception | type(None))
                and all(s.contributors == full for s in o.shares)
                and not getattr(o, "accusations", ())
                for o in outcome
            )
            if r >= 2 * args.warm and complete:
                cpu[mode].append(spent)
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--size", type=int, default=80_000)
    ap.add_argument("--rounds", type=int, default=30, help="rounds of each mode (alternating)")
    ap.add_argument("--warm", type=int, default=3, help="rounds of each mode not counted")
    ap.add_argument("--profile", help="a file: cProfile of the defended rounds")
    args = ap.parse_args()
    import trio

    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
    cpu = trio.run(_rounds, args, profiler)
    if profiler is not None:
        profiler.dump_stats(args.profile)
    med = {m: statistics.median(v) * 1e3 if v else float("nan") for m, v in cpu.items()}
    for m, v in cpu.items():
        print(f"{m}: median {med[m]:.1f} ms CPU a round ({len(v)} of {args.rounds} complete)")
    print(f"overhead {med['defended'] - med['plain']:.1f} ms a round")
    print(json.dumps({
        "peers": args.peers, "size": args.size, "rounds": args.rounds,
        "plain_cpu_ms": round(med["plain"], 2), "defended_cpu_ms": round(med["defended"], 2),
        "overhead_cpu_ms": round(med["defended"] - med["plain"], 2),
        "cpu_ratio": round(med["defended"] / med["plain"], 4),
        "complete": {m: len(v) for m, v in cpu.items()},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
