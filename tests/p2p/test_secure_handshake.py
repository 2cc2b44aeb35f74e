"""The secure channel's handshake: authentication, cipher negotiation, fresh keys, and every
way a peer can break the handshake."""

from __future__ import annotations

import os
import struct

import pytest
import trio
import trio.testing

from p2p.aead import (
    AES_256_GCM,
    AES_256_OCB,
    CHACHA20_POLY1305,
    OFFER_AES,
    OFFER_AES_OCB,
    OFFER_CHACHA,
    choose_cipher,
    cpuinfo_has_aes,
    has_aes_hardware,
    has_ocb,
    local_offers,
)
from p2p.errors import HandshakeError, PeerIDMismatch
from p2p.handshake import LABEL, InitiatorHandshake, ResponderHandshake
from p2p.identity import Identity
from p2p.secure import secure_inbound, secure_outbound
from tests.p2p.securehelpers import (
    ALICE,
    ALL_CIPHERS,
    BOB,
    MALLORY,
    SIZES,
    Tap,
    handshake_both,
    memory_pair,
    run_mock,
    transfer,
)


@pytest.mark.parametrize("cipher", ALL_CIPHERS)
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
        (AES_256_OCB, AES_256_OCB, AES_256_OCB),
        (AES_256_OCB, AES_256_GCM, AES_256_GCM),  # a peer that does not offer OCB3
        (AES_256_GCM, AES_256_OCB, AES_256_GCM),
        (AES_256_OCB, CHACHA20_POLY1305, CHACHA20_POLY1305),
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
        aes = AES_256_OCB if has_ocb() else AES_256_GCM
        assert out.cipher == (aes if has_aes_hardware() else CHACHA20_POLY1305)

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
    assert local_offers(AES_256_OCB) == OFFER_CHACHA | OFFER_AES | OFFER_AES_OCB
    assert choose_cipher(OFFER_CHACHA | OFFER_AES | 0x80, OFFER_AES) == AES_256_GCM
    every = OFFER_CHACHA | OFFER_AES | OFFER_AES_OCB
    assert choose_cipher(every, every) == AES_256_OCB
    assert choose_cipher(every, OFFER_CHACHA | OFFER_AES) == AES_256_GCM
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


@pytest.mark.parametrize(
    ("cipher", "bit"), [(AES_256_GCM, OFFER_AES), (AES_256_OCB, OFFER_AES_OCB)]
)
def test_downgrade_by_editing_offers_is_detected(cipher, bit):
    """A man in the middle clearing an AES bit changes the transcript: the handshake fails."""

    def strip_aes(data: bytes) -> bytes:
        if data[2 : 2 + len(LABEL)] == LABEL:  # the hello, after its 2-byte length
            i = 2 + len(LABEL)
            return data[:i] + bytes([data[i] & ~bit]) + data[i + 1 :]
        return data

    async def main():
        a, b = trio.testing.memory_stream_pair()
        tap = Tap(a)
        tap.mutate = strip_aes
        kw = {"cipher": cipher}
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
