"""Announced addresses: a node behind a port forward is reached where it says it is.

Peer A listens on one loopback port and announces another, which a small TCP forwarder relays
to A's real port (as a router's port forward or a proxy would). Peer B knows only the DHT's
bootstrap node; it must learn A's announced address from the DHT and reach A through the
forwarder, never through A's listen address.
"""

from __future__ import annotations

from functools import partial

import pytest
import trio

from p2p import Identity, Multiaddr, open_node
from p2p.dht import open_dht
from p2p.dht.ids import node_id
from p2p.errors import MultiaddrError
from p2p.nat.observed import IDENTIFY, handle_identify, identify
from p2p.node import announce_addrs


class Forwarder:
    """Relays every TCP connection on its own port to ``target_port``; counts them."""

    def __init__(self) -> None:
        self.target_port = 0  # set once the target listens (it announces our port first)
        self.connections = 0
        self.port = 0

    async def _pipe(self, src: trio.SocketStream, dst: trio.SocketStream) -> None:
        try:
            while data := await src.receive_some(65536):
                await dst.send_all(data)
            await dst.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        server = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        async with client, server, trio.open_nursery() as nursery:
            nursery.start_soon(self._pipe, client, server)
            nursery.start_soon(self._pipe, server, client)

    @property
    def addr(self) -> str:
        return f"/ip4/127.0.0.1/tcp/{self.port}"


async def start_forwarder(nursery: trio.Nursery) -> Forwarder:
    fwd = Forwarder()
    listeners = await nursery.start(partial(trio.serve_tcp, fwd._handle, 0, host="127.0.0.1"))
    fwd.port = listeners[0].socket.getsockname()[1]
    return fwd


def test_peer_finds_announced_address_in_dht_and_connects_through_forwarder() -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            fwd = await start_forwarder(nursery)
            async with (
                open_node() as c,
                open_dht(c) as cd,
                open_node(announce=[fwd.addr]) as a,
            ):
                real = a.listen_addrs[0]
                fwd.target_port = real.port
                announced = Multiaddr.parse(fwd.addr).with_peer(a.peer_id)
                assert a.addrs == [announced]  # the listen address is not advertised
                a.add_handler(IDENTIFY, handle_identify)
                async with open_dht(a, initial_peers=[c.addrs[0]]):
                    # the bootstrap node learned A from A's own requests: announced only
                    entry = cd.routing.get(a.peer_id)
                    assert entry is not None and entry.addrs == (str(announced),)
                    async with open_node() as b, open_dht(b, initial_peers=[c.addrs[0]]) as bd:
                        found = await bd.find_nearest(node_id(a.peer_id))
                        contact = next(x for x in found.nearest if x.peer == a.peer_id)
                        assert contact.addrs == (str(announced),)
                        assert b.peerstore.addrs_of(a.peer_id) == [announced]
                        # B reaches A by its peer ID alone, hence through the forwarder
                        info = await identify(b, a.peer_id)
                        assert info.listen_addrs == (announced,)
                        conn = b.connection_to(a.peer_id)
                        assert conn is not None and conn.remote_addr is not None
                        assert conn.remote_addr.transport_part() == Multiaddr.parse(fwd.addr)
                        assert fwd.connections >= 1
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_without_announce_the_listen_addresses_are_advertised() -> None:
    async def main() -> None:
        async with open_node() as a:
            assert a.addrs == a.listen_addrs and a.addrs[0].peer_id == a.peer_id

    trio.run(main)


def test_announce_addresses_are_checked_and_get_the_peer_id() -> None:
    me, other = Identity.generate().peer_id, Identity.generate().peer_id
    got = announce_addrs(
        [
            "/ip4/203.0.113.7/tcp/4001",
            f"/dns4/example.org/tcp/443/p2p/{me}",
            "/ip4/203.0.113.7/tcp/4001",
        ],
        me,
    )
    assert [str(a) for a in got] == [
        f"/ip4/203.0.113.7/tcp/4001/p2p/{me}",
        f"/dns4/example.org/tcp/443/p2p/{me}",
    ]
    for bad, why in [
        ("203.0.113.7:4001", "starts with"),
        ("/ip4/203.0.113.7", "not dialable"),
        ("/ip4/203.0.113.7/tcp/0", "not dialable"),
        (f"/ip4/203.0.113.7/tcp/4001/p2p/{other}", "another peer"),
        (f"/ip4/203.0.113.7/tcp/4001/p2p/{other}/p2p-circuit/p2p/{me}", "relay circuit"),
        ("/ip4/300.1.1.1/tcp/1", "invalid IPv4"),
    ]:
        with pytest.raises(MultiaddrError, match=why):
            announce_addrs([bad], me)


def test_open_node_rejects_a_bad_announce_address_before_listening() -> None:
    async def main() -> None:
        with pytest.raises(MultiaddrError, match="announce address"):
            async with open_node(announce=["/ip4/1.2.3.4/tcp/nope"]):
                pytest.fail("the node started")

    trio.run(main)
