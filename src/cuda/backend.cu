/*
 * backend.cu — the CUDA backend (sm_90a). Each rank (a thread of one process over the local
 * transport, or a process over ipc / nccl: src/transport/) drives its own stream and has one
 * device allocation for its symmetric heap and one for its signals, reached by peers through the
 * peer table the transport filled. Kernels see the heap as one heap view per heap slot
 * (cuda/heap_view.h: the peer table and the slot's region offsets), built when the layer is created
 * (mf__cuda_moe_t.views) and embedded in every launch's parameters.
 *
 * One forward on rank r is a sequence of launches on the caller's stream, with no host
 * synchronisation and nothing that breaks CUDA-graph capture:
 *   publish           quantise x (FP8 1x128) or copy it, validate + copy ids and weights, write T
 *   sync              phase DISPATCH: arrive, then wait (one block; device epochs; bounded by the
 *                     timeout)
 *   plan              count per local expert, offsets + capacity check, rank-major source rows
 *                     (small problems: the sync and the plan in one block, mf__plan_small_kernel)
 *   gather            PULL / UNFUSED: pull the routed rows from the peers' heaps into the receive
 *                     tensor; DIRECT: none, W13 reads each row at its owner through the plan
 *   w13, w2           grouped GEMMs (grouped_gemm.cu); W2 writes BF16 partials into the owners'
 *                     combine slots through the heap view (UNFUSED: into a local tensor, then
 *                     the return kernel copies them there, as mf_combine does)
 *   sync              phase COMBINE
 *   sum               y[t] = bf16(sum over k ascending of w[t,k] * slot[t,k])
 * Buffer reuse follows the CPU backend's argument (src/cpu/backend.c): two phases per call order
 * every reuse, so nothing is cleared between calls.
 *
 * The split halves (docs/API.md section 16) run in an exchange's heap slot with that slot's plan
 * buffers (mf__cuda_slot_t): a send is publish (or return) + the ARRIVE half of the sync kernel,
 * which leaves its epoch in a device word of the slot and exits; a receive is the WAIT half (a
 * call's first kernel, no PDL attribute) + plan + gather, or + sum. The one-call forms and the
 * forward use slot 0 and the whole sync, as before.
 *
 * Programmatic dependent launch (cuda/pdl.cuh; MF_PDL=0 turns it off): every kernel above waits
 * for its predecessor (mf__pdl_wait) before touching global memory and only then lets its
 * successor start (mf__pdl_trigger), so a kernel launched with the attribute has its launch and
 * prologue hidden under the previous kernel's tail, and each kernel still completes after all the
 * ones before it (a sync's arrival still publishes everything its stream wrote). The edges with the
 * attribute: publish -> sync DISPATCH -> plan fetch -> offsets -> fill -> [gather] -> w13 ->
 * [spare w13] -> w2 -> [spare w2] -> [return] -> sync COMBINE -> sum; at R = 1 the small kernel
 * (w13 + w2 + sum) after the plan, or, with its own plan, right after publish (which syncs itself);
 * mf_dispatch the same from publish to gather, mf_combine return -> sync -> sum. A call's first
 * kernel (publish; mf_combine's return) has none: it follows the caller's kernels (the small
 * kernel with its own plan relies on that: it takes its tickets before its PDL wait). A rejected
 * call's syncs have none. Why this is safe with virtual ranks, whose sync kernels spin until every
 * peer's arrival runs on the same GPU: a resident kernel that waits holds its SMs, so no rank may
 * fill the GPU with CTAs that wait behind its spinning sync while a peer still needs SMs to reach
 * its arrival. Only the sync's successor can be resident during that spin (the trigger follows the
 * wait: at most one grid per stream runs ahead), and it gets the attribute only when its grid has
 * at most this rank's share of the SMs, comm->num_sms = SMs / ranks on the device
 * (mf__pdl_after_sync: the plan fetch, R x 8 CTAs, and the sum, T x H/1024 CTAs; larger grids
 * launch without it). So the waiting CTAs of all the other ranks together touch fewer SMs than
 * the GPU has. Every other successor waits for a predecessor that depends on no peer (GEMMs,
 * moves, plan kernels) and is fully resident before it triggers, so it finishes. The small plan
 * (sync + plan in one block, movement.cuh) replaces sync DISPATCH -> fetch -> offsets -> fill: it
 * gets the attribute after publish, and triggers its successor (a GEMM or the gather, large grids)
 * only after its sync wait, never during the spin.
 *
 * Balanced EP (docs/DESIGN.md "Balanced EP"): the plan's units are slots (Lp static + B spare;
 * L = E / R of them without balancing); the GEMMs run once over the static slots with the caller's
 * weights and once over the spare slots with moeflow's spare allocation as the [B, N, K] operand
 * (the same kernel family: rows_hint stays on logical E). mf_moe_prefetch (pick, push, commit,
 * balance/prefetch.cu) is ordered after this rank's previous forward and before its next one by two
 * internal events (skipped where one call is captured and the other is not: the caller orders them
 * then); this rank's COMBINE wait of that forward already saw every peer's arrival, so every peer
 * has finished reading its spare slots before a push, and reads them again only after its next
 * DISPATCH wait, which needs this rank's next publish, which follows the push.
 *
 * Faults raised by kernels (bad ids, capacity, timeouts) land in mapped host memory; the next call
 * on the comm returns them without launching anything, and mf_comm_get_async_error reports them
 * after synchronising the comm's last stream. A timeout marks the comm broken, and so does an expert
 * GEMM's expired pipeline wait (mf__cuda_pipeline_expired).
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#include <atomic>
#include <mutex>

#include "balance/prefetch.h"
#include "balance/stage.h"
#include "core/alloc.h"
#include "core/backend.h"
#include "core/errors.h"
#include "core/handles.h"
#include "core/layout.h"
#include "core/params.h"
#include "cuda/configs.cuh"
#include "cuda/grouped_gemm.h"
#include "cuda/kernels/movement.cuh"
#include "cuda/pdl.cuh"

#define MF_CUDA_CHECK(call)                                                                      \
    do {                                                                                         \
        cudaError_t mf__e = (call);                                                              \
        if (mf__e != cudaSuccess) {                                                              \
            (void)cudaGetLastError();                                                            \
            return mf__error(MF_ERR_CUDA, "%s:%d: %s failed: %s", __FILE__, __LINE__, #call,       \
                             cudaGetErrorString(mf__e));                                         \
        }                                                                                        \
    } while (0)

typedef struct mf__cuda_comm {
    mf__device_state_t *state;    /* device: the fault state (sync.cuh) */
    mf__device_error_t *record;   /* mapped host memory (host pointer) */
    mf__device_error_t *record_d; /* its device pointer */
    cudaStream_t setup;           /* a private non-blocking stream for setup-time copies */
    cudaStream_t stream;          /* the current call's stream (the caller's; it may be gone later) */
    int32_t capturing;            /* the current call is being captured into a graph */
    cudaEvent_t done;             /* recorded after each call's launches (not while capturing) */
    unsigned long long reported_id;   /* the last fault id this host reported to the user */
    unsigned long long call_acked;    /* reported_id when the current call began: its syncs' ack */
    int64_t launched[MF__NUM_PHASES]; /* arrivals launched by the host (atomic: peers read it) */
} mf__cuda_comm_t;

/* The TMA GEMMs' schedule pairs of a layer (mf__gemm_segments_t.sched), one per launch that can
 * overlap another under PDL. */
enum { kMfSchedW13 = 0, kMfSchedSpareW13, kMfSchedW2, kMfSchedSpareW2, kMfSchedPairs };

typedef struct mf__cuda_moe {
    int32_t *ids_all, *T_all, *global_counts; /* plan: [R, S, K], [R], [E] (zero between calls) */
    int32_t *counts, *offsets, *src; /* plan: [N][L], [N][L + 1], [N][rows, 3], one per heap slot (N =
                                        max_in_flight: an exchange's plan lives from its dispatch
                                        receive to its combine send); the forward uses slot 0 */
    unsigned long long *epochs;      /* [N][2] device: the DISPATCH / COMBINE epochs of each slot's sends */
    mf__heap_view_t views[MF_MAX_IN_FLIGHT]; /* [N] the heap view of each heap slot (cuda/heap_view.h), built
                                                once at init: every launch embeds its slot's */
    int32_t *masked_offsets;         /* MASKED: [L + 1] e * C, the segments of mf_moe_experts */
    uint8_t *recv_x;                 /* [rows, H] of mf_moe_forward */
    float *recv_scales;              /* [rows, H/128] (FP8) */
    uint8_t *h;                      /* [rows, I] FP8 or BF16 */
    float *h_scales;                 /* [rows, I/128] (FP8) */
    uint16_t *expert_out;            /* [rows, H] BF16: MF_DATAFLOW_UNFUSED only */
    int64_t rows;
    cudaEvent_t events[MF_NUM_PHASES + 1];
    int32_t events_valid;            /* the last forward recorded every event */
    /* Balanced EP. slots = Lp + B (= L without balancing); balanced: the slot plan runs; held: the
     * static slots the caller's weights hold (Lp, or L_r of a mapped placement, whose empty slots
     * are the last: the GEMMs' weight operands end there). */
    int32_t slots, Lp, B, balanced, held;
    int32_t *map;                    /* [P] device copy of moe->expert_map */
    int32_t *staged_map;             /* [P] device copy of moe->staged_map, installed by the last stage step */
    int32_t *slot_expert, *slot_begin; /* [slots] */
    int32_t *resident, *next;        /* [R * B] spare tables */
    int32_t *prev_counts;            /* [E] global counts of the last plan that did not fault */
    int32_t *words;                  /* [2]: have_prev, weights_seen */
    int32_t *sched;                  /* [4][2] zeroed: the TMA GEMMs' schedule pairs (W13, spare W13, W2,
                                        spare W2: each launch that can overlap another has its own) */
    int32_t *small_sync;             /* [2 + slots + S H/128] zeroed: the small-batch kernel's ticket, finished
                                        CTAs, per-expert W13 counters and (R = 1) per (token, 128 columns)
                                        W2 arrivals (it zeroes them again at its end) */
    int32_t *publish_count;          /* [1] zeroed: blocks of a publish that syncs (mf__publish_sync_kernel)
                                        that finished; its last block zeroes it again */
    int32_t *pick_scratch;           /* [mf__balance_scratch_words] */
    int64_t *stats;                  /* [2 * MF_MAX_RANKS + 3]: plan loads, home loads, prefetch stats */
    size_t plan_smem, pick_smem;     /* dynamic shared memory of the balanced plan / the pick */
    uint32_t prefetches;             /* mf_moe_prefetch calls (published in the heap meta) */
    cudaEvent_t fwd_done, pf_done;   /* orders a prefetch after the last forward, the next forward after it */
    int32_t fwd_recorded, pf_pending;
    unsigned long long fwd_capture, pf_capture; /* capture id of the recording call (0: eager) */
} mf__cuda_moe_t;

static mf__cuda_comm_t *mf__cc(mf_comm_t comm) { return (mf__cuda_comm_t *)comm->backend_state; }

extern "C" int32_t mf__cuda_plan_serial = 0; /* balance/prefetch.h */
extern "C" int32_t mf__cuda_plan_small = 1;  /* balance/prefetch.h */
/* The small-batch kernel's switch (grouped_gemm.h): 5 = 4 with its first unit's W13 rows made from x
 * by the producer warpgroup's idle warps at R = 1 (publish still writes x), 4 (the default) = 3 with
 * the W2 weights of the next round sent to L2 by a waiting W2 unit, 3 without, 2 with its own sum
 * only, 1 without either, 0 off. 5 ran deepseek-v3 T = 1 34.5 % slower than 4 on the H200 (6c169f7,
 * bench/NOTES.md); three more were measured slower and removed: a producer that made every W13 row
 * from x itself (2.2x on an H100), the last expert's W2 units in halves (+0.1 to +2.5 % on the
 * H200), each unit's weights sent into L2 a ring ahead (17-25 % on an H100). A comm init that reads MF_SMALL sets it for the rest of the
 * process (core/params.c); the GPU tests set it directly. */
extern "C" int32_t mf__cuda_small = 4;
extern "C" int32_t mf__cuda_small_rows = mf__small::kMaxRows; /* grouped_gemm.h */
extern "C" int32_t mf__cuda_decode_tokens = 64;                 /* grouped_gemm.h: MF_DECODE_TOKENS */
extern "C" int32_t mf__cuda_decode_l2 = 0;                       /* grouped_gemm.h: MF_DECODE_L2 */
/* The TMA family's tail tiles (grouped_gemm.h): cleared for the rest of the process by a comm init
 * that reads MF_TMA_TAILS=0 (core/params.c), and by `moeflow bench gemm`. */
extern "C" int32_t mf__cuda_tma_tails = 1;

/* ---- comm and memory ---------------------------------------------------------------------- */

/* Kernels are built for sm_90a only. */
static int32_t mf__cuda_device_ok(int device) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return major == 9 && minor == 0;
}

static int32_t mf__cuda_available(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        return 0;
    }
    return mf__cuda_device_ok(0);
}

static mf_result_t mf__cuda_device_id(mf_comm_t comm, char id[64]) {
    int n = 0;
    MF_CUDA_CHECK(cudaGetDeviceCount(&n));
    if (comm->device >= n)
        return mf__error(MF_ERR_INVALID_ARGUMENT, "cuda backend: rank %d: device %d does not exist (%d devices)",
                         comm->rank, comm->device, n);
    if (!mf__cuda_device_ok(comm->device))
        return mf__error(MF_ERR_NOT_SUPPORTED, "cuda backend: rank %d: device %d is not sm_90 (the kernels are built "
                         "for sm_90a)", comm->rank, comm->device);
    MF_CUDA_CHECK(cudaSetDevice(comm->device));
    MF_CUDA_CHECK(cudaDeviceGetPCIBusId(id, 64, comm->device));
    return MF_SUCCESS;
}

static void mf__cuda_comm_fini(mf_comm_t comm) {
    mf__cuda_comm_t *c = mf__cc(comm);
    if (!c) return;
    cudaSetDevice(comm->device);
    if (c->done) {
        cudaEventSynchronize(c->done); /* the last call's kernels, even if its stream is gone */
        cudaEventDestroy(c->done);
    }
    cudaFree(c->state);
    if (c->record) cudaFreeHost(c->record);
    if (c->setup) cudaStreamDestroy(c->setup);
    mf__free(c);
    comm->backend_state = NULL;
    (void)cudaGetLastError();
}

static mf_result_t mf__cuda_comm_init(mf_comm_t comm) {
    int sms = 0;
    MF_CUDA_CHECK(cudaSetDevice(comm->device));
    MF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, comm->device));
    /* Ranks that share a device must all be resident at once: each gets its share of the SMs. */
    comm->device_sms = sms;
    if (!comm->num_sms) comm->num_sms = sms / comm->ranks_on_device > 0 ? sms / comm->ranks_on_device : 1;
    if (comm->num_sms > sms)
        return mf__error(MF_ERR_INVALID_ARGUMENT, "cuda backend: num_sms %d exceeds the device's %d SMs",
                         comm->num_sms, sms);
    if (comm->transport == MF_TRANSPORT_LOCAL && comm->ranks_on_device > kMfMaxVirtualRanksPerDevice)
        return mf__error(MF_ERR_NOT_SUPPORTED, "cuda backend: %d virtual ranks share device %d; at most %d can (a process "
                         "has at most %d hardware queues, CUDA_DEVICE_MAX_CONNECTIONS, and a rank whose stream shares one "
                         "can wait forever behind a peer's spinning kernel); use fewer ranks or one process per rank",
                         comm->ranks_on_device, comm->device, kMfMaxVirtualRanksPerDevice, kMfMaxVirtualRanksPerDevice);
    /* Load every kernel now. With lazy module loading (CUDA's default) a rank's first launch would
     * load its module on demand, which can stall behind the peers' spinning wait kernels until the
     * timeout: seen on the H200 as a first-forward timeout in every process. */
    const void *kernels[] = {(const void *)mf__publish_kernel, (const void *)mf__plan_fetch_kernel,
                             (const void *)mf__plan_offsets_kernel, (const void *)mf__plan_fill_kernel,
                             (const void *)mf__gather_kernel, (const void *)mf__return_kernel,
                             (const void *)mf__sum_kernel, (const void *)mf__sync_kernel,
                             (const void *)mf__keep_weights_kernel,
                             (const void *)mf__plan_small_kernel};
    for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++) {
        cudaFuncAttributes attr;
        MF_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernels[i]));
    }
    MF_CHECK(mf__cuda_gemm_preload());
    if (!mf__param_pdl()) __atomic_store_n(&mf__cuda_pdl, 0, __ATOMIC_RELAXED); /* MF_PDL=0 (cuda/pdl.cuh) */
    const int32_t small = mf__param_small(); /* MF_SMALL=0 to 5 sets the switch for the process */
    if (small >= 0) __atomic_store_n(&mf__cuda_small, small, __ATOMIC_RELAXED);
    const int32_t tokens = mf__param_decode_tokens(); /* MF_DECODE_TOKENS lowers the largest decode tile */
    if (tokens < __atomic_load_n(&mf__cuda_decode_tokens, __ATOMIC_RELAXED))
        __atomic_store_n(&mf__cuda_decode_tokens, tokens, __ATOMIC_RELAXED);
    if (mf__param_decode_l2()) __atomic_store_n(&mf__cuda_decode_l2, 1, __ATOMIC_RELAXED); /* MF_DECODE_L2=1 */
    if (!mf__param_tma_tails()) __atomic_store_n(&mf__cuda_tma_tails, 0, __ATOMIC_RELAXED); /* MF_TMA_TAILS=0 */

    mf__cuda_comm_t *c = (mf__cuda_comm_t *)mf__calloc(1, sizeof *c);
    if (!c) return mf__error(MF_ERR_OUT_OF_MEMORY, "cuda backend: out of host memory");
    comm->backend_state = c;
    cudaError_t e = cudaStreamCreateWithFlags(&c->setup, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaMalloc((void **)&c->state, sizeof *c->state);
    if (e == cudaSuccess) e = cudaMemsetAsync(c->state, 0, sizeof *c->state, c->setup);
    if (e == cudaSuccess) e = cudaHostAlloc((void **)&c->record, sizeof *c->record, cudaHostAllocMapped);
    if (e == cudaSuccess) {
        memset((void *)c->record, 0, sizeof *c->record);
        c->record->one = 1;
        e = cudaHostGetDevicePointer((void **)&c->record_d, (void *)c->record, 0);
    }
    if (e == cudaSuccess) e = cudaStreamSynchronize(c->setup);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        mf__cuda_comm_fini(comm);
        return mf__error(e == cudaErrorMemoryAllocation ? MF_ERR_OUT_OF_MEMORY : MF_ERR_CUDA,
                         "cuda backend: rank %d's fault state: %s", comm->rank, cudaGetErrorString(e));
    }
    return MF_SUCCESS;
}

/* Device memory for symmetric allocations, zeroed before any peer can see it. */
static mf_result_t mf__cuda_mem_alloc(mf_comm_t comm, size_t bytes, void **ptr) {
    MF_CUDA_CHECK(cudaSetDevice(comm->device));
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e == cudaSuccess) e = cudaMemsetAsync(p, 0, bytes, mf__cc(comm)->setup);
    if (e == cudaSuccess) e = cudaStreamSynchronize(mf__cc(comm)->setup);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        cudaFree(p);
        return mf__error(e == cudaErrorMemoryAllocation ? MF_ERR_OUT_OF_MEMORY : MF_ERR_CUDA,
                         "cuda backend: rank %d: %zu bytes of symmetric memory: %s", comm->rank, bytes,
                         cudaGetErrorString(e));
    }
    *ptr = p;
    return MF_SUCCESS;
}

static void mf__cuda_mem_free(mf_comm_t comm, void *ptr) {
    cudaSetDevice(comm->device);
    cudaFree(ptr);
    (void)cudaGetLastError();
}

/* mf_comm_abort: this rank's waits end (a mapped word its sync kernels poll), and so do the peers'
 * waits for it (its abort word in every peer's signals, copied on the private stream: a copy
 * engine, not behind any spinning kernel). Best effort, no wait. */
static void mf__cuda_abort(mf_comm_t comm) {
    mf__cuda_comm_t *c = mf__cc(comm);
    if (!c) return;
    c->record->abort = 1;
    __sync_synchronize();
    cudaSetDevice(comm->device);
    for (int32_t q = 0; q < comm->num_ranks; q++)
        cudaMemcpyAsync((uint64_t *)comm->signals.peers[q] + MF__SIGNAL_ABORT + comm->rank, &c->record->one,
                        sizeof(uint64_t), cudaMemcpyHostToDevice, c->setup);
    (void)cudaGetLastError();
}

/* ---- faults ------------------------------------------------------------------------------- */

static mf__fault_sink_t mf__sink(mf_comm_t comm) {
    mf__fault_sink_t s;
    s.state = mf__cc(comm)->state;
    s.record = mf__cc(comm)->record_d;
    s.rank = comm->rank;
    return s;
}

/* The message of the comm's current fault (record read without synchronising: code last). */
static mf_result_t mf__cuda_fault_message(mf_comm_t comm, const mf__device_error_t *rec) {
    const mf__device_error_t r = *rec;
    const mf_result_t code = (mf_result_t)r.code;
    const char *tail = "; this call and every call since the fault wrote nothing on any rank";
    switch (r.kind) {
    case kMfFaultTimeout: {
        /* The peer's host count tells "its thread never launched the arrival" from "launched, but
         * the device did not run it in time" (virtual ranks of this process only). */
        long long launched = -1;
        if (comm->group && r.peer >= 0 && r.peer < comm->num_ranks && r.phase >= 0 && r.phase < MF__NUM_PHASES) {
            mf_comm_t peer = comm->group->comms[r.peer];
            if (peer && peer->backend_state)
                launched = (long long)__atomic_load_n(&mf__cc(peer)->launched[r.phase], __ATOMIC_RELAXED);
        }
        return mf__error(code, "rank %d: device wait in phase '%s' timed out after %lld ms: rank %d's signal here read "
                               "epoch %lld, expected %lld (its own epoch counter: %lld; its host has launched %lld "
                               "arrivals, -1 = not known here); the comm is broken", r.rank, mf__phase_name(r.phase),
                         (long long)comm->timeout_ms, r.peer, r.a, r.b, r.c, launched);
    }
    case kMfFaultAborted:
        return mf__error(code, "rank %d: a device wait in phase '%s' ended by an abort (of this comm, or of rank %d "
                               "it waited for)", r.rank, mf__phase_name(r.phase), r.peer);
    case kMfFaultBadId:
        return mf__error(code, "rank %d: device topk_ids[%lld, %lld] = %lld is outside [-1, E)%s", r.rank, r.a, r.b, r.c,
                         tail);
    case kMfFaultDupId:
        return mf__error(code, "rank %d: device topk_ids[%lld, %lld] = %lld repeats an earlier k of the token%s", r.rank,
                         r.a, r.b, r.c, tail);
    case kMfFaultCapacity:
        if (r.peer == -2)
            return mf__error(code, "rank %lld receives %lld rows (segments padded to block_m) > max_recv_rows %lld%s",
                             r.a, r.b, r.c, tail);
        return mf__error(code, "expert %lld (rank %d) receives %lld rows > expert_capacity %lld%s", r.a, r.rank, r.b,
                         r.c, tail);
    case kMfFaultRejected:
        return mf__error(code, "rank %d: this rank's host rejected a call's input (%s)%s", r.rank,
                         mf_result_string(code), tail);
    case kMfFaultPeer:
        return mf__error(code, "rank %d failed a call (%s)%s", r.peer, mf_result_string(code), tail);
    case kMfFaultLayer:
        return mf__error(code, "rank %d called a collective on layer %lld while rank %d called layer %lld: every rank "
                               "must call the same layers in the same order%s", r.peer, r.a, r.rank, r.b, tail);
    case kMfFaultBalance: {
        static const char *const what[MF__META_WORDS] = {"", "expert map (mf_moe_set_expert_map)",
                                                         "mf_moe_prefetch calls", "mf_moe_set_weights calls"};
        return mf__error(code, "mf_moe_forward: rank %d and rank 0 differ in their %s (0x%llx and 0x%llx); every rank "
                               "makes the same balancing calls%s", r.peer, r.a >= 1 && r.a < MF__META_WORDS ? what[r.a] : "?",
                         (unsigned long long)r.b, (unsigned long long)r.c, tail);
    }
    default: return mf__error(MF_ERR_INTERNAL, "rank %d: unknown device fault kind %d (code %d)", r.rank, r.kind, r.code);
    }
}

/* Expired GEMM pipeline waits (kernels/sm90_ptx.cuh mf__pipeline_fault): the first record any comm
 * of this process shows makes every comm of the process broken, as its GEMM kernels (of every family
 * and device) are no longer trusted. g_pipeline_what: that first record, in words. */
static std::atomic<int> g_pipeline_seen;
static char g_pipeline_what[256];
static std::mutex g_pipeline_mu;

static int32_t mf__cuda_pipeline_expired(mf_comm_t comm) {
    const mf__device_error_t *r = mf__cc(comm)->record;
    if (r->pipeline && !g_pipeline_seen.load()) {
        std::lock_guard<std::mutex> lock(g_pipeline_mu);
        if (!g_pipeline_seen.load()) {
            __sync_synchronize(); /* the details were written before the flag */
            snprintf(g_pipeline_what, sizeof g_pipeline_what,
                     "%s on rank %d (block %lld, thread %lld, wait site %lld): its output is not valid and this "
                     "process's expert GEMMs are no longer trusted",
                     r->pipeline_drained ? "an expert GEMM drained after a GEMM wait of this process expired"
                                         : "an expert GEMM's pipeline wait expired",
                     comm->rank, r->pipeline_block, r->pipeline_thread, r->pipeline_site);
            g_pipeline_seen.store(1);
        }
    }
    return g_pipeline_seen.load();
}

/* The comm's fault if this host has not reported it yet (and marks it reported), else SUCCESS;
 * `only_own`: take only a fault this host returned itself (a rejection). A timeout or an abort
 * breaks the comm. */
static mf_result_t mf__cuda_take_fault(mf_comm_t comm, int32_t only_own) {
    mf__cuda_comm_t *c = mf__cc(comm);
    if (!only_own && !comm->broken && mf__cuda_pipeline_expired(comm)) {
        comm->broken = 1;
        return mf__error(MF_ERR_INTERNAL, "rank %d: %s; the comm is broken", comm->rank, g_pipeline_what);
    }
    if (!c->record->code) return MF_SUCCESS;
    __sync_synchronize(); /* the details were written before the code */
    const unsigned long long id = c->record->fault_id;
    if (id == c->reported_id) return MF_SUCCESS;
    const int32_t kind = c->record->kind, own = c->record->reported && c->record->rank == comm->rank;
    if (only_own && !own) return MF_SUCCESS;
    mf_result_t code = mf__cuda_fault_message(comm, c->record);
    if (kind == kMfFaultTimeout || kind == kMfFaultAborted) comm->broken = 1;
    c->reported_id = id;
    return own ? MF_SUCCESS : code; /* a rejection this host returned itself is not reported twice */
}

static mf_result_t mf__cuda_get_async_error(mf_comm_t comm) {
    mf__cuda_comm_t *c = mf__cc(comm);
    MF_CUDA_CHECK(cudaSetDevice(comm->device));
    MF_CUDA_CHECK(cudaEventSynchronize(c->done)); /* the comm's last call (not a graph replay's) */
    return mf__cuda_take_fault(comm, 0);
}

/* Virtual ranks share one GPU: a blocking stream waits for legacy-stream work that other threads
 * issue, which waits for this group's spinning kernels: a deadlock. INVALID_ARGUMENT for such a
 * stream. (Not queried while capturing: cudaStreamGetFlags invalidated a capture on the H200.) */
static mf_result_t mf__cuda_check_stream(mf_comm_t comm, cudaStream_t stream, int capturing, const char *call) {
    if (comm->ranks_on_device <= 1 || comm->transport != MF_TRANSPORT_LOCAL || capturing) return MF_SUCCESS;
    unsigned int flags = 0;
    if (stream) MF_CUDA_CHECK(cudaStreamGetFlags(stream, &flags));
    if (stream && (flags & cudaStreamNonBlocking)) return MF_SUCCESS;
    return mf__error(MF_ERR_INVALID_ARGUMENT,
                     "%srank %d: the stream must be created with cudaStreamNonBlocking when virtual ranks share a "
                     "GPU (a blocking or legacy stream can deadlock)", call, comm->rank);
}

/* Every data-path call starts here. It never refuses to launch because of a fault (a rank that
 * stayed out of a collective would leave its peers waiting): a fault this host has not reported yet
 * is returned by the call after its launches, and the device makes the call write nothing. */
static mf_result_t mf__cuda_enter(mf_comm_t comm, cudaStream_t stream, mf_result_t *pending) {
    /* pending == NULL: a rejected call, which reports only its rejection (a fault stays for later). */
    MF_CUDA_CHECK(cudaSetDevice(comm->device));
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (stream) MF_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    const mf_result_t bad = mf__cuda_check_stream(comm, stream, capture != cudaStreamCaptureStatusNone, "");
    if (bad != MF_SUCCESS) return bad;
    mf__cuda_comm_t *c = mf__cc(comm);
    c->stream = stream;
    c->capturing = capture != cudaStreamCaptureStatusNone;
    /* The call acknowledges the faults its host reported before it; one reported now fails it. */
    const unsigned long long before = c->reported_id;
    const mf_result_t found = mf__cuda_take_fault(comm, pending == NULL);
    c->call_acked = found == MF_SUCCESS ? c->reported_id : before;
    if (pending) *pending = found;
    return MF_SUCCESS;
}

/* Every data-path call ends here: a launch that failed part-way leaves the ranks' protocol state
 * unknown (the comm is broken); otherwise the call returns the fault found at its entry, if any. */
static mf_result_t mf__cuda_leave(mf_comm_t comm, mf_result_t launched, mf_result_t pending) {
    if (launched != MF_SUCCESS) {
        comm->broken = 1;
        return launched;
    }
    mf__cuda_comm_t *c = mf__cc(comm);
    if (!c->capturing) MF_CUDA_CHECK(cudaEventRecord(c->done, c->stream));
    return pending;
}

/* ---- layer -------------------------------------------------------------------------------- */

static void mf__cuda_moe_fini(mf_moe_t moe) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    if (!s) return;
    cudaSetDevice(moe->comm->device);
    /* Only this rank's kernels use a layer's buffers (peers read its heap): its last call. */
    cudaEventSynchronize(mf__cc(moe->comm)->done);
    cudaFree(s->ids_all);
    cudaFree(s->T_all);
    cudaFree(s->global_counts);
    cudaFree(s->counts);
    cudaFree(s->offsets);
    cudaFree(s->masked_offsets);
    cudaFree(s->src);
    cudaFree(s->epochs);
    cudaFree(s->recv_x);
    cudaFree(s->recv_scales);
    cudaFree(s->h);
    cudaFree(s->h_scales);
    cudaFree(s->expert_out);
    if (s->pf_done) {
        if (!s->pf_capture) cudaEventSynchronize(s->pf_done); /* an eager prefetch writes our tables */
        cudaEventDestroy(s->pf_done);
    }
    if (s->fwd_done) cudaEventDestroy(s->fwd_done);
    int32_t *balance_bufs[] = {s->map,  s->staged_map,   s->slot_expert, s->slot_begin, s->resident,
                               s->next, s->prev_counts, s->words,       s->pick_scratch, s->sched,
                               s->small_sync, s->publish_count};
    for (size_t i = 0; i < sizeof balance_bufs / sizeof balance_bufs[0]; i++) cudaFree(balance_bufs[i]);
    cudaFree(s->stats);
    for (int i = 0; i <= MF_NUM_PHASES; i++)
        if (s->events[i]) cudaEventDestroy(s->events[i]);
    (void)cudaGetLastError();
    mf__free(s);
    moe->backend_state = NULL;
}

/* Expected rows per local expert, T K R / E from this rank's T (rounded up): the fact the GEMM
 * choice reads, the same for every dataflow. */
static int32_t mf__cuda_rows_hint(mf_moe_t moe, int32_t T) {
    const mf_moe_config_t *c = &moe->config;
    int64_t routed = (int64_t)T * c->num_topk * moe->comm->num_ranks;
    return (int32_t)((routed + c->num_experts - 1) / c->num_experts);
}

/* The bound on one local expert's receive rows: a token routes to an expert at most once, R * S
 * rows (MASKED: at most C; EXPERT_MAJOR: at most max_recv_rows). */
static int32_t mf__cuda_rows_bound(mf_moe_t moe) {
    const mf_moe_config_t *c = &moe->config;
    int64_t per_expert = (int64_t)moe->comm->num_ranks * c->max_tokens_per_rank;
    if (c->layout == MF_LAYOUT_MASKED) per_expert = c->expert_capacity;
    if (c->layout == MF_LAYOUT_EXPERT_MAJOR && per_expert > c->max_recv_rows) per_expert = c->max_recv_rows;
    return (int32_t)per_expert;
}

/* The GEMM choice of one forward with this rank's T (grouped_gemm.h mf__gemm_choose): kernel family,
 * tile and dataflow (docs/API.md "Dataflow": DIRECT only with the decode family, the one that reads
 * rows in place; above it an explicit DIRECT pulls, y stays the same bits; AUTO: DIRECT where it
 * can). Made once per forward and carried to every GEMM of it. The choice is local (peers only
 * publish). */
static mf__gemm_choice_t mf__cuda_gemm_choice(mf_moe_t moe, int32_t T) {
    const mf_moe_config_t *cfg = &moe->config;
    mf__gemm_choice_t c = mf__gemm_choose(mf__cuda_rows_hint(moe, T), mf__cuda_rows_bound(moe), cfg->dataflow);
    /* the small-batch kernel has no spare-slot launch: a layer with spare slots runs the two GEMMs;
     * and it runs only where this rank expects few routed rows (T K R over the experts, times its
     * local ones; this rank's T stands for every rank's, as in rows_hint), where it leads the two
     * GEMMs (mf__small::kMaxRows) */
    const mf__cuda_moe_t *s = (const mf__cuda_moe_t *)moe->backend_state;
    const int64_t rows = (int64_t)T * cfg->num_topk * moe->comm->num_ranks * moe->info.num_local_experts /
                         (cfg->num_experts > 0 ? cfg->num_experts : 1);
    if ((s && s->B) || __atomic_load_n(&mf__cuda_small, __ATOMIC_RELAXED) == 0 ||
        rows > __atomic_load_n(&mf__cuda_small_rows, __ATOMIC_RELAXED))
        c.fused = 0;
    return c;
}

/* Whether a forward of T tokens with `choice` plans inside the small-batch kernel (its own tables,
 * kernels/sm90_small_gemm.cuh own_tables) instead of in a plan kernel, publish running the DISPATCH
 * sync (switch `small` >= 3): at R = 1 with the kernel's own sum, T K entries it holds, no balancing
 * and every expert local (L = E: the kernel validates ids as publish does), and no capacity verdict
 * the plan could reach: an expert holds at most T rows, so MASKED T <= C, and EXPERT_MAJOR's worst
 * padding (at most min(T K, L) experts with rows, each padded to block_m) fits the receive rows. The
 * kernel must take the shapes (mf__sm90_small_takes): nothing falls back after a publish without a
 * plan. */
static int32_t mf__cuda_own_plan(mf_moe_t moe, const mf__gemm_choice_t *choice, int32_t T, int32_t small) {
    const mf__cuda_moe_t *s = (const mf__cuda_moe_t *)moe->backend_state;
    const mf_moe_config_t *c = &moe->config;
    if (small < 3 || !choice->fused || moe->comm->num_ranks != 1 || T < 1) return 0;
    if (s->balanced || s->B || s->held != c->num_experts || s->slots != c->num_experts || moe->info.first_expert)
        return 0;
    const int64_t n = (int64_t)T * c->num_topk, L = c->num_experts, used = n < L ? n : L; /* experts with rows */
    if (T > mf__small::kOwnMaxTokens || n > mf__small::kOwnEntries || mf__cuda_rows_bound(moe) < T) return 0;
    const int64_t padded_a = n + used * (c->block_m - 1);                          /* each one padded */
    const int64_t padded_b = used * ((T + c->block_m - 1) / c->block_m) * c->block_m; /* each at most T rows */
    if (c->layout == MF_LAYOUT_MASKED ? T > c->expert_capacity
                                      : (padded_a < padded_b ? padded_a : padded_b) > c->max_recv_rows)
        return 0;
    return mf__sm90_small_takes(choice, (int32_t)L, c->dtype, c->hidden, c->intermediate) == MF_SUCCESS;
}

static mf_result_t mf__cuda_moe_init(mf_moe_t moe) {
    const mf_moe_config_t *c = &moe->config;
    const int32_t R_ = moe->comm->num_ranks, P = c->num_physical_experts, B = c->spare_slots;
    MF_CUDA_CHECK(cudaSetDevice(moe->comm->device));
    /* Balanced EP: the planner's arrays live in shared memory (the plan's offsets kernel, the pick). */
    const size_t plan_smem = mf__plan_balance_smem(c->num_experts, R_, P, B);
    const size_t pick_smem = B ? mf__prefetch_smem_bytes(c->num_experts, R_, P, B) : 0;
    if (mf__moe_balanced(moe) && (plan_smem > kMfPrefetchMaxSmem || (B && !pick_smem)))
        return mf__error(MF_ERR_NOT_SUPPORTED, "mf_moe_create: the cuda backend's balancing planner keeps its arrays "
                         "in shared memory (at most %d bytes): E = %d, P = %d, R = %d, B = %d need more",
                         kMfPrefetchMaxSmem, c->num_experts, P, R_, B);
    if (B && (moe->spare_layout.w13_bytes % 16 || moe->spare_layout.w2_bytes % 16))
        return mf__error(MF_ERR_NOT_SUPPORTED, "mf_moe_create: spare slots need expert weights of a multiple of 16 bytes");
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)mf__calloc(1, sizeof *s);
    if (!s) return mf__error(MF_ERR_OUT_OF_MEMORY, "cuda backend: out of host memory");
    moe->backend_state = s;
    s->Lp = moe->slots_per_rank;
    s->B = B;
    s->slots = s->Lp + B;
    s->balanced = mf__moe_balanced(moe); /* replicas, spare slots or a mapped placement (no map is set yet) */
    s->held = moe->info.num_local_slots;
    s->plan_smem = plan_smem;
    s->pick_smem = pick_smem;
    for (int32_t i = 0; i < moe->heap.num_slots; i++) { /* the heap was sized before the layer and never moves */
        const mf__heap_layout_t slot = mf__heap_layout_slot(&moe->heap, i);
        mf__heap_view_init(&s->views[i], &moe->comm->heap, R_, moe->comm->rank, &slot);
    }
    int64_t L = s->slots, H = c->hidden, I = c->intermediate;
    int fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    s->rows = c->layout == MF_LAYOUT_MASKED ? L * c->expert_capacity : c->max_recv_rows;
    size_t esz = fp8 ? 1 : 2;
    /* A receive tensor only where a forward can pull: DIRECT layers pull where the choice for the
     * largest T does (rows_hint grows with T, and decode is chosen below a bound). */
    int pull = c->dataflow != MF_DATAFLOW_DIRECT ||
               mf__cuda_gemm_choice(moe, c->max_tokens_per_rank).dataflow != MF_DATAFLOW_DIRECT;
    const size_t R = (size_t)moe->comm->num_ranks, N = (size_t)moe->heap.num_slots;
    const size_t small_words = /* ticket, count, W13 counters; at R = 1 the sum's (token, 128 columns) counters */
        (size_t)(2 + L) + (R_ == 1 ? (size_t)c->max_tokens_per_rank * (size_t)(H / MF__QUANT_BLOCK) : 0);
    struct { void **p; size_t bytes; } allocs[] = {
        {(void **)&s->ids_all, R * (size_t)c->max_tokens_per_rank * (size_t)c->num_topk * 4},
        {(void **)&s->T_all, R * 4},
        {(void **)&s->global_counts, (size_t)c->num_experts * 4},
        {(void **)&s->counts, N * (size_t)L * 4},
        {(void **)&s->offsets, N * (size_t)(L + 1) * 4},
        {(void **)&s->epochs, N * 2 * sizeof(unsigned long long)},
        {(void **)&s->masked_offsets, c->layout == MF_LAYOUT_MASKED ? (size_t)(L + 1) * 4 : 0},
        {(void **)&s->src, N * (size_t)s->rows * 12},
        {(void **)&s->recv_x, pull ? (size_t)(s->rows * H) * esz : 0},
        {(void **)&s->recv_scales, pull && fp8 ? (size_t)(s->rows * (H / MF__QUANT_BLOCK)) * 4 : 0},
        {(void **)&s->h, (size_t)(s->rows * I) * esz},
        {(void **)&s->h_scales, fp8 ? (size_t)(s->rows * (I / MF__QUANT_BLOCK)) * 4 : 0},
        {(void **)&s->expert_out, c->dataflow == MF_DATAFLOW_UNFUSED ? (size_t)(s->rows * H) * 2 : 0},
        {(void **)&s->map, (size_t)P * 4},
        {(void **)&s->staged_map, (size_t)P * 4},
        {(void **)&s->slot_expert, (size_t)L * 4},
        {(void **)&s->slot_begin, (size_t)L * 4},
        {(void **)&s->resident, (size_t)(R * B + 1) * 4},
        {(void **)&s->next, (size_t)(R * B + 1) * 4},
        {(void **)&s->prev_counts, (size_t)c->num_experts * 4},
        {(void **)&s->words, 2 * 4},
        {(void **)&s->sched, kMfSchedPairs * 2 * 4},
        {(void **)&s->small_sync, small_words * 4},
        {(void **)&s->publish_count, R_ == 1 ? (size_t)4 : 0}, /* only a forward at R = 1 plans in the small kernel */
        {(void **)&s->pick_scratch, B ? (size_t)mf__balance_scratch_words(c->num_experts, R_, P, B) * 4 : 0},
        {(void **)&s->stats, (2 * MF_MAX_RANKS + 3) * 8},
    };
    for (size_t i = 0; i < sizeof allocs / sizeof allocs[0]; i++) {
        if (!allocs[i].bytes) continue;
        cudaError_t e = cudaMalloc(allocs[i].p, allocs[i].bytes);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            mf__cuda_moe_fini(moe);
            return mf__error(MF_ERR_OUT_OF_MEMORY, "cuda backend: rank %d: %zu bytes of layer buffers: %s",
                             moe->comm->rank, allocs[i].bytes, cudaGetErrorString(e));
        }
    }
    /* The plan's global counters are zero between calls (its offsets kernel re-zeroes them). */
    cudaStream_t setup = mf__cc(moe->comm)->setup;
    cudaError_t e = cudaMemsetAsync(s->global_counts, 0, (size_t)c->num_experts * 4, setup);
    /* Balancing: the map, an empty spare table (-1), no previous forward, weights count 0. */
    if (e == cudaSuccess) e = cudaMemcpyAsync(s->map, moe->expert_map, (size_t)P * 4, cudaMemcpyHostToDevice, setup);
    if (e == cudaSuccess) e = cudaMemsetAsync(s->resident, 0xff, (size_t)(R * B + 1) * 4, setup);
    if (e == cudaSuccess) e = cudaMemsetAsync(s->next, 0xff, (size_t)(R * B + 1) * 4, setup);
    if (e == cudaSuccess) e = cudaMemsetAsync(s->words, 0, 2 * 4, setup);
    if (e == cudaSuccess) e = cudaMemsetAsync(s->sched, 0, kMfSchedPairs * 2 * 4, setup);
    if (e == cudaSuccess) e = cudaMemsetAsync(s->small_sync, 0, small_words * 4, setup);
    if (e == cudaSuccess && s->publish_count) e = cudaMemsetAsync(s->publish_count, 0, 4, setup);
    if (e == cudaSuccess) e = cudaMemsetAsync(s->stats, 0, (2 * MF_MAX_RANKS + 3) * 8, setup);
    int32_t *masked = NULL; /* host copy of e * C, until the setup stream has read it */
    if (e == cudaSuccess && s->masked_offsets) {
        masked = (int32_t *)mf__malloc((size_t)(L + 1) * 4);
        if (!masked) e = cudaErrorMemoryAllocation;
        for (int64_t i = 0; masked && i <= L; i++) masked[i] = (int32_t)(i * c->expert_capacity);
        if (e == cudaSuccess)
            e = cudaMemcpyAsync(s->masked_offsets, masked, (size_t)(L + 1) * 4, cudaMemcpyHostToDevice, setup);
    }
    if (e == cudaSuccess && plan_smem > 48 * 1024 && plan_smem <= kMfPrefetchMaxSmem)
        e = cudaFuncSetAttribute(mf__plan_offsets_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)plan_smem);
    if (e == cudaSuccess && B) e = mf__cuda_prefetch_preload(pick_smem) == MF_SUCCESS ? cudaSuccess : cudaErrorUnknown;
    /* Events of the prefetch ordering: spare slots and staged maps (any layer may stage one). */
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s->fwd_done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s->pf_done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaStreamSynchronize(setup);
    mf__free(masked);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        mf__cuda_moe_fini(moe);
        return mf__error(MF_ERR_CUDA, "cuda backend: rank %d: zeroing the plan's counters: %s", moe->comm->rank,
                         cudaGetErrorString(e));
    }
    if (c->profile)
        for (int i = 0; i <= MF_NUM_PHASES; i++)
            if (cudaEventCreate(&s->events[i]) != cudaSuccess) {
                (void)cudaGetLastError();
                mf__cuda_moe_fini(moe);
                return mf__error(MF_ERR_CUDA, "cuda backend: cudaEventCreate failed");
            }
    return MF_SUCCESS;
}

static mf_result_t mf__cuda_get_phase_times(mf_moe_t moe, mf_phase_times_t *times) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    if (!s->events_valid)
        return mf__error(MF_ERR_INVALID_USAGE,
                         "mf_moe_get_phase_times: no forward was timed (none ran, or it was captured in a graph)");
    MF_CUDA_CHECK(cudaEventSynchronize(s->events[MF_NUM_PHASES]));
    memset(times, 0, sizeof *times);
    for (int i = 0; i < MF_NUM_PHASES; i++) {
        float ms = 0;
        MF_CUDA_CHECK(cudaEventElapsedTime(&ms, s->events[i], s->events[i + 1]));
        times->us[i] = ms * 1e3;
        times->total_us += ms * 1e3;
    }
    return MF_SUCCESS;
}

/* ---- launch helpers ----------------------------------------------------------------------- */

/* What a call's kernels move through: the heap view and the plan of one heap slot (the forward's
 * and the one-call forms' slot 0, or an exchange's, x->slot), and the device words where the slot's
 * send halves leave their epochs for the receive halves. */
typedef struct mf__cuda_slot {
    const mf__heap_view_t *view;     /* every rank's heap and the slot's regions (the layer's views[slot]) */
    int32_t *counts, *offsets, *src; /* [L], [L + 1], [rows, 3] */
    unsigned long long *epochs;      /* [2]: DISPATCH, COMBINE */
} mf__cuda_slot_t;

static mf__cuda_slot_t mf__cuda_slot(mf_moe_t moe, int32_t slot) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    const size_t i = (size_t)slot, L = (size_t)s->slots;
    mf__cuda_slot_t v = {&s->views[i], s->counts + i * L, s->offsets + i * (L + 1), s->src + i * (size_t)s->rows * 3,
                         s->epochs + 2 * i};
    return v;
}

/* Slot 0: mf_moe_forward's. */
static mf__cuda_slot_t mf__cuda_slot0(mf_moe_t moe) { return mf__cuda_slot(moe, 0); }

/* This rank's own copy of region `off` of a heap view. */
static uint8_t *mf__view_mine(const mf__heap_view_t *view, unsigned long long off) {
    return view->heap[view->rank] + off;
}

/* Whether a kernel that follows a sync kernel may be launched with the PDL attribute: its CTAs may
 * then sit on SMs, waiting, for as long as the sync waits for the peers, so only a grid of at most
 * this rank's share of the SMs does (see the file comment). */
static int32_t mf__pdl_after_sync(mf_comm_t comm, int64_t blocks) { return blocks <= comm->num_sms; }

/* One synchronisation of the call (sync.cuh); `reject`: the host rejected the call (its code);
 * `pdl`: launched with the PDL attribute (cuda/pdl.cuh; not as a call's first kernel). */
static mf__sync_params_t mf__sync_params(mf_comm_t comm, uint32_t layer, int32_t phase, mf_result_t reject) {
    mf__sync_params_t p;
    memset(&p, 0, sizeof p);
    for (int32_t r = 0; r < comm->num_ranks; r++) p.signals[r] = (uint64_t *)comm->signals.peers[r];
    p.num_ranks = comm->num_ranks;
    p.rank = comm->rank;
    p.phase = phase;
    p.reject = reject;
    p.layer = layer;
    p.acked_id = mf__cc(comm)->call_acked;
    p.timeout_ns = (uint64_t)comm->timeout_ms * 1000000ull;
    p.sink = mf__sink(comm);
    return p;
}

/* One synchronisation of the call (sync.cuh), or one half of it (`mode` kMfSync*, `epoch` the
 * slot's device word of the phase); `reject`: the host rejected the call (its code). */
static mf_result_t mf__cuda_sync(mf_comm_t comm, uint32_t layer, int32_t phase, mf_result_t reject, int32_t mode,
                                 unsigned long long *epoch, int32_t pdl, cudaStream_t stream) {
    mf__sync_params_t p = mf__sync_params(comm, layer, phase, reject);
    p.mode = mode;
    p.epoch = epoch;
    MF_CUDA_CHECK(mf__cuda_launch(mf__sync_kernel, dim3(1), dim3(kMfWaitThreads), 0, stream, pdl, p));
    if (mode != kMfSyncWait) __atomic_fetch_add(&mf__cc(comm)->launched[phase], 1, __ATOMIC_RELAXED);
    return MF_SUCCESS;
}

/* Publishes x, ids (and weights) into the slot of `view`. `epochs` (a forward at R = 1 whose small
 * kernel plans for itself, mf__cuda_own_plan): the slot's epochs, and the DISPATCH sync runs in
 * publish's last block (mf__publish_sync_kernel) instead of a plan kernel. Never
 * with the PDL attribute: the small kernel behind it takes tickets, loads weights and reads x before
 * its own wait, which is safe because nothing of the previous call can still run when publish
 * starts. */
static mf_result_t mf__cuda_publish_at(mf_moe_t moe, const mf__heap_view_t *view, const mf_tensor_t *x,
                                       const mf_tensor_t *ids, const float *weights, unsigned long long *epochs,
                                       cudaStream_t stream) {
    const mf_moe_config_t *c = &moe->config;
    mf__publish_params_t p;
    memset(&p, 0, sizeof p);
    p.x = (const uint16_t *)x->data;
    p.ids = (const int32_t *)ids->data;
    p.weights = weights;
    p.T = (int32_t)x->dims[0];
    p.H = c->hidden;
    p.K = c->num_topk;
    p.E = c->num_experts;
    p.fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    p.ue8m0 = c->ue8m0_scales;
    p.meta_words[0] = (int32_t)moe->map_hash;
    p.meta_words[1] = (int32_t)((mf__cuda_moe_t *)moe->backend_state)->prefetches;
    p.meta_words[2] = (int32_t)moe->weights_count;
    p.view = *view;
    p.sink = mf__sink(moe->comm);
    /* A call's first kernel: no PDL attribute (it follows the caller's kernels) */
    const dim3 grid(p.T > 0 ? (unsigned)p.T : 1u, (unsigned)((p.H + kMfPublishCols - 1) / kMfPublishCols));
    if (!epochs) {
        MF_CUDA_CHECK(mf__cuda_launch(mf__publish_kernel, grid, dim3(kMfPublishThreads), 0, stream, 0, p));
        return MF_SUCCESS;
    }
    mf__sync_params_t sp = mf__sync_params(moe->comm, moe->id, MF__PHASE_DISPATCH, MF_SUCCESS);
    sp.mode = kMfSyncBoth;
    sp.epoch = epochs;
    int32_t *finished = ((mf__cuda_moe_t *)moe->backend_state)->publish_count;
    void *args[] = {(void *)&sp, (void *)&p, (void *)&finished};
    MF_CUDA_CHECK(mf__cuda_launch((const void *)mf__publish_sync_kernel, grid, dim3(kMfPublishThreads), 0, stream, 0,
                                  args));
    __atomic_fetch_add(&mf__cc(moe->comm)->launched[MF__PHASE_DISPATCH], 1, __ATOMIC_RELAXED); /* as mf__cuda_sync */
    return MF_SUCCESS;
}

/* Waits for every rank's publication in the slot's regions (`mode`: the whole DISPATCH sync, or the
 * receive half's wait for the send's arrival), then builds the plan into the slot's buffers (and,
 * for mf_dispatch, copies counts and offsets into the caller's tensors: no memcpy on the data
 * path). A receive half's first kernel follows the caller's work: no PDL attribute.
 * The small plan is chosen by this rank's T (every rank's T assumed alike), never by the capacity
 * S: an engine sizes S for its largest batch and decodes far below it. Both plans give the same
 * bits and the same sync, so ranks may choose differently (a peer with more tokens only makes the
 * one block of the small plan slower). */
static mf_result_t mf__cuda_plan_at(mf_moe_t moe, const mf__cuda_slot_t *slot, int32_t mode, int32_t T,
                                    int32_t *counts_out, int32_t *offsets_out, cudaStream_t stream) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    const mf_moe_config_t *c = &moe->config;
    const int32_t first_pdl = mode == kMfSyncWait ? 0 : 1;
    mf__plan_params_t p;
    memset(&p, 0, sizeof p);
    p.view = *slot->view;
    p.K = c->num_topk;
    p.E = c->num_experts;
    p.S = c->max_tokens_per_rank;
    p.L = s->slots;
    p.first_expert = moe->info.first_expert;
    p.layout = c->layout;
    p.block_m = c->block_m;
    p.capacity = c->expert_capacity;
    p.max_rows = c->max_recv_rows;
    p.ids_all = s->ids_all;
    p.T_all = s->T_all;
    p.global_counts = s->global_counts;
    p.counts = slot->counts;
    p.offsets = slot->offsets;
    p.src = slot->src;
    p.counts_out = counts_out;
    p.offsets_out = offsets_out;
    p.check_weights = s->B > 0;
    p.balanced = s->balanced;
    p.serial = mf__cuda_plan_serial;
    p.P = c->num_physical_experts;
    p.B = s->B;
    p.Lp = s->Lp;
    p.weights_count = moe->weights_count;
    p.map = s->map;
    p.resident = s->resident;
    p.weights_seen = (const uint32_t *)(s->words + 1);
    p.slot_expert = s->slot_expert;
    p.slot_begin = s->slot_begin;
    p.prev_counts = s->prev_counts;
    p.have_prev = s->words;
    p.stats = s->stats;
    p.sink = mf__sink(moe->comm);
    p.placement = c->placement;
    p.out_slots = moe->info.num_local_slots;
    if (!s->balanced && mf__cuda_plan_small &&
        mf__plan_small_fits(moe->comm->num_ranks, T, p.K, p.E, p.L)) { /* the sync and the plan in one block */
        mf__sync_params_t sp = mf__sync_params(moe->comm, moe->id, MF__PHASE_DISPATCH, MF_SUCCESS);
        sp.mode = mode;
        sp.epoch = slot->epochs;
        void *args[] = {(void *)&sp, (void *)&p};
        MF_CUDA_CHECK(mf__cuda_launch((const void *)mf__plan_small_kernel, dim3(1), dim3(kMfPlanSmallThreads), 0, stream,
                                      first_pdl, args));
        if (mode != kMfSyncWait) __atomic_fetch_add(&mf__cc(moe->comm)->launched[MF__PHASE_DISPATCH], 1, __ATOMIC_RELAXED);
        return MF_SUCCESS;
    }
    MF_CHECK(mf__cuda_sync(moe->comm, moe->id, MF__PHASE_DISPATCH, MF_SUCCESS, mode, slot->epochs, first_pdl, stream));
    const dim3 fetch(kMfPlanFetchBlocks, (unsigned)moe->comm->num_ranks);
    MF_CUDA_CHECK(mf__cuda_launch(mf__plan_fetch_kernel, fetch, dim3(kMfPlanThreads), 0, stream,
                                  mf__pdl_after_sync(moe->comm, (int64_t)fetch.x * fetch.y), p));
    MF_CUDA_CHECK(mf__cuda_launch(mf__plan_offsets_kernel, dim3(1), dim3(kMfPlanThreads),
                                  s->balanced ? s->plan_smem : 0, stream, 1, p));
    MF_CUDA_CHECK(mf__cuda_launch(mf__plan_fill_kernel, dim3((unsigned)p.L), dim3(kMfPlanThreads), 0, stream, 1, p));
    return MF_SUCCESS;
}

static mf_result_t mf__cuda_plan(mf_moe_t moe, int32_t T, int32_t *counts_out, int32_t *offsets_out,
                                 cudaStream_t stream) {
    const mf__cuda_slot_t slot = mf__cuda_slot0(moe);
    return mf__cuda_plan_at(moe, &slot, kMfSyncBoth, T, counts_out, offsets_out, stream);
}

static mf__move_params_t mf__move_params_at(mf_moe_t moe, const mf__cuda_slot_t *slot) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    mf__move_params_t p;
    memset(&p, 0, sizeof p);
    p.view = *slot->view;
    p.K = moe->config.num_topk;
    p.L = s->slots;
    p.H = moe->config.hidden;
    p.fp8 = moe->config.dtype == MF_DTYPE_FP8_E4M3;
    p.layout = moe->config.layout;
    p.capacity = moe->config.expert_capacity;
    p.counts = slot->counts;
    p.offsets = slot->offsets;
    p.src = slot->src;
    p.sink = mf__sink(moe->comm);
    return p;
}

static mf__move_params_t mf__move_params(mf_moe_t moe) {
    const mf__cuda_slot_t slot = mf__cuda_slot0(moe);
    return mf__move_params_at(moe, &slot);
}

static int32_t mf__move_blocks(mf_moe_t moe) { return moe->comm->num_sms * kMfMoveBlocksPerSm; }

static mf_result_t mf__cuda_gather_at(mf_moe_t moe, const mf__cuda_slot_t *slot, void *recv_x, float *recv_scales,
                                      int32_t *recv_src, cudaStream_t stream) {
    mf__move_params_t p = mf__move_params_at(moe, slot);
    p.recv_x = (uint8_t *)recv_x;
    p.recv_scales = recv_scales;
    p.recv_src = recv_src;
    MF_CUDA_CHECK(mf__cuda_launch(mf__gather_kernel, dim3((unsigned)mf__move_blocks(moe)), dim3(kMfMoveThreads), 0,
                                  stream, 1, p)); /* after the plan's fill */
    return MF_SUCCESS;
}

static mf_result_t mf__cuda_gather(mf_moe_t moe, void *recv_x, float *recv_scales, int32_t *recv_src,
                                   cudaStream_t stream) {
    const mf__cuda_slot_t slot = mf__cuda_slot0(moe);
    return mf__cuda_gather_at(moe, &slot, recv_x, recv_scales, recv_src, stream);
}

/* Waits for every rank's partials in the slot's combine regions (`mode`: the whole COMBINE sync, or
 * the receive half's wait, a call's first kernel) and sums this rank's tokens. */
static mf_result_t mf__cuda_sum_at(mf_moe_t moe, const mf__cuda_slot_t *slot, int32_t mode, int32_t T,
                                   const float *weights, uint16_t *y, cudaStream_t stream) {
    /* One rank, one call (not a half): the sync would wait only for this rank's own arrival, and its
     * verdict cannot change the fault state (a fresh fault became sticky at the DISPATCH sync, which
     * cleared the claim, and only publish raises one: sync.cuh mf__raise; no peer, no other layer):
     * the sum follows the GEMMs without it. The halves keep it (their epochs pair a send with its
     * receive). */
    if (moe->comm->num_ranks > 1 || mode != kMfSyncBoth)
        MF_CHECK(mf__cuda_sync(moe->comm, moe->id, MF__PHASE_COMBINE, MF_SUCCESS, mode, slot->epochs + 1,
                               mode == kMfSyncWait ? 0 : 1, stream));
    if (T == 0) return MF_SUCCESS;
    mf__sum_params_t p;
    memset(&p, 0, sizeof p);
    p.view = *slot->view;
    p.weights = weights;
    p.y = y;
    p.T = T;
    p.H = moe->config.hidden;
    p.K = moe->config.num_topk;
    p.sink = mf__sink(moe->comm);
    const dim3 grid((unsigned)T, (unsigned)((p.H / 8 + kMfSumThreads - 1) / kMfSumThreads));
    MF_CUDA_CHECK(mf__cuda_launch(mf__sum_kernel, grid, dim3(kMfSumThreads), 0, stream,
                                  mf__pdl_after_sync(moe->comm, (int64_t)grid.x * grid.y), p));
    return MF_SUCCESS;
}

static mf_result_t mf__cuda_sum(mf_moe_t moe, int32_t T, const float *weights, uint16_t *y, cudaStream_t stream) {
    const mf__cuda_slot_t slot = mf__cuda_slot0(moe);
    return mf__cuda_sum_at(moe, &slot, kMfSyncBoth, T, weights, y, stream);
}

/* ---- entry points ------------------------------------------------------------------------- */

static mf_result_t mf__cuda_forward_launch(mf_moe_t moe, const mf_moe_forward_in_t *in,
                                           const mf_moe_forward_out_t *out, cudaStream_t stream) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    const mf_moe_config_t *c = &moe->config;
    const mf_moe_weights_t *w = &moe->weights;
    int32_t fp8 = c->dtype == MF_DTYPE_FP8_E4M3;

    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MF_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    int32_t timed = c->profile && capture == cudaStreamCaptureStatusNone;
    s->events_valid = 0;
#define MF__MARK(i)                                                   \
    do {                                                              \
        if (timed) MF_CUDA_CHECK(cudaEventRecord(s->events[i], stream)); \
    } while (0)

    const int32_t T = (int32_t)in->x.dims[0];
    const mf__gemm_choice_t choice = mf__cuda_gemm_choice(moe, T); /* both GEMMs', and the dataflow */
    const int32_t flow = choice.dataflow;

    /* Spare slots, staged maps: after the prefetch issued since the last forward (see the file
     * comment); the next prefetch follows this forward. */
    unsigned long long capture_id = 0;
    const int32_t ordered = s->B || s->pf_pending || moe->staged_map;
    if (ordered) {
        if (capture != cudaStreamCaptureStatusNone) {
            cudaStreamCaptureStatus st;
            MF_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &st, &capture_id));
        }
        if (s->pf_pending && s->pf_capture == capture_id) MF_CUDA_CHECK(cudaStreamWaitEvent(stream, s->pf_done, 0));
        s->pf_pending = 0;
    }

    /* R = 1 with the small kernel: it sums y itself (small >= 2), and plans for itself too (3: publish
     * runs the DISPATCH sync, no plan kernel) */
    const int32_t small = __atomic_load_n(&mf__cuda_small, __ATOMIC_RELAXED);
    const int32_t own_sum = choice.fused && moe->comm->num_ranks == 1 && T > 0 && small >= 2;
    const int32_t own_plan = mf__cuda_own_plan(moe, &choice, T, small);
    /* 5: warps 1-3 make its first unit's W13 rows from x */
    const mf__gemm_own_t own = {(const int32_t *)in->topk_ids.data,
                                own_plan && small >= 5 ? (const uint16_t *)in->x.data : NULL};

    MF__MARK(MF_PHASE_PREPARE);
    const mf__cuda_slot_t slot0 = mf__cuda_slot0(moe);
    MF_CHECK(mf__cuda_publish_at(moe, slot0.view, &in->x, &in->topk_ids, (const float *)in->topk_weights.data,
                                 own_plan ? slot0.epochs : NULL, stream));
    MF__MARK(MF_PHASE_DISPATCH);
    if (!own_plan) MF_CHECK(mf__cuda_plan(moe, T, NULL, NULL, stream));
    if (flow != MF_DATAFLOW_DIRECT) MF_CHECK(mf__cuda_gather(moe, s->recv_x, s->recv_scales, NULL, stream));
    MF__MARK(MF_PHASE_W13);

    mf__cuda_gemm_debug_layer(moe->id); /* MF_DEBUG's label for the two GEMMs below */
    mf__gemm_segments_t seg;
    seg.counts = s->counts;
    seg.offsets = s->offsets;
    seg.num_experts = s->held; /* the static slots with weights; the spare slots are a second launch */
    seg.max_rows_per_expert = mf__cuda_rows_bound(moe);
    seg.rows_hint = mf__cuda_rows_hint(moe, T);
    seg.sched = s->sched + 2 * kMfSchedW13;
    seg.sink = mf__sink(moe->comm); /* an expired GEMM wait breaks this comm */
    const mf__heap_view_t *view = slot0.view; /* the forward's heap slot */
    const mf__gemm_gather_t gather = {view, s->src};
    mf__gemm_operand_t a = {s->recv_x, s->recv_scales, flow == MF_DATAFLOW_DIRECT ? &gather : NULL};
    mf__gemm_operand_t w13 = {w->w13.data, fp8 ? (const float *)w->w13_scales.data : NULL, NULL};
    const mf__gemm_return_t ret = {view, s->src, c->num_topk};
    mf__gemm_operand_t h = {s->h, s->h_scales, NULL};
    mf__gemm_operand_t w2 = {w->w2.data, fp8 ? (const float *)w->w2_scales.data : NULL, NULL};
    int32_t summed = 0; /* the small kernel wrote y (R = 1) */
    if (choice.fused) {
        /* the small-batch kernel: both GEMMs in one launch (W13's phase holds both, W2's is empty), at
         * R = 1 the sum too (then the COMBINE phase is empty as well) */
        const mf__gemm_sum_t sum = {(uint16_t *)out->y.data, T, &mf__cc(moe->comm)->state->fault};
        MF_CHECK(mf__cuda_w13_w2(&choice, &seg, s->sched + 2 * kMfSchedW2, c->dtype, c->ue8m0_scales, a, w13, w2,
                                 c->hidden, c->intermediate, s->h, s->h_scales, &ret, s->small_sync,
                                 own_sum ? &sum : NULL, own_plan ? &own : NULL, &summed, stream, 1));
        MF__MARK(MF_PHASE_W2);
        MF__MARK(MF_PHASE_COMBINE);
    } else {
        MF_CHECK(mf__cuda_w13_swiglu(&choice, &seg, c->dtype, c->ue8m0_scales, a, w13, c->hidden, c->intermediate, s->h,
                                     s->h_scales, stream, 1));
        /* Spare slots: segments [Lp, Lp + B) over moeflow's [B, 2I, H] copies (rows stay absolute). */
        mf__gemm_segments_t spare_seg = seg;
        spare_seg.counts = s->counts + s->Lp;
        spare_seg.offsets = s->offsets + s->Lp;
        spare_seg.num_experts = s->B;
        spare_seg.sched = s->sched + 2 * kMfSchedSpareW13;
        const mf__spare_layout_t *sl = &moe->spare_layout;
        const uint8_t *spare = (const uint8_t *)moe->spare.local;
        if (s->B) {
            mf__gemm_operand_t sw13 = {spare + sl->w13, fp8 ? (const float *)(spare + sl->w13_scales) : NULL, NULL};
            MF_CHECK(mf__cuda_w13_swiglu(&choice, &spare_seg, c->dtype, c->ue8m0_scales, a, sw13, c->hidden,
                                         c->intermediate, s->h, s->h_scales, stream, 1));
        }
        MF__MARK(MF_PHASE_W2);

        /* W2 starts (PDL) while W13 may still run: its own schedule pairs */
        seg.sched = s->sched + 2 * kMfSchedW2;
        spare_seg.sched = s->sched + 2 * kMfSchedSpareW2;
        mf__gemm_operand_t sw2 = {s->B ? spare + sl->w2 : NULL,
                                  fp8 && s->B ? (const float *)(spare + sl->w2_scales) : NULL, NULL};
        if (flow == MF_DATAFLOW_UNFUSED) {
            MF_CHECK(mf__cuda_w2(&choice, &seg, c->dtype, h, w2, c->hidden, c->intermediate, s->expert_out, NULL,
                                 stream, 1));
            if (s->B)
                MF_CHECK(mf__cuda_w2(&choice, &spare_seg, c->dtype, h, sw2, c->hidden, c->intermediate,
                                     s->expert_out, NULL, stream, 1));
            MF__MARK(MF_PHASE_COMBINE);
            mf__move_params_t p = mf__move_params(moe);
            p.expert_out = s->expert_out;
            MF_CUDA_CHECK(mf__cuda_launch(mf__return_kernel, dim3((unsigned)mf__move_blocks(moe)),
                                          dim3(kMfMoveThreads), 0, stream, 1, p));
        } else {
            MF_CHECK(mf__cuda_w2(&choice, &seg, c->dtype, h, w2, c->hidden, c->intermediate, NULL, &ret, stream, 1));
            if (s->B)
                MF_CHECK(mf__cuda_w2(&choice, &spare_seg, c->dtype, h, sw2, c->hidden, c->intermediate, NULL, &ret,
                                     stream, 1));
            MF__MARK(MF_PHASE_COMBINE);
        }
    }

    /* The owner sums with the weights it published (a copy, valid until its next publish). */
    const float *weights = (const float *)mf__view_mine(view, view->weights);
    if (!summed) MF_CHECK(mf__cuda_sum(moe, T, weights, (uint16_t *)out->y.data, stream));
    MF__MARK(MF_NUM_PHASES);
    if (ordered) { /* the next prefetch follows this forward */
        MF_CUDA_CHECK(cudaEventRecord(s->fwd_done, stream));
        s->fwd_recorded = 1;
        s->fwd_capture = capture_id;
    }
#undef MF__MARK
    s->events_valid = timed;
    return MF_SUCCESS;
}

static mf_result_t mf__cuda_forward(mf_moe_t moe, const mf_moe_forward_in_t *in, const mf_moe_forward_out_t *out,
                                    mf_stream_t stream_) {
    cudaStream_t stream = (cudaStream_t)stream_;
    mf_result_t pending = MF_SUCCESS;
    MF_CHECK(mf__cuda_enter(moe->comm, stream, &pending));
    return mf__cuda_leave(moe->comm, mf__cuda_forward_launch(moe, in, out, stream), pending);
}

/* The halves of exchange x's dispatch (core/backend.h, ops->dispatch), in the exchange's heap slot.
 * SEND: publish, then (alone) the ARRIVE half of the DISPATCH sync, which stores its epoch in the
 * slot's device word and returns: nothing is left waiting on the device. RECV (alone): the WAIT
 * half, the plan, the gather into x->dispatch_out. Both (mf_dispatch): publish, the whole sync (in
 * the small plan when it fits), plan and gather: the one-call form's kernels as before. */
static mf_result_t mf__cuda_dispatch_launch(mf_moe_t moe, struct mf_exchange *x, const mf_dispatch_in_t *in,
                                            uint32_t halves, cudaStream_t stream) {
    const mf__cuda_slot_t slot = mf__cuda_slot(moe, x->slot);
    if (halves & MF__HALF_SEND)
        MF_CHECK(mf__cuda_publish_at(moe, slot.view, &in->x, &in->topk_ids, NULL, NULL, stream));
    if (halves == MF__HALF_SEND)
        return mf__cuda_sync(moe->comm, moe->id, MF__PHASE_DISPATCH, MF_SUCCESS, kMfSyncArrive, slot.epochs, 1, stream);
    const mf_dispatch_out_t *out = &x->dispatch_out;
    const int32_t mode = halves == MF__HALF_RECV ? kMfSyncWait : kMfSyncBoth;
    int32_t *offsets_out = moe->config.layout == MF_LAYOUT_EXPERT_MAJOR ? (int32_t *)out->expert_offsets.data : NULL;
    MF_CHECK(mf__cuda_plan_at(moe, &slot, mode, x->T, (int32_t *)out->expert_counts.data, offsets_out, stream));
    return mf__cuda_gather_at(moe, &slot, out->recv_x.data, (float *)out->recv_scales.data,
                              (int32_t *)out->recv_src.data, stream);
}

static mf_result_t mf__cuda_dispatch(mf_moe_t moe, struct mf_exchange *x, const mf_dispatch_in_t *in, uint32_t halves,
                                     mf_stream_t stream_) {
    cudaStream_t stream = (cudaStream_t)stream_;
    mf_result_t pending = MF_SUCCESS;
    MF_CHECK(mf__cuda_enter(moe->comm, stream, &pending));
    return mf__cuda_leave(moe->comm, mf__cuda_dispatch_launch(moe, x, in, halves, stream), pending);
}

/* The halves of x's combine. SEND: the return kernel (no PDL attribute), then (alone) the ARRIVE
 * half of the COMBINE sync; a send alone first copies its topk_weights into the slot's weights
 * region with a kernel (mf__keep_weights_kernel: the data path launches kernels only), which its
 * receive sums with (the caller's tensor need not outlive the send). RECV (alone): the WAIT half
 * and the sum. Both (mf_combine): return, the whole sync, sum. */
static mf_result_t mf__cuda_combine_launch(mf_moe_t moe, struct mf_exchange *x, uint32_t halves, cudaStream_t stream) {
    const mf__cuda_slot_t slot = mf__cuda_slot(moe, x->slot);
    float *kept = (float *)mf__view_mine(slot.view, slot.view->weights);
    if (halves == MF__HALF_SEND && x->T) {
        const float *src = (const float *)x->combine_in.topk_weights.data;
        const int64_t n = (int64_t)x->T * moe->config.num_topk;
        void *args[] = {(void *)&src, (void *)&kept, (void *)&n};
        const unsigned blocks = (unsigned)((n + kMfMoveThreads - 1) / kMfMoveThreads);
        MF_CUDA_CHECK(mf__cuda_launch((const void *)mf__keep_weights_kernel, dim3(blocks), dim3(kMfMoveThreads), 0,
                                      stream, 0, args));
    }
    if (halves & MF__HALF_SEND) {
        mf__move_params_t p = mf__move_params_at(moe, &slot);
        p.expert_out = (const uint16_t *)x->combine_in.expert_out.data;
        MF_CUDA_CHECK(mf__cuda_launch(mf__return_kernel, dim3((unsigned)mf__move_blocks(moe)), dim3(kMfMoveThreads), 0,
                                      stream, 0, p));
    }
    if (halves == MF__HALF_SEND)
        return mf__cuda_sync(moe->comm, moe->id, MF__PHASE_COMBINE, MF_SUCCESS, kMfSyncArrive, slot.epochs + 1, 1,
                             stream);
    const float *w = halves == MF__HALF_RECV ? kept : (const float *)x->combine_in.topk_weights.data;
    return mf__cuda_sum_at(moe, &slot, halves == MF__HALF_RECV ? kMfSyncWait : kMfSyncBoth, x->T, w,
                           (uint16_t *)x->combine_out.y.data, stream);
}

static mf_result_t mf__cuda_combine(mf_moe_t moe, struct mf_exchange *x, uint32_t halves, mf_stream_t stream_) {
    cudaStream_t stream = (cudaStream_t)stream_;
    mf_result_t pending = MF_SUCCESS;
    MF_CHECK(mf__cuda_enter(moe->comm, stream, &pending));
    return mf__cuda_leave(moe->comm, mf__cuda_combine_launch(moe, x, halves, stream), pending);
}

/* An exchange half's events (DeepEP's previous_event / async_finish). */
static mf_result_t mf__cuda_event(mf_comm_t comm, mf_event_t event, int32_t record, mf_stream_t stream) {
    MF_CUDA_CHECK(cudaSetDevice(comm->device));
    if (record) MF_CUDA_CHECK(cudaEventRecord((cudaEvent_t)event, (cudaStream_t)stream));
    else MF_CUDA_CHECK(cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)event, 0));
    return MF_SUCCESS;
}

/* mf_moe_experts: W13 -> SwiGLU -> W2 over the caller's MASKED rows with the layer's weights and scratch,
 * the forward's GEMM launchers (one choice from the rows hint of the pending dispatch's T, else S; the
 * caller's rows are contiguous: PULL). The first kernel follows the caller's work without PDL, W2
 * follows W13 with it. */
static mf_result_t mf__cuda_experts_launch(mf_moe_t moe, const mf_experts_in_t *in, const mf_experts_out_t *out,
                                           cudaStream_t stream) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    const mf_moe_config_t *c = &moe->config;
    const mf_moe_weights_t *w = &moe->weights;
    const int32_t fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    mf__cuda_gemm_debug_layer(moe->id);
    mf__gemm_segments_t seg;
    seg.counts = (const int32_t *)in->expert_counts.data;
    seg.offsets = s->masked_offsets;
    seg.num_experts = s->held;
    seg.max_rows_per_expert = c->expert_capacity; /* counts are clamped to it on the device */
    seg.rows_hint = mf__cuda_rows_hint(moe, moe->comm->pending_dispatch == moe ? moe->dispatch_T
                                                                               : c->max_tokens_per_rank);
    seg.sched = s->sched + 2 * kMfSchedW13;
    seg.sink = mf__sink(moe->comm); /* an expired GEMM wait breaks this comm */
    const mf__gemm_choice_t choice = mf__gemm_choose(seg.rows_hint, seg.max_rows_per_expert, MF_DATAFLOW_PULL);
    mf__gemm_operand_t a = {in->recv_x.data, fp8 ? (const float *)in->recv_scales.data : NULL, NULL};
    mf__gemm_operand_t w13 = {w->w13.data, fp8 ? (const float *)w->w13_scales.data : NULL, NULL};
    MF_CHECK(mf__cuda_w13_swiglu(&choice, &seg, c->dtype, c->ue8m0_scales, a, w13, c->hidden, c->intermediate, s->h,
                                 s->h_scales, stream, 0));
    seg.sched = s->sched + 2 * kMfSchedW2;
    mf__gemm_operand_t h = {s->h, s->h_scales, NULL};
    mf__gemm_operand_t w2 = {w->w2.data, fp8 ? (const float *)w->w2_scales.data : NULL, NULL};
    return mf__cuda_w2(&choice, &seg, c->dtype, h, w2, c->hidden, c->intermediate, (uint16_t *)out->expert_out.data,
                       NULL, stream, 1);
}

/* Alike on purpose, as mf__cuda_forward: enter, the call's launches, leave. */
static mf_result_t mf__cuda_experts(mf_moe_t moe, const mf_experts_in_t *in, const mf_experts_out_t *out,
                                    mf_stream_t stream_) {
    cudaStream_t stream = (cudaStream_t)stream_;
    mf_result_t pending = MF_SUCCESS;
    MF_CHECK(mf__cuda_enter(moe->comm, stream, &pending));
    return mf__cuda_leave(moe->comm, mf__cuda_experts_launch(moe, in, out, stream), pending);
}

/* A call whose input the host rejected: it still takes part in the call's synchronisations, with
 * the rejection as its status, so that every rank fails the call and writes nothing. The stream is
 * then synchronised (an error path), so that the fault the rejection makes is known to be this
 * host's own and is not reported twice. */
static mf_result_t mf__cuda_reject(mf_moe_t moe, uint32_t phases, mf_result_t code, mf_stream_t stream_) {
    cudaStream_t stream = (cudaStream_t)stream_;
    mf_comm_t comm = moe->comm;
    char why[512];
    snprintf(why, sizeof why, "%s", mf_last_error());
    if (mf__cuda_enter(comm, stream, NULL) != MF_SUCCESS) return mf__error(code, "%s", why);
    mf_result_t res = MF_SUCCESS;
    for (int32_t phase = 0; phase < MF__NUM_PHASES && res == MF_SUCCESS; phase++)
        if (phases & (1u << phase)) /* no PDL: error path */
            res = mf__cuda_sync(comm, moe->id, phase, code, kMfSyncBoth, NULL, 0, stream);
    if ((res = mf__cuda_leave(comm, res, MF_SUCCESS)) != MF_SUCCESS) return res;
    if (!mf__cc(comm)->capturing && cudaStreamSynchronize(stream) == cudaSuccess) (void)mf__cuda_take_fault(comm, 1);
    (void)cudaGetLastError();
    return mf__error(code, "%s", why);
}

/* ---- balanced EP -------------------------------------------------------------------------- */

/* Copies the host map `map` [P] to the device buffer `dst` on the setup stream, blocking: it first
 * waits for this rank's last forward and its last eager prefetch, which read the maps. `fn` names the
 * public call (mf_moe_set_expert_map, mf_moe_stage_expert_map) in the planner's limit error. */
static mf_result_t mf__cuda_upload_map(mf_moe_t moe, int32_t *dst, const int32_t *map, const char *fn) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    mf__cuda_comm_t *c = mf__cc(moe->comm);
    if (s->plan_smem > kMfPrefetchMaxSmem)
        return mf__error(MF_ERR_NOT_SUPPORTED, "%s: the cuda backend's balancing planner keeps its arrays in shared "
                         "memory (at most %d bytes); this layer needs %zu", fn, kMfPrefetchMaxSmem, s->plan_smem);
    MF_CUDA_CHECK(cudaSetDevice(moe->comm->device));
    MF_CUDA_CHECK(cudaEventSynchronize(c->done));
    if (s->pf_done && s->pf_pending && !s->pf_capture) MF_CUDA_CHECK(cudaEventSynchronize(s->pf_done));
    MF_CUDA_CHECK(cudaMemcpyAsync(dst, map, (size_t)moe->config.num_physical_experts * 4, cudaMemcpyHostToDevice,
                                  c->setup));
    MF_CUDA_CHECK(cudaStreamSynchronize(c->setup));
    return MF_SUCCESS;
}

/* The map's device copy (setup: waits for this rank's last forward and prefetch, which read it). */
static mf_result_t mf__cuda_set_expert_map(mf_moe_t moe) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    MF_CHECK(mf__cuda_upload_map(moe, s->map, moe->expert_map, "mf_moe_set_expert_map"));
    s->balanced = 1;
    return MF_SUCCESS;
}

/* A prefetch (and a stage step in it) starts here: the stream's check, its capture id (0 when not
 * capturing), and its order after this rank's last forward of the same capture (or eager). */
static mf_result_t mf__cuda_prefetch_enter(mf_moe_t moe, cudaStream_t stream, unsigned long long *capture_id) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    MF_CUDA_CHECK(cudaSetDevice(moe->comm->device));
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    *capture_id = 0;
    if (stream) MF_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &capture, capture_id));
    if (capture == cudaStreamCaptureStatusNone) *capture_id = 0;
    const mf_result_t bad =
        mf__cuda_check_stream(moe->comm, stream, capture != cudaStreamCaptureStatusNone, "mf_moe_prefetch: ");
    if (bad != MF_SUCCESS) return bad;
    if (s->fwd_recorded && s->fwd_capture == *capture_id) MF_CUDA_CHECK(cudaStreamWaitEvent(stream, s->fwd_done, 0));
    return MF_SUCCESS;
}

/* mf_moe_prefetch: pick, push, commit on `stream` (balance/prefetch.cu), after this rank's last forward. */
static mf_result_t mf__cuda_prefetch_op(mf_moe_t moe, mf_stream_t stream_) {
    cudaStream_t stream = (cudaStream_t)stream_;
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    mf_comm_t comm = moe->comm;
    const mf_moe_config_t *c = &moe->config;
    unsigned long long capture_id = 0;
    const mf_result_t entered = mf__cuda_prefetch_enter(moe, stream, &capture_id);
    if (entered != MF_SUCCESS) return entered;
    mf__prefetch_params_t p;
    memset(&p, 0, sizeof p);
    p.E = c->num_experts;
    p.R = comm->num_ranks;
    p.P = c->num_physical_experts;
    p.B = s->B;
    p.Lp = s->Lp;
    p.rank = comm->rank;
    p.map = s->map;
    p.prev_counts = s->prev_counts;
    p.have_prev = s->words;
    p.resident = s->resident;
    p.next = s->next;
    p.weights_seen = (uint32_t *)(s->words + 1);
    p.weights_count = moe->weights_count;
    p.scratch = s->pick_scratch;
    const mf__spare_layout_t *sl = &moe->spare_layout;
    p.w13 = (const uint8_t *)moe->weights.w13.data;
    p.w2 = (const uint8_t *)moe->weights.w2.data;
    p.w13_scales = (const uint8_t *)moe->weights.w13_scales.data;
    p.w2_scales = (const uint8_t *)moe->weights.w2_scales.data;
    for (int32_t q = 0; q < comm->num_ranks; q++) p.spare[q] = (uint8_t *)moe->spare.peers[q];
    p.off_w13 = sl->w13, p.off_w13_scales = sl->w13_scales, p.off_w2 = sl->w2, p.off_w2_scales = sl->w2_scales;
    p.bytes_w13 = sl->w13_bytes, p.bytes_w13_scales = sl->w13_scale_bytes;
    p.bytes_w2 = sl->w2_bytes, p.bytes_w2_scales = sl->w2_scale_bytes;
    p.stats = s->stats + 2 * MF_MAX_RANKS;
    mf_result_t res = mf__cuda_prefetch(&p, s->pick_smem, stream);
    if (res != MF_SUCCESS) {
        comm->broken = 1; /* ranks' tables may now differ */
        return res;
    }
    MF_CUDA_CHECK(cudaEventRecord(s->pf_done, stream));
    s->pf_pending = 1;
    s->pf_capture = capture_id;
    s->prefetches++;
    return MF_SUCCESS;
}

/* ---- rebalancing without a stall: a staged map's steps (src/balance/stage.h) ---------------- */

/* The staged map's device copy, installed by the last step (blocking: this rank's last forward
 * reads the map, a previous stage's last step may still read the buffer on its stream). The last
 * step rewrites the map: a one-step stage has no staged forward before it that recorded fwd_done,
 * so the last call is waited for here (as mf_moe_set_expert_map does). */
static mf_result_t mf__cuda_stage_begin(mf_moe_t moe, const int32_t *map) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    return mf__cuda_upload_map(moe, s->staged_map, map, "mf_moe_stage_expert_map");
}

/* Copies one expert (weights + FP8 scales) from src to dst (caller tensors [Lp, ...] or a [2n, ...]
 * staging region, any rank's: peer pointers are device addresses here). Copy engines, on `stream`. */
static mf_result_t mf__cuda_copy_expert(mf__expert_ptrs_t dst, mf__expert_ptrs_t src,
                                        const mf__spare_layout_t *sl, int32_t fp8, cudaStream_t stream) {
    MF_CUDA_CHECK(cudaMemcpyAsync(dst.w13, src.w13, sl->w13_bytes, cudaMemcpyDefault, stream));
    MF_CUDA_CHECK(cudaMemcpyAsync(dst.w2, src.w2, sl->w2_bytes, cudaMemcpyDefault, stream));
    if (fp8) {
        MF_CUDA_CHECK(cudaMemcpyAsync(dst.w13_scales, src.w13_scales, sl->w13_scale_bytes, cudaMemcpyDefault, stream));
        MF_CUDA_CHECK(cudaMemcpyAsync(dst.w2_scales, src.w2_scales, sl->w2_scale_bytes, cudaMemcpyDefault, stream));
    }
    return MF_SUCCESS;
}

/* One step on `stream`, ordered like the prefetch (after this rank's last forward by fwd_done;
 * the next forward waits for pf_done): step 0's local copies, the previous step's arrivals from
 * this rank's staging slots into next_weights, this step's pushes from the old weights into the
 * peers' staging slots (the other half); the last step installs the staged map's device copy.
 * The ordering argument is the CPU backend's (src/cpu/backend.c) with the forward's device waits:
 * a peer's step i - 1 copies precede its forward's publish on its stream, which this rank's
 * DISPATCH wait saw before fwd_done; a peer's step i + 1 follows its COMBINE wait, which needs
 * this rank's arrival, which follows this step by pf_done. No host wait; capturable (the copies
 * are memcpy nodes), but the step is chosen on the host: a graph replays the step it captured. */
static mf_result_t mf__cuda_stage_step(mf_moe_t moe, mf_stream_t stream_) {
    cudaStream_t stream = (cudaStream_t)stream_;
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    mf_comm_t comm = moe->comm;
    unsigned long long capture_id = 0;
    const mf_result_t entered = mf__cuda_prefetch_enter(moe, stream, &capture_id);
    if (entered != MF_SUCCESS) return entered;
    const mf__spare_layout_t *sl = &moe->stage_layout;
    const int32_t P = moe->config.num_physical_experts, Lp = moe->slots_per_rank, me = comm->rank;
    const int32_t step = moe->stage_step, fp8 = moe->config.dtype == MF_DTYPE_FP8_E4M3;
    mf_result_t res = MF_SUCCESS;
    for (int32_t p = 0; p < P && res == MF_SUCCESS; p++) {
        const mf__stage_slot_t *st = &moe->stage_plan[p];
        const int32_t q = p / Lp, l = p % Lp;
        if (st->held >= 0) {
            if (step == 0 && q == me)
                res = mf__cuda_copy_expert(mf__expert_in_weights(&moe->staged_weights, sl, l),
                                           mf__expert_in_weights(&moe->weights, sl, st->held), sl, fp8, stream);
            continue;
        }
        if (st->step + 1 == step && q == me)
            res = mf__cuda_copy_expert(mf__expert_in_weights(&moe->staged_weights, sl, l),
                                       mf__expert_in_region(moe->stage.local, sl, st->staging), sl, fp8, stream);
        if (res == MF_SUCCESS && st->step == step && st->source / Lp == me)
            res = mf__cuda_copy_expert(mf__expert_in_region(moe->stage.peers[q], sl, st->staging),
                                       mf__expert_in_weights(&moe->weights, sl, st->source % Lp), sl, fp8, stream);
    }
    if (res == MF_SUCCESS && step + 1 == moe->stage_steps) { /* the switch: the next forward plans with it */
        res = cudaMemcpyAsync(s->map, s->staged_map, (size_t)P * 4, cudaMemcpyDeviceToDevice, stream) == cudaSuccess
                  ? MF_SUCCESS : mf__error(MF_ERR_CUDA, "mf_moe_prefetch: installing the staged map failed");
        s->balanced = 1;
    }
    if (res != MF_SUCCESS) {
        (void)cudaGetLastError();
        comm->broken = 1; /* ranks' steps may now differ */
        return res;
    }
    MF_CUDA_CHECK(cudaEventRecord(s->pf_done, stream));
    s->pf_pending = 1;
    s->pf_capture = capture_id;
    if (!s->B) s->prefetches++; /* a step is a prefetch (published, checked equal); with B the spare step counts */
    return MF_SUCCESS;
}

/* Reads the device stats (synchronises with this rank's last forward and prefetch). */
static mf_result_t mf__cuda_get_balance_stats(mf_moe_t moe, mf_moe_balance_stats_t *st) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    mf__cuda_comm_t *c = mf__cc(moe->comm);
    int64_t h[2 * MF_MAX_RANKS + 3];
    MF_CUDA_CHECK(cudaSetDevice(moe->comm->device));
    MF_CUDA_CHECK(cudaEventSynchronize(c->done));
    if (s->pf_done && !s->pf_capture) MF_CUDA_CHECK(cudaEventSynchronize(s->pf_done));
    MF_CUDA_CHECK(cudaMemcpyAsync(h, s->stats, sizeof h, cudaMemcpyDeviceToHost, c->setup));
    MF_CUDA_CHECK(cudaStreamSynchronize(c->setup));
    const int32_t R = moe->comm->num_ranks;
    for (int32_t r = 0; r < R; r++) st->recv_rows[r] = h[r], st->home_rows[r] = h[MF_MAX_RANKS + r];
    st->prefetch_bytes = h[2 * MF_MAX_RANKS];
    st->prefetch_bytes_all = h[2 * MF_MAX_RANKS + 1];
    st->spare_resident = (int32_t)h[2 * MF_MAX_RANKS + 2];
    return MF_SUCCESS;
}

const mf__backend_ops_t mf__cuda_backend = {
    "cuda",
    mf__cuda_available,
    mf__cuda_device_id,
    mf__cuda_comm_init,
    mf__cuda_comm_fini,
    mf__cuda_mem_alloc,
    mf__cuda_mem_free,
    mf__cuda_moe_init,
    mf__cuda_moe_fini,
    NULL, /* set_weights: borrowed device pointers are used as they are */
    mf__cuda_forward,
    mf__cuda_dispatch,
    mf__cuda_combine,
    mf__cuda_experts,
    mf__cuda_reject,
    mf__cuda_abort,
    mf__cuda_get_async_error,
    mf__cuda_get_phase_times,
    mf__cuda_set_expert_map,
    mf__cuda_prefetch_op,
    mf__cuda_get_balance_stats,
    mf__cuda_stage_step,
    mf__cuda_stage_begin,
    mf__cuda_event,
};
