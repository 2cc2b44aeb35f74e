"""``diloco``: low-communication training (DiLoCo) as a collaborative optax transformation.

Every micro-step applies the ``inner`` optimizer to this peer's own gradients (local training,
no traffic). When the whole collaboration has fed ``target_batch_size`` samples since the last
outer step, the peers take an *outer step*:

1. the inner update of that micro-step is applied first;
2. each peer's pseudo-gradient ``outer_params - local_params`` is averaged with the same
   bandwidth-proportional butterfly as :func:`dedloc_jax.collaborative`, weighted by the
   samples each peer fed since the last outer step;
3. ``outer`` (default: SGD with Nesterov momentum 0.9 and learning rate 0.7, as in DiLoCo) is
   applied to the outer parameters with the average as gradient;
4. the local parameters become the new outer parameters; the inner state is kept or reset to
   ``inner.init`` of them (``reset_inner``).

The update returned on that micro-step moves the caller's parameters onto the new outer ones;
``params + (outer - params)`` may be one rounding off, so :func:`dedloc_jax.keep_in_step`
replaces the parameters by the state's outer parameters right after an outer step: every peer's
parameters are then bit-identical (the average is, and so is everything computed from it).

What the collaboration shares (``share_state``, the digest that matchmaking and the fork choice
compare) is the outer state only: the outer parameters in place of the caller's parameters, the
outer optimizer state and the epoch. The local parameters, the inner state and the samples are
each peer's own work between outer steps: they are served empty (the inner state as zeros,
marked ``fresh``), so peers at one outer state serve one digest; a peer that loads a state
re-initialises its inner state from the loaded parameters on its next micro-step.

Inside ``jax.jit`` the host is reached as in :mod:`dedloc_jax.collaborative`: one cheap
callback with scalars on every micro-step picks a ``lax.switch`` branch; only the branch that
averages moves the pseudo-gradients.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dedloc_jax.collaborative import CALLBACKS, HostCalls, _is_tracer, host_caller
from dedloc_jax.host import CollaborationHost

__all__ = ["DiLoCoState", "diloco", "outer_params_after_step"]

log = logging.getLogger(__name__)

CODECS = ("none", "fp16", "bf16", "int8")


class DiLoCoState(NamedTuple):
    """State of :func:`diloco`: fixed shapes and dtypes, so jit never recompiles."""

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


def _accepts_codec(method: Any) -> bool:
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return "codec" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def diloco(
    inner: optax.GradientTransformation,
    collab: CollaborationHost,
    *,
    target_batch_size: int,
    outer: optax.GradientTransformation | None = None,
    codec: str | None = "int8",
    overlap: bool = False,
    reset_inner: bool = False,
    callback: str = "auto",
) -> optax.GradientTransformationExtraArgs:
    """Local training with ``inner`` and one averaged outer step per collaboration-wide batch.

    Args:
      inner: the optimizer of the local (inner) steps, applied on every micro-step.
      collab: the collaboration (:class:`dedloc_jax.Collaboration` or any
        :class:`dedloc_jax.host.CollaborationHost`).
      target_batch_size: samples the whole collaboration feeds between outer steps (the
        DiLoCo H inner steps times the peers' batches).
      outer: the optimizer of the outer step, fed the averaged pseudo-gradient; default
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
      codec: how pseudo-gradients travel: "int8" (blockwise, per-block scales; the default),
        "fp16", "bf16" or "none" (exact). Every peer of a run must use the same. None: the
        collaboration's own ``CollaborationConfig.codec`` (a host whose ``average_gradients``
        takes no ``codec`` needs None). Auxiliary peers average with the configured codec: a
        run with aux peers sets ``CollaborationConfig(codec=...)`` to this one.
      overlap: average in the background while the next inner steps run. The outer step lands
        when the averaging finished, on the outer parameters; the inner steps taken meanwhile
        are kept on top of it (``local = new_outer + (local_now - local_sent)``) and count
        toward the next outer step. The outer step is thus applied one averaging late, and the
        local parameters then differ across peers by those steps (the outer ones do not).
        Needs a host with ``start_averaging`` and ``poll_averaging``.
      reset_inner: after an outer step, re-initialise the inner state from the new outer
        parameters (True), or keep it (False, the default, as in the DiLoCo paper: AdamW's
        moments carry over). Either way it is a pure function of the state, so the policy is
        the same on every peer; a peer that loads a state starts a fresh inner state.
      callback: how jitted code reaches the host (see :func:`dedloc_jax.collaborative`).

    ``update(grads, state, params, *, batch_size)``: ``grads`` are the mean gradients of a
    micro-batch of ``batch_size`` samples; ``params`` (required) are the local parameters. A
    micro-step of ``batch_size=0`` (a peer waiting for the outer step) takes no inner step.
    The updates returned are the inner updates, and on an outer step those that move the
    parameters onto the new outer ones.
    """
    if target_batch_size <= 0:
        raise ValueError(f"target_batch_size must be positive, got {target_batch_size}")
    if callback not in CALLBACKS:
        raise ValueError(f"callback must be one of {CALLBACKS}, got {callback!r}")
    if codec is not None and codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS} or None, got {codec!r}")
    if codec is not None and not _accepts_codec(collab.average_gradients):
        raise TypeError(
            f"{type(collab).__name__}.average_gradients takes no codec: pass codec=None "
            "(the collaboration's own) or use a dedloc_jax.Collaboration"
        )
    use_target = getattr(collab, "use_target", None)
    if use_target is not None:
        use_target(int(target_batch_size))
    if overlap and not all(hasattr(collab, m) for m in ("start_averaging", "poll_averaging")):
        raise TypeError(
            "overlap=True needs a collaboration with start_averaging and poll_averaging "
            f"(dedloc_jax.host.OverlappingHost); {type(collab).__name__} has not"
        )
    inner = optax.with_extra_args_support(inner)
    if outer is None:
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    calls = HostCalls(collab, {} if codec is None else {"codec": codec})

    def init(params: optax.Params) -> DiLoCoState:
        return DiLoCoState(
            inner_state=inner.init(params),
            outer_params=jax.tree.map(jnp.array, params),  # a copy: params may be donated
            outer_state=outer.init(params),
            samples=jnp.zeros((), jnp.int32),
            epoch=jnp.zeros((), jnp.int32),
            group_size=jnp.zeros((), jnp.int32),
            complete=jnp.zeros((), jnp.bool_),
            synced=jnp.zeros((), jnp.bool_),
            fresh=jnp.zeros((), jnp.bool_),
            sent=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
            if overlap
            else None,
        )

    def update(
        updates: optax.Updates,
        state: DiLoCoState,
        params: optax.Params | None = None,
        *,
        batch_size: int | jax.Array,
        **extra_args: Any,
    ) -> tuple[optax.Updates, DiLoCoState]:
        if params is None:
            raise ValueError("diloco needs the local parameters: update(grads, state, params)")
        batch = jnp.asarray(batch_size, jnp.int32)
        samples = state.samples + batch
        traced = any(
            _is_tracer(x) for x in (samples, state.fresh, *jax.tree.leaves((updates, params)))
        )
        int32 = jax.ShapeDtypeStruct((), jnp.int32)

        host = host_caller(traced, callback)

        # A served or loaded state holds a placeholder inner state: start a fresh one.
        if traced:
            inner_state = jax.lax.cond(
                state.fresh, lambda: inner.init(params), lambda: state.inner_state
            )
        else:
            inner_state = inner.init(params) if bool(state.fresh) else state.inner_state

        # A micro-step of no samples (a peer waiting for the others) takes no inner step.
        def inner_step(inner_state: Any) -> tuple[Any, Any]:
            return inner.update(updates, inner_state, params, **extra_args)

        def no_step(inner_state: Any) -> tuple[Any, Any]:
            shapes = jax.eval_shape(inner_step, inner_state)[0]
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes), inner_state

        if traced:
            inner_updates, inner_state = jax.lax.cond(batch > 0, inner_step, no_step, inner_state)
        else:
            step = inner_step if int(batch) > 0 else no_step
            inner_updates, inner_state = step(inner_state)

        (action,) = host(calls.decide, [int32], state.epoch, samples, batch)

        def local_delta() -> list:
            """outer - local after this micro-step's inner update, float32 leaves."""
            local = optax.apply_updates(params, inner_updates)
            return jax.tree.map(
                lambda o, p: o.astype(jnp.float32) - p.astype(jnp.float32),
                state.outer_params,
                local,
            )

        def outer_step(avg_leaves: list, treedef: Any) -> tuple[Any, Any]:
            avg = jax.tree.unflatten(treedef, avg_leaves)
            avg = jax.tree.map(lambda a, o: a.astype(o.dtype), avg, state.outer_params)
            o_updates, outer_state = outer.update(avg, state.outer_state, state.outer_params)
            return optax.apply_updates(state.outer_params, o_updates), outer_state

        def after_outer(new_outer: Any, inner_state: Any) -> Any:
            return inner.init(new_outer) if reset_inner else inner_state

        def moving_to(target: Any) -> Any:
            """Updates that move ``params`` onto ``target``."""
            return jax.tree.map(lambda t, p: (t - p).astype(p.dtype), target, params)

        # Each branch returns (updates, inner_state, outer_params, outer_state, epoch,
        # group_size, complete, samples, synced, sent).
        def keep(inner_state) -> tuple:
            return (
                inner_updates,
                inner_state,
                state.outer_params,
                state.outer_state,
                state.epoch,
                state.group_size,
                state.complete,
                samples,
                jnp.bool_(False),
                state.sent,
            )

        def average_and_step(inner_state) -> tuple:
            leaves, treedef = jax.tree.flatten(local_delta())
            specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
            *got, new_epoch, group_size, complete, taken = host(
                calls.average, [*specs, int32, int32, int32, int32], state.epoch, samples, *leaves
            )
            new_outer, outer_state = outer_step(got, treedef)
            return (
                moving_to(new_outer),
                after_outer(new_outer, inner_state),
                new_outer,
                outer_state,
                new_epoch,
                group_size,
                complete.astype(jnp.bool_),
                samples - taken,
                jnp.bool_(True),
                state.sent,
            )

        def start_averaging(inner_state) -> tuple:
            delta = local_delta()
            leaves = jax.tree.leaves(delta)
            (taken,) = host(calls.start, [int32], state.epoch, samples, *leaves)
            out = keep(inner_state)
            return (*out[:7], samples - taken, jnp.bool_(False), delta)

        def apply_averaged(inner_state) -> tuple:
            leaves, treedef = jax.tree.flatten(state.sent)
            specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
            *got, new_epoch, group_size, complete = host(
                calls.collect(specs), [*specs, int32, int32, int32], state.epoch
            )
            new_outer, outer_state = outer_step(got, treedef)
            # local = new_outer + (local_now - local_sent), local_sent = outer - sent
            local = jax.tree.map(
                lambda n, p, u, o, s: (
                    n.astype(jnp.float32)
                    + (p.astype(jnp.float32) + u.astype(jnp.float32))
                    - (o.astype(jnp.float32) - s)
                ).astype(p.dtype),
                new_outer,
                params,
                inner_updates,
                state.outer_params,
                state.sent,
            )
            return (
                moving_to(local),
                after_outer(new_outer, inner_state),
                new_outer,
                outer_state,
                new_epoch,
                group_size,
                complete.astype(jnp.bool_),
                samples,
                jnp.bool_(False),
                jax.tree.map(jnp.zeros_like, state.sent),
            )

        if overlap:
            branches = [keep, start_averaging, apply_averaged]
        else:
            branches = [keep, average_and_step]
        if traced:
            out = jax.lax.switch(action, branches, inner_state)
        else:
            out = branches[int(action)](inner_state)
        (new_updates, inner_state, outer_params, outer_state, epoch, group_size, complete) = out[:7]
        samples, synced, sent = out[7:]
        return new_updates, DiLoCoState(
            inner_state=inner_state,
            outer_params=outer_params,
            outer_state=outer_state,
            samples=jnp.asarray(samples, jnp.int32),
            epoch=jnp.asarray(epoch, jnp.int32),
            group_size=jnp.asarray(group_size, jnp.int32),
            complete=jnp.asarray(complete, jnp.bool_),
            synced=jnp.asarray(synced, jnp.bool_),
            fresh=jnp.zeros((), jnp.bool_),
            sent=sent,
        )

    return optax.GradientTransformationExtraArgs(init, update)
