/*
 * balance.h (cuda) — the balancing planner of src/plan/balance.h run on the device: the first
 * piece of the CUDA side of balanced EP (docs/DECISIONS.md "Balanced EP", phase 2). C linkage and
 * no CUDA types, so that the C test suite can call it; the stream is a cudaStream_t as void *.
 *
 * Dimension legend: E logical experts, R ranks, P physical slots, B spare slots per rank,
 * N = P + R * B replica entries.
 */
#ifndef MF_CUDA_BALANCE_H
#define MF_CUDA_BALANCE_H

#include <stdint.h>

#include "core/internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One call of mf__balance_pick; every pointer is DEVICE memory. */
typedef struct mf__balance_pick_params {
    int32_t E, R, P, B;
    const int32_t *counts;   /* [E] the previous forward's global counts */
    const int32_t *map;      /* [P] */
    const int32_t *resident; /* [R * B] the spare table now (-1 = empty), or NULL */
    int32_t *spare;          /* [R * B] out: the next table */
    int32_t *scratch;        /* [mf__balance_scratch_words(E, R, P, B)] int32 words */
} mf__balance_pick_params_t;

/* int32 words of scratch one pick needs (replica lists, shares, loads, candidates' scratch). */
int64_t mf__balance_scratch_words(int32_t E, int32_t R, int32_t P, int32_t B);

/* Runs the pick on `stream` (one thread: the simulation is sequential; a block-parallel version
 * is phase 2's). Asynchronous, graph-capturable; MF_ERR_CUDA if the launch fails. */
mf_result_t mf__cuda_balance_pick(const mf__balance_pick_params_t *params, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MF_CUDA_BALANCE_H */
