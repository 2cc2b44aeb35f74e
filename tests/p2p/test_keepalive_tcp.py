"""Keepalive over real trio TCP sockets on loopback (short intervals through NodeConfig).

Between the two nodes sits a small TCP forwarder that counts the bytes it passes and can
turn into a black hole, as a NAT does when it forgets a mapping: it keeps both sockets open
and silently drops what arrives. An idle connection must carry PING/PONG frames and stay up
for longer than an unanswered ping would allow; a connection whose peer went silent must be
detected and closed, which nothing else does (without keepalive it stays open).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from p2p import CallContext, Multiaddr, NodeConfig, open_node

INTERVAL = 0.3
TIMEOUT = 2.0
IDLE = 4.0  # > INTERVAL + TIMEOUT: a live connection outlasts what an unanswered ping allows


async def echo(ctx: CallContext, request: Any) -> Any:
    return request


class Forwarder:
    """A loopback TCP forwarder to ``port`` that counts bytes and can black-hole them."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.passed = 0
        self.blackhole = False
        self.listen_port = 0

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.listen_port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._serve, listeners)

    async def _serve(self, inbound: trio.SocketStream) -> None:
        outbound = await trio.open_tcp_stream("127.0.0.1", self.port)
        async with inbound, outbound, trio.open_nursery() as nursery:
            nursery.start_soon(self._pipe, inbound, outbound, nursery.cancel_scope)
            nursery.start_soon(self._pipe, outbound, inbound, nursery.cancel_scope)

    async def _pipe(self, src: trio.SocketStream, dst: trio.SocketStream, scope: Any) -> None:
        try:
            while data := await src.receive_some(65536):
                if self.blackhole:
                    continue  # swallowed: the sender sees no error, the receiver nothing
                self.passed += len(data)
                await dst.send_all(data)
        except trio.BrokenResourceError:
            pass
        scope.cancel()


def _config(keepalive: bool) -> NodeConfig:
    return NodeConfig().replace(
        keepalive_interval=INTERVAL if keepalive else None,
        keepalive_timeout=TIMEOUT,
        idle_timeout=600.0,  # idle closing must not be what ends (or keeps) anything here
    )


async def _connected(a: Any, b: Any, forwarder: Forwarder, nursery: trio.Nursery) -> Any:
    a.add_handler("echo", echo)
    await nursery.start(forwarder.run)
    via = Multiaddr.parse(f"/ip4/127.0.0.1/tcp/{forwarder.listen_port}/p2p/{a.peer_id}")
    assert await b.call(via, "echo", 1) == 1
    conn = b.connection_to(a.peer_id)
    assert conn is not None
    return conn


@pytest.mark.parametrize("keepalive", [True, False], ids=["keepalive", "no-keepalive"])
def test_an_idle_connection_carries_pings_and_stays_up(keepalive: bool) -> None:
    out: dict[str, Any] = {}

    async def main() -> None:
        config = _config(keepalive)
        async with (
            open_node(config=config) as a,
            open_node(config=config) as b,
            trio.open_nursery() as nursery,
        ):
            port = a.addrs[0].value_of("tcp")
            forwarder = Forwarder(int(port))
            conn = await _connected(a, b, forwarder, nursery)
            before = forwarder.passed
            await trio.sleep(IDLE)  # nobody calls: only keepalive frames, if any, cross
            out["idle_bytes"] = forwarder.passed - before
            out["open"] = not conn.mux.is_closed and b.connection_to(a.peer_id) is conn
            assert await b.call(a.peer_id, "echo", 2) == 2
            out["same"] = b.connection_to(a.peer_id) is conn
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert out["open"] and out["same"], out  # the very same connection, never closed
    if keepalive:
        # at least a ping and its pong per interval's worth of idle time, on the wire
        assert out["idle_bytes"] > 0, out
    else:
        assert out["idle_bytes"] == 0, out  # so the bytes above were the keepalive


@pytest.mark.parametrize("keepalive", [True, False], ids=["keepalive", "no-keepalive"])
def test_a_peer_that_went_silent_is_detected_by_unanswered_pings(keepalive: bool) -> None:
    out: dict[str, Any] = {}

    async def main() -> None:
        config = _config(keepalive)
        async with (
            open_node(config=config) as a,
            open_node(config=config) as b,
            trio.open_nursery() as nursery,
        ):
            forwarder = Forwarder(int(a.addrs[0].value_of("tcp")))
            conn = await _connected(a, b, forwarder, nursery)
            forwarder.blackhole = True  # the path dies silently: no FIN, no RST
            start = trio.current_time()
            with trio.move_on_after(2 * INTERVAL + TIMEOUT + 4.0):
                while not conn.mux.is_closed:
                    await trio.sleep(0.05)
            out["closed"] = conn.mux.is_closed
            out["after"] = trio.current_time() - start
            out["forgotten"] = b.connection_to(a.peer_id) is None
            nursery.cancel_scope.cancel()

    trio.run(main)
    if keepalive:
        assert out["closed"] and out["forgotten"], out  # detected, and calls will redial
    else:
        assert not out["closed"] and not out["forgotten"], out  # a black hole, undetected
