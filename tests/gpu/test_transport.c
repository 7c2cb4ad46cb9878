/*
 * test_transport.c (CUDA) — ranks as processes over the ipc and nccl transports: the same problem
 * on virtual ranks of one process (local transport) is the reference, bit for bit.
 *
 * The rank count follows the machine (mfp_probe_device_count, asked in a child so that this
 * process has not touched CUDA when it forks the ranks): with several GPUs visible, R = their
 * number, one process per GPU (mfp_run gives rank r device r), over ipc and over nccl; with one,
 * R processes share GPU 0 over ipc (nccl only at R = 1: NCCL refuses two ranks on one device).
 * The local reference is R virtual ranks on GPU 0 (mf_group_create places a group on one device;
 * results do not depend on placement). Cases:
 *   layer       mf_moe_forward, y bit for bit
 *   comm        mf_dispatch and mf_combine alone, with the routing redrawn every call: each call's
 *               dispatch outputs (digest of counts, offsets, every real row's source, payload and
 *               scales) and combined y (expert outputs a function of each received row) equal the
 *               local CUDA run's and the CPU backend's
 *   graph       each rank's forward captured into a CUDA graph once and replayed with the routing
 *               redrawn every replay: every replay's y equals an eager local run's
 *   rank dies   a rank process SIGKILLed right after launching a forward (its kernels in flight):
 *               every survivor returns an error within its timeout, nothing hangs, no process is
 *               left behind
 * Without MPS one GPU time-slices between processes (a round trip of two processes spinning on
 * each other's flags took ~4.5 ms on the H200), so the cases are small and the timeouts generous.
 * Also here, on virtual ranks: the fault model's CUDA cases that need several ranks (a capacity
 * overflow every rank must report, ranks calling different layers) and the virtual-rank limit.
 */
#define _DEFAULT_SOURCE /* for errno / waitpid's ECHILD check with _POSIX_C_SOURCE */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include <cuda_runtime_api.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes" /* nccl.h declares f() for f(void) */
#include <nccl.h>
#pragma GCC diagnostic pop

#include "../harness.h"
#include "cuda_test.h"
#include "problem.h"
#include "ref.h"

#define IPC_TIMEOUT_MS 30000
#define DIES_TIMEOUT_MS 3000 /* survivors' peer timeout when a rank is killed */
#define MP_CALLS 4           /* comm and graph cases: calls per run, each on new routing */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* GPUs visible (asked once, in a child). */
static int32_t gpus(void) {
    static int32_t n = -1;
    if (n < 0) n = mfp_probe_device_count();
    return n;
}

/* R for a multi-process case: one process per GPU where there are several, else `one_gpu_R`
 * processes sharing GPU 0. */
static int32_t mp_ranks(int32_t one_gpu_R) {
    int32_t n = gpus();
    return n > 1 ? (n > MF_MAX_RANKS ? MF_MAX_RANKS : n) : one_gpu_R;
}

/* The process transports a case of R ranks runs over here: ipc always; nccl where every rank has
 * its own GPU (R <= GPUs). */
static int32_t mp_transports(int32_t R, int32_t *tr) {
    int32_t n = 0;
    tr[n++] = MF_TRANSPORT_IPC;
    if (R <= gpus()) tr[n++] = MF_TRANSPORT_NCCL;
    return n;
}

static const char *tr_name(int32_t t) {
    return t == MF_TRANSPORT_IPC ? "ipc" : t == MF_TRANSPORT_NCCL ? "nccl" : "local";
}

static uint16_t **alloc_ys(const mfp_problem_t *p) {
    uint16_t **y = mft_alloc(sizeof(uint16_t *) * (size_t)p->spec.R);
    for (int32_t r = 0; r < p->spec.R; r++) {
        y[r] = mft_alloc((size_t)p->T[r] * p->spec.H * 2 + 2);
        mft_poison(y[r], (size_t)p->T[r] * p->spec.H * 2);
    }
    return y;
}

static void free_ys(uint16_t **y, int32_t R) {
    for (int32_t r = 0; r < R; r++) free(y[r]);
    free(y);
}

/* Every rank's y of two runs, bit for bit. */
static int same_y(const mfp_problem_t *p, uint16_t *const *a, uint16_t *const *b, const char *what) {
    for (int32_t r = 0; r < p->spec.R; r++) {
        const int64_t n = (int64_t)p->T[r] * p->spec.H;
        MFT_CHECK_MSG(memcmp(a[r], b[r], (size_t)n * 2) == 0, "%s: rank %d: y differs (diff %.3g)", what, (int)r,
                      mfref_diff_bf16(a[r], b[r], n));
    }
    return 0;
}

/* ---- the layer: processes (ipc, nccl) against virtual ranks -------------------------------- */

typedef struct mp_case {
    int32_t R, dtype, layout, dataflow;
    const int32_t *T_of_rank; /* [R] or NULL */
    uint64_t seed;
} mp_case_t;

static int mp_problem(const mp_case_t *c, int32_t E_per_rank, mfp_problem_t *p) {
    mfp_spec_t spec;
    memset(&spec, 0, sizeof spec);
    spec.R = c->R, spec.E = E_per_rank * c->R, spec.K = 4, spec.H = 512, spec.I = 256, spec.S = 24;
    while (spec.E < 2 * spec.K) spec.E += c->R; /* one rank: enough experts for K distinct ids */
    spec.T_per_rank = 24, spec.dtype = c->dtype, spec.layout = c->layout, spec.T_of_rank = c->T_of_rank;
    spec.routing = MFP_ROUTING_ZIPF, spec.zipf_s = 1.2, spec.drop_prob = 0.05, spec.seed = c->seed;
    return mfp_generate(&spec, p);
}

/* Idle and uneven ranks for R processes: rank 1 idle, the others 24, 7, 1, 24, 7, 1, ... */
static const int32_t *uneven_T(int32_t R) {
    static int32_t T[MF_MAX_RANKS];
    static const int32_t pat[3] = {24, 7, 1};
    for (int32_t r = 0; r < R; r++) T[r] = r == 1 ? 0 : pat[r % 3];
    return T;
}

/* Every case over every process transport first (this process must not touch CUDA before it
 * forks rank processes), then the local runs, then the comparison. */
static int cuda_ipc_bitwise(void) {
    const int32_t R = mp_ranks(2), R4 = mp_ranks(4);
    /* the last case is one rank, so that the nccl path of mfp_run runs on one GPU too */
    mp_case_t cases[4] = {
        {R, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MF_DATAFLOW_AUTO, NULL, 61},
        {R4, MF_DTYPE_BF16, MF_LAYOUT_MASKED, MF_DATAFLOW_PULL, uneven_T(R4), 62},
        {R4, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, MF_DATAFLOW_UNFUSED, uneven_T(R4), 63},
        {1, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MF_DATAFLOW_AUTO, NULL, 64},
    };
    enum { kCases = 4 };
    mfp_problem_t p[kCases];
    uint16_t **y_mp[kCases][2], **y_local[kCases];
    int32_t trs[kCases][2], ntr[kCases];
    char err[512] = "";
    mft_verbose("  %d GPU(s): R = %d / %d processes\n", (int)gpus(), (int)R, (int)R4);
    for (int i = 0; i < kCases; i++) {
        MFT_CHECK(mp_problem(&cases[i], 4, &p[i]) == 0);
        ntr[i] = mp_transports(cases[i].R, trs[i]);
        for (int t = 0; t < ntr[i]; t++) {
            mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
            o.backend = MF_BACKEND_CUDA, o.iters = 2, o.timeout_ms = IPC_TIMEOUT_MS, o.dataflow = cases[i].dataflow;
            o.transport = trs[i][t];
            y_mp[i][t] = alloc_ys(&p[i]);
            MFT_CHECK_MSG(mfp_run(&p[i], &o, y_mp[i][t], NULL, err, sizeof err) == MF_SUCCESS,
                          "case %d: %s (R = %d processes): %s", i, tr_name(trs[i][t]), (int)cases[i].R, err);
        }
    }
    for (int i = 0; i < kCases; i++) {
        mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
        o.backend = MF_BACKEND_CUDA, o.iters = 2, o.timeout_ms = IPC_TIMEOUT_MS, o.dataflow = cases[i].dataflow;
        y_local[i] = alloc_ys(&p[i]);
        MFT_CHECK_MSG(mfp_run(&p[i], &o, y_local[i], NULL, err, sizeof err) == MF_SUCCESS,
                      "case %d: local (R = %d threads): %s", i, (int)cases[i].R, err);
        for (int t = 0; t < ntr[i]; t++) {
            char what[64];
            snprintf(what, sizeof what, "case %d, %s vs local", i, tr_name(trs[i][t]));
            if (same_y(&p[i], y_mp[i][t], y_local[i], what)) return 1;
            mft_verbose("  case %d: R %d: %s == local, bit for bit\n", i, (int)cases[i].R, tr_name(trs[i][t]));
            free_ys(y_mp[i][t], cases[i].R);
        }
        free_ys(y_local[i], cases[i].R);
        mfp_free(&p[i]);
    }
    return 0;
}

/* ---- dispatch and combine alone; graph replay; over processes -------------------------------- */

/* Runs p as o says with MP_CALLS calls on redrawn routing, digests into d [R][MP_CALLS][2] and y. */
static mf_result_t run_digests(const mfp_problem_t *p, mfp_run_opts_t o, int32_t backend, int32_t transport,
                               uint64_t *d, uint16_t **y, char *err, int errlen) {
    o.backend = backend, o.transport = transport, o.iters = MP_CALLS, o.warmup = 0;
    o.timeout_ms = IPC_TIMEOUT_MS, o.redraw = 1, o.redraw_seed = 500, o.digests = d;
    return mfp_run(p, &o, y, NULL, err, errlen);
}

/* Call by call, both digests of every rank equal (what: the runs' names). */
static int same_digests(int32_t R, const uint64_t *a, const uint64_t *b, int check_dispatch, const char *what) {
    for (int32_t r = 0; r < R; r++)
        for (int32_t c = 0; c < MP_CALLS; c++) {
            const uint64_t *x = a + ((size_t)r * MP_CALLS + c) * 2, *z = b + ((size_t)r * MP_CALLS + c) * 2;
            MFT_CHECK_MSG(!check_dispatch || x[0] == z[0], "%s: rank %d call %d: dispatch outputs differ", what, (int)r,
                          (int)c);
            MFT_CHECK_MSG(x[1] == z[1], "%s: rank %d call %d: y differs", what, (int)r, (int)c);
        }
    return 0;
}

/* One case of op DISPATCH_COMBINE (comm) or a captured FORWARD (graph): its runs over every process
 * transport, kept until the same calls run on local CUDA virtual ranks (eager) and, for comm, on the
 * CPU backend. The process runs of every case come first: a process that has touched CUDA cannot
 * fork rank processes that use it. */
typedef struct mp_digest {
    mfp_problem_t p;
    int32_t trs[2], ntr;
    uint64_t *d_mp[2];
    uint16_t **y_mp[2];
} mp_digest_t;

static mfp_run_opts_t mp_digest_opts(const mp_case_t *c, int graph) {
    mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
    o.op = graph ? MFP_OP_FORWARD : MFP_OP_DISPATCH_COMBINE;
    o.dataflow = c->dataflow;
    return o;
}

static int mp_digest_run(const mp_case_t *c, int graph, mp_digest_t *s) {
    MFT_CHECK(mp_problem(c, graph ? 4 : 2, &s->p) == 0);
    const size_t nd = (size_t)c->R * MP_CALLS * 2;
    s->ntr = mp_transports(c->R, s->trs);
    mfp_run_opts_t og = mp_digest_opts(c, graph);
    og.graph = graph;
    char err[512] = "";
    for (int t = 0; t < s->ntr; t++) {
        s->d_mp[t] = mft_alloc(nd * 8);
        s->y_mp[t] = alloc_ys(&s->p);
        MFT_CHECK_MSG(run_digests(&s->p, og, MF_BACKEND_CUDA, s->trs[t], s->d_mp[t], s->y_mp[t], err, sizeof err) ==
                          MF_SUCCESS,
                      "%s over %s (R = %d processes): %s", graph ? "graph replay" : "dispatch / combine",
                      tr_name(s->trs[t]), (int)c->R, err);
    }
    return 0;
}

static int mp_digest_check(const mp_case_t *c, int graph, mp_digest_t *s) {
    const int32_t R = c->R;
    const size_t nd = (size_t)R * MP_CALLS * 2;
    uint64_t *d_local = mft_alloc(nd * 8), *d_cpu = mft_alloc(nd * 8);
    uint16_t **y_local = alloc_ys(&s->p);
    mfp_run_opts_t o = mp_digest_opts(c, graph);
    char err[512] = "";
    MFT_CHECK_MSG(run_digests(&s->p, o, MF_BACKEND_CUDA, MF_TRANSPORT_LOCAL, d_local, y_local, err, sizeof err) ==
                      MF_SUCCESS, "local (R = %d threads): %s", (int)R, err);
    if (!graph) {
        uint16_t **y_cpu = alloc_ys(&s->p);
        MFT_CHECK_MSG(run_digests(&s->p, o, MF_BACKEND_CPU, MF_TRANSPORT_LOCAL, d_cpu, y_cpu, err, sizeof err) ==
                          MF_SUCCESS, "cpu: %s", err);
        if (same_digests(R, d_local, d_cpu, 1, "local CUDA vs CPU")) return 1;
        free_ys(y_cpu, R);
    }
    for (int t = 0; t < s->ntr; t++) {
        char what[64];
        snprintf(what, sizeof what, "%s vs local", tr_name(s->trs[t]));
        if (same_digests(R, s->d_mp[t], d_local, !graph, what) || same_y(&s->p, s->y_mp[t], y_local, what)) return 1;
        mft_verbose("  R %d %s %s: %s == local%s, %d calls on new routing, bit for bit\n", (int)R,
                    c->dtype == MF_DTYPE_FP8_E4M3 ? "fp8" : "bf16",
                    c->layout == MF_LAYOUT_MASKED ? "masked" : "expert_major", tr_name(s->trs[t]),
                    graph ? " (graph replays vs eager)" : " and cpu (dispatch outputs and y)", MP_CALLS);
        free(s->d_mp[t]);
        free_ys(s->y_mp[t], R);
    }
    free(d_local);
    free(d_cpu);
    free_ys(y_local, R);
    mfp_free(&s->p);
    return 0;
}

/* Every case's process runs, then every case's local runs and comparisons (n <= 4). */
static int mp_digest_cases(const mp_case_t *cases, int n, int graph) {
    const char *name = graph ? "graph" : "comm";
    mp_digest_t s[4];
    for (int i = 0; i < n; i++)
        if (mp_digest_run(&cases[i], graph, &s[i])) return mft_fail(__FILE__, __LINE__, "%s case %d", name, i);
    for (int i = 0; i < n; i++)
        if (mp_digest_check(&cases[i], graph, &s[i])) return mft_fail(__FILE__, __LINE__, "%s case %d", name, i);
    return 0;
}

/* mf_dispatch and mf_combine alone over processes: both dtypes and layouts, an idle rank. */
static int cuda_ipc_comm(void) {
    const int32_t R = mp_ranks(2), R3 = mp_ranks(3);
    mp_case_t cases[4] = {
        {R, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MF_DATAFLOW_AUTO, NULL, 71},
        {R, MF_DTYPE_BF16, MF_LAYOUT_MASKED, MF_DATAFLOW_AUTO, NULL, 72},
        {R3, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, MF_DATAFLOW_AUTO, uneven_T(R3), 73},
        {1, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MF_DATAFLOW_AUTO, NULL, 74}, /* nccl on one GPU too */
    };
    return mp_digest_cases(cases, 4, 0);
}

/* A captured forward replayed over processes with the routing redrawn every replay: DIRECT
 * (decode GEMM reading peers' rows in place) and PULL. */
static int cuda_ipc_graph(void) {
    const int32_t R = mp_ranks(2);
    mp_case_t cases[3] = {
        {R, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, MF_DATAFLOW_DIRECT, NULL, 81},
        {R, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, MF_DATAFLOW_PULL, NULL, 82},
        {1, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MF_DATAFLOW_AUTO, NULL, 83}, /* nccl on one GPU too */
    };
    return mp_digest_cases(cases, 3, 1);
}

/* The last rank process is SIGKILLed right after it launched its second forward (its kernels in
 * flight, its peers inside the call): every survivor returns an error (the timeout naming the
 * rank, or a CUDA error if its mapped memory went with it) within a bound, and no process stays. */
static int cuda_ipc_rank_dies(void) {
    const int32_t R = mp_ranks(3);
    mp_case_t c = {R, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, MF_DATAFLOW_AUTO, NULL, 91};
    mfp_problem_t p;
    MFT_CHECK(mp_problem(&c, 2, &p) == 0);
    int32_t trs[2], ntr = mp_transports(R, trs);
    for (int t = 0; t < ntr; t++) {
        uint16_t **y = alloc_ys(&p);
        mf_result_t codes[MF_MAX_RANKS];
        mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
        o.backend = MF_BACKEND_CUDA, o.iters = 3, o.timeout_ms = DIES_TIMEOUT_MS, o.transport = trs[t];
        o.die_rank = R - 1, o.die_at = 1, o.die_mid = 1, o.rank_results = codes;
        char err[512] = "";
        double t0 = now_s();
        mf_result_t res = mfp_run(&p, &o, y, NULL, err, sizeof err);
        double elapsed = now_s() - t0;
        mft_verbose("  %s, R %d: %s after %.2f s: %s\n", tr_name(trs[t]), (int)R, mft_result_name(res), elapsed, err);
        MFT_CHECK_MSG(res != MF_SUCCESS, "%s: the run succeeded with a rank killed", tr_name(trs[t]));
        for (int32_t r = 0; r < R; r++) {
            mft_verbose("    rank %d: %s\n", (int)r, mft_result_name(codes[r]));
            MFT_CHECK_MSG(codes[r] != MF_SUCCESS, "%s: rank %d returned success with rank %d killed", tr_name(trs[t]),
                          (int)r, (int)(R - 1));
        }
        MFT_CHECK_EQ_INT(codes[R - 1], MF_ERR_SYSTEM);
        /* setup (rendezvous, ncclCommInitRank), the first forward, then at most a timeout per wait */
        MFT_CHECK_MSG(elapsed < 6 * DIES_TIMEOUT_MS / 1000.0 + 30, "%s: took %.1f s", tr_name(trs[t]), elapsed);
        MFT_CHECK_MSG(waitpid(-1, NULL, WNOHANG) < 0 && errno == ECHILD, "%s: a rank process was left behind",
                      tr_name(trs[t]));
        free_ys(y, R);
    }
    mfp_free(&p);
    return 0;
}

/* ---- capacity and layer faults on every rank (virtual ranks) ----------------------------------- */

static int dev_is_poison(const void *d, size_t bytes) {
    uint8_t *h = mft_alloc(bytes + 1);
    int ok = cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost) == cudaSuccess && mft_first_unpoisoned(h, bytes) < 0;
    free(h);
    return ok;
}

typedef struct fault_case {
    mf_group_t group;
    const mfp_problem_t *hot;  /* routing that overflows expert 0's capacity */
    const mfp_problem_t *fine; /* routing that fits */
    int32_t capacity, layers;
    pthread_barrier_t ready;
    /* per rank: forward, dispatch (hot: capacity), then the layer mismatch, then a good forward */
    mf_result_t fwd[MF_MAX_RANKS], fwd_async[MF_MAX_RANKS], disp[MF_MAX_RANKS], disp_async[MF_MAX_RANKS];
    mf_result_t mixed_async[MF_MAX_RANKS], good[MF_MAX_RANKS];
    int32_t y_untouched[MF_MAX_RANKS], counts_untouched[MF_MAX_RANKS];
    char msg[MF_MAX_RANKS][256], mixed_msg[MF_MAX_RANKS][256];
} fault_case_t;

static int fault_case_rank(int32_t rank, void *arg) {
    fault_case_t *f = arg;
    const mfp_spec_t *s = &f->hot->spec;
    const int64_t T = f->hot->T[rank], H = s->H, K = s->K, L = f->hot->L, C = f->capacity;
    CUDA_OK(cudaSetDevice(0));
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    mf_comm_t comm;
    MFT_CHECK_OK(mf_group_get_comm(f->group, rank, &comm));
    mf_moe_config_t cfg = MF_MOE_CONFIG_INIT;
    cfg.num_experts = s->E, cfg.num_topk = s->K, cfg.hidden = s->H, cfg.intermediate = s->I;
    cfg.max_tokens_per_rank = s->S, cfg.dtype = MF_DTYPE_BF16, cfg.layout = MF_LAYOUT_MASKED;
    cfg.expert_capacity = f->capacity;
    mf_moe_t moe[2];
    void *w13 = mft_to_dev(f->hot->w13[rank], (size_t)L * 2 * s->I * H * 2),
         *w2 = mft_to_dev(f->hot->w2[rank], (size_t)L * H * s->I * 2);
    MFT_CHECK(w13 && w2);
    mf_moe_weights_t w;
    memset(&w, 0, sizeof w);
    w.w13 = mft_t3(w13, MF_DTYPE_BF16, L, 2 * s->I, H);
    w.w2 = mft_t3(w2, MF_DTYPE_BF16, L, H, s->I);
    for (int l = 0; l < 2; l++) {
        MFT_CHECK_OK(mf_moe_create(comm, &cfg, &moe[l]));
        MFT_CHECK_OK(mf_moe_set_weights(moe[l], &w));
    }
    void *x = mft_to_dev(f->hot->x[rank], (size_t)T * H * 2), *hot = mft_to_dev(f->hot->topk_ids[rank], (size_t)T * K * 4),
         *fine = mft_to_dev(f->fine->topk_ids[rank], (size_t)T * K * 4),
         *wt = mft_to_dev(f->hot->topk_weights[rank], (size_t)T * K * 4), *y = mft_to_dev(NULL, (size_t)T * H * 2),
         *rx = mft_to_dev(NULL, (size_t)L * C * H * 2), *rsrc = mft_to_dev(NULL, (size_t)L * C * 12),
         *cnt = mft_to_dev(NULL, (size_t)L * 4);
    MFT_CHECK(x && hot && fine && wt && y && rx && rsrc && cnt);
    CUDA_OK(cudaMemset(y, MFT_POISON_BYTE, (size_t)T * H * 2));
    CUDA_OK(cudaMemset(cnt, MFT_POISON_BYTE, (size_t)L * 4));
    CUDA_OK(cudaMemsetAsync(y, MFT_POISON_BYTE, 2, st));
    CUDA_OK(cudaStreamSynchronize(st));
    pthread_barrier_wait(&f->ready);

    mf_moe_forward_in_t in = {mft_t2(x, MF_DTYPE_BF16, T, H), mft_t2(hot, MF_DTYPE_INT32, T, K), mft_t2(wt, MF_DTYPE_FP32, T, K)};
    mf_moe_forward_out_t out = {mft_t2(y, MF_DTYPE_BF16, T, H)};
    /* 1. a forward whose routing overflows expert 0: every rank fails it, y untouched */
    f->fwd[rank] = mf_moe_forward(moe[0], &in, &out, st);
    f->fwd_async[rank] = mf_comm_get_async_error(comm);
    snprintf(f->msg[rank], sizeof f->msg[rank], "%s", mf_last_error());
    f->y_untouched[rank] = dev_is_poison(y, (size_t)T * H * 2);
    pthread_barrier_wait(&f->ready);
    /* 2. a dispatch of the same routing: every rank fails it, counts untouched */
    mf_dispatch_in_t din = {in.x, in.topk_ids};
    mf_dispatch_out_t dout;
    memset(&dout, 0, sizeof dout);
    dout.recv_x = mft_t3(rx, MF_DTYPE_BF16, L, C, H);
    dout.recv_src = mft_t3(rsrc, MF_DTYPE_INT32, L, C, 3);
    dout.expert_counts = mft_t1(cnt, MF_DTYPE_INT32, L);
    f->disp[rank] = mf_dispatch(moe[0], &din, &dout, st);
    f->disp_async[rank] = mf_comm_get_async_error(comm);
    f->counts_untouched[rank] = dev_is_poison(cnt, (size_t)L * 4);
    if (f->disp[rank] == MF_SUCCESS) { /* the dispatch awaits its combine: give it one (it fails too) */
        mf_combine_in_t cin = {mft_t3(rx, MF_DTYPE_BF16, L, C, H), in.topk_weights};
        mf_combine_out_t cout = {out.y};
        (void)mf_combine(moe[0], &cin, &cout, st);
        (void)cudaStreamSynchronize(st);
        (void)mf_comm_get_async_error(comm);
    }
    pthread_barrier_wait(&f->ready);
    /* 3. ranks call different layers (fitting routing): all fail */
    in.topk_ids = mft_t2(fine, MF_DTYPE_INT32, T, K);
    (void)mf_moe_forward(moe[rank % 2], &in, &out, st);
    f->mixed_async[rank] = mf_comm_get_async_error(comm);
    snprintf(f->mixed_msg[rank], sizeof f->mixed_msg[rank], "%s", mf_last_error());
    pthread_barrier_wait(&f->ready);
    /* 4. all reported: the next call works */
    f->good[rank] = mf_moe_forward(moe[1], &in, &out, st);
    if (f->good[rank] == MF_SUCCESS) f->good[rank] = mf_comm_get_async_error(comm);
    CUDA_OK(cudaStreamSynchronize(st));
    pthread_barrier_wait(&f->ready);
    for (int l = 0; l < 2; l++) mf_moe_destroy(moe[l]);
    void *bufs[] = {w13, w2, x, hot, fine, wt, y, rx, rsrc, cnt};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaFree(bufs[i]);
    cudaStreamDestroy(st);
    return 0;
}

/* MASKED with expert_capacity 4 and every token on expert 0: the forward and the dispatch fail with
 * MF_ERR_CAPACITY on every rank (not only on expert 0's owner) and write nothing; ranks calling
 * different layers fail with MF_ERR_INVALID_USAGE; once every rank reported, the group works. And
 * more virtual ranks on one device than CUDA has hardware queues are refused at creation. */
static int cuda_faults_all_ranks(void) {
    const int32_t R = 4;
    mfp_spec_t spec;
    memset(&spec, 0, sizeof spec);
    spec.R = R, spec.E = 8, spec.K = 2, spec.H = 256, spec.I = 128, spec.S = 8, spec.T_per_rank = 8;
    spec.dtype = MF_DTYPE_BF16, spec.layout = MF_LAYOUT_MASKED, spec.routing = MFP_ROUTING_HOT, spec.hot_expert = 0;
    spec.seed = 81;
    mfp_problem_t hot, fine;
    MFT_CHECK(mfp_generate(&spec, &hot) == 0);
    spec.routing = MFP_ROUTING_UNIFORM;
    spec.T_per_rank = 1; /* 4 tokens in all: no expert can receive more than 4 rows */
    spec.seed = 82;
    MFT_CHECK(mfp_generate(&spec, &fine) == 0);
    /* same T on both problems: reuse hot's inputs with fine's ids for T = 8 */
    mfp_problem_t fine8;
    spec.T_per_rank = 8;
    MFT_CHECK(mfp_generate(&spec, &fine8) == 0);
    for (int32_t r = 0; r < R; r++)
        for (int32_t i = 0; i < 8 * spec.K; i++) fine8.topk_ids[r][i] = i < spec.K ? fine.topk_ids[r][i] : -1;
    fault_case_t f;
    memset(&f, 0, sizeof f);
    f.hot = &hot, f.fine = &fine8, f.capacity = 4;
    mf_group_config_t gc = MF_GROUP_CONFIG_INIT;
    gc.backend = MF_BACKEND_CUDA, gc.num_ranks = R, gc.timeout_ms = IPC_TIMEOUT_MS;
    MFT_CHECK_OK(mf_group_create(&gc, &f.group));
    pthread_barrier_init(&f.ready, NULL, (unsigned)R);
    int rc = mft_run_ranks(R, fault_case_rank, &f);
    pthread_barrier_destroy(&f.ready);
    MFT_CHECK_OK(mf_group_destroy(f.group));
    MFT_CHECK(rc == 0);
    for (int32_t r = 0; r < R; r++) {
        mft_verbose("  rank %d: forward %s/%s (%s); dispatch %s/%s; layers %s (%s); then %s\n", r,
                    mft_result_name(f.fwd[r]), mft_result_name(f.fwd_async[r]), f.msg[r], mft_result_name(f.disp[r]),
                    mft_result_name(f.disp_async[r]), mft_result_name(f.mixed_async[r]), f.mixed_msg[r],
                    mft_result_name(f.good[r]));
        MFT_CHECK_MSG((f.fwd[r] == MF_SUCCESS ? f.fwd_async[r] : f.fwd[r]) == MF_ERR_CAPACITY, "rank %d forward: %s / %s",
                      r, mft_result_name(f.fwd[r]), mft_result_name(f.fwd_async[r]));
        MFT_CHECK_MSG(mft_contains_ci(f.msg[r], "expert_capacity"), "rank %d: %s", r, f.msg[r]);
        MFT_CHECK_MSG(f.y_untouched[r], "rank %d: the failed forward wrote y", r);
        MFT_CHECK_MSG((f.disp[r] == MF_SUCCESS ? f.disp_async[r] : f.disp[r]) == MF_ERR_CAPACITY, "rank %d dispatch: %s / %s",
                      r, mft_result_name(f.disp[r]), mft_result_name(f.disp_async[r]));
        MFT_CHECK_MSG(f.counts_untouched[r], "rank %d: the failed dispatch wrote expert_counts", r);
        MFT_CHECK_MSG(f.mixed_async[r] == MF_ERR_INVALID_USAGE && mft_contains_ci(f.mixed_msg[r], "layer"),
                      "rank %d, different layers: %s: %s", r, mft_result_name(f.mixed_async[r]), f.mixed_msg[r]);
        MFT_CHECK_EQ_INT(f.good[r], MF_SUCCESS);
    }
    mfp_free(&hot);
    mfp_free(&fine);
    mfp_free(&fine8);

    mf_group_t g = NULL;
    gc.num_ranks = 33;
    MFT_CHECK_ERR(mf_group_create(&gc, &g), MF_ERR_NOT_SUPPORTED);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "32"));
    return 0;
}

/* ---- the nccl transport at R = 1 ----------------------------------------------------------- */

/* A comm made from an ncclComm (one rank: ncclCommInitRank over its own unique id): its allgather is
 * the bootstrap; memory through symmetric windows where the comm supports them, else the ipc
 * mappings (on one H200, NCCL 2.28.3 reported no symmetric support). y equals the same layer on a
 * local group of one rank, bit for bit. */
static int cuda_nccl_r1(void) {
    mfp_spec_t spec;
    memset(&spec, 0, sizeof spec);
    spec.R = 1, spec.E = 8, spec.K = 4, spec.H = 512, spec.I = 256, spec.S = 16, spec.T_per_rank = 16;
    spec.dtype = MF_DTYPE_FP8_E4M3, spec.layout = MF_LAYOUT_EXPERT_MAJOR, spec.seed = 91;
    mfp_problem_t p;
    MFT_CHECK(mfp_generate(&spec, &p) == 0);
    const int64_t T = p.T[0], H = spec.H, I = spec.I, K = spec.K, L = p.L;
    uint16_t *y_local = mft_alloc((size_t)T * H * 2), *y_nccl = mft_alloc((size_t)T * H * 2);
    char err[512] = "";
    MFT_CHECK_MSG(mfp_run_forward(&p, MF_BACKEND_CUDA, 1, IPC_TIMEOUT_MS, &y_local, NULL, err, sizeof err) == MF_SUCCESS,
                  "local: %s", err);

    CUDA_OK(cudaSetDevice(0));
    ncclUniqueId id;
    ncclComm_t nc;
    MFT_CHECK(ncclGetUniqueId(&id) == ncclSuccess);
    MFT_CHECK(ncclCommInitRank(&nc, 1, id, 0) == ncclSuccess);
    mf_comm_config_t cc = MF_COMM_CONFIG_INIT;
    cc.backend = MF_BACKEND_CUDA;
    cc.transport = MF_TRANSPORT_NCCL;
    cc.timeout_ms = IPC_TIMEOUT_MS;
    mf_comm_t comm = NULL;
    MFT_CHECK_ERR(mf_comm_init(&cc, 0, 1, NULL, &comm), MF_ERR_INVALID_ARGUMENT); /* nccl_comm NULL */
    cc.nccl_comm = nc;
    MFT_CHECK_ERR(mf_comm_init(&cc, 0, 2, NULL, &comm), MF_ERR_INVALID_ARGUMENT); /* its size is 1 */
    MFT_CHECK_OK(mf_comm_init(&cc, 0, 1, NULL, &comm));
    mf_transport_t tr;
    MFT_CHECK_OK(mf_comm_get_transport(comm, &tr));
    MFT_CHECK_EQ_INT(tr, MF_TRANSPORT_NCCL);
    mf_moe_config_t cfg = MF_MOE_CONFIG_INIT;
    cfg.num_experts = spec.E, cfg.num_topk = spec.K, cfg.hidden = spec.H, cfg.intermediate = spec.I;
    cfg.max_tokens_per_rank = spec.S, cfg.dtype = spec.dtype, cfg.layout = spec.layout;
    mf_moe_t moe;
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, &moe));
    void *w13 = mft_to_dev(p.w13[0], (size_t)L * 2 * I * H), *w2 = mft_to_dev(p.w2[0], (size_t)L * H * I),
         *s13 = mft_to_dev(p.w13_scales[0], (size_t)L * (2 * I / 128) * (H / 128) * 4),
         *s2 = mft_to_dev(p.w2_scales[0], (size_t)L * (H / 128) * (I / 128) * 4), *x = mft_to_dev(p.x[0], (size_t)T * H * 2),
         *ids = mft_to_dev(p.topk_ids[0], (size_t)T * K * 4), *wt = mft_to_dev(p.topk_weights[0], (size_t)T * K * 4),
         *y = mft_to_dev(NULL, (size_t)T * H * 2);
    MFT_CHECK(w13 && w2 && s13 && s2 && x && ids && wt && y);
    mf_moe_weights_t w = {mft_t3(w13, MF_DTYPE_FP8_E4M3, L, 2 * I, H), mft_t3(s13, MF_DTYPE_FP32, L, 2 * I / 128, H / 128),
                          mft_t3(w2, MF_DTYPE_FP8_E4M3, L, H, I), mft_t3(s2, MF_DTYPE_FP32, L, H / 128, I / 128)};
    MFT_CHECK_OK(mf_moe_set_weights(moe, &w));
    cudaStream_t st;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    mf_moe_forward_in_t in = {mft_t2(x, MF_DTYPE_BF16, T, H), mft_t2(ids, MF_DTYPE_INT32, T, K), mft_t2(wt, MF_DTYPE_FP32, T, K)};
    mf_moe_forward_out_t out = {mft_t2(y, MF_DTYPE_BF16, T, H)};
    MFT_CHECK_OK(mf_moe_forward(moe, &in, &out, st));
    CUDA_OK(cudaStreamSynchronize(st));
    MFT_CHECK_OK(mf_comm_get_async_error(comm));
    CUDA_OK(cudaMemcpy(y_nccl, y, (size_t)T * H * 2, cudaMemcpyDeviceToHost));
    MFT_CHECK_MSG(memcmp(y_nccl, y_local, (size_t)T * H * 2) == 0, "nccl y differs from local y (diff %.3g)",
                  mfref_diff_bf16(y_nccl, y_local, T * H));
    MFT_CHECK_OK(mf_moe_destroy(moe));
    MFT_CHECK_OK(mf_comm_destroy(comm));
    ncclCommDestroy(nc);
    void *bufs[] = {w13, w2, s13, s2, x, ids, wt, y};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaFree(bufs[i]);
    cudaStreamDestroy(st);
    free(y_local);
    free(y_nccl);
    mfp_free(&p);
    return 0;
}

const mft_test_t mft_tests_cuda_transport[] = {
    {"cuda_ipc_bitwise", cuda_ipc_bitwise, 300},
    {"cuda_ipc_comm", cuda_ipc_comm, 300},
    {"cuda_ipc_graph", cuda_ipc_graph, 300},
    {"cuda_ipc_rank_dies", cuda_ipc_rank_dies, 180},
    {"cuda_faults_all_ranks", cuda_faults_all_ranks, 300},
    {"cuda_nccl_r1", cuda_nccl_r1, 120},
    {NULL, NULL, 0},
};
