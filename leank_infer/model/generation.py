"""LeanK as the cache ``generate`` builds: every path through transformers' ``generate`` decodes with it.

``generate`` makes its default cache in ``_prepare_cache_for_generation``, the method a model
overrides when it needs a cache of its own (t5gemma, voxtral_realtime, ... do). :func:`install`
gives one model object that override, so whoever calls its ``generate`` (``LeanKModel.generate``,
``model.generate``, ``pipeline("text-generation", model=model)``, a generation config saved and
reloaded, a second turn, assisted decoding) decodes over a fresh
:class:`~leank_infer.decode.cache.LeanKCache` without passing one. Where ``generate`` would decode dense
instead, it stops with a :class:`LeanKCacheError` saying what to do:

- a cache of another kind passed in (a ``DynamicCache``, a dense first turn's cache),
- ``use_cache=False`` (every step a dense forward over the whole sequence),
- a ``cache_implementation`` (static, offloaded, quantized: dense caches by construction).

The override steps aside while the model's attention implementation is not ``"leank"``: dense
generation on the same object is ``model.set_attn_implementation("sdpa")`` (and back with
``"leank"``). The name of the cache argument changed in transformers 5.20 (``past_key_values`` to
``cache``); :data:`CACHE_KWARG` is the installed version's, and :func:`cache_kwargs` maps either.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

from transformers.generation import utils as _generation_utils

from ..decode.attention import ATTN_IMPLEMENTATION
from ..decode.cache import LeanKCache
from ..decode.layer_handoff import LeanKCacheError
from ..decode.layout import row_starts
from ..decode.rule import DEFAULT_RULE
from ..mask import ChannelMask

__all__ = [
    "CACHE_KWARG", "LeanKCacheError", "cache_kwargs", "dense_decoding", "install", "installed_mask", "installed_rule",
    "installed_kv_quant", "uninstall",
]

#: The keyword ``generate`` and the models' ``forward`` take the cache under, in this transformers.
CACHE_KWARG: str = _generation_utils.ALL_CACHE_NAMES[0]
_CACHE_NAMES = ("cache", "past_key_values")
_MASK_ATTR = "_leank_mask"
_DENSE_ATTR = "_leank_dense_attn_implementation"
_DENSE_UNTIL_ATTR = "_leank_dense_until"
_RULE_ATTR = "_leank_rule"
_KV_QUANT_ATTR = "_leank_kv_quant"


def cache_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with a cache passed as ``cache=`` or ``past_key_values=`` under :data:`CACHE_KWARG`.

    Code written for either side of the rename runs on both; passing both names is an error.
    """
    given = [name for name in _CACHE_NAMES if kwargs.get(name) is not None]
    if len(given) > 1:
        raise TypeError("pass the cache once, as cache= or past_key_values=, not both")
    out = {k: v for k, v in kwargs.items() if k not in _CACHE_NAMES}
    if given:
        out[CACHE_KWARG] = kwargs[given[0]]
    return out


def _leank_prepare_cache_for_generation(
    self: Any, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any
) -> Any:
    """``_prepare_cache_for_generation`` of a LeanK model: a LeanK cache, or one clear error."""
    base = type(self)._prepare_cache_for_generation
    mask = getattr(self, _MASK_ATTR, None)
    if mask is None or self.config._attn_implementation != ATTN_IMPLEMENTATION:
        return base(self, generation_config, model_kwargs, *args, **kwargs)
    given = model_kwargs.get(CACHE_KWARG)
    if given is not None and not isinstance(given, LeanKCache):
        raise LeanKCacheError(
            f"generate() was given a {type(given).__name__}, over which a LeanK model would decode dense: "
            "pass no cache (generate builds a LeanK one), or a LeanK cache (LeanKModel.new_cache(), or the one "
            "an earlier LeanK turn used); for dense decoding on purpose, call "
            "model.set_attn_implementation('sdpa') first"
        )
    if given is None:
        if generation_config.use_cache is False:
            raise LeanKCacheError(
                "generate(use_cache=False) on a LeanK model would run dense attention over the whole sequence "
                "at every step: leave use_cache at its default (generate then builds a LeanK cache)"
            )
        if generation_config.cache_implementation is not None:
            raise LeanKCacheError(
                f"cache_implementation={generation_config.cache_implementation!r} builds a dense cache; a LeanK "
                "model decodes with its own LeanKCache: drop cache_implementation from the call or the "
                "generation config (model.generation_config.cache_implementation = None)"
            )
        cache = LeanKCache(mask, config=self.config, dense_until=getattr(self, _DENSE_UNTIL_ATTR, 0),
                           rule=getattr(self, _RULE_ATTR, DEFAULT_RULE), kv_quant=getattr(self, _KV_QUANT_ATTR, None))
        model_kwargs[CACHE_KWARG] = cache
        _hint_row_starts(cache, model_kwargs)
        if getattr(generation_config, "is_assistant", False):
            cache.activate_past_recording()  # as the base method does for an assistant's cache
        return None
    if isinstance(given, LeanKCache):
        _hint_row_starts(given, model_kwargs)
    return base(self, generation_config, model_kwargs, *args, **kwargs)


def _hint_row_starts(cache: LeanKCache, model_kwargs: dict) -> None:
    """Tell an empty LeanK cache where each row starts (left padding), from generate's attention mask:
    transformers < 5.20 passes no ``position_ids`` to ``Cache.update``, where the cache reads them."""
    mask = model_kwargs.get("attention_mask")
    if mask is not None and mask.ndim == 2 and cache.get_seq_length() == 0:
        cache.prefill_starts = row_starts(mask, mask.shape[0], mask.device)


def set_attn_implementation(model: Any, name: str) -> None:
    """``model.set_attn_implementation(name)``, or the config attribute for models without that method."""
    try:
        model.set_attn_implementation(name)
    except (AttributeError, ValueError):
        model.config._attn_implementation = name


def install(model: Any, mask: ChannelMask, dense_until: int = 0, rule: str = DEFAULT_RULE, kv_quant: Any = None) -> None:
    """Switch ``model`` to ``"leank"`` attention and make its ``generate`` build a LeanK cache for ``mask``
    (with ``dense_until``, ``rule`` and ``kv_quant``, see :class:`~leank_infer.decode.cache.LeanKCache`).

    This object only; installing again replaces the mask (the model decodes with the last one). The
    mask must already be checked against the model (``mask.validate(model.config)``). The attention
    implementation the model had is kept for :func:`dense_decoding`.
    """
    from ..decode.attention import register

    register()
    current = model.config._attn_implementation
    if current != ATTN_IMPLEMENTATION:
        setattr(model, _DENSE_ATTR, current or "sdpa")
    set_attn_implementation(model, ATTN_IMPLEMENTATION)
    setattr(model, _MASK_ATTR, mask)
    setattr(model, _DENSE_UNTIL_ATTR, int(dense_until))
    setattr(model, _RULE_ATTR, rule)
    setattr(model, _KV_QUANT_ATTR, kv_quant)
    model._prepare_cache_for_generation = types.MethodType(_leank_prepare_cache_for_generation, model)


def uninstall(model: Any) -> None:
    """Give ``model`` its own attention implementation and ``generate`` its own cache choice back."""
    set_attn_implementation(model, getattr(model, _DENSE_ATTR, "sdpa"))
    model.__dict__.pop("_prepare_cache_for_generation", None)
    for attr in (_MASK_ATTR, _DENSE_ATTR, _DENSE_UNTIL_ATTR, _RULE_ATTR, _KV_QUANT_ATTR):
        model.__dict__.pop(attr, None)


@contextlib.contextmanager
def dense_decoding(model: Any) -> Iterator[None]:
    """Within: the model's own dense attention and caches (for a dense reference on the same weights).

    The attention implementation is the one the model had before :func:`install` (``"sdpa"`` if
    unknown); ``"leank"`` is back on exit, also after an error.
    """
    set_attn_implementation(model, getattr(model, _DENSE_ATTR, "sdpa"))
    try:
        yield
    finally:
        set_attn_implementation(model, ATTN_IMPLEMENTATION)


def installed_mask(model: Any) -> ChannelMask | None:
    """The mask :func:`install` gave ``model`` (None if it has none)."""
    return getattr(model, _MASK_ATTR, None)


def installed_rule(model: Any) -> str | None:
    """The rule :func:`install` gave ``model`` (None if it has none)."""
    return getattr(model, _RULE_ATTR, None)


def installed_kv_quant(model: Any) -> Any:
    """The kv_quant :func:`install` gave ``model`` (None: none, or a full-precision middle)."""
    return getattr(model, _KV_QUANT_ATTR, None)
