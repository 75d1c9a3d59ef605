"""The LightningModule that learns LeanK channel scalers by distillation (both stages).

A step (docs/rule.md, "The training step"): one no-grad forward of context + answer gives the
teacher's final hidden states on the answer and records the context's post-RoPE K/V
(``TeacherState``); the student runs only the answer tokens against those K/V with LeanK attention
(``leank_student``), K of middle keys scaled by alpha (stage 1) or by the binary mask with a
straight-through gradient (stage 2). Only ``[answer x context]`` scores exist. Scaling out
(DDP/FSDP, sequence parallelism, activation checkpointing): docs/scaling.md.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch import nn
from torchmetrics import MeanMetric

from leank_infer.decode.rule import DEFAULT_RULE
from leank_infer.mask import (
    ChannelMask,
    MaskError,
    binarize,
    check_config_overrides,
    dense_layers_of,
    model_shape,
)

from .. import sequence_parallel as sp
from ..errors import RecipeError
from ..heap import fix_mmap_threshold
from ..recipe_checks import student_rule_problem
from .finite import StopOnNonFinite
from .student_attention import ATTN_IMPLEMENTATION, STATE_KWARG, StudentState, TeacherState
from .student_attention import register as register_attention

# The frozen base model is in eval mode on purpose (no dropout); Lightning warns about it at fit start.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")


class BinaryMaskSTE(torch.autograd.Function):
    """Forward: the binary mask, exactly. Backward: the gradient goes to alpha unchanged."""

    @staticmethod
    def forward(ctx: Any, alpha: torch.Tensor, binary: torch.Tensor) -> torch.Tensor:
        return binary.to(alpha.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def binary_ste(
    alpha: torch.Tensor, ratio: float, align: int, min_kept: int = 0, dense_layers: Any = ()
) -> torch.Tensor:
    """LeanK's binarisation of ``alpha`` in the forward pass, identity gradient to ``alpha``."""
    binary = binarize(alpha.detach(), ratio, align, min_kept, dense_layers).to(alpha.device)
    return BinaryMaskSTE.apply(alpha, binary)


def load_scores(path: str | Path) -> torch.Tensor:
    """Stage-1 scalers from a mask folder (its ``scores``) or a safetensors file (tensor ``scores`` or ``alpha``).

    Only safetensors is read, never pickles.
    """
    from safetensors.torch import load_file

    p = Path(path)
    if p.is_dir():
        mask = ChannelMask.from_dir(p)
        if mask.scores is None:
            raise MaskError(f"{p} holds no 'scores' tensor to start stage 2 from")
        return mask.scores
    tensors = load_file(str(p))
    for name in ("scores", "alpha"):
        if name in tensors:
            return tensors[name].float()
    raise MaskError(f"{p} has neither a 'scores' nor an 'alpha' tensor")


def warmup_decay(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to the floor ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LeanKDistillation(L.LightningModule):
    """Trainable alpha ``[layers, kv_heads, head_dim]`` over a frozen causal LM, distilled against itself."""

    def __init__(
        self,
        base_model: str = "embedded",
        revision: str | None = None,
        loader: dict[str, Any] | None = None,
        adapter: str | None = None,
        adapter_revision: str | None = None,
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        stage: Literal[1, 2] = 1,
        init_scores: str | None = None,
        sink_size: int = 16,
        recent_size: int = 64,
        ratio: float = 0.7,
        align: int = 16,
        lr: float = 0.02,
        reg_weight: float = 0.06,
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        ratio_start: float | None = None,
        ratio_anneal_steps: int = 0,
        min_kept: int = 0,
        activation_checkpointing: bool = False,
        config_overrides: dict[str, Any] | None = None,
        student_rule: str = DEFAULT_RULE,
        accumu_size: int = 16,
    ) -> None:  # pragma: no mutate block (save_hyperparameters reads this frame: no mutmut trampoline)
        """
        Args:
            base_model: Hub id, local folder, or "embedded" (SmolLM2-135M-Instruct shipped on PyPI).
            revision: base model revision (commit, tag or branch) to pin.
            loader: loader hints forwarded to ``load_base_model`` (e.g. ``{"gguf_file": ...}``).
            adapter: a PEFT adapter (Hub id or folder, safetensors) applied to the base model and
                merged before training: the mask is learned on, and recorded for, the adapted model.
            adapter_revision: adapter revision to pin.
            dtype: dtype of the frozen model; alpha and the loss stay float32.
            stage: 1 = continuous alpha with L1; 2 = binary mask with a straight-through estimator.
            init_scores: start alpha from these scores (mask folder or safetensors); stage 2 needs it.
            sink_size: first tokens that keep all channels.
            recent_size: training recent window: the last tokens before each query keep all channels.
            ratio: fraction of K channels pruned by the binarisation (stage 2 forward, kept stats).
            align: per-head kept counts are multiples of this.
            lr: AdamW learning rate (weight decay 0).
            reg_weight: weight of mean(|alpha|) (stage 1; usually 0 in stage 2).
            warmup_steps: linear warmup steps.
            min_lr_ratio: cosine decay floor, as a fraction of ``lr``.
            ratio_start: stage 2 only: binarise at this ratio first and anneal linearly to ``ratio``
                over ``ratio_anneal_steps`` steps (higher ratios need the mask to get there gradually).
            ratio_anneal_steps: length of that anneal in optimizer steps (0: ``ratio`` from the start).
            min_kept: favour whole-head pruning: a head keeping fewer channels keeps none (see ``binarize``).
            activation_checkpointing: recompute each decoder layer of the student pass in the backward
                instead of keeping its activations (same gradients, less memory on long contexts).
            config_overrides: model config attributes set at load (e.g. ``rope_parameters`` for YaRN),
                forwarded to ``from_pretrained``.
            student_rule: the rule the mask is learned for, dense-prompt (the default): the prompt attends with
                every channel, each generated token by its position; or positional: every query, the prompt's
                too, by its position alone. Under dense-prompt (the paper's step) the student runs the answer
                tokens alone, against the context K/V of the dense teacher pass; under positional the whole
                sequence, prompt included, so the prompt's own pruned attention is part of what is distilled
                (a backward through the whole sequence: use ``activation_checkpointing`` on long prompts).
            accumu_size: ``positional`` only: the decode-time rounding of each query's recent window.
        """
        super().__init__()
        self.save_hyperparameters()
        self.strict_loading = False  # checkpoints hold alpha only, not the frozen model
        self.llm: nn.Module | None = None
        self.alpha: nn.Parameter | None = None
        self.dense_layers: tuple[int, ...] = ()  # sliding-window layers: left whole, alpha fixed at 1
        self.distill_loss = MeanMetric()
        self.reg_loss = MeanMetric()
        self.recent_distill: list[float] = []  # the last steps' losses: one step of batch 1 is noisy
        problem = student_rule_problem(student_rule)
        if problem:
            raise RecipeError(f"model.student_rule: {problem}")
        if stage == 2 and init_scores is None:
            raise RecipeError("stage 2 starts from stage-1 scores: set model.init_scores")
        if ratio_start is not None and not 0 <= ratio_start < 1:
            raise ValueError(f"ratio_start must be in [0, 1), got {ratio_start}")
        try:  # they go into the mask's config.json at export: refuse what it cannot hold before training
            check_config_overrides(config_overrides or {})
        except MaskError as e:
            raise RecipeError(f"model.{e}") from None
        if init_scores is not None and not Path(init_scores).exists():
            raise RecipeError(
                f"model.init_scores={init_scores} does not exist: stage 2 starts from the stage-1 mask folder "
                "(run stage 1 first; `leank run` chains both)"
            )

    # ---- model ---------------------------------------------------------------------------
    @classmethod
    def for_model(cls, model: nn.Module, **kwargs: Any) -> LeanKDistillation:
        """A module around an already loaded causal LM (tests, notebooks); ``kwargs`` as in ``__init__``."""
        module = cls(**kwargs)
        module._attach(model)
        return module

    def _attach(self, model: nn.Module) -> None:
        register_attention()
        if self.hparams.student_rule == "positional":
            fix_mmap_threshold()  # the whole prompt's scores under grad: bound the host heap (leank_train.heap)
        model.requires_grad_(False)
        model.eval()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if self.hparams.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.llm = model
        # The frozen weights are identical on every rank (same file): DDP need not broadcast or track them.
        self._ddp_params_and_buffers_to_ignore = [f"llm.{n}" for n, _ in model.named_parameters()] + [
            f"llm.{n}" for n, _ in model.named_buffers()
        ]
        layers, kv_heads, head_dim = model_shape(model.config)
        self.dense_layers = dense_layers_of(model.config)
        if len(self.dense_layers) == layers:
            raise MaskError(
                f"every layer of {type(model).__name__} uses sliding-window attention: its cache is already "
                "bounded and LeanK prunes only full-attention layers, so there is no mask to learn"
            )
        alpha = torch.ones(layers, kv_heads, head_dim)
        if self.hparams.init_scores is not None:
            scores = load_scores(self.hparams.init_scores)
            if tuple(scores.shape) != tuple(alpha.shape):
                raise MaskError(f"init_scores shape {tuple(scores.shape)} does not fit the model {tuple(alpha.shape)}")
            alpha = scores.clamp(0, 1)
        alpha[list(self.dense_layers)] = 1.0  # unused by the student: no gradient, no L1 pull
        self.alpha = nn.Parameter(alpha.float().contiguous())

    def configure_model(self) -> None:
        if self.llm is not None:
            return
        from leank_infer.model.loading import load_base_model

        model, _ = load_base_model(
            self.hparams.base_model,
            self.hparams.revision,
            self.hparams.loader,
            with_tokenizer=False,
            adapter=self.hparams.adapter,
            adapter_revision=self.hparams.adapter_revision,
            dtype=getattr(torch, self.hparams.dtype),
            **dict(self.hparams.config_overrides or {}),
        )
        self._attach(model)

    def train(self, mode: bool = True) -> LeanKDistillation:
        """Lightning switches modules to train mode; the frozen LM stays in eval (no dropout)."""
        super().train(mode)
        if self.llm is not None:
            self.llm.eval()
        return self

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Only alpha is learned: keep the frozen base model's weights out of Lightning checkpoints.
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("llm.")}
        checkpoint["leank_recent_distill"] = list(self.recent_distill)  # so a resumed run reports the same loss

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.recent_distill = list(checkpoint.get("leank_recent_distill", []))

    def configure_callbacks(self) -> list[L.Callback]:
        """A NaN/inf loss or alpha stops training before it reaches a checkpoint (``leank_train.distill.finite``)."""
        return [StopOnNonFinite()]

    # ---- the step ------------------------------------------------------------------------
    def current_ratio(self) -> float:
        """The binarisation ratio at this step: ``ratio``, or on the way there from ``ratio_start``."""
        start, steps, target = self.hparams.ratio_start, self.hparams.ratio_anneal_steps, self.hparams.ratio
        if start is None or steps <= 0:
            return target
        step = self.trainer.global_step if self._trainer is not None else steps
        return start + (target - start) * min(1.0, step / steps)

    def channel_scale(self) -> torch.Tensor:
        """What multiplies middle-key channels now: alpha (stage 1) or its binarisation with STE (stage 2)."""
        if self.hparams.stage == 2:
            return binary_ste(
                self.alpha, self.current_ratio(), self.hparams.align, self.hparams.min_kept, self.dense_layers
            )
        return self.alpha

    @property
    def sequence_parallel_group(self) -> Any:
        """The process group splitting one sample's sequence: set explicitly, or the strategy's; None if off."""
        group = getattr(self, "_sequence_parallel_group", None)
        if group is None and self._trainer is not None:
            group = getattr(self.trainer.strategy, "sequence_parallel_group", None)
        return group

    @sequence_parallel_group.setter
    def sequence_parallel_group(self, group: Any) -> None:
        self._sequence_parallel_group = group

    @contextmanager
    def _checkpointed_layers(self) -> Iterator[None]:
        """transformers checkpoints a decoder layer only when that layer is in training mode: flip the
        layer's own flag (not its children's, so dropout-like submodules stay in eval) for the student pass."""
        layers = [m for m in self.llm.modules() if getattr(m, "gradient_checkpointing", False)]
        if not self.hparams.activation_checkpointing:
            layers = []
        for m in layers:
            m.training = True
        try:
            yield
        finally:
            for m in layers:
                m.training = False

    def hidden_states(self, input_ids: torch.Tensor, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(teacher, student) final hidden states ``[1, answer, hidden]`` of the tokens after ``context_len``.

        Teacher: one no-grad pass over context + answer that records every layer's K/V (sequence
        parallel: this rank's shard of the sequence, head-sharded K/V). Student: the answer tokens
        alone (replicated on an SP group) against the recorded context K/V, with grad to alpha.
        """
        decoder = self.llm.get_decoder()
        if input_ids.shape[0] != 1:
            raise ValueError(f"hidden_states takes one sequence, got a batch of {input_ids.shape[0]}")
        total = input_ids.shape[1]
        if not 0 < context_len < total:
            raise ValueError(f"context_len must split the sequence, got {context_len} of {total}")
        group = self.sequence_parallel_group
        record = TeacherState(kv={}, group=group)
        with torch.no_grad():
            if group is None:
                teacher = decoder(input_ids=input_ids, use_cache=False, **{STATE_KWARG: record}).last_hidden_state
            else:
                cfg = self.llm.config.get_text_config()
                sp.check_divisible(int(cfg.num_key_value_heads), sp.group_size(group), "the KV heads")
                start, end, padded = sp.sequence_shard(total, group)
                # pad after the answer: causal attention, so nothing before the padding changes
                ids = torch.nn.functional.pad(input_ids, (0, padded - total), value=int(input_ids[0, -1]))
                positions = torch.arange(start, end, device=input_ids.device).unsqueeze(0)
                local = decoder(
                    input_ids=ids[:, start:end], position_ids=positions, use_cache=False, **{STATE_KWARG: record}
                ).last_hidden_state
                teacher = sp.all_gather_cat(local, group, dim=1)[:, :total]
            teacher = teacher[:, context_len:]
        state = StudentState(
            channel_scale=self.channel_scale(),
            sink_size=self.hparams.sink_size,
            recent_size=self.hparams.recent_size,
            skip_zero_heads=self.hparams.stage == 2,
            dense_layers=frozenset(self.dense_layers),
            group=group,
        )
        if self.hparams.student_rule == "positional":  # the whole sequence under the rule; no context to record
            if group is not None:
                raise RecipeError("student_rule positional does not support sequence parallelism")
            state.accumu_size = self.hparams.accumu_size
            with self._checkpointed_layers():
                student = decoder(input_ids=input_ids, use_cache=False, **{STATE_KWARG: state}).last_hidden_state
            return teacher, student[:, context_len:]
        state.context = [(k[:, :, :context_len], v[:, :, :context_len]) for k, v in (record.kv[i] for i in sorted(record.kv))]
        positions = torch.arange(context_len, total, device=input_ids.device).unsqueeze(0)
        with self._checkpointed_layers():
            student = decoder(
                input_ids=input_ids[:, context_len:],
                position_ids=positions,
                use_cache=False,
                **{STATE_KWARG: state},
            ).last_hidden_state
        return teacher, student

    def sample_distill(self, input_ids: torch.Tensor, labels: torch.Tensor, context_len: int) -> torch.Tensor:
        """Distillation MSE of one sequence ``[1, T]``: mean over label tokens of the mean over channels."""
        teacher, student = self.hidden_states(input_ids, context_len)
        per_token = (teacher.float() - student.float()).pow(2).mean(-1)  # [1, answer]
        on_label = (labels[:, context_len:] != -100).to(per_token.dtype)
        return (per_token * on_label).sum() / on_label.sum().clamp_min(1)

    def losses(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(distillation MSE averaged over the samples of the batch, weighted L1 of alpha once per step).

        A batch of several samples (padded by ``collate_needles``; true lengths in ``length``) is a
        loop over its samples, each at its own length, and the mean of their losses: so one process
        with batch B equals B data-parallel processes with batch 1, whose gradients DDP averages.
        The L1 term is added once per step, not per sample, over the layers LeanK prunes.
        """
        input_ids, labels = batch["input_ids"], batch["labels"]
        contexts = batch["context_len"].reshape(-1)
        lengths = batch.get("length")
        lengths = lengths.reshape(-1) if lengths is not None else torch.full_like(contexts, input_ids.shape[1])
        if not len(contexts) == len(lengths) == input_ids.shape[0]:
            raise ValueError("context_len and length need one entry per sample of the batch")
        distill = torch.stack(
            [
                self.sample_distill(input_ids[i : i + 1, :n], labels[i : i + 1, :n], int(c))
                for i, (n, c) in enumerate(zip(lengths.tolist(), contexts.tolist(), strict=True))
            ]
        ).mean()
        pruned = [i for i in range(self.alpha.shape[0]) if i not in self.dense_layers]
        reg = self.hparams.reg_weight * self.alpha[pruned].abs().mean()
        return distill, reg

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.alpha.clamp_(0.0, 1.0)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        distill, reg = self.losses(batch)
        self.distill_loss(distill.detach())
        self.recent_distill = [*self.recent_distill[-9:], distill.item()]
        self.reg_loss(reg.detach())
        self.log("train/distill_loss", self.distill_loss, prog_bar=True, on_step=True, on_epoch=False)
        self.log("train/reg_loss", self.reg_loss, on_step=True, on_epoch=False)
        with torch.no_grad():
            alpha = self.alpha.detach().clamp(0, 1)
            counts = binarize(
                alpha, self.current_ratio(), self.hparams.align, self.hparams.min_kept, self.dense_layers
            ).sum(-1)
            self.log_dict(
                {
                    "train/ratio": self.current_ratio(),
                    "train/alpha_mean": alpha.mean(),
                    "train/alpha_below_0.1": (alpha < 0.1).float().mean(),
                    "train/k_kept_fraction": counts.sum() / alpha.numel(),
                    "train/zero_heads": (counts == 0).sum().float(),
                },
                on_step=True,
                on_epoch=False,
            )
        return distill + reg

    def on_train_end(self) -> None:
        with torch.no_grad():
            self.alpha.clamp_(0.0, 1.0)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW([self.alpha], lr=self.hparams.lr, weight_decay=0.0)
        total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1
        warmup, floor = self.hparams.warmup_steps, self.hparams.min_lr_ratio
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_decay(s, warmup, total, floor))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # ---- results ---------------------------------------------------------------------------
    @property
    def final_distill_loss(self) -> float | None:
        """Mean distillation loss of the last (up to) 10 training steps."""
        return sum(self.recent_distill) / len(self.recent_distill) if self.recent_distill else None

    def mask(self, **meta: Any) -> ChannelMask:
        """The binarised mask of the current alpha (scores = alpha), with training metadata filled in."""
        meta.setdefault("sink_size", self.hparams.sink_size)
        meta.setdefault("base_model", self.hparams.base_model)
        meta.setdefault("base_revision", self.hparams.revision)
        meta.setdefault("loader", dict(self.hparams.loader or {}))
        meta.setdefault("adapter", self.hparams.adapter)
        meta.setdefault("adapter_revision", self.hparams.adapter_revision)
        meta.setdefault("dense_layers", self.dense_layers)
        meta.setdefault("config_overrides", dict(self.hparams.config_overrides or {}))
        alpha = self.alpha.detach().clamp(0, 1).cpu()
        return ChannelMask.from_scores(
            alpha, ratio=self.hparams.ratio, align=self.hparams.align, min_kept=self.hparams.min_kept, **meta
        )
