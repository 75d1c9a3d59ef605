"""The recipes parse against `leank run` and each stage's derived config against LightningCLI (no model load)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from leank_infer.cli import main as leank
from leank_infer.cli_types import UsageError
from leank_train.cli import run_cli
from leank_train.pipeline import load_recipe
from leank_train.recipe import stage_config

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


def fit_config(recipe: Path | str, stage: int, capsys, *overrides: str, fit_flags: tuple[str, ...] = ()) -> dict:
    """The resolved LightningCLI config of one stage of ``recipe``, as `leank run` would run it."""
    cfg = stage_config(load_recipe(recipe, overrides), stage)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", "--config", yaml.safe_dump(cfg), *fit_flags, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_there_are_recipes():
    names = {p.stem for p in RECIPES}
    assert {"smollm2-135m", "llama-3.1-8b", "qwen2.5-7b", "qwen2.5-7b-yarn"} <= names


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_for_each_stage(recipe, stage, capsys):
    r = load_recipe(recipe)
    st = r.stage1 if stage == 1 else r.stage2
    cfg = fit_config(recipe, stage, capsys)
    assert cfg["model"]["stage"] == stage
    assert (cfg["model"]["lr"], cfg["model"]["reg_weight"]) == (st.lr, st.reg_weight)
    assert cfg["trainer"]["max_steps"] == st.steps and cfg["data"]["num_samples"] == st.num_samples
    # every path comes from out_dir (stage 1's folder may be another recipe's: stage1_dir)
    out = Path(r.out_dir)
    assert cfg["trainer"]["default_root_dir"] == str(out)
    assert {lg["init_args"]["save_dir"] for lg in cfg["trainer"]["logger"]} == {str(out / "csv"), str(out / "tb")}
    scores = r.stage1_dir or str(out / "stage1-mask")
    assert cfg["export"]["dirpath"] == (scores if stage == 1 else str(out / "mask"))
    assert cfg["model"]["init_scores"] == (None if stage == 1 else scores)
    # the data uses the model's tokenizer: linked from model.base_model, not a key of its own
    assert "base_model" not in cfg["data"]


def test_yarn_recipe_passes_rope_scaling_to_the_model(capsys):
    recipe = next(p for p in RECIPES if p.stem == "qwen2.5-7b-yarn")
    model = fit_config(recipe, 1, capsys)["model"]
    assert model["config_overrides"]["rope_parameters"]["rope_type"] == "yarn"
    assert model["config_overrides"]["rope_parameters"]["factor"] == 4.0
    assert model["base_model"] == "Qwen/Qwen2.5-7B-Instruct"  # from the recipes it includes


@pytest.mark.parametrize("recipe", [p for p in RECIPES if not p.stem.startswith("smollm2-135m")], ids=lambda p: p.stem)
def test_gpu_recipes_take_the_scaling_flags(recipe, capsys):
    # docs/scaling.md's 8-GPU / 2-node commands: devices, nodes and the sequence-parallel strategy parse
    strategy = "{class_path: leank_train.sequence_parallel.SequenceParallelStrategy, init_args: {sequence_parallel_size: 4}}"
    flags = ["--trainer.devices", "8", "--trainer.num_nodes", "2", "--trainer.strategy", strategy]
    cfg = fit_config(recipe, 1, capsys, *flags)
    assert int(cfg["trainer"]["devices"]) == 8 and cfg["trainer"]["num_nodes"] == 2
    assert cfg["trainer"]["strategy"]["class_path"].endswith("SequenceParallelStrategy")
    assert cfg["trainer"]["strategy"]["init_args"]["sequence_parallel_size"] == 4
    assert cfg["model"]["activation_checkpointing"] is True and cfg["model"]["dtype"] == "bfloat16"
    assert cfg["trainer"]["accelerator"] == "gpu"  # the recipe's own trainer keys stay


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


def test_recipes_are_short_and_write_no_path_twice():
    for recipe in RECIPES:
        text = recipe.read_text()
        assert len(text.splitlines()) <= 60, recipe.name
        keys = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
        # out_dir (and, for r80, the 0.7 recipe's stage-1 folder it shares)
        assert sum("runs/" in line for line in keys) <= 2, recipe.name


def test_flags_override_one_stage_and_out_dir_moves_every_path(capsys):
    recipe = next(p for p in RECIPES if p.stem == "smollm2-135m")
    two = fit_config(recipe, 2, capsys, "--stage2.steps", "7", "--out_dir", "elsewhere")
    assert two["trainer"]["max_steps"] == 7
    assert fit_config(recipe, 1, capsys, "--stage2.steps", "7")["trainer"]["max_steps"] == 150
    paths = [two["trainer"]["default_root_dir"], two["export"]["dirpath"], two["model"]["init_scores"],
             *(lg["init_args"]["save_dir"] for lg in two["trainer"]["logger"])]
    assert all(Path(p).parts[0] == "elsewhere" for p in paths), paths


def test_a_recipe_is_checked_key_by_key(tmp_path):
    good = RECIPES[0].read_text()
    for extra, message in [("ratoi: 0.5\n", "ratoi"), ("stage2: {steps: many}\n", "stage2.steps"),
                           ("dtype: int8\n", "dtype")]:
        path = tmp_path / "r.yaml"
        path.write_text(good + extra)
        with pytest.raises(UsageError, match=message):
            load_recipe(path)
    with pytest.raises(UsageError, match="--stage1.lr"):
        load_recipe(RECIPES[0], ["--stage1.lr", "fast"])


def test_dump_prints_the_fit_config_leank_fit_takes(tmp_path, capsys):
    recipe = next(p for p in RECIPES if p.stem == "smollm2-135m-r80")
    capsys.readouterr()
    assert leank(["run", str(recipe), "--stage", "2", "--dump"]) == 0
    stage2 = tmp_path / "stage2.yaml"
    stage2.write_text(capsys.readouterr().out)
    with pytest.raises(SystemExit):
        run_cli(["fit", "--config", str(stage2), "--print_config"])
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert (model["stage"], model["ratio"], model["ratio_start"], model["min_kept"]) == (2, 0.8, 0.5, 32)
    assert model["init_scores"] == "runs/smollm2-135m/stage1-mask"  # the 0.7 recipe's stage 1
