"""The CPU kernel of the batched LeanK decode: every decode request of a step, one call per layer, in place.

One call reads each request's keys where the engine wrote them (:mod:`~leank_infer.vllm.pool`): the sink and
the recent window with every channel (the kept ones from the packed rows, the others from the window pages'
rest rows: two partial dot products per key), the middle with each KV head's kept channels from
the packed rows, both through the block tables, with no gather. The work is cut into pieces: per request one
with its full-channel keys and the first ``SPLIT`` middle keys, then one per further ``SPLIT`` middle keys (so a
batch of one long request still keeps every thread busy); every piece covers all the KV heads of its keys, so
each token's row (a few hundred bytes of the layer in a 17 KB row of all layers, a page of its own) is fetched
once for all heads: measured 5-15 % faster than one piece per (request, KV head) on these pages. A *run* of rows
(one request's speculative queries at consecutive positions, ``runs``) shares the pieces of the middle its first
query scores, each scoring every query of the run, and each query gets a piece of its own for its full-channel keys
and the few middle keys past the first query's window (0.64-0.84x the time of the rows alone:
``benchmarks/vllm_kernel.py --drafts``). Pieces run
longest first on the engine's threads (OpenMP, ``torch.get_num_threads()``, which vLLM's CPU worker sets and
binds); the last piece of a request to finish merges the request's softmax states, as in flash-decoding. The
cut depends on the lengths only, so the result is the same to the bit at any thread count. Within a piece the
keys go in tiles of 128 (online softmax, one rescale per tile), the query heads of one KV head together so
that each key and value row is loaded once for all of them (8-float vectors, scalar tails for any head_dim and
kept count). A layer's run of a block (:mod:`~leank_infer.vllm.pool`) is a few KB among every layer's runs,
too short for the hardware prefetcher: while the first KV head scores a tile, the kernel asks for the next
tile's rows into L2 (without it a step took 2.0-2.2x as long: ``benchmarks/vllm_kernel_ab.py``, the A/B in
docs/architecture.md). Storage is fp32, bf16, fp16 or fp8 bytes (e4m3/e5m2 through a 256-entry table; the K scale rides
on the query, the V scale on the output); accumulation is fp32.

**Why C++ through ctypes with OpenMP** (``benchmarks/vllm_kernel_build.py`` measures the alternatives; the
numbers are in its docstring): it was the fastest per call, it builds in seconds with the system compiler (no
Python or PyTorch headers; vLLM's CPU backend compiles the model with ``torch.compile``, which needs that
compiler anyway unless ``enforce_eager``), and its OpenMP threads are the engine's own: the library links
``libgomp.so.1``, which resolves to the one PyTorch has loaded, so vLLM's thread count and core binding apply
and nothing oversubscribes. ``torch.utils.cpp_extension.load_inline`` runs the same source no faster but
builds for a minute or more (PyTorch headers) and needs ninja and the Python headers; numba needs no compiler
but JIT-compiles for tens of seconds on first use and about two seconds in every later process, was several
times slower per call, and its OpenMP layer loads a second OpenMP runtime with threads of its own.

The library is compiled the first time a LeanK layer decodes on the CPU, into ``~/.cache/leank/vllm-kernel/``
(or ``$LEANK_CACHE``), keyed by the source, the flags, the compiler and the CPU (``-march=native``); later
processes load it in milliseconds (:mod:`leank_infer.decode.native_build`, shared with the HF path's kernel). Where no compiler works, or with ``LEANK_VLLM_CPU_KERNEL=0``,
:func:`available` is false and :func:`leank_infer.vllm.kernels.decode` keeps the PyTorch path (logged once).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..decode.native_build import NativeLibrary
from .pool import LayerSlot, WorkerPlan

log = logging.getLogger(__name__)

ENV_SWITCH = "LEANK_VLLM_CPU_KERNEL"
SOURCE_PATH = Path(__file__).with_name("cpu_decode.cpp")
SPLIT = 512  # middle keys per piece of work (a multiple of the tile): pieces for the threads at any batch

_KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.uint8: 3}
_Q_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# the fields every struct of the library has, in this order: the two stores' pages and their strides
_PAGES = [
    ("packed", ctypes.c_void_p),
    ("window", ctypes.c_void_p),
    *[(n, ctypes.c_int64) for n in ("packed_block_stride", "packed_row", "window_block_stride", "window_row")],
]


class _Args(ctypes.Structure):
    """The kernel's ``struct Args`` (cpu_decode.cpp), field for field."""

    _fields_ = [
        *[(n, ctypes.c_int64) for n in ("B", "Hq", "Hkv", "D", "block_size")],
        ("q", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        *_PAGES,
        ("packed_table", ctypes.c_void_p),
        ("window_table", ctypes.c_void_p),
        ("packed_table_stride", ctypes.c_int64),
        ("window_table_stride", ctypes.c_int64),
        ("seq_lens", ctypes.c_void_p),
        ("packed_offset", ctypes.c_int64),
        ("window_offset", ctypes.c_int64),
        ("k_off", ctypes.c_void_p),
        ("k_ch", ctypes.c_void_p),
        ("v_col", ctypes.c_void_p),
        *[(n, ctypes.c_int64) for n in ("sink", "recent", "accumu")],
        *[(n, ctypes.c_double) for n in ("scale", "k_scale", "v_scale")],
        ("q_type", ctypes.c_int64),
        ("kv_type", ctypes.c_int64),
        ("lut", ctypes.c_void_p),
        ("threads", ctypes.c_int64),
        ("split", ctypes.c_int64),
        ("rk_off", ctypes.c_void_p),
        ("rk_ch", ctypes.c_void_p),
        ("rv_col", ctypes.c_void_p),
        ("window_block", ctypes.c_int64),
        ("runs", ctypes.c_void_p),
    ]


class _WArgs(ctypes.Structure):
    """The write's ``struct WArgs`` (cpu_decode.cpp), field for field."""

    _fields_ = [
        *[(n, ctypes.c_int64) for n in ("n", "HD", "block_size", "elem")],
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("k_stride", ctypes.c_int64),
        ("v_stride", ctypes.c_int64),
        *_PAGES,
        ("packed_slots", ctypes.c_void_p),
        ("window_slots", ctypes.c_void_p),
        ("k_index", ctypes.c_void_p),
        ("v_index", ctypes.c_void_p),
        *[(n, ctypes.c_int64) for n in ("nk", "nv", "width")],
        ("kr_index", ctypes.c_void_p),
        ("vr_index", ctypes.c_void_p),
        *[(n, ctypes.c_int64) for n in ("nkr", "nvr", "window_block", "threads")],
    ]


class _GArgs(ctypes.Structure):
    """The gather's ``struct GArgs`` (cpu_decode.cpp), field for field."""

    _fields_ = [
        *[(n, ctypes.c_int64) for n in ("n", "H", "D", "block_size", "elem", "threads")],
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        *_PAGES,
        ("packed_table", ctypes.c_void_p),
        ("window_table", ctypes.c_void_p),
        ("src", ctypes.c_void_p),
        ("width", ctypes.c_int64),
        ("out_table", ctypes.c_void_p),
        ("out_block", ctypes.c_int64),
        ("ks", ctypes.c_int64 * 4),
        ("vs", ctypes.c_int64 * 4),
        ("window_block", ctypes.c_int64),
        ("first", ctypes.c_int64),
    ]


class _PArgs(ctypes.Structure):
    """The put's ``struct PArgs`` (cpu_decode.cpp), field for field."""

    _fields_ = [
        *[(n, ctypes.c_int64) for n in ("n", "H", "D", "elem", "threads")],
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("k_stride", ctypes.c_int64),
        ("v_stride", ctypes.c_int64),
        ("kout", ctypes.c_void_p),
        ("vout", ctypes.c_void_p),
        ("out_block", ctypes.c_int64),
        ("ks", ctypes.c_int64 * 4),
        ("vs", ctypes.c_int64 * 4),
        ("slots", ctypes.c_void_p),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    lib.leank_cpu_decode.restype = ctypes.c_int
    lib.leank_cpu_decode.argtypes = [ctypes.POINTER(_Args)]
    lib.leank_cpu_write.restype = ctypes.c_int
    lib.leank_cpu_write.argtypes = [ctypes.POINTER(_WArgs)]
    lib.leank_cpu_gather.restype = ctypes.c_int
    lib.leank_cpu_gather.argtypes = [ctypes.POINTER(_GArgs)]
    lib.leank_cpu_put.restype = ctypes.c_int
    lib.leank_cpu_put.argtypes = [ctypes.POINTER(_PArgs)]


LIBRARY = NativeLibrary(SOURCE_PATH, "vllm-kernel", ENV_SWITCH, "CPU decode kernel", _declare, log)


def build(extra: list[str] | None = None, directory: Path | None = None) -> Path:
    """Compile the kernel (or reuse the cached build) and return the library's path; raises on failure.

    ``extra`` flags (e.g. ``-fsanitize=address``) are tried alone, without the fallbacks."""
    return LIBRARY.build(extra, directory)


def available() -> bool:
    """Whether the kernel is built and switched on (``LEANK_VLLM_CPU_KERNEL`` not ``0``); the first call builds it."""
    return LIBRARY.available()


def supports(
    q: torch.Tensor, packed: torch.Tensor, window: torch.Tensor, fp8: torch.dtype | None = None
) -> bool:
    """Whether the kernel covers these tensors (CPU, a dtype it reads, rows contiguous in each block)."""
    return (
        (packed.dtype == torch.uint8) == (fp8 in (torch.float8_e4m3fn, torch.float8_e5m2))
        and q.device.type == "cpu"
        and q.dtype in _Q_TYPES
        and packed.dtype in _KV_TYPES
        and window.dtype == packed.dtype
        and packed.device.type == "cpu"
        and window.device.type == "cpu"
        and packed.stride(2) == 1
        and packed.stride(1) == packed.shape[2]
        and window.stride(2) == 1
        and window.stride(1) == window.shape[2]
    )


def supports_write(
    packed: torch.Tensor, window: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fp8: torch.dtype | None = None
) -> bool:
    """Whether :func:`write` covers these tensors: CPU pages of the model's own 2- or 4-byte dtype (fp8 pages take
    the PyTorch write: they need the scales and a rounding), rows contiguous in each block and in K/V."""
    return pages_writable(packed, window, fp8) and kv_writable(packed, k, v)


def pages_writable(packed: torch.Tensor, window: torch.Tensor, fp8: torch.dtype | None = None) -> bool:
    """The pages' half of :func:`supports_write` (an engine's pages keep it: a bound layer checks it once)."""
    return (
        fp8 is None
        and packed.device.type == "cpu"
        and window.device.type == "cpu"
        and packed.dtype == window.dtype
        and packed.element_size() in (2, 4)
        and packed.stride(2) == 1
        and window.stride(2) == 1
    )


def kv_writable(packed: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The step's half of :func:`supports_write`: K/V on the CPU in the pages' dtype, each token's ``[Hkv, D]`` one
    run (tokens may lie apart: a fused QKV's)."""
    return (
        k.device.type == "cpu"
        and v.device.type == "cpu"
        and k.dtype == v.dtype == packed.dtype
        and k.stride(2) == 1
        and v.stride(2) == 1
        and k.stride(1) == k.shape[2]
        and v.stride(1) == v.shape[2]
    )


def write(
    packed: torch.Tensor,
    packed_slots: torch.Tensor,
    window: torch.Tensor,
    window_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot: LayerSlot,
) -> None:
    """:func:`leank_infer.vllm.paged_reference.write_pages` in one call (no fp8: see :func:`supports_write`):
    the step's K/V ``[n, Hkv, D]`` into this layer's packed rows and, where the window block is real, rest rows."""
    LayerKernel(slot, packed, window).write(packed_slots, window_slots, k, v)


def supports_gather(packed: torch.Tensor, window: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`gather` covers these pages: CPU pages of ``dtype`` itself, 2 or 4 bytes (fp8 pages, bytes, take
    the PyTorch gather: they need the scales), rows contiguous in each block."""
    return (
        packed.device.type == "cpu"
        and window.device.type == "cpu"
        and packed.dtype == window.dtype == dtype
        and packed.element_size() in (2, 4)
        and packed.stride(2) == 1
        and window.stride(2) == 1
    )


def gather(
    packed: torch.Tensor,
    packed_table: torch.Tensor,
    window: torch.Tensor,
    window_table: torch.Tensor,
    n: int,
    slot: LayerSlot,
    k: torch.Tensor,
    v: torch.Tensor,
    out_table: torch.Tensor | None = None,
    first: int = 0,
) -> None:
    """:func:`leank_infer.vllm.paged_reference.full_rows` of a request's tokens ``[first, first + n)`` in one call,
    into ``k`` and ``v`` (the pages' dtype): every token's packed row and rest row put together (its window block must
    be real, as every prompt block is under the dense-prompt rule while it is computed). The tables are the request's
    from its first token (the two stores' blocks may hold different numbers of tokens). ``k``/``v`` are dense rows
    ``[>= n, Hkv, D]``, contiguous; or, with ``out_table`` (int32), pages ``[blocks, Hkv, block, D]`` of any strides
    (vLLM's CPU pages, K transposed in a block), token ``first + t`` at place ``t % block`` of block
    ``out_table[t // block]``."""
    if not available():
        raise RuntimeError("the LeanK CPU decode kernel is not available (see leank_infer.vllm.cpu_decode)")
    if out_table is None:
        if not (k.dim() == v.dim() == 3 and k.is_contiguous() and v.is_contiguous() and min(k.shape[0], v.shape[0]) >= n):
            raise ValueError(f"gather needs contiguous K/V rows [>= {n}, Hkv, D], got {tuple(k.shape)} {tuple(v.shape)}")
        k, v = k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)  # one block of every row
        out_table = torch.zeros(1, dtype=torch.int32)
    blocks = -(-n // max(k.shape[2], 1))
    ok = k.dim() == 4 and k.shape == v.shape and out_table.dtype == torch.int32 and out_table.is_contiguous()
    if ok and blocks:
        ok = out_table.numel() >= blocks and 0 <= int(out_table[:blocks].min()) <= int(out_table[:blocks].max()) < k.shape[0]
    if not ok:
        raise ValueError(
            f"gather's paged K/V need one shape [blocks, Hkv, block, D] and an int32 table of their blocks for {n} "
            f"tokens, got K {tuple(k.shape)}, V {tuple(v.shape)}, table {out_table.dtype} {tuple(out_table.shape)}"
        )
    if not (k.dtype == v.dtype == packed.dtype and 2 * k.shape[1] * k.shape[3] == slot.layout.full_columns.numel()):
        raise ValueError(f"gather needs K/V of {packed.dtype} with this layer's heads and channels, got {k.dtype} "
                         f"{tuple(k.shape)}")  # fmt: skip
    need = [-(-(first + n) // pages.shape[1]) for pages in (packed, window)]  # blocks of each table it reads
    if first < 0 or need[0] > packed_table.shape[-1] or need[1] > window_table.shape[-1]:
        raise ValueError(
            f"gather of tokens [{first}, {first + n}) needs a first token >= 0 and tables of at least {need[0]} packed "
            f"and {need[1]} window blocks, got {packed_table.shape[-1]} and {window_table.shape[-1]}"
        )
    if n == 0:
        return
    src = _per_slot(_gather_cache, slot, lambda s: s.layout.full_columns.to("cpu", torch.int64).contiguous())
    ptable, wtable = _table(packed_table), _table(window_table)
    a = _GArgs()
    a.n, a.H, a.D, a.block_size, a.elem = n, k.shape[1], k.shape[3], packed.shape[1], packed.element_size()
    a.threads = torch.get_num_threads()
    a.k, a.v = k.data_ptr(), v.data_ptr()
    _set_pages(a, packed, window, slot)
    a.packed_table, a.window_table = ptable.data_ptr(), wtable.data_ptr()
    a.src, a.width = src.data_ptr(), slot.layout.width
    a.out_table, a.out_block = out_table.data_ptr(), k.shape[2]
    a.ks[:], a.vs[:] = k.stride(), v.stride()
    a.first = first
    if LIBRARY.lib.leank_cpu_gather(ctypes.byref(a)):
        raise RuntimeError(f"the LeanK CPU gather got bad arguments ({n} tokens for {slot.layout})")


def supports_put(k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
    """Whether :func:`put` covers these tensors: CPU K/V rows ``[n, H, D]`` (each token's ``[H, D]`` one run) into
    pages ``[blocks, H, block, D]`` of the same dtype, 2 or 4 bytes."""
    return (
        all(t.device.type == "cpu" and t.dtype == k.dtype for t in (v, k_pages, v_pages))
        and k.element_size() in (2, 4)
        and k.dim() == v.dim() == 3
        and k.shape == v.shape
        and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
        and k_pages.dim() == v_pages.dim() == 4
        and k_pages.shape == v_pages.shape
        and k_pages.shape[1] == k.shape[1]
        and k_pages.shape[3] == k.shape[2]
    )


def put(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> None:
    """K/V rows ``[n, H, D]`` into pages ``[blocks, H, block, D]`` of any strides (vLLM's CPU pages: K transposed in a
    block), token ``i`` at place ``slots[i] % block`` of block ``slots[i] // block`` (a negative slot: not written):
    vLLM's ``cpu_attn_reshape_and_cache`` for its ``vec`` layout, split over the threads (:func:`supports_put`)."""
    if not available():
        raise RuntimeError("the LeanK CPU decode kernel is not available (see leank_infer.vllm.cpu_decode)")
    n = k.shape[0] if k.dim() == 3 else -1
    slots = _slots(slots)
    if not supports_put(k, v, k_pages, v_pages) or slots.numel() != n or (
        n and int(slots.max()) >= k_pages.shape[0] * k_pages.shape[2]
    ):
        raise ValueError(
            f"put needs K/V rows [n, H, D] and n slots inside pages [blocks, H, block, D] of their dtype, got "
            f"{tuple(k.shape)} {tuple(v.shape)} {k.dtype}, {slots.numel()} slots, pages {tuple(k_pages.shape)} "
            f"{k_pages.dtype}"
        )
    a = _PArgs()
    a.n, a.H, a.D, a.elem, a.threads = n, k.shape[1], k.shape[2], k.element_size(), torch.get_num_threads()
    a.k, a.v, a.k_stride, a.v_stride = k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0)
    a.kout, a.vout, a.out_block = k_pages.data_ptr(), v_pages.data_ptr(), k_pages.shape[2]
    a.ks[:], a.vs[:] = k_pages.stride(), v_pages.stride()
    a.slots = slots.data_ptr()
    if LIBRARY.lib.leank_cpu_put(ctypes.byref(a)):
        raise RuntimeError(f"the LeanK CPU put got bad arguments ({n} tokens into pages {tuple(k_pages.shape)})")


def _set_pages(a: _WArgs | _GArgs, packed: torch.Tensor, window: torch.Tensor, slot: LayerSlot) -> None:
    """The pages' fields of the write's or the gather's arguments: this layer's columns start at its offsets into
    the rows (``slot``'s), rows ``stride(1)`` elements apart."""
    item = packed.element_size()
    a.packed = packed.data_ptr() + slot.packed_offset * item
    a.window = window.data_ptr() + slot.window_offset * item
    a.packed_block_stride, a.packed_row = packed.stride(0), packed.stride(1)
    a.window_block_stride, a.window_row = window.stride(0), window.stride(1)
    a.window_block = window.shape[1]


def _per_slot(cache: dict[int, tuple[LayerSlot, Any]], slot: LayerSlot, build: Callable[[LayerSlot], Any]) -> Any:
    """``build(slot)``, once per layer slot (keyed by ``id``; a reused id of a slot that is gone builds anew)."""
    hit = cache.get(id(slot))
    if hit is None or hit[0] is not slot:
        hit = cache[id(slot)] = (slot, build(slot))
    return hit[1]


_gather_cache: dict[int, tuple[LayerSlot, torch.Tensor]] = {}


def _slots(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


_write_cache: dict[int, tuple[LayerSlot, tuple[_WArgs, tuple[torch.Tensor, ...]]]] = {}


def _write_layout(slot: LayerSlot) -> tuple[_WArgs, tuple[torch.Tensor, ...]]:
    """The write's constant part for one layer: its kept K columns and V columns (built once)."""
    return _per_slot(_write_cache, slot, _build_write_layout)


def _build_write_layout(slot: LayerSlot) -> tuple[_WArgs, tuple[torch.Tensor, ...]]:
    k_index, v_index, kr_index, vr_index = (
        x.to("cpu", torch.int64).contiguous()
        for x in (slot.layout.k_index, slot.layout.v_index, slot.layout.kr_index, slot.layout.vr_index)
    )
    keep = (k_index, v_index, kr_index, vr_index)
    a = _WArgs()
    a.k_index, a.v_index = k_index.data_ptr(), v_index.data_ptr()
    a.nk, a.nv = k_index.numel(), v_index.numel()
    a.kr_index, a.vr_index = kr_index.data_ptr(), vr_index.data_ptr()
    a.nkr, a.nvr = kr_index.numel(), vr_index.numel()
    return a, keep


_layer_cache: dict[int, tuple[LayerSlot, tuple[_Args, tuple[torch.Tensor, ...]]]] = {}
_luts: dict[torch.dtype, torch.Tensor] = {}


def _lut(fp8: torch.dtype) -> torch.Tensor:
    if fp8 not in _luts:
        _luts[fp8] = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    return _luts[fp8]


def _layer(plan: WorkerPlan, slot: LayerSlot) -> tuple[_Args, tuple[torch.Tensor, ...]]:
    """The call's constant part for one layer (built once: the kept columns of each head and the rule's sizes)."""
    return _per_slot(_layer_cache, slot, lambda s: _build_layer(plan, s))


def _build_layer(plan: WorkerPlan, slot: LayerSlot) -> tuple[_Args, tuple[torch.Tensor, ...]]:
    layout, d, hkv = slot.layout, plan.head_dim, plan.num_kv_heads
    heads = layout.k_index // d
    k_off = torch.cat([torch.zeros(1, dtype=torch.long), torch.bincount(heads, minlength=hkv).cumsum(0)])
    k_ch = (layout.k_index % d).contiguous()
    if k_ch.numel() == 0:
        k_ch = torch.zeros(1, dtype=torch.long)
    v_col = torch.full((hkv,), -1, dtype=torch.long)
    for i, h in enumerate(layout.v_heads):
        v_col[h] = layout.k_index.numel() + i * d
    # the rest row: dropped K channels per head, then the V of each head keeping none
    kr = layout.kr_index.cpu()
    rk_off = torch.cat([torch.zeros(1, dtype=torch.long), torch.bincount(kr // d, minlength=hkv).cumsum(0)])
    rk_ch = (kr % d).contiguous() if kr.numel() else torch.zeros(1, dtype=torch.long)
    rv_col = torch.full((hkv,), -1, dtype=torch.long)
    for i, h in enumerate(layout.rest_v_heads):
        rv_col[h] = kr.numel() + i * d
    a = _Args()
    a.Hkv, a.D, a.block_size = hkv, d, plan.block_size
    a.packed_offset, a.window_offset = slot.packed_offset, slot.window_offset
    a.k_off, a.k_ch, a.v_col = k_off.data_ptr(), k_ch.data_ptr(), v_col.data_ptr()
    a.rk_off, a.rk_ch, a.rv_col = rk_off.data_ptr(), rk_ch.data_ptr(), rv_col.data_ptr()
    a.sink, a.recent, a.accumu = plan.sink, plan.recent, plan.accumu
    a.split = SPLIT
    keep = (k_off, k_ch, v_col, rk_off, rk_ch, rv_col)
    return a, keep


def _table(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int32 or t.stride(-1) != 1:
        t = t.to(torch.int32).contiguous()
    return t


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
    runs: torch.Tensor | None = None,
) -> torch.Tensor:
    """LeanK attention ``[B, Hq, D]`` (q's dtype) of one new query per row, its K/V already in the pages;
    the arguments of :func:`leank_infer.vllm.kernels.decode`, and ``runs`` as :meth:`LayerKernel.decode` takes it.
    Needs :func:`available` and :func:`supports`."""
    return LayerKernel(slot, packed, window, plan, scale, k_scale, v_scale, fp8).decode(
        q, packed_table, window_table, seq_lens, runs=runs
    )


class LayerKernel:
    """The library's write and decode of one layer over its pages, the arguments that do not change from step
    to step (the layer's columns, the pages and their strides, the rule's sizes, the dtypes and scales) put in
    place once: the engine calls a layer's write and decode every step, where building every field anew cost
    more than the write itself (``benchmarks/vllm_profile.py``: the time around the kernel). Needs
    :func:`available`, :func:`supports` for the decode and :func:`supports_write` for the write; ``plan`` only for
    the decode. It holds the pages (views of vLLM's pool), so they live as long as it does."""

    def __init__(
        self,
        slot: LayerSlot,
        packed: torch.Tensor,
        window: torch.Tensor,
        plan: WorkerPlan | None = None,
        scale: float = 1.0,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        fp8: torch.dtype | None = None,
    ) -> None:
        if not available():
            raise RuntimeError("the LeanK CPU decode kernel is not available (see leank_infer.vllm.cpu_decode)")
        self.slot, self.packed, self.window = slot, packed, window
        const, self._keep = _write_layout(slot)
        w = self._write = _WArgs.from_buffer_copy(const)
        w.block_size, w.elem, w.width = packed.shape[1], packed.element_size(), slot.layout.width
        _set_pages(w, packed, window, slot)
        if plan is None:
            return
        const, self._keep_decode = _layer(plan, slot)
        a = self._decode = _Args.from_buffer_copy(const)
        a.packed, a.window = packed.data_ptr(), window.data_ptr()
        a.packed_block_stride, a.packed_row = packed.stride(0), packed.shape[2]
        a.window_block_stride, a.window_row = window.stride(0), window.shape[2]
        a.window_block = window.shape[1]
        a.scale = scale
        if fp8 is not None:
            self._lut = _lut(fp8)
            a.kv_type, a.lut, a.k_scale, a.v_scale = 3, self._lut.data_ptr(), k_scale, v_scale
        else:
            a.kv_type, a.k_scale, a.v_scale = _KV_TYPES[packed.dtype], 1.0, 1.0

    def write(self, packed_slots: torch.Tensor, window_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's K/V ``[n, Hkv, D]`` (rows contiguous) into the layer's packed rows and real window rows."""
        a = _WArgs.from_buffer_copy(self._write)  # a fresh copy: calls from several threads never share one
        ps, ws = _slots(packed_slots), _slots(window_slots)
        a.n, a.HD = k.shape[0], k.shape[1] * k.shape[2]
        a.k, a.v, a.k_stride, a.v_stride = k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0)
        a.packed_slots, a.window_slots = ps.data_ptr(), ws.data_ptr()
        a.threads = torch.get_num_threads()
        if LIBRARY.lib.leank_cpu_write(ctypes.byref(a)):
            raise RuntimeError(
                f"the LeanK CPU write got bad arguments (packed row {self.packed.shape[2]} for {self.slot.layout})"
            )

    def decode(
        self,
        q: torch.Tensor,
        packed_table: torch.Tensor,
        window_table: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor | None = None,
        runs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention ``[B, Hq, D]`` of one new query per row (B = ``q.shape[0]``: the tables and lengths may
        have more rows, the first B are read), into ``out`` when given (else a new tensor of q's dtype).

        ``runs`` (int32 ``[B]``, optional): rows ``[b, b + n)`` with ``runs[b] = n > 1`` and 0 after are ``n`` queries
        of one request at consecutive positions, over the same tables (speculative drafts); 1 marks a row alone. The
        keys all of them score with the kept channels are then read once for the ``n`` (:func:`runs_of`)."""
        b, hq, d = q.shape
        a = _Args.from_buffer_copy(self._decode)
        if runs is not None:
            if runs.dtype != torch.int32 or runs.device.type != "cpu" or not runs.is_contiguous() or runs.numel() < b:
                raise ValueError(
                    f"runs must be int32 on the CPU, contiguous, one per row ({b}), got {runs.dtype} on {runs.device} "
                    f"{tuple(runs.shape)}"
                )
            a.runs = runs.data_ptr()
        q = q if q.is_contiguous() else q.contiguous()
        packed_table, window_table = _table(packed_table), _table(window_table)
        if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
            seq_lens = seq_lens.to(torch.int32).contiguous()
        direct = out is not None and out.dtype == torch.float32 and out.is_contiguous() and out.shape == q.shape
        res = out if direct else torch.empty((b, hq, d), dtype=torch.float32)
        a.B, a.Hq = b, hq
        a.q, a.out, a.q_type = q.data_ptr(), res.data_ptr(), _Q_TYPES[q.dtype]
        a.packed_table, a.window_table = packed_table.data_ptr(), window_table.data_ptr()
        a.packed_table_stride, a.window_table_stride = packed_table.stride(0), window_table.stride(0)
        a.seq_lens = seq_lens.data_ptr()
        a.threads = torch.get_num_threads()
        rc = LIBRARY.lib.leank_cpu_decode(ctypes.byref(a))
        if rc:
            raise RuntimeError(
                f"the LeanK CPU decode kernel failed (code {rc}: 1 out of memory, 2 bad arguments: a run's rows must be "
                "consecutive positions)"
            )
        if out is None:
            return res if q.dtype == torch.float32 else res.to(q.dtype)
        if not direct:
            out.copy_(res)
        return out


def runs_of(lengths: list[int]) -> torch.Tensor:
    """The ``runs`` argument of :meth:`LayerKernel.decode` for rows in groups of ``lengths`` (one request's consecutive
    queries each; 1: a row alone)."""
    out: list[int] = []
    for n in lengths:
        out += [n] + [0] * (n - 1)
    return torch.tensor(out, dtype=torch.int32)
