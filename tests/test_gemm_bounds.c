/*
 * test_gemm_bounds.c — the element bounds of `moeflow bench gemm --check` (cuda/gemm_bench.h,
 * docs/DESIGN.md "GEMM error bounds") on the CPU, no GPU: against an emulation of the tensor-core
 * accumulation they model, and against wrong results they must catch.
 *
 * The emulator (tc_step) is written here from the model's description, not from the bound: one
 * k-step adds a chunk of exact products and the running sum, each cut (toward zero) to `bits`
 * fraction bits below the largest of them, and cuts the sum to `bits` fraction bits of its own.
 * FP8 E4M3 wgmma: 32 products a step, 13 bits observed on Hopper; BF16: 16 a step, fp32's 23 bits.
 * The bounds take one bit of margin (u = 2^-12, 2^-22), so an emulation at 12 / 22 bits must
 * still pass (ratio <= 1) and one at the observed precision passes with room.
 *
 * Operands are drawn as the benchmark draws them (mf__gemm_bench_fill): E4M3 codes of magnitude
 * 2^-3 .. 15, FP8 scales uniform in [mag / 2, mag); BF16 uniform in [-mag, mag).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/numerics.h"
#include "cuda/gemm_bench.h"
#include "harness.h"

#define KMAX 7168
#define QB 128

static uint64_t g_rng = 0x2545F4914F6CDD1Dull;
static double unit(void) { /* [0, 1) */
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (double)(g_rng >> 11) * (1.0 / 9007199254740992.0);
}

static float fp8_value(void) { /* an E4M3 code value, exponents -3 .. 3, random sign and mantissa */
    const int e = (int)(unit() * 7) - 3, m = (int)(unit() * 8);
    const float v = (float)ldexp(1.0 + m / 8.0, e);
    return unit() < 0.5 ? -v : v;
}

static float bf16_value(double mag) { return mf__bf16_to_float(mf__bf16_from_float((float)((2 * unit() - 1) * mag))); }

static double trunc_to(double x, double q) { return trunc(x / q) * q; }

/* One tensor-core k-step of the model (see the top of the file). */
static double tc_step(double c, const double *p, int n, int bits) {
    double m = fabs(c);
    for (int j = 0; j < n; j++) m = fabs(p[j]) > m ? fabs(p[j]) : m;
    if (m == 0) return 0;
    int e;
    frexp(m, &e); /* 2^(e-1) <= m < 2^e */
    const double q = ldexp(1.0, e - 1 - bits);
    double s = trunc_to(c, q);
    for (int j = 0; j < n; j++) s += trunc_to(p[j], q);
    if (s == 0) return 0;
    frexp(s, &e);
    return trunc_to(s, ldexp(1.0, e - 1 - bits));
}

/* The emulated kernel result of one element: FP8 (as != NULL) K blocks of 4 k32 steps promoted in
 * fp32 (acc = fma(P, fl(as ws), acc)); BF16 the whole K in k16 steps. */
static float emulate(const float *a, const float *w, int K, const float *as, const float *ws, int bits) {
    const int fp8 = as != NULL, chunk = fp8 ? MF__GEMM_CHUNK_FP8 : MF__GEMM_CHUNK_BF16, seg = fp8 ? QB : K;
    float acc = 0;
    double p[MF__GEMM_CHUNK_FP8];
    for (int k0 = 0, kb = 0; k0 < K; k0 += seg, kb++) {
        double c = 0;
        for (int j0 = k0; j0 < k0 + seg; j0 += chunk) {
            for (int j = 0; j < chunk; j++) p[j] = (double)a[j0 + j] * (double)w[j0 + j];
            c = tc_step(c, p, chunk, bits);
        }
        if (fp8) acc = fmaf((float)c, as[kb] * ws[kb], acc);
        else acc = (float)c; /* bits <= 23: exact in fp32 */
    }
    return acc;
}

typedef struct elem {
    float a[KMAX], w[KMAX], as[KMAX / QB], ws[KMAX / QB];
} elem_t;

static void draw(elem_t *x, int K, int fp8) {
    const double wmag = sqrt(3.0 / K);
    for (int k = 0; k < K; k++) {
        x->a[k] = fp8 ? fp8_value() : bf16_value(1.0);
        x->w[k] = fp8 ? fp8_value() : bf16_value(wmag);
    }
    for (int kb = 0; kb < K / QB; kb++) {
        x->as[kb] = (float)(0.25 * (0.5 + 0.5 * unit()));
        x->ws[kb] = (float)(0.25 * wmag * (0.5 + 0.5 * unit()));
    }
}

/* max over n random elements of |emulated - exact| / bound (at `bits`), and of the BF16 output. */
static double model_ratio(int fp8, int K, int bits, int n, double *out_ratio) {
    static elem_t x;
    double worst = 0, worst_out = 0;
    for (int i = 0; i < n; i++) {
        draw(&x, K, fp8);
        double exact, bound;
        const float *as = fp8 ? x.as : NULL, *ws = fp8 ? x.ws : NULL;
        mf__gemm_ref_dot(x.a, x.w, K, as, ws, &exact, &bound, NULL);
        const float got = emulate(x.a, x.w, K, as, ws, bits);
        const double r = fabs(got - exact) / bound;
        worst = r > worst ? r : worst;
        const double out = mf__bf16_to_float(mf__bf16_from_float(got));
        const double ro = fabs(out - exact) / mf__gemm_bound_bf16_out(exact, bound);
        worst_out = ro > worst_out ? ro : worst_out;
    }
    if (out_ratio) *out_ratio = worst_out;
    return worst;
}

/* The bound against an emulated accumulator at the reported precision (`bits`: well inside it) and
 * one bit worse (still inside), at deepseek-v3's two K. */
static int check_model(int fp8, int bits, int trials) {
    static const int ks[] = {2048, 7168};
    const char *what = fp8 ? "fp8" : "bf16";
    for (int i = 0; i < 2; i++) {
        double out, out_worse;
        const double r = model_ratio(fp8, ks[i], bits, trials, &out);
        const double r_worse = model_ratio(fp8, ks[i], bits - 1, trials, &out_worse);
        mft_verbose("  %s K %d: max |err| / bound at %d bits %.3g (bf16 out %.3g), at %d bits %.3g (%.3g)\n", what,
                    ks[i], bits, r, out, bits - 1, r_worse, out_worse);
        MFT_CHECK_MSG(r < 0.5 && out <= 1, "%s K %d: %d-bit accumulation at %.3g of the bound (out %.3g)", what, ks[i],
                      bits, r, out);
        MFT_CHECK_MSG(r_worse <= 1 && out_worse <= 1, "%s K %d: %d-bit accumulation at %.3g of the bound (out %.3g)",
                      what, ks[i], bits - 1, r_worse, out_worse);
    }
    return 0;
}

static int test_fp8_model(void) { return check_model(1, 13, 200); }

static int test_bf16_model(void) { return check_model(0, 23, 100); }

/* An output that is zero by cancellation (the second half of K repeats the first with w negated):
 * a relative bound cannot hold there (the issue-27 failures), the condition-aware one does. */
static int test_cancellation(void) {
    static elem_t x;
    int rel_fails = 0;
    for (int fp8 = 0; fp8 < 2; fp8++)
        for (int i = 0; i < 50; i++) {
            const int K = 2048;
            draw(&x, K, fp8);
            for (int k = 0; k < K / 2; k++) x.a[K / 2 + k] = x.a[k], x.w[K / 2 + k] = -x.w[k];
            for (int kb = 0; kb < K / QB / 2; kb++) x.as[K / QB / 2 + kb] = x.as[kb], x.ws[K / QB / 2 + kb] = x.ws[kb];
            double exact, bound;
            const float *as = fp8 ? x.as : NULL, *ws = fp8 ? x.ws : NULL;
            mf__gemm_ref_dot(x.a, x.w, K, as, ws, &exact, &bound, NULL);
            MFT_CHECK(fabs(exact) < 1e-12); /* 0 but for the fp64 sum's own rounding (BF16) */
            const float got = emulate(x.a, x.w, K, as, ws, fp8 ? 13 : 23);
            MFT_CHECK_MSG(fabs(got) <= bound, "fp8 %d: %.3g outside %.3g", fp8, (double)got, bound);
            rel_fails += fabs(got - exact) > 0x1p-7 * fmax(fabs(got), fabs(exact)); /* the old rtol, atol 0 */
        }
    mft_verbose("  %d of 100 cancelled outputs fail a relative bound\n", rel_fails);
    MFT_CHECK(rel_fails > 0);
    return 0;
}

/* Wrong results the bound must catch: a K block's scale taken from its neighbour (as a kernel
 * reading the wrong scale column would), another row's values, and a relative error on every
 * element: 10 % in FP8 (whose accumulation bound is a few % of a typical |y|), 1 % in BF16 (whose
 * bound is mostly the output's half ulp, 0.4 %). */
static int test_catches_wrong(void) {
    static elem_t x;
    const int K = 2048, n = 256;
    double wrong_scale = 0, wrong_row = 0, one_pct = 0, prev_exact = 0;
    for (int i = 0; i < n; i++) {
        draw(&x, K, 1);
        double exact, bound;
        mf__gemm_ref_dot(x.a, x.w, K, x.as, x.ws, &exact, &bound, NULL);
        const float good = emulate(x.a, x.w, K, x.as, x.ws, 13);
        float as_bad[KMAX / QB];
        memcpy(as_bad, x.as, sizeof as_bad);
        as_bad[3] = x.as[4];
        const float bad = emulate(x.a, x.w, K, as_bad, x.ws, 13);
        const double r_scale = fabs(bad - exact) / bound, r_row = i ? fabs(good - prev_exact) / bound : 0;
        const double r_pct = fabs(1.1 * good - exact) / bound;
        wrong_scale = r_scale > wrong_scale ? r_scale : wrong_scale;
        wrong_row = r_row > wrong_row ? r_row : wrong_row;
        one_pct = r_pct > one_pct ? r_pct : one_pct;
        prev_exact = exact;
    }
    mft_verbose("  fp8: max |err| / bound over %d elements: wrong scale column %.3g, wrong row %.3g, 10%% off %.3g\n", n,
                wrong_scale, wrong_row, one_pct);
    MFT_CHECK_MSG(wrong_scale > 2, "a wrong K-block scale stays inside the bound (%.3g)", wrong_scale);
    MFT_CHECK_MSG(wrong_row > 10, "a wrong row stays inside the bound (%.3g)", wrong_row);
    MFT_CHECK_MSG(one_pct > 1, "a 10%% error stays inside the bound (%.3g)", one_pct);
    double bf_pct = 0;
    for (int i = 0; i < n; i++) {
        draw(&x, K, 0);
        double exact, bound;
        mf__gemm_ref_dot(x.a, x.w, K, NULL, NULL, &exact, &bound, NULL);
        const double out = mf__bf16_to_float(mf__bf16_from_float(1.01f * emulate(x.a, x.w, K, NULL, NULL, 23)));
        const double r = fabs(out - exact) / mf__gemm_bound_bf16_out(exact, bound);
        bf_pct = r > bf_pct ? r : bf_pct;
    }
    mft_verbose("  bf16: max |err| / bound, 1%% off: %.3g\n", bf_pct);
    MFT_CHECK_MSG(bf_pct > 1, "a 1%% BF16 error stays inside the bound (%.3g)", bf_pct);
    return 0;
}

/* SwiGLU and the FP8 requantisation of h: the kernel's arithmetic (mf__silu in fp32, the block's
 * fp32 amax, mf__fp8_block_scale, e4m3) on g, u anywhere within their bounds. */
static int test_swiglu_h(void) {
    for (int ue8m0 = 0; ue8m0 < 2; ue8m0++)
        for (int trial = 0; trial < 200; trial++) {
            double g[QB], u[QB], eg[QB], eu[QB], h[QB], eh[QB], amax = 0, eh_max = 0;
            float hf[QB], amax_f = 0;
            const double mag = trial % 3 == 0 ? 1e-3 : trial % 3 == 1 ? 1.0 : 30.0;
            for (int j = 0; j < QB; j++) {
                g[j] = (2 * unit() - 1) * 4 * mag, u[j] = (2 * unit() - 1) * mag;
                if (j % 17 == 0) u[j] = 0; /* h exactly zero: only the bound of u speaks */
                eg[j] = (fabs(g[j]) + mag) * 1e-3 * unit(), eu[j] = (fabs(u[j]) + mag) * 1e-3 * unit();
                mf__gemm_swiglu(g[j], eg[j], u[j], eu[j], &h[j], &eh[j]);
                /* the GPU's accumulators: at an end of their intervals, or inside */
                const int side = (int)(unit() * 3) - 1;
                const float gg = (float)(g[j] + side * eg[j]), uu = (float)(u[j] - side * eu[j]);
                hf[j] = mf__silu(gg) * uu;
                amax_f = fabsf(hf[j]) > amax_f ? fabsf(hf[j]) : amax_f;
                amax = fabs(h[j]) > amax ? fabs(h[j]) : amax;
                eh_max = eh[j] > eh_max ? eh[j] : eh_max;
                const double b16 = mf__bf16_to_float(mf__bf16_from_float(hf[j]));
                MFT_CHECK_MSG(fabs(b16 - h[j]) <= mf__gemm_bound_bf16_out(h[j], eh[j]), "bf16 h %.9g vs %.9g", b16, h[j]);
            }
            float scale, inv;
            mf__fp8_block_scale(amax_f, ue8m0, &scale, &inv);
            MFT_CHECK_MSG(mf__gemm_fp8_scale_ok(amax, eh_max, ue8m0, scale, MF__FP8_AMAX_MIN, MF__FP8_MAX),
                          "ue8m0 %d: scale %.9g for amax %.9g +- %.3g", ue8m0, (double)scale, amax, eh_max);
            MFT_CHECK(!mf__gemm_fp8_scale_ok(amax, eh_max, ue8m0, scale * 2.5, MF__FP8_AMAX_MIN, MF__FP8_MAX));
            for (int j = 0; j < QB; j++) {
                const double got = (double)mf__fp8_to_float(mf__fp8_from_float(hf[j] * inv)) * scale;
                MFT_CHECK_MSG(fabs(got - h[j]) <= mf__gemm_bound_fp8_h(h[j], eh[j], scale),
                              "ue8m0 %d: fp8 h %.9g vs %.9g (bound %.3g)", ue8m0, got, h[j],
                              mf__gemm_bound_fp8_h(h[j], eh[j], scale));
            }
        }
    return 0;
}

/* The GEMM choice's decode tile (docs/DESIGN.md step 5): the hint is the MEAN rows per expert; the
 * tile holds mean + 2 sqrt(mean) (an expert past its tile streams its weights twice), capped by the
 * bound; above 64 expected rows the TMA family with 128-row tiles and 64-row tail tiles (none under
 * MF_TMA_TAILS=0), and DIRECT only with decode. A
 * host function of a CUDA build (no GPU needed); a build without CUDA has no GEMM choice and does
 * not list this test. */
#if MF_WITH_CUDA
extern int32_t mf__cuda_tma_tails; /* cuda/grouped_gemm.h: 1 (the default) lets the choice take tail tiles */

static int test_choice(void) {
    static const int32_t hint_tile[][2] = {{1, 8}, {4, 8}, {5, 16}, {8, 16}, {9, 16}, {10, 32},
                                           {16, 32}, {22, 32}, {23, 64}, {32, 64}, {64, 64}};
    for (size_t i = 0; i < sizeof hint_tile / sizeof hint_tile[0]; i++) {
        int32_t family = -1, block = -1, flow = -1, fused = -1, tail = -1;
        mf__gemm_bench_choose(hint_tile[i][0], 4096, MF_DATAFLOW_AUTO, &family, &block, &flow, &fused, &tail);
        MFT_CHECK_MSG(family == 0 && block == hint_tile[i][1] && flow == MF_DATAFLOW_DIRECT,
                      "hint %d: family %d, %d tokens per tile, dataflow %d", hint_tile[i][0], family, block, flow);
        /* the small-batch kernel exactly with 8-token tiles (DIRECT) */
        MFT_CHECK_MSG(fused == (block == 8), "hint %d: fused %d with %d tokens per tile", hint_tile[i][0], fused, block);
        MFT_CHECK_MSG(tail == 0, "hint %d: decode tiles with tail tiles (%d rows)", hint_tile[i][0], tail);
    }
    int32_t family = -1, block = -1, flow = -1, fused = -1, tail = -1;
    mf__gemm_bench_choose(16, 16, MF_DATAFLOW_AUTO, &family, &block, &flow, &fused, &tail); /* the bound caps the tile */
    MFT_CHECK(family == 0 && block == 16 && !fused);
    mf__gemm_bench_choose(12, 8, MF_DATAFLOW_DIRECT, &family, &block, &flow, &fused, &tail); /* capped to 8: fused */
    MFT_CHECK(family == 0 && block == 8 && flow == MF_DATAFLOW_DIRECT && fused == 1);
    mf__gemm_bench_choose(1, 4096, MF_DATAFLOW_PULL, &family, &block, &flow, &fused, &tail); /* PULL: the two GEMMs */
    MFT_CHECK(family == 0 && block == 8 && flow == MF_DATAFLOW_PULL && !fused);
    mf__gemm_bench_choose(1, 4096, MF_DATAFLOW_UNFUSED, &family, &block, &flow, &fused, &tail);
    MFT_CHECK(flow == MF_DATAFLOW_UNFUSED && !fused);
    mf__gemm_bench_choose(0, 40, MF_DATAFLOW_PULL, &family, &block, &flow, &fused, &tail); /* unknown hint: the bound */
    MFT_CHECK(family == 0 && block == 64 && flow == MF_DATAFLOW_PULL && !fused);
    mf__gemm_bench_choose(65, 4096, MF_DATAFLOW_AUTO, &family, &block, &flow, &fused, &tail);
    MFT_CHECK(family == 1 && block == 128 && flow == MF_DATAFLOW_PULL && !fused && tail == 64); /* tail tiles */
    const int32_t tails = __atomic_load_n(&mf__cuda_tma_tails, __ATOMIC_RELAXED);
    __atomic_store_n(&mf__cuda_tma_tails, 0, __ATOMIC_RELAXED); /* MF_TMA_TAILS=0: full tiles only */
    mf__gemm_bench_choose(4096, 4096, MF_DATAFLOW_AUTO, &family, &block, &flow, &fused, &tail);
    __atomic_store_n(&mf__cuda_tma_tails, tails, __ATOMIC_RELAXED);
    MFT_CHECK(family == 1 && block == 128 && tail == 0);
    mf__gemm_bench_choose(65, 4096, MF_DATAFLOW_UNFUSED, &family, &block, &flow, &fused, &tail);
    MFT_CHECK(family == 1 && flow == MF_DATAFLOW_UNFUSED && !fused);
    return 0;
}
#endif

const mft_test_t mft_tests_gemm_bounds[] = {
#if MF_WITH_CUDA
    {"gemm_choice_decode_tiles", test_choice, 10},
#endif
    {"gemm_bounds_fp8_model", test_fp8_model, 60},
    {"gemm_bounds_bf16_model", test_bf16_model, 60},
    {"gemm_bounds_cancellation", test_cancellation, 30},
    {"gemm_bounds_catch_wrong", test_catches_wrong, 30},
    {"gemm_bounds_swiglu_h", test_swiglu_h, 30},
    {NULL, NULL, 0},
};
