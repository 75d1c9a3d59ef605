"""benchmarks/vllm_profile.py's table (no engine): each side's row is its engine with the fastest unprofiled step,
and every engine's step stays in the table."""

from __future__ import annotations

import argparse

from conftest import load_benchmark


def args(repeats: int) -> argparse.Namespace:
    return argparse.Namespace(mask="hub/smollm2-135m-instruct-s3", batch=1, context=2048, threads=2, steps=30,
                              repeats=repeats)  # fmt: skip


def side(name: str, step: float, attention: float, kernel: float) -> dict:
    return {"side": name, "step_ms": step, "attention_ms": attention, "kernel_ms": kernel}


def test_each_side_shows_its_fastest_engine_and_every_step():
    bench = load_benchmark("vllm_profile")
    tries = [side("plain", 36.0, 8.0, 6.0), side("LeanK", 39.6, 8.4, 4.8),
             side("plain", 34.3, 7.7, 5.8), side("LeanK", 31.5, 6.9, 5.0)]  # fmt: skip
    text = bench.table(tries, args(2))
    assert "the fastest of 2 fresh engines per side" in text
    assert "| plain | 34.3 | 7.7 | 5.8 | 1.9 | 36.0, 34.3 |" in text
    assert "| LeanK | 31.5 | 6.9 | 5.0 | 1.9 | 39.6, 31.5 |" in text
    assert text.index("| plain |") < text.index("| LeanK |")
    one = bench.table(tries[:2], args(1))
    assert "fastest" not in one and "every engine" not in one
    assert "| LeanK | 39.6 | 8.4 | 4.8 | 3.6 |" in one


def test_repeats_alternate_fresh_engines_and_save_the_fastest(monkeypatch, capsys):
    """parent() starts --repeats engines per side, plain and LeanK alternating, and saves the table of the fastest."""
    import json
    import subprocess

    bench = load_benchmark("vllm_profile")
    steps = iter([36.0, 39.6, 34.3, 31.5, 35.0, 33.0])
    sides, saved = [], {}

    def engine(cmd, **kwargs):  # noqa: ANN001, ANN202
        sides.append("LeanK" if cmd[cmd.index("--mask") + 1] else "plain")
        row = side(sides[-1], next(steps), 7.0, 5.0)
        return subprocess.CompletedProcess(cmd, 0, f"   Ordered by: tottime\nRESULT {json.dumps(row)}\n", "")

    monkeypatch.setattr(bench.subprocess, "run", engine)
    monkeypatch.setattr(bench.results, "save", lambda name, text: saved.setdefault(name, text) and name)
    bench.parent(argparse.Namespace(**vars(args(3)), top=5, dump=None, save=True))
    assert sides == ["plain", "LeanK"] * 3
    assert "| plain | 34.3 | 7.0 | 5.0 | 2.0 | 36.0, 34.3, 35.0 |" in saved["vllm-profile"]
    assert "| LeanK | 31.5 | 7.0 | 5.0 | 2.0 | 39.6, 31.5, 33.0 |" in saved["vllm-profile"]
    capsys.readouterr()
