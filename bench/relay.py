"""Relay benchmark: a relayed stream vs a direct one on loopback, in the same run.

Run ``python -m bench.relay``. Three processes (so each side has its own core, as on three
machines): a relay, a target that holds a reservation on it and also listens directly, and
this process, whose two nodes reach the target once directly and once through the relay.
A relayed byte is encrypted twice on each hop (the end-to-end channel inside the per-hop
channels) and copied by the relay, so expect a lower figure there. Figures:

- ``direct_gb_per_s`` / ``relayed_gb_per_s``: 1 MiB messages on one stream, until the target
  confirms, in gigabytes (1e9 bytes) per second, as in ``bench.transport``.
- ``direct_rtt_us`` / ``relayed_rtt_us``: median round trip of a 64-byte ``Node.call``.

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import trio

from p2p.identity import Identity
from p2p.multiaddr import Multiaddr
from p2p.nat import RelayConfig, RelayService, attach
from p2p.node import NodeConfig, open_node

MIB = 1 << 20
RPC_PAYLOAD = b"x" * 64


async def _echo(ctx: Any, request: Any) -> Any:
    return request


async def _sink(ctx: Any, ms: Any) -> None:
    n = 0
    async for chunk in ms:
        n += len(chunk)
    await ms.send(n)


async def _wait_for_stop(conn: Any) -> None:
    """Serve until the parent says stop (polled: no thread needed)."""
    while not conn.poll():
        await trio.sleep(0.2)


def _relay_main(conn: Any) -> None:
    async def main() -> None:
        async with open_node(
            Identity.from_seed(b"bench-relay" * 3), config=NodeConfig.bulk()
        ) as node:
            RelayService(node, RelayConfig.bulk()).register()
            conn.send(str(node.addrs[0]))
            await _wait_for_stop(conn)

    trio.run(main)


def _target_main(conn: Any, relay_addr: str) -> None:
    async def main() -> None:
        async with (
            open_node(Identity.from_seed(b"bench-target" * 3), config=NodeConfig.bulk()) as node,
            trio.open_nursery() as nursery,
        ):
            node.add_handler("echo", _echo)
            node.add_stream_handler("sink", _sink)
            relayed = await nursery.start(attach(node).listen, relay_addr, node.accept_inbound)
            conn.send((str(node.addrs[0]), str(relayed)))
            await _wait_for_stop(conn)
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _measure(target: str, mib: int, rounds: int) -> dict[str, float]:
    async with open_node(Identity.generate(), config=NodeConfig.bulk()) as node:
        attach(node)
        for _ in range(20):  # connect and warm up
            await node.call(target, "echo", RPC_PAYLOAD)
        rtts = []
        for _ in range(rounds):
            start = time.perf_counter()
            await node.call(target, "echo", RPC_PAYLOAD)
            rtts.append(time.perf_counter() - start)
        chunk = b"\x5a" * MIB
        start = time.perf_counter()
        async with node.open_stream(target, "sink") as ms:
            for _ in range(mib):
                await ms.send(chunk)
            await ms.send_eof()
            got = await ms.receive()
        secs = time.perf_counter() - start
        assert got == mib * MIB, f"target received {got} bytes of {mib * MIB}"
        conn = node.connection_to(Multiaddr.parse(target).peer_id)
        return {
            "gb_per_s": mib * MIB / secs / 1e9,
            "rtt_us": statistics.median(rtts) * 1e6,
            "rtt_p90_us": statistics.quantiles(rtts, n=10)[-1] * 1e6,
            "relayed": float(
                conn is not None and conn.remote_addr is not None and conn.remote_addr.is_relayed
            ),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="MiB moved per throughput figure")
    parser.add_argument("--rounds", type=int, default=1000, help="RPC round trips to time")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    relay_end, relay_conn = ctx.Pipe()
    target_end, target_conn = ctx.Pipe()
    relay = ctx.Process(target=_relay_main, args=(relay_conn,), daemon=True)
    relay.start()
    try:
        relay_addr = relay_end.recv()
        target = ctx.Process(target=_target_main, args=(target_conn, relay_addr), daemon=True)
        target.start()
        try:
            direct_addr, relayed_addr = target_end.recv()
            direct = trio.run(_measure, direct_addr, args.mib, args.rounds)
            relayed = trio.run(_measure, relayed_addr, args.mib, args.rounds)
        finally:
            target_end.send("stop")
            target.join(10)
    finally:
        relay_end.send("stop")
        relay.join(10)
    print(
        f"direct : {direct['gb_per_s']:.3f} GB/s, RPC round trip {direct['rtt_us']:.0f} us "
        f"(p90 {direct['rtt_p90_us']:.0f} us)"
    )
    print(
        f"relayed: {relayed['gb_per_s']:.3f} GB/s, RPC round trip {relayed['rtt_us']:.0f} us "
        f"(p90 {relayed['rtt_p90_us']:.0f} us)  [{relayed_addr}]"
    )
    if relayed["relayed"] != 1.0 or direct["relayed"] != 0.0:
        raise SystemExit(f"wrong paths measured: direct {direct}, relayed {relayed}")
    result = {
        "direct_gb_per_s": round(direct["gb_per_s"], 4),
        "relayed_gb_per_s": round(relayed["gb_per_s"], 4),
        "direct_rtt_us": round(direct["rtt_us"], 1),
        "relayed_rtt_us": round(relayed["rtt_us"], 1),
        "direct_rtt_p90_us": round(direct["rtt_p90_us"], 1),
        "relayed_rtt_p90_us": round(relayed["rtt_p90_us"], 1),
        "relayed_over_direct_throughput": round(relayed["gb_per_s"] / direct["gb_per_s"], 3),
        "mib": args.mib,
        "rounds": args.rounds,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
