/*
 * harness.h — the test runner's vocabulary: the test table, the check macros and small helpers
 * shared by every tests/test_<area>.c.
 *
 * Each test_<area>.c exports one `const mft_test_t mft_tests_<area>[]`, terminated by an entry
 * whose `name` is NULL; tests/main.c lists the arrays. A test is `int fn(void)` returning 0 on
 * pass; it runs in its own forked process with a time limit (a hang or a crash is a failure), so
 * a test may leak on its failure path and need not restore global state. The MFT_CHECK* macros
 * print file:line, the expression and the values, and `return 1` from the enclosing function:
 * tests that own resources put their checks in a helper that returns int and free in the caller.
 */
#ifndef MF_TESTS_HARNESS_H
#define MF_TESTS_HARNESS_H

#include <stddef.h>
#include <stdint.h>

#include "moeflow.h"

typedef struct mft_test {
    const char *name;  /* unique, "<area>_<case>"; NULL ends a table */
    int (*fn)(void);   /* 0 = pass */
    double timeout_s;  /* wall-clock limit of the forked test; 0 = MFT_DEFAULT_TIMEOUT_S */
} mft_test_t;

#define MFT_DEFAULT_TIMEOUT_S 60.0

/* The tables, one per area (tests/main.c lists them). */
extern const mft_test_t mft_tests_numerics[];
extern const mft_test_t mft_tests_quant[];
extern const mft_test_t mft_tests_api[];
extern const mft_test_t mft_tests_dispatch[];
extern const mft_test_t mft_tests_layer[];
extern const mft_test_t mft_tests_plan[]; /* tests/test_plan.c (internal routing plan) */
extern const mft_test_t mft_tests_transport[]; /* tests/test_transport.c (ranks as processes) */
extern const mft_test_t mft_tests_rendezvous[]; /* tests/test_rendezvous.c (processes) */
extern const mft_test_t mft_tests_random[]; /* tests/test_random.c (random layer cases) */
extern const mft_test_t mft_tests_balance[]; /* tests/test_balance.c (balanced EP) */
extern const mft_test_t mft_tests_placement[]; /* tests/test_placement.c (mf_placement_t) */
extern const mft_test_t mft_tests_gemm_bounds[]; /* tests/test_gemm_bounds.c (bench gemm --check bounds) */
extern const mft_test_t mft_tests_split[]; /* tests/test_split.c (the split halves, mf_exchange_t) */
extern const mft_test_t mft_tests_cuda[]; /* tests/gpu/test_cuda.c (the CUDA suite) */
extern const mft_test_t mft_tests_cuda_transport[]; /* tests/gpu/test_transport.c (ranks as processes) */
extern const mft_test_t mft_tests_cuda_balance[]; /* tests/gpu/test_balance.c (balanced EP on the device) */
extern const mft_test_t mft_tests_cuda_gemm_bounds[]; /* tests/gpu/test_gemm_bounds.c (GEMMs within their bounds) */
extern const mft_test_t mft_tests_cuda_split[]; /* tests/gpu/test_split.c (the split halves on the device) */

/* ---- failure reporting -------------------------------------------------------------------- */

/* Prints "file:line: <message>" to stderr; returns 1 (so `return mft_fail(...)` fails a test). */
int mft_fail(const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

#define MFT_FAIL(...) return mft_fail(__FILE__, __LINE__, __VA_ARGS__)

#define MFT_CHECK(cond)                                                    \
    do {                                                                   \
        if (!(cond)) MFT_FAIL("check failed: %s", #cond);                  \
    } while (0)

/* Like MFT_CHECK with a printf-style explanation appended. */
#define MFT_CHECK_MSG(cond, ...)                                           \
    do {                                                                   \
        if (!(cond)) {                                                     \
            mft_fail(__FILE__, __LINE__, "check failed: %s", #cond);       \
            mft_note(__VA_ARGS__);                                         \
            return 1;                                                      \
        }                                                                  \
    } while (0)

#define MFT_CHECK_EQ_INT(a, b)                                                                   \
    do {                                                                                         \
        long long mft__a = (long long)(a), mft__b = (long long)(b);                              \
        if (mft__a != mft__b) MFT_FAIL("%s == %s failed: %lld vs %lld", #a, #b, mft__a, mft__b); \
    } while (0)

/* `expr` (an mf_result_t expression) must return MF_SUCCESS. */
#define MFT_CHECK_OK(expr)                                                                       \
    do {                                                                                         \
        mf_result_t mft__r = (expr);                                                             \
        if (mft__r != MF_SUCCESS)                                                                \
            MFT_FAIL("%s -> %s (%d): %s", #expr, mft_result_name(mft__r), (int)mft__r,          \
                     mf_last_error());                                                           \
    } while (0)

/* `expr` must return `code`, and mf_last_error() must then be a non-empty message. */
#define MFT_CHECK_ERR(expr, code)                                                                \
    do {                                                                                         \
        mf_result_t mft__r = (expr);                                                             \
        if (mft__r != (code))                                                                    \
            MFT_FAIL("%s -> %s (%d), expected %s (%d); last error: \"%s\"", #expr,               \
                     mft_result_name(mft__r), (int)mft__r, mft_result_name(code), (int)(code),   \
                     mf_last_error());                                                           \
        if (mf_last_error() == NULL || mf_last_error()[0] == '\0')                               \
            MFT_FAIL("%s -> %s as expected, but mf_last_error() is empty", #expr,                \
                     mft_result_name(mft__r));                                                   \
        mft_verbose("  %s -> %s: %s\n", #expr, mft_result_name(mft__r), mf_last_error());       \
    } while (0)

/* Prints an indented continuation line under a failure (stderr). */
void mft_note(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

/* Prints to stdout only when the runner was given -v. */
void mft_verbose(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
extern int mft_verbose_on;

/* "MF_ERR_TIMEOUT" for a code, "MF_?(n)" outside the enum; never NULL. */
const char *mft_result_name(mf_result_t r);

/* Case-insensitive substring test. */
int mft_contains_ci(const char *haystack, const char *needle);

/* 1 when `err` is the CUDA backend's timeout whose waited-for peer had its arrival launched by its
 * host but not run by the device ("... expected E (its own epoch counter: C; its host has launched
 * N ..." with C < E <= N): the virtual-rank queue stall of docs/API.md section 10, the platform's,
 * which the GPU tests retry (at most twice, saying RETRY) instead of failing a healthy case. */
int mft_queue_stall(const char *err);

/* ---- tensors ------------------------------------------------------------------------------ */

mf_tensor_t mft_t1(void *data, mf_dtype_t dtype, int64_t d0);
mf_tensor_t mft_t2(void *data, mf_dtype_t dtype, int64_t d0, int64_t d1);
mf_tensor_t mft_t3(void *data, mf_dtype_t dtype, int64_t d0, int64_t d1, int64_t d2);
mf_tensor_t mft_t4(void *data, mf_dtype_t dtype, int64_t d0, int64_t d1, int64_t d2, int64_t d3);
/* The empty descriptor, for fields a call does not use. */
mf_tensor_t mft_none(void);

/* ---- memory and data ---------------------------------------------------------------------- */

/* malloc that never returns NULL (prints and exits the test process on failure); bytes may be 0. */
void *mft_alloc(size_t bytes);

/* Per-rank output rows: y[r] of [T[r], H] bf16 for r < R, poisoned (MFT_POISON_BYTE), each with two
 * spare bytes so that T[r] = 0 still allocates; mft_free_ys frees them (NULL is a no-op). */
uint16_t **mft_alloc_ys(int32_t R, const int32_t *T, int64_t H);
void mft_free_ys(uint16_t **y, int32_t R);

#define MFT_POISON_BYTE 0xA5
/* Fills with MFT_POISON_BYTE; mft_first_unpoisoned returns the index of the first byte that no
 * longer reads so, or -1 when all still do (for "outputs untouched" checks). */
void mft_poison(void *p, size_t bytes);
int64_t mft_first_unpoisoned(const void *p, size_t bytes);

/* A small deterministic generator (splitmix64): tests never depend on libc rand(). */
typedef struct mft_rng { uint64_t s; } mft_rng_t;
uint64_t mft_rng_u64(mft_rng_t *rng);
double mft_rng_uniform(mft_rng_t *rng);               /* [0, 1) */
int32_t mft_rng_int(mft_rng_t *rng, int32_t n);       /* [0, n) */
/* A balanced-EP expert map of P slots (P >= E): every logical expert once, then P - E extra
 * replicas of random experts, the whole shuffled, from `seed`. */
void mft_random_map(int32_t E, int32_t P, uint64_t seed, int32_t *map);
int64_t mft_max_i64(const int64_t *v, int32_t n); /* the largest of v[0..n), 0 for n = 0 or all < 0 */
/* A stateless hash of up to four integers, for payloads that encode their coordinates. */
uint64_t mft_hash4(uint64_t a, uint64_t b, uint64_t c, uint64_t d);

/* ---- the quantisation contract, re-implemented independently ---------------------------------- */

/* docs/DESIGN.md "Numerics" block quantisation of nb matrices [M, N] (bf16) with blocks br x 128:
 * amax in fp32 clamped below at 1e-4; scale = amax / 448, q = e4m3(x * (448 / amax)); with ue8m0,
 * scale = 2^ceil(log2(amax / 448)) and q = e4m3(x * (1 / scale)). q [nb, M, N], scales
 * [nb, M / br, N / 128]. Uses only the public mf_fp8_e4m3_from_float / mf_bf16_to_float. */
void mft_quant_blocks(const uint16_t *in, int64_t nb, int64_t M, int64_t N, int br, int ue8m0,
                      uint8_t *q, float *scales);

/* ---- R-thread driver ---------------------------------------------------------------------- */

/* Runs fn(rank, arg) on R threads (one per virtual rank) and joins them all. Returns 0 when every
 * rank returned 0, else 1 (and each failing rank's messages have been printed). */
int mft_run_ranks(int32_t R, int (*fn)(int32_t rank, void *arg), void *arg);

/* CLOCK_MONOTONIC in seconds. */
double mft_now_s(void);

/* A bf16 value that is a function of a received row's source (rank, token, k) `src` and column h:
 * the stand-in experts of the split-halves tests write it, so y checks the routing too. */
uint16_t mft_route_value(const int32_t *src, int64_t h);

/* Forks R rank processes running fn(rank, arg) (each killed if this process dies: PR_SET_PDEATHSIG)
 * and reaps them all, killing them after deadline_s. Returns the number that did not exit 0. */
int mft_fork_ranks(int32_t R, int (*fn)(int32_t rank, void *arg), void *arg, double deadline_s);

/* A CPU group of R ranks with the given peer timeout (0 = default); NULL on failure (printed). */
mf_group_t mft_cpu_group(int32_t R, int64_t timeout_ms);

#endif /* MF_TESTS_HARNESS_H */
