/* Decode attention on CPU (AVX-512), voxpipe: one query token per row over the row's own columns.
 *
 * out[b, h, :] = softmax_t(scale · q[b, h, :] · k[b, h / G, t, :]) · v[b, h / G, t, :]  for t in
 * [start[b], end[b]), G = H / KV (grouped-query attention: query head h reads KV head h / G). A decode
 * step's rows end at T; a prompt chunk's tokens are rows over one shared KV, token i ending at
 * past + i + 1 (causal).
 *
 * One task per (row, KV head) computes all G query heads of that KV head, so each key and value
 * row is read and widened to fp32 once for G heads. Scores go 16 columns at a time (16 partial dot
 * products per head, reduced together by a transpose-and-add tree); the weighted sum of values keeps
 * up to 8 heads × 32 dimensions in registers (faster than one horizontal sum per score and sums kept
 * in memory: docs/BENCHMARKS.md). Sums run in fp32 in a fixed order over the
 * row's own columns only, and a task never depends on another row or on the thread count: a row
 * gets the same bits whatever else is in the batch and however many threads run (batch-invariant
 * by construction). exp is the Cephes single-precision polynomial (range reduction by ln 2,
 * degree-6 minimax on [-ln2/2, ln2/2], ~1 ulp; Moshier, "Methods and Programs for Mathematical
 * Functions", 1989) scaled with vscalefps.
 *
 * Inputs are bf16 with the last dimension contiguous and any other strides (in elements); the
 * output is contiguous bf16 [B, H, D], rounded to nearest even.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

#define MAX_D 256

/* e^x for x <= 0 (scores minus their maximum); NaN stays NaN. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  /* below: e^x is 0 in fp32 */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* r[i] = the sum of v[i]'s 16 lanes, for i in 0..15: a transpose-and-add tree (45 shuffles and
 * adds for 16 sums; _mm512_reduce_add_ps takes ~8 dependent ones for each). */
static inline __m512 reduce16(const __m512 *v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: the lane's sums of v[4i .. 4i+3] */
        __m512d c = _mm512_castps_pd(w[2 * i]), d = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* out[g, 0 : 16·DC] (bf16) = inv[g] · Σ_t p[g, t] · v[t, 0 : 16·DC] for GB query heads: the sums in
 * registers, each value row widened once for all GB heads. */
static inline __attribute__((always_inline)) void pv(const float *p, long p_st, const uint16_t *v, long v_st,
                                                      int n, const float *inv, uint16_t *out, int D, const int GB,
                                                      const int DC) {
    __m512 acc[8][2];
    for (int g = 0; g < GB; g++)
        for (int c = 0; c < DC; c++) acc[g][c] = _mm512_setzero_ps();
    for (int t = 0; t < n; t++) {
        __m512 vc[2];
        for (int c = 0; c < DC; c++) vc[c] = bf16_load16(v + (size_t)t * v_st + 16 * c);
        for (int g = 0; g < GB; g++) {
            __m512 pt = _mm512_set1_ps(p[(size_t)g * p_st + t]);
            for (int c = 0; c < DC; c++) acc[g][c] = _mm512_fmadd_ps(pt, vc[c], acc[g][c]);
        }
    }
    for (int g = 0; g < GB; g++)
        for (int c = 0; c < DC; c++) bf16_store16(out + (size_t)g * D + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
}

static void pv_heads(const float *p, long p_st, const uint16_t *v, long v_st, int n, const float *inv,
                     uint16_t *out, int D, int gb, int dc) {
#define PV_CASE(G_, C_) case (G_) * 2 + (C_) - 1: pv(p, p_st, v, v_st, n, inv, out, D, G_, C_); break;
    switch (gb * 2 + dc - 1) {
        PV_CASE(1, 1) PV_CASE(1, 2) PV_CASE(2, 1) PV_CASE(2, 2) PV_CASE(3, 1) PV_CASE(3, 2) PV_CASE(4, 1)
        PV_CASE(4, 2) PV_CASE(5, 1) PV_CASE(5, 2) PV_CASE(6, 1) PV_CASE(6, 2) PV_CASE(7, 1) PV_CASE(7, 2)
        PV_CASE(8, 1) default: pv(p, p_st, v, v_st, n, inv, out, D, 8, 2); break;
    }
#undef PV_CASE
}

/* scores s[g, 0 : nb] = scale · q[g] · kf[i] for the 16 widened key rows kf (rows past nb zero):
 * per head, 16 partial dot products reduced together. CC: D / 16, a constant where the compiler
 * can keep the head's query in registers. */
static inline __attribute__((always_inline)) void qk_heads(const float *qf, const float *kf, float *s, long s_st,
                                                            int G, int D, int nb, float scale, const int CC) {
    __mmask16 keep = (__mmask16)((1u << nb) - 1);
    for (int g = 0; g < G; g++) {
        const float *qg = qf + g * D;
        __m512 qc[16], part[16];
        for (int c = 0; c < CC; c++) qc[c] = _mm512_loadu_ps(qg + 16 * c);
        for (int i = 0; i < 16; i++) {
            __m512 a = _mm512_mul_ps(qc[0], _mm512_loadu_ps(kf + i * D));
            for (int c = 1; c < CC; c++) a = _mm512_fmadd_ps(qc[c], _mm512_loadu_ps(kf + i * D + 16 * c), a);
            part[i] = a;
        }
        _mm512_mask_storeu_ps(s + (size_t)g * s_st, keep, _mm512_mul_ps(reduce16(part), _mm512_set1_ps(scale)));
    }
}

static void qk_block(const float *qf, const float *kf, float *s, long s_st, int G, int D, int nb, float scale) {
    switch (D / 16) {
        case 1: qk_heads(qf, kf, s, s_st, G, D, nb, scale, 1); break;
        case 2: qk_heads(qf, kf, s, s_st, G, D, nb, scale, 2); break;
        case 4: qk_heads(qf, kf, s, s_st, G, D, nb, scale, 4); break;
        case 8: qk_heads(qf, kf, s, s_st, G, D, nb, scale, 8); break;
        default: qk_heads(qf, kf, s, s_st, G, D, nb, scale, D / 16); break;
    }
}

static int task(const uint16_t *q, long q_sh, const uint16_t *k, long k_st, const uint16_t *v, long v_st,
                uint16_t *out, int G, int n, int D, float scale) {
    const int C = D / 16;
    const long sc_st = n + 16;
    float *qf = malloc(sizeof(float) * ((size_t)G * D + (size_t)G * sc_st + 16 * (size_t)D));
    if (!qf) return -1;
    float *sc = qf + (size_t)G * D, *kf = sc + (size_t)G * sc_st;
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(qf + g * D + 16 * c, bf16_load16(q + g * q_sh + 16 * c));
    /* scores, 16 columns at a time: the key rows widened once, per head 16 partial dot products
     * (each a vector of 16 lane sums) reduced together */
    for (int t0 = 0; t0 < n; t0 += 16) {
        int nb = n - t0 < 16 ? n - t0 : 16;
        for (int i = 0; i < 16; i++)
            for (int c = 0; c < C; c++)
                _mm512_storeu_ps(kf + i * D + 16 * c, i < nb ? bf16_load16(k + (size_t)(t0 + i) * k_st + 16 * c)
                                                             : _mm512_setzero_ps());
        qk_block(qf, kf, sc + t0, sc_st, G, D, nb, scale);
    }
    /* softmax, unnormalized; 1/sum applied to the output */
    float inv[256];
    for (int g = 0; g < G; g++) {
        float *s = sc + (size_t)g * sc_st;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        int t = 0;
        for (; t + 16 <= n; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
        __mmask16 tail = (__mmask16)((1u << (n - t)) - 1);
        if (n - t) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + t));
        __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx)), sum = _mm512_setzero_ps();
        for (t = 0; t + 16 <= n; t += 16) {
            __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
            _mm512_storeu_ps(s + t, p);
            sum = _mm512_add_ps(sum, p);
        }
        if (n - t) {
            __m512 p = _mm512_maskz_mov_ps(tail, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), m)));
            _mm512_mask_storeu_ps(s + t, tail, p);
            sum = _mm512_add_ps(sum, p);
        }
        inv[g] = 1.f / _mm512_reduce_add_ps(sum);
    }
    /* weighted values: up to 8 heads × 32 columns of D at a time */
    for (int d0 = 0; d0 < D; d0 += 32)
        for (int g0 = 0; g0 < G; g0 += 8)
            pv_heads(sc + (size_t)g0 * sc_st, sc_st, v + d0, v_st, n, inv + g0, out + (size_t)g0 * D + d0, D,
                     G - g0 < 8 ? G - g0 : 8, D - d0 < 32 ? 1 : 2);
    free(qf);
    return 0;
}

/* kernels.h: q [B, H, D]; k, v [B, KV, T, D] (a stride of 0 shares one KV between rows, as a prompt
 * chunk's tokens do); row b attends columns [starts[b], ends[b]) (0 <= start < end <= T; ends NULL:
 * every row ends at T); out contiguous [B, H, D]. 0, or -1 on a bad shape or a failed allocation. */
int attn_decode(const uint16_t *q, int64_t q_sb, int64_t q_sh, const uint16_t *k, int64_t k_sb, int64_t k_sh,
                int64_t k_st, const uint16_t *v, int64_t v_sb, int64_t v_sh, int64_t v_st, const int *starts,
                const int *ends, uint16_t *out, int B, int H, int KV, int T, int D, float scale, int threads) {
    if (B <= 0 || KV <= 0 || T <= 0 || D <= 0 || D % 16 || D > MAX_D || H % KV || H / KV > 256) return -1;
    for (int b = 0; b < B; b++)
        if (starts[b] < 0 || (ends ? ends[b] > T || starts[b] >= ends[b] : starts[b] >= T)) return -1;
    const int G = H / KV;
    int failed = 0;
    /* tasks dealt out one at a time: a prompt chunk's rows grow by a column each (causal), so
     * contiguous blocks would leave the last thread the longest rows */
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1) reduction(| : failed)
    for (int task_id = 0; task_id < B * KV; task_id++) {
        int b = task_id / KV, h = task_id % KV, s = starts[b], e = ends ? ends[b] : T;
        failed |= task(q + b * q_sb + (long)h * G * q_sh, q_sh, k + b * k_sb + h * k_sh + s * k_st, k_st,
                       v + b * v_sb + h * v_sh + s * v_st, v_st, out + ((size_t)b * H + (size_t)h * G) * D, G,
                       e - s, D, scale);
    }
    return failed ? -1 : 0;
}
