/*
 * test_placement.c — where a layer's experts live (mf_placement_t; docs/DESIGN.md "Placement") on
 * the CPU backend:
 *   placement_info      what each rank is told: L_r, its first expert, its weight slots, and
 *                       receive sizes bounded by the rank that holds the most (tables written
 *                       out by hand: Qwen3's 128 experts on R = 6 is 22, 22, 21, 21, 21, 21);
 *   placement_forward   uneven LINEAR and ROUND_ROBIN layers (both dtypes and layouts, idle ranks,
 *                       skewed routing): y bit-identical to the same tokens on one rank (the
 *                       identity placement), within the oracle's bounds of the fp64 reference,
 *                       and the rows each rank computed are its experts' rows;
 *   placement_comm      mf_dispatch + mf_combine with the identity expert (workload/problem.h):
 *                       y of every call is the same under every placement of the same E, R;
 *   placement_ipc       a round-robin layer over ranks as processes (ipc transport) equals the
 *                       same layer on threads, forward and dispatch + combine, call by call;
 *   placement_misuse    configs (bad value, E < R, replicas or spare slots with a mapped
 *                       placement, an older config without the field) and calls (weights of
 *                       another L_r, expert maps on a placed layer) fail with clear errors and
 *                       change nothing.
 * The dispatch outputs themselves (row by row, identity payloads) are checked by test_dispatch.c.
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "problem.h"
#include "ref.h"

#define PL_TIMEOUT_MS 20000

static mfp_spec_t pl_spec(int32_t R, int32_t E, int32_t placement, int32_t dtype, int32_t layout, uint64_t seed) {
    mfp_spec_t s;
    memset(&s, 0, sizeof s);
    s.R = R, s.E = E, s.K = 3, s.H = 256, s.I = 128, s.S = 12, s.T_per_rank = 12;
    s.dtype = dtype, s.layout = layout, s.routing = MFP_ROUTING_UNIFORM, s.zipf_s = 1.2, s.hot_expert = E - 1;
    s.placement = placement, s.seed = seed;
    return s;
}

static const char *pl_name(int32_t placement) { return placement ? "round_robin" : "linear"; }

static mf_moe_config_t pl_config(int32_t E, int32_t placement) {
    mf_moe_config_t c = MF_MOE_CONFIG_INIT;
    c.num_experts = E, c.num_topk = 2, c.hidden = 128, c.intermediate = 128, c.max_tokens_per_rank = 8;
    c.placement = placement;
    return c;
}

/* ---- what each rank is told ----------------------------------------------------------------- */

typedef struct info_case {
    int32_t R, E, placement;
    int32_t L[8], first[8]; /* per rank, by hand */
} info_case_t;

typedef struct info_ctx {
    mf_group_t group;
    const info_case_t *c;
} info_ctx_t;

static int info_rank(int32_t rank, void *arg) {
    const info_ctx_t *x = arg;
    const info_case_t *c = x->c;
    mf_comm_t comm;
    MFT_CHECK_OK(mf_group_get_comm(x->group, rank, &comm));
    /* The placed layer, and a plain layer of R * ceil(E / R) experts: every rank of it holds as many
     * as the placed layer's fullest rank, so its receive sizes are the ones to expect. */
    const int32_t Ls = (c->E + c->R - 1) / c->R;
    for (int32_t layout = 0; layout < 2; layout++) {
        mf_moe_config_t cfg = pl_config(c->E, c->placement), even = pl_config(c->R * Ls, MF_PLACEMENT_LINEAR);
        cfg.layout = even.layout = layout;
        mf_moe_t moe, ref;
        MFT_CHECK_OK(mf_moe_create(comm, &cfg, &moe));
        MFT_CHECK_OK(mf_moe_create(comm, &even, &ref));
        mf_moe_info_t a, b;
        MFT_CHECK_OK(mf_moe_get_info(moe, &a));
        MFT_CHECK_OK(mf_moe_get_info(ref, &b));
        MFT_CHECK_OK(mf_moe_destroy(moe));
        MFT_CHECK_OK(mf_moe_destroy(ref));
        MFT_CHECK_MSG(a.num_local_experts == c->L[rank] && a.num_local_slots == c->L[rank] &&
                          a.first_expert == c->first[rank] && a.placement == c->placement,
                      "E %d R %d %s rank %d: L %d slots %d first %d placement %d, want L %d first %d", (int)c->E,
                      (int)c->R, pl_name(c->placement), (int)rank, (int)a.num_local_experts, (int)a.num_local_slots,
                      (int)a.first_expert, (int)a.placement, (int)c->L[rank], (int)c->first[rank]);
        MFT_CHECK_EQ_INT(a.max_recv_rows, b.max_recv_rows);
        MFT_CHECK_EQ_INT(a.expert_capacity, b.expert_capacity);
        MFT_CHECK_EQ_INT(a.block_m, b.block_m);
        int64_t bytes_a = 0, bytes_b = 0;
        MFT_CHECK_OK(mf_moe_heap_bytes(&cfg, c->R, &bytes_a));
        MFT_CHECK_OK(mf_moe_heap_bytes(&even, c->R, &bytes_b));
        MFT_CHECK_EQ_INT(bytes_a, bytes_b);
    }
    return 0;
}

static int test_info(void) {
    static const info_case_t cases[] = {
        {6, 128, MF_PLACEMENT_LINEAR, {22, 22, 21, 21, 21, 21}, {0, 22, 44, 65, 86, 107}}, /* Qwen3 on 6 */
        {3, 10, MF_PLACEMENT_LINEAR, {4, 3, 3}, {0, 4, 7}},
        {4, 10, MF_PLACEMENT_LINEAR, {3, 3, 2, 2}, {0, 3, 6, 8}},
        {2, 8, MF_PLACEMENT_LINEAR, {4, 4}, {0, 4}},
        {4, 10, MF_PLACEMENT_ROUND_ROBIN, {3, 3, 2, 2}, {0, 1, 2, 3}},
        {4, 12, MF_PLACEMENT_ROUND_ROBIN, {3, 3, 3, 3}, {0, 1, 2, 3}},
        {3, 3, MF_PLACEMENT_ROUND_ROBIN, {1, 1, 1}, {0, 1, 2}},
        {8, 9, MF_PLACEMENT_ROUND_ROBIN, {2, 1, 1, 1, 1, 1, 1, 1}, {0, 1, 2, 3, 4, 5, 6, 7}},
        {1, 5, MF_PLACEMENT_ROUND_ROBIN, {5}, {0}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        info_ctx_t x = {mft_cpu_group(cases[i].R, PL_TIMEOUT_MS), &cases[i]};
        MFT_CHECK(x.group);
        int rc = mft_run_ranks(cases[i].R, info_rank, &x);
        MFT_CHECK_OK(mf_group_destroy(x.group));
        if (rc) return rc;
    }
    return 0;
}

/* ---- the whole layer ------------------------------------------------------------------------ */

static uint16_t **pl_alloc_y(const mfp_problem_t *p) { return mft_alloc_ys(p->spec.R, p->T, p->spec.H); }

/* y of `p` (R ranks, its placement) against the same tokens on one rank, bit for bit, and against
 * the fp64 reference within the oracle's bounds; the rows per rank of the balance stats are the
 * placement's (nothing replicated: recv_rows = home_rows = the rows of the rank's experts). */
static int forward_case(const mfp_spec_t *spec, const char *label) {
    mfp_problem_t p, one;
    MFT_CHECK(mfp_generate(spec, &p) == 0);
    MFT_CHECK(mfp_gather_ranks(&p, &one) == 0);
    const int32_t R = p.spec.R, H = p.spec.H, fp8 = p.spec.dtype == MF_DTYPE_FP8_E4M3;
    uint16_t **y = pl_alloc_y(&p), **y1 = pl_alloc_y(&one), **yref = pl_alloc_y(&p);
    mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
    o.backend = MF_BACKEND_CPU, o.iters = 2, o.timeout_ms = PL_TIMEOUT_MS;
    mfp_timing_t t;
    memset(&t, 0, sizeof t);
    char err[512];
    int rc = 0;
    if (mfp_run(&p, &o, y, &t, err, sizeof err) != MF_SUCCESS) rc = mft_fail(__FILE__, __LINE__, "%s: %s", label, err);
    if (!rc && mfp_run(&one, &o, y1, NULL, err, sizeof err) != MF_SUCCESS)
        rc = mft_fail(__FILE__, __LINE__, "%s on one rank: %s", label, err);
    for (int32_t r = 0, t0 = 0; r < R && !rc; t0 += p.T[r], r++)
        for (int64_t i = 0; i < (int64_t)p.T[r] * H && !rc; i++)
            if (y[r][i] != y1[0][(int64_t)t0 * H + i])
                rc = mft_fail(__FILE__, __LINE__, "%s: rank %d y[t=%lld, h=%lld] = 0x%04x, one rank 0x%04x", label,
                              (int)r, (long long)(i / H), (long long)(i % H), y[r][i], y1[0][(int64_t)t0 * H + i]);
    if (!rc && mfref_layer(&p.ref, yref) != 0) rc = mft_fail(__FILE__, __LINE__, "%s: mfref_layer failed", label);
    for (int32_t r = 0; r < R && !rc; r++) {
        const int64_t n = (int64_t)p.T[r] * H;
        double worst = 0, diff = mfref_diff_bf16(y[r], yref[r], n);
        int64_t wrong = mfref_count_wrong_bf16(y[r], yref[r], n, fp8 ? MFREF_ORACLE_ATOL_FP8 : MFREF_ORACLE_ATOL_BF16,
                                               MFREF_ORACLE_RTOL, NULL, &worst);
        if (wrong || !(diff < (fp8 ? MFREF_DIFF_MAX_FP8 : MFREF_DIFF_MAX_BF16)))
            rc = mft_fail(__FILE__, __LINE__, "%s: rank %d: %lld values outside the oracle's bounds, diff %.3g", label,
                          (int)r, (long long)wrong, diff);
    }
    int64_t rows[MF_MAX_RANKS];
    mfp_count_rows(&p, rows, NULL);
    const int mapped = p.spec.E % R != 0 || (p.spec.placement == MF_PLACEMENT_ROUND_ROBIN && R > 1 && p.spec.E > R);
    if (!rc && mapped && !t.have_balance) rc = mft_fail(__FILE__, __LINE__, "%s: no balance stats", label);
    for (int32_t r = 0; r < R && !rc && t.have_balance; r++)
        if (t.balance.recv_rows[r] != rows[r] || t.balance.home_rows[r] != rows[r])
            rc = mft_fail(__FILE__, __LINE__, "%s: rank %d computed %lld rows (home %lld), its experts have %lld", label,
                          (int)r, (long long)t.balance.recv_rows[r], (long long)t.balance.home_rows[r],
                          (long long)rows[r]);
    if (!rc) mft_verbose("  %s: bit-identical to one rank, within the oracle's bounds\n", label);
    mft_free_ys(y, R), mft_free_ys(y1, 1), mft_free_ys(yref, R);
    mfp_free(&p), mfp_free(&one);
    return rc;
}

static int test_forward(void) {
    static const int32_t T3[3] = {12, 0, 7}, T4[4] = {0, 12, 3, 0}, T6[6] = {5, 12, 0, 1, 12, 8};
    static const struct {
        int32_t R, E, placement, dtype, layout, routing, K;
        const int32_t *T;
    } cases[] = {
        {3, 10, MF_PLACEMENT_LINEAR, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_UNIFORM, 3, NULL},
        {3, 10, MF_PLACEMENT_LINEAR, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, MFP_ROUTING_HOT, 3, T3},
        {4, 10, MF_PLACEMENT_LINEAR, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_ZIPF, 4, T4},
        {4, 10, MF_PLACEMENT_LINEAR, MF_DTYPE_BF16, MF_LAYOUT_MASKED, MFP_ROUTING_UNIFORM, 2, NULL},
        {6, 26, MF_PLACEMENT_LINEAR, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_ZIPF, 8, T6},
        {6, 128, MF_PLACEMENT_LINEAR, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_UNIFORM, 8, NULL},
        {4, 12, MF_PLACEMENT_ROUND_ROBIN, MF_DTYPE_BF16, MF_LAYOUT_MASKED, MFP_ROUTING_HOT, 3, T4},
        {4, 12, MF_PLACEMENT_ROUND_ROBIN, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_UNIFORM, 3, NULL},
        {4, 10, MF_PLACEMENT_ROUND_ROBIN, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, MFP_ROUTING_ZIPF, 3, NULL},
        {4, 10, MF_PLACEMENT_ROUND_ROBIN, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_HOT, 5, T4},
        {3, 11, MF_PLACEMENT_ROUND_ROBIN, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_UNIFORM, 3, T3},
        {8, 9, MF_PLACEMENT_ROUND_ROBIN, MF_DTYPE_BF16, MF_LAYOUT_MASKED, MFP_ROUTING_ZIPF, 2, NULL},
        {2, 3, MF_PLACEMENT_LINEAR, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, MFP_ROUTING_UNIFORM, 2, NULL},
        {2, 3, MF_PLACEMENT_ROUND_ROBIN, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_HOT, 3, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        mfp_spec_t s = pl_spec(cases[i].R, cases[i].E, cases[i].placement, cases[i].dtype, cases[i].layout, 300 + i);
        s.routing = cases[i].routing, s.K = cases[i].K, s.T_of_rank = cases[i].T, s.drop_prob = i % 3 == 0 ? 0.1 : 0;
        if (s.E > 64) s.H = 128, s.S = s.T_per_rank = 6; /* Qwen3's 128 experts: small rows */
        char label[160];
        snprintf(label, sizeof label, "E %d R %d %s %s %s K %d", (int)s.E, (int)s.R, pl_name(s.placement),
                 s.dtype == MF_DTYPE_FP8_E4M3 ? "fp8" : "bf16", s.layout == MF_LAYOUT_MASKED ? "masked" : "expert_major",
                 (int)s.K);
        if (forward_case(&s, label)) return 1;
    }
    return 0;
}

/* ---- dispatch + combine, processes ---------------------------------------------------------- */

enum { PL_CALLS = 3 };

/* Runs `p` as `o` says for PL_CALLS calls with the routing redrawn each call; digests[R * PL_CALLS * 2]. */
static int run_digests(const mfp_problem_t *p, mfp_run_opts_t o, uint64_t *digests, const char *label) {
    uint16_t **y = pl_alloc_y(p);
    o.backend = MF_BACKEND_CPU, o.iters = PL_CALLS, o.timeout_ms = PL_TIMEOUT_MS;
    o.redraw = 1, o.redraw_seed = 900, o.digests = digests;
    char err[512];
    mf_result_t res = mfp_run(p, &o, y, NULL, err, sizeof err);
    mft_free_ys(y, p->spec.R);
    MFT_CHECK_MSG(res == MF_SUCCESS, "%s: %s", label, err);
    return 0;
}

/* mf_dispatch + mf_combine with the identity expert (each row's output a function of its source and
 * value): y of every call equals the linear layer's whatever the placement; the dispatch outputs
 * follow the routing (their digests change from call to call). */
static int test_comm(void) {
    static const int32_t shapes[][2] = {{4, 12}, {4, 10}, {3, 10}, {2, 3}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const int32_t R = shapes[i][0], E = shapes[i][1];
        uint64_t d[2][MF_MAX_RANKS * PL_CALLS * 2];
        for (int32_t pl = 0; pl < 2; pl++) {
            mfp_spec_t s = pl_spec(R, E, pl, i % 2 ? MF_DTYPE_FP8_E4M3 : MF_DTYPE_BF16,
                                   i / 2 ? MF_LAYOUT_MASKED : MF_LAYOUT_EXPERT_MAJOR, 400 + i);
            s.drop_prob = 0.1;
            mfp_problem_t p;
            MFT_CHECK(mfp_generate(&s, &p) == 0);
            mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
            o.op = MFP_OP_DISPATCH_COMBINE;
            char label[96];
            snprintf(label, sizeof label, "E %d R %d %s dispatch + combine", (int)E, (int)R, pl_name(pl));
            int rc = run_digests(&p, o, d[pl], label);
            mfp_free(&p);
            if (rc) return rc;
        }
        for (int32_t r = 0; r < R; r++)
            for (int32_t c = 0; c < PL_CALLS; c++) {
                const size_t at = ((size_t)r * PL_CALLS + c) * 2;
                MFT_CHECK_MSG(d[0][at + 1] == d[1][at + 1], "E %d R %d rank %d call %d: y differs between placements",
                              (int)E, (int)R, (int)r, (int)c);
                MFT_CHECK_MSG(d[1][at] != 0 && (c == 0 || d[1][at] != d[1][at - 2]),
                              "E %d R %d rank %d call %d: the dispatch digest does not follow the routing", (int)E,
                              (int)R, (int)r, (int)c);
            }
    }
    return 0;
}

/* A round-robin layer of 10 experts on 3 rank processes (ipc) against the same on threads: the
 * forward's y and dispatch + combine's outputs, call by call. */
static int test_ipc(void) {
    static const int32_t T3[3] = {12, 0, 5};
    mfp_spec_t s = pl_spec(3, 10, MF_PLACEMENT_ROUND_ROBIN, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, 501);
    s.T_of_rank = T3, s.routing = MFP_ROUTING_ZIPF;
    mfp_problem_t p;
    MFT_CHECK(mfp_generate(&s, &p) == 0);
    int rc = 0;
    for (int op = 0; op < 2 && !rc; op++) {
        uint64_t d[2][3 * PL_CALLS * 2];
        for (int t = 0; t < 2 && !rc; t++) {
            mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
            o.op = op ? MFP_OP_DISPATCH_COMBINE : MFP_OP_FORWARD;
            o.transport = t ? MF_TRANSPORT_IPC : MF_TRANSPORT_LOCAL;
            rc = run_digests(&p, o, d[t], t ? "ipc" : "local");
        }
        for (int i = 0; i < 3 * PL_CALLS * 2 && !rc; i++)
            if (d[0][i] != d[1][i])
                rc = mft_fail(__FILE__, __LINE__, "%s: rank %d call %d: the %s digest differs between ipc and local",
                              op ? "dispatch + combine" : "forward", i / (2 * PL_CALLS), (i / 2) % PL_CALLS,
                              i % 2 ? "y" : "dispatch");
    }
    mfp_free(&p);
    return rc;
}

/* ---- misuse --------------------------------------------------------------------------------- */

typedef struct misuse_ctx {
    mf_group_t group;
    const mfp_problem_t *p; /* E = 10 on R = 3, LINEAR (4, 3, 3 experts), BF16 */
    uint16_t **yref;
} misuse_ctx_t;

static int expect_create_fails(mf_comm_t comm, const mf_moe_config_t *cfg, mf_result_t code, const char *needle,
                               const char *what) {
    mf_moe_t moe = NULL;
    mf_result_t res = mf_moe_create(comm, cfg, &moe);
    if (res == MF_SUCCESS) mf_moe_destroy(moe);
    MFT_CHECK_MSG(res == code && moe == NULL, "%s: mf_moe_create -> %s (%s), want %s", what, mft_result_name(res),
                  mf_last_error(), mft_result_name(code));
    MFT_CHECK_MSG(mft_contains_ci(mf_last_error(), needle), "%s: the message does not say \"%s\": %s", what, needle,
                  mf_last_error());
    mft_verbose("  %s: %s\n", what, mf_last_error());
    return 0;
}

static int misuse_configs(mf_comm_t comm, int32_t rank) {
    mf_moe_config_t c = pl_config(10, 2);
    if (expect_create_fails(comm, &c, MF_ERR_INVALID_ARGUMENT, "placement", "placement 2")) return 1;
    c = pl_config(2, MF_PLACEMENT_LINEAR);
    if (expect_create_fails(comm, &c, MF_ERR_INVALID_ARGUMENT, "at least one expert", "E = 2 on R = 3")) return 1;
    c = pl_config(12, MF_PLACEMENT_ROUND_ROBIN);
    c.num_physical_experts = 15;
    if (expect_create_fails(comm, &c, MF_ERR_NOT_SUPPORTED, "replicas", "round robin with replicas")) return 1;
    c = pl_config(10, MF_PLACEMENT_LINEAR);
    c.spare_slots = 1;
    if (expect_create_fails(comm, &c, MF_ERR_NOT_SUPPORTED, "spare slots", "uneven linear with spare slots")) return 1;
    c = pl_config(12, MF_PLACEMENT_ROUND_ROBIN);
    c.spare_slots = 2;
    if (expect_create_fails(comm, &c, MF_ERR_NOT_SUPPORTED, "spare slots", "round robin with spare slots")) return 1;
    /* Replicas stay fine on the linear grid; P = E with an uneven placement is no replica. */
    mf_moe_t moe;
    c = pl_config(12, MF_PLACEMENT_LINEAR);
    c.num_physical_experts = 15;
    MFT_CHECK_OK(mf_moe_create(comm, &c, &moe));
    MFT_CHECK_OK(mf_moe_destroy(moe));
    c = pl_config(10, MF_PLACEMENT_ROUND_ROBIN);
    c.num_physical_experts = 10;
    MFT_CHECK_OK(mf_moe_create(comm, &c, &moe));
    MFT_CHECK_OK(mf_moe_destroy(moe));
    /* A config from before the field (its size ends at spare_slots): LINEAR, whatever lies beyond. */
    c = pl_config(10, MF_PLACEMENT_ROUND_ROBIN);
    c.size = (uint32_t)offsetof(mf_moe_config_t, placement);
    MFT_CHECK_OK(mf_moe_create(comm, &c, &moe));
    mf_moe_info_t info;
    MFT_CHECK_OK(mf_moe_get_info(moe, &info));
    MFT_CHECK_OK(mf_moe_destroy(moe));
    MFT_CHECK_EQ_INT(info.placement, MF_PLACEMENT_LINEAR);
    MFT_CHECK_EQ_INT(info.first_expert, rank == 0 ? 0 : rank == 1 ? 4 : 7);
    return 0;
}

/* This rank's weights from the problem with `L` slots (its L_r, or a wrong count). */
static mf_moe_weights_t misuse_weights(const mfp_problem_t *p, int32_t rank, int64_t L) {
    mf_moe_weights_t w = {mft_t3(p->w13[rank], MF_DTYPE_BF16, L, 2 * p->spec.I, p->spec.H), mft_none(),
                          mft_t3(p->w2[rank], MF_DTYPE_BF16, L, p->spec.H, p->spec.I), mft_none()};
    return w;
}

/* One forward of the problem's tokens: `want` MF_SUCCESS (y equal to the reference) or an error
 * (y untouched). */
static int misuse_forward(mf_moe_t moe, const misuse_ctx_t *x, int32_t rank, mf_result_t want) {
    const mfp_problem_t *p = x->p;
    const int64_t T = p->T[rank], H = p->spec.H, K = p->spec.K;
    uint16_t *y = mft_alloc((size_t)(T * H * 2) + 2);
    mft_poison(y, (size_t)(T * H * 2));
    mf_moe_forward_in_t in = {mft_t2(p->x[rank], MF_DTYPE_BF16, T, H), mft_t2(p->topk_ids[rank], MF_DTYPE_INT32, T, K),
                              mft_t2(p->topk_weights[rank], MF_DTYPE_FP32, T, K)};
    mf_moe_forward_out_t out = {mft_t2(y, MF_DTYPE_BF16, T, H)};
    mf_result_t res = mf_moe_forward(moe, &in, &out, NULL);
    int ok = res == want && (want == MF_SUCCESS ? memcmp(y, x->yref[rank], (size_t)(T * H * 2)) == 0
                                                : mft_first_unpoisoned(y, (size_t)(T * H * 2)) < 0);
    free(y);
    MFT_CHECK_MSG(ok, "rank %d: mf_moe_forward -> %s (%s), want %s%s", (int)rank, mft_result_name(res), mf_last_error(),
                  mft_result_name(want), want == MF_SUCCESS ? " and y of the reference" : " and y untouched");
    return 0;
}

static int misuse_calls(mf_comm_t comm, int32_t rank, const misuse_ctx_t *x) {
    const mfp_problem_t *p = x->p;
    mf_moe_config_t c = pl_config(p->spec.E, MF_PLACEMENT_LINEAR);
    c.num_topk = p->spec.K, c.hidden = p->spec.H, c.intermediate = p->spec.I, c.max_tokens_per_rank = p->spec.S;
    mf_moe_t moe;
    MFT_CHECK_OK(mf_moe_create(comm, &c, &moe));
    mf_moe_info_t info;
    MFT_CHECK_OK(mf_moe_get_info(moe, &info));
    const int64_t L = info.num_local_experts;
    MFT_CHECK_EQ_INT(L, rank == 0 ? 4 : 3);
    /* Weights of another rank's count: rejected, naming the shape. */
    mf_moe_weights_t bad = misuse_weights(p, rank, rank == 0 ? 3 : 4), good = misuse_weights(p, rank, L);
    MFT_CHECK_ERR(mf_moe_set_weights(moe, &bad), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "w13") && mft_contains_ci(mf_last_error(), "shape"));
    if (misuse_forward(moe, x, rank, MF_ERR_INVALID_USAGE)) return 1; /* none set */
    MFT_CHECK_OK(mf_moe_set_weights(moe, &good));
    MFT_CHECK_ERR(mf_moe_set_weights(moe, &bad), MF_ERR_INVALID_ARGUMENT);
    if (misuse_forward(moe, x, rank, MF_SUCCESS)) return 1; /* the good ones serve */
    /* The placement is the layer's map: no other map, staged or not. */
    int32_t map[12];
    for (int32_t i = 0; i < 12; i++) map[i] = i % 10;
    MFT_CHECK_ERR(mf_moe_set_expert_map(moe, map, 12), MF_ERR_NOT_SUPPORTED);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "placement"));
    MFT_CHECK_ERR(mf_moe_stage_expert_map(moe, map, 12, &good, 0), MF_ERR_NOT_SUPPORTED);
    /* Dispatch outputs shaped by another count: rejected on every rank, nothing pending after. */
    const int64_t rows = info.max_recv_rows, H = p->spec.H, T = p->T[rank], K = p->spec.K;
    uint16_t *rx = mft_alloc((size_t)(rows * H * 2));
    int32_t *src = mft_alloc((size_t)rows * 12), *counts = mft_alloc(8 * 4), *offsets = mft_alloc(8 * 4);
    mf_dispatch_in_t din = {mft_t2(p->x[rank], MF_DTYPE_BF16, T, H), mft_t2(p->topk_ids[rank], MF_DTYPE_INT32, T, K)};
    mf_dispatch_out_t dout = {mft_t2(rx, MF_DTYPE_BF16, rows, H), mft_none(), mft_t2(src, MF_DTYPE_INT32, rows, 3),
                              mft_t1(counts, MF_DTYPE_INT32, L + 1), mft_t1(offsets, MF_DTYPE_INT32, L + 2)};
    mft_poison(counts, 8 * 4);
    mf_result_t res = mf_dispatch(moe, &din, &dout, NULL);
    const int untouched = mft_first_unpoisoned(counts, 8 * 4) < 0;
    free(rx), free(src), free(counts), free(offsets);
    MFT_CHECK_MSG(res == MF_ERR_INVALID_ARGUMENT && untouched, "rank %d: dispatch with [L_r + 1] counts -> %s (%s)",
                  (int)rank, mft_result_name(res), mf_last_error());
    if (misuse_forward(moe, x, rank, MF_SUCCESS)) return 1;
    MFT_CHECK_OK(mf_moe_destroy(moe));
    return 0;
}

static int misuse_rank(int32_t rank, void *arg) {
    const misuse_ctx_t *x = arg;
    mf_comm_t comm;
    MFT_CHECK_OK(mf_group_get_comm(x->group, rank, &comm));
    return misuse_calls(comm, rank, x) || misuse_configs(comm, rank); /* the larger heap first */
}

static int test_misuse(void) {
    mfp_spec_t s = pl_spec(3, 10, MF_PLACEMENT_LINEAR, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, 601);
    mfp_problem_t p;
    MFT_CHECK(mfp_generate(&s, &p) == 0);
    misuse_ctx_t x = {NULL, &p, pl_alloc_y(&p)};
    mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
    o.backend = MF_BACKEND_CPU, o.timeout_ms = PL_TIMEOUT_MS;
    char err[512];
    MFT_CHECK_MSG(mfp_run(&p, &o, x.yref, NULL, err, sizeof err) == MF_SUCCESS, "reference: %s", err);
    x.group = mft_cpu_group(3, PL_TIMEOUT_MS);
    MFT_CHECK(x.group);
    int rc = mft_run_ranks(3, misuse_rank, &x);
    MFT_CHECK_OK(mf_group_destroy(x.group));
    mft_free_ys(x.yref, 3);
    mfp_free(&p);
    return rc;
}

const mft_test_t mft_tests_placement[] = {
    {"placement_info", test_info, 60},
    {"placement_forward", test_forward, 120},
    {"placement_comm", test_comm, 60},
    {"placement_ipc", test_ipc, 60},
    {"placement_misuse", test_misuse, 60},
    {NULL, NULL, 0},
};
