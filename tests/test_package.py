"""Packaging contracts: the light import, the console script."""

from __future__ import annotations

import subprocess
import sys

TRAIN_DEPS = ("lightning", "pytorch_lightning", "datasets", "torchmetrics", "peft", "jsonargparse")


def test_leank_infer_imports_no_training_dependency():
    code = (
        "import sys, leank_infer; from leank_infer import ChannelMask, LeanKModel, load_base_model\n"
        "import leank_infer.hub.transfer, leank_infer.model.loading, leank_infer.decode.masked_attention\n"
        "import leank_infer.reference_import, leank_infer.mask.capacity\n"
        f"bad = [m for m in {TRAIN_DEPS!r} if m in sys.modules]\n"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_console_script_help():
    r = subprocess.run([sys.executable, "-m", "leank_infer.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for cmd in ("run", "generate", "push", "pull"):
        assert cmd in r.stdout


def test_unknown_subcommand_is_an_error():
    r = subprocess.run([sys.executable, "-m", "leank_infer.cli", "frobnicate"], capture_output=True, text=True)
    assert r.returncode != 0 and "unknown command" in r.stderr


def test_leank_infer_does_not_import_the_vllm_plugin():
    """leank_infer.vllm is for vLLM's entry point (or a user) only: the light package never pulls it or vLLM in."""
    code = (
        "import sys, leank_infer; from leank_infer import LeanKModel, ChannelMask\n"
        "import leank_infer.cli, leank_infer.decode.cache, leank_infer.model.leank_model\n"
        "bad = [m for m in ('vllm', 'leank_infer.vllm') if m in sys.modules]\n"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
