/*
 * fault.cuh — the comm's one fault sink, as device code sees it: the sticky fault state in device
 * memory, the host's mapped copy of it, and the two ways a kernel records a fault into them
 * (mf__raise: a fresh fault of this call, before its first sync; mf__set_fault: sticky at once).
 * Every kernel that can fault reports here through the sink it was given: the movement and sync
 * kernels (kernels/movement.cuh, kernels/sync.cuh, whose file comment has the fault model) and the
 * expert GEMMs' bounded pipeline waits (kernels/sm90_ptx.cuh mf__pipeline_fault, into words of
 * their own: see mf__device_error.pipeline). The host reads the mapped copy without synchronising
 * (cuda/backend.cu mf__cuda_take_fault).
 */
#ifndef MF_CUDA_KERNELS_FAULT_CUH
#define MF_CUDA_KERNELS_FAULT_CUH

#include <stdint.h>

#include "cuda/configs.cuh" /* kMfFault*: the kinds */

/* The host's view of the comm's fault, in mapped host memory; `code` is written last. */
typedef struct mf__device_error {
    volatile int32_t code;         /* sticky fault code (mf_result_t); 0 = healthy */
    int32_t kind;                  /* kMfFault* */
    int32_t rank, phase, peer;     /* rank whose fault it is (the raiser), phase, peer (per kind) */
    int32_t reported;              /* 1: this rank's host already returned it (its own rejection) */
    long long a, b, c;             /* kind-specific details */
    volatile unsigned long long fault_id; /* the fault's id, the same on every rank */
    volatile int32_t abort;        /* the host sets 1 (mf_comm_abort): this rank's waits end */
    int32_t pad;
    unsigned long long one;        /* 1: the source of abort words copied into the peers' signals */
    /* An expert GEMM's pipeline wait that expired (mf__pipeline_fault): not a fault of the call's
     * protocol but of this rank's GEMMs, so it has words of its own, which only the GEMMs write and
     * no sync verdict clears (the GEMMs may run on another stream than the syncs: mf_moe_experts);
     * `pipeline` (1) is written last; the host breaks the comm when it sees it. */
    volatile int32_t pipeline;
    int32_t pipeline_drained;      /* 1: it drained after another wait of the process expired */
    long long pipeline_block, pipeline_thread, pipeline_site;
} mf__device_error_t;

/* The comm's fault state in device memory (only this rank's kernels touch it, in stream order; the
 * GEMMs' `pipeline` claim excepted, which nothing else reads on the device). */
typedef struct mf__device_state {
    int32_t pipeline;              /* the first expired GEMM wait's claim on the record's pipeline words */
    int32_t claim;                 /* a fresh fault of this call: the first raiser wins */
    int32_t fault;                 /* sticky fault code; 0 = healthy */
    unsigned long long fault_id;   /* incremented by every new sticky fault */
    int32_t code, kind, phase, peer; /* the fresh fault's details */
    long long a, b, c;
} mf__device_state_t;

typedef struct mf__fault_sink {
    mf__device_state_t *state;     /* device memory */
    mf__device_error_t *record;    /* mapped host memory (device pointer) */
    int32_t rank;
} mf__fault_sink_t;

/* Whether the comm is faulted: kernels after a sync write nothing then. */
__device__ __forceinline__ bool mf__faulted(const mf__fault_sink_t &sink) {
    return *(volatile const int32_t *)&sink.state->fault != 0;
}

/* A fresh fault, before the call's first sync (any thread; the first raiser's details win): only
 * publish raises one, which is what lets a forward at R = 1 skip its COMBINE sync (backend.cu
 * mf__cuda_sum_at: no claim can be pending after the DISPATCH verdict). Its
 * field-by-field copy is like mf__set_fault's on purpose: two records (this rank's claim in device
 * memory, the host's mapped copy with its own fences and field order), not one struct to share. */
__device__ __forceinline__ void mf__raise(const mf__fault_sink_t &sink, int32_t code, int32_t kind, int32_t phase,
                                          int32_t peer, long long a, long long b, long long c) {
    mf__device_state_t *s = sink.state;
    if (atomicCAS(&s->claim, 0, 1) != 0) return;
    s->code = code;
    s->kind = kind;
    s->phase = phase;
    s->peer = peer;
    s->a = a;
    s->b = b;
    s->c = c;
    __threadfence();
}

/* Makes the comm faulted (sticky) unless it already is; any thread, the first one wins. Its copy is
 * like mf__raise's on purpose (there). */
__device__ __forceinline__ void mf__set_fault(const mf__fault_sink_t &sink, int32_t code, int32_t kind, int32_t rank,
                                              int32_t phase, int32_t peer, int32_t reported, long long a, long long b,
                                              long long c) {
    mf__device_state_t *s = sink.state;
    if (atomicCAS(&s->fault, 0, code) != 0) return;
    const unsigned long long id = ++s->fault_id;
    mf__device_error_t *r = sink.record;
    r->kind = kind;
    r->rank = rank;
    r->phase = phase;
    r->peer = peer;
    r->reported = reported;
    r->a = a;
    r->b = b;
    r->c = c;
    r->fault_id = id;
    __threadfence_system();
    r->code = code;
    __threadfence_system();
}

#endif /* MF_CUDA_KERNELS_FAULT_CUH */
