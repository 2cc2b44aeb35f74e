"""This peer's state in the run (:class:`LocalState`): serving it after each step, loading the
one the fork choice names, and the verdict on whether ours lost a fork."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import trio

from dedloc_jax.run_dht import RunDHT
from dedloc_jax.state.download import (
    GoneDonors,
    ask_cofounders,
    ask_roots,
    download_manifest_state,
    find_donors,
    introduce_roots,
)
from dedloc_jax.state.lineage import Announcement, fork_verdict
from dedloc_jax.state.serving import StateServer
from dedloc_jax.state.vouching import VouchBook
from p2p.node import Node

if TYPE_CHECKING:  # the tracker imports this package
    from dedloc_jax.tracker import ProgressTracker

log = logging.getLogger(__name__)

INTRODUCTIONS = 12  # tries to introduce our roots to each other (see keep_referred)


def ancestry_of(announced: Sequence[Announcement], epoch: int, digest: bytes) -> tuple:
    """The ancestors (newest first) of the state ``digest`` of ``epoch``, as the longest
    lineage among ``announced`` that names it tells (empty when none does)."""
    best: tuple[bytes, ...] = ()
    for a in announced:
        back = a.epoch - epoch
        if back >= 0 and a.digest_at(epoch) == digest and len(a.lineage) - back > len(best):
            best = tuple(a.lineage[back:])
    return best


def mates_into(tracker: ProgressTracker, epoch: int) -> frozenset[str]:
    """The peers that averaged with us into ``epoch`` (named in our vouch of its state)."""
    into, peers = tracker.mates
    return peers if into == epoch else frozenset()


class LocalState:
    """The state this peer serves and loads, published through its progress record
    (``tracker``); ``server`` answers the others' downloads."""

    def __init__(
        self,
        node: Node,
        dht: RunDHT,
        run_id: str,
        server: StateServer,
        tracker: ProgressTracker,
        book: VouchBook,
        *,
        rpc_timeout: float,
        renew_every: float,
        gone: GoneDonors | None = None,
    ) -> None:
        self.node = node
        self.dht = dht
        self.run_id = run_id
        self.server = server
        self.tracker = tracker
        self.book = book
        self.rpc_timeout = rpc_timeout
        self.renew_every = renew_every  # after an announcement that renewed nothing
        # offers of donors that failed us (shared with the tracker: see opening)
        self.gone = gone if gone is not None else GoneDonors(lambda: server.ttl())

    async def share(self, arrays: Sequence[np.ndarray], epoch: int) -> None:
        manifest = self.server.set_state(arrays, epoch)
        self.tracker.serve(epoch, manifest.digest, self.server.lineage)
        await self.server.announce()

    async def load(
        self, *, timeout: float = 60.0, min_epoch: int | None = None
    ) -> tuple[int, list[np.ndarray]]:
        """Download the state the fork choice names, train on it from now on (the tracker's
        epoch becomes its epoch) and serve it (the fork checks, ours and the others', count
        the state a peer serves). ``min_epoch``: raise :class:`StaleStateError` instead when
        that state is older; nothing changes then (a caller that keeps its own state must
        keep its own epoch and lineage too, or its fork check counts it on the others'
        lineage)."""
        manifest, arrays, donors = await download_manifest_state(
            self.node,
            self.dht,
            self.run_id,
            timeout=timeout,
            request_timeout=self.rpc_timeout,
            # the keeper's loads (no minimum) follow the choice that counts our vote, as its
            # checks and newest_epoch do; a minimum asks for a state others serve
            extra=self.counted_states() if min_epoch is None else self.table_states(),
            min_epoch=min_epoch,
            local=self.server.held,
            book=self.book,
            gone=self.gone,
        )
        epoch = manifest.epoch
        self.server.hold(manifest, arrays, ancestry_of(self.table_states(), epoch, manifest.digest))
        log.info("loaded the state of epoch %d from %d donors", epoch, donors)
        self.tracker.set_epoch(epoch)
        self.tracker.serve(epoch, manifest.digest, self.server.lineage)
        await self.server.announce()
        return epoch, arrays

    async def newest_epoch(self) -> int | None:
        """The epoch of the state a download would bring (the newest on the lineage most
        peers hold, :func:`~dedloc_jax.state.lineage.fork_choice`), or None (nobody announces
        one): whether a download would bring anything newer, for one DHT read. The tracker's
        epoch alone cannot tell: after a healed partition, the side that lost may be ahead."""
        found = await find_donors(
            self.node, self.dht, self.run_id, self.counted_states(), self.book, self.gone
        )
        return None if found is None else found[0]

    def table_states(self) -> list[Announcement]:
        """The states the progress table names (every other peer's, as last read)."""
        return self.tracker.announcements()

    def counted_states(self) -> list[Announcement]:
        """The table's states and ours: the fork choice that names the state to load counts
        our vote as our fork check does. Without it, after a healed partition, a peer of the
        majority that fell behind found its side one vote short, lost a 1-1 tie by digest and
        loaded the minority's state, which its fork check had just beaten.

        Our initial state (epoch 0, no lineage: we neither stepped nor loaded) chose nothing and
        is no vote, so a copy ahead (a coordinator's saved state) can win our own choice; it is
        still a state held: with nothing else announced, the choice names it and nothing is
        newer."""
        latest, server = self.server.latest, self.server
        if latest is None:
            return self.table_states()
        initial = latest.epoch == 0 and not server.lineage
        ours = Announcement(
            self.node.peer_id,
            latest.epoch,
            latest.digest,
            server.lineage,
            votes=self.tracker.mode != "aux" and not initial,
            vouched=server.vouched,
            endorsed=self.endorsed,
        )
        return [*self.table_states(), ours]

    @property
    def endorsed(self) -> bool:
        """Whether our roots trust us (:meth:`~dedloc_jax.state.vouching.VouchBook.endorse`)."""
        return self.book.endorsed(str(self.node.peer_id))

    async def on_minority_fork(self, *, patience: float = 0.0, undecided: bool = False) -> bool:
        """Whether the state we serve lost to another lineage (one more peers hold, see
        :func:`~dedloc_jax.state.lineage.fork_verdict`): then load theirs. Ask once the others
        announced the epoch's state, e.g. when ready to average; ``patience``: seconds to keep
        asking (each second) while it cannot tell (also while the table names no state);
        ``undecided``: the answer when it still cannot tell then. A peer whose round missed
        part of the epoch passes True: it is most likely the odd one out.

        It counts the states the progress table names (every peer publishes the state it
        serves with its progress, and follows the table anyway): it reads nothing from the DHT."""
        deadline = trio.current_time() + patience
        while True:
            verdict = self.fork_verdict()
            left = deadline - trio.current_time()
            if verdict is not None:
                return verdict
            if left <= 0:
                log.info("the fork check could not tell within %.0f s", patience)
                return undecided
            await trio.sleep(min(1.0, left))

    def fork_verdict(self) -> bool | None:
        """:meth:`on_minority_fork` asked once, without waiting: None while it cannot tell
        (most peers still average the epoch, or the table names no state)."""
        latest = self.server.latest
        if latest is None or self.tracker.mode == "aux":
            return False  # we serve nothing, or a copy (no vote): nothing to lose
        table = self.table_states()
        # An empty table (a read that failed, records that lapsed in a cut) cannot tell.
        if not table:
            return None
        server = self.server
        return fork_verdict(
            table, latest.epoch, latest.digest, server.lineage, server.vouched, self.endorsed
        )

    def uncounted(self) -> bool:
        """Whether the table names a trainer's state off our lineage that our fork choice
        counts at no rank (neither vouched nor endorsed): another group's, which our roots
        may trust (or a Sybil's)."""
        latest = self.server.latest
        if latest is None:
            return False
        ours = Announcement(self.node.peer_id, latest.epoch, latest.digest, self.server.lineage)
        return any(
            a.votes and not (a.vouched or a.endorsed) and ours.digest_at(a.epoch) != a.digest
            for a in self.table_states()
        )

    async def keep_referred(self, every: float) -> None:
        """While :meth:`uncounted`, ask our roots whom they trust every ``every`` seconds
        (see :mod:`dedloc_jax.state.vouching` on groups that averaged apart): the peers they
        name are endorsed, and outrank the ones our own mates vouch for in the fork choice.
        Joined through several roots, we first introduce them to each other; a first peer
        with co-founders asks them whom they trust (groups with different roots)."""
        book = self.book
        # (only first peers that trust nobody yet take an introduction: a run's first minutes)
        introductions = INTRODUCTIONS if len(book.roots) > 1 else 0
        while True:
            if introductions > 0:
                told = await introduce_roots(self.node, book)
                introductions = 0 if told else introductions - 1
            if book.cofounders and await ask_cofounders(self.node, book):
                log.info("our co-founders named peers they trust: trusting them as our own")
            if book.roots and self.uncounted() and await ask_roots(self.node, book, endorse=True):
                log.info("our roots named peers they trust: their states outrank our mates'")
            await trio.sleep(every)

    async def keep_announced(self) -> None:
        """Keep our announcement from expiring: renew it at a third of its lifetime. Each step
        announces the new state, so only the time since the last announcement counts: with
        epochs shorter than a third of the TTL, this never stores anything."""
        server = self.server
        while True:
            if trio.current_time() < server.renew_at:
                await trio.sleep_until(server.renew_at)
                continue
            await server.announce()
            if trio.current_time() >= server.renew_at:
                await trio.sleep(self.renew_every)  # nothing to announce, or failed
