/*
 * gemm_configs.cuh — every compile-time limit, size and timeout of the CUDA backend's expert GEMMs,
 * in one place (included by cuda/configs.cuh, by kernels/sm90_ptx.cuh and by each GEMM kernel
 * header): warpgroup and swizzle sizes and the default pipeline-wait bound of the sm90 PTX layer;
 * per kernel family (namespace) its threads and register split, tile, box, stage and K-block sizes,
 * shared-memory limits, expert-table sizes, TMA coordinate limit and mbarrier-wait bound; its
 * launcher's device-table size and pointer alignments; the benchmark filler's launch shape.
 *
 * What stays with the code: template parameters (tokens per decode tile, FP8/BF16, epilogue), the
 * shared-memory maps derived from these sizes (kOff*, kSmemBytes: their layout is the kernel's),
 * named-barrier and fault-tag ids, and the static_asserts that tie a kernel to these numbers.
 * Host-shared limits (block_m, heap and row alignments, the BF16 vector width, the FP8 scale block
 * MF__QUANT_BLOCK) are in core/layout.h and core/numerics.h; kMfDecodeMaxRows, the rows_hint
 * bound below which mf__gemm_choose (grouped_gemm.cu) picks the decode family and with it the
 * DIRECT dataflow, is in cuda/configs.cuh.
 *
 * Families: mf__decode (kernels/sm90_decode_gemm.cuh, gemm_decode.cu: weights as the wgmma A
 * operand, T <= 64 tokens per tile), mf__small (kernels/sm90_small_gemm.cuh, gemm_small.cu: the decode
 * kernels' W13 and W2 in one launch, 8 tokens per tile) and mf__tma (kernels/sm90_tma_gemm.cuh, gemm_tma.cu: 128-row
 * tiles), both on the shared sm90 core mf__sm90 (kernels/sm90_core.cuh: the thread roles and
 * register split, box and K-block sizes, the wait bound, which both namespaces import); mf__gemm
 * (kernels/sm90_grouped_gemm.cuh, grouped_gemm.cu: the mma.sync fallback, v1).
 * Changing a number here changes kernels: validate with the labs (make test-gpu) and re-measure.
 */
#ifndef MF_CUDA_GEMM_CONFIGS_CUH
#define MF_CUDA_GEMM_CONFIGS_CUH

#include <stdint.h>

/* ---- the sm90 PTX layer (kernels/sm90_ptx.cuh) -------------------------------------------------- */

#ifndef MF__SM90_WAIT_TIMEOUT_NS
#define MF__SM90_WAIT_TIMEOUT_NS 4000000000ull /* 4 s: no healthy wait in a GEMM comes near it */
#endif
static constexpr uint64_t kMfSm90WaitTimeoutNs = MF__SM90_WAIT_TIMEOUT_NS;
static constexpr int kMfWarpgroupThreads = 128;
static constexpr int kMfSwizzleBytes = 128;      /* row length of a 128B-swizzled tile */
static constexpr int kMfSwizzleAtomBytes = 1024; /* 8 rows x 128 B: alignment of such a tile */

/* ---- every launcher (cuda/gemm_family.cuh, grouped_gemm.cu) --------------------------------------- */

static constexpr int kMfGemmMaxDevices = 64;  /* per-device tables of the launchers */
static constexpr int kMfGemmMaxVariants = 62; /* variants of one family: one usable bit each */
static constexpr int kMfGemmDataAlign = 16;   /* operand rows and bases: TMA, cp.async, 16-byte stores */
static constexpr int kMfGemmScaleAlign = 4;   /* FP8 scales: 4-byte cp.async */
static constexpr int32_t kMfGemmMaxRowCoord = 0x7fffffff; /* int32 TMA coordinates: weight rows L N, tile indices */

/* ---- the sm90 core both families share (kernels/sm90_core.cuh) ----------------------------------- */

namespace mf__sm90 {

constexpr int kThreads = 3 * kMfWarpgroupThreads;         /* WG 0 producer, WG 1-2 consumers */
constexpr int kConsumerThreads = 2 * kMfWarpgroupThreads;
constexpr int kConsumerWarps = kConsumerThreads / 32;
constexpr int kLaunchRegs = 168;                          /* 65536 / 384, rounded down to 8 */
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * kMfWarpgroupThreads + kConsumerRegs * kConsumerThreads <= kLaunchRegs * kThreads,
              "setmaxnreg.inc would wait forever for registers the CTA does not have");

constexpr int kWgRows = 64;                               /* wgmma M: rows per consumer warpgroup */
constexpr int kBoxRows = 2 * kWgRows;                     /* weight rows per TMA box = FP8 scale block */
constexpr int kKBlock = 128;                              /* K bytes per stage (FP8: one scale block) */
constexpr int kBoxBytes = kBoxRows * kKBlock;             /* 16 KB */
constexpr int kWgOperandBytes = kWgRows * kKBlock;        /* 8 KB: warpgroup g's operand at 8 KB g */
constexpr int kKStepBytes = 32;                           /* K bytes per wgmma: BF16 k16, E4M3 k32 */
constexpr int kKSteps = kKBlock / kKStepBytes;            /* 4 */
constexpr int kChunk = 16;                                /* bytes per cp.async, staging chunk and store */
constexpr int kSmemLimit = 227 * 1024;                    /* dynamic smem per block on sm_90 */
constexpr int32_t kMaxRowCoord = kMfGemmMaxRowCoord;      /* rows of the activation tensor maps ("place_block") */
constexpr uint64_t kWaitTimeoutNs = 20000000000ull;       /* 20 s: see "Bounded waits" in the kernel headers */

} /* namespace mf__sm90 */

/* ---- decode family (kernels/sm90_decode_gemm.cuh, gemm_decode.cu) -------------------------------- */

namespace mf__decode {

using namespace mf__sm90;

constexpr int kTileCols = kBoxRows;                       /* output (or h) columns per tile */
constexpr int kMaxExperts = 512;                          /* shared-memory tables */
constexpr int kMaxStages = 16;
constexpr int kScalePad = 4;                              /* w_scale slots after a K block's a_scales */
constexpr int kEpiPadBytes = 16;                          /* staging row pad (bank spread) */
constexpr int kBarEpilogue = 1;                           /* named barrier of the 256 consumer threads */
constexpr int kBarFront = 2;                              /* the small kernel's first ticket, producer warpgroup */
constexpr int kChunksPerKBlock = kKBlock / kChunk;        /* 8 chunks of an activation row per K block */
constexpr int kTimelineStamps = 3;                        /* the lab's --timeline: entry, prologue, last store */

/* gemm_decode.cu */
constexpr int kMaxVariants = 32; /* variant table (<= kMfGemmMaxVariants) */

} /* namespace mf__decode */

/* ---- the small-batch kernel: W13 + W2 in one launch (kernels/sm90_small_gemm.cuh, gemm_small.cu) ---- */

namespace mf__small {

using namespace mf__decode;

constexpr int kTokens = 8;     /* tokens per tile: the one variant per dtype (grouped_gemm.h, the choice) */
constexpr int kMaxSlots = 24;  /* ring slots of one 16 KB box each (a W13 K block takes two) */
constexpr int kMaxVariants = 4; /* FP8, BF16; each with its own plan (kOwn) too */
constexpr int kOwnEntries = 1024; /* kOwn: routing entries T K at most (src in shared memory) */
constexpr int kOwnMaxTokens = 128; /* kOwn: T at most (a bit per token in each expert's mask) */
constexpr int kOwnWords = kOwnMaxTokens / 32; /* kOwn: mask words per expert */
constexpr int kUnitStamps = 8;   /* the timeline: the first units a CTA's producer takes, stamped */
constexpr int kStamps = 6 + 2 * kUnitStamps; /* the timeline's words per CTA (mf__gemm_small_set_timeline) */
/* AUTO takes the kernel where this rank expects at most this many routed rows (T K R L / E; T K at
 * R = 1): measured on the H200 (2026-12-05, bench/NOTES.md), it led the two decode GEMMs at T K <= 64
 * (deepseek-v3 and qwen3-235b-a22b T <= 8, -0.8 to -12.6 %) and trailed them at 128 and above
 * (T = 16..128, +0.8 to +4.5 %). The GPU tests lift it (mf__cuda_small_rows) to cover the kernel. */
constexpr int kMaxRows = 64;

} /* namespace mf__small */

/* ---- TMA family, large M (kernels/sm90_tma_gemm.cuh, gemm_tma.cu) --------------------------------- */

namespace mf__tma {

using namespace mf__sm90;

constexpr int kBlockM = 128;                               /* receive rows per tile */
constexpr int kWarpRows = 16;                              /* rows per consumer warp */
constexpr int kBoxes = 2;                                  /* weight boxes per tile */
constexpr int kTileN = kBoxes * kBoxRows;                  /* accumulator columns per tile */
constexpr int kHCols = kBoxRows;                           /* h columns per swiglu tile */
constexpr int kABytes = kBlockM * kKBlock;                 /* 16 KB */
constexpr int kStageBytes = kABytes + kBoxes * kBoxBytes;  /* 48 KB of TMA per stage */
constexpr int kStages = 4;
constexpr int kAcc = kTileN / 2;                           /* accumulators per consumer thread */
constexpr int kBoxAcc = kBoxRows / 2;                      /* ... per weight box */
constexpr int kEpiRowBytes = 128;                          /* staging row: 64 BF16 or 128 FP8 columns */
constexpr int kEpiWarpBytes = kWarpRows * kEpiRowBytes;    /* 2 KB staging per consumer warp */
constexpr int kWScaleSlots = 4;                            /* w_scale floats per stage (2 used) */
constexpr int kMaxExperts = 1024;                          /* shared-memory tables */
constexpr int kHalfRows = kWgRows;                         /* a tail tile's rows, [64, 128) of its tile */

} /* namespace mf__tma */

/* ---- v1, the mma.sync fallback (kernels/sm90_grouped_gemm.cuh, grouped_gemm.cu) ------------------ */

namespace mf__gemm {

constexpr int kThreads = 256;                         /* 8 warps */
constexpr int kWarpsM = 2;                            /* warps along rows */
constexpr int kWarpsN = 4;                            /* warps along weight rows */
constexpr int kBlockM = 64;                           /* receive rows per tile */
constexpr int kHalfN = 128;                           /* weight rows per half tile */
constexpr int kBlockN = 2 * kHalfN;                   /* weight rows per tile */
constexpr int kW13BlockN = kHalfN;                    /* h columns per W13 tile (= FP8 block) */
constexpr int kW2BlockN = kBlockN;                    /* out columns per W2 tile */
constexpr int kWarpRows = kBlockM / kWarpsM;          /* 32 */
constexpr int kWarpHalfN = kHalfN / kWarpsN;          /* 32 weight rows of each half per warp */
constexpr int kMmaM = 16;
constexpr int kMmaN = 8;
constexpr int kMmaKBytes = 32;                        /* bf16 k16 or e4m3 k32 */
constexpr int kMTiles = kWarpRows / kMmaM;            /* 2 */
constexpr int kNTilesHalf = kWarpHalfN / kMmaN;       /* 4 */
constexpr int kNTiles = 2 * kNTilesHalf;              /* 8: [0, 4) half 0, [4, 8) half 1 */
constexpr int kStageBytes = 128;                      /* K bytes per row per stage */
constexpr int kKSteps = kStageBytes / kMmaKBytes;     /* 4 */
constexpr int kChunk = 16;                            /* cp.async / ldmatrix row / store width */
constexpr int kChunksPerRow = kStageBytes / kChunk;   /* 8 */
/* cp.async pipeline depth (40 KB a stage). The lab builds variants with -DMF__GEMM_STAGES=n; on
 * an H200, 5 stages measured the same as 4 (bench/NOTES.md). */
#ifndef MF__GEMM_STAGES
#define MF__GEMM_STAGES 4
#endif
constexpr int kStages = MF__GEMM_STAGES;

} /* namespace mf__gemm */

/* ---- the benchmark operand filler (gemm_bench.cu) ------------------------------------------------- */

#define kMfFillThreads 256
#define kMfFillBlocksPerSm 8
#define kMfFillFp8MinExp 4 /* E4M3 exponent field 4..10: 2^-3 .. 2^3 (x 1..1.875) */
#define kMfFillFp8Exps 7

#endif /* MF_CUDA_GEMM_CONFIGS_CUH */
