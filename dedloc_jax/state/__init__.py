"""The training state of a collaboration: how peers serve it, load it and stay on one lineage.

- :mod:`~dedloc_jax.state.chunks`: a state as SHA-256-checked chunks behind a manifest (pure);
- :mod:`~dedloc_jax.state.lineage`: the states' lineages and the fork choice (pure);
- :mod:`~dedloc_jax.state.serving`: the donor side (:class:`StateServer`, the RPCs it answers,
  the announcement record it writes) and reading those announcements;
- :mod:`~dedloc_jax.state.download`: fetching a state from its donors, re-planning a failed
  donor's chunks over the others;
- :mod:`~dedloc_jax.state.training`: the user's pytrees to and from flat arrays
  (:func:`sync_state`, :func:`share_state`);
- :mod:`~dedloc_jax.state.keeping`: the policy behind :func:`keep_in_step` and its drivers.

Re-exported here: the names other modules and packages use.
"""

from dedloc_jax.state.chunks import (
    NonFiniteStateError,
    StateAssembler,
    StateError,
    StateManifest,
    pack_state,
)
from dedloc_jax.state.download import (
    StaleStateError,
    StateSyncError,
    download_manifest_state,
    download_state,
    find_donors,
)
from dedloc_jax.state.keeping import KeepConfig, StepKeeper, keep_in_step, keep_in_step_async
from dedloc_jax.state.lineage import Announcement, fork_choice, fork_verdict, losing_peers
from dedloc_jax.state.serving import StateServer, state_key
from dedloc_jax.state.training import collaboration_epoch, share_state, sync_state

__all__ = [
    "Announcement",
    "KeepConfig",
    "NonFiniteStateError",
    "StaleStateError",
    "StateAssembler",
    "StateError",
    "StateManifest",
    "StateServer",
    "StateSyncError",
    "StepKeeper",
    "collaboration_epoch",
    "download_manifest_state",
    "download_state",
    "find_donors",
    "fork_choice",
    "fork_verdict",
    "keep_in_step",
    "keep_in_step_async",
    "losing_peers",
    "pack_state",
    "share_state",
    "state_key",
    "sync_state",
]
