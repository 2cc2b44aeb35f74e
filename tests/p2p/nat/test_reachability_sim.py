"""Reachability detection and client mode on the simulator (NAT = ``reachable=False``)."""

from __future__ import annotations

from contextlib import AsyncExitStack

import trio

from p2p.dht import DHTConfig, open_dht
from p2p.dht.wire import Contact
from p2p.multiaddr import Multiaddr
from p2p.nat import NATConfig, Reachability, Role, open_nat
from p2p.nat.discovery import advertise_relay, find_relays, lookup_addrs, publish_addrs
from p2p.nat.observed import IDENTIFY, handle_identify
from p2p.node import NodeConfig, open_node
from p2p.testing import SimNetwork, run_sim, sim_identity
from tests.p2p.nat.simworld import SimWorld


async def _echo(ctx, request):
    return {"echo": request, "from": str(ctx.remote_peer)}


class World(SimWorld):
    echo = staticmethod(_echo)

    async def nat(self, node, peers, config=NATConfig.testing(), **kwargs):
        return await self.stack.enter_async_context(
            open_nat(node, peers=[str(p.addrs[0]) for p in peers], config=config, **kwargs)
        )


FAST = DHTConfig.fast()


def world_run(body):
    async def main():
        async with AsyncExitStack() as stack:
            await body(World(stack, SimNetwork(seed=2)))

    run_sim(main)


def test_public_and_private_peers_are_told_apart():
    async def body(w: World):
        publics = [await w.node(reachable=True) for _ in range(3)]
        nats = [await w.nat(n, [p for p in publics if p is not n]) for n in publics]
        for nat in nats:  # the first ones had nobody ready to dial them back: ask again
            await nat.check()
        assert [nat.reachability for nat in nats] == [Reachability.PUBLIC] * 3
        assert all(nat.role is Role.PUBLIC and not nat.client_mode for nat in nats)
        for node, nat in zip(publics, nats, strict=True):  # the dial-back proved the listen address
            assert [a.with_peer(node.peer_id) for a in nat.public_addrs] == node.addrs

        hidden = await w.node(reachable=False)
        direct = list(hidden.addrs)
        nat = await w.nat(hidden, publics)
        assert nat.reachability is Reachability.PRIVATE
        # it holds reservations on two of the public peers and advertises relayed addresses
        assert nat.role is Role.RELAYED and not nat.client_mode
        assert len(nat.relayed_addrs) == 2
        assert hidden.addrs[:2] == nat.relayed_addrs and hidden.addrs[2:] == direct
        assert all(a.peer_id == hidden.peer_id and a.is_relayed for a in nat.relayed_addrs)
        # a public peer reaches it by its relayed address
        reply = await publics[2].call(nat.relayed_addrs[0], "echo", "hi")
        assert reply == {"echo": "hi", "from": str(publics[2].peer_id)}

    world_run(body)


def test_unreachable_peer_without_relay_becomes_a_dht_client():
    async def body(w: World):
        no_relay = NATConfig.testing().replace(offer_relay=False)
        boot = await w.node(reachable=True)
        boot_nat = await w.nat(boot, [], config=no_relay.replace(force_reachability="public"))
        assert boot_nat.reachability is Reachability.PUBLIC
        helpers = [await w.node(reachable=True) for _ in range(2)]
        for h in helpers:
            await w.nat(h, [boot], config=no_relay)
        boot_dht = await w.stack.enter_async_context(open_dht(boot, config=DHTConfig.fast()))
        for h in helpers:
            await w.stack.enter_async_context(
                open_dht(h, initial_peers=[boot.addrs[0]], config=DHTConfig.fast())
            )

        hidden = await w.node(reachable=False)
        nat = await w.nat(hidden, [boot, *helpers])
        assert nat.reachability is Reachability.PRIVATE
        assert nat.relayed_addrs == []  # every relay refused: none offers the service
        assert nat.role is Role.CLIENT and nat.client_mode
        dht = await w.stack.enter_async_context(
            open_dht(
                hidden,
                initial_peers=[boot.addrs[0]],
                config=DHTConfig.fast(),
                client_mode=nat.client_mode,
            )
        )
        # a client can store and read, but nobody puts it in a routing table
        assert (await dht.store("k", "v", dht.now() + 60)).ok
        assert (await boot_dht.get("k")).value == "v"
        assert hidden.peer_id not in boot_dht.routing
        assert all(hidden.peer_id not in d.routing for d in [boot_dht])

        nat.force(Reachability.PUBLIC)  # the user knows better (e.g. a forwarded port)
        assert nat.role is Role.PUBLIC and not nat.client_mode

    world_run(body)


def test_forced_client_mode_and_forced_verdict_skip_detection():
    async def body(w: World):
        boot = await w.node(reachable=True)
        await w.nat(boot, [], config=NATConfig.testing().replace(force_reachability="public"))
        forced = NATConfig.testing().replace(force_client_mode=True)
        nat = await w.nat(await w.node(reachable=True), [boot], config=forced)
        assert nat.role is Role.CLIENT and nat.client_mode
        told = NATConfig.testing().replace(force_reachability=Reachability.PRIVATE, max_relays=1)
        hidden_nat = await w.nat(await w.node(reachable=True), [boot], config=told)
        # forced private (though reachable): it went for a relay instead of probing
        assert hidden_nat.reachability is Reachability.PRIVATE
        assert hidden_nat.role is Role.RELAYED
        assert hidden_nat.answers == []

    world_run(body)


def test_verdict_follows_a_change_of_reachability():
    async def body(w: World):
        publics = [await w.node(reachable=True) for _ in range(2)]
        for p in publics:
            await w.nat(p, [q for q in publics if q is not p])
        host = w.net.add_host("roamer", reachable=False)
        node = await w.stack.enter_async_context(
            open_node(
                sim_identity(w.net, 99),
                transport=host.transport,
                listen=[host.listen_addr],
                config=NodeConfig.testing(),
            )
        )
        nat = await w.nat(node, publics)
        assert nat.role is Role.RELAYED
        host.reachable = True  # e.g. the user forwarded a port
        changed = trio.Event()
        with trio.move_on_after(NATConfig.testing().autonat.recheck_interval + 60):
            while nat.reachability is not Reachability.PUBLIC:
                await nat.wait_changed()
            changed.set()
        assert changed.is_set()
        assert nat.role is Role.PUBLIC
        await trio.sleep(1)
        assert nat.relayed_addrs == []
        assert not any(a.is_relayed for a in node.addrs)

    world_run(body)


def test_relays_and_relayed_addresses_are_found_through_the_dht():
    async def body(w: World):
        boot = await w.node(reachable=True)
        await w.nat(boot, [], config=NATConfig.testing().replace(force_reachability="public"))
        boot_dht = await w.stack.enter_async_context(open_dht(boot, config=DHTConfig.fast()))
        assert await advertise_relay(boot_dht, boot)

        hidden = await w.node(reachable=False)
        nat = await w.nat(
            hidden, [boot], relays=[], config=NATConfig.testing().replace(max_relays=0)
        )
        assert nat.role is Role.CLIENT
        dht = await w.stack.enter_async_context(
            open_dht(
                hidden, initial_peers=[boot.addrs[0]], config=DHTConfig.fast(), client_mode=True
            )
        )
        relays = await find_relays(dht)
        assert relays == [boot.addrs[0]]
        nat.config = nat.config.replace(max_relays=1)
        assert await nat.ensure_relays(relays) == 1
        assert nat.role is Role.RELAYED
        assert await publish_addrs(dht, hidden)

        other = await w.node(reachable=False)
        await w.nat(other, [boot], config=NATConfig.testing().replace(max_relays=0))
        other_dht = await w.stack.enter_async_context(
            open_dht(
                other, initial_peers=[boot.addrs[0]], config=DHTConfig.fast(), client_mode=True
            )
        )
        found = await lookup_addrs(other_dht, hidden.peer_id)
        assert found[0] == nat.relayed_addrs[0]
        reply = await other.call(hidden.peer_id, "echo", 7)  # by peer ID: the peerstore knows
        assert reply == {"echo": 7, "from": str(other.peer_id)}

    world_run(body)


def test_the_nat_manager_keeps_the_dht_in_step_with_its_role():
    async def body(w: World):
        boot = await w.node(reachable=True)
        boot_nat = await w.nat(
            boot, [], config=NATConfig.testing().replace(force_reachability="public")
        )
        boot_dht = await w.stack.enter_async_context(open_dht(boot, config=DHTConfig.fast()))
        boot_nat.use_dht(boot_dht)  # advertises itself as a relay

        # a private node that was given no relay and tried none (max_relays=0 at first)
        hidden = await w.node(reachable=False)
        nat = await w.nat(hidden, [boot], config=NATConfig.testing().replace(max_relays=0))
        assert nat.role is Role.CLIENT
        dht = await w.stack.enter_async_context(
            open_dht(
                hidden, initial_peers=[boot.addrs[0]], config=DHTConfig.fast(), client_mode=True
            )
        )
        nat.config = nat.config.replace(max_relays=1)
        nat.use_dht(dht)  # finds the advertised relay, reserves, publishes its relayed address
        with trio.fail_after(30):
            while nat.role is not Role.RELAYED:
                await nat.wait_changed()
        assert nat.relayed_addrs[0].relay_parts()[0] == boot.addrs[0]
        with trio.fail_after(30):
            while not await lookup_addrs(boot_dht, hidden.peer_id):
                await trio.sleep(1)
        assert (await lookup_addrs(boot_dht, hidden.peer_id))[0] == nat.relayed_addrs[0]

    world_run(body)


def test_each_observation_round_asks_a_few_connected_peers_in_turn():
    """A node of a large collaboration is connected to hundreds of peers: each round asks
    ``observers`` of them how they see it (different ones each round), not all of them."""

    async def body(w: World):
        node = await w.node(reachable=True)
        others = [await w.node(reachable=True) for _ in range(10)]
        for o in others:
            o.add_handler(IDENTIFY, handle_identify)
            await o.call(node.addrs[0], "echo", "hi")  # connected, and not in the NAT's peers
        asked: list[str] = []
        call = node.call

        async def spy(peer, name, request, **kwargs):
            if name == "nat.identify":
                asked.append(str(peer))
            return await call(peer, name, request, **kwargs)

        node.call = spy
        config = NATConfig.testing().replace(observers=4, force_reachability="public")
        nat = await w.nat(node, [], config=config, background=False)
        rounds = [list(asked)]  # the first check's
        for _ in range(3):
            asked.clear()
            await nat._identify_all(nat._observers())
            rounds.append(list(asked))
        # in turn: everyone asked by the third round, each once (a peer asked over the
        # connection it still has is not asked again: see the next test)
        assert [len(r) for r in rounds] == [4, 4, 2, 0]
        assert len({p for r in rounds for p in r}) == 10
        assert (
            len(nat.observed.addrs()) == 1
            and len(nat.observed._seen[nat.observed.addrs()[0]]) == 10
        )

    world_run(body)


def test_a_peer_is_identified_once_per_connection_and_its_report_kept():
    """The address a connection was seen from cannot change while it is open: each
    observation round renews the report of a peer already asked over the connection it still
    has (no RPC), past the reports' lifetime; a new connection is asked again."""

    async def body(w: World):
        node = await w.node(reachable=True)
        others = [await w.node(reachable=True) for _ in range(3)]
        for o in others:
            o.add_handler(IDENTIFY, handle_identify)
            await o.call(node.addrs[0], "echo", "hi")
        asked: list[str] = []
        call = node.call

        async def spy(peer, name, request, **kwargs):
            if name == "nat.identify":
                asked.append(str(peer))
            return await call(peer, name, request, **kwargs)

        node.call = spy
        config = NATConfig.testing().replace(observers=4, force_reachability="public")
        nat = await w.nat(node, [], config=config, background=False)
        for _ in range(8):  # past the reports' lifetime (1800 s)
            await nat._identify_all(nat._observers())
            for _ in range(50):
                await trio.sleep(5)
                for o in others:  # the connections stay busy (not closed as idle)
                    await o.call(node.addrs[0], "echo", "hi")
        assert sorted(asked) == sorted(str(o.peer_id) for o in others), asked
        await nat._identify_all(nat._observers())
        [addr] = nat.observed.addrs()
        assert len(nat.observed._seen[addr]) == 3  # still reported by all three
        asked.clear()
        await node.disconnect(others[0].peer_id)
        await trio.sleep(1)  # the close reached the other end
        await others[0].call(node.addrs[0], "echo", "again")
        assert node.connection_to(others[0].peer_id) is not None
        await nat._identify_all(nat._observers())
        assert asked == [str(others[0].peer_id)], (asked, [str(o.peer_id) for o in others])

    world_run(body)


def test_reachability_changing_mid_run_moves_relays_addresses_and_dht_mode():
    """A reachable node loses its inbound path mid-run (a port forward removed), then gets it
    back: each time the periodic re-check notices, and its relay reservations, advertised
    addresses and DHT mode follow (private: DHT client, reachable through relays only)."""

    async def body(w: World):
        publics = [await w.node(reachable=True) for _ in range(3)]
        dhts = []
        for i, p in enumerate(publics):
            nat = await w.nat(p, [q for q in publics if q is not p])
            dht = await w.stack.enter_async_context(
                open_dht(p, initial_peers=[publics[0].addrs[0]] if i else [], config=FAST)
            )
            nat.use_dht(dht)
            dhts.append(dht)
        host = w.net.add_host("roamer", reachable=True)
        node = await w.stack.enter_async_context(
            open_node(
                sim_identity(w.net, 99),
                transport=host.transport,
                listen=[host.listen_addr],
                config=NodeConfig.testing(),
            )
        )
        node.add_handler("echo", _echo)
        direct = list(node.addrs)
        nat = await w.nat(node, publics)
        dht = await w.stack.enter_async_context(
            open_dht(node, initial_peers=[publics[0].addrs[0]], config=FAST)
        )
        nat.use_dht(dht)
        assert nat.reachability is Reachability.PUBLIC and not dht.client_mode
        assert await dhts[1].protocol.ping(Contact(node.peer_id, ()))  # a DHT server

        async def until(reachability):
            with trio.fail_after(NATConfig.testing().autonat.recheck_interval + 120):
                while nat.reachability is not reachability:
                    await nat.wait_changed()

        host.reachable = False  # the forwarded port is gone; its connections stay up
        await until(Reachability.PRIVATE)
        assert nat.role is Role.RELAYED and dht.client_mode and nat.dht_client_mode
        assert not nat.client_mode  # it still averages: others reach it through its relays
        assert node.addrs[: len(nat.relayed_addrs)] == nat.relayed_addrs
        assert nat.relayed_addrs and all(a.is_relayed for a in nat.relayed_addrs)
        assert not await dhts[1].protocol.ping(Contact(node.peer_id, ()))  # serves no DHT
        assert (await dht.store("k", "private", dht.now() + 60)).ok  # but uses it
        # a newcomer finds its relayed addresses in the DHT and reaches it by peer ID
        newcomer = await w.node(reachable=True)
        newcomer_dht = await w.stack.enter_async_context(
            open_dht(newcomer, initial_peers=[publics[0].addrs[0]], config=FAST)
        )
        with trio.fail_after(60):
            while not any(a.is_relayed for a in await lookup_addrs(newcomer_dht, node.peer_id)):
                await trio.sleep(1)
        await w.stack.enter_async_context(open_nat(newcomer, config=NATConfig.testing()))
        reply = await newcomer.call(node.peer_id, "echo", "via relay")
        assert reply["echo"] == "via relay"
        assert newcomer.connection_to(node.peer_id).remote_addr.is_relayed

        host.reachable = True  # forwarded again
        await until(Reachability.PUBLIC)
        await trio.sleep(1)
        assert nat.role is Role.PUBLIC and not dht.client_mode
        assert nat.relayed_addrs == [] and not any(a.is_relayed for a in node.addrs)
        assert set(direct) <= set(node.addrs)
        assert await dhts[2].protocol.ping(Contact(node.peer_id, ()))  # serves the DHT again
        # and its published addresses no longer name the relays it dropped
        with trio.fail_after(60):
            while any(a.is_relayed for a in await lookup_addrs(newcomer_dht, node.peer_id)):
                await trio.sleep(5)

    world_run(body)


def test_a_dial_back_of_silently_dropped_addresses_answers_failed_within_the_askers_wait():
    """Behind a router that drops unsolicited SYNs every dial-back hangs until its timeout;
    a server that dialed the addresses one after the other answered after the asker gave
    up (an error, no verdict). Dialed at once, the answer is "failed" in one timeout."""
    from p2p.nat.autonat import AutoNATConfig, DialBackServer, ask_dial_back

    async def main():
        net = SimNetwork(seed=6, silent_failures=True)
        async with AsyncExitStack() as stack:
            nodes = []
            for i, reachable in enumerate([True, False]):
                host = net.add_host(f"d{i}", reachable=reachable)
                nodes.append(
                    await stack.enter_async_context(
                        open_node(
                            sim_identity(net, i),
                            transport=host.transport,
                            listen=[host.listen_addr],
                            config=NodeConfig.testing(),
                        )
                    )
                )
            server, hidden = nodes
            config = AutoNATConfig.testing().replace(dial_timeout=2.0, request_timeout=5.0)
            DialBackServer(server, config).register()
            await hidden.connect(server.addrs[0])
            base = str(hidden.addrs[0].transport_part()).rsplit("/", 1)[0]
            addrs = [Multiaddr.parse(f"{base}/{port}") for port in (4001, 4002, 4003)]
            start = trio.current_time()
            answer = await ask_dial_back(hidden, server.peer_id, addrs, config)
            return answer, trio.current_time() - start

    answer, took = run_sim(main)
    assert answer.status == "failed", answer  # a verdict, not the asker's timeout
    assert took < 5.0 and answer.reason.count("timed out") == 3


def test_a_check_whose_dial_backs_all_err_keeps_the_verdict():
    """Errors and refusals say nothing about our reachability: a private, relayed node whose
    re-check heard only errors stays private (a DHT client, no relay service) instead of
    turning "unknown" and serving the DHT from behind its NAT."""
    from p2p.nat.autonat import DIAL_BACK

    async def body(w: World):
        publics = [await w.node(reachable=True) for _ in range(2)]
        for p in publics:
            await w.nat(p, [q for q in publics if q is not p])
        hidden = await w.node(reachable=False)
        nat = await w.nat(hidden, publics, background=False)
        assert nat.reachability is Reachability.PRIVATE and nat.role is Role.RELAYED
        for p in publics:
            p.remove_handler(DIAL_BACK)  # every dial-back request now ends in an error
        assert await nat.check() is Reachability.PRIVATE
        assert {a.status for a in nat.answers} == {"error"}
        assert nat.role is Role.RELAYED and nat.dht_client_mode and not nat.relay.enabled

    world_run(body)


def test_a_relay_advert_goes_to_a_few_nodes():
    """A public relay renews its advert every advert_interval (13 renewals in an hour), each
    on advert_replicas nodes (6; before: the DHT's replication, 20, here all 12 nodes): at
    most 8 nodes hold it, and a private node still finds it."""

    async def body(w: World):
        publics = [await w.node(reachable=True) for _ in range(12)]
        dhts = []
        for i, node in enumerate(publics):
            initial = [publics[0].addrs[0]] if i else []
            dhts.append(
                await w.stack.enter_async_context(
                    open_dht(node, initial_peers=initial, config=DHTConfig.fast())
                )
            )
        config = NATConfig.testing().replace(force_reachability="public")
        relay_nat = await w.nat(publics[5], [], config=config)
        traffic = dhts[5].protocol.traffic
        start = trio.current_time()
        relay_nat.use_dht(dhts[5])
        await trio.sleep(3600 - 1)
        assert trio.current_time() - start < 3600
        stores = traffic.requests["dht.store/nat.relays"]
        holders = sum(1 for d in dhts if "nat.relays" in d.storage)
        assert holders <= 8, holders  # replicas and the relay's own, repair, caches
        assert stores <= 14 * 6, stores  # 13 renewals to 6 replicas (+1 for a slow one)

        hidden = await w.node(reachable=False)
        dht = await w.stack.enter_async_context(
            open_dht(
                hidden,
                initial_peers=[publics[1].addrs[0]],
                config=DHTConfig.fast(),
                client_mode=True,
            )
        )
        assert await find_relays(dht) == [publics[5].addrs[0]]

    world_run(body)
