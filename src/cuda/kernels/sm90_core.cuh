/*
 * sm90_core.cuh — the device core both sm90 expert-GEMM families are built on: the decode kernels
 * (kernels/sm90_decode_gemm.cuh: weights as wgmma's A operand, <= 64 rows per tile) and the large-M
 * kernels (kernels/sm90_tma_gemm.cuh: 128-row tiles). What the two share lives here once; what
 * differs (operand roles, the main loops, the epilogues' fragment layouts) stays with each kernel.
 *
 *   params    one __grid_constant__ struct (gemm_params) and its host fill (w13_params, w2_params)
 *   prologue  barrier init and tensor-map prefetch (before the previous kernel ends, under PDL),
 *             mf__pdl_wait / mf__pdl_trigger, then the expert tables in shared memory: each expert's
 *             clamped row count, first receive row and first work unit, from the plan's device
 *             counts / offsets (build_tables: a warp scan over the experts)
 *   walk      the persistent tile walk (next_tile): tile idx = blockIdx.x, then (decode, and TMA
 *             without a schedule pair) + gridDim.x, ... or (TMA with one) the next ticket, over the
 *             experts with rows, in one of two orders (tile_order), and the row shift of a partial
 *             last block (place_block, clamp_row)
 *   ring      the TMA / cp.async stage ring: slot and parity of ring position `it`, the bounded
 *             waits of producer and consumers, the barriers' init (ring<kStages>), a consumer
 *             warp's release (release_stage)
 *   roles     the register split: warpgroup 0 produces (setmaxnreg.dec), 1 and 2 consume (.inc)
 *             (producer_role)
 *   targets   W2's rows into the owners' combine slots (ret_row)
 *
 * What the kernels compile to was kept: each family's kernels have the opcode mix they had before
 * this core but for a few integer ops (nvdisasm; bench/NOTES.md "Issue 14, third session"), which
 * took the rule at align_pad.
 *
 * Sizes and limits (threads, registers, box and K-block sizes, the wait bound): cuda/gemm_configs.cuh,
 * namespace mf__sm90. C++ (CUDA), included by the kernel headers only.
 */
#ifndef MF_CUDA_KERNELS_SM90_CORE_CUH
#define MF_CUDA_KERNELS_SM90_CORE_CUH

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "core/prefix.h"
#include "cuda/gemm_configs.cuh"
#include "cuda/grouped_gemm.h"
#include "cuda/kernels/sm90_ptx.cuh"
#include "cuda/pdl.cuh"

namespace mf__sm90 {

enum { kTagProducerEmpty = 1, kTagConsumerFull = 2 }; /* fault-record tags of the ring's two waits */

__host__ __device__ constexpr int align_up(int x, int a) { return (x + a - 1) / a * a; }
__host__ __device__ constexpr int min_int(int a, int b) { return a < b ? a : b; }

/* ---- params ---------------------------------------------------------------------------------- */

/* One struct per launch, passed by value (__grid_constant__: the tensor maps stay in param space). */
struct gemm_params {
    CUtensorMap tmap_w;        /* weights [L * N, K], box [128 rows, 128 B], 128B swizzle */
    CUtensorMap tmap_a;        /* contiguous activations [kMaxRowCoord, K], box [rows per tile, 128 B] */
    const int32_t *counts;     /* [L] device: rows of each expert */
    const int32_t *offsets;    /* [L] device: first receive row of each expert */
    const float *a_scales;     /* FP8, contiguous: [rows, K/128] */
    const float *w_scales;     /* FP8: [L, N/128, K/128] */
    uint8_t *out;              /* plain: [rows, N] BF16 (unless use_ret); swiglu: [rows, N/2] BF16 or FP8 */
    float *out_scales;         /* swiglu FP8: [rows, N/256] */
    mf__heap_view_t view;      /* rows at their owners (cuda/heap_view.h): decode W13 with gathered rows
                                  reads them and their FP8 scales there (x, scales), plain with use_ret
                                  sends them to the combine slots (combine) */
    const int32_t *src;        /* [rows, 3] (rank, token, k) of each gathered or returned receive row */
    int32_t num_topk;          /* K, with use_ret */
    int32_t use_ret;
    int32_t num_experts;       /* L */
    int32_t max_rows;          /* counts are clamped to [0, max_rows] */
    int32_t N, K;              /* weight rows per expert, reduction elements */
    int32_t ue8m0;             /* swiglu FP8: power-of-two h scales */
    int32_t *sched;            /* the dynamic schedule's (ticket, finished CTAs), or NULL: the static walk */
    uint64_t *timeline;        /* decode family, the lab's --timeline only: kTimelineStamps %globaltimer
                                  stamps per CTA (entry, prologue done, last store), or NULL */
    int32_t l2_ring;           /* decode family, MF_DECODE_L2=1: the producer sends each tile's weights into
                                  L2 a ring ahead of its loads (sm90_decode_gemm.cuh, "L2 a ring ahead") */
    mf__fault_sink_t sink;     /* the comm's: where an expired pipeline wait records itself */
};

/* What every launch takes from its segments (both GEMMs below). */
static inline gemm_params seg_params(const mf__gemm_segments_t *seg) {
    gemm_params p;
    memset(&p, 0, sizeof p);
    p.counts = seg->counts;
    p.offsets = seg->offsets;
    p.sched = seg->sched;
    p.sink = seg->sink;
    p.num_experts = seg->num_experts;
    p.max_rows = seg->max_rows_per_expert;
    return p;
}

/* W13 + SwiGLU: N = 2I weight rows, K = H (the tensor maps are the launcher's). */
static inline gemm_params w13_params(const mf__gemm_segments_t *seg, int32_t ue8m0, mf__gemm_operand_t a,
                                     mf__gemm_operand_t w13, int32_t H, int32_t I, void *h, float *h_scales) {
    gemm_params p = seg_params(seg);
    p.a_scales = a.gather ? NULL : a.scales;
    p.w_scales = w13.scales;
    p.out = (uint8_t *)h;
    p.out_scales = h_scales;
    if (a.gather) {
        p.view = *a.gather->view;
        p.src = a.gather->src;
    }
    p.N = 2 * I;
    p.K = H;
    p.ue8m0 = ue8m0 ? 1 : 0;
    return p;
}

/* W2: N = H weight rows, K = I; rows to `out` or, with `ret`, to the owners' combine slots. */
static inline gemm_params w2_params(const mf__gemm_segments_t *seg, mf__gemm_operand_t h, mf__gemm_operand_t w2,
                                    int32_t H, int32_t I, uint16_t *out, const mf__gemm_return_t *ret) {
    gemm_params p = seg_params(seg);
    p.a_scales = h.scales;
    p.w_scales = w2.scales;
    p.out = (uint8_t *)out;
    if (ret) {
        p.view = *ret->view;
        p.src = ret->src;
        p.num_topk = ret->num_topk;
        p.use_ret = 1;
    }
    p.N = H;
    p.K = I;
    return p;
}

/* ---- shared memory --------------------------------------------------------------------------- */

/* 128B-swizzled TMA boxes and wgmma operands need 1024-byte aligned shared addresses: the map
 * starts at smem_raw + align_pad(smem_raw), within the kMfSwizzleAtomBytes of slack it reserved.
 * Measured rule for this file: a helper never RETURNS a shared-memory pointer (or a struct of
 * them); it returns an offset or fills the caller's variable. Returned, such pointers made ptxas
 * move the tile walk's arithmetic off the uniform datapath (bench/NOTES.md, "Issue 14, third
 * session"). */
__device__ __forceinline__ uint32_t align_pad(const uint8_t *raw) {
    return (kMfSwizzleAtomBytes - (mf__smem_addr(raw) & (kMfSwizzleAtomBytes - 1))) & (kMfSwizzleAtomBytes - 1);
}

/* ---- tables and the tile walk ---------------------------------------------------------------- */

/* Shared-memory tables built at kernel start. */
struct tables_t {
    int32_t *rows;   /* [L] clamped counts */
    int32_t *row0;   /* [L] offsets */
    int32_t *first;  /* [L + 1] first work unit of each expert; first[L] = the units of all experts */
};

/* tb = the tables at `at`: (3 kMaxExperts + 1) int32 (filled, not returned: see align_pad). */
template <int kMaxExperts>
__device__ __forceinline__ void tables_at(tables_t &tb, uint8_t *at) {
    tb.rows = (int32_t *)at;
    tb.row0 = tb.rows + kMaxExperts;
    tb.first = tb.row0 + kMaxExperts;
}

/* out[e] = the sum of f(in[e']) over e' < e, for e in [0, L), and (kTotal) out[L] = the sum over all
 * (each lane of warp 0 sums a run of experts, then a warp scan). Every thread of the CTA calls it,
 * after a barrier that made in[] visible; it ends with out[] visible to all. */
template <bool kTotal, class F>
__device__ __forceinline__ void scan_into(int32_t *out, const int32_t *in, int L, F f) {
    if (threadIdx.x < 32) {
        const int lane = (int)threadIdx.x, per = (L + 31) / 32;
        const int lo = min_int(L, lane * per), hi = min_int(L, lo + per);
        int32_t local = 0;
        for (int e = lo; e < hi; e++) local += f(in[e]);
        int32_t incl = local;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int32_t v = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= off) incl += v;
        }
        int32_t base = incl - local;
        for (int e = lo; e < hi; e++) {
            out[e] = base;
            base += f(in[e]);
        }
        if (kTotal && lane == 31) out[L] = incl;
    }
    __syncthreads();
}

/* first[] from rows[]: units(rows) are an expert's work units (scan_into). */
template <class Units>
__device__ __forceinline__ void scan_units(const tables_t &tb, int L, Units units) {
    scan_into<true>(tb.first, tb.rows, L, units);
}

/* Reads the counts (clamped to [0, max_rows]) and offsets into the tables and scans them into
 * first[] (scan_units). Every thread of the CTA calls it; it ends with the tables visible to all. */
template <int kThreads, class Params, class Units>
__device__ __forceinline__ void build_tables(const Params &p, const tables_t &tb, Units units) {
    const int L = p.num_experts;
    for (int e = (int)threadIdx.x; e < L; e += kThreads) {
        int32_t n = p.counts[e];
        n = n < 0 ? 0 : (n > p.max_rows ? p.max_rows : n);
        tb.rows[e] = n;
        tb.row0[e] = p.offsets[e];
    }
    __syncthreads();
    scan_units(tb, L, units);
}

/* One tile: expert, n-block, receive row of tile row (decode: column) 0, first tile row that
 * belongs to the tile. */
struct tile_t {
    int32_t e, nb, row0, lo;
};

/* The two walk orders; a work unit is what first[] counts.
 *   kNInner (large M): unit = one kRows-row block of an expert (m-block), counted across experts;
 *     tile idx = unit * nblocks + nb: all n-blocks of one row block run next to each other, so the
 *     ~132 running tiles share a few activation blocks and one stripe of weights in L2.
 *   kRowsInner (decode): unit = tile; an expert's tiles are nb * blocks + block: the row blocks of
 *     one n-block run next to each other and read the same weights, the second from L2. */
enum tile_order { kNInner = 0, kRowsInner = 1 };

/* Block `blk` of expert e's rows in kRows-row tiles. A partial last block (v < kRows rows left)
 * is shifted so that it ENDS at the expert's last row: row0 = (expert end) - kRows, lo = kRows - v,
 * and only tile rows [lo, kRows) belong to it. So no tile ever addresses a row at or past the end of
 * its expert, which is what lets the activation tensor map span 2^31 - 1 rows (the launchers do not
 * know the receive tensor's length): rows below the expert are another expert's rows or padding
 * (read into results that are never stored: GEMM rows are independent), rows below 0 are TMA zero
 * fill (coordinates are signed). */
template <int kRows>
__device__ __forceinline__ void place_block(const tables_t &tb, int32_t e, int32_t blk, tile_t &t) {
    const int32_t left = tb.rows[e] - blk * kRows;
    t.e = e;
    t.lo = left < kRows ? kRows - left : 0;
    t.row0 = tb.row0[e] + blk * kRows - t.lo;
}

/* Tile `idx` of the walk (monotonic idx; `e` is the walker's cursor, starting at 0, moved by
 * mf__prefix_find: core/prefix.h); false past the last tile. nblocks: n-blocks per expert. */
template <int kRows, int kOrder>
__device__ __forceinline__ bool next_tile(const tables_t &tb, int32_t L, int32_t nblocks, int32_t idx, int32_t &e,
                                          tile_t &t) {
    if (kOrder == kNInner) {
        const int32_t gm = idx / nblocks;
        if (gm >= tb.first[L]) return false;
        e = mf__prefix_find(tb.first, L, e, gm);
        place_block<kRows>(tb, e, gm - tb.first[e], t);
        t.nb = idx - gm * nblocks;
    } else {
        if (idx >= tb.first[L]) return false;
        e = mf__prefix_find(tb.first, L, e, idx);
        const int32_t blocks = (tb.rows[e] + kRows - 1) / kRows, local = idx - tb.first[e];
        place_block<kRows>(tb, e, local % blocks, t);
        t.nb = local / blocks;
    }
    return true;
}

/* The receive row whose data (and FP8 scales) tile row j reads: rows below lo read row lo's (their
 * results are never stored), rows past the tile (a producer lane's spare slots) the last row's. */
template <int kRows>
__device__ __forceinline__ int32_t clamp_row(const tile_t &t, int j) {
    return t.row0 + (j < t.lo ? t.lo : (j < kRows ? j : kRows - 1));
}

/* ---- the schedule: static or dynamic (both families' producers) ------------------------------- */

/* The producer's next tile after `idx`: static (sched NULL), idx + grid; dynamic (a schedule pair),
 * grid + the next ticket (lane 0 takes it, the warp shares it), so a CTA whose SM streams faster
 * takes more tiles. Tickets only grow, so every CTA's tiles ascend (the walk's cursor relies on
 * it); the first tile of every CTA is blockIdx.x in both. The producer publishes each stage's tile
 * (tile_of[slot], before the stage's arrival) and ends with a stage of tile -1: the consumers follow
 * it instead of walking on their own. */
__device__ __forceinline__ int32_t next_idx(int32_t *sched, int32_t idx, int lane) {
    if (!sched) return idx + (int32_t)gridDim.x;
    int32_t ticket = 0;
    if (lane == 0) ticket = atomicAdd(sched, 1);
    return (int32_t)gridDim.x + __shfl_sync(0xffffffffu, ticket, 0);
}

/* Dynamic schedule, the producer warp after its last tile: the last CTA to finish takes its
 * past-the-end ticket back to zero; every CTA counts itself only after its last ticket, so nothing
 * takes a ticket after the reset. The next launch on this pair starts after this grid completes
 * (stream order; under PDL it takes tickets only after its griddepcontrol.wait). */
__device__ __forceinline__ void end_schedule(int32_t *sched, int lane) {
    if (sched && lane == 0) {
        __threadfence();
        if (atomicAdd(sched + 1, 1) == (int32_t)gridDim.x - 1) {
            atomicExch(sched, 0);
            atomicExch(sched + 1, 0);
        }
    }
}

/* ---- the stage ring -------------------------------------------------------------------------- */

/* Ring position `it` counts stages over the whole persistent walk in every role: slot it % kStages,
 * parity (it / kStages) & 1. full[s]: the producer's arrive.expect_tx of the stage's TMA bytes (+ one
 * cp.async arrival per producer lane when lanes copy into the stage); empty[s]: one arrival per
 * consumer warp once it is done with the stage. The producer waits empty with the opposite parity
 * (a fresh barrier's "previous phase" counts as done). Every wait is bounded (kWaitTimeoutNs): an
 * expired one records its tag in the comm's fault sink and returns (mf__mbar_wait_bounded). */
template <int kStages>
struct ring {
    static __device__ __forceinline__ uint32_t slot(uint32_t it) { return it % kStages; }
    static __device__ __forceinline__ uint32_t parity(uint32_t it) { return (it / kStages) & 1u; }
    /* true: the wait gave up (expired or drained, mf__mbar_wait_bounded) */
    static __device__ __forceinline__ bool wait_full(uint64_t *full, uint32_t it, const mf__fault_sink_t &sink) {
        return mf__mbar_wait_bounded(&full[slot(it)], parity(it), kTagConsumerFull, kWaitTimeoutNs, &sink);
    }
    /* The producer's: it drains on expiry but records nothing (mf__mbar_wait_bounded: its consumers'
     * full waits then fail or drain and record it). */
    static __device__ __forceinline__ void wait_empty(uint64_t *empty, uint32_t it) {
        mf__mbar_wait_bounded(&empty[slot(it)], parity(it) ^ 1u, kTagProducerEmpty, kWaitTimeoutNs, NULL);
    }
    /* One thread: full[s] expects `full_arrivals`, empty[s] one per consumer warp. */
    static __device__ __forceinline__ void init(uint64_t *full, uint64_t *empty, uint32_t full_arrivals) {
        for (int s = 0; s < kStages; s++) {
            mf__mbar_init(&full[s], full_arrivals);
            mf__mbar_init(&empty[s], kConsumerWarps);
        }
        mf__fence_mbarrier_init();
    }
};

/* A consumer warp is done with stage `slot`: one arrival on empty (after its reads and wgmmas). */
__device__ __forceinline__ void release_stage(uint64_t *empty, uint32_t slot, int lane) {
    __syncwarp();
    if (lane == 0) mf__mbar_arrive(&empty[slot]);
}

/* ---- kernel start and roles ----------------------------------------------------------------- */

/* Both tensor maps' descriptors into the cache (kA: the activation map too; a gathering kernel has
 * none). */
template <bool kA>
__device__ __forceinline__ void prefetch_maps(const gemm_params &p) {
    mf__prefetch_tensormap(&p.tmap_w);
    if (kA) mf__prefetch_tensormap(&p.tmap_a);
}

/* Every thread, at kernel start: thread 0 initialises the ring's barriers and (kPrefetch) prefetches
 * the tensor maps, which depend on no earlier kernel, so under PDL they run while it drains; then
 * the wait for the previous kernel (counts, offsets and the activations are its results:
 * cuda/pdl.cuh), the trigger that lets the next one start, and the expert tables. */
template <int kStages, bool kPrefetch, class Params, class Units>
__device__ __forceinline__ void prologue(const Params &p, uint64_t *full, uint64_t *empty, uint32_t full_arrivals,
                                         const tables_t &tb, Units units) {
    if (threadIdx.x == 0) {
        ring<kStages>::init(full, empty, full_arrivals);
        if constexpr (kPrefetch) prefetch_maps<true>(p);
    }
    mf__pdl_wait();
    mf__pdl_trigger();
    build_tables<kThreads>(p, tb, units);
}

/* The register split, at the end of the prologue: warpgroup 0 gives registers back and is the
 * producer (true; its warp 0 issues the loads), warpgroups 1 and 2 take them and are the consumers
 * (false). */
template <int kProducer = kProducerRegs, int kConsumer = kConsumerRegs>
__device__ __forceinline__ bool producer_role(void) {
    static_assert(kProducer * kMfWarpgroupThreads + kConsumer * kConsumerThreads <= kLaunchRegs * kThreads,
                  "the split must fit the launch's registers");
    if (mf__warpgroup_id() == 0) {
        mf__setmaxnreg_dec<kProducer>();
        return true;
    }
    mf__setmaxnreg_inc<kConsumer>();
    return false;
}

/* ---- epilogue targets ------------------------------------------------------------------------ */

/* W2 with `ret`: where receive row `row` goes, its owner's combine slot *dst = view.heap[rank] +
 * view.combine + (token K + k) n BF16, n = N (the caller adds its columns), (rank, token, k) =
 * table[3 row] (the plan's src, p.src, or the small kernel's own copy in shared memory); false when
 * that entry is invalid or its heap is NULL (the row is not stored). Without `ret` rows go to out +
 * row * N BF16, which each epilogue computes itself. */
template <class Params>
__device__ __forceinline__ bool ret_row(const Params &p, const int32_t *table, int64_t row, int64_t n, uint8_t *&dst) {
    const int32_t *src = table + 3 * row;
    const int32_t rank = src[0], token = src[1], k = src[2];
    if ((uint32_t)rank >= (uint32_t)MF_MAX_RANKS || token < 0 || k < 0 || k >= p.num_topk) return false;
    uint8_t *heap = p.view.heap[rank];
    if (!heap) return false;
    dst = (uint8_t *)((uint16_t *)(heap + p.view.combine) + ((int64_t)token * p.num_topk + k) * n);
    return true;
}

} /* namespace mf__sm90 */

#endif /* MF_CUDA_KERNELS_SM90_CORE_CUH */
