"""PortMapper's life cycle against a small NAT-PMP responder on loopback: it maps at start,
renews at half the lease (keeping the external port), deletes the mapping when cancelled, and
a router that refuses leaves the node unmapped, with the reason kept. (The real router is
tested in the namespace lab, test_portmap_netns.py.)"""

from __future__ import annotations

import socket
import struct

import trio

from p2p.multiaddr import Multiaddr
from p2p.nat.portmap import PortMapConfig, PortMapper, mappable_port


class FakeRouter:
    """Answers NAT-PMP on a loopback UDP port and records every request."""

    def __init__(self, result: int = 0) -> None:
        self.result = result
        self.requests: list[tuple[int, int, int, int]] = []  # (op, internal, external, lease)
        self.sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await self.sock.bind(("127.0.0.1", 0))
        task_status.started(self.sock.getsockname()[1])
        while True:
            data, peer = await self.sock.recvfrom(64)
            if data == b"\x00\x00":
                reply = struct.pack("!BBHI4s", 0, 128, 0, 1, bytes([5, 6, 7, 8]))
            else:
                _, op, _, internal, external, lease = struct.unpack("!BBHHHI", data)
                self.requests.append((op, internal, external, lease))
                mapped = 0 if lease == 0 else 40000 + internal % 1000
                reply = struct.pack(
                    "!BBHIHHI", 0, 128 + op, self.result, 1, internal, mapped, lease
                )
            await self.sock.sendto(reply, peer)


def _config(port: int, lease: int) -> PortMapConfig:
    return PortMapConfig(
        protocols=("natpmp",), gateway="127.0.0.1", natpmp_port=port, lease=lease,
        discover_timeout=0.8, retry_interval=30.0,
    )  # fmt: skip


def test_maps_renews_at_half_the_lease_and_deletes_on_exit() -> None:
    async def main() -> None:
        router = FakeRouter()
        changes = []
        async with trio.open_nursery() as nursery:
            port = await nursery.start(router.serve)
            mapper = PortMapper(4001, _config(port, lease=2), lambda: changes.append(mapper.addr))
            with trio.move_on_after(2.6):
                await mapper.run()
            nursery.cancel_scope.cancel()
        maps = [r for r in router.requests if r[3] > 0]
        assert maps[0] == (2, 4001, 4001, 2)  # our own port asked for first
        assert len(maps) >= 2 and all(r[2] == 40001 for r in maps[1:])  # renewed, same port
        assert router.requests[-1] == (2, 4001, 0, 0)  # deleted on the way out
        assert changes[0] == Multiaddr.parse("/ip4/5.6.7.8/tcp/40001")
        assert mapper.mapping is None

    trio.run(main)


def test_a_refusing_router_leaves_the_node_unmapped_with_the_reason() -> None:
    async def main() -> None:
        router = FakeRouter(result=2)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(router.serve)
            mapper = PortMapper(4001, _config(port, lease=60).replace(attempts=2))
            await nursery.start(mapper.run)
            assert mapper.mapping is None and "not authorized" in (mapper.last_error or "")
            assert len(router.requests) == 2  # our port, then one random one
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_only_private_or_wildcard_listeners_are_mapped() -> None:
    class FakeNode:
        def __init__(self, *addrs: str) -> None:
            self.listen_addrs = [Multiaddr.parse(a) for a in addrs]

    assert mappable_port(FakeNode("/ip4/192.168.1.20/tcp/4001")) == 4001
    assert mappable_port(FakeNode("/ip4/0.0.0.0/tcp/4002")) == 4002
    assert mappable_port(FakeNode("/ip4/127.0.0.1/tcp/4003")) is None
    assert mappable_port(FakeNode("/ip4/8.8.4.4/tcp/4004")) is None  # already public
    assert mappable_port(FakeNode("/sim/h1/tcp/1")) is None
