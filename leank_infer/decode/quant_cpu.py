"""The CPU kernel of the quantised LeanK middle (kv_quant, HF path): the two products that read codes.

:func:`leank_infer.decode.torch_decode.torch_decode_attention`'s fast path over an int8/int4 middle keeps its
full-precision part and its softmax in PyTorch; what reads the middle's codes is here:

- :func:`k_scores`: a head group's middle scores, ``scaling * (sum_c (q_c * scale_cj) * code_ct + sum_c q_c * min_cj)``
  for middle token ``t`` of K group ``j``: the query times the scales (and the minima's part) of every K group of
  a piece first, then the codes (channel-major, tokens along memory) streamed channel after channel, 32 tokens at
  a time, into fp32 accumulators of three query heads at once, each code converted once for all of them;
- :func:`v_add`: ``out += sum_t p_t * (code_t * scale_t + min_t)`` per KV head (one V scale per token and head),
  the weight times the token's scale computed for a tile of tokens, then the tile's code rows streamed.

Why: the PyTorch path converts every code to fp32 before its matrix products, a pass that writes four bytes
per code, which made a quantised middle slower than an fp32 one though it holds a quarter (an eighth) of the
bytes. Here the codes are read once, as bytes, by the products themselves: at 8k tokens the int8 (int4) step is
as fast as (13 % faster than) the fp32 one (docs/speed.md, "Decode speed on CPU"; benchmarks/decode_quant.py).
Three things made the difference, each measured: zero-extending the codes with AVX2 (GCC scalarises a generic
uint8 vector conversion), computing a piece's K parameters before its tokens, vectorised over the K groups
(group by group they cost more than the codes), and a prefetch in every channel's row (more streams than the
hardware prefetcher follows).

The work is cut into pieces of :data:`SPLIT` middle tokens per (batch row, KV head), run on torch's thread count
(OpenMP); a V piece sums into a partial of its own and the partials of a head are added in piece order, so the
result is the same to the bit at any thread count. Accumulation is fp32. Built and loaded as
:mod:`leank_infer.decode.native_build` says (C++ through ctypes, as :mod:`leank_infer.vllm.cpu_decode`, whose
docstring says why); ``LEANK_CPU_KERNEL=0`` switches it off, and where no compiler works the PyTorch path is
used (logged once).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from .kv_quant import KVQuant
from .native_build import NativeLibrary

log = logging.getLogger(__name__)

ENV_SWITCH = "LEANK_CPU_KERNEL"
SOURCE_PATH = Path(__file__).with_name("quant_cpu.cpp")
SPLIT = 1024  # middle tokens per piece of work (a multiple of 32): pieces for every thread at batch 1

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class _KArgs(ctypes.Structure):
    """``struct KArgs`` (quant_cpu.cpp), field for field."""

    _fields_ = [
        *[(n, _I64) for n in ("B", "H", "G", "C", "n", "phase", "k_group", "per_byte")],
        ("q", _PTR), ("q_b", _I64), ("q_h", _I64),
        ("codes", _PTR), ("c_b", _I64), ("c_h", _I64), ("c_r", _I64),
        ("scale", _PTR), ("minimum", _PTR), ("p_b", _I64), ("p_h", _I64), ("p_c", _I64),
        ("out", _PTR), ("o_b", _I64), ("o_h", _I64), ("o_g", _I64),
        ("scaling", ctypes.c_double),
        ("threads", _I64), ("split", _I64),
    ]  # fmt: skip


class _VArgs(ctypes.Structure):
    """``struct VArgs`` (quant_cpu.cpp), field for field."""

    _fields_ = [
        *[(n, _I64) for n in ("B", "Hkv", "G", "Dv", "n", "per_byte")],
        ("p", _PTR), ("p_b", _I64), ("p_h", _I64), ("p_g", _I64),
        ("codes", _PTR), ("c_b", _I64), ("c_h", _I64), ("c_t", _I64),
        ("scale", _PTR), ("minimum", _PTR), ("s_b", _I64), ("s_h", _I64), ("s_t", _I64),
        ("v_row", _PTR),
        ("out", _PTR), ("o_b", _I64), ("o_h", _I64), ("o_g", _I64),
        ("threads", _I64), ("split", _I64),
    ]  # fmt: skip


def _declare(lib: ctypes.CDLL) -> None:
    lib.leank_quant_k_scores.restype = ctypes.c_int
    lib.leank_quant_k_scores.argtypes = [ctypes.POINTER(_KArgs)]
    lib.leank_quant_v_add.restype = ctypes.c_int
    lib.leank_quant_v_add.argtypes = [ctypes.POINTER(_VArgs)]


LIBRARY = NativeLibrary(SOURCE_PATH, "cpu-kernel", ENV_SWITCH, "CPU kv_quant kernel", _declare, log)


def available() -> bool:
    """Whether the kernel is built and switched on (``LEANK_CPU_KERNEL`` not ``0``); the first call builds it."""
    return LIBRARY.available()


def supports(k_codes: tuple[torch.Tensor, ...], k_scale: tuple[torch.Tensor, ...], k_min: tuple[torch.Tensor, ...],
             v_codes: torch.Tensor, v_scale: torch.Tensor, v_min: torch.Tensor) -> bool:
    """Whether the kernel reads these middle tensors as they lie (CPU, uint8 codes with tokens (K) and channels
    (V) along memory, float16 parameters with K groups along memory and V's two on one set of strides)."""
    f16 = torch.float16
    return (
        v_codes.device.type == "cpu"
        and v_codes.dtype == torch.uint8
        and v_codes.stride(3) == 1
        and v_scale.dtype == v_min.dtype == f16
        and v_scale.stride() == v_min.stride()
        and all(
            k.dtype == torch.uint8 and k.device.type == "cpu" and k.stride(2) == 1
            and s.dtype == m.dtype == f16 and s.stride() == m.stride() and s.stride(3) == 1
            for k, s, m in zip(k_codes, k_scale, k_min, strict=True)
        )
    )  # fmt: skip


def _check(rc: int) -> None:
    if rc:
        raise RuntimeError(f"the LeanK CPU kv_quant kernel failed (code {rc}: 1 out of memory, 2 bad arguments)")


def k_scores(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, phase: int,
             fmt: KVQuant, scaling: float, out: torch.Tensor) -> None:
    """Write one head group's middle scores into ``out`` ``[B, Hg, G, n]`` (fp32, tokens along memory).

    ``q`` ``[B, Hg, G, c]`` fp32, the kept channels of the query (``G`` query heads per KV head, channels along
    memory); ``codes`` ``[B, Hg, n, ceil(c / per_byte)]`` the layout's channel-major view; ``scale`` / ``minimum``
    ``[B, Hg, c, groups]`` float16. Needs :func:`available` and :func:`supports`."""
    b, hg, g, c = q.shape
    n = codes.shape[2]
    a = _KArgs(b, hg, g, c, n, phase, fmt.k_group, fmt.per_byte)
    a.q, a.q_b, a.q_h = q.data_ptr(), q.stride(0), q.stride(1)
    # the channel-major storage from slot 0 (token -phase): whole K groups are read, their tokens alone written
    a.codes, a.c_b, a.c_h, a.c_r = codes.data_ptr() - phase, codes.stride(0), codes.stride(1), codes.stride(3)
    a.scale, a.minimum = scale.data_ptr(), minimum.data_ptr()
    a.p_b, a.p_h, a.p_c = scale.stride(0), scale.stride(1), scale.stride(2)
    a.out, a.o_b, a.o_h, a.o_g = out.data_ptr(), out.stride(0), out.stride(1), out.stride(2)
    a.scaling, a.threads, a.split = scaling, torch.get_num_threads(), SPLIT
    _check(LIBRARY.lib.leank_quant_k_scores(ctypes.byref(a)))


def v_add(p: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, v_row: torch.Tensor,
          fmt: KVQuant, out: torch.Tensor) -> None:
    """``out[b, h, g] += sum_t p[b, h, g, t] * V_t`` over the middle's dequantised V, in place.

    ``p`` ``[B, Hkv, G, n]`` fp32 weights (tokens along memory); ``codes`` ``[B, Hnz, n, ceil(Dv / per_byte)]``;
    ``scale`` / ``minimum`` ``[B, Hnz, n, 1]`` float16 (one per token: v_group = Dv); ``v_row`` ``[Hkv]`` int64,
    each KV head's row of ``codes`` or -1 (no middle); ``out`` ``[B, Hkv, G, Dv]`` fp32, channels along memory."""
    b, hkv, g, n = p.shape
    dv = out.shape[3]
    a = _VArgs(b, hkv, g, dv, n, fmt.per_byte)
    a.p, a.p_b, a.p_h, a.p_g = p.data_ptr(), p.stride(0), p.stride(1), p.stride(2)
    a.codes, a.c_b, a.c_h, a.c_t = codes.data_ptr(), codes.stride(0), codes.stride(1), codes.stride(2)
    a.scale, a.minimum = scale.data_ptr(), minimum.data_ptr()
    a.s_b, a.s_h, a.s_t = scale.stride(0), scale.stride(1), scale.stride(2)
    a.v_row = v_row.data_ptr()
    a.out, a.o_b, a.o_h, a.o_g = out.data_ptr(), out.stride(0), out.stride(1), out.stride(2)
    a.threads, a.split = torch.get_num_threads(), SPLIT
    _check(LIBRARY.lib.leank_quant_v_add(ctypes.byref(a)))
