"""The optimizer states of the two transforms, and the forms the collaboration shares them in.

:func:`dedloc_jax.collaborative` keeps a :class:`CollaborativeState`, :func:`dedloc_jax.diloco` a
:class:`DiLoCoState`. They live here, below the transforms, because serving and loading the
training state (:mod:`~dedloc_jax.state.training`, :mod:`~dedloc_jax.state.keeping`) must find
them in a user's ``opt_state`` without importing the transforms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    import optax

__all__ = [
    "CollaborativeState",
    "DiLoCoState",
    "PowerSGDState",
    "outer_params_after_step",
    "served_form",
]


class PowerSGDState(NamedTuple):
    """``collaborative(compression=PowerSGD(...))``'s part of the state, one entry per
    compressed leaf (:mod:`dedloc_jax.powersgd`)."""

    q: tuple  # float32 (m, rank): the last round's mean Q (the same on every peer), warm start
    # float32, the leaf's shape: what the low-rank means left out of this peer's gradients.
    # This peer's own: served and loaded as zeros, so a newcomer starts at zero
    error: tuple


class CollaborativeState(NamedTuple):
    """State of :func:`~dedloc_jax.collaborative`: fixed shapes and dtypes, so jit never
    recompiles."""

    inner_state: optax.OptState
    grad_sum: optax.Updates  # sum over micro-batches of (mean gradient x batch size), float32
    samples: jax.Array  # int32: samples accumulated toward the current epoch
    epoch: jax.Array  # int32: collaboration epoch this peer is in
    group_size: jax.Array  # int32: peers in the last averaging group (0 before the first)
    # bool: the last step averaged with the whole collaboration (False before the first, and
    # after a step alone or one whose mean missed part of the run: keep_in_step then loads
    # the others' state)
    complete: jax.Array
    powersgd: PowerSGDState | None = None  # compression=PowerSGD only


class DiLoCoState(NamedTuple):
    """State of :func:`~dedloc_jax.diloco`: fixed shapes and dtypes, so jit never recompiles."""

    inner_state: optax.OptState
    outer_params: optax.Params  # the parameters of the last outer step (the caller's dtypes)
    outer_state: optax.OptState
    samples: jax.Array  # int32: samples fed since the last outer step (this peer's weight)
    epoch: jax.Array  # int32: outer steps taken
    group_size: jax.Array  # int32: peers in the last averaging group (0 before the first)
    # bool: the last outer step averaged with the whole collaboration (see CollaborativeState)
    complete: jax.Array
    # bool: this micro-step took an outer step: the local parameters are the outer ones
    synced: jax.Array
    # bool: the inner state is a placeholder (a served or loaded state): the next micro-step
    # re-initialises it from the parameters it is given
    fresh: jax.Array
    # overlap=True only: the pseudo-gradient handed to the averaging in flight (else None)
    sent: optax.Updates | None
    # compression=TopK only: what the sparse updates left unsent (float32, the flattened
    # parameters' size; else None). This peer's own: served as zeros, so a newcomer starts at 0
    error_feedback: jax.Array | None = None


def is_diloco_state(x: Any) -> bool:
    return isinstance(x, DiLoCoState)


def served_form(state: DiLoCoState) -> DiLoCoState:
    """The state as the collaboration shares it: this peer's own work between outer steps
    (samples, inner state, what is in flight) emptied, so one outer state has one digest."""
    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
    return state._replace(
        inner_state=zeros(state.inner_state),
        samples=jnp.zeros_like(state.samples),
        synced=jnp.zeros_like(state.synced),
        fresh=jnp.ones_like(state.fresh),
        sent=None if state.sent is None else zeros(state.sent),
        error_feedback=None if state.error_feedback is None else zeros(state.error_feedback),
    )


def outer_params_after_step(params: Any, opt_state: Any) -> Any:
    """``params``, or the outer parameters of the :class:`DiLoCoState` in ``opt_state`` when
    its last micro-step took an outer step (bit-identical on every peer, unlike ``params``
    moved by the returned update), copied. Called by :func:`dedloc_jax.keep_in_step`."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_diloco_state) if is_diloco_state(s)]
    if len(found) != 1 or not bool(found[0].synced):
        return params
    outer = found[0].outer_params
    if jax.tree.structure(outer) != jax.tree.structure(params):
        return params  # diloco wraps part of the parameters: the update moved them
    # a copy: a step that donates both params and opt_state must not get one buffer twice
    return jax.tree.map(jnp.copy, outer)
