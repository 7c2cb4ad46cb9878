/*
 * prefetch.cu — the balancing planner on the device (see prefetch.h and planner.h here):
 * the same MF_HD code the CPU backend runs, so the device table is the host table bit for bit
 * (tests/gpu/test_balance.c). One thread for now: R * B simulated splits of E experts each, a few
 * hundred microseconds for E = 256 on one SM, off the forward's path (it runs in mf_moe_prefetch,
 * during attention); phase 2 parallelises the candidates' simulations over a block.
 *
 * Dimension legend: E logical experts, R ranks, P physical slots, B spare slots per rank,
 * N = P + R * B replica entries.
 */
#include <cuda_runtime.h>

#include "balance/planner.h"
#include "balance/prefetch.h"
#include "core/errors.h"

/* Scratch layout in int32 words: rep_off [E + 1], rep_rank [N], rep_slot [N], share [N],
 * iscratch [E + R * B], then load [R] int64 at an 8-byte boundary. */
static __host__ __device__ int64_t mf__balance_load_word(int32_t E, int32_t R, int32_t P, int32_t B) {
    int64_t N = (int64_t)P + (int64_t)R * B;
    int64_t w = (int64_t)E + 1 + 3 * N + E + (int64_t)R * B;
    return (w + 1) / 2 * 2;
}

static __host__ __device__ int64_t mf__balance_scratch_words_d(int32_t E, int32_t R, int32_t P, int32_t B) {
    return mf__balance_load_word(E, R, P, B) + 2 * (int64_t)R;
}

extern "C" int64_t mf__balance_scratch_words(int32_t E, int32_t R, int32_t P, int32_t B) {
    return mf__balance_scratch_words_d(E, R, P, B);
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

/* ---- the prefetch of a layer (mf_moe_prefetch on CUDA) ------------------------------------------ */

#include "cuda/configs.cuh"

extern "C" size_t mf__prefetch_smem_bytes(int32_t E, int32_t R, int32_t P, int32_t B) {
    /* scratch, then copies of counts [E], map [P], resident [R * B] */
    const size_t bytes = (size_t)(mf__balance_scratch_words(E, R, P, B) + E + P + (int64_t)R * B) * sizeof(int32_t);
    return bytes <= kMfPrefetchMaxSmem ? bytes : 0;
}

/* One block: the table; thread 0 runs the planner over shared memory (the same MF_HD code as the
 * host, so the same table on every rank and as the CPU backend's). */
__global__ void __launch_bounds__(kMfPushThreads) mf__prefetch_pick_kernel(mf__prefetch_params_t p) {
    extern __shared__ int64_t mf__pick_smem[];
    int32_t *scratch = (int32_t *)mf__pick_smem;
    const int64_t words = mf__balance_scratch_words_d(p.E, p.R, p.P, p.B);
    int32_t *counts = scratch + words, *map = counts + p.E, *resident = map + p.P;
    const int32_t RB = p.R * p.B;
    const bool stale = *p.weights_seen != p.weights_count; /* new weights: every spare copy is stale */
    for (int32_t e = threadIdx.x; e < p.E; e += blockDim.x) counts[e] = p.prev_counts[e];
    for (int32_t i = threadIdx.x; i < p.P; i += blockDim.x) map[i] = p.map[i];
    for (int32_t i = threadIdx.x; i < RB; i += blockDim.x) resident[i] = stale ? -1 : p.resident[i];
    __syncthreads();
    if (threadIdx.x != 0) return;
    if (stale) {
        for (int32_t i = 0; i < RB; i++) p.resident[i] = -1;
        *p.weights_seen = p.weights_count;
    }
    if (!*p.have_prev) {
        for (int32_t i = 0; i < RB; i++) p.next[i] = resident[i];
        return;
    }
    const int64_t N = (int64_t)p.P + RB;
    int32_t *rep_off = scratch, *rep_rank = rep_off + p.E + 1, *rep_slot = rep_rank + N, *share = rep_slot + N;
    int32_t *iscratch = share + N;
    int64_t *load = (int64_t *)(scratch + mf__balance_load_word(p.E, p.R, p.P, p.B));
    mf__balance_pick(p.E, p.R, p.P, p.B, counts, map, resident, p.next, rep_off, rep_rank, rep_slot, share, load,
                     iscratch);
}

/* The first static replica of expert e (every expert has one). */
__device__ __forceinline__ int32_t mf__first_slot(const int32_t *map, int32_t P, int32_t e) {
    int32_t src = 0;
    while (src < P - 1 && map[src] != e) src++;
    return src;
}

/* Grid (kMfPushBlocks, R * B): blocks of table entry i copy its expert when it changed and this rank
 * holds the expert's first static replica. */
__global__ void __launch_bounds__(kMfPushThreads) mf__prefetch_push_kernel(mf__prefetch_params_t p) {
    const int32_t i = blockIdx.y, e = p.next[i];
    if (e < 0 || e == p.resident[i]) return;
    const int32_t src = mf__first_slot(p.map, p.P, e);
    if (src / p.Lp != p.rank) return;
    const uint64_t l = (uint64_t)(src % p.Lp), j = (uint64_t)(i % p.B);
    uint8_t *base = p.spare[i / p.B];
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, step = (int64_t)gridDim.x * blockDim.x;
    /* Weights: 16-byte words (the sizes are multiples of 16 and the bases 16-byte aligned). */
    {
        const uint4 *s13 = (const uint4 *)(p.w13 + l * p.bytes_w13), *s2 = (const uint4 *)(p.w2 + l * p.bytes_w2);
        uint4 *d13 = (uint4 *)(base + p.off_w13 + j * p.bytes_w13), *d2 = (uint4 *)(base + p.off_w2 + j * p.bytes_w2);
        for (int64_t k = tid; k < (int64_t)(p.bytes_w13 / 16); k += step) d13[k] = s13[k];
        for (int64_t k = tid; k < (int64_t)(p.bytes_w2 / 16); k += step) d2[k] = s2[k];
    }
    /* FP8 scales: 4-byte words. */
    if (p.bytes_w13_scales) {
        const uint32_t *s13 = (const uint32_t *)(p.w13_scales + l * p.bytes_w13_scales);
        const uint32_t *s2 = (const uint32_t *)(p.w2_scales + l * p.bytes_w2_scales);
        uint32_t *d13 = (uint32_t *)(base + p.off_w13_scales + j * p.bytes_w13_scales);
        uint32_t *d2 = (uint32_t *)(base + p.off_w2_scales + j * p.bytes_w2_scales);
        for (int64_t k = tid; k < (int64_t)(p.bytes_w13_scales / 4); k += step) d13[k] = s13[k];
        for (int64_t k = tid; k < (int64_t)(p.bytes_w2_scales / 4); k += step) d2[k] = s2[k];
    }
    __threadfence_system(); /* the copies are visible to the destination before its next forward's plan */
}

/* One thread: the stats, then the new table becomes the resident one. */
__global__ void mf__prefetch_commit_kernel(mf__prefetch_params_t p) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const int64_t copy = (int64_t)(p.bytes_w13 + p.bytes_w13_scales + p.bytes_w2 + p.bytes_w2_scales);
    int64_t mine = 0, all = 0, resident = 0;
    for (int32_t i = 0; i < p.R * p.B; i++) {
        const int32_t e = p.next[i];
        if (e >= 0 && e != p.resident[i]) {
            all += copy;
            if (mf__first_slot(p.map, p.P, e) / p.Lp == p.rank) mine += copy;
        }
        resident += e >= 0;
        p.resident[i] = e;
    }
    p.stats[0] = mine, p.stats[1] = all, p.stats[2] = resident;
}

extern "C" mf_result_t mf__cuda_prefetch_preload(size_t smem_bytes) {
    cudaError_t e = cudaFuncSetAttribute(mf__prefetch_pick_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem_bytes);
    cudaFuncAttributes attr;
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, mf__prefetch_push_kernel);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, mf__prefetch_commit_kernel);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return mf__error(MF_ERR_CUDA, "prefetch: loading the kernels failed: %s", cudaGetErrorString(e));
    }
    return MF_SUCCESS;
}

extern "C" mf_result_t mf__cuda_prefetch(const mf__prefetch_params_t *params, size_t smem_bytes, void *stream_) {
    cudaStream_t stream = (cudaStream_t)stream_;
    mf__prefetch_pick_kernel<<<1, kMfPushThreads, smem_bytes, stream>>>(*params);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) {
        mf__prefetch_push_kernel<<<dim3(kMfPushBlocks, (unsigned)(params->R * params->B)), kMfPushThreads, 0, stream>>>(
            *params);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) {
        mf__prefetch_commit_kernel<<<1, 32, 0, stream>>>(*params);
        e = cudaGetLastError();
    }
    if (e != cudaSuccess) return mf__error(MF_ERR_CUDA, "prefetch: a launch failed: %s", cudaGetErrorString(e));
    return MF_SUCCESS;
}

/* ---- a test hook: mf__balance_plan_par alone on the device ---------------------------------------- */

typedef struct mf__plan_par_test_params {
    int32_t E, R, P, B, placement, me, masked, block_m, capacity, max_rows;
    const int32_t *map, *spare, *counts;
    int32_t *slot_count, *slot_begin, *slot_expert, *verdict;
    int64_t *load, *home;
} mf__plan_par_test_params_t;

__global__ void __launch_bounds__(kMfPlanThreads) mf__plan_par_test_kernel(mf__plan_par_test_params_t p) {
    extern __shared__ int64_t mf__ppt_smem[];
    const int32_t N = p.P + p.R * p.B;
    int64_t *load = mf__ppt_smem, *home = load + p.R, *rows = home + p.R;
    int32_t *cs = (int32_t *)(rows + p.R), *cp = cs + p.E, *rep_off = cp + p.E, *rep_rank = rep_off + p.E + 1;
    int32_t *rep_slot = rep_rank + N, *share = rep_slot + N, *order = share + N, *small = order + p.E, *over = small + 4;
    const mf__balance_ws_t ws = {cs, cp, rep_off, rep_rank, rep_slot, share, order, small, over, load, home, rows};
    mf__balance_plan_par(p.E, p.R, p.P, p.B, p.placement, p.me, p.masked, p.block_m, p.capacity, p.max_rows, p.map,
                         p.spare, p.counts, &ws, p.slot_count, p.slot_begin, p.slot_expert);
    if (threadIdx.x == 0) {
        p.verdict[0] = small[1], p.verdict[1] = small[2];
        for (int32_t r = 0; r < p.R; r++) p.load[r] = load[r], p.home[r] = home[r];
    }
}

extern "C" mf_result_t mf__cuda_plan_par_test(int32_t E, int32_t R, int32_t P, int32_t B, int32_t placement, int32_t me,
                                              int32_t masked, int32_t block_m, int32_t capacity, int32_t max_rows,
                                              const int32_t *map, const int32_t *spare, const int32_t *counts,
                                              int32_t *slot_count, int32_t *slot_begin, int32_t *slot_expert,
                                              int32_t *verdict, int64_t *load, int64_t *home, void *stream) {
    mf__plan_par_test_params_t p = {E, R, P, B, placement, me, masked, block_m, capacity, max_rows, map, spare, counts,
                                    slot_count, slot_begin, slot_expert, verdict, load, home};
    const size_t N = (size_t)P + (size_t)R * B;
    const size_t smem = 3 * (size_t)R * 8 + (2 * (size_t)E + E + 1 + 3 * N + E + 4 + R) * 4;
    cudaError_t e = cudaFuncSetAttribute(mf__plan_par_test_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e == cudaSuccess) {
        mf__plan_par_test_kernel<<<1, kMfPlanThreads, smem, (cudaStream_t)stream>>>(p);
        e = cudaGetLastError();
    }
    if (e != cudaSuccess) return mf__error(MF_ERR_CUDA, "plan_par test kernel: %s", cudaGetErrorString(e));
    return MF_SUCCESS;
}
