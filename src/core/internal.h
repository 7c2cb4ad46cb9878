/*
 * internal.h — what every part of the library shares: the handle structs behind the opaque public
 * types, the backend interface, the error macros and the symmetric-heap layout.
 *
 * Layering (docs/DESIGN.md): src/core validates every public call on the host and then calls the group's
 * backend (src/cpu or src/cuda) through `mf__backend_ops`. A backend may assume its inputs passed
 * validation: shapes, dtypes and non-NULL data are checked here, once.
 *
 * Dimension legend: T tokens on this rank in this call, S capacity, H hidden, I intermediate,
 * E experts, R ranks, L = E / R local experts (L_r: rank r's under the placement), K top-k,
 * C masked expert capacity.
 */
#ifndef MF_CORE_INTERNAL_H
#define MF_CORE_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "moeflow.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors: the one family of CHECK macros --------------------------------------------------- */

/* Records `fmt` as this thread's last error and returns `code`. */
mf_result_t mf__error(mf_result_t code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void mf__clear_error(void);

/* Evaluates an mf_result_t expression; returns it from the enclosing function when it fails. */
#define MF_CHECK(expr)                          \
    do {                                        \
        mf_result_t mf__r = (expr);             \
        if (mf__r != MF_SUCCESS) return mf__r;  \
    } while (0)

/* Same, but stores the code in `res` and jumps to `label` (for cleanup). */
#define MF_CHECK_GOTO(expr, res, label)          \
    do {                                         \
        (res) = (expr);                          \
        if ((res) != MF_SUCCESS) goto label;     \
    } while (0)

/* Fails with INVALID_ARGUMENT naming the condition when `cond` is false. */
#define MF_REQUIRE(cond, ...)                                                 \
    do {                                                                      \
        if (!(cond)) return mf__error(MF_ERR_INVALID_ARGUMENT, __VA_ARGS__);  \
    } while (0)

/* ---- config structs of any API version --------------------------------------------------------- */

/* Copies a caller's config into the library's current layout (NCCL's habit): checks magic and
 * version (1..MF_API_VERSION), accepts any size from the oldest layout's (`min_size`) to the
 * current one (`lib_size`), copies the caller's bytes and gives the newer fields 0 (their
 * defaults); out->size and out->version then read as current. `init` names the INIT macro for
 * the message. INVALID_USAGE on a bad header. */
mf_result_t mf__read_config(const void *in, size_t lib_size, size_t min_size, uint32_t magic, const char *fn,
                            const char *init, void *out);

/* ---- allocation (host): one place, with a failure switch for tests ---------------------------- */

void *mf__malloc(size_t bytes);
void *mf__calloc(size_t count, size_t bytes);
void mf__free(void *p);
/* Test hook: the n-th host allocation from now on fails (1 = the next); 0 disables. */
void mf__test_fail_alloc_after(int64_t n);

/* ---- tunables: the environment variables (MF_TIMEOUT_MS, MF_DEBUG, MF_PDL) are read in errors.c - */

int64_t mf__param_timeout_ms(void); /* MF_TIMEOUT_MS, default 30000 */
int32_t mf__param_pdl(void);        /* MF_PDL: 0 when it is 0, else 1 (read by each CUDA comm's init) */
/* Resolves a config's timeout: 0 = mf__param_timeout_ms(). */
static inline int64_t mf__timeout_or_default(int64_t ms) { return ms ? ms : mf__param_timeout_ms(); }

/* ---- MF_DEBUG: the one place the library prints (opt-in, stderr) -------------------------------- */
/* MF_DEBUG=1 (read once per process) makes the expert-GEMM selection of both backends report each
 * distinct decision (layer, phase, shape class) once: the kernel that ran and why every other
 * family declined (docs/API.md "Environment"). Off, the cost is one relaxed atomic load per
 * dispatcher call; on, a hash lookup under a mutex per call and a line per new decision. Never
 * synchronises a device. */
int mf__debug_on(void);
/* 1 the first time `key` is seen in this process (then 0); 0 when the table of keys is full. */
int mf__debug_first(uint64_t key);
/* FNV-1a over `n` integers: the key of a decision. */
uint64_t mf__debug_key(const int64_t *v, int n);
/* Writes "moeflow DEBUG [pid P] <message>" and a newline to stderr in one call. */
void mf__debug(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
/* Test hook: forget the decisions seen and read MF_DEBUG again on the next mf__debug_on(). */
void mf__debug_reset(void);

/* ---- limits and alignments -------------------------------------------------------------------- */

#define MF__DEFAULT_BLOCK_M 128   /* EXPERT_MAJOR segment alignment */
#define MF__HEAP_ALIGN 256        /* every symmetric-heap region starts at a multiple of this */
#define MF__VEC_ELEMS_BF16 8      /* 16-byte rows: H and I multiples of 8 in BF16 */
#define MF__ROW_ALIGN 16          /* row tensors' data pointers: 16-byte vector loads and stores */

#define MF__META_WORDS 4        /* heap meta: T, map hash, prefetch count, weights count */

/* Collective phases of the data path; each has its own column of epoch signals. (Setup
 * collectives, mf_comm_init and mf_moe_create, meet over the bootstrap instead.) */
typedef enum mf__phase {
    MF__PHASE_DISPATCH = 0, /* every rank has published x, scales, ids, weights, T */
    MF__PHASE_COMBINE = 1,  /* every rank has written its partials into the owners' slots */
    MF__PHASE_ABORT = 2,    /* every rank has finished reading peers after a failed plan */
    MF__NUM_PHASES = 3
} mf__phase_t;

const char *mf__phase_name(int phase);

/* The synchronisations each data-path call meets at, as bit masks for ops->reject. */
#define MF__CALL_FORWARD ((1u << MF__PHASE_DISPATCH) | (1u << MF__PHASE_COMBINE))
#define MF__CALL_DISPATCH (1u << MF__PHASE_DISPATCH)
#define MF__CALL_COMBINE (1u << MF__PHASE_COMBINE)

/* ---- symmetric heap layout (identical on every rank; docs/DESIGN.md "Symmetric heap") -------------- */
/* Every region is aligned to MF__HEAP_ALIGN:
 *   meta:     4 x int32              T of this rank's current call; with balancing (P != E or B > 0)
 *                                    also the expert map's hash, the layer's prefetch count and
 *                                    weights count, which every rank checks are the same on all
 *   x:        S x H x (1 or 2) bytes published activations, FP8 (1 byte) or BF16 (2 bytes)
 *   scales:   S x H/128 x fp32       FP8 only: 1x128 activation scales
 *   ids:      S x K x int32          published topk_ids (-1 = skip)
 *   weights:  S x K x fp32           published topk_weights
 *   combine:  S x K x H x bf16       slots the experts' ranks write partials into, at (token, k)
 * and the whole repeats num_slots = config.max_in_flight times, one copy per exchange in flight
 * (mf_exchange_t, the split halves; docs/API.md section 16): slot i at i x slot_bytes.
 */
typedef struct mf__heap_layout {
    size_t meta, x, scales, ids, weights, combine;
    size_t slot_bytes; /* the regions above, once: one exchange in flight */
    int32_t num_slots; /* config.max_in_flight: the regions repeat this many times */
    size_t bytes;      /* total: slot_bytes x num_slots */
} mf__heap_layout_t;

/* The layer's layout; its offsets are those of slot 0 (mf_moe_forward's, and the first exchange's). */
void mf__heap_layout_init(mf__heap_layout_t *layout, const mf_moe_config_t *config);
/* The same regions in slot `slot` (offsets + slot x slot_bytes): an exchange's publication and
 * combine slots, while others of the comm are in flight in other slots. */
mf__heap_layout_t mf__heap_layout_slot(const mf__heap_layout_t *layout, int32_t slot);

/* ---- spare slots (balancing): one symmetric allocation per layer with B > 0 ------------------ */
/* Four tensors of B slots each, shaped as the caller's weights (so that a GEMM takes the spare
 * slots as a second [B, N, K] operand), every region aligned to MF__HEAP_ALIGN:
 *   w13:        B x 2I x H x (1 or 2) bytes     w13_scales: B x 2I/128 x H/128 x fp32 (FP8)
 *   w2:         B x H x I x (1 or 2) bytes      w2_scales:  B x H/128 x I/128 x fp32 (FP8)
 * Slot j of rank q is written by the rank that holds the expert's first static replica (a push:
 * the caller's weights are not symmetric memory), read by q's expert compute. */
typedef struct mf__spare_layout {
    size_t w13, w13_scales, w2, w2_scales;             /* offsets of the four tensors */
    size_t w13_bytes, w13_scale_bytes, w2_bytes, w2_scale_bytes; /* one slot of each */
    size_t bytes;                                      /* the allocation */
    size_t copy_bytes;                                 /* bytes of weights (+ scales) one replica moves */
} mf__spare_layout_t;

void mf__spare_layout_init(mf__spare_layout_t *layout, const mf_moe_config_t *config);

/* One expert's weights (+ FP8 scales, NULL without) somewhere: the caller's [Lp, ...] tensors or a
 * spare / staging region laid out as `sl` (both backends' weight moves). */
typedef struct mf__expert_ptrs {
    uint8_t *w13, *w13_scales, *w2, *w2_scales;
} mf__expert_ptrs_t;

/* Slot l of the caller's weights. */
static inline mf__expert_ptrs_t mf__expert_in_weights(const mf_moe_weights_t *w, const mf__spare_layout_t *sl, int32_t l) {
    const size_t i = (size_t)l;
    mf__expert_ptrs_t a;
    a.w13 = (uint8_t *)w->w13.data + i * sl->w13_bytes;
    a.w13_scales = w->w13_scales.data ? (uint8_t *)w->w13_scales.data + i * sl->w13_scale_bytes : NULL;
    a.w2 = (uint8_t *)w->w2.data + i * sl->w2_bytes;
    a.w2_scales = w->w2_scales.data ? (uint8_t *)w->w2_scales.data + i * sl->w2_scale_bytes : NULL;
    return a;
}

/* Slot j of a region laid out as `sl` (the spare slots, or a staging region). */
static inline mf__expert_ptrs_t mf__expert_in_region(void *region, const mf__spare_layout_t *sl, int32_t j) {
    uint8_t *base = (uint8_t *)region;
    const size_t i = (size_t)j;
    mf__expert_ptrs_t a;
    a.w13 = base + sl->w13 + i * sl->w13_bytes;
    a.w13_scales = base + sl->w13_scales + i * sl->w13_scale_bytes;
    a.w2 = base + sl->w2 + i * sl->w2_bytes;
    a.w2_scales = base + sl->w2_scales + i * sl->w2_scale_bytes;
    return a;
}

/* FNV-1a of an expert map, as published in the heap meta. */
uint32_t mf__map_hash(const int32_t *map, int32_t num_physical);

/* ---- signals (every rank, one symmetric allocation; docs/DESIGN.md "Symmetric heap") ----------- */
/* uint64 words:
 *   slots   [MF__NUM_PHASES][Q][MF_MAX_RANKS]  peers write: slot [p][e % Q][q] = e << MF__EPOCH_SHIFT |
 *                                              layer << MF__STATUS_BITS | status, e = rank q's e-th
 *                                              arrival at phase p, layer = the id of the layer it
 *                                              called (16 bits), status = its verdict (8 bits)
 *   epochs  [MF__NUM_PHASES]                   this rank's own epoch counters (device code keeps them)
 *   abort   [MF_MAX_RANKS]                     abort[q] != 0: rank q called mf_comm_abort
 * Epochs only grow: nothing is re-zeroed between calls. A status is an mf_result_t (0 = fine): the
 * arrival of a rank whose call failed before its work (rejected input, a fault its device found)
 * carries the code, and every waiter fails that call with it, so all ranks fail together; so does
 * an arrival for another layer than the waiter's (ranks must call the same layers). Q =
 * MF__EPOCH_SLOTS slots per phase, by epoch modulo Q: with one call at a time, a rank that failed a
 * call at its first phase may arrive at that phase again (its next call) before a peer has read its
 * status for this one, but never two arrivals ahead, since its next call's wait needs this peer
 * (2 would do). With the split halves, up to MF_MAX_IN_FLIGHT exchanges of a comm are in flight and
 * each phase's receives follow its sends in order (core/moe.c, "exchanges"): a rank sends its n-th
 * arrival at a phase only after it completed the exchange of arrival n - MF_MAX_IN_FLIGHT, which
 * needed every peer's combine send of it, made after that peer received (read) arrival n -
 * MF_MAX_IN_FLIGHT; one more for the failed-call case: Q = 2 x MF_MAX_IN_FLIGHT covers both. */
#define MF__EPOCH_SLOTS (2 * MF_MAX_IN_FLIGHT)
#define MF__STATUS_BITS 8
#define MF__STATUS_MASK ((1ull << MF__STATUS_BITS) - 1)
#define MF__LAYER_BITS 16
#define MF__LAYER_MASK ((1ull << MF__LAYER_BITS) - 1)
#define MF__EPOCH_SHIFT (MF__STATUS_BITS + MF__LAYER_BITS)
/* The layer id field of a slot value. */
#define MF__SLOT_LAYER(v) (((v) >> MF__STATUS_BITS) & MF__LAYER_MASK)
#define MF__SIGNAL_SLOTS 0
#define MF__SIGNAL_SLOT(phase, epoch, from)                                                      \
    (MF__SIGNAL_SLOTS + ((size_t)(phase) * MF__EPOCH_SLOTS + ((epoch) % MF__EPOCH_SLOTS)) * MF_MAX_RANKS + \
     (size_t)(from))
#define MF__SIGNAL_EPOCHS ((size_t)MF__NUM_PHASES * MF__EPOCH_SLOTS * MF_MAX_RANKS)
#define MF__SIGNAL_ABORT (MF__SIGNAL_EPOCHS + MF__NUM_PHASES)
#define MF__SIGNAL_WORDS (MF__SIGNAL_ABORT + MF_MAX_RANKS)
#define MF__SIGNAL_BYTES (MF__SIGNAL_WORDS * sizeof(uint64_t))

/* ---- handles ---------------------------------------------------------------------------------- */

typedef struct mf__backend_ops mf__backend_ops_t;
typedef struct mf__transport_ops mf__transport_ops_t;

/* One symmetric allocation as this process sees it (src/transport/transport.h). */
typedef struct mf__sym {
    void *local;                /* this rank's memory (== peers[rank]), zeroed at allocation */
    void *peers[MF_MAX_RANKS];  /* every rank's memory, addressable from this process */
    size_t bytes;               /* the same on every rank */
} mf__sym_t;

/* A symmetric allocation whose free waits for its comm's end (a list: mf_comm.deferred). */
typedef struct mf__deferred_free {
    void *ptr;
    struct mf__deferred_free *next;
} mf__deferred_free_t;

/* R virtual ranks of one process (mf_group_create): their comms, made on R threads through
 * mf_comm_init's path with an in-process allgather. */
struct mf_group {
    mf_backend_t backend;
    int32_t num_ranks;
    int64_t timeout_ms;                 /* resolved: bounds the in-process allgather */
    struct mf_comm **comms;             /* [R] */
    struct mf__host_barrier *barrier;   /* the in-process allgather's meeting point */
    const void *send[MF_MAX_RANKS];     /* each rank's block during an allgather */
    struct mf__group_rank *ranks;       /* [R] bootstrap contexts */
};

/* One rank. Everything the data path needs is here: the peer tables, the resolved settings. */
struct mf_comm {
    mf_backend_t backend;
    const mf__backend_ops_t *ops;
    mf_transport_t transport;           /* resolved (never AUTO) */
    const mf__transport_ops_t *tops;
    int32_t rank, num_ranks;
    int32_t device;                     /* CUDA device ordinal */
    int32_t ranks_on_device;            /* ranks of the comm sharing this rank's device (CUDA) */
    int32_t num_sms;                    /* resolved: SMs this rank's peer-waiting kernels use */
    int64_t timeout_ms;                 /* resolved */
    mf_bootstrap_t bootstrap;
    int32_t bootstrap_failed;           /* the allgather failed once: setup collectives refuse */
    void *nccl_comm;                    /* MF_TRANSPORT_NCCL: the caller's ncclComm_t */
    struct mf_group *group;             /* the group that made this comm, or NULL */
    size_t heap_declared;               /* config heap_bytes (0: sized by the first layer) */
    mf__sym_t heap;                     /* heap.peers[r]: rank r's symmetric heap (bytes 0 until sized) */
    mf__sym_t signals;                  /* signals.peers[r]: rank r's MF__SIGNAL_WORDS words */
    uint64_t epoch[MF__NUM_PHASES];     /* collectives completed per phase, same on every rank */
    uint32_t layers_made;               /* layers created so far: the next one's id (all ranks alike) */
    int32_t broken;                     /* 1 after a timeout: the group's protocol state is unknown */
    int32_t aborted;                    /* 1 after mf_comm_abort (read and written atomically) */
    mf__deferred_free_t *deferred;      /* local transport: a broken comm's symmetric memory, freed
                                         * with the comm (transport/local.c) */
    struct mf_moe *pending_dispatch;    /* layer whose mf_dispatch awaits its mf_combine, or NULL */
    int32_t device_sms;                 /* the device's SMs (CUDA; 0 on the CPU): bounds num_sms */
    int32_t default_sms;                /* num_sms as resolved at init (mf_comm_set_num_sms(0) restores it) */
    /* Exchanges in flight (the split halves; core/moe.c "exchanges"), at most MF_MAX_IN_FLIGHT, and
     * the arrivals this comm's sends made at DISPATCH and COMBINE (the same count on every rank). */
    struct mf_exchange *in_flight[MF_MAX_IN_FLIGHT];
    uint64_t sends[2];
    void *backend_state;
};

/* ---- exchanges: one dispatch + combine of a layer, in halves (docs/API.md section 16) ------------ */
/* An exchange goes IDLE -> (mf_dispatch_send) DISPATCH_SENT -> (mf_dispatch_recv) RECEIVED ->
 * (mf_combine_send) COMBINE_SENT -> (mf_combine_recv) IDLE; a failed half ends it (IDLE). From its
 * dispatch send to its end it holds a heap slot of its layer and is in comm->in_flight. */
typedef enum mf__xstate {
    MF__X_IDLE = 0,
    MF__X_DISPATCH_SENT = 1,
    MF__X_RECEIVED = 2,
    MF__X_COMBINE_SENT = 3
} mf__xstate_t;

/* The halves of one backend call (ops->dispatch / ops->combine): the one-call forms pass both. */
#define MF__HALF_SEND 1u
#define MF__HALF_RECV 2u
#define MF__HALF_BOTH (MF__HALF_SEND | MF__HALF_RECV)

struct mf_exchange {
    struct mf_moe *moe;
    int32_t state;                 /* mf__xstate_t */
    int32_t slot;                  /* the layer's heap slot while in flight */
    int32_t T;                     /* tokens of its dispatch */
    int32_t pad;
    uint64_t seq[2];               /* comm->sends at its DISPATCH and COMBINE sends: receives in this order */
    uint64_t epoch;                /* CPU backend: the epoch its last send arrived at */
    mf__heap_layout_t heap;        /* the slot's regions */
    mf_dispatch_out_t dispatch_out; /* where its rows land (given to the send) */
    mf_combine_in_t combine_in;    /* given to the combine send */
    mf_combine_out_t combine_out;
};

struct mf_moe {
    mf_comm_t comm;
    /* With defaults resolved: num_physical_experts never 0; a mapped placement's slot grid R * Ls
     * (src/plan/placement.h), empty slots included. */
    mf_moe_config_t config;
    mf_moe_info_t info;
    mf__heap_layout_t heap;
    int32_t weights_set;
    mf_moe_weights_t weights; /* borrowed */
    int32_t dispatch_T;       /* T of the dispatch whose combine is pending */
    struct mf_exchange own;   /* the exchange of mf_dispatch / mf_combine (both halves in one call) */
    uint32_t id;              /* the comm's layer number (the same on every rank): carried by syncs */
    /* Balanced EP (docs/DESIGN.md "Balanced EP"). */
    int32_t slots_per_rank;   /* Lp = P / R */
    int32_t placed;           /* 1: a mapped placement (uneven LINEAR, ROUND_ROBIN): expert_map is the
                                 placement's slot grid, fixed at create, -1 in empty slots */
    int32_t *expert_map;      /* [P] logical expert of each physical slot (identity by default) */
    int32_t map_set;          /* 1 once mf_moe_set_expert_map succeeded (needed when P != E) */
    uint32_t map_hash;        /* mf__map_hash(expert_map) */
    uint32_t weights_count;   /* mf_moe_set_weights calls so far */
    mf__sym_t spare;          /* B > 0: the spare slots of every rank (mf__spare_layout_t) */
    mf__spare_layout_t spare_layout;
    /* A staged map (mf_moe_stage_expert_map; docs/DESIGN.md "Balanced EP", rebalancing). */
    int32_t *staged_map;      /* [P] the map that serves after the switch, or NULL when none is staged */
    mf_moe_weights_t staged_weights; /* borrowed and written: this rank's slots under staged_map */
    int32_t stage_per_step;   /* n: experts each rank receives per step at most (>= 1) */
    int32_t stage_steps;      /* prefetches the stage takes (the last one switches) */
    int32_t stage_step;       /* prefetches of it done so far */
    uint32_t map_switches;    /* staged maps switched to */
    struct mf__stage_slot *stage_plan; /* [P] the schedule (src/plan/stage.h), or NULL */
    mf__sym_t stage;          /* the staging slots of every rank: [2n] experts (mf__spare_layout_t) */
    int64_t stage_bytes, stage_bytes_all, stage_local_bytes; /* moved by the last prefetch */
    mf__spare_layout_t stage_layout;
    void *backend_state;
};

/* 1 when the layer's plan runs over its expert map (the balanced plan): replicas in the map
 * (P != E), a map that was set, a mapped placement, or B > 0. 0: slot p holds expert p. */
static inline int32_t mf__moe_balanced(const struct mf_moe *m) {
    return m->config.num_physical_experts != m->config.num_experts || m->config.spare_slots > 0 || m->map_set ||
           m->placed;
}

/* ---- backend interface ------------------------------------------------------------------------ */
/* Called by src/core after validation. Collective entries are entered by every rank. */
struct mf__backend_ops {
    const char *name;
    int32_t (*available)(void);
    /* Selects the comm's device and fills `id` with a string naming it, the same in every process
     * on this host that uses the device ("" for the CPU backend). Before the transport exists. */
    mf_result_t (*device_id)(mf_comm_t comm, char id[64]);
    /* Per-rank state, once comm->ranks_on_device is known (it resolves num_sms). */
    mf_result_t (*comm_init)(mf_comm_t comm);
    void (*comm_fini)(mf_comm_t comm);
    /* Memory of symmetric allocations (the local transport's; ipc uses it on CUDA): zeroed and
     * idle when it returns (no pending work may later write it). */
    mf_result_t (*mem_alloc)(mf_comm_t comm, size_t bytes, void **ptr);
    void (*mem_free)(mf_comm_t comm, void *ptr);
    mf_result_t (*moe_init)(mf_moe_t moe);
    void (*moe_fini)(mf_moe_t moe);
    /* Optional: called after moe->weights holds newly validated, borrowed weights. */
    mf_result_t (*set_weights)(mf_moe_t moe);
    mf_result_t (*forward)(mf_moe_t moe, const mf_moe_forward_in_t *in,
                           const mf_moe_forward_out_t *out, mf_stream_t stream);
    /* The halves (MF__HALF_*) of exchange x's dispatch: SEND quantises and publishes `in` into
     * x->heap and arrives at DISPATCH (x->epoch), waiting on no peer; RECV waits for that arrival of
     * every rank, plans into the layer's plan of x->slot and lands the rows in x->dispatch_out. Both
     * at once: mf_dispatch (a backend may fuse the arrival and the wait). `in` is NULL without SEND. */
    mf_result_t (*dispatch)(mf_moe_t moe, struct mf_exchange *x, const mf_dispatch_in_t *in, uint32_t halves,
                            mf_stream_t stream);
    /* The halves of x's combine: SEND returns x->combine_in's rows to their owners' combine slots
     * (x->heap) and arrives at COMBINE; RECV waits and sums into x->combine_out. */
    mf_result_t (*combine)(mf_moe_t moe, struct mf_exchange *x, uint32_t halves, mf_stream_t stream);
    /* mf_moe_experts (not collective): validated MASKED rows of the layer's num_local_slots. */
    mf_result_t (*experts)(mf_moe_t moe, const mf_experts_in_t *in, const mf_experts_out_t *out,
                           mf_stream_t stream);
    /* A data-path call whose input this rank rejected (`code`, message already set): takes part
     * in the call's synchronisations (`phases`: a bit per mf__phase_t the call meets at) with that
     * status, so that every peer fails the call too, and writes nothing. Returns `code` with the
     * message kept (or a timeout / abort met on the way). */
    mf_result_t (*reject)(mf_moe_t moe, uint32_t phases, mf_result_t code, mf_stream_t stream);
    /* Makes this rank's waits end (mf_comm_abort); any thread, non-blocking. */
    void (*abort)(mf_comm_t comm);
    mf_result_t (*get_async_error)(mf_comm_t comm);
    mf_result_t (*get_phase_times)(mf_moe_t moe, mf_phase_times_t *times);
    /* Balanced EP; NULL where the backend has none (core answers NOT_SUPPORTED). */
    mf_result_t (*set_expert_map)(mf_moe_t moe); /* after moe->expert_map changed */
    mf_result_t (*prefetch)(mf_moe_t moe, mf_stream_t stream);
    mf_result_t (*get_balance_stats)(mf_moe_t moe, mf_moe_balance_stats_t *stats);
    /* Rebalancing; NULL where the backend cannot move weights (core answers NOT_SUPPORTED). One
     * step of the staged map's moves (moe->stage_step of them done before it, src/plan/stage.h),
     * in mf_moe_prefetch before the spare-slot step. The last one (stage_step + 1 == stage_steps)
     * also switches the backend's own copy of the map to moe->staged_map and its weights to
     * moe->staged_weights (ordered on the stream, no host wait); core then switches its state. */
    mf_result_t (*stage_step)(mf_moe_t moe, mf_stream_t stream);
    /* Optional: a stage of `map` [P] is about to start (blocking, every rank; nothing in flight
     * reads what it prepares, e.g. a device copy of the map that the last step installs). */
    mf_result_t (*stage_begin)(mf_moe_t moe, const int32_t *map);
    /* Optional (NULL: the backend runs every call to completion and takes no events): the split
     * halves' events, makes the stream wait for `event` (record = 0) or records it (record = 1). */
    mf_result_t (*event)(mf_comm_t comm, mf_event_t event, int32_t record, mf_stream_t stream);
};

extern const mf__backend_ops_t mf__cpu_backend;
#if MF_WITH_CUDA
extern const mf__backend_ops_t mf__cuda_backend;
#endif

/* ---- host barrier (setup collectives only) ---------------------------------------------------- */
struct mf__host_barrier;
mf_result_t mf__host_barrier_create(struct mf__host_barrier **barrier, int32_t count);
void mf__host_barrier_destroy(struct mf__host_barrier *barrier);
/* Waits until `count` threads arrived or `timeout_ms` passed (MF_ERR_TIMEOUT naming `what`). */
mf_result_t mf__host_barrier_wait(struct mf__host_barrier *barrier, int64_t timeout_ms,
                                  int32_t rank, const char *what);

/* ---- small helpers ---------------------------------------------------------------------------- */
size_t mf__dtype_size(int32_t dtype);
const char *mf__dtype_name(int32_t dtype);
static inline size_t mf__align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
static inline int64_t mf__ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

#ifdef __cplusplus
}
#endif

#endif /* MF_CORE_INTERNAL_H */
