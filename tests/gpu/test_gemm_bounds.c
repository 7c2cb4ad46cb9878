/*
 * test_gemm_bounds.c — the library's grouped expert GEMMs against the element bounds of
 * docs/DESIGN.md "GEMM error bounds" (cuda/gemm_bench.h, the ones `moeflow bench gemm --check`
 * applies), on small problems that put each kernel family to work, and negative controls that
 * the same check must fail.
 *
 *   families  decode (rows_hint <= kMfDecodeMaxRows), TMA (above it: M = 200, whose last m-block
 *             of 72 rows is a full tile, and M = 180, whose 52 run as a 64-row tail tile, with L = 72
 *             too: more tiles than CTAs, and uneven counts (180, 130, 80, 40: tails of 52 and 2, a
 *             full tile of 80, a whole expert as a tail); rows past an expert's count must keep
 *             their poison; every TMA case runs again with the tail tiles off and on
 *             the static walk, which must write the same bits; each case checks that its family
 *             ran, not the fallback),
 *             v1 (the mma.sync fallback:
 *             W2 with H not a multiple of the TMA tile's 256 columns, BF16 W13 with 2I = 384,
 *             FP8 W13 with L past the TMA tables' 1024 experts); FP8 and BF16; W13 + SwiGLU
 *             and W2. Operands drawn by mf__gemm_bench_fill as the benchmark draws them.
 *   controls  the GPU's output judged against a wrong reference: a K block's weight scale taken
 *             from the next block (a kernel reading the wrong scale column), the next row's
 *             values (a wrong row), one element moved by twice its bound, and (FP8 W13) an h
 *             scale doubled. Each must be caught.
 *   drain     the decode and TMA kernels after an expired wait (cuda_gemm_drain_decode, _tma): they
 *             must end.
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../harness.h"
#include "cuda_test.h"
#include "testing.h" /* the GEMMs alone, their element bounds, the exact numerics */

#define QB MF__QUANT_BLOCK
#define SEG_ALIGN 128

enum { CTRL_NONE, CTRL_SCALE, CTRL_ROW, CTRL_ELEMENT, CTRL_HSCALE };
static const char *const k_ctrl[] = {"none", "wrong scale column", "wrong row", "one element off", "h scale doubled"};

extern int32_t mf__cuda_tma_tails; /* cuda/grouped_gemm.h: 1 lets the choice take the 64-row tail tiles */

typedef struct gcase {
    const char *family;
    int32_t op, dtype, H, I, L, M;
    int32_t vary; /* 1: expert e gets M, M - 50, M - 100 or 40 rows as e % 4 (full and tail tiles, a
                     whole expert in one tail); 0: M each */
} gcase_t;

typedef struct verdict {
    int64_t checked, wrong, scale_bad;
    double max_ratio;
} verdict_t;

typedef struct host {
    uint8_t *a, *w, *out;
    float *as, *ws, *os;
} host_t;

static float decode(const uint8_t *p, size_t i, int fp8) {
    if (fp8) return mf__fp8_to_float(p[i]);
    uint16_t v;
    memcpy(&v, p + 2 * i, 2);
    return mf__bf16_to_float(v);
}

static void judge_one(verdict_t *v, double got, double exact, double bound) {
    const double r = fabs(got - exact) / bound;
    v->checked++;
    if (!(fabs(got - exact) <= bound)) v->wrong++;
    if (r > v->max_ratio || r != r) v->max_ratio = r != r ? INFINITY : r;
}

/* Judges the `rows` rows of expert e (from receive row `off`) of the host copies; `ctrl` makes the
 * reference (or the output read) wrong on purpose. */
static int judge_expert(const gcase_t *c, const host_t *h, int32_t e, int64_t off, int32_t rows, int ctrl,
                        verdict_t *v) {
    const int fp8 = c->dtype == MF_DTYPE_FP8_E4M3, swiglu = c->op == MF__GEMM_OP_W13_SWIGLU;
    const int32_t N = swiglu ? 2 * c->I : c->H, K = swiglu ? c->H : c->I, kbs = K / QB;
    const int32_t ocols = swiglu ? c->I : c->H, oesz = swiglu && fp8 ? 1 : 2;
    float *ar = malloc(sizeof(float) * (size_t)K), *wr = malloc(sizeof(float) * (size_t)K);
    float *wsr = malloc(sizeof(float) * (size_t)(kbs + 1));
    double *acc = malloc(sizeof(double) * (size_t)N), *err = malloc(sizeof(double) * (size_t)N);
    if (!ar || !wr || !wsr || !acc || !err) return -1;
    for (int32_t i = 0; i < rows; i++) {
        const int64_t row = off + i, ref_row = ctrl == CTRL_ROW ? off + (i + 1) % rows : row;
        for (int32_t k = 0; k < K; k++) ar[k] = decode(h->a, (size_t)ref_row * K + k, fp8);
        for (int32_t n = 0; n < N; n++) {
            for (int32_t k = 0; k < K; k++) wr[k] = decode(h->w, ((size_t)e * N + n) * K + k, fp8);
            if (fp8) {
                memcpy(wsr, h->ws + ((size_t)e * (N / QB) + n / QB) * kbs, sizeof(float) * (size_t)kbs);
                if (ctrl == CTRL_SCALE) wsr[0] = wsr[kbs > 1 ? 1 : 0] * (kbs > 1 ? 1.0f : 1.5f);
            }
            mf__gemm_ref_dot(ar, wr, K, fp8 ? h->as + (size_t)ref_row * kbs : NULL, fp8 ? wsr : NULL, &acc[n], &err[n], NULL);
        }
        const uint8_t *orow = h->out + (size_t)row * ocols * oesz;
        if (!swiglu) {
            for (int32_t n = 0; n < N; n++) {
                double got = decode(orow, (size_t)n, 0);
                const double bound = mf__gemm_bound_bf16_out(acc[n], err[n]);
                if (ctrl == CTRL_ELEMENT && i == 0 && n == 0) got = acc[n] + 2 * bound;
                judge_one(v, got, acc[n], bound);
            }
            continue;
        }
        for (int32_t b0 = 0; b0 < c->I; b0 += QB) {
            const int32_t bn = c->I - b0 < QB ? c->I - b0 : QB; /* BF16 I need not be a multiple */
            double hx[QB], eh[QB], amax = 0, eh_max = 0;
            for (int32_t j = 0; j < bn; j++) {
                mf__gemm_swiglu(acc[b0 + j], err[b0 + j], acc[c->I + b0 + j], err[c->I + b0 + j], &hx[j], &eh[j]);
                amax = fabs(hx[j]) > amax ? fabs(hx[j]) : amax;
                eh_max = eh[j] > eh_max ? eh[j] : eh_max;
            }
            double gs = 1;
            if (fp8) {
                gs = h->os[(size_t)row * (c->I / QB) + b0 / QB] * (ctrl == CTRL_HSCALE ? 2.0 : 1.0);
                v->scale_bad += !mf__gemm_fp8_scale_ok(amax, eh_max, 0, gs, MF__FP8_AMAX_MIN, MF__FP8_MAX);
            }
            for (int32_t j = 0; j < bn; j++) {
                double got = fp8 ? decode(orow, (size_t)(b0 + j), 1) * gs : decode(orow, (size_t)(b0 + j), 0);
                const double bound = fp8 ? mf__gemm_bound_fp8_h(hx[j], eh[j], gs) : mf__gemm_bound_bf16_out(hx[j], eh[j]);
                if (ctrl == CTRL_ELEMENT && i == 0 && b0 + j == 0) got = hx[j] + 2 * bound;
                judge_one(v, got, hx[j], bound);
            }
        }
    }
    free(ar), free(wr), free(wsr), free(acc), free(err);
    return 0;
}

/* One case on the device: its buffers, the counts and offsets (host copies too), the operands
 * drawn by mf__gemm_bench_fill as the benchmark draws them, the outputs poisoned (0xFF), and the
 * launch's arguments. */
typedef struct dcase {
    int32_t *counts, *offsets; /* host: [L], [L + 1] */
    int64_t slot;              /* rows per expert slot */
    size_t ab, asb, wb, wsb, ob, osb;
    void *a, *as, *w, *ws, *out, *os, *dcounts, *doffsets, *sched;
    mf__gemm_bench_args_t args;
} dcase_t;

static int case_setup(const gcase_t *c, dcase_t *d) {
    const int fp8 = c->dtype == MF_DTYPE_FP8_E4M3, swiglu = c->op == MF__GEMM_OP_W13_SWIGLU;
    const int32_t N = swiglu ? 2 * c->I : c->H, K = swiglu ? c->H : c->I, kbs = K / QB, L = c->L;
    const int32_t ocols = swiglu ? c->I : c->H, oesz = swiglu && fp8 ? 1 : 2, esz = fp8 ? 1 : 2;
    memset(d, 0, sizeof *d);
    d->slot = (c->M + SEG_ALIGN - 1) / SEG_ALIGN * SEG_ALIGN;
    const int64_t rows = d->slot * L;
    d->counts = malloc(sizeof(int32_t) * (size_t)L), d->offsets = malloc(sizeof(int32_t) * (size_t)(L + 1));
    MFT_CHECK(d->counts && d->offsets);
    static const int32_t k_less[4] = {0, 50, 100, -1}; /* vary: M - less, or 40 rows (-1) */
    for (int32_t e = 0; e <= L; e++) {
        if (e < L) d->counts[e] = !c->vary ? c->M : k_less[e % 4] < 0 ? 40 : c->M - k_less[e % 4];
        d->offsets[e] = (int32_t)(e * d->slot);
    }
    d->ab = (size_t)rows * K * esz, d->asb = fp8 ? (size_t)rows * kbs * 4 : 16, d->wb = (size_t)L * N * K * esz;
    d->wsb = fp8 ? (size_t)L * (N / QB) * kbs * 4 : 16, d->ob = (size_t)rows * ocols * oesz;
    d->osb = swiglu && fp8 ? (size_t)rows * (c->I / QB) * 4 : 16;
    CUDA_OK(cudaMalloc(&d->a, d->ab));
    CUDA_OK(cudaMalloc(&d->as, d->asb));
    CUDA_OK(cudaMalloc(&d->w, d->wb));
    CUDA_OK(cudaMalloc(&d->ws, d->wsb));
    CUDA_OK(cudaMalloc(&d->out, d->ob));
    CUDA_OK(cudaMalloc(&d->os, d->osb));
    CUDA_OK(cudaMalloc(&d->dcounts, sizeof(int32_t) * (size_t)L));
    CUDA_OK(cudaMalloc(&d->doffsets, sizeof(int32_t) * (size_t)(L + 1)));
    CUDA_OK(cudaMalloc(&d->sched, 2 * sizeof(int32_t)));
    CUDA_OK(cudaMemcpy(d->dcounts, d->counts, sizeof(int32_t) * (size_t)L, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d->doffsets, d->offsets, sizeof(int32_t) * (size_t)(L + 1), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(d->sched, 0, 2 * sizeof(int32_t)));
    CUDA_OK(cudaMemset(d->out, 0xFF, d->ob));
    CUDA_OK(cudaMemset(d->os, 0xFF, d->osb));
    const float wmag = sqrtf(3.0f / (float)K);
    if (fp8) {
        MFT_CHECK_OK(mf__gemm_bench_fill(d->a, (int64_t)rows * K, MF__BENCH_FILL_FP8, 11, 0, NULL));
        MFT_CHECK_OK(mf__gemm_bench_fill(d->as, (int64_t)rows * kbs, MF__BENCH_FILL_SCALE, 12, 0.25f, NULL));
        MFT_CHECK_OK(mf__gemm_bench_fill(d->w, (int64_t)L * N * K, MF__BENCH_FILL_FP8, 13, 0, NULL));
        MFT_CHECK_OK(mf__gemm_bench_fill(d->ws, (int64_t)L * (N / QB) * kbs, MF__BENCH_FILL_SCALE, 14, 0.25f * wmag, NULL));
    } else {
        MFT_CHECK_OK(mf__gemm_bench_fill(d->a, (int64_t)rows * K, MF__BENCH_FILL_BF16, 11, 1.0f, NULL));
        MFT_CHECK_OK(mf__gemm_bench_fill(d->w, (int64_t)L * N * K, MF__BENCH_FILL_BF16, 13, wmag, NULL));
    }
    mf__gemm_bench_args_t *args = &d->args;
    args->op = c->op, args->dtype = c->dtype, args->H = c->H, args->I = c->I;
    args->num_experts = L, args->max_rows_per_expert = c->M, args->rows_hint = c->M;
    args->counts = d->dcounts, args->offsets = d->doffsets, args->sched = d->sched;
    args->a = d->a, args->a_scales = fp8 ? d->as : NULL, args->w = d->w, args->w_scales = fp8 ? d->ws : NULL;
    args->out = d->out, args->out_scales = swiglu && fp8 ? d->os : NULL;
    return 0;
}

static void case_free(dcase_t *d) {
    free(d->counts), free(d->offsets);
    void *bufs[] = {d->a, d->as, d->w, d->ws, d->out, d->os, d->dcounts, d->doffsets, d->sched};
    for (int b = 0; b < 9; b++) cudaFree(bufs[b]);
}

/* Runs one case on the device, copies it back and judges it under every control. */
static int run_case(const gcase_t *c) {
    const int fp8 = c->dtype == MF_DTYPE_FP8_E4M3, swiglu = c->op == MF__GEMM_OP_W13_SWIGLU;
    const int32_t L = c->L, ocols = swiglu ? c->I : c->H, oesz = swiglu && fp8 ? 1 : 2;
    dcase_t d;
    if (case_setup(c, &d)) return 1;
    const int32_t *counts = d.counts, *offsets = d.offsets;
    const int64_t slot = d.slot;
    const size_t ab = d.ab, asb = d.asb, wb = d.wb, wsb = d.wsb, ob = d.ob, osb = d.osb;
    void *const da = d.a, *const das = d.as, *const dw = d.w, *const dws = d.ws, *const dout = d.out, *const dos = d.os;
    void *const dsched = d.sched;
    mf__gemm_bench_args_t args = d.args;
    const int32_t bench_family = strcmp(c->family, "decode") == 0 ? MF__GEMM_BENCH_DECODE
                                 : strcmp(c->family, "tma") == 0  ? MF__GEMM_BENCH_TMA
                                                                  : -1;
    const uint64_t ran0 = mf__gemm_bench_launches(bench_family);
    MFT_CHECK_OK(mf__gemm_bench_run(&args, NULL));
    CUDA_OK(cudaDeviceSynchronize());
    if (bench_family == MF__GEMM_BENCH_TMA) {
        /* the same bits with the tail tiles off and on the static walk (kernels/sm90_tma_gemm.cuh:
         * neither the tile's kind nor the CTA that computes it changes an element) */
        void *dout2, *dos2;
        CUDA_OK(cudaMalloc(&dout2, ob));
        CUDA_OK(cudaMalloc(&dos2, osb));
        uint8_t *o1 = malloc(ob), *o2 = malloc(ob), *s1 = malloc(osb), *s2 = malloc(osb);
        MFT_CHECK(o1 && o2 && s1 && s2);
        CUDA_OK(cudaMemcpy(o1, dout, ob, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(s1, dos, osb, cudaMemcpyDeviceToHost));
        static const struct { int32_t tails, dynamic; const char *what; } runs[] = {
            {0, 0, "tail tiles off, static walk"}, {1, 0, "tail tiles on, static walk"}};
        const int32_t tails = __atomic_load_n(&mf__cuda_tma_tails, __ATOMIC_RELAXED);
        for (int r = 0; r < 2; r++) {
            CUDA_OK(cudaMemset(dout2, 0xFF, ob));
            CUDA_OK(cudaMemset(dos2, 0xFF, osb));
            __atomic_store_n(&mf__cuda_tma_tails, runs[r].tails, __ATOMIC_RELAXED);
            args.out = dout2, args.out_scales = swiglu && fp8 ? dos2 : NULL;
            args.sched = runs[r].dynamic ? dsched : NULL;
            const mf_result_t res = mf__gemm_bench_run(&args, NULL);
            __atomic_store_n(&mf__cuda_tma_tails, tails, __ATOMIC_RELAXED);
            MFT_CHECK_OK(res);
            CUDA_OK(cudaDeviceSynchronize());
            CUDA_OK(cudaMemcpy(o2, dout2, ob, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(s2, dos2, osb, cudaMemcpyDeviceToHost));
            MFT_CHECK_MSG(memcmp(o1, o2, ob) == 0 && memcmp(s1, s2, osb) == 0,
                          "tma %s %s L %d M %d: %s wrote other bits than tail tiles on, dynamic walk",
                          swiglu ? "w13" : "w2", fp8 ? "fp8" : "bf16", L, c->M, runs[r].what);
        }
        free(o1), free(o2), free(s1), free(s2);
        cudaFree(dout2), cudaFree(dos2);
        args.out = dout, args.out_scales = swiglu && fp8 ? dos : NULL, args.sched = dsched;
    }
    /* the family under test ran (a decline would have fallen back to v1 silently) */
    if (bench_family >= 0)
        MFT_CHECK_MSG(mf__gemm_bench_launches(bench_family) == ran0 + (bench_family == MF__GEMM_BENCH_TMA ? 3 : 1),
                      "%s %s %s: the family did not run every launch (%llu of them)", c->family,
                      swiglu ? "w13" : "w2", fp8 ? "fp8" : "bf16",
                      (unsigned long long)(mf__gemm_bench_launches(bench_family) - ran0));

    host_t h;
    h.a = malloc(ab), h.as = malloc(asb), h.w = malloc(wb), h.ws = malloc(wsb), h.out = malloc(ob), h.os = malloc(osb);
    MFT_CHECK(h.a && h.as && h.w && h.ws && h.out && h.os);
    CUDA_OK(cudaMemcpy(h.a, da, ab, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(h.as, das, asb, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(h.w, dw, wb, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(h.ws, dws, wsb, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(h.out, dout, ob, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(h.os, dos, osb, cudaMemcpyDeviceToHost));

    /* the experts judged: the first four (every count of `vary`), the middle one and the last */
    int32_t ex[6], nex = 0;
    const int32_t pick[6] = {0, 1, 2, 3, L / 2, L - 1};
    for (int x = 0; x < 6; x++) {
        int seen = pick[x] >= L;
        for (int y = 0; y < nex; y++) seen |= ex[y] == pick[x];
        if (!seen) ex[nex++] = pick[x];
    }
    /* rows past an expert's count (its slot's padding, where the row shift puts the rows of its next
     * expert's last tile below lo) are never written: every byte still the 0xFF poison */
    for (int x = 0; x < nex; x++)
        for (int64_t row = offsets[ex[x]] + counts[ex[x]]; row < offsets[ex[x]] + slot; row++) {
            const uint8_t *o = h.out + (size_t)row * ocols * oesz;
            int bad = 0;
            for (size_t b = 0; b < (size_t)ocols * oesz; b++) bad |= o[b] != 0xFF;
            if (swiglu && fp8)
                for (int32_t j = 0; j < c->I / QB; j++) bad |= (uint32_t)((const int32_t *)h.os)[row * (c->I / QB) + j] != 0xFFFFFFFFu;
            MFT_CHECK_MSG(!bad, "%s %s %s L %d M %d: expert %d's row %lld past its %d rows was written", c->family,
                          swiglu ? "w13" : "w2", fp8 ? "fp8" : "bf16", L, c->M, ex[x], (long long)(row - offsets[ex[x]]),
                          counts[ex[x]]);
        }
    for (int ctrl = CTRL_NONE; ctrl <= CTRL_HSCALE; ctrl++) {
        if ((ctrl == CTRL_HSCALE && !(swiglu && fp8)) || (ctrl == CTRL_SCALE && !fp8)) continue; /* BF16: no scales */
        verdict_t v;
        memset(&v, 0, sizeof v);
        for (int x = 0; x < nex; x++) MFT_CHECK(judge_expert(c, &h, ex[x], offsets[ex[x]], counts[ex[x]], ctrl, &v) == 0);
        mft_verbose("  %-6s %s %s H %d I %d L %d M %d, %-18s: %lld elements, %lld outside, %lld h scales bad, max "
                    "|err| / bound %.3g\n",
                    c->family, swiglu ? "w13" : "w2", fp8 ? "fp8" : "bf16", c->H, c->I, L, c->M, k_ctrl[ctrl],
                    (long long)v.checked, (long long)v.wrong, (long long)v.scale_bad, v.max_ratio);
        const int caught = v.wrong > 0 || v.scale_bad > 0;
        if (ctrl == CTRL_NONE)
            MFT_CHECK_MSG(!caught && v.max_ratio < 1 && v.checked > 0, "%s %s %s: %lld outside, %lld scales, max ratio %.3g",
                          c->family, swiglu ? "w13" : "w2", fp8 ? "fp8" : "bf16", (long long)v.wrong,
                          (long long)v.scale_bad, v.max_ratio);
        else
            MFT_CHECK_MSG(caught, "%s %s %s: the control '%s' was not caught (max ratio %.3g)", c->family,
                          swiglu ? "w13" : "w2", fp8 ? "fp8" : "bf16", k_ctrl[ctrl], v.max_ratio);
    }
    free(h.a), free(h.as), free(h.w), free(h.ws), free(h.out), free(h.os);
    case_free(&d);
    return 0;
}

static int run_cases(const gcase_t *cs, int n) {
    for (int i = 0; i < n; i++)
        if (run_case(&cs[i])) return 1;
    return 0;
}

/* The decode family's cases: W13 + SwiGLU and W2, FP8 and BF16, L experts of 40 rows. */
enum { kDecodeCases = 4 };
static void decode_cases(gcase_t cs[kDecodeCases], int32_t L) {
    static const int32_t k_op_dtype[kDecodeCases][2] = {{MF__GEMM_OP_W13_SWIGLU, MF_DTYPE_FP8_E4M3},
                                                         {MF__GEMM_OP_W13_SWIGLU, MF_DTYPE_BF16},
                                                         {MF__GEMM_OP_W2, MF_DTYPE_FP8_E4M3},
                                                         {MF__GEMM_OP_W2, MF_DTYPE_BF16}};
    for (int i = 0; i < kDecodeCases; i++)
        cs[i] = (gcase_t){"decode", k_op_dtype[i][0], k_op_dtype[i][1], 512, 256, L, 40, 0};
}

static int gemm_bounds_decode(void) {
    gcase_t cs[kDecodeCases];
    decode_cases(cs, 4);
    return run_cases(cs, kDecodeCases);
}

/* The TMA family's cases; the last four (uneven counts over 288 tiles) serve the drain test too. */
static const gcase_t k_tma_cases[] = {
    {"tma", MF__GEMM_OP_W13_SWIGLU, MF_DTYPE_FP8_E4M3, 512, 256, 3, 200, 0},
    {"tma", MF__GEMM_OP_W13_SWIGLU, MF_DTYPE_BF16, 512, 256, 3, 200, 0},
    {"tma", MF__GEMM_OP_W2, MF_DTYPE_FP8_E4M3, 512, 256, 3, 200, 0},
    {"tma", MF__GEMM_OP_W2, MF_DTYPE_BF16, 512, 256, 3, 200, 0},
    {"tma", MF__GEMM_OP_W13_SWIGLU, MF_DTYPE_FP8_E4M3, 512, 256, 3, 180, 0},
    {"tma", MF__GEMM_OP_W13_SWIGLU, MF_DTYPE_BF16, 512, 256, 3, 180, 0},
    {"tma", MF__GEMM_OP_W2, MF_DTYPE_FP8_E4M3, 512, 256, 3, 180, 0},
    {"tma", MF__GEMM_OP_W2, MF_DTYPE_BF16, 512, 256, 3, 180, 0},
    /* 288 tiles, more than a grid: CTAs walk full and tail tiles in turn (the overlap's next
     * kind, the amax buffers' turns) */
    {"tma", MF__GEMM_OP_W13_SWIGLU, MF_DTYPE_FP8_E4M3, 512, 256, 72, 180, 0},
    {"tma", MF__GEMM_OP_W2, MF_DTYPE_BF16, 512, 256, 72, 180, 0},
    /* uneven: 180 (a tail of 52), 130 (a tail of 2), 80 (one full tile, lo = 48) and 40 rows
     * (one tail tile whose rows below lo are the previous slot's padding) */
    {"tma", MF__GEMM_OP_W13_SWIGLU, MF_DTYPE_FP8_E4M3, 512, 256, 72, 180, 1},
    {"tma", MF__GEMM_OP_W13_SWIGLU, MF_DTYPE_BF16, 512, 256, 72, 180, 1},
    {"tma", MF__GEMM_OP_W2, MF_DTYPE_FP8_E4M3, 512, 256, 72, 180, 1},
    {"tma", MF__GEMM_OP_W2, MF_DTYPE_BF16, 512, 256, 72, 180, 1},
};
enum { kTmaCases = sizeof k_tma_cases / sizeof k_tma_cases[0], kDrainCases = 4 };

static int gemm_bounds_tma(void) { return run_cases(k_tma_cases, kTmaCases); }

static int gemm_bounds_v1(void) {
    static const gcase_t cs[] = {
        {"v1", MF__GEMM_OP_W13_SWIGLU, MF_DTYPE_FP8_E4M3, 256, 128, 1030, 72, 0},
        {"v1", MF__GEMM_OP_W13_SWIGLU, MF_DTYPE_BF16, 256, 192, 3, 200, 0},
        {"v1", MF__GEMM_OP_W2, MF_DTYPE_FP8_E4M3, 384, 256, 3, 200, 0},
        {"v1", MF__GEMM_OP_W2, MF_DTYPE_BF16, 384, 256, 3, 200, 0},
    };
    return run_cases(cs, 4);
}

/* The drain ("Bounded waits" in kernels/sm90_decode_gemm.cuh and sm90_tma_gemm.cuh): with a family's
 * expired flag raised, as after a wait that expired, every wait that has to wait gives up at once
 * and the producer overwrites stages whose tile codes the consumers are still to read; the kernels
 * must end anyway (the consumers take every code from one leader, so none waits at a named barrier
 * for a partner that left). FP8 and BF16, W13 + SwiGLU and W2, more tiles than CTAs (TMA: the tail
 * tiles in turn with full ones), each launched 4 times: every launch must be the family's and end
 * within the test's time limit with no CUDA error. The outputs are garbage and not read. The flag
 * is never cleared: each family's test needs a process of its own (the runner forks each test; not
 * with --no-fork). */
static int drain(int32_t family, const gcase_t *cs, int n) {
    MFT_CHECK(mf__gemm_bench_expire(family) == 0);
    for (int i = 0; i < n; i++) {
        const gcase_t *c = &cs[i];
        dcase_t d;
        if (case_setup(c, &d)) return 1;
        for (int rep = 0; rep < 4; rep++) {
            const uint64_t ran0 = mf__gemm_bench_launches(family);
            CUDA_OK(cudaMemset(d.sched, 0, 2 * sizeof(int32_t)));
            MFT_CHECK_OK(mf__gemm_bench_run(&d.args, NULL));
            CUDA_OK(cudaDeviceSynchronize());
            MFT_CHECK(mf__gemm_bench_launches(family) == ran0 + 1);
        }
        printf("  drained: %s %s %s L = %d M = %d: 4 launches ended\n", c->family,
               c->dtype == MF_DTYPE_FP8_E4M3 ? "fp8" : "bf16", c->op == MF__GEMM_OP_W13_SWIGLU ? "w13" : "w2", c->L,
               c->M);
        case_free(&d);
    }
    return 0;
}

/* 72 experts of 40 rows: 144 W13 tiles and 288 W2 tiles of the decode family's, more than a grid. */
static int gemm_drain_decode(void) {
    gcase_t cs[kDecodeCases];
    decode_cases(cs, 72);
    return drain(MF__GEMM_BENCH_DECODE, cs, kDecodeCases);
}

static int gemm_drain_tma(void) {
    return drain(MF__GEMM_BENCH_TMA, k_tma_cases + kTmaCases - kDrainCases, kDrainCases);
}

const mft_test_t mft_tests_cuda_gemm_bounds[] = {
    {"cuda_gemm_bounds_decode", gemm_bounds_decode, 120},
    {"cuda_gemm_bounds_tma", gemm_bounds_tma, 120},
    {"cuda_gemm_bounds_v1", gemm_bounds_v1, 180},
    {"cuda_gemm_drain_decode", gemm_drain_decode, 60},
    {"cuda_gemm_drain_tma", gemm_drain_tma, 60},
    {NULL, NULL, 0},
};
