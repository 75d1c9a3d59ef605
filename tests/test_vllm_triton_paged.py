"""The vLLM backend's Triton paged decode against the dense rule, on triton's CPU interpreter (fp16, fp32).

Like tests/test_triton_decode.py: the interpreter needs TRITON_INTERPRET=1 before triton is first
imported; in a full run something imported it already, so the file reruns itself in a fresh process.
"""

import os
import sys

_TRITON_PREIMPORTED = "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not _TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from test_vllm_parts import dense_leank, paged_case  # noqa: E402

from leank_infer.vllm.triton_paged import triton_paged_decode  # noqa: E402


def test_whole_file_in_a_fresh_process():
    import subprocess

    if not _TRITON_PREIMPORTED:
        pytest.skip("this process already runs the kernels on the interpreter")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]


@pytest.fixture(autouse=True)
def interpreted(request):
    if _TRITON_PREIMPORTED and request.node.name != "test_whole_file_in_a_fresh_process":
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1: covered by test_whole_file_in_a_fresh_process"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mid", [(16, 140), (16, 16), (3, 149), (5, 90)])
def test_triton_paged_equals_the_dense_rule(dtype, mid, monkeypatch):
    """Kernel on shuffled pages vs the dense rule; several splits when SPLIT_TOKENS is small."""
    from leank_infer.vllm import triton_paged

    monkeypatch.setattr(
        triton_paged, "SPLIT_TOKENS", 40
    )  # 140 middle tokens: several splits, some empty tiles
    sink, mid_end = mid
    keep, layout, q, k, v, pages, block_row = paged_case(dtype, seed=1)
    full = torch.cat([torch.arange(sink), torch.arange(mid_end, k.shape[0])])
    got = triton_paged_decode(q, k[full], v[full], pages, block_row, sink, mid_end, layout, 0.125)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    assert got.dtype == dtype
    want = dense_leank(q, k, v, keep, sink, mid_end, 0.125)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_gpu_check_runs_the_paged_kernel_check_at_cpu_size():
    """benchmarks/gpu_check.py's vllm part checks this kernel on a Llama-8B mask layer (here: interpreter, fp16)."""
    from conftest import load_benchmark

    mod = load_benchmark("gpu_check")
    (row,) = mod.part_vllm_kernel(True, torch.device("cpu"))
    assert "1 request x 300" in row["setting"] and row["result"].endswith("(ok)"), row
