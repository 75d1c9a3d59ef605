"""The LeanK KV cache for transformers: full head and tail, channel-pruned middle, preallocated.

Per layer, in padded (left-padding) coordinates ``[0, T)`` (see :mod:`leank_infer.decode.layout`):

- head ``[0, H)``, all channels, ``H = min(T, max_row_start + sink_size)``: the sink of every row,
- middle ``[H, M)``: K keeps only the masked channels, one tensor per group of KV heads with
  equal kept count (``[B, Hg, n, c]`` views of channel-major storage), V only for heads that keep any channel,
- tail ``[M, T)``, all channels: the recent tokens, new tokens are appended here.

The layer's state is its rule and its :class:`Phase`. The prefill update compresses at once (the attention
of the prefill runs on the K/V it was given), and before each later update the layer moves to the middle
every key that is a middle key for the next query of every row
(:func:`~leank_infer.decode.rule.positional_compressible`). The attention only reads :meth:`LeanKLayer.layout`.

Storage is preallocated: head and tail share one ``[B, Hkv, cap, D]`` buffer sized for
``head + recent + accumu + 1`` tokens (:meth:`LeanKLayer._full_capacity`: a decode step writes one slot;
every ``accumu_size`` steps the tail shifts down by ``accumu_size``), the middle grows in chunks of
:data:`MID_CHUNK` tokens. Row starts come from ``position_ids`` (generate numbers each row's real tokens from 0).

``rule`` (:data:`~leank_infer.decode.rule.RULES`, described in
:data:`~leank_infer.decode.rule.RULE_DESCRIPTIONS`): every generated query follows
:func:`~leank_infer.decode.rule.positional_recent_from`, a function of its position alone. Under
``"dense-prompt"`` (the default) the forward that fills the empty layer attends with every channel; under
``"positional"`` it follows the rule too (:mod:`~leank_infer.decode.positional_prefill`, over the K/V as
given). With left padding, rows reach a key at different steps: a tail key that is already middle for some
row is scored with the kept channels there (``DecodeMasks.tail_mid``). Several tokens at once (chunked
prefill, assisted decoding) then give what one prefill gives.

``dense_until`` (default 0: off; ``"dense-prompt"`` only) is the documented switch for short contexts:
while a layer holds fewer tokens than that (padded length, before a forward's new tokens), it keeps every
token's full K/V and its attention is the model's dense one, no memory saved (``Phase.DENSE_UNTIL``); the
first forward at or past it compresses the layer to exactly the state the rule would have reached (the
middle is ``[head, recent_start)``, and ``recent_start`` depends on the length alone) and decodes by the
rule from then on. On a CPU at batch 1 below ~1.5k tokens the dense step is the faster one
(docs/speed.md); the saving then starts at ``dense_until`` tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    DynamicLayer,
    get_layer_types_and_kwargs,
)

from ..mask import ChannelMask, dense_layers_of, model_positions
from . import layer_handoff
from .attention import ATTN_IMPLEMENTATION
from .kv_quant import KVQuant, kv_quant_format
from .layout import ChannelGroups, DecodeLayout, DecodeMasks, Phase, decode_masks
from .quant_middle import QuantMiddleStore
from .rule import DEFAULT_RULE, DENSE_PROMPT, POSITIONAL, check_rule, positional_compressible

MID_CHUNK = 64  # middle capacity grows by this many tokens: a copy of the middle every 64 tokens, <= 64 spare
MID_ALIGN = 16  # middle capacity is a multiple of this: the GPU kernel then moves channel-major K as full vectors


def check_rule_options(rule: str, dense_until: int) -> str:
    """``rule`` if it is a known rule and ``dense_until`` fits it, else one ValueError saying what is wrong."""
    check_rule(rule)
    if rule == POSITIONAL and dense_until:
        raise ValueError(
            f"dense_until={dense_until} has no meaning under rule={rule!r}: its prompt is pruned too, so no "
            f"forward is dense; use dense_until=0, or rule={DENSE_PROMPT!r} (the default)"
        )
    return rule


class StepMasks:
    """The region masks of one forward, computed once for every LeanK layer of a cache.

    All LeanK layers of a cache hold the same token layout (lengths, row starts, recent start), so the
    masks of a step are the same for each: the cache makes one of these and gives it to each layer it builds.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._attention_mask: torch.Tensor | None = None
        self._masks: DecodeMasks | None = None

    def get(self, layout: DecodeLayout, attention_mask: torch.Tensor | None, q_len: int) -> DecodeMasks:
        """The masks of ``layout``'s step (:func:`~leank_infer.decode.layout.decode_masks`), reused while the
        layout's geometry and the model's mask object are those of the last call."""
        key = (layout.length, q_len, layout.head_len, layout.mid_len, layout.recent_from)
        if self._masks is None or self._key != key or self._attention_mask is not attention_mask:
            self._key, self._attention_mask = key, attention_mask
            self._masks = decode_masks(layout, attention_mask, q_len)
        return self._masks

    def clear(self) -> None:
        """Forget the last step's masks (the layout changed under them: a new prefill, a batch reordered)."""
        self._key = self._attention_mask = self._masks = None


def mid_capacity(n: int) -> int:
    """Slots to allocate for ``n`` middle tokens: ``n`` rounded up to :data:`MID_ALIGN`."""
    return -(-n // MID_ALIGN) * MID_ALIGN


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what the memory really holds, views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _grow(buf: torch.Tensor, used: int, cap: int) -> torch.Tensor:
    """A buffer like ``buf`` (same memory order) with capacity ``cap`` on axis 2, its first ``used`` slots copied."""
    b, h, _, c = buf.shape
    out = middle_k_storage(buf, b, h, cap, c) if _channel_major(buf) else buf.new_empty(b, h, cap, c)
    out[:, :, :used] = buf[:, :, :used]
    return out


def middle_k_storage(like: torch.Tensor, b: int, h: int, cap: int, c: int) -> torch.Tensor:
    """Storage of one group's middle K: channel-major ``[B, Hg, c, cap]`` seen as ``[B, Hg, cap, c]``.

    Keys run along memory for each kept channel, so the decode's score product reads a ``[c, n]``
    matrix with unit stride (about 2x faster on CPU than key-major ``[n, c]`` at c = 16-48).
    """
    return like.new_empty(b, h, c, cap).transpose(2, 3)


def _channel_major(t: torch.Tensor) -> bool:
    return t.shape[3] > 1 and t.stride(2) == 1


def _batch_map(t: torch.Tensor, fn: Any) -> torch.Tensor:
    """``fn`` (a map over axis 0) applied to ``t`` keeping its memory order (channel-major middle K stays so)."""
    return fn(t.transpose(2, 3)).transpose(2, 3) if _channel_major(t) else fn(t)


class LeanKLayer(CacheLayerMixin):
    """One layer of a :class:`LeanKCache` (see the module docstring for the layout).

    Its state is the ``rule`` it decodes by and its :class:`Phase`; ``update`` moves it along
    ``EMPTY -> PREFILLING | DENSE_UNTIL -> COMPRESSED``, the attention only reads it.
    """

    is_compileable = False
    # crop() drops tokens appended since the last compression (what assisted decoding rolls back) and
    # refuses, with a clear error, any older ones: safe to declare for generate's croppability check
    is_croppable = True
    is_sliding = False

    def __init__(
        self,
        keep: torch.Tensor,
        sink_size: int,
        recent_size: int,
        accumu_size: int,
        config: Any = None,
        step_masks: StepMasks | None = None,
        dense_until: int = 0,
        rule: str = DEFAULT_RULE,
        kv_quant: str | KVQuant | None = None,
    ):
        super().__init__()
        self.kv_quant = kv_quant_format(kv_quant)
        if dense_until < 0:
            raise ValueError(f"dense_until must be >= 0 tokens, got {dense_until}")
        self.rule = check_rule_options(rule, dense_until)
        self.dense_until = int(dense_until)
        self.step_masks = StepMasks() if step_masks is None else step_masks
        self.groups = ChannelGroups.from_keep(keep)
        self.sink_size, self.recent_size, self.accumu_size = sink_size, recent_size, accumu_size
        self._config = config
        self._clear()

    def _clear(self) -> None:
        self._full_k = self._full_v = self._mid_v = None
        self._mid_k: list[torch.Tensor] = []
        self._quant: QuantMiddleStore | None = None  # the middle, when kv_quant quantises it
        self.head_len = self.tail_len = self.mid_len = 0
        self.starts: torch.Tensor | None = None
        self.padded = False  # some row starts after 0 (left padding)
        self.head_target = self.sink_size  # the head holds every row's sink: the last row's start + sink_size
        self.recent_start = 0  # keys below it (and past the head) are middle keys for every row's next query
        self.length = 0
        self.phase = Phase.EMPTY
        self.starts_hint: torch.Tensor | None = None  # row starts when the prefill has no position_ids
        self.is_initialized = False

    # ---- sizes and views -----------------------------------------------------------------------
    @property
    def head_k(self) -> torch.Tensor:
        return self._full_k[:, :, : self.head_len]

    @property
    def head_v(self) -> torch.Tensor:
        return self._full_v[:, :, : self.head_len]

    @property
    def tail_k(self) -> torch.Tensor:
        return self._full_k[:, :, self.head_len : self.head_len + self.tail_len]

    @property
    def tail_v(self) -> torch.Tensor:
        return self._full_v[:, :, self.head_len : self.head_len + self.tail_len]

    @property
    def mid_k(self) -> list[torch.Tensor]:
        """Middle K per head group as ``[B, Hg, n, c]`` views of the preallocated storage (kv_quant: dequantised)."""
        if self._quant is not None:
            return list(self.layout().dequantized().mid_k)
        return [t[:, :, : self.mid_len] for t in self._mid_k]

    @property
    def mid_v(self) -> torch.Tensor:
        if self._quant is not None:
            return self.layout().dequantized().mid_v
        return self._mid_v[:, :, : self.mid_len]

    def layout(self) -> DecodeLayout:
        """This layer's compressed K/V as the decode backends read it."""
        full, n = self.head_len + self.tail_len, self.mid_len
        quant = None
        if self._quant is not None:  # codes and their parameters, checked first (never decoded as garbage)
            self._quant.check()
            mid_k, mid_v, quant = self._quant.view()
        else:
            mid_k, mid_v = tuple(t.narrow(2, 0, n) for t in self._mid_k), self._mid_v.narrow(2, 0, n)
        return DecodeLayout(
            self._full_k.narrow(2, 0, full),
            self._full_v.narrow(2, 0, full),
            self.head_len,
            mid_k,
            mid_v,
            self.groups,
            self.starts,
            self.sink_size,
            self.recent_start,
            self.length,
            self.padded,
            (self.recent_size, self.accumu_size),
            quant,
        )

    def decode_masks(self, attention_mask: torch.Tensor | None, q_len: int) -> DecodeMasks:
        """Region masks of this step (:func:`~leank_infer.decode.layout.decode_masks`), built once per step for all layers."""
        if attention_mask is None and q_len == 1 and not self.padded:
            return DecodeMasks()
        return self.step_masks.get(self.layout(), attention_mask, q_len)

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def _tensors(self) -> list[torch.Tensor]:
        quant = self._quant.tensors() if self._quant is not None else []
        return [t for t in (self._full_k, self._full_v, self._mid_v, *self._mid_k, *quant) if t is not None]

    def nbytes(self) -> int:
        """Bytes of the K/V this layer holds: the tokens stored, each with its channels (the mask's formula,
        :mod:`leank_infer.mask.kv_bytes`; kv_quant: codes, scales, minima and the open group's copy)."""
        if not self.is_initialized:
            return 0
        full = self.head_len + self.tail_len
        item = self._full_k.element_size()
        b = self._full_k.shape[0]
        per_full = self._full_k.shape[1] * (self._full_k.shape[3] + self._full_v.shape[3])
        if self._quant is not None:
            from ..mask.kv_bytes import quantized_middle_bytes

            q = self._quant
            middle = quantized_middle_bytes(self.groups.keep.sum(-1), q.v_dim, self.mid_len, q.k_groups(),
                                            q.open_tokens(), q.fmt, self._full_k.dtype)
            return b * (item * full * per_full + middle)
        per_mid = sum(t.shape[1] * t.shape[3] for t in self._mid_k) + self._mid_v.shape[1] * self._mid_v.shape[3]
        return b * item * (full * per_full + self.mid_len * per_mid)

    def allocated_bytes(self) -> int:
        """Bytes of storage reserved (>= :meth:`nbytes`: the preallocated spare slots included)."""
        return storage_bytes(self._tensors())

    # ---- filling -------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        if (kv_heads, head_dim) != tuple(self.groups.keep.shape):
            raise ValueError(
                f"LeanK cache layer expects {tuple(self.groups.keep.shape)} (kv_heads, head_dim) keys, "
                f"got {(kv_heads, head_dim)}"
            )
        self.device, self.dtype = key_states.device, key_states.dtype
        self.groups = self.groups.to(self.device)
        self.starts = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args: Any,
        kwargs: dict | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new K/V; returns what the attention of this forward reads (see :class:`Phase`).

        Prefill (an empty layer): compressed at once (``PREFILLING``; its attention runs on the K/V given,
        returned as they are), or kept whole while shorter than ``dense_until`` (``DENSE_UNTIL``). Later:
        the rule's compression, then the new tokens join the head (until it holds every row's sink) or the
        tail. ``kwargs`` is the attention kwargs dict of the calling module (transformers 5.20+): the prefill
        reads its ``position_ids`` there.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.phase is Phase.EMPTY:
            positions = kwargs.get("position_ids") if isinstance(kwargs, dict) else None
            self._prefill(key_states, value_states, positions)
            return key_states, value_states
        self._check_attention()
        self.recent_start = positional_compressible(self.length, self.starts, self.recent_size, self.accumu_size)
        if self.phase is Phase.PREFILLING or (self.phase is Phase.DENSE_UNTIL and self.length >= self.dense_until):
            self._compress()
        if self.phase is Phase.COMPRESSED:
            self._roll()
        self._append(key_states, value_states)
        if self.phase is Phase.DENSE_UNTIL:  # dense attention over every token so far, read in place
            full = self.head_len + self.tail_len
            return self._full_k.narrow(2, 0, full), self._full_v.narrow(2, 0, full)
        return key_states, value_states  # the "leank" attention reads layout(), not these

    def _check_attention(self) -> None:
        impl = getattr(self._config, "_attn_implementation", ATTN_IMPLEMENTATION)
        if impl != ATTN_IMPLEMENTATION:
            raise RuntimeError(
                f"a LeanK cache decodes only with attn_implementation={ATTN_IMPLEMENTATION!r}, the model uses {impl!r}: "
                "use LeanKModel, or model.set_attn_implementation('leank') after importing leank_infer.decode.attention"
            )

    @staticmethod
    def starts_from_positions(positions: torch.Tensor | None, batch: int, t: int, device: torch.device) -> torch.Tensor:
        """Each row's first real token: generate numbers real tokens from 0 after left padding, so
        start = T - 1 - position of the last token (zeros without positions)."""
        if positions is None or positions.shape[-1] != t:
            return torch.zeros(batch, dtype=torch.long, device=device)
        start = (t - 1 - positions.reshape(-1, t)[:, -1].to(device).long()).clamp(0, t - 1)
        return start.expand(batch).contiguous()

    def _full_capacity(self, full_tokens: int) -> int:
        """Slots of the head-and-tail buffer for ``full_tokens`` stored whole: at least a compressed layer's
        most (every row's sink, the recent part, ``accumu_size`` tokens before the next compression), plus
        the slot a decode step writes."""
        return max(full_tokens, self._bounded(self.head_target + self.recent_size)) + self._bounded(self.accumu_size) + 1

    def _prefill(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor | None) -> None:
        """Split the prefill K/V into head / compressed middle / tail and store them (under ``dense_until``:
        everything past the head stays whole, in the tail)."""
        batch, kv_heads, tokens, head_dim = key.shape
        if positions is None and self.starts_hint is not None and batch % self.starts_hint.numel() == 0:
            # generate expands rows (beams, num_return_sequences) after making the cache: repeat each row's start
            self.starts = self.starts_hint.to(self.device).repeat_interleave(batch // self.starts_hint.numel())
        else:
            self.starts = self.starts_from_positions(positions, batch, tokens, self.device)
        last_start = int(self.starts.max())
        self.padded = last_start > 0
        self.head_target = last_start + self.sink_size
        head_end = min(tokens, self.head_target)
        self.recent_start = positional_compressible(tokens, self.starts, self.recent_size, self.accumu_size)
        self.phase = Phase.DENSE_UNTIL if tokens < self.dense_until else Phase.PREFILLING
        # the middle [head_end, middle_end); under dense_until everything after the head stays whole
        middle_end = head_end if self.phase is Phase.DENSE_UNTIL else max(head_end, self.recent_start)
        tail_tokens = tokens - middle_end
        capacity = self._full_capacity(head_end + tail_tokens)
        self._full_k = key.new_empty(batch, kv_heads, capacity, head_dim)
        self._full_v = value.new_empty(batch, kv_heads, capacity, value.shape[-1])
        self._full_k[:, :, :head_end] = key[:, :, :head_end]
        self._full_v[:, :, :head_end] = value[:, :, :head_end]
        self._full_k[:, :, head_end : head_end + tail_tokens] = key[:, :, middle_end:]
        self._full_v[:, :, head_end : head_end + tail_tokens] = value[:, :, middle_end:]
        self.head_len, self.tail_len = head_end, tail_tokens
        middle_slots = mid_capacity(middle_end - head_end)
        if self.kv_quant is not None:
            self._quant = QuantMiddleStore(self.kv_quant, self.groups, batch, value.shape[-1], value.dtype,
                                           value.device, MID_ALIGN)
            middle_slots = 0
        self._mid_k = [middle_k_storage(key, batch, len(heads), middle_slots, count)
                       for heads, count in zip(self.groups.heads, self.groups.counts, strict=True)]
        self._mid_v = value.new_empty(batch, len(self.groups.nonzero_order), middle_slots, value.shape[-1])
        self.mid_len = 0
        self._write_middle(key[:, :, head_end:middle_end], value[:, :, head_end:middle_end])
        self.length = tokens
        self.step_masks.clear()

    def _write_middle(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append full K/V ``[B, Hkv, n, D]`` to the middle: the kept channels per head group, V of nonzero heads."""
        n = k.shape[2]
        if n == 0:
            return
        end = self.mid_len + n
        if self._quant is not None:  # kept channels per head group and V of nonzero heads, quantised
            b = k.shape[0]
            kept = [k.index_select(1, heads).gather(-1, channels.view(1, len(heads), 1, -1).expand(b, -1, n, -1))
                    for heads, channels in zip(self.groups.heads, self.groups.channels, strict=True)]
            self._quant.write(kept, v.index_select(1, self.groups.nonzero_order), max(MID_CHUNK, self.accumu_size))
            self.mid_len = end
            return
        cap = self._mid_v.shape[2]
        if end > cap:
            # the first write (an empty middle: a short prompt, or dense_until's switch) takes what it holds
            cap = mid_capacity(max(end, cap + self._bounded(max(MID_CHUNK, self.accumu_size))) if cap else end)
            self._mid_k = [_grow(t, self.mid_len, cap) for t in self._mid_k]
            self._mid_v = _grow(self._mid_v, self.mid_len, cap)
        b = k.shape[0]
        for buf, heads, channels in zip(self._mid_k, self.groups.heads, self.groups.channels, strict=True):
            hg, c = channels.shape
            kept = k.index_select(1, heads).gather(-1, channels.view(1, hg, 1, c).expand(b, hg, n, c))
            buf[:, :, self.mid_len : end] = kept
        self._mid_v[:, :, self.mid_len : end] = v.index_select(1, self.groups.nonzero_order)
        self.mid_len = end

    def _roll(self) -> None:
        """Move the tail's tokens below the recent start to the middle; the rest of the tail shifts down."""
        move = min(self.tail_len, max(self.head_len, self.recent_start) - (self.head_len + self.mid_len))
        if move <= 0:
            return
        h, t = self.head_len, self.tail_len
        self._write_middle(self._full_k[:, :, h : h + move], self._full_v[:, :, h : h + move])
        rest = t - move
        if rest:
            self._full_k[:, :, h : h + rest] = self._full_k[:, :, h + move : h + t].clone()
            self._full_v[:, :, h : h + rest] = self._full_v[:, :, h + move : h + t].clone()
        self.tail_len = rest

    def _compress(self) -> None:
        """Enter ``COMPRESSED``: after the prefill's forward, nothing to move (its update compressed); after
        ``dense_until``, the tokens below ``recent_start`` go to the middle at once (the state the rule would
        have reached by now) and the full buffer shrinks back to its compressed size."""
        was_whole, self.phase = self.phase is Phase.DENSE_UNTIL, Phase.COMPRESSED
        if not was_whole:
            return
        self._roll()
        capacity = self._full_capacity(self.head_len + self.tail_len)
        if capacity < self._full_k.shape[2]:
            self._full_k = self._full_k[:, :, :capacity].clone()
            self._full_v = self._full_v[:, :, :capacity].clone()
        self.step_masks.clear()

    def _bounded(self, tokens: int) -> int:
        """``tokens`` of preallocation, at most the model's positions (a mask's sizes may say 2^31-1: "never
        prune"; no sequence holds more tokens than the model has positions)."""
        limit = model_positions(self._config) if self._config is not None else None
        return tokens if limit is None else min(tokens, limit)

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        q_len = k.shape[2]
        take = 0
        if self.mid_len == 0 and self.tail_len == 0:  # short prompt: fill the head to its target first
            take = min(q_len, max(0, self.head_target - self.head_len))
        pos = self.head_len + self.tail_len
        if pos + q_len > self._full_k.shape[2]:  # several tokens at once, or a dense_until layer growing
            growth = max(MID_CHUNK, self.accumu_size) if self.phase is Phase.DENSE_UNTIL else self.accumu_size
            cap = pos + q_len + self._bounded(growth) + 1
            self._full_k = _grow(self._full_k, pos, cap)
            self._full_v = _grow(self._full_v, pos, cap)
        self._full_k.narrow(2, pos, q_len).copy_(k)
        self._full_v.narrow(2, pos, q_len).copy_(v)
        self.head_len += take
        self.tail_len += q_len - take
        self.length += q_len

    # ---- generate() hooks ----------------------------------------------------------------------
    def _map_batch(self, fn: Any) -> None:
        self.step_masks.clear()
        if not self.is_initialized:
            return
        self.starts = fn(self.starts)
        if self._full_k is None:
            return
        self._full_k, self._full_v, self._mid_v = fn(self._full_k), fn(self._full_v), fn(self._mid_v)
        self._mid_k = [_batch_map(t, fn) for t in self._mid_k]
        if self._quant is not None:
            self._quant.map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (negative count, as DynamicLayer); only uncompressed ones."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to drop, got {tokens_to_remove}")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        # the next query must find full every key it scores with all channels
        next_recent = positional_compressible(self.length - n, self.starts, self.recent_size, self.accumu_size)
        compressed = self.mid_len and next_recent < self.head_len + self.mid_len
        if n > self.tail_len + (self.head_len if self.mid_len == 0 else 0) or compressed:
            raise ValueError(
                f"cannot crop {n} tokens from a LeanK cache: only uncompressed recent tokens can be dropped"
            )
        from_tail = min(n, self.tail_len)
        self.tail_len -= from_tail
        self.head_len -= n - from_tail
        self.length -= n

    def reset(self) -> None:
        self.step_masks.clear()
        self._clear()

    def offload(self) -> None:  # the base class offloads .keys/.values, which this layer does not have
        raise NotImplementedError("LeanK cache layers do not support offloading")

    def prefetch(self) -> None:
        raise NotImplementedError("LeanK cache layers do not support offloading")


def model_cache_layer(config: Any, layer_idx: int) -> CacheLayerMixin:
    """The cache layer transformers' ``DynamicCache(config=...)`` would give this layer (sliding or full)."""
    if config is None:
        return DynamicLayer()
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types, kwargs = get_layer_types_and_kwargs(cfg)
    return DYNAMIC_LAYER_TYPE_MAPPING[types[layer_idx]](**kwargs[layer_idx])


class LeanKCache(Cache):
    """A transformers ``Cache`` that stores K of middle tokens with only the channels a ChannelMask keeps.

    Pass ``config`` (the model's) to check the mask fits and that the model decodes with the
    ``"leank"`` attention implementation (a clear error instead of silently wrong attention).
    The mask's ``dense_layers`` and, given ``config``, every sliding-window layer of the model get
    the model's own cache layer (e.g. ``DynamicSlidingWindowLayer``): they keep only their window.
    ``dense_until`` (tokens, 0 = off): decode dense, without compressing, until a sequence holds that
    many tokens (see the module docstring): the short-context switch, never on by default.
    ``rule`` (:data:`~leank_infer.decode.rule.RULE_DESCRIPTIONS`): ``"dense-prompt"`` (the default), the prompt
    attends with every channel, each generated token by its position; ``"positional"``, every query, the prompt's
    too, by its position alone (it refuses ``dense_until``).
    ``kv_quant``: ``"int8"``, ``"int4"`` (or a :class:`~leank_infer.decode.kv_quant.KVQuant`) stores the middle's
    kept K channels and V quantised (:mod:`~leank_infer.decode.kv_quant`); sink and recent tokens stay full
    precision. None (default): the middle in the model's dtype.
    """

    def __init__(self, mask: ChannelMask, config: Any = None, dense_until: int = 0, rule: str = DEFAULT_RULE,
                 kv_quant: str | KVQuant | None = None):
        check_rule_options(rule, dense_until)
        fmt = kv_quant_format(kv_quant)
        if config is not None:
            mask.validate(config)
        step_masks = StepMasks()  # every LeanK layer holds the same token layout: one set of masks per step
        # the mask's dense layers, and any sliding layer of the model (validate() checked it keeps every channel)
        dense = set(mask.dense_layers) | (set(dense_layers_of(config)) if config is not None else set())
        layers = [
            model_cache_layer(config, i)
            if i in dense
            else LeanKLayer(
                mask.keep[i], mask.sink_size, mask.recent_size, mask.accumu_size, config, step_masks, dense_until, rule, fmt
            )
            for i in range(mask.num_layers)
        ]
        super().__init__(layers=layers)
        self.mask = mask
        self.dense_until = dense_until
        self.rule = rule
        self.kv_quant = fmt
        # Each row's first real token, for a prefill whose update gets no position_ids (transformers
        # < 5.20 hands none to Cache.update): set by generate's cache hook from the attention mask.
        self.prefill_starts: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The base update, then the layer offered to the attention function (see :mod:`~leank_infer.decode.layer_handoff`)."""
        layer = self.layers[layer_idx]
        if isinstance(layer, LeanKLayer):
            layer.starts_hint = self.prefill_starts
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer_handoff.offer(keys, layer if isinstance(layer, LeanKLayer) else None)
        return keys, values

    def nbytes(self) -> int:
        """Bytes of K/V the cache holds, all layers (LeanK layers: the tokens stored; dense ones: their storage)."""
        return sum(
            layer.nbytes() if isinstance(layer, LeanKLayer) else _dense_layer_bytes(layer) for layer in self.layers
        )

    def allocated_bytes(self) -> int:
        """Bytes of storage reserved, all layers: :meth:`nbytes` plus the LeanK layers' preallocated spare slots."""
        return sum(
            layer.allocated_bytes() if isinstance(layer, LeanKLayer) else _dense_layer_bytes(layer)
            for layer in self.layers
        )

    @property
    def leank_layers(self) -> list[int]:
        """Indices of the layers this cache prunes (all but the mask's dense layers)."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, LeanKLayer)]

    def region_lengths(self, layer_idx: int | None = None) -> dict[str, int]:
        """Token counts of the head, compressed middle and tail of a LeanK layer (default: the first one)."""
        if layer_idx is None:
            layer_idx = self.leank_layers[0]
        layer = self.layers[layer_idx]
        if not isinstance(layer, LeanKLayer):
            raise ValueError(f"layer {layer_idx} is a dense layer of the mask (the model's own cache layer)")
        return {
            "head": layer.head_len,
            "middle": layer.mid_len,
            "tail": layer.tail_len,
            "total": layer.length,
        }


def _dense_layer_bytes(layer: CacheLayerMixin) -> int:
    return storage_bytes([getattr(layer, "keys", None), getattr(layer, "values", None)])


def fill_from_prefill(
    cache: Cache, keys: Iterable[torch.Tensor], values: Iterable[torch.Tensor], position_ids: torch.Tensor | None = None
) -> Cache:
    """``cache`` as a prefill that computed ``keys``/``values`` (per layer ``[B, Hkv, T, D]``) leaves it.

    Each layer takes them through its own ``update``, so a LeanK cache compresses them exactly as in its
    own prefill: one dense prefill can serve a dense cache and LeanK caches alike (the benchmark, the
    evaluation). ``position_ids`` give left-padded rows their starts, as ``generate`` numbers them.
    Not for a ``rule="positional"`` cache: its prompt's attention depends on the mask, so a dense prefill's
    K/V (past the first layer) are not what its own prefill computes (``"dense-prompt"`` is fine: its prompt
    attends densely).
    """
    if getattr(cache, "rule", None) == POSITIONAL:
        raise ValueError(
            f"a LeanK cache of rule={POSITIONAL!r} cannot be filled from a dense prefill: under that rule the "
            "prompt attends by the mask too, so prefill through the LeanK model with this cache instead"
        )
    kwargs = {} if position_ids is None else {"position_ids": position_ids}
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k, v, i, kwargs=kwargs)
    return cache


def dynamic_cache_bytes(cache: Cache) -> int:
    """Bytes of K/V a plain transformers cache (DynamicCache and friends) holds, for dense comparisons."""
    return storage_bytes(
        t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
    )
