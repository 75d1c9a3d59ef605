"""benchmarks/gpu_check.py on the CPU: argument parsing, the no-GPU message, the time budget, and the
CPU-sized variant of every part (the GPU numbers themselves are measured only on a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_benchmark


@pytest.fixture(scope="module")
def gpu_check():
    return load_benchmark("gpu_check")


def test_arguments(gpu_check):
    a = gpu_check.parse_args([])
    assert a.parts == ["kernel", "decode", "train", "vllm"] and not a.cpu_small
    assert a.out == Path("gpu_check.md") and a.budget_s < 480  # the whole run stays under 8 minutes
    assert gpu_check.parse_args(["--parts", "decode, train"]).parts == ["decode", "train"]
    for bad in (["--parts", "kernel,warp"], ["--parts", ""], ["--new-tokens", "1"], ["--train-context", "100"]):
        with pytest.raises(SystemExit) as e:
            gpu_check.parse_args(bad)
        assert e.value.code == 2, bad
    assert gpu_check.DECODE_GPU == [(52, 4096), (8, 32768)]  # the paper's batch 52 x 4k, and 8 x 32k


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_a_gpu_it_says_so(gpu_check, tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path / "t.md")]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "--cpu-small" in err and not (tmp_path / "t.md").exists()


def test_time_budget_skips_parts_and_still_writes_the_table(gpu_check, tmp_path, capsys):
    out = tmp_path / "sub" / "t.md"
    assert gpu_check.main(["--cpu-small", "--budget-s", "0", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.count("skipped: time budget") == 4 and "| part | setting | result |" in text
    assert capsys.readouterr().out.rstrip().endswith(text.rstrip().splitlines()[-1])  # the table is printed last


def test_vllm_part_reports_what_is_importable(gpu_check):
    (row,) = gpu_check.part_vllm_engine(True, torch.device("cpu"), lambda: False)
    assert row["part"] == "vllm"
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001
        assert row["result"].startswith("skipped: vllm not importable")
    else:
        assert row["result"].startswith("importable") and "engine run skipped (GPU only)" in row["result"]


def test_the_vllm_engines_start_with_no_attention_backend_argument(gpu_check):
    """A GPU user names a mask and nothing else: the engines of the vllm part are started that way (the backend
    vLLM picks serves LeanK; tests/vllm_plugin/test_vllm_cuda_wiring.py runs the CPU-sized engine)."""
    for small in (False, True):
        plain, leank = gpu_check.engine_args("m", None, small), gpu_check.engine_args("m", "the-mask", small)
        assert not [k for k in (*plain, *leank) if "attention" in k], (plain, leank)
        assert {k: v for k, v in leank.items() if k != "additional_config"} == plain
        assert leank["additional_config"]["leank_mask"] == "the-mask"
    full = gpu_check.engine_args("m", None, False)
    assert (full["max_model_len"], full["kv_cache_memory_bytes"], full["dtype"]) == (32768, 8 * 2**30, "bfloat16")
    source = Path(gpu_check.__file__).read_text()
    assert "--attention-backend" not in source and "attention_backend" not in source


def test_the_full_size_model_is_the_8b_config(gpu_check):
    """The GPU decode/train parts build Llama-3.1-8B-Instruct's shape (meta device here: no memory)."""
    cfg = gpu_check.llama_config(small=False)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim) == (32, 4096, 8, 128)
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.max_position_embeddings == 131072
    model = gpu_check.build_model(False, torch.device("meta"), torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    gpu_check.llama_mask(False).validate(model.config)


@pytest.mark.slow
@pytest.mark.filterwarnings(r"ignore:Found \d+ module\(s\) in eval mode")
def test_cpu_sized_variant_of_every_part(gpu_check, tmp_path, monkeypatch, capsys):
    """Every part runs at CPU size; a failing part becomes a FAILED row (exit 1) and the others still report."""

    def broken(*args):
        raise RuntimeError("plugin exploded")

    monkeypatch.setattr(gpu_check, "part_vllm", broken)
    out = tmp_path / "t.md"
    rc = gpu_check.main(["--cpu-small", "--out", str(out), "--new-tokens", "3", "--train-steps", "2"])
    text = out.read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ") and "---" not in line}
    assert rc == 1 and "FAILED: RuntimeError: plugin exploded" in rows["vllm"]
    assert rows["kernel"].rstrip(" |").endswith("ok")  # the kernel check passed on the interpreter
    decode = [line for line in text.splitlines() if line.startswith("| decode")]
    assert len(decode) == 2 and all("dense" in d and "LeanK" in d and "speedup" in d for d in decode)
    assert "s/step" in rows["train"] and "estimate" in rows["train"]
    assert capsys.readouterr().out.rstrip().endswith(text.rstrip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_vllm_kernel_checks_at_cpu_size(gpu_check):
    """The vLLM part's kernel checks on the interpreter (fp16, the 2-layer Llama mask): the decode against the
    PyTorch reference, the write against the PyTorch write, and the LeanK decode with a full-keep mask
    against vLLM's own (vendored) Triton attention; the GPU-only timings and graph capture say so."""
    from leank_infer.vllm import triton_paged

    if not triton_paged.interpreted():
        pytest.skip("triton was loaded without TRITON_INTERPRET=1")
    rows = gpu_check.part_vllm(True, torch.device("cpu"), lambda: False)
    results = [r["result"] for r in rows]
    assert len(rows) == 6 and all(r["part"] == "vllm" for r in rows), rows
    assert all(r.endswith("(ok)") for r in results[:3]), results
    assert "vs PyTorch reference" in rows[0]["setting"] and "fp8 e5m2" in results[0]
    assert "0 bytes differ" in results[1] and "vLLM Triton attention" in rows[2]["setting"]
    assert results[3] == results[4] == "unmeasured: no GPU", results
    assert "vllm" in results[5]  # the engine part: not importable here, or GPU only


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_vllm_gpu_paths_run_on_cpu_stand_ins(gpu_check):
    """The GPU-only code of the vLLM part, with a CPU timer and a 'capture' that replays eagerly: the speed
    table's plumbing (both kernels at each size) and the graph case's in-place refill and comparison."""
    from types import SimpleNamespace

    from leank_infer.vllm import triton_paged

    if not triton_paged.interpreted():
        pytest.skip("triton was loaded without TRITON_INTERPRET=1")
    mask = gpu_check._vllm_mask(True)
    cpu = torch.device("cpu")
    rows = gpu_check.speed_rows(mask, cpu, [(1, 100), (2, 200)], lambda fn, device: (fn(), (1.0, "cpu"))[1])
    assert [r["setting"][:13] for r in rows] == ["batch 1 x 100", "batch 2 x 200"]
    assert all("LeanK 1.0000 ms vs vLLM Triton 1.0000 ms" in r["result"] for r in rows), rows
    eager = lambda fn: SimpleNamespace(replay=fn)  # noqa: E731
    row = gpu_check.graph_case(mask, 1, 16, True, cpu, lengths=([90, 17, 0], [200, 1, 0]), capture=eager, repeats=1)
    assert "output True, pages True" in row["result"] and "(ok)" in row["result"], row
