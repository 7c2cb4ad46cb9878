/*
 * local.c — host signals of the `local` transport (see local.h): store-release of an epoch into
 * every peer's slot, and a bounded acquire-wait that yields the core while it spins, since R
 * virtual ranks may share fewer cores.
 */
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#include "transport/local.h"

static _Atomic uint64_t *mf__slot(mf_group_t g, int32_t owner, int32_t phase, int32_t from) {
    return (_Atomic uint64_t *)g->signal_base[owner] + (size_t)phase * MF_MAX_RANKS + from;
}

uint64_t mf__local_arrive(mf_comm_t comm, int32_t phase) {
    mf_group_t g = comm->group;
    uint64_t epoch = ++comm->epoch[phase];
    for (int32_t q = 0; q < g->num_ranks; q++)
        atomic_store_explicit(mf__slot(g, q, phase, comm->rank), epoch, memory_order_release);
    return epoch;
}

static double mf__now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

mf_result_t mf__local_wait(mf_comm_t comm, int32_t phase, uint64_t epoch) {
    mf_group_t g = comm->group;
    double start = mf__now_ms();
    int32_t next = 0; /* ranks below `next` have arrived */
    for (uint64_t spin = 0;; spin++) {
        while (next < g->num_ranks &&
               atomic_load_explicit(mf__slot(g, comm->rank, phase, next), memory_order_acquire) >= epoch)
            next++;
        if (next == g->num_ranks) return MF_SUCCESS;
        if (spin < 64) continue;
        if (spin < 4096) {
            sched_yield();
        } else {
            struct timespec nap = {0, 20000};
            nanosleep(&nap, NULL);
        }
        if ((spin & 63) == 0 && mf__now_ms() - start > (double)g->timeout_ms) break;
    }
    char missing[256];
    size_t used = 0;
    missing[0] = '\0';
    for (int32_t q = 0; q < g->num_ranks && used < sizeof missing; q++) {
        uint64_t seen = atomic_load_explicit(mf__slot(g, comm->rank, phase, q), memory_order_acquire);
        if (seen < epoch)
            used += (size_t)snprintf(missing + used, sizeof missing - used, "%s%d (at epoch %llu)",
                                     used ? ", " : "", q, (unsigned long long)seen);
    }
    comm->broken = 1;
    return mf__error(MF_ERR_TIMEOUT,
                     "rank %d: timed out after %lld ms in phase '%s' waiting for epoch %llu; missing "
                     "ranks: %s", comm->rank, (long long)g->timeout_ms, mf__phase_name(phase),
                     (unsigned long long)epoch, missing);
}
