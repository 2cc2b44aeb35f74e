"""An accumulator handed over at the end of a micro-step, averaged once the round is due.

A blocking peer whose micro-step is long would see the target only when its micro-step
ends, and every other peer would wait for it. So when the target is likely to land within its
next micro-step, :func:`dedloc_jax.collaborative` hands the accumulator it holds to the
collaboration, which asks :meth:`~dedloc_jax.peer.CollaborationPeer.due` every poll while the
device computes that micro-step, and begins the round at once when it is due. When the
micro-step ends, the training thread claims it (:meth:`HandOver.claim`): a round that began is
waited for and applied (that micro-step's gradients go to the next epoch); one that did not
begin never will, and the micro-step goes on as if nothing had been handed over.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger(__name__)


class HandOver:
    """One hand-over: a task of the collaboration's trio loop that asks ``due()`` every
    ``poll`` seconds and, once it says yes, runs ``average()``; the training thread claims it
    at the end of its micro-step."""

    def __init__(
        self,
        due: Callable[[], bool],
        average: Callable[[], Awaitable[Any]],
        poll: float,
    ) -> None:
        self._due = due
        self._average = average
        self._poll = poll
        self._begun = False
        self._claimed = False
        self._scope = trio.CancelScope()
        self._done = threading.Event()
        self._outcome: Any = None
        self._error: Exception | None = None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            with self._scope:
                while not self._begun:
                    await trio.sleep(self._poll)
                    # (claim runs in this loop too: no claim falls between the check and begun)
                    self._begun = not self._claimed and self._due()
            if self._begun:
                self._outcome = await self._average()
        except Exception as e:  # noqa: BLE001 - handed to the training thread by result()
            log.error("averaging raised %r", e, exc_info=e)
            self._error = e
        finally:
            self._done.set()

    def claim(self) -> bool:
        """In the trio thread, at the end of the micro-step: whether the round began (then
        :meth:`result` waits for it); if not, it never will."""
        self._claimed = True
        if not self._begun:
            self._scope.cancel()
        return self._begun

    def result(self) -> Any:
        """The round's outcome, once it ended (waits: the peer blocks for its round); raises
        what it raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        if self._outcome is None:
            raise RuntimeError("the collaboration closed while averaging")
        return self._outcome
