"""One record per slot, (epoch, level): everything a peer remembers about one group formation,
kept for the last :data:`KEEP` epochs and pruned in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from dedloc_jax.averaging.group import GroupSpec, Member
from dedloc_jax.round.wire import Slot

KEEP = 4
"""Epochs a record outlives its slot: a late join or question about it still gets the answer."""


@dataclass
class LeaderRound:
    """One group this peer leads: who joined, and whether it is still open."""

    slot: Slot
    me: Member
    max_size: int
    joined: dict[str, Member] = field(default_factory=dict)
    open: bool = True
    formed: trio.Event = field(default_factory=trio.Event)
    changed: trio.Event = field(default_factory=trio.Event)  # set when someone joins
    expected: set[str] = field(default_factory=set)
    spec: GroupSpec | None = None
    addrs: dict[str, list[str]] = field(default_factory=dict)  # what each joiner sent
    cross: bool = False  # the leader's view held other groups: members average across them
    state: bytes | None = None  # the state the leader steps from (None: not known)


@dataclass
class SlotRecord:
    """What this peer knows of one slot; level 0 also holds the epoch's grouping, level 1 the
    outcome of the round across groups (as the level-0 group's representative)."""

    opened: trio.Event = field(default_factory=trio.Event)
    """Set once this peer leads the slot or decided otherwise: a join that came early waits."""
    decided: bool = False
    leader: str | None = None
    """The leader this peer went to, once ``decided`` (None: alone)."""
    registered: dict[str, Any] | None = None
    """Our registration's member as sent: told to a peer whose read of the key missed it."""
    leading: LeaderRound | None = None
    cross: bool = False
    """Level 0: the leader's view held other groups, so the mean goes across groups."""
    view: tuple[list[list[str]], dict[str, str]] | None = None
    """Level 0: the groups this peer computed and the registered peers' modes."""
    settled: trio.Event = field(default_factory=trio.Event)
    """Level 1: set once the representative knows the outcome of the round across groups."""
    ok: bool | None = None
    """Level 1: whether that round gave this group a mean (None: not settled yet)."""
    whole: bool = False
    """Level 1: whether every group's representative took part (else the mean is partial)."""


class Slots:
    """This peer's slot records. A record is made on first use (a join may come before we
    register) and each new one prunes those :data:`KEEP` epochs older than it."""

    def __init__(self) -> None:
        self._records: dict[Slot, SlotRecord] = {}

    def __getitem__(self, slot: Slot) -> SlotRecord:
        record = self._records.get(slot)
        if record is None:
            record = self._records[slot] = SlotRecord()
            for old in [s for s in self._records if s[0] < slot[0] - KEEP]:
                del self._records[old]
        return record

    def get(self, slot: Slot) -> SlotRecord | None:
        """The record, if this peer has one (without making it)."""
        return self._records.get(slot)
