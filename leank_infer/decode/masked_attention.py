"""LeanK attention over uncompressed K/V: the rule of :mod:`leank_infer.decode.rule`, with a channel scale.

Middle keys (see :func:`leank_infer.decode.rule.key_regions`) are scored with K scaled per KV head and
channel (after RoPE; the 1/sqrt(d) scale is not renormalised), the others with all channels.
A head whose channel scale is all zero may skip its middle keys entirely, as the LeanK cache does
at decode.

This is the student attention of training (with learned scalers) and the dense reference that
the compressed cache is tested against (with the binary mask). Memory is ``[queries x keys]``
per query chunk: it never builds a ``[keys x keys]`` matrix.
"""

from __future__ import annotations

import torch

from .rule import apply_softcap, attended, gqa_view, key_regions, row_recent_from, training_recent_from


def leank_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    channel_scale: torch.Tensor,
    q_positions: torch.Tensor,
    sink_size: int,
    recent_size: int,
    scaling: float,
    key_start: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    skip_zero_heads: bool = False,
    q_chunk: int = 256,
    softcap: float | None = None,
    accumu_size: int | None = None,
) -> torch.Tensor:
    """LeanK attention; returns ``[batch, queries, q_heads, head_dim]`` (the HF attention-output layout).

    Args:
        query: ``[B, Hq, Q, D]``; key, value: ``[B, Hkv, K, D]`` (post-RoPE, key j at position j).
        channel_scale: ``[Hkv, D]`` multipliers for middle keys (alpha, a binary mask, or an STE of it).
        q_positions: ``[Q]`` or ``[B, Q]`` positions of the queries among the keys.
        key_start: ``[B]`` index of each row's first real token (left padding); default 0.
        key_padding_mask: ``[B, K]`` bool, False for keys to ignore (padding).
        skip_zero_heads: heads whose scale is all zero ignore their middle keys.
        softcap: attention logit soft-capping, ``cap * tanh(logit / cap)`` after the scale (Gemma 2).
        accumu_size: None for training's rule (each query's last ``recent_size`` keys are recent); an int
            for the positional rule (:func:`~leank_infer.decode.rule.positional_recent_from`), which
            counts positions from each row's first real token.
    """
    b, hq, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    if channel_scale.shape != (hkv, d):
        raise ValueError(f"channel_scale must be [{hkv}, {d}], got {tuple(channel_scale.shape)}")
    pos = q_positions.to(key.device)
    if pos.ndim == 1:
        pos = pos.unsqueeze(0).expand(b, -1)
    start = torch.zeros(b, dtype=torch.long, device=key.device) if key_start is None else key_start.to(key.device)
    j = torch.arange(k_len, device=key.device).view(1, 1, -1)
    scale = channel_scale.to(query.dtype)
    zero_head = (channel_scale == 0).all(-1) if skip_zero_heads else torch.zeros(hkv, dtype=torch.bool)
    zero_head = zero_head.to(key.device).view(1, hkv, 1, 1, 1)
    q5 = gqa_view(query, hkv)

    outs = []
    for s in range(0, q_len, q_chunk):
        q = q5[:, :, :, s : s + q_chunk]
        p = pos[:, s : s + q_chunk].unsqueeze(-1)  # [B, q, 1]
        if accumu_size is None:
            recent_from = training_recent_from(p, recent_size)
        else:
            row = start.view(b, 1, 1)
            recent_from = row_recent_from(p, row, recent_size, accumu_size)
        visible, middle = key_regions(j, p, start.view(b, 1, 1), sink_size, recent_from)
        if key_padding_mask is not None:
            visible = visible & key_padding_mask.to(key.device).bool().unsqueeze(1)
            middle = middle & visible
        full_scores = torch.einsum("bhgqd,bhkd->bhgqk", q, key)
        mid_scores = torch.einsum("bhgqd,bhkd->bhgqk", q * scale.view(1, hkv, 1, 1, d), key)
        middle = middle.view(b, 1, 1, -1, k_len)
        scores = apply_softcap(torch.where(middle, mid_scores, full_scores) * scaling, softcap)
        keep = attended(visible.view(b, 1, 1, -1, k_len), middle, zero_head)
        scores = scores.float().masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(value.dtype)
        out = torch.einsum("bhgqk,bhkd->bhgqd", probs, value)
        outs.append(out.reshape(b, hq, -1, d))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()
