"""Pytrees of host arrays <-> one contiguous float32 vector, and its split into shares and chunks.

All of this is pure and deterministic: every member of a group computes the same boundaries from
the same integers, so no boundary is ever negotiated over the network.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import ml_dtypes
import numpy as np

from .errors import PartitionError

#: Share fractions are integers out of this grid (2**24), so boundaries are exact integer maths.
FRACTION_GRID = 1 << 24

_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}


def _dtype_name(dtype: Any) -> str:
    dt = np.dtype(dtype)
    for name, known in _DTYPES.items():
        if dt == known:
            return name
    raise PartitionError(f"unsupported leaf dtype {dt}; expected one of {sorted(_DTYPES)}")


@dataclass(frozen=True)
class TreeSpec:
    """Where each leaf of a pytree lives in the flat vector, with its shape and dtype."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    offsets: tuple[int, ...]  # start of each leaf; offsets[-1] == size (one more than leaves)

    @property
    def size(self) -> int:
        return self.offsets[-1]


def flatten(tree: Any) -> tuple[np.ndarray, TreeSpec]:
    """Copy every leaf (host or jax array) into one float32 vector; return it and the spec."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    dtypes = tuple(_dtype_name(a.dtype) for a in arrays)
    offsets = [0]
    for a in arrays:
        offsets.append(offsets[-1] + int(a.size))
    if len(arrays) == 1 and arrays[0].dtype == np.float32:
        vec = arrays[0].reshape(-1)  # a view when contiguous: the vector is only read
    else:
        vec = np.empty(offsets[-1], dtype=np.float32)
        for a, start, stop in zip(arrays, offsets[:-1], offsets[1:], strict=True):
            vec[start:stop] = a.reshape(-1)
    spec = TreeSpec(
        treedef, tuple(tuple(int(d) for d in a.shape) for a in arrays), dtypes, tuple(offsets)
    )
    return vec, spec


def unflatten(vec: np.ndarray, spec: TreeSpec) -> Any:
    """Rebuild the pytree of ``spec`` from a float32 vector: same structure, shapes and dtypes.

    float32 leaves are views of ``vec`` (no copy); other dtypes are converted copies.
    """
    vec = np.asarray(vec)
    if vec.ndim != 1 or vec.size != spec.size:
        raise PartitionError(f"vector of shape {vec.shape} does not hold {spec.size} values")
    leaves = []
    for shape, dtype, start, stop in zip(
        spec.shapes, spec.dtypes, spec.offsets[:-1], spec.offsets[1:], strict=True
    ):
        leaves.append(vec[start:stop].astype(_DTYPES[dtype], copy=False).reshape(shape))
    return jax.tree_util.tree_unflatten(spec.treedef, leaves)


def fractions_to_parts(fractions: Sequence[float], grid: int = FRACTION_GRID) -> tuple[int, ...]:
    """Quantise non-negative fractions to integers summing to ``grid`` (largest remainder).

    Ties are broken by index, so the same floats give the same integers everywhere.
    """
    f = np.asarray(fractions, dtype=np.float64)
    if f.ndim != 1 or f.size == 0 or not np.all(np.isfinite(f)) or np.any(f < 0) or f.sum() <= 0:
        raise PartitionError(
            f"fractions must be non-negative, finite and not all zero: {fractions}"
        )
    scaled = f / f.sum() * grid
    parts = np.floor(scaled).astype(np.int64)
    short = grid - int(parts.sum())
    remainders = scaled - parts
    # Largest remainder first, lower index first among equals (stable sort on -remainder).
    order = sorted(range(f.size), key=lambda i: (-remainders[i], i))
    for i in order[:short]:
        parts[i] += 1
    return tuple(int(p) for p in parts)


def share_bounds(total: int, parts: Sequence[int]) -> tuple[int, ...]:
    """Boundaries ``b`` (len(parts) + 1 of them) of shares: share i is ``[b[i], b[i+1])``.

    ``b[i] = total * (parts[0] + ... + parts[i-1]) // sum(parts)`` in exact integer arithmetic.
    """
    if total < 0 or any(int(p) < 0 for p in parts) or sum(parts) <= 0:
        raise PartitionError(f"bad share split of {total} by {parts}")
    grid = int(sum(parts))
    bounds = [0]
    acc = 0
    for p in parts:
        acc += int(p)
        bounds.append(total * acc // grid)
    return tuple(bounds)


def chunk_bounds(length: int, chunk: int) -> tuple[tuple[int, int], ...]:
    """Split ``[0, length)`` into consecutive chunks of at most ``chunk`` elements."""
    if chunk <= 0 or length < 0:
        raise PartitionError(f"bad chunking of {length} by {chunk}")
    return tuple((a, min(a + chunk, length)) for a in range(0, length, chunk))
