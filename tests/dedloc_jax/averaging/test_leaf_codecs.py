"""Per-leaf codecs: the plan, segmented chunks, exact sizes, and a round with mixed leaves."""

import numpy as np
import pytest

from dedloc_jax.averaging import AllReduceConfig, flatten
from dedloc_jax.averaging.chunk_codecs import SegmentedCodec, get_codec, rounding_bound
from dedloc_jax.averaging.errors import CodecError
from dedloc_jax.averaging.leaf_codecs import (
    ADAPTIVE_MIN_INT8,
    LeafCodecs,
    elementwise,
    leaf_codec_names,
)
from dedloc_jax.averaging.partition import chunk_bounds, share_bounds

from .helpers import run_round

# a matrix (int8), a bias and a LayerNorm scale (fp16), a matrix too small to gain (fp16),
# another matrix whose size is no multiple of the int8 block (int8)
SHAPES = [(300, 300), (300,), (300,), (40, 50), (257, 259)]


def _tree(rng, scales=(1.0, 1.0, 1.0, 1.0, 1.0)):
    return {
        f"l{i}": (rng.standard_normal(s) * sc).astype(np.float32)
        for i, (s, sc) in enumerate(zip(SHAPES, scales, strict=True))
    }


def test_adaptive_sends_matrices_in_int8_and_the_rest_in_fp16():
    assert leaf_codec_names("adaptive", SHAPES) == ("int8", "fp16", "fp16", "fp16", "int8")
    assert leaf_codec_names("adaptive", [(ADAPTIVE_MIN_INT8,), (1, ADAPTIVE_MIN_INT8)]) == (
        "fp16",
        "int8",
    )
    assert leaf_codec_names("fp16", SHAPES) == ("fp16",) * len(SHAPES)
    with pytest.raises(CodecError, match="unknown compression"):
        leaf_codec_names("gzip", SHAPES)
    assert elementwise("adaptive") == "fp16" and elementwise("int8") == "fp16"
    assert elementwise("bf16") == "bf16"


def test_the_plan_depends_on_the_leaves_and_a_uniform_one_keeps_its_codecs_name():
    a = LeafCodecs.of_shapes("adaptive", SHAPES)
    b = LeafCodecs.of_shapes("adaptive", SHAPES[::-1])  # same size, other leaves
    assert a.size == b.size and a.name != b.name and a.name.startswith("adaptive:")
    assert LeafCodecs.of_shapes("adaptive", SHAPES).name == a.name  # a pure function
    assert LeafCodecs.of_shapes("int8", SHAPES).name == "int8"


@pytest.mark.parametrize("chunk", [97, 4096, 1 << 16, 1 << 20])
def test_each_leaf_within_its_own_codecs_error_bound(chunk):
    """Wherever chunks cut the vector, every value is within the bound of its leaf's codec,
    and int8 scales are per leaf: a leaf of small values beside one of large values keeps
    its own precision (one int8 block over both would err by ~1e3 / 254 there)."""
    rng = np.random.default_rng(0)
    tree = _tree(rng, scales=(1e-3, 1.0, 1.0, 1.0, 1e3))
    vec, spec = flatten(tree)
    plan = LeafCodecs.plan("adaptive", spec)
    bounds = share_bounds(vec.size, [3, 5, 2])
    out = np.empty_like(vec)
    total = 0
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        for a, b in chunk_bounds(e - s, chunk):
            codec = plan.at(s + a, s + b)
            data = codec.encode(vec[s + a : s + b])
            assert len(data) == codec.encoded_size(b - a)
            total += len(data)
            out[s + a : s + b] = codec.decode(data, b - a)
            err = float(np.linalg.norm(out[s + a : s + b] - vec[s + a : s + b]))
            assert err <= rounding_bound(get_codec(codec.name), out[s + a : s + b], 1e30)
    assert total == plan.wire_bytes(bounds, chunk)
    for i, name in enumerate(leaf_codec_names("adaptive", spec.shapes)):
        x = vec[spec.offsets[i] : spec.offsets[i + 1]].astype(np.float64)
        y = out[spec.offsets[i] : spec.offsets[i + 1]].astype(np.float64)
        if name == "fp16":
            assert np.all(np.abs(x - y) <= np.maximum(np.abs(x) * 2.0**-11, 2.0**-25))
        else:  # no block bigger than 256 values of this leaf
            assert np.max(np.abs(x - y)) <= np.max(np.abs(x)) / 254 * (1 + 2.0**-20)
    small = slice(spec.offsets[0], spec.offsets[1])
    assert np.max(np.abs(out[small] - vec[small])) < 1e-4


def test_wire_bytes_is_what_the_codecs_send():
    """One int8 leaf: n values plus a 4-byte scale per started block of each chunk."""
    plan = LeafCodecs.of_shapes("adaptive", [(1000, 100)])
    bounds = (0, 30_000, 100_000)
    want = 100_000 + 4 * sum(-(-(b - a) // 256) for a, b in chunk_bounds(30_000, 4096))
    want += 4 * sum(-(-(b - a) // 256) for a, b in chunk_bounds(70_000, 4096))
    assert plan.wire_bytes(bounds, 4096) == want
    mixed = LeafCodecs.of_shapes("adaptive", SHAPES)
    fp16 = LeafCodecs.of_shapes("fp16", SHAPES)
    assert fp16.wire_bytes((0, mixed.size), 4096) == 2 * mixed.size
    assert mixed.wire_bytes((0, mixed.size), 4096) < 0.6 * fp16.wire_bytes((0, mixed.size), 4096)


def test_a_segmented_part_of_the_wrong_size_or_with_garbage_is_refused():
    plan = LeafCodecs.of_shapes("adaptive", SHAPES)
    codec = plan.at(90_000 - 10, 90_000 + 20)  # 10 int8 values, then 20 fp16
    assert isinstance(codec, SegmentedCodec) and codec.name == "int8*10+fp16*20"
    x = np.linspace(-1, 1, 30, dtype=np.float32)
    data = codec.encode(x)
    with pytest.raises(CodecError, match="expected 54 bytes, got 53"):
        codec.decode(data[:-1], 30)
    with pytest.raises(CodecError, match="spans 30 values, asked for 31"):
        codec.decode(data + b"\0\0", 31)
    bad = bytearray(data)
    bad[0:4] = np.float32(np.nan).tobytes()  # the int8 segment's block scale
    with pytest.raises(CodecError, match="non-finite or negative block scale"):
        codec.decode(bytes(bad), 30)
    bad = bytearray(data)
    bad[4] = 0x80  # int8 value -128
    with pytest.raises(CodecError, match="-128"):
        codec.decode(bytes(bad), 30)
    for name in ("fp16*0", "gzip*3", "fp16*3+", "fp16*-1", "+".join(["fp16*1"] * 5000)):
        with pytest.raises(CodecError):
            get_codec(name)
    assert get_codec(codec.name).decode(data, 30).tobytes() == codec.decode(data, 30).tobytes()


@pytest.mark.parametrize("verify", [False, True])
def test_a_round_with_mixed_leaves_leaves_every_member_bit_identical(verify):
    """Four members (one client) average a tree of int8 and fp16 leaves in adaptive: all
    hold the same bits, each leaf within its codec's rounding of the exact mean (twice: the
    parts, then the result), and with verification on, no share is dropped."""
    rng = np.random.default_rng(3)
    trees = [_tree(rng) for _ in range(4)]
    weights = [1.0, 2.0, 3.0, 1.5]
    cfg = AllReduceConfig.testing().replace(chunk_elems=5000, verify=verify, robust=verify)
    outcome, _, _ = run_round(
        ["node", "node", "node", "client"], trees, weights, codec="adaptive", config=cfg
    )
    assert all(not isinstance(o, BaseException) and o is not None for o in outcome), outcome
    first = outcome[0].vector
    for o in outcome[1:]:
        assert o.vector.tobytes() == first.tobytes()
    assert not any(s.dropped for s in outcome[0].shares)
    vecs = [flatten(t)[0].astype(np.float64) for t in trees]
    mean = sum(v * w for v, w in zip(vecs, weights, strict=True)) / sum(weights)
    spec = flatten(trees[0])[1]
    for i, name in enumerate(leaf_codec_names("adaptive", SHAPES)):
        a, b = spec.offsets[i], spec.offsets[i + 1]
        err = np.abs(first[a:b] - mean[a:b])
        if name == "fp16":  # per value: the parts' rounding, then the result's
            most = np.max([np.abs(v[a:b]) for v in vecs], axis=0)
            assert np.all(err <= 2.0**-11 * (most + np.abs(mean[a:b])) * 1.01 + 2.0**-24)
        else:
            top = max(np.max(np.abs(v[a:b])) for v in vecs)
            assert 0 < np.max(err) <= 2 * top / 254


def test_the_deadlines_bytes_are_the_parts_the_members_send(monkeypatch):
    """The size the round's deadlines are computed from (``rounds.average.wire_bytes``) is
    exactly what the senders' parts add up to: each of the n senders sends every share but
    its own, (n - 1) vectors in all (here 3 reducers and a client that reduces nothing)."""
    import jax

    from dedloc_jax.averaging import wire
    from dedloc_jax.rounds.average import wire_bytes

    sent: list[int] = []
    real = wire.part

    def counting(k, data):
        sent.append(len(data))
        return real(k, data)

    monkeypatch.setattr(wire, "part", counting)
    rng = np.random.default_rng(5)
    trees = [_tree(rng) for _ in range(4)]
    grid = 1 << 24
    parts = (grid // 2, grid // 3, grid - grid // 2 - grid // 3, 0)
    cfg = AllReduceConfig.testing().replace(chunk_elems=7000)
    outcome, _, _ = run_round(
        ["node", "node", "node", "client"], trees, [1.0] * 4, codec="adaptive", config=cfg,
        parts=parts,
    )  # fmt: skip
    assert all(o is not None and not isinstance(o, BaseException) for o in outcome), outcome

    class Spec:
        def share_parts(self):
            return parts

    leaves = jax.tree_util.tree_leaves(trees[0])
    assert sum(sent) == 3 * wire_bytes(leaves, "adaptive", Spec(), cfg.chunk_elems)
    assert wire_bytes(leaves, "adaptive", Spec(), 7000) < 0.6 * wire_bytes(
        leaves, "fp16", Spec(), 7000
    )
