/*
 * stage.h — the schedule of a staged expert map (mf_moe_stage_expert_map; docs/DESIGN.md "Balanced
 * EP", "Rebalancing without a stall"): which slot of the new map is a local copy, which arrives
 * from which peer, and in which step. Plain C, header-only, no allocation: every rank computes the
 * same schedule from (old map, new map, n), so ranks agree on every step without an exchange.
 *
 * The schedule. Slot l of rank q under the new map holds e = next[q * Lp + l].
 *   local   q already holds e in a static slot of the old map (the first such slot): a copy on q,
 *           done in step 0.
 *   moved   otherwise; q's moved slots, in slot order, are numbered m = 0, 1, ...; slot m travels
 *           in step m / n into q's staging slot (m / n) % 2 * n + m % n, pushed by the rank that
 *           holds e's first static replica of the old map (lowest physical id), from its old
 *           weights; q copies it into next_weights in step m / n + 1.
 * Staging slots alternate between two halves by step parity, so a step's pushes never overwrite
 * arrivals not yet copied (docs/DESIGN.md gives the ordering argument). Steps: k =
 * ceil(max_q moved(q) / n) push steps, and one more that copies the last arrivals; k = 0 needs
 * one step (the local copies). The step that ends the schedule switches the layer.
 *
 * Dimension legend: E logical experts, R ranks, P physical slots, Lp = P / R, n experts per step.
 */
#ifndef MF_BALANCE_STAGE_H
#define MF_BALANCE_STAGE_H

#include <stdint.h>

/* The first static slot of rank q holding e under `map`, as a local slot in [0, Lp), or -1. */
static inline int32_t mf__stage_held(const int32_t *map, int32_t Lp, int32_t q, int32_t e) {
    for (int32_t l = 0; l < Lp; l++)
        if (map[q * Lp + l] == e) return l;
    return -1;
}

/* The physical slot of e's first static replica under `map` (every expert has one). */
static inline int32_t mf__stage_source(const int32_t *map, int32_t P, int32_t e) {
    int32_t p = 0;
    while (p < P - 1 && map[p] != e) p++;
    return p;
}

/* Slots of rank q under `next` whose expert q does not hold under `prev`. */
static inline int32_t mf__stage_moved(const int32_t *prev, const int32_t *next, int32_t Lp, int32_t q) {
    int32_t m = 0;
    for (int32_t l = 0; l < Lp; l++) m += mf__stage_held(prev, Lp, q, next[q * Lp + l]) < 0;
    return m;
}

/* What one slot of the new map needs (the schedule is an array [P] of these, in physical order). */
typedef struct mf__stage_slot {
    int32_t held;    /* local: the old static slot of this rank holding the expert; -1 when it moves */
    int32_t step;    /* moved: the step that pushes it; it lands in next_weights in step + 1 */
    int32_t staging; /* moved: the destination rank's staging slot, in [0, 2n) */
    int32_t source;  /* moved: the old map's physical slot it is pushed from (rank source / Lp) */
} mf__stage_slot_t;

/* Fills plan[P] for (prev -> next) with n >= 1 experts per step and returns the steps (prefetch
 * calls) the schedule takes, the switching one included: k + 1, or 1 when nothing moves. */
static inline int32_t mf__stage_schedule(const int32_t *prev, const int32_t *next, int32_t P, int32_t R, int32_t n,
                                         mf__stage_slot_t *plan) {
    int32_t Lp = P / R, most = 0;
    for (int32_t q = 0; q < R; q++) {
        int32_t m = 0;
        for (int32_t l = 0; l < Lp; l++) {
            int32_t e = next[q * Lp + l];
            mf__stage_slot_t *s = &plan[q * Lp + l];
            s->held = mf__stage_held(prev, Lp, q, e);
            s->step = s->staging = s->source = -1;
            if (s->held >= 0) continue;
            s->step = m / n;
            s->staging = (m / n) % 2 * n + m % n;
            s->source = mf__stage_source(prev, P, e);
            m++;
        }
        most = m > most ? m : most;
    }
    return most == 0 ? 1 : (most + n - 1) / n + 1;
}

#endif /* MF_BALANCE_STAGE_H */
