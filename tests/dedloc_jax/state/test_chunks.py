from __future__ import annotations

import ml_dtypes
import msgpack
import numpy as np
import pytest

from dedloc_jax.state.chunks import (
    StateAssembler,
    StateError,
    StateManifest,
    chunk_of,
    pack_state,
)
from dedloc_jax.state.download import plan_downloads


def _state() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.normal(size=(37, 5)).astype(np.float32),
        rng.normal(size=(3,)).astype(ml_dtypes.bfloat16),
        np.array(7, np.int32),
        np.zeros((0, 4), np.float16),
        rng.normal(size=(1000,)).astype(np.float64),
    ]


def test_pack_transfer_in_any_order_and_reassemble_bit_identical() -> None:
    arrays = _state()
    manifest, buffer = pack_state(arrays, epoch=3, chunk_bytes=256)
    wire = msgpack.unpackb(msgpack.packb(manifest.to_wire()))
    received = StateManifest.from_wire(wire)
    assert received.digest == manifest.digest and received.epoch == 3
    asm = StateAssembler(received)
    order = list(range(manifest.num_chunks))
    np.random.default_rng(1).shuffle(order)
    for i in order[: len(order) // 2]:
        asm.add(i, chunk_of(buffer, manifest, i))
    assert not asm.complete and sorted(asm.missing()) == sorted(order[len(order) // 2 :])
    for i in asm.missing():  # resume: only the missing chunks are fetched again
        asm.add(i, chunk_of(buffer, manifest, i))
    out = asm.arrays()
    for a, b in zip(arrays, out, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def test_corrupted_chunk_is_refused_and_stays_missing() -> None:
    manifest, buffer = pack_state(_state(), epoch=0, chunk_bytes=128)
    asm = StateAssembler(manifest)
    bad = bytearray(chunk_of(buffer, manifest, 2))
    bad[0] ^= 1
    with pytest.raises(StateError, match="does not match"):
        asm.add(2, bytes(bad))
    assert 2 in asm.missing()
    with pytest.raises(StateError):
        asm.add(10**6, b"")
    with pytest.raises(StateError, match="missing"):
        asm.arrays()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m.pop("specs"),
        lambda m: m.update(epoch=-1),
        lambda m: m.update(total=m["total"] + 1),
        lambda m: m.update(chunks=m["chunks"][:-1]),
        lambda m: m.update(specs=[["object", [1]]]),
        lambda m: m.update(specs=[["float32", [-1]]]),
        lambda m: m.update(chunk_bytes=0),
    ],
)
def test_malformed_manifests_are_rejected(mutate) -> None:
    manifest, _ = pack_state(_state(), epoch=1, chunk_bytes=256)
    wire = manifest.to_wire()
    mutate(wire)
    with pytest.raises(StateError):
        StateManifest.from_wire(wire)
    with pytest.raises(StateError):
        StateManifest.from_wire("not a map")


def test_plan_spreads_chunks_over_donors() -> None:
    plan = plan_downloads(list(range(10)), ["a", "b", "c"])
    assert sorted(c for cs in plan.values() for c in cs) == list(range(10))
    assert max(map(len, plan.values())) - min(map(len, plan.values())) <= 1
    assert plan_downloads([1], []) == {}
