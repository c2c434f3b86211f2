/* Linear layers over GGUF block-quantized weights on the CPU, read in their blocks.
 *
 * out[m, n] = sum_k x[m, k] * W[n, k], W stored as GGUF blocks, row n of W holding the
 * blocks of output n (Hugging Face orientation), as ggml writes them. Each output row's
 * blocks are decoded once per call into float32 weights (the values gguf-py's dequantize
 * gives, d * q + m in float32) in a per-thread row buffer, then multiplied with the
 * activation rows four at a time, in float32 with 8-wide accumulators. The weights are
 * read once per call however many rows there are, so a few rows (decode, a speculative
 * verify) cost about what one costs; the bytes read are the blocks', 4.5-8.5 bits a
 * weight instead of 32.
 *
 * Block layouts (ggml's; d, dmin and m are float16):
 *   Q4_0  18 bytes / 32:  d, qs[16]           w = d * (q - 8)
 *   Q4_1  20 bytes / 32:  d, m, qs[16]        w = d * q + m
 *   Q5_0  22 bytes / 32:  d, qh[4], qs[16]    w = d * (q - 16), q's fifth bit in qh
 *   Q5_1  24 bytes / 32:  d, m, qh[4], qs[16] w = d * q + m
 *   Q8_0  34 bytes / 32:  d, int8 qs[32]      w = d * q
 *   Q4_K 144 bytes / 256: d, dmin, scales[12] (8 six-bit scale/min pairs), qs[128]
 *   Q5_K 176 bytes / 256: d, dmin, scales[12], qh[32], qs[128]
 *   Q6_K 210 bytes / 256: ql[128], qh[64], int8 scales[16], d
 *   BF16  64 bytes / 32:  32 bfloat16 values (a dense bfloat16 row read as 32-weight
 *         "blocks": the dense path of a CPU without bfloat16 units)
 * In the 32-weight types, weight j < 16 is the low nibble of qs[j], weight j + 16 its high
 * nibble (and bit j, j + 16 of qh).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GGUF_AVX2 1
#endif

enum { GF32 = 0, GBF16 = 1, GF16 = 2 };
enum { Q4_0 = 0, Q4_1 = 1, Q5_0 = 2, Q5_1 = 3, Q8_0 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7,
       BF16 = 8 };

static inline float half_at(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

#ifndef GGUF_AVX2
/* 32 weights of a 4- or 5-bit block: w[j] = a * q[j] + b */
static inline void nibbles32(const uint8_t *restrict qs, uint32_t qh, int has_qh, float a,
                             float b, float *restrict w) {
    for (int j = 0; j < 16; j++) {
        float lo = (float)(qs[j] & 0x0F), hi = (float)(qs[j] >> 4);
        if (has_qh) {
            lo += (float)(((qh >> j) & 1u) << 4);
            hi += (float)(((qh >> (j + 16)) & 1u) << 4);
        }
        w[j] = a * lo + b;
        w[j + 16] = a * hi + b;
    }
}
#endif

/* the six-bit scale and min of sub-block j of a Q4_K / Q5_K super-block */
static inline void scale_min_k4(int j, const uint8_t *q, float *sc, float *mn) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *mn = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
        *mn = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

#ifndef GGUF_AVX2
/* one output row: ``k`` weights from ``blk`` (its blocks) into w (the portable path) */
static void decode_row(int qtype, const uint8_t *restrict blk, int64_t k, float *restrict w) {
    switch (qtype) {
    case Q4_0:
        for (int64_t i = 0; i < k; i += 32, blk += 18) {
            const float d = half_at(blk);
            nibbles32(blk + 2, 0, 0, d, -8.0f * d, w + i);
        }
        break;
    case Q4_1:
        for (int64_t i = 0; i < k; i += 32, blk += 20)
            nibbles32(blk + 4, 0, 0, half_at(blk), half_at(blk + 2), w + i);
        break;
    case Q5_0:
        for (int64_t i = 0; i < k; i += 32, blk += 22) {
            const float d = half_at(blk);
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            nibbles32(blk + 6, qh, 1, d, -16.0f * d, w + i);
        }
        break;
    case Q5_1:
        for (int64_t i = 0; i < k; i += 32, blk += 24) {
            uint32_t qh;
            memcpy(&qh, blk + 4, 4);
            nibbles32(blk + 8, qh, 1, half_at(blk), half_at(blk + 2), w + i);
        }
        break;
    case Q8_0:
        for (int64_t i = 0; i < k; i += 32, blk += 34) {
            const float d = half_at(blk);
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int j = 0; j < 32; j++) w[i + j] = d * (float)q[j];
        }
        break;
    case BF16:
        for (int64_t i = 0; i < k; i++) {
            uint16_t b;
            memcpy(&b, blk + 2 * i, 2);
            w[i] = bf16_to_f32(b);
        }
        break;
    case Q4_K: case Q5_K: /* Q5_K: Q4_K's layout with a fifth bit a weight in qh[32] */
        for (int64_t i = 0; i < k; blk += qtype == Q4_K ? 144 : 176, i += 256) {
            const float d = half_at(blk), dmin = half_at(blk + 2);
            const uint8_t *scales = blk + 4, *qh = blk + 16;
            const uint8_t *qs = blk + (qtype == Q4_K ? 16 : 48);
            for (int c = 0; c < 4; c++) { /* 64 weights: sub-blocks 2c (low), 2c + 1 (high) */
                float sc0, m0, sc1, m1;
                scale_min_k4(2 * c, scales, &sc0, &m0);
                scale_min_k4(2 * c + 1, scales, &sc1, &m1);
                const float a0 = d * sc0, b0 = -dmin * m0, a1 = d * sc1, b1 = -dmin * m1;
                const uint8_t *q = qs + 32 * c;
                float *o = w + i + 64 * c;
                for (int l = 0; l < 32; l++) {
                    int lo = q[l] & 0x0F, hi = q[l] >> 4;
                    if (qtype == Q5_K) {
                        lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                    }
                    o[l] = a0 * (float)lo + b0;
                    o[l + 32] = a1 * (float)hi + b1;
                }
            }
        }
        break;
    case Q6_K:
        for (int64_t i = 0; i < k; i += 256, blk += 210) {
            const float d = half_at(blk + 208);
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int h = 0; h < 2; h++) { /* 128 weights a half */
                const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
                const int8_t *s = sc + 8 * h;
                float *o = w + i + 128 * h;
                for (int l = 0; l < 32; l++) {
                    const int g = l / 16;
                    o[l] = d * s[g] * (float)(((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32);
                    o[l + 32] = d * s[g + 2] *
                                (float)(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
                    o[l + 64] = d * s[g + 4] * (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                    o[l + 96] = d * s[g + 6] *
                                (float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                }
            }
        }
        break;
    }
}
#endif

static inline void store_value(void *out, int64_t at, int dtype, float v) {
    if (dtype == GF32)
        ((float *)out)[at] = v;
    else if (dtype == GBF16)
        ((uint16_t *)out)[at] = f32_to_bf16(v);
    else
        ((_Float16 *)out)[at] = (_Float16)v;
}

#ifdef GGUF_AVX2
/* 8 unsigned bytes -> 8 floats, times a plus b */
static inline __m256 u8x8(__m128i q, __m256 a, __m256 b) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), a, b);
}

/* 32 unsigned bytes -> four vectors of 8 weights, times a plus b */
static inline void u8x32(__m256i q, __m256 a, __m256 b, __m256 *v) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    v[0] = u8x8(lo, a, b);
    v[1] = u8x8(_mm_srli_si128(lo, 8), a, b);
    v[2] = u8x8(hi, a, b);
    v[3] = u8x8(_mm_srli_si128(hi, 8), a, b);
}

/* 32 signed bytes -> four vectors; the first two times a, the last two times b */
static inline void i8x32(__m256i q, __m256 a, __m256 b, __m256 *v) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    v[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), a);
    v[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), a);
    v[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), b);
    v[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), b);
}

/* 16 bytes of nibbles (and 32 fifth bits of qh) -> the 32 weights a * q + b */
static inline void nibble_regs(const uint8_t *qs, uint32_t qh, int has_qh, float a, float b,
                               __m256 *v) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
    if (has_qh) {
        const __m128i spread = _mm_set_epi8(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m128i bit = _mm_set_epi8(-128, 64, 32, 16, 8, 4, 2, 1, -128, 64, 32, 16, 8,
                                         4, 2, 1);
        const __m128i sixteen = _mm_set1_epi8(0x10);
        __m128i m = _mm_shuffle_epi8(_mm_set1_epi16((short)(qh & 0xFFFFu)), spread);
        lo = _mm_or_si128(lo, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(m, bit), bit),
                                            sixteen));
        m = _mm_shuffle_epi8(_mm_set1_epi16((short)(qh >> 16)), spread);
        hi = _mm_or_si128(hi, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(m, bit), bit),
                                            sixteen));
    }
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    v[0] = u8x8(lo, va, vb);
    v[1] = u8x8(_mm_srli_si128(lo, 8), va, vb);
    v[2] = u8x8(hi, va, vb);
    v[3] = u8x8(_mm_srli_si128(hi, 8), va, vb);
}

/* Piece p (32 weights) of a block as four vectors of 8: the whole block of the 32-weight
 * types (p = 0); of a 256-weight super-block, its p-th 32 weights in order */
static inline __attribute__((always_inline)) void piece_regs(int qtype, const uint8_t *blk,
                                                             int p, __m256 *v) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    switch (qtype) {
    case Q4_0: {
        const float d = half_at(blk);
        nibble_regs(blk + 2, 0, 0, d, -8.0f * d, v);
        return;
    }
    case Q4_1:
        nibble_regs(blk + 4, 0, 0, half_at(blk), half_at(blk + 2), v);
        return;
    case Q5_0: case Q5_1: {
        uint32_t qh;
        const float d = half_at(blk);
        memcpy(&qh, blk + (qtype == Q5_0 ? 2 : 4), 4);
        if (qtype == Q5_0) nibble_regs(blk + 6, qh, 1, d, -16.0f * d, v);
        else nibble_regs(blk + 8, qh, 1, d, half_at(blk + 2), v);
        return;
    }
    case Q8_0: {
        const __m256 vd = _mm256_set1_ps(half_at(blk));
        i8x32(_mm256_loadu_si256((const __m256i *)(blk + 2)), vd, vd, v);
        return;
    }
    case BF16: /* a bfloat16 is the top half of its float32 */
        for (int j = 0; j < 4; j++) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(blk + 16 * j));
            v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        return;
    case Q4_K: case Q5_K: { /* 64-weight chunk c = p / 2: low nibbles, then high */
        const int c = p >> 1, high = p & 1;
        float sc, mn;
        scale_min_k4(p, blk + 4, &sc, &mn);
        const uint8_t *qs = blk + (qtype == Q4_K ? 16 : 48) + 32 * c;
        const __m256i q = _mm256_loadu_si256((const __m256i *)qs);
        __m256i n = high ? _mm256_and_si256(_mm256_srli_epi16(q, 4), low4)
                         : _mm256_and_si256(q, low4);
        if (qtype == Q5_K) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
            const __m256i b = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(p)),
                                               _mm256_set1_epi8(1));
            n = _mm256_or_si256(n, _mm256_slli_epi16(b, 4));
        }
        u8x32(n, _mm256_set1_ps(half_at(blk) * sc), _mm256_set1_ps(-half_at(blk + 2) * mn),
              v);
        return;
    }
    default: { /* Q6_K: half h = p / 4, group g = p % 4 of 32 */
        const int h = p >> 2, g = p & 3;
        const float d = half_at(blk + 208);
        const int8_t *s = (const int8_t *)(blk + 192) + 8 * h + 2 * g;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (g & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        const __m256i n = (g & 2) ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), low4)
                                  : _mm256_and_si256(ql, low4);
        const __m256i top = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)),
                                             _mm256_set1_epi8(3));
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(n, _mm256_slli_epi16(top, 4)),
                                          _mm256_set1_epi8(32));
        i8x32(q, _mm256_set1_ps(d * s[0]), _mm256_set1_ps(d * s[1]), v);
        return;
    }
    }
}

static inline int block_weights(int qtype) {
    return (qtype == Q4_K || qtype == Q5_K || qtype == Q6_K) ? 256 : 32;
}

static inline int block_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case BF16: return 64;
    case Q4_K: return 144;
    case Q5_K: return 176;
    default: return 210;
    }
}

static inline float hsum(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* Every row's product is summed the same way whatever the call's row count: four
 * chains of 8 lanes, chain j taking the j-th 8 weights of each piece of 32 (fused FMAs),
 * then ((c0 + c1) + c2) + c3 and its lanes pairwise. So a row's output does not depend on
 * the rows beside it: a speculative verify scores its drafts with the bits the one-token
 * decodes would have had, and a batch gives what its requests give one at a time. */
static inline float finish(__m256 c0, __m256 c1, __m256 c2, __m256 c3) {
    return hsum(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), c2), c3));
}

/* o[r] = x_r . W[n] for ``rows`` (1 or 2) rows, each piece decoded into registers and
 * used at once; qtype and rows are constants where this is inlined */
static inline __attribute__((always_inline)) void fused_rows(
    int qtype, int rows, const uint8_t *blk, int64_t k, const float *xf, float *o) {
    __m256 acc[2][4];
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    const int pieces = block_weights(qtype) / 32, bytes = block_bytes(qtype);
    __m256 v[4];
    for (int64_t i = 0; i < k; blk += bytes) {
        for (int p = 0; p < pieces; p++, i += 32) {
            piece_regs(qtype, blk, p, v);
            for (int r = 0; r < rows; r++) {
                const float *x = xf + r * k + i;
                for (int j = 0; j < 4; j++)
                    acc[r][j] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(x + 8 * j), acc[r][j]);
            }
        }
    }
    for (int r = 0; r < rows; r++) o[r] = finish(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

#define FUSED_CASE(T)                                                                    \
    case T:                                                                              \
        if (rows == 1) fused_rows(T, 1, blk, k, xf, o);                                  \
        else fused_rows(T, 2, blk, k, xf, o);                                            \
        break;

static void fused(int qtype, int rows, const uint8_t *blk, int64_t k, const float *xf,
                  float *o) {
    switch (qtype) {
        FUSED_CASE(Q4_0)
        FUSED_CASE(Q4_1)
        FUSED_CASE(Q5_0)
        FUSED_CASE(Q5_1)
        FUSED_CASE(Q8_0)
        FUSED_CASE(Q4_K)
        FUSED_CASE(Q5_K)
        FUSED_CASE(Q6_K)
        FUSED_CASE(BF16)
    }
}

/* the row's weights, as piece_regs gives them, into w */
#define DECODE_CASE(T)                                                                   \
    case T:                                                                              \
        for (int64_t i = 0; i < k; blk += block_bytes(T))                                \
            for (int p = 0; p < block_weights(T) / 32; p++, i += 32) {                   \
                piece_regs(T, blk, p, v);                                                \
                for (int j = 0; j < 4; j++) _mm256_storeu_ps(w + i + 8 * j, v[j]);       \
            }                                                                            \
        break;

static void decode_row_regs(int qtype, const uint8_t *blk, int64_t k, float *w) {
    __m256 v[4];
    switch (qtype) {
        DECODE_CASE(Q4_0)
        DECODE_CASE(Q4_1)
        DECODE_CASE(Q5_0)
        DECODE_CASE(Q5_1)
        DECODE_CASE(Q8_0)
        DECODE_CASE(Q4_K)
        DECODE_CASE(Q5_K)
        DECODE_CASE(Q6_K)
        DECODE_CASE(BF16)
    }
}

/* o[r] = x_r . w for ``rows`` (1 or 2) rows of a decoded row w, summed as fused_rows sums */
static inline void dot_rows(const float *w, const float *xf, int64_t k, int rows, float *o) {
    __m256 acc[2][4];
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 32)
        for (int j = 0; j < 4; j++) {
            const __m256 wv = _mm256_loadu_ps(w + i + 8 * j);
            acc[0][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xf + i + 8 * j), acc[0][j]);
            if (rows == 2)
                acc[1][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xf + k + i + 8 * j),
                                            acc[1][j]);
        }
    for (int r = 0; r < rows; r++) o[r] = finish(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}
#else
/* the portable order: four chains of 8 lanes per row, as above, lanes summed as hsum does */
static inline void dot_rows(const float *w, const float *xf, int64_t k, int rows, float *o) {
    for (int r = 0; r < rows; r++) {
        float c[4][8] = {{0}};
        const float *x = xf + r * k;
        for (int64_t i = 0; i < k; i += 32)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 8; l++) c[j][l] += w[i + 8 * j + l] * x[i + 8 * j + l];
        float t[8], h[4];
        for (int l = 0; l < 8; l++) t[l] = ((c[0][l] + c[1][l]) + c[2][l]) + c[3][l];
        for (int l = 0; l < 4; l++) h[l] = t[l] + t[l + 4];
        o[r] = (h[0] + h[2]) + (h[1] + h[3]);
    }
}
#endif

/* out[r * out_stride + n] = x[r] . W[n] for r < m, n < n_out; x: m rows of k values of
 * x_dtype, row r at x + r * x_stride (elements); w: n_out rows of w_row_bytes bytes */
void gguf_linear(int64_t m, int64_t n_out, int64_t k, const void *x, int64_t x_stride,
                 int x_dtype, const uint8_t *w, int64_t w_row_bytes, int qtype, void *out,
                 int64_t out_stride, int out_dtype, int num_threads) {
    /* the activations in float32, once */
    float *xf = (float *)aligned_alloc(64, (size_t)((m * k * 4 + 63) / 64 * 64));
    for (int64_t r = 0; r < m; r++) {
        float *dst = xf + r * k;
        if (x_dtype == GF32) {
            memcpy(dst, (const float *)x + r * x_stride, (size_t)k * 4);
        } else if (x_dtype == GBF16) {
            const uint16_t *s = (const uint16_t *)x + r * x_stride;
#pragma omp simd
            for (int64_t i = 0; i < k; i++) dst[i] = bf16_to_f32(s[i]);
        } else {
            const _Float16 *s = (const _Float16 *)x + r * x_stride;
#pragma omp simd
            for (int64_t i = 0; i < k; i++) dst[i] = (float)s[i];
        }
    }
#pragma omp parallel num_threads(num_threads)
    {
        float *wrow = (float *)aligned_alloc(64, (size_t)((k * 4 + 63) / 64 * 64));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < n_out; n++) {
            const uint8_t *blk = w + n * w_row_bytes;
            float o[2];
#ifdef GGUF_AVX2
            if (m <= 2) { /* one or two rows: the blocks go from registers to the products */
                fused(qtype, (int)m, blk, k, xf, o);
                for (int64_t r = 0; r < m; r++)
                    store_value(out, r * out_stride + n, out_dtype, o[r]);
                continue;
            }
            decode_row_regs(qtype, blk, k, wrow);
#else
            decode_row(qtype, blk, k, wrow);
#endif
            for (int64_t r = 0; r < m; r += 2) {
                const int rows = m - r >= 2 ? 2 : 1;
                dot_rows(wrow, xf + r * k, k, rows, o);
                for (int j = 0; j < rows; j++)
                    store_value(out, (r + j) * out_stride + n, out_dtype, o[j]);
            }
        }
        free(wrow);
    }
    free(xf);
}

/* W's rows n0 .. n0 + rows - 1, decoded, into out (rows x k of out_dtype, row-major) */
void gguf_dequantize(int64_t rows, int64_t k, const uint8_t *w, int64_t w_row_bytes,
                     int qtype, void *out, int out_dtype, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        float *wrow = (float *)aligned_alloc(64, (size_t)((k * 4 + 63) / 64 * 64));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < rows; n++) {
            float *dst = out_dtype == GF32 ? (float *)out + n * k : wrow;
#ifdef GGUF_AVX2
            decode_row_regs(qtype, w + n * w_row_bytes, k, dst);
#else
            decode_row(qtype, w + n * w_row_bytes, k, dst);
#endif
            if (out_dtype == GBF16) {
                uint16_t *o = (uint16_t *)out + n * k;
                for (int64_t i = 0; i < k; i++) o[i] = f32_to_bf16(wrow[i]);
            } else if (out_dtype == GF16) {
                _Float16 *o = (_Float16 *)out + n * k;
                for (int64_t i = 0; i < k; i++) o[i] = (_Float16)wrow[i];
            }
        }
        free(wrow);
    }
}
