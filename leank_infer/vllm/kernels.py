"""The batched LeanK decode over vLLM's LeanK pages: one call per layer for every decode request.

(Interim: the PyTorch reference per request, until the fused kernels land.)
"""

from __future__ import annotations

import torch

from .paged_reference import reference_attention, request_kv
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


def _row(window, table, p, slot, plan, which, scale, fp8, dtype):  # noqa: ANN001, ANN202 - interim
    bs = window.shape[1]
    hd = plan.num_kv_heads * plan.head_dim
    row = window[int(table[p // bs]), p % bs, slot.window_offset + which * hd : slot.window_offset + (which + 1) * hd]
    x = row.view(fp8).to(dtype) * scale if fp8 is not None else row.to(dtype)
    return x.view(1, plan.num_kv_heads, plan.head_dim)
