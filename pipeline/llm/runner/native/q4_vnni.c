/* int4-weight × int8-activation GEMM for CPU decode (AVX-512 VNNI), voxpipe.
 *
 * y[m, n] = Σ_k W[n, k] · x[m, k] with W[n, k] = q[n, k] · scale[n, g] + min[n, g], q in 0..15,
 * g = k / 32 (groups of 32 along K). The activations are quantized per row and group to int8
 * (d = max|x| / 127, the Q8_0 scheme of llama.cpp's ggml-quants.c) so that one
 * vpdpbusd multiplies 16 outputs × 4 weights; the min term uses the exact fp32 group sum:
 *   Σ_k W x = Σ_g scale[n,g] · d[g] · Σ_k q[n,k] · xq[k]  +  min[n,g] · Σ_k x[k].
 *
 * Weight layout (built by pipeline/llm/runner/native/q4.py): tiles of 16 outputs; per tile t
 * and group g, 256 bytes: for p in 0..3, 64 bytes, byte 4·i + j (i: output 0..15, j: 0..3)
 *   = q[16t+i][32g+8p+j] | q[16t+i][32g+8p+4+j] << 4,
 * so one 64-byte load unpacks into two vpdpbusd operands (low and high nibbles). Scales and
 * mins: fp16, per (t, g) 16 scales then 16 mins (one cache line).
 *
 * Each weight tile is unpacked once for up to 8 activation rows, so a step of several
 * decoding requests reads and unpacks the weights once. Tiles are split across OpenMP
 * threads (the libgomp torch loads, by soname).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

#define GROUP 32
#define MAX_ROWS 8
#define PREFETCH 2048 /* bytes of packed weights ahead (8 groups); other distances and L2 hints: docs/BENCHMARKS.md */

typedef int32_t __attribute__((may_alias, aligned(1))) i32u; /* 4 activation bytes read as one int32 */

/* per row and group of 32: d = max|x| / 127, xq = round(x / d) (nearest even, as lrintf),
 * and the fp32 sum of the group's unquantized values (the min term); 16 lanes at a time: it runs
 * serially before the parallel tiles, so a scalar loop here shows in every step. */
static void quantize_rows(const uint16_t *x, int M, int K, int8_t *xq, float *dx, float *xs) {
    int G = K / GROUP;
    for (int m = 0; m < M; m++) {
        for (int g = 0; g < G; g++) {
            const uint16_t *src = x + (size_t)m * K + g * GROUP;
            __m512 a = bf16_load16(src), b = bf16_load16(src + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            __m512 vid = _mm512_set1_ps(id);
            int8_t *out = xq + ((size_t)m * G + g) * GROUP;
            _mm_storeu_si128((__m128i *)out, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, vid))));
            _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, vid))));
            dx[(size_t)m * G + g] = d;
            xs[(size_t)m * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        }
    }
}

/* y (fp32 or, with bf16_out, bf16 rounded to nearest even) = acc + bias */
static inline void store(void *y, size_t at, __m512 acc, const float *bias, int n0, int bf16_out) {
    if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias + n0));
    if (!bf16_out) {
        _mm512_storeu_ps((float *)y + at, acc);
        return;
    }
    bf16_store16((uint16_t *)y + at, acc);
}

static inline __attribute__((always_inline)) void tile(const uint8_t *w, const uint16_t *sm, int G,
                                                       const int8_t *xq, const float *dx, const float *xs,
                                                       void *y, const float *bias, int bf16_out, int N, int t,
                                                       const int R) {
    __m512 acc[MAX_ROWS];
    const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 8
    for (int m = 0; m < R; m++) acc[m] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *wg = w + ((size_t)t * G + g) * 256;
        if (R > 1) { /* weights and scales ~8 groups ahead: at 8 rows the pass took 6 % less (Qwen2.5-0.5B, 2
                      * threads); a batch-1 pass is bound by the memory bandwidth and gains nothing */
            for (int l = 0; l < 256; l += 64) _mm_prefetch((const char *)(wg + PREFETCH + l), _MM_HINT_T0);
            _mm_prefetch((const char *)(sm + ((size_t)t * G + g) * 32 + PREFETCH / 8), _MM_HINT_T0);
        }
        __m512i ia[MAX_ROWS];
#pragma GCC unroll 8
        for (int m = 0; m < R; m++) ia[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            __m512i v = _mm512_loadu_si512((const void *)(wg + p * 64));
            __m512i lo = _mm512_and_si512(v, low);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 8
            for (int m = 0; m < R; m++) {
                const int8_t *xm = xq + ((size_t)m * G + g) * GROUP + 8 * p;
                /* = _mm512_dpbusd_epi32(ia[m], lo, _mm512_set1_epi32(4 bytes at xm)), with the broadcast
                 * folded into the instruction's memory operand ({1to16}): GCC 12 emits a separate
                 * vpbroadcastd for each (2 % of an 8-row pass) */
                __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(ia[m]) : [w] "v"(lo),
                        [x] "m"(*(const i32u *)xm));
                __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(ia[m]) : [w] "v"(hi),
                        [x] "m"(*(const i32u *)(xm + 4)));
            }
        }
        const uint16_t *sg = sm + ((size_t)t * G + g) * 32;
        __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sg));
        __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sg + 16)));
#pragma GCC unroll 8
        for (int m = 0; m < R; m++) {
            __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(dx[(size_t)m * G + g]));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m]), sd, acc[m]);
            acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[(size_t)m * G + g]), acc[m]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < R; m++) store(y, (size_t)m * N + 16 * t, acc[m], bias, 16 * t, bf16_out);
}

static void tile_rows(const uint8_t *w, const uint16_t *sm, int G, const int8_t *xq, const float *dx,
                      const float *xs, void *y, const float *bias, int bf16_out, int N, int t, int R) {
#define TILE_CASE(r) case r: tile(w, sm, G, xq, dx, xs, y, bias, bf16_out, N, t, r); break;
    switch (R) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7)
        default: tile(w, sm, G, xq, dx, xs, y, bias, bf16_out, N, t, 8); break;
    }
#undef TILE_CASE
}

/* kernels.h: x bf16 [M, K]; y [M, N] fp32, or bf16 when bf16_out; 0, or -1 with y untouched. */
int q4_gemm(const uint8_t *w, const uint16_t *sm, const uint16_t *x, const float *bias, void *y, int M, int N,
            int K, int threads, int bf16_out) {
    if (M <= 0 || N <= 0 || K <= 0 || N % 16 || K % GROUP) return -1;
    int G = K / GROUP, T = N / 16;
    int8_t *xq = malloc((size_t)M * K);
    float *dx = malloc(sizeof(float) * (size_t)M * G), *xs = malloc(sizeof(float) * (size_t)M * G);
    if (!xq || !dx || !xs) {
        free(xq); free(dx); free(xs);
        return -1;
    }
    quantize_rows(x, M, K, xq, dx, xs);
    size_t esize = bf16_out ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int t = 0; t < T; t++) {
        for (int m0 = 0; m0 < M; m0 += MAX_ROWS) {
            int r = M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS;
            tile_rows(w, sm, G, xq + (size_t)m0 * K, dx + (size_t)m0 * G, xs + (size_t)m0 * G,
                      (char *)y + (size_t)m0 * N * esize, bias, bf16_out, N, t, r);
        }
    }
    free(xq); free(dx); free(xs);
    return 0;
}
