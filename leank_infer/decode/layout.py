"""The decode core's data: one layer's compressed K/V (:class:`DecodeLayout`) and a step's masks.

A :class:`~leank_infer.decode.cache.LeanKLayer` owns the storage and hands a ``DecodeLayout`` of views to
the attention; every backend (:mod:`leank_infer.decode.torch_decode`, :mod:`leank_infer.decode.triton_decode`)
takes ``(query, layout, masks, scaling, softcap)`` and returns ``[B, Q, Hq, D]``. Tokens, in padded
coordinates ``[0, length)``:

- head ``[0, head_len)``: all channels; the sink of every row (with left padding, a row's later
  head keys are middle keys *for that row*: scored with the kept channels),
- middle ``[head_len, head_len + mid_len)``: per group of KV heads with equal kept count, one K
  tensor of the kept channels ``[B, Hg, n, c]``; V ``[B, Hnz, n, D]`` only for heads keeping any,
- tail ``[head_len + mid_len, length)``: all channels, the recent tokens (under the positional rule
  with left padding, a row's oldest tail keys may already be middle keys *for that row*: scored with the
  kept channels, as in the head).

Head and tail are stored one after the other (``full_k``/``full_v``: ``[B, Hkv, head_len +
tail_len, D]``), so a step with nothing to mask attends to them in one call.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from .kv_quant import KVQuant, dequantize, unpack
from .rule import key_regions, row_recent_from


class Phase(enum.Enum):
    """Where a :class:`~leank_infer.decode.cache.LeanKLayer`'s sequence is: what its next attention computes, and what it stores."""

    EMPTY = "empty"  # nothing stored yet
    PREFILLING = "prefilling"  # the forward that filled the layer: it attends to that forward's K/V as given
    # (dense under "dense-prompt", the positional prefill under "positional"); the store is compressed
    DENSE_UNTIL = "dense until"  # shorter than ``dense_until``: every token's full K/V, the model's dense attention
    COMPRESSED = "compressed"  # the middle keeps the kept channels only; the attention reads ``layout()``


@dataclass(frozen=True)
class ChannelGroups:
    """How one layer's KV heads are grouped by kept-channel count, so that each group is one dense tensor.

    A group is a run of consecutive KV heads with the same nonzero kept count: ``heads[g]`` (all
    keep ``counts[g]`` channels), ``channels[g]`` their kept channel indices ``[Hg, counts[g]]``.
    Zero-channel heads belong to no group. Middle V is stored for the heads of ``nonzero_order``
    (the nonzero heads in KV-head order), so group g's V is the slice ``[v_offsets[g], v_offsets[g]
    + len(heads[g]))`` and every run of consecutive nonzero heads is one slice too: no gather over
    the cache at decode, and scores stay in KV-head order.
    """

    keep: torch.Tensor  # [Hkv, D] bool
    heads: tuple[torch.Tensor, ...]
    channels: tuple[torch.Tensor, ...]
    counts: tuple[int, ...]
    v_offsets: tuple[int, ...]
    nonzero_order: torch.Tensor  # [Hnz] long
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_keep(cls, keep: torch.Tensor) -> ChannelGroups:
        """Group the KV heads of one layer (``keep``: ``[Hkv, D]`` bool) into runs of equal nonzero kept count."""
        keep = keep.bool()
        counts = keep.sum(-1).tolist()
        heads, channels, sizes, offsets = [], [], [], []
        h = offset = 0
        while h < len(counts):
            c, end = counts[h], h + 1
            while end < len(counts) and counts[end] == c:
                end += 1
            if c:
                idx = torch.arange(h, end)
                heads.append(idx)
                # kept channel indices of each head, ascending
                channels.append(torch.stack([torch.nonzero(keep[x]).flatten() for x in range(h, end)]))
                sizes.append(int(c))
                offsets.append(offset)
                offset += end - h
            h = end
        order = torch.cat(heads) if heads else torch.zeros(0, dtype=torch.long)
        return cls(keep, tuple(heads), tuple(channels), tuple(sizes), tuple(offsets), order)

    def score_plan(self, groups_per_kv: int) -> tuple[tuple[int, int, int, int], ...]:
        """The middle's score blocks in KV-head order, ``(group or -1 for zero heads, heads, count,
        offset into the gathered query)`` (memoised: the decode fast path walks it every step)."""
        key = ("plan", groups_per_kv)
        if key not in self._memo:
            plan, off, firsts = [], 0, [int(h[0]) for h in self.heads]
            for first, end, v_off in self.runs():
                if v_off is None:
                    plan.append((-1, end - first, 0, 0))
                    continue
                for gi, f in enumerate(firsts):
                    if first <= f < end:
                        hg, c = len(self.heads[gi]), self.counts[gi]
                        plan.append((gi, hg, c, off))
                        off += hg * groups_per_kv * c
            self._memo[key] = tuple(plan)
        return self._memo[key]

    def runs(self) -> tuple[tuple[int, int, int | None], ...]:
        """KV heads in order as runs ``(first, end, v_offset)``: ``v_offset`` is where a run of nonzero
        heads starts in middle V, None for a run of zero-channel heads (memoised)."""
        if "runs" not in self._memo:
            nonzero = self.keep.any(-1).tolist()
            out, h, v = [], 0, 0
            while h < len(nonzero):
                end = h + 1
                while end < len(nonzero) and nonzero[end] == nonzero[h]:
                    end += 1
                out.append((h, end, v if nonzero[h] else None))
                v += (end - h) if nonzero[h] else 0
                h = end
            self._memo["runs"] = tuple(out)
        return self._memo["runs"]

    def v_rows(self) -> torch.Tensor:
        """``[Hkv]`` int64: each KV head's index into middle V (``nonzero_order``), -1 for a head keeping no
        channel (memoised: the CPU kernel of a quantised middle takes it every step)."""
        if "v_rows" not in self._memo:
            rows = torch.full((self.num_kv_heads,), -1, dtype=torch.long)
            rows[self.nonzero_order.cpu()] = torch.arange(len(self.nonzero_order))
            self._memo["v_rows"] = rows
        return self._memo["v_rows"]

    @property
    def num_kv_heads(self) -> int:
        return self.keep.shape[0]

    @property
    def nonzero(self) -> torch.Tensor:
        """``[Hkv]`` bool: heads that keep at least one channel (the others skip their middle keys)."""
        return self.keep.any(-1)

    def query_index(self, groups_per_kv: int, head_dim: int) -> torch.Tensor:
        """Flat indices into a query ``[B, Hkv * G * D]`` of every group's kept channels, ordered
        (group, head, G, channel): one ``index_select`` gives each group's ``[B, Hg, G, c]`` query
        as a contiguous slice (memoised: it is the same every step)."""
        key = ("query_index", groups_per_kv, head_dim)
        if key not in self._memo:
            parts = []
            for heads, channels in zip(self.heads, self.channels, strict=True):
                q_heads = heads.view(-1, 1, 1) * groups_per_kv + torch.arange(groups_per_kv, device=heads.device).view(1, -1, 1)
                parts.append((q_heads * head_dim + channels.unsqueeze(1)).flatten())
            empty = torch.zeros(0, dtype=torch.long, device=self.keep.device)
            self._memo[key] = torch.cat(parts) if parts else empty
        return self._memo[key]

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


@dataclass(frozen=True)
class DecodeMasks:
    """Per-region attendable keys of a step (bool; None = every key of the region, for every query).

    ``head_full`` / ``head_mid``: ``[B, Q, H]``, head keys scored with all / only the kept channels
    (disjoint); ``mid``: ``[B or 1, Q, n]``; ``tail`` / ``tail_mid``: ``[B or 1, Q, t]``, tail keys scored
    with all / only the kept channels (disjoint; ``tail_mid`` None: no tail key is a middle key, as always
    for one query of an unpadded row).
    """

    head_full: torch.Tensor | None = None
    head_mid: torch.Tensor | None = None
    mid: torch.Tensor | None = None
    tail: torch.Tensor | None = None
    tail_mid: torch.Tensor | None = None

    @property
    def trivial(self) -> bool:
        """Nothing to mask: all keys are attended, and head and tail keys with all channels."""
        return (self.head_full is None and self.head_mid is None and self.mid is None and self.tail is None
                and self.tail_mid is None)


@dataclass(frozen=True)
class QuantizedMiddle:
    """The parameters of a quantised middle (:mod:`leank_infer.decode.kv_quant`); the codes are the layout's
    ``mid_k`` / ``mid_v``. Middle token ``j``'s K parameters are group ``(phase + j) // fmt.k_group``."""

    fmt: KVQuant
    phase: int
    v_group: int
    k_scale: tuple[torch.Tensor, ...]  # per head group [B, Hg, c, groups] float16
    k_min: tuple[torch.Tensor, ...]
    v_scale: torch.Tensor  # [B, Hnz, n, Dv // v_group] float16
    v_min: torch.Tensor

    def k_of(self, gi: int, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Head group ``gi``'s middle K ``[B, Hg, n, c]`` (a channel-major view) in ``dtype``."""
        scale, mn = self.k_scale[gi], self.k_min[gi]
        c, groups, g = scale.shape[2], scale.shape[3], self.fmt.k_group
        n = codes.shape[2]
        # codes of whole groups, from the first group's first slot (phase slots before token 0)
        cm = codes.transpose(2, 3)  # [B, Hg, cp, n] view of channel-major storage
        whole = groups * g
        cm = cm.as_strided((*cm.shape[:3], whole), cm.stride(), cm.storage_offset() - self.phase * cm.stride(3))
        k = dequantize(unpack(cm, 2, self.fmt.per_byte, c), scale, mn, g, dtype)  # [B, Hg, c, whole]
        return k.narrow(3, self.phase, n).transpose(2, 3)

    def v_of(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The middle V ``[B, Hnz, n, Dv]`` in ``dtype``."""
        dv = self.v_scale.shape[-1] * self.v_group
        return dequantize(unpack(codes, 3, self.fmt.per_byte, dv), self.v_scale, self.v_min, self.v_group, dtype)


@dataclass(slots=True)
class DecodeLayout:
    """One layer's compressed K/V as views (see the module docstring); built by the cache, read by backends."""

    full_k: torch.Tensor  # [B, Hkv, head_len + tail_len, D]: head then tail
    full_v: torch.Tensor
    head_len: int
    mid_k: tuple[torch.Tensor, ...]  # per group of ``groups``: [B, Hg, n, c_g] (the cache's: channel-major storage)
    mid_v: torch.Tensor  # [B, Hnz, n, Dv]
    groups: ChannelGroups
    starts: torch.Tensor  # [B] first real token of each row (left padding)
    sink_size: int
    recent_from: int  # first full recent key: keys in [start + sink, recent_from) are middle keys
    length: int  # tokens in padded coordinates, the new ones included
    padded: bool  # some row starts after 0 (left padding): the head holds padding or that row's middle keys
    # (recent_size, accumu_size) under the positional rule: each query's own recent part
    # (rule.row_recent_from), ``recent_from`` only where the middle ends; None: ``recent_from`` for every query
    positional: tuple[int, int] | None = None
    # a quantised middle (kv_quant): ``mid_k`` / ``mid_v`` hold uint8 codes, these their parameters
    quant: QuantizedMiddle | None = None

    def dequantized(self, dtype: torch.dtype | None = None) -> DecodeLayout:
        """This layout with a full-precision middle (``dtype``: default the full part's): what a backend that
        reads codes must compute as if over (the reference of the kv_quant tests and the PyTorch path)."""
        q = self.quant
        if q is None:
            return self
        dtype = dtype or self.full_k.dtype
        mid_k = tuple(q.k_of(i, k, dtype) for i, k in enumerate(self.mid_k))
        return replace(self, mid_k=mid_k, mid_v=q.v_of(self.mid_v, dtype), quant=None)

    def float(self) -> DecodeLayout:
        """The same layout with K/V in fp32 (the reference precision kernels are checked against)."""
        if self.quant is not None:
            return self.dequantized(torch.float32).float()
        return replace(
            self, full_k=self.full_k.float(), full_v=self.full_v.float(),
            mid_k=tuple(k.float() for k in self.mid_k), mid_v=self.mid_v.float(),
        )  # fmt: skip

    @classmethod
    def from_parts(
        cls,
        head_k: torch.Tensor,
        head_v: torch.Tensor,
        tail_k: torch.Tensor,
        tail_v: torch.Tensor,
        mid_k: Sequence[torch.Tensor],
        mid_v: torch.Tensor,
        groups: ChannelGroups,
        starts: torch.Tensor | None = None,
        sink_size: int = 0,
    ) -> DecodeLayout:
        """A layout from separate head / middle / tail tensors (tests, benchmarks); recent = the tail."""
        b = head_k.shape[0]
        head, n, t = head_k.shape[2], (mid_k[0].shape[2] if len(mid_k) else mid_v.shape[2]), tail_k.shape[2]
        starts = torch.zeros(b, dtype=torch.long, device=head_k.device) if starts is None else starts
        join = lambda a, b: b if a.shape[2] == 0 else a if b.shape[2] == 0 else torch.cat([a, b], 2)  # noqa: E731
        return cls(
            join(head_k, tail_k),
            join(head_v, tail_v),
            head,
            tuple(mid_k),
            mid_v,
            groups,
            starts.to(head_k.device).long(),
            sink_size,
            head + n,
            head + n + t,
            bool(starts.any()),
        )

    @property
    def mid_len(self) -> int:
        return self.mid_v.shape[2]

    @property
    def tail_len(self) -> int:
        return self.full_k.shape[2] - self.head_len

    @property
    def head_k(self) -> torch.Tensor:
        return self.full_k[:, :, : self.head_len]

    @property
    def head_v(self) -> torch.Tensor:
        return self.full_v[:, :, : self.head_len]

    @property
    def tail_k(self) -> torch.Tensor:
        return self.full_k[:, :, self.head_len :]

    @property
    def tail_v(self) -> torch.Tensor:
        return self.full_v[:, :, self.head_len :]


def allowed_from_mask(
    attention_mask: torch.Tensor | None, total: int, q_len: int, device: torch.device
) -> torch.Tensor | None:
    """``[B or 1, Q, T]`` bool of keys the model's mask allows (4D bool/float, 2D padding, or None = causal)."""
    if attention_mask is None:
        if q_len == 1:
            return None
        j = torch.arange(total, device=device)
        qpos = torch.arange(total - q_len, total, device=device)
        return j.view(1, 1, -1) <= qpos.view(1, -1, 1)
    m = attention_mask
    if m.ndim == 2:  # [B, T] padding mask: add causality
        pad = m[:, -total:].bool().unsqueeze(1)
        causal = allowed_from_mask(None, total, q_len, m.device)
        return pad if causal is None else pad & causal
    m = m[:, 0, -q_len:, :total] if m.shape[-1] >= total else m[:, 0, -q_len:]
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min
    return m


def decode_masks(layout: DecodeLayout, attention_mask: torch.Tensor | None, q_len: int) -> DecodeMasks:
    """The region masks of a step: the LeanK rule (:func:`~leank_infer.decode.rule.key_regions`) per row and
    query, and the model's own mask (padding, custom masks) on top.

    Trivial (all None, the backends' fast path) when one query per row sees every key with the
    layout's channels: no model mask, and no row starts after 0 (so the head holds only sinks).
    """
    if attention_mask is None and q_len == 1 and not layout.padded:
        return DecodeMasks()
    starts = layout.starts
    device = starts.device
    h, n, total = layout.head_len, layout.mid_len, layout.length
    j = torch.arange(total, device=device).view(1, 1, -1)
    p = torch.arange(total - q_len, total, device=device).view(1, -1, 1)
    rf: torch.Tensor | int = layout.recent_from
    if layout.positional is not None:  # each row and query its own recent part
        rf = row_recent_from(p, starts.view(-1, 1, 1), *layout.positional)
    visible, middle = key_regions(j, p, starts.view(-1, 1, 1), layout.sink_size, rf)
    base = allowed_from_mask(attention_mask, total, q_len, device)
    if base is not None:
        visible = visible & base
    tail, tail_mid = visible[..., h + n :], None
    if layout.positional is not None:
        # rows (left padding) and later queries of a chunk pass rf at different keys: the tail can hold keys
        # that are middle keys for some of them (the cache moves a key only once it is middle for every row)
        tail_mid = tail & middle[..., h + n :]
        tail = tail & ~middle[..., h + n :]
        tail_mid = tail_mid if bool(tail_mid.any()) else None
    return DecodeMasks(
        head_full=visible[..., :h] & ~middle[..., :h],
        head_mid=visible[..., :h] & middle[..., :h],
        mid=visible[..., h : h + n],  # the cache moves a key to the middle only once it is middle for every row
        tail=tail,
        tail_mid=tail_mid,
    )


def row_starts(attention_mask: torch.Tensor | None, batch_size: int, device: torch.device) -> torch.Tensor:
    """Index of each row's first attended key at prefill (left padding), from the model's mask; zeros if None."""
    if attention_mask is None:
        return torch.zeros(batch_size, dtype=torch.long, device=device)
    m = attention_mask if attention_mask.ndim == 2 else attention_mask[:, 0, -1, :]
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min if m.is_floating_point() else m.bool()
    starts = m.int().argmax(-1).long()
    return starts.expand(batch_size).contiguous() if starts.numel() == 1 else starts
