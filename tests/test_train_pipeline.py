"""`leank run` end to end on the embedded SmolLM2 (2 steps per stage, short prompts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from leank_infer.mask import ChannelMask

# the frozen base model is in eval mode on purpose
pytestmark = pytest.mark.filterwarnings(r"ignore:Found \d+ module\(s\) in eval mode")

RECIPE = Path(__file__).parent.parent / "recipes" / "smollm2-135m.yaml"


@pytest.mark.slow
def test_leank_run_two_steps_per_stage(tmp_path, capsys):
    from leank_infer.cli import main

    overrides = [
        "--stage1.steps", "2", "--stage2.steps", "2", "--trainer.logger", "false",
        "--out_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
        "--stage1.num_samples", "2", "--stage2.num_samples", "2", "--min_length", "300", "--max_length", "400",
        "--mask_dir", str(tmp_path / "final"),
        # a small evaluation: one short passkey probe, the full model and the mask, no KL
        "--evaluate.lengths", "[300]", "--evaluate.samples", "1", "--evaluate.methods", "[full, leank]",
        "--evaluate.kl", "false", "--evaluate.tasks", "[passkey]",
    ]
    assert main(["run", str(RECIPE), *overrides]) == 0
    out = capsys.readouterr().out
    assert "k_kept_fraction" in out and "wall time" in out
    mask = ChannelMask.from_dir(tmp_path / "final")
    assert mask.keep.shape == (30, 3, 64)
    assert (mask.sink_size, mask.recent_size, mask.accumu_size, mask.align) == (16, 64, 16, 16)
    assert mask.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and mask.loader.get("embedded")
    import yaml

    recipe = yaml.safe_load(mask.recipe)  # the resolved recipe: reruns as `leank run FILE`
    assert recipe["out_dir"] == str(tmp_path) and recipe["stage2"]["steps"] == 2 and recipe["ratio"] == 0.7
    assert (tmp_path / "stage1-mask" / "mask.safetensors").is_file()
    assert mask.extra["training"]["stage"] == 2 and mask.extra["training"]["steps"] == 2
    assert abs(mask.stats()["k_kept_fraction"] - 0.3) < 0.1
    # the evaluation went into the model card, with the command that reproduces it
    from huggingface_hub import ModelCard

    card = ModelCard.load(tmp_path / "final" / "README.md")
    results = card.data.to_dict()["model-index"][0]["results"]
    metrics = {m["name"] for r in results for m in r["metrics"]}
    assert metrics == {"accuracy (full)", "accuracy (leank)"}
    assert f"leank eval {tmp_path / 'final'} --lengths 300 --samples 1 --methods full leank" in card.text
    assert "leank eval" in out and "| leank |" in out
    # and it ends by setting the mask beside the committed one the recipe names (compare_to)
    assert "vs the committed mask (hub/smollm2-135m-instruct)" in out and "channels that differ" in out
