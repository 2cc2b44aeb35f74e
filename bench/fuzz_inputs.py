"""Fuzz inputs for :mod:`bench.fuzz`: random bytes, byte mutations of valid seeds, and
structure-aware msgpack (random objects, and seeds with fields replaced).

Why apart: generating inputs is pure (a seeded numpy generator in, bytes out) and reused by
the hypothesis tests of the decoders; running them against decoders is the bench's job.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

if TYPE_CHECKING:
    from bench.fuzz import Decoder


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


_INTS = (0, 1, -1, 2, 7, 31, 32, 33, 255, 256, 65535, 1 << 31, (1 << 32) - 1, 1 << 62,
         (1 << 63) - 1, -(1 << 63), (1 << 64) - 1)  # fmt: skip
_FLOATS = (0.0, -0.0, 1.5, -1.0, 1e308, -1e308, math.inf, -math.inf, math.nan, 5e-324)


def random_object(rng: np.random.Generator, depth: int = 0, keys: tuple[Any, ...] = ()) -> Any:
    """A random msgpack-able value (extreme ints and floats, nesting, keys from ``keys``)."""
    kind = rng.integers(0, 10 if depth < 4 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return bool(rng.integers(0, 2))
    if kind == 2:
        if rng.random() < 0.6:
            return _INTS[int(rng.integers(0, len(_INTS)))]
        return int(rng.integers(-1000, 1000))
    if kind == 3:
        return float(rng.choice(_FLOATS)) if rng.random() < 0.6 else float(rng.normal() * 1e3)
    if kind == 4:
        return "".join(chr(int(c)) for c in rng.integers(32, 0x2FF, size=rng.integers(0, 40)))
    if kind == 5:
        return rng.bytes(int(rng.choice((0, 1, 16, 31, 32, 33, 64, 100))))
    if kind == 6:
        return str(rng.choice(keys)) if keys else ""
    n = int(rng.integers(0, 6))
    if kind in (7, 8):
        return [random_object(rng, depth + 1, keys) for _ in range(n)]
    out: dict[Any, Any] = {}
    for _ in range(n):
        key = rng.choice(keys) if keys and rng.random() < 0.7 else random_object(rng, 4)
        if isinstance(key, np.generic):
            key = key.item()
        if isinstance(key, (list, dict)):
            continue
        out[key] = random_object(rng, depth + 1, keys)
    return out


def _keys_of(obj: Any, acc: set[str]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, str):
                acc.add(k)
            _keys_of(v, acc)
    elif isinstance(obj, list):
        for v in obj:
            _keys_of(v, acc)


def mutate_structure(rng: np.random.Generator, obj: Any, keys: tuple[Any, ...]) -> Any:
    """``obj`` with one randomly chosen node replaced, removed or duplicated."""
    if isinstance(obj, dict) and obj and rng.random() < 0.8:
        k = list(obj)[int(rng.integers(0, len(obj)))]
        out = dict(obj)
        r = rng.random()
        if r < 0.15:
            del out[k]
        elif r < 0.6:
            out[k] = mutate_structure(rng, obj[k], keys)
        else:
            out[k] = random_object(rng, 2, keys)
        return out
    if isinstance(obj, list) and obj and rng.random() < 0.8:
        i = int(rng.integers(0, len(obj)))
        out_l = list(obj)
        r = rng.random()
        if r < 0.15:
            del out_l[i]
        elif r < 0.25:
            out_l.insert(i, random_object(rng, 2, keys))
        elif r < 0.6:
            out_l[i] = mutate_structure(rng, obj[i], keys)
        else:
            out_l[i] = random_object(rng, 2, keys)
        return out_l
    return random_object(rng, 2, keys)


def mutate_bytes(rng: np.random.Generator, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(int(rng.integers(1, 5))):
        op = rng.integers(0, 6)
        pos = int(rng.integers(0, len(buf) + 1))
        if op == 0 and buf:
            i = min(pos, len(buf) - 1)
            buf[i] ^= 1 << int(rng.integers(0, 8))
        elif op == 1 and buf:
            buf[min(pos, len(buf) - 1)] = int(rng.choice((0, 0xFF, 0x7F, 0x80, 0xC1, 0xDC, 0xDF)))
        elif op == 2:
            buf[pos:pos] = rng.bytes(int(rng.integers(1, 9)))
        elif op == 3 and buf:
            del buf[pos : pos + int(rng.integers(1, 9))]
        elif op == 4:
            del buf[pos:]
        else:
            buf[pos:pos] = buf[pos : pos + int(rng.integers(1, 33))]
    return bytes(buf)


class InputGenerator:
    """Inputs for one decoder: a third each of random bytes, byte mutations of valid seeds and
    structure-aware msgpack (random objects, and seeds with fields replaced)."""

    def __init__(self, decoder: Decoder, seed: int) -> None:
        self.decoder = decoder
        self.rng = np.random.default_rng([seed, int.from_bytes(decoder.name.encode()[:8], "big")])
        acc: set[str] = set()
        self.seed_objects = []
        for s in decoder.seeds:
            try:
                obj = msgpack.unpackb(s, raw=False, strict_map_key=False)
            except (ValueError, msgpack.UnpackException):
                continue
            self.seed_objects.append(obj)
            _keys_of(obj, acc)
        self.keys = tuple(sorted(acc)) + ("t", "k", "d")

    def __call__(self) -> bytes:
        rng = self.rng
        r = rng.random()
        if r < 0.3:
            return rng.bytes(int(rng.choice((0, 1, 4, 9, 20, 64, 200, 1000))))
        if r < 0.65 or not (self.decoder.message and self.seed_objects):
            base = self.decoder.seeds[int(rng.integers(0, len(self.decoder.seeds)))]
            return mutate_bytes(rng, base)
        if r < 0.8:
            obj = random_object(rng, 0, self.keys)
        else:
            base_obj = self.seed_objects[int(rng.integers(0, len(self.seed_objects)))]
            obj = mutate_structure(rng, base_obj, self.keys)
        try:
            return _pack(obj)
        except (OverflowError, TypeError, ValueError):  # e.g. an int beyond 64 bits
            return rng.bytes(16)
