/*
 * sync.cuh — device-side synchronisation between ranks and fault reporting.
 *
 * Signals (DESIGN.md "Symmetric heap"): every rank owns kMfSignalWords uint64 in device memory:
 * slots [MF__NUM_PHASES][MF_MAX_RANKS] that peers write, then its own epoch counter per phase.
 * sync (one kernel): arrive, my_epoch[phase] += 1, then a release store of it into every peer's
 * slot [phase][me]; then wait until every slot [phase][q] >= my_epoch[phase], acquire; bounded by
 * the group timeout.
 * Epochs live in device memory, so a captured CUDA graph replays with fresh epochs and nothing is
 * ever re-zeroed.
 *
 * Faults: the first raiser wins a claim word in device memory and writes the record into mapped
 * host memory (plain stores + system fences, no atomics on host memory), so the host can read it
 * without synchronising.
 */
#ifndef MF_CUDA_SYNC_CUH
#define MF_CUDA_SYNC_CUH

#include <stdint.h>

#include "cuda/configs.cuh"

/* Fault record, in mapped host memory; `code` is written last. */
typedef struct mf__device_error {
    volatile int32_t code; /* mf_result_t; 0 = none */
    int32_t kind;          /* kMfFault* */
    int32_t rank, phase, peer, pad;
    long long a, b, c;     /* kind-specific details */
} mf__device_error_t;

typedef struct mf__fault_sink {
    int32_t *claim;             /* device memory: 0 until a fault is raised */
    mf__device_error_t *record; /* mapped host memory (device pointer) */
    int32_t rank;
} mf__fault_sink_t;

__device__ __forceinline__ uint64_t mf__ld_acquire_sys(const uint64_t *p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void mf__st_release_sys(uint64_t *p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t mf__globaltimer_ns(void) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void mf__raise(const mf__fault_sink_t &sink, int32_t code, int32_t kind,
                                          int32_t phase, int32_t peer, long long a, long long b,
                                          long long c) {
    if (atomicCAS(sink.claim, 0, 1) != 0) return;
    mf__device_error_t *r = sink.record;
    r->kind = kind;
    r->rank = sink.rank;
    r->phase = phase;
    r->peer = peer;
    r->a = a;
    r->b = b;
    r->c = c;
    __threadfence_system();
    r->code = code;
    __threadfence_system();
}

typedef struct mf__sync_params {
    uint64_t *signals[MF_MAX_RANKS]; /* every rank's signal words (peer pointers) */
    int32_t num_ranks, rank, phase;
    uint64_t timeout_ns;
    mf__fault_sink_t sink;
} mf__sync_params_t;

/* One block. Thread 0 arrives: bumps my epoch for the phase and publishes it to every rank (me
 * included). Then one thread per peer waits for that peer's arrival at the same epoch, bounded by the
 * group timeout. A comm that already timed out still arrives but does not wait again (its protocol
 * state is gone). One kernel for both halves: a kernel boundary fewer per synchronisation. */
__global__ void __launch_bounds__(kMfWaitThreads) mf__sync_kernel(mf__sync_params_t p) {
    __shared__ uint64_t want;
    uint64_t *mine = p.signals[p.rank];
    if (threadIdx.x == 0) {
        const uint64_t epoch = mine[MF__SIGNAL_COUNT + p.phase] + 1;
        mine[MF__SIGNAL_COUNT + p.phase] = epoch;
        __threadfence_system(); /* everything this stream wrote before is visible before the signal */
        for (int32_t q = 0; q < p.num_ranks; q++)
            mf__st_release_sys(p.signals[q] + (size_t)p.phase * MF_MAX_RANKS + p.rank, epoch);
        want = epoch;
    }
    __syncthreads();
    const int32_t q = threadIdx.x;
    if (q >= p.num_ranks) return;
    if (p.sink.record->code == MF_ERR_TIMEOUT) return;
    const uint64_t *slot = mine + (size_t)p.phase * MF_MAX_RANKS + q;
    uint64_t start = mf__globaltimer_ns(), seen;
    while ((seen = mf__ld_acquire_sys(slot)) < want) {
        if (mf__globaltimer_ns() - start > p.timeout_ns) {
            /* The peer's own epoch tells "never arrived" (< want) from "arrived, signal lost". */
            uint64_t peer_epoch = mf__ld_acquire_sys(p.signals[q] + MF__SIGNAL_COUNT + p.phase);
            mf__raise(p.sink, MF_ERR_TIMEOUT, kMfFaultTimeout, p.phase, q, (long long)seen, (long long)want,
                      (long long)peer_epoch);
            return;
        }
        __nanosleep(kMfWaitBackoffNs);
    }
}

#endif /* MF_CUDA_SYNC_CUH */
