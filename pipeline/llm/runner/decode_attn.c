/* Decode attention on CPU (AVX-512), voxpipe: one query token per row over the row's own columns.
 *
 * out[b, h, :] = softmax_t(scale · q[b, h, :] · k[b, h / G, t, :]) · v[b, h / G, t, :]  for t in
 * [start[b], end[b]), G = H / KV (grouped-query attention: query head h reads KV head h / G). A decode
 * step's rows end at T; a prompt chunk's tokens are rows over one shared KV, token i ending at
 * past + i + 1 (causal).
 *
 * One task per (row, KV head) computes all G query heads of that KV head, so each key and value
 * row is read and widened to fp32 once for G heads. Sums run in fp32 in a fixed order over the
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

#define MAX_D 256

static inline __m512 load_bf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

static inline void store_bf16(uint16_t *p, __m512 x) {
    __m512i b = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
}

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

static int task(const uint16_t *q, long q_sh, const uint16_t *k, long k_st, const uint16_t *v, long v_st,
                uint16_t *out, int G, int n, int D, float scale) {
    const int C = D / 16;
    float *qf = malloc(sizeof(float) * ((size_t)G * D + (size_t)G * (n + 16) + (size_t)G * D));
    if (!qf) return -1;
    float *sc = qf + (size_t)G * D, *acc = sc + (size_t)G * (n + 16);
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(qf + g * D + 16 * c, load_bf16(q + g * q_sh + 16 * c));
    /* scores */
    for (int t = 0; t < n; t++) {
        __m512 kc[MAX_D / 16];
        for (int c = 0; c < C; c++) kc[c] = load_bf16(k + (size_t)t * k_st + 16 * c);
        for (int g = 0; g < G; g++) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qf + g * D), kc[0]);
            for (int c = 1; c < C; c++) a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + 16 * c), kc[c], a);
            sc[(size_t)g * (n + 16) + t] = _mm512_reduce_add_ps(a) * scale;
        }
    }
    /* softmax, unnormalized; 1/sum applied to the output */
    float inv[256];
    for (int g = 0; g < G; g++) {
        float *s = sc + (size_t)g * (n + 16);
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
    /* weighted values */
    for (int i = 0; i < G * D; i += 16) _mm512_storeu_ps(acc + i, _mm512_setzero_ps());
    for (int t = 0; t < n; t++) {
        __m512 vc[MAX_D / 16];
        for (int c = 0; c < C; c++) vc[c] = load_bf16(v + (size_t)t * v_st + 16 * c);
        for (int g = 0; g < G; g++) {
            __m512 p = _mm512_set1_ps(sc[(size_t)g * (n + 16) + t]);
            float *a = acc + g * D;
            for (int c = 0; c < C; c++) _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(p, vc[c], _mm512_loadu_ps(a + 16 * c)));
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++)
            store_bf16(out + g * D + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * c), _mm512_set1_ps(inv[g])));
    free(qf);
    return 0;
}

/* q: [B, H, D] (strides q_sb, q_sh); k, v: [B, KV, T, D] (strides *_sb, *_sh, *_st; a stride of 0 shares
 * one KV between rows, as a prompt chunk's tokens do); starts, ends: [B], row b attends columns
 * [starts[b], ends[b]) (0 <= start < end <= T; ends NULL: every row ends at T); out: contiguous [B, H, D].
 * D % 16 == 0, D <= 256, H % KV == 0, H / KV <= 256. Returns 0, or -1 on a bad shape or a failed
 * allocation. */
int attn_decode(const uint16_t *q, long q_sb, long q_sh, const uint16_t *k, long k_sb, long k_sh, long k_st,
                const uint16_t *v, long v_sb, long v_sh, long v_st, const int *starts, const int *ends,
                uint16_t *out, int B, int H, int KV, int T, int D, float scale, int threads) {
    if (B <= 0 || KV <= 0 || T <= 0 || D <= 0 || D % 16 || D > MAX_D || H % KV || H / KV > 256) return -1;
    for (int b = 0; b < B; b++)
        if (starts[b] < 0 || (ends ? ends[b] > T || starts[b] >= ends[b] : starts[b] >= T)) return -1;
    const int G = H / KV;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1) reduction(| : failed)
    for (int task_id = 0; task_id < B * KV; task_id++) {
        int b = task_id / KV, h = task_id % KV, s = starts[b], e = ends ? ends[b] : T;
        failed |= task(q + b * q_sb + (long)h * G * q_sh, q_sh, k + b * k_sb + h * k_sh + s * k_st, k_st,
                       v + b * v_sb + h * v_sh + s * v_st, v_st, out + ((size_t)b * H + (size_t)h * G) * D, G,
                       e - s, D, scale);
    }
    return failed ? -1 : 0;
}
