"""The help of every `leank` subcommand, as a newcomer reads it: every option explained, nothing marked required
that a recipe or a default supplies, the recipe file shown first, each stage's group holding its own options,
examples that parse, one list syntax, and `leank eval` without third-party banners."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from leank_infer import cli

ROOT = Path(__file__).resolve().parent.parent
TYPED = [name for name in cli.COMMANDS if name not in cli.RAW_ARGV]
RECIPE = ROOT / "recipes" / "smollm2-135m.yaml"


def parser_of(name: str):
    return cli.command_parser(cli._load(name), f"leank {name}")


def options(parser) -> list:
    """Every argument of ``parser`` but argparse's -h and jsonargparse's --print_config."""
    return [a for a in parser._actions if a.dest not in ("help", "print_config")]


def help_line(parser, action) -> str:
    """The text ``--help`` prints beside ``action`` (jsonargparse's own formatter, ours on top)."""
    return parser._get_formatter()._get_help_string(action)


def test_top_level_help_lists_every_command_and_its_examples_parse(capsys, monkeypatch):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(re.search(rf"^  {name}\s+\S", out, re.M) for name in cli.COMMANDS)
    monkeypatch.chdir(ROOT)
    examples = out.split("examples:\n", 1)[1].splitlines()
    assert examples
    for line in examples:
        words = shlex.split(line)
        cli.parse(cli._load(words[1]), words[2:], f"leank {words[1]}")


@pytest.mark.parametrize("name", TYPED)
def test_every_option_has_a_help_line(name):
    parser = parser_of(name)
    bare = [a.option_strings[0] if a.option_strings else a.dest for a in options(parser)
            if not (a.help or "").strip() or not help_line(parser, a).split("(")[0].strip()]
    assert not bare, f"leank {name}: no help text for {bare}"


@pytest.mark.parametrize("name", TYPED)
def test_only_what_nothing_supplies_is_marked_required(name):
    """A signature's parameter is required only without a default; a recipe key never reads "required" (the recipe
    file gives it), and the shipped recipe does give every key that has no default."""
    import inspect

    func = cli._load(name)
    params = inspect.signature(func).parameters
    parser = parser_of(name)
    for action in options(parser):
        marked = "(required" in help_line(parser, action)
        param = params.get(action.dest)
        if param is not None:
            assert marked == (param.default is inspect.Parameter.empty), action.dest
        else:  # a key of the recipe
            assert not marked, f"leank {name}: {action.option_strings} marked required though a recipe sets it"
    if name == "run":
        given = cli.parse(func, [str(RECIPE)], "leank run")["recipe"]
        assert given.out_dir and given.base_model and given.stage1.steps and given.stage2.steps


def test_run_help_shows_the_recipe_first_and_an_example():
    text = parser_of("run").format_help()
    usage = text.split("\n\n")[0]
    assert usage.startswith("usage: leank run RECIPE.yaml ")
    assert "--out_dir" not in usage and "--stage1.steps" not in usage  # not typed on the command line
    examples = text.split("examples:\n", 1)[1]
    assert "leank run recipes/smollm2-135m.yaml" in examples


def test_stage_groups_hold_their_own_options():
    text = parser_of("run").format_help()
    stage1 = text.split("\nstage 1", 1)[1].split("\n\n", 1)[0]
    stage2 = text.split("\nstage 2", 1)[1].split("\n\n", 1)[0]
    assert "--stage1.steps" in stage1 and "--stage2." not in stage1
    assert not re.search(r"ratio_start|ratio_anneal_steps|min_kept", stage1)  # the binarisation: stage 2's
    assert all(f"--stage2.{k}" in stage2 for k in ("steps", "ratio_start", "ratio_anneal_steps", "min_kept"))
    assert "--stage1." not in stage2


def test_a_recipe_missing_a_key_is_one_error_naming_it(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({k: v for k, v in yaml.safe_load(RECIPE.read_text()).items() if k != "out_dir"}))
    assert cli.main(["run", str(recipe), "--dump"]) == 2
    err = capsys.readouterr().err
    assert f"the recipe {recipe} sets no out_dir" in err and "--out_dir VALUE" in err


@pytest.mark.parametrize("name", TYPED)
def test_the_examples_in_the_help_parse(name, monkeypatch):
    """Each example line of a command's help is a command line its parser takes (nothing runs)."""
    monkeypatch.chdir(ROOT)
    func = cli._load(name)
    examples = cli._docs(func)[2]
    for line in examples.splitlines():
        words = shlex.split(line, comments=True)
        assert words[:2] == ["leank", name], line
        cli.parse(func, words[2:], f"leank {name}")


def test_lists_are_space_separated_everywhere_and_the_comma_form_is_deprecated(capsys):
    from leank_infer.bench import bench
    from leank_train.evaluate import eval_command
    from leank_train.pipeline import run

    assert cli.parse(eval_command, ["m", "--lengths", "1024", "2048"], "leank eval")["lengths"] == [1024, 2048]
    assert cli.parse(bench, ["--contexts", "1024", "2048"], "leank bench")["contexts"] == [1024, 2048]
    assert cli.parse(bench, ["--capacity", "80", "141"], "leank bench")["capacity"] == [80, 141]
    recipe = cli.parse(run, [str(RECIPE), "--evaluate.lengths", "1024", "2048", "--haystacks", "noise"],
                       "leank run")["recipe"]
    assert recipe.evaluate.lengths == [1024, 2048] and recipe.haystacks == ["noise"]
    assert capsys.readouterr().err == ""
    # jsonargparse's own list form, everywhere
    assert cli.parse(bench, ["--batches", "[1,4]"], "leank bench")["batches"] == [1, 4]
    assert cli.parse(run, [str(RECIPE), "--evaluate.lengths", "[512,1024]"], "leank run")["recipe"].evaluate.lengths \
        == [512, 1024]
    appended = cli.parse(run, [str(RECIPE), "--evaluate.lengths+", "4096", "8192", "--haystacks+", "x.txt"], "leank run")
    assert appended["recipe"].evaluate.lengths == [1024, 2048, 4096, 8192]  # jsonargparse's append, several at once
    assert appended["recipe"].haystacks[-1] == "x.txt"
    assert capsys.readouterr().err == ""
    # the older comma form: the same values, and a warning giving the new spelling
    assert cli.parse(bench, ["--contexts", "1024,2048", "--batches=1,4"], "leank bench")["contexts"] == [1024, 2048]
    err = capsys.readouterr().err
    assert "leank bench: warning: --contexts 1024,2048: comma-separated lists are deprecated" in err
    assert "--contexts 1024 2048" in err and "--batches 1 4" in err
    # a bad item is still one clear error naming the option
    with pytest.raises(cli.UsageError, match="--contexts"):
        cli.parse(bench, ["--contexts", "1024", "many"], "leank bench")


def test_invocations_print_lists_space_separated():
    from leank_infer.bench import bench

    cmd = cli.invocation("leank bench", bench, {"mask": "m", "contexts": [1024, 2048], "capacity": [80.0]})
    assert cmd == "leank bench m --contexts 1024 2048 --capacity 80"


def test_options_are_spelled_with_underscores_or_dashes():
    from leank_infer.bench import bench

    for spelling in ("--new_tokens", "--new-tokens"):
        assert cli.parse(bench, [spelling, "5", "--kv-quant", "int8"], "leank bench")["new_tokens"] == 5


def test_eval_quick_prints_no_third_party_banners_and_a_bar_with_the_time_left(tmp_path):
    """`leank eval --quick` (here with the needle probes and a short length: a tiny model) prints its table and
    Lightning's progress bar, without Lightning's tips, its device lines or a deprecation from its code."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_model import tiny_repo

    mask_dir, _ = tiny_repo(tmp_path)
    code = ("import leank_train.evaluation.settings as s; s.QUICK['lengths'] = [40]; from leank_infer.cli import main;"
            f"raise SystemExit(main(['eval', {str(mask_dir)!r}, '--quick', '--kinds', 'passkey', '--methods', 'full',"
            "'leank', '--seed', '0']))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "| leank |" in out
    for banner in ("Tip:", "💡", "litlogger", "litmodels", "GPU available", "TPU available", "deprecated",
                   "FutureWarning"):
        assert banner not in out, f"{banner!r} in the output of leank eval --quick:\n{out}"
    # Lightning's bar over the probe batches: done/total, elapsed and remaining (rich: 0:00:01 • 0:00:05;
    # tqdm: [00:01<00:05)
    assert re.search(r"\d+/\d+ .*(\d+:\d\d:\d\d • \d+:\d\d:\d\d|\[\d\d:\d\d<\d\d:\d\d)", out), out


def test_training_runs_with_lightnings_progress_bar():
    """Each stage of `leank run` has Lightning's progress bar (steps, it/s and the time left)."""
    from lightning.pytorch.callbacks.progress import ProgressBar

    from leank_train.cli import run_cli
    from leank_train.pipeline import load_recipe
    from leank_train.recipe import stage_config

    config = stage_config(load_recipe(RECIPE), 1)
    assert config["trainer"]["enable_progress_bar"] is True
    probe = run_cli(["--config", yaml.safe_dump(config)], run=False)  # built, nothing loaded or trained
    assert isinstance(probe.trainer.progress_bar_callback, ProgressBar)


def test_leank_run_shows_each_stages_bar_and_no_third_party_banners(tmp_path):
    """A tiny `leank run`: each stage prints Lightning's bar (steps, time left, it/s) and says its devices once;
    no Lightning tip, and nothing from the trainer that is only built to resolve the config."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_faults import base_model, recipe

    path = recipe(tmp_path / "r", base_model(tmp_path / "base"), {"trainer": {"enable_progress_bar": True}})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    r = subprocess.run([sys.executable, "-m", "leank_infer.cli", "run", str(path)], capture_output=True, text=True,
                       env=env, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for banner in ("Tip:", "💡", "litlogger", "litmodels", "FutureWarning"):
        assert banner not in out, f"{banner!r} in the output of leank run:\n{out}"
    assert out.count("GPU available") == 2 and out.count("Seed set to") == 2  # once per stage, not per probe
    bars = re.findall(r"(\d+)/(\d+) \d+:\d\d:\d\d • \d+:\d\d:\d\d [\d.]+it/s|\| (\d+)/(\d+) \[\d\d:\d\d<\d\d:\d\d", out)
    assert bars, out
