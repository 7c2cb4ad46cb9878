/*
 * sm90_small_gemm.cuh — the small-batch expert kernel (issue 25): W13 + SwiGLU and W2 + return of one
 * decode forward in ONE persistent launch, with a per-expert dependency in place of the kernel
 * boundary between the two GEMMs. Launched by src/cuda/gemm_small.cu (mf__sm90_small_experts); the
 * forward takes it where the GEMM choice says `fused` (cuda/grouped_gemm.h). Same arithmetic as the
 * two decode kernels (kernels/sm90_decode_gemm.cuh: its K-block math and epilogue staging are called
 * from here, mma_kblock and stage_tile), so y is the same bits.
 *
 * Why (bench/NOTES.md "Issue 25 item 1"): at T = 1 token per rank the two decode GEMMs of deepseek-v3
 * stream 83 us of weights, but each kernel boundary drains every SM (the last CTA of W13 ends 6-16 us
 * after the first) and refills it (W2's first stage lands 4-8 us after its start). Here an SM that
 * finishes its W13 tile goes straight on to W2 tiles, whose weights do not depend on h: their TMA
 * loads are issued at once and only the h rows wait for the expert's W13 tiles.
 *
 * Work units, in one order: first every W13 tile (expert with rows, h n-block of 128 columns, token
 * block of kBlockT rows: the decode kernel's swiglu tiles, rows inner), then every W2 tile (expert,
 * output n-block of 128 columns, token block). Every unit, a CTA's first included, is taken by ticket
 * (sync[0]), so units are handed out in order to CTAs that are running: a W2 unit waits only on W13
 * units, all earlier, already taken by running CTAs that never wait on anything but their own ring.
 * Hence no deadlock whether or not every CTA of the grid is resident (another stream's kernels may
 * hold SMs). A W13 unit's consumers, after its h (and FP8 h scales) are stored, raise the expert's
 * counter done[e] (bar.sync of the consumers, fence, atomic add); a W2 unit of expert e needs done[e]
 * = (h n-blocks) x (token blocks of e).
 *
 * The ring: kSlots slots, each one 16 KB weight box [128 rows x 128 B] + the activation tile of one K
 * block [kBlockT rows x 128 B] + its FP8 scales (a_scale per tile column, the box's w_scale). A W13
 * K block takes two consecutive positions (it: gate box, activation and scales; it + 1: up box and
 * its w_scale), a W2 K block one, so W2 keeps twice the K blocks in flight that W13 does at the same
 * bytes. Every position's full barrier expects the producer lane 0's arrive.expect_tx (16 KB) and one
 * arrival per producer lane (1 + 32): a cp.async arrival (a lane with nothing to copy arrives at
 * once); under switch 5 the 32 of the first unit's positions come from the row warp that made them
 * (FP8: plain release arrivals after its stores).
 *
 * The producer (warp 0 of warpgroup 0), per unit:
 *   W13: the rows gathered at their owners (view.x, src) by cp.async, as the decode kernel's DIRECT
 *        variant does (switch 5: the first unit's made from the caller's x, "Its first rows"), the
 *        gate and up boxes by TMA;
 *   W2:  every position's weight box by TMA at once; its h rows (contiguous in h, written by other
 *        CTAs: generic stores read by generic cp.async after each lane's ld.acquire, which on sm_90
 *        also invalidates L1 for the 4-byte scale copies, CCTL.IVALL) and scales as soon as done[e]
 *        is complete: polled once per position, blocking (bounded like every pipeline wait) only
 *        when the ring would otherwise wait on this unit's own positions.
 * Each position carries its unit in tile_of[slot]; the consumers follow it and stop at -1.
 *
 * L2 ahead (switch 4, params.l2_ahead; at any R). A W2 unit waits for all of its expert's W13 tiles;
 * its producer issues the weights of the K blocks the ring holds (12 slots: 12 of deepseek-v3's 16
 * FP8 K blocks) and then blocks, so a CTA that takes one while the expert's slowest W13 tile still
 * streams (the W13 -> W2 seam; at T = 1 every CTA's first W13 unit is 1.8 MB and they end ~6 us
 * apart) loads next to nothing for that time. Such a unit, when its first poll of done[e] (after
 * its first K block's load) fails, sends the W2 weights of unit idx + grid, the unit of the walk's
 * next round, into L2 (cp.async.bulk.prefetch.tensor, one 16 KB box per producer lane, the unit's
 * first 32 K blocks: all of deepseek-v3's, kimi-k2's and qwen3's; a hint, nothing waits for it, the
 * bits do not change): the next round then reads them from L2. At most one unit per parked unit:
 * for deepseek-v3 FP8 262 KB, 132 of them 35 MB, within the 50 MB L2 that W13's evict-first weights
 * leave alone.
 *
 * The consumers (warpgroups 1 and 2): W13 as the decode swiglu kernel (two boxes), W2 as the decode
 * plain kernel with `ret` (one box): rows go to the owners' combine slots. After a W13 unit's stores:
 * one more named barrier, then one thread publishes.
 *
 * The sum (R = 1, params.y set): the forward's last kernel then is this one. After a W2 tile's rows
 * are in the combine slots, each row's token arrives on its (token, 128-column block) counter; the
 * arrival that completes the token's valid k sums that block into y with the sum kernel's arithmetic
 * (kernels/sum.cuh), and CTA b writes the zero rows of tokens b, b + grid, ... that route nowhere.
 * A faulted comm (the sticky word, set before this kernel) leaves y untouched, as the sum kernel does.
 *
 * Its own plan (kOwn, R = 1 with the sum, params.ids set): no plan kernel runs before it. Every CTA
 * builds the tables and src from the caller's routing in its shared memory (own_tables) before its
 * PDL wait, takes its first unit and, for a W13 unit, issues the TMAs of the K blocks its ring holds;
 * then the wait for publish (mf__publish_sync_kernel, which also ran the DISPATCH sync), then the
 * activation rows of those K blocks, and on as above. Consumers wait for publish before they read
 * anything of it (ids, weights, the fault word). A faulted call (the verdict is known once a
 * producer has waited) takes no further unit: the units already taken finish (h and combine slots,
 * this rank's scratch at R = 1; y stays untouched), and since every W13 unit is taken before any W2
 * unit, no W2 unit waits on a W13 unit that nobody took. Unlike the PDL rule of the other kernels
 * (cuda/pdl.cuh: wait, then trigger, then global memory) this one triggers, takes tickets and
 * issues weight loads before its wait (with its first rows, below, it also reads x and computes and
 * stores its whole first unit: h, h_scales and done[e] are its own): that is the point, and it is
 * safe only because publish, its
 * predecessor, is a call's first kernel and has no PDL attribute, so the previous launch on these
 * sync words has completed before this one can start (backend.cu mf__cuda_publish_at).
 *
 * Its first rows (kOwn, switch 5, params.x set): x, like ids, was written before publish started,
 * so the rows of a CTA's first W13 unit can be made from it without waiting for publish. (A switch
 * whose producer warp made every K block's rows itself, between its weight loads, ran the stream at
 * one warp's serial pace, 2.2x slower, and was removed: bench/NOTES.md.) Warp 0 issues the weights
 * alone and warps 1-3 of its warpgroup, idle otherwise, make the rows of the CTA's first unit only
 * (front_rows: the first ticket handed over through shared memory and a named barrier, K blocks
 * round-robin over the three warps, each giving the full barriers the 32 arrivals warp 0's lanes
 * give elsewhere). Publish still writes x: the CTA's later units gather it as under 4, after the
 * wait for publish that follows the first unit; the consumers likewise wait for publish after the
 * first unit, before the next ticket (whose stop word is publish's verdict), any W2 unit (the sum
 * reads the published ids and weights) or the end. At T = 1 a CTA has one W13 unit, so none of its
 * W13 rows waits for publish. Measured +34.5 % at deepseek-v3 T = 1 on the H200 (6c169f7), not
 * yet explained (bench/NOTES.md): not the default.
 *
 * The end: every CTA, once its consumers are done, counts itself in sync[1]; the last one zeroes the
 * ticket, the count, done[0 .. L) and the sum's counters: the next launch starts from zeros (stream
 * order; under PDL the next launch on this buffer is at least one kernel later, a call's first,
 * launched without the attribute).
 *
 * Limits (the launcher declines anything else): H and I multiples of kTileCols (128: the W2 and h
 * n-blocks), their rows' bytes multiples of kKBlock, L <= kMaxExperts, L 2I and L H within int32 TMA
 * coordinates. Rows are always gathered (DIRECT) and returned (`ret`) through one heap view and src.
 */
#ifndef MF_CUDA_KERNELS_SM90_SMALL_GEMM_CUH
#define MF_CUDA_KERNELS_SM90_SMALL_GEMM_CUH

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "core/numerics.h"
#include "cuda/gemm_configs.cuh"
#include "cuda/grouped_gemm.h"
#include "cuda/kernels/sm90_core.cuh"
#include "cuda/kernels/sm90_decode_gemm.cuh"
#include "cuda/kernels/sm90_ptx.cuh"
#include "cuda/kernels/sum.cuh"

namespace mf__small {

using namespace mf__decode; /* tile columns, scale pad, epilogue barrier; mma_kblock, stage_tile */

/* One struct per launch (__grid_constant__). */
struct small_params {
    CUtensorMap tmap_w13;      /* [L 2I, H] box [128 rows, 128 B], 128B swizzle */
    CUtensorMap tmap_w2;       /* [L H, I] */
    const int32_t *counts;     /* [L] device: rows of each expert */
    const int32_t *offsets;    /* [L] device: first receive row of each expert */
    const float *w13_scales;   /* FP8: [L, 2I/128, H/128] */
    const float *w2_scales;    /* FP8: [L, H/128, I/128] */
    uint8_t *h;                /* [rows, I] FP8 or BF16: W13's output, W2's input */
    float *h_scales;           /* FP8: [rows, I/128] */
    mf__heap_view_t view;      /* W13 rows and FP8 scales at their owners (x, scales; not with `x` below);
                                  W2 rows to the owners' combine slots (combine) */
    const int32_t *src;        /* [rows, 3] (rank, token, k) of each receive row */
    int32_t num_topk;          /* K */
    int32_t num_experts;       /* L */
    int32_t max_rows;          /* counts are clamped to [0, max_rows] */
    int32_t H, I;
    int32_t ue8m0;             /* FP8: power-of-two h scales */
    int32_t *sync;             /* zeroed: ticket, finished CTAs, done[L] (W13 tiles stored), and with the
                                  sum arrive[T][H/128] (W2 tiles of each token's 128-column block) */
    uint16_t *y;               /* the sum (R = 1): y [T, H] BF16 from the partials; NULL: the sum kernel's */
    const int32_t *fault;      /* with the sum: the comm's sticky fault word; set: y stays untouched */
    int32_t T;                 /* with the sum: this rank's tokens */
    mf__fault_sink_t sink;     /* the comm's: where an expired wait records itself */
    const int32_t *ids;        /* kOwn: the caller's routing [T, K] (its own plan; counts, offsets, src unread) */
    uint64_t *timeline;        /* `moeflow bench layer --timeline` only (NULL otherwise): kStamps stamps per CTA */
    int32_t l2_ahead;          /* switch 4: a W2 unit that waits for its expert's W13 sends the W2 weights of
                                  unit idx + grid into L2 (see "L2 ahead" in the file comment) */
    const uint16_t *x;         /* kOwn, switch 5: the caller's x [T, H] BF16, from which warps 1-3 make the
                                  CTA's first unit's W13 rows (see "Its first rows"); NULL: all rows are
                                  the ones publish wrote (publish writes x either way) */
};

/* The timeline (small_params.timeline), kStamps words per CTA: word i = %globaltimer: 0 entry; 1
 * tables built (with the plan's tables this includes the PDL wait for the plan kernel; with its own
 * plan no wait); 2 its first ring position full (weights and rows in shared memory; with its own plan
 * this includes the wait for publish, but not with its first rows; a CTA that took no unit: its end
 * marker); 3 its consumers done (before the count-out); 4 its SM (%smid); 5 (kOwn) its producer's
 * PDL wait for publish returned (with its first rows, switch 5: after its first unit);
 * then, for the first kUnitStamps tickets its producer took, pairs (what: the unit's index, bit 32
 * set for a W2 unit, bit 33 for the end; when). */
__device__ __forceinline__ void stamp(const small_params &p, int i) {
    p.timeline[kStamps * (int64_t)blockIdx.x + i] = mf__globaltimer();
}
__device__ __forceinline__ void stamp_sm(const small_params &p) {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    p.timeline[kStamps * (int64_t)blockIdx.x + 4] = sm;
}
/* The producer's lane 0, at its u-th ticket (idx; w2, end: its kind). */
__device__ __forceinline__ void stamp_unit(const small_params &p, int32_t u, int32_t idx, bool w2, bool end) {
    if (u >= kUnitStamps) return;
    uint64_t *const s = p.timeline + kStamps * (int64_t)blockIdx.x + 6 + 2 * u;
    s[0] = (uint64_t)(uint32_t)idx | (uint64_t)w2 << 32 | (uint64_t)end << 33;
    s[1] = mf__globaltimer();
}

template <bool kFp8, int kBlockT, bool kOwn = false>
struct cfg {
    static constexpr int kEsz = kFp8 ? 1 : 2;
    static constexpr int kActBytes = kBlockT * kKBlock;
    static constexpr int kSlotBytes = kBoxBytes + kActBytes;            /* box, then the activation tile */
    static constexpr int kScaleStride = kBlockT + kScalePad;            /* floats per slot: a_scales, w_scale */
    static constexpr int kScaleBytes = kFp8 ? kScaleStride * 4 : 0;
    static constexpr int kOutEsz13 = kFp8 ? 1 : 2;                      /* h */
    static constexpr int kEpiRowBytes13 = kTileCols * kOutEsz13 + kEpiPadBytes;
    static constexpr int kEpiRowBytes2 = kTileCols * 2 + kEpiPadBytes; /* BF16 rows to the owners */
    static constexpr int kEpiBytes = align_up(kBlockT * kEpiRowBytes2, 128);
    static constexpr int kRedBytes = kConsumerWarps * kBlockT * 4;
    static constexpr int kTableBytes = align_up((3 * kMaxExperts + 1) * 4, 16);
    static constexpr int kTileOfBytes = align_up(kMaxSlots * 4, 16);
    static constexpr int kSrcBytes = kOwn ? align_up(kOwnEntries * 3 * 4, 16) : 0; /* kOwn: src [rows, 3] */
    static constexpr int kFixedBytes = kMfSwizzleAtomBytes /* base alignment slack */ + kEpiBytes + kRedBytes +
                                       kTableBytes + kTileOfBytes + 16 + kBlockT * 4 + kSrcBytes + 16;
    static constexpr int kPerSlotBytes = kSlotBytes + kScaleBytes + 2 * 8;
    static constexpr int kSlots = min_int(kMaxSlots, (kSmemLimit - kFixedBytes - 16) / kPerSlotBytes);

    static constexpr int kOffSlots = 0;
    static constexpr int kOffEpi = kSlots * kSlotBytes;
    static constexpr int kOffScales = kOffEpi + kEpiBytes;
    static constexpr int kOffRed = kOffScales + align_up(kSlots * kScaleBytes, 16);
    static constexpr int kOffTables = kOffRed + kRedBytes;
    static constexpr int kOffTileOf = kOffTables + kTableBytes;
    static constexpr int kOffFlag = kOffTileOf + kTileOfBytes;          /* the count-out's "last CTA", then
                                                                           switch 5's first ticket */
    static constexpr int kOffSumFlags = kOffFlag + 16;                  /* the sum: [kBlockT] token + 1 or 0 */
    static constexpr int kOffSrc = align_up(kOffSumFlags + kBlockT * 4, 16); /* kOwn: the plan's src */
    static constexpr int kOffUnit = kOffSrc + kSrcBytes;                /* the consumers' next unit, [2] */
    static constexpr int kOffBars = align_up(kOffUnit + 2 * 4, 8);
    static constexpr int kSmemBytes = kOffBars + kSlots * 2 * 8 + kMfSwizzleAtomBytes;

    static_assert(kBlockT == 8, "the small kernel is built for 8-token tiles (the choice takes it below them)");
    static_assert(kSlots >= 4, "a W13 K block takes two positions: the ring needs four");
    static_assert(!kOwn || kSlots * kSlotBytes >= (kOwnEntries + kMaxExperts * kOwnWords) * 4,
                  "kOwn: the plan's scratch lives in the ring");
    static_assert(kSmemBytes <= kSmemLimit, "shared memory map exceeds 227 KB");
    static_assert(kSlotBytes % kMfSwizzleAtomBytes == 0 && kBoxBytes % kMfSwizzleAtomBytes == 0,
                  "every box and activation tile must start on a 1024-byte swizzle atom");
};

/* ---- the unit walk ----------------------------------------------------------------------------- */

/* Unit `idx` (tables' first[] counts token blocks): false past the last unit; else w2 (false: W13)
 * and the tile (expert, n-block, rows) (core/prefix.h mf__w2_unit: the one W2 mapping, the L2-ahead
 * unit's too), with the phase's cursor (one per phase: each role's units ascend, so each cursor only
 * moves forward). */
template <int kBlockT>
__device__ __forceinline__ bool locate(const tables_t &tb, int32_t L, int32_t nb13, int32_t nb2, int32_t idx,
                                       int32_t &cur13, int32_t &cur2, bool &w2, tile_t &t) {
    const int32_t blocks_all = tb.first[L];
    w2 = idx >= nb13 * blocks_all;
    if (w2) {
        int32_t e, nb, blk;
        if (!mf__w2_unit(tb.first, L, nb2, idx - nb13 * blocks_all, cur2, &e, &nb, &blk)) return false;
        cur2 = e;
        place_block<kBlockT>(tb, e, blk, t);
        t.nb = nb;
        return true;
    }
    int32_t e = mf__prefix_find(tb.first, L, cur13, idx / nb13); /* nb13 first[e + 1] <= idx */
    cur13 = e;
    const int32_t blocks = tb.first[e + 1] - tb.first[e], local = idx - nb13 * tb.first[e];
    place_block<kBlockT>(tb, e, local % blocks, t);
    t.nb = local / blocks;
    return true;
}

/* The next unit of this CTA (every unit by ticket: see the file comment); lane 0 takes it. None
 * (INT32_MAX is past the walk's end) once this family's pipeline drains (mf__sm90_expired: a wait
 * expired, sm90_ptx.cuh) or, `stop` (kOwn, once publish has been waited for: the comm's fault
 * word), the call faulted. */
__device__ __forceinline__ int32_t take(int32_t *ticket, int lane, const int32_t *stop = nullptr) {
    int32_t v = 0;
    if (lane == 0)
        v = mf__sm90_expired || (stop && *(volatile const int32_t *)stop) ? INT32_MAX : atomicAdd(ticket, 1);
    return __shfl_sync(0xffffffffu, v, 0);
}

__device__ __forceinline__ int32_t ld_acquire(const int32_t *p) {
    int32_t v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

enum { kTagDepends = 3 }; /* wait site (fault record's c): a W2 unit's wait for its expert's W13 tiles */

/* Every lane: until done >= target (acquire), bounded as the ring's waits are (an expired wait
 * records itself in the comm's fault sink, raises mf__sm90_expired and returns: the kernel drains,
 * the comm breaks; sm90_ptx.cuh mf__mbar_wait_bounded). */
__device__ __forceinline__ void wait_done(const int32_t *done, int32_t target, const mf__fault_sink_t &sink) {
    if (ld_acquire(done) >= target) return;
    const uint64_t t0 = mf__globaltimer();
    while (ld_acquire(done) < target) {
        if (mf__sm90_expired) {
            mf__pipeline_fault(sink, kTagDepends, 1);
            return;
        }
        if (mf__globaltimer() - t0 > kWaitTimeoutNs) {
            mf__pipeline_fault(sink, kTagDepends, 0);
            mf__sm90_expired = 1;
            __threadfence();
            return;
        }
        __nanosleep(64);
    }
}

/* ---- its own plan (kOwn, R = 1) ----------------------------------------------------------------- */

/* The tables and src of this rank's routing, built by every CTA in its own shared memory from the
 * caller's ids (p.ids: written by a kernel before publish, so readable before this kernel's PDL
 * wait), in place of the plan kernel's counts, offsets and src: every entry as publish validates it
 * (an id outside [-1, L) or repeated earlier in its row is dropped: L = E at R = 1), each expert's
 * rows in token order (the plan's order at one rank), the experts' rows packed from row 0 (no
 * padding: h is this kernel's own), src (rank, token, k). A token routes to an expert at most once,
 * so each expert's tokens are a bit mask (T <= kOwnMaxTokens bits): its rows are the mask's bits, a
 * token's place among them the bits below its own; nothing is serial. Every CTA computes the same
 * tables, so h rows and the W13 counters agree across CTAs. The caller (backend.cu) takes it only
 * where the plan could not fault: T <= kOwnMaxTokens, T K <= kOwnEntries, no capacity overflow
 * possible. `scratch`: (kOwnEntries + L kOwnWords) int32 of the ring (no load has been issued
 * yet; the async-proxy fence after it orders these generic writes before the TMA writes that
 * follow). Every thread calls it; it ends with tables and src visible to all. */
__device__ __forceinline__ void own_tables(const small_params &p, const tables_t &tb, int32_t *src, int32_t *scratch) {
    const int32_t L = p.num_experts, K = p.num_topk, n = p.T * K, W = (p.T + 31) / 32;
    int32_t *const ent = scratch;                                  /* entry i's expert or -1 */
    uint32_t *const mask = (uint32_t *)(scratch + kOwnEntries);    /* [L][W] tokens of each expert */
    for (int32_t i = (int32_t)threadIdx.x; i < L * W; i += kThreads) mask[i] = 0u;
    __syncthreads();
    for (int32_t i = (int32_t)threadIdx.x; i < n; i += kThreads) {
        const int32_t *row = p.ids + (i / K) * K;
        const int32_t t = i / K, k = i % K;
        int32_t id = row[k];
        if (id < -1 || id >= L) id = -1;
        for (int32_t j = 0; j < k && id >= 0; j++)
            if (row[j] == id) id = -1;
        ent[i] = id;
        if (id >= 0) atomicOr(mask + id * W + t / 32, 1u << (t % 32));
    }
    __syncthreads();
    for (int32_t e = (int32_t)threadIdx.x; e < L; e += kThreads) {
        int32_t rows = 0;
        for (int32_t w = 0; w < W; w++) rows += __popc(mask[e * W + w]);
        tb.rows[e] = rows;
    }
    __syncthreads();
    scan_into<false>(tb.row0, tb.rows, L, [](int32_t rows) { return rows; });
    scan_units(tb, L, [](int32_t rows) { return (rows + kTokens - 1) / kTokens; });
    for (int32_t i = (int32_t)threadIdx.x; i < n; i += kThreads) {
        const int32_t e = ent[i];
        if (e < 0) continue;
        const int32_t t = i / K;
        const uint32_t *m = mask + e * W;
        int32_t pos = __popc(m[t / 32] & ((1u << (t % 32)) - 1u));
        for (int32_t w = 0; w < t / 32; w++) pos += __popc(m[w]);
        int32_t *s = src + 3 * (tb.row0[e] + pos);
        s[0] = p.view.rank;
        s[1] = t;
        s[2] = i % K;
    }
    mf__fence_proxy_async_smem(); /* every writer's: the scratch above is ring memory that TMA writes next */
    __syncthreads();
}

/* ---- producer ---------------------------------------------------------------------------------- */

/* K block kb of row `row` (128 bytes) into tile row j of the activation tile at `act`, by 16-byte
 * cp.asyncs, in the layout a 128B-swizzled TMA box has: chunk c of row j at chunk c ^ (j & 7). */
__device__ __forceinline__ void copy_kblock(uint8_t *act, const uint8_t *row, int32_t kb, int j) {
    const uint8_t *g = row + (int64_t)kb * kKBlock;
#pragma unroll
    for (int c = 0; c < kChunksPerKBlock; c++)
        mf__cp_async_16(act + j * kKBlock + ((c ^ (j & 7)) * kChunk), g + c * kChunk);
}

/* Its first rows (switch 5, p.x): K block kb of a W13 unit's activation rows made from the caller's x
 * into the activation tile at `act` (128B-swizzled as a TMA box: chunk c of row r at c ^ (r & 7))
 * and their scales into a_scale[r], with publish's arithmetic (kernels/movement.cuh
 * mf__publish_block: the amax of |x| over the 128-wide block, NaN never winning, mf__fp8_block_scale,
 * __fmul_rn, mf__fp8_from_float), so the tile holds the bits the published rows would. Eight lanes
 * per tile row, one 16-byte chunk (16 columns) each, four rows per pass; rows below lo are zeros
 * (their D columns are never stored). Generic stores: the caller fences them for the async proxy
 * before its release arrivals. */
template <int kBlockT>
__device__ __forceinline__ void quantise_kblock(uint8_t *act, float *a_scale, const uint16_t *x, int32_t H,
                                                const int32_t *src, const tile_t &t, int32_t kb, int lane,
                                                int32_t ue8m0) {
    static_assert(kBlockT % 4 == 0, "four tile rows per pass");
    constexpr int kPasses = kBlockT / 4;
    const int c = lane & 7;
    uint4 raw[kPasses][2]; /* every pass's loads first: one latency per K block, not one per pass */
#pragma unroll
    for (int pass = 0; pass < kPasses; pass++) {
        const int r = 4 * pass + (lane >> 3);
        raw[pass][0] = raw[pass][1] = make_uint4(0u, 0u, 0u, 0u);
        if (r >= t.lo) {
            const int64_t token = src[3 * (int64_t)clamp_row<kBlockT>(t, r) + 1];
            const uint4 *g = (const uint4 *)(x + token * H + (int64_t)kb * MF__QUANT_BLOCK + c * 16);
            raw[pass][0] = g[0];
            raw[pass][1] = g[1];
            /* the next K block's 32 bytes into L1 meanwhile: a row warp's next K block then waits
             * on an L1 hit, not on L2 */
            if ((kb + 1) * MF__QUANT_BLOCK < H) mf__prefetch_l1(g + MF__QUANT_BLOCK / 8);
        }
    }
#pragma unroll
    for (int pass = 0; pass < kPasses; pass++) {
        const int r = 4 * pass + (lane >> 3);
        const uint32_t w[8] = {raw[pass][0].x, raw[pass][0].y, raw[pass][0].z, raw[pass][0].w,
                               raw[pass][1].x, raw[pass][1].y, raw[pass][1].z, raw[pass][1].w};
        float amax = 0.0f;
#pragma unroll
        for (int k = 0; k < 16; k++) {
            const float a = fabsf(mf__bf16_to_float((uint16_t)(w[k / 2] >> (16 * (k % 2)))));
            amax = a > amax ? a : amax; /* NaN never wins, as on the CPU */
        }
#pragma unroll
        for (int off = 1; off < 8; off *= 2) { /* the row's 8 lanes */
            const float o = __shfl_xor_sync(0xffffffffu, amax, off);
            amax = o > amax ? o : amax;
        }
        float scale, inv;
        mf__fp8_block_scale(amax, ue8m0, &scale, &inv);
        uint32_t out[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t packed = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int e = 4 * i + k;
                const float v = mf__bf16_to_float((uint16_t)(w[e / 2] >> (16 * (e % 2))));
                packed |= (uint32_t)mf__fp8_from_float(__fmul_rn(v, inv)) << (8 * k);
            }
            out[i] = packed;
        }
        *(uint4 *)(act + r * kKBlock + ((c ^ (r & 7)) * kChunk)) = make_uint4(out[0], out[1], out[2], out[3]);
        if (c == 0) a_scale[r] = scale;
    }
}

template <bool kFp8, int kBlockT, bool kOwn>
__device__ __forceinline__ void producer(const small_params &p, const tables_t &tb, const int32_t *own_src,
                                         uint8_t *slots, float *scales, int32_t *tile_of, uint64_t *full,
                                         uint64_t *empty, int32_t *front) {
    using C = cfg<kFp8, kBlockT, kOwn>;
    using R = ring<C::kSlots>;
    const int lane = (int)(threadIdx.x & 31);
    const int32_t L = p.num_experts;
    const int32_t nb13 = p.I / kTileCols, nb2 = p.H / kTileCols;
    const int32_t kbytes13 = p.H * C::kEsz, kbytes2 = p.I * C::kEsz;
    const int32_t kb13 = kbytes13 / kKBlock, kb2 = kbytes2 / kKBlock; /* = H/128, I/128 scale columns (FP8) */
    const int32_t srows13 = 2 * p.I / kBoxRows, srows2 = p.H / kBoxRows; /* weight scale rows per expert */
    const uint64_t pol_w = mf__l2_policy(kMfL2EvictFirst); /* weights: read once */
    int32_t *const done = p.sync + 2;
    if (lane == 0) {
        mf__prefetch_tensormap(&p.tmap_w13);
        mf__prefetch_tensormap(&p.tmap_w2);
    }
    uint32_t it = 0;
    int32_t cur13 = 0, cur2 = 0;
    bool w2;
    tile_t t;
    bool published = !kOwn; /* kOwn: publish (the kernel before this one) has not been waited for yet */
    int32_t taken = 0;      /* the timeline's count of tickets */
    int32_t idx = take(p.sync, lane);
    if (kOwn && p.x) { /* its first rows (switch 5): the first ticket to warps 1-3 (front_rows) */
        if (lane == 0) *front = idx;
        __syncwarp();
        mf__named_barrier_arrive(kBarFront, kMfWarpgroupThreads);
    }
    for (; locate<kBlockT>(tb, L, nb13, nb2, idx, cur13, cur2, w2, t);
         idx = take(p.sync, lane, kOwn && published ? p.fault : nullptr)) {
        if (p.timeline && lane == 0) stamp_unit(p, taken++, idx, w2, false);
        /* this lane's column j = lane (kBlockT <= 32): its row's data and FP8 scales; columns below
         * lo read row lo's scales and copy no data (their D columns are never stored) */
        const int j = lane;
        const int32_t row = clamp_row<kBlockT>(t, j);
        const bool copy = j >= t.lo && j < kBlockT;
        const uint8_t *arow = NULL;
        const float *srow = NULL;
        if (!w2) {
            const int32_t *src = (kOwn ? own_src : p.src) + 3 * (int64_t)row;
            const int32_t rank = src[0], token = src[1];
            const uint8_t *heap = (uint32_t)rank < (uint32_t)MF_MAX_RANKS ? p.view.heap[rank] : NULL;
            if (heap && copy) arow = heap + p.view.x + (int64_t)token * kbytes13;
            if (heap) srow = (const float *)(heap + p.view.scales) + (int64_t)token * kb13;
            const int32_t wrow = t.e * 2 * p.I + t.nb * kBoxRows; /* gate; up at + I */
            const int64_t ws = ((int64_t)t.e * srows13 + t.nb) * kb13; /* FP8: the gate box's w_scales */
            const int64_t ws_up = ws + (int64_t)(p.I / kBoxRows) * kb13;
            /* K block kb's published part (this lane's activation row and FP8 scales) and its weights
             * (lane 0: the gate and up boxes by TMA), into ring slots sg and su */
            auto copy_x = [&](int32_t kb, uint32_t sg, uint32_t su) {
                uint8_t *act = slots + sg * C::kSlotBytes + kBoxBytes;
                if constexpr (kFp8) {
                    float *scg = scales + sg * C::kScaleStride, *scu = scales + su * C::kScaleStride;
                    if (j < kBlockT && srow) mf__cp_async_4(scg + j, srow + kb);
                    if (lane == 0) mf__cp_async_4(scg + kBlockT, p.w13_scales + ws + kb);
                    if (lane == 1) mf__cp_async_4(scu + kBlockT, p.w13_scales + ws_up + kb);
                }
                if (arow) copy_kblock(act, arow, kb, j);
                mf__cp_async_mbar_arrive_noinc(&full[sg]);
                mf__cp_async_mbar_arrive_noinc(&full[su]);
            };
            auto load_w = [&](int32_t kb, uint32_t sg, uint32_t su) {
                if (lane == 0) {
                    tile_of[sg] = idx; /* published by the arrivals below */
                    tile_of[su] = idx;
                    const int32_t kc = kb * (kKBlock / C::kEsz);
                    mf__mbar_arrive_expect_tx(&full[sg], (uint32_t)kBoxBytes);
                    mf__tma_load_2d_hint(slots + sg * C::kSlotBytes, &p.tmap_w13, &full[sg], kc, wrow, pol_w);
                    mf__mbar_arrive_expect_tx(&full[su], (uint32_t)kBoxBytes);
                    mf__tma_load_2d_hint(slots + su * C::kSlotBytes, &p.tmap_w13, &full[su], kc, wrow + p.I, pol_w);
                }
            };
            /* its first rows (switch 5): this unit's rows come from warps 1-3, its weights from here */
            const bool front_unit = kOwn && p.x && !published;
            int32_t kb = 0;
            if constexpr (kOwn) {
                if (!published && !front_unit) {
                    /* The CTA's first unit (W13 units come first): the weights of the K blocks the ring
                     * holds go out before publish has ended, its rows after the PDL wait. */
                    const int32_t early = kb13 < C::kSlots / 2 ? kb13 : C::kSlots / 2;
                    for (; kb < early; kb++) {
                        R::wait_empty(empty, it + 2 * kb);
                        R::wait_empty(empty, it + 2 * kb + 1);
                        load_w(kb, R::slot(it + 2 * kb), R::slot(it + 2 * kb + 1));
                    }
                    __syncwarp();
                    mf__pdl_wait();
                    published = true;
                    if (p.timeline && lane == 0) stamp(p, 5);
                    for (int32_t x = 0; x < early; x++) copy_x(x, R::slot(it + 2 * x), R::slot(it + 2 * x + 1));
                    it += 2 * early;
                }
            }
            for (; kb < kb13; kb++, it += 2) {
                const uint32_t sg = R::slot(it), su = R::slot(it + 1);
                R::wait_empty(empty, it);
                R::wait_empty(empty, it + 1);
                if (front_unit) {
                    load_w(kb, sg, su); /* lane 0's arrival; the other 32 are the row warp's */
                } else {
                    copy_x(kb, sg, su);
                    __syncwarp();
                    load_w(kb, sg, su);
                }
            }
        } else {
            if constexpr (kOwn) {
                if (!published) { /* a CTA whose first unit is W2: publish waited for here, so that a
                                     faulted call's stop word reaches it too (its h waits are longer) */
                    mf__pdl_wait();
                    published = true;
                    if (p.timeline && lane == 0) stamp(p, 5);
                }
            }
            if (copy) arow = p.h + (int64_t)row * kbytes2;
            if constexpr (kFp8) srow = p.h_scales + (int64_t)row * kb2;
            const int32_t wrow = t.e * p.H + t.nb * kBoxRows;
            const int64_t ws = ((int64_t)t.e * srows2 + t.nb) * kb2; /* FP8: the box's w_scales */
            /* The weights do not depend on h: each position's TMA goes out at once. h does: until the
             * expert's W13 tiles are all stored (done[e], polled once per position) the positions
             * wait for their h rows, which then follow for every position issued so far; the poll
             * blocks only when the ring holds nothing but this unit's weights (kb >= kSlots) or at
             * the unit's end. Once ready (the usual case after the W13 phase) h goes with the weights. */
            const int32_t blocks = tb.first[t.e + 1] - tb.first[t.e];
            const int32_t *const dep = done + t.e;
            const int32_t target = nb13 * blocks;
            bool ready = false;
            int32_t h_next = 0; /* the first K block whose h rows are not issued */
            auto issue_h = [&](int32_t upto) { /* h rows and scales of K blocks [h_next, upto) */
                for (; h_next < upto; h_next++) {
                    const uint32_t s = R::slot(it + h_next);
                    uint8_t *act = slots + s * C::kSlotBytes + kBoxBytes;
                    if constexpr (kFp8) {
                        float *sc = scales + s * C::kScaleStride;
                        if (j < kBlockT) mf__cp_async_4(sc + j, srow + h_next);
                        if (lane == 0) mf__cp_async_4(sc + kBlockT, p.w2_scales + ws + h_next);
                    }
                    if (arow) copy_kblock(act, arow, h_next, j);
                    mf__cp_async_mbar_arrive_noinc(&full[s]);
                }
            };
            for (int32_t kb = 0; kb < kb2; kb++) {
                if (!ready && kb >= C::kSlots) { /* the next position's last use is this unit's: h first */
                    wait_done(dep, target, p.sink);
                    ready = true;
                    issue_h(kb);
                }
                const uint32_t s = R::slot(it + kb);
                R::wait_empty(empty, it + kb);
                if (lane == 0) {
                    tile_of[s] = idx; /* published by the arrivals */
                    mf__mbar_arrive_expect_tx(&full[s], (uint32_t)kBoxBytes);
                    mf__tma_load_2d_hint(slots + s * C::kSlotBytes, &p.tmap_w2, &full[s], kb * (kKBlock / C::kEsz), wrow,
                                         pol_w);
                }
                /* every lane's own acquire (its copies follow it), one verdict for the warp */
                if (!ready) ready = __all_sync(0xffffffffu, ld_acquire(dep) >= target);
                if (kb == 0 && !ready && p.l2_ahead) { /* L2 ahead (file comment): parked, so the weights of
                    unit idx + grid, W2 unit j2 (locate's arithmetic: expert t.e or a later one) */
                    int32_t e2, nb2_, blk2;
                    if (mf__w2_unit(tb.first, L, nb2, idx + (int32_t)gridDim.x - nb13 * tb.first[L], t.e, &e2, &nb2_,
                                    &blk2) &&
                        lane < kb2) /* a box per lane: the unit's first 32 K blocks */
                        mf__tma_prefetch_2d(&p.tmap_w2, lane * (kKBlock / C::kEsz), e2 * p.H + nb2_ * kBoxRows);
                }
                if (ready) issue_h(kb + 1);
            }
            if (!ready) {
                wait_done(dep, target, p.sink);
                issue_h(kb2);
            }
            it += kb2;
        }
        if constexpr (kOwn) {
            if (!published) { /* its first rows: the first unit read nothing of publish; the next ticket's
                                 stop word is its verdict */
                __syncwarp();
                mf__pdl_wait();
                published = true;
                if (p.timeline && lane == 0) stamp(p, 5);
            }
        }
    }
    if (p.timeline && lane == 0) stamp_unit(p, taken, idx, false, true);
    /* The end: one more position, unit -1 and no data, full by plain arrivals (32 + 1) */
    const uint32_t s = R::slot(it);
    R::wait_empty(empty, it);
    if (lane == 0) tile_of[s] = -1;
    __syncwarp();
    mf__mbar_arrive(&full[s]);
    if (lane == 0) mf__mbar_arrive(&full[s]);
    mf__cp_async_wait_all();
}

/* Its first rows (kOwn, switch 5, p.x): warps 1-3 of the producer warpgroup, idle
 * otherwise, make the activation rows of the CTA's first unit, if it is a W13 unit, from the caller's
 * x while warp 0 issues that unit's weights without waiting for publish (file comment "Its first
 * rows"). The first ticket comes from warp 0 through `front` and a named barrier; locate from it, as
 * warp 0 does, gives the same unit. Warp w makes K blocks w, w + 3, ...: the unit's first positions
 * are the ring's 0, 1, ..., so K block kb's are 2 kb and 2 kb + 1; each waits for its two slots to
 * be free and gives each full barrier the 32 arrivals that warp 0's lanes give elsewhere (FP8: the
 * rows quantised as publish does, quantise_kblock, and the weight scales by generic stores, then the
 * async-proxy fence and release arrivals; BF16: x's bytes by cp.async, arriving on completion). No
 * cycle: the warp with the lowest K block kb waits only for the consumers to pass K block kb -
 * kSlots / 2, whose rows and every earlier K block's are made (each warp goes in order). */
template <bool kFp8, int kBlockT>
__device__ __forceinline__ void front_rows(const small_params &p, const tables_t &tb, const int32_t *own_src,
                                           uint8_t *slots, float *scales, uint64_t *full, uint64_t *empty,
                                           const int32_t *front) {
    using C = cfg<kFp8, kBlockT, true>;
    using R = ring<C::kSlots>;
    constexpr int kRowWarps = kMfWarpgroupThreads / kMfWarp - 1;
    mf__named_barrier_sync(kBarFront, kMfWarpgroupThreads);
    const int32_t idx = *front;
    const int32_t L = p.num_experts, nb13 = p.I / kTileCols, nb2 = p.H / kTileCols;
    int32_t cur13 = 0, cur2 = 0;
    bool w2;
    tile_t t;
    if (!locate<kBlockT>(tb, L, nb13, nb2, idx, cur13, cur2, w2, t) || w2) return;
    const int lane = (int)(threadIdx.x & 31), w = mf__warp_id() - 1;
    const int32_t kb13 = p.H * C::kEsz / kKBlock;
    const int32_t srows13 = 2 * p.I / kBoxRows;
    const int64_t ws = ((int64_t)t.e * srows13 + t.nb) * kb13; /* FP8: the gate box's w_scales */
    const int64_t ws_up = ws + (int64_t)(p.I / kBoxRows) * kb13;
    const int j = lane;
    const bool copy = j >= t.lo && j < kBlockT;
    const int64_t token = own_src[3 * (int64_t)clamp_row<kBlockT>(t, j) + 1];
    const uint8_t *arow = copy ? (const uint8_t *)(p.x + token * p.H) : NULL; /* BF16: x's bytes */
    /* FP8: the weight scales of this warp's first 32 K blocks in its lanes' registers (lane l: K block
     * w + 3 l), loaded before the first wait: a load per K block would put an HBM latency on each */
    float wg = 0.0f, wu = 0.0f;
    if constexpr (kFp8) {
        const int32_t k = w + kRowWarps * lane;
        if (k < kb13) {
            wg = p.w13_scales[ws + k];
            wu = p.w13_scales[ws_up + k];
        }
    }
    for (int32_t i = 0, kb = w; kb < kb13; i++, kb += kRowWarps) {
        const uint32_t sg = R::slot(2 * kb), su = R::slot(2 * kb + 1);
        R::wait_empty(empty, 2 * kb);
        R::wait_empty(empty, 2 * kb + 1);
        if constexpr (kFp8) {
            float *scg = scales + sg * C::kScaleStride, *scu = scales + su * C::kScaleStride;
            quantise_kblock<kBlockT>(slots + sg * C::kSlotBytes + kBoxBytes, scg, p.x, p.H, own_src, t, kb, lane,
                                     p.ue8m0);
            const float wsg = __shfl_sync(0xffffffffu, wg, i & 31), wsu = __shfl_sync(0xffffffffu, wu, i & 31);
            if (lane == 0) scg[kBlockT] = i < 32 ? wsg : p.w13_scales[ws + kb];
            if (lane == 1) scu[kBlockT] = i < 32 ? wsu : p.w13_scales[ws_up + kb];
            mf__fence_proxy_async_smem();
            mf__mbar_arrive(&full[sg]);
            mf__mbar_arrive(&full[su]);
        } else {
            if (arow) copy_kblock(slots + sg * C::kSlotBytes + kBoxBytes, arow, kb, j);
            mf__cp_async_mbar_arrive_noinc(&full[sg]);
            mf__cp_async_mbar_arrive_noinc(&full[su]);
        }
    }
    mf__cp_async_wait_all();
}

/* ---- the sum (R = 1) ---------------------------------------------------------------------------- */

/* y of the tokens with no valid k (every id -1): no W2 tile arrives for them, so CTA b writes them,
 * tokens b, b + grid, ... (the sum kernel's result: nothing added, a BF16 zero). Consumer threads. */
__device__ __forceinline__ void sum_dropped(const small_params &p, int ctid) {
    const uint8_t *heap = p.view.heap[p.view.rank];
    for (int32_t token = (int32_t)blockIdx.x; token < p.T; token += (int32_t)gridDim.x) {
        const int32_t *ids = (const int32_t *)(heap + p.view.ids) + (int64_t)token * p.num_topk;
        int32_t valid = 0;
        for (int32_t k = 0; k < p.num_topk; k++) valid += ids[k] >= 0;
        if (valid || *(volatile const int32_t *)p.fault) continue;
        for (int32_t c = ctid; c < p.H / 8; c += kConsumerThreads)
            *(uint4 *)(p.y + (int64_t)token * p.H + c * 8) =
                mf__sum_columns<true>(ids, (const float *)(heap + p.view.weights) + (int64_t)token * p.num_topk,
                                      (const uint16_t *)(heap + p.view.combine) + (int64_t)token * p.num_topk * p.H,
                                      p.num_topk, p.H, c);
    }
}

/* After a W2 tile's rows are in their combine slots: each row's token arrives on its (token, n-block)
 * counter (release: this tile's stores, ordered by the barrier, then a fence and the add); the row
 * whose arrival completes the token's valid k sums that token's 128 columns here (acquire: a fence
 * after the add; the partials of other CTAs read through L2), 16 consumer threads of 8 columns each,
 * with the sum kernel's arithmetic (kernels/sum.cuh). A token routes to an expert at most once, so
 * the rows of one tile are distinct tokens. */
template <int kBlockT>
__device__ __forceinline__ void sum_tile(const small_params &p, const int32_t *src_table, const tile_t &t, int32_t nb2,
                                         int ctid, int32_t *flags) {
    static_assert(kBlockT * 16 <= kConsumerThreads, "16 threads per token row");
    const uint8_t *heap = p.view.heap[p.view.rank];
    const int32_t *ids_all = (const int32_t *)(heap + p.view.ids);
    int32_t *arrive = p.sync + 2 + p.num_experts;
    mf__named_barrier_sync(kBarEpilogue, kConsumerThreads); /* every row of the tile is in its slot */
    if (ctid < kBlockT) {
        int32_t flag = 0;
        if (ctid >= t.lo) {
            const int32_t *src = src_table + 3 * ((int64_t)t.row0 + ctid);
            const int32_t token = src[1];
            if (src[0] == p.view.rank && token >= 0 && token < p.T) {
                const int32_t *ids = ids_all + (int64_t)token * p.num_topk;
                int32_t want = 0;
                for (int32_t k = 0; k < p.num_topk; k++) want += ids[k] >= 0 ? 1 : 0;
                __threadfence();
                if (atomicAdd(arrive + (int64_t)token * nb2 + t.nb, 1) + 1 == want) {
                    __threadfence();
                    flag = token + 1;
                }
            }
        }
        flags[ctid] = flag;
    }
    mf__named_barrier_sync(kBarEpilogue, kConsumerThreads);
    const int j = ctid / 16;
    if (j < kBlockT && flags[j] > 0 && !*(volatile const int32_t *)p.fault) {
        const int32_t token = flags[j] - 1, c = t.nb * 16 + ctid % 16;
        *(uint4 *)(p.y + (int64_t)token * p.H + c * 8) =
            mf__sum_columns<true>(ids_all + (int64_t)token * p.num_topk,
                                  (const float *)(heap + p.view.weights) + (int64_t)token * p.num_topk,
                                  (const uint16_t *)(heap + p.view.combine) + (int64_t)token * p.num_topk * p.H,
                                  p.num_topk, p.H, c);
    }
}

/* ---- consumers --------------------------------------------------------------------------------- */

template <bool kFp8, int kBlockT, bool kOwn>
__device__ __forceinline__ void consumer(const small_params &p, const tables_t &tb, const int32_t *own_src,
                                         uint8_t *slots, const float *scales, const int32_t *tile_of, uint8_t *epi,
                                         float *red, int32_t *sum_flags, int32_t *unit, uint64_t *full,
                                         uint64_t *empty) {
    using C = cfg<kFp8, kBlockT, kOwn>;
    using R = ring<C::kSlots>;
    constexpr int kFrag = kBlockT / 2;
    const int ctid = (int)threadIdx.x - kMfWarpgroupThreads; /* 0..255 */
    const int wg = ctid / kMfWarpgroupThreads;              /* weight rows [64 wg, 64 wg + 64) of each box */
    const int lane = ctid & 31, quad = lane & 3;
    const int32_t L = p.num_experts;
    const int32_t nb13 = p.I / kTileCols, nb2 = p.H / kTileCols;
    const int32_t kb13 = p.H * C::kEsz / kKBlock, kb2 = p.I * C::kEsz / kKBlock;
    const uint64_t desc_slots = mf__wgmma_desc_sw128(slots);
    int32_t *const done = p.sync + 2;

    float tmp[2][kFrag];
#pragma unroll
    for (int b = 0; b < 2; b++)
#pragma unroll
        for (int i = 0; i < kFrag; i++) tmp[b][i] = 0.0f;
    float tmp2[1][kFrag];
#pragma unroll
    for (int i = 0; i < kFrag; i++) tmp2[0][i] = 0.0f;

    const int32_t *const src = kOwn ? own_src : p.src;
    /* publish's rows, ids, weights and fault verdict (the producer waits for them before its first
     * activation copy; with its first rows, switch 5, after its first unit); with its first rows a
     * first W13 unit reads nothing of publish: the wait comes before the second unit, a W2 unit or
     * the end */
    bool published = false;
    auto wait_publish = [&]() {
        if constexpr (kOwn) mf__pdl_wait();
        if (p.y) sum_dropped(p, ctid);
        published = true;
    };
    if (!kOwn || !p.x) wait_publish();

    uint32_t it = 0;
    int32_t cur13 = 0, cur2 = 0;
    bool w2;
    tile_t t;
    /* Each unit is read by one thread and handed to all 256 (unit[u & 1], a named barrier): once the
     * pipeline drains (a wait expired: every wait returns at once, the producer overwrites ring
     * positions the consumers have not used) they all leave together at the next unit, instead of
     * reading tile_of apart (different units, different barriers) or walking stale ones forever. */
    for (uint32_t u = 0;; u++) {
        R::wait_full(full, it, p.sink);
        if (p.timeline && it == 0 && ctid == 0) stamp(p, 2);
        if (ctid == 0) unit[u & 1] = mf__sm90_expired ? -1 : tile_of[R::slot(it)];
        mf__named_barrier_sync(kBarEpilogue, kConsumerThreads);
        const int32_t idx = unit[u & 1];
        if (idx < 0 || !locate<kBlockT>(tb, L, nb13, nb2, idx, cur13, cur2, w2, t)) break;
        if (!published && (u > 0 || w2)) wait_publish();
        if (!w2) {
            float acc[2][kFrag];
#pragma unroll
            for (int b = 0; b < 2; b++)
#pragma unroll
                for (int i = 0; i < kFrag; i++) acc[b][i] = 0.0f;
            for (int32_t kb = 0; kb < kb13; kb++, it += 2) {
                const uint32_t sg = R::slot(it), su = R::slot(it + 1);
                R::wait_full(full, it, p.sink);
                R::wait_full(full, it + 1, p.sink);
                mf__fence_proxy_async_smem(); /* cp.async or st.shared (generic) -> wgmma (async) */
                const uint64_t da[2] = {
                    mf__wgmma_desc_advance(desc_slots, sg * C::kSlotBytes + wg * kWgOperandBytes),
                    mf__wgmma_desc_advance(desc_slots, su * C::kSlotBytes + wg * kWgOperandBytes)};
                const uint64_t db = mf__wgmma_desc_advance(desc_slots, sg * C::kSlotBytes + kBoxBytes);
                const float *scg = scales + sg * C::kScaleStride;
                const float *const ws[2] = {scg + kBlockT, scales + su * C::kScaleStride + kBlockT};
                mma_kblock<kFp8, 2, kBlockT>(acc, tmp, da, db, scg, ws, quad);
                release_stage(empty, sg, lane);
                release_stage(empty, su, lane);
            }
            stage_tile<kFp8, kEpiSwiglu, kBlockT, C::kOutEsz13, C::kEpiRowBytes13>(acc, epi, red, p.ue8m0, p.h_scales,
                                                                                 p.I / MF__QUANT_BLOCK, t, ctid);
            store_tile<kEpiSwiglu, kBlockT, C::kOutEsz13, C::kEpiRowBytes13>(p, src, p.h, false, epi, p.I, t, ctid);
            /* h of this tile stored by all 256 threads: publish it */
            mf__named_barrier_sync(kBarEpilogue, kConsumerThreads);
            if (ctid == 0) {
                __threadfence();
                atomicAdd(done + t.e, 1);
            }
        } else {
            float acc[1][kFrag];
#pragma unroll
            for (int i = 0; i < kFrag; i++) acc[0][i] = 0.0f;
            for (int32_t kb = 0; kb < kb2; kb++, it++) {
                const uint32_t s = R::slot(it);
                R::wait_full(full, it, p.sink);
                mf__fence_proxy_async_smem();
                const uint64_t da[1] = {mf__wgmma_desc_advance(desc_slots, s * C::kSlotBytes + wg * kWgOperandBytes)};
                const uint64_t db = mf__wgmma_desc_advance(desc_slots, s * C::kSlotBytes + kBoxBytes);
                const float *sc = scales + s * C::kScaleStride;
                const float *const ws[1] = {sc + kBlockT};
                mma_kblock<kFp8, 1, kBlockT>(acc, tmp2, da, db, sc, ws, quad);
                release_stage(empty, s, lane);
            }
            stage_tile<kFp8, kEpiPlain, kBlockT, 2, C::kEpiRowBytes2>(acc, epi, red, p.ue8m0, NULL, 0, t, ctid);
            store_tile<kEpiPlain, kBlockT, 2, C::kEpiRowBytes2>(p, src, NULL, true, epi, p.H, t, ctid);
            if (p.y) sum_tile<kBlockT>(p, src, t, nb2, ctid, sum_flags);
        }
    }
    if (!published) wait_publish();
}

/* ---- the kernel -------------------------------------------------------------------------------- */

template <bool kFp8, int kBlockT, bool kOwn>
__global__ void __launch_bounds__(kThreads, 1) sm90_small_kernel(const __grid_constant__ small_params p) {
    using C = cfg<kFp8, kBlockT, kOwn>;
    /* the shared-memory map, spelled as the decode kernel spells its own (deliberate: a helper that
     * returned these pointers moved the tile walk off the uniform datapath, sm90_core.cuh align_pad) */
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = smem_raw + align_pad(smem_raw);
    uint8_t *slots = smem + C::kOffSlots;
    uint8_t *epi = smem + C::kOffEpi;
    float *scales = (float *)(smem + C::kOffScales);
    float *red = (float *)(smem + C::kOffRed);
    tables_t tb;
    tables_at<kMaxExperts>(tb, smem + C::kOffTables);
    int32_t *tile_of = (int32_t *)(smem + C::kOffTileOf);
    int32_t *last = (int32_t *)(smem + C::kOffFlag);
    int32_t *sum_flags = (int32_t *)(smem + C::kOffSumFlags);
    int32_t *own_src = (int32_t *)(smem + C::kOffSrc); /* kOwn */
    int32_t *unit = (int32_t *)(smem + C::kOffUnit);
    uint64_t *full = (uint64_t *)(smem + C::kOffBars);
    uint64_t *empty = full + C::kSlots;
    if (p.timeline && threadIdx.x == 0) {
        stamp(p, 0);
        stamp_sm(p);
    }
    /* first[e]: the token blocks of the experts < e (units = blocks x n-blocks of each phase) */
    if constexpr (kOwn) { /* the prologue without the PDL wait: the tables are the kernel's own */
        if (threadIdx.x == 0) ring<C::kSlots>::init(full, empty, 1 + 32);
        own_tables(p, tb, own_src, (int32_t *)slots);
        mf__pdl_trigger();
    } else {
        prologue<C::kSlots, false>(p, full, empty, 1 + 32, tb,
                                   [](int32_t rows) { return (rows + kBlockT - 1) / kBlockT; });
    }
    if (p.timeline && threadIdx.x == 0) stamp(p, 1);

    /* the split: 72 registers for the producer, 216 for the consumers (8-token tiles need far fewer;
     * no variant spills) */
    if (producer_role<72, 216>()) {
        if (mf__warp_id() == 0) {
            producer<kFp8, kBlockT, kOwn>(p, tb, own_src, slots, scales, tile_of, full, empty, last + 1);
        } else if constexpr (kOwn) { /* warps 1-3: switch 5's first rows, else nothing */
            if (p.x) front_rows<kFp8, kBlockT>(p, tb, own_src, slots, scales, full, empty, last + 1);
        }
        return;
    }
    consumer<kFp8, kBlockT, kOwn>(p, tb, own_src, slots, scales, tile_of, epi, red, sum_flags, unit, full, empty);

    /* The count-out (consumers only: their W13 counters are raised; no unit is taken after a CTA's
     * producer saw the end): the last CTA zeroes the ticket, the count and the counters. */
    const int ctid = (int)threadIdx.x - kMfWarpgroupThreads;
    if (ctid == 0) mf__pipeline_check(p.sink, kTagProducerEmpty); /* a producer's expiry records nothing itself */
    if (p.timeline && ctid == 0) stamp(p, 3);
    mf__named_barrier_sync(kBarEpilogue, kConsumerThreads);
    if (ctid == 0) {
        __threadfence();
        *last = atomicAdd(p.sync + 1, 1) == (int32_t)gridDim.x - 1;
    }
    mf__named_barrier_sync(kBarEpilogue, kConsumerThreads);
    if (*last) {
        __threadfence();
        const int32_t words = 2 + p.num_experts + (p.y ? p.T * (p.H / kTileCols) : 0);
        for (int32_t i = ctid; i < words; i += kConsumerThreads) p.sync[i] = 0;
    }
}

} /* namespace mf__small */

/* What gemm_small.cu ships (cuda/gemm_family.cuh's variant info), for the lab and diagnostics. */
typedef struct mf__gemm_variant_info mf__gemm_variant_info_t;
int mf__sm90_small_variants(mf__gemm_variant_info_t *out, int max);


#endif /* MF_CUDA_KERNELS_SM90_SMALL_GEMM_CUH */
