"""Text for pretraining: the sahajBERT tokenizer, the SOP/MLM batch pipeline, where documents
come from (files, HF streams), and the synthetic Bengali corpus used by tests and the demo.

Kept apart from the model code (``models.albert``): nothing here imports JAX.
"""

from models.text.corpus import generate_documents, write_corpus
from models.text.data import (
    PretrainingConfig,
    TokenizedCorpus,
    load_or_tokenize,
    prepare_pretraining_data,
    pretraining_batches,
    streaming_batches,
)
from models.text.sources import (
    SourceSpec,
    SourceUnavailableError,
    parse_data,
    sample_documents,
    stream_documents,
)
from models.text.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

__all__ = [
    "PretrainingConfig",
    "SourceSpec",
    "SourceUnavailableError",
    "TokenizedCorpus",
    "generate_documents",
    "load_or_tokenize",
    "load_tokenizer",
    "parse_data",
    "prepare_pretraining_data",
    "pretraining_batches",
    "sample_documents",
    "save_tokenizer",
    "stream_documents",
    "streaming_batches",
    "train_tokenizer",
    "write_corpus",
]
