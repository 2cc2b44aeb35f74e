"""The host-side interface that the collaborative optax transform talks to.

The transform runs inside ``jax.jit``; everything that needs the network happens on the host,
behind this small protocol. :class:`dedloc_jax.Collaboration` implements it over the DHT and the
butterfly all-reduce; tests may implement it in-process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np


class AveragingOutcome(NamedTuple):
    """What one averaging step produced on this peer.

    ``gradients`` are the collaboration's mean gradients (same order, shapes and dtypes as given),
    ``epoch`` the collaboration epoch after the step, ``group_size`` how many peers contributed
    (1 when the peer had to proceed alone).
    """

    gradients: list[np.ndarray]
    epoch: int
    group_size: int


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
