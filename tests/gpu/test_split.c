/*
 * test_split.c — the split halves on the device (make test-gpu), R virtual ranks of one GPU, each
 * on its own non-blocking stream.
 *
 *   cuda_split_bitwise     two micro-batches overlapped through the halves (send A, send B, receive
 *                          A, experts A, combine-send A, receive B, ...) equal mf_dispatch /
 *                          mf_combine bit for bit, BF16 / EXPERT_MAJOR and FP8 / MASKED, with
 *                          events in and out of every half, over rounds that reuse the heap slots
 *   cuda_split_send_returns  a send leaves nothing waiting on the device: rank 0 sends and its
 *                          stream drains before rank 1 has sent anything; the send's host
 *                          launch-to-return time is printed (-v)
 *   cuda_split_graph       the overlapped schedule captured once (experts = a device copy, BF16)
 *                          and replayed: y equals the eager one-call forms' on every replay
 *   cuda_split_rank_dies   a rank that stops after its dispatch send: the survivor's combine
 *                          receive fails with MF_ERR_TIMEOUT (reported by the next call / the async
 *                          error), bounded, y untouched
 * The "experts" of the bitwise case run on the host from the downloaded recv_src (a function of
 * (rank, token, k) per row), as tests/test_split.c's do.
 *
 * Host reads: a rank's thread drains its stream before it copies to pageable host memory
 * (sg_download, sg_experts): a pageable copy can hold the driver's staging buffer until its stream
 * reaches it, and a peer's thread blocked behind it never launches what that stream waits for
 * (docs/API.md section 10). Before that rule every run of cuda_split_graph stalled until the
 * timeout on the H200 (2026-12-04), which held the halves back for a session.
 */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../harness.h"
#include "cuda_test.h"

#define SG_R 2
#define SG_MB 2
#define SG_ROUNDS 3
#define SG_TIMEOUT_MS 20000
#define SG_SHORT_MS 500
#define SG_REPLAYS 10

typedef struct sg_run {
    int32_t dtype, layout;
    int64_t timeout_ms;
    mf_group_t group;
    pthread_barrier_t ready;
    volatile int32_t sent;          /* cuda_split_send_returns: rank 0's stream has drained */
    mf_result_t result[SG_R];
    int32_t untouched[SG_R];
} sg_run_t;

enum { kE = 8, kK = 3, kH = 256, kI = 128, kS = 16 };

/* One micro-batch of one rank: host inputs and the device buffers of both runs. */
typedef struct sg_batch {
    int32_t T;
    int64_t rows, L, C;
    size_t x_bytes, sc_bytes, src_bytes;
    void *x, *ids, *w;              /* device inputs */
    void *recv, *eo, *y;            /* device: recv_x | scales | src | counts | offsets; expert_out; y */
    size_t recv_bytes;
    mf_dispatch_in_t din;
    mf_dispatch_out_t dout;
    mf_combine_in_t cin;
    mf_combine_out_t cout;
} sg_batch_t;

static int sg_batch_make(sg_batch_t *b, mf_moe_t moe, int32_t dtype, int32_t layout, int32_t T, uint64_t seed) {
    mf_moe_info_t info;
    MFT_CHECK_OK(mf_moe_get_info(moe, &info));
    memset(b, 0, sizeof *b);
    b->T = T, b->L = info.num_local_slots, b->C = info.expert_capacity;
    b->rows = layout == MF_LAYOUT_MASKED ? b->L * b->C : info.max_recv_rows;
    const int fp8 = dtype == MF_DTYPE_FP8_E4M3;
    b->x_bytes = (size_t)b->rows * kH * (fp8 ? 1 : 2);
    b->sc_bytes = fp8 ? (size_t)b->rows * (kH / 128) * 4 : 0;
    b->src_bytes = (size_t)b->rows * 12;
    b->recv_bytes = b->x_bytes + b->sc_bytes + b->src_bytes + (size_t)(2 * b->L + 1) * 4;
    uint16_t *x = mft_alloc((size_t)T * kH * 2 + 2);
    int32_t *ids = mft_alloc((size_t)T * kK * 4 + 4);
    float *w = mft_alloc((size_t)T * kK * 4 + 4);
    mft_rng_t rng = {seed};
    for (int64_t i = 0; i < (int64_t)T * kH; i++) x[i] = mf_bf16_from_float((float)(mft_rng_uniform(&rng) * 4 - 2));
    for (int32_t t = 0; t < T; t++)
        for (int32_t k = 0; k < kK; k++) {
            ids[t * kK + k] = (t * 5 + k * 3 + (int32_t)(seed % 7)) % kE; /* distinct: k * 3 mod 8 differ */
            w[t * kK + k] = (float)mft_rng_uniform(&rng);
        }
    b->x = mft_to_dev(x, (size_t)T * kH * 2), b->ids = mft_to_dev(ids, (size_t)T * kK * 4);
    b->w = mft_to_dev(w, (size_t)T * kK * 4), b->recv = mft_to_dev(NULL, b->recv_bytes);
    b->eo = mft_to_dev(NULL, (size_t)b->rows * kH * 2), b->y = mft_to_dev(NULL, (size_t)T * kH * 2);
    MFT_CHECK(b->x && b->ids && b->w && b->recv && b->eo && b->y);
    free(x), free(ids), free(w);
    uint8_t *p = b->recv;
    const mf_tensor_t none = mft_none();
    uint8_t *cnt = p + b->x_bytes + b->sc_bytes + b->src_bytes;
    if (layout == MF_LAYOUT_MASKED) {
        b->dout.recv_x = mft_t3(p, (mf_dtype_t)dtype, b->L, b->C, kH);
        b->dout.recv_scales = fp8 ? mft_t3(p + b->x_bytes, MF_DTYPE_FP32, b->L, b->C, kH / 128) : none;
        b->dout.recv_src = mft_t3(p + b->x_bytes + b->sc_bytes, MF_DTYPE_INT32, b->L, b->C, 3);
        b->dout.expert_offsets = none;
        b->cin.expert_out = mft_t3(b->eo, MF_DTYPE_BF16, b->L, b->C, kH);
    } else {
        b->dout.recv_x = mft_t2(p, (mf_dtype_t)dtype, b->rows, kH);
        b->dout.recv_scales = fp8 ? mft_t2(p + b->x_bytes, MF_DTYPE_FP32, b->rows, kH / 128) : none;
        b->dout.recv_src = mft_t2(p + b->x_bytes + b->sc_bytes, MF_DTYPE_INT32, b->rows, 3);
        b->dout.expert_offsets = mft_t1(cnt + (size_t)b->L * 4, MF_DTYPE_INT32, b->L + 1);
        b->cin.expert_out = mft_t2(b->eo, MF_DTYPE_BF16, b->rows, kH);
    }
    b->dout.expert_counts = mft_t1(cnt, MF_DTYPE_INT32, b->L);
    b->din.x = mft_t2(b->x, MF_DTYPE_BF16, T, kH);
    b->din.topk_ids = mft_t2(b->ids, MF_DTYPE_INT32, T, kK);
    b->cin.topk_weights = mft_t2(b->w, MF_DTYPE_FP32, T, kK);
    b->cout.y = mft_t2(b->y, MF_DTYPE_BF16, T, kH);
    return 0;
}

static void sg_batch_free(sg_batch_t *b) {
    cudaFree(b->x), cudaFree(b->ids), cudaFree(b->w), cudaFree(b->recv), cudaFree(b->eo), cudaFree(b->y);
    memset(b, 0, sizeof *b);
}

static int sg_poison(sg_batch_t *b, cudaStream_t stream) {
    CUDA_OK(cudaMemsetAsync(b->recv, MFT_POISON_BYTE, b->recv_bytes, stream));
    CUDA_OK(cudaMemsetAsync(b->y, MFT_POISON_BYTE, (size_t)b->T * kH * 2 + 0, stream));
    return 0;
}

/* The stand-in experts: fill b's expert_out from its received rows, on `stream`. */
typedef int (*sg_experts_fn)(sg_batch_t *b, int32_t layout, cudaStream_t stream);

/* The host "experts": every received row becomes a function of its (rank, token, k). */
static int sg_experts(sg_batch_t *b, int32_t layout, cudaStream_t stream) {
    CUDA_OK(cudaStreamSynchronize(stream));
    int32_t *src = mft_alloc(b->src_bytes + (size_t)b->L * 4);
    int32_t *counts = src + 3 * b->rows;
    uint16_t *eo = mft_alloc((size_t)b->rows * kH * 2);
    CUDA_OK(cudaMemcpyAsync(src, (uint8_t *)b->recv + b->x_bytes + b->sc_bytes, b->src_bytes + (size_t)b->L * 4,
                            cudaMemcpyDeviceToHost, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    for (int64_t r = 0; r < b->rows; r++) {
        const int32_t *s = src + 3 * r;
        const int valid = layout == MF_LAYOUT_MASKED ? r % b->C < counts[r / b->C] : s[0] >= 0 && s[0] < SG_R;
        for (int64_t h = 0; h < kH; h++)
            eo[r * kH + h] = valid ? mft_route_value(s, h) : 0;
    }
    CUDA_OK(cudaMemcpyAsync(b->eo, eo, (size_t)b->rows * kH * 2, cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    free(src), free(eo);
    return 0;
}

/* Downloads recv and y of b (the whole buffers). The stream drains first: a copy into pageable
 * host memory may hold the driver's staging buffer until its stream reaches it, and a peer rank's
 * thread (virtual ranks share one process) then blocks in its own pageable copy before it launches
 * what this stream waits for (seen on the H200: a replay stalled until the 20 s timeout). */
static uint8_t *sg_download(const sg_batch_t *b, cudaStream_t stream) {
    size_t yb = (size_t)b->T * kH * 2;
    if (cudaStreamSynchronize(stream) != cudaSuccess) return NULL;
    uint8_t *h = mft_alloc(b->recv_bytes + yb + 1);
    if (cudaMemcpyAsync(h, b->recv, b->recv_bytes, cudaMemcpyDeviceToHost, stream) != cudaSuccess) return NULL;
    if (yb && cudaMemcpyAsync(h + b->recv_bytes, b->y, yb, cudaMemcpyDeviceToHost, stream) != cudaSuccess) return NULL;
    if (cudaStreamSynchronize(stream) != cudaSuccess) return NULL;
    return h;
}

static int sg_open(sg_run_t *run, int32_t rank, int32_t max_in_flight, mf_moe_t *moe, cudaStream_t *stream,
                   mf_exchange_t *x, int32_t num_x) {
    mf_comm_t comm;
    CUDA_OK(cudaSetDevice(0));
    CUDA_OK(cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking));
    MFT_CHECK_OK(mf_group_get_comm(run->group, rank, &comm));
    mf_moe_config_t cfg = MF_MOE_CONFIG_INIT;
    cfg.num_experts = kE, cfg.num_topk = kK, cfg.hidden = kH, cfg.intermediate = kI, cfg.max_tokens_per_rank = kS;
    cfg.dtype = run->dtype, cfg.layout = run->layout, cfg.max_in_flight = max_in_flight;
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, moe));
    for (int32_t i = 0; i < num_x; i++) MFT_CHECK_OK(mf_exchange_create(*moe, &x[i]));
    return 0;
}

/* The end of a healthy rank: no device fault, then every rank meets before anything is freed
 * (a free synchronises the device, which must not wait behind a peer's waiting kernel). */
static int sg_finish(sg_run_t *run, int32_t rank) {
    mf_comm_t comm;
    MFT_CHECK_OK(mf_group_get_comm(run->group, rank, &comm));
    MFT_CHECK_OK(mf_comm_get_async_error(comm));
    pthread_barrier_wait(&run->ready);
    return 0;
}

static int sg_close(mf_moe_t moe, cudaStream_t st, mf_exchange_t *x, int32_t num_x) {
    for (int32_t i = 0; i < num_x; i++) MFT_CHECK_OK(mf_exchange_destroy(x[i]));
    mf_moe_destroy(moe);
    cudaStreamDestroy(st);
    return 0;
}

/* Micro-batches one after the other through mf_dispatch / experts / mf_combine: the reference. */
static int sg_one_call(mf_moe_t moe, sg_batch_t *b, sg_experts_fn experts, int32_t layout, cudaStream_t st) {
    for (int i = 0; i < SG_MB; i++) {
        MFT_CHECK_OK(mf_dispatch(moe, &b[i].din, &b[i].dout, st));
        if (experts(&b[i], layout, st)) return 1;
        MFT_CHECK_OK(mf_combine(moe, &b[i].cin, &b[i].cout, st));
    }
    return 0;
}

/* Two micro-batches overlapped through the halves. With events (ev[i], or NULL for none), each
 * send records ev[i] (async_finish) and the receives wait for it (previous_event); with `poison`,
 * the weights of micro-batch 0 are poisoned right after its combine send (the send kept them). */
static int sg_overlapped(mf_exchange_t *x, sg_batch_t *b, sg_experts_fn experts, int32_t layout,
                         const cudaEvent_t *ev, int poison, cudaStream_t st) {
    mf_exchange_events_t fin[SG_MB], prev[SG_MB];
    for (int i = 0; i < SG_MB; i++) {
        fin[i].previous = NULL, fin[i].finished = ev ? (mf_event_t)ev[i] : NULL;
        prev[i].previous = ev ? (mf_event_t)ev[i] : NULL, prev[i].finished = NULL;
    }
    MFT_CHECK_OK(mf_dispatch_send(x[0], &b[0].din, &b[0].dout, &fin[0], st));
    MFT_CHECK_OK(mf_dispatch_send(x[1], &b[1].din, &b[1].dout, &fin[1], st));
    MFT_CHECK_OK(mf_dispatch_recv(x[0], &prev[0], st));
    if (experts(&b[0], layout, st)) return 1;
    MFT_CHECK_OK(mf_combine_send(x[0], &b[0].cin, &b[0].cout, &fin[0], st));
    if (poison) CUDA_OK(cudaMemsetAsync(b[0].w, MFT_POISON_BYTE, (size_t)b[0].T * kK * 4, st));
    MFT_CHECK_OK(mf_dispatch_recv(x[1], &prev[1], st));
    if (experts(&b[1], layout, st)) return 1;
    MFT_CHECK_OK(mf_combine_send(x[1], &b[1].cin, &b[1].cout, &fin[1], st));
    MFT_CHECK_OK(mf_combine_recv(x[0], &prev[0], st));
    MFT_CHECK_OK(mf_combine_recv(x[1], &prev[1], st));
    return 0;
}

/* ---- bitwise: overlapped halves vs the one-call forms --------------------------------------- */

static int sg_bitwise_rank(int32_t rank, void *arg) {
    sg_run_t *run = arg;
    mf_moe_t moe;
    cudaStream_t st;
    mf_exchange_t x[SG_MB];
    if (sg_open(run, rank, 2, &moe, &st, x, SG_MB)) return 1;
    cudaEvent_t ev[SG_MB];
    for (int i = 0; i < SG_MB; i++) CUDA_OK(cudaEventCreateWithFlags(&ev[i], cudaEventDisableTiming));
    /* Every round's buffers first: an allocation (or a free) may wait for the device, and so for a
     * peer's kernel that waits for this rank (tests/gpu/test_cuda.c, setup_done). */
    sg_batch_t all_ref[SG_ROUNDS][SG_MB], all_got[SG_ROUNDS][SG_MB];
    sg_batch_t(*ref)[SG_MB] = all_ref, (*got)[SG_MB] = all_got;
    for (int round = 0; round < SG_ROUNDS; round++)
        for (int i = 0; i < SG_MB; i++) {
            const int32_t T = i == 0 ? kS : kS / 2 - round;
            const uint64_t seed = mft_hash4(round, i, rank, 28);
            if (sg_batch_make(&ref[round][i], moe, run->dtype, run->layout, T, seed) ||
                sg_batch_make(&got[round][i], moe, run->dtype, run->layout, T, seed))
                return 1;
            if (sg_poison(&ref[round][i], st) || sg_poison(&got[round][i], st)) return 1;
        }
    CUDA_OK(cudaStreamSynchronize(st));
    pthread_barrier_wait(&run->ready);
    for (int round = 0; round < SG_ROUNDS; round++) {
        sg_batch_t *rf = ref[round], *gt = got[round];
        if (sg_one_call(moe, rf, sg_experts, run->layout, st) || sg_overlapped(x, gt, sg_experts, run->layout, ev, 1, st))
            return 1;
        for (int i = 0; i < SG_MB; i++) {
            uint8_t *a = sg_download(&rf[i], st), *b = sg_download(&gt[i], st);
            MFT_CHECK(a && b);
            MFT_CHECK_MSG(memcmp(a, b, rf[i].recv_bytes) == 0, "rank %d round %d mb %d: dispatch outputs differ", rank,
                          round, i);
            MFT_CHECK_MSG(memcmp(a + rf[i].recv_bytes, b + rf[i].recv_bytes, (size_t)rf[i].T * kH * 2) == 0,
                          "rank %d round %d mb %d: y differs", rank, round, i);
            free(a), free(b);
        }
    }
    if (sg_finish(run, rank)) return 1;
    for (int r = 0; r < SG_ROUNDS; r++)
        for (int i = 0; i < SG_MB; i++) sg_batch_free(&ref[r][i]), sg_batch_free(&got[r][i]);
    for (int i = 0; i < SG_MB; i++) cudaEventDestroy(ev[i]);
    return sg_close(moe, st, x, SG_MB);
}

static int sg_run(sg_run_t *run, int (*fn)(int32_t, void *)) {
    mf_group_config_t cfg = MF_GROUP_CONFIG_INIT;
    cfg.backend = MF_BACKEND_CUDA;
    cfg.num_ranks = SG_R;
    cfg.timeout_ms = run->timeout_ms;
    MFT_CHECK_OK(mf_group_create(&cfg, &run->group));
    pthread_barrier_init(&run->ready, NULL, SG_R);
    int rc = mft_run_ranks(SG_R, fn, run);
    pthread_barrier_destroy(&run->ready);
    mf_group_destroy(run->group);
    return rc;
}

static int cuda_split_bitwise(void) {
    static const int32_t kinds[][2] = {{MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR}, {MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED}};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        sg_run_t run;
        memset(&run, 0, sizeof run);
        run.dtype = kinds[k][0], run.layout = kinds[k][1], run.timeout_ms = SG_TIMEOUT_MS;
        MFT_CHECK_MSG(sg_run(&run, sg_bitwise_rank) == 0, "dtype %d layout %d", run.dtype, run.layout);
    }
    return 0;
}

/* ---- a send leaves nothing waiting ---------------------------------------------------------- */

static int sg_send_rank(int32_t rank, void *arg) {
    sg_run_t *run = arg;
    mf_moe_t moe;
    cudaStream_t st;
    mf_exchange_t x;
    sg_batch_t b;
    if (sg_open(run, rank, 2, &moe, &st, &x, 1)) return 1;
    if (sg_batch_make(&b, moe, run->dtype, run->layout, kS, mft_hash4(rank, 1, 2, 3))) return 1;
    CUDA_OK(cudaStreamSynchronize(st));
    pthread_barrier_wait(&run->ready);
    if (rank == 0) {
        double best = 1e9;
        for (int i = 0; i < 2; i++) { /* the first launches load nothing new (kernels are preloaded) */
            const double t0 = mft_now_s();
            MFT_CHECK_OK(mf_dispatch_send(x, &b.din, &b.dout, NULL, st));
            best = best < mft_now_s() - t0 ? best : mft_now_s() - t0;
            /* Drains while rank 1 has sent nothing: no kernel of the send waits for a peer. */
            const double t1 = mft_now_s();
            CUDA_OK(cudaStreamSynchronize(st));
            MFT_CHECK_MSG(mft_now_s() - t1 < 0.5 * run->timeout_ms / 1000.0, "the send's stream took %.2f s to drain",
                          mft_now_s() - t1);
            if (i == 0) {
                __atomic_store_n(&run->sent, 1, __ATOMIC_RELEASE);
                MFT_CHECK_OK(mf_dispatch_recv(x, NULL, st));
                if (sg_experts(&b, run->layout, st)) return 1;
                MFT_CHECK_OK(mf_combine_send(x, &b.cin, &b.cout, NULL, st));
                MFT_CHECK_OK(mf_combine_recv(x, NULL, st));
                CUDA_OK(cudaStreamSynchronize(st));
                pthread_barrier_wait(&run->ready);
            }
        }
        mft_verbose("  mf_dispatch_send: host launch-to-return %.1f us (best of 2)\n", best * 1e6);
        __atomic_store_n(&run->sent, 2, __ATOMIC_RELEASE);
    } else {
        while (__atomic_load_n(&run->sent, __ATOMIC_ACQUIRE) < 1) {}
        MFT_CHECK_OK(mf_dispatch_send(x, &b.din, &b.dout, NULL, st));
        MFT_CHECK_OK(mf_dispatch_recv(x, NULL, st));
        if (sg_experts(&b, run->layout, st)) return 1;
        MFT_CHECK_OK(mf_combine_send(x, &b.cin, &b.cout, NULL, st));
        MFT_CHECK_OK(mf_combine_recv(x, NULL, st));
        CUDA_OK(cudaStreamSynchronize(st));
        pthread_barrier_wait(&run->ready);
        while (__atomic_load_n(&run->sent, __ATOMIC_ACQUIRE) < 2) {}
        MFT_CHECK_OK(mf_dispatch_send(x, &b.din, &b.dout, NULL, st));
    }
    /* Both second exchanges finish normally. */
    MFT_CHECK_OK(mf_dispatch_recv(x, NULL, st));
    if (sg_experts(&b, run->layout, st)) return 1;
    MFT_CHECK_OK(mf_combine_send(x, &b.cin, &b.cout, NULL, st));
    MFT_CHECK_OK(mf_combine_recv(x, NULL, st));
    CUDA_OK(cudaStreamSynchronize(st));
    if (sg_finish(run, rank)) return 1;
    sg_batch_free(&b);
    return sg_close(moe, st, &x, 1);
}

static int cuda_split_send_returns(void) {
    sg_run_t run;
    memset(&run, 0, sizeof run);
    run.dtype = MF_DTYPE_FP8_E4M3, run.layout = MF_LAYOUT_MASKED, run.timeout_ms = SG_TIMEOUT_MS;
    return sg_run(&run, sg_send_rank);
}

/* ---- graph capture ------------------------------------------------------------------------ */

/* BF16: the experts are the identity, a device copy of recv_x into expert_out (same layout). */
static int sg_copy_experts(sg_batch_t *b, int32_t layout, cudaStream_t st) {
    (void)layout;
    CUDA_OK(cudaMemcpyAsync(b->eo, b->recv, b->x_bytes, cudaMemcpyDeviceToDevice, st));
    return 0;
}

static int sg_graph_rank(int32_t rank, void *arg) {
    sg_run_t *run = arg;
    mf_moe_t moe;
    cudaStream_t st;
    mf_exchange_t x[SG_MB];
    sg_batch_t ref[SG_MB], got[SG_MB];
    if (sg_open(run, rank, 2, &moe, &st, x, SG_MB)) return 1;
    for (int i = 0; i < SG_MB; i++) {
        const uint64_t seed = mft_hash4(7, i, rank, 0);
        if (sg_batch_make(&ref[i], moe, run->dtype, run->layout, kS - 3 * i, seed) ||
            sg_batch_make(&got[i], moe, run->dtype, run->layout, kS - 3 * i, seed))
            return 1;
    }
    CUDA_OK(cudaStreamSynchronize(st));
    pthread_barrier_wait(&run->ready);
    if (sg_one_call(moe, ref, sg_copy_experts, run->layout, st)) return 1; /* the eager reference */
    CUDA_OK(cudaStreamSynchronize(st));
    pthread_barrier_wait(&run->ready); /* captures run while no peer launches */
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    if (sg_overlapped(x, got, sg_copy_experts, run->layout, NULL, 0, st)) return 1; /* replays reuse w */
    CUDA_OK(cudaStreamEndCapture(st, &graph));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    pthread_barrier_wait(&run->ready);
    for (int rep = 0; rep < SG_REPLAYS; rep++) {
        for (int i = 0; i < SG_MB; i++)
            if (sg_poison(&got[i], st)) return 1;
        CUDA_OK(cudaGraphLaunch(exec, st));
        for (int i = 0; i < SG_MB; i++) {
            uint8_t *a = sg_download(&ref[i], st), *b = sg_download(&got[i], st);
            MFT_CHECK(a && b);
            const size_t yb = (size_t)ref[i].T * kH * 2;
            if (memcmp(a + ref[i].recv_bytes, b + ref[i].recv_bytes, yb) != 0) {
                /* written but wrong, or never written (a device fault: the comm's async error) */
                mf_comm_t comm;
                MFT_CHECK_OK(mf_group_get_comm(run->group, rank, &comm));
                const mf_result_t fault = mf_comm_get_async_error(comm);
                MFT_FAIL("rank %d replay %d mb %d: y differs from the eager one-call forms' (y %s; async error %s: %s)",
                         rank, rep, i, mft_first_unpoisoned(b + ref[i].recv_bytes, yb) < 0 ? "never written" : "written",
                         mft_result_name(fault), fault ? mf_last_error() : "");
            }
            free(a), free(b);
        }
    }
    if (sg_finish(run, rank)) return 1;
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    for (int i = 0; i < SG_MB; i++) sg_batch_free(&ref[i]), sg_batch_free(&got[i]);
    return sg_close(moe, st, x, SG_MB);
}

static int cuda_split_graph(void) {
    sg_run_t run;
    memset(&run, 0, sizeof run);
    run.dtype = MF_DTYPE_BF16, run.layout = MF_LAYOUT_EXPERT_MAJOR, run.timeout_ms = SG_TIMEOUT_MS;
    return sg_run(&run, sg_graph_rank);
}

/* ---- a rank that dies between send and receive ---------------------------------------------- */

static int sg_dies_rank(int32_t rank, void *arg) {
    sg_run_t *run = arg;
    mf_moe_t moe;
    cudaStream_t st;
    mf_exchange_t x;
    sg_batch_t b;
    if (sg_open(run, rank, 2, &moe, &st, &x, 1)) return 1;
    if (sg_batch_make(&b, moe, run->dtype, run->layout, kS, mft_hash4(rank, 9, 9, 9)) || sg_poison(&b, st)) return 1;
    CUDA_OK(cudaStreamSynchronize(st));
    pthread_barrier_wait(&run->ready);
    MFT_CHECK_OK(mf_dispatch_send(x, &b.din, &b.dout, NULL, st));
    mf_comm_t comm;
    MFT_CHECK_OK(mf_group_get_comm(run->group, rank, &comm));
    if (rank == SG_R - 1) { /* dies: no further call on the comm */
        CUDA_OK(cudaStreamSynchronize(st));
        run->result[rank] = MF_SUCCESS;
        return 0;
    }
    MFT_CHECK_OK(mf_dispatch_recv(x, NULL, st));
    if (sg_experts(&b, run->layout, st)) return 1;
    CUDA_OK(cudaMemsetAsync(b.y, MFT_POISON_BYTE, (size_t)b.T * kH * 2, st));
    MFT_CHECK_OK(mf_combine_send(x, &b.cin, &b.cout, NULL, st));
    const double t0 = mft_now_s();
    mf_result_t r = mf_combine_recv(x, NULL, st);
    if (r == MF_SUCCESS) r = mf_comm_get_async_error(comm); /* the device wait's verdict */
    run->result[rank] = r;
    mft_verbose("  rank %d: %s after %.2f s: %s\n", rank, mft_result_name(r), mft_now_s() - t0, mf_last_error());
    MFT_CHECK(mft_now_s() - t0 < 4.0 * run->timeout_ms / 1000.0 + 5.0);
    uint8_t *h = mft_alloc((size_t)b.T * kH * 2);
    CUDA_OK(cudaMemcpyAsync(h, b.y, (size_t)b.T * kH * 2, cudaMemcpyDeviceToHost, st));
    CUDA_OK(cudaStreamSynchronize(st));
    run->untouched[rank] = mft_first_unpoisoned(h, (size_t)b.T * kH * 2) < 0;
    free(h);
    return 0; /* the comm is broken; the group goes with the test */
}

static int cuda_split_rank_dies(void) {
    sg_run_t run;
    memset(&run, 0, sizeof run);
    run.dtype = MF_DTYPE_BF16, run.layout = MF_LAYOUT_MASKED, run.timeout_ms = SG_SHORT_MS;
    MFT_CHECK(sg_run(&run, sg_dies_rank) == 0);
    MFT_CHECK_MSG(run.result[0] == MF_ERR_TIMEOUT, "rank 0: %s", mft_result_name(run.result[0]));
    MFT_CHECK_MSG(run.untouched[0], "rank 0's y was written by a failed combine receive");
    return 0;
}

const mft_test_t mft_tests_cuda_split[] = {
    {"cuda_split_bitwise", cuda_split_bitwise, 300},
    {"cuda_split_send_returns", cuda_split_send_returns, 120},
    {"cuda_split_graph", cuda_split_graph, 300},
    {"cuda_split_rank_dies", cuda_split_rank_dies, 120},
    {NULL, NULL, 0},
};
