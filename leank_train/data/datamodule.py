"""Synthetic long-context retrieval data (RULER-style needles in a haystack) as a LightningDataModule.

Each sample is a chat prompt whose user turn hides needles in a haystack and asks for one of them;
the label is the one-sentence answer after the assistant turn start. Templates and haystacks are
parameters, so evaluation can use wordings and texts that training never saw. Samples are a pure
function of ``(seed, index)``: the same seed gives the same data on every machine.

Haystacks: ``"noise"`` (a repeated filler paragraph), ``"essay"`` (English prose shipping with
Python, ``pydoc_data.topics``; no download), a local text file or folder of ``*.txt``, or any
Hub dataset id with a ``text`` column (``datasets.load_dataset``, the user's network).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import uuid
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from datasets import Dataset
from torch.utils.data import DataLoader, DistributedSampler

from ..errors import RecipeError

# ResumableSampler resumes mid-epoch at the right sample (tests/test_faults.py checks it step by step);
# Lightning cannot see that from a plain DataLoader and warns on every mid-epoch resume.
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_WORDS = (
    "amber anchor apple arrow autumn badger bamboo beacon birch blossom breeze candle canyon cedar cherry "
    "cobalt comet copper coral cricket crystal daisy dawn delta desert dolphin dragon eagle ember falcon "
    "fern fjord forest garnet glacier granite harbor hazel heron island ivory jasmine juniper lagoon lantern "
    "lemon lilac lotus maple marble meadow mercury meteor mint nebula nectar oasis ocean olive onyx orchid "
    "otter panda pearl pepper pine planet plum prairie quartz raven reef river robin saffron sapphire "
    "shadow silver spruce summit swan thistle thunder tiger topaz tulip valley velvet violet walnut willow"
).split()
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")


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


def essay_text() -> str:
    """English prose from the Python docs shipped with CPython (``pydoc_data.topics``), code blocks dropped."""
    from pydoc_data.topics import topics

    paragraphs = []
    for text in topics.values():
        for para in re.split(r"\n\s*\n", text):
            lines = para.splitlines()
            if not lines or any(line.startswith((" ", "\t")) for line in lines):
                continue  # indented: code, grammar or a table
            joined = " ".join(line.strip() for line in lines)
            letters = sum(c.isalpha() or c == " " for c in joined)
            if len(joined) > 80 and letters / len(joined) > 0.85 and joined.endswith("."):
                paragraphs.append(joined)
    return " ".join(paragraphs)


def haystack_text(spec: str, max_chars: int = 2_000_000) -> str:
    """The text of a haystack named by ``spec`` ("noise", "essay", a local path, or a Hub dataset id)."""
    if spec == "noise":
        return " ".join([NOISE] * 50)
    if spec == "essay":
        return essay_text()
    path = Path(spec).expanduser()
    if path.exists():
        files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
        if not files:
            raise RecipeError(f"haystack folder {path} holds no *.txt file")
        return " ".join(f.read_text(errors="replace") for f in files)[:max_chars]
    if _looks_like_path(spec):
        raise RecipeError(f"haystack {spec!r}: no such file or folder (data.haystacks)")
    from datasets import load_dataset

    try:
        ds = load_dataset(spec, split="train", streaming=True)
    except Exception as e:  # noqa: BLE001 - the Hub/network/format errors of `datasets` are many
        raise RecipeError(
            f"haystack {spec!r} is not a local file or folder, and loading it as a Hub dataset failed: "
            f"{type(e).__name__}: {e}"
        ) from None
    parts, size = [], 0
    for row in ds:
        text = row.get("text")
        if not isinstance(text, str):
            raise ValueError(f"haystack dataset {spec!r} has no string column 'text'")
        parts.append(text)
        size += len(text)
        if size >= max_chars:
            break
    return " ".join(parts)[:max_chars]


def _looks_like_path(spec: str) -> bool:
    """Whether a haystack name can only mean a local path (a Hub id is ``name`` or ``owner/name``)."""
    return (
        spec.startswith(("/", ".", "~", "\\"))
        or spec.count("/") > 1
        or Path(spec).suffix.lower() in (".txt", ".md", ".json", ".jsonl", ".csv", ".parquet")
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


def load_tokenizer(base_model: str, revision: str | None = None, loader: dict[str, Any] | None = None) -> Any:
    """The base model's tokenizer, resolved like the model (the embedded one works offline)."""
    from transformers import AutoTokenizer

    from leank_infer.model.loading import resolve_base_model

    source, extra = resolve_base_model(base_model, loader)
    kwargs = {**extra, "trust_remote_code": False}  # a repo's own Python never runs (and never prompts)
    if revision is not None and not Path(source).is_dir():
        kwargs["revision"] = revision
    return AutoTokenizer.from_pretrained(source, **kwargs)


def model_max_positions(base_model: str, revision: str | None = None, loader: dict[str, Any] | None = None) -> int | None:
    """The base model's ``max_position_embeddings`` from its config alone (no weights), None if it has none."""
    from transformers import AutoConfig

    from leank_infer.model.loading import resolve_base_model

    source, extra = resolve_base_model(base_model, loader)
    kwargs = {**extra, "trust_remote_code": False}  # a repo's own Python never runs (and never prompts)
    if revision is not None and not Path(source).is_dir():
        kwargs["revision"] = revision
    config = AutoConfig.from_pretrained(source, **kwargs)
    value = getattr(config.get_text_config(), "max_position_embeddings", None)
    return int(value) if value else None


class ResumableSampler(DistributedSampler):
    """Indices in order, this data-parallel rank's share; the first pass starts at ``start``.

    Rank ``r`` of ``world`` gets samples ``r, r + world, ...`` (padded from the start to equal shares, as
    ``DistributedSampler`` does, but never shuffled: Lightning would inject a shuffled one for training),
    so ``world`` processes x batch 1 see exactly what one process x batch ``world`` sees. Lightning
    restores the loop's progress but restarts a plain DataLoader at its first batch; skipping ``start``
    samples on the first pass makes a resumed run see the same sample at every step as an
    uninterrupted one. Later passes (epochs) start at 0. It is a ``DistributedSampler`` so that Lightning
    keeps it instead of wrapping it in a shuffled one.
    """

    def __init__(self, n: int, start: int = 0, rank: int = 0, world: int = 1) -> None:
        super().__init__(range(n), num_replicas=world, rank=rank, shuffle=False)
        indices = list(range(n))
        if world > 1 and n:
            indices += indices[: (-n) % world]
        self.indices, self.start = indices[rank::world], start

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self):
        start, self.start = self.start, 0
        return iter(self.indices[start:])


class NeedleDataModule(L.LightningDataModule):
    """Needle-in-a-haystack retrieval prompts, one variable-length sequence per batch."""

    def __init__(
        self,
        base_model: str = "embedded",
        revision: str | None = None,
        loader: dict[str, Any] | None = None,
        haystacks: list[str] | None = None,
        templates: list[NeedleTemplate] | None = None,
        min_length: int = 500,
        max_length: int = 2000,
        length_intervals: int = 15,
        num_samples: int = 256,
        seed: int = 0,
        num_workers: int = 0,
        batch_size: int = 1,
        chat: bool | None = None,
    ) -> None:
        """
        Args:
            base_model: whose tokenizer and chat template to use (linked to ``model.base_model`` by the CLI).
            revision: base model revision. loader: loader hints (e.g. the embedded GGUF).
            haystacks: "noise", "essay", local text paths or Hub dataset ids; a sample draws one.
            templates: task wordings; default: multi-key UUIDs and multi-value numbers.
            min_length: shortest prompt, in tokens. max_length: longest prompt, in tokens.
            length_intervals: lengths are drawn from this many even steps between min and max.
            num_samples: samples per epoch (Lightning cycles epochs until ``max_steps``).
            seed: the data seed; same seed, same samples.
            num_workers: DataLoader workers.
            batch_size: samples per step and process (padded by ``collate_needles``; the module loops
                over them). The order is fixed: see ``train_dataloader``.
            chat: True: prompts in the tokenizer's chat template (an error if it has none); False: plain
                "question / Answer:" prompts; None: the chat template when the tokenizer has one.
        """
        super().__init__()
        self.save_hyperparameters(ignore=["templates"])
        self.base_model, self.revision, self.loader = base_model, revision, loader
        self.haystack_names = list(haystacks or ["essay", "noise"])
        self.templates = list(templates or DEFAULT_TEMPLATES)
        self.lengths = length_grid(min_length, max_length, length_intervals)
        self.num_samples = num_samples
        self.seed = seed
        self.num_workers = num_workers
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.chat = chat
        self.tokenizer: Any = None
        self.train_set: Dataset | None = None

    def build_dataset(self, num_samples: int | None = None, seed: int | None = None) -> Dataset:
        """The tokenised samples as a ``datasets.Dataset`` (columns input_ids, labels, context_len, ...)."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.base_model, self.revision, self.loader)
        texts = {name: haystack_text(name) for name in self.haystack_names}
        seed = self.seed if seed is None else seed
        n = self.num_samples if num_samples is None else num_samples
        sampler = NeedleSampler(self.tokenizer, texts, self.templates, self.lengths, seed, chat=self.chat)
        fingerprint = hashlib.sha1(
            json.dumps(
                [seed, n, self.lengths, self.haystack_names, [asdict(t) for t in self.templates],
                 getattr(self.tokenizer, "name_or_path", ""), sampler.chat],
                sort_keys=True,
            ).encode()
        ).hexdigest()
        index = Dataset.from_dict({"index": list(range(n))})
        return index.map(
            lambda row: sampler.sample(row["index"]),
            remove_columns=["index"],
            new_fingerprint=f"leank-needles-{fingerprint}",
            desc="needle prompts",
        )

    def check_inputs(self) -> None:
        """Refuse, before anything is built or written, a tokenizer or lengths that cannot work (one clear message).

        Haystack paths are checked as they are read (``haystack_text``), still before anything is written.
        """
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.base_model, self.revision, self.loader)
        if self.chat and not getattr(self.tokenizer, "chat_template", None):
            raise RecipeError(
                f"data.chat is true but the tokenizer of {self.base_model!r} has no chat template: "
                "give a base model whose tokenizer has one, or set data.chat: false for plain prompts"
            )
        limit = model_max_positions(self.base_model, self.revision, self.loader)
        if limit is not None and max(self.lengths) > limit:
            raise RecipeError(
                f"data.max_length={max(self.lengths)} is larger than the {limit} positions of {self.base_model!r} "
                f"(max_position_embeddings): lower data.max_length (and data.min_length) to at most {limit}"
            )

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.check_inputs()
            self.train_set = self.build_dataset()
            self.train_set.set_format("torch", columns=["input_ids", "labels", "context_len"])

    def train_dataloader(self) -> DataLoader:
        """Samples in index order. Distributed, our own ``DistributedSampler(shuffle=False)`` over the
        strategy's ``distributed_sampler_kwargs``: Lightning would inject a *shuffled* one for training
        (it always passes ``shuffle=True`` there). Unshuffled, data-parallel rank r of W gets the samples
        r, r + W, ..., so W processes x batch 1 see exactly what one process x batch W sees (samples
        are i.i.d. draws of ``(seed, index)``: shuffling would add nothing). Sequence-parallel ranks
        of one group share a data-parallel rank, hence their sample."""
        assert self.train_set is not None, "call setup() first"
        trainer = self.trainer
        kwargs = (trainer.distributed_sampler_kwargs if trainer is not None else None) or {}
        sampler = ResumableSampler(
            len(self.train_set), 0, rank=kwargs.get("rank", 0), world=kwargs.get("num_replicas", 1)
        )
        sampler.start = self._resume_offset(len(sampler)) * self.batch_size
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=collate_needles,
        )

    def _resume_offset(self, per_process: int) -> int:
        """Batches of the current epoch already trained on (non-zero only when resuming from a checkpoint)."""
        trainer = self.trainer
        if trainer is None or per_process == 0:
            return 0
        # restored from the checkpoint before the dataloader is built; `processed` counts the step whose
        # on_train_batch_end saved the checkpoint (`completed` is bumped only after that hook)
        batches = math.ceil(per_process / self.batch_size)
        return trainer.fit_loop.epoch_loop.batch_progress.current.processed % batches


def collate_needles(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pad samples of different lengths to one batch: ``input_ids`` (pad 0), ``labels`` (pad -100),
    ``context_len`` and ``length`` (true lengths; the module trims each sample back to it)."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.as_tensor(r["input_ids"])
        labels[i, :n] = torch.as_tensor(r["labels"])
    return {
        "input_ids": ids,
        "labels": labels,
        "context_len": torch.tensor([int(r["context_len"]) for r in rows]),
        "length": torch.tensor([len(r["input_ids"]) for r in rows]),
    }


def collate_check(batch: dict[str, torch.Tensor]) -> None:
    """Raise unless a batch is one sequence whose labels are exactly its tokens after ``context_len``."""
    ids, labels, ctx = batch["input_ids"], batch["labels"], int(batch["context_len"][0])
    if ids.shape[0] != 1 or labels.shape != ids.shape:
        raise ValueError("batches must hold one sequence (batch_size=1) with labels of the same shape")
    if (labels[0, :ctx] != -100).any() or not torch.equal(labels[0, ctx:], ids[0, ctx:]):
        raise ValueError("labels must be -100 on the context and equal the answer tokens after it")
