/*
 * group.c — groups and comms: creation of R ranks on a backend, their comm handles, and the host
 * barrier used by setup-time collectives.
 *
 * With the `local` transport one group holds R comms that share the peer tables
 * (group->heap_base, group->signal_base): rank r's symmetric heap is group->heap_base[r], and
 * every rank reaches every peer's heap through that table, exactly as device code will through
 * its copy of the table.
 */
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "core/internal.h"

/* ---- host barrier ------------------------------------------------------------------------- */

struct mf__host_barrier {
    pthread_mutex_t mutex;
    pthread_cond_t cond;
    int32_t count, arrived;
    uint64_t generation;
};

mf_result_t mf__host_barrier_create(struct mf__host_barrier **barrier, int32_t count) {
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

void mf__host_barrier_destroy(struct mf__host_barrier *barrier) {
    if (!barrier) return;
    pthread_cond_destroy(&barrier->cond);
    pthread_mutex_destroy(&barrier->mutex);
    mf__free(barrier);
}

mf_result_t mf__host_barrier_wait(struct mf__host_barrier *b, int64_t timeout_ms, int32_t rank,
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

/* ---- groups ------------------------------------------------------------------------------- */

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

mf_result_t mf_group_destroy(mf_group_t group) {
    mf__clear_error();
    if (!group) return MF_SUCCESS;
    if (group->comms)
        for (int32_t r = 0; r < group->num_ranks; r++)
            if (group->comms[r].ready) group->ops->comm_fini(&group->comms[r]);
    if (group->ops) group->ops->group_fini(group);
    mf__host_barrier_destroy(group->setup_barrier);
    mf__free(group->comms);
    mf__free(group);
    return MF_SUCCESS;
}

mf_result_t mf_group_create(const mf_group_config_t *config, mf_group_t *group) {
    mf__clear_error();
    if (!config || !group)
        return mf__error(MF_ERR_INVALID_ARGUMENT, "mf_group_create: config and group must not be NULL");
    if (config->size != sizeof(mf_group_config_t) || config->magic != MF_GROUP_CONFIG_MAGIC)
        return mf__error(MF_ERR_INVALID_USAGE,
                         "mf_group_create: config header is wrong (size %u, magic 0x%x); "
                         "initialise it with MF_GROUP_CONFIG_INIT",
                         config->size, config->magic);
    if (config->version != MF_API_VERSION)
        return mf__error(MF_ERR_INVALID_USAGE, "mf_group_create: config version %u, library expects %d",
                         config->version, MF_API_VERSION);
    MF_REQUIRE(config->num_ranks >= 1 && config->num_ranks <= MF_MAX_RANKS,
               "mf_group_create: num_ranks %d is outside [1, %d]", config->num_ranks, MF_MAX_RANKS);
    MF_REQUIRE(config->transport == MF_TRANSPORT_LOCAL,
               "mf_group_create: transport %d is not supported (only MF_TRANSPORT_LOCAL)", config->transport);
    MF_REQUIRE(config->backend == MF_BACKEND_CPU || config->backend == MF_BACKEND_CUDA ||
                   config->backend == MF_BACKEND_AUTO,
               "mf_group_create: backend %d is not an mf_backend_t", config->backend);
    MF_REQUIRE(config->timeout_ms >= 0, "mf_group_create: timeout_ms %lld is negative",
               (long long)config->timeout_ms);
    MF_REQUIRE(config->num_sms >= 0, "mf_group_create: num_sms %d is negative", config->num_sms);
    MF_REQUIRE(config->device >= 0, "mf_group_create: device %d is negative", config->device);

    mf_backend_t backend = (mf_backend_t)config->backend;
    if (backend == MF_BACKEND_AUTO)
        backend = mf_backend_available(MF_BACKEND_CUDA) ? MF_BACKEND_CUDA : MF_BACKEND_CPU;
    const mf__backend_ops_t *ops = mf__backend_ops(backend);
    if (!ops || !ops->available())
        return mf__error(MF_ERR_NOT_SUPPORTED, "mf_group_create: backend %s is not available in this %s",
                         backend == MF_BACKEND_CUDA ? "cuda" : "cpu",
                         MF_WITH_CUDA ? "process (no usable CUDA device)" : "build (compiled without CUDA)");

    mf_group_t g = mf__calloc(1, sizeof *g);
    if (!g) return mf__error(MF_ERR_OUT_OF_MEMORY, "mf_group_create: out of host memory");
    g->backend = backend;
    g->ops = ops;
    g->num_ranks = config->num_ranks;
    g->device = config->device;
    g->num_sms = config->num_sms;
    g->timeout_ms = config->timeout_ms ? config->timeout_ms : mf__param_timeout_ms();
    mf_result_t res;
    g->comms = mf__calloc((size_t)g->num_ranks, sizeof *g->comms);
    if (!g->comms) {
        res = mf__error(MF_ERR_OUT_OF_MEMORY, "mf_group_create: out of host memory");
        goto fail;
    }
    MF_CHECK_GOTO(mf__host_barrier_create(&g->setup_barrier, g->num_ranks), res, fail);
    MF_CHECK_GOTO(ops->group_init(g), res, fail_no_backend);
    for (int32_t r = 0; r < g->num_ranks; r++) {
        mf_comm_t c = &g->comms[r];
        c->group = g;
        c->rank = r;
        MF_CHECK_GOTO(ops->comm_init(c), res, fail);
        c->ready = 1;
    }
    *group = g;
    return MF_SUCCESS;
fail_no_backend:
    g->ops = NULL; /* group_init cleans up after itself */
fail: {
    char msg[512];
    strncpy(msg, mf_last_error(), sizeof msg - 1);
    msg[sizeof msg - 1] = '\0';
    mf_group_destroy(g);
    return mf__error(res, "%s", msg);
}
}

mf_result_t mf_group_get_comm(mf_group_t group, int32_t rank, mf_comm_t *comm) {
    mf__clear_error();
    MF_REQUIRE(group && comm, "mf_group_get_comm: group and comm must not be NULL");
    MF_REQUIRE(rank >= 0 && rank < group->num_ranks, "mf_group_get_comm: rank %d is outside [0, %d)",
               rank, group->num_ranks);
    *comm = &group->comms[rank];
    return MF_SUCCESS;
}

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
    *num_ranks = comm->group->num_ranks;
    return MF_SUCCESS;
}

mf_result_t mf_comm_get_async_error(mf_comm_t comm) {
    mf__clear_error();
    MF_REQUIRE(comm, "mf_comm_get_async_error: comm must not be NULL");
    return comm->group->ops->get_async_error(comm);
}
