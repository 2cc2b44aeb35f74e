"""The real node stack (secure channel, mux, RPC) over the simulated network, with the
durations the bandwidth model predicts (in virtual time)."""

from __future__ import annotations

import random

import pytest
import trio

from p2p.testing import SimNetwork, run_sim
from tests.p2p.simhelpers import MB


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


def test_a_send_cancelled_midway_leaves_the_connection_and_its_other_streams_alive():
    """One stream's send cancelled while its frame is half on the wire (a slow link, a full
    socket buffer) finishes that frame: the connection and its other streams live on. (Cut
    there, the channel closed, and every stream of the connection with it: in
    bench.collaboration a link probe that timed out killed the all-reduce streams that shared
    its connection, and the round failed.)"""
    from p2p.node import NodeConfig
    from p2p.testing import open_sim_nodes

    received: list[int] = []

    async def sink(ctx, ms) -> None:
        while True:
            msg = await ms.receive()
            received.append(len(msg))

    async def echo(ctx, request):
        return request

    async def main():
        net = SimNetwork(seed=3)
        async with open_sim_nodes(
            net, 2, config=NodeConfig.testing(), upload_bps=1_000_000, latency=0.01
        ) as (a, b):
            b.add_stream_handler("sink", sink)
            b.add_handler("echo", echo)
            await a.connect(b.addrs[0])
            conn = a.connection_to(b.peer_id)
            async with a.open_stream(b.peer_id, "sink") as ms:
                with trio.move_on_after(2.5) as scope:  # 8 MB take 8 s on this link
                    await ms.send(b"x" * (8 << 20))
                assert scope.cancelled_caught
                ms.reset("cancelled")
            assert await a.call(b.peer_id, "echo", {"n": 1}) == {"n": 1}
            assert a.connection_to(b.peer_id) is conn
            assert not conn.mux.is_closed

    run_sim(main)


def test_bytes_sent_name_each_protocol_and_add_up_to_the_wire():
    """Each node counts what it wrote per stream protocol (request under the caller, response
    under the callee), and together with the handshakes the counts are the bytes the
    network carried: what bench.collaboration's breakdown of traffic relies on."""
    from p2p.node import NodeConfig
    from p2p.testing import open_sim_nodes

    async def echo(ctx, request):
        return request

    async def small(ctx, request):
        return b"ok"

    async def main():
        net = SimNetwork(seed=3)
        async with open_sim_nodes(net, 2, config=NodeConfig.testing(), latency=0.01) as (a, b):
            b.add_handler("echo", echo)
            b.add_handler("small", small)
            await a.connect(b.addrs[0])
            handshakes = net.stats.bytes
            await a.call(b.peer_id, "echo", bytes(100_000))
            await a.call(b.peer_id, "small", bytes(30_000))
            await trio.sleep(1)  # window updates and the like are flushed
            received = (a.bytes_received.total, b.bytes_received.total)
            return dict(a.bytes_sent), dict(b.bytes_sent), handshakes, net.stats.bytes, received

    sent_a, sent_b, handshakes, wire, (received_a, received_b) = run_sim(main)
    # what one node wrote after the handshake is what the other read (a traffic rate's base)
    assert received_b == sum(sent_a.values()) and received_a == sum(sent_b.values())
    assert 100_000 < sent_a["echo"] < 101_000
    assert 100_000 < sent_b["echo"] < 101_000
    assert 30_000 < sent_a["small"] < 30_500
    assert sent_b["small"] < 200
    counted = sum(sent_a.values()) + sum(sent_b.values())
    assert counted + handshakes == wire
