// LeanK decode over vLLM's LeanK pages on the CPU: one call per layer for every decode request of a step.
// Plain C++ (no PyTorch or Python headers), built by leank_infer/vllm/cpu_decode.py and called through ctypes.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

#define TILE 128  // keys scored before one rescale of the accumulators
#define GMAX 8    // query heads of one KV head kept in registers at once

typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

struct Args {  // mirrored by _Args in cpu_decode.py: keep the order
    int64_t B, Hq, Hkv, D, block_size;
    const void *q;        // [B, Hq, D] contiguous, q_type
    float *out;           // [B, Hq, D] contiguous
    const void *packed;   // block b at packed + b * packed_block_stride elements; rows of packed_row elements
    const void *window;
    int64_t packed_block_stride, packed_row, window_block_stride, window_row;
    const int32_t *packed_table, *window_table;  // [B, *] rows at *_table_stride
    int64_t packed_table_stride, window_table_stride;
    const int32_t *seq_lens;  // [B]
    int64_t packed_offset, window_offset;
    const int64_t *k_off;  // [Hkv + 1]: head h's kept K columns are [k_off[h], k_off[h + 1]) of the layer's row
    const int64_t *k_ch;   // [nk]: their channels
    const int64_t *v_col;  // [Hkv]: first column of head h's V in the layer's row, -1: it keeps nothing
    int64_t sink, recent, accumu;
    double scale, k_scale, v_scale;
    int64_t q_type;   // 0 f32, 1 bf16, 2 f16
    int64_t kv_type;  // 0 f32, 1 bf16, 2 f16, 3 fp8 (bytes through lut)
    const float *lut;  // [256] fp8 byte -> float
    int64_t threads;
    int64_t split;  // middle keys per piece (a multiple of TILE)
    // the rest rows of the window pages (what a packed row lacks: dropped K channels, V of heads keeping none)
    const int64_t *rk_off;  // [Hkv + 1]: head h's dropped K columns are [rk_off[h], rk_off[h + 1]) of the rest row
    const int64_t *rk_ch;   // [nkr]: their channels
    const int64_t *rv_col;  // [Hkv]: first column of head h's V in the rest row, -1: its V is in the packed row
    int64_t window_block;   // tokens per window page (block_size is the packed pages')
    // [B] or NULL (every row alone): runs[b] = q > 1 where rows [b, b + q) are q queries of one request at consecutive
    // positions over the same block tables (speculative drafts), 0 for the rows after a run's first, 1 elsewhere: the
    // middle they all score is read once for the q of them
    const int32_t *runs;
};

static inline v8 bits_f(v8u u) { return (v8)u; }

static inline float bf16_f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// IEEE half to float (normals, subnormals, inf, NaN) with integer ops only: any x86-64 or ARM build.
static inline v8 f16_f8(v8h h) {
    v8u x = __builtin_convertvector(h, v8u);
    v8u em = x & 0x7fffu;
    v8u bits = (v8u)(bits_f(em << 13) * 0x1p112f);
    bits |= (v8u)(em >= 0x7c00u) & 0x7f800000u;
    return bits_f(bits | ((x & 0x8000u) << 16));
}

static inline float f16_f(uint16_t h) {
    v8h x = {h, 0, 0, 0, 0, 0, 0, 0};
    return f16_f8(x)[0];
}

// Loaders: one element, or 8 consecutive ones, of a stored row as floats.
struct LF32 {
    typedef float T;
    static inline float one(const T *p, const float *) { return *p; }
    static inline v8 eight(const T *p, const float *) {
        v8 r;
        memcpy(&r, p, 32);
        return r;
    }
};
struct LBF16 {
    typedef uint16_t T;
    static inline float one(const T *p, const float *) { return bf16_f(*p); }
    static inline v8 eight(const T *p, const float *) {
        v8h h;
        memcpy(&h, p, 16);
        return bits_f(__builtin_convertvector(h, v8u) << 16);
    }
};
struct LF16 {
    typedef uint16_t T;
    static inline float one(const T *p, const float *) { return f16_f(*p); }
    static inline v8 eight(const T *p, const float *) {
        v8h h;
        memcpy(&h, p, 16);
        return f16_f8(h);
    }
};
struct LFP8 {
    typedef uint8_t T;
    static inline float one(const T *p, const float *lut) { return lut[*p]; }
    static inline v8 eight(const T *p, const float *lut) {
        v8 r = {lut[p[0]], lut[p[1]], lut[p[2]], lut[p[3]], lut[p[4]], lut[p[5]], lut[p[6]], lut[p[7]]};
        return r;
    }
};

static inline float hsum(v8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

// exp(x) to ~1 ulp (Cephes expf), branch-free so loops over it vectorise; NaN stays NaN (the tests' NaN
// pages rely on it), -inf gives 0.
static inline float exp_f(float x) {
    x = x < -87.0f ? -87.0f : x;  // a NaN compares false and passes through
    x = x > 88.0f ? 88.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = (int32_t)(n != n ? 0.0f : n) + 127;
    uint32_t u = (uint32_t)e << 23;
    float two_n;
    memcpy(&two_n, &u, 4);
    return p * two_n;
}

// Ask for bytes [p, p + bytes) into L2 (prefetcht1): asked into L1, the next tile's rows evicted the rows being
// scored, and the middle ran 1.6x slower (benchmarks/vllm_kernel.py, batch 4 x 8k, one thread).
static inline __attribute__((always_inline)) void prefetch_row(const char *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
    __builtin_prefetch(p + bytes - 1, 0, 2);
}

template <class T>
static inline void prefetch_rows(const T *const *rows, int64_t nt, int64_t bytes) {
    for (int64_t t = 0; t < nt; t++) prefetch_row((const char *)rows[t], bytes);
}

// The tile functions below are always inlined: called from both keys() and keys_full(), GCC would keep them out
// of line, which measured 20-30% slower decode steps (benchmarks/vllm_kernel.py, batch 4 x 2k).

// s[g * TILE + t] = q_g . k_t over n channels for GB query heads (q rows ldq apart); each 8-channel piece of
// a key is loaded once for all GB heads.
template <class L, int GB>
static inline __attribute__((always_inline)) void dot_tile(const float *q, int64_t ldq, const typename L::T *const *kr, int64_t nt, int64_t n,
                     const float *lut, float *s, const char *const *pf, int64_t npf, int64_t pf_bytes) {
    for (int64_t t = 0; t < nt; t++) {
        if (t < npf) prefetch_row(pf[t], pf_bytes);
        const typename L::T *k = kr[t];
        v8 a[GB];
        for (int g = 0; g < GB; g++) a[g] = (v8){0, 0, 0, 0, 0, 0, 0, 0};
        int64_t c = 0;
        for (; c + 8 <= n; c += 8) {
            const v8 kv = L::eight(k + c, lut);
            for (int g = 0; g < GB; g++) {
                v8 qv;
                memcpy(&qv, q + g * ldq + c, 32);
                a[g] += qv * kv;
            }
        }
        float r[GB];
        for (int g = 0; g < GB; g++) r[g] = hsum(a[g]);
        for (; c < n; c++) {
            const float kv = L::one(k + c, lut);
            for (int g = 0; g < GB; g++) r[g] += q[g * ldq + c] * kv;
        }
        for (int g = 0; g < GB; g++) s[g * TILE + t] = r[g];
    }
}

// acc[g][0..D) += sum_t p[g * TILE + t] * v_t for GB query heads: 16 channels of every head stay in registers
// across the tile.
template <class L, int GB>
static inline __attribute__((always_inline)) void v_tile(const float *p, const typename L::T *const *vr, int64_t nt, int64_t D, const float *lut,
                   float *acc) {
    int64_t d0 = 0;
    for (; d0 + 16 <= D; d0 += 16) {
        v8 r0[GB], r1[GB];
        for (int g = 0; g < GB; g++) {
            memcpy(&r0[g], acc + g * D + d0, 32);
            memcpy(&r1[g], acc + g * D + d0 + 8, 32);
        }
        for (int64_t t = 0; t < nt; t++) {
            const v8 a = L::eight(vr[t] + d0, lut), b = L::eight(vr[t] + d0 + 8, lut);
            for (int g = 0; g < GB; g++) {
                const float w = p[g * TILE + t];
                r0[g] += w * a;
                r1[g] += w * b;
            }
        }
        for (int g = 0; g < GB; g++) {
            memcpy(acc + g * D + d0, &r0[g], 32);
            memcpy(acc + g * D + d0 + 8, &r1[g], 32);
        }
    }
    for (; d0 < D; d0++) {
        float r[GB];
        for (int g = 0; g < GB; g++) r[g] = acc[g * D + d0];
        for (int64_t t = 0; t < nt; t++) {
            const float a = L::one(vr[t] + d0, lut);
            for (int g = 0; g < GB; g++) r[g] += p[g * TILE + t] * a;
        }
        for (int g = 0; g < GB; g++) acc[g * D + d0] = r[g];
    }
}

template <class L>
static inline __attribute__((always_inline)) void dot_any(int gb, const float *q, int64_t ldq, const typename L::T *const *kr, int64_t nt, int64_t n,
                    const float *lut, float *s, const char *const *pf = NULL, int64_t npf = 0, int64_t pf_bytes = 0) {
    switch (gb) {
        case 1: dot_tile<L, 1>(q, ldq, kr, nt, n, lut, s, pf, npf, pf_bytes); break;
        case 2: dot_tile<L, 2>(q, ldq, kr, nt, n, lut, s, pf, npf, pf_bytes); break;
        case 3: dot_tile<L, 3>(q, ldq, kr, nt, n, lut, s, pf, npf, pf_bytes); break;
        case 4: dot_tile<L, 4>(q, ldq, kr, nt, n, lut, s, pf, npf, pf_bytes); break;
        case 5: dot_tile<L, 5>(q, ldq, kr, nt, n, lut, s, pf, npf, pf_bytes); break;
        case 6: dot_tile<L, 6>(q, ldq, kr, nt, n, lut, s, pf, npf, pf_bytes); break;
        case 7: dot_tile<L, 7>(q, ldq, kr, nt, n, lut, s, pf, npf, pf_bytes); break;
        default: dot_tile<L, 8>(q, ldq, kr, nt, n, lut, s, pf, npf, pf_bytes); break;
    }
}

template <class L>
static inline __attribute__((always_inline)) void v_any(int gb, const float *p, const typename L::T *const *vr, int64_t nt, int64_t D, const float *lut,
                  float *acc) {
    switch (gb) {
        case 1: v_tile<L, 1>(p, vr, nt, D, lut, acc); break;
        case 2: v_tile<L, 2>(p, vr, nt, D, lut, acc); break;
        case 3: v_tile<L, 3>(p, vr, nt, D, lut, acc); break;
        case 4: v_tile<L, 4>(p, vr, nt, D, lut, acc); break;
        case 5: v_tile<L, 5>(p, vr, nt, D, lut, acc); break;
        case 6: v_tile<L, 6>(p, vr, nt, D, lut, acc); break;
        case 7: v_tile<L, 7>(p, vr, nt, D, lut, acc); break;
        default: v_tile<L, 8>(p, vr, nt, D, lut, acc); break;
    }
}

struct Scratch {  // one thread's buffers, for every query head of a piece's rows (a run's q rows: q Hq)
    float *s, *qf, *qk, *qc, *acc, *m, *l;
    const void **rows, **rows2, **kr, **vr;
    void *F;  // [TILE, D] elements: one KV head's full K rows of a tile, put together (keys_full)
};

// Fold one tile's scores s[g * TILE + t] of a KV head's G query heads into their online softmax (m, l, acc) with
// the values at vr[t].
template <class L>
static inline __attribute__((always_inline)) void fold(const Args &A, int64_t G, int64_t nt, float *s, float *m, float *l, float *acc,
                        const typename L::T *const *vr) {
    const int64_t D = A.D;
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * TILE;
        float mx = m[g];
        for (int64_t t = 0; t < nt; t++) mx = sg[t] > mx ? sg[t] : mx;  // a NaN score stays in w below
        const float c = exp_f(m[g] - mx);  // first tile: exp(-inf) = 0
        float sum = 0.f;
        for (int64_t t = 0; t < nt; t++) {
            const float w = exp_f(sg[t] - mx);
            sg[t] = w;
            sum += w;
        }
        l[g] = l[g] * c + sum;
        m[g] = mx;
        float *ag = acc + g * D;
        for (int64_t d = 0; d < D; d++) ag[d] *= c;
    }
    for (int64_t g0 = 0; g0 < G; g0 += GMAX) {
        const int gb = (int)(G - g0 < GMAX ? G - g0 : GMAX);
        v_any<L>(gb, s + g0 * TILE, vr, nt, D, A.lut, acc + g0 * D);
    }
}

// Keys [a, e) of one request's pages (token pos's row at base + table[pos / bs] * block_stride + (pos % bs) *
// row) for the KV heads h in heads[0..nh): scores of its G query heads over n[h] channels at column kcol[h]
// (queries q + h * G * D, rows D apart; G: the query rows of a KV head, G' = q G for a run of q queries), values of D channels at column vcol[h], folded tile by tile into the
// online softmax of those query heads (S.m, S.l, S.acc). Every head of a tile reads the same 128 rows one
// after the other: a token's row, a few hundred bytes in a page of its own, is fetched once for all of them.
template <class L>
static void keys(const Args &A, const typename L::T *base, int64_t block_stride, int64_t row, const int32_t *table,
                 const int64_t *heads, int64_t nh, const int64_t *kcol, const int64_t *vcol, const int64_t *n,
                 const float *q, int64_t a, int64_t e, int64_t span_el, int64_t G, Scratch &S) {
    typedef typename L::T T;
    const int64_t bs = A.block_size, D = A.D;
    const T **rows = (const T **)S.rows, **kr = (const T **)S.kr, **vr = (const T **)S.vr;
    const int64_t span = (int64_t)sizeof(T) * span_el;  // bytes of the layer's columns in a row
    for (int64_t t0 = a; t0 < e; t0 += TILE) {
        const int64_t nt = e - t0 < TILE ? e - t0 : TILE;  // the tile clamp
        for (int64_t t = 0; t < nt; t++) {
            const int64_t pos = t0 + t;
            rows[t] = base + (int64_t)table[pos / bs] * block_stride + (pos % bs) * row;
        }
        if (t0 == a) prefetch_rows(rows, nt, span);
        // the next tile's rows, asked for while the first head scores this one (a row per key): a block's run of
        // the layer is a few KB in a page of every layer's runs, too short for the hardware prefetcher to follow;
        // without this a step took 2.0-2.2x as long (benchmarks/vllm_kernel_ab.py)
        const char **pf = (const char **)S.rows2;
        const int64_t left = e - t0 - nt, npf = left < TILE ? left : TILE;  // the next tile's keys
        for (int64_t t = 0; t < npf; t++) {
            const int64_t pos = t0 + TILE + t;
            pf[t] = (const char *)(base + (int64_t)table[pos / bs] * block_stride + (pos % bs) * row);
        }
        for (int64_t i = 0; i < nh; i++) {
            const int64_t h = heads[i];
            for (int64_t t = 0; t < nt; t++) {
                kr[t] = rows[t] + kcol[h];
                vr[t] = rows[t] + vcol[h];
            }
            float *s = S.s + h * G * TILE, *m = S.m + h * G, *l = S.l + h * G, *acc = S.acc + h * G * D;
            for (int64_t g0 = 0; g0 < G; g0 += GMAX) {
                const int gb = (int)(G - g0 < GMAX ? G - g0 : GMAX);
                dot_any<L>(gb, q + (h * G + g0) * D, D, kr, nt, n[h], A.lut, s + g0 * TILE, pf, i == 0 && g0 == 0 ? npf : 0, span);
            }
            fold<L>(A, G, nt, s, m, l, acc, vr);
        }
    }
}

struct Heads {  // the layer's heads as the kernel walks them (the same for every piece)
    int64_t *mid, n_mid;        // the KV heads keeping any channel
    int64_t *mid_k, *mid_n;     // [Hkv] first kept K column of head h in a packed row, how many
    int64_t *rest_k, *rest_n;   // [Hkv] first dropped K column of head h in a rest row, how many
    int64_t mid_span;           // the layer's columns in a packed row: [0, mid_span)
};

// The sink and recent keys [a, e) of one request, every channel of every KV head: per key and head its kept K
// channels (packed row, column mid_k[h], mid_n[h] of them) and its dropped ones (rest row, column rest_k[h]) are
// copied side by side into one row of D (S.F), scored in one dot with the query permuted alike (S.qc: kept
// channels, then dropped), and folded as in keys(); V from the packed row (v_col[h] >= 0) or the rest row.
template <class L>
static void keys_full(const Args &A, const Heads &H, const typename L::T *packed, const int32_t *ptable,
                      const typename L::T *rest, const int32_t *rtable, int64_t a, int64_t e, Scratch &S) {
    typedef typename L::T T;
    const int64_t bs = A.block_size, wbs = A.window_block, D = A.D, G = A.Hq / A.Hkv;
    const T **rows = (const T **)S.rows, **rows2 = (const T **)S.rows2, **kr = (const T **)S.kr;
    const T **vr = (const T **)S.vr;
    T *F = (T *)S.F;
    for (int64_t t0 = a; t0 < e; t0 += TILE) {
        const int64_t nt = e - t0 < TILE ? e - t0 : TILE;  // the tile clamp
        for (int64_t t = 0; t < nt; t++) {
            const int64_t pos = t0 + t;
            rows[t] = packed + (int64_t)ptable[pos / bs] * A.packed_block_stride + (pos % bs) * A.packed_row;
            rows2[t] = rest + (int64_t)rtable[pos / wbs] * A.window_block_stride + (pos % wbs) * A.window_row;
        }
        for (int64_t h = 0; h < A.Hkv; h++) {
            const int64_t n1 = H.mid_n[h], n2 = H.rest_n[h], k1 = H.mid_k[h], k2 = H.rest_k[h];
            const bool v_rest = A.v_col[h] < 0;
            const int64_t vc = v_rest ? A.rv_col[h] : A.v_col[h];
            for (int64_t t = 0; t < nt; t++) {
                T *f = F + t * D;
                memcpy(f, rows[t] + k1, sizeof(T) * (size_t)n1);
                memcpy(f + n1, rows2[t] + k2, sizeof(T) * (size_t)n2);
                kr[t] = f;
                vr[t] = (v_rest ? rows2[t] : rows[t]) + vc;
            }
            float *s = S.s + h * G * TILE, *m = S.m + h * G, *l = S.l + h * G, *acc = S.acc + h * G * D;
            for (int64_t g0 = 0; g0 < G; g0 += GMAX) {
                const int gb = (int)(G - g0 < GMAX ? G - g0 : GMAX);
                dot_any<L>(gb, S.qc + (h * G + g0) * D, D, kr, nt, D, A.lut, s + g0 * TILE);
            }
            fold<L>(A, G, nt, s, m, l, acc, vr);
        }
    }
}

struct Item {  // a piece of one request: its full-channel keys (the first piece) and/or a slice of its middle
    int64_t b, mid_a, mid_e, full, cost;
    int64_t full_from;  // the request's first full recent key, max(sink, rf) (rf: the rule's, computed once in run)
    int64_t part;  // its partial result's slot, -1: writes the output directly (the request has one piece)
    int64_t nq;      // query rows it scores: 1, or a run's q (rows [b, b + q): a slice of the middle all of them score)
    int64_t stride;  // slots from one row's partials to the next row's (a run's shared slice)
    int64_t run;     // the first row of its run, whose counter it counts down (b for a row alone)
};

static int by_cost(const void *x, const void *y) {
    const int64_t a = ((const Item *)x)->cost, b = ((const Item *)y)->cost;
    return a < b ? 1 : (a > b ? -1 : 0);
}

static inline float q_at(const Args &A, int64_t i) {
    if (A.q_type == 1) return bf16_f(((const uint16_t *)A.q)[i]);
    if (A.q_type == 2) return f16_f(((const uint16_t *)A.q)[i]);
    return ((const float *)A.q)[i];
}

static inline int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Query head qh of row b, scaled (stored K are k / k_scale: the scale rides on q), into qf; its head's kept channels
// into qk; with qc, the kept channels then the dropped ones (the order keys_full puts a full row in).
static inline void load_query(const Args &A, int64_t b, int64_t qh, float *qf, float *qk, float *qc) {
    const int64_t D = A.D, h = qh / (A.Hq / A.Hkv);
    const double qscale = A.scale * A.k_scale;
    for (int64_t d = 0; d < D; d++) qf[d] = (float)(q_at(A, (b * A.Hq + qh) * D + d) * qscale);
    const int64_t c0 = A.k_off[h], nk = A.k_off[h + 1] - c0;
    for (int64_t c = 0; c < nk; c++) qk[c] = qf[A.k_ch[c0 + c]];
    if (!qc) return;
    const int64_t r0 = A.rk_off[h], nr = A.rk_off[h + 1] - r0;
    for (int64_t c = 0; c < nk; c++) qc[c] = qk[c];
    for (int64_t c = 0; c < nr; c++) qc[nk + c] = qf[A.rk_ch[r0 + c]];
}

template <class L>
static void run_item(const Args &A, const Heads &H, const Item &it, Scratch &S, float *parts) {
    typedef typename L::T T;
    const int64_t Hq = A.Hq, G = Hq / A.Hkv, D = A.D, b = it.b, nq = it.nq, GQ = G * nq;
    const int64_t p = (int64_t)A.seq_lens[b] - 1;
    // state row r = h * GQ + j * G + g: query head h * G + g of row b + j (r = qh for a row alone), so that a KV head's
    // GQ query rows are adjacent
    for (int64_t j = 0; j < nq; j++)
        for (int64_t qh = 0; qh < Hq; qh++) {
            const int64_t r = (qh / G) * GQ + j * G + qh % G;
            load_query(A, b + j, qh, S.qf + r * D, S.qk + r * D, it.full ? S.qc + r * D : NULL);
            S.m[r] = -INFINITY;
            S.l[r] = 0.f;
        }
    memset(S.acc, 0, sizeof(float) * (size_t)(nq * Hq * D));
    const T *pk = (const T *)A.packed + A.packed_offset;
    const int32_t *pt = A.packed_table + b * A.packed_table_stride;
    if (it.full) {  // sink [0, min(sink, p + 1)) and recent [max(sink, rf), p]: every channel, packed + rest row
        const T *w = (const T *)A.window + A.window_offset;
        const int32_t *wt = A.window_table + b * A.window_table_stride;
        const int64_t sink_end = A.sink < p + 1 ? A.sink : p + 1;
        keys_full<L>(A, H, pk, pt, w, wt, 0, sink_end, S);
        keys_full<L>(A, H, pk, pt, w, wt, it.full_from, p + 1, S);
    }
    if (it.mid_e > it.mid_a)  // middle: each head's kept channels, packed pages
        keys<L>(A, pk, A.packed_block_stride, A.packed_row, pt, H.mid, H.n_mid, H.mid_k, A.v_col, H.mid_n, S.qk,
                it.mid_a, it.mid_e, H.mid_span, GQ, S);
    for (int64_t j = 0; j < nq; j++)
        for (int64_t qh = 0; qh < Hq; qh++) {
            const int64_t r = (qh / G) * GQ + j * G + qh % G;
            if (it.part < 0) {
                const float inv = (float)(A.v_scale / S.l[r]);
                float *o = A.out + ((b + j) * Hq + qh) * D;
                for (int64_t d = 0; d < D; d++) o[d] = S.acc[r * D + d] * inv;
            } else {
                float *pp = parts + ((it.part + j * it.stride) * Hq + qh) * (D + 2);
                pp[0] = S.m[r];
                pp[1] = S.l[r];
                memcpy(pp + 2, S.acc + r * D, sizeof(float) * (size_t)D);
            }
        }
}

// The k pieces of request b (partials from slot f on), in piece order (so any thread count gives the same
// bits). A head without middle keys has an empty state (m = -inf, l = 0) in every piece but the first.
static void merge(const Args &A, int64_t b, int64_t k, int64_t f, const float *parts) {
    const int64_t Hq = A.Hq, D = A.D;
    for (int64_t qh = 0; qh < Hq; qh++) {
        float mx = -INFINITY;
        for (int64_t j = 0; j < k; j++) {
            const float mj = parts[((f + j) * Hq + qh) * (D + 2)];
            mx = (mj > mx || mj != mj) ? mj : mx;
        }
        float l = 0.f;
        float *o = A.out + (b * Hq + qh) * D;
        for (int64_t d = 0; d < D; d++) o[d] = 0.f;
        for (int64_t j = 0; j < k; j++) {
            const float *pp = parts + ((f + j) * Hq + qh) * (D + 2);
            if (pp[1] == 0.f && pp[0] == -INFINITY) continue;  // a head with no key in this piece
            const float c = exp_f(pp[0] - mx);
            l += pp[1] * c;
            for (int64_t d = 0; d < D; d++) o[d] += pp[2 + d] * c;
        }
        const float inv = (float)(A.v_scale / l);
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}

template <class L>
static int run(const Args &A) {
    const int64_t B = A.B, Hkv = A.Hkv, Hq = A.Hq, D = A.D;
    // Pieces: per request one with its full-channel keys and the first `split` middle keys, then one per further
    // `split` middle keys (whole tiles), each over every KV head; their partial softmax states are merged
    // (flash-decoding) by the thread that finishes a request's last piece. A run of q queries of one request
    // (A.runs) shares the middle its first query scores (the least: the window moves on with the position):
    // pieces of `split` of those keys score all q queries, and each query has a piece of its own with its
    // full-channel keys and the few middle keys past the first query's. The cut depends on the lengths alone,
    // never on the thread count: every thread count gives the same bits.
    int64_t *buf64 = (int64_t *)malloc(sizeof(int64_t) * (size_t)(6 * B + 8 * Hkv + 1));
    if (!buf64) return 1;
    // per request: its first partial's slot, its pieces, those not yet done, its middle [sink, sink + mid) and its
    // first full recent key; per row, the length of the run it starts (0 inside one)
    int64_t *first = buf64, *splits = first + B, *left = splits + B, *mids = left + B, *full_from = mids + B;
    int64_t *runlen = full_from + B;
    int64_t qmax = 1;
    for (int64_t b = 0; b < B;) {  // the runs: q rows of consecutive positions, 0 after the first
        const int64_t q = A.runs ? A.runs[b] : 1;
        bool ok = q >= 1 && b + q <= B;
        for (int64_t j = 1; ok && j < q; j++) ok = A.runs[b + j] == 0 && A.seq_lens[b + j] == A.seq_lens[b] + j;
        if (!ok) {
            free(buf64);
            return 2;
        }
        runlen[b] = q;
        for (int64_t j = 1; j < q; j++) runlen[b + j] = 0;
        qmax = q > qmax ? q : qmax;
        b += q;
    }
    Heads H;
    H.mid = runlen + B, H.rest_k = H.mid + Hkv, H.rest_n = H.rest_k + Hkv;
    H.mid_k = H.rest_n + Hkv, H.mid_n = H.mid_k + Hkv;
    H.n_mid = 0;
    int64_t mid_width = 0;  // kept K channels + V channels the middle reads per token
    H.mid_span = A.k_off[Hkv];
    for (int64_t h = 0; h < Hkv; h++) {
        if (A.v_col[h] >= 0 && A.v_col[h] + D > H.mid_span) H.mid_span = A.v_col[h] + D;
        H.rest_k[h] = A.rk_off[h], H.rest_n[h] = A.rk_off[h + 1] - A.rk_off[h];
        H.mid_k[h] = A.k_off[h], H.mid_n[h] = A.k_off[h + 1] - A.k_off[h];
        if (A.v_col[h] >= 0) H.mid[H.n_mid++] = h, mid_width += H.mid_n[h] + D;
    }
    for (int64_t b = 0; b < B; b++) {
        // the rule (leank_infer/decode/rule.py, positional_recent_from): the query at p = seq_len - 1 scores keys
        // [sink, rf) with the kept channels, [0, sink) and [max(sink, rf), p] with every channel
        const int64_t p = (int64_t)A.seq_lens[b] - 1;
        const int64_t rf = A.accumu * floor_div(p - A.recent, A.accumu);
        mids[b] = H.n_mid && rf > A.sink ? rf - A.sink : 0;
        full_from[b] = A.sink > rf ? A.sink : rf;
    }
    int64_t n_items = 0, n_parts = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t q = runlen[b];
        if (q == 1) {
            const int64_t mid = mids[b], k = mid > A.split ? (mid + A.split - 1) / A.split : 1;
            splits[b] = left[b] = k;
            first[b] = k > 1 ? n_parts : -1;
            n_items += k;
            if (k > 1) n_parts += k;
        } else if (q > 1) {  // a piece per row, and the shared middle's pieces; each row merges 1 + M partials
            const int64_t M = (mids[b] + A.split - 1) / A.split;
            splits[b] = 1 + M, left[b] = q + M;
            first[b] = M ? n_parts : -1;
            n_items += q + M;
            if (M) n_parts += q * (1 + M);
        }
    }
    Item *items = (Item *)malloc(sizeof(Item) * (size_t)n_items);
    float *parts = n_parts ? (float *)malloc(sizeof(float) * (size_t)(n_parts * Hq * (D + 2))) : NULL;
    if (!items || (n_parts && !parts)) {
        free(buf64), free(items), free(parts);
        return 1;
    }
    int64_t i = 0;
    const auto full_keys = [&](int64_t b) {  // full-channel keys of row b: the sink and the recent window
        const int64_t p = (int64_t)A.seq_lens[b] - 1;
        return (A.sink < p + 1 ? A.sink : p + 1) + (p + 1 - full_from[b]);
    };
    for (int64_t b = 0; b < B; b++) {
        const int64_t q = runlen[b], m = mids[b], k = splits[b];
        if (q == 1) {
            for (int64_t j = 0; j < k; j++) {
                Item &it = items[i++];
                it.b = b, it.full = j == 0, it.full_from = full_from[b];
                it.mid_a = A.sink + j * A.split;
                it.mid_e = j == k - 1 ? A.sink + m : A.sink + (j + 1) * A.split;
                it.cost = (it.full ? full_keys(b) * 2 * Hkv * D : 0) + (it.mid_e - it.mid_a) * mid_width + 1;
                it.part = k > 1 ? first[b] + j : -1;
                it.nq = 1, it.stride = 0, it.run = b;
            }
        } else if (q > 1) {
            for (int64_t j = 0; j < q; j++) {  // row b + j: its full-channel keys, its middle past the first row's
                Item &it = items[i++];
                it.b = b + j, it.full = 1, it.full_from = full_from[b + j];
                it.mid_a = A.sink + m, it.mid_e = A.sink + mids[b + j];
                it.cost = full_keys(b + j) * 2 * Hkv * D + (it.mid_e - it.mid_a) * mid_width + 1;
                it.part = k > 1 ? first[b] + j * k : -1;
                it.nq = 1, it.stride = 0, it.run = b;
            }
            for (int64_t j = 0; j + 1 < k; j++) {  // a slice of the shared middle, all q rows
                Item &it = items[i++];
                it.b = b, it.full = 0, it.full_from = full_from[b];
                it.mid_a = A.sink + j * A.split;
                it.mid_e = j == k - 2 ? A.sink + m : A.sink + (j + 1) * A.split;
                it.cost = (it.mid_e - it.mid_a) * mid_width * (q + 3) / 4 + 1;  // read once, scored q times
                it.part = first[b] + 1 + j;
                it.nq = q, it.stride = k, it.run = b;
            }
        }
    }
    qsort(items, (size_t)n_items, sizeof(Item), by_cost);  // longest first: dynamic scheduling balances the rest
    int failed = 0;
    int64_t threads = A.threads < n_items ? A.threads : n_items;
    if (threads < 1) threads = 1;
    const int64_t R = qmax * Hq;  // state rows of the widest piece
#pragma omp parallel num_threads(threads)
    {
        Scratch S;
        const size_t nf = (size_t)(R * TILE + 4 * R * D + 2 * R);
        float *buf = (float *)malloc(sizeof(float) * nf + sizeof(float) * (size_t)(TILE * D));  // + S.F (<= 4 B)
        const void **ptrs = (const void **)malloc(sizeof(void *) * 4 * TILE);
        if (!buf || !ptrs) {
#pragma omp atomic write
            failed = 1;
        } else {
            S.s = buf, S.qf = S.s + R * TILE, S.qk = S.qf + R * D, S.acc = S.qk + R * D, S.m = S.acc + R * D;
            S.l = S.m + R, S.qc = S.l + R, S.F = S.qc + R * D;
            S.rows = ptrs, S.rows2 = ptrs + TILE, S.kr = ptrs + 2 * TILE, S.vr = ptrs + 3 * TILE;
        }
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t j = 0; j < n_items; j++) {
            if (!buf || !ptrs) continue;
            const Item &it = items[j];
            run_item<L>(A, H, it, S, parts);
            // the last piece of a request to finish merges them, no barrier: the counter's acquire-release makes every
            // other piece's partial visible to it, and exactly one piece sees the count reach 0 (one writer per output)
            if (it.part >= 0 && __atomic_sub_fetch(&left[it.run], 1, __ATOMIC_ACQ_REL) == 0)
                for (int64_t r = 0; r < runlen[it.run]; r++)
                    merge(A, it.run + r, splits[it.run], first[it.run] + r * splits[it.run], parts);
        }
        free(buf);
        free(ptrs);
    }
    free(buf64), free(items), free(parts);
    return failed;
}

extern "C" int leank_cpu_decode(const Args *A) {
    if (A->Hkv <= 0 || A->Hq % A->Hkv || A->block_size <= 0 || A->window_block <= 0 || A->accumu <= 0 || A->split < TILE || A->split % TILE) return 2;
    switch (A->kv_type) {
        case 0: return run<LF32>(*A);
        case 1: return run<LBF16>(*A);
        case 2: return run<LF16>(*A);
        case 3: return run<LFP8>(*A);
        default: return 2;
    }
}

extern "C" int leank_cpu_decode_tile(void) { return TILE; }

// The step's K/V into the pages (what paged_reference.write_pages does in PyTorch, without its dozen small tensor
// ops per layer): token i's packed row (kept K channels k_index, then V columns v_index, zero padding up to width)
// at packed slot ps[i] >= 0, its rest row (dropped K channels kr_index, then V columns vr_index) at window slot
// ws[i] >= window_block (-1 pads,
// [0, window_block) is the null block). K/V rows [Hkv * D] contiguous, tokens k_stride / v_stride elements apart;
// pages of the model's dtype (elem bytes); a slot's row at base + (slot / bs) * block_stride + (slot % bs) * row.
struct WArgs {  // mirrored by _WArgs in cpu_decode.py: keep the order
    int64_t n, HD, block_size, elem;
    const void *k, *v;
    int64_t k_stride, v_stride;
    void *packed, *window;
    int64_t packed_block_stride, packed_row, window_block_stride, window_row;
    const int64_t *packed_slots, *window_slots;
    const int64_t *k_index, *v_index;
    int64_t nk, nv, width;
    const int64_t *kr_index, *vr_index;
    int64_t nkr, nvr;
    int64_t window_block;  // tokens per window page (block_size is the packed pages')
    int64_t threads;       // tokens split over at most this many (a step's slots are distinct)
};

// Threads for n tokens of row copies: at most the engine's, and >= 64 tokens a thread (fewer do not repay the team).
static inline int64_t team(const int64_t threads, const int64_t n) { return threads < n / 64 + 1 ? threads : n / 64 + 1; }

template <class T>
static void write_rows(const WArgs &A) {
    const T *k = (const T *)A.k, *v = (const T *)A.v;
    const int64_t bs = A.block_size, wbs = A.window_block;
    const int64_t threads = team(A.threads, A.n);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < A.n; i++) {
        const T *ki = k + i * A.k_stride, *vi = v + i * A.v_stride;
        const int64_t p = A.packed_slots[i];
        if (p >= 0) {
            T *row = (T *)A.packed + (p / bs) * A.packed_block_stride + (p % bs) * A.packed_row;
            for (int64_t j = 0; j < A.nk; j++) row[j] = ki[A.k_index[j]];
            for (int64_t j = 0; j < A.nv; j++) row[A.nk + j] = vi[A.v_index[j]];
            for (int64_t j = A.nk + A.nv; j < A.width; j++) row[j] = (T)0;
        }
        const int64_t w = A.window_slots[i];
        if (w >= wbs) {
            T *row = (T *)A.window + (w / wbs) * A.window_block_stride + (w % wbs) * A.window_row;
            for (int64_t j = 0; j < A.nkr; j++) row[j] = ki[A.kr_index[j]];
            for (int64_t j = 0; j < A.nvr; j++) row[A.nkr + j] = vi[A.vr_index[j]];
        }
    }
}

extern "C" int leank_cpu_write(const WArgs *A) {
    if (A->block_size <= 0 || A->window_block <= 0 || A->threads < 1 || A->nk + A->nv > A->width ||
        A->nkr + A->nvr > A->window_row)
        return 2;
    switch (A->elem) {
        case 4: write_rows<uint32_t>(*A); return 0;
        case 2: write_rows<uint16_t>(*A); return 0;
        default: return 2;
    }
}

// A request's tokens [first, first + n) with every channel, as K and V of the pages' dtype (what
// paged_reference.full_rows does in PyTorch with four copies): the dense-prompt rule's prompt chunk reads every earlier
// prompt token. Element j of a token's K | V row is its packed row's column src[j] when src[j] < width, else its rest
// row's column src[j] - width (PackedLayout.full_columns). The output is paged: token t (position first + t) goes to
// block out_table[t / out_block],
// place t % out_block, element (head h, channel d) at block * s[0] + h * s[1] + place * s[2] + d * s[3] (ks for K,
// vs for V): dense rows [n, H, D] are one block with strides (0, D, H * D, 1); vLLM's CPU pages hold K transposed
// in a block. Tokens split over the threads.
struct GArgs {  // mirrored by _GArgs in cpu_decode.py: keep the order
    int64_t n, H, D, block_size, elem, threads;
    void *k, *v;
    const void *packed, *window;
    int64_t packed_block_stride, packed_row, window_block_stride, window_row;
    const int32_t *packed_table, *window_table;
    const int64_t *src;
    int64_t width;
    const int32_t *out_table;
    int64_t out_block;
    int64_t ks[4], vs[4];
    int64_t window_block;  // tokens per window page (block_size is the packed pages')
    int64_t first;         // position of token 0 in the request: token t's rows are those of position first + t
};

// One output of gather_rows: the tile's m tokens (rows of buf, RW elements apart) put into K or V at base, element
// (token t, head h, channel d) at base + t * s2 + h * s1 + d * s3. Where tokens are adjacent in the output (vLLM's
// transposed K: s2 == 1) the inner loop runs over tokens, else over channels: a store stream either way, each
// element a load from the tile (L1), never a branch.
template <class T>
static void put_tile(T *base, const int64_t s1, const int64_t s2, const int64_t s3, const int32_t *src, const int64_t H,
                     const int64_t D, const int64_t m, const T *buf, const int64_t RW) {
    if (s2 == 1) {
        for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < D; d++) {
                T *dst = base + h * s1 + d * s3;
                const T *col = buf + src[h * D + d];
                for (int64_t t = 0; t < m; t++) dst[t] = col[t * RW];
            }
    } else {
        for (int64_t t = 0; t < m; t++)
            for (int64_t h = 0; h < H; h++) {
                T *dst = base + t * s2 + h * s1;
                const T *row = buf + t * RW;
                const int32_t *sh = src + h * D;
                for (int64_t d = 0; d < D; d++) dst[d * s3] = row[sh[d]];
            }
    }
}

// Tokens go in tiles of up to GATHER_TILE adjacent places of one output block: a tile's packed and rest rows are
// copied side by side into a small buffer (two memcpy a token), then every output element is a load from it.
constexpr int64_t GATHER_TILE = 16;

template <class T>
static void gather_rows(const GArgs &A) {
    const int64_t bs = A.block_size, wbs = A.window_block, H = A.H, D = A.D, HD = H * D, W = A.width, ob = A.out_block;
    int64_t R = 0;  // the rest row's columns read: up to the last one any src names
    for (int64_t j = 0; j < 2 * HD; j++) R = A.src[j] - W + 1 > R ? A.src[j] - W + 1 : R;
    const int64_t RW = W + R;
    std::vector<int32_t> src(A.src, A.src + 2 * HD);  // buf columns: packed row at [0, W), rest row at [W, W + R)
    const int64_t per_block = (ob + GATHER_TILE - 1) / GATHER_TILE;
    const int64_t tiles = (A.n + ob - 1) / ob * per_block;  // some past n are empty
    const int64_t threads = team(A.threads, A.n);
#pragma omp parallel num_threads(threads)
    {
        std::vector<T> buf(GATHER_TILE * RW);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tiles; i++) {
            const int64_t b = i / per_block, t0 = b * ob + (i % per_block) * GATHER_TILE;
            const int64_t t1 = std::min(std::min(t0 + GATHER_TILE, b * ob + ob), A.n);
            if (t0 >= t1) continue;
            for (int64_t t = t0; t < t1; t++) {
                const int64_t pos = A.first + t;
                const T *p = (const T *)A.packed + (int64_t)A.packed_table[pos / bs] * A.packed_block_stride +
                             (pos % bs) * A.packed_row;
                std::memcpy(buf.data() + (t - t0) * RW, p, W * sizeof(T));
                if (R) {
                    const T *w = (const T *)A.window + (int64_t)A.window_table[pos / wbs] * A.window_block_stride +
                                 (pos % wbs) * A.window_row;
                    std::memcpy(buf.data() + (t - t0) * RW + W, w, R * sizeof(T));
                }
            }
            const int64_t block = A.out_table[b], place = t0 - b * ob;
            put_tile((T *)A.k + block * A.ks[0] + place * A.ks[2], A.ks[1], A.ks[2], A.ks[3], src.data(), H, D,
                     t1 - t0, buf.data(), RW);
            put_tile((T *)A.v + block * A.vs[0] + place * A.vs[2], A.vs[1], A.vs[2], A.vs[3], src.data() + HD, H, D,
                     t1 - t0, buf.data(), RW);
        }
    }
}

extern "C" int leank_cpu_gather(const GArgs *A) {
    if (A->block_size <= 0 || A->window_block <= 0 || A->first < 0 || A->n < 0 || A->H <= 0 || A->D <= 0 || A->threads < 1 || A->out_block <= 0) return 2;
    switch (A->elem) {
        case 4: gather_rows<uint32_t>(*A); return 0;
        case 2: gather_rows<uint16_t>(*A); return 0;
        default: return 2;
    }
}

// A step's own K/V rows [n, H, D] (token i at k + i * k_stride, its [H, D] one run) into pages of any strides, token i
// at slot slots[i] >= 0: block slots[i] / out_block, place slots[i] % out_block, element (head h, channel d) at
// block * s[0] + h * s[1] + place * s[2] + d * s[3] (ks for K, vs for V). What vLLM's cpu_attn_reshape_and_cache does
// for its vec layout (K transposed in a block), here in tiles of up to GATHER_TILE tokens at adjacent places of one
// block, split over the threads: the dense-prompt prefill puts a step's prompt chunks into its scratch with it.
struct PArgs {  // mirrored by _PArgs in cpu_decode.py: keep the order
    int64_t n, H, D, elem, threads;
    const void *k, *v;
    int64_t k_stride, v_stride;
    void *kout, *vout;
    int64_t out_block;
    int64_t ks[4], vs[4];
    const int64_t *slots;
};

template <class T>
static void put_rows(const PArgs &A) {
    const int64_t HD = A.H * A.D, ob = A.out_block;
    std::vector<int32_t> id(HD);
    for (int64_t j = 0; j < HD; j++) id[j] = (int32_t)j;
    std::vector<int64_t> starts, ends;  // tiles [start, end): runs of adjacent places in one block
    for (int64_t t = 0; t < A.n; t++) {
        const int64_t s = A.slots[t];
        if (s < 0) continue;  // a padding token
        if (!ends.empty() && ends.back() == t && A.slots[t - 1] == s - 1 && s % ob != 0 && t - starts.back() < GATHER_TILE)
            ends.back() = t + 1;
        else
            starts.push_back(t), ends.push_back(t + 1);
    }
    const int64_t tiles = (int64_t)starts.size();
    const int64_t threads = team(A.threads, A.n);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t t0 = starts[i], t1 = ends[i];
        const int64_t block = A.slots[t0] / ob, place = A.slots[t0] % ob;
        put_tile((T *)A.kout + block * A.ks[0] + place * A.ks[2], A.ks[1], A.ks[2], A.ks[3], id.data(), A.H, A.D,
                 t1 - t0, (const T *)A.k + t0 * A.k_stride, A.k_stride);
        put_tile((T *)A.vout + block * A.vs[0] + place * A.vs[2], A.vs[1], A.vs[2], A.vs[3], id.data(), A.H, A.D,
                 t1 - t0, (const T *)A.v + t0 * A.v_stride, A.v_stride);
    }
}

extern "C" int leank_cpu_put(const PArgs *A) {
    if (A->n < 0 || A->H <= 0 || A->D <= 0 || A->threads < 1 || A->out_block <= 0) return 2;
    switch (A->elem) {
        case 4: put_rows<uint32_t>(*A); return 0;
        case 2: put_rows<uint16_t>(*A); return 0;
        default: return 2;
    }
}
