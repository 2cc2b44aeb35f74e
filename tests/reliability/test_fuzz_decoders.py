"""Hostile bytes into every decoder of network input: only the documented errors come out.

The decoder table lives in :mod:`bench.fuzz` (``python -m bench.fuzz`` runs 100,000+ inputs per
decoder); here hypothesis feeds each a few hundred derandomized inputs of three kinds (random
bytes, random msgpack, byte mutations of valid messages), plus a live node on loopback that is
flooded with garbage and must still answer an honest call.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.fuzz import DECODERS, Decoder
from bench.fuzz_inputs import mutate_bytes, random_object
from dedloc_jax.averaging import bandwidth, wire
from dedloc_jax.state.chunks import StateError, StateManifest
from p2p.errors import ProtocolError
from p2p.rpc import MessageStream
from p2p.testing import received_stream

FUZZ = settings(
    deadline=None,
    max_examples=60,
    derandomize=True,  # the same examples every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
NAMES = sorted(DECODERS)

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=70),
)
_msgpack_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), inner, max_size=6),
    ),
    max_leaves=30,
)


def _check(decoder: Decoder, data: bytes) -> None:
    """Run one input; any exception outside the documented ones fails the test (a hang fails
    it through the per-test timeout)."""
    try:
        decoder.run(data)
    except decoder.documented:
        pass


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes(name: str, data: bytes) -> None:
    _check(DECODERS[name], data)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
@FUZZ
@given(value=_msgpack_values)
def test_random_msgpack(name: str, value: object) -> None:
    _check(DECODERS[name], msgpack.packb(value, use_bin_type=True))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", NAMES)
@FUZZ
@given(seed=st.integers(0, 2**32 - 1))
def test_mutated_valid_messages(name: str, seed: int) -> None:
    decoder = DECODERS[name]
    rng = np.random.default_rng(seed)
    base = decoder.seeds[seed % len(decoder.seeds)]
    _check(decoder, mutate_bytes(rng, base))
    _check(decoder, msgpack.packb(random_object(rng), use_bin_type=True))


@pytest.mark.parametrize("name", NAMES)
def test_valid_seeds_are_accepted(name: str) -> None:
    """The seeds are real messages: a decoder that rejects them is fuzzing nothing useful."""
    decoder = DECODERS[name]
    if name in ("p2p.handshake_reply", "p2p.handshake_finish", "p2p.secure_frames"):
        pytest.skip("bound to another handshake's keys / the stream ends in EOF (by design)")
    for seed in decoder.seeds:
        decoder.run(seed)


# ---- regressions found by the fuzzer ----------------------------------------------------------
def test_manifest_with_a_malformed_dtype_name_is_a_state_error() -> None:
    """np.dtype raises ValueError (not TypeError) for a comma-string; it escaped as a plain
    ValueError, which download_state does not catch (fixed in
    dedloc_jax.state.chunks._dtype_from_name)."""
    wire = {"epoch": 0, "specs": [["2x,", [1]]], "chunk_bytes": 4, "total": 4}
    wire["chunks"] = [b"x" * 32]
    with pytest.raises(StateError):
        StateManifest.from_wire(wire)


def test_manifest_with_overflowing_shape_is_rejected() -> None:
    wire = {
        "epoch": 0,
        "specs": [["float32", [1 << 62, 4]]],
        "chunk_bytes": 4,
        "chunks": [b"x" * 32],
        "total": 0,
    }
    with pytest.raises(StateError):
        StateManifest.from_wire(wire)


def test_message_stream_zero_length_body_at_buffer_end() -> None:
    reader = MessageStream(received_stream([b"\x00\x00\x00\x00"]), max_message_size=1 << 16)
    with pytest.raises(ProtocolError):  # an empty body is not a msgpack value
        trio.run(reader.receive)


def test_progress_record_rejects_non_finite_numbers() -> None:
    from dedloc_jax.progress import PeerProgress

    record = {"epoch": 1, "samples": 2, "sps": math.nan, "time": 0.0, "mode": "node"}
    with pytest.raises(ValueError):
        PeerProgress.from_record("peer", record)


# ---- a live node ------------------------------------------------------------------------------
RPC_NAMES = ("dht.ping", "dht.store", "dht.find", "dht.changes", "collab.join", "collab.leader",
             "collab.state.manifest", "collab.state.chunk")  # fmt: skip
STREAM_NAMES = (wire.PROTOCOL, wire.REPAIR_PROTOCOL, bandwidth.PROBE_PROTOCOL)  # the served names


def test_live_node_survives_garbage_and_random_rpcs() -> None:
    """A collaboration node on loopback gets raw garbage connections, garbage frames after a
    valid handshake, and random requests to its real DHT / matchmaking / state / all-reduce
    handlers; afterwards an honest peer still joins its DHT and downloads its state."""
    from contextlib import AsyncExitStack

    from dedloc_jax.config import CollaborationConfig
    from dedloc_jax.opening import open_collaboration
    from dedloc_jax.state.download import download_state
    from p2p.dht import DHTConfig, open_dht
    from p2p.errors import P2PError
    from p2p.identity import Identity
    from p2p.node import NodeConfig, open_node
    from p2p.secure import secure_outbound

    rng = np.random.default_rng(7)
    state = np.arange(300, dtype=np.float32)
    stats = {"garbage": 0, "frames": 0, "rpc_errors": 0, "rpc_ok": 0, "streams": 0}

    async def main() -> tuple[int, list[np.ndarray]]:
        async with AsyncExitStack() as stack:
            node = await stack.enter_async_context(
                open_node(Identity.from_seed(b"live-target"), config=NodeConfig.testing())
            )
            core = await stack.enter_async_context(
                open_collaboration(
                    node,
                    "live",
                    config=CollaborationConfig.local_demo(64),
                    dht_config=DHTConfig.fast(),
                )  # fmt: skip
            )
            core.state_server.set_state([state], 3)
            await core.state_server.announce()
            port = node.addrs[0].port

            async def raw_garbage(i: int) -> None:
                with trio.move_on_after(5):
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                    try:
                        for _ in range(3):
                            await stream.send_all(rng.bytes(int(rng.integers(1, 3000))))
                        stats["garbage"] += 1
                    except trio.BrokenResourceError:
                        stats["garbage"] += 1  # the node hung up on us: fine
                    finally:
                        await stream.aclose()

            async def garbage_frames(i: int) -> None:
                with trio.move_on_after(5):
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                    channel = await secure_outbound(stream, Identity.from_seed(b"g%d" % i))
                    try:
                        for _ in range(5):
                            await channel.send_frame(rng.bytes(int(rng.integers(0, 600))))
                            stats["frames"] += 1
                    except P2PError:
                        pass
                    finally:
                        await channel.aclose()

            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(raw_garbage, i)
                    nursery.start_soon(garbage_frames, i)

            attacker = await stack.enter_async_context(
                open_node(Identity.from_seed(b"live-attacker"), config=NodeConfig.testing())
            )
            attacker.peerstore.add_addrs(node.peer_id, node.addrs)
            for i in range(120):
                name = RPC_NAMES[i % len(RPC_NAMES)]
                try:
                    await attacker.call(node.peer_id, name, random_object(rng), timeout=5)
                    stats["rpc_ok"] += 1
                except P2PError:
                    stats["rpc_errors"] += 1
            for i in range(30):
                name = STREAM_NAMES[i % len(STREAM_NAMES)]
                with trio.move_on_after(3):
                    try:
                        async with attacker.open_stream(node.peer_id, name, timeout=3) as s:
                            for _ in range(3):
                                await s.send(random_object(rng))
                            await s.send_eof()
                            async for _msg in s:
                                pass
                    except P2PError:
                        pass
                stats["streams"] += 1

            # An honest peer: joins the DHT through the flooded node and downloads its state.
            honest = await stack.enter_async_context(
                open_node(Identity.from_seed(b"live-honest"), config=NodeConfig.testing())
            )
            dht = await stack.enter_async_context(
                open_dht(honest, initial_peers=[str(node.addrs[0])], config=DHTConfig.fast())
            )
            with trio.fail_after(30):
                assert (await dht.store("after-flood", 42, dht.now() + 60)).ok
                epoch, arrays, _ = await download_state(honest, dht, "live")
            return epoch, arrays

    epoch, arrays = trio.run(main)
    assert epoch == 3 and arrays[0].tobytes() == state.tobytes()
    assert stats["garbage"] == 20 and stats["streams"] == 30
    assert stats["rpc_errors"] > 0  # most random requests are refused...
    assert stats["rpc_ok"] + stats["rpc_errors"] == 120  # ...and every one got an answer
