"""The student's attention: LeanK's rule plugged into transformers through ``AttentionInterface``.

One registered function serves every family (llama, qwen2, qwen3, mistral, ...): each family's
attention module calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v,
mask, **kwargs)`` with the ``**kwargs`` given to the model's forward, so the per-step state
(channel scales, sink/recent sizes) travels as one forward kwarg, ``leank_student``, and the layer
comes from ``module.layer_idx``. Without that kwarg the function is plain SDPA, so the model can
keep this implementation set for the teacher pass too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from leank_infer.attention import softcapped_attention
from leank_infer.masked_attention import leank_attention

ATTN_IMPLEMENTATION = "leank_student"
STATE_KWARG = "leank_student"


@dataclass
class StudentState:
    """What the student attention needs besides q/k/v: one ``[Hkv, D]`` scale per layer, and the split."""

    channel_scale: torch.Tensor  # [layers, kv_heads, head_dim]: alpha (stage 1) or the STE mask (stage 2)
    sink_size: int
    recent_size: int
    skip_zero_heads: bool = False  # stage 2: heads with no kept channel ignore their middle, as at decode
    dense_layers: frozenset[int] = frozenset()  # sliding-window layers: the model's own attention, no LeanK


def leank_student_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    leank_student: StudentState | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """LeanK attention for the queries of this call against all cached keys; dense when no state is given.

    The queries are the last ``Q`` of the ``K`` keys (the answer tokens after a cached context), so
    query ``i`` sits at position ``K - Q + i``; causality and the sink/middle/recent split follow
    from positions alone, and the transformers mask is not needed. Dense means SDPA with the
    model's mask (sliding window included), or :func:`softcapped_attention` when the model
    soft-caps its logits (Gemma 2): the teacher pass, and the student's dense layers.
    """
    softcap = kwargs.pop("softcap", None)
    if leank_student is None or module.layer_idx in leank_student.dense_layers:
        if softcap is not None:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return softcapped_attention(query, key, value, attention_mask, scale, softcap), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if query.shape[0] != 1:
        raise ValueError("the LeanK student pass runs one sequence at a time (batch size 1)")
    q_len, k_len = query.shape[2], key.shape[2]
    positions = torch.arange(k_len - q_len, k_len, device=query.device)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = leank_attention(
        query,
        key,
        value,
        leank_student.channel_scale[module.layer_idx],
        positions,
        leank_student.sink_size,
        leank_student.recent_size,
        scale,
        skip_zero_heads=leank_student.skip_zero_heads,
        softcap=softcap,
    )
    return out, None


def register() -> str:
    """Register the student attention (and SDPA's mask builder for its teacher use); returns its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, leank_student_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


register()
