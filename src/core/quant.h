/*
 * quant.h — host FP8 block quantisation (docs/DESIGN.md "Numerics"), used by mf_quantize_fp8 and by
 * the CPU backend. The CUDA kernels use the same per-element functions from numerics.h.
 */
#ifndef MF_CORE_QUANT_H
#define MF_CORE_QUANT_H

#include <stdint.h>

/* Quantises n values (n a multiple of 128) in 1x128 blocks: q[n] FP8, scales[n / 128]. */
void mf__quant_1x128_f32(const float *x, int64_t n, int32_t ue8m0, uint8_t *q, float *scales);
void mf__quant_1x128_bf16(const uint16_t *x, int64_t n, int32_t ue8m0, uint8_t *q, float *scales);

#endif /* MF_CORE_QUANT_H */
