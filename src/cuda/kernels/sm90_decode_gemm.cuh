/*
 * sm90_decode_gemm.cuh — the Hopper (sm_90a) grouped expert GEMM for DECODE (a handful of rows per
 * expert), BF16 and block-FP8: the kernel of the grouped GEMM dispatcher's decode family
 * (cuda/grouped_gemm.h), launched by src/cuda/gemm_decode.cu. dev/cuda/sm90_decode_lab.cu
 * validates and times it through those launchers. The job of the kernel is to stream the routed
 * experts' weights at full HBM bandwidth: at 8..64 rows per expert the GEMM is a weight copy with
 * a little arithmetic on the side.
 *
 * Dimension legend: L local experts, N weight rows per expert (the GEMM's output dim: 2I for W13,
 * H for W2), K the reduction dim (H for W13, I for W2), H hidden, I intermediate, T = kBlockT
 * tokens (receive rows of one expert) per tile, C masked capacity.
 *
 *   plain (W2):      out[rows, N] = bf16(a[rows, K] . W[e]^T)      W[e] = [N, K]; rows go to out[row]
 *                    or, with `ret`, to the owner's combine slot (token K + k) H at view.heap[rank] +
 *                    view.combine
 *   swiglu (W13):    h[rows, I] = silu(a . Wg^T) * (a . Wu^T)      W[e] = [Wg; Wu] = [2I, K]
 *                    BF16: h rounded to BF16; FP8: h requantised 1x128 (h_fp8 + h_scales [rows, I/128])
 *
 * Swap A/B. The weights are wgmma's A operand (64 weight rows per warpgroup, K-major, 128B swizzle,
 * loaded by TMA) and the expert's activation rows are the B operand (wgmma N = kBlockT in
 * {8, 16, 32, 64}, one [kBlockT x 128 B] tile per K block): D[w_row, column] accumulates in fp32 and
 * the epilogue stores it transposed, out[row, n]. D[:, j] depends on B row j alone, so a column
 * holding garbage (another expert's row, padding, NaN) never reaches a stored column.
 *
 * Token blocks and the column shift. Tile column j holds receive row t.row0 + j; the columns that
 * belong to the tile are [t.lo, kBlockT). A full token block has lo = 0; the last, partial block of
 * an expert (v < kBlockT rows left) is shifted so that it ENDS at the expert's last row: row0 =
 * (expert's end) - kBlockT, lo = kBlockT - v. Hence no tile ever addresses a row at or past the end
 * of its expert's rows, which is what lets the activation tensor map span 2^31 - 1 rows (the
 * launchers do not know the receive tensor's length): rows below the expert are another expert's
 * rows or padding (read, never stored), rows below 0 are TMA zero fill (coordinates are signed).
 *
 * Activation sources (kGather, W13 only):
 *   contiguous: one TMA box [kBlockT rows x 128 B] per K block at (k, row0), 128B swizzle.
 *   gathered:   a.gather (the direct dataflow): column j's row lives at its owner, view.heap[rank] +
 *               view.x + token * K bytes (src[3 row] = (rank, token, k)); the producer warp copies it with
 *               16-byte cp.asyncs into the layout TMA would produce (chunk c of row j at chunk
 *               c ^ (j & 7) of the row's 128 B, rows 128 B apart, tile 1024-B aligned) and arrives
 *               on the full barrier with cp.async.mbarrier.arrive.noinc. Columns below lo are not
 *               written (stale shared memory: harmless, see above). The consumers issue
 *               fence.proxy.async after the full wait: cp.async writes are generic-proxy writes and
 *               wgmma reads shared memory through the async proxy.
 *   The arithmetic does not depend on the source: the same rows give the same bits.
 *
 * Work. A tile is (expert with rows, n-block, token block): plain n-blocks are 128 weight rows
 * (= 128 output columns; consumer warpgroup g takes rows [64g, 64g + 64)); swiglu n-blocks are 128
 * h columns: gate rows [n0, n0 + 128) and up rows [I + n0, I + n0 + 128), warpgroup g takes gate
 * and up rows [64g, 64g + 64) of each, so that h = silu(g) * u is element-wise on two fragments of
 * the same layout and a token's 128 h columns (one FP8 scale block) are all in the tile. Token
 * blocks (more than kBlockT rows in one expert) are the innermost tile index: their CTAs run at the
 * same time and read the same weights, the second one from L2. The grid is persistent (one CTA per
 * SM): CTA b's first tile is b; then, with a schedule pair (seg->sched) and more tiles than CTAs,
 * the producer takes the next tile by ticket (sm90_core.cuh next_idx: an SM that streams faster
 * takes more tiles; CTAs' rates differ by up to 1.5x at T = 1, `sm90_decode_lab --timeline`),
 * otherwise b + grid, ...; it puts each stage's tile into tile_of[slot] and ends with a stage of
 * tile -1, which the consumers follow. Experts without rows have no tiles, so they cost nothing. The
 * counts and offsets are read on the device (CUDA-graph capturable) into shared-memory tables
 * at kernel start (a warp scan gives each expert's first tile); counts are clamped to
 * [0, max_rows]. Before that read the kernel waits for the previous kernel (mf__pdl_wait,
 * cuda/pdl.cuh; barrier init runs before it) and then lets the next one start (mf__pdl_trigger).
 * (The tensor-map prefetch stays in the producer: moved into the prologue it cost one variant
 * a 4-byte spill.)
 *
 * Pipeline. Warpgroup 0 is the producer (setmaxnreg 40; one warp issues everything), warpgroups 1
 * and 2 are the consumers (setmaxnreg 232). kStages stages ring through shared memory, each holding
 * one K block of 128 bytes (FP8: 128 elements = one scale block; BF16: 64): the weight boxes
 * (1 or 2 x [128 rows x 128 B] = 16 / 32 KB), the activation tile [kBlockT x 128 B] and, for FP8,
 * the scales of that K block (a_scale of each column by cp.async, columns below lo copying column
 * lo's; w_scale of each weight box). full[s]: the producer's arrive.expect_tx of the stage's TMA
 * bytes (a partly out-of-bounds box still delivers its full size) + for FP8 or gathered rows one
 * cp.async.mbarrier.arrive.noinc per producer lane (init count 1 + 32); empty[s]: one arrival per
 * consumer warp after its wgmmas completed and its scale reads were done. The producer runs ahead
 * across tile boundaries, so the consumers' epilogue hides under the next tile's loads. The ring
 * index `it` counts stages over the whole persistent loop in both roles: slot = it % kStages,
 * parity = (it / kStages) & 1 (the producer waits empty with the opposite parity; a fresh
 * barrier's "previous phase" counts as done).
 *
 * L2 a ring ahead (gemm_params.l2_ring, MF_DECODE_L2=1; off by default, for A/B measurements). With
 * K block kb's weight boxes the producer sends K block kb + kStages's into L2
 * (cp.async.bulk.prefetch.tensor, a hint: nothing waits for it, the bits do not change), so a CTA
 * has twice the ring's weight bytes on their way. The question it answers (bench/NOTES.md "Issue
 * 25: L2 a ring ahead"): whether the 64-token tile streams at 80 % of DRAM where the 32-token one
 * reaches 89 % (Nsight Compute, qwen3 W13 at L = 128) because its ring holds fewer stages. Not yet
 * measured here; the same prefetch in the small kernel ran every decode row 17-25 % slower on an
 * H100 (2026-12-05) and was removed there: measure it before anything relies on it.
 *
 * Bounded waits. Every mbarrier wait gives up after kWaitTimeoutNs (20 s) of %globaltimer, records
 * itself in the calling comm's fault sink (gemm_params.sink) and returns (mf__mbar_wait_bounded,
 * sm90_ptx.cuh). The bound is far above any healthy wait, a slow but live peer included (gathered rows
 * are peer reads): it exists only so that a broken pipeline can never hang the GPU. Once a wait has
 * given up, every later wait of the family returns at once and the producer drains too, overwriting
 * stages whose tile code (tile_of) a consumer is still to read: consumer threads that each read the
 * code could disagree on the next tile, and one would wait forever at the epilogue's named barrier.
 * So the 256 take every tile code from one thread: it writes the code, or -1 when its own wait gave
 * up (the consumers end within a tile), into a word after tile_of, then a sync of the epilogue's
 * barrier (kBarEpilogue) and all read it. The word is next written after the tile's epilogue
 * barriers, which every reader passes after reading it. Test: `cuda_gemm_drain_decode`.
 *
 * FP8 (docs/DESIGN.md "Numerics"): for each 128-wide K block the four k32 wgmmas go into a temporary
 * fragment (scale-d = 0 on the first), then acc += tmp * (a_scale[column][kb] * w_scale[n/128][kb]):
 * w_scale is one scalar per (weight box, kb) since a box is one 128-row scale block, a_scale varies
 * along D's columns (tokens). Same arithmetic as the CPU oracle (src/cpu/gemm.c), other order; the
 * E4M3 wgmma accumulates inside a K block with reduced precision (~5e-4 relative per element
 * against an exact fp32 sum), so FP8 results match the oracle within a bound, not bitwise.
 *
 * Epilogue (consumer warpgroups, named barrier 1 over their 256 threads): fragments -> BF16 or FP8
 * in a padded [kBlockT][128] staging tile -> 16-byte stores of the columns in [lo, kBlockT). FP8 h:
 * amax of a token over its 128 h columns = max over the thread's two rows, the 8 lanes sharing the
 * column (shfl xor 4, 8, 16) and the 8 consumer warps (smem); then mf__fp8_block_scale and
 * mf__fp8_from_float from core/numerics.h, as the CPU does it.
 *
 * Limits (the launchers decline anything else): N a multiple of 128 (plain) or 256 (swiglu),
 * K * element bytes a multiple of 128, L <= kMaxExperts, L * N < 2^31, 16-byte aligned data.
 */
#ifndef MF_CUDA_KERNELS_SM90_DECODE_GEMM_CUH
#define MF_CUDA_KERNELS_SM90_DECODE_GEMM_CUH

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "core/numerics.h"
#include "cuda/gemm_configs.cuh"
#include "cuda/grouped_gemm.h"
#include "cuda/kernels/sm90_core.cuh"
#include "cuda/kernels/sm90_ptx.cuh"

namespace mf__decode {

enum { kEpiPlain = 0, kEpiSwiglu = 1 };

/* Threads, registers, tile sizes, table sizes and the wait bound: cuda/gemm_configs.cuh. Params,
 * tables, tile walk, ring, roles and row targets: the shared core, kernels/sm90_core.cuh. */

static_assert(kKBlock == kMfSwizzleBytes, "a K block is one 128B-swizzle row");
static_assert(kKBlock == MF__QUANT_BLOCK, "an FP8 K block must be exactly one scale block");
static_assert(kTileCols == MF__QUANT_BLOCK, "a swiglu tile must hold whole FP8 h scale blocks");
static_assert(kWgOperandBytes % kMfSwizzleAtomBytes == 0, "wgmma operands must start on a swizzle atom");

/* Compile-time tile parameters and the shared-memory map. */
template <bool kFp8, int kEpi, int kBlockT>
struct cfg {
    static constexpr int kEsz = kFp8 ? 1 : 2;
    static constexpr int kBoxes = kEpi == kEpiSwiglu ? 2 : 1;          /* weight boxes per K block */
    static constexpr int kWeightBytes = kBoxes * kBoxBytes;             /* TMA bytes of a gathered stage */
    static constexpr int kActBytes = kBlockT * kKBlock;
    static constexpr int kStageBytes = kWeightBytes + kActBytes;        /* TMA bytes of a contiguous stage */
    static constexpr int kRowsPerLane = (kBlockT + 31) / 32;            /* producer lane l: columns l + 32 i */
    static constexpr int kOutEsz = (kEpi == kEpiSwiglu && kFp8) ? 1 : 2;
    static constexpr int kEpiRowBytes = kTileCols * kOutEsz + kEpiPadBytes;
    static constexpr int kScaleStride = kBlockT + kScalePad;            /* floats per stage */
    static constexpr int kScaleBytes = kFp8 ? kScaleStride * 4 : 0;     /* per stage */
    static constexpr int kEpiBytes = align_up(kBlockT * kEpiRowBytes, 128);
    static constexpr int kRedBytes = kConsumerWarps * kBlockT * 4;
    static constexpr int kTableBytes = align_up((3 * kMaxExperts + 1) * 4, 16);
    static constexpr int kTileOfBytes = align_up((kMaxStages + 1) * 4, 16); /* tile_of[kStages], the lead's word */
    static constexpr int kFixedBytes =
        kMfSwizzleAtomBytes /* base alignment slack */ + kEpiBytes + kRedBytes + kTableBytes + kTileOfBytes;
    static constexpr int kPerStageBytes = kStageBytes + kScaleBytes + 2 * 8;
    static constexpr int kStages = min_int(kMaxStages, (kSmemLimit - kFixedBytes - 16) / kPerStageBytes);

    static constexpr int kOffStages = 0;
    static constexpr int kOffEpi = kStages * kStageBytes;
    static constexpr int kOffScales = kOffEpi + kEpiBytes;
    static constexpr int kOffRed = kOffScales + align_up(kStages * kScaleBytes, 16);
    static constexpr int kOffTables = kOffRed + kRedBytes;
    static constexpr int kOffTileOf = kOffTables + kTableBytes;
    static constexpr int kOffBars = align_up(kOffTileOf + kTileOfBytes, 8);
    static constexpr int kSmemBytes = kOffBars + kStages * 2 * 8 + kMfSwizzleAtomBytes;

    static_assert(kBlockT == 8 || kBlockT == 16 || kBlockT == 32 || kBlockT == 64, "wgmma N (tokens per tile)");
    static_assert(kStages >= 2, "the ring needs two stages");
    static_assert(kSmemBytes <= kSmemLimit, "shared memory map exceeds 227 KB");
    static_assert(kActBytes % kMfSwizzleAtomBytes == 0 && kStageBytes % kMfSwizzleAtomBytes == 0,
                  "every box must start on a 1024-byte swizzle atom");
    static_assert(kEpiRowBytes % kChunk == 0, "staging rows must be 16-byte aligned");
};

/* ---- producer: one warp; lane 0 issues the TMA, all lanes the cp.asyncs ----------------------- */

template <bool kFp8, int kEpi, int kBlockT, bool kGather>
__device__ __forceinline__ void producer(const gemm_params &p, const tables_t &tb, uint8_t *stages, float *scales,
                                         int32_t *tile_of, uint64_t *full, uint64_t *empty) {
    using C = cfg<kFp8, kEpi, kBlockT>;
    constexpr bool kCpAsync = kFp8 || kGather;                  /* lanes arrive on full[] */
    const int lane = (int)(threadIdx.x & 31);
    const int32_t kbytes = p.K * C::kEsz;
    const int32_t kblocks = kbytes / kKBlock;                  /* = K/128 scale columns for FP8 */
    const int32_t scale_rows = p.N / kBoxRows;                 /* weight scale rows per expert */
    const int32_t half = p.N / 2;                              /* swiglu: first up row */
    const uint64_t pol_w = mf__l2_policy(kMfL2EvictFirst);    /* weights: read once */
    const uint64_t pol_a = mf__l2_policy(kMfL2EvictLast);     /* activations: read by every n-block */
    if (lane == 0) prefetch_maps<!kGather>(p);
    uint32_t it = 0;
    int32_t cursor = 0;
    tile_t t;
    /* tiles by ticket only when there are more tiles than CTAs: with one tile per CTA (T = 1's W13)
     * a ticket buys nothing and its end (a fence, two atomics) holds the SM (every CTA decides
     * alike, from the same tables) */
    int32_t *const sched = tb.first[p.num_experts] > (int32_t)gridDim.x ? p.sched : NULL;
    for (int32_t idx = (int32_t)blockIdx.x; next_tile<kBlockT, kRowsInner>(tb, p.num_experts, 0, idx, cursor, t);
         idx = next_idx(sched, idx, lane)) {
        /* weight rows of box b (gate, up) and its scale row */
        const int32_t wrow0 = t.e * p.N + t.nb * kBoxRows;
        const int32_t srow0 = t.e * scale_rows + t.nb;
        /* this lane's columns j = lane + 32 i: the row (gathered) and the FP8 scale row; columns
         * below lo take column lo's scales (their D columns are never stored) */
        const uint8_t *arow[C::kRowsPerLane];
        const float *srow[C::kRowsPerLane];
#pragma unroll
        for (int i = 0; i < C::kRowsPerLane; i++) {
            const int j = lane + 32 * i;
            const int32_t row = clamp_row<kBlockT>(t, j);
            arow[i] = NULL;
            srow[i] = p.a_scales;
            if constexpr (kGather) {
                const int32_t *src = p.src + 3 * (int64_t)row;
                const int32_t rank = src[0], token = src[1];
                const uint8_t *heap = (uint32_t)rank < (uint32_t)MF_MAX_RANKS ? p.view.heap[rank] : NULL;
                if (heap && j >= t.lo && j < kBlockT) arow[i] = heap + p.view.x + (int64_t)token * kbytes;
                if (heap) srow[i] = (const float *)(heap + p.view.scales) + (int64_t)token * kblocks;
            } else if constexpr (kFp8) {
                srow[i] = p.a_scales + (int64_t)row * kblocks;
            }
        }
        for (int32_t kb = 0; kb < kblocks; kb++, it++) {
            const uint32_t slot = ring<C::kStages>::slot(it);
            ring<C::kStages>::wait_empty(empty, it);
            uint8_t *st = stages + slot * C::kStageBytes;
            uint8_t *act = st + C::kWeightBytes;
            if constexpr (kFp8) {
                float *sc = scales + slot * C::kScaleStride;
#pragma unroll
                for (int i = 0; i < C::kRowsPerLane; i++) {
                    const int j = lane + 32 * i;
                    if (j < kBlockT) mf__cp_async_4(sc + j, srow[i] + kb);
                }
                if (lane < C::kBoxes) {
                    const int32_t srow_w = srow0 + (kEpi == kEpiSwiglu ? lane * (half / kBoxRows) : 0);
                    mf__cp_async_4(sc + kBlockT + lane, p.w_scales + (int64_t)srow_w * kblocks + kb);
                }
            }
            if constexpr (kGather) {
                /* the layout of a 128B-swizzled TMA box: chunk c of row j at chunk c ^ (j & 7) */
#pragma unroll
                for (int i = 0; i < C::kRowsPerLane; i++) {
                    const int j = lane + 32 * i;
                    if (arow[i]) {
                        const uint8_t *g = arow[i] + (int64_t)kb * kKBlock;
#pragma unroll
                        for (int c = 0; c < kChunksPerKBlock; c++)
                            mf__cp_async_16(act + j * kKBlock + ((c ^ (j & 7)) * kChunk), g + c * kChunk);
                    }
                }
            }
            if constexpr (kCpAsync) mf__cp_async_mbar_arrive_noinc(&full[slot]); /* one of full's 1 + 32 */
            __syncwarp();
            if (lane == 0) {
                tile_of[slot] = idx; /* published by the arrive below */
                mf__mbar_arrive_expect_tx(&full[slot], (uint32_t)(kGather ? C::kWeightBytes : C::kStageBytes));
                const int32_t kc = kb * (kKBlock / C::kEsz); /* K coordinate, elements */
#pragma unroll
                for (int b = 0; b < C::kBoxes; b++)
                    mf__tma_load_2d_hint(st + b * kBoxBytes, &p.tmap_w, &full[slot], kc, wrow0 + b * half, pol_w);
                if constexpr (!kGather) mf__tma_load_2d_hint(act, &p.tmap_a, &full[slot], kc, t.row0, pol_a);
                if (p.l2_ring && kb + C::kStages < kblocks) { /* L2 a ring ahead (file comment) */
                    const int32_t ka = (kb + C::kStages) * (kKBlock / C::kEsz);
#pragma unroll
                    for (int b = 0; b < C::kBoxes; b++) mf__tma_prefetch_2d(&p.tmap_w, ka, wrow0 + b * half);
                }
            }
        }
    }
    /* The end: one more stage, tile -1 and no data, full by plain arrivals (with lanes' copies: 32 + 1
     * in place of the 32 cp.async arrivals and the expect_tx): the consumers' "no next tile". */
    const uint32_t slot = ring<C::kStages>::slot(it);
    ring<C::kStages>::wait_empty(empty, it);
    if (lane == 0) tile_of[slot] = -1;
    __syncwarp();
    if constexpr (kCpAsync) mf__mbar_arrive(&full[slot]);
    if (lane == 0) mf__mbar_arrive(&full[slot]);
    end_schedule(sched, lane);
    if constexpr (kCpAsync) mf__cp_async_wait_all();
}

/* ---- consumers: two warpgroups, 64 weight rows each per box ----------------------------------- */

/* Staging tile -> output rows of columns [lo, kBlockT), columns [nb 128, nb 128 + 128) of the row,
 * 16 bytes per store: out[row0 + token], or (plain with use_ret) the owner's combine slot (ret_row:
 * p's view and num_topk, the rows' sources in `src`). Shared with the small-batch kernel
 * (kernels/sm90_small_gemm.cuh). */
template <int kEpi, int kBlockT, int kOutEsz, int kEpiRowBytes, class Params>
__device__ __forceinline__ void store_tile(const Params &p, const int32_t *src, uint8_t *out, bool use_ret,
                                           const uint8_t *epi, int64_t out_ld, const tile_t &t, int ctid) {
    constexpr int kChunksPerRow = kTileCols * kOutEsz / kChunk;
    const int64_t col_bytes = (int64_t)t.nb * kTileCols * kOutEsz;
#pragma unroll
    for (int c = ctid; c < kBlockT * kChunksPerRow; c += kConsumerThreads) {
        const int token = c / kChunksPerRow, ch = c % kChunksPerRow;
        if (token < t.lo) continue;
        const int64_t row = (int64_t)t.row0 + token;
        uint8_t *dst;
        if (kEpi == kEpiPlain && use_ret) {
            if (!ret_row(p, src, row, out_ld, dst)) continue;
        } else {
            dst = out + row * out_ld * kOutEsz;
        }
        *(uint4 *)(dst + col_bytes + ch * kChunk) = *(const uint4 *)(epi + token * kEpiRowBytes + ch * kChunk);
    }
}

/* One K block of a tile into acc (the consumer warpgroup's kBoxes weight boxes at descriptors da[b],
 * the activation tile at db). FP8: the four k32 wgmmas of each box into tmp (scale-d = 0 on the
 * first), then the promotion acc += tmp * (as[column] * *ws[b]) with as = the K block's a_scale per
 * tile column and ws[b] its box's w_scale; BF16: straight into acc. Shared with the small-batch
 * kernel (kernels/sm90_small_gemm.cuh), whose boxes of one K block sit in separate ring slots. */
template <bool kFp8, int kBoxes, int kBlockT>
__device__ __forceinline__ void mma_kblock(float (&acc)[kBoxes][kBlockT / 2], float (&tmp)[kBoxes][kBlockT / 2],
                                           const uint64_t (&da)[kBoxes], uint64_t db, const float *as,
                                           const float *const *ws, int quad) {
    if constexpr (kFp8) {
        /* issued like the BF16 branch below, on purpose: one helper templated on the dtype
         * changed the SASS of the two W2 T = 64 kernels (dev/cubin_diff.py) */
#pragma unroll
        for (int b = 0; b < kBoxes; b++) mf__fence_fragment<kBlockT>(tmp[b]); /* last promotion's reads first */
        mf__wgmma_fence();
#pragma unroll
        for (int k = 0; k < kKSteps; k++)
#pragma unroll
            for (int b = 0; b < kBoxes; b++)
                mf__wgmma_e4m3<kBlockT>(tmp[b], mf__wgmma_desc_advance(da[b], k * kKStepBytes),
                                        mf__wgmma_desc_advance(db, k * kKStepBytes), k > 0 ? 1 : 0);
        mf__wgmma_commit();
        mf__wgmma_wait<0>();
#pragma unroll
        for (int b = 0; b < kBoxes; b++) mf__fence_fragment<kBlockT>(tmp[b]);
        /* promotion of this K block: acc += tmp * (a_scale[column] * w_scale[box]) */
        float w[kBoxes];
#pragma unroll
        for (int b = 0; b < kBoxes; b++) w[b] = *ws[b];
#pragma unroll
        for (int j = 0; j < kBlockT / 8; j++) {
            const float2 a = *(const float2 *)(as + 8 * j + 2 * quad);
#pragma unroll
            for (int b = 0; b < kBoxes; b++) {
                const float s0 = a.x * w[b], s1 = a.y * w[b];
                acc[b][4 * j + 0] += tmp[b][4 * j + 0] * s0;
                acc[b][4 * j + 1] += tmp[b][4 * j + 1] * s1;
                acc[b][4 * j + 2] += tmp[b][4 * j + 2] * s0;
                acc[b][4 * j + 3] += tmp[b][4 * j + 3] * s1;
            }
        }
    } else {
        /* issued like the FP8 branch above, on purpose (there) */
#pragma unroll
        for (int b = 0; b < kBoxes; b++) mf__fence_fragment<kBlockT>(acc[b]); /* zeroing first */
        mf__wgmma_fence();
#pragma unroll
        for (int k = 0; k < kKSteps; k++)
#pragma unroll
            for (int b = 0; b < kBoxes; b++)
                mf__wgmma_bf16<kBlockT>(acc[b], mf__wgmma_desc_advance(da[b], k * kKStepBytes),
                                        mf__wgmma_desc_advance(db, k * kKStepBytes), 1);
        mf__wgmma_commit();
        mf__wgmma_wait<0>();
#pragma unroll
        for (int b = 0; b < kBoxes; b++) mf__fence_fragment<kBlockT>(acc[b]);
    }
}

/* A finished tile's accumulators -> the staging tile `epi` (BF16, or FP8 with its scales written to
 * out_scales[(row0 + token) h_blocks + nb] for the tile's tokens), between the 256 consumer threads'
 * named barriers: the first waits for the previous tile's stores, the last leaves the staging tile
 * complete for store_tile. swiglu: h = silu(acc[0]) * acc[1] first (acc[0] is overwritten). */
template <bool kFp8, int kEpi, int kBlockT, int kOutEsz, int kEpiRowBytes, int kBoxes>
__device__ __forceinline__ void stage_tile(float (&acc)[kBoxes][kBlockT / 2], uint8_t *epi, float *red, int32_t ue8m0,
                                           float *out_scales, int32_t h_blocks, const tile_t &t, int ctid) {
    constexpr int kFrag = kBlockT / 2;
    const int wg = ctid / kMfWarpgroupThreads;
    const int warp = (ctid / 32) % 4, lane = ctid & 31;
    const int quad = lane & 3, group = lane >> 2;
    /* fragment (j, h, b) = acc[4j + 2h + b] sits at D[row 16 warp + group + 8h][column 8j + 2 quad + b] */
    const int col_base = wg * kWgRows + warp * 16 + group; /* tile column (weight row) of h = 0 */
    if constexpr (kEpi == kEpiSwiglu) {
#pragma unroll
        for (int i = 0; i < kFrag; i++) acc[0][i] = mf__silu(acc[0][i]) * acc[1][i];
    }
    mf__named_barrier_sync(kBarEpilogue, kConsumerThreads); /* the previous tile's stores are done */
    if constexpr (kOutEsz == 2) {
#pragma unroll
        for (int j = 0; j < kBlockT / 8; j++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int b = 0; b < 2; b++) {
                    const int token = 8 * j + 2 * quad + b, col = col_base + 8 * h;
                    *(uint16_t *)(epi + token * kEpiRowBytes + col * 2) = mf__bf16_from_float(acc[0][4 * j + 2 * h + b]);
                }
    } else {
        /* FP8 h: amax of each token over the tile's 128 h columns */
        float m[kBlockT / 8][2];
#pragma unroll
        for (int j = 0; j < kBlockT / 8; j++)
#pragma unroll
            for (int b = 0; b < 2; b++) {
                float v = 0.0f;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const float a = fabsf(acc[0][4 * j + 2 * h + b]);
                    v = a > v ? a : v; /* NaN never wins, as in the host quantiser */
                }
#pragma unroll
                for (int off = 4; off < 32; off <<= 1) {
                    const float o = __shfl_xor_sync(0xffffffffu, v, off);
                    v = o > v ? o : v;
                }
                m[j][b] = v;
            }
        if (group == 0)
#pragma unroll
            for (int j = 0; j < kBlockT / 8; j++)
#pragma unroll
                for (int b = 0; b < 2; b++) red[(wg * 4 + warp) * kBlockT + 8 * j + 2 * quad + b] = m[j][b];
        mf__named_barrier_sync(kBarEpilogue, kConsumerThreads);
#pragma unroll
        for (int j = 0; j < kBlockT / 8; j++)
#pragma unroll
            for (int b = 0; b < 2; b++) {
                const int token = 8 * j + 2 * quad + b;
                float amax = 0.0f;
#pragma unroll
                for (int w = 0; w < kConsumerWarps; w++) {
                    const float o = red[w * kBlockT + token];
                    amax = o > amax ? o : amax;
                }
                float scale, inv;
                mf__fp8_block_scale(amax, ue8m0, &scale, &inv);
#pragma unroll
                for (int h = 0; h < 2; h++)
                    epi[token * kEpiRowBytes + col_base + 8 * h] = mf__fp8_from_float(acc[0][4 * j + 2 * h + b] * inv);
                if (wg == 0 && warp == 0 && group == 0 && token >= t.lo)
                    out_scales[(int64_t)(t.row0 + token) * h_blocks + t.nb] = scale;
            }
    }
    mf__named_barrier_sync(kBarEpilogue, kConsumerThreads); /* the staging tile is complete */
}

template <bool kFp8, int kEpi, int kBlockT, bool kGather>
__device__ __forceinline__ void consumer(const gemm_params &p, const tables_t &tb, uint8_t *stages, const float *scales,
                                         int32_t *tile_of, uint8_t *epi, float *red, uint64_t *full,
                                         uint64_t *empty) {
    using C = cfg<kFp8, kEpi, kBlockT>;
    constexpr int kFrag = kBlockT / 2;          /* accumulators per thread per 64-row block */
    const int ctid = (int)threadIdx.x - kMfWarpgroupThreads; /* 0..255 */
    const int wg = ctid / kMfWarpgroupThreads;  /* consumer warpgroup: weight rows [64 wg, 64 wg + 64) */
    const int lane = ctid & 31;
    const int quad = lane & 3;
    const int32_t kblocks = p.K * C::kEsz / kKBlock;
    const int64_t out_ld = kEpi == kEpiSwiglu ? p.N / 2 : p.N;
    const uint64_t desc_stages = mf__wgmma_desc_sw128(stages);

    float tmp[C::kBoxes][kFrag];
#pragma unroll
    for (int b = 0; b < C::kBoxes; b++)
#pragma unroll
        for (int i = 0; i < kFrag; i++) tmp[b][i] = 0.0f;

    uint32_t it = 0;
    int32_t cursor = 0;
    tile_t t;
    /* The next tile is the one the producer put into the next stage (tile_of; -1: the end), taken
     * from one thread's read (see "Bounded waits"): the word is rewritten only after every consumer
     * thread has passed the tile's epilogue barriers, i.e. after all of them read it. */
    int32_t *lead = tile_of + kMaxStages;
    for (;;) {
        const bool gave_up = ring<C::kStages>::wait_full(full, it, p.sink);
        if (ctid == 0) *lead = gave_up ? -1 : tile_of[ring<C::kStages>::slot(it)];
        mf__named_barrier_sync(kBarEpilogue, kConsumerThreads);
        const int32_t idx = *lead;
        if (idx < 0 || !next_tile<kBlockT, kRowsInner>(tb, p.num_experts, 0, idx, cursor, t)) break;
        float acc[C::kBoxes][kFrag];
#pragma unroll
        for (int b = 0; b < C::kBoxes; b++)
#pragma unroll
            for (int i = 0; i < kFrag; i++) acc[b][i] = 0.0f;

        for (int32_t kb = 0; kb < kblocks; kb++, it++) {
            const uint32_t slot = ring<C::kStages>::slot(it);
            ring<C::kStages>::wait_full(full, it, p.sink);
            if constexpr (kGather) mf__fence_proxy_async_smem(); /* cp.async (generic) -> wgmma (async) */
            const uint64_t dslot = desc_stages + (uint64_t)((slot * C::kStageBytes) >> 4);
            uint64_t da[C::kBoxes];
#pragma unroll
            for (int b = 0; b < C::kBoxes; b++) da[b] = mf__wgmma_desc_advance(dslot, b * kBoxBytes + wg * kWgOperandBytes);
            const uint64_t db = mf__wgmma_desc_advance(dslot, C::kWeightBytes);
            const float *sc_slot = scales + slot * C::kScaleStride; /* FP8: this K block's scales */
            const float *wsp[C::kBoxes];
#pragma unroll
            for (int b = 0; b < C::kBoxes; b++) wsp[b] = sc_slot + kBlockT + b;
            mma_kblock<kFp8, C::kBoxes, kBlockT>(acc, tmp, da, db, sc_slot, wsp, quad);
            release_stage(empty, slot, lane); /* this warp is done with the stage */
        }

        /* ---- epilogue ---- */
        stage_tile<kFp8, kEpi, kBlockT, C::kOutEsz, C::kEpiRowBytes>(acc, epi, red, p.ue8m0, p.out_scales,
                                                                      (int32_t)(out_ld / MF__QUANT_BLOCK), t, ctid);
        store_tile<kEpi, kBlockT, C::kOutEsz, C::kEpiRowBytes>(p, p.src, p.out, p.use_ret != 0, epi, out_ld, t, ctid);
    }
}

/* The lab's --timeline: this CTA's stamp i (0 entry, 1 prologue done, 2 last store) = %globaltimer. */
__device__ __forceinline__ void stamp(const gemm_params &p, int i) {
    p.timeline[kTimelineStamps * (int64_t)blockIdx.x + i] = mf__globaltimer();
}

template <bool kFp8, int kEpi, int kBlockT, bool kGather>
__global__ void __launch_bounds__(kThreads, 1) sm90_decode_kernel(const __grid_constant__ gemm_params p) {
    using C = cfg<kFp8, kEpi, kBlockT>;
    /* full[s]: the producer's arrive.expect_tx, + (FP8 or gathered rows) one cp.async arrival per
     * producer lane */
    constexpr uint32_t kFullArrivals = (kFp8 || kGather) ? 1 + 32 : 1;
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = smem_raw + align_pad(smem_raw);
    uint8_t *stages = smem + C::kOffStages;
    uint8_t *epi = smem + C::kOffEpi;
    float *scales = (float *)(smem + C::kOffScales);
    float *red = (float *)(smem + C::kOffRed);
    tables_t tb;
    tables_at<kMaxExperts>(tb, smem + C::kOffTables);
    int32_t *tile_of = (int32_t *)(smem + C::kOffTileOf);
    uint64_t *full = (uint64_t *)(smem + C::kOffBars);
    uint64_t *empty = full + C::kStages;
    const int32_t nblocks = kEpi == kEpiSwiglu ? p.N / (2 * kTileCols) : p.N / kTileCols; /* n-blocks per expert */
    /* the decode lab's --timeline (gemm_params.timeline; NULL in the library) */
    const bool timed = p.timeline != NULL;
    if (timed && threadIdx.x == 0) stamp(p, 0);
    /* first[e]: the tiles of the experts < e (the producer prefetches the tensor maps) */
    prologue<C::kStages, false>(p, full, empty, kFullArrivals, tb, [nblocks](int32_t rows) {
        return rows > 0 ? nblocks * ((rows + kBlockT - 1) / kBlockT) : 0;
    });
    if (timed && threadIdx.x == 0) stamp(p, 1);

    if (producer_role()) {
        if (mf__warp_id() == 0) producer<kFp8, kEpi, kBlockT, kGather>(p, tb, stages, scales, tile_of, full, empty);
    } else {
        consumer<kFp8, kEpi, kBlockT, kGather>(p, tb, stages, scales, tile_of, epi, red, full, empty);
        if (threadIdx.x == kMfWarpgroupThreads) mf__pipeline_check(p.sink, kTagProducerEmpty);
        if (timed && threadIdx.x == kMfWarpgroupThreads) stamp(p, 2);
    }
}

} /* namespace mf__decode */

/* What gemm_decode.cu ships, for the lab and for diagnostics: fills up to `max` entries (NULL: none) of
 * mf__gemm_variant_info_t (cuda/gemm_family.cuh) for the current device (loads the kernels) and
 * returns the number of variants, or -1 on a CUDA error. */
typedef struct mf__gemm_variant_info mf__gemm_variant_info_t;
int mf__sm90_decode_variants(mf__gemm_variant_info_t *out, int max);


/* The decode lab's timeline: `stamps` (device, kTimelineStamps uint64 per CTA of the largest grid) or NULL (off,
 * the library's state) for the decode launches on the current device that follow (gemm_params.timeline).
 * Not for concurrent use: set it between launches, from the thread that launches. */
cudaError_t mf__sm90_decode_set_timeline(uint64_t *stamps);

#endif /* MF_CUDA_KERNELS_SM90_DECODE_GEMM_CUH */
