"""Where pretraining text comes from: local files, or HF ``datasets`` streams like sahajBERT's.

A run's data is a tuple of :class:`SourceSpec` (what ``--data`` parses into, and what the run
manifest carries), each with a weight: :func:`stream_documents` reads them all as endless
streams and mixes them by weight, never holding more than a shuffle buffer of documents.

* local text files: one document per line (``line``), or per block of lines separated by blank
  lines (``block``); each pass starts at a random byte offset drawn from the peer's seed, so
  peers read the same file in different orders without an index;
* local Parquet or Arrow files (a path, or a directory of them), streamed with ``datasets``;
* Hugging Face hub datasets, streamed. ``hf`` is sahajBERT's mix: Bengali Wikipedia 0.23 /
  Bengali web text 0.77. sahajBERT used OSCAR, whose loader is a script that current
  ``datasets`` refuses; both defaults here are plain Parquet repositories:
  ``wikimedia/wikipedia`` ``20231101.bn`` and FineWeb-2's ``ben_Beng`` subset
  (``HuggingFaceFW/fineweb-2``, ODC-By).

``datasets`` is the optional ``data`` extra, imported lazily: without it (or offline) a
source fails with :class:`SourceUnavailableError` and a hint.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

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
            yield from _documents(f, layout)


def read_local_documents(
    paths: str | Path | Iterable[str | Path], *, layout: DocumentLayout | str = DocumentLayout.LINE
) -> list[str]:
    """All documents of the files, in order."""
    return list(iter_local_documents(paths, layout=layout))


class SourceKind(StrEnum):
    TEXT = "text"  # local UTF-8 text, ``layout`` says how documents are separated
    PARQUET = "parquet"  # local Parquet file(s), streamed with ``datasets``
    ARROW = "arrow"  # local Arrow file(s), streamed with ``datasets``
    HUB = "hub"  # a Hugging Face hub dataset, streamed


MAX_SOURCES = 16
_MAX_FIELD = 1024  # characters of a path, name or column (a manifest crosses the network)


@dataclass(frozen=True)
class SourceSpec:
    """One pretraining text source and its share of the mix."""

    kind: SourceKind
    path: str  # a local file or directory, or the hub dataset's repository
    name: str | None = None  # the hub dataset's configuration (e.g. ``20231101.bn``)
    split: str = "train"
    layout: DocumentLayout = DocumentLayout.LINE  # text files only
    text_column: str = "text"
    weight: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", SourceKind(self.kind))
        object.__setattr__(self, "layout", DocumentLayout(self.layout))
        for field_name in ("path", "split", "text_column"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value or len(value) > _MAX_FIELD:
                raise ValueError(f"source {field_name} must be a non-empty string")
        if self.name is not None and (not isinstance(self.name, str) or len(self.name) > 200):
            raise ValueError("source name must be a string")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"source weight must be a positive finite number, not {w!r}")

    @property
    def local(self) -> bool:
        return self.kind is not SourceKind.HUB

    def describe(self) -> str:
        if self.kind is SourceKind.HUB:
            return f"hf:{self.path}" + (f":{self.name}" if self.name else "")
        if self.kind is SourceKind.TEXT:
            return f"{self.layout.value}:{self.path}"
        return self.path

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kind"], out["layout"] = self.kind.value, self.layout.value
        return out

    @classmethod
    def from_dict(cls, value: Any) -> SourceSpec:
        """From :meth:`to_dict`'s form; ValueError for anything else (it may come from a peer)."""
        if not isinstance(value, dict):
            raise ValueError("a data source is not a map")
        known = {"kind", "path", "name", "split", "layout", "text_column", "weight"}
        if set(value) - known:
            raise ValueError(f"unknown data source fields {sorted(set(value) - known)}")
        return cls(**value)


WIKIPEDIA_BN = SourceSpec(SourceKind.HUB, "wikimedia/wikipedia", "20231101.bn", weight=0.23)
FINEWEB2_BN = SourceSpec(SourceKind.HUB, "HuggingFaceFW/fineweb-2", "ben_Beng", weight=0.77)
SAHAJBERT_SOURCES: tuple[SourceSpec, ...] = (WIKIPEDIA_BN, FINEWEB2_BN)

DATA_HELP = """\
comma-separated sources: FILE or line:FILE (a text file, one document per line),
block:FILE (documents separated by blank lines), FILE.parquet / FILE.arrow or a directory of
them, hf:REPO[:CONFIG] (a Hugging Face dataset, streamed), or 'hf' for sahajBERT's mix
(Bengali Wikipedia 0.23 + FineWeb-2 ben_Beng 0.77)"""


def parse_data(text: str, mix: str | None = None) -> tuple[SourceSpec, ...]:
    """The sources a ``--data`` value names, weighted by ``--data-mix`` (comma-separated
    positive numbers, one per source; unset: equal shares, or sahajBERT's for ``hf``)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError("--data names no source")
    specs: list[SourceSpec] = []
    for item in items:
        if item == "hf":
            specs.extend(SAHAJBERT_SOURCES)
        elif item.startswith("hf:"):
            repo, _, name = item[3:].partition(":")
            specs.append(SourceSpec(SourceKind.HUB, repo, name or None))
        elif item.startswith(("line:", "block:")):
            layout, _, path = item.partition(":")
            specs.append(SourceSpec(SourceKind.TEXT, path, layout=DocumentLayout(layout)))
        else:
            specs.append(SourceSpec(_local_kind(Path(item)), item))
    if len(specs) > MAX_SOURCES:
        raise ValueError(f"at most {MAX_SOURCES} data sources")
    if mix is not None:
        try:
            weights = [float(w) for w in mix.split(",") if w.strip()]
        except ValueError:
            raise ValueError(f"--data-mix {mix!r}: comma-separated numbers expected") from None
        if len(weights) != len(specs):
            raise ValueError(
                f"--data-mix has {len(weights)} weights for {len(specs)} sources "
                f"({', '.join(s.describe() for s in specs)})"
            )
        specs = [
            SourceSpec(**{**s.to_dict(), "weight": w}) for s, w in zip(specs, weights, strict=True)
        ]
    return tuple(specs)


def _local_kind(path: Path) -> SourceKind:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return SourceKind.PARQUET
    if suffix == ".arrow":
        return SourceKind.ARROW
    if path.is_dir():
        if any(path.glob("*.parquet")):
            return SourceKind.PARQUET
        if any(path.glob("*.arrow")):
            return SourceKind.ARROW
        raise ValueError(f"{path}: a directory without .parquet or .arrow files")
    return SourceKind.TEXT


def check_local(specs: Iterable[SourceSpec]) -> None:
    """FileNotFoundError naming the first local source that is missing here."""
    for spec in specs:
        if spec.local and not Path(spec.path).exists():
            raise FileNotFoundError(f"no such data source: {spec.path}")


def stream_documents(
    specs: Iterable[SourceSpec], *, seed: int, shuffle_buffer: int = 1024
) -> Iterator[str]:
    """Documents forever, drawn from ``specs`` in proportion to their weights.

    ``seed`` (each peer passes its own) picks the mix's draws, each text file's start offsets
    and the datasets' shuffles, so peers read in different orders. Memory is bounded by the
    shuffle buffers, whatever the size of the data.
    """
    specs = tuple(specs)
    if not specs:
        raise ValueError("no data sources")
    rng = np.random.default_rng([seed, 0x50])
    streams = [
        _endless(s, seed=seed + 7919 * i, buffer=shuffle_buffer) for i, s in enumerate(specs)
    ]
    weights = np.array([s.weight for s in specs], dtype=np.float64)
    weights /= weights.sum()
    while True:
        yield next(streams[int(rng.choice(len(streams), p=weights))])


def sample_documents(specs: Iterable[SourceSpec], count: int, *, seed: int) -> list[str]:
    """Up to ``count`` documents, each source's share by weight, from one pass of each (for
    training a tokenizer: a small file is read once, not cycled up to ``count``)."""
    specs = tuple(specs)
    total = sum(s.weight for s in specs)
    out: list[str] = []
    for i, spec in enumerate(specs):
        share = math.ceil(count * spec.weight / total)
        out.extend(
            itertools.islice(_one_pass(spec, seed=seed + 7919 * i, epoch=0, buffer=1024), share)
        )
    return out


def _one_pass(spec: SourceSpec, *, seed: int, epoch: int, buffer: int) -> Iterator[str]:
    if spec.kind is SourceKind.TEXT:
        rng = np.random.default_rng([seed, epoch])
        return _shuffle_docs(_text_pass(spec, rng), buffer, rng)
    return _dataset_pass(spec, seed=seed, epoch=epoch, buffer=buffer)


def _endless(spec: SourceSpec, *, seed: int, buffer: int) -> Iterator[str]:
    """One source, pass after pass (each in a new order)."""
    passes = 0
    while True:
        produced = False
        for doc in _one_pass(spec, seed=seed, epoch=passes, buffer=buffer):
            produced = True
            yield doc
        if not produced:
            raise ValueError(f"data source {spec.describe()} holds no document")
        passes += 1


def _text_pass(spec: SourceSpec, rng: np.random.Generator) -> Iterator[str]:
    """Every document of a text file once: from the first document boundary after a random
    offset to the end, then from the start up to that boundary."""
    path = Path(spec.path)
    size = path.stat().st_size
    with path.open("rb") as f:
        boundary = _boundary_after(f, int(rng.integers(0, size)) if size else 0, spec.layout)
        f.seek(boundary)
        yield from _documents(_lines(f, None), spec.layout)
        f.seek(0)
        yield from _documents(_lines(f, boundary), spec.layout)


def _boundary_after(f: Any, offset: int, layout: DocumentLayout) -> int:
    """The first offset at or after ``offset`` where a document starts (or the end)."""
    if offset == 0:
        return 0
    f.seek(offset - 1)
    if f.read(1) != b"\n":
        f.readline()  # the rest of the line we landed in
    if layout is DocumentLayout.BLOCK:
        while True:  # a block starts after a blank line
            line = f.readline()
            if not line or not line.strip():
                break
    return f.tell()


def _lines(f: Any, stop: int | None) -> Iterator[str]:
    """Decoded lines from the file's position, up to offset ``stop`` (None: to the end)."""
    while stop is None or f.tell() < stop:
        raw = f.readline()
        if not raw:
            return
        yield raw.decode("utf-8", errors="replace")


def _documents(lines: Iterable[str], layout: DocumentLayout) -> Iterator[str]:
    block: list[str] = []
    for line in lines:
        line = line.strip()
        if layout is DocumentLayout.LINE:
            if line:
                yield line
        elif line:
            block.append(line)
        elif block:
            yield " ".join(block)
            block = []
    if block:
        yield " ".join(block)


def _shuffle_docs(docs: Iterator[str], size: int, rng: np.random.Generator) -> Iterator[str]:
    buffer: list[str] = []
    for doc in docs:
        if len(buffer) < size:
            buffer.append(doc)
            continue
        j = int(rng.integers(len(buffer)))
        buffer[j], doc = doc, buffer[j]
        yield doc
    for j in rng.permutation(len(buffer)):
        yield buffer[j]


def _dataset_pass(spec: SourceSpec, *, seed: int, epoch: int, buffer: int) -> Iterator[str]:
    datasets = _import_datasets()
    try:
        if spec.kind is SourceKind.HUB:
            ds = datasets.load_dataset(spec.path, spec.name, split=spec.split, streaming=True)
        else:
            path = Path(spec.path)
            files = (
                sorted(str(p) for p in path.glob(f"*.{spec.kind.value}"))
                if path.is_dir()
                else [str(path)]
            )
            ds = datasets.load_dataset(
                spec.kind.value, data_files={spec.split: files}, split=spec.split, streaming=True
            )
    except (OSError, ValueError) as err:  # includes connection and not-found errors
        raise SourceUnavailableError(
            f"cannot stream {spec.describe()}: {err} (offline? hub name changed?)"
        ) from err
    if spec.text_column not in (ds.column_names or [spec.text_column]):
        raise SourceUnavailableError(
            f"{spec.describe()} has no column {spec.text_column!r} (it has {ds.column_names})"
        )
    ds = ds.select_columns([spec.text_column]).shuffle(seed=seed, buffer_size=buffer)
    ds.set_epoch(epoch)  # another shard order and buffer draw each pass
    rows = iter(ds)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except OSError as err:  # the connection dropped mid-stream
            raise SourceUnavailableError(f"streaming {spec.describe()} stopped: {err}") from err
        text = row[spec.text_column]
        if isinstance(text, str) and text.strip():
            yield text.strip()


def _import_datasets():
    try:
        return importlib.import_module("datasets")
    except ImportError as err:
        raise SourceUnavailableError(
            "streaming Parquet/Arrow files or Hugging Face datasets needs the optional "
            "`datasets` package (pip install 'dedloc-jax[data]'); the hub also needs network "
            "access. Offline, use local text files or the synthetic corpus"
        ) from err


def stream_hf_documents(*, seed: int, shuffle_buffer: int = 10_000) -> Iterator[str]:
    """sahajBERT's mix from the hub (:data:`SAHAJBERT_SOURCES`), endless."""
    _import_datasets()
    return stream_documents(SAHAJBERT_SOURCES, seed=seed, shuffle_buffer=shuffle_buffer)
