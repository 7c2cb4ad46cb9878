/*
 * sm90_tma_lab_kernel.cuh — the lab's fork of the shipped TMA grouped GEMM (src/cuda/kernels/
 * sm90_tma_gemm.cuh), for A/B measurements and timing probes only; included by
 * dev/cuda/sm90_gemm_lab.cu, never by the library (llm.c's dev/: the lab forks what it varies, the
 * shipped kernel carries no lab parameter). What varies in sm90_tma_lab_kernel is the FP8
 * consumer's schedule; the producer, the BF16 main loop, the epilogues and the whole host contract
 * are the shipped kernel's, reused from its header, so an A/B measures one change. Its second
 * kernel, sm90_tma_half_kernel (below, "the 64-row tail tile"), forks the producer, the consumers
 * and the launch (two more tensor maps) for the tail tiles, and reuses the rest.
 *
 * Dimension legend: as sm90_tma_gemm.cuh (L local experts, N weight rows per expert, K the
 * reduction dim, H hidden, I intermediate, rows = receive rows).
 *
 *   kOrder      the FP8 issue order: kOrderIssue, what ships ("Issue order" in the kernel header);
 *               kOrderNone, both warpgroups issue as soon as the stage is full; kOrderStagger, the
 *               warpgroups take turns by completion: each box's 4 wgmmas go out as two commit
 *               groups, and a warpgroup hands the turn over once its first group has completed
 *               (wait_group 1), so the other's group queues behind its second half instead of
 *               running interleaved with all of it, and each promotion runs while the other
 *               warpgroup's wgmmas keep the tensor cores busy (bench/NOTES.md "Issue 27: the FP8
 *               consumers staggered")
 *   kNoOverlap  FP8 without the epilogue overlap (the next tile's first wgmmas are issued after
 *               the epilogue, not before it)
 *   kProbe      a timing probe whose results are not the GEMM: kProbeNoPromote, FP8 without the
 *               overlap, each box's wgmmas straight into its half of acc (the same waits, no
 *               scales, no promotion); kProbeNoStore, no epilogue (its code stays behind a test that
 *               is never true, so the main loop is compiled as in what ships)
 *
 * <kFp8, kEpi, kOrderIssue, false, kProbeNone> is the shipped kernel's arithmetic (kOrderStagger's
 * and the tail tiles' too: the same wgmmas over the same bytes in the same order; the lab's validate
 * requires the shipped kernel's bits of every lab variant); the lab runs that one through the
 * library's launchers, never from here. Launching: tma_lab_w13_swiglu / tma_lab_w2
 * below take the library launchers' arguments and run the variant the lab switch (kMfTmaLab*)
 * selects, with the launchers' tensor maps and persistent grid (shapes are the lab's and valid:
 * nothing is declined but a kernel of the wrong register count).
 */
#ifndef MF_DEV_SM90_TMA_LAB_KERNEL_CUH
#define MF_DEV_SM90_TMA_LAB_KERNEL_CUH

#include "cuda/kernels/sm90_tma_gemm.cuh"

/* The lab switch (bits): 0 = what ships; FP8: 1 = without the issue order, 2 = without the epilogue
 * overlap, 4 = without the overlap and without the promotion (timing only), 16 = the staggered
 * turns (kOrderStagger, with the overlap), 32 = the 64-row tail tiles (sm90_tma_half_kernel, with
 * the issue order and the overlap); BF16: 8 = without the epilogue (timing only, nothing is
 * written), 32 = the 64-row tail tiles. */
enum { kMfTmaLabShipped = 0, kMfTmaLabUnordered = 1, kMfTmaLabNoOverlap = 2, kMfTmaLabNoPromote = 4, kMfTmaLabNoStore = 8,
       kMfTmaLabStagger = 16, kMfTmaLabHalf = 32 };

namespace mf__tma_lab {

using namespace mf__tma;

enum { kProbeNone = 0, kProbeNoPromote = 1, kProbeNoStore = 2 };
enum { kOrderNone = 0, kOrderIssue = 1, kOrderStagger = 2 };

/* fp8_issue of the shipped kernel, with the issue order optional or staggered (kOrder) and (kZero =
 * false) accumulating from the first wgmma on (the promotion probe). kOrderStagger: the turn (the
 * same two named barriers, one sync before and one arrival per group as kOrderIssue) passes once
 * the first two k-steps have completed; the caller's wait_group 0 then waits for the other two.
 * Both commit groups and the wait_group 1 stay within this function (no group issued before a loop
 * edge is waited on with wait_group 1: ptxas would serialise every wgmma, bench/NOTES.md). */
template <int kOrder, bool kZero = true>
__device__ __forceinline__ void fp8_issue(float *tmp, uint64_t desc_st, int wg, int b) {
    const uint64_t da = mf__wgmma_desc_advance(desc_st, wg * kWgOperandBytes);
    const uint64_t db = mf__wgmma_desc_advance(desc_st, kABytes + b * kBoxBytes);
    mf__fence_fragment<kBoxRows>(tmp);
    if (kOrder != kOrderNone) mf__named_barrier_sync(wg == 0 ? kBarIssued1 : kBarIssued0, kConsumerThreads);
    mf__wgmma_fence();
#pragma unroll
    for (int k = 0; k < kKSteps; k++) {
        mf__wgmma_e4m3<kBoxRows>(tmp, mf__wgmma_desc_advance(da, k * kKStepBytes), mf__wgmma_desc_advance(db, k * kKStepBytes),
                                 (k > 0 || !kZero) ? 1 : 0);
        if (kOrder == kOrderStagger && k == kKSteps / 2 - 1) mf__wgmma_commit();
    }
    mf__wgmma_commit();
    /* the first half is done: the other warpgroup's group queues behind the second (tmp is still
     * being written: no fence on it until the caller's wait_group 0) */
    if constexpr (kOrder == kOrderStagger) mf__wgmma_wait<1>();
    if (kOrder != kOrderNone) mf__named_barrier_arrive(wg == 0 ? kBarIssued0 : kBarIssued1, kConsumerThreads);
}

/* fp8_kblock of the shipped kernel with the issue order optional or staggered. */
template <int kOrder, bool kFirst, bool kIssued>
__device__ __forceinline__ void fp8_kblock(const consumer_t &c, float *acc, float *tmp, uint32_t it) {
    const uint32_t slot = ring_t::slot(it);
    const uint64_t desc_st = mf__wgmma_desc_advance(c.desc_stages, slot * kStageBytes);
    if (!kIssued) {
        ring_t::wait_full(c.full, it, *c.sink);
        fp8_issue<kOrder>(tmp, desc_st, c.wg, 0);
    }
    const float sa_lo = c.a_sc[slot * kBlockM + c.row_lo], sa_hi = c.a_sc[slot * kBlockM + c.row_lo + 8];
    const float sw0 = c.w_sc[slot * kWScaleSlots], sw1 = c.w_sc[slot * kWScaleSlots + 1];
    mf__wgmma_wait<0>();
    mf__fence_fragment<kBoxRows>(tmp);
    fp8_promote<kFirst>(acc, tmp, sa_lo * sw0, sa_hi * sw0);
    fp8_issue<kOrder>(tmp, desc_st, c.wg, 1);
    mf__wgmma_wait<0>();
    mf__fence_fragment<kBoxRows>(tmp);
    release(c, slot);
    fp8_promote<kFirst>(acc + kBoxAcc, tmp, sa_lo * sw1, sa_hi * sw1);
}

/* kProbeNoPromote: fp8_kblock's issues and waits, each box's wgmmas straight into its half of acc
 * (zeroed on the tile's first K block), no scales, no promotion. */
template <int kOrder, bool kFirst>
__device__ __forceinline__ void fp8_kblock_probe(const consumer_t &c, float *acc, uint32_t it) {
    const uint32_t slot = ring_t::slot(it);
    const uint64_t desc_st = mf__wgmma_desc_advance(c.desc_stages, slot * kStageBytes);
    ring_t::wait_full(c.full, it, *c.sink);
    fp8_issue<kOrder, kFirst>(acc, desc_st, c.wg, 0);
    mf__wgmma_wait<0>();
    mf__fence_fragment<kBoxRows>(acc);
    fp8_issue<kOrder, kFirst>(acc + kBoxAcc, desc_st, c.wg, 1);
    mf__wgmma_wait<0>();
    mf__fence_fragment<kBoxRows>(acc + kBoxAcc);
    release(c, slot);
}

/* The shipped consumer with the lab's three parameters. */
template <bool kFp8, int kEpi, int kOrder, bool kNoOverlap, int kProbe>
__device__ __forceinline__ void consumer(const gemm_params &p, const tables_t &tb, int32_t nblocks, consumer_t &c,
                                         float *acc, float *tmp) {
    constexpr bool kOverlap = kFp8 && !kNoOverlap;
    static_assert(kProbe != kProbeNoPromote || (kFp8 && kNoOverlap), "the promotion probe is FP8 without the overlap");
    const int32_t kblocks = (p.K * (kFp8 ? 1 : 2) + kKBlock - 1) / kKBlock;
    uint32_t it = 0;
    int32_t cursor = 0, idx = (int32_t)blockIdx.x;
    tile_t t;
    if (!next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, idx, cursor, t)) return;
    if (kFp8 && kOrder != kOrderNone && c.wg == 1) mf__named_barrier_arrive(kBarIssued1, kConsumerThreads);
    if constexpr (kOverlap) {
        ring_t::wait_full(c.full, 0, *c.sink);
        fp8_issue<kOrder>(tmp, c.desc_stages, c.wg, 0);
    }
    for (;;) {
        if constexpr (kProbe == kProbeNoPromote) {
            fp8_kblock_probe<kOrder, true>(c, acc, it++);
            for (int32_t kb = 1; kb < kblocks; kb++) fp8_kblock_probe<kOrder, false>(c, acc, it++);
        } else if constexpr (kFp8) {
            fp8_kblock<kOrder, true, kOverlap>(c, acc, tmp, it++);
            for (int32_t kb = 1; kb < kblocks; kb++) fp8_kblock<kOrder, false, false>(c, acc, tmp, it++);
        } else {
            bf16_mainloop(c, acc, it, kblocks);
        }
        int32_t idx_next = -1;
        if constexpr (kOverlap) {
            ring_t::wait_full(c.full, it, *c.sink);
            idx_next = c.tile_of[ring_t::slot(it)];
            const uint32_t at = idx_next >= 0 ? it : it - 1;
            fp8_issue<kOrder>(tmp, mf__wgmma_desc_advance(c.desc_stages, ring_t::slot(at) * kStageBytes), c.wg, 0);
        }
        /* kProbeNoStore: ue8m0 is 0 or 1, so the epilogue never runs, yet it keeps acc, hence the
         * main loop's wgmmas, alive (the wgmma asm has no side effect of its own) */
        if (kProbe != kProbeNoStore || p.ue8m0 == 0x7fffffff) epilogue<kFp8, kEpi>(p, c, t, acc);
        if constexpr (!kOverlap) {
            ring_t::wait_full(c.full, it, *c.sink);
            idx_next = c.tile_of[ring_t::slot(it)];
        }
        if (idx_next < 0) break;
        idx = idx_next;
        next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, idx, cursor, t);
    }
    if constexpr (kOverlap) mf__wgmma_wait<0>();
    if (kFp8 && kOrder != kOrderNone && c.wg == 0) mf__named_barrier_sync(kBarIssued1, kConsumerThreads);
}

/* A consumer thread's state from the kernel's aligned shared-memory base (the shipped kernel sets
 * the same fields inline: moving them into a helper there changed the SASS of 3 of its 4 kernels). */
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

/* The shipped kernel's body around the lab's consumer. */
template <bool kFp8, int kEpi, int kOrder, bool kNoOverlap, int kProbe>
__global__ void __launch_bounds__(kThreads, 1) sm90_tma_lab_kernel(const __grid_constant__ gemm_params p) {
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
    const int32_t nblocks = kEpi == kEpiSwiglu ? p.N / (2 * kHCols) : p.N / kTileN;
    prologue<kStages, true>(p, full, empty, kFullArrivals, tb, [](int32_t rows) { return (rows + kBlockM - 1) / kBlockM; });

    if (producer_role()) {
        if (mf__warp_id() == 0) producer<kFp8, kEpi>(p, tb, nblocks, stages, a_sc, w_sc, tile_of, full, empty);
    } else {
        consumer_t c;
        consumer_at(c, smem);
        c.sink = &p.sink;
        float acc[kAcc];
        float tmp[kFp8 ? kBoxAcc : 1];
#pragma unroll
        for (int i = 0; i < (kFp8 ? kBoxAcc : 1); i++) tmp[i] = 0.0f;
        consumer<kFp8, kEpi, kOrder, kNoOverlap, kProbe>(p, tb, nblocks, c, acc, tmp);
        if (threadIdx.x == kMfWarpgroupThreads) mf__pipeline_check(p.sink, kTagProducerEmpty);
    }
}

/* ---- the 64-row tail tile (kMfTmaLabHalf, FP8 and BF16; bench/NOTES.md "Issue 27: the 64-row tail tile") ---
 *
 * A tile whose rows that belong to it are all in its second half (t.lo >= 64: an expert's last,
 * partial m-block of at most 64 rows, or a whole expert of at most 64) is a tail tile. What ships
 * computes it as a full 128-row tile: the 16 KB A box, both warpgroups' wgmmas over 128 rows, and
 * stores only rows [lo, 128). Here a tail tile loads only tile rows [64, 128) (a 64-row A box, its
 * own map, at the stage's second 8 KB; the first 8 KB stay as they were and nobody reads them) and
 * the same 32 KB of weights, and both consumer warpgroups work on those 64 rows, each on half of
 * the tile's columns: plain, warpgroup w takes weight box w (output columns 128 w .. + 128);
 * SwiGLU, warpgroup w takes h columns 64 w .. + 64, so it needs the gate AND up rows of those
 * columns, which the producer lays out as one 16 KB operand per warpgroup from four 64-row weight
 * boxes (its own map): [gate 0-63 | up 0-63 | gate 64-127 | up 64-127]. Each warpgroup issues ONE
 * m64n128k32 group per K block (a full tile: two), of the same shape as a full tile's, so the
 * epilogue overlap's issue picks the next tile's operands by offsets alone (no wgmma on a divergent
 * path). Per K block a tail tile moves 40 KB instead of 48 and runs half the tensor work.
 *
 * The arithmetic of every stored element is what ships: the same k32 wgmmas over the same bytes in
 * the same K order, the same promotion, the same epilogue math; only the FP8 h scale of a row,
 * the amax over its 128 h columns, now spans both warpgroups: each writes its rows' amax over its
 * 64 columns to shared memory (two buffers, alternating per tail tile), a named barrier of the 256
 * consumer threads, each takes the max with the other's (max is exact: the same scale). The lab's
 * validate checks the bits against what ships (run 3 of a lab case is the library's kernel).
 * BF16 the same way with m64n128k16 (no temporary, no promotion, no overlap, so no kind in the
 * overlap's issue; the SwiGLU h needs no amax). */

struct half_params {
    gemm_params p;        /* what ships launches with */
    CUtensorMap tmap_a64; /* activations [kMaxRowCoord, K], box [64 rows, 128 B], 128B swizzle */
    CUtensorMap tmap_w64; /* weights [L N, K], box [64 rows, 128 B], 128B swizzle */
};

constexpr int kHalfRows = kWgRows;                                    /* a tail tile's rows: [64, 128) */
constexpr int kHalfN = kBoxRows;                                      /* a warpgroup's columns (wgmma N) */
constexpr int kHalfStageBytes = kWgOperandBytes + kBoxes * kBoxBytes; /* 40 KB of TMA */
enum { kBarAmax = 3 };                                                /* named barrier: the h amax exchange */
constexpr int kOffAmax = align_up(kOffTables + (3 * kMaxExperts + 1) * 4, 16); /* [2][2 wg][64 rows] f32 */
constexpr int kHalfSmemBytes = kOffAmax + 2 * 2 * kHalfRows * 4 + kMfSwizzleAtomBytes;
static_assert(kHalfSmemBytes <= kSmemLimit, "the tail tile's shared memory exceeds 227 KB");
static_assert((int)kBarAmax != (int)kBarIssued0 && (int)kBarAmax != (int)kBarIssued1, "named barriers must differ");

__device__ __forceinline__ bool is_half(const tile_t &t) { return t.lo >= kHalfRows; }

/* %tid.x, read where it is used (asm volatile: not hoisted). The tail tiles' values derived from
 * the thread's warpgroup and warp, computed once at the consumer's start, were spilled (the
 * consumer has 232 registers, 192 of them accumulators); read here they cost an S2R. */
__device__ __forceinline__ uint32_t tid_here(void) {
    uint32_t tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    return tid;
}
__device__ __forceinline__ int wg_here(void) { return (int)(tid_here() / kMfWarpgroupThreads) - 1; } /* consumer 0, 1 */

/* n-blocks per expert (computed in each role, after the register split: one computed before it was
 * spilled across setmaxnreg) */
template <int kEpi>
__device__ __forceinline__ int32_t n_blocks(const gemm_params &p) {
    return kEpi == kEpiSwiglu ? p.N / (2 * kHCols) : p.N / kTileN;
}

/* Byte offsets in a stage of warpgroup wg's operands for its group of weight box b: a full tile,
 * its 64 rows and box b; a tail tile, rows [64, 128) and its own 16 KB of weights. Selects, not
 * branches: the group's wgmmas are the same instructions either way. */
__device__ __forceinline__ uint32_t a_off(bool half, int wg) { return (uint32_t)(half ? 1 : wg) * kWgOperandBytes; }
__device__ __forceinline__ uint32_t b_off(bool half, int wg, int b) { return (uint32_t)(kABytes + (half ? wg : b) * kBoxBytes); }

/* The shipped fp8_issue with the operands at byte offsets of the stage at desc_st. */
__device__ __forceinline__ void fp8_issue_at(float *tmp, uint64_t desc_st, int wg, uint32_t aoff, uint32_t boff) {
    const uint64_t da = mf__wgmma_desc_advance(desc_st, aoff);
    const uint64_t db = mf__wgmma_desc_advance(desc_st, boff);
    mf__fence_fragment<kBoxRows>(tmp);
    mf__named_barrier_sync(wg == 0 ? kBarIssued1 : kBarIssued0, kConsumerThreads);
    mf__wgmma_fence();
#pragma unroll
    for (int k = 0; k < kKSteps; k++)
        mf__wgmma_e4m3<kBoxRows>(tmp, mf__wgmma_desc_advance(da, k * kKStepBytes), mf__wgmma_desc_advance(db, k * kKStepBytes),
                                 k > 0 ? 1 : 0);
    mf__wgmma_commit();
    mf__named_barrier_arrive(wg == 0 ? kBarIssued0 : kBarIssued1, kConsumerThreads);
}

/* fp8_promote over the first kN accumulators (kN a multiple of 4). */
template <bool kFirst, int kN>
__device__ __forceinline__ void promote_n(float *acc, const float *tmp, float s_lo, float s_hi) {
#pragma unroll
    for (int j = 0; j < kN / 4; j++) {
        if (kFirst) { /* the shipped fp8_promote's two forms: the first assigns (0 + x would lose -0) */
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

/* A tail tile's K block at ring position `it` (kIssued: its group is in flight). Plain: acc[0, 64) = box wg's 128 columns; SwiGLU: acc[0, 32) gate, acc[32, 64) up
 * of h columns 64 wg .. + 64. */
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
        promote_n<kFirst, kBoxAcc / 2>(acc, tmp, sa_lo * sw0, sa_hi * sw0);
        promote_n<kFirst, kBoxAcc / 2>(acc + kBoxAcc / 2, tmp + kBoxAcc / 2, sa_lo * sw1, sa_hi * sw1);
    } else {
        const float sw = c.wg ? sw1 : sw0;
        promote_n<kFirst, kBoxAcc>(acc, tmp, sa_lo * sw, sa_hi * sw);
    }
}

/* BF16: a tail tile's whole K loop into acc[0, 64) (the layout of half_kblock's), as the shipped
 * bf16_mainloop: one group kept in flight, a stage released when the next one's group is issued. */
__device__ __forceinline__ void bf16_half_mainloop(const consumer_t &c, float *acc, uint32_t &it, int32_t kblocks) {
    int32_t prev = -1;
    mf__fence_fragment<kHalfN>(acc);
    for (int32_t kb = 0; kb < kblocks; kb++, it++) {
        const uint32_t slot = ring_t::slot(it);
        ring_t::wait_full(c.full, it, *c.sink);
        const uint64_t desc_st = mf__wgmma_desc_advance(c.desc_stages, slot * kStageBytes);
        const uint64_t da = mf__wgmma_desc_advance(desc_st, a_off(true, c.wg));
        const uint64_t db = mf__wgmma_desc_advance(desc_st, b_off(true, c.wg, 0));
        mf__wgmma_fence();
#pragma unroll
        for (int k = 0; k < kKSteps; k++)
            mf__wgmma_bf16<kHalfN>(acc, mf__wgmma_desc_advance(da, k * kKStepBytes), mf__wgmma_desc_advance(db, k * kKStepBytes),
                                   (kb > 0 || k > 0) ? 1 : 0);
        mf__wgmma_commit();
        mf__wgmma_wait<1>();
        if (prev >= 0) release(c, (uint32_t)prev);
        prev = (int32_t)slot;
    }
    mf__wgmma_wait<0>();
    if (prev >= 0) release(c, (uint32_t)prev);
    mf__fence_fragment<kHalfN>(acc);
}

/* row_target for tile row tr (a tail tile's rows are [64, 128) in both warpgroups). */
template <int kEpi>
__device__ __forceinline__ uint8_t *half_row_target(const gemm_params &p, const tile_t &t, int tr, int64_t row_bytes,
                                                    int64_t col_bytes) {
    if (tr < t.lo) return NULL;
    const int64_t row = (int64_t)t.row0 + tr;
    if (kEpi == kEpiPlain && p.use_ret) {
        uint8_t *dst;
        return ret_row(p, p.src, row, p.N, dst) ? dst + col_bytes : NULL;
    }
    return p.out + row * row_bytes + col_bytes;
}

/* A tail tile's epilogue, per consumer warp (its 16 of the 64 rows); par: which of the two amax
 * buffers [2 wg][64 rows] at kOffAmax (SwiGLU FP8; found from the warp's staging buffer, so that no
 * pointer stays live through the main loop). */
template <bool kFp8, int kEpi>
__device__ __forceinline__ void half_epilogue(const gemm_params &p, const consumer_t &c, const tile_t &t, float *acc,
                                              uint32_t par) {
    const int wr = kHalfRows + (int)(tid_here() / 32 % 4) * kWarpRows; /* tile row of the warp's first row */
    if constexpr (kEpi == kEpiPlain) {
        /* box wg's 128 columns: two passes of 64, as the shipped plain epilogue's four */
        uint8_t *dst[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            dst[i] = half_row_target<kEpi>(p, t, wr + 4 * i + c.lane / 8, (int64_t)p.N * 2,
                                           ((int64_t)t.nb * kTileN + c.wg * kBoxRows) * 2 + (c.lane % 8) * kChunk);
#pragma unroll
        for (int pass = 0; pass < kBoxRows / 64; pass++) {
            stage_bf16(c, acc, pass);
            copy_out(c, dst, pass * 64 * 2);
        }
    } else if constexpr (!kFp8) {
        /* h = silu(gate) * up over the warpgroup's 64 h columns: one pass of 64 BF16 */
        constexpr int kH = kBoxAcc / 2;
#pragma unroll
        for (int i = 0; i < kH; i++) acc[i] = mf__silu(acc[i]) * acc[kH + i];
        const int32_t I = p.N / 2;
        uint8_t *dst[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            dst[i] = half_row_target<kEpi>(p, t, wr + 4 * i + c.lane / 8, (int64_t)I * 2,
                                           ((int64_t)t.nb * kHCols + c.wg * (kHCols / 2)) * 2 + (c.lane % 8) * kChunk);
        stage_bf16(c, acc, 0);
        copy_out(c, dst, 0);
    } else {
        constexpr int kH = kBoxAcc / 2; /* 32 accumulators: 64 h columns */
#pragma unroll
        for (int i = 0; i < kH; i++) acc[i] = mf__silu(acc[i]) * acc[kH + i];
        const int32_t I = p.N / 2;
        float amax_lo = 0.0f, amax_hi = 0.0f;
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
        /* the row's other 64 h columns are the other warpgroup's */
        const int g = c.lane / 4, q = c.lane % 4;
        {
            /* the exchange's addresses from %tid.x (tid_here) */
            const uint32_t tid = tid_here();
            const int wg = (int)(tid / kMfWarpgroupThreads) - 1, hr = (int)(tid / 32 % 4) * kWarpRows + (int)(tid % 32) / 4;
            float *xamax = (float *)(c.epi - kOffEpi - (wg * 4 + (int)(tid / 32 % 4)) * kEpiWarpBytes + kOffAmax) + par * 2 * kHalfRows;
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
        uint8_t *row_lo = c.epi + g * kEpiRowBytes, *row_hi = c.epi + (g + 8) * kEpiRowBytes;
#pragma unroll
        for (int j = 0; j < kH / 4; j++) {
            const int at = (((j >> 1) ^ g) * kChunk) + (j & 1) * 8 + 2 * q;
            *(uint16_t *)(row_lo + at) = mf__cvt_e4m3x2(acc[4 * j + 0] * inv_lo, acc[4 * j + 1] * inv_lo);
            *(uint16_t *)(row_hi + at) = mf__cvt_e4m3x2(acc[4 * j + 2] * inv_hi, acc[4 * j + 3] * inv_hi);
        }
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
            uint8_t *dst = half_row_target<kEpi>(p, t, wr + r, (int64_t)I, (int64_t)t.nb * kHCols + c.wg * (kHCols / 2) + ch * kChunk);
            if (dst) *(uint4 *)dst = v;
        }
        __syncwarp();
    }
}

/* The producer (warp 0) with tail tiles: a full tile's loads as shipped; a tail tile's 64-row A box
 * at the stage's second 8 KB and its weights (plain: the two boxes as shipped; SwiGLU: four 64-row
 * boxes, each warpgroup's gate and up rows next to each other). Scales as shipped. */
template <bool kFp8, int kEpi>
__device__ __forceinline__ void half_producer(const half_params &hp, const tables_t &tb, uint8_t *stages, float *a_sc,
                                              float *w_sc, int32_t *tile_of, uint64_t *full, uint64_t *empty) {
    const gemm_params &p = hp.p;
    const int32_t nblocks = n_blocks<kEpi>(p);
    const int lane = (int)(threadIdx.x & 31);
    const int32_t kblocks = (p.K * (kFp8 ? 1 : 2) + kKBlock - 1) / kKBlock, kbs = p.K / kKBlock; /* FP8: K/128 scale columns */
    uint32_t it = 0;
    int32_t cursor = 0;
    tile_t t;
    for (int32_t idx = (int32_t)blockIdx.x; next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, idx, cursor, t);
         idx = next_idx(p.sched, idx, lane)) {
        const bool half = is_half(t);
        int32_t wrow[kBoxes];
#pragma unroll
        for (int b = 0; b < kBoxes; b++) wrow[b] = weight_row<kEpi>(p, t, b);
        const float *srow[kBlockM / 32];
        const float *wsrc = p.w_scales;
        if constexpr (kFp8) {
#pragma unroll
            for (int i = 0; i < kBlockM / 32; i++) srow[i] = p.a_scales + (int64_t)clamp_row<kBlockM>(t, lane + 32 * i) * kbs;
            if (lane < kBoxes) wsrc = p.w_scales + (int64_t)((lane == 0 ? wrow[0] : wrow[1]) / kBoxRows) * kbs;
        }
        for (int32_t kb = 0; kb < kblocks; kb++, it++) {
            const uint32_t slot = ring_t::slot(it);
            ring_t::wait_empty(empty, it);
            if constexpr (kFp8) {
#pragma unroll
                for (int i = 0; i < kBlockM / 32; i++) mf__cp_async_4(a_sc + slot * kBlockM + lane + 32 * i, srow[i] + kb);
                if (lane < kBoxes) mf__cp_async_4(w_sc + slot * kWScaleSlots + lane, wsrc + kb);
                mf__cp_async_mbar_arrive_noinc(&full[slot]);
            }
            __syncwarp();
            if (lane == 0) {
                uint8_t *st = stages + slot * kStageBytes;
                const int32_t kc = kb * (kFp8 ? kKBlock : kKBlock / 2); /* K coordinate, elements */
                tile_of[slot] = idx << 1 | (half ? 1 : 0); /* the tile and its kind (the consumers' overlap needs it) */
                mf__mbar_arrive_expect_tx(&full[slot], (uint32_t)(half ? kHalfStageBytes : kStageBytes));
                if (!half) {
                    mf__tma_load_2d(st, &p.tmap_a, &full[slot], kc, t.row0);
                } else {
                    mf__tma_load_2d(st + kWgOperandBytes, &hp.tmap_a64, &full[slot], kc, t.row0 + kHalfRows);
                }
                if (half && kEpi == kEpiSwiglu) {
#pragma unroll
                    for (int q = 0; q < 4; q++)
                        mf__tma_load_2d(st + kABytes + q * kWgOperandBytes, &hp.tmap_w64, &full[slot], kc,
                                        wrow[q & 1] + (q >> 1) * kHalfRows);
                } else {
#pragma unroll
                    for (int b = 0; b < kBoxes; b++) mf__tma_load_2d(st + kABytes + b * kBoxBytes, &p.tmap_w, &full[slot], kc, wrow[b]);
                }
            }
        }
    }
    const uint32_t slot = ring_t::slot(it);
    ring_t::wait_empty(empty, it);
    if (lane == 0) tile_of[slot] = -1;
    __syncwarp();
    if (kFp8) mf__mbar_arrive(&full[slot]);
    if (lane == 0) mf__mbar_arrive(&full[slot]);
    end_schedule(p.sched, lane);
    if constexpr (kFp8) mf__cp_async_wait_all();
}

/* BF16: the shipped consumer with tail tiles (a tile's kind picks its main loop and epilogue). */
template <int kEpi>
__device__ __forceinline__ void half_consumer_bf16(const gemm_params &p, const tables_t &tb, consumer_t &c, float *acc) {
    const int32_t nblocks = n_blocks<kEpi>(p);
    const int32_t kblocks = (p.K * 2 + kKBlock - 1) / kKBlock;
    uint32_t it = 0;
    int32_t cursor = 0, idx = (int32_t)blockIdx.x;
    tile_t t;
    if (!next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, idx, cursor, t)) return;
    bool half = is_half(t);
    for (;;) {
        if (half) {
            bf16_half_mainloop(c, acc, it, kblocks);
            half_epilogue<false, kEpi>(p, c, t, acc, 0);
        } else {
            bf16_mainloop(c, acc, it, kblocks);
            epilogue<false, kEpi>(p, c, t, acc);
        }
        ring_t::wait_full(c.full, it, *c.sink);
        const int32_t code = c.tile_of[ring_t::slot(it)];
        if (code < 0) break;
        next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, code >> 1, cursor, t);
        half = code & 1;
    }
}

/* FP8: the shipped consumer (issue order, epilogue overlap) with tail tiles: a tile's kind picks its
 * main loop and epilogue; the overlap's issue takes the next tile's kind from tile_of. */
template <int kEpi>
__device__ __forceinline__ void half_consumer(const gemm_params &p, const tables_t &tb, consumer_t &c, float *acc,
                                              float *tmp) {
    const int32_t nblocks = n_blocks<kEpi>(p);
    const int32_t kblocks = (p.K + kKBlock - 1) / kKBlock; /* the producer's count */
    uint32_t it = 0, par = 0;
    int32_t cursor = 0, idx = (int32_t)blockIdx.x;
    tile_t t;
    if (!next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, idx, cursor, t)) return;
    if (c.wg == 1) mf__named_barrier_arrive(kBarIssued1, kConsumerThreads);
    bool half = is_half(t);
    ring_t::wait_full(c.full, 0, *c.sink);
    fp8_issue_at(tmp, c.desc_stages, c.wg, a_off(half, c.wg), b_off(half, c.wg, 0));
    for (;;) {
        if (half) {
            half_kblock<kEpi, true, true>(c, acc, tmp, it++);
            for (int32_t kb = 1; kb < kblocks; kb++) half_kblock<kEpi, false, false>(c, acc, tmp, it++);
        } else {
            fp8_kblock<kOrderIssue, true, true>(c, acc, tmp, it++);
            for (int32_t kb = 1; kb < kblocks; kb++) fp8_kblock<kOrderIssue, false, false>(c, acc, tmp, it++);
        }
        /* the next tile's kind now, from the producer's tile_of (its first group goes out before
         * the epilogue), the tile itself after it: its stage is not released before, so tile_of still
         * names it (nothing of the next tile stays live through the epilogue) */
        ring_t::wait_full(c.full, it, *c.sink);
        {
            const int32_t code = c.tile_of[ring_t::slot(it)];
            const bool half_next = code >= 0 && (code & 1);
            const uint32_t at = code >= 0 ? it : it - 1; /* none: rerun the last stage, dropped */
            const int wg = wg_here();
            fp8_issue_at(tmp, mf__wgmma_desc_advance(c.desc_stages, ring_t::slot(at) * kStageBytes), c.wg,
                         a_off(half_next, wg), b_off(half_next, wg, 0));
        }
        if (half) {
            half_epilogue<true, kEpi>(p, c, t, acc, par);
            par ^= 1u;
        } else {
            epilogue<true, kEpi>(p, c, t, acc);
        }
        const int32_t code = c.tile_of[ring_t::slot(it)];
        if (code < 0) break;
        next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, code >> 1, cursor, t);
        half = code & 1;
    }
    mf__wgmma_wait<0>();
    if (c.wg == 0) mf__named_barrier_sync(kBarIssued1, kConsumerThreads);
}

/* The shipped kernel's body with the tail-tile producer and consumer. */
template <bool kFp8, int kEpi>
__global__ void __launch_bounds__(kThreads, 1) sm90_tma_half_kernel(const __grid_constant__ half_params hp) {
    const gemm_params &p = hp.p;
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
    if (threadIdx.x == 0) {
        mf__prefetch_tensormap(&hp.tmap_a64);
        mf__prefetch_tensormap(&hp.tmap_w64);
    }
    prologue<kStages, true>(p, full, empty, kFullArrivals, tb, [](int32_t rows) { return (rows + kBlockM - 1) / kBlockM; });

    if (producer_role()) {
        if (mf__warp_id() == 0) half_producer<kFp8, kEpi>(hp, tb, stages, a_sc, w_sc, tile_of, full, empty);
    } else {
        consumer_t c;
        consumer_at(c, smem);
        c.sink = &p.sink;
        float acc[kAcc];
        if constexpr (kFp8) {
            float tmp[kBoxAcc];
#pragma unroll
            for (int i = 0; i < kBoxAcc; i++) tmp[i] = 0.0f;
            half_consumer<kEpi>(p, tb, c, acc, tmp);
        } else {
            half_consumer_bf16<kEpi>(p, tb, c, acc);
        }
        if (threadIdx.x == kMfWarpgroupThreads) mf__pipeline_check(p.sink, kTagProducerEmpty);
    }
}

/* ---- host: the lab's variants and their launcher ------------------------------------------------ */

struct variant_t {
    const void *fn;
    int fp8, swiglu, order, overlap, probe; /* order: kOrder* */
    const char *tag;
    int half; /* sm90_tma_half_kernel: launched with half_params and kHalfSmemBytes */
};

/* Every lab kernel: 0-7 what the former library table held in its slots 4-11, 8-9 the staggered
 * turns, 10-13 the tail tiles (half = 1: launched with half_params). */
static const variant_t kVariants[] = {
    {(const void *)sm90_tma_lab_kernel<true, kEpiPlain, kOrderNone, false, kProbeNone>, 1, 0, 0, 1, kProbeNone, "unordered"},
    {(const void *)sm90_tma_lab_kernel<true, kEpiSwiglu, kOrderNone, false, kProbeNone>, 1, 1, 0, 1, kProbeNone, "unordered"},
    {(const void *)sm90_tma_lab_kernel<true, kEpiSwiglu, kOrderIssue, true, kProbeNone>, 1, 1, 1, 0, kProbeNone, "no overlap"},
    {(const void *)sm90_tma_lab_kernel<true, kEpiPlain, kOrderIssue, true, kProbeNone>, 1, 0, 1, 0, kProbeNone, "no overlap"},
    {(const void *)sm90_tma_lab_kernel<true, kEpiPlain, kOrderIssue, true, kProbeNoPromote>, 1, 0, 1, 0, kProbeNoPromote,
     "probe: no promotion"},
    {(const void *)sm90_tma_lab_kernel<true, kEpiSwiglu, kOrderIssue, true, kProbeNoPromote>, 1, 1, 1, 0, kProbeNoPromote,
     "probe: no promotion"},
    {(const void *)sm90_tma_lab_kernel<false, kEpiPlain, kOrderIssue, false, kProbeNoStore>, 0, 0, 0, 0, kProbeNoStore,
     "probe: no epilogue"},
    {(const void *)sm90_tma_lab_kernel<false, kEpiSwiglu, kOrderIssue, false, kProbeNoStore>, 0, 1, 0, 0, kProbeNoStore,
     "probe: no epilogue"},
    {(const void *)sm90_tma_lab_kernel<true, kEpiPlain, kOrderStagger, false, kProbeNone>, 1, 0, 2, 1, kProbeNone, "staggered"},
    {(const void *)sm90_tma_lab_kernel<true, kEpiSwiglu, kOrderStagger, false, kProbeNone>, 1, 1, 2, 1, kProbeNone, "staggered"},
    {(const void *)sm90_tma_half_kernel<true, kEpiPlain>, 1, 0, 1, 1, kProbeNone, "tail tiles", 1},
    {(const void *)sm90_tma_half_kernel<true, kEpiSwiglu>, 1, 1, 1, 1, kProbeNone, "tail tiles", 1},
    {(const void *)sm90_tma_half_kernel<false, kEpiPlain>, 0, 0, 0, 0, kProbeNone, "tail tiles", 1},
    {(const void *)sm90_tma_half_kernel<false, kEpiSwiglu>, 0, 1, 0, 0, kProbeNone, "tail tiles", 1},
};
static const int kNumVariants = (int)(sizeof kVariants / sizeof kVariants[0]);

static int g_switch; /* kMfTmaLab* bits: what tma_lab_* and the lab's run_call launch */

static inline void set_switch(int lab) { g_switch = lab; }
static inline int get_switch(void) { return g_switch; }

/* The lab variant the switch selects for (fp8, swiglu), or -1 when that is what ships (the lab then
 * runs the library's launcher). */
static inline int variant_index(int lab, int fp8, int swiglu) {
    if (lab & kMfTmaLabHalf) return (fp8 ? 10 : 12) + swiglu;
    if (!fp8) return (lab & kMfTmaLabNoStore) ? 6 + swiglu : -1;
    if (lab & kMfTmaLabStagger) return 8 + swiglu;
    if (lab & kMfTmaLabNoPromote) return 4 + swiglu;
    if (lab & kMfTmaLabNoOverlap) return swiglu ? 2 : 3;
    return (lab & kMfTmaLabUnordered) ? swiglu : -1;
}

/* gemm_tma.cu's launch for lab variant `vi`: the same tensor maps and persistent grid. */
static inline mf_result_t launch(int vi, const mf__gemm_segments_t *seg, int fp8, const void *a, const void *w,
                                 gemm_params *p, cudaStream_t stream) {
    const void *fn = kVariants[vi].fn;
    const int half = kVariants[vi].half, smem = half ? kHalfSmemBytes : kSmemBytes;
    cudaFuncAttributes fa;
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaFuncGetAttributes(&fa, fn) != cudaSuccess ||
        cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
        (void)cudaGetLastError();
        return MF_ERR_CUDA;
    }
    if (fa.numRegs != kLaunchRegs) return MF_ERR_NOT_SUPPORTED; /* setmaxnreg.inc would wait forever */
    if (seg->num_experts == 0 || seg->max_rows_per_expert == 0) return MF_SUCCESS;
    const char *map = NULL;
    if (encode_maps(p, fp8, a, w, &map) != CUDA_SUCCESS) return MF_ERR_NOT_SUPPORTED;
    const int grid = grid_of(p, seg->max_rows_per_expert, sms);
    if (grid <= 0) return MF_SUCCESS;
    /* the tail tiles' tile_of holds idx << 1 | kind */
    if (half && (int64_t)p->num_experts * ((seg->max_rows_per_expert + kBlockM - 1) / kBlockM) * (p->N / kTileN) >= (1 << 30))
        return MF_ERR_NOT_SUPPORTED;
    /* the tail tiles' kernel: the same params and two more maps of 64-row boxes */
    half_params hp;
    memset(&hp, 0, sizeof hp);
    hp.p = *p;
    if (half) { /* encode_maps' two maps with 64-row boxes */
        const int esz = fp8 ? 1 : 2;
        const uint64_t kbytes = (uint64_t)p->K * esz;
        const CUtensorMapDataType dt = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
        if (mf__tma_encode_2d(&hp.tmap_a64, dt, a, (uint64_t)p->K, (uint64_t)kMaxRowCoord, kbytes, (uint32_t)(kKBlock / esz),
                              (uint32_t)kHalfRows, CU_TENSOR_MAP_SWIZZLE_128B) != CUDA_SUCCESS ||
            mf__tma_encode_2d(&hp.tmap_w64, dt, w, (uint64_t)p->K, (uint64_t)p->num_experts * p->N, kbytes,
                              (uint32_t)(kKBlock / esz), (uint32_t)kHalfRows, CU_TENSOR_MAP_SWIZZLE_128B) != CUDA_SUCCESS)
            return MF_ERR_NOT_SUPPORTED;
    }
    void *args[] = {half ? (void *)&hp : (void *)p};
    if (cudaLaunchKernel(fn, dim3((unsigned)grid), dim3(kThreads), args, (size_t)smem, stream) != cudaSuccess) {
        (void)cudaGetLastError();
        return MF_ERR_CUDA;
    }
    return MF_SUCCESS;
}

} /* namespace mf__tma_lab */

/* The library launchers' arguments (cuda/grouped_gemm.h, pdl 0): the variant the switch selects,
 * or the library's own launcher where that is what ships. */
static inline mf_result_t tma_lab_w13_swiglu(const mf__gemm_segments_t *seg, int32_t dtype, int32_t ue8m0,
                                             mf__gemm_operand_t a, mf__gemm_operand_t w13, int32_t H, int32_t I, void *h,
                                             float *h_scales, cudaStream_t stream) {
    const int fp8 = dtype == MF_DTYPE_FP8_E4M3, vi = mf__tma_lab::variant_index(mf__tma_lab::get_switch(), fp8, 1);
    if (vi < 0 || a.gather) return mf__sm90_tma_w13_swiglu(seg, dtype, ue8m0, a, w13, H, I, h, h_scales, stream, 0);
    mf__tma::gemm_params p = mf__tma::w13_params(seg, ue8m0, a, w13, H, I, h, h_scales);
    return mf__tma_lab::launch(vi, seg, fp8, a.data, w13.data, &p, stream);
}

static inline mf_result_t tma_lab_w2(const mf__gemm_segments_t *seg, int32_t dtype, mf__gemm_operand_t h,
                                     mf__gemm_operand_t w2, int32_t H, int32_t I, uint16_t *out,
                                     const mf__gemm_return_t *ret, cudaStream_t stream) {
    const int fp8 = dtype == MF_DTYPE_FP8_E4M3, vi = mf__tma_lab::variant_index(mf__tma_lab::get_switch(), fp8, 0);
    if (vi < 0) return mf__sm90_tma_w2(seg, dtype, h, w2, H, I, out, ret, stream, 0);
    mf__tma::gemm_params p = mf__tma::w2_params(seg, h, w2, H, I, out, ret);
    return mf__tma_lab::launch(vi, seg, fp8, h.data, w2.data, &p, stream);
}

#endif /* MF_DEV_SM90_TMA_LAB_KERNEL_CUH */
