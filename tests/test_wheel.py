"""The package as pip installs it: the built wheel holds every file the code reads at run time, and from an
installed copy (outside the repo) the README quick start runs and an int8 kv_quant decode goes through the C++
kernel. The vLLM plugin's import from the same kind of copy: tests/vllm_plugin/test_vllm_wheel.py."""

from __future__ import annotations

import textwrap
import zipfile
from pathlib import Path

import pytest
from installed_wheel import (
    ROOT,
    build_wheel,
    install,
    package_data_files,
    readme_quick_start,
    run_installed,
    runtime_files,
    wheel_files,
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_scan_finds_the_loaders_and_refuses_one_it_cannot_read(tmp_path):
    found = runtime_files()
    # the two C++ kernels, each read next to its module (decode/quant_cpu.py, vllm/cpu_decode.py)
    assert {"leank_infer/decode/quant_cpu.cpp", "leank_infer/vllm/cpu_decode.cpp"} <= found, found
    for name in found:
        assert (ROOT / name).is_file(), name
    pkg = tmp_path / "leank_infer" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "leank_train").mkdir()
    (pkg / "a.py").write_text('from importlib import resources\nT = resources.files("leank_infer.sub") / "t.json"\n')
    (pkg / "b.py").write_text('from pathlib import Path\nS = Path(__file__).resolve().parent / "k.cpp"\n')
    assert runtime_files(tmp_path) == {"leank_infer/sub/t.json", "leank_infer/sub/k.cpp"}
    (pkg / "c.py").write_text('import os\nD = os.path.join(os.path.dirname(__file__), "data.bin")\n')
    with pytest.raises(ValueError, match=r"c\.py:2: a file loader the scan cannot read"):
        runtime_files(tmp_path)


def test_the_wheel_holds_every_file_the_code_reads(wheel):
    files = wheel_files(wheel)
    missing = sorted((runtime_files() | package_data_files()) - files)
    assert not missing, f"the wheel lacks {missing} (pyproject.toml [tool.setuptools.package-data])"
    py = {p.relative_to(ROOT).as_posix() for pkg in ("leank_infer", "leank_train") for p in (ROOT / pkg).rglob("*.py")}
    assert py <= files, sorted(py - files)[:5]
    with zipfile.ZipFile(wheel) as z:
        entry = z.read(next(n for n in files if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "leank = leank_infer.cli:main" in entry and "leank = leank_infer.vllm:register" in entry, entry


# The quick start, then an int8 decode of a prompt longer than sink + recent + accumu (a quantised middle), with
# the kernel's entry point counted: the C++ kernel must be built from the installed source and used.
INSTALLED_RUN = """
import json
from leank_infer.decode import quant_cpu

{quick_start}
calls = []
real = quant_cpu.k_scores
quant_cpu.k_scores = lambda *a: calls.append(1) or real(*a)
q = LeanKModel(m.model, m.mask, m.tokenizer, kv_quant="int8")
text = "The quick brown fox jumps over the lazy dog. " * 40
ids = m.tokenizer(text, return_tensors="pt")
q_out = q.generate(**ids, max_new_tokens=4, do_sample=False)
print(json.dumps({{
    "answer": m.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True),
    "int8_tokens": q_out.shape[1] - ids["input_ids"].shape[1],
    "kernel_source": str(quant_cpu.SOURCE_PATH), "kernel_loaded": quant_cpu.LIBRARY.lib is not None,
    "kernel_calls": len(calls), "prompt": ids["input_ids"].shape[1],
}}))
"""


@pytest.mark.slow
def test_the_installed_package_runs_the_quick_start_and_the_int8_kernel(wheel, tmp_path):
    target = install(wheel, tmp_path / "site")
    work = tmp_path / "work"
    work.mkdir()
    code = INSTALLED_RUN.format(quick_start=readme_quick_start())
    out = run_installed(textwrap.dedent(code), target, work)
    assert out["answer"].strip(), out
    assert out["prompt"] > 16 + 64 + 16 and out["int8_tokens"] == 4, out
    assert out["kernel_source"].startswith(str(target.resolve())), out
    assert out["kernel_loaded"] and out["kernel_calls"] > 0, f"the int8 decode did not use the C++ kernel: {out}"
