"""One record per slot, (epoch, level): everything a peer remembers about one group formation,
kept for the last :data:`KEEP` epochs and pruned in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from dedloc_jax.averaging.group import GroupSpec, Member
from dedloc_jax.rounds.wire import Slot

KEEP = 4
"""Epochs a record outlives its slot: a late join or question about it still gets the answer."""


@dataclass
class LedGroup:
    """One group this peer leads: who joined, and whether it is still open."""

    slot: Slot
    me: Member
    max_size: int
    joined: dict[str, Member] = field(default_factory=dict)
    open: bool = True
    formed: trio.Event = field(default_factory=trio.Event)
    changed: trio.Event = field(default_factory=trio.Event)  # set when someone joins
    expected: set[str] = field(default_factory=set)
    # Of ``expected``, those no read of the registrations found: missing since the gathering.
    late: frozenset[str] = frozenset()
    spec: GroupSpec | None = None
    addrs: dict[str, list[str]] = field(default_factory=dict)  # what each joiner sent
    cross: bool = False  # the leader's view held other groups: members average across them
    state: bytes | None = None  # the state the leader steps from (None: not known)
    share: float = 0.0  # an equal share of the target among the peers expected (claims.py)


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
    share: float = 0.0
    """The target's samples over the peers expected at the slot, us counted (claims.py)."""
    leading: LedGroup | None = None
    grouped: bool = False
    """This peer holds the spec of a group of 2+ (led or joined): told to members that its
    leader refused with a closed group, which believe the refusal only then."""
    refused: str | None = None
    """The leader that refused our join as its group closed (believed or not): told to the
    members it took, which leave a leader that refused more of their group than it took."""
    waiting: tuple[trio.CancelScope, tuple[str, ...]] | None = None
    """Our join that waits for a leader's spec, and our planned group: cancelled once enough
    of the group say that leader refused them (``Matchmaker._complained``)."""
    knocking: set[str] = field(default_factory=set)
    """Peers whose join waits for us to decide (they planned us as their leader): a plan that
    leaves us alone leads them instead (``Matchmaker._planned``)."""
    complaints: dict[str, str] = field(default_factory=dict)
    """Members of our group that, asking us whom we follow, said a leader refused them as
    its group closed: member -> that leader."""
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


MAX_ASKED = 256
"""Records other peers' questions may create ahead of this peer's own rounds."""


class Slots:
    """This peer's slot records. Its own rounds make and prune them: a record goes once this
    peer's newest epoch is :data:`KEEP` past it. A question from another peer (a join, a
    cross query) may come before we register, so it may make a record too, but only near our
    own epochs and at most :data:`MAX_ASKED` of them: a query naming a far epoch must neither
    prune the rounds in progress nor grow the table."""

    def __init__(self) -> None:
        self._records: dict[Slot, SlotRecord] = {}
        self._newest: int | None = None  # the newest epoch of a round of our own

    def __getitem__(self, slot: Slot) -> SlotRecord:
        """The record of a slot this peer works on (made if new; older ones pruned)."""
        epoch = slot[0]
        if self._newest is None or epoch > self._newest:
            self._newest = epoch
            for old in [s for s in self._records if s[0] < epoch - KEEP]:
                del self._records[old]
        return self._make(slot)

    def asked(self, slot: Slot) -> SlotRecord:
        """The record another peer's question about ``slot`` waits on. Outside ``KEEP`` epochs
        of our newest, or past ``MAX_ASKED`` records, it is a record of nobody's: it tells that
        we decided nothing there, at once."""
        record = self._records.get(slot)
        if record is not None:
            return record
        newest = self._newest
        near = newest is None or abs(slot[0] - newest) <= KEEP
        if near and len(self._records) < MAX_ASKED:
            return self._make(slot)
        record = SlotRecord()
        record.opened.set()
        record.settled.set()
        return record

    def _make(self, slot: Slot) -> SlotRecord:
        record = self._records.get(slot)
        if record is None:
            record = self._records[slot] = SlotRecord()
        return record

    def get(self, slot: Slot) -> SlotRecord | None:
        """The record, if this peer has one (without making it)."""
        return self._records.get(slot)
