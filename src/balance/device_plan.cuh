/*
 * device_plan.cuh — the balanced plan on the device: the branch of the plan's offsets kernel
 * (cuda/kernels/movement.cuh, mf__plan_offsets_kernel) that runs when the layer has replicas or
 * spare slots (docs/DESIGN.md "Balanced EP"), and the dynamic shared memory it needs. The planner
 * of planner.h over shared memory: block-parallel (mf__balance_plan_par) or, as a test hook, its
 * serial functions on thread 0, which are the CPU oracle's (src/plan/plan.c mf__plan_build) line
 * for line; then the capacity verdict over replicas, this rank's slot offsets and its stats.
 *
 * Not a header of its own: movement.cuh includes it after mf__plan_params_t and mf__plan_check_meta,
 * at the place the function stood, so that every kernel's code stays as it was (dev/cubin_diff.py).
 *
 * Dimension legend: E logical experts, R ranks, P physical slots, Lp = P / R, B spare slots per rank,
 * N = P + R * B replica entries, L = Lp + B this rank's slots.
 */
#ifndef MF_BALANCE_DEVICE_PLAN_CUH
#define MF_BALANCE_DEVICE_PLAN_CUH

#include "balance/planner.h"

/* Bytes of dynamic shared memory of the balanced offsets kernel: load, home, rows [R] int64; counts
 * [E], map [P], spare [R * B], rep_off [E + 1], rep_rank, rep_slot, share [N], order [E],
 * count_static, count_spare [E], small [4], over [R] int32. */
static inline size_t mf__plan_balance_smem(int32_t E, int32_t R, int32_t P, int32_t B) {
    const size_t N = (size_t)P + (size_t)R * B;
    return 3 * (size_t)R * sizeof(int64_t) +
           ((size_t)E + P + (size_t)R * B + E + 1 + 3 * N + E + 2 * (size_t)E + 4 + R) * sizeof(int32_t);
}

/* The balanced plan of one call (one block; thread 0 runs the planner over shared memory, as the CPU
 * plan does; see the comment above mf__plan_params_t in movement.cuh). A faulted call leaves empty
 * segments. */
__device__ void mf__plan_offsets_balanced(const mf__plan_params_t &p) {
    extern __shared__ int64_t mf__bal_smem[];
    __shared__ int32_t ok;
    const int32_t E = p.E, R = p.view.num_ranks, P = p.P, B = p.B, Lp = p.Lp, L = p.L, me = p.view.rank;
    const int32_t N = P + R * B;
    const bool masked = p.layout == MF_LAYOUT_MASKED;
    int64_t *load = mf__bal_smem, *home = load + R, *rows_q = home + R;
    int32_t *counts = (int32_t *)(rows_q + R), *map = counts + E, *spare = map + P, *rep_off = spare + R * B;
    int32_t *rep_rank = rep_off + E + 1, *rep_slot = rep_rank + N, *share = rep_slot + N, *order = share + N;
    int32_t *cs = order + E, *cp = cs + E, *small = cp + E, *over = small + 4;
    const bool use_spare = B > 0 && *p.weights_seen == p.weights_count;
    for (int32_t e = threadIdx.x; e < E; e += blockDim.x) counts[e] = p.global_counts[e];
    for (int32_t i = threadIdx.x; i < P; i += blockDim.x) map[i] = p.map[i];
    for (int32_t i = threadIdx.x; i < R * B; i += blockDim.x) spare[i] = use_spare ? p.resident[i] : -1;
    __syncthreads();
    bool faulted = mf__faulted(p.sink); /* the same on every thread: set only in stream order, or by the meta check */
    if (!faulted && !p.serial) {
        /* Every thread: lists, split, capacity per rank, this rank's slots (src/balance/planner.h). */
        const mf__balance_ws_t ws = {cs, cp, rep_off, rep_rank, rep_slot, share, order, small, over, load, home, rows_q};
        mf__balance_plan_par(E, R, P, B, p.placement, me, masked, p.block_m, p.capacity, p.max_rows, map, spare, counts,
                             &ws, p.counts, p.slot_begin, p.slot_expert);
    }
    if (threadIdx.x == 0) {
        if (!faulted && p.serial) {
            mf__balance_replicas(E, R, P, B, map, B ? spare : (const int32_t *)0, rep_off, rep_rank, rep_slot, order);
            mf__balance_split(E, R, counts, rep_off, rep_rank, share, load, order);
            for (int32_t r = 0; r < R; r++) home[r] = 0;
            for (int32_t e = 0; e < E; e++) home[mf__placement_rank(E, R, p.placement, e)] += counts[e];
            /* Capacity verdict for every rank, as the CPU plan reports it: the lowest failing rank (MASKED:
             * its lowest overflowing replica), from one pass over the replicas (expert order). */
            small[1] = -1, small[2] = -1;
            for (int32_t q = 0; q < R; q++) rows_q[q] = 0, over[q] = -1;
            for (int32_t i = 0; i < rep_off[E]; i++) {
                const int32_t q = rep_rank[i];
                if (masked && share[i] > p.capacity && over[q] < 0) over[q] = i;
                rows_q[q] += ((long long)share[i] + p.block_m - 1) / p.block_m * p.block_m;
            }
            for (int32_t q = 0; q < R && small[1] < 0; q++)
                if ((masked && over[q] >= 0) || (!masked && rows_q[q] > p.max_rows)) small[1] = q, small[2] = over[q];
            for (int32_t s = 0; s < L; s++) {
                p.counts[s] = 0;
                p.slot_begin[s] = 0;
                p.slot_expert[s] = s < Lp ? map[me * Lp + s] : spare[me * B + s - Lp];
            }
            for (int32_t e = 0; e < E; e++)
                for (int32_t i = rep_off[e], begin = 0; i < rep_off[e + 1]; begin += share[i], i++)
                    if (rep_rank[i] == me) p.counts[rep_slot[i]] = share[i], p.slot_begin[rep_slot[i]] = begin;
        }
        if (!faulted && small[1] >= 0) {
            const int32_t q = small[1];
            if (masked) {
                const int32_t i = small[2];
                int32_t e = 0;
                while (rep_off[e + 1] <= i) e++;
                mf__set_fault(p.sink, MF_ERR_CAPACITY, kMfFaultCapacity, q, MF__PHASE_DISPATCH, -1, 0, e, share[i],
                              p.capacity);
            } else {
                mf__set_fault(p.sink, MF_ERR_CAPACITY, kMfFaultCapacity, q, MF__PHASE_DISPATCH, -2, 0, q, rows_q[q],
                              p.max_rows);
            }
            faulted = true;
        }
        /* Offsets over this rank's slots; a faulted call leaves empty segments. */
        int32_t off = 0;
        for (int32_t s = 0; s < L; s++) {
            if (faulted) {
                p.counts[s] = 0;
                p.slot_begin[s] = 0;
                p.slot_expert[s] = s < Lp ? map[me * Lp + s] : spare[me * B + s - Lp];
            }
            const int32_t c = p.counts[s];
            p.offsets[s] = faulted ? 0 : masked ? s * p.capacity : off;
            off += (int32_t)(((int64_t)c + p.block_m - 1) / p.block_m * p.block_m);
        }
        p.offsets[L] = faulted ? 0 : masked ? L * p.capacity : off;
        if (!faulted) {
            for (int32_t r = 0; r < R; r++) p.stats[r] = load[r], p.stats[MF_MAX_RANKS + r] = home[r];
            *p.have_prev = 1;
        }
        ok = !faulted;
    }
    __syncthreads();
    if (ok)
        for (int32_t e = threadIdx.x; e < E; e += blockDim.x) p.prev_counts[e] = counts[e];
    /* mf_dispatch: the caller's copies (its slots are the first out_slots; a faulted call writes none) */
    if (ok && p.counts_out)
        for (int32_t s = threadIdx.x; s < p.out_slots; s += blockDim.x) p.counts_out[s] = p.counts[s];
    if (ok && p.offsets_out)
        for (int32_t s = threadIdx.x; s <= p.out_slots; s += blockDim.x) p.offsets_out[s] = p.offsets[s];
}

#endif /* MF_BALANCE_DEVICE_PLAN_CUH */
