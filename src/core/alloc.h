/*
 * alloc.h — host allocation: one place, with a failure switch for tests (alloc.c), so that every
 * error path of the library can be walked (SQLite's habit). Device memory is the backends'.
 */
#ifndef MF_CORE_ALLOC_H
#define MF_CORE_ALLOC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

void *mf__malloc(size_t bytes);
void *mf__calloc(size_t count, size_t bytes);
void mf__free(void *p);
/* Test hook: the n-th host allocation from now on fails (1 = the next); 0 disables. */
void mf__test_fail_alloc_after(int64_t n);

#ifdef __cplusplus
}
#endif

#endif /* MF_CORE_ALLOC_H */
