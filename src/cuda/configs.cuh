/*
 * configs.cuh — the compile-time limits, block sizes, timeouts and constants of the CUDA backend, in
 * one place (DeepEP's `configs` habit): here the data movement and synchronisation (publish, plan,
 * gather / return, combine sum, peer waits), the decode-rows threshold that picks the GEMM family
 * and the dataflow, and the kinds of device faults; and, through cuda/gemm_configs.cuh (included
 * below), every limit, size and timeout of the expert GEMMs (threads and register splits, tile,
 * stage and K-block sizes, expert-table sizes, the mbarrier-wait bounds kWaitTimeoutNs = 20 s and
 * MF__SM90_WAIT_TIMEOUT_NS = 4 s, launcher device tables and pointer alignments, the benchmark
 * filler's launch shape). Kernel files include this or gemm_configs.cuh. Limits shared with the
 * host (default block_m, heap and row alignments, BF16 vector width) are in core/layout.h.
 */
#ifndef MF_CUDA_CONFIGS_CUH
#define MF_CUDA_CONFIGS_CUH

#include "core/layout.h"
#include "cuda/gemm_configs.cuh"

#define kMfWarp 32
#define kMfPublishThreads 256  /* publish: one block per token, warps over 128-wide blocks */
#define kMfPlanThreads 256     /* plan fetch (grid 8 x R), offsets (one block), fill (one block per local expert) */
#define kMfPlanPerThread 4     /* plan fill: consecutive routing entries per thread per pass */
#define kMfPlanFetchBlocks 8   /* plan fetch: blocks per rank copying its routing */
#define kMfPlanSmemExperts 8192 /* plan fetch: experts counted in shared memory (more: global atomics) */
#define kMfPlanSmallThreads 512 /* the small plan (sync + plan in one block, movement.cuh) */
#define kMfPlanSmallEntries 4096 /* the small plan: R T K routing entries at most (this rank's T) */
#define kMfPlanSmallExperts 1024 /* the small plan: E at most (counts in shared memory) */
#define kMfPlanSmallLocal 512   /* the small plan: local experts L at most (kimi-k2 at R = 1: 384) */
#define kMfMaxWarps 32          /* warps of a 1024-thread block */
#define kMfMoveThreads 256     /* gather / return: one warp per row, grid-stride */
#define kMfMoveBlocksPerSm 4   /* gather / return grid = SMs of this rank x this */
#define kMfSumThreads 128      /* combine sum: blocks of (token, column group), 8 columns per thread */
#define kMfSumBatch 8          /* combine sum: partials loaded together before they are added */
#define kMfWaitThreads 64      /* wait: one thread per peer (>= MF_MAX_RANKS) */
#define kMfWaitBackoffNs 64    /* __nanosleep between polls of a peer's signal */
#define kMfDecodeMaxRows 64    /* rows_hint <= this: the decode GEMMs and the DIRECT dataflow */
#define kMfPushThreads 256     /* prefetch push: 16-byte copies of one spare slot's weights */
#define kMfPrefetchMaxSmem (200 * 1024) /* prefetch pick: its planner's arrays in shared memory, at most */
#define kMfPushBlocks 16       /* prefetch push: blocks per spare slot of the group (grid y = R * B) */

/* Kinds of device-raised faults (mf__device_error.kind). */
enum {
    kMfFaultTimeout = 1,  /* a peer's signal did not arrive in time */
    kMfFaultBadId = 2,    /* topk_ids value outside [-1, E) */
    kMfFaultDupId = 3,    /* a token repeats an expert */
    kMfFaultCapacity = 4, /* an expert (MASKED) or a rank's receive tensor (EXPERT_MAJOR) would overflow */
    kMfFaultAborted = 5,  /* mf_comm_abort on this rank, or on the peer waited for */
    kMfFaultPeer = 6,     /* another rank failed the call (its fault or its host's rejection) */
    kMfFaultRejected = 7, /* this rank's host rejected the call's input */
    kMfFaultLayer = 8,    /* ranks called the collective on different layers */
    kMfFaultBalance = 9   /* ranks differ in expert map, prefetch count or weights count (heap meta) */
};

/* Virtual ranks of one process on one device: CUDA gives a process at most 32 hardware queues
 * (CUDA_DEVICE_MAX_CONNECTIONS); a rank whose stream shares a queue with a peer's can wait forever
 * behind that peer's spinning kernel (R = 64 timed out on the H200), so a comm refuses more. */
#define kMfMaxVirtualRanksPerDevice 32

static_assert(kMfWaitThreads >= MF_MAX_RANKS, "one wait thread per peer");

#endif /* MF_CUDA_CONFIGS_CUH */
