"""Evaluation as sahajBERT was judged: NER on WikiANN bn and news classification on sna.bn.

``python -m examples.sahajbert finetune --task ner|ncc --checkpoint DIR [--data D]``
fine-tunes the checkpoint's encoder with the published recipe (AdamW at lr 1e-5, sequences of
128, batches of 128, up to 20 epochs, early stopping when the validation loss has not improved
for 3 epochs; the best epoch's weights are kept) and prints the test scores: entity-level F1
(seqeval's default, conlleval-style chunking) on each word's first sub-token for NER, accuracy
for NCC.

Data: a directory of ``train.jsonl``/``validation.jsonl``/``test.jsonl`` (NER rows
``{"tokens": [...], "ner_tags": [...]}``, NCC rows ``{"text": ..., "label": ...}``; tags and
labels as names or as integer ids in the HF order), ``hf`` for the Hugging Face datasets
(``wikiann``/``bn``, ``indic_glue``/``sna.bn``), or nothing: a small synthetic set.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from examples.sahajbert import checkpoint, training
from examples.sahajbert.config import DEFAULT_WORK_DIR, FinetuneConfig
from models.albert import (
    IGNORE_INDEX,
    AlbertForPreTraining,
    AlbertForSequenceClassification,
    AlbertForTokenClassification,
    load_backbone,
)
from models.text.corpus import NCC_LABELS, NER_TAGS

log = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
HF_NAMES = {"ner": ("wikiann", "bn"), "ncc": ("indic_glue", "sna.bn")}


# ------------------------------------------------------------------------------- scoring
def entity_spans(tags: Sequence[str]) -> set[tuple[int, int, str]]:
    """Chunks ``(start, end, type)`` of an IOB2 sequence, conlleval-style: an ``I-`` that does
    not continue a chunk of its type starts a new one."""
    spans: set[tuple[int, int, str]] = set()
    start, kind = None, ""
    for i, tag in enumerate([*tags, "O"]):
        prefix, _, typ = tag.partition("-") if tag != "O" else ("O", "", "")
        if start is not None and (prefix in ("O", "B") or typ != kind):
            spans.add((start, i, kind))
            start = None
        if prefix == "B" or (prefix == "I" and start is None):
            start, kind = i, typ
    return spans


def f1_score(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> dict[str, float]:
    """Micro precision, recall and F1 over entities (exact span and type)."""
    tp = n_gold = n_pred = 0
    for g, p in zip(gold, pred, strict=True):
        gs, ps = entity_spans(g), entity_spans(p)
        tp += len(gs & ps)
        n_gold += len(gs)
        n_pred += len(ps)
    precision = tp / n_pred if n_pred else 0.0
    recall = tp / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


# ---------------------------------------------------------------------------------- data
def _label_name(value: Any, names: Sequence[str]) -> str:
    if isinstance(value, int | np.integer):
        return names[int(value)]
    if value not in names:
        raise ValueError(f"unknown label {value!r} (expected one of {list(names)})")
    return str(value)


class TaskDataError(ValueError):
    """Fine-tuning data that cannot be used (a missing split, a malformed row); the message
    names the file and row and says what is expected."""


NER_ROW = '{"tokens": [...], "ner_tags": [...]}'
NCC_ROW = '{"text": "...", "label": "..."}'


def _row_ner(r: Any) -> tuple[list[str], list[str]]:
    tokens, tags = r["tokens"], r["ner_tags"]
    if not isinstance(tokens, list) or not isinstance(tags, list) or len(tokens) != len(tags):
        raise ValueError("tokens and ner_tags must be lists of the same length")
    return [str(t) for t in tokens], [_label_name(t, NER_TAGS) for t in tags]


def _row_ncc(r: Any) -> tuple[str, str]:
    return str(r["text"]), _label_name(r["label"], NCC_LABELS)


def _parse_rows(task: str, rows: list, where: str) -> list:
    parse, layout = (_row_ner, NER_ROW) if task == "ner" else (_row_ncc, NCC_ROW)
    out = []
    for i, r in enumerate(rows, 1):
        try:
            out.append(parse(r))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise TaskDataError(f"{where}, row {i}: {e!s} (a {task} row is {layout})") from None
    return out


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise TaskDataError(f"{path}, line {i}: not JSON ({e.msg})") from None
    return rows


def load_task_data(task: str, data: str | None, *, seed: int = 0) -> dict[str, list]:
    """``{"train": [...], "validation": [...], "test": [...]}`` of (input, label) pairs."""
    if data is None:
        return synthetic_task_data(task, seed=seed)
    if data == "hf":
        import importlib

        try:
            datasets = importlib.import_module("datasets")
        except ImportError as e:
            raise SystemExit("--finetune-data hf needs `pip install datasets`") from e
        path, name = HF_NAMES[task]
        ds = datasets.load_dataset(path, name)
        missing = [s for s in SPLITS if s not in ds]
        if missing:
            raise TaskDataError(f"{path}/{name} has no {', '.join(missing)} split")
        return {
            s: _parse_rows(task, [dict(r) for r in ds[s]], f"{path}/{name} {s}") for s in SPLITS
        }
    root = Path(data)
    if not root.is_dir():
        raise TaskDataError(f"{root} is not a directory (expected train/validation/test .jsonl)")
    missing = [f"{s}.jsonl" for s in SPLITS if not (root / f"{s}.jsonl").is_file()]
    if missing:
        raise TaskDataError(
            f"{root} lacks {', '.join(missing)}: fine-tuning needs train.jsonl, "
            "validation.jsonl and test.jsonl (see `finetune --help` for the row format)"
        )
    splits = {s: _parse_rows(task, read_jsonl(root / f"{s}.jsonl"), str(root / f"{s}.jsonl"))
              for s in SPLITS}  # fmt: skip
    empty = [s for s in SPLITS if not splits[s]]
    if empty:
        raise TaskDataError(f"{root}: the {', '.join(empty)} split has no rows")
    return splits


def synthetic_task_data(task: str, *, seed: int = 0, sizes=(400, 100, 100)) -> dict[str, list]:
    from models.text.corpus import generate_ncc_examples, generate_ner_examples

    gen = generate_ner_examples if task == "ner" else generate_ncc_examples
    return {
        s: gen(n, seed=seed * 10 + i) for i, (s, n) in enumerate(zip(SPLITS, sizes, strict=True))
    }


def write_jsonl_split(task: str, out: Path, splits: dict[str, list]) -> Path:
    """Save (input, label) pairs in the local-file format :func:`load_task_data` reads."""
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        with (out / f"{split}.jsonl").open("w", encoding="utf-8") as f:
            for x, y in rows:
                row = {"tokens": x, "ner_tags": y} if task == "ner" else {"text": x, "label": y}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return out


@dataclass
class Encoded:
    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray
    labels: np.ndarray  # [n, seq] (NER, -100 off first sub-tokens) or [n] (NCC)
    first_token: list[list[int]] | None = None  # NER: position of each word's first piece


def encode_ner(tokenizer: Any, rows: list, seq: int) -> Encoded:
    enc = tokenizer(
        [words for words, _ in rows],
        is_split_into_words=True,
        truncation=True,
        max_length=seq,
        padding="max_length",
    )
    labels = np.full((len(rows), seq), IGNORE_INDEX, np.int32)
    firsts = []
    for i, (words, tags) in enumerate(rows):
        word_ids = enc.word_ids(i)
        first = [-1] * len(words)
        for pos, w in enumerate(word_ids):
            if w is not None and first[w] < 0:
                first[w] = pos
                labels[i, pos] = NER_TAGS.index(tags[w])
        firsts.append(first)
    return Encoded(
        np.asarray(enc["input_ids"], np.int32),
        np.asarray(enc["attention_mask"], np.int32),
        np.asarray(enc["token_type_ids"], np.int32),
        labels,
        firsts,
    )


def encode_ncc(tokenizer: Any, rows: list, seq: int) -> Encoded:
    enc = tokenizer(
        [text for text, _ in rows], truncation=True, max_length=seq, padding="max_length"
    )
    return Encoded(
        np.asarray(enc["input_ids"], np.int32),
        np.asarray(enc["attention_mask"], np.int32),
        np.asarray(enc["token_type_ids"], np.int32),
        np.asarray([NCC_LABELS.index(y) for _, y in rows], np.int32),
    )


# --------------------------------------------------------------------------------- model
def load_pretrained(path: Path) -> tuple[AlbertForPreTraining, dict]:
    """The pretraining model saved in the checkpoint at (or newest under) ``path``."""
    return checkpoint.load_model(path)


def _loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    valid = labels != IGNORE_INDEX
    nll = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), jnp.where(valid, labels, 0)
    )
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def _batch_loss(model: nnx.Module, batch: dict) -> jax.Array:
    out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    return _loss(out.logits, batch["labels"])


@nnx.jit
def _train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: dict) -> jax.Array:
    loss, grads = nnx.value_and_grad(_batch_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def _eval_step(model: nnx.Module, batch: dict) -> tuple[jax.Array, jax.Array]:
    out = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    return _loss(out.logits, batch["labels"]), jnp.argmax(out.logits, -1)


def _batches(enc: Encoded, size: int, rng: np.random.Generator | None):
    n = len(enc.labels)
    order = rng.permutation(n) if rng is not None else np.arange(n)
    for s in range(0, n, size):
        idx = order[s : s + size]
        if rng is not None and len(idx) < size and n >= size:
            continue  # fixed shapes while training: drop the ragged tail
        yield (
            idx,
            {
                "input_ids": enc.input_ids[idx],
                "attention_mask": enc.attention_mask[idx],
                "token_type_ids": enc.token_type_ids[idx],
                "labels": enc.labels[idx],
            },
        )


def evaluate(model: nnx.Module, enc: Encoded, size: int) -> tuple[float, np.ndarray]:
    """Mean loss (weighted by examples) and the argmax predictions."""
    model.eval()
    losses, preds = [], []
    for idx, batch in _batches(enc, size, None):
        loss, pred = _eval_step(model, batch)
        losses.append(float(loss) * len(idx))
        preds.append(np.asarray(pred))
    return sum(losses) / max(len(enc.labels), 1), np.concatenate(preds)


def score(task: str, enc: Encoded, rows: list, preds: np.ndarray) -> dict[str, float]:
    if task == "ncc":
        return {"accuracy": float(np.mean(preds == enc.labels))}
    gold, pred = [], []
    for i, (_, tags) in enumerate(rows):
        firsts = enc.first_token[i]
        gold.append(list(tags))
        pred.append([NER_TAGS[int(preds[i, p])] if p >= 0 else "O" for p in firsts])
    return f1_score(gold, pred)


def finetune(
    task: str,
    ckpt: Path,
    data: str | None,
    cfg: FinetuneConfig = FinetuneConfig(),
    *,
    work_dir: Path = DEFAULT_WORK_DIR,
) -> dict[str, Any]:
    """Fine-tune and score; returns test scores, the epochs run and the validation losses.
    ``work_dir`` holds the compiled programs' cache."""
    from models.text.tokenizer import load_tokenizer

    training.enable_compilation_cache(Path(work_dir) / "jax-cache")
    splits = load_task_data(task, data, seed=cfg.seed)  # first: bad data fails fast
    pretrained, meta = load_pretrained(ckpt)
    tokenizer = load_tokenizer(checkpoint.resolve(ckpt) / "tokenizer")
    seq = min(cfg.seq_length, pretrained.config.max_position_embeddings)
    encode = encode_ner if task == "ner" else encode_ncc
    enc = {s: encode(tokenizer, splits[s], seq) for s in SPLITS}
    n_labels = len(NER_TAGS) if task == "ner" else len(NCC_LABELS)
    head = AlbertForTokenClassification if task == "ner" else AlbertForSequenceClassification
    model = head(pretrained.config, n_labels, rngs=nnx.Rngs(cfg.seed))
    load_backbone(model, pretrained)
    optimizer = nnx.Optimizer(
        model, optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay), wrt=nnx.Param
    )
    rng = np.random.default_rng(cfg.seed)
    best, best_state, waited, history = math.inf, nnx.state(model), 0, []
    for epoch in range(cfg.epochs):
        model.train()
        train_losses = [
            float(_train_step(model, optimizer, b))
            for _, b in _batches(enc["train"], cfg.batch_size, rng)
        ]
        val_loss, _ = evaluate(model, enc["validation"], cfg.batch_size)
        history.append({"epoch": epoch, "train_loss": float(np.mean(train_losses)),
                        "validation_loss": val_loss})  # fmt: skip
        log.info("epoch %d: train %.4f, validation %.4f", epoch, history[-1]["train_loss"],
                 val_loss)  # fmt: skip
        if val_loss < best:
            best, waited = val_loss, 0
            best_state = jax.tree.map(lambda x: x, nnx.state(model))
        else:
            waited += 1
            if waited >= cfg.patience:
                break
    nnx.update(model, best_state)
    test_loss, preds = evaluate(model, enc["test"], cfg.batch_size)
    scores = score(task, enc["test"], splits["test"], preds)
    return {
        "task": task,
        "checkpoint_epoch": meta.get("epoch"),
        "epochs": len(history),
        "best_validation_loss": best,
        "test_loss": test_loss,
        "history": history,
        **scores,
    }


def main_finetune(args: argparse.Namespace) -> int:
    cfg = FinetuneConfig(
        learning_rate=args.lr,
        epochs=args.epochs,
        batch_size=args.batch_size,
        patience=args.patience,
        seq_length=args.ft_seq_length,
    )
    try:
        result = finetune(
            args.task, args.checkpoint, args.finetune_data, cfg, work_dir=args.work_dir
        )
    except (TaskDataError, FileNotFoundError) as e:
        print(f"finetune: {e}", file=sys.stderr)
        return 2
    metric = "f1" if args.task == "ner" else "accuracy"
    print(
        f"{args.task}: test {metric} {100 * result[metric]:.2f} "
        f"(test loss {result['test_loss']:.4f}, {result['epochs']} epochs, checkpoint of "
        f"epoch {result['checkpoint_epoch']})"
    )
    print(json.dumps({k: v for k, v in result.items() if k != "history"}))
    return 0
