"""LeanK decode over vLLM's paged, packed KV cache (PyTorch; the reference of the Triton kernel).

Each request's new query attends to its full-channel keys (sink + recent, from the backend's side
store) with every channel and to its middle keys ``[mid_start, mid_end)`` with the kept channels,
read from the packed page rows (:class:`~leank_infer.vllm.layout.PackedLayout`) through the block
table. :func:`paged_decode_batch` does every decode request of a step at once: one gather of the
middle's pages of all requests (padded to the longest, masked per request), one batched product
of the packed K part with a block-diagonal query (each KV head's kept channels against its query
heads), one softmax over both parts, and one batched product per KV head with a middle V: the op
count per layer does not grow with the batch. At long contexts its cost is the three passes over the
middle's rows (gather, K product, V product), not Python; for fp32 on CPU the backend uses the fused
kernel of :mod:`~leank_infer.vllm.cpu_kernel` (one pass), and this path is its reference.
"""

from __future__ import annotations

import torch

from .layout import PackedLayout


def block_query(q: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """``[B, nk, Hq]`` from ``q`` ``[B, Hkv, G, D]``: column ``h * G + g`` holds query ``(h, g)``'s channels
    at the packed K positions of KV head h, 0 elsewhere (so one product scores every head's kept channels)."""
    b, hkv, group, d = q.shape
    sel = q.transpose(2, 3).reshape(b, hkv * d, group).index_select(1, layout.k_index)  # [B, nk, G]
    onehot = layout.k_head_onehot(q.dtype)  # [nk, Hkv, 1]
    return (sel[:, :, None, :] * onehot).view(b, -1, hkv * group)


def paged_decode_batch(
    q: torch.Tensor,
    full_k: torch.Tensor,
    full_v: torch.Tensor,
    full_len: torch.Tensor,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    mid_start: int,
    mid_end: list[int],
    layout: PackedLayout,
    scale: float,
) -> torch.Tensor:
    """LeanK attention of B queries ``[B, Hq, D]``; ``[B, Hq, D]`` in q's dtype.

    ``full_k/v`` ``[B, F, Hkv, D]``: each request's full-channel keys, padded; ``full_len`` ``[B]``
    (long, on q's device): how many of them are real. ``pages`` ``[num_blocks, block_size, width]``;
    ``block_table`` ``[B, >= blocks]``: each request's blocks; the middle of request i is positions
    ``[mid_start, mid_end[i])``. Positions gathered past a request's middle (padding up to the
    longest) get probability 0; they read other slots of vLLM's pool, which vLLM allocates zeroed
    and which only ever hold finite packed rows, so ``0 * value`` stays 0.
    """
    b, hq, d = q.shape
    hkv = layout.num_kv_heads
    g = hq // hkv
    f = full_k.shape[1]
    qh = (q * scale).view(b, hkv, g, d)  # the scale rides on q: one pass fewer over the scores
    s_full = torch.einsum("bhgd,bnhd->bhgn", qh, full_k.to(q.dtype)).reshape(b, hq, f)
    bs = pages.shape[1]
    first = mid_start // bs
    last = -(-max(mid_end) // bs)
    nk, nv = layout.k_index.numel(), layout.v_index.numel()
    dev = q.device
    if last <= first or nv == 0 or max(mid_end) <= mid_start:  # no middle key in the batch
        n = 0
        s = s_full
    else:
        blocks = block_table[:, first:last].reshape(-1).long()
        n = (last - first) * bs
        rows = pages.index_select(0, blocks).view(b, n, pages.shape[-1])  # [B, n, width]
        # [B, Hq, nk] x [B, nk, n] with the rows read transposed in place (far faster than rows @ q on CPU BLAS)
        s_mid = torch.bmm(
            block_query(qh, layout).transpose(1, 2), rows[:, :, :nk].to(q.dtype).transpose(1, 2)
        )
        s = torch.cat([s_full, s_mid], dim=-1)  # [B, Hq, f + n]
    # one additive mask over both parts (0 or -inf): padded full keys, and middle positions outside
    # [mid_start, mid_end[i]) (an add is several times cheaper than a broadcast masked_fill on CPU)
    col = torch.arange(f + n, device=dev)
    pos = col - f + first * bs
    ends = torch.tensor(mid_end, device=dev)[:, None]
    dead = torch.where(col < f, col >= full_len[:, None], (pos < mid_start) | (pos >= ends))  # [B, f + n]
    s = s + torch.zeros(dead.shape, dtype=s.dtype, device=dev).masked_fill_(dead, float("-inf"))[:, None]
    if n and len(layout.v_heads) < hkv:  # heads keeping nothing attend to no middle key
        s[:, :, f:].masked_fill_((~layout.head_has_middle).repeat_interleave(g)[:, None], float("-inf"))
    p = torch.softmax(s.float(), dim=-1)  # [B, Hq, f + n]
    out = torch.einsum("bhgn,bnhd->bhgd", p[:, :, :f].reshape(b, hkv, g, f), full_v.float())  # [B, Hkv, G, D]
    if n:
        vals = rows[:, :, nk : nk + nv]  # [B, n, Hnz * D]
        if vals.dtype != torch.float32:
            vals = vals.float()
        p_mid = p[:, :, f:].view(b, hkv, g, n)
        for i, h in enumerate(layout.v_heads):
            out[:, h] += torch.bmm(p_mid[:, h], vals[:, :, i * d : (i + 1) * d])
    return out.reshape(b, hq, d).to(q.dtype)


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
    """One request: query ``[Hq, D]`` over ``full_k/v`` ``[nf, Hkv, D]`` (every channel) and the middle
    positions ``[mid_start, mid_end)`` of the pages (kept channels); ``[Hq, D]`` in q's dtype."""
    nf = torch.tensor([full_k.shape[0]], device=q.device)
    return paged_decode_batch(
        q[None], full_k[None], full_v[None], nf, pages, block_row[None], mid_start, [mid_end], layout, scale
    )[0]
