"""The LeanK KV cache for transformers: full head and tail, channel-pruned middle.

Per layer, in padded (left-padding) coordinates ``[0, T)``:

- head ``[0, H)``, all channels, ``H = min(T, max_row_start + sink_size)``: the sink of every row
  (with left padding a row's later head tokens are middle tokens *for that row*; the attention
  scores them with the kept channels only, which is cheap as the head is small),
- middle ``[H, M)``: K keeps only the masked channels, one dense tensor per group of KV heads with
  equal kept count (stored transposed, ``[B, Hg, c, n]``, so q @ K^T reads keys contiguously;
  ``mid_k`` gives ``[B, Hg, n, c]`` views); V only for heads that keep any channel,
- tail ``[M, T)``, all channels: the recent tokens, new tokens are appended here.

``recent_start`` (R) is where the full recent part begins for the LeanK rule: keys in
``[row_start + sink, R)`` are middle keys. Prefill runs ordinary attention over what was passed,
then compresses (``R = T0 - recent_size``). Before each later update, while the full part
``[R, T)`` holds more than ``recent_size + accumu_size`` tokens, R advances by ``accumu_size``
and the tail tokens below it move to the middle: new tokens are never compressed before they
have been attended with all channels.
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

from . import layer_handoff
from .attention import ATTN_IMPLEMENTATION, ChannelGroups, decode_masks
from .mask import ChannelMask, dense_layers_of


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what the memory really holds, views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A copy holding exactly its own elements (a slice must not keep the whole parent storage alive)."""
    return t.clone(memory_format=torch.contiguous_format)


class LeanKLayer(CacheLayerMixin):
    """One layer of a :class:`LeanKCache` (see the module docstring for the layout)."""

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
        shared: dict | None = None,
    ):
        super().__init__()
        # all layers of a cache hold the same token layout: they share the decode masks of a step
        self._shared = {} if shared is None else shared
        self.groups = ChannelGroups.from_keep(keep)
        self.sink_size, self.recent_size, self.accumu_size = sink_size, recent_size, accumu_size
        self._config = config
        self._clear()

    def _clear(self) -> None:
        self.head_k = self.head_v = self.tail_k = self.tail_v = self.mid_v = None
        self._mid_kt: list[torch.Tensor] = []
        self.starts: torch.Tensor | None = None
        self.head_target = self.sink_size
        self.recent_start = 0
        self.length = 0
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._prefill_positions: torch.Tensor | None = None
        self.is_initialized = False

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def head_len(self) -> int:
        return 0 if self.head_k is None else self.head_k.shape[2]

    @property
    def mid_len(self) -> int:
        return (
            self._mid_kt[0].shape[3] if self._mid_kt else (0 if self.mid_v is None else self.mid_v.shape[2])
        )

    @property
    def mid_k(self) -> list[torch.Tensor]:
        """Middle K per head group as ``[B, Hg, n, c]`` views (stored transposed: keys contiguous per channel)."""
        return [t.transpose(-1, -2) for t in self._mid_kt]

    @property
    def tail_len(self) -> int:
        return 0 if self.tail_k is None else self.tail_k.shape[2]

    @property
    def prefill_pending(self) -> bool:
        """True between the prefill update and its attention: K/V are still uncompressed."""
        return self._pending is not None

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def nbytes(self) -> int:
        """Bytes of K/V this layer really holds (distinct storages)."""
        pending = self._pending or ()
        return storage_bytes(
            [self.head_k, self.head_v, self.tail_k, self.tail_v, self.mid_v, *self._mid_kt, *pending]
        )

    # ---- filling -------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, hkv, _, d = key_states.shape
        if (hkv, d) != tuple(self.groups.keep.shape):
            raise ValueError(
                f"LeanK cache layer expects {tuple(self.groups.keep.shape)} (kv_heads, head_dim) keys, got {(hkv, d)}"
            )
        self.device, self.dtype = key_states.device, key_states.dtype
        self.groups = self.groups.to(self.device)
        empty = key_states.new_empty(b, hkv, 0, d)
        self.head_k = self.tail_k = empty
        self.head_v = self.tail_v = value_states.new_empty(b, hkv, 0, value_states.shape[-1])
        self._mid_kt = [
            key_states.new_empty(b, len(h), c, 0)
            for h, c in zip(self.groups.heads, self.groups.counts, strict=True)
        ]
        self.mid_v = value_states.new_empty(b, len(self.groups.nonzero_order), 0, value_states.shape[-1])
        self.starts = torch.zeros(b, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args: Any,
        kwargs: dict | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new K/V. Prefill: kept whole until its attention ran; later: appended (head first, then tail).

        ``kwargs`` is the attention kwargs dict of the calling module: the layer puts itself there
        as ``leank_layer`` for the ``"leank"`` attention function to find.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if isinstance(kwargs, dict):
            kwargs["leank_layer"] = self
        if self.length == 0 and self._pending is None:
            self._pending = (key_states, value_states)
            self._prefill_positions = kwargs.get("position_ids") if isinstance(kwargs, dict) else None
            self.length = key_states.shape[2]
            return key_states, value_states
        self._check_attention()
        if (
            self._pending is not None
        ):  # the prefill was not attended by "leank": take row starts from positions
            self.finish_prefill(self._starts_from_positions())
        self._roll()
        self._append(key_states, value_states)
        return self.tail_k, self.tail_v

    def _check_attention(self) -> None:
        impl = getattr(self._config, "_attn_implementation", ATTN_IMPLEMENTATION)
        if impl != ATTN_IMPLEMENTATION:
            raise RuntimeError(
                f"a LeanK cache decodes only with attn_implementation={ATTN_IMPLEMENTATION!r}, the model uses {impl!r}: "
                "use LeanKModel, or model.set_attn_implementation('leank') after importing leank_infer.attention"
            )

    def _starts_from_positions(self) -> torch.Tensor:
        pos = self._prefill_positions
        b, t = self._pending[0].shape[0], self._pending[0].shape[2]
        if pos is None or pos.shape[-1] != t:
            return torch.zeros(b, dtype=torch.long, device=self.device)
        # generate() numbers real tokens from 0 after left padding: start = T - 1 - position of the last token
        start = (t - 1 - pos.reshape(-1, t)[:, -1].to(self.device).long()).clamp(0, t - 1)
        return start.expand(b).contiguous()

    def decode_masks(self, attention_mask: torch.Tensor | None, q_len: int) -> dict[str, torch.Tensor | None]:
        """Region masks of this step (see :func:`~leank_infer.attention.decode_masks`), built once per step."""
        key = (self.length, q_len, self.head_len, self.mid_len, self.recent_start)
        memo = self._shared
        if memo.get("key") != key or memo.get("mask") is not attention_mask:
            masks = decode_masks(
                attention_mask,
                self.starts,
                self.sink_size,
                self.recent_start,
                self.head_len,
                self.mid_len,
                self.length,
                q_len,
            )
            memo.update(key=key, mask=attention_mask, masks=masks)
        return memo["masks"]

    def finish_prefill(self, starts: torch.Tensor) -> None:
        """Split the prefill K/V into head / compressed middle / tail, given each row's first real token."""
        k, v = self._pending
        self._pending = self._prefill_positions = None
        self._shared.clear()
        t = k.shape[2]
        self.starts = starts.to(self.device).long()
        self.head_target = int(self.starts.max()) + self.sink_size
        h = min(t, self.head_target)
        self.recent_start = max(0, t - self.recent_size)
        m = max(h, self.recent_start)
        self.head_k, self.head_v = _compact(k[:, :, :h]), _compact(v[:, :, :h])
        self._mid_kt, self.mid_v = self._compress(k[:, :, h:m], v[:, :, h:m])
        self.tail_k, self.tail_v = _compact(k[:, :, m:]), _compact(v[:, :, m:])

    def _compress(self, k: torch.Tensor, v: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Middle form of full K/V ``[B, Hkv, n, D]``: kept channels per head group (K^T), V of nonzero heads."""
        b, _, n, d = k.shape
        ks = []
        for heads, channels in zip(self.groups.heads, self.groups.channels, strict=True):
            hg, c = channels.shape
            kept = k.index_select(1, heads).gather(-1, channels.view(1, hg, 1, c).expand(b, hg, n, c))
            ks.append(_compact(kept.transpose(-1, -2)))
        return ks, v.index_select(1, self.groups.nonzero_order)

    def _roll(self) -> None:
        """Move the oldest full tokens to the middle while the full part exceeds recent + accumu tokens."""
        while self.length - self.recent_start > self.recent_size + self.accumu_size:
            self.recent_start += self.accumu_size
        move = max(self.head_len, self.recent_start) - (self.head_len + self.mid_len)
        if move <= 0:
            return
        ks, v = self._compress(self.tail_k[:, :, :move], self.tail_v[:, :, :move])
        self._mid_kt = [torch.cat([a, b], dim=3) for a, b in zip(self._mid_kt, ks, strict=True)]
        self.mid_v = torch.cat([self.mid_v, v], dim=2)
        self.tail_k, self.tail_v = _compact(self.tail_k[:, :, move:]), _compact(self.tail_v[:, :, move:])

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        take = 0
        if self.mid_len == 0 and self.tail_len == 0:  # short prompt: fill the head to its target first
            take = min(k.shape[2], max(0, self.head_target - self.head_len))
        if take:
            self.head_k = torch.cat([self.head_k, k[:, :, :take]], dim=2)
            self.head_v = torch.cat([self.head_v, v[:, :, :take]], dim=2)
        if take < k.shape[2]:
            self.tail_k = torch.cat([self.tail_k, k[:, :, take:]], dim=2)
            self.tail_v = torch.cat([self.tail_v, v[:, :, take:]], dim=2)
        self.length += k.shape[2]

    # ---- generate() hooks ----------------------------------------------------------------------
    def _map_batch(self, fn: Any) -> None:
        self._shared.clear()
        if not self.is_initialized:
            return
        if self._pending is not None:
            self._pending = (fn(self._pending[0]), fn(self._pending[1]))
        for name in ("head_k", "head_v", "tail_k", "tail_v", "mid_v", "starts"):
            setattr(self, name, fn(getattr(self, name)))
        self._mid_kt = [fn(t) for t in self._mid_kt]

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
        if (
            self._pending is not None
            or n > self.tail_len + (self.head_len if self.mid_len == 0 else 0)
            or (self.length - n < self.recent_start)
        ):
            raise ValueError(
                f"cannot crop {n} tokens from a LeanK cache: only uncompressed recent tokens can be dropped"
            )
        from_tail = min(n, self.tail_len)
        self.tail_k, self.tail_v = (
            self.tail_k[:, :, : self.tail_len - from_tail],
            self.tail_v[:, :, : self.tail_len - from_tail],
        )
        rest = n - from_tail
        if rest:
            self.head_k, self.head_v = (
                self.head_k[:, :, : self.head_len - rest],
                self.head_v[:, :, : self.head_len - rest],
            )
        self.length -= n

    def reset(self) -> None:
        self._shared.clear()
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
    """

    def __init__(self, mask: ChannelMask, config: Any = None):
        if config is not None:
            mask.validate(config)
        shared: dict = {}
        # the mask's dense layers, and any sliding layer of the model (validate() checked it keeps every channel)
        dense = set(mask.dense_layers) | (set(dense_layers_of(config)) if config is not None else set())
        layers = [
            model_cache_layer(config, i)
            if i in dense
            else LeanKLayer(mask.keep[i], mask.sink_size, mask.recent_size, mask.accumu_size, config, shared)
            for i in range(mask.num_layers)
        ]
        super().__init__(layers=layers)
        self.mask = mask

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The base update, then the layer offered to the attention function (see :mod:`~leank_infer.layer_handoff`)."""
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        layer_handoff.offer(keys, layer if isinstance(layer, LeanKLayer) else None)
        return keys, values

    def nbytes(self) -> int:
        """Bytes of K/V the cache really holds, all layers (distinct tensor storages)."""
        return sum(
            layer.nbytes() if isinstance(layer, LeanKLayer) else _dense_layer_bytes(layer) for layer in self.layers
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


def dynamic_cache_bytes(cache: Cache) -> int:
    """Bytes of K/V a plain transformers cache (DynamicCache and friends) holds, for dense comparisons."""
    return storage_bytes(
        t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
    )
