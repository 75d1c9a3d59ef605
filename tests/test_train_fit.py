"""Short Lightning fits: every family trains alpha only, logs metrics, exports a mask repo, runs stage 2."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import tiny_model
from lightning.pytorch.loggers import CSVLogger

from leank_infer.mask import ChannelMask
from leank_train.data import NeedleDataModule, load_tokenizer
from leank_train.distill.module import LeanKDistillation
from leank_train.export import ExportMask

# the frozen base model is in eval mode on purpose
pytestmark = pytest.mark.filterwarnings(r"ignore:Found \d+ module\(s\) in eval mode")

@pytest.fixture(scope="module")
def datamodule() -> NeedleDataModule:
    dm = NeedleDataModule(min_length=120, max_length=240, length_intervals=3, num_samples=4, seed=0)
    dm.tokenizer = load_tokenizer("embedded")
    dm.setup()
    return dm


def _trainer(tmp_path, steps: int, callbacks=()) -> L.Trainer:
    return L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=CSVLogger(tmp_path, name="logs"),
        callbacks=list(callbacks),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )


def _module(family: str, **kwargs) -> LeanKDistillation:
    model = tiny_model(family, vocab_size=49152)  # the embedded tokenizer's vocabulary
    kwargs = {"sink_size": 4, "recent_size": 8, "align": 4, "warmup_steps": 1, **kwargs}
    return LeanKDistillation.for_model(model, **kwargs)


def test_three_step_fit_trains_only_alpha(family, datamodule, tmp_path):
    module = _module(family, lr=0.05)
    frozen = {k: v.clone() for k, v in module.llm.state_dict().items()}
    trainer = _trainer(tmp_path, 3, [ExportMask(dirpath=str(tmp_path / "mask"), recent_size=16, accumu_size=4)])
    trainer.fit(module, datamodule=datamodule)

    assert trainer.global_step == 3
    assert [n for n, p in module.named_parameters() if p.requires_grad] == ["alpha"]
    assert not module.llm.training
    alpha = module.alpha.detach()
    assert (alpha >= 0).all() and (alpha <= 1).all() and (alpha < 1).any()
    for k, v in module.llm.state_dict().items():
        assert torch.equal(v, frozen[k]), k

    rows = list(csv.DictReader(Path(trainer.logger.log_dir, "metrics.csv").read_text().splitlines()))
    logged = {k for row in rows for k, v in row.items() if v != ""}
    for key in ("train/distill_loss", "train/reg_loss", "train/alpha_mean", "train/alpha_below_0.1",
                "train/k_kept_fraction", "train/zero_heads"):
        assert key in logged, key
    assert module.final_distill_loss is not None and module.final_distill_loss >= 0

    mask = ChannelMask.from_dir(tmp_path / "mask")
    assert mask.keep.shape == (2, 2, 16)
    assert (mask.sink_size, mask.recent_size, mask.accumu_size) == (4, 16, 4)
    torch.testing.assert_close(mask.scores, alpha)
    assert mask.extra["training"]["train_recent_size"] == 8


def test_stage2_starts_from_stage1_folder(datamodule, tmp_path):
    stage1 = _module("llama", lr=0.2, reg_weight=0.5)
    _trainer(tmp_path, 3, [ExportMask(dirpath=str(tmp_path / "s1"))]).fit(stage1, datamodule=datamodule)

    stage2 = _module("llama", stage=2, init_scores=str(tmp_path / "s1"), lr=0.01, reg_weight=0.0, ratio=0.5)
    torch.testing.assert_close(stage2.alpha.detach(), stage1.alpha.detach())
    _trainer(tmp_path, 2, [ExportMask(dirpath=str(tmp_path / "final"))]).fit(stage2, datamodule=datamodule)
    final = ChannelMask.from_dir(tmp_path / "final")
    assert final.ratio == 0.5 and (final.kept_counts % 4 == 0).all()
    assert torch.equal(final.keep, ChannelMask.from_scores(final.scores, 0.5, 4).keep)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp folder left behind


def test_stage2_needs_scores():
    with pytest.raises(ValueError, match="init_scores"):
        LeanKDistillation(stage=2)


def test_checkpoints_hold_alpha_not_the_base_model(datamodule, tmp_path):
    module = _module("qwen2")
    trainer = _trainer(tmp_path, 1)
    trainer.fit(module, datamodule=datamodule)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)  # our own file, tensors and plain data only
    assert list(ckpt["state_dict"]) == ["alpha"]


def test_export_defaults_are_the_recipes_decode_sizes_and_nothing_is_exported_before_fit():
    """An ExportMask configured with its folder only writes the recipe's default decode-time sizes."""
    import dataclasses

    from leank_train.recipe import Recipe

    defaults = {f.name: f.default for f in dataclasses.fields(Recipe)}
    export = ExportMask(dirpath="unused")
    assert (export.recent_size, export.accumu_size) == (defaults["decode_recent_size"], defaults["accumu_size"])
    assert export.exported is None


def test_export_writes_what_the_fit_did_on_rank_zero_only(tmp_path):
    """ExportMask at the end of fit, without a fit: the mask of alpha at the decode-time sizes, the training
    record (stage, steps, train recent size, mean of the last distillation losses), the embedded base model
    under its Hub id with its loader hints, the recipe's text; nothing on other ranks or without a folder."""
    from types import SimpleNamespace

    from leank_infer.mask import MaskError
    from leank_infer.model.loading import EMBEDDED_LOADER, EMBEDDED_MODEL_ID

    module = _module("llama", stage=1, loader={"extra": "x"})
    with torch.no_grad():
        module.alpha.copy_(torch.rand(module.alpha.shape, generator=torch.Generator().manual_seed(0)))
    module.recent_distill = [0.25, 0.75]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  lr: 0.05\n")
    rank0, rank1 = SimpleNamespace(is_global_zero=True, global_step=7), SimpleNamespace(is_global_zero=False, global_step=7)

    ExportMask(dirpath=str(tmp_path / "other"), recipe=str(recipe)).on_fit_end(rank1, module)
    ExportMask(dirpath=None).on_fit_end(rank0, module)
    assert not (tmp_path / "other").exists()

    export = ExportMask(dirpath=str(tmp_path / "mask"), recent_size=24, accumu_size=6, recipe=str(recipe))
    export.setup(rank0, module, "fit")
    export.on_fit_end(rank0, module)
    assert export.exported == tmp_path / "mask"
    mask = ChannelMask.from_dir(tmp_path / "mask")
    assert torch.equal(mask.keep, module.mask().keep)
    assert (mask.sink_size, mask.recent_size, mask.accumu_size) == (4, 24, 6)
    assert mask.extra["training"] == {"stage": 1, "steps": 7, "train_recent_size": 8, "final_distill_loss_last10": 0.5}
    assert mask.base_model == EMBEDDED_MODEL_ID and mask.loader == {**EMBEDDED_LOADER, "extra": "x"}
    assert mask.recipe == "model:\n  lr: 0.05\n"
    assert ExportMask(recipe="model:\n  lr: 1\n").recipe_text() == "model:\n  lr: 1\n"  # the text itself
    assert ExportMask(recipe=str(tmp_path / "missing.yaml")).recipe_text() == str(tmp_path / "missing.yaml")
    assert ExportMask().recipe_text() is None

    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    with pytest.raises(MaskError):  # refused before training, on rank zero
        ExportMask(dirpath=str(tmp_path / "user")).setup(rank0, module, "fit")
    ExportMask(dirpath=str(tmp_path / "user")).setup(rank1, module, "fit")
