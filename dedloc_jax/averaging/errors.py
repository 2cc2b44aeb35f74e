"""Exception classes of the averaging package.

Callers catch :class:`AveragingError` for any failure of a round; the subclasses say what went
wrong precisely enough to decide whether to retry, skip the step or resync state.
:func:`is_failure` tells a peer's failure (one the round survives) from a bug.
"""

from __future__ import annotations

from p2p.errors import P2PError


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


FAILURES = (P2PError, BadContributionError, CodecError)


def is_failure(e: BaseException) -> bool:
    """Whether ``e`` (possibly a group from a nursery) consists only of a peer's failures."""
    if isinstance(e, BaseExceptionGroup):
        return all(is_failure(x) for x in e.exceptions)
    return isinstance(e, FAILURES)
