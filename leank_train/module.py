"""The LightningModule that learns LeanK channel scalers by distillation (both stages).

A step (LEANK.md, "Cost of a training step"): one no-grad forward of context + answer with a
``DynamicCache`` gives the teacher's final hidden states on the answer and the context's post-RoPE
K/V; the cache is cropped to the context and the student runs only the answer tokens against it
with LeanK attention (``leank_student``), K of middle keys scaled by alpha (stage 1) or by the
binary mask with a straight-through gradient (stage 2). Only ``[answer x context]`` scores exist.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch import nn
from torchmetrics import MeanMetric

from leank_infer.mask import ChannelMask, MaskError, binarize, model_shape

from .errors import RecipeError
from .finite import StopOnNonFinite
from .student_attention import ATTN_IMPLEMENTATION, STATE_KWARG, StudentState
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


def binary_ste(alpha: torch.Tensor, ratio: float, align: int, min_kept: int = 0) -> torch.Tensor:
    """LeanK's binarisation of ``alpha`` in the forward pass, identity gradient to ``alpha``."""
    binary = binarize(alpha.detach(), ratio, align, min_kept).to(alpha.device)
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
    ) -> None:
        """
        Args:
            base_model: Hub id, local folder, or "embedded" (SmolLM2-135M-Instruct shipped on PyPI).
            revision: base model revision (commit, tag or branch) to pin.
            loader: loader hints forwarded to ``load_base_model`` (e.g. ``{"gguf_file": ...}``).
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
        """
        super().__init__()
        self.save_hyperparameters()
        self.strict_loading = False  # checkpoints hold alpha only, not the frozen model
        self.llm: nn.Module | None = None
        self.alpha: nn.Parameter | None = None
        self.distill_loss = MeanMetric()
        self.reg_loss = MeanMetric()
        self.recent_distill: list[float] = []  # the last steps' losses: one step of batch 1 is noisy
        if stage == 2 and init_scores is None:
            raise RecipeError("stage 2 starts from stage-1 scores: set model.init_scores")
        if ratio_start is not None and not 0 <= ratio_start < 1:
            raise ValueError(f"ratio_start must be in [0, 1), got {ratio_start}")
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
        model.requires_grad_(False)
        model.eval()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.llm = model
        layers, kv_heads, head_dim = model_shape(model.config)
        alpha = torch.ones(layers, kv_heads, head_dim)
        if self.hparams.init_scores is not None:
            scores = load_scores(self.hparams.init_scores)
            if tuple(scores.shape) != tuple(alpha.shape):
                raise MaskError(f"init_scores shape {tuple(scores.shape)} does not fit the model {tuple(alpha.shape)}")
            alpha = scores.clamp(0, 1)
        self.alpha = nn.Parameter(alpha.float().contiguous())

    def configure_model(self) -> None:
        if self.llm is not None:
            return
        from leank_infer.loading import load_base_model

        model, _ = load_base_model(
            self.hparams.base_model,
            self.hparams.revision,
            self.hparams.loader,
            with_tokenizer=False,
            dtype=getattr(torch, self.hparams.dtype),
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
        """A NaN/inf loss or alpha stops training before it reaches a checkpoint (``leank_train.finite``)."""
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
            return binary_ste(self.alpha, self.current_ratio(), self.hparams.align, self.hparams.min_kept)
        return self.alpha

    def hidden_states(self, input_ids: torch.Tensor, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(teacher, student) final hidden states ``[1, answer, hidden]`` of the tokens after ``context_len``."""
        from transformers import DynamicCache

        decoder = self.llm.get_decoder()
        total = input_ids.shape[1]
        if not 0 < context_len < total:
            raise ValueError(f"context_len must split the sequence, got {context_len} of {total}")
        cache = DynamicCache(config=self.llm.config)
        with torch.no_grad():
            teacher = decoder(input_ids=input_ids, cache=cache, use_cache=True).last_hidden_state[:, context_len:]
        cache.crop(-(total - context_len))  # negative: drop the answer, keep the context's K/V
        state = StudentState(
            channel_scale=self.channel_scale(),
            sink_size=self.hparams.sink_size,
            recent_size=self.hparams.recent_size,
            skip_zero_heads=self.hparams.stage == 2,
        )
        positions = torch.arange(context_len, total, device=input_ids.device).unsqueeze(0)
        student = decoder(
            input_ids=input_ids[:, context_len:],
            position_ids=positions,
            cache=cache,
            use_cache=True,
            **{STATE_KWARG: state},
        ).last_hidden_state
        return teacher, student

    def losses(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(distillation MSE over label tokens, weighted L1 of alpha)."""
        input_ids, labels = batch["input_ids"], batch["labels"]
        context_len = int(batch["context_len"].reshape(-1)[0])
        teacher, student = self.hidden_states(input_ids, context_len)
        per_token = (teacher.float() - student.float()).pow(2).mean(-1)  # [1, answer]
        on_label = (labels[:, context_len:] != -100).to(per_token.dtype)
        distill = (per_token * on_label).sum() / on_label.sum().clamp_min(1)
        reg = self.hparams.reg_weight * self.alpha.abs().mean()
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
            counts = binarize(alpha, self.current_ratio(), self.hparams.align, self.hparams.min_kept).sum(-1)
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
        alpha = self.alpha.detach().clamp(0, 1).cpu()
        return ChannelMask.from_scores(
            alpha, ratio=self.hparams.ratio, align=self.hparams.align, min_kept=self.hparams.min_kept, **meta
        )
