"""State download: a newcomer fetches the state donors announce, verified.

A newcomer picks the state the fork choice names among the announcements, fetches the
manifest, checks that its digest is the announced one, then fetches chunks from all donors
of that digest at once, checks each chunk against the manifest, and when a donor leaves or
lies, re-plans its chunks over the remaining donors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import numpy as np
import trio

from dedloc_jax.run_dht import RunDHT
from dedloc_jax.state.chunks import StateAssembler, StateError, StateManifest, first_non_finite
from dedloc_jax.state.lineage import Announcement, fork_choice
from dedloc_jax.state.serving import CHUNK, MANIFEST, TRUSTED, read_announcements
from dedloc_jax.state.vouching import MAX_TRUSTED, VouchBook
from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.node import Node

log = logging.getLogger(__name__)


class StateSyncError(RuntimeError):
    """No verified state could be downloaded (no donors, or all of them failed)."""


class StaleStateError(StateSyncError):
    """The state a download would bring is older than the caller wants (nothing was
    downloaded, and the peer's own state and epoch stand)."""


class GoneDonors:
    """Offers whose donor failed a download (unreachable, or broke off): such an offer is no
    offer, nor a vote in the choice of the state to download, until its peer announces another
    state or ``hold`` seconds pass (an announcement's lifetime: a peer gone for good has its
    offer lapse meanwhile, one that failed once is asked again then). A leaver's offer lives
    in the DHT and the progress table until it lapses: a newcomer behind it must not dial it
    again each time it looks for a newer state."""

    def __init__(self, hold: Callable[[], float]) -> None:
        self.hold = hold
        self._gone: dict[str, tuple[int, bytes, float, float]] = {}  # (..., until, failed at)

    def drop(self, peer: PeerID | str, epoch: int, digest: bytes, why: str = "failed") -> None:
        """Drop ``peer``'s offer of (``epoch``, ``digest``); said once (INFO) per peer."""
        (log.debug if str(peer) in self._gone else log.info)(
            "donor %s %s; not asked again until it announces another state", str(peer)[:8], why
        )
        now = trio.current_time()
        self._gone[str(peer)] = (epoch, digest, now + self.hold(), now)

    def failed_at(self, peer: str, epoch: int, digest: bytes) -> float | None:
        """When a download of ``peer``'s offer of (``epoch``, ``digest``) last failed, while
        that offer is dropped (None: it is not). The progress tracker reads it: a state only
        strangers hold backs its epoch for a peer with no history of its own until a download
        of it fails (:meth:`~dedloc_jax.tracker.ProgressTracker.backed_ceiling`)."""
        g = self._gone.get(peer)
        if g is None or g[:2] != (epoch, digest) or g[2] <= trio.current_time():
            return None
        return g[3]

    def offers(self, announced: Iterable[Announcement]) -> list[Announcement]:
        """``announced`` less the offers dropped."""
        now = trio.current_time()
        self._gone = {p: g for p, g in self._gone.items() if g[2] > now}
        return [
            a
            for a in announced
            if self._gone.get(str(a.peer), (None, None))[:2] != (a.epoch, a.digest)
        ]


def _failed(
    gone: GoneDonors | None, donor: PeerID | str, offer: tuple[int, bytes], why: str
) -> None:
    """A donor's network failure: dropped into ``gone`` (which says so), or logged."""
    if gone is None:
        log.info("donor %s %s", donor, why)
    else:
        gone.drop(donor, *offer, why)


async def find_donors(
    node: Node,
    dht: RunDHT,
    run_id: str,
    extra: Sequence[Announcement] = (),
    book: VouchBook | None = None,
    gone: GoneDonors | None = None,
) -> tuple[int, bytes, list[PeerID]] | None:
    """The state to download: (epoch, digest, donors), or None. :func:`fork_choice` over
    every announcement, and over ``extra`` (the states the progress table names, which the
    fork checks count: the state key's reads miss some peers, and a choice from it alone may
    name a lineage the next fork check rejects). Per peer, its newest one counts. ``book``
    keeps the vouches the read proves (the progress table's states are marked by it);
    ``gone``: the offers of donors that failed us, left out."""
    newest = await _newest(node, dht, run_id, extra, book)
    if book is not None and book.orphaned(newest.values()):
        if not await _reach_any(node, book):
            (log.debug if book.orphan_warned else log.warning)(
                "the peers we joined through are gone, and no state is vouched by one they "
                "vouched for (%d unvouched announcers): not following them; waiting (start "
                "again with --initial-peers of the run's peers)",
                len(newest),
            )
            book.orphan_warned = True  # once: the keeper asks again every few seconds
            return None
        # Our roots are here but announce nothing (a bootstrap, a coordinator): their word
        # on whom they trust grounds ours.
        if await ask_roots(node, book):
            newest = await _newest(node, dht, run_id, extra, book)
        if book.orphaned(newest.values()) and await _any_vouch(node, dht, run_id):
            (log.debug if book.orphan_warned else log.warning)(
                "the peers we joined through vouch for none of the %d announced states: not "
                "following unvouched announcers; waiting",
                len(newest),
            )
            book.orphan_warned = True
            return None
    offers = list(newest.values()) if gone is None else gone.offers(newest.values())
    chosen = fork_choice(offers)
    if chosen is None:
        return None
    donors = []
    for a in offers:
        if (a.epoch, a.digest) == chosen and str(a.peer) != str(node.peer_id):  # (ours: held)
            try:
                donors.append(a.peer if isinstance(a.peer, PeerID) else PeerID.from_base58(a.peer))
            except P2PError:
                continue
    return chosen[0], chosen[1], sorted(donors)


async def _newest(
    node: Node,
    dht: RunDHT,
    run_id: str,
    extra: Sequence[Announcement],
    book: VouchBook | None,
) -> dict[str, Announcement]:
    """Per peer, its newest announcement (read, or in ``extra``); the table's copies (peers
    that train nothing) are no votes."""
    newest: dict[str, Announcement] = {}
    copies = {str(a.peer) for a in extra if not a.votes}
    for a in (*await read_announcements(node, dht, run_id, whole=True, book=book), *extra):
        known = newest.get(str(a.peer))
        if known is None or a.epoch > known.epoch:
            newest[str(a.peer)] = replace(a, votes=False) if str(a.peer) in copies else a
    return newest


async def _any_vouch(node: Node, dht: RunDHT, run_id: str) -> bool:
    """Whether any announcement is vouched by anyone (the run has an averaging history: a
    newcomer that traces none of it to its roots must not count unvouched announcers)."""
    return any(a.vouched for a in await read_announcements(node, dht, run_id, whole=True))


async def ask_roots(node: Node, book: VouchBook, *, endorse: bool = False) -> bool:
    """Ask each connected root whom it trusts (:data:`~dedloc_jax.state.serving.TRUSTED`)
    and adopt its answer (a newcomer's trust), or with ``endorse`` endorse it (a peer that
    sees a group it does not count: :meth:`VouchBook.endorse`); whether anything was new.
    Endorsing, it dials a root it is not connected to (a partition broke the connection, and
    the other group's states are what the roots' answer is for)."""
    new = 0
    for name in sorted(book.roots):
        try:
            pid = PeerID.from_base58(name)
        except (P2PError, ValueError):
            continue
        if node.connection_to(pid) is None and not endorse:
            continue
        try:
            answer = await node.call(pid, TRUSTED, {}, timeout=ROOT_DIAL_TIMEOUT)
        except P2PError as e:
            # (asked again every few seconds while endorsing: said once per newcomer's ask)
            (log.debug if endorse else log.info)(
                "the peer we joined through %s did not say whom it trusts: %s", name[:8], e
            )
            continue
        peers = answer.get("peers") if isinstance(answer, dict) else None
        if not isinstance(peers, list):
            continue
        named = [p for p in peers[:MAX_TRUSTED] if isinstance(p, str) and 0 < len(p) <= 64]
        new += book.endorse(named) if endorse else book.adopt(named)
    return new > 0


async def introduce_roots(node: Node, book: VouchBook) -> bool:
    """We joined through several roots: tell each of them all of them (their addresses), so
    that first peers that trust nobody yet take each other as co-founders
    (:meth:`VouchBook.cofound`); whether every root heard it (else: try again later)."""
    addrs = []
    for name in sorted(book.roots):
        try:
            pid = PeerID.from_base58(name)
        except (P2PError, ValueError):
            continue
        addrs.extend(str(a.with_peer(pid)) for a in node.peerstore.addrs_of(pid)[:1])
    told = 0
    for name in sorted(book.roots):
        try:
            await node.call(
                PeerID.from_base58(name), TRUSTED, {"roots": addrs}, timeout=ROOT_DIAL_TIMEOUT
            )
            told += 1
        except (P2PError, ValueError) as e:
            log.debug("could not introduce our roots to %s: %s", name[:8], e)
    return told == len(book.roots)


async def ask_cofounders(node: Node, book: VouchBook) -> bool:
    """Ask each of our co-founders whom it trusts, and trust them as our own first signers
    (:meth:`VouchBook.join`); whether anyone was new."""
    new = 0
    for name in sorted(book.cofounders):
        try:
            answer = await node.call(
                PeerID.from_base58(name), TRUSTED, {}, timeout=ROOT_DIAL_TIMEOUT
            )
        except (P2PError, ValueError) as e:
            log.debug("our co-founder %s did not say whom it trusts: %s", name[:8], e)
            continue
        peers = answer.get("peers") if isinstance(answer, dict) else None
        if isinstance(peers, list):
            named = [p for p in peers[:MAX_TRUSTED] if isinstance(p, str) and 0 < len(p) <= 64]
            new += book.join(named)
    return new > 0


ROOT_DIAL_TIMEOUT = 10.0
"""Seconds a newcomer tries to reach the peers it joined through before it counts them gone."""


async def _reach_any(node: Node, book: VouchBook) -> bool:
    """Whether one of ``book``'s roots is connected or can be dialed now. A root that is here
    but silent (a bootstrap peer, a coordinator that vouches for nobody) leaves the fork
    choice as it was; only roots that are all gone make a newcomer wait."""
    roots = []
    for name in sorted(book.roots):
        try:
            roots.append(PeerID.from_base58(name))
        except (P2PError, ValueError):
            continue
    if any(node.connection_to(p) is not None for p in roots):
        return True
    for pid in roots:
        with trio.move_on_after(ROOT_DIAL_TIMEOUT):
            try:
                await node.connect(pid)
                return True
            except P2PError as e:
                log.info("the peer we joined through %s is unreachable: %s", str(pid)[:8], e)
    return False


async def _offers(
    node: Node, dht: RunDHT, run_id: str, gone: GoneDonors | None
) -> dict[PeerID, tuple[int, bytes]]:
    """Every announced state (not this peer's, nor one dropped in ``gone``): peer -> its
    (epoch, digest)."""
    announced = await read_announcements(node, dht, run_id)
    offers = announced if gone is None else gone.offers(announced)
    return {a.peer: (a.epoch, a.digest) for a in offers if isinstance(a.peer, PeerID)}


def plan_downloads(missing: Sequence[int], donors: Sequence[str]) -> dict[str, list[int]]:
    """Spread the missing chunks over the donors round-robin (several donors at once)."""
    if not donors:
        return {}
    plan: dict[str, list[int]] = {d: [] for d in donors}
    for i, chunk in enumerate(missing):
        plan[donors[i % len(donors)]].append(chunk)
    return {d: c for d, c in plan.items() if c}


async def _latest_manifests(
    node: Node,
    donors: dict[PeerID, tuple[int, bytes]],
    min_epoch: int,
    request_timeout: float,
    gone: GoneDonors | None,
) -> tuple[StateManifest | None, list[PeerID]]:
    """Each donor's current manifest (``donors``: each one's offer); the newest digest held
    by the most donors."""
    held: dict[bytes, tuple[StateManifest, list[PeerID]]] = {}
    for donor, offer in donors.items():
        try:
            wire = await node.call(donor, MANIFEST, {"latest": True}, timeout=request_timeout)
            manifest = StateManifest.from_wire(wire)
        except P2PError as e:
            _failed(gone, donor, offer, f"gave no current manifest: {e}")
            continue
        except StateError as e:  # (it answered: not the state it offered)
            _failed(gone, donor, offer, f"gave a malformed manifest: {e}")
            continue
        if manifest.epoch >= min_epoch:
            held.setdefault(manifest.digest, (manifest, []))[1].append(donor)
    if not held:
        return None, []
    manifest, agreeing = max(held.values(), key=lambda mv: (mv[0].epoch, len(mv[1])))
    return manifest, agreeing


async def download_state(
    node: Node,
    dht: RunDHT,
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
    node: Node,
    dht: RunDHT,
    run_id: str,
    *,
    timeout: float = 60.0,
    request_timeout: float = 10.0,
    extra: Sequence[Announcement] = (),
    book: VouchBook | None = None,
    min_epoch: int | None = None,
    local: Callable[[bytes], tuple[StateManifest, list[np.ndarray]] | None] | None = None,
    gone: GoneDonors | None = None,
) -> tuple[StateManifest, list[np.ndarray], int]:
    """:func:`download_state`, with the downloaded state's manifest instead of its epoch;
    ``extra``, ``book``: more announcements to choose from (see :func:`find_donors`); ``min_epoch``:
    raise :class:`StaleStateError` instead of downloading an older state; ``local``: the
    state of a digest if we hold it (:meth:`StateServer.held`), which then comes from no donor
    (0 donors used): a peer whose round missed part of the epoch asks for the state most
    peers hold, and that is often its own; ``gone``: the offers of donors that failed us,
    which this download leaves out and adds to."""

    def check_new_enough(epoch: int) -> None:
        if min_epoch is not None and epoch < min_epoch:
            raise StaleStateError(
                f"the newest state served is of epoch {epoch}, wanted {min_epoch} or newer"
            )

    with trio.move_on_after(timeout) as scope:
        found = await find_donors(node, dht, run_id, extra, book, gone)
        if found is None:
            raise StateSyncError("no peer announces a state")
        epoch, digest, donors = found
        check_new_enough(epoch)
        held = local(digest) if local is not None else None
        if held is not None:
            return held[0], held[1], 0
        manifest = await _announced_manifest(node, donors, epoch, digest, request_timeout, gone)
        if manifest is None:
            manifest, donors = await _current_manifest(
                node, dht, run_id, donors, epoch, digest, request_timeout, gone
            )
            check_new_enough(manifest.epoch)
        arrays, used = await _fetch_chunks(node, manifest, donors, request_timeout, gone)
        _check_finite(manifest, arrays, used)
        return manifest, arrays, used
    assert scope.cancelled_caught
    raise StateSyncError(f"state download did not finish within {timeout} s")


async def _announced_manifest(
    node: Node,
    donors: Sequence[PeerID],
    epoch: int,
    digest: bytes,
    request_timeout: float,
    gone: GoneDonors | None,
) -> StateManifest | None:
    """The manifest of the announced ``digest`` (of ``epoch``) from the first donor that
    serves it."""
    for donor in donors:
        try:
            wire = await node.call(donor, MANIFEST, {"digest": digest}, timeout=request_timeout)
            candidate = StateManifest.from_wire(wire)
        except P2PError as e:
            _failed(gone, donor, (epoch, digest), f"gave no manifest: {e}")
            continue
        except StateError as e:  # (it answered: not the state it announced)
            _failed(gone, donor, (epoch, digest), f"gave a malformed manifest: {e}")
            continue
        if candidate.digest == digest:
            return candidate
        log.warning("donor %s sent a manifest that does not match its announcement", donor)
        _failed(gone, donor, (epoch, digest), "sent another state's manifest")
    return None


async def _current_manifest(
    node: Node,
    dht: RunDHT,
    run_id: str,
    donors: Sequence[PeerID],
    epoch: int,
    digest: bytes,
    request_timeout: float,
    gone: GoneDonors | None,
) -> tuple[StateManifest, list[PeerID]]:
    """When no donor serves the state it announced, the newest state the peers hold now and
    who serves it."""
    # The announcements we read were stale (e.g. from a cache after a partition): ask
    # the donors what they hold now and take the newest state most of them agree on.
    offered = {d: (epoch, digest) for d in donors}
    manifest, serving = await _latest_manifests(node, offered, epoch, request_timeout, gone)
    if manifest is None:
        # The newest state's donors are gone (e.g. killed before their announcement
        # expired): take the newest state that any other announcing peer holds now.
        others = await _offers(node, dht, run_id, gone)
        rest = {d: others[d] for d in sorted(others, key=str) if d not in offered}
        manifest, serving = await _latest_manifests(node, rest, 0, request_timeout, gone)
    if manifest is None:
        raise StateSyncError("no donor served a manifest matching its announcement")
    return manifest, serving


async def _fetch_chunks(
    node: Node,
    manifest: StateManifest,
    donors: Sequence[PeerID],
    request_timeout: float,
    gone: GoneDonors | None,
) -> tuple[list[np.ndarray], int]:
    """The state's arrays, its chunks spread over ``donors`` and a failed donor's re-planned
    over the others; and how many donors it came from."""
    request = {"digest": manifest.digest}
    offer = (manifest.epoch, manifest.digest)
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
                except P2PError as e:
                    _failed(gone, donor, offer, f"failed on chunk {i}: {e}")
                    failed.add(donor)
                    return
                except StateError as e:  # (a chunk that is not the manifest's)
                    _failed(gone, donor, offer, f"sent a bad chunk {i}: {e}")
                    failed.add(donor)
                    return

        async with trio.open_nursery() as nursery:
            for donor, indices in plan.items():
                nursery.start_soon(fetch, donor, indices)
        live = [d for d in live if str(d) not in failed]
    return assembler.arrays(), len(used)


def _check_finite(manifest: StateManifest, arrays: list[np.ndarray], used: int) -> None:
    bad = first_non_finite(arrays)
    if bad is not None:
        # Its digest checks out, so every donor of it serves the same: a diverged run's
        # state (or liars'); training on it would only spread the NaN.
        log.error(
            "the state of epoch %d that %d donor(s) serve holds a NaN or an infinity "
            "(array %d): the run diverged; not loading it",
            manifest.epoch, used, bad,
        )  # fmt: skip
        raise StateSyncError(f"the state of epoch {manifest.epoch} is not finite")
