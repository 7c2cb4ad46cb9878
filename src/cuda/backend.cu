/*
 * backend.cu — the CUDA backend (sm_90a) with the `local` transport: R virtual ranks on one GPU,
 * each driven by its own host thread on its own stream, each with one device allocation for its
 * symmetric heap and one for its signals, reached by peers through the peer table.
 *
 * One forward on rank r is a sequence of launches on the caller's stream, with no host
 * synchronisation and nothing that breaks CUDA-graph capture:
 *   publish           quantise x (FP8 1x128) or copy it, validate + copy ids and weights, write T
 *   sync              phase DISPATCH: arrive, then wait (one block; device epochs; bounded by the
 *                     timeout)
 *   plan              count per local expert, offsets + capacity check, rank-major source rows
 *   gather            PULL / UNFUSED: pull the routed rows from the peers' heaps into the receive
 *                     tensor; DIRECT: none, W13 reads each row at its owner through the plan
 *   w13, w2           grouped GEMMs (grouped_gemm.cu); W2 writes BF16 partials into the owners'
 *                     combine slots through the peer table (UNFUSED: into a local tensor, then
 *                     the return kernel copies them there, as mf_combine does)
 *   sync              phase COMBINE
 *   sum               y[t] = bf16(sum over k ascending of w[t,k] * slot[t,k])
 * Buffer reuse follows the CPU backend's argument (src/cpu/backend.c): two phases per call order
 * every reuse, so nothing is cleared between calls.
 *
 * Faults raised by kernels (bad ids, capacity, timeouts) land in mapped host memory; the next call
 * on the comm returns them without launching anything, and mf_comm_get_async_error reports them
 * after synchronising the comm's last stream. A timeout marks the comm broken.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "cuda/configs.cuh"
#include "cuda/grouped_gemm.h"
#include "cuda/kernels/movement.cuh"

#define MF_CUDA_CHECK(call)                                                                      \
    do {                                                                                         \
        cudaError_t mf__e = (call);                                                              \
        if (mf__e != cudaSuccess) {                                                              \
            (void)cudaGetLastError();                                                            \
            return mf__error(MF_ERR_CUDA, "%s:%d: %s failed: %s", __FILE__, __LINE__, #call,       \
                             cudaGetErrorString(mf__e));                                         \
        }                                                                                        \
    } while (0)

#define MF_CUDA_CHECK_LAUNCH() MF_CUDA_CHECK(cudaGetLastError())

typedef struct mf__cuda_comm {
    uint64_t *signals;            /* device: kMfSignalWords */
    int32_t *claim;               /* device: fault claim word */
    mf__device_error_t *record;   /* mapped host memory (host pointer) */
    mf__device_error_t *record_d; /* its device pointer */
    cudaStream_t last_stream;
    int64_t launched[MF__NUM_PHASES]; /* arrivals launched by the host (atomic: peers read it) */
} mf__cuda_comm_t;

typedef struct mf__cuda_moe {
    int32_t *counts, *offsets, *src; /* plan: [L], [L + 1], [rows, 3] */
    uint8_t *recv_x;                 /* [rows, H] of mf_moe_forward */
    float *recv_scales;              /* [rows, H/128] (FP8) */
    uint8_t *h;                      /* [rows, I] FP8 or BF16 */
    float *h_scales;                 /* [rows, I/128] (FP8) */
    uint16_t *expert_out;            /* [rows, H] BF16: MF_DATAFLOW_UNFUSED only */
    int64_t rows;
    cudaEvent_t events[MF_NUM_PHASES + 1];
    int32_t events_valid;            /* the last forward recorded every event */
} mf__cuda_moe_t;

static mf__cuda_comm_t *mf__cc(mf_comm_t comm) { return (mf__cuda_comm_t *)comm->backend_state; }

/* ---- group / comm / heap ------------------------------------------------------------------ */

/* R virtual ranks put R streams of spinning-capable kernels on one GPU. CUDA maps streams onto
 * CUDA_DEVICE_MAX_CONNECTIONS hardware queues (default 8); two ranks sharing a queue deadlock when
 * one's spinning sync kernel sits in front of the other's (seen on the H200 with R = 8). Ask for the
 * maximum before the context exists, unless the user chose a value (docs/API.md). */
static void mf__cuda_request_connections(void) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", kMfMaxConnections, 0);
    /* Likewise, load modules eagerly (cudart's own too), so that no call on the data path waits
     * for a module load behind a peer's spinning kernel. */
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);
}

static int32_t mf__cuda_available(void) {
    mf__cuda_request_connections();
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        return 0;
    }
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return major == 9 && minor == 0; /* the kernels are built for sm_90a only */
}

static mf_result_t mf__cuda_group_init(mf_group_t g) {
    int n = 0, sms = 0;
    mf__cuda_request_connections();
    MF_CUDA_CHECK(cudaGetDeviceCount(&n));
    if (g->device >= n)
        return mf__error(MF_ERR_INVALID_ARGUMENT, "cuda backend: device %d does not exist (%d devices)", g->device, n);
    MF_CUDA_CHECK(cudaSetDevice(g->device));
    MF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, g->device));
    if (!g->num_sms) g->num_sms = sms / g->num_ranks > 0 ? sms / g->num_ranks : 1;
    if (g->num_sms > sms)
        return mf__error(MF_ERR_INVALID_ARGUMENT, "cuda backend: num_sms %d exceeds the device's %d SMs", g->num_sms, sms);
    /* Load every kernel now. With lazy module loading (CUDA's default) a rank's first launch would
     * load its module on demand, which can stall behind the peers' spinning wait kernels until the
     * timeout: seen on the H200 as a first-forward timeout in every process. */
    const void *kernels[] = {(const void *)mf__publish_kernel, (const void *)mf__plan_count_kernel,
                             (const void *)mf__plan_offsets_kernel, (const void *)mf__plan_fill_kernel,
                             (const void *)mf__gather_kernel, (const void *)mf__return_kernel,
                             (const void *)mf__sum_kernel, (const void *)mf__sync_kernel};
    for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++) {
        cudaFuncAttributes attr;
        MF_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernels[i]));
    }
    return mf__cuda_gemm_preload();
}

static void mf__cuda_group_fini(mf_group_t g) { (void)g; }

static void mf__cuda_comm_fini(mf_comm_t comm) {
    mf__cuda_comm_t *c = mf__cc(comm);
    mf_group_t g = comm->group;
    cudaSetDevice(g->device);
    cudaDeviceSynchronize(); /* no kernel may still touch what is freed */
    if (c) {
        cudaFree(c->signals);
        cudaFree(c->claim);
        cudaFreeHost(c->record);
        mf__free(c);
    }
    cudaFree(g->heap_base[comm->rank]);
    g->heap_base[comm->rank] = g->signal_base[comm->rank] = NULL;
    comm->backend_state = NULL;
    (void)cudaGetLastError();
}

static mf_result_t mf__cuda_comm_init(mf_comm_t comm) {
    mf_group_t g = comm->group;
    MF_CUDA_CHECK(cudaSetDevice(g->device));
    mf__cuda_comm_t *c = (mf__cuda_comm_t *)mf__calloc(1, sizeof *c);
    if (!c) return mf__error(MF_ERR_OUT_OF_MEMORY, "cuda backend: out of host memory");
    comm->backend_state = c;
    mf_result_t res = MF_SUCCESS;
    cudaError_t e = cudaMalloc((void **)&c->signals, kMfSignalWords * sizeof(uint64_t));
    if (e == cudaSuccess) e = cudaMemset(c->signals, 0, kMfSignalWords * sizeof(uint64_t));
    if (e == cudaSuccess) e = cudaMalloc((void **)&c->claim, sizeof(int32_t));
    if (e == cudaSuccess) e = cudaMemset(c->claim, 0, sizeof(int32_t));
    if (e == cudaSuccess) e = cudaHostAlloc((void **)&c->record, sizeof *c->record, cudaHostAllocMapped);
    if (e == cudaSuccess) {
        memset((void *)c->record, 0, sizeof *c->record);
        e = cudaHostGetDevicePointer((void **)&c->record_d, (void *)c->record, 0);
    }
    /* cudaMemset runs on the legacy stream, which the ranks' non-blocking streams do not wait for:
     * finish it before any peer can signal into this array (a late memset erased signals on the
     * H200, and the ranks waited forever for epoch 1). */
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        res = mf__error(e == cudaErrorMemoryAllocation ? MF_ERR_OUT_OF_MEMORY : MF_ERR_CUDA,
                        "cuda backend: rank %d's signals: %s", comm->rank, cudaGetErrorString(e));
        cudaFree(c->signals);
        cudaFree(c->claim);
        if (c->record) cudaFreeHost(c->record);
        mf__free(c);
        comm->backend_state = NULL;
        return res;
    }
    g->signal_base[comm->rank] = c->signals;
    return MF_SUCCESS;
}

static mf_result_t mf__cuda_heap_resize(mf_comm_t comm, size_t bytes, void **base) {
    MF_CUDA_CHECK(cudaSetDevice(comm->group->device));
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return mf__error(MF_ERR_OUT_OF_MEMORY, "cuda backend: rank %d: cudaMalloc of a %zu-byte heap: %s",
                         comm->rank, bytes, cudaGetErrorString(e));
    }
    MF_CUDA_CHECK(cudaMemset(p, 0, bytes));
    /* The memset must be done before a peer (on a non-blocking stream) writes here; cudaFree
     * below needs an idle device too: no peer kernel still reads the old heap. */
    MF_CUDA_CHECK(cudaDeviceSynchronize());
    MF_CUDA_CHECK(cudaFree(comm->group->heap_base[comm->rank]));
    *base = p;
    return MF_SUCCESS;
}

/* ---- faults ------------------------------------------------------------------------------- */

static mf__fault_sink_t mf__sink(mf_comm_t comm) {
    mf__fault_sink_t s;
    s.claim = mf__cc(comm)->claim;
    s.record = mf__cc(comm)->record_d;
    s.rank = comm->rank;
    return s;
}

/* Turns a raised fault into an error message; clears it when `clear` (the stream is idle). */
static mf_result_t mf__cuda_report_fault(mf_comm_t comm, int32_t clear) {
    mf__cuda_comm_t *c = mf__cc(comm);
    mf__device_error_t r = *c->record; /* code is written last, after a system fence */
    if (!r.code) return MF_SUCCESS;
    mf_result_t code = (mf_result_t)r.code;
    switch (r.kind) {
    case kMfFaultTimeout: {
        comm->broken = 1;
        /* The peer's host count tells "its thread never launched the arrival" from "launched, but
         * the device did not run it in time" (read now, so possibly later than the timeout). */
        long long launched = -1;
        mf_comm_t peer = r.peer >= 0 && r.peer < comm->group->num_ranks ? &comm->group->comms[r.peer] : NULL;
        if (peer && peer->backend_state && r.phase >= 0 && r.phase < MF__NUM_PHASES)
            launched = (long long)__atomic_load_n(&mf__cc(peer)->launched[r.phase], __ATOMIC_RELAXED);
        mf__error(code, "rank %d: device wait in phase '%s' timed out after %lld ms: rank %d's signal here read "
                        "epoch %lld, expected %lld (its own epoch counter: %lld; its host has launched %lld "
                        "arrivals)", r.rank, mf__phase_name(r.phase), (long long)comm->group->timeout_ms, r.peer, r.a,
                  r.b, r.c, launched);
        break;
    }
    case kMfFaultBadId:
        mf__error(code, "rank %d: device topk_ids[%lld, %lld] = %lld is outside [-1, E); treated as -1", r.rank, r.a,
                  r.b, r.c);
        break;
    case kMfFaultDupId:
        mf__error(code, "rank %d: device topk_ids[%lld, %lld] = %lld repeats an earlier k of the token; treated as -1",
                  r.rank, r.a, r.b, r.c);
        break;
    case kMfFaultCapacity:
        if (r.peer == -2)
            mf__error(code, "rank %d: expert %lld's segment ends at row %lld > max_recv_rows %lld; rows past it "
                            "were dropped", r.rank, r.a, r.b, r.c);
        else
            mf__error(code, "rank %d: expert %lld receives %lld rows > expert_capacity %lld; rows past it were dropped",
                      r.rank, r.a, r.b, r.c);
        break;
    default: mf__error(MF_ERR_INTERNAL, "rank %d: unknown device fault kind %d (code %d)", r.rank, r.kind, r.code);
    }
    if (clear && r.kind != kMfFaultTimeout) {
        c->record->code = 0;
        MF_CUDA_CHECK(cudaMemset(c->claim, 0, sizeof(int32_t)));
        MF_CUDA_CHECK(cudaDeviceSynchronize()); /* the legacy-stream memset, before the next launch */
    }
    return code;
}

static mf_result_t mf__cuda_get_async_error(mf_comm_t comm) {
    mf__cuda_comm_t *c = mf__cc(comm);
    MF_CUDA_CHECK(cudaSetDevice(comm->group->device));
    MF_CUDA_CHECK(cudaStreamSynchronize(c->last_stream));
    return mf__cuda_report_fault(comm, 1);
}

/* Every data-path call starts here: a pending fault fails the call before anything is launched. */
static mf_result_t mf__cuda_enter(mf_comm_t comm, cudaStream_t stream) {
    MF_CUDA_CHECK(cudaSetDevice(comm->group->device));
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (stream) MF_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (comm->group->num_ranks > 1 && capture == cudaStreamCaptureStatusNone) {
        /* Virtual ranks share one GPU: a blocking stream waits for legacy-stream work that other
         * threads issue, which waits for this group's spinning kernels: a deadlock. (Not queried
         * while capturing: cudaStreamGetFlags invalidated a capture on the H200.) */
        unsigned int flags = 0;
        if (stream) MF_CUDA_CHECK(cudaStreamGetFlags(stream, &flags));
        if (!stream || !(flags & cudaStreamNonBlocking))
            return mf__error(MF_ERR_INVALID_ARGUMENT,
                             "rank %d: the stream must be created with cudaStreamNonBlocking when R > 1 "
                             "virtual ranks share a GPU (a blocking or legacy stream can deadlock)",
                             comm->rank);
    }
    mf__cc(comm)->last_stream = stream;
    mf__cuda_comm_t *c = mf__cc(comm);
    if (c->record->code) {
        mf_result_t code = mf__cuda_report_fault(comm, 0);
        if (c->record->kind != kMfFaultTimeout) {
            /* Reported once: clear it in stream order, after the kernels that may have raised it. */
            c->record->code = 0;
            MF_CUDA_CHECK(cudaMemsetAsync(c->claim, 0, sizeof(int32_t), stream));
        }
        return code;
    }
    return MF_SUCCESS;
}

/* ---- layer -------------------------------------------------------------------------------- */

static void mf__cuda_moe_fini(mf_moe_t moe) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    if (!s) return;
    cudaSetDevice(moe->comm->group->device);
    cudaDeviceSynchronize();
    cudaFree(s->counts);
    cudaFree(s->offsets);
    cudaFree(s->src);
    cudaFree(s->recv_x);
    cudaFree(s->recv_scales);
    cudaFree(s->h);
    cudaFree(s->h_scales);
    cudaFree(s->expert_out);
    for (int i = 0; i <= MF_NUM_PHASES; i++)
        if (s->events[i]) cudaEventDestroy(s->events[i]);
    (void)cudaGetLastError();
    mf__free(s);
    moe->backend_state = NULL;
}

/* Expected rows per local expert, T K R / E from this rank's T (rounded up): picks the GEMM
 * kernels (grouped_gemm.h), the same for every dataflow. */
static int32_t mf__cuda_rows_hint(mf_moe_t moe, int32_t T) {
    const mf_moe_config_t *c = &moe->config;
    int64_t routed = (int64_t)T * c->num_topk * moe->comm->group->num_ranks;
    return (int32_t)((routed + c->num_experts - 1) / c->num_experts);
}

/* The dataflow of one forward (docs/API.md "Dataflow"). DIRECT only while the decode GEMM runs
 * (rows_hint <= kMfDecodeMaxRows): it is the kernel that can read rows in place, and above it the
 * TMA GEMM runs for every dataflow, so an explicit DIRECT pulls there (y stays the same bits).
 * AUTO: DIRECT where it can. The choice is local (peers only publish). */
static int32_t mf__cuda_dataflow(mf_moe_t moe, int32_t T) {
    const int32_t flow = moe->config.dataflow, direct_ok = mf__cuda_rows_hint(moe, T) <= kMfDecodeMaxRows;
    if (flow == MF_DATAFLOW_AUTO || flow == MF_DATAFLOW_DIRECT) return direct_ok ? MF_DATAFLOW_DIRECT : MF_DATAFLOW_PULL;
    return flow;
}

static mf_result_t mf__cuda_moe_init(mf_moe_t moe) {
    const mf_moe_config_t *c = &moe->config;
    MF_CUDA_CHECK(cudaSetDevice(moe->comm->group->device));
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)mf__calloc(1, sizeof *s);
    if (!s) return mf__error(MF_ERR_OUT_OF_MEMORY, "cuda backend: out of host memory");
    moe->backend_state = s;
    int64_t L = moe->info.num_local_experts, H = c->hidden, I = c->intermediate;
    int fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    s->rows = c->layout == MF_LAYOUT_MASKED ? L * c->expert_capacity : c->max_recv_rows;
    size_t esz = fp8 ? 1 : 2;
    /* A receive tensor only where a forward can pull: DIRECT layers pull above the decode regime. */
    int pull = c->dataflow != MF_DATAFLOW_DIRECT || mf__cuda_rows_hint(moe, c->max_tokens_per_rank) > kMfDecodeMaxRows;
    struct { void **p; size_t bytes; } allocs[] = {
        {(void **)&s->counts, (size_t)L * 4},
        {(void **)&s->offsets, (size_t)(L + 1) * 4},
        {(void **)&s->src, (size_t)s->rows * 12},
        {(void **)&s->recv_x, pull ? (size_t)(s->rows * H) * esz : 0},
        {(void **)&s->recv_scales, pull && fp8 ? (size_t)(s->rows * (H / MF__QUANT_BLOCK)) * 4 : 0},
        {(void **)&s->h, (size_t)(s->rows * I) * esz},
        {(void **)&s->h_scales, fp8 ? (size_t)(s->rows * (I / MF__QUANT_BLOCK)) * 4 : 0},
        {(void **)&s->expert_out, c->dataflow == MF_DATAFLOW_UNFUSED ? (size_t)(s->rows * H) * 2 : 0},
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

static mf__heap_view_t mf__view(mf_moe_t moe) {
    mf__heap_view_t v;
    mf_group_t g = moe->comm->group;
    memset(&v, 0, sizeof v);
    for (int32_t r = 0; r < g->num_ranks; r++) v.heap[r] = (uint8_t *)g->heap_base[r];
    v.meta = moe->heap.meta;
    v.x = moe->heap.x;
    v.scales = moe->heap.scales;
    v.ids = moe->heap.ids;
    v.weights = moe->heap.weights;
    v.combine = moe->heap.combine;
    v.num_ranks = g->num_ranks;
    v.rank = moe->comm->rank;
    return v;
}

static mf_result_t mf__cuda_sync_phase(mf_moe_t moe, int32_t phase, cudaStream_t stream) {
    mf_group_t g = moe->comm->group;
    mf__sync_params_t p;
    memset(&p, 0, sizeof p);
    for (int32_t r = 0; r < g->num_ranks; r++) p.signals[r] = (uint64_t *)g->signal_base[r];
    p.num_ranks = g->num_ranks;
    p.rank = moe->comm->rank;
    p.phase = phase;
    p.timeout_ns = (uint64_t)g->timeout_ms * 1000000ull;
    p.sink = mf__sink(moe->comm);
    mf__sync_kernel<<<1, kMfWaitThreads, 0, stream>>>(p);
    MF_CUDA_CHECK_LAUNCH();
    __atomic_fetch_add(&mf__cc(moe->comm)->launched[phase], 1, __ATOMIC_RELAXED);
    return MF_SUCCESS;
}

static mf_result_t mf__cuda_publish(mf_moe_t moe, const mf_tensor_t *x, const mf_tensor_t *ids, const float *weights,
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
    p.heap = (uint8_t *)moe->comm->group->heap_base[moe->comm->rank];
    p.meta = moe->heap.meta;
    p.x_off = moe->heap.x;
    p.scales_off = moe->heap.scales;
    p.ids_off = moe->heap.ids;
    p.weights_off = moe->heap.weights;
    p.sink = mf__sink(moe->comm);
    mf__publish_kernel<<<p.T > 0 ? p.T : 1, kMfPublishThreads, 0, stream>>>(p);
    MF_CUDA_CHECK_LAUNCH();
    return MF_SUCCESS;
}

/* Waits for every rank's publication, then builds the plan into the layer's buffers (and, for
 * mf_dispatch, copies counts and offsets into the caller's tensors: no memcpy on the data path). */
static mf_result_t mf__cuda_plan(mf_moe_t moe, int32_t *counts_out, int32_t *offsets_out, cudaStream_t stream) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    const mf_moe_config_t *c = &moe->config;
    MF_CHECK(mf__cuda_sync_phase(moe, MF__PHASE_DISPATCH, stream));
    mf__plan_params_t p;
    memset(&p, 0, sizeof p);
    p.view = mf__view(moe);
    p.K = c->num_topk;
    p.L = moe->info.num_local_experts;
    p.first_expert = moe->info.first_expert;
    p.layout = c->layout;
    p.block_m = c->block_m;
    p.capacity = c->expert_capacity;
    p.max_rows = c->max_recv_rows;
    p.counts = s->counts;
    p.offsets = s->offsets;
    p.src = s->src;
    p.counts_out = counts_out;
    p.offsets_out = offsets_out;
    p.sink = mf__sink(moe->comm);
    mf__plan_count_kernel<<<p.L, kMfPlanThreads, 0, stream>>>(p);
    MF_CUDA_CHECK_LAUNCH();
    mf__plan_offsets_kernel<<<1, kMfWarp, 0, stream>>>(p);
    MF_CUDA_CHECK_LAUNCH();
    mf__plan_fill_kernel<<<p.L, kMfPlanThreads, 0, stream>>>(p);
    MF_CUDA_CHECK_LAUNCH();
    return MF_SUCCESS;
}

static mf__move_params_t mf__move_params(mf_moe_t moe) {
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    mf__move_params_t p;
    memset(&p, 0, sizeof p);
    p.view = mf__view(moe);
    p.K = moe->config.num_topk;
    p.L = moe->info.num_local_experts;
    p.H = moe->config.hidden;
    p.fp8 = moe->config.dtype == MF_DTYPE_FP8_E4M3;
    p.layout = moe->config.layout;
    p.capacity = moe->config.expert_capacity;
    p.counts = s->counts;
    p.offsets = s->offsets;
    p.src = s->src;
    return p;
}

static int32_t mf__move_blocks(mf_moe_t moe) { return moe->comm->group->num_sms * kMfMoveBlocksPerSm; }

static mf_result_t mf__cuda_gather(mf_moe_t moe, void *recv_x, float *recv_scales, int32_t *recv_src,
                                   cudaStream_t stream) {
    mf__move_params_t p = mf__move_params(moe);
    p.recv_x = (uint8_t *)recv_x;
    p.recv_scales = recv_scales;
    p.recv_src = recv_src;
    mf__gather_kernel<<<mf__move_blocks(moe), kMfMoveThreads, 0, stream>>>(p);
    MF_CUDA_CHECK_LAUNCH();
    return MF_SUCCESS;
}

/* Waits for every rank's partials and sums this rank's tokens. */
static mf_result_t mf__cuda_sum(mf_moe_t moe, int32_t T, const float *weights, uint16_t *y, cudaStream_t stream) {
    MF_CHECK(mf__cuda_sync_phase(moe, MF__PHASE_COMBINE, stream));
    if (T == 0) return MF_SUCCESS;
    mf__sum_params_t p;
    memset(&p, 0, sizeof p);
    p.heap = (const uint8_t *)moe->comm->group->heap_base[moe->comm->rank];
    p.ids = moe->heap.ids;
    p.combine = moe->heap.combine;
    p.weights = weights;
    p.y = y;
    p.T = T;
    p.H = moe->config.hidden;
    p.K = moe->config.num_topk;
    const dim3 grid((unsigned)T, (unsigned)((p.H / 8 + kMfSumThreads - 1) / kMfSumThreads));
    mf__sum_kernel<<<grid, kMfSumThreads, 0, stream>>>(p);
    MF_CUDA_CHECK_LAUNCH();
    return MF_SUCCESS;
}

/* ---- entry points ------------------------------------------------------------------------- */

static mf_result_t mf__cuda_forward(mf_moe_t moe, const mf_moe_forward_in_t *in, const mf_moe_forward_out_t *out,
                                    mf_stream_t stream_) {
    cudaStream_t stream = (cudaStream_t)stream_;
    MF_CHECK(mf__cuda_enter(moe->comm, stream));
    mf__cuda_moe_t *s = (mf__cuda_moe_t *)moe->backend_state;
    const mf_moe_config_t *c = &moe->config;
    const mf_moe_weights_t *w = &moe->weights;
    mf_group_t g = moe->comm->group;
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
    const int32_t flow = mf__cuda_dataflow(moe, T);

    MF__MARK(MF_PHASE_PREPARE);
    MF_CHECK(mf__cuda_publish(moe, &in->x, &in->topk_ids, (const float *)in->topk_weights.data, stream));
    MF__MARK(MF_PHASE_DISPATCH);
    MF_CHECK(mf__cuda_plan(moe, NULL, NULL, stream));
    if (flow != MF_DATAFLOW_DIRECT) MF_CHECK(mf__cuda_gather(moe, s->recv_x, s->recv_scales, NULL, stream));
    MF__MARK(MF_PHASE_W13);

    mf__gemm_segments_t seg;
    seg.counts = s->counts;
    seg.offsets = s->offsets;
    seg.num_experts = moe->info.num_local_experts;
    /* A token routes to an expert at most once: R * S rows (MASKED: at most C). */
    int64_t per_expert = (int64_t)g->num_ranks * c->max_tokens_per_rank;
    if (c->layout == MF_LAYOUT_MASKED) per_expert = c->expert_capacity;
    if (c->layout == MF_LAYOUT_EXPERT_MAJOR && per_expert > c->max_recv_rows) per_expert = c->max_recv_rows;
    seg.max_rows_per_expert = (int32_t)per_expert;
    seg.rows_hint = mf__cuda_rows_hint(moe, T);
    mf__gemm_gather_t gather;
    memset(&gather, 0, sizeof gather);
    for (int32_t r = 0; r < g->num_ranks; r++) gather.heap[r] = (const uint8_t *)g->heap_base[r];
    gather.x = moe->heap.x;
    gather.scales = moe->heap.scales;
    gather.src = s->src;
    mf__gemm_operand_t a = {s->recv_x, s->recv_scales, flow == MF_DATAFLOW_DIRECT ? &gather : NULL};
    mf__gemm_operand_t w13 = {w->w13.data, fp8 ? (const float *)w->w13_scales.data : NULL, NULL};
    MF_CHECK(mf__cuda_w13_swiglu(&seg, c->dtype, c->ue8m0_scales, a, w13, c->hidden, c->intermediate, s->h,
                                 s->h_scales, stream));
    MF__MARK(MF_PHASE_W2);

    mf__gemm_return_t ret;
    memset(&ret, 0, sizeof ret);
    for (int32_t r = 0; r < g->num_ranks; r++) ret.slots[r] = (uint16_t *)((uint8_t *)g->heap_base[r] + moe->heap.combine);
    ret.src = s->src;
    ret.num_topk = c->num_topk;
    mf__gemm_operand_t h = {s->h, s->h_scales, NULL};
    mf__gemm_operand_t w2 = {w->w2.data, fp8 ? (const float *)w->w2_scales.data : NULL, NULL};
    if (flow == MF_DATAFLOW_UNFUSED) {
        MF_CHECK(mf__cuda_w2(&seg, c->dtype, h, w2, c->hidden, c->intermediate, s->expert_out, NULL, stream));
        MF__MARK(MF_PHASE_COMBINE);
        mf__move_params_t p = mf__move_params(moe);
        p.expert_out = s->expert_out;
        mf__return_kernel<<<mf__move_blocks(moe), kMfMoveThreads, 0, stream>>>(p);
        MF_CUDA_CHECK_LAUNCH();
    } else {
        MF_CHECK(mf__cuda_w2(&seg, c->dtype, h, w2, c->hidden, c->intermediate, NULL, &ret, stream));
        MF__MARK(MF_PHASE_COMBINE);
    }

    /* The owner sums with the weights it published (a copy, valid until its next publish). */
    const float *weights = (const float *)((uint8_t *)g->heap_base[moe->comm->rank] + moe->heap.weights);
    MF_CHECK(mf__cuda_sum(moe, T, weights, (uint16_t *)out->y.data, stream));
    MF__MARK(MF_NUM_PHASES);
#undef MF__MARK
    s->events_valid = timed;
    return MF_SUCCESS;
}

static mf_result_t mf__cuda_dispatch(mf_moe_t moe, const mf_dispatch_in_t *in, const mf_dispatch_out_t *out,
                                     mf_stream_t stream_) {
    cudaStream_t stream = (cudaStream_t)stream_;
    MF_CHECK(mf__cuda_enter(moe->comm, stream));
    MF_CHECK(mf__cuda_publish(moe, &in->x, &in->topk_ids, NULL, stream));
    int32_t *offsets_out = moe->config.layout == MF_LAYOUT_EXPERT_MAJOR ? (int32_t *)out->expert_offsets.data : NULL;
    MF_CHECK(mf__cuda_plan(moe, (int32_t *)out->expert_counts.data, offsets_out, stream));
    MF_CHECK(mf__cuda_gather(moe, out->recv_x.data, (float *)out->recv_scales.data, (int32_t *)out->recv_src.data,
                             stream));
    return MF_SUCCESS;
}

static mf_result_t mf__cuda_combine(mf_moe_t moe, const mf_combine_in_t *in, const mf_combine_out_t *out,
                                    mf_stream_t stream_) {
    cudaStream_t stream = (cudaStream_t)stream_;
    MF_CHECK(mf__cuda_enter(moe->comm, stream));
    mf__move_params_t p = mf__move_params(moe);
    p.expert_out = (const uint16_t *)in->expert_out.data;
    mf__return_kernel<<<mf__move_blocks(moe), kMfMoveThreads, 0, stream>>>(p);
    MF_CUDA_CHECK_LAUNCH();
    return mf__cuda_sum(moe, moe->dispatch_T, (const float *)in->topk_weights.data, (uint16_t *)out->y.data, stream);
}

const mf__backend_ops_t mf__cuda_backend = {
    "cuda",
    mf__cuda_available,
    mf__cuda_group_init,
    mf__cuda_group_fini,
    mf__cuda_comm_init,
    mf__cuda_comm_fini,
    mf__cuda_heap_resize,
    mf__cuda_moe_init,
    mf__cuda_moe_fini,
    NULL, /* set_weights: borrowed device pointers are used as they are */
    mf__cuda_forward,
    mf__cuda_dispatch,
    mf__cuda_combine,
    mf__cuda_get_async_error,
    mf__cuda_get_phase_times,
};
