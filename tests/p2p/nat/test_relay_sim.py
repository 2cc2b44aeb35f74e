"""Relays and circuits on the simulator: unreachable peers reach each other end to end."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio

from p2p.errors import ConnectionClosed, DialError, P2PError, PeerIDMismatch
from p2p.nat import RelayConfig, RelayRefused, RelayService, attach, circuit_addr
from p2p.nat.relay import Circuit
from p2p.testing import SimNetwork, run_sim
from tests.p2p.nat.simworld import SimWorld

SECRET = b"attack at dawn: the known plaintext 0123456789"


class TappedRelay(RelayService):
    """A relay that keeps everything it forwards (to check it only sees ciphertext)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen = bytearray()

    def observe(self, circuit: Circuit, data):
        self.seen += bytes(data)
        return data


class RedirectingRelay(TappedRelay):
    """A malicious relay: every circuit goes to ``self.redirect`` whatever the dialer asked."""

    redirect = None

    def circuit_refusal(self, src, dst, relayed):
        return None

    async def _connect(self, ms, circuit):
        await super()._connect(ms, Circuit(circuit.src, self.redirect, circuit.started))


async def _echo(ctx, request):
    return {"echo": request, "from": str(ctx.remote_peer), "addr": str(ctx.remote_addr)}


class Lab(SimWorld):
    """One public relay and some unreachable peers on a simulated network."""

    echo = staticmethod(_echo)

    def __init__(self, stack: AsyncExitStack, nursery: trio.Nursery, net: SimNetwork) -> None:
        super().__init__(stack, net)
        self.nursery = nursery

    async def relay(self, cls=TappedRelay, config: RelayConfig = RelayConfig.testing()):
        node = await self.node(reachable=True)
        service = cls(node, config)
        service.register()
        return node, service

    async def private(self, relay_node=None):
        """An unreachable node, holding a reservation on ``relay_node`` if given."""
        node = await self.node(reachable=False)
        ct = attach(node)
        if relay_node is not None:
            mine = await self.nursery.start(ct.listen, relay_node.addrs[0], node.accept_inbound)
            assert mine == circuit_addr(relay_node.addrs[0], node.peer_id)
        return node


def lab_run(body):
    async def main():
        net = SimNetwork(seed=1)
        async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
            await body(Lab(stack, nursery, net))
            nursery.cancel_scope.cancel()

    run_sim(main)


def test_two_unreachable_peers_talk_end_to_end_through_a_relay():
    async def body(lab: Lab):
        relay, service = await lab.relay()
        a = await lab.private(relay)
        b = await lab.private(relay)
        with pytest.raises(DialError):  # no direct path: both are behind NAT
            await a.call(b.addrs[0], "echo", 1)
        addr_b = circuit_addr(relay.addrs[0], b.peer_id)
        reply = await a.call(addr_b, "echo", {"msg": SECRET})
        assert reply["echo"] == {"msg": SECRET}
        assert reply["from"] == str(a.peer_id)  # b authenticated a, end to end
        assert "p2p-circuit" in reply["addr"]  # and knows a came through the relay
        conn = a.connection_to(b.peer_id)
        assert conn is not None and conn.remote_addr == addr_b
        # b can call back over the same circuit connection
        assert (await b.call(a.peer_id, "echo", "back"))["echo"] == "back"
        assert service.stats.circuits_opened == 1
        assert len(service.seen) > len(SECRET)  # the data did cross the relay ...
        assert SECRET not in service.seen  # ... but only as ciphertext
        assert SECRET[:16] not in service.seen

    lab_run(body)


def test_bulk_data_crosses_a_circuit_intact():
    async def body(lab: Lab):
        relay, service = await lab.relay(
            config=RelayConfig.testing().replace(max_circuit_bytes=64 << 20)
        )
        a = await lab.private(relay)
        b = await lab.private(relay)
        got = bytearray()

        async def sink(ctx, ms):
            async for msg in ms:
                got.extend(msg)
            await ms.send(len(got))

        b.add_stream_handler("sink", sink)
        blob = bytes(range(256)) * 4096  # 1 MiB
        async with a.open_stream(circuit_addr(relay.addrs[0], b.peer_id), "sink") as ms:
            for i in range(0, len(blob), 100_000):
                await ms.send(blob[i : i + 100_000])
            # wait for the answer: closing a stream the peer has not finished resets it, and
            # the reset may overtake the last pieces the sink has not read yet
            await ms.send_eof()
            assert await ms.receive() == len(blob)
        assert bytes(got) == blob
        assert service.stats.bytes_relayed > len(blob)

    lab_run(body)


def test_relay_refuses_reservations_past_its_limit():
    async def body(lab: Lab):
        relay, service = await lab.relay(config=RelayConfig.testing().replace(max_reservations=1))
        await lab.private(relay)
        late = await lab.private()
        with pytest.raises(RelayRefused, match="reservation limit reached"):
            await lab.nursery.start(attach(late).listen, relay.addrs[0], late.accept_inbound)
        assert service.stats.reservations_refused == 1
        assert len(service.reservations) == 1

    lab_run(body)


def test_relay_refuses_circuits_past_the_per_peer_limit_and_unknown_targets():
    async def body(lab: Lab):
        relay, service = await lab.relay(
            config=RelayConfig.testing().replace(max_circuits_per_peer=1)
        )
        target = await lab.private(relay)
        addr = circuit_addr(relay.addrs[0], target.peer_id)
        first = await lab.private()
        second = await lab.private()
        assert (await first.call(addr, "echo", 1))["echo"] == 1
        with pytest.raises(RelayRefused, match="circuit limit per peer") as info:
            await attach(second).dial(addr)
        assert str(target.peer_id) in info.value.reason
        # a peer without a reservation cannot be reached through the relay
        stranger = await lab.node(reachable=False)
        with pytest.raises(RelayRefused, match="no reservation"):
            await attach(second).dial(circuit_addr(relay.addrs[0], stranger.peer_id))
        assert service.stats.circuits_refused == 2

    lab_run(body)


def test_circuit_past_its_byte_budget_is_closed():
    async def body(lab: Lab):
        relay, service = await lab.relay(
            config=RelayConfig.testing().replace(max_circuit_bytes=200_000)
        )
        a = await lab.private(relay)
        attach(a).renew_at = None  # the relay's cut itself (one stream cannot change circuits)
        b = await lab.private(relay)

        async def sink(ctx, ms):
            async for _ in ms:
                pass

        b.add_stream_handler("sink", sink)
        with pytest.raises((ConnectionClosed, DialError)):
            async with a.open_stream(circuit_addr(relay.addrs[0], b.peer_id), "sink") as ms:
                for _ in range(100):
                    await ms.send(b"x" * 10_000)
                    await trio.sleep(0.01)
        assert service.stats.cuts == {"circuit data limit": 1}
        assert not service.circuits
        await trio.sleep(1)
        assert a.connection_to(b.peer_id) is None

    lab_run(body)


def test_circuit_past_its_duration_is_closed():
    async def body(lab: Lab):
        cfg = RelayConfig.testing().replace(max_circuit_duration=30.0)
        relay, service = await lab.relay(config=cfg)
        a = await lab.private(relay)
        attach(a).renew_at = None  # the relay's cut itself (one stream cannot change circuits)
        b = await lab.private(relay)
        addr = circuit_addr(relay.addrs[0], b.peer_id)

        async def hold(ctx, ms):
            async for _ in ms:
                pass

        b.add_stream_handler("hold", hold)
        started = trio.current_time()
        with pytest.raises(ConnectionClosed):
            async with a.open_stream(addr, "hold") as ms:
                while True:
                    await ms.send(b"tick")
                    await trio.sleep(1)
        assert trio.current_time() - started == pytest.approx(30.0, abs=2.0)
        assert service.stats.circuits_cut == 1
        assert service.stats.cuts == {"circuit duration limit": 1}
        assert a.connection_to(b.peer_id) is None

    lab_run(body)


def test_a_relayed_address_cannot_be_claimed_for_another_peer():
    async def body(lab: Lab):
        relay, service = await lab.relay()
        victim = await lab.private()  # no reservation anywhere
        mallory = await lab.private(relay)  # holds a reservation under her own ID
        alice = await lab.private()
        forged = circuit_addr(relay.addrs[0], victim.peer_id)
        # the honest relay binds reservations to the authenticated ID: none for the victim
        assert set(service.reservations) == {mallory.peer_id}
        with pytest.raises(DialError, match="no reservation"):
            await alice.call(forged, "echo", 1)

        # a lying relay that hands the circuit to mallory: the end-to-end handshake catches it
        evil, evil_service = await lab.relay(cls=RedirectingRelay)
        evil_service.redirect = mallory.peer_id
        await lab.nursery.start(attach(mallory).listen, evil.addrs[0], mallory.accept_inbound)
        with pytest.raises(PeerIDMismatch):
            await alice.call(circuit_addr(evil.addrs[0], victim.peer_id), "echo", 1)
        assert alice.connection_to(victim.peer_id) is None
        assert alice.connection_to(mallory.peer_id) is None

    lab_run(body)


def test_circuits_arrive_only_from_relays_we_hold_a_reservation_on():
    async def body(lab: Lab):
        relay, service = await lab.relay()
        target = await lab.private()
        attach(target)  # serves the stop protocol but reserved nowhere
        # the relay's node is connected to target (target dialed it) but holds no reservation
        await target.connect(relay.addrs[0])
        async with relay.open_stream(target.peer_id, "nat.relay.stop") as ms:
            await ms.send({"src": str(relay.peer_id)})
            answer = await ms.receive()
        assert answer == {"ok": False, "reason": "no reservation with this relay"}

    lab_run(body)


def test_reservations_are_renewed_without_losing_the_relayed_address():
    async def body(lab: Lab):
        relay, service = await lab.relay(config=RelayConfig.testing().replace(reservation_ttl=30.0))
        b = await lab.private(relay)
        ct = b.circuit_transport
        lost = []

        async def watch():
            while True:
                await ct.wait_changed()
                lost.append((trio.current_time(), dict(ct.reservations)))

        lab.nursery.start_soon(watch)
        await trio.sleep(100)  # three renewals
        assert lost == []  # the address never went away
        assert relay.peer_id in ct.reservations and b.peer_id in service.reservations
        a = await lab.private()
        reply = await a.call(circuit_addr(relay.addrs[0], b.peer_id), "echo", "still there")
        assert reply["echo"] == "still there"
        # when the relay goes, the reservation (and the relayed address) goes with it
        await relay.disconnect(b.peer_id)
        await trio.sleep(1)
        assert ct.reservations == {} and len(lost) == 1

    lab_run(body)


@pytest.mark.parametrize("renew", [True, False], ids=["renewed", "not-renewed"])
def test_circuits_are_renewed_before_the_relay_cuts_them(renew):
    """Averaging moves far more than one circuit's budget between two peers, over many
    rounds: the dialer replaces a circuit that carried half its byte budget (or lived half
    its duration) by a new one, so no call ever meets the relay's cut."""

    async def body(lab: Lab):
        cfg = RelayConfig.testing().replace(max_circuit_bytes=4 << 20, max_circuit_duration=60.0)
        relay, service = await lab.relay(config=cfg)
        a = await lab.private(relay)
        if not renew:
            attach(a).renew_at = None
        b = await lab.private(relay)
        addr = circuit_addr(relay.addrs[0], b.peer_id)

        async def digest(ctx, blob):
            return {"n": len(blob), "via": str(ctx.remote_addr)}

        b.add_handler("digest", digest)
        a.peerstore.add_addrs(b.peer_id, [addr])
        blob = bytes(range(256)) * 2048  # 512 KiB a call: 40 calls carry 5x the budget
        outcomes = []
        for _ in range(40):
            try:
                reply = await a.call(b.peer_id, "digest", blob)
                outcomes.append(reply["n"] == len(blob) and "/p2p-circuit/" in reply["via"])
            except P2PError as e:  # the cut stream's call, when not renewed
                outcomes.append(repr(e))
            await trio.sleep(2)  # 80 s in all: past the duration limit as well
        if renew:
            assert outcomes == [True] * 40
            assert service.stats.circuits_cut == 0
            assert attach(a).renewed >= 5 and service.stats.circuits_opened >= 6
            await trio.sleep(5)
            assert len(service.circuits) == 1  # the replaced circuits drained and closed
        else:
            assert service.stats.circuits_cut >= 1
            assert any(o is not True for o in outcomes)

    lab_run(body)


def test_a_peer_reached_only_through_a_relay_reserves_on_another_over_a_direct_connection():
    """A private peer whose only connection to a second relay came in through the first (the
    second dialed its relayed address, as a restarted coordinator does) takes its reservation
    there over a direct connection of its own: a relay refuses reservations over a relayed
    one, so the peer held none on the second relay and fell to 0 relays when the first died."""

    async def body(lab: Lab):
        first, _ = await lab.relay()
        second, service = await lab.relay()
        attach(second)  # dials relayed addresses
        v = await lab.node(reachable=False)
        ct = attach(v)
        await lab.nursery.start(ct.listen, first.addrs[0], v.accept_inbound)
        await second.connect(circuit_addr(first.addrs[0], v.peer_id))
        await trio.sleep(1)  # v has set up the connection it accepted
        via = v.connection_to(second.peer_id)
        assert via is not None and via.remote_addr is not None and via.remote_addr.is_relayed
        mine = await lab.nursery.start(ct.listen, second.addrs[0], v.accept_inbound)
        assert mine == circuit_addr(second.addrs[0], v.peer_id)
        assert v.peer_id in service.reservations and set(ct.reservations) == {
            first.peer_id,
            second.peer_id,
        }
        lab.net.kill(lab.net.hosts[first.addrs[0].value_of("sim")])  # the first relay dies
        other = await lab.private()
        reply = await other.call(mine, "echo", "still reachable")
        assert reply["echo"] == "still reachable"

    lab_run(body)
