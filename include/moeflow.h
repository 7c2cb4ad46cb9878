/*
 * moeflow.h — the one public header of moeflow, an expert-parallel (EP) Mixture-of-Experts runtime.
 *
 * Pure C11: no CUDA types, fixed-width integers only. Streams cross as `mf_stream_t` (a
 * `cudaStream_t` cast to `void *` on the CUDA backend, ignored by the CPU backend).
 *
 * Dimension legend (docs/DESIGN.md): T tokens on this rank in this call, S capacity (max tokens per rank
 * per call), H hidden, I expert intermediate size, E global experts, R ranks, L = E / R local
 * experts (L_r, this rank's, when R does not divide E or the placement is round robin: see
 * mf_placement_t), K top-k. Shapes are row-major, innermost last: `[T, H]`.
 *
 * Model of use. R ranks share a symmetric heap; each rank is one *comm* handle. An engine runs one
 * rank per process: every process calls mf_comm_init with its rank and a bootstrap (the engine's
 * allgather, or the built-in rendezvous). For tests and single-process use, mf_group_create makes
 * R virtual ranks of one process at once, each driven by its own host thread. Calls marked
 * *collective* must be made by every rank, in the same order, each from its own thread or process.
 * A *layer* (`mf_moe_t`) belongs to one comm.
 *
 * Memory. Every tensor crosses as a non-owning descriptor (`mf_tensor_t`); its memory is the
 * backend's (host memory for MF_BACKEND_CPU, device memory of the group's device for
 * MF_BACKEND_CUDA), contiguous and row-major; row tensors (activations, dispatch payloads, expert
 * outputs, weights) 16-byte aligned, the others aligned to their elements. The library keeps no pointer to it after the call
 * returns, except for expert weights (see mf_moe_set_weights), which it borrows.
 *
 * Errors. Every function returns an `mf_result_t`. On failure `mf_last_error()` (per thread) names
 * the violated condition, outputs are left untouched, and nothing was printed: the library never
 * prints, exits or aborts. Faults found by device code (out-of-range ids in a device tensor, a peer
 * that never arrives) are reported by the next call on that comm or by mf_comm_get_async_error().
 */
#ifndef MOEFLOW_H
#define MOEFLOW_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Version
 * ------------------------------------------------------------------------------------------- */
#define MOEFLOW_VERSION_MAJOR 0
#define MOEFLOW_VERSION_MINOR 2
#define MOEFLOW_VERSION_PATCH 0
#define MOEFLOW_VERSION_CODE \
    (MOEFLOW_VERSION_MAJOR * 10000 + MOEFLOW_VERSION_MINOR * 100 + MOEFLOW_VERSION_PATCH)
/* Version of the config-struct layouts; stored in every config's `version` field by its INIT.
 * The library accepts configs of every earlier version (NCCL's habit: it reads the caller's `size`
 * bytes and gives newer fields their defaults): 1 = moeflow 0.1 (mf_group_config_t without
 * heap_bytes; no mf_comm_config_t), 2 = this header. */
#define MF_API_VERSION 2

/* Exported from libmoeflow.so; everything else is hidden. */
#if defined(__GNUC__)
#define MF_API __attribute__((visibility("default")))
#else
#define MF_API
#endif

/* The library's MOEFLOW_VERSION_CODE (may differ from the header's if linked against another). */
MF_API int32_t mf_get_version(void);

/* ---------------------------------------------------------------------------------------------
 * Results and errors
 * ------------------------------------------------------------------------------------------- */
typedef enum mf_result {
    MF_SUCCESS = 0,
    MF_ERR_INVALID_ARGUMENT = 1, /* a value, shape, dtype, pointer or id is outside the contract */
    MF_ERR_INVALID_USAGE = 2,    /* wrong call order, wrong magic/size/version, broken comm */
    MF_ERR_OUT_OF_MEMORY = 3,    /* host or device allocation failed */
    MF_ERR_CAPACITY = 4,         /* a user-set capacity was exceeded; nothing was written */
    MF_ERR_TIMEOUT = 5,          /* a wait on a peer expired; the message names rank and phase */
    MF_ERR_CUDA = 6,             /* a CUDA runtime/driver call failed */
    MF_ERR_NCCL = 7,             /* an NCCL call failed */
    MF_ERR_SYSTEM = 8,           /* an operating-system call failed (threads, clocks) */
    MF_ERR_NOT_SUPPORTED = 9,    /* valid request this build or backend cannot serve */
    MF_ERR_INTERNAL = 10,        /* a bug in moeflow: please report the message */
    MF_ERR_ABORTED = 11          /* this comm, or a peer it waited for, was aborted (mf_comm_abort) */
} mf_result_t;

/* A static string naming `result` ("MF_ERR_TIMEOUT: ..."); never NULL. */
MF_API const char *mf_result_string(mf_result_t result);

/* The message of the last failed call made by this thread ("" if none); valid until the next call
 * into moeflow from this thread. */
MF_API const char *mf_last_error(void);

/* ---------------------------------------------------------------------------------------------
 * Enums
 * ------------------------------------------------------------------------------------------- */
typedef enum mf_backend {
    MF_BACKEND_CPU = 0,  /* plain C11 host backend: the oracle; tensors in host memory */
    MF_BACKEND_CUDA = 1, /* sm_90a; tensors in device memory */
    MF_BACKEND_AUTO = 2  /* CUDA when this build has it and a device is present, else CPU */
} mf_backend_t;

/* How ranks reach each other's symmetric heaps (docs/API.md "Transports"). Only setup differs:
 * every transport ends in the same peer table, and the data path never learns which one ran. */
typedef enum mf_transport {
    MF_TRANSPORT_LOCAL = 0, /* ranks are threads of one process (one GPU, one GPU each, or host) */
    MF_TRANSPORT_IPC = 1,   /* ranks are processes of one host: shared memory (CPU backend) or
                               CUDA IPC handles (CUDA backend), exchanged over the bootstrap */
    MF_TRANSPORT_NCCL = 2,  /* from the caller's ncclComm_t: its allgather is the bootstrap; NCCL
                               symmetric windows where the comm supports them, else IPC mappings */
    MF_TRANSPORT_AUTO = 3   /* mf_comm_init: LOCAL when every rank is in this process, else IPC */
} mf_transport_t;

typedef enum mf_dtype {
    MF_DTYPE_BF16 = 0,     /* bfloat16, stored as uint16_t */
    MF_DTYPE_FP8_E4M3 = 1, /* OCP E4M3 "fn" (max 448, no inf), stored as uint8_t */
    MF_DTYPE_FP32 = 2,
    MF_DTYPE_INT32 = 3
} mf_dtype_t;

/* Layout of dispatch output / grouped-GEMM input (docs/LAYOUTS.md). */
typedef enum mf_layout {
    /* Contiguous: rows of local expert e are [offsets[e], offsets[e] + counts[e]); every segment
     * start is a multiple of block_m; rows [offsets[e] + counts[e], offsets[e+1]) are padding,
     * marked by source (-1, -1, -1). For prefill. */
    MF_LAYOUT_EXPERT_MAJOR = 0,
    /* Masked: [L, C, H] with C = expert capacity (R * S by default) and a count per expert; fixed
     * shapes, CUDA-graph safe. Rows at or past counts[e] are not written. For decode. */
    MF_LAYOUT_MASKED = 1
} mf_layout_t;

/* Where the experts live (mf_moe_config_t.placement; docs/API.md section 3). Rank r holds L_r experts,
 * its local experts l = 0 .. L_r - 1, in this order in its weights and its dispatch segments. Every
 * rank holds at least one expert (E >= R). Routing ids stay global expert ids whatever the placement,
 * and y does not depend on it, bit for bit. */
typedef enum mf_placement {
    /* Contiguous ranges, the first E % R ranks one expert more: L_r = E / R + (r < E % R), local l
     * is global first_r + l with first_r = r * (E / R) + min(r, E % R). With R | E: L = E / R and
     * rank r holds [r L, (r + 1) L). (Qwen3's 128 experts on R = 6: 22, 22, 21, 21, 21, 21.) */
    MF_PLACEMENT_LINEAR = 0,
    /* Expert e on rank e % R as local expert e / R: L_r = ceil((E - r) / R), local l is global
     * r + l * R. */
    MF_PLACEMENT_ROUND_ROBIN = 1
} mf_placement_t;

/* How mf_moe_forward's expert side consumes the routed rows (docs/API.md "Dataflow"). Every
 * choice gives the same y, bit for bit; they differ in speed. The CPU backend has one path and
 * accepts every value. */
typedef enum mf_dataflow {
    MF_DATAFLOW_AUTO = 0,     /* DIRECT when few rows per expert are expected, else PULL */
    MF_DATAFLOW_DIRECT = 1,   /* W13 reads each row from its owner's published copy (decode) */
    MF_DATAFLOW_PULL = 2,     /* rows are first pulled into the receive tensor (prefill) */
    MF_DATAFLOW_UNFUSED = 3   /* pull, GEMMs into a local tensor, then a separate return: the
                                 dispatch + GEMM + combine path, kept for comparison */
} mf_dataflow_t;

/* ---------------------------------------------------------------------------------------------
 * Tensors: non-owning descriptors of contiguous row-major memory
 * ------------------------------------------------------------------------------------------- */
#define MF_MAX_DIMS 4

typedef struct mf_tensor {
    void *data;                 /* first element; may be NULL only where a field says optional */
    int32_t dtype;              /* mf_dtype_t */
    int32_t ndim;               /* 0..MF_MAX_DIMS */
    int64_t dims[MF_MAX_DIMS];  /* dims[0] outermost */
} mf_tensor_t;

/* ---------------------------------------------------------------------------------------------
 * Opaque handles and the stream
 * ------------------------------------------------------------------------------------------- */
typedef struct mf_group *mf_group_t; /* R ranks and their symmetric heaps */
typedef struct mf_comm *mf_comm_t;   /* one rank of a group */
typedef struct mf_moe *mf_moe_t;     /* one MoE layer on one rank */
typedef void *mf_stream_t;           /* cudaStream_t on CUDA; ignored (pass NULL) on CPU */
typedef void *mf_event_t;            /* cudaEvent_t on CUDA; the CPU backend takes none (NULL) */
typedef struct mf_exchange *mf_exchange_t; /* one dispatch + combine in halves (section "Overlap") */

/* ---------------------------------------------------------------------------------------------
 * Group and comm
 * ------------------------------------------------------------------------------------------- */
#define MF_GROUP_CONFIG_MAGIC 0x6d666772u /* "mfgr" */
#define MF_MAX_RANKS 64

typedef struct mf_group_config {
    uint32_t size;       /* sizeof(mf_group_config_t) */
    uint32_t magic;      /* MF_GROUP_CONFIG_MAGIC */
    uint32_t version;    /* MF_API_VERSION */
    int32_t backend;     /* mf_backend_t */
    int32_t transport;   /* mf_transport_t */
    int32_t num_ranks;   /* R, 1..MF_MAX_RANKS */
    int32_t device;      /* CUDA device ordinal (CUDA backend); ignored by CPU */
    int32_t num_sms;     /* SMs each rank's peer-waiting kernels may use; 0 = num_sms / R */
    int64_t timeout_ms;  /* bound on every wait for a peer; 0 = MF_TIMEOUT_MS env or 30000 */
    int64_t heap_bytes;  /* each rank's symmetric heap, as mf_comm_config_t.heap_bytes */
} mf_group_config_t;

#define MF_GROUP_CONFIG_INIT                                                                     \
    {                                                                                            \
        sizeof(mf_group_config_t), MF_GROUP_CONFIG_MAGIC, MF_API_VERSION, MF_BACKEND_AUTO,       \
            MF_TRANSPORT_LOCAL, 1, 0, 0, 0, 0                                                    \
    }

/* 1 if `backend` can be used by this build on this machine (a CUDA build finds a device), else 0. */
MF_API int32_t mf_backend_available(mf_backend_t backend);

/* Creates a group of `config->num_ranks` virtual ranks in this process and their comms, built the
 * way mf_comm_init builds one comm per process (one thread per rank, an in-process allgather,
 * the local transport). Not collective (one call for the whole group), blocking, not
 * graph-capturable. The caller owns *group (mf_group_destroy). */
MF_API mf_result_t mf_group_create(const mf_group_config_t *config, mf_group_t *group);

/* The comm of `rank`; owned by the group (valid until mf_group_destroy). */
MF_API mf_result_t mf_group_get_comm(mf_group_t group, int32_t rank, mf_comm_t *comm);

/* The backend the group resolved to (MF_BACKEND_AUTO never comes back). */
MF_API mf_result_t mf_group_get_backend(mf_group_t group, mf_backend_t *backend);

/* Destroys the group, its comms and heaps. Call once, after every rank's layers are destroyed and
 * no rank is inside a call. NULL is a no-op. */
MF_API mf_result_t mf_group_destroy(mf_group_t group);

MF_API mf_result_t mf_comm_get_rank(mf_comm_t comm, int32_t *rank);
MF_API mf_result_t mf_comm_get_size(mf_comm_t comm, int32_t *num_ranks);

/* Reports, and clears, the first fault that device code of this comm raised since the last report
 * (MF_SUCCESS if none); mf_last_error() then describes it. Blocking: synchronises the comm's last
 * stream. Not collective. */
MF_API mf_result_t mf_comm_get_async_error(mf_comm_t comm);

/* The SMs this rank's communication kernels may use (DeepEP's Buffer.set_num_sms): the grids of
 * the gather and return moves (num_sms x 4 blocks) and the bound on a grid that may wait behind a
 * peer-waiting kernel. `num_sms` = 0 restores the value the comm resolved at init (config num_sms,
 * or the device's SMs shared by the ranks on it). Between calls; the next launches use it (a
 * captured graph keeps the grids it captured). Not collective, non-blocking. Errors:
 * INVALID_ARGUMENT (negative, more than the device has, or more than num_sms / ranks sharing the
 * device when virtual ranks share a GPU: their waiting kernels must all be resident at once). The
 * CPU backend stores the value and ignores it. */
MF_API mf_result_t mf_comm_set_num_sms(mf_comm_t comm, int32_t num_sms);
MF_API mf_result_t mf_comm_get_num_sms(mf_comm_t comm, int32_t *num_sms);

/* ---------------------------------------------------------------------------------------------
 * One rank per process: a bootstrap, then mf_comm_init on every rank
 * ------------------------------------------------------------------------------------------- */
/* The caller's allgather, how an engine hands over its process group: gathers `bytes` from every
 * rank into recv[r * bytes .. (r + 1) * bytes) for r = 0..R-1 (the caller's own block included).
 * Every rank calls it with the same `bytes`, in the same order; blocking; returns 0 on success and
 * anything else on failure. moeflow calls it only inside setup calls (mf_comm_init, mf_moe_create,
 * mf_comm_destroy), never on the data path. */
typedef int32_t (*mf_allgather_fn)(void *ctx, const void *send, void *recv, size_t bytes);

typedef struct mf_bootstrap {
    mf_allgather_fn allgather;
    void *ctx;
    /* Optional: called once with ctx when the comm that took this bootstrap is destroyed (or its
     * mf_comm_init fails); NULL leaves ctx to the caller, who keeps it valid until then. */
    void (*destroy)(void *ctx);
} mf_bootstrap_t;

/* The built-in rendezvous, for tools and tests (an engine passes its own allgather): rank 0
 * listens at an address that every rank was given, the others connect. Addresses are
 * "unix:NAME" (a Linux abstract Unix socket: ranks on this host, in this network namespace). */
#define MF_ADDRESS_BYTES 128

/* A fresh address, unique on this host (as ncclGetUniqueId): make it once, before the ranks
 * start, and give it to every rank. Not collective, non-blocking. */
MF_API mf_result_t mf_rendezvous_address(char address[MF_ADDRESS_BYTES]);

/* Connects rank `rank` of `num_ranks` at `address` and fills *bootstrap with an allgather over
 * the connection (destroy set: the comm it is given to owns it). Collective over the ranks,
 * blocking for at most `timeout_ms` (0 = MF_TIMEOUT_MS or 30000), or 1 s more on a rank other than 0
 * while it waits for rank 0's verdict: MF_ERR_TIMEOUT, on every rank that arrived, naming the ranks
 * that did not; MF_ERR_SYSTEM when a socket call fails or a rank leaves. */
MF_API mf_result_t mf_rendezvous_bootstrap(const char *address, int32_t rank, int32_t num_ranks,
                                    int64_t timeout_ms, mf_bootstrap_t *bootstrap);

#define MF_COMM_CONFIG_MAGIC 0x6d66636du /* "mfcm" */

typedef struct mf_comm_config {
    uint32_t size;       /* sizeof(mf_comm_config_t) */
    uint32_t magic;      /* MF_COMM_CONFIG_MAGIC */
    uint32_t version;    /* MF_API_VERSION */
    int32_t backend;     /* mf_backend_t; every rank resolves to the same backend */
    int32_t transport;   /* mf_transport_t; AUTO (default) picks LOCAL or IPC */
    int32_t device;      /* this rank's CUDA device ordinal (CUDA backend) */
    int32_t num_sms;     /* SMs this rank's peer-waiting kernels may use; 0 = all (one rank per
                            GPU), or num_sms / ranks sharing the device */
    int64_t timeout_ms;  /* bound on every wait for a peer; 0 = MF_TIMEOUT_MS env or 30000 */
    int64_t heap_bytes;  /* this rank's symmetric heap, the same on every rank: at least the
                            largest mf_moe_heap_bytes() of the layers the comm will hold; 0 =
                            sized by the first mf_moe_create. It is allocated once and never
                            moves (captured graphs keep valid pointers). */
    void *nccl_comm;     /* MF_TRANSPORT_NCCL: the caller's ncclComm_t (borrowed); else NULL */
} mf_comm_config_t;

#define MF_COMM_CONFIG_INIT                                                                      \
    {                                                                                            \
        sizeof(mf_comm_config_t), MF_COMM_CONFIG_MAGIC, MF_API_VERSION, MF_BACKEND_AUTO,         \
            MF_TRANSPORT_AUTO, 0, 0, 0, 0, NULL                                                  \
    }

/* Creates this process's rank `rank` of `num_ranks`. Collective: every rank calls it with the same
 * num_ranks, backend, transport and heap_bytes (checked: all fail with INVALID_ARGUMENT if not).
 * Blocking, not graph-capturable. `bootstrap` is copied; with its destroy set the comm owns its
 * ctx (also when the call fails). MF_TRANSPORT_NCCL takes its allgather from config->nccl_comm and
 * accepts bootstrap = NULL. The caller owns *comm (mf_comm_destroy). */
MF_API mf_result_t mf_comm_init(const mf_comm_config_t *config, int32_t rank, int32_t num_ranks,
                         const mf_bootstrap_t *bootstrap, mf_comm_t *comm);

/* Aborts the comm: every wait of this rank on a peer, host or device, ends with MF_ERR_ABORTED,
 * peers waiting for this rank end likewise, and every later call on the comm fails with
 * MF_ERR_ABORTED; only mf_comm_destroy remains. Non-blocking, may be called from any thread
 * (also while another thread is inside a call on the comm), not collective. */
MF_API mf_result_t mf_comm_abort(mf_comm_t comm);

/* Destroys a comm made by mf_comm_init, after its layers. Waits (within the timeout) until every
 * peer has stopped using this rank's heap, unless the comm is broken or aborted; then unmaps the
 * peers' heaps and frees its own. Collective when the comm is healthy, blocking. NULL is a no-op.
 * Comms of an mf_group_t are destroyed by mf_group_destroy. */
MF_API mf_result_t mf_comm_destroy(mf_comm_t comm);

/* The transport the comm resolved to (AUTO never comes back). */
MF_API mf_result_t mf_comm_get_transport(mf_comm_t comm, mf_transport_t *transport);

/* ---------------------------------------------------------------------------------------------
 * MoE layer
 * ------------------------------------------------------------------------------------------- */
#define MF_MOE_CONFIG_MAGIC 0x6d666d65u /* "mfme" */

typedef struct mf_moe_config {
    uint32_t size;                /* sizeof(mf_moe_config_t) */
    uint32_t magic;               /* MF_MOE_CONFIG_MAGIC */
    uint32_t version;             /* MF_API_VERSION */
    int32_t num_experts;          /* E >= R (placement says which rank holds which expert) */
    int32_t num_topk;             /* K, 1..MF_MAX_TOPK */
    int32_t hidden;               /* H; a multiple of 128 for FP8, of 8 for BF16 */
    int32_t intermediate;         /* I; a multiple of 128 for FP8, of 8 for BF16 */
    int32_t max_tokens_per_rank;  /* S; every call has T <= S */
    int32_t dtype;                /* MF_DTYPE_BF16 or MF_DTYPE_FP8_E4M3: weights, dispatch payload */
    int32_t layout;               /* mf_layout_t of dispatch output and expert compute */
    int32_t block_m;              /* EXPERT_MAJOR segment alignment; 0 = 128 */
    int32_t expert_capacity;      /* MASKED: rows per local expert (C); 0 = R * S (worst case) */
    int32_t max_recv_rows;        /* EXPERT_MAJOR: rows of the receive tensor; 0 = worst case */
    int32_t ue8m0_scales;         /* 1: activation scales rounded up to powers of two */
    int32_t profile;              /* 1: record per-phase times (mf_moe_get_phase_times) */
    int32_t dataflow;             /* mf_dataflow_t; 0 = AUTO */
    /* Added after moeflow 0.2.0 (same MF_API_VERSION; older, shorter configs read 0 here). */
    int32_t num_physical_experts; /* P: physical expert slots over all ranks (replicas included),
                                     a multiple of R, >= E; 0 = E. Rank r holds the P / R slots
                                     [r * P / R, (r + 1) * P / R) (mf_moe_set_expert_map).
                                     Replicas (P > E) need placement LINEAR with R | E */
    int32_t spare_slots;          /* B: per-step balancing slots per rank, 0..MF_MAX_SPARE_SLOTS;
                                     0 = off (mf_moe_prefetch). Needs placement LINEAR with R | E */
    int32_t placement;            /* mf_placement_t; 0 = MF_PLACEMENT_LINEAR (older, shorter configs
                                     read 0 here) */
    int32_t max_in_flight;        /* exchanges of this layer in flight at once (mf_exchange_t, the
                                     split halves), 1..MF_MAX_IN_FLIGHT; 0 = 1. The heap holds this
                                     many copies of the layer's publication and combine regions
                                     (mf_moe_heap_bytes grows with it); 2 = two micro-batches */
} mf_moe_config_t;

#define MF_MAX_IN_FLIGHT 4

#define MF_MAX_SPARE_SLOTS 16

#define MF_MAX_TOPK 32

#define MF_MOE_CONFIG_INIT                                                                       \
    {                                                                                            \
        sizeof(mf_moe_config_t), MF_MOE_CONFIG_MAGIC, MF_API_VERSION, 0, 0, 0, 0, 0,             \
            MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, 0, 0, 0, 0, 0, MF_DATAFLOW_AUTO, 0, 0,        \
            MF_PLACEMENT_LINEAR, 0                                                               \
    }

/* What a layer resolved its defaults to, for sizing weights and dispatch outputs. */
typedef struct mf_moe_info {
    int32_t num_ranks;          /* R */
    int32_t rank;               /* this rank */
    int32_t num_local_experts;  /* L_r: the experts this rank holds under the placement (E / R
                                   when R | E and LINEAR) */
    int32_t first_expert;       /* global id of local expert 0: LINEAR r * (E / R) + min(r, E % R)
                                   (rank * L when R | E), ROUND_ROBIN rank */
    int32_t block_m;            /* EXPERT_MAJOR segment alignment */
    int32_t expert_capacity;    /* MASKED rows per expert (C) */
    int32_t max_recv_rows;      /* EXPERT_MAJOR receive rows (sized for the rank holding the most) */
    int64_t heap_bytes;         /* this rank's symmetric heap (shared by all layers of the comm) */
    /* Added after moeflow 0.2.0: */
    int32_t placement;          /* mf_placement_t */
    int32_t num_local_slots;    /* this rank's weight slots, the leading dim of its weights and of its
                                   dispatch segments (expert_counts, MASKED recv_x): num_local_experts,
                                   or P / R on a layer with replicas (num_physical_experts > E) */
} mf_moe_info_t;

/* The symmetric-heap bytes a layer with `config` needs on each of `num_ranks` ranks, for
 * mf_comm_config_t.heap_bytes (layers of a comm share one heap: declare the largest). Not
 * collective, non-blocking. */
MF_API mf_result_t mf_moe_heap_bytes(const mf_moe_config_t *config, int32_t num_ranks, int64_t *bytes);

/* Creates a layer on `comm`. Collective over the group, blocking, not graph-capturable. All layers
 * of a comm share its symmetric heap, which never moves: a comm declared with heap_bytes = 0 sizes
 * it here, at its first layer; a later layer that needs more fails with MF_ERR_CAPACITY naming
 * the size to declare. The caller owns *moe. Errors: INVALID_ARGUMENT (bad config values,
 * E < R, a placement outside mf_placement_t, H or I not a multiple of 128 for FP8, ranks asking
 * for different layers), INVALID_USAGE (bad magic/size/version), NOT_SUPPORTED (replicas or spare
 * slots with ROUND_ROBIN or with E % R != 0), CAPACITY (heap), OUT_OF_MEMORY. */
MF_API mf_result_t mf_moe_create(mf_comm_t comm, const mf_moe_config_t *config, mf_moe_t *moe);

MF_API mf_result_t mf_moe_get_info(mf_moe_t moe, mf_moe_info_t *info);

/* Destroys the layer; no call on it may be in flight. NULL is a no-op. Not collective, except for
 * a layer with spare_slots > 0 or one that staged a map (mf_moe_stage_expert_map): every rank
 * destroys it, meeting at a barrier over the bootstrap so that no peer still writes its spare or
 * staging slots (skipped on a broken or aborted comm, whose peers may still write them: virtual
 * ranks of an mf_group_t then keep that memory until mf_group_destroy). */
MF_API mf_result_t mf_moe_destroy(mf_moe_t moe);

/* This rank's expert weights, one per weight slot of the rank: Ls = info.num_local_slots slots,
 * L_r (num_local_experts) without replicas, Lp = P / R with them. Without an expert map, slot l
 * holds the placement's local expert l (LINEAR: global first_expert + l; ROUND_ROBIN: global
 * rank + l * R); with one, the logical expert map[rank * Lp + l] of mf_moe_set_expert_map. */
typedef struct mf_moe_weights {
    mf_tensor_t w13;        /* [Ls, 2I, H]: rows [0, I) gate, [I, 2I) up; the layer's dtype */
    mf_tensor_t w13_scales; /* FP8: [Ls, 2I/128, H/128] fp32, one per 128x128 block; BF16: unused */
    mf_tensor_t w2;         /* [Ls, H, I]; the layer's dtype */
    mf_tensor_t w2_scales;  /* FP8: [Ls, H/128, I/128] fp32; BF16: unused */
} mf_moe_weights_t;

/* Sets this rank's expert weights. The layer BORROWS the memory: it must stay valid and unchanged
 * until the layer is destroyed or the weights are set again. Not collective, non-blocking, not
 * graph-capturable. Errors: INVALID_ARGUMENT (a shape other than [num_local_slots, ...], a dtype,
 * NULL data; the weights set before stay), INVALID_USAGE (a staged map in progress). */
MF_API mf_result_t mf_moe_set_weights(mf_moe_t moe, const mf_moe_weights_t *weights);

typedef struct mf_moe_forward_in {
    mf_tensor_t x;            /* [T, H] BF16, T <= S (T = 0 allowed) */
    mf_tensor_t topk_ids;     /* [T, K] int32 in [-1, E); -1 skips; a token's ids are distinct */
    mf_tensor_t topk_weights; /* [T, K] fp32 */
} mf_moe_forward_in_t;

typedef struct mf_moe_forward_out {
    mf_tensor_t y;            /* [T, H] BF16: sum over k of topk_weights * expert(x) */
} mf_moe_forward_out_t;

/* The whole layer: dispatch, W13 -> SwiGLU -> W2 on the local experts, combine.
 * Collective, blocking on CPU / asynchronous on `stream` (CUDA), graph-capturable on CUDA.
 * Errors: INVALID_ARGUMENT (shapes, dtypes, NULL data, T > S, ids outside [-1, E) or repeated in a
 * token when the ids are host memory), INVALID_USAGE (weights not set, comm broken), CAPACITY,
 * TIMEOUT. */
MF_API mf_result_t mf_moe_forward(mf_moe_t moe, const mf_moe_forward_in_t *in,
                           const mf_moe_forward_out_t *out, mf_stream_t stream);

/* ---------------------------------------------------------------------------------------------
 * Balanced EP: logical experts, physical replicas, per-step spare slots (docs/API.md section 13)
 *
 * Routing ids stay logical (topk_ids in [-1, E)). A layer has P = num_physical_experts slots, P / R
 * on each rank; the *expert map* names the logical expert each slot holds (vLLM EPLB's
 * physical_to_logical_map for one layer). Every (token, k) is sent to exactly one replica of its
 * expert, chosen in each call from the call's global per-expert counts so that rows per rank are
 * as even as the replicas allow; the choice is a function of the routing and the map alone, the
 * same on every rank. y is bit-identical to the same layer without replicas, whatever the map,
 * for a fixed expert kernel (docs/API.md: AUTO may choose another GEMM variant when a replica's
 * share changes the rows per expert; pin the dataflow to compare bit for bit on CUDA).
 * ------------------------------------------------------------------------------------------- */

/* Sets the layer's expert map: phys_to_logical[p] for every physical slot p in [0, P) is the
 * logical expert in [0, E) that slot p holds (slot p lives on rank p / (P / R), local slot
 * p % (P / R)). num_physical must be the layer's P. Every logical expert needs at least one slot.
 * The default (never set) is the identity, which needs P = E. Not collective, but every rank sets
 * the same map before its next forward (the forward checks it: INVALID_USAGE on every rank if
 * not); the caller's weights (mf_moe_set_weights) must hold the new map's experts by then.
 * Between calls only; host memory, copied; not graph-capturable. CPU: non-blocking; CUDA: waits
 * for this rank's last forward and prefetch (they read the device copy it replaces). Errors:
 * INVALID_ARGUMENT (NULL, wrong num_physical, an id outside [0, E), a logical expert with no slot;
 * nothing is changed), NOT_SUPPORTED (a layer placed ROUND_ROBIN or with E % R != 0: its placement
 * is its map). */
MF_API mf_result_t mf_moe_set_expert_map(mf_moe_t moe, const int32_t *phys_to_logical, int32_t num_physical);

/* Per-step balancing (config.spare_slots = B > 0): from the global per-expert counts of this
 * layer's last forward (every rank holds the same ones), every rank computes the same plan: the
 * hot experts to replicate into the R * B spare slots and their destination ranks; each expert's
 * weights (FP8: and scales) are copied peer to peer into the spare slots that need them (slots
 * already holding the expert are kept). The next forward splits those experts' rows across the
 * new replicas too. Call it between two forwards of the layer, e.g. on a side stream during
 * attention; the next forward on the layer waits for it (on the device on CUDA: no host wait).
 * CUDA ordering: the prefetch follows this rank's last forward and the next forward follows the
 * prefetch through events moeflow records, whatever the two streams, when both calls are eager
 * or both are captured into the same graph; when one is captured and the other is not, order
 * them yourself (the same stream, or the graph launch and the eager call joined by events).
 * Collective (every rank calls it between the same forwards), asynchronous on `stream` on CUDA
 * (blocking on CPU), graph-capturable on CUDA. A layer with B = 0: a no-op, except for the step of
 * a staged map (mf_moe_stage_expert_map) that each call makes while one is in flight. Errors: INVALID_USAGE
 * (weights not set, comm broken), NOT_SUPPORTED (backend without balancing). */
MF_API mf_result_t mf_moe_prefetch(mf_moe_t moe, mf_stream_t stream);

/* Rebalancing without a stall (docs/API.md section 13, "A new map without a stall"): stages a new
 * expert map whose weights moeflow moves itself, while the current map and weights keep serving.
 * `next_weights` are this rank's Lp slots under the new map, caller-allocated [Lp, ...] buffers
 * shaped like mf_moe_set_weights' (checked the same way); the layer BORROWS them and WRITES them:
 * do not read, write or free them until the switch. The moves run inside the following
 * mf_moe_prefetch calls, one bounded step per call: in each, every rank pushes at most
 * `experts_per_step` experts into each peer's staging slots (0 = all in one step) and copies the
 * previous step's arrivals into `next_weights`; the first step also copies the experts the rank
 * already holds (local copies). The old map and weights serve every forward meanwhile. The
 * prefetch that completes the last copy switches the layer, on every rank alike, to the staged
 * map and `next_weights` (as mf_moe_set_expert_map + mf_moe_set_weights would; spare copies are
 * dropped and refilled by later prefetches); the next forward is the first under the new map.
 * From then the old weights are never read again: the caller may free or reuse them once that
 * prefetch has returned (CPU) or completed on its stream (CUDA); mf_moe_get_balance_stats'
 * stage_steps_left is 0 and map_switches counts the switches. A layer with P / R slots needs
 * ceil(max moves per rank / experts_per_step) + 1 prefetches (1 when no expert crosses ranks).
 * Collective and blocking: every rank stages the same map with the same experts_per_step
 * between the same two forwards (they meet over the bootstrap, as in mf_moe_create; the first
 * stage allocates 2 x experts_per_step staging slots per rank in the symmetric heap of each
 * peer, kept until the layer is destroyed or a stage needs more). Not graph-capturable.
 * Errors, on every rank alike and with nothing changed: INVALID_ARGUMENT (NULL, wrong
 * num_physical, an id outside [0, E), an expert with no slot, bad next_weights,
 * experts_per_step < 0, or ranks that staged different maps or steps), INVALID_USAGE (weights not
 * set, a stage already in progress, comm broken), NOT_SUPPORTED (a backend without staging, a layer
 * placed ROUND_ROBIN or with E % R != 0; CUDA: a layer whose balancing planner exceeds shared
 * memory). CUDA: waits for this rank's last forward
 * and prefetch (as mf_moe_set_expert_map); the steps copy with the copy engines on the prefetch's
 * stream, no host wait; a captured prefetch replays the step it captured (stage eagerly). */
MF_API mf_result_t mf_moe_stage_expert_map(mf_moe_t moe, const int32_t *phys_to_logical, int32_t num_physical,
                                           const mf_moe_weights_t *next_weights, int32_t experts_per_step);

/* What balancing did in this layer's last forward and prefetch, as every rank sees it. */
typedef struct mf_moe_balance_stats {
    uint32_t size;                       /* sizeof(mf_moe_balance_stats_t), set by the caller */
    int32_t num_physical_experts;        /* P (a layer placed ROUND_ROBIN or with E % R != 0: its slot
                                            grid R * ceil(E / R), empty slots included) */
    int32_t slots_per_rank;              /* Lp = P / R */
    int32_t spare_slots;                 /* B */
    int64_t recv_rows[MF_MAX_RANKS];     /* last forward: rows each rank's experts computed */
    int64_t home_rows[MF_MAX_RANKS];     /* the same routing without replicas (e on its placement's rank) */
    int64_t prefetch_bytes;              /* weight bytes this rank copied in the last prefetch */
    int64_t prefetch_bytes_all;          /* the same over every rank */
    int32_t spare_resident;              /* spare slots holding an expert after the last prefetch */
    int32_t pad;
    /* mf_moe_stage_expert_map: */
    int64_t stage_bytes;                 /* weight bytes this rank pushed to peers in the last prefetch */
    int64_t stage_bytes_all;             /* the same over every rank */
    int64_t stage_local_bytes;           /* weight bytes this rank copied locally in it (held experts
                                            and arrivals from the staging slots into next_weights) */
    int32_t stage_steps_left;            /* prefetches until the staged map serves; 0 = none staged */
    int32_t map_switches;                /* staged maps switched to so far */
} mf_moe_balance_stats_t;

/* Fills *stats (stats->size must be set; a smaller size gets the fields that fit). Not
 * collective; blocking on CUDA (synchronises with the last forward). */
MF_API mf_result_t mf_moe_get_balance_stats(mf_moe_t moe, mf_moe_balance_stats_t *stats);

/* Phases of mf_moe_forward, for profiling. */
typedef enum mf_phase {
    MF_PHASE_PREPARE = 0,  /* quantise and publish this rank's tokens and routing */
    MF_PHASE_DISPATCH = 1, /* wait for the peers, plan, gather the routed rows */
    MF_PHASE_W13 = 2,      /* grouped W13 GEMM and SwiGLU (+ FP8 requantisation) */
    MF_PHASE_W2 = 3,       /* grouped W2 GEMM and the return of partials to the token owners */
    MF_PHASE_COMBINE = 4,  /* wait for the peers, weighted K-sum into y */
    MF_NUM_PHASES = 5
} mf_phase_t;

typedef struct mf_phase_times {
    double us[MF_NUM_PHASES]; /* microseconds per phase (waits on peers included) */
    double total_us;
} mf_phase_times_t;

/* Per-phase times of this layer's last mf_moe_forward; needs config.profile = 1 (else
 * INVALID_USAGE). CPU: wall clock; CUDA: device events, so the call synchronises with that
 * forward. Not collective, blocking. */
MF_API mf_result_t mf_moe_get_phase_times(mf_moe_t moe, mf_phase_times_t *times);

/* ---------------------------------------------------------------------------------------------
 * Communication only: dispatch and combine, for engines that bring their own expert GEMMs.
 * On one comm, mf_dispatch and mf_combine alternate; mf_combine uses the routing of the
 * mf_dispatch before it on the same layer. The segments are the rank's weight slots, L =
 * info.num_local_slots of them: segment l holds the rows of the expert in weight slot l (its
 * placement's local expert l; with an expert map, slot l's share of its expert's rows, as the
 * forward splits them over the replicas).
 * ------------------------------------------------------------------------------------------- */
typedef struct mf_dispatch_in {
    mf_tensor_t x;        /* [T, H] BF16; sent as the layer's dtype (FP8: quantised 1x128 here) */
    mf_tensor_t topk_ids; /* [T, K] int32, as in mf_moe_forward */
} mf_dispatch_in_t;

typedef struct mf_dispatch_out {
    /* EXPERT_MAJOR: [max_recv_rows, H]; MASKED: [L, C, H]. The layer's dtype. */
    mf_tensor_t recv_x;
    /* FP8: [max_recv_rows, H/128] / [L, C, H/128] fp32 scales of recv_x; BF16: unused. */
    mf_tensor_t recv_scales;
    /* [max_recv_rows, 3] / [L, C, 3] int32: (source rank, source token, k) of each row, rank-major
     * then token then k; EXPERT_MAJOR padding rows read (-1, -1, -1). */
    mf_tensor_t recv_src;
    /* [L] int32: rows received per segment (L = info.num_local_slots). */
    mf_tensor_t expert_counts;
    /* EXPERT_MAJOR: [L + 1] int32 segment starts, multiples of block_m; MASKED: unused. */
    mf_tensor_t expert_offsets;
} mf_dispatch_out_t;

/* Moves every (token, k) with a local expert of some rank to that rank, in the layer's layout.
 * Collective, blocking on CPU / asynchronous on CUDA, graph-capturable on CUDA. Errors as
 * mf_moe_forward's; NOT_SUPPORTED on a layer with spare slots (B > 0: their weights are moeflow's
 * copies, which the caller's GEMMs cannot read). */
MF_API mf_result_t mf_dispatch(mf_moe_t moe, const mf_dispatch_in_t *in, const mf_dispatch_out_t *out,
                        mf_stream_t stream);

typedef struct mf_combine_in {
    /* Expert outputs, BF16, in the layout and row order of the preceding dispatch's recv_x:
     * [max_recv_rows, H] / [L, C, H]. */
    mf_tensor_t expert_out;
    mf_tensor_t topk_weights; /* [T, K] fp32 of this rank's tokens (T of the preceding dispatch) */
} mf_combine_in_t;

typedef struct mf_combine_out {
    mf_tensor_t y; /* [T, H] BF16: bf16(sum over k ascending of w[t,k] * expert_out row of (t,k)) */
} mf_combine_out_t;

/* Returns every expert output row to its token's rank and sums the K rows of each token there.
 * Collective, blocking on CPU / asynchronous on CUDA, graph-capturable on CUDA. */
MF_API mf_result_t mf_combine(mf_moe_t moe, const mf_combine_in_t *in, const mf_combine_out_t *out,
                       mf_stream_t stream);

typedef struct mf_experts_in {
    /* Rows in the MASKED layout of mf_dispatch's output, the layer's dtype: [L, C, H] (L =
     * info.num_local_slots), slot e's rows [0, expert_counts[e]) of recv_x[e]. */
    mf_tensor_t recv_x;
    mf_tensor_t recv_scales;   /* FP8: [L, C, H/128] fp32 1 x 128 scales of recv_x; BF16: unused */
    mf_tensor_t expert_counts; /* [L] int32, the backend's memory (device memory on CUDA) */
} mf_experts_in_t;

typedef struct mf_experts_out {
    /* [L, C, H] BF16: row j < expert_counts[e] of slot e is W2 (SwiGLU (W13 recv_x[e, j])) with
     * slot e's weights, unweighted; rows past a count are not written. */
    mf_tensor_t expert_out;
} mf_experts_out_t;

/* This rank's experts on rows in the dispatch layout, for engines that use moeflow's dispatch and
 * combine around moeflow's grouped GEMMs (vLLM's prepare / experts / finalize split): W13 ->
 * SwiGLU -> W2 with the layer's weights and the fused layer's rounding points (the intermediate
 * requantised 1 x 128 for FP8, rounded to BF16 for BF16; W2 rounded to BF16), so that mf_dispatch
 * -> mf_moe_experts -> mf_combine gives mf_moe_forward's y (bit for bit on the CPU backend). The
 * layer's layout must be MASKED. Not collective, asynchronous on `stream` (CUDA; the counts are
 * read on the device, at most C rows a slot: a larger count is clamped to C), graph-capturable;
 * it uses the layer's GEMM scratch, so no other mf_moe_experts or mf_moe_forward of the layer may run
 * concurrently; the halves of the layer's exchanges may (a micro-batch's experts beside another's
 * receive: docs/API.md section 16, `moeflow bench overlap`). Errors:
 * INVALID_ARGUMENT (shapes, dtypes, NULL data; on the CPU a count outside [0, C]), INVALID_USAGE
 * (weights not set), NOT_SUPPORTED (EXPERT_MAJOR layout, a layer with spare slots). */
MF_API mf_result_t mf_moe_experts(mf_moe_t moe, const mf_experts_in_t *in, const mf_experts_out_t *out,
                           mf_stream_t stream);

/* ---------------------------------------------------------------------------------------------
 * Overlap: dispatch and combine in halves (docs/API.md section 16)
 *
 * An exchange (mf_exchange_t) is one mf_dispatch + mf_combine of a layer cut into four calls: a
 * *send* half quantises, publishes and signals, then returns without waiting on any peer (on CUDA
 * it leaves no kernel waiting on the device); a *receive* half waits for every rank's send and
 * lands the rows (dispatch) or sums them (combine). Up to config.max_in_flight exchanges of a layer
 * (MF_MAX_IN_FLIGHT of a comm) are in flight at once, each in its own heap slot, so that two
 * micro-batches overlap their communication with each other's compute (DeepEP's
 * return_recv_hook, vLLM's prepare_async / finalize_async, SGLang's dispatch_a / dispatch_b).
 * mf_dispatch and mf_combine are an exchange whose halves run in one call.
 *
 * Order: every rank makes the halves' calls in the same order (they are collective), and the
 * receives of each phase come in the order of its sends (the oldest exchange sent at a phase is
 * received first); a send needs a free heap slot of its layer. Faults: a send that fails (bad
 * input, an exchange already in flight, no free slot) still takes part in its collective with the
 * failure as status, so every rank fails that exchange (the failing rank at its send, the others at
 * their receive) and nothing is written; a failed receive ends the exchange on every rank; a
 * receive refused for misuse (no send before it, out of order) is local and changes nothing. Every
 * wait is bounded by the comm timeout, a rank that dies between send and receive makes the
 * survivors' next receive that needs it fail with MF_ERR_TIMEOUT (or MF_ERR_ABORTED), writing
 * nothing. CUDA: the halves are graph-capturable, and the halves of one comm must run in stream
 * order (one stream, or streams joined by events: the `events` below).
 * ------------------------------------------------------------------------------------------- */

/* Events around one half (DeepEP's previous_event / async_finish); either may be NULL, and the
 * argument itself may be NULL. CPU backend: both must be NULL (each half completes before it
 * returns). */
typedef struct mf_exchange_events {
    mf_event_t previous; /* the half's work on `stream` waits for it (cudaStreamWaitEvent) */
    mf_event_t finished; /* recorded on `stream` after the half's work (cudaEventRecord) */
} mf_exchange_events_t;

/* A handle for exchanges of `moe` (reusable: one exchange after another). Not collective,
 * non-blocking, host memory only. The caller owns *exchange (mf_exchange_destroy). */
MF_API mf_result_t mf_exchange_create(mf_moe_t moe, mf_exchange_t *exchange);

/* Frees the handle. INVALID_USAGE while its exchange is in flight (finish it, or destroy the
 * layer's comm). NULL is a no-op. */
MF_API mf_result_t mf_exchange_destroy(mf_exchange_t exchange);

/* The send half of dispatch: validates `in` and `out` as mf_dispatch does, takes a heap slot,
 * quantises and publishes this rank's tokens and routing there and signals the peers. Returns
 * without waiting on a peer. `out` is where mf_dispatch_recv will land the rows: it must stay
 * valid until then. Collective (every rank sends, in the same order), non-blocking,
 * graph-capturable (CUDA). Errors (every rank then fails this exchange): as mf_dispatch's;
 * INVALID_USAGE (the handle's exchange is already in flight; no free heap slot: more in flight
 * than config.max_in_flight or MF_MAX_IN_FLIGHT of the comm, or than the heap regions allow
 * across layers; an mf_moe_forward cannot run while exchanges are in flight either). */
MF_API mf_result_t mf_dispatch_send(mf_exchange_t exchange, const mf_dispatch_in_t *in,
                                    const mf_dispatch_out_t *out, const mf_exchange_events_t *events,
                                    mf_stream_t stream);

/* The receive half of dispatch: waits (bounded) for every rank's send of this exchange, plans and
 * lands the rows in the `out` given to the send (mf_dispatch's layout and order). Blocking on CPU,
 * asynchronous on CUDA, graph-capturable. Errors: INVALID_USAGE, local and changing nothing (no
 * dispatch send in flight on the handle; an exchange sent before it at DISPATCH not yet received);
 * a peer's failed send, a capacity overflow, MF_ERR_TIMEOUT, MF_ERR_ABORTED: the exchange ends
 * on every rank and nothing is written. */
MF_API mf_result_t mf_dispatch_recv(mf_exchange_t exchange, const mf_exchange_events_t *events,
                                    mf_stream_t stream);

/* The send half of combine: validates as mf_combine does (T of this exchange's dispatch), writes
 * the expert output rows into their owners' combine slots of this exchange, keeps a copy of
 * topk_weights in the exchange's heap slot, and signals. Returns without waiting. `in` may be
 * reused once the send returned (CPU) or ran on its stream (CUDA); `out->y` must stay valid
 * until mf_combine_recv. Collective, non-blocking,
 * graph-capturable. Errors (every rank then fails the exchange): as mf_combine's; INVALID_USAGE
 * (the exchange's dispatch was not received). */
MF_API mf_result_t mf_combine_send(mf_exchange_t exchange, const mf_combine_in_t *in,
                                   const mf_combine_out_t *out, const mf_exchange_events_t *events,
                                   mf_stream_t stream);

/* The receive half of combine: waits (bounded) for every rank's combine send of this exchange and
 * sums this rank's tokens into y. The exchange then ends (its slot is free, the handle reusable).
 * Blocking on CPU, asynchronous on CUDA, graph-capturable. Errors: INVALID_USAGE, local (no
 * combine send in flight on the handle; out of order); a peer's failure, TIMEOUT, ABORTED: y is
 * not written and the exchange ends. */
MF_API mf_result_t mf_combine_recv(mf_exchange_t exchange, const mf_exchange_events_t *events,
                                   mf_stream_t stream);

/* ---------------------------------------------------------------------------------------------
 * Numerics helpers (host; the same conversions every backend uses)
 * ------------------------------------------------------------------------------------------- */
/* float -> E4M3: round to nearest even, saturate to +-448 (inf too), NaN -> 0x7f | sign. */
MF_API uint8_t mf_fp8_e4m3_from_float(float x);
MF_API float mf_fp8_e4m3_to_float(uint8_t x);
/* float -> bf16: round to nearest even; NaN stays NaN. */
MF_API uint16_t mf_bf16_from_float(float x);
MF_API float mf_bf16_to_float(uint16_t x);

/* Block-quantises a BF16 matrix (or a batch of them) to FP8 E4M3 with one fp32 scale per block:
 *   in     [..., M, N] BF16, N a multiple of 128 (and M of 128 when block_rows = 128)
 *   out    [..., M, N] FP8
 *   scales [..., M / block_rows, N / 128] fp32
 * block_rows = 1 (activations, 1x128) or 128 (weights, 128x128); ue8m0 = 1 rounds scales up to
 * powers of two. Host memory; not collective; blocking. */
MF_API mf_result_t mf_quantize_fp8(const mf_tensor_t *in, const mf_tensor_t *out, const mf_tensor_t *scales,
                            int32_t block_rows, int32_t ue8m0);

/* ---------------------------------------------------------------------------------------------
 * ABI: the sizes of the public structs, for bindings that build them without this header
 * ------------------------------------------------------------------------------------------- */
typedef enum mf_struct {
    MF_STRUCT_TENSOR = 0,
    MF_STRUCT_GROUP_CONFIG = 1,
    MF_STRUCT_COMM_CONFIG = 2,
    MF_STRUCT_BOOTSTRAP = 3,
    MF_STRUCT_MOE_CONFIG = 4,
    MF_STRUCT_MOE_INFO = 5,
    MF_STRUCT_MOE_WEIGHTS = 6,
    MF_STRUCT_MOE_FORWARD_IN = 7,
    MF_STRUCT_MOE_FORWARD_OUT = 8,
    MF_STRUCT_DISPATCH_IN = 9,
    MF_STRUCT_DISPATCH_OUT = 10,
    MF_STRUCT_COMBINE_IN = 11,
    MF_STRUCT_COMBINE_OUT = 12,
    MF_STRUCT_PHASE_TIMES = 13,
    MF_STRUCT_MOE_BALANCE_STATS = 14,
    MF_STRUCT_EXPERTS_IN = 15,
    MF_STRUCT_EXPERTS_OUT = 16,
    MF_STRUCT_EXCHANGE_EVENTS = 17,
    MF_NUM_STRUCTS = 18
} mf_struct_t;

/* sizeof the struct `which` in this library (0 for an unknown value). Not collective, non-blocking;
 * the one function that never touches mf_last_error(). */
MF_API int64_t mf_get_struct_size(mf_struct_t which);

#ifdef __cplusplus
}
#endif

#endif /* MOEFLOW_H */
