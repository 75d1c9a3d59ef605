"""What one token costs in the K/V cache: the one formula, used by the mask's stats, the config estimate,
the capacity table and the training memory estimate.

A LeanK middle token stores the kept K channels of every (layer, KV head), and the whole V row of each
head that keeps any K channel (a head with none drops its V too). A dense token is the case where every
channel and every head is kept: ``2 x layers x kv_heads x head_dim`` values. A kv_quant middle token
(:func:`quantized_middle_bytes`) stores codes of a few bits plus the scales and minima of its groups.
"""

from __future__ import annotations

from typing import Any

import torch

#: bytes of one kv_quant scale or minimum (float16, whatever the model's dtype: leank_infer.decode.kv_quant)
PARAM_BYTES = 2


def value_bytes(dtype: torch.dtype | int) -> int:
    """Bytes of one cached value: the element size of ``dtype`` (an int is taken as that size)."""
    return dtype if isinstance(dtype, int) else torch.empty((), dtype=dtype).element_size()


def kv_token_bytes(k_channels: float, v_heads: float, head_dim: int, dtype: torch.dtype | int) -> float:
    """K+V bytes of one token that keeps ``k_channels`` K channels and the V rows of ``v_heads`` heads,
    summed over the layers counted (an int for real counts; a float for an expected count)."""
    return (k_channels + v_heads * head_dim) * value_bytes(dtype)


def dense_token_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype | int) -> int:
    """K+V bytes of one token of a dense cache: every channel of every head in ``layers`` layers."""
    return int(kv_token_bytes(layers * kv_heads * head_dim, layers * kv_heads, head_dim, dtype))


def kept_token_bytes(kept_counts: torch.Tensor, head_dim: int, dtype: torch.dtype | int) -> int:
    """K+V bytes of one LeanK middle token, from kept channel counts per (layer, KV head) (any shape)."""
    return int(kv_token_bytes(int(kept_counts.sum()), int((kept_counts > 0).sum()), head_dim, dtype))


def quantized_middle_bytes(kept_counts: torch.Tensor, head_dim: int, tokens: int, k_groups: int, open_tokens: int,
                           fmt: Any, dtype: torch.dtype | int) -> int:
    """Bytes of a kv_quant middle of ``tokens`` tokens (:mod:`leank_infer.decode.kv_quant`), one sequence, the
    layers of ``kept_counts`` (kept channels per (layer, KV head), any shape), everything counted:

    - codes: per token, ``ceil(c * bits / 8)`` bytes of K per head keeping ``c`` channels, and
      ``ceil(head_dim * bits / 8)`` of V per head keeping any;
    - K's scale and minimum (float16) per kept channel and K group; the tokens span ``k_groups`` groups;
    - V's scale and minimum per token, head keeping any, and ``v_group`` channels;
    - ``open_tokens`` tokens of a half-filled K group also held in ``dtype`` (their kept K channels).
    """
    counts = [int(c) for c in kept_counts.flatten().tolist()]
    nonzero = sum(1 for c in counts if c)
    kept = sum(counts)
    k_codes = sum(fmt.packed(c) for c in counts)
    v_codes = nonzero * fmt.packed(head_dim)
    v_params = nonzero * (head_dim // fmt.v_group_for(head_dim)) * 2 * PARAM_BYTES
    return (tokens * (k_codes + v_codes + v_params) + k_groups * kept * 2 * PARAM_BYTES
            + open_tokens * kept * value_bytes(dtype))


def quantized_token_bytes(kept_counts: torch.Tensor, head_dim: int, fmt: Any) -> float:
    """Bytes of one kv_quant middle token, K's parameters shared over ``fmt.k_group`` tokens (the long-context
    rate: :func:`quantized_middle_bytes` of ``n`` tokens over ``n``, as ``n`` grows)."""
    kept = int(kept_counts.sum())
    return quantized_middle_bytes(kept_counts, head_dim, 1, 0, 0, fmt, 1) + kept * 2 * PARAM_BYTES / fmt.k_group


def prefilled_cache_bytes(mask: Any, tokens: int, dtype: torch.dtype | int, fmt: Any = None) -> int:
    """Bytes of one sequence's LeanK cache right after a prefill of ``tokens`` tokens: the sink and the keys from
    the next query's recent start on full (``mask.full_token_count``: the last ``recent_size`` to
    ``recent_size + accumu_size - 1``), the rest the middle (``fmt``: quantised, its first
    write ending on a K group boundary, so no open group); the mask's dense layers keep every token."""
    pruned = [i for i in range(mask.num_layers) if i not in mask.dense_layers]
    counts = mask.keep[pruned].sum(-1)
    hkv, hd = mask.keep.shape[1], mask.keep.shape[2]
    full, n = mask.full_token_count(tokens)
    out = tokens * dense_token_bytes(len(mask.dense_layers), hkv, hd, dtype) + full * dense_token_bytes(
        len(pruned), hkv, hd, dtype)
    if fmt is None:
        return out + n * kept_token_bytes(counts, hd, dtype)
    return out + quantized_middle_bytes(counts, hd, n, -(-n // fmt.k_group), 0, fmt, dtype)


def hf_quantized_cache_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int, bits: int,
                             dtype: torch.dtype | int, group: int = 64, residual: int = 0) -> int:
    """Bytes of transformers' ``QuantizedCache`` (quanto backend) holding ``tokens`` tokens, ``residual`` of them
    in full precision: per other token, layer, KV head, K and V each ``head_dim * bits / 8`` bytes of codes
    plus a scale and a zero point (in ``dtype``) per ``group`` values."""
    per = 2 * layers * kv_heads * (head_dim * bits // 8 + 2 * value_bytes(dtype) * (head_dim // group))
    return (tokens - residual) * per + residual * dense_token_bytes(layers, kv_heads, head_dim, dtype)
