"""The leader's side of forming a group: accept joins, wait (bounded) for the members it
expects, ask a missing one whom it follows, and answer every member with one spec.

:class:`Leading` is the part of :class:`dedloc_jax.round.matchmaking.Matchmaker` that runs when the
peer ranks first in its group; the attributes it reads (rounds, choices, waits, the tracker's
``moved_on``) are the matchmaker's.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from dedloc_jax.averaging.errors import GroupError
from dedloc_jax.averaging.group import GroupSpec, Member
from dedloc_jax.round.plan import same_state
from dedloc_jax.round.wire import Slot, member_from_wire, slot_of, state_from_wire
from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr
from p2p.rpc import CallContext

log = logging.getLogger(__name__)


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


class Leading:
    """Leader-side handlers and waits; mixed into the matchmaker."""

    node: Any
    peer_id: str
    window: float
    admit: Callable[[PeerID, str | None], Awaitable[None]] | None
    moved_on: Callable[[str, int], bool]
    state_of: Callable[[int], bytes | None]
    _rounds: dict[Slot, LeaderRound]
    _chosen: dict[Slot, str | None]
    _learned: dict[str, tuple[str, ...]]
    max_wait: float
    member_wait: float

    def _opened(self, slot: Slot) -> trio.Event:
        raise NotImplementedError

    def needs_cross(self, epoch: int) -> bool:
        raise NotImplementedError

    def _group_id(self, slot: Slot) -> bytes:
        raise NotImplementedError

    async def _ask_leader(self, slot: Slot, peer: str, timeout: float) -> Any:
        raise NotImplementedError

    async def _handle_join(self, ctx: CallContext, request: Any) -> Any:
        slot = slot_of(request)
        epoch, level = slot
        peer = str(ctx.remote_peer)
        member = member_from_wire(peer, request.get("member"))
        state = state_from_wire(request.get("state"))
        if self.admit is not None:
            await self.admit(ctx.remote_peer, member.mode)
        addrs = request.get("addrs", [])
        known: list[str] = []
        if isinstance(addrs, list):
            try:
                parsed = [Multiaddr.parse(a) for a in addrs[:8] if isinstance(a, str)]
                self.node.peerstore.add_addrs(ctx.remote_peer, parsed)
                known = [str(a) for a in parsed]
            except P2PError as e:
                log.info("ignoring bad addresses from %s: %s", peer, e)
        # The follower may come before we decided to lead this epoch: wait a bounded time.
        with trio.move_on_after(self.max_wait + 2 * self.window):
            await self._opened(slot).wait()
        rnd = self._rounds.get(slot)
        if rnd is None:
            chosen = self._chosen.get(slot, "?")
            state = {"?": "undecided", None: "alone", self.peer_id: "leading"}.get(
                chosen, "following"
            )
            answer: dict[str, Any] = {
                "ok": False,
                "reason": f"not leading epoch {epoch} at level {level} ({state})",
            }
            if state == "following" and chosen != peer:
                # Its view of the registrations differs from ours: send it to our leader.
                answer["redirect"] = chosen
                answer["redirect_addrs"] = list(self._learned.get(chosen, ()))
            return answer
        if not rnd.open:
            return {"ok": False, "reason": "group already formed"}
        if not same_state(rnd.state, state):
            # Its view of the registrations missed that we are on another lineage.
            return {"ok": False, "reason": "it steps from another state than the group"}
        if rnd.state is None:  # we hold no state (aux): the first member's is the group's
            rnd.state = state
        if len(rnd.joined) + 1 >= rnd.max_size:
            return {"ok": False, "reason": "group full"}
        rnd.joined[peer] = member
        rnd.addrs[peer] = known
        rnd.changed.set()
        try:
            # Longer than the leader may keep the group open (max_wait), so that a peer the
            # spec will name is never told that no group was formed.
            with trio.move_on_after(self.max_wait + 2 * self.window):
                await rnd.formed.wait()
        finally:
            if not rnd.formed.is_set():  # told no (or gone): must not be in a later spec
                rnd.joined.pop(peer, None)
        if rnd.spec is None or peer not in {m.peer_id for m in rnd.spec.members}:
            return {"ok": False, "reason": "group was not formed"}
        # The members' addresses, so that members that never read each other's registration
        # (a reader polls some of the key's holders) can still dial each other.
        addrs = {p: rnd.addrs[p] for p in rnd.joined if p != peer and rnd.addrs.get(p)}
        return {"ok": True, "spec": rnd.spec.to_bytes(), "addrs": addrs, "cross": rnd.cross}

    async def _lead(
        self, slot: Slot, me: Member, window: float, cap: int, *, expected: set[str]
    ) -> GroupSpec | None:
        """Accept joins for one window, and longer (up to :attr:`member_wait`) while an
        expected member (one that registered in our group) has not joined yet."""
        epoch = slot[0]
        rnd = LeaderRound(slot, me, cap, cross=self.needs_cross(epoch) if slot[1] == 0 else False)
        rnd.expected = expected
        rnd.state = self.state_of(epoch)
        started = trio.current_time()
        self._rounds[slot] = rnd
        for old in [s for s in self._rounds if s[0] < epoch - 2]:
            del self._rounds[old]
        self._opened(slot).set()
        try:
            # Close as soon as every peer we saw registered has joined; otherwise keep the
            # door open for one window for peers we did not see, and longer (bounded) for
            # those we did.
            # Level 1 waits longer: the other groups' means come when their rounds end.
            with trio.move_on_after(self.member_wait if slot[1] == 0 else self.max_wait):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._ask_missing, rnd, window)
                    while True:
                        rnd.expected = {p for p in rnd.expected if not self.moved_on(p, epoch)}
                        if rnd.expected <= set(rnd.joined) and (
                            rnd.expected or trio.current_time() - started >= window
                        ):
                            break
                        with trio.move_on_after(window / 4):
                            await rnd.changed.wait()
                        rnd.changed = trio.Event()
                    nursery.cancel_scope.cancel()
            rnd.open = False
            missing = rnd.expected - set(rnd.joined)
            if missing:
                log.info(
                    "epoch %d: closing the group after %.1f s without %d registered peer(s) "
                    "that did not join (%s)",
                    epoch,
                    trio.current_time() - started,
                    len(missing),
                    ", ".join(sorted(p[:8] for p in missing)),
                )
            if rnd.joined:
                members = [me, *(rnd.joined[p] for p in sorted(rnd.joined))]
                spec = GroupSpec(tuple(members), group_id=self._group_id(slot))
                rnd.spec = spec.with_parts()
            return rnd.spec
        except GroupError as e:
            log.warning("could not form a group at epoch %d: %s", epoch, e)
            return None
        finally:
            rnd.open = False
            rnd.formed.set()

    async def _ask_missing(self, rnd: LeaderRound, window: float) -> None:
        """A window after opening, ask each expected member that has not joined whom it
        follows; stop waiting for those that follow someone else, average alone, or cannot be
        reached. Views of the registrations differ (a late registration, another count of
        groups), and without this the leader waited ``member_wait`` for each such member."""
        await trio.sleep(window)
        asked: set[str] = set()

        async def ask(peer: str) -> None:
            try:
                answer = await self._ask_leader(rnd.slot, peer, window)
            except P2PError as e:
                log.debug(
                    "member %s of epoch %d did not say whom it follows: %s", peer, rnd.slot[0], e
                )
                answer = {"decided": True, "leader": None}
            decided = isinstance(answer, dict) and answer.get("decided") is True
            if decided and answer.get("leader") != self.peer_id:
                rnd.expected.discard(peer)
                rnd.changed.set()

        while True:
            missing = rnd.expected - set(rnd.joined) - asked
            if missing:
                async with trio.open_nursery() as nursery:
                    for peer in sorted(missing):
                        asked.add(peer)
                        nursery.start_soon(ask, peer)
            await trio.sleep(window / 2)
            asked -= {p for p in asked if p in rnd.expected}  # undecided: ask again
