/*
 * backend.c — the CPU backend: the oracle every other backend is judged against. Plain C11; each
 * rank runs on its caller's thread (a thread of one process over the local transport, or a process
 * over ipc's shared memory); ranks meet only through the symmetric heaps and the epoch signals (no
 * lock around whole operations).
 *
 * One forward on rank r, docs/DESIGN.md's unfused dataflow:
 *   prepare   publish T, x (FP8 1x128 + scales, or BF16), topk ids and weights in r's heap
 *   dispatch  signal + wait (phase DISPATCH); plan from every rank's ids; gather the routed rows
 *             from the peers' heaps into the layer's receive buffer, in the configured layout
 *   w13       per local expert: W13 GEMM, h = silu(g) * u, FP8 1x128 requant (or BF16 rounding)
 *   w2        W2 GEMM, rounded to BF16, written into the token owner's combine slot (token, k)
 *   combine   signal + wait (phase COMBINE); y[t] = bf16(sum over k ascending of w * slot[t, k])
 * Buffer reuse without clearing: a rank publishes call n+1 only after the COMBINE wait of call n,
 * which every peer reaches only after it finished reading the publications of call n; a peer
 * writes my combine slots for call n+1 only after the DISPATCH wait of n+1, which I reach only
 * after summing call n. mf_dispatch / mf_combine follow the same two phases. The split halves
 * (mf_dispatch_send / _recv, mf_combine_send / _recv) cut each phase at its arrival: the send
 * publishes (or returns rows) and arrives, the receive waits and plans / sums, in the exchange's
 * heap slot and with the plan of that slot (core/moe.c "exchanges" carries the argument over).
 *
 * Balanced EP (docs/DESIGN.md "Balanced EP"): the plan's units are slots (Lp static, B spare); a
 * static slot's weights are the caller's, a spare slot's are in the layer's spare allocation. A
 * mapped placement (uneven LINEAR, ROUND_ROBIN) is such a map, its empty slots (-1, the last of a
 * rank) never holding rows, so their weights, past the caller's [L_r, ...], are never read.
 * mf_moe_prefetch, between forward n and n+1, pushes experts into peers' spare slots. No extra
 * synchronisation: a peer read its spare slots of call n before its COMBINE arrival of n, which
 * this rank waited for before returning from forward n; it reads them again for n + 1 only after
 * the DISPATCH wait of n + 1, which this rank reaches only after its prefetch.
 */
#include <string.h>
#include <time.h>

#include "balance/planner.h"
#include "balance/stage.h"
#include "core/alloc.h"
#include "core/backend.h"
#include "core/debug.h"
#include "core/errors.h"
#include "core/handles.h"
#include "core/layout.h"
#include "core/numerics.h"
#include "core/quant.h"
#include "core/tensor.h"
#include "cpu/gemm.h"
#include "cpu/sync.h"
#include "plan/plan.h"

typedef struct mf__cpu_moe {
    /* One plan per heap slot (config.max_in_flight): an exchange's plan lives from its dispatch
     * receive to its combine send; mf_moe_forward uses slot 0's. */
    mf__plan_t plans[MF_MAX_IN_FLIGHT];
    /* Receive buffer of mf_moe_forward, in the layer's layout: rows = max_recv_rows or L * C. */
    void *recv_x;       /* [rows, H] FP8 or BF16 */
    float *recv_scales; /* [rows, H/128] (FP8) */
    /* Row-chunk scratch of the expert MLP. */
    float *a;           /* [MF__CPU_ROWS, max(H, I)] decoded operand */
    float *a_scales;    /* [MF__CPU_ROWS, max(H, I)/128] */
    float *c;           /* [MF__CPU_ROWS, max(2I, H)] GEMM output */
    uint8_t *hq;        /* [MF__CPU_ROWS, I] requantised h (FP8) */
    uint16_t *part;     /* [H] one W2 partial rounded to BF16 */
    float *acc;         /* [H] combine accumulator */
    mf_phase_times_t times;
    /* Balanced EP. */
    int32_t *resident;      /* [R * B] expert in each rank's spare slot j (-1 = empty); all ranks alike */
    int32_t *next;          /* [R * B] scratch: the table a prefetch computes */
    int32_t *prev_counts;   /* [E] global counts of the last successful forward */
    int32_t have_prev;
    uint32_t prefetches;    /* mf_moe_prefetch calls so far (published, checked equal) */
    uint32_t weights_seen;  /* moe->weights_count when `resident` was last valid */
    int64_t recv_rows[MF_MAX_RANKS], home_rows[MF_MAX_RANKS];
    int64_t prefetch_bytes, prefetch_bytes_all;
} mf__cpu_moe_t;

static double mf__now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

/* Pointer to region `offset` of rank r's heap. */
static uint8_t *mf__heap(mf_moe_t moe, int32_t r, size_t offset) {
    return (uint8_t *)moe->comm->heap.peers[r] + offset;
}

/* ---- group / comm / heap ------------------------------------------------------------------ */

static int32_t mf__cpu_available(void) { return 1; }

static mf_result_t mf__cpu_device_id(mf_comm_t comm, char id[64]) {
    (void)comm;
    id[0] = '\0';
    return MF_SUCCESS;
}

static mf_result_t mf__cpu_comm_init(mf_comm_t comm) {
    (void)comm; /* the CPU backend keeps no per-rank state beyond the comm's */
    return MF_SUCCESS;
}

static void mf__cpu_comm_fini(mf_comm_t comm) { (void)comm; }

static mf_result_t mf__cpu_mem_alloc(mf_comm_t comm, size_t bytes, void **ptr) {
    *ptr = mf__calloc(1, bytes);
    if (!*ptr)
        return mf__error(MF_ERR_OUT_OF_MEMORY, "cpu backend: rank %d: out of host memory for %zu symmetric bytes",
                         comm->rank, bytes);
    return MF_SUCCESS;
}

static void mf__cpu_mem_free(mf_comm_t comm, void *ptr) {
    (void)comm;
    mf__free(ptr);
}

static void mf__cpu_abort(mf_comm_t comm) { mf__cpu_signal_abort(comm); }

static mf_result_t mf__cpu_get_async_error(mf_comm_t comm) {
    (void)comm; /* every CPU fault is reported synchronously */
    return MF_SUCCESS;
}

/* ---- layer -------------------------------------------------------------------------------- */

static void mf__cpu_moe_fini(mf_moe_t moe) {
    mf__cpu_moe_t *s = moe->backend_state;
    if (!s) return;
    for (int32_t i = 0; i < MF_MAX_IN_FLIGHT; i++) mf__plan_fini(&s->plans[i]);
    mf__free(s->recv_x);
    mf__free(s->recv_scales);
    mf__free(s->a);
    mf__free(s->a_scales);
    mf__free(s->c);
    mf__free(s->hq);
    mf__free(s->part);
    mf__free(s->acc);
    mf__free(s->resident);
    mf__free(s->next);
    mf__free(s->prev_counts);
    mf__free(s);
    moe->backend_state = NULL;
}

static mf_result_t mf__cpu_moe_init(mf_moe_t moe) {
    const mf_moe_config_t *c = &moe->config;
    mf__cpu_moe_t *s = mf__calloc(1, sizeof *s);
    if (!s) return mf__error(MF_ERR_OUT_OF_MEMORY, "cpu backend: out of host memory");
    moe->backend_state = s;
    for (int32_t i = 0; i < moe->heap.num_slots; i++) {
        mf_result_t res = mf__plan_init(&s->plans[i], c, moe->info.num_ranks, moe->info.rank);
        if (res != MF_SUCCESS) {
            mf__cpu_moe_fini(moe);
            return res;
        }
    }
    int64_t H = c->hidden, I = c->intermediate, KMAX = H > I ? H : I, NMAX = 2 * I > H ? 2 * I : H;
    int64_t rows = c->layout == MF_LAYOUT_MASKED ? (int64_t)s->plans[0].num_local * c->expert_capacity
                                                 : c->max_recv_rows;
    int fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    s->recv_x = mf__malloc((size_t)(rows * H) * (fp8 ? 1 : 2));
    s->recv_scales = fp8 ? mf__malloc((size_t)(rows * (H / MF__QUANT_BLOCK)) * sizeof(float)) : NULL;
    s->a = mf__malloc((size_t)(MF__CPU_ROWS * KMAX) * sizeof(float));
    s->a_scales = mf__malloc((size_t)(MF__CPU_ROWS * mf__ceil_div(KMAX, MF__QUANT_BLOCK)) * sizeof(float));
    s->c = mf__malloc((size_t)(MF__CPU_ROWS * NMAX) * sizeof(float));
    s->hq = mf__malloc((size_t)(MF__CPU_ROWS * I));
    s->part = mf__malloc((size_t)H * sizeof(uint16_t));
    s->acc = mf__malloc((size_t)H * sizeof(float));
    size_t RB = (size_t)moe->info.num_ranks * (size_t)c->spare_slots;
    s->resident = mf__malloc((RB ? RB : 1) * sizeof(int32_t));
    s->next = mf__malloc((RB ? RB : 1) * sizeof(int32_t));
    s->prev_counts = mf__calloc((size_t)c->num_experts, sizeof(int32_t));
    for (size_t i = 0; s->resident && i < RB; i++) s->resident[i] = -1;
    if (!s->recv_x || (fp8 && !s->recv_scales) || !s->a || !s->a_scales || !s->c || !s->hq || !s->part ||
        !s->acc || !s->resident || !s->next || !s->prev_counts) {
        mf__cpu_moe_fini(moe);
        return mf__error(MF_ERR_OUT_OF_MEMORY, "cpu backend: out of host memory for a %lld-row receive buffer",
                         (long long)rows);
    }
    return MF_SUCCESS;
}

static mf_result_t mf__cpu_get_phase_times(mf_moe_t moe, mf_phase_times_t *times) {
    *times = ((mf__cpu_moe_t *)moe->backend_state)->times;
    return MF_SUCCESS;
}

/* ---- prepare: publish this rank's tokens -------------------------------------------------- */

/* Into the regions `regions` (the layer's slot 0, or an exchange's slot). */
static void mf__cpu_publish(mf_moe_t moe, const mf__heap_layout_t *regions, const mf_tensor_t *x, const mf_tensor_t *ids,
                            const float *weights) {
    const mf_moe_config_t *c = &moe->config;
    int32_t r = moe->comm->rank, T = (int32_t)x->dims[0], K = c->num_topk;
    int64_t H = c->hidden;
    mf__cpu_moe_t *st = moe->backend_state;
    int32_t *meta = (int32_t *)mf__heap(moe, r, regions->meta);
    meta[0] = T;
    meta[1] = (int32_t)moe->map_hash;
    meta[2] = (int32_t)st->prefetches;
    meta[3] = (int32_t)moe->weights_count;
    const uint16_t *xs = (const uint16_t *)x->data;
    if (c->dtype == MF_DTYPE_FP8_E4M3) {
        uint8_t *q = mf__heap(moe, r, regions->x);
        float *sc = (float *)mf__heap(moe, r, regions->scales);
        mf__quant_1x128_bf16(xs, (int64_t)T * H, c->ue8m0_scales, q, sc);
    } else if (T) {
        memcpy(mf__heap(moe, r, regions->x), xs, (size_t)(T * H) * 2);
    }
    if (T) {
        memcpy(mf__heap(moe, r, regions->ids), ids->data, (size_t)T * K * sizeof(int32_t));
        if (weights) memcpy(mf__heap(moe, r, regions->weights), weights, (size_t)T * K * sizeof(float));
    }
}

/* ---- dispatch: plan + gather -------------------------------------------------------------- */

/* Waits for every rank's DISPATCH arrival `epoch` (their publications in the regions `regions`) and builds
 * `plan`; on a capacity error, every rank waits until all have stopped reading the publications
 * before returning it. */
static mf_result_t mf__cpu_exchange_and_plan(mf_moe_t moe, const mf__heap_layout_t *regions, mf__plan_t *plan,
                                             uint64_t epoch) {
    mf__cpu_moe_t *s = moe->backend_state;
    mf_comm_t comm = moe->comm;
    int32_t R = comm->num_ranks;
    MF_CHECK(mf__cpu_wait(comm, MF__PHASE_DISPATCH, epoch, moe->id, "dispatch"));
    const int32_t *ids[MF_MAX_RANKS];
    int32_t T[MF_MAX_RANKS];
    for (int32_t r = 0; r < R; r++) {
        T[r] = *(const int32_t *)mf__heap(moe, r, regions->meta);
        ids[r] = (const int32_t *)mf__heap(moe, r, regions->ids);
    }
    /* Every rank must run the same map, have made the same prefetches and weight settings (the
     * spare table is a function of them); all read the same metas, so all reach one verdict. */
    mf_result_t res = MF_SUCCESS;
    const int32_t *meta0 = (const int32_t *)mf__heap(moe, 0, regions->meta);
    static const char *const what[MF__META_WORDS] = {"", "expert map (mf_moe_set_expert_map)",
                                                     "mf_moe_prefetch calls", "mf_moe_set_weights calls"};
    for (int32_t r = 1; r < R && res == MF_SUCCESS; r++) {
        const int32_t *meta = (const int32_t *)mf__heap(moe, r, regions->meta);
        for (int32_t w = 1; w < MF__META_WORDS && res == MF_SUCCESS; w++)
            if (meta[w] != meta0[w] && (w != 3 || moe->config.spare_slots > 0))
                res = mf__error(MF_ERR_INVALID_USAGE,
                                "mf_moe_forward: rank %d and rank 0 differ in their %s (0x%x and 0x%x); every rank "
                                "makes the same balancing calls; nothing was written", r, what[w], (unsigned)meta[w],
                                (unsigned)meta0[w]);
    }
    if (res == MF_SUCCESS) {
        const int32_t *spare = moe->config.spare_slots && s->weights_seen == moe->weights_count ? s->resident : NULL;
        res = mf__plan_build(plan, moe->config.num_topk, ids, T, moe->expert_map, spare);
    }
    if (res == MF_SUCCESS) {
        memcpy(s->prev_counts, plan->global_counts, (size_t)moe->config.num_experts * sizeof(int32_t));
        s->have_prev = 1;
        memcpy(s->recv_rows, plan->load, sizeof s->recv_rows);
        memcpy(s->home_rows, plan->home_load, sizeof s->home_rows);
    }
    if (res != MF_SUCCESS) {
        char why[512];
        strncpy(why, mf_last_error(), sizeof why - 1);
        why[sizeof why - 1] = '\0';
        MF_CHECK(mf__cpu_wait(comm, MF__PHASE_ABORT, mf__cpu_arrive(comm, MF__PHASE_ABORT, moe->id, MF_SUCCESS), moe->id,
                              "dispatch"));
        return mf__error(res, "%s", why);
    }
    return MF_SUCCESS;
}

/* Copies every planned row from its owner's heap into recv_x (+ scales) and writes recv_src. */
static void mf__cpu_gather(mf_moe_t moe, const mf__heap_layout_t *regions, const mf__plan_t *p, void *recv_x,
                           float *recv_scales, int32_t *recv_src) {
    const mf_moe_config_t *c = &moe->config;
    int fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    size_t row_bytes = (size_t)c->hidden * (fp8 ? 1 : 2), nsc = (size_t)c->hidden / MF__QUANT_BLOCK;
    for (int32_t e = 0; e < p->num_local; e++) {
        int64_t end = p->layout == MF_LAYOUT_MASKED ? p->offsets[e] + p->counts[e] : p->offsets[e + 1];
        for (int64_t row = p->offsets[e]; row < end; row++) {
            const int32_t *src = p->src + 3 * row;
            if (recv_src) memcpy(recv_src + 3 * row, src, 3 * sizeof(int32_t));
            if (src[0] < 0) continue; /* EXPERT_MAJOR padding: marked, payload not written */
            memcpy((uint8_t *)recv_x + row * row_bytes, mf__heap(moe, src[0], regions->x) + src[1] * row_bytes,
                   row_bytes);
            if (fp8)
                memcpy(recv_scales + row * nsc,
                       (const float *)mf__heap(moe, src[0], regions->scales) + src[1] * nsc, nsc * sizeof(float));
        }
    }
}

/* ---- combine: the owner's K-sum ----------------------------------------------------------- */

/* Writes one BF16 partial row into its token owner's combine slot (token, k). */
static void mf__cpu_return_row(mf_moe_t moe, const mf__heap_layout_t *regions, const int32_t *src, const uint16_t *row) {
    const mf_moe_config_t *c = &moe->config;
    uint16_t *slots = (uint16_t *)mf__heap(moe, src[0], regions->combine);
    memcpy(slots + ((int64_t)src[1] * c->num_topk + src[2]) * c->hidden, row, (size_t)c->hidden * 2);
}

/* Waits for every rank's COMBINE arrival `epoch` (their partials in this rank's combine slots of
 * `regions`), then y[t] = bf16(sum over k ascending of w[t,k] * slot[t,k]). */
static mf_result_t mf__cpu_sum(mf_moe_t moe, const mf__heap_layout_t *regions, uint64_t epoch, int32_t T, const float *w,
                               uint16_t *y) {
    mf__cpu_moe_t *s = moe->backend_state;
    mf_comm_t comm = moe->comm;
    MF_CHECK(mf__cpu_wait(comm, MF__PHASE_COMBINE, epoch, moe->id, "combine"));
    const mf_moe_config_t *c = &moe->config;
    int32_t K = c->num_topk;
    int64_t H = c->hidden;
    const int32_t *ids = (const int32_t *)mf__heap(moe, comm->rank, regions->ids);
    const uint16_t *slots = (const uint16_t *)mf__heap(moe, comm->rank, regions->combine);
    for (int32_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < H; h++) s->acc[h] = 0.0f;
        for (int32_t k = 0; k < K; k++) {
            if (ids[t * K + k] < 0) continue;
            float wk = w[t * K + k];
            const uint16_t *part = slots + ((int64_t)t * K + k) * H;
            for (int64_t h = 0; h < H; h++) s->acc[h] += wk * mf__bf16_to_float(part[h]);
        }
        for (int64_t h = 0; h < H; h++) y[t * H + h] = mf__bf16_from_float(s->acc[h]);
    }
    return MF_SUCCESS;
}

/* ---- experts: W13 -> SwiGLU -> W2 --------------------------------------------------------- */

/* Decodes `m` rows of x (+ scales) starting at `row` into s->a (fp32) and s->a_scales. */
static void mf__cpu_load_rows(mf_moe_t moe, const void *x, const float *scales, int64_t row, int64_t m) {
    mf__cpu_moe_t *s = moe->backend_state;
    const mf_moe_config_t *c = &moe->config;
    int64_t H = c->hidden, nsc = H / MF__QUANT_BLOCK;
    for (int64_t i = 0; i < m; i++) {
        float *a = s->a + i * H;
        if (c->dtype == MF_DTYPE_FP8_E4M3) {
            const uint8_t *q = (const uint8_t *)x + (row + i) * H;
            const float *lut = mf__cpu_fp8_table();
            for (int64_t h = 0; h < H; h++) a[h] = lut[q[h]];
            memcpy(s->a_scales + i * nsc, scales + (row + i) * nsc, (size_t)nsc * sizeof(float));
        } else {
            const uint16_t *b = (const uint16_t *)x + (row + i) * H;
            for (int64_t h = 0; h < H; h++) a[h] = mf__bf16_to_float(b[h]);
        }
    }
}

/* h = silu(gate) * up from s->c ([m, 2I]), rounded per the layer's dtype, into s->a (+ scales). */
static void mf__cpu_swiglu(mf_moe_t moe, int64_t m) {
    mf__cpu_moe_t *s = moe->backend_state;
    const mf_moe_config_t *c = &moe->config;
    int64_t I = c->intermediate;
    for (int64_t i = 0; i < m; i++) {
        const float *g = s->c + i * 2 * I, *u = g + I;
        float *h = s->a + i * I;
        for (int64_t j = 0; j < I; j++) h[j] = mf__silu(g[j]) * u[j];
        if (c->dtype == MF_DTYPE_FP8_E4M3) {
            uint8_t *q = s->hq + i * I;
            mf__quant_1x128_f32(h, I, c->ue8m0_scales, q, s->a_scales + i * (I / MF__QUANT_BLOCK));
            const float *lut = mf__cpu_fp8_table();
            for (int64_t j = 0; j < I; j++) h[j] = lut[q[j]];
        } else {
            for (int64_t j = 0; j < I; j++) h[j] = mf__bf16_to_float(mf__bf16_from_float(h[j]));
        }
    }
}

/* MF_DEBUG: the CPU backend has one GEMM; reported once per (layer, phase, shape). */
static void mf__cpu_debug_gemm(mf_moe_t moe) {
    const mf_moe_config_t *c = &moe->config;
    static const char *const phase[2] = {"w13", "w2"};
    for (int ph = 0; ph < 2; ph++) {
        const int64_t key[7] = {0x637075 /* "cpu" */, moe->id, ph, c->dtype, c->hidden, c->intermediate,
                                moe->info.num_local_experts};
        if (!mf__debug_first(mf__debug_key(key, 7))) continue;
        mf__debug("gemm layer %u %s %s H %d I %d L %d: ran cpu reference GEMM (plain C, fp32 accumulation, %d-row "
                  "blocks); declined: none (the cpu backend has no other family)",
                  moe->id, phase[ph], mf__dtype_name(c->dtype), c->hidden, c->intermediate, moe->info.num_local_experts,
                  MF__CPU_ROWS);
    }
}

/* The rows the experts run on: slot e's counts[e] rows of x (+ scales) from row offsets[e] on
 * (offsets NULL: e * C, the MASKED layout). Each result row, rounded to BF16, goes to `out` at the
 * same row, or (out NULL) back to its token's owner through the plan's src. */
typedef struct mf__cpu_rows {
    const void *x;
    const float *scales;
    const int32_t *counts, *offsets;
    int32_t num_slots;
    uint16_t *out;
} mf__cpu_rows_t;

static void mf__cpu_experts(mf_moe_t moe, const mf__cpu_rows_t *rows, double *t_w13, double *t_w2) {
    mf__cpu_moe_t *s = moe->backend_state;
    if (mf__debug_on()) mf__cpu_debug_gemm(moe);
    const mf__plan_t *p = &s->plans[0]; /* mf_moe_forward's */
    const mf_moe_config_t *c = &moe->config;
    const mf_moe_weights_t *w = &moe->weights;
    int64_t H = c->hidden, I = c->intermediate;
    int fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    size_t esz = fp8 ? 1 : 2;
    for (int32_t e = 0; e < rows->num_slots; e++) { /* e: a slot, static (the caller's) or spare (ours) */
        const int32_t count = rows->counts[e];
        if (!count) continue;
        mf__cpu_weight_t w13, w2;
        if (e < p->slots_per_rank) {
            w13 = (mf__cpu_weight_t){(const uint8_t *)w->w13.data + (size_t)e * 2 * I * H * esz,
                                     fp8 ? (const float *)w->w13_scales.data + (size_t)e * (2 * I / MF__QUANT_BLOCK) * (H / MF__QUANT_BLOCK) : NULL,
                                     fp8};
            w2 = (mf__cpu_weight_t){(const uint8_t *)w->w2.data + (size_t)e * H * I * esz,
                                    fp8 ? (const float *)w->w2_scales.data + (size_t)e * (H / MF__QUANT_BLOCK) * (I / MF__QUANT_BLOCK) : NULL,
                                    fp8};
        } else {
            const mf__spare_layout_t *sl = &moe->spare_layout;
            const uint8_t *base = (const uint8_t *)moe->spare.local;
            size_t j = (size_t)(e - p->slots_per_rank);
            w13 = (mf__cpu_weight_t){base + sl->w13 + j * sl->w13_bytes,
                                     fp8 ? (const float *)(base + sl->w13_scales + j * sl->w13_scale_bytes) : NULL, fp8};
            w2 = (mf__cpu_weight_t){base + sl->w2 + j * sl->w2_bytes,
                                    fp8 ? (const float *)(base + sl->w2_scales + j * sl->w2_scale_bytes) : NULL, fp8};
        }
        const int64_t first = rows->offsets ? rows->offsets[e] : (int64_t)e * c->expert_capacity;
        for (int64_t j = 0; j < count; j += MF__CPU_ROWS) {
            int64_t m = count - j < MF__CPU_ROWS ? count - j : MF__CPU_ROWS;
            int64_t row = first + j;
            double t0 = mf__now_us();
            mf__cpu_load_rows(moe, rows->x, rows->scales, row, m);
            mf__cpu_gemm_nt(s->a, s->a_scales, m, &w13, 2 * I, H, s->c);
            mf__cpu_swiglu(moe, m);
            double t1 = mf__now_us();
            mf__cpu_gemm_nt(s->a, s->a_scales, m, &w2, H, I, s->c);
            for (int64_t i = 0; i < m; i++) {
                uint16_t *part = rows->out ? rows->out + (row + i) * H : s->part;
                for (int64_t h = 0; h < H; h++) part[h] = mf__bf16_from_float(s->c[i * H + h]);
                if (!rows->out) mf__cpu_return_row(moe, &moe->heap, p->src + 3 * (row + i), s->part);
            }
            *t_w13 += t1 - t0;
            *t_w2 += mf__now_us() - t1;
        }
    }
}

/* ---- entry points ------------------------------------------------------------------------- */

static mf_result_t mf__cpu_forward(mf_moe_t moe, const mf_moe_forward_in_t *in, const mf_moe_forward_out_t *out,
                                   mf_stream_t stream) {
    (void)stream;
    mf__cpu_moe_t *s = moe->backend_state;
    mf_phase_times_t *pt = &s->times;
    double t0 = mf__now_us();
    mf_comm_t comm = moe->comm;
    mf__plan_t *plan = &s->plans[0];
    mf__cpu_publish(moe, &moe->heap, &in->x, &in->topk_ids, (const float *)in->topk_weights.data);
    double t1 = mf__now_us();
    MF_CHECK(mf__cpu_exchange_and_plan(moe, &moe->heap, plan, mf__cpu_arrive(comm, MF__PHASE_DISPATCH, moe->id, MF_SUCCESS)));
    mf__cpu_gather(moe, &moe->heap, plan, s->recv_x, s->recv_scales, NULL);
    double t2 = mf__now_us(), w13 = 0, w2 = 0;
    const mf__cpu_rows_t rows = {s->recv_x, s->recv_scales, plan->counts, plan->offsets, plan->num_local, NULL};
    mf__cpu_experts(moe, &rows, &w13, &w2);
    double t3 = mf__now_us();
    MF_CHECK(mf__cpu_sum(moe, &moe->heap, mf__cpu_arrive(comm, MF__PHASE_COMBINE, moe->id, MF_SUCCESS),
                         (int32_t)in->x.dims[0], (const float *)in->topk_weights.data, (uint16_t *)out->y.data));
    double t4 = mf__now_us();
    pt->us[MF_PHASE_PREPARE] = t1 - t0;
    pt->us[MF_PHASE_DISPATCH] = t2 - t1;
    pt->us[MF_PHASE_W13] = w13;
    pt->us[MF_PHASE_W2] = (t3 - t2) - w13;
    pt->us[MF_PHASE_COMBINE] = t4 - t3;
    pt->total_us = t4 - t0;
    return MF_SUCCESS;
}

/* Exchange x's dispatch halves: SEND publishes into its slot and arrives (no wait); RECV waits
 * for that arrival of every rank, plans into the slot's plan and lands the rows. */
static mf_result_t mf__cpu_dispatch(mf_moe_t moe, struct mf_exchange *x, const mf_dispatch_in_t *in, uint32_t halves,
                                    mf_stream_t stream) {
    (void)stream;
    mf__cpu_moe_t *s = moe->backend_state;
    if (halves & MF__HALF_SEND) {
        mf__cpu_publish(moe, &x->heap, &in->x, &in->topk_ids, NULL);
        x->epoch = mf__cpu_arrive(moe->comm, MF__PHASE_DISPATCH, moe->id, MF_SUCCESS);
    }
    if (!(halves & MF__HALF_RECV)) return MF_SUCCESS;
    mf__plan_t *plan = &s->plans[x->slot];
    const mf_dispatch_out_t *out = &x->dispatch_out;
    MF_CHECK(mf__cpu_exchange_and_plan(moe, &x->heap, plan, x->epoch));
    mf__cpu_gather(moe, &x->heap, plan, out->recv_x.data, (float *)out->recv_scales.data, (int32_t *)out->recv_src.data);
    /* The caller's segments are the rank's first num_local_slots slots: its static slots (B = 0 here),
     * less a placement's empty ones, which are the last and hold no rows (offsets[L] ends them all). */
    int32_t L = moe->info.num_local_slots;
    memcpy(out->expert_counts.data, plan->counts, (size_t)L * sizeof(int32_t));
    if (moe->config.layout == MF_LAYOUT_EXPERT_MAJOR)
        memcpy(out->expert_offsets.data, plan->offsets, (size_t)(L + 1) * sizeof(int32_t));
    return MF_SUCCESS;
}

/* Exchange x's combine halves: SEND returns every expert output row into its owner's combine slot
 * (x's slot) and arrives; RECV waits for that arrival of every rank and sums. A send alone keeps
 * its topk_weights in the slot's weights region (the caller's tensor need not outlive the send). */
static mf_result_t mf__cpu_combine(mf_moe_t moe, struct mf_exchange *x, uint32_t halves, mf_stream_t stream) {
    (void)stream;
    float *kept = (float *)mf__heap(moe, moe->comm->rank, x->heap.weights);
    if (halves == MF__HALF_SEND && x->T)
        memcpy(kept, x->combine_in.topk_weights.data, (size_t)x->T * moe->config.num_topk * sizeof(float));
    if (halves & MF__HALF_SEND) {
        const mf__plan_t *p = &((mf__cpu_moe_t *)moe->backend_state)->plans[x->slot];
        int64_t H = moe->config.hidden;
        const uint16_t *eo = (const uint16_t *)x->combine_in.expert_out.data;
        for (int32_t e = 0; e < p->num_local; e++)
            for (int32_t j = 0; j < p->counts[e]; j++) {
                int64_t row = mf__plan_row(p, e, j);
                mf__cpu_return_row(moe, &x->heap, p->src + 3 * row, eo + row * H);
            }
        x->epoch = mf__cpu_arrive(moe->comm, MF__PHASE_COMBINE, moe->id, MF_SUCCESS);
    }
    if (!(halves & MF__HALF_RECV)) return MF_SUCCESS;
    const float *w = halves == MF__HALF_RECV ? kept : (const float *)x->combine_in.topk_weights.data;
    return mf__cpu_sum(moe, &x->heap, x->epoch, x->T, w, (uint16_t *)x->combine_out.y.data);
}

static mf_result_t mf__cpu_moe_experts(mf_moe_t moe, const mf_experts_in_t *in, const mf_experts_out_t *out,
                                       mf_stream_t stream) {
    (void)stream;
    const int32_t L = moe->info.num_local_slots, C = moe->config.expert_capacity;
    const int32_t *counts = (const int32_t *)in->expert_counts.data;
    for (int32_t e = 0; e < L; e++)
        if (counts[e] < 0 || counts[e] > C)
            return mf__error(MF_ERR_INVALID_ARGUMENT, "mf_moe_experts: expert_counts[%d] = %d is outside [0, C = %d]",
                             e, counts[e], C);
    const mf__cpu_rows_t rows = {in->recv_x.data, (const float *)in->recv_scales.data, counts, NULL, L,
                                 (uint16_t *)out->expert_out.data};
    double w13 = 0, w2 = 0;
    mf__cpu_experts(moe, &rows, &w13, &w2);
    return MF_SUCCESS;
}

/* A rejected call: arrive with the failure as status at the call's first synchronisation and wait,
 * so that every peer fails it there too; no publication, nothing written. */
static mf_result_t mf__cpu_reject(mf_moe_t moe, uint32_t phases, mf_result_t code, mf_stream_t stream) {
    (void)stream;
    /* CPU ranks decide at the call's first synchronisation and all return there. */
    const int32_t phase = phases & MF__CALL_DISPATCH ? MF__PHASE_DISPATCH : MF__PHASE_COMBINE;
    char why[512];
    strncpy(why, mf_last_error(), sizeof why - 1);
    why[sizeof why - 1] = '\0';
    mf_result_t res = mf__cpu_wait(moe->comm, phase, mf__cpu_arrive(moe->comm, phase, moe->id, code), moe->id,
                                   mf__phase_name(phase));
    if (res == code) return mf__error(code, "%s", why);
    return res; /* a timeout or an abort says more than the rejection */
}

/* ---- balanced EP: the per-step prefetch ------------------------------------------------------ */

/* Copies the weights (+ scales) of this rank's static slot `l` into spare slot j of rank q. */
static void mf__cpu_push_expert(mf_moe_t moe, int32_t l, int32_t q, int32_t j) {
    const mf__spare_layout_t *sl = &moe->spare_layout;
    const mf_moe_weights_t *w = &moe->weights;
    uint8_t *base = (uint8_t *)moe->spare.peers[q];
    size_t sj = (size_t)j, sl_ = (size_t)l;
    memcpy(base + sl->w13 + sj * sl->w13_bytes, (const uint8_t *)w->w13.data + sl_ * sl->w13_bytes, sl->w13_bytes);
    memcpy(base + sl->w2 + sj * sl->w2_bytes, (const uint8_t *)w->w2.data + sl_ * sl->w2_bytes, sl->w2_bytes);
    if (moe->config.dtype == MF_DTYPE_FP8_E4M3) {
        memcpy(base + sl->w13_scales + sj * sl->w13_scale_bytes,
               (const uint8_t *)w->w13_scales.data + sl_ * sl->w13_scale_bytes, sl->w13_scale_bytes);
        memcpy(base + sl->w2_scales + sj * sl->w2_scale_bytes,
               (const uint8_t *)w->w2_scales.data + sl_ * sl->w2_scale_bytes, sl->w2_scale_bytes);
    }
}

/* Every rank computes the same next table from the last forward's counts; the rank holding an
 * expert's first static replica pushes it into each spare slot that does not hold it yet. */
static mf_result_t mf__cpu_prefetch(mf_moe_t moe, mf_stream_t stream) {
    (void)stream;
    mf__cpu_moe_t *s = moe->backend_state;
    mf__plan_t *p = &s->plans[0];
    const mf_moe_config_t *c = &moe->config;
    int32_t R = moe->info.num_ranks, B = c->spare_slots, E = c->num_experts, P = c->num_physical_experts;
    int32_t Lp = moe->slots_per_rank, me = moe->info.rank;
    if (s->weights_seen != moe->weights_count) { /* new weights: every spare copy is stale */
        for (int32_t i = 0; i < R * B; i++) s->resident[i] = -1;
        s->weights_seen = moe->weights_count;
    }
    /* The planner's scratch is the plan's replica arrays (rebuilt by every forward). */
    if (s->have_prev)
        mf__balance_pick(E, R, P, B, s->prev_counts, moe->expert_map, s->resident, s->next, p->rep_off, p->rep_rank,
                         p->rep_slot, p->share, p->load, p->scratch);
    else
        for (int32_t i = 0; i < R * B; i++) s->next[i] = s->resident[i];
    s->prefetch_bytes = s->prefetch_bytes_all = 0;
    for (int32_t i = 0; i < R * B; i++) {
        int32_t e = s->next[i];
        if (e < 0 || e == s->resident[i]) continue;
        int32_t src = 0;
        while (moe->expert_map[src] != e) src++; /* the first static replica (every expert has one) */
        s->prefetch_bytes_all += (int64_t)moe->spare_layout.copy_bytes;
        if (src / Lp != me) continue;
        mf__cpu_push_expert(moe, src % Lp, i / B, i % B);
        s->prefetch_bytes += (int64_t)moe->spare_layout.copy_bytes;
    }
    memcpy(s->resident, s->next, (size_t)R * B * sizeof(int32_t));
    s->prefetches++;
    return MF_SUCCESS;
}

/* ---- balanced EP: a staged map's moves (mf_moe_stage_expert_map) ------------------------------ */

/* Copies one expert (weights + FP8 scales) from src to dst. */
static void mf__cpu_copy_expert(mf__expert_ptrs_t dst, mf__expert_ptrs_t src, const mf__spare_layout_t *sl, int fp8) {
    memcpy(dst.w13, src.w13, sl->w13_bytes);
    memcpy(dst.w2, src.w2, sl->w2_bytes);
    if (fp8) {
        memcpy(dst.w13_scales, src.w13_scales, sl->w13_scale_bytes);
        memcpy(dst.w2_scales, src.w2_scales, sl->w2_scale_bytes);
    }
}

/* Step `moe->stage_step` of the schedule (src/balance/stage.h) on this rank: in step 0 the local
 * copies; the arrivals of the previous step from this rank's staging slots into next_weights; the
 * pushes of this step from the old weights into the peers' staging slots (the other half). No
 * synchronisation: a peer pushed step i - 1 before its DISPATCH arrival of the forward between,
 * which this rank waited for; it pushes step i + 1 (into the half read here) only after its
 * COMBINE wait of the next forward, which this rank reaches after this step. */
static mf_result_t mf__cpu_stage_step(mf_moe_t moe, mf_stream_t stream) {
    (void)stream;
    mf__cpu_moe_t *st = moe->backend_state;
    const mf__spare_layout_t *sl = &moe->stage_layout;
    const int32_t P = moe->config.num_physical_experts, Lp = moe->slots_per_rank, me = moe->info.rank;
    const int32_t step = moe->stage_step, fp8 = moe->config.dtype == MF_DTYPE_FP8_E4M3;
    for (int32_t p = 0; p < P; p++) {
        const mf__stage_slot_t *s = &moe->stage_plan[p];
        int32_t q = p / Lp, l = p % Lp;
        if (s->held >= 0) {
            if (step == 0 && q == me)
                mf__cpu_copy_expert(mf__expert_in_weights(&moe->staged_weights, sl, l),
                                    mf__expert_in_weights(&moe->weights, sl, s->held), sl, fp8);
            continue;
        }
        if (s->step + 1 == step && q == me)
            mf__cpu_copy_expert(mf__expert_in_weights(&moe->staged_weights, sl, l),
                                mf__expert_in_region(moe->stage.local, sl, s->staging), sl, fp8);
        if (s->step == step && s->source / Lp == me)
            mf__cpu_copy_expert(mf__expert_in_region(moe->stage.peers[q], sl, s->staging),
                                mf__expert_in_weights(&moe->weights, sl, s->source % Lp), sl, fp8);
    }
    /* A step is a prefetch: counted (and checked equal by the forward) with or without spares. */
    if (moe->config.spare_slots == 0) st->prefetches++;
    return MF_SUCCESS;
}

static mf_result_t mf__cpu_set_expert_map(mf_moe_t moe) {
    (void)moe; /* the CPU plan reads moe->expert_map at every forward */
    return MF_SUCCESS;
}

static mf_result_t mf__cpu_get_balance_stats(mf_moe_t moe, mf_moe_balance_stats_t *st) {
    mf__cpu_moe_t *s = moe->backend_state;
    int32_t RB = moe->info.num_ranks * moe->config.spare_slots;
    memcpy(st->recv_rows, s->recv_rows, sizeof st->recv_rows);
    memcpy(st->home_rows, s->home_rows, sizeof st->home_rows);
    st->prefetch_bytes = s->prefetch_bytes;
    st->prefetch_bytes_all = s->prefetch_bytes_all;
    st->spare_resident = 0;
    for (int32_t i = 0; i < RB; i++) st->spare_resident += s->resident[i] >= 0;
    return MF_SUCCESS;
}

const mf__backend_ops_t mf__cpu_backend = {
    .name = "cpu",
    .available = mf__cpu_available,
    .device_id = mf__cpu_device_id,
    .comm_init = mf__cpu_comm_init,
    .comm_fini = mf__cpu_comm_fini,
    .mem_alloc = mf__cpu_mem_alloc,
    .mem_free = mf__cpu_mem_free,
    .moe_init = mf__cpu_moe_init,
    .moe_fini = mf__cpu_moe_fini,
    .set_weights = NULL,
    .forward = mf__cpu_forward,
    .dispatch = mf__cpu_dispatch,
    .combine = mf__cpu_combine,
    .experts = mf__cpu_moe_experts,
    .reject = mf__cpu_reject,
    .abort = mf__cpu_abort,
    .get_async_error = mf__cpu_get_async_error,
    .get_phase_times = mf__cpu_get_phase_times,
    .set_expert_map = mf__cpu_set_expert_map,
    .prefetch = mf__cpu_prefetch,
    .get_balance_stats = mf__cpu_get_balance_stats,
    .stage_step = mf__cpu_stage_step,
};
