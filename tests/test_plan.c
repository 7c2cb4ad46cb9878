/*
 * test_plan.c — the host routing plan (src/plan): per-expert counts, layout offsets, rank-major
 * source rows, padding markers, and the capacity verdict that every rank must reach alike.
 *
 * The expected plan is rebuilt here the slow, obvious way (for each expert, scan every rank, token
 * and k) and compared field by field.
 */
#include <stdlib.h>
#include <string.h>

#include "core/alloc.h" /* mf__test_fail_alloc_after: the allocator's failure switch */
#include "core/prefix.h" /* mf__prefix_find: the kernels' tile walks */
#include "harness.h"
#include "plan/plan.h"

static mf_moe_config_t plan_config(int32_t E, int32_t K, int32_t S, int32_t layout, int32_t block_m,
                                   int32_t capacity, int32_t max_rows) {
    mf_moe_config_t c = MF_MOE_CONFIG_INIT;
    c.num_experts = E;
    c.num_topk = K;
    c.hidden = 128;
    c.intermediate = 128;
    c.max_tokens_per_rank = S;
    c.layout = layout;
    c.block_m = block_m;
    c.expert_capacity = capacity;
    c.max_recv_rows = max_rows;
    return c;
}

/* Checks plan `p` of `rank` against the obvious construction from ids. */
static int check_plan(const mf__plan_t *p, int32_t R, int32_t K, const int32_t *const *ids, const int32_t *T) {
    int32_t L = p->num_local, first = p->first_expert;
    int64_t expect_offset = 0;
    for (int32_t e = 0; e < L; e++) {
        int32_t n = 0;
        int64_t start = p->layout == MF_LAYOUT_MASKED ? (int64_t)e * p->capacity : expect_offset;
        MFT_CHECK_EQ_INT(p->offsets[e], start);
        for (int32_t r = 0; r < R; r++)
            for (int32_t t = 0; t < T[r]; t++)
                for (int32_t k = 0; k < K; k++) {
                    if (ids[r][t * K + k] != first + e) continue;
                    const int32_t *s = p->src + 3 * (start + n);
                    MFT_CHECK_MSG(s[0] == r && s[1] == t && s[2] == k,
                                  "expert %d row %d: got (%d, %d, %d), expected (%d, %d, %d)", e, n, s[0], s[1],
                                  s[2], r, t, k);
                    n++;
                }
        MFT_CHECK_EQ_INT(p->counts[e], n);
        if (p->layout == MF_LAYOUT_EXPERT_MAJOR) {
            int64_t padded = (n + p->block_m - 1) / p->block_m * p->block_m;
            for (int64_t row = start + n; row < start + padded; row++)
                MFT_CHECK_MSG(p->src[3 * row] == -1 && p->src[3 * row + 1] == -1 && p->src[3 * row + 2] == -1,
                              "expert %d padding row %lld is not marked (-1, -1, -1)", e, (long long)row);
            expect_offset = start + padded;
            MFT_CHECK_EQ_INT(p->offsets[e] % p->block_m, 0);
        }
    }
    if (p->layout == MF_LAYOUT_EXPERT_MAJOR) MFT_CHECK_EQ_INT(p->offsets[L], expect_offset);
    return 0;
}

/* Random routing with distinct ids per token and some -1 drops; every rank's plan checked. */
static int plan_random_case(int32_t R, int32_t E, int32_t K, int32_t S, int32_t layout, int32_t block_m,
                            uint64_t seed) {
    int32_t T[8], *ids[8];
    mft_rng_t rng = {seed};
    for (int32_t r = 0; r < R; r++) {
        T[r] = r == R - 1 ? 0 : mft_rng_int(&rng, S + 1); /* the last rank is idle */
        ids[r] = mft_alloc((size_t)S * K * sizeof(int32_t));
        for (int32_t t = 0; t < T[r]; t++)
            for (int32_t k = 0; k < K; k++) {
                int32_t e, dup;
                do {
                    e = mft_rng_int(&rng, E + 1) - 1; /* -1 .. E-1 */
                    dup = 0;
                    for (int32_t j = 0; j < k; j++) dup |= e >= 0 && ids[r][t * K + j] == e;
                } while (dup);
                ids[r][t * K + k] = e;
            }
    }
    for (int32_t rank = 0; rank < R; rank++) {
        mf_moe_config_t c = plan_config(E, K, S, layout, block_m, R * S, R * S * K + (E / R) * (block_m - 1));
        mf__plan_t p;
        MFT_CHECK_OK(mf__plan_init(&p, &c, R, rank));
        MFT_CHECK_OK(mf__plan_build(&p, K, (const int32_t *const *)ids, T, NULL, NULL));
        int rc = check_plan(&p, R, K, (const int32_t *const *)ids, T);
        mf__plan_fini(&p);
        if (rc) return mft_fail(__FILE__, __LINE__, "rank %d of R=%d E=%d K=%d layout %d", rank, R, E, K, layout);
    }
    for (int32_t r = 0; r < R; r++) free(ids[r]);
    return 0;
}

static int plan_expert_major(void) {
    for (uint64_t seed = 1; seed <= 4; seed++) {
        if (plan_random_case(1, 4, 2, 9, MF_LAYOUT_EXPERT_MAJOR, 4, seed)) return 1;
        if (plan_random_case(4, 8, 3, 17, MF_LAYOUT_EXPERT_MAJOR, 8, seed)) return 1;
        if (plan_random_case(8, 16, 4, 5, MF_LAYOUT_EXPERT_MAJOR, 128, seed)) return 1;
    }
    return 0;
}

static int plan_masked(void) {
    for (uint64_t seed = 1; seed <= 4; seed++) {
        if (plan_random_case(2, 4, 2, 9, MF_LAYOUT_MASKED, 128, seed)) return 1;
        if (plan_random_case(8, 16, 4, 7, MF_LAYOUT_MASKED, 128, seed)) return 1;
    }
    return 0;
}

/* A hand-checked case: R = 2, E = 4 (L = 2), K = 2, block_m = 4. */
static int plan_hand_checked(void) {
    int32_t ids0[] = {1, 2, 0, 1, -1, 3}; /* rank 0: 3 tokens */
    int32_t ids1[] = {1, 0};              /* rank 1: 1 token */
    const int32_t *ids[] = {ids0, ids1};
    int32_t T[] = {3, 1};
    mf_moe_config_t c = plan_config(4, 2, 3, MF_LAYOUT_EXPERT_MAJOR, 4, 0, 16);
    mf__plan_t p;
    MFT_CHECK_OK(mf__plan_init(&p, &c, 2, 0)); /* rank 0 owns experts 0 and 1 */
    MFT_CHECK_OK(mf__plan_build(&p, 2, ids, T, NULL, NULL));
    /* expert 0: (0,1,0), (1,0,1); expert 1: (0,0,0), (0,1,1), (1,0,0) */
    MFT_CHECK_EQ_INT(p.counts[0], 2);
    MFT_CHECK_EQ_INT(p.counts[1], 3);
    MFT_CHECK_EQ_INT(p.offsets[0], 0);
    MFT_CHECK_EQ_INT(p.offsets[1], 4);
    MFT_CHECK_EQ_INT(p.offsets[2], 8);
    const int32_t want[8][3] = {{0, 1, 0}, {1, 0, 1}, {-1, -1, -1}, {-1, -1, -1},
                                {0, 0, 0}, {0, 1, 1}, {1, 0, 0},    {-1, -1, -1}};
    for (int row = 0; row < 8; row++)
        for (int j = 0; j < 3; j++) MFT_CHECK_EQ_INT(p.src[3 * row + j], want[row][j]);
    MFT_CHECK_EQ_INT(p.global_counts[2], 1);
    MFT_CHECK_EQ_INT(p.global_counts[3], 1);
    mf__plan_fini(&p);
    return 0;
}

/* Over capacity on rank 1 only: rank 0 must reach the same verdict. */
static int plan_capacity(void) {
    int32_t ids0[] = {2, 3, 2};
    int32_t ids1[] = {2, 3, 2}; /* K = 1, 3 tokens each: expert 2 receives 4 rows */
    const int32_t *ids[] = {ids0, ids1};
    int32_t T[] = {3, 3};
    for (int32_t rank = 0; rank < 2; rank++) {
        mf_moe_config_t c = plan_config(4, 1, 3, MF_LAYOUT_MASKED, 128, 3, 0);
        mf__plan_t p;
        MFT_CHECK_OK(mf__plan_init(&p, &c, 2, rank));
        MFT_CHECK_ERR(mf__plan_build(&p, 1, ids, T, NULL, NULL), MF_ERR_CAPACITY);
        MFT_CHECK(mft_contains_ci(mf_last_error(), "expert 2"));
        mf__plan_fini(&p);

        /* EXPERT_MAJOR with block_m 4: rank 1 needs 4 + 4 = 8 rows, more than 6. */
        c = plan_config(4, 1, 3, MF_LAYOUT_EXPERT_MAJOR, 4, 0, 6);
        MFT_CHECK_OK(mf__plan_init(&p, &c, 2, rank));
        MFT_CHECK_ERR(mf__plan_build(&p, 1, ids, T, NULL, NULL), MF_ERR_CAPACITY);
        MFT_CHECK(mft_contains_ci(mf_last_error(), "rank 1"));
        mf__plan_fini(&p);
    }
    return 0;
}

/* Allocation failure inside plan_init is reported, not crashed on. */
static int plan_alloc_failure(void) {
    mf_moe_config_t c = plan_config(4, 1, 3, MF_LAYOUT_MASKED, 128, 3, 0);
    for (int64_t n = 1; n <= 5; n++) {
        mf__plan_t p;
        mf__test_fail_alloc_after(n);
        MFT_CHECK_ERR(mf__plan_init(&p, &c, 2, 0), MF_ERR_OUT_OF_MEMORY);
    }
    mf__test_fail_alloc_after(0);
    return 0;
}

/* mf__prefix_find (core/prefix.h; the CUDA kernels' cursors run it on the device) against the walk
 * one segment at a time that it replaced: prefix sums of n segments where most are empty (a few
 * tokens over hundreds of experts), some long and some of one unit, every position from every cursor
 * a walker can hold there (first[s0] <= g), and a walker's ascending positions keeping its cursor. */
static int plan_prefix_find(void) {
    mft_rng_t rng = {77};
    int32_t first[400];
    for (int round = 0; round < 300; round++) {
        const int32_t n = 1 + mft_rng_int(&rng, 384);
        const int32_t empty_pct = round % 3 == 0 ? 0 : (round % 3 == 1 ? 60 : 98);
        first[0] = 0;
        for (int32_t s = 0; s < n; s++)
            first[s + 1] = first[s] + (mft_rng_int(&rng, 100) < empty_pct ? 0 : 1 + mft_rng_int(&rng, round % 2 ? 3 : 40));
        if (first[n] == 0) first[n] = 1; /* at least one position */
        for (int32_t g = 0; g < first[n]; g++) {
            int32_t walk = 0;
            while (first[walk + 1] <= g) walk++;
            for (int32_t s0 = 0; s0 <= walk; s0++) {
                if (first[s0] > g) continue;
                const int32_t got = mf__prefix_find(first, n, s0, g);
                MFT_CHECK_MSG(got == walk, "n %d, g %d from %d: %d, the walk %d", n, g, s0, got, walk);
            }
        }
        int32_t cursor = 0; /* a walker: positions ascend, the cursor carries over */
        for (int32_t g = 0; g < first[n]; g += 1 + mft_rng_int(&rng, 5)) {
            cursor = mf__prefix_find(first, n, cursor, g);
            MFT_CHECK(first[cursor] <= g && g < first[cursor + 1]);
        }
    }
    return 0;
}

/* mf__w2_unit (core/prefix.h; the small kernel's W2 walk, kernels/sm90_small_gemm.cuh): over prefix
 * sums of experts with 0-3 token blocks (most empty, as at a few tokens), nb2 n-blocks each, the
 * units j = 0, 1, ... with the cursor carried over cover every (expert, n-block, token block) once,
 * in ascending experts, and nothing past the count. */
static int plan_w2_units(void) {
    mft_rng_t rng = {91};
    int32_t first[130];
    static uint8_t seen[128][8][4]; /* expert, n-block, token block */
    for (int round = 0; round < 200; round++) {
        const int32_t n = 1 + mft_rng_int(&rng, 128), nb2 = 1 + mft_rng_int(&rng, 8);
        first[0] = 0;
        for (int32_t s = 0; s < n; s++) first[s + 1] = first[s] + (mft_rng_int(&rng, 100) < 70 ? 0 : mft_rng_int(&rng, 4));
        memset(seen, 0, sizeof seen);
        int32_t cursor = 0, j = 0, e, nb, blk, prev = 0;
        for (; mf__w2_unit(first, n, nb2, j, cursor, &e, &nb, &blk); j++) {
            MFT_CHECK_MSG(e >= prev && e < n && nb >= 0 && nb < nb2 && blk >= 0 && blk < first[e + 1] - first[e],
                          "round %d, unit %d: e %d nb %d blk %d", round, j, e, nb, blk);
            seen[e][nb][blk]++;
            prev = cursor = e;
        }
        MFT_CHECK_MSG(j == nb2 * first[n], "round %d: %d units, want %d", round, j, nb2 * first[n]);
        MFT_CHECK(!mf__w2_unit(first, n, nb2, nb2 * first[n] + 3, cursor, &e, &nb, &blk));
        for (int32_t x = 0; x < n; x++)
            for (int32_t y = 0; y < nb2; y++)
                for (int32_t b = 0; b < first[x + 1] - first[x]; b++)
                    MFT_CHECK_MSG(seen[x][y][b] == 1, "round %d: expert %d n-block %d block %d seen %d times", round, x,
                                  y, b, seen[x][y][b]);
    }
    return 0;
}

const mft_test_t mft_tests_plan[] = {
    {"plan_prefix_find", plan_prefix_find, 30},
    {"plan_w2_units", plan_w2_units, 30},
    {"plan_hand_checked", plan_hand_checked, 10},
    {"plan_expert_major", plan_expert_major, 30},
    {"plan_masked", plan_masked, 30},
    {"plan_capacity", plan_capacity, 10},
    {"plan_alloc_failure", plan_alloc_failure, 10},
    {NULL, NULL, 0},
};
