"""State sync: up-to-date peers serve their state; newcomers download it, verified.

Donors announce ``{epoch, digest, lineage}`` under ``<run_id>.state`` (one signed subkey
each; ``lineage`` is the digests of the states it descends from, newest first) and
answer two RPCs: the manifest of a digest, and one chunk of it. A newcomer picks the newest
epoch that donors announce, fetches the manifest, checks that its digest is the announced one,
then fetches chunks from all donors of that digest at once, checks each chunk against the
manifest, and when a donor leaves or lies, re-plans its chunks over the remaining donors.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import trio

from dedloc_jax.lineage import (
    LINEAGE,
    Announcement,
    fork_choice,
    fork_verdict,
)
from dedloc_jax.progress import MAX_DIGEST
from dedloc_jax.state_chunks import (
    StateAssembler,
    StateError,
    StateManifest,
    chunk_of,
    pack_state,
    plan_downloads,
)
from p2p.dht import DHT, InvalidRecordError, follower_replicas
from p2p.dht.records import owner_marker, owner_markers
from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr
from p2p.rpc import CallContext

log = logging.getLogger(__name__)

MANIFEST = "collab.state.manifest"
CHUNK = "collab.state.chunk"
_KEEP = 2  # snapshots kept, so a download started before our last step can finish
_MAX_DIGEST = MAX_DIGEST


class StateSyncError(RuntimeError):
    """No verified state could be downloaded (no donors, or all of them failed)."""


class StaleStateError(StateSyncError):
    """The state a download would bring is older than the caller wants (nothing was
    downloaded, and the peer's own state and epoch stand)."""


def state_key(run_id: str) -> str:
    return f"{run_id}.state"


class StateServer:
    """Serves this peer's latest state snapshots to others."""

    def __init__(self, node: Any, dht: DHT, run_id: str, *, chunk_bytes: int, ttl: float) -> None:
        self.node = node
        self.dht = dht
        self.run_id = run_id
        self.chunk_bytes = chunk_bytes
        self.ttl = ttl
        self._snapshots: dict[bytes, tuple[StateManifest, bytes]] = {}
        self.latest: StateManifest | None = None
        self.lineage: tuple[bytes, ...] = ()  # the digests ``latest`` descends from
        # The state this peer trains on: (epoch, digest), set by set_state and by a download
        # (adopt); the next step's state descends from it.
        self._head: tuple[int, bytes] | None = None
        self.announced_at = -float("inf")  # trio time of the last announcement that went out
        self.chunks_served = 0
        # Private runs (dedloc_jax.access): raises ValueError unless the peer may take part.
        self.admit: Callable[[PeerID], Awaitable[None]] | None = None

    def register(self) -> None:
        self.node.add_handler(MANIFEST, self._handle_manifest)
        self.node.add_handler(CHUNK, self._handle_chunk)

    def set_state(self, arrays: Sequence[np.ndarray], epoch: int) -> StateManifest:
        manifest, buffer = pack_state(arrays, epoch, chunk_bytes=self.chunk_bytes)
        self._snapshots[manifest.digest] = (manifest, buffer)
        while len(self._snapshots) > _KEEP:
            del self._snapshots[next(iter(self._snapshots))]
        head = self._head
        if head is not None and head[0] == epoch - 1:
            self.lineage = (head[1], *self.lineage)[:LINEAGE]  # a step from it
        elif head != (epoch, manifest.digest):
            self.lineage = ()  # whose descendant it is, we do not know
        self._head = (epoch, manifest.digest)
        self.latest = manifest
        return manifest

    def head_at(self, epoch: int) -> bytes | None:
        """The digest of the state we step from at ``epoch`` (None: we hold none of it)."""
        head = self._head
        return head[1] if head is not None and head[0] == epoch else None

    def hold(self, manifest: StateManifest, arrays: Sequence[np.ndarray]) -> None:
        """Serve a state downloaded from others under its own manifest (its digest, which the
        others' fork checks count and ours asks of, whatever our chunk size); our next step
        descends from it."""
        self.adopt(manifest.epoch, manifest.digest)
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

    async def announce(self) -> None:
        if self.latest is None:
            return
        try:
            await self.dht.store(
                state_key(self.run_id),
                {
                    "epoch": self.latest.epoch,
                    "digest": self.latest.digest,
                    "lineage": list(self.lineage),
                    "addrs": [str(a) for a in self.node.addrs],
                },
                self.dht.now() + self.ttl,
                subkey=owner_marker(self.node.peer_id),
                # re-announced every epoch and read from all the key's nearest nodes: a few
                # replicas suffice (see docs/decisions.md, "Stores on every replica")
                replicas=follower_replicas(self.dht.config),
            )
            self.announced_at = trio.current_time()
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


async def find_donors(
    node: Any, dht: DHT, run_id: str, extra: Sequence[Announcement] = ()
) -> tuple[int, bytes, list[PeerID]] | None:
    """The state to download: (epoch, digest, donors), or None. :func:`fork_choice` over
    every announcement, and over ``extra`` (the states the progress table names, which the
    fork checks count: choosing from the state key alone, whose reads miss some peers, had
    peers load the lineage their next check rejected). Per peer, its newest one counts."""
    newest: dict[str, Announcement] = {}
    for a in (*await _announcements(node, dht, run_id, whole=True), *extra):
        known = newest.get(str(a.peer))
        if known is None or a.epoch > known.epoch:
            newest[str(a.peer)] = a
    chosen = fork_choice(list(newest.values()))
    if chosen is None:
        return None
    donors = []
    for a in newest.values():
        if (a.epoch, a.digest) == chosen:
            try:
                donors.append(a.peer if isinstance(a.peer, PeerID) else PeerID.from_base58(a.peer))
            except P2PError:
                continue
    return chosen[0], chosen[1], sorted(donors)


async def state_forked(
    node: Any,
    dht: DHT,
    run_id: str,
    epoch: int,
    digest: bytes,
    *,
    lineage: Sequence[bytes] = (),
    patience: float = 0.0,
) -> bool:
    """:func:`fork_verdict` over the states peers announce now; while it cannot tell, read
    again (every second) for up to ``patience`` seconds, then answer False."""
    deadline = trio.current_time() + patience
    while True:
        announced = await _announcements(node, dht, run_id, whole=True)
        verdict = fork_verdict(announced, epoch, digest, lineage)
        left = deadline - trio.current_time()
        if verdict is not None or left <= 0:
            return bool(verdict)
        await trio.sleep(min(1.0, left))


async def _offers(
    node: Any, dht: DHT, run_id: str, *, whole: bool = False
) -> dict[tuple[int, bytes], list[PeerID]]:
    """Every announced state: (epoch, digest) -> the peers announcing it (not this one)."""
    offers: dict[tuple[int, bytes], list[PeerID]] = {}
    for a in await _announcements(node, dht, run_id, whole=whole):
        offers.setdefault((a.epoch, a.digest), []).append(a.peer)
    return offers


async def _announcements(
    node: Any, dht: DHT, run_id: str, *, whole: bool = False
) -> list[Announcement]:
    """Every other peer's announced state (malformed ones are skipped and logged).
    ``whole`` asks all the key's nearest nodes: counting lineages needs every announcement,
    and after a partition each side's went to the nodes that side could reach. It repairs
    nothing: every peer re-announces each epoch."""
    value = await dht.get(state_key(run_id), quorum=0 if whole else None, repair=not whole)
    found: list[Announcement] = []
    if not isinstance(value, dict):
        return found
    for subkey, item in value.items():
        names = owner_markers(subkey)
        v = item.value
        if len(names) != 1 or names[0] == str(node.peer_id) or not isinstance(v, dict):
            continue
        epoch, digest, addrs = v.get("epoch"), v.get("digest"), v.get("addrs", [])
        lineage = v.get("lineage", [])
        if not (
            isinstance(epoch, int)
            and isinstance(digest, bytes)
            and isinstance(addrs, list)
            and isinstance(lineage, list)
            and len(lineage) <= LINEAGE
            and all(isinstance(d, bytes) and len(d) <= _MAX_DIGEST for d in lineage)
        ):
            log.info("ignoring a malformed state offer of %s", names[0][:8])
            continue
        try:
            pid = PeerID.from_base58(names[0])
            node.peerstore.add_addrs(pid, [Multiaddr.parse(a) for a in addrs[:8]])
        except (P2PError, TypeError) as e:
            log.info("ignoring a malformed state offer: %s", e)
            continue
        found.append(Announcement(pid, epoch, digest, tuple(lineage)))
    return found


async def _latest_manifests(
    node: Any, donors: list[PeerID], min_epoch: int, request_timeout: float
) -> tuple[StateManifest | None, list[PeerID]]:
    """Each donor's current manifest; the newest digest held by the most donors."""
    held: dict[bytes, tuple[StateManifest, list[PeerID]]] = {}
    for donor in donors:
        try:
            wire = await node.call(donor, MANIFEST, {"latest": True}, timeout=request_timeout)
            manifest = StateManifest.from_wire(wire)
        except (P2PError, StateError) as e:
            log.info("donor %s gave no current manifest: %s", donor, e)
            continue
        if manifest.epoch >= min_epoch:
            held.setdefault(manifest.digest, (manifest, []))[1].append(donor)
    if not held:
        return None, []
    manifest, agreeing = max(held.values(), key=lambda mv: (mv[0].epoch, len(mv[1])))
    return manifest, agreeing


async def download_state(
    node: Any,
    dht: DHT,
    run_id: str,
    *,
    timeout: float = 60.0,
    request_timeout: float = 10.0,
) -> tuple[int, list[np.ndarray], int]:
    """Download the newest state; returns (epoch, arrays, number of donors used)."""
    manifest, arrays, used = await download_manifest_state(
        node, dht, run_id, timeout=timeout, request_timeout=request_timeout
    )
    return manifest.epoch, arrays, used


async def download_manifest_state(
    node: Any,
    dht: DHT,
    run_id: str,
    *,
    timeout: float = 60.0,
    request_timeout: float = 10.0,
    extra: Sequence[Announcement] = (),
    min_epoch: int | None = None,
    local: Callable[[bytes], tuple[StateManifest, list[np.ndarray]] | None] | None = None,
) -> tuple[StateManifest, list[np.ndarray], int]:
    """:func:`download_state`, with the downloaded state's manifest instead of its epoch;
    ``extra``: more announcements to choose from (see :func:`find_donors`); ``min_epoch``:
    raise :class:`StaleStateError` instead of downloading an older state; ``local``: the
    state of a digest if we hold it (:meth:`StateServer.held`), which then comes from no donor
    (0 donors used): a peer whose round missed part of the epoch asks for the state most
    peers hold, and that is often its own."""

    def check_new_enough(epoch: int) -> None:
        if min_epoch is not None and epoch < min_epoch:
            raise StaleStateError(
                f"the newest state served is of epoch {epoch}, wanted {min_epoch} or newer"
            )

    with trio.move_on_after(timeout) as scope:
        found = await find_donors(node, dht, run_id, extra)
        if found is None:
            raise StateSyncError("no peer announces a state")
        epoch, digest, donors = found
        check_new_enough(epoch)
        held = local(digest) if local is not None else None
        if held is not None:
            return held[0], held[1], 0
        request = {"digest": digest}
        manifest = None
        for donor in donors:
            try:
                wire = await node.call(donor, MANIFEST, request, timeout=request_timeout)
                candidate = StateManifest.from_wire(wire)
            except (P2PError, StateError) as e:
                log.info("donor %s gave no manifest: %s", donor, e)
                continue
            if candidate.digest == digest:
                manifest = candidate
                break
            log.warning("donor %s sent a manifest that does not match its announcement", donor)
        if manifest is None:
            # The announcements we read were stale (e.g. from a cache after a partition): ask
            # the donors what they hold now and take the newest state most of them agree on.
            manifest, donors = await _latest_manifests(node, donors, epoch, request_timeout)
            if manifest is None:
                # The newest state's donors are gone (e.g. killed before their announcement
                # expired): take the newest state that any other announcing peer holds now.
                others = await _offers(node, dht, run_id)
                rest = sorted({d for ds in others.values() for d in ds} - set(found[2]))
                manifest, donors = await _latest_manifests(node, rest, 0, request_timeout)
            if manifest is None:
                raise StateSyncError("no donor served a manifest matching its announcement")
            check_new_enough(manifest.epoch)
            request = {"digest": manifest.digest}
        assembler = StateAssembler(manifest)
        live = list(donors)
        used: set[PeerID] = set()
        while not assembler.complete:
            if not live:
                raise StateSyncError(f"all donors failed with {len(assembler.missing())} left")
            plan = plan_downloads(assembler.missing(), [str(d) for d in live])
            failed: set[str] = set()

            async def fetch(donor: str, indices: list[int], failed: set[str] = failed) -> None:
                pid = PeerID.from_base58(donor)
                for i in indices:
                    try:
                        data = await node.call(
                            pid, CHUNK, {**request, "index": i}, timeout=request_timeout
                        )
                        assembler.add(i, data)
                        used.add(pid)
                    except (P2PError, StateError) as e:
                        log.info("donor %s failed on chunk %d: %s", donor, i, e)
                        failed.add(donor)
                        return

            async with trio.open_nursery() as nursery:
                for donor, indices in plan.items():
                    nursery.start_soon(fetch, donor, indices)
            live = [d for d in live if str(d) not in failed]
        return manifest, assembler.arrays(), len(used)
    assert scope.cancelled_caught
    raise StateSyncError(f"state download did not finish within {timeout} s")
