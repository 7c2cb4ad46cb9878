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
 * stage's tile into tile_of[slot] before its arrival and ends with one stage of tile -1 and no
 * data; the consumers learn their next tile there. The last CTA to finish zeroes the pair.
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
 * it exists only so that a broken pipeline can never hang the GPU.
 *
 * Limits (the launchers decline anything else): plain N a multiple of 256, swiglu N = 2I with I a
 * multiple of 128; K * element bytes a multiple of 16 (FP8: K a multiple of 128; BF16 K tails past
 * a 64-element stage are TMA zero fill); L <= kMaxExperts; L * N < 2^31; 16-byte aligned data,
 * 4-byte aligned scales.
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
       kBarIssued1 = 2 };                                  /* WG 1 issued group i: WG 0 may issue group i + 1 */

/* The shared-memory map (offsets from the 1024-aligned base). */
constexpr int kOffStages = 0;
constexpr int kOffEpi = kOffStages + kStages * kStageBytes;
constexpr int kOffAScales = kOffEpi + kConsumerWarps * kEpiWarpBytes;  /* [kStages][128] f32 */
constexpr int kOffWScales = kOffAScales + kStages * kBlockM * 4;       /* [kStages][4] f32 */
constexpr int kOffBars = kOffWScales + kStages * kWScaleSlots * 4;    /* full[kStages], empty[kStages] */
constexpr int kOffTileOf = kOffBars + 2 * kStages * 8;                /* tile_of[kStages]: the tile of each stage */
constexpr int kOffTables = kOffTileOf + kStages * 4;                  /* rows[L], row0[L], first[L + 1] */
constexpr int kSmemBytes = kOffTables + (3 * kMaxExperts + 1) * 4 + kMfSwizzleAtomBytes /* base slack */;

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

/* First weight row (of the [L * N, K] map) of box b of tile t. */
template <int kEpi>
__device__ __forceinline__ int32_t weight_row(const gemm_params &p, const tile_t &t, int b) {
    if (kEpi == kEpiSwiglu) return t.e * p.N + b * (p.N / 2) + t.nb * kBoxRows; /* b = 0 gate, 1 up */
    return t.e * p.N + t.nb * kTileN + b * kBoxRows;
}

/* ---- producer: warp 0; lane 0 issues the TMA, FP8: all lanes copy the scales ---------------- */

template <bool kFp8, int kEpi>
__device__ __forceinline__ void producer(const gemm_params &p, const tables_t &tb, int32_t nblocks, uint8_t *stages,
                                         float *a_sc, float *w_sc, int32_t *tile_of, uint64_t *full, uint64_t *empty) {
    const int lane = (int)(threadIdx.x & 31);
    const int32_t kblocks = (p.K * (kFp8 ? 1 : 2) + kKBlock - 1) / kKBlock; /* FP8: K/128 scale columns */
    uint32_t it = 0;
    int32_t cursor = 0;
    tile_t t;
    for (int32_t idx = (int32_t)blockIdx.x; next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, idx, cursor, t);
         idx = next_idx(p.sched, idx, lane)) {
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
                tile_of[slot] = idx; /* published by the arrive below */
                mf__mbar_arrive_expect_tx(&full[slot], (uint32_t)kStageBytes);
                mf__tma_load_2d(st, &p.tmap_a, &full[slot], kc, t.row0);
#pragma unroll
                for (int b = 0; b < kBoxes; b++) mf__tma_load_2d(st + kABytes + b * kBoxBytes, &p.tmap_w, &full[slot], kc, wrow[b]);
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

/* FP8: issues the 4 k32 wgmmas of box b of the stage at `st` for warpgroup `wg` into `tmp` (the
 * first overwrites), in turn with the other warpgroup (see "Issue order"). */
__device__ __forceinline__ void fp8_issue(float *tmp, uint64_t desc_st, int wg, int b) {
    const uint64_t da = mf__wgmma_desc_advance(desc_st, wg * kWgOperandBytes);
    const uint64_t db = mf__wgmma_desc_advance(desc_st, kABytes + b * kBoxBytes);
    mf__fence_fragment<kBoxRows>(tmp); /* the last promotion's reads of tmp come first */
    mf__named_barrier_sync(wg == 0 ? kBarIssued1 : kBarIssued0, kConsumerThreads);
    mf__wgmma_fence();
#pragma unroll
    for (int k = 0; k < kKSteps; k++)
        mf__wgmma_e4m3<kBoxRows>(tmp, mf__wgmma_desc_advance(da, k * kKStepBytes), mf__wgmma_desc_advance(db, k * kKStepBytes),
                                 k > 0 ? 1 : 0);
    mf__wgmma_commit();
    mf__named_barrier_arrive(wg == 0 ? kBarIssued0 : kBarIssued1, kConsumerThreads);
}

/* FP8 promotion of one box: acc (+)= tmp * scale (rows r: s_lo, r + 8: s_hi); kFirst assigns. */
template <bool kFirst>
__device__ __forceinline__ void fp8_promote(float *acc, const float *tmp, float s_lo, float s_hi) {
#pragma unroll
    for (int j = 0; j < kBoxAcc / 4; j++) {
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
    const int32_t *tile_of; /* [kStages]: the tile each stage belongs to (-1: the end) */
    uint8_t *epi;           /* this warp's staging buffer */
    int wg, warp, lane;     /* consumer warpgroup (0, 1), warp in it, lane */
    int row_lo;             /* tile row of acc[4j + 0, 1]; acc[4j + 2, 3] are row_lo + 8 */
    const mf__fault_sink_t *sink; /* the params' (an expired wait records itself there) */
};

__device__ __forceinline__ void release(const consumer_t &c, uint32_t slot) { release_stage(c.empty, slot, c.lane); }

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

/* BF16: the whole K loop of one tile into acc (the first wgmma overwrites). */
__device__ __forceinline__ void bf16_mainloop(const consumer_t &c, float *acc, uint32_t &it, int32_t kblocks) {
    int32_t prev = -1;
    mf__fence_fragment<kTileN>(acc); /* the previous epilogue's reads of acc come first */
    for (int32_t kb = 0; kb < kblocks; kb++, it++) {
        const uint32_t slot = ring_t::slot(it);
        ring_t::wait_full(c.full, it, *c.sink);
        const uint64_t desc_st = mf__wgmma_desc_advance(c.desc_stages, slot * kStageBytes);
        const uint64_t da = mf__wgmma_desc_advance(desc_st, c.wg * kWgOperandBytes);
        const uint64_t db = mf__wgmma_desc_advance(desc_st, kABytes);
        mf__wgmma_fence();
#pragma unroll
        for (int k = 0; k < kKSteps; k++)
            mf__wgmma_bf16<kTileN>(acc, mf__wgmma_desc_advance(da, k * kKStepBytes),
                                   mf__wgmma_desc_advance(db, k * kKStepBytes), (kb > 0 || k > 0) ? 1 : 0);
        mf__wgmma_commit();
        mf__wgmma_wait<1>();
        if (prev >= 0) release(c, (uint32_t)prev);
        prev = (int32_t)slot;
    }
    mf__wgmma_wait<0>();
    if (prev >= 0) release(c, (uint32_t)prev);
    mf__fence_fragment<kTileN>(acc);
}

/* Where row r of the warp's 16 goes (bytes), or NULL when the row does not belong to the tile (or,
 * with `ret`, its source entry is invalid): `row_bytes` apart in `out`, from column byte `col_bytes`. */
template <int kEpi>
__device__ __forceinline__ uint8_t *row_target(const gemm_params &p, const consumer_t &c, const tile_t &t, int r,
                                               int64_t row_bytes, int64_t col_bytes) {
    const int tr = c.wg * kWgRows + c.warp * kWarpRows + r; /* tile row */
    if (tr < t.lo) return NULL;
    const int64_t row = (int64_t)t.row0 + tr;
    if (kEpi == kEpiPlain && p.use_ret) {
        uint8_t *dst;
        return ret_row(p, p.src, row, p.N, dst) ? dst + col_bytes : NULL;
    }
    return p.out + row * row_bytes + col_bytes;
}

/* The targets of the 4 rows lane `c.lane` copies out of the staging buffer (rows 4 i + lane / 8,
 * its 16-byte chunk lane % 8 of each), at column byte `col_bytes`: NULL where the row is not stored.
 * Computed once per tile (row_target reads `src` for `ret`); every pass adds its column offset. */
template <int kEpi>
__device__ __forceinline__ void row_targets(const gemm_params &p, const consumer_t &c, const tile_t &t, int64_t row_bytes,
                                            int64_t col_bytes, uint8_t *(&dst)[4]) {
#pragma unroll
    for (int i = 0; i < 4; i++)
        dst[i] = row_target<kEpi>(p, c, t, 4 * i + c.lane / 8, row_bytes, col_bytes + (c.lane % 8) * kChunk);
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
 * stmatrix (matrix m of an x4: rows 8 (m & 1) .. + 7, column chunk jj + (m >> 1)). */
__device__ __forceinline__ void stage_bf16(const consumer_t &c, const float *v, int pass) {
    const int m = c.lane / 8, rr = c.lane & 7, r = (m & 1) * 8 + rr;
#pragma unroll
    for (int jj = 0; jj < 8; jj += 2) {
        const int j = pass * 8 + jj;
        const int ch = jj + (m >> 1);
        mf__stmatrix_x4(c.epi + r * kEpiRowBytes + ((ch ^ rr) * kChunk), mf__cvt_bf16x2(v[4 * j + 0], v[4 * j + 1]),
                        mf__cvt_bf16x2(v[4 * j + 2], v[4 * j + 3]), mf__cvt_bf16x2(v[4 * j + 4], v[4 * j + 5]),
                        mf__cvt_bf16x2(v[4 * j + 6], v[4 * j + 7]));
    }
}

template <bool kFp8, int kEpi>
__device__ __forceinline__ void epilogue(const gemm_params &p, const consumer_t &c, const tile_t &t, float *acc) {
    if constexpr (kEpi == kEpiPlain) {
        uint8_t *dst[4];
        row_targets<kEpi>(p, c, t, (int64_t)p.N * 2, (int64_t)t.nb * kTileN * 2, dst);
#pragma unroll
        for (int pass = 0; pass < kTileN / 64; pass++) {
            stage_bf16(c, acc, pass);
            copy_out(c, dst, pass * 64 * 2);
        }
    } else if constexpr (!kFp8) {
        /* SwiGLU: h = silu(gate) * up, in place over the gate fragment */
#pragma unroll
        for (int i = 0; i < kBoxAcc; i++) acc[i] = mf__silu(acc[i]) * acc[kBoxAcc + i];
        const int32_t I = p.N / 2;
        uint8_t *dst[4];
        row_targets<kEpi>(p, c, t, (int64_t)I * 2, (int64_t)t.nb * kHCols * 2, dst);
#pragma unroll
        for (int pass = 0; pass < kHCols / 64; pass++) {
            stage_bf16(c, acc, pass);
            copy_out(c, dst, pass * 64 * 2);
        }
    } else {
#pragma unroll
        for (int i = 0; i < kBoxAcc; i++) acc[i] = mf__silu(acc[i]) * acc[kBoxAcc + i];
        const int32_t I = p.N / 2;
        /* FP8 1x128: the tile's 128 h columns are one scale block; a row's values sit in the 4
         * lanes of a quad */
        float amax_lo = 0.0f, amax_hi = 0.0f;
#pragma unroll
        for (int j = 0; j < kBoxAcc / 4; j++) {
            amax_lo = fmaxf(amax_lo, fmaxf(fabsf(acc[4 * j + 0]), fabsf(acc[4 * j + 1])));
            amax_hi = fmaxf(amax_hi, fmaxf(fabsf(acc[4 * j + 2]), fabsf(acc[4 * j + 3])));
        }
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
            amax_lo = fmaxf(amax_lo, __shfl_xor_sync(0xffffffffu, amax_lo, o));
            amax_hi = fmaxf(amax_hi, __shfl_xor_sync(0xffffffffu, amax_hi, o));
        }
        float sc_lo, inv_lo, sc_hi, inv_hi;
        mf__fp8_block_scale(amax_lo, p.ue8m0, &sc_lo, &inv_lo);
        mf__fp8_block_scale(amax_hi, p.ue8m0, &sc_hi, &inv_hi);
        const int g = c.lane / 4, q = c.lane % 4;
        uint8_t *row_lo = c.epi + g * kEpiRowBytes, *row_hi = c.epi + (g + 8) * kEpiRowBytes;
#pragma unroll
        for (int j = 0; j < kBoxAcc / 4; j++) {
            /* columns 8 j + 2 q, + 1: chunk j / 2, bytes (j & 1) 8 + 2 q of it; rows g and g + 8 share the swizzle */
            const int at = (((j >> 1) ^ g) * kChunk) + (j & 1) * 8 + 2 * q;
            *(uint16_t *)(row_lo + at) = mf__cvt_e4m3x2(acc[4 * j + 0] * inv_lo, acc[4 * j + 1] * inv_lo);
            *(uint16_t *)(row_hi + at) = mf__cvt_e4m3x2(acc[4 * j + 2] * inv_hi, acc[4 * j + 3] * inv_hi);
        }
        if (q == 0) {
            const int32_t sblocks = I / MF__QUANT_BLOCK;
            const int tr = c.row_lo;
            if (tr >= t.lo) p.out_scales[(int64_t)(t.row0 + tr) * sblocks + t.nb] = sc_lo;
            if (tr + 8 >= t.lo) p.out_scales[(int64_t)(t.row0 + tr + 8) * sblocks + t.nb] = sc_hi;
        }
        uint8_t *dst[4];
        row_targets<kEpi>(p, c, t, (int64_t)I, (int64_t)t.nb * kHCols, dst);
        copy_out(c, dst, 0);
    }
}

template <bool kFp8, int kEpi>
__device__ __forceinline__ void consumer(const gemm_params &p, const tables_t &tb, int32_t nblocks, consumer_t &c,
                                         float *acc, float *tmp) {
    const int32_t kblocks = (p.K * (kFp8 ? 1 : 2) + kKBlock - 1) / kKBlock;
    uint32_t it = 0;
    int32_t cursor = 0, idx = (int32_t)blockIdx.x;
    tile_t t;
    if (!next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, idx, cursor, t)) return;
    /* FP8 issue order: WG 1's arrival lets WG 0 issue its first group; WG 0 takes WG 1's last at the end */
    if (kFp8 && c.wg == 1) mf__named_barrier_arrive(kBarIssued1, kConsumerThreads);
    /* FP8: the next tile's first wgmmas overlap this tile's epilogue (see "Epilogue overlap") */
    if constexpr (kFp8) {
        ring_t::wait_full(c.full, 0, p.sink);
        fp8_issue(tmp, c.desc_stages, c.wg, 0);
    }
    for (;;) {
        if constexpr (kFp8) {
            fp8_kblock<true, true>(c, acc, tmp, it++);
            for (int32_t kb = 1; kb < kblocks; kb++) fp8_kblock<false, false>(c, acc, tmp, it++);
        } else {
            bf16_mainloop(c, acc, it, kblocks);
        }
        /* The next tile is the one the producer put into the next stage (tile_of; -1: none):
         * FP8, with the overlap, learns it before its epilogue, BF16 after. */
        int32_t idx_next = -1;
        if constexpr (kFp8) {
            ring_t::wait_full(c.full, it, *c.sink);
            idx_next = c.tile_of[ring_t::slot(it)];
            /* issued unconditionally (wgmmas on a divergent path serialise too): without a next
             * tile it reruns the last, consumed stage into tmp and the result is dropped */
            const uint32_t at = idx_next >= 0 ? it : it - 1;
            fp8_issue(tmp, mf__wgmma_desc_advance(c.desc_stages, ring_t::slot(at) * kStageBytes), c.wg, 0);
        }
        epilogue<kFp8, kEpi>(p, c, t, acc);
        if constexpr (!kFp8) {
            ring_t::wait_full(c.full, it, *c.sink);
            idx_next = c.tile_of[ring_t::slot(it)];
        }
        if (idx_next < 0) break;
        idx = idx_next;
        next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, idx, cursor, t);
    }
    if constexpr (kFp8) mf__wgmma_wait<0>();
    if (kFp8 && c.wg == 0) mf__named_barrier_sync(kBarIssued1, kConsumerThreads);
}

/* The shipped kernel: kFp8 (E4M3 with block scales, else BF16) x kEpi (kEpiPlain: W2, kEpiSwiglu:
 * W13). The lab's A/B kernels (without the issue order or the epilogue overlap, and the timing
 * probes) are its fork in dev/cuda/sm90_tma_lab_kernel.cuh, never compiled into the library. */
template <bool kFp8, int kEpi>
__global__ void __launch_bounds__(kThreads, 1) sm90_tma_kernel(const __grid_constant__ gemm_params p) {
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
    const int32_t nblocks = kEpi == kEpiSwiglu ? p.N / (2 * kHCols) : p.N / kTileN; /* n-blocks per expert */
    /* first[e]: the m-blocks of the experts < e */
    prologue<kStages, true>(p, full, empty, kFullArrivals, tb, [](int32_t rows) { return (rows + kBlockM - 1) / kBlockM; });

    if (producer_role()) {
        if (mf__warp_id() == 0) producer<kFp8, kEpi>(p, tb, nblocks, stages, a_sc, w_sc, tile_of, full, empty);
    } else {
        consumer_t c;
        const int ctid = (int)threadIdx.x - kMfWarpgroupThreads; /* 0..255 */
        c.wg = ctid / kMfWarpgroupThreads;
        c.warp = (ctid / 32) % 4;
        c.lane = ctid & 31;
        c.row_lo = c.wg * kWgRows + c.warp * kWarpRows + c.lane / 4;
        c.desc_stages = mf__wgmma_desc_sw128(stages);
        c.a_sc = a_sc;
        c.w_sc = w_sc;
        c.full = full;
        c.empty = empty;
        c.tile_of = tile_of;
        c.epi = smem + kOffEpi + (c.wg * 4 + c.warp) * kEpiWarpBytes;
        c.sink = &p.sink;
        float acc[kAcc];
        float tmp[kFp8 ? kBoxAcc : 1];
#pragma unroll
        for (int i = 0; i < (kFp8 ? kBoxAcc : 1); i++) tmp[i] = 0.0f;
        consumer<kFp8, kEpi>(p, tb, nblocks, c, acc, tmp);
        if (threadIdx.x == kMfWarpgroupThreads) mf__pipeline_check(p.sink, kTagProducerEmpty);
    }
}

/* ---- host: what every launch of the kernel (gemm_tma.cu, the lab's fork) sets up ------------------ */

/* Encodes p's activation map ([kMaxRowCoord, K] from `a`, 128-row boxes) and weight map ([L N, K]
 * from `w`, 128-row boxes), both 128B-swizzled; p's K, N and num_experts must be set. CUDA_SUCCESS,
 * or the driver's result with *which naming the map ("activation", "weight"). */
static inline CUresult encode_maps(gemm_params *p, int fp8, const void *a, const void *w, const char **which) {
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
