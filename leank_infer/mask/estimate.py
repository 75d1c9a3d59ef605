"""KV-cache bytes per token, dense vs LeanK, for any transformers config (no weights needed).

Why: before training a mask for a 70B model, a user wants to know what it buys. Sliding-window
layers keep their own cache (LeanK prunes only global layers), so they count as dense.
"""

from __future__ import annotations

from typing import Any

import torch

from .binarize import check_ratio_align
from .channel_mask import ChannelMask
from .layers import dense_layers_of, model_shape


def global_layers(config: Any) -> list[bool]:
    """Per layer: True where attention is global (LeanK applies), False for sliding-window layers.

    The complement of :func:`leank_infer.mask.dense_layers_of`, the one rule for which layers slide,
    so the estimate counts as dense exactly the layers a mask leaves whole.
    """
    layers, _, _ = model_shape(config)
    dense = set(dense_layers_of(config))
    return [i not in dense for i in range(layers)]


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
    item = torch.empty((), dtype=dtype).element_size()
    per_layer_dense = 2 * kv_heads * head_dim * item
    is_global = global_layers(config)
    leank = 0.0
    for layer, g in enumerate(is_global):
        if not g:
            leank += per_layer_dense
        elif mask is not None:
            counts = mask.kept_counts[layer]
            leank += (int(counts.sum()) + int((counts > 0).sum()) * head_dim) * item
        else:
            leank += kv_heads * head_dim * item * ((1 - ratio) + (1 - zero_head_fraction))
    dense = per_layer_dense * layers
    return {
        "layers": layers,
        "global_layers": sum(is_global),
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": str(dtype).replace("torch.", ""),
        "dense_bytes_per_token": dense,
        "leank_bytes_per_token": int(round(leank)),
        "ratio": leank / dense,
    }
