"""Butterfly all-reduce over real, tbf-shaped links: LP split vs the LP bound vs an equal split.

    sudo python -m bench.allreduce_netns [--uplinks 10,25,50,100] [--downlink 100]
                                         [--modes node,node,node,node]
                                         [--size 2000000] [--rounds 2] [--codec none]

Each peer is a process in its own network namespace (see :mod:`bench.netns_lab`), attached to
one bridge; its uplink is shaped with tbf to the given rate, and its downlink to ``--downlink``
Mbit/s (one rate or one per peer; 0 leaves a downlink unshaped, given to the LP as infinite).
``--modes`` makes peers clients (send only) or aux peers (reduce only). The LP is given exactly the
shaped rates (tbf delivers ~96-97% of them as TCP goodput, so the bound is slightly optimistic).
Rounds alternate between the LP's split and an equal split in the same run, with the same
vectors (S float32 values per peer, peer i weighted i + 1). A round's time is the slowest peer's
time from a common start signal to its result. Prints per-round figures and, as the last line,
a JSON object with ``lp_seconds`` and ``equal_seconds`` (medians), ``lp_bound_seconds``,
``lp_vs_bound`` (lp_seconds / bound) and ``equal_vs_lp`` (equal_seconds / lp_seconds), plus
``identical`` and ``max_abs_error`` over every round.

``--measured`` types no rate in: peers probe their links as they join, warm-up rounds feed
their meters, and the LP gets the measured figures; the JSON has ``measured_up_mbps``,
``measured_down_mbps``, ``true_up_mbps``, ``true_down_mbps``, ``round_s`` (median, measured
split), ``lp_bound_s`` (from the true rates) and ``equal_split_s``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.netns_lab import ShapedLab, enter_namespace, peer_ip, unavailable_reason

MBIT = 1e6 / 8  # bytes/s per Mbit/s


def _vector(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(2000 + i).standard_normal(size, dtype=np.float32)


# ---- worker process (inside its namespace) --------------------------------------------------


def _worker(index: int, ns: str, mode: str, size: int, codec_name: str, conn: Any) -> None:
    enter_namespace(ns)  # first, while this process has one thread: later threads inherit it

    import trio

    from dedloc_jax.averaging import (
        AllReduceConfig,
        AveragingService,
        BandwidthMeter,
        GroupSpec,
        LinkLocks,
        all_reduce,
        get_codec,
        install_probe,
        measure_links,
    )
    from p2p.identity import Identity, PeerID
    from p2p.node import NodeConfig, open_node

    meter = BandwidthMeter()
    vec = _vector(index, size)
    weight = _weight(index, mode)
    codec = get_codec(codec_name)
    config = AllReduceConfig.internet()

    async def recv() -> Any:
        # the pipe blocks: wait in a worker thread so this peer keeps serving the others
        return await trio.to_thread.run_sync(conn.recv)

    async def main() -> None:
        identity = Identity.from_seed(f"bench-allreduce-netns/{index}".encode())
        listen = [f"/ip4/{peer_ip(index)}/tcp/0"]
        async with open_node(identity, listen=listen, config=NodeConfig.bulk()) as node:
            service = AveragingService(node, config)
            locks = LinkLocks()
            install_probe(node, locks)
            conn.send((str(node.peer_id), [str(a) for a in node.addrs]))
            addrs = await recv()
            for pid, pa in addrs.items():
                if pid != str(node.peer_id):
                    node.peerstore.add_addrs(PeerID.from_base58(pid), pa)
            while True:
                msg = await recv()
                if msg == "quit":
                    return
                if msg[0] == "probe":  # measure our links against these peers, best first
                    partners = [PeerID.from_base58(p) for p in msg[1]]
                    await measure_links(node, partners, meter, locks=locks)
                    conn.send(tuple(meter.figures()))
                    continue
                if msg[0] == "figures":
                    conn.send(tuple(meter.figures()))
                    continue
                spec_bytes, round_id, timeout, length = msg
                spec = GroupSpec.from_bytes(spec_bytes)
                t0 = time.perf_counter()
                result = await all_reduce(
                    service,
                    spec,
                    {"g": vec[:length]},
                    weight,
                    codec=codec,
                    timeout=timeout,
                    round_id=round_id,
                    config=config,
                    meter=meter,
                )
                elapsed = time.perf_counter() - t0
                if result.vector is None:  # an aux peer: it reduced, it holds no result
                    conn.send((elapsed, None, None))
                    continue
                digest = hashlib.sha256(result.vector.tobytes()).hexdigest()
                conn.send((elapsed, digest, result.vector[:: max(1, length // 4096)].copy()))

    trio.run(main)


# ---- driver ---------------------------------------------------------------------------------


def _weight(index: int, mode: str) -> float:
    return 0.0 if mode == "aux" else float(index + 1)


def _expected_sample(modes: Sequence[str], size: int) -> np.ndarray:
    """Every (size // 4096)-th value of the weighted mean of the senders' vectors (float64)."""
    step = max(1, size // 4096)
    total = np.zeros(len(range(0, size, step)), np.float64)
    weights = [_weight(i, m) for i, m in enumerate(modes)]
    for i, w in enumerate(weights):
        if w:
            total += _vector(i, size)[::step].astype(np.float64) * w
    return total / sum(weights)


def run_netns(
    uplinks_mbit: Sequence[float],
    downlink_mbit: float | Sequence[float | None] | None,
    size: int,
    rounds: int,
    codec: str = "none",
    modes: Sequence[str] | None = None,
) -> dict:
    """Start the lab and the peers, run ``rounds`` LP and ``rounds`` equal-split rounds.

    ``downlink_mbit``: one rate for every peer or one per peer; None (or 0) leaves a downlink
    unshaped. ``modes``: "node" (default), "client" or "aux" per peer.
    """
    from dedloc_jax.averaging import GroupSpec, Member, get_codec, solve_shares
    from dedloc_jax.averaging.load_balancing import equal_split, predicted_time
    from dedloc_jax.averaging.partition import fractions_to_parts

    n = len(uplinks_mbit)
    uplinks = [float(u) for u in uplinks_mbit]
    if downlink_mbit is None or isinstance(downlink_mbit, int | float):
        downlinks = [downlink_mbit or None] * n
    else:
        downlinks = [d or None for d in downlink_mbit]
    modes = list(modes or ["node"] * n)
    if len(downlinks) != n or len(modes) != n:
        raise ValueError("one downlink and one mode per uplink")
    wire_bytes = get_codec(codec).encoded_size(size)
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    pipes: list[Any] = []
    with ShapedLab(uplinks, downlinks) as lab:
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker, args=(i, lab.host(i), modes[i], size, codec, child))
                p.start()
                procs.append(p)
                pipes.append(parent)
            hellos = [_recv(p, procs, 120) for p in pipes]
            addrs = dict(hellos)
            for p in pipes:
                p.send(addrs)
            members = tuple(
                Member(
                    pid,
                    modes[i],  # type: ignore[arg-type]
                    uplinks[i] * MBIT,
                    downlinks[i] * MBIT if downlinks[i] else float("inf"),  # type: ignore[operator]
                    _weight(i, modes[i]),
                )
                for i, (pid, _) in enumerate(hellos)
            )
            lp = solve_shares(members)
            equal = equal_split(members)
            specs = {
                "lp": GroupSpec(members, b"netns-lp", lp.parts),
                "equal": GroupSpec(members, b"netns-equal", fractions_to_parts(equal)),
            }
            bound = lp.lower_bound(wire_bytes)
            timeout = 30 * bound + 120
            print(f"modes {modes}")
            print(f"uplinks {uplinks} Mbit/s, downlinks {[d or 'unshaped' for d in downlinks]}")
            print(f"LP fractions {[round(f, 4) for f in lp.fractions]}; bound {bound:.2f} s")
            print(f"equal split: model time {predicted_time(members, equal, wire_bytes):.2f} s")
            # warm-up: connections are dialed and TCP windows opened before anything is timed
            # (a collaboration reuses its connections round after round)
            warm = min(size, 1 << 18)
            for p in pipes:
                p.send((specs["lp"].to_bytes(), b"warm-up", timeout, warm))
            warm_s = max(_recv(p, procs, timeout + 60)[0] for p in pipes)
            print(f"warm-up round ({warm} values): {warm_s:.2f} s")
            times: dict[str, list[float]] = {"lp": [], "equal": []}
            identical = True
            err = 0.0
            want = _expected_sample(modes, size)
            for r in range(rounds):
                for label in ("lp", "equal"):
                    for p in pipes:
                        p.send((specs[label].to_bytes(), f"{label}/{r}".encode(), timeout, size))
                    reports = [_recv(p, procs, timeout + 60) for p in pipes]
                    seconds = max(rep[0] for rep in reports)
                    times[label].append(seconds)
                    all_reports = reports
                    reports = [rep for rep in reports if rep[1] is not None]
                    round_digests = {rep[1] for rep in reports}
                    identical = identical and len(round_digests) == 1
                    err = max(err, max(float(np.max(np.abs(rep[2] - want))) for rep in reports))
                    print(
                        f"round {r + 1} {label:>5}: {seconds:.2f} s "
                        f"({seconds / bound:.3f} x bound), identical {len(round_digests) == 1}; "
                        f"per peer {[round(rep[0], 2) for rep in all_reports]}"
                    )
            _quit(pipes, procs)
        finally:
            _reap(procs)
    lp_s, eq_s = statistics.median(times["lp"]), statistics.median(times["equal"])
    print(
        f"LP split {lp_s:.2f} s = {lp_s / bound:.3f} x the LP bound {bound:.2f} s; "
        f"equal split {eq_s:.2f} s = {eq_s / lp_s:.3f} x the LP split"
    )
    return {
        "modes": modes,
        "uplinks_mbit": uplinks,
        "downlinks_mbit": downlinks,
        "size": size,
        "codec": codec,
        "rounds": rounds,
        "lp_fractions": list(lp.fractions),
        "lp_seconds": lp_s,
        "equal_seconds": eq_s,
        "lp_bound_seconds": bound,
        "lp_vs_bound": lp_s / bound,
        "equal_vs_lp": eq_s / lp_s,
        "lp_rounds": times["lp"],
        "equal_rounds": times["equal"],
        # in every round, every peer ended with the same bits
        "identical": identical,
        "max_abs_error": err,
    }


def run_measured(
    uplinks_mbit: Sequence[float],
    downlink_mbit: float,
    size: int,
    rounds: int,
    warmup: int = 2,
    codec: str = "none",
) -> dict:
    """The split from measured links only: peers probe as they join (partners with the widest
    published uplinks first), ``warmup`` rounds run on the figures so far (feeding the meters),
    then ``rounds`` timed rounds on the measured figures, and as many with an equal split."""
    from dedloc_jax.averaging import GroupSpec, Member, get_codec, solve_shares
    from dedloc_jax.averaging.load_balancing import equal_split
    from dedloc_jax.averaging.partition import fractions_to_parts

    n = len(uplinks_mbit)
    ups = [float(u) * MBIT for u in uplinks_mbit]
    downs = [float(downlink_mbit) * MBIT] * n
    wire_bytes = get_codec(codec).encoded_size(size)
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    pipes: list[Any] = []
    with ShapedLab(list(map(float, uplinks_mbit)), [float(downlink_mbit)] * n) as lab:
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker, args=(i, lab.host(i), "node", size, codec, child))
                p.start()
                procs.append(p)
                pipes.append(parent)
            hellos = [_recv(p, procs, 120) for p in pipes]
            for p in pipes:
                p.send(dict(hellos))
            pids = [pid for pid, _ in hellos]
            true = tuple(Member(pids[i], "node", ups[i], downs[i], i + 1.0) for i in range(n))
            bound = solve_shares(true).lower_bound(wire_bytes)
            figures: list[Any] = [(None, None, 0.0, 0.0)] * n
            for i in range(n):  # one joins after the other, as in a run
                others = sorted(
                    (j for j in range(n) if j != i), key=lambda j: -(figures[j][0] or 0)
                )
                pipes[i].send(("probe", [pids[j] for j in others]))
                figures[i] = _recv(pipes[i], procs, 300)
                print(f"peer {i} probed: up {_mbit(figures[i][0])}, down {_mbit(figures[i][1])}")

            def measured() -> tuple[Member, ...]:
                for p in pipes:
                    p.send(("figures",))
                got = [_recv(p, procs, 60) for p in pipes]
                return tuple(
                    Member(pids[i], "node", g[0], g[1], i + 1.0) for i, g in enumerate(got)
                )

            timeout = 30 * bound + 120

            def one_round(spec: Any, label: str) -> float:
                for p in pipes:
                    p.send((spec.to_bytes(), label.encode(), timeout, size))
                return max(_recv(p, procs, timeout + 60)[0] for p in pipes)

            for r in range(warmup):
                members = measured()
                spec = GroupSpec(members, f"warm/{r}".encode(), solve_shares(members).parts)
                print(f"warm-up round {r + 1}: {one_round(spec, f'warm/{r}'):.2f} s")
            members = measured()
            lp = solve_shares(members)
            equal = GroupSpec(true, b"equal", fractions_to_parts(equal_split(true)))
            times, equal_times = [], []
            for r in range(rounds):
                times.append(one_round(GroupSpec(members, b"measured", lp.parts), f"m/{r}"))
                equal_times.append(one_round(equal, f"e/{r}"))
                print(
                    f"round {r + 1}: measured split {times[-1]:.2f} s, "
                    f"equal {equal_times[-1]:.2f} s"
                )
            _quit(pipes, procs)
        finally:
            _reap(procs)
    round_s = statistics.median(times)
    print(f"measured split {round_s:.2f} s = {round_s / bound:.3f} x the LP bound {bound:.2f} s")
    return {
        "size": size,
        "codec": codec,
        "lp_fractions": list(lp.fractions),
        "measured_up_mbps": [round(m.upload_bps / MBIT, 2) for m in members],
        "measured_down_mbps": [round(m.download_bps / MBIT, 2) for m in members],
        "true_up_mbps": [float(u) for u in uplinks_mbit],
        "true_down_mbps": [float(downlink_mbit)] * n,
        "round_s": round_s,
        "lp_bound_s": bound,
        "round_vs_bound": round_s / bound,
        "equal_split_s": statistics.median(equal_times),
    }


def _quit(pipes: list[Any], procs: list[Any]) -> None:
    """Ask every peer process to end, and wait for it (a bounded while)."""
    for p in pipes:
        p.send("quit")
    for p in procs:
        p.join(timeout=30)


def _reap(procs: list[Any]) -> None:
    """Kill whatever peer process is still alive (a round that failed, an interrupt)."""
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=10)


def _mbit(bps: float | None) -> str:
    return "none" if bps is None else f"{bps / MBIT:.1f} Mbit/s"


def _recv(pipe: Any, procs: list[Any], timeout: float) -> Any:
    """A message from a peer, or a clear error when a peer died or took too long."""
    if not pipe.poll(timeout):
        dead = [i for i, p in enumerate(procs) if not p.is_alive()]
        raise RuntimeError(f"no answer from a peer within {timeout:.0f} s (dead peers: {dead})")
    return pipe.recv()


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through the finally blocks that tear the lab down


def _numbers(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--uplinks", default="10,25,50,100", help="Mbit/s, one per peer")
    ap.add_argument(
        "--downlink", default="100", help="Mbit/s, one for all or one per peer; 0 = unshaped"
    )
    ap.add_argument("--modes", default=None, help="node/client/aux per peer (default: all node)")
    ap.add_argument("--size", type=int, default=2_000_000, help="float32 values per peer")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each split")
    ap.add_argument("--codec", default="none", choices=["none", "fp16", "bf16", "int8"])
    ap.add_argument(
        "--measured",
        action="store_true",
        help="no rates typed in: peers probe and measure their links, the LP gets the figures",
    )
    ap.add_argument("--warmup", type=int, default=2, help="--measured: rounds before timing")
    args = ap.parse_args(argv)
    try:
        uplinks = _numbers(args.uplinks)
        downlinks = _numbers(args.downlink)
    except ValueError:
        ap.error("--uplinks and --downlink must be comma-separated numbers")
    n = len(uplinks)
    if len(downlinks) == 1:
        downlinks *= n
    modes = args.modes.split(",") if args.modes else ["node"] * n
    if n < 2 or min(uplinks) <= 0 or min(downlinks) < 0 or args.rounds < 1 or args.size < 1:
        ap.error("need at least 2 positive uplinks, --rounds >= 1 and --size >= 1")
    if len(downlinks) != n or len(modes) != n:
        ap.error("--downlink and --modes need one value per uplink")
    if any(m not in ("node", "client", "aux") for m in modes):
        ap.error("--modes: each one of node, client, aux")
    reason = unavailable_reason("tc")
    if reason is not None:
        sys.exit(f"bench.allreduce_netns cannot run: {reason}")
    signal.signal(signal.SIGTERM, _terminate)
    if args.measured:
        if len(set(downlinks)) != 1 or not downlinks[0] or args.modes:
            ap.error("--measured: one shaped downlink for all, every peer a node")
        try:
            result = run_measured(
                uplinks, downlinks[0], args.size, args.rounds, args.warmup, args.codec
            )
        except KeyboardInterrupt:
            sys.exit("interrupted: peers stopped, namespaces deleted")
        print(json.dumps(result))
        return
    try:
        result = run_netns(
            uplinks, [d or None for d in downlinks], args.size, args.rounds, args.codec, modes
        )
    except KeyboardInterrupt:
        sys.exit("interrupted: peers stopped, namespaces deleted")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
