"""The secure channel over real TCP loopback (the recv_into/send fast path): frames of every
size, bad length prefixes, resets, timeouts, trickling frames."""

from __future__ import annotations

import os
import socket
import struct

import pytest
import trio
import trio.testing

from p2p.errors import ConnectionClosed, HandshakeError
from p2p.secure import DEFAULT_MAX_FRAME, secure_inbound
from tests.p2p.securehelpers import (
    ALL_CIPHERS,
    BOB,
    SIZES,
    Tap,
    handshake_both,
    raw_tcp_pair,
    tcp_pair,
    transfer,
)


@pytest.mark.parametrize("cipher", ALL_CIPHERS)
def test_tcp_loopback_frames_of_every_size(cipher):
    async def main():
        kw = {"cipher": cipher}
        out, inn, _ = await tcp_pair(kw, kw)
        assert out.cipher == cipher
        frames = [os.urandom(n) for n in SIZES] + [os.urandom(37) for _ in range(200)]
        assert await transfer(out, inn, frames) == frames
        big = [os.urandom(DEFAULT_MAX_FRAME) for _ in range(6)]
        assert await transfer(inn, out, big) == big
        await out.aclose()
        with pytest.raises(ConnectionClosed, match="peer closed"):
            await inn.receive_frame()
        await inn.aclose()

    trio.run(main)


def test_tcp_loopback_oversized_length_prefix_closes_connection():
    async def main():
        out, inn, client = await tcp_pair()
        await client.send_all(b"\xff\xff\xff\xff")
        with trio.fail_after(10):
            with pytest.raises(ConnectionClosed, match="invalid frame length 4294967295"):
                await inn.receive_frame()
            with pytest.raises(ConnectionClosed):
                await out.receive_frame()

    trio.run(main)


def test_tcp_loopback_peer_reset_is_connection_closed():
    async def main():
        out, inn, client = await tcp_pair()
        client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await client.aclose()  # RST
        with trio.fail_after(10), pytest.raises(ConnectionClosed):
            while True:
                await inn.send_frame(b"x" * 60000)

    trio.run(main)


def test_tcp_loopback_silent_client_times_out():
    async def main():
        client, server = await raw_tcp_pair()
        with trio.fail_after(10), pytest.raises(HandshakeError, match="timed out"):
            await secure_inbound(server, BOB, timeout=0.2)
        assert await client.receive_some() == b""
        await client.aclose()

    trio.run(main)


def test_tcp_stalled_frame_is_closed_by_the_frame_watcher():
    """Over a socket the mux runs ``watch_frames``: frames are then timed by that task instead
    of a cancel scope each, and a frame that stops midway still closes the connection."""

    async def main():
        out, inn, client = await tcp_pair(in_kwargs={"frame_timeout": 0.3})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(inn.watch_frames)
            await trio.sleep(0.01)
            assert inn._watched
            with trio.move_on_after(0.6) as idle:  # idle time between frames is not limited
                await inn.receive_frame()
            assert idle.cancelled_caught and not inn.closed
            await client.send_all(struct.pack(">I", 1000) + b"x" * 10)  # then silence
            with trio.fail_after(10), pytest.raises(ConnectionClosed, match="not completed"):
                await inn.receive_frame()
            assert inn.closed
        await out.aclose()

    trio.run(main)


class Trickle(Tap):
    """Sends in small pieces with pauses, so a big frame reaches the reader a bit at a time."""

    async def send_all(self, data) -> None:
        view = memoryview(bytes(data))
        for i in range(0, len(view), 48 << 10):
            await self.inner.send_all(view[i : i + (48 << 10)])
            await trio.sleep(0.002)


def test_tcp_frames_trickling_in_arrive_whole_and_small_ones_still_wake_the_reader():
    """The reader asks the kernel to wake it only once a big frame's missing bytes are all
    there (SO_RCVLOWAT); that mark must never exceed what is missing, or a reader would wait
    for bytes that never come: each frame here is the last one in flight when it is read."""

    async def main():
        client, server = await raw_tcp_pair()
        out, inn = await handshake_both(Trickle(client), server)
        out, inn = out.unwrap(), inn.unwrap()
        with trio.fail_after(20):
            for size in (DEFAULT_MAX_FRAME, 3, 200 << 10, 70 << 10, 1, DEFAULT_MAX_FRAME):
                frame = os.urandom(size)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(out.send_frame, frame)
                    assert await inn.receive_frame() == frame
        await out.aclose()
        await inn.aclose()

    trio.run(main)
