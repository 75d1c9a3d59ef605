"""KV-cache bytes per token, dense vs LeanK, for any transformers config (no weights needed).

Why: before training a mask for a 70B model, a user wants to know what it buys. Sliding-window
layers keep their own cache (LeanK prunes only global layers), so they count as dense.
"""

from __future__ import annotations

from typing import Any

import torch

from .binarize import check_ratio_align
from .channel_mask import ChannelMask
from .kv_bytes import dense_token_bytes, kept_token_bytes, kv_token_bytes
from .layers import dense_layers_of, model_shape


def estimate_kv_bytes(
    config: Any,
    ratio: float = 0.7,
    zero_head_fraction: float = 0.0,
    dtype: torch.dtype = torch.bfloat16,
    mask: ChannelMask | None = None,
) -> dict[str, Any]:
    """Bytes of K+V per token (all layers) dense and with LeanK at ``ratio`` of K channels pruned.

    Without a mask, every global layer keeps ``1 - ratio`` of its K channels and a
    ``zero_head_fraction`` of its KV heads store no middle V (the paper measured 16-18% on 7-8B
    models; 0 is the conservative default). With ``mask``, its real counts are used.
    """
    layers, kv_heads, head_dim = model_shape(config)
    check_ratio_align(ratio, 1, head_dim)
    if not 0.0 <= zero_head_fraction <= 1.0:
        raise ValueError(f"zero_head_fraction must be in [0, 1], got {zero_head_fraction}")
    dense_layers = set(dense_layers_of(config))  # sliding-window layers keep their own, dense cache
    pruned = [i for i in range(layers) if i not in dense_layers]
    if mask is not None:
        leank = dense_token_bytes(len(dense_layers), kv_heads, head_dim, dtype) + kept_token_bytes(
            mask.kept_counts[pruned], head_dim, dtype
        )
    else:
        k_kept, v_kept = kv_heads * head_dim * (1 - ratio), kv_heads * (1 - zero_head_fraction)
        leank = dense_token_bytes(len(dense_layers), kv_heads, head_dim, dtype) + len(pruned) * kv_token_bytes(
            k_kept, v_kept, head_dim, dtype
        )
    dense = dense_token_bytes(layers, kv_heads, head_dim, dtype)
    return {
        "layers": layers,
        "global_layers": len(pruned),
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": str(dtype).replace("torch.", ""),
        "dense_bytes_per_token": dense,
        "leank_bytes_per_token": int(round(leank)),
        "ratio": leank / dense,
    }
