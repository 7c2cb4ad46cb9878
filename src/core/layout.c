/*
 * layout.c — the symmetric layouts every rank computes alike (core/layout.h): the heap and its
 * slots, the spare slots, the expert map's hash, and the names of the collective phases.
 */
#include <stddef.h>
#include <stdint.h>

#include "core/layout.h"
#include "core/numerics.h"

/* ---- symmetric heap layout ---------------------------------------------------------------- */

void mf__heap_layout_init(mf__heap_layout_t *h, const mf_moe_config_t *c) {
    size_t S = (size_t)c->max_tokens_per_rank, H = (size_t)c->hidden, K = (size_t)c->num_topk;
    size_t x_elem = c->dtype == MF_DTYPE_FP8_E4M3 ? 1 : 2;
    size_t off = 0;
#define MF__REGION(field, bytes)                 \
    do {                                         \
        h->field = off;                          \
        off = mf__align_up(off + (bytes), MF__HEAP_ALIGN); \
    } while (0)
    MF__REGION(meta, MF__META_WORDS * sizeof(int32_t));
    MF__REGION(x, S * H * x_elem);
    MF__REGION(scales, c->dtype == MF_DTYPE_FP8_E4M3 ? S * (H / MF__QUANT_BLOCK) * sizeof(float) : 0);
    MF__REGION(ids, S * K * sizeof(int32_t));
    MF__REGION(weights, S * K * sizeof(float));
    MF__REGION(combine, S * K * H * sizeof(uint16_t));
#undef MF__REGION
    h->slot_bytes = off;
    h->num_slots = c->max_in_flight > 0 ? c->max_in_flight : 1;
    h->bytes = off * (size_t)h->num_slots;
}

mf__heap_layout_t mf__heap_layout_slot(const mf__heap_layout_t *h, int32_t slot) {
    mf__heap_layout_t s = *h;
    const size_t base = (size_t)slot * h->slot_bytes;
    s.meta += base, s.x += base, s.scales += base, s.ids += base, s.weights += base, s.combine += base;
    return s;
}

void mf__spare_layout_init(mf__spare_layout_t *l, const mf_moe_config_t *c) {
    size_t H = (size_t)c->hidden, I = (size_t)c->intermediate, Q = MF__QUANT_BLOCK, B = (size_t)c->spare_slots;
    int fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    size_t esz = fp8 ? 1 : 2, off = 0;
    l->w13_bytes = 2 * I * H * esz;
    l->w13_scale_bytes = fp8 ? (2 * I / Q) * (H / Q) * sizeof(float) : 0;
    l->w2_bytes = H * I * esz;
    l->w2_scale_bytes = fp8 ? (H / Q) * (I / Q) * sizeof(float) : 0;
    l->w13 = off, off = mf__align_up(off + B * l->w13_bytes, MF__HEAP_ALIGN);
    l->w13_scales = off, off = mf__align_up(off + B * l->w13_scale_bytes, MF__HEAP_ALIGN);
    l->w2 = off, off = mf__align_up(off + B * l->w2_bytes, MF__HEAP_ALIGN);
    l->w2_scales = off, off = mf__align_up(off + B * l->w2_scale_bytes, MF__HEAP_ALIGN);
    l->bytes = off;
    l->copy_bytes = l->w13_bytes + l->w13_scale_bytes + l->w2_bytes + l->w2_scale_bytes;
}

uint32_t mf__map_hash(const int32_t *map, int32_t n) {
    uint32_t h = 2166136261u;
    for (int32_t i = 0; i < n; i++)
        for (int b = 0; b < 4; b++) h = (h ^ (((uint32_t)map[i] >> (8 * b)) & 0xffu)) * 16777619u;
    return h;
}

/* ---- collective phases --------------------------------------------------------------------- */

const char *mf__phase_name(int phase) {
    switch (phase) {
    case MF__PHASE_DISPATCH: return "dispatch";
    case MF__PHASE_COMBINE: return "combine";
    case MF__PHASE_ABORT: return "abort";
    default: return "unknown phase";
    }
}
