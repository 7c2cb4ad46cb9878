/*
 * debug.h — MF_DEBUG: the one place the library prints (opt-in, stderr; debug.c).
 */
#ifndef MF_CORE_DEBUG_H
#define MF_CORE_DEBUG_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* MF_DEBUG=1 (read once per process) makes the expert-GEMM selection of both backends report each
 * distinct decision (layer, phase, shape class) once: the kernel that ran and why every other
 * family declined (docs/API.md "Environment"). Off, the cost is one relaxed atomic load per
 * dispatcher call; on, a hash lookup under a mutex per call and a line per new decision. Never
 * synchronises a device. */
int mf__debug_on(void);
/* 1 the first time `key` is seen in this process (then 0); 0 when the table of keys is full. */
int mf__debug_first(uint64_t key);
/* FNV-1a over `n` integers: the key of a decision. */
uint64_t mf__debug_key(const int64_t *v, int n);
/* Writes "moeflow DEBUG [pid P] <message>" and a newline to stderr in one call. */
void mf__debug(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
/* Test hook: forget the decisions seen and read MF_DEBUG again on the next mf__debug_on(). */
void mf__debug_reset(void);

#ifdef __cplusplus
}
#endif

#endif /* MF_CORE_DEBUG_H */
