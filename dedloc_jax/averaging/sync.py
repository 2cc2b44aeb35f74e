"""Small pieces shared by the round's roles: a change signal and failure classification."""

from __future__ import annotations

import numpy as np
import trio

from p2p.errors import P2PError

from .errors import BadContributionError, CodecError

F32 = np.dtype("<f4")
FAILURES = (P2PError, BadContributionError, CodecError)


def is_failure(e: BaseException) -> bool:
    """Whether ``e`` (possibly a group from a nursery) consists only of a peer's failures."""
    if isinstance(e, BaseExceptionGroup):
        return all(is_failure(x) for x in e.exceptions)
    return isinstance(e, FAILURES)


class Changes:
    """A broadcast "something changed" signal for tasks that re-check a condition."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self, until: float) -> bool:
        """Wait for a change until ``until``; True if one happened."""
        event = self._event
        with trio.move_on_at(until):
            await event.wait()
        return event.is_set()
