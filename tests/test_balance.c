/*
 * test_balance.c — balanced EP on the CPU backend (docs/DESIGN.md "Balanced EP"): the planner of
 * src/balance/planner.h on its own, then whole layers through the public API.
 *
 * The contract under test: whatever the expert map (replicas, permutations) and whatever the spare
 * slots hold, y is bit-identical to the same layer without replicas (the per-row expert
 * computation does not depend on the other rows, and the combine sums k ascending); balancing
 * lowers the busiest rank's rows; a bad map is rejected with a clear error and changes nothing;
 * ranks that disagree about the map or the prefetches all fail the call together.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "balance/planner.h"
#include "balance/stage.h"
#include "harness.h"
#include "plan/placement.h"
#include "problem.h"

#define BAL_TIMEOUT_MS 20000

static mfp_spec_t bal_spec(int32_t R, int32_t dtype, int32_t layout, int32_t routing, uint64_t seed) {
    mfp_spec_t s;
    memset(&s, 0, sizeof s);
    s.R = R, s.E = 4 * R, s.K = 3, s.H = 256, s.I = 128, s.S = 12, s.T_per_rank = 12;
    s.dtype = dtype, s.layout = layout, s.routing = routing, s.zipf_s = 1.2, s.hot_expert = 1, s.seed = seed;
    return s;
}

/* ---- the planner alone -------------------------------------------------------------------- */

/* Shares sum to each expert's count, loads to the total; with one replica per expert the loads are
 * the home loads; replicas water-fill (the loads of an expert's replica ranks end within one row
 * of each other, or the lighter ones got nothing); the pick lowers the busiest rank and keeps a
 * steady table in place. */
static int test_planner(void) {
    enum { E = 64, R = 8, B = 2, P = E };
    int32_t counts[E], map[P], spare[R * B], again[R * B];
    int32_t rep_off[E + 1], rep_rank[P + R * B], rep_slot[P + R * B], share[P + R * B], scratch[E + R * B];
    int64_t load[R], home[R];
    mft_rng_t rng = {7};
    for (int32_t e = 0; e < E; e++) counts[e] = mft_rng_int(&rng, 40) + (e == 5 ? 900 : 0) + (e == 9 ? 500 : 0);
    for (int32_t p = 0; p < P; p++) map[p] = p;
    int32_t n = mf__balance_replicas(E, R, P, 0, map, NULL, rep_off, rep_rank, rep_slot, scratch);
    MFT_CHECK_EQ_INT(n, P);
    mf__balance_split(E, R, counts, rep_off, rep_rank, share, home, scratch);
    int64_t total = 0;
    for (int32_t r = 0; r < R; r++) total += home[r];
    for (int32_t e = 0; e < E; e++) MFT_CHECK_EQ_INT(share[rep_off[e]], counts[e]);

    mf__balance_pick(E, R, P, B, counts, map, NULL, spare, rep_off, rep_rank, rep_slot, share, load, scratch);
    n = mf__balance_replicas(E, R, P, B, map, spare, rep_off, rep_rank, rep_slot, scratch);
    mf__balance_split(E, R, counts, rep_off, rep_rank, share, load, scratch);
    int64_t sum = 0;
    for (int32_t r = 0; r < R; r++) sum += load[r];
    MFT_CHECK_EQ_INT(sum, total);
    for (int32_t e = 0; e < E; e++) {
        int64_t s = 0;
        for (int32_t i = rep_off[e]; i < rep_off[e + 1]; i++) s += share[i];
        MFT_CHECK_EQ_INT(s, counts[e]);
    }
    mft_verbose("  planner: max/mean %.3f -> %.3f (%d replicas)\n", (double)mft_max_i64(home, R) * R / (double)total,
                (double)mft_max_i64(load, R) * R / (double)total, (int)n);
    MFT_CHECK_MSG(mft_max_i64(load, R) < mft_max_i64(home, R), "balancing did not lower the busiest rank (%lld -> %lld)",
                  (long long)mft_max_i64(home, R), (long long)mft_max_i64(load, R));
    MFT_CHECK_MSG((double)mft_max_i64(load, R) * R / (double)total < 1.1, "max/mean %.3f after balancing",
                  (double)mft_max_i64(load, R) * R / (double)total);
    /* The same counts again, from the table it made: nothing moves. */
    mf__balance_pick(E, R, P, B, counts, map, spare, again, rep_off, rep_rank, rep_slot, share, load, scratch);
    MFT_CHECK_MSG(memcmp(again, spare, sizeof spare) == 0, "a steady routing moved spare slots");
    return 0;
}

/* The pick before mf__balance_trial (every candidate rebuilt the lists and split in full): the
 * reference the incremental trials must match bit for bit. Deliberately a copy of the old body of
 * mf__balance_pick (src/balance/planner.h), whose first ~40 lines it shares. */
static void ref_balance_pick(int32_t E, int32_t R, int32_t P, int32_t B, const int32_t *counts,
                                   const int32_t *map, const int32_t *resident, int32_t *spare, int32_t *rep_off,
                                   int32_t *rep_rank, int32_t *rep_slot, int32_t *share, int64_t *load,
                                   int32_t *iscratch) {
    const int32_t RB = R * B;
    int32_t *chosen = iscratch + E; /* [R * B]: expert per (rank, n-th pick on the rank), unordered */
    int32_t *order = iscratch;      /* [E] */
    for (int32_t i = 0; i < RB; i++) spare[i] = -1, chosen[i] = -1;
    if (B == 0) return;
    mf__balance_replicas(E, R, P, 0, map, (const int32_t *)0, rep_off, rep_rank, rep_slot, order);
    mf__balance_split(E, R, counts, rep_off, rep_rank, share, load, order);
    for (int32_t it = 0; it < RB; it++) {
        int32_t q = 0;
        for (int32_t r = 1; r < R; r++) q = load[r] > load[q] ? r : q;
        /* Candidates: the experts with the largest shares on q (ties: lowest id), each with its
         * destination, the least loaded rank with a free spare slot and no replica of it yet. */
        int32_t cand[MF__BALANCE_CANDIDATES], dest[MF__BALANCE_CANDIDATES], nc = 0;
        int64_t cand_rows[MF__BALANCE_CANDIDATES];
        for (int32_t e = 0; e < E; e++) {
            int64_t on_q = 0;
            for (int32_t i = rep_off[e]; i < rep_off[e + 1]; i++) on_q += rep_rank[i] == q ? share[i] : 0;
            if (on_q <= 0) continue;
            int32_t at = nc < MF__BALANCE_CANDIDATES ? nc++ : MF__BALANCE_CANDIDATES;
            while (at > 0 && cand_rows[at - 1] < on_q) {
                if (at < MF__BALANCE_CANDIDATES) cand[at] = cand[at - 1], cand_rows[at] = cand_rows[at - 1];
                at--;
            }
            if (at < MF__BALANCE_CANDIDATES) cand[at] = e, cand_rows[at] = on_q;
        }
        for (int32_t c = 0; c < nc; c++) {
            int32_t e = cand[c], d = -1;
            for (int32_t r = 0; r < R; r++) {
                int32_t used = 0, has = 0;
                for (int32_t n = 0; n < B; n++) used += chosen[r * B + n] >= 0;
                for (int32_t i = rep_off[e]; i < rep_off[e + 1] && !has; i++) has = rep_rank[i] == r;
                if (used < B && !has && (d < 0 || load[r] < load[d])) d = r;
            }
            dest[c] = d;
        }
        /* Each candidate is tried (the lists and loads are rebuilt from the map and the picks: R * B
         * is small); the one whose split has the lowest (max load, sum of squared loads) wins, if
         * it beats the table without it. */
        int64_t best_max = 0;
        double best_sq = 0;
        for (int32_t r = 0; r < R; r++) best_max = load[r] > best_max ? load[r] : best_max, best_sq += (double)load[r] * load[r];
        int32_t pick = -1;
        for (int32_t c = 0; c < nc; c++) {
            if (dest[c] < 0) continue;
            int32_t n = 0;
            while (chosen[dest[c] * B + n] >= 0) n++;
            chosen[dest[c] * B + n] = cand[c];
            mf__balance_replicas(E, R, P, B, map, chosen, rep_off, rep_rank, rep_slot, order);
            mf__balance_split(E, R, counts, rep_off, rep_rank, share, load, order);
            chosen[dest[c] * B + n] = -1;
            int64_t mx = 0;
            double sq = 0;
            for (int32_t r = 0; r < R; r++) mx = load[r] > mx ? load[r] : mx, sq += (double)load[r] * load[r];
            if (mx < best_max || (mx == best_max && sq < best_sq)) best_max = mx, best_sq = sq, pick = c;
        }
        if (pick >= 0) {
            int32_t n = 0;
            while (chosen[dest[pick] * B + n] >= 0) n++;
            chosen[dest[pick] * B + n] = cand[pick];
        }
        mf__balance_replicas(E, R, P, B, map, chosen, rep_off, rep_rank, rep_slot, order);
        mf__balance_split(E, R, counts, rep_off, rep_rank, share, load, order);
        if (pick < 0) break; /* no replica of q's experts improves the table */
    }
    /* Slots: a chosen expert stays where it is resident; the others take the free slots in order. */
    for (int32_t r = 0; r < R; r++) {
        for (int32_t n = 0; n < B; n++) {
            int32_t e = chosen[r * B + n];
            if (e < 0) continue;
            for (int32_t j = 0; j < B; j++)
                if (resident && resident[r * B + j] == e && spare[r * B + j] < 0) {
                    spare[r * B + j] = e, chosen[r * B + n] = -1;
                    break;
                }
        }
        for (int32_t n = 0; n < B; n++) {
            int32_t e = chosen[r * B + n];
            if (e < 0) continue;
            int32_t j = 0;
            while (spare[r * B + j] >= 0) j++;
            spare[r * B + j] = e;
        }
    }
}


/* mf__balance_pick (incremental trials) == the full-rebuild pick, over random shapes, counts (flat,
 * zipf-like, one hot expert, zeros), maps with replicas and resident tables. */
static int test_pick_incremental(void) {
    enum { MAXE = 256, MAXR = 8, MAXB = 4, MAXP = MAXE + MAXR * 4, MAXN = MAXP + MAXR * MAXB };
    static int32_t counts[MAXE], map[MAXP], resident[MAXR * MAXB], a[MAXR * MAXB], b[MAXR * MAXB];
    static int32_t rep_off[MAXE + 1], rep_rank[MAXN], rep_slot[MAXN], share[MAXN], scratch[MAXE + MAXR * MAXB];
    static int64_t load[MAXR];
    mft_rng_t rng = {0x51c4};
    int32_t picked = 0;
    for (int32_t it = 0; it < 3000; it++) {
        const int32_t R = 1 + mft_rng_int(&rng, MAXR), E = R * (1 + mft_rng_int(&rng, MAXE / R));
        const int32_t P = E + R * mft_rng_int(&rng, 5), B = 1 + mft_rng_int(&rng, MAXB), kind = mft_rng_int(&rng, 4);
        for (int32_t e = 0; e < E; e++)
            counts[e] = kind == 0 ? 10 + mft_rng_int(&rng, 20)
                      : kind == 1 ? (int32_t)(4096.0 / (1.0 + mft_rng_int(&rng, E)))
                      : kind == 2 ? (e == 3 % E ? 5000 : mft_rng_int(&rng, 8))
                                  : (mft_rng_int(&rng, 3) ? 0 : mft_rng_int(&rng, 100));
        mft_random_map(E, P, 1000 + (uint64_t)it, map);
        for (int32_t i = 0; i < R * B; i++) resident[i] = mft_rng_int(&rng, 3) ? -1 : mft_rng_int(&rng, E);
        const int32_t *res = mft_rng_int(&rng, 4) ? resident : NULL;
        ref_balance_pick(E, R, P, B, counts, map, res, a, rep_off, rep_rank, rep_slot, share, load, scratch);
        mf__balance_pick(E, R, P, B, counts, map, res, b, rep_off, rep_rank, rep_slot, share, load, scratch);
        for (int32_t i = 0; i < R * B; i++) {
            MFT_CHECK_MSG(a[i] == b[i], "case %d (E %d R %d P %d B %d kind %d): spare[%d] = %d, reference %d", (int)it,
                          (int)E, (int)R, (int)P, (int)B, (int)kind, (int)i, (int)b[i], (int)a[i]);
            picked += a[i] >= 0;
        }
    }
    mft_verbose("  3000 random picks equal the full-rebuild pick (%d spare slots filled)\n", (int)picked);
    MFT_CHECK(picked > 1000);
    return 0;
}

/* mf__balance_plan_par (the CUDA plan's block-parallel version, here as plain loops) == the serial
 * functions and the CPU plan's capacity verdict and slot table for one plan; the home loads are
 * each expert's count on its placement's rank (`placed`: the rank of the one slot of the map that
 * holds it; else LINEAR's e / (E / R)). *verdict: the failing rank or -1. */
enum { PP_MAXE = 256, PP_MAXR = 8, PP_MAXB = 4, PP_MAXP = PP_MAXE + PP_MAXR * 4, PP_MAXN = PP_MAXP + PP_MAXR * PP_MAXB };

static int plan_par_case(const char *what, int32_t E, int32_t R, int32_t P, int32_t B, int32_t placement, int32_t placed,
                         int32_t me, int32_t masked, int32_t block_m, int32_t capacity, int32_t max_rows,
                         const int32_t *map, const int32_t *spare, const int32_t *counts, int32_t *verdict) {
    static int32_t rep_off[PP_MAXE + 1], rep_rank[PP_MAXN], rep_slot[PP_MAXN], share[PP_MAXN],
        scratch[PP_MAXE + PP_MAXR * PP_MAXB];
    static int32_t cs[PP_MAXE], cp[PP_MAXE], p_off[PP_MAXE + 1], p_rank[PP_MAXN], p_slot[PP_MAXN], p_share[PP_MAXN],
        order[PP_MAXE], small[4], over[PP_MAXR], sc[PP_MAXP + PP_MAXB], sb[PP_MAXP + PP_MAXB], se[PP_MAXP + PP_MAXB];
    static int64_t load[PP_MAXR], home[PP_MAXR], p_load[PP_MAXR], p_home[PP_MAXR], p_rows[PP_MAXR];
    const int32_t Lp = P / R, L = Lp + B;
    /* serial */
    mf__balance_replicas(E, R, P, B, map, B ? spare : NULL, rep_off, rep_rank, rep_slot, scratch);
    mf__balance_split(E, R, counts, rep_off, rep_rank, share, load, scratch);
    int32_t want_q = -1, want_i = -1;
    for (int32_t q = 0; q < R && want_q < 0; q++) {
        int64_t rows = 0;
        for (int32_t e = 0; e < E && want_q < 0; e++)
            for (int32_t i = rep_off[e]; i < rep_off[e + 1] && want_q < 0; i++) {
                if (rep_rank[i] != q) continue;
                if (masked && share[i] > capacity) want_q = q, want_i = i;
                rows += (share[i] + block_m - 1) / block_m * block_m;
            }
        if (want_q < 0 && !masked && rows > max_rows) want_q = q;
    }
    for (int32_t r = 0; r < R; r++) home[r] = 0;
    for (int32_t e = 0; e < E; e++) {
        int32_t p = 0;
        while (placed && map[p] != e) p++;
        home[placed ? p / Lp : e / (E / R)] += counts[e];
    }
    /* parallel (as loops) */
    mf__balance_ws_t ws = {cs, cp, p_off, p_rank, p_slot, p_share, order, small, over, p_load, p_home, p_rows};
    mf__balance_plan_par(E, R, P, B, placement, me, masked, block_m, capacity, max_rows, map, spare, counts, &ws, sc, sb,
                         se);
    for (int32_t e = 0; e <= E; e++) MFT_CHECK_MSG(p_off[e] == rep_off[e], "%s: rep_off[%d]", what, (int)e);
    for (int32_t i = 0; i < rep_off[E]; i++)
        MFT_CHECK_MSG(p_rank[i] == rep_rank[i] && p_slot[i] == rep_slot[i] && p_share[i] == share[i],
                      "%s: replica %d: rank %d/%d slot %d/%d share %d/%d", what, (int)i, (int)p_rank[i],
                      (int)rep_rank[i], (int)p_slot[i], (int)rep_slot[i], (int)p_share[i], (int)share[i]);
    for (int32_t r = 0; r < R; r++)
        MFT_CHECK_MSG(p_load[r] == load[r] && p_home[r] == home[r], "%s: rank %d: load %lld/%lld home %lld/%lld", what,
                      (int)r, (long long)p_load[r], (long long)load[r], (long long)p_home[r], (long long)home[r]);
    MFT_CHECK_MSG(small[1] == want_q && (!masked || small[2] == want_i), "%s: verdict rank %d replica %d, serial %d %d",
                  what, (int)small[1], (int)small[2], (int)want_q, (int)want_i);
    for (int32_t s = 0; s < L; s++) {
        int32_t c = 0, b = 0, x = s < Lp ? map[me * Lp + s] : spare[me * B + s - Lp];
        for (int32_t e = 0; e < E; e++)
            for (int32_t i = rep_off[e], begin = 0; i < rep_off[e + 1]; begin += share[i], i++)
                if (rep_rank[i] == me && rep_slot[i] == s) c = share[i], b = begin;
        MFT_CHECK_MSG(sc[s] == c && sb[s] == b && se[s] == x, "%s: slot %d: count %d/%d begin %d/%d expert %d/%d",
                      what, (int)s, (int)sc[s], (int)c, (int)sb[s], (int)b, (int)se[s], (int)x);
    }
    *verdict = want_q;
    return 0;
}

/* Counts of one random plan: flat, zipf-like, one hot expert, or mostly zeros. */
static void plan_counts(mft_rng_t *rng, int32_t kind, int32_t E, int32_t *counts) {
    for (int32_t e = 0; e < E; e++)
        counts[e] = kind == 0 ? 10 + mft_rng_int(rng, 20)
                  : kind == 1 ? (int32_t)(4096.0 / (1.0 + mft_rng_int(rng, E)))
                  : kind == 2 ? (e == 3 % E ? 5000 : mft_rng_int(rng, 8))
                              : (mft_rng_int(rng, 3) ? 0 : mft_rng_int(rng, 100));
}

/* plan_par_case over random shapes, counts, maps with replicas, spare tables and capacities; then
 * over the slot grids of the placements (E not a multiple of R, round robin: empty slots, -1). */
static int test_plan_parallel(void) {
    static int32_t counts[PP_MAXE], map[PP_MAXP], spare[PP_MAXR * PP_MAXB];
    mft_rng_t rng = {0x9a7a};
    int32_t verdicts = 0, verdict;
    char what[160];
    for (int32_t it = 0; it < 4000; it++) {
        const int32_t R = 1 + mft_rng_int(&rng, PP_MAXR), E = R * (1 + mft_rng_int(&rng, PP_MAXE / R));
        const int32_t P = E + R * mft_rng_int(&rng, 5), B = mft_rng_int(&rng, PP_MAXB + 1);
        const int32_t kind = mft_rng_int(&rng, 4), masked = mft_rng_int(&rng, 2), block_m = 1 << mft_rng_int(&rng, 8);
        plan_counts(&rng, kind, E, counts);
        mft_random_map(E, P, 2000 + (uint64_t)it, map);
        for (int32_t i = 0; i < R * B; i++) spare[i] = mft_rng_int(&rng, 2) ? -1 : mft_rng_int(&rng, E);
        int64_t total = 0;
        for (int32_t e = 0; e < E; e++) total += counts[e];
        const int32_t capacity = 1 + mft_rng_int(&rng, 3000), max_rows = (int32_t)(total / R + mft_rng_int(&rng, 4000));
        const int32_t me = mft_rng_int(&rng, R);
        snprintf(what, sizeof what, "case %d (E %d R %d P %d B %d kind %d masked %d)", (int)it, (int)E, (int)R, (int)P,
                 (int)B, (int)kind, (int)masked);
        if (plan_par_case(what, E, R, P, B, MF_PLACEMENT_LINEAR, 0, me, masked, block_m, capacity, max_rows, map, spare,
                          counts, &verdict))
            return 1;
        verdicts += verdict >= 0;
    }
    mft_verbose("  4000 random plans: the parallel plan equals the serial one (%d capacity faults)\n", (int)verdicts);
    MFT_CHECK(verdicts > 100);
    mft_rng_t prng = {0x9a7c};
    int32_t placed = 0;
    for (int32_t it = 0; it < 1000; it++) {
        const int32_t R = 1 + mft_rng_int(&prng, PP_MAXR), E = R + mft_rng_int(&prng, PP_MAXE - PP_MAXR);
        const int32_t placement = mft_rng_int(&prng, 2), Ls = mf__placement_slots(E, R), P = R * Ls;
        const int32_t kind = mft_rng_int(&prng, 4), masked = mft_rng_int(&prng, 2), block_m = 1 << mft_rng_int(&prng, 8);
        plan_counts(&prng, kind, E, counts);
        for (int32_t p = 0; p < P; p++) map[p] = mf__placement_expert(E, R, placement, p / Ls, p % Ls);
        placed += mf__placement_mapped(E, R, placement);
        int64_t total = 0;
        for (int32_t e = 0; e < E; e++) total += counts[e];
        const int32_t capacity = 1 + mft_rng_int(&prng, 3000), max_rows = (int32_t)(total / R + mft_rng_int(&prng, 4000));
        snprintf(what, sizeof what, "placement case %d (E %d R %d %s kind %d masked %d)", (int)it, (int)E, (int)R,
                 placement ? "round robin" : "linear", (int)kind, (int)masked);
        if (plan_par_case(what, E, R, P, 0, placement, 1, mft_rng_int(&prng, R), masked, block_m, capacity, max_rows, map,
                          spare, counts, &verdict))
            return 1;
    }
    mft_verbose("  1000 random placement grids (%d mapped): the parallel plan equals the serial one\n", (int)placed);
    MFT_CHECK(placed > 500);
    return 0;
}

/* ---- whole layers ------------------------------------------------------------------------- */

/* Runs `p` plain and with (map, P, B, prefetch) on `transport`; y bit for bit. Fills stats. */
static int run_vs_plain(const mfp_problem_t *p, const int32_t *map, int32_t P, int32_t B, int32_t iters,
                        int32_t transport, mfp_timing_t *timing) {
    const int32_t R = p->spec.R;
    uint16_t *y0[MF_MAX_RANKS], *y1[MF_MAX_RANKS];
    for (int32_t r = 0; r < R; r++) {
        y0[r] = mft_alloc((size_t)p->T[r] * p->spec.H * 2 + 2);
        y1[r] = mft_alloc((size_t)p->T[r] * p->spec.H * 2 + 2);
        mft_poison(y1[r], (size_t)p->T[r] * p->spec.H * 2);
    }
    mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
    o.backend = MF_BACKEND_CPU;
    o.iters = 1;
    o.timeout_ms = BAL_TIMEOUT_MS;
    char err[512];
    int rc = 0;
    if (mfp_run(p, &o, y0, NULL, err, sizeof err) != MF_SUCCESS) rc = mft_fail(__FILE__, __LINE__, "plain: %s", err);
    o.iters = iters;
    o.transport = transport;
    o.expert_map = map;
    o.num_physical = P;
    o.spare_slots = B;
    o.prefetch = B > 0;
    if (!rc && mfp_run(p, &o, y1, timing, err, sizeof err) != MF_SUCCESS)
        rc = mft_fail(__FILE__, __LINE__, "balanced (P %d, B %d): %s", (int)P, (int)B, err);
    for (int32_t r = 0; r < R && !rc; r++)
        if (memcmp(y0[r], y1[r], (size_t)p->T[r] * p->spec.H * 2) != 0)
            rc = mft_fail(__FILE__, __LINE__, "rank %d: y with P = %d, B = %d differs from y without replicas "
                          "(R = %d, %s, %s)", (int)r, (int)P, (int)B, (int)R,
                          p->spec.dtype == MF_DTYPE_FP8_E4M3 ? "fp8" : "bf16",
                          p->spec.layout == MF_LAYOUT_MASKED ? "masked" : "expert-major");
    for (int32_t r = 0; r < R; r++) free(y0[r]), free(y1[r]);
    return rc;
}

/* Any map (permutations, replicas on the same rank or others) gives y bit-identical to no map. */
static int test_maps_bitwise(void) {
    static const struct { int32_t R, dtype, layout, routing, extra; } cases[] = {
        {2, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_UNIFORM, 0},
        {2, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, MFP_ROUTING_HOT, 1},
        {4, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_ZIPF, 2},
        {4, MF_DTYPE_BF16, MF_LAYOUT_MASKED, MFP_ROUTING_ZIPF, 1},
        {8, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_HOT, 3},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        mfp_spec_t s = bal_spec(cases[c].R, cases[c].dtype, cases[c].layout, cases[c].routing, 100 + c);
        mfp_problem_t p;
        MFT_CHECK(mfp_generate(&s, &p) == 0);
        int32_t P = s.E + cases[c].extra * s.R, map[256];
        mft_random_map(s.E, P, 500 + c, map);
        int rc = run_vs_plain(&p, map, P, 0, 2, MF_TRANSPORT_LOCAL, NULL);
        mfp_free(&p);
        if (rc) return rc;
    }
    return 0;
}

/* Spare slots with the per-step prefetch: y identical to balancing off, the busiest rank lighter
 * under skew, and a steady routing copies weights once. */
static int spare_case(int32_t R, int32_t dtype, int32_t layout, int32_t routing, int32_t B, int32_t transport,
                      uint64_t seed) {
    mfp_spec_t s = bal_spec(R, dtype, layout, routing, seed);
    s.K = 2;
    mfp_problem_t p;
    MFT_CHECK(mfp_generate(&s, &p) == 0);
    mfp_timing_t t;
    memset(&t, 0, sizeof t);
    int rc = run_vs_plain(&p, NULL, 0, B, 3, transport, &t);
    mfp_free(&p);
    if (rc) return rc;
    MFT_CHECK(t.have_balance);
    int64_t before = mft_max_i64(t.balance.home_rows, R), after = mft_max_i64(t.balance.recv_rows, R);
    mft_verbose("  R %d B %d: busiest rank %lld -> %lld rows; moved %lld then %lld bytes; %d spares resident\n",
                (int)R, (int)B, (long long)before, (long long)after, (long long)t.prefetch_first_bytes,
                (long long)t.prefetch_last_bytes, (int)t.balance.spare_resident);
    MFT_CHECK_MSG(after <= before, "balancing made the busiest rank heavier (%lld -> %lld)", (long long)before,
                  (long long)after);
    if (routing == MFP_ROUTING_HOT) {
        MFT_CHECK_MSG(after < before, "hot routing: the busiest rank is not lighter (%lld rows)", (long long)after);
        MFT_CHECK(t.prefetch_first_bytes > 0);
    }
    MFT_CHECK_MSG(t.prefetch_last_bytes == 0, "the same routing again moved %lld bytes", (long long)t.prefetch_last_bytes);
    return 0;
}

static int test_spare_bitwise(void) {
    return spare_case(2, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_HOT, 1, MF_TRANSPORT_LOCAL, 31) ||
           spare_case(4, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, MFP_ROUTING_HOT, 2, MF_TRANSPORT_LOCAL, 32) ||
           spare_case(8, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_ZIPF, 2, MF_TRANSPORT_LOCAL, 33) ||
           spare_case(4, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_UNIFORM, 1, MF_TRANSPORT_LOCAL, 34);
}

/* The same with ranks as processes: the pushes cross POSIX shared memory. */
static int test_ipc(void) {
    mfp_spec_t s = bal_spec(4, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_ZIPF, 41);
    mfp_problem_t p;
    MFT_CHECK(mfp_generate(&s, &p) == 0);
    int32_t map[64];
    mft_random_map(s.E, s.E + s.R, 42, map);
    int rc = run_vs_plain(&p, map, s.E + s.R, 0, 2, MF_TRANSPORT_IPC, NULL);
    mfp_free(&p);
    if (rc) return rc;
    return spare_case(4, MF_DTYPE_BF16, MF_LAYOUT_MASKED, MFP_ROUTING_HOT, 2, MF_TRANSPORT_IPC, 43);
}

/* Random cases: R 1..8, both dtypes and layouts, uneven T with idle ranks, drops, every routing,
 * random maps with 0..3 extra slots per rank, B 0..3: y bit-identical to the plain layer. */
static int test_random_cases(void) {
    mft_rng_t rng = {0xba1a};
    for (int32_t i = 0; i < 24; i++) {
        const int32_t R = 1 + mft_rng_int(&rng, 8);
        mfp_spec_t s = bal_spec(R, mft_rng_int(&rng, 2) ? MF_DTYPE_FP8_E4M3 : MF_DTYPE_BF16,
                                mft_rng_int(&rng, 2) ? MF_LAYOUT_MASKED : MF_LAYOUT_EXPERT_MAJOR, mft_rng_int(&rng, 3),
                                900 + (uint64_t)i);
        s.E = R * (1 + mft_rng_int(&rng, 4));
        s.K = 1 + mft_rng_int(&rng, s.E < 4 ? s.E : 4);
        s.hot_expert = mft_rng_int(&rng, s.E);
        s.drop_prob = mft_rng_int(&rng, 3) == 0 ? 0.2 : 0.0;
        int32_t T[MF_MAX_RANKS];
        for (int32_t r = 0; r < R; r++) T[r] = mft_rng_int(&rng, 4) == 0 ? 0 : 1 + mft_rng_int(&rng, 12);
        s.T_of_rank = T;
        s.S = 12;
        const int32_t P = s.E + R * mft_rng_int(&rng, 4), B = mft_rng_int(&rng, 4);
        int32_t map[64 + 8 * 3];
        mft_random_map(s.E, P, 950 + (uint64_t)i, map);
        mfp_problem_t p;
        MFT_CHECK(mfp_generate(&s, &p) == 0);
        mft_verbose("  case %d: R %d E %d K %d P %d B %d\n", (int)i, (int)R, (int)s.E, (int)s.K, (int)P, (int)B);
        int rc = run_vs_plain(&p, mft_rng_int(&rng, 2) || P != s.E ? map : NULL, P == s.E ? 0 : P, B, 3,
                              MF_TRANSPORT_LOCAL, NULL);
        mfp_free(&p);
        if (rc) return mft_fail(__FILE__, __LINE__, "random case %d (R %d, E %d, K %d, P %d, B %d) failed", (int)i,
                                (int)R, (int)s.E, (int)s.K, (int)P, (int)B);
    }
    return 0;
}

/* ---- maps that change between calls, ranks that disagree, routing that changes -------------- */

typedef struct change_ctx {
    mf_group_t group;
    const mfp_problem_t *p[2];   /* the same weights, two routings */
    uint16_t *yref[2][MF_MAX_RANKS];
    int32_t maps[3][64];
    int32_t P, B;
    pthread_barrier_t met;       /* the ranks meet (tests that order ranks' steps) */
    int64_t pushed;              /* bytes pushed (atomic) */
} change_ctx_t;

/* This rank's weights laid out from `map` (slot l holds logical map[rank * Lp + l]). */
static void layout_weights(const mfp_problem_t *p, const int32_t *map, int32_t P, int32_t rank, uint8_t *w13,
                           uint8_t *w2) {
    const int32_t Lp = P / p->spec.R, L = p->L;
    const size_t n13 = (size_t)2 * p->spec.I * p->spec.H * 2, n2 = (size_t)p->spec.H * p->spec.I * 2;
    for (int32_t l = 0; l < Lp; l++) {
        int32_t e = map[rank * Lp + l];
        memcpy(w13 + l * n13, (const uint8_t *)p->w13[e / L] + (size_t)(e % L) * n13, n13);
        memcpy(w2 + l * n2, (const uint8_t *)p->w2[e / L] + (size_t)(e % L) * n2, n2);
    }
}

static int forward_check(mf_moe_t moe, const change_ctx_t *c, int32_t which, int32_t rank, uint16_t *y,
                         mf_result_t want) {
    const mfp_problem_t *p = c->p[which];
    int64_t T = p->T[rank], H = p->spec.H, K = p->spec.K;
    mf_moe_forward_in_t in = {mft_t2(p->x[rank], MF_DTYPE_BF16, T, H), mft_t2(p->topk_ids[rank], MF_DTYPE_INT32, T, K),
                              mft_t2(p->topk_weights[rank], MF_DTYPE_FP32, T, K)};
    mft_poison(y, (size_t)(T * H * 2));
    mf_moe_forward_out_t out = {mft_t2(y, MF_DTYPE_BF16, T, H)};
    if (want != MF_SUCCESS) {
        MFT_CHECK_ERR(mf_moe_forward(moe, &in, &out, NULL), want);
        MFT_CHECK_MSG(mft_first_unpoisoned(y, (size_t)(T * H * 2)) < 0, "a failed forward wrote y");
        return 0;
    }
    MFT_CHECK_OK(mf_moe_forward(moe, &in, &out, NULL));
    MFT_CHECK_MSG(memcmp(y, c->yref[which][rank], (size_t)(T * H * 2)) == 0, "rank %d: y differs (routing %d)",
                  (int)rank, (int)which);
    return 0;
}

static int change_rank_body(int32_t rank, change_ctx_t *c, mf_moe_t moe, uint8_t *w13, uint8_t *w2, uint16_t *y) {
    const mfp_problem_t *p = c->p[0];
    const int32_t Lp = c->P / p->spec.R;
    const int64_t H = p->spec.H, I = p->spec.I;
    mf_moe_weights_t w = {mft_t3(w13, MF_DTYPE_BF16, Lp, 2 * I, H), mft_none(), mft_t3(w2, MF_DTYPE_BF16, Lp, H, I),
                          mft_none()};
    /* Before any map: a layer with replicas refuses to run. */
    layout_weights(p, c->maps[0], c->P, rank, w13, w2);
    MFT_CHECK_OK(mf_moe_set_weights(moe, &w));
    MFT_CHECK(forward_check(moe, c, 0, rank, y, MF_ERR_INVALID_USAGE) == 0);
    for (int32_t m = 0; m < 3; m++) {
        MFT_CHECK_OK(mf_moe_set_expert_map(moe, c->maps[m], c->P));
        layout_weights(p, c->maps[m], c->P, rank, w13, w2);
        MFT_CHECK_OK(mf_moe_set_weights(moe, &w));
        for (int32_t it = 0; it < 4; it++) { /* routing alternates; spare slots follow the last call */
            MFT_CHECK(forward_check(moe, c, it % 2, rank, y, MF_SUCCESS) == 0);
            MFT_CHECK_OK(mf_moe_prefetch(moe, NULL));
        }
    }
    /* Rank 0 alone changes its map: every rank fails the next forward, nothing written. */
    if (rank == 0) MFT_CHECK_OK(mf_moe_set_expert_map(moe, c->maps[0], c->P));
    MFT_CHECK(forward_check(moe, c, 0, rank, y, MF_ERR_INVALID_USAGE) == 0);
    if (rank == 0) MFT_CHECK(mft_contains_ci(mf_last_error(), "expert map"));
    /* Agreeing again: it runs (rank 0's weights follow its map). */
    if (rank != 0) MFT_CHECK_OK(mf_moe_set_expert_map(moe, c->maps[0], c->P));
    layout_weights(p, c->maps[0], c->P, rank, w13, w2);
    MFT_CHECK_OK(mf_moe_set_weights(moe, &w));
    MFT_CHECK(forward_check(moe, c, 1, rank, y, MF_SUCCESS) == 0);
    /* Only rank 1 prefetches: every rank fails the next forward. */
    if (rank == 1) MFT_CHECK_OK(mf_moe_prefetch(moe, NULL));
    MFT_CHECK(forward_check(moe, c, 0, rank, y, MF_ERR_INVALID_USAGE) == 0);
    return 0;
}

/* Rank `rank`'s BF16 layer of the context's spec, P physical experts and B spare slots. */
static int change_moe(int32_t rank, change_ctx_t *c, mf_moe_t *moe) {
    const mfp_problem_t *p = c->p[0];
    mf_comm_t comm;
    MFT_CHECK_OK(mf_group_get_comm(c->group, rank, &comm));
    mf_moe_config_t cfg = MF_MOE_CONFIG_INIT;
    cfg.num_experts = p->spec.E, cfg.num_topk = p->spec.K, cfg.hidden = p->spec.H, cfg.intermediate = p->spec.I;
    cfg.max_tokens_per_rank = p->spec.S, cfg.dtype = MF_DTYPE_BF16;
    cfg.num_physical_experts = c->P, cfg.spare_slots = c->B;
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, moe));
    return 0;
}

static int change_rank(int32_t rank, void *arg) {
    change_ctx_t *c = arg;
    const mfp_problem_t *p = c->p[0];
    mf_moe_t moe;
    MFT_CHECK(change_moe(rank, c, &moe) == 0);
    const int32_t Lp = c->P / p->spec.R;
    uint8_t *w13 = mft_alloc((size_t)Lp * 2 * p->spec.I * p->spec.H * 2);
    uint8_t *w2 = mft_alloc((size_t)Lp * p->spec.H * p->spec.I * 2);
    uint16_t *y = mft_alloc((size_t)p->spec.S * p->spec.H * 2 + 2);
    int rc = change_rank_body(rank, c, moe, w13, w2, y);
    mf_result_t d = mf_moe_destroy(moe);
    free(w13), free(w2), free(y);
    if (!rc) MFT_CHECK_OK(d);
    return rc;
}

/* Two problems of one spec (hot routing, then zipf inputs redrawn with seed + 1), their plain
 * references (CPU, no balancing), three random maps of E + R slots (seeds map_seed + m) with B spare
 * slots per rank; then `rank_fn` on every rank of a CPU group over that context. */
static int run_change_ranks(uint64_t seed, int32_t B, uint64_t map_seed, int (*rank_fn)(int32_t, void *)) {
    mfp_spec_t s = bal_spec(4, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_HOT, seed);
    mfp_problem_t p0, p1;
    MFT_CHECK(mfp_generate(&s, &p0) == 0);
    MFT_CHECK(mfp_generate(&s, &p1) == 0);
    p1.spec.routing = MFP_ROUTING_ZIPF;
    MFT_CHECK(mfp_redraw_inputs(&p1, seed + 1) == 0);
    change_ctx_t c;
    memset(&c, 0, sizeof c);
    c.p[0] = &p0, c.p[1] = &p1;
    c.P = s.E + s.R, c.B = B;
    for (int m = 0; m < 3; m++) mft_random_map(s.E, c.P, map_seed + (uint64_t)m, c.maps[m]);
    mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
    o.backend = MF_BACKEND_CPU;
    o.timeout_ms = BAL_TIMEOUT_MS;
    char err[512];
    for (int i = 0; i < 2; i++) {
        for (int32_t r = 0; r < s.R; r++) c.yref[i][r] = mft_alloc((size_t)s.T_per_rank * s.H * 2 + 2);
        MFT_CHECK_MSG(mfp_run(c.p[i], &o, c.yref[i], NULL, err, sizeof err) == MF_SUCCESS, "plain: %s", err);
    }
    c.group = mft_cpu_group(s.R, BAL_TIMEOUT_MS);
    MFT_CHECK(c.group);
    pthread_barrier_init(&c.met, NULL, (unsigned)s.R);
    int rc = mft_run_ranks(s.R, rank_fn, &c);
    pthread_barrier_destroy(&c.met);
    MFT_CHECK_OK(mf_group_destroy(c.group));
    for (int i = 0; i < 2; i++)
        for (int32_t r = 0; r < s.R; r++) free(c.yref[i][r]);
    mfp_free(&p0), mfp_free(&p1);
    return rc;
}

static int test_map_changes(void) { return run_change_ranks(61, 2, 70, change_rank); }

/* A rank whose comm is aborted destroys its layer without the barrier (it waits for no peer), while
 * its peers, which have not looked at the abort, still push experts into its spare slots from their
 * hosts: the pushes must land in memory that is still there. Virtual ranks share one address space;
 * the local transport keeps a broken comm's symmetric memory until the group is destroyed (without
 * that, ASan reports a use after free here; on CUDA the copy read freed device memory as host
 * memory: the segfault seen on the H200). */
static int aborted_destroy_rank(int32_t rank, void *arg) {
    change_ctx_t *c = arg;
    const mfp_problem_t *p = c->p[0];
    const int32_t Lp = c->P / p->spec.R, victim = p->spec.R - 1;
    const int64_t H = p->spec.H, I = p->spec.I;
    mf_comm_t comm;
    mf_moe_t moe;
    MFT_CHECK_OK(mf_group_get_comm(c->group, rank, &comm));
    MFT_CHECK(change_moe(rank, c, &moe) == 0);
    uint8_t *w13 = mft_alloc((size_t)Lp * 2 * I * H * 2), *w2 = mft_alloc((size_t)Lp * H * I * 2);
    uint16_t *y = mft_alloc((size_t)p->spec.S * H * 2 + 2);
    mf_moe_weights_t w = {mft_t3(w13, MF_DTYPE_BF16, Lp, 2 * I, H), mft_none(), mft_t3(w2, MF_DTYPE_BF16, Lp, H, I),
                          mft_none()};
    MFT_CHECK_OK(mf_moe_set_expert_map(moe, c->maps[0], c->P));
    layout_weights(p, c->maps[0], c->P, rank, w13, w2);
    MFT_CHECK_OK(mf_moe_set_weights(moe, &w));
    MFT_CHECK(forward_check(moe, c, 0, rank, y, MF_SUCCESS) == 0); /* hot routing: every spare slot wanted */
    if (rank == victim) {
        MFT_CHECK_OK(mf_comm_abort(comm));
        MFT_CHECK_OK(mf_moe_destroy(moe)); /* no barrier on an aborted comm */
    }
    pthread_barrier_wait(&c->met);
    if (rank != victim) {
        MFT_CHECK_OK(mf_moe_prefetch(moe, NULL));
        mf_moe_balance_stats_t st = {.size = sizeof st};
        MFT_CHECK_OK(mf_moe_get_balance_stats(moe, &st));
        __atomic_fetch_add(&c->pushed, st.prefetch_bytes, __ATOMIC_RELAXED);
        MFT_CHECK_OK(mf_comm_abort(comm)); /* the victim is gone: no destroy barrier */
        MFT_CHECK_OK(mf_moe_destroy(moe));
    }
    pthread_barrier_wait(&c->met);
    MFT_CHECK_MSG(__atomic_load_n(&c->pushed, __ATOMIC_RELAXED) > 0, "no rank pushed an expert: the test tests nothing");
    free(w13), free(w2), free(y);
    return 0;
}

static int test_aborted_destroy(void) { return run_change_ranks(67, 2, 71, aborted_destroy_rank); }

/* ---- misuse --------------------------------------------------------------------------------- */

typedef struct bad_ctx {
    mf_group_t group;
} bad_ctx_t;

static int bad_rank(int32_t rank, void *arg) {
    bad_ctx_t *c = arg;
    (void)rank;
    mf_comm_t comm;
    MFT_CHECK_OK(mf_group_get_comm(c->group, rank, &comm));
    mf_moe_config_t cfg = MF_MOE_CONFIG_INIT;
    cfg.num_experts = 8, cfg.num_topk = 2, cfg.hidden = 128, cfg.intermediate = 128, cfg.max_tokens_per_rank = 4;
    mf_moe_t moe = NULL;
    /* Configs: P not a multiple of R, P < E, B out of range (every rank alike). */
    cfg.num_physical_experts = 9;
    MFT_CHECK_ERR(mf_moe_create(comm, &cfg, &moe), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "num_physical_experts"));
    cfg.num_physical_experts = 6;
    MFT_CHECK_ERR(mf_moe_create(comm, &cfg, &moe), MF_ERR_INVALID_ARGUMENT);
    cfg.num_physical_experts = 0, cfg.spare_slots = MF_MAX_SPARE_SLOTS + 1;
    MFT_CHECK_ERR(mf_moe_create(comm, &cfg, &moe), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "spare_slots"));
    cfg.num_physical_experts = 10, cfg.spare_slots = 1;
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, &moe));
    int32_t map[10] = {0, 1, 2, 3, 4, 5, 6, 7, 0, 1};
    int32_t bad[10];
    MFT_CHECK_ERR(mf_moe_set_expert_map(moe, NULL, 10), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_ERR(mf_moe_set_expert_map(moe, map, 8), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "num_physical"));
    memcpy(bad, map, sizeof map), bad[3] = 8; /* a slot naming no expert */
    MFT_CHECK_ERR(mf_moe_set_expert_map(moe, bad, 10), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "phys_to_logical[3] = 8"));
    bad[3] = -1;
    MFT_CHECK_ERR(mf_moe_set_expert_map(moe, bad, 10), MF_ERR_INVALID_ARGUMENT);
    memcpy(bad, map, sizeof map), bad[7] = 0; /* expert 7 has no replica */
    MFT_CHECK_ERR(mf_moe_set_expert_map(moe, bad, 10), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "logical expert 7 has no physical slot"));
    /* Nothing was set: a forward still refuses for want of a map; prefetch wants weights. */
    MFT_CHECK_ERR(mf_moe_prefetch(moe, NULL), MF_ERR_INVALID_USAGE);
    mf_moe_balance_stats_t st = {.size = 2};
    MFT_CHECK_ERR(mf_moe_get_balance_stats(moe, &st), MF_ERR_INVALID_ARGUMENT);
    st.size = sizeof st;
    MFT_CHECK_OK(mf_moe_get_balance_stats(moe, &st));
    MFT_CHECK_EQ_INT(st.num_physical_experts, 10);
    MFT_CHECK_EQ_INT(st.slots_per_rank, 5);
    MFT_CHECK_EQ_INT(st.spare_slots, 1);
    MFT_CHECK_OK(mf_moe_set_expert_map(moe, map, 10));
    MFT_CHECK_OK(mf_moe_destroy(moe));
    return 0;
}

static int test_bad_maps(void) {
    bad_ctx_t c = {mft_cpu_group(2, BAL_TIMEOUT_MS)};
    MFT_CHECK(c.group);
    int rc = mft_run_ranks(2, bad_rank, &c);
    MFT_CHECK_OK(mf_group_destroy(c.group));
    return rc;
}

/* ---- rebalancing without a stall (mf_moe_stage_expert_map) ---------------------------------- */

/* Stages `next` over `prev` (n experts per step, B spare slots) with the routing redrawn every
 * call: every call's y equals the plain layer's bit for bit, while staging (old map) and after the
 * switch (new map); mfp_run checks next_weights byte for byte against the experts and that the
 * map switched; the steps, the forwards served while staging and the bytes pushed are the
 * schedule's. */
static int stage_case(int32_t R, int32_t dtype, int32_t B, int32_t extra, int32_t n, int32_t transport, uint64_t seed) {
    mfp_spec_t s = bal_spec(R, dtype, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_ZIPF, seed);
    s.K = 2;
    mfp_problem_t p;
    MFT_CHECK(mfp_generate(&s, &p) == 0);
    const int32_t P = s.E + extra * R, Lp = P / R;
    int32_t prev[64], next[64];
    mft_random_map(s.E, P, seed + 1, prev);
    mft_random_map(s.E, P, seed + 2, next);
    mf__stage_slot_t plan[64];
    int32_t moved = 0, most = 0;
    for (int32_t q = 0; q < R; q++) {
        int32_t m = mf__stage_moved(prev, next, Lp, q);
        moved += m, most = m > most ? m : most;
    }
    const int32_t steps = mf__stage_schedule(prev, next, P, R, n ? n : (most ? most : 1), plan);
    const int32_t total = steps + 3;
    uint64_t *d[2];
    uint16_t *y[2][MF_MAX_RANKS];
    mfp_timing_t t;
    memset(&t, 0, sizeof t);
    int rc = 0;
    for (int k = 0; k < 2; k++) {
        d[k] = calloc((size_t)R * total * 2, sizeof(uint64_t));
        for (int32_t r = 0; r < R; r++) y[k][r] = mft_alloc((size_t)p.T[r] * s.H * 2 + 2);
    }
    for (int k = 0; k < 2 && !rc; k++) {
        mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
        o.backend = MF_BACKEND_CPU, o.iters = total, o.timeout_ms = BAL_TIMEOUT_MS;
        o.redraw = 1, o.redraw_seed = seed * 100, o.digests = d[k];
        if (k) {
            o.transport = transport;
            o.expert_map = prev, o.num_physical = P, o.spare_slots = B, o.prefetch = 1;
            o.stage_map = next, o.stage_at = 1, o.stage_per_step = n;
        }
        char err[512];
        if (mfp_run(&p, &o, y[k], k ? &t : NULL, err, sizeof err) != MF_SUCCESS)
            rc = mft_fail(__FILE__, __LINE__, "%s run (R %d, B %d, n %d): %s", k ? "staged" : "plain", (int)R, (int)B,
                          (int)n, err);
    }
    for (int32_t i = 0; i < R * total && !rc; i++)
        if (d[0][2 * i + 1] != d[1][2 * i + 1])
            rc = mft_fail(__FILE__, __LINE__, "rank %d call %d: y differs from the plain layer's (%s; stage at call "
                          "1, switch after %d steps; R %d, B %d, n %d)", (int)(i / total), (int)(i % total),
                          i % total >= 1 && i % total < steps ? "staging, old map" : "new map", (int)steps, (int)R,
                          (int)B, (int)n);
    if (!rc) {
        const int64_t copy = (int64_t)(2 * s.I * s.H + s.H * s.I) * (dtype == MF_DTYPE_FP8_E4M3 ? 1 : 2) +
                             (dtype == MF_DTYPE_FP8_E4M3 ? (int64_t)3 * (s.I / 128) * (s.H / 128) * 4 : 0);
        mft_verbose("  R %d B %d n %d: %d moved experts, %d steps, %d forwards while staging, %lld bytes pushed "
                    "(at most %lld in a step)\n", (int)R, (int)B, (int)n, (int)moved, (int)t.stage_steps,
                    (int)t.stage_forwards, (long long)t.stage_bytes_total, (long long)t.stage_step_bytes_max);
        if (t.stage_steps != steps || t.stage_forwards != steps - 1 || t.stage_bytes_total != moved * copy ||
            t.stage_step_bytes_max > (int64_t)R * (n ? n : most) * copy)
            rc = mft_fail(__FILE__, __LINE__, "R %d B %d n %d: %d steps (want %d), %d forwards while staging (want %d), "
                          "%lld bytes pushed (want %lld), %lld in a step (at most %lld)", (int)R, (int)B, (int)n,
                          (int)t.stage_steps, (int)steps, (int)t.stage_forwards, (int)steps - 1,
                          (long long)t.stage_bytes_total, (long long)(moved * copy), (long long)t.stage_step_bytes_max,
                          (long long)((int64_t)R * (n ? n : most) * copy));
    }
    for (int k = 0; k < 2; k++) {
        free(d[k]);
        for (int32_t r = 0; r < R; r++) free(y[k][r]);
    }
    mfp_free(&p);
    return rc;
}

/* The schedule itself: every moved slot once, at most n per rank and step, sources hold it. */
static int test_stage_schedule(void) {
    mft_rng_t rng = {0x57a9e};
    for (int i = 0; i < 2000; i++) {
        const int32_t R = 1 + mft_rng_int(&rng, 8), E = R * (1 + mft_rng_int(&rng, 6)), P = E + R * mft_rng_int(&rng, 4);
        const int32_t Lp = P / R, n = 1 + mft_rng_int(&rng, 4);
        int32_t prev[96], next[96];
        mft_random_map(E, P, 3 * (uint64_t)i + 1, prev);
        mft_random_map(E, P, 3 * (uint64_t)i + 2, next);
        if (i % 5 == 0) memcpy(next, prev, sizeof prev); /* the same map: local copies only */
        mf__stage_slot_t plan[96];
        const int32_t steps = mf__stage_schedule(prev, next, P, R, n, plan);
        int32_t per[96][2 * 4 + 1];
        memset(per, 0, sizeof per);
        int32_t last = -1;
        for (int32_t p = 0; p < P; p++) {
            const mf__stage_slot_t *st = &plan[p];
            const int32_t q = p / Lp;
            if (st->held >= 0) {
                MFT_CHECK_MSG(prev[q * Lp + st->held] == next[p], "case %d slot %d: held slot has another expert", i, p);
                continue;
            }
            MFT_CHECK(mf__stage_held(prev, Lp, q, next[p]) < 0);
            MFT_CHECK_MSG(prev[st->source] == next[p], "case %d slot %d: the source does not hold the expert", i, p);
            MFT_CHECK(st->staging >= 0 && st->staging < 2 * n && st->staging / n == st->step % 2);
            MFT_CHECK(st->step + 1 < steps);
            per[q][st->staging]++;
            MFT_CHECK_MSG(per[q][st->staging] <= (st->step / 2 + 1), "case %d: staging slot reused within a step", i);
            last = st->step > last ? st->step : last;
        }
        MFT_CHECK_EQ_INT(steps, last + 2 > 1 ? last + 2 : 1);
        if (i % 5 == 0) MFT_CHECK_EQ_INT(steps, 1);
    }
    return 0;
}

static int test_stage_bitwise(void) {
    return stage_case(2, MF_DTYPE_BF16, 0, 1, 1, MF_TRANSPORT_LOCAL, 71) ||
           stage_case(4, MF_DTYPE_FP8_E4M3, 2, 1, 2, MF_TRANSPORT_LOCAL, 72) ||
           stage_case(4, MF_DTYPE_BF16, 1, 2, 0, MF_TRANSPORT_LOCAL, 73) ||
           stage_case(8, MF_DTYPE_FP8_E4M3, 0, 0, 3, MF_TRANSPORT_LOCAL, 74) ||
           stage_case(1, MF_DTYPE_BF16, 1, 2, 1, MF_TRANSPORT_LOCAL, 75);
}

static int test_stage_ipc(void) {
    return stage_case(4, MF_DTYPE_FP8_E4M3, 2, 1, 1, MF_TRANSPORT_IPC, 81) ||
           stage_case(3, MF_DTYPE_BF16, 0, 2, 0, MF_TRANSPORT_IPC, 82);
}

/* Misuse: bad staged maps and weights, ranks that disagree, calls during a stage; each fails on
 * every rank with nothing changed (the old map still serves, bit for bit), then a good stage runs. */
static int stage_misuse_body(int32_t rank, change_ctx_t *c, mf_moe_t moe, uint8_t *w13, uint8_t *w2, uint16_t *y,
                             uint8_t *n13, uint8_t *n2) {
    const mfp_problem_t *p = c->p[0];
    const int32_t Lp = c->P / p->spec.R, P = c->P;
    const int64_t H = p->spec.H, I = p->spec.I;
    mf_moe_weights_t w = {mft_t3(w13, MF_DTYPE_BF16, Lp, 2 * I, H), mft_none(), mft_t3(w2, MF_DTYPE_BF16, Lp, H, I),
                          mft_none()};
    mf_moe_weights_t nw = {mft_t3(n13, MF_DTYPE_BF16, Lp, 2 * I, H), mft_none(), mft_t3(n2, MF_DTYPE_BF16, Lp, H, I),
                           mft_none()};
    int32_t bad[64];
    /* Before weights: every rank is refused (the old weights are the source). */
    MFT_CHECK_ERR(mf_moe_stage_expert_map(moe, c->maps[1], P, &nw, 1), MF_ERR_INVALID_USAGE);
    MFT_CHECK_OK(mf_moe_set_expert_map(moe, c->maps[0], P));
    layout_weights(p, c->maps[0], P, rank, w13, w2);
    MFT_CHECK_OK(mf_moe_set_weights(moe, &w));
    MFT_CHECK(forward_check(moe, c, 0, rank, y, MF_SUCCESS) == 0);
    /* Bad maps and arguments, the same on every rank. */
    memcpy(bad, c->maps[1], sizeof bad), bad[2] = p->spec.E;
    MFT_CHECK_ERR(mf_moe_stage_expert_map(moe, bad, P, &nw, 1), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "phys_to_logical[2]"));
    memcpy(bad, c->maps[1], sizeof bad);
    for (int32_t q = 0; q < P; q++) bad[q] = bad[q] == 3 ? 4 : bad[q];
    MFT_CHECK_ERR(mf_moe_stage_expert_map(moe, bad, P, &nw, 1), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "logical expert 3 has no physical slot"));
    MFT_CHECK_ERR(mf_moe_stage_expert_map(moe, c->maps[1], P - 1, &nw, 1), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_ERR(mf_moe_stage_expert_map(moe, c->maps[1], P, NULL, 1), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_ERR(mf_moe_stage_expert_map(moe, c->maps[1], P, &nw, -1), MF_ERR_INVALID_ARGUMENT);
    mf_moe_weights_t short_w = nw;
    short_w.w2.dims[0] = Lp - 1;
    MFT_CHECK_ERR(mf_moe_stage_expert_map(moe, c->maps[1], P, &short_w, 1), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "next_weights.w2"));
    MFT_CHECK_ERR(mf_moe_stage_expert_map(moe, c->maps[1], P, &w, 1), MF_ERR_INVALID_ARGUMENT); /* the current ones */
    MFT_CHECK(mft_contains_ci(mf_last_error(), "current weights"));
    /* One rank's bad map: every rank fails (the others name it). */
    memcpy(bad, c->maps[1], sizeof bad), bad[0] = rank == 1 ? -1 : bad[0];
    MFT_CHECK_ERR(mf_moe_stage_expert_map(moe, bad, P, &nw, 1), MF_ERR_INVALID_ARGUMENT);
    if (rank != 1) MFT_CHECK(mft_contains_ci(mf_last_error(), "rank 1 rejected"));
    /* Ranks that stage different maps, or steps: every rank fails. */
    MFT_CHECK_ERR(mf_moe_stage_expert_map(moe, c->maps[rank == 0 ? 2 : 1], P, &nw, 1), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "every rank stages the same"));
    MFT_CHECK_ERR(mf_moe_stage_expert_map(moe, c->maps[1], P, &nw, rank == 2 ? 2 : 1), MF_ERR_INVALID_ARGUMENT);
    /* Nothing changed: no stage in flight, the old map serves; a prefetch moves nothing. */
    mf_moe_balance_stats_t st = {.size = sizeof st};
    MFT_CHECK_OK(mf_moe_get_balance_stats(moe, &st));
    MFT_CHECK_EQ_INT(st.stage_steps_left, 0);
    MFT_CHECK_EQ_INT(st.map_switches, 0);
    MFT_CHECK_OK(mf_moe_prefetch(moe, NULL));
    MFT_CHECK_OK(mf_moe_get_balance_stats(moe, &st));
    MFT_CHECK(st.stage_bytes == 0 && st.stage_local_bytes == 0);
    MFT_CHECK(forward_check(moe, c, 1, rank, y, MF_SUCCESS) == 0);
    /* A good stage, one expert per step; during it: no second stage, no set_expert_map or
     * set_weights; forwards serve the old map. */
    memset(n13, 0xA5, (size_t)Lp * 2 * I * H * 2), memset(n2, 0xA5, (size_t)Lp * H * I * 2);
    MFT_CHECK_OK(mf_moe_stage_expert_map(moe, c->maps[1], P, &nw, 1));
    MFT_CHECK_ERR(mf_moe_stage_expert_map(moe, c->maps[1], P, &nw, 1), MF_ERR_INVALID_USAGE);
    MFT_CHECK(mft_contains_ci(mf_last_error(), "in progress"));
    MFT_CHECK_ERR(mf_moe_set_expert_map(moe, c->maps[1], P), MF_ERR_INVALID_USAGE);
    MFT_CHECK_ERR(mf_moe_set_weights(moe, &w), MF_ERR_INVALID_USAGE);
    int32_t steps = 0;
    for (;; steps++) {
        MFT_CHECK_OK(mf_moe_get_balance_stats(moe, &st));
        if (!st.stage_steps_left) break;
        MFT_CHECK(steps < 64);
        MFT_CHECK_OK(mf_moe_prefetch(moe, NULL));
        MFT_CHECK(forward_check(moe, c, steps % 2, rank, y, MF_SUCCESS) == 0);
    }
    MFT_CHECK_EQ_INT(st.map_switches, 1);
    /* The moved weights are the new map's experts, byte for byte. */
    layout_weights(p, c->maps[1], P, rank, w13, w2);
    MFT_CHECK_MSG(memcmp(n13, w13, (size_t)Lp * 2 * I * H * 2) == 0 && memcmp(n2, w2, (size_t)Lp * H * I * 2) == 0,
                  "rank %d: next_weights differ from the new map's experts", (int)rank);
    memset(w13, 0x5A, (size_t)Lp * 2 * I * H * 2), memset(w2, 0x5A, (size_t)Lp * H * I * 2); /* old ones reusable */
    for (int32_t it = 0; it < 3; it++) {
        MFT_CHECK(forward_check(moe, c, it % 2, rank, y, MF_SUCCESS) == 0);
        MFT_CHECK_OK(mf_moe_prefetch(moe, NULL));
    }
    /* A rank that skips a step: every rank fails the next forward (the prefetch counts differ). */
    MFT_CHECK_OK(mf_moe_stage_expert_map(moe, c->maps[2], P, &w, 1)); /* into the old buffers */
    if (rank != 0) MFT_CHECK_OK(mf_moe_prefetch(moe, NULL));
    MFT_CHECK(forward_check(moe, c, 0, rank, y, MF_ERR_INVALID_USAGE) == 0);
    return 0;
}

static int stage_misuse_rank(int32_t rank, void *arg) {
    change_ctx_t *c = arg;
    const mfp_problem_t *p = c->p[0];
    mf_moe_t moe;
    MFT_CHECK(change_moe(rank, c, &moe) == 0);
    const int32_t Lp = c->P / p->spec.R;
    const size_t b13 = (size_t)Lp * 2 * p->spec.I * p->spec.H * 2, b2 = (size_t)Lp * p->spec.H * p->spec.I * 2;
    uint8_t *w13 = mft_alloc(b13), *w2 = mft_alloc(b2), *n13 = mft_alloc(b13), *n2 = mft_alloc(b2);
    uint16_t *y = mft_alloc((size_t)p->spec.S * p->spec.H * 2 + 2);
    int rc = stage_misuse_body(rank, c, moe, w13, w2, y, n13, n2);
    mf_result_t d = mf_moe_destroy(moe);
    free(w13), free(w2), free(n13), free(n2), free(y);
    if (!rc) MFT_CHECK_OK(d);
    return rc;
}

static int test_stage_misuse(void) { return run_change_ranks(91, 1, 93, stage_misuse_rank); }

const mft_test_t mft_tests_balance[] = {
    {"balance_stage_schedule", test_stage_schedule, 0},
    {"balance_stage_bitwise", test_stage_bitwise, 0},
    {"balance_stage_ipc", test_stage_ipc, 0},
    {"balance_stage_misuse", test_stage_misuse, 0},
    {"balance_pick_incremental", test_pick_incremental, 120},
    {"balance_plan_parallel", test_plan_parallel, 120},
    {"balance_planner", test_planner, 0},
    {"balance_maps_bitwise", test_maps_bitwise, 0},
    {"balance_spare_bitwise", test_spare_bitwise, 0},
    {"balance_ipc", test_ipc, 0},
    {"balance_random", test_random_cases, 0},
    {"balance_map_changes", test_map_changes, 0},
    {"balance_aborted_destroy", test_aborted_destroy, 0},
    {"balance_bad_maps", test_bad_maps, 0},
    {NULL, NULL, 0},
};
