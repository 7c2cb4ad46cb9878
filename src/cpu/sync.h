/*
 * sync.h — the CPU backend's synchronisation between ranks: epoch signals in every rank's
 * symmetric signal array (core/layout.h "signals"), reached through comm->signals.peers. The
 * arrays are plain host memory on the local transport and POSIX shared memory on ipc: the same
 * atomics work for threads and processes. The CUDA backend keeps the same layout in device memory
 * and waits in its kernels (src/cuda/kernels/sync.cuh).
 */
#ifndef MF_CPU_SYNC_H
#define MF_CPU_SYNC_H

#include "moeflow.h"

/* Announces this rank's arrival at `phase` for the next epoch with `status` (0, or the
 * mf_result_t of a call this rank rejected), release: every write before this call is visible to
 * a peer that observes the signal. `layer`: the id of the layer called (mf_moe.id). Returns the
 * epoch to wait for. */
uint64_t mf__cpu_arrive(mf_comm_t comm, int32_t phase, uint32_t layer, mf_result_t status);

/* Waits until every rank has arrived at `phase` for `epoch` (acquire), at most the comm timeout.
 * Then MF_SUCCESS when every arrival carried status 0 and this `layer`; else the lowest failing
 * rank's status (MF_ERR_INVALID_USAGE for a rank that called another layer) with a message naming
 * it and `what`. On expiry: MF_ERR_TIMEOUT naming this rank, the phase and the
 * missing ranks, and the comm is marked broken; MF_ERR_ABORTED when this comm or a missing peer
 * was aborted. */
mf_result_t mf__cpu_wait(mf_comm_t comm, int32_t phase, uint64_t epoch, uint32_t layer, const char *what);

/* Raises this rank's abort flag in every peer's signal array (mf_comm_abort). */
void mf__cpu_signal_abort(mf_comm_t comm);

#endif /* MF_CPU_SYNC_H */
