"""Triton kernels of the vLLM plugin on CUDA: the batched LeanK decode over the pages, and the page write.

:func:`decode` is :func:`leank_infer.vllm.kernels.decode` (same signature, same result as the reference
``tests/vllm_pages.reference``) for every decode request of a step, reading the LeanK pages
(:mod:`~leank_infer.vllm.pool`) in place through the block tables:

- ``_decode_kernel``, grid ``(B, Hkv, S)``: program ``(b, h, s)`` takes split ``s`` of request ``b``'s
  positions ``[0, seq_len)`` for KV head ``h`` (flash-decoding: ``S`` chunks of ``ceil(seq_len / S)``
  positions rounded up to the key tile). In its chunk it scores the sink and the recent window with
  every channel (each K element from the packed row or the window pages' rest row), and the middle with the head's kept channels (q gathered on
  them once) and its V from the packed rows; a head keeping no channel skips its middle. The rule is
  computed in the kernel from ``seq_lens`` (a device tensor: nothing is read back to the host). The
  ``G`` query heads of a KV head are the rows of one ``[G, C] x [C, BLOCK_N]`` dot, so each page tile is
  loaded once for all of them. Each program writes an unnormalised partial (fp32, base-2 logits);
- ``_merge_kernel``, grid ``(B, Hq)``: log-sum-exp merge of the ``S`` partials, and the division.

Why splits and a merge rather than one pass per (request, KV head): at batch 1 that pass is ``Hkv``
programs (8 for Llama-8B) on a GPU with 132 SMs, each walking the whole context; splitting the
positions gives ``B * Hkv * S`` programs of about twice the SM count. ``S`` depends on the batch's
*shape* only (``B``, ``Hkv``, the SM count), never on its lengths, so a CUDA graph captured for a
batch size replays for any lengths: the grid, the workspaces and every argument are fixed by the
shapes, and the lengths are read on the device. When the shape gives ``S == 1`` (large batches) the
decode kernel normalises and writes the output itself and the merge is not launched: two launches
per call, one when ``S == 1`` (:func:`launches`).

fp8 pages (``torch.uint8`` holding ``float8_e4m3fn`` / ``float8_e5m2`` bytes, or typed as that fp8
dtype) are converted in the kernel; their scales are folded into the logit scale (K) and the output
(V): ``q.(s k) = s (q.k)``, exact up to float rounding, since fp8 converts exactly into fp16, bf16 and
fp32. The write rounds ``value / scale`` to fp8 to nearest even, as PyTorch does; out of fp8's range
the GPU saturates where PyTorch gives NaN (e4m3fn) or inf (e5m2).

:func:`write` puts a step's K/V into the pages (the capture-safe form of the PyTorch write
:func:`~leank_infer.vllm.paged_reference.write_pages`): ``_write_kernel``, one program per token,
skips padding (slot ``< 0``) and window slots in the null block (slot ``<`` the window block size) on the device.

Per-layer channel tables live on the device, built once per layer and device (:func:`prepare`); build
them before a CUDA graph capture (the backend does when it plans the worker): creating them copies
from the host, which a capturing stream does not allow.

Tested on triton's CPU interpreter (fp16, fp32; fp8 pages) against the PyTorch reference
(``tests/test_vllm_triton_paged.py``); on a GPU ``benchmarks/gpu_check.py`` (vllm part) checks bf16,
times it and captures it in a CUDA graph. Launch options are untuned (chosen without a GPU).
"""

from __future__ import annotations  # kernel annotations stay strings ("tl.constexpr"): triton reads them so

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from .layout import PackedLayout
from .pool import LayerSlot, WorkerPlan

BLOCK_N = 64  # keys per tile
MAX_SPLITS = 64  # splits of one request's positions, at most
PROGRAMS_PER_SM = 2  # S is chosen for about this many decode programs per SM
CPU_SMS = 2  # the interpreter's "SM count": few splits (each interpreted program is slow)
WRITE_BLOCK = 256  # columns per step of the write kernel
ENV_CPU = "LEANK_TRITON_ON_CPU"  # =1 (with TRITON_INTERPRET=1): CPU tensors run these kernels too (tests)
_LOG2E = 1.4426950408889634
_FP8_CODE = {None: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}

triton: Any = None  # bound by _load() at the first launch
tl: Any = None
_JIT: list[str] = []
_interpreted: bool | None = None  # set at the first launch: did triton.jit give interpreted functions?
_tables: dict[tuple[int, str], tuple[Any, ...]] = {}


def _jit(fn: Callable) -> Callable:
    """Mark ``fn`` for ``triton.jit`` at the first launch, so that importing this module never imports
    triton and ``TRITON_INTERPRET`` is read when the kernels are first needed."""
    _JIT.append(fn.__name__)
    return fn


def _load() -> None:
    """Import triton and replace every ``@_jit`` function of this module by its ``triton.jit`` form."""
    global triton, tl, _interpreted
    if tl is not None:
        return
    import triton as triton_mod
    import triton.language as tl_mod

    names = globals()
    for name in _JIT:
        names[name] = triton_mod.jit(names[name])
    _interpreted = type(names[_JIT[0]]).__name__ == "InterpretedFunction"
    triton, tl = triton_mod, tl_mod


def interpreted() -> bool:
    """True when triton runs on its CPU interpreter (``TRITON_INTERPRET=1`` before triton is first loaded)."""
    if _interpreted is not None:
        return _interpreted
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def handles(x: torch.Tensor) -> bool:
    """Whether :mod:`~leank_infer.vllm.kernels` sends ``x``'s work here: CUDA tensors, and CPU tensors when
    ``$LEANK_TRITON_ON_CPU=1`` and the interpreter is on (tests; a CPU engine keeps its own kernels)."""
    if x.is_cuda:
        return True
    return os.environ.get(ENV_CPU) == "1" and interpreted()


# ---- kernels -----------------------------------------------------------------------------------------


@_jit
def _dequant(x, FP8: tl.constexpr):
    """Stored elements as loaded: fp8 bytes reinterpreted (e4m3fn: 1, e5m2: 2), others unchanged."""
    if FP8 == 1:
        x = x.to(tl.float8e4nv, bitcast=True)
    elif FP8 == 2:
        x = x.to(tl.float8e5, bitcast=True)
    return x


@_jit
def _attend(acc, m_i, l_i, q, k, v, ok, qk_scale, PREC: tl.constexpr):
    """One online-softmax step: q ``[BG, C]`` against k ``[C, BN]``, v ``[BN, BD]``; keys where ``ok``
    (at least one: callers only step over non-empty ranges)."""
    sc = tl.dot(q, k, input_precision=PREC) * qk_scale
    sc = tl.where(ok[None, :], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, m_new, l_i


@_jit
def _full_range(
    acc, m_i, l_i, q, lo, hi, PACKED, ptab, sp_blk, sp_row, WIN, wtab, sw_blk, sw_row, kp, kr, v_col, v_rest,
    qk_scale,
    BLOCK_SIZE: tl.constexpr, WIN_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D: tl.constexpr, FP8: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Keys ``[lo, hi)`` with every channel: K channel d of the head from the packed row's column ``kp[d]`` or the
    rest row's ``kr[d]`` (the other is -1), V from column ``v_col`` of the rest row (``v_rest``) or the packed row
    (both pointers already at the layer's columns)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        ok = pos < hi
        pblk = tl.load(ptab + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        wblk = tl.load(wtab + pos // WIN_BLOCK, mask=ok, other=0).to(tl.int64)
        prow = PACKED + pblk * sp_blk + (pos % BLOCK_SIZE) * sp_row
        wrow = WIN + wblk * sw_blk + (pos % WIN_BLOCK) * sw_row
        k = tl.load(prow[None, :] + kp[:, None], mask=ok[None, :] & (kp >= 0)[:, None], other=0) + tl.load(
            wrow[None, :] + kr[:, None], mask=ok[None, :] & (kr >= 0)[:, None], other=0
        )  # each element from one of the two rows (the other load is masked to 0)
        vrow = tl.where(v_rest, wrow, prow)
        v = tl.load(vrow[:, None] + v_col + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0)
        k = _dequant(k, FP8).to(q.dtype)
        v = _dequant(v, FP8).to(q.dtype)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, k, v, ok, qk_scale, PREC)
    return acc, m_i, l_i


@_jit
def _decode_kernel(
    Q, PACKED, PTAB, WIN, WTAB, SEQ, KOFF, KCNT, KCH, VCOL, FKP, FKR, RVCOL, ACC, M, L, OUT,
    sq_b, sq_h, sp_blk, sp_row, spt_b, sw_blk, sw_row, swt_b, so_b, so_h,
    packed_offset, window_offset, qk_scale, v_scale,
    SINK: tl.constexpr, RECENT: tl.constexpr, ACCUMU: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    WIN_BLOCK: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, PREC: tl.constexpr, DIRECT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq = tl.load(SEQ + b)  # keys [0, seq): the query is at p = seq - 1 (0 for padding rows: no keys)
    chunk = tl.cdiv(tl.cdiv(seq, S), BLOCK_N) * BLOCK_N
    lo = s * chunk
    hi = tl.minimum(lo + chunk, seq)
    # the positional rule: middle [SINK, rf), rf = ACCUMU * floor((p - RECENT) / ACCUMU); a negative
    # p - RECENT gives rf <= 0 <= SINK, an empty middle, as clamping it to 0 does (no negative division)
    rf = tl.maximum(seq - 1 - RECENT, 0) // ACCUMU * ACCUMU
    full_from = tl.maximum(rf, SINK)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    d_ok = offs_d < D
    q_row = Q + b * sq_b + (h * G + offs_g) * sq_h
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    # sink [0, SINK) and recent window [full_from, seq): every channel, the packed row's and the window pages'
    # rest row's (hi <= seq)
    q = tl.load(q_row[:, None] + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    wtab = WTAB + b * swt_b
    ptab = PTAB + b * spt_b
    kp = tl.load(FKP + h * D + offs_d, mask=d_ok, other=-1)
    kr = tl.load(FKR + h * D + offs_d, mask=d_ok, other=-1)
    v_rest = tl.load(RVCOL + h) >= 0
    full_v = tl.where(v_rest, tl.load(RVCOL + h), tl.load(VCOL + h))
    acc, m_i, l_i = _full_range(
        acc, m_i, l_i, q, lo, tl.minimum(hi, SINK), PACKED + packed_offset, ptab, sp_blk, sp_row,
        WIN + window_offset, wtab, sw_blk, sw_row, kp, kr, full_v, v_rest, qk_scale,
        BLOCK_SIZE, WIN_BLOCK, BLOCK_N, BLOCK_D, D, FP8, PREC,
    )  # fmt: skip
    acc, m_i, l_i = _full_range(
        acc, m_i, l_i, q, tl.maximum(lo, full_from), hi, PACKED + packed_offset, ptab, sp_blk, sp_row,
        WIN + window_offset, wtab, sw_blk, sw_row, kp, kr, full_v, v_rest, qk_scale,
        BLOCK_SIZE, WIN_BLOCK, BLOCK_N, BLOCK_D, D, FP8, PREC,
    )  # fmt: skip

    # middle: the head's kept K channels and its V, from the packed rows
    cnt = tl.load(KCNT + h)
    k_off = tl.load(KOFF + h)
    v_off = tl.load(VCOL + h)
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < cnt
    ch = tl.load(KCH + k_off + offs_c, mask=c_ok, other=0)
    qm = tl.load(q_row[:, None] + ch[None, :], mask=g_ok[:, None] & c_ok[None, :], other=0.0)
    mid_lo = tl.maximum(lo, SINK)
    mid_hi = tl.where(cnt > 0, tl.minimum(hi, rf), mid_lo)  # a head keeping no channel has no middle keys
    for start in range(mid_lo, mid_hi, BLOCK_N):
        pos = start + offs_n
        ok = pos < mid_hi
        blk = tl.load(ptab + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        row = PACKED + blk * sp_blk + (pos % BLOCK_SIZE) * sp_row + packed_offset
        k = tl.load(row[None, :] + k_off + offs_c[:, None], mask=ok[None, :] & c_ok[:, None], other=0)
        v = tl.load(row[:, None] + v_off + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0)
        k = _dequant(k, FP8).to(q.dtype)
        v = _dequant(v, FP8).to(q.dtype)
        acc, m_i, l_i = _attend(acc, m_i, l_i, qm, k, v, ok, qk_scale, PREC)

    if DIRECT:  # one split: this program has every key of (b, h)
        den = tl.where(l_i > 0, l_i, 1.0)  # 0 only for padding rows (seq 0): their output is 0
        out = acc / den[:, None] * v_scale
        o_ptr = OUT + b * so_b + (h * G + offs_g)[:, None] * so_h + offs_d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        slot = ((b * HKV + h) * S + s) * G + offs_g
        tl.store(M + slot, m_i, mask=g_ok)
        tl.store(L + slot, l_i, mask=g_ok)
        tl.store(ACC + slot[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@_jit
def _merge_kernel(
    ACC, M, L, OUT, so_b, so_h, v_scale,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    qh = tl.program_id(1)
    h = qh // G
    g = qh % G
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < S
    d_ok = offs_d < D
    slot = ((b * HKV + h) * S + offs_s) * G + g
    m = tl.load(M + slot, mask=s_ok, other=float("-inf"))
    lsum = tl.load(L + slot, mask=s_ok, other=0.0)
    top = tl.max(m, 0)
    top = tl.where(top > float("-inf"), top, 0.0)  # every split empty (padding row): weights exp2(-inf) = 0
    w = tl.exp2(m - top)
    den = tl.sum(w * lsum, 0)
    acc = tl.load(ACC + slot[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    out = num / tl.where(den > 0, den, 1.0) * v_scale
    tl.store(OUT + b * so_b + qh * so_h + offs_d, out.to(OUT.dtype.element_ty), mask=d_ok)


@_jit
def _gather(K, V, t, src, ok, sk_n, sk_h, sv_n, sv_h, HD: tl.constexpr, D: tl.constexpr):
    """Elements ``src`` of token t's ``[K | V]`` flat row (``[0, HD)`` K, ``[HD, 2 HD)`` V, ``< 0`` zero)."""
    is_k = ok & (src >= 0) & (src < HD)
    is_v = ok & (src >= HD)
    kx = tl.load(K + t * sk_n + (src // D) * sk_h + src % D, mask=is_k, other=0.0)
    vs = src - HD
    vx = tl.load(V + t * sv_n + (vs // D) * sv_h + vs % D, mask=is_v, other=0.0)
    return tl.where(is_v, vx, kx)


@_jit
def _stored(x, is_k, k_scale, v_scale, DST, FP8: tl.constexpr):
    """``x`` as the pages store it: fp8 bytes of ``x / scale`` (K or V scale), else the page dtype."""
    if FP8 == 0:
        return x.to(DST.dtype.element_ty)
    y = x.to(tl.float32) / tl.where(is_k, k_scale, v_scale)
    if FP8 == 1:
        y = y.to(tl.float8e4nv)
    else:
        y = y.to(tl.float8e5)
    return y.to(tl.uint8, bitcast=True)


@_jit
def _write_kernel(
    K, V, PSLOT, WSLOT, PACKED, WIN, SRC, RSRC,
    sk_n, sk_h, sv_n, sv_h, sp_blk, sp_row, sw_blk, sw_row,
    packed_offset, window_offset, width, nk, rest_width, nkr, k_scale, v_scale,
    HD: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, WIN_BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_W)
    ps = tl.load(PSLOT + t).to(tl.int64)
    if ps >= 0:  # -1: padding
        dst = PACKED + (ps // BLOCK_SIZE) * sp_blk + (ps % BLOCK_SIZE) * sp_row + packed_offset
        for c0 in range(0, width, BLOCK_W):
            c = c0 + offs
            ok = c < width
            src = tl.load(SRC + c, mask=ok, other=-1)
            x = _gather(K, V, t, src, ok, sk_n, sk_h, sv_n, sv_h, HD, D)
            tl.store(dst + c, _stored(x, c < nk, k_scale, v_scale, PACKED, FP8), mask=ok)
    ws = tl.load(WSLOT + t).to(tl.int64)
    if ws >= WIN_BLOCK:  # -1: padding; [0, WIN_BLOCK): the null block, which nothing reads
        dst = WIN + (ws // WIN_BLOCK) * sw_blk + (ws % WIN_BLOCK) * sw_row + window_offset
        for c0 in range(0, rest_width, BLOCK_W):
            c = c0 + offs
            ok = c < rest_width
            src = tl.load(RSRC + c, mask=ok, other=-1)
            x = _gather(K, V, t, src, ok, sk_n, sk_h, sv_n, sv_h, HD, D)
            tl.store(dst + c, _stored(x, c < nkr, k_scale, v_scale, WIN, FP8), mask=ok)


# ---- launchers ---------------------------------------------------------------------------------------


def _canonical(device: torch.device) -> torch.device:
    """``cuda`` with its index (what a tensor's ``.device`` says), so that memo keys match."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def layer_tables(layout: PackedLayout, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The layer's int32 channel tables on ``device`` (built once, :func:`prepare`): per KV head the first
    packed K column, the kept count, the packed V column; the kept channel ids (flat, packed order);
    the write's source of every packed column (``[K | V]`` flat index, -1 for the padding element)."""
    device = _canonical(device)
    key = (id(layout), str(device))
    if key not in _tables:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "LeanK's channel tables were not on the GPU before CUDA graph capture: call "
                "leank_infer.vllm.kernels.prepare(plan, device) first (the backend does when it plans the worker)"
            )
        d, hkv = layout.head_dim, layout.num_kv_heads
        k_index, v_index = layout.k_index.cpu(), layout.v_index.cpu()
        nk = k_index.numel()
        counts = torch.bincount(k_index // d, minlength=hkv)
        k_off = torch.cumsum(counts, 0) - counts
        v_col = torch.zeros(hkv, dtype=torch.long)
        for i, h in enumerate(layout.v_heads):
            v_col[h] = nk + i * d
        channels = k_index % d if nk else torch.zeros(1, dtype=torch.long)
        src = torch.full((layout.width,), -1, dtype=torch.long)
        src[:nk] = k_index
        src[nk : nk + v_index.numel()] = hkv * d + v_index
        # the rest row (dropped K channels, then the V of heads keeping none): where each full K element is, and
        # where each head's V is when the packed row lacks it; the write's source of every rest column
        kr_index, vr_index = layout.kr_index.cpu(), layout.vr_index.cpu()
        fkp = torch.full((hkv * d,), -1, dtype=torch.long)
        fkp[k_index] = torch.arange(nk)
        fkr = torch.full((hkv * d,), -1, dtype=torch.long)
        fkr[kr_index] = torch.arange(kr_index.numel())
        rv_col = torch.full((hkv,), -1, dtype=torch.long)
        for i, h in enumerate(layout.rest_v_heads):
            rv_col[h] = kr_index.numel() + i * d
        rsrc = torch.cat([kr_index, hkv * d + vr_index]) if layout.rest_width else torch.full((1,), -1)
        tensors = tuple(
            t.to(device=device, dtype=torch.int32) for t in (k_off, counts, v_col, channels, src, fkp, fkr, rv_col, rsrc)
        )
        _tables[key] = (*tensors, int(counts.max()) if nk else 0, layout)  # the layout keeps its id its own
    return _tables[key][:10]


def prepare(plan: WorkerPlan, device: torch.device) -> None:
    """Build every layer's device tables now (before any CUDA graph capture)."""
    for slot in plan.slots.values():
        layer_tables(slot.layout, device)


@functools.cache
def _cuda_sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _sm_count(device: torch.device) -> int:
    return _cuda_sm_count(device) if device.type == "cuda" else CPU_SMS


def num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per (request, KV head): a function of the shape only (graph-safe), about
    ``PROGRAMS_PER_SM`` decode programs per SM."""
    target = PROGRAMS_PER_SM * _sm_count(_canonical(device))
    return max(1, min(MAX_SPLITS, -(-target // max(1, batch * num_kv_heads))))


def launches(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Kernel launches of one :func:`decode` call: the decode kernel, and the merge unless one split."""
    return 1 if num_splits(batch, num_kv_heads, device) == 1 else 2


def _as_stored(pages: torch.Tensor, fp8: torch.dtype | None) -> tuple[torch.Tensor, int]:
    """Pages as the kernels index them (fp8 pages as their uint8 bytes, whichever dtype they come in) and
    the fp8 code of the kernels (0: none, 1: e4m3fn, 2: e5m2)."""
    if fp8 not in _FP8_CODE:
        raise ValueError(f"unsupported fp8 page dtype {fp8}")
    if fp8 is not None and pages.dtype == fp8:
        pages = pages.view(torch.uint8)
    if (fp8 is not None) != (pages.dtype == torch.uint8):
        raise ValueError(
            f"pages of {pages.dtype} with fp8={fp8}: fp8 pages hold fp8 bytes, others the model dtype"
        )
    return pages, _FP8_CODE[fp8]


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def decode(
    q: torch.Tensor,
    packed: torch.Tensor,
    packed_table: torch.Tensor,
    window: torch.Tensor,
    window_table: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: WorkerPlan,
    slot: LayerSlot,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8: torch.dtype | None = None,
) -> torch.Tensor:
    """LeanK attention ``[B, Hq, D]`` of one new query per request (its K/V already in the pages), on
    Triton (module docstring); rows with ``seq_len == 0`` (graph padding) give zeros."""
    _load()
    b, hq, d = q.shape
    hkv = plan.num_kv_heads
    if hq % hkv or d != plan.head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit {hkv} KV heads of {plan.head_dim} channels")
    packed, code = _as_stored(packed, fp8)
    window, _ = _as_stored(window, fp8)
    bs, wbs = packed.shape[1], window.shape[1]  # tokens per block of each store
    if packed.stride(2) != 1 or window.stride(2) != 1:
        raise ValueError("packed and window pages need contiguous rows")
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    if packed_table.stride(1) != 1 or window_table.stride(1) != 1:
        raise ValueError("block tables need contiguous rows")
    g = hq // hkv
    k_off, counts, v_col, channels, _, fkp, fkr, rv_col, _, max_count = layer_tables(slot.layout, q.device)
    s = num_splits(b, hkv, q.device)
    acc = m = lsum = out  # unused when S == 1
    if s > 1:
        acc = torch.empty(b * hkv * s * g, d, dtype=torch.float32, device=q.device)
        m = torch.empty(b * hkv * s * g, dtype=torch.float32, device=q.device)
        lsum = torch.empty_like(m)
    block_d = _pow2(d)
    _decode_kernel[(b, hkv, s)](
        q, packed, packed_table, window, window_table, seq_lens, k_off, counts, channels, v_col, fkp, fkr, rv_col,
        acc, m, lsum, out,
        q.stride(0), q.stride(1), packed.stride(0), packed.stride(1), packed_table.stride(0),
        window.stride(0), window.stride(1), window_table.stride(0), out.stride(0), out.stride(1),
        slot.packed_offset, slot.window_offset, scale * _LOG2E * k_scale, v_scale,
        SINK=plan.sink, RECENT=plan.recent, ACCUMU=plan.accumu, BLOCK_SIZE=bs, WIN_BLOCK=wbs,
        HKV=hkv, G=g, D=d, S=s, BLOCK_G=_pow2(g), BLOCK_D=block_d, BLOCK_C=_pow2(max_count), BLOCK_N=BLOCK_N,
        FP8=code, PREC="ieee" if q.dtype == torch.float32 else "tf32", DIRECT=s == 1,
    )  # fmt: skip
    if s > 1:
        _merge_kernel[(b, hq)](
            acc, m, lsum, out, out.stride(0), out.stride(1), v_scale,
            HKV=hkv, G=g, D=d, S=s, BLOCK_S=_pow2(s, 2), BLOCK_D=block_d,
        )  # fmt: skip
    return out


def write(
    packed: torch.Tensor,
    packed_slots: torch.Tensor,
    window: torch.Tensor,
    window_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot: LayerSlot,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8: torch.dtype | None = None,
) -> None:
    """The step's K/V ``[n, Hkv, D]`` into this layer's columns, as
    :func:`~leank_infer.vllm.paged_reference.write_pages` does, in one launch without host syncs: a packed
    row at every ``packed_slots`` entry ``>= 0``, a rest row at every ``window_slots`` entry ``>=`` the window block."""
    _load()
    n = k.shape[0]
    if n == 0:
        return
    packed, code = _as_stored(packed, fp8)
    window, _ = _as_stored(window, fp8)
    bs, wbs = packed.shape[1], window.shape[1]  # tokens per block of each store
    if packed.stride(2) != 1 or window.stride(2) != 1:
        raise ValueError("packed and window pages need contiguous rows")
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    layout = slot.layout
    hd = layout.num_kv_heads * layout.head_dim
    tables = layer_tables(layout, k.device)
    _write_kernel[(n,)](
        k, v, packed_slots, window_slots, packed, window, tables[4], tables[8],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        packed.stride(0), packed.stride(1), window.stride(0), window.stride(1),
        slot.packed_offset, slot.window_offset, layout.width, layout.k_index.numel(),
        layout.rest_width, layout.kr_index.numel(), k_scale, v_scale,
        HD=hd, D=layout.head_dim, BLOCK_SIZE=bs, WIN_BLOCK=wbs, BLOCK_W=WRITE_BLOCK, FP8=code,
    )  # fmt: skip
