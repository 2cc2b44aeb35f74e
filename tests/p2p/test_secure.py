"""The secure channel: handshake, framing, ciphers, and every way a peer can misbehave."""

from __future__ import annotations

import functools
import logging
import os
import socket
import struct

import outcome
import pytest
import trio
import trio.testing

from p2p import secure_buffers
from p2p.aead import (
    AES_256_GCM,
    CHACHA20_POLY1305,
    OFFER_AES,
    OFFER_CHACHA,
    choose_cipher,
    cpuinfo_has_aes,
    has_aes_hardware,
    local_offers,
)
from p2p.errors import ConnectionClosed, HandshakeError, PeerIDMismatch
from p2p.handshake import LABEL, InitiatorHandshake, ResponderHandshake
from p2p.identity import Identity
from p2p.secure import DEFAULT_MAX_FRAME, SecureChannel, secure_inbound, secure_outbound

ALICE = Identity.from_seed(b"alice")
BOB = Identity.from_seed(b"bob")
MALLORY = Identity.from_seed(b"mallory")
BOTH_CIPHERS = [CHACHA20_POLY1305, AES_256_GCM]


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


# ---- handshake ------------------------------------------------------------------------------


@pytest.mark.parametrize("cipher", BOTH_CIPHERS)
def test_handshake_authenticates_both_sides_and_carries_frames(cipher):
    async def main():
        kw = {"cipher": cipher}
        out, inn, _ = await memory_pair(out_kwargs=kw, in_kwargs=kw)
        assert out.cipher == inn.cipher == cipher
        assert out.remote_peer == BOB.peer_id and inn.remote_peer == ALICE.peer_id
        assert out.local_peer == ALICE.peer_id and inn.local_peer == BOB.peer_id
        assert out.remote_public_key == BOB.public_key
        assert inn.remote_public_key == ALICE.public_key
        frames = [os.urandom(n) for n in SIZES]
        assert await transfer(out, inn, frames) == frames
        assert await transfer(inn, out, frames[::-1]) == frames[::-1]

    run_mock(main)


def test_both_directions_at_once():
    async def main():
        out, inn, _ = await memory_pair()
        a_frames = [os.urandom(n) for n in (5, 70000, 0, 3)]
        b_frames = [os.urandom(n) for n in (100000, 1, 2, 0, 9)]
        async with trio.open_nursery() as nursery:
            results = {}

            async def one(name, s, r, frames):
                results[name] = await transfer(s, r, frames)

            nursery.start_soon(one, "ab", out, inn, a_frames)
            nursery.start_soon(one, "ba", inn, out, b_frames)
        assert results == {"ab": a_frames, "ba": b_frames}

    run_mock(main)


@pytest.mark.parametrize(
    ("out_cipher", "in_cipher", "expected"),
    [
        (AES_256_GCM, AES_256_GCM, AES_256_GCM),
        (AES_256_GCM, CHACHA20_POLY1305, CHACHA20_POLY1305),
        (CHACHA20_POLY1305, AES_256_GCM, CHACHA20_POLY1305),
        (CHACHA20_POLY1305, CHACHA20_POLY1305, CHACHA20_POLY1305),
    ],
)
def test_cipher_negotiation(out_cipher, in_cipher, expected):
    async def main():
        out, inn, _ = await memory_pair(
            out_kwargs={"cipher": out_cipher}, in_kwargs={"cipher": in_cipher}
        )
        assert out.cipher == inn.cipher == expected
        assert await transfer(out, inn, [b"x" * 100]) == [b"x" * 100]

    run_mock(main)


def test_automatic_cipher_follows_aes_hardware():
    async def main():
        out, inn, _ = await memory_pair()
        assert out.cipher == (AES_256_GCM if has_aes_hardware() else CHACHA20_POLY1305)

    run_mock(main)


def test_aes_detection_reads_x86_and_arm_cpuinfo():
    x86 = "processor\t: 0\nflags\t\t: fpu vme sse2 aes avx2\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1\n"
    assert cpuinfo_has_aes(x86) and cpuinfo_has_aes(arm)
    assert not cpuinfo_has_aes("flags\t\t: fpu vme sse2 vaes-like aesni\n")
    assert not cpuinfo_has_aes("model name\t: aes 9000\n")
    assert not cpuinfo_has_aes("")


def test_cipher_choice_rules():
    assert local_offers(CHACHA20_POLY1305) == OFFER_CHACHA
    assert local_offers(AES_256_GCM) == OFFER_CHACHA | OFFER_AES
    assert choose_cipher(OFFER_CHACHA | OFFER_AES | 0x80, OFFER_AES) == AES_256_GCM
    assert choose_cipher(OFFER_CHACHA | 0x40, OFFER_CHACHA | OFFER_AES) == CHACHA20_POLY1305
    with pytest.raises(HandshakeError, match="no common cipher"):
        choose_cipher(OFFER_AES, OFFER_CHACHA)
    with pytest.raises(ValueError, match="unknown cipher"):
        local_offers("rot13")


def test_pure_handshake_gives_matching_directional_keys():
    initiator = InitiatorHandshake(ALICE, OFFER_CHACHA)
    responder = ResponderHandshake(BOB, OFFER_CHACHA | OFFER_AES)
    reply = responder.process_hello(initiator.hello())
    finish, ikeys = initiator.process_reply(reply)
    rkeys = responder.process_finish(finish)
    assert ikeys.send_key == rkeys.recv_key and ikeys.recv_key == rkeys.send_key
    assert ikeys.send_key != ikeys.recv_key
    assert ikeys.cipher == rkeys.cipher == CHACHA20_POLY1305
    assert ikeys.remote_peer == BOB.peer_id and rkeys.remote_peer == ALICE.peer_id
    with pytest.raises(HandshakeError, match="out of order"):
        responder.process_finish(finish)
    with pytest.raises(HandshakeError, match="out of order"):
        initiator.process_reply(reply)


def test_sessions_use_fresh_keys():
    """Same identities, same plaintext: two sessions put different bytes on the wire."""

    async def main():
        wires = []
        for _ in range(2):
            out, inn, tap = await memory_pair(tap=True)
            await transfer(out, inn, [b"same plaintext"])
            wires.append(tap.sent[-1])
        assert wires[0] != wires[1]

    run_mock(main)


def test_expected_peer_mismatch_names_both_ids():
    async def main():
        a, b = trio.testing.memory_stream_pair()
        out, inn = await handshake_both(a, b, out_kwargs={"expected": MALLORY.peer_id})
        with pytest.raises(PeerIDMismatch) as info:
            out.unwrap()
        assert str(MALLORY.peer_id) in str(info.value) and str(BOB.peer_id) in str(info.value)
        with pytest.raises(HandshakeError):
            inn.unwrap()  # the dialer hung up before finishing

    run_mock(main)


class LyingIdentity(Identity):
    """Signs something other than what it is asked to sign."""

    __slots__ = ()

    def sign(self, data: bytes) -> bytes:
        return super().sign(data + b"!")


@pytest.mark.parametrize("liar", ["responder", "initiator"])
def test_wrong_signature_fails_handshake_on_the_other_side(liar):
    async def main():
        a, b = trio.testing.memory_stream_pair()
        out_id = LyingIdentity(ALICE._private) if liar == "initiator" else ALICE
        in_id = LyingIdentity(BOB._private) if liar == "responder" else BOB
        out, inn = await handshake_both(
            a, b, out_kwargs={"identity": out_id}, in_kwargs={"identity": in_id}
        )
        victim = out if liar == "responder" else inn
        with pytest.raises(HandshakeError, match="signature"):
            victim.unwrap()
        if liar == "responder":
            with pytest.raises(HandshakeError):
                inn.unwrap()

    run_mock(main)


def test_downgrade_by_editing_offers_is_detected():
    """A man in the middle clearing the AES bit changes the transcript: the handshake fails."""

    def strip_aes(data: bytes) -> bytes:
        if data[2 : 2 + len(LABEL)] == LABEL:  # the hello, after its 2-byte length
            i = 2 + len(LABEL)
            return data[:i] + bytes([data[i] & ~OFFER_AES]) + data[i + 1 :]
        return data

    async def main():
        a, b = trio.testing.memory_stream_pair()
        tap = Tap(a)
        tap.mutate = strip_aes
        kw = {"cipher": AES_256_GCM}
        out, inn = await handshake_both(tap, b, out_kwargs=kw, in_kwargs=kw)
        with pytest.raises(HandshakeError, match="cipher code"):
            out.unwrap()
        with pytest.raises(HandshakeError):
            inn.unwrap()

    run_mock(main)


async def _fake_peer(stream, script):
    """Play a scripted peer: bytes to send, or a float to sleep."""
    for step in script:
        if isinstance(step, bytes):
            await stream.send_all(step)
        else:
            await trio.sleep(step)


@pytest.mark.parametrize(
    ("script", "fragment"),
    [
        ([b"\x00\x10" + b"garbage garbage!"], "not a /dedloc-jax"),
        ([b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"], "exceeds"),
        ([b"\xff\xff"], "exceeds"),
        ([b"\x00\x59" + LABEL + b"\x01" + b"\x00" * 10], "peer closed"),  # truncated hello
        ([b"\x00"], "peer closed"),  # truncated length prefix
        ([], "peer closed|connection failed"),  # closed before or while we send
        ([1e6], "timed out"),  # silent peer (slowloris)
        ([b"\x00", 3.0, b"\x59", 3.0, LABEL[:4], 3.0, LABEL[4:8], 3.0] * 5, "timed out"),
    ],
)
@pytest.mark.parametrize("side", ["inbound", "outbound"])
def test_bad_handshakes_fail_cleanly_and_in_bounded_time(script, fragment, side):
    if side == "outbound" and fragment == "not a /dedloc-jax":
        fragment = "reply has"  # the dialer checks the reply's size first

    async def main():
        ours, theirs = trio.testing.memory_stream_pair()
        start = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def peer():
                await _fake_peer(theirs, script)
                if not script or not isinstance(script[-1], float):
                    await theirs.aclose()

            nursery.start_soon(peer)
            with pytest.raises(HandshakeError, match=fragment):
                if side == "inbound":
                    await secure_inbound(ours, BOB, timeout=10.0)
                else:
                    await secure_outbound(ours, ALICE, timeout=10.0)
            nursery.cancel_scope.cancel()
        assert trio.current_time() - start <= 10.0 + 1e-6
        # our side closed its stream: the peer sees end of file
        with pytest.raises(trio.ClosedResourceError):
            await ours.send_all(b"x")

    run_mock(main)


def test_reply_from_wrong_key_material_fails():
    """A reply with an invalid ephemeral key (all zero, a low-order point) is refused."""

    async def main():
        ours, theirs = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:

            async def peer():
                await theirs.receive_some()
                body = bytes([OFFER_CHACHA, 1]) + bytes(32) + bytes(32 + 64 + 16)
                await theirs.send_all(struct.pack(">H", len(body)) + body)

            nursery.start_soon(peer)
            with pytest.raises(HandshakeError, match="invalid ephemeral"):
                await secure_outbound(ours, ALICE)

    run_mock(main)


def test_cancelling_a_handshake_closes_the_stream():
    async def main():
        ours, theirs = trio.testing.memory_stream_pair()
        with trio.move_on_after(1.0):
            await secure_inbound(ours, BOB, timeout=100.0)
        assert await theirs.receive_some() == b""

    run_mock(main)


def test_invalid_arguments_are_rejected():
    async def main():
        ours, _ = trio.testing.memory_stream_pair()
        with pytest.raises(ValueError, match="timeout"):
            await secure_inbound(ours, BOB, timeout=0)
        with pytest.raises(ValueError, match="max_frame"):
            await secure_inbound(ours, BOB, max_frame=0)

    run_mock(main)


# ---- frames after the handshake -------------------------------------------------------------


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


@pytest.mark.parametrize("cipher", BOTH_CIPHERS)
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


# ---- real TCP loopback (the recv_into/send fast path) ---------------------------------------


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


@pytest.mark.parametrize("cipher", BOTH_CIPHERS)
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
