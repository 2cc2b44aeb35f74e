"""Fine-tuning a (tiny, untrained) checkpoint on small generated NER / NCC sets, end to end."""

from __future__ import annotations

import math
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


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (fresh) with a small tokenizer trained on generated text: no corpus
    cache needed, so the CLI test below stays short."""
    from models.text.corpus import generate_documents
    from models.text.tokenizer import load_tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("small")
    train_tokenizer(generate_documents(200, seed=3), 400, root / "tok")
    model_cfg = training.model_config("tiny", len(load_tokenizer(root / "tok")), 128, False)
    _, params, _ = training.build_model(model_cfg)
    checkpoint.save_checkpoint(
        root / "ckpt", 5, training.flat_params(params), model_cfg, root / "tok", "test"
    )
    return root / "ckpt"


@pytest.mark.slow
def test_finetune_from_the_cli_at_the_recipes_settings(small_checkpoint, tmp_path, capsys) -> None:
    """``finetune`` as the README runs it, from local .jsonl files, at sahajBERT's recipe (lr
    1e-5, sequences of 128, batches of 128, patience 3), for two epochs of generated data."""
    import json

    from examples.sahajbert.__main__ import main

    data = write_jsonl_split(
        "ncc", tmp_path / "ncc", synthetic_task_data("ncc", sizes=(256, 64, 64))
    )
    argv = ["finetune", "--task", "ncc", "--checkpoint", str(small_checkpoint), "--data",
            str(data), "--epochs", "2", "--work-dir", str(tmp_path / "wd")]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("ncc: test accuracy")
    result = json.loads(out[-1])
    assert result["checkpoint_epoch"] == 5 and result["epochs"] == 2
    assert 0.0 <= result["accuracy"] <= 1.0 and math.isfinite(result["test_loss"])
    assert (tmp_path / "wd" / "jax-cache").is_dir()  # --work-dir honoured
