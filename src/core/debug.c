/*
 * debug.c — MF_DEBUG decision reports (core/debug.h): the keys of the decisions seen, and the one
 * place the library writes to stderr.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/debug.h"
#include "core/params.h"

#define MF__DEBUG_KEYS 4096 /* distinct decisions remembered; past this, no more reports */

static _Atomic int mf__debug_state = -1; /* -1 not read yet, else 0 / 1 */
static pthread_mutex_t mf__debug_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t mf__debug_seen[MF__DEBUG_KEYS]; /* open addressing; 0 = empty */
static int32_t mf__debug_count;

int mf__debug_on(void) {
    int s = atomic_load_explicit(&mf__debug_state, memory_order_relaxed);
    if (s < 0) { /* concurrent first calls read the same environment: the same answer */
        s = mf__param_debug();
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
