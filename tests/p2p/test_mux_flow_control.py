"""The stream multiplexer's flow control: windows, slow readers, small calls beside big
transfers (over an in-memory frame channel, no encryption, virtual time)."""

from __future__ import annotations

import trio
import trio.testing

from p2p.mux import MuxConfig, MuxStream
from tests.p2p.muxhelpers import echo, mux_pair, read_all, run_virtual


def test_transfer_larger_than_window_completes() -> None:
    config = MuxConfig(initial_window=64 << 10, max_frame_payload=16 << 10)

    async def main() -> None:
        got = []

        async def sink(stream: MuxStream) -> None:
            got.append(await read_all(stream))
            await stream.send_eof()

        async with mux_pair(sink, config) as (client, server):
            stream = await client.open_stream()
            payload = bytes(range(256)) * 4096  # 1 MiB, 16 windows
            await stream.send_all(payload)
            await stream.send_eof()
            assert await stream.receive_some() == b""
            assert server.held_bytes == 0 and client.held_bytes == 0
        assert got == [payload]

    run_virtual(main)


def test_slow_reader_blocks_only_its_own_stream() -> None:
    config = MuxConfig(initial_window=64 << 10, max_frame_payload=16 << 10)

    async def main() -> None:
        stalled: list[MuxStream] = []
        release = trio.Event()

        async def server(stream: MuxStream) -> None:
            first = await stream.receive_exactly(1)
            if bytes(first) == b"S":  # the slow reader: reads nothing until released
                stalled.append(stream)
                await release.wait()
                await read_all(stream)
                await stream.send_eof()
            else:
                await echo_rest(stream, first)

        async def echo_rest(stream: MuxStream, first: bytes | memoryview) -> None:
            await stream.send_all(first)
            await echo(stream)

        async with mux_pair(server, config) as (client, _server):
            slow = await client.open_stream()
            sent = 0

            async def push() -> None:
                nonlocal sent
                await slow.send_all(b"S")
                for _ in range(64):
                    await slow.send_all(bytes(16 << 10))
                    sent += 16 << 10
                await slow.send_eof()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(push)
                await trio.testing.wait_all_tasks_blocked()
                # the writer is stuck at the window, not buffering without bound
                assert sent <= config.initial_window
                assert stalled and stalled[0]._buffered <= config.initial_window
                # meanwhile a small exchange on another stream goes through
                quick = await client.open_stream()
                await quick.send_all(b"hi")
                assert bytes(await quick.receive_exactly(2)) == b"hi"
                await quick.aclose()
                release.set()
            assert sent == 64 * (16 << 10)

    run_virtual(main)


def test_small_call_is_not_starved_by_a_big_transfer() -> None:
    async def main() -> None:
        order: list[str] = []

        async def server(stream: MuxStream) -> None:
            await echo(stream)

        async with mux_pair(server) as (client, _server):
            big = await client.open_stream()

            async def transfer() -> None:
                async with trio.open_nursery() as n:
                    n.start_soon(big.send_all, bytes(20 << 20))
                    await big.receive_exactly(20 << 20)
                order.append("big")

            async def small() -> None:
                await trio.sleep(0)  # start once the transfer is under way
                s = await client.open_stream()
                await s.send_all(b"x")
                await s.receive_exactly(1)
                order.append("small")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(transfer)
                nursery.start_soon(small)
            assert order == ["small", "big"]

    run_virtual(main)
