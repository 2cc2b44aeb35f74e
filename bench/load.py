"""Load: a DHT node that is also a relay, under a bounded flood, keeps answering honest peers.

Run ``python -m bench.load [--flood-seconds 20] [--workers 16]``. Three processes on loopback
(multiprocessing spawn): the *target* (a node with a DHT and a relay service), a *flooder*
(opens and drops raw and handshaked connections, sends garbage, and fires many concurrent
RPCs and streams at the DHT and relay handlers, most of them invalid) and an *honest* client
that pings and queries the target's DHT every 50 ms throughout. Phases: a quiet baseline, the
flood, a quiet tail. Everything stops by itself.

Figures: flood requests/s answered (and connections/s), honest p50/p99 latency before and
during the flood, honest failures, the target's RSS (VmRSS) before, right after and after the
tail. The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np
import trio

from p2p.dht import DHTConfig, open_dht
from p2p.dht import wire as dht_wire
from p2p.errors import P2PError
from p2p.identity import Identity
from p2p.multiaddr import Multiaddr
from p2p.nat import RelayConfig, RelayService
from p2p.node import NodeConfig, open_node
from p2p.secure import secure_outbound

HONEST_PERIOD = 0.05


def random_object(rng: np.random.Generator, depth: int = 0) -> Any:
    """A random msgpack-able value (the flood's junk requests; no JAX import in this process)."""
    kind = int(rng.integers(0, 8 if depth < 3 else 5))
    if kind == 0:
        return None
    if kind == 1:
        return int(rng.integers(-(1 << 62), 1 << 62))
    if kind == 2:
        return float(rng.normal() * 1e6)
    if kind == 3:
        return rng.bytes(int(rng.integers(0, 64)))
    if kind == 4:
        return "x" * int(rng.integers(0, 40))
    if kind in (5, 6):
        return [random_object(rng, depth + 1) for _ in range(int(rng.integers(0, 5)))]
    keys = ("client", "addrs", "queries", "records", "target", "ttl", "t")
    return {keys[int(rng.integers(0, len(keys)))]: random_object(rng, depth + 1) for _ in range(3)}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


# ---- target -----------------------------------------------------------------------------------
def _target(addr_q: Any, stop: Any) -> None:
    logging.disable(logging.WARNING)  # every refused junk request logs; the counts say enough

    async def main() -> None:
        async with (
            open_node(Identity.from_seed(b"load-target")) as node,
            open_dht(node, config=DHTConfig.fast()),
        ):
            RelayService(node, RelayConfig()).register()
            addr_q.put(str(node.addrs[0]))
            while not stop.is_set():
                await trio.sleep(0.1)

    trio.run(main)


# ---- flooder ----------------------------------------------------------------------------------
def _flooder(addr: str, seconds: float, workers: int, out_q: Any) -> None:
    logging.disable(logging.WARNING)
    target = Multiaddr.parse(addr)
    rng = np.random.default_rng(1)
    counts = {"connections": 0, "requests": 0, "answered": 0, "refused": 0, "timeouts": 0}

    async def raw_churn(deadline: float) -> None:
        while trio.current_time() < deadline:
            try:
                stream = await trio.open_tcp_stream(target.host, target.port)
            except OSError:
                await trio.sleep(0.01)
                continue
            counts["connections"] += 1
            try:
                with trio.move_on_after(1):
                    if rng.random() < 0.5:
                        await stream.send_all(rng.bytes(int(rng.integers(1, 2000))))
                    else:
                        ch = await secure_outbound(stream, Identity.generate(), timeout=2)
                        await ch.send_frame(rng.bytes(int(rng.integers(0, 500))))
            except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            finally:
                await trio.aclose_forcefully(stream)

    async def rpc_flood(node: Any, deadline: float) -> None:
        names = (dht_wire.PING, dht_wire.FIND, dht_wire.STORE, "nope")
        while trio.current_time() < deadline:
            name = names[int(rng.integers(0, len(names)))]
            r = rng.random()
            if r < 0.4:
                request: Any = dht_wire.request(True, ())
                if name == dht_wire.FIND:
                    request["queries"] = [rng.bytes(32), "some-key"]
            else:
                request = random_object(rng)
            counts["requests"] += 1
            try:
                await node.call(target.peer_id, name, request, timeout=5)
                counts["answered"] += 1
            except P2PError as e:
                key = "timeouts" if "timed out" in str(e).lower() else "refused"
                counts[key] += 1

    async def stream_flood(node: Any, deadline: float) -> None:
        names = ("nat.relay.reserve", "nat.relay.hop")
        while trio.current_time() < deadline:
            counts["requests"] += 1
            with trio.move_on_after(2):
                try:
                    async with node.open_stream(
                        target.peer_id, names[int(rng.integers(0, 2))], timeout=2
                    ) as s:
                        await s.send(random_object(rng))
                        await s.receive()
                        counts["answered"] += 1
                except P2PError:
                    counts["refused"] += 1

    async def main() -> None:
        async with open_node(listen=[], config=NodeConfig.testing()) as node:
            node.peerstore.add_addrs(target.peer_id, [target])
            counts["start"] = time.time()
            deadline = trio.current_time() + seconds
            async with trio.open_nursery() as nursery:
                for _ in range(max(1, workers // 4)):
                    nursery.start_soon(raw_churn, deadline)
                    nursery.start_soon(stream_flood, node, deadline)
                for _ in range(workers):
                    nursery.start_soon(rpc_flood, node, deadline)
        counts["end"] = time.time()

    trio.run(main)
    out_q.put(counts)


# ---- honest client ----------------------------------------------------------------------------
def _honest(addr: str, stop: Any, out_q: Any) -> None:
    logging.disable(logging.WARNING)
    target = Multiaddr.parse(addr)
    samples: list[tuple[float, float | None]] = []  # (wall time, latency or None on failure)

    async def main() -> None:
        async with open_node(listen=[], config=NodeConfig.testing()) as node:
            node.peerstore.add_addrs(target.peer_id, [target])
            k = 0
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    if k % 2:
                        await node.call(target.peer_id, dht_wire.PING, dht_wire.request(True, ()),
                                        timeout=5)  # fmt: skip
                    else:
                        req = dht_wire.request(True, (), queries=["honest-key"])
                        await node.call(target.peer_id, dht_wire.FIND, req, timeout=5)
                    samples.append((time.time(), time.perf_counter() - t0))
                    if k == 0:
                        out_q.put("ready")
                except P2PError:
                    samples.append((time.time(), None))
                k += 1
                await trio.sleep(HONEST_PERIOD)

    trio.run(main)
    out_q.put(samples)


def _latency(samples: list[tuple[float, float | None]], lo: float, hi: float) -> dict[str, Any]:
    window = [lat for t, lat in samples if lo <= t < hi]
    ok = sorted(lat for lat in window if lat is not None)
    if not ok:
        return {"n": len(window), "failed": len(window), "p50_ms": None, "p99_ms": None}
    return {
        "n": len(window),
        "failed": len(window) - len(ok),
        "p50_ms": round(statistics.median(ok) * 1e3, 2),
        "p99_ms": round(float(np.percentile(ok, 99)) * 1e3, 2),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flood-seconds", type=float, default=20.0)
    ap.add_argument("--quiet-seconds", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=16, help="concurrent RPC loops")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    addr_q, flood_q, honest_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    stop_target, stop_honest = ctx.Event(), ctx.Event()
    target = ctx.Process(target=_target, args=(addr_q, stop_target), daemon=True)
    target.start()
    addr = addr_q.get(timeout=60)
    honest = ctx.Process(target=_honest, args=(addr, stop_honest, honest_q), daemon=True)
    honest.start()
    try:
        if honest_q.get(timeout=120) != "ready":
            raise RuntimeError("the honest client did not start")
        t_before = time.time()
        time.sleep(args.quiet_seconds)
        rss_before = rss_kib(target.pid)
        t_flood = time.time()
        flooder = ctx.Process(
            target=_flooder, args=(addr, args.flood_seconds, args.workers, flood_q), daemon=True
        )
        flooder.start()
        flood = flood_q.get(timeout=args.flood_seconds + 120)
        flooder.join(timeout=30)
        t_flood, t_end = flood["start"], flood["end"]
        rss_flood = rss_kib(target.pid)
        time.sleep(args.quiet_seconds)
        rss_after = rss_kib(target.pid)
        t_after = time.time()
        stop_honest.set()
        samples = honest_q.get(timeout=60)
        honest.join(timeout=30)
    finally:
        stop_target.set()
        stop_honest.set()
        target.join(timeout=30)
        for p in (target, honest):
            if p.is_alive():
                p.kill()
    figures = {
        "flood_seconds": round(t_end - t_flood, 1),
        "flood_requests": flood["requests"],
        "flood_answered": flood["answered"],
        "flood_refused": flood["refused"],
        "flood_timeouts": flood["timeouts"],
        "flood_requests_per_s": round(flood["requests"] / (t_end - t_flood), 1),
        "flood_connections": flood["connections"],
        "flood_connections_per_s": round(flood["connections"] / (t_end - t_flood), 1),
        "honest_before": _latency(samples, t_before, t_flood),
        "honest_during": _latency(samples, t_flood, t_end),
        "honest_after": _latency(samples, t_end, t_after),
        "target_rss_kib_before": rss_before,
        "target_rss_kib_end_of_flood": rss_flood,
        "target_rss_kib_after": rss_after,
        "cpus": os.cpu_count(),
    }
    for k, v in figures.items():
        print(f"{k:30s} {v}")
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
