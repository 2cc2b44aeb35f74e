"""The stream multiplexer over an in-memory frame channel (no encryption, virtual time)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing

from p2p.errors import ConnectionClosed, ProtocolError
from p2p.mux import (
    BULK,
    BULK_MIN,
    DATA,
    EOF,
    GOAWAY,
    OPEN,
    OPEN_DATA,
    RESET,
    WINDOW,
    MemoryBudget,
    Mux,
    MuxConfig,
    MuxStream,
    decode_frame,
    encode_frame,
)
from p2p.rpc import MessageStream


class MemoryFrameChannel:
    """A test-only plaintext frame channel: one side of a pair of trio memory channels."""

    def __init__(
        self,
        send: trio.MemorySendChannel,
        receive: trio.MemoryReceiveChannel,
        max_frame: int = 1 << 20,
    ) -> None:
        self._send = send
        self._receive = receive
        self.max_frame = max_frame
        self.sent: list[bytes] = []

    async def send_frame(self, data: bytes | bytearray | memoryview) -> None:
        frame = bytes(data)
        assert len(frame) <= self.max_frame
        self.sent.append(frame)
        try:
            await self._send.send(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise ConnectionClosed("peer gone") from e

    async def receive_frame(self) -> bytes:
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError) as e:
            raise ConnectionClosed("channel closed") from e

    async def aclose(self) -> None:
        await self._send.aclose()
        await self._receive.aclose()


def frame_channel_pair(
    capacity: int = 4, first: type[MemoryFrameChannel] = MemoryFrameChannel
) -> tuple[MemoryFrameChannel, MemoryFrameChannel]:
    """Two connected channels; the first of class ``first`` (e.g. one that stalls its sends)."""
    a_send, b_receive = trio.open_memory_channel[bytes](capacity)
    b_send, a_receive = trio.open_memory_channel[bytes](capacity)
    return first(a_send, a_receive), MemoryFrameChannel(b_send, b_receive)


Handler = Callable[[MuxStream], Awaitable[None]]


async def _no_streams(stream: MuxStream) -> None:
    raise AssertionError("unexpected inbound stream")


@asynccontextmanager
async def mux_pair(
    server_handler: Handler, config: MuxConfig = MuxConfig()
) -> AsyncIterator[tuple[Mux, Mux]]:
    """(client mux, server mux), both running; the server runs ``server_handler`` per stream."""
    ca, cb = frame_channel_pair()
    client = Mux(ca, initiator=True, handle_stream=_no_streams, config=config, label="client")
    server = Mux(cb, initiator=False, handle_stream=server_handler, config=config, label="server")
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        await nursery.start(server.run)
        yield client, server
        nursery.cancel_scope.cancel()


def run_virtual(fn: Callable[[], Awaitable[None]]) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


async def echo(stream: MuxStream) -> None:
    while True:
        data = await stream.receive_some()
        if not data:
            break
        await stream.send_all(data)
    await stream.send_eof()


async def read_all(stream: MuxStream) -> bytes:
    parts = []
    while True:
        data = await stream.receive_some()
        if not data:
            return b"".join(bytes(p) for p in parts)
        parts.append(bytes(data))


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


def test_reset_cancels_the_remote_handler() -> None:
    async def main() -> None:
        started = trio.Event()
        cancelled = trio.Event()

        async def server(stream: MuxStream) -> None:
            started.set()
            try:
                await trio.sleep_forever()
            finally:
                cancelled.set()

        async with mux_pair(server) as (client, server_mux):
            stream = await client.open_stream()
            await stream.send_all(b"x")
            await started.wait()
            stream.reset("caller gave up")
            with trio.fail_after(5):
                await cancelled.wait()
            with pytest.raises(ConnectionClosed):
                await stream.send_all(b"more")
            await trio.testing.wait_all_tasks_blocked()
            assert server_mux.num_streams == 0 and client.num_streams == 0
            assert not client.is_closed  # a reset touches only its stream

    run_virtual(main)


def test_data_received_before_a_remote_reset_stays_readable() -> None:
    async def main() -> None:
        async def server(stream: MuxStream) -> None:
            await stream.send_all(b"last words")
            stream.reset("bye")

        async with mux_pair(server) as (client, _server):
            stream = await client.open_stream()
            await stream.send_all(b"?")
            await trio.testing.wait_all_tasks_blocked()
            assert bytes(await stream.receive_exactly(10)) == b"last words"
            with pytest.raises(ConnectionClosed, match="bye"):
                await stream.receive_some()

    run_virtual(main)


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


class RawPeer:
    """Drives one side of a frame channel by hand, to break the protocol on purpose."""

    def __init__(self, channel: MemoryFrameChannel) -> None:
        self.channel = channel

    async def send(self, kind: int, sid: int, payload: bytes = b"") -> None:
        await self.channel.send_frame(encode_frame(kind, sid, payload))


@asynccontextmanager
async def raw_vs_mux(
    handler: Handler = echo, config: MuxConfig = MuxConfig()
) -> AsyncIterator[tuple[RawPeer, Mux]]:
    ca, cb = frame_channel_pair(capacity=1000)
    mux = Mux(cb, initiator=False, handle_stream=handler, config=config, label="victim")
    async with trio.open_nursery() as nursery:
        await nursery.start(mux.run)
        yield RawPeer(ca), mux
        nursery.cancel_scope.cancel()


def test_sending_beyond_the_window_closes_the_connection(caplog: pytest.LogCaptureFixture) -> None:
    config = MuxConfig(initial_window=32 << 10, max_frame_payload=16 << 10)

    async def silent(stream: MuxStream) -> None:
        await trio.sleep_forever()

    async def main() -> None:
        async with raw_vs_mux(silent, config) as (peer, mux):
            await peer.send(OPEN, 1)
            for _ in range(3):  # 48 KiB into a 32 KiB window
                await peer.send(DATA, 1, bytes(16 << 10))
            with trio.fail_after(5):
                await mux.closed.wait()
            assert "granted" in (mux.close_reason or "")

    with caplog.at_level(logging.WARNING, logger="p2p.mux"):
        run_virtual(main)
    assert any("protocol violation" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([(DATA, 1, b"x")], "unopened"),
        ([(OPEN, 2, b"")], "parity"),
        ([(OPEN, 3, b""), (OPEN, 1, b"")], "reused"),
        ([(OPEN, 1, b""), (EOF, 1, b""), (DATA, 1, b"x")], "after EOF"),
        ([(OPEN, 1, b""), (WINDOW, 1, (2**31).to_bytes(4, "big"))], "overflow"),
        ([(OPEN, 1, b""), (BULK, 1, (0).to_bytes(4, "big"))], "BULK of 0"),
        (
            [(OPEN, 1, b""), (BULK, 1, (MuxConfig().initial_window + 1).to_bytes(4, "big"))],
            "granted",
        ),
        ([(OPEN, 1, b""), (EOF, 1, b""), (BULK, 1, (1).to_bytes(4, "big"))], "BULK after EOF"),
        # the frame after a BULK must be exactly as long as announced (here a 6-byte frame)
        ([(OPEN, 1, b""), (BULK, 1, (10).to_bytes(4, "big")), (DATA, 1, b"x")], "announced 10"),
    ],
)
def test_protocol_violations_close_the_connection(frames: list, reason: str) -> None:
    async def silent(stream: MuxStream) -> None:
        # never answers: with echo, its EOF could finish stream 1 before the offending frame
        # arrives, which then is a harmless late frame (a race trio's scheduler may decide)
        await trio.sleep_forever()

    async def main() -> None:
        async with raw_vs_mux(silent) as (peer, mux):
            for kind, sid, payload in frames:
                await peer.send(kind, sid, payload)
            with trio.fail_after(5):
                await mux.closed.wait()
            assert reason in (mux.close_reason or "")

    run_virtual(main)


def test_frames_for_finished_streams_are_ignored() -> None:
    async def main() -> None:
        async def resetter(stream: MuxStream) -> None:
            stream.reset("no thanks")

        async with raw_vs_mux(resetter) as (peer, mux):
            await peer.send(OPEN, 1)
            await trio.testing.wait_all_tasks_blocked()
            # the peer had these in flight when our reset crossed them
            await peer.send(DATA, 1, b"late")
            await peer.send(EOF, 1)
            await peer.send(RESET, 1, b"late reset")
            # a late BULK: its raw frame is dropped unread (parsed as a frame it would be fatal)
            raw = encode_frame(DATA, 77, b"unopened")
            await peer.send(BULK, 1, len(raw).to_bytes(4, "big"))
            await peer.channel.send_frame(raw)
            await trio.testing.wait_all_tasks_blocked()
            assert not mux.is_closed

    run_virtual(main)


def test_peer_closing_resets_every_stream() -> None:
    async def main() -> None:
        async def hang(stream: MuxStream) -> None:
            await trio.sleep_forever()

        async with mux_pair(hang) as (client, server):
            stream = await client.open_stream()
            await stream.send_eof()
            await trio.testing.wait_all_tasks_blocked()
            await server.aclose("shutting down")
            with trio.fail_after(5):
                await client.closed.wait()
            assert "shutting down" in (client.close_reason or "")
            with pytest.raises(ConnectionClosed):
                await stream.receive_some()

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


class StallingFrameChannel(MemoryFrameChannel):
    """Blocks every send until ``release`` is set (a congested connection)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.release = trio.Event()

    async def send_frame(self, data: bytes | bytearray | memoryview) -> None:
        await self.release.wait()
        await super().send_frame(data)


def test_cancelling_a_first_send_leaves_no_trace_on_the_wire() -> None:
    async def main() -> None:
        ca, cb = frame_channel_pair(10, first=StallingFrameChannel)
        client = Mux(ca, initiator=True, handle_stream=_no_streams)
        server = Mux(cb, initiator=False, handle_stream=echo)
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            await nursery.start(server.run)
            stream = await client.open_stream()
            with trio.move_on_after(1):
                await stream.send_all(b"never sent")
            assert stream.is_reset and client.num_streams == 0
            ca.release.set()
            other = await client.open_stream()
            await other.send_all(b"ok")
            assert bytes(await other.receive_exactly(2)) == b"ok"
            await trio.testing.wait_all_tasks_blocked()
            assert not server.is_closed and not client.is_closed
            sent = [decode_frame(f)[:2] for f in ca.sent]
            assert RESET not in [kind for kind, _ in sent]  # nothing about the first stream
            assert sent[0] == (OPEN_DATA, 3)  # id 1 was skipped: allowed, order is kept
            nursery.cancel_scope.cancel()

    run_virtual(main)


def test_many_local_resets_at_once_keep_the_connection() -> None:
    config = MuxConfig(max_pending_control=4)

    async def main() -> None:
        async def hang(stream: MuxStream) -> None:
            await trio.sleep_forever()

        async with mux_pair(hang, config) as (client, server):
            streams = [await client.open_stream() for _ in range(20)]
            for stream in streams:
                await stream.send_all(b"x")
            await trio.testing.wait_all_tasks_blocked()
            for stream in streams:  # e.g. a batch of calls cancelled together
                stream.reset("cancelled")
            await trio.testing.wait_all_tasks_blocked()
            assert not client.is_closed and not server.is_closed
            assert server.num_streams == 0

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


def test_goaway_names_the_streams_the_peer_never_processed() -> None:
    async def main() -> None:
        async with raw_vs_mux() as (peer, mux):
            first, second = await mux.open_stream(), await mux.open_stream()
            await first.send_all(b"a")
            await second.send_all(b"b")
            ids = [decode_frame(await peer.channel.receive_frame())[1] for _ in range(2)]
            assert ids == [2, 4]
            await peer.send(GOAWAY, 2, b"idle")  # saw stream 2, never stream 4
            with trio.fail_after(5):
                await mux.closed.wait()
            assert not first.unprocessed and second.unprocessed
            with pytest.raises(ConnectionClosed, match="idle"):
                await second.receive_some()

    run_virtual(main)


# ---- BULK: big buffers as frames of their own ---------------------------------------------


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
