"""A short local demo of the p2p layer: three peers, three processes, loopback TCP.

    python -m examples.demo            # the hub; it starts two worker processes itself

The hub starts, two workers dial it and register; all three join a small DHT. The hub times
RPC round trips to each worker, stores a value in the DHT that a worker then reads, and asks
worker A to pull a 100 MB stream from worker B (over the encrypted, multiplexed connection A
dials to B) while small RPCs keep flowing. Everything printed is measured in this run.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from typing import Any

import trio

from p2p import CallContext, MessageStream, Multiaddr, Node, open_node
from p2p.dht import open_dht

CHUNK = 1 << 20
logger = logging.getLogger("examples.demo")


# ---- worker -------------------------------------------------------------------------------


async def run_worker(hub: str, name: str) -> None:
    stop = trio.Event()
    async with open_node() as node, open_dht(node, initial_peers=[hub]) as dht:

        async def ping(ctx: CallContext, request: Any) -> Any:
            return request

        async def blob(ctx: CallContext, stream: MessageStream) -> None:
            """Send the requested number of bytes in 1 MiB messages."""
            size = int((await stream.receive())["size"])
            chunk = bytes(CHUNK)
            sent = 0
            while sent < size:
                n = min(CHUNK, size - sent)
                await stream.send(chunk if n == CHUNK else chunk[:n])
                sent += n

        async def fetch_from(ctx: CallContext, request: dict[str, Any]) -> dict[str, Any]:
            """Pull ``size`` bytes from another worker; report how long it took."""
            start = time.perf_counter()
            got = 0
            async with node.open_stream(request["peer"], "demo.blob") as stream:
                await stream.send({"size": request["size"]})
                await stream.send_eof()
                async for chunk in stream:
                    got += len(chunk)
            return {"bytes": got, "seconds": time.perf_counter() - start}

        async def halt(ctx: CallContext, request: Any) -> None:
            stop.set()

        async def dht_get(ctx: CallContext, key: str) -> Any:
            found = await dht.get(key)
            return None if found is None else found.value

        node.add_handler("demo.ping", ping)
        node.add_stream_handler("demo.blob", blob)
        node.add_handler("demo.fetch_from", fetch_from)
        node.add_handler("demo.stop", halt)
        node.add_handler("demo.dht_get", dht_get)
        await node.call(hub, "demo.register", {"name": name, "addrs": [str(a) for a in node.addrs]})
        await stop.wait()
        await trio.sleep(0.05)  # let the reply to demo.stop leave


# ---- hub ----------------------------------------------------------------------------------


async def time_pings(node: Node, peer: Any, rounds: int) -> list[float]:
    samples = []
    for i in range(rounds):
        start = time.perf_counter()
        await node.call(peer, "demo.ping", {"i": i})
        samples.append(time.perf_counter() - start)
    return samples


async def run_hub(size_mb: int, rounds: int) -> None:
    t0 = time.perf_counter()
    registered: dict[str, list[str]] = {}
    both = trio.Event()
    async with open_node() as hub, open_dht(hub) as dht:

        async def register(ctx: CallContext, request: dict[str, Any]) -> str:
            registered[request["name"]] = request["addrs"]
            print(f"  {request['name']} registered: {ctx.remote_peer} from {ctx.remote_addr}")
            if len(registered) == 2:
                both.set()
            return "welcome"

        hub.add_handler("demo.register", register)
        print(f"hub  {hub.peer_id} listening on {hub.addrs[0]}")
        procs = []
        for name in ("worker-a", "worker-b"):
            procs.append(
                await trio.lowlevel.open_process(
                    [sys.executable, "-m", "examples.demo", "--worker", str(hub.addrs[0]), name]
                )
            )
        try:
            with trio.fail_after(60):
                await both.wait()
            a = Multiaddr.parse(registered["worker-a"][0])
            b = Multiaddr.parse(registered["worker-b"][0])

            for label, addr in (("worker-a", a), ("worker-b", b)):
                rtts = await time_pings(hub, addr, rounds)
                print(
                    f"RPC round trips hub -> {label}: {rounds} calls, median "
                    f"{statistics.median(rtts) * 1e6:.0f} us, max {max(rtts) * 1e6:.0f} us"
                )

            key, value = "demo/greeting", {"from": str(hub.peer_id)[:8], "text": "hello"}
            start = time.perf_counter()
            result = await dht.store(key, value, dht.now() + 60)
            stored = time.perf_counter() - start
            start = time.perf_counter()
            seen = await hub.call(b, "demo.dht_get", key)
            print(
                f"DHT: hub stored {key!r} on {result.stored} node(s) in {stored * 1e3:.0f} ms; "
                f"worker-b read {seen} in {(time.perf_counter() - start) * 1e3:.0f} ms"
            )

            size = size_mb * 1_000_000
            print(f"worker-a pulls {size_mb} MB from worker-b over one encrypted stream ...")
            side_rtts: list[float] = []

            async def background_pings() -> None:
                while True:
                    side_rtts.extend(await time_pings(hub, b, 1))
                    await trio.sleep(0.01)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(background_pings)
                report = await hub.call(
                    a, "demo.fetch_from", {"peer": str(b), "size": size}, timeout=120
                )
                nursery.cancel_scope.cancel()
            rate = report["bytes"] / report["seconds"]
            print(
                f"  received {report['bytes']:,} bytes in {report['seconds']:.2f} s: "
                f"{rate / 1e6:.0f} MB/s ({rate * 8 / 1e9:.2f} Gbit/s)"
            )
            if side_rtts:
                print(
                    f"  meanwhile {len(side_rtts)} pings hub -> worker-b: median "
                    f"{statistics.median(side_rtts) * 1e3:.1f} ms"
                )
            print(f"hub connections: {len(hub.connected_peers())} peers")
            for addr in (a, b):
                await hub.call(addr, "demo.stop", None)
        finally:
            with trio.move_on_after(10) as scope:
                scope.shield = True
                for proc in procs:
                    await proc.wait()
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
    print(f"done in {time.perf_counter() - t0:.1f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("HUB_ADDR", "NAME"), help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=int, default=100, help="MB streamed between the workers")
    parser.add_argument("--rounds", type=int, default=200, help="timed RPC round trips")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.worker:
        trio.run(run_worker, *args.worker)
    else:
        trio.run(run_hub, args.mb, args.rounds)


if __name__ == "__main__":
    main()
