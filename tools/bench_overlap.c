/*
 * bench_overlap.c — `moeflow bench overlap`: two micro-batches of one MoE layer, their expert GEMMs
 * overlapping each other's communication through the split halves (docs/API.md section 16), beside
 * the same two run back to back (issue 28). Built into the CLI only with CUDA (tools/moeflow.c
 * dispatches here); C11 on the public API and the CUDA runtime.
 *
 * Per R (virtual ranks of one GPU, one thread each) and T (tokens per micro-batch and rank), every
 * rank holds a layer (MASKED, max_in_flight = 2) with a comm stream and a GEMM stream, and times, in
 * each of --rounds rounds, --iters iterations of each schedule (after --warmup), from an event on
 * the comm stream before the pair to one after it (the GEMM stream joined):
 *   serial   on the comm stream: mf_dispatch, mf_moe_experts, mf_combine of A, then of B (the
 *            one-call forms, nothing overlapped)
 *   overlap  comm stream: send A, send B, receive A, receive B, combine-send A, receive A,
 *            combine-send B, receive B; GEMM stream: experts A after A's dispatch receive (overlaps
 *            B's receive), experts B after B's (overlaps A's combine); the combine sends wait for
 *            their experts (events in and out of the halves)
 *   comm     serial without the experts (the communication alone)
 *   experts  mf_moe_experts of A and B alone (the compute alone)
 * hidden = serial - overlap (what the overlap saved), hidden_pct = hidden / comm. The host's
 * launch-to-return time of every dispatch send of the overlap schedule is kept (median reported).
 * Rank 0's times are reported (the ranks move in lockstep through their syncs). After the rounds,
 * y of both micro-batches from the overlap schedule is compared with the serial one bit for bit on
 * every rank (`wrong` counts differing elements; any makes the exit status 1).
 *
 * Weights are drawn once on the device for all E experts (a 16 MB random tile copied over them,
 * FP8 values in [0.5, 2) with weight scales 2^-10, or BF16); rank r of R borrows its experts' slice.
 * Inputs: x uniform in [-1, 1), K distinct uniform experts per token, weights uniform in (0, 1].
 *
 * Output: nccl-tests style (`#` metadata, one row per (R, T)); --json writes docs/DESIGN.md's record
 * (op "overlap": time_us = the overlap schedule's median over rounds; serial_us, comm_us, experts_us,
 * hidden_us, hidden_pct, send_host_us, wrong, the rounds' fields for the overlap time). Exit status
 * as tools/bench.h.
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moeflow.h"
#include "problem.h" /* mfp_barrier_t */
#include "bench.h"

#define DEF_ITERS 20
#define DEF_WARMUP 3
#define DEF_ROUNDS 3
#define MAX_LIST 16
#define TILE_BYTES ((size_t)16 << 20)
#define SPREAD_FLAG 0.05
#define PEER_FAILED -2 /* a rank stopped because another failed (rank_body) */
#define MEET_TIMEOUT_MS 600000 /* a meeting of the rank threads: far above a schedule's rounds */

enum { SERIAL, OVERLAP, COMM, EXPERTS, NMODES };
static const char *const k_modes[NMODES] = {"serial", "overlap", "comm", "experts"};

typedef struct ov_shape {
    const char *name;
    int32_t E, K, H, I, fp8;
} ov_shape_t;

static const ov_shape_t k_shapes[] = {
    {"deepseek-v3", 256, 8, 7168, 2048, 1},
    {"qwen3-235b-a22b", 128, 8, 4096, 1536, 1},
    {"tiny", 8, 2, 256, 128, 0},
};

typedef struct ov_opts {
    ov_shape_t shape;
    int32_t T[MAX_LIST], nT, R[MAX_LIST], nR;
    int32_t iters, warmup, rounds;
    const char *json;
} ov_opts_t;

/* ---- small helpers ------------------------------------------------------------------------------ */

static const char *k_who = "moeflow bench overlap";

#define CU(call)                                                                                       \
    do {                                                                                               \
        cudaError_t e_ = (call);                                                                       \
        if (e_ != cudaSuccess) {                                                                       \
            snprintf(err, err_len, "%s:%d: %s: %s", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            return -1;                                                                                 \
        }                                                                                              \
    } while (0)
#define MF(call)                                                                                       \
    do {                                                                                               \
        mf_result_t r_ = (call);                                                                       \
        if (r_ != MF_SUCCESS) {                                                                        \
            snprintf(err, err_len, "%s: %s", #call, mf_last_error());                                   \
            return -1;                                                                                 \
        }                                                                                              \
    } while (0)

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_unit(uint64_t *s) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }

static uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static mf_tensor_t tensor(void *p, mf_dtype_t dt, int ndim, int64_t d0, int64_t d1, int64_t d2) {
    mf_tensor_t t;
    memset(&t, 0, sizeof t);
    t.data = p, t.dtype = dt, t.ndim = ndim;
    t.dims[0] = d0, t.dims[1] = d1, t.dims[2] = d2;
    return t;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of n values (sorted in place); with n even the mean of the two middle ones. */
static double median(double *v, int n) {
    if (n <= 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ---- one (R, T) run ------------------------------------------------------------------------------ */

typedef struct ov_weights { /* every expert's, on the device; rank r borrows its slice */
    void *w13, *w2;
    float *s13, *s2;
} ov_weights_t;

typedef struct ov_run {
    const ov_opts_t *o;
    int32_t R, T;
    mf_group_t group;
    const ov_weights_t *w;
    mfp_barrier_t met;     /* the rank threads meet; a failing rank breaks it */
    int32_t first_failed; /* the rank that failed first (its error is the run's), -1 while none */
    /* rank 0's results */
    double round_us[NMODES][MAX_LIST];
    double send_host_us;
    /* every rank's */
    int64_t wrong[MF_MAX_RANKS];
    int failed[MF_MAX_RANKS];
    char err[MF_MAX_RANKS][512];
} ov_run_t;

typedef struct ov_mb { /* one micro-batch of one rank: its inputs, dispatch outputs and ys */
    void *x, *ids, *wts, *recv, *scales, *src, *counts, *eo, *y[3];
    mf_dispatch_in_t din;
    mf_dispatch_out_t dout;
    mf_experts_in_t ein;
    mf_experts_out_t eout;
    mf_combine_in_t cin;
    mf_combine_out_t cout[3]; /* [0] the serial schedule's y, [1] the overlap's, [2] comm's (unchecked) */
} ov_mb_t;

typedef struct ov_rank {
    mf_moe_t moe;
    mf_exchange_t x[2];
    cudaStream_t sc, sg;
    cudaEvent_t start, stop, join, dispatched[2], computed[2];
    atomic_int gate; /* 1 once the iteration is enqueued (gate_hold) */
    ov_mb_t mb[2];
} ov_rank_t;

/* A host function at the head of the comm stream that holds it until the rank's thread has enqueued
 * the whole iteration, so that the time is the device's, not the host's enqueue (moeflow bench
 * --gated). It runs on the CUDA runtime's callback thread and calls no CUDA API. */
static void CUDART_CB gate_hold(void *arg) {
    atomic_int *open = (atomic_int *)arg;
    while (!atomic_load_explicit(open, memory_order_acquire)) sched_yield();
}

static int mb_alloc(ov_mb_t *m, const ov_shape_t *s, const mf_moe_info_t *info, int32_t T, uint64_t seed, char *err,
                    size_t err_len) {
    const int64_t L = info->num_local_slots, C = info->expert_capacity, H = s->H, K = s->K;
    const mf_dtype_t dt = s->fp8 ? MF_DTYPE_FP8_E4M3 : MF_DTYPE_BF16;
    const size_t es = s->fp8 ? 1 : 2;
    CU(cudaMalloc(&m->x, (size_t)T * H * 2));
    CU(cudaMalloc(&m->ids, (size_t)T * K * 4));
    CU(cudaMalloc(&m->wts, (size_t)T * K * 4));
    CU(cudaMalloc(&m->recv, (size_t)(L * C * H) * es));
    CU(cudaMalloc(&m->scales, (size_t)(L * C * (H / 128 > 0 ? H / 128 : 1)) * 4));
    CU(cudaMalloc(&m->src, (size_t)(L * C * 3) * 4));
    CU(cudaMalloc(&m->counts, (size_t)L * 4));
    CU(cudaMalloc(&m->eo, (size_t)(L * C * H) * 2));
    for (int i = 0; i < 3; i++) CU(cudaMalloc(&m->y[i], (size_t)T * H * 2 + 2));
    /* inputs, drawn on the host (setup, before any collective) */
    uint16_t *x = malloc((size_t)T * H * 2);
    int32_t *ids = malloc((size_t)T * K * 4);
    float *wts = malloc((size_t)T * K * 4);
    if (!x || !ids || !wts) {
        free(x), free(ids), free(wts);
        snprintf(err, err_len, "out of host memory");
        return -1;
    }
    uint64_t r = seed;
    for (int64_t i = 0; i < T * H; i++) x[i] = bf16_of((float)(2.0 * rng_unit(&r) - 1.0));
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            int32_t e, dup;
            do { /* K distinct experts */
                e = (int32_t)(rng_next(&r) % (uint64_t)s->E);
                dup = 0;
                for (int64_t j = 0; j < k; j++) dup |= ids[t * K + j] == e;
            } while (dup);
            ids[t * K + k] = e;
            wts[t * K + k] = (float)(1.0 - rng_unit(&r));
        }
    cudaError_t e = cudaMemcpy(m->x, x, (size_t)T * H * 2, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(m->ids, ids, (size_t)T * K * 4, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaMemcpy(m->wts, wts, (size_t)T * K * 4, cudaMemcpyHostToDevice);
    free(x), free(ids), free(wts);
    CU(e);
    m->din.x = tensor(m->x, MF_DTYPE_BF16, 2, T, H, 0);
    m->din.topk_ids = tensor(m->ids, MF_DTYPE_INT32, 2, T, K, 0);
    m->dout.recv_x = tensor(m->recv, dt, 3, L, C, H);
    m->dout.recv_scales = s->fp8 ? tensor(m->scales, MF_DTYPE_FP32, 3, L, C, H / 128) : tensor(NULL, 0, 0, 0, 0, 0);
    m->dout.recv_src = tensor(m->src, MF_DTYPE_INT32, 3, L, C, 3);
    m->dout.expert_counts = tensor(m->counts, MF_DTYPE_INT32, 1, L, 0, 0);
    m->ein.recv_x = m->dout.recv_x;
    m->ein.recv_scales = m->dout.recv_scales;
    m->ein.expert_counts = m->dout.expert_counts;
    m->eout.expert_out = tensor(m->eo, MF_DTYPE_BF16, 3, L, C, H);
    m->cin.expert_out = m->eout.expert_out;
    m->cin.topk_weights = tensor(m->wts, MF_DTYPE_FP32, 2, T, K, 0);
    for (int i = 0; i < 3; i++) m->cout[i].y = tensor(m->y[i], MF_DTYPE_BF16, 2, T, H, 0);
    return 0;
}

static void mb_free(ov_mb_t *m) {
    void *p[] = {m->x, m->ids, m->wts, m->recv, m->scales, m->src, m->counts, m->eo, m->y[0], m->y[1], m->y[2]};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) cudaFree(p[i]);
}

/* The calls of one iteration of `mode` on rank k, after k->start on the comm stream. `send_us`: the
 * host time of each dispatch send (overlap), appended. */
static int enqueue(ov_rank_t *k, int mode, double *send_us, int *nsend, char *err, size_t err_len) {
    ov_mb_t *m = k->mb;
    if (mode == SERIAL || mode == COMM) {
        for (int i = 0; i < 2; i++) {
            MF(mf_dispatch(k->moe, &m[i].din, &m[i].dout, k->sc));
            if (mode == SERIAL) MF(mf_moe_experts(k->moe, &m[i].ein, &m[i].eout, k->sc));
            MF(mf_combine(k->moe, &m[i].cin, &m[i].cout[mode == SERIAL ? 0 : 2], k->sc));
        }
    } else if (mode == EXPERTS) {
        for (int i = 0; i < 2; i++) MF(mf_moe_experts(k->moe, &m[i].ein, &m[i].eout, k->sc));
    } else {
        mf_exchange_events_t none = {NULL, NULL};
        for (int i = 0; i < 2; i++) {
            const double t0 = now_s();
            MF(mf_dispatch_send(k->x[i], &m[i].din, &m[i].dout, &none, k->sc));
            if (send_us) send_us[(*nsend)++] = (now_s() - t0) * 1e6;
        }
        CU(cudaStreamWaitEvent(k->sg, k->start, 0));
        for (int i = 0; i < 2; i++) { /* experts of i on the GEMM stream overlap the next receive */
            mf_exchange_events_t fin = {NULL, k->dispatched[i]};
            MF(mf_dispatch_recv(k->x[i], &fin, k->sc));
            CU(cudaStreamWaitEvent(k->sg, k->dispatched[i], 0));
            MF(mf_moe_experts(k->moe, &m[i].ein, &m[i].eout, k->sg));
            CU(cudaEventRecord(k->computed[i], k->sg));
        }
        for (int i = 0; i < 2; i++) { /* A's combine overlaps B's experts */
            mf_exchange_events_t after = {k->computed[i], NULL};
            MF(mf_combine_send(k->x[i], &m[i].cin, &m[i].cout[1], &after, k->sc));
            MF(mf_combine_recv(k->x[i], NULL, k->sc));
        }
        CU(cudaEventRecord(k->join, k->sg));
        CU(cudaStreamWaitEvent(k->sc, k->join, 0));
    }
    return 0;
}

/* One iteration, bracketed by k->start / k->stop on the comm stream and gated (the gate opens also
 * when a call failed, so that the stream never stays held). */
static int schedule(ov_rank_t *k, int mode, double *send_us, int *nsend, char *err, size_t err_len) {
    atomic_store_explicit(&k->gate, 0, memory_order_release);
    CU(cudaLaunchHostFunc(k->sc, gate_hold, &k->gate));
    int rc = cudaEventRecord(k->start, k->sc) == cudaSuccess ? 0 : -1;
    if (rc) snprintf(err, err_len, "cudaEventRecord failed");
    if (!rc) rc = enqueue(k, mode, send_us, nsend, err, err_len);
    if (!rc && cudaEventRecord(k->stop, k->sc) != cudaSuccess) {
        snprintf(err, err_len, "cudaEventRecord failed");
        rc = -1;
    }
    atomic_store_explicit(&k->gate, 1, memory_order_release);
    return rc;
}

/* Runs `iters` timed iterations (events per iteration), returns their median in us. */
static int timed(ov_rank_t *k, int mode, int iters, double *med, double *send_us, int *nsend, char *err,
                 size_t err_len) {
    double *v = malloc((size_t)iters * sizeof *v);
    if (!v) {
        snprintf(err, err_len, "out of host memory");
        return -1;
    }
    for (int i = 0; i < iters; i++) { /* one pair at a time: its events are read before the next */
        if (schedule(k, mode, send_us, nsend, err, err_len)) {
            free(v);
            return -1;
        }
        float ms = 0;
        cudaError_t e = cudaEventSynchronize(k->stop);
        if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, k->start, k->stop);
        if (e != cudaSuccess) {
            free(v);
            CU(e);
        }
        v[i] = 1e3 * ms;
    }
    *med = median(v, iters);
    free(v);
    return 0;
}

static int rank_body(ov_run_t *run, int32_t rank, ov_rank_t *k, char *err, size_t err_len) {
    const ov_opts_t *o = run->o;
    const ov_shape_t *s = &o->shape;
    mf_comm_t comm;
    CU(cudaSetDevice(0));
    MF(mf_group_get_comm(run->group, rank, &comm));
    mf_moe_config_t cfg = MF_MOE_CONFIG_INIT;
    cfg.num_experts = s->E, cfg.num_topk = s->K, cfg.hidden = s->H, cfg.intermediate = s->I;
    cfg.max_tokens_per_rank = run->T, cfg.dtype = s->fp8 ? MF_DTYPE_FP8_E4M3 : MF_DTYPE_BF16;
    cfg.layout = MF_LAYOUT_MASKED, cfg.max_in_flight = 2;
    MF(mf_moe_create(comm, &cfg, &k->moe));
    mf_moe_info_t info;
    MF(mf_moe_get_info(k->moe, &info));
    const int64_t L = info.num_local_slots, f = info.first_expert, H = s->H, I = s->I;
    const size_t es = s->fp8 ? 1 : 2;
    const mf_dtype_t dt = s->fp8 ? MF_DTYPE_FP8_E4M3 : MF_DTYPE_BF16;
    mf_moe_weights_t w;
    memset(&w, 0, sizeof w);
    w.w13 = tensor((uint8_t *)run->w->w13 + (size_t)(f * 2 * I * H) * es, dt, 3, L, 2 * I, H);
    w.w2 = tensor((uint8_t *)run->w->w2 + (size_t)(f * H * I) * es, dt, 3, L, H, I);
    if (s->fp8) {
        w.w13_scales = tensor(run->w->s13 + f * (2 * I / 128) * (H / 128), MF_DTYPE_FP32, 3, L, 2 * I / 128, H / 128);
        w.w2_scales = tensor(run->w->s2 + f * (H / 128) * (I / 128), MF_DTYPE_FP32, 3, L, H / 128, I / 128);
    }
    MF(mf_moe_set_weights(k->moe, &w));
    for (int i = 0; i < 2; i++) {
        MF(mf_exchange_create(k->moe, &k->x[i]));
        if (mb_alloc(&k->mb[i], s, &info, run->T, 0x5eed0000ull + (uint64_t)rank * 16 + (uint64_t)i, err, err_len))
            return -1;
    }
    CU(cudaStreamCreateWithFlags(&k->sc, cudaStreamNonBlocking));
    CU(cudaStreamCreateWithFlags(&k->sg, cudaStreamNonBlocking));
    cudaEvent_t *evs[] = {&k->start, &k->stop, &k->join, &k->dispatched[0], &k->dispatched[1], &k->computed[0],
                          &k->computed[1]};
    for (size_t i = 0; i < sizeof evs / sizeof evs[0]; i++)
        CU(i < 2 ? cudaEventCreate(evs[i]) : cudaEventCreateWithFlags(evs[i], cudaEventDisableTiming));
    /* warm both streams with finished work (docs/API.md section 10) */
    CU(cudaMemsetAsync(k->mb[0].y[0], 0, 2, k->sc));
    CU(cudaMemsetAsync(k->mb[0].y[1], 0, 2, k->sg));
    CU(cudaDeviceSynchronize());
    if (mfp_barrier_wait(&run->met)) return PEER_FAILED;

    int nsend = 0;
    double *send_us = malloc((size_t)(o->rounds * (o->iters + o->warmup) * 2 + 2) * sizeof *send_us);
    if (!send_us) {
        snprintf(err, err_len, "out of host memory");
        return -1;
    }
    int rc = 0;
    for (int round = 0; round < o->rounds && !rc; round++)
        for (int mode = 0; mode < NMODES && !rc; mode++) {
            double med, unused;
            int none = 0;
            rc = timed(k, mode, o->warmup, &unused, NULL, &none, err, err_len) ||
                 timed(k, mode, o->iters, &med, mode == OVERLAP ? send_us : NULL, &nsend, err, err_len);
            if (!rc && rank == 0) run->round_us[mode][round] = med;
            if (!rc && mfp_barrier_wait(&run->met)) rc = PEER_FAILED; /* the ranks start each schedule together */
        }
    if (rank == 0) run->send_host_us = median(send_us, nsend);
    free(send_us);
    if (rc) return rc;
    /* the overlap's y against the serial one's, bit for bit (streams drained: no host copy waits) */
    CU(cudaStreamSynchronize(k->sc));
    CU(cudaStreamSynchronize(k->sg));
    const size_t yb = (size_t)run->T * (size_t)H * 2;
    uint16_t *a = malloc(yb + 2), *b = malloc(yb + 2);
    for (int i = 0; i < 2 && a && b; i++) {
        CU(cudaMemcpy(a, k->mb[i].y[0], yb, cudaMemcpyDeviceToHost));
        CU(cudaMemcpy(b, k->mb[i].y[1], yb, cudaMemcpyDeviceToHost));
        for (size_t j = 0; j < yb / 2; j++) run->wrong[rank] += a[j] != b[j];
    }
    free(a), free(b);
    return 0;
}

static void rank_free(ov_rank_t *k) {
    cudaStreamSynchronize(k->sc);
    cudaStreamSynchronize(k->sg);
    for (int i = 0; i < 2; i++) {
        mf_exchange_destroy(k->x[i]);
        mb_free(&k->mb[i]);
    }
    cudaEvent_t evs[] = {k->start, k->stop, k->join, k->dispatched[0], k->dispatched[1], k->computed[0], k->computed[1]};
    for (size_t i = 0; i < sizeof evs / sizeof evs[0]; i++)
        if (evs[i]) cudaEventDestroy(evs[i]);
    if (k->sc) cudaStreamDestroy(k->sc);
    if (k->sg) cudaStreamDestroy(k->sg);
    mf_moe_destroy(k->moe);
}

typedef struct ov_thread {
    ov_run_t *run;
    int32_t rank;
    ov_rank_t k;
} ov_thread_t;

static void *rank_main(void *arg) {
    ov_thread_t *t = arg;
    ov_run_t *run = t->run;
    const int rc = rank_body(run, t->rank, &t->k, run->err[t->rank], sizeof run->err[t->rank]);
    if (rc) {
        run->failed[t->rank] = 1;
        int32_t none = -1;
        if (rc != PEER_FAILED) /* the first real failure is the run's error */
            __atomic_compare_exchange_n(&run->first_failed, &none, t->rank, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        mfp_barrier_break(&run->met); /* no rank waits for this one at a meeting */
        mf_comm_t comm;
        if (mf_group_get_comm(run->group, t->rank, &comm) == MF_SUCCESS) mf_comm_abort(comm); /* nor in a collective */
    }
    return NULL;
}

/* Fills `bytes` of device memory with copies of a random tile (FP8: values in [0.5, 2) of either sign;
 * BF16: in [-1, 1)); `f32` (count floats) with `value`. */
static int fill(void *dev, size_t bytes, int fp8, float *f32, size_t count, float value, char *err, size_t err_len) {
    uint8_t *tile = malloc(TILE_BYTES);
    if (!tile) {
        snprintf(err, err_len, "out of host memory");
        return -1;
    }
    uint64_t r = 7;
    for (size_t i = 0; i < TILE_BYTES; i += 2) {
        if (fp8) {
            uint64_t v = rng_next(&r);
            tile[i] = (uint8_t)((v & 0x8f) | 0x30), tile[i + 1] = (uint8_t)(((v >> 8) & 0x8f) | 0x30);
        } else {
            uint16_t h = bf16_of((float)(2.0 * rng_unit(&r) - 1.0));
            memcpy(tile + i, &h, 2);
        }
    }
    cudaError_t e = cudaMemcpy(dev, tile, bytes < TILE_BYTES ? bytes : TILE_BYTES, cudaMemcpyHostToDevice);
    for (size_t off = TILE_BYTES; e == cudaSuccess && off < bytes; off += TILE_BYTES)
        e = cudaMemcpy((uint8_t *)dev + off, dev, bytes - off < TILE_BYTES ? bytes - off : TILE_BYTES,
                       cudaMemcpyDeviceToDevice);
    free(tile);
    CU(e);
    if (f32 && count) {
        float *h = malloc(count * sizeof *h);
        if (!h) {
            snprintf(err, err_len, "out of host memory");
            return -1;
        }
        for (size_t i = 0; i < count; i++) h[i] = value;
        e = cudaMemcpy(f32, h, count * sizeof *h, cudaMemcpyHostToDevice);
        free(h);
        CU(e);
    }
    return 0;
}

static int weights_make(const ov_shape_t *s, ov_weights_t *w, char *err, size_t err_len) {
    const size_t es = s->fp8 ? 1 : 2, E = (size_t)s->E, H = (size_t)s->H, I = (size_t)s->I;
    memset(w, 0, sizeof *w);
    CU(cudaMalloc(&w->w13, E * 2 * I * H * es));
    CU(cudaMalloc(&w->w2, E * H * I * es));
    size_t n13 = 0, n2 = 0;
    if (s->fp8) {
        n13 = E * (2 * I / 128) * (H / 128), n2 = E * (H / 128) * (I / 128);
        CU(cudaMalloc((void **)&w->s13, n13 * 4));
        CU(cudaMalloc((void **)&w->s2, n2 * 4));
    }
    if (fill(w->w13, E * 2 * I * H * es, s->fp8, w->s13, n13, 0x1p-10f, err, err_len) ||
        fill(w->w2, E * H * I * es, s->fp8, w->s2, n2, 0x1p-10f, err, err_len))
        return -1;
    return 0;
}

static void weights_free(ov_weights_t *w) {
    cudaFree(w->w13), cudaFree(w->w2), cudaFree(w->s13), cudaFree(w->s2);
}

/* One (R, T): a group of R virtual ranks, a thread each. */
static int run_one(ov_run_t *run, char *err, size_t err_len) {
    mf_group_config_t g = MF_GROUP_CONFIG_INIT;
    g.backend = MF_BACKEND_CUDA, g.num_ranks = run->R;
    MF(mf_group_create(&g, &run->group));
    mfp_barrier_init(&run->met, run->R, MEET_TIMEOUT_MS);
    run->first_failed = -1;
    ov_thread_t *t = calloc((size_t)run->R, sizeof *t);
    pthread_t *tid = calloc((size_t)run->R, sizeof *tid);
    int rc = t && tid ? 0 : -1;
    for (int32_t r = 0; r < run->R && !rc; r++) {
        t[r].run = run, t[r].rank = r;
        rc = pthread_create(&tid[r], NULL, rank_main, &t[r]) ? -1 : 0;
    }
    if (rc) mfp_barrier_break(&run->met); /* the threads started do not wait for the others */
    for (int32_t r = 0; r < run->R && tid; r++)
        if (tid[r]) pthread_join(tid[r], NULL);
    for (int32_t r = 0; r < run->R && t; r++) rank_free(&t[r].k);
    free(t), free(tid);
    mfp_barrier_fini(&run->met);
    mf_group_destroy(run->group);
    if (rc) {
        snprintf(err, err_len, "out of host memory or threads");
        return rc;
    }
    int32_t r = run->first_failed;
    for (int32_t q = 0; q < run->R && r < 0; q++) r = run->failed[q] ? q : -1;
    if (r >= 0) {
        snprintf(err, err_len, "rank %d: %s", (int)r, run->err[r]);
        return -1;
    }
    return 0;
}

/* ---- options ------------------------------------------------------------------------------------- */

static void usage(FILE *f) {
    fprintf(f,
            "usage: moeflow bench overlap [options]\n"
            "  Two micro-batches of one layer, their expert GEMMs overlapping each other's communication\n"
            "  through the split halves, beside the same pair back to back (CUDA; R virtual ranks of GPU 0).\n"
            "  --preset NAME     deepseek-v3 (default), qwen3-235b-a22b, tiny (BF16, E 8: a smoke test)\n"
            "  -T LIST           tokens per micro-batch and rank (default 64,128)\n"
            "  -R LIST           virtual ranks (default 1,8; each divides E)\n"
            "  --iters N         timed iterations per schedule and round (default %d)\n"
            "  --warmup N        untimed iterations before them (default %d)\n"
            "  --rounds N        rounds over all schedules (default %d; min / median / max)\n"
            "  --json FILE       write the record (docs/DESIGN.md \"Benchmark records\", op \"overlap\")\n",
            DEF_ITERS, DEF_WARMUP, DEF_ROUNDS);
}

static int parse_list(const char *s, int32_t *out, int32_t max) {
    int32_t n = 0;
    char *end;
    while (*s) {
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > 1 << 20 || n == max || (*end && *end != ',')) return -1;
        out[n++] = (int32_t)v;
        s = *end ? end + 1 : end;
    }
    return n;
}

static int parse_int(const char *s, int lo) {
    char *end;
    long v = strtol(s, &end, 10);
    return *s && !*end && v >= lo && v <= 1 << 20 ? (int)v : -1;
}

static void parse(int argc, char **argv, ov_opts_t *o) {
    memset(o, 0, sizeof *o);
    o->shape = k_shapes[0];
    o->T[0] = 64, o->T[1] = 128, o->nT = 2;
    o->R[0] = 1, o->R[1] = 8, o->nR = 2;
    o->iters = DEF_ITERS, o->warmup = DEF_WARMUP, o->rounds = DEF_ROUNDS;
    for (int i = 3; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            exit(0);
        }
        if (!v) cli_die(EXIT_USAGE, k_who, "%s needs a value (--help)", a);
        i++;
        if (!strcmp(a, "--preset")) {
            size_t n = sizeof k_shapes / sizeof k_shapes[0], j = 0;
            while (j < n && strcmp(k_shapes[j].name, v)) j++;
            if (j == n) cli_die(EXIT_USAGE, k_who, "--preset: unknown '%s' (deepseek-v3, qwen3-235b-a22b, tiny)", v);
            o->shape = k_shapes[j];
        } else if (!strcmp(a, "-T")) {
            if ((o->nT = parse_list(v, o->T, MAX_LIST)) < 1) cli_die(EXIT_USAGE, k_who, "-T: a list of T >= 1, not '%s'", v);
        } else if (!strcmp(a, "-R")) {
            if ((o->nR = parse_list(v, o->R, MAX_LIST)) < 1) cli_die(EXIT_USAGE, k_who, "-R: a list of R >= 1, not '%s'", v);
        } else if (!strcmp(a, "--iters")) {
            if ((o->iters = parse_int(v, 1)) < 0) cli_die(EXIT_USAGE, k_who, "--iters: an integer >= 1, not '%s'", v);
        } else if (!strcmp(a, "--warmup")) {
            if ((o->warmup = parse_int(v, 0)) < 0) cli_die(EXIT_USAGE, k_who, "--warmup: an integer >= 0, not '%s'", v);
        } else if (!strcmp(a, "--rounds")) {
            if ((o->rounds = parse_int(v, 1)) < 0 || o->rounds > MAX_LIST)
                cli_die(EXIT_USAGE, k_who, "--rounds: 1..%d, not '%s'", MAX_LIST, v);
        } else if (!strcmp(a, "--json")) {
            o->json = v;
        } else {
            cli_die(EXIT_USAGE, k_who, "unknown option '%s' (--help)", a);
        }
    }
    for (int32_t i = 0; i < o->nR; i++)
        if (o->R[i] > MF_MAX_RANKS || o->shape.E % o->R[i])
            cli_die(EXIT_USAGE, k_who, "-R %d: R must divide E = %d (and be <= %d)", (int)o->R[i], (int)o->shape.E,
                    MF_MAX_RANKS);
}

/* ---- main ---------------------------------------------------------------------------------------- */

int cli_bench_overlap_main(int argc, char **argv) {
    ov_opts_t o;
    parse(argc, argv, &o);
    if (o.json && cli_json_check_writable(o.json) != 0) cli_die(EXIT_IO, k_who, "--json %s: %s", o.json, strerror(errno));
    if (!mf_backend_available(MF_BACKEND_CUDA))
        cli_die(EXIT_USAGE, k_who, "needs a CUDA GPU (sm_90): no usable CUDA device found");
    setvbuf(stdout, NULL, _IOLBF, 0);
    const ov_shape_t *s = &o.shape;
    printf("# moeflow bench overlap: %s (E %d K %d H %d I %d %s), two micro-batches of T tokens per rank, R virtual "
           "ranks of GPU 0, MASKED, max_in_flight 2\n",
           s->name, (int)s->E, (int)s->K, (int)s->H, (int)s->I, s->fp8 ? "fp8" : "bf16");
    printf("# %d rounds x %d iterations (+%d warm-up) per schedule; times are rank 0's, the median over rounds of "
           "each round's median; hidden = serial - overlap, %% of comm\n",
           o.rounds, o.iters, o.warmup);
    printf("#%4s %6s %10s %10s %10s %10s %10s %8s %9s %8s %6s\n", "R", "T", "serial", "overlap", "comm", "experts",
           "hidden", "hidden", "send_host", "spread", "wrong");
    printf("#%4s %6s %10s %10s %10s %10s %10s %8s %9s %8s %6s\n", "", "", "(us)", "(us)", "(us)", "(us)", "(us)", "(%)",
           "(us)", "", "");
    char err[1024];
    ov_weights_t w;
    if (weights_make(s, &w, err, sizeof err)) cli_die(EXIT_IO, k_who, "weights: %s", err);
    FILE *jf = NULL;
    if (o.json) {
        if (!(jf = fopen(o.json, "w"))) cli_die(EXIT_IO, k_who, "--json %s: %s", o.json, strerror(errno));
        cli_json_meta(jf, "cuda", argc, argv);
    }
    int status = 0, first = 1;
    for (int32_t ri = 0; ri < o.nR; ri++)
        for (int32_t ti = 0; ti < o.nT; ti++) {
            ov_run_t *run = calloc(1, sizeof *run);
            if (!run) cli_die(EXIT_IO, k_who, "out of host memory");
            run->o = &o, run->R = o.R[ri], run->T = o.T[ti], run->w = &w;
            if (run_one(run, err, sizeof err)) {
                fprintf(stderr, "%s: R %d T %d: %s\n", k_who, (int)run->R, (int)run->T, err);
                status = EXIT_FAIL;
                free(run);
                continue;
            }
            double med[NMODES], lo = INFINITY, hi = 0;
            for (int m = 0; m < NMODES; m++) {
                double v[MAX_LIST];
                memcpy(v, run->round_us[m], sizeof v);
                med[m] = median(v, o.rounds);
            }
            for (int r = 0; r < o.rounds; r++) {
                lo = fmin(lo, run->round_us[OVERLAP][r]);
                hi = fmax(hi, run->round_us[OVERLAP][r]);
            }
            const double spread = o.rounds > 1 ? (hi - lo) / med[OVERLAP] : NAN;
            const double hidden = med[SERIAL] - med[OVERLAP], pct = 100.0 * hidden / med[COMM];
            int64_t wrong = 0;
            for (int32_t r = 0; r < run->R; r++) wrong += run->wrong[r];
            if (wrong) status = EXIT_FAIL;
            printf(" %4d %6d %10.1f %10.1f %10.1f %10.1f %10.1f %8.1f %9.1f %7.1f%%%s %6lld\n", (int)run->R, (int)run->T,
                   med[SERIAL], med[OVERLAP], med[COMM], med[EXPERTS], hidden, pct, run->send_host_us, 100.0 * spread,
                   spread > SPREAD_FLAG ? "!" : " ", (long long)wrong);
            if (jf) {
                fprintf(jf, "%s\n  {\"op\": \"overlap\", \"dtype\": \"%s\", \"layout\": \"masked\", \"model\": ",
                        first ? "" : ",", s->fp8 ? "fp8" : "bf16");
                cli_json_string(jf, s->name);
                fprintf(jf, ", \"shape\": {\"R\": %d, \"E\": %d, \"K\": %d, \"H\": %d, \"I\": %d, \"T\": %d, \"S\": %d}",
                        (int)run->R, (int)s->E, (int)s->K, (int)s->H, (int)s->I, (int)run->T, (int)run->T);
                const char *keys[NMODES] = {"serial_us", "time_us", "comm_us", "experts_us"};
                for (int m = 0; m < NMODES; m++) {
                    fprintf(jf, ", \"%s\": ", keys[m]);
                    cli_json_number(jf, med[m]);
                }
                fprintf(jf, ", \"hidden_us\": ");
                cli_json_number(jf, hidden);
                fprintf(jf, ", \"hidden_pct\": ");
                cli_json_number(jf, pct);
                fprintf(jf, ", \"send_host_us\": ");
                cli_json_number(jf, run->send_host_us);
                fprintf(jf, ", \"wrong\": %lld, \"iters\": %d, \"warmup\": %d, \"rounds\": %d, \"round_us\": {",
                        (long long)wrong, o.iters, o.warmup, o.rounds);
                for (int m = 0; m < NMODES; m++) {
                    fprintf(jf, "%s\"%s\": [", m ? ", " : "", k_modes[m]);
                    for (int r = 0; r < o.rounds; r++) {
                        fprintf(jf, "%s", r ? ", " : "");
                        cli_json_number(jf, run->round_us[m][r]);
                    }
                    fprintf(jf, "]");
                }
                fprintf(jf, "}, \"min_us\": ");
                cli_json_number(jf, lo);
                fprintf(jf, ", \"median_us\": ");
                cli_json_number(jf, med[OVERLAP]);
                fprintf(jf, ", \"max_us\": ");
                cli_json_number(jf, hi);
                fprintf(jf, ", \"spread\": ");
                cli_json_number(jf, spread);
                fprintf(jf, ", \"spread_flagged\": %s}", spread > SPREAD_FLAG ? "true" : "false");
                first = 0;
            }
            free(run);
        }
    if (jf) {
        fprintf(jf, "\n]}\n");
        if (fclose(jf) != 0) cli_die(EXIT_IO, k_who, "--json %s: %s", o.json, strerror(errno));
    }
    weights_free(&w);
    return status;
}
