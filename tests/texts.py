"""Test corpora that every machine has or that the tests make: nothing is downloaded and
nothing outside the repository is read.

- ``stdlib``: the source of this Python's standard library (the files ``ferrolm demo``
  trains on), one document per file: code, docstrings, comments, some non-ASCII.
- ``multilingual``: generated prose in German (the fixture ``german.txt`` plus words),
  Russian, Greek, Chinese, Japanese, Korean, Hindi and Arabic, with emoji (joined, flagged,
  skin-toned), numbers, CRLF lines and odd whitespace.
- ``stories``: generated short children's stories, TinyStories-like English with dialogue.

Each is a string of documents separated by ``SEPARATOR`` (an ``<|endoftext|>`` line), the
layout of TinyStories' text files. The same size gives the same text on every run (the
stdlib corpus differs between Python versions, so tests compare against a peer computed
at run time, never against stored ids).
"""

from __future__ import annotations

import functools
import hashlib
import random
from pathlib import Path

EOT = "<|endoftext|>"
SEPARATOR = "\n" + EOT + "\n"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
#: The generated corpora by name (see corpus_text).
CORPORA = ("stdlib", "multilingual", "stories")


def fixture_file(name: str) -> Path:
    """A data file under tests/fixtures (part of the repository)."""
    path = FIXTURES / name
    if not path.is_file():
        raise FileNotFoundError(f"test fixture {path} is missing: it is part of the repository (git checkout it)")
    return path


def _cut(docs, size: int) -> str:
    """Documents joined by SEPARATOR, cycled until ``size`` chars, cut after the last
    newline that fits (so never inside a separator or a line)."""
    parts, n = [], -len(SEPARATOR)
    while n < size:
        for doc in docs:
            parts.append(doc)
            n += len(SEPARATOR) + len(doc)
            if n >= size:
                break
    text = SEPARATOR.join(parts)
    if len(text) > size:
        cut = text.rfind("\n", 0, size)
        text = text[: cut + 1] if cut >= 0 else text[:size]
        if text.endswith(SEPARATOR):
            text = text[: -len(SEPARATOR) + 1]
    return text


# ----------------------------------------------------------------------------- stdlib


@functools.cache
def _stdlib_documents() -> tuple:
    """The standard library's text files in a fixed order that mixes the whole library
    (sha256 of the relative path), so that a slice is not only its first letters."""
    from ferrolm.app.demo import stdlib_files

    files = sorted(stdlib_files(), key=lambda rel_path: hashlib.sha256(rel_path[0].encode()).digest())
    docs = []
    for _, path in files:
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip() and EOT not in text:
            docs.append(text.strip("\n"))
    if not docs:
        raise RuntimeError("no standard library source found: the tests' code corpus is this Python's stdlib")
    return tuple(docs)


@functools.cache
def stdlib_text(size: int) -> str:
    """About ``size`` chars of the standard library's source (repeated when larger)."""
    return _cut(_stdlib_documents(), size)


# ----------------------------------------------------------------------------- multilingual

# Word lists written for these tests; frequent words first (they are drawn Zipf-like).
_WORDS = {
    "de": "der die und in den von zu das mit sich des auf für ist im dem nicht ein eine als auch es an "
    "werden aus er hat daß dass sie nach wird bei einer um am sind noch wie einem über einen so zum war "
    "haben nur oder aber vor zur bis mehr durch man Straße Größe größer Mädchen Bücher Häuser müssen "
    "können Übung Ärger Öffnung schön früh spät Frühstück Fußball weiß Schlüssel Gemütlichkeit",
    "ru": "и в не на я быть он с что а по это она этот к но они мы как из у который то за свой весь год "
    "от так о для ты же все тот мочь вы человек такой его сказать только или ещё бы себя один как уже "
    "девочка мальчик собака кошка дом солнце река лес друг играть бежать смотреть большой маленький",
    "el": "και το να του η της με τα που για την σε από τον οι είναι ένα θα δεν στο στην των ότι "
    "Αθήνα θάλασσα ουρανός φίλος σπίτι μικρό μεγάλο όμορφη ημέρα νύχτα ψωμί νερό",
    "hi": "के है में की और से को का एक पर यह भी कि था हैं लिए नहीं तो ही या कर गया अपने "
    "भारत दिल्ली पानी किताब बच्चा खेलना सुंदर नमस्ते धन्यवाद",
    "ar": "في من على أن إلى التي الذي عن مع هذا كان هذه لا ما بين كل قد بعد ذلك "
    "القاهرة مدرسة كتاب شمس قمر بيت صديق جميل كبير صغير",
}
_CJK = {
    # Runs of characters without spaces, as written; common characters first.
    "zh": "的一是不了人我在有他这中大来上个国到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后"
    "小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现"
    "分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被"
    "走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑"
    "性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清",
    "ja": "のにはをたがでてとしれさあるいうもなかこですますからまでよりそのこのそれこれ"
    "日本東京学校先生友達今日明日時間電車会社仕事映画音楽天気雨雪山川海空花猫犬本",
    "ko": "이그저것수들등말더나한일사람때년하다있다되다없다보다같다우리학교친구선생님오늘내일시간사랑바다하늘",
}
_KATAKANA = ["コーヒー", "テレビ", "パソコン", "ラーメン", "アイスクリーム", "コンピューター", "ホテル", "タクシー"]
_JA_PARTICLES = ["は", "が", "を", "に", "で", "と", "の", "も", "へ", "から", "まで"]
_EMOJI = [
    "😀",
    "😂",
    "👍",
    "👍🏽",
    "❤️",
    "🇩🇪",
    "🇯🇵",
    "👨‍👩‍👧‍👦",
    "🧑🏿‍💻",
    "🏳️‍🌈",
    "✓",
    "☕",
    "🐍",
    "🦀",
    "1️⃣",
]
_NUMBERS = ["1,234.56", "2024-05-01", "12:30", "３４５", "٣٤٥", "१२३", "3.14159", "-42", "100%", "½", "10⁶", "№ 7"]
_SPACES = [" ", " ", " ", " ", "  ", "\t", "\u00a0", "\u3000", " \u200b"]


def _zipf_choice(rng: random.Random, items: list):
    # Rank r drawn with weight ~ 1/(r+1): a few frequent words, a long tail.
    return items[min(int(len(items) ** rng.random()) - 1, len(items) - 1)]


def _spaced_sentence(rng: random.Random, words: list, end: str) -> str:
    out = [_zipf_choice(rng, words) for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.3:
        out.insert(rng.randrange(len(out)), rng.choice(_NUMBERS))
    if rng.random() < 0.2:
        out.append(rng.choice(_EMOJI))
    sentence = ""
    for k, w in enumerate(out):
        sentence += (rng.choice(_SPACES) if k else "") + w
        if k and rng.random() < 0.08:
            sentence += ","
    return sentence[:1].upper() + sentence[1:] + end


def _cjk_sentence(rng: random.Random, lang: str) -> str:
    chars = _CJK[lang]
    out = []
    for _ in range(rng.randint(2, 5)):
        run = "".join(_zipf_choice(rng, chars) for _ in range(rng.randint(2, 8)))
        if lang == "ja":
            run += rng.choice(_JA_PARTICLES)
            if rng.random() < 0.3:
                run += rng.choice(_KATAKANA)
        if lang == "ko":
            run += " "
        out.append(run)
    sentence = ("，" if lang == "zh" else "、" if lang == "ja" else "").join(out).rstrip()
    if rng.random() < 0.2:
        sentence += rng.choice(_NUMBERS)
    if rng.random() < 0.15:
        sentence += rng.choice(_EMOJI)
    return sentence + {"zh": "。", "ja": "。", "ko": "."}[lang]


def _multilingual_document(rng: random.Random, german: str) -> str:
    paragraphs = []
    for _ in range(rng.randint(1, 4)):
        lang = rng.choice(["de", "ru", "el", "hi", "ar", "zh", "ja", "ko"])
        if lang in _CJK:
            sentences = [_cjk_sentence(rng, lang) for _ in range(rng.randint(2, 6))]
            para = "".join(sentences) if lang != "ko" else " ".join(sentences)
        else:
            words = _WORDS[lang].split()
            end = {"hi": "।", "ar": "؟" if rng.random() < 0.2 else "."}.get(lang, rng.choice([".", ".", "!", "?"]))
            para = " ".join(_spaced_sentence(rng, words, end) for _ in range(rng.randint(2, 6)))
            if lang == "de" and rng.random() < 0.3:
                para = german + " " + para
        if rng.random() < 0.2:
            para = para.replace("\n", "\r\n") + "\r"
        paragraphs.append(para)
    return rng.choice(["\n\n", "\n", "\r\n\r\n", "\n \n"]).join(paragraphs)


#: The generated corpora are made once at this size and cycled beyond it.
_GENERATED_CHARS = 600_000


@functools.cache
def _generated_documents(make) -> tuple:
    rng = random.Random(0)
    docs, n = [], 0
    while n < _GENERATED_CHARS:
        docs.append(make(rng))
        n += len(docs[-1]) + len(SEPARATOR)
    return tuple(docs)


def _multilingual_document_with_german(rng: random.Random) -> str:
    return _multilingual_document(rng, _german())


@functools.cache
def _german() -> str:
    return fixture_file("german.txt").read_text(encoding="utf-8").strip()


@functools.cache
def multilingual_text(size: int) -> str:
    """About ``size`` chars of generated many-script text (the same on every run)."""
    return _cut(_generated_documents(_multilingual_document_with_german), size)


# ----------------------------------------------------------------------------- stories

# Frequent words first (drawn Zipf-like, as children's stories repeat a few of them a lot).
_NAMES = ["Lily", "Ben", "Tim", "Sue", "Max", "Mia", "Tom", "Anna", "Sam", "Lucy", "Jack", "Zoe", "Leo", "Ella"]
_CHARACTERS = ["girl", "boy", "dog", "cat", "bird", "bunny", "frog", "bear", "duck", "mouse", "puppy", "owl"]
_THINGS = ["ball", "toy", "kite", "box", "hat", "red balloon", "big book", "shiny rock", "blue cup", "drum"]
_PLACES = ["park", "garden", "house", "forest", "beach", "big tree", "pond", "school", "farm", "hill"]
_ADJECTIVES = ["little", "happy", "big", "kind", "sad", "brave", "shy", "funny", "tired", "curious", "silly"]
_FEELINGS = ["happy", "sad", "scared", "proud", "excited", "angry", "sorry", "surprised"]
_VERBS = ["play", "run", "jump", "sing", "dance", "read", "swim", "draw", "climb", "explore", "bake", "share"]


def _story(rng: random.Random) -> str:
    def pick(words):
        return _zipf_choice(rng, words)

    name, friend = pick(_NAMES), pick(_NAMES[1:])
    animal, thing, place = pick(_CHARACTERS), pick(_THINGS), pick(_PLACES)
    adjective, feeling, verb = pick(_ADJECTIVES), pick(_FEELINGS), pick(_VERBS)
    he = rng.choice(["He", "She"])
    lines = [
        pick(["Once upon a time", "One day", "Long ago", "One sunny morning"])
        + f", there was a {adjective} {animal} named {name}.",
        f"{name} {rng.choice(['loved', 'liked'])} to {verb} in the {place}. {he} had a {thing} that {he.lower()}"
        " liked very much.",
    ]
    for _ in range(rng.randint(2, 7)):
        kind = rng.randrange(5)
        if kind == 0:
            lines.append(f'{friend} said, "Can I {verb} with your {thing}?"')
        elif kind == 1:
            lines.append(f"{name} felt {pick(_FEELINGS)}. {he} didn't want to lose the {thing}.")
        elif kind == 2:
            lines.append(f"They went to the {pick(_PLACES)} to {pick(_VERBS)} all day long.")
        elif kind == 3:
            lines.append(f"“Look!” said {friend}. “The {pick(_CHARACTERS[2:])} is {pick(_ADJECTIVES)}!”")
        else:
            lines.append(f"{rng.randint(2, 12)} {pick(_CHARACTERS[2:])}s came to {verb} too. It was fun.")
    lines.append(
        rng.choice(
            [
                f"In the end, {name} and {friend} were {feeling} friends.",
                f"From that day on, {name} always shared the {thing}.",
                f"{name} learned that it's good to be kind. The end.",
            ]
        )
    )
    text = " ".join(lines)
    return text if rng.random() < 0.5 else text.replace(". ", ".\n", rng.randint(1, 3))


@functools.cache
def stories_text(size: int) -> str:
    """About ``size`` chars of generated short stories (the same on every run)."""
    return _cut(_generated_documents(_story), size)


# ----------------------------------------------------------------------------- by name


def corpus_text(name: str, size: int) -> str:
    """The corpus ``name`` (one of CORPORA), about ``size`` chars."""
    return {"stdlib": stdlib_text, "multilingual": multilingual_text, "stories": stories_text}[name](size)


def write_corpus(path: Path, name: str, size: int) -> Path:
    """The corpus written to ``path`` as UTF-8 (newlines kept as they are)."""
    path = Path(path)
    path.write_bytes(corpus_text(name, size).encode("utf-8"))
    return path
