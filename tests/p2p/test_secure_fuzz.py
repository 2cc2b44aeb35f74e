"""Property tests: hostile bytes into the handshake and the framing never raise anything but the
documented errors, never hang, and never let a bad frame through."""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p.aead import OFFER_AES, OFFER_CHACHA
from p2p.errors import ConnectionClosed, HandshakeError
from p2p.handshake import (
    FINISH_SIZE,
    HELLO_SIZE,
    LABEL,
    REPLY_SIZE,
    InitiatorHandshake,
    ResponderHandshake,
)
from p2p.identity import Identity
from p2p.secure import secure_inbound, secure_outbound

ALICE = Identity.from_seed(b"fuzz-alice")
BOB = Identity.from_seed(b"fuzz-bob")

FUZZ = settings(
    deadline=None,
    max_examples=100,
    derandomize=True,  # the same examples every run: deterministic tests
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def run_mock(fn, *args):
    return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


# ---- the pure handshake ---------------------------------------------------------------------

_hello_like = st.one_of(
    st.binary(max_size=200),
    st.binary(min_size=HELLO_SIZE - len(LABEL), max_size=HELLO_SIZE - len(LABEL)).map(
        lambda tail: LABEL + tail
    ),
)


@FUZZ
@given(_hello_like)
def test_responder_hello_accepts_or_raises_handshake_error(hello):
    responder = ResponderHandshake(BOB, OFFER_CHACHA | OFFER_AES)
    try:
        reply = responder.process_hello(hello)
    except HandshakeError:
        return
    # Any well-formed hello gets a reply; its static key is unproven until the finish.
    assert len(reply) == REPLY_SIZE
    with pytest.raises(HandshakeError):
        responder.process_finish(b"\x00" * FINISH_SIZE)


@FUZZ
@given(st.one_of(st.binary(max_size=300), st.binary(min_size=REPLY_SIZE, max_size=REPLY_SIZE)))
def test_initiator_rejects_every_forged_reply(reply):
    initiator = InitiatorHandshake(ALICE, OFFER_CHACHA | OFFER_AES)
    initiator.hello()
    with pytest.raises(HandshakeError):
        initiator.process_reply(reply)


@FUZZ
@given(st.one_of(st.binary(max_size=200), st.binary(min_size=FINISH_SIZE, max_size=FINISH_SIZE)))
def test_responder_rejects_every_forged_finish(finish):
    initiator = InitiatorHandshake(ALICE, OFFER_CHACHA)
    responder = ResponderHandshake(BOB, OFFER_CHACHA)
    responder.process_hello(initiator.hello())
    with pytest.raises(HandshakeError):
        responder.process_finish(finish)


@FUZZ
@given(st.data())
def test_any_single_bit_flip_in_the_handshake_is_caught(data):
    """Flip one bit of one handshake message: someone must fail, and no session may disagree."""
    initiator = InitiatorHandshake(ALICE, OFFER_CHACHA | OFFER_AES, BOB.peer_id)
    responder = ResponderHandshake(BOB, OFFER_CHACHA | OFFER_AES)
    which = data.draw(st.sampled_from(["hello", "reply", "finish"]))

    def maybe_flip(name: str, msg: bytes) -> bytes:
        if name != which:
            return msg
        bit = data.draw(st.integers(0, 8 * len(msg) - 1))
        return msg[: bit // 8] + bytes([msg[bit // 8] ^ (1 << (bit % 8))]) + msg[bit // 8 + 1 :]

    with pytest.raises(HandshakeError):
        reply = responder.process_hello(maybe_flip("hello", initiator.hello()))
        finish, _ = initiator.process_reply(maybe_flip("reply", reply))
        responder.process_finish(maybe_flip("finish", finish))


# ---- handshake over a stream ------------------------------------------------------------------


async def _feed(stream, chunks, close: bool) -> None:
    for chunk in chunks:
        await stream.send_all(chunk)
        await trio.sleep(0.5)
    if close:
        await stream.aclose()


@FUZZ
@given(
    st.lists(st.binary(max_size=120), max_size=6),
    st.booleans(),
    st.sampled_from(["inbound", "outbound"]),
)
def test_random_bytes_as_handshake_fail_cleanly_within_the_timeout(chunks, close, side):
    async def main():
        ours, theirs = trio.testing.memory_stream_pair()
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_feed, theirs, chunks, close)
            with pytest.raises(HandshakeError):
                if side == "inbound":
                    await secure_inbound(ours, BOB, timeout=5.0)
                else:
                    await secure_outbound(ours, ALICE, timeout=5.0)
            nursery.cancel_scope.cancel()
        assert trio.current_time() - start <= 5.0 + 1e-6

    run_mock(main)


# ---- framing after the handshake --------------------------------------------------------------


class _Chunker(trio.abc.HalfCloseableStream):
    """Delivers what it receives in pieces of the sizes a test chooses (hostile segmentation)."""

    def __init__(self, inner, sizes: list[int]) -> None:
        self.inner = inner
        self.sizes = sizes
        self.i = 0

    async def send_all(self, data) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        limit = self.sizes[self.i % len(self.sizes)] if self.sizes else max_bytes
        self.i += 1
        if max_bytes is not None:
            limit = min(limit, max_bytes)
        return await self.inner.receive_some(limit)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _secured(receiver_wrapper=None, max_frame: int = 4096):
    a, b = trio.testing.memory_stream_pair()
    if receiver_wrapper is not None:
        b = receiver_wrapper(b)
    result = {}
    async with trio.open_nursery() as nursery:

        async def inbound():
            result["in"] = await secure_inbound(b, BOB, max_frame=max_frame)

        nursery.start_soon(inbound)
        result["out"] = await secure_outbound(a, ALICE, BOB.peer_id, max_frame=max_frame)
    return result["out"], result["in"], a


async def _drain(channel, limit: int) -> tuple[list[bytes], str | None]:
    """Receive until ConnectionClosed (returns its message) or ``limit`` frames; never hangs."""
    got: list[bytes] = []
    with trio.fail_after(1000):
        for _ in range(limit):
            try:
                got.append(bytes(await channel.receive_frame()))
            except ConnectionClosed as e:
                return got, str(e)
    return got, None


@FUZZ
@given(st.binary(max_size=600), st.booleans())
def test_random_bytes_after_handshake_close_the_connection(garbage, close):
    async def main():
        _, inn, raw = await _secured()
        await raw.send_all(garbage)
        if close:
            await raw.send_eof()
        with trio.move_on_after(100) as idle:
            got, err = await _drain(inn, 5)
        if idle.cancelled_caught:
            # only an incomplete frame can leave the reader waiting, and only if not closed
            assert not close and len(garbage) < 4 + 4096 + 16
        else:
            assert got == [] and err is not None

    run_mock(main)


@FUZZ
@given(
    st.lists(st.binary(max_size=4096), min_size=1, max_size=8),
    st.lists(st.integers(1, 5000), min_size=1, max_size=10),
)
def test_frames_survive_any_segmentation(frames, sizes):
    async def main():
        out, inn, _ = await _secured(functools.partial(_Chunker, sizes=sizes))
        async with trio.open_nursery() as nursery:

            async def send():
                for f in frames:
                    await out.send_frame(f)

            nursery.start_soon(send)
            got, err = await _drain(inn, len(frames))
        assert err is None and got == frames

    run_mock(main)


@FUZZ
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=6), st.data())
def test_a_corrupted_byte_stops_delivery_exactly_there(frames, data):
    """Corrupt one byte of the encrypted stream: the frames before it arrive, none from it on."""

    async def main():
        out, inn, raw = await _secured()
        # encrypt the frames, then take their raw bytes off the wire before the receiver sees them
        for f in frames:
            await out.send_frame(f)
        blob = b""
        while len(blob) < sum(4 + len(f) + 16 for f in frames):
            blob += await inn.transport_stream.receive_some()
        pos = data.draw(st.integers(0, len(blob) - 1))
        delta = data.draw(st.integers(1, 255))
        corrupted = blob[:pos] + bytes([blob[pos] ^ delta]) + blob[pos + 1 :]
        boundaries = [0]
        for f in frames:
            boundaries.append(boundaries[-1] + 4 + len(f) + 16)
        intact = sum(1 for end in boundaries[1:] if end <= pos)
        # replay the (corrupted) bytes to the receiving channel, then close
        await raw.send_all(corrupted)
        await raw.send_eof()
        got, err = await _drain(inn, len(frames) + 1)
        assert got == frames[:intact]
        assert err is not None

    run_mock(main)


@FUZZ
@given(st.integers(0, 2**32 - 1))
def test_any_length_prefix_is_bounded(length):
    """A frame header alone never makes the receiver allocate more than max_frame + slack."""

    async def main():
        _, inn, raw = await _secured(max_frame=4096)
        await raw.send_all(length.to_bytes(4, "big"))
        await raw.send_eof()
        got, err = await _drain(inn, 1)
        assert got == [] and err is not None
        if 16 <= length <= 4096 + 16:
            assert "inside a frame" in err
        else:
            assert f"invalid frame length {length}" in err
        assert len(inn._reader._buf) <= 4 + 4096 + 16 + 64 * 1024

    run_mock(main)
