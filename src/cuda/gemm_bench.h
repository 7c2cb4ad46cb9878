/*
 * gemm_bench.h — a C entry to the CUDA backend's grouped expert GEMMs, for `moeflow bench gemm`
 * (tools/bench_gemm.c). Internal (`mf__`), not part of the public API: it exposes the launchers of
 * cuda/grouped_gemm.h (C++ linkage, CUDA types) as plain C with streams passed as void *
 * (cudaStream_t), plus a device filler for benchmark operands too large to draw on the host.
 *
 * Dimension legend: H hidden, I intermediate, L local experts, rows = rows of the receive tensor.
 * The contract of every pointer, layout and number is the one of cuda/grouped_gemm.h: rows of
 * expert e are [offsets[e], offsets[e] + counts[e]) (DEVICE arrays), FP8 activations carry 1x128
 * scales [rows, K/128], FP8 weights 128x128 scales [L, N/128, K/128], outputs are written only on
 * rows below counts[e].
 */
#ifndef MF_CUDA_GEMM_BENCH_H
#define MF_CUDA_GEMM_BENCH_H

#include <stdint.h>

#include "moeflow.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The GEMMs of one expert layer, as the benchmark names them. N output columns, K the reduction:
 *   W13_SWIGLU  a [rows, H] . w13[e]^T -> gate, up [rows, I] each; out = h [rows, I] = silu(gate) * up
 *               (FP8: E4M3 codes + out_scales [rows, I/128]; BF16: bf16). N = 2I, K = H.
 *   W2          a = h [rows, I] . w2[e]^T -> out [rows, H] bf16. N = H, K = I.
 *   W13         a [rows, H] . w13[e]^T -> out [rows, 2I] bf16, no SwiGLU. N = 2I, K = H. Not in the
 *               library yet: MF_ERR_NOT_SUPPORTED (the slot for the plain W13 of the coming kernels). */
typedef enum mf__gemm_op {
    MF__GEMM_OP_W13_SWIGLU = 0,
    MF__GEMM_OP_W2 = 1,
    MF__GEMM_OP_W13 = 2,
    MF__GEMM_NUM_OPS = 3
} mf__gemm_op_t;

typedef struct mf__gemm_bench_args {
    int32_t op;                  /* mf__gemm_op_t */
    int32_t dtype;               /* MF_DTYPE_BF16 or MF_DTYPE_FP8_E4M3 (operands; outputs as above) */
    int32_t ue8m0;               /* W13_SWIGLU FP8: power-of-two h scales */
    int32_t H, I;
    int32_t num_experts;         /* L */
    int32_t max_rows_per_expert; /* host bound on counts[e]: C (MASKED) or the largest count */
    int32_t rows_hint;           /* expected rows per expert (picks the kernel); 0 = the bound */
    const int32_t *counts;       /* [L] device */
    const int32_t *offsets;      /* [L + 1] device */
    int32_t *sched;              /* device: a zeroed schedule pair (mf__gemm_segments_t.sched) or NULL */
    const void *a;               /* [rows, K] */
    const float *a_scales;       /* FP8: [rows, K/128] */
    const void *w;               /* [L, N, K] */
    const float *w_scales;       /* FP8: [L, N/128, K/128] */
    void *out;                   /* [rows, out columns] */
    float *out_scales;           /* W13_SWIGLU FP8: [rows, I/128] */
} mf__gemm_bench_args_t;

/* 1 when the library has `op` for `dtype`, else 0. */
int32_t mf__gemm_bench_supported(int32_t op, int32_t dtype);

/* Launches one grouped GEMM on `stream` (a cudaStream_t; NULL = the legacy stream). Not blocking,
 * CUDA-graph capturable, allocates nothing. MF_ERR_NOT_SUPPORTED for an op or dtype the library
 * does not have; otherwise the launcher's codes (invalid argument, not supported shape, CUDA). */
mf_result_t mf__gemm_bench_run(const mf__gemm_bench_args_t *args, void *stream);

/* What mf__gemm_bench_fill writes: element i is a hash of (seed, i), so a fill is reproducible. */
typedef enum mf__bench_fill {
    MF__BENCH_FILL_BF16 = 0,  /* uint16 bf16 values uniform in [-mag, mag), never 0 */
    MF__BENCH_FILL_FP8 = 1,   /* uint8 E4M3 codes of magnitude 2^-3 .. 15 (exponents -3..3), random
                                 sign and mantissa: never 0, never NaN; `mag` unused */
    MF__BENCH_FILL_SCALE = 2  /* fp32 uniform in [mag / 2, mag) */
} mf__bench_fill_t;

/* Fills count elements of `data` (device) on `stream`; not blocking. */
mf_result_t mf__gemm_bench_fill(void *data, int64_t count, int32_t kind, uint32_t seed, float mag,
                                void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MF_CUDA_GEMM_BENCH_H */
