/*
 * plan.c — the host routing plan (see plan.h). Two passes over every rank's ids: global counts
 * (and the capacity verdict for every rank), then this rank's rows in rank-major order.
 */
#include <string.h>

#include "plan/plan.h"

mf_result_t mf__plan_init(mf__plan_t *p, const mf_moe_config_t *c, int32_t R, int32_t rank) {
    memset(p, 0, sizeof *p);
    p->num_ranks = R;
    p->rank = rank;
    p->num_experts = c->num_experts;
    p->num_local = c->num_experts / R;
    p->first_expert = rank * p->num_local;
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
    if (!p->global_counts || !p->counts || !p->offsets || !p->cursor || !p->src) {
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
    memset(p, 0, sizeof *p);
}

static int64_t mf__round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

mf_result_t mf__plan_build(mf__plan_t *p, int32_t K, const int32_t *const *ids, const int32_t *T) {
    int32_t R = p->num_ranks, E = p->num_experts, L = p->num_local;
    memset(p->global_counts, 0, (size_t)E * sizeof(int32_t));
    for (int32_t r = 0; r < R; r++)
        for (int64_t i = 0; i < (int64_t)T[r] * K; i++)
            if (ids[r][i] >= 0 && ids[r][i] < E) p->global_counts[ids[r][i]]++;

    /* Capacity verdict for every rank, so that all ranks agree. */
    for (int32_t q = 0; q < R; q++) {
        int64_t rows = 0;
        for (int32_t e = q * L; e < (q + 1) * L; e++) {
            if (p->layout == MF_LAYOUT_MASKED && p->global_counts[e] > p->capacity)
                return mf__error(MF_ERR_CAPACITY,
                                 "expert %d (rank %d) receives %d rows > expert_capacity %d; nothing was "
                                 "written", e, q, p->global_counts[e], p->capacity);
            rows += mf__round_up(p->global_counts[e], p->block_m);
        }
        if (p->layout == MF_LAYOUT_EXPERT_MAJOR && rows > p->max_rows)
            return mf__error(MF_ERR_CAPACITY,
                             "rank %d receives %lld rows (segments padded to %d) > max_recv_rows %d; "
                             "nothing was written", q, (long long)rows, p->block_m, p->max_rows);
    }

    /* This rank's segments. */
    for (int32_t e = 0; e < L; e++) {
        p->counts[e] = p->global_counts[p->first_expert + e];
        p->offsets[e + 1] = p->layout == MF_LAYOUT_MASKED
                                ? (e + 1) * p->capacity
                                : p->offsets[e] + (int32_t)mf__round_up(p->counts[e], p->block_m);
    }
    p->num_rows = p->offsets[L];

    /* Rows in rank-major, token, k order; a fill cursor per expert. */
    int32_t *cursor = p->cursor;
    memset(cursor, 0, (size_t)L * sizeof(int32_t));
    for (int32_t r = 0; r < R; r++)
        for (int32_t t = 0; t < T[r]; t++)
            for (int32_t k = 0; k < K; k++) {
                int32_t e = ids[r][(int64_t)t * K + k] - p->first_expert;
                if (e < 0 || e >= L) continue;
                int32_t *s = p->src + 3 * mf__plan_row(p, e, cursor[e]++);
                s[0] = r, s[1] = t, s[2] = k;
            }
    if (p->layout == MF_LAYOUT_EXPERT_MAJOR)
        for (int32_t e = 0; e < L; e++)
            for (int64_t row = p->offsets[e] + p->counts[e]; row < p->offsets[e + 1]; row++)
                p->src[3 * row] = p->src[3 * row + 1] = p->src[3 * row + 2] = -1;
    return MF_SUCCESS;
}
