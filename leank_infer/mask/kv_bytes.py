"""What one token costs in the K/V cache: the one formula, used by the mask's stats, the config estimate,
the capacity table and the training memory estimate.

A LeanK middle token stores the kept K channels of every (layer, KV head), and the whole V row of each
head that keeps any K channel (a head with none drops its V too). A dense token is the case where every
channel and every head is kept: ``2 x layers x kv_heads x head_dim`` values.
"""

from __future__ import annotations

import torch


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
