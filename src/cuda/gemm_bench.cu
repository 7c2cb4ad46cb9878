/*
 * gemm_bench.cu — the C entry of cuda/gemm_bench.h: the grouped GEMM launchers of
 * cuda/grouped_gemm.h behind one C function, and a device filler of benchmark operands.
 *
 * Dimension legend: H hidden, I intermediate, L local experts, rows = rows of the receive tensor.
 * Nothing here synchronises or allocates; errors come back as mf_result_t with mf_last_error().
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "core/errors.h" /* C linkage through its own guards */
#include "core/params.h" /* MF_DECODE_L2 */
#include "core/numerics.h"
#include "core/params.h"
#include "cuda/gemm_bench.h"
#include "cuda/gemm_configs.cuh" /* kMfFill*: the filler's launch shape */
#include "cuda/gemm_family.cuh" /* mf__gemm_launches */
#include "cuda/grouped_gemm.h"


namespace {

struct fill_params {
    void *data;
    int64_t count;
    int32_t kind; /* mf__bench_fill_t */
    uint32_t seed;
    float mag;
};

/* splitmix64 finaliser of (seed, i): 64 well-mixed bits per element. */
__device__ __forceinline__ uint64_t fill_hash(uint64_t i, uint32_t seed) {
    uint64_t z = i * 0x9E3779B97F4A7C15ull + ((uint64_t)seed << 32 | seed);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* [0, 1) from the top 24 bits. */
__device__ __forceinline__ float fill_unit(uint64_t h) { return (float)(h >> 40) * (1.0f / 16777216.0f); }

__global__ void bench_fill_kernel(fill_params p) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.count; i += stride) {
        const uint64_t h = fill_hash((uint64_t)i, p.seed);
        if (p.kind == MF__BENCH_FILL_BF16) {
            float v = (2.0f * fill_unit(h) - 1.0f) * p.mag;
            ((uint16_t *)p.data)[i] = mf__bf16_from_float(v == 0.0f ? p.mag : v);
        } else if (p.kind == MF__BENCH_FILL_FP8) {
            const uint32_t sign = (uint32_t)(h & 0x80u), mant = (uint32_t)(h >> 8) & 7u;
            const uint32_t exp = kMfFillFp8MinExp + (uint32_t)((h >> 16) % kMfFillFp8Exps);
            ((uint8_t *)p.data)[i] = (uint8_t)(sign | exp << 3 | mant);
        } else {
            ((float *)p.data)[i] = p.mag * (0.5f + 0.5f * fill_unit(h));
        }
    }
}

} /* namespace */

void mf__gemm_bench_choose(int32_t rows_hint, int32_t max_rows_per_expert, int32_t dataflow, int32_t *family,
                           int32_t *block_rows, int32_t *dataflow_out, int32_t *fused, int32_t *tail_rows) {
    const mf__gemm_choice_t c = mf__gemm_choose(rows_hint, max_rows_per_expert, dataflow);
    *family = c.family;
    *block_rows = c.block_rows;
    *dataflow_out = c.dataflow;
    *fused = c.fused;
    *tail_rows = c.tail_rows;
}

uint64_t mf__gemm_bench_launches(int32_t family) {
    return family == MF__GEMM_BENCH_DECODE ? mf__gemm_launches(kMfGemmFamilyDecode)
           : family == MF__GEMM_BENCH_TMA  ? mf__gemm_launches(kMfGemmFamilyTma)
                                           : 0;
}

int mf__gemm_bench_expire(int32_t family) {
    return family == MF__GEMM_BENCH_DECODE ? mf__sm90_decode_expire()
           : family == MF__GEMM_BENCH_TMA  ? mf__sm90_tma_expire()
                                           : -1;
}

int32_t mf__gemm_bench_supported(int32_t op, int32_t dtype) {
    const int dtype_ok = dtype == MF_DTYPE_BF16 || dtype == MF_DTYPE_FP8_E4M3;
    return dtype_ok && (op == MF__GEMM_OP_W13_SWIGLU || op == MF__GEMM_OP_W2);
}

mf_result_t mf__gemm_bench_run(const mf__gemm_bench_args_t *args, void *stream) {
    MF_REQUIRE(args, "mf__gemm_bench_run: args must not be NULL");
    if (!mf__gemm_bench_supported(args->op, args->dtype))
        return mf__error(MF_ERR_NOT_SUPPORTED, "mf__gemm_bench_run: op %d in dtype %d is not in the library%s",
                         args->op, args->dtype,
                         args->op == MF__GEMM_OP_W13 ? " yet (plain W13 without SwiGLU)" : "");
    mf__gemm_segments_t seg;
    seg.counts = args->counts;
    seg.offsets = args->offsets;
    seg.num_experts = args->num_experts;
    seg.max_rows_per_expert = args->max_rows_per_expert;
    seg.rows_hint = args->rows_hint > 0 ? args->rows_hint : args->max_rows_per_expert;
    seg.sched = args->sched;
    memset(&seg.sink, 0, sizeof seg.sink); /* no comm: an expired wait is recorded nowhere (and drains) */
    /* the layer's choice for these rows (contiguous: PULL), or the family asked for: decode with the
     * tile its largest hint gives, TMA with its one tile (an A/B of the families at the same rows) */
    MF_REQUIRE(args->family >= MF__GEMM_BENCH_AUTO && args->family <= MF__GEMM_BENCH_TMA,
               "mf__gemm_bench_run: family %d is not auto (0), decode (1) or tma (2)", args->family);
    int32_t hint = seg.rows_hint;
    if (args->family == MF__GEMM_BENCH_DECODE && hint > kMfDecodeMaxRows) hint = kMfDecodeMaxRows;
    if (args->family == MF__GEMM_BENCH_TMA && hint <= kMfDecodeMaxRows) hint = kMfDecodeMaxRows + 1;
    /* MF_TMA_TAILS=0: full TMA tiles only (no comm reads the environment here), for the tails' A/B */
    if (!mf__param_tma_tails()) __atomic_store_n(&mf__cuda_tma_tails, 0, __ATOMIC_RELAXED);
    const mf__gemm_choice_t choice = mf__gemm_choose(hint, seg.max_rows_per_expert, MF_DATAFLOW_PULL);
    /* no comm reads the environment here: MF_DECODE_L2=1 raises the decode prefetch for the process */
    if (mf__param_decode_l2()) __atomic_store_n(&mf__cuda_decode_l2, 1, __ATOMIC_RELAXED);
    mf__gemm_operand_t a = {args->a, args->a_scales, NULL}, w = {args->w, args->w_scales, NULL};
    cudaStream_t s = (cudaStream_t)stream;
    /* pdl 0: back-to-back timed launches stay serialised, as the records were taken */
    if (args->op == MF__GEMM_OP_W13_SWIGLU)
        return mf__cuda_w13_swiglu(&choice, &seg, args->dtype, args->ue8m0, a, w, args->H, args->I, args->out,
                                   args->out_scales, s, 0);
    return mf__cuda_w2(&choice, &seg, args->dtype, a, w, args->H, args->I, (uint16_t *)args->out, NULL, s, 0);
}

mf_result_t mf__gemm_bench_fill(void *data, int64_t count, int32_t kind, uint32_t seed, float mag, void *stream) {
    static const char *who = "mf__gemm_bench_fill";
    MF_REQUIRE(count >= 0, "%s: count (%lld) must be >= 0", who, (long long)count);
    MF_REQUIRE(count == 0 || data, "%s: data must not be NULL", who);
    MF_REQUIRE(kind >= MF__BENCH_FILL_BF16 && kind <= MF__BENCH_FILL_SCALE, "%s: kind %d is unknown", who, kind);
    if (count == 0) return MF_SUCCESS;
    int dev = 0, sms = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return mf__error(MF_ERR_CUDA, "%s: no device: %s", who, cudaGetErrorString(e));
    }
    const int64_t want = (count + kMfFillThreads - 1) / kMfFillThreads;
    const int blocks = (int)(want < (int64_t)sms * kMfFillBlocksPerSm ? want : (int64_t)sms * kMfFillBlocksPerSm);
    fill_params p = {data, count, kind, seed, mag};
    bench_fill_kernel<<<blocks, kMfFillThreads, 0, (cudaStream_t)stream>>>(p);
    e = cudaGetLastError();
    if (e != cudaSuccess) return mf__error(MF_ERR_CUDA, "%s: launch failed: %s", who, cudaGetErrorString(e));
    return MF_SUCCESS;
}
