"""The DHT's RPCs on a :class:`p2p.node.Node`: the handlers that answer peers, the calls that
ask them, and the bookkeeping every exchange triggers.

Every request refreshes its sender in the receiver's routing table (unless the sender says it
is in client mode: such peers cannot be dialed, so they are never added). Every answer
refreshes the responder; every failed request bans the peer for a while (exponential backoff)
and drops it from the routing table, its bucket's freshest replacement moving in. A full bucket
pings its least-recently-seen peer before evicting it. A peer entering the table receives the
records this node is responsible for and the newcomer is now among the nearest of.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import trio

from p2p.dht.blacklist import Blacklist
from p2p.dht.clock import DHTClock
from p2p.dht.config import DHTConfig
from p2p.dht.ids import key_id, node_id
from p2p.dht.records import Record, merge_views, view_records
from p2p.dht.routing import PeerEntry, RoutingTable
from p2p.dht.storage import LocalStorage
from p2p.dht.traffic import Traffic, current_purpose, encoded_size, key_kind, purpose
from p2p.dht.traverse import FindAnswer
from p2p.dht.validation import ValidatorChain
from p2p.dht.wire import (
    CHANGES,
    FIND,
    PING,
    STORE,
    Contact,
    Cursor,
    Held,
    Limits,
    changes_to_wire,
    find_result_to_wire,
    held_entry,
    held_to_wire,
    parse_changes_request,
    parse_changes_response,
    parse_find_request,
    parse_find_response,
    parse_sender,
    parse_store_request,
    parse_store_response,
    parse_time,
    query_to_wire,
    record_to_wire,
    request,
    response,
    store_addrs,
)
from p2p.errors import P2PError, ProtocolError, RPCError
from p2p.identity import PeerID

log = logging.getLogger(__name__)

MAX_FIND_RESPONSE_BYTES = 16 << 20


LIVE_FOR = 30.0
"""Seconds a routing entry heard from counts as live: a full bucket keeps it without a ping
(Kademlia's optimisation), so a busy bucket does not ping on every newcomer."""


def _newer_than_held(rec: Record, held: dict[bytes, Held]) -> bool:
    """Whether a reader holding ``held`` lacks ``rec``: it holds nothing in that slot, an
    older record, or one of another value with the same expiration (which of the two wins is
    the reader's merge to make)."""
    slot, mine = held_entry(rec)
    theirs = held.get(slot)
    return (
        theirs is None
        or mine.expiration > theirs.expiration
        or (mine.expiration == theirs.expiration and mine.tag != theirs.tag)
    )


class DHTProtocol:
    """RPC handlers and calls, over one node; owns the routing table and the stores."""

    def __init__(
        self,
        node: Any,
        *,
        config: DHTConfig,
        clock: DHTClock,
        validators: ValidatorChain,
        client_mode: bool = False,
    ) -> None:
        self.node = node
        self.config = config
        self.clock = clock
        self.validators = validators
        self.client_mode = client_mode
        self.local_id = node_id(node.peer_id)
        self.routing = RoutingTable(self.local_id, config.k, config.replacement_cache_size)
        self.storage = LocalStorage(
            config.max_keys,
            config.max_subkeys,
            max_bytes=config.max_storage_bytes,
            quotas=config.writer_quotas,
        )
        self.cache = LocalStorage(
            config.cache_size,
            config.max_subkeys,
            lru=True,
            max_bytes=config.cache_bytes,
            quotas=config.writer_quotas,
        )
        self.blacklist = Blacklist(config.blacklist_base, config.blacklist_max)
        self.limits = Limits(
            max_addrs=config.max_addrs_per_peer,
            max_records=config.max_records_per_store,
            max_queries=config.max_queries_per_find,
            max_peers=max(config.k, 64),  # peers with a larger k may answer more
            max_subkeys=config.max_subkeys,
            max_value_bytes=config.max_value_bytes,
        )
        self.stats: Counter[str] = Counter()
        self.traffic = Traffic()  # our requests' bytes by message and purpose
        self.nursery: trio.Nursery | None = None  # background work; set while the DHT runs
        self._evicting: set[PeerID] = set()
        self._handoff_limiter = trio.CapacityLimiter(config.handoff_concurrency)
        self._handoffs_pending = 0
        self._own_addrs: tuple[str, ...] = ()
        self._own_addrs_of: tuple[Any, ...] | None = None

    # --- wiring --------------------------------------------------------------------------
    def register(self) -> None:
        """Serve the DHT RPCs (client-mode nodes serve nothing: nobody can dial them)."""
        if self.client_mode:
            return
        self.node.add_handler(PING, self.handle_ping)
        self.node.add_handler(STORE, self.handle_store)
        self.node.add_handler(FIND, self.handle_find)
        self.node.add_handler(CHANGES, self.handle_changes)

    def unregister(self) -> None:
        for name in (PING, STORE, FIND, CHANGES):
            self.node.remove_handler(name)

    def own_addrs(self) -> tuple[str, ...]:
        if self.client_mode:
            return ()
        # Re-read each time: relayed addresses come and go (p2p.nat); render text only on change.
        current = tuple(self.node.addrs)
        if current != self._own_addrs_of:
            self._own_addrs_of = current
            self._own_addrs = tuple(str(a) for a in current)
        return self._own_addrs[: self.config.max_addrs_per_peer]

    def _running(self) -> bool:
        return self.nursery is not None

    # --- bookkeeping ---------------------------------------------------------------------
    def peer_seen(self, peer: PeerID, addrs: tuple[str, ...], *, client: bool) -> None:
        """A request or answer came from ``peer``: refresh it in the routing table."""
        self.blacklist.succeeded(peer.digest)
        if client or peer.digest == self.node.peer_id.digest:
            return
        entry = self.routing.get(peer)
        known = entry is not None
        if addrs and (
            (entry is None and peer not in self.node.peerstore)
            or (entry is not None and entry.addrs != addrs)
        ):
            self._remember_addrs(peer, addrs)
        lrs = self.routing.add_or_update(peer, node_id(peer), addrs, trio.current_time())
        if not self._running():
            return
        if lrs is not None and trio.current_time() - lrs.last_seen > LIVE_FOR:
            self._check_eviction(lrs)
        elif not known and peer in self.routing and not self.client_mode:
            self._schedule_handoff(Contact(peer, addrs))

    def _remember_addrs(self, peer: PeerID, addrs: tuple[str, ...]) -> None:
        try:
            self.node.peerstore.add_addrs(peer, store_addrs(addrs))
        except P2PError as e:  # addresses were validated on arrival; be safe anyway
            log.debug("bad addresses for %s: %s", peer, e)

    def peer_failed(self, peer: PeerID) -> None:
        """Ban the peer for a while; drop it from its bucket if a replacement can take its
        place or it failed too often (a lone stale peer is kept, banned, as Kademlia does:
        after a partition heals it is tried again and answers)."""
        self.stats["failures"] += 1
        self.blacklist.failed(peer.digest, trio.current_time())
        entry = self.routing.get(peer)
        if entry is None:
            return
        bucket = self.routing.bucket_for(entry.id)
        stale = self.blacklist.failures(peer.digest) >= self.config.stale_failures
        if bucket.replacements or stale:
            self.routing.remove(peer)

    def _check_eviction(self, lrs: PeerEntry) -> None:
        if lrs.peer in self._evicting or len(self._evicting) >= self.config.max_pending_evictions:
            return
        self._evicting.add(lrs.peer)
        self.nursery.start_soon(self._ping_before_evict, lrs)

    async def _ping_before_evict(self, lrs: PeerEntry) -> None:
        try:
            # an answer refreshes it (peer_seen); a failure removes it (peer_failed)
            with purpose("evict"):
                await self.ping(Contact(lrs.peer, lrs.addrs))
        finally:
            self._evicting.discard(lrs.peer)

    def _schedule_handoff(self, newcomer: Contact) -> None:
        if len(self.storage) == 0 or self._handoffs_pending >= 256:
            return
        records = self._records_for(newcomer.peer)
        if records:
            self._handoffs_pending += 1
            self.nursery.start_soon(self._handoff, newcomer, records)

    def _records_for(self, newcomer: PeerID) -> list[Record]:
        """Records for which the newcomer is among the nearest and we are the nearest holder."""
        now = self.clock.now()
        out: list[Record] = []
        for key in self.storage.held_keys():
            kid = key_id(key)
            near = self.routing.nearest(kid, self.config.replication)
            if all(e.peer != newcomer for e in near):
                continue
            others = [e for e in near if e.peer != newcomer]
            if others and others[0].id ^ kid < self.local_id ^ kid:
                continue  # a nearer node is responsible for handing it over
            out.extend(view_records(self.storage.get(key, now)))
        return out

    async def _handoff(self, newcomer: Contact, records: list[Record]) -> None:
        try:
            async with self._handoff_limiter:
                self.stats["handoffs"] += 1
                with purpose("handoff"):
                    await self.store(newcomer, records)
        finally:
            self._handoffs_pending -= 1

    # --- handlers ------------------------------------------------------------------------
    async def handle_ping(self, ctx: Any, req: Any) -> dict:
        client, addrs = parse_sender(req, ctx.remote_peer, self.limits)
        self.peer_seen(ctx.remote_peer, addrs, client=client)
        return response(self.clock.local_time())

    async def handle_store(self, ctx: Any, req: Any) -> dict:
        client, addrs = parse_sender(req, ctx.remote_peer, self.limits)
        items = parse_store_request(req, self.limits)
        now = self.clock.now()
        results: list[bool | str] = []
        for rec, cache in items:
            reason = self.validators.reason(rec)
            if reason is None:
                reason = self.validators.lifetime_reason(rec, now, self.config.max_ttl)
            if reason is None:
                outcome = (self.cache if cache else self.storage).offer(rec, now)
                if isinstance(outcome, str):
                    reason = outcome
            if reason is not None:
                self.stats["refused"] += 1
                log.debug("refused a record from %s: %s", ctx.remote_peer, reason)
                results.append(reason)
            else:
                results.append(outcome)
        self.peer_seen(ctx.remote_peer, addrs, client=client)
        return response(self.clock.local_time(), results=results)

    async def handle_find(self, ctx: Any, req: Any) -> dict:
        client, addrs = parse_sender(req, ctx.remote_peer, self.limits)
        queries, count = parse_find_request(req, self.limits)
        now = self.clock.now()
        budget = MAX_FIND_RESPONSE_BYTES
        results = []
        wanted = self.config.k if count is None else min(count, self.config.k)
        for q in queries:
            target = q if isinstance(q, int) else key_id(q)
            near = self.routing.nearest(target, wanted, exclude=(ctx.remote_peer,))
            records = None
            if isinstance(q, str):
                held = view_records(self.storage.get(q, now)) + view_records(self.cache.get(q, now))
                if held:
                    records = []
                    for r in sorted(view_records(merge_views(held)), key=Record.sort_key)[::-1]:
                        budget -= len(r.value) + len(r.subkey or "") + 128
                        if budget < 0:
                            break
                        records.append(r)
            if records:
                self.stats["find_records_sent"] += len(records)
            results.append(find_result_to_wire([Contact(e.peer, e.addrs) for e in near], records))
        self.peer_seen(ctx.remote_peer, addrs, client=client)
        return response(self.clock.local_time(), results=results)

    async def handle_changes(self, ctx: Any, req: Any) -> dict:
        """The records of one key stored here since the reader's cursor (see wire.py), less
        those the reader says it holds already, or newer."""
        key, since, held = parse_changes_request(req, self.limits.max_subkeys)
        store = self.storage
        now = self.clock.now()
        start = since.number if since is not None and since.incarnation == store.incarnation else 0
        records, number = store.changes(
            key, start, now, MAX_FIND_RESPONSE_BYTES, self.limits.max_subkeys
        )
        same = None
        if held is not None:
            theirs = dict(held)
            changed = len(records)
            records = [r for r in records if _newer_than_held(r, theirs)]
            mine = dict(held_entry(r) for r in store.slot_records(key, now))
            same = [mine.get(slot) == h for slot, h in held]
            self.stats["changes_held_skipped"] += changed - len(records)
        self.stats["changes_served"] += 1
        body = changes_to_wire(records, Cursor(store.incarnation, number), same)
        return response(self.clock.local_time(), **body)

    # --- calls ---------------------------------------------------------------------------
    async def _call(
        self, contact: Contact, name: str, label: str | None = None, **body: Any
    ) -> Any | None:
        """One request; None (and the peer is banned) when it fails or answers garbage.
        ``label``: what it is for when the caller named no purpose (see p2p.dht.traffic)."""
        if contact.peer.digest == self.node.peer_id.digest:
            return None
        if contact.addrs and contact.peer not in self.node.peerstore:
            self._remember_addrs(contact.peer, contact.addrs)
        self.stats[name] += 1
        sent = self.clock.local_time()
        req = request(self.client_mode, self.own_addrs(), **body)
        resp = None
        try:
            resp = await self.node.call(
                contact.peer, name, req, timeout=self.config.request_timeout
            )
            peer_time = parse_time(resp)
        except P2PError as e:  # unreachable, closed, bad answer: all mean "no usable answer"
            log.debug("%s to %s failed: %r", name, contact.peer, e)
            self.peer_failed(contact.peer)
            return None
        finally:
            size = encoded_size(req) + (0 if resp is None else encoded_size(resp))
            self.traffic.add(name, current_purpose() or label, size)
        self.clock.observe(contact.peer.digest, peer_time, sent, self.clock.local_time())
        self.peer_seen(contact.peer, contact.addrs, client=False)
        return resp

    async def ping(self, contact: Contact) -> bool:
        return await self._call(contact, PING, "ping") is not None

    async def why_no_ping(self, contact: Contact) -> str:
        """Why ``contact`` did not answer a ping, in words a user can act on: a DHT client
        (behind a NAT, no public address) serves no DHT request, so it cannot bootstrap."""
        try:
            await self.node.call(
                contact.peer,
                PING,
                request(self.client_mode, self.own_addrs()),
                timeout=self.config.request_timeout,
            )
        except RPCError as e:
            if e.remote and "unknown protocol" in str(e):
                return (
                    "it serves no DHT requests: it is a DHT client (a node behind a NAT, "
                    "without a public address); use a node others can reach (a public one)"
                )
            return f"no answer to ping ({e})"
        except P2PError as e:
            return f"no answer to ping ({e})"
        return "no answer to ping"

    async def store(
        self, contact: Contact, records: list[Record], *, cache: bool = False
    ) -> list[bool | str] | None:
        """Send records (in chunks); one result per record, None if the peer failed."""
        out: list[bool | str] = []
        step = self.config.max_records_per_store
        for i in range(0, len(records), step):
            chunk = records[i : i + step]
            resp = await self._call(
                contact,
                STORE,
                key_kind(chunk[0].key),
                records=[record_to_wire(r, cache) for r in chunk],
            )
            if resp is None:
                return None
            try:
                out.extend(parse_store_response(resp, len(chunk)))
            except ProtocolError as e:
                log.debug("bad store answer from %s: %s", contact.peer, e)
                self.peer_failed(contact.peer)
                return None
        return out

    async def changes(
        self,
        contact: Contact,
        key: str,
        since: Cursor | None,
        held: list[Record] | None = None,
    ) -> tuple[list[Record], Cursor, list[bool]] | None:
        """What ``contact`` stored under ``key`` since ``since``, less what ``held`` (our
        records, one per slot) has already or newer; and for each of ``held``, whether the
        contact holds that very record. None on failure."""
        since_wire = None if since is None else [since.incarnation, since.number]
        body: dict[str, Any] = {"key": key, "since": since_wire}
        if held:
            body["held"] = held_to_wire(held)
        resp = await self._call(contact, CHANGES, key_kind(key), **body)
        if resp is None:
            return None
        try:
            return parse_changes_response(resp, key, self.limits, len(held or ()))
        except ProtocolError as e:
            log.debug("bad changes answer from %s: %s", contact.peer, e)
            self.peer_failed(contact.peer)
            return None

    async def find(
        self, contact: Contact, queries: list[int | str], count: int | None = None
    ) -> list[FindAnswer] | None:
        """FIND several targets at once (in chunks); one answer per query, None on failure.
        ``count``: the nearest contacts wanted per query (None: the responder's k)."""
        out: list[FindAnswer] = []
        step = self.config.max_queries_per_find
        extra = {} if count is None else {"count": count}
        for i in range(0, len(queries), step):
            chunk = queries[i : i + step]
            keys = [q for q in chunk if isinstance(q, str)]
            label = key_kind(keys[0]) if keys else "lookup"
            resp = await self._call(
                contact, FIND, label, queries=[query_to_wire(q) for q in chunk], **extra
            )
            if resp is None:
                return None
            try:
                out.extend(parse_find_response(resp, chunk, self.limits))
            except ProtocolError as e:
                log.debug("bad find answer from %s: %s", contact.peer, e)
                self.peer_failed(contact.peer)
                return None
        return out
