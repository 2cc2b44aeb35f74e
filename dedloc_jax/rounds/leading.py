"""The leader's side of forming a group: accept joins, wait (bounded) for the members it
expects, ask a missing one whom it follows, and answer every member with one spec.

:class:`~dedloc_jax.rounds.matchmaking.Matchmaker` calls these when its peer ranks first in its
group, and hands in what they read (the slot's record, the waits, the peer's context).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from dedloc_jax.averaging.errors import GroupError
from dedloc_jax.averaging.group import GroupSpec, Member
from dedloc_jax.rounds.claims import bound_claims, zero_weightless
from dedloc_jax.rounds.plan import same_state
from dedloc_jax.rounds.slots import LedGroup, Slots
from dedloc_jax.rounds.wire import Slot
from p2p.errors import P2PError

log = logging.getLogger(__name__)


Ask = Callable[[str, float], Awaitable[Any]]
"""``ask(peer, timeout)``: whom ``peer`` follows at the slot (raises P2PError)."""


async def answer_join(
    slots: Slots,
    slot: Slot,
    peer: str,
    member: Member,
    state: bytes | None,
    addrs: list[str],
    *,
    me: str,
    wait: Callable[[], float],
    learned: Mapping[str, tuple[str, ...]],
) -> dict[str, Any]:
    """The answer to ``peer``'s join of ``slot`` (``member``: what it brings; ``state``: the
    state it steps from; ``addrs``: its addresses, passed on to the other members). ``wait()``:
    how long a join may wait for us to decide, then for the group to form; ``learned``: the
    addresses we know per peer, sent with a redirect."""
    # The follower may come before we decided to lead this epoch: wait a bounded time.
    asked = slots.asked(slot)
    asked.knocking.add(peer)
    try:
        with trio.move_on_after(wait()):
            await asked.opened.wait()
    finally:
        asked.knocking.discard(peer)
    record = slots.get(slot)
    rnd = record.leading if record is not None else None
    if rnd is None:
        chosen = record.leader if record is not None and record.decided else "?"
        doing = {"?": "undecided", None: "alone", me: "leading"}.get(chosen, "following")
        epoch, level = slot
        answer: dict[str, Any] = {
            "ok": False,
            "reason": f"not leading epoch {epoch} at level {level} ({doing})",
        }
        if doing == "following" and chosen != peer:
            # Its view of the registrations differs from ours: send it to our leader.
            answer["redirect"] = chosen
            answer["redirect_addrs"] = list(learned.get(str(chosen), ()))
        return answer
    # "closed": an honest race (the follower goes alone, as ever); any other refusal says we
    # lead nothing, and the follower falls back to the next member in rank.
    if not rnd.open:
        return {"ok": False, "reason": "group already formed", "closed": True}
    if not same_state(rnd.state, state):
        # Its view of the registrations missed that we are on another lineage.
        return {"ok": False, "reason": "it steps from another state than the group", "closed": True}
    if rnd.state is None:  # we hold no state (aux): the first member's is the group's
        rnd.state = state
    if len(rnd.joined) + 1 >= rnd.max_size:
        return {"ok": False, "reason": "group full", "closed": True}
    rnd.joined[peer] = member
    rnd.addrs[peer] = addrs
    rnd.changed.set()
    try:
        # Longer than the leader may keep the group open (max_wait), so that a peer the
        # spec will name is never told that no group was formed.
        with trio.move_on_after(wait()):
            await rnd.formed.wait()
    finally:
        if not rnd.formed.is_set():  # told no (or gone): must not be in a later spec
            rnd.joined.pop(peer, None)
    if rnd.spec is None or peer not in {m.peer_id for m in rnd.spec.members}:
        return {"ok": False, "reason": "group was not formed", "closed": True}
    # The members' addresses, so that members that never read each other's registration
    # (a reader polls some of the key's holders) can still dial each other.
    known = {p: rnd.addrs[p] for p in rnd.joined if p != peer and rnd.addrs.get(p)}
    return {"ok": True, "spec": rnd.spec.to_bytes(), "addrs": known, "cross": rnd.cross}


async def lead(
    rnd: LedGroup,
    *,
    window: float,
    wait: float,
    me: str,
    moved_on: Callable[[str, int], bool],
    ask: Ask,
    group_id: bytes,
    weightless: Callable[[str], bool] | None = None,
) -> GroupSpec | None:
    """Accept joins to ``rnd`` for one ``window``, and longer (up to ``wait``) while an
    expected member (one that registered in our group) has not joined yet; then form the
    group (None when nobody joined). Every join waiting on ``rnd`` is answered at the end.
    ``weightless``: whether a member's contribution weighed nothing lately (weight 0 in the
    spec: :func:`~dedloc_jax.rounds.claims.zero_weightless`)."""
    epoch = rnd.slot[0]
    started = trio.current_time()
    try:
        # Close as soon as every peer we saw registered has joined; otherwise keep the
        # door open for one window for peers we did not see, and longer (bounded) for
        # those we did.
        with trio.move_on_after(wait):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask_missing, rnd, window, ask, me)
                while True:
                    rnd.expected = {p for p in rnd.expected if not moved_on(p, epoch)}
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
            members = bound_claims(
                [rnd.me, *(rnd.joined[p] for p in sorted(rnd.joined))],
                rnd.me.peer_id,
                share=rnd.share,
            )
            if weightless is not None:
                members = zero_weightless(members, rnd.me.peer_id, weightless)
            spec = GroupSpec(tuple(members), group_id=group_id)
            rnd.spec = spec.with_parts()
        return rnd.spec
    except GroupError as e:
        log.warning("could not form a group at epoch %d: %s", epoch, e)
        return None
    finally:
        rnd.open = False
        rnd.formed.set()


async def ask_missing(rnd: LedGroup, window: float, ask: Ask, me: str) -> None:
    """A window after opening, ask each expected member that has not joined whom it
    follows; stop waiting for those that follow someone else, average alone, or cannot be
    reached. Views of the registrations differ (a late registration, another count of
    groups), and without this the leader waited ``member_wait`` for each such member.
    The ``late`` ones (expected, never registered: the gathering already waited two windows
    for them) are asked at once: a peer that left the run has a progress record that
    outlives it, and asking at once finds it unreachable without a third window."""
    asked: set[str] = set()
    if rnd.late:
        async with trio.open_nursery() as nursery:
            for peer in sorted(rnd.late - set(rnd.joined)):
                asked.add(peer)
                nursery.start_soon(_ask_one, rnd, ask, me, window, peer)
    await trio.sleep(window)
    asked -= {p for p in asked if p in rnd.expected}  # undecided: ask again

    while True:
        missing = rnd.expected - set(rnd.joined) - asked
        if missing:
            async with trio.open_nursery() as nursery:
                for peer in sorted(missing):
                    asked.add(peer)
                    nursery.start_soon(_ask_one, rnd, ask, me, window, peer)
        await trio.sleep(window / 2)
        asked -= {p for p in asked if p in rnd.expected}  # undecided: ask again


async def _ask_one(rnd: LedGroup, ask: Ask, me: str, window: float, peer: str) -> None:
    """Ask ``peer`` whom it follows; stop waiting for it unless it is undecided or follows us."""
    try:
        answer = await ask(peer, window)
    except P2PError as e:
        log.debug("member %s of epoch %d did not say whom it follows: %s", peer, rnd.slot[0], e)
        answer = {"decided": True, "leader": None}
    decided = isinstance(answer, dict) and answer.get("decided") is True
    if decided and answer.get("leader") != me:
        rnd.expected.discard(peer)
        rnd.changed.set()
