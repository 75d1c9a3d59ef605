"""Triton flash-decoding over the LeanK compressed cache: the kernels and their launcher.

One decode step (one new query token per row) is two launches:

1. ``_partials_kernel``, a 1-D grid: its first ``B * Hkv * S_full`` programs do the full-channel
   parts (head, then tail) of one (row, KV head, split); the other ``B * Hnz * S_mid`` programs the
   compressed middle of one (row, nonzero KV head, split), every group of the ``ChannelGroups``
   in the same launch (the group's K tensor, kept count and channel list are picked per program
   from tuple arguments; q is gathered on the kept channels once). Zero-channel heads have no
   middle programs. Each program writes an unnormalised partial (acc ``[G, D]``, running max m
   ``[G]``, sum of exps l ``[G]``, base-2 logits) to an fp32 workspace.
2. ``_merge_kernel``, grid ``(B * Hq,)``: log-sum-exp merge of the partials of one (row, query
   head), 32 splits at a time, and the final division; writes ``[B, 1, Hq, D]``.

GQA: the G query heads of a KV head live in one program as the rows of a ``[G, D] x [D, BLOCK_N]``
dot, so each K/V tile is loaded once for all of them. Scores accumulate in fp32 (fp16/bf16/fp32
inputs). Partial slots per KV head: ``[0, S_full)`` full parts, then ``[S_full, S_full + S_mid)``
middle, the latter read by the merge only for heads that keep channels (so nothing needs clearing).
The middle tile is ``BLOCK_C = next_pow2(max kept count)`` channels for every group, masked to
the group's count: loads fetch only kept bytes (16-byte vectors when counts are multiples of 16,
as align 16/32 gives), the dot does padded work, which a memory-bound decode can afford. Middle K
is indexed as ``[B, Hg, c, cap]`` (channel-major: the cache's preallocated storage) or ``[B, Hg, cap, c]``
storage; other strides are copied.

The launcher implements the decode contract of :mod:`leank_infer.decode.backend` over a
:class:`~leank_infer.decode.layout.DecodeLayout`; masks are its :class:`~leank_infer.decode.layout.DecodeMasks`
(None = all attended), read per key in the kernel through their
strides (1 byte per key per KV head, next to >= 2 * 16 bytes of K): any per-row pattern works
(left padding, row starts), no host sync is needed to turn them into offsets, and ``None`` skips
the load. Not supported (:func:`unsupported`; the dispatcher sends them to the PyTorch path): ``q_len > 1`` (prefill-like chunks, or
speculative verification), dtypes other than fp16/bf16/fp32, V head_dim != K head_dim, a
non-positive ``softcap``. Tail keys a row scores with the kept channels (``tail_mid``: the positional
rule with left padding) are scored like the head's middle keys: a second dot with q zeroed off the kept
channels, selected per key, and skipped by zero-channel heads (a constexpr branch: steps without them
compile without it). Attention logit soft-capping (Gemma 2's ``softcap``) is a constexpr branch
of the score step (:func:`_logits`): models without it compile the plain kernel.
"""

from __future__ import annotations  # kernel annotations stay strings ("tl.constexpr"): triton reads them so

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

from .layout import DecodeLayout, DecodeMasks

HAS_TRITON = importlib.util.find_spec("triton") is not None
triton: Any = None  # the triton modules, bound by _load_triton() at the first launch
tl: Any = None
_JIT_OPTIONS: dict[str, dict[str, Any]] = {}


def _jit(fn: Callable | None = None, **options: Any) -> Any:
    """``triton.jit``, applied at the first launch rather than at import.

    Importing this module (``leank_infer.decode.attention`` may, at its top) never imports triton: no cost on
    CPU-only runs, nothing to fail without triton, and ``TRITON_INTERPRET`` is read when the kernels
    are first needed, not when some earlier import happened to load this file.
    """

    def mark(f: Callable) -> Callable:
        _JIT_OPTIONS[f.__name__] = options
        return f

    return mark(fn) if fn is not None else mark


def _load_triton() -> None:
    """Import triton and replace every ``@_jit`` function of this module by its ``triton.jit`` form."""
    global triton, tl
    if tl is not None:
        return
    import triton as triton_mod
    import triton.language as tl_mod

    names = globals()
    for name, options in _JIT_OPTIONS.items():
        names[name] = triton_mod.jit(names[name], **options)
    triton, tl = triton_mod, tl_mod


BLOCK_N = 64  # keys per tile; every split covers a multiple of it
MIN_BLOCKS_PER_SPLIT = 4  # a split amortises its q load and partial write over at least 256 keys
WAVES = 4  # target programs per SM when choosing split counts (latency hiding at small batch)
MAX_SPLITS = 128  # per part; beyond this the merge reads more than the split saves
MERGE_BLOCK_S = 32  # partials merged per step
NUM_WARPS, NUM_STAGES = 4, 3  # launch options of the partial kernels (untuned: chosen without a GPU)
_LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
@_jit
def _online_update(acc, m_i, l_i, s, v, PREC: tl.constexpr):
    """One flash-attention step, base 2: fold scores ``s`` [BG, BN] (fp32, -inf = masked) and ``v`` [BN, BD]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: keep exps at 0, not NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, m_new, l_i


@_jit
def _logits(s, qk_scale, cap_log2, SOFTCAP: tl.constexpr):
    """Raw ``q.k`` dots -> base-2 logits: ``s * scale * log2e``, or with soft-capping (Gemma 2)
    ``cap * tanh(s * scale / cap) * log2e`` (then ``qk_scale`` is ``scale / cap``, ``cap_log2`` is
    ``cap * log2e``). tanh from exp2 of ``-2|x|``: no overflow at any logit, and the sign restored."""
    x = s * qk_scale
    if SOFTCAP:
        e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
        t = (1.0 - e) / (1.0 + e)
        x = tl.where(x < 0, -t, t) * cap_log2
    return x


@_jit
def _store_partial(
    ACC, M, L, acc, m_i, l_i, bh, slot, n_slots, offs_g, offs_d, G: tl.constexpr, D: tl.constexpr
):
    """Write one partial: (row, KV head) ``bh``, split ``slot`` of the ``[B, Hkv, G, S(, D)]`` workspace."""
    g_ok = offs_g < G
    rows = (bh * G + offs_g) * n_slots + slot  # [BG]
    tl.store(M + rows, m_i, mask=g_ok)
    tl.store(L + rows, l_i, mask=g_ok)
    tl.store(ACC + rows[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & (offs_d[None, :] < D))


@_jit
def _full_part(
    Q, HK, HV, TK, TV, KEEP, HFULL, HMID, TMASK, TMID, ACC, M, L, b, kvh, split,
    sq_b, sq_h, sq_d,
    shk_b, shk_h, shk_n, shk_d, shv_b, shv_h, shv_n, shv_d,
    stk_b, stk_h, stk_n, stk_d, stv_b, stv_h, stv_n, stv_d,
    skeep_h, skeep_d, shf_b, shf_n, shm_b, shm_n, stm_b, stm_n, stt_b, stt_n,
    head_len, head_pad, tail_len, split_len, n_kv_heads, n_slots, qk_scale, cap_log2,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_TAIL_MASK: tl.constexpr, HAS_TAIL_MID: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Partial attention of (row b, KV head kvh, split) over the virtual sequence [head | pad | tail].

    The head is padded to ``head_pad`` (a multiple of BLOCK_N) so tail tiles stay aligned. Head keys
    are scored with all channels (``head_full``) or only the kept ones (``head_mid``: that row's
    middle keys stored in the head, e.g. under left padding); zero-channel heads skip the latter.
    ``HAS_TAIL_MID``: likewise tail keys flagged in ``TMID`` (a row's keys already past its recent part,
    under the positional rule with left padding) are scored with the kept channels, or skipped by a zero head.
    """
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < D

    q_ptrs = Q + b * sq_b + (kvh * G + offs_g)[:, None] * sq_h + offs_d[None, :] * sq_d
    q = tl.load(q_ptrs, mask=(offs_g[:, None] < G) & d_ok[None, :], other=0.0)
    keep = tl.load(KEEP + kvh * skeep_h + offs_d * skeep_d, mask=d_ok, other=0) != 0
    q_kept = tl.where(keep[None, :], q, 0.0).to(q.dtype)
    nonzero = tl.max(keep.to(tl.int32), 0) > 0

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, head_pad + tail_len)

    for start in range(lo, tl.minimum(hi, head_pad), BLOCK_N):
        j = start + offs_n
        ok = j < head_len
        k = tl.load(
            HK + b * shk_b + kvh * shk_h + j[None, :] * shk_n + offs_d[:, None] * shk_d,
            mask=d_ok[:, None] & ok[None, :],
            other=0.0,
        )
        full = tl.load(HFULL + b * shf_b + j * shf_n, mask=ok, other=0) != 0
        mid = tl.load(HMID + b * shm_b + j * shm_n, mask=ok, other=0) != 0
        s_full = tl.dot(q, k, input_precision=PREC)
        s_mid = tl.dot(q_kept, k, input_precision=PREC)
        s = _logits(tl.where(mid[None, :], s_mid, s_full), qk_scale, cap_log2, SOFTCAP)
        s = tl.where((full | (mid & nonzero))[None, :], s, float("-inf"))
        v = tl.load(
            HV + b * shv_b + kvh * shv_h + j[:, None] * shv_n + offs_d[None, :] * shv_d,
            mask=ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v, PREC)

    for start in range(tl.maximum(lo, head_pad) - head_pad, hi - head_pad, BLOCK_N):
        j = start + offs_n
        in_range = j < tail_len
        k = tl.load(
            TK + b * stk_b + kvh * stk_h + j[None, :] * stk_n + offs_d[:, None] * stk_d,
            mask=d_ok[:, None] & in_range[None, :],
            other=0.0,
        )
        ok = in_range
        if HAS_TAIL_MASK:
            ok = ok & (tl.load(TMASK + b * stm_b + j * stm_n, mask=in_range, other=0) != 0)
        s = tl.dot(q, k, input_precision=PREC)
        if HAS_TAIL_MID:  # the head loop's rule: kept channels for this row's middle keys, none for a zero head
            tmid = tl.load(TMID + b * stt_b + j * stt_n, mask=in_range, other=0) != 0
            s = tl.where(tmid[None, :], tl.dot(q_kept, k, input_precision=PREC), s)
            ok = ok | (tmid & nonzero)
        s = _logits(s, qk_scale, cap_log2, SOFTCAP)
        s = tl.where(ok[None, :], s, float("-inf"))
        v = tl.load(
            TV + b * stv_b + kvh * stv_h + j[:, None] * stv_n + offs_d[None, :] * stv_d,
            mask=in_range[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v, PREC)

    _store_partial(ACC, M, L, acc, m_i, l_i, b * n_kv_heads + kvh, split, n_slots, offs_g, offs_d, G, D)


@_jit
def _mid_part(
    Q, MK, MCH, MV, NZ, MMASK, ACC, M, L, b, i, split,
    sq_b, sq_h, sq_d, smv_b, smv_h, smv_n, smv_d, smm_b, smm_n,
    STARTS, SIZES, COUNTS,
    MKS, MKM, VS, VM, svs_b, svs_h, svs_n, svs_d, ks_cap, phase,
    mid_len, mid_cap, split_len, n_kv_heads, n_slots, slot_offset, qk_scale, cap_log2,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_GROUPS: tl.constexpr, HAS_MID_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    PREC: tl.constexpr, MID_CM: tl.constexpr, QBITS: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr,
):  # fmt: skip
    """Partial attention of (row b, nonzero head i, split) over the compressed middle.

    Nonzero head i is KV head ``NZ[i]`` and V row i; it belongs to the last group g with
    ``STARTS[g] <= i``, whose K ``MK[g]`` (``[B, SIZES[g], mid_cap, COUNTS[g]]`` storage, the first
    ``mid_len`` keys used) holds channels ``MCH[g][i - STARTS[g]]`` only: q is gathered on them once,
    outside the loop. ``MID_CM``: the block of a (row, head) is channel-major ``[c, cap]`` (the cache's
    storage) instead of key-major ``[cap, c]``.

    ``QBITS`` 8 or 4: a quantised middle (kv_quant). ``MK[g]`` holds uint8 codes, channel-major, int4 two kept
    channels a byte (even index low nibble); key ``j``'s K is ``code * MKS[g][ch, (phase + j) // KG] +
    MKM[g][...]`` (float16 parameters ``[B, Hg, c, ks_cap]``); V codes ``MV`` (int4: two channels a byte) times
    ``VS[j, d // VG]`` plus ``VM[...]``. Dequantised in fp32, cast to the query's dtype for the dots.
    """
    k_base = MK[0]
    ch_base = MCH[0]
    first = STARTS[0]
    hg = SIZES[0]
    c = COUNTS[0]
    ks_base = MKS[0]
    km_base = MKM[0]
    for gi in tl.static_range(1, NUM_GROUPS):
        if i >= STARTS[gi]:
            k_base = MK[gi]
            ch_base = MCH[gi]
            first = STARTS[gi]
            hg = SIZES[gi]
            c = COUNTS[gi]
            ks_base = MKS[gi]
            km_base = MKM[gi]
    local = i - first
    kvh = tl.load(NZ + i)

    offs_g = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    c_ok = offs_c < c
    d_ok = offs_d < D
    ch = tl.load(ch_base + local * c + offs_c, mask=c_ok, other=0)
    q_ptrs = Q + b * sq_b + (kvh * G + offs_g)[:, None] * sq_h + ch[None, :] * sq_d
    q = tl.load(q_ptrs, mask=(offs_g[:, None] < G) & c_ok[None, :], other=0.0)
    if QBITS == 4:
        cp = (c + 1) // 2  # code bytes of a key: two kept channels a byte
    else:
        cp = c
    k_row = k_base + (b * hg + local) * mid_cap * cp  # [cap, c] block of this (row, head)
    ks_row = (b * hg + local) * c * ks_cap  # [c, ks_cap] parameters of this (row, head)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo = tl.multiple_of(split * split_len, BLOCK_N)  # split_len is a multiple of BLOCK_N
    hi = tl.minimum(lo + split_len, mid_len)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        in_range = j < mid_len
        if QBITS != 0:
            kq_ok = c_ok[:, None] & in_range[None, :]
            if QBITS == 4:
                byte = tl.load(k_row + j[None, :] + (offs_c // 2)[:, None] * mid_cap, mask=kq_ok, other=0)
                code = (byte >> ((offs_c % 2) * 4).to(tl.uint8)[:, None]) & 15
            else:
                code = tl.load(k_row + j[None, :] + offs_c[:, None] * mid_cap, mask=kq_ok, other=0)
            grp = (phase + j) // KG
            p_off = ks_row + offs_c[:, None] * ks_cap + grp[None, :]
            k_s = tl.load(ks_base + p_off, mask=kq_ok, other=0.0).to(tl.float32)
            k_m = tl.load(km_base + p_off, mask=kq_ok, other=0.0).to(tl.float32)
            k = (code.to(tl.float32) * k_s + k_m).to(q.dtype)
        elif MID_CM:
            # keys run along memory: bound the load by the capacity (slots past mid_len are allocated,
            # their scores are masked below), a multiple of 16 for the cache, so tiles move as full vectors
            k_ptrs = k_row + j[None, :] + offs_c[:, None] * mid_cap
            k = tl.load(k_ptrs, mask=c_ok[:, None] & (j < mid_cap)[None, :], other=0.0)
        else:
            k_ptrs = k_row + j[None, :] * c + offs_c[:, None]
            k = tl.load(k_ptrs, mask=c_ok[:, None] & in_range[None, :], other=0.0)
        ok = in_range
        if HAS_MID_MASK:
            ok = ok & (tl.load(MMASK + b * smm_b + j * smm_n, mask=in_range, other=0) != 0)
        s = _logits(tl.dot(q, k, input_precision=PREC), qk_scale, cap_log2, SOFTCAP)
        s = tl.where(ok[None, :], s, float("-inf"))
        if QBITS != 0:
            vq_ok = in_range[:, None] & d_ok[None, :]
            if QBITS == 4:
                byte = tl.load(MV + b * smv_b + i * smv_h + j[:, None] * smv_n + (offs_d // 2)[None, :] * smv_d,
                               mask=vq_ok, other=0)
                vcode = (byte >> ((offs_d % 2) * 4).to(tl.uint8)[None, :]) & 15
            else:
                vcode = tl.load(MV + b * smv_b + i * smv_h + j[:, None] * smv_n + offs_d[None, :] * smv_d,
                                mask=vq_ok, other=0)
            vp = b * svs_b + i * svs_h + j[:, None] * svs_n + (offs_d // VG)[None, :] * svs_d
            v_s = tl.load(VS + vp, mask=vq_ok, other=0.0).to(tl.float32)
            v_m = tl.load(VM + vp, mask=vq_ok, other=0.0).to(tl.float32)
            v = (vcode.to(tl.float32) * v_s + v_m).to(q.dtype)
        else:
            v = tl.load(
                MV + b * smv_b + i * smv_h + j[:, None] * smv_n + offs_d[None, :] * smv_d,
                mask=in_range[:, None] & d_ok[None, :],
                other=0.0,
            )
        acc, m_i, l_i = _online_update(acc, m_i, l_i, s, v, PREC)

    _store_partial(
        ACC, M, L, acc, m_i, l_i, b * n_kv_heads + kvh, slot_offset + split, n_slots, offs_g, offs_d, G, D
    )


# Lengths and counts change from step to step: not specialised on (divisibility by 16, == 1), so
# a generation does not recompile as they move; K/V strides and kept counts, which decide
# vectorised loads, are.
_VARYING = ["head_len", "head_pad", "tail_len", "full_split_len", "n_full_splits", "n_full_programs"]
_VARYING += ["mid_len", "mid_split_len", "n_mid_splits", "n_nonzero", "n_slots", "phase", "ks_cap"]
_VARYING += ["shf_b", "shm_b", "stm_b", "stt_b", "smm_b"]  # row strides of masks sliced from the model's growing mask


@_jit(do_not_specialize=_VARYING)
def _partials_kernel(
    Q, HK, HV, TK, TV, KEEP, HFULL, HMID, TMASK, TMID, MK, MCH, MV, NZ, MMASK, ACC, M, L,
    sq_b, sq_h, sq_d,
    shk_b, shk_h, shk_n, shk_d, shv_b, shv_h, shv_n, shv_d,
    stk_b, stk_h, stk_n, stk_d, stv_b, stv_h, stv_n, stv_d,
    skeep_h, skeep_d, shf_b, shf_n, shm_b, shm_n, stm_b, stm_n, stt_b, stt_n,
    smv_b, smv_h, smv_n, smv_d, smm_b, smm_n,
    STARTS, SIZES, COUNTS,
    MKS, MKM, VS, VM, svs_b, svs_h, svs_n, svs_d, ks_cap, phase,
    head_len, head_pad, tail_len, full_split_len, n_full_splits, n_full_programs,
    mid_len, mid_cap, mid_split_len, n_mid_splits, n_nonzero, n_kv_heads, n_slots, qk_scale, cap_log2,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_GROUPS: tl.constexpr,
    HAS_TAIL_MASK: tl.constexpr, HAS_TAIL_MID: tl.constexpr, HAS_MID_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    PREC: tl.constexpr, MID_CM: tl.constexpr, QBITS: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr,
):  # fmt: skip
    """All partials of a decode step in one launch: programs ``[0, n_full_programs)`` do the full parts
    of (row, KV head, split), the rest the middle of (row, nonzero head, split), every group included."""
    pid = tl.program_id(0)
    if pid < n_full_programs:
        split = pid % n_full_splits
        bh = (pid // n_full_splits).to(tl.int64)  # int64: row * stride passes 2**31 elements in big caches
        _full_part(
            Q, HK, HV, TK, TV, KEEP, HFULL, HMID, TMASK, TMID, ACC, M, L, bh // n_kv_heads, bh % n_kv_heads,
            split,
            sq_b, sq_h, sq_d,
            shk_b, shk_h, shk_n, shk_d, shv_b, shv_h, shv_n, shv_d,
            stk_b, stk_h, stk_n, stk_d, stv_b, stv_h, stv_n, stv_d,
            skeep_h, skeep_d, shf_b, shf_n, shm_b, shm_n, stm_b, stm_n, stt_b, stt_n,
            head_len, head_pad, tail_len, full_split_len, n_kv_heads, n_slots, qk_scale, cap_log2,
            G, D, BLOCK_G, BLOCK_D, BLOCK_N, HAS_TAIL_MASK, HAS_TAIL_MID, SOFTCAP, PREC,
        )  # fmt: skip
    else:
        p = pid - n_full_programs
        split = p % n_mid_splits
        bi = (p // n_mid_splits).to(tl.int64)
        _mid_part(
            Q, MK, MCH, MV, NZ, MMASK, ACC, M, L, bi // n_nonzero, bi % n_nonzero, split,
            sq_b, sq_h, sq_d, smv_b, smv_h, smv_n, smv_d, smm_b, smm_n,
            STARTS, SIZES, COUNTS,
            MKS, MKM, VS, VM, svs_b, svs_h, svs_n, svs_d, ks_cap, phase,
            mid_len, mid_cap, mid_split_len, n_kv_heads, n_slots, n_full_splits, qk_scale, cap_log2,
            G, D, BLOCK_G, BLOCK_C, BLOCK_D, BLOCK_N, NUM_GROUPS, HAS_MID_MASK, SOFTCAP, PREC, MID_CM,
            QBITS, KG, VG,
        )  # fmt: skip


@_jit(do_not_specialize=["n_slots", "n_full_slots", "n_mid_slots"])
def _merge_kernel(
    ACC, M, L, KEEP, OUT,
    skeep_h, skeep_d, so_b, so_h, so_d,
    n_kv_heads, n_slots, n_full_slots, n_mid_slots,
    G: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Log-sum-exp merge of one (row, query head)'s partials, BLOCK_S splits at a time.

    Middle slots count only for KV heads that keep channels (zero heads never wrote them).
    """
    pid = tl.program_id(0).to(tl.int64)
    g = pid % G
    bh = pid // G
    b = bh // n_kv_heads
    kvh = bh % n_kv_heads
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    keep = tl.load(KEEP + kvh * skeep_h + offs_d * skeep_d, mask=d_ok, other=0)
    used = n_full_slots + tl.where(tl.max(keep.to(tl.int32), 0) > 0, n_mid_slots, 0)

    m_i = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    base = (bh * G + g) * n_slots
    for s0 in range(0, used, BLOCK_S):
        ok = s0 + offs_s < used
        rows = base + s0 + offs_s
        m_s = tl.load(M + rows, mask=ok, other=float("-inf"))
        l_s = tl.load(L + rows, mask=ok, other=0.0)
        a_s = tl.load(ACC + rows[:, None] * D + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        m_new = tl.maximum(m_i, tl.max(m_s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing attended yet: weights 0, not NaN
        w_old = tl.exp2(m_i - m_safe)
        w = tl.exp2(m_s - m_safe)
        acc = acc * w_old + tl.sum(a_s * w[:, None], 0)
        l_i = l_i * w_old + tl.sum(l_s * w, 0)
        m_i = m_new

    out = tl.where(l_i > 0, acc / tl.where(l_i > 0, l_i, 1.0), 0.0)
    tl.store(OUT + b * so_b + (kvh * G + g) * so_h + offs_d * so_d, out.to(OUT.dtype.element_ty), mask=d_ok)


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------
def _workspace(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """fp32 scratch for partials (every element read is written first; tests poison it through here)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def kernels_interpreted() -> bool:
    """True when the kernels run on triton's CPU interpreter (``TRITON_INTERPRET=1`` when first built)."""
    if not HAS_TRITON:
        return False
    if tl is None:  # not built yet: they will follow the variable
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")
    return type(_merge_kernel).__name__ == "InterpretedFunction"


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few splits, so the split logic is exercised


def num_splits(n_keys: int, programs: int, device: torch.device, block_n: int = BLOCK_N) -> int:
    """Splits of a part of ``n_keys`` keys over ``programs`` (row, head) programs (flash-decoding heuristic).

    Enough splits to give every SM ``WAVES`` programs when the batch is small, but no split shorter
    than ``MIN_BLOCKS_PER_SPLIT`` tiles (merge cost and per-split prologue) and at most
    ``MAX_SPLITS``; 0 for an empty part.
    """
    blocks = -(-n_keys // block_n)
    if blocks == 0:
        return 0
    want = -(-WAVES * _sm_count(device) // max(1, programs))
    return max(1, min(want, MAX_SPLITS, -(-blocks // MIN_BLOCKS_PER_SPLIT)))


def _split_len(n_keys: int, splits: int, block_n: int) -> tuple[int, int]:
    """(keys per split, a multiple of block_n; splits actually needed so that none is empty)."""
    blocks = -(-n_keys // block_n)
    if blocks == 0 or splits <= 0:
        return block_n, 0
    per = -(-blocks // min(splits, blocks))
    return per * block_n, -(-blocks // per)


def _row_mask(mask: torch.Tensor | None, b: int, n: int) -> torch.Tensor | None:
    """``[B or 1, 1, n]`` bool -> ``[B, n]`` uint8 view (no copy; stride 0 where broadcast)."""
    if mask is None:
        return None
    return mask.expand(b, 1, n)[:, 0].view(torch.uint8)


def unsupported(query: torch.Tensor, layout: DecodeLayout, masks: DecodeMasks, softcap: float | None = None) -> str | None:
    """Why the kernel cannot run these inputs (the dispatcher then uses the PyTorch path), or None."""
    if softcap is not None and not softcap > 0:
        return f"softcap {softcap} (not a positive cap)"
    if query.shape[2] != 1:
        return "q_len > 1"
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {query.dtype}"
    if layout.full_v.shape[-1] != query.shape[-1]:
        return "V head_dim != K head_dim"
    for m in (masks.head_full, masks.head_mid, masks.mid, masks.tail, masks.tail_mid):
        if m is not None and (m.ndim != 3 or m.shape[1] != 1 or m.dtype != torch.bool):
            return "a mask that is not [B, 1, n] bool"
    return None


def _mid_storage(mid_k: tuple[torch.Tensor, ...], n: int) -> tuple[tuple[torch.Tensor, ...], int, bool]:
    """Middle K as the kernel indexes it: ``(tensors, cap, channel_major)``.

    Per (row, head) the kernel reads a ``[cap, c]`` key-major block, or with ``channel_major`` a
    ``[c, cap]`` block (the cache's preallocated storage: its ``[B, Hg, n, c]`` views pass without a
    copy). Other strides are copied to a compact key-major layout (cap = n).
    """
    for channel_major in (False, True):
        caps = set()
        for k in mid_k:
            b, hg, _, c = k.shape
            if channel_major:
                cap = k.stride(1) // max(1, c)
                ok = k.stride(2) == 1 and (c == 1 or k.stride(3) == cap) and k.stride(1) == c * cap and cap >= n
            else:
                cap = k.stride(1) // max(1, c)
                ok = k.stride(3) == 1 and k.stride(2) == c and k.stride(1) == cap * c
            ok = ok and (b == 1 or k.stride(0) == hg * cap * c)
            caps.add(cap if ok else -1)
        if len(caps) == 1 and -1 not in caps:
            return mid_k, caps.pop(), channel_major
    return tuple(k.contiguous() for k in mid_k), n, False


def _param_storage(params: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """K scales / minima as the kernel indexes them: ``[B, Hg, c, cap]`` storage, the last axis unit-stride, one
    ``cap`` for every head group (the cache's; anything else is copied to that form)."""
    caps = {p.stride(2) for p in params}
    ok = len(caps) == 1 and all(
        p.stride(3) == 1 and p.stride(1) == p.shape[2] * p.stride(2) and p.stride(0) == p.shape[1] * p.stride(1)
        for p in params
    )
    return params if ok else tuple(p.contiguous() for p in params)


def triton_decode_attention(
    query: torch.Tensor,
    layout: DecodeLayout,
    masks: DecodeMasks,
    scaling: float,
    softcap: float | None = None,
    *,
    splits: int | None = None,
    block_n: int = BLOCK_N,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernels' implementation of the decode contract (:mod:`leank_infer.decode.backend`), ``[B, 1, Hq, D]``.

    One query token per row; other inputs raise (see :func:`unsupported`; the dispatcher sends them to
    the PyTorch path). ``splits`` forces the split count of every part (tests; default:
    :func:`num_splits`); ``out`` is an optional ``[B, 1, Hq, D]`` buffer of the query's dtype to write into.
    """
    why = unsupported(query, layout, masks, softcap)
    if why is not None:
        raise ValueError(f"the Triton decode kernel does not cover these inputs: {why}")
    if not HAS_TRITON:
        raise RuntimeError("triton_decode_attention needs triton (pip install triton); use backend='torch'")
    if query.device.type != "cuda" and not kernels_interpreted():
        raise RuntimeError(
            f"the Triton kernel needs CUDA tensors (got {query.device}); for triton's CPU interpreter set "
            "TRITON_INTERPRET=1 before triton is first imported, or use backend='torch'"
        )

    _load_triton()
    groups = layout.groups
    head_k, head_v, tail_k, tail_v = layout.head_k, layout.head_v, layout.tail_k, layout.tail_v
    b, hq, _, d = query.shape
    hkv = groups.num_kv_heads
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    g = hq // hkv
    h, t, n = layout.head_len, layout.tail_len, layout.mid_len
    if not groups.counts:
        n = 0
    device = query.device
    head_pad = -(-h // block_n) * block_n
    full_split, s_full = _split_len(
        head_pad + t, splits or num_splits(head_pad + t, b * hkv, device, block_n), block_n
    )
    n_nonzero = len(groups.nonzero_order)
    mid_split, s_mid = _split_len(n, splits or num_splits(n, b * max(1, n_nonzero), device, block_n), block_n)
    if n_nonzero == 0:
        s_mid = 0
    n_slots = max(1, s_full + s_mid)

    acc = _workspace((b, hkv, g, n_slots, d), device)
    m_ws = _workspace((b, hkv, g, n_slots), device)
    l_ws = _workspace((b, hkv, g, n_slots), device)
    if out is None:
        out = torch.empty(b, 1, hq, d, dtype=query.dtype, device=device)
    q = query[:, :, 0]  # [B, Hq, D]
    keep = groups.keep.view(torch.uint8)
    block_d = max(16, triton.next_power_of_2(d))
    head_full, head_mid = masks.head_full, masks.head_mid
    if head_full is None:  # trivial masks: every head key is a sink key
        head_full = torch.ones(1, 1, h, dtype=torch.bool, device=device)
    if head_mid is None:
        head_mid = torch.zeros(1, 1, h, dtype=torch.bool, device=device)
    hf, hm = _row_mask(head_full, b, h), _row_mask(head_mid, b, h)
    tm, mm = _row_mask(masks.tail, b, t), _row_mask(masks.mid, b, layout.mid_len)
    tmid = _row_mask(masks.tail_mid, b, t)
    mid_cap, mid_cm = 1, False
    quant = layout.quant
    qbits, kg, vg, phase, ks_cap = 0, 1, 1, 0, 1
    if s_mid:
        mk, mid_cap, mid_cm = _mid_storage(tuple(layout.mid_k), n)  # the cache's tensors pass without a copy
        mch = tuple(ch.contiguous() for ch in groups.channels)
        sizes = tuple(len(x) for x in groups.heads)
        counts, starts, mv = tuple(groups.counts), tuple(groups.v_offsets), layout.mid_v
    else:  # no middle programs run: placeholders of the right types
        mk, mch, sizes, counts, starts, mv = (tail_k,), (groups.nonzero_order,), (0,), (0,), (0,), tail_v
    if s_mid and quant is not None:
        if not mid_cm:
            raise ValueError("a quantised middle's K codes must be the cache's channel-major storage")
        mks, mkm = _param_storage(quant.k_scale), _param_storage(quant.k_min)
        ks_cap = mks[0].stride(2)
        vs, vm = quant.v_scale, quant.v_min
        qbits, kg, vg, phase = quant.fmt.bits, quant.fmt.k_group, quant.v_group, quant.phase
    else:  # not read (QBITS = 0): placeholders of the right types
        mks, mkm, vs, vm = (tail_k,) * len(mk), (tail_k,) * len(mk), tail_v, tail_v
    if softcap is None:
        qk_scale, cap_log2 = float(scaling) * _LOG2E, 1.0
    else:  # cap * tanh(logit / cap), in base 2
        qk_scale, cap_log2 = float(scaling) / float(softcap), float(softcap) * _LOG2E
    n_full_programs = b * hkv * s_full
    grid = (n_full_programs + b * n_nonzero * s_mid,)
    if grid[0]:  # else nothing is cached: the merge writes zeros
        _partials_kernel[grid](
            q, head_k, head_v, tail_k, tail_v, keep, hf, hm, tm if tm is not None else hf,
            tmid if tmid is not None else hf, mk, mch, mv, groups.nonzero_order, mm if mm is not None else hf, acc, m_ws, l_ws,
            *q.stride(), *head_k.stride(), *head_v.stride(), *tail_k.stride(), *tail_v.stride(),
            *keep.stride(), *hf.stride(), *hm.stride(), *(tm.stride() if tm is not None else (0, 0)),
            *(tmid.stride() if tmid is not None else (0, 0)),
            *mv.stride(), *(mm.stride() if mm is not None else (0, 0)),
            starts, sizes, counts,
            mks, mkm, vs, vm, *vs.stride(), ks_cap, phase,
            h, head_pad, t, full_split, s_full, n_full_programs,
            n, mid_cap, mid_split, s_mid, n_nonzero, hkv, n_slots, qk_scale, cap_log2,
            G=g, D=d, BLOCK_G=max(16, triton.next_power_of_2(g)),
            BLOCK_C=max(16, triton.next_power_of_2(max(counts))), BLOCK_D=block_d, BLOCK_N=block_n,
            NUM_GROUPS=len(mk), HAS_TAIL_MASK=tm is not None, HAS_TAIL_MID=tmid is not None, HAS_MID_MASK=mm is not None,
            SOFTCAP=softcap is not None, MID_CM=mid_cm, QBITS=qbits, KG=kg, VG=vg,
            PREC="ieee" if query.dtype == torch.float32 else None,  # fp32: exact products, not TF32
            num_warps=NUM_WARPS,
            # fp32 tiles are twice the bytes: 2 pipeline stages keep shared memory under ~90 KB (sm_80+)
            num_stages=2 if query.dtype == torch.float32 else NUM_STAGES,
        )  # fmt: skip
    _merge_kernel[(b * hq,)](
        acc, m_ws, l_ws, keep, out,
        *keep.stride(), out.stride(0), out.stride(2), out.stride(3),
        hkv, n_slots, s_full, s_mid,
        G=g, D=d, BLOCK_S=MERGE_BLOCK_S, BLOCK_D=block_d,
    )  # fmt: skip
    return out


__all__ = ["HAS_TRITON", "kernels_interpreted", "num_splits", "triton_decode_attention", "unsupported"]
