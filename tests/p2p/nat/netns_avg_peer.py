"""An averaging peer of the namespace lab: ``python -m tests.p2p.nat.netns_avg_peer ROLE ...``.

``pub`` is the public bootstrap node, DHT server and relay (with a small circuit budget, so
that circuits must be renewed between rounds); ``nated`` joins through it behind a NAT with no
port mapping, learns it is private, takes a reservation, becomes a DHT client and publishes
its relayed address. Commands arrive as JSON lines on stdin, events leave on stdout:

* ``{"cmd": "find", "peer": ID}``: look the peer up in the DHT and connect to it by peer ID
  within the DHT's request timeout; also dial its private address alone, to show how the
  path treats it (``"timeout"`` when a router drops it silently).
* ``{"cmd": "round", "spec": HEX, "round": I, "size": N}``: all-reduce ``vector(index, N)``.
* ``{"cmd": "report"}``, ``{"cmd": "quit"}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from contextlib import AsyncExitStack

import numpy as np
import trio

from p2p.dht import DHTConfig, open_dht
from p2p.errors import P2PError
from p2p.identity import Identity, PeerID
from p2p.multiaddr import Multiaddr
from p2p.nat import AutoNATConfig, NATConfig, RelayConfig, open_nat
from p2p.nat.discovery import lookup_addrs, publish_addrs
from p2p.nat.holepunch import HolePunchConfig
from p2p.node import NodeConfig, open_node
from tests.p2p.nat.netns_peer import commands, emit


def vector(index: int, size: int) -> np.ndarray:
    return np.random.default_rng(7000 + index).standard_normal(size, dtype=np.float32)


async def serve(args: argparse.Namespace) -> None:
    cfg = NodeConfig.testing().replace(call_timeout=60.0, idle_timeout=120.0)
    relay = RelayConfig.default().replace(max_circuit_bytes=args.relay_bytes)
    punch = HolePunchConfig(auto=True, attempts=2, connect_timeout=2.0) if args.punch else None
    nat_cfg = NATConfig.default().replace(
        autonat=AutoNATConfig.testing(), relay=relay, hole_punching=punch
    )
    identity = Identity.from_seed(f"netns-avg/{args.index}".encode())
    peers = [args.boot] if args.boot else []
    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        node = await stack.enter_async_context(
            open_node(identity, listen=[args.listen], config=cfg)
        )
        receive, pump = commands()
        nursery.start_soon(pump)
        nat = await stack.enter_async_context(open_nat(node, peers=peers, config=nat_cfg))
        dht = await stack.enter_async_context(
            open_dht(
                node, initial_peers=peers, config=DHTConfig.fast(), client_mode=nat.dht_client_mode
            )
        )
        nat.use_dht(dht)
        await run_commands(args, node, nat, dht, receive)
        nursery.cancel_scope.cancel()


async def run_commands(args, node, nat, dht, receive) -> None:
    from dedloc_jax.averaging import AveragingService, GroupSpec, all_reduce

    service = AveragingService(node)
    if args.role == "nated":  # (retried: on a loaded machine a 2 s DHT request may time out)
        with trio.fail_after(60):
            while not await publish_addrs(dht, node):
                await trio.sleep(1)
    emit(
        "ready",
        peer=str(node.peer_id),
        addrs=[str(a) for a in node.addrs],
        reachability=nat.reachability.value,
        role=nat.role.value,
        dht_client=dht.client_mode,
        relayed=[str(a) for a in nat.relayed_addrs],
    )
    async for line in receive:
        msg = json.loads(line) if line.startswith("{") else {"cmd": line}
        if msg["cmd"] == "quit":
            return
        if msg["cmd"] == "find":
            await find(node, dht, PeerID.from_base58(msg["peer"]))
        elif msg["cmd"] == "round":
            spec = GroupSpec.from_bytes(bytes.fromhex(msg["spec"]))
            result = await all_reduce(
                service,
                spec,
                {"g": vector(args.index, msg["size"])},
                codec="none",
                timeout=120.0,
                round_id=f"round-{msg['round']}".encode(),
            )
            out = result.vector
            emit(
                "round",
                round=msg["round"],
                sha256=hashlib.sha256(out.tobytes()).hexdigest(),
                sample=out[:: max(1, len(out) // 512)].tolist(),
                contributors=[sorted(c) for c in result.contributors],
            )
        elif msg["cmd"] == "report":
            puncher = nat.puncher
            emit(
                "report",
                circuits=nat.relay.stats.circuits_opened,
                cuts=dict(nat.relay.stats.cuts),
                bytes_relayed=nat.relay.stats.bytes_relayed,
                renewed=nat.circuits.renewed,
                conns={
                    str(p): str(node.connection_to(p).remote_addr) for p in node.connected_peers()
                },
                punched=puncher.upgraded if puncher else None,
                punch_failed=puncher.failed if puncher else None,
                role=nat.role.value,
                dht_client=dht.client_mode,
            )


async def find(node, dht, peer: PeerID) -> None:
    with trio.fail_after(30):
        while not (addrs := await lookup_addrs(dht, peer)):
            await trio.sleep(0.5)
    # within a DHT request's time: what every DHT call to a relayed peer must manage
    bound = DHTConfig().request_timeout  # the default DHT's (5 s; the test preset's is 2 s)
    with trio.fail_after(bound):
        await node.connect(peer)
    conn = node.connection_to(peer)
    private = [a for a in addrs if not a.is_relayed]
    how = "none"
    if private:
        try:
            with trio.move_on_after(3) as scope:
                raw = await node.transport.dial(Multiaddr.parse(str(private[0])).transport_part())
                await trio.aclose_forcefully(raw)
            how = "timeout" if scope.cancelled_caught else "connected"
        except (P2PError, OSError) as e:
            how = f"error: {e}"
    emit(
        "found",
        addrs=[str(a) for a in addrs],
        remote_addr=str(conn.remote_addr) if conn is not None else None,
        took_under=bound,
        private_dial=how,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["pub", "nated"])
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--boot")
    parser.add_argument("--relay-bytes", type=int, default=16 << 20)
    parser.add_argument("--punch", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    trio.run(serve, args)


if __name__ == "__main__":
    main()
