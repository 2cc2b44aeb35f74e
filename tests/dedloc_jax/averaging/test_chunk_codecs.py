import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dedloc_jax.averaging.chunk_codecs import CODECS, get_codec
from dedloc_jax.averaging.errors import CodecError

finite_f32 = arrays(
    np.float32,
    st.integers(0, 700),
    elements=st.floats(-(2.0**126), 2.0**126, width=32),
)


def _bound(name, x, block=256):
    ax = np.abs(x.astype(np.float64))
    if name == "none":
        return np.zeros_like(ax)
    if name == "fp16":
        return np.maximum(ax * 2.0**-11, 2.0**-25)
    if name == "bf16":
        return np.maximum(ax * 2.0**-8, 2.0**-133)
    nb = -(-x.size // block)
    pad = np.zeros(nb * block)
    pad[: x.size] = ax
    absmax = np.repeat(pad.reshape(nb, block).max(axis=1), block)[: x.size]
    return absmax / 254 * (1 + 2.0**-20) + 127 * 2.0**-150  # see the codecs module docstring


@settings(max_examples=150, deadline=None)
@given(finite_f32, st.sampled_from(sorted(CODECS)))
def test_roundtrip_within_documented_error_bound(x, name):
    codec = get_codec(name)
    if name == "fp16":
        x = np.clip(x, -65504, 65504)
    data = codec.encode(x)
    assert len(data) == codec.encoded_size(x.size)
    y = codec.decode(data, x.size)
    assert y.dtype == np.float32 and y.shape == x.shape
    err = np.abs(x.astype(np.float64) - y.astype(np.float64))
    assert np.all(err <= _bound(name, x)), (name, x[err > _bound(name, x)])


def test_fp16_clips_instead_of_overflowing_to_inf():
    codec = get_codec("fp16")
    y = codec.decode(codec.encode(np.array([1e6, -1e6], np.float32)), 2)
    assert np.all(np.isfinite(y)) and y[0] == 65504


@pytest.mark.parametrize("name", sorted(CODECS))
def test_decode_is_deterministic_and_rejects_wrong_sizes(name):
    codec = get_codec(name)
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    data = codec.encode(x)
    assert np.array_equal(codec.decode(data, 1000), codec.decode(bytes(data), 1000))
    with pytest.raises(CodecError):
        codec.decode(data[:-1], 1000)
    with pytest.raises(CodecError):
        codec.decode(data, 1001)


def test_int8_rejects_bad_scales_and_unknown_codec():
    codec = get_codec("int8")
    data = bytearray(codec.encode(np.ones(10, np.float32)))
    data[0:4] = np.array([np.nan], "<f4").tobytes()
    with pytest.raises(CodecError):
        codec.decode(bytes(data), 10)
    with pytest.raises(CodecError):
        get_codec("zip")


def test_int8_rejects_a_scale_that_would_decode_to_inf():
    """Found by bench.fuzz: a finite scale whose block times 127 overflows float32."""
    codec = get_codec("int8")
    big = np.full(10, np.finfo(np.float32).max, np.float32)
    assert np.all(np.isfinite(codec.decode(codec.encode(big), 10)))  # the encoder's largest
    data = bytearray(codec.encode(np.ones(10, np.float32)))
    data[0:4] = np.array([np.finfo(np.float32).max / 2], "<f4").tobytes()
    with pytest.raises(CodecError, match="float32 range"):
        codec.decode(bytes(data), 10)


def test_int8_bound_holds_for_subnormal_blocks():
    """Found by hypothesis: a block whose scale is a subnormal float32 (x = 6.449e-42)."""
    codec = get_codec("int8")
    x = np.array([6.449e-42, -3e-43, 1e-45], np.float32)
    y = codec.decode(codec.encode(x), x.size)
    err = np.abs(x.astype(np.float64) - y.astype(np.float64))
    assert np.all(err <= _bound("int8", x))


def test_fp16_rounding_bound_bounds_the_error_and_matches_its_per_value_formula():
    from dedloc_jax.averaging.chunk_codecs import _F16_MAX, rounding_bound

    rng = np.random.default_rng(7)
    x = (rng.standard_normal(50_000) * np.exp(rng.uniform(-30, 12, 50_000))).astype(np.float32)
    x[:5] = [0.0, 1e-30, -7e4, 1e6, -65504.0]  # zero, subnormal, saturated both ways
    codec = get_codec("fp16")
    y = codec.decode(codec.encode(x), x.size)
    cap = float(np.max(np.abs(x)))
    got = rounding_bound(codec, y, cap)
    # the bound's definition, value by value in float64
    y64 = np.abs(y.astype(np.float64))
    b = np.maximum(y64 * 2.0**-11 * (1 + 2.0**-10), 2.0**-25)
    b[y64 >= _F16_MAX] = cap
    assert got >= float(np.sqrt(np.sum(b**2))) * (1 - 1e-12)
    assert got <= float(np.sqrt(np.sum(b**2))) * (1 + 1e-6)
    assert got >= float(np.linalg.norm(x.astype(np.float64) - y))


def test_fp16_rounding_bound_from_the_norm_bounds_the_error_like_the_formula():
    """Given ``|y|`` (what a check has already), the fp16 bound takes no pass over the values
    but their extremes: never below the per-value formula, within 1e-6 of it on real chunks,
    and the formula itself where a value saturated."""
    from dedloc_jax.averaging.chunk_codecs import rounding_bound
    from dedloc_jax.averaging.verify import part_norm

    rng = np.random.default_rng(8)
    codec = get_codec("fp16")
    for scale in (1e-6, 1.0, 3e3):
        x = (rng.standard_normal(65_536) * scale).astype(np.float32)
        x[0] = 0.0
        y = codec.decode(codec.encode(x), x.size)
        exact = rounding_bound(codec, y, 1.0)
        fast = rounding_bound(codec, y, 1.0, part_norm(y))
        assert exact * (1 - 1e-12) <= fast <= exact * (1 + 1e-6) + 2.0**-25 * 256
        assert fast >= float(np.linalg.norm(x.astype(np.float64) - y))
    x[1] = 1e6  # saturates: the per-value formula, with its cap
    y = codec.decode(codec.encode(x), x.size)
    assert rounding_bound(codec, y, 1e6, part_norm(y)) == rounding_bound(codec, y, 1e6)


def test_fp16_decodes_every_bit_pattern_as_numpys_conversion_does():
    codec = get_codec("fp16")
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view("<f2").astype(np.float32)
    got = codec.decode(bits.tobytes(), bits.size)
    assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()
    into = np.empty((2, 1 << 16), np.float32)[:, 0]  # not contiguous
    codec.decode_into(bits[:2].tobytes(), into)
    assert into.view(np.uint32).tolist() == want[:2].view(np.uint32).tolist()
