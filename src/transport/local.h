/*
 * local.h — the `local` transport's host-side signals: R virtual ranks in one process reach each
 * other's signal arrays through group->signal_base. Used by the CPU backend; the CUDA backend
 * keeps the same layout in device memory and waits in its kernels.
 *
 * Signal array of one rank: [MF__NUM_PHASES][MF_MAX_RANKS] uint64 epochs; slot [p][q] holds the
 * number of times rank q has arrived at phase p. Epochs only grow: no re-zeroing between calls.
 */
#ifndef MF_TRANSPORT_LOCAL_H
#define MF_TRANSPORT_LOCAL_H

#include "core/internal.h"

#define MF__SIGNAL_COUNT ((size_t)MF__NUM_PHASES * MF_MAX_RANKS)
#define MF__SIGNAL_BYTES (MF__SIGNAL_COUNT * sizeof(uint64_t))

/* Announces this rank's arrival at `phase` for the next epoch (release: every write before this
 * call is visible to a peer that observes the signal). Returns the epoch to wait for. */
uint64_t mf__local_arrive(mf_comm_t comm, int32_t phase);

/* Waits until every rank has arrived at `phase` for `epoch` (acquire), at most the group timeout.
 * On expiry: MF_ERR_TIMEOUT naming this rank, the phase and the missing ranks; the comm is marked
 * broken. */
mf_result_t mf__local_wait(mf_comm_t comm, int32_t phase, uint64_t epoch);

#endif /* MF_TRANSPORT_LOCAL_H */
