/*
 * movement.cuh — the CUDA kernels that move tokens: publish (quantise + copy into my heap),
 * the routing plan (fetch, offsets, fill), gather (pull routed rows from the peers' heaps into the
 * receive tensor), return (expert outputs into the owners' combine slots) and the owner's K-sum.
 *
 * Dimension legend: T tokens on this rank, S capacity, H hidden, E experts, R ranks, L local
 * experts (with balancing: this rank's slots Lp + B), K top-k, C masked expert capacity, P physical
 * slots, Lp = P / R, B spare slots per rank, N = P + R * B replica entries. Every kernel reaches the
 * heap only through the heap view in its parameters (cuda/heap_view.h: the peer table `heap[R]`
 * and the slot's region offsets; this rank's own heap is heap[rank]), so it runs unchanged on every
 * transport. All of them match the CPU backend bit for bit: same per-element functions
 * (numerics.h), same row order, same fixed-order K-sum with separate fp32 multiply and add (no
 * contraction into FMA). Each kernel calls mf__pdl_wait() before its first global access and
 * mf__pdl_trigger() right after it (cuda/pdl.cuh).
 */
#ifndef MF_CUDA_MOVEMENT_CUH
#define MF_CUDA_MOVEMENT_CUH

#include <stdint.h>

#include "core/layout.h"
#include "core/numerics.h"
#include "cuda/heap_view.h"
#include "cuda/kernels/sum.cuh"
#include "cuda/kernels/sync.cuh"

/* ---- publish ------------------------------------------------------------------------------ */

typedef struct mf__publish_params {
    const uint16_t *x;     /* [T, H] bf16 */
    const int32_t *ids;    /* [T, K] */
    const float *weights;  /* [T, K] or NULL */
    int32_t T, H, K, E, fp8, ue8m0;
    int32_t meta_words[MF__META_WORDS - 1]; /* map hash, prefetch count, weights count (all ranks check) */
    mf__heap_view_t view;  /* the slot's: writes my heap, view.heap[view.rank] */
    mf__fault_sink_t sink;
} mf__publish_params_t;

/* Columns of one token per publish block: one 128-wide block per warp (FP8 1x128). */
#define kMfPublishCols (kMfPublishThreads / kMfWarp * MF__QUANT_BLOCK)

/* Grid (max(T, 1), ceil(H / kMfPublishCols)): block (t, g) publishes columns [g, g + 1) x
 * kMfPublishCols of token t, every warp one 128-wide block, so that a few tokens still spread over
 * many SMs with one load in flight per lane (a loop of 7 dependent blocks per warp cost ~7 us at
 * T = 1); blocks (t, 0) also validate and copy the routing, block (0, 0) writes T. One block's part
 * (both publish kernels below). */
__device__ __forceinline__ void mf__publish_block(const mf__publish_params_t &p) {
    const int32_t t = blockIdx.x, tid = threadIdx.x, lane = tid % kMfWarp, warp = tid / kMfWarp;
    uint8_t *const heap = p.view.heap[p.view.rank]; /* my heap */
    mf__pdl_wait(); /* a call's first kernel is launched without the attribute: returns at once */
    mf__pdl_trigger();
    if (t == 0 && blockIdx.y == 0 && tid < MF__META_WORDS)
        ((int32_t *)(heap + p.view.meta))[tid] = tid ? p.meta_words[tid - 1] : p.T;
    if (t >= p.T) return;

    /* Routing: validate, then copy; a bad or repeated id becomes -1 and raises a fault. */
    if (blockIdx.y == 0 && tid < p.K) {
        const int32_t *row = p.ids + (size_t)t * p.K;
        int32_t id = row[tid];
        if (id < -1 || id >= p.E) {
            mf__raise(p.sink, MF_ERR_INVALID_ARGUMENT, kMfFaultBadId, MF__PHASE_DISPATCH, -1, t, tid, id);
            id = -1;
        }
        for (int32_t j = 0; j < tid && id >= 0; j++)
            if (row[j] == id) {
                mf__raise(p.sink, MF_ERR_INVALID_ARGUMENT, kMfFaultDupId, MF__PHASE_DISPATCH, -1, t, tid, id);
                id = -1;
            }
        ((int32_t *)(heap + p.view.ids))[(size_t)t * p.K + tid] = id;
        if (p.weights) ((float *)(heap + p.view.weights))[(size_t)t * p.K + tid] = p.weights[(size_t)t * p.K + tid];
    }

    const uint16_t *xr = p.x + (size_t)t * p.H;
    const int32_t c0 = (int32_t)blockIdx.y * kMfPublishCols, c1 = min(c0 + kMfPublishCols, p.H);
    if (!p.fp8) {
        const uint4 *src = (const uint4 *)xr;
        uint4 *dst = (uint4 *)(heap + p.view.x + (size_t)t * p.H * 2);
        for (int32_t i = c0 / 8 + tid; i < c1 / 8; i += blockDim.x) dst[i] = src[i];
        return;
    }
    /* FP8 1x128: one warp per 128-wide block, 4 values per lane. */
    uint8_t *q = heap + p.view.x + (size_t)t * p.H;
    float *scales = (float *)(heap + p.view.scales) + (size_t)t * (p.H / MF__QUANT_BLOCK);
    for (int32_t b = c0 / MF__QUANT_BLOCK + warp; b < c1 / MF__QUANT_BLOCK; b += blockDim.x / kMfWarp) {
        uint2 raw = *(const uint2 *)(xr + b * MF__QUANT_BLOCK + lane * 4);
        float v[4] = {mf__bf16_to_float((uint16_t)(raw.x & 0xffff)), mf__bf16_to_float((uint16_t)(raw.x >> 16)),
                      mf__bf16_to_float((uint16_t)(raw.y & 0xffff)), mf__bf16_to_float((uint16_t)(raw.y >> 16))};
        float amax = 0.0f;
        for (int i = 0; i < 4; i++) {
            float a = fabsf(v[i]);
            amax = a > amax ? a : amax; /* NaN never wins, as on the CPU */
        }
        for (int off = kMfWarp / 2; off > 0; off /= 2) {
            float o = __shfl_xor_sync(0xffffffffu, amax, off);
            amax = o > amax ? o : amax;
        }
        float scale, inv;
        mf__fp8_block_scale(amax, p.ue8m0, &scale, &inv);
        uint32_t packed = 0;
        for (int i = 0; i < 4; i++) packed |= (uint32_t)mf__fp8_from_float(__fmul_rn(v[i], inv)) << (8 * i);
        *(uint32_t *)(q + b * MF__QUANT_BLOCK + lane * 4) = packed;
        if (lane == 0) scales[b] = scale;
    }
}

__global__ void __launch_bounds__(kMfPublishThreads) mf__publish_kernel(mf__publish_params_t p) {
    mf__publish_block(p);
}

/* Publish and the DISPATCH sync in one kernel, for a forward at R = 1 whose small-batch kernel plans
 * for itself (kernels/sm90_small_gemm.cuh kOwn; backend.cu): no plan kernel runs, so the sync that
 * turns this call's fresh fault into the comm's sticky one (sync.cuh) runs here, in the block that
 * finishes last: each block counts itself out in `finished` (zero between calls; the last block
 * zeroes it again) after its writes and claims (a barrier, then one thread's fence and add, as a
 * grid-wide barrier does), and the last one, after a fence, runs mf__sync_block (with one rank its
 * wait is for its own arrival). The kernel after it (launched with the PDL attribute) may start at
 * once: publish triggers at its start; what it reads of this kernel (the published rows, ids and
 * weights, the fault verdict) it reads after its own mf__pdl_wait, i.e. after this grid's end. */
static_assert(kMfPublishThreads >= kMfWaitThreads, "mf__sync_block needs kMfWaitThreads threads");
__global__ void __launch_bounds__(kMfPublishThreads) mf__publish_sync_kernel(mf__sync_params_t sp,
                                                                             mf__publish_params_t p,
                                                                             int32_t *finished) {
    __shared__ int32_t last;
    mf__publish_block(p);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(finished, 1) == (int32_t)(gridDim.x * gridDim.y) - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (threadIdx.x == 0) *finished = 0;
    mf__sync_block(sp);
}

/* ---- plan ---------------------------------------------------------------------------------
 *
 * Three kernels, after the DISPATCH sync (a faulted comm writes nothing):
 *   fetch    copies every rank's T and routing once into this rank's memory (over NVLink each
 *            remote id crosses the link once per call, not once per local expert) and counts
 *            rows per global expert (E counters, zero on entry);
 *   offsets  the capacity verdict from the global counts, for every rank's experts, so that all
 *            ranks reach the same one (docs/DESIGN.md: an overflow writes nothing anywhere and every
 *            rank returns MF_ERR_CAPACITY); then this rank's counts and segment offsets; and it
 *            zeroes the global counters for the next call;
 *   fill     each local expert's source rows in rank-major, token, k order, from the local copy.
 *
 * Balanced EP (p.balanced; docs/DESIGN.md "Balanced EP"): the units are this rank's slots (L = Lp + B),
 * not logical experts. offsets runs src/balance/planner.h over shared memory (src/balance/device_plan.cuh: the
 * replica lists from the map and the resident spare table, the split of the global counts), which
 * is the CPU oracle's code (src/plan/plan.c mf__plan_build) line for line; the capacity verdict
 * runs over replicas; each slot gets its expert and the first row of its share in the expert's
 * global (rank, token, k) order. fill then keeps, of that expert's hits in global order, the
 * positions [begin, begin + count). Before any of it, offsets compares the heap meta words (map
 * hash, prefetch count, weights count) of every rank: all ranks read the same words, so a
 * disagreement faults every rank at the same call, before anything is written.
 */

typedef struct mf__plan_params {
    mf__heap_view_t view;
    int32_t K, E, L, S, first_expert, layout, block_m, capacity, max_rows;
    int32_t *ids_all;       /* [R, S, K] copy of every rank's routing */
    int32_t *T_all;         /* [R] */
    int32_t *global_counts; /* [E] rows per global expert; zero between calls */
    int32_t *counts;        /* [L] */
    int32_t *offsets;       /* [L + 1] */
    int32_t *src;           /* [rows, 3] */
    int32_t *counts_out, *offsets_out; /* mf_dispatch's copies for the caller, or NULL */
    int32_t check_weights;  /* compare meta word 3 (weights count) too: B > 0 */
    /* Balanced EP (balanced = 1; L = Lp + B slots). Dynamic shared memory: mf__plan_balance_smem. */
    int32_t balanced, P, B, Lp;
    int32_t serial;                /* 1: the planner on thread 0 (the CPU's functions); 0: mf__balance_plan_par */
    uint32_t weights_count;        /* the host's mf_moe_set_weights count at this call */
    const int32_t *map;            /* [P] device copy of the expert map */
    const int32_t *resident;       /* [R * B] spare table (-1 = empty); used when *weights_seen == weights_count */
    const uint32_t *weights_seen;  /* the weights count the resident table was pushed from */
    int32_t *slot_expert, *slot_begin; /* [L] logical expert of each slot, its first row in the expert's order */
    int32_t *prev_counts;          /* [E] out: the global counts of the last plan that did not fault */
    int32_t *have_prev;            /* out: 1 once prev_counts holds a plan's counts */
    int64_t *stats;                /* out: [2 * MF_MAX_RANKS] rows per rank with replicas, then without */
    mf__fault_sink_t sink;
    /* Balanced only (appended: the kernels of the plain plan keep their parameter offsets). */
    int32_t placement;             /* mf_placement_t: each expert's home rank, for stats[MF_MAX_RANKS + r] */
    int32_t out_slots;             /* mf_dispatch: the caller's segments, counts_out [out_slots] and
                                      offsets_out [out_slots + 1] (a placement's empty slots are the last) */
} mf__plan_params_t;

/* Grid (kMfPlanFetchBlocks, R): blocks of rank r copy its routing and count it. */
__global__ void __launch_bounds__(kMfPlanThreads) mf__plan_fetch_kernel(mf__plan_params_t p) {
    __shared__ int32_t hist[kMfPlanSmemExperts];
    const bool smem = p.E <= kMfPlanSmemExperts;
    if (smem)
        for (int32_t e = threadIdx.x; e < p.E; e += blockDim.x) hist[e] = 0;
    mf__pdl_wait();
    mf__pdl_trigger();
    if (mf__faulted(p.sink)) return;
    const int32_t r = blockIdx.y;
    const int32_t T = *(const volatile int32_t *)(p.view.heap[r] + p.view.meta);
    if (blockIdx.x == 0 && threadIdx.x == 0) p.T_all[r] = T;
    __syncthreads();
    const int32_t *ids = (const int32_t *)(p.view.heap[r] + p.view.ids);
    int32_t *copy = p.ids_all + (size_t)r * p.S * p.K;
    const int32_t entries = T * p.K;
    for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < entries; i += gridDim.x * blockDim.x) {
        const int32_t id = ids[i]; /* publish made every id -1 or in [0, E) */
        copy[i] = id;
        if (id >= 0) atomicAdd(smem ? &hist[id] : &p.global_counts[id], 1);
    }
    if (!smem) return;
    __syncthreads();
    for (int32_t e = threadIdx.x; e < p.E; e += blockDim.x)
        if (hist[e]) atomicAdd(&p.global_counts[e], hist[e]);
}

/* The offsets kernel's first step: every rank's meta words 1..3 against rank 0's (word 3 only with
 * spare slots), thread r - 1 reading rank r; the lowest (rank, word) that differs faults the call.
 * The peers wrote them before their DISPATCH arrival, which this call waited for. */
__device__ void mf__plan_check_meta(const mf__plan_params_t &p) {
    __shared__ int32_t first; /* lowest r * MF__META_WORDS + w that differs */
    if (threadIdx.x == 0) first = INT32_MAX;
    __syncthreads();
    const int32_t r = threadIdx.x + 1;
    if (r < p.view.num_ranks && !mf__faulted(p.sink)) {
        const volatile int32_t *m0 = (const volatile int32_t *)(p.view.heap[0] + p.view.meta);
        const volatile int32_t *m = (const volatile int32_t *)(p.view.heap[r] + p.view.meta);
        for (int32_t w = 1; w < MF__META_WORDS; w++)
            if ((w != 3 || p.check_weights) && m[w] != m0[w]) {
                atomicMin(&first, r * MF__META_WORDS + w);
                break;
            }
    }
    __syncthreads();
    if (threadIdx.x == 0 && first != INT32_MAX) {
        const int32_t fr = first / MF__META_WORDS, w = first % MF__META_WORDS;
        const int32_t a = ((const volatile int32_t *)(p.view.heap[fr] + p.view.meta))[w];
        const int32_t b = ((const volatile int32_t *)(p.view.heap[0] + p.view.meta))[w];
        mf__set_fault(p.sink, MF_ERR_INVALID_USAGE, kMfFaultBalance, p.view.rank, MF__PHASE_DISPATCH, fr, 0, w,
                      (long long)(uint32_t)a, (long long)(uint32_t)b);
    }
    __syncthreads(); /* every thread sees the fault before it reads the counts */
}
static_assert(kMfPlanThreads >= MF_MAX_RANKS, "the meta check reads one rank per thread");

#include "balance/device_plan.cuh" /* mf__plan_offsets_balanced, mf__plan_balance_smem */

/* The verdict and offsets of the plan without balancing, block-wide (after mf__plan_check_meta):
 * the capacity verdict (lowest overflowing expert, MASKED, or rank, EXPERT_MAJOR, as the CPU plan
 * reports it) from the global counts `gc` [E] (global memory, or the small plan's shared copy),
 * then a block-wide scan of this rank's padded counts into offsets and counts. */
__device__ void mf__plan_offsets_static(const mf__plan_params_t &p, const int32_t *gc) {
    __shared__ int32_t worst;
    __shared__ int64_t warp_sum[kMfMaxWarps];
    const int32_t lane = threadIdx.x % kMfWarp, warp = threadIdx.x / kMfWarp, nwarps = blockDim.x / kMfWarp;
    const bool masked = p.layout == MF_LAYOUT_MASKED;
    const int32_t R = p.view.num_ranks;
    if (threadIdx.x == 0) worst = INT32_MAX;
    __syncthreads();
    bool faulted = mf__faulted(p.sink);
    if (!faulted && masked) {
        for (int32_t e = threadIdx.x; e < p.E; e += blockDim.x)
            if (gc[e] > p.capacity) atomicMin(&worst, e);
    } else if (!faulted) {
        for (int32_t q = warp; q < R; q += nwarps) {
            long long rows = 0;
            for (int32_t e = q * p.L + lane; e < (q + 1) * p.L; e += kMfWarp)
                rows += ((long long)gc[e] + p.block_m - 1) / p.block_m * p.block_m;
            for (int off = kMfWarp / 2; off > 0; off /= 2) rows += __shfl_xor_sync(0xffffffffu, rows, off);
            if (lane == 0 && rows > p.max_rows) atomicMin(&worst, q);
        }
    }
    __syncthreads();
    if (worst != INT32_MAX && threadIdx.x == 0) {
        long long seen = 0;
        if (masked) {
            seen = gc[worst];
        } else {
            for (int32_t e = worst * p.L; e < (worst + 1) * p.L; e++)
                seen += ((long long)gc[e] + p.block_m - 1) / p.block_m * p.block_m;
        }
        /* Every rank sets the same fault from the same counts: no rank writes anything. */
        mf__set_fault(p.sink, MF_ERR_CAPACITY, kMfFaultCapacity, masked ? worst / p.L : worst, MF__PHASE_DISPATCH,
                      masked ? -1 : -2, 0, worst, seen, masked ? p.capacity : p.max_rows);
    }
    faulted = faulted || worst != INT32_MAX;
    /* This rank's padded counts, scanned block-wide: thread i owns experts [i per, (i + 1) per), its
     * loads independent of each other (warp 0 walking kMfWarp experts at a time cost a dependent
     * load per chunk: ~5 us at L = 256). */
    const int32_t per = (p.L + (int32_t)blockDim.x - 1) / (int32_t)blockDim.x;
    const int32_t e0 = min((int32_t)threadIdx.x * per, p.L), e1 = min(e0 + per, p.L);
    int64_t mine = 0;
    for (int32_t e = e0; e < e1 && !masked && !faulted; e++)
        mine += ((int64_t)gc[p.first_expert + e] + p.block_m - 1) / p.block_m * p.block_m;
    /* This block scan and mf__plan_fill_kernel's are alike on purpose: one shared helper changed the
     * fill kernel's SASS (its loop tests rescheduled; dev/cubin_diff.py), so each stays written out. */
    int64_t incl = mine; /* inclusive scan over the lanes, then over the warps */
#pragma unroll
    for (int off = 1; off < kMfWarp; off <<= 1) {
        const int64_t v = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += v;
    }
    if (lane == kMfWarp - 1) warp_sum[warp] = incl;
    __syncthreads();
    int64_t base = incl - mine, total = 0;
    for (int32_t w = 0; w < nwarps; w++) {
        base += w < warp ? warp_sum[w] : 0;
        total += warp_sum[w];
    }
    for (int32_t e = e0; e < e1; e++) {
        /* A faulted call leaves empty segments: the GEMMs and moves that follow do nothing. */
        const int32_t c = faulted ? 0 : gc[p.first_expert + e];
        const int32_t offset = masked ? e * p.capacity : (int32_t)base;
        base += masked ? 0 : ((int64_t)c + p.block_m - 1) / p.block_m * p.block_m;
        p.offsets[e] = faulted ? 0 : offset;
        p.counts[e] = c;
        if (p.counts_out && !faulted) p.counts_out[e] = c;
        if (p.offsets_out && !faulted) p.offsets_out[e] = offset;
    }
    if (threadIdx.x == 0) {
        p.offsets[p.L] = faulted ? 0 : masked ? p.L * p.capacity : (int32_t)total;
        if (p.offsets_out && !faulted) p.offsets_out[p.L] = p.offsets[p.L];
    }
    __syncthreads();
}

/* One block: the meta check, then the balanced plan or the verdict and offsets (above); it zeroes
 * the global counts for the next call. */
__global__ void __launch_bounds__(kMfPlanThreads) mf__plan_offsets_kernel(mf__plan_params_t p) {
    mf__pdl_wait();
    mf__pdl_trigger();
    mf__plan_check_meta(p); /* block-wide */
    if (p.balanced) {
        mf__plan_offsets_balanced(p);
        __syncthreads();
    } else {
        mf__plan_offsets_static(p, p.global_counts);
    }
    for (int32_t e = threadIdx.x; e < p.E; e += blockDim.x) p.global_counts[e] = 0; /* for the next call */
}

/* One block per local expert: its rows in rank-major, token, k order; then padding markers. Each
 * pass scans kMfPlanPerThread consecutive entries per thread (loads in flight together), then a
 * block-wide exclusive scan of the per-thread hit counts places the hits in entry order. */
__global__ void __launch_bounds__(kMfPlanThreads) mf__plan_fill_kernel(mf__plan_params_t p) {
    __shared__ int32_t warp_total[kMfPlanThreads / kMfWarp];
    mf__pdl_wait();
    mf__pdl_trigger();
    if (mf__faulted(p.sink)) return;
    const int32_t e = blockIdx.x, lane = threadIdx.x % kMfWarp, warp = threadIdx.x / kMfWarp,
                  nwarps = blockDim.x / kMfWarp;
    /* Balanced: slot e holds expert slot_expert[e] and takes its hits [begin, begin + count) in global
     * order; otherwise local expert e takes all of its hits. */
    const int32_t target = p.balanced ? p.slot_expert[e] : p.first_expert + e;
    const int32_t begin = p.balanced ? p.slot_begin[e] : 0;
    const int32_t count = p.counts[e], row0 = p.offsets[e], end = begin + count;
    const int32_t per_pass = kMfPlanPerThread * blockDim.x;
    int32_t base = 0;
    for (int32_t r = 0; r < p.view.num_ranks && base < end && count > 0; r++) {
        const int32_t entries = p.T_all[r] * p.K;
        const int32_t *ids = p.ids_all + (size_t)r * p.S * p.K;
        for (int32_t chunk = 0; chunk < entries && base < end; chunk += per_pass) {
            const int32_t i0 = chunk + kMfPlanPerThread * threadIdx.x;
            bool hit[kMfPlanPerThread];
            int32_t n = 0;
#pragma unroll
            for (int q = 0; q < kMfPlanPerThread; q++) {
                hit[q] = i0 + q < entries && ids[i0 + q] == target;
                n += hit[q];
            }
            /* Alike on purpose, as mf__plan_offsets_static's block scan (there). */
            int32_t incl = n; /* inclusive scan over the warp's lanes */
#pragma unroll
            for (int off = 1; off < kMfWarp; off <<= 1) {
                const int32_t v = __shfl_up_sync(0xffffffffu, incl, off);
                if (lane >= off) incl += v;
            }
            if (lane == kMfWarp - 1) warp_total[warp] = incl;
            __syncthreads();
            int32_t before = 0, total = 0;
            for (int32_t w = 0; w < nwarps; w++) {
                before += w < warp ? warp_total[w] : 0;
                total += warp_total[w];
            }
            int32_t pos = base + before + incl - n;
#pragma unroll
            for (int q = 0; q < kMfPlanPerThread; q++) {
                if (!hit[q]) continue;
                if (pos >= begin && pos < end) {
                    int32_t *s = p.src + 3 * (size_t)(row0 + pos - begin);
                    s[0] = r;
                    s[1] = (i0 + q) / p.K;
                    s[2] = (i0 + q) % p.K;
                }
                pos++;
            }
            base += total;
            __syncthreads();
        }
    }
    if (p.layout == MF_LAYOUT_EXPERT_MAJOR)
        for (int32_t j = count + threadIdx.x; j < p.offsets[e + 1] - row0; j += blockDim.x) {
            int32_t *s = p.src + 3 * (size_t)(row0 + j);
            s[0] = s[1] = s[2] = -1;
        }
}

/* ---- the small plan: the DISPATCH sync and the whole plan in one block ----------------------
 *
 * For small problems without balancing (the host's test: mf__plan_small_fits, on this rank's T) one block of
 * kMfPlanSmallThreads does what mf__sync_kernel, fetch, offsets and fill do, with the same
 * results bit for bit: the global counts live in shared memory (the global counters are never
 * touched, so they stay zero), the verdict and offsets are mf__plan_offsets_static's, and the fill
 * places each hit at (its expert's hits in earlier rounds) + (in earlier warps of this round) +
 * (in earlier lanes of its warp: __match_any_sync), i.e. rank-major, token, k order. Four kernel
 * boundaries fewer on the decode path (each ~2-3 us at T = 1). The block triggers its dependents
 * only after its sync wait: the next kernel is a GEMM or the gather, large grids that must not
 * sit on SMs while this rank waits for its peers (docs/DESIGN.md "Performance doctrine"). */
static inline bool mf__plan_small_fits(int32_t R, int32_t T, int32_t K, int32_t E, int32_t L) {
    return (int64_t)R * T * K <= kMfPlanSmallEntries && E <= kMfPlanSmallExperts && L <= kMfPlanSmallLocal;
}

__global__ void __launch_bounds__(kMfPlanSmallThreads) mf__plan_small_kernel(mf__sync_params_t sp, mf__plan_params_t p) {
    __shared__ int32_t cnt[kMfPlanSmallExperts];                          /* global counts [E] */
    __shared__ int32_t run[kMfPlanSmallLocal];                            /* hits placed per local expert */
    __shared__ int32_t tbl[kMfPlanSmallThreads / kMfWarp][kMfPlanSmallLocal]; /* this round's hits per warp */
    __shared__ int32_t first_entry[MF_MAX_RANKS + 1];                    /* rank r's entries start here */
    __shared__ int32_t seg_off[kMfPlanSmallLocal + 1], seg_cnt[kMfPlanSmallLocal]; /* the plan's offsets, counts */
    const int32_t lane = threadIdx.x % kMfWarp, warp = threadIdx.x / kMfWarp, nwarps = blockDim.x / kMfWarp;
    const int32_t R = p.view.num_ranks, L = p.L;
    mf__pdl_wait();
    for (int32_t e = threadIdx.x; e < p.E; e += blockDim.x) cnt[e] = 0;
    for (int32_t e = threadIdx.x; e < L; e += blockDim.x) {
        run[e] = 0;
        for (int32_t w = 0; w < nwarps; w++) tbl[w][e] = 0;
    }
    mf__sync_block(sp); /* ends with a barrier: the peers' publications are visible to every thread */
    mf__pdl_trigger();
    const bool faulted = mf__faulted(p.sink);
    /* fetch: every rank's T and routing (a faulted call fetches nothing, as fetch does) */
    if (threadIdx.x == 0) {
        int32_t at = 0;
        for (int32_t r = 0; r < R; r++) {
            const int32_t T = faulted ? 0 : *(const volatile int32_t *)(p.view.heap[r] + p.view.meta);
            if (!faulted) p.T_all[r] = T;
            first_entry[r] = at;
            at += T * p.K;
        }
        first_entry[R] = at;
    }
    __syncthreads();
    const int32_t entries = first_entry[R];
    for (int32_t g = threadIdx.x; g < entries; g += blockDim.x) {
        int32_t r = 0;
        while (first_entry[r + 1] <= g) r++;
        const int32_t i = g - first_entry[r];
        const int32_t id = ((const int32_t *)(p.view.heap[r] + p.view.ids))[i]; /* -1 or in [0, E) */
        p.ids_all[(size_t)r * p.S * p.K + i] = id;
        if (id >= 0) atomicAdd(&cnt[id], 1);
    }
    __syncthreads();
    /* offsets: the meta check, the verdict and this rank's segments */
    mf__plan_check_meta(p);
    mf__plan_offsets_static(p, cnt); /* ends with a barrier */
    if (mf__faulted(p.sink)) return;
    for (int32_t e = threadIdx.x; e <= L; e += blockDim.x) {
        seg_off[e] = p.offsets[e];
        if (e < L) seg_cnt[e] = p.counts[e];
    }
    __syncthreads();
    /* fill, kMfPlanSmallThreads entries a round in global order */
    for (int32_t g0 = 0; g0 < entries; g0 += blockDim.x) {
        const int32_t g = g0 + threadIdx.x;
        int32_t e = -1, r = 0, i = 0;
        if (g < entries) {
            while (first_entry[r + 1] <= g) r++;
            i = g - first_entry[r];
            const int32_t id = p.ids_all[(size_t)r * p.S * p.K + i];
            e = id >= p.first_expert && id < p.first_expert + L ? id - p.first_expert : -1;
        }
        const uint32_t peers = __match_any_sync(0xffffffffu, e);
        const uint32_t before = peers & ((1u << lane) - 1u);
        if (e >= 0 && before == 0) tbl[warp][e] = __popc(peers); /* the warp's hits of e, by its first lane */
        __syncthreads();
        if (e >= 0) {
            int32_t pos = run[e] + __popc(before);
            for (int32_t w = 0; w < warp; w++) pos += tbl[w][e];
            int32_t *s = p.src + 3 * (size_t)(seg_off[e] + pos);
            s[0] = r;
            s[1] = i / p.K;
            s[2] = i % p.K;
        }
        __syncthreads();
        for (int32_t x = threadIdx.x; x < L; x += blockDim.x) {
            int32_t sum = 0;
            for (int32_t w = 0; w < nwarps; w++) {
                sum += tbl[w][x];
                tbl[w][x] = 0;
            }
            run[x] += sum;
        }
        __syncthreads();
    }
    /* padding markers (EXPERT_MAJOR), as fill writes them: a warp per expert */
    if (p.layout == MF_LAYOUT_EXPERT_MAJOR)
        for (int32_t e = warp; e < L; e += nwarps)
            for (int32_t j = seg_cnt[e] + lane; j < seg_off[e + 1] - seg_off[e]; j += kMfWarp) {
                int32_t *s = p.src + 3 * (size_t)(seg_off[e] + j);
                s[0] = s[1] = s[2] = -1;
            }
}

/* ---- gather and return: one warp per receive row, grid-stride over all of them ----------------
 *
 * The walk covers the receive rows [0, offsets[L]) of every expert at once (both layouts end there;
 * MASKED: L * C), so all warps of the grid have rows even when each expert has few (a walk expert
 * by expert left most warps idle: 1.5 ms to gather 32768 rows over 256 experts on the H200). A row
 * is a routed one when, EXPERT_MAJOR, the plan's source entry is not a padding marker (the plan
 * writes -1 over [count, padded)), or, MASKED, its slot is below its expert's count. */

typedef struct mf__move_params {
    mf__heap_view_t view;
    int32_t K, L, H, fp8, layout, capacity;
    const int32_t *counts, *offsets, *src;
    /* gather */
    uint8_t *recv_x;       /* [rows, H] payload */
    float *recv_scales;    /* [rows, H/128] (FP8) */
    int32_t *recv_src;     /* [rows, 3] copy for the caller, or NULL */
    /* return */
    const uint16_t *expert_out; /* [rows, H] bf16 */
    mf__fault_sink_t sink;      /* a faulted comm moves nothing */
} mf__move_params_t;

/* One warp copies `bytes` (a multiple of 16): 4 loads in flight per lane before their stores. */
__device__ __forceinline__ void mf__copy_row16(uint8_t *__restrict__ dst, const uint8_t *__restrict__ src, size_t bytes,
                                               int32_t lane) {
    const uint4 *s = (const uint4 *)src;
    uint4 *d = (uint4 *)dst;
    const size_t n = bytes / 16;
    size_t i = (size_t)lane;
    for (; i + 3 * kMfWarp < n; i += 4 * kMfWarp) {
        const uint4 a = s[i], b = s[i + kMfWarp], c = s[i + 2 * kMfWarp], e = s[i + 3 * kMfWarp];
        d[i] = a;
        d[i + kMfWarp] = b;
        d[i + 2 * kMfWarp] = c;
        d[i + 3 * kMfWarp] = e;
    }
    for (; i < n; i += kMfWarp) d[i] = s[i];
}

/* Whether receive row `row` holds a routed row (see above); EXPERT_MAJOR padding sets *pad. */
__device__ __forceinline__ bool mf__routed_row(const mf__move_params_t &p, int64_t row, bool *pad) {
    *pad = false;
    if (p.layout == MF_LAYOUT_MASKED) return row % p.capacity < p.counts[row / p.capacity];
    *pad = p.src[3 * row] < 0;
    return !*pad;
}

__global__ void __launch_bounds__(kMfMoveThreads) mf__gather_kernel(mf__move_params_t p) {
    const int32_t lane = threadIdx.x % kMfWarp;
    const int64_t gwarp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / kMfWarp;
    const int64_t nwarps = (int64_t)gridDim.x * blockDim.x / kMfWarp;
    const size_t row_bytes = (size_t)p.H * (p.fp8 ? 1 : 2);
    const int32_t nsc = p.H / MF__QUANT_BLOCK;
    mf__pdl_wait();
    mf__pdl_trigger();
    const int64_t rows = mf__faulted(p.sink) ? 0 : p.offsets[p.L];
    for (int64_t row = gwarp; row < rows; row += nwarps) {
        bool pad;
        if (!mf__routed_row(p, row, &pad)) {
            if (pad && p.recv_src && lane < 3) p.recv_src[3 * row + lane] = -1; /* the padding marker */
            continue;
        }
        const int32_t *s = p.src + 3 * row;
        const int32_t r = s[0], t = s[1];
        if (p.recv_src && lane < 3) p.recv_src[3 * row + lane] = s[lane];
        mf__copy_row16(p.recv_x + row * row_bytes, p.view.heap[r] + p.view.x + (size_t)t * row_bytes, row_bytes, lane);
        if (p.fp8) {
            const float *ss = (const float *)(p.view.heap[r] + p.view.scales) + (size_t)t * nsc;
            for (int32_t i = lane; i < nsc; i += kMfWarp) p.recv_scales[row * nsc + i] = ss[i];
        }
    }
}

__global__ void __launch_bounds__(kMfMoveThreads) mf__return_kernel(mf__move_params_t p) {
    const int32_t lane = threadIdx.x % kMfWarp;
    const int64_t gwarp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / kMfWarp;
    const int64_t nwarps = (int64_t)gridDim.x * blockDim.x / kMfWarp;
    const size_t row_bytes = (size_t)p.H * 2;
    mf__pdl_wait();
    mf__pdl_trigger();
    const int64_t rows = mf__faulted(p.sink) ? 0 : p.offsets[p.L];
    for (int64_t row = gwarp; row < rows; row += nwarps) {
        bool pad;
        if (!mf__routed_row(p, row, &pad)) continue;
        const int32_t *s = p.src + 3 * row;
        uint8_t *slot = p.view.heap[s[0]] + p.view.combine + ((size_t)s[1] * p.K + s[2]) * row_bytes;
        mf__copy_row16(slot, (const uint8_t *)(p.expert_out + row * p.H), row_bytes, lane);
    }
}

/* A combine send's copy of its topk_weights into its heap slot (the receive sums with the copy):
 * a kernel, not a cudaMemcpyAsync, as everything on the data path (docs/DECISIONS.md: a copy can
 * wait behind a peer's spinning kernel on a shared GPU). Grid-stride over n floats. */
__global__ void __launch_bounds__(kMfMoveThreads) mf__keep_weights_kernel(const float *src, float *dst, int64_t n) {
    mf__pdl_wait(); /* launched without the attribute (a call's first kernel): returns at once */
    mf__pdl_trigger();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

/* ---- the owner's K-sum -------------------------------------------------------------------- */

typedef struct mf__sum_params {
    mf__heap_view_t view; /* the slot's: reads my heap's ids and combine slots, view.heap[view.rank] */
    const float *weights; /* [T, K] */
    uint16_t *y;          /* [T, H] */
    int32_t T, H, K;
    mf__fault_sink_t sink; /* a faulted comm leaves y untouched */
} mf__sum_params_t;

/* Grid (T, column groups): each thread owns 8 columns of one token (16-byte loads and stores), so
 * a few tokens still spread over many SMs. A thread loads up to kMfSumBatch partials before adding
 * them, in k order (kernels/sum.cuh: the one definition of that arithmetic). */
__global__ void __launch_bounds__(kMfSumThreads) mf__sum_kernel(mf__sum_params_t p) {
    const int32_t t = blockIdx.x;
    const int32_t c = blockIdx.y * blockDim.x + threadIdx.x;
    mf__pdl_wait();
    mf__pdl_trigger();
    if (c >= p.H / 8 || mf__faulted(p.sink)) return;
    const uint8_t *heap = p.view.heap[p.view.rank]; /* my heap */
    const int32_t *ids = (const int32_t *)(heap + p.view.ids) + (size_t)t * p.K;
    const uint16_t *slots = (const uint16_t *)(heap + p.view.combine) + (size_t)t * p.K * p.H;
    *(uint4 *)(p.y + (size_t)t * p.H + c * 8) =
        mf__sum_columns<false>(ids, p.weights + (size_t)t * p.K, slots, p.K, p.H, c);
}

#endif /* MF_CUDA_MOVEMENT_CUH */
