"""``python -m examples.sahajbert export``: a checkpoint as a transformers model directory.

The directory holds ``config.json`` and ``model.safetensors`` of a PyTorch
``AlbertForPreTraining`` (float32; the decoder tied to the word embeddings, as in transformers)
and the run's fast tokenizer (``tokenizer.json``, ``tokenizer_config.json``), so that::

    transformers.AutoModelForPreTraining.from_pretrained(DIR)
    transformers.AutoTokenizer.from_pretrained(DIR)

load them. ``dedloc_export.json`` says which checkpoint (epoch, run id) it came from.
torch and transformers are needed here only (the ``dev`` extra has them).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from examples.sahajbert import checkpoint

log = logging.getLogger(__name__)


class ExportError(RuntimeError):
    """The checkpoint cannot be exported (no tokenizer, no torch...); the message says why."""


def export(checkpoint_path: Path, out_dir: Path) -> Path:
    """Write the checkpoint at (or newest under) ``checkpoint_path`` to ``out_dir``."""
    try:
        import torch  # noqa: F401 (checked here: the error names the extra to install)
        import transformers  # noqa: F401
    except ImportError as e:
        raise ExportError(f"export needs torch and transformers ({e.name} is missing)") from None
    from models.hf import albert_to_torch
    from models.text.tokenizer import load_tokenizer

    try:
        source = checkpoint.resolve(Path(checkpoint_path))
    except FileNotFoundError as e:
        raise ExportError(str(e)) from None
    tokenizer_dir = source / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise ExportError(f"{source} has no tokenizer/ (the checkpoint is incomplete)")
    model, meta = checkpoint.load_model(source)
    tokenizer = load_tokenizer(tokenizer_dir)
    if len(tokenizer) != model.config.vocab_size:
        raise ExportError(
            f"the tokenizer has {len(tokenizer)} ids, "
            f"the model's vocabulary {model.config.vocab_size}"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch_model = albert_to_torch(model)
    torch_model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    info = {"epoch": meta.get("epoch"), "run_id": meta.get("run_id"), "checkpoint": str(source)}
    (out_dir / "dedloc_export.json").write_text(json.dumps(info, indent=1))
    log.info("exported %s (epoch %s) to %s", source, meta.get("epoch"), out_dir)
    return out_dir
