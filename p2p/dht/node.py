"""The DHT node: joins through initial peers, stores and gets values, keeps itself healthy.

``open_dht(node, ...)`` runs a :class:`DHT` on a :class:`p2p.node.Node` for the duration of an
``async with`` block. Background work (ping-before-evict, handing records to new nodes,
caching/repairing along lookup paths, bucket refresh, republishing, purging expired records)
runs in a nursery the DHT owns and ends with the block.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from p2p.dht.clock import DHTClock
from p2p.dht.config import DHTConfig
from p2p.dht.errors import BootstrapError, InvalidRecordError
from p2p.dht.follow import KeyFollower
from p2p.dht.ids import key_id, node_id, random_id
from p2p.dht.protocol import DHTProtocol
from p2p.dht.records import (
    Record,
    ValueWithExpiration,
    View,
    decode_view,
    merge_views,
    pack_value,
    view_records,
)
from p2p.dht.traffic import default_purpose, key_kind, purpose
from p2p.dht.traverse import FindBatcher, LookupResult, lookup
from p2p.dht.validation import RecordValidator, ValidatorChain, record_owner, sign_record
from p2p.dht.wire import Contact
from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr

log = logging.getLogger(__name__)

DHTValue = ValueWithExpiration | dict[str, ValueWithExpiration]
_MAX_NOTED = 4096  # invalid records remembered as logged (then forgotten, so logged again)
_MAX_LOCATED = 1024  # keys whose nearest nodes a DHT remembers (locate_ttl)


@dataclass
class StoreResult:
    """How a store went: on how many nodes the record is now held, and why others refused."""

    stored: int = 0
    outdated: int = 0  # nodes holding a newer record
    failed: int = 0  # nodes that did not answer
    refused: dict[str, str] = field(default_factory=dict)  # peer -> reason

    @property
    def ok(self) -> bool:
        return self.stored > 0


class DHT:
    """A Kademlia node; create it with :func:`open_dht`."""

    def __init__(
        self,
        node: Any,
        *,
        config: DHTConfig = DHTConfig(),
        client_mode: bool = False,
        validators: Iterable[RecordValidator] = (),
        clock: DHTClock | None = None,
    ) -> None:
        self.node = node
        self.peer_id: PeerID = node.peer_id
        self.config = config
        self.client_mode = client_mode
        self.clock = clock or DHTClock(samples=config.clock_samples, max_skew=config.max_clock_skew)
        self.validators = ValidatorChain(validators)
        self.protocol = DHTProtocol(
            node,
            config=config,
            clock=self.clock,
            validators=self.validators,
            client_mode=client_mode,
        )
        self.routing = self.protocol.routing
        self.storage = self.protocol.storage
        self.cache = self.protocol.cache
        self._batcher: FindBatcher = FindBatcher(self.protocol.find)
        self._gets: dict[str, _SharedGet] = {}
        self._located: dict[str, tuple[float, list[Contact]]] = {}  # key -> (when, nearest)
        self.lookups: list[LookupResult] = []  # the last few lookups (rounds/messages figures)
        self.initial_peers: list[str | Multiaddr] = []
        self._greeted: tuple[float, int] | None = None  # last re-greeting: (when, table size)
        self._greet_misses = 0  # re-greetings in a row that reached no initial peer
        self._noted: set[tuple] = set()  # invalid records already logged (see note_invalid)

    def note_invalid(self, record: Record, reason: str) -> None:
        """Log an invalid record that a read brought, once per record (key, subkey, value):
        a junk record that stays in the DHT is read again every second, and logging it at
        every read buried the log."""
        ident = (record.key, record.subkey, record.value)
        if ident in self._noted:
            log.debug("dropped an invalid record of %r again: %s", record.key, reason)
            return
        if len(self._noted) >= _MAX_NOTED:
            self._noted.clear()
        self._noted.add(ident)
        log.info(
            "dropped an invalid record of %r (subkey %.60r): %s; not logged again",
            record.key,
            record.subkey,
            reason,
        )

    def now(self) -> float:
        """The DHT time (skew-corrected) in which expirations are written."""
        return self.clock.now()

    @property
    def _nursery(self) -> trio.Nursery:
        assert self.protocol.nursery is not None, "the DHT is not running"
        return self.protocol.nursery

    # --- mode ----------------------------------------------------------------------------
    def set_client_mode(self, client: bool) -> None:
        """Serve the DHT (False) or only use it (True), e.g. when our reachability changed
        (``p2p.nat`` calls this). A new server looks up its own ID, so that the nodes nearest to
        it hear from it and add it; a server turned client stops answering (others drop it
        after failed calls) and hands the records it holds to the nodes that should hold them."""
        if client == self.client_mode:
            return
        log.info("DHT mode: %s", "client" if client else "server")
        self.client_mode = client
        self.protocol.client_mode = client
        if client:
            self.protocol.unregister()
            if self.protocol.nursery is not None:
                self.protocol.nursery.start_soon(self._hand_off_records)
        else:
            self.protocol.register()
            if self.protocol.nursery is not None:
                with purpose("join"):
                    self.protocol.nursery.start_soon(self.find_nearest, node_id(self.peer_id))

    async def _hand_off_records(self) -> None:
        records = list(self.storage.records(self.now()))
        if not records:
            return
        try:
            with purpose("handoff"):
                await self.store_records(records)
        except (P2PError, InvalidRecordError) as e:
            log.info("handing off %d records failed: %s", len(records), e)

    # --- joining -------------------------------------------------------------------------
    async def bootstrap(self, initial_peers: Sequence[str | Multiaddr]) -> int:
        """Ping the initial peers, then look up our own ID; returns how many peers answered."""
        if not initial_peers:
            return 0
        self.initial_peers = list(initial_peers)
        answered: list[PeerID] = []
        errors: list[str] = []

        async def try_peer(addr: str | Multiaddr) -> None:
            try:
                ma = Multiaddr.parse(addr)
                with trio.fail_after(self.config.bootstrap_timeout):
                    peer = await self.node.connect(ma)
                    if peer == self.peer_id:
                        return
                    if await self.protocol.ping(Contact(peer, (str(ma.with_peer(peer)),))):
                        answered.append(peer)
                    else:
                        contact = Contact(peer, (str(ma.with_peer(peer)),))
                        errors.append(f"{addr}: {await self.protocol.why_no_ping(contact)}")
            except (P2PError, trio.TooSlowError) as e:
                errors.append(f"{addr}: {e or type(e).__name__}")

        with purpose("bootstrap"):
            async with trio.open_nursery() as nursery:
                for addr in initial_peers:
                    nursery.start_soon(try_peer, addr)
        if not answered:
            raise BootstrapError(
                f"none of the {len(initial_peers)} initial peers answered: " + "; ".join(errors)
            )
        with purpose("bootstrap"):
            await self.find_nearest(node_id(self.peer_id))
        return len(answered)

    async def _reping_initial_peers(self) -> None:
        """A small table may mean we were cut off (a partition): greet the initial peers."""
        answered = []

        async def one(addr: str | Multiaddr) -> None:
            try:
                ma = Multiaddr.parse(addr)
                with trio.move_on_after(self.config.request_timeout):
                    peer = await self.node.connect(ma)
                    if await self.protocol.ping(Contact(peer, (str(ma.with_peer(peer)),))):
                        answered.append(peer)
            except P2PError as e:
                log.debug("initial peer %s still unreachable: %s", addr, e)

        async with trio.open_nursery() as nursery:
            for addr in self.initial_peers:
                nursery.start_soon(one, addr)
        if answered and self._greet_misses:
            # back from a cut: meet the others through them, as a bootstrap does
            await self.find_nearest(node_id(self.peer_id))
        self._greet_misses = 0 if answered else self._greet_misses + 1

    # --- lookups -------------------------------------------------------------------------
    async def find_nearest(
        self,
        target: int,
        query: int | str | None = None,
        enough: Callable[[PeerID, list[Record]], bool] | None = None,
        *,
        count: int | None = None,
    ) -> LookupResult:
        """An iterative lookup of ``target`` (sending ``query``: the ID itself, or a key).

        ``count``: how many of the nearest nodes the caller needs (default ``k``). The lookup
        ends once that many nearest candidates answered, so a store to 6 replicas asks about
        a third of the nodes a full lookup asks (the beam never drops below ``2 * alpha``).
        """
        now = trio.current_time()
        initial = [Contact(e.peer, e.addrs) for e in self.routing.nearest(target, self.config.k)]
        failed = self.protocol.blacklist
        beam = (
            self.config.k
            if count is None
            else min(self.config.k, max(count, 2 * self.config.alpha))
        )
        result = await lookup(
            target,
            target if query is None else query,
            initial,
            # concurrent lookups' queries to one peer share a request; a partial, not a
            # lambda: the lookup calls the batcher directly (no frame back in this module)
            functools.partial(self._batcher.find, count=None if count is None else beam),
            k=beam,
            alpha=self.config.alpha,
            local=self.peer_id,
            skip=lambda p: p.digest in failed and failed.is_banned(p.digest, trio.current_time()),
            enough=enough,
        )
        self.routing.touch_bucket(target, now)
        self.lookups.append(result)
        del self.lookups[:-100]
        return result

    # --- store ---------------------------------------------------------------------------
    def make_record(
        self, key: str, value: Any, expiration: float, subkey: str | None = None
    ) -> Record:
        """A record, signed when its key or subkey names this node as owner; validated."""
        rec = Record(key, subkey, pack_value(value), float(expiration))
        if record_owner(rec) == self.peer_id:
            rec = sign_record(rec, self.node.identity)
        self.validators.validate(rec)
        return rec

    async def store(
        self,
        key: str,
        value: Any,
        expiration: float,
        *,
        subkey: str | None = None,
        replicas: int | None = None,
    ) -> StoreResult:
        """Store ``value`` under ``key`` (or one subkey of it) until ``expiration`` (DHT time).

        ``replicas``: how many of the key's nearest nodes get it (default: the config's
        ``replication``); fewer suit short-lived records rewritten every few seconds.
        Raises InvalidRecordError when the record is invalid (here, or refused by every node
        that answered, with their reason).
        """
        rec = self.make_record(key, value, expiration, subkey)
        return (await self.store_records([rec], replicas=replicas))[0]

    async def store_records(
        self, records: Sequence[Record], *, replicas: int | None = None
    ) -> list[StoreResult]:
        """Store several records: one lookup per key, one STORE per target node."""
        if replicas is None:
            replicas = self.config.replication
        if not 1 <= replicas <= self.config.replication:
            raise ValueError(f"replicas must be in 1..{self.config.replication}")
        now = self.now()
        for rec in records:
            self.validators.validate(rec)
            if rec.expiration <= now:
                raise InvalidRecordError(f"record of {rec.key!r} expired already")
            too_long = self.validators.lifetime_reason(rec, now, self.config.max_ttl)
            if too_long is not None:
                raise InvalidRecordError(too_long)
        results = [StoreResult() for _ in records]
        targets: dict[str, list[Contact]] = {}
        local: dict[str, bool] = {}

        async def locate(key: str) -> None:
            kid = key_id(key)
            nearest = self._recently_located(key, replicas)
            if nearest is None:
                with default_purpose(f"locate {key_kind(key)}"):
                    found = await self.find_nearest(kid, count=replicas)
                nearest = found.nearest[:replicas]
                self._remember_located(key, nearest, replicas)
            nearest = nearest[:replicas]
            local[key] = not self.client_mode and (
                len(nearest) < replicas
                or self.protocol.local_id ^ kid < node_id(nearest[-1].peer) ^ kid
            )
            targets[key] = nearest[: replicas - local[key]]

        async with trio.open_nursery() as nursery:
            for key in {r.key for r in records}:
                nursery.start_soon(locate, key)

        per_peer: dict[PeerID, tuple[Contact, list[int]]] = {}
        for i, rec in enumerate(records):
            if local[rec.key]:
                outcome = self.storage.offer(rec, now)
                if outcome is True:
                    results[i].stored += 1
                elif outcome is False:
                    results[i].outdated += 1
                else:
                    results[i].refused[str(self.peer_id)] = outcome
            for c in targets[rec.key]:
                per_peer.setdefault(c.peer, (c, []))[1].append(i)

        async def send(contact: Contact, indices: list[int]) -> None:
            answers = await self.protocol.store(contact, [records[i] for i in indices])
            if answers is None:  # a target is gone: the next store of these keys looks again
                for i in indices:
                    self._located.pop(records[i].key, None)
            for j, i in enumerate(indices):
                res = results[i]
                if answers is None:
                    res.failed += 1
                elif answers[j] is True:
                    res.stored += 1
                elif answers[j] is False:
                    res.outdated += 1
                else:
                    res.refused[str(contact.peer)] = answers[j]

        async with trio.open_nursery() as nursery:
            for contact, indices in per_peer.values():
                nursery.start_soon(send, contact, indices)
        for res in results:
            if not res.stored and not res.outdated and res.refused:
                raise InvalidRecordError("refused: " + next(iter(res.refused.values())))
        return results

    async def locate(self, key: str, *, replicas: int | None = None) -> None:
        """Look up ``key``'s ``replicas`` nearest nodes now (default: ``replication``), for the
        next store or follower of it (:meth:`_recently_located`): a record that must be
        stored the moment it is due (a matchmaking's registration) then takes one round trip,
        not a lookup first."""
        count = self.config.replication if replicas is None else replicas
        if self._recently_located(key, count) is not None:
            return
        with default_purpose(f"locate {key_kind(key)}"):
            found = await self.find_nearest(key_id(key), count=count)
        self._remember_located(key, found.nearest[:count], count)

    def _recently_located(self, key: str, count: int) -> list[Contact] | None:
        """The ``count`` (or more) nearest nodes a lookup of ``key`` found within
        ``locate_ttl``, unless one of them has failed since (a store to it failed, or it is
        banned) or a node heard from since is nearer the key than the farthest of them (a
        newcomer would hold only its handoff's records): then the key is looked up again."""
        entry = self._located.get(key)
        if entry is None:
            return None
        at, nearest = entry
        if len(nearest) < count:
            return None
        now = trio.current_time()
        banned = self.protocol.blacklist
        kid = key_id(key)
        farthest = max(node_id(c.peer) ^ kid for c in nearest[:count])
        known = {c.peer for c in nearest}
        if (
            now - at > self.config.locate_ttl
            or any(banned.is_banned(c.peer.digest, now) for c in nearest)
            or any(
                e.last_seen > at and e.id ^ kid < farthest and e.peer not in known
                for e in self.routing.nearest(kid, count)
            )
        ):
            del self._located[key]
            return None
        return nearest

    def _remember_located(self, key: str, nearest: list[Contact], count: int) -> None:
        if self.config.locate_ttl <= 0 or len(nearest) < count:
            return  # a small (or still forming) network: look again next time
        self._located.pop(key, None)
        self._located[key] = (trio.current_time(), nearest)
        while len(self._located) > _MAX_LOCATED:
            del self._located[next(iter(self._located))]  # the oldest

    # --- get -----------------------------------------------------------------------------
    def follow(
        self,
        key: str,
        *,
        holders: int | None = None,
        relocate_interval: float = 30.0,
        sweep_every: int = 8,
        lapse_grace: float = 30.0,
    ) -> KeyFollower:
        """A reader of ``key`` for frequent re-reads: after a lookup, only what changed is
        fetched (see :mod:`p2p.dht.follow`)."""
        return KeyFollower(
            self,
            key,
            holders=holders,
            relocate_interval=relocate_interval,
            sweep_every=sweep_every,
            lapse_grace=lapse_grace,
        )

    async def get(
        self, key: str, *, latest: bool = True, quorum: int | None = None, repair: bool = True
    ) -> DHTValue | None:
        """The value under ``key``: a ValueWithExpiration, or for a dictionary value a
        ``{subkey: ValueWithExpiration}``; None when nothing live is found.

        With ``latest=False`` a value held locally is returned without a network lookup.
        ``quorum`` overrides ``get_quorum`` (0: ask all the nearest nodes): a dictionary whose
        subkeys were stored on different nodes (e.g. by both sides of a healed partition) is
        then read whole, at the cost of a full lookup. ``repair=False`` gives the nodes that
        lack some records nothing: right for a key whose writers rewrite their records often
        anyway (with repair, each whole read of an n-writer key stores up to ``replication``
        records per missing one).
        """
        if quorum is not None:
            return decode_view(await self._lookup_value(key, quorum, repair=repair))
        return decode_view(await self.get_view(key, latest=latest))

    async def get_view(self, key: str, *, latest: bool = True) -> View | None:
        """The merged records of ``key``; concurrent gets of one key share one search."""
        if not latest:
            held = self._local_records(key)
            if held:
                return merge_views(held)
        shared = self._gets.get(key)
        if shared is None:
            shared = self._gets[key] = _SharedGet()
            self._nursery.start_soon(self._search, key, shared)
        await shared.done.wait()
        if shared.error is not None:
            raise shared.error
        return shared.view

    def _local_records(self, key: str) -> list[Record]:
        now = self.now()
        return view_records(self.storage.get(key, now)) + view_records(self.cache.get(key, now))

    async def _search(self, key: str, shared: _SharedGet) -> None:
        try:
            shared.view = await self._lookup_value(key)
        except P2PError as e:
            shared.error = e
        finally:
            del self._gets[key]
            shared.done.set()

    async def _lookup_value(
        self, key: str, quorum: int | None = None, *, repair: bool = True
    ) -> View | None:
        """Look the key up; stop once ``quorum`` (default ``get_quorum``) nodes answered with
        valid live records. A whole lookup (quorum 0) also locates the key for the next
        store of it (:meth:`_recently_located`)."""
        quorum = self.config.get_quorum if quorum is None else quorum
        verdicts: dict[tuple, bool] = {}  # each distinct record is validated once
        holders: set[PeerID] = set()

        def valid(r: Record, now: float) -> bool:
            ident = (r.subkey, r.value, r.expiration, r.proof)
            ok = verdicts.get(ident)
            if ok is None:
                why = self.validators.reason(r)
                ok = verdicts[ident] = why is None
                if why is not None:
                    self.note_invalid(r, why)
            # (a record that lives longer than its key allows came from a node that does
            # not check: it is dropped as the honest nodes refuse it)
            return (
                ok
                and r.expiration > now
                and self.validators.lifetime_reason(r, now, self.config.max_ttl) is None
            )

        def enough(peer: PeerID, records: list[Record]) -> bool:
            now = self.now()
            if any(valid(r, now) for r in records):
                holders.add(peer)
            return 0 < quorum <= len(holders)

        found = await self.find_nearest(key_id(key), key, enough)
        if quorum == 0:
            self._remember_located(key, found.nearest, self.config.replication)
        now = self.now()
        good: dict[tuple, Record] = {}
        for records in found.records.values():
            for r in records:
                if valid(r, now):
                    good.setdefault((r.subkey, r.value, r.expiration, r.proof), r)
        bad = sum(not ok for ok in verdicts.values())
        if bad:
            self.protocol.stats["invalid_records_seen"] += bad
        view = merge_views([*good.values(), *self._local_records(key)])
        if repair and view is not None and self.protocol.nursery is not None:  # not closing
            with purpose("repair"):
                self._nursery.start_soon(self._repair_and_cache, found, view_records(view))
        return view

    async def _repair_and_cache(self, found: LookupResult, want: list[Record]) -> None:
        """Give the latest records to the nearest answering nodes lacking them (repair), and
        cache them at the closest node further along the lookup path that lacks them."""

        def missing(peer: PeerID) -> list[Record]:
            got = {(r.subkey, r.value, r.expiration) for r in found.records.get(peer, [])}
            return [r for r in want if (r.subkey, r.value, r.expiration) not in got]

        async with trio.open_nursery() as nursery:
            repl = self.config.replication
            for contact in found.responders[:repl]:
                if lacking := missing(contact.peer):
                    nursery.start_soon(self.protocol.store, contact, lacking)
            if self.config.cache_on_path:
                for contact in found.responders[repl:]:
                    if lacking := missing(contact.peer):
                        nursery.start_soon(_store_cached, self.protocol, contact, lacking)
                        break

    # --- maintenance ---------------------------------------------------------------------
    async def _maintenance(self) -> None:
        while True:
            await trio.sleep(self.config.maintenance_interval)
            await self.maintain()

    async def _refresh_empty(self, buckets: list[Any], now: float) -> None:
        await self.find_nearest(node_id(self.peer_id), count=self.config.alpha)
        for bucket in buckets:
            bucket.last_updated = max(bucket.last_updated, now)

    async def _refresh_bucket(self, bucket: Any) -> None:
        # A refresh only has to meet a few live nodes of the range (its answers refresh the
        # bucket, a dead member fails and leaves): a lookup for alpha nodes, whose answers
        # carry 2 * alpha contacts, not a full lookup's k each (3x fewer bytes at k=20).
        await self.find_nearest(random_id(bucket.lo, bucket.hi), count=self.config.alpha)

    def _should_greet(self, now: float) -> bool:
        """Greet the initial peers when the table is short of ``k`` and it shrank since the
        last greeting (we may be getting cut off), or a refresh interval went by: a network
        of fewer than k + 1 nodes is always short, and greeting at every maintenance pinged
        the initial peers every 10 s for the whole run."""
        size = len(self.routing)
        if not self.initial_peers or size >= self.config.k:
            return False
        if self._greeted is None:
            return True
        at, then = self._greeted
        # A greeting that reached nobody (we are cut off) is tried again at every maintenance
        # (a dial that fails; nothing else is sent), so a partition's side that evicted
        # everyone else rejoins within one maintenance of the heal, not a refresh interval.
        again = (
            self.config.maintenance_interval if self._greet_misses else self.config.refresh_interval
        )
        return size < then or now - at >= again

    async def maintain(self) -> None:
        """Purge expired records, refresh stale buckets, republish what was not re-stored."""
        now = self.now()
        self.storage.purge(now)
        self.cache.purge(now)
        mono = trio.current_time()
        stale = self.routing.stale_buckets(mono, self.config.refresh_interval)
        # Empty stale buckets share one lookup of our own ID: buckets are empty only near our
        # ID (farther ranges hold more nodes), so a node in one of them would be among our
        # nearest, which that lookup finds (one lookup each found nothing new).
        empty = [b for b in stale if not b.peers]
        with purpose("refresh"):
            async with trio.open_nursery() as nursery:
                if self._should_greet(mono):
                    self._greeted = (mono, len(self.routing))
                    nursery.start_soon(self._reping_initial_peers)
                for bucket in stale:
                    if bucket.peers:
                        nursery.start_soon(self._refresh_bucket, bucket)
                if empty:
                    nursery.start_soon(self._refresh_empty, empty, mono)
        if self.client_mode:
            return
        # Kademlia's republish, less what needs none: a key some STORE brought within the
        # interval (its writer or another holder re-sent it to the nearest nodes), and a
        # record that expires before the next republish would come (its writer renews it or
        # lets it go: relay adverts, progress reports, group keys live minutes).
        interval = self.config.republish_interval
        due = [
            r
            for r in self.storage.records(now)
            if now - (self.storage.last_received(r.key) or now) >= interval
            and r.expiration - now > interval
        ]
        if due:
            self.protocol.stats["republished"] += len(due)
            for rec in due:
                self.storage.store(rec, now)  # marks them received now
            try:
                with purpose("republish"):
                    await self.store_records(due)
            except InvalidRecordError as e:  # e.g. validators changed since it was stored
                log.warning("republishing failed: %s", e)


@dataclass
class _SharedGet:
    done: trio.Event = field(default_factory=trio.Event)
    view: View | None = None
    error: P2PError | None = None


async def _store_cached(protocol: DHTProtocol, contact: Contact, records: list[Record]) -> None:
    await protocol.store(contact, records, cache=True)


@asynccontextmanager
async def open_dht(
    node: Any,
    *,
    initial_peers: Sequence[str | Multiaddr] = (),
    config: DHTConfig = DHTConfig(),
    client_mode: bool = False,
    validators: Iterable[RecordValidator] = (),
    clock: DHTClock | None = None,
) -> AsyncIterator[DHT]:
    """Run a DHT on ``node`` for the block; raises BootstrapError if no initial peer answers.

    With no initial peers the node starts a new DHT (the first bootstrap node).
    """
    dht = DHT(node, config=config, client_mode=client_mode, validators=validators, clock=clock)
    failed: BootstrapError | None = None
    async with trio.open_nursery() as nursery:
        dht.protocol.nursery = nursery
        dht.protocol.register()
        try:
            try:
                await dht.bootstrap(initial_peers)
            except BootstrapError as e:
                failed = e  # raised below, outside the nursery, unwrapped
            else:
                nursery.start_soon(dht._maintenance)
                yield dht
        finally:
            dht.protocol.nursery = None
            dht.protocol.unregister()
            nursery.cancel_scope.cancel()
    if failed is not None:
        raise failed
