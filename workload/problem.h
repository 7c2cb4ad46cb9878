/*
 * problem.h — random EP MoE problems and the R-rank driver (threads or processes) that runs them through the public
 * API; shared by the tests and the `moeflow` CLI (workload/: neither includes the other).
 *
 * A problem holds, for every rank, its tokens, routing and local experts' weights in host memory,
 * generated from a seed (never zeros). `mfp_run_forward` creates a local group on a backend, one
 * thread per rank, each creating its layer, setting its weights (copied to the device on CUDA)
 * and calling mf_moe_forward `iters` times, and returns the y of the last call per rank.
 */
#ifndef MF_WORKLOAD_PROBLEM_H
#define MF_WORKLOAD_PROBLEM_H

#include <pthread.h>
#include <stdint.h>

#include "moeflow.h"
#include "ref.h"

typedef enum mfp_routing {
    MFP_ROUTING_UNIFORM = 0, /* K distinct experts uniformly at random per token */
    MFP_ROUTING_ZIPF = 1,    /* K distinct experts drawn with P(e) ~ 1 / (rank(e) + 1)^zipf_s, where
                                rank(e) is e's place in a popularity order shuffled from the seed */
    MFP_ROUTING_HOT = 2      /* every token picks expert hot_expert (at a random k), the rest uniform */
} mfp_routing_t;

typedef struct mfp_spec {
    int32_t R, E, K, H, I, S;
    int32_t dtype, layout, ue8m0;
    int32_t T_per_rank;     /* T on every rank unless T_of_rank is set */
    const int32_t *T_of_rank; /* optional [R]: per-rank T (idle ranks: 0) */
    int32_t routing;        /* mfp_routing_t */
    double zipf_s;
    int32_t hot_expert;
    double drop_prob;       /* probability of a -1 id per (t, k) */
    uint64_t seed;
    /* Layer config passed through to mf_moe_config_t (0 = the library's default, worst case). */
    int32_t block_m, expert_capacity, max_recv_rows;
    int32_t placement;      /* mf_placement_t of the layer (E need not be a multiple of R) */
} mfp_spec_t;

/* Where the experts are. The problem holds rank r's weights as the LINEAR placement gives them to
 * it (uneven when R does not divide E: the first E % R ranks one expert more), whatever
 * spec.placement says; mfp_run lays out each rank's experts of spec.placement (or of an expert
 * map) from them. These follow docs/API.md's rules, written here independently of the library. */
int32_t mfp_rank_experts(const mfp_spec_t *s, int32_t placement, int32_t r);          /* L_r */
int32_t mfp_rank_expert(const mfp_spec_t *s, int32_t placement, int32_t r, int32_t l); /* global id, -1 past L_r */
int32_t mfp_expert_rank(const mfp_spec_t *s, int32_t placement, int32_t e);           /* the rank holding e */

typedef struct mfp_problem {
    mfp_spec_t spec;
    int32_t L;               /* the most experts a rank holds: ceil(E / R) (E / R when R | E) */
    int32_t *T;              /* [R] */
    uint16_t **x;            /* [R] -> [T_r, H] */
    int32_t **topk_ids;      /* [R] -> [T_r, K] */
    float **topk_weights;    /* [R] -> [T_r, K] */
    void **w13, **w2;        /* [R] -> [L_r] LINEAR local experts' weights in the layer's dtype */
    float **w13_scales, **w2_scales; /* [R] (FP8) */
    mfref_problem_t ref;     /* views of the above for mfref_layer */
} mfp_problem_t;

/* Values: x ~ N(0, 1) (a sum of four uniforms) as bf16, weights ~ U(-1, 1) * sqrt(3 / fan_in) so
 * that g, u, h, partials and y are O(1); no value is zero; topk_weights > 0, summing to 1 per token.
 * FP8 weights are drawn as BF16 and quantised by mf_quantize_fp8 (128x128 blocks, fp32 scales).
 * Expert e's weights depend only on (seed, e) and rank r's inputs only on (seed, r), so the routing
 * is the same for both dtypes. spec->S <= 0 resolves to the largest T (at least 1) in p->spec.
 * The weights are drawn by several threads (deterministic: one stream per expert). */
int mfp_generate(const mfp_spec_t *spec, mfp_problem_t *p); /* 0 ok, -1 no memory / bad spec */
void mfp_free(mfp_problem_t *p);                             /* zeroes *p; a zeroed p is a no-op */
/* Re-draws activations and routing (same shapes) from `seed`, keeping the weights. */
int mfp_redraw_inputs(mfp_problem_t *p, uint64_t seed);
/* Sets T = T_per_rank on every rank and re-draws the inputs from `seed`, keeping the weights (for
 * size sweeps; S is unchanged). 0 ok, -1 no memory / bad T. */
int mfp_set_tokens(mfp_problem_t *p, int32_t T_per_rank, uint64_t seed);
/* Routed (t, k) rows over all ranks; per rank (the rank holding the expert under spec.placement,
 * [R]) and per expert ([E]) when the arrays are not NULL. */
int64_t mfp_count_rows(const mfp_problem_t *p, int64_t *rows_per_rank, int64_t *rows_per_expert);
/* The same layer and tokens on one rank (R = 1, the identity placement): every rank's tokens in rank
 * order (token t of rank r is token T_0 + .. + T_{r-1} + t), every expert's weights, S = the total
 * (at least 1). y of a token does not depend on the rank that held it nor on the placement: a
 * bit-identity reference. 0 ok, -1 no memory; `one` is freed with mfp_free. */
int mfp_gather_ranks(const mfp_problem_t *p, mfp_problem_t *one);

/* Timing of mfp_run: times are wall clock from a common start (all ranks leave a barrier), to the
 * end of mf_moe_forward (CPU) or of the stream synchronisation after it (CUDA). */
#define MFP_TIMES (MF_NUM_PHASES + 1) /* phases, then the total */
typedef struct mfp_timing {
    double forward_ms;    /* median wall time of one mf_moe_forward over the iterations (rank 0) */
    double setup_ms;      /* group + layer creation + weights */
    double forward_max_ms; /* median over the iterations of the slowest rank's time */
    int32_t have_phases;  /* 1 when phase_us / phase_max_us are filled (profile = 1) */
    /* mf_moe_get_phase_times: [MF_NUM_PHASES] per phase, then total_us; medians over the timed
     * iterations, of rank 0 and of the max over ranks. */
    double phase_us[MFP_TIMES];
    double phase_max_us[MFP_TIMES];
    double phase_rank_us[MF_MAX_RANKS][MFP_TIMES]; /* medians of each rank's own times */
    /* CUDA with profile: when each rank's forward began on the device, after the earliest rank's
     * begin in the same iteration (median over iterations, us); with phase_rank_us, a timeline of
     * the ranks that time-share one GPU. -1 where not measured. */
    double rank_start_us[MF_MAX_RANKS];
    /* Balanced EP (opts.num_physical / spare_slots / expert_map) or a placement other than LINEAR
     * with R | E: rank 0's mf_moe_get_balance_stats after the last forward; the weight bytes all
     * ranks moved in the first prefetch and in the last one; the mean wall time of rank 0's
     * prefetches (ms). */
    int32_t have_balance;
    mf_moe_balance_stats_t balance;
    int64_t prefetch_first_bytes, prefetch_last_bytes;
    double prefetch_ms;
    /* With stage_map: the forwards served while the stage was in flight (old map) and the others,
     * medians of rank 0's wall time and of the slowest rank's (ms; only iterations below
     * MFP_STAGE_ITERS are classified); the stage's prefetch calls, their mean wall time (rank 0,
     * ms, synchronised) and the most weight bytes all ranks pushed in one of them. */
    int32_t stage_forwards, stage_steps;
    double stage_forward_ms, stage_forward_max_ms, plain_forward_ms, plain_forward_max_ms, stage_prefetch_ms;
    int64_t stage_step_bytes_max, stage_bytes_total;
} mfp_timing_t;

#define MFP_STAGE_ITERS 4096

/* How mfp_run drives the layer. */
typedef struct mfp_run_opts {
    mf_backend_t backend; /* CPU, CUDA or AUTO (CUDA when this build has it and finds a device) */
    int32_t iters;        /* timed forwards, >= 1 */
    int32_t warmup;       /* untimed forwards before them */
    int64_t timeout_ms;   /* group config timeout_ms; 0 = the library's default */
    int32_t profile;      /* 1: config.profile = 1 and timing.phase_* filled */
    int32_t dataflow;     /* config.dataflow (mf_dataflow_t) */
    int32_t gated;        /* CUDA: hold each rank's stream until its whole forward is enqueued, so
                             the device runs it back to back, as a CUDA graph replay would (the
                             time without host launch gaps) */
    /* Optional: called by rank 0's thread after each forward with (done, warmup + iters). */
    void (*progress)(void *ctx, int32_t done, int32_t total);
    void *progress_ctx;
    /* MF_TRANSPORT_LOCAL: one process, a group of R virtual ranks (mf_group_create), a thread each.
     * MF_TRANSPORT_IPC: R processes forked from this one, each one rank through the built-in
     * rendezvous and mf_comm_init; the problem is shared copy-on-write, the outputs and times come
     * back through shared memory. This process must not have used CUDA yet (forked children
     * cannot use a parent's CUDA context): resolve the backend with mfp_probe_backend. */
    int32_t transport;
    /* MF_TRANSPORT_NCCL: processes as for IPC, each rank also making an ncclComm (rank 0 draws the
     * unique id and hands it over in the run's shared memory; libnccl.so.2 is opened at run time)
     * and passing it to mf_comm_init as its bootstrap and memory path. CUDA only; NCCL refuses two
     * ranks on one device, so R <= the devices visible.
     * Devices: rank processes (IPC, NCCL) take device r % (devices visible to them), one GPU per
     * rank where there are R; virtual ranks (LOCAL) all run on device 0 (mf_group_create places a
     * group on one device). */
    /* IPC / NCCL fault injection for tests: rank `die_rank` kills itself (SIGKILL) at iteration
     * `die_at` (counting warm-up): before its call (die_mid 0), or right after its call was
     * launched (die_mid 1: on CUDA its stream is held until then, so the kill always lands with
     * the call enqueued and not run while its peers are inside it); -1 = nobody. */
    int32_t die_rank, die_at, die_mid;
    int32_t op;        /* mfp_op_t: the whole layer, or dispatch + combine alone */
    /* FORWARD, CUDA: capture the rank's forward into a CUDA graph once (before the first
     * iteration) and replay it every iteration; with redraw, the new inputs are copied into the
     * captured tensors first. Not with profile or gated. */
    int32_t graph;
    /* Iteration it (counting warm-up) runs on inputs redrawn from seed redraw_seed + it (same T
     * per rank, same weights; mfp_draw_rank_inputs); 0 = the problem's inputs every time. */
    int32_t redraw;
    uint64_t redraw_seed;
    /* Optional [R * (warmup + iters) * 2]: per rank and iteration, a 64-bit digest (FNV-1a) of
     * {DISPATCH_COMBINE: the dispatch outputs (counts, offsets, and every real row's source,
     * payload and scales); FORWARD: 0} and of y. For comparing runs bit for bit, call by call. */
    uint64_t *digests;
    /* Optional [R]: each rank's final code (MF_SUCCESS, the error its first failing call
     * returned, or MF_ERR_SYSTEM for a rank process that died); filled on failure too. */
    mf_result_t *rank_results;
    /* Balanced EP: an expert map of num_physical slots (NULL: the identity, num_physical 0 = E);
     * every rank's weights are laid out from it (slot l of rank r holds the problem's logical
     * expert map[r * P / R + l]). spare_slots = B; prefetch = 1 calls mf_moe_prefetch before every
     * forward but the first (FORWARD only). */
    const int32_t *expert_map;
    int32_t num_physical, spare_slots, prefetch;
    /* Rebalancing (mf_moe_stage_expert_map; needs prefetch = 1): before the prefetch of iteration
     * stage_at (>= 1, counting warm-up), every rank stages stage_map [num_physical] with
     * stage_per_step experts per step, into next_weights the run allocates (poisoned first); at
     * the end each rank checks them byte for byte against the problem's experts of stage_map and
     * that the map switched (a mismatch fails the run, naming the slot). NULL: no stage. */
    const int32_t *stage_map;
    int32_t stage_at, stage_per_step;
    /* FORWARD, CUDA, with profile: 1 = no events between the phases (config.profile = 0), only one
     * before and one after each rank's forward on its stream: timing.phase_*[MF_NUM_PHASES] is that
     * device time and the phases are 0. An event between two kernels also ends a programmatic
     * dependent launch there (docs/DESIGN.md "Performance doctrine"), so phase events cost the
     * forward what they measure; this is the total as a graph replay runs it. */
    int32_t no_phases;
    /* The layer's capacity S (config.max_tokens_per_rank) for this run: 0 = spec.S; else >= every
     * rank's T. The buffers a layer sizes by S (symmetric heap, receive tensor, routing copies) and
     * the plan variant (the small plan fits R S K <= 4096 entries) follow it; the problem's inputs
     * do not depend on it (`moeflow bench -S 512,4096` times one T at two capacities). */
    int32_t max_tokens;
} mfp_run_opts_t;

/* What each rank calls per iteration. */
typedef enum mfp_op {
    MFP_OP_FORWARD = 0, /* mf_moe_forward; phases from mf_moe_get_phase_times */
    /* mf_dispatch, then mf_combine of expert outputs that are a function of each received row:
     * with digests set, expert_out[row][h] = bf16(received value + identity(source, h)) computed
     * on the host between the two calls (a misrouted row or payload changes y); without, a fixed
     * device buffer (nothing between the calls: for timing). With profile, phase DISPATCH holds the
     * dispatch's device time on the rank's stream (events around the call), COMBINE the
     * combine's, total their sum; the other phases 0. */
    MFP_OP_DISPATCH_COMBINE = 1,
    /* mf_dispatch, mf_moe_experts on the received rows, mf_combine: the layer split as vLLM's
     * modular kernel runs it (MASKED layouts; no digests, no profile). y is the forward's. */
    MFP_OP_SPLIT = 2
} mfp_op_t;

#define MFP_RUN_OPTS_INIT                                                                                \
    {MF_BACKEND_AUTO, 1, 0, 0, 0, MF_DATAFLOW_AUTO, 0, NULL, NULL, MF_TRANSPORT_LOCAL, -1, -1, 0, MFP_OP_FORWARD, \
     0, 0, 0, NULL, NULL, NULL, 0, 0, 0, NULL, 0, 0, 0, 0}

/* Draws rank r's inputs for `seed` (as mfp_redraw_inputs would, for that rank alone) into x
 * [T_r, H], topk_ids [T_r, K], topk_weights [T_r, K] (host). 0 ok, -1 no memory. */
int mfp_draw_rank_inputs(const mfp_problem_t *p, int32_t r, uint64_t seed, uint16_t *x, int32_t *topk_ids,
                         float *topk_weights);

/* CUDA devices visible, asked in a forked child (this process never touches CUDA); 0 without
 * CUDA or a device. */
int32_t mfp_probe_device_count(void);

/* What a process that runs virtual ranks of one GPU should set before its first CUDA call (the
 * library sets no environment variable; docs/API.md "Virtual ranks on one GPU"): one hardware
 * queue per stream (CUDA_DEVICE_MAX_CONNECTIONS=32) and modules loaded eagerly
 * (CUDA_MODULE_LOADING=EAGER), each unless the user already set it; and NVLink multicast off in
 * the NCCL comms of the nccl transport (NCCL_NVLS_ENABLE=0, always). The test runner and the CLI
 * call it first thing. */
void mfp_cuda_env(void);

/* A barrier of rank threads, or of rank processes when it lives in shared memory (process-shared),
 * that a failing rank breaks (mfp_barrier_break) so that nobody waits for it; a wait longer than
 * timeout_ms breaks it too. */
typedef struct mfp_barrier {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t count, arrived, failed;
    uint64_t generation;
    int64_t timeout_ms;
} mfp_barrier_t;

void mfp_barrier_init(mfp_barrier_t *b, int32_t count, int64_t timeout_ms);
void mfp_barrier_fini(mfp_barrier_t *b);
/* 0 when all arrived, -1 when the barrier is broken or its wait expired (which breaks it). */
int mfp_barrier_wait(mfp_barrier_t *b);
void mfp_barrier_break(mfp_barrier_t *b);

/* The backend that `backend` means here (AUTO resolved, as mf_group_create would). */
mf_backend_t mfp_resolve_backend(mf_backend_t backend);
/* The same, asked in a forked child, so that this process never touches CUDA (for IPC runs). */
mf_backend_t mfp_probe_backend(mf_backend_t backend);

/* Runs the problem as `opts` says; fills y[r] ([T_r, H], host memory; NULL allowed where T_r = 0)
 * with the last forward's output. Returns MF_SUCCESS or the first failing rank's code; err[errlen]
 * (err may be NULL) then holds "rank r: " and that rank's mf_last_error(), prefixed with the
 * call's name unless it starts with it (a rank process that died: MF_ERR_SYSTEM naming its
 * signal, unless a survivor failed first). A failing rank may leave the others waiting inside a
 * collective until the timeout. timing may be NULL. */
mf_result_t mfp_run(const mfp_problem_t *p, const mfp_run_opts_t *opts, uint16_t *const *y,
                    mfp_timing_t *timing, char *err, int errlen);

/* Runs the problem on `backend` (group config `timeout_ms`, 0 = default); fills y[r] ([T_r, H]).
 * Returns MF_SUCCESS or the first failing rank's code (message copied into err[errlen]).
 * Same as mfp_run with no warm-up and no profiling. */
mf_result_t mfp_run_forward(const mfp_problem_t *p, mf_backend_t backend, int32_t iters,
                            int64_t timeout_ms, uint16_t *const *y, mfp_timing_t *timing,
                            char *err, int errlen);

#endif /* MF_WORKLOAD_PROBLEM_H */
