"""KV bytes per token, dense vs LeanK, from a config alone."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from leank_infer import ChannelMask
from leank_infer.estimate import estimate_kv_bytes, global_layers


def test_estimate_matches_the_formula_for_llama_8b_shapes():
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    e = estimate_kv_bytes(cfg, ratio=0.7, zero_head_fraction=0.17, dtype=torch.bfloat16)
    assert e["dense_bytes_per_token"] == 32 * 2 * 8 * 128 * 2  # 128 KiB per token
    assert e["ratio"] == pytest.approx((0.30 + 0.83) / 2)  # LEANK.md's byte floor
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
    flags = global_layers(cfg)
    assert flags.count(False) == 2 and flags.count(True) == 2
    e = estimate_kv_bytes(cfg, ratio=0.5)
    per_layer = 2 * 2 * 16 * 2
    assert e["leank_bytes_per_token"] == 2 * per_layer + 2 * (2 * 16 * 2) * (0.5 + 1.0)


def test_estimate_rejects_bad_input():
    with pytest.raises(ValueError, match="ratio"):
        estimate_kv_bytes(tiny_config(), ratio=1.2)
    with pytest.raises(ValueError, match="zero_head_fraction"):
        estimate_kv_bytes(tiny_config(), zero_head_fraction=2)
