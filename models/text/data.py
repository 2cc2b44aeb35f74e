"""The sahajBERT pretraining pipeline: sentence pairs for SOP, 15% MLM masking, numpy batches.

Documents are split into sentences, each sentence tokenized once (the result can be cached to an
``.npz``). Each epoch shuffles the documents, packs consecutive sentences of a document up to the
target length (``seq_len`` minus 3 for ``[CLS] A [SEP] B [SEP]``), cuts the pack at a random
sentence boundary into segments A and B, and swaps them with probability 0.5 (SOP label 1 =
swapped, 0 = in order), as ALBERT and sahajBERT did. Examples then pass through a shuffle buffer
and are batched into fixed shapes (``seq_len`` padded with id 0), and MLM masking is drawn per
batch (dynamic masking): 15% of the non-special tokens are selected; of those 80% become
``[MASK]``, 10% a random non-special token and 10% stay as they were.

Everything is drawn from ``np.random.default_rng([seed, peer_seed])``: a run is reproducible and
each peer of a collaboration (its own ``peer_seed``) walks the data in its own order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.text.tokenizer import (
    CLS_ID,
    MASK_ID,
    NUM_SPECIAL,
    PAD_ID,
    SEP_ID,
    encode_batch,
    load_tokenizer,
    train_tokenizer,
)

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
NO_PAIR_LIMIT = 10_000  # documents a stream may yield without a single pair
BATCH_KEYS: tuple[str, ...] = (
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "mlm_labels",
    "sop_labels",
)

# A sentence ends at a danda (or a look-alike the normaliser maps to one), '?' or '!', followed by
# white space. '.' is not a terminator: Bengali prose uses the danda, and '.' occurs in numbers.
_SENTENCE_BREAK = re.compile(r"(?<=[\u0964\u0965?!|\u09e4\u09e5\u09f7])\s+")


def split_sentences(text: str) -> list[str]:
    """Split a document into sentences (terminators stay with their sentence)."""
    return [s.strip() for s in _SENTENCE_BREAK.split(text) if s.strip()]


# ----------------------------------------------------------------------------------------------
# Tokenized corpus (and its on-disk cache)
# ----------------------------------------------------------------------------------------------


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the full tokenizer definition, to refuse a cache built with another one."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:32]


def texts_fingerprint(texts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for text in texts:
        h.update(text.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class TokenizedCorpus:
    """Sentence-tokenized documents in three flat arrays (CSR layout).

    Sentence ``s`` is ``tokens[sentence_offsets[s]:sentence_offsets[s + 1]]``; document ``d`` is
    sentences ``document_offsets[d]`` to ``document_offsets[d + 1]``.
    """

    tokens: np.ndarray  # int32 [n_tokens]
    sentence_offsets: np.ndarray  # int64 [n_sentences + 1]
    document_offsets: np.ndarray  # int64 [n_documents + 1]
    vocab_size: int
    tokenizer_fingerprint: str = ""
    texts_fingerprint: str = ""

    @property
    def n_documents(self) -> int:
        return len(self.document_offsets) - 1

    @property
    def n_sentences(self) -> int:
        return len(self.sentence_offsets) - 1

    def document(self, d: int) -> list[np.ndarray]:
        """The sentences of document ``d`` as views into ``tokens``."""
        lo, hi = int(self.document_offsets[d]), int(self.document_offsets[d + 1])
        offs = self.sentence_offsets
        return [self.tokens[offs[s] : offs[s + 1]] for s in range(lo, hi)]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed: peers sharing a work directory build the same cache at once.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with tmp.open("wb") as f:  # a file object keeps numpy from appending ".npz"
            np.savez(
                f,
                tokens=self.tokens,
                sentence_offsets=self.sentence_offsets,
                document_offsets=self.document_offsets,
                vocab_size=np.int64(self.vocab_size),
                tokenizer_fingerprint=np.str_(self.tokenizer_fingerprint),
                texts_fingerprint=np.str_(self.texts_fingerprint),
            )
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> TokenizedCorpus:
        with np.load(Path(path), allow_pickle=False) as z:
            corpus = cls(
                tokens=z["tokens"].astype(np.int32, copy=False),
                sentence_offsets=z["sentence_offsets"].astype(np.int64, copy=False),
                document_offsets=z["document_offsets"].astype(np.int64, copy=False),
                vocab_size=int(z["vocab_size"]),
                tokenizer_fingerprint=str(z["tokenizer_fingerprint"]),
                texts_fingerprint=str(z["texts_fingerprint"]),
            )
        corpus.validate()
        return corpus

    def validate(self) -> None:
        """Reject a corrupt or inconsistent corpus with a clear error."""
        so, do = self.sentence_offsets, self.document_offsets
        if so.ndim != 1 or do.ndim != 1 or len(so) < 1 or len(do) < 1:
            raise ValueError("offset arrays must be 1-D and non-empty")
        if so[0] != 0 or so[-1] != len(self.tokens) or np.any(np.diff(so) < 0):
            raise ValueError("sentence offsets do not index the token array")
        if do[0] != 0 or do[-1] != self.n_sentences or np.any(np.diff(do) < 0):
            raise ValueError("document offsets do not index the sentences")
        if len(self.tokens) and (self.tokens.min() < 0 or self.tokens.max() >= self.vocab_size):
            raise ValueError("token ids outside the vocabulary")


def tokenize_corpus(
    texts: Iterable[str], tokenizer, *, chunk_documents: int = 1000
) -> TokenizedCorpus:
    """Split each document into sentences and tokenize them (no special tokens)."""
    tokens: list[np.ndarray] = []
    sentence_lengths: list[int] = []
    doc_counts: list[int] = []
    hasher = hashlib.sha256()

    def flush(docs: list[list[str]]) -> None:
        flat = [s for doc in docs for s in doc]
        ids = encode_batch(tokenizer, flat) if flat else []
        k = 0
        for doc in docs:
            kept = 0
            for sentence_ids in ids[k : k + len(doc)]:
                if sentence_ids:
                    tokens.append(np.asarray(sentence_ids, dtype=np.int32))
                    sentence_lengths.append(len(sentence_ids))
                    kept += 1
            k += len(doc)
            if kept:
                doc_counts.append(kept)

    pending: list[list[str]] = []
    for text in texts:
        hasher.update(text.encode())
        hasher.update(b"\0")
        pending.append(split_sentences(text))
        if len(pending) >= chunk_documents:
            flush(pending)
            pending = []
    flush(pending)

    corpus = TokenizedCorpus(
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
        sentence_offsets=np.concatenate([[0], np.cumsum(sentence_lengths, dtype=np.int64)]),
        document_offsets=np.concatenate([[0], np.cumsum(doc_counts, dtype=np.int64)]),
        vocab_size=len(tokenizer),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        texts_fingerprint=hasher.hexdigest()[:32],
    )
    corpus.validate()
    logger.info(
        "tokenized %d documents, %d sentences, %d tokens",
        corpus.n_documents,
        corpus.n_sentences,
        len(corpus.tokens),
    )
    return corpus


def load_or_tokenize(path: str | Path, texts: Sequence[str], tokenizer) -> TokenizedCorpus:
    """Load the cached corpus at ``path`` if it was built from these texts with this tokenizer,
    else tokenize and (re)write the cache."""
    path = Path(path)
    if path.is_file():
        try:
            cached = TokenizedCorpus.load(path)
        except (OSError, ValueError, KeyError) as err:
            logger.warning("ignoring unreadable corpus cache %s: %s", path, err)
        else:
            if cached.tokenizer_fingerprint == tokenizer_fingerprint(
                tokenizer
            ) and cached.texts_fingerprint == texts_fingerprint(texts):
                logger.info("loaded tokenized corpus from %s", path)
                return cached
            logger.info("corpus cache %s is stale; re-tokenizing", path)
    corpus = tokenize_corpus(texts, tokenizer)
    corpus.save(path)
    return corpus


def prepare_pretraining_data(work_dir: str | Path, texts: Sequence[str], *, vocab_size: int):
    """Tokenizer and tokenized corpus for ``texts``, built once and reused from ``work_dir``.

    The tokenizer is trained only if ``work_dir/tokenizer`` holds none (training is not
    bit-reproducible, so reusing the saved one keeps ids stable across runs and peers); the
    tokenized corpus is cached in ``work_dir/corpus.npz`` and rebuilt when texts or tokenizer
    change. Returns ``(tokenizer, corpus)``.
    """
    work_dir = Path(work_dir)
    tok_dir = work_dir / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(tok_dir)
        if len(tokenizer) > vocab_size:
            raise ValueError(
                f"{tok_dir} holds a tokenizer of {len(tokenizer)} pieces, more than "
                f"vocab_size={vocab_size}; remove it to retrain"
            )
    else:
        tokenizer = train_tokenizer(texts, vocab_size, tok_dir)
    return tokenizer, load_or_tokenize(work_dir / "corpus.npz", texts, tokenizer)


# ----------------------------------------------------------------------------------------------
# Sentence-order pairs
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PretrainingConfig:
    """Knobs of example creation and masking (defaults: sahajBERT's)."""

    seq_len: int = 512
    mlm_probability: float = 0.15
    mask_fraction: float = 0.8  # of the selected tokens, replaced by [MASK]
    random_fraction: float = 0.1  # of the selected tokens, replaced by a random token
    swap_probability: float = 0.5  # SOP: chance to present B before A
    short_seq_probability: float = 0.1  # ALBERT: sometimes aim for a shorter pack
    shuffle_buffer: int = 1024

    def __post_init__(self) -> None:
        if self.seq_len < 5:
            raise ValueError("seq_len must leave room for [CLS] A [SEP] B [SEP]")
        if not 0.0 <= self.mlm_probability <= 1.0:
            raise ValueError("mlm_probability must be in [0, 1]")
        if self.mask_fraction < 0 or self.random_fraction < 0:
            raise ValueError("mask/random fractions must be non-negative")
        if self.mask_fraction + self.random_fraction > 1.0:
            raise ValueError("mask_fraction + random_fraction must be <= 1")
        if self.shuffle_buffer < 1:
            raise ValueError("shuffle_buffer must be >= 1")

    @classmethod
    def sahajbert(cls) -> PretrainingConfig:
        return cls()

    @classmethod
    def tiny(cls) -> PretrainingConfig:
        return cls(seq_len=64, shuffle_buffer=64)


def truncate_pair(
    a: np.ndarray, b: np.ndarray, max_tokens: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Trim the longer segment, one token at a time from its front or back at random, until
    both fit in ``max_tokens`` (ALBERT's rule), computed in closed form."""
    la, lb = len(a), len(b)
    excess = la + lb - max_tokens
    if excess <= 0:
        return a, b
    if abs(la - lb) >= excess:  # only the longer one is trimmed
        new_a, new_b = (la - excess, lb) if la >= lb else (la, lb - excess)
    else:  # trimmed to balance, then alternately (ties trim A first)
        new_a = max_tokens // 2
        new_b = max_tokens - new_a
    front_a = int(rng.binomial(la - new_a, 0.5))
    front_b = int(rng.binomial(lb - new_b, 0.5))
    return a[front_a : front_a + new_a], b[front_b : front_b + new_b]


def document_pairs(
    sentences: Sequence[np.ndarray], config: PretrainingConfig, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Yield (segment A, segment B, SOP label) packs from one tokenized document.

    A pack that holds a single sentence cannot be cut at a sentence boundary and is dropped,
    as in ALBERT's reference code.
    """
    max_tokens = config.seq_len - 3

    def pick_target() -> int:
        if rng.random() < config.short_seq_probability:
            return int(rng.integers(2, max_tokens + 1))
        return max_tokens

    target = pick_target()
    chunk: list[np.ndarray] = []
    length = 0
    for i, sentence in enumerate(sentences):
        chunk.append(sentence)
        length += len(sentence)
        if length < target and i < len(sentences) - 1:
            continue
        if len(chunk) >= 2:
            cut = int(rng.integers(1, len(chunk)))
            a = np.concatenate(chunk[:cut])
            b = np.concatenate(chunk[cut:])
            a, b = truncate_pair(a, b, max_tokens, rng)
            if len(a) and len(b):
                if rng.random() < config.swap_probability:
                    yield b, a, 1
                else:
                    yield a, b, 0
        chunk, length = [], 0
        target = pick_target()


def encode_pair(a: np.ndarray, b: np.ndarray, seq_len: int) -> tuple[np.ndarray, ...]:
    """``[CLS] A [SEP] B [SEP]`` padded to ``seq_len``: (input_ids, token_type_ids, mask)."""
    n = len(a) + len(b) + 3
    if n > seq_len:
        raise ValueError(f"pair of {n} tokens exceeds seq_len {seq_len}")
    input_ids = np.full(seq_len, PAD_ID, dtype=np.int32)
    token_type_ids = np.zeros(seq_len, dtype=np.int32)
    attention_mask = np.zeros(seq_len, dtype=np.int32)
    input_ids[0] = CLS_ID
    input_ids[1 : 1 + len(a)] = a
    input_ids[1 + len(a)] = SEP_ID
    b_start = 2 + len(a)
    input_ids[b_start : b_start + len(b)] = b
    input_ids[b_start + len(b)] = SEP_ID
    token_type_ids[b_start:n] = 1
    attention_mask[:n] = 1
    return input_ids, token_type_ids, attention_mask


# ----------------------------------------------------------------------------------------------
# Masking
# ----------------------------------------------------------------------------------------------


def mask_tokens(
    input_ids: np.ndarray,
    rng: np.random.Generator,
    *,
    vocab_size: int,
    mlm_probability: float = 0.15,
    mask_fraction: float = 0.8,
    random_fraction: float = 0.1,
    mask_id: int = MASK_ID,
    num_special: int = NUM_SPECIAL,
) -> tuple[np.ndarray, np.ndarray]:
    """BERT masking: returns (masked input ids, labels with -100 where nothing is predicted).

    Ids below ``num_special`` (pad, unk, [CLS], [SEP], [MASK]) are never selected; random
    replacements are drawn from the non-special ids ``[num_special, vocab_size)``.
    """
    if vocab_size <= num_special:
        raise ValueError("vocab_size must exceed the number of special tokens")
    eligible = input_ids >= num_special
    selected = eligible & (rng.random(input_ids.shape) < mlm_probability)
    labels = np.where(selected, input_ids, IGNORE_INDEX).astype(np.int32)
    action = rng.random(input_ids.shape)
    to_mask = selected & (action < mask_fraction)
    to_random = selected & (action >= mask_fraction) & (action < mask_fraction + random_fraction)
    masked = input_ids.astype(np.int32, copy=True)
    masked[to_mask] = mask_id
    masked[to_random] = rng.integers(num_special, vocab_size, size=int(to_random.sum()))
    return masked, labels


# ----------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------


def _shuffled(
    items: Iterator[tuple[np.ndarray, np.ndarray, int]], size: int, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """A shuffle buffer: bounded memory, works on streams."""
    buffer: list = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        j = int(rng.integers(len(buffer)))
        yield buffer[j]
        buffer[j] = item
    for j in rng.permutation(len(buffer)):
        yield buffer[j]


def _epoch_pairs(
    corpus: TokenizedCorpus, config: PretrainingConfig, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    for d in rng.permutation(corpus.n_documents):
        yield from document_pairs(corpus.document(int(d)), config, rng)


def pretraining_batches(
    texts: Sequence[str] | TokenizedCorpus,
    tokenizer=None,
    *,
    batch_size: int,
    seq_len: int | None = None,
    seed: int,
    peer_seed: int = 0,
    config: PretrainingConfig | None = None,
    vocab_size: int | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Endless numpy batches for ALBERT pretraining (MLM + SOP), reshuffled every epoch.

    Each batch is a dict of int32 arrays: ``input_ids``, ``attention_mask``, ``token_type_ids``,
    ``mlm_labels`` of shape ``[batch_size, seq_len]`` and ``sop_labels`` of shape
    ``[batch_size]``. ``texts`` may be raw documents (tokenized here, needs ``tokenizer``) or a
    :class:`TokenizedCorpus`. The stream depends only on (data, seed, peer_seed, config).
    """
    config = config or PretrainingConfig()
    if seq_len is not None and seq_len != config.seq_len:
        config = dataclasses.replace(config, seq_len=seq_len)
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if isinstance(texts, TokenizedCorpus):
        corpus = texts
    else:
        if tokenizer is None:
            raise ValueError("raw texts need a tokenizer")
        corpus = tokenize_corpus(texts, tokenizer)
    if not np.any(np.diff(corpus.document_offsets) >= 2):
        raise ValueError("no document has two sentences, so no sentence-order pair can be built")
    vocab_size = vocab_size or corpus.vocab_size
    rng = np.random.default_rng([seed, peer_seed])
    return _batches(corpus, config, batch_size, vocab_size, rng)


def _pair_stream(
    corpus: TokenizedCorpus, config: PretrainingConfig, rng: np.random.Generator
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Pairs forever: one shuffled pass over the documents per epoch."""
    while True:
        produced = False
        for pair in _shuffled(_epoch_pairs(corpus, config, rng), config.shuffle_buffer, rng):
            produced = True
            yield pair
        if not produced:
            raise ValueError("the corpus yielded no sentence pairs in a whole epoch")


def streaming_batches(
    documents: Iterator[str],
    tokenizer,
    *,
    batch_size: int,
    seed: int,
    peer_seed: int = 0,
    config: PretrainingConfig | None = None,
    vocab_size: int | None = None,
    chunk_documents: int = 64,
) -> Iterator[dict[str, np.ndarray]]:
    """:func:`pretraining_batches` for a stream of raw documents, tokenized on the fly.

    Documents are read ``chunk_documents`` at a time, split into sentences and tokenized, and
    their pairs pass through the shuffle buffer: memory holds one chunk and one buffer, never
    the corpus.
    """
    config = config or PretrainingConfig()
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    vocab_size = vocab_size or len(tokenizer)
    rng = np.random.default_rng([seed, peer_seed])
    pairs = _shuffled(_stream_pairs(documents, tokenizer, config, rng, chunk_documents),
                      config.shuffle_buffer, rng)  # fmt: skip
    return _batches_of(pairs, config, batch_size, vocab_size, rng)


def _stream_pairs(
    documents: Iterator[str],
    tokenizer,
    config: PretrainingConfig,
    rng: np.random.Generator,
    chunk_documents: int,
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    seen = read = 0
    while True:
        docs = [split_sentences(d) for d in itertools.islice(documents, chunk_documents)]
        read += len(docs)
        if not docs:
            return
        flat = [s for doc in docs for s in doc]
        ids = encode_batch(tokenizer, flat) if flat else []
        k = 0
        for doc in docs:
            sentences = [np.asarray(t, np.int32) for t in ids[k : k + len(doc)] if t]
            k += len(doc)
            for pair in document_pairs(sentences, config, rng):
                seen += 1
                yield pair
        # an endless stream of one-sentence documents would otherwise never yield a batch
        if not seen and (len(docs) < chunk_documents or read >= NO_PAIR_LIMIT):
            raise ValueError(
                f"no sentence-order pair in the first {read} documents: does any have two "
                "sentences (ended by a danda, '?' or '!')?"
            )


def _batches(
    corpus: TokenizedCorpus,
    config: PretrainingConfig,
    batch_size: int,
    vocab_size: int,
    rng: np.random.Generator,
) -> Iterator[dict[str, np.ndarray]]:
    return _batches_of(_pair_stream(corpus, config, rng), config, batch_size, vocab_size, rng)


def _batches_of(
    pairs: Iterator[tuple[np.ndarray, np.ndarray, int]],
    config: PretrainingConfig,
    batch_size: int,
    vocab_size: int,
    rng: np.random.Generator,
) -> Iterator[dict[str, np.ndarray]]:
    shape = (batch_size, config.seq_len)
    while True:
        input_ids = np.empty(shape, np.int32)
        token_type_ids = np.empty(shape, np.int32)
        attention_mask = np.empty(shape, np.int32)
        sop_labels = np.empty(batch_size, np.int32)
        for row in range(batch_size):
            a, b, label = next(pairs)
            input_ids[row], token_type_ids[row], attention_mask[row] = encode_pair(
                a, b, config.seq_len
            )
            sop_labels[row] = label
        yield _finish(
            input_ids, attention_mask, token_type_ids, sop_labels, config, vocab_size, rng
        )


def _finish(input_ids, attention_mask, token_type_ids, sop_labels, config, vocab_size, rng):
    masked, labels = mask_tokens(
        input_ids,
        rng,
        vocab_size=vocab_size,
        mlm_probability=config.mlm_probability,
        mask_fraction=config.mask_fraction,
        random_fraction=config.random_fraction,
    )
    return {
        "input_ids": masked,
        "attention_mask": attention_mask,
        "token_type_ids": token_type_ids,
        "mlm_labels": labels,
        "sop_labels": sop_labels,
    }
