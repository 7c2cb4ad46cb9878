/*
 * group.c — comms and groups. mf_comm_init makes one rank: it meets its peers over the bootstrap,
 * checks that they agree (ranks, backend, transport, heap), resolves the transport, and maps every
 * rank's signals (and heap, when declared) through the transport's symmetric allocation, so that
 * the comm holds the peer tables the data path uses. mf_group_create makes R virtual ranks of
 * this process on R threads through that same path, with an in-process allgather (the group's
 * host barrier) as the bootstrap.
 */
#define _GNU_SOURCE /* gethostname, getpid */
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/alloc.h"
#include "core/backend.h"
#include "core/config.h"
#include "core/errors.h"
#include "core/handles.h"
#include "core/layout.h"
#include "core/params.h"
#include "transport/transport.h"

/* ---- host barrier ------------------------------------------------------------------------- */

struct mf__host_barrier {
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    int32_t count, arrived;
    uint64_t generation;
};

static mf_result_t mf__host_barrier_create(struct mf__host_barrier **barrier, int32_t count) {
    struct mf__host_barrier *b = mf__calloc(1, sizeof *b);
    if (!b) return mf__error(MF_ERR_OUT_OF_MEMORY, "host barrier: out of memory");
    pthread_condattr_t attr;
    if (pthread_mutex_init(&b->mutex, NULL) != 0) {
        mf__free(b);
        return mf__error(MF_ERR_SYSTEM, "host barrier: pthread_mutex_init failed");
    }
    if (pthread_condattr_init(&attr) != 0 || pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) != 0 ||
        pthread_cond_init(&b->cond, &attr) != 0) {
        pthread_mutex_destroy(&b->mutex);
        mf__free(b);
        return mf__error(MF_ERR_SYSTEM, "host barrier: pthread_cond_init failed");
    }
    pthread_condattr_destroy(&attr);
    b->count = count;
    *barrier = b;
    return MF_SUCCESS;
}

static void mf__host_barrier_destroy(struct mf__host_barrier *barrier) {
    if (!barrier) return;
    pthread_cond_destroy(&barrier->cond);
    pthread_mutex_destroy(&barrier->mutex);
    mf__free(barrier);
}

/* Waits until `count` threads arrived or `timeout_ms` passed (MF_ERR_TIMEOUT naming `what`). */
static mf_result_t mf__host_barrier_wait(struct mf__host_barrier *b, int64_t timeout_ms, int32_t rank,
                                         const char *what) {
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += timeout_ms / 1000;
    deadline.tv_nsec += (timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec += 1;
        deadline.tv_nsec -= 1000000000L;
    }
    mf_result_t res = MF_SUCCESS;
    pthread_mutex_lock(&b->mutex);
    uint64_t gen = b->generation;
    if (++b->arrived == b->count) {
        b->arrived = 0;
        b->generation++;
        pthread_cond_broadcast(&b->cond);
    } else {
        while (gen == b->generation) {
            int rc = pthread_cond_timedwait(&b->cond, &b->mutex, &deadline);
            if (rc == ETIMEDOUT && gen == b->generation) {
                int32_t missing = b->count - b->arrived;
                b->arrived--; /* leave the barrier consistent for whoever still waits */
                res = mf__error(MF_ERR_TIMEOUT,
                                "rank %d: timed out after %lld ms in %s: %d of %d ranks never arrived",
                                rank, (long long)timeout_ms, what, missing, b->count);
                break;
            }
        }
    }
    pthread_mutex_unlock(&b->mutex);
    return res;
}

/* ---- comms --------------------------------------------------------------------------------- */

static const mf__backend_ops_t *mf__backend_ops(mf_backend_t backend) {
#if MF_WITH_CUDA
    if (backend == MF_BACKEND_CUDA) return &mf__cuda_backend;
#endif
    return backend == MF_BACKEND_CPU ? &mf__cpu_backend : NULL;
}

int32_t mf_backend_available(mf_backend_t backend) {
    if (backend == MF_BACKEND_AUTO) return 1;
    const mf__backend_ops_t *ops = mf__backend_ops(backend);
    return ops && ops->available() ? 1 : 0;
}

static const char *mf__transport_name(int32_t t) {
    switch (t) {
    case MF_TRANSPORT_LOCAL: return "local";
    case MF_TRANSPORT_IPC: return "ipc";
    case MF_TRANSPORT_NCCL: return "nccl";
    case MF_TRANSPORT_AUTO: return "auto";
    default: return "unknown";
    }
}

/* What every rank tells the others at mf_comm_init (one allgather). */
typedef struct mf__rank_info {
    int32_t status; /* mf_result_t of this rank's steps before the exchange */
    int32_t rank, num_ranks, backend, transport, api_version;
    int64_t heap_bytes;
    int64_t pid;
    char host[64];   /* hostname + boot id: ranks on the same machine (and kernel boot) */
    char device[64]; /* the backend's device id ("" on CPU) */
} mf__rank_info_t;

static void mf__host_id(char id[64]) {
    char name[32] = "", boot[40] = "";
    if (gethostname(name, sizeof name - 1) != 0) name[0] = '\0';
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof boot, f)) boot[0] = '\0';
        fclose(f);
    }
    boot[strcspn(boot, "\n")] = '\0';
    snprintf(id, 64, "%.31s/%.31s", name, boot);
}

/* Checks the gathered table; every rank reaches the same verdict from the same table. */
static mf_result_t mf__check_infos(mf_comm_t comm, const mf__rank_info_t *info, int32_t requested) {
    const char *fn = "mf_comm_init";
    const int32_t R = comm->num_ranks;
    for (int32_t q = 0; q < R; q++)
        if (info[q].status != MF_SUCCESS)
            return mf__error((mf_result_t)info[q].status, "rank %d: %s: rank %d failed before the exchange (%s)",
                             comm->rank, fn, q, mf_result_string((mf_result_t)info[q].status));
    for (int32_t q = 0; q < R; q++) {
        const mf__rank_info_t *a = &info[q], *z = &info[0];
        MF_REQUIRE(a->rank == q, "%s: the bootstrap's block %d came from a rank that calls itself %d (two ranks with "
                   "the same rank, or a bootstrap that does not order blocks by rank)", fn, q, a->rank);
        MF_REQUIRE(a->num_ranks == z->num_ranks && a->api_version == z->api_version,
                   "%s: rank %d says num_ranks %d (API %d), rank 0 says %d (API %d)", fn, q, a->num_ranks,
                   a->api_version, z->num_ranks, z->api_version);
        MF_REQUIRE(a->backend == z->backend, "%s: rank %d resolved the backend to %d, rank 0 to %d; every rank must "
                   "use the same backend", fn, q, a->backend, z->backend);
        MF_REQUIRE(a->transport == z->transport, "%s: rank %d asks for transport %s, rank 0 for %s", fn, q,
                   mf__transport_name(a->transport), mf__transport_name(z->transport));
        MF_REQUIRE(a->heap_bytes == z->heap_bytes, "%s: rank %d declares heap_bytes %lld, rank 0 %lld; the heap is "
                   "symmetric", fn, q, (long long)a->heap_bytes, (long long)z->heap_bytes);
    }
    int32_t one_process = 1, one_host = 1;
    comm->ranks_on_device = 0;
    for (int32_t q = 0; q < R; q++) {
        one_process &= info[q].pid == info[0].pid && strcmp(info[q].host, info[0].host) == 0;
        one_host &= strcmp(info[q].host, info[0].host) == 0;
        comm->ranks_on_device += strcmp(info[q].host, info[comm->rank].host) == 0 &&
                                 strcmp(info[q].device, info[comm->rank].device) == 0;
    }
    int32_t t = requested;
    if (t == MF_TRANSPORT_AUTO) t = one_process ? MF_TRANSPORT_LOCAL : MF_TRANSPORT_IPC;
    if (t == MF_TRANSPORT_LOCAL && !one_process)
        return mf__error(MF_ERR_INVALID_ARGUMENT, "%s: transport local needs every rank in one process; these ranks "
                         "run in several (use MF_TRANSPORT_IPC or AUTO)", fn);
    if (t == MF_TRANSPORT_IPC && !one_host)
        return mf__error(MF_ERR_NOT_SUPPORTED, "%s: transport ipc needs every rank on one host; ranks across hosts "
                         "need MF_TRANSPORT_NCCL", fn);
    if (t == MF_TRANSPORT_IPC && one_process && R > 1 && comm->backend == MF_BACKEND_CUDA)
        return mf__error(MF_ERR_INVALID_ARGUMENT, "%s: transport ipc maps CUDA memory between processes, and these "
                         "ranks share one process (use MF_TRANSPORT_LOCAL or AUTO)", fn);
    comm->transport = (mf_transport_t)t;
    return MF_SUCCESS;
}

static const mf__transport_ops_t *mf__transport_ops(mf_comm_t comm) {
    switch (comm->transport) {
    case MF_TRANSPORT_LOCAL: return &mf__transport_local;
#if MF_WITH_CUDA
    case MF_TRANSPORT_NCCL: return &mf__transport_nccl;
#endif
    default: return &mf__transport_ipc;
    }
}

/* Frees what mf__comm_setup made. `peers_done`: no peer uses this rank's memory any more. */
static void mf__comm_free(mf_comm_t c) {
    if (!c) return;
    if (c->backend_state) c->ops->comm_fini(c);
    if (c->tops) {
        c->tops->sym_free(c, &c->heap);
        c->tops->sym_free(c, &c->signals);
    }
    while (c->deferred) { /* transport/local.c: what a broken comm's layers freed */
        mf__deferred_free_t *d = c->deferred;
        c->deferred = d->next;
        c->ops->mem_free(c, d->ptr);
        mf__free(d);
    }
    if (c->bootstrap.destroy) c->bootstrap.destroy(c->bootstrap.ctx);
    mf__free(c);
}

/* The one path of every comm: validation, the exchange, the transport's allocations. On failure
 * everything is freed (the bootstrap too, when it is the comm's), *out untouched. */
static mf_result_t mf__comm_setup(const mf_comm_config_t *config, int32_t rank, int32_t num_ranks,
                                  const mf_bootstrap_t *bootstrap, struct mf_group *group, mf_comm_t *out) {
    const char *fn = "mf_comm_init";
    mf_bootstrap_t boot = {0};
    if (bootstrap) boot = *bootstrap;
    mf__rank_info_t mine, info[MF_MAX_RANKS];
    memset(&mine, 0, sizeof mine);
    mf_comm_t c = mf__calloc(1, sizeof *c);
    if (!c) {
        /* Still meet the peers once, with the failure, so that none waits for this rank. */
        mine.status = MF_ERR_OUT_OF_MEMORY;
        mine.rank = rank;
        if (num_ranks > 1) (void)boot.allgather(boot.ctx, &mine, info, sizeof mine);
        if (boot.destroy) boot.destroy(boot.ctx);
        return mf__error(MF_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    }
    c->bootstrap = boot;
    c->rank = rank;
    c->num_ranks = num_ranks;
    c->group = group;
    c->device = config->device;
    c->num_sms = config->num_sms;
    c->timeout_ms = mf__timeout_or_default(config->timeout_ms);
    c->heap_declared = (size_t)config->heap_bytes;
    c->nccl_comm = config->nccl_comm;

    /* Local steps; their status travels in the exchange, so that no rank waits for one that
     * already gave up. */
    mf_result_t res = MF_SUCCESS;
    mf_backend_t backend = (mf_backend_t)config->backend;
    if (backend == MF_BACKEND_AUTO)
        backend = mf_backend_available(MF_BACKEND_CUDA) ? MF_BACKEND_CUDA : MF_BACKEND_CPU;
    c->backend = backend;
    c->ops = mf__backend_ops(backend);
    if (!c->ops || !c->ops->available())
        res = mf__error(MF_ERR_NOT_SUPPORTED, "%s: backend %s is not available in this %s", fn,
                        backend == MF_BACKEND_CUDA ? "cuda" : "cpu",
                        MF_WITH_CUDA ? "process (no usable CUDA device)" : "build (compiled without CUDA)");
    if (res == MF_SUCCESS) res = c->ops->device_id(c, mine.device);
    char keep[512];
    snprintf(keep, sizeof keep, "%s", mf_last_error());
    mine.status = res;
    mine.rank = rank;
    mine.num_ranks = num_ranks;
    mine.backend = backend;
    mine.transport = config->transport;
    mine.api_version = MF_API_VERSION;
    mine.heap_bytes = config->heap_bytes;
    mine.pid = (int64_t)getpid();
    mf__host_id(mine.host);

    mf_result_t xres = mf__allgather(c, &mine, info, sizeof mine, fn);
    if (res != MF_SUCCESS) { /* this rank's own failure first, in its own words */
        mf__comm_free(c);
        return mf__error(res, "%s", keep);
    }
    if (xres == MF_SUCCESS) xres = mf__check_infos(c, info, config->transport);
    if (xres != MF_SUCCESS) goto fail;
    c->tops = mf__transport_ops(c);
    /* Per-rank state (CUDA: fault words, num_sms from ranks_on_device), then the signals and, if
     * declared, the heap: every step agreed, so all ranks stop at the same one. */
    MF_CHECK_GOTO(mf__agree(c, c->ops->comm_init(c), fn), xres, fail);
    c->default_sms = c->num_sms;
    MF_CHECK_GOTO(c->tops->sym_alloc(c, MF__SIGNAL_BYTES, &c->signals), xres, fail);
    if (c->heap_declared) MF_CHECK_GOTO(c->tops->sym_alloc(c, c->heap_declared, &c->heap), xres, fail);
    *out = c;
    return MF_SUCCESS;
fail:
    snprintf(keep, sizeof keep, "%s", mf_last_error());
    mf__comm_free(c);
    return mf__error(xres, "%s", keep);
}

/* Checks a config already in the current layout (mf__read_config). */
static mf_result_t mf__check_comm_config(const mf_comm_config_t *config, int32_t rank, int32_t num_ranks) {
    const char *fn = "mf_comm_init";
    MF_REQUIRE(num_ranks >= 1 && num_ranks <= MF_MAX_RANKS, "%s: num_ranks %d is outside [1, %d]", fn, num_ranks,
               MF_MAX_RANKS);
    MF_REQUIRE(rank >= 0 && rank < num_ranks, "%s: rank %d is outside [0, num_ranks = %d)", fn, rank, num_ranks);
    MF_REQUIRE(config->backend == MF_BACKEND_CPU || config->backend == MF_BACKEND_CUDA ||
                   config->backend == MF_BACKEND_AUTO,
               "%s: backend %d is not an mf_backend_t", fn, config->backend);
    MF_REQUIRE(config->transport >= MF_TRANSPORT_LOCAL && config->transport <= MF_TRANSPORT_AUTO,
               "%s: transport %d is not an mf_transport_t", fn, config->transport);
    MF_REQUIRE(config->timeout_ms >= 0, "%s: timeout_ms %lld is negative", fn, (long long)config->timeout_ms);
    MF_REQUIRE(config->heap_bytes >= 0, "%s: heap_bytes %lld is negative", fn, (long long)config->heap_bytes);
    MF_REQUIRE(config->num_sms >= 0, "%s: num_sms %d is negative", fn, config->num_sms);
    MF_REQUIRE(config->device >= 0, "%s: device %d is negative", fn, config->device);
    return MF_SUCCESS;
}

mf_result_t mf_comm_init(const mf_comm_config_t *config, int32_t rank, int32_t num_ranks,
                         const mf_bootstrap_t *bootstrap, mf_comm_t *comm) {
    mf__clear_error();
    const char *fn = "mf_comm_init";
    mf_result_t res = MF_SUCCESS;
    mf_bootstrap_t boot = {0};
    if (bootstrap) boot = *bootstrap;
    mf_comm_config_t cfg;
    if (!config || !comm) res = mf__error(MF_ERR_INVALID_ARGUMENT, "%s: config and comm must not be NULL", fn);
    if (res == MF_SUCCESS)
        res = mf__read_config(config, sizeof cfg, sizeof cfg, MF_COMM_CONFIG_MAGIC, fn, "MF_COMM_CONFIG_INIT", &cfg);
    if (res == MF_SUCCESS) config = &cfg, res = mf__check_comm_config(config, rank, num_ranks);
#if MF_WITH_CUDA
    if (res == MF_SUCCESS && config->transport == MF_TRANSPORT_NCCL) {
        /* The engine's ncclComm carries the bootstrap; its rank and size must be the caller's. */
        int32_t nrank = -1, nranks = -1, ndev = -1;
        if (!config->nccl_comm) res = mf__error(MF_ERR_INVALID_ARGUMENT, "%s: transport nccl needs config->nccl_comm", fn);
        if (res == MF_SUCCESS && !bootstrap) res = mf__nccl_bootstrap(config->nccl_comm, &boot, &nrank, &nranks, &ndev);
        if (res == MF_SUCCESS && !bootstrap && (nrank != rank || nranks != num_ranks))
            res = mf__error(MF_ERR_INVALID_ARGUMENT, "%s: the ncclComm is rank %d of %d, the call says %d of %d", fn,
                            nrank, nranks, rank, num_ranks);
    }
#else
    if (res == MF_SUCCESS && config->transport == MF_TRANSPORT_NCCL)
        res = mf__error(MF_ERR_NOT_SUPPORTED, "%s: transport nccl needs a CUDA build", fn);
#endif
    if (res == MF_SUCCESS && (!boot.allgather && num_ranks > 1))
        res = mf__error(MF_ERR_INVALID_ARGUMENT, "%s: bootstrap (with its allgather) must not be NULL when num_ranks > 1", fn);
    if (res != MF_SUCCESS) {
        if (boot.destroy) boot.destroy(boot.ctx); /* the comm owned it, also on failure */
        return res;
    }
    return mf__comm_setup(config, rank, num_ranks, &boot, NULL, comm);
}

mf_result_t mf_comm_abort(mf_comm_t comm) {
    mf__clear_error();
    MF_REQUIRE(comm, "mf_comm_abort: comm must not be NULL");
    __atomic_store_n(&comm->aborted, 1, __ATOMIC_RELEASE);
    if (comm->ops && comm->signals.local) comm->ops->abort(comm);
    return MF_SUCCESS;
}

mf_result_t mf_comm_destroy(mf_comm_t comm) {
    mf__clear_error();
    if (!comm) return MF_SUCCESS;
    if (comm->group)
        return mf__error(MF_ERR_INVALID_USAGE, "mf_comm_destroy: rank %d belongs to an mf_group_t; mf_group_destroy "
                         "destroys it", comm->rank);
    mf_result_t res = MF_SUCCESS;
    /* No peer may still read or write this rank's memory: meet first, unless the group is gone. */
    if (!comm->broken && !__atomic_load_n(&comm->aborted, __ATOMIC_ACQUIRE) && !comm->bootstrap_failed)
        res = mf__barrier(comm, "mf_comm_destroy");
    mf__comm_free(comm);
    return res;
}

mf_result_t mf_comm_get_transport(mf_comm_t comm, mf_transport_t *transport) {
    mf__clear_error();
    MF_REQUIRE(comm && transport, "mf_comm_get_transport: comm and transport must not be NULL");
    *transport = comm->transport;
    return MF_SUCCESS;
}

mf_result_t mf_comm_set_num_sms(mf_comm_t comm, int32_t num_sms) {
    const char *fn = "mf_comm_set_num_sms";
    mf__clear_error();
    MF_REQUIRE(comm, "%s: comm must not be NULL", fn);
    MF_REQUIRE(num_sms >= 0, "%s: num_sms %d is negative", fn, num_sms);
    if (num_sms == 0) num_sms = comm->default_sms;
    MF_REQUIRE(!comm->device_sms || num_sms <= comm->device_sms, "%s: num_sms %d exceeds the device's %d SMs", fn,
               num_sms, comm->device_sms);
    /* Virtual ranks on one GPU: every rank's waiting kernels must be resident at once. */
    const int32_t share = comm->device_sms / (comm->ranks_on_device > 0 ? comm->ranks_on_device : 1);
    MF_REQUIRE(!comm->device_sms || comm->transport != MF_TRANSPORT_LOCAL || comm->ranks_on_device <= 1 ||
                   num_sms <= share,
               "%s: num_sms %d exceeds this rank's share of device %d (%d SMs / %d virtual ranks = %d)", fn, num_sms,
               comm->device, comm->device_sms, comm->ranks_on_device, share);
    comm->num_sms = num_sms;
    return MF_SUCCESS;
}

mf_result_t mf_comm_get_num_sms(mf_comm_t comm, int32_t *num_sms) {
    mf__clear_error();
    MF_REQUIRE(comm && num_sms, "mf_comm_get_num_sms: comm and num_sms must not be NULL");
    *num_sms = comm->num_sms;
    return MF_SUCCESS;
}

/* ---- groups: R virtual ranks of this process ------------------------------------------------- */

struct mf__group_rank {
    struct mf_group *group;
    int32_t rank;
    const mf_comm_config_t *config; /* mf_group_create's: valid while the comms are made */
    mf_result_t result;
    char error[512];
    pthread_t thread;
};

/* The in-process allgather: each rank posts its block, everyone copies every block, and a second
 * barrier keeps the blocks alive until all have copied. */
static int32_t mf__group_allgather(void *ctx, const void *send, void *recv, size_t bytes) {
    struct mf__group_rank *me = ctx;
    struct mf_group *g = me->group;
    g->send[me->rank] = send;
    if (mf__host_barrier_wait(g->barrier, g->timeout_ms, me->rank, "the group's allgather") != MF_SUCCESS) return 1;
    for (int32_t q = 0; q < g->num_ranks; q++) memcpy((uint8_t *)recv + (size_t)q * bytes, g->send[q], bytes);
    return mf__host_barrier_wait(g->barrier, g->timeout_ms, me->rank, "the group's allgather") != MF_SUCCESS;
}

static void *mf__group_rank_main(void *arg) {
    struct mf__group_rank *me = arg;
    mf_bootstrap_t boot = {mf__group_allgather, me, NULL};
    me->result = mf__comm_setup(me->config, me->rank, me->group->num_ranks, &boot, me->group,
                                &me->group->comms[me->rank]);
    snprintf(me->error, sizeof me->error, "%s", mf_last_error());
    return NULL;
}

mf_result_t mf_group_destroy(mf_group_t group) {
    mf__clear_error();
    if (!group) return MF_SUCCESS;
    /* The contract: no rank is inside a call, so no peer uses any memory: no meeting needed. */
    for (int32_t r = 0; group->comms && r < group->num_ranks; r++) mf__comm_free(group->comms[r]);
    mf__host_barrier_destroy(group->barrier);
    mf__free(group->comms);
    mf__free(group->ranks);
    mf__free(group);
    return MF_SUCCESS;
}

mf_result_t mf_group_create(const mf_group_config_t *config, mf_group_t *group) {
    mf__clear_error();
    const char *fn = "mf_group_create";
    if (!config || !group) return mf__error(MF_ERR_INVALID_ARGUMENT, "%s: config and group must not be NULL", fn);
    /* Version 1 (moeflow 0.1) ended before heap_bytes. */
    mf_group_config_t gcfg;
    MF_CHECK(mf__read_config(config, sizeof gcfg, offsetof(mf_group_config_t, heap_bytes), MF_GROUP_CONFIG_MAGIC, fn,
                             "MF_GROUP_CONFIG_INIT", &gcfg));
    config = &gcfg;
    MF_REQUIRE(config->transport == MF_TRANSPORT_LOCAL,
               "%s: transport %d: a group is R virtual ranks of one process (MF_TRANSPORT_LOCAL); for one rank per "
               "process use mf_comm_init", fn, config->transport);
    mf_comm_config_t cc = MF_COMM_CONFIG_INIT;
    cc.backend = config->backend;
    cc.transport = MF_TRANSPORT_LOCAL;
    cc.device = config->device;
    cc.num_sms = config->num_sms;
    cc.timeout_ms = config->timeout_ms;
    cc.heap_bytes = config->heap_bytes;
    MF_CHECK(mf__check_comm_config(&cc, 0, config->num_ranks));
    const int32_t R = config->num_ranks;

    mf_group_t g = mf__calloc(1, sizeof *g);
    mf_result_t res = MF_SUCCESS;
    if (!g) return mf__error(MF_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    g->num_ranks = R;
    g->timeout_ms = mf__timeout_or_default(config->timeout_ms);
    g->comms = mf__calloc((size_t)R, sizeof *g->comms);
    g->ranks = mf__calloc((size_t)R, sizeof *g->ranks);
    if (!g->comms || !g->ranks) {
        res = mf__error(MF_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
        goto fail;
    }
    MF_CHECK_GOTO(mf__host_barrier_create(&g->barrier, R), res, fail);
    int32_t started = 0;
    for (; started < R; started++) {
        struct mf__group_rank *me = &g->ranks[started];
        me->group = g;
        me->rank = started;
        me->config = &cc;
        if (pthread_create(&me->thread, NULL, mf__group_rank_main, me) != 0) break;
    }
    for (int32_t r = 0; r < started; r++) pthread_join(g->ranks[r].thread, NULL);
    if (started < R) {
        /* The started ranks waited for the others at their first allgather until the timeout. */
        res = mf__error(MF_ERR_SYSTEM, "%s: could not start the thread of rank %d", fn, started);
        goto fail;
    }
    for (int32_t r = 0; r < R; r++)
        if (g->ranks[r].result != MF_SUCCESS) {
            res = mf__error(g->ranks[r].result, "%s", g->ranks[r].error);
            goto fail;
        }
    g->backend = g->comms[0]->backend;
    *group = g;
    return MF_SUCCESS;
fail: {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", mf_last_error());
    mf_group_destroy(g);
    return mf__error(res, "%s", msg);
}
}

mf_result_t mf_group_get_comm(mf_group_t group, int32_t rank, mf_comm_t *comm) {
    mf__clear_error();
    MF_REQUIRE(group && comm, "mf_group_get_comm: group and comm must not be NULL");
    MF_REQUIRE(rank >= 0 && rank < group->num_ranks, "mf_group_get_comm: rank %d is outside [0, %d)",
               rank, group->num_ranks);
    *comm = group->comms[rank];
    return MF_SUCCESS;
}

/* The getters are alike on purpose (as mf_moe_get_info, core/moe.c): each is one public function that
 * checks its handles, names itself in its error and copies one field; a shared helper would save nothing. */
mf_result_t mf_group_get_backend(mf_group_t group, mf_backend_t *backend) {
    mf__clear_error();
    MF_REQUIRE(group && backend, "mf_group_get_backend: group and backend must not be NULL");
    *backend = group->backend;
    return MF_SUCCESS;
}

mf_result_t mf_comm_get_rank(mf_comm_t comm, int32_t *rank) {
    mf__clear_error();
    MF_REQUIRE(comm && rank, "mf_comm_get_rank: comm and rank must not be NULL");
    *rank = comm->rank;
    return MF_SUCCESS;
}

mf_result_t mf_comm_get_size(mf_comm_t comm, int32_t *num_ranks) {
    mf__clear_error();
    MF_REQUIRE(comm && num_ranks, "mf_comm_get_size: comm and num_ranks must not be NULL");
    *num_ranks = comm->num_ranks;
    return MF_SUCCESS;
}

mf_result_t mf_comm_get_async_error(mf_comm_t comm) {
    mf__clear_error();
    MF_REQUIRE(comm, "mf_comm_get_async_error: comm must not be NULL");
    return comm->ops->get_async_error(comm);
}
