/*
 * sm90_tma_lab_kernel.cuh — the lab's fork of the shipped TMA grouped GEMM (src/cuda/kernels/
 * sm90_tma_gemm.cuh), for A/B measurements and timing probes only; included by
 * dev/cuda/sm90_gemm_lab.cu, never by the library (llm.c's dev/: the lab forks what it varies, the
 * shipped kernel carries no lab parameter). What varies in sm90_tma_lab_kernel is the FP8
 * consumer's schedule, and it computes full tiles only (the shipped producer with tma_params.tails
 * 0: the kernel as it was before the 64-row tail tiles, kMfTmaLabFullTiles, the tails' A/B); the
 * producer, the BF16 main loop, the epilogues and the whole host contract are the shipped kernel's,
 * reused from its header, so an A/B measures one change.
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
 * <kFp8, kEpi, kOrderIssue, false, kProbeNone> is the shipped kernel's arithmetic and schedule with
 * full tiles only (kMfTmaLabFullTiles; kOrderStagger's arithmetic too: the same wgmmas over the same
 * bytes in the same order; the lab's validate requires the shipped kernel's bits of every lab
 * variant); the shipped kernel itself the lab runs through the library's launchers, never from
 * here. Launching: tma_lab_w13_swiglu / tma_lab_w2 below take the library launchers' arguments and
 * run the variant the lab switch (kMfTmaLab*) selects, with the launchers' tensor maps and
 * persistent grid (shapes are the lab's and valid: nothing is declined but a kernel of the wrong
 * register count).
 */
#ifndef MF_DEV_SM90_TMA_LAB_KERNEL_CUH
#define MF_DEV_SM90_TMA_LAB_KERNEL_CUH

#include "cuda/kernels/sm90_tma_gemm.cuh"

/* The lab switch (bits): 0 = what ships; FP8: 1 = without the issue order, 2 = without the epilogue
 * overlap, 4 = without the overlap and without the promotion (timing only), 16 = the staggered
 * turns (kOrderStagger, with the overlap), 32 = full tiles only (the issue order and the overlap,
 * no 64-row tail tiles: the kernel before them); BF16: 8 = without the epilogue (timing only,
 * nothing is written), 32 = full tiles only. Every lab variant computes full tiles only. */
enum { kMfTmaLabShipped = 0, kMfTmaLabUnordered = 1, kMfTmaLabNoOverlap = 2, kMfTmaLabNoPromote = 4, kMfTmaLabNoStore = 8,
       kMfTmaLabStagger = 16, kMfTmaLabFullTiles = 32 };

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
            bf16_mainloop<false>(c, acc, it, kblocks);
        }
        int32_t idx_next = -1;
        if constexpr (kOverlap) {
            ring_t::wait_full(c.full, it, *c.sink);
            idx_next = code_tile(c.tile_of[ring_t::slot(it)]); /* full tiles only: the kind bit is 0 */
            const uint32_t at = idx_next >= 0 ? it : it - 1;
            fp8_issue<kOrder>(tmp, mf__wgmma_desc_advance(c.desc_stages, ring_t::slot(at) * kStageBytes), c.wg, 0);
        }
        /* kProbeNoStore: ue8m0 is 0 or 1, so the epilogue never runs, yet it keeps acc, hence the
         * main loop's wgmmas, alive (the wgmma asm has no side effect of its own) */
        if (kProbe != kProbeNoStore || p.ue8m0 == 0x7fffffff) epilogue<kFp8, kEpi>(p, c, t, acc);
        if constexpr (!kOverlap) {
            ring_t::wait_full(c.full, it, *c.sink);
            idx_next = code_tile(c.tile_of[ring_t::slot(it)]);
        }
        if (idx_next < 0) break;
        idx = idx_next;
        next_tile<kBlockM, kNInner>(tb, p.num_experts, nblocks, idx, cursor, t);
    }
    if constexpr (kOverlap) mf__wgmma_wait<0>();
    if (kFp8 && kOrder != kOrderNone && c.wg == 0) mf__named_barrier_sync(kBarIssued1, kConsumerThreads);
}

/* The shipped kernel's body around the lab's consumer (tp.tails is 0: full tiles only). */
template <bool kFp8, int kEpi, int kOrder, bool kNoOverlap, int kProbe>
__global__ void __launch_bounds__(kThreads, 1) sm90_tma_lab_kernel(const __grid_constant__ tma_params tp) {
    const gemm_params &p = tp.p;
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
        if (mf__warp_id() == 0) producer<kFp8, kEpi>(tp, tb, stages, a_sc, w_sc, tile_of, full, empty);
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

struct variant_t {
    const void *fn;
    int fp8, swiglu, order, overlap, probe; /* order: kOrder* */
    const char *tag;
};

/* Every lab kernel: 0-7 what the former library table held in its slots 4-11, 8-9 the staggered
 * turns, 10-13 full tiles only (the shipped schedule before the 64-row tail tiles). */
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
    {(const void *)sm90_tma_lab_kernel<true, kEpiPlain, kOrderIssue, false, kProbeNone>, 1, 0, 1, 1, kProbeNone, "full tiles"},
    {(const void *)sm90_tma_lab_kernel<true, kEpiSwiglu, kOrderIssue, false, kProbeNone>, 1, 1, 1, 1, kProbeNone, "full tiles"},
    {(const void *)sm90_tma_lab_kernel<false, kEpiPlain, kOrderIssue, false, kProbeNone>, 0, 0, 0, 0, kProbeNone, "full tiles"},
    {(const void *)sm90_tma_lab_kernel<false, kEpiSwiglu, kOrderIssue, false, kProbeNone>, 0, 1, 0, 0, kProbeNone, "full tiles"},
};
static const int kNumVariants = (int)(sizeof kVariants / sizeof kVariants[0]);

static int g_switch; /* kMfTmaLab* bits: what tma_lab_* and the lab's run_call launch */

static inline void set_switch(int lab) { g_switch = lab; }
static inline int get_switch(void) { return g_switch; }

/* The lab variant the switch selects for (fp8, swiglu), or -1 when that is what ships (the lab then
 * runs the library's launcher). */
static inline int variant_index(int lab, int fp8, int swiglu) {
    if (lab & kMfTmaLabFullTiles) return (fp8 ? 10 : 12) + swiglu;
    if (!fp8) return (lab & kMfTmaLabNoStore) ? 6 + swiglu : -1;
    if (lab & kMfTmaLabStagger) return 8 + swiglu;
    if (lab & kMfTmaLabNoPromote) return 4 + swiglu;
    if (lab & kMfTmaLabNoOverlap) return swiglu ? 2 : 3;
    return (lab & kMfTmaLabUnordered) ? swiglu : -1;
}

/* gemm_tma.cu's launch for lab variant `vi`: the same tensor maps and persistent grid, full tiles. */
static inline mf_result_t launch(int vi, const mf__gemm_segments_t *seg, int fp8, const void *a, const void *w,
                                 const gemm_params &p, cudaStream_t stream) {
    const void *fn = kVariants[vi].fn;
    cudaFuncAttributes fa;
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaFuncGetAttributes(&fa, fn) != cudaSuccess ||
        cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes) != cudaSuccess) {
        (void)cudaGetLastError();
        return MF_ERR_CUDA;
    }
    if (fa.numRegs != kLaunchRegs) return MF_ERR_NOT_SUPPORTED; /* setmaxnreg.inc would wait forever */
    if (seg->num_experts == 0 || seg->max_rows_per_expert == 0) return MF_SUCCESS;
    if ((int64_t)p.num_experts * ((seg->max_rows_per_expert + kBlockM - 1) / kBlockM) * (p.N / kTileN) >= kMaxTiles)
        return MF_ERR_NOT_SUPPORTED; /* tile_of holds idx << 1 (the shipped producer) */
    tma_params tp;
    memset(&tp, 0, sizeof tp);
    tp.p = p;
    tp.tails = 0;
    const char *map = NULL;
    if (encode_maps(&tp, fp8, a, w, &map) != CUDA_SUCCESS) return MF_ERR_NOT_SUPPORTED;
    const int grid = grid_of(&tp.p, seg->max_rows_per_expert, sms);
    if (grid <= 0) return MF_SUCCESS;
    void *args[] = {(void *)&tp};
    if (cudaLaunchKernel(fn, dim3((unsigned)grid), dim3(kThreads), args, (size_t)kSmemBytes, stream) != cudaSuccess) {
        (void)cudaGetLastError();
        return MF_ERR_CUDA;
    }
    return MF_SUCCESS;
}

} /* namespace mf__tma_lab */

/* The library launchers' arguments (cuda/grouped_gemm.h, pdl 0): the variant the switch selects,
 * or the library's own launcher with the library's choice where that is what ships (tail tiles on,
 * for BF16 too: the lab's main sets mf__cuda_tma_tails to 2; it creates no comm, so nothing reads
 * MF_TMA_TAILS here). */
static inline mf__gemm_choice_t tma_lab_choice(const mf__gemm_segments_t *seg) {
    return mf__gemm_choose(kMfDecodeMaxRows + 1, seg->max_rows_per_expert, MF_DATAFLOW_PULL);
}

static inline mf_result_t tma_lab_w13_swiglu(const mf__gemm_segments_t *seg, int32_t dtype, int32_t ue8m0,
                                             mf__gemm_operand_t a, mf__gemm_operand_t w13, int32_t H, int32_t I, void *h,
                                             float *h_scales, cudaStream_t stream) {
    const int fp8 = dtype == MF_DTYPE_FP8_E4M3, vi = mf__tma_lab::variant_index(mf__tma_lab::get_switch(), fp8, 1);
    if (vi < 0 || a.gather) {
        const mf__gemm_choice_t choice = tma_lab_choice(seg);
        return mf__sm90_tma_w13_swiglu(&choice, seg, dtype, ue8m0, a, w13, H, I, h, h_scales, stream, 0);
    }
    return mf__tma_lab::launch(vi, seg, fp8, a.data, w13.data, mf__tma::w13_params(seg, ue8m0, a, w13, H, I, h, h_scales),
                               stream);
}

static inline mf_result_t tma_lab_w2(const mf__gemm_segments_t *seg, int32_t dtype, mf__gemm_operand_t h,
                                     mf__gemm_operand_t w2, int32_t H, int32_t I, uint16_t *out,
                                     const mf__gemm_return_t *ret, cudaStream_t stream) {
    const int fp8 = dtype == MF_DTYPE_FP8_E4M3, vi = mf__tma_lab::variant_index(mf__tma_lab::get_switch(), fp8, 0);
    if (vi < 0) {
        const mf__gemm_choice_t choice = tma_lab_choice(seg);
        return mf__sm90_tma_w2(&choice, seg, dtype, h, w2, H, I, out, ret, stream, 0);
    }
    return mf__tma_lab::launch(vi, seg, fp8, h.data, w2.data, mf__tma::w2_params(seg, h, w2, H, I, out, ret), stream);
}

#endif /* MF_DEV_SM90_TMA_LAB_KERNEL_CUH */
