"""A hole punch that cannot even start must leave the node, and its relayed connection, alive.

A coordinator behind a 1:1 NAT or a port forward announces an address that is no local
interface; the punch used to bind that address (OSError 99), outside any ``try``, in the NAT
manager's nursery, so the first relayed dial took the whole node down.
"""

from __future__ import annotations

import trio

from p2p.multiaddr import Multiaddr
from p2p.nat import NATConfig, Reachability, open_nat
from p2p.nat.holepunch import local_ipv4
from p2p.node import open_node

ANNOUNCED = "/ip4/203.0.113.7/tcp/4001"  # TEST-NET-3: never a local interface


async def echo(ctx, request):
    return request


def test_local_ip_is_a_bound_listen_address_never_an_announced_one() -> None:
    listen = [Multiaddr.parse("/ip4/10.0.0.5/tcp/4001")]
    assert local_ipv4(listen) == "10.0.0.5"
    assert local_ipv4([Multiaddr.parse("/ip4/0.0.0.0/tcp/4001")]) == "0.0.0.0"
    assert local_ipv4([]) == "0.0.0.0"


def test_punch_from_an_announced_public_address_keeps_the_node_and_the_relay() -> None:
    async def main() -> None:
        public = NATConfig.testing().replace(force_reachability=Reachability.PUBLIC)
        private = NATConfig.testing().replace(force_reachability=Reachability.PRIVATE)
        async with (
            open_node() as relay,
            open_nat(relay, config=public),
            open_node() as volunteer,
            open_nat(volunteer, relays=[relay.addrs[0]], config=private) as vnat,
            open_node(announce=[ANNOUNCED]) as coordinator,
            open_nat(coordinator, config=public) as cnat,
        ):
            volunteer.add_handler("echo", echo)
            assert vnat.relayed_addrs, "the volunteer holds a reservation"
            assert coordinator.addrs[0].host == "203.0.113.7"
            await coordinator.connect(vnat.relayed_addrs[0])  # starts the automatic punch
            puncher = cnat.puncher
            assert puncher is not None
            with trio.fail_after(20):
                while puncher.failed + puncher.upgraded == 0:
                    await trio.sleep(0.05)
            assert puncher.failed == 1 and puncher.upgraded == 0
            conn = coordinator.connection_to(volunteer.peer_id)
            assert conn is not None and conn.remote_addr is not None
            assert conn.remote_addr.is_relayed
            assert await coordinator.call(volunteer.peer_id, "echo", "still here") == "still here"
            # an explicit upgrade fails the same quiet way
            assert await puncher.upgrade(volunteer.peer_id) is False
            assert puncher.failed == 2

    trio.run(main)
