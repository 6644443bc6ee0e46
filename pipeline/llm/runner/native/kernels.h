/* voxpipe's C kernels: every function the library exports.
 *
 * Each .c file includes this header, so the compiler checks each definition against its
 * prototype (and -Werror=missing-prototypes in the build refuses an exported function that
 * is not here). The Python side binds these through ctypes in bindings.py; a test
 * (tests/test_native_header.py) parses this file and checks every binding against it.
 *
 * bf16 values travel as uint16_t (their bits); every function returns 0, or -1 on a shape it
 * does not take or a failed allocation, and then writes nothing.
 */
#ifndef VOXPIPE_KERNELS_H
#define VOXPIPE_KERNELS_H

#include <stdint.h>

/* int4-weight × int8-activation GEMM (q4_vnni.c): y[M, N] = x[M, K] · W[N, K]^T + bias.
 * w, sm: the packed weights and fp16 scales/mins (layout in q4_vnni.c); x: bf16 [M, K];
 * bias: fp32 [N] or NULL; y: fp32 [M, N], or bf16 when bf16_out. N % 16 == 0, K % 32 == 0;
 * threads: OpenMP threads. */
int q4_gemm(const uint8_t *w, const uint16_t *sm, const uint16_t *x, const float *bias, void *y, int M, int N,
            int K, int threads, int bf16_out);

/* Decode attention (decode_attn.c): one query token per row over its own columns.
 * q: bf16 [B, H, D] (strides q_sb, q_sh, in elements); k, v: bf16 [B, KV, T, D] (strides *_sb,
 * *_sh, *_st; a stride of 0 shares one KV between rows); starts, ends: int [B], row b attends
 * columns [starts[b], ends[b]) (ends NULL: to T); out: contiguous bf16 [B, H, D].
 * D % 16 == 0, D <= 256, H % KV == 0, H / KV <= 256. */
int attn_decode(const uint16_t *q, int64_t q_sb, int64_t q_sh, const uint16_t *k, int64_t k_sb, int64_t k_sh,
                int64_t k_st, const uint16_t *v, int64_t v_sb, int64_t v_sh, int64_t v_st, const int *starts,
                const int *ends, uint16_t *out, int B, int H, int KV, int T, int D, float scale, int threads);

/* Greedy argmax (argmax.c): out[r] = the index of the largest of x[r, 0..n) (torch.argmax's
 * answer: first on ties, first NaN, 0 when all are -inf). x: bf16 [rows, n], row stride
 * `stride` elements (>= n); out: int64 [rows]. n < 2^31. */
int argmax_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t stride, int64_t *out);

#endif
