"""dedloc-jax: collaborative training over the Internet (DeDLOC) for JAX.

The public API: join a run with :class:`Collaboration`, wrap your optax optimizer with
:func:`collaborative` (or :func:`diloco`: local training with an averaged outer step), and call
:func:`keep_in_step` after every train step (it loads the run's state when you join, serves
yours after each step, and catches up when you fall out of step).

``__all__`` is the user API. The machinery behind it (the peer's core, the host thread,
matchmaking, the all-reduce and its load balancing) is imported from its own module, e.g.
``dedloc_jax.averaging``, ``dedloc_jax.peer``, ``dedloc_jax.host``.
"""

from dedloc_jax.averaging import (
    AllReduceConfig,
    AllReduceError,
    AveragingError,
    ShareLostError,
)
from dedloc_jax.collaboration import Collaboration
from dedloc_jax.collaborative import CollaborativeState, collaborative
from dedloc_jax.config import (
    AccessConfig,
    CollaborationConfig,
    DefenceConfig,
    LinkConfig,
    ProgressConfig,
    ReachabilityConfig,
    RoundConfig,
    StateConfig,
)
from dedloc_jax.diloco import DiLoCoState, diloco
from dedloc_jax.history import RoundOutcome
from dedloc_jax.host import AveragingOutcome
from dedloc_jax.powersgd import PowerSGD
from dedloc_jax.progress import CollaborationEstimate, PeerProgress
from dedloc_jax.state import (
    KeepConfig,
    StaleStateError,
    StateSyncError,
    collaboration_epoch,
    keep_in_step,
    share_state,
    sync_state,
)
from dedloc_jax.topk import TopK

__all__ = [
    "AccessConfig",
    "AllReduceConfig",
    "AllReduceError",
    "AveragingError",
    "AveragingOutcome",
    "Collaboration",
    "CollaborationConfig",
    "CollaborationEstimate",
    "CollaborativeState",
    "DefenceConfig",
    "DiLoCoState",
    "KeepConfig",
    "LinkConfig",
    "PeerProgress",
    "PowerSGD",
    "ProgressConfig",
    "ReachabilityConfig",
    "RoundConfig",
    "RoundOutcome",
    "ShareLostError",
    "StateConfig",
    "StaleStateError",
    "StateSyncError",
    "TopK",
    "collaboration_epoch",
    "collaborative",
    "diloco",
    "keep_in_step",
    "share_state",
    "sync_state",
]
