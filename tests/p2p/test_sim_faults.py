"""Faults in the simulated network: killed and revived hosts, partitions, bandwidth and
latency changes, silent failures (in virtual time)."""

from __future__ import annotations

import pytest
import trio

from p2p.errors import DialError
from p2p.multiaddr import Multiaddr
from p2p.testing import SimNetwork, run_sim
from tests.p2p.simhelpers import MB, Sink, _first, _keep, _listen


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
