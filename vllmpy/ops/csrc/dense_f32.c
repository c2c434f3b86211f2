/* Dense float32 linear layers on the CPU: out[m, n] = x[m, k] . W[n, k] (+ bias[n]).
 *
 * W is packed once into panels of 16 outputs, k-major: panel p holds W[16p .. 16p + 15, i]
 * for i = 0 .. k - 1 as k rows of 16 floats (zeros past the last output), so a panel is
 * one contiguous read. A tile of up to 6 activation rows by one panel keeps its 6 x 16
 * sums in twelve 8-lane registers: for each i, the panel's 16 weights are loaded once and
 * each row's x[r, i] is broadcast against them (24 multiply-adds a load pair).
 *
 * Each output's sum is one fused multiply-add chain over i = 0 .. k - 1 in order, in its
 * own lane, then the bias: the same operations whatever the call's row count or the
 * tile a row lands in. So a row's output does not depend on the rows beside it: a
 * speculative verify scores its drafts with the bits its one-token decodes would have
 * had, and a batch gives what its requests give one at a time.
 */

#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define F32_AVX2 1
#endif

#define NR 16 /* outputs a panel */
#define MR 6  /* activation rows a tile */

/* W [n, k] (row i at w + i * w_stride) into ceil(n / 16) panels of k x 16 floats */
void f32_pack(int64_t n, int64_t k, const float *w, int64_t w_stride, float *packed,
              int num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * k * NR;
        for (int64_t j = 0; j < NR; j++) {
            const int64_t row = p * NR + j;
            if (row < n) {
                const float *src = w + row * w_stride;
                for (int64_t i = 0; i < k; i++) dst[i * NR + j] = src[i];
            } else {
                for (int64_t i = 0; i < k; i++) dst[i * NR + j] = 0.0f;
            }
        }
    }
}

/* rows 0 .. mr - 1 of a panel's sums over inputs i0 .. i0 + kc - 1: each sum starts from
 * acc[r * 16 ..] (zero for the first inputs) and is stored back there, so a sum is one
 * chain over all k inputs in order however the inputs are blocked; mr is a constant
 * where this is inlined */
static inline __attribute__((always_inline)) void tile(
    int mr, const float *restrict x, int64_t x_stride, const float *restrict panel,
    int64_t kc, int first, float *restrict acc_mem) {
#ifdef F32_AVX2
    __m256 acc[MR][2];
    for (int r = 0; r < mr; r++) {
        acc[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_mem + r * NR);
        acc[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_mem + r * NR + 8);
    }
    for (int64_t i = 0; i < kc; i++) {
        const __m256 w0 = _mm256_loadu_ps(panel + i * NR);
        const __m256 w1 = _mm256_loadu_ps(panel + i * NR + 8);
        for (int r = 0; r < mr; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + i);
            acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(acc_mem + r * NR, acc[r][0]);
        _mm256_storeu_ps(acc_mem + r * NR + 8, acc[r][1]);
    }
#else
    for (int r = 0; r < mr; r++) {
        float *sums = acc_mem + r * NR;
        if (first)
            for (int j = 0; j < NR; j++) sums[j] = 0.0f;
        const float *xr = x + r * x_stride;
        for (int64_t i = 0; i < kc; i++)
            for (int j = 0; j < NR; j++)
                sums[j] = __builtin_fmaf(panel[i * NR + j], xr[i], sums[j]);
    }
#endif
}

#define TILE_CASE(R)                                                                     \
    case R:                                                                              \
        tile(R, xr + i0, x_stride, panel + i0 * NR, kc, i0 == 0, acc + r0 * NR);          \
        break;

/* Inputs a block: a panel's block (KC x 16 floats, 16 KiB) stays in L1 while every row
 * tile passes over it */
#define KC 256
/* Rows a chunk: a chunk's activations (about 512 KiB of them, 24 to 192 rows) stay in L2
 * while every panel passes over them */
#define CHUNK_BYTES (512 * 1024)

/* out[r * out_stride + j] = x[r] . W[j] (+ bias[j]) for r < m, j < n, from f32_pack's
 * panels; x row r at x + r * x_stride; bias may be NULL */
void f32_linear(int64_t m, int64_t n, int64_t k, const float *x, int64_t x_stride,
                const float *packed, const float *bias, float *out, int64_t out_stride,
                int num_threads) {
    const int64_t panels = (n + NR - 1) / NR;
    int64_t chunk = CHUNK_BYTES / (k * 4) / MR * MR;
    chunk = chunk < 4 * MR ? 4 * MR : (chunk > 32 * MR ? 32 * MR : chunk);
#pragma omp parallel num_threads(num_threads)
    {
        /* a panel's running sums for the chunk's rows, between input blocks */
        float *acc = (float *)aligned_alloc(64, (size_t)(chunk * NR * 4));
        for (int64_t c0 = 0; c0 < m; c0 += chunk) {
            const int64_t rows_c = m - c0 < chunk ? m - c0 : chunk;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                const float *panel = packed + p * k * NR;
                for (int64_t i0 = 0; i0 < k; i0 += KC) {
                    const int64_t kc = k - i0 < KC ? k - i0 : KC;
                    for (int64_t r0 = 0; r0 < rows_c; r0 += MR) {
                        const float *xr = x + (c0 + r0) * x_stride;
                        switch (rows_c - r0 < MR ? (int)(rows_c - r0) : MR) {
                            TILE_CASE(1)
                            TILE_CASE(2)
                            TILE_CASE(3)
                            TILE_CASE(4)
                            TILE_CASE(5)
                            TILE_CASE(6)
                        }
                    }
                }
                const int width = n - p * NR < NR ? (int)(n - p * NR) : NR;
                const float *b = bias ? bias + p * NR : 0;
                for (int64_t r = 0; r < rows_c; r++) {
                    float *o = out + (c0 + r) * out_stride + p * NR;
                    const float *sums = acc + r * NR;
                    for (int j = 0; j < width; j++) o[j] = b ? sums[j] + b[j] : sums[j];
                }
            }
        }
        free(acc);
    }
}
