"""Following one often-read, often-updated key: a lookup now and then, only changes between.

Why: every peer of a collaboration re-reads the run's progress table (one signed subkey per
peer) about once a second. A ``get`` is a lookup whose answers each carry the whole table, so
with n peers a refresh round moves n² records (times the lookup's fan-out). A :class:`KeyFollower`
finds the key's nearest nodes once per ``relocate_interval`` and otherwise asks them (over
``dht.changes``) for the records they stored since its last read from each, which costs about
one record per update instead of one per peer. A read asks one of the ``holders`` nearest
nodes (this reader's own pick among them, so that readers spread over the holders), and all of
them every ``sweep_every`` reads or when it fails: a record every holder has arrives at the
next read, one that reached only some holders (a store that failed on the way) within a sweep.
Asking one holder matters because each holder's answer carries every change since the reader
last asked *that* holder: reading three holders in turn fetched each update three times. For
the same reason a sweep asks the one holder first and tells the others what the reader holds
(``dht.changes``' ``held``: a digest, expiration and value tag per record): they send only
records newer than ours, and name those they hold the same. A holder that withholds newer
records hides them only until a sweep asks another holder; every record is still validated.

A record leaves the view only after a read that asked every holder: between sweeps, a read
whose one answer leaves a record expired asks them all (the one holder asked may be a far node
that writers do not store on). And an expired record leaves on time only when a holder that
sent us that very record answered after it expired (with nothing newer for it): a reader that
hears from none of them (its own link saturated, a cut, or only far nodes answering, which hold
a few records or none) cannot tell that the writer left, so the record then lapses only
``lapse_grace`` seconds past its expiry. A holder speaks only for the records it sent: a far
node holding a few records says nothing of the others.

A relocation keeps the holders that still answer unless nearer nodes were found, and a read
on which every holder failed drops none of them (the fault is then most likely ours: our own
link is congested, or we are cut off); the next relocation asks such holders again before it
ranks them behind the nodes a lookup found: a lookup on a busy network may return a few far
nodes that writers do not store on.

The incidents behind these rules are in docs/decisions.md ("Followed keys").

Every record is validated as in a ``get`` (a forged or expired one is dropped) and merged with
the same rules (:class:`~p2p.dht.records.KeyState`), so the view equals what a ``get`` from the
same holders returns.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import TYPE_CHECKING

import trio

from p2p.dht.ids import key_id, node_id
from p2p.dht.records import KeyState, Record, View, decode_view
from p2p.dht.traffic import default_purpose, key_kind
from p2p.dht.wire import Contact, Cursor
from p2p.identity import PeerID

if TYPE_CHECKING:
    from p2p.dht.config import DHTConfig
    from p2p.dht.node import DHT

log = logging.getLogger(__name__)


def follower_replicas(config: DHTConfig) -> int:
    """Replicas for a short-lived record that readers follow: twice the holders a follower
    reads (slack for churn among the key's nearest), within ``replication``. A progress
    record rewritten every few seconds needs no more, and every extra replica is a store per
    peer and update."""
    return min(config.replication, 2 * max(1, config.get_quorum))


class KeyFollower:
    """The live value of one key, kept current with incremental reads (from trio tasks of the
    DHT's loop; overlapping reads are safe, they may just fetch some records twice)."""

    def __init__(
        self,
        dht: DHT,
        key: str,
        *,
        holders: int | None = None,
        relocate_interval: float = 30.0,
        sweep_every: int = 8,
        lapse_grace: float = 30.0,
    ) -> None:
        if holders is not None and holders < 1:
            raise ValueError("holders must be at least 1")
        if not lapse_grace >= 0:
            raise ValueError("lapse_grace must be at least 0")
        if sweep_every < 1:
            raise ValueError("sweep_every must be at least 1")
        if not relocate_interval > 0:
            raise ValueError("relocate_interval must be positive")
        self.dht = dht
        self.key = key
        self.wanted = holders or max(1, dht.config.get_quorum)
        self.relocate_interval = relocate_interval
        self.sweep_every = sweep_every
        self.lapse_grace = lapse_grace
        self._reads = 0
        self._pick = int.from_bytes(dht.peer_id.digest[:4], "big")  # our holder, by rank
        self.stats: Counter[str] = Counter()
        self._state = KeyState()
        self._holders: list[Contact] = []
        self._suspects: set[PeerID] = set()  # holders whose last answer failed
        self._stale: set[PeerID] = set()  # holders that let the view lapse (next relocation)
        self._cursors: dict[PeerID, Cursor | None] = {}
        self._local_cursor = 0
        self._local_incarnation = b""
        self._located_at = -math.inf
        self._fresh_lookup = False  # the next relocation ignores cached lookups
        self._weighed: set[PeerID] = set()  # the candidates the last relocation ranked
        # For each slot (subkey; None: the plain value), the holders that sent the record it
        # holds, and when each holder last answered (DHT clock): see _drop_lapsed.
        self._providers: dict[str | None, set[PeerID]] = {}
        self._answered_at: dict[PeerID, float] = {}

    @property
    def holders(self) -> list[PeerID]:
        """The nodes read from now (nearest to the key first)."""
        return [c.peer for c in self._holders]

    async def get(self, *, sweep: bool = False) -> object:
        """Like ``DHT.get``: a ValueWithExpiration, a ``{subkey: ValueWithExpiration}`` for a
        dictionary, or None. ``sweep`` reads every holder this time (see :meth:`read`)."""
        return decode_view(await self.read(sweep=sweep))

    async def read(
        self, *, sweep: bool = False, relocate_interval: float | None = None
    ) -> View | None:
        """Bring the view up to date and return it (a dictionary is a fresh copy). A read
        asks one holder, and all of them every ``sweep_every`` reads or when ``sweep`` is
        set: for a reader that must not miss records a holder lacks (writers store on the
        nearest nodes they found, and their views of the nearest differ).
        ``relocate_interval`` overrides the follower's for this read: a reader that reads
        rarely can relocate as rarely (a failed holder or a nearer node still relocates)."""
        turn = 0 if sweep else self._reads % self.sweep_every
        interval = self.relocate_interval if relocate_interval is None else relocate_interval
        due = trio.current_time() - self._located_at >= interval
        if turn == 0 and self._nearer_known():
            due = self._fresh_lookup = True  # (a cached lookup predates the nearer node)
        if due or len(self._holders) < self.wanted:
            await self._relocate()
        self._reads += 1
        held = self._state.held()
        if self._holders:
            one = self._holders[self._pick % len(self._holders)]
            if not await self._poll([one], drop=False):
                await self._poll(self._holders)
            elif turn == 0 or self._lapsing():
                await self._poll([c for c in self._holders if c is not one], answered=True)
        self._take_local()
        self._drop_lapsed()
        if held >= 4 and 2 * self._state.held() <= held:
            self._collapsed()
        return self._state.view()

    def _nearer_known(self) -> bool:
        """Whether our routing table names a node nearer the key than a holder we follow, one
        no relocation has weighed yet: holders located while the network was small (the run's
        first peers) are not where writers that joined later store, and waiting for the
        relocation interval froze the view that long."""
        if not self._holders:
            return False
        target = key_id(self.key)
        farthest = max(node_id(c.peer) ^ target for c in self._holders)
        return any(
            e.id ^ target < farthest and e.peer not in self._weighed
            for e in self.dht.routing.nearest(target, self.wanted)
        )

    def _collapsed(self) -> None:
        """Half the view lapsed in one read although every holder was asked: they no longer
        get the writers' stores (or a cut took the writers away). Look the key up afresh at
        the next read, not from a store's cached lookup, and prefer the nodes it finds to the
        holders that let the view lapse."""
        self.stats["collapses"] += 1
        log.debug("the view of %r lapsed; looking the key up again", self.key)
        self._stale.update(c.peer for c in self._holders)
        self._located_at = -math.inf
        self._fresh_lookup = True

    def _lapsing(self) -> bool:
        """Whether records would drop out of the view now. Before letting them go on one
        holder's word, ask them all: the one may be a far node writers do not store on. A
        writer that left costs one sweep."""
        return self._state.lapsing(self.dht.now())

    def _drop_lapsed(self) -> None:
        """Forget the expired records a holder that sent them has since answered without a
        newer one for, and those ``lapse_grace`` past their expiry (without holders, our own
        store is all there is: every expired record)."""
        now = self.dht.now()
        expired = self._state.expired(now)
        if self._holders:
            floor = now - self.lapse_grace
            expired = [r for r in expired if r.expiration <= max(floor, self._heard(r.subkey))]
        self._state.drop(expired)
        for rec in expired:
            self._providers.pop(rec.subkey, None)

    def _heard(self, slot: str | None) -> float:
        """When a holder that sent the record of ``slot`` we hold last answered."""
        answered = self._answered_at
        return max(
            (answered.get(p, -math.inf) for p in self._providers.get(slot, ())), default=-math.inf
        )

    def _take_local(self) -> None:
        """This node's own store is read the same way (it may be one of the holders)."""
        storage = self.dht.storage
        if storage.incarnation != self._local_incarnation:
            self._local_incarnation, self._local_cursor = storage.incarnation, 0
        records, self._local_cursor = storage.changes(
            self.key, self._local_cursor, self.dht.now(), math.inf
        )
        self._apply(records)

    async def _relocate(self) -> None:
        """Follow the ``wanted`` nearest nodes to the key among those a lookup found (a recent
        store's, or a new one) and the holders that still answer: a lookup on a busy network
        may return a few far nodes, which writers do not store on."""
        self.stats["relocations"] += 1
        fresh, self._fresh_lookup = self._fresh_lookup, False
        nearest = None if fresh else self.dht._recently_located(self.key, self.wanted)
        if nearest is None:
            with default_purpose(f"follow {key_kind(self.key)}"):
                found = await self.dht.find_nearest(key_id(self.key), count=self.wanted)
            nearest = found.nearest
        target = key_id(self.key)
        merged = {c.peer: c for c in self._holders}
        for c in nearest:
            merged.setdefault(c.peer, c)
        by_distance = sorted(merged.values(), key=lambda c: node_id(c.peer) ^ target)
        # (and those the routing table names: one that the lookup did not find, e.g. a dead
        # node, brings no relocation at every sweep)
        self._weighed = set(merged) | {
            e.peer for e in self.dht.routing.nearest(target, self.wanted)
        }
        stale, self._stale = self._stale, set()
        retry = [c for c in by_distance[: self.wanted] if c.peer in self._suspects - stale]
        if retry:
            # Holders that failed while every one failed (our link, most likely) are still
            # the key's nearest: ask them again before putting far nodes in their place.
            await self._poll(retry, drop=False)
        ranked = sorted(
            by_distance, key=lambda c: c.peer in self._suspects or c.peer in stale
        )  # (stable: nearest first within each rank)
        self._holders = ranked[: self.wanted]
        self._cursors = {c.peer: self._cursors.get(c.peer) for c in self._holders}
        keep = {c.peer for c in self._holders}.union(*self._providers.values())
        self._answered_at = {p: t for p, t in self._answered_at.items() if p in keep}
        self._located_at = trio.current_time()

    async def _poll(
        self, holders: list[Contact], *, drop: bool = True, answered: bool = False
    ) -> bool:
        """Ask ``holders`` for their changes; False when none answered. ``drop``: stop
        following those that failed while others answered (``answered``: another holder
        answered this read already).

        Every holder but the one we ask at each read is told the records we hold: its
        cursor is older than our last read, and it would resend what that one sent since
        (a sweep fetched each update three times); a holder that knows ours sends only
        newer records, and names those it holds the same (it could have sent them)."""
        count = 0
        failed: list[PeerID] = []
        now = self.dht.now()
        ours = [r for r in self._state.records() if r.expiration > now]
        picked = self._holders[self._pick % len(self._holders)].peer if self._holders else None

        async def one(contact: Contact) -> None:
            nonlocal count
            since = self._cursors.get(contact.peer)
            held = None if contact.peer == picked and since is not None else ours
            got = await self.dht.protocol.changes(contact, self.key, since, held)
            if got is None:
                failed.append(contact.peer)
                self._suspects.add(contact.peer)
                return
            self._suspects.discard(contact.peer)
            records, cursor, same = got
            count += 1
            self.stats["records"] += len(records)
            self._cursors[contact.peer] = cursor
            self._apply(records, contact.peer)
            for rec, yes in zip(held or (), same, strict=True):
                if yes:
                    self._vouched(rec, contact.peer)
            self._answered_at[contact.peer] = self.dht.now()

        self.stats["polls"] += 1
        async with trio.open_nursery() as nursery:
            for contact in holders:
                nursery.start_soon(one, contact)
        if drop and failed and not (count or answered):
            # Most likely our own fault (a congested link, a cut): dropping them all put far
            # nodes in their place. The next relocation replaces those still failing then.
            self.stats["all_failed"] += 1
            log.debug("no holder of %r answered; keeping them", self.key)
        elif drop and failed:
            log.debug("%d holders of %r did not answer; looking for others", len(failed), self.key)
            self._holders = [c for c in self._holders if c.peer not in failed]
            for peer in failed:
                self._cursors.pop(peer, None)
                self._suspects.discard(peer)
        return count > 0

    def _vouched(self, rec: Record, holder: PeerID) -> None:
        """``holder`` holds ``rec``, which we hold: as if it had sent it (see _drop_lapsed)."""
        slot = rec.subkey
        held = self._state.plain if slot is None else self._state.subs.get(slot)
        if held is not None and held.same_as(rec):
            self._providers.setdefault(slot, set()).add(holder)

    def _apply(self, records: list[Record], holder: PeerID | None = None) -> None:
        """Merge records sent by ``holder`` (None: our own store)."""
        now = self.dht.now()
        state = self._state
        for rec in records:
            if rec.expiration <= now:
                continue
            reason = self.dht.validators.reason(rec) or self.dht.validators.lifetime_reason(
                rec, now, self.dht.config.max_ttl
            )
            if reason is not None:
                self.stats["invalid"] += 1
                self.dht.note_invalid(rec, reason)
                continue
            state.apply(rec, self.dht.config.max_subkeys)
            slot = rec.subkey
            held = state.plain if slot is None else state.subs.get(slot)
            if held is rec:  # a newer record: only its senders can tell it was not refreshed
                self._providers[slot] = set() if holder is None else {holder}
            elif held is not None and holder is not None and held.same_as(rec):
                self._providers.setdefault(slot, set()).add(holder)
