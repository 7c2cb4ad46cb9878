/*
 * gemm.c — the CPU expert GEMM (see gemm.h). Blocked so that the compiler vectorises the inner
 * loop over a tile of N: for each (N tile, K block) the B tile is decoded once into
 * Bt[k][n] (fp32, 16 KB, in L1) and then streamed against every row of A.
 */
#include <pthread.h>
#include <string.h>

#include "core/numerics.h"
#include "cpu/gemm.h"

/* E4M3 code -> float, built once from numerics.h: the GEMM decodes every weight it reads. */
static float mf__fp8_lut[256];
static pthread_once_t mf__fp8_lut_once = PTHREAD_ONCE_INIT;

static void mf__fp8_lut_init(void) {
    for (int c = 0; c < 256; c++) mf__fp8_lut[c] = mf__fp8_to_float((uint8_t)c);
}

const float *mf__cpu_fp8_table(void) {
    pthread_once(&mf__fp8_lut_once, mf__fp8_lut_init);
    return mf__fp8_lut;
}

/* Decodes B[n0 .. n0+nt, k0 .. k0+kt] into bt[k][n] (unscaled values). */
static void mf__pack_b(const mf__cpu_weight_t *B, int64_t Kd, int64_t n0, int nt, int64_t k0, int kt,
                       float bt[MF__CPU_TILE_K][MF__CPU_TILE_N]) {
    for (int n = 0; n < nt; n++) {
        int64_t base = (n0 + n) * Kd + k0;
        if (B->fp8) {
            const uint8_t *row = (const uint8_t *)B->data + base;
            const float *lut = mf__cpu_fp8_table();
            for (int k = 0; k < kt; k++) bt[k][n] = lut[row[k]];
        } else {
            const uint16_t *row = (const uint16_t *)B->data + base;
            for (int k = 0; k < kt; k++) bt[k][n] = mf__bf16_to_float(row[k]);
        }
    }
    for (int n = nt; n < MF__CPU_TILE_N; n++) /* the tail of the last tile multiplies zeros */
        for (int k = 0; k < kt; k++) bt[k][n] = 0.0f;
}

void mf__cpu_gemm_nt(const float *A, const float *a_scales, int64_t M, const mf__cpu_weight_t *B,
                     int64_t N, int64_t Kd, float *C) {
    float bt[MF__CPU_TILE_K][MF__CPU_TILE_N];
    int64_t kblocks = (Kd + MF__CPU_TILE_K - 1) / MF__CPU_TILE_K;
    for (int64_t m = 0; m < M; m++) memset(C + m * N, 0, (size_t)N * sizeof(float));
    for (int64_t n0 = 0; n0 < N; n0 += MF__CPU_TILE_N) {
        int nt = (int)(N - n0 < MF__CPU_TILE_N ? N - n0 : MF__CPU_TILE_N);
        for (int64_t kb = 0; kb < kblocks; kb++) {
            int64_t k0 = kb * MF__CPU_TILE_K;
            int kt = (int)(Kd - k0 < MF__CPU_TILE_K ? Kd - k0 : MF__CPU_TILE_K);
            mf__pack_b(B, Kd, n0, nt, k0, kt, bt);
            /* FP8: one weight scale per (128-row block of N, K block); a tile never straddles. */
            float b_scale = B->fp8 ? B->scales[(n0 / MF__QUANT_BLOCK) * kblocks + kb] : 1.0f;
            for (int64_t m = 0; m < M; m++) {
                const float *a = A + m * Kd + k0;
                float part[MF__CPU_TILE_N] = {0};
                for (int k = 0; k < kt; k++) {
                    float av = a[k];
                    for (int n = 0; n < MF__CPU_TILE_N; n++) part[n] += av * bt[k][n];
                }
                float *c = C + m * N + n0;
                if (B->fp8) {
                    float s = a_scales[m * kblocks + kb] * b_scale;
                    for (int n = 0; n < nt; n++) c[n] += part[n] * s;
                } else {
                    for (int n = 0; n < nt; n++) c[n] += part[n];
                }
            }
        }
    }
}
