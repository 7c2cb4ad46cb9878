/*
 * internal.h — what every part of the library shares: the handle structs behind the opaque public
 * types, the backend interface, the error macros and the symmetric-heap layout.
 *
 * Layering (DESIGN.md): src/core validates every public call on the host and then calls the group's
 * backend (src/cpu or src/cuda) through `mf__backend_ops`. A backend may assume its inputs passed
 * validation: shapes, dtypes and non-NULL data are checked here, once.
 *
 * Dimension legend: T tokens on this rank in this call, S capacity, H hidden, I intermediate,
 * E experts, R ranks, L = E / R local experts, K top-k, C masked expert capacity.
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

/* ---- allocation (host): one place, with a failure switch for tests ---------------------------- */

void *mf__malloc(size_t bytes);
void *mf__calloc(size_t count, size_t bytes);
void mf__free(void *p);
/* Test hook: the n-th host allocation from now on fails (1 = the next); 0 disables. */
void mf__test_fail_alloc_after(int64_t n);

/* ---- tunables: every environment variable is read in params.c ---------------------------------- */

int64_t mf__param_timeout_ms(void); /* MF_TIMEOUT_MS, default 30000 */

/* ---- limits and alignments -------------------------------------------------------------------- */

#define MF__DEFAULT_BLOCK_M 128   /* EXPERT_MAJOR segment alignment */
#define MF__HEAP_ALIGN 256        /* every symmetric-heap region starts at a multiple of this */
#define MF__VEC_ELEMS_BF16 8      /* 16-byte rows: H and I multiples of 8 in BF16 */
#define MF__ROW_ALIGN 16          /* row tensors' data pointers: 16-byte vector loads and stores */

/* Collective phases of the data path; each has its own column of epoch signals. (Setup
 * collectives, mf_moe_create, meet at the group's host barrier instead.) */
typedef enum mf__phase {
    MF__PHASE_DISPATCH = 0, /* every rank has published x, scales, ids, weights, T */
    MF__PHASE_COMBINE = 1,  /* every rank has written its partials into the owners' slots */
    MF__PHASE_ABORT = 2,    /* every rank has finished reading peers after a failed plan */
    MF__NUM_PHASES = 3
} mf__phase_t;

const char *mf__phase_name(int phase);

/* ---- symmetric heap layout (identical on every rank; DESIGN.md "Symmetric heap") -------------- */
/* Every region is aligned to MF__HEAP_ALIGN:
 *   meta:     1 x int32              T of this rank's current call
 *   x:        S x H x (1 or 2) bytes published activations, FP8 (1 byte) or BF16 (2 bytes)
 *   scales:   S x H/128 x fp32       FP8 only: 1x128 activation scales
 *   ids:      S x K x int32          published topk_ids (-1 = skip)
 *   weights:  S x K x fp32           published topk_weights
 *   combine:  S x K x H x bf16       slots the experts' ranks write partials into, at (token, k)
 */
typedef struct mf__heap_layout {
    size_t meta, x, scales, ids, weights, combine;
    size_t bytes; /* total */
} mf__heap_layout_t;

void mf__heap_layout_init(mf__heap_layout_t *layout, const mf_moe_config_t *config);

/* ---- handles ---------------------------------------------------------------------------------- */

typedef struct mf__backend_ops mf__backend_ops_t;

struct mf_group {
    mf_backend_t backend;
    int32_t num_ranks;
    int32_t device;
    int32_t num_sms;    /* per rank, resolved */
    int64_t timeout_ms; /* resolved */
    const mf__backend_ops_t *ops;
    void *backend_state;
    struct mf_comm *comms; /* [R] */
    /* Peer tables of the local transport: every rank's symmetric heap and signal array. */
    void *heap_base[MF_MAX_RANKS];
    void *signal_base[MF_MAX_RANKS];
    /* Host barrier for setup-time collectives (mf_moe_create); not on the data path. */
    struct mf__host_barrier *setup_barrier;
    /* mf_moe_create's exchange, read after each of its two barriers: every rank's resolved config
     * and validation result (barrier 1), and its heap/backend result (barrier 2). */
    mf_moe_config_t setup_config[MF_MAX_RANKS];
    mf_result_t setup_result[MF_MAX_RANKS];
    mf_result_t create_result[MF_MAX_RANKS];
};

struct mf_comm {
    mf_group_t group;
    int32_t rank;
    int32_t ready;              /* comm_init succeeded (for cleanup) */
    size_t heap_bytes;          /* size of this rank's heap */
    uint64_t epoch[MF__NUM_PHASES]; /* collectives completed per phase, same on every rank */
    int32_t broken;             /* 1 after a timeout: the group's protocol state is unknown */
    struct mf_moe *pending_dispatch; /* layer whose dispatch awaits its combine, or NULL */
    void *backend_state;
};

struct mf_moe {
    mf_comm_t comm;
    mf_moe_config_t config; /* with defaults resolved */
    mf_moe_info_t info;
    mf__heap_layout_t heap;
    int32_t weights_set;
    mf_moe_weights_t weights; /* borrowed */
    int32_t dispatch_T;       /* T of the dispatch whose combine is pending */
    void *backend_state;
};

/* ---- backend interface ------------------------------------------------------------------------ */
/* Called by src/core after validation. Collective entries are entered by every rank's thread. */
struct mf__backend_ops {
    const char *name;
    int32_t (*available)(void);
    mf_result_t (*group_init)(mf_group_t group);
    void (*group_fini)(mf_group_t group);
    /* Per-rank state, the signal array (zeroed) and an empty heap. */
    mf_result_t (*comm_init)(mf_comm_t comm);
    void (*comm_fini)(mf_comm_t comm);
    /* (Re)allocates this rank's heap with `bytes`; the caller publishes it in group->heap_base. */
    mf_result_t (*heap_resize)(mf_comm_t comm, size_t bytes, void **base);
    mf_result_t (*moe_init)(mf_moe_t moe);
    void (*moe_fini)(mf_moe_t moe);
    /* Optional: called after moe->weights holds newly validated, borrowed weights. */
    mf_result_t (*set_weights)(mf_moe_t moe);
    mf_result_t (*forward)(mf_moe_t moe, const mf_moe_forward_in_t *in,
                           const mf_moe_forward_out_t *out, mf_stream_t stream);
    mf_result_t (*dispatch)(mf_moe_t moe, const mf_dispatch_in_t *in, const mf_dispatch_out_t *out,
                            mf_stream_t stream);
    mf_result_t (*combine)(mf_moe_t moe, const mf_combine_in_t *in, const mf_combine_out_t *out,
                           mf_stream_t stream);
    mf_result_t (*get_async_error)(mf_comm_t comm);
    mf_result_t (*get_phase_times)(mf_moe_t moe, mf_phase_times_t *times);
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
