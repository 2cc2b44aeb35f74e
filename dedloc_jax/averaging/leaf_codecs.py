"""A codec per pytree leaf: which codec carries each range of the flat vector.

A run names one *compression*: a codec (``none``, ``fp16``, ``bf16``, ``int8``: every leaf in
it) or a per-leaf policy (``adaptive``). The plan is a pure function of that name and the
leaves' shapes, both the same on every member (the group's vector is one model's tree), so no
member ever states a codec and every member encodes, decodes and predicts sizes alike. Its
:attr:`LeafCodecs.name` carries a digest of the plan: a member whose leaves differ is refused
at its hello.

``adaptive`` (after hivemind's size-adaptive selection): leaves of one dimension (biases,
LayerNorm scales) and leaves under :data:`ADAPTIVE_MIN_INT8` values travel in fp16, where
per-block scales would cost more than they save and their few bytes buy precision where one
value moves a whole feature; the matrices, nearly all the bytes, travel in blockwise int8.

A chunk that spans several leaves encodes each leaf's segment in its leaf's codec
(:class:`~.chunk_codecs.SegmentedCodec`); int8 blocks never straddle leaves, so each leaf has
its own scales. :meth:`LeafCodecs.wire_bytes` is the exact sum of the encoded parts of a vector as a
round cuts it, which the round's deadlines use.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

from .chunk_codecs import CODECS, ELEMENTWISE, Codec, SegmentedCodec, get_codec
from .errors import CodecError
from .partition import TreeSpec, chunk_bounds

ADAPTIVE_MIN_INT8 = 1 << 16
"""Values a leaf of two or more dimensions needs for ``adaptive`` to send it in int8."""

POLICIES = ("adaptive",)
"""Per-leaf policies, beside the codecs that carry every leaf alike."""

COMPRESSIONS = (*CODECS, *POLICIES)
"""Every name a run may choose for what its averaged vectors travel in."""


def _adaptive(shape: tuple[int, ...]) -> str:
    return "int8" if len(shape) >= 2 and math.prod(shape) >= ADAPTIVE_MIN_INT8 else "fp16"


def leaf_codec_names(compression: str, shapes: Sequence[tuple[int, ...]]) -> tuple[str, ...]:
    """The codec of each leaf under ``compression`` (a codec's name or a policy's)."""
    if compression in CODECS:
        return (compression,) * len(shapes)
    if compression == "adaptive":
        return tuple(_adaptive(tuple(s)) for s in shapes)
    raise CodecError(f"unknown compression {compression!r}; known: {list(COMPRESSIONS)}")


def elementwise(compression: str) -> str:
    """A compression that rounds every value alike however the vector is cut (for a mean that
    groups chunked differently must hold identically): int8 leaves become fp16."""
    if compression == "int8" or compression in POLICIES:
        return "fp16"
    return compression


class LeafCodecs:
    """The codec of every range of a flat vector of leaves (see the module docstring)."""

    def __init__(self, compression: str, offsets: Sequence[int], names: Sequence[str]) -> None:
        if len(offsets) != len(names) + 1:
            raise CodecError("one codec per leaf")
        self.compression = compression
        self.offsets = tuple(int(o) for o in offsets)
        self.codecs = tuple(get_codec(n) for n in names)
        self.lossless = all(c.lossless for c in self.codecs)
        self._uniform = self.codecs[0] if len(set(names)) == 1 else None
        if self._uniform is not None and compression in CODECS:
            self.name = compression
        else:
            plan = repr((self.offsets, tuple(names))).encode()
            self.name = f"{compression}:{hashlib.sha256(plan).hexdigest()[:16]}"
        self._spans: dict[tuple[int, int], Codec] = {}

    @classmethod
    def plan(cls, compression: str, spec: TreeSpec) -> LeafCodecs:
        """The plan for a tree of ``spec``'s leaves."""
        return cls(compression, spec.offsets, leaf_codec_names(compression, spec.shapes))

    @classmethod
    def of_shapes(cls, compression: str, shapes: Sequence[tuple[int, ...]]) -> LeafCodecs:
        """The plan for leaves of ``shapes`` flattened in this order."""
        offsets = [0]
        for shape in shapes:
            offsets.append(offsets[-1] + math.prod(shape))
        return cls(compression, offsets, leaf_codec_names(compression, shapes))

    @classmethod
    def uniform(cls, codec: Codec, size: int) -> LeafCodecs:
        """One codec for the whole vector (a codec object, e.g. a test's)."""
        plan = cls("none", (0, size), ("none",))
        plan.codecs, plan._uniform, plan.lossless, plan.name = (
            (codec,),
            codec,
            codec.lossless,
            codec.name,
        )
        return plan

    @property
    def size(self) -> int:
        return self.offsets[-1]

    def at(self, a: int, b: int) -> Codec:
        """The codec of values ``a..b`` of the vector: its leaf's, or one segment per leaf."""
        if self._uniform is not None:
            return self._uniform
        found = self._spans.get((a, b))
        if found is None:
            if not 0 <= a <= b <= self.size:
                raise CodecError(f"values {a}..{b} are outside a vector of {self.size}")
            found = self._span(a, b)
            if len(self._spans) > 1 << 16:  # chunk boundaries differ per group: bounded memory
                self._spans.clear()
            self._spans[(a, b)] = found
        return found

    def _span(self, a: int, b: int) -> Codec:
        i = bisect.bisect_right(self.offsets, a) - 1
        segments: list[tuple[Codec, int]] = []
        while a < b:
            while self.offsets[i + 1] <= a:  # empty leaves
                i += 1
            stop = min(b, self.offsets[i + 1])
            codec = self.codecs[i]
            if segments and segments[-1][0] is codec and codec.name in ELEMENTWISE:
                segments[-1] = (codec, segments[-1][1] + stop - a)  # no per-leaf state: merge
            else:
                segments.append((codec, stop - a))
            a, i = stop, i + 1
        if len(segments) == 1:
            return segments[0][0]
        return SegmentedCodec(tuple(segments))

    def wire_bytes(self, bounds: Sequence[int], chunk_elems: int) -> int:
        """Bytes of one whole vector encoded as a round cuts it: shares at ``bounds``, each in
        chunks of ``chunk_elems`` values (exactly what a sender's parts add up to, its own share
        included)."""
        total = 0
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            for a, b in chunk_bounds(stop - start, chunk_elems):
                total += self.at(start + a, start + b).encoded_size(b - a)
        return total
