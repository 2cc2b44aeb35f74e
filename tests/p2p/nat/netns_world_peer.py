"""A collaboration peer of the world lab (:class:`bench.netns_lab.InternetLab`).

Run as ``python -m tests.p2p.nat.netns_world_peer ROLE ...`` inside a lab namespace:

* ``coordinator``: the run's organiser peer on a cloud VM behind 1:1 NAT, started with
  ``--announce PUBLIC`` like the sahajBERT coordinator, and like it an ``aux`` peer that
  trains nothing and helps average (it reduces a share of every round).
* ``volunteer``: a peer at home whose mode follows its reachability (a node when reachable
  directly or through relays, a client with no inbound path at all, e.g. with
  ``--no-relay``). After ``go`` it trains a
  stand-in model: each epoch it sums random gradients of ``--size`` floats until the
  collaboration reaches the target, then averages them with the run.

Events leave as JSON lines on stdout (``ready``, ``round``, ``done``, ``report``); commands
arrive as lines on stdin (``go``, ``report``, ``quit``; EOF reads as ``quit``).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
from contextlib import AsyncExitStack
from typing import Any

import numpy as np
import trio

from dedloc_jax.config import CollaborationConfig
from dedloc_jax.opening import open_collaboration
from p2p.dht import DHTConfig
from p2p.identity import Identity
from p2p.nat import AutoNATConfig, NATConfig, PortMapConfig
from p2p.node import NodeConfig, announce_addrs, open_node
from tests.p2p.nat.netns_peer import commands, emit

MICRO = 4
RATE = 16.0  # samples per second of one volunteer
SAMPLE_EVERY = 997  # the coordinate stride of the values a round event carries

log = logging.getLogger("netns_world_peer")


def gradient(index: int, epoch: int, step: int, size: int) -> np.ndarray:
    return np.random.default_rng([index, epoch, step]).standard_normal(size, dtype=np.float32)


def _state(core: Any) -> dict[str, Any]:
    nat = core.nat
    mapper = nat.port_mapper if nat is not None else None
    mapping = mapper.mapping if mapper is not None else None
    conns = {}
    for peer in core.node.connected_peers():
        conn = core.node.connection_to(peer)
        if conn is not None:
            conns[str(peer)] = str(conn.remote_addr)
    return {
        "peer": str(core.node.peer_id),
        "addrs": [str(a) for a in core.node.addrs],
        "reachability": nat.reachability.value if nat is not None else None,
        "role": nat.role.value if nat is not None else None,
        "mode": core.mode,
        "dht_client": getattr(core.dht, "client_mode", None),
        "mapping": None if mapping is None else [mapping.protocol, str(mapping.addr)],
        "relayed": [str(a) for a in nat.relayed_addrs] if nat is not None else [],
        "conns": conns,
        "table": sorted(core.tracker.records),
        "punched": nat.puncher.upgraded if nat is not None and nat.puncher else None,
    }


async def train(core: Any, args: argparse.Namespace) -> None:
    for epoch in range(args.epochs):
        acc = np.zeros(args.size, np.float32)
        samples = step = 0
        while True:
            await trio.sleep(MICRO / RATE)
            acc += gradient(args.index, epoch, step, args.size) * MICRO
            samples += MICRO
            step += 1
            if core.report(epoch, samples, MICRO):
                break
        mean = acc / samples
        out = await core.average(epoch, [mean], samples)
        got = np.asarray(out.average[0])
        log.info("epoch %d averaged: %s", epoch, core.history[-1])
        emit(
            "round",
            epoch=epoch,
            group=out.group_size,
            complete=out.complete,
            mode=core.history[-1].mode,
            samples=samples,
            sha256=hashlib.sha256(got.tobytes()).hexdigest(),
            sent=mean[::SAMPLE_EVERY].tolist(),
            got=got[::SAMPLE_EVERY].tolist(),
        )
    emit("done", epochs=args.epochs)


async def serve(args: argparse.Namespace) -> None:
    identity = Identity.from_seed(f"netns-world/{args.index}".encode())
    config = CollaborationConfig.local_demo(args.target)
    config = config.replace(
        links=config.links.replace(measure=False),
        rounds=config.rounds.replace(averaging_timeout=120.0),
    )
    nat_config = NATConfig.default().replace(
        autonat=AutoNATConfig.testing(), port_mapping=PortMapConfig.testing()
    )
    if args.no_relay:  # as when every relay refuses: no inbound path at all
        nat_config = nat_config.replace(max_relays=0)
    announce = announce_addrs(args.announce, identity.peer_id) if args.announce else []
    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        receive, pump = commands()
        nursery.start_soon(pump)
        node = await stack.enter_async_context(
            open_node(identity, listen=[args.listen], config=NodeConfig(), announce=announce)
        )
        core = await stack.enter_async_context(
            open_collaboration(
                node,
                args.run_id,
                initial_peers=args.boot,
                config=config.replace(mode="aux" if args.role == "coordinator" else None),
                dht_config=DHTConfig.fast(),
                nat_config=nat_config,
            )
        )
        if args.role == "coordinator":
            nursery.start_soon(core.run_aux, [np.zeros(args.size, np.float32)])
        emit("ready", **_state(core))
        async for line in receive:
            if line == "quit":
                break
            if line == "go" and args.role == "volunteer":
                nursery.start_soon(train, core, args)
            elif line == "report":
                emit("report", **_state(core))
        nursery.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["coordinator", "volunteer"])
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--announce", nargs="*", default=[])
    parser.add_argument("--boot", nargs="*", default=[])
    parser.add_argument("--run-id", default="world")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--size", type=int, default=1 << 16)
    parser.add_argument("--target", type=int, default=96)
    parser.add_argument("--no-relay", action="store_true", help="take no relay reservation")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    trio.run(serve, args)


if __name__ == "__main__":
    main()
