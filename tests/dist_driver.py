"""Driver of the distributed tests: launched by ``torchrun`` (one process per rank), or called in-process.

``fit_and_record`` runs one short Lightning fit of a tiny saved model and writes, per rank, the final
alpha, the (synced) gradient of alpha and the loss of the first step to ``OUT/<name>-rank<r>.safetensors``.
Under torchrun (``python -m torch.distributed.run --nproc_per_node 2 tests/dist_driver.py MODEL OUT``)
it runs the DDP fit (2 processes x batch 1) and then the sequence-parallel fit (2 ranks share one
sample), and checks the Ulysses exchange itself against a full tensor.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from leank_train.data import NeedleDataModule
from leank_train.distill.module import LeanKDistillation

warnings.filterwarnings("ignore")

MODULE_KW: dict[str, Any] = dict(sink_size=4, recent_size=8, align=4, lr=0.05, reg_weight=0.06, warmup_steps=1)
DATA_KW: dict[str, Any] = dict(min_length=120, max_length=240, length_intervals=3, num_samples=6, seed=0)


class Record(L.Callback):
    """Keeps the first step's loss and its gradient of alpha (after DDP's all-reduce) and the final alpha."""

    def __init__(self) -> None:
        self.loss0: torch.Tensor | None = None
        self.grad0: torch.Tensor | None = None
        self.sp_size = torch.tensor([1])

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        group = pl_module.sequence_parallel_group
        if group is not None:
            import torch.distributed as dist

            self.sp_size = torch.tensor([dist.get_world_size(group)])

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.grad0 is None:
            self.grad0 = pl_module.alpha.grad.detach().clone()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.loss0 is None:
            self.loss0 = outputs["loss"].detach().reshape(1).clone()


def fit_and_record(model_dir: str, out: Path, name: str, strategy: Any = "auto", devices: int = 1,
                   batch_size: int = 1, steps: int = 3, **module_kw: Any) -> dict[str, torch.Tensor]:
    """One short fit; returns (and writes per rank) ``alpha``, ``grad0`` and ``loss0``."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        callbacks=[record],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = LeanKDistillation(base_model=model_dir, **{**MODULE_KW, **module_kw})
    data = NeedleDataModule(base_model=model_dir, batch_size=batch_size, **DATA_KW)
    trainer.fit(module, datamodule=data)
    result = {"alpha": module.alpha.detach().clone(), "grad0": record.grad0, "loss0": record.loss0,
              "sp_size": record.sp_size}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in result.items()}, str(out / f"{name}-rank{trainer.global_rank}.safetensors"))
    return result


def check_exchange(out: Path) -> None:
    """seq_to_heads / heads_to_seq against slices of one full tensor every rank can build."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from leank_train import sequence_parallel as sp

    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    full = torch.randn(1, 4, 6 * world, 3, generator=torch.Generator().manual_seed(7))  # [B, H, T, D]
    t = full.shape[2] // world
    mine = full[:, :, rank * t : (rank + 1) * t]
    heads = sp.seq_to_heads(mine, group)
    ok = torch.equal(heads, full[:, sp.head_slice(4, group)]) and torch.equal(sp.heads_to_seq(heads, group), mine)
    save_file({"ok": torch.tensor([int(ok)])}, str(out / f"exchange-rank{rank}.safetensors"))


def main(model_dir: str, out_dir: str) -> None:
    """The 2-process runs; alpha starts from ``MODEL/scores.safetensors`` so distillation has a gradient."""
    torch.set_num_threads(1)
    from lightning.pytorch.strategies import DDPStrategy

    from leank_train.sequence_parallel import SequenceParallelStrategy

    out = Path(out_dir)
    MODULE_KW["init_scores"] = str(Path(model_dir) / "scores.safetensors")
    fit_and_record(model_dir, out, "ddp", strategy=DDPStrategy(process_group_backend="gloo"), devices=2)
    fit_and_record(model_dir, out, "sp", strategy=SequenceParallelStrategy(2, process_group_backend="gloo"), devices=2)
    fit_and_record(model_dir, out, "sp-ckpt", strategy=SequenceParallelStrategy(2, process_group_backend="gloo"),
                   devices=2, steps=1, activation_checkpointing=True)
    check_exchange(out)
    # Join the gloo group's threads before the interpreter exits: left to exit-time destructors they can
    # abort the rank ("terminate called without an active exception", seen once in CI after all results
    # were written).
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
