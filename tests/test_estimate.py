"""KV bytes per token, dense vs LeanK, from a config alone."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from leank_infer import ChannelMask
from leank_infer.mask import dense_layers_of
from leank_infer.mask.estimate import estimate_kv_bytes


def test_estimate_matches_the_formula_for_llama_8b_shapes():
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    e = estimate_kv_bytes(cfg, ratio=0.7, zero_head_fraction=0.17, dtype=torch.bfloat16)
    assert e["dense_bytes_per_token"] == 32 * 2 * 8 * 128 * 2  # 128 KiB per token
    assert e["ratio"] == pytest.approx((0.30 + 0.83) / 2)  # the byte floor of docs/rule.md, "Bytes per token"
    assert estimate_kv_bytes(cfg, ratio=0.0)["ratio"] == pytest.approx(1.0)


def test_estimate_with_a_mask_equals_mask_stats():
    cfg = tiny_config("qwen3")
    mask = ChannelMask.from_scores(torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(0)), 0.6, 4)
    e = estimate_kv_bytes(cfg, dtype=torch.float16, mask=mask)
    s = mask.stats(cfg, dtype=torch.float16)["bytes_per_token"]
    assert (e["dense_bytes_per_token"], e["leank_bytes_per_token"]) == (s["dense"], s["leank"])


def test_sliding_layers_stay_dense():
    from transformers import Gemma2Config

    cfg = Gemma2Config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       hidden_size=64, intermediate_size=64, vocab_size=64)
    assert dense_layers_of(cfg) == (0, 2)
    e = estimate_kv_bytes(cfg, ratio=0.5)
    per_layer = 2 * 2 * 16 * 2
    assert e["leank_bytes_per_token"] == 2 * per_layer + 2 * (2 * 16 * 2) * (0.5 + 1.0)


def test_estimate_rejects_bad_input():
    with pytest.raises(ValueError, match="ratio"):
        estimate_kv_bytes(tiny_config(), ratio=1.2)
    with pytest.raises(ValueError, match="zero_head_fraction"):
        estimate_kv_bytes(tiny_config(), zero_head_fraction=2)


# Which layers slide, written out by hand for each family config (not derived from either function).
SLIDING_CASES = {
    "llama": ("llama", {}, ()),
    "qwen2": ("qwen2", {}, ()),
    "qwen3": ("qwen3", {}, ()),
    "mistral": ("mistral", {}, ()),
    "gemma2": ("gemma2", {}, (0,)),
    "gemma3": ("gemma3", {}, (0,)),
    "phi3": ("phi3", {}, ()),
    "gemma2-4-layers": ("gemma2", {"num_hidden_layers": 4}, (0, 2)),
    "mistral-window-16": ("mistral", {"sliding_window": 16}, (0, 1)),
    "phi3-window-16": ("phi3", {"sliding_window": 16}, (0, 1)),
    # Phi-3-128k: a window as long as the positions never bites, so every layer is global
    "phi3-window-eq-max-positions": ("phi3", {"sliding_window": 4096, "max_position_embeddings": 4096}, ()),
    "qwen2-window-from-layer-1": ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, (1,)),
    "qwen2-window-off": ("qwen2", {"use_sliding_window": False, "sliding_window": 16}, ()),
    "qwen3-window-from-layer-1": ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, (1,)),
}


@pytest.mark.parametrize("case", sorted(SLIDING_CASES))
def test_one_rule_for_which_layers_slide(case):
    """The estimate and the mask (validate, binarize, training) agree on the sliding layers of every family."""
    family, overrides, sliding = SLIDING_CASES[case]
    cfg = tiny_config(family, **overrides)
    assert dense_layers_of(cfg) == sliding
    e = estimate_kv_bytes(cfg, ratio=0.5)
    assert e["global_layers"] == cfg.num_hidden_layers - len(sliding)
    per_layer = 2 * 2 * 16 * 2  # K+V, 2 KV heads, head_dim 16, bf16
    assert e["leank_bytes_per_token"] == len(sliding) * per_layer + e["global_layers"] * (2 * 16 * 2) * (0.5 + 1.0)
