/*
 * handles.h — the structs behind the opaque public handles: mf_group (R virtual ranks of one
 * process), mf_comm (one rank), mf_exchange (one dispatch + combine in halves) and mf_moe (a
 * layer). Core fills them (group.c, moe.c); the backends and transports read them.
 */
#ifndef MF_CORE_HANDLES_H
#define MF_CORE_HANDLES_H

#include <stddef.h>
#include <stdint.h>

#include "core/layout.h"
#include "moeflow.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mf__backend_ops mf__backend_ops_t;
typedef struct mf__transport_ops mf__transport_ops_t;

/* A symmetric allocation whose free waits for its comm's end (a list: mf_comm.deferred). */
typedef struct mf__deferred_free {
    void *ptr;
    struct mf__deferred_free *next;
} mf__deferred_free_t;

/* R virtual ranks of one process (mf_group_create): their comms, made on R threads through
 * mf_comm_init's path with an in-process allgather. */
struct mf_group {
    mf_backend_t backend;
    int32_t num_ranks;
    int64_t timeout_ms;                 /* resolved: bounds the in-process allgather */
    struct mf_comm **comms;             /* [R] */
    struct mf__host_barrier *barrier;   /* the in-process allgather's meeting point */
    const void *send[MF_MAX_RANKS];     /* each rank's block during an allgather */
    struct mf__group_rank *ranks;       /* [R] bootstrap contexts */
};

/* One rank. Everything the data path needs is here: the peer tables, the resolved settings. */
struct mf_comm {
    mf_backend_t backend;
    const mf__backend_ops_t *ops;
    mf_transport_t transport;           /* resolved (never AUTO) */
    const mf__transport_ops_t *tops;
    int32_t rank, num_ranks;
    int32_t device;                     /* CUDA device ordinal */
    int32_t ranks_on_device;            /* ranks of the comm sharing this rank's device (CUDA) */
    int32_t num_sms;                    /* resolved: SMs this rank's peer-waiting kernels use */
    int64_t timeout_ms;                 /* resolved */
    mf_bootstrap_t bootstrap;
    int32_t bootstrap_failed;           /* the allgather failed once: setup collectives refuse */
    void *nccl_comm;                    /* MF_TRANSPORT_NCCL: the caller's ncclComm_t */
    struct mf_group *group;             /* the group that made this comm, or NULL */
    size_t heap_declared;               /* config heap_bytes (0: sized by the first layer) */
    mf__sym_t heap;                     /* heap.peers[r]: rank r's symmetric heap (bytes 0 until sized) */
    mf__sym_t signals;                  /* signals.peers[r]: rank r's MF__SIGNAL_WORDS words */
    uint64_t epoch[MF__NUM_PHASES];     /* collectives completed per phase, same on every rank */
    uint32_t layers_made;               /* layers created so far: the next one's id (all ranks alike) */
    int32_t broken;                     /* 1 after a timeout (or an expired GEMM wait): its state is unknown */
    int32_t aborted;                    /* 1 after mf_comm_abort (read and written atomically) */
    mf__deferred_free_t *deferred;      /* local transport: a broken comm's symmetric memory, freed
                                         * with the comm (transport/local.c) */
    struct mf_moe *pending_dispatch;    /* layer whose mf_dispatch awaits its mf_combine, or NULL */
    int32_t device_sms;                 /* the device's SMs (CUDA; 0 on the CPU): bounds num_sms */
    int32_t default_sms;                /* num_sms as resolved at init (mf_comm_set_num_sms(0) restores it) */
    /* Exchanges in flight (the split halves; core/moe.c "exchanges"), at most MF_MAX_IN_FLIGHT, and
     * the arrivals this comm's sends made at DISPATCH and COMBINE (the same count on every rank). */
    struct mf_exchange *in_flight[MF_MAX_IN_FLIGHT];
    uint64_t sends[2];
    void *backend_state;
};

/* ---- exchanges: one dispatch + combine of a layer, in halves (docs/API.md section 16) ------------ */
/* An exchange goes IDLE -> (mf_dispatch_send) DISPATCH_SENT -> (mf_dispatch_recv) RECEIVED ->
 * (mf_combine_send) COMBINE_SENT -> (mf_combine_recv) IDLE; a failed half ends it (IDLE). From its
 * dispatch send to its end it holds a heap slot of its layer and is in comm->in_flight. */
typedef enum mf__xstate {
    MF__X_IDLE = 0,
    MF__X_DISPATCH_SENT = 1,
    MF__X_RECEIVED = 2,
    MF__X_COMBINE_SENT = 3
} mf__xstate_t;

/* The halves of one backend call (ops->dispatch / ops->combine): the one-call forms pass both. */
#define MF__HALF_SEND 1u
#define MF__HALF_RECV 2u
#define MF__HALF_BOTH (MF__HALF_SEND | MF__HALF_RECV)

struct mf_exchange {
    struct mf_moe *moe;
    int32_t state;                 /* mf__xstate_t */
    int32_t slot;                  /* the layer's heap slot while in flight */
    int32_t T;                     /* tokens of its dispatch */
    int32_t pad;
    uint64_t seq[2];               /* comm->sends at its DISPATCH and COMBINE sends: receives in this order */
    uint64_t epoch;                /* CPU backend: the epoch its last send arrived at */
    mf__heap_layout_t heap;        /* the slot's regions */
    mf_dispatch_out_t dispatch_out; /* where its rows land (given to the send) */
    mf_combine_in_t combine_in;    /* given to the combine send */
    mf_combine_out_t combine_out;
};

struct mf_moe {
    mf_comm_t comm;
    /* With defaults resolved: num_physical_experts never 0; a mapped placement's slot grid R * Ls
     * (src/plan/placement.h), empty slots included. */
    mf_moe_config_t config;
    mf_moe_info_t info;
    mf__heap_layout_t heap;
    int32_t weights_set;
    mf_moe_weights_t weights; /* borrowed */
    int32_t dispatch_T;       /* T of the dispatch whose combine is pending */
    struct mf_exchange own;   /* the exchange of mf_dispatch / mf_combine (both halves in one call) */
    uint32_t id;              /* the comm's layer number (the same on every rank): carried by syncs */
    /* Balanced EP (docs/DESIGN.md "Balanced EP"). */
    int32_t slots_per_rank;   /* Lp = P / R */
    int32_t placed;           /* 1: a mapped placement (uneven LINEAR, ROUND_ROBIN): expert_map is the
                                 placement's slot grid, fixed at create, -1 in empty slots */
    int32_t *expert_map;      /* [P] logical expert of each physical slot (identity by default) */
    int32_t map_set;          /* 1 once mf_moe_set_expert_map succeeded (needed when P != E) */
    uint32_t map_hash;        /* mf__map_hash(expert_map) */
    uint32_t weights_count;   /* mf_moe_set_weights calls so far */
    mf__sym_t spare;          /* B > 0: the spare slots of every rank (mf__spare_layout_t) */
    mf__spare_layout_t spare_layout;
    /* A staged map (mf_moe_stage_expert_map; docs/DESIGN.md "Balanced EP", rebalancing). */
    int32_t *staged_map;      /* [P] the map that serves after the switch, or NULL when none is staged */
    mf_moe_weights_t staged_weights; /* borrowed and written: this rank's slots under staged_map */
    int32_t stage_per_step;   /* n: experts each rank receives per step at most (>= 1) */
    int32_t stage_steps;      /* prefetches the stage takes (the last one switches) */
    int32_t stage_step;       /* prefetches of it done so far */
    uint32_t map_switches;    /* staged maps switched to */
    struct mf__stage_slot *stage_plan; /* [P] the schedule (src/balance/stage.h), or NULL */
    mf__sym_t stage;          /* the staging slots of every rank: [2n] experts (mf__spare_layout_t) */
    int64_t stage_bytes, stage_bytes_all, stage_local_bytes; /* moved by the last prefetch */
    mf__spare_layout_t stage_layout;
    void *backend_state;
};

/* 1 when the layer's plan runs over its expert map (the balanced plan): replicas in the map
 * (P != E), a map that was set, a mapped placement, or B > 0. 0: slot p holds expert p. */
static inline int32_t mf__moe_balanced(const struct mf_moe *m) {
    return m->config.num_physical_experts != m->config.num_experts || m->config.spare_slots > 0 || m->map_set ||
           m->placed;
}

/* Checks that every layer call shares (moe.c; balance/maps.c's calls use them too): the comm can
 * still take part in a collective; a rank's weights have the layer's shapes (`name` prefixes the
 * messages). MF_SUCCESS, or the error (the last error set). */
mf_result_t mf__check_comm_usable(mf_comm_t comm, const char *fn);
mf_result_t mf__check_weights(mf_moe_t moe, const mf_moe_weights_t *w, const char *name);

#ifdef __cplusplus
}
#endif

#endif /* MF_CORE_HANDLES_H */
