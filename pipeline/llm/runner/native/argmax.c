/* Greedy decoding's argmax over bf16 logits (AVX-512), voxpipe.
 *
 * out[r] = the index of the largest of x[r, 0..n) read as fp32 (a bf16 is the top half of an
 * fp32, so the widening is exact): the first one on ties, the first NaN if there is one, 0 if
 * every value is -inf, which is torch.argmax's answer on the same values. PyTorch's argmax over a
 * large vocabulary (a bf16 argmax, or an fp32 copy and its argmax) is a cost per row of every
 * decode step (docs/BENCHMARKS.md); this reads each logit once.
 *
 * Lane l of the running maximum sees columns l, l + 16, ...; a strict > keeps the earliest
 * index per lane, and the lanes are merged by value, then by the smallest index.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "kernels.h"

static int64_t argmax_row(const uint16_t *x, int64_t n) {
    int64_t vec = n - n % 16, best = 0;
    float top = bf16_to_f32(x[0]);
    if (vec >= 16) {
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        __m512i vidx = _mm512_setzero_si512(), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                       13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 nan = 0;
        for (int64_t i = 0; i < vec; i += 16) {
            __m512 v = bf16_load16(x + i);
            __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            vmax = _mm512_mask_mov_ps(vmax, gt, v);
            vidx = _mm512_mask_mov_epi32(vidx, gt, at);
            at = _mm512_add_epi32(at, step);
        }
        if (nan) {  /* rare: the first NaN, found by a scalar pass */
            for (int64_t i = 0; i < vec; i++)
                if (bf16_to_f32(x[i]) != bf16_to_f32(x[i])) return i;
        }
        top = _mm512_reduce_max_ps(vmax);
        __mmask16 is_top = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(top), _CMP_EQ_OQ);
        /* all -inf: no lane moved, every index is 0; else the smallest index among the top lanes */
        best = _mm512_mask_reduce_min_epi32(is_top, vidx);
    }
    for (int64_t i = vec; i < n; i++) {  /* the tail (and rows shorter than 16) */
        float v = bf16_to_f32(x[i]);
        if (v != v) {
            /* a NaN in the vector part was returned above; the first NaN is here */
            return i;
        }
        if (v > top) {
            top = v;
            best = i;
        }
    }
    return best;
}

/* kernels.h: x bf16 [rows, n], row stride `stride` (elements); out int64 [rows]. 0, or -1 on a bad
 * shape (out untouched). Column indices must fit int32 (n < 2^31). */
int argmax_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
    if (rows <= 0 || n <= 0 || n > INT32_MAX || stride < n) return -1;
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, n);
    return 0;
}
