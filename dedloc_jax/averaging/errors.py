"""Exception classes of the averaging package.

Callers catch :class:`AveragingError` for any failure of a round; the subclasses say what went
wrong precisely enough to decide whether to retry, skip the step or resync state.
"""

from __future__ import annotations


class AveragingError(Exception):
    """Base class of every error raised by ``dedloc_jax.averaging``."""


class GroupError(AveragingError, ValueError):
    """A group description is malformed or inconsistent (no reducer, unknown member, bad mode)."""


class LoadBalancingError(AveragingError):
    """The share fractions could not be computed (infeasible or failed linear program)."""


class CodecError(AveragingError, ValueError):
    """Encoded bytes do not match what the codec expects (size, header, non-finite scale)."""


class PartitionError(AveragingError, ValueError):
    """A pytree or vector does not match the tree spec it is reassembled with."""


class AllReduceError(AveragingError):
    """A round could not produce a complete average (nothing arrived, or a share was lost)."""


class ShareLostError(AllReduceError):
    """A share's result could not be obtained, even by repair, before the round's deadline."""

    def __init__(self, message: str, *, shares: tuple[int, ...]) -> None:
        super().__init__(message)
        self.shares = shares


class BadContributionError(AveragingError, ValueError):
    """A contribution (or message) from a peer is malformed: wrong size, non-finite, bad field."""
