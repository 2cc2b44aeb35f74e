"""Node behaviour: dialing, connection reuse and deduplication, limits, closing."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import trio
import trio.testing

from p2p import (
    CallContext,
    DialError,
    Identity,
    Multiaddr,
    NodeConfig,
    PeerIDMismatch,
    PeerStore,
    TcpTransport,
    open_node,
)
from p2p.testing import SimNetwork, open_sim_nodes, run_sim


async def echo(ctx: CallContext, request: Any) -> Any:
    return request


def test_one_connection_is_reused_by_many_concurrent_calls() -> None:
    async def main() -> None:
        async with open_node() as a, open_node() as b:
            a.add_handler("echo", echo)
            results: list[int] = []

            async def one(i: int) -> None:
                results.append(await b.call(a.addrs[0], "echo", i))

            async with trio.open_nursery() as nursery:
                for i in range(50):
                    nursery.start_soon(one, i)
            assert sorted(results) == list(range(50))
            assert b.num_connections == 1 and a.num_connections == 1
            assert b.connected_peers() == [a.peer_id] and a.connected_peers() == [b.peer_id]
            # the dialed address went to the peer store: the peer ID alone now suffices
            assert b.peerstore.addrs_of(a.peer_id) == [a.addrs[0]]
            assert await b.call(a.peer_id, "echo", "by id") == "by id"

    trio.run(main)


def test_simultaneous_dials_converge_on_one_connection() -> None:
    async def main() -> None:
        async with open_node() as a, open_node() as b:
            a.add_handler("echo", echo)
            b.add_handler("echo", echo)
            a.peerstore.add_addrs(b.peer_id, b.addrs)
            b.peerstore.add_addrs(a.peer_id, a.addrs)
            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(a.call, b.peer_id, "echo", 1)
                    nursery.start_soon(b.call, a.peer_id, "echo", 2)
            # both sides keep the same connection: the one dialed by the smaller peer ID
            ca, cb = a.connection_to(b.peer_id), b.connection_to(a.peer_id)
            assert ca is not None and cb is not None
            assert ca.initiator == cb.initiator
            # the duplicate (if both dials completed) is drained and closed once idle
            with trio.fail_after(10):
                while a.num_connections > 1 or b.num_connections > 1:
                    await trio.sleep(0.05)
            assert await a.call(b.peer_id, "echo", 3) == 3
            assert await b.call(a.peer_id, "echo", 4) == 4

    trio.run(main)


def test_dialing_the_wrong_peer_id_fails_clearly() -> None:
    async def main() -> None:
        async with open_node() as a, open_node() as b:
            impostor = Identity.generate().peer_id
            wrong = a.addrs[0].transport_part().with_peer(impostor)
            with pytest.raises(PeerIDMismatch):
                await b.connect(wrong)
            assert b.num_connections == 0
            # without a /p2p/ part we learn who answered
            assert await b.connect(a.addrs[0].transport_part()) == a.peer_id

    trio.run(main)


def test_unreachable_and_unknown_peers_raise_dial_error() -> None:
    async def main() -> None:
        # a port that was just free: nothing listens there
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        async with open_node() as b:
            with pytest.raises(DialError):
                await b.call(f"/ip4/127.0.0.1/tcp/{port}", "echo", 1)
            with pytest.raises(DialError, match="no known address"):
                await b.call(Identity.generate().peer_id, "echo", 1)
            with pytest.raises(DialError, match="ourselves"):
                await b.connect(b.peer_id)
            with pytest.raises(DialError):
                await b.connect(Multiaddr.parse("/sim/nowhere/tcp/1"))

    trio.run(main)


def test_idle_connections_are_closed_in_virtual_time() -> None:
    config = NodeConfig(idle_timeout=30.0)

    async def main() -> None:
        net = SimNetwork(seed=0)
        async with open_sim_nodes(net, 2, config=config) as (a, b):
            a.add_handler("echo", echo)
            await b.call(a.addrs[0], "echo", 1)
            assert b.num_connections == 1
            await trio.sleep(10)
            assert b.num_connections == 1  # not idle long enough yet
            await b.call(a.peer_id, "echo", 1)  # activity restarts the clock
            await trio.sleep(25)
            assert b.num_connections == 1
            await trio.sleep(30)  # closed between 30 s and 37.5 s after the last call
            assert b.num_connections == 0 and a.num_connections == 0
            # and a new call simply redials
            assert await b.call(a.peer_id, "echo", 7) == 7

    run_sim(main)


def test_connection_limit_per_ip_refuses_extra_connections() -> None:
    async def main() -> None:
        config = NodeConfig(max_connections_per_ip=2)
        async with open_node(config=config) as server:
            server.add_handler("echo", echo)
            async with open_node() as c1, open_node() as c2, open_node() as c3:
                assert await c1.call(server.addrs[0], "echo", 1) == 1
                assert await c2.call(server.addrs[0], "echo", 2) == 2
                with pytest.raises(DialError):
                    await c3.call(server.addrs[0], "echo", 3)
                assert server.num_connections == 2
            # once others left, there is room again
            with trio.fail_after(10):
                while server.num_connections:
                    await trio.sleep(0.02)
            async with open_node() as c4:
                assert await c4.call(server.addrs[0], "echo", 4) == 4

    trio.run(main)


def test_closing_a_node_closes_its_connections() -> None:
    async def main() -> None:
        async with open_node() as b:
            async with open_node() as a:
                a.add_handler("echo", echo)
                await b.call(a.addrs[0], "echo", 1)
                assert b.num_connections == 1
            with trio.fail_after(5):
                while b.num_connections:
                    await trio.sleep(0.01)
            with pytest.raises(DialError):
                await b.call(a.peer_id, "echo", 1)

    trio.run(main)


def test_a_peer_that_shuts_down_is_news_at_debug_only_and_a_failure_stays_info(caplog) -> None:
    """A node that stops closes its connections with "node shutting down": the other side
    logged it at INFO (every temporary node of a coordinator's manifest fetch left a line,
    as did each NAT dial-back and duplicate connection). Ordinary closes are DEBUG now; a
    reason outside them (a failure) stays INFO."""

    async def main() -> None:
        async with open_sim_nodes(SimNetwork(seed=1), 3, config=NodeConfig.testing()) as nodes:
            b, a, c = nodes
            a.add_handler("echo", echo)
            await b.call(a.addrs[0], "echo", 1)
            await c.call(a.addrs[0], "echo", 1)
            await a.disconnect(c.peer_id, "protocol violation: a test")
            await trio.sleep(1.0)

    with caplog.at_level("DEBUG", logger="p2p.mux"):
        run_sim(main)
    said = [
        (r.levelname, r.getMessage().split(": ", 1)[1])
        for r in caplog.records
        if "peer is closing the connection" in r.getMessage()
    ]
    assert ("INFO", "peer is closing the connection: protocol violation: a test") in said, said
    assert ("DEBUG", "peer is closing the connection: node shutting down") in said, said
    assert all(lv == "DEBUG" for lv, why in said if "protocol violation" not in why), said


def test_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")

    async def main() -> None:
        async with open_node(listen=["/ip6/::1/tcp/0"]) as a, open_node() as b:
            a.add_handler("echo", echo)
            assert str(a.addrs[0]).startswith("/ip6/::1/tcp/")
            assert await b.call(a.addrs[0], "echo", "v6") == "v6"

    trio.run(main)


def test_tcp_transport_reports_observed_address() -> None:
    async def main() -> None:
        seen: list[Multiaddr | None] = []
        transport = TcpTransport()

        async def handler(stream: trio.abc.Stream, observed: Multiaddr | None) -> None:
            seen.append(observed)
            await stream.send_all(b"ok")

        async with trio.open_nursery() as nursery:
            bound = await nursery.start(
                transport.listen, Multiaddr.parse("/ip4/127.0.0.1/tcp/0"), handler
            )
            assert bound.port and bound.port > 0
            stream = await transport.dial(bound)
            assert await stream.receive_some(2) == b"ok"
            local_port = stream.socket.getsockname()[1]
            await stream.aclose()
            nursery.cancel_scope.cancel()
        assert seen == [Multiaddr.parse(f"/ip4/127.0.0.1/tcp/{local_port}")]

    trio.run(main)


def test_peerstore_is_bounded_and_normalises() -> None:
    store = PeerStore(max_peers=2, max_addrs_per_peer=2)
    ids = [Identity.from_seed(bytes([i])).peer_id for i in range(3)]
    store.add_addrs(ids[0], ["/ip4/1.1.1.1/tcp/1", "/ip4/1.1.1.1/tcp/2", "/ip4/1.1.1.1/tcp/3"])
    assert [str(a.transport_part()) for a in store.addrs_of(ids[0])] == [
        "/ip4/1.1.1.1/tcp/1",
        "/ip4/1.1.1.1/tcp/2",
    ]
    assert all(a.peer_id == ids[0] for a in store.addrs_of(ids[0]))
    # an address naming another peer is ignored
    store.add_addrs(ids[1], [Multiaddr.parse("/ip4/2.2.2.2/tcp/1").with_peer(ids[2])])
    assert ids[1] not in store
    store.add_addrs(ids[1], ["/ip4/2.2.2.2/tcp/1"])
    store.add_addrs(ids[2], ["/ip4/3.3.3.3/tcp/1"])
    assert len(store) == 2 and ids[0] not in store  # least recently used evicted


def test_simultaneous_dial_on_the_simulator_keeps_the_smaller_ids_connection() -> None:
    config = NodeConfig(drain_grace=1.0)

    async def main() -> None:
        net = SimNetwork(seed=5)
        async with open_sim_nodes(net, 2, config=config, latency=0.05) as (a, b):
            a.add_handler("echo", echo)
            b.add_handler("echo", echo)
            async with trio.open_nursery() as nursery:  # both dial at the same virtual instant
                nursery.start_soon(a.connect, b.addrs[0])
                nursery.start_soon(b.connect, a.addrs[0])
            await trio.sleep(0.2)  # the inbound halves finish their handshakes too
            assert a.num_connections == 2 and b.num_connections == 2  # the race happened
            smaller = min(a.peer_id, b.peer_id)
            ca, cb = a.connection_to(b.peer_id), b.connection_to(a.peer_id)
            assert ca is not None and cb is not None
            assert ca.initiator == cb.initiator == smaller
            await trio.sleep(5)  # the duplicate drains, idle, and is closed
            assert a.num_connections == 1 and b.num_connections == 1
            assert await a.call(b.peer_id, "echo", 1) == 1
            assert await b.call(a.peer_id, "echo", 2) == 2
            assert a.num_connections == 1 and b.num_connections == 1

    run_sim(main)


def test_a_call_crossing_the_peers_goaway_is_retried_on_a_new_connection() -> None:
    async def main() -> None:
        net = SimNetwork(seed=4)
        async with open_sim_nodes(net, 2, latency=0.05) as (a, b):
            calls = []

            async def count(ctx: CallContext, request: Any) -> Any:
                calls.append(request)
                return request

            a.add_handler("count", count)
            assert await b.call(a.addrs[0], "count", 0) == 0
            conn = a.connection_to(b.peer_id)
            assert conn is not None
            async with trio.open_nursery() as nursery:
                # a closes the connection (say, idle) while b's next call is on the wire
                nursery.start_soon(conn.mux.aclose, "idle")
                assert await b.call(a.peer_id, "count", 1) == 1
            assert calls == [0, 1]  # delivered once, on a fresh connection
            assert b.connection_to(a.peer_id) is not None

    run_sim(main)


def test_nodes_ask_the_allocator_to_keep_freed_memory_once_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The setting is process-wide: made by the first node that wants it, never by one that
    opted out (p2p.node.retain_freed_memory itself is replaced here)."""
    import p2p.node

    calls: list[str] = []
    monkeypatch.setattr(p2p.node, "retain_freed_memory", lambda: calls.append("set") or True)
    monkeypatch.setattr(p2p.node, "_allocator_settled", False)

    async def main() -> None:
        opted_out = NodeConfig.testing().replace(retain_freed_memory=False)
        async with open_node(config=opted_out, listen=()):
            pass
        assert calls == []
        async with open_node(config=NodeConfig.testing(), listen=()):
            pass
        async with open_node(config=NodeConfig.testing(), listen=()):
            pass
        assert calls == ["set"]

    trio.run(main)
