"""The LightningDataModule: needle samples (``tasks``) over haystacks (``haystack``), tokenised with the
base model's tokenizer, sampled so that a resumed run continues at the right sample.

Templates and haystacks are parameters, so evaluation can use wordings and texts that training never saw.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from datasets import Dataset
from torch.utils.data import DataLoader, DistributedSampler

from ..errors import RecipeError
from .haystack import haystack_text
from .tasks import DEFAULT_TEMPLATES, NeedleSampler, NeedleTemplate, length_grid

# ResumableSampler resumes mid-epoch at the right sample (tests/test_faults.py checks it step by step);
# Lightning cannot see that from a plain DataLoader and warns on every mid-epoch resume.
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")


def _base_model_source(base_model: str, revision: str | None, loader: dict[str, Any] | None) -> tuple[str, dict]:
    """Where the base model's files are and the ``from_pretrained`` options, resolved like the model's."""
    from leank_infer.model.loading import resolve_base_model

    source, extra = resolve_base_model(base_model, loader)
    kwargs = {**extra, "trust_remote_code": False}  # a repo's own Python never runs (and never prompts)
    if revision is not None and not Path(source).is_dir():
        kwargs["revision"] = revision
    return source, kwargs


def load_tokenizer(base_model: str, revision: str | None = None, loader: dict[str, Any] | None = None) -> Any:
    """The base model's tokenizer, resolved like the model (the embedded one works offline)."""
    from transformers import AutoTokenizer

    source, kwargs = _base_model_source(base_model, revision, loader)
    return AutoTokenizer.from_pretrained(source, **kwargs)


def model_max_positions(base_model: str, revision: str | None = None, loader: dict[str, Any] | None = None) -> int | None:
    """The base model's ``max_position_embeddings`` from its config alone (no weights), None if it has none."""
    from transformers import AutoConfig

    from leank_infer.mask import model_positions

    source, kwargs = _base_model_source(base_model, revision, loader)
    return model_positions(AutoConfig.from_pretrained(source, **kwargs))


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
