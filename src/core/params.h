/*
 * params.h — the tunables: the environment variables (MF_TIMEOUT_MS, MF_DEBUG, MF_PDL, MF_SMALL,
 * MF_DECODE_TOKENS, MF_DECODE_L2, MF_TMA_TAILS), all read in params.c, which holds their one table.
 */
#ifndef MF_CORE_PARAMS_H
#define MF_CORE_PARAMS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

int64_t mf__param_timeout_ms(void); /* MF_TIMEOUT_MS, default 30000 */
int32_t mf__param_pdl(void);        /* MF_PDL: 0 when it is 0, else 1 (read by each CUDA comm's init) */
int32_t mf__param_small(void);      /* MF_SMALL: 0 to 5, or -1 when unset (each CUDA comm's init) */
int32_t mf__param_decode_tokens(void); /* MF_DECODE_TOKENS: 8, 16, 32 or 64 (default; each CUDA comm's init) */
int32_t mf__param_decode_l2(void);     /* MF_DECODE_L2: 1 on, else 0 (default; each CUDA comm's init) */
int32_t mf__param_tma_tails(void);     /* MF_TMA_TAILS: 0 off, else 1 (default; each CUDA comm's init) */
int32_t mf__param_debug(void);      /* MF_DEBUG: 1 when it is a positive integer, else 0 (core/debug.h) */
/* Resolves a config's timeout: 0 = mf__param_timeout_ms(). */
static inline int64_t mf__timeout_or_default(int64_t ms) { return ms ? ms : mf__param_timeout_ms(); }

#ifdef __cplusplus
}
#endif

#endif /* MF_CORE_PARAMS_H */
