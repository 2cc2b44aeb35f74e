"""Helpers shared by the secure channel tests (tests/p2p/test_secure_*.py): identities,
in-memory and TCP loopback channel pairs, a wire tap."""

from __future__ import annotations

import functools

import outcome
import trio
import trio.testing

from p2p.aead import AES_256_GCM, AES_256_OCB, CHACHA20_POLY1305
from p2p.identity import Identity
from p2p.secure import DEFAULT_MAX_FRAME, SecureChannel, secure_inbound, secure_outbound

ALICE = Identity.from_seed(b"alice")
BOB = Identity.from_seed(b"bob")
MALLORY = Identity.from_seed(b"mallory")
ALL_CIPHERS = [CHACHA20_POLY1305, AES_256_GCM, AES_256_OCB]


def run_mock(fn, *args):
    """Run under a MockClock that skips idle time: timeouts pass instantly and deterministically."""
    return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


class Tap(trio.abc.HalfCloseableStream):
    """Wraps the dialer's stream: records what it sends and lets a test alter or hold it."""

    def __init__(self, inner: trio.abc.HalfCloseableStream) -> None:
        self.inner = inner
        self.sent: list[bytes] = []
        self.mutate = None  # callable(bytes) -> bytes | None (None: drop)

    async def send_all(self, data) -> None:
        data = bytes(data)
        self.sent.append(data)
        if self.mutate is not None:
            data = self.mutate(data)
            if data is None:
                await trio.lowlevel.checkpoint()
                return
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        return await self.inner.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def handshake_both(out_stream, in_stream, *, out_kwargs=None, in_kwargs=None):
    """Run both handshakes concurrently; returns (outcome of outbound, outcome of inbound)."""
    out_kwargs = {"identity": ALICE, "expected": BOB.peer_id, **(out_kwargs or {})}
    in_kwargs = {"identity": BOB, **(in_kwargs or {})}
    results = {}

    async def inbound():
        results["in"] = await outcome.acapture(
            functools.partial(secure_inbound, in_stream, **in_kwargs)
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(inbound)
        results["out"] = await outcome.acapture(
            functools.partial(secure_outbound, out_stream, **out_kwargs)
        )
    return results["out"], results["in"]


async def memory_pair(*, tap=False, out_kwargs=None, in_kwargs=None):
    a, b = trio.testing.memory_stream_pair()
    if tap:
        a = Tap(a)
    out, inn = await handshake_both(a, b, out_kwargs=out_kwargs, in_kwargs=in_kwargs)
    return out.unwrap(), inn.unwrap(), a


async def transfer(sender: SecureChannel, receiver: SecureChannel, frames: list[bytes]) -> list:
    got = []
    async with trio.open_nursery() as nursery:

        async def send_all_frames():
            for frame in frames:
                await sender.send_frame(frame)

        nursery.start_soon(send_all_frames)
        for _ in frames:
            got.append(bytes(await receiver.receive_frame()))
    return got


SIZES = [0, 1, 15, 16, 17, 1000, 65535, 65536, 65537, DEFAULT_MAX_FRAME - 1, DEFAULT_MAX_FRAME]


async def raw_tcp_pair():
    """A plain TCP connection on 127.0.0.1: (client stream, server stream)."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = await trio.open_tcp_stream("127.0.0.1", listener.getsockname()[1])
    server_sock, _ = await listener.accept()
    listener.close()
    return client, trio.SocketStream(server_sock)


async def tcp_pair(out_kwargs=None, in_kwargs=None):
    """A secured TCP connection on 127.0.0.1; returns (outbound, inbound, raw client socket)."""
    client, server = await raw_tcp_pair()
    out, inn = await handshake_both(client, server, out_kwargs=out_kwargs, in_kwargs=in_kwargs)
    return out.unwrap(), inn.unwrap(), client
