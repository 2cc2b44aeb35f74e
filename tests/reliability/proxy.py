"""A tiny trio TCP forwarder that records every byte crossing it (for wire-level tests)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio


@dataclass
class Capture:
    """Bytes seen per direction: ``to_server`` (client -> listener) and ``to_client``."""

    port: int = 0
    to_server: bytearray = field(default_factory=bytearray)
    to_client: bytearray = field(default_factory=bytearray)
    connections: int = 0

    def all_bytes(self) -> bytes:
        return bytes(self.to_server) + b"\x00" * 64 + bytes(self.to_client)


async def _pump(src: trio.abc.Stream, dst: trio.abc.Stream, sink: bytearray) -> None:
    try:
        while data := await src.receive_some(65536):
            sink += data
            await dst.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await trio.aclose_forcefully(dst)


@asynccontextmanager
async def capturing_proxy(target_port: int) -> AsyncIterator[Capture]:
    """Listen on 127.0.0.1 (``capture.port``) and forward each connection to ``target_port``."""
    capture = Capture()

    async def handle(client: trio.SocketStream) -> None:
        capture.connections += 1
        try:
            server = await trio.open_tcp_stream("127.0.0.1", target_port)
        except OSError:
            await client.aclose()
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump, client, server, capture.to_server)
            nursery.start_soon(_pump, server, client, capture.to_client)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1")
        )
        capture.port = listeners[0].socket.getsockname()[1]
        try:
            yield capture
        finally:
            nursery.cancel_scope.cancel()
