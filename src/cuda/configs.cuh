/*
 * configs.cuh — every compile-time limit, block size and timeout constant of the CUDA backend, in
 * one place (DeepEP's `configs` habit). Kernel files include this; nothing else defines numbers.
 */
#ifndef MF_CUDA_CONFIGS_CUH
#define MF_CUDA_CONFIGS_CUH

#include "core/internal.h"
#include "transport/local.h"

#define kMfWarp 32
#define kMfPublishThreads 256  /* publish: one block per token, warps over 128-wide blocks */
#define kMfPlanThreads 256     /* plan count / fill: one block per local expert */
#define kMfPlanPerThread 4     /* plan fill: consecutive routing entries per thread per pass */
#define kMfMoveThreads 256     /* gather / return: one warp per row, grid-stride */
#define kMfMoveBlocksPerSm 4   /* gather / return grid = SMs of this rank x this */
#define kMfSumThreads 128      /* combine sum: blocks of (token, column group), 8 columns per thread */
#define kMfSumBatch 8          /* combine sum: partials loaded together before they are added */
#define kMfWaitThreads 64      /* wait: one thread per peer (>= MF_MAX_RANKS) */
#define kMfWaitBackoffNs 64    /* __nanosleep between polls of a peer's signal */
#define kMfMaxConnections "32" /* CUDA_DEVICE_MAX_CONNECTIONS requested for virtual ranks */
#define kMfDecodeMaxRows 64    /* rows_hint <= this: the decode GEMMs and the DIRECT dataflow */

/* Own epoch counters follow the peer-written slots in every rank's signal allocation. */
#define kMfSignalWords (MF__SIGNAL_COUNT + MF__NUM_PHASES)

/* Kinds of device-raised faults (mf__device_error.kind). */
enum {
    kMfFaultTimeout = 1,  /* a peer's signal did not arrive in time */
    kMfFaultBadId = 2,    /* topk_ids value outside [-1, E): treated as -1 */
    kMfFaultDupId = 3,    /* a token repeats an expert: the later k treated as -1 */
    kMfFaultCapacity = 4  /* an expert or the receive tensor overflowed: rows past it dropped */
};

static_assert(kMfWaitThreads >= MF_MAX_RANKS, "one wait thread per peer");

#endif /* MF_CUDA_CONFIGS_CUH */
