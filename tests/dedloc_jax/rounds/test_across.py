"""The pure parts of averaging across groups (dedloc_jax.rounds.across)."""

from __future__ import annotations

from dedloc_jax.averaging import AllReduceResult, GroupSpec, Member, ShareResult
from dedloc_jax.rounds.across import (
    averaged_weight,
    broadcast_codec,
    broadcast_round,
    representative,
)


def _spec(*modes: str) -> GroupSpec:
    return GroupSpec(
        tuple(Member(f"p{i}", m, weight=float(10 * (i + 1))) for i, m in enumerate(modes))
    )


def test_the_representative_is_the_first_member_that_sends() -> None:
    assert representative(_spec("node", "node")) == "p0"
    assert representative(_spec("aux", "client", "node")) == "p1"


def test_the_group_weight_counts_members_included_in_every_share() -> None:
    spec = _spec("node", "node", "node")
    everyone = frozenset({"p0", "p1", "p2"})
    full = ShareResult("p0", 0, 10, ((0, 10, everyone),), False)
    lossy = ShareResult("p1", 10, 20, ((10, 15, everyone), (15, 20, everyone - {"p2"})), True)
    assert averaged_weight(spec, AllReduceResult(None, None, (full, full))) == 60.0
    assert averaged_weight(spec, AllReduceResult(None, None, (full, lossy))) == 30.0


def test_the_broadcast_rounds_element_wise_and_has_its_own_round() -> None:
    assert broadcast_codec("int8") == "fp16"
    assert [broadcast_codec(c) for c in ("none", "fp16", "bf16")] == ["none", "fp16", "bf16"]
    spec = _spec("node", "node")
    assert broadcast_round(spec) != spec.digest
