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

#include <math.h>
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
    int32_t rows_hint;           /* expected rows per expert (mf__gemm_choose reads it); 0 = the bound */
    const int32_t *counts;       /* [L] device */
    const int32_t *offsets;      /* [L + 1] device */
    int32_t *sched;              /* device: a zeroed schedule pair (mf__gemm_segments_t.sched) or NULL */
    const void *a;               /* [rows, K] */
    const float *a_scales;       /* FP8: [rows, K/128] */
    const void *w;               /* [L, N, K] */
    const float *w_scales;       /* FP8: [L, N/128, K/128] */
    void *out;                   /* [rows, out columns] */
    float *out_scales;           /* W13_SWIGLU FP8: [rows, I/128] */
    int32_t family;              /* 0 (MF__GEMM_BENCH_AUTO): the library's choice (mf__gemm_choose);
                                    MF__GEMM_BENCH_DECODE (its tile for min(rows_hint, its largest)) or
                                    MF__GEMM_BENCH_TMA: that family whatever the rows */
} mf__gemm_bench_args_t;
#define MF__GEMM_BENCH_AUTO 0
#define MF__GEMM_BENCH_DECODE 1
#define MF__GEMM_BENCH_TMA 2

/* The library's GEMM choice for these host facts (cuda/grouped_gemm.h mf__gemm_choose): *family 0
 * decode or 1 TMA, *block_rows the tokens (decode) or rows (TMA) per tile, *dataflow_out the
 * dataflow it runs (MF_DATAFLOW_*), *fused 1 when the tiles allow the small-batch kernel (the layer
 * also bounds its routed rows: cuda/backend.cu, mf__small::kMaxRows), *tail_rows the TMA tail tiles'
 * rows (64, or 0: none). Pure host arithmetic, no GPU needed. */
void mf__gemm_bench_choose(int32_t rows_hint, int32_t max_rows_per_expert, int32_t dataflow, int32_t *family,
                           int32_t *block_rows, int32_t *dataflow_out, int32_t *fused, int32_t *tail_rows);

/* The small-batch kernel's launches in this process so far, those of them that summed y, those that
 * planned for themselves and those that made their first unit's rows from x (switch 5) (the CUDA
 * suite checks which of the small kernel, its own sum, its own plan, its first rows and the two
 * GEMMs ran). */
void mf__gemm_small_counts(uint64_t *launches, uint64_t *sums, uint64_t *plans, uint64_t *fronts);

/* `moeflow bench layer --timeline`: the small-batch kernel launches that follow on the current device
 * write MF__GEMM_SMALL_STAMPS words per CTA into `stamps` (device memory, grid <= its SMs; each
 * launch overwrites its CTAs'): %globaltimer stamps 0 entry, 1 tables built, 2 first ring position
 * full, 3 consumers done; 4 the CTA's SM; 5 with its own plan, its producer's wait for publish
 * returned (else 0); then MF__GEMM_SMALL_UNIT_STAMPS pairs (unit, when) for the
 * first tickets its producer took: the unit's index in its low 32 bits, bit 32 set for a W2 unit,
 * bit 33 for the ticket past the end (sm90_small_gemm.cuh). NULL turns it off (the library's
 * state). 0, or -1 without a current device. */
#define MF__GEMM_SMALL_UNIT_STAMPS 8
#define MF__GEMM_SMALL_STAMPS (6 + 2 * MF__GEMM_SMALL_UNIT_STAMPS)
int mf__gemm_small_set_timeline(uint64_t *stamps);

/* The launches of a family (MF__GEMM_BENCH_DECODE or MF__GEMM_BENCH_TMA) in this process so far, by
 * every caller (layers, benches, tests); 0 for any other value. */
uint64_t mf__gemm_bench_launches(int32_t family);

/* Raises the expired flag of a family (MF__GEMM_BENCH_DECODE or MF__GEMM_BENCH_TMA) as an expired
 * pipeline wait would: the family's later kernels drain wherever a wait has to wait, and must still
 * end. Never cleared: a test of the drain runs it in a process of its own. 0, or -1 (another
 * family, a CUDA error). */
int mf__gemm_bench_expire(int32_t family);

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

/* ---- --check: the element bounds (docs/DESIGN.md "Numerics", "GEMM error bounds") -------------
 * Pure C (no CUDA), shared by `moeflow bench gemm --check` and the tests (tests/test_gemm_bounds.c
 * on the CPU, tests/gpu/test_gemm_bounds.c on the device). Every function returns a bound on
 * |gpu - exact| for one output element, where `exact` is the fp64 value of the arithmetic on the
 * same quantised operands (no rounding anywhere), so a bound never depends on how the reference
 * itself rounds. The accumulation term is condition-aware: it is built from the exact prefix sums
 * and product magnitudes of the element's own dot product, so an output that is near zero by
 * cancellation is judged by the size of what cancelled, not by its own size. */

/* Tensor-core accumulation model: each MMA k-step adds MF__GEMM_CHUNK_* exact products and the
 * running sum c, aligned to the largest of them and truncated to u (relative to that largest), and
 * the result is truncated again to the accumulator's precision. Per step:
 *   |err| <= u ((chunk + 1) max(|c|, max |p_j|) + |c'|)        (c' the sum after the step)
 * FP8 E4M3 wgmma (k32): 13 fraction bits are observed (DeepSeek-V3 3.3.2 "around 14 bits";
 * Khattak & Mikaitis 2025, arXiv:2512.07004: H100 FP8 truncates to 13 fraction bits); u takes one
 * bit of margin. BF16 (k16): fp32's 23 fraction bits with truncation; u one bit of margin. */
#define MF__GEMM_CHUNK_FP8 32
#define MF__GEMM_CHUNK_BF16 16
#define MF__GEMM_UACC_FP8 0x1p-12
#define MF__GEMM_UACC_BF16 0x1p-22
#define MF__GEMM_U32 0x1p-24          /* unit roundoff of an fp32 operation (round to nearest) */
#define MF__GEMM_SILU_DMAX 1.0999     /* max |silu'(x)| = 1.0998.. (at x = 2.3994..) */
#define MF__GEMM_SILU_OPS 8.0         /* fp32 silu(g) * u: expf (<= 2 ulp), add, IEEE div, mul */
#define MF__GEMM_BF16_HALF_ULP 0x1p-8 /* |bf16(x) - x| <= 2^-8 |x| (8-bit significand) */
#define MF__GEMM_E4M3_HALF_ULP 0x1p-4 /* |e4m3(x) - x| <= 2^-4 |x| for normal x ... */
#define MF__GEMM_E4M3_SUB_HALF 0x1p-10 /* ... and <= 2^-10 below 2^-6 (half the subnormal step) */

/* One element of a grouped GEMM: exact = sum_kb s_kb sum_{k in kb} a_k w_k (FP8: s_kb = a_scales[kb]
 * w_scales[kb], kb the 128-wide K blocks, each promoted into an fp32 accumulator; BF16: a_scales =
 * w_scales = NULL, the whole K in one tensor-core accumulator). a, w: [K] decoded values (E4M3 code
 * values or bf16). *bound: the accumulation model above per k-step, scaled by |s_kb|, plus the
 * promotion (fp32 scale product and fma: (kbs + 2) u32 of the scaled absolute sums) and the fp64
 * reference's own rounding; *abs_sum: sum_kb |s_kb| sum |a_k w_k| (the condition of the element). */
static inline void mf__gemm_ref_dot(const float *a, const float *w, int32_t K, const float *a_scales,
                                    const float *w_scales, double *exact, double *bound, double *abs_sum) {
    const int fp8 = a_scales != 0;
    const int32_t seg = fp8 ? 128 : K, chunk = fp8 ? MF__GEMM_CHUNK_FP8 : MF__GEMM_CHUNK_BF16;
    const double u = fp8 ? MF__GEMM_UACC_FP8 : MF__GEMM_UACC_BF16;
    double acc = 0, err = 0, tsum = 0;
    int32_t kbs = 0;
    for (int32_t k0 = 0; k0 < K; k0 += seg, kbs++) {
        const int32_t k1 = k0 + seg < K ? k0 + seg : K;
        double c = 0, steps = 0, sabs = 0;
        for (int32_t j0 = k0; j0 < k1; j0 += chunk) {
            const int32_t j1 = j0 + chunk < k1 ? j0 + chunk : k1;
            double m = c < 0 ? -c : c;
            for (int32_t j = j0; j < j1; j++) {
                const double p = (double)a[j] * (double)w[j], ap = p < 0 ? -p : p;
                m = ap > m ? ap : m;
                sabs += ap;
                c += p;
            }
            steps += (double)(chunk + 1) * m + (c < 0 ? -c : c);
        }
        double s = 1;
        if (fp8) s = (double)a_scales[kbs] * (double)w_scales[kbs];
        const double as = s < 0 ? -s : s;
        acc += s * c;
        err += as * u * steps;
        tsum += as * sabs;
    }
    /* promotion in fp32: s_kb rounded, then acc += P s (fma or mul + add), over kbs blocks; the
     * fp64 reference sums K products: its rounding is below K 2^-53 of the absolute sum */
    err += (double)(kbs + 2) * MF__GEMM_U32 * (tsum + err) + (double)K * 0x1p-53 * tsum;
    *exact = acc;
    *bound = err;
    if (abs_sum) *abs_sum = tsum;
}

/* A BF16 output of an fp32 value within e of y: |gpu - y| <= e + 2^-8 (|y| + e). */
static inline double mf__gemm_bound_bf16_out(double y, double e) {
    return e + MF__GEMM_BF16_HALF_ULP * ((y < 0 ? -y : y) + e);
}

/* SwiGLU of two accumulated values g, u within eg, eu: h = silu(g) u exactly (*h), and the bound
 * of the kernel's fp32 h on |h_gpu - h| (*eh), before any output rounding:
 *   |silu(g') u' - silu(g) u| <= max|silu'| eg (|u| + eu) + |silu(g)| eu, plus the fp32 ops. */
static inline void mf__gemm_swiglu(double g, double eg, double u, double eu, double *h, double *eh) {
    const double sg = g / (1.0 + exp(-g)), au = u < 0 ? -u : u, asg = sg < 0 ? -sg : sg;
    const double prop = MF__GEMM_SILU_DMAX * eg * (au + eu) + asg * eu;
    *h = sg * u;
    *eh = prop + MF__GEMM_SILU_OPS * MF__GEMM_U32 * ((*h < 0 ? -*h : *h) + prop);
}

/* An FP8 h element: the kernel's fp32 h (within eh of the exact h) requantised with the block
 * scale gs the kernel wrote, q = e4m3(h * (1 / gs)), read back as q gs:
 *   |q gs - h| <= eh + max(2^-4 (|h| + eh), 2^-10 gs) (1 + 2^-21) + 2^-22 (|h| + eh)
 * (half an E4M3 step at the element's own magnitude, or half the subnormal step of the block;
 * 2^-22: the rounding of h * inv and of inv against gs). A one-step flip where the GPU's h and the
 * exact h straddle a rounding boundary is inside this bound: it is measured from the exact h. */
static inline double mf__gemm_bound_fp8_h(double h, double eh, double gs) {
    const double ah = (h < 0 ? -h : h) + eh, rel = MF__GEMM_E4M3_HALF_ULP * ah, sub = MF__GEMM_E4M3_SUB_HALF * gs;
    return eh + (rel > sub ? rel : sub) * (1 + 0x1p-21) + 0x1p-22 * ah;
}

/* The h scale of a block whose exact amax is `amax` and whose fp32 h values are each within
 * e_max of exact (so the kernel's amax is within e_max of amax): 1 when gs is a scale the kernel
 * may have computed (mf__fp8_block_scale of some amax' in [amax - e_max, amax + e_max], with the
 * MF__FP8_AMAX_MIN clamp and one fp32 rounding), else 0. */
static inline int mf__gemm_fp8_scale_ok(double amax, double e_max, int ue8m0, double gs, double amax_min,
                                        double fp8_max) {
    double lo = amax - e_max, hi = amax + e_max;
    lo = lo > amax_min ? lo : amax_min;
    hi = hi > amax_min ? hi : amax_min;
    lo /= fp8_max, hi /= fp8_max;
    if (ue8m0) { /* 2^ceil(log2(x)) is monotone: the bounds' powers of two */
        double plo = 1, phi = 1;
        while (plo < lo) plo *= 2;
        while (plo / 2 >= lo) plo /= 2;
        while (phi < hi) phi *= 2;
        while (phi / 2 >= hi) phi /= 2;
        lo = plo, hi = phi;
    }
    return gs >= lo * (1 - 0x1p-23) && gs <= hi * (1 + 0x1p-23);
}

#ifdef __cplusplus
}
#endif

#endif /* MF_CUDA_GEMM_BENCH_H */
