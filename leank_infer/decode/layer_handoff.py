"""How a LeanK cache layer reaches the ``"leank"`` attention function, whatever the transformers version.

An attention module calls ``cache.update(k, v, layer_idx, ...)`` and then the attention function
with the K/V that update returned; transformers hands the attention function no cache (docs/architecture.md,
"What the transformers API cannot carry"), and the function would never learn that a LeanK cache is in use.
This is the one way it learns it, on every supported transformers: so :class:`~leank_infer.decode.cache.LeanKCache` offers
each layer here as it returns that layer's K/V, and the attention function takes it back, matched
by the identity of the key tensor it received: a stale offer (an exception between the two calls,
another model's forward) can never be taken by a call it was not made for.

The offer also tells the attention function that a LeanK cache is in use for layers it leaves dense
(the mask's dense layers, sliding-window layers), which is what lets ``"leank"`` refuse to decode
over any other kind of cache instead of silently running dense.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_slot = threading.local()


def offer(keys: torch.Tensor, leank_layer: Any | None) -> None:
    """Called by the LeanK cache with the keys it returns; ``leank_layer`` None for a layer it keeps dense."""
    _slot.offer = (keys, leank_layer)


def take(keys: torch.Tensor) -> tuple[bool, Any | None]:
    """``(fed_by_leank_cache, leank_layer)`` for the attention call that received ``keys``; clears the slot."""
    offered = getattr(_slot, "offer", None)
    _slot.offer = None
    if offered is None or offered[0] is not keys:
        return False, None
    return True, offered[1]


class LeanKCacheError(RuntimeError):
    """A model set up for LeanK was asked to decode without a LeanK cache (it would have run dense)."""


NOT_A_LEANK_CACHE = (
    "this model's attention is 'leank', but its past keys come from a cache that is not a LeanKCache: "
    "decoding over it would run dense, with no memory saved. Let generate build the cache (LeanKModel.generate, "
    "model.generate and pipeline('text-generation', model=...) all do, once LeanKModel has wrapped the model), "
    "or pass a LeanKModel.new_cache() to a forward call; for dense decoding on purpose, call "
    "model.set_attn_implementation('sdpa') first (and set_attn_implementation('leank') to come back)"
)
