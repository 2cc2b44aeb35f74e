"""The sahajBERT example in DiLoCo mode: the options, and a short demo (slow)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import optax
import pytest

from dedloc_jax import DiLoCoState
from examples.sahajbert import training
from examples.sahajbert.__main__ import parse_args, trainer_config
from examples.sahajbert.config import DEFAULT_WORK_DIR, DemoConfig, TrainerConfig
from examples.sahajbert.demo import cli_args, run_collaboration
from examples.sahajbert.trainer import collaboration_config


def test_mode_diloco_sets_the_outer_target_and_the_int8_codec() -> None:
    args = parse_args(
        ["trainer", "--mode", "diloco", "--inner-steps", "7", "--initial-peers", "/x"]
    )
    cfg = trainer_config(args)
    assert cfg.mode == "diloco" and cfg.inner_steps == 7
    assert cfg.collaboration_target == 7 * cfg.target_batch_size
    collab = collaboration_config(cfg)
    assert collab.target_batch_size == 7 * cfg.target_batch_size and collab.codec == "int8"
    # DeDLOC mode is the default and unchanged
    plain = trainer_config(parse_args(["trainer", "--initial-peers", "/x"]))
    assert plain.mode == "dedloc" and plain.collaboration_target == plain.target_batch_size
    assert collaboration_config(plain).codec == "fp16"
    # the demo passes the mode on to its trainers
    demo = TrainerConfig.demo().replace(mode="diloco", inner_steps=3)
    again = trainer_config(parse_args(["trainer", *cli_args(demo), "--initial-peers", "/x"]))
    assert (again.mode, again.inner_steps) == ("diloco", 3)
    with pytest.raises(ValueError, match="mode"):
        TrainerConfig(mode="local")


def test_make_optimizer_in_diloco_mode_is_diloco_around_the_inner_recipe() -> None:
    peer = _CodecHost()
    tx = training.make_optimizer(
        TrainerConfig.demo().optimizer, peer, 64, inner=optax.sgd(0.1), diloco="int8"
    )
    state = tx.init({"w": np.zeros(3, np.float32)})
    assert isinstance(state, DiLoCoState)


def test_the_outer_rate_decays_to_zero_at_the_runs_last_outer_step() -> None:
    """DiLoCo's 0.7 at the first outer step, cosine to 0 at total_steps / inner_steps outer
    steps; Nesterov momentum 0.9 throughout."""
    opt = TrainerConfig.demo().optimizer.replace(total_steps=40)
    outer = training.outer_optimizer(opt, inner_steps=4)  # 10 outer steps
    params = {"w": np.zeros(2, np.float32)}
    state = outer.init(params)
    grad = {"w": np.ones(2, np.float32)}
    rates = []
    trace = 0.0  # Nesterov SGD: trace = g + 0.9 trace; the step is rate * (g + 0.9 trace)
    for _ in range(12):
        update, state = outer.update(grad, state, params)
        trace = 1.0 + 0.9 * trace
        rates.append(float(-update["w"][0]) / (1.0 + 0.9 * trace))
    np.testing.assert_allclose(rates[0], 0.7, rtol=1e-6)
    assert all(a > b for a, b in zip(rates[:10], rates[1:11], strict=True))  # decays...
    assert rates[10] == rates[11] == 0.0  # ... to 0 at the 10th outer step and after


class _CodecHost:
    def report_progress(self, epoch, samples, batch_size):
        return False

    def average_gradients(self, epoch, gradients, samples, *, codec=None):
        raise AssertionError("not reached")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_diloco_demo_ends_bit_identical_and_checkpointed(tmp_path: Path) -> None:
    cfg = TrainerConfig.demo(DEFAULT_WORK_DIR).replace(
        run_id="sahajbert-diloco-test", mode="diloco", inner_steps=2
    )
    demo = DemoConfig(trainers=2, client_trainers=1, epochs=3, checkpoint_every=3, timeout=400)
    result = run_collaboration(demo, cfg, tmp_path, live=False)
    assert result.returncodes == {"coordinator": 0, "trainer0": 0, "trainer1": 0}
    assert [r["epoch"] for r in result.rows] == list(range(demo.epochs))
    assert result.identical  # the trainers' final (outer) parameters, bit for bit
    final = dict(np.load(result.final_params[0]))
    assert int(final.pop("__epoch__")) == demo.epochs
    assert result.checkpoint is not None
    # each outer step gathered about inner_steps target batches, not one
    assert all(r["samples"] >= cfg.target_batch_size for r in result.rows), result.rows


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_diloco_demo_as_shipped_lowers_the_loss(tmp_path: Path) -> None:
    """`python -m examples.sahajbert --mode diloco`'s run (30 outer steps): the loss of its
    last epochs is below that of its first ones."""
    cfg = TrainerConfig.demo(DEFAULT_WORK_DIR).replace(
        run_id="sahajbert-diloco-loss", mode="diloco"
    )
    result = run_collaboration(DemoConfig(), cfg, tmp_path, live=False)
    assert result.identical
    losses = [r["loss"] for r in result.rows if r.get("loss") is not None]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.2, losses
