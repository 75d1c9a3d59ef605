"""Hybrid models: LeanK on the full-attention layers, vLLM's own attention on the sliding-window ones.

Tiny random Gemma 2 and Gemma 3 models (layers alternating sliding-window and full attention, written by
``benchmarks/vllm_hybrid.py``), each engine in its own process. The greedy tokens equal ``LeanKModel`` (the
transformers path, which leaves the windowed layers whole) under the ``"dense-prompt"`` rule, the plugin's
default, on the same weights and mask.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import vllm_hybrid  # noqa: E402

NEW_TOKENS = 16


def reference(model: Path, mask: Path, rule: str = "dense-prompt") -> list[list[int]]:
    """``LeanKModel(rule=rule).generate`` greedy tokens of the benchmark's prompts, from the main environment."""
    python = os.environ.get("LEANK_REF_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    if not Path(python).exists():
        pytest.skip(f"no main environment at {python} for the LeanKModel reference (set LEANK_REF_PYTHON)")
    job = {"model": str(model), "mask": str(mask), "prompts": vllm_hybrid.prompts(), "max_new_tokens": NEW_TOKENS,
           "rule": rule}  # fmt: skip
    run = subprocess.run(
        [python, str(ROOT / "tests" / "vllm_plugin" / "reference.py")], input=json.dumps(job), capture_output=True,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=1800,
    )  # fmt: skip
    if run.returncode:
        raise AssertionError(f"reference run failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])["tokens"]


class _Layer:
    """An attention layer as ``_share_pages`` reads it: its spec (vLLM's, for a windowed layer) and backend."""

    def __init__(self, spec):
        self.spec = spec

    def get_kv_cache_spec(self, _config):
        return self.spec

    def get_attn_backend(self):
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend


@pytest.mark.parametrize(("layers", "keep", "user_block"), [(4, 0.4, False), (30, 0.3, False), (4, 0.4, True)])
def test_pages_are_shared_without_padding_the_windowed_layers(layers, keep, user_block):
    """LeanK's page holds its widest row for its block and a whole number of the windowed kernel's blocks of a
    windowed layer's rows; the windowed spec is vLLM's with that page's block size, unpadded; rounding wastes at
    most 1/8 of a page where a block up to 128 tokens allows it, and a block named by --block-size is kept."""
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from leank_infer.mask import ChannelMask
    from leank_infer.vllm.backend import _share_pages
    from leank_infer.vllm.kv_specs import kv_specs
    from leank_infer.vllm.pool import WorkerPlan

    mask = ChannelMask(keep=torch.rand(layers, 1, 64, generator=torch.Generator().manual_seed(layers)) < keep,
                       sink_size=16, recent_size=32, accumu_size=16, ratio=1 - keep, align=1)  # fmt: skip
    full = list(range(1, layers, 2))
    plan = WorkerPlan.build(mask, full, block_size=48 if user_block else 16)
    sliding = SlidingWindowSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=torch.float32, sliding_window=48)
    windowed = [type("Impl", (), {"attention_layer": _Layer(sliding)})() for _ in range(layers - len(full))]
    first = type("First", (), {"kv_cache_torch_dtype": torch.float32})()
    shared, page = _share_pages(plan, windowed, first, None, user_block)
    row = 4 * max(plan.packed_row, plan.window_row)
    packed, window = kv_specs(shared, torch.float32, None, page)
    assert packed.page_size_bytes == window.page_size_bytes == page >= shared.block_size * row
    specs = [w.attention_layer.get_kv_cache_spec(None) for w in windowed]
    per_token = 2 * 64 * 4
    assert all(isinstance(s, SlidingWindowSpec) and s.page_size_padded is None for s in specs)
    assert all(s.block_size * per_token == s.page_size_bytes == page and s.block_size % 32 == 0 for s in specs)
    if user_block:
        assert shared.block_size == 48
    else:
        assert (page - shared.block_size * row) * 8 <= page
        assert shared.block_size == min(
            b for b in range(16, 129, 16) if (-(-b * row // (32 * per_token)) * 32 * per_token - b * row) * 8
            <= -(-b * row // (32 * per_token)) * 32 * per_token
        )


@pytest.fixture(scope="module", params=vllm_hybrid.FAMILIES)
def served(request, tmp_path_factory):
    """(family, model, mask, the LeanK engine's record)."""
    family = request.param
    model, mask = vllm_hybrid.build(family, tmp_path_factory.mktemp(family))
    return family, model, mask, vllm_hybrid.engine(model, mask, new_tokens=NEW_TOKENS)


@pytest.mark.slow
def test_greedy_tokens_equal_leank_model(served):
    """vLLM with LeanK gives LeanKModel's tokens; pruning changes them on this config (a full mask would not give
    them), so serving the full-attention layers whole, or pruning a windowed layer, would fail here."""
    family, model, mask, record = served
    tokens = record["tokens"]
    assert tokens == reference(model, mask), family
    from leank_infer.mask import ChannelMask

    full = ChannelMask.from_pretrained(str(mask))
    full.keep[:] = True
    full_dir = mask.parent / "full-mask"
    full.save_pretrained(full_dir)
    assert tokens != reference(model, full_dir), f"{family}: the mask changes no token, the test could not tell"


@pytest.mark.slow
def test_windowed_layers_keep_vllms_attention_and_spec(served):
    """The sliding-window layers are vLLM's own (a SlidingWindowSpec group each, no LeanK state); LeanK runs the
    full-attention layers only; every group has one page size, the windowed pages filled exactly and LeanK's
    padded by at most 1/8 (vLLM, left alone, would pad LeanK's pages to the windowed layers' larger ones)."""
    family, _, _, record = served
    full = [i for i, t in enumerate(vllm_hybrid.LAYER_TYPES) if t == "full_attention"]
    windowed = [i for i, t in enumerate(vllm_hybrid.LAYER_TYPES) if t != "full_attention"]
    assert record["leank_layers"] == [f"model.layers.{i}.self_attn.attn" for i in full], family
    sliding = [g for g in record["groups"] if g["spec"] == "SlidingWindowSpec"]
    assert sorted(name for g in sliding for name in g["layers"]) == [f"model.layers.{i}.self_attn.attn" for i in windowed]
    assert len({g["page_bytes"] for g in record["groups"]}) == 1
    per_token = 2 * 1 * vllm_hybrid.HEAD_DIM * 4  # K+V of one KV head, fp32
    assert all(g["block_size"] * per_token == g["page_bytes"] for g in sliding)
    assert {g["spec"] for g in record["groups"]} == {"SlidingWindowSpec", "FullAttentionSpec", "LeanKWindowSpec"}
    (packed,) = [g for g in record["groups"] if g["spec"] == "FullAttentionSpec"]  # LeanK's pages: little padding
    assert (packed["page_bytes"] - packed["block_size"] * 4 * record["packed_row"]) * 8 <= packed["page_bytes"]
