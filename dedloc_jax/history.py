"""The averaging history: what each averaging round did on this peer.

:class:`~dedloc_jax.peer.CollaborationPeer` appends one :class:`RoundOutcome` per
round; :attr:`dedloc_jax.Collaboration.history` and ``last_outcome`` return them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    """One averaging round of this peer.

    ``epoch``: the epoch it averaged toward (the peer is at ``epoch + 1`` after it);
    ``group_size``: the peers in its group (1: it stepped alone); ``complete``: the mean covers
    the whole collaboration; ``seconds``: from the round's start to its end; ``collab_samples``:
    the collaboration's samples toward ``epoch`` when the round began; ``reason``: why it was
    not complete (empty when it was); ``mode``: how this peer took part ("node", "client",
    "aux").
    """

    epoch: int
    group_size: int
    complete: bool
    seconds: float
    collab_samples: float
    reason: str
    mode: str

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (for JSON), in declaration order."""
        return asdict(self)
