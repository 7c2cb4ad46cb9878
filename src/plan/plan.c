/*
 * plan.c — the host routing plan (see plan.h). Two passes over every rank's ids: global counts
 * (and the capacity verdict for every rank), then this rank's rows in rank-major order.
 */
#include <string.h>

#include "balance/planner.h"
#include "core/alloc.h"
#include "core/errors.h"
#include "plan/placement.h"
#include "plan/plan.h"

mf_result_t mf__plan_init(mf__plan_t *p, const mf_moe_config_t *c, int32_t R, int32_t rank) {
    memset(p, 0, sizeof *p);
    p->num_ranks = R;
    p->rank = rank;
    p->num_experts = c->num_experts;
    p->num_physical = c->num_physical_experts ? c->num_physical_experts : c->num_experts;
    p->slots_per_rank = p->num_physical / R;
    p->spare_slots = c->spare_slots;
    p->num_local = p->slots_per_rank + p->spare_slots;
    p->placement = c->placement;
    p->first_expert = mf__placement_expert(c->num_experts, R, c->placement, rank, 0);
    p->layout = c->layout;
    p->block_m = c->block_m;
    p->capacity = c->expert_capacity;
    p->max_rows = c->max_recv_rows;
    int64_t rows = c->layout == MF_LAYOUT_MASKED ? (int64_t)p->num_local * p->capacity : p->max_rows;
    p->global_counts = mf__calloc((size_t)p->num_experts, sizeof(int32_t));
    p->counts = mf__calloc((size_t)p->num_local, sizeof(int32_t));
    p->offsets = mf__calloc((size_t)p->num_local + 1, sizeof(int32_t));
    p->cursor = mf__calloc((size_t)p->num_local, sizeof(int32_t));
    p->src = mf__malloc((size_t)rows * 3 * sizeof(int32_t));
    size_t E = (size_t)p->num_experts, N = (size_t)p->num_physical + (size_t)R * p->spare_slots;
    p->slot_expert = mf__calloc((size_t)p->num_local, sizeof(int32_t));
    p->rep_off = mf__calloc(E + 1, sizeof(int32_t));
    p->rep_rank = mf__calloc(N, sizeof(int32_t));
    p->rep_slot = mf__calloc(N, sizeof(int32_t));
    p->share = mf__calloc(N, sizeof(int32_t));
    p->rep_begin = mf__calloc(N, sizeof(int32_t));
    p->scratch = mf__calloc(E + (size_t)R * p->spare_slots, sizeof(int32_t));
    p->seen = mf__calloc(E, sizeof(int32_t));
    p->identity_map = mf__calloc((size_t)p->num_physical, sizeof(int32_t));
    for (int32_t i = 0; p->identity_map && i < p->num_physical; i++) p->identity_map[i] = i % p->num_experts;
    if (!p->global_counts || !p->counts || !p->offsets || !p->cursor || !p->src || !p->slot_expert || !p->rep_off ||
        !p->rep_rank || !p->rep_slot || !p->share || !p->rep_begin || !p->scratch || !p->seen ||
        !p->identity_map) {
        mf__plan_fini(p);
        return mf__error(MF_ERR_OUT_OF_MEMORY, "routing plan: out of host memory for %lld rows", (long long)rows);
    }
    return MF_SUCCESS;
}

void mf__plan_fini(mf__plan_t *p) {
    mf__free(p->global_counts);
    mf__free(p->counts);
    mf__free(p->offsets);
    mf__free(p->cursor);
    mf__free(p->src);
    mf__free(p->slot_expert);
    mf__free(p->rep_off);
    mf__free(p->rep_rank);
    mf__free(p->rep_slot);
    mf__free(p->share);
    mf__free(p->rep_begin);
    mf__free(p->scratch);
    mf__free(p->seen);
    mf__free(p->identity_map);
    memset(p, 0, sizeof *p);
}

static int64_t mf__round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

mf_result_t mf__plan_build(mf__plan_t *p, int32_t K, const int32_t *const *ids, const int32_t *T,
                           const int32_t *map, const int32_t *spare) {
    int32_t R = p->num_ranks, E = p->num_experts, S = p->num_local, Lp = p->slots_per_rank, B = p->spare_slots;
    if (!map) map = p->identity_map;
    memset(p->global_counts, 0, (size_t)E * sizeof(int32_t));
    for (int32_t r = 0; r < R; r++)
        for (int64_t i = 0; i < (int64_t)T[r] * K; i++)
            if (ids[r][i] >= 0 && ids[r][i] < E) p->global_counts[ids[r][i]]++;

    /* Replicas and their shares of every expert's rows (the same on every rank). */
    mf__balance_replicas(E, R, p->num_physical, B, map, B ? spare : NULL, p->rep_off, p->rep_rank, p->rep_slot,
                         p->scratch);
    mf__balance_split(E, R, p->global_counts, p->rep_off, p->rep_rank, p->share, p->load, p->scratch);
    for (int32_t r = 0; r < R; r++) p->home_load[r] = 0;
    for (int32_t e = 0; e < E; e++) {
        p->home_load[mf__placement_rank(E, R, p->placement, e)] += p->global_counts[e];
        for (int32_t i = p->rep_off[e], begin = 0; i < p->rep_off[e + 1]; i++) p->rep_begin[i] = begin, begin += p->share[i];
    }

    /* Capacity verdict for every rank, so that all ranks agree. */
    for (int32_t q = 0; q < R; q++) {
        int64_t rows = 0;
        for (int32_t e = 0; e < E; e++)
            for (int32_t i = p->rep_off[e]; i < p->rep_off[e + 1]; i++) {
                if (p->rep_rank[i] != q) continue;
                if (p->layout == MF_LAYOUT_MASKED && p->share[i] > p->capacity)
                    return mf__error(MF_ERR_CAPACITY,
                                     "expert %d (rank %d, slot %d) receives %d rows > expert_capacity %d; nothing "
                                     "was written", e, q, p->rep_slot[i], p->share[i], p->capacity);
                rows += mf__round_up(p->share[i], p->block_m);
            }
        if (p->layout == MF_LAYOUT_EXPERT_MAJOR && rows > p->max_rows)
            return mf__error(MF_ERR_CAPACITY,
                             "rank %d receives %lld rows (segments padded to %d) > max_recv_rows %d; "
                             "nothing was written", q, (long long)rows, p->block_m, p->max_rows);
    }

    /* This rank's segments, one per slot (an empty spare slot: an empty segment). */
    for (int32_t s = 0; s < S; s++) {
        p->counts[s] = 0;
        p->slot_expert[s] = s < Lp ? map[p->rank * Lp + s] : (spare ? spare[p->rank * B + s - Lp] : -1);
    }
    for (int32_t i = 0; i < p->rep_off[E]; i++)
        if (p->rep_rank[i] == p->rank) p->counts[p->rep_slot[i]] = p->share[i];
    for (int32_t s = 0; s < S; s++)
        p->offsets[s + 1] = p->layout == MF_LAYOUT_MASKED ? (s + 1) * p->capacity
                                                          : p->offsets[s] + (int32_t)mf__round_up(p->counts[s], p->block_m);
    p->num_rows = p->offsets[S];

    /* Rows in rank-major, token, k order: the j-th row of expert e goes to the replica whose range
     * [rep_begin, rep_begin + share) holds j; a fill cursor per slot. */
    int32_t *cursor = p->cursor, *seen = p->seen;
    memset(cursor, 0, (size_t)S * sizeof(int32_t));
    memset(seen, 0, (size_t)E * sizeof(int32_t));
    for (int32_t r = 0; r < R; r++)
        for (int32_t t = 0; t < T[r]; t++)
            for (int32_t k = 0; k < K; k++) {
                int32_t e = ids[r][(int64_t)t * K + k];
                if (e < 0 || e >= E) continue;
                int32_t j = seen[e]++, i = p->rep_off[e];
                while (j >= p->rep_begin[i] + p->share[i]) i++;
                if (p->rep_rank[i] != p->rank) continue;
                int32_t s = p->rep_slot[i];
                int32_t *src = p->src + 3 * mf__plan_row(p, s, cursor[s]++);
                src[0] = r, src[1] = t, src[2] = k;
            }
    if (p->layout == MF_LAYOUT_EXPERT_MAJOR)
        for (int32_t s = 0; s < S; s++)
            for (int64_t row = p->offsets[s] + p->counts[s]; row < p->offsets[s + 1]; row++)
                p->src[3 * row] = p->src[3 * row + 1] = p->src[3 * row + 2] = -1;
    return MF_SUCCESS;
}
