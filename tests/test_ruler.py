"""The RULER-style suite (leank_train.evaluation.tasks): its probes do what each task defines, fit their length, and
share no wording, haystack sentence or key word with the training data (leank_train.data)."""

from __future__ import annotations

import re
import string
from collections import Counter

import pytest

from leank_train import data
from leank_train.data import haystack
from leank_train.evaluation import tasks as ruler
from leank_train.evaluation.tasks import TASKS, build_probes, chat_ids


def word_tokenizer():
    """A fast whitespace/punctuation word-level tokenizer with a chat template (counts words, not BPE)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    t.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")
    return t


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer()


@pytest.fixture(scope="module")
def probes(tok):
    return build_probes(tok, list(TASKS), [1024, 4096], 2, seed=7)


def _fragments(fmt: str) -> list[str]:
    """The fixed wording of a format string: the text between its {placeholders}, 3+ words long."""
    return [f.strip(" .?:") for f in re.split(r"\{[^}]*\}", fmt) if len(f.split()) >= 3]


def test_no_wording_haystack_or_key_shared_with_training(probes):
    """Training and evaluation cannot produce the same prompt: disjoint wordings, sentences and keys."""
    # key words: the suite's keys are adjective-noun pairs from wonderwords, minus training's key words
    assert ruler.eval_keys() and not ruler.eval_keys() & set(haystack._WORDS)
    # haystacks: no evaluation sentence is a sentence of training's essay or noise haystack
    training = ruler.training_sentences()
    assert len(training) > 1000
    for name in ("docs", "words", "filler"):
        sentences = set(ruler.haystack(name))
        assert len(sentences) >= 5 and not sentences & training, name
    # wordings: no fixed phrase of a training template occurs in any evaluation prompt, and vice versa
    train_phrases = {f for t in data.DEFAULT_TEMPLATES for fmt in (t.intro, t.needle, t.question, t.answer)
                     for f in _fragments(fmt)}
    assert "special magic" in " ".join(train_phrases)
    for p in probes:
        text = p.messages[0]["content"] + p.answer_prefix
        assert not [f for f in train_phrases if f in text], p.kind
        assert "special magic" not in text and data.NOISE.split(".")[0] not in text
        keys = set(re.findall(r"\b([a-z]+)-([a-z]+)\b", text))
        assert not {w for k in keys for w in k} & set(haystack._WORDS), p.kind
    eval_phrases = {f for fmt, q, a in ruler._FACTS.values() for f in _fragments(fmt) + _fragments(q)}
    training_text = " ".join(data.haystack_text(n) for n in ("essay", "noise"))
    assert eval_phrases and not [f for f in eval_phrases if f in training_text]


def test_every_probe_fits_its_length_and_fills_it(tok, probes):
    for p in probes:
        n = len(chat_ids(tok, p.messages, p.answer_prefix))
        assert n + p.max_new_tokens <= p.length, (p.kind, n)
        assert n + p.max_new_tokens >= 0.9 * p.length, (p.kind, n)  # the haystack fills the budget


def test_probes_are_a_function_of_seed_and_use_two_haystacks(tok, probes):
    again = build_probes(tok, ["niah_multikey", "common_words"], [4096], 2, seed=7)
    assert [p.messages for p in again] == [p.messages for p in probes
                                           if p.length == 4096 and p.kind in ("niah_multikey", "common_words")]
    other = build_probes(tok, ["niah_single_number"], [1024], 2, seed=8)
    assert [p.expected for p in other] != [p.expected for p in probes if p.kind == "niah_single_number"][:2]
    for name, task in TASKS.items():
        used = {p.haystack for p in probes if p.kind == name}
        assert len(task.haystacks) >= 2 and used == set(task.haystacks[:2]), name


def _by(probes, kind):
    return [p for p in probes if p.kind == kind]


def test_needle_tasks_hide_their_answers_and_their_distractors(probes):
    for p in probes:
        if p.kind.startswith(("niah", "passkey", "variable")):
            text = p.messages[0]["content"]
            assert all(e in text for e in p.expected) and not any(e in p.answer_prefix for e in p.expected)
    uuid = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
    assert all(uuid.fullmatch(p.expected[0]) for p in _by(probes, "niah_single_uuid"))
    assert all(p.expected[0].isdigit() and len(p.expected[0]) == 7 for p in _by(probes, "niah_single_number"))
    assert all(p.expected[0].isalpha() for p in _by(probes, "niah_single_word"))
    for p in _by(probes, "niah_multikey"):  # the asked needle and 1 distractor needle of another key
        assert p.messages[0]["content"].count("The locker combination of the ") == 2
    assert all(len(p.expected) == 4 for p in _by(probes, "niah_multivalue"))
    assert all(len(p.expected) == 2 for p in _by(probes, "niah_multiquery"))


def test_the_expected_value_is_the_one_in_the_asked_keys_needle(tok):
    """Issue #31 item 3: in every task with distractors, the answer is read from the asked key's own needle (a
    shuffle before the read would make 12 of 20 probes expect a distractor's number)."""
    import random

    b = ruler.Builder(tok)
    suite = build_probes(tok, ["niah_multikey", "niah_multiquery"], [1024], 20, seed=3)
    cases = [(p, 2 if p.kind == "niah_multikey" else 4) for p in suite]  # needles: the asked ones and distractors
    cases += [(ruler.NeedleMultiKey(distractors=3).make(b, 1024, random.Random(i), "docs", i), 4) for i in range(10)]
    for p, needles in cases:
        text, question = p.messages[0]["content"], p.messages[0]["content"].rsplit("\n\n", 1)[1]
        asked = re.findall(r"of the ([a-z]+-[a-z]+)", question)
        values = [re.search(rf"The locker combination of the {k} is (\d+)\.", text).group(1) for k in asked]
        assert asked and p.expected == values, (p.kind, asked, p.expected, values)
        assert text.count("The locker combination of the ") == needles
        assert text.startswith(ruler._INTRO)
        # the answer starts naming the asked key (not a distractor's); several keys: no key in the prefix
        assert p.answer_prefix == (f"The locker combination of the {asked[0]} is" if p.kind == "niah_multikey"
                                   else "The locker combinations are")
    for kind in ("niah_multikey", "niah_multiquery"):  # probe i of a (task, length) is numbered i
        assert [p.index for p in suite if p.kind == kind] == list(range(20))


def test_variable_tracking_chains_in_order(probes):
    for p in _by(probes, "variable_tracking"):
        text = p.messages[0]["content"]
        names = p.expected
        assert len(names) == 4 and all(len(n) == 5 and set(n) <= set(string.ascii_uppercase) for n in names)
        value = re.search(r"holding the value (\d+)", p.answer_prefix).group(1)
        pos = [text.index(f"let {names[0]} = {value}.")]
        pos += [text.index(f"let {names[i]} = {names[i - 1]}.") for i in range(1, 4)]
        assert pos == sorted(pos)


def test_extraction_tasks_ask_for_the_truly_most_frequent_words(probes):
    for p in _by(probes, "common_words"):
        words = re.findall(r"\d+\. ([a-z]+)", p.messages[0]["content"])
        counts = Counter(words).most_common()
        top = {w for w, _ in counts[:5]}
        assert top == set(p.expected) and counts[4][1] > counts[5][1]
    for p in _by(probes, "frequent_words"):
        body = p.messages[0]["content"].split("\n\n")[1]
        counts = Counter(body.split()).most_common()
        assert [w for w, _ in counts[:3]] == p.expected and counts[2][1] > counts[3][1]


def test_scoring_is_all_or_nothing_and_ignores_case():
    assert ruler.correct("The names are ABCDE, FGHIJ.", ["abcde", "FGHIJ"])
    assert not ruler.correct("The names are ABCDE.", ["ABCDE", "FGHIJ"])


def test_a_length_too_short_or_an_unknown_task_is_named(tok):
    from leank_train.errors import RecipeError

    with pytest.raises(RecipeError, match="too short for task 'niah_multivalue'"):
        build_probes(tok, ["niah_multivalue"], [60], 1)
    with pytest.raises(RecipeError, match="unknown task.*nope"):
        build_probes(tok, ["nope"], [1024], 1)


def test_a_task_variant_is_registered_under_its_own_name_and_checked(tok, monkeypatch):
    """Issue #34: variants (other haystacks, fewer distractors) answer as tasks of their own; the task they copy
    is unchanged; an unknown task, parameter or haystack is named before any probe is built."""
    from leank_train.errors import RecipeError

    monkeypatch.setattr(ruler, "TASKS", dict(TASKS))
    assert ruler.task_variant("passkey") == "passkey"
    name = ruler.task_variant("passkey:haystacks=filler")
    assert name == "passkey[haystacks=filler]" and ruler.TASKS["passkey"].haystacks == ("filler", "words")
    two = ruler.task_variant("niah_multikey:distractors=0,haystacks=filler+docs")
    assert (ruler.TASKS[two].distractors, ruler.TASKS[two].haystacks) == (0, ("filler", "docs"))
    assert ruler.TASKS["niah_multikey"].distractors == 1
    probes = build_probes(tok, [name, two], [1024], 4, seed=7)
    assert [p.haystack for p in probes] == ["filler"] * 4 + ["filler", "docs"] * 2
    assert {p.kind for p in probes} == {name, two}
    assert all(len(re.findall(r"The locker combination of the", p.messages[0]["content"])) == 1 for p in probes[4:])
    for spec, message in [("nope:x=1", "unknown task 'nope'"), ("passkey:depth=3", "no parameter 'depth'"),
                          ("passkey:haystacks=filler+moon", "unknown haystack 'moon'")]:
        with pytest.raises((RecipeError, ValueError), match=message):
            ruler.task_variant(spec)
