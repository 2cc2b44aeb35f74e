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


def test_a_peer_alone_in_its_group_names_the_representatives_it_averaged_with() -> None:
    """Issue 46 (the capped soak at seed 8): a peer alone in its group averaged across groups
    with the other representatives but recorded no mates, so it vouched for nobody, nobody
    for it, and it anchored none of them. Its only trusted signer then left the run; after a
    partition it found no announcement vouched but its own (an old mate's vouch), counted
    itself the only vote of every fork check and stepped alone on its lineage to the end.
    The representatives it averaged with are its mates (``on_averaged`` gets their group)."""
    import numpy as np
    import trio
    import trio.testing

    from dedloc_jax.rounds.average import average_round
    from dedloc_jax.rounds.deadlines import Deadlines

    level1 = GroupSpec(tuple(Member(p, "node", weight=10.0) for p in ("me", "r1", "r2")))

    class Matchmaker:
        async def form_group(self, epoch, me, *, target, expected, deadlines, level=0):  # noqa: ANN001, ANN202
            return level1 if level == 1 else None  # alone in our group at level 0

        def needs_cross(self, epoch: int) -> bool:
            return True

        def representatives(self, epoch: int) -> set[str]:
            return {"r1", "r2"}

        def decline(self, epoch: int) -> None:
            pass

    class Across:
        def begin(self, wait: float) -> None:
            pass

        def settle(self, epoch: int, ok: bool, whole: bool = True) -> None:
            pass

        def close(self, epoch: int) -> None:
            pass

    class Node:
        peer_id = "me"

    class Averager:
        node, matchmaker, across = Node(), Matchmaker(), Across()

        def member(self, weight: float) -> Member:
            return Member("me", "node", weight=weight)

        async def group(self, epoch, me, **kw):  # noqa: ANN001, ANN003, ANN202
            return await self.matchmaker.form_group(epoch, me, **kw)

        async def all_reduce(self, spec, arrays, weight, codec, deadlines, **kw):  # noqa: ANN001, ANN003, ANN202
            assert spec is level1
            return AllReduceResult([np.full(3, 2.0, np.float32)], None, ()), ""

    named: list[GroupSpec] = []

    async def main():  # noqa: ANN202
        return await average_round(
            Averager(),  # type: ignore[arg-type]
            1,
            Member("me", "node", weight=10.0),
            [np.ones(3, np.float32)],
            deadlines=Deadlines(window=1.0),
            codec="none",
            target=30.0,
            expected=set(),
            on_averaged=named.append,
        )

    got = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert got.complete and got.group_size == 3
    assert named == [level1]
