/*
 * test_split.c — the split halves (mf_exchange_t: mf_dispatch_send / _recv, mf_combine_send / _recv)
 * on the CPU backend, threads and processes.
 *
 * Two micro-batches of one layer in flight at once, interleaved the way a dual-batch overlap runs
 * them (send A, send B, receive A, experts A, combine-send A, receive B, ..., combine-receive A, B),
 * must give, bit for bit, what the one-call mf_dispatch / mf_combine give for each micro-batch alone:
 * every output buffer is poisoned the same way before both runs and compared whole, so a row written
 * twice, to the wrong slot or not at all shows. The "experts" write each row as a function of its
 * recv_src (rank, token, k), so y checks the combine's routing too. Several rounds reuse the heap
 * slots. Misuse is refused with real errors (a receive without a send, out of order, a handle used
 * twice, more in flight than the heap holds, a forward while exchanges are in flight, events on
 * the CPU backend); a send one rank rejects fails the exchange on every rank (the others at their
 * receive) with nothing written; and a rank that dies between send and receive (a thread that
 * stops, an abort, a process that exits) makes the survivors' receive fail, bounded, writing
 * nothing.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "harness.h"

#define SP_MAX_R 4
#define SP_MB 2              /* micro-batches in flight */
#define SP_ROUNDS 3
#define SP_TIMEOUT_MS 20000  /* peer waits where nothing should time out */
#define SP_SHORT_MS 300      /* peer waits that are meant to expire */

typedef struct sp_cfg {
    int32_t R, E, K, H, I, S, dtype, layout, max_in_flight;
    int64_t timeout_ms;
} sp_cfg_t;

static mf_moe_config_t sp_layer_config(const sp_cfg_t *c) {
    mf_moe_config_t cfg = MF_MOE_CONFIG_INIT;
    cfg.num_experts = c->E, cfg.num_topk = c->K, cfg.hidden = c->H, cfg.intermediate = c->I;
    cfg.max_tokens_per_rank = c->S, cfg.dtype = c->dtype, cfg.layout = c->layout;
    cfg.max_in_flight = c->max_in_flight;
    return cfg;
}

/* One micro-batch of one rank: inputs drawn from (round, mb, rank), outputs of the dispatch and of
 * the combine, each in one allocation so that a poisoned copy compares whole. */
typedef struct sp_batch {
    int32_t T;
    uint16_t *x;        /* [T, H] */
    int32_t *ids;       /* [T, K], distinct per token, some -1 */
    float *w;           /* [T, K] */
    uint8_t *recv;      /* recv_x | recv_scales | recv_src | counts | offsets */
    size_t recv_bytes;
    uint16_t *eo;       /* expert_out, the dispatch's layout */
    uint16_t *y;        /* [T, H] */
    mf_dispatch_in_t din;
    mf_dispatch_out_t dout;
    mf_combine_in_t cin;
    mf_combine_out_t cout;
} sp_batch_t;

static void sp_batch_free(sp_batch_t *b) {
    free(b->x), free(b->ids), free(b->w), free(b->recv), free(b->eo), free(b->y);
    memset(b, 0, sizeof *b);
}

/* Allocates b for layer `moe` and draws its inputs. */
static void sp_batch_make(sp_batch_t *b, mf_moe_t moe, const sp_cfg_t *c, int32_t T, uint64_t seed) {
    mf_moe_info_t info;
    mf_moe_get_info(moe, &info);
    memset(b, 0, sizeof *b);
    const int64_t H = c->H, K = c->K, L = info.num_local_slots;
    const int64_t rows = c->layout == MF_LAYOUT_MASKED ? L * info.expert_capacity : info.max_recv_rows;
    const size_t xe = c->dtype == MF_DTYPE_FP8_E4M3 ? 1 : 2, nsc = (size_t)H / 128;
    const size_t x_bytes = (size_t)rows * H * xe, sc_bytes = c->dtype == MF_DTYPE_FP8_E4M3 ? (size_t)rows * nsc * 4 : 0;
    const size_t src_bytes = (size_t)rows * 12, cnt_bytes = (size_t)L * 4, off_bytes = (size_t)(L + 1) * 4;
    b->T = T;
    b->x = mft_alloc((size_t)T * H * 2 + 16);
    b->ids = mft_alloc((size_t)T * K * 4 + 16);
    b->w = mft_alloc((size_t)T * K * 4 + 16);
    b->recv_bytes = x_bytes + sc_bytes + src_bytes + cnt_bytes + off_bytes;
    b->recv = mft_alloc(b->recv_bytes);
    b->eo = mft_alloc((size_t)rows * H * 2);
    b->y = mft_alloc((size_t)T * H * 2 + 16);
    mft_rng_t rng = {seed};
    for (int64_t i = 0; i < T * H; i++) b->x[i] = mf_bf16_from_float((float)(mft_rng_uniform(&rng) * 4.0 - 2.0));
    for (int32_t t = 0; t < T; t++)
        for (int32_t k = 0; k < K; k++) {
            int32_t e, again;
            do { /* distinct experts per token, an occasional -1 */
                e = mft_rng_int(&rng, 8) == 0 ? -1 : mft_rng_int(&rng, c->E);
                again = 0;
                for (int32_t j = 0; j < k && e >= 0; j++) again |= b->ids[t * K + j] == e;
            } while (again);
            b->ids[t * K + k] = e;
            b->w[t * K + k] = (float)mft_rng_uniform(&rng);
        }
    uint8_t *p = b->recv;
    mf_tensor_t none = mft_none();
    if (c->layout == MF_LAYOUT_MASKED) {
        const int64_t C = info.expert_capacity;
        b->dout.recv_x = mft_t3(p, (mf_dtype_t)c->dtype, L, C, H);
        b->dout.recv_scales = sc_bytes ? mft_t3(p + x_bytes, MF_DTYPE_FP32, L, C, H / 128) : none;
        b->dout.recv_src = mft_t3(p + x_bytes + sc_bytes, MF_DTYPE_INT32, L, C, 3);
        b->dout.expert_offsets = none;
        b->cin.expert_out = mft_t3(b->eo, MF_DTYPE_BF16, L, C, H);
    } else {
        b->dout.recv_x = mft_t2(p, (mf_dtype_t)c->dtype, rows, H);
        b->dout.recv_scales = sc_bytes ? mft_t2(p + x_bytes, MF_DTYPE_FP32, rows, H / 128) : none;
        b->dout.recv_src = mft_t2(p + x_bytes + sc_bytes, MF_DTYPE_INT32, rows, 3);
        b->dout.expert_offsets = mft_t1(p + x_bytes + sc_bytes + src_bytes + cnt_bytes, MF_DTYPE_INT32, L + 1);
        b->cin.expert_out = mft_t2(b->eo, MF_DTYPE_BF16, rows, H);
    }
    b->dout.expert_counts = mft_t1(p + x_bytes + sc_bytes + src_bytes, MF_DTYPE_INT32, L);
    b->din.x = mft_t2(b->x, MF_DTYPE_BF16, T, H);
    b->din.topk_ids = mft_t2(b->ids, MF_DTYPE_INT32, T, K);
    b->cin.topk_weights = mft_t2(b->w, MF_DTYPE_FP32, T, K);
    b->cout.y = mft_t2(b->y, MF_DTYPE_BF16, T, H);
}

static void sp_poison(sp_batch_t *b, const sp_cfg_t *c) {
    mft_poison(b->recv, b->recv_bytes);
    mft_poison(b->y, (size_t)b->T * c->H * 2);
}

/* The "experts": every received row (recv_src >= 0) becomes a function of its source (rank,
 * token, k); the rest of expert_out is zero. */
static void sp_experts(sp_batch_t *b, const sp_cfg_t *c) {
    const int64_t rows = b->dout.recv_src.dims[0] * (b->dout.recv_src.ndim == 3 ? b->dout.recv_src.dims[1] : 1);
    const int32_t *src = b->dout.recv_src.data;
    const int32_t *counts = b->dout.expert_counts.data;
    const int64_t C = b->dout.recv_src.ndim == 3 ? b->dout.recv_src.dims[1] : 0;
    for (int64_t r = 0; r < rows; r++) {
        const int32_t *s = src + 3 * r;
        const int valid = C ? r % C < counts[r / C] : s[0] >= 0; /* MASKED: rows past a count are unwritten */
        for (int64_t h = 0; h < c->H; h++)
            b->eo[r * c->H + h] = valid ? mft_route_value(s, h) : 0;
    }
}

/* Both micro-batches one after the other through the one-call forms: the reference. */
static int sp_reference(mf_moe_t moe, sp_batch_t *mb, const sp_cfg_t *c) {
    for (int i = 0; i < SP_MB; i++) {
        sp_poison(&mb[i], c);
        MFT_CHECK_OK(mf_dispatch(moe, &mb[i].din, &mb[i].dout, NULL));
        sp_experts(&mb[i], c);
        MFT_CHECK_OK(mf_combine(moe, &mb[i].cin, &mb[i].cout, NULL));
    }
    return 0;
}

/* The two micro-batches overlapped through the halves, as a dual-batch overlap schedules them. */
static int sp_overlapped(mf_exchange_t *x, sp_batch_t *mb, const sp_cfg_t *c) {
    const mf_exchange_events_t none = {NULL, NULL};
    for (int i = 0; i < SP_MB; i++) sp_poison(&mb[i], c);
    MFT_CHECK_OK(mf_dispatch_send(x[0], &mb[0].din, &mb[0].dout, NULL, NULL));
    MFT_CHECK_OK(mf_dispatch_send(x[1], &mb[1].din, &mb[1].dout, &none, NULL));
    MFT_CHECK_OK(mf_dispatch_recv(x[0], NULL, NULL));
    sp_experts(&mb[0], c);
    MFT_CHECK_OK(mf_combine_send(x[0], &mb[0].cin, &mb[0].cout, NULL, NULL));
    mft_poison(mb[0].w, (size_t)mb[0].T * c->K * 4); /* the send kept its weights: reusable now */
    MFT_CHECK_OK(mf_dispatch_recv(x[1], &none, NULL));
    sp_experts(&mb[1], c);
    MFT_CHECK_OK(mf_combine_send(x[1], &mb[1].cin, &mb[1].cout, NULL, NULL));
    MFT_CHECK_OK(mf_combine_recv(x[0], NULL, NULL));
    MFT_CHECK_OK(mf_combine_recv(x[1], NULL, NULL));
    return 0;
}

/* Micro-batch i's outputs of the two runs are equal byte for byte. */
static int sp_compare(const sp_batch_t *ref, const sp_batch_t *got, const sp_cfg_t *c, int32_t rank, int round) {
    for (int i = 0; i < SP_MB; i++) {
        MFT_CHECK_MSG(memcmp(ref[i].recv, got[i].recv, ref[i].recv_bytes) == 0,
                      "rank %d round %d micro-batch %d: dispatch outputs differ from mf_dispatch's", rank, round, i);
        MFT_CHECK_MSG(memcmp(ref[i].y, got[i].y, (size_t)ref[i].T * c->H * 2) == 0,
                      "rank %d round %d micro-batch %d: y differs from mf_combine's", rank, round, i);
        MFT_CHECK_MSG(ref[i].T == 0 || mft_first_unpoisoned(got[i].y, (size_t)got[i].T * c->H * 2) >= 0,
                      "rank %d round %d micro-batch %d: y not written", rank, round, i);
    }
    return 0;
}

/* Rounds of (reference, overlapped) on one rank's layer; T of micro-batch 1 varies by round and
 * rank (0 on rank 1 in round 1). */
static int sp_rounds(mf_moe_t moe, const sp_cfg_t *c, int32_t rank) {
    mf_exchange_t x[SP_MB] = {NULL, NULL};
    sp_batch_t ref[SP_MB], got[SP_MB];
    int rc = 0;
    for (int i = 0; i < SP_MB; i++) MFT_CHECK_OK(mf_exchange_create(moe, &x[i]));
    for (int round = 0; round < SP_ROUNDS && !rc; round++) {
        for (int i = 0; i < SP_MB; i++) {
            int32_t T = i == 0 ? c->S : (round == 1 && rank == 1 ? 0 : c->S / 2 + round);
            uint64_t seed = mft_hash4(round, i, rank, 28);
            sp_batch_make(&ref[i], moe, c, T, seed);
            sp_batch_make(&got[i], moe, c, T, seed);
        }
        rc = sp_reference(moe, ref, c) || sp_overlapped(x, got, c) || sp_compare(ref, got, c, rank, round);
        for (int i = 0; i < SP_MB; i++) sp_batch_free(&ref[i]), sp_batch_free(&got[i]);
    }
    for (int i = 0; i < SP_MB; i++) MFT_CHECK_OK(mf_exchange_destroy(x[i]));
    return rc;
}

/* ---- threads ------------------------------------------------------------------------------- */

typedef struct sp_run {
    sp_cfg_t c;
    mf_group_t group;
    int32_t die_rank;   /* the rank that stops after its dispatch send (-1 none) */
    int32_t die_abort;  /* it calls mf_comm_abort before it stops */
    mf_result_t result[SP_MAX_R];
    int32_t untouched[SP_MAX_R];
    double seconds[SP_MAX_R];
} sp_run_t;

/* Rank `rank`'s comm of the run's group and its layer (collective). */
static int sp_open(sp_run_t *run, int32_t rank, mf_comm_t *comm, mf_moe_t *moe) {
    MFT_CHECK_OK(mf_group_get_comm(run->group, rank, comm));
    mf_moe_config_t cfg = sp_layer_config(&run->c);
    MFT_CHECK_OK(mf_moe_create(*comm, &cfg, moe));
    return 0;
}

static int sp_rank_rounds(int32_t rank, void *arg) {
    sp_run_t *run = arg;
    mf_comm_t comm;
    mf_moe_t moe;
    if (sp_open(run, rank, &comm, &moe)) return 1;
    int rc = sp_rounds(moe, &run->c, rank);
    mf_moe_destroy(moe);
    return rc;
}

static int sp_run_threads(sp_run_t *run, int (*fn)(int32_t, void *)) {
    run->group = mft_cpu_group(run->c.R, run->c.timeout_ms);
    MFT_CHECK(run->group);
    int rc = mft_run_ranks(run->c.R, fn, run);
    mf_group_destroy(run->group);
    return rc;
}

static sp_cfg_t sp_small(int32_t R, int32_t dtype, int32_t layout) {
    sp_cfg_t c = {R, 4 * R + 1, 3, 256, 128, 10, dtype, layout, 2, SP_TIMEOUT_MS};
    return c;
}

/* Two micro-batches in flight equal the one-call forms, bit for bit: BF16 / EXPERT_MAJOR and
 * FP8 / MASKED, R = 3, E = 13 (an uneven placement), three rounds reusing the heap slots. */
static int test_split_two_in_flight(void) {
    static const int32_t kinds[][2] = {{MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR}, {MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED}};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        sp_run_t run;
        memset(&run, 0, sizeof run);
        run.c = sp_small(3, kinds[k][0], kinds[k][1]);
        MFT_CHECK_MSG(sp_run_threads(&run, sp_rank_rounds) == 0, "dtype %d layout %d", kinds[k][0], kinds[k][1]);
    }
    return 0;
}

/* The heap holds max_in_flight copies of the layer's regions; the config is checked. */
static int test_split_heap(void) {
    sp_cfg_t c = sp_small(2, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR);
    int64_t one = 0, two = 0, dflt = 0;
    mf_moe_config_t cfg = sp_layer_config(&c);
    cfg.max_in_flight = 1;
    MFT_CHECK_OK(mf_moe_heap_bytes(&cfg, 2, &one));
    cfg.max_in_flight = 0;
    MFT_CHECK_OK(mf_moe_heap_bytes(&cfg, 2, &dflt));
    cfg.max_in_flight = 2;
    MFT_CHECK_OK(mf_moe_heap_bytes(&cfg, 2, &two));
    MFT_CHECK_EQ_INT(dflt, one);
    MFT_CHECK_EQ_INT(two, 2 * one);
    cfg.max_in_flight = MF_MAX_IN_FLIGHT + 1;
    MFT_CHECK_ERR(mf_moe_heap_bytes(&cfg, 2, &two), MF_ERR_INVALID_ARGUMENT);
    cfg.max_in_flight = -1;
    MFT_CHECK_ERR(mf_moe_heap_bytes(&cfg, 2, &two), MF_ERR_INVALID_ARGUMENT);
    return 0;
}

/* Misuse on both ranks of R = 2 (every refusal the same on both, so the collective ones meet). */
static int sp_rank_misuse(int32_t rank, void *arg) {
    sp_run_t *run = arg;
    const sp_cfg_t *c = &run->c;
    mf_comm_t comm;
    mf_moe_t moe, one;
    if (sp_open(run, rank, &comm, &moe)) return 1;
    mf_moe_config_t cfg = sp_layer_config(c);
    cfg.max_in_flight = 1;
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, &one));
    mf_exchange_t a, b;
    MFT_CHECK_OK(mf_exchange_create(moe, &a));
    MFT_CHECK_OK(mf_exchange_create(moe, &b));
    sp_batch_t mb[2];
    sp_batch_make(&mb[0], moe, c, c->S, mft_hash4(1, rank, 0, 0));
    sp_batch_make(&mb[1], moe, c, 3, mft_hash4(2, rank, 0, 0));

    /* Receives without their sends: local refusals. */
    MFT_CHECK_ERR(mf_dispatch_recv(a, NULL, NULL), MF_ERR_INVALID_USAGE);
    MFT_CHECK_ERR(mf_combine_recv(a, NULL, NULL), MF_ERR_INVALID_USAGE);
    MFT_CHECK_ERR(mf_dispatch_recv(NULL, NULL, NULL), MF_ERR_INVALID_ARGUMENT);
    /* A combine send before the dispatch was received, events on the CPU backend: collective. */
    MFT_CHECK_ERR(mf_combine_send(a, &mb[0].cin, &mb[0].cout, NULL, NULL), MF_ERR_INVALID_USAGE);
    const mf_exchange_events_t ev = {(mf_event_t)&ev, NULL};
    MFT_CHECK_ERR(mf_dispatch_send(a, &mb[0].din, &mb[0].dout, &ev, NULL), MF_ERR_INVALID_ARGUMENT);

    /* Out of order: B's dispatch receive before A's, B's combine receive before A's. */
    MFT_CHECK_OK(mf_dispatch_send(a, &mb[0].din, &mb[0].dout, NULL, NULL));
    MFT_CHECK_ERR(mf_dispatch_send(a, &mb[0].din, &mb[0].dout, NULL, NULL), MF_ERR_INVALID_USAGE); /* used twice */
    MFT_CHECK_OK(mf_dispatch_send(b, &mb[1].din, &mb[1].dout, NULL, NULL));
    MFT_CHECK_ERR(mf_dispatch_recv(b, NULL, NULL), MF_ERR_INVALID_USAGE);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "order"));
    /* Nothing else fits: more in flight than the heap holds; no forward, no one-call dispatch. */
    mf_exchange_t c3;
    MFT_CHECK_OK(mf_exchange_create(one, &c3));
    MFT_CHECK_ERR(mf_dispatch_send(c3, &mb[0].din, &mb[0].dout, NULL, NULL), MF_ERR_INVALID_USAGE);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "no free heap slot"));
    mf_moe_forward_in_t fin = {mb[0].din.x, mb[0].din.topk_ids, mb[0].cin.topk_weights};
    mf_moe_forward_out_t fout = {mb[0].cout.y};
    MFT_CHECK_ERR(mf_moe_forward(moe, &fin, &fout, NULL), MF_ERR_INVALID_USAGE);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "in flight"));
    MFT_CHECK_ERR(mf_dispatch(moe, &mb[0].din, &mb[0].dout, NULL), MF_ERR_INVALID_USAGE);
    MFT_CHECK_ERR(mf_exchange_destroy(a), MF_ERR_INVALID_USAGE);
    MFT_CHECK_OK(mf_dispatch_recv(a, NULL, NULL));
    MFT_CHECK_OK(mf_dispatch_recv(b, NULL, NULL));
    sp_experts(&mb[0], c);
    sp_experts(&mb[1], c);
    MFT_CHECK_OK(mf_combine_send(a, &mb[0].cin, &mb[0].cout, NULL, NULL));
    MFT_CHECK_OK(mf_combine_send(b, &mb[1].cin, &mb[1].cout, NULL, NULL));
    MFT_CHECK_ERR(mf_combine_recv(b, NULL, NULL), MF_ERR_INVALID_USAGE);
    MFT_CHECK_OK(mf_combine_recv(a, NULL, NULL));
    MFT_CHECK_OK(mf_combine_recv(b, NULL, NULL));
    MFT_CHECK_ERR(mf_combine_recv(b, NULL, NULL), MF_ERR_INVALID_USAGE);

    /* One rank rejects its send (a wrong x): every rank fails the exchange, nothing is written. */
    mf_dispatch_in_t bad = mb[0].din;
    if (rank == 1) bad.x.dims[1] = c->H + 8;
    sp_poison(&mb[0], c);
    mf_result_t r = mf_dispatch_send(a, &bad, &mb[0].dout, NULL, NULL);
    if (rank == 1) {
        MFT_CHECK_EQ_INT(r, MF_ERR_INVALID_ARGUMENT);
    } else {
        MFT_CHECK_OK(r);
        MFT_CHECK_ERR(mf_dispatch_recv(a, NULL, NULL), MF_ERR_INVALID_ARGUMENT);
        MFT_CHECK(mft_contains_ci(mf_last_error(), "rank 1"));
    }
    MFT_CHECK_EQ_INT(mft_first_unpoisoned(mb[0].recv, mb[0].recv_bytes), -1);
    /* ... and the next exchange on the same handle runs. */
    MFT_CHECK_OK(mf_dispatch_send(a, &mb[0].din, &mb[0].dout, NULL, NULL));
    MFT_CHECK_OK(mf_dispatch_recv(a, NULL, NULL));
    sp_experts(&mb[0], c);
    MFT_CHECK_OK(mf_combine_send(a, &mb[0].cin, &mb[0].cout, NULL, NULL));
    MFT_CHECK_OK(mf_combine_recv(a, NULL, NULL));

    /* The SMs of the communication kernels, per comm (stored on the CPU). */
    int32_t sms = -1, dflt = -1;
    MFT_CHECK_OK(mf_comm_get_num_sms(comm, &dflt));
    MFT_CHECK_OK(mf_comm_set_num_sms(comm, 7));
    MFT_CHECK_OK(mf_comm_get_num_sms(comm, &sms));
    MFT_CHECK_EQ_INT(sms, 7);
    MFT_CHECK_ERR(mf_comm_set_num_sms(comm, -1), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_OK(mf_comm_set_num_sms(comm, 0));
    MFT_CHECK_OK(mf_comm_get_num_sms(comm, &sms));
    MFT_CHECK_EQ_INT(sms, dflt);

    MFT_CHECK_OK(mf_exchange_destroy(a));
    MFT_CHECK_OK(mf_exchange_destroy(b));
    MFT_CHECK_OK(mf_exchange_destroy(c3));
    MFT_CHECK_OK(mf_exchange_destroy(NULL));
    sp_batch_free(&mb[0]);
    sp_batch_free(&mb[1]);
    mf_moe_destroy(one);
    mf_moe_destroy(moe);
    return 0;
}

static int test_split_misuse(void) {
    sp_run_t run;
    memset(&run, 0, sizeof run);
    run.c = sp_small(2, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR);
    return sp_run_threads(&run, sp_rank_misuse);
}

/* A rank that dies between its dispatch send and its receive: the survivors' dispatch receive
 * still lands its rows (the rank had sent them), their combine receive then waits for it and fails
 * with MF_ERR_TIMEOUT (or MF_ERR_ABORTED after an abort) within the timeout, y untouched. */
static int sp_dying_rank(int32_t rank, mf_comm_t comm, mf_moe_t moe, const sp_cfg_t *c, int32_t die_rank,
                         int32_t die_abort, mf_exchange_t *handle, mf_result_t *result, int32_t *untouched,
                         double *seconds) {
    mf_exchange_t x;
    sp_batch_t mb;
    MFT_CHECK_OK(mf_exchange_create(moe, &x));
    *handle = x;
    sp_batch_make(&mb, moe, c, c->S, mft_hash4(5, rank, 0, 0));
    MFT_CHECK_OK(mf_dispatch_send(x, &mb.din, &mb.dout, NULL, NULL));
    if (rank == die_rank) {
        if (die_abort) MFT_CHECK_OK(mf_comm_abort(comm));
        sp_batch_free(&mb);
        *result = MF_SUCCESS;
        return 0; /* dies: no more calls on the comm (its exchange stays in flight until its layer goes) */
    }
    MFT_CHECK_OK(mf_dispatch_recv(x, NULL, NULL));
    sp_experts(&mb, c);
    mft_poison(mb.y, (size_t)mb.T * c->H * 2);
    MFT_CHECK_OK(mf_combine_send(x, &mb.cin, &mb.cout, NULL, NULL));
    double t0 = mft_now_s();
    *result = mf_combine_recv(x, NULL, NULL);
    *seconds = mft_now_s() - t0;
    mft_verbose("  rank %d: mf_combine_recv -> %s after %.2f s: %s\n", rank, mft_result_name(*result), *seconds,
                mf_last_error());
    *untouched = mft_first_unpoisoned(mb.y, (size_t)mb.T * c->H * 2) < 0;
    sp_batch_free(&mb);
    return 0; /* the failed receive ended the exchange */
}

static int sp_rank_dies(int32_t rank, void *arg) {
    sp_run_t *run = arg;
    mf_comm_t comm;
    mf_moe_t moe;
    if (sp_open(run, rank, &comm, &moe)) return 1;
    mf_exchange_t x = NULL;
    int rc = sp_dying_rank(rank, comm, moe, &run->c, run->die_rank, run->die_abort, &x, &run->result[rank],
                           &run->untouched[rank], &run->seconds[rank]);
    mf_moe_destroy(moe); /* also ends the dead rank's exchange, whose handle can then go */
    MFT_CHECK_OK(mf_exchange_destroy(x));
    return rc;
}

/* The survivors' verdicts: `code`, y untouched, within a few timeouts. */
static int sp_check_survivors(const sp_cfg_t *c, int32_t die_rank, const mf_result_t *result, const int32_t *untouched,
                              const double *seconds, mf_result_t code) {
    for (int32_t r = 0; r < c->R; r++) {
        if (r == die_rank) continue;
        MFT_CHECK_MSG(result[r] == code, "rank %d: %s, expected %s", r, mft_result_name(result[r]), mft_result_name(code));
        MFT_CHECK_MSG(untouched[r], "rank %d: y was written by a failed combine receive", r);
        MFT_CHECK_MSG(seconds[r] < 4.0 * (double)c->timeout_ms / 1000.0 + 2.0, "rank %d waited %.2f s", r, seconds[r]);
    }
    return 0;
}

static int test_split_rank_dies(void) {
    for (int32_t abort_ = 0; abort_ <= 1; abort_++) {
        sp_run_t run;
        memset(&run, 0, sizeof run);
        run.c = sp_small(3, MF_DTYPE_BF16, MF_LAYOUT_MASKED);
        run.c.timeout_ms = SP_SHORT_MS;
        run.die_rank = 2;
        run.die_abort = abort_;
        MFT_CHECK(sp_run_threads(&run, sp_rank_dies) == 0);
        if (sp_check_survivors(&run.c, run.die_rank, run.result, run.untouched, run.seconds,
                               abort_ ? MF_ERR_ABORTED : MF_ERR_TIMEOUT))
            return 1;
    }
    return 0;
}

/* ---- processes (the ipc transport over POSIX shared memory) -------------------------------- */

typedef struct sp_shared {
    char address[MF_ADDRESS_BYTES];
    mf_result_t result[SP_MAX_R];
    int32_t untouched[SP_MAX_R];
    double seconds[SP_MAX_R];
} sp_shared_t;

typedef struct sp_proc {
    sp_cfg_t c;
    sp_shared_t *sh;
} sp_proc_t;

/* One rank process: the overlapped rounds against the one-call forms over ipc, then the dying
 * exchange (rank R - 1 exits after its dispatch send). */
static int sp_rank_process(int32_t rank, void *arg) {
    const sp_proc_t *pr = arg;
    const sp_cfg_t *c = &pr->c;
    mf_bootstrap_t boot;
    MFT_CHECK_OK(mf_rendezvous_bootstrap(pr->sh->address, rank, c->R, SP_TIMEOUT_MS, &boot));
    mf_comm_config_t cc = MF_COMM_CONFIG_INIT;
    cc.backend = MF_BACKEND_CPU;
    cc.timeout_ms = c->timeout_ms;
    mf_comm_t comm;
    MFT_CHECK_OK(mf_comm_init(&cc, rank, c->R, &boot, &comm));
    mf_transport_t tr;
    MFT_CHECK_OK(mf_comm_get_transport(comm, &tr));
    MFT_CHECK_EQ_INT(tr, MF_TRANSPORT_IPC);
    mf_moe_t moe;
    mf_moe_config_t cfg = sp_layer_config(c);
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, &moe));
    if (sp_rounds(moe, c, rank)) return 1;
    const int32_t die = c->R - 1;
    mf_exchange_t x = NULL;
    if (sp_dying_rank(rank, comm, moe, c, die, 0, &x, &pr->sh->result[rank], &pr->sh->untouched[rank],
                      &pr->sh->seconds[rank]))
        return 1;
    if (rank == die) _exit(0); /* dies holding its comm: nothing is torn down */
    MFT_CHECK_OK(mf_exchange_destroy(x));
    mf_moe_destroy(moe);
    mf_comm_destroy(comm); /* broken by the timeout: no peer is waited for */
    return 0;
}

static int test_split_ipc(void) {
    sp_proc_t pr;
    pr.c = sp_small(3, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR);
    pr.c.timeout_ms = 2000; /* the rounds must not time out on a loaded machine; the death must */
    pr.sh = mmap(NULL, sizeof *pr.sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    MFT_CHECK(pr.sh != MAP_FAILED);
    memset(pr.sh, 0, sizeof *pr.sh);
    MFT_CHECK_OK(mf_rendezvous_address(pr.sh->address));
    MFT_CHECK_EQ_INT(mft_fork_ranks(pr.c.R, sp_rank_process, &pr, 60.0), 0);
    int rc = sp_check_survivors(&pr.c, pr.c.R - 1, pr.sh->result, pr.sh->untouched, pr.sh->seconds, MF_ERR_TIMEOUT);
    munmap(pr.sh, sizeof *pr.sh);
    return rc;
}

const mft_test_t mft_tests_split[] = {
    {"split_heap", test_split_heap, 0},
    {"split_two_in_flight", test_split_two_in_flight, 60},
    {"split_misuse", test_split_misuse, 60},
    {"split_rank_dies", test_split_rank_dies, 30},
    {"split_ipc", test_split_ipc, 90},
    {NULL, NULL, 0},
};
