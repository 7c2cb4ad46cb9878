/*
 * maps.c — balanced EP's calls on a layer (docs/DESIGN.md "Balanced EP"): the expert map
 * (mf_moe_set_expert_map), a staged map (mf_moe_stage_expert_map, a setup collective that agrees
 * on the map and sizes the staging slots; its schedule is stage.h's), the per-step prefetch that
 * runs the staged map's steps and the spare slots' push (mf_moe_prefetch) and the stats
 * (mf_moe_get_balance_stats). As in core/moe.c: every argument is checked here, once, for every
 * backend, then the backend's ops do the work (src/cpu/backend.c, src/cuda/backend.cu).
 *
 * Dimension legend: E logical experts, R ranks, P physical slots, Lp = P / R, n experts per step.
 */
#include <stdio.h>
#include <string.h>

#include "balance/stage.h"
#include "core/alloc.h"
#include "core/backend.h"
#include "core/errors.h"
#include "core/handles.h"
#include "core/layout.h"
#include "transport/transport.h"

/* ---- the expert map ------------------------------------------------------------------------ */

/* A layer with a mapped placement has no settable map: its slot grid is the placement's. */
static mf_result_t mf__check_map_settable(mf_moe_t moe, const char *fn) {
    if (!moe->placed) return MF_SUCCESS;
    return mf__error(MF_ERR_NOT_SUPPORTED,
                     "%s: the layer's placement (%s, E = %d on R = %d) is its expert map; expert maps (replicas, "
                     "EPLB) need placement MF_PLACEMENT_LINEAR with E a multiple of R; nothing was changed", fn,
                     moe->config.placement == MF_PLACEMENT_ROUND_ROBIN ? "MF_PLACEMENT_ROUND_ROBIN" : "LINEAR",
                     moe->config.num_experts, moe->comm->num_ranks);
}

/* A map is valid: P entries, every id in [0, E), every expert with a slot. */
static mf_result_t mf__check_map(mf_moe_t moe, const int32_t *map, int32_t num_physical, const char *fn) {
    const int32_t P = moe->config.num_physical_experts, E = moe->config.num_experts;
    MF_REQUIRE(num_physical == P, "%s: num_physical = %d, the layer has num_physical_experts P = %d", fn,
               num_physical, P);
    int32_t *seen = mf__calloc((size_t)E, sizeof(int32_t));
    if (!seen) return mf__error(MF_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    mf_result_t res = MF_SUCCESS;
    for (int32_t p = 0; p < P && res == MF_SUCCESS; p++) {
        if (map[p] < 0 || map[p] >= E)
            res = mf__error(MF_ERR_INVALID_ARGUMENT,
                            "%s: phys_to_logical[%d] = %d (slot %d of rank %d) is outside [0, E = %d); nothing was "
                            "changed", fn, p, map[p], p % moe->slots_per_rank, p / moe->slots_per_rank, E);
        else seen[map[p]]++;
    }
    for (int32_t e = 0; e < E && res == MF_SUCCESS; e++)
        if (!seen[e])
            res = mf__error(MF_ERR_INVALID_ARGUMENT,
                            "%s: logical expert %d has no physical slot (every expert needs a replica); nothing "
                            "was changed", fn, e);
    mf__free(seen);
    return res;
}

mf_result_t mf_moe_set_expert_map(mf_moe_t moe, const int32_t *map, int32_t num_physical) {
    const char *fn = "mf_moe_set_expert_map";
    mf__clear_error();
    MF_REQUIRE(moe && map, "%s: moe and phys_to_logical must not be NULL", fn);
    if (moe->staged_map)
        return mf__error(MF_ERR_INVALID_USAGE, "%s: a staged map is in progress (mf_moe_stage_expert_map); it "
                         "switches by itself", fn);
    MF_CHECK(mf__check_map_settable(moe, fn));
    MF_CHECK(mf__check_map(moe, map, num_physical, fn));
    const int32_t P = moe->config.num_physical_experts, E = moe->config.num_experts;
    mf_result_t res = MF_SUCCESS;
    int32_t identity = P == E;
    for (int32_t p = 0; p < P && identity; p++) identity = map[p] == p;
    if (!moe->comm->ops->set_expert_map && !identity)
        return mf__error(MF_ERR_NOT_SUPPORTED, "%s: the %s backend has no expert maps yet (only the identity)", fn,
                         moe->comm->ops->name);
    int32_t *saved = mf__malloc((size_t)P * sizeof(int32_t));
    if (!saved) return mf__error(MF_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    memcpy(saved, moe->expert_map, (size_t)P * sizeof(int32_t));
    memcpy(moe->expert_map, map, (size_t)P * sizeof(int32_t));
    if (moe->comm->ops->set_expert_map && (res = moe->comm->ops->set_expert_map(moe)) != MF_SUCCESS)
        memcpy(moe->expert_map, saved, (size_t)P * sizeof(int32_t));
    mf__free(saved);
    if (res != MF_SUCCESS) return res;
    moe->map_set = 1;
    moe->map_hash = mf__map_hash(moe->expert_map, P);
    return MF_SUCCESS;
}

/* ---- rebalancing without a stall (docs/DESIGN.md "Balanced EP") ------------------------------ */

/* What every rank tells the others when it stages a map. */
typedef struct mf__stage_info {
    int32_t status;          /* this rank's verdict on its arguments */
    uint32_t map_hash;       /* mf__map_hash of the staged map */
    int32_t experts_per_step;
} mf__stage_info_t;

mf_result_t mf_moe_stage_expert_map(mf_moe_t moe, const int32_t *map, int32_t num_physical,
                                    const mf_moe_weights_t *next_weights, int32_t experts_per_step) {
    const char *fn = "mf_moe_stage_expert_map";
    mf__clear_error();
    MF_REQUIRE(moe, "%s: moe must not be NULL", fn);
    mf_comm_t comm = moe->comm;
    MF_CHECK(mf__check_comm_usable(comm, fn));
    if (!comm->ops->stage_step) /* the same backend on every rank: all return here */
        return mf__error(MF_ERR_NOT_SUPPORTED, "%s: the %s backend cannot move a staged map's weights yet; set the "
                         "map and its weights between two forwards instead (mf_moe_set_expert_map, "
                         "mf_moe_set_weights)", fn, comm->ops->name);
    MF_CHECK(mf__check_map_settable(moe, fn)); /* the same config on every rank: all return here */

    /* This rank's verdict, then every rank's: all fail together, nothing changed. */
    mf__stage_info_t mine = {0}, all[MF_MAX_RANKS];
    mf_result_t res = MF_SUCCESS;
    if (!map || !next_weights) res = mf__error(MF_ERR_INVALID_ARGUMENT, "%s: phys_to_logical and next_weights must "
                                               "not be NULL", fn);
    else if (!moe->weights_set) res = mf__error(MF_ERR_INVALID_USAGE, "%s: weights are not set (the current map's "
                                                "weights are the source; call mf_moe_set_weights first)", fn);
    else if (moe->staged_map) res = mf__error(MF_ERR_INVALID_USAGE, "%s: a staged map is in progress (%d of its %d "
                                              "prefetch steps done)", fn, moe->stage_step, moe->stage_steps);
    else if (experts_per_step < 0) res = mf__error(MF_ERR_INVALID_ARGUMENT, "%s: experts_per_step = %d is negative",
                                                   fn, experts_per_step);
    if (res == MF_SUCCESS) res = mf__check_map(moe, map, num_physical, fn);
    if (res == MF_SUCCESS) res = mf__check_weights(moe, next_weights, "next_weights");
    if (res == MF_SUCCESS && (next_weights->w13.data == moe->weights.w13.data ||
                              next_weights->w2.data == moe->weights.w2.data))
        res = mf__error(MF_ERR_INVALID_ARGUMENT, "%s: next_weights are the current weights (they are the source "
                        "until the switch: pass other buffers)", fn);
    char why[512];
    snprintf(why, sizeof why, "%s", mf_last_error());
    mine.status = res;
    mine.map_hash = res == MF_SUCCESS ? mf__map_hash(map, num_physical) : 0;
    mine.experts_per_step = experts_per_step;
    MF_CHECK(mf__allgather(comm, &mine, all, sizeof mine, fn));
    if (res != MF_SUCCESS) return mf__error(res, "%s", why);
    for (int32_t r = 0; r < comm->num_ranks; r++) {
        if (all[r].status != MF_SUCCESS)
            return mf__error((mf_result_t)all[r].status, "%s: rank %d rejected its staged map; nothing was changed",
                             fn, r);
        if (all[r].map_hash != all[0].map_hash || all[r].experts_per_step != all[0].experts_per_step)
            return mf__error(MF_ERR_INVALID_ARGUMENT,
                             "%s: rank %d staged another map or experts_per_step than rank 0 (map 0x%x, %d; rank 0: "
                             "0x%x, %d); every rank stages the same; nothing was changed", fn, r,
                             (unsigned)all[r].map_hash, all[r].experts_per_step, (unsigned)all[0].map_hash,
                             all[0].experts_per_step);
    }

    /* The schedule (the same on every rank) and the staging slots it needs: 2n experts per rank. */
    const int32_t P = moe->config.num_physical_experts, R = comm->num_ranks, Lp = moe->slots_per_rank;
    int32_t n = experts_per_step;
    if (n == 0) /* all in one step: n = the most any rank receives */
        for (int32_t q = 0; q < R; q++) {
            int32_t m = mf__stage_moved(moe->expert_map, map, Lp, q);
            n = m > n ? m : n;
        }
    n = n > 0 ? n : 1;
    int32_t *staged = mf__malloc((size_t)P * sizeof(int32_t));
    mf__stage_slot_t *plan = mf__malloc((size_t)P * sizeof(mf__stage_slot_t));
    res = staged && plan ? MF_SUCCESS : mf__error(MF_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    int32_t steps = 0;
    if (res == MF_SUCCESS) {
        memcpy(staged, map, (size_t)P * sizeof(int32_t));
        steps = mf__stage_schedule(moe->expert_map, staged, P, R, n, plan);
    }
    mf_moe_config_t sc = moe->config;
    sc.spare_slots = 2 * n;
    mf__spare_layout_t layout;
    mf__spare_layout_init(&layout, &sc);
    int32_t need = steps > 1 && (!moe->stage.local || moe->stage.bytes < layout.bytes);
    if (res == MF_SUCCESS && comm->ops->stage_begin) res = comm->ops->stage_begin(moe, staged);
    res = mf__agree(comm, res, fn); /* the same `need` on every rank: same maps, same n */
    if (res == MF_SUCCESS && need) {
        /* No peer writes the old staging slots any more: their last pushes preceded the forward
         * after the last switch, and every rank is here. */
        if (moe->stage.local) comm->tops->sym_free(comm, &moe->stage);
        res = comm->tops->sym_alloc(comm, layout.bytes, &moe->stage); /* collective, agreed */
    }
    if (res != MF_SUCCESS) {
        mf__free(staged);
        mf__free(plan);
        return res;
    }
    moe->stage_layout = layout;
    moe->staged_map = staged;
    moe->stage_plan = plan;
    moe->staged_weights = *next_weights;
    moe->stage_per_step = n;
    moe->stage_steps = steps;
    moe->stage_step = 0;
    return MF_SUCCESS;
}

/* After the last step: the staged map and its weights serve from the next forward on (every rank
 * switches in the same prefetch). As mf_moe_set_expert_map + mf_moe_set_weights: the weights
 * count grows, so spare copies are dropped. The backend switched its own state (a device copy of
 * the map) in its last stage_step, ordered on the stream without a host wait. */
static void mf__stage_switch(mf_moe_t moe) {
    const int32_t P = moe->config.num_physical_experts;
    memcpy(moe->expert_map, moe->staged_map, (size_t)P * sizeof(int32_t));
    moe->map_set = 1;
    moe->map_hash = mf__map_hash(moe->expert_map, P);
    moe->weights = moe->staged_weights;
    moe->weights_count++;
    mf__free(moe->staged_map);
    mf__free(moe->stage_plan);
    moe->staged_map = NULL;
    moe->stage_plan = NULL;
    moe->map_switches++;
}

/* The bytes one step moves (the schedule is known on every rank). */
static void mf__stage_count_bytes(mf_moe_t moe, int32_t step) {
    const int32_t P = moe->config.num_physical_experts, Lp = moe->slots_per_rank, me = moe->comm->rank;
    const int64_t bytes = (int64_t)moe->stage_layout.copy_bytes;
    for (int32_t p = 0; p < P; p++) {
        const mf__stage_slot_t *s = &moe->stage_plan[p];
        if (s->held >= 0) {
            moe->stage_local_bytes += step == 0 && p / Lp == me ? bytes : 0;
            continue;
        }
        moe->stage_bytes_all += s->step == step ? bytes : 0;
        moe->stage_bytes += s->step == step && s->source / Lp == me ? bytes : 0;
        moe->stage_local_bytes += s->step + 1 == step && p / Lp == me ? bytes : 0;
    }
}

mf_result_t mf_moe_prefetch(mf_moe_t moe, mf_stream_t stream) {
    const char *fn = "mf_moe_prefetch";
    mf__clear_error();
    MF_REQUIRE(moe, "%s: moe must not be NULL", fn);
    MF_CHECK(mf__check_comm_usable(moe->comm, fn));
    if (!moe->weights_set)
        return mf__error(MF_ERR_INVALID_USAGE, "%s: weights are not set (call mf_moe_set_weights first)", fn);
    moe->stage_bytes = moe->stage_bytes_all = moe->stage_local_bytes = 0;
    if (moe->staged_map) { /* one step of the staged map's moves, then (the last) the switch */
        MF_CHECK(moe->comm->ops->stage_step(moe, stream));
        mf__stage_count_bytes(moe, moe->stage_step);
        if (++moe->stage_step == moe->stage_steps) mf__stage_switch(moe);
    }
    if (moe->config.spare_slots == 0) return MF_SUCCESS;
    if (!moe->comm->ops->prefetch)
        return mf__error(MF_ERR_NOT_SUPPORTED, "%s: the %s backend has no per-step balancing yet", fn,
                         moe->comm->ops->name);
    return moe->comm->ops->prefetch(moe, stream);
}

mf_result_t mf_moe_get_balance_stats(mf_moe_t moe, mf_moe_balance_stats_t *stats) {
    const char *fn = "mf_moe_get_balance_stats";
    mf__clear_error();
    MF_REQUIRE(moe && stats, "%s: moe and stats must not be NULL", fn);
    MF_REQUIRE(stats->size >= sizeof(uint32_t) && stats->size <= sizeof(mf_moe_balance_stats_t),
               "%s: stats->size = %u is outside [4, %zu]; set it to sizeof(mf_moe_balance_stats_t)", fn, stats->size,
               sizeof(mf_moe_balance_stats_t));
    mf_moe_balance_stats_t s;
    memset(&s, 0, sizeof s);
    s.size = stats->size;
    s.num_physical_experts = moe->config.num_physical_experts;
    s.slots_per_rank = moe->slots_per_rank;
    s.spare_slots = moe->config.spare_slots;
    if (moe->comm->ops->get_balance_stats) MF_CHECK(moe->comm->ops->get_balance_stats(moe, &s));
    s.stage_bytes = moe->stage_bytes;
    s.stage_bytes_all = moe->stage_bytes_all;
    s.stage_local_bytes = moe->stage_local_bytes;
    s.stage_steps_left = moe->staged_map ? moe->stage_steps - moe->stage_step : 0;
    s.map_switches = (int32_t)moe->map_switches;
    memcpy(stats, &s, stats->size);
    return MF_SUCCESS;
}
