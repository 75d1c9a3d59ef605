"""An offline long-context suite after RULER (Hsieh et al., 2024, arXiv:2404.06654), rebuilt from the paper's
task definitions with our own generators: needle in a haystack (single needle with a number, word or UUID
value; multi-key with distractor needles; multi-value; multi-query), variable tracking, common-words and
frequent-words extraction, and the passkey task.

Nothing is downloaded: haystacks are standard-library docstrings, sentences composed from the word lists of
the ``wonderwords`` package, and a filler paragraph of our own; keys come from the same word lists. None of
the wordings, haystack sentences or key words is shared with the training data (``leank_train.data``):
the training keys and haystack sentences are removed here, and ``tests/test_ruler.py`` asserts the sets
are disjoint. As in RULER, a length is the whole budget: prompt (chat template and answer prefix included)
plus the tokens the task may generate, so a length of 8192 fits an 8k-position model.

A probe is a pure function of ``(seed, task, length, index)``: every method answers the same probes.
"""

from __future__ import annotations

import copy
import functools
import math
import random
import string
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import RecipeError

#: the filler haystack (RULER's "noise"): our own sentences, not the training data's ``NOISE``
FILLER = ("The kettle hums on the stove. A cat naps by the window. Rain taps on the roof. "
          "The clock in the hall keeps ticking. Somebody hums a tune upstairs.")
#: frames of the composed "words" haystack, filled with wonderwords' nouns, adjectives and verbs
_FRAMES = (
    "Nobody expected the {a} {n} to {v} the {n2}.",
    "They asked the {n} to {v} a {a} {n2} before noon.",
    "Every {n} in town wants to {v} something {a}.",
    "It is hard to {v} a {n} that looks so {a}.",
    "Later that week a {a} {n} tried to {v} the old {n2}.",
    "Nobody remembers why the {n} refused to {v} the {a} {n2}.",
)


@dataclass
class Probe:
    """One prompt: chat messages, the strings a correct answer contains, its task and length bucket.

    ``answer_prefix`` starts the assistant turn (RULER's answer prefix), ``max_new_tokens`` is the task's
    generation budget (None: the evaluation's default), ``haystack`` names the text the facts hide in.
    """

    messages: list[dict[str, str]]
    expected: list[str]
    kind: str
    length: int
    answer_prefix: str = ""
    max_new_tokens: int | None = None
    haystack: str = ""
    index: int = 0


def correct(answer: str, expected: Sequence[str]) -> bool:
    """RULER's string match, all or nothing: every expected string occurs in the answer (case ignored)."""
    text = answer.lower()
    return all(e.lower() in text for e in expected)


# ----------------------------------------------------------------------------------------------- vocabulary


_WORD_FILES = {"noun": "nounlist.txt", "adjective": "adjectivelist.txt", "verb": "verblist.txt"}


@functools.cache
def vocabulary(part: str) -> tuple[str, ...]:
    """wonderwords' ``noun`` / ``adjective`` / ``verb`` list: lower-case, 4-9 letters, no profanity, and
    none of the training data's key words. (The package's word files are read directly: its
    ``RandomWord`` builds search tries, seconds per list, that nothing here needs.)"""
    from importlib.resources import files

    from ..data.haystack import _WORDS

    assets = files("wonderwords.assets")
    banned = set(_WORDS) | set(assets.joinpath("profanitylist.txt").read_text().split())
    words = assets.joinpath(_WORD_FILES[part]).read_text().split()
    return tuple(sorted({w for w in words if w.isalpha() and w.islower() and 4 <= len(w) <= 9 and w not in banned}))


def eval_keys() -> set[str]:
    """Every word a key of this suite can contain (the nouns and adjectives of ``adjective-noun`` keys)."""
    return set(vocabulary("noun")) | set(vocabulary("adjective"))


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(vocabulary('adjective'))}-{rng.choice(vocabulary('noun'))}"
        if key not in taken:
            taken.add(key)
            return key


def _number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


# ------------------------------------------------------------------------------------------------ haystacks


def haystack_sentences() -> list[str]:
    """Paragraphs of standard-library docstrings: English prose that training never sees."""
    import importlib
    import inspect

    modules = (
        "collections", "functools", "itertools", "json", "argparse", "logging", "subprocess", "threading",
        "unittest", "csv", "textwrap", "inspect", "typing", "pathlib", "random", "statistics", "decimal",
        "fractions", "datetime", "calendar", "heapq", "bisect", "shutil", "tempfile", "zipfile", "tarfile",
        "sqlite3", "socket", "selectors", "asyncio", "contextlib", "dataclasses", "enum", "string", "difflib",
    )
    seen, sentences = set(), []
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
        for obj in objs:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            for para in (doc or "").split("\n\n"):
                line = " ".join(para.split())
                if len(line) < 40 or ">>>" in line or line in seen or not line[0].isalpha():
                    continue
                seen.add(line)
                sentences.append(line)
    return sentences


@functools.cache
def training_sentences() -> frozenset[str]:
    """Every sentence of the training haystacks (``essay`` and ``noise``), split as training splits them."""
    from ..data.haystack import _SENTENCE_END, haystack_text

    out: set[str] = set()
    for name in ("essay", "noise"):
        out.update(s for s in _SENTENCE_END.split(" ".join(haystack_text(name).split())) if s)
    return frozenset(out)


def _split(text: str) -> list[str]:
    from ..data.haystack import _SENTENCE_END

    return [s for s in _SENTENCE_END.split(" ".join(text.split())) if s]


@functools.cache
def haystack(name: str) -> tuple[str, ...]:
    """The sentences of an evaluation haystack: ``docs``, ``words`` or ``filler``; training's are removed."""
    if name == "docs":
        sentences = [s for para in haystack_sentences() for s in _split(para) if 20 <= len(s) <= 400]
    elif name == "words":
        rng = random.Random("leank-ruler-words")
        nouns, adjs, verbs = vocabulary("noun"), vocabulary("adjective"), vocabulary("verb")
        sentences = [rng.choice(_FRAMES).format(n=rng.choice(nouns), n2=rng.choice(nouns), a=rng.choice(adjs),
                                                v=rng.choice(verbs)) for _ in range(3000)]
    elif name == "filler":
        sentences = _split(FILLER)
    else:
        raise ValueError(f"unknown haystack {name!r}; choose from docs, words, filler")
    banned = training_sentences()
    return tuple(s for s in sentences if s not in banned)


class Builder:
    """Token counting and haystack filling for one tokenizer (sentence token counts are cached)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._counts: dict[str, list[int]] = {}

    def prompt_tokens(self, user: str, prefix: str) -> int:
        return len(self.prompt_ids(user, prefix))

    def prompt_ids(self, user: str, prefix: str) -> list[int]:
        return chat_ids(self.tokenizer, [{"role": "user", "content": user}], prefix)

    def fill(self, name: str, budget: int, rng: random.Random) -> tuple[list[str], list[int]]:
        """Consecutive sentences of haystack ``name`` from a random start, a little over ``budget`` tokens,
        and their token counts (counted alone; :meth:`fit` trims the joined prompt to the limit)."""
        sentences = haystack(name)
        if name not in self._counts:
            self._counts[name] = [len(i) for i in self.tokenizer(list(sentences), add_special_tokens=False)["input_ids"]]
        counts = self._counts[name]
        start, picked, sizes, used = rng.randrange(len(sentences)), [], [], 0
        while used < budget * 1.02:
            i = (start + len(picked)) % len(sentences)
            picked.append(sentences[i])
            sizes.append(counts[i])
            used += counts[i]
        return picked, sizes

    def fit(self, parts: list[str], sizes: list[int | None], render, limit: int) -> str:
        """Drop parts with a size (haystack sentences, from the end) until ``render(parts)`` is within
        ``limit`` prompt tokens; parts of size None (needles) stay."""
        while True:
            user, prefix = render(parts)
            excess = self.prompt_tokens(user, prefix) - limit
            removable = [i for i, n in enumerate(sizes) if n is not None]
            if excess <= 0 or not removable:
                return user
            while excess > 0 and removable:
                i = removable.pop()
                excess -= sizes[i] or 1
                del parts[i], sizes[i]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], answer_prefix: str = "") -> list[int]:
    """Token ids of a chat prompt; with an answer prefix the assistant turn starts with it."""
    if answer_prefix:
        messages = [*messages, {"role": "assistant", "content": answer_prefix}]
        return tokenizer.apply_chat_template(messages, continue_final_message=True, return_dict=True)["input_ids"]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


def _probe(task: Task, b: Builder, length: int, rng: random.Random, hay: str, index: int, intro: str,
           needles: list[str], question: str, prefix: str, expected: list[str]) -> Probe:
    """Needles at random depths of haystack ``hay``, prompt + generation budget within ``length`` tokens."""
    limit = length - task.max_new_tokens
    frame = f"{intro}\n\n{' '.join(needles)}\n\n{question}"
    budget = limit - b.prompt_tokens(frame, prefix)
    if budget < 0:
        raise RecipeError(f"length {length} is too short for task {task.name!r}: its prompt alone needs "
                         f"{limit - budget + task.max_new_tokens} tokens")
    parts, sizes = b.fill(hay, budget, rng)
    slots = sorted(rng.randint(0, len(parts)) for _ in needles)
    for offset, (slot, needle) in enumerate(zip(slots, needles, strict=True)):
        parts.insert(slot + offset, needle)
        sizes.insert(slot + offset, None)
    user = b.fit(parts, sizes, lambda ps: (f"{intro}\n\n{' '.join(ps)}\n\n{question}", prefix), limit)
    return Probe([{"role": "user", "content": user}], expected, task.name, length, prefix, task.max_new_tokens,
                 hay, index)


# -------------------------------------------------------------------------------------------------- tasks


class Task:
    """One task of the suite: a name, the haystacks its probes rotate through, a generation budget."""

    name = ""
    haystacks: tuple[str, ...] = ("docs", "words")
    max_new_tokens = 24

    def make(self, b: Builder, length: int, rng: random.Random, hay: str, index: int) -> Probe:
        raise NotImplementedError


_INTRO = "Read the long text below carefully. A few facts are tucked into it and you will need them afterwards."
_FACTS = {  # value kind -> (needle, question, answer prefix)
    "number": ("The locker combination of the {key} is {value}.", "What is the locker combination of the {key}?",
               "The locker combination of the {key} is"),
    "word": ("The password picked by the {key} is {value}.", "Which password did the {key} pick?",
             "The password picked by the {key} is"),
    "uuid": ("The serial code stamped on the {key} is {value}.", "What serial code is stamped on the {key}?",
             "The serial code stamped on the {key} is"),
}


def _value(kind: str, rng: random.Random, taken: set[str]) -> str:
    if kind == "number":
        return _number(rng)
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    while (word := rng.choice(vocabulary("noun"))) in taken:
        pass
    taken.add(word)
    return word


class NeedleSingle(Task):
    """RULER S-NIAH: one needle (key -> number, word or UUID) in a haystack; asked for its value."""

    haystacks = ("filler", "docs", "words")

    def __init__(self, value: str) -> None:
        self.value, self.name = value, f"niah_single_{value}"
        # SmolLM2 spells a UUID in ~36 tokens: 32 cut every answer short (measured on the embedded model)
        self.max_new_tokens = 56 if value == "uuid" else 16

    def make(self, b, length, rng, hay, index):
        needle, question, prefix = _FACTS[self.value]
        taken: set[str] = set()
        key = _key(rng, taken)
        value = _value(self.value, rng, taken)
        return _probe(self, b, length, rng, hay, index, _INTRO, [needle.format(key=key, value=value)],
                      question.format(key=key), prefix.format(key=key), [value])


class NeedleMultiKey(Task):
    """RULER MK-NIAH: the needle among ``distractors`` needles of other keys; asked for one key's value."""

    name = "niah_multikey"
    max_new_tokens = 16

    # 1 distractor: the embedded 135M model answers 7/8 at 1k (3 distractors: 6/8), development seed 7
    # (benchmarks/task_difficulty.py; docs/evaluation.md, "Dev and report seeds")
    def __init__(self, distractors: int = 1) -> None:
        self.distractors = distractors

    def make(self, b, length, rng, hay, index):
        needle, question, prefix = _FACTS["number"]
        taken: set[str] = set()
        keys = [_key(rng, taken) for _ in range(self.distractors + 1)]
        needles = [needle.format(key=k, value=_number(rng)) for k in keys]
        value = needles[0].rsplit(" ", 1)[1].rstrip(".")
        rng.shuffle(needles)
        return _probe(self, b, length, rng, hay, index, _INTRO, needles, question.format(key=keys[0]),
                      prefix.format(key=keys[0]), [value])


class NeedleMultiValue(Task):
    """RULER MV-NIAH: one key with ``values`` values in separate needles; all of them are asked."""

    name = "niah_multivalue"
    max_new_tokens = 48

    def __init__(self, values: int = 4) -> None:
        self.values = values

    def make(self, b, length, rng, hay, index):
        key = _key(rng, set())
        values = [_number(rng) for _ in range(self.values)]
        needles = [f"One locker combination of the {key} is {v}." for v in values]
        return _probe(self, b, length, rng, hay, index, _INTRO, needles,
                      f"What are all the locker combinations of the {key}? List every one.",
                      f"The locker combinations of the {key} are", values)


class NeedleMultiQuery(Task):
    """RULER MQ-NIAH: ``needles`` needles of different keys; ``queries`` of them are asked at once."""

    name = "niah_multiquery"
    max_new_tokens = 40

    def __init__(self, needles: int = 4, queries: int = 2) -> None:
        self.needles, self.queries = needles, queries

    def make(self, b, length, rng, hay, index):
        needle = _FACTS["number"][0]
        taken: set[str] = set()
        keys = [_key(rng, taken) for _ in range(self.needles)]
        values = [_number(rng) for _ in keys]
        needles = [needle.format(key=k, value=v) for k, v in zip(keys, values, strict=True)]
        asked = rng.sample(range(self.needles), self.queries)
        names = " and of the ".join(keys[i] for i in asked)
        return _probe(self, b, length, rng, hay, index, _INTRO, needles,
                      f"What are the locker combinations of the {names}?",
                      "The locker combinations are", [values[i] for i in asked])


class VariableTracking(Task):
    """RULER VT: a chain of ``hops`` assignments ``NAME = value`` / ``NAME2 = NAME`` in the haystack;
    asked for every name that ends up holding the value."""

    name = "variable_tracking"
    haystacks = ("filler", "docs")
    max_new_tokens = 48

    def __init__(self, hops: int = 3) -> None:
        self.hops = hops

    def make(self, b, length, rng, hay, index):
        names: list[str] = []
        while len(names) < self.hops + 1:
            name = "".join(rng.choices(string.ascii_uppercase, k=5))
            if name not in names:
                names.append(name)
        value = _number(rng, 5)
        chain = [f"let {names[0]} = {value}."] + [f"let {names[i]} = {names[i - 1]}." for i in range(1, len(names))]
        intro = ("The text below hides a few assignments written as 'let NAME = value'. Follow each assignment "
                 "as you read.")
        # needles keep their order (sorted slots), so each assignment comes after the one it reads
        return _probe(self, b, length, rng, hay, index, intro, chain,
                      f"Which names end up holding the value {value}? List every one of them.",
                      f"The names holding the value {value} are", names)


class _WordList(Task):
    """Shared by the two extraction tasks: a word list sized to the length by a few count-and-scale rounds."""

    haystacks = ("nouns", "coded")

    def pool(self, hay: str, rng: random.Random, n: int) -> list[str]:
        if hay == "nouns":
            return rng.sample(vocabulary("noun"), n)
        words: set[str] = set()  # "coded" words: pronounceable nonsense, never dictionary words
        while len(words) < n:
            words.add("".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 3))))
        out = sorted(words)
        rng.shuffle(out)
        return out

    def sized(self, b: Builder, length: int, render, words_for) -> tuple[str, str]:
        """Grow the word count until the prompt fills ``length`` minus the generation budget."""
        limit = length - self.max_new_tokens
        n, best = 32, None
        for _ in range(8):
            user, prefix = render(words_for(n))
            tokens = b.prompt_tokens(user, prefix)
            if tokens <= limit:
                best = (user, prefix)
            if abs(limit - tokens) < 0.02 * limit and tokens <= limit:
                break
            n = max(8, int(n * limit / max(tokens, 1) * (0.99 if tokens > limit else 1.0)))
        if best is None:
            raise RecipeError(f"length {length} is too short for task {self.name!r}: give a longer length")
        return best


class CommonWords(_WordList):
    """RULER CWE: a numbered word list where ``top`` words repeat often and the rest rarely; asked for the
    ``top`` most common words."""

    name = "common_words"

    def __init__(self, top: int = 5) -> None:
        self.top = top
        self.max_new_tokens = 6 * top + 8

    def make(self, b, length, rng, hay, index):
        pool = self.pool(hay, rng, min(4000, len(vocabulary("noun"))))
        common, rare = pool[: self.top], pool[self.top:]
        seed = rng.random()

        def words_for(n: int) -> list[str]:
            r = random.Random(seed)
            freq_common = max(3, min(30, n // (3 * self.top)))  # RULER: 30 times each at long lengths
            freq_rare = max(1, min(3, freq_common // 3))
            # past what the pool can fill (very long lengths), rare words repeat more, common ones 3x that
            freq_rare = max(freq_rare, math.ceil((n - self.top * freq_common) / len(rare)))
            freq_common = max(freq_common, 3 * freq_rare)
            words = [w for w in common for _ in range(freq_common)]
            words += [w for w in rare[: max(1, (n - len(words)) // freq_rare)] for _ in range(freq_rare)]
            r.shuffle(words)
            return words

        def render(words):
            listing = " ".join(f"{i}. {w}" for i, w in enumerate(words, 1))
            return (f"Here is a numbered list of words; a few of them come up again and again.\n\n{listing}\n\n"
                    f"Which {self.top} words come up most often in the list?",
                    f"The {self.top} words that come up most often are")

        user, prefix = self.sized(b, length, render, words_for)
        return Probe([{"role": "user", "content": user}], list(common), self.name, length, prefix,
                     self.max_new_tokens, hay, index)


class FrequentWords(_WordList):
    """RULER FWE: words drawn from a Zipf distribution (exponent ``alpha``); asked for the 3 most frequent."""

    name = "frequent_words"
    max_new_tokens = 24

    def __init__(self, alpha: float = 2.0) -> None:
        self.alpha = alpha

    def make(self, b, length, rng, hay, index):
        pool = self.pool(hay, rng, 400)
        seed = rng.random()

        def words_for(n: int) -> list[str]:
            weights = [1 / (r + 1) ** self.alpha for r in range(len(pool))]
            total = sum(weights)
            counts = [int(n * w / total) for w in weights]
            words = [w for w, c in zip(pool, counts, strict=True) for _ in range(c)]
            random.Random(seed).shuffle(words)
            return words

        def render(words):
            return (f"Below is a text of coded words. Keep count of how often each word appears.\n\n"
                    f"{' '.join(words)}\n\nWhich three words appear most often in the text above?",
                    "The three words that appear most often are")

        user, prefix = self.sized(b, length, render, words_for)
        return Probe([{"role": "user", "content": user}], pool[:3], self.name, length, prefix,
                     self.max_new_tokens, hay, index)


class Passkey(Task):
    """The passkey task (Mohtashami & Jaggi, 2023) that RULER extends: a number in repeated filler."""

    name = "passkey"
    haystacks = ("filler", "words")
    max_new_tokens = 12

    def make(self, b, length, rng, hay, index):
        value = _number(rng, 5)
        intro = ("A door code is hidden somewhere in the long text below. Find it and keep it in mind; "
                 "you will be asked for it at the end.")
        return _probe(self, b, length, rng, hay, index, intro,
                      [f"The door code is {value}. Keep the door code {value} in mind."],
                      "What is the door code?", "The door code is", [value])


TASKS: dict[str, Task] = {t.name: t for t in (
    NeedleSingle("number"), NeedleSingle("word"), NeedleSingle("uuid"), NeedleMultiKey(), NeedleMultiValue(),
    NeedleMultiQuery(), VariableTracking(), CommonWords(), FrequentWords(), Passkey(),
)}


def task_variant(spec: str) -> str:
    """Register the variant ``spec`` of a suite task in :data:`TASKS` and return its name there.

    ``spec`` is ``name`` (the task itself) or ``name:param=value,...``: a copy of the task with those
    attributes set, registered as ``name[param=value,...]`` (``niah_multikey:distractors=0``,
    ``passkey:haystacks=filler``; a tuple such as ``haystacks`` takes names joined by ``+``:
    ``haystacks=filler+docs``). ``benchmarks/task_difficulty.py`` tunes tasks with it on a development seed,
    ``benchmarks/eval_masks.py --tasks`` answers them with the masks (issue #34: the tasks the full model
    passes at 4k and 8k).
    """
    name, _, params = spec.partition(":")
    if name not in TASKS:
        raise RecipeError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    if not params:
        return name
    task = copy.copy(TASKS[name])
    for item in params.split(","):
        key, _, value = item.partition("=")
        if not hasattr(task, key) or key == "name":
            raise RecipeError(f"task {name!r} has no parameter {key!r}")
        old = getattr(task, key)
        if isinstance(old, tuple):
            new = tuple(value.split("+"))
            if key == "haystacks":
                for hay in new:  # an unknown haystack fails here, not at the first probe that uses it
                    if hay not in ("nouns", "coded"):
                        haystack(hay)
        else:
            new = type(old)(value)
        setattr(task, key, new)
    if hasattr(task, "top"):  # common words: the generation budget follows the word count
        task.max_new_tokens = 6 * task.top + 8
    task.name = f"{name}[{params}]"
    TASKS[task.name] = task
    return task.name


def build_probes(tokenizer: Any, tasks: Sequence[str], lengths: Sequence[int], samples: int,
                 seed: int = 1234) -> list[Probe]:
    """``samples`` probes per (task, length); probe ``i`` uses haystack ``i mod len(task.haystacks)``."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise RecipeError(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    b = Builder(tokenizer)
    probes = []
    for length in lengths:
        for name in tasks:
            task = TASKS[name]
            for i in range(samples):
                rng = random.Random(f"leank-ruler:{seed}:{name}:{length}:{i}")
                probes.append(task.make(b, length, rng, task.haystacks[i % len(task.haystacks)], i))
    return probes
