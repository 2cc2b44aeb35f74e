"""Data parallelism over the local devices, and jitted training steps.

The recipe is plain SPMD: a 1-D mesh over the devices, the weights and optimizer state replicated
on each, the batch split along its leading axis. ``jax.jit`` then runs the step on every device
on its slice of the batch and sums the gradients across devices by itself, so the same step
function serves one device or many: only where its inputs live differs.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.albert import pretraining_batch_loss

DATA_AXIS = "data"


def make_mesh(devices=None, axis_name: str = DATA_AXIS) -> Mesh:
    """A 1-D mesh over ``devices`` (default: all local devices)."""
    devices = jax.local_devices() if devices is None else list(devices)
    return Mesh(np.array(devices), (axis_name,))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Split the leading (batch) axis over the mesh; the other axes stay whole."""
    return NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def shard_batch(batch, mesh: Mesh):
    """Place each array of ``batch`` (any pytree) split along its leading axis over the mesh."""
    n = mesh.size
    for leaf in jax.tree.leaves(batch):
        if np.shape(leaf)[0] % n:
            raise ValueError(f"batch of {np.shape(leaf)[0]} does not split over {n} devices")
    return jax.device_put(batch, batch_sharding(mesh))


def replicate(obj, mesh: Mesh):
    """Put a full copy of ``obj`` on every device of the mesh.

    ``obj`` is an NNX object (a model, an ``nnx.Optimizer``: updated in place and returned) or
    any pytree of arrays (a replicated copy is returned).
    """
    sharding = replicated_sharding(mesh)
    if isinstance(obj, nnx.Pytree):
        nnx.update(obj, jax.device_put(nnx.state(obj), sharding))
        return obj
    return jax.device_put(obj, sharding)


LossFn = Callable[[nnx.Module, dict], jax.Array]


def make_grad_step(loss_fn: LossFn = pretraining_batch_loss):
    """A jitted ``grad_step(model, batch) -> (loss, grads)`` that does not touch the weights,
    for callers that accumulate or average gradients before applying them."""

    @nnx.jit
    def grad_step(model, batch):
        return nnx.value_and_grad(loss_fn)(model, batch)

    return grad_step


def make_train_step(loss_fn: LossFn = pretraining_batch_loss):
    """A jitted ``train_step(model, optimizer, batch) -> loss``: forward, backward and the
    optimizer update (in place) in one compiled program. ``optimizer`` is an
    ``nnx.Optimizer(model, tx, wrt=nnx.Param)``. The default loss is
    ``pretraining_batch_loss`` (training mode, so dropout is on)."""

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    return train_step
