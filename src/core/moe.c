/*
 * moe.c — MoE layers: creation (a setup collective that sizes the comm's shared symmetric heap),
 * weights, and the host-side validation of every data-path call before it reaches the backend
 * (balanced EP's calls, the expert maps and the prefetch: src/balance/maps.c).
 *
 * What is checked here, once, for every backend: NULLs, config headers, shapes and dtypes of every
 * tensor, T <= S, call order (weights set; dispatch/combine alternate; the comm not broken). What
 * only the CPU backend can check here: topk_ids values, because they are host memory there; on
 * CUDA they are device memory and the kernels check them (docs/DESIGN.md "Bad input and faults").
 */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "core/alloc.h"
#include "core/backend.h"
#include "core/config.h"
#include "core/errors.h"
#include "core/handles.h"
#include "core/layout.h"
#include "core/numerics.h"
#include "core/tensor.h"
#include "plan/placement.h"
#include "transport/transport.h"

/* ---- creation ----------------------------------------------------------------------------- */

/* Validates `in` and writes it with defaults resolved to `out`. */
static mf_result_t mf__resolve_config(const mf_moe_config_t *in, int32_t R, mf_moe_config_t *out) {
    const char *fn = "mf_moe_create";
    mf_moe_config_t c;
    /* Configs made before num_physical_experts / spare_slots existed end at dataflow. */
    MF_CHECK(mf__read_config(in, sizeof c, offsetof(mf_moe_config_t, num_physical_experts), MF_MOE_CONFIG_MAGIC, fn,
                             "MF_MOE_CONFIG_INIT", &c));
    MF_REQUIRE(c.num_experts >= 1, "%s: num_experts (E) is %d, must be >= 1", fn, c.num_experts);
    MF_REQUIRE(c.num_experts >= R, "%s: num_experts (E = %d) is below the ranks (R = %d): every rank must hold at "
               "least one expert", fn, c.num_experts, R);
    MF_REQUIRE(c.placement == MF_PLACEMENT_LINEAR || c.placement == MF_PLACEMENT_ROUND_ROBIN,
               "%s: placement %d is not MF_PLACEMENT_LINEAR or MF_PLACEMENT_ROUND_ROBIN", fn, c.placement);
    MF_REQUIRE(c.num_topk >= 1 && c.num_topk <= MF_MAX_TOPK && c.num_topk <= c.num_experts,
               "%s: num_topk (K = %d) must be in [1, min(E = %d, %d)]", fn, c.num_topk, c.num_experts,
               MF_MAX_TOPK);
    MF_REQUIRE(c.max_tokens_per_rank >= 1, "%s: max_tokens_per_rank (S) is %d, must be >= 1", fn,
               c.max_tokens_per_rank);
    MF_REQUIRE(c.dtype == MF_DTYPE_BF16 || c.dtype == MF_DTYPE_FP8_E4M3,
               "%s: dtype must be MF_DTYPE_BF16 or MF_DTYPE_FP8_E4M3, got %d", fn, c.dtype);
    int32_t mult = c.dtype == MF_DTYPE_FP8_E4M3 ? MF__QUANT_BLOCK : MF__VEC_ELEMS_BF16;
    MF_REQUIRE(c.hidden >= 1 && c.hidden % mult == 0, "%s: hidden (H = %d) must be a positive multiple of %d for %s",
               fn, c.hidden, mult, mf__dtype_name(c.dtype));
    MF_REQUIRE(c.intermediate >= 1 && c.intermediate % mult == 0,
               "%s: intermediate (I = %d) must be a positive multiple of %d for %s", fn, c.intermediate,
               mult, mf__dtype_name(c.dtype));
    MF_REQUIRE(c.layout == MF_LAYOUT_EXPERT_MAJOR || c.layout == MF_LAYOUT_MASKED,
               "%s: layout %d is not MF_LAYOUT_EXPERT_MAJOR or MF_LAYOUT_MASKED", fn, c.layout);
    MF_REQUIRE(c.block_m >= 0 && c.block_m <= 4096, "%s: block_m %d is outside [0, 4096]", fn, c.block_m);
    MF_REQUIRE(c.expert_capacity >= 0, "%s: expert_capacity %d is negative", fn, c.expert_capacity);
    MF_REQUIRE(c.max_recv_rows >= 0, "%s: max_recv_rows %d is negative", fn, c.max_recv_rows);
    MF_REQUIRE(c.ue8m0_scales == 0 || c.ue8m0_scales == 1, "%s: ue8m0_scales must be 0 or 1", fn);
    MF_REQUIRE(c.profile == 0 || c.profile == 1, "%s: profile must be 0 or 1", fn);
    MF_REQUIRE(c.dataflow >= MF_DATAFLOW_AUTO && c.dataflow <= MF_DATAFLOW_UNFUSED,
               "%s: dataflow %d is not an mf_dataflow_t", fn, c.dataflow);
    MF_REQUIRE(c.max_in_flight >= 0 && c.max_in_flight <= MF_MAX_IN_FLIGHT,
               "%s: max_in_flight %d is outside [0, MF_MAX_IN_FLIGHT = %d]", fn, c.max_in_flight, MF_MAX_IN_FLIGHT);
    if (!c.max_in_flight) c.max_in_flight = 1;

    MF_REQUIRE(c.spare_slots >= 0 && c.spare_slots <= MF_MAX_SPARE_SLOTS, "%s: spare_slots (B = %d) is outside [0, %d]",
               fn, c.spare_slots, MF_MAX_SPARE_SLOTS);
    if (mf__placement_mapped(c.num_experts, R, c.placement)) {
        /* The slot grid of the placement (src/plan/placement.h); replicas and spare slots are defined
         * over the linear grid only. */
        const char *which = c.placement == MF_PLACEMENT_ROUND_ROBIN ? "MF_PLACEMENT_ROUND_ROBIN" : "LINEAR with E % R != 0";
        if (c.num_physical_experts && c.num_physical_experts != c.num_experts)
            return mf__error(MF_ERR_NOT_SUPPORTED,
                             "%s: replicas (num_physical_experts P = %d > E = %d) need placement MF_PLACEMENT_LINEAR with "
                             "E a multiple of R (here %s, E = %d, R = %d)", fn, c.num_physical_experts, c.num_experts,
                             which, c.num_experts, R);
        if (c.spare_slots)
            return mf__error(MF_ERR_NOT_SUPPORTED,
                             "%s: spare slots (B = %d) need placement MF_PLACEMENT_LINEAR with E a multiple of R (here "
                             "%s, E = %d, R = %d)", fn, c.spare_slots, which, c.num_experts, R);
        c.num_physical_experts = R * mf__placement_slots(c.num_experts, R);
    }
    if (!c.num_physical_experts) c.num_physical_experts = c.num_experts;
    MF_REQUIRE(c.num_physical_experts >= c.num_experts && c.num_physical_experts % R == 0,
               "%s: num_physical_experts (P = %d) must be >= num_experts (E = %d) and a multiple of the ranks (R = %d)",
               fn, c.num_physical_experts, c.num_experts, R);

    /* Expert slots of a rank: its P / R static ones and its B spare ones (L of them without balancing;
     * a mapped placement's Ls = ceil(E / R), the most experts a rank holds). */
    int64_t L = c.num_physical_experts / R + c.spare_slots, S = c.max_tokens_per_rank, K = c.num_topk;
    if (!c.block_m) c.block_m = MF__DEFAULT_BLOCK_M;
    /* A token's ids are distinct, so an expert receives at most one row per token: R * S. */
    int64_t worst_per_expert = (int64_t)R * S;
    if (!c.expert_capacity) c.expert_capacity = (int32_t)(worst_per_expert < INT32_MAX ? worst_per_expert : INT32_MAX);
    /* EXPERT_MAJOR worst case: every (token, k) lands here, and every segment is padded. */
    int64_t routed = (int64_t)R * S * (K < L ? K : L);
    int64_t worst_rows = routed + L * (c.block_m - 1);
    int64_t cap_rows = L * mf__ceil_div(worst_per_expert, c.block_m) * c.block_m;
    if (cap_rows < worst_rows) worst_rows = cap_rows;
    MF_REQUIRE(worst_rows < INT32_MAX, "%s: the receive tensor would need %lld rows; set max_recv_rows",
               fn, (long long)worst_rows);
    if (!c.max_recv_rows) c.max_recv_rows = (int32_t)worst_rows;
    *out = c;
    return MF_SUCCESS;
}

mf_result_t mf_moe_heap_bytes(const mf_moe_config_t *config, int32_t num_ranks, int64_t *bytes) {
    mf__clear_error();
    MF_REQUIRE(config && bytes, "mf_moe_heap_bytes: config and bytes must not be NULL");
    MF_REQUIRE(num_ranks >= 1 && num_ranks <= MF_MAX_RANKS, "mf_moe_heap_bytes: num_ranks %d is outside [1, %d]",
               num_ranks, MF_MAX_RANKS);
    mf_moe_config_t c;
    MF_CHECK(mf__resolve_config(config, num_ranks, &c));
    mf__heap_layout_t heap;
    mf__heap_layout_init(&heap, &c);
    *bytes = (int64_t)heap.bytes;
    return MF_SUCCESS;
}

/* Refuses calls on a comm that cannot take part in a collective any more (core/handles.h). */
mf_result_t mf__check_comm_usable(mf_comm_t comm, const char *fn) {
    if (__atomic_load_n(&comm->aborted, __ATOMIC_ACQUIRE))
        return mf__error(MF_ERR_ABORTED, "%s: the comm of rank %d was aborted; destroy it", fn, comm->rank);
    if (comm->broken)
        return mf__error(MF_ERR_INVALID_USAGE, "%s: the comm of rank %d is broken by an earlier timeout or expired GEMM wait; destroy it",
                         fn, comm->rank);
    return MF_SUCCESS;
}

/* What every rank tells the others at mf_moe_create. */
typedef struct mf__create_info {
    int32_t status;
    int32_t pad;
    mf_moe_config_t config;
} mf__create_info_t;

mf_result_t mf_moe_create(mf_comm_t comm, const mf_moe_config_t *config, mf_moe_t *moe) {
    const char *fn = "mf_moe_create";
    mf__clear_error();
    MF_REQUIRE(comm && config && moe, "%s: comm, config and moe must not be NULL", fn);
    MF_CHECK(mf__check_comm_usable(comm, fn));

    /* Resolve locally; every rank then checks that all ranks asked for the same layer. */
    mf__create_info_t mine, all[MF_MAX_RANKS];
    memset(&mine, 0, sizeof mine);
    mine.status = mf__resolve_config(config, comm->num_ranks, &mine.config);
    char why[512];
    snprintf(why, sizeof why, "%s", mf_last_error());
    MF_CHECK(mf__allgather(comm, &mine, all, sizeof mine, fn));
    mf_result_t res = MF_SUCCESS;
    if (mine.status != MF_SUCCESS) res = mf__error((mf_result_t)mine.status, "%s", why);
    for (int32_t r = 0; r < comm->num_ranks && res == MF_SUCCESS; r++) {
        if (all[r].status != MF_SUCCESS)
            res = mf__error(MF_ERR_INVALID_ARGUMENT, "%s: rank %d rejected its config", fn, r);
        else if (memcmp(&all[r].config, &all[0].config, sizeof mine.config) != 0)
            res = mf__error(MF_ERR_INVALID_ARGUMENT,
                            "%s: rank %d's config differs from rank 0's; every rank must create the same layer", fn, r);
    }
    if (res != MF_SUCCESS) return res; /* every rank reached the same verdict */
    const mf_moe_config_t c = mine.config;

    /* The heap: sized once (at init, or by the first layer), never moved. */
    mf__heap_layout_t heap;
    mf__heap_layout_init(&heap, &c);
    if (!comm->heap.local) {
        size_t bytes = comm->heap_declared > heap.bytes ? comm->heap_declared : heap.bytes;
        MF_CHECK(comm->tops->sym_alloc(comm, bytes, &comm->heap));
    } else if (comm->heap.bytes < heap.bytes) {
        return mf__error(MF_ERR_CAPACITY,
                         "%s: this layer needs a %zu-byte symmetric heap, the comm has %zu bytes (sized once, at its "
                         "first layer or by heap_bytes); declare heap_bytes >= the largest mf_moe_heap_bytes() of the "
                         "comm's layers", fn, heap.bytes, comm->heap.bytes);
    }

    mf_moe_t m = mf__calloc(1, sizeof *m);
    res = m ? MF_SUCCESS : mf__error(MF_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    if (res == MF_SUCCESS) {
        m->expert_map = mf__malloc((size_t)c.num_physical_experts * sizeof(int32_t));
        if (!m->expert_map) res = mf__error(MF_ERR_OUT_OF_MEMORY, "%s: out of host memory for the expert map", fn);
    }
    /* Spare slots: their own symmetric allocation (collective; every rank has the same B). */
    mf__spare_layout_init(m ? &m->spare_layout : &(mf__spare_layout_t){0}, &c);
    if (c.spare_slots > 0) {
        mf_result_t agreed_mem = mf__agree(comm, res, fn);
        if (agreed_mem == MF_SUCCESS)
            agreed_mem = comm->tops->sym_alloc(comm, m->spare_layout.bytes, &m->spare);
        if (agreed_mem != MF_SUCCESS) {
            if (m) mf__free(m->expert_map);
            mf__free(m);
            return agreed_mem;
        }
    }
    if (res == MF_SUCCESS) {
        const int32_t R = comm->num_ranks, E = c.num_experts, Lp = c.num_physical_experts / R;
        m->slots_per_rank = Lp;
        m->placed = mf__placement_mapped(E, R, c.placement);
        /* The default map: the placement's slot grid, or p % E (the identity, then replicas of it). */
        for (int32_t p = 0; p < c.num_physical_experts; p++)
            m->expert_map[p] = m->placed ? mf__placement_expert(E, R, c.placement, p / Lp, p % Lp) : p % E;
        m->map_hash = mf__map_hash(m->expert_map, c.num_physical_experts);
        m->comm = comm;
        m->config = c;
        m->heap = heap;
        m->info.num_ranks = R;
        m->info.rank = comm->rank;
        m->info.num_local_experts = mf__placement_count(E, R, c.placement, comm->rank);
        m->info.first_expert = mf__placement_expert(E, R, c.placement, comm->rank, 0);
        m->info.placement = c.placement;
        m->info.num_local_slots = m->placed ? m->info.num_local_experts : Lp;
        m->info.block_m = c.block_m;
        m->info.expert_capacity = c.expert_capacity;
        m->info.max_recv_rows = c.max_recv_rows;
        m->info.heap_bytes = (int64_t)comm->heap.bytes;
        m->id = comm->layers_made & MF__LAYER_MASK;
        m->own.moe = m;
        res = comm->ops->moe_init(m);
    }
    mf_result_t agreed = mf__agree(comm, res, fn);
    if (agreed != MF_SUCCESS) {
        if (m && res == MF_SUCCESS) comm->ops->moe_fini(m);
        if (m && m->spare.local) comm->tops->sym_free(comm, &m->spare);
        if (m) mf__free(m->expert_map);
        mf__free(m);
        return agreed;
    }
    comm->layers_made++; /* every rank made it: the ids stay the same on every rank */
    *moe = m;
    return MF_SUCCESS;
}

/* Alike on purpose, as the getters of core/group.c (mf_group_get_backend, mf_comm_get_rank, ...). */
mf_result_t mf_moe_get_info(mf_moe_t moe, mf_moe_info_t *info) {
    mf__clear_error();
    MF_REQUIRE(moe && info, "mf_moe_get_info: moe and info must not be NULL");
    *info = moe->info;
    return MF_SUCCESS;
}

mf_result_t mf_moe_destroy(mf_moe_t moe) {
    mf__clear_error();
    if (!moe) return MF_SUCCESS;
    mf_comm_t comm = moe->comm;
    if (comm->pending_dispatch == moe) comm->pending_dispatch = NULL;
    for (int32_t i = 0; i < MF_MAX_IN_FLIGHT; i++) /* its exchanges end with it (their handles stay valid) */
        if (comm->in_flight[i] && comm->in_flight[i]->moe == moe) {
            comm->in_flight[i]->state = MF__X_IDLE;
            comm->in_flight[i] = NULL;
        }
    comm->ops->moe_fini(moe);
    mf_result_t res = MF_SUCCESS;
    if (moe->spare.local || moe->stage.local) {
        /* Peers push into this rank's spare and staging slots: they must all have stopped (a
         * barrier over the bootstrap, skipped on a broken or aborted comm, whose peers are not
         * waited for). */
        if (!comm->broken && !__atomic_load_n(&comm->aborted, __ATOMIC_ACQUIRE) && !comm->bootstrap_failed)
            res = mf__barrier(comm, "mf_moe_destroy (spare and staging slots)");
        if (moe->spare.local) comm->tops->sym_free(comm, &moe->spare);
        if (moe->stage.local) comm->tops->sym_free(comm, &moe->stage);
    }
    mf__free(moe->staged_map);
    mf__free(moe->stage_plan);
    mf__free(moe->expert_map);
    mf__free(moe);
    return res;
}

/* ---- weights ------------------------------------------------------------------------------ */

/* Shapes of a rank's weights [num_local_slots, ...] (Lp, or L_r of a mapped placement); `name`
 * prefixes the messages ("weights", "next_weights"; core/handles.h). */
mf_result_t mf__check_weights(mf_moe_t moe, const mf_moe_weights_t *w, const char *name) {
    const mf_moe_config_t *c = &moe->config;
    int64_t L = moe->info.num_local_slots, H = c->hidden, I = c->intermediate, B = MF__QUANT_BLOCK;
    char what[64];
#define MF__NAME(field) (snprintf(what, sizeof what, "%s." field " of rank %d", name, moe->comm->rank), what)
    MF_CHECK(mf__check_tensor(&w->w13, MF__NAME("w13"), c->dtype, 3, MF__DIMS(L, 2 * I, H), 0));
    MF_CHECK(mf__check_tensor(&w->w2, MF__NAME("w2"), c->dtype, 3, MF__DIMS(L, H, I), 0));
    MF_CHECK(mf__check_rows16(&w->w13, MF__NAME("w13")));
    MF_CHECK(mf__check_rows16(&w->w2, MF__NAME("w2")));
    if (c->dtype == MF_DTYPE_FP8_E4M3) {
        MF_CHECK(mf__check_tensor(&w->w13_scales, MF__NAME("w13_scales"), MF_DTYPE_FP32, 3,
                                  MF__DIMS(L, 2 * I / B, H / B), 0));
        MF_CHECK(mf__check_tensor(&w->w2_scales, MF__NAME("w2_scales"), MF_DTYPE_FP32, 3,
                                  MF__DIMS(L, H / B, I / B), 0));
    }
#undef MF__NAME
    return MF_SUCCESS;
}

mf_result_t mf_moe_set_weights(mf_moe_t moe, const mf_moe_weights_t *w) {
    mf__clear_error();
    MF_REQUIRE(moe && w, "mf_moe_set_weights: moe and weights must not be NULL");
    if (moe->staged_map)
        return mf__error(MF_ERR_INVALID_USAGE, "mf_moe_set_weights: a staged map is in progress "
                         "(mf_moe_stage_expert_map); its switch sets the weights");
    MF_CHECK(mf__check_weights(moe, w, "weights"));
    mf_moe_weights_t saved = moe->weights;
    int32_t saved_set = moe->weights_set;
    moe->weights = *w;
    moe->weights_set = 1;
    if (moe->comm->ops->set_weights) {
        mf_result_t res = moe->comm->ops->set_weights(moe);
        if (res != MF_SUCCESS) {
            moe->weights = saved;
            moe->weights_set = saved_set;
            return res;
        }
    }
    moe->weights_count++;
    return MF_SUCCESS;
}

/* ---- data-path validation ----------------------------------------------------------------- */

static mf_result_t mf__check_usable(mf_moe_t moe, const char *fn) { return mf__check_comm_usable(moe->comm, fn); }

/* x [T, H] bf16 and topk_ids [T, K] int32 with T <= S; host ids checked when the backend is CPU. */
static mf_result_t mf__check_tokens(mf_moe_t moe, const mf_tensor_t *x, const mf_tensor_t *ids,
                                    const char *fn, int64_t *T_out) {
    const mf_moe_config_t *c = &moe->config;
    char name[64];
    MF_REQUIRE(x->ndim == 2, "%s: x must be [T, H], got %d dims", fn, x->ndim);
    int64_t T = x->dims[0];
    MF_REQUIRE(T >= 0 && T <= c->max_tokens_per_rank,
               "%s: T = %lld tokens is outside [0, max_tokens_per_rank S = %d]", fn, (long long)T,
               c->max_tokens_per_rank);
    snprintf(name, sizeof name, "%s x", fn);
    MF_CHECK(mf__check_tensor(x, name, MF_DTYPE_BF16, 2, MF__DIMS(T, c->hidden), 0));
    MF_CHECK(mf__check_rows16(x, name));
    snprintf(name, sizeof name, "%s topk_ids", fn);
    MF_CHECK(mf__check_tensor(ids, name, MF_DTYPE_INT32, 2, MF__DIMS(T, c->num_topk), 0));
    if (moe->comm->backend == MF_BACKEND_CPU) {
        const int32_t *id = (const int32_t *)ids->data;
        int32_t K = c->num_topk;
        for (int64_t t = 0; t < T; t++)
            for (int32_t k = 0; k < K; k++) {
                int32_t e = id[t * K + k];
                MF_REQUIRE(e >= -1 && e < c->num_experts,
                           "%s: topk_ids[%lld, %d] = %d is outside [-1, E = %d)", fn, (long long)t, k, e,
                           c->num_experts);
                for (int32_t j = 0; j < k && e >= 0; j++)
                    MF_REQUIRE(id[t * K + j] != e,
                               "%s: token %lld repeats expert %d (topk_ids[%lld, %d] and [%lld, %d])", fn,
                               (long long)t, e, (long long)t, j, (long long)t, k);
            }
    }
    *T_out = T;
    return MF_SUCCESS;
}

/* A layer with replicas runs once its map is set. */
static mf_result_t mf__check_map_ready(mf_moe_t moe, const char *fn) {
    if (moe->config.num_physical_experts == moe->config.num_experts || moe->map_set || moe->placed) return MF_SUCCESS;
    return mf__error(MF_ERR_INVALID_USAGE,
                     "%s: the layer has P = %d physical experts for E = %d: set its expert map first "
                     "(mf_moe_set_expert_map)", fn, moe->config.num_physical_experts, moe->config.num_experts);
}

/* ---- exchanges: the bookkeeping of the split halves ----------------------------------------- */
/* Why the heap regions of an exchange may be reused without clearing (docs/DESIGN.md "Symmetric
 * heap"): a rank publishes into a slot only after its combine receive of the slot's last exchange,
 * which needed every peer's combine send of it, made after that peer's dispatch receive (its last
 * read of the publication); a peer writes this rank's combine slots of an exchange only after its
 * dispatch receive of it, which needs this rank's dispatch send, made after this rank summed the
 * slot's last exchange. Layers of a comm share the heap, so a slot is free when its byte range
 * meets no exchange in flight on the comm, of any layer. Every rank makes the same calls in the
 * same order, so every rank picks the same slot. */

static mf_result_t mf__check_none_in_flight(mf_comm_t comm, const char *fn) {
    for (int32_t i = 0; i < MF_MAX_IN_FLIGHT; i++)
        if (comm->in_flight[i] && comm->in_flight[i] != &comm->in_flight[i]->moe->own)
            return mf__error(MF_ERR_INVALID_USAGE, "%s: an exchange of the split halves (mf_dispatch_send) is in flight "
                             "on this comm; finish it (mf_combine_recv) first", fn);
    return MF_SUCCESS;
}

/* The lowest slot of moe's heap regions that meets no exchange in flight on the comm, or -1. */
static int32_t mf__free_slot(mf_moe_t moe) {
    mf_comm_t comm = moe->comm;
    int32_t busy = 0;
    for (int32_t i = 0; i < MF_MAX_IN_FLIGHT; i++) busy += comm->in_flight[i] != NULL;
    if (busy == MF_MAX_IN_FLIGHT) return -1;
    for (int32_t slot = 0; slot < moe->heap.num_slots; slot++) {
        const size_t lo = (size_t)slot * moe->heap.slot_bytes, hi = lo + moe->heap.slot_bytes;
        int32_t free_ = 1;
        for (int32_t i = 0; i < MF_MAX_IN_FLIGHT && free_; i++) {
            const struct mf_exchange *x = comm->in_flight[i];
            if (!x) continue;
            const size_t xlo = (size_t)x->slot * x->moe->heap.slot_bytes, xhi = xlo + x->moe->heap.slot_bytes;
            free_ = hi <= xlo || xhi <= lo;
        }
        if (free_) return slot;
    }
    return -1;
}

static mf_result_t mf__no_free_slot(mf_moe_t moe, const char *fn) {
    int32_t busy = 0;
    for (int32_t i = 0; i < MF_MAX_IN_FLIGHT; i++) busy += moe->comm->in_flight[i] != NULL;
    return mf__error(MF_ERR_INVALID_USAGE, "%s: no free heap slot: %d exchanges are in flight on this comm and the layer "
                     "holds max_in_flight = %d (at most MF_MAX_IN_FLIGHT = %d per comm); receive one first, or create "
                     "the layer with a larger max_in_flight", fn, busy, moe->heap.num_slots, MF_MAX_IN_FLIGHT);
}

static void mf__exchange_begin(struct mf_exchange *x, int32_t slot) {
    mf_comm_t comm = x->moe->comm;
    x->slot = slot;
    x->heap = mf__heap_layout_slot(&x->moe->heap, slot);
    x->state = MF__X_DISPATCH_SENT;
    x->seq[0] = comm->sends[0]++;
    for (int32_t i = 0; i < MF_MAX_IN_FLIGHT; i++)
        if (!comm->in_flight[i]) {
            comm->in_flight[i] = x;
            break;
        }
}

static void mf__exchange_end(struct mf_exchange *x) {
    mf_comm_t comm = x->moe->comm;
    for (int32_t i = 0; i < MF_MAX_IN_FLIGHT; i++)
        if (comm->in_flight[i] == x) comm->in_flight[i] = NULL;
    x->state = MF__X_IDLE;
}

/* Receives at a phase come in the order of its sends: x, awaiting its receive in `state`
 * (DISPATCH_SENT or COMBINE_SENT), must be the oldest exchange of the comm that does. */
static mf_result_t mf__check_receive_order(const struct mf_exchange *x, int32_t state, const char *fn) {
    const int32_t p = state == MF__X_DISPATCH_SENT ? 0 : 1;
    mf_comm_t comm = x->moe->comm;
    for (int32_t i = 0; i < MF_MAX_IN_FLIGHT; i++) {
        const struct mf_exchange *y = comm->in_flight[i];
        if (y && y != x && y->state == state && y->seq[p] < x->seq[p])
            return mf__error(MF_ERR_INVALID_USAGE, "%s: an exchange sent before this one (layer %u) awaits its %s receive: "
                             "receive in the order of the sends", fn, y->moe->id, p ? "combine" : "dispatch");
    }
    return MF_SUCCESS;
}

static mf_result_t mf__check_events(mf_comm_t comm, const mf_exchange_events_t *ev, const char *fn) {
    if (!ev || (!ev->previous && !ev->finished) || comm->ops->event) return MF_SUCCESS;
    return mf__error(MF_ERR_INVALID_ARGUMENT, "%s: the %s backend takes no events (each half completes before it "
                     "returns): pass NULL events", fn, comm->ops->name);
}

/* Waits for ev->previous (record = 0) or records ev->finished (record = 1) on the stream. */
static mf_result_t mf__apply_event(mf_comm_t comm, const mf_exchange_events_t *ev, int32_t record, mf_stream_t stream) {
    mf_event_t e = !ev ? NULL : record ? ev->finished : ev->previous;
    return e ? comm->ops->event(comm, e, record, stream) : MF_SUCCESS;
}

/* A rejected data-path call still takes part in its collective (ops->reject), with the failure as
 * its status, so that every rank fails it together and no peer waits for this one. Only calls
 * without a usable comm return at once. */
static mf_result_t mf__check_forward(mf_moe_t moe, const mf_moe_forward_in_t *in, const mf_moe_forward_out_t *out) {
    const char *fn = "mf_moe_forward";
    MF_REQUIRE(in && out, "%s: in and out must not be NULL", fn);
    if (moe->comm->pending_dispatch)
        return mf__error(MF_ERR_INVALID_USAGE, "%s: an mf_dispatch on this comm awaits its mf_combine", fn);
    MF_CHECK(mf__check_none_in_flight(moe->comm, fn));
    if (!moe->weights_set)
        return mf__error(MF_ERR_INVALID_USAGE, "%s: weights are not set (call mf_moe_set_weights first)", fn);
    MF_CHECK(mf__check_map_ready(moe, fn));
    int64_t T = 0;
    MF_CHECK(mf__check_tokens(moe, &in->x, &in->topk_ids, fn, &T));
    const mf_moe_config_t *c = &moe->config;
    MF_CHECK(mf__check_tensor(&in->topk_weights, "mf_moe_forward topk_weights", MF_DTYPE_FP32, 2,
                              MF__DIMS(T, c->num_topk), 0));
    MF_CHECK(mf__check_tensor(&out->y, "mf_moe_forward y", MF_DTYPE_BF16, 2, MF__DIMS(T, c->hidden), 0));
    return mf__check_rows16(&out->y, "mf_moe_forward y");
}

mf_result_t mf_moe_forward(mf_moe_t moe, const mf_moe_forward_in_t *in, const mf_moe_forward_out_t *out,
                           mf_stream_t stream) {
    mf__clear_error();
    MF_REQUIRE(moe, "mf_moe_forward: moe must not be NULL");
    MF_CHECK(mf__check_usable(moe, "mf_moe_forward"));
    mf_result_t res = mf__check_forward(moe, in, out);
    if (res != MF_SUCCESS) return moe->comm->ops->reject(moe, MF__CALL_FORWARD, res, stream);
    return moe->comm->ops->forward(moe, in, out, stream);
}

/* The inputs and outputs of a dispatch (mf_dispatch, mf_dispatch_send). */
/* The name of a tensor in a message: "<fn> <field>". */
#define MF__NAME(field) (snprintf(what, sizeof what, "%s " field, fn), what)

static mf_result_t mf__check_dispatch(mf_moe_t moe, const mf_dispatch_in_t *in, const mf_dispatch_out_t *out,
                                      const char *fn, int64_t *T_out) {
    MF_REQUIRE(in && out, "%s: in and out must not be NULL", fn);
    char what[96];
    if (moe->config.spare_slots > 0)
        return mf__error(MF_ERR_NOT_SUPPORTED,
                         "%s: a layer with spare slots (B = %d) runs mf_moe_forward only: rows routed to a spare slot "
                         "would need moeflow's copy of the expert's weights, which the caller's GEMMs cannot see", fn,
                         moe->config.spare_slots);
    MF_CHECK(mf__check_map_ready(moe, fn));
    int64_t T = 0;
    MF_CHECK(mf__check_tokens(moe, &in->x, &in->topk_ids, fn, &T));
    const mf_moe_config_t *c = &moe->config;
    int64_t L = moe->info.num_local_slots, H = c->hidden, B = MF__QUANT_BLOCK;
    int fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    if (c->layout == MF_LAYOUT_EXPERT_MAJOR) {
        int64_t rows = c->max_recv_rows;
        MF_CHECK(mf__check_tensor(&out->recv_x, MF__NAME("recv_x"), c->dtype, 2, MF__DIMS(rows, H), 0));
        if (fp8)
            MF_CHECK(mf__check_tensor(&out->recv_scales, MF__NAME("recv_scales"), MF_DTYPE_FP32, 2,
                                      MF__DIMS(rows, H / B), 0));
        MF_CHECK(mf__check_tensor(&out->recv_src, MF__NAME("recv_src"), MF_DTYPE_INT32, 2, MF__DIMS(rows, 3), 0));
        MF_CHECK(mf__check_tensor(&out->expert_offsets, MF__NAME("expert_offsets"), MF_DTYPE_INT32, 1,
                                  MF__DIMS(L + 1), 0));
    } else {
        int64_t C = c->expert_capacity;
        MF_CHECK(mf__check_tensor(&out->recv_x, MF__NAME("recv_x"), c->dtype, 3, MF__DIMS(L, C, H), 0));
        if (fp8)
            MF_CHECK(mf__check_tensor(&out->recv_scales, MF__NAME("recv_scales"), MF_DTYPE_FP32, 3,
                                      MF__DIMS(L, C, H / B), 0));
        MF_CHECK(mf__check_tensor(&out->recv_src, MF__NAME("recv_src"), MF_DTYPE_INT32, 3, MF__DIMS(L, C, 3), 0));
    }
    MF_CHECK(mf__check_tensor(&out->expert_counts, MF__NAME("expert_counts"), MF_DTYPE_INT32, 1, MF__DIMS(L), 0));
    MF_CHECK(mf__check_rows16(&out->recv_x, MF__NAME("recv_x")));
    *T_out = T;
    return MF_SUCCESS;
}

/* Validates a dispatch send, then runs `halves` of exchange x's dispatch (the send, or, for
 * mf_dispatch, both). A rejected send takes part in the DISPATCH collective with its failure. */
static mf_result_t mf__dispatch_run(struct mf_exchange *x, const mf_dispatch_in_t *in, const mf_dispatch_out_t *out,
                                    uint32_t halves, const mf_exchange_events_t *ev, mf_stream_t stream,
                                    const char *fn) {
    mf_moe_t moe = x->moe;
    mf_comm_t comm = moe->comm;
    int64_t T = 0;
    int32_t slot = -1;
    mf_result_t res = mf__check_dispatch(moe, in, out, fn, &T);
    if (res == MF_SUCCESS) res = mf__check_events(comm, ev, fn);
    if (res == MF_SUCCESS && x->state != MF__X_IDLE)
        res = mf__error(MF_ERR_INVALID_USAGE, "%s: this exchange is already in flight (a handle carries one exchange at a "
                        "time: finish it with mf_combine_recv, or use another handle)", fn);
    for (int32_t i = 0; i < MF_MAX_IN_FLIGHT && res == MF_SUCCESS && (halves & MF__HALF_RECV); i++)
        if (comm->in_flight[i] && comm->in_flight[i]->state == MF__X_DISPATCH_SENT)
            res = mf__error(MF_ERR_INVALID_USAGE, "%s: an exchange sent before this call awaits its dispatch receive "
                            "(mf_dispatch_recv): receive in the order of the sends", fn);
    if (res == MF_SUCCESS && (slot = mf__free_slot(moe)) < 0) res = mf__no_free_slot(moe, fn);
    if (res == MF_SUCCESS) res = mf__apply_event(comm, ev, 0, stream);
    if (res != MF_SUCCESS) return comm->ops->reject(moe, MF__CALL_DISPATCH, res, stream);
    x->T = (int32_t)T;
    x->dispatch_out = *out;
    mf__exchange_begin(x, slot);
    res = comm->ops->dispatch(moe, x, in, halves, stream);
    if (res != MF_SUCCESS) {
        mf__exchange_end(x);
        return res;
    }
    if (halves & MF__HALF_RECV) x->state = MF__X_RECEIVED;
    return mf__apply_event(comm, ev, 1, stream);
}

mf_result_t mf_dispatch(mf_moe_t moe, const mf_dispatch_in_t *in, const mf_dispatch_out_t *out,
                        mf_stream_t stream) {
    const char *fn = "mf_dispatch";
    mf__clear_error();
    MF_REQUIRE(moe, "%s: moe must not be NULL", fn);
    MF_CHECK(mf__check_usable(moe, fn));
    if (moe->comm->pending_dispatch)
        return moe->comm->ops->reject(moe, MF__CALL_DISPATCH, mf__error(MF_ERR_INVALID_USAGE, "%s: the previous "
                                      "mf_dispatch on this comm has not been combined yet", fn), stream);
    MF_CHECK(mf__dispatch_run(&moe->own, in, out, MF__HALF_BOTH, NULL, stream, fn));
    moe->comm->pending_dispatch = moe;
    moe->dispatch_T = moe->own.T;
    return MF_SUCCESS;
}

/* The inputs and outputs of a combine of exchange x (mf_combine, mf_combine_send). */
static mf_result_t mf__check_combine(const struct mf_exchange *x, const mf_combine_in_t *in, const mf_combine_out_t *out,
                                     const char *fn) {
    MF_REQUIRE(in && out, "%s: in and out must not be NULL", fn);
    if (x->state != MF__X_RECEIVED)
        return mf__error(MF_ERR_INVALID_USAGE, "%s: no received dispatch of this exchange awaits a combine "
                         "(mf_dispatch, or mf_dispatch_send + mf_dispatch_recv, first)", fn);
    const mf_moe_t moe = x->moe;
    char what[96];
    const mf_moe_config_t *c = &moe->config;
    int64_t L = moe->info.num_local_slots, H = c->hidden, T = x->T;
    if (c->layout == MF_LAYOUT_EXPERT_MAJOR)
        MF_CHECK(mf__check_tensor(&in->expert_out, MF__NAME("expert_out"), MF_DTYPE_BF16, 2, MF__DIMS(c->max_recv_rows, H), 0));
    else
        MF_CHECK(mf__check_tensor(&in->expert_out, MF__NAME("expert_out"), MF_DTYPE_BF16, 3,
                                  MF__DIMS(L, c->expert_capacity, H), 0));
    MF_CHECK(mf__check_tensor(&in->topk_weights, MF__NAME("topk_weights (T of the dispatch)"), MF_DTYPE_FP32, 2,
                              MF__DIMS(T, c->num_topk), 0));
    MF_CHECK(mf__check_tensor(&out->y, MF__NAME("y (T of the dispatch)"), MF_DTYPE_BF16, 2, MF__DIMS(T, H), 0));
    MF_CHECK(mf__check_rows16(&in->expert_out, MF__NAME("expert_out")));
    return mf__check_rows16(&out->y, MF__NAME("y"));
}
#undef MF__NAME

/* Validates a combine send, then runs `halves` of x's combine. A rejected send takes part in the
 * COMBINE collective with its failure and ends the exchange (every rank fails it). */
static mf_result_t mf__combine_run(struct mf_exchange *x, const mf_combine_in_t *in, const mf_combine_out_t *out,
                                   uint32_t halves, const mf_exchange_events_t *ev, mf_stream_t stream, const char *fn) {
    mf_moe_t moe = x->moe;
    mf_comm_t comm = moe->comm;
    mf_result_t res = mf__check_combine(x, in, out, fn);
    if (res == MF_SUCCESS) res = mf__check_events(comm, ev, fn);
    for (int32_t i = 0; i < MF_MAX_IN_FLIGHT && res == MF_SUCCESS && (halves & MF__HALF_RECV); i++)
        if (comm->in_flight[i] && comm->in_flight[i]->state == MF__X_COMBINE_SENT)
            res = mf__error(MF_ERR_INVALID_USAGE, "%s: an exchange sent before this call awaits its combine receive "
                            "(mf_combine_recv): receive in the order of the sends", fn);
    if (res == MF_SUCCESS) res = mf__apply_event(comm, ev, 0, stream);
    if (res != MF_SUCCESS) {
        if (x->state != MF__X_IDLE) mf__exchange_end(x);
        return comm->ops->reject(moe, MF__CALL_COMBINE, res, stream);
    }
    x->combine_in = *in;
    x->combine_out = *out;
    x->state = MF__X_COMBINE_SENT;
    x->seq[1] = comm->sends[1]++;
    res = comm->ops->combine(moe, x, halves, stream);
    if (res != MF_SUCCESS || (halves & MF__HALF_RECV)) mf__exchange_end(x);
    if (res != MF_SUCCESS) return res;
    return mf__apply_event(comm, ev, 1, stream);
}

mf_result_t mf_combine(mf_moe_t moe, const mf_combine_in_t *in, const mf_combine_out_t *out,
                       mf_stream_t stream) {
    mf__clear_error();
    MF_REQUIRE(moe, "mf_combine: moe must not be NULL");
    MF_CHECK(mf__check_usable(moe, "mf_combine"));
    /* The dispatch's combine is consumed by a combine on its layer, also a rejected one (the peers
     * failed theirs with it); a combine on another layer leaves it pending. */
    if (moe->comm->pending_dispatch == moe) moe->comm->pending_dispatch = NULL;
    return mf__combine_run(&moe->own, in, out, MF__HALF_BOTH, NULL, stream, "mf_combine");
}

/* ---- the split halves (docs/API.md section 16) ---------------------------------------------- */

mf_result_t mf_exchange_create(mf_moe_t moe, mf_exchange_t *exchange) {
    mf__clear_error();
    MF_REQUIRE(moe && exchange, "mf_exchange_create: moe and exchange must not be NULL");
    struct mf_exchange *x = mf__calloc(1, sizeof *x);
    if (!x) return mf__error(MF_ERR_OUT_OF_MEMORY, "mf_exchange_create: out of host memory");
    x->moe = moe;
    *exchange = x;
    return MF_SUCCESS;
}

mf_result_t mf_exchange_destroy(mf_exchange_t exchange) {
    mf__clear_error();
    if (!exchange) return MF_SUCCESS;
    if (exchange->state != MF__X_IDLE)
        return mf__error(MF_ERR_INVALID_USAGE, "mf_exchange_destroy: the exchange is in flight; finish it "
                         "(mf_combine_recv) first");
    mf__free(exchange);
    return MF_SUCCESS;
}

/* The check every half of an exchange starts with: a handle, of a layer whose comm is usable. */
static mf_result_t mf__check_exchange(mf_exchange_t x, const char *fn) {
    MF_REQUIRE(x, "%s: exchange must not be NULL", fn);
    return mf__check_usable(x->moe, fn);
}

/* The two send halves (this and mf_combine_send) are alike on purpose: one public entry per half,
 * their checks in mf__check_exchange, their work in mf__dispatch_run / mf__combine_run. */
mf_result_t mf_dispatch_send(mf_exchange_t x, const mf_dispatch_in_t *in, const mf_dispatch_out_t *out,
                             const mf_exchange_events_t *events, mf_stream_t stream) {
    const char *fn = "mf_dispatch_send";
    mf__clear_error();
    MF_CHECK(mf__check_exchange(x, fn));
    return mf__dispatch_run(x, in, out, MF__HALF_SEND, events, stream, fn);
}

/* The checks of a receive, local (a refused receive changes nothing and meets no peer). */
static mf_result_t mf__check_receive(mf_exchange_t x, int32_t state, const mf_exchange_events_t *ev,
                                     mf_stream_t stream, const char *fn) {
    MF_CHECK(mf__check_exchange(x, fn));
    if (x->state != state)
        return mf__error(MF_ERR_INVALID_USAGE, "%s: no %s send of this exchange awaits its receive (%s first)", fn,
                         state == MF__X_DISPATCH_SENT ? "dispatch" : "combine",
                         state == MF__X_DISPATCH_SENT ? "mf_dispatch_send" : "mf_combine_send");
    MF_CHECK(mf__check_receive_order(x, state, fn));
    MF_CHECK(mf__check_events(x->moe->comm, ev, fn));
    return mf__apply_event(x->moe->comm, ev, 0, stream);
}

mf_result_t mf_dispatch_recv(mf_exchange_t x, const mf_exchange_events_t *events, mf_stream_t stream) {
    const char *fn = "mf_dispatch_recv";
    mf__clear_error();
    MF_CHECK(mf__check_receive(x, MF__X_DISPATCH_SENT, events, stream, fn));
    mf_comm_t comm = x->moe->comm;
    mf_result_t res = comm->ops->dispatch(x->moe, x, NULL, MF__HALF_RECV, stream);
    if (res != MF_SUCCESS) {
        mf__exchange_end(x);
        return res;
    }
    x->state = MF__X_RECEIVED;
    return mf__apply_event(comm, events, 1, stream);
}

/* Alike on purpose, as mf_dispatch_send (there). */
mf_result_t mf_combine_send(mf_exchange_t x, const mf_combine_in_t *in, const mf_combine_out_t *out,
                            const mf_exchange_events_t *events, mf_stream_t stream) {
    const char *fn = "mf_combine_send";
    mf__clear_error();
    MF_CHECK(mf__check_exchange(x, fn));
    return mf__combine_run(x, in, out, MF__HALF_SEND, events, stream, fn);
}

mf_result_t mf_combine_recv(mf_exchange_t x, const mf_exchange_events_t *events, mf_stream_t stream) {
    const char *fn = "mf_combine_recv";
    mf__clear_error();
    MF_CHECK(mf__check_receive(x, MF__X_COMBINE_SENT, events, stream, fn));
    mf_comm_t comm = x->moe->comm;
    mf_result_t res = comm->ops->combine(x->moe, x, MF__HALF_RECV, stream);
    mf__exchange_end(x);
    if (res != MF_SUCCESS) return res;
    return mf__apply_event(comm, events, 1, stream);
}

mf_result_t mf_moe_experts(mf_moe_t moe, const mf_experts_in_t *in, const mf_experts_out_t *out,
                           mf_stream_t stream) {
    const char *fn = "mf_moe_experts";
    mf__clear_error();
    MF_REQUIRE(moe && in && out, "%s: moe, in and out must not be NULL", fn);
    MF_CHECK(mf__check_usable(moe, fn));
    const mf_moe_config_t *c = &moe->config;
    if (c->layout != MF_LAYOUT_MASKED)
        return mf__error(MF_ERR_NOT_SUPPORTED, "%s: the layer's layout is EXPERT_MAJOR; the experts run on the "
                         "MASKED layout (create the layer with layout MF_LAYOUT_MASKED)", fn);
    if (c->spare_slots > 0)
        return mf__error(MF_ERR_NOT_SUPPORTED, "%s: a layer with spare slots runs its experts in mf_moe_forward "
                         "only (the spare slots hold moeflow's own weight copies)", fn);
    if (!moe->weights_set)
        return mf__error(MF_ERR_INVALID_USAGE, "%s: weights are not set (mf_moe_set_weights)", fn);
    if (!moe->comm->ops->experts)
        return mf__error(MF_ERR_NOT_SUPPORTED, "%s: the %s backend has no standalone experts", fn,
                         moe->comm->ops->name);
    int64_t L = moe->info.num_local_slots, C = c->expert_capacity, H = c->hidden;
    MF_CHECK(mf__check_tensor(&in->recv_x, "mf_moe_experts recv_x", c->dtype, 3, MF__DIMS(L, C, H), 0));
    MF_CHECK(mf__check_rows16(&in->recv_x, "mf_moe_experts recv_x"));
    if (c->dtype == MF_DTYPE_FP8_E4M3)
        MF_CHECK(mf__check_tensor(&in->recv_scales, "mf_moe_experts recv_scales", MF_DTYPE_FP32, 3,
                                  MF__DIMS(L, C, H / MF__QUANT_BLOCK), 0));
    MF_CHECK(mf__check_tensor(&in->expert_counts, "mf_moe_experts expert_counts", MF_DTYPE_INT32, 1, MF__DIMS(L), 0));
    MF_CHECK(mf__check_tensor(&out->expert_out, "mf_moe_experts expert_out", MF_DTYPE_BF16, 3, MF__DIMS(L, C, H), 0));
    MF_CHECK(mf__check_rows16(&out->expert_out, "mf_moe_experts expert_out"));
    return moe->comm->ops->experts(moe, in, out, stream);
}

mf_result_t mf_moe_get_phase_times(mf_moe_t moe, mf_phase_times_t *times) {
    mf__clear_error();
    MF_REQUIRE(moe && times, "mf_moe_get_phase_times: moe and times must not be NULL");
    if (!moe->config.profile)
        return mf__error(MF_ERR_INVALID_USAGE,
                         "mf_moe_get_phase_times: the layer was created with profile = 0");
    if (!moe->comm->ops->get_phase_times)
        return mf__error(MF_ERR_NOT_SUPPORTED, "mf_moe_get_phase_times: backend has no profiler");
    return moe->comm->ops->get_phase_times(moe, times);
}
