"""The synthetic Bengali corpus: determinism, the quirks it must exercise, and its grammar."""

import math
import re
from collections import Counter

import pytest

from models.text.corpus import (
    CLOSING,
    CONNECTIVES,
    NCC_LABELS,
    NER_TAGS,
    PAST_TIMES,
    PRONOUNS,
    TOPICS,
    VERBS,
    generate_documents,
    generate_ncc_examples,
    generate_ner_examples,
    write_corpus,
)
from models.text.data import split_sentences
from models.text.sources import read_local_documents


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return generate_documents(400, seed=11)


def test_documents_are_deterministic_by_seed():
    assert generate_documents(30, seed=3) == generate_documents(30, seed=3)
    assert generate_documents(30, seed=3) != generate_documents(30, seed=4)
    assert len(generate_documents(7, seed=0)) == 7


def test_documents_are_single_lines_of_several_sentences(docs):
    for doc in docs:
        assert "\n" not in doc
        assert doc == doc.strip()
        assert len(split_sentences(doc)) >= 2


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError):
        generate_documents(-1, seed=0)
    with pytest.raises(ValueError):
        generate_documents(3, seed=0, min_sentences=5, max_sentences=2)
    with pytest.raises(ValueError):
        generate_ncc_examples(3, seed=0, labels=["weather"])


def test_corpus_exercises_what_the_normaliser_handles(docs):
    text = "\n".join(docs)
    assert "।" in text
    for danda_variant in ("|", "\u09e4", "\u09e5", "\u09f7"):
        assert danda_variant in text, hex(ord(danda_variant))
    assert re.search(r"[\u0980-\u09ff]:", text), "':' written after a Bengali letter"
    assert "ঃ" in text, "visarga written properly too"
    assert "  " in text, "double spaces"
    assert "?" in text and "!" in text
    assert re.search(r"[০-৯]", text) and re.search(r"[0-9]", text)
    latin = re.findall(r"[A-Za-z]+", text)
    by_lower: dict[str, set[str]] = {}
    for word in latin:
        by_lower.setdefault(word.lower(), set()).add(word)
    # Some Latin word occurs in several casings, so lowercasing changes tokenization.
    assert any(len(forms) >= 2 for forms in by_lower.values())


def _verb_readings() -> dict[str, set[tuple[int, int]]]:
    readings: dict[str, set[tuple[int, int]]] = {}
    for present, past in VERBS.values():
        for tense, forms in enumerate((present, past)):
            for person, form in enumerate(forms):
                readings.setdefault(form, set()).add((tense, person))
    return readings


def test_verbs_agree_with_pronoun_subjects_and_time_adverbs(docs):
    readings = _verb_readings()
    pronoun_person = dict(PRONOUNS)
    checked_person = checked_tense = 0
    for doc in docs:
        for sentence in split_sentences(doc):
            words = sentence.rstrip("।|?!\u09e4\u09e5\u09f7").split()
            if words[0] in CONNECTIVES or words[0] == CLOSING:
                words = words[1:]
            if words[-1] == "না":
                words = words[:-1]
            verb = words[-1]
            if verb not in readings:
                continue
            if words[0] in pronoun_person:
                persons = {p for _, p in readings[verb]}
                assert pronoun_person[words[0]] in persons, sentence
                checked_person += 1
            padded = f" {' '.join(words)} "
            if any(f" {phrase} " in padded for phrase in PAST_TIMES):
                assert 1 in {t for t, _ in readings[verb]}, sentence
                checked_tense += 1
    assert checked_person > 100 and checked_tense > 100


def test_documents_stay_on_one_topic(docs):
    # Place names of a topic co-occur: most place mentions in a document share its topic.
    places = {p: t.name for t in TOPICS for p in t.places if len(p.split()) == 1}
    coherent = total = 0
    for doc in docs:
        topics = Counter(places[w] for w in re.findall(r"\S+", doc) if w in places)
        if sum(topics.values()) >= 2:
            total += 1
            coherent += topics.most_common(1)[0][1] / sum(topics.values()) >= 0.75
    assert total > 20 and coherent / total > 0.8


def test_write_corpus_in_both_layouts_reads_back(tmp_path):
    expected = generate_documents(12, seed=5)
    lines = write_corpus(tmp_path / "lines.txt", 12, seed=5)
    blocks = write_corpus(tmp_path / "blocks.txt", 12, seed=5, blank_line_separated=True)
    assert read_local_documents(lines) == expected
    assert read_local_documents(blocks, layout="block") == expected
    assert "\n\n" in blocks.read_text(encoding="utf-8")


def test_ner_examples_are_well_formed_bio():
    examples = generate_ner_examples(300, seed=2)
    assert examples == generate_ner_examples(300, seed=2)
    seen = Counter()
    for tokens, tags in examples:
        assert len(tokens) == len(tags) > 0
        assert all(" " not in t and t for t in tokens)
        for i, tag in enumerate(tags):
            assert tag in NER_TAGS
            if tag.startswith("I-"):
                assert tags[i - 1] in (f"B-{tag[2:]}", tag), (tokens, tags)
            seen[tag] += 1
    assert set(seen) == set(NER_TAGS)


def test_ner_entities_come_from_the_lexicons():
    first_words = {
        "PER": set(),
        "ORG": {o.split()[0] for t in TOPICS for o in t.orgs},
        "LOC": {p.split()[0] for t in TOPICS for p in t.places},
    }
    from models.text.corpus import FIRST_NAMES

    first_words["PER"] = set(FIRST_NAMES)
    for tokens, tags in generate_ner_examples(200, seed=9):
        for token, tag in zip(tokens, tags, strict=True):
            if tag.startswith("B-"):
                assert any(token.startswith(w) for w in first_words[tag[2:]]), (token, tag)


def test_news_categories_are_learnable_from_words():
    train = generate_ncc_examples(600, seed=1)
    test = generate_ncc_examples(200, seed=2)
    assert train == generate_ncc_examples(600, seed=1)
    assert {label for _, label in train} == set(NCC_LABELS)
    # A bag-of-words naive Bayes classifier must beat chance (1/6) by far.
    counts = {label: Counter() for label in NCC_LABELS}
    for text, label in train:
        counts[label].update(text.split())
    vocab = set().union(*counts.values())
    totals = {label: sum(c.values()) + len(vocab) for label, c in counts.items()}

    def score(text: str, label: str) -> float:
        return sum(math.log((counts[label][w] + 1) / totals[label]) for w in text.split())

    correct = sum(max(NCC_LABELS, key=lambda lab: score(text, lab)) == y for text, y in test)
    assert correct / len(test) > 0.8


def test_sentence_order_is_detectable(docs):
    # What SOP can learn: connectives open only later sentences, and a person's short name
    # appears only after the full introduction.
    first_openers = Counter()
    later_openers = Counter()
    for doc in docs:
        sentences = split_sentences(doc)
        first_openers[sentences[0].split()[0]] += 1
        later_openers.update(s.split()[0] for s in sentences[1:])
    cues = set(CONNECTIVES) | {CLOSING}
    assert not cues & set(first_openers)
    assert sum(later_openers[c] for c in cues) > 0.2 * sum(later_openers.values())
