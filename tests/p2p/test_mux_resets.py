"""The stream multiplexer's resets, cancellations and connection shutdown (close, GOAWAY),
over an in-memory frame channel (no encryption, virtual time)."""

from __future__ import annotations

import gc
import weakref

import pytest
import trio
import trio.testing

from p2p.errors import ConnectionClosed
from p2p.mux import GOAWAY, OPEN_DATA, RESET, Mux, MuxConfig, MuxStream, decode_frame
from tests.p2p.muxhelpers import (
    MemoryFrameChannel,
    _no_streams,
    echo,
    frame_channel_pair,
    mux_pair,
    raw_vs_mux,
    run_virtual,
)


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


def test_a_closed_mux_lets_go_of_the_owner_its_handler_belongs_to() -> None:
    """A node's handler is often a method of the object that holds the mux: once the
    connection has ended, dropping that object frees it by reference counting alone (a cycle
    through the handler would wait for the cyclic collector, and a busy node's memory grew)."""

    class Owner:
        def __init__(self, channel: MemoryFrameChannel) -> None:
            self.mux = Mux(channel, initiator=False, handle_stream=self.handle, label="owner")

        async def handle(self, stream: MuxStream) -> None:
            await echo(stream)

    async def main() -> weakref.ref:
        ca, cb = frame_channel_pair()
        client = Mux(ca, initiator=True, handle_stream=_no_streams, label="client")
        owner = Owner(cb)
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            await nursery.start(owner.mux.run)
            stream = await client.open_stream()
            await stream.send_all(b"ping")
            assert await stream.receive_some() == b"ping"
            await client.aclose("done")
        assert owner.mux.is_closed
        with pytest.raises(ConnectionClosed):  # no stream is served after the end
            await owner.mux._handle_stream(stream)
        ref = weakref.ref(owner)
        del owner
        return ref

    gc.disable()
    try:
        ref = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
        assert ref() is None
    finally:
        gc.enable()
