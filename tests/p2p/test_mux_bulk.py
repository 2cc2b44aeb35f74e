"""The stream multiplexer's BULK frames: big buffers as frames of their own (over an
in-memory frame channel, no encryption, virtual time)."""

from __future__ import annotations

from functools import partial

import trio
import trio.testing

from p2p.mux import (
    BULK,
    BULK_MIN,
    DATA,
    EOF,
    OPEN,
    OPEN_DATA,
    WINDOW,
    Mux,
    MuxConfig,
    MuxStream,
    decode_frame,
)
from p2p.rpc import MessageStream
from tests.p2p.muxhelpers import (
    MemoryFrameChannel,
    _no_streams,
    echo,
    frame_channel_pair,
    mux_pair,
    read_all,
    run_virtual,
)


def test_a_big_buffer_travels_as_its_own_frame_and_arrives_uncopied() -> None:
    """A 1 MiB chunk leaves as one raw frame after a BULK header; the reader gets that very
    frame object back as the message (no join, no copy)."""

    async def main() -> None:
        received: list[object] = []

        async def sink(stream: MuxStream) -> None:
            received.append(await MessageStream(stream, 4 << 20).receive())

        async with mux_pair(sink) as (client, server):
            chunk = bytes(range(256)) * 4096
            stream = await client.open_stream()
            await MessageStream(stream, 4 << 20).send(chunk)
            await trio.testing.wait_all_tasks_blocked()
            channel = client.channel
            assert isinstance(channel, MemoryFrameChannel)
            kinds = [decode_frame(f)[0] for f in channel.sent[:2]]
            assert kinds == [OPEN_DATA, BULK]  # length prefix + msgpack header, then BULK
            assert decode_frame(channel.sent[1])[2] == len(chunk).to_bytes(4, "big")
            assert channel.sent[2] == chunk
            assert received == [chunk] and received[0] is channel.sent[2]

    run_virtual(main)


def test_the_small_data_before_a_big_buffer_rides_in_its_bulk_frame() -> None:
    """On an open stream a 1 MiB message is two channel frames: BULK carrying the length
    prefix and msgpack header, then the chunk itself."""

    async def main() -> None:
        received: list[object] = []

        async def sink(stream: MuxStream) -> None:
            async for message in MessageStream(stream, 4 << 20):
                received.append(message)

        async with mux_pair(sink) as (client, _server):
            chunks = [bytes([i]) * (1 << 20) for i in range(3)]
            stream = MessageStream(await client.open_stream(), 4 << 20)
            await stream.send(b"hello")
            channel = client.channel
            assert isinstance(channel, MemoryFrameChannel)
            first = len(channel.sent)
            for chunk in chunks:
                await stream.send(chunk)
            await stream.send_eof()
            await trio.testing.wait_all_tasks_blocked()
            frames = channel.sent[first:]
            for i, chunk in enumerate(chunks):
                kind, _, payload = decode_frame(frames[2 * i])
                assert kind == BULK and len(payload) > 4  # u32 size, then the message head
                assert int.from_bytes(payload[:4], "big") == len(chunk)
                assert frames[2 * i + 1] == chunk
            assert [decode_frame(f)[0] for f in frames[6:]] == [EOF]
            assert received == [b"hello", *chunks]
            assert all(r is f for r, f in zip(received[1:], frames[1:6:2], strict=True))

    run_virtual(main)


def test_bulk_pieces_respect_a_small_window_and_keep_the_byte_order() -> None:
    # 256 KiB windows: bulk pieces are capped at 64 KiB (max_frame_payload), each waiting for
    # a whole piece of credit; small buffers in between still go as DATA
    config = MuxConfig(initial_window=256 << 10, max_frame_payload=BULK_MIN)

    async def main() -> None:
        async with mux_pair(echo, config) as (client, _server):
            big = bytes(range(251)) * 5000  # not a multiple of the piece size
            parts = [b"head", big, b"middle", big[::-1], b"tail"]
            expected = b"".join(parts)
            stream = await client.open_stream()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(stream.send_parts, parts, eof=True))
                assert await read_all(stream) == expected
            channel = client.channel
            assert isinstance(channel, MemoryFrameChannel)
            sizes = {DATA: 0, BULK: 0}
            frames = iter(channel.sent)
            for frame in frames:
                kind, _, payload = decode_frame(frame)
                if kind == BULK:
                    raw = next(frames)  # the data frame that follows, with no mux header
                    assert len(raw) == int.from_bytes(payload[:4], "big") <= BULK_MIN
                    sizes[BULK] += len(raw)
                    sizes[DATA] += len(payload) - 4  # small parts riding in the BULK frame
                elif kind != WINDOW:  # our grants for the echoed data carry no stream bytes
                    sizes[DATA] += len(payload)
            # the bulk of both big buffers went as BULK, their short tails with the small parts
            assert sizes[BULK] > 2 * len(big) - 2 * BULK_MIN
            assert sizes[BULK] + sizes[DATA] == len(expected)

    run_virtual(main)


class StallAfterFrames(MemoryFrameChannel):
    """Lets ``allow`` frames through, then blocks every send (a connection that stalls)."""

    allow = 2

    async def send_frame(self, data: bytes | bytearray | memoryview) -> None:
        if len(self.sent) >= self.allow:
            await trio.sleep_forever()
        await super().send_frame(data)


def test_a_send_cancelled_between_a_bulk_header_and_its_data_closes_the_connection() -> None:
    """Nothing may follow a BULK header but its data: cancelled in between, the connection
    closes (channels that write several frames at once never stop in between)."""

    async def main() -> None:
        ca, cb = frame_channel_pair(10, first=StallAfterFrames)
        server = Mux(cb, initiator=False, handle_stream=echo)
        client = Mux(ca, initiator=True, handle_stream=_no_streams)
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            await nursery.start(server.run)
            stream = await client.open_stream()
            with trio.move_on_after(1):
                await stream.send_all(bytes(BULK_MIN))  # OPEN, BULK header, then stalls
            assert [decode_frame(f)[0] for f in ca.sent] == [OPEN, BULK]
            assert client.is_closed and "between the frames" in (client.close_reason or "")
            nursery.cancel_scope.cancel()

    run_virtual(main)
