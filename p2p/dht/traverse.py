"""Iterative Kademlia lookups: alpha requests in flight, a beam of the k nearest candidates.

A lookup keeps every candidate it heard of, sorted by XOR distance to the target. It keeps
up to ``alpha`` requests in flight to the nearest candidates not yet asked, and ends when the
``k`` nearest candidates that did not fail have all answered (those still in flight are then
cancelled). As in the Kademlia paper, once ``alpha`` answers in a row bring no candidate closer
than the closest already known, the lookup has converged and asks all of the k nearest it has
not asked yet at once, instead of alpha at a time (this cuts the sequential waves of a lookup
roughly in half). Hop counts (how many responses separate a candidate from our own table) give the
number of rounds. The request function is supplied by the caller: it applies per-request
timeouts, the blacklist and batching of concurrent lookups (see :class:`FindBatcher`).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio

from p2p.dht.records import Record
from p2p.dht.wire import Contact
from p2p.identity import PeerID

log = logging.getLogger(__name__)

FindAnswer = tuple[list[Contact], list[Record] | None]
FindFn = Callable[[Contact, "int | str"], Awaitable[FindAnswer | None]]

_NEW, _WAITING, _DONE, _FAILED = range(4)


@dataclass
class _Candidate:
    contact: Contact
    distance: int
    hop: int
    state: int = _NEW


def _by_distance(cand: _Candidate) -> int:
    return cand.distance


@dataclass
class LookupResult:
    """The k nearest peers that answered (nearest first) and what they held for the key."""

    nearest: list[Contact]
    responders: list[Contact] = field(default_factory=list)  # every peer that answered
    records: dict[PeerID, list[Record]] = field(default_factory=dict)
    rounds: int = 0
    messages: int = 0


async def lookup(
    target: int,
    query: int | str,
    initial: Iterable[Contact],
    find: FindFn,
    *,
    k: int,
    alpha: int,
    local: PeerID | None = None,
    skip: Callable[[PeerID], bool] = lambda peer: False,
    enough: Callable[[PeerID, list[Record]], bool] | None = None,
) -> LookupResult:
    """Find the k nodes nearest to ``target``; ``query`` is sent to each (an ID or a key).

    ``enough(peer, records)`` is called for each answer holding records; when it returns True
    the lookup stops early (a get that has heard the value from enough nodes).
    """
    cands: dict[bytes, _Candidate] = {}  # keyed by peer ID digest (cheap hashing)
    order: list[_Candidate] = []  # the same candidates, nearest first
    best: int | None = None  # the smallest distance heard of
    result = LookupResult([])
    local_key = local.digest if local is not None else None

    def learn(contacts: Iterable[Contact], hop: int) -> None:
        nonlocal best
        for c in contacts:
            key = c.peer.digest
            old = cands.get(key)
            if old is None:
                if key == local_key or skip(c.peer):
                    continue
                cand = cands[key] = _Candidate(c, int.from_bytes(key, "big") ^ target, hop)
                bisect.insort(order, cand, key=_by_distance)
                if best is None or cand.distance < best:
                    best = cand.distance
            elif old.state == _NEW and hop < old.hop:
                old.hop = hop

    def beam() -> list[_Candidate]:
        """The k nearest candidates that did not fail."""
        out = []
        for cand in order:
            if cand.state != _FAILED:
                out.append(cand)
                if len(out) == k:
                    break
        return out

    learn(initial, 1)
    send_done, recv_done = trio.open_memory_channel[None](1000)
    closest = best
    stale_answers = 0  # answers in a row that brought nothing closer
    satisfied = False

    async def ask(cand: _Candidate) -> None:
        nonlocal closest, stale_answers, satisfied
        answer = await find(cand.contact, query)
        if answer is None:
            cand.state = _FAILED
        else:
            cand.state = _DONE
            contacts, records = answer
            if records is not None:
                result.records[cand.contact.peer] = records
                if enough is not None and enough(cand.contact.peer, records):
                    satisfied = True
            learn(contacts, cand.hop + 1)
            if best is not None and (closest is None or best < closest):
                closest, stale_answers = best, 0
            else:
                stale_answers += 1
        send_done.send_nowait(None)

    async with trio.open_nursery() as nursery:
        in_flight = 0
        while True:
            nearest = beam()
            if satisfied or all(c.state == _DONE for c in nearest):
                break
            width = k if stale_answers >= alpha else alpha
            for cand in nearest:
                if in_flight >= width:
                    break
                if cand.state == _NEW:
                    cand.state = _WAITING
                    in_flight += 1
                    result.messages += 1
                    nursery.start_soon(ask, cand)
            if in_flight == 0:
                break
            await recv_done.receive()
            in_flight -= 1
        nursery.cancel_scope.cancel()

    done = [c for c in order if c.state == _DONE]
    result.responders = [c.contact for c in done]
    result.nearest = result.responders[:k]
    result.rounds = max((c.hop for c in done), default=0)
    return result


T = TypeVar("T")


@dataclass
class _Batch(Generic[T]):
    queries: list = field(default_factory=list)
    count: int | None = None  # contacts wanted per answer (None: the responder's k)
    done: trio.Event = field(default_factory=trio.Event)
    results: list[T] | None = None
    completed: bool = False


class FindBatcher(Generic[T]):
    """Merges queries that concurrent lookups send to the same peer at the same moment.

    The first caller for a peer yields once, letting others add their queries, then sends one
    request for all of them; the others wait for its answer. ``send`` returns one result per
    query, or None when the request failed.
    """

    def __init__(
        self, send: Callable[[Contact, list, int | None], Awaitable[list[T] | None]]
    ) -> None:
        self._send = send
        self._pending: dict[PeerID, _Batch[T]] = {}

    async def find(self, contact: Contact, query: int | str, count: int | None = None) -> T | None:
        """``count``: the contacts the caller needs per answer (None: as many as the peer
        gives); a batch asks for the most any of its queries needs."""
        while True:
            batch = self._pending.get(contact.peer)
            if batch is None:
                return await self._lead(contact, query, count)
            index = len(batch.queries)
            batch.queries.append(query)
            if batch.count is not None:
                batch.count = None if count is None else max(batch.count, count)
            await batch.done.wait()
            if batch.completed:
                return batch.results[index] if batch.results is not None else None
            # the leader was cancelled before answering: try again ourselves

    async def _lead(self, contact: Contact, query: int | str, count: int | None) -> T | None:
        batch: _Batch[T] = _Batch([query], count)
        self._pending[contact.peer] = batch
        try:
            try:
                await trio.lowlevel.checkpoint()
            finally:
                if self._pending.get(contact.peer) is batch:
                    del self._pending[contact.peer]
            batch.results = await self._send(contact, batch.queries, batch.count)
            batch.completed = True
        finally:
            batch.done.set()
        return batch.results[0] if batch.results is not None else None
