"""Bad input from the network: the offending connection is closed (with a logged reason) in
bounded time, memory stays bounded, and the node keeps serving an honest peer."""

from __future__ import annotations

import logging
import os
import struct
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p import CallContext, Identity, MessageStream, Node, NodeConfig, open_node
from p2p.errors import ConnectionClosed, P2PError, ProtocolError
from p2p.messages import unpack
from p2p.mux import (
    BULK,
    DATA,
    EOF,
    OPEN,
    RESET,
    WINDOW,
    Mux,
    MuxConfig,
    decode_frame,
    encode_frame,
)
from p2p.secure import secure_outbound
from p2p.testing import SimNetwork, open_sim_nodes, received_stream, run_sim

FAST = NodeConfig.testing().replace(handshake_timeout=1.0, frame_timeout=1.0, header_timeout=1.0)


async def echo(ctx: CallContext, request: Any) -> Any:
    return request


async def assert_honest_peer_served(node: Node) -> None:
    async with open_node() as honest:
        assert await honest.call(node.addrs[0], "echo", "still here", timeout=10) == "still here"


async def raw_tcp(node: Node) -> trio.SocketStream:
    addr = node.addrs[0]
    return await trio.open_tcp_stream(addr.host, addr.port)


async def wait_closed_by_peer(stream: trio.abc.Stream, limit: float = 10.0) -> None:
    """The peer must hang up on us within ``limit`` seconds (we read and drop what it sends)."""
    with trio.fail_after(limit):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return
            if not data:
                return


def messages_of(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_garbage_bytes_to_a_listener(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with open_node(config=FAST) as node:
            node.add_handler("echo", echo)
            for garbage in (os.urandom(5000), b"\x00\x20" + os.urandom(32), b"GET / HTTP/1.1\r\n"):
                stream = await raw_tcp(node)
                await stream.send_all(garbage)
                await wait_closed_by_peer(stream)
                await stream.aclose()
            await assert_honest_peer_served(node)
            with trio.fail_after(10):  # the honest peer said goodbye; nothing else is left
                while node.num_connections:
                    await trio.sleep(0.01)

    with caplog.at_level(logging.INFO):
        trio.run(main)
    assert "handshake" in messages_of(caplog)


def test_huge_length_prefix_in_the_handshake_and_after_it(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with open_node(config=FAST) as node:
            node.add_handler("echo", echo)
            stream = await raw_tcp(node)
            await stream.send_all(b"\xff\xff\xff\xff")  # before the handshake
            await wait_closed_by_peer(stream)

            # after a genuine handshake: a 4 GB frame length
            raw = await raw_tcp(node)
            await secure_outbound(raw, Identity.generate(), node.peer_id)
            await raw.send_all(struct.pack(">I", 2**32 - 1))
            await wait_closed_by_peer(raw)
            await assert_honest_peer_served(node)

    with caplog.at_level(logging.INFO):
        trio.run(main)
    assert "invalid frame length" in messages_of(caplog)


def test_truncated_frame_then_silence_or_eof(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with open_node(config=FAST) as node:
            node.add_handler("echo", echo)
            for then_eof in (True, False):
                raw = await raw_tcp(node)
                await secure_outbound(raw, Identity.generate(), node.peer_id)
                await raw.send_all(struct.pack(">I", 1000) + b"only part of it")
                if then_eof:
                    await raw.send_eof()
                await wait_closed_by_peer(raw)  # silence: the frame timeout ends it
            await assert_honest_peer_served(node)

    with caplog.at_level(logging.INFO):
        trio.run(main)
    log = messages_of(caplog)
    assert "inside a frame" in log and "not completed" in log


def test_garbage_mux_frames_after_a_valid_handshake(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with open_node(config=FAST) as node:
            node.add_handler("echo", echo)
            for bad in (b"\x7f\x00\x00\x00\x01", b"\x01", encode_frame(DATA, 77, b"no open")):
                raw = await raw_tcp(node)
                channel = await secure_outbound(raw, Identity.generate(), node.peer_id)
                await channel.send_frame(bad)
                with trio.fail_after(10):
                    with pytest.raises(ConnectionClosed):
                        while True:  # the GOAWAY explaining why, then the end
                            await channel.receive_frame()
            await assert_honest_peer_served(node)

    with caplog.at_level(logging.WARNING, logger="p2p.mux"):
        trio.run(main)
    log = messages_of(caplog)
    assert "unknown mux frame kind" in log and "unopened stream" in log


def test_oversized_and_malformed_messages_reset_only_their_stream() -> None:
    async def main() -> None:
        async with open_node(config=FAST.replace(max_message_size=1000)) as node:
            node.add_handler("echo", echo)
            raw = await raw_tcp(node)
            channel = await secure_outbound(raw, Identity.generate(), node.peer_id)
            # stream 1: a 4 GB message length; stream 3: bytes that are not msgpack
            await channel.send_frame(encode_frame(OPEN, 1))
            await channel.send_frame(encode_frame(DATA, 1, b"\xff\xff\xff\xff"))
            await channel.send_frame(encode_frame(OPEN, 3))
            await channel.send_frame(encode_frame(DATA, 3, b"\x00\x00\x00\x01\xc1"))
            resets = {}
            with trio.fail_after(10):
                while len(resets) < 2:
                    kind, sid, payload = decode_frame(await channel.receive_frame())
                    if kind == RESET:
                        resets[sid] = bytes(payload).decode()
            assert "too large" in resets[1] and "malformed" in resets[3]
            # the connection itself is fine: a proper call on stream 5 works
            await channel.send_frame(encode_frame(OPEN, 5))
            body = [msgpack.packb(x) for x in (["u", "echo"], "ok")]
            data = b"".join(struct.pack(">I", len(b)) + b for b in body)
            await channel.send_frame(encode_frame(6, 5, data))  # DATA_EOF
            with trio.fail_after(10):
                while True:
                    kind, sid, payload = decode_frame(await channel.receive_frame())
                    if sid == 5 and kind in (DATA, 6):
                        assert unpack(bytes(payload)[4:]) == "ok"
                        break
            await channel.aclose()
            await assert_honest_peer_served(node)

    trio.run(main)


class LyingIdentity(Identity):
    """Signs something else than the handshake transcript."""

    def sign(self, data: bytes) -> bytes:
        return super().sign(data + b"!")


def test_handshake_with_a_wrong_signature(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with open_node(config=FAST) as node:
            node.add_handler("echo", echo)
            liar = LyingIdentity(Identity.generate()._private)
            async with open_node(liar, config=FAST) as attacker:
                with pytest.raises(P2PError):
                    await attacker.call(node.addrs[0], "echo", 1)
            assert node.num_connections == 0
            await assert_honest_peer_served(node)

    with caplog.at_level(logging.INFO):
        trio.run(main)
    assert "signature" in messages_of(caplog)


def test_silent_connections_are_dropped_in_virtual_time(caplog: pytest.LogCaptureFixture) -> None:
    """Slowloris on the simulator: a dialer that never speaks is cut at the handshake timeout."""
    config = NodeConfig(handshake_timeout=5.0, max_connections_per_ip=3)

    async def main() -> None:
        net = SimNetwork(seed=0)
        async with open_sim_nodes(net, 2, config=config) as (node, honest):
            node.add_handler("echo", echo)
            mallory = net.add_host("mallory")
            target = node.addrs[0].transport_part()
            silent = [await mallory.transport.dial(target) for _ in range(5)]
            start = trio.current_time()
            for stream in silent:
                await wait_closed_by_peer(stream, limit=60)
            assert trio.current_time() - start <= 5.0 + 1.0
            assert await honest.call(node.addrs[0], "echo", 1) == 1

    with caplog.at_level(logging.INFO):
        run_sim(main)
    log = messages_of(caplog)
    assert "timed out" in log and "refusing connection" in log  # 3 timed out, 2 refused


def test_too_many_streams_from_one_peer() -> None:
    config = FAST.replace(max_streams_per_connection=4)

    async def main() -> None:
        async with open_node(config=config) as node:
            node.add_handler("echo", echo)
            hold = trio.Event()

            async def hang(ctx: CallContext, request: Any) -> Any:
                await hold.wait()
                return request

            node.add_handler("hang", hang)
            async with open_node() as greedy:
                results: list[str] = []

                async def one() -> None:
                    try:
                        await greedy.call(node.addrs[0], "hang", 1, timeout=10)
                        results.append("ok")
                    except P2PError as e:
                        results.append(f"refused: {e}")

                async with trio.open_nursery() as nursery:
                    for _ in range(10):
                        nursery.start_soon(one)
                    with trio.fail_after(10):
                        while len(results) < 6:
                            await trio.sleep(0.01)
                    hold.set()
                assert results.count("ok") == 4
                assert all("too many streams" in r for r in results if r != "ok")
            await assert_honest_peer_served(node)

    trio.run(main)


# ---- property-based tests of the decoders ---------------------------------------------------


@given(st.binary(max_size=64))
def test_decode_frame_accepts_or_raises_protocol_error(data: bytes) -> None:
    try:
        kind, sid, payload = decode_frame(data)
    except ProtocolError:
        return
    assert encode_frame(kind, sid, payload) == data


class _FakeNursery:
    def __init__(self) -> None:
        self.started: list[Any] = []
        self.cancel_scope = trio.CancelScope()

    def start_soon(self, fn: Any, *args: Any) -> None:
        self.started.append(args)


class _NullChannel:
    max_frame = 1 << 20

    async def send_frame(self, data: Any) -> None: ...

    async def receive_frame(self) -> bytes:
        raise ConnectionClosed("null")

    async def aclose(self) -> None: ...


frames = st.one_of(
    st.tuples(
        st.sampled_from([OPEN, DATA, WINDOW, EOF, RESET, 5, 6, BULK]),
        st.integers(0, 12),
        st.binary(max_size=40),
    ).map(lambda t: encode_frame(*t)),
    st.binary(max_size=16),
    # well-formed BULK announcements (with or without leading stream bytes): the next frame
    # is taken as raw stream data
    st.tuples(st.integers(0, 12), st.integers(0, 70), st.binary(max_size=20)).map(
        lambda t: encode_frame(BULK, t[0], t[1].to_bytes(4, "big") + t[2])
    ),
)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(frames, max_size=30))
def test_mux_survives_any_frame_sequence(sequence: list[bytes]) -> None:
    """Arbitrary frames only ever cause a ProtocolError; buffers never exceed the window."""
    config = MuxConfig(
        initial_window=64,
        max_frame_payload=32,
        max_inbound_streams=3,
        max_pending_control=8,
        max_buffered_bytes=100,
    )
    mux = Mux(_NullChannel(), initiator=True, handle_stream=echo, config=config)  # type: ignore[arg-type]
    nursery = _FakeNursery()
    mux._nursery = nursery  # type: ignore[assignment]
    for frame in sequence:
        if mux.is_closed:
            break
        try:
            mux.handle_frame(frame)
        except ProtocolError:
            break
        assert mux._inbound <= config.max_inbound_streams
        for stream in mux._streams.values():
            assert stream._buffered <= config.initial_window
        assert mux.held_bytes <= config.max_buffered_bytes


@given(st.binary(max_size=200))
def test_message_decoder_accepts_or_raises_protocol_error(data: bytes) -> None:
    try:
        unpack(data)
    except ProtocolError:
        pass


@given(st.lists(st.binary(max_size=50), max_size=20), st.integers(1, 300))
def test_message_stream_is_bounded_and_only_raises_protocol_error(
    chunks: list[bytes], limit: int
) -> None:
    """Whatever arrives, the reader returns only messages of at most ``limit`` bytes, or ends
    with a ProtocolError (or ConnectionClosed when the bytes stop mid-message)."""
    data = b"".join(chunks)

    async def main() -> None:
        reader = MessageStream(received_stream(chunks), max_message_size=limit)
        pos = 0
        try:
            async for _ in reader:
                n = int.from_bytes(data[pos : pos + 4], "big")
                assert n <= limit
                pos += 4 + n
        except (ProtocolError, ConnectionClosed):
            pass

    trio.run(main)


@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats(allow_nan=False)
        | st.text(max_size=20)
        | st.binary(max_size=50),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
        ),
        max_leaves=20,
    )
)
def test_messages_roundtrip_through_the_stream_in_any_split(value: Any) -> None:
    from p2p.messages import encode_message

    prefix, body = encode_message(value)
    data = prefix + body
    pieces = [data[i : i + 7] for i in range(0, len(data), 7)]

    async def main() -> list[Any]:
        return [message async for message in MessageStream(received_stream(pieces), 1 << 20)]

    assert trio.run(main) == [value]  # and then a clean end: the stream is at a boundary


def test_a_stream_that_never_completes_its_request_is_reset(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = NodeConfig(header_timeout=5.0, request_timeout=10.0)

    async def main() -> None:
        from p2p.messages import encode_parts

        net = SimNetwork(seed=2)
        async with open_sim_nodes(net, 2, config=config) as (node, slow):
            node.add_handler("echo", echo)
            await slow.connect(node.addrs[0])
            conn = slow.connection_to(node.peer_id)
            assert conn is not None
            silent = await conn.mux.open_stream()
            await silent.send_all(b"\x00\x00")  # half a length prefix, then silence
            header_only = await conn.mux.open_stream()
            await header_only.send_parts(encode_parts(["u", "echo"]))  # ... and no request
            start = trio.current_time()
            for stream in (header_only, silent):
                with pytest.raises(ConnectionClosed, match="in time|cancelled mid-message"):
                    await stream.receive_some()
            assert trio.current_time() - start <= 15.0 + 1.0
            assert await slow.call(node.peer_id, "echo", "fine") == "fine"

    with caplog.at_level(logging.INFO):
        run_sim(main)
