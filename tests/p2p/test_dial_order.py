"""Dialing a peer with several addresses when some of them silently drop (as foreign private
addresses do on the Internet): the advertised order is kept, the addresses are dialed
staggered in parallel, and no attempt outlives the caller's deadline."""

from __future__ import annotations

from contextlib import AsyncExitStack
from functools import partial

import pytest
import trio

from p2p.errors import DialError
from p2p.identity import Identity
from p2p.nat import RelayConfig, RelayService, attach, circuit_addr
from p2p.node import NodeConfig, open_node
from p2p.peerstore import PeerStore
from p2p.testing import SimNetwork, run_sim, sim_identity

DHT_TIMEOUT = 2.0  # the request timeout of the DHT preset Collaboration uses


async def echo(ctx, request):
    return request


def test_peerstore_keeps_the_advertised_order() -> None:
    store = PeerStore()
    peer = Identity.from_seed(b"p").peer_id
    relay = Identity.from_seed(b"r").peer_id
    advertised = [
        "/ip4/203.0.113.7/tcp/4001",
        f"/ip4/198.51.100.1/tcp/1/p2p/{relay}/p2p-circuit/p2p/{peer}",
        "/ip4/192.168.1.20/tcp/4001",
    ]
    store.add_addrs(peer, advertised)
    assert [str(a) for a in store.addrs_of(peer)] == [
        advertised[0] + f"/p2p/{peer}",
        advertised[1],
        advertised[2] + f"/p2p/{peer}",
    ]
    # a later batch (e.g. the address a dial just proved) goes first, the rest stay in order
    store.add_addrs(peer, [advertised[2]])
    assert [str(a.transport_part()) for a in store.addrs_of(peer)][0] == advertised[2]
    assert len(store.addrs_of(peer)) == 3


async def _world(stack: AsyncExitStack, nursery: trio.Nursery, net: SimNetwork):
    """A public relay, a NATed target holding a reservation on it, and a public dialer; the
    network drops dials to the target's own address without an answer."""
    nodes = []
    for i, reachable in enumerate((True, False, True)):
        host = net.add_host(f"h{i}", reachable=reachable)
        node = await stack.enter_async_context(
            open_node(sim_identity(net, i), transport=host.transport, listen=[host.listen_addr])
        )
        nodes.append(node)
    relay, target, dialer = nodes
    RelayService(relay, RelayConfig()).register()
    ct = attach(target)
    relayed = await nursery.start(ct.listen, relay.addrs[0], target.accept_inbound)
    assert relayed == circuit_addr(relay.addrs[0], target.peer_id)
    attach(dialer)
    target.add_handler("echo", echo)
    return target, dialer, relayed


@pytest.mark.parametrize("relay_first", [True, False], ids=["advertised", "dead-first"])
def test_a_dead_address_does_not_eat_a_dht_request_to_a_relayed_peer(relay_first) -> None:
    async def main() -> None:
        net = SimNetwork(seed=3, silent_failures=True)
        async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
            target, dialer, relayed = await _world(stack, nursery, net)
            dead = target.addrs[0]  # the target's own address: behind its NAT, it drops
            if relay_first:  # as advertised
                dialer.peerstore.add_addrs(target.peer_id, [relayed, dead])
            else:  # the dead address learned last, so tried first
                dialer.peerstore.add_addrs(target.peer_id, [relayed])
                dialer.peerstore.add_addrs(target.peer_id, [dead])
            assert dialer.peerstore.addrs_of(target.peer_id)[0] == (
                relayed if relay_first else dead
            )
            got = await dialer.call(target.peer_id, "echo", "hi", timeout=DHT_TIMEOUT)
            assert got == "hi"
            conn = dialer.connection_to(target.peer_id)
            assert conn is not None and conn.remote_addr == relayed
            nursery.cancel_scope.cancel()

    run_sim(main)


def test_a_dial_that_cannot_finish_fails_before_the_callers_deadline() -> None:
    async def main() -> None:
        net = SimNetwork(seed=4, silent_failures=True)
        async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
            target, dialer, _ = await _world(stack, nursery, net)
            dialer.peerstore.add_addrs(target.peer_id, [target.addrs[0]])
            start = trio.current_time()
            with pytest.raises(DialError, match="no connection within"):
                await dialer.call(target.peer_id, "echo", "hi", timeout=DHT_TIMEOUT)
            assert trio.current_time() - start < DHT_TIMEOUT  # virtual time: the attempt's cap
            nursery.cancel_scope.cancel()

    run_sim(main)


def test_staggered_dial_on_loopback_skips_a_listener_that_never_answers() -> None:
    """A TCP listener that accepts and then says nothing (a stuck peer) comes first; the
    real address, 250 ms later, wins and the stuck attempt is cancelled."""

    async def main() -> None:
        async def silent(stream: trio.SocketStream) -> None:
            await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, silent, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            async with open_node() as a, open_node(config=NodeConfig()) as b:
                b.add_handler("echo", echo)
                a.peerstore.add_addrs(b.peer_id, [b.addrs[0]])
                a.peerstore.add_addrs(b.peer_id, [f"/ip4/127.0.0.1/tcp/{port}"])  # tried first
                assert await a.call(b.peer_id, "echo", 7, timeout=DHT_TIMEOUT) == 7
                assert a.connection_to(b.peer_id).remote_addr == b.addrs[0]
            nursery.cancel_scope.cancel()

    trio.run(main)
