"""``collaborative``: an optax transformation that trains with a DeDLOC collaboration.

Like :func:`optax.MultiSteps`, it accumulates micro-batch gradients and returns zero updates until
a step is due. The difference is who decides: the step is due when the *whole collaboration* has
accumulated ``target_batch_size`` samples. Then this peer's accumulated mean gradient is averaged
with its group (weights = samples), the inner optimizer is applied to the average, and the
accumulator is reset. Every peer of a group receives bit-identical averages and holds the same
inner state, so every peer takes the same step.

Inside ``jax.jit`` the host is reached with ordered ``io_callback``s: a cheap one with scalars on
every micro-step, and, only on steps that average, one that moves the gradient buffers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback

from dedloc_jax.host import CollaborationHost

__all__ = ["CollaborativeState", "collaborative"]


class CollaborativeState(NamedTuple):
    """State of :func:`collaborative`: fixed shapes and dtypes, so jit never recompiles."""

    inner_state: optax.OptState
    grad_sum: optax.Updates  # sum over micro-batches of (mean gradient x batch size), float32
    samples: jax.Array  # int32: samples accumulated toward the current epoch
    epoch: jax.Array  # int32: collaboration epoch this peer is in
    group_size: jax.Array  # int32: peers in the last averaging group (0 before the first)


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def collaborative(
    inner: optax.GradientTransformation,
    collab: CollaborationHost,
    *,
    target_batch_size: int,
    accumulator_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that it steps once per collaboration-wide batch.

    Args:
      inner: the optimizer applied to the collaboration's averaged gradients; its step count
        is the collaboration's epoch (also for a newcomer that loaded the state of others).
      collab: the collaboration (:class:`dedloc_jax.Collaboration` or any
        :class:`dedloc_jax.host.CollaborationHost`).
      target_batch_size: samples the whole collaboration accumulates per step.
      accumulator_dtype: dtype of the gradient accumulator.

    ``update(grads, state, params=None, *, batch_size)``: ``grads`` are the mean gradients of a
    micro-batch of ``batch_size`` samples.
    """
    if target_batch_size <= 0:
        raise ValueError(f"target_batch_size must be positive, got {target_batch_size}")
    inner = optax.with_extra_args_support(inner)

    def init(params: optax.Params) -> CollaborativeState:
        return CollaborativeState(
            inner_state=inner.init(params),
            grad_sum=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), accumulator_dtype), params),
            samples=jnp.zeros((), jnp.int32),
            epoch=jnp.zeros((), jnp.int32),
            group_size=jnp.zeros((), jnp.int32),
        )

    def _report(epoch: np.ndarray, samples: np.ndarray, batch_size: np.ndarray) -> np.ndarray:
        return np.bool_(collab.report_progress(int(epoch), int(samples), int(batch_size)))

    def _average(epoch: np.ndarray, samples: np.ndarray, *leaves: np.ndarray) -> tuple:
        arrays = [np.asarray(x) for x in leaves]
        outcome = collab.average_gradients(int(epoch), arrays, int(samples))
        if len(outcome.gradients) != len(leaves):
            raise ValueError("the collaboration returned a different number of gradient arrays")
        grads = []
        for got, want in zip(outcome.gradients, leaves, strict=True):
            got = np.asarray(got)
            if got.shape != want.shape:
                raise ValueError(f"averaged gradient has shape {got.shape}, expected {want.shape}")
            grads.append(got.astype(want.dtype, copy=False))
        return (*grads, np.int32(outcome.epoch), np.int32(outcome.group_size))

    def update(
        updates: optax.Updates,
        state: CollaborativeState,
        params: optax.Params | None = None,
        *,
        batch_size: int | jax.Array,
        **extra_args: Any,
    ) -> tuple[optax.Updates, CollaborativeState]:
        batch = jnp.asarray(batch_size, jnp.int32)
        grad_sum = jax.tree.map(
            lambda acc, g: acc + g.astype(acc.dtype) * batch.astype(acc.dtype),
            state.grad_sum,
            updates,
        )
        samples = state.samples + batch
        should_average = io_callback(
            _report, jax.ShapeDtypeStruct((), jnp.bool_), state.epoch, samples, batch, ordered=True
        )

        def average_and_step(_: None) -> tuple[optax.Updates, CollaborativeState]:
            leaves, treedef = jax.tree.flatten(grad_sum)
            denom = jnp.maximum(samples, 1).astype(jnp.float32)
            means = [leaf / denom.astype(leaf.dtype) for leaf in leaves]
            result_shapes = (
                *(jax.ShapeDtypeStruct(m.shape, m.dtype) for m in means),
                jax.ShapeDtypeStruct((), jnp.int32),
                jax.ShapeDtypeStruct((), jnp.int32),
            )
            *avg_leaves, new_epoch, group_size = io_callback(
                _average, result_shapes, state.epoch, samples, *means, ordered=True
            )
            averaged = jax.tree.unflatten(treedef, avg_leaves)
            averaged = jax.tree.map(lambda a, u: a.astype(u.dtype), averaged, updates)
            step_updates, inner_state = inner.update(
                averaged, state.inner_state, params, **extra_args
            )
            return step_updates, CollaborativeState(
                inner_state=inner_state,
                grad_sum=jax.tree.map(jnp.zeros_like, state.grad_sum),
                samples=jnp.zeros((), jnp.int32),
                epoch=new_epoch,
                group_size=group_size,
            )

        def keep_accumulating(_: None) -> tuple[optax.Updates, CollaborativeState]:
            zeros = jax.tree.map(jnp.zeros_like, updates)
            return zeros, state._replace(grad_sum=grad_sum, samples=samples)

        if _is_tracer(should_average):
            return jax.lax.cond(should_average, average_and_step, keep_accumulating, None)
        # Stepping on the host: plain Python control flow, no compiled conditional.
        if bool(should_average):
            return average_and_step(None)
        return keep_accumulating(None)

    return optax.GradientTransformationExtraArgs(init, update)
