"""The recipes parse against the CLI (no model load), the stage sections map onto LightningCLI configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from leank_train.cli import expand_stage, run_cli
from leank_train.pipeline import split_overrides

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


def test_there_are_recipes():
    names = {p.stem for p in RECIPES}
    assert {"smollm2-135m", "llama-3.1-8b", "qwen2.5-7b", "qwen2.5-7b-yarn"} <= names


def test_yarn_recipe_passes_rope_scaling_to_the_model(capsys):
    recipe = next(p for p in RECIPES if p.stem == "qwen2.5-7b-yarn")
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", str(recipe), "--stage", "1", "--print_config"])
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert model["config_overrides"]["rope_parameters"]["rope_type"] == "yarn"
    assert model["config_overrides"]["rope_parameters"]["factor"] == 4.0


@pytest.mark.parametrize("recipe", [p for p in RECIPES if not p.stem.startswith("smollm2-135m")], ids=lambda p: p.stem)
def test_gpu_recipes_take_the_scaling_flags(recipe, capsys):
    # the README's 8-GPU / 2-node commands: devices, nodes and the sequence-parallel strategy parse
    flags = ["--trainer.devices", "8", "--trainer.num_nodes", "2",
             "--trainer.strategy", "leank_train.sequence_parallel.SequenceParallelStrategy",
             "--trainer.strategy.sequence_parallel_size", "4"]
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", str(recipe), "--stage", "1", *flags, "--print_config"])
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert int(cfg["trainer"]["devices"]) == 8 and cfg["trainer"]["num_nodes"] == 2
    assert cfg["trainer"]["strategy"]["class_path"].endswith("SequenceParallelStrategy")
    assert cfg["trainer"]["strategy"]["init_args"]["sequence_parallel_size"] == 4
    assert cfg["model"]["activation_checkpointing"] is True and cfg["model"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_for_each_stage(recipe, stage, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", "--config", str(recipe), "--stage", str(stage), "--print_config"])
    assert exit_info.value.code in (0, None)
    cfg = yaml.safe_load(capsys.readouterr().out)
    section = yaml.safe_load(recipe.read_text())[f"stage{stage}"]
    assert cfg["model"]["stage"] == stage
    for key, value in section["model"].items():
        assert cfg["model"][key] == value, key
    assert cfg["trainer"]["max_steps"] == section["trainer"]["max_steps"]
    assert cfg["export"]["dirpath"] == section["export"]["dirpath"]
    # the data uses the model's tokenizer: linked from model.base_model, not a key of its own
    assert "base_model" not in cfg["data"]


def test_every_recipe_key_is_commented():
    # litgpt style: every group of keys (lines up to the previous blank line) opens with a comment
    for recipe in RECIPES:
        lines = recipe.read_text().splitlines()
        for i, line in enumerate(lines):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            j = i - 1
            while j >= 0 and lines[j].strip() and not lines[j].lstrip().startswith("#"):
                j -= 1
            assert j >= 0 and lines[j].lstrip().startswith("#"), f"{recipe.name}:{i + 1} is not commented: {line!r}"


def test_later_flags_override_the_stage_section(tmp_path, capsys):
    recipe = RECIPES[0]
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", str(recipe), "--stage", "2", "--trainer.max_steps", "7", "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["max_steps"] == 7


def test_expand_stage_inserts_the_section(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("model: {lr: 1.0}\nstage2:\n  model: {lr: 0.5}\n")
    out = expand_stage(["fit", "--config", str(cfg), "--stage=2", "--model.lr", "0.1"])
    assert out[:3] == ["fit", "--config", str(cfg)]
    assert out[3] == "--config" and yaml.safe_load(out[4]) == {"model": {"lr": 0.5}}
    assert out[5:] == ["--model.lr", "0.1"]
    with pytest.raises(SystemExit, match="stage3"):
        expand_stage(["--config", str(cfg), "--stage", "3"])


def test_pipeline_routes_overrides_per_stage():
    routed = split_overrides(["--trainer.max_steps", "5", "--stage2.model.lr=0.3", "--stage1.data.seed", "9"])
    assert routed[1] == ["--trainer.max_steps", "5", "--data.seed", "9"]
    assert routed[2] == ["--trainer.max_steps", "5", "--model.lr=0.3"]
