"""dedloc-jax: collaborative training over the Internet (DeDLOC) for JAX.

The public API: join a run with :class:`Collaboration`, wrap your optax optimizer with
:func:`collaborative` (or :func:`diloco`: local training with an averaged outer step), and call
:func:`keep_in_step` after every train step (it loads the run's state when you join, serves
yours after each step, and catches up when you fall out of step).
"""

from dedloc_jax.averaging import (
    AllReduceConfig,
    AllReduceError,
    AllReduceResult,
    AveragingError,
    BandwidthMeter,
    GroupSpec,
    Member,
    ShareLostError,
    all_reduce,
    install,
    solve_shares,
)
from dedloc_jax.collaboration import CollaborationCore, open_collaboration
from dedloc_jax.collaborative import CollaborativeState, collaborative
from dedloc_jax.config import CollaborationConfig
from dedloc_jax.diloco import DiLoCoState, diloco
from dedloc_jax.host import AveragingOutcome, CollaborationHost
from dedloc_jax.keeping import KeepConfig, StepKeeper, keep_in_step
from dedloc_jax.progress import CollaborationEstimate, PeerProgress
from dedloc_jax.state_sync import StaleStateError, StateSyncError
from dedloc_jax.threaded import Collaboration
from dedloc_jax.training_state import collaboration_epoch, share_state, sync_state

__all__ = [
    "AllReduceConfig",
    "AllReduceError",
    "AllReduceResult",
    "AveragingError",
    "AveragingOutcome",
    "BandwidthMeter",
    "Collaboration",
    "CollaborationConfig",
    "CollaborationCore",
    "CollaborationEstimate",
    "CollaborationHost",
    "CollaborativeState",
    "DiLoCoState",
    "GroupSpec",
    "KeepConfig",
    "Member",
    "PeerProgress",
    "ShareLostError",
    "StepKeeper",
    "StaleStateError",
    "StateSyncError",
    "all_reduce",
    "collaboration_epoch",
    "collaborative",
    "diloco",
    "install",
    "keep_in_step",
    "open_collaboration",
    "share_state",
    "solve_shares",
    "sync_state",
]
