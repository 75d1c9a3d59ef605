"""The LeanK attention rule over uncompressed K/V: where the channel mask applies.

A query at position ``p`` scores keys in ``[start, start + sink)`` and ``[p - recent, p]`` with
all channels and the middle keys ``[start + sink, p - recent)`` with only the kept channels
(K scaled per KV head and channel, after RoPE; the 1/sqrt(d) scale is not renormalised).
``start`` is the first real token of the row (left padding). A head whose channel scale is all
zero may skip its middle keys entirely, as the LeanK cache does at decode.

This is the student attention of training (with learned scalers) and the dense reference that
the compressed cache is tested against (with the binary mask). Memory is ``[queries x keys]``
per query chunk: it never builds a ``[keys x keys]`` matrix.
"""

from __future__ import annotations

import torch


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
    """
    b, hq, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    groups = hq // hkv
    if channel_scale.shape != (hkv, d):
        raise ValueError(f"channel_scale must be [{hkv}, {d}], got {tuple(channel_scale.shape)}")
    pos = q_positions.to(key.device)
    if pos.ndim == 1:
        pos = pos.unsqueeze(0).expand(b, -1)
    start = torch.zeros(b, dtype=torch.long, device=key.device) if key_start is None else key_start.to(key.device)
    j = torch.arange(k_len, device=key.device)
    scale = channel_scale.to(query.dtype)
    zero_head = (channel_scale == 0).all(-1) if skip_zero_heads else torch.zeros(hkv, dtype=torch.bool)
    zero_head = zero_head.to(key.device).view(1, hkv, 1, 1, 1)

    outs = []
    for s in range(0, q_len, q_chunk):
        q = query[:, :, s : s + q_chunk].reshape(b, hkv, groups, -1, d)
        p = pos[:, s : s + q_chunk]  # [B, q]
        jj = j.view(1, 1, -1)
        st = start.view(b, 1, 1)
        valid = (jj <= p.unsqueeze(-1)) & (jj >= st)  # causal and not left padding
        if key_padding_mask is not None:
            valid = valid & key_padding_mask.to(key.device).bool().unsqueeze(1)
        middle = (jj >= st + sink_size) & (jj < p.unsqueeze(-1) - recent_size)  # [B, q, K]
        full_scores = torch.einsum("bhgqd,bhkd->bhgqk", q, key)
        mid_scores = torch.einsum("bhgqd,bhkd->bhgqk", q * scale.view(1, hkv, 1, 1, d), key)
        middle = middle.view(b, 1, 1, -1, k_len)
        scores = torch.where(middle, mid_scores, full_scores) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        keep = valid.view(b, 1, 1, -1, k_len) & ~(middle & zero_head)
        scores = scores.float().masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(value.dtype)
        out = torch.einsum("bhgqk,bhkd->bhgqd", probs, value)
        outs.append(out.reshape(b, hq, -1, d))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()
