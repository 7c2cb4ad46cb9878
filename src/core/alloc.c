/*
 * alloc.c — the host allocator (core/alloc.h), with the test switch that makes it fail.
 */
#include <stdlib.h>

#include "core/alloc.h"

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
