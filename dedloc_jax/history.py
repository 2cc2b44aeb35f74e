"""The record of one averaging round: :class:`RoundOutcome`.

:func:`~dedloc_jax.rounds.average.average_round` returns one (with the mean it gave and the
group behind it); :class:`~dedloc_jax.rounds.stepping.Stepper` completes it, hands it (with the
mean) to the transform's host calls and keeps it, without the mean, in the peer's history, which
:attr:`dedloc_jax.Collaboration.history` and ``last_outcome`` return. A host written by hand
(:class:`~dedloc_jax.host.CollaborationHost`) returns one too: ``RoundOutcome(epoch, group_size,
average=mean)``. Inside a round, each all-reduce gives the butterfly's ``AllReduceResult``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from dedloc_jax.averaging.group import GroupSpec


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    """One averaging round of this peer.

    ``epoch``: the epoch it averaged toward (the peer is at :attr:`next_epoch` after it);
    ``group_size``: the peers in its group (1: it stepped alone); ``complete``: the mean covers
    the whole collaboration; ``seconds``: from the round's start to its end; ``collab_samples``:
    the collaboration's samples toward ``epoch`` when the round began; ``reason``: why it was
    not complete (empty when it was); ``mode``: how this peer took part ("node", "client",
    "aux").

    While the round hands it on, it also holds what the history leaves out (:meth:`to_dict`
    omits them, equality ignores them): ``average``, the mean this peer steps with (its own
    arrays when no group averaged); ``group``, the level-0 group whose all-reduce succeeded
    (both None once kept); ``error``, that all-reduce's failure; ``across``, whether the
    epoch's groups were averaged across.
    """

    epoch: int
    group_size: int
    complete: bool = True
    seconds: float = 0.0
    collab_samples: float = 0.0
    reason: str = ""
    mode: str = "node"
    average: list[np.ndarray] | None = field(default=None, compare=False, repr=False)
    group: GroupSpec | None = field(default=None, compare=False, repr=False)
    error: str | None = field(default=None, compare=False)
    across: bool = field(default=False, compare=False)

    @property
    def next_epoch(self) -> int:
        """The epoch the peer is at after this round's step."""
        return self.epoch + 1

    def to_dict(self) -> dict[str, Any]:
        """The history's fields as a dict (for JSON), in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in _KEPT}


_KEPT = ("epoch", "group_size", "complete", "seconds", "collab_samples", "reason", "mode")
