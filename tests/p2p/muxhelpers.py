"""Helpers shared by the stream multiplexer tests (tests/p2p/test_mux_*.py): an in-memory
frame channel, a running pair of muxes, a hand-driven raw peer, virtual time."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import trio
import trio.testing

from p2p.errors import ConnectionClosed
from p2p.mux import Mux, MuxConfig, MuxStream, encode_frame


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
