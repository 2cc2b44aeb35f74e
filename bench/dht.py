"""DHT benchmark: real nodes on loopback, and lookups at scale in simulation.

    python -m bench.dht [--nodes 64] [--procs 2] [--ops 100] [--sim-sizes 100,1000,5000]
                        [--sim-lookups 100] [--sim-budget SECONDS]

Loopback: ``--nodes`` DHT nodes (default config: k=20, replication 20) split over ``--procs``
processes (this one hosts the first share and measures; the others only serve), real TCP,
secure channels. After a warm-up (three lookups from each local node, so that measured
operations mostly reuse connections as in a long-running swarm), measures store and get
latency (median, p95) from random nodes of this process, one at a time (a store is a full
lookup plus STOREs to the 20 nearest; a get stops once 3 nodes returned the value), gets per
second from one node with 16 gets in flight, and resident memory per node (sum of the
processes' RSS over the node count).

Simulation: N nodes join, 16 at a time, through the full DHT protocol code (each pings a
random node already in, then looks up its own ID; routing tables fill only from the messages)
over an in-memory network (``p2p.dht.memnet``: messages round-trip through msgpack, no
transport or crypto; the real-stack simulator costs ~0.2 s of CPU per node, too much for
thousands), in virtual time (10 ms one way). Then iterative lookups of random IDs from random
nodes: mean rounds (hops), FIND messages per lookup, and top-1 / top-k agreement with brute
force; also join messages per node and the build's wall and CPU seconds. With
``--sim-budget``, sizes whose build would not fit (extrapolated from the previous size) are
skipped and reported as such.

The last line is one JSON object: store_median_ms, store_p95_ms, get_median_ms, get_p95_ms,
gets_per_s, rss_mb_per_node, store_cpu_ms and get_cpu_ms (CPU time of the measuring
process per operation: a load-independent view when the machine is shared), nodes, procs, sim.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import trio
import trio.testing

from p2p.dht import DHT, DHTClock, DHTConfig, open_dht
from p2p.dht.ids import node_id, random_id
from p2p.dht.memnet import MemoryNetwork
from p2p.identity import Identity
from p2p.node import open_node


def _rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def _host(
    count: int, initial: list[str], config: DHTConfig, out: list[DHT], nursery: trio.Nursery
) -> None:
    """Start ``count`` nodes (8 joining at a time) in ``nursery``; they run until it ends."""

    async def run(init: list[str], task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with (
            open_node(Identity.generate()) as node,
            open_dht(node, initial_peers=init, config=config) as dht,
        ):
            task_status.started(dht)
            await trio.sleep_forever()

    if not initial:
        out.append(await nursery.start(run, []))
        initial = [str(out[0].node.addrs[0])]
        count -= 1
    for start in range(0, count, 8):
        async with trio.open_nursery() as batch:
            for _ in range(min(8, count - start)):
                batch.start_soon(_start_into, nursery, run, initial, out)


async def _start_into(nursery: trio.Nursery, run: Any, init: list[str], out: list[DHT]) -> None:
    out.append(await nursery.start(run, init))


# ---- serving processes ----------------------------------------------------------------------
async def _worker(count: int, initial: str) -> None:
    dhts: list[DHT] = []
    async with trio.open_nursery() as nursery:
        await _host(count, [initial], DHTConfig(), dhts, nursery)
        print("ready", flush=True)
        # serve until the parent closes our stdin
        await trio.to_thread.run_sync(sys.stdin.read)
        nursery.cancel_scope.cancel()


# ---- loopback measurement -------------------------------------------------------------------
async def _loopback(nodes: int, procs: int, ops: int) -> dict[str, float]:
    rng = random.Random(0)
    local_count = nodes - (procs - 1) * (nodes // procs)
    dhts: list[DHT] = []
    workers: list[subprocess.Popen] = []
    try:
        async with trio.open_nursery() as nursery:
            t0 = time.perf_counter()
            await _host(1, [], DHTConfig(), dhts, nursery)
            entry = str(dhts[0].node.addrs[0])
            for _ in range(procs - 1):
                workers.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "bench.dht",
                            "--worker",
                            str(nodes // procs),
                            "--initial-peers",
                            entry,
                        ],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            await _host(local_count - 1, [entry], DHTConfig(), dhts, nursery)
            for w in workers:
                line = await trio.to_thread.run_sync(w.stdout.readline)
                if line.strip() != "ready":
                    raise RuntimeError("a worker process failed to start its nodes")
            print(
                f"loopback: {nodes} nodes in {procs} processes up in "
                f"{time.perf_counter() - t0:.1f} s",
                flush=True,
            )
            # warm up: a few lookups from every local node open the connections a long-running
            # node would already have (handshakes are measured by bench.transport, not here)
            async with trio.open_nursery() as warm:
                for d in dhts:
                    for _ in range(3):
                        warm.start_soon(d.find_nearest, random_id(rng=rng))
            await trio.sleep(1)

            values = {
                f"bench/{i}": {"peer": i, "samples": i * 37, "blob": os.urandom(64)}
                for i in range(ops)
            }
            store_ms, get_ms = [], []
            cpu0 = time.process_time()
            for key, value in values.items():
                d = rng.choice(dhts)
                t = time.perf_counter()
                res = await d.store(key, value, d.now() + 600)
                store_ms.append((time.perf_counter() - t) * 1000)
                assert res.ok
            store_cpu = (time.process_time() - cpu0) * 1000 / len(values)
            misses = 0
            cpu0 = time.process_time()
            for key, value in values.items():
                d = rng.choice(dhts)
                t = time.perf_counter()
                got = await d.get(key)
                get_ms.append((time.perf_counter() - t) * 1000)
                misses += got is None or got.value != value
            get_cpu = (time.process_time() - cpu0) * 1000 / len(values)
            one = dhts[-1]
            keys = list(values) * 2
            sem = trio.Semaphore(16)

            async def get_one(key: str) -> None:
                async with sem:
                    await one.get(key)

            t = time.perf_counter()
            async with trio.open_nursery() as gets:
                for key in keys:
                    gets.start_soon(get_one, key)
            gets_per_s = len(keys) / (time.perf_counter() - t)
            rss = _rss_mb() + sum(_rss_mb(w.pid) for w in workers)
            nursery.cancel_scope.cancel()
    finally:
        for w in workers:
            if w.stdin:
                w.stdin.close()
            try:
                w.wait(15)
            except subprocess.TimeoutExpired:
                w.kill()
    return {
        "store_median_ms": statistics.median(store_ms),
        "store_p95_ms": _pct(store_ms, 0.95),
        "get_median_ms": statistics.median(get_ms),
        "get_p95_ms": _pct(get_ms, 0.95),
        "gets_per_s": gets_per_s,
        "rss_mb_per_node": rss / nodes,
        "store_cpu_ms": store_cpu,
        "get_cpu_ms": get_cpu,
        "get_misses": misses,
    }


# ---- simulation -----------------------------------------------------------------------------
@contextmanager
def _gc_paused() -> Iterator[None]:
    """No garbage collection while thousands of nodes are built: the build makes next to no
    cyclic garbage (a few dozen objects found in a 600-node one), yet every collector pass
    would scan all the nodes built so far. On exit what was built is frozen, so that later
    passes skip it too (the nodes live to the end; ``gc.unfreeze()`` hands them back)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


async def _sim(n: int, lookups: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    net = MemoryNetwork(latency=0.01)
    cfg = DHTConfig.fast().replace(
        refresh_interval=1e9, republish_interval=1e9, maintenance_interval=1e9
    )
    dhts: list[DHT] = []
    async with trio.open_nursery() as nursery:

        async def run(i: int, init: list[str], task_status=trio.TASK_STATUS_IGNORED) -> None:
            node = net.add_node(Identity.from_seed(f"bench-sim/{seed}/{i}".encode()))
            async with open_dht(
                node, initial_peers=init, config=cfg, clock=DHTClock(trio.current_time)
            ) as dht:
                task_status.started(dht)
                await trio.sleep_forever()

        t0, cpu0 = time.perf_counter(), time.process_time()
        with _gc_paused():
            dhts.append(await nursery.start(run, 0, []))
            for start in range(1, n, 16):
                joined: dict[int, DHT] = {}

                async def join(i: int, joined: dict[int, DHT]) -> None:
                    init = [str(rng.choice(dhts).node.addrs[0])]
                    joined[i] = await nursery.start(run, i, init)

                async with trio.open_nursery() as batch:
                    for i in range(start, min(n, start + 16)):
                        batch.start_soon(join, i, joined)
                dhts.extend(joined[i] for i in sorted(joined))
        build_s = time.perf_counter() - t0
        build_cpu_s = time.process_time() - cpu0
        build_calls = net.calls
        ids = [d.peer_id for d in dhts]
        k = cfg.k
        rounds, messages, top1, overlap = [], [], [], []
        for _ in range(lookups):
            d = rng.choice(dhts)
            target = random_id(rng=rng)
            res = await d.find_nearest(target)
            truth = sorted((p for p in ids if p != d.peer_id), key=lambda p: node_id(p) ^ target)
            got = [c.peer for c in res.nearest]
            rounds.append(res.rounds)
            messages.append(res.messages)
            top1.append(got[:1] == truth[:1])
            overlap.append(len(set(got) & set(truth[:k])) / k)
        nursery.cancel_scope.cancel()
    gc.unfreeze()
    return {
        "rounds": statistics.mean(rounds),
        "messages": statistics.mean(messages),
        "top1": statistics.mean(top1),
        "overlap": statistics.mean(overlap),
        "join_messages": build_calls / n,
        "build_s": build_s,
        "build_cpu_s": build_cpu_s,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.dht")
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--ops", type=int, default=100)
    p.add_argument("--sim-sizes", default="100,1000,5000")
    p.add_argument("--sim-lookups", type=int, default=100)
    p.add_argument(
        "--sim-budget",
        type=float,
        default=None,
        help="skip sim sizes whose build would take longer than this many seconds in all",
    )
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--initial-peers", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        trio.run(_worker, args.worker, args.initial_peers)
        return

    loop = trio.run(_loopback, args.nodes, args.procs, args.ops)
    print(
        f"loopback store: median {loop['store_median_ms']:.1f} ms, "
        f"p95 {loop['store_p95_ms']:.1f} ms"
    )
    print(
        f"loopback get:   median {loop['get_median_ms']:.1f} ms, p95 {loop['get_p95_ms']:.1f} ms"
        f" ({loop['get_misses']} misses)"
    )
    print(f"loopback gets/s from one node (16 in flight): {loop['gets_per_s']:.0f}")
    print(f"RSS per node: {loop['rss_mb_per_node']:.1f} MB")
    print(
        f"CPU of this process per op (its nodes serve ~1/{args.procs} of the requests): "
        f"store {loop['store_cpu_ms']:.1f} ms, get {loop['get_cpu_ms']:.1f} ms"
    )

    sim: dict[str, Any] = {}
    spent = 0.0
    last: tuple[int, float] | None = None
    for n in (int(x) for x in args.sim_sizes.split(",") if x):
        if last is not None and args.sim_budget is not None:
            projected = last[1] * n / last[0] * 1.2
            if spent + projected > args.sim_budget:
                sim[str(n)] = {"skipped": f"projected build {projected:.0f} s exceeds budget"}
                print(
                    f"sim N={n}: skipped (projected {projected:.0f} s, budget "
                    f"{args.sim_budget:.0f} s, {spent:.0f} s spent)",
                    flush=True,
                )
                continue
        fig = trio.run(
            _sim, n, args.sim_lookups, n, clock=trio.testing.MockClock(autojump_threshold=0)
        )
        spent += fig["build_s"]
        last = (n, fig["build_s"])
        sim[str(n)] = {k: round(v, 3) for k, v in fig.items()}
        print(
            f"sim N={n}: rounds {fig['rounds']:.2f}, messages/lookup {fig['messages']:.1f}, "
            f"top-1 {fig['top1']:.2f}, top-k overlap {fig['overlap']:.3f}, "
            f"join msgs/node {fig['join_messages']:.1f}, build {fig['build_s']:.0f} s "
            f"({fig['build_cpu_s']:.0f} s CPU)",
            flush=True,
        )
    out = {k: round(v, 2) for k, v in loop.items()}
    out.update(nodes=args.nodes, procs=args.procs, sim=sim)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
