import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dedloc_jax.averaging.errors import PartitionError
from dedloc_jax.averaging.partition import (
    FRACTION_GRID,
    chunk_bounds,
    flatten,
    fractions_to_parts,
    share_bounds,
    unflatten,
)


def _tree():
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((3, 5)).astype(np.float32),
        "b": [rng.standard_normal(7).astype(np.float16), np.full((), 2.5, np.float32)],
        "e": jnp.asarray(rng.standard_normal((2, 1, 3)), dtype=jnp.bfloat16),
        "empty": np.zeros((0, 4), np.float32),
    }


def test_flatten_roundtrip_keeps_structure_shapes_dtypes_and_values():
    tree = _tree()
    vec, spec = flatten(tree)
    assert vec.dtype == np.float32 and vec.size == 15 + 7 + 1 + 6
    back = unflatten(vec, spec)
    assert back["w"].shape == (3, 5) and back["w"].dtype == np.float32
    assert back["b"][0].dtype == np.float16 and back["b"][1].shape == ()
    assert back["e"].dtype == ml_dtypes.bfloat16 and back["e"].shape == (2, 1, 3)
    assert back["empty"].shape == (0, 4)
    np.testing.assert_array_equal(back["w"], tree["w"])
    np.testing.assert_array_equal(back["b"][0], tree["b"][0])
    np.testing.assert_array_equal(np.asarray(back["e"]), np.asarray(tree["e"]))


def test_unflatten_rejects_wrong_size_and_flatten_rejects_ints():
    vec, spec = flatten(_tree())
    with pytest.raises(PartitionError):
        unflatten(vec[:-1], spec)
    with pytest.raises(PartitionError):
        flatten({"x": np.arange(3)})


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=16).filter(
        lambda f: sum(f) > 0
    ),
    st.integers(0, 10**8),
)
def test_share_bounds_cover_everything_in_order_and_respect_parts(fractions, total):
    parts = fractions_to_parts(fractions)
    assert sum(parts) == FRACTION_GRID and len(parts) == len(fractions)
    assert all(p == 0 for p, f in zip(parts, fractions, strict=True) if f == 0)
    bounds = share_bounds(total, parts)
    assert bounds[0] == 0 and bounds[-1] == total
    assert all(a <= b for a, b in zip(bounds, bounds[1:], strict=False))
    for i, p in enumerate(parts):
        size = bounds[i + 1] - bounds[i]
        assert abs(size - total * p / FRACTION_GRID) <= 1
        if p == 0:
            assert size == 0


def test_fractions_to_parts_is_deterministic_with_ties():
    assert fractions_to_parts([1, 1, 1]) == fractions_to_parts([1.0, 1.0, 1.0])
    parts = fractions_to_parts([1, 1, 1])
    assert parts[0] >= parts[1] >= parts[2]  # the leftover goes to the lowest index
    with pytest.raises(PartitionError):
        fractions_to_parts([0, 0])
    with pytest.raises(PartitionError):
        fractions_to_parts([1, float("nan")])


@given(st.integers(0, 5000), st.integers(1, 700))
def test_chunk_bounds_tile_the_range(length, chunk):
    chunks = chunk_bounds(length, chunk)
    assert sum(b - a for a, b in chunks) == length
    assert all(0 < b - a <= chunk for a, b in chunks)
    assert all(x[1] == y[0] for x, y in zip(chunks, chunks[1:], strict=False))
