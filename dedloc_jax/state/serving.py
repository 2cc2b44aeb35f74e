"""The donor side of state sync: serving this peer's state, and what donors announce.

Donors announce ``{epoch, digest, lineage, vouches}`` under ``<run_id>.state`` (one signed
subkey each; ``lineage`` is the digests of the states it descends from, newest first;
``vouches`` its own signed vouch for the state it stepped to, naming the mates it averaged
with, and the vouches of mates naming it: :mod:`dedloc_jax.state.vouching`) and
answer two RPCs: the manifest of a digest, and one chunk of it. The announcement record is
written and read here, so its format has one home.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import numpy as np
import trio

from dedloc_jax.progress import MAX_DIGEST
from dedloc_jax.run_dht import RunDHT
from dedloc_jax.state.chunks import (
    NonFiniteStateError,
    StateAssembler,
    StateError,
    StateManifest,
    chunk_of,
    first_non_finite,
    pack_state,
)
from dedloc_jax.state.lineage import LINEAGE, Announcement, fork_verdict
from dedloc_jax.state.vouching import (
    MAX_COFOUNDERS,
    MAX_VOUCHES,
    Vouch,
    VouchBook,
    sign_vouch,
    vouched_names,
)
from p2p.dht import InvalidRecordError, follower_replicas
from p2p.dht.records import owner_marker, owner_markers
from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr
from p2p.node import Node
from p2p.rpc import CallContext

log = logging.getLogger(__name__)

MANIFEST = "collab.state.manifest"
CHUNK = "collab.state.chunk"
TRUSTED = "collab.state.trusted"  # whom this peer trusts (a newcomer joined through it asks)
TRUST_REFRESH = 5.0  # seconds between the announcement reads answers to TRUSTED make
_KEEP = 2  # snapshots kept, so a download started before our last step can finish
_MAX_DIGEST = MAX_DIGEST
VOUCH_RETRY = 2.0  # seconds between re-announcements while our mates' vouches are missing
VOUCH_TRIES = 15  # of them, per state


def state_key(run_id: str) -> str:
    return f"{run_id}.state"


class StateServer:
    """Serves this peer's latest state snapshots to others."""

    def __init__(
        self,
        node: Node,
        dht: RunDHT,
        run_id: str,
        *,
        chunk_bytes: int,
        ttl: Callable[[], float],
        admit: Callable[[PeerID], Awaitable[None]] | None = None,
        mates: Callable[[int], Iterable[str]] | None = None,
        book: VouchBook | None = None,
    ) -> None:
        self.node = node
        self.dht = dht
        self.run_id = run_id
        self.chunk_bytes = chunk_bytes
        # How long the next announcement lives (the progress record's lifetime: long while the
        # next step is far, so that rare steps do not mean frequent renewals).
        self.ttl = ttl
        self._snapshots: dict[bytes, tuple[StateManifest, bytes]] = {}
        self.latest: StateManifest | None = None
        self.lineage: tuple[bytes, ...] = ()  # the digests ``latest`` descends from
        # The state this peer trains on: (epoch, digest), set by set_state and by a download
        # (adopt); the next step's state descends from it.
        self._head: tuple[int, bytes] | None = None
        self.renew_at = -float("inf")  # trio time to renew the last announcement that went out
        self.chunks_served = 0
        # Private runs (dedloc_jax.access): raises ValueError unless the peer may take part.
        self.admit = admit
        # Who averaged with us into an epoch (named in our vouch for the state we step to),
        # and where the vouches read from announcements are kept (see state.vouching).
        self.mates = mates
        self.book = book
        self._own_vouch: Vouch | None = None
        self._vouches: dict[tuple[str, int, bytes], Vouch] = {}  # mates' vouches naming us
        self._vouch_tries = 0
        # The ancestors of a state we downloaded, as the announcements that chose it named
        # them: not announced while we hold it (a copy is no vote), named after our next step.
        self._ancestry: tuple[bytes, ...] = ()
        self._trust_read_at = -float("inf")  # trio time of the last read for TRUSTED
        self._trust_lock = trio.Lock()

    def register(self) -> None:
        self.node.add_handler(MANIFEST, self._handle_manifest)
        self.node.add_handler(CHUNK, self._handle_chunk)
        self.node.add_handler(TRUSTED, self._handle_trusted)

    def set_state(self, arrays: Sequence[np.ndarray], epoch: int) -> StateManifest:
        """Serve ``arrays`` as our state of ``epoch`` from now on. NonFiniteStateError (and
        nothing changes) when they hold a NaN or an infinity."""
        bad = first_non_finite(arrays)
        if bad is not None:
            raise NonFiniteStateError(
                f"the state of epoch {epoch} holds a NaN or an infinity (array {bad}): the run "
                "diverged; not serving it"
            )
        manifest, buffer = pack_state(arrays, epoch, chunk_bytes=self.chunk_bytes)
        self._snapshots[manifest.digest] = (manifest, buffer)
        while len(self._snapshots) > _KEEP:
            del self._snapshots[next(iter(self._snapshots))]
        head = self._head
        if head is not None and head[0] == epoch - 1:
            # a step from it (from a downloaded state: its ancestors as the others named them,
            # or a peer that loaded, then stepped, counted at no fork before its load, and a
            # healed partition's majority of such peers lost to the minority's two)
            self.lineage = (head[1], *(self.lineage or self._ancestry))[:LINEAGE]
        elif head != (epoch, manifest.digest):
            self.lineage = ()  # whose descendant it is, we do not know
        self._ancestry = ()
        stepped = head is not None and head[0] == epoch - 1
        self._head = (epoch, manifest.digest)
        self.latest = manifest
        if head != self._head:  # a new state: vouch for it when we averaged into it
            mates = list(self.mates(epoch)) if self.mates is not None and stepped else []
            if self.book is not None:
                self.book.anchor(mates)
            self._own_vouch = (
                sign_vouch(self.node.identity, self.run_id, epoch, manifest.digest, mates)
                if mates
                else None
            )
            self._vouch_tries = 0
        return manifest

    def head_at(self, epoch: int) -> bytes | None:
        """The digest of the state we step from at ``epoch`` (None: we hold none of it)."""
        head = self._head
        return head[1] if head is not None and head[0] == epoch else None

    def hold(
        self,
        manifest: StateManifest,
        arrays: Sequence[np.ndarray],
        ancestry: Sequence[bytes] = (),
    ) -> None:
        """Serve a state downloaded from others under its own manifest (its digest, which the
        others' fork checks count and ours asks of, whatever our chunk size); our next step
        descends from it, and from ``ancestry`` (its ancestors' digests, newest first, as the
        others name them). NonFiniteStateError (and nothing changes) for a non-finite state."""
        bad = first_non_finite(arrays)
        if bad is not None:
            raise NonFiniteStateError(
                f"the state of epoch {manifest.epoch} holds a NaN or an infinity (array {bad}): "
                "not serving it"
            )
        self.adopt(manifest.epoch, manifest.digest)
        self._ancestry = tuple(ancestry)[:LINEAGE]
        self._snapshots[manifest.digest] = (manifest, b"".join(a.tobytes() for a in arrays))
        while len(self._snapshots) > _KEEP:
            del self._snapshots[next(iter(self._snapshots))]
        self.latest = manifest

    def adopt(self, epoch: int, digest: bytes) -> None:
        """We now train on another peer's state (``digest`` of ``epoch``, downloaded): our
        next step descends from it, not from what we served."""
        if self._head != (epoch, digest):
            self._head = (epoch, digest)
            self.lineage = ()
            self._ancestry = ()
            self._own_vouch = None

    @property
    def vouched(self) -> bool:
        """Whether a mate's vouch names us (we averaged with another peer)."""
        return bool(self._vouches)

    def _wants_vouch(self) -> bool:
        """Our own state's vouch is out, none of its mates' is in yet (retry soon)."""
        own = self._own_vouch
        return (
            own is not None
            and self._vouch_tries < VOUCH_TRIES
            and not any(
                (v.epoch, v.digest) == (own.epoch, own.digest) for v in self._vouches.values()
            )
        )

    def _collect(self, offered: Sequence[Vouch]) -> None:
        """Keep the newest valid vouches mates signed naming us (our averaging history)."""
        me = str(self.node.peer_id)
        for v in offered:
            key = (v.signer, v.epoch, v.digest)
            if key not in self._vouches and me in v.mates and v.valid(self.run_id):
                self._vouches[key] = v
        newest = sorted(self._vouches.items(), key=lambda kv: -kv[1].epoch)[: MAX_VOUCHES - 1]
        self._vouches = dict(newest)

    def _vouches_out(self) -> list[list]:
        """Our own vouch, then the mates' naming us, newest first (bounded)."""
        theirs = sorted(self._vouches.values(), key=lambda v: -v.epoch)
        own = [self._own_vouch] if self._own_vouch is not None else []
        return [v.to_wire() for v in (*own, *theirs)[:MAX_VOUCHES]]

    async def announce(self) -> None:
        if self.latest is None:
            return
        ttl = self.ttl()
        if self._wants_vouch():
            # Our mates announce the state they stepped to as we do: read theirs for their
            # vouches naming us (one read per step, a few more while none is in).
            self._vouch_tries += 1
            offered: list[Vouch] = []
            try:
                await read_announcements(
                    self.node, self.dht, self.run_id, book=self.book, offered=offered
                )
            except (P2PError, InvalidRecordError) as e:
                log.debug("could not read the state announcements for vouches: %s", e)
            self._collect(offered)
        try:
            await self.dht.store(
                state_key(self.run_id),
                {
                    "epoch": self.latest.epoch,
                    "digest": self.latest.digest,
                    "lineage": list(self.lineage),
                    "addrs": [str(a) for a in self.node.addrs],
                    "vouches": self._vouches_out(),
                },
                self.dht.now() + ttl,
                subkey=owner_marker(self.node.peer_id),
                # re-announced every epoch and read from all the key's nearest nodes: a few
                # replicas suffice (see docs/decisions.md, "Stores on every replica")
                replicas=follower_replicas(self.dht.config),
            )
            self.renew_at = trio.current_time() + (VOUCH_RETRY if self._wants_vouch() else ttl / 3)
        except (P2PError, InvalidRecordError) as e:
            log.warning("could not announce state: %s", e)

    def held(self, digest: bytes) -> tuple[StateManifest, list[np.ndarray]] | None:
        """The state of ``digest`` if this peer holds it (a download may then skip the wire)."""
        snapshot = self._snapshots.get(digest)
        if snapshot is None:
            return None
        manifest, buffer = snapshot
        assembler = StateAssembler(manifest)
        for i in range(manifest.num_chunks):
            assembler.add(i, chunk_of(buffer, manifest, i))
        return manifest, assembler.arrays()

    async def _handle_trusted(self, ctx: CallContext, request: Any) -> Any:
        """Whom we trust (:meth:`VouchBook.trusted_peers`), read afresh from the announcements
        at most every :data:`TRUST_REFRESH` seconds (the first read grounds a book that trusted
        every signer: :meth:`VouchBook.ground`)."""
        if self.admit is not None:
            await self.admit(ctx.remote_peer)
        if self.book is None:
            return {"peers": []}
        self._introduced(request)
        async with self._trust_lock:
            if trio.current_time() - self._trust_read_at >= TRUST_REFRESH:
                self._trust_read_at = trio.current_time()
                try:
                    await read_announcements(self.node, self.dht, self.run_id, book=self.book)
                except (P2PError, InvalidRecordError) as e:
                    log.debug("could not read the state announcements for a trust query: %s", e)
        return {"peers": self.book.trusted_peers()}

    def _introduced(self, request: Any) -> None:
        """A peer joined through us and other roots names them all (``roots``: their
        addresses): before we trust anyone, they are our co-founders (:meth:`VouchBook.cofound`),
        whom we ask whom they trust (:meth:`LocalState.keep_referred`)."""
        named = request.get("roots") if isinstance(request, dict) else None
        if not isinstance(named, list) or self.book is None or self.book.grounded:
            return
        me, roots = str(self.node.peer_id), []
        for text in named[: MAX_COFOUNDERS + 1]:
            try:
                addr = Multiaddr.parse(text) if isinstance(text, str) else None
            except P2PError:
                continue
            if addr is None or addr.peer_id is None:
                continue
            roots.append(str(addr.peer_id))
            if str(addr.peer_id) != me:
                self.node.peerstore.add_addrs(addr.peer_id, [addr])
        if me in roots and self.book.cofound(roots, me):
            log.info("a peer joined through us and %d other roots: our co-founders", len(roots) - 1)

    def _snapshot(self, request: Any) -> tuple[StateManifest, bytes]:
        if isinstance(request, dict) and request.get("latest") is True and self.latest:
            return self._snapshots[self.latest.digest]
        digest = request.get("digest") if isinstance(request, dict) else None
        if not isinstance(digest, bytes) or digest not in self._snapshots:
            raise ValueError("no such state (it may have been replaced by a newer one)")
        return self._snapshots[digest]

    async def _handle_manifest(self, ctx: CallContext, request: Any) -> Any:
        if self.admit is not None:
            await self.admit(ctx.remote_peer)
        return self._snapshot(request)[0].to_wire()

    async def _handle_chunk(self, ctx: CallContext, request: Any) -> Any:
        if self.admit is not None:
            await self.admit(ctx.remote_peer)
        manifest, buffer = self._snapshot(request)
        index = request.get("index")
        if not isinstance(index, int):
            raise ValueError("chunk index must be an integer")
        try:
            data = chunk_of(buffer, manifest, index)
        except StateError as e:
            raise ValueError(str(e)) from None
        self.chunks_served += 1
        return data


async def read_announcements(
    node: Node,
    dht: RunDHT,
    run_id: str,
    *,
    whole: bool = False,
    book: VouchBook | None = None,
    offered: list[Vouch] | None = None,
) -> list[Announcement]:
    """Every other peer's announced state (malformed ones are skipped and logged).
    ``whole`` asks all the key's nearest nodes: counting lineages needs every announcement,
    and after a partition each side's went to the nodes that side could reach. It repairs
    nothing: every peer re-announces each epoch.

    An announcement is ``vouched`` when one of its vouches, signed by another peer, names its
    peer (verified here; ``book`` remembers the peer). ``offered`` gets each announcer's own
    vouch naming this peer (unverified: the caller checks it)."""
    me = str(node.peer_id)
    value = await dht.get(state_key(run_id), quorum=0 if whole else None, repair=not whole)
    found: list[Announcement] = []
    carried: list[list[Vouch]] = []  # each announcement's vouches
    if not isinstance(value, dict):
        return found
    for subkey, item in value.items():
        names = owner_markers(subkey)
        v = item.value
        if len(names) != 1 or names[0] == str(node.peer_id) or not isinstance(v, dict):
            continue
        epoch, digest, addrs = v.get("epoch"), v.get("digest"), v.get("addrs", [])
        lineage, wire_vouches = v.get("lineage", []), v.get("vouches", [])
        if not (
            isinstance(epoch, int)
            and isinstance(digest, bytes)
            and isinstance(addrs, list)
            and isinstance(lineage, list)
            and len(lineage) <= LINEAGE
            and all(isinstance(d, bytes) and len(d) <= _MAX_DIGEST for d in lineage)
            and isinstance(wire_vouches, list)
            and len(wire_vouches) <= MAX_VOUCHES
        ):
            # (the run's schema refuses these where they are stored and read: debug only)
            log.debug("ignoring a malformed state offer of %s", names[0][:8])
            continue
        try:
            pid = PeerID.from_base58(names[0])
            node.peerstore.add_addrs(pid, [Multiaddr.parse(a) for a in addrs[:8]])
        except (P2PError, TypeError) as e:
            log.debug("ignoring a malformed state offer: %s", e)
            continue
        vouches = [w for w in map(Vouch.from_wire, wire_vouches) if w is not None]
        if offered is not None:
            offered.extend(w for w in vouches if me in w.mates and w.signer == names[0])
        found.append(Announcement(pid, epoch, digest, tuple(lineage)))
        carried.append(vouches)
    # Vouched: named by a trusted signer (with a book: our mates, us, and whom they vouched
    # for, found until nothing changes; a Sybil's word for another Sybil never starts a
    # chain), in any announcement: a vouch is as good where another peer carries it. Only the
    # ones each peer carries about itself left a healed partition's minority, whose mates'
    # vouches name nobody on the other side, trusting none of the majority (issue 46).
    if book is not None and not book.grounded:
        # (the run's first peer: its first vouches read are whom it trusts from now on)
        book.ground(v.signer for vouches in carried for v in vouches if v.valid(run_id))
    trusted = None if book is None else (lambda signer: signer == me or book.trusts(signer))
    every = [v for vouches in carried for v in vouches]
    named = vouched_names(run_id, every, trusted)
    vouched = [str(a.peer) in named for a in found]
    if book is None:
        return [dataclasses.replace(a, vouched=v) for a, v in zip(found, vouched, strict=True)]
    for a, v in zip(found, vouched, strict=True):
        if v:
            book.record(str(a.peer))
    if book.referred:  # the peers those our roots trust vouched for are endorsed too
        book.endorse(vouched_names(run_id, every, book.endorses))
    return [
        dataclasses.replace(a, vouched=v, endorsed=book.endorsed(str(a.peer)))
        for a, v in zip(found, vouched, strict=True)
    ]


async def state_forked(
    node: Node,
    dht: RunDHT,
    run_id: str,
    epoch: int,
    digest: bytes,
    *,
    lineage: Sequence[bytes] = (),
    patience: float = 0.0,
    vouched: bool = False,
) -> bool:
    """:func:`fork_verdict` over the states peers announce now; while it cannot tell, read
    again (every second) for up to ``patience`` seconds, then answer False."""
    deadline = trio.current_time() + patience
    while True:
        announced = await read_announcements(node, dht, run_id, whole=True)
        verdict = fork_verdict(announced, epoch, digest, lineage, vouched)
        left = deadline - trio.current_time()
        if verdict is not None or left <= 0:
            return bool(verdict)
        await trio.sleep(min(1.0, left))
