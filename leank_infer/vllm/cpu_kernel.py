"""A fused CPU kernel for the batched LeanK decode over vLLM's packed pages (fp32), built at first use.

:func:`~leank_infer.vllm.paged_decode.paged_decode_batch` in PyTorch makes three passes over the
middle's packed rows (a gather of the request's pages into one batch, then one product with the K
part and one with the V part) where vLLM's C++ kernel makes one over its larger dense rows; at 8k
tokens that extra traffic, not Python, is what made LeanK's layer slower than vLLM's. This kernel
reads each row once, in place through the block table: per (request, KV head) it scores the
head's kept K channels of a block's rows, updates an online softmax tile by tile, and adds the
head's V, after the full-channel sink and recent keys of the side store; the result is the same
attention as the PyTorch path (fp32 rounding apart: tests compare them).

It is plain C (no PyTorch headers: a build takes about a second), compiled with the system C
compiler (``$CC``, else ``cc``) into ``~/.cache/leank/vllm-kernel/`` (or ``$LEANK_CACHE``) the first
time a LeanK layer decodes, keyed by the source's hash, and called through ctypes; it is
single-threaded. Where no compiler works, for other dtypes, or with ``LEANK_VLLM_CPU_KERNEL=0``,
the backend keeps the PyTorch path (:func:`available` says which; a failed build is logged once).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .layout import PackedLayout

log = logging.getLogger(__name__)

ENV_SWITCH = "LEANK_VLLM_CPU_KERNEL"

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 128 /* tokens scored before one rescale of the accumulators */

typedef float v8 __attribute__((vector_size(32), aligned(4))); /* 8 floats, unaligned loads allowed */

/* acc[g][0..D) += sum_t s[g][t] * v_t for the G query heads of one KV head (G known at compile time):
   16 channels of every query head stay in registers across the tile, and each value row's cache line
   is read once. */
#define VACC(GG)                                                                                       \
    static void vacc_##GG(int64_t D, int64_t n, const float *s, const float **vr, float *acc) {        \
        for (int64_t d0 = 0; d0 < D; d0 += 16) {                                                       \
            v8 r0[GG], r1[GG];                                                                         \
            for (int g = 0; g < GG; g++) {                                                             \
                r0[g] = *(const v8 *)(acc + g * D + d0);                                               \
                r1[g] = *(const v8 *)(acc + g * D + d0 + 8);                                           \
            }                                                                                          \
            for (int64_t t = 0; t < n; t++) {                                                          \
                const v8 a = *(const v8 *)(vr[t] + d0), b = *(const v8 *)(vr[t] + d0 + 8);             \
                for (int g = 0; g < GG; g++) {                                                         \
                    const float p = s[g * TILE + t];                                                   \
                    r0[g] += p * a;                                                                    \
                    r1[g] += p * b;                                                                    \
                }                                                                                      \
            }                                                                                          \
            for (int g = 0; g < GG; g++) {                                                             \
                *(v8 *)(acc + g * D + d0) = r0[g];                                                     \
                *(v8 *)(acc + g * D + d0 + 8) = r1[g];                                                 \
            }                                                                                          \
        }                                                                                              \
    }
VACC(1) VACC(2) VACC(3) VACC(4) VACC(5) VACC(6) VACC(7) VACC(8)

/* s[g * TILE] = q_g . k over nk kept channels (nk % 8 == 0) for the G query heads of one KV head:
   each 8-channel piece of the key is loaded once for all G. */
#define KDOT(GG)                                                                                       \
    static void kdot_##GG(int64_t nk, int64_t D, const float *q, const float *k, float *s) {           \
        v8 z[GG];                                                                                      \
        for (int g = 0; g < GG; g++) z[g] = (v8){0};                                                   \
        for (int64_t c = 0; c < nk; c += 8) {                                                          \
            const v8 kv = *(const v8 *)(k + c);                                                        \
            for (int g = 0; g < GG; g++) z[g] += *(const v8 *)(q + g * D + c) * kv;                    \
        }                                                                                              \
        for (int g = 0; g < GG; g++)                                                                   \
            s[g * TILE] = z[g][0] + z[g][1] + z[g][2] + z[g][3] + z[g][4] + z[g][5] + z[g][6] + z[g][7]; \
    }
KDOT(1) KDOT(2) KDOT(3) KDOT(4) KDOT(5) KDOT(6) KDOT(7) KDOT(8)

/* Online softmax over a tile of n keys for the query heads qh with live[qh]: scores s[qh * TILE + t],
   values vrows[h * TILE + t] (h = qh / G) folded into max m, sum l and accumulator acc[qh * D ...]. */
static void fold(int64_t Hq, int64_t G, int64_t D, int64_t n, const char *live, float *s,
                 const float **vrows, float *m, float *l, float *acc) {
    for (int64_t qh = 0; qh < Hq; qh++) {
        if (!live[qh]) continue;
        float *sq = s + qh * TILE;
        float mx = m[qh];
        for (int64_t t = 0; t < n; t++) mx = sq[t] > mx ? sq[t] : mx;
        const float c = expf(m[qh] - mx); /* first tile: exp(-1e30) = 0 */
        float sum = 0.f;
        for (int64_t t = 0; t < n; t++) { const float p = expf(sq[t] - mx); sq[t] = p; sum += p; }
        l[qh] = l[qh] * c + sum;
        m[qh] = mx;
        float *a = acc + qh * D;
        for (int64_t d = 0; d < D; d++) a[d] *= c;
    }
    /* acc += p @ V, per KV head for its G query heads */
    for (int64_t h = 0; h < Hq / G; h++) {
        if (!live[h * G]) continue;
        const float *sh = s + h * G * TILE;
        const float **vr = vrows + h * TILE;
        float *ah = acc + h * G * D;
        if (D % 16 == 0 && G <= 8) {
            switch (G) {
                case 1: vacc_1(D, n, sh, vr, ah); break;
                case 2: vacc_2(D, n, sh, vr, ah); break;
                case 3: vacc_3(D, n, sh, vr, ah); break;
                case 4: vacc_4(D, n, sh, vr, ah); break;
                case 5: vacc_5(D, n, sh, vr, ah); break;
                case 6: vacc_6(D, n, sh, vr, ah); break;
                case 7: vacc_7(D, n, sh, vr, ah); break;
                default: vacc_8(D, n, sh, vr, ah); break;
            }
            continue;
        }
        for (int64_t t = 0; t < n; t++) {
            const float *v = vr[t];
            for (int64_t g = 0; g < G; g++) {
                const float p = sh[g * TILE + t];
                float *a = ah + g * D;
                for (int64_t d = 0; d < D; d++) a[d] += p * v[d];
            }
        }
    }
}

int leank_paged_decode_f32(
    int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
    const float *q,                                /* [B, Hq, D] */
    const float *full_k, const float *full_v,      /* [B, F, Hkv, D] */
    int64_t F, const int64_t *full_len,            /* [B] */
    const float *pages, int64_t bs, int64_t width, /* the pool's rows: [num_blocks * bs, width] */
    const int32_t *block_table, int64_t bt_stride, /* [B, bt_stride] */
    int64_t mid_start, const int64_t *mid_end,     /* middle of request b: [mid_start, mid_end[b]) */
    const int64_t *k_off, /* [Hkv + 1]: head h's kept K columns are [k_off[h], k_off[h + 1]) of a row */
    const int64_t *k_ch,  /* [nk]: their channels */
    const int64_t *v_col, /* [Hkv]: first column of head h's V in a row, or -1 (the head skips the middle) */
    float scale, float *out) /* [B, Hq, D] */
{
    const int64_t G = Hq / Hkv;
    float *buf = malloc(sizeof(float) * (size_t)(Hq * TILE + 3 * Hq * D + 2 * Hq));
    const float **vrows = malloc(sizeof(float *) * (size_t)(Hkv * TILE));
    char *all = malloc((size_t)Hq), *mid = malloc((size_t)Hq);
    if (!buf || !vrows || !all || !mid) { free(buf); free(vrows); free(all); free(mid); return 1; }
    float *s = buf, *acc = s + Hq * TILE, *qs = acc + Hq * D, *qk = qs + Hq * D, *m = qk + Hq * D, *l = m + Hq;
    for (int64_t qh = 0; qh < Hq; qh++) { all[qh] = 1; mid[qh] = v_col[qh / G] >= 0; }
    for (int64_t b = 0; b < B; b++) {
        for (int64_t qh = 0; qh < Hq; qh++) {
            const int64_t h = qh / G, c0 = k_off[h], nkh = k_off[h + 1] - c0;
            for (int64_t d = 0; d < D; d++) qs[qh * D + d] = q[(b * Hq + qh) * D + d] * scale;
            for (int64_t c = 0; c < nkh; c++) qk[qh * D + c] = qs[qh * D + k_ch[c0 + c]];
            m[qh] = -1e30f; /* finite: the build assumes finite math (vectorised expf) */ l[qh] = 0.f;
        }
        memset(acc, 0, sizeof(float) * (size_t)(Hq * D));
        /* sink and recent keys: every channel */
        for (int64_t j0 = 0; j0 < full_len[b]; j0 += TILE) {
            const int64_t n = full_len[b] - j0 < TILE ? full_len[b] - j0 : TILE;
            for (int64_t t = 0; t < n; t++) {
                for (int64_t h = 0; h < Hkv; h++) {
                    const int64_t off = ((b * F + j0 + t) * Hkv + h) * D;
                    vrows[h * TILE + t] = full_v + off;
                    for (int64_t g = 0; g < G; g++) {
                        const float *qq = qs + (h * G + g) * D, *k = full_k + off;
                        float dot = 0.f;
                        for (int64_t d = 0; d < D; d++) dot += qq[d] * k[d];
                        s[(h * G + g) * TILE + t] = dot;
                    }
                }
            }
            fold(Hq, G, D, n, all, s, vrows, m, l, acc);
        }
        /* middle keys: the kept channels, read in place from the packed rows through the block table */
        for (int64_t p0 = mid_start; p0 < mid_end[b];) {
            const int64_t blk = block_table[b * bt_stride + p0 / bs], in = p0 % bs;
            int64_t n = bs - in;
            if (n > mid_end[b] - p0) n = mid_end[b] - p0;
            if (n > TILE) n = TILE;
            const float *row = pages + (blk * bs + in) * width;
            for (int64_t t = 0; t < n; t++, row += width) {
                for (int64_t h = 0; h < Hkv; h++) {
                    if (v_col[h] < 0) continue;
                    const int64_t c0 = k_off[h], nkh = k_off[h + 1] - c0;
                    vrows[h * TILE + t] = row + v_col[h];
                    if (nkh % 8 == 0 && G <= 8) {
                        const float *qh = qk + h * G * D, *k = row + c0;
                        float *sh = s + h * G * TILE + t;
                        switch (G) {
                            case 1: kdot_1(nkh, D, qh, k, sh); break;
                            case 2: kdot_2(nkh, D, qh, k, sh); break;
                            case 3: kdot_3(nkh, D, qh, k, sh); break;
                            case 4: kdot_4(nkh, D, qh, k, sh); break;
                            case 5: kdot_5(nkh, D, qh, k, sh); break;
                            case 6: kdot_6(nkh, D, qh, k, sh); break;
                            case 7: kdot_7(nkh, D, qh, k, sh); break;
                            default: kdot_8(nkh, D, qh, k, sh); break;
                        }
                        continue;
                    }
                    for (int64_t g = 0; g < G; g++) {
                        const float *qq = qk + (h * G + g) * D, *k = row + c0;
                        float dot = 0.f;
                        for (int64_t c = 0; c < nkh; c++) dot += qq[c] * k[c];
                        s[(h * G + g) * TILE + t] = dot;
                    }
                }
            }
            fold(Hq, G, D, n, mid, s, vrows, m, l, acc);
            p0 += n;
        }
        for (int64_t qh = 0; qh < Hq; qh++) {
            const float inv = 1.f / l[qh];
            for (int64_t d = 0; d < D; d++) out[(b * Hq + qh) * D + d] = acc[qh * D + d] * inv;
        }
    }
    free(buf); free(vrows); free(all); free(mid);
    return 0;
}
"""

_FLAGS = ["-O3", "-march=native", "-ffast-math"]
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("LEANK_CACHE") or str(Path.home() / ".cache" / "leank")
    return Path(root) / "vllm-kernel"


def _build() -> ctypes.CDLL | None:
    """Compile (once per source and flags) and load the kernel; ``None`` when that fails (logged)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("LeanK: no C compiler found; the vLLM CPU decode keeps its PyTorch path")
        return None
    key = hashlib.sha256((SOURCE + " ".join(_FLAGS) + cc).encode()).hexdigest()[:16]
    lib_path = _cache_dir() / f"leank_paged_{key}.so"
    try:
        if not lib_path.exists():
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
                src = Path(tmp) / "leank_paged.c"
                src.write_text(SOURCE)
                so = Path(tmp) / lib_path.name
                subprocess.run(
                    [cc, *_FLAGS, "-shared", "-fPIC", "-o", str(so), str(src), "-lm"],
                    check=True, capture_output=True, text=True,
                )  # fmt: skip
                os.replace(so, lib_path)  # atomic: concurrent builders never load half a file
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning(
            "LeanK: building the vLLM CPU decode kernel failed (PyTorch path kept): %s", detail[-2000:]
        )
        return None
    fn = lib.leank_paged_decode_f32
    fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the fused kernel is built and switched on (``LEANK_VLLM_CPU_KERNEL`` not ``0``)."""
    global _lib, _tried
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    if not _tried:
        _tried = True
        _lib = _build()
    return _lib is not None


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def kernel_tensors(layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k_off`` ``[Hkv + 1]``, ``k_ch`` ``[nk]``, ``v_col`` ``[Hkv]`` of a layout (the kernel's view of a packed row)."""
    d, hkv = layout.head_dim, layout.num_kv_heads
    heads = layout.k_index // d
    counts = torch.bincount(heads, minlength=hkv)
    k_off = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    nk = layout.k_index.numel()
    v_col = torch.full((hkv,), -1, dtype=torch.long)
    for i, h in enumerate(layout.v_heads):
        v_col[h] = nk + i * d
    return k_off, (layout.k_index % d).contiguous(), v_col


def cpu_paged_decode_batch(
    q: torch.Tensor,
    full_k: torch.Tensor,
    full_v: torch.Tensor,
    full_len: torch.Tensor,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    mid_start: int,
    mid_end: list[int],
    layout: PackedLayout,
    scale: float,
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`~leank_infer.vllm.paged_decode.paged_decode_batch` (same arguments; fp32 CPU tensors) in one
    kernel call; ``tensors``: :func:`kernel_tensors` of the layout, cached by the caller."""
    if not available():
        raise RuntimeError("the LeanK CPU kernel is not available (see leank_infer.vllm.cpu_kernel)")
    b, hq, d = q.shape
    k_off, k_ch, v_col = tensors if tensors is not None else kernel_tensors(layout)
    q = q.contiguous()
    full_k, full_v = full_k.contiguous(), full_v.contiguous()
    full_len = full_len.to(torch.long).contiguous()
    ends = torch.tensor(mid_end, dtype=torch.long)
    table = block_table.to(torch.int32)
    if table.stride(-1) != 1:
        table = table.contiguous()
    if (
        pages.stride(-1) != 1
        or pages.stride(1) != pages.shape[-1]
        or pages.stride(0) != pages.shape[1] * pages.shape[2]
    ):
        raise ValueError("pages must be contiguous rows [num_blocks, block_size, width]")
    out = torch.empty_like(q)
    rc = _lib.leank_paged_decode_f32(
        ctypes.c_int64(b), ctypes.c_int64(hq), ctypes.c_int64(layout.num_kv_heads), ctypes.c_int64(d),
        _ptr(q), _ptr(full_k), _ptr(full_v), ctypes.c_int64(full_k.shape[1]), _ptr(full_len),
        _ptr(pages), ctypes.c_int64(pages.shape[1]), ctypes.c_int64(pages.shape[2]),
        _ptr(table), ctypes.c_int64(table.stride(0)), ctypes.c_int64(mid_start), _ptr(ends),
        _ptr(k_off), _ptr(k_ch), _ptr(v_col), ctypes.c_float(scale), _ptr(out),
    )  # fmt: skip
    if rc:
        raise MemoryError("LeanK CPU kernel: out of memory for its work buffers")
    return out
