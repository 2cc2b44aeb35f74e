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

Inside ``jax.jit`` the host is reached through :mod:`dedloc_jax.host`, as by
:func:`dedloc_jax.collaborative`: one cheap callback with scalars on every micro-step picks a
``lax.switch`` branch; only a branch that averages moves the pseudo-gradients.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dedloc_jax.averaging.leaf_codecs import COMPRESSIONS
from dedloc_jax.host import (
    Averaged,
    CollaborationHost,
    MicroStep,
    TransformBranches,
    check_options,
    connect,
    is_traced,
)
from dedloc_jax.state.transform_states import DiLoCoState, outer_params_after_step
from dedloc_jax.topk import TopK, encode_jax

__all__ = ["DiLoCoState", "diloco", "outer_params_after_step"]

log = logging.getLogger(__name__)

CODECS = COMPRESSIONS  # a codec for every leaf, or a per-leaf policy


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
    compression: TopK | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Local training with ``inner`` and one averaged outer step per collaboration-wide batch.

    Args:
      inner: the optimizer of the local (inner) steps, applied on every micro-step.
      collab: the collaboration (:class:`dedloc_jax.Collaboration` or any
        :class:`dedloc_jax.host.CollaborationHost`).
      target_batch_size: samples the whole collaboration feeds between outer steps (the
        DiLoCo H inner steps times the peers' batches).
      outer: the optimizer of the outer step, fed the averaged pseudo-gradient; default
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` (DiLoCo's), and ``optax.sgd(1.0)``
        with ``compression`` (SparseLoCo's: the error feedback already re-sends what earlier
        steps left out, and momentum on top of it overshoots; ``bench/README.md`` has the
        figures).
      codec: how pseudo-gradients travel: "int8" (blockwise, per-block scales; the default),
        "fp16", "bf16", "none" (exact) or "adaptive" (per leaf: small and 1-D leaves fp16,
        matrices int8). Every peer of a run must use the same. None: the collaboration's own
        ``CollaborationConfig.rounds.codec`` (a host whose ``average_gradients``
        takes no ``codec`` needs None). Auxiliary peers average with the configured codec: a
        run with aux peers sets ``RoundConfig(codec=...)`` to this one.
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
      compression: :class:`dedloc_jax.TopK` for SparseLoCo-style pseudo-gradients: each peer
        sends the top ``density`` of every chunk of ``outer - local`` plus its error feedback
        (kept in the state, never served), values in ``bits`` bits; the host gets the compact
        payload and returns the dense mean (``codec`` is then ignored). None: dense, ``codec``.

    ``update(grads, state, params, *, batch_size)``: ``grads`` are the mean gradients of a
    micro-batch of ``batch_size`` samples; ``params`` (required) are the local parameters. A
    micro-step of ``batch_size=0`` (a peer waiting for the outer step) takes no inner step.
    The updates returned are the inner updates, and on an outer step those that move the
    parameters onto the new outer ones.
    """
    check_options(target_batch_size, callback)
    if codec is not None and codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS} or None, got {codec!r}")
    if codec is not None and not _accepts_codec(collab.average_gradients):
        raise TypeError(
            f"{type(collab).__name__}.average_gradients takes no codec: pass codec=None "
            "(the collaboration's own) or use a dedloc_jax.Collaboration"
        )
    if compression is not None:
        codec = compression  # type: ignore[assignment]  # the host gathers sparse payloads
    wire = {} if codec is None else {"codec": codec}
    calls = connect(collab, target_batch_size=target_batch_size, overlap=overlap, wire=wire)
    inner = optax.with_extra_args_support(inner)
    if outer is None and compression is not None:
        outer = optax.sgd(1.0)  # SparseLoCo's: the error feedback stands in for momentum
    elif outer is None:
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)

    def init(params: optax.Params) -> DiLoCoState:
        return _init_state(inner, outer, params, overlap, compression)

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
        traced = is_traced(samples, state.fresh, updates, params)
        step = MicroStep(calls, traced=traced, kind=callback, overlap=overlap)
        inner_updates, inner_state = _inner_step(
            inner, step, state, updates, params, batch, extra_args
        )
        action = step.decide(state.epoch, samples, batch)
        branches = _OuterStep(
            inner, outer, reset_inner, step, state, params, samples, inner_updates, compression
        )
        return _new_state(branches.chosen(action)(inner_state))

    return optax.GradientTransformationExtraArgs(init, update)


def _init_state(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    params: optax.Params,
    overlap: bool,
    compression: TopK | None = None,
) -> DiLoCoState:
    size = sum(int(jnp.size(p)) for p in jax.tree.leaves(params))
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
        error_feedback=None if compression is None else jnp.zeros((size,), jnp.float32),
    )


def _inner_step(
    inner: optax.GradientTransformationExtraArgs,
    step: MicroStep,
    state: DiLoCoState,
    updates: optax.Updates,
    params: optax.Params,
    batch: jax.Array,
    extra_args: dict[str, Any],
) -> tuple[optax.Updates, optax.OptState]:
    """This micro-step's inner update and inner state."""
    # A served or loaded state holds a placeholder inner state: start a fresh one.
    inner_state = step.cond(state.fresh, lambda: inner.init(params), lambda: state.inner_state)

    def inner_step(inner_state: Any) -> tuple[Any, Any]:
        return inner.update(updates, inner_state, params, **extra_args)

    def no_step(inner_state: Any) -> tuple[Any, Any]:
        shapes = jax.eval_shape(inner_step, inner_state)[0]
        return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes), inner_state

    # A micro-step of no samples (a peer waiting for the others) takes no inner step.
    return step.cond(batch > 0, inner_step, no_step, inner_state)


def _new_state(out: tuple) -> tuple[optax.Updates, DiLoCoState]:
    """The updates and the new state, from a branch's output."""
    (new_updates, inner_state, outer_params, outer_state, epoch, group_size, complete) = out[:7]
    samples, synced, sent, error_feedback = out[7:]
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
        error_feedback=error_feedback,
    )


class _OuterStep(TransformBranches):
    """The branches of one micro-step of :func:`diloco`, after its inner step.

    Each takes the inner state and returns (updates, inner_state, outer_params, outer_state,
    epoch, group_size, complete, samples, synced, sent, error_feedback).
    """

    def __init__(
        self,
        inner: optax.GradientTransformationExtraArgs,
        outer: optax.GradientTransformation,
        reset_inner: bool,
        step: MicroStep,
        state: DiLoCoState,
        params: optax.Params,
        samples: jax.Array,
        inner_updates: optax.Updates,
        compression: TopK | None = None,
    ) -> None:
        super().__init__(inner, step, state, samples, params, compression)
        self.outer = outer
        self.reset_inner = reset_inner
        self.inner_updates = inner_updates

    def keep(self, inner_state: Any) -> tuple:
        state = self.state
        return (
            self.inner_updates,
            inner_state,
            state.outer_params,
            state.outer_state,
            state.epoch,
            state.group_size,
            state.complete,
            self.samples,
            jnp.bool_(False),
            state.sent,
            state.error_feedback,
        )

    def average(self, inner_state: Any) -> tuple:
        leaves, treedef = jax.tree.flatten(self._local_delta())
        error_feedback = self.state.error_feedback
        if self.compression is None:
            got, taken = self.step.average(self.state.epoch, self.samples, leaves)
        else:
            payload, error_feedback = self._compress(leaves)
            like = [jax.ShapeDtypeStruct(error_feedback.shape, jnp.float32)]
            got, taken = self.step.average(self.state.epoch, self.samples, payload, like)
            got = got._replace(leaves=_split(got.leaves[0], leaves))
        new_outer, outer_state = self._outer_step(got, treedef)
        landed = self._landed(got, new_outer, outer_state, inner_state, local=new_outer)
        return (*landed, self.samples - taken, jnp.bool_(True), self.state.sent, error_feedback)

    def start(self, inner_state: Any) -> tuple:
        delta = self._local_delta()
        sending, error_feedback = jax.tree.leaves(delta), self.state.error_feedback
        if self.compression is not None:
            sending, error_feedback = self._compress(sending)
        taken = self.step.start(self.state.epoch, self.samples, sending)
        out = self.keep(inner_state)
        return (*out[:7], self.samples - taken, jnp.bool_(False), delta, error_feedback)

    def apply(self, inner_state: Any) -> tuple:
        state = self.state
        leaves, treedef = jax.tree.flatten(state.sent)
        if self.compression is None:
            got = self.step.collect(state.epoch, leaves)
        else:
            got = self.step.collect(state.epoch, [state.error_feedback])
            got = got._replace(leaves=_split(got.leaves[0], leaves))
        new_outer, outer_state = self._outer_step(got, treedef)
        # local = new_outer + (local_now - local_sent), local_sent = outer - sent
        local = jax.tree.map(
            lambda n, p, u, o, s: (
                n.astype(jnp.float32)
                + (p.astype(jnp.float32) + u.astype(jnp.float32))
                - (o.astype(jnp.float32) - s)
            ).astype(p.dtype),
            new_outer,
            self.params,
            self.inner_updates,
            state.outer_params,
            state.sent,
        )
        landed = self._landed(got, new_outer, outer_state, inner_state, local=local)
        unsent = jax.tree.map(jnp.zeros_like, state.sent)
        return (*landed, self.samples, jnp.bool_(False), unsent, state.error_feedback)

    def _local_delta(self) -> Any:
        """outer - local after this micro-step's inner update, float32 leaves."""
        local = optax.apply_updates(self.params, self.inner_updates)
        return jax.tree.map(
            lambda o, p: o.astype(jnp.float32) - p.astype(jnp.float32),
            self.state.outer_params,
            local,
        )

    def _outer_step(self, got: Averaged, treedef: Any) -> tuple[Any, Any]:
        """The outer optimizer's step with the averaged pseudo-gradient."""
        outer_params = self.state.outer_params
        avg = jax.tree.unflatten(treedef, got.leaves)
        avg = jax.tree.map(lambda a, o: a.astype(o.dtype), avg, outer_params)
        o_updates, outer_state = self.outer.update(avg, self.state.outer_state, outer_params)
        return optax.apply_updates(outer_params, o_updates), outer_state

    def _compress(self, leaves: list[jax.Array]) -> tuple[list[jax.Array], jax.Array]:
        """The TopK payload (offsets, codes, scales, size) of (error feedback x decay + the
        pseudo-gradient), and what it leaves unsent: the new error feedback."""
        assert self.compression is not None and self.state.error_feedback is not None
        flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])
        decay = jnp.float32(self.compression.error_feedback)
        acc = decay * self.state.error_feedback + flat
        payload, sent = encode_jax(self.compression, acc)
        return [*payload, jnp.asarray(flat.size, jnp.int32)], acc - sent

    def _landed(
        self, got: Averaged, new_outer: Any, outer_state: Any, inner_state: Any, *, local: Any
    ) -> tuple:
        """The first seven slots of a branch whose outer step landed (``got``: the averaging):
        updates that move the parameters onto ``local``, the inner state after it, the new
        outer parameters and state, and the averaging's epoch, group size and completeness."""
        moved = self._moving_to(local)
        after = self._after_outer(new_outer, inner_state)
        return (moved, after, new_outer, outer_state, got.epoch, got.group_size, got.complete)

    def _after_outer(self, new_outer: Any, inner_state: Any) -> Any:
        return self.inner.init(new_outer) if self.reset_inner else inner_state

    def _moving_to(self, target: Any) -> Any:
        """Updates that move the local parameters onto ``target``."""
        return jax.tree.map(lambda t, p: (t - p).astype(p.dtype), target, self.params)


def _split(flat: jax.Array, like: list[jax.Array]) -> list[jax.Array]:
    """``flat`` cut into arrays shaped like ``like`` (the inverse of concatenating them)."""
    out, at = [], 0
    for x in like:
        out.append(flat[at : at + x.size].reshape(x.shape))
        at += x.size
    return out
