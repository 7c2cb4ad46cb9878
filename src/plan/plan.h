/*
 * plan.h — the routing plan of one rank (docs/DESIGN.md layer 2), host version used by the CPU backend
 * and as the oracle for the CUDA plan kernels.
 *
 * From every rank's topk_ids it computes, for this rank's L local experts: rows per expert, the
 * segment offsets of the chosen layout, and the source (rank, token, k) of every receive row in
 * rank-major, then token, then k order (deterministic). It also checks every rank's capacity from
 * the global per-expert counts, so all ranks reach the same verdict without talking.
 *
 * Balanced EP (docs/DESIGN.md "Balanced EP"): the plan's units are this rank's *slots*, its Lp = P / R
 * static slots and its B spare slots (slot Lp + j), not logical experts. Every (token, k) goes to
 * one replica of its logical expert, split by src/balance/planner.h from the global counts; with the
 * identity map and B = 0 the slots are the L local experts and the plan is the unbalanced one. A
 * mapped placement (src/plan/placement.h) is such a map, with -1 in empty slots (no rows).
 */
#ifndef MF_PLAN_PLAN_H
#define MF_PLAN_PLAN_H

#include <stdint.h>

#include "moeflow.h"

typedef struct mf__plan {
    int32_t num_ranks, rank, num_experts, num_local, first_expert; /* num_local: slots Lp + B */
    int32_t num_physical, slots_per_rank, spare_slots;             /* P, Lp, B */
    int32_t placement;                                             /* mf_placement_t: home ranks */
    int32_t layout, block_m, capacity, max_rows; /* capacity: MASKED C; max_rows: EXPERT_MAJOR */
    int32_t *global_counts; /* [E] rows per logical expert over all ranks */
    int32_t *counts;        /* [Lp + B] rows per slot of this rank */
    int32_t *offsets;       /* [Lp + B + 1] first row of each slot (MASKED: s * C) */
    int32_t *cursor;        /* [Lp + B] scratch: fill position per slot */
    int32_t *slot_expert;   /* [Lp + B] logical expert of each slot (-1: an empty spare slot) */
    /* Replicas (balance/planner.h): N = P + R * B entries at most. */
    int32_t *rep_off, *rep_rank, *rep_slot, *share, *rep_begin; /* [E + 1], [N] x 4 */
    int32_t *scratch;       /* [E + R * B] */
    int32_t *seen;          /* [E] scratch: rows of each expert met so far */
    int32_t *identity_map;  /* [P] p % E: the map when mf__plan_build gets none */
    int64_t load[MF_MAX_RANKS];      /* rows each rank's slots receive in this call */
    int64_t home_load[MF_MAX_RANKS]; /* the same routing without replicas: e on its placement's rank */
    int32_t *src;           /* [rows, 3] (rank, token, k); rows = max_rows or L * C */
    int32_t num_rows;       /* rows in use: EXPERT_MAJOR offsets[L] (padding included) */
} mf__plan_t;

mf_result_t mf__plan_init(mf__plan_t *plan, const mf_moe_config_t *config, int32_t num_ranks, int32_t rank);
void mf__plan_fini(mf__plan_t *plan);

/* Builds the plan from ids[r] ([T[r], K] int32, values in [-1, E)) of every rank r, the expert
 * map [P] (NULL: the identity, p % E; -1 = an empty slot) and the spare table [R * B] (-1 = empty;
 * NULL = all empty).
 * MF_ERR_CAPACITY (naming the rank and slot) when any rank's receive rows would not fit. */
mf_result_t mf__plan_build(mf__plan_t *plan, int32_t K, const int32_t *const *ids, const int32_t *T,
                           const int32_t *map, const int32_t *spare);

/* Receive row of (local expert e, j-th row of it). */
static inline int64_t mf__plan_row(const mf__plan_t *p, int32_t e, int32_t j) { return (int64_t)p->offsets[e] + j; }

#endif /* MF_PLAN_PLAN_H */
