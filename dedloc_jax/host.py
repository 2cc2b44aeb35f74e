"""The host-side interface that the collaborative optax transform talks to.

The transform runs inside ``jax.jit``; everything that needs the network happens on the host,
behind this small protocol. :class:`dedloc_jax.Collaboration` implements it over the DHT and the
butterfly all-reduce; tests may implement it in-process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import trio

log = logging.getLogger(__name__)


class AveragingOutcome(NamedTuple):
    """What one averaging step produced on this peer.

    ``gradients`` are the collaboration's mean gradients (same order, shapes and dtypes as given),
    ``epoch`` the collaboration epoch after the step, ``group_size`` how many peers contributed
    (1 when the peer had to proceed alone). ``complete`` is False when the mean leaves out
    groups it was meant to cover (the peer averaged alone, or its group's round across groups
    failed): the peer then holds other parameters than the collaboration and should load its
    state.
    """

    gradients: list[np.ndarray]
    epoch: int
    group_size: int
    complete: bool = True


class CollaborationHost(Protocol):
    """What :func:`dedloc_jax.collaborative` needs from a collaboration."""

    def report_progress(self, epoch: int, samples: int, batch_size: int) -> bool:
        """Record that this peer holds ``samples`` samples toward ``epoch`` after a micro-batch
        of ``batch_size``; return True when this peer should average now.

        Called on every micro-step, so it must be cheap: it only posts the numbers to the
        collaboration's background loop and reads its latest estimate.
        """
        ...

    def average_gradients(
        self, epoch: int, gradients: Sequence[np.ndarray], samples: int
    ) -> AveragingOutcome:
        """Average this peer's mean ``gradients`` over ``samples`` samples with its group."""
        ...


class OverlappingHost(CollaborationHost, Protocol):
    """A collaboration that can average in the background, for ``collaborative(overlap=True)``
    (DeDLOC's delayed updates: the peer keeps computing while its group averages)."""

    def start_averaging(self, epoch: int, gradients: Sequence[np.ndarray], samples: int) -> None:
        """Begin what :meth:`average_gradients` does and return at once (one at a time)."""
        ...

    def poll_averaging(self) -> AveragingOutcome | None:
        """The outcome of the averaging started last once it finished (then forgotten), else
        None. Cheap: called on every micro-step while an averaging is in flight."""
        ...


class BackgroundAveraging:
    """One averaging that runs as a task of the collaboration's trio loop while the training
    thread goes on; the training thread polls :meth:`result` (no waiting)."""

    def __init__(self, average: Callable[[], Awaitable[AveragingOutcome]]) -> None:
        self._average = average
        self._done = threading.Event()
        self._outcome: AveragingOutcome | None = None
        self._error: Exception | None = None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            self._outcome = await self._average()
        except Exception as e:  # noqa: BLE001 - handed to the training thread by result()
            # Logged in full here: the training thread may re-raise it through a JAX host
            # callback, whose error message keeps only the traceback's last line.
            log.error("averaging raised %r", e, exc_info=e)
            self._error = e
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> AveragingOutcome:
        """The outcome of a finished averaging; raises what it raised."""
        if not self._done.is_set():
            raise RuntimeError("the averaging has not finished")
        if self._error is not None:
            raise self._error
        if self._outcome is None:
            raise RuntimeError("the collaboration closed while averaging")
        return self._outcome
