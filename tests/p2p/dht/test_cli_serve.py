"""``python -m p2p.dht serve`` as a full node: a NATed one (forced private) takes a
reservation on the node it bootstraps through and is reachable through the relay; a wildcard
listener prints dialable addresses; ``--announce`` replaces what is advertised."""

from __future__ import annotations

import os
import select
import subprocess
import time

import trio

from p2p.multiaddr import Multiaddr
from p2p.nat import attach, identify
from p2p.node import open_node

from .test_cli import CMD, ROOT, _env


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*CMD, "serve", "--config", "fast", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=_env(),
    )


def _lines(proc: subprocess.Popen, quiet: float = 1.0) -> list[str]:
    """The addresses a serve process printed: lines until it is quiet for ``quiet`` s."""
    fd = proc.stdout.fileno()
    data = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], quiet if data else 60)
        if not ready:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    out = [line for line in data.decode().splitlines() if line.strip()]
    if not out:
        proc.kill()
        raise AssertionError(f"serve printed no address: {proc.stderr.read()[-2000:]}")
    return out


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_a_private_standalone_node_is_reachable_through_its_relay() -> None:
    public = _start("--force-reachability", "public")
    private = None
    try:
        (relay_addr,) = _lines(public)
        private = _start("--force-reachability", "private", "--initial-peers", relay_addr)
        printed = [Multiaddr.parse(a) for a in _lines(private)]
        relayed = [a for a in printed if a.is_relayed]
        assert relayed, printed
        assert str(relayed[0]).startswith(relay_addr + "/p2p-circuit/")

        async def reach() -> tuple[bool, str]:
            async with open_node(listen=[]) as node:
                attach(node)
                result = await identify(node, relayed[0], timeout=10)
                conn = node.connection_to(result.peer)
                return conn.remote_addr.is_relayed, str(result.peer)

        through_relay, peer = trio.run(reach)
        assert through_relay and peer == str(relayed[0].peer_id)
    finally:
        _stop(public, *([private] if private else []))


def test_serve_prints_only_dialable_addresses_and_takes_announce() -> None:
    wildcard = _start("--listen", "/ip4/0.0.0.0/tcp/0", "--no-nat")
    announced = _start("--announce", "/ip4/203.0.113.7/tcp/4001", "--force-reachability", "public")
    try:
        printed = [Multiaddr.parse(a) for a in _lines(wildcard)]
        assert printed and all(a.host != "0.0.0.0" for a in printed), printed
        assert any(a.host == "127.0.0.1" for a in printed)
        (only,) = _lines(announced)
        assert Multiaddr.parse(only).transport_part() == Multiaddr.parse(
            "/ip4/203.0.113.7/tcp/4001"
        )
    finally:
        _stop(wildcard, announced)
