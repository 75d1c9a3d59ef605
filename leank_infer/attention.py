"""LeanK decode attention over the pruned cache, and its seam into transformers.

``leank_decode_attention`` is the reference computation (plain tensors in, tensor out): attention
of the new queries over three parts of a :class:`~leank_infer.cache.LeanKLayer`,

- the *head* (first tokens, all channels stored; per row: sink keys use all channels, later head
  keys are middle keys for that row and use only the kept channels),
- the compressed *middle* (per group of KV heads with equal kept count, one dense K tensor of the
  kept channels; V only for heads that keep any channel),
- the full *tail* (recent tokens and the new ones),

head and tail form one part (both are short: their scores and V are concatenated), each kept-count
group of the middle another; every part gives (unnormalised output, running max, sum of exps) and
the parts are merged with log-sum-exp as in flash-decoding. A Triton kernel can replace this one
function without touching the glue (``leank_attention_forward`` is the only caller).

``leank_attention_forward`` is registered as attention implementation ``"leank"``: at prefill, and
in a forward without a cache, it is transformers' SDPA; over a LeanK cache layer it decodes over the
compressed cache; past keys from any other cache are an error (it never decodes dense silently).
Its mask function is SDPA's, so the model hands it a bool mask (or ``None``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import layer_handoff
from .triton_decode import decode_attention

ATTN_IMPLEMENTATION = "leank"
_NEG_INF = float("-inf")
_FLOOR = -1e30  # finite floor of running maxima: exp(-inf - floor) = 0, exp(floor - floor) = 1


@dataclass(frozen=True)
class ChannelGroups:
    """How one layer's KV heads are grouped by kept-channel count, so that each group is one dense tensor.

    ``heads[g]`` are the KV heads of group g (all keep ``counts[g] > 0`` channels), ``channels[g]``
    their kept channel indices ``[Hg, counts[g]]``. Middle V is stored for the heads of
    ``nonzero_order`` (groups one after the other), so group g's V is the slice
    ``[v_offsets[g], v_offsets[g] + len(heads[g]))``: no gather over the cache at decode.
    """

    keep: torch.Tensor  # [Hkv, D] bool
    heads: tuple[torch.Tensor, ...]
    channels: tuple[torch.Tensor, ...]
    counts: tuple[int, ...]
    v_offsets: tuple[int, ...]
    nonzero_order: torch.Tensor  # [Hnz] long

    @classmethod
    def from_keep(cls, keep: torch.Tensor) -> ChannelGroups:
        """Group the KV heads of one layer (``keep``: ``[Hkv, D]`` bool) by kept count, zero-count heads left out."""
        keep = keep.bool()
        counts = keep.sum(-1)
        heads, channels, sizes, offsets = [], [], [], []
        offset = 0
        for c in sorted({int(x) for x in counts.tolist()} - {0}):
            idx = torch.nonzero(counts == c).flatten()
            # kept channel indices of each head, ascending
            ch = torch.stack([torch.nonzero(keep[h]).flatten() for h in idx.tolist()])
            heads.append(idx)
            channels.append(ch)
            sizes.append(c)
            offsets.append(offset)
            offset += len(idx)
        order = torch.cat(heads) if heads else torch.zeros(0, dtype=torch.long)
        return cls(keep, tuple(heads), tuple(channels), tuple(sizes), tuple(offsets), order)

    @property
    def num_kv_heads(self) -> int:
        return self.keep.shape[0]

    @property
    def nonzero(self) -> torch.Tensor:
        """``[Hkv]`` bool: heads that keep at least one channel (the others skip their middle keys)."""
        return self.keep.any(-1)

    def to(self, device: torch.device | str) -> ChannelGroups:
        move = lambda ts: tuple(t.to(device) for t in ts)  # noqa: E731
        return ChannelGroups(
            self.keep.to(device),
            move(self.heads),
            move(self.channels),
            self.counts,
            self.v_offsets,
            self.nonzero_order.to(device),
        )


def _partial(scores: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum_j e^(s_j - m) v_j, m, sum_j e^(s_j - m)) over the last axis of fp32 ``scores`` [B,h,G,Q,k]; v: [B,h,k,D].

    m is floored at a finite value, so a fully masked part gives l = 0 and merges with weight 0.
    """
    b, h, g, q, k = scores.shape
    m = scores.amax(-1, keepdim=True).clamp_min_(_FLOOR)
    p = scores.sub_(m).exp_()
    # one [G*Q, k] x [k, D] product per (row, head): no broadcast, so V is never copied
    acc = torch.matmul(p.to(value.dtype).view(b, h, g * q, k), value).float().view(b, h, g, q, -1)
    return acc, m, p.sum(-1, keepdim=True)


def _scores(q: torch.Tensor, k: torch.Tensor, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """fp32 logits ``[B,h,G,Q,n]`` of queries ``[B,h,G,Q,c]`` against keys ``[B,h,n,c]`` (read in place).

    ``softcap`` (Gemma 2's attention logit soft-capping): ``cap * tanh(logit / cap)`` after the scale,
    as transformers' eager attention does it, so capped models stay exact.
    """
    b, h, g, q_len, c = q.shape
    s = torch.matmul(q.reshape(b, h, g * q_len, c), k.transpose(-1, -2))
    s = s.float() if s.dtype != torch.float32 else s
    s = s.view(b, h, g, q_len, -1).mul_(scaling)
    return s if softcap is None else s.div_(softcap).tanh_().mul_(softcap)


def _merge(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Log-sum-exp merge of two partial results."""
    m = torch.maximum(a[1], b[1])
    wa, wb = (a[1] - m).exp_(), (b[1] - m).exp_()
    return a[0] * wa + b[0] * wb, m, a[2] * wa + b[2] * wb


def _masked(scores: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    return scores if allowed is None else scores.masked_fill_(~allowed, _NEG_INF)


def leank_decode_attention(
    query: torch.Tensor,
    head_k: torch.Tensor,
    head_v: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    mid_k: Sequence[torch.Tensor],
    mid_v: torch.Tensor | None,
    groups: ChannelGroups,
    head_full: torch.Tensor,
    head_mid: torch.Tensor,
    mid_mask: torch.Tensor | None,
    tail_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of new queries over a compressed LeanK cache; returns ``[B, Q, Hq, D]`` (HF layout).

    Args:
        query: ``[B, Hq, Q, D]`` (post-RoPE); query head h uses KV head ``h // (Hq // Hkv)``.
        head_k, head_v: ``[B, Hkv, H, D]``; tail_k, tail_v: ``[B, Hkv, t, D]`` (all channels).
        mid_k: per group of ``groups``, ``[B, Hg, n, c_g]`` (any strides: the cache passes transposed
            views of keys-contiguous storage, so q @ K^T reads K in place); mid_v: ``[B, Hnz, n, D]`` or None.
        head_full / head_mid: ``[B, Q, H]`` bool, head keys scored with all / only kept channels
            (disjoint; False = not attended: padding, or causally hidden).
        mid_mask, tail_mask: ``[B, Q, n]`` / ``[B, Q, t]`` bool or None (= all attended).
        scaling: the logit scale (1/sqrt(D) usually), applied without renormalisation.
        softcap: attention logit soft-capping (``cap * tanh(logit / cap)``, Gemma 2), or None.

    Parts: head and tail together (all channels; their scores and V are concatenated, both are
    short), then each kept-count group of the middle; merged by log-sum-exp.
    """
    b, hq, q_len, d = query.shape
    hkv = groups.num_kv_heads
    g = hq // hkv
    q5 = query.view(b, hkv, g, q_len, d)

    scores, values = [], []
    if head_k.shape[2] > 0:
        keep = groups.keep.to(query.dtype).view(1, hkv, 1, 1, d)
        s_full = _scores(q5, head_k, scaling, softcap)
        if head_mid.any():  # rows with left padding: their later head keys are middle keys
            s_mid = _scores(q5 * keep, head_k, scaling, softcap)
            mid = head_mid.unsqueeze(1).unsqueeze(1)  # [B,1,1,Q,H]
            allowed = head_full.unsqueeze(1).unsqueeze(1) | (mid & groups.nonzero.view(1, hkv, 1, 1, 1))
            s_full = torch.where(mid, s_mid, s_full)
        else:
            allowed = head_full.unsqueeze(1).unsqueeze(1)
        scores.append(_masked(s_full, allowed))
        values.append(head_v)
    if tail_k.shape[2] > 0:
        allowed = None if tail_mask is None else tail_mask.unsqueeze(1).unsqueeze(1)
        scores.append(_masked(_scores(q5, tail_k, scaling, softcap), allowed))
        values.append(tail_v)
    if not scores:  # nothing but (possibly) middle keys: start from an empty part
        shape = (b, hkv, g, q_len, 1)
        state = (
            query.new_zeros(b, hkv, g, q_len, d, dtype=torch.float32),
            query.new_full(shape, _FLOOR, dtype=torch.float32),
            query.new_zeros(shape, dtype=torch.float32),
        )
    elif len(scores) == 1:
        state = _partial(scores[0], values[0])
    else:
        state = _partial(torch.cat(scores, -1), torch.cat(values, 2))

    n = mid_k[0].shape[2] if len(mid_k) else 0
    if n > 0:
        allowed = None if mid_mask is None else mid_mask.unsqueeze(1).unsqueeze(1)
        parts = []
        for heads, channels, off, k in zip(
            groups.heads, groups.channels, groups.v_offsets, mid_k, strict=True
        ):
            hg, c = channels.shape
            qg = q5.index_select(1, heads)
            qg = qg.gather(-1, channels.view(1, hg, 1, 1, c).expand(b, hg, g, q_len, c))
            parts.append(_partial(_masked(_scores(qg, k, scaling, softcap), allowed), mid_v[:, off : off + hg]))
        order = groups.nonzero_order
        # back to KV-head order; heads without a middle part get an empty one (m = floor, l = 0)
        fill = (0.0, _FLOOR, 0.0)
        mid_state = tuple(
            x.new_full(x.shape, f).index_copy_(1, order, torch.cat([p[i] for p in parts], 1))
            for i, (x, f) in enumerate(zip(state, fill, strict=True))
        )
        state = _merge(state, mid_state)

    acc, _, denom = state
    out = acc.div_(denom.clamp_min_(torch.finfo(torch.float32).tiny))  # l = 0 only where acc = 0
    return out.view(b, hq, q_len, d).transpose(1, 2).to(query.dtype).contiguous()


def _allowed_from_mask(attention_mask: torch.Tensor | None, total: int, q_len: int, device: torch.device):
    """``[B or 1, Q, T]`` bool of attendable keys from the model's mask (4D bool/float, 2D padding, or None)."""
    if attention_mask is None:
        if q_len == 1:
            return None
        j = torch.arange(total, device=device)
        qpos = torch.arange(total - q_len, total, device=device)
        return j.view(1, 1, -1) <= qpos.view(1, -1, 1)
    m = attention_mask
    if m.ndim == 2:  # [B, T] padding mask: add causality
        pad = m[:, -total:].bool().unsqueeze(1)
        causal = _allowed_from_mask(None, total, q_len, m.device)
        return pad if causal is None else pad & causal
    m = m[:, 0, -q_len:, :total] if m.shape[-1] >= total else m[:, 0, -q_len:]
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min
    return m


def decode_masks(
    attention_mask: torch.Tensor | None,
    starts: torch.Tensor,
    sink_size: int,
    recent_start: int,
    head_len: int,
    mid_len: int,
    total_len: int,
    q_len: int,
) -> dict[str, torch.Tensor | None]:
    """Per-region masks for :func:`leank_decode_attention` from the model's mask and the LeanK row rule.

    Head key j of row b (start s_b) is padding if j < s_b, a sink key if j < s_b + sink, a full
    recent key if j >= recent_start, and a middle key (kept channels only) otherwise.
    """
    device = starts.device
    base = _allowed_from_mask(attention_mask, total_len, q_len, device)
    j = torch.arange(head_len, device=device).view(1, -1)
    s = starts.view(-1, 1)
    in_mid = (j >= s + sink_size) & (j < recent_start)
    head_full = ((j >= s) & ~in_mid).unsqueeze(1)  # [B,1,H]
    head_mid = in_mid.unsqueeze(1)
    mid_end = head_len + mid_len
    if base is None:
        mid_mask = tail_mask = None
        head_full = head_full.expand(-1, q_len, -1)
        head_mid = head_mid.expand(-1, q_len, -1)
    else:
        head_full = head_full & base[..., :head_len]
        head_mid = head_mid & base[..., :head_len]
        mid_mask = base[..., head_len:mid_end]
        tail_mask = base[..., mid_end:total_len]
    return {"head_full": head_full, "head_mid": head_mid, "mid_mask": mid_mask, "tail_mask": tail_mask}


def row_starts(attention_mask: torch.Tensor | None, batch_size: int, device: torch.device) -> torch.Tensor:
    """Index of each row's first attended key at prefill (left padding), from the model's mask; zeros if None."""
    if attention_mask is None:
        return torch.zeros(batch_size, dtype=torch.long, device=device)
    m = attention_mask if attention_mask.ndim == 2 else attention_mask[:, 0, -1, :]
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min if m.is_floating_point() else m.bool()
    starts = m.int().argmax(-1).long()
    return starts.expand(batch_size).contiguous() if starts.numel() == 1 else starts


def softcapped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
) -> torch.Tensor:
    """Dense attention with logit soft-capping, ``[B, Q, Hq, Dv]``: where SDPA cannot go.

    transformers' SDPA refuses ``softcap``, so Gemma 2's prefill, its dense forwards and its
    sliding-window layers (which keep the model's own cache) come here. ``attention_mask`` is the
    model's (4-D bool/float, 2-D padding, or None for causal), as SDPA would have received it.
    """
    b, hq, q_len, d = query.shape
    hkv = key.shape[1]
    q5 = query.reshape(b, hkv, hq // hkv, q_len, d)
    scores = _scores(q5, key, scaling, softcap)
    allowed = _allowed_from_mask(attention_mask, key.shape[2], q_len, query.device)
    if allowed is not None:
        scores = _masked(scores, allowed.unsqueeze(1).unsqueeze(1))
    acc, _, denom = _partial(scores, value)
    out = acc.div_(denom.clamp_min_(torch.finfo(torch.float32).tiny))
    return out.view(b, hq, q_len, -1).transpose(1, 2).to(query.dtype).contiguous()


def dense_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The model's own dense attention: transformers' SDPA, or :func:`softcapped_attention` where the
    model soft-caps its logits (Gemma 2), which SDPA refuses. ``kwargs`` (dropout, ...) go to SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if softcap is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return softcapped_attention(query, key, value, attention_mask, scale, softcap), None


def leank_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``"leank"`` attention implementation: dense at prefill, LeanK decode over a LeanK cache.

    Without any cache (a plain forward, a loss: keys only of the tokens passed) it is the model's
    dense attention, which is what LeanK computes at prefill. Past keys from a cache that is not a
    LeanK cache raise :class:`~leank_infer.layer_handoff.LeanKCacheError` instead of decoding dense.
    Layers the mask leaves dense (sliding-window layers, with the model's own cache layer) come
    without a LeanK layer and take the dense path. A ``softcap`` (Gemma 2) is honoured on every
    path: :func:`softcapped_attention` instead of SDPA, and inside the LeanK decode.
    """
    layer = kwargs.pop("leank_layer", None)
    fed_by_leank_cache, offered = layer_handoff.take(key)
    layer = offered if layer is None else layer
    softcap = kwargs.pop("softcap", None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if layer is None and not fed_by_leank_cache and key.shape[2] > query.shape[2]:
        # past keys from another kind of cache: a decode step that would silently run dense
        raise layer_handoff.LeanKCacheError(layer_handoff.NOT_A_LEANK_CACHE)
    if layer is None or layer.prefill_pending:
        out = dense_attention(module, query, key, value, attention_mask, scaling, softcap, dropout=dropout, **kwargs)
        if layer is not None:
            layer.finish_prefill(row_starts(attention_mask, query.shape[0], query.device))
        return out
    q_len = query.shape[2]
    masks = layer.decode_masks(attention_mask, q_len)
    out = decode_attention(
        query,
        layer.head_k,
        layer.head_v,
        layer.tail_k,
        layer.tail_v,
        layer.mid_k,
        layer.mid_v,
        layer.groups,
        scaling=scaling,
        softcap=softcap,
        **masks,
    )
    return out, None


def register() -> None:
    """Register ``"leank"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, leank_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


register()
