"""Newcomers load the collaboration's training state; everyone serves their own.

``sync_state`` fills the user's pytrees (parameters and optimizer state) with the newest state
that peers serve, verified chunk by chunk, and resets this peer's gradient accumulator, so a
newcomer (or a peer that fell behind) continues in step with the others. ``share_state`` hands
this peer's state to its state server after each collaboration step.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dedloc_jax.state.transform_states import (
    CollaborativeState,
    DiLoCoState,
    is_diloco_state,
    served_form,
)

log = logging.getLogger(__name__)


class _StateHost(Protocol):
    def load_state(self, *, timeout: float = ...) -> tuple[int, list[np.ndarray]]: ...
    # Hosts may also take ``min_epoch`` (the Collaboration does); sync_state passes it only
    # when asked to.
    def share_state(self, arrays: list[np.ndarray], epoch: int) -> None: ...


def _is_collab_state(x: Any) -> bool:
    return isinstance(x, CollaborativeState | DiLoCoState)


def collaboration_state(opt_state: Any) -> CollaborativeState | DiLoCoState | None:
    """The :class:`CollaborativeState` (or :class:`~dedloc_jax.diloco.DiLoCoState`) inside
    ``opt_state`` (the newest, if several)."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_collab_state) if _is_collab_state(s)]
    return max(found, key=lambda s: int(s.epoch)) if found else None


def collaboration_epoch(opt_state: Any) -> int | None:
    """The epoch held by the :class:`CollaborativeState` inside ``opt_state``, if any."""
    found = [
        int(s.epoch)
        for s in jax.tree.leaves(opt_state, is_leaf=_is_collab_state)
        if _is_collab_state(s)
    ]
    return max(found) if found else None


def _reset_accumulators(opt_state: Any) -> Any:
    def reset(s: Any) -> Any:
        if is_diloco_state(s):
            return served_form(s)
        if not _is_collab_state(s):
            return s
        lowrank = s.powersgd  # PowerSGD's error feedback is this peer's own work too
        if lowrank is not None:
            lowrank = lowrank._replace(error=jax.tree.map(jnp.zeros_like, lowrank.error))
        return s._replace(
            grad_sum=jax.tree.map(jnp.zeros_like, s.grad_sum),
            samples=jnp.zeros_like(s.samples),
            powersgd=lowrank,
        )

    return jax.tree.map(reset, opt_state, is_leaf=_is_collab_state)


def _outer_params(params: Any, opt_state: Any) -> Any:
    """The parameters the collaboration shares: the outer ones under diloco."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_diloco_state) if is_diloco_state(s)]
    if not found:
        return params
    if len(found) > 1:
        raise ValueError("opt_state holds several diloco states: serve which outer parameters?")
    outer = found[0].outer_params
    if jax.tree.structure(outer) != jax.tree.structure(params):
        raise ValueError(
            "diloco's outer parameters are not shaped like the parameters shared: diloco must "
            "wrap all of them to serve its state"
        )
    return outer


def share_state(collab: _StateHost, params: Any, opt_state: Any) -> None:
    """Serve ``(params, opt_state)`` to newcomers (copied to host memory once per call).

    The gradient accumulator is this peer's own work toward the next step, not the
    collaboration's state: it is served empty, so peers that hold the same state serve the
    same digest (and matchmaking, which averages only peers stepping from one state, pairs them).
    Under :func:`dedloc_jax.diloco` the outer parameters are served in place of ``params``
    (the local ones differ across peers between outer steps), with the local work emptied.
    """
    params = _outer_params(params, opt_state)
    opt_state = _reset_accumulators(opt_state)
    leaves = [np.asarray(x) for x in jax.device_get(jax.tree.leaves((params, opt_state)))]
    epoch = collaboration_epoch(opt_state) or 0
    collab.share_state(leaves, epoch)


def sync_state(
    collab: _StateHost,
    params: Any,
    opt_state: Any,
    *,
    timeout: float = 60.0,
    min_epoch: int | None = None,
) -> tuple[Any, Any, int]:
    """Load the collaboration's newest ``(params, opt_state)`` into pytrees of this structure.

    Returns ``(params, opt_state, epoch)``. Raises ``StateSyncError`` when no peer serves a
    state (the first peer of a run starts from its own initialisation instead), its subclass
    ``StaleStateError`` when the state served is older than ``min_epoch`` (a peer that
    stepped alone keeps its own then; nothing was loaded), and ValueError when the served
    state does not fit these pytrees (another model or optimizer).
    """
    leaves, treedef = jax.tree.flatten((params, opt_state))
    if min_epoch is None:
        epoch, arrays = collab.load_state(timeout=timeout)
    else:
        epoch, arrays = collab.load_state(timeout=timeout, min_epoch=min_epoch)  # type: ignore[call-arg]
    if len(arrays) != len(leaves):
        raise ValueError(
            f"the collaboration's state has {len(arrays)} arrays, this model {len(leaves)}"
        )
    new_leaves = []
    for i, (got, want) in enumerate(zip(arrays, leaves, strict=True)):
        want_shape, want_dtype = np.shape(want), jnp.result_type(want)
        if got.shape != want_shape or got.dtype != want_dtype:
            raise ValueError(
                f"state array {i} is {got.dtype}{list(got.shape)}, "
                f"expected {want_dtype}{list(want_shape)}"
            )
        new_leaves.append(jnp.asarray(got))
    new_params, new_opt_state = jax.tree.unflatten(treedef, new_leaves)
    log.info("loaded the collaboration's state of epoch %d", epoch)
    return new_params, _reset_accumulators(new_opt_state), epoch
