"""A broadcast "something changed" signal: tasks of a round's roles that re-check a condition
(a share's result arrived, a sender was excluded) wait on it instead of polling."""

from __future__ import annotations

import trio


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
