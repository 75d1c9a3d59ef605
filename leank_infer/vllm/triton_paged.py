"""Triton LeanK decode over vLLM's paged, packed KV cache: the CUDA path of :mod:`~leank_infer.vllm.paged_decode`.

Same inputs and result as :func:`~leank_infer.vllm.paged_decode.paged_decode` (one request, one new
query), in one launch plus a small log-sum-exp merge. Grid ``(Hkv, S + 1)``: program ``(h, s < S)``
takes split s of the middle positions ``[mid_start, mid_end)`` for KV head h, reading each token's
packed page row through the request's block table (``pages[block_row[pos // bs], pos % bs]``): the
head's kept K channels (a ``BLOCK_C``-wide tile masked to its count, against q gathered on the same
channels) and its V; program ``(h, S)`` takes the full-channel keys of the side store (sink +
recent). Heads that keep no channel write an empty partial for the middle. The G query heads of a
KV head are the rows of one ``[G, C] x [C, BLOCK_N]`` dot. Partials ``[Hkv, S + 1, G, D]`` (fp32,
base-2 logits) are merged in PyTorch.

Tested against the PyTorch path on triton's CPU interpreter (``TRITON_INTERPRET=1``, fp16 and fp32,
``tests/test_vllm_triton_paged.py``); on a GPU it is exercised by ``benchmarks/gpu_check.py``'s vllm
part. Kernel launch options are untuned (chosen without a GPU).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..decode import triton_decode
from .layout import PackedLayout

BLOCK_N = 64  # tokens per tile
SPLIT_TOKENS = 1024  # middle tokens per program (at least): splits give a long middle enough programs
_LOG2E = 1.4426950408889634
_kernel: Any = None
_meta: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _build() -> Any:
    """The jitted kernel, built at the first launch (``TRITON_INTERPRET`` is read then)."""
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit
    def leank_paged_kernel(
        Q, FK, FV, PAGES, BT, KOFF, KCNT, KCH, VOFF, ACC, M, L,
        n_full, mid_start, mid_end, split_len, n_splits, block_size, qk_scale,
        sq_h, sfk_n, sfk_h, sfv_n, sfv_h, sp_blk, sp_row,
        G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        h = tl.program_id(0)
        s = tl.program_id(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        g_ok = offs_g < G
        d_ok = offs_d < D
        q_rows = (h * G + offs_g) * sq_h
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        if s == n_splits:  # the full-channel keys (sink + recent) of the side store
            q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
            for start in range(0, n_full, BLOCK_N):
                n = start + offs_n
                n_ok = n < n_full
                k = tl.load(FK + n[None, :] * sfk_n + h * sfk_h + offs_d[:, None],
                            mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # fmt: skip
                v = tl.load(FV + n[:, None] * sfv_n + h * sfv_h + offs_d[None, :],
                            mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
                sc = tl.dot(q, k.to(q.dtype), input_precision=PREC) * qk_scale
                sc = tl.where(n_ok[None, :], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(sc - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
                m_i = m_new
        else:  # split s of the middle: kept K channels and V from the pages
            cnt = tl.load(KCNT + h)
            k_off = tl.load(KOFF + h)
            v_off = tl.load(VOFF + h)
            offs_c = tl.arange(0, BLOCK_C)
            c_ok = offs_c < cnt
            ch = tl.load(KCH + k_off + offs_c, mask=c_ok, other=0)
            q = tl.load(Q + q_rows[:, None] + ch[None, :], mask=g_ok[:, None] & c_ok[None, :], other=0.0)
            lo = mid_start + s * split_len
            hi = tl.minimum(lo + split_len, mid_end)
            hi = tl.where(cnt > 0, hi, lo)  # no middle keys for a head keeping no channel
            for start in range(lo, hi, BLOCK_N):
                pos = start + offs_n
                n_ok = pos < hi
                blk = tl.load(BT + pos // block_size, mask=n_ok, other=0).to(tl.int64)
                row = PAGES + blk * sp_blk + (pos % block_size) * sp_row  # [BLOCK_N] row pointers
                k = tl.load(
                    row[None, :] + k_off + offs_c[:, None], mask=n_ok[None, :] & c_ok[:, None], other=0.0
                )
                v = tl.load(
                    row[:, None] + v_off + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0
                )
                sc = tl.dot(q, k.to(q.dtype), input_precision=PREC) * qk_scale
                sc = tl.where(n_ok[None, :], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(sc - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
                m_i = m_new
        slot = (h * (n_splits + 1) + s) * G + offs_g  # [BLOCK_G]
        tl.store(M + slot, m_i, mask=g_ok)
        tl.store(L + slot, l_i, mask=g_ok)
        tl.store(ACC + slot[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])

    _kernel = leank_paged_kernel
    return _kernel


def _layout_tensors(layout: PackedLayout, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per KV head: packed K offset, kept count, kept channels (flat), V offset in a row (memoised per device)."""
    key = (id(layout), str(device))
    if key not in _meta:
        d, hkv = layout.head_dim, layout.num_kv_heads
        k_index = layout.k_index.cpu()
        heads = k_index // d
        counts = torch.bincount(heads, minlength=hkv)
        k_off = torch.cumsum(counts, 0) - counts
        v_off = torch.zeros(hkv, dtype=torch.long)
        for i, h in enumerate(layout.v_heads):
            v_off[h] = k_index.numel() + i * d
        ch = k_index % d if k_index.numel() else torch.zeros(1, dtype=torch.long)
        _meta[key] = tuple(t.to(device=device, dtype=torch.int32) for t in (k_off, counts, ch, v_off)) + (
            layout,
        )  # the layout is kept alive so that its id stays its own
    return _meta[key][:4]


def triton_paged_decode(
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
    """:func:`~leank_infer.vllm.paged_decode.paged_decode` on Triton (module docstring); ``[Hq, D]``."""
    triton_decode._load_triton()  # the shared import rule: TRITON_INTERPRET is read at the first launch
    kernel = _build()
    hq, d = q.shape
    hkv = layout.num_kv_heads
    g = hq // hkv
    n_mid = max(0, mid_end - mid_start)
    n_splits = max(1, math.ceil(n_mid / SPLIT_TOKENS))
    split_len = max(BLOCK_N, math.ceil(n_mid / n_splits / BLOCK_N) * BLOCK_N)
    k_off, counts, ch, v_off = _layout_tensors(layout, q.device)
    max_count = int(counts.max()) if counts.numel() else 0
    q = q.contiguous()
    full_k, full_v = full_k.to(q.dtype), full_v.to(q.dtype)
    acc = torch.empty(hkv, n_splits + 1, g, d, dtype=torch.float32, device=q.device)
    m = torch.empty(hkv, n_splits + 1, g, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    kernel[(hkv, n_splits + 1)](
        q, full_k, full_v, pages, block_row, k_off, counts, ch, v_off, acc, m, lsum,
        full_k.shape[0], mid_start, mid_end, split_len, n_splits, pages.shape[1], scale * _LOG2E,
        q.stride(0), full_k.stride(0), full_k.stride(1), full_v.stride(0), full_v.stride(1),
        pages.stride(0), pages.stride(1),
        G=g, D=d, BLOCK_G=max(16, triton_decode.triton.next_power_of_2(g)),
        BLOCK_D=max(16, triton_decode.triton.next_power_of_2(d)),
        BLOCK_C=max(16, triton_decode.triton.next_power_of_2(max(1, max_count))), BLOCK_N=BLOCK_N,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    top = m.amax(1, keepdim=True)  # the full part has >= 1 key (the new token): finite
    w = torch.exp2(m - top)  # empty partials (m = -inf) weigh 0
    out = (acc * w[..., None]).sum(1) / (lsum * w).sum(1)[..., None]
    return out.reshape(hq, d).to(q.dtype)
