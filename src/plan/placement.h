/*
 * placement.h — where a layer's experts live (mf_placement_t; docs/DESIGN.md "Placement"): plain C,
 * header-only, the same code on the host and on the device (MF_HD).
 *
 * A placement is a map over a uniform slot grid: Ls = ceil(E / R) slots per rank, R * Ls in all;
 * slot (r, l) holds the expert the placement gives rank r as its local expert l, or -1 (an empty
 * slot: it never receives a row and its weights are never read). Both placements fill each rank's
 * slots from 0, so the empty ones are a rank's last Ls - L_r: a rank's weights and dispatch segments
 * are its first L_r slots. With R | E and LINEAR the grid is the identity map of the plain layer.
 *
 * Dimension legend: E logical experts, R ranks (E >= R), Ls = ceil(E / R) slots per rank, L_r the
 * experts of rank r.
 */
#ifndef MF_PLAN_PLACEMENT_H
#define MF_PLAN_PLACEMENT_H

#include <stdint.h>

#include "core/numerics.h" /* MF_HD */
#include "moeflow.h"       /* mf_placement_t */

/* Ls: the slots of every rank (the most experts a rank holds). */
MF_HD int32_t mf__placement_slots(int32_t E, int32_t R) { return (E + R - 1) / R; }

/* L_r: the experts rank r holds. */
MF_HD int32_t mf__placement_count(int32_t E, int32_t R, int32_t placement, int32_t r) {
    if (placement == MF_PLACEMENT_ROUND_ROBIN) return (E - r + R - 1) / R;
    return E / R + (r < E % R);
}

/* The global expert of rank r's local expert l in [0, Ls), or -1 for an empty slot. */
MF_HD int32_t mf__placement_expert(int32_t E, int32_t R, int32_t placement, int32_t r, int32_t l) {
    if (l >= mf__placement_count(E, R, placement, r)) return -1;
    if (placement == MF_PLACEMENT_ROUND_ROBIN) return r + l * R;
    const int32_t extra = E % R;
    return r * (E / R) + (r < extra ? r : extra) + l;
}

/* The rank holding expert e. */
MF_HD int32_t mf__placement_rank(int32_t E, int32_t R, int32_t placement, int32_t e) {
    if (placement == MF_PLACEMENT_ROUND_ROBIN) return e % R;
    const int32_t q = E / R, big = (E % R) * (q + 1); /* the first E % R ranks hold q + 1 */
    return e < big ? e / (q + 1) : E % R + (e - big) / q;
}

/* 1 when the placement is not the identity of the slot grid (slot p holds expert p): R does not
 * divide E, or ROUND_ROBIN with more than one expert on some rank of several. */
MF_HD int32_t mf__placement_mapped(int32_t E, int32_t R, int32_t placement) {
    return E % R != 0 || (placement == MF_PLACEMENT_ROUND_ROBIN && R > 1 && E > R);
}

#endif /* MF_PLAN_PLACEMENT_H */
