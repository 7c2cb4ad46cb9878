/*
 * balance.cu — the balancing planner on the device (see balance.h here and src/plan/balance.h):
 * the same MF_HD code the CPU backend runs, so the device table is the host table bit for bit
 * (tests/gpu/test_balance.c). One thread for now: R * B simulated splits of E experts each, a few
 * hundred microseconds for E = 256 on one SM, off the forward's path (it runs in mf_moe_prefetch,
 * during attention); phase 2 parallelises the candidates' simulations over a block.
 *
 * Dimension legend: E logical experts, R ranks, P physical slots, B spare slots per rank,
 * N = P + R * B replica entries.
 */
#include <cuda_runtime.h>

#include "cuda/balance.h"
#include "plan/balance.h"

/* Scratch layout in int32 words: rep_off [E + 1], rep_rank [N], rep_slot [N], share [N],
 * iscratch [E + R * B], then load [R] int64 at an 8-byte boundary. */
static __host__ __device__ int64_t mf__balance_load_word(int32_t E, int32_t R, int32_t P, int32_t B) {
    int64_t N = (int64_t)P + (int64_t)R * B;
    int64_t w = (int64_t)E + 1 + 3 * N + E + (int64_t)R * B;
    return (w + 1) / 2 * 2;
}

extern "C" int64_t mf__balance_scratch_words(int32_t E, int32_t R, int32_t P, int32_t B) {
    return mf__balance_load_word(E, R, P, B) + 2 * (int64_t)R;
}

__global__ void mf__balance_pick_kernel(mf__balance_pick_params_t p) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const int64_t N = (int64_t)p.P + (int64_t)p.R * p.B;
    int32_t *rep_off = p.scratch, *rep_rank = rep_off + p.E + 1, *rep_slot = rep_rank + N, *share = rep_slot + N;
    int32_t *iscratch = share + N;
    int64_t *load = (int64_t *)(p.scratch + mf__balance_load_word(p.E, p.R, p.P, p.B));
    mf__balance_pick(p.E, p.R, p.P, p.B, p.counts, p.map, p.resident, p.spare, rep_off, rep_rank, rep_slot, share, load,
                     iscratch);
}

extern "C" mf_result_t mf__cuda_balance_pick(const mf__balance_pick_params_t *params, void *stream) {
    mf__balance_pick_kernel<<<1, 32, 0, (cudaStream_t)stream>>>(*params);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return mf__error(MF_ERR_CUDA, "balance pick: launch failed: %s", cudaGetErrorString(e));
    return MF_SUCCESS;
}
