"""Fine-tuning a (tiny, untrained) checkpoint on small generated NER / NCC sets, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.sahajbert import checkpoint, training
from examples.sahajbert.config import DEFAULT_WORK_DIR, FinetuneConfig, TrainerConfig
from examples.sahajbert.finetune import finetune, synthetic_task_data, write_jsonl_split


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the demo's tiny model (fresh initialisation) with the demo tokenizer."""
    cfg = TrainerConfig.demo(DEFAULT_WORK_DIR)
    training.enable_compilation_cache(cfg.work_dir / "jax-cache")
    tokenizer, _ = training.prepare_data(cfg)
    model_cfg = training.model_config("tiny", len(tokenizer), 64, False)
    _, params, _ = training.build_model(model_cfg)
    root = tmp_path_factory.mktemp("ckpt")
    checkpoint.save_checkpoint(
        root, 0, training.flat_params(params), model_cfg, training.tokenizer_dir(cfg), "test"
    )
    return root


pytestmark = pytest.mark.timeout(600)  # compiles two models on a busy CPU

FAST = FinetuneConfig(learning_rate=1e-3, seq_length=48, batch_size=16, epochs=6, patience=3)


@pytest.mark.slow  # ~3 min on a busy 2-core machine
def test_ncc_finetunes_from_local_files_and_beats_chance(tiny_checkpoint: Path, tmp_path: Path):
    data = write_jsonl_split(
        "ncc", tmp_path / "ncc", synthetic_task_data("ncc", sizes=(320, 64, 96))
    )
    result = finetune("ncc", tiny_checkpoint, str(data), FAST)
    assert result["checkpoint_epoch"] == 0
    assert 1 <= result["epochs"] <= FAST.epochs
    assert result["accuracy"] > 1 / 6 + 0.15  # six news categories
    losses = [h["train_loss"] for h in result["history"]]
    assert losses[-1] < losses[0]


@pytest.mark.slow  # ~3 min on a busy 2-core machine
def test_ner_finetunes_and_finds_entities(tiny_checkpoint: Path) -> None:
    cfg = FAST.replace(epochs=6, patience=3)
    result = finetune("ner", tiny_checkpoint, None, cfg)
    assert result["f1"] > 0.2  # a model that tags nothing scores 0
