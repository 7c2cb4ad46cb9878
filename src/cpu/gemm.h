/*
 * gemm.h — the CPU backend's expert GEMM: C[M, N] = A[M, Kd] . B[N, Kd]^T in fp32, with the FP8
 * per-128-K-block promotion of docs/DESIGN.md ("Numerics"): the partial sum of every 128-wide K block
 * is multiplied by (a_scale[m, kb] * b_scale[n / 128, kb]) and added into the fp32 accumulator.
 *
 * A arrives decoded to fp32 (FP8 codes as their unscaled values; scales apart); B is a weight
 * matrix as the user stored it ([N, Kd] BF16, or FP8 with [N/128, Kd/128] scales) and is decoded
 * into a small transposed tile per (N tile, K block), reused by every row of A.
 */
#ifndef MF_CPU_GEMM_H
#define MF_CPU_GEMM_H

#include <stdint.h>

#define MF__CPU_TILE_N 32   /* columns of C per packed B tile: 8 SSE vectors of partial sums */
#define MF__CPU_TILE_K 128  /* K block: the FP8 promotion interval */
#define MF__CPU_ROWS 16     /* rows of A decoded and multiplied together */

typedef struct mf__cpu_weight {
    const void *data;     /* [N, Kd] BF16 or FP8 */
    const float *scales;  /* FP8: [N/128, Kd/128]; NULL for BF16 */
    int32_t fp8;
} mf__cpu_weight_t;

/* The 256 E4M3 values as floats (mf__fp8_to_float of every code). */
const float *mf__cpu_fp8_table(void);

/* C[m, n] = sum_k A[m, k] * B[n, k] (per-block promoted when B is FP8; then a_scales [M, Kd/128]
 * must be given), for m < M <= MF__CPU_ROWS, n < N, k < Kd. */
void mf__cpu_gemm_nt(const float *A, const float *a_scales, int64_t M, const mf__cpu_weight_t *B,
                     int64_t N, int64_t Kd, float *C);

#endif /* MF_CPU_GEMM_H */
