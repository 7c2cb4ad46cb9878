/*
 * ref.c — the naive fp64 reference of the EP MoE layer (ref.h): the oracle that the tests and
 * `moeflow run` judge every backend against.
 *
 * It shares nothing with the library but the public scalar conversions (mf_fp8_e4m3_* and
 * mf_bf16_*): the 1x128 quantisation of docs/DESIGN.md "Numerics" is written again here, from the
 * contract. Each token is computed on its own, on one "rank", with no expert parallelism:
 *   x -> (FP8: quantised 1x128 along H, dequantised q * scale) -> xa            [H]    double
 *   for k ascending, id != -1, expert e = id (its rank and local index in the arrays, ref.h):
 *     g, u = W13[e] . xa                     (weights dequantised q * scale)   [2I]   double
 *     h = silu(g) * u                                                          [I]    double
 *     h -> FP8 1x128 along I, dequantised (FP8) or bf16 (BF16) -> ha            [I]
 *     partial = bf16(W2[e] . ha)                                               [H]
 *     acc += w[t, k] * partial                                                 [H]    fp32
 *   y = bf16(acc)
 *
 * mfref_layer_mt splits every rank's tokens over threads; tokens are independent, so the result is
 * the same bits for any thread count.
 *
 * Speed: weight rows are decoded on the fly (FP8 through a 256-entry table built from the public
 * conversion, BF16 by the format's definition: the high half of an fp32), and every dot product
 * keeps REF_LANES independent double accumulators, summed in a fixed order.
 */
#include "ref.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define REF_QBLOCK 128         /* FP8 block edge: 1x128 activations, 128x128 weights */
#define REF_FP8_MAX 448.0f     /* largest finite E4M3 value */
#define REF_AMAX_MIN 1e-4f     /* block amax is clamped below to this */
#define REF_FP8_CODES 256
#define REF_LANES 8            /* independent accumulators per dot product */
#define REF_MAX_THREADS 64     /* mfref_layer_mt */

typedef struct ref_ctx {
    const mfref_problem_t *p;
    double fp8[REF_FP8_CODES]; /* E4M3 code -> value */
    float *xf;                 /* [H] the token as fp32 */
    double *xa;                /* [H] the token as the W13 GEMM sees it */
    double *gu;                /* [2I] gate then up */
    float *hf;                 /* [I] h in fp32 (the value that is rounded or requantised) */
    double *ha;                /* [I] h as the W2 GEMM sees it */
    float *acc;                /* [H] the fp32 K-sum */
    double *wrow;              /* [max(H, I)] one decoded BF16 weight row */
} ref_ctx_t;

/* sum over i < n of a[i] * w[i]. */
static double dot_f64(const double *a, const double *w, int32_t n) {
    double s[REF_LANES] = {0}, sum = 0.0;
    int32_t i = 0;
    for (; i + REF_LANES <= n; i += REF_LANES)
        for (int j = 0; j < REF_LANES; j++) s[j] += a[i + j] * w[i + j];
    for (; i < n; i++) s[0] += a[i] * w[i];
    for (int j = 0; j < REF_LANES; j++) sum += s[j];
    return sum;
}

/* sum over i < n of a[i] * value(w[i]), w FP8 codes. */
static double dot_fp8(const double *a, const uint8_t *w, const double *lut, int32_t n) {
    double s[REF_LANES] = {0}, sum = 0.0;
    int32_t i = 0;
    for (; i + REF_LANES <= n; i += REF_LANES)
        for (int j = 0; j < REF_LANES; j++) s[j] += a[i + j] * lut[w[i + j]];
    for (; i < n; i++) s[0] += a[i] * lut[w[i]];
    for (int j = 0; j < REF_LANES; j++) sum += s[j];
    return sum;
}

/* One row of a weight matrix times a: BF16 row of n, or FP8 row of n whose 128-wide blocks have
 * the scales scales[0 .. n/128). */
static double row_dot(ref_ctx_t *c, const void *w, const float *scales, const double *a,
                      int32_t n) {
    if (c->p->dtype == MF_DTYPE_BF16) {
        const uint16_t *b = (const uint16_t *)w;
        for (int32_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)b[i] << 16; /* a bf16 is the high half of an fp32 */
            float f;
            memcpy(&f, &u, sizeof f);
            c->wrow[i] = f;
        }
        return dot_f64(a, c->wrow, n);
    }
    const uint8_t *q = (const uint8_t *)w;
    double sum = 0.0;
    for (int32_t b = 0; b < n / REF_QBLOCK; b++)
        sum += (double)scales[b] * dot_fp8(a + b * REF_QBLOCK, q + b * REF_QBLOCK, c->fp8, REF_QBLOCK);
    return sum;
}

/* Quantises v[0, n) to FP8 in 1x128 blocks exactly as docs/DESIGN.md says and writes the
 * dequantised values q * scale into out. amax is an fp32 max (NaN propagates); scale = amax / 448
 * and q = e4m3(v * (448 / amax)) in fp32; UE8M0: scale = 2^ceil(log2(amax / 448)) and
 * q = e4m3(v * (1 / scale)). */
static void fake_quant_fp8(const ref_ctx_t *c, const float *v, int32_t n, double *out) {
    for (int32_t b = 0; b < n; b += REF_QBLOCK) {
        float amax = 0.0f;
        int nan = 0;
        for (int32_t i = b; i < b + REF_QBLOCK; i++) {
            float a = fabsf(v[i]);
            if (a != a) nan = 1;
            if (a > amax) amax = a;
        }
        if (nan) amax = NAN;
        else if (amax < REF_AMAX_MIN) amax = REF_AMAX_MIN;
        float scale = amax / REF_FP8_MAX, mult = REF_FP8_MAX / amax;
        if (c->p->ue8m0 && !nan) {
            int e;
            float m = frexpf(scale, &e); /* scale = m * 2^e, m in [0.5, 1) */
            scale = m == 0.5f ? scale : ldexpf(1.0f, e);
            mult = 1.0f / scale;
        }
        for (int32_t i = b; i < b + REF_QBLOCK; i++) {
            float prod = v[i] * mult; /* rounded to fp32 before the conversion */
            out[i] = c->fp8[mf_fp8_e4m3_from_float(prod)] * (double)scale;
        }
    }
}

/* y [H] of one token with ids / tw [K]. */
static void ref_token(ref_ctx_t *c, const uint16_t *x, const int32_t *ids, const float *tw,
                      uint16_t *y) {
    const mfref_problem_t *p = c->p;
    const int32_t H = p->H, I = p->I, fp8 = p->dtype == MF_DTYPE_FP8_E4M3;
    const size_t esize = fp8 ? 1 : 2;
    const int32_t hb = H / REF_QBLOCK, ib = I / REF_QBLOCK; /* FP8 blocks along H and I */

    for (int32_t j = 0; j < H; j++) c->xf[j] = mf_bf16_to_float(x[j]);
    if (fp8) fake_quant_fp8(c, c->xf, H, c->xa);
    else
        for (int32_t j = 0; j < H; j++) c->xa[j] = c->xf[j];
    for (int32_t j = 0; j < H; j++) c->acc[j] = 0.0f;

    for (int32_t k = 0; k < p->K; k++) {
        const int32_t e = ids[k];
        if (e == -1) continue;
        int32_t r = 0, l = e; /* ranks hold E / R experts each, the first E % R one more */
        while (l >= p->E / p->R + (r < p->E % p->R)) l -= p->E / p->R + (r < p->E % p->R), r++;
        const char *w13 = (const char *)p->w13[r] + (size_t)l * 2 * I * H * esize;
        const char *w2 = (const char *)p->w2[r] + (size_t)l * H * I * esize;
        const float *s13 = fp8 ? p->w13_scales[r] + (size_t)l * (2 * I / REF_QBLOCK) * hb : NULL;
        const float *s2 = fp8 ? p->w2_scales[r] + (size_t)l * (H / REF_QBLOCK) * ib : NULL;

        for (int32_t i = 0; i < 2 * I; i++)
            c->gu[i] = row_dot(c, w13 + (size_t)i * H * esize,
                               fp8 ? s13 + (size_t)(i / REF_QBLOCK) * hb : NULL, c->xa, H);
        for (int32_t i = 0; i < I; i++) {
            double g = c->gu[i], u = c->gu[I + i];
            c->hf[i] = (float)(g / (1.0 + exp(-g)) * u);
        }
        if (fp8) fake_quant_fp8(c, c->hf, I, c->ha);
        else
            for (int32_t i = 0; i < I; i++) c->ha[i] = mf_bf16_to_float(mf_bf16_from_float(c->hf[i]));

        for (int32_t j = 0; j < H; j++) {
            double part = row_dot(c, w2 + (size_t)j * I * esize,
                                  fp8 ? s2 + (size_t)(j / REF_QBLOCK) * ib : NULL, c->ha, I);
            float partial = mf_bf16_to_float(mf_bf16_from_float((float)part));
            c->acc[j] += tw[k] * partial; /* fp32 multiply, then fp32 add (no contraction) */
        }
    }
    for (int32_t j = 0; j < H; j++) y[j] = mf_bf16_from_float(c->acc[j]);
}

static int valid_problem(const mfref_problem_t *p, uint16_t *const *y) {
    if (!p || !y || p->R < 1 || p->E < p->R || p->K < 1 || p->H < 1 || p->I < 1)
        return 0;
    if (!p->T || !p->x || !p->topk_ids || !p->topk_weights || !p->w13 || !p->w2) return 0;
    const int fp8 = p->dtype == MF_DTYPE_FP8_E4M3;
    if (!fp8 && p->dtype != MF_DTYPE_BF16) return 0;
    if (fp8 && (p->H % REF_QBLOCK || p->I % REF_QBLOCK || !p->w13_scales || !p->w2_scales)) return 0;
    for (int32_t r = 0; r < p->R; r++) {
        if (!p->w13[r] || !p->w2[r] || (fp8 && (!p->w13_scales[r] || !p->w2_scales[r]))) return 0;
        if (p->T[r] < 0) return 0;
        if (p->T[r] == 0) continue;
        if (!p->x[r] || !p->topk_ids[r] || !p->topk_weights[r] || !y[r]) return 0;
        for (int64_t i = 0; i < (int64_t)p->T[r] * p->K; i++)
            if (p->topk_ids[r][i] < -1 || p->topk_ids[r][i] >= p->E) return 0;
    }
    return 1;
}

int mfref_layer(const mfref_problem_t *p, uint16_t *const *y) {
    if (!valid_problem(p, y)) return -1;
    ref_ctx_t c = {.p = p};
    for (int i = 0; i < REF_FP8_CODES; i++) c.fp8[i] = mf_fp8_e4m3_to_float((uint8_t)i);
    c.xf = malloc(sizeof(float) * (size_t)p->H);
    c.xa = malloc(sizeof(double) * (size_t)p->H);
    c.gu = malloc(sizeof(double) * 2 * (size_t)p->I);
    c.hf = malloc(sizeof(float) * (size_t)p->I);
    c.ha = malloc(sizeof(double) * (size_t)p->I);
    c.acc = malloc(sizeof(float) * (size_t)p->H);
    c.wrow = malloc(sizeof(double) * (size_t)(p->H > p->I ? p->H : p->I));
    int rc = c.xf && c.xa && c.gu && c.hf && c.ha && c.acc && c.wrow ? 0 : -1;

    int64_t done = 0, total = 0;
    for (int32_t r = 0; r < p->R; r++) total += p->T[r];
    for (int32_t r = 0; r < p->R && rc == 0; r++)
        for (int32_t t = 0; t < p->T[r]; t++) {
            const size_t tk = (size_t)t * p->K;
            ref_token(&c, p->x[r] + (size_t)t * p->H, p->topk_ids[r] + tk, p->topk_weights[r] + tk,
                      y[r] + (size_t)t * p->H);
            if (p->progress) p->progress(p->progress_ctx, ++done, total);
        }
    free(c.xf);
    free(c.xa);
    free(c.gu);
    free(c.hf);
    free(c.ha);
    free(c.acc);
    free(c.wrow);
    return rc;
}

double mfref_diff_bf16(const uint16_t *a, const uint16_t *b, int64_t n) {
    double ab = 0.0, sq = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double x = mf_bf16_to_float(a[i]), z = mf_bf16_to_float(b[i]);
        if (!isfinite(x) || !isfinite(z)) return MFREF_DIFF_NAN;
        ab += x * z;
        sq += x * x + z * z;
    }
    return sq == 0.0 ? 0.0 : 1.0 - 2.0 * ab / sq;
}

int64_t mfref_count_wrong_bf16(const uint16_t *out, const uint16_t *ref, int64_t n, double atol,
                               double rtol, int64_t *first_wrong, double *max_abs_err) {
    int64_t wrong = 0;
    double worst = 0.0;
    if (first_wrong) *first_wrong = -1;
    for (int64_t i = 0; i < n; i++) {
        double a = mf_bf16_to_float(out[i]), r = mf_bf16_to_float(ref[i]);
        double err = fabs(a - r);
        if (!(err <= atol + rtol * fabs(r))) { /* NaN in either fails here */
            if (wrong++ == 0 && first_wrong) *first_wrong = i;
        }
        if (err != err || worst != worst) worst = NAN; /* a NaN sticks */
        else if (err > worst) worst = err;
    }
    if (max_abs_err) *max_abs_err = worst;
    return wrong;
}

/* ---- the same, on several threads: each takes a slice of every rank's tokens ---------------- */

typedef struct ref_slice {
    mfref_problem_t view; /* p with x, ids, weights and T narrowed to the slice */
    int32_t *T;
    const uint16_t **x;
    const int32_t **ids;
    const float **tw;
    uint16_t **y;
    int rc;
} ref_slice_t;

typedef struct ref_shared {
    const mfref_problem_t *p;
    pthread_mutex_t mu;
    int64_t done, total;
} ref_shared_t;

static void slice_progress(void *ctx, int64_t done, int64_t total) {
    (void)done;
    (void)total;
    ref_shared_t *sh = ctx;
    pthread_mutex_lock(&sh->mu);
    sh->done++;
    sh->p->progress(sh->p->progress_ctx, sh->done, sh->total);
    pthread_mutex_unlock(&sh->mu);
}

static void *slice_main(void *arg) {
    ref_slice_t *s = arg;
    s->rc = mfref_layer(&s->view, s->y);
    return NULL;
}

int mfref_layer_mt(const mfref_problem_t *p, uint16_t *const *y, int32_t threads) {
    if (threads <= 1 || !valid_problem(p, y)) return mfref_layer(p, y);
    if (threads > REF_MAX_THREADS) threads = REF_MAX_THREADS;
    const size_t R = (size_t)p->R;
    ref_shared_t sh = {.p = p};
    for (size_t r = 0; r < R; r++) sh.total += p->T[r];
    pthread_mutex_init(&sh.mu, NULL);
    ref_slice_t sl[REF_MAX_THREADS];
    pthread_t th[REF_MAX_THREADS];
    int started[REF_MAX_THREADS] = {0}, rc = 0;
    memset(sl, 0, sizeof sl);
    for (int32_t j = 0; j < threads; j++) {
        ref_slice_t *s = &sl[j];
        s->T = malloc(R * sizeof *s->T);
        s->x = malloc(R * sizeof *s->x);
        s->ids = malloc(R * sizeof *s->ids);
        s->tw = malloc(R * sizeof *s->tw);
        s->y = malloc(R * sizeof *s->y);
        if (!s->T || !s->x || !s->ids || !s->tw || !s->y) {
            rc = -1;
            break;
        }
        for (size_t r = 0; r < R; r++) { /* tokens [t0, t1) of rank r */
            int64_t t0 = (int64_t)p->T[r] * j / threads, t1 = (int64_t)p->T[r] * (j + 1) / threads;
            s->T[r] = (int32_t)(t1 - t0);
            s->x[r] = p->x[r] ? p->x[r] + t0 * p->H : NULL;
            s->ids[r] = p->topk_ids[r] ? p->topk_ids[r] + t0 * p->K : NULL;
            s->tw[r] = p->topk_weights[r] ? p->topk_weights[r] + t0 * p->K : NULL;
            s->y[r] = y[r] ? y[r] + t0 * p->H : NULL;
        }
        s->view = *p;
        s->view.T = s->T;
        s->view.x = s->x;
        s->view.topk_ids = s->ids;
        s->view.topk_weights = s->tw;
        s->view.progress = p->progress ? slice_progress : NULL;
        s->view.progress_ctx = &sh;
        started[j] = pthread_create(&th[j], NULL, slice_main, s) == 0;
        if (!started[j]) slice_main(s); /* no thread: do it here */
    }
    for (int32_t j = 0; j < threads; j++) {
        if (started[j]) pthread_join(th[j], NULL);
        if (sl[j].rc) rc = -1;
        free(sl[j].T);
        free(sl[j].x);
        free(sl[j].ids);
        free(sl[j].tw);
        free(sl[j].y);
    }
    pthread_mutex_destroy(&sh.mu);
    return rc;
}
