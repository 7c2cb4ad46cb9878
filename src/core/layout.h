/*
 * layout.h — the symmetric memory every rank lays out alike: the alignments, the collective
 * phases, the heap (a layer's publications and combine slots), the spare slots of balancing, the
 * signal words, and mf__sym_t, one symmetric allocation as this process sees it (layout.c;
 * src/transport/ maps them). Kernels see the same offsets (src/cuda/configs.cuh includes this).
 *
 * Dimension legend: T tokens on this rank in this call, S capacity, H hidden, I intermediate,
 * E experts, R ranks, L = E / R local experts (L_r: rank r's under the placement), K top-k,
 * C masked expert capacity.
 */
#ifndef MF_CORE_LAYOUT_H
#define MF_CORE_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "moeflow.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- limits and alignments -------------------------------------------------------------------- */

#define MF__DEFAULT_BLOCK_M 128   /* EXPERT_MAJOR segment alignment */
#define MF__HEAP_ALIGN 256        /* every symmetric-heap region starts at a multiple of this */
#define MF__VEC_ELEMS_BF16 8      /* 16-byte rows: H and I multiples of 8 in BF16 */
#define MF__ROW_ALIGN 16          /* row tensors' data pointers: 16-byte vector loads and stores */

#define MF__META_WORDS 4        /* heap meta: T, map hash, prefetch count, weights count */

static inline size_t mf__align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
static inline int64_t mf__ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* ---- collective phases ------------------------------------------------------------------------ */

/* Collective phases of the data path; each has its own column of epoch signals. (Setup
 * collectives, mf_comm_init and mf_moe_create, meet over the bootstrap instead.) */
typedef enum mf__phase {
    MF__PHASE_DISPATCH = 0, /* every rank has published x, scales, ids, weights, T */
    MF__PHASE_COMBINE = 1,  /* every rank has written its partials into the owners' slots */
    MF__PHASE_ABORT = 2,    /* every rank has finished reading peers after a failed plan */
    MF__NUM_PHASES = 3
} mf__phase_t;

const char *mf__phase_name(int phase);

/* The synchronisations each data-path call meets at, as bit masks for ops->reject. */
#define MF__CALL_FORWARD ((1u << MF__PHASE_DISPATCH) | (1u << MF__PHASE_COMBINE))
#define MF__CALL_DISPATCH (1u << MF__PHASE_DISPATCH)
#define MF__CALL_COMBINE (1u << MF__PHASE_COMBINE)

/* ---- symmetric heap layout (identical on every rank; docs/DESIGN.md "Symmetric heap") -------------- */
/* Every region is aligned to MF__HEAP_ALIGN:
 *   meta:     4 x int32              T of this rank's current call, the expert map's hash, the
 *                                    layer's prefetch count and weights count, which every rank
 *                                    checks are the same on all (equal everywhere without balancing)
 *   x:        S x H x (1 or 2) bytes published activations, FP8 (1 byte) or BF16 (2 bytes)
 *   scales:   S x H/128 x fp32       FP8 only: 1x128 activation scales
 *   ids:      S x K x int32          published topk_ids (-1 = skip)
 *   weights:  S x K x fp32           published topk_weights
 *   combine:  S x K x H x bf16       slots the experts' ranks write partials into, at (token, k)
 * and the whole repeats num_slots = config.max_in_flight times, one copy per exchange in flight
 * (mf_exchange_t, the split halves; docs/API.md section 16): slot i at i x slot_bytes.
 */
typedef struct mf__heap_layout {
    size_t meta, x, scales, ids, weights, combine;
    size_t slot_bytes; /* the regions above, once: one exchange in flight */
    int32_t num_slots; /* config.max_in_flight: the regions repeat this many times */
    size_t bytes;      /* total: slot_bytes x num_slots */
} mf__heap_layout_t;

/* The layer's layout; its offsets are those of slot 0 (mf_moe_forward's, and the first exchange's). */
void mf__heap_layout_init(mf__heap_layout_t *layout, const mf_moe_config_t *config);
/* The same regions in slot `slot` (offsets + slot x slot_bytes): an exchange's publication and
 * combine slots, while others of the comm are in flight in other slots. */
mf__heap_layout_t mf__heap_layout_slot(const mf__heap_layout_t *layout, int32_t slot);

/* ---- spare slots (balancing): one symmetric allocation per layer with B > 0 ------------------ */
/* Four tensors of B slots each, shaped as the caller's weights (so that a GEMM takes the spare
 * slots as a second [B, N, K] operand), every region aligned to MF__HEAP_ALIGN:
 *   w13:        B x 2I x H x (1 or 2) bytes     w13_scales: B x 2I/128 x H/128 x fp32 (FP8)
 *   w2:         B x H x I x (1 or 2) bytes      w2_scales:  B x H/128 x I/128 x fp32 (FP8)
 * Slot j of rank q is written by the rank that holds the expert's first static replica (a push:
 * the caller's weights are not symmetric memory), read by q's expert compute. */
typedef struct mf__spare_layout {
    size_t w13, w13_scales, w2, w2_scales;             /* offsets of the four tensors */
    size_t w13_bytes, w13_scale_bytes, w2_bytes, w2_scale_bytes; /* one slot of each */
    size_t bytes;                                      /* the allocation */
    size_t copy_bytes;                                 /* bytes of weights (+ scales) one replica moves */
} mf__spare_layout_t;

void mf__spare_layout_init(mf__spare_layout_t *layout, const mf_moe_config_t *config);

/* One expert's weights (+ FP8 scales, NULL without) somewhere: the caller's [Lp, ...] tensors or a
 * spare / staging region laid out as `sl` (both backends' weight moves). */
typedef struct mf__expert_ptrs {
    uint8_t *w13, *w13_scales, *w2, *w2_scales;
} mf__expert_ptrs_t;

/* Slot l of the caller's weights. */
static inline mf__expert_ptrs_t mf__expert_in_weights(const mf_moe_weights_t *w, const mf__spare_layout_t *sl, int32_t l) {
    const size_t i = (size_t)l;
    mf__expert_ptrs_t a;
    a.w13 = (uint8_t *)w->w13.data + i * sl->w13_bytes;
    a.w13_scales = w->w13_scales.data ? (uint8_t *)w->w13_scales.data + i * sl->w13_scale_bytes : NULL;
    a.w2 = (uint8_t *)w->w2.data + i * sl->w2_bytes;
    a.w2_scales = w->w2_scales.data ? (uint8_t *)w->w2_scales.data + i * sl->w2_scale_bytes : NULL;
    return a;
}

/* Slot j of a region laid out as `sl` (the spare slots, or a staging region). */
static inline mf__expert_ptrs_t mf__expert_in_region(void *region, const mf__spare_layout_t *sl, int32_t j) {
    uint8_t *base = (uint8_t *)region;
    const size_t i = (size_t)j;
    mf__expert_ptrs_t a;
    a.w13 = base + sl->w13 + i * sl->w13_bytes;
    a.w13_scales = base + sl->w13_scales + i * sl->w13_scale_bytes;
    a.w2 = base + sl->w2 + i * sl->w2_bytes;
    a.w2_scales = base + sl->w2_scales + i * sl->w2_scale_bytes;
    return a;
}

/* FNV-1a of an expert map, as published in the heap meta. */
uint32_t mf__map_hash(const int32_t *map, int32_t num_physical);

/* ---- signals (every rank, one symmetric allocation; docs/DESIGN.md "Symmetric heap") ----------- */
/* uint64 words:
 *   slots   [MF__NUM_PHASES][Q][MF_MAX_RANKS]  peers write: slot [p][e % Q][q] = e << MF__EPOCH_SHIFT |
 *                                              layer << MF__STATUS_BITS | status, e = rank q's e-th
 *                                              arrival at phase p, layer = the id of the layer it
 *                                              called (16 bits), status = its verdict (8 bits)
 *   epochs  [MF__NUM_PHASES]                   this rank's own epoch counters (device code keeps them)
 *   abort   [MF_MAX_RANKS]                     abort[q] != 0: rank q called mf_comm_abort
 * Epochs only grow: nothing is re-zeroed between calls. A status is an mf_result_t (0 = fine): the
 * arrival of a rank whose call failed before its work (rejected input, a fault its device found)
 * carries the code, and every waiter fails that call with it, so all ranks fail together; so does
 * an arrival for another layer than the waiter's (ranks must call the same layers). Q =
 * MF__EPOCH_SLOTS slots per phase, by epoch modulo Q: with one call at a time, a rank that failed a
 * call at its first phase may arrive at that phase again (its next call) before a peer has read its
 * status for this one, but never two arrivals ahead, since its next call's wait needs this peer
 * (2 would do). With the split halves, up to MF_MAX_IN_FLIGHT exchanges of a comm are in flight and
 * each phase's receives follow its sends in order (core/moe.c, "exchanges"): a rank sends its n-th
 * arrival at a phase only after it completed the exchange of arrival n - MF_MAX_IN_FLIGHT, which
 * needed every peer's combine send of it, made after that peer received (read) arrival n -
 * MF_MAX_IN_FLIGHT; one more for the failed-call case: Q = 2 x MF_MAX_IN_FLIGHT covers both. */
#define MF__EPOCH_SLOTS (2 * MF_MAX_IN_FLIGHT)
#define MF__STATUS_BITS 8
#define MF__STATUS_MASK ((1ull << MF__STATUS_BITS) - 1)
#define MF__LAYER_BITS 16
#define MF__LAYER_MASK ((1ull << MF__LAYER_BITS) - 1)
#define MF__EPOCH_SHIFT (MF__STATUS_BITS + MF__LAYER_BITS)
/* The layer id field of a slot value. */
#define MF__SLOT_LAYER(v) (((v) >> MF__STATUS_BITS) & MF__LAYER_MASK)
#define MF__SIGNAL_SLOTS 0
#define MF__SIGNAL_SLOT(phase, epoch, from)                                                      \
    (MF__SIGNAL_SLOTS + ((size_t)(phase) * MF__EPOCH_SLOTS + ((epoch) % MF__EPOCH_SLOTS)) * MF_MAX_RANKS + \
     (size_t)(from))
#define MF__SIGNAL_EPOCHS ((size_t)MF__NUM_PHASES * MF__EPOCH_SLOTS * MF_MAX_RANKS)
#define MF__SIGNAL_ABORT (MF__SIGNAL_EPOCHS + MF__NUM_PHASES)
#define MF__SIGNAL_WORDS (MF__SIGNAL_ABORT + MF_MAX_RANKS)
#define MF__SIGNAL_BYTES (MF__SIGNAL_WORDS * sizeof(uint64_t))

/* ---- symmetric allocations ------------------------------------------------------------------- */

/* One symmetric allocation as this process sees it (src/transport/transport.h). */
typedef struct mf__sym {
    void *local;                /* this rank's memory (== peers[rank]), zeroed at allocation */
    void *peers[MF_MAX_RANKS];  /* every rank's memory, addressable from this process */
    size_t bytes;               /* the same on every rank */
} mf__sym_t;

#ifdef __cplusplus
}
#endif

#endif /* MF_CORE_LAYOUT_H */
