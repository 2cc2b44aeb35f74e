"""``TopK``: SparseLoCo-style compression of DiLoCo's pseudo-gradients (sparse and low-bit).

The pseudo-gradient (plus this peer's error-feedback accumulator) is flattened into one float32
vector and cut into chunks of ``chunk`` values. Each chunk sends its ``k = density x chunk``
values of largest magnitude: their offsets within the chunk (ascending, Elias-Fano coded:
about ``2 + log2(chunk / k)`` bits each, 8 at SparseLoCo's 1/64, not ``log2 chunk`` = 12) and
their values in ``bits`` bits: one sign bit and ``bits - 1`` bits of magnitude,
uniform between the smallest and the largest selected magnitude of the chunk (two float32
scales per chunk), each value decoded to the lower edge of its bin: a sent value never exceeds,
in magnitude, the value it stands for (the outer step applies an overshoot at once; what falls
short stays in the error feedback and goes out later). What a chunk does not send stays in the
accumulator: ``e <- error_feedback x e + delta``, ``e <- e - decode(encode(e))``.

The same arithmetic runs in two places, which must agree bit for bit: :func:`encode_jax` inside
:func:`dedloc_jax.diloco` (jitted) and :func:`encode` (NumPy), the reference that tests replay.
Both use only element-wise float32 operations in the same order.

A peer's payload (:func:`pack`) is untrusted input: :func:`unpack` checks its exact size, that
offsets are strictly ascending within their chunk (in range, no repeats) and that the scales are
finite with ``0 <= lo <= hi``; anything else raises :class:`PayloadError`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dedloc_jax.averaging.verify import MIN_CLIPPED, OUTLIER, RADIUS

__all__ = [
    "Payload",
    "PayloadError",
    "TopK",
    "decode",
    "encode",
    "encode_jax",
    "mean_of",
    "pack",
    "unpack",
]


class PayloadError(ValueError):
    """A sparse payload that is not what :class:`TopK` with the run's settings produces."""


@dataclass(frozen=True)
class TopK:
    """Top-k per chunk of the pseudo-gradient, values in ``bits`` bits, error feedback.

    ``density``: fraction of each chunk sent (SparseLoCo: 1/64); ``bits``: bits per value, sign
    included (1 to 8); ``error_feedback``: the accumulator's decay (0: none kept); ``chunk``:
    values per chunk (at most 65536). Every peer of a run must use the same settings."""

    density: float = 1 / 64
    bits: int = 2
    error_feedback: float = 0.95
    chunk: int = 4096

    def __post_init__(self) -> None:
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
        if not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be 1 to 8, got {self.bits}")
        if not 0.0 <= self.error_feedback <= 1.0:
            raise ValueError(f"error_feedback must be in [0, 1], got {self.error_feedback}")
        if not 2 <= self.chunk <= 1 << 16:
            raise ValueError(f"chunk must be 2 to 65536, got {self.chunk}")

    def layout(self, n: int) -> tuple[int, int, int]:
        """(chunks, values per chunk, values sent per chunk) for a vector of ``n`` values.

        A vector shorter than ``chunk`` is one chunk; ``k`` never exceeds the last chunk's
        real length, so no padding is ever selected."""
        if n < 1:
            raise ValueError("TopK needs at least one value")
        size = min(self.chunk, n)
        chunks = -(-n // size)
        last = n - (chunks - 1) * size
        k = max(1, min(round(self.density * size), last))
        return chunks, size, k

    def payload_bytes(self, n: int) -> int:
        """The exact size of one peer's payload for ``n`` values (:func:`pack`)."""
        chunks, size, k = self.layout(n)
        low, high = _ef_layout(size, k)
        return (
            8 * chunks
            + _packed_len(chunks * k, low)
            + _packed_len(chunks * high, 1)
            + _packed_len(chunks * k, self.bits)
        )


class Payload(NamedTuple):
    """One peer's compressed vector: ``offsets`` (chunks, k) int32 within each chunk,
    ascending; ``codes`` (chunks, k) uint8: sign in the top bit of ``bits``, magnitude bin
    below; ``scales`` (chunks, 2) float32: the smallest and largest selected magnitude."""

    offsets: np.ndarray
    codes: np.ndarray
    scales: np.ndarray


def _ef_layout(size: int, k: int) -> tuple[int, int]:
    """Elias-Fano for ``k`` ascending offsets below ``size``: the low bits of each offset
    (``low``, plain), and the high parts as one bit per offset set at ``high part + rank`` in
    a row of ``high`` bits (their gaps in unary): (low, high)."""
    low = int(math.floor(math.log2(size / k))) if size > k else 0
    return low, k + ((size - 1) >> low) + 1


def _packed_len(count: int, width: int) -> int:
    return -(-count * width // 8)


# --- the arithmetic, twice: NumPy (the reference) and JAX (in the transform) ---------------
def _chunks_np(x: np.ndarray, chunks: int, size: int) -> np.ndarray:
    padded = np.zeros(chunks * size, np.float32)
    padded[: x.size] = x
    return padded.reshape(chunks, size)


def encode(cfg: TopK, x: np.ndarray) -> Payload:
    """The payload of the float32 vector ``x`` (the NumPy reference of :func:`encode_jax`)."""
    x = np.asarray(x, np.float32).reshape(-1)
    chunks, size, k = cfg.layout(x.size)
    blocks = _chunks_np(x, chunks, size)
    mag = np.abs(blocks)
    if chunks * size > x.size:  # padding is never selected
        mag.reshape(-1)[x.size :] = -1.0
    # largest magnitudes, ties to the lower offset (as lax.top_k), then ascending offsets
    order = np.argsort(-mag, axis=1, kind="stable")[:, :k]
    offsets = np.sort(order, axis=1).astype(np.int32)
    values = np.take_along_axis(blocks, offsets, axis=1)
    codes, scales = _quantise_np(cfg, values)
    return Payload(offsets, codes, scales)


def _quantise_np(cfg: TopK, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    levels = np.float32(1 << (cfg.bits - 1))
    m = np.abs(values)
    lo = m.min(axis=1)
    hi = m.max(axis=1)
    step = (hi - lo) / levels
    safe = np.where(step > 0, step, np.float32(1.0))
    q = np.floor((m - lo[:, None]) / safe[:, None])
    q = np.clip(np.where(step[:, None] > 0, q, 0), 0, levels - 1).astype(np.uint8)
    sign = (values < 0).astype(np.uint8) << np.uint8(cfg.bits - 1)
    return (q | sign).astype(np.uint8), np.stack([lo, hi], axis=1).astype(np.float32)


def decode(cfg: TopK, payload: Payload, n: int) -> np.ndarray:
    """The dense float32 vector of ``n`` values that ``payload`` stands for."""
    chunks, size, k = cfg.layout(n)
    offsets, codes, scales = payload
    out = np.zeros((chunks, size), np.float32)
    np.put_along_axis(out, offsets.astype(np.int64), _dequantise_np(cfg, codes, scales), axis=1)
    return out.reshape(-1)[:n]


def _dequantise_np(cfg: TopK, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    levels = np.float32(1 << (cfg.bits - 1))
    lo, hi = scales[:, 0:1], scales[:, 1:2]
    step = (hi - lo) / levels
    mag_code = (codes & np.uint8((1 << (cfg.bits - 1)) - 1)).astype(np.float32)
    mag = lo + mag_code * step  # the bin's lower edge: never more than was held
    negative = (codes >> np.uint8(cfg.bits - 1)) & np.uint8(1)
    return np.where(negative == 1, -mag, mag).astype(np.float32)


def encode_jax(cfg: TopK, x: jax.Array) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array]:
    """(offsets, codes, scales) of the float32 vector ``x``, and its decoded dense form."""
    n = x.shape[0]
    chunks, size, k = cfg.layout(n)
    blocks = jnp.zeros(chunks * size, jnp.float32).at[:n].set(x).reshape(chunks, size)
    mag = jnp.abs(blocks)
    if chunks * size > n:
        mag = mag.reshape(-1).at[n:].set(-1.0).reshape(chunks, size)
    _, order = jax.lax.top_k(mag, k)
    offsets = jnp.sort(order, axis=1).astype(jnp.int32)
    values = jnp.take_along_axis(blocks, offsets, axis=1)
    levels = jnp.float32(1 << (cfg.bits - 1))
    m = jnp.abs(values)
    lo = m.min(axis=1)
    hi = m.max(axis=1)
    step = (hi - lo) / levels
    safe = jnp.where(step > 0, step, jnp.float32(1.0))
    q = jnp.floor((m - lo[:, None]) / safe[:, None])
    q = jnp.clip(jnp.where(step[:, None] > 0, q, 0), 0, levels - 1)
    codes = q.astype(jnp.uint8) | ((values < 0).astype(jnp.uint8) << (cfg.bits - 1))
    scales = jnp.stack([lo, hi], axis=1)
    mag_out = lo[:, None] + q * step[:, None]
    dec = jnp.where(values < 0, -mag_out, mag_out)
    rows = jnp.arange(chunks)[:, None]
    dense = jnp.zeros((chunks, size), jnp.float32).at[rows, offsets].set(dec)
    return (offsets, codes, scales.astype(jnp.float32)), dense.reshape(-1)[:n]


# --- the wire form ------------------------------------------------------------------------
def _pack_bits(values: np.ndarray, width: int) -> bytes:
    v = values.astype(np.uint32).reshape(-1)
    bits = ((v[:, None] >> np.arange(width, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def _unpack_bits(data: bytes | memoryview, count: int, width: int) -> np.ndarray:
    raw = np.frombuffer(data, np.uint8)
    bits = np.unpackbits(raw, bitorder="little", count=count * width).reshape(count, width)
    return (bits.astype(np.uint32) << np.arange(width, dtype=np.uint32)).sum(axis=1)


def pack(cfg: TopK, payload: Payload, n: int) -> bytes:
    """The compact bytes of ``payload`` (for ``n`` values): the scales as little-endian
    float32, then the offsets and the codes, bit-packed."""
    chunks, size, k = cfg.layout(n)
    offsets, codes, scales = (np.asarray(a) for a in payload)
    if offsets.shape != (chunks, k) or codes.shape != (chunks, k) or scales.shape != (chunks, 2):
        raise PayloadError(f"payload shapes do not fit {n} values with {cfg}")
    low, high = _ef_layout(size, k)
    offsets = offsets.astype(np.int64)
    if (offsets < 0).any() or (offsets >= size).any():  # (each high part must fit its row)
        raise PayloadError("offset out of range")
    # Offsets not ascending (encode's are) pack into bytes that unpack refuses.
    row = np.zeros((chunks, high), np.uint8)
    np.put_along_axis(row, (offsets >> low) + np.arange(k), 1, axis=1)
    return (
        scales.astype("<f4").tobytes()
        + (_pack_bits(offsets & ((1 << low) - 1), low) if low else b"")
        + np.packbits(row.reshape(-1), bitorder="little").tobytes()
        + _pack_bits(codes, cfg.bits)
    )


def unpack(cfg: TopK, data: bytes | bytearray | memoryview, n: int) -> Payload:
    """The payload in ``data``, checked (see the module docstring); :class:`PayloadError`
    says what is wrong."""
    chunks, size, k = cfg.layout(n)
    if len(data) != cfg.payload_bytes(n):
        raise PayloadError(f"{len(data)} bytes, expected {cfg.payload_bytes(n)} for {n} values")
    data = memoryview(data).cast("B")
    scales = np.frombuffer(data, "<f4", count=2 * chunks).reshape(chunks, 2).astype(np.float32)
    if not np.isfinite(scales).all():
        raise PayloadError("non-finite scale")
    if (scales[:, 0] < 0).any() or (scales[:, 0] > scales[:, 1]).any():
        raise PayloadError("scales out of order (need 0 <= lo <= hi)")
    at = 8 * chunks
    low, high = _ef_layout(size, k)
    low_len, high_len = _packed_len(chunks * k, low), _packed_len(chunks * high, 1)
    lows = np.zeros((chunks, k), np.int64)
    if low:
        lows[:] = _unpack_bits(data[at : at + low_len], chunks * k, low).reshape(chunks, k)
    at += low_len
    raw = np.frombuffer(data[at : at + high_len], np.uint8)
    row = np.unpackbits(raw, bitorder="little", count=chunks * high).reshape(chunks, high)
    if (row.sum(axis=1, dtype=np.int64) != k).any():
        raise PayloadError("a chunk does not hold k offsets")
    _, cols = np.nonzero(row)  # row-major: each chunk's set bits in ascending order
    offsets = ((cols.reshape(chunks, k).astype(np.int64) - np.arange(k)) << low) | lows
    codes = _unpack_bits(data[at + high_len :], chunks * k, cfg.bits).reshape(chunks, k)
    limits = np.full(chunks, size)
    limits[-1] = n - (chunks - 1) * size
    if (offsets >= limits[:, None]).any():
        raise PayloadError("offset out of range")
    if k > 1 and (np.diff(offsets.astype(np.int64), axis=1) <= 0).any():
        raise PayloadError("offsets not strictly ascending within a chunk")
    # values decode within [lo, hi]: finite scales give finite values
    return Payload(offsets.astype(np.int32), codes.astype(np.uint8), scales)


SCALE_CAP = 4.0
"""A payload's scales count for at most this many times the members' upper median, per chunk:
one peer cannot blow up the mean with huge (finite) values."""


def outlier_weights(
    cfg: TopK, payloads: Sequence[Payload], weights: Sequence[float], n: int
) -> np.ndarray | None:
    """Each payload's weight per chunk (payloads x chunks, float32), zero where the chunk at
    its own scales is longer than :data:`~dedloc_jax.averaging.verify.OUTLIER` derived radii
    of the payloads' norms there (the rule of the reducers' CenteredClip, with at least
    ``MIN_CLIPPED`` payloads): a -1000 x or 1e30 payload counts for nothing instead of for
    ``SCALE_CAP`` x the others' magnitudes in its own direction (one flipped sender of four,
    capped only, multiplied bench.byzantine's topk loss by 23). None: nothing excluded."""
    if len(payloads) < MIN_CLIPPED:
        return None
    # a chunk's norm from its k values (float64: the same figure on every member)
    values = np.stack([_dequantise_np(cfg, p.codes, p.scales) for p in payloads])
    norms = np.sqrt(np.einsum("pck,pck->pc", values, values, dtype=np.float64))
    upper = np.sort(norms, axis=0)[len(payloads) // 2]
    tau = np.maximum(RADIUS * upper, 1e-30)  # verify.derived_tau, for every chunk at once
    far = norms > OUTLIER * tau[None, :]
    w = np.repeat(np.asarray(weights, np.float32)[:, None], norms.shape[1], axis=1)
    far &= w > 0
    if not far.any():
        return None
    w[far] = 0.0  # (never every payload of a chunk: the upper median's is within)
    return w


def mean_of(
    cfg: TopK,
    payloads: Sequence[Payload],
    weights: Sequence[float],
    n: int,
    *,
    outliers: bool = False,
) -> np.ndarray:
    """The weighted mean of the payloads' dense forms, summed in the order given (so every
    peer that sums the same payloads in the same order holds the same bits). Each payload's
    scales are first capped per chunk at ``SCALE_CAP`` times the upper median of the
    payloads' largest scales (element-wise minimum: exact, the same everywhere). ``outliers``
    (robust aggregation, on in open runs): a payload's chunk far outside the others' counts
    for nothing (:func:`outlier_weights`)."""
    if not payloads or len(payloads) != len(weights):
        raise ValueError("need one weight per payload, and at least one payload")
    his = np.stack([p.scales[:, 1] for p in payloads])
    cap = np.float32(SCALE_CAP) * np.sort(his, axis=0)[len(payloads) // 2]
    # nothing excluded (or no rule): the same bits as without it
    per_chunk = outlier_weights(cfg, payloads, weights, n) if outliers else None
    out = np.zeros(n, np.float32)
    if per_chunk is None:
        total = np.float32(sum(np.float32(w) for w in weights))
        if total <= 0:
            return out
        for p, w in zip(payloads, weights, strict=True):
            scales = np.minimum(p.scales, cap[:, None])
            dense = decode(cfg, Payload(p.offsets, p.codes, scales), n)
            out += (np.float32(w) / total) * dense
        return out
    chunks, size, _ = cfg.layout(n)
    totals = np.zeros(chunks, np.float32)
    for row in per_chunk:  # in the order given, as above
        totals += row
    safe = np.where(totals > 0, totals, np.float32(1.0))
    for p, row in zip(payloads, per_chunk, strict=True):
        scales = np.minimum(p.scales, cap[:, None])
        dense = decode(cfg, Payload(p.offsets, p.codes, scales), n)
        out += np.repeat(row / safe, size)[:n] * dense
    return out
