/*
 * test_transport.c (CUDA) — ranks as processes sharing the one GPU over the ipc transport (CUDA IPC
 * handles exchanged through the built-in rendezvous): y bit-identical to the same problem on
 * virtual ranks of one process (local transport).
 *
 * Without MPS the GPU time-slices between processes (a round trip of two processes spinning on each
 * other's flags took ~4.5 ms on the H200), so the cases are small and the peer timeout generous.
 * The ipc run goes first: the test process must not have touched CUDA when it forks the ranks.
 * Also here, on virtual ranks: the fault model's CUDA cases that need several ranks (a capacity
 * overflow every rank must report, ranks calling different layers) and the virtual-rank limit.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes" /* nccl.h declares f() for f(void) */
#include <nccl.h>
#pragma GCC diagnostic pop

#include "../harness.h"
#include "problem.h"
#include "ref.h"

#define IPC_TIMEOUT_MS 30000

typedef struct ipc_case {
    int32_t R, dtype, layout, dataflow;
    const int32_t *T_of_rank;
    uint64_t seed;
    mfp_problem_t p;
    uint16_t *y_ipc[MF_MAX_RANKS], *y_local[MF_MAX_RANKS];
} ipc_case_t;

static mf_result_t run_case(ipc_case_t *c, int32_t transport, char *err, int errlen) {
    mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
    o.backend = MF_BACKEND_CUDA;
    o.iters = 2;
    o.timeout_ms = IPC_TIMEOUT_MS;
    o.dataflow = c->dataflow;
    o.transport = transport;
    return mfp_run(&c->p, &o, transport == MF_TRANSPORT_IPC ? c->y_ipc : c->y_local, NULL, err, errlen);
}

/* Every case's ipc run first (this process must not touch CUDA before it forks rank processes),
 * then every local run, then the comparison. */
static int cuda_ipc_bitwise(void) {
    static const int32_t uneven[4] = {24, 0, 7, 1};
    ipc_case_t cases[3];
    memset(cases, 0, sizeof cases);
    cases[0].R = 2, cases[0].dtype = MF_DTYPE_FP8_E4M3, cases[0].layout = MF_LAYOUT_EXPERT_MAJOR;
    cases[0].dataflow = MF_DATAFLOW_AUTO, cases[0].seed = 61;
    cases[1].R = 4, cases[1].dtype = MF_DTYPE_BF16, cases[1].layout = MF_LAYOUT_MASKED;
    cases[1].dataflow = MF_DATAFLOW_PULL, cases[1].T_of_rank = uneven, cases[1].seed = 62;
    cases[2].R = 4, cases[2].dtype = MF_DTYPE_FP8_E4M3, cases[2].layout = MF_LAYOUT_MASKED;
    cases[2].dataflow = MF_DATAFLOW_UNFUSED, cases[2].T_of_rank = uneven, cases[2].seed = 63;
    const int n = (int)(sizeof cases / sizeof cases[0]);
    char err[512] = "";
    for (int i = 0; i < n; i++) {
        ipc_case_t *c = &cases[i];
        mfp_spec_t spec;
        memset(&spec, 0, sizeof spec);
        spec.R = c->R, spec.E = 4 * c->R, spec.K = 4, spec.H = 512, spec.I = 256, spec.S = 24, spec.T_per_rank = 24;
        spec.dtype = c->dtype, spec.layout = c->layout, spec.T_of_rank = c->T_of_rank;
        spec.routing = MFP_ROUTING_ZIPF, spec.zipf_s = 1.2, spec.drop_prob = 0.05, spec.seed = c->seed;
        MFT_CHECK(mfp_generate(&spec, &c->p) == 0);
        for (int32_t r = 0; r < c->R; r++) {
            c->y_ipc[r] = mft_alloc((size_t)c->p.T[r] * spec.H * 2 + 2);
            c->y_local[r] = mft_alloc((size_t)c->p.T[r] * spec.H * 2 + 2);
        }
        MFT_CHECK_MSG(run_case(c, MF_TRANSPORT_IPC, err, sizeof err) == MF_SUCCESS, "case %d: ipc (R = %d processes): %s",
                      i, (int)c->R, err);
    }
    for (int i = 0; i < n; i++) {
        ipc_case_t *c = &cases[i];
        MFT_CHECK_MSG(run_case(c, MF_TRANSPORT_LOCAL, err, sizeof err) == MF_SUCCESS, "case %d: local (R = %d threads): %s",
                      i, (int)c->R, err);
        for (int32_t r = 0; r < c->R; r++) {
            const int64_t n_el = (int64_t)c->p.T[r] * c->p.spec.H;
            MFT_CHECK_MSG(memcmp(c->y_ipc[r], c->y_local[r], (size_t)n_el * 2) == 0,
                          "case %d (R %d): rank %d: ipc y differs from local y (diff %.3g)", i, (int)c->R, (int)r,
                          mfref_diff_bf16(c->y_ipc[r], c->y_local[r], n_el));
            free(c->y_ipc[r]);
            free(c->y_local[r]);
        }
        mft_verbose("  case %d: R %d: ipc == local, bit for bit\n", i, (int)c->R);
        mfp_free(&c->p);
    }
    return 0;
}

/* ---- capacity and layer faults on every rank (virtual ranks) ----------------------------------- */

#define CUDA_OK(call)                                                                                 \
    do {                                                                                              \
        cudaError_t e_ = (call);                                                                      \
        if (e_ != cudaSuccess) MFT_FAIL("%s failed: %s", #call, cudaGetErrorString(e_));             \
    } while (0)

static void *dev_copy(const void *host, size_t bytes) {
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 16) != cudaSuccess) return NULL;
    if (bytes && host && cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) return NULL;
    return d;
}

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
    void *w13 = dev_copy(f->hot->w13[rank], (size_t)L * 2 * s->I * H * 2), *w2 = dev_copy(f->hot->w2[rank], (size_t)L * H * s->I * 2);
    MFT_CHECK(w13 && w2);
    mf_moe_weights_t w;
    memset(&w, 0, sizeof w);
    w.w13 = mft_t3(w13, MF_DTYPE_BF16, L, 2 * s->I, H);
    w.w2 = mft_t3(w2, MF_DTYPE_BF16, L, H, s->I);
    for (int l = 0; l < 2; l++) {
        MFT_CHECK_OK(mf_moe_create(comm, &cfg, &moe[l]));
        MFT_CHECK_OK(mf_moe_set_weights(moe[l], &w));
    }
    void *x = dev_copy(f->hot->x[rank], (size_t)T * H * 2), *hot = dev_copy(f->hot->topk_ids[rank], (size_t)T * K * 4),
         *fine = dev_copy(f->fine->topk_ids[rank], (size_t)T * K * 4),
         *wt = dev_copy(f->hot->topk_weights[rank], (size_t)T * K * 4), *y = dev_copy(NULL, (size_t)T * H * 2),
         *rx = dev_copy(NULL, (size_t)L * C * H * 2), *rsrc = dev_copy(NULL, (size_t)L * C * 12), *cnt = dev_copy(NULL, (size_t)L * 4);
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
    void *w13 = dev_copy(p.w13[0], (size_t)L * 2 * I * H), *w2 = dev_copy(p.w2[0], (size_t)L * H * I),
         *s13 = dev_copy(p.w13_scales[0], (size_t)L * (2 * I / 128) * (H / 128) * 4),
         *s2 = dev_copy(p.w2_scales[0], (size_t)L * (H / 128) * (I / 128) * 4), *x = dev_copy(p.x[0], (size_t)T * H * 2),
         *ids = dev_copy(p.topk_ids[0], (size_t)T * K * 4), *wt = dev_copy(p.topk_weights[0], (size_t)T * K * 4),
         *y = dev_copy(NULL, (size_t)T * H * 2);
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
    {"cuda_faults_all_ranks", cuda_faults_all_ranks, 300},
    {"cuda_nccl_r1", cuda_nccl_r1, 120},
    {NULL, NULL, 0},
};
