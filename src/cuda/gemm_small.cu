/*
 * gemm_small.cu — the launcher of the small-batch expert kernel (cuda/grouped_gemm.h
 * mf__sm90_small_experts; the kernel and its design: kernels/sm90_small_gemm.cuh): W13 + SwiGLU and
 * W2 + return of one decode forward in one launch, with the rows gathered at their owners (DIRECT)
 * and returned to their combine slots. Like the decode launchers it checks the shape, encodes both
 * weight tensor maps into the kernel's __grid_constant__ parameter and launches once: no
 * synchronisation, no allocation, CUDA-graph capturable; a shape it does not take declines
 * (MF_ERR_NOT_SUPPORTED, no launch, no library error: the dispatcher runs the two GEMMs instead).
 * Configuring, declining and the MF_DEBUG report go through the families' skeleton
 * (cuda/gemm_family.cuh).
 *
 * Variants (4): FP8 and BF16, 8 tokens per tile (the choice takes the kernel only with 8-token
 * decode tiles), each also with its own plan (kOwn: `own`, R = 1), whose shape checks the forward
 * asks first (mf__sm90_small_takes): nothing falls back there, no plan kernel ran.
 */
#include <atomic>
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "core/errors.h"
#include "cuda/gemm_bench.h" /* mf__gemm_small_counts */
#include "cuda/gemm_family.cuh"
#include "cuda/grouped_gemm.h"
#include "cuda/kernels/sm90_small_gemm.cuh"
#include "cuda/pdl.cuh"

using namespace mf__small;

namespace {

static_assert(mf__small::kMaxVariants == 4 && mf__small::kMaxVariants <= kMfGemmMaxVariants,
              "FP8 and BF16, each with the plan's tables and with its own: one usable bit each");

/* Variant 0: FP8, 1: BF16, 2 and 3 the same with their own plan (8-token tiles all). */
template <bool kFp8, bool kOwn>
mf__gemm_variant_info_t info_of() {
    using C = mf__small::cfg<kFp8, kTokens, kOwn>;
    const mf__gemm_variant_info_t o = {kFp8 ? 1 : 0, 1, kTokens, 1, C::kSmemBytes, C::kSlots, 0, 0, 0};
    return o;
}

int variant_count(void) { return mf__small::kMaxVariants; }
const void *variant_fn(int i) {
    const void *fns[mf__small::kMaxVariants] = {
        (const void *)sm90_small_kernel<true, kTokens, false>, (const void *)sm90_small_kernel<false, kTokens, false>,
        (const void *)sm90_small_kernel<true, kTokens, true>, (const void *)sm90_small_kernel<false, kTokens, true>};
    return fns[i];
}
mf__gemm_variant_info_t variant_info(int i) {
    const mf__gemm_variant_info_t v[mf__small::kMaxVariants] = {info_of<true, false>(), info_of<false, false>(),
                                                     info_of<true, true>(), info_of<false, true>()};
    return v[i];
}

mf__gemm_family_t g_family = {kMfGemmFamilySmall, kLaunchRegs, variant_count, variant_fn, variant_info};

std::atomic<uint64_t> g_launches, g_sums, g_plans, g_fronts; /* mf__gemm_small_counts (testing.h) */
std::atomic<uint64_t *> g_timeline[kMfGemmMaxDevices]; /* mf__gemm_small_set_timeline, per device; NULL: off */
static_assert(MF__GEMM_SMALL_STAMPS == kStamps && MF__GEMM_SMALL_UNIT_STAMPS == kUnitStamps,
              "gemm_bench.h spells the stamps per CTA for C");

} /* namespace */

/* The checks of a launch that its data does not enter: the tile, the shape, the variant (vi) usable on
 * this device (sms: its SMs). The launcher runs them, and mf__sm90_small_takes alone. */
static mf_result_t check_shape(const mf__gemm_choice_t *choice, int32_t L, int32_t dtype, int32_t H, int32_t I,
                               int own, int *vi, int *sms) {
    const int fp8 = dtype == MF_DTYPE_FP8_E4M3;
    const int esz = fp8 ? 1 : 2;
    if (choice->block_rows != kTokens)
        return mf__gemm_decline(&g_family, "tiles of %d tokens (the kernel has %d)", choice->block_rows, kTokens);
    mf__gemm_segments_t seg;
    memset(&seg, 0, sizeof seg);
    seg.num_experts = L;
    MF_CHECK(mf__gemm_check_segments(&g_family, &seg, 2 * (int64_t)I, kMaxExperts));
    MF_CHECK(mf__gemm_check_segments(&g_family, &seg, H, kMaxExperts));
    if (I <= 0 || H <= 0 || I % kTileCols || H % kTileCols)
        return mf__gemm_decline(&g_family, "H = %d, I = %d: not positive multiples of %d", H, I, kTileCols);
    if (((int64_t)H * esz) % kKBlock || ((int64_t)I * esz) % kKBlock)
        return mf__gemm_decline(&g_family, "H = %d, I = %d: row bytes not multiples of %d", H, I, kKBlock);
    *vi = (fp8 ? 0 : 1) + (own ? 2 : 0);
    int dev = 0;
    MF_CHECK(mf__gemm_configure(&g_family, __func__, &dev, sms));
    return mf__gemm_require(&g_family, dev, *vi);
}

mf_result_t mf__sm90_small_takes(const mf__gemm_choice_t *choice, int32_t L, int32_t dtype, int32_t H, int32_t I) {
    int vi = 0, sms = 0;
    return check_shape(choice, L, dtype, H, I, 1, &vi, &sms);
}

mf_result_t mf__sm90_small_experts(const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg, int32_t dtype,
                                   int32_t ue8m0, mf__gemm_operand_t a, mf__gemm_operand_t w13, mf__gemm_operand_t w2,
                                   int32_t H, int32_t I, void *h, float *h_scales, const mf__gemm_return_t *ret,
                                   int32_t *sync, const mf__gemm_sum_t *sum, const mf__gemm_own_t *own,
                                   cudaStream_t stream, int32_t pdl) {
    const int fp8 = dtype == MF_DTYPE_FP8_E4M3;
    const int esz = fp8 ? 1 : 2;
    if (!a.gather || !ret || !sync)
        return mf__gemm_decline(&g_family, "rows not gathered and returned at their owners");
    if (a.gather->view != ret->view || a.gather->src != ret->src)
        return mf__gemm_decline(&g_family, "rows gathered and returned through different views or plans");
    if (sum && ret->view->num_ranks != 1)
        return mf__gemm_decline(&g_family, "the sum over %d ranks (one rank only)", ret->view->num_ranks);
    if (own && (!sum || sum->T < 1 || sum->T > kOwnMaxTokens || (int64_t)sum->T * ret->num_topk > kOwnEntries ||
                     seg->max_rows_per_expert < sum->T))
        return mf__gemm_decline(&g_family, "its own plan: one rank with its sum, 1 <= T <= %d, T K <= %d, T <= the "
                                           "rows bound", kOwnMaxTokens, kOwnEntries);
    int vi = 0, sms = 0;
    MF_CHECK(check_shape(choice, seg->num_experts, dtype, H, I, own != NULL, &vi, &sms));
    if (seg->num_experts == 0 || seg->max_rows_per_expert == 0) /* no rows: nothing to launch (y: the sum kernel) */
        return sum ? mf__gemm_decline(&g_family, "no rows to compute: the sum runs alone") : MF_SUCCESS;
    const mf__gemm_variant_info_t v = variant_info(vi);

    small_params p;
    memset(&p, 0, sizeof p);
    const CUtensorMapDataType dt = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    const uint64_t L = (uint64_t)seg->num_experts;
    CUresult r = mf__tma_encode_2d(&p.tmap_w13, dt, w13.data, (uint64_t)H, L * 2 * (uint64_t)I, (uint64_t)H * esz,
                                   (uint32_t)(kKBlock / esz), (uint32_t)kBoxRows, CU_TENSOR_MAP_SWIZZLE_128B);
    if (r != CUDA_SUCCESS) return mf__gemm_decline(&g_family, "W13 tensor map: CUresult %d", (int)r);
    r = mf__tma_encode_2d(&p.tmap_w2, dt, w2.data, (uint64_t)I, L * (uint64_t)H, (uint64_t)I * esz,
                          (uint32_t)(kKBlock / esz), (uint32_t)kBoxRows, CU_TENSOR_MAP_SWIZZLE_128B);
    if (r != CUDA_SUCCESS) return mf__gemm_decline(&g_family, "W2 tensor map: CUresult %d", (int)r);
    p.counts = seg->counts;
    p.offsets = seg->offsets;
    p.w13_scales = w13.scales;
    p.w2_scales = w2.scales;
    p.h = (uint8_t *)h;
    p.h_scales = h_scales;
    p.view = *a.gather->view; /* = *ret->view: one slot's regions (x, scales, combine) */
    p.src = a.gather->src;
    p.num_topk = ret->num_topk;
    p.num_experts = seg->num_experts;
    p.max_rows = seg->max_rows_per_expert;
    p.H = H;
    p.I = I;
    p.ue8m0 = ue8m0 ? 1 : 0;
    p.sync = sync;
    p.sink = seg->sink;
    if (sum) {
        p.y = sum->y;
        p.fault = sum->fault;
        p.T = sum->T;
    }
    if (own) {
        p.ids = own->ids;
        p.x = own->x;
    }
    p.l2_ahead = __atomic_load_n(&mf__cuda_small, __ATOMIC_RELAXED) >= 4;
    int dev = 0;
    MF__GEMM_CUDA(cudaGetDevice(&dev), __func__);
    p.timeline = dev < kMfGemmMaxDevices ? g_timeline[dev].load() : NULL;

    /* one CTA per SM, never more than the units of the largest possible problem */
    const int64_t blocks = (int64_t)seg->num_experts * ((seg->max_rows_per_expert + kTokens - 1) / kTokens);
    const int64_t units = blocks * (I / kTileCols + H / kTileCols);
    const int grid = (int)(units < sms ? units : sms);
    void *args[] = {(void *)&p};
    MF__GEMM_CUDA(mf__cuda_launch(variant_fn(vi), dim3((unsigned)grid), dim3(kThreads), (size_t)v.smem_bytes, stream,
                                  pdl, args),
                  __func__);
    g_launches.fetch_add(1, std::memory_order_relaxed);
    if (sum) g_sums.fetch_add(1, std::memory_order_relaxed);
    if (own) g_plans.fetch_add(1, std::memory_order_relaxed);
    if (own && own->x) g_fronts.fetch_add(1, std::memory_order_relaxed);
    const char *own_label = !own ? "" : !own->x ? ", its own plan" : ", its own plan and first rows";
    mf__gemm_report_launch(&g_family, "small %s W13 + W2, T %d, %d slots, %d B smem, grid %d%s", fp8 ? "fp8" : "bf16",
                           kTokens, v.stages, v.smem_bytes, grid, own_label);
    return MF_SUCCESS;
}

extern "C" void mf__gemm_small_counts(uint64_t *launches, uint64_t *sums, uint64_t *plans, uint64_t *fronts) {
    *launches = g_launches.load(std::memory_order_relaxed);
    *sums = g_sums.load(std::memory_order_relaxed);
    *plans = g_plans.load(std::memory_order_relaxed);
    *fronts = g_fronts.load(std::memory_order_relaxed);
}

extern "C" int mf__gemm_small_set_timeline(uint64_t *stamps) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev >= kMfGemmMaxDevices) return -1;
    g_timeline[dev].store(stamps);
    return 0;
}

mf_result_t mf__sm90_small_preload(void) { return mf__gemm_preload(&g_family, __func__); }

int mf__sm90_small_variants(mf__gemm_variant_info_t *out, int max) {
    return mf__gemm_variants(&g_family, __func__, out, max);
}

