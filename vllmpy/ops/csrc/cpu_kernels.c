/* CPU kernels for the steps where PyTorch's eager ops cost more than the work: paged
 * decode attention read straight from the cache blocks, and the fused elementwise parts of
 * a decoder layer (residual add + RMSNorm, NeoX rotary, SiLU-and-mul).
 *
 * Plain C with OpenMP, no PyTorch headers: vllmpy/ops/cpu_kernels.py builds it once per
 * machine with the system's C compiler (-O3 -march=native) and calls it through ctypes.
 * Threads come from the OpenMP runtime PyTorch has already loaded (the same libgomp.so.1),
 * so both share one pool. Values are float32 inside; tensors are float32, bfloat16 or
 * float16 (dtype codes below), rounded to nearest-even on the way out as PyTorch rounds.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

enum { F32 = 0, BF16 = 1, F16 = 2 };

static inline size_t elt_size(int dtype) { return dtype == F32 ? 4 : 2; }

/* n values of dtype at p (contiguous) into float dst */
static inline void load_row(const void *p, int dtype, float *restrict dst, int64_t n) {
    if (dtype == F32) {
        memcpy(dst, p, (size_t)n * 4);
    } else if (dtype == BF16) {
        const uint16_t *s = (const uint16_t *)p;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        const _Float16 *s = (const _Float16 *)p;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
    }
}

static inline void store_row(void *p, int dtype, const float *restrict src, int64_t n) {
    if (dtype == F32) {
        memcpy(p, src, (size_t)n * 4);
    } else if (dtype == BF16) {
        uint16_t *d = (uint16_t *)p;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        _Float16 *d = (_Float16 *)p;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = (_Float16)src[i];
    }
}

/* e^x in float32 to about 2 ulp (Cephes' expf polynomial on x - n ln 2, scaled by 2^n),
 * written so that the compiler vectorizes the loops that call it (libm's expf is a call
 * per value) */
static inline float exp_f32(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    /* n = round(x / ln 2): adding and taking away 1.5 * 2^23 rounds to an integer */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* x rounded to dtype and back (what PyTorch's op in that dtype hands the next op) */
static inline float round_to(float x, int dtype) {
    if (dtype == BF16) return bf16_to_f32(f32_to_bf16(x));
    if (dtype == F16) return (float)(_Float16)x;
    return x;
}

/* Attention of one-token queries over paged keys and values.
 *
 * Row r is the query of token q_tokens[r] (q: [tokens, num_heads, head_dim] with the
 * given strides), for a request seq_lens[r] long whose blocks are
 * block_table[table_rows[r] * table_stride ...]. The caches hold [num_blocks, block_size,
 * num_kv_heads, head_dim] with the given element strides (keys and values alike). A
 * query sees its request's last `window` keys (window 0: all of them). Scores are scale *
 * q.k, capped to softcap * tanh(s / softcap) when softcap > 0; sinks (one logit per query
 * head, or NULL) join each softmax's denominator. The output row of token q_tokens[r]
 * goes to out (same layout as q, out_dtype). */
/* Keys and values read ahead of the one in hand (software prefetch) */
#define AHEAD 8

/* One (query row, kv head) item of decode_attention: its group of query heads over the
 * item's n keys and values. Always inlined, so that a call with a constant head_dim (the
 * common 64 and 128) is compiled with fixed-length inner loops that stay in registers. */
static inline __attribute__((always_inline)) void attend_item(
    const int64_t group, const int64_t dim, const char *qbase, int64_t q_head_stride,
    int q_dtype, const void *k_cache, const void *v_cache, int kv_dtype, int64_t block_stride,
    int64_t token_stride, int64_t head_stride, int64_t block_size, const int32_t *table,
    int64_t h, int64_t start, int64_t len, float scale, float softcap, const float *sinks,
    char *obase, int64_t out_head_stride, int out_dtype, float *restrict scores,
    float *restrict qf, float *restrict acc, float *restrict row) {
    const size_t kv_elt = elt_size(kv_dtype), q_elt = elt_size(q_dtype),
                 out_elt = elt_size(out_dtype);
    const int64_t n = len - start;
    for (int64_t g = 0; g < group; g++) {
        load_row(qbase + (size_t)((h * group + g) * q_head_stride) * q_elt, q_dtype,
                 qf + g * dim, dim);
        for (int64_t d = 0; d < dim; d++) qf[g * dim + d] *= scale;
    }
    for (int64_t t = start; t < len; t++) {
        const int64_t at = (int64_t)table[t / block_size] * block_stride +
                           (t % block_size) * token_stride + h * head_stride;
        if (t + AHEAD < len) { /* the row AHEAD keys on, on its way from memory */
            const int64_t u = t + AHEAD;
            const char *next = (const char *)k_cache +
                (size_t)((int64_t)table[u / block_size] * block_stride +
                         (u % block_size) * token_stride + h * head_stride) * kv_elt;
            for (int64_t b = 0; b < (int64_t)(dim * kv_elt); b += 64)
                __builtin_prefetch(next + b, 0, 3);
        }
        load_row((const char *)k_cache + (size_t)at * kv_elt, kv_dtype, row, dim);
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qf + g * dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; d++) dot += qg[d] * row[d];
            scores[g * n + (t - start)] = dot;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * n;
        if (softcap > 0.f)
            for (int64_t i = 0; i < n; i++) sg[i] = softcap * tanhf(sg[i] / softcap);
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t i = 0; i < n; i++) top = sg[i] > top ? sg[i] : top;
        const float sink = sinks ? sinks[h * group + g] : -INFINITY;
        if (sink > top) top = sink;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            sg[i] = exp_f32(sg[i] - top);
            sum += sg[i];
        }
        if (sinks) sum += expf(sink - top);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) sg[i] *= inv;
    }
    for (int64_t i = 0; i < group * dim; i++) acc[i] = 0.f;
    for (int64_t t = start; t < len; t++) {
        const int64_t at = (int64_t)table[t / block_size] * block_stride +
                           (t % block_size) * token_stride + h * head_stride;
        if (t + AHEAD < len) { /* the row AHEAD keys on, on its way from memory */
            const int64_t u = t + AHEAD;
            const char *next = (const char *)v_cache +
                (size_t)((int64_t)table[u / block_size] * block_stride +
                         (u % block_size) * token_stride + h * head_stride) * kv_elt;
            for (int64_t b = 0; b < (int64_t)(dim * kv_elt); b += 64)
                __builtin_prefetch(next + b, 0, 3);
        }
        load_row((const char *)v_cache + (size_t)at * kv_elt, kv_dtype, row, dim);
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * n + (t - start)];
            float *ag = acc + g * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) ag[d] += p * row[d];
        }
    }
    for (int64_t g = 0; g < group; g++)
        store_row(obase + (size_t)((h * group + g) * out_head_stride) * out_elt, out_dtype,
                  acc + g * dim, dim);
}

/* Attention of one-token queries over paged keys and values.
 *
 * Row r is the query of token q_tokens[r] (q: [tokens, num_heads, head_dim] with the
 * given strides), for a request seq_lens[r] long whose blocks are
 * block_table[table_rows[r] * table_stride ...]. The caches hold [num_blocks, block_size,
 * num_kv_heads, head_dim] with the given element strides (keys and values alike). A
 * query sees its request's last `window` keys (window 0: all of them). Scores are scale *
 * q.k, capped to softcap * tanh(s / softcap) when softcap > 0; sinks (one logit per query
 * head, or NULL) join each softmax's denominator. The output row of token q_tokens[r]
 * goes to out (same layout as q, out_dtype). */
void decode_attention(int64_t num_rows, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, const void *q, int64_t q_token_stride,
                      int64_t q_head_stride, int q_dtype, const int64_t *q_tokens,
                      const void *k_cache, const void *v_cache, int kv_dtype,
                      int64_t block_stride, int64_t token_stride, int64_t head_stride,
                      int64_t block_size, const int32_t *block_table, int64_t table_stride,
                      const int64_t *table_rows, const int64_t *seq_lens, float scale,
                      float softcap, int64_t window, const float *sinks, void *out,
                      int64_t out_token_stride, int64_t out_head_stride, int out_dtype,
                      int num_threads) {
    const int64_t group = num_heads / num_kv_heads, dim = head_dim;
    const size_t q_elt = elt_size(q_dtype), out_elt = elt_size(out_dtype);
    int64_t longest = 1;
    for (int64_t r = 0; r < num_rows; r++) longest = seq_lens[r] > longest ? seq_lens[r] : longest;
    const int64_t items = num_rows * num_kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        /* each thread's buffers, for the longest row: scores, queries, sums, one row */
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * longest));
        float *qf = (float *)malloc(sizeof(float) * (size_t)(group * dim));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(group * dim));
        float *row = (float *)malloc(sizeof(float) * (size_t)dim);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int64_t r = item / num_kv_heads, h = item % num_kv_heads;
            const int64_t len = seq_lens[r];
            const int64_t start = (window > 0 && len > window) ? len - window : 0;
            const int32_t *table = block_table + table_rows[r] * table_stride;
            const char *qbase = (const char *)q + (size_t)(q_tokens[r] * q_token_stride) * q_elt;
            char *obase = (char *)out + (size_t)(q_tokens[r] * out_token_stride) * out_elt;
#define ATTEND(G, D)                                                                        \
    attend_item(G, D, qbase, q_head_stride, q_dtype, k_cache, v_cache, kv_dtype,            \
                block_stride, token_stride, head_stride, block_size, table, h, start, len,  \
                scale, softcap, sinks, obase, out_head_stride, out_dtype, scores, qf, acc, row)
            if (dim == 64 && group == 1) ATTEND(1, 64);
            else if (dim == 64 && group == 3) ATTEND(3, 64);
            else if (dim == 64 && group == 4) ATTEND(4, 64);
            else if (dim == 64) ATTEND(group, 64);
            else if (dim == 128 && group == 1) ATTEND(1, 128);
            else if (dim == 128 && group == 4) ATTEND(4, 128);
            else if (dim == 128 && group == 8) ATTEND(8, 128);
            else if (dim == 128) ATTEND(group, 128);
            else ATTEND(group, dim);
#undef ATTEND
        }
        free(scores);
        free(qf);
        free(acc);
        free(row);
    }
}

/* RMSNorm of rows [rows, hidden] (row stride x_stride), optionally after adding the
 * residual: h = x + residual rounded to dtype (written to residual_out), then
 * out = weight * round(h * rsqrt(mean(h^2) + eps)), the product rounded to dtype. Without
 * a residual (NULL) h = x. All tensors share dtype; out and residual_out are contiguous. */
void add_rms_norm(int64_t rows, int64_t hidden, const void *x, int64_t x_stride,
                  const void *residual, int64_t residual_stride, const void *weight,
                  float eps, void *out, void *residual_out, int dtype, int num_threads) {
    const size_t elt = elt_size(dtype);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *h = (float *)malloc(sizeof(float) * (size_t)hidden * 3);
        float *tmp = h + hidden, *w = h + 2 * hidden;
        load_row((const char *)x + (size_t)(r * x_stride) * elt, dtype, h, hidden);
        if (residual) {
            load_row((const char *)residual + (size_t)(r * residual_stride) * elt, dtype, tmp,
                     hidden);
            for (int64_t i = 0; i < hidden; i++) h[i] = round_to(h[i] + tmp[i], dtype);
            store_row((char *)residual_out + (size_t)(r * hidden) * elt, dtype, h, hidden);
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < hidden; i++) ss += h[i] * h[i];
        const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
        load_row(weight, dtype, w, hidden);
        for (int64_t i = 0; i < hidden; i++) tmp[i] = w[i] * round_to(h[i] * inv, dtype);
        store_row((char *)out + (size_t)(r * hidden) * elt, dtype, tmp, hidden);
        free(h);
    }
}

/* NeoX rotary in place on the first rotary_dim dims of every head of q and k
 * ([tokens, heads, head_dim] with token strides q_stride / k_stride, heads contiguous at
 * head_dim): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin in float32, from cos_sin
 * [max_position, rotary_dim] float32 (cos first half, sin second) at positions[t]. */
void rotary_neox(int64_t tokens, const int64_t *positions, void *q, int64_t q_stride,
                 int64_t q_heads, void *k, int64_t k_stride, int64_t k_heads,
                 int64_t head_dim, int64_t rotary_dim, const float *cos_sin, int dtype,
                 int num_threads) {
    const size_t elt = elt_size(dtype);
    const int64_t half = rotary_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *cs = cos_sin + positions[t] * rotary_dim;
        float x[1024];
        for (int64_t which = 0; which < 2; which++) {
            char *base = which == 0 ? (char *)q + (size_t)(t * q_stride) * elt
                                    : (char *)k + (size_t)(t * k_stride) * elt;
            const int64_t heads = which == 0 ? q_heads : k_heads;
            for (int64_t hd = 0; hd < heads; hd++) {
                char *p = base + (size_t)(hd * head_dim) * elt;
                load_row(p, dtype, x, rotary_dim);
                float y[1024];
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    y[i] = x[i] * cs[i] - x[i + half] * cs[half + i];
                    y[i + half] = x[i + half] * cs[i] + x[i] * cs[half + i];
                }
                store_row(p, dtype, y, rotary_dim);
            }
        }
    }
}

/* out[r] = round(silu(x[r, :d])) * x[r, d:], the product rounded to dtype, for x
 * [rows, 2d] (row stride x_stride) and out [rows, d] contiguous. */
void silu_and_mul(int64_t rows, int64_t d, const void *x, int64_t x_stride, void *out,
                  int dtype, int num_threads) {
    const size_t elt = elt_size(dtype);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *a = (float *)malloc(sizeof(float) * (size_t)d * 2);
        float *b = a + d;
        const char *src = (const char *)x + (size_t)(r * x_stride) * elt;
        load_row(src, dtype, a, d);
        load_row(src + (size_t)d * elt, dtype, b, d);
        if (dtype == BF16) {
#pragma omp simd
            for (int64_t i = 0; i < d; i++)
                a[i] = bf16_to_f32(f32_to_bf16(a[i] / (1.f + exp_f32(-a[i])))) * b[i];
        } else if (dtype == F16) {
#pragma omp simd
            for (int64_t i = 0; i < d; i++)
                a[i] = (float)(_Float16)(a[i] / (1.f + exp_f32(-a[i]))) * b[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < d; i++) a[i] = a[i] / (1.f + exp_f32(-a[i])) * b[i];
        }
        store_row((char *)out + (size_t)(r * d) * elt, dtype, a, d);
        free(a);
    }
}
