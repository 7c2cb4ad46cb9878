/*
 * errors.c — result codes and the per-thread last-error message.
 *
 * The library never prints: every failure goes through mf__error(), which formats a message into
 * a thread-local buffer that mf_last_error() returns. The one exception is opt-in: MF_DEBUG=1
 * reports the expert-GEMM decisions on stderr (core/debug.h).
 */
#include <stdarg.h>
#include <stdio.h>

#include "core/errors.h"

#define MF__ERROR_LEN 512

static _Thread_local char mf__last_error[MF__ERROR_LEN];

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
