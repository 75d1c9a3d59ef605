"""The older needle probes (``leank eval --kinds``): passkey, multi-key and multi-value needles in prose.

Kept for the figures made with them; the suite of :mod:`.tasks` is the default. No wording, haystack
sentence or key word is shared with the training data.
"""

from __future__ import annotations

import random
import string
from typing import Any

from .tasks import Probe

KINDS = ("passkey", "multikey", "multivalue")
_ANIMALS = "otter heron lynx badger falcon walrus ibis marmot gecko yak tapir okapi".split()


def make_probe(tokenizer: Any, kind: str, length: int, rng: random.Random, sentences: list[str]) -> Probe:
    """A needle prompt of about ``length`` tokens of ``kind`` (passkey / multikey / multivalue)."""
    if kind == "passkey":
        value = str(rng.randint(1_000_000, 9_999_999))
        needles = [f"The secret passcode for the vault is {value}. Keep it safe."]
        question = "What is the secret passcode for the vault? Reply with the number only."
        expected = [value]
    elif kind == "multikey":
        keys = [f"{rng.choice(_ANIMALS)}-{rng.randint(10, 99)}" for _ in range(4)]
        vals = ["".join(rng.choices(string.ascii_lowercase + string.digits, k=8)) for _ in keys]
        needles = [f"The access token of {k} is {v}." for k, v in zip(keys, vals, strict=True)]
        i = rng.randrange(len(keys))
        question = f"What is the access token of {keys[i]}? Reply with the token only."
        expected = [vals[i]]
    elif kind == "multivalue":
        animal = rng.choice(_ANIMALS)
        vals = [str(rng.randint(10_000, 99_999)) for _ in range(3)]
        needles = [f"A lucky number of the {animal} is {v}." for v in vals]
        question = f"List every lucky number of the {animal} mentioned in the text."
        expected = vals
    else:
        raise ValueError(f"unknown probe kind {kind!r}; choose from {', '.join(KINDS)}")
    intro = "Read the following documentation carefully. A few facts are hidden inside it."
    overhead = len(tokenizer.apply_chat_template(
        [{"role": "user", "content": intro + " ".join(needles) + question}], add_generation_prompt=True,
        return_dict=True)["input_ids"])
    budget = max(0, length - overhead)
    start = rng.randrange(len(sentences))
    hay: list[str] = []
    used = 0
    while used < budget:
        s = sentences[(start + len(hay)) % len(sentences)]
        used += len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
        hay.append(s)
    for needle in needles:  # depths spread over 10%..90% of the haystack
        hay.insert(int(len(hay) * rng.uniform(0.1, 0.9)), needle)
    content = f"{intro}\n\n{' '.join(hay)}\n\n{question}"
    return Probe([{"role": "user", "content": content}], expected, kind, length)
