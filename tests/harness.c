/*
 * harness.c — the helpers behind tests/harness.h: failure printing, tensor descriptors, poison
 * fills, a deterministic generator and the R-thread driver used by the collective tests.
 *
 * Nothing here knows about a particular test; the runner itself (fork, time limit, summary) lives
 * in tests/main.c.
 */
#include "harness.h"

#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int mft_verbose_on = 0;

int mft_fail(const char *file, int line, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s:%d: %s\n", file, line, msg);
    fflush(stderr);
    return 1;
}

void mft_note(const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "    %s\n", msg);
    fflush(stderr);
}

void mft_verbose(const char *fmt, ...) {
    if (!mft_verbose_on) return;
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    fflush(stdout);
}

const char *mft_result_name(mf_result_t r) {
    static const char *const names[] = {
        "MF_SUCCESS",         "MF_ERR_INVALID_ARGUMENT", "MF_ERR_INVALID_USAGE",
        "MF_ERR_OUT_OF_MEMORY", "MF_ERR_CAPACITY",       "MF_ERR_TIMEOUT",
        "MF_ERR_CUDA",        "MF_ERR_NCCL",             "MF_ERR_SYSTEM",
        "MF_ERR_NOT_SUPPORTED", "MF_ERR_INTERNAL",         "MF_ERR_ABORTED"};
    if ((int)r >= 0 && (size_t)r < sizeof names / sizeof names[0]) return names[r];
    return "MF_?(out of range)";
}

int mft_queue_stall(const char *err) {
    const char *at = err ? strstr(err, ", expected ") : NULL;
    long long expected, counter, launched;
    return at && sscanf(at, ", expected %lld (its own epoch counter: %lld; its host has launched %lld", &expected,
                        &counter, &launched) == 3 && counter < expected && launched >= expected;
}

int mft_contains_ci(const char *haystack, const char *needle) {
    if (!haystack || !needle) return 0;
    size_t n = strlen(needle);
    for (const char *h = haystack; *h; h++) {
        size_t i = 0;
        while (i < n && h[i] &&
               tolower((unsigned char)h[i]) == tolower((unsigned char)needle[i]))
            i++;
        if (i == n) return 1;
    }
    return n == 0;
}

/* ---- tensors -------------------------------------------------------------------------------- */

static mf_tensor_t make_tensor(void *data, mf_dtype_t dtype, int ndim, const int64_t *dims) {
    mf_tensor_t t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = (int32_t)dtype;
    t.ndim = ndim;
    for (int i = 0; i < ndim; i++) t.dims[i] = dims[i];
    return t;
}

mf_tensor_t mft_t1(void *data, mf_dtype_t dtype, int64_t d0) {
    int64_t d[1] = {d0};
    return make_tensor(data, dtype, 1, d);
}
mf_tensor_t mft_t2(void *data, mf_dtype_t dtype, int64_t d0, int64_t d1) {
    int64_t d[2] = {d0, d1};
    return make_tensor(data, dtype, 2, d);
}
mf_tensor_t mft_t3(void *data, mf_dtype_t dtype, int64_t d0, int64_t d1, int64_t d2) {
    int64_t d[3] = {d0, d1, d2};
    return make_tensor(data, dtype, 3, d);
}
mf_tensor_t mft_t4(void *data, mf_dtype_t dtype, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
    int64_t d[4] = {d0, d1, d2, d3};
    return make_tensor(data, dtype, 4, d);
}
mf_tensor_t mft_none(void) { return make_tensor(NULL, MF_DTYPE_BF16, 0, NULL); }

/* ---- memory and data ------------------------------------------------------------------------ */

void *mft_alloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "mft_alloc: out of memory (%zu bytes)\n", bytes);
        exit(2);
    }
    return p;
}

void mft_poison(void *p, size_t bytes) { memset(p, MFT_POISON_BYTE, bytes); }

uint16_t **mft_alloc_ys(int32_t R, const int32_t *T, int64_t H) {
    uint16_t **y = mft_alloc(sizeof *y * (size_t)R);
    for (int32_t r = 0; r < R; r++) {
        y[r] = mft_alloc((size_t)T[r] * (size_t)H * 2 + 2);
        mft_poison(y[r], (size_t)T[r] * (size_t)H * 2);
    }
    return y;
}

void mft_free_ys(uint16_t **y, int32_t R) {
    for (int32_t r = 0; y && r < R; r++) free(y[r]);
    free(y);
}

int64_t mft_first_unpoisoned(const void *p, size_t bytes) {
    const unsigned char *b = (const unsigned char *)p;
    for (size_t i = 0; i < bytes; i++)
        if (b[i] != MFT_POISON_BYTE) return (int64_t)i;
    return -1;
}

uint64_t mft_rng_u64(mft_rng_t *rng) {
    uint64_t z = (rng->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double mft_rng_uniform(mft_rng_t *rng) { return (double)(mft_rng_u64(rng) >> 11) * 0x1p-53; }

int32_t mft_rng_int(mft_rng_t *rng, int32_t n) {
    return n <= 0 ? 0 : (int32_t)(mft_rng_u64(rng) % (uint64_t)n);
}

uint64_t mft_hash4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    mft_rng_t r = {a * 0x100000001b3ull ^ 0xcbf29ce484222325ull};
    uint64_t h = mft_rng_u64(&r);
    r.s ^= b + h;
    h = mft_rng_u64(&r);
    r.s ^= c + h;
    h = mft_rng_u64(&r);
    r.s ^= d + h;
    return mft_rng_u64(&r);
}

/* ---- the quantisation contract ------------------------------------------------------------- */

#define MFT_QBLOCK 128
#define MFT_AMAX_MIN 1e-4f

/* 2^ceil(log2(s)) for a positive normal float, from frexp (s = m * 2^e, m in [0.5, 1)). */
static float pow2_ceil(float s) {
    int e;
    float m = frexpf(s, &e);
    return m == 0.5f ? s : ldexpf(1.0f, e);
}

void mft_quant_blocks(const uint16_t *in, int64_t nb, int64_t M, int64_t N, int br, int ue8m0,
                      uint8_t *q, float *scales) {
    int64_t nbr = M / br, nbc = N / MFT_QBLOCK;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t bi = 0; bi < nbr; bi++)
            for (int64_t bj = 0; bj < nbc; bj++) {
                float amax = 0.0f;
                for (int64_t i = bi * br; i < (bi + 1) * br; i++)
                    for (int64_t j = bj * MFT_QBLOCK; j < (bj + 1) * MFT_QBLOCK; j++) {
                        float v = fabsf(mf_bf16_to_float(in[(b * M + i) * N + j]));
                        if (v > amax) amax = v;
                    }
                if (amax < MFT_AMAX_MIN) amax = MFT_AMAX_MIN;
                float scale, mul;
                if (ue8m0) {
                    scale = pow2_ceil(amax / 448.0f);
                    mul = 1.0f / scale;
                } else {
                    scale = amax / 448.0f;
                    mul = 448.0f / amax;
                }
                scales[(b * nbr + bi) * nbc + bj] = scale;
                for (int64_t i = bi * br; i < (bi + 1) * br; i++)
                    for (int64_t j = bj * MFT_QBLOCK; j < (bj + 1) * MFT_QBLOCK; j++) {
                        volatile float prod = mf_bf16_to_float(in[(b * M + i) * N + j]) * mul;
                        q[(b * M + i) * N + j] = mf_fp8_e4m3_from_float(prod);
                    }
            }
}

/* ---- R-thread driver ------------------------------------------------------------------------ */

typedef struct rank_thread {
    pthread_t thread;
    int32_t rank;
    int (*fn)(int32_t rank, void *arg);
    void *arg;
    int result;
} rank_thread_t;

static void *rank_main(void *p) {
    rank_thread_t *t = (rank_thread_t *)p;
    t->result = t->fn(t->rank, t->arg);
    if (t->result) fprintf(stderr, "    (rank %d failed)\n", (int)t->rank);
    return NULL;
}

int mft_run_ranks(int32_t R, int (*fn)(int32_t rank, void *arg), void *arg) {
    rank_thread_t *ts = (rank_thread_t *)mft_alloc(sizeof *ts * (size_t)(R > 0 ? R : 1));
    int32_t started = 0;
    int failed = 0;
    for (int32_t r = 0; r < R; r++) {
        ts[r].rank = r;
        ts[r].fn = fn;
        ts[r].arg = arg;
        ts[r].result = 1;
        if (pthread_create(&ts[r].thread, NULL, rank_main, &ts[r]) != 0) {
            fprintf(stderr, "mft_run_ranks: pthread_create failed for rank %d\n", (int)r);
            failed = 1;
            break;
        }
        started++;
    }
    for (int32_t r = 0; r < started; r++) {
        pthread_join(ts[r].thread, NULL);
        if (ts[r].result) failed = 1;
    }
    free(ts);
    return failed;
}

double mft_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int mft_fork_ranks(int32_t R, int (*fn)(int32_t rank, void *arg), void *arg, double deadline_s) {
    pid_t pids[MF_MAX_RANKS];
    fflush(NULL);
    for (int32_t r = 0; r < R; r++) {
        pid_t pid = fork();
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            int rc = fn(r, arg);
            fflush(NULL);
            _exit(rc ? 1 : 0);
        }
        pids[r] = pid;
    }
    int bad = 0;
    double t0 = mft_now_s();
    for (int32_t left = R; left > 0;) {
        int status = 0;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid > 0) {
            left--;
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) bad++;
            continue;
        }
        if (mft_now_s() - t0 > deadline_s) {
            for (int32_t r = 0; r < R; r++) kill(pids[r], SIGKILL);
            mft_note("rank processes still running after %.0f s: killed", deadline_s);
            while (waitpid(-1, NULL, 0) > 0) {}
            return R;
        }
        struct timespec nap = {0, 1000000};
        nanosleep(&nap, NULL);
    }
    return bad;
}

uint16_t mft_route_value(const int32_t *src, int64_t h) {
    return mf_bf16_from_float((float)((src[0] * 131 + src[1] * 7 + src[2] * 3 + h) % 61) / 8.0f - 3.0f);
}

mf_group_t mft_cpu_group(int32_t R, int64_t timeout_ms) {
    mf_group_config_t cfg = MF_GROUP_CONFIG_INIT;
    cfg.backend = MF_BACKEND_CPU;
    cfg.num_ranks = R;
    cfg.timeout_ms = timeout_ms;
    mf_group_t group = NULL;
    mf_result_t r = mf_group_create(&cfg, &group);
    if (r != MF_SUCCESS) {
        fprintf(stderr, "mft_cpu_group(R=%d): %s: %s\n", (int)R, mft_result_name(r),
                mf_last_error());
        return NULL;
    }
    return group;
}

void mft_random_map(int32_t E, int32_t P, uint64_t seed, int32_t *map) {
    mft_rng_t rng = {seed};
    for (int32_t p = 0; p < P; p++) map[p] = p < E ? p : mft_rng_int(&rng, E);
    for (int32_t p = P - 1; p > 0; p--) {
        int32_t j = mft_rng_int(&rng, p + 1), t = map[p];
        map[p] = map[j], map[j] = t;
    }
}

int64_t mft_max_i64(const int64_t *v, int32_t n) {
    int64_t m = 0;
    for (int32_t i = 0; i < n; i++) m = v[i] > m ? v[i] : m;
    return m;
}
