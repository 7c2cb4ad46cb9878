/*
 * gemm_tma.cu — launchers of the sm90 TMA grouped GEMMs (cuda/grouped_gemm.h; the kernel and its
 * design are in kernels/sm90_tma_gemm.cuh, validated and timed by dev/cuda/sm90_gemm_lab.cu through
 * these launchers). Each launcher checks the shape, encodes the activation and weight tensor maps on
 * the host (two cuTensorMapEncodeTiled calls, three or four with tail tiles, about a microsecond
 * each) into the kernel's __grid_constant__ parameter, and launches once on a persistent grid (one
 * CTA per SM, never more than the tiles of the largest possible problem). They never synchronise and never allocate, so
 * they are CUDA-graph capturable.
 *
 * Declining: a shape the kernel does not take returns MF_ERR_NOT_SUPPORTED without launching and
 * without recording a library error (the dispatcher then runs the mma.sync fallback); the reason is
 * kept per thread for the lab (mf__gemm_last_decline). The arguments (NULLs, 16-byte aligned data,
 * 4-byte aligned scales and schedule pair, BF16 or FP8 E4M3, counts) are the dispatcher's to check,
 * once (cuda/grouped_gemm.cu); a caller of the launchers themselves (the labs) passes valid ones.
 * Configuring, declining and the MF_DEBUG report go through the families' one skeleton,
 * cuda/gemm_family.cuh. The kernel takes: W13: contiguous A (a.gather declines: TMA cannot gather
 * rows), I a multiple of 128; W2: H a multiple of 256; K * element bytes a multiple of 16 (FP8: K a
 * multiple of 128); L <= kMaxExperts; L * N < 2^31; fewer than 2^30 tiles (kMaxTiles).
 *
 * Variants (4): {FP8, BF16} x {W13 SwiGLU, W2 plain}; W2 sends rows to `out` or, with `ret`, to the
 * owners' combine slots, and the 64-row tail tiles are on where the choice says (choice->tail_rows,
 * mf__gemm_choose): runtime flags. The lab's A/B kernels and timing probes are its own fork
 * of the kernel with its own launcher (dev/cuda/sm90_tma_lab_kernel.cuh), never compiled or
 * registered here. mf__sm90_tma_preload loads every variant and raises its shared-memory limit
 * (group init calls it before any rank can spin: no lazy module load ever happens on the data
 * path); a launch on a device not yet configured does the same first. A variant that did not get
 * exactly kLaunchRegs registers (setmaxnreg's assumption: with fewer, the consumers' setmaxnreg.inc
 * would wait forever) is never launched: its calls decline.
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "core/errors.h"
#include "cuda/gemm_family.cuh"
#include "cuda/grouped_gemm.h"
#include "cuda/kernels/sm90_tma_gemm.cuh"
#include "cuda/pdl.cuh"

using namespace mf__tma;

namespace {

struct variant_t {
    const void *fn;
    int fp8, swiglu;
};

/* Every variant, indexed by 2 fp8 + swiglu. */
constexpr int kNumVariants = 4;
const variant_t kVariants[kNumVariants] = {
    {(const void *)sm90_tma_kernel<false, kEpiPlain>, 0, 0},
    {(const void *)sm90_tma_kernel<false, kEpiSwiglu>, 0, 1},
    {(const void *)sm90_tma_kernel<true, kEpiPlain>, 1, 0},
    {(const void *)sm90_tma_kernel<true, kEpiSwiglu>, 1, 1},
};

const void *variant_fn(int i) { return kVariants[i].fn; }
int variant_count(void) { return kNumVariants; }
mf__gemm_variant_info_t variant_info(int i) {
    const mf__gemm_variant_info_t o = {kVariants[i].fp8, kVariants[i].swiglu, 0, 0, kSmemBytes, kStages, 0, 0, 0};
    return o;
}

/* The family's per-device state and reports (cuda/gemm_family.cuh). */
mf__gemm_family_t g_family = {kMfGemmFamilyTma, kLaunchRegs, variant_count, variant_fn, variant_info};

/* The checks shared by both GEMMs; `N` weight rows per expert, `K` reduction elements. */
mf_result_t check_shape(const mf__gemm_segments_t *seg, int32_t dtype, int swiglu, int64_t N, int64_t K) {
    MF_CHECK(mf__gemm_check_segments(&g_family, seg, N, kMaxExperts));
    const int fp8 = dtype == MF_DTYPE_FP8_E4M3, esz = fp8 ? 1 : 2;
    if (N <= 0 || N % kTileN)
        return mf__gemm_decline(&g_family, "%s = %lld is not a positive multiple of %d", swiglu ? "2I" : "H",
                                (long long)N, kTileN);
    if (K <= 0 || (K * esz) % kMfGemmDataAlign || (fp8 && K % MF__QUANT_BLOCK))
        return mf__gemm_decline(&g_family, "K = %lld: rows must be 16-byte multiples (FP8: K a multiple of %d)",
                                (long long)K, MF__QUANT_BLOCK);
    const int64_t tiles = (int64_t)seg->num_experts * ((seg->max_rows_per_expert + kBlockM - 1) / kBlockM) * (N / kTileN);
    if (tiles >= kMaxTiles)
        return mf__gemm_decline(&g_family, "%lld tiles: the kernel's tile codes hold fewer than %lld", (long long)tiles,
                                (long long)kMaxTiles);
    return MF_SUCCESS;
}

/* Encodes the tensor maps and launches variant (fp8, swiglu) on a persistent grid, with tail tiles
 * where the choice says (choice->tail_rows). */
mf_result_t launch(const char *who, const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg, int fp8,
                   int swiglu, const void *a, const void *w, const gemm_params &p, cudaStream_t stream, int32_t pdl) {
    if (seg->num_experts == 0 || seg->max_rows_per_expert == 0) return MF_SUCCESS; /* no rows: nothing to launch */
    if (choice->tail_rows != 0 && choice->tail_rows != kHalfRows)
        return mf__gemm_decline(&g_family, "tail tiles of %d rows: the kernel's are %d", choice->tail_rows, kHalfRows);
    int dev = 0, sms = 0;
    MF_CHECK(mf__gemm_configure(&g_family, who, &dev, &sms));
    const int vi = 2 * fp8 + swiglu;
    MF_CHECK(mf__gemm_require(&g_family, dev, vi));
    tma_params tp;
    memset(&tp, 0, sizeof tp);
    tp.p = p;
    const char *map = NULL;
    const CUresult r = encode_maps(&tp, fp8, a, w, &map);
    if (r != CUDA_SUCCESS) return mf__gemm_decline(&g_family, "%s tensor map: CUresult %d", map, (int)r);
    /* tail tiles where chosen (BF16 only with choice.tail_bf16, grouped_gemm.h) and their maps
     * encode (else full tiles only: the same bits) */
    tp.tails = choice->tail_rows != 0 && (fp8 || choice->tail_bf16) &&
               encode_tail_maps(&tp, fp8, swiglu, a, w) == CUDA_SUCCESS;
    const int grid = grid_of(&tp.p, seg->max_rows_per_expert, sms);
    if (grid <= 0) return MF_SUCCESS;
    void *args[] = {(void *)&tp};
    MF__GEMM_CUDA(mf__cuda_launch(variant_fn(vi), dim3((unsigned)grid), dim3(kThreads), (size_t)kSmemBytes, stream, pdl,
                                 args),
                 who);
    mf__gemm_report_launch(&g_family, "tma %s %s (%d-row tiles%s, %d stages, %d B smem, grid %d, %s schedule)",
                           fp8 ? "fp8" : "bf16", swiglu ? "swiglu" : "plain", kBlockM, tp.tails ? ", 64-row tails" : "",
                           kStages, kSmemBytes, grid, tp.p.sched ? "dynamic" : "static");
    return MF_SUCCESS;
}

} /* namespace */

mf_result_t mf__sm90_tma_w13_swiglu(const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg, int32_t dtype,
                                    int32_t ue8m0, mf__gemm_operand_t a, mf__gemm_operand_t w13, int32_t H, int32_t I,
                                    void *h, float *h_scales, cudaStream_t stream, int32_t pdl) {
    if (a.gather)
        return mf__gemm_decline(&g_family, "a.gather: TMA cannot gather rows (mf__gemm_choose never asks it to)");
    const int64_t N = 2 * (int64_t)I, K = H;
    const int fp8 = dtype == MF_DTYPE_FP8_E4M3;
    MF_CHECK(check_shape(seg, dtype, 1, N, K));
    return launch(__func__, choice, seg, fp8, 1, a.data, w13.data, w13_params(seg, ue8m0, a, w13, H, I, h, h_scales),
                  stream, pdl);
}

mf_result_t mf__sm90_tma_w2(const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg, int32_t dtype,
                            mf__gemm_operand_t h, mf__gemm_operand_t w2, int32_t H, int32_t I, uint16_t *out,
                            const mf__gemm_return_t *ret, cudaStream_t stream, int32_t pdl) {
    const int64_t N = H, K = I;
    const int fp8 = dtype == MF_DTYPE_FP8_E4M3;
    MF_CHECK(check_shape(seg, dtype, 0, N, K));
    return launch(__func__, choice, seg, fp8, 0, h.data, w2.data, w2_params(seg, h, w2, H, I, out, ret), stream, pdl);
}

mf_result_t mf__sm90_tma_preload(void) { return mf__gemm_preload(&g_family, __func__); }

int mf__sm90_tma_expire(void) { return mf__sm90_raise_expired(); }

int mf__sm90_tma_variants(mf__gemm_variant_info_t *out, int max) {
    return mf__gemm_variants(&g_family, __func__, out, max);
}

