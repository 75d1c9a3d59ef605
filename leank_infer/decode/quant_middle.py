"""One layer's quantised middle (:mod:`leank_infer.decode.kv_quant`): codes, scales and minima, appended in place.

Storage, per group of KV heads with ``c`` kept channels (:class:`~leank_infer.decode.layout.ChannelGroups`):

- K codes ``[B, Hg, ceil(c / per_byte), cap]`` uint8, channel-major (tokens run along memory, as the
  full-precision middle), int4 packed two channels to a byte; K scales and minima ``[B, Hg, c, cap / k_group]``;
- V codes ``[B, Hnz, cap, ceil(Dv / per_byte)]``, V scales and minima ``[B, Hnz, cap, Dv / v_group]``.

K slot ``s`` holds middle token ``s - phase`` and belongs to K group ``s // k_group``. ``phase`` is set by
the first write so that it ends on a group boundary: without left padding every later write is
``accumu_size`` tokens (a multiple of the group when the group divides it), so no group is ever
half-filled. When one is (a group larger than ``accumu_size``, or left-padded rows, whose writes are
irregular), the **open group**'s tokens are also kept in full precision (``open_k``, at
most ``k_group - 1`` tokens of kept channels, counted in :meth:`nbytes`) and the group is quantised anew
from them when it grows: every code is always the quantisation of the original value, never of an
earlier dequantisation. V is quantised per token and never needs that.

:meth:`check` is the cache's guard on its own scales: a NaN, inf, zero or negative scale, a non-finite
minimum, or a tensor of the wrong shape or dtype is an error naming it, never decoded as garbage.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .kv_quant import PARAM_DTYPE, KVQuant, pack, quant_params, quantize
from .layout import ChannelGroups, QuantizedMiddle


class CorruptQuantError(RuntimeError):
    """A quantised middle's scales or codes are not what the cache wrote: it refuses to decode them."""


def _capacity(n: int, align: int) -> int:
    return -(-n // align) * align


class QuantMiddleStore:
    """The quantised middle of one LeanK layer (see the module docstring)."""

    def __init__(self, fmt: KVQuant, groups: ChannelGroups, batch: int, v_dim: int, dtype: torch.dtype,
                 device: torch.device, align: int):
        self.fmt, self.groups = fmt, groups
        self.v_group = fmt.v_group_for(v_dim)
        self.v_dim, self.dtype, self.device = v_dim, dtype, device
        self.align = max(align, fmt.k_group)  # capacity: a multiple of both (powers of two)
        self.batch = batch
        self.n = 0
        self.phase = 0
        self.k_codes: list[torch.Tensor] = []
        self.open_k: list[torch.Tensor] = []  # per group [B, Hg, c, k_group]: the open group's kept K
        self._alloc(0)

    # ---- storage ---------------------------------------------------------------------------------
    @property
    def cap(self) -> int:
        return self.v_codes.shape[2]

    @property
    def k_scale(self) -> list[torch.Tensor]:
        """K scales per head group, ``[B, Hg, c, cap / k_group]`` views of :attr:`k_params`."""
        return self._k_views(0)

    @property
    def k_min(self) -> list[torch.Tensor]:
        return self._k_views(1)

    @property
    def v_scale(self) -> torch.Tensor:
        """V scales ``[B, Hnz, cap, Dv / v_group]``, a view of :attr:`v_params`."""
        return self.v_params.select(3, 0)

    @property
    def v_min(self) -> torch.Tensor:
        return self.v_params.select(3, 1)

    def _k_sizes(self, cap: int) -> list[tuple[int, int, int]]:
        """(offset, heads, kept count) of each head group's K parameters in a row of :attr:`k_params`."""
        out, off = [], 0
        for h, c in zip(self.groups.heads, self.groups.counts, strict=True):
            out.append((off, len(h), c))
            off += len(h) * c * (cap // self.fmt.k_group)
        return out

    def _k_views(self, which: int) -> list[torch.Tensor]:
        kg, b = self.cap // self.fmt.k_group, self.k_params.shape[0]
        row = self.k_params.select(1, which)
        return [row.narrow(1, off, hg * c * kg).view(b, hg, c, kg) for off, hg, c in self._k_sizes(self.cap)]

    def _alloc(self, cap: int) -> None:
        """Storage for ``cap`` slots (the used ones copied). Every K scale and minimum of the layer is one buffer
        ``k_params`` ``[B, 2, ...]``, every V one ``v_params`` ``[B, Hnz, cap, 2, Dv / v_group]``: one reduction
        each checks them all (:meth:`check`). Unused parameters hold scale 1 and minimum 0, valid values."""
        b, g, fmt, dev = self.batch, self.groups, self.fmt, self.device
        kg = cap // fmt.k_group
        # zeros: slots past the last token are read (masked) by vectorised kernel loads
        codes = [torch.zeros(b, len(h), fmt.packed(c), cap, dtype=torch.uint8, device=dev)
                 for h, c in zip(g.heads, g.counts, strict=True)]
        total = sum(len(h) * c * kg for h, c in zip(g.heads, g.counts, strict=True))
        k_params = torch.zeros(b, 2, total, dtype=PARAM_DTYPE, device=dev)
        k_params[:, 0] = 1
        hnz = len(g.nonzero_order)
        v_codes = torch.zeros(b, hnz, cap, fmt.packed(self.v_dim), dtype=torch.uint8, device=dev)
        v_params = torch.zeros(b, hnz, cap, 2, self.v_dim // self.v_group, dtype=PARAM_DTYPE, device=dev)
        v_params[:, :, :, 0] = 1
        if hasattr(self, "v_codes"):
            used = self.phase + self.n if self.n else 0
            groups_used = -(-used // fmt.k_group)
            old_k = (self.k_scale, self.k_min)
            for codes_new, codes_old in zip(codes, self.k_codes, strict=True):
                codes_new[..., :used] = codes_old[..., :used]
            new_kg = cap // fmt.k_group
            for which in (0, 1):
                row = k_params.select(1, which)
                for (off, hg, c), o in zip(self._k_sizes(cap), old_k[which], strict=True):
                    row.narrow(1, off, hg * c * new_kg).view(b, hg, c, new_kg)[..., :groups_used] = o[..., :groups_used]
            v_codes[:, :, : self.n] = self.v_codes[:, :, : self.n]
            v_params[:, :, : self.n] = self.v_params[:, :, : self.n]
        self.k_codes, self.k_params, self.v_codes, self.v_params = codes, k_params, v_codes, v_params
        if not self.open_k:
            self.open_k = [torch.zeros(b, len(h), c, fmt.k_group, dtype=self.dtype, device=dev)
                           for h, c in zip(g.heads, g.counts, strict=True)]

    def _reserve(self, tokens: int, chunk: int) -> None:
        """Room for ``tokens`` middle tokens (K slots from ``phase``); grows by at least ``chunk``."""
        need = self.phase + tokens
        if need <= self.cap:
            return
        cap = self.cap
        self._alloc(_capacity(max(need, cap + chunk) if cap else need, self.align))

    # ---- writing ---------------------------------------------------------------------------------
    def write(self, kept_k: list[torch.Tensor], v: torch.Tensor, chunk: int) -> None:
        """Append ``m`` tokens: per head group the kept K ``[B, Hg, m, c]``, and V ``[B, Hnz, m, Dv]``."""
        m = v.shape[2]
        if m == 0:
            return
        fmt, kgrp = self.fmt, self.fmt.k_group
        if self.n == 0:
            self.phase = (-m) % kgrp  # the first write ends on a group boundary
        self._reserve(self.n + m, chunk)
        # V: per token, groups along the channels
        scale, mn = quant_params(v, self.v_group, fmt.levels)
        codes = quantize(v, scale, mn, self.v_group, fmt.levels)
        end = self.n + m
        self.v_codes[:, :, self.n : end] = pack(codes, -1, fmt.per_byte)
        self.v_params[:, :, self.n : end, 0] = scale
        self.v_params[:, :, self.n : end, 1] = mn
        # K: per kept channel, groups along the tokens; the open group is quantised again with the new tokens
        s0 = self.phase + self.n
        g0 = s0 // kgrp
        first = g0 * kgrp  # first slot of the group s0 falls in
        held = s0 - first  # tokens of that group already stored (kept in full precision in open_k)
        s1 = s0 + m
        g1 = -(-s1 // kgrp)
        k_scale, k_min = self.k_scale, self.k_min
        for i, k in enumerate(kept_k):
            cm = k.transpose(2, 3).to(self.dtype)  # [B, Hg, c, m]
            if held:
                cm = torch.cat([self.open_k[i][..., :held], cm], -1)
            span = cm.shape[-1]
            pad = g1 * kgrp - first - span
            padded = torch.cat([cm, cm[..., -1:].expand(*cm.shape[:-1], pad)], -1) if pad else cm
            scale, mn = quant_params(padded, kgrp, fmt.levels)
            codes = quantize(padded, scale, mn, kgrp, fmt.levels)[..., :span]
            self.k_codes[i][..., first:s1] = pack(codes, -2, fmt.per_byte)
            k_scale[i][..., g0:g1] = scale
            k_min[i][..., g0:g1] = mn
            tail = s1 % kgrp
            if tail:
                self.open_k[i][..., :tail] = cm[..., span - tail :]
        self.n = end

    # ---- views -----------------------------------------------------------------------------------
    def view(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, QuantizedMiddle]:
        """What the decode backends read: (K codes per head group ``[B, Hg, n, ceil(c / per_byte)]``, channel-major
        views; V codes ``[B, Hnz, n, ceil(Dv / per_byte)]``; the parameters of every group the tokens span)."""
        n, fmt = self.n, self.fmt
        kg = self.k_groups()
        params = QuantizedMiddle(
            fmt,
            self.phase,
            self.v_group,
            tuple(t.narrow(3, 0, kg) for t in self.k_scale),
            tuple(t.narrow(3, 0, kg) for t in self.k_min),
            self.v_scale.narrow(2, 0, n),
            self.v_min.narrow(2, 0, n),
        )
        k = tuple(c.narrow(3, self.phase, n).transpose(2, 3) for c in self.k_codes)
        return k, self.v_codes.narrow(2, 0, n), params

    def open_tokens(self) -> int:
        """Tokens of the open (half-filled) K group, held in full precision too."""
        return (self.phase + self.n) % self.fmt.k_group if self.n else 0

    def k_groups(self) -> int:
        """K groups the ``n`` tokens span (each holds a scale and a minimum per kept channel)."""
        return -(-(self.phase + self.n) // self.fmt.k_group) if self.n else 0

    def tensors(self) -> list[torch.Tensor]:
        return [*self.k_codes, self.k_params, *self.open_k, self.v_codes, self.v_params]

    def map_batch(self, fn: Any) -> None:
        """``fn`` (a map over the batch axis) applied to every tensor (beam reorder, repeat, select)."""
        self.k_codes = [fn(t) for t in self.k_codes]
        self.open_k = [fn(t) for t in self.open_k]
        self.k_params, self.v_codes, self.v_params = fn(self.k_params), fn(self.v_codes), fn(self.v_params)
        self.batch = self.v_codes.shape[0]

    # ---- the cache's own checks ------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`CorruptQuantError` unless every scale is finite and > 0, every minimum finite, and
        every tensor has the shape and dtype this store gave it (what a decode must be able to trust).

        The values cost one host sync and four min-max reductions, whatever the number of head groups (the
        parameters not yet used hold scale 1 and minimum 0, and are checked too): a scale's minimum must be > 0
        and its maximum finite, a NaN anywhere makes both NaN. (A sum of logs did the same at 3-4x the cost:
        2.1 ms of a 30-layer step at 8k tokens, as much as the CPU kernel's K scores.)"""
        b, cap, fmt = self.batch, self.cap, self.fmt
        kg = cap // fmt.k_group
        total = sum(len(h) * c * kg for h, c in zip(self.groups.heads, self.groups.counts, strict=True))
        hnz, vg = len(self.groups.nonzero_order), self.v_dim // self.v_group
        expect: list[tuple[str, Any, tuple[int, ...], torch.dtype]] = [
            ("K parameters", self.k_params, (b, 2, total), PARAM_DTYPE),
            ("V codes", self.v_codes, (b, hnz, cap, fmt.packed(self.v_dim)), torch.uint8),
            ("V parameters", self.v_params, (b, hnz, cap, 2, vg), PARAM_DTYPE),
        ]
        for i, (h, c) in enumerate(zip(self.groups.heads, self.groups.counts, strict=True)):
            codes = self.k_codes[i] if i < len(self.k_codes) else None
            expect.append((f"K codes of head group {i}", codes, (b, len(h), fmt.packed(c), cap), torch.uint8))
        if len(self.k_codes) != len(self.groups.counts):
            raise CorruptQuantError(f"kv_quant cache: {len(self.k_codes)} K code tensors for "
                                    f"{len(self.groups.counts)} head groups")
        for name, t, shape, dtype in expect:
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                raise CorruptQuantError(f"kv_quant cache: {name} should be {shape} {dtype}, found {got}")
        what = ["a K scale is NaN, inf, zero or negative", "a K minimum is NaN or inf",
                "a V scale is NaN, inf, zero or negative", "a V minimum is NaN or inf"]
        parts = [self.k_params.select(1, 0), self.k_params.select(1, 1), self.v_params.select(3, 0),
                 self.v_params.select(3, 1)]
        kept = [i for i, t in enumerate(parts) if t.numel()]
        if not kept:
            return
        # NaN propagates to both; a scale must be > 0 (its minimum) and finite (its maximum), a minimum finite
        stats = [torch.aminmax(parts[i]) for i in kept]
        bounds = torch.stack([x for st in stats for x in (st.min, st.max)]).float().tolist()
        for j, i in enumerate(kept):
            lo, hi = bounds[2 * j], bounds[2 * j + 1]
            if not (math.isfinite(lo) and math.isfinite(hi)) or (i % 2 == 0 and not lo > 0):
                raise CorruptQuantError(f"kv_quant cache: {what[i]}; the cache will not decode it")
