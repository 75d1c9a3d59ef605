"""Stop training at the first non-finite loss or channel scaler, before it reaches a checkpoint.

Lightning runs ``ModelCheckpoint`` after every other callback's ``on_train_batch_end``, so a check
here raises before the step's checkpoint is written: the last checkpoint on disk is the last good
one, and ``--ckpt_path last`` (or rerunning ``leank run``) resumes from it.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch


class NonFiniteError(FloatingPointError):
    """The loss or alpha became NaN/inf; the message names the step and the last good checkpoint."""


class StopOnNonFinite(L.Callback):
    """Raise :class:`NonFiniteError` when a step's loss or the module's ``alpha`` is NaN or inf."""

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step counts optimizer steps done, this one included: the failing step is 1-based
        step = trainer.global_step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all():
            raise NonFiniteError(f"non-finite loss at step {step} ({loss.item()}){_last_good(trainer)}")
        alpha = getattr(pl_module, "alpha", None)
        if isinstance(alpha, torch.Tensor) and not torch.isfinite(alpha).all():
            bad = int((~torch.isfinite(alpha)).sum())
            raise NonFiniteError(
                f"non-finite channel scalers (alpha) at step {step}: {bad} of {alpha.numel()} are NaN or inf"
                f"{_last_good(trainer)}"
            )


def _last_good(trainer: L.Trainer) -> str:
    paths = [cb.last_model_path for cb in trainer.checkpoint_callbacks if getattr(cb, "last_model_path", "")]
    if paths:
        return f"; the last good checkpoint is {paths[0]} (nothing was saved after it)"
    return "; no checkpoint had been saved yet"
