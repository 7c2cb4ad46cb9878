/*
 * test_balance.c (gpu) — balanced EP on the device, phase 2's first piece: the planner of
 * src/plan/balance.h run by a CUDA kernel (src/cuda/balance.cu) gives the host's spare table bit
 * for bit, over random counts (skewed and flat), maps with replicas and resident tables. The
 * layer-level cases (maps and spare slots bit-identical to no replicas, graph replay with changing
 * routing) join when the CUDA backend serves balanced layers (docs/DECISIONS.md, phase 2).
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../harness.h"
#include "cuda/balance.h"
#include "plan/balance.h"

#define CUDA_OK(call)                                                                                 \
    do {                                                                                              \
        cudaError_t e_ = (call);                                                                      \
        if (e_ != cudaSuccess) MFT_FAIL("%s failed: %s", #call, cudaGetErrorString(e_));             \
    } while (0)

enum { MAXE = 384, MAXR = 8, MAXB = 4, MAXP = MAXE + MAXR * 4 };

static int pick_case(mft_rng_t *rng, int32_t E, int32_t R, int32_t P, int32_t B, int skew) {
    int32_t counts[MAXE], map[MAXP], resident[MAXR * MAXB], host[MAXR * MAXB], dev_out[MAXR * MAXB];
    int32_t rep_off[MAXE + 1], rep_rank[MAXP + MAXR * MAXB], rep_slot[MAXP + MAXR * MAXB];
    int32_t share[MAXP + MAXR * MAXB], scratch[MAXE + MAXR * MAXB];
    int64_t load[MAXR];
    for (int32_t e = 0; e < E; e++)
        counts[e] = skew ? (int32_t)(4096.0 / (1.0 + mft_rng_int(rng, E))) : 10 + mft_rng_int(rng, 20);
    for (int32_t p = 0; p < P; p++) map[p] = p < E ? p : mft_rng_int(rng, E);
    for (int32_t i = 0; i < R * B; i++) resident[i] = mft_rng_int(rng, 3) ? -1 : mft_rng_int(rng, E);
    mf__balance_pick(E, R, P, B, counts, map, resident, host, rep_off, rep_rank, rep_slot, share, load, scratch);

    int32_t *d_counts, *d_map, *d_res, *d_spare, *d_scratch;
    const int64_t words = mf__balance_scratch_words(E, R, P, B);
    CUDA_OK(cudaMalloc((void **)&d_counts, sizeof counts));
    CUDA_OK(cudaMalloc((void **)&d_map, sizeof map));
    CUDA_OK(cudaMalloc((void **)&d_res, sizeof resident));
    CUDA_OK(cudaMalloc((void **)&d_spare, sizeof dev_out));
    CUDA_OK(cudaMalloc((void **)&d_scratch, (size_t)words * sizeof(int32_t)));
    CUDA_OK(cudaMemcpy(d_counts, counts, sizeof counts, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_map, map, sizeof map, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_res, resident, sizeof resident, cudaMemcpyHostToDevice));
    mf__balance_pick_params_t prm = {E, R, P, B, d_counts, d_map, d_res, d_spare, d_scratch};
    MFT_CHECK_OK(mf__cuda_balance_pick(&prm, NULL));
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(dev_out, d_spare, (size_t)R * B * sizeof(int32_t), cudaMemcpyDeviceToHost));
    cudaFree(d_counts), cudaFree(d_map), cudaFree(d_res), cudaFree(d_spare), cudaFree(d_scratch);
    for (int32_t i = 0; i < R * B; i++)
        MFT_CHECK_MSG(dev_out[i] == host[i], "E %d R %d P %d B %d: spare[%d] device %d, host %d", (int)E, (int)R,
                      (int)P, (int)B, (int)i, (int)dev_out[i], (int)host[i]);
    return 0;
}

static int cuda_balance_pick(void) {
    mft_rng_t rng = {0xb4};
    static const int32_t shapes[][4] = {{256, 8, 256, 2}, {256, 8, 288, 2}, {384, 8, 384, 4}, {16, 4, 20, 1},
                                        {8, 2, 8, 3}, {64, 1, 64, 2}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int skew = 0; skew < 2; skew++)
            if (pick_case(&rng, shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3], skew)) return 1;
    return 0;
}

const mft_test_t mft_tests_cuda_balance[] = {
    {"cuda_balance_pick", cuda_balance_pick, 120},
    {NULL, NULL, 0},
};
