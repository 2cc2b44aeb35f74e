"""Asking the expected peers that have not registered for an epoch's group what they are doing,
so that a peer gathering registrations stops waiting for those that will bring no samples."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from dedloc_jax.averaging.errors import GroupError
from dedloc_jax.averaging.group import Member
from dedloc_jax.matchmaking_wire import member_from_wire, state_from_wire
from p2p.errors import P2PError

log = logging.getLogger(__name__)


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
