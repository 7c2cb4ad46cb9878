/*
 * sm90_tma_gemm.cuh — the Hopper (sm_90a) grouped expert GEMM for more than a handful of rows per
 * expert (the dispatcher's "tma" family, rows_hint > kMfDecodeMaxRows), BF16 and block-FP8: TMA
 * loads, wgmma from shared memory, warp specialisation. Launched by src/cuda/gemm_tma.cu;
 * dev/cuda/sm90_gemm_lab.cu validates and times it through those launchers. Promoted from that lab
 * (2026-12-02 version), without its cluster-multicast path (measured 35-60 % slower).
 *
 * Dimension legend: L local experts, N weight rows per expert (the GEMM's output dim: 2I for W13,
 * H for W2), K the reduction dim (H for W13, I for W2), H hidden, I intermediate, C masked
 * capacity, rows = receive rows (all experts).
 *
 *   plain (W2):   out[rows, N] = bf16(a[rows, K] . W[e]^T)        W[e] = [N, K], rows of expert e only;
 *                 a row goes to out[row] or, with `ret`, to its owner's combine slot (token K + k) H
 *                 at view.heap[rank] + view.combine, (rank, token, k) = src[3 row]
 *   swiglu (W13): h[rows, I] = silu(a . Wg^T) * (a . Wu^T)       W[e] = [Wg; Wu] = [2I, K]
 *                 BF16: h rounded to BF16; FP8: h requantised 1x128 (h_fp8 + h_scales [rows, I/128])
 *
 * Tiles. A tile is 128 receive rows of one expert x two weight boxes of 128 rows: plain, 256
 * consecutive output columns; swiglu, gate rows [128 nb, +128) and up rows [I + 128 nb, +128), so
 * that the tile holds both factors of its 128 h columns (= one FP8 scale block: the requantisation's
 * amax is tile-local). Order: m-major (all n-blocks of one 128-row block consecutive, m-blocks
 * counted across experts), persistent grid of one CTA per SM; experts without rows have no tiles
 * (m-major keeps the ~132 running tiles on ~8 A blocks and one stripe of weights, both L2-resident:
 * FP8 W13's 29 MB per expert fits the 50 MB L2). CTA b's first tile is b; then, with a schedule
 * pair (seg->sched), the producer takes the next tile as grid + an atomic ticket, so the running
 * tiles stay a window of ~grid consecutive tiles however the CTAs' speeds drift (without one, the
 * static walk b + grid, b + 2 grid, ...: measured on BF16 W13 at L = 256, CTAs drifted apart until
 * the readers of a weight stripe no longer met in L2, bench/NOTES.md). The producer writes each
 * stage's tile (and its kind, "Tail tiles") into tile_of[slot] before its arrival and ends with one
 * stage of tile -1 and no data; the consumers learn their next tile there. The last CTA to finish
 * zeroes the pair.
 * counts/offsets are read on the device at kernel start into shared tables (a warp scan gives each
 * expert's first m-block), clamped to [0, max_rows]. Before that read the kernel waits for the previous kernel
 * (mf__pdl_wait, cuda/pdl.cuh; barrier init and tensor-map prefetch run before it) and then lets
 * the next one start (mf__pdl_trigger).
 *
 * Row shift. A full m-block covers rows [row0, row0 + 128). The last, partial m-block of an expert
 * (v < 128 rows left) is shifted so that it ENDS at the expert's last row: row0 = (expert end) - 128,
 * lo = 128 - v, and only tile rows [lo, 128) belong to it. So no tile ever addresses a row at or past
 * the end of its expert, which is what lets the activation tensor map span 2^31 - 1 rows (the
 * launchers do not know the receive tensor's length): rows below the expert are another expert's
 * rows or padding (read into accumulator rows that are never stored; GEMM rows are independent),
 * rows below 0 are TMA zero fill (coordinates are signed).
 *
 * Tail tiles (tma_params.tails; the choice's tail_rows, cuda/grouped_gemm.h). A tile whose rows all
 * lie in its second half (lo >= 64: an expert's last, partial m-block of at most 64 rows, or a whole
 * expert of at most 64) is a tail tile: it loads only tile rows [64, 128) (a 64-row A box by its own
 * map, tmap_a64, at the stage's second 8 KB; the first 8 KB are not read) and the same 32 KB of
 * weights, and both consumer warpgroups work on those 64 rows, each on half of the tile's columns:
 * plain, warpgroup w takes weight box w (output columns 128 w .. + 128); SwiGLU, warpgroup w takes h
 * columns 64 w .. + 64, so it needs the gate AND up rows of those columns, which the producer lays
 * out as one 16 KB operand per warpgroup from four 64-row weight boxes (tmap_w64): [gate 0-63 | up
 * 0-63 | gate 64-127 | up 64-127]. Each warpgroup issues ONE m64n128 group per K block (a full FP8
 * tile: two), of the same shape as a full tile's, so the epilogue overlap's issue picks the next
 * tile's operands by offsets alone (no wgmma on a divergent path). Per K block a tail tile moves 40 KB
 * instead of 48 and runs half the tensor work: the experts of ~128 rows (prefill: deepseek-v3 at T =
 * 4096 routes 128 +- 11 to each) computed a whole second 128-row m-block for a tail of a few rows.
 * Every stored element is the same wgmmas over the same bytes in the same K order with the same
 * promotion and epilogue math, so the same bits as a full tile; only the FP8 h scale of a row, the
 * amax over its 128 h columns, spans both warpgroups: each writes its rows' amax over its 64 columns
 * to shared memory (two buffers, alternating per tail tile, kOffAmax), a named barrier of the 256
 * consumer threads (kBarAmax), and each takes the max with the other's (exact: the same scale). BF16
 * the same way with m64n128k16 (no temporary, no promotion, no overlap; the SwiGLU h needs no amax).
 * The producer writes each stage's tile AND kind into tile_of[slot] (idx << 1 | tail), so the FP8
 * consumers' overlap issues the next tile's first group with that tile's operands. The lab
 * (dev/cuda/sm90_gemm_lab.cu) checks tails on against the full-tile kernel bitwise and times both.
 *
 * Pipeline. 384 threads: warpgroup 0 is the producer (setmaxnreg 40; warp 0 only: lane 0 issues
 * the TMA, FP8: the 32 lanes copy the stage's scales with cp.async), warpgroups 1 and 2 are the
 * consumers (setmaxnreg 232), tile rows [0, 64) and [64, 128). kStages = 4 stages of one K block
 * (128 bytes of K: FP8 128 elements = one scale block, BF16 64): A [128 rows x 128 B] and the two
 * weight boxes, 128B-swizzled (48 KB), + FP8 a_scale[128] and w_scale[2]. full[s]: arrive.expect_tx
 * of the stage's bytes (a partly out-of-bounds box still delivers its full size), + FP8 one
 * cp.async.mbarrier.arrive.noinc per producer lane (count 1 + 32). empty[s]: one arrival per
 * consumer warp once its wgmmas on the stage completed and its scale reads are done. The ring index
 * `it` counts stages over the whole persistent walk in every role: slot it % kStages, parity
 * (it / kStages) & 1 (the producer waits empty with the opposite parity).
 *
 * Main loop. BF16: per stage 4 x wgmma m64n256k16 straight into the 128 accumulators (scale-d 0 on
 * the tile's first), one group kept in flight (a stage is released when the next stage's group is
 * issued and the previous one has completed). FP8 (docs/DESIGN.md "Numerics"): per stage and weight box
 * 4 x wgmma m64n128k32 into a 64-register temporary (scale-d 0 on the first), wait, then
 * acc(box) (+)= tmp * (a_scale[row][kb] * w_scale[box][kb]) — the first K block assigns; one
 * warpgroup promotes while the other's wgmmas run (see "Issue order"). 256-wide tiles have no room
 * for a second temporary (acc 128 + 2 x 64 > 232 registers). FP8 wgmma accumulates with reduced
 * precision inside a K block (~5e-4 relative per element against an exact fp32 sum): FP8 results
 * match the CPU oracle within a bound, not bitwise; run to run they are bitwise identical.
 *
 * Issue order (FP8). Both consumer warpgroups wait for the same stage, so left alone they issue
 * their wgmma groups together, the tensor cores run them interleaved, both finish together and both
 * promote together while the tensor cores idle. Instead the warpgroups take turns: WG 1 issues its
 * group i only after WG 0 issued group i, WG 0 its group i + 1 only after WG 1 issued group i (two
 * named barriers, bar.sync before / bar.arrive after each group's issue), so one warpgroup's group
 * is queued whole behind the other's and each promotion runs while the other warpgroup's wgmmas
 * keep the tensor cores busy (FlashAttention-3's "ping-pong" order, applied to the two halves of
 * one tile). Both warpgroups issue the same groups in the same order: 2 per K block, + 1 per tile
 * for the overlap below; WG 1 arrives once before its first group, WG 0 syncs once after its last.
 *
 * Epilogue overlap (FP8, plain and SwiGLU). Before a consumer stores tile t it already issues box 0
 * of tile t + grid's first K block into the (free) temporary, so the tensor cores work on the next
 * tile while the warps convert and store; the next tile's main loop starts by waiting for that
 * group. Without a next tile the group reruns the last (consumed) stage and is dropped: wgmmas
 * issued on a divergent path make ptxas serialise every wgmma of the kernel, and so does a call
 * while wgmmas are in flight, which is why the epilogue's divisions (mf__silu, the h scales) use
 * numerics.h's call-free mf__div (no div.rn slow path; equal to IEEE division over every input,
 * proved by the lab's --selftest). (BF16 accumulates straight into acc: nothing to overlap with.)
 *
 * Epilogue, per consumer warp (its 16 rows; no barrier wider than the warp): fragments -> BF16
 * pairs (cvt.rn.bf16x2, stmatrix) or FP8 pairs (cvt.rn.satfinite.e4m3x2) into the warp's 2 KB
 * staging buffer (16 rows x 128 B, 16-byte chunk c of row r at chunk c ^ (r & 7): bank-conflict
 * free both ways), __syncwarp, then 16-byte st.global of the rows in [lo, 128), one 128-byte row
 * segment per 8 lanes; 4 passes (plain), 2 (swiglu BF16), 1 (swiglu FP8). The hardware conversions
 * give the bits of mf__bf16_from_float / mf__fp8_from_float for every non-NaN input (sm90_ptx.cuh;
 * proved over all 2^32 floats by the lab's --selftest). SwiGLU: h = mf__silu(gate) * up in fp32 on
 * the same register of the two boxes' fragments; FP8: amax of a row over its 128 h columns across
 * the 4 lanes of a quad, then mf__fp8_block_scale and q = e4m3(h * inv_scale), as the CPU does it.
 *
 * Bounded waits. Every mbarrier wait gives up after kWaitTimeoutNs (20 s, >= 10 s) of %globaltimer,
 * records itself in the calling comm's fault sink (gemm_params.sink) and returns
 * (mf__mbar_wait_bounded, sm90_ptx.cuh). The bound is far above any healthy wait (time-sliced or preempted GPUs included);
 * it exists only so that a broken pipeline can never hang the GPU. Once a wait has given up, the
 * producer drains too and overwrites stages whose tile code (tile_of) a consumer is still to read,
 * so consumer threads that each read the code could disagree on the next tile: one would then wait
 * forever at a named barrier (FP8: kBarIssued0/1, kBarAmax), which has no bound. So the consumers
 * take every tile code from one thread (lead_code): a leader reads it (-1 when its own wait gave
 * up: the consumers end within a tile) into a word of code_of between two named barriers, and the
 * threads take that word. FP8: the first tile's code from one leader of all 256 threads (kBarLead0
 * + 1); every later one from WG 0's first thread (code_of[slot], kBarLead0), and WG 1 reads that
 * word after the issue-order barrier that follows WG 0's first group of the tile
 * (fp8_issue_first). BF16 (no barrier between the warpgroups): a leader per warpgroup
 * (code_of[kStages wg + slot], kBarLead0 + wg). A word read again later (FP8, after the epilogue)
 * is read before its reader's warpgroup can pass the position at which it is next written
 * (kStages positions on, each of them at least one issue-order group).
 *
 * Limits (the launchers decline anything else): plain N a multiple of 256, swiglu N = 2I with I a
 * multiple of 128; K * element bytes a multiple of 16 (FP8: K a multiple of 128; BF16 K tails past
 * a 64-element stage are TMA zero fill); L <= kMaxExperts; L * N < 2^31; fewer than kMaxTiles (2^30)
 * tiles; 16-byte aligned data, 4-byte aligned scales.
 */
#ifndef MF_CUDA_KERNELS_SM90_TMA_GEMM_CUH
#define MF_CUDA_KERNELS_SM90_TMA_GEMM_CUH

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "core/numerics.h"
#include "cuda/gemm_configs.cuh"
#include "cuda/grouped_gemm.h"
#include "cuda/kernels/sm90_core.cuh"
#include "cuda/kernels/sm90_ptx.cuh"

namespace mf__tma {

enum { kEpiPlain = 0, kEpiSwiglu = 1 };

/* Threads, registers, tile and stage sizes, table sizes and the wait bound: cuda/gemm_configs.cuh.
 * Params, tables, tile walk, ring, roles and row targets: the shared core, kernels/sm90_core.cuh. */
using ring_t = ring<kStages>;
/* FP8 issue order (see "Issue order"): named barriers over the 256 consumer threads */
enum { kBarIssued0 = 1,                                    /* WG 0 issued group i: WG 1 may issue group i */
       kBarIssued1 = 2,                                    /* WG 1 issued group i: WG 0 may issue group i + 1 */
       kBarAmax = 3,                                       /* tail tiles: the FP8 h amax exchange */
       kBarLead0 = 4 };                                    /* + wg: a warpgroup takes its leader's tile code */

/* Tail tiles ("Tail tiles" above). */
constexpr int kHalfN = kBoxRows;                                      /* a warpgroup's columns (wgmma N) */
constexpr int kHalfStageBytes = kWgOperandBytes + kBoxes * kBoxBytes; /* 40 KB of TMA */
constexpr int64_t kMaxTiles = (int64_t)1 << 30;                       /* tile_of holds idx << 1 | tail */

/* One struct per launch (__grid_constant__): the shared core's parameters and the tail tiles' maps. */
struct tma_params {
    gemm_params p;
    CUtensorMap tmap_a64; /* activations [kMaxRowCoord, K], box [64 rows, 128 B], 128B swizzle (tails only) */
    CUtensorMap tmap_w64; /* weights [L N, K], box [64 rows, 128 B], 128B swizzle (SwiGLU tails only) */
    int32_t tails;        /* 1: tail tiles (the producer marks them); 0: every tile is a full one */
};

/* The shared-memory map (offsets from the 1024-aligned base). */
constexpr int kOffStages = 0;
constexpr int kOffEpi = kOffStages + kStages * kStageBytes;
constexpr int kOffAScales = kOffEpi + kConsumerWarps * kEpiWarpBytes;  /* [kStages][128] f32 */
constexpr int kOffWScales = kOffAScales + kStages * kBlockM * 4;       /* [kStages][4] f32 */
constexpr int kOffBars = kOffWScales + kStages * kWScaleSlots * 4;    /* full[kStages], empty[kStages] */
constexpr int kOffTileOf = kOffBars + 2 * kStages * 8;                /* tile_of[kStages]: the tile of each stage */
constexpr int kOffCodeOf = kOffTileOf + kStages * 4;                  /* code_of[2][kStages]: the leaders' codes */
constexpr int kOffTables = kOffCodeOf + 2 * kStages * 4;              /* rows[L], row0[L], first[L + 1] */
constexpr int kOffAmax = align_up(kOffTables + (3 * kMaxExperts + 1) * 4, 16); /* tails: [2][2 wg][64 rows] f32 */
constexpr int kSmemBytes = kOffAmax + 2 * 2 * kHalfRows * 4 + kMfSwizzleAtomBytes /* base slack */;

static_assert(kKBlock == kMfSwizzleBytes, "a K block is one 128B-swizzle row");
static_assert(kKBlock == MF__QUANT_BLOCK, "an FP8 K block must be exactly one scale block");
static_assert(kHCols == MF__QUANT_BLOCK, "a swiglu tile must hold whole FP8 h scale blocks");
static_assert(kBlockM == 2 * kWgRows && kWgRows == 4 * kWarpRows, "consumer warps must cover the tile rows");
static_assert(kStageBytes % kMfSwizzleAtomBytes == 0 && kWgOperandBytes % kMfSwizzleAtomBytes == 0 &&
                  kOffEpi % kMfSwizzleAtomBytes == 0 && kEpiWarpBytes % kMfSwizzleAtomBytes == 0,
              "every operand and staging buffer must start on a 1024-byte swizzle atom");
static_assert(kSmemBytes <= kSmemLimit, "shared memory map exceeds 227 KB");
static_assert((kStages & (kStages - 1)) == 0, "the ring's it % kStages must be a mask");
static_assert(kBoxes == 2, "two weight boxes per tile: the code names them 0 and 1");
static_assert(kHalfStageBytes % kMfSwizzleAtomBytes == 0 && kHalfRows * 2 == kBlockM, "a tail tile is a tile's second half");

/* First weight row (of the [L * N, K] map) of box b of tile t. */
template <int kEpi>
__device__ __forceinline__ int32_t weight_row(const gemm_params &p, const tile_t &t, int b) {
    if (kEpi == kEpiSwiglu) return t.e * p.N + b * (p.N / 2) + t.nb * kBoxRows; /* b = 0 gate, 1 up */
    return t.e * p.N + t.nb * kTileN + b * kBoxRows;
}

/* A tail tile (only with tma_params.tails): its rows all lie in the tile's second half. */
__device__ __forceinline__ bool is_half(const tile_t &t) { return t.lo >= kHalfRows; }

/* n-blocks per expert (computed in each role, after the register split: one computed before it was
 * spilled across setmaxnreg in the tail tiles' first build) */
template <int kEpi>
__device__ __forceinline__ int32_t n_blocks(const gemm_params &p) {
    return kEpi == kEpiSwiglu ? p.N / (2 * kHCols) : p.N / kTileN;
}

/* ---- producer: warp 0; lane 0 issues the TMA, FP8: all lanes copy the scales ---------------- */

/* A full tile: the 128-row A box and the two weight boxes. A tail tile: a 64-row A box at the
 * stage's second 8 KB and its weights (plain: the two boxes; SwiGLU: four 64-row boxes, each
 * warpgroup's gate and up rows next to each other). Scales alike for both kinds. */
template <bool kFp8, int kEpi>
__device__ __forceinline__ void producer(const tma_params &tp, const tables_t &tb, uint8_t *stages, float *a_sc,
                                         float *w_sc, int32_t *tile_of, uint64_t *full, uint64_t *empty) {
    const gemm_params &p = tp.p;
    const int32_t nblocks = n_blocks<kEpi>(p);
    const int lane = (int)(threadIdx.x & 31);
    const int32_t kblocks = (p.K * (kFp8 ? 1 : 2) + kKBlock - 1) / kKBlock; /* FP8: K/128 scale columns */
    const bool tails = tp.tails != 0;
    uint32_t it = 0;
    int32_t cursor = 0;
    tile_t t;
    for (int32_t idx = (int32_t)blockIdx.x; next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, idx, cursor, t);
         idx = next_idx(p.sched, idx, lane)) {
        const bool half = tails && is_half(t);
        int32_t wrow[kBoxes];
#pragma unroll
        for (int b = 0; b < kBoxes; b++) wrow[b] = weight_row<kEpi>(p, t, b);
        /* FP8: this lane's a_scale rows j = lane + 32 i (rows below lo copy row lo's: their
         * accumulator rows are never stored) and, lanes 0-1, box `lane`'s w_scale row */
        const float *srow[kBlockM / 32];
        const float *wsrc = p.w_scales;
        if constexpr (kFp8) {
            const int32_t kbs = p.K / kKBlock;
#pragma unroll
            for (int i = 0; i < kBlockM / 32; i++) {
                srow[i] = p.a_scales + (int64_t)clamp_row<kBlockM>(t, lane + 32 * i) * kbs;
            }
            if (lane < kBoxes) wsrc = p.w_scales + (int64_t)((lane == 0 ? wrow[0] : wrow[1]) / kBoxRows) * kbs;
        }
        for (int32_t kb = 0; kb < kblocks; kb++, it++) {
            const uint32_t slot = ring_t::slot(it);
            ring_t::wait_empty(empty, it);
            if constexpr (kFp8) {
#pragma unroll
                for (int i = 0; i < kBlockM / 32; i++) mf__cp_async_4(a_sc + slot * kBlockM + lane + 32 * i, srow[i] + kb);
                if (lane < kBoxes) mf__cp_async_4(w_sc + slot * kWScaleSlots + lane, wsrc + kb);
                mf__cp_async_mbar_arrive_noinc(&full[slot]); /* one of full's 1 + 32 */
            }
            __syncwarp();
            if (lane == 0) {
                uint8_t *st = stages + slot * kStageBytes;
                const int32_t kc = kb * (kFp8 ? kKBlock : kKBlock / 2); /* K coordinate, elements */
                tile_of[slot] = idx << 1 | (half ? 1 : 0); /* the tile and its kind, published by the arrive below */
                mf__mbar_arrive_expect_tx(&full[slot], (uint32_t)(half ? kHalfStageBytes : kStageBytes));
                if (!half) {
                    mf__tma_load_2d(st, &p.tmap_a, &full[slot], kc, t.row0);
                } else {
                    mf__tma_load_2d(st + kWgOperandBytes, &tp.tmap_a64, &full[slot], kc, t.row0 + kHalfRows);
                }
                if (half && kEpi == kEpiSwiglu) {
#pragma unroll
                    for (int q = 0; q < 4; q++)
                        mf__tma_load_2d(st + kABytes + q * kWgOperandBytes, &tp.tmap_w64, &full[slot], kc,
                                        wrow[q & 1] + (q >> 1) * kHalfRows);
                } else {
#pragma unroll
                    for (int b = 0; b < kBoxes; b++)
                        mf__tma_load_2d(st + kABytes + b * kBoxBytes, &p.tmap_w, &full[slot], kc, wrow[b]);
                }
            }
        }
    }
    /* The end: one more stage, tile -1 and no data, full by plain arrivals (FP8: 32 + 1 in place of
     * the 32 cp.async arrivals and the expect_tx): the consumers' "no next tile". */
    const uint32_t slot = ring_t::slot(it);
    ring_t::wait_empty(empty, it);
    if (lane == 0) tile_of[slot] = -1;
    __syncwarp();
    if (kFp8) mf__mbar_arrive(&full[slot]);
    if (lane == 0) mf__mbar_arrive(&full[slot]);
    end_schedule(p.sched, lane);
    /* a thread must not exit with copies still writing its CTA's shared memory */
    if constexpr (kFp8) mf__cp_async_wait_all();
}

/* ---- consumers ------------------------------------------------------------------------------- */

/* Byte offsets in a stage of warpgroup wg's operands for its group of weight box b: a full tile,
 * its 64 rows and box b; a tail tile, rows [64, 128) and its own 16 KB of weights. Selects, not
 * branches: the group's wgmmas are the same instructions either way. */
__device__ __forceinline__ uint32_t a_off(bool half, int wg) { return (uint32_t)(half ? 1 : wg) * kWgOperandBytes; }
__device__ __forceinline__ uint32_t b_off(bool half, int wg, int b) { return (uint32_t)(kABytes + (half ? wg : b) * kBoxBytes); }

/* FP8: the 4 k32 wgmmas of one m64n128 group into `tmp` (the first overwrites), A and B at the
 * descriptors da, db. */
__device__ __forceinline__ void fp8_group(float *tmp, uint64_t da, uint64_t db) {
    mf__wgmma_fence();
#pragma unroll
    for (int k = 0; k < kKSteps; k++)
        mf__wgmma_e4m3<kBoxRows>(tmp, mf__wgmma_desc_advance(da, k * kKStepBytes), mf__wgmma_desc_advance(db, k * kKStepBytes),
                                 k > 0 ? 1 : 0);
    mf__wgmma_commit();
}

/* FP8: issues one group for warpgroup `wg`, A and B at byte offsets `aoff`, `boff` of the stage at
 * desc_st, in turn with the other warpgroup (see "Issue order"). */
__device__ __forceinline__ void fp8_issue_at(float *tmp, uint64_t desc_st, int wg, uint32_t aoff, uint32_t boff) {
    const uint64_t da = mf__wgmma_desc_advance(desc_st, aoff);
    const uint64_t db = mf__wgmma_desc_advance(desc_st, boff);
    mf__fence_fragment<kBoxRows>(tmp); /* the last promotion's reads of tmp come first */
    mf__named_barrier_sync(wg == 0 ? kBarIssued1 : kBarIssued0, kConsumerThreads);
    fp8_group(tmp, da, db);
    mf__named_barrier_arrive(wg == 0 ? kBarIssued0 : kBarIssued1, kConsumerThreads);
}

/* A full tile's group of box b (its 64 rows). */
__device__ __forceinline__ void fp8_issue(float *tmp, uint64_t desc_st, int wg, int b) {
    fp8_issue_at(tmp, desc_st, wg, a_off(false, wg), b_off(false, wg, b));
}

/* FP8 promotion of the first kN accumulators of one group: acc (+)= tmp * scale (rows r: s_lo,
 * r + 8: s_hi); kFirst assigns (0 + x would lose -0). */
template <bool kFirst, int kN = kBoxAcc>
__device__ __forceinline__ void fp8_promote(float *acc, const float *tmp, float s_lo, float s_hi) {
    static_assert(kN % 4 == 0, "whole fragments");
#pragma unroll
    for (int j = 0; j < kN / 4; j++) {
        if (kFirst) {
            acc[4 * j + 0] = tmp[4 * j + 0] * s_lo;
            acc[4 * j + 1] = tmp[4 * j + 1] * s_lo;
            acc[4 * j + 2] = tmp[4 * j + 2] * s_hi;
            acc[4 * j + 3] = tmp[4 * j + 3] * s_hi;
        } else {
            acc[4 * j + 0] += tmp[4 * j + 0] * s_lo;
            acc[4 * j + 1] += tmp[4 * j + 1] * s_lo;
            acc[4 * j + 2] += tmp[4 * j + 2] * s_hi;
            acc[4 * j + 3] += tmp[4 * j + 3] * s_hi;
        }
    }
}

/* Where a consumer thread's state lives (one per thread, set up once). */
struct consumer_t {
    uint64_t desc_stages;   /* wgmma descriptor of stage 0 */
    const float *a_sc;      /* [kStages][128] */
    const float *w_sc;      /* [kStages][4] */
    uint64_t *full, *empty;
    const int32_t *tile_of; /* [kStages]: the tile each stage belongs to and its kind, idx << 1 | tail (-1: the end) */
    uint8_t *epi;           /* this warp's staging buffer */
    int wg, warp, lane;     /* consumer warpgroup (0, 1), warp in it, lane */
    int row_lo;             /* tile row of acc[4j + 0, 1]; acc[4j + 2, 3] are row_lo + 8 */
    const mf__fault_sink_t *sink; /* the params' (an expired wait records itself there) */
};

__device__ __forceinline__ void release(const consumer_t &c, uint32_t slot) { release_stage(c.empty, slot, c.lane); }

/* A consumer thread's state from the kernel's aligned shared-memory base (the kernel and the lab's fork). */
__device__ __forceinline__ void consumer_at(consumer_t &c, uint8_t *smem) {
    const int ctid = (int)threadIdx.x - kMfWarpgroupThreads; /* 0..255 */
    c.wg = ctid / kMfWarpgroupThreads;
    c.warp = (ctid / 32) % 4;
    c.lane = ctid & 31;
    c.row_lo = c.wg * kWgRows + c.warp * kWarpRows + c.lane / 4;
    c.desc_stages = mf__wgmma_desc_sw128(smem + kOffStages);
    c.a_sc = (const float *)(smem + kOffAScales);
    c.w_sc = (const float *)(smem + kOffWScales);
    c.full = (uint64_t *)(smem + kOffBars);
    c.empty = c.full + kStages;
    c.tile_of = (const int32_t *)(smem + kOffTileOf);
    c.epi = smem + kOffEpi + (c.wg * 4 + c.warp) * kEpiWarpBytes;
}

/* %tid.x, read where it is used (asm volatile: not hoisted). The tail tiles' values derived from the
 * thread's warpgroup and warp, computed once at the consumer's start, were spilled (the consumer has
 * 232 registers, 192 of them accumulators); read here they cost an S2R. */
__device__ __forceinline__ uint32_t tid_here(void) {
    uint32_t tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    return tid;
}
__device__ __forceinline__ int wg_here(void) { return (int)(tid_here() / kMfWarpgroupThreads) - 1; } /* consumer 0, 1 */

/* The leaders' tile codes (code_of[kStages * wg + slot]: behind tile_of, kOffCodeOf). */
__device__ __forceinline__ int32_t *code_of(const consumer_t &c, int wg) { return (int32_t *)c.tile_of + kStages * (1 + wg); }

/* The code of the tile whose first stage is `slot` (see "Bounded waits"), taken by the kParties
 * threads of named barrier kBarLead0 + wg (warpgroup wg's 128, or all 256 consumers): their first
 * thread reads tile_of, or -1 when its own wait for the stage gave up (`gave_up`), into code_of
 * between two syncs of the barrier (the first: every party has read the word's last code), and
 * every party takes that word. */
template <int kParties = kMfWarpgroupThreads>
__device__ __forceinline__ int32_t lead_code(const consumer_t &c, int wg, uint32_t slot, bool gave_up) {
    int32_t *code = code_of(c, wg) + slot;
    mf__named_barrier_sync(kBarLead0 + wg, kParties);
    if (tid_here() % kParties == 0) *code = gave_up ? -1 : c.tile_of[slot];
    mf__named_barrier_sync(kBarLead0 + wg, kParties);
    return *code;
}

/* The tile a stage's code names (tile_of: idx << 1 | tail; -1: none). */
__device__ __forceinline__ int32_t code_tile(int32_t code) { return code < 0 ? -1 : code >> 1; }
__device__ __forceinline__ bool code_half(int32_t code) { return code >= 0 && (code & 1); }

/* FP8: the first group of the tile whose first stage is at ring position `it` (fp8_issue_at), its
 * kind from WG 0's code (`code0`, lead_code; WG 1 reads WG 0's word after the issue-order barrier
 * that WG 0 arrives at after writing it): issued from stage `it`, or from `none_at` when the code
 * is -1 (no next tile: the group is dropped). Returns the code. */
__device__ __forceinline__ int32_t fp8_issue_first(float *tmp, const consumer_t &c, uint32_t it, uint32_t none_at,
                                                   int32_t code0) {
    const int wg = wg_here();
    mf__fence_fragment<kBoxRows>(tmp); /* the last promotion's reads of tmp come first */
    mf__named_barrier_sync(wg == 0 ? kBarIssued1 : kBarIssued0, kConsumerThreads);
    const int32_t code = wg == 0 ? code0 : code_of(c, 0)[ring_t::slot(it)];
    const bool half = code_half(code);
    const uint64_t desc_st = mf__wgmma_desc_advance(c.desc_stages, ring_t::slot(code >= 0 ? it : none_at) * kStageBytes);
    const uint64_t da = mf__wgmma_desc_advance(desc_st, a_off(half, wg));
    const uint64_t db = mf__wgmma_desc_advance(desc_st, b_off(half, wg, 0));
    fp8_group(tmp, da, db);
    mf__named_barrier_arrive(wg == 0 ? kBarIssued0 : kBarIssued1, kConsumerThreads);
    return code;
}

/* FP8: one K block at ring position `it`; with kIssued, box 0's group is already in flight. */
template <bool kFirst, bool kIssued>
__device__ __forceinline__ void fp8_kblock(const consumer_t &c, float *acc, float *tmp, uint32_t it) {
    const uint32_t slot = ring_t::slot(it);
    const uint64_t desc_st = mf__wgmma_desc_advance(c.desc_stages, slot * kStageBytes);
    if (!kIssued) {
        ring_t::wait_full(c.full, it, *c.sink);
        fp8_issue(tmp, desc_st, c.wg, 0);
    }
    /* this stage's scales, read before the stage is released */
    const float sa_lo = c.a_sc[slot * kBlockM + c.row_lo], sa_hi = c.a_sc[slot * kBlockM + c.row_lo + 8];
    const float sw0 = c.w_sc[slot * kWScaleSlots], sw1 = c.w_sc[slot * kWScaleSlots + 1];
    mf__wgmma_wait<0>();
    mf__fence_fragment<kBoxRows>(tmp);
    fp8_promote<kFirst>(acc, tmp, sa_lo * sw0, sa_hi * sw0);
    fp8_issue(tmp, desc_st, c.wg, 1);
    mf__wgmma_wait<0>();
    mf__fence_fragment<kBoxRows>(tmp);
    release(c, slot);
    fp8_promote<kFirst>(acc + kBoxAcc, tmp, sa_lo * sw1, sa_hi * sw1);
}

/* FP8: a tail tile's K block at ring position `it` (kIssued: its group is already in flight). Plain:
 * acc[0, 64) = box wg's 128 columns; SwiGLU: acc[0, 32) gate, acc[32, 64) up of h columns 64 wg .. + 64. */
template <int kEpi, bool kFirst, bool kIssued>
__device__ __forceinline__ void half_kblock(const consumer_t &c, float *acc, float *tmp, uint32_t it) {
    const uint32_t slot = ring_t::slot(it);
    const int rl = c.row_lo + (c.wg ? 0 : kHalfRows); /* the tile row of acc[4j + 0, 1]: rows [64, 128) */
    const uint64_t desc_st = mf__wgmma_desc_advance(c.desc_stages, slot * kStageBytes);
    if (!kIssued) {
        ring_t::wait_full(c.full, it, *c.sink);
        fp8_issue_at(tmp, desc_st, c.wg, a_off(true, c.wg), b_off(true, c.wg, 0));
    }
    const float sa_lo = c.a_sc[slot * kBlockM + rl], sa_hi = c.a_sc[slot * kBlockM + rl + 8];
    const float sw0 = c.w_sc[slot * kWScaleSlots], sw1 = c.w_sc[slot * kWScaleSlots + 1];
    mf__wgmma_wait<0>();
    mf__fence_fragment<kBoxRows>(tmp);
    release(c, slot);
    if constexpr (kEpi == kEpiSwiglu) {
        fp8_promote<kFirst, kBoxAcc / 2>(acc, tmp, sa_lo * sw0, sa_hi * sw0);
        fp8_promote<kFirst, kBoxAcc / 2>(acc + kBoxAcc / 2, tmp + kBoxAcc / 2, sa_lo * sw1, sa_hi * sw1);
    } else {
        const float sw = c.wg ? sw1 : sw0;
        fp8_promote<kFirst>(acc, tmp, sa_lo * sw, sa_hi * sw);
    }
}

/* BF16: the whole K loop of one tile into acc (the first wgmma overwrites): one group kept in flight,
 * a stage released when the next one's group is issued. A full tile: m64n256 into acc[0, 128); a
 * tail tile (kHalf): m64n128 into acc[0, 64), half_kblock's layout. */
template <bool kHalf>
__device__ __forceinline__ void bf16_mainloop(const consumer_t &c, float *acc, uint32_t &it, int32_t kblocks) {
    constexpr int kN = kHalf ? kHalfN : kTileN;
    int32_t prev = -1;
    mf__fence_fragment<kN>(acc); /* the previous epilogue's reads of acc come first */
    for (int32_t kb = 0; kb < kblocks; kb++, it++) {
        const uint32_t slot = ring_t::slot(it);
        ring_t::wait_full(c.full, it, *c.sink);
        const uint64_t desc_st = mf__wgmma_desc_advance(c.desc_stages, slot * kStageBytes);
        const uint64_t da = mf__wgmma_desc_advance(desc_st, a_off(kHalf, c.wg));
        const uint64_t db = mf__wgmma_desc_advance(desc_st, b_off(kHalf, c.wg, 0));
        mf__wgmma_fence();
#pragma unroll
        for (int k = 0; k < kKSteps; k++)
            mf__wgmma_bf16<kN>(acc, mf__wgmma_desc_advance(da, k * kKStepBytes), mf__wgmma_desc_advance(db, k * kKStepBytes),
                               (kb > 0 || k > 0) ? 1 : 0);
        mf__wgmma_commit();
        mf__wgmma_wait<1>();
        if (prev >= 0) release(c, (uint32_t)prev);
        prev = (int32_t)slot;
    }
    mf__wgmma_wait<0>();
    if (prev >= 0) release(c, (uint32_t)prev);
    mf__fence_fragment<kN>(acc);
}

/* Where tile row tr goes (bytes), or NULL when the row does not belong to the tile (or, with `ret`,
 * its source entry is invalid): `row_bytes` apart in `out`, from column byte `col_bytes`. */
template <int kEpi>
__device__ __forceinline__ uint8_t *row_at(const gemm_params &p, const tile_t &t, int tr, int64_t row_bytes,
                                           int64_t col_bytes) {
    if (tr < t.lo) return NULL;
    const int64_t row = (int64_t)t.row0 + tr;
    if (kEpi == kEpiPlain && p.use_ret) {
        uint8_t *dst;
        return ret_row(p, p.src, row, p.N, dst) ? dst + col_bytes : NULL;
    }
    return p.out + row * row_bytes + col_bytes;
}

/* The targets of the 4 rows lane `c.lane` copies out of the staging buffer (rows 4 i + lane / 8 of
 * the warp's 16, from tile row `wr`; its 16-byte chunk lane % 8 of each), at column byte
 * `col_bytes`: NULL where the row is not stored. Computed once per tile (row_at reads `src` for
 * `ret`); every pass adds its column offset. */
template <int kEpi>
__device__ __forceinline__ void row_targets(const gemm_params &p, const consumer_t &c, const tile_t &t, int wr,
                                            int64_t row_bytes, int64_t col_bytes, uint8_t *(&dst)[4]) {
#pragma unroll
    for (int i = 0; i < 4; i++)
        dst[i] = row_at<kEpi>(p, t, wr + 4 * i + c.lane / 8, row_bytes, col_bytes + (c.lane % 8) * kChunk);
}

/* The warp's staging buffer (16 rows x 128 B) -> global: lane l loads 16 bytes of rows 4 i + l / 8
 * (i = 0..3), chunk l % 8, all four first, then stores them at dst[i] + `pass_bytes`; then the buffer
 * may be rewritten. */
__device__ __forceinline__ void copy_out(const consumer_t &c, uint8_t *const (&dst)[4], int pass_bytes) {
    __syncwarp();
    const int ch = c.lane % 8;
    uint4 v[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = 4 * i + c.lane / 8;
        v[i] = *(const uint4 *)(c.epi + r * kEpiRowBytes + ((ch ^ (r & 7)) * kChunk));
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
        if (dst[i]) *(uint4 *)(dst[i] + pass_bytes) = v[i];
    __syncwarp();
}

/* BF16 epilogue pass: fragments j in [8 pass, 8 pass + 8) of `v` (64 columns) -> staging via
 * stmatrix (matrix m of an x4: rows 8 (m & 1) .. + 7, column chunk jj + (m >> 1)). The lane from
 * %tid.x here (tid_here): with the tail tiles' second plain epilogue ptxas hoisted these addresses
 * out of the tile loop and spilled them (FP8 W2, 20 bytes). */
__device__ __forceinline__ void stage_bf16(const consumer_t &c, const float *v, int pass) {
    const int lane = (int)(tid_here() & 31);
    const int m = lane / 8, rr = lane & 7, r = (m & 1) * 8 + rr;
#pragma unroll
    for (int jj = 0; jj < 8; jj += 2) {
        const int j = pass * 8 + jj;
        const int ch = jj + (m >> 1);
        mf__stmatrix_x4(c.epi + r * kEpiRowBytes + ((ch ^ rr) * kChunk), mf__cvt_bf16x2(v[4 * j + 0], v[4 * j + 1]),
                        mf__cvt_bf16x2(v[4 * j + 2], v[4 * j + 3]), mf__cvt_bf16x2(v[4 * j + 4], v[4 * j + 5]),
                        mf__cvt_bf16x2(v[4 * j + 6], v[4 * j + 7]));
    }
}

/* SwiGLU in place over the kH gate accumulators (up at acc + kH): h = mf__silu(gate) * up in fp32. */
template <int kH>
__device__ __forceinline__ void swiglu(float *acc) {
#pragma unroll
    for (int i = 0; i < kH; i++) acc[i] = mf__silu(acc[i]) * acc[kH + i];
}

/* FP8 1x128: swiglu, then the amax of the thread's two rows (r: lo, r + 8: hi) over its kH h
 * accumulators, across the 4 lanes of a quad that hold a row's values. */
template <int kH>
__device__ __forceinline__ void swiglu_amax(float *acc, float &amax_lo, float &amax_hi) {
    swiglu<kH>(acc);
    amax_lo = 0.0f, amax_hi = 0.0f;
#pragma unroll
    for (int j = 0; j < kH / 4; j++) {
        amax_lo = fmaxf(amax_lo, fmaxf(fabsf(acc[4 * j + 0]), fabsf(acc[4 * j + 1])));
        amax_hi = fmaxf(amax_hi, fmaxf(fabsf(acc[4 * j + 2]), fabsf(acc[4 * j + 3])));
    }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
        amax_lo = fmaxf(amax_lo, __shfl_xor_sync(0xffffffffu, amax_lo, o));
        amax_hi = fmaxf(amax_hi, __shfl_xor_sync(0xffffffffu, amax_hi, o));
    }
}

/* FP8 h of the kH accumulators, q = e4m3(h * inv), into the warp's staging rows g = lane / 4 and
 * g + 8: columns 8 j + 2 q, + 1 at chunk j / 2, bytes (j & 1) 8 + 2 q of it (rows g and g + 8 share
 * the swizzle). */
template <int kH>
__device__ __forceinline__ void stage_fp8(const consumer_t &c, const float *acc, float inv_lo, float inv_hi) {
    const int g = c.lane / 4, q = c.lane % 4;
    uint8_t *row_lo = c.epi + g * kEpiRowBytes, *row_hi = c.epi + (g + 8) * kEpiRowBytes;
#pragma unroll
    for (int j = 0; j < kH / 4; j++) {
        const int at = (((j >> 1) ^ g) * kChunk) + (j & 1) * 8 + 2 * q;
        *(uint16_t *)(row_lo + at) = mf__cvt_e4m3x2(acc[4 * j + 0] * inv_lo, acc[4 * j + 1] * inv_lo);
        *(uint16_t *)(row_hi + at) = mf__cvt_e4m3x2(acc[4 * j + 2] * inv_hi, acc[4 * j + 3] * inv_hi);
    }
}

template <bool kFp8, int kEpi>
__device__ __forceinline__ void epilogue(const gemm_params &p, const consumer_t &c, const tile_t &t, float *acc) {
    if constexpr (kEpi == kEpiPlain) {
        uint8_t *dst[4];
        row_targets<kEpi>(p, c, t, c.wg * kWgRows + c.warp * kWarpRows, (int64_t)p.N * 2, (int64_t)t.nb * kTileN * 2, dst);
#pragma unroll
        for (int pass = 0; pass < kTileN / 64; pass++) {
            stage_bf16(c, acc, pass);
            copy_out(c, dst, pass * 64 * 2);
        }
    } else if constexpr (!kFp8) {
        swiglu<kBoxAcc>(acc); /* in place over the gate fragment */
        const int32_t I = p.N / 2;
        uint8_t *dst[4];
        row_targets<kEpi>(p, c, t, c.wg * kWgRows + c.warp * kWarpRows, (int64_t)I * 2, (int64_t)t.nb * kHCols * 2, dst);
#pragma unroll
        for (int pass = 0; pass < kHCols / 64; pass++) {
            stage_bf16(c, acc, pass);
            copy_out(c, dst, pass * 64 * 2);
        }
    } else {
        /* FP8 1x128: the tile's 128 h columns are one scale block */
        const int32_t I = p.N / 2;
        float amax_lo, amax_hi;
        swiglu_amax<kBoxAcc>(acc, amax_lo, amax_hi);
        float sc_lo, inv_lo, sc_hi, inv_hi;
        mf__fp8_block_scale(amax_lo, p.ue8m0, &sc_lo, &inv_lo);
        mf__fp8_block_scale(amax_hi, p.ue8m0, &sc_hi, &inv_hi);
        const int q = c.lane % 4;
        stage_fp8<kBoxAcc>(c, acc, inv_lo, inv_hi);
        if (q == 0) {
            const int32_t sblocks = I / MF__QUANT_BLOCK;
            const int tr = c.row_lo;
            if (tr >= t.lo) p.out_scales[(int64_t)(t.row0 + tr) * sblocks + t.nb] = sc_lo;
            if (tr + 8 >= t.lo) p.out_scales[(int64_t)(t.row0 + tr + 8) * sblocks + t.nb] = sc_hi;
        }
        uint8_t *dst[4];
        row_targets<kEpi>(p, c, t, c.wg * kWgRows + c.warp * kWarpRows, (int64_t)I, (int64_t)t.nb * kHCols, dst);
        copy_out(c, dst, 0);
    }
}

/* A tail tile's epilogue, per consumer warp (its 16 of the 64 rows); par: which of the two amax
 * buffers [2 wg][64 rows] at kOffAmax (SwiGLU FP8; found from the warp's staging buffer, so that no
 * pointer stays live through the main loop). */
template <bool kFp8, int kEpi>
__device__ __forceinline__ void half_epilogue(const gemm_params &p, const consumer_t &c, const tile_t &t, float *acc,
                                              uint32_t par) {
    const int wr = kHalfRows + (int)(tid_here() / 32 % 4) * kWarpRows; /* tile row of the warp's first row */
    if constexpr (kEpi == kEpiPlain) {
        /* box wg's 128 columns: two passes of 64, as the full tile's four */
        uint8_t *dst[4];
        row_targets<kEpi>(p, c, t, wr, (int64_t)p.N * 2, ((int64_t)t.nb * kTileN + c.wg * kBoxRows) * 2, dst);
#pragma unroll
        for (int pass = 0; pass < kBoxRows / 64; pass++) {
            stage_bf16(c, acc, pass);
            copy_out(c, dst, pass * 64 * 2);
        }
    } else if constexpr (!kFp8) {
        swiglu<kBoxAcc / 2>(acc); /* the warpgroup's 64 h columns: one pass of 64 BF16 */
        const int32_t I = p.N / 2;
        uint8_t *dst[4];
        row_targets<kEpi>(p, c, t, wr, (int64_t)I * 2, ((int64_t)t.nb * kHCols + c.wg * (kHCols / 2)) * 2, dst);
        stage_bf16(c, acc, 0);
        copy_out(c, dst, 0);
    } else {
        float amax_lo, amax_hi;
        swiglu_amax<kBoxAcc / 2>(acc, amax_lo, amax_hi); /* 32 accumulators: 64 h columns */
        const int32_t I = p.N / 2;
        /* the row's other 64 h columns are the other warpgroup's */
        const int g = c.lane / 4, q = c.lane % 4;
        {
            /* the exchange's addresses from %tid.x (tid_here) */
            const uint32_t tid = tid_here();
            const int wg = (int)(tid / kMfWarpgroupThreads) - 1, hr = (int)(tid / 32 % 4) * kWarpRows + (int)(tid % 32) / 4;
            float *xamax =
                (float *)(c.epi - kOffEpi - (wg * 4 + (int)(tid / 32 % 4)) * kEpiWarpBytes + kOffAmax) + par * 2 * kHalfRows;
            if (q == 0) {
                xamax[wg * kHalfRows + hr] = amax_lo;
                xamax[wg * kHalfRows + hr + 8] = amax_hi;
            }
            mf__named_barrier_sync(kBarAmax, kConsumerThreads);
            amax_lo = fmaxf(amax_lo, xamax[(1 - wg) * kHalfRows + hr]);
            amax_hi = fmaxf(amax_hi, xamax[(1 - wg) * kHalfRows + hr + 8]);
        }
        float sc_lo, inv_lo, sc_hi, inv_hi;
        mf__fp8_block_scale(amax_lo, p.ue8m0, &sc_lo, &inv_lo);
        mf__fp8_block_scale(amax_hi, p.ue8m0, &sc_hi, &inv_hi);
        stage_fp8<kBoxAcc / 2>(c, acc, inv_lo, inv_hi);
        if (q == 0 && c.wg == 0) { /* both warpgroups hold the same scale: one writes it */
            const int32_t sblocks = I / MF__QUANT_BLOCK;
            if (wr + g >= t.lo) p.out_scales[(int64_t)(t.row0 + wr + g) * sblocks + t.nb] = sc_lo;
            if (wr + g + 8 >= t.lo) p.out_scales[(int64_t)(t.row0 + wr + g + 8) * sblocks + t.nb] = sc_hi;
        }
        /* 64-byte rows: lane l copies chunk l % 4 of rows l / 4 and 8 + l / 4 */
        __syncwarp();
        const int ch = c.lane % 4;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int r = 8 * i + c.lane / 4;
            const uint4 v = *(const uint4 *)(c.epi + r * kEpiRowBytes + ((ch ^ (r & 7)) * kChunk));
            uint8_t *dst = row_at<kEpi>(p, t, wr + r, (int64_t)I, (int64_t)t.nb * kHCols + c.wg * (kHCols / 2) + ch * kChunk);
            if (dst) *(uint4 *)dst = v;
        }
        __syncwarp();
    }
}

/* BF16: a tile's kind picks its main loop and epilogue; the next tile is learnt after the epilogue. */
template <int kEpi>
__device__ __forceinline__ void consumer_bf16(const tma_params &tp, const tables_t &tb, consumer_t &c, float *acc) {
    const gemm_params &p = tp.p;
    const int32_t nblocks = n_blocks<kEpi>(p);
    const int32_t kblocks = (p.K * 2 + kKBlock - 1) / kKBlock;
    uint32_t it = 0;
    int32_t cursor = 0, idx = (int32_t)blockIdx.x;
    tile_t t;
    if (!next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, idx, cursor, t)) return;
    /* the first tile's kind is the producer's word too (its stage 0); each warpgroup takes every
     * code from its leader (lead_code: see "Bounded waits") */
    bool half = code_half(lead_code(c, c.wg, 0, ring_t::wait_full(c.full, 0, *c.sink)));
    for (;;) {
        if (half) {
            bf16_mainloop<true>(c, acc, it, kblocks);
            half_epilogue<false, kEpi>(p, c, t, acc, 0);
        } else {
            bf16_mainloop<false>(c, acc, it, kblocks);
            epilogue<false, kEpi>(p, c, t, acc);
        }
        /* the next tile is the one the producer put into the next stage (-1: none) */
        const int32_t code = lead_code(c, wg_here(), ring_t::slot(it), ring_t::wait_full(c.full, it, *c.sink));
        if (code < 0) break;
        next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, code_tile(code), cursor, t);
        half = code_half(code);
    }
}

/* FP8 (issue order, epilogue overlap): a tile's kind picks its main loop and epilogue; the overlap's
 * issue takes the next tile's kind from tile_of. */
template <int kEpi>
__device__ __forceinline__ void consumer_fp8(const tma_params &tp, const tables_t &tb, consumer_t &c, float *acc,
                                             float *tmp) {
    const gemm_params &p = tp.p;
    const int32_t nblocks = n_blocks<kEpi>(p);
    const int32_t kblocks = (p.K + kKBlock - 1) / kKBlock; /* the producer's count */
    uint32_t it = 0, par = 0;
    int32_t cursor = 0, idx = (int32_t)blockIdx.x;
    tile_t t;
    if (!next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, idx, cursor, t)) return;
    /* issue order: WG 1's arrival lets WG 0 issue its first group; WG 0 takes WG 1's last at the end */
    if (c.wg == 1) mf__named_barrier_arrive(kBarIssued1, kConsumerThreads);
    /* the next tile's first wgmmas overlap this tile's epilogue (see "Epilogue overlap"); the first
     * tile's kind is the producer's word too (its stage 0), taken from WG 0's leader (lead_code,
     * fp8_issue_first: see "Bounded waits") */
    bool half;
    {
        const bool gave_up = ring_t::wait_full(c.full, 0, *c.sink);
        half = code_half(lead_code<kConsumerThreads>(c, 1, 0, gave_up));
        fp8_issue_at(tmp, c.desc_stages, c.wg, a_off(half, c.wg), b_off(half, c.wg, 0));
    }
    for (;;) {
        if (half) {
            half_kblock<kEpi, true, true>(c, acc, tmp, it++);
            for (int32_t kb = 1; kb < kblocks; kb++) half_kblock<kEpi, false, false>(c, acc, tmp, it++);
        } else {
            fp8_kblock<true, true>(c, acc, tmp, it++);
            for (int32_t kb = 1; kb < kblocks; kb++) fp8_kblock<false, false>(c, acc, tmp, it++);
        }
        /* The next tile is the one the producer put into the next stage (WG 0's leader's code of it;
         * -1: none); its kind now (its first group goes out before the epilogue), the tile itself
         * after it, from code_of again (nothing of the next tile stays live through the epilogue:
         * the word is not rewritten before this warpgroup passes kStages more positions). Issued
         * unconditionally (wgmmas on a divergent path serialise too): without a next tile it reruns
         * the last, consumed stage into tmp and is dropped. */
        {
            const bool gave_up = ring_t::wait_full(c.full, it, *c.sink);
            const int32_t code0 = wg_here() == 0 ? lead_code(c, 0, ring_t::slot(it), gave_up) : 0;
            fp8_issue_first(tmp, c, it, it - 1, code0);
        }
        if (half) {
            half_epilogue<true, kEpi>(p, c, t, acc, par);
            par ^= 1u;
        } else {
            epilogue<true, kEpi>(p, c, t, acc);
        }
        const int32_t code = code_of(c, 0)[ring_t::slot(it)];
        if (code < 0) break;
        next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, code_tile(code), cursor, t);
        half = code_half(code);
    }
    mf__wgmma_wait<0>();
    if (c.wg == 0) mf__named_barrier_sync(kBarIssued1, kConsumerThreads);
}

/* The shipped kernel: kFp8 (E4M3 with block scales, else BF16) x kEpi (kEpiPlain: W2, kEpiSwiglu:
 * W13), tail tiles as tp.tails says. The lab's A/B kernels (without the issue order or the epilogue
 * overlap, full tiles only, and the timing probes) are its fork in dev/cuda/sm90_tma_lab_kernel.cuh,
 * never compiled into the library. */
template <bool kFp8, int kEpi>
__global__ void __launch_bounds__(kThreads, 1) sm90_tma_kernel(const __grid_constant__ tma_params tp) {
    const gemm_params &p = tp.p;
    /* full[s]: the producer's arrive.expect_tx, + FP8 one cp.async arrival per producer lane */
    constexpr uint32_t kFullArrivals = kFp8 ? 1 + 32 : 1;
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = smem_raw + align_pad(smem_raw);
    uint8_t *stages = smem + kOffStages;
    float *a_sc = (float *)(smem + kOffAScales);
    float *w_sc = (float *)(smem + kOffWScales);
    uint64_t *full = (uint64_t *)(smem + kOffBars);
    uint64_t *empty = full + kStages;
    int32_t *tile_of = (int32_t *)(smem + kOffTileOf);
    tables_t tb;
    tables_at<kMaxExperts>(tb, smem + kOffTables);
    if (threadIdx.x == 0 && tp.tails) {
        mf__prefetch_tensormap(&tp.tmap_a64);
        if (kEpi == kEpiSwiglu) mf__prefetch_tensormap(&tp.tmap_w64);
    }
    /* first[e]: the m-blocks of the experts < e */
    prologue<kStages, true>(p, full, empty, kFullArrivals, tb, [](int32_t rows) { return (rows + kBlockM - 1) / kBlockM; });

    if (producer_role()) {
        if (mf__warp_id() == 0) producer<kFp8, kEpi>(tp, tb, stages, a_sc, w_sc, tile_of, full, empty);
    } else {
        consumer_t c;
        consumer_at(c, smem);
        c.sink = &p.sink;
        float acc[kAcc];
        if constexpr (kFp8) {
            float tmp[kBoxAcc];
#pragma unroll
            for (int i = 0; i < kBoxAcc; i++) tmp[i] = 0.0f;
            consumer_fp8<kEpi>(tp, tb, c, acc, tmp);
        } else {
            consumer_bf16<kEpi>(tp, tb, c, acc);
        }
        if (threadIdx.x == kMfWarpgroupThreads) mf__pipeline_check(p.sink, kTagProducerEmpty);
    }
}

/* ---- host: what every launch of the kernel (gemm_tma.cu, the lab's fork) sets up ------------------ */

/* Encodes tp's activation map ([kMaxRowCoord, K] from `a`, 128-row boxes) and weight map ([L N, K]
 * from `w`, 128-row boxes), both 128B-swizzled; tp->p's K, N and num_experts must be set.
 * CUDA_SUCCESS, or the driver's result with *which naming the map ("activation", "weight"). */
static inline CUresult encode_maps(tma_params *tp, int fp8, const void *a, const void *w, const char **which) {
    gemm_params *p = &tp->p;
    const int esz = fp8 ? 1 : 2;
    const uint64_t kbytes = (uint64_t)p->K * esz;
    const CUtensorMapDataType dt = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    *which = "activation";
    CUresult r = mf__tma_encode_2d(&p->tmap_a, dt, a, (uint64_t)p->K, (uint64_t)kMaxRowCoord, kbytes,
                                   (uint32_t)(kKBlock / esz), (uint32_t)kBlockM, CU_TENSOR_MAP_SWIZZLE_128B);
    if (r != CUDA_SUCCESS) return r;
    *which = "weight";
    return mf__tma_encode_2d(&p->tmap_w, dt, w, (uint64_t)p->K, (uint64_t)p->num_experts * p->N, kbytes,
                             (uint32_t)(kKBlock / esz), (uint32_t)kBoxRows, CU_TENSOR_MAP_SWIZZLE_128B);
}

/* The tail tiles' maps: activations with 64-row boxes and (SwiGLU only: plain tail tiles load the
 * full tile's weight boxes) weights with 64-row boxes, like encode_maps'. CUDA_SUCCESS or the
 * driver's result (the launcher then runs full tiles only). */
static inline CUresult encode_tail_maps(tma_params *tp, int fp8, int swiglu, const void *a, const void *w) {
    const gemm_params *p = &tp->p;
    const int esz = fp8 ? 1 : 2;
    const uint64_t kbytes = (uint64_t)p->K * esz;
    const CUtensorMapDataType dt = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    CUresult r = mf__tma_encode_2d(&tp->tmap_a64, dt, a, (uint64_t)p->K, (uint64_t)kMaxRowCoord, kbytes,
                                   (uint32_t)(kKBlock / esz), (uint32_t)kHalfRows, CU_TENSOR_MAP_SWIZZLE_128B);
    if (r != CUDA_SUCCESS || !swiglu) return r;
    return mf__tma_encode_2d(&tp->tmap_w64, dt, w, (uint64_t)p->K, (uint64_t)p->num_experts * p->N, kbytes,
                             (uint32_t)(kKBlock / esz), (uint32_t)kHalfRows, CU_TENSOR_MAP_SWIZZLE_128B);
}

/* The persistent grid: one CTA per SM, never more than the tiles of the largest possible problem
 * (`max_rows` rows per expert). */
static inline int grid_of(const gemm_params *p, int32_t max_rows, int sms) {
    const int64_t tiles = (int64_t)p->num_experts * ((max_rows + kBlockM - 1) / kBlockM) * (p->N / kTileN);
    return (int)(tiles < sms ? tiles : sms);
}

} /* namespace mf__tma */

/* What gemm_tma.cu ships, for the lab and for diagnostics: fills up to `max` entries (NULL: none) of
 * mf__gemm_variant_info_t (cuda/gemm_family.cuh) for the current device (loads the kernels) and
 * returns the number of variants, or -1 on a CUDA error. */
typedef struct mf__gemm_variant_info mf__gemm_variant_info_t;
int mf__sm90_tma_variants(mf__gemm_variant_info_t *out, int max);


#endif /* MF_CUDA_KERNELS_SM90_TMA_GEMM_CUH */
