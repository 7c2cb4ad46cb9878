/*
 * test_layer.c — the whole EP MoE layer (mf_moe_forward on MF_BACKEND_CPU, R virtual ranks)
 * against the naive fp64 reference of workload/ref.c, on problems from workload/problem.c.
 *
 * Judged as docs/DESIGN.md says: diff = 1 - 2 sum(xy) / sum(x^2 + y^2) per rank (BF16 < 1e-5,
 * FP8 < 1e-3) plus element-wise atol + rtol |ref| bounds (the CPU oracle's, workload/ref.h
 * MFREF_ORACLE_*), and no NaN/Inf ever; tests/test_random.c adds random cases. The sweep covers
 * R in {1, 2, 4, 8}, both layouts, uniform / zipf / hot routing, T in {0, 1, S}, idle ranks, ranks
 * that receive nothing, -1 drops, UE8M0 scales, sizes that are not tile multiples, the edges of E
 * and K, repeated calls on the same layer and buffers, two layers sharing one comm (own drivers
 * below), and a NaN/Inf token that must not touch the other tokens.
 * Shapes stay small (H = I = 256, E = 16, T <= 32) so the suite is fast under ASan too.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/debug.h" /* mf__debug_reset: MF_DEBUG is read once per process */
#include "harness.h"
#include "problem.h"
#include "ref.h"

#define LAYER_TIMEOUT_MS 20000 /* peer waits; below the test's own limit so a hang reports */

/* Pass marks are workload/ref.h's: docs/DESIGN.md's diff per rank (MFREF_DIFF_MAX_*), and the
 * element-wise bounds that the CPU oracle achieves (MFREF_ORACLE_*, measured; tighter than the
 * MFREF_ATOL_* that `moeflow run` applies to any backend), so that a rounding point missing from
 * the CPU backend or the reference fails here. */

static mfp_spec_t base_spec(int32_t R, int32_t dtype, int32_t layout) {
    mfp_spec_t s;
    memset(&s, 0, sizeof s);
    s.R = R;
    s.E = 16;
    s.K = 4;
    s.H = 256;
    s.I = 256;
    s.S = 24;
    s.dtype = dtype;
    s.layout = layout;
    s.ue8m0 = 0;
    s.T_per_rank = 24;
    s.routing = MFP_ROUTING_UNIFORM;
    s.zipf_s = 1.2;
    s.hot_expert = 0;
    s.drop_prob = 0.0;
    s.seed = 1000u + (uint64_t)R * 17u + (uint64_t)dtype * 3u + (uint64_t)layout;
    return s;
}

static const char *dtype_name(int32_t dtype) { return dtype == MF_DTYPE_FP8_E4M3 ? "fp8" : "bf16"; }
static const char *layout_name(int32_t layout) {
    return layout == MF_LAYOUT_MASKED ? "masked" : "expert_major";
}

/* Compares one rank's y ([T, H]) with the reference; prints the first mismatches. */
static int compare_y(const char *label, int32_t rank, int32_t dtype, const uint16_t *got,
                     const uint16_t *want, int64_t T, int64_t H) {
    int64_t n = T * H;
    int fp8 = dtype == MF_DTYPE_FP8_E4M3;
    double rtol = MFREF_ORACLE_RTOL, atol = fp8 ? MFREF_ORACLE_ATOL_FP8 : MFREF_ORACLE_ATOL_BF16;
    int64_t bad = 0;
    double worst = 0; /* largest |got - want| as a fraction of its bound */
    for (int64_t i = 0; i < n; i++) {
        double g = mf_bf16_to_float(got[i]), w = mf_bf16_to_float(want[i]);
        double bound = rtol * fabs(w) + atol;
        int ok = isfinite(g) && fabs(g - w) <= bound;
        if (ok && bound > 0 && fabs(g - w) / bound > worst) worst = fabs(g - w) / bound;
        if (!ok && bad++ < 8)
            mft_note("%s rank %d: y[t=%lld, h=%lld] = %.6g (0x%04x), reference %.6g (0x%04x)", label,
                     (int)rank, (long long)(i / H), (long long)(i % H), g, got[i], w, want[i]);
    }
    double diff = mfref_diff_bf16(got, want, n);
    double dmax = fp8 ? MFREF_DIFF_MAX_FP8 : MFREF_DIFF_MAX_BF16;
    mft_verbose("  %s rank %d: T=%lld diff=%.3g worst=%.2f of the bound, bad=%lld\n", label,
                (int)rank, (long long)T, diff, worst, (long long)bad);
    if (bad) MFT_FAIL("%s rank %d: %lld of %lld elements outside the bounds (diff %.3g)", label,
                      (int)rank, (long long)bad, (long long)n, diff);
    if (!(diff < dmax))
        MFT_FAIL("%s rank %d: diff %.3g >= %.0e (T=%lld)", label, (int)rank, diff, dmax,
                 (long long)T);
    return 0;
}

/* Runs a generated problem through mfp_run_forward `iters` times and compares every rank's y with
 * the reference. With `keep`, the library's y arrays are handed to the caller (free each and the
 * array); otherwise they are freed here. */
static int run_problem(const char *label, mfp_problem_t *p, int32_t iters, uint16_t ***keep) {
    int32_t R = p->spec.R, H = p->spec.H;
    uint16_t **y = (uint16_t **)mft_alloc(sizeof *y * (size_t)R);
    uint16_t **y_ref = (uint16_t **)mft_alloc(sizeof *y_ref * (size_t)R);
    for (int32_t r = 0; r < R; r++) {
        size_t bytes = (size_t)p->T[r] * (size_t)H * 2;
        y[r] = (uint16_t *)mft_alloc(bytes);
        y_ref[r] = (uint16_t *)mft_alloc(bytes);
        mft_poison(y[r], bytes);
        mft_poison(y_ref[r], bytes);
    }
    int rc = 0;
    char err[512] = "";
    mfp_timing_t timing;
    memset(&timing, 0, sizeof timing);
    if (mfref_layer(&p->ref, y_ref) != 0) {
        rc = mft_fail(__FILE__, __LINE__, "%s: mfref_layer failed", label);
    } else {
        mf_result_t r = mfp_run_forward(p, MF_BACKEND_CPU, iters, LAYER_TIMEOUT_MS, y, &timing, err,
                                        (int)sizeof err);
        if (r != MF_SUCCESS)
            rc = mft_fail(__FILE__, __LINE__, "%s: mfp_run_forward -> %s: %s", label,
                          mft_result_name(r), err);
    }
    for (int32_t r = 0; r < R && !rc; r++)
        rc = compare_y(label, r, p->spec.dtype, y[r], y_ref[r], p->T[r], H);
    if (!rc)
        mft_verbose("  %s: ok, forward %.2f ms (setup %.2f ms)\n", label, timing.forward_ms,
                    timing.setup_ms);
    for (int32_t r = 0; r < R; r++) {
        if (!keep) free(y[r]);
        free(y_ref[r]);
    }
    if (keep) *keep = y;
    else free(y);
    free(y_ref);
    return rc;
}

static int run_spec(const mfp_spec_t *spec, int32_t iters, const char *what) {
    char label[256];
    snprintf(label, sizeof label, "%s R=%d %s %s T=%d S=%d K=%d routing=%d ue8m0=%d drop=%.2f",
             what, (int)spec->R, dtype_name(spec->dtype), layout_name(spec->layout),
             (int)spec->T_per_rank, (int)spec->S, (int)spec->K, (int)spec->routing,
             (int)spec->ue8m0, spec->drop_prob);
    mfp_problem_t p;
    if (mfp_generate(spec, &p) != 0) MFT_FAIL("%s: mfp_generate failed", label);
    int rc = run_problem(label, &p, iters, NULL);
    mfp_free(&p);
    return rc;
}

/* ---- the R sweep ---------------------------------------------------------------------------- */

static int sweep_R(int32_t dtype, int32_t layout, int32_t routing) {
    static const int32_t Rs[] = {1, 2, 4, 8};
    for (size_t i = 0; i < sizeof Rs / sizeof Rs[0]; i++) {
        mfp_spec_t s = base_spec(Rs[i], dtype, layout);
        s.routing = routing;
        if (run_spec(&s, 1, "sweep")) return 1;
    }
    return 0;
}

static int test_bf16_expert_major(void) {
    return sweep_R(MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_UNIFORM);
}
static int test_bf16_masked(void) {
    return sweep_R(MF_DTYPE_BF16, MF_LAYOUT_MASKED, MFP_ROUTING_ZIPF);
}
static int test_fp8_expert_major(void) {
    return sweep_R(MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_ZIPF);
}
static int test_fp8_masked(void) {
    return sweep_R(MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, MFP_ROUTING_UNIFORM);
}

static int test_fp8_ue8m0(void) {
    for (int32_t layout = 0; layout < 2; layout++)
        for (int32_t R = 2; R <= 4; R += 2) {
            mfp_spec_t s = base_spec(R, MF_DTYPE_FP8_E4M3, layout);
            s.ue8m0 = 1;
            if (run_spec(&s, 1, "ue8m0")) return 1;
        }
    return 0;
}

/* Sizes that are not tile multiples: BF16 H = 136, I = 200 (multiples of 8 only), FP8 H = 384,
 * I = 640 (odd numbers of 128-blocks), E = 12 (L = 3 on R = 4), K = 3, S = 13. */
static int test_odd_sizes(void) {
    for (int32_t dtype = 0; dtype < 2; dtype++)
        for (int32_t layout = 0; layout < 2; layout++) {
            mfp_spec_t s = base_spec(dtype ? 4 : 2, dtype, layout);
            s.H = dtype ? 384 : 136;
            s.I = dtype ? 640 : 200;
            s.E = 12;
            s.K = 3;
            s.S = s.T_per_rank = 13;
            s.drop_prob = 0.1;
            if (run_spec(&s, 1, "odd_sizes")) return 1;
        }
    return 0;
}

/* The edges of E and K: K = MF_MAX_TOPK (E = 64); one expert per rank (E = R = 8); one expert in
 * all (E = R = K = 1). */
static int test_expert_edges(void) {
    for (int32_t dtype = 0; dtype < 2; dtype++) {
        mfp_spec_t s = base_spec(2, dtype, dtype ? MF_LAYOUT_MASKED : MF_LAYOUT_EXPERT_MAJOR);
        s.E = 64;
        s.K = MF_MAX_TOPK;
        s.H = s.I = 128;
        s.S = s.T_per_rank = 4;
        s.drop_prob = 0.1;
        if (run_spec(&s, 1, "max_topk")) return 1;
        s = base_spec(8, dtype, dtype ? MF_LAYOUT_EXPERT_MAJOR : MF_LAYOUT_MASKED);
        s.E = 8;
        s.K = 2;
        s.S = s.T_per_rank = 6;
        if (run_spec(&s, 1, "one_expert_per_rank")) return 1;
        s = base_spec(1, dtype, MF_LAYOUT_EXPERT_MAJOR);
        s.E = 1;
        s.K = 1;
        s.S = s.T_per_rank = 5;
        if (run_spec(&s, 1, "single_expert")) return 1;
    }
    return 0;
}

/* T = 0 on every rank, T = 1, and T = S (S = 32), both dtypes and layouts. */
static int test_token_counts(void) {
    static const int32_t Ts[] = {0, 1, 32};
    for (int32_t dtype = 0; dtype < 2; dtype++)
        for (int32_t layout = 0; layout < 2; layout++)
            for (size_t i = 0; i < 3; i++) {
                mfp_spec_t s = base_spec(4, dtype, layout);
                s.S = 32;
                s.T_per_rank = Ts[i];
                s.seed += (uint64_t)i * 101u;
                if (run_spec(&s, 1, "token_counts")) return 1;
            }
    return 0;
}

/* Every token picks one hot expert: with K = 1 that expert receives every token and every other
 * expert (and every other rank) receives nothing; with K = 4 it receives every token and the rest
 * is uniform. The hot expert is the last one (on the last rank) to avoid rank-0 bias. */
static int test_hot_expert(void) {
    for (int32_t dtype = 0; dtype < 2; dtype++)
        for (int32_t layout = 0; layout < 2; layout++)
            for (int32_t K = 1; K <= 4; K += 3) {
                mfp_spec_t s = base_spec(4, dtype, layout);
                s.S = 32;
                s.T_per_rank = 32;
                s.K = K;
                s.routing = MFP_ROUTING_HOT;
                s.hot_expert = s.E - 1;
                if (run_spec(&s, 1, "hot_expert")) return 1;
            }
    return 0;
}

/* All tokens of all ranks go to rank 0's experts (K distinct ones of its L), so ranks 1..R-1
 * receive nothing but still send and combine. */
static int test_rank0_only(void) {
    for (int32_t dtype = 0; dtype < 2; dtype++)
        for (int32_t layout = 0; layout < 2; layout++) {
            mfp_spec_t s = base_spec(4, dtype, layout); /* L = 4, K = 4 */
            s.K = 3;
            char label[128];
            snprintf(label, sizeof label, "rank0_only %s %s", dtype_name(dtype), layout_name(layout));
            mfp_problem_t p;
            if (mfp_generate(&s, &p) != 0) MFT_FAIL("%s: mfp_generate failed", label);
            int32_t L = s.E / s.R;
            for (int32_t r = 0; r < s.R; r++)
                for (int32_t t = 0; t < p.T[r]; t++)
                    for (int32_t k = 0; k < s.K; k++)
                        p.topk_ids[r][t * s.K + k] = (t + r + k) % L; /* distinct within a token */
            int rc = run_problem(label, &p, 1, NULL);
            mfp_free(&p);
            if (rc) return 1;
        }
    return 0;
}

/* Idle ranks (T = 0) beside busy ones, including T = S, and the last rank alone busy. */
static int test_idle_ranks(void) {
    static const int32_t T_a[4] = {24, 0, 3, 0};
    static const int32_t T_b[4] = {0, 0, 0, 5};
    static const int32_t T_c[8] = {0, 1, 0, 24, 0, 0, 7, 0};
    const struct {
        int32_t R;
        const int32_t *T;
    } cases[] = {{4, T_a}, {4, T_b}, {8, T_c}};
    for (int32_t dtype = 0; dtype < 2; dtype++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            mfp_spec_t s = base_spec(cases[i].R, dtype, (int32_t)(i % 2));
            s.T_of_rank = cases[i].T;
            if (run_spec(&s, 1, "idle_ranks")) return 1;
        }
    return 0;
}

/* -1 ids: random drops, plus one token per rank whose every id is -1: its y row must be exactly
 * zero (an empty fp32 sum rounded to bf16). */
static int test_drops(void) {
    for (int32_t dtype = 0; dtype < 2; dtype++)
        for (int32_t layout = 0; layout < 2; layout++) {
            mfp_spec_t s = base_spec(2, dtype, layout);
            s.drop_prob = 0.3;
            char label[128];
            snprintf(label, sizeof label, "drops %s %s", dtype_name(dtype), layout_name(layout));
            mfp_problem_t p;
            if (mfp_generate(&s, &p) != 0) MFT_FAIL("%s: mfp_generate failed", label);
            for (int32_t r = 0; r < s.R; r++)
                for (int32_t k = 0; k < s.K; k++) p.topk_ids[r][(r + 1) * s.K + k] = -1;
            uint16_t **y = NULL;
            int rc = run_problem(label, &p, 1, &y);
            for (int32_t r = 0; r < s.R && !rc; r++) {
                const uint16_t *row = y[r] + (size_t)(r + 1) * (size_t)s.H;
                for (int32_t h = 0; h < s.H && !rc; h++)
                    if ((row[h] & 0x7fff) != 0) /* +0 or -0 */
                        rc = mft_fail(__FILE__, __LINE__,
                                      "%s: rank %d token %d has every id -1, but y[%d] = 0x%04x",
                                      label, (int)r, (int)(r + 1), (int)h, row[h]);
            }
            for (int32_t r = 0; y && r < s.R; r++) free(y[r]);
            free(y);
            mfp_free(&p);
            if (rc) return 1;
        }
    return 0;
}

/* mfp_run_forward with iters = 3: the same layer and buffers three times, the last y compared. */
static int test_iters(void) {
    for (int32_t dtype = 0; dtype < 2; dtype++) {
        mfp_spec_t s = base_spec(4, dtype, dtype ? MF_LAYOUT_MASKED : MF_LAYOUT_EXPERT_MAJOR);
        s.routing = MFP_ROUTING_ZIPF;
        if (run_spec(&s, 3, "iters")) return 1;
    }
    return 0;
}

/* ---- repeated calls with changing inputs, driven here -------------------------------------- */

#define ROUNDS 4

/* One round's inputs for every rank (deep copies, since mfp_redraw_inputs rewrites the problem's
 * arrays), the reference y and the y the library wrote. */
typedef struct round_data {
    int32_t T[8];
    uint16_t *x[8];
    int32_t *ids[8];
    float *w[8];
    uint16_t *y_ref[8];
    uint16_t *y[8]; /* [S, H]: rows past T must stay poisoned */
} round_data_t;

typedef struct repeat_ctx {
    const mfp_problem_t *p;
    mf_group_t group;
    round_data_t rounds[ROUNDS];
    mf_result_t results[8][ROUNDS];
    char errors[8][256];
} repeat_ctx_t;

/* Creates rank `rank`'s layer of problem `p` on `comm` (collective) and sets its weights; on a
 * set_weights failure *moe is still returned, so the caller can take part in the collectives. */
static mf_moe_config_t layer_config(const mfp_problem_t *p) {
    const mfp_spec_t *s = &p->spec;
    mf_moe_config_t cfg = MF_MOE_CONFIG_INIT;
    cfg.num_experts = s->E;
    cfg.num_topk = s->K;
    cfg.hidden = s->H;
    cfg.intermediate = s->I;
    cfg.max_tokens_per_rank = s->S;
    cfg.dtype = s->dtype;
    cfg.layout = s->layout;
    cfg.ue8m0_scales = s->ue8m0;
    return cfg;
}

static mf_result_t create_layer(mf_comm_t comm, const mfp_problem_t *p, int32_t rank, mf_moe_t *moe) {
    const mfp_spec_t *s = &p->spec;
    mf_moe_config_t cfg = layer_config(p);
    mf_result_t res = mf_moe_create(comm, &cfg, moe);
    if (res != MF_SUCCESS) return res;
    int32_t L = p->L, H = s->H, I = s->I;
    mf_moe_weights_t w;
    memset(&w, 0, sizeof w);
    w.w13 = mft_t3(p->w13[rank], (mf_dtype_t)s->dtype, L, 2 * I, H);
    w.w2 = mft_t3(p->w2[rank], (mf_dtype_t)s->dtype, L, H, I);
    if (s->dtype == MF_DTYPE_FP8_E4M3) {
        w.w13_scales = mft_t3(p->w13_scales[rank], MF_DTYPE_FP32, L, 2 * I / 128, H / 128);
        w.w2_scales = mft_t3(p->w2_scales[rank], MF_DTYPE_FP32, L, H / 128, I / 128);
    }
    return mf_moe_set_weights(*moe, &w);
}

static int repeat_rank(int32_t rank, void *arg) {
    repeat_ctx_t *c = (repeat_ctx_t *)arg;
    const mfp_spec_t *s = &c->p->spec;
    mf_comm_t comm = NULL;
    mf_moe_t moe = NULL;
    MFT_CHECK_OK(mf_group_get_comm(c->group, rank, &comm));
    mf_result_t res = create_layer(comm, c->p, rank, &moe);
    if (!moe) MFT_FAIL("rank %d: mf_moe_create -> %s: %s", (int)rank, mft_result_name(res),
                       mf_last_error());
    int32_t H = s->H;
    for (int i = 0; i < ROUNDS; i++) {
        round_data_t *rd = &c->rounds[i];
        int32_t T = rd->T[rank];
        mf_moe_forward_in_t in;
        mf_moe_forward_out_t out;
        in.x = mft_t2(rd->x[rank], MF_DTYPE_BF16, T, H);
        in.topk_ids = mft_t2(rd->ids[rank], MF_DTYPE_INT32, T, s->K);
        in.topk_weights = mft_t2(rd->w[rank], MF_DTYPE_FP32, T, s->K);
        out.y = mft_t2(rd->y[rank], MF_DTYPE_BF16, T, H);
        /* A failed set_weights still takes part, so the other ranks fail instead of hanging. */
        if (res == MF_SUCCESS) res = mf_moe_forward(moe, &in, &out, NULL);
        c->results[rank][i] = res;
        if (res != MF_SUCCESS && !c->errors[rank][0])
            snprintf(c->errors[rank], sizeof c->errors[rank], "round %d: %s", i, mf_last_error());
    }
    mf_moe_destroy(moe);
    return 0;
}

static int check_rounds(repeat_ctx_t *c, const char *label) {
    const mfp_spec_t *s = &c->p->spec;
    int32_t R = s->R, H = s->H, S = s->S;
    for (int32_t r = 0; r < R; r++)
        for (int i = 0; i < ROUNDS; i++)
            if (c->results[r][i] != MF_SUCCESS)
                MFT_FAIL("%s: rank %d round %d -> %s: %s", label, (int)r, i,
                         mft_result_name(c->results[r][i]), c->errors[r]);
    for (int i = 0; i < ROUNDS; i++) {
        round_data_t *rd = &c->rounds[i];
        for (int32_t r = 0; r < R; r++) {
            char l2[300];
            snprintf(l2, sizeof l2, "%s round %d", label, i);
            if (compare_y(l2, r, s->dtype, rd->y[r], rd->y_ref[r], rd->T[r], H)) return 1;
            size_t used = (size_t)rd->T[r] * (size_t)H * 2, all = (size_t)S * (size_t)H * 2;
            int64_t at = mft_first_unpoisoned((const char *)rd->y[r] + used, all - used);
            if (at >= 0)
                MFT_FAIL("%s: rank %d wrote y past its T = %d rows (byte %lld after the end)", l2,
                         (int)r, (int)rd->T[r], (long long)at);
        }
    }
    /* Round 3 repeats round 0's inputs: the layer is deterministic, so y is bitwise the same. */
    for (int32_t r = 0; r < R; r++)
        if (memcmp(c->rounds[0].y[r], c->rounds[3].y[r], (size_t)c->rounds[0].T[r] * H * 2) != 0)
            MFT_FAIL("%s: rank %d: the same inputs gave a different y in round 3 than in round 0",
                     label, (int)r);
    return 0;
}

/* Four forwards on one layer and one set of y buffers: inputs re-drawn each round (routing too),
 * T changing per round and rank (a prefix of the drawn tokens), the last round a replay of the
 * first. */
static int repeat_case(int32_t R, int32_t dtype, int32_t layout) {
    char label[128];
    snprintf(label, sizeof label, "repeat R=%d %s %s", (int)R, dtype_name(dtype),
             layout_name(layout));
    mfp_spec_t s = base_spec(R, dtype, layout);
    s.drop_prob = 0.1;
    mfp_problem_t p;
    if (mfp_generate(&s, &p) != 0) MFT_FAIL("%s: mfp_generate failed", label);
    repeat_ctx_t *c = (repeat_ctx_t *)calloc(1, sizeof *c);
    if (!c) MFT_FAIL("out of memory");
    c->p = &p;
    int rc = 0;
    size_t xb = (size_t)s.S * (size_t)s.H * 2, kb = (size_t)s.S * (size_t)s.K * 4;
    for (int i = 0; i < ROUNDS && !rc; i++) {
        round_data_t *rd = &c->rounds[i];
        if (i == 3) { /* replay round 0 */
            for (int32_t r = 0; r < R; r++) {
                rd->T[r] = c->rounds[0].T[r];
                rd->x[r] = (uint16_t *)mft_alloc(xb);
                rd->ids[r] = (int32_t *)mft_alloc(kb);
                rd->w[r] = (float *)mft_alloc(kb);
                rd->y_ref[r] = (uint16_t *)mft_alloc(xb);
                memcpy(rd->x[r], c->rounds[0].x[r], xb);
                memcpy(rd->ids[r], c->rounds[0].ids[r], kb);
                memcpy(rd->w[r], c->rounds[0].w[r], kb);
                memcpy(rd->y_ref[r], c->rounds[0].y_ref[r], xb);
                rd->y[r] = (uint16_t *)mft_alloc(xb);
                mft_poison(rd->y[r], xb);
            }
            break;
        }
        if (i > 0 && mfp_redraw_inputs(&p, 7777u + (uint64_t)i) != 0) {
            rc = mft_fail(__FILE__, __LINE__, "%s: mfp_redraw_inputs failed", label);
            break;
        }
        for (int32_t r = 0; r < R; r++) {
            /* T per round: S, then varying prefixes including 0 and 1. */
            static const int32_t pick[3][8] = {{24, 24, 24, 24, 24, 24, 24, 24},
                                               {1, 0, 24, 7, 0, 13, 2, 24},
                                               {0, 24, 5, 1, 24, 0, 9, 3}};
            int32_t T = pick[i][r] < p.T[r] ? pick[i][r] : p.T[r];
            rd->T[r] = T;
            rd->x[r] = (uint16_t *)mft_alloc(xb);
            rd->ids[r] = (int32_t *)mft_alloc(kb);
            rd->w[r] = (float *)mft_alloc(kb);
            rd->y_ref[r] = (uint16_t *)mft_alloc(xb);
            rd->y[r] = (uint16_t *)mft_alloc(xb);
            memcpy(rd->x[r], p.x[r], (size_t)T * (size_t)s.H * 2);
            memcpy(rd->ids[r], p.topk_ids[r], (size_t)T * (size_t)s.K * 4);
            memcpy(rd->w[r], p.topk_weights[r], (size_t)T * (size_t)s.K * 4);
            mft_poison(rd->y[r], xb);
        }
        /* The reference of this round: the problem's view with this round's T and arrays. */
        mfref_problem_t ref = p.ref;
        ref.T = rd->T;
        ref.x = (const uint16_t *const *)rd->x;
        ref.topk_ids = (const int32_t *const *)rd->ids;
        ref.topk_weights = (const float *const *)rd->w;
        if (mfref_layer(&ref, rd->y_ref) != 0)
            rc = mft_fail(__FILE__, __LINE__, "%s: mfref_layer failed in round %d", label, i);
    }
    if (!rc) {
        c->group = mft_cpu_group(R, LAYER_TIMEOUT_MS);
        if (!c->group) rc = 1;
        else {
            rc = mft_run_ranks(R, repeat_rank, c);
            mf_group_destroy(c->group);
        }
    }
    if (!rc) rc = check_rounds(c, label);
    for (int i = 0; i < ROUNDS; i++)
        for (int32_t r = 0; r < R; r++) {
            free(c->rounds[i].x[r]);
            free(c->rounds[i].ids[r]);
            free(c->rounds[i].w[r]);
            free(c->rounds[i].y_ref[r]);
            free(c->rounds[i].y[r]);
        }
    free(c);
    mfp_free(&p);
    return rc;
}

static int test_repeat(void) {
    if (repeat_case(2, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR)) return 1;
    if (repeat_case(4, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED)) return 1;
    if (repeat_case(8, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR)) return 1;
    if (repeat_case(1, MF_DTYPE_BF16, MF_LAYOUT_MASKED)) return 1;
    return 0;
}

/* ---- a NaN / Inf token touches only itself ---------------------------------------------------- */

/* docs/DESIGN.md: NaN/Inf in one token's input may make that token's output NaN; it never touches
 * other tokens. The reference is computed on the clean inputs; then rank 0 token 0 gets an Inf and
 * rank 1 token 3 a NaN, and every other token must still match the reference. */
static int nan_case(int32_t dtype, int32_t layout) {
    mfp_spec_t s = base_spec(2, dtype, layout);
    s.K = 8; /* many experts per token: the poisoned rows share experts with most other tokens */
    s.seed += 99;
    char label[128];
    snprintf(label, sizeof label, "nan_isolation %s %s", dtype_name(dtype), layout_name(layout));
    mfp_problem_t p;
    if (mfp_generate(&s, &p) != 0) MFT_FAIL("%s: mfp_generate failed", label);
    int32_t H = s.H, R = s.R;
    uint16_t *y[2], *y_ref[2];
    for (int32_t r = 0; r < R; r++) {
        y[r] = (uint16_t *)mft_alloc((size_t)p.T[r] * (size_t)H * 2);
        y_ref[r] = (uint16_t *)mft_alloc((size_t)p.T[r] * (size_t)H * 2);
    }
    int rc = 0;
    char err[512] = "";
    if (mfref_layer(&p.ref, y_ref) != 0) rc = mft_fail(__FILE__, __LINE__, "mfref_layer failed");
    const int32_t bad_rank[2] = {0, 1}, bad_token[2] = {0, 3};
    p.x[0][0 * (size_t)H + 7] = 0x7f80;   /* +Inf */
    p.x[1][3 * (size_t)H + 130] = 0x7fc0; /* NaN, in the second 128-block */
    if (!rc) {
        mf_result_t r = mfp_run_forward(&p, MF_BACKEND_CPU, 1, LAYER_TIMEOUT_MS, y, NULL, err,
                                        (int)sizeof err);
        if (r != MF_SUCCESS)
            rc = mft_fail(__FILE__, __LINE__, "%s: mfp_run_forward -> %s: %s", label,
                          mft_result_name(r), err);
    }
    /* Blank the poisoned tokens' rows in both (they may be anything), then compare the rest. */
    for (int i = 0; i < 2 && !rc; i++) {
        memset(y[bad_rank[i]] + (size_t)bad_token[i] * H, 0, (size_t)H * 2);
        memset(y_ref[bad_rank[i]] + (size_t)bad_token[i] * H, 0, (size_t)H * 2);
    }
    for (int32_t r = 0; r < R && !rc; r++) rc = compare_y(label, r, dtype, y[r], y_ref[r], p.T[r], H);
    for (int32_t r = 0; r < R; r++) {
        free(y[r]);
        free(y_ref[r]);
    }
    mfp_free(&p);
    return rc;
}

static int test_nan_isolation(void) {
    for (int32_t dtype = 0; dtype < 2; dtype++)
        for (int32_t layout = 0; layout < 2; layout++)
            if (nan_case(dtype, layout)) return 1;
    return 0;
}

/* ---- two layers sharing one comm ------------------------------------------------------------ */

/* Layer A (FP8, EXPERT_MAJOR) is created first, then layer B (BF16, MASKED, larger H and S), which
 * grows the comm's shared heap. Forwards alternate A, B, A; then A is destroyed and B runs again.
 * Each result matches its reference, and repeats are bitwise identical. */
typedef struct two_ctx {
    mfp_problem_t *p[2];
    mf_group_t group;
    uint16_t *y[2][2][8]; /* [layer][call][rank] -> [T, H] */
    char err[8][256];
} two_ctx_t;

static int two_rank(int32_t rank, void *arg) {
    two_ctx_t *c = (two_ctx_t *)arg;
    mf_comm_t comm = NULL;
    mf_moe_t moe[2] = {NULL, NULL};
    MFT_CHECK_OK(mf_group_get_comm(c->group, rank, &comm));
    mf_result_t res = MF_SUCCESS;
    for (int l = 0; l < 2 && res == MF_SUCCESS; l++) {
        res = create_layer(comm, c->p[l], rank, &moe[l]);
        if (res != MF_SUCCESS)
            snprintf(c->err[rank], sizeof c->err[rank], "layer %c: %s: %s", 'A' + l,
                     mft_result_name(res), mf_last_error());
    }
    static const int order[4][2] = {{0, 0}, {1, 0}, {0, 1}, {1, 1}}; /* (layer, call) */
    for (int i = 0; i < 4 && res == MF_SUCCESS; i++) {
        int l = order[i][0], call = order[i][1];
        const mfp_problem_t *p = c->p[l];
        int32_t T = p->T[rank], H = p->spec.H, K = p->spec.K;
        if (i == 3) {
            res = mf_moe_destroy(moe[0]);
            moe[0] = NULL;
            if (res != MF_SUCCESS) break;
        }
        mf_moe_forward_in_t in;
        mf_moe_forward_out_t out;
        in.x = mft_t2(p->x[rank], MF_DTYPE_BF16, T, H);
        in.topk_ids = mft_t2(p->topk_ids[rank], MF_DTYPE_INT32, T, K);
        in.topk_weights = mft_t2(p->topk_weights[rank], MF_DTYPE_FP32, T, K);
        out.y = mft_t2(c->y[l][call][rank], MF_DTYPE_BF16, T, H);
        res = mf_moe_forward(moe[l], &in, &out, NULL);
        if (res != MF_SUCCESS)
            snprintf(c->err[rank], sizeof c->err[rank], "forward %d (layer %c): %s: %s", i, 'A' + l,
                     mft_result_name(res), mf_last_error());
    }
    mf_moe_destroy(moe[0]);
    mf_moe_destroy(moe[1]);
    if (res != MF_SUCCESS) MFT_FAIL("rank %d: %s", (int)rank, c->err[rank]);
    return 0;
}

static int two_layers_check(two_ctx_t *c, int32_t R) {
    for (int l = 0; l < 2; l++) {
        const mfp_problem_t *p = c->p[l];
        uint16_t *y_ref[8];
        for (int32_t r = 0; r < R; r++)
            y_ref[r] = (uint16_t *)mft_alloc((size_t)p->T[r] * (size_t)p->spec.H * 2);
        int rc = mfref_layer(&p->ref, y_ref) != 0;
        if (rc) mft_fail(__FILE__, __LINE__, "mfref_layer failed");
        for (int32_t r = 0; r < R && !rc; r++) {
            rc = compare_y(l ? "two_layers B" : "two_layers A", r, p->spec.dtype, c->y[l][0][r],
                           y_ref[r], p->T[r], p->spec.H);
            if (!rc && memcmp(c->y[l][0][r], c->y[l][1][r],
                              (size_t)p->T[r] * (size_t)p->spec.H * 2) != 0)
                rc = mft_fail(__FILE__, __LINE__, "layer %c rank %d: the second forward differs from "
                              "the first", 'A' + l, (int)r);
        }
        for (int32_t r = 0; r < R; r++) free(y_ref[r]);
        if (rc) return 1;
    }
    return 0;
}

static int test_two_layers(void) {
    const int32_t R = 4;
    mfp_spec_t a = base_spec(R, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR);
    mfp_spec_t b = base_spec(R, MF_DTYPE_BF16, MF_LAYOUT_MASKED);
    a.S = a.T_per_rank = 16;
    b.E = 8;
    b.K = 2;
    b.H = 512;
    b.I = 128;
    b.S = b.T_per_rank = 32;
    b.routing = MFP_ROUTING_ZIPF;
    b.seed += 5;
    mfp_problem_t pa, pb;
    if (mfp_generate(&a, &pa) != 0) MFT_FAIL("mfp_generate A failed");
    if (mfp_generate(&b, &pb) != 0) MFT_FAIL("mfp_generate B failed");
    two_ctx_t *c = (two_ctx_t *)calloc(1, sizeof *c);
    if (!c) MFT_FAIL("out of memory");
    c->p[0] = &pa;
    c->p[1] = &pb;
    for (int l = 0; l < 2; l++)
        for (int call = 0; call < 2; call++)
            for (int32_t r = 0; r < R; r++)
                c->y[l][call][r] = (uint16_t *)mft_alloc((size_t)c->p[l]->T[r] *
                                                         (size_t)c->p[l]->spec.H * 2);
    /* The comm's heap is sized once: declare the larger layer's (mf_moe_heap_bytes). */
    int rc = 1;
    mf_moe_config_t ca = layer_config(&pa), cb = layer_config(&pb);
    int64_t ha = 0, hb = 0;
    MFT_CHECK_OK(mf_moe_heap_bytes(&ca, R, &ha));
    MFT_CHECK_OK(mf_moe_heap_bytes(&cb, R, &hb));
    MFT_CHECK(ha > 0 && hb > ha);
    mf_group_config_t gc = MF_GROUP_CONFIG_INIT;
    gc.backend = MF_BACKEND_CPU;
    gc.num_ranks = R;
    gc.timeout_ms = LAYER_TIMEOUT_MS;
    gc.heap_bytes = hb;
    MFT_CHECK_OK(mf_group_create(&gc, &c->group));
    if (c->group) {
        rc = mft_run_ranks(R, two_rank, c);
        mf_group_destroy(c->group);
    }
    if (!rc) rc = two_layers_check(c, R);
    for (int l = 0; l < 2; l++)
        for (int call = 0; call < 2; call++)
            for (int32_t r = 0; r < R; r++) free(c->y[l][call][r]);
    free(c);
    mfp_free(&pa);
    mfp_free(&pb);
    return rc;
}

/* ---- MF_DEBUG ------------------------------------------------------------------------------ */

/* Runs `spec` `iters` times with stderr sent to a file; the file's text into out (NUL-ended). */
static int run_capturing_stderr(const mfp_spec_t *spec, int32_t iters, char *out, size_t bytes) {
    FILE *f = tmpfile();
    MFT_CHECK(f != NULL);
    fflush(stderr);
    int saved = dup(STDERR_FILENO);
    MFT_CHECK(saved >= 0);
    MFT_CHECK(dup2(fileno(f), STDERR_FILENO) >= 0);
    int rc = run_spec(spec, iters, "debug");
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);
    rewind(f);
    size_t n = fread(out, 1, bytes - 1, f);
    out[n] = '\0';
    fclose(f);
    return rc;
}

static int count_lines_with(const char *text, const char *a, const char *b) {
    int n = 0;
    for (const char *line = text; line && *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        char buf[1024];
        snprintf(buf, sizeof buf, "%.*s", (int)(len < sizeof buf ? len : sizeof buf - 1), line);
        if (strstr(buf, a) && strstr(buf, b)) n++;
        line = end ? end + 1 : NULL;
    }
    return n;
}

/* MF_DEBUG=1: each GEMM decision of the CPU backend is reported once per (layer, phase, shape),
 * however many ranks and calls make it; unset, nothing is printed. */
static int test_debug_report(void) {
    static char text[1 << 16];
    mfp_spec_t s = base_spec(2, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR);
    MFT_CHECK(setenv("MF_DEBUG", "1", 1) == 0);
    mf__debug_reset();
    if (run_capturing_stderr(&s, 3, text, sizeof text)) return 1;
    const char *pre = "moeflow DEBUG [pid ";
    MFT_CHECK_MSG(count_lines_with(text, pre, "gemm layer 0 w13 bf16 H 256 I 256 L 8: ran cpu reference GEMM") == 1,
                  "stderr was:\n%s", text);
    MFT_CHECK_MSG(count_lines_with(text, pre, "gemm layer 0 w2 bf16 H 256 I 256 L 8: ran cpu reference GEMM") == 1,
                  "stderr was:\n%s", text);
    MFT_CHECK_MSG(count_lines_with(text, pre, "declined: none") == 2, "stderr was:\n%s", text);
    MFT_CHECK(unsetenv("MF_DEBUG") == 0);
    mf__debug_reset();
    if (run_capturing_stderr(&s, 1, text, sizeof text)) return 1;
    MFT_CHECK_MSG(strstr(text, "moeflow DEBUG") == NULL, "MF_DEBUG unset, stderr was:\n%s", text);
    MFT_CHECK(setenv("MF_DEBUG", "0", 1) == 0);
    mf__debug_reset();
    if (run_capturing_stderr(&s, 1, text, sizeof text)) return 1;
    MFT_CHECK_MSG(strstr(text, "moeflow DEBUG") == NULL, "MF_DEBUG=0, stderr was:\n%s", text);
    return 0;
}

const mft_test_t mft_tests_layer[] = {
    {"layer_bf16_expert_major", test_bf16_expert_major, 60},
    {"layer_bf16_masked", test_bf16_masked, 60},
    {"layer_fp8_expert_major", test_fp8_expert_major, 60},
    {"layer_fp8_masked", test_fp8_masked, 60},
    {"layer_fp8_ue8m0", test_fp8_ue8m0, 60},
    {"layer_odd_sizes", test_odd_sizes, 60},
    {"layer_expert_edges", test_expert_edges, 60},
    {"layer_token_counts", test_token_counts, 60},
    {"layer_hot_expert", test_hot_expert, 60},
    {"layer_rank0_only", test_rank0_only, 60},
    {"layer_idle_ranks", test_idle_ranks, 60},
    {"layer_drops", test_drops, 60},
    {"layer_iters", test_iters, 60},
    {"layer_repeat", test_repeat, 90},
    {"layer_two_layers", test_two_layers, 60},
    {"layer_nan_isolation", test_nan_isolation, 60},
    {"layer_debug_report", test_debug_report, 60},
    {NULL, NULL, 0},
};
