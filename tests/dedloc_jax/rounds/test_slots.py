"""One record per slot, pruned in one place (dedloc_jax.rounds.slots)."""

from __future__ import annotations

from dedloc_jax.rounds.slots import KEEP, MAX_ASKED, Slots


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


def test_a_question_about_a_far_epoch_prunes_nothing_and_is_answered_at_once() -> None:
    slots = Slots()
    leading = slots[(7, 0)]  # a round of ours in progress
    far = slots.asked((10**9, 0))  # another peer names an epoch far ahead
    assert far.opened.is_set() and far.settled.is_set()  # nothing to wait for
    assert slots.get((10**9, 0)) is None and slots.get((7, 0)) is leading
    near = slots.asked((8, 1))  # the next epoch: a join may come before we register
    assert not near.opened.is_set() and slots.get((8, 1)) is near
    assert slots[(8, 1)] is near  # our own round then uses the record the question made


def test_questions_make_at_most_max_asked_records() -> None:
    slots = Slots()  # no round of our own yet: any epoch is near
    made = [slots.asked((e, 0)) for e in range(MAX_ASKED + 10)]
    assert sum(slots.get((e, 0)) is not None for e in range(MAX_ASKED + 10)) == MAX_ASKED
    assert all(r.opened.is_set() for r in made[MAX_ASKED:])
