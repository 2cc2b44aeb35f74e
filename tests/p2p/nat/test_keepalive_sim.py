"""Keepalive: an idle relay reservation behind a NAT that forgets quiet connections.

Home routers drop a TCP mapping after some minutes without traffic and then silently discard
the connection's packets; a NATed peer's only inbound path, its reservation on a relay, is a
connection that is idle most of the time. Keepalive pings keep the mapping open; without them
the relay holds a reservation on a dead connection and every circuit to the peer fails.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio

from p2p.errors import P2PError
from p2p.mux_frames import PING, PONG, decode_frame, encode_frame
from p2p.nat import RelayConfig, RelayService, attach
from p2p.node import NodeConfig, open_node
from p2p.testing import SimNetwork, run_sim, sim_identity

MAPPING_TIMEOUT = 120.0
IDLE = 600.0


async def _echo(ctx, request):
    return {"echo": request, "addr": str(ctx.remote_addr)}


def _outcome(keepalive: float | None) -> dict:
    """Reserve through a forgetful NAT, stay idle for ``IDLE`` s, then dial the relayed address."""
    out: dict = {}

    async def main():
        net = SimNetwork(seed=3)
        config = NodeConfig.testing().replace(keepalive_interval=keepalive, idle_timeout=3600.0)
        async with trio.open_nursery() as nursery, AsyncExitStack() as stack:

            async def node(i: int, *, reachable: bool, mapping: float | None = None):
                host = net.add_host(f"h{i}", reachable=reachable)
                host.nat_mapping_timeout = mapping
                return await stack.enter_async_context(
                    open_node(
                        sim_identity(net, i),
                        transport=host.transport,
                        listen=[host.listen_addr],
                        config=config,
                    )
                )

            relay = await node(0, reachable=True)
            RelayService(relay, RelayConfig.testing()).register()
            hidden = await node(1, reachable=False, mapping=MAPPING_TIMEOUT)
            hidden.add_handler("echo", _echo)
            mine = await nursery.start(attach(hidden).listen, relay.addrs[0], hidden.accept_inbound)
            first = relay.connection_to(hidden.peer_id)
            dialer = await node(2, reachable=True)
            attach(dialer)
            assert (await dialer.call(mine, "echo", 1))["echo"] == 1
            await dialer.disconnect(hidden.peer_id)

            await trio.sleep(IDLE)  # nobody calls anyone: only keepalives, if any, cross the NAT
            out["same_connection"] = relay.connection_to(hidden.peer_id) is first
            try:
                with trio.fail_after(30):
                    out["reply"] = await dialer.call(mine, "echo", 2)
            except (P2PError, trio.TooSlowError) as e:
                out["error"] = repr(e)
            nursery.cancel_scope.cancel()

    run_sim(main)
    return out


@pytest.mark.parametrize("keepalive", [15.0, None], ids=["keepalive", "no-keepalive"])
def test_an_idle_reservation_survives_a_forgetful_nat_only_with_keepalive(keepalive):
    out = _outcome(keepalive)
    if keepalive is not None:
        assert out.get("reply", {}).get("echo") == 2, out
        assert "/p2p-circuit/" in out["reply"]["addr"]  # through the relay
        assert out["same_connection"] is True  # the reservation's connection never broke
    else:
        assert "reply" not in out, out  # the relay's connection to the peer is a black hole
        assert "error" in out


def test_keepalive_is_on_by_default_and_pings_are_small_stream0_frames():
    assert NodeConfig().keepalive_interval is not None
    assert decode_frame(encode_frame(PING, 0, b"12345678"))[:2] == (PING, 0)
    assert decode_frame(encode_frame(PONG, 0))[:2] == (PONG, 0)
    with pytest.raises(P2PError):
        decode_frame(encode_frame(PING, 3, b""))  # only on stream 0
    with pytest.raises(P2PError):
        decode_frame(encode_frame(PING, 0, b"123456789"))  # at most 8 bytes
    with pytest.raises(ValueError):
        NodeConfig(keepalive_interval=0)


def test_a_connection_that_stops_answering_pings_is_closed():
    """The NAT forgot the connection before the first ping (interval > mapping timeout): no
    PONG ever comes, and the node closes the connection instead of keeping a black hole."""

    async def main():
        net = SimNetwork(seed=4)
        config = NodeConfig.testing().replace(
            keepalive_interval=300.0, keepalive_timeout=60.0, idle_timeout=3600.0
        )
        async with AsyncExitStack() as stack:
            hosts = [net.add_host(f"h{i}", reachable=i == 0) for i in range(2)]
            hosts[1].nat_mapping_timeout = MAPPING_TIMEOUT
            a, b = [
                await stack.enter_async_context(
                    open_node(
                        sim_identity(net, i),
                        transport=h.transport,
                        listen=[h.listen_addr],
                        config=config,
                    )
                )
                for i, h in enumerate(hosts)
            ]
            a.add_handler("echo", _echo)
            await b.call(a.addrs[0], "echo", 1)
            conn = b.connection_to(a.peer_id)
            assert conn is not None
            await trio.sleep(300.0 + 300.0 + 60.0 + 30.0)  # a ping, then the timeout
            assert conn.mux.is_closed
            assert b.connection_to(a.peer_id) is None
            # the next call dials afresh (a new mapping) and works
            assert (await b.call(a.addrs[0], "echo", 2))["echo"] == 2

    run_sim(main)


def test_an_idle_connection_carries_one_ping_a_minute_by_default():
    """A silent connection carries one PING (and its PONG) per keepalive interval, a minute
    by default, from whichever end's turn comes first, which a NAT that forgets quiet
    mappings after two minutes still sees in time. (Pinging at both ends every 15 s was 4%
    of a long DiLoCo run's bytes.)"""

    async def main():
        net = SimNetwork(seed=5)
        config = NodeConfig(idle_timeout=3600.0)
        async with AsyncExitStack() as stack:
            hosts = [net.add_host(f"h{i}", reachable=i == 0) for i in range(2)]
            hosts[1].nat_mapping_timeout = MAPPING_TIMEOUT
            a, b = [
                await stack.enter_async_context(
                    open_node(
                        sim_identity(net, i),
                        transport=h.transport,
                        listen=[h.listen_addr],
                        config=config,
                    )
                )
                for i, h in enumerate(hosts)
            ]
            a.add_handler("echo", _echo)
            await b.call(a.addrs[0], "echo", 1)
            conn = b.connection_to(a.peer_id)
            pings = [a.bytes_sent["mux/ping"], b.bytes_sent["mux/ping"]]
            await trio.sleep(IDLE)
            sent = a.bytes_sent["mux/ping"] - pings[0] + b.bytes_sent["mux/ping"] - pings[1]
            frame = encode_frame(PING, 0, b"")
            count = sent / (len(frame) + conn.mux._frame_overhead)
            assert 1 <= count <= IDLE / 60 + 1, count
            assert b.connection_to(a.peer_id) is conn and not conn.mux.is_closed
            assert (await b.call(a.addrs[0], "echo", 2))["echo"] == 2

    run_sim(main)
