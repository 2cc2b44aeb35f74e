"""Where pretraining text comes from: local files, or HF ``datasets`` streams like sahajBERT's.

Local files hold one document per line, or one document per block of lines separated by blank
lines. The HF source streams Bengali Wikipedia and OSCAR and interleaves them 0.23 / 0.77, the mix
sahajBERT used; it needs the optional ``datasets`` package and network access, so it is imported
lazily and fails with :class:`SourceUnavailableError` and a hint when either is missing.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

logger = logging.getLogger(__name__)


class SourceUnavailableError(RuntimeError):
    """A text source cannot be used here (missing package, no network, unknown dataset)."""


class DocumentLayout(StrEnum):
    """How a local text file separates documents."""

    LINE = "line"  # one document per non-empty line
    BLOCK = "block"  # one document per block of lines separated by blank lines


def iter_local_documents(
    paths: str | Path | Iterable[str | Path], *, layout: DocumentLayout | str = DocumentLayout.LINE
) -> Iterator[str]:
    """Documents from UTF-8 text files, streamed (a block's lines are joined with a space)."""
    layout = DocumentLayout(layout)
    if isinstance(paths, str | Path):
        paths = [paths]
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no such text file: {path}")
        with path.open(encoding="utf-8") as f:
            if layout is DocumentLayout.LINE:
                for line in f:
                    line = line.strip()
                    if line:
                        yield line
                continue
            block: list[str] = []
            for line in f:
                line = line.strip()
                if line:
                    block.append(line)
                elif block:
                    yield " ".join(block)
                    block = []
            if block:
                yield " ".join(block)


def read_local_documents(
    paths: str | Path | Iterable[str | Path], *, layout: DocumentLayout | str = DocumentLayout.LINE
) -> list[str]:
    """All documents of the files, in order."""
    return list(iter_local_documents(paths, layout=layout))


@dataclass(frozen=True)
class HFStreamSpec:
    """One HF dataset streamed for pretraining text."""

    path: str
    name: str | None
    split: str = "train"
    text_column: str = "text"


# Defaults in the spirit of sahajBERT's mix; hub names change over time, so both are settable.
BENGALI_WIKIPEDIA = HFStreamSpec("wikimedia/wikipedia", "20231101.bn")
OSCAR_BENGALI = HFStreamSpec("oscar", "unshuffled_deduplicated_bn")
SAHAJBERT_MIX: tuple[tuple[HFStreamSpec, float], ...] = (
    (BENGALI_WIKIPEDIA, 0.23),
    (OSCAR_BENGALI, 0.77),
)


def _import_datasets():
    try:
        return importlib.import_module("datasets")
    except ImportError as err:
        raise SourceUnavailableError(
            "streaming Bengali Wikipedia/OSCAR needs the optional `datasets` package "
            "(pip install datasets) and network access to the Hugging Face hub; offline, use "
            "local text files (models.sources.iter_local_documents) or the synthetic corpus "
            "(models.corpus.write_corpus)"
        ) from err


def stream_hf_documents(
    *,
    seed: int,
    mix: Iterable[tuple[HFStreamSpec, float]] = SAHAJBERT_MIX,
    shuffle_buffer: int = 10_000,
) -> Iterator[str]:
    """Documents streamed from HF datasets, interleaved with the given probabilities.

    Each peer should pass its own ``seed`` so peers read the stream in different orders.
    """
    datasets = _import_datasets()
    specs, weights = zip(*mix, strict=True)
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("mix weights must sum to a positive number")
    streams = []
    for spec in specs:
        try:
            ds = datasets.load_dataset(spec.path, spec.name, split=spec.split, streaming=True)
        except (OSError, ValueError) as err:  # includes connection and not-found errors
            raise SourceUnavailableError(
                f"cannot stream {spec.path}/{spec.name}: {err} (offline? hub name changed? "
                "set another HFStreamSpec)"
            ) from err
        if spec.text_column != "text":
            ds = ds.rename_column(spec.text_column, "text")
        streams.append(ds.select_columns(["text"]).shuffle(seed=seed, buffer_size=shuffle_buffer))
    mixed = datasets.interleave_datasets(
        streams, probabilities=[w / total for w in weights], seed=seed
    )
    rows = iter(mixed)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except OSError as err:  # the connection dropped mid-stream
            raise SourceUnavailableError(f"streaming stopped: {err}") from err
        text = row["text"].strip()
        if text:
            yield text
