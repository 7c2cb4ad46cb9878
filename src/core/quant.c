/*
 * quant.c — the public numerics helpers: scalar FP8/BF16 conversions and block quantisation of
 * BF16 tensors (1x128 for activations, 128x128 for weights), all on the host, all built from the
 * per-element definitions in numerics.h.
 */
#include <math.h>
#include <string.h>

#include "core/errors.h"
#include "core/numerics.h"
#include "core/quant.h"
#include "core/tensor.h"

uint8_t mf_fp8_e4m3_from_float(float x) { return mf__fp8_from_float(x); }
float mf_fp8_e4m3_to_float(uint8_t x) { return mf__fp8_to_float(x); }
uint16_t mf_bf16_from_float(float x) { return mf__bf16_from_float(x); }
float mf_bf16_to_float(uint16_t x) { return mf__bf16_to_float(x); }

void mf__quant_1x128_f32(const float *x, int64_t n, int32_t ue8m0, uint8_t *q, float *scales) {
    for (int64_t b = 0; b < n / MF__QUANT_BLOCK; b++) {
        const float *xb = x + b * MF__QUANT_BLOCK;
        float amax = 0.0f, scale, inv;
        for (int i = 0; i < MF__QUANT_BLOCK; i++) {
            float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        mf__fp8_block_scale(amax, ue8m0, &scale, &inv);
        scales[b] = scale;
        for (int i = 0; i < MF__QUANT_BLOCK; i++) q[b * MF__QUANT_BLOCK + i] = mf__fp8_from_float(xb[i] * inv);
    }
}

void mf__quant_1x128_bf16(const uint16_t *x, int64_t n, int32_t ue8m0, uint8_t *q, float *scales) {
    float buf[MF__QUANT_BLOCK];
    for (int64_t b = 0; b < n / MF__QUANT_BLOCK; b++) {
        for (int i = 0; i < MF__QUANT_BLOCK; i++) buf[i] = mf__bf16_to_float(x[b * MF__QUANT_BLOCK + i]);
        mf__quant_1x128_f32(buf, MF__QUANT_BLOCK, ue8m0, q + b * MF__QUANT_BLOCK, scales + b);
    }
}

/* One 128x128 block of a row-major [.., N] matrix: amax over all 16384 values. */
static void mf__quant_128x128_block(const uint16_t *x, int64_t ld, int32_t ue8m0, uint8_t *q,
                                    float *scale) {
    float amax = 0.0f, inv;
    for (int r = 0; r < MF__QUANT_BLOCK; r++)
        for (int c = 0; c < MF__QUANT_BLOCK; c++) {
            float a = fabsf(mf__bf16_to_float(x[r * ld + c]));
            amax = a > amax ? a : amax;
        }
    mf__fp8_block_scale(amax, ue8m0, scale, &inv);
    for (int r = 0; r < MF__QUANT_BLOCK; r++)
        for (int c = 0; c < MF__QUANT_BLOCK; c++)
            q[r * ld + c] = mf__fp8_from_float(mf__bf16_to_float(x[r * ld + c]) * inv);
}

mf_result_t mf_quantize_fp8(const mf_tensor_t *in, const mf_tensor_t *out, const mf_tensor_t *scales,
                            int32_t block_rows, int32_t ue8m0) {
    mf__clear_error();
    MF_REQUIRE(in && out && scales, "mf_quantize_fp8: in, out and scales must not be NULL");
    MF_REQUIRE(block_rows == 1 || block_rows == MF__QUANT_BLOCK,
               "mf_quantize_fp8: block_rows must be 1 or 128, got %d", block_rows);
    MF_REQUIRE(ue8m0 == 0 || ue8m0 == 1, "mf_quantize_fp8: ue8m0 must be 0 or 1, got %d", ue8m0);
    MF_REQUIRE(in->ndim >= 2 && in->ndim <= MF_MAX_DIMS,
               "mf_quantize_fp8: in must have 2 to %d dims, got %d", MF_MAX_DIMS, in->ndim);
    int32_t nd = in->ndim;
    int64_t M = in->dims[nd - 2], N = in->dims[nd - 1], batch = 1;
    for (int32_t i = 0; i < nd - 2; i++) batch *= in->dims[i];
    MF_REQUIRE(N % MF__QUANT_BLOCK == 0, "mf_quantize_fp8: columns (%lld) must be a multiple of 128",
               (long long)N);
    MF_REQUIRE(M % block_rows == 0, "mf_quantize_fp8: rows (%lld) must be a multiple of %d",
               (long long)M, block_rows);
    int64_t sdims[MF_MAX_DIMS];
    memcpy(sdims, in->dims, sizeof sdims);
    sdims[nd - 2] = M / block_rows;
    sdims[nd - 1] = N / MF__QUANT_BLOCK;
    MF_CHECK(mf__check_tensor(in, "mf_quantize_fp8 in", MF_DTYPE_BF16, nd, in->dims, 0));
    MF_CHECK(mf__check_tensor(out, "mf_quantize_fp8 out", MF_DTYPE_FP8_E4M3, nd, in->dims, 0));
    MF_CHECK(mf__check_tensor(scales, "mf_quantize_fp8 scales", MF_DTYPE_FP32, nd, sdims, 0));

    const uint16_t *x = (const uint16_t *)in->data;
    uint8_t *q = (uint8_t *)out->data;
    float *s = (float *)scales->data;
    for (int64_t b = 0; b < batch; b++) {
        const uint16_t *xb = x + b * M * N;
        uint8_t *qb = q + b * M * N;
        float *sb = s + b * (M / block_rows) * (N / MF__QUANT_BLOCK);
        if (block_rows == 1) {
            mf__quant_1x128_bf16(xb, M * N, ue8m0, qb, sb);
        } else {
            for (int64_t br = 0; br < M / MF__QUANT_BLOCK; br++)
                for (int64_t bc = 0; bc < N / MF__QUANT_BLOCK; bc++)
                    mf__quant_128x128_block(xb + br * MF__QUANT_BLOCK * N + bc * MF__QUANT_BLOCK, N, ue8m0,
                                            qb + br * MF__QUANT_BLOCK * N + bc * MF__QUANT_BLOCK,
                                            sb + br * (N / MF__QUANT_BLOCK) + bc);
        }
    }
    return MF_SUCCESS;
}
