"""``LeanKModel``: a transformers causal LM that decodes with a LeanK-pruned K cache.

The model itself is untouched but for its attention implementation, set to ``"leank"``, and the
cache its ``generate`` builds (a :class:`~leank_infer.decode.cache.LeanKCache`, see
:mod:`leank_infer.model.generation`): ``model.generate`` and ``pipeline("text-generation", model=model)``
decode with LeanK as ``LeanKModel.generate`` does. A forward without a cache (a loss, a prefill) is
dense, as the default rule's prompt is (a forward with ``new_cache()`` follows the model's ``rule``);
decoding over any other cache is an error, never silently dense.
Dense decoding on the same object: ``model.set_attn_implementation("sdpa")``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..decode.backend import requested_backend
from ..decode.cache import LeanKCache, check_rule_options
from ..decode.kv_quant import KVQuant, kv_quant_format
from ..decode.rule import DEFAULT_RULE
from ..mask import ChannelMask, check_fit
from . import generation as _generation
from .loading import load_mask_base_model


class LeanKModel:
    """A causal LM plus the ChannelMask it decodes with; ``generate`` uses a fresh LeanK cache each call.

    ``LeanKModel(model, mask, tokenizer)`` wraps models already in memory. The mask is checked
    against ``model.config`` first (a mask for another shape of model is a ``MaskError`` and the
    model is left as it was).

    ``dense_until`` (tokens, default 0 = off) trades memory for speed at short contexts: a sequence
    decodes dense, keeping every channel, until it holds that many tokens, then compresses and
    follows the LeanK rule (see :class:`~leank_infer.decode.cache.LeanKCache`). On a CPU at batch 1 the
    dense step is faster below ~1.5k tokens; docs/speed.md measures where.

    ``rule`` (:data:`~leank_infer.decode.rule.RULE_DESCRIPTIONS`; the vLLM plugin's ``leank_rule``, with the same
    default, so both paths give the same tokens): ``"dense-prompt"`` (the default), the prompt attends with every
    channel, each generated token by its position; ``"positional"``, every query, the prompt's too, by its
    position alone (:func:`~leank_infer.decode.rule.positional_recent_from`; it has no ``dense_until``).

    ``kv_quant`` (default None): ``"int8"`` or ``"int4"`` stores the middle's kept K channels and its V quantised
    (KIVI's grouping: K per channel, V per token; :mod:`~leank_infer.decode.kv_quant`), sink and recent tokens in
    full precision. A decode setting, not part of the mask.
    """

    def __init__(
        self, model: Any, mask: ChannelMask, tokenizer: Any = None, dense_until: int = 0, rule: str = DEFAULT_RULE,
        kv_quant: str | KVQuant | None = None,
    ):
        requested_backend()  # LEANK_BACKEND=nope: refused now, not at the first decode step
        fmt = kv_quant_format(kv_quant)
        mask.validate(model.config)
        if isinstance(dense_until, bool) or not isinstance(dense_until, int) or dense_until < 0:
            raise ValueError(f"dense_until must be a number of tokens >= 0, got {dense_until!r}")
        check_rule_options(rule, dense_until)
        self.model = model
        self.mask = mask
        self.tokenizer = tokenizer
        self.dense_until = dense_until
        self.rule = rule
        self.kv_quant = fmt
        _generation.install(model, mask, dense_until, rule, fmt)

    @classmethod
    def from_pretrained(
        cls,
        repo_or_dir: str | os.PathLike,
        revision: str | None = None,
        model: Any = None,
        tokenizer: Any = None,
        check_base_model: bool = True,
        dense_until: int = 0,
        rule: str = DEFAULT_RULE,
        kv_quant: str | KVQuant | None = None,
        **hf_kwargs: Any,
    ) -> LeanKModel:
        """Load a mask (folder or Hub repo) and the base model its config names (``hf_kwargs`` go to the loader).

        A mask learned on a fine-tune names its PEFT adapter too (``mask.adapter``, at
        ``mask.adapter_revision``): it is loaded onto the base model and merged, as in training.
        Config attributes the mask was learned with (``mask.config_overrides``, e.g. YaRN's
        ``rope_parameters``) are set at load; ``hf_kwargs`` of the same name win.

        With ``model=`` given, that model is used as is: it must fit the mask
        (:func:`~leank_infer.mask.fit.check_fit`: its shape, its Hub id, no adapter the model may
        lack, the config overrides carried; else ``MaskError``, before the model is touched). A
        fine-tune or a renamed copy of the base model passes ``check_base_model=False``, which turns
        the identity checks into a warning. ``dense_until``, ``rule`` and ``kv_quant``: see :class:`LeanKModel`.
        """
        requested_backend()  # before anything loads
        check_rule_options(rule, dense_until)
        kv_quant_format(kv_quant)
        mask = ChannelMask.from_pretrained(repo_or_dir, revision=revision)
        if model is None:
            model, loaded_tokenizer = load_mask_base_model(mask, **hf_kwargs)
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        else:
            check_fit(mask, model.config, [getattr(model.config, "_name_or_path", None)], check_base_model)
        return cls(model, mask, tokenizer, dense_until=dense_until, rule=rule, kv_quant=kv_quant)

    # ---- decoding ------------------------------------------------------------------------------
    def new_cache(self) -> LeanKCache:
        """An empty LeanK cache for this model (one per generation / conversation)."""
        return LeanKCache(self.mask, config=self.model.config, dense_until=self.dense_until, rule=self.rule,
                          kv_quant=self.kv_quant)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``model.generate``: a fresh LeanK cache unless one is passed (as ``cache=`` or ``past_key_values=``,
        either name on any supported transformers)."""
        kwargs = _generation.cache_kwargs(kwargs)
        installed = (_generation.installed_mask(self.model), _generation.installed_rule(self.model),
                     _generation.installed_kv_quant(self.model))
        if kwargs.get(_generation.CACHE_KWARG) is None and (
            installed[0] is not self.mask or installed[1] != self.rule or installed[2] != self.kv_quant
        ):
            # another LeanKModel wrapped the same model with its mask (or rule) since: decode with this one's
            kwargs[_generation.CACHE_KWARG] = self.new_cache()
        return self.model.generate(*args, **kwargs)

    def dense(self) -> Any:
        """Context manager: the model's own dense attention and caches within (a reference on the same weights),
        e.g. ``with m.dense(): m.model.generate(...)``; LeanK again on exit."""
        return _generation.dense_decoding(self.model)

    def kv_cache_bytes(self, cache: LeanKCache) -> int:
        """Bytes of K/V the cache holds right now (its real tensor storage)."""
        return cache.nbytes()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward (a cache as ``cache=`` or ``past_key_values=``, either name)."""
        return self.model(*args, **_generation.cache_kwargs(kwargs))

    forward = __call__

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    def __repr__(self) -> str:
        rule = "" if self.rule == DEFAULT_RULE else f", rule={self.rule!r}"
        quant = "" if self.kv_quant is None else f", kv_quant={self.kv_quant.name!r}"
        return f"LeanKModel(model={type(self.model).__name__}, mask={self.mask!r}{rule}{quant})"
