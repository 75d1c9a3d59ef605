"""The methods an evaluation compares, in the style of kvpress's presses: one small class each, one method.

A method answers one question: which channels does row ``row`` of a prefilled batch decode with
(``mask(lm, prefill, row)``; None: all of them, the full model). The loop (:mod:`.loop`) decodes rows
that get the same mask together. The baselines spend the learned mask's K budget:

- :class:`RandomChannels`: per head the same number of kept channels as the learned mask, chosen at random;
- :class:`ThinK`: query-driven selection per prompt (ThinK): per KV head keep the channels with the
  largest ``|Q_window| * |K|`` column-norm product, the same count in every head.

A LeanK method decodes by a rule (``rule``: ``"dense-prompt"``, the default, or ``"positional"``, see
:data:`leank_infer.decode.rule.RULE_DESCRIPTIONS`; None: the evaluated model's ``lm.rule``). Under
``"positional"`` the prompt's attention depends on the mask, so such a method prefills on its own
(:func:`.prefill.decode`) instead of sharing the batch's dense prefill.

A LeanK method may also store its middle quantised (``kv_quant``: ``"int8"`` / ``"int4"``, see
:class:`leank_infer.LeanKModel`). :class:`QuantizedKV` is KV quantisation alone: every channel, transformers'
``QuantizedCache`` (quanto or HQQ backend), the baseline LeanK + quantisation is measured against.

Nothing here keeps state between calls: a method's fields are its settings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from leank_infer import ChannelMask
from leank_infer.decode.rule import DEFAULT_RULE

from .prefill import Prefill


class Method:
    """Which channels a method decodes with; ``window`` > 0 asks the prefill to record that many queries.

    ``name`` labels its answers (a second learned mask in the same run is ``Learned("leank-r80", mask)``).
    ``rule``: the LeanK rule its masks decode by (None: the evaluated model's, ``lm.rule``).
    """

    name: str = ""
    window: int = 0
    rule: str | None = None
    kv_quant: str | None = None  # a LeanK method's quantised middle (None: the model's dtype)
    hf_quant: tuple[str, int, int] | None = None  # (backend, bits, group) of transformers' QuantizedCache

    def mask(self, lm: Any, prefill: Prefill, row: int) -> ChannelMask | None:
        """The mask row ``row`` of ``prefill`` decodes with (None: every channel, the model's own cache)."""
        raise NotImplementedError


@dataclass
class Full(Method):
    """The full model: dense attention and the model's own cache."""

    name: str = "full"

    def mask(self, lm, prefill, row):
        return None


@dataclass
class Learned(Method):
    """LeanK: the learned mask, ``lm.mask`` unless ``learned`` is given."""

    name: str = "leank"
    learned: ChannelMask | None = None
    rule: str | None = None
    kv_quant: str | None = None

    def mask(self, lm, prefill, row):
        return self.learned if self.learned is not None else lm.mask


@dataclass
class RandomChannels(Method):
    """Per head as many kept channels as the learned mask (``like``, default ``lm.mask``), drawn at random
    with ``seed``; or the ``fixed`` mask given."""

    name: str = "random"
    seed: int = 0
    like: ChannelMask | None = None
    fixed: ChannelMask | None = None
    rule: str | None = None
    kv_quant: str | None = None

    def mask(self, lm, prefill, row):
        return self.fixed if self.fixed is not None else random_mask_like(self.like or lm.mask, self.seed)


@dataclass
class ThinK(Method):
    """ThinK's selection from row ``row``'s last ``window`` queries and all its keys, at the budget of the
    learned mask (``like``, default ``lm.mask``)."""

    name: str = "think"
    window: int = 32
    like: ChannelMask | None = None
    rule: str | None = None
    kv_quant: str | None = None

    def mask(self, lm, prefill, row):
        start = int(prefill.starts[row])
        keys = {i: k[row:row + 1, :, start:] for i, k in enumerate(prefill.keys)}
        queries = {i: q[row:row + 1] for i, q in prefill.queries.items()}
        return think_from(queries, keys, self.like or lm.mask, self.window)


@dataclass
class QuantizedKV(Method):
    """KV quantisation alone: every channel, the cache transformers' ``QuantizedCache(backend, nbits=bits)``
    with its defaults (64 values per group, ``group``; the last 128 tokens in full precision)."""

    name: str = "quanto-int4"
    backend: str = "quanto"
    bits: int = 4
    group: int = 64  # values per scale (transformers' q_group_size): it must divide a layer's K/V size

    @property
    def hf_quant(self) -> tuple[str, int, int]:  # type: ignore[override]
        return (self.backend, self.bits, self.group)

    def mask(self, lm, prefill, row):
        return None


#: the methods by name, as ``--methods`` names them
METHODS: dict[str, type[Method]] = {m().name: m for m in (Full, Learned, RandomChannels, ThinK)}


def method(name: str) -> Method:
    """The method called ``name`` with its default settings (a LeanK method: the evaluated model's rule)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name]()


def kv_quant_of(method: Method, lm: Any) -> Any:
    """The kv_quant a method's masks decode with: its own, else the evaluated model's (``lm.kv_quant``), else None."""
    return method.kv_quant or getattr(lm, "kv_quant", None)


def rule_of(method: Method, lm: Any) -> str:
    """The rule ``method`` decodes by: its own, else the evaluated model's (``lm.rule``), else the default."""
    return method.rule or getattr(lm, "rule", DEFAULT_RULE)


def random_mask_like(mask: ChannelMask, seed: int = 0) -> ChannelMask:
    """The same kept count per head as ``mask``, channels drawn at random."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(mask.keep.shape, generator=g)
    ranks = noise.argsort(-1).argsort(-1)
    keep = ranks < mask.kept_counts.unsqueeze(-1)
    return _with_keep(mask, keep)


def _with_keep(mask: ChannelMask, keep: torch.Tensor) -> ChannelMask:
    """``mask`` with another ``keep`` (no scores): sizes, base model, adapter, overrides and dense layers stay."""
    return replace(mask, keep=keep, scores=None)


def think_from(queries: dict[int, torch.Tensor], keys: dict[int, torch.Tensor], mask: ChannelMask,
               window: int = 32) -> ChannelMask:
    """ThinK's mask from one prompt's post-RoPE queries ``[1, Hq, >=window, D]`` and keys ``[1, Hkv, T, D]``
    per layer, at the learned mask's K budget.

    The budget is the learned mask's mean kept count over the layers it prunes; layers it leaves dense
    (sliding-window layers: Gemma 2/3) stay dense here too, as LeanK's cache requires.
    """
    pruned = [i for i in range(mask.num_layers) if i not in mask.dense_layers]
    missed = sorted(set(pruned) - (set(queries) & set(keys)))
    if missed:  # those layers would stay whole: ThinK would spend more than LeanK's budget
        raise RuntimeError(f"ThinK baseline: the probe saw no queries/keys of layers {missed}")
    per_head = int(round(float(mask.keep[pruned].float().mean()) * mask.head_dim)) if pruned else mask.head_dim
    keep = torch.ones_like(mask.keep)
    for layer in pruned:
        q, k = queries[layer], keys[layer]
        keep[layer] = False
        b, hq, _, d = q.shape
        hkv = k.shape[1]
        qn = q[:, :, -window:].float().reshape(b, hkv, hq // hkv, -1, d).pow(2).sum(dim=(0, 2, 3)).sqrt()
        kn = k.float().pow(2).sum(dim=(0, 2)).sqrt()  # column norms per KV head and channel: [Hkv, D]
        top = (qn * kn).topk(per_head, dim=-1).indices
        keep[layer].scatter_(-1, top.cpu(), True)
    return _with_keep(mask, keep)


def think_mask(model: Any, input_ids: torch.Tensor, mask: ChannelMask, window: int = 32) -> ChannelMask:
    """ThinK's query-driven selection for one prompt ``[1, T]``, at the learned mask's K budget."""
    from .prefill import prefill

    pre = prefill(model, input_ids, torch.ones_like(input_ids), window=window)
    return think_from(pre.queries, dict(enumerate(pre.keys)), mask, window)
