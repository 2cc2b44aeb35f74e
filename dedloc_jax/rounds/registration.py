"""Registration: a peer ready for a slot stores what it brings under the slot's key, reads the
others', and asks the expected peers it has not read what they are doing, so that it stops
waiting for those that will bring no samples."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from dedloc_jax.averaging.errors import GroupError
from dedloc_jax.averaging.group import Member
from dedloc_jax.rounds.wire import member_from_wire, state_from_wire
from dedloc_jax.run_dht import RunDHT
from p2p.dht import InvalidRecordError, KeyFollower, follower_replicas
from p2p.dht.records import owner_marker, owner_markers
from p2p.errors import P2PError
from p2p.identity import PeerID

log = logging.getLogger(__name__)


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
        elif "member" in answer:  # it gathers registrations: ours missed its own
            try:
                probed[peer] = member_from_wire(peer, answer["member"])
                states[peer] = state_from_wire(answer.get("state"))
            except GroupError as e:
                log.info("ignoring the malformed registration %s sent: %s", peer[:8], e)
                expected.discard(peer)

    while True:
        missing = expected - registered() - set(probed)
        if missing:
            async with trio.open_nursery() as nursery:
                for peer in sorted(missing):
                    nursery.start_soon(ask, peer)
        await trio.sleep(window)
