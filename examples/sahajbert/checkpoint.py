"""Checkpoints of the pretrained model: orbax arrays plus what is needed to use them alone.

Layout of one checkpoint (``<checkpoint-dir>/epoch_000010/``)::

    params/             orbax (StandardCheckpointer) of {"albert.embeddings...": array, ...}
    model_config.json   the AlbertConfig fields
    meta.json           epoch, run id, save time, and the state's lineage: its digest and
                        the digests of the states it descends from (newest first), as the
                        trainers that served it announce them
    tokenizer/          the tokenizer the run used (fine-tuning needs the same ids)

``<checkpoint-dir>/latest`` names the newest one. Parameters are stored under flat dotted names
(no optimizer state): fine-tuning and export need the weights only, and newcomers to a live run
get the full state from peers instead.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from examples.sahajbert import training
from models.albert import AlbertConfig

log = logging.getLogger(__name__)


def save_checkpoint(
    root: Path,
    epoch: int,
    flat: dict[str, np.ndarray],
    model_config: AlbertConfig,
    tokenizer_dir: Path | None,
    run_id: str,
    lineage: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``epoch`` under ``root`` and point ``root/latest`` at it; ``lineage``
    (:func:`served_lineage`) goes to its meta: after two peers split, it tells which lineage a
    checkpoint is of (and whether the run went on from it)."""
    import orbax.checkpoint as ocp

    root = root.resolve()
    path = root / f"epoch_{epoch:06d}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / "params", {k: np.asarray(v) for k, v in flat.items()})
    checkpointer.wait_until_finished()
    training.save_model_config(model_config, path / "model_config.json")
    meta = {"epoch": epoch, "run_id": run_id, "saved_at": time.time(), **(lineage or {})}
    (path / "meta.json").write_text(json.dumps(meta))
    if tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
        shutil.copytree(tokenizer_dir, path / "tokenizer")
    (root / "latest").write_text(path.name)
    log.info("saved checkpoint of epoch %d to %s", epoch, path)
    return path


async def served_lineage(core: Any) -> dict[str, Any]:
    """The lineage of the state ``core`` (a CollaborationPeer) serves: ``{"digest": hex,
    "lineage": [hex, ...]}``, the ancestors as the peers serving the same state name them
    (a downloaded copy knows none of its own). Empty when it serves nothing."""
    served = core.tracker.served
    if served is None:
        return {}
    epoch, digest, ancestors = served
    for a in core.tracker.announcements():
        if (a.epoch, a.digest) == (epoch, digest) and len(a.lineage) > len(ancestors):
            ancestors = a.lineage
    return {"digest": digest.hex(), "lineage": [d.hex() for d in ancestors]}


def resolve(path: Path) -> Path:
    """A checkpoint directory, given it or its parent (then the newest one)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        return path / latest.read_text().strip()
    raise FileNotFoundError(f"{path} is not a checkpoint (no meta.json, no 'latest')")


def load_checkpoint(path: Path) -> tuple[AlbertConfig, dict[str, np.ndarray], dict]:
    """``(model config, flat params, meta)`` of the checkpoint at (or newest under) ``path``."""
    import orbax.checkpoint as ocp

    path = resolve(path)
    flat = ocp.StandardCheckpointer().restore(path / "params")
    meta = json.loads((path / "meta.json").read_text())
    config = training.load_model_config(path / "model_config.json")
    return config, {k: np.asarray(v) for k, v in flat.items()}, meta


def load_model(path: Path) -> tuple[Any, dict]:
    """The pretraining model (an nnx ``AlbertForPreTraining``) saved in the checkpoint at (or
    newest under) ``path``, and its meta."""
    from flax import nnx

    config, flat, meta = load_checkpoint(path)
    graphdef, params, rest = training.build_model(config)
    params = training.unflat_params(params, flat)
    return nnx.merge(graphdef, params, rest), meta
