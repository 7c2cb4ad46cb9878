/*
 * test_random.c — a randomised differential test of the whole EP MoE layer: random cases run
 * through mf_moe_forward on the CPU backend (workload/problem.h) and judged against the independent
 * fp64 reference (workload/ref.h): per rank by docs/DESIGN.md's diff measure and the element-wise
 * bounds the CPU oracle meets (MFREF_ORACLE_*), every value by NaN never passing and a token whose
 * ids are all -1 giving an exactly zero row, and per dtype by the diff pooled over the whole run
 * (MFREF_ORACLE_POOLED_DIFF_MAX: what catches a missing bf16 rounding, see ref.h).
 *
 * The case space: R in 1..8, L = E / R in 1..4, K in 1..min(E, 8) (sometimes min(E, MF_MAX_TOPK)),
 * the placement (half the cases the plain LINEAR layer; else LINEAR with E not a multiple of R, or
 * ROUND_ROBIN with E a multiple of R or not: up to R - 1 experts more),
 * H and I multiples of 128 (FP8, up to 384) or of 8 (BF16, up to 384), S in 1..32 and an uneven T
 * per rank (idle ranks with T = 0, ranks with T = S), uniform / zipf / hot routing, -1 drops (none,
 * some, all), both dtypes and layouts, UE8M0 scales on and off, block_m, and an expert_capacity /
 * max_recv_rows that is the default, exactly what the routing needs, or a little more (never
 * exceeded). R * S * K * 3 * H * I is capped per case (RND_MAX_MACS) so the suite stays fast.
 *
 * Every case is a function of one 64-bit seed: case i of a run has the seed base + i. A failing
 * case prints its whole spec and the line that replays it alone:
 *     MFT_RANDOM_SEED=<seed> MFT_RANDOM_CASES=1 ./build/moeflow_tests random
 * MFT_RANDOM_SEED sets the base (default RND_BASE_SEED), MFT_RANDOM_CASES the number of cases
 * (default RND_CASES); widen with e.g. MFT_RANDOM_CASES=3000 MFT_TIMEOUT_SCALE=50. With -v the
 * test prints every case and, per dtype, the worst error seen (how the bounds of ref.h were
 * measured).
 *
 * tests/gpu/test_cuda.c runs the same case space on the CUDA backend: it includes this file with
 * MFT_RANDOM_CASE_SPACE_ONLY defined, which leaves out the CPU test below the case space.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "problem.h"
#include "ref.h"

#define RND_BASE_SEED 20261204u /* the fixed base of `make test` */
#define RND_CASES 128           /* cases per run in `make test` */
#define RND_MAX_R 8
#define RND_MAX_L 4             /* local experts per rank */
#define RND_MAX_K 8             /* K drawn in 1..min(E, this), or min(E, MF_MAX_TOPK) */
#define RND_MAX_S 32
#define RND_MAX_HI 384          /* H and I */
#define RND_MAX_MACS 1.0e8      /* R * S * K * 3 * H * I: bounds the work of a case */
#define RND_TIMEOUT_MS 20000    /* peer waits; below the test's own limit so a hang reports */
#define RND_DEFAULT_BLOCK_M 128 /* what block_m = 0 means (docs/API.md section 3) */

/* ---- the case space (shared with tests/gpu/test_cuda.c) ------------------------------------ */

typedef enum rnd_capacity {
    RND_CAP_DEFAULT = 0, /* expert_capacity = max_recv_rows = 0: the library's worst case */
    RND_CAP_EXACT = 1,   /* exactly the rows this routing needs */
    RND_CAP_SLACK = 2    /* what it needs plus 1..8 */
} rnd_capacity_t;

typedef struct rnd_case {
    uint64_t seed;         /* the case's seed: everything below is drawn from it */
    mfp_spec_t spec;       /* spec.T_of_rank points at T; capacities are set by rnd_generate */
    int32_t T[RND_MAX_R];
    int32_t capacity;      /* rnd_capacity_t */
    int32_t dataflow;      /* mf_dataflow_t, for the CUDA backend (the CPU has one path) */
} rnd_case_t;

static const char *rnd_dtype_name(int32_t dtype) {
    return dtype == MF_DTYPE_FP8_E4M3 ? "fp8" : "bf16";
}

/* Draws case `seed`: its spec (capacities still 0) and T per rank. */
static void rnd_draw(uint64_t seed, rnd_case_t *c) {
    memset(c, 0, sizeof *c);
    c->seed = seed;
    mft_rng_t rng = {seed * 0x9e3779b97f4a7c15ull ^ 0x5851f42d4c957f2dull};
    mfp_spec_t *s = &c->spec;
    s->dtype = mft_rng_int(&rng, 2) ? MF_DTYPE_FP8_E4M3 : MF_DTYPE_BF16;
    s->layout = mft_rng_int(&rng, 2) ? MF_LAYOUT_MASKED : MF_LAYOUT_EXPERT_MAJOR;
    s->ue8m0 = mft_rng_int(&rng, 2); /* BF16 layers must ignore it */
    s->R = 1 + mft_rng_int(&rng, RND_MAX_R);
    s->E = s->R * (1 + mft_rng_int(&rng, RND_MAX_L));
    int32_t kmax = s->E < RND_MAX_K ? s->E : RND_MAX_K;
    s->K = mft_rng_int(&rng, 10) == 0 ? (s->E < MF_MAX_TOPK ? s->E : MF_MAX_TOPK)
                                      : 1 + mft_rng_int(&rng, kmax);
    const int32_t step = s->dtype == MF_DTYPE_FP8_E4M3 ? 128 : 8;
    s->H = step * (1 + mft_rng_int(&rng, RND_MAX_HI / step));
    s->I = step * (1 + mft_rng_int(&rng, RND_MAX_HI / step));
    double smax = RND_MAX_MACS / ((double)s->R * s->K * 3.0 * s->H * s->I);
    int32_t S_cap = smax >= RND_MAX_S ? RND_MAX_S : smax < 1.0 ? 1 : (int32_t)smax;
    s->S = 1 + mft_rng_int(&rng, S_cap);
    for (int32_t r = 0; r < s->R; r++) { /* idle ranks, full ranks, anything between */
        int32_t u = mft_rng_int(&rng, 20);
        c->T[r] = u < 4 ? 0 : u < 7 ? s->S : mft_rng_int(&rng, s->S + 1);
    }
    s->T_of_rank = c->T;
    s->T_per_rank = 0;
    int32_t route = mft_rng_int(&rng, 20);
    s->routing = route < 8 ? MFP_ROUTING_UNIFORM : route < 15 ? MFP_ROUTING_ZIPF : MFP_ROUTING_HOT;
    s->zipf_s = 0.5 + 2.0 * mft_rng_uniform(&rng);
    s->hot_expert = mft_rng_int(&rng, s->E);
    int32_t drop = mft_rng_int(&rng, 20);
    s->drop_prob = drop < 10 ? 0.0 : drop < 19 ? 0.5 * mft_rng_uniform(&rng) : 1.0;
    static const int32_t block_ms[] = {0, 0, 0, 1, 8, 64, 128, 256};
    s->block_m = block_ms[mft_rng_int(&rng, 8)];
    c->capacity = mft_rng_int(&rng, 3);
    static const int32_t flows[] = {MF_DATAFLOW_AUTO, MF_DATAFLOW_DIRECT, MF_DATAFLOW_PULL,
                                    MF_DATAFLOW_UNFUSED};
    c->dataflow = flows[mft_rng_int(&rng, 4)];
    s->seed = mft_rng_u64(&rng);
    /* Where the experts live, drawn last (the draws above stay those of the plain case): half the
     * cases the plain LINEAR layer; else uneven LINEAR, or ROUND_ROBIN with R | E or not. */
    const int32_t where = mft_rng_int(&rng, 4);
    if (where >= 2 && s->R > 1 && (where == 2 || mft_rng_int(&rng, 2))) s->E += 1 + mft_rng_int(&rng, s->R - 1);
    s->placement = where == 3 ? MF_PLACEMENT_ROUND_ROBIN : MF_PLACEMENT_LINEAR;
}

/* Generates the problem of case c and sets its capacities from the routing drawn: exactly what it
 * needs (RND_CAP_EXACT), a little more (RND_CAP_SLACK) or the defaults. 0 ok, -1 on failure. */
static int rnd_generate(rnd_case_t *c, mfp_problem_t *p) {
    if (mfp_generate(&c->spec, p) != 0) return -1;
    const mfp_spec_t *s = &c->spec;
    int64_t *per_expert = (int64_t *)mft_alloc(sizeof(int64_t) * (size_t)s->E);
    mfp_count_rows(p, NULL, per_expert);
    const int64_t bm = s->block_m ? s->block_m : RND_DEFAULT_BLOCK_M;
    int64_t most = 0, rows = 0; /* the fullest expert; the most rows a rank receives */
    for (int32_t q = 0; q < s->R; q++) {
        int64_t sum = 0;
        for (int32_t e = 0; e < s->E; e++) {
            if (mfp_expert_rank(s, s->placement, e) != q) continue;
            most = per_expert[e] > most ? per_expert[e] : most;
            sum += (per_expert[e] + bm - 1) / bm * bm;
        }
        rows = sum > rows ? sum : rows;
    }
    free(per_expert);
    if (c->capacity != RND_CAP_DEFAULT) {
        mft_rng_t rng = {c->seed ^ 0xc0ffeeull};
        int32_t slack = c->capacity == RND_CAP_SLACK ? 1 + mft_rng_int(&rng, 8) : 0;
        /* 0 would mean "the default": a layer that receives nothing still gets one row */
        c->spec.expert_capacity = (int32_t)(most > 0 ? most : 1) + slack;
        c->spec.max_recv_rows = (int32_t)(rows > 0 ? rows : 1) + slack;
    }
    p->spec.expert_capacity = c->spec.expert_capacity;
    p->spec.max_recv_rows = c->spec.max_recv_rows;
    return 0;
}

/* Appends printf-style text to buf[len], which stays NUL-terminated (text past its end is lost). */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static void rnd_append(char *buf, size_t len, const char *fmt, ...) {
    size_t used = strlen(buf);
    if (used + 1 >= len) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + used, len - used, fmt, ap);
    va_end(ap);
}

/* One line naming everything about the case. */
static void rnd_describe(const rnd_case_t *c, char *buf, size_t len) {
    static const char *const routings[] = {"uniform", "zipf", "hot"};
    static const char *const caps[] = {"default", "exact", "slack"};
    const mfp_spec_t *s = &c->spec;
    buf[0] = '\0';
    rnd_append(buf, len, "seed %llu: %s %s R=%d E=%d (%s, L=%d..%d) K=%d H=%d I=%d S=%d T=[",
               (unsigned long long)c->seed, rnd_dtype_name(s->dtype),
               s->layout == MF_LAYOUT_MASKED ? "masked" : "expert_major", (int)s->R, (int)s->E,
               s->placement == MF_PLACEMENT_ROUND_ROBIN ? "round_robin" : "linear", (int)(s->E / s->R),
               (int)((s->E + s->R - 1) / s->R), (int)s->K, (int)s->H, (int)s->I, (int)s->S);
    for (int32_t r = 0; r < s->R; r++) rnd_append(buf, len, "%s%d", r ? "," : "", (int)c->T[r]);
    rnd_append(buf, len, "] routing=%s", routings[s->routing]);
    if (s->routing == MFP_ROUTING_ZIPF) rnd_append(buf, len, ":%.2f", s->zipf_s);
    if (s->routing == MFP_ROUTING_HOT) rnd_append(buf, len, ":%d", (int)s->hot_expert);
    rnd_append(buf, len,
               " drop=%.3f ue8m0=%d block_m=%d capacity=%s (expert_capacity=%d max_recv_rows=%d)"
               " dataflow=%d problem_seed=%llu",
               s->drop_prob, (int)s->ue8m0, (int)s->block_m, caps[c->capacity],
               (int)s->expert_capacity, (int)s->max_recv_rows, (int)c->dataflow,
               (unsigned long long)s->seed);
}

/* The base seed and the number of cases of this run (environment, else the defaults). */
static void rnd_run_params(uint64_t *base, int32_t *cases, int32_t default_cases) {
    const char *e = getenv("MFT_RANDOM_SEED");
    *base = e && *e ? strtoull(e, NULL, 0) : RND_BASE_SEED;
    e = getenv("MFT_RANDOM_CASES");
    long n = e && *e ? strtol(e, NULL, 0) : default_cases;
    *cases = n < 1 ? 1 : n > 1000000 ? 1000000 : (int32_t)n;
}

/* Pass marks: diff below diff_max and |got - want| <= atol + rtol |want| everywhere. */
typedef struct rnd_bounds {
    double diff_max, atol, rtol;
} rnd_bounds_t;

/* The worst seen, per dtype, over the judged outputs: how the bounds were measured. */
typedef struct rnd_stats {
    int64_t cases, values;
    double max_err;    /* max |got - want| */
    double max_excess; /* max |got - want| - rtol |want|: the smallest atol that would pass */
    double max_diff;   /* per rank */
    double sq_err, sq_sum; /* sum (got - want)^2 and sum got^2 + want^2 over the finite values */
} rnd_stats_t;

/* The diff measure pooled over every value judged: sum (got - want)^2 / sum (got^2 + want^2),
 * which is 1 - 2 sum(got want) / sum(got^2 + want^2). */
static double rnd_pooled_diff(const rnd_stats_t *st) {
    return st->sq_sum > 0.0 ? st->sq_err / st->sq_sum : 0.0;
}

/* Judges every rank's y ([T_r, H]) against want; `vs` names the reference in messages. Also: a
 * token whose every id is -1 has an exactly zero row. Prints the first mismatches. */
static int rnd_judge(const char *vs, const mfp_problem_t *p, uint16_t *const *got,
                     uint16_t *const *want, rnd_bounds_t b, rnd_stats_t *st) {
    const mfp_spec_t *s = &p->spec;
    const int64_t H = s->H;
    int failed = 0;
    double case_excess = 0.0, case_diff = 0.0; /* this case's worst, for -v */
    st->cases++;
    for (int32_t r = 0; r < s->R; r++) {
        const int64_t n = (int64_t)p->T[r] * H;
        int64_t first = -1, printed = 0;
        double max_err = 0.0;
        int64_t wrong = mfref_count_wrong_bf16(got[r], want[r], n, b.atol, b.rtol, &first, &max_err);
        double diff = mfref_diff_bf16(got[r], want[r], n);
        st->values += n;
        st->max_err = max_err > st->max_err || max_err != max_err ? max_err : st->max_err;
        case_diff = diff > case_diff ? diff : case_diff;
        for (int64_t i = 0; i < n; i++) {
            double g = mf_bf16_to_float(got[r][i]), w = mf_bf16_to_float(want[r][i]);
            double excess = fabs(g - w) - b.rtol * fabs(w);
            if (isfinite(g) && isfinite(w)) {
                st->sq_err += (g - w) * (g - w);
                st->sq_sum += g * g + w * w;
            }
            if (excess > case_excess || excess != excess) case_excess = excess;
            if (!(fabs(g - w) <= b.atol + b.rtol * fabs(w)) && printed++ < 4)
                mft_note("rank %d: y[t=%lld, h=%lld] = %.6g (0x%04x), %s %.6g (0x%04x), bound %.3g",
                         (int)r, (long long)(i / H), (long long)(i % H), g, got[r][i], vs, w,
                         want[r][i], b.atol + b.rtol * fabs(w));
        }
        if (wrong) {
            failed = mft_fail(__FILE__, __LINE__,
                              "rank %d: %lld of %lld values outside %g + %g |%s| (max |err| %.3g, "
                              "first at t=%lld h=%lld), diff %.3g",
                              (int)r, (long long)wrong, (long long)n, b.atol, b.rtol, vs, max_err,
                              (long long)(first / H), (long long)(first % H), diff);
        } else if (!(diff < b.diff_max)) {
            failed = mft_fail(__FILE__, __LINE__, "rank %d: diff vs %s %.3g >= %.3g", (int)r, vs,
                              diff, b.diff_max);
        }
        for (int32_t t = 0; t < p->T[r]; t++) {
            int all_dropped = 1;
            for (int32_t k = 0; k < s->K; k++) all_dropped &= p->topk_ids[r][(int64_t)t * s->K + k] == -1;
            for (int64_t h = 0; all_dropped && h < H; h++)
                if (got[r][t * H + h] & 0x7fff) {
                    failed = mft_fail(__FILE__, __LINE__,
                                      "rank %d token %d has every id -1, but y[%lld] = 0x%04x", (int)r,
                                      (int)t, (long long)h, got[r][t * H + h]);
                    break;
                }
        }
    }
    mft_verbose("    vs %s: max |err| - rtol |%s| %.3g, max diff %.3g\n", vs, vs, case_excess, case_diff);
    if (case_excess > st->max_excess || case_excess != case_excess) st->max_excess = case_excess;
    st->max_diff = case_diff > st->max_diff ? case_diff : st->max_diff;
    return failed;
}

static void rnd_print_stats(const char *what, const rnd_stats_t st[2], const rnd_bounds_t b[2]) {
    for (int d = 0; d < 2; d++)
        mft_verbose("# %s %s: %lld cases, %lld values: max |err| %.3g, max |err| - rtol |ref| %.3g "
                    "(atol %.3g, rtol %.3g), max diff %.3g (bound %.0e), pooled diff %.3g\n",
                    what, d ? "fp8" : "bf16", (long long)st[d].cases, (long long)st[d].values,
                    st[d].max_err, st[d].max_excess, b[d].atol, b[d].rtol, st[d].max_diff,
                    b[d].diff_max, rnd_pooled_diff(&st[d]));
}

/* y arrays of a problem: [R] -> [T_r, H] bf16, poisoned. */
static uint16_t **rnd_alloc_y(const mfp_problem_t *p) { return mft_alloc_ys(p->spec.R, p->T, p->spec.H); }

static void rnd_free_y(uint16_t **y, int32_t R) { mft_free_ys(y, R); }

/* MASKED cases: the layer split as vLLM's modular kernel runs it (mf_dispatch, mf_moe_experts,
 * mf_combine) on `backend` gives `forward`'s y bit for bit (0), else a failure naming the first
 * differing value. Other layouts: 0 (the split runs on MASKED only). */
static int rnd_split_matches(const mfp_problem_t *p, mf_backend_t backend, int64_t timeout_ms,
                             uint16_t *const *forward) {
    if (p->spec.layout != MF_LAYOUT_MASKED) return 0;
    uint16_t **y = rnd_alloc_y(p);
    char err[512] = "";
    mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
    o.backend = backend, o.timeout_ms = timeout_ms, o.op = MFP_OP_SPLIT;
    mf_result_t res = mfp_run(p, &o, y, NULL, err, (int)sizeof err);
    /* the platform's virtual-rank stall (mft_queue_stall) is retried, as the GPU layer cases do */
    for (int retry = 0; retry < 2 && backend == MF_BACKEND_CUDA && p->spec.R > 1 && res == MF_ERR_TIMEOUT; retry++) {
        if (!mft_queue_stall(err)) break;
        mft_note("  RETRY split run: virtual-rank queue stall (%s)\n", err);
        res = mfp_run(p, &o, y, NULL, err, (int)sizeof err);
    }
    int rc = res != MF_SUCCESS ? mft_fail(__FILE__, __LINE__, "split run -> %s: %s", mft_result_name(res), err) : 0;
    for (int32_t r = 0; r < p->spec.R && !rc; r++)
        for (int64_t i = 0; i < (int64_t)p->T[r] * p->spec.H && !rc; i++)
            if (y[r][i] != forward[r][i])
                rc = mft_fail(__FILE__, __LINE__, "dispatch + mf_moe_experts + combine != forward: rank %d token %lld "
                              "h %lld: 0x%04x vs 0x%04x", (int)r, (long long)(i / p->spec.H),
                              (long long)(i % p->spec.H), y[r][i], forward[r][i]);
    rnd_free_y(y, p->spec.R);
    return rc;
}

#ifndef MFT_RANDOM_CASE_SPACE_ONLY
/* ---- the CPU backend against the fp64 reference --------------------------------------------- */

/* One case; st[dtype == FP8] collects its errors. */
static int cpu_case(uint64_t seed, const rnd_bounds_t bounds[2], rnd_stats_t st[2]) {
    rnd_case_t c;
    mfp_problem_t p;
    char desc[512];
    rnd_draw(seed, &c);
    if (rnd_generate(&c, &p) != 0) {
        rnd_describe(&c, desc, sizeof desc);
        MFT_FAIL("mfp_generate failed: %s", desc);
    }
    rnd_describe(&c, desc, sizeof desc);
    mft_verbose("  %s\n", desc);
    const int fp8 = c.spec.dtype == MF_DTYPE_FP8_E4M3;
    uint16_t **y = rnd_alloc_y(&p), **y_ref = rnd_alloc_y(&p);
    char err[512] = "";
    int rc = 0;
    if (mfref_layer(&p.ref, y_ref) != 0) {
        rc = mft_fail(__FILE__, __LINE__, "mfref_layer failed");
    } else {
        mf_result_t res = mfp_run_forward(&p, MF_BACKEND_CPU, 1, RND_TIMEOUT_MS, y, NULL, err,
                                          (int)sizeof err);
        if (res != MF_SUCCESS)
            rc = mft_fail(__FILE__, __LINE__, "mfp_run_forward -> %s: %s", mft_result_name(res), err);
        else
            rc = rnd_judge("ref", &p, y, y_ref, bounds[fp8], &st[fp8]);
        if (!rc) rc = rnd_split_matches(&p, MF_BACKEND_CPU, RND_TIMEOUT_MS, y);
    }
    if (rc) {
        mft_note("case %s", desc);
        mft_note("replay: MFT_RANDOM_SEED=%llu MFT_RANDOM_CASES=1 ./build/moeflow_tests random",
                 (unsigned long long)seed);
    }
    rnd_free_y(y, c.spec.R);
    rnd_free_y(y_ref, c.spec.R);
    mfp_free(&p);
    return rc;
}

static int test_random_cpu(void) {
    uint64_t base;
    int32_t cases;
    rnd_run_params(&base, &cases, RND_CASES);
    /* The oracle's bounds (ref.h MFREF_ORACLE_*), per rank; docs/DESIGN.md's diff per rank. */
    const rnd_bounds_t bounds[2] = {
        {MFREF_DIFF_MAX_BF16, MFREF_ORACLE_ATOL_BF16, MFREF_ORACLE_RTOL},
        {MFREF_DIFF_MAX_FP8, MFREF_ORACLE_ATOL_FP8, MFREF_ORACLE_RTOL},
    };
    rnd_stats_t st[2];
    memset(st, 0, sizeof st);
    int32_t failed = 0;
    for (int32_t i = 0; i < cases; i++) failed += cpu_case(base + (uint64_t)i, bounds, st) != 0;
    rnd_print_stats("cpu vs ref", st, bounds);
    int rc = 0;
    if (failed)
        rc = mft_fail(__FILE__, __LINE__, "%d of %d random cases failed (base seed %llu)",
                      (int)failed, (int)cases, (unsigned long long)base);
    /* The sensitive check: the diff pooled over the run (a removed bf16 rounding of h or of the
     * partials moves it 20x past the bound while almost every value stays inside its bound). */
    for (int d = 0; d < 2; d++) {
        double pooled = rnd_pooled_diff(&st[d]);
        if (st[d].values < MFREF_ORACLE_POOLED_MIN_VALUES) {
            mft_verbose("# %s: pooled diff not judged (%lld values < %d)\n", d ? "fp8" : "bf16",
                        (long long)st[d].values, MFREF_ORACLE_POOLED_MIN_VALUES);
            continue;
        }
        if (!(pooled < MFREF_ORACLE_POOLED_DIFF_MAX))
            rc = mft_fail(__FILE__, __LINE__,
                          "%s: the diff pooled over %lld values of %lld cases is %.3g >= %.0e (base "
                          "seed %llu): a rounding point differs between the CPU backend and the "
                          "reference", d ? "fp8" : "bf16", (long long)st[d].values,
                          (long long)st[d].cases, pooled, MFREF_ORACLE_POOLED_DIFF_MAX,
                          (unsigned long long)base);
    }
    return rc;
}

const mft_test_t mft_tests_random[] = {
    {"random_layer_cpu", test_random_cpu, 120},
    {NULL, NULL, 0},
};
#endif /* MFT_RANDOM_CASE_SPACE_ONLY */
