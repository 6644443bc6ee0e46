/* bf16 <-> fp32 for voxpipe's kernels (AVX-512F; scalar for one value).
 *
 * A bf16 is the top 16 bits of an fp32, so widening is exact: shift the bits up by 16.
 * Narrowing rounds to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then keep
 * the top 16 bits (NaN and infinity are not special-cased: the kernels' outputs are finite
 * sums of finite inputs, or carry a NaN through).
 */
#ifndef VOXPIPE_BF16_H
#define VOXPIPE_BF16_H

#include <immintrin.h>
#include <stdint.h>

/* one bf16 -> fp32 */
static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)v << 16};
    return c.f;
}

/* 16 bf16 at p (no alignment needed) -> 16 fp32 */
static inline __m512 bf16_load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 fp32 -> 16 bf16 at p (no alignment needed), rounded to nearest even */
static inline void bf16_store16(uint16_t *p, __m512 x) {
    __m512i b = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
}

#endif
