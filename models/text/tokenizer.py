"""sahajBERT's tokenizer: a Unigram model trained with HF ``tokenizers``, built the same way.

The pipeline (normaliser, pre-tokeniser, decoder, post-processor and special-token ids) follows
the published sahajBERT tokenizer; only the training text differs (here: whatever the caller
passes, by default the synthetic corpus of :mod:`models.text.corpus`). The result is saved as a
transformers fast tokenizer so ``AutoTokenizer.from_pretrained(out_dir)`` loads it.

The visarga rule uses a regex look-behind, ``(?<=[\\u0980-\\u09ff]):``. The ``tokenizers`` Regex
is Oniguruma, which supports fixed-width look-behind, so the rule is written exactly as in
sahajBERT (checked in tests).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers.models import Unigram

if TYPE_CHECKING:  # transformers is heavy to import; only the functions that need it import it
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

PAD, UNK, CLS, SEP, MASK = "<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, CLS, SEP, MASK)  # ids 0..4 in this order
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(5)
NUM_SPECIAL = len(SPECIAL_TOKENS)
MODEL_MAX_LENGTH = 512
METASPACE = "▁"


def build_normalizer() -> normalizers.Normalizer:
    """Nmt, NFKC, collapse spaces, Bengali danda fixes, ':' -> visarga, lowercase."""
    return normalizers.Sequence(
        [
            normalizers.Nmt(),
            normalizers.NFKC(),
            normalizers.Replace(Regex(" {2,}"), " "),
            normalizers.Replace("\u09e4", "\u0964"),  # reserved "danda" -> DEVANAGARI DANDA
            normalizers.Replace("\u09e5", "\u0965"),  # reserved "double danda" -> double danda
            normalizers.Replace("|", "\u0964"),  # ASCII bar typed as a danda
            normalizers.Replace("\u09f7", "\u0964"),  # currency numerator four, a look-alike
            normalizers.Replace(Regex(r"(?<=[\u0980-\u09ff]):"), "\u0983"),  # ':' -> visarga
            normalizers.Lowercase(),
        ]
    )


def build_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Metaspace (always prepend), then single digits, then punctuation as separate pieces."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(),
        ]
    )


def build_post_processor() -> processors.TemplateProcessing:
    """``[CLS] A [SEP]`` and ``[CLS] A [SEP] B [SEP]`` with B (and its [SEP]) of type id 1."""
    return processors.TemplateProcessing(
        single=f"{CLS}:0 $A:0 {SEP}:0",
        pair=f"{CLS}:0 $A:0 {SEP}:0 $B:1 {SEP}:1",
        special_tokens=[(CLS, CLS_ID), (SEP, SEP_ID)],
    )


def build_untrained_tokenizer() -> Tokenizer:
    """The full sahajBERT pipeline around an empty Unigram model (train it next)."""
    tok = Tokenizer(Unigram())
    tok.normalizer = build_normalizer()
    tok.pre_tokenizer = build_pre_tokenizer()
    tok.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="always")
    return tok


def _iter_texts(texts_or_files: Iterable[str | Path]) -> Iterator[str]:
    for item in texts_or_files:
        if isinstance(item, Path):
            with item.open(encoding="utf-8") as f:
                yield from (line.strip() for line in f if line.strip())
        else:
            yield item


def wrap_fast(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap a trained ``tokenizers.Tokenizer`` as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=MODEL_MAX_LENGTH,
        pad_token=PAD,
        unk_token=UNK,
        cls_token=CLS,
        sep_token=SEP,
        mask_token=MASK,
        padding_side="right",
        # transformers 5 defaults to ids and mask only; ALBERT needs the segment ids too.
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def train_tokenizer(
    texts_or_files: Iterable[str | Path] | str | Path,
    vocab_size: int,
    out_dir: str | Path | None = None,
    *,
    max_piece_length: int = 16,
    show_progress: bool = False,
) -> PreTrainedTokenizerFast:
    """Train the sahajBERT tokenizer on texts (``str``) or text files (``Path``).

    ``vocab_size`` counts the 5 special tokens (sahajBERT: 31,995 pieces + 5 = 32,000). A small
    corpus can yield fewer pieces than asked: HF's trainer seeds pieces from substrings shared by
    distinct words, so a corpus with a small lexicon caps the vocabulary. When ``out_dir`` is
    given the tokenizer is saved there in transformers format.

    Training twice on the same text gives the same pieces but not always the same ids (the
    trainer iterates Rust hash maps), so peers of one collaboration must share the saved
    tokenizer files rather than each train their own.
    """
    if vocab_size <= NUM_SPECIAL:
        raise ValueError(f"vocab_size must exceed the {NUM_SPECIAL} special tokens")
    if isinstance(texts_or_files, str | Path):
        texts_or_files = [Path(texts_or_files)]
    tok = build_untrained_tokenizer()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        unk_token=UNK,
        max_piece_length=max_piece_length,
        show_progress=show_progress,
    )
    tok.train_from_iterator(_iter_texts(texts_or_files), trainer=trainer)
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != i:
            raise RuntimeError(f"trainer put {special} at {tok.token_to_id(special)}, not {i}")
    tok.post_processor = build_post_processor()
    fast = wrap_fast(tok)
    logger.info("trained a Unigram tokenizer with %d pieces", tok.get_vocab_size())
    if out_dir is not None:
        save_tokenizer(fast, out_dir)
    return fast


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    """Save in transformers format (``tokenizer.json`` + ``tokenizer_config.json``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by :func:`train_tokenizer` (local directory only, no hub)."""
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {directory}")
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.convert_tokens_to_ids(special) != i:
            raise ValueError(f"{directory}: {special} is not id {i}; not a sahajBERT tokenizer")
    return tok


def normalize(tokenizer: PreTrainedTokenizerFast | Tokenizer, text: str) -> str:
    """Apply the tokenizer's normaliser alone (what decode(encode(text)) should give back)."""
    backend = tokenizer if isinstance(tokenizer, Tokenizer) else tokenizer.backend_tokenizer
    return backend.normalizer.normalize_str(text)


def encode_batch(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str]) -> list[list[int]]:
    """Ids without special tokens for each text (the data pipeline adds [CLS]/[SEP] itself)."""
    encodings = tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [e.ids for e in encodings]
