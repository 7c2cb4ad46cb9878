/*
 * sum.cuh — the owner's K-sum of one token, 8 columns at a time: the one definition of y's arithmetic
 * (docs/DESIGN.md "Numerics": for k ascending, acc = acc + w[k] * partial[k] in fp32, __fmul_rn and
 * __fadd_rn, no FMA; a skipped k (id -1) adds nothing, not even a zero; BF16 rounding at the end).
 * The sum kernel (kernels/movement.cuh) and the small-batch kernel's own sum (kernels/sm90_small_gemm.cuh,
 * R = 1) both call it, so y is the same bits whichever runs it.
 */
#ifndef MF_CUDA_KERNELS_SUM_CUH
#define MF_CUDA_KERNELS_SUM_CUH

#include <stdint.h>

#include "core/numerics.h"
#include "cuda/configs.cuh" /* kMfSumBatch */

/* Columns [8c, 8c + 8) of one token: ids [K] (its validated ids), w [K] (its weights), slots [K, H]
 * BF16 (its partials, slot k at k H). kBypassL1: the partials are read through L2 only (ld.global.cg:
 * written by other SMs of the same kernel). Returns the 8 BF16 results, packed. */
template <bool kBypassL1>
__device__ __forceinline__ uint4 mf__sum_columns(const int32_t *ids, const float *w, const uint16_t *slots, int32_t K,
                                                 int32_t H, int32_t c) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int32_t k0 = 0; k0 < K; k0 += kMfSumBatch) {
        bool use[kMfSumBatch];
        float wk[kMfSumBatch];
        uint4 v[kMfSumBatch];
#pragma unroll
        for (int j = 0; j < kMfSumBatch; j++) {
            const int32_t k = k0 + j;
            use[j] = k < K && ids[k] >= 0;
            wk[j] = use[j] ? w[k] : 0.0f;
            const uint4 *src = (const uint4 *)(slots + (size_t)k * H + c * 8);
            v[j] = !use[j] ? make_uint4(0, 0, 0, 0) : kBypassL1 ? __ldcg(src) : *src;
        }
#pragma unroll
        for (int j = 0; j < kMfSumBatch; j++) {
            if (!use[j]) continue;
            const uint32_t words[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
            for (int i = 0; i < 8; i++) {
                uint16_t b = (uint16_t)(words[i / 2] >> (16 * (i % 2)));
                acc[i] = __fadd_rn(acc[i], __fmul_rn(wk[j], mf__bf16_to_float(b)));
            }
        }
    }
    uint32_t out[4];
    for (int i = 0; i < 4; i++)
        out[i] = (uint32_t)mf__bf16_from_float(acc[2 * i]) | ((uint32_t)mf__bf16_from_float(acc[2 * i + 1]) << 16);
    return make_uint4(out[0], out[1], out[2], out[3]);
}

#endif /* MF_CUDA_KERNELS_SUM_CUH */
