/*
 * backend.h — the backend interface, `mf__backend_ops`, and the backends' tables.
 *
 * Layering (docs/DESIGN.md): src/core validates every public call on the host and then calls the group's
 * backend (src/cpu or src/cuda) through `mf__backend_ops`. A backend may assume its inputs passed
 * validation: shapes, dtypes and non-NULL data are checked in src/core, once.
 */
#ifndef MF_CORE_BACKEND_H
#define MF_CORE_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "core/handles.h"
#include "moeflow.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Called by src/core after validation. Collective entries are entered by every rank. */
struct mf__backend_ops {
    const char *name;
    int32_t (*available)(void);
    /* Selects the comm's device and fills `id` with a string naming it, the same in every process
     * on this host that uses the device ("" for the CPU backend). Before the transport exists. */
    mf_result_t (*device_id)(mf_comm_t comm, char id[64]);
    /* Per-rank state, once comm->ranks_on_device is known (it resolves num_sms). */
    mf_result_t (*comm_init)(mf_comm_t comm);
    void (*comm_fini)(mf_comm_t comm);
    /* Memory of symmetric allocations (the local transport's; ipc uses it on CUDA): zeroed and
     * idle when it returns (no pending work may later write it). */
    mf_result_t (*mem_alloc)(mf_comm_t comm, size_t bytes, void **ptr);
    void (*mem_free)(mf_comm_t comm, void *ptr);
    mf_result_t (*moe_init)(mf_moe_t moe);
    void (*moe_fini)(mf_moe_t moe);
    /* Optional: called after moe->weights holds newly validated, borrowed weights. */
    mf_result_t (*set_weights)(mf_moe_t moe);
    mf_result_t (*forward)(mf_moe_t moe, const mf_moe_forward_in_t *in,
                           const mf_moe_forward_out_t *out, mf_stream_t stream);
    /* The halves (MF__HALF_*) of exchange x's dispatch: SEND quantises and publishes `in` into
     * x->heap and arrives at DISPATCH (x->epoch), waiting on no peer; RECV waits for that arrival of
     * every rank, plans into the layer's plan of x->slot and lands the rows in x->dispatch_out. Both
     * at once: mf_dispatch (a backend may fuse the arrival and the wait). `in` is NULL without SEND. */
    mf_result_t (*dispatch)(mf_moe_t moe, struct mf_exchange *x, const mf_dispatch_in_t *in, uint32_t halves,
                            mf_stream_t stream);
    /* The halves of x's combine: SEND returns x->combine_in's rows to their owners' combine slots
     * (x->heap) and arrives at COMBINE; RECV waits and sums into x->combine_out. */
    mf_result_t (*combine)(mf_moe_t moe, struct mf_exchange *x, uint32_t halves, mf_stream_t stream);
    /* mf_moe_experts (not collective): validated MASKED rows of the layer's num_local_slots. */
    mf_result_t (*experts)(mf_moe_t moe, const mf_experts_in_t *in, const mf_experts_out_t *out,
                           mf_stream_t stream);
    /* A data-path call whose input this rank rejected (`code`, message already set): takes part
     * in the call's synchronisations (`phases`: a bit per mf__phase_t the call meets at) with that
     * status, so that every peer fails the call too, and writes nothing. Returns `code` with the
     * message kept (or a timeout / abort met on the way). */
    mf_result_t (*reject)(mf_moe_t moe, uint32_t phases, mf_result_t code, mf_stream_t stream);
    /* Makes this rank's waits end (mf_comm_abort); any thread, non-blocking. */
    void (*abort)(mf_comm_t comm);
    mf_result_t (*get_async_error)(mf_comm_t comm);
    mf_result_t (*get_phase_times)(mf_moe_t moe, mf_phase_times_t *times);
    /* Balanced EP; NULL where the backend has none (core answers NOT_SUPPORTED). */
    mf_result_t (*set_expert_map)(mf_moe_t moe); /* after moe->expert_map changed */
    mf_result_t (*prefetch)(mf_moe_t moe, mf_stream_t stream);
    mf_result_t (*get_balance_stats)(mf_moe_t moe, mf_moe_balance_stats_t *stats);
    /* Rebalancing; NULL where the backend cannot move weights (core answers NOT_SUPPORTED). One
     * step of the staged map's moves (moe->stage_step of them done before it, src/balance/stage.h),
     * in mf_moe_prefetch before the spare-slot step. The last one (stage_step + 1 == stage_steps)
     * also switches the backend's own copy of the map to moe->staged_map and its weights to
     * moe->staged_weights (ordered on the stream, no host wait); core then switches its state. */
    mf_result_t (*stage_step)(mf_moe_t moe, mf_stream_t stream);
    /* Optional: a stage of `map` [P] is about to start (blocking, every rank; nothing in flight
     * reads what it prepares, e.g. a device copy of the map that the last step installs). */
    mf_result_t (*stage_begin)(mf_moe_t moe, const int32_t *map);
    /* Optional (NULL: the backend runs every call to completion and takes no events): the split
     * halves' events, makes the stream wait for `event` (record = 0) or records it (record = 1). */
    mf_result_t (*event)(mf_comm_t comm, mf_event_t event, int32_t record, mf_stream_t stream);
};

extern const mf__backend_ops_t mf__cpu_backend;
#if MF_WITH_CUDA
extern const mf__backend_ops_t mf__cuda_backend;
#endif

#ifdef __cplusplus
}
#endif

#endif /* MF_CORE_BACKEND_H */
