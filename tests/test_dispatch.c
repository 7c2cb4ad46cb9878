/*
 * test_dispatch.c — the communication-only pair mf_dispatch / mf_combine on the CPU backend,
 * compared bitwise with identity payloads (STYLE.md "Tests").
 *
 * Every source row x[r][t] carries (r + 1, t + 1) in its first two elements and a hash of
 * (round, r, t, h) elsewhere, so a misrouted row is found among all source rows and named. Dispatch
 * is checked row by row: recv_src in rank-major, then token, then k order per local expert; counts;
 * EXPERT_MAJOR offsets (multiples of block_m, tightly packed) and padding rows marked (-1, -1, -1);
 * MASKED rows past the count untouched; FP8 rows and scales equal to this file's own 1x128
 * quantisation of the source row. Combine is fed expert rows that encode (rank, token, k) and must
 * return, bit for bit, bf16(sum over k ascending of w[t,k] * row) accumulated in fp32 (-1 skipped).
 * Several rounds reuse one layer and one set of buffers with different routing and T; each rank
 * runs on its own thread (mft_run_ranks), creating its layer collectively.
 *
 * The same checks run on layers whose segments are not E / R contiguous experts: placements
 * (uneven LINEAR, ROUND_ROBIN: segment l is the placement's local expert l, all of its rows) and
 * expert maps (replicas, permutations: segment l is slot map[rank * Lp + l], which takes the rows
 * [begin, begin + share) of its expert's rank-major order that the balancing split gives it,
 * computed here with src/balance/planner.h's serial functions).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "balance/planner.h"

#define DMAX_R 8
#define DROUNDS 4
#define DTIMEOUT_MS 15000
#define BF16_NAN 0x7fc0

typedef struct dround {
    int32_t T[DMAX_R];
    uint16_t *x[DMAX_R];   /* [S, H] */
    uint8_t *qx[DMAX_R];   /* FP8: [S, H], the expected quantisation of x */
    float *qs[DMAX_R];     /* FP8: [S, H / 128] */
    int32_t *ids[DMAX_R];  /* [S, K] */
    float *w[DMAX_R];      /* [S, K] */
} dround_t;

#define DMAX_E 64
#define DMAX_P (DMAX_E + 4 * DMAX_R)

typedef struct dctx {
    int32_t R, E, K, H, S, dtype, layout, ue8m0, block_m;
    int32_t placement;     /* mf_placement_t */
    int32_t P;             /* > 0: the layer has this expert map of P slots (map) */
    int32_t map[DMAX_P];
    dround_t rounds[DROUNDS];
    mf_group_t group;
} dctx_t;

/* The rank holding expert g under the placement (docs/API.md section 3). */
static int32_t placement_rank(const dctx_t *c, int32_t g) {
    if (c->placement == MF_PLACEMENT_ROUND_ROBIN) return g % c->R;
    int32_t r = 0, end = c->E / c->R + (0 < c->E % c->R); /* LINEAR: E / R each, the first E % R one more */
    while (g >= end) r++, end += c->E / c->R + (r < c->E % c->R);
    return r;
}

/* Which rows segment `e` of `rank` holds in round `rd`: expert *g's rows [*begin, *begin + *count)
 * of its rank-major, token, k order (all of them without a map; the balancing split's share of the
 * slot with one). */
static void segment_rows(const dctx_t *c, const dround_t *rd, int32_t rank, int32_t e, int32_t *g, int32_t *begin,
                         int32_t *count) {
    int32_t counts[DMAX_E] = {0};
    for (int32_t r = 0; r < c->R; r++)
        for (int32_t i = 0; i < rd->T[r] * c->K; i++)
            if (rd->ids[r][i] >= 0) counts[rd->ids[r][i]]++;
    if (!c->P) { /* the placement's e-th expert of this rank, in ascending ids */
        int32_t l = e;
        for (*g = 0; *g < c->E && (placement_rank(c, *g) != rank || l-- > 0); ++*g) continue;
        *begin = 0, *count = counts[*g];
        return;
    }
    int32_t rep_off[DMAX_E + 1], rep_rank[DMAX_P], rep_slot[DMAX_P], share[DMAX_P], scratch[DMAX_E];
    int64_t load[DMAX_R];
    mf__balance_replicas(c->E, c->R, c->P, 0, c->map, NULL, rep_off, rep_rank, rep_slot, scratch);
    mf__balance_split(c->E, c->R, counts, rep_off, rep_rank, share, load, scratch);
    *g = c->map[rank * (c->P / c->R) + e];
    *begin = 0;
    for (int32_t i = rep_off[*g]; i < rep_off[*g + 1]; *begin += share[i], i++)
        if (rep_rank[i] == rank && rep_slot[i] == e) {
            *count = share[i];
            return;
        }
    *count = 0; /* not reached: every slot of the map is a replica */
}

static uint16_t x_value(int round, int32_t r, int32_t t, int32_t h) {
    if (h == 0) return mf_bf16_from_float((float)(r + 1));
    if (h == 1) return mf_bf16_from_float((float)(t + 1));
    uint64_t z = mft_hash4((uint64_t)round, (uint64_t)r, (uint64_t)t, (uint64_t)h);
    return mf_bf16_from_float((float)((double)(z >> 11) * 0x1p-53 * 8.0 - 4.0));
}

/* The expert output row of (rank, token, k): exact (r+1, t+1, k+1) first, then a hash. Tokens
 * t % 3 == 0 (whose weights are all 1) carry, in every column h % 4 == 3, the order probe
 * 2^30, 1, -2^30, 0.5: summed in fp32 in ascending k that is 0.5; in any other order, pairwise,
 * or in double it is not (0, 1 or 1.5), so the K-sum order of the contract is checked bitwise. */
static uint16_t partial_value(int round, int32_t r, int32_t t, int32_t k, int32_t h) {
    if (h == 0) return mf_bf16_from_float((float)(r + 1));
    if (h == 1) return mf_bf16_from_float((float)(t + 1));
    if (h == 2) return mf_bf16_from_float((float)(k + 1));
    if (t % 3 == 0 && h % 4 == 3) {
        static const float probe[4] = {0x1p30f, 1.0f, -0x1p30f, 0.5f};
        return mf_bf16_from_float(probe[k % 4]);
    }
    uint64_t z = mft_hash4((uint64_t)round * 64u + (uint64_t)k, (uint64_t)r, (uint64_t)t,
                           (uint64_t)h + 1000u);
    return mf_bf16_from_float((float)((double)(z >> 11) * 0x1p-53 * 4.0 - 2.0));
}

/* Routing of one round. mode 0: uniform K distinct ids with 20% drops; 1: the last expert is every
 * token's k = 0 choice (hot), the rest uniform; 2: T varies per rank (0, 1, S, ...), uniform;
 * 3: every token to the first max(L, K) experts only (rank 0's when L >= K; the other ranks
 * receive nothing). */
static void make_round(dctx_t *c, int round, int mode, uint64_t seed) {
    dround_t *rd = &c->rounds[round];
    mft_rng_t rng = {seed};
    int32_t L = c->E / c->R;
    for (int32_t r = 0; r < c->R; r++) {
        static const int32_t t_mode2[DMAX_R] = {0, 1, -1, 3, 0, -1, 2, 5}; /* -1 = S */
        int32_t T = c->S;
        if (mode == 2) T = t_mode2[r] < 0 ? c->S : (t_mode2[r] < c->S ? t_mode2[r] : c->S);
        if (mode == 0 && r == 1) T = c->S - 3;
        rd->T[r] = T;
        size_t xb = (size_t)c->S * (size_t)c->H;
        rd->x[r] = (uint16_t *)mft_alloc(xb * 2);
        rd->ids[r] = (int32_t *)mft_alloc((size_t)c->S * (size_t)c->K * 4);
        rd->w[r] = (float *)mft_alloc((size_t)c->S * (size_t)c->K * 4);
        for (int32_t t = 0; t < T; t++) {
            for (int32_t h = 0; h < c->H; h++) rd->x[r][(size_t)t * c->H + h] = x_value(round, r, t, h);
            int32_t *id = rd->ids[r] + (size_t)t * c->K;
            for (int32_t k = 0; k < c->K; k++) {
                int32_t e, dup;
                do {
                    if (mode == 1 && k == 0) e = c->E - 1;
                    else if (mode == 3) e = mft_rng_int(&rng, L > c->K ? L : c->K);
                    else e = mft_rng_int(&rng, c->E);
                    dup = 0;
                    for (int32_t j = 0; j < k; j++) dup |= id[j] == e;
                } while (dup);
                id[k] = e;
                rd->w[r][(size_t)t * c->K + k] = t % 3 == 0 ? 1.0f : (float)mft_rng_uniform(&rng);
            }
            if (mode == 0)
                for (int32_t k = 0; k < c->K; k++)
                    if (mft_rng_uniform(&rng) < 0.2) id[k] = -1;
        }
        if (mode == 0 && T > 2)
            for (int32_t k = 0; k < c->K; k++) rd->ids[r][2 * c->K + k] = -1; /* all dropped */
        if (c->dtype == MF_DTYPE_FP8_E4M3) {
            rd->qx[r] = (uint8_t *)mft_alloc(xb);
            rd->qs[r] = (float *)mft_alloc((size_t)c->S * (size_t)(c->H / 128) * 4);
            mft_quant_blocks(rd->x[r], 1, T, c->H, 1, c->ue8m0, rd->qx[r], rd->qs[r]);
        }
    }
}

static void free_rounds(dctx_t *c) {
    for (int i = 0; i < DROUNDS; i++)
        for (int32_t r = 0; r < DMAX_R; r++) {
            free(c->rounds[i].x[r]);
            free(c->rounds[i].qx[r]);
            free(c->rounds[i].qs[r]);
            free(c->rounds[i].ids[r]);
            free(c->rounds[i].w[r]);
        }
}

/* ---- one rank's buffers and checks -------------------------------------------------------- */

typedef struct rank_bufs {
    int32_t L, C, rows, block_m, max_recv_rows;
    size_t elem;
    uint8_t *recv_x;   /* [rows, H] of elem bytes */
    float *recv_scales; /* [rows, H / 128] (FP8) */
    int32_t *recv_src; /* [rows, 3] */
    int32_t *counts;   /* [L] */
    int32_t *offsets;  /* [L + 1] (EXPERT_MAJOR) */
    uint16_t *expert_out; /* [rows, H] */
    uint16_t *y;       /* [S, H] */
} rank_bufs_t;

/* The payload of source row (r, t) matches recv row `row`? */
static int row_matches(const dctx_t *c, const dround_t *rd, const rank_bufs_t *b, int64_t row,
                       int32_t r, int32_t t) {
    int32_t H = c->H;
    if (c->dtype == MF_DTYPE_FP8_E4M3) {
        return memcmp(b->recv_x + (size_t)row * H, rd->qx[r] + (size_t)t * H, (size_t)H) == 0 &&
               memcmp(b->recv_scales + (size_t)row * (H / 128), rd->qs[r] + (size_t)t * (H / 128),
                      (size_t)(H / 128) * 4) == 0;
    }
    return memcmp(b->recv_x + (size_t)row * H * 2, rd->x[r] + (size_t)t * H, (size_t)H * 2) == 0;
}

/* Names the source row whose payload recv row `row` holds, for a failure message. */
static void name_row(const dctx_t *c, const dround_t *rd, const rank_bufs_t *b, int64_t row) {
    for (int32_t r = 0; r < c->R; r++)
        for (int32_t t = 0; t < rd->T[r]; t++)
            if (row_matches(c, rd, b, row, r, t)) {
                mft_note("recv row %lld holds the payload of (rank %d, token %d)", (long long)row,
                         (int)r, (int)t);
                return;
            }
    mft_note("recv row %lld holds no source row's payload (first bytes 0x%02x 0x%02x 0x%02x 0x%02x)",
             (long long)row, b->recv_x[(size_t)row * c->H * b->elem],
             b->recv_x[(size_t)row * c->H * b->elem + 1], b->recv_x[(size_t)row * c->H * b->elem + 2],
             b->recv_x[(size_t)row * c->H * b->elem + 3]);
}

static int rows_poisoned(const rank_bufs_t *b, const dctx_t *c, int64_t row, int64_t n) {
    size_t H = (size_t)c->H;
    if (mft_first_unpoisoned(b->recv_x + (size_t)row * H * b->elem, (size_t)n * H * b->elem) >= 0)
        return 0;
    if (mft_first_unpoisoned(b->recv_src + (size_t)row * 3, (size_t)n * 12) >= 0) return 0;
    if (c->dtype == MF_DTYPE_FP8_E4M3 &&
        mft_first_unpoisoned(b->recv_scales + (size_t)row * (H / 128), (size_t)n * (H / 128) * 4) >= 0)
        return 0;
    return 1;
}

static int check_dispatch(const dctx_t *c, int round, int32_t rank, const rank_bufs_t *b) {
    const dround_t *rd = &c->rounds[round];
    int32_t L = b->L, K = c->K;
    int em = c->layout == MF_LAYOUT_EXPERT_MAJOR;
    int64_t next_start = 0;
    if (em) MFT_CHECK_EQ_INT(b->offsets[0], 0);
    for (int32_t e = 0; e < L; e++) {
        /* The expected list: expert g's rows [first, first + n) in rank-major, then token, then k order. */
        int32_t g, first, n;
        segment_rows(c, rd, rank, e, &g, &first, &n);
        if (b->counts[e] != n)
            MFT_FAIL("round %d rank %d: expert_counts[%d] (global expert %d) = %d, expected %d", round,
                     (int)rank, (int)e, (int)g, (int)b->counts[e], (int)n);
        int64_t base;
        if (em) {
            int32_t off = b->offsets[e], end = b->offsets[e + 1];
            if (off != next_start || off % b->block_m != 0)
                MFT_FAIL("round %d rank %d: expert_offsets[%d] = %d, expected %lld (segments packed, "
                         "each start a multiple of block_m = %d)", round, (int)rank, (int)e,
                         (int)off, (long long)next_start, (int)b->block_m);
            next_start = off + ((int64_t)n + b->block_m - 1) / b->block_m * b->block_m;
            if (end != next_start)
                MFT_FAIL("round %d rank %d: expert_offsets[%d] = %d, expected %lld (count %d padded "
                         "to block_m %d)", round, (int)rank, (int)e + 1, (int)end,
                         (long long)next_start, (int)n, (int)b->block_m);
            if (end > b->max_recv_rows)
                MFT_FAIL("round %d rank %d: expert_offsets[%d] = %d past max_recv_rows %d", round,
                         (int)rank, (int)e + 1, (int)end, (int)b->max_recv_rows);
            base = off;
            for (int64_t row = off + n; row < end; row++) {
                const int32_t *src = b->recv_src + row * 3;
                if (src[0] != -1 || src[1] != -1 || src[2] != -1)
                    MFT_FAIL("round %d rank %d: padding row %lld of expert %d has recv_src (%d, %d, "
                             "%d), expected (-1, -1, -1)", round, (int)rank, (long long)row, (int)e,
                             (int)src[0], (int)src[1], (int)src[2]);
            }
        } else {
            if (n > b->C) MFT_FAIL("test bug: %d rows for expert capacity %d", (int)n, (int)b->C);
            base = (int64_t)e * b->C;
            if (!rows_poisoned(b, c, base + n, b->C - n))
                MFT_FAIL("round %d rank %d: MASKED expert %d: rows at or past its count %d were "
                         "written", round, (int)rank, (int)e, (int)n);
        }
        int32_t j = 0, seen = 0;
        for (int32_t r = 0; r < c->R; r++)
            for (int32_t t = 0; t < rd->T[r]; t++)
                for (int32_t k = 0; k < K; k++) {
                    if (rd->ids[r][(size_t)t * K + k] != g || seen++ < first || j >= n) continue;
                    int64_t row = base + j++;
                    const int32_t *src = b->recv_src + row * 3;
                    if (src[0] != r || src[1] != t || src[2] != k) {
                        mft_fail(__FILE__, __LINE__,
                                 "round %d rank %d: expert %d row %d (recv row %lld): recv_src = (%d, "
                                 "%d, %d), expected (%d, %d, %d)", round, (int)rank, (int)e,
                                 (int)(j - 1), (long long)row, (int)src[0], (int)src[1],
                                 (int)src[2], (int)r, (int)t, (int)k);
                        name_row(c, rd, b, row);
                        return 1;
                    }
                    if (!row_matches(c, rd, b, row, r, t)) {
                        mft_fail(__FILE__, __LINE__,
                                 "round %d rank %d: expert %d row %d (recv row %lld) should hold "
                                 "(rank %d, token %d) %s", round, (int)rank, (int)e, (int)(j - 1),
                                 (long long)row, (int)r, (int)t,
                                 c->dtype == MF_DTYPE_FP8_E4M3 ? "quantised 1x128 (codes + scales)"
                                                                : "bitwise");
                        name_row(c, rd, b, row);
                        return 1;
                    }
                }
    }
    if (em && next_start > b->max_recv_rows)
        MFT_FAIL("round %d rank %d: segments need %lld rows > max_recv_rows %d", round, (int)rank,
                 (long long)next_start, (int)b->max_recv_rows);
    return 0;
}

/* Fills expert_out from what dispatch said each row holds: the (rank, token, k) payload for real
 * rows, NaN for padding and unused rows (so a combine that reads them shows it). */
static void fill_expert_out(const dctx_t *c, int round, const rank_bufs_t *b) {
    int32_t H = c->H;
    for (int64_t row = 0; row < b->rows; row++) {
        uint16_t *out = b->expert_out + (size_t)row * H;
        int valid;
        const int32_t *src = b->recv_src + row * 3;
        if (c->layout == MF_LAYOUT_EXPERT_MAJOR) {
            valid = row < b->offsets[b->L] && src[0] >= 0;
        } else {
            valid = row % b->C < b->counts[row / b->C];
        }
        for (int32_t h = 0; h < H; h++)
            out[h] = valid ? partial_value(round, src[0], src[1], src[2], h) : BF16_NAN;
    }
}

static int check_combine(const dctx_t *c, int round, int32_t rank, const rank_bufs_t *b) {
    const dround_t *rd = &c->rounds[round];
    int32_t T = rd->T[rank], K = c->K, H = c->H;
    int64_t bad = 0;
    for (int32_t t = 0; t < T; t++)
        for (int32_t h = 0; h < H; h++) {
            float acc = 0.0f;
            for (int32_t k = 0; k < K; k++) {
                if (rd->ids[rank][(size_t)t * K + k] < 0) continue;
                volatile float prod = rd->w[rank][(size_t)t * K + k] *
                                      mf_bf16_to_float(partial_value(round, rank, t, k, h));
                acc = acc + prod;
            }
            uint16_t want = mf_bf16_from_float(acc), got = b->y[(size_t)t * H + h];
            if (got != want && bad++ < 8)
                mft_note("round %d rank %d: y[t=%d, h=%d] = 0x%04x (%g), expected 0x%04x (%g)", round,
                         (int)rank, (int)t, (int)h, got, (double)mf_bf16_to_float(got), want,
                         (double)mf_bf16_to_float(want));
        }
    if (bad) MFT_FAIL("round %d rank %d: combine: %lld elements of y differ", round, (int)rank,
                      (long long)bad);
    size_t used = (size_t)T * H * 2, all = (size_t)c->S * H * 2;
    int64_t at = mft_first_unpoisoned((const char *)b->y + used, all - used);
    if (at >= 0)
        MFT_FAIL("round %d rank %d: combine wrote y past T = %d rows", round, (int)rank, (int)T);
    return 0;
}

static int dispatch_rank(int32_t rank, void *arg) {
    dctx_t *c = (dctx_t *)arg;
    mf_comm_t comm = NULL;
    mf_moe_t moe = NULL;
    MFT_CHECK_OK(mf_group_get_comm(c->group, rank, &comm));
    mf_moe_config_t cfg = MF_MOE_CONFIG_INIT;
    cfg.num_experts = c->E;
    cfg.num_topk = c->K;
    cfg.hidden = c->H;
    cfg.intermediate = 128;
    cfg.max_tokens_per_rank = c->S;
    cfg.dtype = c->dtype;
    cfg.layout = c->layout;
    cfg.block_m = c->block_m;
    cfg.ue8m0_scales = c->ue8m0;
    cfg.placement = c->placement;
    cfg.num_physical_experts = c->P;
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, &moe));
    if (c->P) MFT_CHECK_OK(mf_moe_set_expert_map(moe, c->map, c->P));
    mf_moe_info_t info;
    MFT_CHECK_OK(mf_moe_get_info(moe, &info));
    MFT_CHECK_EQ_INT(info.rank, rank);
    int32_t mine = 0, first = -1; /* this rank's experts under the placement, and the first */
    for (int32_t g = c->E - 1; g >= 0; g--)
        if (placement_rank(c, g) == rank) mine++, first = g;
    MFT_CHECK_EQ_INT(info.num_local_experts, mine);
    MFT_CHECK_EQ_INT(info.first_expert, first);
    MFT_CHECK_EQ_INT(info.num_local_slots, c->P ? c->P / c->R : mine);
    if (c->block_m) MFT_CHECK_EQ_INT(info.block_m, c->block_m);

    rank_bufs_t b;
    memset(&b, 0, sizeof b);
    b.L = info.num_local_slots;
    b.C = info.expert_capacity;
    b.block_m = info.block_m;
    b.max_recv_rows = info.max_recv_rows;
    b.elem = c->dtype == MF_DTYPE_FP8_E4M3 ? 1 : 2;
    int em = c->layout == MF_LAYOUT_EXPERT_MAJOR;
    b.rows = em ? info.max_recv_rows : b.L * b.C;
    size_t H = (size_t)c->H, rows = (size_t)b.rows;
    b.recv_x = (uint8_t *)mft_alloc(rows * H * b.elem);
    b.recv_scales = (float *)mft_alloc(rows * (H / 128) * 4);
    b.recv_src = (int32_t *)mft_alloc(rows * 12);
    b.counts = (int32_t *)mft_alloc((size_t)b.L * 4);
    b.offsets = (int32_t *)mft_alloc((size_t)(b.L + 1) * 4);
    b.expert_out = (uint16_t *)mft_alloc(rows * H * 2);
    b.y = (uint16_t *)mft_alloc((size_t)c->S * H * 2);

    mf_dispatch_out_t dout;
    mf_combine_in_t cin;
    mf_combine_out_t cout;
    memset(&dout, 0, sizeof dout);
    mf_dtype_t dt = (mf_dtype_t)c->dtype;
    if (em) {
        dout.recv_x = mft_t2(b.recv_x, dt, b.rows, c->H);
        if (b.elem == 1) dout.recv_scales = mft_t2(b.recv_scales, MF_DTYPE_FP32, b.rows, c->H / 128);
        dout.recv_src = mft_t2(b.recv_src, MF_DTYPE_INT32, b.rows, 3);
        dout.expert_offsets = mft_t1(b.offsets, MF_DTYPE_INT32, b.L + 1);
        cin.expert_out = mft_t2(b.expert_out, MF_DTYPE_BF16, b.rows, c->H);
    } else {
        dout.recv_x = mft_t3(b.recv_x, dt, b.L, b.C, c->H);
        if (b.elem == 1)
            dout.recv_scales = mft_t3(b.recv_scales, MF_DTYPE_FP32, b.L, b.C, c->H / 128);
        dout.recv_src = mft_t3(b.recv_src, MF_DTYPE_INT32, b.L, b.C, 3);
        cin.expert_out = mft_t3(b.expert_out, MF_DTYPE_BF16, b.L, b.C, c->H);
    }
    dout.expert_counts = mft_t1(b.counts, MF_DTYPE_INT32, b.L);

    int failed = 0;
    for (int i = 0; i < DROUNDS; i++) {
        const dround_t *rd = &c->rounds[i];
        int32_t T = rd->T[rank];
        mft_poison(b.recv_x, rows * H * b.elem);
        mft_poison(b.recv_scales, rows * (H / 128) * 4);
        mft_poison(b.recv_src, rows * 12);
        mft_poison(b.counts, (size_t)b.L * 4);
        mft_poison(b.offsets, (size_t)(b.L + 1) * 4);
        mft_poison(b.y, (size_t)c->S * H * 2);
        mf_dispatch_in_t din;
        din.x = mft_t2(rd->x[rank], MF_DTYPE_BF16, T, c->H);
        din.topk_ids = mft_t2(rd->ids[rank], MF_DTYPE_INT32, T, c->K);
        mf_result_t res = mf_dispatch(moe, &din, &dout, NULL);
        if (res != MF_SUCCESS) {
            mft_fail(__FILE__, __LINE__, "round %d rank %d: mf_dispatch -> %s: %s", i, (int)rank,
                     mft_result_name(res), mf_last_error());
            failed = 1;
            break;
        }
        /* After a failed check this rank keeps taking part in every round (unchecked), so the
         * peers finish instead of waiting in vain; only a failed call stops it. */
        if (!failed && check_dispatch(c, i, rank, &b)) failed = 1;
        fill_expert_out(c, i, &b);
        cin.topk_weights = mft_t2(rd->w[rank], MF_DTYPE_FP32, T, c->K);
        cout.y = mft_t2(b.y, MF_DTYPE_BF16, T, c->H);
        res = mf_combine(moe, &cin, &cout, NULL);
        if (res != MF_SUCCESS) {
            mft_fail(__FILE__, __LINE__, "round %d rank %d: mf_combine -> %s: %s", i, (int)rank,
                     mft_result_name(res), mf_last_error());
            failed = 1;
            break;
        }
        if (!failed && check_combine(c, i, rank, &b)) failed = 1;
    }
    /* A rank that stopped early leaves its peers to time out (DTIMEOUT_MS), which they report. */
    MFT_CHECK_OK(mf_moe_destroy(moe));
    free(b.recv_x);
    free(b.recv_scales);
    free(b.recv_src);
    free(b.counts);
    free(b.offsets);
    free(b.expert_out);
    free(b.y);
    return failed;
}

/* Where a case's experts live: E (0 = 16), the placement, and an expert map of E + extra * R slots
 * (mapped: a random map from the seed, replicas when extra > 0; else none). */
typedef struct dwhere {
    int32_t E, placement, mapped, extra;
} dwhere_t;

/* Runs DROUNDS rounds (uniform + drops, hot expert, varying T, rank 0 only) on R ranks; H = 0
 * means 256. */
static int run_case_at(int32_t R, int32_t dtype, int32_t layout, int32_t ue8m0, int32_t block_m, int32_t H,
                       dwhere_t where) {
    dctx_t *c = (dctx_t *)calloc(1, sizeof *c);
    if (!c) MFT_FAIL("out of memory");
    c->R = R;
    c->E = where.E ? where.E : 16;
    c->K = c->E < 4 ? c->E : 4;
    c->H = H ? H : 256;
    c->S = 16;
    c->dtype = dtype;
    c->layout = layout;
    c->ue8m0 = ue8m0;
    c->block_m = block_m;
    c->placement = where.placement;
    c->P = where.mapped ? c->E + where.extra * R : 0;
    if (c->P) mft_random_map(c->E, c->P, 0x3a9 + (uint64_t)R * 17u + (uint64_t)where.extra, c->map);
    for (int i = 0; i < DROUNDS; i++)
        make_round(c, i, i, 0x5eed0000u + (uint64_t)R * 131u + (uint64_t)i * 7u + (uint64_t)dtype);
    int rc = 1;
    c->group = mft_cpu_group(R, DTIMEOUT_MS);
    if (c->group) {
        rc = mft_run_ranks(R, dispatch_rank, c);
        mf_group_destroy(c->group);
    }
    if (rc)
        mft_note("case: R=%d E=%d %s P=%d H=%d %s %s ue8m0=%d block_m=%d", (int)R, (int)c->E,
                 c->placement == MF_PLACEMENT_ROUND_ROBIN ? "round_robin" : "linear", (int)c->P, (int)c->H,
                 dtype == MF_DTYPE_FP8_E4M3 ? "fp8" : "bf16", layout == MF_LAYOUT_MASKED ? "masked" : "expert_major",
                 (int)ue8m0, (int)block_m);
    free_rounds(c);
    free(c);
    return rc;
}

static int run_case_h(int32_t R, int32_t dtype, int32_t layout, int32_t ue8m0, int32_t block_m, int32_t H) {
    const dwhere_t plain = {0, MF_PLACEMENT_LINEAR, 0, 0};
    return run_case_at(R, dtype, layout, ue8m0, block_m, H, plain);
}

static int run_case(int32_t R, int32_t dtype, int32_t layout, int32_t ue8m0, int32_t block_m) {
    return run_case_h(R, dtype, layout, ue8m0, block_m, 0);
}

static int sweep(int32_t dtype, int32_t layout) {
    static const int32_t Rs[] = {1, 2, 4, 8};
    for (size_t i = 0; i < 4; i++)
        if (run_case(Rs[i], dtype, layout, 0, 0)) return 1;
    return 0;
}

static int test_bf16_expert_major(void) { return sweep(MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR); }
static int test_bf16_masked(void) { return sweep(MF_DTYPE_BF16, MF_LAYOUT_MASKED); }
static int test_fp8_expert_major(void) { return sweep(MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR); }
static int test_fp8_masked(void) { return sweep(MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED); }

static int test_fp8_ue8m0(void) {
    if (run_case(2, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, 1, 0)) return 1;
    if (run_case(4, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, 1, 0)) return 1;
    return 0;
}

/* Non-default segment alignments: 1 (no padding), 8, 48 (not a power of two) and 64. */
static int test_block_m(void) {
    if (run_case(2, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, 0, 1)) return 1;
    if (run_case(4, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, 0, 8)) return 1;
    if (run_case(8, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, 0, 48)) return 1;
    if (run_case(2, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, 0, 64)) return 1;
    return 0;
}

/* Rows that are not a multiple of 128 (BF16 H = 136, 8) and FP8 rows of 3 and 7 scale blocks. */
static int test_odd_hidden(void) {
    if (run_case_h(2, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, 0, 0, 136)) return 1;
    if (run_case_h(4, MF_DTYPE_BF16, MF_LAYOUT_MASKED, 0, 0, 8)) return 1;
    if (run_case_h(2, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, 0, 0, 384)) return 1;
    if (run_case_h(4, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, 1, 0, 896)) return 1;
    return 0;
}

/* Placements: uneven LINEAR and ROUND_ROBIN (E a multiple of R or not), every rank's segments its
 * own L_r experts; idle ranks (round 2), both dtypes and layouts, a block_m that is not 128. */
static int test_placements(void) {
    const int32_t BF = MF_DTYPE_BF16, F8 = MF_DTYPE_FP8_E4M3, EM = MF_LAYOUT_EXPERT_MAJOR, MA = MF_LAYOUT_MASKED;
    const int32_t LIN = MF_PLACEMENT_LINEAR, RR = MF_PLACEMENT_ROUND_ROBIN;
    const struct {
        int32_t R, dtype, layout, block_m;
        dwhere_t where;
    } cases[] = {
        {3, BF, EM, 0, {10, LIN, 0, 0}}, {3, F8, MA, 0, {10, LIN, 0, 0}}, {4, F8, EM, 8, {10, LIN, 0, 0}},
        {4, BF, MA, 0, {10, LIN, 0, 0}}, {6, BF, EM, 0, {26, LIN, 0, 0}}, {4, BF, MA, 0, {12, RR, 0, 0}},
        {4, F8, EM, 0, {12, RR, 0, 0}},  {4, F8, MA, 0, {10, RR, 0, 0}},  {3, BF, EM, 48, {11, RR, 0, 0}},
        {8, F8, EM, 0, {9, RR, 0, 0}},   {2, BF, MA, 0, {3, RR, 0, 0}},   {2, F8, EM, 0, {3, LIN, 0, 0}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (run_case_at(cases[i].R, cases[i].dtype, cases[i].layout, 0, cases[i].block_m, 0, cases[i].where)) return 1;
    return 0;
}

/* Expert maps (B = 0): replicas on one or more ranks, and a permutation without replicas; every
 * segment is one slot with its share of its expert's rows. */
static int test_expert_maps(void) {
    const int32_t BF = MF_DTYPE_BF16, F8 = MF_DTYPE_FP8_E4M3, EM = MF_LAYOUT_EXPERT_MAJOR, MA = MF_LAYOUT_MASKED;
    const struct {
        int32_t R, dtype, layout, block_m, extra;
    } cases[] = {
        {1, BF, EM, 0, 2}, {2, F8, MA, 0, 2}, {2, BF, EM, 8, 0}, {4, BF, MA, 0, 1},
        {4, F8, EM, 0, 3}, {4, F8, MA, 0, 0}, {8, BF, EM, 48, 2}, {8, F8, MA, 0, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const dwhere_t where = {16, MF_PLACEMENT_LINEAR, 1, cases[i].extra};
        if (run_case_at(cases[i].R, cases[i].dtype, cases[i].layout, 0, cases[i].block_m, 0, where)) return 1;
    }
    return 0;
}

/* ---- call order ----------------------------------------------------------------------------- */

/* R = 1: combine with no dispatch, dispatch twice, forward between dispatch and combine, and
 * dispatch or combine on another layer of the comm while one waits are all INVALID_USAGE; the
 * pending dispatch survives the misuse and its combine then succeeds. */
static int call_order_body(mf_comm_t moe_comm, mf_moe_t moe) {
    enum { E = 4, K = 2, H = 128, I = 128, S = 4, T = 3 };
    static uint16_t x[T * H], recv_x[E * S * H], expert_out[E * S * H], y[S * H];
    static uint16_t w13[E * 2 * I * H], w2[E * H * I];
    static int32_t ids[T * K] = {0, 1, 2, 3, 1, -1}, recv_src[E * S * 3], counts[E];
    static float w[T * K] = {0.5f, 0.25f, 1.0f, 2.0f, 0.75f, 0.1f};
    for (int i = 0; i < T * H; i++) x[i] = mf_bf16_from_float((float)(i % 7) - 3.0f);
    mf_moe_info_t info;
    MFT_CHECK_OK(mf_moe_get_info(moe, &info));
    MFT_CHECK_EQ_INT(info.expert_capacity, S); /* MASKED default: R * S */

    mf_dispatch_in_t din = {mft_t2(x, MF_DTYPE_BF16, T, H), mft_t2(ids, MF_DTYPE_INT32, T, K)};
    mf_dispatch_out_t dout;
    memset(&dout, 0, sizeof dout);
    dout.recv_x = mft_t3(recv_x, MF_DTYPE_BF16, E, S, H);
    dout.recv_src = mft_t3(recv_src, MF_DTYPE_INT32, E, S, 3);
    dout.expert_counts = mft_t1(counts, MF_DTYPE_INT32, E);
    mf_combine_in_t cin = {mft_t3(expert_out, MF_DTYPE_BF16, E, S, H), mft_t2(w, MF_DTYPE_FP32, T, K)};
    mf_combine_out_t cout = {mft_t2(y, MF_DTYPE_BF16, T, H)};
    mf_moe_forward_in_t fin = {din.x, din.topk_ids, cin.topk_weights};
    mf_moe_forward_out_t fout = {cout.y};
    mf_moe_weights_t wt;
    memset(&wt, 0, sizeof wt);
    wt.w13 = mft_t3(w13, MF_DTYPE_BF16, E, 2 * I, H);
    wt.w2 = mft_t3(w2, MF_DTYPE_BF16, E, H, I);
    MFT_CHECK_OK(mf_moe_set_weights(moe, &wt));

    mft_poison(y, sizeof y);
    MFT_CHECK_ERR(mf_combine(moe, &cin, &cout, NULL), MF_ERR_INVALID_USAGE);
    MFT_CHECK(mft_first_unpoisoned(y, sizeof y) < 0);

    MFT_CHECK_OK(mf_dispatch(moe, &din, &dout, NULL));
    MFT_CHECK_EQ_INT(counts[0], 1);
    MFT_CHECK_EQ_INT(counts[1], 2);
    mft_poison(recv_x, sizeof recv_x);
    mft_poison(counts, sizeof counts);
    MFT_CHECK_ERR(mf_dispatch(moe, &din, &dout, NULL), MF_ERR_INVALID_USAGE);
    MFT_CHECK(mft_first_unpoisoned(recv_x, sizeof recv_x) < 0);
    MFT_CHECK(mft_first_unpoisoned(counts, sizeof counts) < 0);
    MFT_CHECK_ERR(mf_moe_forward(moe, &fin, &fout, NULL), MF_ERR_INVALID_USAGE);
    MFT_CHECK(mft_first_unpoisoned(y, sizeof y) < 0);

    /* Another layer of the same comm can neither dispatch nor combine meanwhile. */
    mf_moe_t other = NULL;
    mf_moe_config_t cfg2 = MF_MOE_CONFIG_INIT;
    cfg2.num_experts = E;
    cfg2.num_topk = K;
    cfg2.hidden = H;
    cfg2.intermediate = I;
    cfg2.max_tokens_per_rank = S;
    cfg2.layout = MF_LAYOUT_MASKED;
    MFT_CHECK_OK(mf_moe_create(moe_comm, &cfg2, &other));
    int rc2 = 0;
    if (mf_combine(other, &cin, &cout, NULL) != MF_ERR_INVALID_USAGE) rc2 = 1;
    if (mf_dispatch(other, &din, &dout, NULL) != MF_ERR_INVALID_USAGE) rc2 = 1;
    MFT_CHECK_OK(mf_moe_destroy(other));
    if (rc2) MFT_FAIL("a second layer of the comm could dispatch or combine while a dispatch waits");
    MFT_CHECK(mft_first_unpoisoned(recv_x, sizeof recv_x) < 0);
    MFT_CHECK(mft_first_unpoisoned(y, sizeof y) < 0);

    /* The first dispatch is still pending: its combine works and sums the right rows. */
    for (int i = 0; i < E * S * H; i++) expert_out[i] = mf_bf16_from_float(1.0f);
    MFT_CHECK_OK(mf_combine(moe, &cin, &cout, NULL));
    for (int t = 0; t < T; t++) {
        float acc = 0.0f;
        for (int k = 0; k < K; k++)
            if (ids[t * K + k] >= 0) acc = acc + w[t * K + k];
        MFT_CHECK_EQ_INT(y[t * H + 5], mf_bf16_from_float(acc));
    }
    /* ... and leaves nothing pending. */
    mft_poison(y, sizeof y);
    MFT_CHECK_ERR(mf_combine(moe, &cin, &cout, NULL), MF_ERR_INVALID_USAGE);
    MFT_CHECK(mft_first_unpoisoned(y, sizeof y) < 0);
    /* forward works again after the pair is closed */
    MFT_CHECK_OK(mf_moe_forward(moe, &fin, &fout, NULL));
    return 0;
}

static int test_call_order(void) {
    mf_group_t g = mft_cpu_group(1, DTIMEOUT_MS);
    if (!g) return 1;
    mf_comm_t comm;
    mf_moe_t moe = NULL;
    mf_moe_config_t cfg = MF_MOE_CONFIG_INIT;
    cfg.num_experts = 4;
    cfg.num_topk = 2;
    cfg.hidden = 128;
    cfg.intermediate = 128;
    cfg.max_tokens_per_rank = 4;
    cfg.dtype = MF_DTYPE_BF16;
    cfg.layout = MF_LAYOUT_MASKED;
    MFT_CHECK_OK(mf_group_get_comm(g, 0, &comm));
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, &moe));
    int rc = call_order_body(comm, moe);
    MFT_CHECK_OK(mf_moe_destroy(moe));
    MFT_CHECK_OK(mf_group_destroy(g));
    return rc;
}

const mft_test_t mft_tests_dispatch[] = {
    {"dispatch_bf16_expert_major", test_bf16_expert_major, 60},
    {"dispatch_bf16_masked", test_bf16_masked, 60},
    {"dispatch_fp8_expert_major", test_fp8_expert_major, 60},
    {"dispatch_fp8_masked", test_fp8_masked, 60},
    {"dispatch_fp8_ue8m0", test_fp8_ue8m0, 60},
    {"dispatch_block_m", test_block_m, 60},
    {"dispatch_odd_hidden", test_odd_hidden, 60},
    {"dispatch_call_order", test_call_order, 30},
    {"dispatch_placements", test_placements, 60},
    {"dispatch_expert_maps", test_expert_maps, 60},
    {NULL, NULL, 0},
};
