"""The simulated network's addresses and dialing: dial errors, observed addresses, the
Transport interface, unreachable hosts (in virtual time)."""

from __future__ import annotations

import pytest
import trio

from p2p.errors import DialError
from p2p.multiaddr import Multiaddr
from p2p.testing import SimNetwork, run_sim
from tests.p2p.simhelpers import _first, _keep, _listen


def test_dial_errors_and_observed_address():
    async def main():
        net = SimNetwork()
        a, b = net.add_host("a"), net.add_host("b")
        seen: list[Multiaddr | None] = []

        async def handler(stream, remote):
            seen.append(remote)

        async with trio.open_nursery() as nursery:
            addr = await _listen(nursery, b, handler)
            assert addr.value_of("sim") == "b" and addr.port != 0
            for bad in ("/sim/nobody/tcp/1", f"/sim/b/tcp/{addr.port + 1}", "/ip4/1.2.3.4/tcp/5"):
                with pytest.raises(DialError):
                    await a.transport.dial(bad)
            with pytest.raises(OSError):
                await nursery.start(b.transport.listen, addr, handler)
            with pytest.raises(ValueError):
                await nursery.start(b.transport.listen, "/sim/a/tcp/0", handler)
            await a.transport.dial(addr)
            await _first(seen)
            assert seen and seen[0].value_of("sim") == "a" and seen[0].port
            nursery.cancel_scope.cancel()
        # the /ip4/ address is rejected before it counts as a dial
        assert (net.stats.dials, net.stats.failed_dials, net.stats.connections) == (3, 2, 1)
        # after the listener stopped, dials are refused
        with pytest.raises(DialError):
            await a.transport.dial(addr)

    run_sim(main)


def test_sim_transport_is_a_transport():
    from p2p.transport import Transport

    net = SimNetwork()
    assert isinstance(net.add_host().transport, Transport)
    assert isinstance(net.add_host().transport, Transport)
    assert sorted(net.hosts) == ["h0", "h1"]
    with pytest.raises(ValueError):
        net.add_host("h0")
    with pytest.raises(ValueError):
        net.add_host("bad/name")


def test_unreachable_host_dials_out_but_refuses_inbound():
    async def main():
        net = SimNetwork()
        public = net.add_host("public")
        natted = net.add_host("natted", reachable=False)
        peer: list[trio.abc.Stream] = []
        async with trio.open_nursery() as nursery:
            public_addr = await _listen(nursery, public, lambda s, r: _keep(peer, s))
            natted_addr = await _listen(nursery, natted, lambda s, r: _keep(peer, s))
            with pytest.raises(DialError, match="NAT"):
                await public.transport.dial(natted_addr)
            stream = await natted.transport.dial(public_addr)
            await (await _first(peer)).send_all(b"inbound over an outbound connection")
            assert await stream.receive_some() == b"inbound over an outbound connection"
            nursery.cancel_scope.cancel()

    run_sim(main)
