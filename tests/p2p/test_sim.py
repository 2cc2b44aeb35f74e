"""The simulated network: stream semantics, bandwidth/latency model, faults, determinism.

All tests run in virtual time (MockClock with autojump), so the durations asserted below are
the model's predictions, exact up to float rounding, not wall-clock measurements.
"""

from __future__ import annotations

import math
import random

import pytest
import trio

from p2p.errors import DialError
from p2p.multiaddr import Multiaddr
from p2p.sim.engine import Engine
from p2p.sim.fluid import Flow, FluidNet
from p2p.testing import SimNetwork, run_sim

MB = 1_000_000


async def _collect(stream: trio.abc.Stream, out: bytearray, max_bytes: int | None = None) -> None:
    while True:
        data = await stream.receive_some(max_bytes)
        if not data:
            return
        out.extend(data)


class Sink:
    """A listener that stores what each inbound connection sends, with finish times."""

    def __init__(self) -> None:
        self.received: dict[str, bytearray] = {}
        self.done_at: dict[str, float] = {}
        self.streams: list[trio.abc.Stream] = []

    async def handler(self, stream: trio.abc.Stream, remote: Multiaddr | None) -> None:
        key = str(remote)
        buf = self.received.setdefault(key, bytearray())
        self.streams.append(stream)
        try:
            await _collect(stream, buf)
        except trio.BrokenResourceError:
            return
        self.done_at[key] = trio.current_time()


async def _listen(nursery: trio.Nursery, host, handler) -> Multiaddr:
    return await nursery.start(host.transport.listen, Multiaddr.parse(host.listen_addr), handler)


# -- the pure fluid model ------------------------------------------------------------------


def test_fluid_max_min_rates():
    """Progressive filling: capacity a flow cannot use goes to the others on its link."""
    eng = Engine()
    fluid = FluidNet(eng)
    a_up = fluid.new_link("a.up", 100.0)
    b_down = fluid.new_link("b.down", 20.0)
    c_down = fluid.new_link("c.down", math.inf)
    d_down = fluid.new_link("d.down", math.inf)
    got: list[tuple[str, float]] = []
    ab = Flow(a_up, b_down, lambda p, t: got.append(("ab", t)))
    ac = Flow(a_up, c_down, lambda p, t: got.append(("ac", t)))
    ad = Flow(a_up, d_down, lambda p, t: got.append(("ad", t)))
    eng.run_until(0.0)
    for f in (ab, ac, ad):
        fluid.enqueue(f, b"x" * 1000)
    assert fluid.flush()  # the three starts are one reallocation
    assert fluid.reallocations == 1 and not fluid.flush()
    # a.up = 100 shared by three flows, but a->b is held to 20 by b's downlink: 40 + 40 + 20
    assert ab.rate == pytest.approx(20.0)
    assert ac.rate == pytest.approx(40.0)
    assert ad.rate == pytest.approx(40.0)
    eng.run_until(100.0)
    # ac, ad finish at 1000/40 = 25 s; then a->b alone, still capped at 20: 1000/20 = 50 s
    assert sorted(got) == [("ab", 50.0), ("ac", pytest.approx(25.0)), ("ad", pytest.approx(25.0))]
    assert got[-1][0] == "ab"
    assert not a_up.flows and not b_down.flows


def test_fluid_infinite_links_deliver_at_once():
    eng = Engine()
    fluid = FluidNet(eng)
    up, down = fluid.new_link("u", math.inf), fluid.new_link("d", math.inf)
    got: list[tuple[bytes, float]] = []
    flow = Flow(up, down, lambda p, t: got.append((p, t)))
    eng.run_until(3.0)
    fluid.enqueue(flow, b"abc")
    assert got == [(b"abc", 3.0)]
    with pytest.raises(ValueError):
        fluid.new_link("zero", 0)


# -- stream semantics ----------------------------------------------------------------------


def test_data_integrity_and_ordering():
    """Random-sized writes and reads over a slow, laggy path arrive intact and in order."""
    rnd = random.Random(7)
    payload = rnd.randbytes(3 * MB)

    async def main():
        net = SimNetwork(seed=1)
        a = net.add_host("a", upload_bps=5 * MB, latency=0.03)
        b = net.add_host("b", download_bps=3 * MB, latency=0.01)
        got = bytearray()
        done = trio.Event()

        async def handler(stream, remote):
            while True:
                data = await stream.receive_some(rnd.randint(1, 200_000))
                if not data:
                    break
                got.extend(data)
            done.set()

        async with trio.open_nursery() as nursery:
            addr = await _listen(nursery, b, handler)
            stream = await a.transport.dial(addr)
            pos = 0
            while pos < len(payload):
                n = rnd.choice([1, 17, 1000, 65536, 300_000])
                await stream.send_all(payload[pos : pos + n])
                pos += n
            await stream.send_eof()
            await done.wait()
            nursery.cancel_scope.cancel()
        return bytes(got)

    assert run_sim(main) == payload


async def _random_traffic(seed: int) -> tuple[int, int]:
    """Random hosts, links and connections carrying random writes in both directions, read
    in random sizes with random pauses; returns (bytes checked, bytes sent). A lost wakeup in the
    simulator would stall virtual time, which ``fail_after`` turns into a failure."""
    rng = random.Random(seed)
    net = SimNetwork(seed=seed, buffer_bytes=rng.choice([4096, 65536, 512 * 1024]))
    speeds = [math.inf, 50_000, 1 * MB, 20 * MB]
    hosts = [
        net.add_host(
            upload_bps=rng.choice(speeds),
            download_bps=rng.choice(speeds),
            latency=rng.choice([0.0, 0.001, 0.03]),
        )
        for _ in range(rng.randint(2, 5))
    ]
    checked = 0

    async def pump(stream: trio.abc.Stream, data: bytes) -> None:
        pos = 0
        while pos < len(data):
            n = 1 if rng.random() < 0.02 else rng.choice([100, 5000, 70_000, 300_000])
            await stream.send_all(data[pos : pos + n])
            pos += n
            if rng.random() < 0.3:
                await trio.sleep(rng.uniform(0, 0.01))
        await stream.send_eof()

    async def drain(stream: trio.abc.Stream, expected: bytes) -> None:
        nonlocal checked
        got = bytearray()
        while True:
            size = 1 if rng.random() < 0.02 else rng.choice([1000, 65536, None])
            chunk = await stream.receive_some(size)
            if not chunk:
                break
            got.extend(chunk)
            if rng.random() < 0.2:
                await trio.sleep(rng.uniform(0, 0.02))
        assert got == expected
        checked += len(got)

    async def both_ways(stream: trio.abc.Stream, out: bytes, back: bytes) -> None:
        async with trio.open_nursery() as n:
            n.start_soon(pump, stream, out)
            n.start_soon(drain, stream, back)

    with trio.fail_after(10_000):
        async with trio.open_nursery() as nursery:
            plans: dict[str, tuple[bytes, bytes]] = {}

            async def serve(stream, remote):
                out, back = plans[str(remote)]
                await both_ways(stream, back, out)

            addrs = [await _listen(nursery, h, serve) for h in hosts]
            expected = 0
            async with trio.open_nursery() as conns:
                for _ in range(rng.randint(1, 6)):
                    a, b = rng.sample(range(len(hosts)), 2)
                    out = rng.randbytes(rng.choice([0, 10, 100_000, 700_000]))
                    back = rng.randbytes(rng.choice([0, 10, 100_000]))
                    expected += len(out) + len(back)
                    stream = await hosts[a].transport.dial(addrs[b])
                    plans[str(stream.local_addr)] = (out, back)
                    conns.start_soon(both_ways, stream, out, back)
            while checked < expected:  # the listeners' sides may still be reading
                await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
    assert net.stats.bytes == checked
    return checked, expected


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_arrives_intact_without_stalls(seed):
    checked, sent = run_sim(_random_traffic, seed)
    assert checked == sent


@pytest.mark.parametrize(
    ("up", "down", "lat_a", "lat_b", "size"),
    [
        (1 * MB, 2 * MB, 0.01, 0.02, 4 * MB),  # sender's uplink is the bottleneck
        (10 * MB, 2.5 * MB, 0.05, 0.0, 10 * MB),  # receiver's downlink is the bottleneck
        (math.inf, 0.5 * MB, 0.1, 0.1, 1 * MB),
        (math.inf, math.inf, 0.2, 0.05, 2 * MB),  # only latency
        (100 * MB, 200 * MB, 0.05, 0.05, 20 * MB),  # bandwidth-delay product >> socket buffer
    ],
)
def test_transfer_time_matches_the_model(up, down, lat_a, lat_b, size):
    """Dial takes one RTT; n bytes then take n / min(up, down) + one-way latency."""

    async def main():
        net = SimNetwork()
        a = net.add_host("a", upload_bps=up, latency=lat_a)
        b = net.add_host("b", download_bps=down, latency=lat_b)
        sink = Sink()
        async with trio.open_nursery() as nursery:
            addr = await _listen(nursery, b, sink.handler)
            t0 = trio.current_time()
            stream = await a.transport.dial(addr)
            t1 = trio.current_time()
            await stream.send_all(bytes(size))
            await stream.aclose()
            while not sink.done_at:
                await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        (done,) = sink.done_at.values()
        (got,) = sink.received.values()
        return t1 - t0, done - t1, len(got)

    dial_time, transfer_time, n = run_sim(main)
    assert n == size
    assert dial_time == pytest.approx(2 * (lat_a + lat_b))
    expected = size / min(up, down) + lat_a + lat_b
    assert transfer_time == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_concurrent_flows_share_a_link_fairly():
    """Two uploads from one host each get half its uplink; a third, download-limited flow
    takes only what it can and leaves the rest to the others (max-min fairness)."""

    async def main():
        net = SimNetwork()
        src = net.add_host("src", upload_bps=2 * MB)
        fast1 = net.add_host("fast1")
        fast2 = net.add_host("fast2")
        slow = net.add_host("slow", download_bps=0.5 * MB)
        sinks = {h.name: Sink() for h in (fast1, fast2, slow)}
        finish: dict[str, float] = {}
        async with trio.open_nursery() as nursery:
            addrs = {
                h.name: await _listen(nursery, h, sinks[h.name].handler)
                for h in (fast1, fast2, slow)
            }

            async def push(name: str, size: int) -> None:
                stream = await src.transport.dial(addrs[name])
                await stream.send_all(bytes(size))
                await stream.aclose()

            t0 = trio.current_time()
            async with trio.open_nursery() as inner:
                inner.start_soon(push, "fast1", 3 * MB)
                inner.start_soon(push, "fast2", 3 * MB)
                inner.start_soon(push, "slow", 1 * MB)
            while len(finish) < 3:
                for name, sink in sinks.items():
                    if sink.done_at:
                        finish[name] = next(iter(sink.done_at.values())) - t0
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        return finish

    finish = run_sim(main)
    # slow gets 0.5 MB/s throughout (1 MB -> 2 s); fast flows share the remaining 1.5 MB/s
    # (0.75 each) for 2 s = 1.5 MB each, then 1 MB/s each for the remaining 1.5 MB: 3.5 s.
    assert finish["slow"] == pytest.approx(2.0)
    assert finish["fast1"] == pytest.approx(3.5)
    assert finish["fast2"] == pytest.approx(3.5)


def test_two_senders_share_a_downlink():
    async def main():
        net = SimNetwork()
        dst = net.add_host("dst", download_bps=1 * MB)
        senders = [net.add_host(f"s{i}") for i in range(2)]
        sink = Sink()
        async with trio.open_nursery() as nursery:
            addr = await _listen(nursery, dst, sink.handler)

            async def push(host) -> None:
                stream = await host.transport.dial(addr)
                await stream.send_all(bytes(MB))
                await stream.aclose()

            async with trio.open_nursery() as inner:
                for s in senders:
                    inner.start_soon(push, s)
            while len(sink.done_at) < 2:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        return sorted(sink.done_at.values())

    assert run_sim(main) == [pytest.approx(2.0), pytest.approx(2.0)]


def test_slow_reader_back_pressures_sender():
    """A reader that does not read stops the writer after about one socket buffer."""

    async def main():
        net = SimNetwork(buffer_bytes=256 * 1024)
        a, b = net.add_host("a"), net.add_host("b")
        accepted: list[trio.abc.Stream] = []
        got_stream = trio.Event()

        async def handler(stream, remote):
            accepted.append(stream)
            got_stream.set()
            await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            addr = await _listen(nursery, b, handler)
            stream = await a.transport.dial(addr)
            await got_stream.wait()
            sent = 0
            with trio.move_on_after(10):
                for _ in range(100):
                    await stream.send_all(bytes(16 * 1024))
                    sent += 16 * 1024
            blocked_after = sent
            # now read everything: the writer resumes and finishes
            got = bytearray()

            async def write_rest():
                await stream.send_all(bytes(100 * 16 * 1024 - blocked_after))
                await stream.send_eof()

            nursery.start_soon(write_rest)
            await _collect(accepted[0], got)
            nursery.cancel_scope.cancel()
        return blocked_after, len(got)

    blocked_after, total = run_sim(main)
    assert blocked_after == 256 * 1024
    assert total == 100 * 16 * 1024


def test_wait_send_all_might_not_block_waits_for_buffer_space():
    async def main():
        net = SimNetwork(buffer_bytes=1000)
        a, b = net.add_host("a"), net.add_host("b")
        peer: list[trio.abc.Stream] = []
        async with trio.open_nursery() as nursery:
            addr = await _listen(nursery, b, lambda s, r: _keep(peer, s))
            stream = await a.transport.dial(addr)
            await stream.send_all(bytes(1000))
            blocked = True
            with trio.move_on_after(5):
                await stream.wait_send_all_might_not_block()
                blocked = False
            assert blocked
            assert await (await _first(peer)).receive_some(10) == bytes(10)
            await stream.wait_send_all_might_not_block()
            nursery.cancel_scope.cancel()

    run_sim(main)


async def _keep(store: list, stream: trio.abc.Stream) -> None:
    store.append(stream)
    await trio.sleep_forever()


async def _first(store: list) -> trio.abc.Stream:
    """The first accepted stream, once the listener's handler task has run."""
    while not store:
        await trio.sleep(0)
    return store[0]


def test_half_close_and_close_semantics():
    """send_eof -> peer reads b"" after the data and can still answer; aclose -> the peer's
    writes fail; using a closed endpoint -> ClosedResourceError."""

    async def main():
        net = SimNetwork()
        a = net.add_host("a", latency=0.01)
        b = net.add_host("b", latency=0.01)
        peer: list[trio.abc.Stream] = []
        async with trio.open_nursery() as nursery:
            addr = await _listen(nursery, b, lambda s, r: _keep(peer, s))
            stream = await a.transport.dial(addr)
            server = await _first(peer)
            await stream.send_all(b"question")
            await stream.send_eof()
            with pytest.raises(trio.ClosedResourceError):
                await stream.send_all(b"more")
            got = bytearray()
            await _collect(server, got)
            assert got == b"question"
            assert await server.receive_some() == b""  # EOF is sticky
            await server.send_all(b"answer")  # half-closed: the other direction still works
            assert await stream.receive_some() == b"answer"
            await stream.aclose()
            await trio.sleep(1)
            with pytest.raises(trio.BrokenResourceError):
                await server.send_all(b"anyone there?")
            with pytest.raises(trio.ClosedResourceError):
                await stream.receive_some()
            await stream.aclose()  # idempotent
            nursery.cancel_scope.cancel()

    run_sim(main)


def test_concurrent_receivers_are_rejected():
    async def main():
        net = SimNetwork()
        a, b = net.add_host("a"), net.add_host("b")
        peer: list[trio.abc.Stream] = []
        async with trio.open_nursery() as nursery:
            addr = await _listen(nursery, b, lambda s, r: _keep(peer, s))
            stream = await a.transport.dial(addr)
            nursery.start_soon(stream.receive_some)
            await trio.sleep(0.1)
            with pytest.raises(trio.BusyResourceError):
                await stream.receive_some()
            nursery.cancel_scope.cancel()

    run_sim(main)


# -- addresses and dialing -----------------------------------------------------------------


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


# -- faults --------------------------------------------------------------------------------


def test_kill_breaks_connections_promptly_and_revive_restores():
    async def main():
        net = SimNetwork()
        a = net.add_host("a", latency=0.05)
        b = net.add_host("b", latency=0.05)
        c = net.add_host("c")
        peer: list[trio.abc.Stream] = []
        async with trio.open_nursery() as nursery:
            b_addr = await _listen(nursery, b, lambda s, r: _keep(peer, s))
            c_addr = await _listen(nursery, c, lambda s, r: _keep(peer, s))
            stream = await a.transport.dial(b_addr)
            await stream.send_all(b"in flight")  # still on the wire when b dies
            errors: list[float] = []

            async def reader():
                with pytest.raises(trio.BrokenResourceError):
                    await stream.receive_some()
                errors.append(trio.current_time())

            nursery.start_soon(reader)
            await trio.sleep(0.01)
            t_kill = trio.current_time()
            net.kill(b)
            await trio.sleep(0.5)
            assert errors == [t_kill]  # the blocked reader fails at once, no hang
            with pytest.raises(trio.BrokenResourceError):
                await stream.send_all(b"x")
            with pytest.raises(trio.BrokenResourceError):
                await peer[0].receive_some()  # the dead side's endpoint is broken too
            with pytest.raises(DialError, match="down"):
                await a.transport.dial(b_addr)
            with pytest.raises(DialError, match="down"):
                await b.transport.dial(c_addr)
            net.revive(b)
            again = await a.transport.dial(b_addr)
            await again.send_all(b"hello again")
            await trio.sleep(1)
            assert await peer[-1].receive_some() == b"hello again"
            nursery.cancel_scope.cancel()

    run_sim(main)


class Accepted:
    """Inbound streams of one host, by the dialer's host name."""

    def __init__(self) -> None:
        self.by_dialer: dict[str, trio.abc.Stream] = {}

    async def handler(self, stream: trio.abc.Stream, remote: Multiaddr | None) -> None:
        self.by_dialer[remote.value_of("sim")] = stream
        await trio.sleep_forever()

    async def of(self, dialer: str) -> trio.abc.Stream:
        while dialer not in self.by_dialer:
            await trio.sleep(0)
        return self.by_dialer[dialer]


def test_partition_and_heal():
    async def main():
        net = SimNetwork()
        hosts = {n: net.add_host(n) for n in "abcde"}
        acc = {n: Accepted() for n in hosts}
        async with trio.open_nursery() as nursery:
            addrs = {n: await _listen(nursery, h, acc[n].handler) for n, h in hosts.items()}
            ab = await hosts["a"].transport.dial(addrs["b"])  # same side
            ac = await hosts["a"].transport.dial(addrs["c"])  # across
            ae = await hosts["a"].transport.dial(addrs["e"])  # e is in neither group
            dc = await hosts["d"].transport.dial(addrs["c"])  # same side
            c_from_a = await acc["c"].of("a")
            net.partition([hosts["a"], "b"], ["c", hosts["d"]])
            with pytest.raises(trio.BrokenResourceError):
                await ac.send_all(b"x")
            with pytest.raises(trio.BrokenResourceError):
                await c_from_a.receive_some()
            for stream, src, dst in ((ab, "a", "b"), (ae, "a", "e"), (dc, "d", "c")):
                await stream.send_all(b"still fine")
                assert await (await acc[dst].of(src)).receive_some() == b"still fine"
            with pytest.raises(DialError, match="partitioned"):
                await hosts["b"].transport.dial(addrs["d"])
            await hosts["e"].transport.dial(addrs["d"])
            net.heal()
            bd = await hosts["b"].transport.dial(addrs["d"])
            await bd.send_all(b"healed")
            assert await (await acc["d"].of("b")).receive_some() == b"healed"
            nursery.cancel_scope.cancel()

    run_sim(main)


def test_set_bandwidth_mid_transfer():
    async def main():
        net = SimNetwork()
        a = net.add_host("a", upload_bps=1 * MB)
        b = net.add_host("b")
        sink = Sink()
        async with trio.open_nursery() as nursery:
            addr = await _listen(nursery, b, sink.handler)
            stream = await a.transport.dial(addr)

            async def slow_down():
                await trio.sleep(1.0)
                net.set_bandwidth(a, upload_bps=0.25 * MB)

            nursery.start_soon(slow_down)
            await stream.send_all(bytes(2 * MB))
            await stream.aclose()
            while not sink.done_at:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        return next(iter(sink.done_at.values()))

    # 1 MB in the first second, the other 1 MB at 0.25 MB/s: 4 more seconds
    assert run_sim(main) == pytest.approx(5.0)


def test_pairwise_latency_override():
    async def main():
        net = SimNetwork()
        a = net.add_host("a", latency=0.1)
        b = net.add_host("b", latency=0.1)
        net.set_latency(a, b, 0.02)
        peer: list[trio.abc.Stream] = []
        async with trio.open_nursery() as nursery:
            addr = await _listen(nursery, b, lambda s, r: _keep(peer, s))
            t0 = trio.current_time()
            stream = await a.transport.dial(addr)
            assert trio.current_time() - t0 == pytest.approx(0.04)
            t1 = trio.current_time()
            await stream.send_all(b"ping")
            assert await (await _first(peer)).receive_some() == b"ping"
            assert trio.current_time() - t1 == pytest.approx(0.02)
            nursery.cancel_scope.cancel()

    run_sim(main)


def test_silent_failures_make_dials_hang_until_the_callers_timeout():
    async def main():
        net = SimNetwork(silent_failures=True)
        a, b = net.add_host("a"), net.add_host("b", reachable=False)
        async with trio.open_nursery() as nursery:
            addr = await _listen(nursery, b, lambda s, r: _keep([], s))
            with trio.move_on_after(3) as scope:
                await a.transport.dial(addr)
            assert scope.cancelled_caught
            nursery.cancel_scope.cancel()

    run_sim(main)


# -- scale and determinism -----------------------------------------------------------------


async def _gossip(seed: int, n_hosts: int, fanout: int, messages: int) -> tuple[list, list, dict]:
    """Every host sends ``messages`` small messages to ``fanout`` random others, over links
    of random speed and latency; returns (delivery log, network trace, stats)."""
    net = SimNetwork(seed=seed, record=True)
    rng = random.Random(seed)
    hosts = [
        net.add_host(
            upload_bps=rng.choice([1, 5, 20]) * MB / 8,
            download_bps=rng.choice([5, 20, 100]) * MB / 8,
            latency=rng.uniform(0.005, 0.1),
        )
        for _ in range(n_hosts)
    ]
    log: list[tuple[float, str, str, int]] = []

    async with trio.open_nursery() as nursery:
        addrs = []
        for h in hosts:

            async def handler(stream, remote, h=h):
                buf = bytearray()
                await _collect(stream, buf)
                assert len(buf) % 100 == 0
                log.append((trio.current_time(), str(remote.value_of("sim")), h.name, len(buf)))

            addrs.append(await _listen(nursery, h, handler))

        async def talk(src, dst_index):
            stream = await src.transport.dial(addrs[dst_index])
            for i in range(messages):
                await stream.send_all(bytes([i % 256]) * 100)
                await net.sleep(rng.uniform(0, 0.05))
            await stream.aclose()

        async with trio.open_nursery() as talkers:
            for i, h in enumerate(hosts):
                for j in rng.sample([k for k in range(n_hosts) if k != i], fanout):
                    talkers.start_soon(talk, h, j)
        while len(log) < n_hosts * fanout:
            await net.sleep(0.1)
        nursery.cancel_scope.cancel()
    return log, net.trace, vars(net.stats)


def test_200_hosts_exchange_messages():
    log, _, stats = run_sim(_gossip, 0, 200, 3, 5)
    assert len(log) == 600
    assert all(n == 500 for *_, n in log)
    assert stats["bytes"] == 200 * 3 * 5 * 100
    assert stats["connections"] == 600


def test_same_seed_same_trace():
    first = run_sim(_gossip, 3, 30, 3, 5, seed=11)
    second = run_sim(_gossip, 3, 30, 3, 5, seed=11)
    assert first == second
    assert first[1]  # the trace is not empty
    other = run_sim(_gossip, 4, 30, 3, 5, seed=11)
    assert other[1] != first[1]


# -- the real node stack (secure channel, mux, RPC) over the simulator ----------------------


def test_rpc_between_60_nodes():
    """60 real nodes on heterogeneous links call each other; every answer is right."""
    from p2p.node import NodeConfig
    from p2p.testing import open_sim_nodes

    async def add(ctx, request):
        return {"sum": request["a"] + request["b"], "from": str(ctx.remote_peer)}

    async def main():
        net = SimNetwork(seed=5)
        rng = random.Random(5)
        results: list[tuple[int, int, dict]] = []
        async with open_sim_nodes(
            net, 60, config=NodeConfig.testing(), upload_bps=2 * MB, latency=0.02
        ) as nodes:
            for node in nodes:
                node.add_handler("add", add)

            async def caller(i: int) -> None:
                for j in rng.sample([k for k in range(60) if k != i], 3):
                    reply = await nodes[i].call(nodes[j].addrs[0], "add", {"a": i, "b": j})
                    results.append((i, j, reply))

            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                for i in range(60):
                    nursery.start_soon(caller, i)
            elapsed = trio.current_time() - t0
            peers = [str(n.peer_id) for n in nodes]
        return results, elapsed, peers

    results, elapsed, peers = run_sim(main)
    assert len(results) == 180
    for i, j, reply in results:
        assert reply == {"sum": i + j, "from": peers[i]}
    # each call needs at least a dial round trip (80 ms) plus the request and response trips
    assert elapsed >= 3 * 0.12


def test_killing_the_callee_mid_call_fails_the_call_promptly():
    from p2p.errors import P2PError, RPCTimeout
    from p2p.node import NodeConfig
    from p2p.testing import host_of, open_sim_nodes

    started = trio.Event()

    async def slow(ctx, request):
        started.set()
        await trio.sleep(1000)
        return "too late"

    async def main():
        net = SimNetwork(seed=2)
        async with open_sim_nodes(net, 2, config=NodeConfig(), latency=0.01) as (a, b):
            b.add_handler("slow", slow)
            await a.connect(b.addrs[0])
            failed_at: list[float] = []

            async def call() -> None:
                with pytest.raises(P2PError) as info:
                    await a.call(b.peer_id, "slow", None)
                assert not isinstance(info.value, RPCTimeout)
                failed_at.append(trio.current_time())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                await started.wait()
                await trio.sleep(0.5)
                t_kill = trio.current_time()
                net.kill(host_of(net, b))
            return failed_at[0] - t_kill

    # the caller learns at once (the connection resets), long before its 60 s call timeout
    assert run_sim(main) < 0.1


def test_10_mb_stream_takes_the_bandwidth_predicted_time():
    from p2p.node import NodeConfig
    from p2p.testing import open_sim_nodes

    size, piece = 10 << 20, 1 << 20
    done: list[tuple[float, int]] = []

    async def sink(ctx, stream):
        total = 0
        async for msg in stream:
            total += len(msg)
        done.append((trio.current_time(), total))

    async def main():
        net = SimNetwork(seed=0)
        async with open_sim_nodes(
            net, 2, config=NodeConfig.bulk(), upload_bps=10 * MB, download_bps=20 * MB, latency=0.02
        ) as (a, b):
            b.add_stream_handler("sink", sink)
            await a.connect(b.addrs[0])
            async with a.open_stream(b.peer_id, "sink") as stream:
                t0 = trio.current_time()  # opening the stream took a round trip
                for _ in range(size // piece):
                    await stream.send(bytes(piece))
                await stream.send_eof()
                while not done:
                    await trio.sleep(0.01)
            return done[0][0] - t0, done[0][1]

    elapsed, total = run_sim(main)
    assert total == size
    # a's 10 MB/s uplink is the bottleneck; framing and encryption add well under 1%
    expected = total / (10 * MB) + 0.04
    assert expected <= elapsed <= expected * 1.01


@pytest.mark.slow
def test_500_hosts_exchange_messages():
    log, _, stats = run_sim(_gossip, 1, 500, 4, 5)
    assert len(log) == 2000
    assert stats["bytes"] == 500 * 4 * 5 * 100


def test_run_sim_timeout_turns_a_deadlock_into_an_error():
    async def stuck():
        await trio.Event().wait()  # nothing will ever set it, and no deadline is pending

    with pytest.raises(trio.TooSlowError):
        run_sim(stuck, timeout=60)
    assert run_sim(trio.sleep, 5, timeout=60) is None


def test_one_network_per_trio_run():
    net = SimNetwork()
    a, b = net.add_host("a"), net.add_host("b")

    async def main():
        async with trio.open_nursery() as nursery:
            addr = await _listen(nursery, b, lambda s, r: _keep([], s))
            await net.sleep(5)
            await a.transport.dial(addr)
            nursery.cancel_scope.cancel()

    run_sim(main)
    with pytest.raises(RuntimeError, match="one network per trio.run"):
        run_sim(net.sleep, 1.0)  # a new run's clock starts behind this network's
