"""One dense prefill per batch of probes, shared by every method, and greedy decoding from it.

LeanK's default rule (``"dense-prompt"``, docs/rule.md, "The rules") prefills with full attention: the prompt's forward, its K/V and its
first answer token are the same for the full model, the learned mask and both baselines. Only what the cache keeps of those
K/V differs, and so the decode steps. So a batch of left-padded prompts is prefilled once, dense; each
method then gets a cache filled from those K/V (a ``DynamicCache`` for the full model, a ``LeanKCache``
of its mask otherwise: the cache compresses the prompt exactly as in its own prefill) and decodes from
the first token on. That is the same computation as ``generate`` per method, with the prefill done once
instead of four times; a test holds the answers equal to each method's own ``generate``. Under the
``"positional"`` rule the prompt attends by the mask too, so a method decoding by it prefills on its own:
``generate`` from the prompt with a LeanK cache of that rule.

ThinK selects channels from the prompt's queries: the prefill can record each layer's last ``window``
post-RoPE queries. The recorder is handed to the attention function through the forward's keyword
arguments (transformers passes them down to it), so nothing is kept outside the objects of one call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from leank_infer import ChannelMask
from leank_infer.decode.cache import LeanKCache, fill_from_prefill
from leank_infer.decode.rule import DEFAULT_RULE, POSITIONAL, check_rule
from leank_infer.model.generation import CACHE_KWARG

#: the attention implementation of a recording prefill: the model's dense attention, plus the recorder
RECORDING = "leank_record"
_RECORDER_KWARG = "leank_recorder"


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    """Dense attention; a recorder in the forward's kwargs sees each layer's post-RoPE queries and keys."""
    from leank_infer.decode.attention import dense_attention

    recorder = kwargs.pop(_RECORDER_KWARG, None)
    if recorder is not None:
        recorder(module.layer_idx, query, key)
    return dense_attention(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(RECORDING, _recording_attention)
    AttentionMaskInterface.register(RECORDING, sdpa_mask)


@dataclass
class Prefill:
    """A batch of left-padded prompts after their dense prefill.

    ``keys``/``values``: per layer ``[B, Hkv, T, D]`` (post-RoPE keys, padding included); ``queries``: per
    layer the last ``window`` post-RoPE queries ``[B, Hq, W, D]`` (empty unless recorded); ``first``: the
    greedy first answer token of each row.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    first: torch.Tensor
    queries: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def starts(self) -> torch.Tensor:
        """Each row's first real token (its left padding)."""
        return (self.attention_mask == 0).long().cumprod(-1).sum(-1)

    def select(self, rows: Sequence[int]) -> Prefill:
        """The prefill of these rows alone, padding no row needs dropped."""
        idx = torch.tensor(list(rows), dtype=torch.long)
        cut = int(self.starts[idx].min())
        return Prefill(self.input_ids[idx, cut:], self.attention_mask[idx, cut:],
                       [k[idx, :, cut:] for k in self.keys], [v[idx, :, cut:] for v in self.values],
                       self.first[idx], {i: q[idx] for i, q in self.queries.items()})

    @property
    def positions(self) -> torch.Tensor:
        """``position_ids`` as ``generate`` numbers them: real tokens from 0, padding at 1."""
        pos = self.attention_mask.long().cumsum(-1) - 1
        return pos.masked_fill(self.attention_mask == 0, 1)


@torch.no_grad()
def prefill(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, window: int = 0) -> Prefill:
    """The dense prefill of a left-padded batch (the model's own dense attention, whatever it decodes with);
    with ``window`` > 0 each layer's last ``window`` queries are recorded (for ThinK)."""
    from transformers import DynamicCache

    from leank_infer.model.generation import set_attn_implementation

    queries: dict[int, torch.Tensor] = {}
    extra: dict[str, Any] = {}
    if window > 0:

        def record(layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
            queries[layer] = query[:, :, -window:].detach()

        extra[_RECORDER_KWARG] = record
    _register()
    cache = DynamicCache(config=model.config)
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    previous = model.config._attn_implementation
    set_attn_implementation(model, RECORDING)
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                    **{CACHE_KWARG: cache}, use_cache=True, logits_to_keep=1, **extra)
    finally:
        set_attn_implementation(model, previous)
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    return Prefill(input_ids, attention_mask, keys, values, out.logits[:, -1].argmax(-1), queries)


def _filled_cache(lm: Any, mask: ChannelMask | None, pre: Prefill, kv_quant: str | None = None,
                  hf_quant: tuple[str, int, int] | None = None, rule: str = DEFAULT_RULE) -> Any:
    """A cache holding the prefill's K/V as ``mask``'s own prefill would store them (None: a dense cache;
    ``kv_quant``: a LeanK cache with a quantised middle; ``hf_quant`` (backend, bits, group): transformers'
    ``QuantizedCache``, every channel)."""
    from transformers import DynamicCache, QuantizedCache

    config = lm.model.config
    if mask is not None:
        cache = LeanKCache(mask, config=config, kv_quant=kv_quant, rule=rule)
    elif hf_quant is not None:
        cache = QuantizedCache(hf_quant[0], config, nbits=hf_quant[1], q_group_size=hf_quant[2])
    else:
        cache = DynamicCache(config=config)
    return fill_from_prefill(cache, pre.keys, pre.values, pre.positions)


def _eos_ids(lm: Any) -> set[int]:
    eos = lm.model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if getattr(lm.tokenizer, "eos_token_id", None) is not None:
        eos.append(lm.tokenizer.eos_token_id)
    return set(eos)


@torch.no_grad()
def decode(lm: Any, mask: ChannelMask | None, pre: Prefill, max_new_tokens: int,
           rule: str = DEFAULT_RULE, kv_quant: str | None = None,
           hf_quant: tuple[str, int, int] | None = None) -> list[list[int]]:
    """Greedy answer tokens of each row with ``mask`` (None: the full model), up to ``max_new_tokens``,
    ending before the first end-of-sequence token: what ``generate`` returns after this prefill. With
    ``rule="positional"`` a mask's answers come from its own prefill (``generate`` from the prompt).
    ``kv_quant``: the LeanK cache's middle quantised; ``hf_quant``: without a mask, transformers'
    ``QuantizedCache`` instead of the dense one (see :func:`_filled_cache`)."""
    eos = _eos_ids(lm)
    pad = next(iter(eos)) if eos else 0
    check_rule(rule)
    if kv_quant is not None and mask is not None and len(pre.first) > 1 and not bool(pre.attention_mask.all()):
        # rows of different lengths reach a key at different steps, and the cache quantises a key only once it is
        # middle for every row: batched, a row would hold some of its middle keys unquantised longer than alone.
        # Each row alone (its padding dropped) answers as its own generate does.
        return [decode(lm, mask, pre.select([i]), max_new_tokens, rule, kv_quant, hf_quant)[0]
                for i in range(len(pre.first))]
    if rule == POSITIONAL and mask is not None:
        cache = LeanKCache(mask, config=lm.model.config, rule=POSITIONAL, kv_quant=kv_quant)
        out = lm.model.generate(input_ids=pre.input_ids, attention_mask=pre.attention_mask, **{CACHE_KWARG: cache},
                                max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        return _until_eos(out[:, pre.input_ids.shape[1]:], eos)
    first = pre.first.unsqueeze(-1)
    tokens = first
    if max_new_tokens > 1 and not all(int(t) in eos for t in pre.first):
        ids = torch.cat([pre.input_ids, first], -1)
        attn = torch.cat([pre.attention_mask, torch.ones_like(first)], -1)
        cache = _filled_cache(lm, mask, pre, kv_quant, hf_quant, rule)
        with lm.dense() if mask is None else contextlib.nullcontext():
            out = lm.model.generate(input_ids=ids, attention_mask=attn, **{CACHE_KWARG: cache},
                                    max_new_tokens=max_new_tokens - 1, do_sample=False, pad_token_id=pad)
        tokens = torch.cat([first, out[:, ids.shape[1]:]], -1)
    return _until_eos(tokens, eos)


def _until_eos(tokens: torch.Tensor, eos: set[int]) -> list[list[int]]:
    """Each row's tokens before its first end-of-sequence token."""
    rows = []
    for row in tokens.tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def decode_each(lm: Any, masks: Sequence[ChannelMask | None], pre: Prefill, max_new_tokens: int,
                key: Callable[[ChannelMask | None], Any] | None = None, rule: str = DEFAULT_RULE,
                kv_quant: str | None = None, hf_quant: tuple[str, int, int] | None = None) -> list[list[int]]:
    """Row ``i`` decoded with ``masks[i]`` by ``rule`` (and ``kv_quant`` / ``hf_quant``, see :func:`decode`):
    rows that share a mask decode together, in one batch."""
    key = key or mask_key
    groups: dict[Any, list[int]] = {}
    for i, m in enumerate(masks):
        groups.setdefault(key(m), []).append(i)
    answers: list[list[int]] = [[] for _ in masks]
    for rows in groups.values():
        part = pre if len(rows) == len(masks) else pre.select(rows)
        for i, tokens in zip(rows, decode(lm, masks[rows[0]], part, max_new_tokens, rule, kv_quant, hf_quant),
                             strict=True):
            answers[i] = tokens
    return answers


def mask_key(mask: ChannelMask | None) -> Any:
    """Equal for masks that decode alike (the same kept channels and sizes), None for the full model."""
    if mask is None:
        return None
    return (mask.keep.numpy().tobytes(), mask.sink_size, mask.recent_size, mask.accumu_size, mask.dense_layers)
