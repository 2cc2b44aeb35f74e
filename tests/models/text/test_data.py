"""The pretraining pipeline: pairs, SOP, MLM masking statistics, determinism, cache, sources."""

import sys

import numpy as np
import pytest

from models.text.corpus import generate_documents, write_corpus
from models.text.data import (
    BATCH_KEYS,
    IGNORE_INDEX,
    PretrainingConfig,
    TokenizedCorpus,
    document_pairs,
    encode_pair,
    load_or_tokenize,
    mask_tokens,
    prepare_pretraining_data,
    pretraining_batches,
    split_sentences,
    tokenize_corpus,
    truncate_pair,
)
from models.text.sources import SourceUnavailableError, iter_local_documents, stream_hf_documents
from models.text.tokenizer import CLS_ID, MASK_ID, NUM_SPECIAL, PAD_ID, SEP_ID, train_tokenizer

SEQ = 64
BATCH = 16


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return generate_documents(300, seed=0)


@pytest.fixture(scope="module")
def tok(docs):
    return train_tokenizer(docs, 800)


@pytest.fixture(scope="module")
def corpus(docs, tok) -> TokenizedCorpus:
    return tokenize_corpus(docs, tok)


def take(it, n):
    return [next(it) for _ in range(n)]


def test_split_sentences_on_danda_variants_question_and_exclamation():
    text = "আমি যাই। তুমি যাও? কী সুন্দর!  সে যায়| তিনি যান\u09f7 শেষ"
    assert split_sentences(text) == [
        "আমি যাই।",
        "তুমি যাও?",
        "কী সুন্দর!",
        "সে যায়|",
        "তিনি যান\u09f7",
        "শেষ",
    ]
    assert split_sentences("সময় 10.30 টায়।") == ["সময় 10.30 টায়।"]


def test_tokenized_corpus_keeps_every_sentence(docs, tok, corpus):
    assert corpus.n_documents == len(docs)
    assert corpus.n_sentences == sum(len(split_sentences(d)) for d in docs)
    first = corpus.document(0)
    expected = [tok(s, add_special_tokens=False)["input_ids"] for s in split_sentences(docs[0])]
    assert [list(s) for s in first] == expected
    assert corpus.tokens.dtype == np.int32 and corpus.vocab_size == len(tok)


def test_batches_have_fixed_shapes_and_int32(corpus):
    for batch in take(pretraining_batches(corpus, batch_size=BATCH, seq_len=SEQ, seed=0), 10):
        assert tuple(batch) == BATCH_KEYS
        for key in BATCH_KEYS[:4]:
            assert batch[key].shape == (BATCH, SEQ) and batch[key].dtype == np.int32
        assert batch["sop_labels"].shape == (BATCH,) and batch["sop_labels"].dtype == np.int32


def test_segment_layout_cls_a_sep_b_sep(corpus):
    config = PretrainingConfig(seq_len=SEQ, mlm_probability=0.0)
    batch = next(pretraining_batches(corpus, batch_size=64, seed=1, config=config))
    for ids, types, mask in zip(
        batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], strict=True
    ):
        n = int(mask.sum())
        assert np.all(mask[:n] == 1) and np.all(mask[n:] == 0)
        assert ids[0] == CLS_ID and ids[n - 1] == SEP_ID
        seps = np.flatnonzero(ids == SEP_ID)
        assert len(seps) == 2 and seps[1] == n - 1
        assert seps[0] >= 2 and seps[1] - seps[0] >= 2, "both segments non-empty"
        assert np.all(types[: seps[0] + 1] == 0)
        assert np.all(types[seps[0] + 1 : n] == 1)
        assert np.all(types[n:] == 0) and np.all(ids[n:] == PAD_ID)
        assert np.all(ids[1:n][ids[1:n] != SEP_ID] >= NUM_SPECIAL)


def test_encode_pair_rejects_overlong_pairs():
    with pytest.raises(ValueError):
        encode_pair(np.arange(5, 10), np.arange(5, 10), 12)
    ids, types, mask = encode_pair(np.array([7, 8]), np.array([9]), 8)
    assert ids.tolist() == [CLS_ID, 7, 8, SEP_ID, 9, SEP_ID, PAD_ID, PAD_ID]
    assert types.tolist() == [0, 0, 0, 0, 1, 1, 0, 0]
    assert mask.tolist() == [1, 1, 1, 1, 1, 1, 0, 0]


def _contains_run(haystack: np.ndarray, needle: np.ndarray) -> bool:
    n = len(needle)
    return any(np.array_equal(haystack[i : i + n], needle) for i in range(len(haystack) - n + 1))


def test_sop_pairs_are_in_order_or_swapped_as_labelled(corpus):
    config = PretrainingConfig(seq_len=512, short_seq_probability=0.0)
    rng = np.random.default_rng(0)
    labels = []
    for d in range(100):
        doc = corpus.document(d)
        flat = np.concatenate(doc)
        for a, b, label in document_pairs(doc, config, rng):
            first, second = (b, a) if label == 1 else (a, b)
            assert _contains_run(flat, np.concatenate([first, second]))
            labels.append(label)
    assert len(labels) >= 80 and 0.3 < np.mean(labels) < 0.7


def test_long_documents_are_packed_into_several_pairs_that_fit(corpus):
    config = PretrainingConfig(seq_len=24)
    rng = np.random.default_rng(3)
    n_pairs = 0
    for d in range(50):
        for a, b, _ in document_pairs(corpus.document(d), config, rng):
            assert len(a) >= 1 and len(b) >= 1 and len(a) + len(b) <= 24 - 3
            n_pairs += 1
    assert n_pairs > 100  # several pairs per document


def test_sop_labels_are_balanced(corpus):
    it = pretraining_batches(corpus, batch_size=64, seq_len=SEQ, seed=5)
    labels = np.concatenate([b["sop_labels"] for b in take(it, 30)])
    assert set(np.unique(labels)) == {0, 1}
    assert abs(labels.mean() - 0.5) < 0.04  # 1920 draws: 3.5 sigma


def test_mask_tokens_statistics():
    rng = np.random.default_rng(0)
    vocab = 1000
    ids = rng.integers(0, vocab, size=(400, 512)).astype(np.int32)
    masked, labels = mask_tokens(ids, np.random.default_rng(1), vocab_size=vocab)
    eligible = ids >= NUM_SPECIAL
    selected = labels != IGNORE_INDEX
    assert not np.any(selected & ~eligible), "special tokens and padding are never selected"
    assert np.array_equal(masked[~eligible], ids[~eligible])
    assert np.array_equal(labels[selected], ids[selected])
    assert np.all(masked[~selected] == ids[~selected])
    rate = selected.sum() / eligible.sum()
    assert abs(rate - 0.15) < 0.003
    n = selected.sum()
    to_mask = (masked == MASK_ID) & selected
    kept = (masked == ids) & selected
    replaced = selected & ~to_mask & ~kept
    assert abs(to_mask.sum() / n - 0.8) < 0.01
    assert abs(kept.sum() / n - 0.1) < 0.01
    assert abs(replaced.sum() / n - 0.1) < 0.01
    assert masked[replaced].min() >= NUM_SPECIAL and masked[replaced].max() < vocab


def test_pipeline_masks_fifteen_percent_of_real_tokens_only(corpus):
    it = pretraining_batches(corpus, batch_size=32, seq_len=SEQ, seed=2)
    eligible = selected = 0
    for batch in take(it, 40):
        labels, mask = batch["mlm_labels"], batch["attention_mask"]
        sel = labels != IGNORE_INDEX
        originals = np.where(sel, labels, batch["input_ids"])
        is_real = (mask == 1) & (originals >= NUM_SPECIAL)
        assert not np.any(sel & ~is_real), "no [CLS], [SEP] or padding is ever a target"
        assert np.all(batch["input_ids"][mask == 0] == PAD_ID)
        eligible += is_real.sum()
        selected += sel.sum()
    assert abs(selected / eligible - 0.15) < 0.01


def test_deterministic_per_seed_and_different_per_peer(corpus):
    def first(seed, peer, n=4):
        it = pretraining_batches(corpus, batch_size=8, seq_len=SEQ, seed=seed, peer_seed=peer)
        return np.stack([b["input_ids"] for b in take(it, n)])

    assert np.array_equal(first(0, 0), first(0, 0))
    assert np.array_equal(first(0, 3), first(0, 3))
    assert not np.array_equal(first(0, 0), first(0, 1))
    assert not np.array_equal(first(0, 0), first(1, 0))


def test_raw_texts_give_the_same_stream_as_a_tokenized_corpus(docs, tok, corpus):
    a = pretraining_batches(docs[:40], tok, batch_size=4, seq_len=SEQ, seed=7)
    b = pretraining_batches(tokenize_corpus(docs[:40], tok), batch_size=4, seq_len=SEQ, seed=7)
    for x, y in zip(take(a, 3), take(b, 3), strict=True):
        for key in BATCH_KEYS:
            assert np.array_equal(x[key], y[key])


def test_iterator_loops_over_epochs_with_a_fresh_order(tok):
    small = tokenize_corpus(generate_documents(6, seed=1), tok)
    config = PretrainingConfig(seq_len=512, mlm_probability=0.0, short_seq_probability=0.0)
    it = pretraining_batches(small, batch_size=6, seed=0, config=config)
    epochs = take(it, 40)  # about one batch per epoch: far more examples than the corpus holds
    assert len(epochs) == 40
    orders = {b["input_ids"].tobytes() for b in epochs}
    assert len(orders) > 1


def test_single_sentence_documents_cannot_make_pairs(tok):
    one = tokenize_corpus(["শুধু একটি বাক্য।", "আরও একটি।"], tok)
    with pytest.raises(ValueError, match="two sentences"):
        pretraining_batches(one, batch_size=2, seq_len=SEQ, seed=0)


def test_config_validation():
    with pytest.raises(ValueError):
        PretrainingConfig(seq_len=4)
    with pytest.raises(ValueError):
        PretrainingConfig(mask_fraction=0.9, random_fraction=0.2)
    assert PretrainingConfig.sahajbert().seq_len == 512


def test_cache_round_trip_and_staleness(tmp_path, docs, tok, corpus, caplog):
    path = tmp_path / "corpus.npz"
    built = load_or_tokenize(path, docs, tok)
    assert path.is_file()
    loaded = TokenizedCorpus.load(path)
    for field in ("tokens", "sentence_offsets", "document_offsets"):
        assert np.array_equal(getattr(loaded, field), getattr(corpus, field))
    assert loaded.vocab_size == corpus.vocab_size
    assert load_or_tokenize(path, docs, tok).texts_fingerprint == built.texts_fingerprint
    # Other texts: the cache is stale and is rebuilt.
    other = load_or_tokenize(path, docs[:10], tok)
    assert other.n_documents == 10
    assert TokenizedCorpus.load(path).n_documents == 10
    # A corrupt file is ignored with a warning and rebuilt.
    path.write_bytes(b"not an npz")
    assert load_or_tokenize(path, docs[:5], tok).n_documents == 5


def test_corrupt_offsets_are_rejected(corpus):
    bad = TokenizedCorpus(
        tokens=corpus.tokens,
        sentence_offsets=corpus.sentence_offsets[:-1],
        document_offsets=corpus.document_offsets,
        vocab_size=corpus.vocab_size,
    )
    with pytest.raises(ValueError):
        bad.validate()


def test_local_sources_line_and_block_layouts(tmp_path):
    lines = write_corpus(tmp_path / "a.txt", 5, seed=1)
    blocks = tmp_path / "b.txt"
    blocks.write_text("প্রথম লাইন।\nদ্বিতীয় লাইন।\n\n\nআরেকটি নথি।\n", encoding="utf-8")
    assert list(iter_local_documents(lines)) == generate_documents(5, seed=1)
    assert list(iter_local_documents([blocks], layout="block")) == [
        "প্রথম লাইন। দ্বিতীয় লাইন।",
        "আরেকটি নথি।",
    ]
    assert len(list(iter_local_documents(blocks))) == 3
    with pytest.raises(FileNotFoundError):
        list(iter_local_documents(tmp_path / "missing.txt"))


def test_hf_source_without_datasets_fails_with_a_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(SourceUnavailableError, match="datasets"):
        next(stream_hf_documents(seed=0))


def test_prepare_trains_once_then_reuses_tokenizer_and_cache(tmp_path):
    texts = generate_documents(60, seed=8)
    tok, corpus = prepare_pretraining_data(tmp_path, texts, vocab_size=300)
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()
    assert (tmp_path / "corpus.npz").is_file()
    tok2, corpus2 = prepare_pretraining_data(tmp_path, texts, vocab_size=300)
    assert tok2.get_vocab() == tok.get_vocab()  # loaded, not retrained
    assert np.array_equal(corpus2.tokens, corpus.tokens)
    with pytest.raises(ValueError, match="retrain"):
        prepare_pretraining_data(tmp_path, texts, vocab_size=100)


def _greedy_lengths(la: int, lb: int, max_tokens: int) -> tuple[int, int]:
    while la + lb > max_tokens:
        if la >= lb:
            la -= 1
        else:
            lb -= 1
    return la, lb


@pytest.mark.parametrize(
    ("la", "lb", "max_tokens"),
    [(10, 3, 20), (10, 3, 9), (3, 10, 9), (50, 40, 61), (40, 50, 61), (7, 7, 10), (9, 9, 9)],
)
def test_truncate_pair_trims_the_longer_segment_into_contiguous_runs(la, lb, max_tokens):
    a, b = np.arange(100, 100 + la), np.arange(500, 500 + lb)
    rng = np.random.default_rng(0)
    fronts = set()
    for _ in range(30):
        ta, tb = truncate_pair(a, b, max_tokens, rng)
        assert (len(ta), len(tb)) == _greedy_lengths(la, lb, max_tokens)
        for kept, full in ((ta, a), (tb, b)):
            if len(kept):
                assert np.array_equal(kept, np.arange(kept[0], kept[0] + len(kept)))
                assert full[0] <= kept[0] and kept[-1] <= full[-1]
        fronts.add((int(ta[0]), int(tb[0])))
    if la + lb > max_tokens:
        assert len(fronts) > 1, "tokens are dropped from the front as well as the back"
