/*
 * sync.cuh — device-side synchronisation between ranks, and the fault model of the CUDA backend.
 *
 * Signals (core/layout.h "signals"): every rank owns MF__SIGNAL_WORDS uint64 in device memory,
 * reached by peers through the signal table. sync (one kernel): arrive, my_epoch[phase] += 1, a
 * release store of (epoch, status) into every peer's slot [phase][epoch % Q][me]; then wait until
 * every slot [phase][epoch % Q][q] holds that epoch, acquire; bounded by the comm timeout, ended early by an abort (this
 * rank's mapped abort word, or the abort word of the peer it waits for). Epochs live in device
 * memory, so a captured CUDA graph replays with fresh epochs and nothing is ever re-zeroed.
 * The split halves (mf_dispatch_send / _recv, ...) cut a sync in two (mf__sync_params.mode): the
 * send's ARRIVE stores the epoch it arrived at in a device word of the exchange's slot and returns
 * at once (no kernel left waiting), the receive's WAIT reads that word and waits for it, then the
 * verdict. A send's fresh fault travels in its arrival, so ARRIVE clears the claim there.
 *
 * Faults (one model for every rank; docs/API.md "Faults"):
 *  - A *fresh* fault is raised by a kernel of this rank before the call's first sync (publish: a
 *    bad or repeated id), or is the host's rejection of the call's input. It travels as the status
 *    of this rank's arrival, so every rank learns of it at the same sync.
 *  - A sync whose arrivals carry a status makes the comm *faulted* on every rank alike (the same
 *    sticky code and fault id everywhere, the lowest failing rank's). So is a capacity overflow,
 *    which every rank's plan finds from the same global counts. Every kernel after the sync checks
 *    the sticky code and writes nothing, so the call writes no output on any rank; so do all later
 *    calls until the fault is acknowledged.
 *  - Acknowledged: each rank's host passes the id of the last fault it reported to the user
 *    (mf_comm_get_async_error, or a call's result). At the first sync of a call (phase DISPATCH)
 *    where every rank acknowledged the current fault, every rank clears it and the call runs.
 *    The decision is taken by device code from the same signals on every rank, so ranks never
 *    disagree on which calls failed, whenever their hosts happen to look.
 *  - A timeout or an abort is also sticky, but ends the protocol: later syncs no longer wait, and
 *    the host marks the comm broken.
 * The sticky state lives in device memory (mf__device_state); its copy for the host, written last
 * with system fences, in mapped host memory (mf__device_error), so the host reads it without
 * synchronising.
 */
#ifndef MF_CUDA_SYNC_CUH
#define MF_CUDA_SYNC_CUH

#include <stdint.h>

#include "core/layout.h"
#include "cuda/configs.cuh"
#include "cuda/kernels/fault.cuh"
#include "cuda/pdl.cuh"

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

/* Status bits of an arrival (below the epoch): the failure code, whether the raising rank's host
 * returned it itself, and whether this rank acknowledged the comm's current fault. */
#define kMfStatusCode 0x3full
#define kMfStatusReported 0x40ull
#define kMfStatusAck 0x80ull
static_assert(MF__STATUS_BITS == 8, "status: 6 bits of code, reported, ack");
#define kMfSlotLayer(v) MF__SLOT_LAYER(v)
static_assert(MF_ERR_ABORTED <= (int)kMfStatusCode, "every mf_result_t fits the status");

/* mf__sync_params.mode: the whole sync (a one-call collective), or one half of it. */
enum { kMfSyncBoth = 0, kMfSyncArrive = 1, kMfSyncWait = 2 };

typedef struct mf__sync_params {
    uint64_t *signals[MF_MAX_RANKS]; /* every rank's signal words (peer pointers) */
    int32_t num_ranks, rank, phase;
    int32_t mode;                    /* kMfSync*: both halves, or the arrival / the wait alone */
    unsigned long long *epoch;       /* ARRIVE writes the epoch it arrived at here, WAIT reads it */
    int32_t reject;                  /* the host rejected this call: its mf_result_t, else 0 */
    uint32_t layer;                  /* the id of the layer called (mf_moe.id) */
    unsigned long long acked_id;     /* the last fault id this rank's host reported */
    uint64_t timeout_ns;
    mf__fault_sink_t sink;
} mf__sync_params_t;

/* The end of a sync, thread 0: every arrival's status through the fault model (file comment). */
__device__ void mf__sync_verdict(const mf__sync_params_t &p, uint64_t want, int32_t stop) {
    mf__device_state_t *s = p.sink.state;
    uint64_t *mine = p.signals[p.rank];
    const int32_t fault = s->fault;
    if (p.mode == kMfSyncBoth) s->claim = 0; /* this call's fresh fault, if any, travelled in the arrival */
    if (stop || fault == MF_ERR_TIMEOUT || fault == MF_ERR_ABORTED) return;
    bool all_ack = true;
    int32_t failed = -1, other_layer = -1;
    uint64_t failed_status = 0;
    for (int32_t r = 0; r < p.num_ranks; r++) {
        const uint64_t v = mf__ld_acquire_sys(mine + MF__SIGNAL_SLOT(p.phase, want, r));
        all_ack = all_ack && (v & kMfStatusAck);
        if (failed < 0 && (v & kMfStatusCode)) {
            failed = r;
            failed_status = v;
        }
        if (other_layer < 0 && MF__SLOT_LAYER(v) != (p.layer & MF__LAYER_MASK)) other_layer = r;
    }
    if (fault && all_ack && p.phase == MF__PHASE_DISPATCH) {
        /* Every host has reported it: the fault ends here, for every rank at once. */
        s->fault = 0;
        p.sink.record->code = 0;
        __threadfence_system();
    }
    if (failed < 0 && other_layer >= 0) {
        /* Ranks called different layers: every rank sees the mismatch and fails the call (after
         * the clear above, so that a fault every host reported gives way to this one). */
        mf__set_fault(p.sink, MF_ERR_INVALID_USAGE, kMfFaultLayer, p.rank, p.phase, other_layer, 0,
                      (long long)MF__SLOT_LAYER(mf__ld_acquire_sys(mine + MF__SIGNAL_SLOT(p.phase, want, other_layer))),
                      (long long)(p.layer & MF__LAYER_MASK), 0);
        return;
    }
    if (failed < 0) return;
    const int32_t code = (int32_t)(failed_status & kMfStatusCode);
    if (failed == p.rank && !p.reject && s->code == code)
        mf__set_fault(p.sink, code, s->kind, p.rank, s->phase, s->peer, 0, s->a, s->b, s->c);
    else
        mf__set_fault(p.sink, code, failed == p.rank ? kMfFaultRejected : kMfFaultPeer, failed, p.phase, failed,
                      failed == p.rank && (failed_status & kMfStatusReported) ? 1 : 0, 0, 0, 0);
}

/* One sync, block-wide (blockDim.x >= kMfWaitThreads): thread 0 arrives with this rank's status;
 * one thread per peer waits for that peer's arrival; then thread 0 reads every status and applies
 * the fault model above; every thread returns after it (a trailing barrier). A comm that timed out
 * or was aborted still arrives but no longer waits (its protocol state is gone). */
__device__ void mf__sync_block(const mf__sync_params_t &p) {
    __shared__ uint64_t want;
    __shared__ int32_t stop;
    mf__device_state_t *s = p.sink.state;
    uint64_t *mine = p.signals[p.rank];
    if (threadIdx.x == 0 && p.mode == kMfSyncWait) { /* the receive half: the send's epoch */
        want = *(volatile unsigned long long *)p.epoch;
        stop = s->fault == MF_ERR_TIMEOUT || s->fault == MF_ERR_ABORTED;
    } else if (threadIdx.x == 0) {
        const int32_t fault = s->fault;
        const bool ack = fault && p.acked_id == s->fault_id;
        uint64_t status;
        if (fault && !ack) status = (uint64_t)fault; /* not yet acknowledged here: the call fails */
        else if (p.reject) status = (uint64_t)p.reject | kMfStatusReported;
        else status = s->claim ? (uint64_t)s->code : 0;
        if (ack) status |= kMfStatusAck;
        const uint64_t epoch = mine[MF__SIGNAL_EPOCHS + p.phase] + 1;
        mine[MF__SIGNAL_EPOCHS + p.phase] = epoch;
        __threadfence_system(); /* everything this stream wrote before is visible before the signal */
        for (int32_t q = 0; q < p.num_ranks; q++)
            mf__st_release_sys(p.signals[q] + MF__SIGNAL_SLOT(p.phase, epoch, p.rank),
                               epoch << MF__EPOCH_SHIFT | (uint64_t)(p.layer & MF__LAYER_MASK) << MF__STATUS_BITS | status);
        want = epoch;
        stop = fault == MF_ERR_TIMEOUT || fault == MF_ERR_ABORTED;
        if (p.mode == kMfSyncArrive) {
            *p.epoch = epoch;
            s->claim = 0; /* this send's fresh fault, if any, travelled in the arrival */
        }
    }
    if (p.mode == kMfSyncArrive) return; /* the send half: no wait (mode is uniform over the block) */
    __syncthreads();
    const int32_t q = threadIdx.x;
    if (q < p.num_ranks && !stop) {
        const uint64_t *slot = mine + MF__SIGNAL_SLOT(p.phase, want, q);
        const uint64_t *peer_abort = mine + MF__SIGNAL_ABORT + q;
        uint64_t start = mf__globaltimer_ns(), seen;
        for (uint32_t spin = 0; (seen = mf__ld_acquire_sys(slot)) >> MF__EPOCH_SHIFT < want; spin++) {
            if ((spin & 63) == 63) {
                if (p.sink.record->abort || mf__ld_acquire_sys(peer_abort)) {
                    /* A peer that arrived before it aborted (a send half, then mf_comm_abort) did arrive. */
                    if (!p.sink.record->abort && mf__ld_acquire_sys(slot) >> MF__EPOCH_SHIFT >= want) break;
                    mf__set_fault(p.sink, MF_ERR_ABORTED, kMfFaultAborted, p.rank, p.phase, q, 0, 0, 0, 0);
                    break;
                }
                if (mf__globaltimer_ns() - start > p.timeout_ns) {
                    /* The peer's own epoch tells "never arrived" (< want) from "arrived, signal lost". */
                    const uint64_t peer_epoch = mf__ld_acquire_sys(p.signals[q] + MF__SIGNAL_EPOCHS + p.phase);
                    mf__set_fault(p.sink, MF_ERR_TIMEOUT, kMfFaultTimeout, p.rank, p.phase, q, 0,
                                  (long long)(seen >> MF__EPOCH_SHIFT), (long long)want, (long long)peer_epoch);
                    break;
                }
            }
            __nanosleep(kMfWaitBackoffNs);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) mf__sync_verdict(p, want, stop);
    __syncthreads();
}

/* One block: mf__sync_block. One kernel for both halves: a kernel boundary fewer per
 * synchronisation. The arrival publishes everything this stream wrote before: the previous kernel
 * must have completed. The kernel that follows (a small grid, backend.cu) may then take its place
 * on the SMs while this one waits for the peers. */
__global__ void __launch_bounds__(kMfWaitThreads) mf__sync_kernel(mf__sync_params_t p) {
    mf__pdl_wait();
    mf__pdl_trigger();
    mf__sync_block(p);
}

#endif /* MF_CUDA_SYNC_CUH */
