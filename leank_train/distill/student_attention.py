"""The student's attention: LeanK's rule plugged into transformers through ``AttentionInterface``.

One registered function serves every family (llama, qwen2, qwen3, mistral, ...): each family's
attention module calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v,
mask, **kwargs)`` with the ``**kwargs`` given to the model's forward, so the per-step state
travels as one forward kwarg, ``leank_student``, and the layer comes from ``module.layer_idx``:

- ``TeacherState``: the teacher pass (full attention, SDPA) records every layer's post-RoPE K/V;
- ``StudentState``: the student pass (answer tokens only) attends to the recorded context K/V plus
  its own keys with the LeanK rule. Passing the context through the state rather than a KV cache
  keeps the student pass free of side effects, so activation checkpointing may replay it.
Without that kwarg the function is plain SDPA. With a sequence-parallel group in the state, the
exchange of :mod:`leank_train.sequence_parallel` wraps both (Ulysses: heads sharded, whole sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from leank_infer.decode.attention import dense_attention
from leank_infer.decode.masked_attention import leank_attention
from leank_infer.decode.rule import default_scale

from .. import sequence_parallel as sp

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
    # the positional rule (the vLLM plugin's leank_rule "positional"): the student runs the whole sequence, every
    # query by its position alone
    # (``accumu_size``: the decode-time rounding of the recent window); None: answer tokens after the context
    accumu_size: int | None = None
    # per layer (K, V) of the context, post-RoPE, [1, kv_heads (or this rank's shard), context, D]
    context: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    group: Any = None  # sequence-parallel process group: context holds this rank's KV heads


@dataclass
class TeacherState:
    """The teacher pass: full causal attention; every layer's post-RoPE (K, V) is recorded for the student."""

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    group: Any = None  # sequence-parallel group: q/k/v come sequence-sharded, K/V are recorded head-sharded


def leank_student_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    leank_student: StudentState | TeacherState | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Teacher (record K/V, dense), student (LeanK rule vs the recorded context), or plain dense attention.

    Student: the queries are the answer tokens at positions ``C .. C+Q-1`` after a context of
    ``C`` recorded keys; causality and the sink/middle/recent split follow from positions alone,
    so the transformers mask is not needed. Dense means :func:`dense_attention` with the model's mask
    (SDPA, or the soft-capped path for Gemma 2); the student's dense
    (sliding-window) layers attend densely to the recorded context under the window.
    """
    softcap = kwargs.pop("softcap", None)
    state = leank_student
    if isinstance(state, TeacherState):
        return _teacher(module, query, key, value, attention_mask, scaling, state, softcap, **kwargs)
    if state is None:
        return dense_attention(module, query, key, value, attention_mask, scaling, softcap, dropout=dropout, **kwargs)
    if query.shape[0] != 1:
        raise ValueError("the LeanK student pass runs one sequence at a time (batch size 1)")
    layer = module.layer_idx
    if state.accumu_size is not None:
        return _positional(module, query, key, value, attention_mask, scaling, softcap, state, **kwargs)
    if state.context is None:
        raise ValueError("the student pass needs the context K/V recorded by the teacher pass")
    ctx_k, ctx_v = state.context[layer]
    if layer in state.dense_layers:
        return _dense_after_context(module, query, key, value, ctx_k, ctx_v, scaling, softcap, **kwargs)
    channel_scale = state.channel_scale[layer]
    group = state.group
    if group is not None:
        # replicated answer tokens -> this rank's heads (gradients summed over the group on the way back)
        query, key, value, channel_scale = (sp.copy_to_group(t, group) for t in (query, key, value, channel_scale))
        query = query[:, sp.head_slice(query.shape[1], group)]
        kv_heads = sp.head_slice(key.shape[1], group)
        key, value, channel_scale = key[:, kv_heads], value[:, kv_heads], channel_scale[kv_heads]
    c_len = ctx_k.shape[2]
    keys = torch.cat([ctx_k.to(key.dtype), key], dim=2)
    values = torch.cat([ctx_v.to(value.dtype), value], dim=2)
    out = _by_rule(query, keys, values, channel_scale, c_len, state, scaling, softcap)
    if group is not None:
        out = sp.gather_heads(out, group, dim=2)  # [1, Q, Hq, D] on every rank
    return out, None


def _positional(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    softcap: float | None,
    state: StudentState,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The student of a positional-rule mask: the whole sequence (prompt and answer), every query scoring the
    sink and its recent window (rounded as at decode) with every channel and the middle with the scaled ones,
    as the vLLM plugin serves every token. The prompt's errors then reach the answer through the layers, and
    the mask learns to keep them small."""
    if state.group is not None:
        raise NotImplementedError("the positional student does not support sequence parallelism")
    if module.layer_idx in state.dense_layers:
        return dense_attention(module, query, key, value, attention_mask, scaling, softcap, **kwargs)
    return _by_rule(query, key, value, state.channel_scale[module.layer_idx], 0, state, scaling, softcap), None


def _by_rule(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    channel_scale: torch.Tensor,
    first: int,
    state: StudentState,
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """``leank_attention`` of queries at positions ``first, first + 1, ...`` over ``keys`` (key j at position j),
    by the training rule (``accumu_size`` None) or the positional one."""
    positions = torch.arange(first, first + query.shape[2], device=query.device)
    return leank_attention(
        query,
        keys,
        values,
        channel_scale,
        positions,
        state.sink_size,
        state.recent_size,
        default_scale(query.shape[-1], scaling),
        skip_zero_heads=state.skip_zero_heads,
        softcap=softcap,
        accumu_size=state.accumu_size,
    )


def _dense_after_context(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    scaling: float | None,
    softcap: float | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A dense (sliding-window) layer of the student pass: the answer against context + itself, as the model would.

    The model built its mask for the answer tokens alone (no cache), so the causal and window mask over
    the recorded context is built here from positions (transformers' rule: key ``j`` is visible to the
    query at ``p`` when ``j <= p`` and ``p - j < window``).
    """
    keys = torch.cat([ctx_k.to(key.dtype), key], dim=2)
    values = torch.cat([ctx_v.to(value.dtype), value], dim=2)
    q_len, k_len = query.shape[2], keys.shape[2]
    q_pos = torch.arange(k_len - q_len, k_len, device=query.device).unsqueeze(-1)
    k_pos = torch.arange(k_len, device=query.device).unsqueeze(0)
    allowed = k_pos <= q_pos
    window = kwargs.pop("sliding_window", None)
    if window is not None:
        allowed &= q_pos - k_pos < window
    return dense_attention(module, query, keys, values, allowed[None, None], scaling, softcap, **kwargs)


def _teacher(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    state: TeacherState,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Full attention of the teacher pass; records (K, V). Sequence parallel: Ulysses all-to-all over heads."""
    if state.group is None:
        state.kv[module.layer_idx] = (key, value)
        return dense_attention(module, query, key, value, attention_mask, scaling, softcap, **kwargs)
    if torch.is_grad_enabled():
        raise RuntimeError("the sequence-parallel teacher pass runs without gradients (torch.no_grad)")
    group = state.group
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("sequence parallelism does not support sliding-window attention layers")
    if softcap is not None:
        raise NotImplementedError("sequence parallelism does not support soft-capped attention (Gemma 2)")
    q, k, v = (sp.seq_to_heads(t, group) for t in (query, key, value))  # my heads, whole (padded) sequence
    state.kv[module.layer_idx] = (k, v)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
    )
    return sp.heads_to_seq(out, group).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the student attention (and SDPA's mask builder for its teacher use); returns its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, leank_student_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


register()
