"""One record per slot, pruned in one place (dedloc_jax.round.slots)."""

from __future__ import annotations

from dedloc_jax.round.slots import KEEP, Slots


def test_a_slot_has_one_record_made_on_first_use() -> None:
    slots = Slots()
    assert slots.get((3, 0)) is None  # looking does not make one
    record = slots[(3, 0)]
    assert slots[(3, 0)] is record and slots.get((3, 0)) is record
    assert slots[(3, 1)] is not record  # each level is a slot of its own
    assert not record.decided and record.ok is None and not record.opened.is_set()


def test_a_new_record_prunes_those_keep_epochs_older() -> None:
    slots = Slots()
    for epoch in range(3):
        slots[(epoch, 0)]
        slots[(epoch, 1)]
    slots[(2 + KEEP, 0)]  # epochs 0 and 1 are now more than KEEP behind
    assert slots.get((0, 0)) is None and slots.get((1, 1)) is None
    assert slots.get((2, 0)) is not None and slots.get((2, 1)) is not None
    slots[(1, 0)]  # an older record pruned nothing newer
    assert slots.get((2 + KEEP, 0)) is not None
