"""The stream multiplexer's frames and streams: encoding, stream ids, echo and EOF, many
streams at once (over an in-memory frame channel, no encryption, virtual time)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from p2p.errors import ProtocolError
from p2p.mux import DATA, OPEN_DATA, RESET, WINDOW, MuxConfig, MuxStream, decode_frame, encode_frame
from tests.p2p.muxhelpers import MemoryFrameChannel, echo, mux_pair, run_virtual


def test_frame_roundtrip() -> None:
    frame = encode_frame(DATA, 7, b"hello")
    kind, sid, payload = decode_frame(frame)
    assert (kind, sid, bytes(payload)) == (DATA, 7, b"hello")
    with pytest.raises(ProtocolError):
        decode_frame(b"\x01\x00")
    with pytest.raises(ProtocolError):
        decode_frame(encode_frame(WINDOW, 1, b"\x00\x01"))  # window payload must be 4 bytes
    with pytest.raises(ProtocolError):
        decode_frame(encode_frame(99, 1))


def test_a_stream_is_announced_by_its_first_frame() -> None:
    async def main() -> None:
        async with mux_pair(echo) as (client, _server):
            first = await client.open_stream()
            second = await client.open_stream()
            assert first.stream_id is None and client.num_streams == 2
            await second.send_all(b"b")  # ids follow the order frames leave in
            await first.send_all(b"a")
            assert (second.stream_id, first.stream_id) == (1, 3)
            channel = client.channel
            assert isinstance(channel, MemoryFrameChannel)
            assert [decode_frame(f)[0] for f in channel.sent] == [OPEN_DATA, OPEN_DATA]
            first.reset()
            await second.aclose()
            unused = await client.open_stream()
            unused.reset()  # never announced: nothing to send
            await trio.testing.wait_all_tasks_blocked()
            assert client.num_streams == 0
            sent = [decode_frame(f)[:2] for f in channel.sent]
            assert (RESET, 3) in sent
            assert {sid for _, sid in sent} == {1, 3}  # nothing about the unused stream

    run_virtual(main)


def test_echo_and_eof() -> None:
    async def main() -> None:
        async with mux_pair(echo) as (client, _server):
            stream = await client.open_stream()
            await stream.send_all(b"ping")
            assert bytes(await stream.receive_exactly(4)) == b"ping"
            await stream.send_eof()
            assert await stream.receive_some() == b""
            assert stream.finished
            assert client.num_streams == 0

    run_virtual(main)


def test_many_concurrent_streams_keep_their_data_apart() -> None:
    async def main() -> None:
        async with mux_pair(echo) as (client, _server):
            results: dict[int, bytes] = {}

            async def one(i: int) -> None:
                stream = await client.open_stream()
                payload = bytes([i]) * (50_000 + i * 1000)
                async with trio.open_nursery() as n:
                    n.start_soon(
                        stream.send_parts,
                        [payload],
                    )
                    results[i] = await stream.receive_exactly(len(payload))
                await stream.send_eof()
                assert await stream.receive_some() == b""

            async with trio.open_nursery() as nursery:
                for i in range(40):
                    nursery.start_soon(one, i)
            for i in range(40):
                assert bytes(results[i]) == bytes([i]) * (50_000 + i * 1000)

    run_virtual(main)


def test_concurrent_senders_or_receivers_on_one_stream_are_refused() -> None:
    config = MuxConfig(initial_window=16 << 10, max_frame_payload=16 << 10)

    async def main() -> None:
        async def hang(stream: MuxStream) -> None:
            await trio.sleep_forever()

        async with mux_pair(hang, config) as (client, _server):
            stream = await client.open_stream()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.send_all, bytes(64 << 10))  # blocks at the window
                nursery.start_soon(stream.receive_exactly, 10)  # blocks: nothing comes
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(trio.BusyResourceError):
                    await stream.send_all(b"interleaved")
                with pytest.raises(trio.BusyResourceError):
                    await stream.receive_exactly(1)
                nursery.cancel_scope.cancel()

    run_virtual(main)
