/*
 * problem.c — seeded random EP MoE problems and the driver that runs them through the public API
 * (problem.h), shared by the tests and the `moeflow` CLI.
 *
 * Generation. One splitmix64 stream per purpose: expert e's weights from (seed, e), rank r's tokens
 * and routing from (seed, r), the zipf popularity order from (seed). Weight streams are independent,
 * so several threads draw them and the result does not depend on how many.
 *
 * Running. mfp_run drives R ranks, as threads of a local group (mf_group_create) or as forked
 * processes that each make one comm (the built-in rendezvous and mf_comm_init over the ipc
 * transport). Every rank creates its layer (collective), sets its weights and calls mf_moe_forward
 * warmup + iters times, each call started together with the other ranks' (a barrier that a failing
 * rank breaks, so nobody waits on a rank that has left). On CUDA every rank copies its inputs and
 * weights to the device first and its y back at the end. The run's state (barrier, first failure,
 * times, outputs) lives in memory that processes share too. The first failure wins: its code and
 * its rank's mf_last_error() are returned.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include "problem.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if MF_WITH_CUDA
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <sched.h>
#include <stdatomic.h>
#endif

#define MFP_QBLOCK 128            /* FP8 weight blocks are 128 x 128 */
#define MFP_MAX_GEN_THREADS 16    /* threads drawing weights */
#define MFP_MIN_WEIGHT 0.05       /* topk_weights are drawn from [MIN, MIN + 1) then normalised */
#define MFP_MIN_ALLOC 64          /* bytes: every per-rank array exists, even for T = 0 */
#define MFP_ERRLEN 512
#define MFP_MAX_K 64              /* K the generator accepts (above MF_MAX_TOPK, for misuse tests) */
#define MFP_NCCL_ID_BYTES 128     /* sizeof(ncclUniqueId) (NCCL_UNIQUE_ID_BYTES) */

/* Stream tags: different purposes never share a stream. */
enum { TAG_W13 = 1, TAG_W2 = 2, TAG_INPUT = 3, TAG_ZIPF = 4 };

/* ---- random numbers ------------------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t stream_seed(uint64_t seed, uint64_t tag, uint64_t index) {
    uint64_t s = seed ^ (tag << 56) ^ (index * 0xd1b54a32d192ed03ull);
    return splitmix64(&s);
}

static double uniform01(uint64_t *s) { return (double)(splitmix64(s) >> 11) * 0x1.0p-53; }

/* Roughly N(0, 1): four 16-bit uniforms on [-1, 1) summed (variance 4/3), rescaled. */
static float normal_ish(uint64_t *s) {
    uint64_t b = splitmix64(s);
    double sum = 0.0;
    for (int i = 0; i < 4; i++, b >>= 16) sum += ((double)(b & 0xffff) - 32767.5) / 32768.0;
    return (float)(sum * 0.8660254037844386); /* sqrt(3/4) */
}

/* bf16 of v, never zero. */
static uint16_t bf16_nonzero(float v) {
    uint16_t b = mf_bf16_from_float(v);
    return (b & 0x7fff) ? b : mf_bf16_from_float(v < 0 ? -1e-3f : 1e-3f);
}

/* ---- placement (docs/API.md section 3) -------------------------------------------------------- */

/* Both placements list a rank's experts in ascending id: the rank of every expert says it all. */
int32_t mfp_expert_rank(const mfp_spec_t *s, int32_t placement, int32_t e) {
    if (placement == MF_PLACEMENT_ROUND_ROBIN) return e % s->R;
    int32_t first = 0; /* LINEAR: contiguous ranges, the first E % R ranks one longer */
    for (int32_t r = 0; r < s->R; r++) {
        first += s->E / s->R + (r < s->E % s->R);
        if (e < first) return r;
    }
    return -1;
}

int32_t mfp_rank_expert(const mfp_spec_t *s, int32_t placement, int32_t r, int32_t l) {
    for (int32_t e = 0; e < s->E; e++)
        if (mfp_expert_rank(s, placement, e) == r && l-- == 0) return e;
    return -1;
}

int32_t mfp_rank_experts(const mfp_spec_t *s, int32_t placement, int32_t r) {
    int32_t n = 0;
    for (int32_t e = 0; e < s->E; e++) n += mfp_expert_rank(s, placement, e) == r;
    return n;
}

/* Bytes of one expert's w13, w2, w13 scales and w2 scales (0 for BF16's scales). */
static void expert_bytes(const mfp_spec_t *s, size_t per[4]) {
    const size_t H = (size_t)s->H, I = (size_t)s->I, esize = s->dtype == MF_DTYPE_FP8_E4M3 ? 1 : 2;
    const size_t nsc = s->dtype == MF_DTYPE_FP8_E4M3 ? (2 * I / MFP_QBLOCK) * (H / MFP_QBLOCK) : 0;
    per[0] = 2 * I * H * esize, per[1] = H * I * esize, per[2] = nsc * sizeof(float), per[3] = nsc / 2 * sizeof(float);
}

/* Expert e's four tensors in the problem (its LINEAR rank's arrays; scales NULL for BF16). */
static void expert_ptrs(const mfp_problem_t *p, int32_t e, uint8_t *ptr[4]) {
    const int32_t r = mfp_expert_rank(&p->spec, MF_PLACEMENT_LINEAR, e);
    const size_t l = (size_t)(e - mfp_rank_expert(&p->spec, MF_PLACEMENT_LINEAR, r, 0));
    size_t per[4];
    expert_bytes(&p->spec, per);
    uint8_t *base[4] = {p->w13[r], p->w2[r], (uint8_t *)p->w13_scales[r], (uint8_t *)p->w2_scales[r]};
    for (int i = 0; i < 4; i++) ptr[i] = base[i] ? base[i] + l * per[i] : NULL;
}

/* ---- weights -------------------------------------------------------------------------------- */

/* rows x cols bf16, U(-1, 1) * sqrt(3 / cols): two values per 64-bit draw. */
static void draw_matrix(uint64_t seed, uint16_t *w, int64_t n, int32_t fan_in) {
    const float bound = (float)sqrt(3.0 / fan_in);
    for (int64_t i = 0; i < n; i += 2) {
        uint64_t b = splitmix64(&seed);
        w[i] = bf16_nonzero((float)((int32_t)(uint32_t)b * 0x1.0p-31) * bound);
        if (i + 1 < n) w[i + 1] = bf16_nonzero((float)((int32_t)(uint32_t)(b >> 32) * 0x1.0p-31) * bound);
    }
}

typedef struct gen_job {
    mfp_problem_t *p;
    pthread_mutex_t mu;
    int32_t next_expert;
    int failed;
} gen_job_t;

/* Draws expert e into its rank's arrays; FP8 through a bf16 scratch of [2I * H] (W13, then W2). */
static int draw_expert(mfp_problem_t *p, int32_t e, uint16_t *scratch) {
    const mfp_spec_t *s = &p->spec;
    const int32_t H = s->H, I = s->I;
    const int64_t n13 = 2LL * I * H, n2 = (int64_t)H * I;
    const uint64_t seed13 = stream_seed(s->seed, TAG_W13, (uint64_t)e);
    const uint64_t seed2 = stream_seed(s->seed, TAG_W2, (uint64_t)e);
    uint8_t *w[4];
    expert_ptrs(p, e, w);
    if (s->dtype == MF_DTYPE_BF16) {
        draw_matrix(seed13, (uint16_t *)w[0], n13, H);
        draw_matrix(seed2, (uint16_t *)w[1], n2, I);
        return 0;
    }
    mf_tensor_t in = {scratch, MF_DTYPE_BF16, 2, {2 * I, H}};
    mf_tensor_t out = {w[0], MF_DTYPE_FP8_E4M3, 2, {2 * I, H}};
    mf_tensor_t sc = {w[2], MF_DTYPE_FP32, 2, {2 * I / MFP_QBLOCK, H / MFP_QBLOCK}};
    draw_matrix(seed13, scratch, n13, H);
    if (mf_quantize_fp8(&in, &out, &sc, MFP_QBLOCK, 0) != MF_SUCCESS) return -1;
    mf_tensor_t in2 = {scratch, MF_DTYPE_BF16, 2, {H, I}};
    mf_tensor_t out2 = {w[1], MF_DTYPE_FP8_E4M3, 2, {H, I}};
    mf_tensor_t sc2 = {w[3], MF_DTYPE_FP32, 2, {H / MFP_QBLOCK, I / MFP_QBLOCK}};
    draw_matrix(seed2, scratch, n2, I);
    return mf_quantize_fp8(&in2, &out2, &sc2, MFP_QBLOCK, 0) == MF_SUCCESS ? 0 : -1;
}

/* Takes experts from the job until none is left or one failed. */
static void *gen_worker(void *arg) {
    gen_job_t *job = arg;
    const mfp_spec_t *s = &job->p->spec;
    uint16_t *scratch = NULL;
    int ok = 1;
    if (s->dtype == MF_DTYPE_FP8_E4M3) {
        scratch = malloc(sizeof(uint16_t) * 2 * (size_t)s->I * s->H);
        ok = scratch != NULL;
    }
    for (;;) {
        pthread_mutex_lock(&job->mu);
        if (!ok) job->failed = 1;
        int32_t e = job->failed ? s->E : job->next_expert++;
        pthread_mutex_unlock(&job->mu);
        if (e >= s->E) break;
        ok = draw_expert(job->p, e, scratch) == 0;
    }
    free(scratch);
    return NULL;
}

static int draw_weights(mfp_problem_t *p) {
    gen_job_t job = {.p = p};
    pthread_mutex_init(&job.mu, NULL);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int n = ncpu < 1 ? 1 : ncpu > MFP_MAX_GEN_THREADS ? MFP_MAX_GEN_THREADS : (int)ncpu;
    if (n > p->spec.E) n = p->spec.E;
    pthread_t th[MFP_MAX_GEN_THREADS];
    int started = 0;
    for (; started < n - 1; started++)
        if (pthread_create(&th[started], NULL, gen_worker, &job) != 0) break;
    gen_worker(&job); /* this thread works too; fewer threads only make it slower */
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    pthread_mutex_destroy(&job.mu);
    return job.failed ? -1 : 0;
}

/* ---- inputs --------------------------------------------------------------------------------- */

/* 1 if e is among ids[0, n). */
static int has_id(const int32_t *ids, int32_t n, int32_t e) {
    for (int32_t i = 0; i < n; i++)
        if (ids[i] == e) return 1;
    return 0;
}

/* K distinct ids for one token into ids[K]; popularity[E] holds the zipf weights (ZIPF only). */
static void draw_routing(const mfp_spec_t *s, const double *popularity, uint64_t *st, int32_t *ids) {
    const int32_t E = s->E, K = s->K;
    int32_t k0 = 0;
    if (s->routing == MFP_ROUTING_HOT) { /* the hot expert at a random k, the others uniform */
        int32_t at = (int32_t)(uniform01(st) * K);
        for (int32_t k = 0; k < K; k++) ids[k] = -2;
        ids[at] = s->hot_expert;
        for (int32_t k = 0; k < K; k++)
            while (ids[k] == -2) {
                int32_t e = (int32_t)(uniform01(st) * E);
                if (!has_id(ids, K, e)) ids[k] = e;
            }
        k0 = K;
    }
    if (s->routing == MFP_ROUTING_ZIPF) { /* without replacement: take the chosen mass out */
        double left = 0.0;
        for (int32_t e = 0; e < E; e++) left += popularity[e];
        for (int32_t k = 0; k < K; k++) {
            double u = uniform01(st) * left, acc = 0.0;
            int32_t pick = -1;
            for (int32_t e = 0; e < E; e++) {
                if (has_id(ids, k, e)) continue;
                pick = e; /* the last unused expert if rounding leaves u past the end */
                acc += popularity[e];
                if (u < acc) break;
            }
            ids[k] = pick;
            left -= popularity[pick];
        }
        k0 = K;
    }
    for (int32_t k = k0; k < K; k++) { /* uniform: rejection of repeats */
        int32_t e;
        do e = (int32_t)(uniform01(st) * E);
        while (has_id(ids, k, e));
        ids[k] = e;
    }
}

/* Zipf weight of every expert: 1 / (place + 1)^s, places shuffled from the seed. */
static double *zipf_popularity(const mfp_spec_t *s) {
    double *pop = malloc(sizeof(double) * (size_t)s->E);
    int32_t *place = malloc(sizeof(int32_t) * (size_t)s->E);
    if (!pop || !place) {
        free(pop);
        free(place);
        return NULL;
    }
    uint64_t st = stream_seed(s->seed, TAG_ZIPF, 0);
    for (int32_t e = 0; e < s->E; e++) place[e] = e;
    for (int32_t e = s->E - 1; e > 0; e--) { /* Fisher-Yates */
        int32_t j = (int32_t)(uniform01(&st) * (e + 1)), t = place[e];
        place[e] = place[j];
        place[j] = t;
    }
    for (int32_t e = 0; e < s->E; e++) pop[e] = pow(place[e] + 1.0, -s->zipf_s);
    free(place);
    return pop;
}

static void free_inputs(mfp_problem_t *p) {
    for (int32_t r = 0; p->x && r < p->spec.R; r++) {
        free(p->x[r]);
        free(p->topk_ids[r]);
        free(p->topk_weights[r]);
        p->x[r] = NULL;
        p->topk_ids[r] = NULL;
        p->topk_weights[r] = NULL;
    }
}

static void fill_ref_view(mfp_problem_t *p) {
    const mfp_spec_t *s = &p->spec;
    mfref_problem_t v = {
        .R = s->R, .E = s->E, .K = s->K, .H = s->H, .I = s->I, .dtype = s->dtype, .ue8m0 = s->ue8m0,
        .T = p->T,
        .x = (const uint16_t *const *)p->x,
        .topk_ids = (const int32_t *const *)p->topk_ids,
        .topk_weights = (const float *const *)p->topk_weights,
        .w13 = (const void *const *)p->w13,
        .w13_scales = (const float *const *)p->w13_scales,
        .w2 = (const void *const *)p->w2,
        .w2_scales = (const float *const *)p->w2_scales,
    };
    p->ref = v;
}

/* Rank r's T tokens, routing and weights from (seed, r); popularity: zipf weights (ZIPF only). */
static void draw_rank(const mfp_spec_t *s, const double *pop, uint64_t seed, int32_t r, int32_t T, uint16_t *xs,
                      int32_t *idss, float *ws) {
    const int32_t H = s->H, K = s->K;
    uint64_t st = stream_seed(seed, TAG_INPUT, (uint64_t)r);
    for (size_t t = 0; t < (size_t)T; t++) { /* token by token: a prefix of tokens is seed-stable */
        uint16_t *x = xs + t * H;
        int32_t *ids = idss + t * K;
        float *w = ws + t * K;
        for (int32_t h = 0; h < H; h++) x[h] = bf16_nonzero(normal_ish(&st));
        draw_routing(s, pop, &st, ids);
        double sum = 0.0, wd[MFP_MAX_K];
        for (int32_t k = 0; k < K; k++) {
            if (uniform01(&st) < s->drop_prob) ids[k] = -1;
            sum += wd[k] = MFP_MIN_WEIGHT + uniform01(&st);
        }
        for (int32_t k = 0; k < K; k++) w[k] = (float)(wd[k] / sum);
    }
}

/* (Re)allocates and draws every rank's x, ids and weights for the current p->T. */
static int draw_inputs(mfp_problem_t *p, uint64_t seed) {
    const mfp_spec_t *s = &p->spec;
    const int32_t H = s->H, K = s->K;
    double *pop = NULL;
    if (s->routing == MFP_ROUTING_ZIPF && !(pop = zipf_popularity(s))) return -1;
    free_inputs(p);
    int rc = 0;
    for (int32_t r = 0; r < s->R && rc == 0; r++) {
        const size_t T = (size_t)p->T[r];
        p->x[r] = malloc(sizeof(uint16_t) * T * H + MFP_MIN_ALLOC);
        p->topk_ids[r] = malloc(sizeof(int32_t) * T * K + MFP_MIN_ALLOC);
        p->topk_weights[r] = malloc(sizeof(float) * T * K + MFP_MIN_ALLOC);
        if (!p->x[r] || !p->topk_ids[r] || !p->topk_weights[r]) {
            rc = -1;
            break;
        }
        draw_rank(s, pop, seed, r, p->T[r], p->x[r], p->topk_ids[r], p->topk_weights[r]);
    }
    free(pop);
    fill_ref_view(p);
    return rc;
}

int mfp_draw_rank_inputs(const mfp_problem_t *p, int32_t r, uint64_t seed, uint16_t *x, int32_t *topk_ids,
                         float *topk_weights) {
    double *pop = NULL;
    if (p->spec.routing == MFP_ROUTING_ZIPF && !(pop = zipf_popularity(&p->spec))) return -1;
    draw_rank(&p->spec, pop, seed, r, p->T[r], x, topk_ids, topk_weights);
    free(pop);
    return 0;
}

/* ---- problem -------------------------------------------------------------------------------- */

static int valid_spec(const mfp_spec_t *s) {
    if (s->R < 1 || s->R > MF_MAX_RANKS || s->E < s->R) return 0;
    if (s->placement != MF_PLACEMENT_LINEAR && s->placement != MF_PLACEMENT_ROUND_ROBIN) return 0;
    if (s->K < 1 || s->K > s->E || s->K > MFP_MAX_K || s->H < 1 || s->I < 1) return 0;
    if (s->dtype != MF_DTYPE_BF16 && s->dtype != MF_DTYPE_FP8_E4M3) return 0;
    if (s->dtype == MF_DTYPE_FP8_E4M3 && (s->H % MFP_QBLOCK || s->I % MFP_QBLOCK)) return 0;
    if (s->routing < MFP_ROUTING_UNIFORM || s->routing > MFP_ROUTING_HOT) return 0;
    if (s->routing == MFP_ROUTING_HOT && (s->hot_expert < 0 || s->hot_expert >= s->E)) return 0;
    if (s->routing == MFP_ROUTING_ZIPF && !(s->zipf_s >= 0.0)) return 0;
    if (!(s->drop_prob >= 0.0 && s->drop_prob <= 1.0)) return 0;
    if (s->T_per_rank < 0) return 0;
    for (int32_t r = 0; s->T_of_rank && r < s->R; r++)
        if (s->T_of_rank[r] < 0) return 0;
    return 1;
}

int mfp_generate(const mfp_spec_t *spec, mfp_problem_t *p) {
    if (!p) return -1;
    memset(p, 0, sizeof *p);
    if (!spec || !valid_spec(spec)) return -1;
    mfp_spec_t *s = &p->spec;
    *s = *spec;
    s->T_of_rank = NULL; /* the caller's array is not kept; p->T holds the values */
    p->L = (s->E + s->R - 1) / s->R;
    const size_t R = (size_t)s->R;
    p->T = calloc(R, sizeof *p->T);
    p->x = calloc(R, sizeof *p->x);
    p->topk_ids = calloc(R, sizeof *p->topk_ids);
    p->topk_weights = calloc(R, sizeof *p->topk_weights);
    p->w13 = calloc(R, sizeof *p->w13);
    p->w2 = calloc(R, sizeof *p->w2);
    p->w13_scales = calloc(R, sizeof *p->w13_scales);
    p->w2_scales = calloc(R, sizeof *p->w2_scales);
    if (!p->T || !p->x || !p->topk_ids || !p->topk_weights || !p->w13 || !p->w2 ||
        !p->w13_scales || !p->w2_scales)
        goto fail;
    int32_t maxT = 0;
    for (size_t r = 0; r < R; r++) {
        p->T[r] = spec->T_of_rank ? spec->T_of_rank[r] : spec->T_per_rank;
        if (p->T[r] > maxT) maxT = p->T[r];
    }
    if (s->S <= 0) s->S = maxT > 0 ? maxT : 1;

    size_t per[4];
    expert_bytes(s, per);
    for (size_t r = 0; r < R; r++) { /* the LINEAR placement's L_r experts */
        const size_t L = (size_t)mfp_rank_experts(s, MF_PLACEMENT_LINEAR, (int32_t)r);
        if (!(p->w13[r] = malloc(L * per[0])) || !(p->w2[r] = malloc(L * per[1]))) goto fail;
        if (s->dtype == MF_DTYPE_FP8_E4M3 &&
            (!(p->w13_scales[r] = malloc(L * per[2])) || !(p->w2_scales[r] = malloc(L * per[3]))))
            goto fail;
    }
    if (draw_weights(p) != 0 || draw_inputs(p, s->seed) != 0) goto fail;
    return 0;
fail:
    mfp_free(p);
    return -1;
}

void mfp_free(mfp_problem_t *p) {
    if (!p) return;
    free_inputs(p);
    for (int32_t r = 0; p->w13 && r < p->spec.R; r++) {
        free(p->w13[r]);
        free(p->w2[r]);
        free(p->w13_scales[r]);
        free(p->w2_scales[r]);
    }
    free(p->T);
    free(p->x);
    free(p->topk_ids);
    free(p->topk_weights);
    free(p->w13);
    free(p->w2);
    free(p->w13_scales);
    free(p->w2_scales);
    memset(p, 0, sizeof *p);
}

int mfp_redraw_inputs(mfp_problem_t *p, uint64_t seed) {
    if (!p || !p->T) return -1;
    return draw_inputs(p, seed);
}

int mfp_set_tokens(mfp_problem_t *p, int32_t T_per_rank, uint64_t seed) {
    if (!p || !p->T || T_per_rank < 0) return -1;
    for (int32_t r = 0; r < p->spec.R; r++) p->T[r] = T_per_rank;
    p->spec.T_per_rank = T_per_rank;
    return draw_inputs(p, seed);
}

int64_t mfp_count_rows(const mfp_problem_t *p, int64_t *rows_per_rank, int64_t *rows_per_expert) {
    const mfp_spec_t *s = &p->spec;
    int64_t rows = 0;
    if (rows_per_rank) memset(rows_per_rank, 0, sizeof(int64_t) * (size_t)s->R);
    if (rows_per_expert) memset(rows_per_expert, 0, sizeof(int64_t) * (size_t)s->E);
    for (int32_t r = 0; r < s->R; r++)
        for (int64_t i = 0; i < (int64_t)p->T[r] * s->K; i++) {
            int32_t e = p->topk_ids[r][i];
            if (e < 0 || e >= s->E) continue;
            rows++;
            if (rows_per_rank) rows_per_rank[mfp_expert_rank(s, s->placement, e)]++;
            if (rows_per_expert) rows_per_expert[e]++;
        }
    return rows;
}

int mfp_gather_ranks(const mfp_problem_t *p, mfp_problem_t *one) {
    memset(one, 0, sizeof *one);
    const mfp_spec_t *s = &p->spec;
    int64_t total = 0;
    for (int32_t r = 0; r < s->R; r++) total += p->T[r];
    one->spec = *s;
    one->spec.R = 1, one->spec.placement = MF_PLACEMENT_LINEAR;
    one->spec.T_per_rank = (int32_t)total, one->spec.T_of_rank = NULL, one->spec.S = total > 0 ? (int32_t)total : 1;
    one->L = s->E;
    size_t per[4];
    expert_bytes(s, per);
    const size_t T = (size_t)total, H = (size_t)s->H, K = (size_t)s->K, E = (size_t)s->E;
    one->T = calloc(1, sizeof *one->T);
    one->x = calloc(1, sizeof *one->x), one->topk_ids = calloc(1, sizeof *one->topk_ids);
    one->topk_weights = calloc(1, sizeof *one->topk_weights);
    one->w13 = calloc(1, sizeof *one->w13), one->w2 = calloc(1, sizeof *one->w2);
    one->w13_scales = calloc(1, sizeof *one->w13_scales), one->w2_scales = calloc(1, sizeof *one->w2_scales);
    if (!one->T || !one->x || !one->topk_ids || !one->topk_weights || !one->w13 || !one->w2 || !one->w13_scales ||
        !one->w2_scales) {
        mfp_free(one);
        return -1;
    }
    one->T[0] = (int32_t)total;
    /* Tokens in rank order, then every expert in id order (the LINEAR ranks' arrays, one after another). */
    const size_t row[3] = {H * 2, K * 4, K * 4};
    uint8_t *mem[7];
    for (int i = 0; i < 7; i++) /* BF16 has no scales */
        mem[i] = i < 5 || per[i - 3] ? malloc((i < 3 ? T * row[i] : E * per[i - 3]) + MFP_MIN_ALLOC) : NULL;
    one->x[0] = (uint16_t *)mem[0], one->topk_ids[0] = (int32_t *)mem[1], one->topk_weights[0] = (float *)mem[2];
    one->w13[0] = mem[3], one->w2[0] = mem[4], one->w13_scales[0] = (float *)mem[5], one->w2_scales[0] = (float *)mem[6];
    for (int i = 0; i < 7; i++)
        if (!mem[i] && (i < 5 || per[i - 3])) {
            mfp_free(one);
            return -1;
        }
    for (int32_t r = 0; r < s->R; r++) {
        const void *src[7] = {p->x[r], p->topk_ids[r], p->topk_weights[r], p->w13[r], p->w2[r], p->w13_scales[r],
                              p->w2_scales[r]};
        const size_t Lr = (size_t)mfp_rank_experts(s, MF_PLACEMENT_LINEAR, r);
        for (int i = 0; i < 7; i++) {
            if (!mem[i]) continue;
            const size_t n = i < 3 ? (size_t)p->T[r] * row[i] : Lr * per[i - 3];
            memcpy(mem[i], src[i], n);
            mem[i] += n;
        }
    }
    fill_ref_view(one);
    return 0;
}

/* ---- running -------------------------------------------------------------------------------- */

/* The barrier (problem.h): process-shared primitives, so that rank processes use it in shared
 * memory as threads do; a wait is bounded (a rank process that died never arrives). */
void mfp_barrier_init(mfp_barrier_t *b, int32_t count, int64_t timeout_ms) {
    pthread_mutexattr_t ma;
    pthread_condattr_t ca;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutex_init(&b->mu, &ma);
    pthread_mutexattr_destroy(&ma);
    pthread_condattr_init(&ca);
    pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&b->cv, &ca);
    pthread_condattr_destroy(&ca);
    b->count = count;
    b->timeout_ms = timeout_ms;
}

void mfp_barrier_fini(mfp_barrier_t *b) {
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
}

int mfp_barrier_wait(mfp_barrier_t *b) {
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += (time_t)(b->timeout_ms / 1000);
    deadline.tv_nsec += (long)(b->timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) deadline.tv_sec++, deadline.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&b->mu);
    uint64_t gen = b->generation;
    if (!b->failed && ++b->arrived == b->count) {
        b->arrived = 0;
        b->generation++;
        pthread_cond_broadcast(&b->cv);
    }
    while (!b->failed && gen == b->generation)
        if (pthread_cond_timedwait(&b->cv, &b->mu, &deadline) == ETIMEDOUT) {
            b->failed = 1;
            pthread_cond_broadcast(&b->cv);
        }
    int rc = gen != b->generation ? 0 : -1;
    pthread_mutex_unlock(&b->mu);
    return rc;
}

void mfp_barrier_break(mfp_barrier_t *b) {
    pthread_mutex_lock(&b->mu);
    b->failed = 1;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

typedef struct run_state {
    const mfp_problem_t *p;
    const mfp_run_opts_t *opts;
    mf_backend_t backend;
    mf_group_t group;          /* LOCAL: the ranks' group */
    char address[MF_ADDRESS_BYTES]; /* IPC: the rendezvous */
    uint8_t nccl_id[MFP_NCCL_ID_BYTES]; /* NCCL: rank 0's ncclUniqueId, handed to the others */
    uint16_t *y[MF_MAX_RANKS]; /* where rank r writes its output (shared memory for IPC / NCCL) */
    mfp_barrier_t barrier;
    pthread_mutex_t mu; /* guards code, err and rank_code (process-shared) */
    mf_result_t code;
    char err[MFP_ERRLEN];
    mf_result_t rank_code[MF_MAX_RANKS]; /* each rank's first failure */
    double t_start;     /* seconds, before the comms are made */
    double *setup_done; /* [R] seconds */
    double *times;      /* [R][iters] ms */
    mf_phase_times_t *phases; /* [R][iters] */
    mf_moe_balance_stats_t balance; /* rank 0, after the last forward */
    int64_t prefetch_first_bytes, prefetch_last_bytes;
    double prefetch_ms_sum;
    int32_t prefetch_n;
    uint8_t staged_iter[MFP_STAGE_ITERS]; /* rank 0: 1 where a timed forward ran while a stage was in flight */
    int32_t stage_steps;
    double stage_prefetch_ms_sum;
    int64_t stage_step_bytes_max, stage_bytes_total;
    uint64_t *digests;  /* [R][warmup + iters][2] when opts->digests */
#if MF_WITH_CUDA
    cudaEvent_t *begins; /* [R][iters] LOCAL, CUDA with profile: recorded on each rank's stream before its forward */
#endif
} run_state_t;

typedef struct rank_arg {
    run_state_t *run;
    int32_t rank;
} rank_arg_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Records the first failure (code and message) and each rank's own, and breaks the barrier. */
static void fail(run_state_t *run, int32_t rank, mf_result_t code, const char *what, const char *msg) {
    pthread_mutex_lock(&run->mu);
    if (run->code == MF_SUCCESS) { /* library messages usually name the call already */
        int named = !strncmp(msg, what, strlen(what));
        run->code = code;
        snprintf(run->err, sizeof run->err, "rank %d: %s%s%s", rank, named ? "" : what,
                 named ? "" : ": ", msg);
    }
    if (rank >= 0 && rank < MF_MAX_RANKS && run->rank_code[rank] == MF_SUCCESS) run->rank_code[rank] = code;
    pthread_mutex_unlock(&run->mu);
    mfp_barrier_break(&run->barrier);
}

/* ---- digests and the identity expert (DISPATCH_COMBINE) ------------------------------------- */

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME 0x100000001b3ull

static uint64_t fnv1a(uint64_t h, const void *data, size_t n) {
    const uint8_t *b = data;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * FNV_PRIME;
    return h;
}

/* The expert output of a received row: its value (dequantised) plus a function of its source
 * (rank, token, k) and column, rounded to bf16; the same on every backend and transport. */
static uint16_t identity_expert(const int32_t *src, int64_t h, float value) {
    uint64_t s = ((uint64_t)(uint32_t)src[0] << 40) ^ ((uint64_t)(uint32_t)src[1] << 16) ^ (uint64_t)(uint32_t)src[2];
    s ^= (uint64_t)h * 0x9e3779b97f4a7c15ull;
    uint64_t v = splitmix64(&s);
    return mf_bf16_from_float(value * 0.5f + (float)((int64_t)(v % 2001) - 1000) / 256.0f);
}

/* The receive tensors of one rank (host copies for the identity expert and the digest). */
typedef struct recv_bufs {
    int64_t L;           /* the rank's segments (mf_moe_info_t.num_local_slots) */
    int64_t rows, cap;   /* rows of recv_x; MASKED capacity per expert (0 for EXPERT_MAJOR) */
    void *x, *scales, *src, *counts, *offsets, *eo; /* backend memory */
    uint8_t *hx;         /* host copies */
    float *hscales;
    int32_t *hsrc, *hcounts, *hoffsets;
    uint16_t *heo;
} recv_bufs_t;

/* Host side of DISPATCH_COMBINE with digests: the digest of the dispatch outputs and the identity
 * expert's outputs of every real row (copied to the backend's eo when that is not host memory). */
static uint64_t identity_step(const mfp_problem_t *p, int32_t layout, recv_bufs_t *b) {
    const mfp_spec_t *s = &p->spec;
    const int64_t H = s->H, L = b->L, nsc = H / MFP_QBLOCK;
    const int fp8 = s->dtype == MF_DTYPE_FP8_E4M3;
    const size_t esz = fp8 ? 1 : 2;
    uint64_t d = fnv1a(FNV_OFFSET, b->hcounts, (size_t)L * 4);
    if (layout == MF_LAYOUT_EXPERT_MAJOR) d = fnv1a(d, b->hoffsets, (size_t)(L + 1) * 4);
    for (int64_t e = 0; e < L; e++) {
        const int64_t row0 = layout == MF_LAYOUT_MASKED ? e * b->cap : b->hoffsets[e];
        for (int64_t j = 0; j < b->hcounts[e]; j++) {
            const int64_t row = row0 + j;
            const int32_t *src = b->hsrc + 3 * row;
            const uint8_t *x = b->hx + row * H * esz;
            d = fnv1a(d, src, 12);
            d = fnv1a(d, x, (size_t)H * esz);
            if (fp8) d = fnv1a(d, b->hscales + row * nsc, (size_t)nsc * 4);
            for (int64_t h = 0; h < H; h++) {
                float v = fp8 ? mf_fp8_e4m3_to_float(x[h]) * b->hscales[row * nsc + h / MFP_QBLOCK]
                              : mf_bf16_to_float(((const uint16_t *)x)[h]);
                b->heo[row * H + h] = identity_expert(src, h, v);
            }
        }
    }
    return d;
}

/* ---- NCCL, resolved at run time (the library does not link it, nor does the CLI) ------------- */
#if MF_WITH_CUDA
typedef struct nccl_id { uint8_t internal[MFP_NCCL_ID_BYTES]; } nccl_id_t; /* ncclUniqueId's layout */
typedef struct nccl_api {
    int (*get_unique_id)(nccl_id_t *id);
    int (*comm_init_rank)(void **comm, int nranks, nccl_id_t id, int rank);
    int (*comm_destroy)(void *comm);
    int (*comm_abort)(void *comm);
    const char *(*get_error_string)(int result);
} nccl_api_t;

/* Opens libnccl.so.2 (global, so that the library's own dlsym finds the same NCCL); 0 ok. */
static int nccl_open(nccl_api_t *api, char *why, size_t n) {
    void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        snprintf(why, n, "dlopen libnccl.so.2: %s", dlerror());
        return -1;
    }
    *(void **)&api->get_unique_id = dlsym(lib, "ncclGetUniqueId");
    *(void **)&api->comm_init_rank = dlsym(lib, "ncclCommInitRank");
    *(void **)&api->comm_destroy = dlsym(lib, "ncclCommDestroy");
    *(void **)&api->comm_abort = dlsym(lib, "ncclCommAbort");
    *(void **)&api->get_error_string = dlsym(lib, "ncclGetErrorString");
    if (!api->get_unique_id || !api->comm_init_rank || !api->comm_destroy || !api->comm_abort ||
        !api->get_error_string) {
        snprintf(why, n, "libnccl.so.2 lacks one of ncclGetUniqueId, ncclCommInitRank, ncclCommDestroy, "
                         "ncclCommAbort, ncclGetErrorString");
        return -1;
    }
    return 0;
}
#endif

#if MF_WITH_CUDA
/* opts->gated: a host function at the head of the rank's stream that holds the stream until the
 * rank's thread has enqueued its whole forward (it runs on the CUDA runtime's callback thread and
 * calls no CUDA API). */
static void CUDART_CB gate_hold(void *arg) {
    atomic_int *open = (atomic_int *)arg;
    while (!atomic_load_explicit(open, memory_order_acquire)) sched_yield();
}

/* Allocates bytes (at least MFP_MIN_ALLOC) of device memory at *dst and copies src there if set. */
static cudaError_t to_device(void **dst, const void *src, size_t bytes, cudaStream_t st) {
    cudaError_t e = cudaMalloc(dst, bytes > MFP_MIN_ALLOC ? bytes : MFP_MIN_ALLOC);
    if (e == cudaSuccess && src && bytes)
        e = cudaMemcpyAsync(*dst, src, bytes, cudaMemcpyHostToDevice, st);
    return e;
}
#endif

/* Backend memory of `bytes` (at least MFP_MIN_ALLOC): device memory on CUDA, host on the CPU. */
static void *backend_alloc(int on_device, size_t bytes) {
    bytes = bytes > MFP_MIN_ALLOC ? bytes : MFP_MIN_ALLOC;
#if MF_WITH_CUDA
    if (on_device) { /* zeroed, as calloc: a combine of the fixed buffer reads zeros */
        void *d = NULL;
        if (cudaMalloc(&d, bytes) != cudaSuccess) return NULL;
        if (cudaMemset(d, 0, bytes) != cudaSuccess || cudaStreamSynchronize(cudaStreamLegacy) != cudaSuccess) {
            cudaFree(d);
            return NULL;
        }
        return d;
    }
#endif
    (void)on_device;
    return calloc(1, bytes);
}

static void backend_free(int on_device, void *ptr) {
#if MF_WITH_CUDA
    if (on_device) {
        cudaFree(ptr);
        return;
    }
#endif
    (void)on_device;
    free(ptr);
}

/* Copies between backend and host memory (a plain memcpy on the CPU); 0 ok. */
static int backend_copy(int on_device, void *dst, const void *src, size_t bytes, int to_host) {
    if (!bytes || dst == src) return 0;
#if MF_WITH_CUDA
    /* cudaMemcpy from pageable memory may return before its DMA reaches the device, and the
     * ranks' streams do not wait for the legacy stream: wait for it here (never the whole device:
     * virtual ranks' kernels may be waiting on this rank) */
    if (on_device)
        return cudaMemcpy(dst, src, bytes, to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice) == cudaSuccess &&
                       cudaStreamSynchronize(cudaStreamLegacy) == cudaSuccess
                   ? 0 : -1;
#endif
    (void)on_device, (void)to_host;
    memcpy(dst, src, bytes);
    return 0;
}

/* Fills backend memory with 0xA5 bytes (0 ok). */
static int backend_poison(int on_device, void *ptr, size_t bytes) {
#if MF_WITH_CUDA
    if (on_device)
        return cudaMemset(ptr, 0xA5, bytes) == cudaSuccess && cudaStreamSynchronize(cudaStreamLegacy) == cudaSuccess
                   ? 0 : -1;
#endif
    (void)on_device;
    memset(ptr, 0xA5, bytes);
    return 0;
}

/* stage_map: this rank's next_weights [L, ...] (backend memory) hold, byte for byte, the problem's
 * experts of stage_map, and the layer switched to it. 0 ok; else the run failed naming the slot. */
static int check_next_weights(run_state_t *run, int32_t r, mf_moe_t moe, void *const next[4], size_t L) {
    const mfp_problem_t *p = run->p;
    size_t per[4];
    expert_bytes(&p->spec, per);
    static const char *const names[4] = {"w13", "w2", "w13_scales", "w2_scales"};
    mf_moe_balance_stats_t bs = {.size = sizeof bs};
    mf_result_t res = mf_moe_get_balance_stats(moe, &bs);
    if (res != MF_SUCCESS) {
        fail(run, r, res, "mf_moe_get_balance_stats", mf_last_error());
        return -1;
    }
    if (bs.map_switches != 1 || bs.stage_steps_left != 0) {
        char msg[128];
        snprintf(msg, sizeof msg, "%d switches, %d steps left after the run (want 1, 0)", (int)bs.map_switches,
                 (int)bs.stage_steps_left);
        fail(run, r, MF_ERR_INTERNAL, "the staged map", msg);
        return -1;
    }
    for (int i = 0; i < 4; i++) {
        if (!per[i]) continue;
        uint8_t *h = malloc(L * per[i]);
        if (!h || backend_copy(run->backend == MF_BACKEND_CUDA, h, next[i], L * per[i], 1) != 0) {
            free(h);
            fail(run, r, MF_ERR_CUDA, "next_weights", "copying them to the host failed");
            return -1;
        }
        for (size_t l = 0; l < L; l++) {
            const int32_t e = run->opts->stage_map[(size_t)r * L + l];
            uint8_t *w[4];
            expert_ptrs(p, e, w);
            const uint8_t *src = w[i];
            if (memcmp(h + l * per[i], src, per[i]) != 0) {
                size_t b = 0;
                while (h[l * per[i] + b] == src[b]) b++;
                char msg[160];
                snprintf(msg, sizeof msg, "slot %zu (expert %d): %s differs from the expert at byte %zu (0x%02x, want "
                         "0x%02x)", l, (int)e, names[i], b, h[l * per[i] + b], src[b]);
                free(h);
                fail(run, r, MF_ERR_INTERNAL, "next_weights", msg);
                return -1;
            }
        }
        free(h);
    }
    return 0;
}

/* ---- one rank: its steps, in order (rank_main) ------------------------------------------------ */

/* Everything one rank holds while it runs: its inputs and weights, its comm and layer, the tensors of
 * its calls and, on CUDA, its stream, events and graph. Each step below fills or uses a part of it;
 * a step that fails has called fail() and returns -1, and rank_release frees whatever was made. */
typedef struct rank_ctx {
    run_state_t *run;
    const mfp_problem_t *p;
    const mfp_spec_t *s;
    const mfp_run_opts_t *o;
    int32_t r, T, fp8, procs, comm_op, split, total;
    size_t H, I, K, esize, nsc, P, L;
    int on_device;
    /* host or device addresses of: x, ids, topk weights, y, w13, w2, w13 scales, w2 scales */
    const void *host[8];
    size_t bytes[8];
    void *mem[8];
    void *phys[4];                                      /* mapped or placed weights, laid out on the host */
    void *next[4];                                      /* stage_map: next_weights */
    uint16_t y_dummy[MFP_MIN_ALLOC / sizeof(uint16_t)]; /* a y for T = 0 when the caller has none */
    mf_stream_t stream;
    mf_comm_t comm;
    mf_moe_t moe;
    mf_moe_weights_t w, nw; /* the layer's weights; a staged map's (the run's buffers, poisoned) */
    int staging;            /* a stage is in flight (its prefetch steps are counted) */
    recv_bufs_t rb;
    mf_moe_forward_in_t in;
    mf_moe_forward_out_t out;
    mf_dispatch_in_t din;
    mf_dispatch_out_t dout;
    mf_combine_in_t cin;
    mf_combine_out_t cout;
    /* redraw: this rank's inputs of the iteration, drawn on the host */
    uint16_t *rx_host;
    int32_t *rids_host;
    float *rw_host;
#if MF_WITH_CUDA
    cudaStream_t cst;
    cudaEvent_t ev[4]; /* DISPATCH_COMBINE with profile: around each call */
    cudaGraph_t graph;
    cudaGraphExec_t graph_exec;
    nccl_api_t nccl;
    void *nccl_comm;
    int32_t device;
    int gate_always;
    atomic_int gate_open;
#endif
} rank_ctx_t;

/* The rank's constants and host addresses; with an expert map, this rank's slots hold the map's
 * logical experts; with another placement than LINEAR, the placement's: copied from the LINEAR
 * ranks that hold them in the problem. 0 ok. */
static int rank_lay_out_weights(rank_ctx_t *c, run_state_t *run, int32_t r) {
    memset(c, 0, sizeof *c);
    const mfp_problem_t *p = run->p;
    const mfp_spec_t *s = &p->spec;
    const mfp_run_opts_t *o = run->opts;
    c->run = run, c->p = p, c->s = s, c->o = o, c->r = r;
    c->T = p->T[r], c->fp8 = s->dtype == MF_DTYPE_FP8_E4M3;
    c->procs = !run->group, c->comm_op = o->op != MFP_OP_FORWARD, c->split = o->op == MFP_OP_SPLIT;
    c->total = o->warmup + o->iters;
    c->H = (size_t)s->H, c->I = (size_t)s->I, c->K = (size_t)s->K;
    c->esize = c->fp8 ? 1 : 2, c->nsc = (2 * c->I / MFP_QBLOCK) * (c->H / MFP_QBLOCK);
    const void *host[8] = {p->x[r], p->topk_ids[r], p->topk_weights[r], run->y[r],
                           p->w13[r], p->w2[r], p->w13_scales[r], p->w2_scales[r]};
    memcpy(c->host, host, sizeof host);
    c->P = o->num_physical ? (size_t)o->num_physical : (size_t)s->E;
    c->L = o->expert_map ? c->P / (size_t)s->R : (size_t)mfp_rank_experts(s, s->placement, r);
    if (o->expert_map || s->placement != MF_PLACEMENT_LINEAR) {
        size_t per[4];
        expert_bytes(s, per);
        for (int i = 0; i < 4; i++) {
            if (!per[i]) continue;
            c->phys[i] = malloc(c->L * per[i]);
            if (!c->phys[i]) {
                fail(run, r, MF_ERR_OUT_OF_MEMORY, "laying out the mapped weights", "out of host memory");
                for (int j = 0; j < 4; j++) free(c->phys[j]);
                return -1;
            }
            for (size_t l = 0; l < c->L; l++) {
                const int32_t e = o->expert_map ? o->expert_map[(size_t)r * c->L + l]
                                                : mfp_rank_expert(s, s->placement, r, (int32_t)l);
                uint8_t *w[4];
                expert_ptrs(p, e, w);
                memcpy((uint8_t *)c->phys[i] + l * per[i], w[i], per[i]);
            }
            c->host[4 + i] = c->phys[i];
        }
    }
    const size_t T = (size_t)c->T, H = c->H, I = c->I, K = c->K, L = c->L, esize = c->esize, nsc = c->nsc;
    const size_t bytes[8] = {T * H * 2, T * K * 4, T * K * 4, T * H * 2, L * 2 * I * H * esize,
                             L * H * I * esize, c->fp8 ? L * nsc * 4 : 0, c->fp8 ? L * nsc / 2 * 4 : 0};
    memcpy(c->bytes, bytes, sizeof bytes);
    if (!c->host[3]) c->host[3] = c->y_dummy;
    for (int i = 0; i < 8; i++) c->mem[i] = (void *)c->host[i];
    c->on_device = run->backend == MF_BACKEND_CUDA;
    return 0;
}

/* CUDA: the rank's device, stream and events, and its inputs and weights copied to the device
 * (y allocated only). 0 ok. */
static int rank_upload(rank_ctx_t *c) {
#if MF_WITH_CUDA
    const mfp_run_opts_t *o = c->o;
    if (c->on_device) {
        int n = 0;
        cudaError_t ce = cudaSuccess;
        if (c->procs) { /* one GPU per rank where there are R; else they share round robin */
            ce = cudaGetDeviceCount(&n);
            c->device = ce == cudaSuccess && n > 0 ? c->r % n : 0;
        }
        if (ce == cudaSuccess) ce = cudaSetDevice(c->device);
        if (ce == cudaSuccess) ce = cudaStreamCreateWithFlags(&c->cst, cudaStreamNonBlocking);
        for (int i = 0; i < 8; i++) c->mem[i] = NULL;
        for (int i = 0; i < 8 && ce == cudaSuccess; i++) /* y (3) is only allocated */
            if (c->host[i]) ce = to_device(&c->mem[i], i == 3 ? NULL : c->host[i], c->bytes[i], c->cst);
        for (int i = 0; i < 4 && ce == cudaSuccess && c->comm_op && o->profile; i++) ce = cudaEventCreate(&c->ev[i]);
        if (ce == cudaSuccess && !c->comm_op && o->profile && o->no_phases) ce = cudaEventCreate(&c->ev[3]); /* the end */
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(c->cst);
        c->stream = (mf_stream_t)c->cst;
        if (ce != cudaSuccess) {
            fail(c->run, c->r, MF_ERR_CUDA, "copying the inputs to the device", cudaGetErrorString(ce));
            return -1;
        }
    }
#else
    (void)c;
#endif
    return 0;
}

/* redraw: the host buffers the iteration's inputs are drawn into (on the CPU, the call's own). */
static int rank_alloc_redraw(rank_ctx_t *c) {
    if (!c->o->redraw) return 0;
    c->rx_host = malloc(c->bytes[0] + MFP_MIN_ALLOC);
    c->rids_host = malloc(c->bytes[1] + MFP_MIN_ALLOC);
    c->rw_host = malloc(c->bytes[2] + MFP_MIN_ALLOC);
    if (!c->rx_host || !c->rids_host || !c->rw_host) {
        fail(c->run, c->r, MF_ERR_OUT_OF_MEMORY, "redraw", "out of host memory");
        return -1;
    }
    if (!c->on_device) c->mem[0] = c->rx_host, c->mem[1] = c->rids_host, c->mem[2] = c->rw_host;
    return 0;
}

#if MF_WITH_CUDA
/* NCCL transport: rank 0 draws the unique id and hands it over in shared memory (the barrier);
 * every rank makes its ncclComm, which the comm borrows (its allgather is the bootstrap). 0 ok. */
static int rank_nccl_comm(rank_ctx_t *c) {
    run_state_t *run = c->run;
    const int32_t r = c->r;
    char why[256];
    nccl_id_t id;
    int nr = 0;
    if (nccl_open(&c->nccl, why, sizeof why) != 0) {
        fail(run, r, MF_ERR_NOT_SUPPORTED, "nccl transport", why);
        return -1;
    }
    if (r == 0 && (nr = c->nccl.get_unique_id(&id)) != 0) {
        fail(run, r, MF_ERR_NCCL, "ncclGetUniqueId", c->nccl.get_error_string(nr));
        return -1;
    }
    if (r == 0) memcpy(run->nccl_id, id.internal, sizeof id.internal);
    if (mfp_barrier_wait(&run->barrier) != 0) return -1;
    memcpy(id.internal, run->nccl_id, sizeof id.internal);
    if ((nr = c->nccl.comm_init_rank(&c->nccl_comm, c->s->R, id, r)) != 0) {
        c->nccl_comm = NULL;
        fail(run, r, MF_ERR_NCCL, "ncclCommInitRank", c->nccl.get_error_string(nr));
        return -1;
    }
    return 0;
}
#endif

/* The rank's comm: the group's (threads), or its own through the rendezvous or an ncclComm
 * (processes). 0 ok. */
static int rank_join_comm(rank_ctx_t *c) {
    run_state_t *run = c->run;
    const mfp_run_opts_t *o = c->o;
    const int32_t r = c->r, R = c->s->R;
    mf_result_t res;
    if (run->group) {
        if ((res = mf_group_get_comm(run->group, r, &c->comm)) != MF_SUCCESS) {
            fail(run, r, res, "mf_group_get_comm", mf_last_error());
            return -1;
        }
        return 0;
    }
    mf_bootstrap_t boot;
    mf_comm_config_t cc = MF_COMM_CONFIG_INIT;
    const mf_bootstrap_t *bp = &boot;
    cc.backend = run->backend;
    cc.transport = o->transport;
    cc.timeout_ms = o->timeout_ms;
#if MF_WITH_CUDA
    cc.device = c->device;
    if (o->transport == MF_TRANSPORT_NCCL) {
        if (rank_nccl_comm(c) != 0) return -1;
        cc.nccl_comm = c->nccl_comm;
        bp = NULL; /* the ncclComm's allgather is the bootstrap */
    }
#endif
    if (bp && (res = mf_rendezvous_bootstrap(run->address, r, R, o->timeout_ms, &boot)) != MF_SUCCESS) {
        fail(run, r, res, "mf_rendezvous_bootstrap", mf_last_error());
        return -1;
    }
    if ((res = mf_comm_init(&cc, r, R, bp, &c->comm)) != MF_SUCCESS) {
        c->comm = NULL;
        fail(run, r, res, "mf_comm_init", mf_last_error());
        return -1;
    }
    return 0;
}

/* The rank's layer: created from the problem and the run's options, its expert map and weights set,
 * and with stage_map the poisoned buffers its staged map's weights go to. 0 ok. */
static int rank_create_layer(rank_ctx_t *c) {
    run_state_t *run = c->run;
    const mfp_spec_t *s = c->s;
    const mfp_run_opts_t *o = c->o;
    const int32_t r = c->r;
    const int64_t L = (int64_t)c->L, H = (int64_t)c->H, I = (int64_t)c->I;
    mf_result_t res;
    mf_moe_config_t cfg = MF_MOE_CONFIG_INIT;
    cfg.num_experts = s->E;
    cfg.num_topk = s->K;
    cfg.hidden = s->H;
    cfg.intermediate = s->I;
    cfg.max_tokens_per_rank = o->max_tokens > 0 ? o->max_tokens : s->S;
    cfg.dtype = s->dtype;
    cfg.layout = s->layout;
    cfg.block_m = s->block_m;
    cfg.expert_capacity = s->expert_capacity;
    cfg.max_recv_rows = s->max_recv_rows;
    cfg.ue8m0_scales = s->ue8m0;
    cfg.profile = o->profile && !c->comm_op && !o->no_phases;
    cfg.dataflow = o->dataflow;
    cfg.num_physical_experts = o->num_physical;
    cfg.spare_slots = o->spare_slots;
    cfg.placement = s->placement;
    if ((res = mf_moe_create(c->comm, &cfg, &c->moe)) != MF_SUCCESS) {
        fail(run, r, res, "mf_moe_create", mf_last_error());
        return -1;
    }
    if (o->expert_map && (res = mf_moe_set_expert_map(c->moe, o->expert_map, (int32_t)c->P)) != MF_SUCCESS) {
        fail(run, r, res, "mf_moe_set_expert_map", mf_last_error());
        return -1;
    }
    const int32_t wdt = s->dtype;
    c->w = (mf_moe_weights_t){
        .w13 = {c->mem[4], wdt, 3, {L, 2 * I, H}},
        .w2 = {c->mem[5], wdt, 3, {L, H, I}},
    };
    if (c->fp8) {
        c->w.w13_scales = (mf_tensor_t){c->mem[6], MF_DTYPE_FP32, 3, {L, 2 * I / MFP_QBLOCK, H / MFP_QBLOCK}};
        c->w.w2_scales = (mf_tensor_t){c->mem[7], MF_DTYPE_FP32, 3, {L, H / MFP_QBLOCK, I / MFP_QBLOCK}};
    }
    if ((res = mf_moe_set_weights(c->moe, &c->w)) != MF_SUCCESS) {
        fail(run, r, res, "mf_moe_set_weights", mf_last_error());
        return -1;
    }
    /* A staged map's weights: the run's buffers, poisoned, that moeflow fills. */
    c->nw = c->w;
    c->staging = 0;
    if (o->stage_map) {
        for (int i = 0; i < 4; i++) {
            if (!c->bytes[4 + i]) continue;
            c->next[i] = backend_alloc(c->on_device, c->bytes[4 + i]);
            if (!c->next[i] || backend_poison(c->on_device, c->next[i], c->bytes[4 + i]) != 0) {
                fail(run, r, MF_ERR_OUT_OF_MEMORY, "next_weights", "out of memory");
                return -1;
            }
        }
        c->nw.w13.data = c->next[0], c->nw.w2.data = c->next[1];
        if (c->fp8) c->nw.w13_scales.data = c->next[2], c->nw.w2_scales.data = c->next[3];
    }
    return 0;
}

/* The tensors of the rank's calls: the forward's, and with a comm op the receive tensors of
 * dispatch and combine, sized by the layer (mf_moe_get_info), with host copies for digests. 0 ok. */
static int rank_bind_tensors(rank_ctx_t *c) {
    run_state_t *run = c->run;
    const mfp_spec_t *s = c->s;
    const int32_t r = c->r, wdt = s->dtype;
    const int64_t T = c->T;
    const size_t H = c->H, L = c->L, esize = c->esize;
    recv_bufs_t *rb = &c->rb;
    mf_result_t res;
    c->in = (mf_moe_forward_in_t){
        .x = {c->mem[0], MF_DTYPE_BF16, 2, {T, (int64_t)H}},
        .topk_ids = {c->mem[1], MF_DTYPE_INT32, 2, {T, (int64_t)c->K}},
        .topk_weights = {c->mem[2], MF_DTYPE_FP32, 2, {T, (int64_t)c->K}},
    };
    c->out = (mf_moe_forward_out_t){.y = {c->mem[3], MF_DTYPE_BF16, 2, {T, (int64_t)H}}};
    c->din = (mf_dispatch_in_t){c->in.x, c->in.topk_ids};
    c->cout = (mf_combine_out_t){c->out.y};
    memset(&c->dout, 0, sizeof c->dout);
    memset(&c->cin, 0, sizeof c->cin);
    if (!c->comm_op) return 0;
    mf_moe_info_t info;
    if ((res = mf_moe_get_info(c->moe, &info)) != MF_SUCCESS) {
        fail(run, r, res, "mf_moe_get_info", mf_last_error());
        return -1;
    }
    const int masked = s->layout == MF_LAYOUT_MASKED;
    const int64_t Lq = (int64_t)L, Hq = (int64_t)H, nq = Hq / MFP_QBLOCK;
    if (info.num_local_slots != (int32_t)L) {
        char msg[96];
        snprintf(msg, sizeof msg, "num_local_slots %d, the run laid out %zu slots", (int)info.num_local_slots, L);
        fail(run, r, MF_ERR_INTERNAL, "mf_moe_get_info", msg);
        return -1;
    }
    rb->L = Lq;
    rb->cap = masked ? info.expert_capacity : 0;
    rb->rows = masked ? Lq * info.expert_capacity : info.max_recv_rows;
    const size_t rows = (size_t)rb->rows;
    rb->x = backend_alloc(c->on_device, rows * H * esize);
    rb->scales = backend_alloc(c->on_device, rows * (size_t)nq * 4);
    rb->src = backend_alloc(c->on_device, rows * 12);
    rb->counts = backend_alloc(c->on_device, L * 4);
    rb->offsets = backend_alloc(c->on_device, (L + 1) * 4);
    rb->eo = backend_alloc(c->on_device, rows * H * 2);
    if (!rb->x || !rb->scales || !rb->src || !rb->counts || !rb->offsets || !rb->eo) {
        fail(run, r, MF_ERR_OUT_OF_MEMORY, "receive tensors", "out of memory");
        return -1;
    }
    if (c->o->digests) {
        rb->hx = malloc(rows * H * esize + 1), rb->hscales = malloc(rows * (size_t)nq * 4 + 4);
        rb->hsrc = malloc(rows * 12 + 4), rb->hcounts = malloc(L * 4 + 4), rb->hoffsets = malloc((L + 1) * 4);
        rb->heo = calloc(rows * H + 1, 2);
        if (!rb->hx || !rb->hscales || !rb->hsrc || !rb->hcounts || !rb->hoffsets || !rb->heo) {
            fail(run, r, MF_ERR_OUT_OF_MEMORY, "receive tensors", "out of host memory");
            return -1;
        }
    }
    mf_dispatch_out_t *dout = &c->dout;
    if (masked) {
        dout->recv_x = (mf_tensor_t){rb->x, wdt, 3, {Lq, rb->cap, Hq}};
        if (c->fp8) dout->recv_scales = (mf_tensor_t){rb->scales, MF_DTYPE_FP32, 3, {Lq, rb->cap, nq}};
        dout->recv_src = (mf_tensor_t){rb->src, MF_DTYPE_INT32, 3, {Lq, rb->cap, 3}};
        c->cin.expert_out = (mf_tensor_t){rb->eo, MF_DTYPE_BF16, 3, {Lq, rb->cap, Hq}};
    } else {
        dout->recv_x = (mf_tensor_t){rb->x, wdt, 2, {rb->rows, Hq}};
        if (c->fp8) dout->recv_scales = (mf_tensor_t){rb->scales, MF_DTYPE_FP32, 2, {rb->rows, nq}};
        dout->recv_src = (mf_tensor_t){rb->src, MF_DTYPE_INT32, 2, {rb->rows, 3}};
        dout->expert_offsets = (mf_tensor_t){rb->offsets, MF_DTYPE_INT32, 1, {Lq + 1}};
        c->cin.expert_out = (mf_tensor_t){rb->eo, MF_DTYPE_BF16, 2, {rb->rows, Hq}};
    }
    dout->expert_counts = (mf_tensor_t){rb->counts, MF_DTYPE_INT32, 1, {Lq}};
    c->cin.topk_weights = c->in.topk_weights;
    return 0;
}

/* opts->graph on CUDA: the forward captured once, before any rank's first collective, then
 * instantiated and uploaded. 0 ok. */
static int rank_capture_graph(rank_ctx_t *c) {
#if MF_WITH_CUDA
    if (c->on_device && c->o->graph) {
        cudaError_t ce = cudaStreamBeginCapture(c->cst, cudaStreamCaptureModeThreadLocal);
        if (ce != cudaSuccess) {
            fail(c->run, c->r, MF_ERR_CUDA, "cudaStreamBeginCapture", cudaGetErrorString(ce));
            return -1;
        }
        mf_result_t res = mf_moe_forward(c->moe, &c->in, &c->out, c->stream);
        ce = cudaStreamEndCapture(c->cst, &c->graph);
        if (res != MF_SUCCESS) {
            fail(c->run, c->r, res, "mf_moe_forward (captured)", mf_last_error());
            return -1;
        }
        if (ce == cudaSuccess) ce = cudaGraphInstantiate(&c->graph_exec, c->graph, 0);
        if (ce == cudaSuccess) ce = cudaGraphUpload(c->graph_exec, c->cst);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(c->cst);
        if (ce != cudaSuccess) {
            fail(c->run, c->r, MF_ERR_CUDA, "capturing the forward", cudaGetErrorString(ce));
            return -1;
        }
    }
#else
    (void)c;
#endif
    return 0;
}

/* redraw: iteration it's inputs, into the tensors the calls (or the graph) use. 0 ok. */
static int rank_redraw_inputs(rank_ctx_t *c, int32_t it) {
    if (!c->o->redraw) return 0;
    if (mfp_draw_rank_inputs(c->p, c->r, c->o->redraw_seed + (uint64_t)it, c->rx_host, c->rids_host, c->rw_host) != 0 ||
        (c->on_device && (backend_copy(1, c->mem[0], c->rx_host, c->bytes[0], 0) != 0 ||
                          backend_copy(1, c->mem[1], c->rids_host, c->bytes[1], 0) != 0 ||
                          backend_copy(1, c->mem[2], c->rw_host, c->bytes[2], 0) != 0))) {
        fail(c->run, c->r, MF_ERR_CUDA, "redraw", "drawing or uploading the iteration's inputs failed");
        return -1;
    }
    return 0;
}

/* stage_map at stage_at: the map staged; prefetch after the first iteration: mf_moe_prefetch
 * between two forwards, as an engine would during attention, with rank 0 counting its bytes, time
 * and the stage's steps. 0 ok. */
static int rank_stage_and_prefetch(rank_ctx_t *c, int32_t it) {
    run_state_t *run = c->run;
    const mfp_run_opts_t *o = c->o;
    const int32_t r = c->r;
    mf_result_t res;
    if (o->stage_map && it == o->stage_at &&
        (res = mf_moe_stage_expert_map(c->moe, o->stage_map, (int32_t)c->P, &c->nw, o->stage_per_step)) != MF_SUCCESS) {
        fail(run, r, res, "mf_moe_stage_expert_map", mf_last_error());
        return -1;
    }
    if (o->stage_map && it == o->stage_at) c->staging = 1;
    if (!o->prefetch || it == 0) return 0;
    double tp = now_s();
    if ((res = mf_moe_prefetch(c->moe, c->stream)) != MF_SUCCESS) {
        fail(run, r, res, "mf_moe_prefetch", mf_last_error());
        return -1;
    }
#if MF_WITH_CUDA
    if (c->on_device && cudaStreamSynchronize(c->cst) != cudaSuccess) {
        fail(run, r, MF_ERR_CUDA, "cudaStreamSynchronize after mf_moe_prefetch", "");
        return -1;
    }
#endif
    mf_moe_balance_stats_t bs = {.size = sizeof bs};
    if (r == 0 && mf_moe_get_balance_stats(c->moe, &bs) == MF_SUCCESS) {
        if (run->prefetch_n == 0) run->prefetch_first_bytes = bs.prefetch_bytes_all;
        run->prefetch_last_bytes = bs.prefetch_bytes_all;
        run->prefetch_ms_sum += (now_s() - tp) * 1e3;
        run->prefetch_n++;
        if (c->staging) { /* this prefetch made a step of the stage */
            c->staging = bs.stage_steps_left > 0;
            run->stage_steps++;
            run->stage_prefetch_ms_sum += (now_s() - tp) * 1e3;
            run->stage_bytes_total += bs.stage_bytes_all;
            if (bs.stage_bytes_all > run->stage_step_bytes_max) run->stage_step_bytes_max = bs.stage_bytes_all;
        }
        const int32_t jt = it - o->warmup;
        if (jt >= 0 && jt < MFP_STAGE_ITERS) run->staged_iter[jt] = bs.stage_steps_left > 0;
    }
    return 0;
}

/* With digests, between dispatch and combine: the dispatch outputs copied to the host, their digest
 * (*digest) and the identity expert's outputs uploaded as the combine's input. 0 ok (*res holds the
 * comm's async error, if any). */
static int rank_identity_expert(rank_ctx_t *c, mf_result_t *res, uint64_t *digest) {
    run_state_t *run = c->run;
    const int32_t r = c->r;
    const int on_device = c->on_device;
    recv_bufs_t *rb = &c->rb;
    const size_t rows = (size_t)rb->rows, H = c->H, L = c->L, nq = H / MFP_QBLOCK;
#if MF_WITH_CUDA
    cudaError_t ce = on_device ? cudaStreamSynchronize(c->cst) : cudaSuccess;
    if (ce == cudaSuccess && on_device) *res = mf_comm_get_async_error(c->comm);
    if (ce != cudaSuccess) {
        fail(run, r, MF_ERR_CUDA, "cudaStreamSynchronize after mf_dispatch", cudaGetErrorString(ce));
        return -1;
    }
#endif
    if (*res == MF_SUCCESS &&
        (backend_copy(on_device, rb->hcounts, rb->counts, L * 4, 1) != 0 ||
         backend_copy(on_device, rb->hoffsets, rb->offsets, (L + 1) * 4, 1) != 0 ||
         backend_copy(on_device, rb->hsrc, rb->src, rows * 12, 1) != 0 ||
         backend_copy(on_device, rb->hx, rb->x, rows * H * c->esize, 1) != 0 ||
         (c->fp8 && backend_copy(on_device, rb->hscales, rb->scales, rows * nq * 4, 1) != 0))) {
        fail(run, r, MF_ERR_CUDA, "copying the dispatch outputs", "copy failed");
        return -1;
    }
    if (*res == MF_SUCCESS) {
        *digest = identity_step(c->p, c->s->layout, rb);
        if (backend_copy(on_device, rb->eo, rb->heo, rows * H * 2, 0) != 0) {
            fail(run, r, MF_ERR_CUDA, "uploading the expert outputs", "copy failed");
            return -1;
        }
    }
    return 0;
}

#if MF_WITH_CUDA
static void rank_record(const rank_ctx_t *c, int i) {
    if (c->ev[i]) cudaEventRecord(c->ev[i], c->cst);
}
#endif

/* A comm op: dispatch; with split, the experts; with digests, the host's identity expert between the
 * calls; combine. Each call's wall time in *t_disp / *t_comb, the failing call's name in *call.
 * Returns the calls' result; -1 in *failed where the run has failed already. */
static mf_result_t rank_comm_op(rank_ctx_t *c, const char **call, double *t_disp, double *t_comb, uint64_t *digest,
                                int *failed) {
    mf_result_t res;
    *call = "mf_dispatch";
#if MF_WITH_CUDA
    rank_record(c, 0);
#endif
    double c0 = now_s();
    res = mf_dispatch(c->moe, &c->din, &c->dout, c->stream);
#if MF_WITH_CUDA
    rank_record(c, 1);
#endif
    *t_disp = now_s() - c0;
    if (res == MF_SUCCESS && c->split) {
        *call = "mf_moe_experts";
        const mf_experts_in_t ein = {c->dout.recv_x, c->dout.recv_scales, c->dout.expert_counts};
        const mf_experts_out_t eout = {c->cin.expert_out};
        res = mf_moe_experts(c->moe, &ein, &eout, c->stream);
    }
    if (res == MF_SUCCESS && c->o->digests && rank_identity_expert(c, &res, digest) != 0) {
        *failed = -1;
        return res;
    }
    if (res == MF_SUCCESS) {
        *call = "mf_combine";
#if MF_WITH_CUDA
        rank_record(c, 2);
#endif
        c0 = now_s();
        res = mf_combine(c->moe, &c->cin, &c->cout, c->stream);
        *t_comb = now_s() - c0;
#if MF_WITH_CUDA
        rank_record(c, 3);
#endif
    }
    return res;
}

/* Iteration j >= 0 (timed): its wall time (t0 to t1) and, with profile, its phases: the layer's
 * phase times, the begin -> end events without phases, or the comm op's two calls. 0 ok. */
static int rank_record_times(rank_ctx_t *c, int32_t j, double t0, double t1, double t_disp, double t_comb) {
    run_state_t *run = c->run;
    const mfp_run_opts_t *o = c->o;
    const int32_t r = c->r;
    mf_result_t res;
    run->times[(size_t)r * o->iters + j] = (t1 - t0) * 1e3;
    mf_phase_times_t *ph = &run->phases[(size_t)r * o->iters + j];
    if (o->profile && !c->comm_op && !o->no_phases && (res = mf_moe_get_phase_times(c->moe, ph)) != MF_SUCCESS) {
        fail(run, r, res, "mf_moe_get_phase_times", mf_last_error());
        return -1;
    }
    if (o->profile && !c->comm_op && o->no_phases) { /* begin -> end on the device, nothing between */
        memset(ph, 0, sizeof *ph);
#if MF_WITH_CUDA
        float ms = 0;
        if (c->on_device && (!run->begins || cudaEventElapsedTime(&ms, run->begins[(size_t)r * o->iters + j], c->ev[3]) !=
                                                 cudaSuccess)) {
            fail(run, r, MF_ERR_CUDA, "reading the begin / end events", "cudaEventElapsedTime failed");
            return -1;
        }
        ph->total_us = ms * 1e3;
#endif
    }
    if (o->profile && c->comm_op) { /* device events on CUDA, wall clock on the CPU */
        memset(ph, 0, sizeof *ph);
        ph->us[MF_PHASE_DISPATCH] = t_disp * 1e6;
        ph->us[MF_PHASE_COMBINE] = t_comb * 1e6;
#if MF_WITH_CUDA
        float a = 0, b = 0;
        if (c->on_device && (cudaEventElapsedTime(&a, c->ev[0], c->ev[1]) != cudaSuccess ||
                             cudaEventElapsedTime(&b, c->ev[2] ? c->ev[2] : c->ev[1], c->ev[3]) != cudaSuccess)) {
            fail(run, r, MF_ERR_CUDA, "reading the dispatch / combine events", "cudaEventElapsedTime failed");
            return -1;
        }
        if (c->on_device) ph->us[MF_PHASE_DISPATCH] = a * 1e3, ph->us[MF_PHASE_COMBINE] = b * 1e3;
#endif
        ph->total_us = ph->us[MF_PHASE_DISPATCH] + ph->us[MF_PHASE_COMBINE];
    }
    return 0;
}

/* One iteration: after the barrier, its inputs, the stage and prefetch, then the call (the forward,
 * or its graph, or the comm op) between the gate and the events, its faults, times and digests.
 * 0 ok; -1 when this rank or another failed. */
static int rank_iteration(rank_ctx_t *c, int32_t it) {
    run_state_t *run = c->run;
    const mfp_run_opts_t *o = c->o;
    const int32_t r = c->r, T = c->T;
    mf_result_t res;
    if (mfp_barrier_wait(&run->barrier) != 0) return -1; /* another rank failed */
    if (rank_redraw_inputs(c, it) != 0) return -1;
    if (r == o->die_rank && it == o->die_at && c->procs && !o->die_mid) raise(SIGKILL); /* fault injection */
    if (rank_stage_and_prefetch(c, it) != 0) return -1;
    double t0 = now_s(), t_disp = 0, t_comb = 0;
    uint64_t digest_disp = 0;
    const int dies_mid = r == o->die_rank && it == o->die_at && c->procs && o->die_mid;
#if MF_WITH_CUDA
    /* A rank that dies mid-call holds its stream too: killed with its call launched and not
     * run, whatever the timing, while its peers are inside the call. */
    const int gated = c->gate_always || (c->on_device && dies_mid && !c->graph_exec && !(c->comm_op && o->digests));
    if (gated) {
        atomic_store_explicit(&c->gate_open, 0, memory_order_relaxed);
        cudaError_t ce = cudaLaunchHostFunc(c->cst, gate_hold, &c->gate_open);
        if (ce != cudaSuccess) {
            fail(run, r, MF_ERR_CUDA, "cudaLaunchHostFunc (gate)", cudaGetErrorString(ce));
            return -1;
        }
    }
    if (c->on_device && run->begins && it >= o->warmup) {
        cudaEvent_t *bev = &run->begins[(size_t)r * o->iters + (it - o->warmup)];
        cudaError_t ce = cudaEventCreate(bev);
        if (ce == cudaSuccess) ce = cudaEventRecord(*bev, c->cst);
        if (ce != cudaSuccess) {
            atomic_store_explicit(&c->gate_open, 1, memory_order_release);
            fail(run, r, MF_ERR_CUDA, "recording the begin event", cudaGetErrorString(ce));
            return -1;
        }
    }
#endif
    const char *call = "mf_moe_forward";
    if (!c->comm_op) {
#if MF_WITH_CUDA
        if (c->graph_exec) {
            cudaError_t ce = cudaGraphLaunch(c->graph_exec, c->cst);
            res = ce == cudaSuccess ? MF_SUCCESS : MF_ERR_CUDA;
            if (ce != cudaSuccess) {
                fail(run, r, res, "cudaGraphLaunch", cudaGetErrorString(ce));
                return -1;
            }
        } else
#endif
            res = mf_moe_forward(c->moe, &c->in, &c->out, c->stream);
    } else {
        int failed = 0;
        res = rank_comm_op(c, &call, &t_disp, &t_comb, &digest_disp, &failed);
        if (failed) return -1;
    }
#if MF_WITH_CUDA
    if (c->ev[3] && !c->comm_op && res == MF_SUCCESS) cudaEventRecord(c->ev[3], c->cst); /* no_phases: the forward's end */
#endif
    if (dies_mid) raise(SIGKILL); /* its call launched, its peers inside the call */
#if MF_WITH_CUDA
    if (gated) atomic_store_explicit(&c->gate_open, 1, memory_order_release);
#endif
    if (res != MF_SUCCESS) {
        fail(run, r, res, call, mf_last_error());
        return -1;
    }
#if MF_WITH_CUDA
    cudaError_t ce = c->on_device ? cudaStreamSynchronize(c->cst) : cudaSuccess;
    if (ce != cudaSuccess) {
        fail(run, r, MF_ERR_CUDA, "cudaStreamSynchronize after the call", cudaGetErrorString(ce));
        return -1;
    }
#endif
    double t1 = now_s();
    /* Faults found by device code (a peer that never arrived) surface here, not as the
     * forward's result; outside the timed span. */
    if ((res = mf_comm_get_async_error(c->comm)) != MF_SUCCESS) {
        fail(run, r, res, "mf_comm_get_async_error after the call", mf_last_error());
        return -1;
    }
    const int32_t j = it - o->warmup;
    if (j >= 0 && rank_record_times(c, j, t0, t1, t_disp, t_comb) != 0) return -1;
    if (o->digests) { /* y of this call, bit for bit */
        uint64_t *d = &run->digests[((size_t)r * c->total + it) * 2];
        if (T > 0 && backend_copy(c->on_device, run->y[r], c->mem[3], c->bytes[3], 1) != 0) {
            fail(run, r, MF_ERR_CUDA, "copying y to the host", "copy failed");
            return -1;
        }
        d[0] = digest_disp;
        d[1] = fnv1a(FNV_OFFSET, run->y[r], T > 0 ? c->bytes[3] : 0);
    }
    if (r == 0 && o->progress) o->progress(o->progress_ctx, it + 1, c->total);
    return 0;
}

/* After the last iteration: the staged weights checked, rank 0's balance statistics, y to the host.
 * 0 ok. */
static int rank_finish(rank_ctx_t *c) {
    run_state_t *run = c->run;
    const mfp_run_opts_t *o = c->o;
    if (o->stage_map && check_next_weights(run, c->r, c->moe, c->next, c->L) != 0) return -1;
    const int balanced = o->num_physical || o->spare_slots || o->expert_map ||
                         c->s->placement != MF_PLACEMENT_LINEAR || c->s->E % c->s->R;
    if (c->r == 0 && balanced) {
        run->balance.size = sizeof run->balance;
        mf_result_t res = mf_moe_get_balance_stats(c->moe, &run->balance);
        if (res != MF_SUCCESS) fail(run, c->r, res, "mf_moe_get_balance_stats", mf_last_error());
    }
#if MF_WITH_CUDA
    if (c->on_device && c->T > 0) {
        cudaError_t ce = cudaMemcpy(run->y[c->r], c->mem[3], c->bytes[3], cudaMemcpyDeviceToHost);
        if (ce != cudaSuccess) fail(run, c->r, MF_ERR_CUDA, "copying y to the host", cudaGetErrorString(ce));
    }
#endif
    return 0;
}

/* Frees what the steps made, in reverse: the graph, the layer, a rank process's comm (a healthy one
 * meets its peers here: they stop using its heap), its ncclComm, the receive tensors, the redraw
 * buffers, the device copies, events and stream, the laid-out and staged weights. */
static void rank_release(rank_ctx_t *c) {
    run_state_t *run = c->run;
    const int on_device = c->on_device;
#if MF_WITH_CUDA
    if (c->graph_exec) cudaGraphExecDestroy(c->graph_exec);
    if (c->graph) cudaGraphDestroy(c->graph);
#endif
    mf_moe_destroy(c->moe);
    if (!run->group && c->comm) {
        mf_result_t res = mf_comm_destroy(c->comm);
        if (res != MF_SUCCESS) fail(run, c->r, res, "mf_comm_destroy", mf_last_error());
    }
#if MF_WITH_CUDA
    if (c->nccl_comm) { /* after the comm that borrowed it; a failed run aborts (peers may be gone) */
        if (run->code == MF_SUCCESS) c->nccl.comm_destroy(c->nccl_comm);
        else c->nccl.comm_abort(c->nccl_comm);
    }
#endif
    recv_bufs_t *rb = &c->rb;
    void *rbufs[] = {rb->x, rb->scales, rb->src, rb->counts, rb->offsets, rb->eo};
    for (size_t i = 0; i < sizeof rbufs / sizeof rbufs[0]; i++)
        if (rbufs[i]) backend_free(on_device, rbufs[i]);
    free(rb->hx), free(rb->hscales), free(rb->hsrc), free(rb->hcounts), free(rb->hoffsets), free(rb->heo);
    free(c->rx_host), free(c->rids_host), free(c->rw_host);
#if MF_WITH_CUDA
    if (on_device) {
        for (int i = 0; i < 8; i++) cudaFree(c->mem[i]);
        for (int i = 0; i < 4; i++)
            if (c->ev[i]) cudaEventDestroy(c->ev[i]);
        if (c->cst) cudaStreamDestroy(c->cst);
    }
#endif
    for (int i = 0; i < 4; i++) free(c->phys[i]);
    for (int i = 0; i < 4; i++)
        if (c->next[i]) backend_free(on_device, c->next[i]);
}

/* One rank, a thread of this process or the main thread of a rank process: its steps in order; the
 * first that fails ends the rank (the run has failed, and the barrier is broken for the others). */
static void *rank_main(void *varg) {
    rank_arg_t *arg = varg;
    rank_ctx_t ctx, *c = &ctx;
    if (rank_lay_out_weights(c, arg->run, arg->rank) != 0) return NULL;
    if (rank_upload(c) == 0 && rank_alloc_redraw(c) == 0 && rank_join_comm(c) == 0 && rank_create_layer(c) == 0 &&
        rank_bind_tensors(c) == 0 && rank_capture_graph(c) == 0) {
        c->run->setup_done[c->r] = now_s();
#if MF_WITH_CUDA
        c->gate_always = c->on_device && c->o->gated && !c->o->graph && !(c->comm_op && c->o->digests);
        atomic_init(&c->gate_open, 1);
#endif
        int32_t it = 0;
        while (it < c->total && rank_iteration(c, it) == 0) it++;
        if (it == c->total) rank_finish(c);
    }
    rank_release(c);
    return NULL;
}

static double median(double *v, int32_t n);

/* Forward times split by whether a stage was in flight (rank 0's flags; first MFP_STAGE_ITERS). */
static void stage_medians(const run_state_t *run, mfp_timing_t *t) {
    const int32_t R = run->p->spec.R, n = run->opts->iters < MFP_STAGE_ITERS ? run->opts->iters : MFP_STAGE_ITERS;
    double *a[2] = {malloc(sizeof(double) * (size_t)(n + 1)), malloc(sizeof(double) * (size_t)(n + 1))};
    double *b[2] = {malloc(sizeof(double) * (size_t)(n + 1)), malloc(sizeof(double) * (size_t)(n + 1))};
    int32_t m[2] = {0, 0};
    for (int32_t j = 0; a[0] && a[1] && b[0] && b[1] && j < n; j++) {
        const int32_t k = run->staged_iter[j];
        double worst = 0;
        for (int32_t r = 0; r < R; r++) worst = run->times[(size_t)r * run->opts->iters + j] > worst
                                                    ? run->times[(size_t)r * run->opts->iters + j] : worst;
        a[k][m[k]] = run->times[j], b[k][m[k]] = worst, m[k]++;
    }
    t->stage_forwards = m[1];
    if (m[1]) t->stage_forward_ms = median(a[1], m[1]), t->stage_forward_max_ms = median(b[1], m[1]);
    if (m[0]) t->plain_forward_ms = median(a[0], m[0]), t->plain_forward_max_ms = median(b[0], m[0]);
    t->stage_steps = run->stage_steps;
    t->stage_prefetch_ms = run->stage_steps ? run->stage_prefetch_ms_sum / run->stage_steps : 0.0;
    t->stage_step_bytes_max = run->stage_step_bytes_max;
    t->stage_bytes_total = run->stage_bytes_total;
    for (int i = 0; i < 2; i++) free(a[i]), free(b[i]);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int32_t n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Medians over iterations of each rank's value(rank, iter) into per_rank[r][field]. */
static void rank_medians(const run_state_t *run, int32_t field, double (*per_rank)[MFP_TIMES]) {
    const int32_t R = run->p->spec.R, n = run->opts->iters;
    double *a = malloc(sizeof(double) * (size_t)n);
    if (!a) return;
    for (int32_t r = 0; r < R; r++) {
        for (int32_t j = 0; j < n; j++) {
            const size_t at = (size_t)r * n + j;
            a[j] = field < MF_NUM_PHASES ? run->phases[at].us[field] : run->phases[at].total_us;
        }
        per_rank[r][field] = median(a, n);
    }
    free(a);
}

/* Medians over iterations of rank 0's value and of the max over ranks of value(rank, iter). */
static void medians(const run_state_t *run, int32_t field, double *rank0, double *max_over_ranks) {
    const int32_t R = run->p->spec.R, n = run->opts->iters;
    double *a = malloc(sizeof(double) * (size_t)n), *b = malloc(sizeof(double) * (size_t)n);
    if (!a || !b) {
        free(a);
        free(b);
        return;
    }
    for (int32_t j = 0; j < n; j++) {
        b[j] = 0.0;
        for (int32_t r = 0; r < R; r++) {
            const size_t at = (size_t)r * n + j;
            double v = field < 0 ? run->times[at]
                       : field < MF_NUM_PHASES ? run->phases[at].us[field] : run->phases[at].total_us;
            if (r == 0) a[j] = v;
            if (v > b[j]) b[j] = v;
        }
    }
    *rank0 = median(a, n);
    *max_over_ranks = median(b, n);
    free(a);
    free(b);
}

#if MF_WITH_CUDA
/* Signed milliseconds from event a to event b (whichever was first). */
static int event_delta_ms(cudaEvent_t a, cudaEvent_t b, double *ms) {
    float f = 0;
    if (cudaEventElapsedTime(&f, a, b) == cudaSuccess) {
        *ms = f;
        return 0;
    }
    (void)cudaGetLastError();
    if (cudaEventElapsedTime(&f, b, a) == cudaSuccess) {
        *ms = -f;
        return 0;
    }
    (void)cudaGetLastError();
    return -1;
}

/* timing->rank_start_us from run->begins (see mfp_timing_t). */
static void rank_starts(run_state_t *run, mfp_timing_t *timing) {
    const int32_t R = run->p->spec.R, n = run->opts->iters;
    double *v = malloc(sizeof(double) * (size_t)R * n), *a = malloc(sizeof(double) * (size_t)n);
    int ok = v && a && cudaSetDevice(0) == cudaSuccess;
    for (int32_t j = 0; ok && j < n; j++) {
        double lo = 0;
        for (int32_t r = 0; ok && r < R; r++) {
            ok = run->begins[(size_t)r * n + j] && cudaEventSynchronize(run->begins[(size_t)r * n + j]) == cudaSuccess &&
                 event_delta_ms(run->begins[j], run->begins[(size_t)r * n + j], &v[(size_t)r * n + j]) == 0;
            if (ok && v[(size_t)r * n + j] < lo) lo = v[(size_t)r * n + j];
        }
        for (int32_t r = 0; ok && r < R; r++) v[(size_t)r * n + j] -= lo;
    }
    for (int32_t r = 0; r < MF_MAX_RANKS; r++) timing->rank_start_us[r] = -1;
    for (int32_t r = 0; ok && r < R; r++) {
        for (int32_t j = 0; j < n; j++) a[j] = v[(size_t)r * n + j] * 1e3;
        timing->rank_start_us[r] = median(a, n);
    }
    free(v);
    free(a);
}
#endif

void mfp_cuda_env(void) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);
    /* NVLink multicast (NVLS) stays off in every NCCL comm the tools make: on shared multi-GPU
     * hosts a program using it can put the GPUs out of service; moeflow needs none of it. */
    setenv("NCCL_NVLS_ENABLE", "0", 1);
}

mf_backend_t mfp_resolve_backend(mf_backend_t backend) {
    if (backend != MF_BACKEND_AUTO) return backend;
    return MF_WITH_CUDA && mf_backend_available(MF_BACKEND_CUDA) ? MF_BACKEND_CUDA : MF_BACKEND_CPU;
}

mf_backend_t mfp_probe_backend(mf_backend_t backend) {
    if (backend != MF_BACKEND_AUTO || !MF_WITH_CUDA) return mfp_resolve_backend(backend);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) _exit(mfp_resolve_backend(backend) == MF_BACKEND_CUDA ? 1 : 0);
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return MF_BACKEND_CPU;
    return WEXITSTATUS(status) == 1 ? MF_BACKEND_CUDA : MF_BACKEND_CPU;
}

int32_t mfp_probe_device_count(void) {
#if MF_WITH_CUDA
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
        _exit(n > 255 ? 255 : n);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
    return WEXITSTATUS(status);
#else
    return 0;
#endif
}

/* The run's shared block: the state, then setup_done [R], times [R][iters], phases [R][iters] and
 * (IPC) every rank's y. Anonymous shared memory, so rank processes forked later see it too. */
static size_t run_block_bytes(const mfp_problem_t *p, const mfp_run_opts_t *o, size_t *y_off) {
    const size_t R = (size_t)p->spec.R, n = (size_t)o->iters, calls = (size_t)(o->warmup + o->iters);
    size_t bytes = sizeof(run_state_t) + R * sizeof(double) + R * n * sizeof(double) + R * n * sizeof(mf_phase_times_t);
    bytes = (bytes + 15) / 16 * 16 + (o->digests ? R * calls * 2 * sizeof(uint64_t) : 0);
    bytes = (bytes + 15) / 16 * 16;
    *y_off = bytes;
    for (size_t r = 0; r < R; r++) bytes += ((size_t)p->T[r] * (size_t)p->spec.H * 2 + 15) / 16 * 16;
    return bytes;
}

/* IPC: forks the rank processes and reaps them. A rank that died by a signal breaks the barrier at
 * once (so that no survivor waits for it there); its death is the run's failure only when no
 * survivor reported one (a survivor's timeout names what it waited for). */
static void run_processes(run_state_t *run) {
    const int32_t R = run->p->spec.R;
    pid_t pids[MF_MAX_RANKS];
    int32_t started = 0;
    fflush(NULL);
    for (; started < R; started++) {
        pid_t pid = fork();
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL); /* no orphan ranks if this process goes */
            rank_arg_t arg = {run, started};
            rank_main(&arg);
            fflush(NULL);
            _exit(0);
        }
        if (pid < 0) {
            fail(run, started, MF_ERR_SYSTEM, "fork", strerror(errno));
            break;
        }
        pids[started] = pid;
    }
    int32_t died = -1, signal_no = 0;
    for (int32_t left = started; left > 0; left--) {
        int status = 0;
        pid_t pid = waitpid(-1, &status, 0);
        if (pid < 0) break;
        int32_t r = 0;
        while (r < started && pids[r] != pid) r++;
        if (WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0)) {
            if (died < 0) died = r, signal_no = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
            pthread_mutex_lock(&run->mu);
            if (r < started) run->rank_code[r] = MF_ERR_SYSTEM;
            pthread_mutex_unlock(&run->mu);
            mfp_barrier_break(&run->barrier);
        }
    }
    if (died >= 0) {
        char why[64];
        snprintf(why, sizeof why, "the rank's process died (signal %d)", signal_no);
        fail(run, died, MF_ERR_SYSTEM, "rank process", why);
    }
}

mf_result_t mfp_run(const mfp_problem_t *p, const mfp_run_opts_t *opts, uint16_t *const *y,
                    mfp_timing_t *timing, char *err, int errlen) {
    if (err && errlen > 0) err[0] = '\0';
    if (!p || !p->T || !opts || !y || opts->iters < 1 || opts->warmup < 0 ||
        (opts->transport != MF_TRANSPORT_LOCAL && opts->transport != MF_TRANSPORT_IPC &&
         opts->transport != MF_TRANSPORT_NCCL) ||
        (opts->op != MFP_OP_FORWARD && opts->op != MFP_OP_DISPATCH_COMBINE && opts->op != MFP_OP_SPLIT) ||
        (opts->op == MFP_OP_SPLIT && (p->spec.layout != MF_LAYOUT_MASKED || opts->digests || opts->profile)) ||
        (opts->graph && (opts->op != MFP_OP_FORWARD || opts->profile || opts->gated)) || opts->max_tokens < 0) {
        if (err && errlen > 0) snprintf(err, (size_t)errlen, "mfp_run: bad arguments");
        return MF_ERR_INVALID_ARGUMENT;
    }
    if (opts->transport == MF_TRANSPORT_NCCL && (!MF_WITH_CUDA || opts->backend == MF_BACKEND_CPU)) {
        if (err && errlen > 0) snprintf(err, (size_t)errlen, "mfp_run: the nccl transport needs the CUDA backend");
        return MF_ERR_NOT_SUPPORTED;
    }
    for (int32_t r = 0; opts->max_tokens > 0 && r < p->spec.R; r++)
        if (p->T[r] > opts->max_tokens) {
            if (err && errlen > 0)
                snprintf(err, (size_t)errlen, "mfp_run: max_tokens %d is below rank %d's T = %d", opts->max_tokens, r,
                         p->T[r]);
            return MF_ERR_INVALID_ARGUMENT;
        }
    /* ipc: rank processes, the problem's own transport between them; nccl: rank processes too */
    const int32_t R = p->spec.R, ipc = opts->transport != MF_TRANSPORT_LOCAL;
    size_t y_off = 0, block_bytes = run_block_bytes(p, opts, &y_off);
    uint8_t *block = mmap(NULL, block_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (block == MAP_FAILED) {
        if (err && errlen > 0) snprintf(err, (size_t)errlen, "mfp_run: out of memory for the run's shared block");
        return MF_ERR_OUT_OF_MEMORY;
    }
    run_state_t *run = (run_state_t *)block;
    run->p = p;
    run->opts = opts;
    /* Rank processes resolve AUTO themselves: this process must not touch CUDA before it forks. */
    run->backend = ipc ? opts->backend : mfp_resolve_backend(opts->backend);
    run->setup_done = (double *)(block + sizeof(run_state_t));
    run->times = run->setup_done + R;
    run->phases = (mf_phase_times_t *)(run->times + (size_t)R * opts->iters);
    if (opts->digests) {
        size_t at = sizeof(run_state_t) + (size_t)R * sizeof(double) * (1 + (size_t)opts->iters) +
                    (size_t)R * opts->iters * sizeof(mf_phase_times_t);
        run->digests = (uint64_t *)(block + (at + 15) / 16 * 16);
    }
    uint8_t *yp = block + y_off;
    for (int32_t r = 0; r < R; r++) {
        run->y[r] = ipc ? (uint16_t *)yp : y[r];
        yp += ((size_t)p->T[r] * (size_t)p->spec.H * 2 + 15) / 16 * 16;
    }
    /* A barrier wait outlasts any peer wait of the library (a rank in a forward gives up first). */
    const int64_t timeout = opts->timeout_ms ? opts->timeout_ms : 30000;
    mfp_barrier_init(&run->barrier, R, 2 * timeout + 10000);
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutex_init(&run->mu, &ma);
    pthread_mutexattr_destroy(&ma);
#if MF_WITH_CUDA
    if (opts->profile && !ipc && run->backend == MF_BACKEND_CUDA)
        run->begins = calloc((size_t)R * opts->iters, sizeof *run->begins);
#endif
    rank_arg_t *args = calloc((size_t)R, sizeof *args);
    pthread_t *th = calloc((size_t)R, sizeof *th);
    if (!args || !th) {
        run->code = MF_ERR_OUT_OF_MEMORY;
        snprintf(run->err, sizeof run->err, "mfp_run: out of host memory");
        goto out;
    }

    run->t_start = now_s();
    if (ipc) {
        mf_result_t res = mf_rendezvous_address(run->address);
        if (res != MF_SUCCESS) {
            run->code = res;
            snprintf(run->err, sizeof run->err, "mf_rendezvous_address: %s", mf_last_error());
            goto out;
        }
        run_processes(run);
    } else {
        mf_group_config_t gc = MF_GROUP_CONFIG_INIT;
        gc.backend = run->backend;
        gc.num_ranks = R;
        gc.device = 0;
        gc.timeout_ms = opts->timeout_ms;
        mf_result_t res = mf_group_create(&gc, &run->group);
        if (res != MF_SUCCESS) {
            run->code = res;
            snprintf(run->err, sizeof run->err, "mf_group_create: %s", mf_last_error());
            goto out;
        }
        int32_t started = 0;
        for (; started < R; started++) {
            args[started] = (rank_arg_t){run, started};
            if (pthread_create(&th[started], NULL, rank_main, &args[started]) != 0) {
                fail(run, started, MF_ERR_SYSTEM, "pthread_create", "could not start a rank thread");
                break;
            }
        }
        for (int32_t i = 0; i < started; i++) pthread_join(th[i], NULL);
        mf_group_destroy(run->group);
    }

    if (run->code == MF_SUCCESS && ipc)
        for (int32_t r = 0; r < R; r++)
            if (y[r]) memcpy(y[r], run->y[r], (size_t)p->T[r] * (size_t)p->spec.H * 2);
    if (run->code == MF_SUCCESS && timing) {
        memset(timing, 0, sizeof *timing);
        double worst = 0.0;
        for (int32_t r = 0; r < R; r++)
            if (run->setup_done[r] - run->t_start > worst) worst = run->setup_done[r] - run->t_start;
        timing->setup_ms = worst * 1e3;
        medians(run, -1, &timing->forward_ms, &timing->forward_max_ms);
        if (opts->profile) {
            timing->have_phases = 1;
            for (int32_t f = 0; f < MFP_TIMES; f++) {
                medians(run, f, &timing->phase_us[f], &timing->phase_max_us[f]);
                rank_medians(run, f, timing->phase_rank_us);
            }
        }
        for (int32_t r = 0; r < MF_MAX_RANKS; r++) timing->rank_start_us[r] = -1;
        if (run->balance.size) {
            timing->have_balance = 1;
            timing->balance = run->balance;
            timing->prefetch_first_bytes = run->prefetch_first_bytes;
            timing->prefetch_last_bytes = run->prefetch_last_bytes;
            timing->prefetch_ms = run->prefetch_n ? run->prefetch_ms_sum / run->prefetch_n : 0.0;
        }
        if (opts->stage_map) stage_medians(run, timing);
#if MF_WITH_CUDA
        if (run->begins) rank_starts(run, timing);
#endif
    }
out:;
    mf_result_t code = run->code;
    if (opts->rank_results) memcpy(opts->rank_results, run->rank_code, sizeof(mf_result_t) * (size_t)R);
    if (opts->digests)
        memcpy(opts->digests, run->digests, sizeof(uint64_t) * 2 * (size_t)R * (size_t)(opts->warmup + opts->iters));
    if (code != MF_SUCCESS && err && errlen > 0) snprintf(err, (size_t)errlen, "%s", run->err);
#if MF_WITH_CUDA
    for (size_t i = 0; run->begins && i < (size_t)R * opts->iters; i++)
        if (run->begins[i]) cudaEventDestroy(run->begins[i]);
    free(run->begins);
#endif
    free(args);
    free(th);
    mfp_barrier_fini(&run->barrier);
    pthread_mutex_destroy(&run->mu);
    munmap(block, block_bytes);
    return code;
}

mf_result_t mfp_run_forward(const mfp_problem_t *p, mf_backend_t backend, int32_t iters,
                            int64_t timeout_ms, uint16_t *const *y, mfp_timing_t *timing,
                            char *err, int errlen) {
    mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
    o.backend = backend;
    o.iters = iters;
    o.timeout_ms = timeout_ms;
    return mfp_run(p, &o, y, timing, err, errlen);
}
