"""Tunables of a butterfly round, with named presets."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class AllReduceConfig:
    """Chunking, stall detection and how a round's timeout is split between its phases.

    Phases are fractions of the round's timeout, measured from when this member started it:
    reducers stop waiting for parts at ``collect_fraction``; senders stop waiting for results
    at ``exchange_fraction``; a repair coordinator stops waiting for participants at
    ``join_fraction`` and for their data at ``data_fraction``; everything ends at 1.
    """

    chunk_elems: int = 1 << 16
    """Values per chunk (the unit of pipelining, of accumulation and of fault exclusion)."""
    stall_timeout: float = 20.0
    """A peer that makes no progress for this long (including opening a stream to it) is
    treated as failed: senders are excluded, reducers are repaired."""
    collect_fraction: float = 0.5
    exchange_fraction: float = 0.75
    join_fraction: float = 0.85
    data_fraction: float = 0.95
    window_chunks: int = 8
    """Chunks a reducer holds at once (accumulating or encoded, not yet sent to everyone):
    its memory is this many chunks whatever its share."""
    max_pending_rounds: int = 16
    """Rounds a peer may announce before we start them locally; more are refused."""
    linger: float = 60.0
    """How long a finished round stays available to relay its results to repairing peers."""
    robust: bool = False
    """Reducers aggregate each chunk with CenteredClip (:mod:`.robust`), buffering the chunk's
    parts until all arrived, so one peer sending scaled values moves a chunk by a bounded
    amount. The radius is ``robust_tau`` if set, else derived per chunk from the parts: twice
    the upper median of their norms, parts over ten upper medians weighing nothing
    (:func:`.verify.derived_tau`, :func:`.verify.robust_weights`)."""
    robust_tau: float | None = None
    """A fixed CenteredClip radius (L2, per chunk); setting it implies ``robust``."""
    robust_iters: int = 50
    verify: bool = False
    """Every member checks every reducer's result in the same round (:mod:`.verify`,
    :mod:`.audit`); a caught share is recomputed by everyone without its liar's part (or
    dropped when nobody is convicted) and its liar named."""
    verify_timeout: float | None = None
    """How long the check's statements may take to gather (None: ``stall_timeout``)."""

    @classmethod
    def internet(cls) -> AllReduceConfig:
        """Volunteers on home links: 256 KiB chunks, generous stall detection."""
        return cls()

    @classmethod
    def loopback(cls) -> AllReduceConfig:
        """Peers on one machine or a LAN: 1 MiB chunks, quick stall detection."""
        return cls(chunk_elems=1 << 18, stall_timeout=5.0)

    @classmethod
    def testing(cls) -> AllReduceConfig:
        """Tiny chunks so small test vectors still span many chunks; short stalls."""
        return cls(chunk_elems=16, stall_timeout=2.0, linger=30.0)

    def __post_init__(self) -> None:
        if self.robust_tau is not None and not self.robust_tau > 0:
            raise ValueError("robust_tau must be positive when set")
        if self.window_chunks < 1:
            raise ValueError("window_chunks must be at least 1")
        if self.robust_iters < 1:
            raise ValueError("robust_iters must be at least 1")

    @property
    def robust_mode(self) -> bool:
        """Whether reducers use CenteredClip (``robust`` or a fixed ``robust_tau``)."""
        return self.robust or self.robust_tau is not None

    def replace(self, **changes: Any) -> AllReduceConfig:
        return replace(self, **changes)
