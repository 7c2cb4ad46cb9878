/*
 * heap_view.h — how a kernel sees one heap slot of a layer: every rank's symmetric heap (the comm's
 * peer pointers, mf__sym_t) and the byte offsets of the slot's regions (mf__heap_layout_t of that
 * slot, core/layout.h). One definition for every kernel that addresses the heap: the movement
 * kernels (cuda/kernels/movement.cuh: publish, plan, gather, return, sum) and the expert GEMMs
 * (cuda/grouped_gemm.h: W13's rows read in place, W2's rows sent to the combine slots). The layer
 * builds one view per heap slot when it is created (the heap never moves) and every launch embeds
 * its slot's view in the kernel's parameters by value, so the peer table is filled in one place.
 *
 * Rank r's region `name` of the slot starts at heap[r] + name: e.g. token t's published row at
 * heap[r] + x + t * row_bytes, partial (t, k) at heap[r] + combine + (t K + k) H BF16; this rank's
 * own copy is heap[rank]. Entries past num_ranks are NULL. The signal table (sync.cuh) and the
 * spare slots keep their own peer tables: they are not regions of the heap. C and CUDA C++.
 */
#ifndef MF_CUDA_HEAP_VIEW_H
#define MF_CUDA_HEAP_VIEW_H

#include <stdint.h>
#include <string.h>

#include "core/layout.h"
#include "moeflow.h"

typedef struct mf__heap_view {
    uint8_t *heap[MF_MAX_RANKS]; /* every rank's symmetric heap (comm->heap.peers; NULL past num_ranks) */
    unsigned long long meta, x, scales, ids, weights, combine; /* byte offsets of the slot's regions */
    int32_t num_ranks, rank;
} mf__heap_view_t;

/* The view of the regions `layout` (one slot's, mf__heap_layout_slot) in the allocation `heap` of a
 * comm of `num_ranks` ranks, seen from `rank`. Host arithmetic only. */
static inline void mf__heap_view_init(mf__heap_view_t *v, const mf__sym_t *heap, int32_t num_ranks, int32_t rank,
                                      const mf__heap_layout_t *layout) {
    memset(v, 0, sizeof *v);
    for (int32_t r = 0; r < num_ranks; r++) v->heap[r] = (uint8_t *)heap->peers[r];
    v->meta = layout->meta;
    v->x = layout->x;
    v->scales = layout->scales;
    v->ids = layout->ids;
    v->weights = layout->weights;
    v->combine = layout->combine;
    v->num_ranks = num_ranks;
    v->rank = rank;
}

#endif /* MF_CUDA_HEAP_VIEW_H */
