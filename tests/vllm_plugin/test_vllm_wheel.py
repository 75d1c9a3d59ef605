"""The vLLM plugin as pip installs it: from the built wheel installed into a scratch folder (outside the repo,
vLLM and the other dependencies from this environment), vLLM's own plugin loader finds the installed entry
point, its backends take vLLM's CPU_ATTN and TRITON_ATTN slots, and the CPU decode kernel builds from the
installed C++ source. The main environment's part: tests/test_wheel.py."""

from __future__ import annotations

import pytest
from installed_wheel import build_wheel, install, run_installed

INSTALLED_PLUGIN = """
import json, sys
from importlib.metadata import distribution
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.registry import AttentionBackendEnum

load_general_plugins()  # what every vLLM process does: the vllm.general_plugins entry points
cpu, triton = AttentionBackendEnum.CPU_ATTN.get_path(), AttentionBackendEnum.TRITON_ATTN.get_path()
backend = AttentionBackendEnum.CPU_ATTN.get_class()
from leank_infer.vllm import cpu_decode

eps = [e.value for e in distribution("leank").entry_points if e.group == "vllm.general_plugins"]
print(json.dumps({
    "dist": str(distribution("leank").locate_file("")), "entry_points": eps,
    "cpu_attn": cpu, "triton_attn": triton, "backend_file": sys.modules[backend.__module__].__file__,
    "kernel": cpu_decode.available(), "kernel_source": str(cpu_decode.SOURCE_PATH),
}))
"""


@pytest.mark.slow
def test_the_installed_plugin_loads_through_vllms_entry_point(tmp_path):
    from leank_infer.vllm import BACKEND, CUDA_BACKEND

    target = install(build_wheel(tmp_path / "wheel"), tmp_path / "site")
    work = tmp_path / "work"
    work.mkdir()
    out = run_installed(INSTALLED_PLUGIN, target, work)
    site = str(target.resolve())
    assert out["dist"].startswith(site) and out["entry_points"] == ["leank_infer.vllm:register"], out
    assert (out["cpu_attn"], out["triton_attn"]) == (BACKEND, CUDA_BACKEND), out
    assert out["backend_file"].startswith(site), out
    assert out["kernel"] and out["kernel_source"].startswith(site), f"the CPU decode kernel did not build: {out}"
