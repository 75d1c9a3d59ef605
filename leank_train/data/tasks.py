"""Needle tasks: their wordings (templates), the context-length grid, and one sample per ``(seed, index)``.

Each sample is a chat prompt whose user turn hides needles in a haystack and asks for one of them;
the label is the one-sentence answer after the assistant turn start. Samples are a pure function of
``(seed, index)``: the same seed gives the same data on every machine.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from .haystack import _SENTENCE_END, _WORDS


@dataclass
class NeedleTemplate:
    """The wording of one retrieval task; ``{key}``, ``{value}``, ``{values}`` and ``{noun}`` are filled in.

    ``kind="multikey"``: ``num_keys`` keys with one UUID each, one key is asked.
    ``kind="multivalue"``: one key with ``num_values`` 7-digit numbers, all of them are asked.
    """

    kind: Literal["multikey", "multivalue"] = "multikey"
    noun: str = "uuids"
    intro: str = (
        "Some special magic {noun} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {noun} afterwards."
    )
    needle: str = "One of the special magic {noun} for {key} is: {value}."
    question: str = "What is the special magic uuid for {key} mentioned in the provided text?"
    answer: str = "The special magic uuid for {key} mentioned in the provided text is {value}."
    num_keys: int = 4
    num_values: int = 1


DEFAULT_TEMPLATES: tuple[NeedleTemplate, ...] = (
    NeedleTemplate(),
    NeedleTemplate(
        kind="multivalue",
        noun="numbers",
        question="What are all the special magic numbers for {key} mentioned in the provided text?",
        answer="The special magic numbers for {key} mentioned in the provided text are {values}.",
        num_keys=1,
        num_values=4,
    ),
)


def length_grid(min_length: int, max_length: int, intervals: int) -> list[int]:
    """Context lengths (tokens) on an even grid from ``min_length`` to ``max_length``, as the reference samples."""
    if not 0 < min_length <= max_length:
        raise ValueError(f"need 0 < min_length <= max_length, got {min_length}, {max_length}")
    if intervals <= 0 or min_length == max_length:
        return [min_length]
    step = (max_length - min_length) / intervals
    return sorted({round(min_length + i * step) for i in range(intervals + 1)})


class NeedleSampler:
    """Builds one tokenised sample per ``(seed, index)``: haystack, template and length drawn from the index."""

    def __init__(
        self,
        tokenizer: Any,
        haystacks: dict[str, str],
        templates: list[NeedleTemplate],
        lengths: list[int],
        seed: int,
        chat: bool | None = None,
    ) -> None:
        """``chat``: True wraps prompts in the tokenizer's chat template, False never, None when it has one."""
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
        self.templates = templates
        self.lengths = lengths
        self.seed = seed
        self.haystacks = {}
        for name, text in haystacks.items():
            sentences = [s for s in _SENTENCE_END.split(" ".join(text.split())) if s]
            if not sentences:
                raise ValueError(f"haystack {name!r} is empty")
            counts = [len(ids) for ids in tokenizer(sentences, add_special_tokens=False)["input_ids"]]
            self.haystacks[name] = (sentences, counts)

    def _count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _prompt(self, user: str) -> str:
        if self.chat:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
            )
        return f"{user}\nAnswer: "

    def sample(self, index: int) -> dict[str, Any]:
        rng = random.Random(f"leank:{self.seed}:{index}")
        name = sorted(self.haystacks)[rng.randrange(len(self.haystacks))]
        sentences, counts = self.haystacks[name]
        tmpl = self.templates[rng.randrange(len(self.templates))]
        target = rng.choice(self.lengths)

        keys = rng.sample(_WORDS, max(1, tmpl.num_keys))
        key = keys[0]
        if tmpl.kind == "multikey":
            pairs = [(k, str(uuid.UUID(int=rng.getrandbits(128), version=4))) for k in keys]
            value = pairs[0][1]
        else:
            pairs = [(key, str(rng.randint(1_000_000, 9_999_999))) for _ in range(max(1, tmpl.num_values))]
            value = pairs[0][1]
        needles = [tmpl.needle.format(noun=tmpl.noun, key=k, value=v) for k, v in pairs]
        rng.shuffle(needles)
        values = ", ".join(v for _, v in pairs)
        question = tmpl.question.format(noun=tmpl.noun, key=key, value=value, values=values)
        answer = tmpl.answer.format(noun=tmpl.noun, key=key, value=value, values=values)
        intro = tmpl.intro.format(noun=tmpl.noun)

        overhead = self._count(self._prompt(f"{intro}\n\n\n\n{question}")) + sum(self._count(n) + 1 for n in needles)
        budget = max(0, target - overhead)
        start, picked, used = rng.randrange(len(sentences)), [], 0
        while used < budget:
            i = (start + len(picked)) % len(sentences)
            picked.append(sentences[i])
            used += counts[i] + 1
        slots = sorted(rng.randint(0, len(picked)) for _ in needles)
        for offset, (slot, needle) in enumerate(zip(slots, needles, strict=True)):
            picked.insert(slot + offset, needle)
        user = f"{intro}\n\n{' '.join(picked)}\n\n{question}"
        prompt_ids = self.tokenizer(self._prompt(user), add_special_tokens=False)["input_ids"]
        answer_ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
        return {
            "input_ids": prompt_ids + answer_ids,
            "labels": [-100] * len(prompt_ids) + answer_ids,
            "context_len": len(prompt_ids),
            "answer": answer,
            "haystack": name,
            "template": tmpl.kind,
        }
