"""``leank generate``: dense vs LeanK answers side by side, with KV bytes, on a tiny saved model."""

from __future__ import annotations

import re

import pytest
from test_model import random_mask, tiny_repo

from leank_infer import cli


def main(args: list[str]) -> int:
    return cli.main(["generate", *args])


pytestmark = pytest.mark.usefixtures("one_thread")


PROMPT = " ".join(f"w{3 + (i * 7) % 120}" for i in range(40))


def _bytes(line: str) -> float:
    value, unit = re.search(r"KV ([\d.]+) (B|KiB|MiB|GiB)", line).groups()
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_generate_prints_dense_and_leank_with_bytes(tmp_path, capsys):
    mask_dir, _ = tiny_repo(tmp_path, mask=random_mask(ratio=0.7))
    assert main([str(mask_dir), "--prompt", PROMPT, "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "prompt 40 tokens" in out
    header = next(line for line in out.splitlines() if line.startswith("dense: KV"))
    dense_part, leank_part = header.split(" | ")
    assert leank_part.startswith("LeanK: KV") and "6 tokens" in dense_part
    assert _bytes(leank_part) < _bytes(dense_part)


def test_generate_through_the_console_script_with_chat(tmp_path, capsys):
    mask_dir, _ = tiny_repo(tmp_path)
    assert (
        cli.main(["generate", str(mask_dir), "--prompt", "w5 w6 w7", "--chat", "--max-new-tokens", "3"]) == 0
    )
    assert "LeanK: KV" in capsys.readouterr().out


def test_empty_prompt_is_one_clear_error(tmp_path, capsys):
    mask_dir, _ = tiny_repo(tmp_path)
    assert main([str(mask_dir), "--prompt", "   "]) == 2
    err = capsys.readouterr().err
    assert "prompt is empty" in err and "Traceback" not in err


def test_unloadable_base_model_is_one_clear_error(tmp_path, capsys):
    mask = random_mask()
    mask.base_model = str(tmp_path / "missing-model")
    mask.save_pretrained(tmp_path / "mask")
    assert main([str(tmp_path / "mask"), "--prompt", "w5"]) == 2
    err = capsys.readouterr().err
    assert "missing-model" in err and "Traceback" not in err
