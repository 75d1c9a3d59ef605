"""Issue 46, item 20: a byte that is not UTF-8 in a recipe value on the command line (the shell passes it to Python as
a lone surrogate, PEP 383) is one line naming the option, from the real ``leank`` entry point: no traceback, no
YAML parser's report about an escape code the user never wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "smollm2-135m.yaml")
TEXT = "not valid text: character {} is an undecodable byte or lone surrogate ('\\udcff'); give UTF-8 text"


def leank(args: list[str | bytes], cwd: Path) -> subprocess.CompletedProcess:
    """``leank ARGS`` in a fresh process, argv bytes as a shell passes them."""
    return subprocess.run([sys.executable, "-m", "leank_infer.cli", *args], cwd=cwd, capture_output=True,
                          timeout=600)  # fmt: skip


@pytest.mark.parametrize("args, message", [
    (["run", RECIPE, "--base_model", b"x\xff"], "leank run: error: --base_model: " + TEXT.format(1)),
    (["run", RECIPE, b"--out_dir=out\xff"], "leank run: error: --out_dir: " + TEXT.format(3)),
    (["run", RECIPE, "--stage1.trainer", b"{a: x\xff}"], "leank run: error: --stage1.trainer: " + TEXT.format(5)),
    (["run", RECIPE, "--evaluate.lengths", "1024", b"2\xff"], "leank run: error: --evaluate.lengths: " + TEXT.format(1)),
    (["run", RECIPE, "--stage", "1", "--dump", "--revision", b"\xff"], "leank run: error: --revision: " + TEXT.format(0)),
    (["fit", "--config", "stage1.yaml", "--model.base_model", b"x\xff", "--trainer.max_steps", "1"],
     "leank fit: error: --model.base_model: " + TEXT.format(1)),
])  # fmt: skip
def test_a_byte_that_is_not_utf8_in_a_recipe_value_is_one_line(tmp_path, args, message):
    if "fit" in args:  # a stage's config, as `leank run --dump` writes it (the user's way to `leank fit`)
        dump = leank(["run", RECIPE, "--out_dir", str(tmp_path / "out"), "--stage", "1", "--dump"], tmp_path)
        assert dump.returncode == 0, dump.stderr
        (tmp_path / "stage1.yaml").write_bytes(dump.stdout)
    run = leank(args, tmp_path)
    err = run.stderr.decode("utf-8", "backslashreplace")
    assert run.returncode == 2 and err == message + "\n", err[-3000:]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out*"))


def test_a_recipe_file_whose_name_is_not_utf8_still_runs(tmp_path):
    """The recipe file is a path that exists: read as such, whatever bytes its name holds."""
    name = b"recipe-\xff.yaml"
    (tmp_path / name.decode("utf-8", "surrogateescape")).write_bytes(Path(RECIPE).read_bytes())
    run = leank(["run", name, "--out_dir", str(tmp_path / "out"), "--stage", "1", "--dump"], tmp_path)
    assert run.returncode == 0 and b"max_steps" in run.stdout, run.stderr[-3000:]
