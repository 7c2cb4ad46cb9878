/*
 * errors.c — result codes, the per-thread last-error message, the host allocator (with the test
 * switch that makes it fail), the table of environment variables, and small dtype helpers.
 *
 * The library never prints: every failure goes through mf__error(), which formats a message into
 * a thread-local buffer that mf_last_error() returns. The one exception is opt-in: MF_DEBUG=1
 * reports the expert-GEMM decisions on stderr (mf__debug, below).
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/alloc.h"
#include "core/config.h"
#include "core/debug.h"
#include "core/errors.h"
#include "core/layout.h"
#include "core/params.h"
#include "core/tensor.h"

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
/* MF_TIMEOUT_MS   bound on every wait for a peer, in milliseconds (default 30000)
 * MF_DEBUG        1: report each distinct expert-GEMM decision once on stderr (default 0; below)
 * MF_PDL          0: the CUDA backend launches its kernels without programmatic dependent launch
 *                 (default 1; cuda/pdl.cuh), for A/B measurements */

/* The integer value of `name`, or `fallback` when it is unset, not an integer, or below `min`. */
static int64_t mf__env_int(const char *name, int64_t fallback, int64_t min) {
    const char *s = getenv(name);
    if (!s || !*s) return fallback;
    char *end = NULL;
    long long v = strtoll(s, &end, 10);
    return (end && *end == '\0' && v >= min) ? (int64_t)v : fallback;
}

int64_t mf__param_timeout_ms(void) { return mf__env_int("MF_TIMEOUT_MS", 30000, 1); }

int32_t mf__param_pdl(void) { return mf__env_int("MF_PDL", 1, 0) != 0; }

/* ---- MF_DEBUG: decision reports (core/debug.h) ---------------------------------------------- */
#define MF__DEBUG_KEYS 4096 /* distinct decisions remembered; past this, no more reports */

static _Atomic int mf__debug_state = -1; /* -1 not read yet, else 0 / 1 */
static pthread_mutex_t mf__debug_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t mf__debug_seen[MF__DEBUG_KEYS]; /* open addressing; 0 = empty */
static int32_t mf__debug_count;

int mf__debug_on(void) {
    int s = atomic_load_explicit(&mf__debug_state, memory_order_relaxed);
    if (s < 0) { /* concurrent first calls read the same environment: the same answer */
        s = mf__env_int("MF_DEBUG", 0, 1) > 0;
        atomic_store_explicit(&mf__debug_state, s, memory_order_relaxed);
    }
    return s;
}

uint64_t mf__debug_key(const int64_t *v, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++)
        for (int b = 0; b < 8; b++) {
            h ^= (uint64_t)((v[i] >> (8 * b)) & 0xff);
            h *= 1099511628211ull;
        }
    return h ? h : 1; /* 0 marks an empty slot */
}

int mf__debug_first(uint64_t key) {
    if (!key) key = 1;
    int first = 0, full = 0;
    pthread_mutex_lock(&mf__debug_mu);
    uint32_t i = (uint32_t)(key % MF__DEBUG_KEYS);
    for (int probe = 0; probe < MF__DEBUG_KEYS; probe++, i = (i + 1) % MF__DEBUG_KEYS) {
        if (mf__debug_seen[i] == key) break;
        if (mf__debug_seen[i] == 0) {
            if (mf__debug_count + 1 < MF__DEBUG_KEYS) {
                mf__debug_seen[i] = key;
                first = 1;
            } else {
                full = mf__debug_count == MF__DEBUG_KEYS - 1;
            }
            mf__debug_count += first || full;
            break;
        }
    }
    pthread_mutex_unlock(&mf__debug_mu);
    if (full) mf__debug("%d distinct decisions reported: no more reports in this process", MF__DEBUG_KEYS - 1);
    return first;
}

void mf__debug(const char *fmt, ...) {
    char line[1024];
    int n = snprintf(line, sizeof line, "moeflow DEBUG [pid %ld] ", (long)getpid());
    if (n < 0 || n >= (int)sizeof line) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", line); /* one call: lines of concurrent ranks do not interleave */
}

void mf__debug_reset(void) {
    pthread_mutex_lock(&mf__debug_mu);
    memset(mf__debug_seen, 0, sizeof mf__debug_seen);
    mf__debug_count = 0;
    pthread_mutex_unlock(&mf__debug_mu);
    atomic_store_explicit(&mf__debug_state, -1, memory_order_relaxed);
}

/* ---- config structs and struct sizes ----------------------------------------------------- */

/* Every config struct starts with these three fields. */
typedef struct mf__config_header {
    uint32_t size, magic, version;
} mf__config_header_t;

mf_result_t mf__read_config(const void *in, size_t lib_size, size_t min_size, uint32_t magic, const char *fn,
                            const char *init, void *out) {
    mf__config_header_t h;
    memcpy(&h, in, sizeof h);
    if (h.magic != magic)
        return mf__error(MF_ERR_INVALID_USAGE, "%s: config header is wrong (magic 0x%x); initialise it with %s", fn,
                         h.magic, init);
    if (h.version < 1 || h.version > MF_API_VERSION)
        return mf__error(MF_ERR_INVALID_USAGE, "%s: config version %u, this library reads versions 1 to %d (a newer "
                         "header needs a newer library)", fn, h.version, MF_API_VERSION);
    if (h.size < min_size || h.size > lib_size)
        return mf__error(MF_ERR_INVALID_USAGE, "%s: config size %u is outside [%zu, %zu] (version %u); initialise it "
                         "with %s", fn, h.size, min_size, lib_size, h.version, init);
    memset(out, 0, lib_size);
    memcpy(out, in, h.size);
    mf__config_header_t cur = {(uint32_t)lib_size, magic, MF_API_VERSION};
    memcpy(out, &cur, sizeof cur);
    return MF_SUCCESS;
}

int64_t mf_get_struct_size(mf_struct_t which) {
    switch (which) {
    case MF_STRUCT_TENSOR: return (int64_t)sizeof(mf_tensor_t);
    case MF_STRUCT_GROUP_CONFIG: return (int64_t)sizeof(mf_group_config_t);
    case MF_STRUCT_COMM_CONFIG: return (int64_t)sizeof(mf_comm_config_t);
    case MF_STRUCT_BOOTSTRAP: return (int64_t)sizeof(mf_bootstrap_t);
    case MF_STRUCT_MOE_CONFIG: return (int64_t)sizeof(mf_moe_config_t);
    case MF_STRUCT_MOE_INFO: return (int64_t)sizeof(mf_moe_info_t);
    case MF_STRUCT_MOE_WEIGHTS: return (int64_t)sizeof(mf_moe_weights_t);
    case MF_STRUCT_MOE_FORWARD_IN: return (int64_t)sizeof(mf_moe_forward_in_t);
    case MF_STRUCT_MOE_FORWARD_OUT: return (int64_t)sizeof(mf_moe_forward_out_t);
    case MF_STRUCT_DISPATCH_IN: return (int64_t)sizeof(mf_dispatch_in_t);
    case MF_STRUCT_DISPATCH_OUT: return (int64_t)sizeof(mf_dispatch_out_t);
    case MF_STRUCT_COMBINE_IN: return (int64_t)sizeof(mf_combine_in_t);
    case MF_STRUCT_COMBINE_OUT: return (int64_t)sizeof(mf_combine_out_t);
    case MF_STRUCT_PHASE_TIMES: return (int64_t)sizeof(mf_phase_times_t);
    case MF_STRUCT_MOE_BALANCE_STATS: return (int64_t)sizeof(mf_moe_balance_stats_t);
    case MF_STRUCT_EXPERTS_IN: return (int64_t)sizeof(mf_experts_in_t);
    case MF_STRUCT_EXPERTS_OUT: return (int64_t)sizeof(mf_experts_out_t);
    case MF_STRUCT_EXCHANGE_EVENTS: return (int64_t)sizeof(mf_exchange_events_t);
    case MF_NUM_STRUCTS: break;
    }
    return 0;
}

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
