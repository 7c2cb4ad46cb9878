/*
 * gemm_decode.cu — launchers of the sm90 decode grouped GEMMs (cuda/grouped_gemm.h; the kernel and
 * its design are in kernels/sm90_decode_gemm.cuh, validated and timed by dev/cuda/sm90_decode_lab.cu
 * through these launchers). Each launcher checks the shape, takes the variant of the call's choice
 * (tokens per tile: choice->block_rows, decided by mf__gemm_choose in grouped_gemm.cu, never here),
 * encodes the weight (and contiguous activation) tensor maps on the host into the kernel's
 * __grid_constant__ parameter, and launches once. They never synchronise and never allocate, so
 * they are CUDA-graph capturable.
 *
 * Declining: a shape the kernel does not take returns MF_ERR_NOT_SUPPORTED without launching and
 * without recording a library error (the dispatcher then runs the mma.sync fallback); the reason is
 * kept per thread for the lab (mf__gemm_last_decline). The arguments (NULLs, 16-byte aligned data,
 * 4-byte aligned scales, BF16 or FP8 E4M3, counts) are the dispatcher's to check, once
 * (cuda/grouped_gemm.cu); a caller of the launchers themselves (the labs) passes valid ones.
 * Configuring, declining and the MF_DEBUG report go through the families' one skeleton,
 * cuda/gemm_family.cuh. The kernel takes: N a multiple of 128 (W2: H) or 256 (W13: 2I), K * element
 * bytes a multiple of 128 (W13: H, W2: I), L <= kMaxExperts, L * N < 2^31.
 *
 * Variants (24): W13 {FP8, BF16} x T {8, 16, 32, 64} x {contiguous A by TMA, A gathered at its
 * owners by cp.async}; W2 {FP8, BF16} x T (rows to out or, with `ret`, to the owners' slots: a
 * runtime flag). mf__sm90_decode_preload loads every variant and raises its shared-memory limit
 * (group init calls it before any rank can spin: no lazy module load ever happens on the data
 * path); a launch on a device not yet configured does the same first. A variant that did not get
 * exactly kLaunchRegs registers (setmaxnreg's assumption: with fewer, the consumers' setmaxnreg.inc
 * would wait forever) is never launched: its calls decline.
 */
#include <atomic>
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>


#include "core/errors.h"
#include "cuda/gemm_family.cuh"
#include "cuda/grouped_gemm.h"
#include "cuda/kernels/sm90_decode_gemm.cuh"
#include "cuda/pdl.cuh"

using namespace mf__decode;

namespace {

static_assert(kMaxVariants <= kMfGemmMaxVariants, "one usable bit per variant");

struct variant_t {
    const void *fn;
    int fp8, swiglu, block_t, gather;
    int smem, stages;
};

template <bool kFp8, int kEpi, int kBlockT, bool kGather>
variant_t variant_of() {
    using C = cfg<kFp8, kEpi, kBlockT>;
    variant_t v = {(const void *)sm90_decode_kernel<kFp8, kEpi, kBlockT, kGather>, kFp8 ? 1 : 0, kEpi == kEpiSwiglu ? 1 : 0,
                   kBlockT, kGather ? 1 : 0, C::kSmemBytes, C::kStages};
    return v;
}

template <bool kFp8, int kEpi, bool kGather>
void add_block_ts(variant_t *table, int &n) {
    table[n++] = variant_of<kFp8, kEpi, 8, kGather>();
    table[n++] = variant_of<kFp8, kEpi, 16, kGather>();
    table[n++] = variant_of<kFp8, kEpi, 32, kGather>();
    table[n++] = variant_of<kFp8, kEpi, 64, kGather>();
}

/* Every shipped variant (built once, thread-safe static initialisation). */
const variant_t *variants(int *count) {
    static variant_t table[kMaxVariants];
    static const int n = [] {
        int k = 0;
        add_block_ts<true, kEpiSwiglu, false>(table, k);
        add_block_ts<false, kEpiSwiglu, false>(table, k);
        add_block_ts<true, kEpiSwiglu, true>(table, k);
        add_block_ts<false, kEpiSwiglu, true>(table, k);
        add_block_ts<true, kEpiPlain, false>(table, k);
        add_block_ts<false, kEpiPlain, false>(table, k);
        return k;
    }();
    *count = n;
    return table;
}

int find_variant(int fp8, int swiglu, int block_t, int gather) {
    int n = 0;
    const variant_t *v = variants(&n);
    for (int i = 0; i < n; i++)
        if (v[i].fp8 == fp8 && v[i].swiglu == swiglu && v[i].block_t == block_t && v[i].gather == gather) return i;
    return -1;
}

int variant_count(void) {
    int n = 0;
    (void)variants(&n);
    return n;
}
const void *variant_fn(int i) {
    int n = 0;
    return variants(&n)[i].fn;
}
mf__gemm_variant_info_t variant_info(int i) {
    int n = 0;
    const variant_t &v = variants(&n)[i];
    const mf__gemm_variant_info_t o = {v.fp8, v.swiglu, v.block_t, v.gather, v.smem, v.stages, 0, 0, 0};
    return o;
}

/* The decode lab's --timeline stamps per device (mf__sm90_decode_set_timeline), NULL in the library. */
std::atomic<uint64_t *> g_timeline[kMfGemmMaxDevices];

/* The family's per-device state and reports (cuda/gemm_family.cuh). */
mf__gemm_family_t g_family = {kMfGemmFamilyDecode, kLaunchRegs, variant_count, variant_fn, variant_info};

/* The checks shared by both GEMMs; `N` weight rows per expert, `K` reduction elements. */
mf_result_t check_shape(const mf__gemm_segments_t *seg, int32_t dtype, int swiglu, int64_t N, int64_t K) {
    MF_CHECK(mf__gemm_check_segments(&g_family, seg, N, kMaxExperts));
    const int esz = dtype == MF_DTYPE_FP8_E4M3 ? 1 : 2;
    const int64_t nmult = swiglu ? 2 * kTileCols : kTileCols;
    if (N <= 0 || N % nmult)
        return mf__gemm_decline(&g_family, "N = %lld is not a positive multiple of %lld", (long long)N, (long long)nmult);
    if (K <= 0 || (K * esz) % kKBlock)
        return mf__gemm_decline(&g_family, "K = %lld: K bytes not a multiple of %d", (long long)K, kKBlock);
    return MF_SUCCESS;
}

/* Grid: one CTA per SM, never more than the tiles of the largest possible problem. */
int grid_of(const mf__gemm_segments_t *seg, int64_t N, int swiglu, int block_t, int sms) {
    const int64_t nblocks = N / (swiglu ? 2 * kTileCols : kTileCols);
    const int64_t tiles = (int64_t)seg->num_experts * ((seg->max_rows_per_expert + block_t - 1) / block_t) * nblocks;
    return (int)(tiles < sms ? tiles : sms);
}

/* Takes the choice's variant, encodes the weight map (and the contiguous activation map) and launches. */
mf_result_t launch(const char *who, const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg, int fp8,
                   int swiglu, int gather, const void *w, const void *a, gemm_params *p, cudaStream_t stream, int32_t pdl) {
    if (seg->num_experts == 0 || seg->max_rows_per_expert == 0) return MF_SUCCESS; /* no rows: nothing to launch */
    const int block_t = choice->block_rows;
    const int vi = find_variant(fp8, swiglu, block_t, gather);
    if (vi < 0)
        return mf__gemm_decline(&g_family, "no variant fp8 %d swiglu %d T %d gather %d", fp8, swiglu, block_t, gather);
    int dev = 0, sms = 0;
    MF_CHECK(mf__gemm_configure(&g_family, who, &dev, &sms));
    MF_CHECK(mf__gemm_require(&g_family, dev, vi));
    int n = 0;
    const variant_t &v = variants(&n)[vi];
    const int esz = fp8 ? 1 : 2;
    const uint64_t kbytes = (uint64_t)p->K * esz;
    const CUtensorMapDataType dt = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    CUresult r = mf__tma_encode_2d(&p->tmap_w, dt, w, (uint64_t)p->K, (uint64_t)seg->num_experts * p->N, kbytes,
                                   (uint32_t)(kKBlock / esz), (uint32_t)kBoxRows, CU_TENSOR_MAP_SWIZZLE_128B);
    if (r != CUDA_SUCCESS) return mf__gemm_decline(&g_family, "weight tensor map: CUresult %d", (int)r);
    if (!gather) {
        r = mf__tma_encode_2d(&p->tmap_a, dt, a, (uint64_t)p->K, (uint64_t)kMaxRowCoord, kbytes, (uint32_t)(kKBlock / esz),
                              (uint32_t)block_t, CU_TENSOR_MAP_SWIZZLE_128B);
        if (r != CUDA_SUCCESS) return mf__gemm_decline(&g_family, "activation tensor map: CUresult %d", (int)r);
    }
    const int grid = grid_of(seg, p->N, swiglu, block_t, sms);
    if (grid <= 0) return MF_SUCCESS;
    p->timeline = g_timeline[dev].load();
    p->l2_ring = __atomic_load_n(&mf__cuda_decode_l2, __ATOMIC_RELAXED);
    void *args[] = {(void *)p};
    MF__GEMM_CUDA(mf__cuda_launch(v.fn, dim3((unsigned)grid), dim3(kThreads), (size_t)v.smem, stream, pdl, args), who);
    mf__gemm_report_launch(&g_family, "decode %s %s T %d, A %s (%d stages, %d B smem, grid %d)", fp8 ? "fp8" : "bf16",
                 swiglu ? "swiglu" : "plain", block_t, gather ? "gathered in place" : "by TMA", v.stages, v.smem, grid);
    return MF_SUCCESS;
}

} /* namespace */

mf_result_t mf__sm90_decode_w13_swiglu(const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg, int32_t dtype,
                                       int32_t ue8m0, mf__gemm_operand_t a, mf__gemm_operand_t w13, int32_t H, int32_t I,
                                       void *h, float *h_scales, cudaStream_t stream, int32_t pdl) {
    const int64_t N = 2 * (int64_t)I, K = H;
    const int fp8 = dtype == MF_DTYPE_FP8_E4M3;
    MF_CHECK(check_shape(seg, dtype, 1, N, K));
    gemm_params p = w13_params(seg, ue8m0, a, w13, H, I, h, h_scales);
    return launch(__func__, choice, seg, fp8, 1, a.gather ? 1 : 0, w13.data, a.data, &p, stream, pdl);
}

mf_result_t mf__sm90_decode_w2(const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg, int32_t dtype,
                               mf__gemm_operand_t h, mf__gemm_operand_t w2, int32_t H, int32_t I, uint16_t *out,
                               const mf__gemm_return_t *ret, cudaStream_t stream, int32_t pdl) {
    const int64_t N = H, K = I;
    const int fp8 = dtype == MF_DTYPE_FP8_E4M3;
    MF_CHECK(check_shape(seg, dtype, 0, N, K));
    gemm_params p = w2_params(seg, h, w2, H, I, out, ret);
    return launch(__func__, choice, seg, fp8, 0, 0, w2.data, h.data, &p, stream, pdl);
}

mf_result_t mf__sm90_decode_preload(void) { return mf__gemm_preload(&g_family, __func__); }

int mf__sm90_decode_expire(void) { return mf__sm90_raise_expired(); }

int mf__sm90_decode_variants(mf__gemm_variant_info_t *out, int max) {
    return mf__gemm_variants(&g_family, __func__, out, max);
}


cudaError_t mf__sm90_decode_set_timeline(uint64_t *stamps) {
    int dev = 0;
    const cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    if (dev < 0 || dev >= kMfGemmMaxDevices) return cudaErrorInvalidDevice;
    g_timeline[dev].store(stamps);
    return cudaSuccess;
}
