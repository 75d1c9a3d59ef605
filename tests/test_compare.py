"""`leank run`'s closing comparison with a committed mask, and the demo recipe writing under runs/, not hub/."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml

from leank_infer.cli import main as leank
from leank_infer.mask import MASK_FILE, ChannelMask
from leank_train import pipeline
from leank_train.cli import run_cli
from leank_train.compare import (
    MaskSnapshot,
    compare_masks,
    eval_side_by_side,
    format_comparison,
    read_reference,
)
from leank_train.errors import RecipeError

ROOT = Path(__file__).parent.parent
HUB = ROOT / "hub"


def _mask(keep: torch.Tensor) -> ChannelMask:
    return ChannelMask(keep=keep, ratio=0.5, align=4, sink_size=4, recent_size=8, accumu_size=4)


def _pair() -> tuple[ChannelMask, ChannelMask]:
    """Two masks [2 layers, 2 heads, 8 channels] = 32 channels: the reference keeps 16, the new one 11."""
    ref = torch.zeros(2, 2, 8, dtype=torch.bool)
    ref[:, :, :4] = True  # every head keeps its first 4 channels
    new = ref.clone()
    new[0, 0, :4] = False  # head (0, 0) keeps none: 4 channels differ, one zero head
    new[1, 1, 1] = False  # 2 more differ: (1, 1) swaps channel 1 for channel 6, same count
    new[1, 1, 6] = True
    new[1, 0, 3] = False  # and 1 more: (1, 0) keeps 3
    return _mask(new), _mask(ref)


def test_compare_masks_counts_differing_channels_and_kept_fractions():
    new, ref = _pair()
    c = compare_masks(new, ref)
    assert c["differing_channels"] == 7 and c["total_channels"] == 32
    assert c["differing_fraction"] == pytest.approx(7 / 32)
    assert c["new"]["k_kept_fraction"] == pytest.approx(11 / 32)
    assert c["reference"]["k_kept_fraction"] == pytest.approx(16 / 32)
    assert (c["new"]["zero_heads"], c["reference"]["zero_heads"]) == (1, 0)
    assert c["new"]["v_kept_fraction"] == pytest.approx(3 / 4) and c["reference"]["v_kept_fraction"] == 1.0
    assert c["new"]["total_heads"] == c["reference"]["total_heads"] == 4
    assert compare_masks(ref, ref)["differing_channels"] == 0
    # masks of different models do not line up: no channel count, the fractions still compare
    other = compare_masks(_mask(torch.ones(3, 2, 8, dtype=torch.bool)), ref)
    assert other["differing_channels"] is None and other["new"]["k_kept_fraction"] == 1.0


def _rows(command: str, values: dict[tuple[str, str], float]) -> list[dict]:
    return [{"dataset": d, "metric": m, "value": v, "command": command} for (d, m), v in values.items()]


def test_comparison_sets_the_shared_evaluation_rows_side_by_side(tmp_path):
    new, ref = _pair()
    a, b = "unseen needles, 1024 tokens", "unseen needles, 4096 tokens"
    new_rows = _rows("leank eval runs/x/mask --lengths 1024 --samples 6", {(a, "accuracy (leank)"): 0.5})
    ref_rows = _rows("leank eval hub/x --lengths 1024 4096 --samples 12",
                     {(a, "accuracy (leank)"): 0.4166, (b, "accuracy (leank)"): 0.33})
    assert eval_side_by_side(new_rows, ref_rows) == [(a, "accuracy (leank)", 0.5, 0.4166)]

    for folder, mask, rows in (("new", new, new_rows), ("ref", ref, ref_rows)):
        mask.save_pretrained(tmp_path / folder)
        (tmp_path / folder / "eval.json").write_text(json.dumps({"results": rows}))
    text = format_comparison(MaskSnapshot.read(tmp_path / "new"), read_reference(tmp_path / "ref"))
    assert "channels that differ 7 of 32 (21.9%)" in text
    assert re.search(r"k_kept_fraction\s+0\.344\s+0\.500", text)
    assert re.search(r"v_kept_fraction\s+0\.750\s+1\.000", text)
    assert re.search(r"zero heads\s+1 of 4\s+0 of 4", text)
    assert f"| {a} | accuracy (leank) | 0.5 | 0.4166 |" in text and b not in text
    assert "different evaluation settings" in text and "leank eval hub/x --lengths 1024 4096" in text

    (tmp_path / "ref" / "eval.json").unlink()
    text = format_comparison(MaskSnapshot.read(tmp_path / "new"), MaskSnapshot.read(tmp_path / "ref"))
    assert "nothing to set side by side" in text and "has no eval.json" in text


def test_a_missing_reference_is_one_error_naming_it(tmp_path):
    with pytest.raises(RecipeError, match=r"compare_to '.*nowhere' is not a mask folder.*--compare_to null"):
        read_reference(tmp_path / "nowhere")


def test_the_run_compares_with_the_reference_as_it_was_before_training(tmp_path, monkeypatch, capsys):
    # reproducing the committed mask exports into the compare_to folder itself: the comparison must be
    # with what was there before (read before training), not with the freshly written copy
    new, ref = _pair()
    folder = tmp_path / "hub-mask"
    ref.save_pretrained(folder)
    recipe = pipeline.load_recipe(ROOT / "recipes" / "smollm2-135m.yaml",
                                  ["--compare_to", str(folder), "--evaluate.enabled", "false"])

    def fake_stage(recipe, stage, before=None):
        before({})
        if stage == 2:
            new.save_pretrained(folder)
        return str(folder), {}

    monkeypatch.setattr(pipeline, "run_stage", fake_stage)
    assert pipeline._run(recipe) == 0
    out = capsys.readouterr().out
    assert "channels that differ 7 of 32" in out
    assert f"leank push {folder} ORG/NAME" in out


def _resolved(recipe: Path, stage: int, capsys) -> dict:
    from leank_train.recipe import stage_config

    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", yaml.safe_dump(stage_config(pipeline.load_recipe(recipe), stage)), "--print_config"])
    return yaml.safe_load(capsys.readouterr().out)


def test_make_demo_writes_under_runs_and_never_into_hub(capsys):
    # the demo target's command, from the Makefile itself
    makefile = (ROOT / "Makefile").read_text()
    command = re.search(r"^demo:.*\n\t(.+)$", makefile, re.M).group(1)
    words = shlex.split(command)
    assert words[1:3] == ["run", "recipes/smollm2-135m.yaml"] and not any("hub" in w for w in words), command
    recipe = ROOT / words[2]
    hub_folders = {p.resolve() for p in HUB.iterdir() if p.is_dir()}
    assert hub_folders  # the committed masks are there to protect
    for stage in (1, 2):
        cfg = _resolved(recipe, stage, capsys)
        out = Path(cfg["export"]["dirpath"])
        assert out.parts[0] == "runs", out
        assert (ROOT / out).resolve() not in hub_folders and HUB.resolve() not in (ROOT / out).resolve().parents
        assert Path(cfg["trainer"]["default_root_dir"]).parts[0] == "runs"
    # and it ends by comparing with the committed mask it reproduces
    compare_to = pipeline.load_recipe(recipe).compare_to
    assert (ROOT / compare_to).resolve() == (HUB / "smollm2-135m-instruct").resolve()
    assert MaskSnapshot.read(ROOT / compare_to).results  # the committed folder has rows to compare


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_a_compare_to_names_a_committed_mask_folder(recipe):
    target = pipeline.load_recipe(recipe).compare_to
    if target is not None:
        MaskSnapshot.read(ROOT / target)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings(r"ignore:Found \d+ module\(s\) in eval mode", "ignore:.*does not have many workers",
                            "ignore:.*there is no last checkpoint available")
def test_leank_run_writes_its_folder_and_compares_without_touching_the_committed_one(tmp_path, capsys):
    from test_faults import base_model, recipe

    base = base_model(tmp_path / "tiny-llama")
    path = str(recipe(tmp_path, base))
    committed = tmp_path / "hub" / "tiny"
    # the "committed" mask: the recipe exporting into hub/ (what `--mask_dir hub/...` does, docs/training.md)
    assert leank(["run", path, "--mask_dir", str(committed)]) == 0
    before = (committed / MASK_FILE).read_bytes()
    capsys.readouterr()

    # the demo way: the run's own folder, then the comparison; training is reused (same settings)
    out_dir = tmp_path / "runs" / "mask"
    assert leank(["run", path, "--mask_dir", str(out_dir), "--compare_to", str(committed)]) == 0
    out = capsys.readouterr().out
    assert "stage 1 already done" in out and "stage 2 resumes from" in out
    total = ChannelMask.from_dir(out_dir).keep.numel()
    assert f"channels that differ 0 of {total} (0.0%)" in out
    assert f"leank push {out_dir} ORG/NAME" in out
    assert (committed / MASK_FILE).read_bytes() == before

    # a compare_to that is not a mask folder stops before anything trains, with exit 2 and one line
    assert leank(["run", path, "--mask_dir", str(tmp_path / "other"), "--compare_to", str(tmp_path / "nowhere")]) == 2
    assert "compare_to" in capsys.readouterr().err and not (tmp_path / "other").exists()
