"""The secure channel's frames after the handshake: confidentiality, and tampered, replayed,
reordered, dropped, oversized or stalled frames."""

from __future__ import annotations

import logging
import os
import struct

import pytest
import trio
import trio.testing

from p2p import secure_buffers
from p2p.errors import ConnectionClosed
from p2p.secure import DEFAULT_MAX_FRAME
from tests.p2p.securehelpers import ALL_CIPHERS, BOB, memory_pair, run_mock, tcp_pair, transfer


def test_confidentiality_no_plaintext_on_the_wire():
    async def main():
        out, inn, tap = await memory_pair(tap=True)
        secret = b"TOP-SECRET-GRADIENT-" * 50
        assert await transfer(out, inn, [secret, secret[:40]]) == [secret, secret[:40]]
        wire = b"".join(tap.sent)
        for i in range(0, len(secret) - 16, 7):
            assert secret[i : i + 16] not in wire
        # the responder's identity travels sealed; only the dialer's key is in the clear
        assert BOB.public_key not in wire

    run_mock(main)


def _flip_last_bit(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


def _flip_first_ciphertext_bit(data: bytes) -> bytes:
    return data[:4] + bytes([data[4] ^ 0x80]) + data[5:]


@pytest.mark.parametrize("size", [14, DEFAULT_MAX_FRAME])  # big ones decrypt into fresh bytes
@pytest.mark.parametrize("mutate", [_flip_last_bit, _flip_first_ciphertext_bit])
def test_tampered_frame_closes_connection(mutate, size, caplog):
    async def main():
        out, inn, tap = await memory_pair(tap=True)
        assert await transfer(out, inn, [b"before"]) == [b"before"]
        tap.mutate = mutate
        await out.send_frame(b"attack at dawn".ljust(size, b"!"))
        with pytest.raises(ConnectionClosed, match="authentication"):
            await inn.receive_frame()
        with pytest.raises(ConnectionClosed):
            await inn.receive_frame()
        with pytest.raises(ConnectionClosed):
            await inn.send_frame(b"still there?")
        assert inn.closed
        with pytest.raises(ConnectionClosed):
            await out.receive_frame()  # the victim hung up on us

    with caplog.at_level(logging.WARNING, logger="p2p.secure"):
        run_mock(main)
    assert "failed authentication" in caplog.text


@pytest.mark.parametrize("cipher", ALL_CIPHERS)
def test_big_frames_arrive_as_bytes_objects_of_their_own(cipher):
    """Big frames are decrypted into fresh bytes objects that were never zero-filled
    (p2p.secure_buffers): each must hold exactly its plaintext, whatever came before."""

    async def main():
        kw = {"cipher": cipher}
        out, inn, _ = await memory_pair(out_kwargs=kw, in_kwargs=kw)
        frames = [os.urandom(n) for n in (64 << 10, DEFAULT_MAX_FRAME, 200 << 10, 1, 70000)]
        got = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(out.send_frames, frames)
            for _ in frames:
                got.append(await inn.receive_frame())  # as the channel returns them
        assert got == frames
        assert all(type(g) is bytes for g in got)
        assert len({id(g) for g in got}) == len(got)

    run_mock(main)


def test_fresh_bytes_holds_what_was_written():
    if not secure_buffers.AVAILABLE:
        pytest.skip("not CPython: the channel decrypts into zeroed buffers")
    obj, view = secure_buffers.fresh_bytes(1 << 16)
    view[:] = bytes(range(256)) * 256
    view.release()
    assert type(obj) is bytes and obj == bytes(range(256)) * 256
    with pytest.raises(ValueError):
        secure_buffers.fresh_bytes(0)


def test_replayed_frame_closes_connection():
    async def main():
        out, inn, tap = await memory_pair(tap=True)
        assert await transfer(out, inn, [b"pay 10"]) == [b"pay 10"]
        await tap.inner.send_all(tap.sent[-1])  # the attacker resends the captured frame
        with pytest.raises(ConnectionClosed, match="replayed"):
            await inn.receive_frame()

    run_mock(main)


def test_reordered_frames_close_connection():
    async def main():
        out, inn, tap = await memory_pair(tap=True)
        tap.mutate = lambda data: None  # hold everything
        await out.send_frame(b"first")
        await out.send_frame(b"second")
        first, second = tap.sent[-2:]
        await tap.inner.send_all(second)
        await tap.inner.send_all(first)
        with pytest.raises(ConnectionClosed, match="reordered"):
            await inn.receive_frame()

    run_mock(main)


def test_dropped_frame_closes_connection():
    async def main():
        out, inn, tap = await memory_pair(tap=True)
        tap.mutate = lambda data: None if len(tap.sent) == 3 else data  # hello, finish, frame
        await out.send_frame(b"dropped")
        await out.send_frame(b"kept")
        with pytest.raises(ConnectionClosed, match="authentication"):
            await inn.receive_frame()

    run_mock(main)


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"\xff\xff\xff\xff" + b"x" * 100, "invalid frame length 4294967295"),
        (struct.pack(">I", DEFAULT_MAX_FRAME + 17), "invalid frame length"),
        (struct.pack(">I", 15) + b"y" * 15, "invalid frame length 15"),
        (struct.pack(">I", 0), "invalid frame length 0"),
        (struct.pack(">I", 100) + b"z" * 20, "inside a frame"),  # then EOF
        (b"\x00\x00", "inside a frame"),
        (struct.pack(">I", 16) + bytes(16), "authentication"),
    ],
)
def test_garbage_after_handshake_closes_connection(raw, fragment):
    async def main():
        out, inn, tap = await memory_pair(tap=True)
        await tap.inner.send_all(raw)
        await tap.inner.send_eof()
        with pytest.raises(ConnectionClosed, match=fragment):
            await inn.receive_frame()
        with pytest.raises(ConnectionClosed):
            await out.receive_frame()

    run_mock(main)


def test_clean_close_is_connection_closed_for_the_peer():
    async def main():
        out, inn, _ = await memory_pair()
        await out.aclose()
        await out.aclose()  # idempotent
        with pytest.raises(ConnectionClosed, match="peer closed"):
            await inn.receive_frame()
        with pytest.raises(ConnectionClosed, match="closed locally"):
            await out.send_frame(b"x")
        with pytest.raises(ConnectionClosed, match="closed locally"):
            await out.receive_frame()

    run_mock(main)


def test_oversized_send_is_refused_locally_and_channel_survives():
    async def main():
        kw = {"max_frame": 1024}
        out, inn, _ = await memory_pair(out_kwargs=kw, in_kwargs=kw)
        with pytest.raises(ValueError, match="exceeds max_frame"):
            await out.send_frame(b"x" * 1025)
        assert await transfer(out, inn, [b"y" * 1024]) == [b"y" * 1024]

    run_mock(main)


def test_receiver_enforces_its_own_max_frame():
    async def main():
        out, inn, _ = await memory_pair(in_kwargs={"max_frame": 1024})
        await out.send_frame(b"x" * 2000)
        with pytest.raises(ConnectionClosed, match="invalid frame length 2016"):
            await inn.receive_frame()

    run_mock(main)


def test_stalled_frame_hits_frame_timeout():
    async def main():
        out, inn, tap = await memory_pair(tap=True, in_kwargs={"frame_timeout": 5.0})
        with trio.move_on_after(60.0) as idle:  # idle time between frames is not limited
            await inn.receive_frame()
        assert idle.cancelled_caught and not inn.closed
        tap.mutate = lambda data: data[:10]  # header and a little, then silence
        await out.send_frame(b"q" * 100)
        start = trio.current_time()
        with pytest.raises(ConnectionClosed, match="not completed within"):
            await inn.receive_frame()
        assert trio.current_time() - start == pytest.approx(5.0)

    run_mock(main)


def test_cancelled_receive_keeps_partial_data():
    async def main():
        out, inn, tap = await memory_pair(tap=True)
        held = []
        tap.mutate = lambda data: held.append(data)  # hold the frame
        await out.send_frame(b"patience")
        await tap.inner.send_all(held[0][:7])
        with trio.move_on_after(1.0):
            await inn.receive_frame()
        await tap.inner.send_all(held[0][7:])
        assert await inn.receive_frame() == b"patience"

    run_mock(main)


def test_concurrent_receivers_or_senders_are_refused():
    async def main():
        out, inn, tap = await memory_pair(tap=True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(inn.receive_frame)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError):
                await inn.receive_frame()
            nursery.cancel_scope.cancel()
        release = trio.Event()

        async def slow_send(data):
            await release.wait()
            await tap.inner.send_all(data)

        tap.send_all = slow_send
        async with trio.open_nursery() as nursery:
            nursery.start_soon(out.send_frame, b"one")
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError):
                await out.send_frame(b"two")
            release.set()
        assert await inn.receive_frame() == b"one"

    run_mock(main)


@pytest.mark.parametrize("transport", ["memory", "tcp"])
def test_send_frames_batches_into_ordinary_frames(transport):
    async def main():
        out, inn, _ = await (memory_pair() if transport == "memory" else tcp_pair())
        batch = [b"", b"a", os.urandom(1000), os.urandom(DEFAULT_MAX_FRAME), b"z" * 17]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(out.send_frames, batch)
            got = [bytes(await inn.receive_frame()) for _ in batch]
        assert got == batch
        await out.send_frames([])
        assert await transfer(out, inn, [b"after"]) == [b"after"]  # counters stayed in step
        with pytest.raises(ValueError, match="exceeds max_frame"):
            await out.send_frames([b"ok", b"x" * (DEFAULT_MAX_FRAME + 1)])
        assert await transfer(out, inn, [b"still fine"]) == [b"still fine"]

    if transport == "memory":
        run_mock(main)
    else:
        trio.run(main)


def test_memoryview_and_bytearray_frames():
    async def main():
        out, inn, _ = await memory_pair()
        data = bytearray(os.urandom(5000))
        await out.send_frame(memoryview(data)[100:4100])
        await out.send_frame(data)
        assert await inn.receive_frame() == bytes(data[100:4100])
        assert await inn.receive_frame() == bytes(data)

    run_mock(main)
