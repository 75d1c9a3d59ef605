"""LeanK decode of one request over vLLM's paged, packed KV cache (PyTorch; the reference of the Triton kernel).

One new query attends to the request's full-channel keys (sink + recent, from the backend's side
store) with every channel and to its middle keys ``[sink, recent_from)`` with the kept channels,
read straight from the packed page rows (:class:`~leank_infer.vllm.layout.PackedLayout`): no
dense copy of the middle K/V is made. Scores of the middle are one product of the packed K part
with a block-diagonal query (each KV head's kept channels against its query heads); values are one
product per KV head with a middle V. One softmax over both parts, as in the HF path's fast decode.
"""

from __future__ import annotations

import torch

from .layout import PackedLayout


def gather_rows(pages: torch.Tensor, block_row: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Page rows of token positions ``[start, end)`` of one request, ``[end - start, width]``.

    ``pages``: ``[num_blocks, block_size, width]``; ``block_row``: the request's block table row.
    Whole blocks are gathered (one index per block), then trimmed.
    """
    bs = pages.shape[1]
    first, last = start // bs, (end - 1) // bs + 1
    blocks = pages.index_select(0, block_row[first:last].long())
    return blocks.view(-1, pages.shape[-1])[start - first * bs : end - first * bs]


def block_query(q: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """``[nk, Hq]``: column ``h * G + g`` holds query ``(h, g)``'s channels at the packed K positions of KV head h, 0 elsewhere."""
    hkv, group, _ = q.shape
    nk = layout.k_index.numel()
    kh, kc = layout.k_index // layout.head_dim, layout.k_index % layout.head_dim
    out = q.new_zeros(nk, hkv, group)
    out[torch.arange(nk, device=q.device), kh] = q[kh, :, kc]
    return out.view(nk, hkv * group)


def paged_decode(
    q: torch.Tensor,
    full_k: torch.Tensor,
    full_v: torch.Tensor,
    pages: torch.Tensor,
    block_row: torch.Tensor,
    mid_start: int,
    mid_end: int,
    layout: PackedLayout,
    scale: float,
) -> torch.Tensor:
    """LeanK attention of one query ``[Hq, D]`` over ``full_k/v`` ``[nf, Hkv, D]`` (every channel) and the
    middle positions ``[mid_start, mid_end)`` of the pages (kept channels); ``[Hq, D]`` in q's dtype."""
    hq, d = q.shape
    hkv = layout.num_kv_heads
    g = hq // hkv
    qh = (q * scale).view(hkv, g, d)  # the scale rides on q: one pass fewer over the scores
    s_full = torch.einsum("hgd,nhd->hgn", qh, full_k.to(q.dtype)).reshape(hq, -1)
    n = mid_end - mid_start
    nk = layout.k_index.numel()
    if n <= 0 or layout.v_index.numel() == 0:
        p = torch.softmax(s_full.float(), dim=-1).view(hkv, g, -1)
        return torch.einsum("hgn,nhd->hgd", p, full_v.float()).reshape(hq, d).to(q.dtype)
    rows = gather_rows(pages, block_row, mid_start, mid_end)  # [n, width]
    if nk:
        # [Hq, nk] x [nk, n] with the rows read transposed in place (far faster than rows @ q on CPU BLAS)
        s_mid = block_query(qh, layout).t() @ rows[:, :nk].to(q.dtype).t()  # [Hq, n]
    else:  # heads keeping no K channel but a V: every middle score is 0
        s_mid = q.new_zeros(hq, n)
    if len(layout.v_heads) < hkv:  # heads keeping nothing attend to no middle key
        s_mid.masked_fill_((~layout.head_has_middle).repeat_interleave(g)[:, None], float("-inf"))
    nf = s_full.shape[1]
    p = torch.softmax(torch.cat([s_full, s_mid], dim=-1).float(), dim=-1)  # [Hq, nf + n]
    out = torch.einsum("hgn,nhd->hgd", p[:, :nf].reshape(hkv, g, nf), full_v.float())  # [Hkv, G, D]
    vals = rows[:, nk : nk + layout.v_index.numel()]  # [n, Hnz * D]
    if vals.dtype != torch.float32:
        vals = vals.float()
    p_mid = p[:, nf:].reshape(hkv, g, n)
    for i, h in enumerate(layout.v_heads):
        out[h] += p_mid[h] @ vals[:, i * d : (i + 1) * d]
    return out.reshape(hq, d).to(q.dtype)
