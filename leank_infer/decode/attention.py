"""The ``"leank"`` attention implementation: the seam between transformers and the decode core.

``leank_attention_forward`` is registered with transformers' ``AttentionInterface``. It learns the LeanK
cache layer of its call from :mod:`~leank_infer.decode.layer_handoff` (transformers hands an attention function
no cache: docs/architecture.md, "What the transformers API cannot carry") and picks its path from the layer's
:class:`~leank_infer.decode.layout.Phase`:

- no LeanK layer (no LeanK cache, or a layer the mask keeps dense): the model's own dense attention
  (:func:`dense_attention`);
- ``PREFILLING``, the forward that fills an empty layer: dense under ``"dense-prompt"``; under ``"positional"``
  :func:`~leank_infer.decode.positional_prefill.positional_prefill_attention`, over the K/V as given;
- ``DENSE_UNTIL``, a step of a layer still under its ``dense_until``, which hands over every token's full K/V:
  dense;
- ``COMPRESSED``: the layer's :class:`~leank_infer.decode.layout.DecodeLayout` and the step's masks, through
  the backend dispatcher (:func:`leank_infer.decode.backend.decode_attention`).

It never changes the cache: the cache compresses itself in its ``update``. Its mask function is SDPA's, so
the model hands it a bool mask (or None). Past keys from a cache that is not a LeanK cache raise
:class:`~leank_infer.decode.layer_handoff.LeanKCacheError` (it never decodes dense silently).
"""

from __future__ import annotations

from typing import Any

import torch

from . import layer_handoff
from .backend import decode_attention
from .layout import Phase, allowed_from_mask, row_starts
from .positional_prefill import positional_prefill_attention
from .rule import POSITIONAL, default_scale, gqa_view
from .torch_decode import finish, masked, partial, scores

ATTN_IMPLEMENTATION = "leank"


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
    q5 = gqa_view(query, key.shape[1])
    s = scores(q5, key, scaling, softcap)
    allowed = allowed_from_mask(attention_mask, key.shape[2], query.shape[2], query.device)
    if allowed is not None:
        s = masked(s, allowed.unsqueeze(1).unsqueeze(1))
    return finish(partial(s, value), query)


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
    return softcapped_attention(query, key, value, attention_mask, default_scale(query.shape[-1], scaling), softcap), None


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
    """The ``"leank"`` attention implementation: dense at prefill / without a LeanK layer, LeanK decode otherwise.

    Without any cache (a plain forward, a loss: keys only of the tokens passed) it is the model's
    dense attention, which is what LeanK computes at prefill. Past keys from a cache that is not a
    LeanK cache raise :class:`~leank_infer.decode.layer_handoff.LeanKCacheError` instead of decoding dense.
    Layers the mask leaves dense (sliding-window layers, with the model's own cache layer) come
    without a LeanK layer and take the dense path. A ``softcap`` (Gemma 2) is honoured on every
    path: :func:`softcapped_attention` instead of SDPA, and inside the LeanK decode.
    """
    fed_by_leank_cache, layer = layer_handoff.take(key)
    softcap = kwargs.pop("softcap", None)
    scaling = default_scale(query.shape[-1], scaling)
    if layer is None:
        if not fed_by_leank_cache and key.shape[2] > query.shape[2]:
            # past keys from another kind of cache: a decode step that would silently run dense
            raise layer_handoff.LeanKCacheError(layer_handoff.NOT_A_LEANK_CACHE)
        return dense_attention(module, query, key, value, attention_mask, scaling, softcap, dropout=dropout, **kwargs)
    if layer.phase is Phase.COMPRESSED:
        masks = layer.decode_masks(attention_mask, query.shape[2])
        return decode_attention(query, layer.layout(), masks, scaling, softcap), None
    if layer.length == query.shape[2]:  # the prefill (PREFILLING, or DENSE_UNTIL below its threshold)
        _check_row_starts(layer, attention_mask, query.shape[0])
    if layer.phase is Phase.PREFILLING and layer.rule == POSITIONAL:  # the prompt by the rule, over its whole K/V
        out = positional_prefill_attention(
            query, key, value, layer.groups.keep, layer.starts, layer.sink_size, layer.recent_size,
            layer.accumu_size, scaling, softcap, attention_mask,
        )
        return out, None
    # the dense-prompt prefill, or a step under the cache's dense_until
    return dense_attention(module, query, key, value, attention_mask, scaling, softcap, dropout=dropout, **kwargs)


def _check_row_starts(layer: Any, attention_mask: torch.Tensor | None, batch: int) -> None:
    """The prefill's mask must agree with the row starts the cache took from ``position_ids``."""
    if attention_mask is None:
        return
    from_mask = row_starts(attention_mask, batch, layer.starts.device)
    if not torch.equal(from_mask, layer.starts):
        raise ValueError(
            f"the attention mask left-pads rows by {from_mask.tolist()} tokens but position_ids say "
            f"{layer.starts.tolist()}: with left padding pass position_ids as generate() does "
            "(attention_mask.cumsum(-1) - 1, padding at 0), so the LeanK cache knows where each row starts"
        )


def register() -> None:
    """Register ``"leank"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, leank_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


register()
