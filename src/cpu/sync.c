/*
 * sync.c — host signals of the CPU backend (see sync.h): store-release of (epoch, status) into
 * every peer's slot, and a bounded acquire-wait that yields the core while it spins, since R ranks
 * may share fewer cores. The wait also ends on an abort: this comm's own flag, or the flag of a
 * peer it still waits for.
 */
#include <sched.h>
#include <stdio.h>
#include <time.h>

#include "core/errors.h"
#include "core/handles.h"
#include "core/layout.h"
#include "cpu/sync.h"

static uint64_t *mf__word(mf_comm_t comm, int32_t owner, size_t index) {
    return (uint64_t *)comm->signals.peers[owner] + index;
}

static uint64_t mf__slot_load(mf_comm_t comm, int32_t phase, uint64_t epoch, int32_t from) {
    return __atomic_load_n(mf__word(comm, comm->rank, MF__SIGNAL_SLOT(phase, epoch, from)), __ATOMIC_ACQUIRE);
}

uint64_t mf__cpu_arrive(mf_comm_t comm, int32_t phase, uint32_t layer, mf_result_t status) {
    uint64_t epoch = ++comm->epoch[phase];
    uint64_t value = epoch << MF__EPOCH_SHIFT | ((uint64_t)layer & MF__LAYER_MASK) << MF__STATUS_BITS |
                     ((uint64_t)status & MF__STATUS_MASK);
    for (int32_t q = 0; q < comm->num_ranks; q++)
        __atomic_store_n(mf__word(comm, q, MF__SIGNAL_SLOT(phase, epoch, comm->rank)), value, __ATOMIC_RELEASE);
    return epoch;
}

void mf__cpu_signal_abort(mf_comm_t comm) {
    for (int32_t q = 0; q < comm->num_ranks; q++)
        __atomic_store_n(mf__word(comm, q, MF__SIGNAL_ABORT + comm->rank), 1, __ATOMIC_RELEASE);
}

static double mf__now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

mf_result_t mf__cpu_wait(mf_comm_t comm, int32_t phase, uint64_t epoch, uint32_t layer, const char *what) {
    const int32_t R = comm->num_ranks;
    double start = mf__now_ms();
    int32_t next = 0; /* ranks below `next` have arrived */
    int32_t aborted_peer = -1;
    for (uint64_t spin = 0;; spin++) {
        while (next < R && mf__slot_load(comm, phase, epoch, next) >> MF__EPOCH_SHIFT >= epoch) next++;
        if (next == R) break;
        if (spin < 64) continue;
        if (spin < 4096) {
            sched_yield();
        } else {
            struct timespec nap = {0, 20000};
            nanosleep(&nap, NULL);
        }
        if ((spin & 63) != 0) continue;
        if (__atomic_load_n(&comm->aborted, __ATOMIC_ACQUIRE))
            return mf__error(MF_ERR_ABORTED, "rank %d: %s: the comm was aborted while waiting in phase '%s'",
                             comm->rank, what, mf__phase_name(phase));
        if (__atomic_load_n(mf__word(comm, comm->rank, MF__SIGNAL_ABORT + next), __ATOMIC_ACQUIRE)) {
            /* A peer that arrived and then aborted (a send half, then mf_comm_abort) did arrive: its
             * arrival was stored before its abort flag, so it shows now. */
            if (mf__slot_load(comm, phase, epoch, next) >> MF__EPOCH_SHIFT >= epoch) continue;
            aborted_peer = next;
            break;
        }
        if (mf__now_ms() - start > (double)comm->timeout_ms) break;
    }
    if (next == R) {
        /* Every rank arrived: fail together when any arrival carried a status. */
        for (int32_t q = 0; q < R; q++) {
            const uint64_t v = mf__slot_load(comm, phase, epoch, q);
            mf_result_t st = (mf_result_t)(v & MF__STATUS_MASK);
            if (st == MF_SUCCESS && MF__SLOT_LAYER(v) != (layer & MF__LAYER_MASK))
                return mf__error(MF_ERR_INVALID_USAGE, "rank %d: %s: rank %d called this collective on layer %llu, this "
                                 "rank on layer %u: every rank must call the same layers in the same order", comm->rank,
                                 what, q, (unsigned long long)MF__SLOT_LAYER(v), (unsigned)(layer & MF__LAYER_MASK));
            if (st == MF_SUCCESS) continue;
            if (q == comm->rank) return st; /* this rank's own message is already set */
            return mf__error(st, "rank %d: %s: rank %d failed this call (%s); every rank fails it, nothing was "
                                 "written", comm->rank, what, q, mf_result_string(st));
        }
        return MF_SUCCESS;
    }
    comm->broken = 1;
    if (aborted_peer >= 0)
        return mf__error(MF_ERR_ABORTED, "rank %d: %s: rank %d was aborted while this rank waited for it in phase '%s'",
                         comm->rank, what, aborted_peer, mf__phase_name(phase));
    char missing[256];
    size_t used = 0;
    missing[0] = '\0';
    for (int32_t q = 0; q < R && used < sizeof missing; q++) {
        uint64_t seen = mf__slot_load(comm, phase, epoch, q) >> MF__EPOCH_SHIFT;
        if (seen < epoch)
            used += (size_t)snprintf(missing + used, sizeof missing - used, "%s%d (at epoch %llu)",
                                     used ? ", " : "", q, (unsigned long long)seen);
    }
    return mf__error(MF_ERR_TIMEOUT,
                     "rank %d: %s: timed out after %lld ms in phase '%s' waiting for epoch %llu; missing "
                     "ranks: %s", comm->rank, what, (long long)comm->timeout_ms, mf__phase_name(phase),
                     (unsigned long long)epoch, missing);
}
