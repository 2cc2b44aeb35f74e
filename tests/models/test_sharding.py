"""Data parallelism: a step over 2 (fake CPU) devices equals the same step on one."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from models.sharding import batch_sharding, make_mesh, replicate, shard_batch

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: the device count is fixed when jax starts.
TWO_DEVICES = textwrap.dedent(
    """
    import json
    import jax, numpy as np, optax
    from flax import nnx
    from models.albert import AlbertConfig, AlbertForPreTraining
    from models.sharding import make_mesh, make_train_step, replicate, shard_batch
    from tests.models.test_albert import make_batch

    assert jax.device_count() == 2, jax.devices()
    cfg = AlbertConfig.tiny(num_hidden_layers=2)
    batch = make_batch(cfg, batch=4, seq=32)
    mesh = make_mesh()

    # Plain SGD with rate 1: after one step, weights minus new weights are the gradients.
    def build():
        model = AlbertForPreTraining(cfg, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)

    def grads_and_losses(model, opt, batch):
        def params():
            return nnx.to_pure_dict(nnx.state(model, nnx.Param))  # a snapshot of the arrays

        before = params()
        losses = [float(train_step(model, opt, batch))]
        grads = jax.tree.map(lambda a, b: a - b, before, params())
        losses.append(float(train_step(model, opt, batch)))
        return grads, losses

    train_step = make_train_step()
    single, single_opt = build()
    grads_1, losses_1 = grads_and_losses(single, single_opt, batch)

    model, opt = build()
    replicate(model, mesh)
    replicate(opt, mesh)
    sharded = shard_batch(batch, mesh)
    split = [s.data.shape for s in sharded["input_ids"].addressable_shards]
    grads_2, losses_2 = grads_and_losses(model, opt, sharded)
    kernel = model.albert.encoder.embedding_hidden_mapping_in.kernel[...]

    def max_diff(a, b):
        return max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

    try:
        shard_batch({"x": np.zeros((3, 2))}, mesh)
        odd_batch = "accepted"
    except ValueError:
        odd_batch = "refused"
    print(json.dumps(dict(
        split=split,
        param_devices=len(kernel.sharding.device_set),
        grad_diff=max_diff(grads_1, grads_2),
        grad_scale=max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(grads_1)),
        losses_1=losses_1,
        losses_2=losses_2,
        param_diff=max_diff(nnx.to_pure_dict(nnx.state(single, nnx.Param)),
                            nnx.to_pure_dict(nnx.state(model, nnx.Param))),
        odd_batch=odd_batch,
    )))
    """
)


@pytest.mark.slow
def test_two_device_data_parallel_step_matches_single_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()
    proc = subprocess.run(
        [sys.executable, "-c", TWO_DEVICES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["split"] == [[2, 32], [2, 32]]  # each device holds half the batch
    assert result["param_devices"] == 2  # weights replicated on both
    assert result["odd_batch"] == "refused"
    assert result["grad_scale"] > 0.01
    assert result["grad_diff"] < 1e-5 * max(1.0, result["grad_scale"])
    np.testing.assert_allclose(result["losses_2"], result["losses_1"], rtol=1e-5)
    assert result["param_diff"] < 1e-5


def test_helpers_on_the_local_devices():
    mesh = make_mesh()
    assert mesh.size == jax.local_device_count()
    n = mesh.size
    batch = {"ids": np.arange(4 * n).reshape(2 * n, 2)}
    placed = shard_batch(batch, mesh)
    assert placed["ids"].sharding == batch_sharding(mesh)
    np.testing.assert_array_equal(placed["ids"], batch["ids"])
    tree = replicate({"w": np.ones(3)}, mesh)
    assert tree["w"].sharding.is_fully_replicated
    if n > 1:
        with pytest.raises(ValueError):
            shard_batch({"ids": np.zeros((n + 1, 2))}, mesh)
