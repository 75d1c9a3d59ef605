"""LeanK attention over vLLM's LeanK pages in plain PyTorch: the reference every kernel is tested against.

It reads a request's keys the way the kernels do — middle keys from the packed pages (kept K channels,
V of heads keeping any), sink and window keys with every channel from the window pages, the step's
own new keys from the step's K/V — rebuilds dense K/V (zeros where nothing is stored) and calls the
one PyTorch implementation of the rule, :func:`leank_infer.decode.masked_attention.leank_attention`,
with the positional rule. The backend uses :func:`request_kv` for prefill chunks (its gather, then
:func:`~leank_infer.vllm.kernels.prefill`, SDPA) and the kernels for decoding; :func:`reference_attention` is
what both are tested against.
"""

from __future__ import annotations

import torch

from ..decode.masked_attention import leank_attention
from ..decode.rule import positional_recent_from
from .pool import LayerSlot, WorkerPlan


def page_rows(pages: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows ``[n, row]`` of ``pages`` ``[num_blocks, block_size, row]`` at token ``positions`` of one request."""
    bs = pages.shape[1]
    blocks = block_table.long()[positions // bs]
    return pages[blocks, positions % bs]


def to_compute(rows: torch.Tensor, dtype: torch.dtype, scale: float, fp8: torch.dtype | None) -> torch.Tensor:
    """Stored elements to ``dtype``: fp8 bytes are reinterpreted and scaled, others cast."""
    if fp8 is not None:
        return rows.view(fp8).to(dtype) * scale
    return rows.to(dtype)


def request_kv(
    plan: WorkerPlan,
    slot: LayerSlot,
    packed: torch.Tensor,
    packed_table: torch.Tensor,
    window: torch.Tensor,
    window_table: torch.Tensor,
    length: int,
    first_query: int,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    dtype: torch.dtype,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8: torch.dtype | None = None,
    whole: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[length, heads, head_dim]`` K and V of one request as the queries from ``first_query`` on see them.

    Positions ``[first_query, length)`` come from ``new_k``/``new_v`` (the step's own tokens), the sink and
    the window before the first query from the window pages, every other position from the packed
    pages (K zero in the channels the layer does not keep, V zero for heads that keep none). ``whole``:
    every earlier position from the window pages, with every channel (a prompt chunk under the dense-prompt
    rule: the window pages hold the whole prompt until it is computed).
    """
    h, d = plan.num_kv_heads, plan.head_dim
    pos = torch.arange(length, device=packed.device)
    alloc = torch.empty if whole else torch.zeros  # whole: every position is written below
    k = alloc(length, h * d, dtype=dtype, device=packed.device)
    v = alloc(length, h * d, dtype=dtype, device=packed.device)
    if not whole:
        layout = slot.layout
        rows = page_rows(packed, packed_table, pos)[:, slot.packed_offset : slot.packed_offset + slot.packed_width]
        nk, nv = layout.k_index.numel(), layout.v_index.numel()
        lay = layout.to(packed.device)
        k[:, lay.k_index] = to_compute(rows[:, :nk], dtype, k_scale, fp8)
        v[:, lay.v_index] = to_compute(rows[:, nk : nk + nv], dtype, v_scale, fp8)
    k, v = k.view(length, h, d), v.view(length, h, d)
    # full channels where the window pages hold them: the sink, and from the first query's window on
    start = 0 if whole else positional_recent_from(first_query, plan.recent, plan.accumu)
    full = torch.cat([pos[: min(plan.sink, first_query)], pos[max(start, plan.sink) : first_query]])
    if full.numel():
        wrows = page_rows(window, window_table, full)[:, slot.window_offset : slot.window_offset + 2 * h * d]
        k[full] = to_compute(wrows[:, : h * d], dtype, k_scale, fp8).view(-1, h, d)
        v[full] = to_compute(wrows[:, h * d :], dtype, v_scale, fp8).view(-1, h, d)
    k[first_query:] = new_k.to(dtype)
    v[first_query:] = new_v.to(dtype)
    return k, v


def reference_attention(
    plan: WorkerPlan,
    slot: LayerSlot,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_query: int,
    scale: float,
) -> torch.Tensor:
    """LeanK attention ``[n, Hq, D]`` of the queries ``q`` ``[n, Hq, D]`` at positions ``first_query + i`` over
    dense ``k``/``v`` ``[length, Hkv, D]`` from :func:`request_kv`, positional rule."""
    n = q.shape[0]
    out = leank_attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        slot.layout.keep(q.device).float(),
        torch.arange(first_query, first_query + n, device=q.device),
        plan.sink,
        plan.recent,
        scale,
        skip_zero_heads=True,
        accumu_size=plan.accumu,
    )
    return out[0].to(q.dtype)


def write_pages(
    packed: torch.Tensor,
    packed_slots: torch.Tensor,
    window: torch.Tensor,
    window_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot: LayerSlot,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8: torch.dtype | None = None,
) -> None:
    """The step's K/V ``[n, Hkv, D]`` into this layer's columns: a packed row for every token, a full row for
    the tokens whose window block is real (vLLM's slot -1 pads; the null block 0 holds nothing).

    PyTorch, with boolean indexing (a host sync): the reference of the Triton write, which CUDA runs."""
    bs = packed.shape[1]
    rows = slot.layout.to(k.device).pack(k, v)
    full = torch.cat([k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)], dim=1)
    if fp8 is not None:
        rows = _to_fp8(rows, slot.layout.k_index.numel(), k_scale, v_scale, fp8)
        full = _to_fp8(full, k[0].numel(), k_scale, v_scale, fp8)
    else:
        rows, full = rows.to(packed.dtype), full.to(window.dtype)
    p = packed_slots.long()
    keep = p >= 0
    if not bool(keep.all()):
        p, rows = p[keep], rows[keep]
    packed[p // bs, p % bs, slot.packed_offset : slot.packed_offset + rows.shape[1]] = rows
    w = window_slots.long()
    keep = w >= bs  # -1: padding, [0, bs): the null block (a token no later query reads fully)
    w, full = w[keep], full[keep]
    window[w // bs, w % bs, slot.window_offset : slot.window_offset + full.shape[1]] = full


def _to_fp8(x: torch.Tensor, nk: int, k_scale: float, v_scale: float, fp8: torch.dtype) -> torch.Tensor:
    """K columns ``[:nk]`` scaled by the K scale, the rest by the V scale, as fp8 bytes."""
    scale = torch.full((x.shape[1],), v_scale, dtype=torch.float32, device=x.device)
    scale[:nk] = k_scale
    return (x.float() / scale).to(fp8).view(torch.uint8)
