"""LeanK attention over vLLM's LeanK pages in plain PyTorch: the reference every kernel is tested against.

It reads a request's keys the way the kernels do — middle keys from the packed pages (kept K channels,
V of heads keeping any), sink and window keys with every channel from the packed row and the window
pages' rest row together, the step's own new keys from the step's K/V — rebuilds dense K/V (zeros where nothing is stored) and calls the
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

    Positions ``[first_query, length)`` come from ``new_k``/``new_v`` (the step's own tokens), every other
    position from the packed pages (K zero in the channels the layer does not keep, V zero for heads that
    keep none), and the sink and the window before the first query also from the window pages' rest rows
    (every channel). ``whole``: every earlier position with every channel (a prompt chunk under the
    dense-prompt rule: the window pages hold the whole prompt's rest rows until it is computed).
    """
    h, d = plan.num_kv_heads, plan.head_dim
    pos = torch.arange(length, device=packed.device)
    pages = (plan, slot, packed, packed_table, window, window_table)
    if whole:
        k = torch.empty(length, h, d, dtype=dtype, device=packed.device)
        v = torch.empty(length, h, d, dtype=dtype, device=packed.device)
        k[:first_query], v[:first_query] = full_rows(*pages, pos[:first_query], dtype, k_scale, v_scale, fp8)
    else:
        layout = slot.layout.to(packed.device)
        k = torch.zeros(length, h * d, dtype=dtype, device=packed.device)
        v = torch.zeros(length, h * d, dtype=dtype, device=packed.device)
        rows = page_rows(packed, packed_table, pos[:first_query])
        rows = rows[:, slot.packed_offset : slot.packed_offset + slot.packed_width]
        nk, nv = layout.k_index.numel(), layout.v_index.numel()
        k[:first_query, layout.k_index] = to_compute(rows[:, :nk], dtype, k_scale, fp8)
        v[:first_query, layout.v_index] = to_compute(rows[:, nk : nk + nv], dtype, v_scale, fp8)
        k, v = k.view(length, h, d), v.view(length, h, d)
        # every channel where the window pages hold the rest: the sink, and from the first query's window on
        start = positional_recent_from(first_query, plan.recent, plan.accumu)
        full = torch.cat([pos[: min(plan.sink, first_query)], pos[max(start, plan.sink) : first_query]])
        if full.numel():
            k[full], v[full] = full_rows(*pages, full, dtype, k_scale, v_scale, fp8)
    k[first_query:] = new_k.to(dtype)
    v[first_query:] = new_v.to(dtype)
    return k, v


def full_rows(
    plan: WorkerPlan,
    slot: LayerSlot,
    packed: torch.Tensor,
    packed_table: torch.Tensor,
    window: torch.Tensor,
    window_table: torch.Tensor,
    positions: torch.Tensor,
    dtype: torch.dtype,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every channel of K and V ``[n, heads, head_dim]`` of a request's tokens at ``positions`` (tokens whose window
    block is real): the packed row and the rest row put together."""
    layout = slot.layout.to(packed.device)
    rows = page_rows(packed, packed_table, positions)[:, slot.packed_offset : slot.packed_offset + slot.packed_width]
    rest = page_rows(window, window_table, positions)[:, slot.window_offset : slot.window_offset + layout.rest_width]
    both = torch.cat([rows, rest], 1).index_select(1, layout.full_columns)  # [n, K | V], every channel
    hd = layout.num_kv_heads * layout.head_dim
    shape = (positions.numel(), layout.num_kv_heads, layout.head_dim)
    k = to_compute(both[:, :hd], dtype, k_scale, fp8).view(shape)
    v = to_compute(both[:, hd:], dtype, v_scale, fp8).view(shape)
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
    """The step's K/V ``[n, Hkv, D]`` into this layer's columns: a packed row for every token, a rest row for
    the tokens whose window block is real (vLLM's slot -1 pads; the null block 0 holds nothing).

    PyTorch, with boolean indexing (a host sync): the reference of the Triton write, which CUDA runs."""
    bs, wbs = packed.shape[1], window.shape[1]  # the two stores' blocks may hold different numbers of tokens
    layout = slot.layout.to(k.device)
    rows = layout.pack(k, v)
    full = layout.pack_rest(k, v)
    if fp8 is not None:
        rows = _to_fp8(rows, layout.k_index.numel(), k_scale, v_scale, fp8)
        full = _to_fp8(full, layout.kr_index.numel(), k_scale, v_scale, fp8)
    else:
        rows, full = rows.to(packed.dtype), full.to(window.dtype)
    p = packed_slots.long()
    keep = p >= 0
    if not bool(keep.all()):
        p, rows = p[keep], rows[keep]
    packed[p // bs, p % bs, slot.packed_offset : slot.packed_offset + rows.shape[1]] = rows
    w = window_slots.long()
    keep = w >= wbs  # -1: padding, [0, wbs): the null block (a token no later query reads fully)
    w, full = w[keep], full[keep]
    window[w // wbs, w % wbs, slot.window_offset : slot.window_offset + full.shape[1]] = full


def _to_fp8(x: torch.Tensor, nk: int, k_scale: float, v_scale: float, fp8: torch.dtype) -> torch.Tensor:
    """K columns ``[:nk]`` scaled by the K scale, the rest by the V scale, as fp8 bytes."""
    scale = torch.full((x.shape[1],), v_scale, dtype=torch.float32, device=x.device)
    scale[:nk] = k_scale
    return (x.float() / scale).to(fp8).view(torch.uint8)
