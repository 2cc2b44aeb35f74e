"""The stream multiplexer's limits: inbound and outbound stream counts, buffered memory
(over an in-memory frame channel, no encryption, virtual time)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from p2p.errors import ConnectionClosed
from p2p.mux import MemoryBudget, Mux, MuxConfig, MuxStream
from tests.p2p.muxhelpers import (
    _no_streams,
    echo,
    frame_channel_pair,
    mux_pair,
    read_all,
    run_virtual,
)


def test_too_many_inbound_streams_are_reset() -> None:
    config = MuxConfig(max_inbound_streams=3, max_outbound_streams=10)

    async def main() -> None:
        hold = trio.Event()

        async def server(stream: MuxStream) -> None:
            await hold.wait()

        async with mux_pair(server, config) as (client, server_mux):
            streams = [await client.open_stream() for _ in range(5)]
            for stream in streams:
                await stream.send_all(b"hello")
            await trio.testing.wait_all_tasks_blocked()
            assert server_mux.num_streams == 3
            refused = [s for s in streams if s.is_reset]
            assert len(refused) == 2
            with pytest.raises(ConnectionClosed, match="too many streams"):
                await refused[0].receive_some()
            hold.set()
            assert not client.is_closed

    run_virtual(main)


def test_outbound_streams_wait_for_a_free_slot() -> None:
    config = MuxConfig(max_outbound_streams=2)

    async def main() -> None:
        async with mux_pair(echo, config) as (client, _server):
            a = await client.open_stream()
            await client.open_stream()
            with trio.move_on_after(1) as scope:
                await client.open_stream()
            assert scope.cancelled_caught  # blocked, not refused
            a.reset()
            with trio.fail_after(1):
                await client.open_stream()

    run_virtual(main)


def test_memory_limit_resets_the_stream_that_would_exceed_it() -> None:
    config = MuxConfig(
        initial_window=64 << 10, max_frame_payload=16 << 10, max_buffered_bytes=96 << 10
    )
    budget = MemoryBudget(1 << 30)

    async def main() -> None:
        arrived: list[MuxStream] = []
        release = trio.Event()

        async def hoard(stream: MuxStream) -> None:
            arrived.append(stream)
            await release.wait()
            got = await read_all(stream)
            await stream.send_all(len(got).to_bytes(4, "big"))
            await stream.send_eof()

        ca, cb = frame_channel_pair()
        client = Mux(ca, initiator=True, handle_stream=_no_streams, config=config)
        server = Mux(cb, initiator=False, handle_stream=hoard, config=config, budget=budget)
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            await nursery.start(server.run)
            first, second = await client.open_stream(), await client.open_stream()
            await first.send_all(bytes(64 << 10))  # a full window each: 128 KiB > 96 KiB
            await first.send_eof()
            nursery.start_soon(second.send_all, bytes(64 << 10))
            await trio.testing.wait_all_tasks_blocked()
            assert server.held_bytes <= 96 << 10 and budget.used == server.held_bytes
            assert second.is_reset
            with pytest.raises(ConnectionClosed, match="memory limit"):
                await second.receive_some()
            release.set()
            assert int.from_bytes(await first.receive_exactly(4), "big") == 64 << 10
            await trio.testing.wait_all_tasks_blocked()
            assert server.held_bytes == 0 and budget.used == 0
            assert not server.is_closed
            nursery.cancel_scope.cancel()

    run_virtual(main)
