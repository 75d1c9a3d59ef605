"""One layer's quantised middle (:mod:`leank_infer.decode.kv_quant`): codes, scales and minima, appended in place.

Storage, per group of KV heads with ``c`` kept channels (:class:`~leank_infer.decode.layout.ChannelGroups`):

- K codes ``[B, Hg, ceil(c / per_byte), cap]`` uint8, channel-major (tokens run along memory, as the
  full-precision middle), int4 packed two channels to a byte; K scales and minima ``[B, Hg, c, cap / k_group]``;
- V codes ``[B, Hnz, cap, ceil(Dv / per_byte)]``, V scales and minima ``[B, Hnz, cap, Dv / v_group]``.

K slot ``s`` holds middle token ``s - phase`` and belongs to K group ``s // k_group``. ``phase`` is set by
the first write so that it ends on a group boundary: under the dense-prefill rule every later write is
``accumu_size`` tokens (a multiple of the group when the group divides it), so no group is ever
half-filled. When one is (a group larger than ``accumu_size``, or the positional rule with left padding,
whose writes are irregular), the **open group**'s tokens are also kept in full precision (``open_k``, at
most ``k_group - 1`` tokens of kept channels, counted in :meth:`nbytes`) and the group is quantised anew
from them when it grows: every code is always the quantisation of the original value, never of an
earlier dequantisation. V is quantised per token and never needs that.

:meth:`check` is the cache's guard on its own scales: a NaN, inf, zero or negative scale, a non-finite
minimum, or a tensor of the wrong shape or dtype is an error naming it, never decoded as garbage.
"""

from __future__ import annotations

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
        self.k_scale: list[torch.Tensor] = []
        self.k_min: list[torch.Tensor] = []
        self.open_k: list[torch.Tensor] = []  # per group [B, Hg, c, k_group]: the open group's kept K
        self._alloc(0)

    # ---- storage ---------------------------------------------------------------------------------
    @property
    def cap(self) -> int:
        return self.v_codes.shape[2]

    def _alloc(self, cap: int) -> None:
        b, g, fmt = self.batch, self.groups, self.fmt
        kg = cap // fmt.k_group
        new = torch.zeros  # zeros: slots past the last token are read (masked) by vectorised kernel loads

        def k(hg: int, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return (new(b, hg, fmt.packed(c), cap, dtype=torch.uint8, device=self.device),
                    torch.ones(b, hg, c, kg, dtype=PARAM_DTYPE, device=self.device),
                    new(b, hg, c, kg, dtype=PARAM_DTYPE, device=self.device))

        old = (self.k_codes, self.k_scale, self.k_min) if hasattr(self, "v_codes") else None
        parts = [k(len(h), c) for h, c in zip(g.heads, g.counts, strict=True)]
        hnz = len(g.nonzero_order)
        v = (new(b, hnz, cap, fmt.packed(self.v_dim), dtype=torch.uint8, device=self.device),
             torch.ones(b, hnz, cap, self.v_dim // self.v_group, dtype=PARAM_DTYPE, device=self.device),
             new(b, hnz, cap, self.v_dim // self.v_group, dtype=PARAM_DTYPE, device=self.device))
        if old is not None:
            used = self.phase + self.n if self.n else 0
            groups_used = -(-used // fmt.k_group)
            for (codes, scale, mn), oc, os_, om in zip(parts, *old, strict=True):
                codes[..., :used] = oc[..., :used]
                scale[..., :groups_used] = os_[..., :groups_used]
                mn[..., :groups_used] = om[..., :groups_used]
            for t, o in zip(v, (self.v_codes, self.v_scale, self.v_min), strict=True):
                t[:, :, : self.n] = o[:, :, : self.n]
        self.k_codes = [p[0] for p in parts]
        self.k_scale = [p[1] for p in parts]
        self.k_min = [p[2] for p in parts]
        self.v_codes, self.v_scale, self.v_min = v
        if not self.open_k:
            self.open_k = [torch.zeros(b, len(h), c, fmt.k_group, dtype=self.dtype, device=self.device)
                           for h, c in zip(g.heads, g.counts, strict=True)]

    def _reserve(self, tokens: int, chunk: int) -> None:
        """Room for ``tokens`` middle tokens (K slots from ``phase``); grows by at least ``chunk``."""
        need = max(self.phase + tokens, tokens)
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
        self.v_scale[:, :, self.n : end] = scale
        self.v_min[:, :, self.n : end] = mn
        # K: per kept channel, groups along the tokens; the open group is quantised again with the new tokens
        s0 = self.phase + self.n
        g0 = s0 // kgrp
        first = g0 * kgrp  # first slot of the group s0 falls in
        held = s0 - first  # tokens of that group already stored (kept in full precision in open_k)
        s1 = s0 + m
        g1 = -(-s1 // kgrp)
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
            self.k_scale[i][..., g0:g1] = scale
            self.k_min[i][..., g0:g1] = mn
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
            tuple(s.narrow(3, 0, kg) for s in self.k_scale),
            tuple(m.narrow(3, 0, kg) for m in self.k_min),
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
        return [*self.k_codes, *self.k_scale, *self.k_min, *self.open_k, self.v_codes, self.v_scale, self.v_min]

    def map_batch(self, fn: Any) -> None:
        """``fn`` (a map over the batch axis) applied to every tensor (beam reorder, repeat, select)."""
        self.k_codes = [fn(t) for t in self.k_codes]
        self.k_scale = [fn(t) for t in self.k_scale]
        self.k_min = [fn(t) for t in self.k_min]
        self.open_k = [fn(t) for t in self.open_k]
        self.v_codes, self.v_scale, self.v_min = fn(self.v_codes), fn(self.v_scale), fn(self.v_min)
        self.batch = self.v_codes.shape[0]

    # ---- the cache's own checks ------------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`CorruptQuantError` unless every scale is finite and > 0, every minimum finite, and
        every tensor has the shape and dtype this store gave it (what a decode must be able to trust)."""
        b, cap, fmt = self.batch, self.cap, self.fmt
        kg = cap // fmt.k_group
        used_k = self.k_groups()
        expect: list[tuple[str, torch.Tensor, tuple[int, ...], torch.dtype]] = []
        for i, (h, c) in enumerate(zip(self.groups.heads, self.groups.counts, strict=True)):
            hg = len(h)
            expect += [(f"K codes of head group {i}", self.k_codes[i], (b, hg, fmt.packed(c), cap), torch.uint8),
                       (f"K scales of head group {i}", self.k_scale[i], (b, hg, c, kg), PARAM_DTYPE),
                       (f"K minima of head group {i}", self.k_min[i], (b, hg, c, kg), PARAM_DTYPE)]
        hnz, vg = len(self.groups.nonzero_order), self.v_dim // self.v_group
        expect += [("V codes", self.v_codes, (b, hnz, cap, fmt.packed(self.v_dim)), torch.uint8),
                   ("V scales", self.v_scale, (b, hnz, cap, vg), PARAM_DTYPE),
                   ("V minima", self.v_min, (b, hnz, cap, vg), PARAM_DTYPE)]
        for name, t, shape, dtype in expect:
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                raise CorruptQuantError(f"kv_quant cache: {name} should be {shape} {dtype}, found {got}")
        # one host sync for all the values: every used scale finite and > 0, every used minimum finite
        scales = [t.narrow(3, 0, used_k) for t in self.k_scale] + [self.v_scale.narrow(2, 0, self.n)]
        minima = [t.narrow(3, 0, used_k) for t in self.k_min] + [self.v_min.narrow(2, 0, self.n)]
        flags = [(torch.isfinite(s) & (s > 0)).all() for s in scales] + [torch.isfinite(m).all() for m in minima]
        ok = torch.stack(flags).tolist() if flags else []
        bad = [i for i, x in enumerate(ok) if not x]
        if bad:
            what = "scale is NaN, inf, zero or negative" if bad[0] < len(scales) else "minimum is NaN or inf"
            part = bad[0] % len(scales)
            name = "V" if part == len(scales) - 1 else f"K (head group {part})"
            raise CorruptQuantError(f"kv_quant cache: a {name} {what}; the cache will not decode it")
