/*
 * plan.h — the routing plan of one rank (docs/DESIGN.md layer 2), host version used by the CPU backend
 * and as the oracle for the CUDA plan kernels.
 *
 * From every rank's topk_ids it computes, for this rank's L local experts: rows per expert, the
 * segment offsets of the chosen layout, and the source (rank, token, k) of every receive row in
 * rank-major, then token, then k order (deterministic). It also checks every rank's capacity from
 * the global per-expert counts, so all ranks reach the same verdict without talking.
 */
#ifndef MF_PLAN_PLAN_H
#define MF_PLAN_PLAN_H

#include <stdint.h>

#include "core/internal.h"

typedef struct mf__plan {
    int32_t num_ranks, rank, num_experts, num_local, first_expert;
    int32_t layout, block_m, capacity, max_rows; /* capacity: MASKED C; max_rows: EXPERT_MAJOR */
    int32_t *global_counts; /* [E] rows per expert over all ranks */
    int32_t *counts;        /* [L] rows per local expert */
    int32_t *offsets;       /* [L + 1] first row of each expert (MASKED: e * C) */
    int32_t *cursor;        /* [L] scratch: fill position per expert */
    int32_t *src;           /* [rows, 3] (rank, token, k); rows = max_rows or L * C */
    int32_t num_rows;       /* rows in use: EXPERT_MAJOR offsets[L] (padding included) */
} mf__plan_t;

mf_result_t mf__plan_init(mf__plan_t *plan, const mf_moe_config_t *config, int32_t num_ranks, int32_t rank);
void mf__plan_fini(mf__plan_t *plan);

/* Builds the plan from ids[r] ([T[r], K] int32, values in [-1, E)) of every rank r.
 * MF_ERR_CAPACITY (naming the rank and expert) when any rank's receive rows would not fit. */
mf_result_t mf__plan_build(mf__plan_t *plan, int32_t K, const int32_t *const *ids, const int32_t *T);

/* Receive row of (local expert e, j-th row of it). */
static inline int64_t mf__plan_row(const mf__plan_t *p, int32_t e, int32_t j) { return (int64_t)p->offsets[e] + j; }

#endif /* MF_PLAN_PLAN_H */
