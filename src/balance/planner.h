/*
 * planner.h — the balancing planner (docs/DESIGN.md "Balanced EP"): plain C, header-only, the same
 * code on the host (CPU backend, the CLI's model, the CUDA backend's oracle) and on the device (one
 * thread of the CUDA plan kernel, compiled by nvcc through MF_HD). No allocation, no libc: every
 * array is the caller's, sized as each function says.
 *
 * Words. A *logical* expert is a routing id, e in [0, E). A *physical slot* holds the weights of one
 * logical expert: the P static slots of the expert map (slot p on rank p / Lp, Lp = P / R; -1 in a
 * placement's empty slot, src/plan/placement.h, which is no replica) and the R * B spare slots
 * (spare j of rank q holds spare[q * B + j], or -1). A *replica* is a slot
 * holding e. Replicas are listed per expert in CSR form (rep_off[E + 1]), static slots in physical
 * order, then spare slots in (rank, j) order; a replica is named by its rank and local slot (static
 * l in [0, Lp), spare Lp + j).
 *
 * The three steps, all deterministic functions of their inputs (every rank computes the same):
 *   mf__balance_replicas  map + spare table -> replica lists
 *   mf__balance_split     global counts [E] + replica lists -> rows of every replica (share) and
 *                         rows per rank: experts with one replica give it all; the others, in
 *                         order of descending count (then ascending id), water-fill their
 *                         replicas' ranks towards an equal level (ties to the earlier replica).
 *                         Replica i of e takes e's global rows [begin_i, begin_i + share_i), in
 *                         e's row order (source rank, token, k) and in replica order.
 *   mf__balance_pick      the previous call's counts + map + resident spares -> the next spare
 *                         table: up to R * B times, each of the busiest rank's 4 largest shares
 *                         is tried as a new replica on the least loaded rank with a free spare
 *                         slot (and none of it yet); the one whose split gives the lowest (max
 *                         load, sum of squared loads) is kept, while one improves the table; then
 *                         each rank's chosen experts keep the slots they already occupy, so that
 *                         a steady routing copies nothing.
 *
 * Dimension legend: E logical experts, R ranks, P physical slots (P % R == 0), Lp = P / R, B spare
 * slots per rank, N = P + R * B replica entries at most.
 */
#ifndef MF_BALANCE_PLANNER_H
#define MF_BALANCE_PLANNER_H

#include <stdint.h>

#include "core/numerics.h" /* MF_HD: static inline on the host, __host__ __device__ under nvcc */
#include "moeflow.h"       /* MF_MAX_RANKS */
#include "plan/placement.h" /* the home rank of an expert */

/* mf__balance_pick tries this many of the busiest rank's experts per spare slot. */
#define MF__BALANCE_CANDIDATES 4

/* Builds the replica lists. map [P] (values in [0, E), validated by the caller, or -1: an empty
 * slot), spare [R * B] (-1 = empty) or NULL when B = 0. Out: rep_off [E + 1], rep_rank [N],
 * rep_slot [N]; count [E] scratch. Returns the number of replicas. */
MF_HD int32_t mf__balance_replicas(int32_t E, int32_t R, int32_t P, int32_t B, const int32_t *map,
                                          const int32_t *spare, int32_t *rep_off, int32_t *rep_rank,
                                          int32_t *rep_slot, int32_t *count) {
    const int32_t Lp = P / R;
    for (int32_t e = 0; e < E; e++) count[e] = 0;
    for (int32_t p = 0; p < P; p++)
        if (map[p] >= 0) count[map[p]]++;
    for (int32_t i = 0; spare && i < R * B; i++)
        if (spare[i] >= 0) count[spare[i]]++;
    rep_off[0] = 0;
    for (int32_t e = 0; e < E; e++) rep_off[e + 1] = rep_off[e] + count[e], count[e] = rep_off[e];
    for (int32_t p = 0; p < P; p++) {
        if (map[p] < 0) continue;
        int32_t at = count[map[p]]++;
        rep_rank[at] = p / Lp, rep_slot[at] = p % Lp;
    }
    for (int32_t i = 0; spare && i < R * B; i++)
        if (spare[i] >= 0) {
            int32_t at = count[spare[i]]++;
            rep_rank[at] = i / B, rep_slot[at] = Lp + i % B;
        }
    return rep_off[E];
}

/* Water-fills `rows` over the replicas [a, b) of one expert: share[i] so that the loads of their
 * ranks rise towards one level (a rank holding two replicas counts once per replica, seeing the
 * load as it rises). Adds the shares to load [R]. */
MF_HD void mf__balance_fill(int64_t rows, int32_t a, int32_t b, const int32_t *rep_rank, int32_t *share,
                                   int64_t *load) {
    if (b - a == 1) {
        share[a] = (int32_t)rows;
        load[rep_rank[a]] += rows;
        return;
    }
    /* The smallest level lv with f(lv) = sum max(0, lv - load) >= rows, by bisection. */
    int64_t lo = load[rep_rank[a]];
    for (int32_t i = a; i < b; i++) lo = load[rep_rank[i]] < lo ? load[rep_rank[i]] : lo;
    int64_t hi = lo + rows;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2, f = 0;
        for (int32_t i = a; i < b; i++) f += mid > load[rep_rank[i]] ? mid - load[rep_rank[i]] : 0;
        if (f >= rows) hi = mid;
        else lo = mid + 1;
    }
    /* Fill to lv - 1, then one more row each to the earliest replicas standing at lv - 1. */
    int64_t left = rows;
    for (int32_t i = a; i < b; i++) {
        int64_t l = load[rep_rank[i]];
        share[i] = (int32_t)(lo - 1 > l ? lo - 1 - l : 0);
        left -= share[i];
    }
    for (int32_t i = a; i < b && left > 0; i++)
        if (load[rep_rank[i]] + share[i] == lo - 1) share[i]++, left--;
    for (int32_t i = a; i < b; i++) load[rep_rank[i]] += share[i];
}

/* Splits every expert's rows over its replicas. counts [E]; rep_* from mf__balance_replicas.
 * Out: share [N] rows of each replica; load [R] rows per rank. order [E] scratch. */
MF_HD void mf__balance_split(int32_t E, int32_t R, const int32_t *counts, const int32_t *rep_off,
                                    const int32_t *rep_rank, int32_t *share, int64_t *load, int32_t *order) {
    for (int32_t r = 0; r < R; r++) load[r] = 0;
    int32_t m = 0;
    for (int32_t e = 0; e < E; e++) {
        if (rep_off[e + 1] - rep_off[e] == 1) mf__balance_fill(counts[e], rep_off[e], rep_off[e] + 1, rep_rank, share, load);
        else order[m++] = e;
    }
    /* Replicated experts by descending count, then ascending id (insertion sort: m is small). */
    for (int32_t i = 1; i < m; i++) {
        int32_t e = order[i], j = i;
        while (j > 0 && (counts[order[j - 1]] < counts[e] || (counts[order[j - 1]] == counts[e] && order[j - 1] > e)))
            order[j] = order[j - 1], j--;
        order[j] = e;
    }
    for (int32_t i = 0; i < m; i++) mf__balance_fill(counts[order[i]], rep_off[order[i]], rep_off[order[i] + 1], rep_rank, share, load);
}

/* One trial of mf__balance_pick, without rebuilding the lists: the loads mf__balance_split would give
 * if expert e gained a spare replica on rank d at spare-table index inew (d * B + n), from the
 * current state (rep_off / rep_rank of the picks so far, order[0, m) the replicated experts in the
 * split's order, base [R] the singletons' rows per rank, chosen [R * B]). Singletons only add their counts (order-free integer sums), and
 * the replicated experts water-fill in the split's order, e inserted where the split would sort
 * it, its new replica placed where mf__balance_replicas would list it (statics, then spares by
 * table index): so the loads are the split's, bit for bit. tshare [N] and trank [N] are scratch
 * (clobbered); out: tload [R], *mx, *sq as the pick measures them. */
MF_HD void mf__balance_trial(int32_t E, int32_t R, int32_t B, const int32_t *counts, const int32_t *rep_off,
                             const int32_t *rep_rank, const int32_t *order, int32_t m, const int64_t *base,
                             const int32_t *chosen, int32_t e, int32_t d, int32_t inew, int32_t *tshare, int32_t *trank,
                             int64_t *tload, int64_t *mx, double *sq) {
    (void)E;
    for (int32_t r = 0; r < R; r++) tload[r] = base[r];
    if (rep_off[e + 1] - rep_off[e] == 1) tload[rep_rank[rep_off[e]]] -= counts[e]; /* e leaves the singletons */
    /* e's replicas with the new one: its statics (listed first), then its spares by table index. */
    int32_t k = 0, nspare = 0;
    for (int32_t i = 0; i < R * B; i++) nspare += chosen[i] == e;
    for (int32_t i = rep_off[e]; i < rep_off[e + 1] - nspare; i++) trank[k++] = rep_rank[i];
    for (int32_t i = 0; i < R * B; i++) {
        if (i == inew) trank[k++] = d;
        else if (chosen[i] == e) trank[k++] = i / B;
    }
    const int32_t ce = counts[e];
    int32_t inserted = 0;
    for (int32_t j = 0; j <= m; j++) {
        const int32_t x = j < m ? order[j] : -1;
        if (!inserted && (x < 0 || x == e || counts[x] < ce || (counts[x] == ce && x > e))) {
            mf__balance_fill(ce, 0, k, trank, tshare, tload);
            inserted = 1;
        }
        if (x < 0 || x == e) continue;
        mf__balance_fill(counts[x], rep_off[x], rep_off[x + 1], rep_rank, tshare, tload);
    }
    *mx = 0, *sq = 0;
    for (int32_t r = 0; r < R; r++) *mx = tload[r] > *mx ? tload[r] : *mx, *sq += (double)tload[r] * tload[r];
}

/* The next spare table. counts [E] (the previous call's), map [P], resident [R * B] (the table now,
 * -1 = empty). Out: spare [R * B]. Scratch: rep_off [E + 1], rep_rank [N], rep_slot [N], share [N],
 * load [R], iscratch [E + R * B]. */
MF_HD void mf__balance_pick(int32_t E, int32_t R, int32_t P, int32_t B, const int32_t *counts,
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
        /* Each candidate is tried (mf__balance_trial: the split's loads with that one replica added,
         * without rebuilding the lists); the one whose split has the lowest (max load, sum of squared
         * loads) wins, if it beats the table without it. The trials clobber share, rep_slot and load
         * (scratch until the rebuild below). */
        int64_t best_max = 0, base[MF_MAX_RANKS];
        double best_sq = 0;
        for (int32_t r = 0; r < R; r++) best_max = load[r] > best_max ? load[r] : best_max, best_sq += (double)load[r] * load[r];
        int32_t m = 0;
        for (int32_t r = 0; r < R; r++) base[r] = 0;
        for (int32_t e = 0; e < E; e++) {
            if (rep_off[e + 1] - rep_off[e] == 1) base[rep_rank[rep_off[e]]] += counts[e];
            else m++;
        }
        int32_t pick = -1;
        for (int32_t c = 0; c < nc; c++) {
            if (dest[c] < 0) continue;
            int32_t n = 0;
            while (chosen[dest[c] * B + n] >= 0) n++;
            int64_t mx;
            double sq;
            mf__balance_trial(E, R, B, counts, rep_off, rep_rank, order, m, base, chosen, cand[c], dest[c],
                              dest[c] * B + n, share, rep_slot, load, &mx, &sq);
            if (mx < best_max || (mx == best_max && sq < best_sq)) best_max = mx, best_sq = sq, pick = c;
        }
        if (pick < 0) break; /* no replica of q's experts improves the table */
        int32_t n = 0;
        while (chosen[dest[pick] * B + n] >= 0) n++;
        chosen[dest[pick] * B + n] = cand[pick];
        mf__balance_replicas(E, R, P, B, map, chosen, rep_off, rep_rank, rep_slot, order);
        mf__balance_split(E, R, counts, rep_off, rep_rank, share, load, order);
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

/* ---- the plan of one call, block-parallel (the CUDA plan's offsets kernel) -------------------------
 *
 * mf__balance_plan_par computes what mf__balance_replicas + mf__balance_split + the plan's capacity
 * verdict and slot table compute (src/plan/plan.c), with the work spread over the threads of one
 * CUDA block: counts by atomics, prefixes and list positions by counting (lockstep loops over
 * shared memory), the singletons' loads by atomic sums (order-free integers), and only the
 * replicated experts' water-fill on one thread in the split's order. The same code runs on the
 * host with MF__PAR_* as plain loops (one "thread" doing every index in turn, barriers empty):
 * tests/test_balance.c checks it there against the serial functions, bit for bit.
 */
#if defined(__CUDA_ARCH__)
#define MF__PAR_FOR(i, n) for (int32_t i = (int32_t)threadIdx.x; i < (n); i += (int32_t)blockDim.x)
#define MF__PAR_SYNC() __syncthreads()
#define MF__PAR_ONE (threadIdx.x == 0)
#define MF__PAR_ADD32(p, v) atomicAdd((p), (v))
#define MF__PAR_ADD64(p, v) atomicAdd((unsigned long long *)(p), (unsigned long long)(v))
#define MF__PAR_MIN32(p, v) atomicMin((p), (v))
#else
#define MF__PAR_FOR(i, n) for (int32_t i = 0; i < (n); i++)
#define MF__PAR_SYNC() ((void)0)
#define MF__PAR_ONE 1
#define MF__PAR_ADD32(p, v) ((*(p) += (v)) - (v)) /* the old value, as atomicAdd returns */
#define MF__PAR_ADD64(p, v) (*(p) += (v))
#define MF__PAR_MIN32(p, v) (*(p) = *(p) < (v) ? *(p) : (v))
#endif

/* Workspace of mf__balance_plan_par (shared memory on CUDA), every array the caller's:
 * int32: count_static [E], count_spare [E], rep_off [E + 1], rep_rank [N], rep_slot [N], share [N],
 * order [E], small [4] (m, verdict, ...); int64: load [R], home [R], rows [R]; int32 over [R]. */
typedef struct mf__balance_ws {
    int32_t *count_static, *count_spare, *rep_off, *rep_rank, *rep_slot, *share, *order, *small, *over;
    int64_t *load, *home, *rows;
} mf__balance_ws_t;

/* The plan's balanced part for rank `me`: map [P] (-1 = an empty slot), spare [R * B] (-1 = empty;
 * all -1 when unused), counts [E]; `placement` (mf_placement_t) names each expert's home rank for
 * ws->home. Out (the caller's, e.g. global memory): slot_count [L], slot_begin [L], slot_expert [L]
 * for this rank's L = Lp + B slots; ws->load / ws->home [R]. Returns through ws->small[1] the
 * capacity verdict: -1 fine, else the failing rank (the lowest, as the serial plan reports it);
 * small[2]: MASKED its overflowing replica index (lowest), small[3] unused. Every thread of the
 * block calls it (it has barriers). */
MF_HD void mf__balance_plan_par(int32_t E, int32_t R, int32_t P, int32_t B, int32_t placement, int32_t me, int32_t masked,
                                int32_t block_m, int32_t capacity, int32_t max_rows, const int32_t *map,
                                const int32_t *spare, const int32_t *counts, const mf__balance_ws_t *ws,
                                int32_t *slot_count, int32_t *slot_begin, int32_t *slot_expert) {
    const int32_t Lp = P / R, RB = R * B, L = Lp + B;
    int32_t *cs = ws->count_static, *cp = ws->count_spare, *rep_off = ws->rep_off, *rep_rank = ws->rep_rank;
    int32_t *rep_slot = ws->rep_slot, *share = ws->share, *order = ws->order, *small = ws->small, *over = ws->over;
    int64_t *load = ws->load, *home = ws->home, *rows = ws->rows;
    MF__PAR_FOR(e, E) cs[e] = 0, cp[e] = 0;
    MF__PAR_FOR(r, R) load[r] = 0, home[r] = 0, rows[r] = 0, over[r] = 0x7fffffff;
    if (MF__PAR_ONE) small[0] = 0, small[1] = -1, small[2] = -1, small[3] = 0;
    MF__PAR_SYNC();
    MF__PAR_FOR(p, P) if (map[p] >= 0)(void) MF__PAR_ADD32(&cs[map[p]], 1);
    MF__PAR_FOR(i, RB) if (spare[i] >= 0)(void) MF__PAR_ADD32(&cp[spare[i]], 1);
    MF__PAR_SYNC();
    /* rep_off[e] = sum of the counts before e (each thread sums its own prefix). */
    MF__PAR_FOR(e, E + 1) {
        int32_t sum = 0;
        for (int32_t x = 0; x < e; x++) sum += cs[x] + cp[x];
        rep_off[e] = sum;
    }
    MF__PAR_SYNC();
    /* Lists: statics in physical order, then spares in table order (mf__balance_replicas' order). */
    MF__PAR_FOR(p, P) {
        const int32_t e = map[p];
        if (e >= 0) {
            int32_t before = 0;
            for (int32_t x = 0; x < p; x++) before += map[x] == e;
            rep_rank[rep_off[e] + before] = p / Lp, rep_slot[rep_off[e] + before] = p % Lp;
        }
    }
    MF__PAR_FOR(i, RB) {
        const int32_t e = spare[i];
        if (e >= 0) {
            int32_t before = 0;
            for (int32_t x = 0; x < i; x++) before += spare[x] == e;
            rep_rank[rep_off[e] + cs[e] + before] = i / B, rep_slot[rep_off[e] + cs[e] + before] = Lp + i % B;
        }
    }
    MF__PAR_SYNC();
    /* The split: singletons add their counts (order-free), the replicated experts are collected. */
    MF__PAR_FOR(e, E) {
        MF__PAR_ADD64(&home[mf__placement_rank(E, R, placement, e)], counts[e]);
        if (rep_off[e + 1] - rep_off[e] == 1) {
            share[rep_off[e]] = counts[e];
            MF__PAR_ADD64(&load[rep_rank[rep_off[e]]], counts[e]);
        } else {
            order[MF__PAR_ADD32(&small[0], 1)] = e;
        }
    }
    MF__PAR_SYNC();
    if (MF__PAR_ONE) {
        /* The split's order (count descending, then id ascending): a total order, so the result does
         * not depend on the order the threads appended in. */
        const int32_t m = small[0];
        for (int32_t i = 1; i < m; i++) {
            int32_t e = order[i], j = i;
            while (j > 0 && (counts[order[j - 1]] < counts[e] || (counts[order[j - 1]] == counts[e] && order[j - 1] > e)))
                order[j] = order[j - 1], j--;
            order[j] = e;
        }
        for (int32_t i = 0; i < m; i++)
            mf__balance_fill(counts[order[i]], rep_off[order[i]], rep_off[order[i] + 1], rep_rank, share, load);
    }
    MF__PAR_SYNC();
    /* Capacity: rows per rank (padded) and, MASKED, the lowest overflowing replica per rank. */
    MF__PAR_FOR(i, rep_off[E]) {
        const int32_t q = rep_rank[i];
        if (masked && share[i] > capacity) MF__PAR_MIN32(&over[q], i);
        MF__PAR_ADD64(&rows[q], ((int64_t)share[i] + block_m - 1) / block_m * block_m);
    }
    MF__PAR_FOR(s, L) {
        slot_count[s] = 0, slot_begin[s] = 0;
        slot_expert[s] = s < Lp ? map[me * Lp + s] : spare[me * B + s - Lp];
    }
    MF__PAR_SYNC();
    if (MF__PAR_ONE)
        for (int32_t q = 0; q < R && small[1] < 0; q++)
            if ((masked && over[q] != 0x7fffffff) || (!masked && rows[q] > max_rows))
                small[1] = q, small[2] = masked ? over[q] : -1;
    /* This rank's slots: count and first row in the expert's global order. */
    MF__PAR_FOR(e, E) {
        for (int32_t i = rep_off[e], begin = 0; i < rep_off[e + 1]; begin += share[i], i++)
            if (rep_rank[i] == me) slot_count[rep_slot[i]] = share[i], slot_begin[rep_slot[i]] = begin;
    }
    MF__PAR_SYNC();
}

#endif /* MF_BALANCE_PLANNER_H */
