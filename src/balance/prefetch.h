/*
 * prefetch.h — balanced EP on the device (CUDA): the planner of planner.h in CUDA kernels, the
 * prefetch's kernel chain (pick, push, commit) and the plan's test hooks (docs/DECISIONS.md
 * "Balanced EP", phase 2). C linkage and
 * no CUDA types, so that the C test suite can call it; the stream is a cudaStream_t as void *.
 *
 * Dimension legend: E logical experts, R ranks, P physical slots, B spare slots per rank,
 * N = P + R * B replica entries.
 */
#ifndef MF_BALANCE_PREFETCH_H
#define MF_BALANCE_PREFETCH_H

#include <stdint.h>

#include "moeflow.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The balanced plan's variant for the forwards launched from now on (a test hook, default 0):
 * 0 = mf__balance_plan_par over the plan block's threads, 1 = the serial functions on thread 0. */
extern int32_t mf__cuda_plan_serial;

/* The plan without balancing for the forwards launched from now on (a test hook, default 1): 1 =
 * the small plan (the DISPATCH sync and the plan in one block, movement.cuh) where it fits, 0 =
 * always the sync kernel and the three plan kernels. */
extern int32_t mf__cuda_plan_small;

/* mf__balance_plan_par in one block of kMfPlanThreads threads, for tests: inputs map [P] (-1 =
 * an empty slot), spare [R * B], counts [E], placement (home ranks), outputs slot_count,
 * slot_begin, slot_expert [Lp + B], verdict [2] (failing rank, replica), load and home [R] int64;
 * every pointer DEVICE memory. MF_ERR_CUDA if the launch fails. */
mf_result_t mf__cuda_plan_par_test(int32_t E, int32_t R, int32_t P, int32_t B, int32_t placement, int32_t me,
                                   int32_t masked, int32_t block_m, int32_t capacity, int32_t max_rows,
                                   const int32_t *map, const int32_t *spare, const int32_t *counts,
                                   int32_t *slot_count, int32_t *slot_begin, int32_t *slot_expert, int32_t *verdict,
                                   int64_t *load, int64_t *home, void *stream);

/* One call of mf__balance_pick; every pointer is DEVICE memory. */
typedef struct mf__balance_pick_params {
    int32_t E, R, P, B;
    const int32_t *counts;   /* [E] the previous forward's global counts */
    const int32_t *map;      /* [P] */
    const int32_t *resident; /* [R * B] the spare table now (-1 = empty), or NULL */
    int32_t *spare;          /* [R * B] out: the next table */
    int32_t *scratch;        /* [mf__balance_scratch_words(E, R, P, B)] int32 words */
} mf__balance_pick_params_t;

/* int32 words of scratch one pick needs (replica lists, shares, loads, candidates' scratch). */
int64_t mf__balance_scratch_words(int32_t E, int32_t R, int32_t P, int32_t B);

/* Runs the pick on `stream` (one thread: the simulation is sequential; a block-parallel version
 * is phase 2's). Asynchronous, graph-capturable; MF_ERR_CUDA if the launch fails. */
mf_result_t mf__cuda_balance_pick(const mf__balance_pick_params_t *params, void *stream);

/* One mf_moe_prefetch of a layer on CUDA (docs/DESIGN.md "Balanced EP"): every pointer is DEVICE
 * memory (spare[q]: rank q's spare allocation as this process addresses it). */
typedef struct mf__prefetch_params {
    int32_t E, R, P, B, Lp, rank;
    const int32_t *map;          /* [P] the expert map */
    const int32_t *prev_counts;  /* [E] the last forward's global counts */
    const int32_t *have_prev;    /* 0 until a forward planned: the table stays as it is */
    int32_t *resident;           /* [R * B] the spare table (-1 = empty), updated by the commit */
    int32_t *next;               /* [R * B] the table this prefetch computes */
    uint32_t *weights_seen;      /* the weights count the resident table was pushed from */
    uint32_t weights_count;      /* the host's count now: a different one empties the table first */
    int32_t *scratch;            /* [mf__balance_scratch_words] (the pick runs on it in shared memory) */
    const uint8_t *w13, *w13_scales, *w2, *w2_scales; /* this rank's weights [Lp, ...] (scales: FP8) */
    uint8_t *spare[MF_MAX_RANKS];  /* every rank's spare allocation (mf__spare_layout_t) */
    uint64_t off_w13, off_w13_scales, off_w2, off_w2_scales;     /* the layout's offsets */
    uint64_t bytes_w13, bytes_w13_scales, bytes_w2, bytes_w2_scales; /* one slot of each */
    int64_t *stats;              /* out: [3] bytes this rank pushed, bytes all ranks pushed, slots resident */
} mf__prefetch_params_t;

/* Bytes of dynamic shared memory the prefetch's pick kernel uses (0: it does not fit in one SM's
 * shared memory; the caller refuses such a layer). */
size_t mf__prefetch_smem_bytes(int32_t E, int32_t R, int32_t P, int32_t B);

/* Loads the prefetch kernels and sets the pick kernel's shared-memory limit (setup time). */
mf_result_t mf__cuda_prefetch_preload(size_t smem_bytes);

/* The prefetch's kernel chain on `stream`: pick (one block: a weights change empties the table;
 * without a planned forward the table stays; else mf__balance_pick on prev_counts), push (every
 * table entry that changed, by the rank holding its expert's first static replica, into the
 * destination's spare slot through the peer pointers; a system fence), commit (the table becomes
 * the resident one; stats). No host synchronisation, graph-capturable; MF_ERR_CUDA if a launch
 * fails. */
mf_result_t mf__cuda_prefetch(const mf__prefetch_params_t *params, size_t smem_bytes, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MF_BALANCE_PREFETCH_H */
