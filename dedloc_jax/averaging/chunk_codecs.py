"""Wire codecs for float32 chunks: none, fp16, bf16 and 8-bit blockwise with per-block scales.

Encoding and decoding are pure functions of their input, so a reducer that decodes its own
encoded result holds exactly the values every receiver decodes. ``decode`` never trusts the
byte count: a size that does not match ``n`` values is a :class:`CodecError`.

Error bounds (tested), for input ``x`` with ``|x| <= 2**126`` and ``y = decode(encode(x))``:

* ``none``: exact;
* ``fp16``: values are clipped to +-65504, then ``|x - y| <= max(|x| * 2**-11, 2**-25)``;
* ``bf16``: ``|x - y| <= max(|x| * 2**-8, 2**-133)``;
* ``int8`` (blocks of 256 values, one float32 scale ``absmax / 127`` each):
  ``|x - y| <= absmax(block) / 254 * (1 + 2**-20) + 127 * 2**-150`` (the last term only matters
  for blocks whose scale is a subnormal float32, i.e. absmax below ~1.5e-36: the scale's rounding
  to a multiple of 2**-149 can then push a value past 127 steps, where it is clipped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import ml_dtypes
import numpy as np

from .errors import CodecError

_F16_MAX = float(np.finfo(np.float16).max)
_F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view("<f2").astype(np.float32)
"""Every half-precision bit pattern as float32: decoding by table look-up gives numpy's own
conversion's bits (all 65,536 patterns) 2.6x faster (its conversion is a software loop)."""
_BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def _largest_int8_scale() -> np.float32:
    """The largest float32 block scale that 127 times stays finite (max / 127 rounds up)."""
    scale = np.float32(np.finfo(np.float32).max) / np.float32(127.0)
    with np.errstate(over="ignore"):
        while not np.isfinite(scale * np.float32(127.0)):
            scale = np.nextafter(scale, np.float32(0.0))
    return scale


_INT8_MAX_SCALE = _largest_int8_scale()


class Codec(Protocol):
    """What the all-reduce needs from a codec."""

    name: str
    lossless: bool  # decode(encode(x)) == x bit for bit

    def encode(self, x: np.ndarray) -> bytes | memoryview: ...

    def decode(self, data: bytes | bytearray | memoryview, n: int) -> np.ndarray: ...

    def decode_into(self, data: bytes | bytearray | memoryview, out: np.ndarray) -> None: ...

    def decode_view(
        self, data: bytes | bytearray | memoryview, scratch: np.ndarray
    ) -> np.ndarray: ...

    def encoded_size(self, n: int) -> int: ...


_FINITE_BLOCK = 1 << 16


def is_finite(x: np.ndarray) -> bool:
    """Whether every value is finite (NaN/Inf contributions are rejected).

    Checked in blocks: a whole-vector mask would be a fresh array as big as a quarter of the
    vector (fresh pages cost more than the check), and the first bad block ends the scan."""
    flat = np.asarray(x).reshape(-1)
    for a in range(0, flat.size, _FINITE_BLOCK):
        if not np.isfinite(flat[a : a + _FINITE_BLOCK]).all():
            return False
    return True


def _as_f32(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim != 1:
        raise CodecError(f"codecs take 1-D float32 arrays, got {x.dtype} {x.shape}")
    return x


def _decode_view(
    codec: Codec, data: bytes | bytearray | memoryview, scratch: np.ndarray
) -> np.ndarray:
    codec.decode_into(data, scratch)
    return scratch


def _exceeds(x: np.ndarray, limit: float) -> bool:
    """Whether some value is beyond +-limit (two passes, no temporary array)."""
    return x.size > 0 and (float(x.max()) > limit or float(x.min()) < -limit)


def _bytes_view(a: np.ndarray) -> memoryview:
    """The bytes of a contiguous array without copying them (the p2p layer frames a
    memoryview without a copy; the array must not change until it is sent)."""
    return memoryview(np.ascontiguousarray(a)).cast("B")


def _check_size(data: bytes | bytearray | memoryview, expected: int, name: str) -> None:
    if len(data) != expected:
        raise CodecError(f"{name}: expected {expected} bytes, got {len(data)}")


@dataclass(frozen=True)
class NoCompression:
    """Raw little-endian float32."""

    name: str = "none"

    def encode(self, x: np.ndarray) -> memoryview:
        return _bytes_view(_as_f32(x).astype("<f4", copy=False))

    lossless = True

    def decode(self, data: bytes | bytearray | memoryview, n: int) -> np.ndarray:
        _check_size(data, 4 * n, self.name)
        return np.frombuffer(data, dtype="<f4", count=n).astype(np.float32)

    def decode_into(self, data: bytes | bytearray | memoryview, out: np.ndarray) -> None:
        _check_size(data, 4 * out.size, self.name)
        out[...] = np.frombuffer(data, dtype="<f4", count=out.size)

    def decode_view(self, data: bytes | bytearray | memoryview, scratch: np.ndarray) -> np.ndarray:
        """Read-only values of ``data`` (``scratch.size`` of them) without copying."""
        _check_size(data, 4 * scratch.size, self.name)
        return np.frombuffer(data, dtype="<f4", count=scratch.size)

    def encoded_size(self, n: int) -> int:
        return 4 * n


@dataclass(frozen=True)
class Float16Compression:
    """IEEE half precision, clipped to its finite range (sahajBERT's wire format)."""

    name: str = "fp16"

    def encode(self, x: np.ndarray) -> memoryview:
        x = _as_f32(x)
        if _exceeds(x, _F16_MAX):
            x = np.clip(x, -_F16_MAX, _F16_MAX)
        return _bytes_view(x.astype("<f2"))

    lossless = False

    def decode(self, data: bytes | bytearray | memoryview, n: int) -> np.ndarray:
        out = np.empty(n, np.float32)
        self.decode_into(data, out)
        return out

    def decode_into(self, data: bytes | bytearray | memoryview, out: np.ndarray) -> None:
        _check_size(data, 2 * out.size, self.name)
        bits = np.frombuffer(data, dtype="<u2", count=out.size)
        if out.flags.c_contiguous:  # "wrap": no bounds check (16-bit indices), no buffering
            np.take(_F16_TABLE, bits, out=out.reshape(-1), mode="wrap")
        else:
            out[...] = _F16_TABLE[bits].reshape(out.shape)

    def encoded_size(self, n: int) -> int:
        return 2 * n

    def decode_view(self, data: bytes | bytearray | memoryview, scratch: np.ndarray) -> np.ndarray:
        return _decode_view(self, data, scratch)


@dataclass(frozen=True)
class BFloat16Compression:
    """bfloat16 (float32's range, 8 bits of mantissa), round to nearest even."""

    name: str = "bf16"

    def encode(self, x: np.ndarray) -> memoryview:
        x = _as_f32(x)
        if _exceeds(x, _BF16_MAX):
            x = np.clip(x, -_BF16_MAX, _BF16_MAX)
        return _bytes_view(x.astype(ml_dtypes.bfloat16).view(np.uint16))

    lossless = False

    def decode(self, data: bytes | bytearray | memoryview, n: int) -> np.ndarray:
        _check_size(data, 2 * n, self.name)
        return np.frombuffer(data, dtype=ml_dtypes.bfloat16, count=n).astype(np.float32)

    def decode_into(self, data: bytes | bytearray | memoryview, out: np.ndarray) -> None:
        _check_size(data, 2 * out.size, self.name)
        out[...] = np.frombuffer(data, dtype=ml_dtypes.bfloat16, count=out.size)

    def encoded_size(self, n: int) -> int:
        return 2 * n

    def decode_view(self, data: bytes | bytearray | memoryview, scratch: np.ndarray) -> np.ndarray:
        return _decode_view(self, data, scratch)


@dataclass(frozen=True)
class BlockwiseInt8Compression:
    """Signed 8-bit values with one float32 scale (absmax / 127) per block of ``block`` values.

    Layout: ``ceil(n / block)`` little-endian float32 scales, then ``n`` int8 values.
    """

    name: str = "int8"
    block: int = 256
    lossless = False

    def _blocks(self, n: int) -> int:
        return -(-n // self.block)

    def encode(self, x: np.ndarray) -> bytes:
        x = _as_f32(x)
        n = x.size
        nb = self._blocks(n)
        padded = np.zeros(nb * self.block, dtype=np.float32)
        padded[:n] = x
        blocks = padded.reshape(nb, self.block)
        scales = (np.abs(blocks).max(axis=1) / np.float32(127.0)).astype(np.float32)
        scales = np.minimum(scales, _INT8_MAX_SCALE)  # a block of float32 max decodes finite
        safe = np.where(scales > 0, scales, np.float32(1.0))
        q = np.clip(np.rint(blocks / safe[:, None]), -127, 127).astype(np.int8)
        return scales.astype("<f4").tobytes() + q.reshape(-1)[:n].tobytes()

    def decode(self, data: bytes | bytearray | memoryview, n: int) -> np.ndarray:
        nb = self._blocks(n)
        _check_size(data, self.encoded_size(n), self.name)
        scales = np.frombuffer(data, dtype="<f4", count=nb).astype(np.float32)
        if not np.all(np.isfinite(scales)) or np.any(scales < 0):
            raise CodecError("int8: non-finite or negative block scale")
        if np.any(scales > _INT8_MAX_SCALE):
            raise CodecError("int8: a block scale that decodes beyond float32 range")
        q = np.frombuffer(data, dtype=np.int8, count=n, offset=4 * nb)
        if np.any(q == -128):
            raise CodecError("int8: value -128 is outside the codec's range")
        out = np.empty(nb * self.block, dtype=np.float32)
        out[:n] = q
        out[n:] = 0
        out = out.reshape(nb, self.block) * scales[:, None]
        return out.reshape(-1)[:n].copy()

    def decode_into(self, data: bytes | bytearray | memoryview, out: np.ndarray) -> None:
        out[...] = self.decode(data, out.size)

    def encoded_size(self, n: int) -> int:
        return 4 * self._blocks(n) + n

    def decode_view(self, data: bytes | bytearray | memoryview, scratch: np.ndarray) -> np.ndarray:
        return _decode_view(self, data, scratch)


ELEMENTWISE = frozenset({"none", "fp16", "bf16"})
"""Codecs that encode each value on its own: any split of a vector encodes to the same values."""

MAX_SEGMENTS = 4096
"""Segments one :class:`SegmentedCodec` name may list (a chunk spans at most this many leaves)."""


@dataclass(frozen=True)
class SegmentedCodec:
    """Consecutive segments of a chunk, each in its own codec (the leaves a chunk spans).

    The encoding is the segments' encodings concatenated, so its size is the sum of theirs and
    a part of the wrong size is refused before any value is read. Its name lists the segments
    (``fp16*120+int8*3000``) and :func:`get_codec` parses it back, so evidence that names the
    codec of a chunk is checked by a peer that never saw the run's leaves.
    """

    segments: tuple[tuple[Codec, int], ...]

    @property
    def name(self) -> str:  # type: ignore[override]
        return "+".join(f"{c.name}*{n}" for c, n in self.segments)

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        return all(c.lossless for c, _ in self.segments)

    @property
    def size(self) -> int:
        return sum(n for _, n in self.segments)

    def _check_n(self, n: int) -> None:
        if n != self.size:
            raise CodecError(f"{self.name}: spans {self.size} values, asked for {n}")

    def encode(self, x: np.ndarray) -> bytes:
        x = _as_f32(x)
        self._check_n(x.size)
        out, at = [], 0
        for c, n in self.segments:
            out.append(bytes(c.encode(x[at : at + n])))
            at += n
        return b"".join(out)

    def decode(self, data: bytes | bytearray | memoryview, n: int) -> np.ndarray:
        out = np.empty(n, np.float32)
        self.decode_into(data, out)
        return out

    def decode_into(self, data: bytes | bytearray | memoryview, out: np.ndarray) -> None:
        self._check_n(out.size)
        _check_size(data, self.encoded_size(out.size), self.name)
        view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
        at, pos = 0, 0
        for c, n in self.segments:
            size = c.encoded_size(n)
            c.decode_into(view[pos : pos + size], out[at : at + n])
            at, pos = at + n, pos + size

    def decode_view(self, data: bytes | bytearray | memoryview, scratch: np.ndarray) -> np.ndarray:
        return _decode_view(self, data, scratch)

    def encoded_size(self, n: int) -> int:
        self._check_n(n)
        return sum(c.encoded_size(k) for c, k in self.segments)


def _parse_segments(name: str) -> SegmentedCodec:
    """The :class:`SegmentedCodec` a name such as ``fp16*120+int8*3000`` lists."""
    parts = name.split("+")
    if len(parts) > MAX_SEGMENTS:
        raise CodecError(f"a segmented codec of {len(parts)} segments (at most {MAX_SEGMENTS})")
    segments = []
    for part in parts:
        codec, _, count = part.partition("*")
        if codec not in CODECS or not count.isdigit() or int(count) <= 0 or len(count) > 12:
            raise CodecError(f"bad codec segment {part[:40]!r}")
        segments.append((CODECS[codec], int(count)))
    return SegmentedCodec(tuple(segments))


CODECS: dict[str, Codec] = {
    "none": NoCompression(),
    "fp16": Float16Compression(),
    "bf16": BFloat16Compression(),
    "int8": BlockwiseInt8Compression(),
}


def rounding_bound(codec: Codec, y: np.ndarray, cap: float, norm: float | None = None) -> float:
    """An L2 bound on ``|x - y|`` for ``y = decode(encode(x))`` (the error bounds above), from
    ``y`` alone; ``cap`` bounds ``|x|`` where ``y`` saturated (fp16's +-65504). ``norm``:
    ``|y|`` if the caller has it (fp16 then needs no pass over ``y`` but its extremes)."""
    if isinstance(codec, SegmentedCodec):  # the segments' bounds are independent
        y, at, sq = np.asarray(y), 0, 0.0
        for c, n in codec.segments:
            sq += rounding_bound(c, y[at : at + n], cap) ** 2
            at += n
        return math.sqrt(sq)
    if codec.name == "none" or np.size(y) == 0:
        return 0.0
    if codec.name == "fp16" and norm is not None and not _exceeds(y, _F16_MAX * (1 - 2**-11)):
        # max(a, f)**2 <= a**2 + f**2 per value: within 2**-50 per value of the formula below
        c = 2.0**-11 * (1 + 2.0**-10)
        return math.sqrt(norm * norm * c * c + np.size(y) * 2.0**-50)
    if codec.name == "fp16":
        # per value max(|y| c, 2**-25), cap where saturated: c * max(|y|, 2**-25 / c) summed
        # in float32 values with float64 squares (a float64 copy and four passes cost a
        # fifth of a chunk's check)
        c = 2.0**-11 * (1 + 2.0**-10)
        a = np.abs(np.asarray(y, np.float32))
        np.maximum(a, np.nextafter(np.float32(2.0**-25 / c), np.float32(1)), out=a)
        sq = float(np.einsum("i,i->", a, a, dtype=np.float64)) * c * c
        sat = a >= _F16_MAX
        if sat.any():
            over = a[sat].astype(np.float64)
            sq += float(np.sum(cap * cap - (over * c) ** 2))
        return math.sqrt(max(sq, 0.0))
    y = np.abs(np.asarray(y, np.float64))
    if codec.name == "bf16":
        b = np.maximum(y * 2.0**-8 * (1 + 2.0**-7), 2.0**-133)
    elif codec.name == "int8":
        block = BlockwiseInt8Compression.block
        nb = -(-y.size // block)
        padded = np.zeros(nb * block)
        padded[: y.size] = y
        absmax = padded.reshape(nb, block).max(axis=1)
        per = absmax / 254 * (1 + 2.0**-19) + 127 * 2.0**-150
        counts = np.full(nb, block)
        counts[-1] = y.size - (nb - 1) * block
        return float(np.sqrt(np.sum(per**2 * counts)))
    else:
        raise CodecError(f"no rounding bound for codec {codec.name!r}")
    return float(np.sqrt(np.einsum("i,i->", b, b)))  # einsum: BLAS is slow on a busy machine


def get_codec(name: str) -> Codec:
    """The codec registered under ``name`` (``none``, ``fp16``, ``bf16``, ``int8``), or the
    :class:`SegmentedCodec` a segment list names (``fp16*120+int8*3000``)."""
    if "*" in name:
        return _parse_segments(name)
    try:
        return CODECS[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}; known: {sorted(CODECS)}") from None
