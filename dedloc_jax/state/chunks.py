"""Training state as verifiable chunks: what a donor serves and a newcomer reassembles.

The state (parameters, optimizer state, epoch) is flattened to a list of host arrays, packed into
one byte buffer and cut into fixed-size chunks. The manifest lists each array's dtype and shape
and each chunk's SHA-256; its own digest is what donors announce in the DHT. A newcomer fetches
chunks from any donors that announce the same digest, checks every chunk on arrival, and can
resume from the chunks it already holds when a donor leaves. Pure logic, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

DEFAULT_CHUNK_BYTES = 1 << 20
_MAX_ARRAYS = 1 << 16
_MAX_TOTAL_BYTES = 1 << 36


class StateError(ValueError):
    """A manifest or chunk is malformed or does not match its digest."""


class NonFiniteStateError(StateError):
    """A state holds a NaN or an infinity: the run (or this peer) diverged. Such a state is
    never served nor loaded: it would spread to every peer that trains on it."""


def first_non_finite(arrays: Sequence[np.ndarray]) -> int | None:
    """The index of the first array holding a NaN or an infinity (None: all are finite).
    Integer and boolean arrays are finite by nature; bfloat16 ones are checked as float32."""
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        if a.dtype.kind in "biu":
            continue
        if a.dtype.kind != "f":  # e.g. ml_dtypes' bfloat16
            a = a.astype(np.float32)
        if not np.isfinite(a).all():
            return i
    return None


def _dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name


def _dtype_from_name(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        dt = np.dtype(name)
    except (TypeError, ValueError):  # numpy raises either for a malformed name
        raise StateError(f"unknown dtype {name!r}") from None
    if dt.kind not in "biuf" or dt.hasobject:
        raise StateError(f"dtype {name!r} is not a numeric array dtype")
    return dt


@dataclass(frozen=True, slots=True)
class StateManifest:
    """Describes a state: ``epoch``, array specs and per-chunk digests."""

    epoch: int
    specs: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype name, shape) per array
    chunk_bytes: int
    chunk_digests: tuple[bytes, ...]
    total_bytes: int

    @property
    def digest(self) -> bytes:
        return hashlib.sha256(msgpack.packb(self.to_wire())).digest()

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_digests)

    def to_wire(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "specs": [[d, list(s)] for d, s in self.specs],
            "chunk_bytes": self.chunk_bytes,
            "chunks": list(self.chunk_digests),
            "total": self.total_bytes,
        }

    @classmethod
    def from_wire(cls, msg: Any) -> StateManifest:
        """Parse and validate a manifest received from a peer."""
        if not isinstance(msg, Mapping):
            raise StateError("a manifest is a map")
        try:
            epoch, specs, chunk_bytes = msg["epoch"], msg["specs"], msg["chunk_bytes"]
            chunks, total = msg["chunks"], msg["total"]
        except KeyError as e:
            raise StateError(f"manifest misses {e}") from None
        if not (isinstance(epoch, int) and epoch >= 0):
            raise StateError("bad epoch")
        if not (isinstance(chunk_bytes, int) and 1 <= chunk_bytes <= 1 << 26):
            raise StateError("bad chunk size")
        if not (isinstance(specs, list) and len(specs) <= _MAX_ARRAYS):
            raise StateError("bad array specs")
        parsed = []
        size = 0
        for spec in specs:
            if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str)):
                raise StateError("bad array spec")
            shape = spec[1]
            if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
                raise StateError("bad array shape")
            dt = _dtype_from_name(spec[0])
            count = 1
            for d in shape:  # Python ints: no wrap-around, and bounded at every step
                count *= d
                if count * dt.itemsize > _MAX_TOTAL_BYTES:
                    raise StateError("array larger than any state")
            size += count * dt.itemsize
            parsed.append((spec[0], tuple(shape)))
        if not (isinstance(total, int) and total == size and total <= _MAX_TOTAL_BYTES):
            raise StateError("total size does not match the array specs")
        expected_chunks = max(1, -(-total // chunk_bytes))
        if not (
            isinstance(chunks, list)
            and len(chunks) == expected_chunks
            and all(isinstance(c, bytes) and len(c) == 32 for c in chunks)
        ):
            raise StateError("bad chunk digests")
        return cls(epoch, tuple(parsed), chunk_bytes, tuple(chunks), total)


def pack_state(
    arrays: Sequence[np.ndarray], epoch: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> tuple[StateManifest, bytes]:
    """Pack host arrays into one buffer and describe it; returns (manifest, buffer)."""
    arrays = [np.asarray(a) for a in arrays]  # tobytes() is C-ordered; keeps 0-d shapes
    buffer = b"".join(a.tobytes() for a in arrays)
    n_chunks = max(1, -(-len(buffer) // chunk_bytes))
    digests = tuple(
        hashlib.sha256(buffer[i * chunk_bytes : (i + 1) * chunk_bytes]).digest()
        for i in range(n_chunks)
    )
    specs = tuple((_dtype_name(a.dtype), tuple(int(d) for d in a.shape)) for a in arrays)
    return StateManifest(epoch, specs, chunk_bytes, digests, len(buffer)), buffer


def chunk_of(buffer: bytes, manifest: StateManifest, index: int) -> bytes:
    if not 0 <= index < manifest.num_chunks:
        raise StateError(f"chunk index {index} out of range")
    start = index * manifest.chunk_bytes
    return buffer[start : start + manifest.chunk_bytes]


class StateAssembler:
    """Collects verified chunks of one manifest, in any order, from any donors."""

    def __init__(self, manifest: StateManifest) -> None:
        self.manifest = manifest
        self._buffer = bytearray(manifest.total_bytes)
        self._have = [False] * manifest.num_chunks

    def missing(self) -> list[int]:
        return [i for i, ok in enumerate(self._have) if not ok]

    @property
    def complete(self) -> bool:
        return all(self._have)

    def add(self, index: int, data: bytes) -> None:
        """Store chunk ``index``; raises StateError if it does not match its digest."""
        m = self.manifest
        if not (isinstance(index, int) and 0 <= index < m.num_chunks):
            raise StateError(f"chunk index {index!r} out of range")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise StateError("chunk data must be bytes")
        if hashlib.sha256(data).digest() != m.chunk_digests[index]:
            raise StateError(f"chunk {index} does not match the manifest")
        start = index * m.chunk_bytes
        self._buffer[start : start + len(data)] = data
        self._have[index] = True

    def arrays(self) -> list[np.ndarray]:
        """The state's arrays; only once every chunk arrived."""
        if not self.complete:
            raise StateError(f"{len(self.missing())} chunks still missing")
        out = []
        offset = 0
        for dtype_name, shape in self.manifest.specs:
            dt = _dtype_from_name(dtype_name)
            n = int(np.prod(shape, dtype=np.int64))
            out.append(
                np.frombuffer(self._buffer, dt, count=n, offset=offset).reshape(shape).copy()
            )
            offset += n * dt.itemsize
        return out
