// The quantised LeanK middle on the CPU: scores against the K codes and the product of the weights with the V
// codes, read as bytes (int8) or nibbles (int4) and never copied out as floats.
// Plain C++ (no PyTorch or Python headers), built by leank_infer/decode/quant_cpu.py and called through ctypes.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

#define GB 4   // query heads whose accumulators stay in registers at once
#define TT 64  // V: tokens whose weights are computed before their codes are read
#define K_AHEAD 512  // K: bytes ahead of the chunk fetched in every channel's row

struct KArgs {  // mirrored by _KArgs in quant_cpu.py: keep the order
    int64_t B, H, G, C, n, phase, k_group, per_byte;  // H heads of C kept channels, G query heads each
    const float *q;  // q[b*q_b + h*q_h + g*C + c]
    int64_t q_b, q_h;
    const uint8_t *codes;  // byte row r (channel r, int4: channels 2r, 2r+1) at slot s: codes[b*c_b + h*c_h + r*c_r + s]
    int64_t c_b, c_h, c_r;  // slot 0 is middle token -phase
    const uint16_t *scale, *minimum;  // float16 of channel c, K group j: [b*p_b + h*p_h + c*p_c + j]
    int64_t p_b, p_h, p_c;
    float *out;  // score of middle token t: out[b*o_b + h*o_h + g*o_g + t]
    int64_t o_b, o_h, o_g;
    double scaling;
    int64_t threads, split;  // split: slots per piece of work (a multiple of 32)
};

struct VArgs {  // mirrored by _VArgs in quant_cpu.py
    int64_t B, Hkv, G, Dv, n, per_byte;
    const float *p;  // weight of middle token t: p[b*p_b + h*p_h + g*p_g + t]
    int64_t p_b, p_h, p_g;
    const uint8_t *codes;  // V codes of stored head i, token t: codes[b*c_b + i*c_h + t*c_t + byte]
    int64_t c_b, c_h, c_t;
    const uint16_t *scale, *minimum;  // float16, one per token: [b*s_b + i*s_h + t*s_t]
    int64_t s_b, s_h, s_t;
    const int64_t *v_row;  // [Hkv]: stored head of KV head h, -1: none (no middle keys)
    float *out;  // out[b*o_b + h*o_h + g*o_g + d] += the middle's part
    int64_t o_b, o_h, o_g;
    int64_t threads, split;  // split: tokens per piece of work
};

// IEEE half to float (normals, subnormals, inf, NaN): one instruction with F16C, else integer ops only.
static inline float f16_f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t em = h & 0x7fffu, u = em << 13;
    float f;
    memcpy(&f, &u, 4);
    f *= 0x1p112f;
    memcpy(&u, &f, 4);
    if (em >= 0x7c00u) u |= 0x7f800000u;
    u |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&f, &u, 4);
    return f;
#endif
}

// 8 codes from p as floats: bytes (int8), or the low and the high nibbles (int4). GCC scalarises a generic
// uint8 -> int32 vector conversion, so with AVX2 the zero-extension is spelled out.
#if defined(__AVX2__)
static inline __m256i widen8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline v8 bytes8(const uint8_t *p) { return (v8)_mm256_cvtepi32_ps(widen8(p)); }
static inline void nibbles8(const uint8_t *p, v8 *lo, v8 *hi) {
    const __m256i x = widen8(p);
    *lo = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15)));
    *hi = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4));
}
#else
static inline v8i widen8(const uint8_t *p) { return (v8i){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]}; }
static inline v8 bytes8(const uint8_t *p) { return __builtin_convertvector(widen8(p), v8); }
static inline void nibbles8(const uint8_t *p, v8 *lo, v8 *hi) {
    const v8i x = widen8(p);
    *lo = __builtin_convertvector(x & 15, v8);
    *hi = __builtin_convertvector(x >> 4, v8);
}
#endif
static inline v8 splat(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 loadf(const float *p) {
    v8 r;
    memcpy(&r, p, 32);
    return r;
}
static inline void storef(float *p, v8 x) { memcpy(p, &x, 32); }

// ---- K scores ----------------------------------------------------------------------------------------
// s[t] = scaling * (sum_c q[c] * scale[c, j] * code[c, t] + sum_c q[c] * min[c, j]), j the K group of slot
// phase + t. The query times the scales (qs) and the minima's part (qm) of all the K groups of a piece are
// computed first, vectorised over the groups (contiguous in the parameters): done group by group in the token
// loop, they cost more than the codes themselves.
// qs[(c * G + g) * ng + j], channel c (C..cs-1: zero weights, int4's empty nibble); qm[g * ng + j]; j from j0.
static void k_params(const KArgs *a, const float *q, const uint16_t *sc, const uint16_t *mn, int64_t j0,
                     int64_t ng, float *qs, float *qm) {
    const int64_t C = a->C, G = a->G;
    const float scaling = (float)a->scaling;
    for (int64_t i = 0; i < G * ng; i++) qm[i] = 0.f;
    for (int64_t c = 0; c < C; c++) {
        const uint16_t *s = sc + c * a->p_c + j0, *m = mn + c * a->p_c + j0;
        for (int64_t g = 0; g < G; g++) {
            const float x = scaling * q[g * C + c];
            float *qs_row = qs + (c * G + g) * ng, *qm_row = qm + g * ng;
            int64_t j = 0;
#if defined(__F16C__)
            const v8 xv = splat(x);
            for (; j + 8 <= ng; j += 8) {
                const v8 sv = (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + j)));
                const v8 mv = (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + j)));
                storef(qs_row + j, xv * sv);
                storef(qm_row + j, loadf(qm_row + j) + xv * mv);
            }
#endif
            for (; j < ng; j++) {
                qs_row[j] = x * f16_f(s[j]);
                qm_row[j] += x * f16_f(m[j]);
            }
        }
    }
}

// One chunk of 8 * NV slots from slot s (a multiple of 8 * NV, inside K group j of the piece's parameters),
// query heads [g0, g0 + NG).
template <int NV, int PB, int NG>
static inline void k_chunk(const KArgs *a, const uint8_t *codes, const float *qs, const float *qm, int64_t ng,
                           int64_t j, int64_t s, int64_t s0, int64_t s1, int64_t g0, float *out) {
    const int64_t G = a->G;
    v8 acc[NG][NV];
    for (int g = 0; g < NG; g++)
        for (int v = 0; v < NV; v++) acc[g][v] = splat(qm[(g0 + g) * ng + j]);
    const int64_t rows = PB == 1 ? a->C : (a->C + 1) / 2;
    const float *w = qs + g0 * ng + j;  // channel c, head g0 + g: w[(c * G + g) * ng]
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = codes + r * a->c_r + s;
        __builtin_prefetch(row + K_AHEAD);  // one stream per channel: more than the hardware prefetcher follows
        if (PB == 1) {
            v8 x[NV];
            for (int v = 0; v < NV; v++) x[v] = bytes8(row + 8 * v);
            for (int g = 0; g < NG; g++) {
                const v8 wv = splat(w[(r * G + g) * ng]);
                for (int v = 0; v < NV; v++) acc[g][v] += wv * x[v];
            }
        } else {  // channel 2r in the low nibble, 2r + 1 in the high one (weight 0 past the last channel)
            v8 lo[NV], hi[NV];
            for (int v = 0; v < NV; v++) nibbles8(row + 8 * v, &lo[v], &hi[v]);
            for (int g = 0; g < NG; g++) {
                const v8 wl = splat(w[(2 * r * G + g) * ng]), wh = splat(w[((2 * r + 1) * G + g) * ng]);
                for (int v = 0; v < NV; v++) acc[g][v] += wl * lo[v] + wh * hi[v];
            }
        }
    }
    const int64_t lo_t = s0 > s ? s0 - s : 0, hi_t = s1 - s < 8 * NV ? s1 - s : 8 * NV;
    for (int g = 0; g < NG; g++) {
        float buf[8 * NV];
        memcpy(buf, acc[g], sizeof buf);
        float *o = out + (g0 + g) * a->o_g + s - a->phase;
        for (int64_t i = lo_t; i < hi_t; i++) o[i] = buf[i];
    }
}

template <int NV, int PB>
static void k_piece_vec(const KArgs *a, const uint8_t *codes, int64_t s0, int64_t s1, const float *qs,
                        const float *qm, int64_t j0, int64_t ng, float *out) {
    const int64_t W = 8 * NV, G = a->G;
    const int B = NV >= 4 ? 3 : GB;  // query heads per pass: their accumulators and the codes stay in registers
    for (int64_t s = s0 - s0 % W; s < s1; s += W) {
        const int64_t j = s / a->k_group - j0;
        int64_t g0 = 0;
        for (; g0 + B <= G; g0 += B) {
            if (B == 3)
                k_chunk<NV, PB, 3>(a, codes, qs, qm, ng, j, s, s0, s1, g0, out);
            else
                k_chunk<NV, PB, GB>(a, codes, qs, qm, ng, j, s, s0, s1, g0, out);
        }
        switch (G - g0) {
            case 1: k_chunk<NV, PB, 1>(a, codes, qs, qm, ng, j, s, s0, s1, g0, out); break;
            case 2: k_chunk<NV, PB, 2>(a, codes, qs, qm, ng, j, s, s0, s1, g0, out); break;
            case 3: k_chunk<NV, PB, 3>(a, codes, qs, qm, ng, j, s, s0, s1, g0, out); break;
            default: break;
        }
    }
}

// K groups smaller than 8 slots: one slot at a time.
static void k_piece_scalar(const KArgs *a, const uint8_t *codes, int64_t s0, int64_t s1, const float *qs,
                           const float *qm, int64_t j0, int64_t ng, float *out) {
    for (int64_t s = s0; s < s1; s++) {
        const int64_t j = s / a->k_group - j0;
        for (int64_t g = 0; g < a->G; g++) {
            float acc = qm[g * ng + j];
            for (int64_t c = 0; c < a->C; c++) {
                const uint8_t byte = codes[(a->per_byte == 1 ? c : c / 2) * a->c_r + s];
                const int code = a->per_byte == 1 ? byte : (c % 2 ? byte >> 4 : byte & 15);
                acc += qs[(c * a->G + g) * ng + j] * (float)code;
            }
            out[g * a->o_g + s - a->phase] = acc;
        }
    }
}

extern "C" int leank_quant_k_scores(const KArgs *a) {
    if (a->B < 0 || a->H < 0 || a->G < 1 || a->C < 1 || a->n < 0 || a->phase < 0 || a->k_group < 1 ||
        (a->per_byte != 1 && a->per_byte != 2) || a->split < 32 || a->split % 32)
        return 2;
    if (a->n == 0) return 0;
    const int64_t first = a->phase / a->split, last = (a->phase + a->n + a->split - 1) / a->split;
    const int64_t per_head = last - first, pieces = a->B * a->H * per_head;
    const int64_t cs = a->C + (a->C % 2);  // channels of qs: even, the padding one's weights 0
    int err = 0;
#pragma omp parallel for schedule(dynamic) num_threads(a->threads) if (a->threads > 1 && pieces > 1)
    for (int64_t i = 0; i < pieces; i++) {
        const int64_t bh = i / per_head, p = first + i % per_head, b = bh / a->H, h = bh % a->H;
        const int64_t s0 = p * a->split > a->phase ? p * a->split : a->phase;
        const int64_t end = (p + 1) * a->split, s1 = end < a->phase + a->n ? end : a->phase + a->n;
        const int64_t j0 = s0 / a->k_group, ng = (s1 - 1) / a->k_group - j0 + 1;  // the piece's K groups
        float *qs = (float *)calloc((size_t)((cs + 1) * a->G * ng), sizeof(float));
        if (!qs) {
#pragma omp atomic write
            err = 1;
            continue;
        }
        float *qm = qs + cs * a->G * ng;
        const float *q = a->q + b * a->q_b + h * a->q_h;
        const uint8_t *codes = a->codes + b * a->c_b + h * a->c_h;
        const uint16_t *sc = a->scale + b * a->p_b + h * a->p_h, *mn = a->minimum + b * a->p_b + h * a->p_h;
        float *out = a->out + b * a->o_b + h * a->o_h;
        k_params(a, q, sc, mn, j0, ng, qs, qm);
        const int64_t kg = a->k_group;
        if (kg % 32 == 0)
            (a->per_byte == 1 ? k_piece_vec<4, 1> : k_piece_vec<4, 2>)(a, codes, s0, s1, qs, qm, j0, ng, out);
        else if (kg % 16 == 0)
            (a->per_byte == 1 ? k_piece_vec<2, 1> : k_piece_vec<2, 2>)(a, codes, s0, s1, qs, qm, j0, ng, out);
        else if (kg % 8 == 0)
            (a->per_byte == 1 ? k_piece_vec<1, 1> : k_piece_vec<1, 2>)(a, codes, s0, s1, qs, qm, j0, ng, out);
        else
            k_piece_scalar(a, codes, s0, s1, qs, qm, j0, ng, out);
        free(qs);
    }
    return err;
}

// ---- V ---------------------------------------------------------------------------------------------
// sum_t p[t] * (code[t, d] * scale[t] + min[t]) = sum_t (p[t] * scale[t]) * code[t, d] + sum_t p[t] * min[t]:
// per piece of tokens, acc[g, .] (int4: even channels, then odd ones) and the minima's sum msum[g].
template <int PB, int NG>
static inline void v_block(const VArgs *a, const uint8_t *codes, const float *w, int64_t t0, int64_t tn,
                           int64_t col, int64_t g0, float *acc) {
    const int64_t Dv = a->Dv, half = Dv / 2;
    v8 r[NG][2];
    for (int g = 0; g < NG; g++) {
        float *row = acc + (g0 + g) * Dv;
        r[g][0] = loadf(row + col);
        r[g][1] = loadf(row + (PB == 1 ? col + 8 : half + col));
    }
    for (int64_t t = 0; t < tn; t++) {
        const uint8_t *c = codes + (t0 + t) * a->c_t + col;
        v8 x0, x1;
        if (PB == 1) {
            x0 = bytes8(c);
            x1 = bytes8(c + 8);
        } else {
            nibbles8(c, &x0, &x1);
        }
        for (int g = 0; g < NG; g++) {
            const v8 ww = splat(w[(g0 + g) * TT + t]);
            r[g][0] += ww * x0;
            r[g][1] += ww * x1;
        }
    }
    for (int g = 0; g < NG; g++) {
        float *row = acc + (g0 + g) * Dv;
        storef(row + col, r[g][0]);
        storef(row + (PB == 1 ? col + 8 : half + col), r[g][1]);
    }
}

template <int PB>
static void v_piece(const VArgs *a, const float *p, const uint8_t *codes, const uint16_t *sc, const uint16_t *mn,
                    int64_t ta, int64_t tb, float *acc, float *msum, float *w) {
    const int64_t G = a->G, Dv = a->Dv, bytes = PB == 1 ? Dv : Dv / 2, step = PB == 1 ? 16 : 8;
    for (int64_t t0 = ta; t0 < tb; t0 += TT) {
        const int64_t tn = tb - t0 < TT ? tb - t0 : TT;
        float sf[TT], mf[TT];
        for (int64_t t = 0; t < tn; t++) {
            sf[t] = f16_f(sc[(t0 + t) * a->s_t]);
            mf[t] = f16_f(mn[(t0 + t) * a->s_t]);
        }
        for (int64_t g = 0; g < G; g++) {  // the weights times the scales; the minima's part in 8 lanes
            const float *pg = p + g * a->p_g + t0;
            float *wg = w + g * TT;
            v8 ms = splat(0.f);
            int64_t t = 0;
            for (; t + 8 <= tn; t += 8) {
                const v8 x = loadf(pg + t);
                storef(wg + t, x * loadf(sf + t));
                ms += x * loadf(mf + t);
            }
            float m = ((ms[0] + ms[1]) + (ms[2] + ms[3])) + ((ms[4] + ms[5]) + (ms[6] + ms[7]));
            for (; t < tn; t++) {
                wg[t] = pg[t] * sf[t];
                m += pg[t] * mf[t];
            }
            msum[g] += m;
        }
        int64_t col = 0;
        for (; col + step <= bytes; col += step) {
            int64_t g0 = 0;
            for (; g0 + GB <= G; g0 += GB) v_block<PB, GB>(a, codes, w, t0, tn, col, g0, acc);
            switch (G - g0) {
                case 1: v_block<PB, 1>(a, codes, w, t0, tn, col, g0, acc); break;
                case 2: v_block<PB, 2>(a, codes, w, t0, tn, col, g0, acc); break;
                case 3: v_block<PB, 3>(a, codes, w, t0, tn, col, g0, acc); break;
                default: break;
            }
        }
        for (; col < bytes; col++)  // the bytes past the last whole vector
            for (int64_t g = 0; g < G; g++)
                for (int64_t t = 0; t < tn; t++) {
                    const uint8_t c = codes[(t0 + t) * a->c_t + col];
                    const float ww = w[g * TT + t];
                    if (PB == 1) {
                        acc[g * Dv + col] += ww * (float)c;
                    } else {
                        acc[g * Dv + col] += ww * (float)(c & 15);
                        acc[g * Dv + Dv / 2 + col] += ww * (float)(c >> 4);
                    }
                }
    }
}

extern "C" int leank_quant_v_add(const VArgs *a) {
    if (a->B < 0 || a->Hkv < 0 || a->G < 1 || a->Dv < 1 || a->n < 0 || (a->per_byte != 1 && a->per_byte != 2) ||
        (a->per_byte == 2 && a->Dv % 2) || a->split < 1)
        return 2;
    const int64_t per_head = (a->n + a->split - 1) / a->split, pieces = a->B * a->Hkv * per_head;
    const int64_t G = a->G, Dv = a->Dv, stride = G * Dv + G;  // a piece's partial: acc [G, Dv], msum [G]
    if (pieces == 0) return 0;
    float *part = (float *)calloc((size_t)(pieces * stride), sizeof(float));
    if (!part) return 1;
    int err = 0;
#pragma omp parallel num_threads(a->threads) if (a->threads > 1 && pieces > 1)
    {
        float *w = (float *)malloc((size_t)(G * TT) * sizeof(float));
        if (!w) {
#pragma omp atomic write
            err = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < pieces; i++) {
            const int64_t bh = i / per_head, j = i % per_head, b = bh / a->Hkv, h = bh % a->Hkv;
            const int64_t vi = a->v_row[h];
            if (vi < 0 || !w) continue;
            const int64_t ta = j * a->split, tb = ta + a->split < a->n ? ta + a->split : a->n;
            float *acc = part + i * stride;
            const float *p = a->p + b * a->p_b + h * a->p_h;
            const uint8_t *codes = a->codes + b * a->c_b + vi * a->c_h;
            const uint16_t *sc = a->scale + b * a->s_b + vi * a->s_h, *mn = a->minimum + b * a->s_b + vi * a->s_h;
            (a->per_byte == 1 ? v_piece<1> : v_piece<2>)(a, p, codes, sc, mn, ta, tb, acc, acc + G * Dv, w);
        }
        free(w);
        // the pieces of each (row, head) summed in their order: the same bits at any thread count
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < a->B * a->Hkv; bh++) {
            const int64_t b = bh / a->Hkv, h = bh % a->Hkv;
            if (a->v_row[h] < 0 || err) continue;
            const float *first = part + bh * per_head * stride;
            for (int64_t g = 0; g < G; g++) {
                float m = 0.f;
                for (int64_t j = 0; j < per_head; j++) m += first[j * stride + G * Dv + g];
                float *o = a->out + b * a->o_b + h * a->o_h + g * a->o_g;
                for (int64_t d = 0; d < Dv; d++) {
                    const int64_t src = a->per_byte == 1 ? d : (d % 2 ? Dv / 2 + d / 2 : d / 2);
                    float s = 0.f;
                    for (int64_t j = 0; j < per_head; j++) s += first[j * stride + g * Dv + src];
                    o[d] += s + m;
                }
            }
        }
    }
    free(part);
    return err;
}
