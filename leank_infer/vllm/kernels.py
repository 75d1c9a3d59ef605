"""The batched LeanK decode over vLLM's LeanK pages (one call per layer for every decode request), and the
write of a step's K/V into them.

CUDA tensors run the Triton kernels (:mod:`~leank_infer.vllm.triton_paged`: capturable in a CUDA graph);
so do CPU tensors in tests (``$LEANK_TRITON_ON_CPU=1`` with triton's interpreter). The rest: the PyTorch
reference (:mod:`~leank_infer.vllm.paged_reference`).
"""

from __future__ import annotations

import torch

from . import triton_paged
from .paged_reference import reference_attention, request_kv, write_pages
from .pool import LayerSlot, WorkerPlan


def decode(
    q: torch.Tensor,
    packed: torch.Tensor,
    packed_table: torch.Tensor,
    window: torch.Tensor,
    window_table: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: WorkerPlan,
    slot: LayerSlot,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8: torch.dtype | None = None,
) -> torch.Tensor:
    """LeanK attention ``[B, Hq, D]`` of one new query per request (its K/V already in the pages)."""
    if triton_paged.handles(q):
        return triton_paged.decode(
            q, packed, packed_table, window, window_table, seq_lens, plan, slot, scale, k_scale, v_scale, fp8
        )
    out = torch.empty_like(q)
    for i, length in enumerate(seq_lens.tolist()):
        p = length - 1
        k, v = request_kv(
            plan, slot, packed, packed_table[i], window, window_table[i], length, p,
            _row(window, window_table[i], p, slot, plan, 0, k_scale, fp8, q.dtype),
            _row(window, window_table[i], p, slot, plan, 1, v_scale, fp8, q.dtype),
            q.dtype, k_scale, v_scale, fp8,
        )  # fmt: skip
        out[i] = reference_attention(plan, slot, q[i : i + 1], k, v, p, scale)[0]
    return out


def write(
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
    """The step's K/V ``[n, Hkv, D]`` into this layer's packed columns (slot ``>= 0``) and window columns (slot
    ``>= block_size``); on CUDA without host syncs (capturable)."""
    fn = triton_paged.write if triton_paged.handles(k) else write_pages
    fn(packed, packed_slots, window, window_slots, k, v, slot, k_scale, v_scale, fp8)


def prepare(plan: WorkerPlan, device: torch.device) -> None:
    """Put what the kernels read besides the pages (per-layer channel tables) on ``device``: once per worker,
    before any CUDA graph capture (a capturing stream cannot copy from the host)."""
    if torch.device(device).type == "cuda":
        triton_paged.prepare(plan, device)


def _row(window, table, p, slot, plan, which, scale, fp8, dtype):  # noqa: ANN001, ANN202 - interim
    bs = window.shape[1]
    hd = plan.num_kv_heads * plan.head_dim
    row = window[int(table[p // bs]), p % bs, slot.window_offset + which * hd : slot.window_offset + (which + 1) * hd]
    x = row.view(fp8).to(dtype) * scale if fp8 is not None else row.to(dtype)
    return x.view(1, plan.num_kv_heads, plan.head_dim)
