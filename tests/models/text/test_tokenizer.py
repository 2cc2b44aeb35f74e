"""sahajBERT's tokenizer pipeline: specials, Bengali normalisation, round trips, save/load."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from models.text.corpus import generate_documents, write_corpus
from models.text.tokenizer import (
    MODEL_MAX_LENGTH,
    SPECIAL_TOKENS,
    build_normalizer,
    encode_batch,
    load_tokenizer,
    normalize,
    train_tokenizer,
)

VOCAB = 1000


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[PreTrainedTokenizerFast, Path]:
    out = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer(generate_documents(500, seed=0), VOCAB, out)
    return tok, out


@pytest.fixture(scope="module")
def tok(saved) -> PreTrainedTokenizerFast:
    return saved[0]


def test_special_token_ids(tok):
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (tok.pad_token_id, tok.unk_token_id, tok.cls_token_id) == (0, 1, 2)
    assert (tok.sep_token_id, tok.mask_token_id) == (3, 4)
    assert tok.model_max_length == MODEL_MAX_LENGTH
    assert 100 < len(tok) <= VOCAB


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("বাড়ি|", "বাড়ি।"),  # ASCII bar as danda
        ("বাড়ি\u09e4", "বাড়ি।"),  # reserved code point used as danda
        ("বাড়ি\u09f7", "বাড়ি।"),  # currency numerator four as danda
        ("বাড়ি\u09e5", "বাড়ি\u0965"),  # double danda
        ("দু:খ", "দুঃখ"),  # ':' after a Bengali letter is a visarga
        ("ড: সেন", "ডঃ সেন"),
        ("time 10:30", "time 10:30"),  # ':' after anything else stays
        ("ক  খ   গ", "ক খ গ"),  # runs of spaces collapse
        ("FaceBook COVID", "facebook covid"),
        ("\uff21\ufb01", "afi"),  # NFKC folds compatibility forms, then lowercase
        ("\u09df", "\u09af\u09bc"),  # precomposed য় decomposes (NFKC composition exclusion)
        ("a\x07b", "ab"),  # Nmt drops control characters
        ("a\u200bb", "a b"),  # and maps zero-width spaces to a space
    ],
)
def test_normaliser_handles_bengali_specifics(raw, expected):
    assert build_normalizer().normalize_str(raw) == expected


def test_visarga_lookbehind_is_supported_by_the_regex_engine(tok):
    # The rule only fires after a Bengali letter: a naive replacement would change both colons.
    assert normalize(tok, "ক:a:") == "কঃa:"


def test_latin_case_does_not_change_ids(tok):
    assert tok("COVID Facebook")["input_ids"] == tok("covid facebook")["input_ids"]


def test_digits_are_single_tokens(tok):
    pieces = tok.convert_ids_to_tokens(tok("২০২১ 1999", add_special_tokens=False)["input_ids"])
    digits = [p.lstrip("▁") for p in pieces if p.lstrip("▁")]
    assert digits == list("২০২১1999")


def test_punctuation_is_split_off(tok):
    pieces = tok.convert_ids_to_tokens(tok("সে যায়। তুমি?", add_special_tokens=False)["input_ids"])
    assert "।" in pieces and "?" in pieces


def test_round_trip_on_unseen_corpus_text(tok):
    held_out = generate_documents(50, seed=123)
    ids = encode_batch(tok, held_out)
    for text, row in zip(held_out, ids, strict=True):
        assert tok.unk_token_id not in row
        assert tok.decode(row) == normalize(tok, text)


def test_single_and_pair_templates(tok):
    single = tok("আমি যাই।")
    assert single["input_ids"][0] == 2 and single["input_ids"][-1] == 3
    pair = tok("আমি যাই।", "সে যায়।")
    ids, types = pair["input_ids"], pair["token_type_ids"]
    first_sep = ids.index(3)
    assert ids[0] == 2 and ids[-1] == 3 and ids.count(3) == 2
    assert types == [0] * (first_sep + 1) + [1] * (len(ids) - first_sep - 1)
    a_ids = tok("আমি যাই।", add_special_tokens=False)["input_ids"]
    assert ids[1:first_sep] == a_ids


def test_save_and_load_through_auto_tokenizer(saved):
    tok, out = saved
    assert (out / "tokenizer.json").is_file()
    text = generate_documents(3, seed=77)
    auto = AutoTokenizer.from_pretrained(str(out))
    plain = PreTrainedTokenizerFast.from_pretrained(str(out))
    mine = load_tokenizer(out)
    for other in (auto, plain, mine):
        assert other(text)["input_ids"] == tok(text)["input_ids"]
        assert other.mask_token == "[MASK]" and other.pad_token_id == 0
        assert other.model_max_length == MODEL_MAX_LENGTH
    batch = auto(text, padding="max_length", max_length=128, truncation=True)
    assert all(len(row) == 128 and row[-1] == 0 for row in batch["input_ids"])


def test_load_rejects_a_directory_without_a_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path)


def test_train_from_a_file_gives_the_pieces_of_training_from_texts(tmp_path):
    # Same pieces; ids may differ between runs (HF's trainer iterates hash maps).
    path = write_corpus(tmp_path / "c.txt", 120, seed=4)
    from_file = train_tokenizer(path, 400)
    from_texts = train_tokenizer(generate_documents(120, seed=4), 400)
    assert set(from_file.get_vocab()) == set(from_texts.get_vocab())
    assert len(from_file) == 400


def test_vocab_must_exceed_specials():
    with pytest.raises(ValueError):
        train_tokenizer(["কিছু লেখা।"], 5)
