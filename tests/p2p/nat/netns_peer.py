"""One peer of the namespace lab, run as ``python -m tests.p2p.nat.netns_peer`` inside a namespace.

It speaks to the test through JSON lines: events on stdout, commands (``report``, ``quit``) on
stdin. ``pub`` is the public bootstrap peer and relay, and checks every byte it relays for a
known plaintext; ``nated`` joins through it, reports its reachability and role, publishes its
addresses in the DHT and, given ``--send-to``, looks up that peer and streams data to it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable

import trio

from p2p.dht import DHTConfig, open_dht
from p2p.identity import PeerID
from p2p.nat import AutoNATConfig, NATConfig, open_nat
from p2p.nat.discovery import advertise_relay, lookup_addrs, publish_addrs
from p2p.nat.holepunch import HolePunchConfig
from p2p.node import NodeConfig, open_node


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def payload(marker: bytes, size: int) -> bytes:
    block = marker + bytes(range(256)) * 4
    return (block * (size // len(block) + 1))[:size]


def commands() -> tuple[trio.MemoryReceiveChannel, Callable[[], Awaitable[None]]]:
    """Lines from stdin (read without threads, as a trio FdStream); EOF reads as ``quit``."""
    send, receive = trio.open_memory_channel(8)

    async def pump() -> None:
        buf = b""
        async with trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin:
            while True:
                data = await stdin.receive_some(4096)
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    await send.send(line.decode().strip())
                if not data:
                    await send.send("quit")
                    return

    return receive, pump


async def serve(args: argparse.Namespace) -> None:
    marker = bytes.fromhex(args.marker)
    cfg = NodeConfig.testing().replace(call_timeout=30.0, idle_timeout=60.0)
    # short timeouts: the routers drop unsolicited SYNs, so failed dial-backs and punches
    # end by timing out
    nat_cfg = NATConfig.default().replace(
        autonat=AutoNATConfig.testing(),
        hole_punching=HolePunchConfig(auto=False, attempts=2, connect_timeout=2.0),
    )
    dht_cfg = DHTConfig.fast()
    async with trio.open_nursery() as nursery, open_node(listen=[args.listen], config=cfg) as node:
        receive, pump = commands()
        nursery.start_soon(pump)
        peers = [args.boot] if args.boot else []
        async with open_nat(node, peers=peers, config=nat_cfg) as nat:
            seen = bytearray()
            if args.role == "pub":
                nat.relay.observe = lambda circuit, data: (seen.extend(data), data)[1]
            async with open_dht(
                node, initial_peers=peers, config=dht_cfg, client_mode=nat.client_mode
            ) as dht:
                if args.role == "pub":
                    await advertise_relay(dht, node)
                else:
                    await publish_addrs(dht, node)

                    async def sink(ctx, ms):
                        digest = hashlib.sha256()
                        n = 0
                        async for chunk in ms:
                            digest.update(chunk)
                            n += len(chunk)
                        await ms.send(
                            {"n": n, "sha256": digest.hexdigest(), "via": str(ctx.remote_addr)}
                        )

                    node.add_stream_handler("sink", sink)
                emit(
                    "ready",
                    peer=str(node.peer_id),
                    addrs=[str(a) for a in node.addrs],
                    reachability=nat.reachability.value,
                    role=nat.role.value,
                    client_mode=nat.client_mode,
                    relayed=[str(a) for a in nat.relayed_addrs],
                )
                if args.send_to:
                    await send(node, dht, nat, PeerID.from_base58(args.send_to), marker, args.size)
                async for command in receive:
                    if command == "report":
                        emit(
                            "report",
                            reachability=nat.reachability.value,
                            marker_seen=marker in seen,
                            seen_bytes=len(seen),
                            bytes_relayed=nat.relay.stats.bytes_relayed,
                            circuits=nat.relay.stats.circuits_opened,
                        )
                    elif command == "quit":
                        break
        nursery.cancel_scope.cancel()


async def send(node, dht, nat, target: PeerID, marker: bytes, size: int) -> None:
    with trio.fail_after(30):
        while not await lookup_addrs(dht, target):
            await trio.sleep(0.5)
    await stream_to(node, target, marker, size, "result")
    # then try to go direct (explicitly here, so the first transfer surely used the relay)
    ok = await nat.puncher.upgrade(target)
    emit("upgrade", ok=ok, upgraded=nat.puncher.upgraded, failed=nat.puncher.failed)
    await stream_to(node, target, marker, size // 4, "after-upgrade")


async def stream_to(node, target: PeerID, marker: bytes, size: int, event: str) -> None:
    data = payload(marker, size)
    start = time.perf_counter()
    async with node.open_stream(target, "sink") as ms:
        for i in range(0, len(data), 256 << 10):
            await ms.send(data[i : i + (256 << 10)])
        await ms.send_eof()
        answer = await ms.receive()
    secs = time.perf_counter() - start
    conn = node.connection_to(target)
    emit(
        event,
        n=answer["n"],
        sha_ok=answer["sha256"] == hashlib.sha256(data).hexdigest(),
        via=answer["via"],  # how the target saw us: the path this stream took
        remote_addr=str(conn.remote_addr) if conn is not None else None,
        cipher=conn.channel.cipher if conn is not None else None,
        mbps=size * 8 / secs / 1e6,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["pub", "nated"])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--boot")
    parser.add_argument("--marker", required=True)
    parser.add_argument("--send-to")
    parser.add_argument("--size", type=int, default=4 << 20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    logging.getLogger("p2p.nat").setLevel(logging.DEBUG)
    trio.run(serve, args)


if __name__ == "__main__":
    main()
