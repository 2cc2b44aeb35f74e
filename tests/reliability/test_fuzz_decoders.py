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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.fuzz import DECODERS, Decoder, mutate_bytes, random_object
from dedloc_jax.state_chunks import StateError, StateManifest
from p2p import messages
from p2p.errors import ProtocolError

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
    ValueError, which download_state does not catch (fixed in state_chunks._dtype_from_name)."""
    wire = {"epoch": 0, "specs": [["2x,", [1]]], "chunk_bytes": 4, "total": 4}
    wire["chunks"] = [b"x" * 32]
    with pytest.raises(StateError):
        StateManifest.from_wire(wire)


@pytest.mark.xfail(
    strict=True,
    reason="StateManifest.from_wire multiplies shapes with np.prod(dtype=int64), which wraps: "
    "a 2**62 x 4 shape has 'size' 0 and is accepted with total 0 (fix: multiply Python ints "
    "and bound each dim and the product by _MAX_TOTAL_BYTES)",
)
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


@pytest.mark.xfail(
    strict=True,
    raises=IndexError,
    reason="MessageParser._take(0) indexes an empty deque when a zero-length message's prefix "
    "ends exactly at the end of the buffered data (fix: return b'' for n == 0 in _take)",
)
def test_message_parser_zero_length_body_at_buffer_end() -> None:
    parser = messages.MessageParser()
    parser.feed(b"\x00\x00\x00\x00")
    with pytest.raises(ProtocolError):  # an empty body is not a msgpack value
        parser.next_message()


def test_progress_record_rejects_non_finite_numbers() -> None:
    from dedloc_jax.progress import PeerProgress

    record = {"epoch": 1, "samples": 2, "sps": math.nan, "time": 0.0, "mode": "node"}
    with pytest.raises(ValueError):
        PeerProgress.from_record("peer", record)
