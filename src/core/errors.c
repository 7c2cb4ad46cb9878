/*
 * errors.c — result codes, the per-thread last-error message, the host allocator (with the test
 * switch that makes it fail), the table of environment variables, and small dtype helpers.
 *
 * The library never prints: every failure goes through mf__error(), which formats a message into
 * a thread-local buffer that mf_last_error() returns.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"

#define MF__ERROR_LEN 512

static _Thread_local char mf__last_error[MF__ERROR_LEN];

int32_t mf_get_version(void) { return MOEFLOW_VERSION_CODE; }

const char *mf_result_string(mf_result_t result) {
    switch (result) {
    case MF_SUCCESS: return "MF_SUCCESS: no error";
    case MF_ERR_INVALID_ARGUMENT: return "MF_ERR_INVALID_ARGUMENT: an argument is outside the contract";
    case MF_ERR_INVALID_USAGE: return "MF_ERR_INVALID_USAGE: wrong call order, config header or broken comm";
    case MF_ERR_OUT_OF_MEMORY: return "MF_ERR_OUT_OF_MEMORY: an allocation failed";
    case MF_ERR_CAPACITY: return "MF_ERR_CAPACITY: a user-set capacity was exceeded";
    case MF_ERR_TIMEOUT: return "MF_ERR_TIMEOUT: a wait on a peer expired";
    case MF_ERR_CUDA: return "MF_ERR_CUDA: a CUDA call failed";
    case MF_ERR_NCCL: return "MF_ERR_NCCL: an NCCL call failed";
    case MF_ERR_SYSTEM: return "MF_ERR_SYSTEM: an operating-system call failed";
    case MF_ERR_NOT_SUPPORTED: return "MF_ERR_NOT_SUPPORTED: not supported by this build or backend";
    case MF_ERR_INTERNAL: return "MF_ERR_INTERNAL: internal error";
    case MF_ERR_ABORTED: return "MF_ERR_ABORTED: the comm or a peer was aborted";
    }
    return "unknown mf_result_t value";
}

const char *mf_last_error(void) { return mf__last_error; }

mf_result_t mf__error(mf_result_t code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(mf__last_error, sizeof mf__last_error, fmt, ap);
    va_end(ap);
    return code;
}

void mf__clear_error(void) { mf__last_error[0] = '\0'; }

/* ---- host allocation ---------------------------------------------------------------------- */

static _Atomic int64_t mf__fail_countdown; /* > 0: allocations left until one fails */

void mf__test_fail_alloc_after(int64_t n) { mf__fail_countdown = n; }

static int mf__alloc_should_fail(void) {
    if (mf__fail_countdown <= 0) return 0;
    return --mf__fail_countdown == 0;
}

void *mf__malloc(size_t bytes) {
    if (mf__alloc_should_fail()) return NULL;
    return malloc(bytes ? bytes : 1);
}

void *mf__calloc(size_t count, size_t bytes) {
    if (mf__alloc_should_fail()) return NULL;
    return calloc(count ? count : 1, bytes ? bytes : 1);
}

void mf__free(void *p) { free(p); }

/* ---- environment variables: the one table ------------------------------------------------- */
/* MF_TIMEOUT_MS   bound on every wait for a peer, in milliseconds (default 30000) */

static int64_t mf__env_int(const char *name, int64_t fallback) {
    const char *s = getenv(name);
    if (!s || !*s) return fallback;
    char *end = NULL;
    long long v = strtoll(s, &end, 10);
    return (end && *end == '\0' && v > 0) ? (int64_t)v : fallback;
}

int64_t mf__param_timeout_ms(void) { return mf__env_int("MF_TIMEOUT_MS", 30000); }

/* ---- helpers ------------------------------------------------------------------------------ */

size_t mf__dtype_size(int32_t dtype) {
    switch (dtype) {
    case MF_DTYPE_BF16: return 2;
    case MF_DTYPE_FP8_E4M3: return 1;
    case MF_DTYPE_FP32: return 4;
    case MF_DTYPE_INT32: return 4;
    default: return 0;
    }
}

const char *mf__dtype_name(int32_t dtype) {
    switch (dtype) {
    case MF_DTYPE_BF16: return "bf16";
    case MF_DTYPE_FP8_E4M3: return "fp8_e4m3";
    case MF_DTYPE_FP32: return "fp32";
    case MF_DTYPE_INT32: return "int32";
    default: return "unknown dtype";
    }
}

const char *mf__phase_name(int phase) {
    switch (phase) {
    case MF__PHASE_DISPATCH: return "dispatch";
    case MF__PHASE_COMBINE: return "combine";
    case MF__PHASE_ABORT: return "abort";
    default: return "unknown phase";
    }
}
