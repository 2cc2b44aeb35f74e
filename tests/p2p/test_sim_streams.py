"""The simulated network's stream semantics: integrity, the bandwidth/latency model, fair
sharing, back-pressure, half-close and close.

All tests run in virtual time (MockClock with autojump), so the durations asserted below are
the model's predictions, exact up to float rounding, not wall-clock measurements.
"""

from __future__ import annotations

import math
import random

import pytest
import trio

from p2p.testing import SimNetwork, run_sim
from tests.p2p.simhelpers import MB, Sink, _collect, _first, _keep, _listen


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
