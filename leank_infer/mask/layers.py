"""Which layers a model has, how wide, how long, and which of them LeanK leaves dense (one rule each)."""

from __future__ import annotations

from typing import Any

from .format import MaskError


def model_shape(model_config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers config (text config for multimodal ones)."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    layers = int(cfg.num_hidden_layers)
    q_heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or q_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // q_heads
    return layers, kv_heads, int(head_dim)


def model_positions(model_config: Any) -> int | None:
    """How many positions the model was built for (``max_position_embeddings``), None where it does not say.

    Every entry point bounds prompt + new tokens by it: beyond it a model decodes garbage (or runs
    until memory is gone) and transformers only warns.
    """
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    value = getattr(cfg, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def dense_layers_of(model_config: Any) -> tuple[int, ...]:
    """Layers LeanK leaves whole: the model's sliding-window (or chunked) attention layers.

    Their cache is already bounded by the window and stays the model's own cache layer; LeanK
    prunes only full (global) attention layers. Layer types come from transformers itself
    (``get_layer_types_and_kwargs``: ``config.layer_types``, else ``sliding_window``). A window at
    least ``max_position_embeddings`` long never bites (Phi-3-128k's 262144): such a layer is global.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    types, kwargs = get_layer_types_and_kwargs(cfg)
    limit = getattr(cfg, "max_position_embeddings", None)
    return tuple(
        i
        for i, (kind, kw) in enumerate(zip(types, kwargs, strict=True))
        if kind != "full_attention"
        and not (limit is not None and kw.get("sliding_window") is not None and kw["sliding_window"] >= limit)
    )


def check_dense_layers(dense_layers: Any, num_layers: int) -> tuple[int, ...]:
    """``dense_layers`` as a sorted tuple of distinct layer indices, or MaskError."""
    if isinstance(dense_layers, (str, bytes)) or not hasattr(dense_layers, "__iter__"):
        raise MaskError(f"dense_layers must be a list of layer indices, got {dense_layers!r}")
    items = list(dense_layers)  # checked before sorting: a list or a string among them cannot be sorted or hashed
    bad = [i for i in items if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise MaskError(f"dense_layers must be layer indices in [0, {num_layers}), got {bad}")
    return tuple(sorted(set(items)))
