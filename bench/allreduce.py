"""Butterfly all-reduce benchmark: N peer processes on loopback, vs plain sockets.

    python -m bench.allreduce --peers 4 --size 18000000 [--clients K] [--codec C] [--rounds R]
    python -m bench.allreduce --sim-hetero [--size S] [--codec C]

Each peer process runs a node (secure channel + mux) and averages S float32 values (peer i's
vector is seeded by i, weight i + 1). In the same run, the same peers move the same per-peer
traffic pattern over plain TCP (no encryption, no framing): each sender sends every reducer its
slice of that reducer's share and gets the same number of bytes back. Prints per-round times
and, as the last line, a JSON object with ``seconds`` (median of the complete rounds: every
peer got a result that includes every sender), ``complete_rounds`` of ``rounds``,
``socket_seconds`` (median plain-socket round), ``cpu_seconds`` / ``socket_cpu_seconds`` (median
CPU time of a round, all peers together: a figure the machine's other load hardly moves),
``max_abs_error`` (vs the float64 weighted mean), ``identical`` (all peers hold the same bits),
``peak_rss_mb`` (per peer process, its high-water mark over the rounds: the node, its vector,
the results and whatever the rounds held) and ``rss_before_rounds_mb``.

``--sim-hetero`` runs the simulator instead: four nodes with 10/25/50/100 Mbit/s uplinks (and
100 Mbit/s downlinks), comparing the round's virtual time with the LP bound and with an equal
split of the same vector.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np


def _vector(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(1000 + i).standard_normal(size, dtype=np.float32)


# ---- worker process -------------------------------------------------------------------------


def _worker(
    index: int,
    size: int,
    mode: str,
    codec_name: str,
    rounds: int,
    conn: Any,
    defences: bool = False,
) -> None:
    import trio

    from dedloc_jax.averaging import (
        AllReduceConfig,
        AllReduceError,
        AveragingService,
        GroupSpec,
        all_reduce,
        get_codec,
    )
    from p2p.identity import Identity, PeerID
    from p2p.node import NodeConfig, open_node

    vec = _vector(index, size)
    weight = float(index + 1)
    codec = get_codec(codec_name)

    async def serve_plain(stream: trio.SocketStream) -> None:
        # reducer side of the plain-socket pattern: read the part, send as many bytes back
        header = await _read_exactly(stream, 8)
        n = int.from_bytes(header, "little")
        buf = await _read_exactly(stream, n)
        await stream.send_all(buf)
        await stream.aclose()

    async def plain_round(targets: list[tuple[int, int]]) -> None:
        async def one(port: int, n: int) -> None:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            payload = bytes(n)
            await stream.send_all(n.to_bytes(8, "little") + payload)
            await _read_exactly(stream, n)
            await stream.aclose()

        async with trio.open_nursery() as nursery:
            for port, n in targets:
                nursery.start_soon(one, port, n)

    async def recv() -> Any:
        # the pipe blocks: wait in a worker thread so this peer keeps serving the others
        return await trio.to_thread.run_sync(conn.recv)

    async def main() -> None:
        identity = Identity.from_seed(f"bench-allreduce/{index}".encode())
        config = AllReduceConfig.loopback()
        if defences:  # an open run's: CenteredClip (derived radius) and verified results
            config = config.replace(robust=True, verify=True)
        async with (
            open_node(identity, config=NodeConfig.bulk()) as node,
            trio.open_nursery() as nursery,
        ):
            service = AveragingService(node, config)
            serve = partial(trio.serve_tcp, serve_plain, 0, host="127.0.0.1")
            listeners = await nursery.start(serve)
            plain_port = listeners[0].socket.getsockname()[1]
            conn.send((str(node.peer_id), [str(a) for a in node.addrs], plain_port))
            spec_bytes, addrs, plain_ports = await recv()
            spec = GroupSpec.from_bytes(spec_bytes)
            for pid, pa in addrs.items():
                if pid != str(node.peer_id):
                    node.peerstore.add_addrs(PeerID.from_base58(pid), pa)
            me = spec.index_of(node.peer_id)
            targets = []
            if spec.members[me].sends:
                for j in range(len(spec.members)):
                    nbytes = _my_part(spec, size, codec, j)
                    if j != me and nbytes:
                        targets.append((plain_ports[j], nbytes))
            senders = frozenset(m.peer_id for m in spec.members if m.sends)
            times, plain_times, cpu, plain_cpu, complete = [], [], [], [], []
            result = None
            base = _rss_mb("VmRSS")
            _reset_peak_rss()
            for r in range(rounds):
                await recv()  # barrier: plain-socket round
                t0, c0 = time.perf_counter(), time.process_time()
                await plain_round(targets)
                plain_times.append(time.perf_counter() - t0)
                plain_cpu.append(time.process_time() - c0)
                conn.send("plain-done")
                await recv()  # barrier: all-reduce round
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    out = await all_reduce(
                        service,
                        spec,
                        {"g": vec},
                        weight,
                        codec=codec,
                        timeout=300,
                        round_id=f"bench/{r}".encode(),
                        config=config,
                    )
                except AllReduceError as e:
                    print(f"peer {index} round {r}: {e!r}", file=sys.stderr)
                    out = None
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                complete.append(
                    out is not None and all(c == senders for c in out.contributors)
                    if spec.members[me].sends
                    else True
                )
                result = out if out is not None else result
                del out
                conn.send("round-done")
            peak = _rss_mb("VmHWM")  # the rounds' high-water mark (reset after start-up)
            await recv()
            digest, err = None, None
            if result is not None and result.vector is not None:
                digest = hashlib.sha256(result.vector.tobytes()).hexdigest()
                want = np.zeros(size, np.float64)
                total = 0.0
                for i, m in enumerate(spec.members):
                    if m.sends:
                        want += _vector(i, size).astype(np.float64) * (i + 1)
                        total += i + 1
                err = float(np.max(np.abs(result.vector - want / total)))
            conn.send((times, plain_times, digest, err, peak, base, cpu, plain_cpu, complete))
            nursery.cancel_scope.cancel()

    prof_dir = os.environ.get("BENCH_PROFILE")  # a folder: one cProfile dump per peer and mode
    if prof_dir:
        import cProfile

        cProfile.runctx(
            "trio.run(main)",
            globals(),
            {"trio": trio, "main": main},
            f"{prof_dir}/peer{index}-{'defended' if defences else 'plain'}.prof",
        )
    else:
        trio.run(main)


def _rss_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (high-water mark) of this process in MiB (Linux); else
    the peak that ``getrusage`` reports."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak_rss() -> None:
    """Start ``VmHWM`` afresh (Linux: "5" to clear_refs), so the peak covers only the rounds,
    not start-up or the float64 check of the result after them."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _my_part(spec: Any, size: int, codec: Any, j: int) -> int:
    """Bytes a sender sends reducer ``j`` (and gets back) in the butterfly."""
    from dedloc_jax.averaging.partition import chunk_bounds, share_bounds

    bounds = share_bounds(size, spec.share_parts())
    n = bounds[j + 1] - bounds[j]
    return sum(codec.encoded_size(b - a) for a, b in chunk_bounds(n, 1 << 18))


async def _read_exactly(stream: Any, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = await stream.receive_some(min(1 << 20, n - len(buf)))
        if not data:
            raise EOFError("peer closed early")
        buf += data
    return bytes(buf)


def run_loopback(
    peers: int,
    size: int,
    clients: int,
    codec: str,
    rounds: int,
    between: Callable[[int], None] | None = None,
    defences: bool = False,
) -> dict:
    """``between(r)``, if given, runs after round ``r`` while the peers wait (another system's
    round, measured under the same load: bench.compare_hivemind)."""
    from dedloc_jax.averaging import GroupSpec, Member

    ctx = mp.get_context("spawn")
    modes = ["node"] * (peers - clients) + ["client"] * clients
    pipes, procs = [], []
    for i in range(peers):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(i, size, modes[i], codec, rounds, child, defences))
        p.start()
        pipes.append(parent)
        procs.append(p)
    try:
        hellos = [p.recv() for p in pipes]
        members = tuple(Member(pid, mode) for (pid, _, _), mode in zip(hellos, modes, strict=True))
        spec = GroupSpec(members, b"bench-allreduce").with_parts()
        addrs = {pid: a for pid, a, _ in hellos}
        plain_ports = [port for _, _, port in hellos]
        for p in pipes:
            p.send((spec.to_bytes(), addrs, plain_ports))
        for r in range(rounds):
            for p in pipes:
                p.send("go-plain")
            for p in pipes:
                p.recv()
            for p in pipes:
                p.send("go")
            for p in pipes:
                p.recv()
            print(f"round {r + 1}/{rounds} done", file=sys.stderr)
            if between is not None:
                between(r)
        for p in pipes:
            p.send("report")
        reports = [p.recv() for p in pipes]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    per_round = [max(rep[0][r] for rep in reports) for r in range(rounds)]
    per_plain = [max(rep[1][r] for rep in reports) for r in range(rounds)]
    cpu = [sum(rep[6][r] for rep in reports) for r in range(rounds)]
    plain_cpu = [sum(rep[7][r] for rep in reports) for r in range(rounds)]
    complete = [all(rep[8][r] for rep in reports) for r in range(rounds)]
    digests = {rep[2] for rep in reports if rep[2] is not None}
    errors = [rep[3] for rep in reports if rep[3] is not None]
    for r in range(rounds):
        print(
            f"round {r + 1}: all-reduce {per_round[r]:.3f} s ({cpu[r]:.2f} CPU-s, "
            f"{'complete' if complete[r] else 'INCOMPLETE'}), plain sockets {per_plain[r]:.3f} s "
            f"({plain_cpu[r]:.2f} CPU-s)"
        )
    done = [r for r in range(rounds) if complete[r]]
    seconds = statistics.median(per_round[r] for r in done) if done else None
    socket_seconds = statistics.median(per_plain)
    return {
        "peers": peers,
        "clients": clients,
        "size": size,
        "codec": codec,
        "rounds": rounds,
        "complete_rounds": len(done),
        "seconds": seconds,
        "socket_seconds": socket_seconds,
        "ratio": seconds / socket_seconds if seconds is not None else None,
        "cpu_seconds": statistics.median(cpu[r] for r in done) if done else None,
        "socket_cpu_seconds": statistics.median(plain_cpu),
        "max_abs_error": max(errors) if errors else None,
        "identical": len(digests) == 1,
        # per peer process, MiB: the high-water mark over the rounds (start-up excluded)
        "peak_rss_mb": [round(rep[4], 1) for rep in reports],
        "rss_before_rounds_mb": [round(rep[5], 1) for rep in reports],
    }


# ---- simulator: heterogeneous links ---------------------------------------------------------


def _sim_case(
    modes: list[str], links_mbit: list[tuple[float, float]], size: int, codec: str
) -> dict:
    """One heterogeneous simulated round with the LP's split and with an equal split."""
    import trio

    from dedloc_jax.averaging import (
        AllReduceConfig,
        AveragingService,
        GroupSpec,
        Member,
        all_reduce,
        get_codec,
        solve_shares,
    )
    from dedloc_jax.averaging.load_balancing import equal_split, predicted_time
    from dedloc_jax.averaging.partition import fractions_to_parts
    from p2p.sim import SimNetwork
    from p2p.testing import host_of, open_sim_nodes, run_sim

    mbit = 1e6 / 8
    links = [(u * mbit, d * mbit) for u, d in links_mbit]
    vectors = [_vector(i, size) for i in range(len(links))]
    wire_bytes = get_codec(codec).encoded_size(size)
    model = [
        Member(f"p{i}", m, u, d) for i, (m, (u, d)) in enumerate(zip(modes, links, strict=True))
    ]
    lp = solve_shares(model)
    splits = {"lp": lp.parts, "equal": fractions_to_parts(equal_split(model))}
    config = AllReduceConfig.internet().replace(chunk_elems=1 << 16)
    times: dict[str, float] = {}

    for label, parts in splits.items():

        async def main(parts: tuple[int, ...] = parts, label: str = label) -> None:
            net = SimNetwork(seed=0)
            async with open_sim_nodes(net, len(links)) as nodes:
                services = [AveragingService(node, config) for node in nodes]
                for node, mode, (up, down) in zip(nodes, modes, links, strict=True):
                    net.set_bandwidth(host_of(net, node), up, down)
                    host_of(net, node).reachable = mode != "client"
                    for other in nodes:
                        if other is not node:
                            node.peerstore.add_addrs(other.peer_id, other.addrs)
                spec = GroupSpec(
                    tuple(
                        Member(str(n.peer_id), m, u, d)
                        for n, m, (u, d) in zip(nodes, modes, links, strict=True)
                    ),
                    b"hetero",
                    parts,
                )
                t0 = trio.current_time()
                async with trio.open_nursery() as nursery:
                    for i, service in enumerate(services):
                        nursery.start_soon(
                            lambda service=service, i=i: all_reduce(
                                service,
                                spec,
                                {"g": vectors[i]},
                                1.0,
                                codec=codec,
                                timeout=3600,
                                config=config,
                            )
                        )
                times[label] = trio.current_time() - t0

        run_sim(main)
    bound = lp.lower_bound(wire_bytes)
    print(f"  members {list(zip(modes, links_mbit, strict=True))} (Mbit/s up, down)")
    print(f"  LP fractions {[round(f, 4) for f in lp.fractions]}")
    print(
        f"  LP split {times['lp']:.2f} s, equal split {times['equal']:.2f} s (virtual); "
        f"LP bound {bound:.2f} s, model time of the equal split "
        f"{predicted_time(model, equal_split(model), wire_bytes):.2f} s"
    )
    return {
        "seconds": times["lp"],
        "lp_bound_seconds": bound,
        "equal_split_seconds": times["equal"],
        "ratio_to_bound": times["lp"] / bound,
        "speedup_vs_equal": times["equal"] / times["lp"],
    }


def run_sim_hetero(size: int, codec: str) -> dict:
    """Two cases: four nodes with 10/25/50/100 Mbit/s uplinks and 100 Mbit/s downlinks, and a
    mix of symmetric nodes, a client and a fast aux peer."""
    print("case 1: asymmetric home links")
    first = _sim_case(["node"] * 4, [(10, 100), (25, 100), (50, 100), (100, 100)], size, codec)
    print("case 2: nodes 25/50/100 symmetric, client 50/50, aux 200/200")
    mixed = _sim_case(
        ["node", "node", "node", "client", "aux"],
        [(25, 25), (50, 50), (100, 100), (50, 50), (200, 200)],
        size,
        codec,
    )
    return {
        "sim_hetero": True,
        "uplinks_mbit": [10, 25, 50, 100],
        "size": size,
        "codec": codec,
        **first,
        "mixed": mixed,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--size", type=int, default=None, help="float32 values per peer")
    ap.add_argument("--clients", type=int, default=0)
    ap.add_argument("--codec", default="none", choices=["none", "fp16", "bf16", "int8"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sim-hetero", action="store_true")
    ap.add_argument(
        "--defences",
        action="store_true",
        help="also run with an open run's defences (CenteredClip, verified rounds) and print "
        "their cost: seconds_ratio, cpu_ratio (defended / plain)",
    )
    args = ap.parse_args(argv)
    if args.sim_hetero:
        result = run_sim_hetero(args.size or 2_000_000, args.codec)
    else:
        if not 0 <= args.clients < args.peers:
            ap.error("--clients must leave at least one node")
        result = run_loopback(
            args.peers, args.size or 18_000_000, args.clients, args.codec, args.rounds
        )
        if args.defences:
            defended = run_loopback(
                args.peers,
                args.size or 18_000_000,
                args.clients,
                args.codec,
                args.rounds,
                defences=True,
            )
            result = {
                "plain": result,
                "defended": defended,
                "seconds_ratio": defended["seconds"] / result["seconds"],
                "cpu_ratio": defended["cpu_seconds"] / result["cpu_seconds"],
            }
            print(
                f"defences' cost: {result['seconds_ratio']:.3f}x the round time, "
                f"{result['cpu_ratio']:.3f}x its CPU"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
