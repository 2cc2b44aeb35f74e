"""What a round needs from the peer it runs for, passed in at construction: the round reads
the peer's progress table and state through it and never holds the peer itself."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from p2p.identity import PeerID


def _never_moved_on(peer: str, epoch: int) -> bool:
    return False


def _never_over(epoch: int) -> bool:
    return False


def _always_proven(peer: str) -> bool:
    return True


def _never_banned(peer: str) -> bool:
    return False


def _never_weightless(peer: str) -> bool:
    return False


def _no_state(epoch: int) -> bytes | None:
    return None


def _ignore(epoch: int) -> None:
    return None


@dataclass(frozen=True)
class PeerSide:
    """The peer's side of its rounds; the defaults are a peer that knows nothing (an open run
    with no progress table, as in the matchmaking tests)."""

    moved_on: Callable[[str, int], bool] = _never_moved_on
    """Whether a peer has gone past an epoch (the tracker knows): a leader stops waiting for
    an expected member that already averaged that epoch without it."""
    epoch_over: Callable[[int], bool] = _never_over
    """Whether the collaboration is past an epoch: a late peer that nobody waits for at its
    epoch then stops looking for a group at once."""
    state_of: Callable[[int], bytes | None] = _no_state
    """The digest of the state this peer steps from at an epoch (None: not known, e.g. not
    served yet): registrations and joins carry it, and peers on other states group apart."""
    banned: Callable[[str], bool] = _never_banned
    """Whether a peer was caught lying (:mod:`dedloc_jax.bans`): left out of our groups."""
    proven: Callable[[str], bool] = _always_proven
    """Whether a peer averaged with the run (``ProgressTracker.proven``): one that never did
    and never registered is not waited for (a fresh identity's record costs nothing)."""
    weightless: Callable[[str], bool] = _never_weightless
    """Whether a peer's contribution weighed nothing in its newest round we know of
    (``ProgressTracker.weightless``): its registration weighs 0 (:mod:`~dedloc_jax.rounds.
    claims`)."""
    forming: Callable[[int], None] = _ignore
    """A peer of the run asked us whom we follow at an epoch whose round we have not joined:
    its round forms, and our progress table may be stale (``ProgressTracker.sweep_next_read``
    when we are at that epoch and check mid-step whether to average)."""
    admit: Callable[[PeerID, str | None], Awaitable[None]] | None = None
    """Private runs (:mod:`dedloc_jax.access`): raises unless the caller (in that mode) may
    take part; None in an open run."""


class ProgressTable(Protocol):
    """What a round's context reads of the progress tracker
    (:class:`~dedloc_jax.tracker.ProgressTracker`)."""

    @property
    def records(self) -> Mapping[str, Any]: ...

    def current_estimate(self) -> Any: ...

    def proven(self, peer: str) -> bool: ...

    def weightless(self, peer: str) -> bool: ...

    @property
    def epoch(self) -> int: ...

    def sweep_next_read(self) -> None: ...

    @property
    def poll(self) -> float | None: ...


def _moved_on(table: ProgressTable, peer: str, epoch: int) -> bool:
    record = table.records.get(peer)
    return record is not None and record.epoch > epoch


def _epoch_over(table: ProgressTable, epoch: int) -> bool:
    return table.current_estimate().epoch > epoch


def _sweep_at(table: ProgressTable, epoch: int) -> None:
    # Only a peer that checks mid-step reads again before its micro-step ends; elsewhere the
    # sweep only shifts the timings of reads that come at micro-step ends anyway.
    if table.epoch == epoch and table.poll is not None:
        table.sweep_next_read()


def context_of(
    table: ProgressTable,
    state_of: Callable[[int], bytes | None],
    banned: Callable[[str], bool],
    admit: Callable[[PeerID, str | None], Awaitable[None]] | None,
) -> PeerSide:
    """A peer's context: who moved on and whether an epoch is over, from its progress
    ``table``; ``state_of``: its state server's head (peers average only with peers that step
    from the same state, or do not say); ``banned``: its bans; ``admit``: its access guard;
    whether a peer is proven (averaged with the run) or weightless, and whether a question
    about a round we have not joined sweeps it (when we check mid-step), from the table too."""
    return PeerSide(
        moved_on=functools.partial(_moved_on, table),
        epoch_over=functools.partial(_epoch_over, table),
        state_of=state_of,
        banned=banned,
        proven=table.proven,
        weightless=table.weightless,
        forming=functools.partial(_sweep_at, table),
        admit=admit,
    )
