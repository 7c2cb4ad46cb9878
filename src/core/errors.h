/*
 * errors.h — how the library fails: mf__error records this thread's last error (mf_last_error)
 * and returns a code; the one family of CHECK macros (NCCL's habit) passes codes up. The library
 * never prints (errors.c; the opt-in exception is core/debug.h).
 */
#ifndef MF_CORE_ERRORS_H
#define MF_CORE_ERRORS_H

#include "moeflow.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Records `fmt` as this thread's last error and returns `code`. */
mf_result_t mf__error(mf_result_t code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void mf__clear_error(void);

/* Evaluates an mf_result_t expression; returns it from the enclosing function when it fails. */
#define MF_CHECK(expr)                          \
    do {                                        \
        mf_result_t mf__r = (expr);             \
        if (mf__r != MF_SUCCESS) return mf__r;  \
    } while (0)

/* Same, but stores the code in `res` and jumps to `label` (for cleanup). */
#define MF_CHECK_GOTO(expr, res, label)          \
    do {                                         \
        (res) = (expr);                          \
        if ((res) != MF_SUCCESS) goto label;     \
    } while (0)

/* Fails with INVALID_ARGUMENT naming the condition when `cond` is false. */
#define MF_REQUIRE(cond, ...)                                                 \
    do {                                                                      \
        if (!(cond)) return mf__error(MF_ERR_INVALID_ARGUMENT, __VA_ARGS__);  \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif /* MF_CORE_ERRORS_H */
