/*
 * test_transport.c — ranks as processes and comms made one per rank (CPU backend): the ipc
 * transport bit-identical to the local one and to the oracle, mf_comm_init over a caller's own
 * allgather, the checks every rank agrees on at init and at layer creation, and the fault model
 * across processes (a rank that dies, a bad id on one rank, an abort).
 *
 * Rank processes are forked by the test (spawn_ranks) or by mfp_run (opts.transport = IPC); each
 * meets the others through the built-in rendezvous. A process that outlives its parent is killed
 * (PR_SET_PDEATHSIG), and every test reaps all its children before it returns.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "problem.h"
#include "ref.h"

#define TR_TIMEOUT_MS 20000 /* peer waits where nothing should time out */
#define TR_SHORT_MS 500     /* peer waits that are meant to expire */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static mfp_spec_t small_spec(int32_t R, int32_t dtype, int32_t layout, uint64_t seed) {
    mfp_spec_t s;
    memset(&s, 0, sizeof s);
    s.R = R, s.E = 4 * R, s.K = 3, s.H = 256, s.I = 128, s.S = 12, s.T_per_rank = 12;
    s.dtype = dtype, s.layout = layout, s.routing = MFP_ROUTING_UNIFORM, s.zipf_s = 1.2, s.seed = seed;
    return s;
}

/* y of every rank against the fp64 reference: the diff measure and the element-wise bounds. */
static int check_ref(const mfp_problem_t *p, uint16_t *const *y) {
    const int32_t R = p->spec.R, fp8 = p->spec.dtype == MF_DTYPE_FP8_E4M3;
    uint16_t *ref[MF_MAX_RANKS];
    for (int32_t r = 0; r < R; r++) ref[r] = mft_alloc((size_t)p->T[r] * p->spec.H * 2);
    MFT_CHECK(mfref_layer(&p->ref, ref) == 0);
    int rc = 0;
    for (int32_t r = 0; r < R && !rc; r++) {
        const int64_t n = (int64_t)p->T[r] * p->spec.H;
        double diff = mfref_diff_bf16(y[r], ref[r], n), worst = 0;
        int64_t wrong = mfref_count_wrong_bf16(y[r], ref[r], n, fp8 ? MFREF_ATOL_FP8 : MFREF_ATOL_BF16,
                                               fp8 ? MFREF_RTOL_FP8 : MFREF_RTOL_BF16, NULL, &worst);
        if (wrong || !(diff < (fp8 ? MFREF_DIFF_MAX_FP8 : MFREF_DIFF_MAX_BF16)))
            rc = mft_fail(__FILE__, __LINE__, "rank %d: %lld elements outside the bounds, diff %.3g", (int)r,
                          (long long)wrong, diff);
    }
    for (int32_t r = 0; r < R; r++) free(ref[r]);
    return rc;
}

/* The same problem on R threads (local) and on R processes (ipc): y bit for bit, and the oracle
 * within the reference's bounds. */
static int ipc_vs_local(const mfp_spec_t *spec, int32_t iters) {
    mfp_problem_t p;
    MFT_CHECK(mfp_generate(spec, &p) == 0);
    const int32_t R = p.spec.R;
    uint16_t *y_local[MF_MAX_RANKS], *y_ipc[MF_MAX_RANKS];
    for (int32_t r = 0; r < R; r++) {
        y_local[r] = mft_alloc((size_t)p.T[r] * p.spec.H * 2);
        y_ipc[r] = mft_alloc((size_t)p.T[r] * p.spec.H * 2);
        mft_poison(y_ipc[r], (size_t)p.T[r] * p.spec.H * 2);
    }
    mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
    o.backend = MF_BACKEND_CPU;
    o.iters = iters;
    o.timeout_ms = TR_TIMEOUT_MS;
    char err[512];
    MFT_CHECK_MSG(mfp_run(&p, &o, y_local, NULL, err, sizeof err) == MF_SUCCESS, "local: %s", err);
    o.transport = MF_TRANSPORT_IPC;
    MFT_CHECK_MSG(mfp_run(&p, &o, y_ipc, NULL, err, sizeof err) == MF_SUCCESS, "ipc: %s", err);
    for (int32_t r = 0; r < R; r++)
        MFT_CHECK_MSG(memcmp(y_local[r], y_ipc[r], (size_t)p.T[r] * p.spec.H * 2) == 0,
                      "rank %d: ipc y differs from local y (R = %d, T = %d)", (int)r, (int)R, (int)p.T[r]);
    int rc = check_ref(&p, y_ipc);
    for (int32_t r = 0; r < R; r++) free(y_local[r]), free(y_ipc[r]);
    mfp_free(&p);
    return rc;
}

static int test_ipc_bitwise(void) {
    /* R = 2, 4, 8 processes; both dtypes and layouts; uneven T with idle ranks; drops; skew. */
    static const int32_t T4[4] = {5, 0, 12, 1};
    static const int32_t T8[8] = {0, 3, 12, 7, 0, 1, 9, 4};
    mfp_spec_t a = small_spec(2, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, 11);
    mfp_spec_t b = small_spec(4, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, 12);
    b.T_of_rank = T4;
    b.drop_prob = 0.1;
    mfp_spec_t c = small_spec(8, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, 13);
    c.T_of_rank = T8;
    c.routing = MFP_ROUTING_ZIPF;
    mfp_spec_t d = small_spec(8, MF_DTYPE_BF16, MF_LAYOUT_MASKED, 14);
    d.routing = MFP_ROUTING_HOT;
    if (ipc_vs_local(&a, 2) || ipc_vs_local(&b, 2) || ipc_vs_local(&c, 1) || ipc_vs_local(&d, 1)) return 1;
    return 0;
}

/* Rank 2 of 4 processes dies before its second forward: the others fail with MF_ERR_TIMEOUT
 * within their timeout (no hang), and every process is reaped. */
static int test_ipc_rank_dies(void) {
    mfp_spec_t spec = small_spec(4, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, 21);
    mfp_problem_t p;
    MFT_CHECK(mfp_generate(&spec, &p) == 0);
    uint16_t *y[4];
    for (int r = 0; r < 4; r++) y[r] = mft_alloc((size_t)p.T[r] * p.spec.H * 2);
    mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
    o.backend = MF_BACKEND_CPU;
    o.iters = 3;
    o.timeout_ms = TR_SHORT_MS;
    o.transport = MF_TRANSPORT_IPC;
    o.die_rank = 2;
    o.die_at = 1;
    char err[512] = "";
    double t0 = now_s();
    mf_result_t res = mfp_run(&p, &o, y, NULL, err, sizeof err);
    double elapsed = now_s() - t0;
    mft_verbose("  %s after %.2f s: %s\n", mft_result_name(res), elapsed, err);
    MFT_CHECK_MSG(res == MF_ERR_TIMEOUT, "%s: %s", mft_result_name(res), err);
    MFT_CHECK_MSG(mft_contains_ci(err, "missing ranks: 2"), "the message names the dead rank: %s", err);
    MFT_CHECK_MSG(elapsed < 10 * TR_SHORT_MS / 1000.0 + 3, "took %.2f s", elapsed);
    MFT_CHECK_MSG(waitpid(-1, NULL, WNOHANG) < 0 && errno == ECHILD, "a rank process was left behind");
    for (int r = 0; r < 4; r++) free(y[r]);
    mfp_free(&p);
    return 0;
}

/* mfp_run's dispatch + combine mode over processes (the driver of the CUDA suite's and bench's
 * multi-process comm cases, walked here on the CPU backend): with the routing redrawn every call,
 * each call's dispatch digest and combined y equal the local run's; and the forward with redraw
 * equals it call by call too. */
static int test_ipc_comm_digests(void) {
    enum { kCalls = 3 };
    static const int32_t T3[3] = {12, 0, 5};
    for (int op = 0; op < 2; op++) {
        mfp_spec_t spec = small_spec(3, op ? MF_DTYPE_FP8_E4M3 : MF_DTYPE_BF16,
                                     op ? MF_LAYOUT_EXPERT_MAJOR : MF_LAYOUT_MASKED, 31 + (uint64_t)op);
        spec.T_of_rank = T3;
        spec.drop_prob = 0.1;
        mfp_problem_t p;
        MFT_CHECK(mfp_generate(&spec, &p) == 0);
        uint64_t d[2][3 * kCalls * 2];
        uint16_t *y[2][3];
        for (int t = 0; t < 2; t++) {
            for (int r = 0; r < 3; r++) y[t][r] = mft_alloc((size_t)p.T[r] * p.spec.H * 2 + 2);
            mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
            o.backend = MF_BACKEND_CPU, o.iters = kCalls, o.timeout_ms = TR_TIMEOUT_MS;
            o.transport = t ? MF_TRANSPORT_IPC : MF_TRANSPORT_LOCAL;
            o.op = op ? MFP_OP_DISPATCH_COMBINE : MFP_OP_FORWARD, o.profile = 1;
            o.redraw = 1, o.redraw_seed = 700, o.digests = d[t];
            char err[512];
            MFT_CHECK_MSG(mfp_run(&p, &o, y[t], NULL, err, sizeof err) == MF_SUCCESS, "op %d %s: %s", op,
                          t ? "ipc" : "local", err);
        }
        for (int i = 0; i < 3 * kCalls * 2; i++)
            MFT_CHECK_MSG(d[0][i] == d[1][i], "op %d: rank %d call %d: %s digest differs", op, i / (2 * kCalls),
                          (i / 2) % kCalls, i % 2 ? "y" : "dispatch");
        for (int i = 0; op && i < 3 * kCalls; i++)
            MFT_CHECK_MSG(d[0][2 * i] != 0 && d[0][2 * i] != d[0][(2 * i + 2) % (6 * kCalls)],
                          "op %d: dispatch digests do not follow the routing", op);
        for (int r = 0; r < 3; r++) {
            MFT_CHECK(memcmp(y[0][r], y[1][r], (size_t)p.T[r] * p.spec.H * 2) == 0);
            free(y[0][r]), free(y[1][r]);
        }
        mfp_free(&p);
    }
    return 0;
}

/* ---- rank processes driven by the test ------------------------------------------------------ */

#define TR_MAX_CALLS 4

/* What each rank process reports back (shared memory). */
typedef struct tr_shared {
    char address[MF_ADDRESS_BYTES];
    mf_result_t result[MF_MAX_RANKS][TR_MAX_CALLS];
    char msg[MF_MAX_RANKS][TR_MAX_CALLS][256];
    int32_t untouched[MF_MAX_RANKS][TR_MAX_CALLS]; /* y still held the poison after the call */
    double seconds[MF_MAX_RANKS][TR_MAX_CALLS];
    int32_t same_as_first[MF_MAX_RANKS];          /* the last call's y equals the first call's */
    int32_t done[MF_MAX_RANKS];
} tr_shared_t;

typedef int (*tr_rank_fn)(int32_t rank, int32_t R, tr_shared_t *sh, void *arg);

/* Forks R rank processes running fn (mft_fork_ranks); returns the number that did not exit 0. */
typedef struct tr_spawn {
    tr_rank_fn fn;
    int32_t R;
    tr_shared_t *sh;
    void *arg;
} tr_spawn_t;

static int tr_spawn_main(int32_t rank, void *arg) {
    const tr_spawn_t *sp = arg;
    return sp->fn(rank, sp->R, sp->sh, sp->arg);
}

static int spawn_ranks(int32_t R, tr_rank_fn fn, tr_shared_t *sh, void *arg, double deadline_s) {
    tr_spawn_t sp = {fn, R, sh, arg};
    return mft_fork_ranks(R, tr_spawn_main, &sp, deadline_s);
}

static tr_shared_t *tr_shared_new(void) {
    tr_shared_t *sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) return NULL;
    memset(sh, 0, sizeof *sh);
    if (mf_rendezvous_address(sh->address) != MF_SUCCESS) return NULL;
    return sh;
}

/* Rank `rank`'s layer of problem p on `comm` (collective), its host weights set. */
static int open_layer(mf_comm_t comm, const mfp_problem_t *p, int32_t rank, mf_moe_t *moe) {
    const mfp_spec_t *s = &p->spec;
    mf_moe_config_t cfg = MF_MOE_CONFIG_INIT;
    cfg.num_experts = s->E, cfg.num_topk = s->K, cfg.hidden = s->H, cfg.intermediate = s->I;
    cfg.max_tokens_per_rank = s->S, cfg.dtype = s->dtype, cfg.layout = s->layout;
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, moe));
    mf_moe_weights_t w;
    memset(&w, 0, sizeof w);
    w.w13 = mft_t3(p->w13[rank], (mf_dtype_t)s->dtype, p->L, 2 * s->I, s->H);
    w.w2 = mft_t3(p->w2[rank], (mf_dtype_t)s->dtype, p->L, s->H, s->I);
    if (s->dtype == MF_DTYPE_FP8_E4M3) {
        w.w13_scales = mft_t3(p->w13_scales[rank], MF_DTYPE_FP32, p->L, 2 * s->I / 128, s->H / 128);
        w.w2_scales = mft_t3(p->w2_scales[rank], MF_DTYPE_FP32, p->L, s->H / 128, s->I / 128);
    }
    MFT_CHECK_OK(mf_moe_set_weights(*moe, &w));
    return 0;
}

/* One rank of a small BF16 layer over ipc: comm, layer, weights; the caller's steps follow. */
typedef struct tr_rank {
    const mfp_problem_t *p;
    mf_comm_t comm;
    mf_moe_t moe;
    uint16_t *y;
    mf_moe_forward_in_t in;
    mf_moe_forward_out_t out;
} tr_rank_t;

static int tr_rank_open(tr_rank_t *t, const mfp_problem_t *p, int32_t rank, tr_shared_t *sh, int64_t timeout_ms) {
    memset(t, 0, sizeof *t);
    t->p = p;
    const mfp_spec_t *s = &p->spec;
    mf_bootstrap_t boot;
    MFT_CHECK_OK(mf_rendezvous_bootstrap(sh->address, rank, s->R, timeout_ms, &boot));
    mf_comm_config_t cc = MF_COMM_CONFIG_INIT;
    cc.backend = MF_BACKEND_CPU;
    cc.timeout_ms = timeout_ms;
    MFT_CHECK_OK(mf_comm_init(&cc, rank, s->R, &boot, &t->comm));
    mf_transport_t tr;
    MFT_CHECK_OK(mf_comm_get_transport(t->comm, &tr));
    MFT_CHECK_EQ_INT(tr, MF_TRANSPORT_IPC); /* AUTO: the ranks are processes */
    if (open_layer(t->comm, p, rank, &t->moe)) return 1;
    const int64_t T = p->T[rank];
    t->y = mft_alloc((size_t)T * s->H * 2);
    t->in.x = mft_t2(p->x[rank], MF_DTYPE_BF16, T, s->H);
    t->in.topk_ids = mft_t2(p->topk_ids[rank], MF_DTYPE_INT32, T, s->K);
    t->in.topk_weights = mft_t2(p->topk_weights[rank], MF_DTYPE_FP32, T, s->K);
    t->out.y = mft_t2(t->y, MF_DTYPE_BF16, T, s->H);
    return 0;
}

static void tr_rank_close(tr_rank_t *t) {
    mf_moe_destroy(t->moe);
    mf_comm_destroy(t->comm);
    free(t->y);
}

/* Call `c` of rank r: a forward with `in`, its result, message, time, whether y stayed poisoned. */
static void tr_forward(tr_rank_t *t, const mf_moe_forward_in_t *in, int32_t rank, int32_t c, tr_shared_t *sh) {
    const size_t bytes = (size_t)t->p->T[rank] * t->p->spec.H * 2;
    mft_poison(t->y, bytes);
    double t0 = now_s();
    sh->result[rank][c] = mf_moe_forward(t->moe, in, &t->out, NULL);
    sh->seconds[rank][c] = now_s() - t0;
    snprintf(sh->msg[rank][c], sizeof sh->msg[rank][c], "%s", mf_last_error());
    sh->untouched[rank][c] = mft_first_unpoisoned(t->y, bytes) < 0;
}

/* ---- a bad id on one rank ------------------------------------------------------------------ */

static int bad_id_rank(int32_t rank, int32_t R, tr_shared_t *sh, void *arg) {
    (void)R;
    const mfp_problem_t *p = arg;
    tr_rank_t t;
    if (tr_rank_open(&t, p, rank, sh, TR_TIMEOUT_MS)) return 1;
    const size_t bytes = (size_t)p->T[rank] * p->spec.H * 2;
    uint16_t *first = mft_alloc(bytes);
    tr_forward(&t, &t.in, rank, 0, sh);
    memcpy(first, t.y, bytes);
    /* Call 1: rank 1 routes a token to expert E + 3. */
    int32_t *bad = mft_alloc((size_t)p->T[rank] * p->spec.K * 4);
    memcpy(bad, p->topk_ids[rank], (size_t)p->T[rank] * p->spec.K * 4);
    if (rank == 1) bad[1] = p->spec.E + 3;
    mf_moe_forward_in_t in = t.in;
    in.topk_ids = mft_t2(bad, MF_DTYPE_INT32, p->T[rank], p->spec.K);
    tr_forward(&t, &in, rank, 1, sh);
    /* Call 2: everyone good again: the group is still usable. */
    tr_forward(&t, &t.in, rank, 2, sh);
    sh->same_as_first[rank] = memcmp(first, t.y, bytes) == 0;
    sh->done[rank] = 1;
    free(bad);
    free(first);
    tr_rank_close(&t);
    return 0;
}

/* Rank 1 of 4 processes passes an out-of-range id: every rank's call fails with
 * MF_ERR_INVALID_ARGUMENT and writes nothing; the next call works on all of them. */
static int test_ipc_bad_id(void) {
    mfp_spec_t spec = small_spec(4, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, 31);
    mfp_problem_t p;
    MFT_CHECK(mfp_generate(&spec, &p) == 0);
    tr_shared_t *sh = tr_shared_new();
    MFT_CHECK(sh);
    MFT_CHECK_EQ_INT(spawn_ranks(4, bad_id_rank, sh, &p, 30), 0);
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 3; c++)
            mft_verbose("  rank %d call %d: %s (%.2f s): %s\n", r, c, mft_result_name(sh->result[r][c]), sh->seconds[r][c],
                        sh->msg[r][c]);
    for (int r = 0; r < 4; r++) {
        MFT_CHECK_MSG(sh->done[r], "rank %d did not finish", r);
        MFT_CHECK_EQ_INT(sh->result[r][0], MF_SUCCESS);
        MFT_CHECK_MSG(sh->result[r][1] == MF_ERR_INVALID_ARGUMENT, "rank %d: %s", r, mft_result_name(sh->result[r][1]));
        MFT_CHECK_MSG(mft_contains_ci(sh->msg[r][1], r == 1 ? "topk_ids" : "rank 1 failed"), "rank %d: %s", r,
                      sh->msg[r][1]);
        MFT_CHECK_MSG(sh->untouched[r][1], "rank %d: the failed call wrote y", r);
        MFT_CHECK_EQ_INT(sh->result[r][2], MF_SUCCESS);
        MFT_CHECK_MSG(sh->same_as_first[r], "rank %d: y after the failure differs from before it", r);
    }
    munmap(sh, sizeof *sh);
    mfp_free(&p);
    return 0;
}

/* ---- abort ---------------------------------------------------------------------------------- */

static int abort_rank(int32_t rank, int32_t R, tr_shared_t *sh, void *arg) {
    (void)R;
    tr_rank_t t;
    if (tr_rank_open(&t, arg, rank, sh, TR_TIMEOUT_MS)) return 1;
    if (rank == 1) {
        /* Rank 1 gives up instead of calling: its abort releases rank 0's wait for it. */
        struct timespec nap = {0, 200000000};
        nanosleep(&nap, NULL);
        MFT_CHECK_OK(mf_comm_abort(t.comm));
        sh->result[1][1] = mf_moe_forward(t.moe, &t.in, &t.out, NULL);
    } else {
        tr_forward(&t, &t.in, rank, 0, sh);
    }
    sh->done[rank] = 1;
    tr_rank_close(&t);
    return 0;
}

/* In one process: rank 0's thread waits in a forward that rank 1 never joins; rank 1's thread
 * aborts rank 0's comm (any thread may): the forward returns MF_ERR_ABORTED at once. */
typedef struct abort_ctx {
    mf_group_t group;
    const mfp_problem_t *p;
    mf_result_t result, after;
    double seconds;
    int32_t untouched;
} abort_ctx_t;

static int abort_thread_rank(int32_t rank, void *arg) {
    abort_ctx_t *a = arg;
    const mfp_spec_t *s = &a->p->spec;
    mf_comm_t comm, comm0;
    MFT_CHECK_OK(mf_group_get_comm(a->group, rank, &comm));
    MFT_CHECK_OK(mf_group_get_comm(a->group, 0, &comm0));
    mf_moe_t moe;
    if (open_layer(comm, a->p, rank, &moe)) return 1;
    if (rank == 1) {
        struct timespec nap = {0, 200000000};
        nanosleep(&nap, NULL);
        MFT_CHECK_OK(mf_comm_abort(comm0));
    } else {
        const int64_t T = a->p->T[0];
        uint16_t *y = mft_alloc((size_t)T * s->H * 2);
        mft_poison(y, (size_t)T * s->H * 2);
        mf_moe_forward_in_t in = {mft_t2(a->p->x[0], MF_DTYPE_BF16, T, s->H),
                                  mft_t2(a->p->topk_ids[0], MF_DTYPE_INT32, T, s->K),
                                  mft_t2(a->p->topk_weights[0], MF_DTYPE_FP32, T, s->K)};
        mf_moe_forward_out_t out = {mft_t2(y, MF_DTYPE_BF16, T, s->H)};
        double t0 = now_s();
        a->result = mf_moe_forward(moe, &in, &out, NULL);
        a->seconds = now_s() - t0;
        a->untouched = mft_first_unpoisoned(y, (size_t)T * s->H * 2) < 0;
        a->after = mf_moe_forward(moe, &in, &out, NULL);
        free(y);
    }
    MFT_CHECK_OK(mf_moe_destroy(moe));
    return 0;
}

static int test_abort(void) {
    mfp_spec_t spec = small_spec(2, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, 41);
    mfp_problem_t p;
    MFT_CHECK(mfp_generate(&spec, &p) == 0);
    /* Across processes: rank 1 aborts, rank 0 (waiting in its forward) returns MF_ERR_ABORTED long
     * before its 20 s timeout. */
    tr_shared_t *sh = tr_shared_new();
    MFT_CHECK(sh);
    MFT_CHECK_EQ_INT(spawn_ranks(2, abort_rank, sh, &p, 30), 0);
    mft_verbose("  processes: rank 0 %s after %.2f s: %s\n", mft_result_name(sh->result[0][0]), sh->seconds[0][0],
                sh->msg[0][0]);
    MFT_CHECK_EQ_INT(sh->result[0][0], MF_ERR_ABORTED);
    MFT_CHECK_MSG(mft_contains_ci(sh->msg[0][0], "rank 1"), "%s", sh->msg[0][0]);
    MFT_CHECK(sh->seconds[0][0] < 5.0);
    MFT_CHECK(sh->untouched[0][0]);
    MFT_CHECK_EQ_INT(sh->result[1][1], MF_ERR_ABORTED); /* an aborted comm takes no more calls */
    munmap(sh, sizeof *sh);

    abort_ctx_t a;
    memset(&a, 0, sizeof a);
    a.p = &p;
    a.group = mft_cpu_group(2, TR_TIMEOUT_MS);
    MFT_CHECK(a.group);
    int rc = mft_run_ranks(2, abort_thread_rank, &a);
    MFT_CHECK_OK(mf_group_destroy(a.group));
    MFT_CHECK(rc == 0);
    mft_verbose("  threads: rank 0 %s after %.2f s\n", mft_result_name(a.result), a.seconds);
    MFT_CHECK_EQ_INT(a.result, MF_ERR_ABORTED);
    MFT_CHECK(a.seconds < 5.0);
    MFT_CHECK(a.untouched);
    MFT_CHECK_EQ_INT(a.after, MF_ERR_ABORTED);
    mfp_free(&p);
    return 0;
}

/* ---- mf_comm_init over a caller's allgather (threads of this process) ----------------------- */

typedef struct user_boot {
    pthread_barrier_t barrier;
    const void *send[MF_MAX_RANKS];
    int32_t R, destroyed;
    int32_t transport;          /* asked for */
    int64_t heap_of_rank1;      /* rank 1's heap_bytes (the others 0) */
    const mfp_problem_t *p;
    mf_result_t init[MF_MAX_RANKS];
    char msg[MF_MAX_RANKS][256];
    mf_transport_t got[MF_MAX_RANKS];
    uint16_t *y[MF_MAX_RANKS];
} user_boot_t;

typedef struct user_rank {
    user_boot_t *ub;
    int32_t rank;
} user_rank_t;

/* An engine's allgather, as simple as one can be: a barrier, everyone copies, a barrier. */
static int32_t user_allgather(void *ctx, const void *send, void *recv, size_t bytes) {
    user_rank_t *u = ctx;
    u->ub->send[u->rank] = send;
    pthread_barrier_wait(&u->ub->barrier);
    for (int32_t q = 0; q < u->ub->R; q++) memcpy((uint8_t *)recv + (size_t)q * bytes, u->ub->send[q], bytes);
    pthread_barrier_wait(&u->ub->barrier);
    return 0;
}

static void user_destroy(void *ctx) {
    __atomic_fetch_add(&((user_rank_t *)ctx)->ub->destroyed, 1, __ATOMIC_RELAXED);
    free(ctx);
}

/* One rank: mf_comm_init with the caller's allgather, then (when it worked) the layer once. */
static int user_rank_main(int32_t rank, void *arg) {
    user_boot_t *ub = arg;
    user_rank_t *me = mft_alloc(sizeof *me); /* the bootstrap's ctx: the comm hands it to destroy */
    me->ub = ub;
    me->rank = rank;
    mf_bootstrap_t boot = {user_allgather, me, user_destroy};
    mf_comm_config_t cc = MF_COMM_CONFIG_INIT;
    cc.backend = MF_BACKEND_CPU;
    cc.transport = ub->transport;
    cc.timeout_ms = TR_TIMEOUT_MS;
    if (rank == 1) cc.heap_bytes = ub->heap_of_rank1;
    mf_comm_t comm = NULL;
    ub->init[rank] = mf_comm_init(&cc, rank, ub->R, &boot, &comm);
    snprintf(ub->msg[rank], sizeof ub->msg[rank], "%s", mf_last_error());
    if (ub->init[rank] != MF_SUCCESS) {
        MFT_CHECK(comm == NULL);
        return 0;
    }
    MFT_CHECK_OK(mf_comm_get_transport(comm, &ub->got[rank]));
    const mfp_problem_t *p = ub->p;
    const mfp_spec_t *s = &p->spec;
    mf_moe_t moe;
    if (open_layer(comm, p, rank, &moe)) return 1;
    const int64_t T = p->T[rank];
    mf_moe_forward_in_t in = {mft_t2(p->x[rank], MF_DTYPE_BF16, T, s->H), mft_t2(p->topk_ids[rank], MF_DTYPE_INT32, T, s->K),
                              mft_t2(p->topk_weights[rank], MF_DTYPE_FP32, T, s->K)};
    mf_moe_forward_out_t out = {mft_t2(ub->y[rank], MF_DTYPE_BF16, T, s->H)};
    MFT_CHECK_OK(mf_moe_forward(moe, &in, &out, NULL));
    MFT_CHECK_OK(mf_moe_destroy(moe));
    MFT_CHECK_OK(mf_comm_destroy(comm));
    return 0;
}

static int user_boot_run(user_boot_t *ub) {
    pthread_barrier_init(&ub->barrier, NULL, (unsigned)ub->R);
    int rc = mft_run_ranks(ub->R, user_rank_main, ub);
    pthread_barrier_destroy(&ub->barrier);
    return rc;
}

/* Threads that each make their rank with mf_comm_init over the caller's allgather: AUTO resolves
 * to local; IPC (shared memory, here inside one process) works too; both give the group's y bit
 * for bit; the comm owns the bootstrap (its destroy runs once per rank, also when init fails). A
 * rank that declares another heap makes every rank fail. */
static int test_user_bootstrap(void) {
    mfp_spec_t spec = small_spec(3, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, 51);
    mfp_problem_t p;
    MFT_CHECK(mfp_generate(&spec, &p) == 0);
    uint16_t *y_group[3];
    for (int r = 0; r < 3; r++) y_group[r] = mft_alloc((size_t)p.T[r] * p.spec.H * 2);
    char err[512];
    MFT_CHECK_MSG(mfp_run_forward(&p, MF_BACKEND_CPU, 1, TR_TIMEOUT_MS, y_group, NULL, err, sizeof err) == MF_SUCCESS,
                  "%s", err);
    static const int32_t transports[2] = {MF_TRANSPORT_AUTO, MF_TRANSPORT_IPC};
    for (int i = 0; i < 2; i++) {
        user_boot_t ub;
        memset(&ub, 0, sizeof ub);
        ub.R = 3, ub.p = &p, ub.transport = transports[i];
        for (int r = 0; r < 3; r++) ub.y[r] = mft_alloc((size_t)p.T[r] * p.spec.H * 2);
        MFT_CHECK(user_boot_run(&ub) == 0);
        for (int r = 0; r < 3; r++) {
            MFT_CHECK_MSG(ub.init[r] == MF_SUCCESS, "rank %d: %s", r, ub.msg[r]);
            MFT_CHECK_EQ_INT(ub.got[r], i == 0 ? MF_TRANSPORT_LOCAL : MF_TRANSPORT_IPC);
            MFT_CHECK_MSG(memcmp(ub.y[r], y_group[r], (size_t)p.T[r] * p.spec.H * 2) == 0, "rank %d: y differs", r);
            free(ub.y[r]);
        }
        MFT_CHECK_EQ_INT(ub.destroyed, 3);
    }
    /* Rank 1 declares a heap the others do not: all three fail, naming it. */
    user_boot_t ub;
    memset(&ub, 0, sizeof ub);
    ub.R = 3, ub.p = &p, ub.transport = MF_TRANSPORT_AUTO, ub.heap_of_rank1 = 1 << 20;
    MFT_CHECK(user_boot_run(&ub) == 0);
    for (int r = 0; r < 3; r++) {
        mft_verbose("  rank %d: %s: %s\n", r, mft_result_name(ub.init[r]), ub.msg[r]);
        MFT_CHECK_EQ_INT(ub.init[r], MF_ERR_INVALID_ARGUMENT);
        MFT_CHECK_MSG(mft_contains_ci(ub.msg[r], "heap_bytes"), "rank %d: %s", r, ub.msg[r]);
    }
    MFT_CHECK_EQ_INT(ub.destroyed, 3);
    for (int r = 0; r < 3; r++) free(y_group[r]);
    mfp_free(&p);
    return 0;
}

static int count_destroy(void *ctx) { return ++*(int *)ctx; }
static void count_destroy_cb(void *ctx) { (void)count_destroy(ctx); }
static int32_t never_allgather(void *ctx, const void *send, void *recv, size_t bytes) {
    (void)ctx, (void)send, (void)recv, (void)bytes;
    return 1;
}

/* Argument checks of mf_comm_init / mf_comm_destroy, a failing caller allgather, and the heap
 * sized once: declared (a larger layer is refused with MF_ERR_CAPACITY) or by the first layer. */
static int test_comm_init_checks(void) {
    mf_comm_config_t cc = MF_COMM_CONFIG_INIT;
    cc.backend = MF_BACKEND_CPU;
    mf_comm_t comm = (mf_comm_t)(uintptr_t)0x1;
    int destroyed = 0;
    mf_bootstrap_t boot = {never_allgather, &destroyed, count_destroy_cb};
    MFT_CHECK_ERR(mf_comm_init(NULL, 0, 1, NULL, &comm), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_ERR(mf_comm_init(&cc, 0, 1, NULL, NULL), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_ERR(mf_comm_init(&cc, 2, 2, &boot, &comm), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_ERR(mf_comm_init(&cc, 0, 0, &boot, &comm), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_ERR(mf_comm_init(&cc, 0, MF_MAX_RANKS + 1, &boot, &comm), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_ERR(mf_comm_init(&cc, 0, 2, NULL, &comm), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_EQ_INT(destroyed, 3); /* the comm owned each bootstrap, also when the call failed */
    mf_comm_config_t bad = cc;
    bad.magic = 0;
    MFT_CHECK_ERR(mf_comm_init(&bad, 0, 1, NULL, &comm), MF_ERR_INVALID_USAGE);
    bad = cc;
    bad.heap_bytes = -1;
    MFT_CHECK_ERR(mf_comm_init(&bad, 0, 1, NULL, &comm), MF_ERR_INVALID_ARGUMENT);
    bad = cc;
    bad.transport = 17;
    MFT_CHECK_ERR(mf_comm_init(&bad, 0, 1, NULL, &comm), MF_ERR_INVALID_ARGUMENT);
#if !MF_WITH_CUDA
    bad = cc;
    bad.transport = MF_TRANSPORT_NCCL;
    MFT_CHECK_ERR(mf_comm_init(&bad, 0, 1, NULL, &comm), MF_ERR_NOT_SUPPORTED);
#endif
    /* A caller's allgather that fails: MF_ERR_SYSTEM naming the bootstrap, the comm not made. */
    destroyed = 0;
    MFT_CHECK_ERR(mf_comm_init(&cc, 0, 2, &boot, &comm), MF_ERR_SYSTEM);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "bootstrap"));
    MFT_CHECK_EQ_INT(destroyed, 1);
    MFT_CHECK(comm == (mf_comm_t)(uintptr_t)0x1);
    MFT_CHECK_OK(mf_comm_destroy(NULL));
    MFT_CHECK_OK(mf_comm_abort(NULL) == MF_ERR_INVALID_ARGUMENT ? MF_SUCCESS : MF_ERR_INTERNAL);

    /* A group's comm is the group's to destroy. */
    mf_group_t g = mft_cpu_group(1, 0);
    MFT_CHECK(g);
    mf_comm_t gc;
    MFT_CHECK_OK(mf_group_get_comm(g, 0, &gc));
    MFT_CHECK_ERR(mf_comm_destroy(gc), MF_ERR_INVALID_USAGE);
    MFT_CHECK_OK(mf_group_destroy(g));

    /* The heap: declared for the small layer, so the large one is refused; undeclared, the first
     * layer sizes it and a larger later one is refused too. */
    mf_moe_config_t small = MF_MOE_CONFIG_INIT, large;
    small.num_experts = 4, small.num_topk = 2, small.hidden = 128, small.intermediate = 128;
    small.max_tokens_per_rank = 8;
    large = small;
    large.max_tokens_per_rank = 64;
    int64_t hs = 0, hl = 0;
    MFT_CHECK_OK(mf_moe_heap_bytes(&small, 1, &hs));
    MFT_CHECK_OK(mf_moe_heap_bytes(&large, 1, &hl));
    MFT_CHECK(0 < hs && hs < hl);
    MFT_CHECK_ERR(mf_moe_heap_bytes(&small, 0, &hs), MF_ERR_INVALID_ARGUMENT);
    for (int declared = 0; declared < 2; declared++) {
        mf_comm_config_t c1 = cc;
        c1.heap_bytes = declared ? hs : 0;
        MFT_CHECK_OK(mf_comm_init(&c1, 0, 1, NULL, &comm));
        mf_moe_t a = NULL, b = NULL;
        MFT_CHECK_OK(mf_moe_create(comm, &small, &a));
        mf_moe_info_t info;
        MFT_CHECK_OK(mf_moe_get_info(a, &info));
        MFT_CHECK_EQ_INT(info.heap_bytes, hs);
        MFT_CHECK_ERR(mf_moe_create(comm, &large, &b), MF_ERR_CAPACITY);
        MFT_CHECK(mft_contains_ci(mf_last_error(), "heap_bytes"));
        MFT_CHECK(b == NULL);
        MFT_CHECK_OK(mf_moe_create(comm, &small, &b)); /* as large as the heap: fine */
        MFT_CHECK_OK(mf_moe_destroy(a));
        MFT_CHECK_OK(mf_moe_destroy(b));
        MFT_CHECK_OK(mf_comm_destroy(comm));
    }
    return 0;
}

/* Processes asking for the local transport are refused on every rank. */
static int local_from_processes_rank(int32_t rank, int32_t R, tr_shared_t *sh, void *arg) {
    (void)arg;
    mf_bootstrap_t boot;
    MFT_CHECK_OK(mf_rendezvous_bootstrap(sh->address, rank, R, TR_TIMEOUT_MS, &boot));
    mf_comm_config_t cc = MF_COMM_CONFIG_INIT;
    cc.backend = MF_BACKEND_CPU;
    cc.transport = MF_TRANSPORT_LOCAL;
    mf_comm_t comm = NULL;
    sh->result[rank][0] = mf_comm_init(&cc, rank, R, &boot, &comm);
    snprintf(sh->msg[rank][0], sizeof sh->msg[rank][0], "%s", mf_last_error());
    sh->done[rank] = 1;
    return 0;
}

static int test_ipc_local_refused(void) {
    tr_shared_t *sh = tr_shared_new();
    MFT_CHECK(sh);
    MFT_CHECK_EQ_INT(spawn_ranks(2, local_from_processes_rank, sh, NULL, 30), 0);
    for (int r = 0; r < 2; r++) {
        MFT_CHECK_EQ_INT(sh->result[r][0], MF_ERR_INVALID_ARGUMENT);
        MFT_CHECK_MSG(mft_contains_ci(sh->msg[r][0], "one process"), "rank %d: %s", r, sh->msg[r][0]);
    }
    munmap(sh, sizeof *sh);
    return 0;
}

/* ---- ranks calling different layers ---------------------------------------------------------- */

typedef struct layers_ctx {
    mf_group_t group;
    const mfp_problem_t *p;
    mf_result_t mixed[2], same[2];
    char msg[2][256];
} layers_ctx_t;

static int layers_rank(int32_t rank, void *arg) {
    layers_ctx_t *c = arg;
    const mfp_problem_t *p = c->p;
    const mfp_spec_t *s = &p->spec;
    mf_comm_t comm;
    MFT_CHECK_OK(mf_group_get_comm(c->group, rank, &comm));
    mf_moe_t moe[2];
    for (int l = 0; l < 2; l++)
        if (open_layer(comm, p, rank, &moe[l])) return 1;
    const int64_t T = p->T[rank];
    uint16_t *y = mft_alloc((size_t)T * s->H * 2);
    mf_moe_forward_in_t in = {mft_t2(p->x[rank], MF_DTYPE_BF16, T, s->H), mft_t2(p->topk_ids[rank], MF_DTYPE_INT32, T, s->K),
                              mft_t2(p->topk_weights[rank], MF_DTYPE_FP32, T, s->K)};
    mf_moe_forward_out_t out = {mft_t2(y, MF_DTYPE_BF16, T, s->H)};
    c->mixed[rank] = mf_moe_forward(moe[rank], &in, &out, NULL); /* rank 0 layer 0, rank 1 layer 1 */
    snprintf(c->msg[rank], sizeof c->msg[rank], "%s", mf_last_error());
    c->same[rank] = mf_moe_forward(moe[1], &in, &out, NULL);
    free(y);
    for (int l = 0; l < 2; l++) MFT_CHECK_OK(mf_moe_destroy(moe[l]));
    return 0;
}

/* Rank 0 calls one layer while rank 1 calls another: both fail with MF_ERR_INVALID_USAGE naming
 * the layers (the id travels with every arrival); the next call on the same layer works. */
static int test_layer_mismatch(void) {
    mfp_spec_t spec = small_spec(2, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, 71);
    mfp_problem_t p;
    MFT_CHECK(mfp_generate(&spec, &p) == 0);
    layers_ctx_t c;
    memset(&c, 0, sizeof c);
    c.p = &p;
    c.group = mft_cpu_group(2, TR_TIMEOUT_MS);
    MFT_CHECK(c.group);
    int rc = mft_run_ranks(2, layers_rank, &c);
    MFT_CHECK_OK(mf_group_destroy(c.group));
    MFT_CHECK(rc == 0);
    for (int r = 0; r < 2; r++) {
        mft_verbose("  rank %d: %s: %s\n", r, mft_result_name(c.mixed[r]), c.msg[r]);
        MFT_CHECK_EQ_INT(c.mixed[r], MF_ERR_INVALID_USAGE);
        MFT_CHECK_MSG(mft_contains_ci(c.msg[r], "layer"), "rank %d: %s", r, c.msg[r]);
        MFT_CHECK_EQ_INT(c.same[r], MF_SUCCESS);
    }
    mfp_free(&p);
    return 0;
}

const mft_test_t mft_tests_transport[] = {
    {"transport_ipc_bitwise", test_ipc_bitwise, 60},
    {"transport_ipc_rank_dies", test_ipc_rank_dies, 60},
    {"transport_ipc_comm_digests", test_ipc_comm_digests, 60},
    {"transport_ipc_bad_id", test_ipc_bad_id, 60},
    {"transport_ipc_local_refused", test_ipc_local_refused, 60},
    {"transport_abort", test_abort, 60},
    {"transport_user_bootstrap", test_user_bootstrap, 60},
    {"transport_comm_init_checks", test_comm_init_checks, 60},
    {"transport_layer_mismatch", test_layer_mismatch, 60},
    {NULL, NULL, 0},
};
