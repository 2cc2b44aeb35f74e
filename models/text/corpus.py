"""A deterministic generator of SYNTHETIC Bengali running text and tiny labelled sets.

No Bengali corpus can be installed in this project's environment, so tests and the default demo
use this generator instead. Everything it produces is SYNTHETIC: sentences are built from a small
hand-written vocabulary and grammar templates. It is not natural language data and says nothing
about the quality a model would reach on real Bengali text.

The text is built so that a masked language model has something to learn:

* subject-verb agreement: Bengali verbs inflect for person and honorific (আমি যাই, তুমি যাও,
  আপনি যান, সে যায়), and every verb agrees with its subject;
* tense agreement: past-time adverbs (গতকাল ...) take past forms, the others present forms;
* topical coherence: each document has one of six news topics whose places, organisations,
  roles and nouns co-occur, and a small cast of people who recur across its sentences.

It also exercises what sahajBERT's tokenizer normaliser handles: danda variants (``|``, U+09E4,
U+09E5, U+09F7), ``:`` written for visarga after a Bengali letter, double spaces, Bengali and ASCII
digits, ``?`` and ``!``, and Latin words in mixed case.

The same sentence builder yields token-level NER tags (WikiANN tag set) and the document builder
yields news-category labels (IndicGLUE sna.bn label set), both equally synthetic.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

NER_TAGS: tuple[str, ...] = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC")
NCC_LABELS: tuple[str, ...] = (
    "kolkata",
    "state",
    "national",
    "sports",
    "entertainment",
    "international",
)

# Grammatical person classes: index into each verb's tuple of forms.
FIRST, SECOND, HONORIFIC, THIRD = 0, 1, 2, 3

BENGALI_DIGITS = "০১২৩৪৫৬৭৮৯"

# Verb lemma -> (present forms, past forms), each ordered (1st, 2nd, honorific, 3rd person).
VERBS: dict[str, tuple[tuple[str, str, str, str], tuple[str, str, str, str]]] = {
    "যাওয়া": (("যাই", "যাও", "যান", "যায়"), ("গেলাম", "গেলে", "গেলেন", "গেল")),
    "আসা": (("আসি", "আসো", "আসেন", "আসে"), ("এলাম", "এলে", "এলেন", "এল")),
    "খাওয়া": (("খাই", "খাও", "খান", "খায়"), ("খেলাম", "খেলে", "খেলেন", "খেল")),
    "পড়া": (("পড়ি", "পড়ো", "পড়েন", "পড়ে"), ("পড়লাম", "পড়লে", "পড়লেন", "পড়ল")),
    "লেখা": (("লিখি", "লেখো", "লেখেন", "লেখে"), ("লিখলাম", "লিখলে", "লিখলেন", "লিখল")),
    "দেখা": (("দেখি", "দেখো", "দেখেন", "দেখে"), ("দেখলাম", "দেখলে", "দেখলেন", "দেখল")),
    "শোনা": (("শুনি", "শোনো", "শোনেন", "শোনে"), ("শুনলাম", "শুনলে", "শুনলেন", "শুনল")),
    "কেনা": (("কিনি", "কেনো", "কেনেন", "কেনে"), ("কিনলাম", "কিনলে", "কিনলেন", "কিনল")),
    "করা": (("করি", "করো", "করেন", "করে"), ("করলাম", "করলে", "করলেন", "করল")),
    "দেওয়া": (("দিই", "দাও", "দেন", "দেয়"), ("দিলাম", "দিলে", "দিলেন", "দিল")),
}

# Objects each transitive verb takes (topic-independent part of the lexicon).
VERB_OBJECTS: dict[str, tuple[str, ...]] = {
    "খাওয়া": ("ভাত", "মাছ", "মিষ্টি", "রসগোল্লা", "ডাল", "রুটি", "ফুচকা"),
    "পড়া": ("বই", "খবরের কাগজ", "উপন্যাস", "প্রতিবেদন", "কবিতা"),
    "লেখা": ("চিঠি", "প্রতিবেদন", "কবিতা", "গল্প", "প্রবন্ধ"),
    "শোনা": ("গান", "খবর", "বক্তৃতা", "রেডিও"),
    "কেনা": ("জামা", "বই", "সবজি", "টিকিট", "ফোন", "মিষ্টি"),
}

PRONOUNS: tuple[tuple[str, int], ...] = (
    ("আমি", FIRST),
    ("আমরা", FIRST),
    ("তুমি", SECOND),
    ("তোমরা", SECOND),
    ("আপনি", HONORIFIC),
    ("আপনারা", HONORIFIC),
    ("তিনি", HONORIFIC),
    ("সে", THIRD),
    ("তারা", THIRD),
)

FIRST_NAMES: tuple[str, ...] = (
    "রহিম", "করিম", "সুমন", "অমিত", "রাহুল", "প্রিয়াঙ্কা", "সুমিতা", "অনন্যা", "দেবাশিস",
    "তানিয়া", "ফারহানা", "সৌরভ", "অর্পিতা", "নাসির", "মৌমিতা", "জয়ন্ত", "রাকিব", "শ্রেয়া",
    "অভিজিৎ", "পায়েল", "সঞ্জয়", "রুমা", "ইমরান", "কৌশিক",
)  # fmt: skip
LAST_NAMES: tuple[str, ...] = (
    "চট্টোপাধ্যায়", "বন্দ্যোপাধ্যায়", "মুখার্জি", "দাস", "সেন", "ঘোষ", "বসু", "রায়", "হোসেন",
    "ইসলাম", "চৌধুরী", "সরকার", "মণ্ডল", "গাঙ্গুলি", "দত্ত", "আহমেদ", "মিত্র", "পাল",
)  # fmt: skip
# Titles that make a name honorific ("ড:" exercises the colon -> visarga rule).
TITLES: tuple[str, ...] = ("শ্রী", "ড:", "অধ্যাপক", "জনাব")

PRESENT_TIMES: tuple[str, ...] = ("প্রতিদিন", "রোজ", "আজ", "এখন", "সকালে", "প্রতি সপ্তাহে")
PAST_TIMES: tuple[str, ...] = ("গতকাল", "গত সপ্তাহে", "গত বছর", "সেদিন", "তখন", "গত মাসে")
ADJECTIVES: tuple[str, ...] = (
    "বড়", "নতুন", "পুরনো", "সুন্দর", "গুরুত্বপূর্ণ", "কঠিন", "সহজ", "বিশাল", "ছোট", "ভালো",
)  # fmt: skip
# Words spelled with visarga; the generator sometimes writes ':' instead, as people do.
VISARGA_WORDS: tuple[str, ...] = ("অতঃপর", "নিঃসন্দেহে", "দুঃখজনক", "দুঃসময়", "প্রাতঃকালে")
# Discourse connectives that open only non-first sentences ("then", "after this", "besides",
# "later"), and the one that opens a closing sentence ("finally").
CONNECTIVES: tuple[str, ...] = ("তারপর", "এরপর", "তাছাড়া", "পরে")
CLOSING = "অবশেষে"
UNITS: tuple[str, ...] = ("টাকা", "লক্ষ টাকা", "কোটি টাকা")


@dataclass(frozen=True)
class Topic:
    """The lexicon of one news topic; the words co-occur within a document."""

    name: str
    places: tuple[str, ...]
    orgs: tuple[str, ...]
    nouns: tuple[str, ...]
    roles: tuple[str, ...]
    events: tuple[str, ...]
    latin: tuple[str, ...]


TOPICS: tuple[Topic, ...] = (
    Topic(
        "kolkata",
        places=("কলকাতা", "হাওড়া", "সল্টলেক", "বেহালা", "ধর্মতলা", "শিয়ালদহ", "গড়িয়াহাট",
                "কলেজ স্ট্রিট", "নিউ টাউন", "দমদম"),
        orgs=("কলকাতা পৌরসভা", "কলকাতা পুলিশ", "কলকাতা মেট্রো", "যাদবপুর বিশ্ববিদ্যালয়",
              "কলকাতা বিশ্ববিদ্যালয়"),
        nouns=("রাস্তা", "মেট্রো", "ট্রাম", "বাস", "যানজট", "বাজার", "পার্ক", "ফ্লাইওভার",
               "দুর্গাপুজো", "জলনিকাশি"),
        roles=("মেয়র", "কাউন্সিলর", "পুলিশ কমিশনার"),
        events=("মিছিল", "উৎসব", "অগ্নিকাণ্ড", "দুর্ঘটনা", "বইমেলা"),
        latin=("Metro", "WiFi", "Uber", "AC"),
    ),
    Topic(
        "state",
        places=("বর্ধমান", "মুর্শিদাবাদ", "দার্জিলিং", "বাঁকুড়া", "পুরুলিয়া", "মালদা",
                "শিলিগুড়ি", "নদিয়া", "মেদিনীপুর", "কোচবিহার"),
        orgs=("রাজ্য সরকার", "রাজ্য নির্বাচন কমিশন", "পশ্চিমবঙ্গ বিধানসভা", "জেলা পরিষদ",
              "পঞ্চায়েত সমিতি"),
        nouns=("ধান", "চাষি", "সেচ", "পঞ্চায়েত", "স্কুল", "হাসপাতাল", "বন্যা", "সেতু", "গ্রাম",
               "হিমঘর"),
        roles=("জেলাশাসক", "বিধায়ক", "মুখ্যমন্ত্রী", "পঞ্চায়েত প্রধান"),
        events=("পঞ্চায়েত নির্বাচন", "বন্যা", "মেলা", "ধর্মঘট", "কৃষক সভা"),
        latin=("Panchayat", "Tea", "Toto", "SSC"),
    ),
    Topic(
        "national",
        places=("দিল্লি", "মুম্বই", "চেন্নাই", "বেঙ্গালুরু", "হায়দরাবাদ", "পাটনা", "লখনউ",
                "গুয়াহাটি", "আহমেদাবাদ", "জয়পুর"),
        orgs=("লোকসভা", "রাজ্যসভা", "সুপ্রিম কোর্ট", "নির্বাচন কমিশন", "রিজার্ভ ব্যাংক",
              "ভারতীয় রেল"),
        nouns=("বাজেট", "সংসদ", "আইন", "কর", "রেল", "অর্থনীতি", "মূল্যবৃদ্ধি", "ভোট", "প্রকল্প",
               "জিএসটি"),
        roles=("প্রধানমন্ত্রী", "রাষ্ট্রপতি", "অর্থমন্ত্রী", "সাংসদ", "বিচারপতি"),
        events=("অধিবেশন", "শুনানি", "বৈঠক", "লোকসভা নির্বাচন", "ধর্মঘট"),
        latin=("GST", "Aadhaar", "RBI", "Budget"),
    ),
    Topic(
        "sports",
        places=("ইডেন গার্ডেন্স", "যুবভারতী", "ওয়াংখেড়ে", "লর্ডস", "সল্টলেক স্টেডিয়াম",
                "মোহালি", "ধরমশালা"),
        orgs=("মোহনবাগান", "ইস্টবেঙ্গল", "মহমেডান স্পোর্টিং", "ভারতীয় ক্রিকেট দল", "বিসিসিআই",
              "সিএবি"),
        nouns=("ক্রিকেট", "ফুটবল", "ম্যাচ", "গোল", "রান", "উইকেট", "সেঞ্চুরি", "টুর্নামেন্ট",
               "মাঠ", "অনুশীলন"),
        roles=("অধিনায়ক", "কোচ", "খেলোয়াড়", "ব্যাটসম্যান", "গোলরক্ষক"),
        events=("ডার্বি", "ফাইনাল", "সেমিফাইনাল", "টেস্ট ম্যাচ", "লিগ"),
        latin=("IPL", "Test", "FIFA", "World Cup"),
    ),
    Topic(
        "entertainment",
        places=("টালিগঞ্জ", "নন্দন", "রবীন্দ্র সদন", "স্টার থিয়েটার", "ফিল্ম সিটি"),
        orgs=("টলিউড", "বলিউড", "কলকাতা চলচ্চিত্র উৎসব", "সঙ্গীত নাটক অকাদেমি",
              "জাতীয় নাট্যশালা"),
        nouns=("ছবি", "সিনেমা", "গান", "নাটক", "সিরিয়াল", "অভিনয়", "চিত্রনাট্য", "অ্যালবাম",
               "পুরস্কার", "দর্শক"),
        roles=("অভিনেতা", "অভিনেত্রী", "পরিচালক", "গায়ক", "প্রযোজক"),
        events=("মুক্তি", "শুটিং", "প্রিমিয়ার", "কনসার্ট", "চলচ্চিত্র উৎসব"),
        latin=("Netflix", "YouTube", "Oscar", "Trailer"),
    ),
    Topic(
        "international",
        places=("আমেরিকা", "চিন", "রাশিয়া", "লন্ডন", "প্যারিস", "ঢাকা", "টোকিও", "ইউক্রেন",
                "জার্মানি", "ব্রাজিল"),
        orgs=("জাতিসংঘ", "বিশ্বব্যাংক", "ন্যাটো", "বিশ্ব স্বাস্থ্য সংস্থা", "ইউরোপীয় ইউনিয়ন"),
        nouns=("যুদ্ধ", "চুক্তি", "নিষেধাজ্ঞা", "সীমান্ত", "শরণার্থী", "বাণিজ্য", "জলবায়ু",
               "দূতাবাস", "শান্তি", "তেল"),
        roles=("রাষ্ট্রদূত", "প্রেসিডেন্ট", "বিদেশমন্ত্রী", "মহাসচিব"),
        events=("সম্মেলন", "শীর্ষ বৈঠক", "নির্বাচন", "হামলা", "আলোচনা"),
        latin=("UN", "NATO", "COVID", "G20"),
    ),
)  # fmt: skip
TOPIC_BY_NAME: dict[str, Topic] = {t.name: t for t in TOPICS}

_VOWEL_SIGNS = set("ািীুূৃেৈোৌ")
_INDEPENDENT_VOWELS = set("অআইঈউঊঋএঐওঔ")

# A sentence is a list of (word, NER tag) pairs plus its terminator.
Tagged = list[tuple[str, str]]


def genitive(word: str) -> str:
    """Bengali genitive: -র after a vowel, -এর (written ের) after a consonant."""
    last = word[-1]
    if last in _VOWEL_SIGNS or last in _INDEPENDENT_VOWELS:
        return word + "র"
    if last == "ং":
        return word + "য়ের"
    if last == "ৎ":
        return word[:-1] + "তের"
    return word + "ের"


def locative(word: str) -> str:
    """Bengali locative: -য় after আ-kar, -তে after other vowels, -এ after a consonant."""
    last = word[-1]
    if last == "া":
        return word + "য়"
    if last in _VOWEL_SIGNS or last in _INDEPENDENT_VOWELS:
        return word + "তে"
    if last == "ং":
        return word + "য়ে"
    if last == "ৎ":
        return word[:-1] + "তে"
    return word + "ে"


def _entity(phrase: str, kind: str, inflect=None) -> Tagged:
    """Tag a multi-word entity B-/I- and inflect its last word (suffixes stay inside the entity)."""
    words = phrase.split(" ")
    if inflect is not None:
        words[-1] = inflect(words[-1])
    return [(w, (f"B-{kind}" if i == 0 else f"I-{kind}")) for i, w in enumerate(words)]


def _plain(phrase: str) -> Tagged:
    return [(w, "O") for w in phrase.split(" ")]


@dataclass(frozen=True)
class _Person:
    name: str  # one or two words
    title: str  # "" or an honorific title / topic role
    person: int  # THIRD or HONORIFIC


class _DocumentWriter:
    """Builds the sentences of one document about one topic with a fixed cast."""

    def __init__(self, rng: random.Random, topic: Topic, noise: float = 0.0) -> None:
        self.rng = rng
        self.topic = topic
        self.noise = noise
        n_cast = rng.randint(1, 3)
        self.cast = [self._new_person() for _ in range(n_cast)]
        self.home = rng.sample(topic.places, k=min(2, len(topic.places)))
        self.org = rng.choice(topic.orgs)
        self.introduced: set[str] = set()

    # ----- lexical choices -------------------------------------------------------------
    def _new_person(self) -> _Person:
        rng = self.rng
        first = rng.choice(FIRST_NAMES)
        name = first if rng.random() < 0.3 else f"{first} {rng.choice(LAST_NAMES)}"
        r = rng.random()
        if r < 0.35:
            return _Person(name, rng.choice(self.topic.roles), HONORIFIC)
        if r < 0.5:
            return _Person(name, rng.choice(TITLES), HONORIFIC)
        return _Person(name, "", THIRD)

    def _topic(self) -> Topic:
        # With probability `noise` a sentence borrows another topic's lexicon.
        if self.noise and self.rng.random() < self.noise:
            return self.rng.choice(TOPICS)
        return self.topic

    def _place(self, topic: Topic) -> str:
        if topic is self.topic and self.rng.random() < 0.7:
            return self.rng.choice(self.home)
        return self.rng.choice(topic.places)

    def _org(self, topic: Topic) -> str:
        if topic is self.topic and self.rng.random() < 0.6:
            return self.org
        return self.rng.choice(topic.orgs)

    def _number(self, low: int, high: int) -> str:
        value = str(self.rng.randint(low, high))
        if self.rng.random() < 0.7:
            return "".join(BENGALI_DIGITS[int(c)] for c in value)
        return value

    def _latin(self, topic: Topic) -> str:
        word = self.rng.choice(topic.latin)
        style = self.rng.random()
        if style < 0.4:
            return word
        if style < 0.6:
            return word.upper()
        if style < 0.8:
            return word.lower()
        return word.title()

    def _visarga(self) -> str:
        word = self.rng.choice(VISARGA_WORDS)
        return word.replace("ঃ", ":") if self.rng.random() < 0.35 else word

    def _subject(self) -> tuple[Tagged, int]:
        rng = self.rng
        r = rng.random()
        if r < 0.5:
            p = rng.choice(self.cast)
            if p.name in self.introduced and rng.random() < 0.7:
                # Once introduced, a person is mostly called by the first name alone.
                return _entity(p.name.split(" ")[0], "PER"), p.person
            self.introduced.add(p.name)
            tagged = _plain(p.title) if p.title else []
            return tagged + _entity(p.name, "PER"), p.person
        if r < 0.8:
            word, person = rng.choice(PRONOUNS)
            return [(word, "O")], person
        # A bare role noun ("the mayor") takes honorific agreement.
        return _plain(rng.choice(self._topic().roles)), HONORIFIC

    def _time(self) -> tuple[Tagged, int]:
        """A time adverb and the tense (0 present, 1 past) it requires."""
        if self.rng.random() < 0.5:
            return _plain(self.rng.choice(PRESENT_TIMES)), 0
        return _plain(self.rng.choice(PAST_TIMES)), 1

    @staticmethod
    def _verb(lemma: str, tense: int, person: int) -> str:
        return VERBS[lemma][tense][person]

    # ----- sentence templates ----------------------------------------------------------
    def motion(self) -> tuple[Tagged, str]:
        subj, person = self._subject()
        time, tense = self._time()
        place = _entity(self._place(self._topic()), "LOC", locative)
        verb = self._verb(self.rng.choice(("যাওয়া", "আসা")), tense, person)
        return subj + time + place + [(verb, "O")], "."

    def transitive(self) -> tuple[Tagged, str]:
        subj, person = self._subject()
        time, tense = self._time()
        lemma = self.rng.choice(tuple(VERB_OBJECTS))
        obj = _plain(self.rng.choice(VERB_OBJECTS[lemma]))
        tail = [(self._verb(lemma, tense, person), "O")]
        if tense == 0 and self.rng.random() < 0.15:
            tail.append(("না", "O"))
        return subj + time + obj + tail, "."

    def watch(self) -> tuple[Tagged, str]:
        subj, person = self._subject()
        time, tense = self._time()
        topic = self._topic()
        obj = _plain(self.rng.choice(topic.nouns + topic.events))
        return subj + time + obj + [(self._verb("দেখা", tense, person), "O")], "."

    def discuss(self) -> tuple[Tagged, str]:
        subj, person = self._subject()
        time, tense = self._time()
        topic = self._topic()
        middle: Tagged = []
        if self.rng.random() < 0.5:
            middle = _entity(self._org(topic), "ORG", genitive)
        middle += _plain(f"{self.rng.choice(topic.nouns)} নিয়ে")
        if self.rng.random() < 0.5:
            middle += _plain(self.rng.choice(ADJECTIVES))
        verb = self._verb("করা", tense, person)
        return subj + time + middle + [("আলোচনা", "O"), (verb, "O")], "."

    def announce(self) -> tuple[Tagged, str]:
        topic = self._topic()
        org = _entity(self._org(topic), "ORG")
        time, tense = self._time()
        amount = [(self._number(2, 900), "O"), ("কোটি", "O"), ("টাকার", "O")]
        noun = _plain(f"{self.rng.choice(ADJECTIVES)} {self.rng.choice(topic.nouns)} প্রকল্প")
        verb = self._verb("করা", tense, THIRD)
        return org + time + amount + noun + [("ঘোষণা", "O"), (verb, "O")], "."

    def event(self) -> tuple[Tagged, str]:
        topic = self._topic()
        place = _entity(self._place(topic), "LOC", locative)
        event = _plain(self.rng.choice(topic.events))
        if self.rng.random() < 0.5:
            when = [(self._number(1990, 2023), "O"), ("সালে", "O")]
            return when + place + event + [("হয়েছিল", "O")], "."
        when = [(self._number(1, 28), "O"), ("তারিখে", "O")]
        return when + place + event + [("হবে", "O")], "."

    def join_event(self) -> tuple[Tagged, str]:
        subj, person = self._subject()
        time, tense = self._time()
        event = self.rng.choice(self._topic().events).split(" ")
        event[-1] = locative(event[-1])
        verb = self._verb("দেওয়া", tense, person)
        return subj + time + _plain(" ".join(event)) + [("যোগ", "O"), (verb, "O")], "."

    def count(self) -> tuple[Tagged, str]:
        topic = self._topic()
        place = _entity(self._place(topic), "LOC", locative)
        unit = self.rng.choice(UNITS)
        body = [(self._number(2, 5000), "O")] + _plain(unit)
        event = self.rng.choice(topic.events).split(" ")
        event[-1] = genitive(event[-1])
        return place + _plain(" ".join(event)) + _plain("জন্য") + body + _plain("খরচ হয়েছে"), "."

    def question(self) -> tuple[Tagged, str]:
        subj, person = self._subject()
        time, tense = self._time()
        place = _entity(self._place(self._topic()), "LOC", locative)
        verb = self._verb("যাওয়া", tense, person)
        return subj + [("কি", "O")] + time + place + [(verb, "O")], "?"

    def comment(self) -> tuple[Tagged, str]:
        subj, person = self._subject()
        time, tense = self._time()
        topic = self._topic()
        latin = _plain(self._latin(topic)) + [("নিয়ে", "O")]
        verb = self._verb("করা", tense, person)
        return subj + time + latin + _plain(f"{self.rng.choice(ADJECTIVES)} মন্তব্য") + [
            (verb, "O")
        ], "."

    def visarga(self) -> tuple[Tagged, str]:
        rng = self.rng
        if rng.random() < 0.5:
            adverb = rng.choice(("অতঃপর", "নিঃসন্দেহে"))
            if rng.random() < 0.35:
                adverb = adverb.replace("ঃ", ":")
            sentence, end = self.motion()
            return [(adverb, "O"), (",", "O")] + sentence, end
        topic = self._topic()
        word = self._visarga()
        return _plain(f"কী {word} {rng.choice(topic.events)}"), "!"

    def score(self) -> tuple[Tagged, str]:
        topic = TOPIC_BY_NAME["sports"]
        a, b = self.rng.sample(topic.orgs[:3], k=2)
        goals = [(f"{self._number(1, 5)}-{self._number(0, 1)}", "O"), ("গোলে", "O")]
        b_tagged = _entity(b, "ORG", lambda w: w + "কে")
        return _entity(a, "ORG") + goals + b_tagged + [("হারাল", "O")], "."

    def sentence(self) -> tuple[Tagged, str]:
        templates = [
            (self.motion, 3),
            (self.transitive, 3),
            (self.watch, 2),
            (self.discuss, 3),
            (self.announce, 2),
            (self.event, 2),
            (self.join_event, 2),
            (self.count, 1),
            (self.question, 1),
            (self.comment, 1),
            (self.visarga, 1),
        ]
        if self.topic.name == "sports":
            templates.append((self.score, 2))
        fns, weights = zip(*templates, strict=True)
        return self.rng.choices(fns, weights=weights, k=1)[0]()


def _terminator(rng: random.Random, kind: str) -> str:
    """Sentence end as people type it: mostly ।, sometimes a look-alike the normaliser fixes."""
    if kind != ".":
        return kind
    r = rng.random()
    if r < 0.82:
        return "।"
    if r < 0.9:
        return "|"
    if r < 0.94:
        return "\u09e4"  # reserved Bengali code point that some text uses for danda
    if r < 0.97:
        return "\u09f7"  # Bengali currency numerator four, a danda look-alike
    return "\u09e5"


_BENGALI_LETTER_END = set("ািীুূৃেৈোৌংৎ") | {chr(c) for c in range(0x0995, 0x09BA)}


def _clitics(rng: random.Random, tagged: Tagged, p: float = 0.05) -> Tagged:
    """Attach the emphatic -ই or inclusive -ও clitic to a few words (আজই, সেও, কলকাতাতেও).

    Besides being ordinary Bengali, this varies word forms, which the Unigram trainer needs: HF
    seeds its pieces from substrings shared by distinct words.
    """
    out = []
    for i, (word, tag) in enumerate(tagged):
        # Leave the verb group (the last two words) alone, so agreement stays easy to check.
        if i < len(tagged) - 2 and word[-1] in _BENGALI_LETTER_END and rng.random() < p:
            word += rng.choice("ইও")
        out.append((word, tag))
    return out


def _render(rng: random.Random, tagged: Tagged, end: str) -> str:
    parts = [w for w, _ in _clitics(rng, tagged)]
    text = ""
    for i, word in enumerate(parts):
        if i and word != ",":
            text += "  " if rng.random() < 0.03 else " "
        text += word
    return text + _terminator(rng, end)


def _document(rng: random.Random, topic: Topic, n_sentences: int, noise: float) -> str:
    """Sentences in an order a model can detect (for SOP): people are introduced in full before
    being called by first name, and only later sentences open with a connective."""
    writer = _DocumentWriter(rng, topic, noise)
    out = ""
    for i in range(n_sentences):
        tagged, end = writer.sentence()
        if i == n_sentences - 1 and n_sentences >= 4 and rng.random() < 0.5:
            tagged = [(CLOSING, "O")] + tagged
        elif i and rng.random() < 0.35:
            tagged = [(rng.choice(CONNECTIVES), "O")] + tagged
        if i:
            out += "  " if rng.random() < 0.1 else " "
        out += _render(rng, tagged, end)
    return out


def generate_documents(
    n: int, *, seed: int, min_sentences: int = 4, max_sentences: int = 12
) -> list[str]:
    """``n`` SYNTHETIC Bengali documents (one string each, no newlines), deterministic by seed."""
    if n < 0 or min_sentences < 1 or max_sentences < min_sentences:
        raise ValueError("need n >= 0 and 1 <= min_sentences <= max_sentences")
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        topic = rng.choice(TOPICS)
        docs.append(_document(rng, topic, rng.randint(min_sentences, max_sentences), noise=0.05))
    return docs


def write_corpus(
    path: str | Path, n_docs: int, *, seed: int, blank_line_separated: bool = False
) -> Path:
    """Write a SYNTHETIC corpus: one document per line (or blank-line separated blocks)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    docs = generate_documents(n_docs, seed=seed)
    if blank_line_separated:
        text = "\n\n".join(docs) + "\n"
    else:
        text = "\n".join(docs) + "\n"
    path.write_text(text, encoding="utf-8")
    logger.info("wrote %d synthetic documents to %s", n_docs, path)
    return path


def generate_ner_examples(n: int, *, seed: int) -> list[tuple[list[str], list[str]]]:
    """``n`` SYNTHETIC NER sentences as (tokens, tags) with the WikiANN tag set.

    Tokens are whitespace words plus the sentence terminator as its own token; case suffixes stay
    attached to the entity word (as in WikiANN), e.g. ``কলকাতায়`` is tagged ``B-LOC``.
    """
    rng = random.Random(seed)
    out: list[tuple[list[str], list[str]]] = []
    while len(out) < n:
        writer = _DocumentWriter(rng, rng.choice(TOPICS))
        tagged, end = writer.sentence()
        if all(tag == "O" for _, tag in tagged) and rng.random() < 0.7:
            continue  # keep most examples informative: they should contain an entity
        tagged = _clitics(rng, tagged)
        tokens = [w for w, _ in tagged] + [_terminator(rng, end)]
        tags = [t for _, t in tagged] + ["O"]
        out.append((tokens, tags))
    return out


def generate_ncc_examples(
    n: int, *, seed: int, labels: Sequence[str] = NCC_LABELS, noise: float = 0.15
) -> list[tuple[str, str]]:
    """``n`` SYNTHETIC news articles as (text, label) with the sna.bn label set.

    ``noise`` is the chance that a sentence borrows another topic's words, so the task is not
    trivially separable by a single keyword.
    """
    for label in labels:
        if label not in TOPIC_BY_NAME:
            raise ValueError(f"unknown news category {label!r}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        label = rng.choice(tuple(labels))
        text = _document(rng, TOPIC_BY_NAME[label], rng.randint(2, 5), noise=noise)
        out.append((text, label))
    return out
