"""Matchmaking: the peers of an epoch agree on averaging groups and one GroupSpec per group.

1. Each peer that is ready to average at epoch ``e`` registers (a signed subkey, with the
   samples it brings) under ``<run_id>.group.<e>`` and waits one matchmaking window, so that
   peers who learned of the target a refresh later can register too; while the registered
   samples fall short of the target (a decision made on an extrapolated estimate), it waits a
   little more, within a bound.
2. It reads the registrations and runs :func:`~dedloc_jax.rounds.plan.plan_groups` (capped,
   reshuffled per epoch). The first member of its group is the group's leader.
3. Followers send ``collab.join`` to their leader, a call that returns once the leader has
   formed the group. The leader accepts joins for one window (longer, within a bound, while a
   peer it saw registered in its group has not joined), then answers every join with the
   same :class:`GroupSpec` (members = itself + those who joined in time, each with its measured
   bandwidth and sample count, plus the share split from the load-balancing LP).

Above ``max_group_size`` peers an epoch has several groups; each group's mean then goes through
a second round across groups (level 1, one group of representatives, see
:mod:`dedloc_jax.rounds.across`), formed the same way under ``<run_id>.group.<e>.x``. The leader
tells its members whether its view of the epoch held other groups (``cross``).

Only the leader decides, so two peers that saw different registrations cannot form
conflicting specs: at worst a peer that joined nobody in time averages alone (no deadlock: every
wait is bounded by a cancel scope). Clients reach leaders by dialing out, like everyone else.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from dedloc_jax.averaging.errors import GroupError
from dedloc_jax.averaging.group import GroupSpec, Member
from dedloc_jax.rounds.context import PeerSide
from dedloc_jax.rounds.deadlines import Deadlines
from dedloc_jax.rounds.following import (
    FollowsGone,
    Joining,
    LeaderClosed,
    LeaderGone,
    Misled,
    ask_leader,
    follow,
)
from dedloc_jax.rounds.grouping import group_seed
from dedloc_jax.rounds.leading import answer_join, lead
from dedloc_jax.rounds.plan import plan_groups, same_state
from dedloc_jax.rounds.plan import representatives as plan_representatives
from dedloc_jax.rounds.slots import LedGroup, Slots
from dedloc_jax.rounds.wire import (
    JOIN,
    LEADER,
    Slot,
    group_key,
    member_from_wire,
    state_from_wire,
)
from dedloc_jax.rounds.wire import member_to_wire as _member_to_wire
from dedloc_jax.rounds.wire import slot_of as _slot_of
from dedloc_jax.run_dht import RunDHT
from p2p.dht import InvalidRecordError, KeyFollower, follower_replicas
from p2p.dht.records import owner_marker, owner_markers
from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr
from p2p.node import Node
from p2p.rpc import CallContext

log = logging.getLogger(__name__)

CROSS_CAP = 4096
"""Representatives in one level-1 group: all of them (n / max_group_size of an epoch's n peers)."""
MAX_LEADER_FALLBACKS = 2
"""Members after a dead leader that its followers try as leader, in group order."""
FALLBACK_ASKS = 4
"""Times a follower asks the member after a dead leader, a quarter window apart, while that
member still follows the dead leader (it falls back once it finds it gone, as we did)."""
CLOSED_ASKS = 8
"""Members of our group (the first in rank) asked whether a leader that refused us as its
group closed holds them: one says yes in an honest race (level 1 plans thousands)."""
MIN_WITNESSES = 2
"""Members of our planned group that must say a leader refused them before we leave it: one
member's word against the leader's is a draw (a lone liar would strand every honest leader of
its groups), two independent ones outweigh it."""
_MAX_LEARNED = 4096  # peers whose last addresses we remember (then start over)
MAX_NO_SHOW_SKIP = 32
"""The most epochs a peer that kept missing its expected registrations goes unwaited for."""
FEW_MISSING = 4
"""Expected peers still to register that a gathering asks at once whether they can be
reached (more are asked half a window in): the last few are most often the slowest, or one
that left the run; asking a whole epoch's peers as the first one gathers would be n**2 calls."""
NEWCOMER_WAIT_SHARE = 0.01
"""A newcomer (a peer not yet waited for, see :meth:`Matchmaker._earned`) is waited for one
window when that window is at most this share of an epoch: a fresh identity then costs a round
at most 1% of its time, while a DiLoCo newcomer, whose first outer round carries hours of its
computing, is not left out for noticing the target a second late."""


def _outweighs(said: int, held: int | None, group: int) -> bool:
    """Whether ``said`` witnesses that a leader refused them (each a member of our planned
    group of ``group`` peers without the leader, us counted) outweigh its spec, which holds
    ``held`` of that group (None: unknown, no spec yet). At least :data:`MIN_WITNESSES`, and
    more than it took or more than a third of the group: an honest leader refuses a member
    only when views differ, and a leader that took half of four and refused the other half
    was believed. A lone claimant (one member, or a leader's single refusal) is not enough."""
    if said < MIN_WITNESSES:
        return False
    return (held is not None and said > held) or 3 * said > group


# -- registration: a peer ready for a slot stores what it brings under the slot's key, reads
# the others', and asks the expected peers it has not read what they are doing, so that it
# stops waiting for those that will bring no samples. Here, beside its one user: a round's
# walk goes from the matchmaker to the DHT without stepping out and back.


async def register(
    dht: RunDHT, peer: PeerID, key: str, registration: dict[str, Any], ttl: float
) -> None:
    """Store our ``registration`` under the slot's ``key`` (our signed subkey) for ``ttl``
    seconds. A failed store is logged, not raised: peers that read the key miss us, and the
    leaders' questions to expected peers still find us."""
    try:
        await dht.store(
            key,
            registration,
            dht.now() + ttl,
            subkey=owner_marker(peer),
            replicas=follower_replicas(dht.config),
        )
    except (P2PError, InvalidRecordError) as e:
        log.warning("could not register for matchmaking: %s", e)


async def read_registrations(
    registry: KeyFollower,
    me: str,
    *,
    sweep: bool = False,
    states: dict[str, bytes | None],
    learn: Callable[[str, Any], None],
) -> dict[str, Member]:
    """The peers registered under ``registry``'s key (``me`` left out) and what each brings;
    ``sweep`` reads all the key's holders (before a decision, when expected peers are
    missing). ``states`` gets the state each one steps from; ``learn(peer, registration)``
    sees each registration (its addresses). A failed read is an empty one: the caller polls
    again, and a malformed registration is skipped."""
    try:
        value = await registry.get(sweep=sweep)
    except P2PError as e:
        log.warning("could not read matchmaking registrations: %s", e)
        return {}
    found: dict[str, Member] = {}
    if not isinstance(value, dict):
        return found
    for subkey, item in value.items():
        names = owner_markers(subkey)
        reg = item.value
        if len(names) != 1 or names[0] == me or not isinstance(reg, dict):
            continue
        try:
            member = member_from_wire(names[0], reg.get("member"))
            state = state_from_wire(reg.get("state"))
        except GroupError as e:
            log.info("ignoring a malformed registration of %s: %s", names[0], e)
            continue
        found[names[0]] = member
        states[names[0]] = state
        learn(names[0], reg)
    return found


async def drop_gone(
    ask_leader: Callable[[str, float], Awaitable[Any]],
    expected: set[str],
    registered: Callable[[], set[str]],
    probed: dict[str, Member],
    states: dict[str, bytes | None],
    window: float,
) -> None:
    """Ask each expected peer that has not registered whether it still gathers
    registrations or computes (undecided: keep waiting for it, and ask again a window
    later). One that gathers registrations sends its own, which our read of the key
    missed: it goes into ``probed`` (and the state it steps from into ``states``) and is not
    asked again. Drop a peer from ``expected`` when it cannot be reached (crashed, or across a
    partition) or has already decided on a group that our view of the registrations missed:
    either way no samples of it will come. ``ask_leader(peer, timeout)``: the peer's answer
    to whom it follows at this slot (raises P2PError). Runs until cancelled."""

    async def ask(peer: str) -> None:
        try:
            answer = await ask_leader(peer, window)
        except P2PError as e:
            log.debug("expected peer %s is gone: %s", peer[:8], e)
            expected.discard(peer)
            return
        if not isinstance(answer, dict) or answer.get("decided") is not False:
            expected.discard(peer)  # it decided on a group that our view missed
        elif not _take_registration(peer, answer, probed, states):
            expected.discard(peer)

    while True:
        missing = expected - registered() - set(probed)
        if missing:
            async with trio.open_nursery() as nursery:
                for peer in sorted(missing):
                    nursery.start_soon(ask, peer)
        await trio.sleep(window)


def _take_registration(
    peer: str, answer: dict, probed: dict[str, Member], states: dict[str, bytes | None]
) -> bool:
    """Take the registration ``peer`` sent with its answer (it gathers registrations: our read
    of the key missed its own) into ``probed`` and ``states``; False when it is malformed."""
    if "member" not in answer:
        return True
    try:
        probed[peer] = member_from_wire(peer, answer["member"])
        states[peer] = state_from_wire(answer.get("state"))
    except GroupError as e:
        log.info("ignoring the malformed registration %s sent: %s", peer[:8], e)
        return False
    return True


async def drop_unreachable(
    ask_leader: Callable[[str, float], Awaitable[Any]],
    expected: set[str],
    registered: Callable[[], set[str]],
    window: float,
    probed: dict[str, Member],
    states: dict[str, bytes | None],
) -> None:
    """While the gathering waits, ask each expected peer that has not registered whom it
    follows, once at most :data:`FEW_MISSING` are missing or half a window in (once: a peer
    that answers is there); drop from ``expected`` only those that cannot be reached. A peer
    that left the run keeps its "computing" progress record for up to its lifetime (a live
    peer's may be as old: it renews it only when others' extrapolation drifts), and the
    gathering waited its two windows for it, then more for the samples its record claimed.
    Any answer keeps a peer waited for: a slow or hostile one gains nothing, and one that
    drops itself only loses its place. One that sends its registration (our read missed it)
    goes into ``probed`` (its state into ``states``), as :func:`drop_gone` takes it. Runs
    until cancelled."""

    async def ask(peer: str) -> None:
        try:
            answer = await ask_leader(peer, window)
        except P2PError as e:
            log.debug("expected peer %s cannot be reached: %s", peer[:8], e)
            expected.discard(peer)
            return
        if isinstance(answer, dict) and answer.get("decided") is False:
            _take_registration(peer, answer, probed, states)

    start = trio.current_time()
    asked: set[str] = set()
    async with trio.open_nursery() as nursery:
        while True:
            missing = expected - registered() - asked
            if len(missing) <= FEW_MISSING or trio.current_time() - start >= window / 2:
                for peer in sorted(missing):
                    asked.add(peer)
                    nursery.start_soon(ask, peer)
            await trio.sleep(window / 8)  # (the gathering's reads: what registered() sees)


@dataclass
class _Gathering:
    """One slot's registrations as this peer gathers them."""

    registry: KeyFollower
    me: Member
    target: float
    expected: set[str]
    deadlines: Deadlines
    start: float
    others: dict[str, Member] = field(default_factory=dict)
    states: dict[str, bytes | None] = field(default_factory=dict)  # each registered peer's
    # Whether a registered peer's contribution weighed nothing lately: its samples count 0.
    weightless: Callable[[str], bool] = lambda peer: False
    newcomers: frozenset[str] = frozenset()  # unearned peers waited for one window
    # Registrations the expected peers sent with their answers (our reads missed them).
    probed: dict[str, Member] = field(default_factory=dict)

    def short_of_target(self) -> bool:
        """Whether waiting can still bring the samples the target needs. Registered peers
        stopped accumulating: more can only come from expected peers not registered yet (with
        all of them in there is nothing to wait for) or, when the tracker expects nobody, from
        peers it has not seen yet (worth a short wait only)."""
        now = trio.current_time()
        others = (m.weight for p, m in self.others.items() if not self.weightless(p))
        got = self.me.weight + sum(others)
        if got >= self.target or now >= self.start + self.deadlines.max_wait:
            return False
        if self.expected:
            return not self.expected <= set(self.others)
        return now - self.start < 2 * self.deadlines.window


@dataclass(frozen=True)
class PlannedGroup:
    """The group a peer planned for ``slot`` from the registrations (:meth:`Matchmaker.
    plan_group`): its members in rank order (``mine``; the first leads) and the peers it
    waits for that registered late; ``deadlines``: the round's."""

    slot: Slot
    mine: tuple[str, ...]
    late: frozenset[str]
    deadlines: Deadlines
    state: bytes | None  # the state we step from
    gathering: _Gathering  # the registrations it was planned from
    planned: frozenset[str]  # whom the groups were sized for


class Matchmaker:
    """Forms averaging groups for one peer; registers the ``collab.join`` handler.

    ``context``: what the round reads from its peer (default: a peer that knows nothing);
    ``slots``: the peer's slot records, shared with its :class:`~dedloc_jax.rounds.across.
    AcrossGroups`; ``deadlines``: those of a round that passes none to :meth:`form_group` (a
    fixed window); ``eager``: every round matchmakes eagerly, not only those whose deadlines
    say so (``Deadlines.eager``: every peer the round expects checks mid-step whether to
    average). Eagerly, the gathering asks the expected peers still missing whether they can
    be reached (:func:`drop_unreachable`) and reads the registrations as it begins, and the
    next epoch's key is looked up ahead. Not otherwise: a peer that looks only between
    micro-steps registers up to a micro-step after the others, and a gathering that closes
    at its first read would plan without it."""

    def __init__(
        self,
        node: Node,
        dht: RunDHT,
        run_id: str,
        *,
        max_group_size: int,
        context: PeerSide = PeerSide(),
        slots: Slots | None = None,
        deadlines: Deadlines = Deadlines(window=1.0),
        eager: bool = False,
    ) -> None:
        self.node = node
        self.dht = dht
        self.run_id = run_id
        self.max_group_size = max_group_size
        self.peer_id = str(node.peer_id)
        self.context = context
        self.eager = eager
        self.slots = Slots() if slots is None else slots
        # The addresses last learned per peer: every poll of the registrations reads them all
        # again, so parse only what changed.
        self._learned: dict[str, tuple[str, ...]] = {}
        # Expected peers that did not register in time: peer -> (epoch of its last miss,
        # misses in a row); the peers we ever read a registration of; and those we read only
        # after we had planned, that took part in that matchmaking. See :meth:`_earned`.
        self._no_shows: dict[str, tuple[int, int]] = {}
        self._registered: set[str] = set()
        self._late: set[str] = set()
        # Peers that served nothing we asked (a join as our leader, a question as a member):
        # peer -> (epoch of the last failure, failures in a row); those that held our join
        # until the timeout -> that epoch; and leaders whose refusals led nowhere -> (epoch,
        # in a row). See :meth:`_serves`, :meth:`_shunned` and :meth:`_note_misled`.
        self._unserved: dict[str, tuple[int, int]] = {}
        self._hung_at: dict[str, int] = {}
        self._misled: dict[str, tuple[int, int]] = {}
        # (epoch, time) of our first level-0 gathering at the newest epoch and at the one
        # before (a plan made ahead of the target gathers again): how long epochs take.
        self._gathered: tuple[int, float] | None = None
        self._gathered_before: tuple[int, float] | None = None
        self.deadlines = deadlines
        # Answers to others' joins follow the deadlines of the round this peer began last.
        self._answering = deadlines

    def _eager(self, deadlines: Deadlines) -> bool:
        """Whether a round with ``deadlines`` matchmakes eagerly (see the class)."""
        return self.eager or deadlines.eager

    def register(self) -> None:
        self.node.add_handler(JOIN, self._handle_join)
        self.node.add_handler(LEADER, self._handle_leader)

    def _choose(self, slot: Slot, leader: str | None) -> None:
        record = self.slots[slot]
        record.decided, record.leader = True, leader
        if leader != self.peer_id:  # a join that waits for us is answered (redirected) now
            record.opened.set()

    def needs_cross(self, epoch: int) -> bool:
        """Whether this peer's level-0 group at ``epoch`` was one of several (its leader's
        view): the group's mean is then averaged across groups (:mod:`dedloc_jax.rounds.across`)."""
        record = self.slots.get((epoch, 0))
        return record is not None and record.cross

    def decline(self, epoch: int) -> None:
        """This peer takes no part in ``epoch``'s round across groups (it does not represent
        a group, or its group needs none): a leader waiting for it stops at once."""
        record = self.slots.get((epoch, 1))
        if record is None or not record.decided:
            self._choose((epoch, 1), None)

    def representatives(self, epoch: int) -> set[str]:
        """Who represents the level-0 groups of ``epoch`` in this peer's view: each group's
        first member that sends a vector (aux peers hold none)."""
        record = self.slots.get((epoch, 0))
        view = record.view if record is not None else None
        return plan_representatives(*(view or ([], {})))

    def _remember(self, epoch: int, cross: bool, view: Any = None) -> None:
        record = self.slots[(epoch, 0)]
        record.cross = cross
        if view is not None:
            record.view = view

    async def _handle_leader(self, ctx: CallContext, request: Any) -> Any:
        """Whom this peer follows at an epoch: ``{"decided": False}`` while it is still
        gathering registrations, else ``{"decided": True, "leader": ID or None, "grouped":
        whether it holds that leader's spec}`` (:meth:`_closed_group`), and ``"refused"``:
        the leader that refused it as its group closed, if one did (:meth:`_split`); with its
        registration (``"member"``) once it registered, which the asker's read of the key
        may have missed."""
        slot = _slot_of(request)
        if self.context.admit is not None:
            await self.context.admit(ctx.remote_peer, None)
        self._showed_up(str(ctx.remote_peer), slot)
        record = self.slots.get(slot)
        if slot[1] == 0 and (record is None or record.registered is None):
            # Its round forms while we compute: our table may be stale, so read it anew from
            # every holder (at most one such read per regular read).
            self.context.forming(slot[0])
        if record is None:
            return {"decided": False}
        refused = request.get("refused")
        if isinstance(refused, str):
            self._complained(slot, str(ctx.remote_peer), refused)
        answer: dict[str, Any] = {"decided": record.decided}
        if record.decided:
            answer["leader"], answer["grouped"] = record.leader, record.grouped
        if record.refused is not None:
            answer["refused"] = record.refused
        if record.registered is not None:  # the asker's read of the key may miss ours
            answer["member"] = record.registered
            state = self.context.state_of(slot[0])  # ours stays until we step, after this round
            if state is not None:
                answer["state"] = state
        return answer

    @property
    def window(self) -> float:
        return self.deadlines.window

    @property
    def max_wait(self) -> float:
        """The longest a peer waits for others to register (then it goes with what it has)."""
        return self.deadlines.max_wait

    @property
    def member_wait(self) -> float:
        """The longest a leader waits for a member it saw registered in its group. Members
        decide about when the leader does, from nearly the same registrations, so one that
        has not joined after a few windows saw other groups (or died), and ``max_wait`` would
        hold the whole group."""
        return self.deadlines.member_wait

    async def _registrations(
        self, registry: KeyFollower, *, sweep: bool = False, states: dict[str, bytes | None]
    ) -> dict[str, Member]:
        found = await read_registrations(
            registry, self.peer_id, sweep=sweep, states=states, learn=self._learn_addrs
        )
        return {p: m for p, m in found.items() if not self.context.banned(p)}

    async def form_group(
        self,
        epoch: int,
        me: Member,
        *,
        target: float = 0.0,
        expected: set[str] | frozenset[str] = frozenset(),
        level: int = 0,
        deadlines: Deadlines | None = None,
    ) -> GroupSpec | None:
        """The group this peer averages with at ``epoch``, or None if it must go alone.

        ``deadlines``: the round's (from its predictions; None: the matchmaker's own); its
        waits, and its answers to others' joins until it begins another round, follow them.

        ``level`` 1 forms the group of representatives that averages the level-0 groups'
        means (uncapped, under its own key); see :meth:`needs_cross`.

        Registration stays open until every ``expected`` peer (those the tracker sees at this
        epoch) has registered, for two windows at most (one when nobody is expected); then,
        while the registered peers hold fewer than ``target`` samples (this peer may have
        decided early on an extrapolated estimate), longer while expected peers are missing
        (up to :attr:`max_wait`), or two windows when nobody is expected.
        """
        try:
            planned = await self.plan_group(
                epoch, me, target=target, expected=expected, level=level, deadlines=deadlines
            )
            return None if planned is None else await self.join_group(planned, me)
        finally:
            # This peer's part in the epoch is over: a late join is answered at once.
            self.slots[(epoch, level)].opened.set()

    async def plan_group(
        self,
        epoch: int,
        me: Member,
        *,
        target: float = 0.0,
        expected: set[str] | frozenset[str] = frozenset(),
        level: int = 0,
        deadlines: Deadlines | None = None,
        ahead: bool = False,
    ) -> PlannedGroup | None:
        """:meth:`form_group`'s first part: register, read the others' registrations and plan
        the groups; None: this peer goes alone. It can run ahead of the target
        (:mod:`~dedloc_jax.rounds.early`: ``me.weight`` is then the samples we expect to
        hold); :meth:`join_group` then leads or joins with the weight we hold. ``ahead``: a
        plan alone is not final (a group of us only, for :meth:`join_group` to plan anew)."""
        expected = {p for p in expected if not self.context.banned(p)}  # nobody waits for them
        unearned: frozenset[str] = frozenset()
        deadlines = self.deadlines if deadlines is None else deadlines
        if level == 0:
            if self._eager(deadlines):
                self.node.start_soon(self._locate, group_key(self.run_id, epoch + 1, level))
            unearned = frozenset(p for p in expected if not self._earned(p, epoch))
            expected -= unearned
        self._answering = deadlines
        return await self._plan_group(
            (epoch, level), me, target, expected, deadlines, ahead, unearned=unearned
        )

    async def join_group(
        self, planned: PlannedGroup, me: Member, *, reread: bool = False
    ) -> GroupSpec | None:
        """:meth:`form_group`'s second part: lead ``planned``'s group or join its leader, with
        ``me`` (its weight, the samples we hold now, goes into the spec). ``reread``: first
        read the registrations again and plan anew (planned ahead of the target, a peer that
        registered since, a newcomer, would otherwise be refused by a leader that closed its
        group as soon as every peer it planned with had joined)."""
        self._answering = planned.deadlines
        try:
            if reread:
                g = planned.gathering
                g.others |= await self._registrations(g.registry, states=g.states)
                again = self._planned(planned.slot, me, planned.state, g, planned.planned)
                if again is None:
                    return None
                planned = again
            spec = await self._lead_or_follow(
                planned.slot,
                me,
                list(planned.mine),
                set(planned.late),
                planned.deadlines,
                states=planned.gathering.states,
            )
            self._took_part({m.peer_id for m in spec.members} if spec is not None else set())
            return spec
        finally:
            self.slots[planned.slot].opened.set()  # our part in the slot is over

    async def _plan_group(
        self,
        slot: Slot,
        me: Member,
        target: float,
        expected: set[str] | frozenset[str],
        deadlines: Deadlines,
        ahead: bool = False,
        *,
        unearned: frozenset[str] = frozenset(),
    ) -> PlannedGroup | None:
        epoch, level = slot
        if level == 0:
            self._remember(epoch, False)
        if self._too_late(slot, set(expected) - {self.peer_id}):
            return None
        my_state = await self._register(slot, me, target, expected, deadlines)
        # Who the tracker saw at this epoch, before any is dropped: groups are sized for them.
        planned = set(expected) | {self.peer_id}
        expected = set(expected) - {self.peer_id}
        # Polled several times per epoch by every peer: fetch only new registrations. A
        # registration lapses on time even when we hear from nobody (no grace): grouping with
        # a peer whose registration expired costs a failed round.
        registry = self.dht.follow(
            group_key(self.run_id, epoch, level),
            relocate_interval=deadlines.relocate_interval,
            lapse_grace=0.0,
        )
        newcomers = frozenset()
        if level == 0:
            newcomers = unearned if self._long_epochs(epoch, deadlines.window) else frozenset()
            if self._gathered is None or epoch > self._gathered[0]:
                self._gathered_before, self._gathered = self._gathered, (epoch, trio.current_time())
        gathering = _Gathering(
            registry,
            me,
            target,
            expected,
            deadlines,
            trio.current_time(),
            weightless=self.context.weightless,
            newcomers=newcomers - {self.peer_id},
        )
        if not await self._gather(slot, gathering):
            return None
        if not await self._wait_for_target(slot, gathering):
            return None
        if level == 0:
            self._note_shows(epoch, expected, set(gathering.others))
            unseen = (unearned | expected) - set(gathering.others)
            if unseen:
                self.node.start_soon(self._read_late, slot, gathering, frozenset(unseen))
        if expected - set(gathering.others):
            log.debug(
                "%s: going on after %.1f s without expected peers %s",
                slot,
                trio.current_time() - gathering.start,
                sorted(expected - set(gathering.others)),
            )
        return self._planned(slot, me, my_state, gathering, frozenset(planned), ahead)

    def _planned(
        self,
        slot: Slot,
        me: Member,
        my_state: bytes | None,
        gathering: _Gathering,
        planned: frozenset[str],
        ahead: bool = False,
    ) -> PlannedGroup | None:
        """Our group from the registrations ``gathering`` holds (None: alone; ``ahead``: a
        group of us only, not final: a peer that registers by the target may still join)."""
        epoch, level = slot
        others = gathering.others
        modes = {p: m.mode for p, m in others.items()} | {self.peer_id: me.mode}
        plan = plan_groups(
            self.peer_id,
            my_state,
            others,
            gathering.states,
            modes,
            planned=set(planned),
            expected=gathering.expected,
            seed=group_seed(self.run_id, epoch),
            cap=self.max_group_size if level == 0 else CROSS_CAP,
            level=level,
        )
        if plan.apart:
            log.info(
                "%s: %d of %d registered peers step from another state: not averaging with them",
                slot,
                len(plan.apart),
                len(others),
            )
        if level == 0:
            self._remember(epoch, len(plan.groups) > 1, (plan.groups, modes))
        knocking = self._knocking(slot, my_state, gathering) if not ahead else frozenset()
        if len(plan.mine) == 1 and not plan.late and knocking:
            # Others planned us as their leader and their joins wait for us: our view (a
            # registration they do not count, another number of groups) left us alone, and
            # going alone sent them to the next in rank, without us. Lead them instead.
            groups = [[p for p in g if p not in knocking] for g in plan.groups]
            groups = [[self.peer_id, *sorted(knocking)]] + [
                g for g in groups if g and self.peer_id not in g
            ]
            self._remember(epoch, len(groups) > 1, (groups, modes))
            log.info("%s: alone in our plan, but %d peer(s) join us: leading", slot, len(knocking))
            return PlannedGroup(
                slot, (self.peer_id,), knocking, gathering.deadlines, my_state, gathering,
                planned,
            )  # fmt: skip
        if len(plan.mine) == 1 and not plan.late:
            log.debug(
                "%s: alone in our group of %d (%d registrations read, %d planned, %d expected)",
                slot,
                len(plan.groups),
                len(others),
                len(planned),
                len(gathering.expected),
            )
            if ahead:  # alone ahead of the target: deciding it then refused a newcomer's join
                return PlannedGroup(
                    slot, (self.peer_id,), frozenset(), gathering.deadlines, my_state,
                    gathering, planned,
                )  # fmt: skip
            self._choose(slot, None)
            return None
        return PlannedGroup(
            slot,
            tuple(plan.mine),
            frozenset(plan.late),
            gathering.deadlines,
            my_state,
            gathering,
            planned,
        )

    async def _locate(self, key: str) -> None:
        """Look up the nodes that will hold ``key``, the next epoch's registrations, while this
        peer computes toward it: registering at the target is then one round trip, not a
        lookup first (it is on every peer's path through the last peer to stop)."""
        try:
            await self.dht.locate(key, replicas=follower_replicas(self.dht.config))
        except P2PError as e:
            log.debug("could not look up %s ahead: %s", key, e)

    async def _register(
        self,
        slot: Slot,
        me: Member,
        target: float,
        expected: set[str] | frozenset[str],
        deadlines: Deadlines,
    ) -> bytes | None:
        """Register for ``slot`` (with the state we step from, which it returns)."""
        epoch, level = slot
        record = self.slots[slot]
        record.registered = _member_to_wire(me)
        record.share = target / (1 + len(set(expected) - {self.peer_id}))
        registration: dict[str, Any] = {
            "member": record.registered,
            "addrs": [str(a) for a in self.node.addrs],
        }
        my_state = self.context.state_of(epoch)
        if my_state is not None:
            registration["state"] = my_state
        key = group_key(self.run_id, epoch, level)
        await register(self.dht, self.node.peer_id, key, registration, deadlines.registration_ttl)
        return my_state

    async def _gather(self, slot: Slot, g: _Gathering) -> bool:
        """Read registrations until every expected peer is in or the window ends (two windows
        while some are expected), not waiting for those that cannot be reached
        (:func:`drop_unreachable`); False when the others moved past the epoch meanwhile."""
        async with trio.open_nursery() as nursery:
            if g.expected and self._eager(g.deadlines):
                ask = functools.partial(self._ask_leader, slot)
                others = lambda: set(g.others)  # noqa: E731
                nursery.start_soon(
                    drop_unreachable,
                    ask,
                    g.expected,
                    others,
                    g.deadlines.window,
                    g.probed,
                    g.states,
                )
            gathered = await self._read_until_gathered(slot, g)
            nursery.cancel_scope.cancel()
        return gathered

    async def _read_until_gathered(self, slot: Slot, g: _Gathering) -> bool:
        window = g.deadlines.window
        # (eager: the first read at once: the last peer to stop finds the others in)
        poll = 0.0 if self._eager(g.deadlines) else window / 8
        while True:
            # Polling only helps to close early once every expected peer registered; with
            # nobody expected, one read at the end of the window does (a read is a lookup).
            # (Deadlines as instants: sleeping ``window - elapsed`` could wake one ulp short
            # of ``start + window``, and the loop then slept 0 s forever in virtual time.)
            if g.expected:
                await trio.sleep(poll)
            else:
                await trio.sleep_until(g.start + window)
            poll = window / 8
            g.others = await self._registrations(g.registry, states=g.states) | g.probed
            if self._too_late(slot, g.expected):
                return False
            everyone = bool(g.expected) and g.expected <= set(g.others)
            # A peer the tracker sees at this epoch gets two windows: it is computing and will
            # register, but on a busy machine it may notice the target a window late.
            limit = 2 * window if g.expected else window
            # Newcomers (long epochs only) get one window.
            now = trio.current_time()
            waiting = not g.newcomers <= set(g.others) and now < g.start + window
            if (everyone and not waiting) or now >= g.start + limit:
                if not everyone:
                    # Deciding without some: first read every holder of the key. The one a
                    # read asks may lack registrations the others hold (writers store on
                    # the nearest nodes they found, and their views differ).
                    found = await self._registrations(g.registry, sweep=True, states=g.states)
                    g.others = found | g.probed
                    everyone = bool(g.expected) and g.expected <= set(g.others)
                break
        if g.expected and not everyone:
            log.debug(
                "%s: %d of %d expected peers registered after %.1f s",
                slot,
                len(g.expected & set(g.others)),
                len(g.expected),
                trio.current_time() - g.start,
            )
        return True

    async def _wait_for_target(self, slot: Slot, g: _Gathering) -> bool:
        """Keep reading while waiting can still bring the samples the target needs (see
        :meth:`_Gathering.short_of_target`), asking the missing expected peers meanwhile;
        False when the others moved past the epoch meanwhile."""
        window = g.deadlines.window
        too_late = False
        probed = g.probed  # registrations the expected peers told us
        async with trio.open_nursery() as nursery:
            if g.short_of_target():
                # Expected peers that crashed or sit across a partition would hold the group
                # for max_wait while their stale progress records live: ask the missing ones.
                ask = functools.partial(self._ask_leader, slot)
                nursery.start_soon(
                    drop_gone, ask, g.expected, lambda: set(g.others), probed, g.states, window
                )
            while g.short_of_target():
                await trio.sleep(window / 2)
                found = await self._registrations(g.registry, sweep=True, states=g.states)
                g.others = found | probed
                if self._too_late(slot, g.expected):
                    too_late = True
                    break
            nursery.cancel_scope.cancel()
        g.others = g.others | probed
        return not too_late

    async def _lead_or_follow(
        self,
        slot: Slot,
        me: Member,
        mine: list[str],
        late: set[str],
        deadlines: Deadlines,
        *,
        states: Mapping[str, bytes | None] | None = None,
    ) -> GroupSpec | None:
        """Lead or follow in our planned group ``mine`` (``states``: the state each member
        registered with). A leader that died after registering would leave its whole group
        alone: each of its followers then tries the next member, the same one on every
        follower (bounded). So does a leader whose refusal leads nowhere (a closed group no
        member of ours is in, a redirect to a peer that serves no join): a hostile one that
        ranks first sent its whole group home alone."""
        cap = self.max_group_size if slot[1] == 0 else CROSS_CAP
        # Leaders we skip count as found gone: a redirect to one is asked again, then left.
        shunned = {p for p in (*self._hung_at, *self._misled) if self._shunned(p, slot[0])}
        gone = set(shunned)
        for k, leader in enumerate(mine[: 1 + MAX_LEADER_FALLBACKS]):
            if leader != self.peer_id and leader in gone:
                # It held our last join until the timeout, or its refusals led nowhere: the
                # others fall back to the same member once they find it gone, so skip the wait.
                continue
            if leader == self.peer_id and k == 0:  # undecided until it asked the others
                return await self._lead_or_join(
                    slot, me, mine, deadlines, cap, late=late, states=states
                )
            self._choose(slot, leader)
            if leader == self.peer_id:
                expected = set(mine[k + 1 :]) | late
                return await self._lead(slot, me, deadlines, cap, expected=expected, late=late)
            for ask in range(FALLBACK_ASKS):
                try:
                    return await self._follow(
                        slot, me, leader, deadlines, gone=frozenset(gone), members=mine
                    )
                except LeaderGone as e:
                    self._gone(slot[0], e)
                    gone.add(leader)
                    break
                except FollowsGone as e:
                    if ask + 1 < FALLBACK_ASKS:
                        await trio.sleep(deadlines.window / 4)
                        continue
                    log.info("%s: %s kept following a gone leader", slot, leader[:8])
                    if e.target not in shunned:  # (found gone in this slot: it may be late)
                        self._choose(slot, None)
                        return None
                    # One we shun since an earlier round: a hostile member sends every join
                    # there (its first try cost the timeout), so it counts as gone.
                    self._note_misled(leader, slot[0])
                    gone.add(leader)
        self._choose(slot, None)
        return None

    def _gone(self, epoch: int, e: LeaderGone) -> None:
        """Remember a leader that did not serve our join at ``epoch`` (and, when it sent us to
        another that did not, both)."""
        if isinstance(e, Misled):
            self._note_misled(e.leader, epoch)
            if e.target is not None:  # (it may be the leader itself: a redirect loop)
                self._note_unserved(e.target, epoch, hung=e.target_hung)
        else:
            self._note_unserved(e.leader, epoch, hung=e.hung)

    async def _read_late(self, slot: Slot, g: _Gathering, unseen: frozenset[str]) -> None:
        """Read ``slot``'s registrations once more, past the longest wait for a peer that we
        expect (two windows), for the ``unseen`` peers we planned without (unearned, see
        :meth:`_earned`, or expected and missing): others learn that a newcomer registers only
        from the reads they make before they plan, so one late at its first round was left
        out of every later one. Each that registered since, was never seen registering in
        time, and took part in the matchmaking (it says whom it followed: it joined, or was
        refused, or went alone) is waited for from the next round on, once (then it is in
        ``_late``: a miss forfeits :data:`MAX_NO_SHOW_SKIP` epochs); a ghost that only stores
        registrations earns nothing."""
        window = g.deadlines.window
        await trio.sleep_until(g.start + 3 * window)  # the registration lives 16 windows + 35 s
        found = await self._registrations(g.registry, sweep=True, states={})
        late = sorted((unseen & set(found)) - self._late - self._registered)

        async def took_part(peer: str) -> None:
            try:
                answer = await self._ask_leader(slot, peer, window)
            except P2PError as e:
                log.debug(
                    "%s: %s registered late and did not say whom it followed: %s", slot, peer[:8], e
                )
                return
            if isinstance(answer, dict) and answer.get("decided") is True:
                log.info(
                    "epoch %d: newcomer %s registered after we planned: waited for from now on",
                    slot[0],
                    peer[:8],
                )
                self._late.add(peer)
                self._no_shows.pop(peer, None)  # (marked when it missed the window we planned in)

        async with trio.open_nursery() as nursery:
            for peer in late:
                nursery.start_soon(took_part, peer)

    def _knocking(self, slot: Slot, state: bytes | None, g: _Gathering) -> frozenset[str]:
        """The peers whose join of level-0 ``slot`` waits for us to decide, at most a group's
        worth: not banned, and not registered with another state than ours (``state``; their
        join would be refused, and we would wait for them)."""
        record = self.slots.get(slot)
        if slot[1] != 0 or record is None:
            return frozenset()
        peers = sorted(
            p
            for p in record.knocking
            if not self.context.banned(p) and same_state(state, g.states.get(p))
        )
        return frozenset(peers[: self.max_group_size - 1])

    def _showed_up(self, peer: str, slot: Slot) -> None:
        """``peer``, which we planned ``slot`` without (it had not registered), joins or asks
        whom we follow there: it takes part, late. It is waited for from the next round on,
        once (as :meth:`_read_late` does): a peer refused by a group that formed before it
        came went home alone at the next epoch too, as nobody waited for it, and was grouped
        only from the one after (the refusal reached it after our late read). So is a peer we
        did not expect there at all, once we took part in the slot: a newcomer that loaded
        the state after our gathering began. A fresh identity that joins or asks costs the
        next round one wait (2 windows), then it is a no-show for ``MAX_NO_SHOW_SKIP`` epochs,
        as one that registers late and says whom it followed (:meth:`_read_late`)."""
        epoch, level = slot
        missed = self._no_shows.get(peer)
        if level != 0 or peer in self._late:
            return
        if missed is None:
            # (never expected there: unearned, it was left out of our next plan too, while
            # others, whose reads it made in time, planned with it)
            record = self.slots.get(slot)
            if peer in self._registered or record is None or record.registered is None:
                return
        elif missed[0] != epoch:
            return
        log.info("epoch %d: %s came after we planned: waited for from now on", epoch, peer[:8])
        self._late.add(peer)
        self._no_shows.pop(peer, None)

    def _earned(self, peer: str, epoch: int) -> bool:
        """Whether the round at ``epoch`` waits for ``peer``, which progress records say should
        register: a record costs nothing to publish, so a peer that publishes one and never
        registers would stall every round by the registration window. After ``k`` misses in a
        row it is not waited for during ``2**k - 1`` epochs (at most :data:`MAX_NO_SHOW_SKIP`),
        then given another chance; a registration clears it. A peer we never saw register gets
        no second chance until it does, or until we read that it registered after we planned
        and it took part in that matchmaking (:meth:`_read_late`; a miss after that forfeits
        for :data:`MAX_NO_SHOW_SKIP` epochs). It is still grouped whenever it registers in
        time, so a slow honest peer or newcomer loses only the wait, never its place."""
        known = peer in self._registered or peer in self._late
        if not known and not self.context.proven(peer):
            return False  # never registered, never averaged with the run: a fresh identity
        missed = self._no_shows.get(peer)
        if missed is None:
            return True
        last, k = missed
        if epoch < last:
            return True
        skip = min(2**k - 1, MAX_NO_SHOW_SKIP) if peer in self._registered else MAX_NO_SHOW_SKIP
        return epoch > last + skip

    def _took_part(self, members: set[str]) -> None:
        """``members`` are in a group with us: each registered and served this round, so
        marks of past misses go: taking part proves a peer, so one late once (compiling at
        epoch 0) is waited for again from the next round."""
        for peer in members - {self.peer_id}:
            self._unserved.pop(peer, None)
            self._hung_at.pop(peer, None)
            self._misled.pop(peer, None)
            self._no_shows.pop(peer, None)
        if len(self._registered) < _MAX_LEARNED:
            self._registered |= members - {self.peer_id}

    def _long_epochs(self, epoch: int, window: float) -> bool:
        """Whether a window is at most :data:`NEWCOMER_WAIT_SHARE` of an epoch, as measured
        between our own gatherings (unknown before our second: no)."""
        known = [g for g in (self._gathered, self._gathered_before) if g and g[0] < epoch]
        if not known:
            return False
        last, at = known[0]
        return window <= NEWCOMER_WAIT_SHARE * (trio.current_time() - at) / (epoch - last)

    def _note_unserved(self, peer: str, epoch: int, *, hung: bool = False) -> None:
        """``peer`` served nothing we asked at ``epoch`` (see :meth:`_serves`)."""
        if max(len(self._unserved), len(self._hung_at), len(self._misled)) >= _MAX_LEARNED:
            self._unserved.clear()
            self._hung_at.clear()
            self._misled.clear()
        last, k = self._unserved.get(peer, (epoch, 0))
        if last < epoch or k == 0:
            self._unserved[peer] = (epoch, k + 1)
        if hung:
            self._hung_at[peer] = epoch

    def _serves(self, peer: str, epoch: int) -> bool:
        """Whether a group we lead at ``epoch`` waits for ``peer``: after ``k`` rounds in a row
        in which it served nothing we asked (no join as our leader, no answer as a member),
        not during ``2**k - 1`` epochs (at most :data:`MAX_NO_SHOW_SKIP`): a registered peer
        that never joins held each group it was planned in by a window. It is still taken
        when it joins; taking part in a group clears it."""
        failed = self._unserved.get(peer)
        if failed is None:
            return True
        last, k = failed
        return epoch < last or epoch > last + min(2**k - 1, MAX_NO_SHOW_SKIP)

    def _note_misled(self, leader: str, epoch: int) -> None:
        """``leader``'s refusal of our join at ``epoch`` led nowhere: a closed group that no
        member of ours is in, or a redirect to a peer that served no join (see :meth:`_shunned`)."""
        self._note_unserved(leader, epoch)
        last, k = self._misled.get(leader, (epoch, 0))
        if last < epoch or k == 0:
            self._misled[leader] = (epoch, k + 1)

    def _shunned(self, peer: str, epoch: int) -> bool:
        """Whether we skip ``peer`` as leader at ``epoch`` (its followers fall back to the
        next in rank at once). One that held our join until the timeout, during the last
        :data:`MAX_NO_SHOW_SKIP` epochs: an honest leader answers every join before it (its
        group forms within the member wait), and each such join stalled the group by the
        timeout (31 s for a 1 s window). One whose refusals led nowhere in ``k >= 2`` epochs
        in a row, during ``2**k - 1`` epochs (at most :data:`MAX_NO_SHOW_SKIP`): an honest
        leader's closed group or redirect fails us once in a while (a crash, a race), a
        hostile one's every time, and each try costs its followers a fallback (or the
        redirect target's timeout). Averaging with it clears both."""
        at = self._hung_at.get(peer)
        if at is not None and at <= epoch <= at + MAX_NO_SHOW_SKIP:
            return True
        last, k = self._misled.get(peer, (epoch, 0))
        return k >= 2 and last <= epoch <= last + min(2**k - 1, MAX_NO_SHOW_SKIP)

    def _note_shows(self, epoch: int, expected: set[str], registered: set[str]) -> None:
        """Remember which expected peers did not register for ``epoch`` (see :meth:`_earned`)."""
        if max(len(self._no_shows), len(self._registered), len(self._late)) >= _MAX_LEARNED:
            self._no_shows.clear()
            self._registered.clear()
            self._late.clear()
        for p in registered:
            self._no_shows.pop(p, None)
        self._registered |= registered
        for p in expected - registered:
            last, k = self._no_shows.get(p, (epoch, 0))
            if last < epoch or k == 0:
                self._no_shows[p] = (epoch, k + 1)
                log.info(
                    "epoch %d: expected peer %s did not register (%d in a row%s): not waited "
                    "for in the next epochs",
                    epoch,
                    p[:8],
                    k + 1,
                    "" if p in self._registered else ", never seen registered",
                )

    def _too_late(self, slot: Slot, expected: set[str]) -> bool:
        """The others averaged this epoch and moved on, and nobody we expect is still at it:
        no group can form, so average alone now (the caller then loads the others' state)
        instead of waiting out the windows, which made a late peer late for the next epoch
        too."""
        epoch = slot[0]
        context = self.context
        if not context.epoch_over(epoch) or any(not context.moved_on(p, epoch) for p in expected):
            return False
        log.info("epoch %d: the others moved past it; averaging alone", epoch)
        self._choose(slot, None)
        if slot[1] == 0:
            self._remember(epoch, False)
        return True

    async def _lead_or_join(
        self,
        slot: Slot,
        me: Member,
        mine: list[str],
        deadlines: Deadlines | float,
        cap: int,
        *,
        late: set[str] | frozenset[str] = frozenset(),
        states: Mapping[str, bytes | None] | None = None,
    ) -> GroupSpec | None:
        """Lead ``mine`` (we rank first in it), unless we registered late: a member that
        registered before us may already follow a leader that did not see us. Then join that
        leader rather than split the group in two (one round across groups needs one group of
        representatives; two groups of one state fork it). Every member is asked, not only the
        next in rank: two peers that finished compiling late ranked first and second in their
        view, the second undecided, so the first led them apart from the two that had begun
        (a 2+2 split at epoch 0 that never joined). We answer "undecided" while asking, so
        that the others' leader keeps waiting for us."""
        if len(mine) > 1:
            window, waits = self._window_of(deadlines)
            other = await self._followed(slot, mine[1:], window, states or {})
            if other is not None:
                self._choose(slot, other)
                try:
                    return await self._follow(slot, me, other, waits, members=mine)
                except LeaderGone:
                    self._choose(slot, None)
                    return None
        self._choose(slot, self.peer_id)
        expected = set(mine[1:]) | late
        return await self._lead(slot, me, deadlines, cap, expected=expected, late=late)

    async def _followed(
        self, slot: Slot, members: list[str], window: float, states: Mapping[str, bytes | None]
    ) -> str | None:
        """The leader to join instead of leading our group ``members`` (after us, in rank
        order): the one the next in rank follows (it may have decided on a leader that did not
        see us); else a member that says it leads while another member follows it. An answer
        is a member's word: one member alone, saying that it leads or naming a peer that does
        not, cannot take us from our group (a hostile one would lead, or strand, every group it
        ranks in). Only members that registered with our state count (``states``; an aux peer,
        stating none, may follow another lineage's leader, whose group refuses us), unless we
        state none. A member that has stepped past the epoch answers with no state: it counts
        (its group formed without us; leading the late ones apart would fork the run). Only
        witnesses (:meth:`_witness`) are asked: a fresh identity's word counts for nothing."""
        ours = self.context.state_of(slot[0])
        leaders: list[str | None] = [None] * len(members)

        async def ask(i: int) -> None:
            if not self._witness(members[i]):  # a Sybil next in rank sent us to its ghost
                return
            try:
                answer = await self._ask_leader(slot, members[i], window)
            except P2PError as e:
                log.debug("%s did not say whom it follows at %s: %s", members[i], slot, e)
                return
            if not isinstance(answer, dict) or answer.get("decided") is not True:
                return
            stated = states.get(members[i], answer.get("state"))
            if ours is not None and (stated != ours or answer.get("state") not in (None, ours)):
                return
            leader = answer.get("leader")
            leaders[i] = leader if isinstance(leader, str) and leader != self.peer_id else None

        async with trio.open_nursery() as nursery:
            for i in range(len(members)):
                nursery.start_soon(ask, i)
        if leaders[0] is not None:
            return leaders[0]
        says = dict(zip(members, leaders, strict=True))
        for leader in members:
            followed = any(x == leader for m, x in says.items() if m != leader)
            if says[leader] == leader and followed:
                return leader
        return None

    def _window_of(self, deadlines: Deadlines | float) -> tuple[float, Deadlines]:
        """A round's window and its other waits, from its deadlines or from a bare window (the
        other waits then the matchmaker's own)."""
        if isinstance(deadlines, Deadlines):
            return deadlines.window, deadlines
        return deadlines, self.deadlines

    async def _ask_leader(
        self, slot: Slot, peer: str, timeout: float, *, refused: str | None = None
    ) -> Any:
        """``peer``'s answer to whom it follows at ``slot`` (raises P2PError); ``refused``:
        the leader that refused us, told to ``peer`` (see :meth:`_complained`)."""
        try:
            return await ask_leader(self.node, slot, peer, timeout, refused=refused)
        except P2PError:
            self._note_unserved(peer, slot[0])
            raise

    async def _follow(
        self,
        slot: Slot,
        me: Member,
        leader: str,
        deadlines: Deadlines | None = None,
        *,
        gone: frozenset[str] = frozenset(),
        members: list[str] | tuple[str, ...] = (),
    ) -> GroupSpec | None:
        """Join ``leader``'s group (see :func:`~dedloc_jax.rounds.following.follow`);
        ``gone``: the slot's leaders we found gone; ``members``: our planned group. None:
        refused as the group closed without us, which a member of ours confirms (see
        :meth:`_closed_group`); else the refusal counts as a gone leader (raises
        :class:`LeaderGone`), as does a leader that refused members of ours while our join
        waited (:meth:`_complained`) or whose spec left them out (:meth:`_split`)."""
        epoch, level = slot
        deadlines = deadlines or self.deadlines

        def cross(several: bool) -> None:
            if level == 0:
                self._remember(epoch, several)

        joining = Joining(
            self.node,
            slot,
            me,
            self.context,
            deadlines.join_timeout,
            learn=self._learn_addrs,
            choose=lambda target: self._choose(slot, target),
            cross=cross,
            share=self.slots[slot].share,
            gone=gone,
        )
        record = self.slots[slot]
        try:
            with trio.CancelScope() as scope:
                record.waiting = (scope, tuple(members))
                spec = await follow(joining, leader)
        except LeaderClosed as e:
            self.slots[slot].refused = e.leader
            if await self._closed_group(slot, e.leader, members, deadlines.window):
                return None  # its group closed without us (an honest race): as ever, alone
            log.warning(
                "%s: %s refused us as its group closed, but no member of ours is in it",
                slot,
                e.leader[:8],
            )
            raise Misled(leader, e.leader) from e  # (e.leader: we or a redirect went there)
        finally:
            record.waiting = None
        took = self.slots[slot].leader or leader  # (a redirect's target, if it sent us there)
        if scope.cancelled_caught:
            log.warning(
                "%s: %s refused members of our group before it formed: leaving it",
                slot,
                took[:8],
            )
            raise Misled(leader, None if took == leader else took)
        if await self._split(slot, spec, took, members, deadlines.window):
            log.warning(
                "%s: %s formed a group without members of ours that say it refused them: "
                "leaving it",
                slot,
                took[:8],
            )
            raise Misled(leader, None if took == leader else took)
        self.slots[slot].grouped = True
        return spec

    async def _split(
        self,
        slot: Slot,
        spec: GroupSpec,
        leader: str,
        members: list[str] | tuple[str, ...],
        window: float,
    ) -> bool:
        """Whether ``leader``'s ``spec`` splits our planned group ``members``: enough of them
        are left out while they say they follow it, or that it refused them as its group
        closed (and they still look for a group). An honest leader refuses only those that
        came after its group formed (it waits for every member it saw registered), whom our
        view then also missed; a hostile one that took
        one of three and refused the others kept them apart in every epoch it led, as the
        one it took confirmed its `closed`. Leaving it, we answer that we do not follow it,
        so those it refused fall back to the next in rank, with us. The claims must outweigh
        the leader's word (:func:`_outweighs`), and only witnesses count (:meth:`_witness`):
        a leader that took two of four and refused two split the run in every epoch it led,
        and Sybils with no history, more than it took, pulled its members from an honest one."""
        inside = {m.peer_id for m in spec.members}
        held = sum(1 for p in members if p in inside and p != leader) or 1  # (us)
        out = [p for p in members if p not in inside and p != leader and self._witness(p)]
        out = out[: 2 * CLOSED_ASKS]
        group = sum(1 for p in members if p != leader)
        if not _outweighs(len(out), held, group):
            return False
        said: list[str] = []

        async def ask(peer: str) -> None:
            try:
                # (done before a member it refused asks us, a quarter window after its refusal)
                answer = await self._ask_leader(slot, peer, window / 8)
            except P2PError:
                return
            if not isinstance(answer, dict):
                return
            joining = answer.get("leader") == leader and answer.get("grouped") is not True
            looking = answer.get("refused") == leader and answer.get("leader") is not None
            if joining or looking:
                said.append(peer)

        async with trio.open_nursery() as nursery:
            for peer in out:
                nursery.start_soon(ask, peer)
        return _outweighs(len(said), held, group)

    def _witness(self, peer: str) -> bool:
        """Whether ``peer``'s word that a leader refused it counts: it averaged with the run
        (a Sybil with no history counts for nothing) and is not banned. It is a member of our
        own plan (its registration came in time in our view), and it says so itself (each
        identity once: we ask it, or it asks us)."""
        return self.context.proven(peer) and not self.context.banned(peer)

    def _complained(self, slot: Slot, peer: str, leader: str) -> None:
        """``peer`` asks us whom we follow at ``slot``, saying ``leader`` refused it as its
        group closed. While our own join of that leader still waits, the group has not
        formed, so an honest leader refused nobody of it (a refusal for another state comes
        to a peer planned apart; a full group, to one a capped plan did not count): once
        such witnesses outweigh it (:func:`_outweighs`, how many it took is unknown) we
        leave it. A hostile leader that refused the others at once and held the one it took
        for more than a window made the others give up first, each alone."""
        record = self.slots.get(slot)
        if record is None or record.waiting is None:
            return
        scope, members = record.waiting
        if peer not in members or not self._witness(peer) or peer in record.complaints:
            return
        record.complaints[peer] = leader
        target = record.leader or leader
        said = sum(1 for p, x in record.complaints.items() if x == target)
        if _outweighs(said, None, sum(1 for p in members if p != target)):
            scope.cancel()

    async def _closed_group(
        self, slot: Slot, leader: str, members: list[str] | tuple[str, ...], window: float
    ) -> bool:
        """Whether ``leader``'s group at ``slot`` formed: a member of our planned group says
        that it is in it. A closed group sends its refused follower home alone, without a
        fallback, so that the late ones do not form a second group of the same state (which
        forks the run); but a hostile leader that ranks first and answers every join so kept
        all its followers alone. Its own word is not enough: the members it refused say that
        they are not grouped. (One that takes a few and refuses more of our group is left by
        those it took, see :meth:`_split`.) Asked a quarter window later: the members it took
        are told when the group forms, as we are refused."""
        others = [p for p in members if p not in (leader, self.peer_id)][:CLOSED_ASKS]
        grouped: list[bool] = []

        async def ask(peer: str) -> None:
            try:
                answer = await self._ask_leader(slot, peer, window, refused=leader)
            except P2PError:
                return
            if isinstance(answer, dict) and answer.get("leader") == leader:
                grouped.append(answer.get("grouped") is True)

        await trio.sleep(window / 4)
        async with trio.open_nursery() as nursery:
            for peer in others:
                nursery.start_soon(ask, peer)
        return any(grouped)

    def _learn_addrs(self, peer: str, registration: Any) -> None:
        """Remember a registered peer's addresses, so that we can dial it if it leads."""
        addrs = registration.get("addrs") if isinstance(registration, dict) else None
        if not isinstance(addrs, list):
            return
        listed = tuple(a for a in addrs[:8] if isinstance(a, str))
        if self._learned.get(peer) == listed:
            return
        try:
            pid = PeerID.from_base58(peer)
            parsed = [Multiaddr.parse(a) for a in listed]
        except P2PError as e:
            log.info("ignoring bad addresses of %s: %s", peer, e)
            return
        self.node.peerstore.add_addrs(pid, parsed)
        if len(self._learned) >= _MAX_LEARNED:
            self._learned.clear()
        self._learned[peer] = listed

    def _group_id(self, slot: Slot) -> bytes:
        epoch, level = slot
        return f"{self.run_id}:{epoch}:{'x:' if level else ''}{self.peer_id}".encode()

    async def _handle_join(self, ctx: CallContext, request: Any) -> Any:
        """A follower's join of a group we may lead (see :func:`~dedloc_jax.rounds.leading.
        answer_join`)."""
        slot = _slot_of(request)
        peer = str(ctx.remote_peer)
        member = member_from_wire(peer, request.get("member"))
        state = state_from_wire(request.get("state"))
        if self.context.admit is not None:
            await self.context.admit(ctx.remote_peer, member.mode)
        if self.context.banned(peer):
            raise GroupError(f"{peer} is banned (caught lying in a round)")
        self._showed_up(peer, slot)
        addrs = request.get("addrs", [])
        known: list[str] = []
        if isinstance(addrs, list):
            try:
                parsed = [Multiaddr.parse(a) for a in addrs[:8] if isinstance(a, str)]
                self.node.peerstore.add_addrs(ctx.remote_peer, parsed)
                known = [str(a) for a in parsed]
            except P2PError as e:
                log.info("ignoring bad addresses from %s: %s", peer, e)
        return await answer_join(
            self.slots,
            slot,
            peer,
            member,
            state,
            known,
            me=self.peer_id,
            wait=lambda: self._answering.max_wait + 2 * self._answering.window,
            learned=self._learned,
        )

    async def _lead(
        self,
        slot: Slot,
        me: Member,
        deadlines: Deadlines | float,
        cap: int,
        *,
        expected: set[str],
        late: set[str] | frozenset[str] = frozenset(),
    ) -> GroupSpec | None:
        """Lead ``slot``'s group: accept joins for one window, and longer (up to the member
        wait; level 1: the longest wait, as the other groups' means come when their rounds
        end) while an expected member has not joined yet (``late``: those of them that never
        registered, asked at once). ``deadlines``: the round's, or a bare window (the other
        waits then the matchmaker's own)."""
        window, waits = self._window_of(deadlines)
        epoch, level = slot
        rnd = LedGroup(
            slot,
            me,
            cap,
            expected={p for p in expected if self._serves(p, epoch)},
            late=frozenset(late),
            cross=self.needs_cross(epoch) if level == 0 else False,
            state=self.context.state_of(epoch),
            share=self.slots[slot].share,
        )
        record = self.slots[slot]
        record.leading = rnd
        record.opened.set()
        spec = await lead(
            rnd,
            window=window,
            wait=waits.member_wait if level == 0 else waits.max_wait,
            me=self.peer_id,
            moved_on=self.context.moved_on,
            ask=functools.partial(self._ask_leader, slot),
            group_id=self._group_id(slot),
            # (a representative's weight is its group's samples, weighed there)
            weightless=self.context.weightless if level == 0 else None,
        )
        record.grouped = spec is not None
        return spec
