/*
 * gemm_tma.cu — launchers of the sm90 tma grouped GEMMs (grouped_gemm.h). Being written: until the
 * kernels land, every call declines with MF_ERR_NOT_SUPPORTED and the dispatcher runs v1.
 */
#include "core/internal.h"
#include "cuda/grouped_gemm.h"

mf_result_t mf__sm90_tma_w13_swiglu(const mf__gemm_segments_t *, int32_t, int32_t, mf__gemm_operand_t,
                                  mf__gemm_operand_t, int32_t, int32_t, void *, float *, cudaStream_t) {
    return MF_ERR_NOT_SUPPORTED;
}

mf_result_t mf__sm90_tma_w2(const mf__gemm_segments_t *, int32_t, mf__gemm_operand_t, mf__gemm_operand_t, int32_t,
                          int32_t, uint16_t *, const mf__gemm_return_t *, cudaStream_t) {
    return MF_ERR_NOT_SUPPORTED;
}

mf_result_t mf__sm90_tma_preload(void) { return MF_SUCCESS; }
