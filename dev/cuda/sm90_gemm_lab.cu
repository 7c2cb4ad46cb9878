/*
 * sm90_gemm_lab.cu — the Hopper (sm_90a) grouped expert GEMM for prefill (M >= 128 rows per expert),
 * BF16 and block-FP8, built on TMA + wgmma + warp specialisation (kernels/sm90_ptx.cuh), and its
 * validate-then-bench main. It is the candidate replacement of v1's mma.sync kernels
 * (kernels/sm90_grouped_gemm.cuh); once it wins it moves into src/cuda. Built by `make lab` into
 * build/dev/sm90_gemm_lab; needs one sm_90a GPU.
 *
 *   sm90_gemm_lab --selftest    one 64 x 64 x K wgmma tile (FP8, BF16) from TMA-loaded smem vs CPU
 *   sm90_gemm_lab --validate    small and DeepSeek-shaped cases vs the CPU reference below
 *   sm90_gemm_lab --bench [--json FILE]   DeepSeek-V3 W13 / W2 shapes, kernel time, L2 flushed
 *   sm90_gemm_lab               selftest, validate, bench
 *
 * Dimension legend: L local experts, rows = receive rows (all experts), K the reduction dim (H for
 * W13, I for W2), N the output columns of a plain GEMM (H for W2), I the h columns of a fused W13
 * (its weight has Nw = 2I rows: gate [0, I), up [I, 2I)), Nw weight rows per expert.
 *
 *   plain:   out[rows, N] = bf16(a[rows, K] . w[e][N, K]^T)             rows of expert e only
 *   swiglu:  h[rows, I] = silu(a . w[e][0:I]^T) * (a . w[e][I:2I]^T)     BF16, or FP8 1x128 + scales
 *
 * Rows of expert e are [offsets[e], offsets[e] + counts[e]) (device arrays): EXPERT_MAJOR (offsets
 * multiples of 128) or MASKED (offsets[e] = e * C). Rows past counts[e] are garbage, read only
 * into accumulator rows that are never stored.
 *
 * The kernel (mf__sm90_gemm). Persistent, grid = #SMs, 384 threads = 3 warpgroups:
 *  - WG 0, producer (setmaxnreg 40): warp 0's elected lane issues the TMA loads of each K block —
 *    A [128 rows, 128 B] and kChunks weight boxes [128 rows, 128 B] — into a kStages ring of
 *    128B-swizzled tiles, completing on full[s]; for FP8 warp 1 copies the block's scales with
 *    cp.async (a_scale of the 128 rows, w_scale of each chunk) into the stage and arrives on
 *    full[s] when they land (full[s] expects 1 + 32 arrivals). Both wait on empty[s] first.
 *  - WG 1, 2, consumers (setmaxnreg 232): rows [0, 64) and [64, 128) of the tile. BF16: per stage
 *    4 x wgmma m64n(128 kChunks)k16 into the accumulators, one group kept in flight (the stage is
 *    released when the next one's group is issued and the previous has completed). FP8: per stage
 *    and chunk 4 x wgmma m64n128k32 into a temporary fragment (scale-d 0 on the first), wait, then
 *    acc += tmp * (a_scale[row][kb] * w_scale[n/128][kb]) — DESIGN.md's arithmetic, in this order.
 *    The two consumer warpgroups interleave on the tensor cores, so one promotes while the other's
 *    wgmma run. With 128-column tiles (kChunks = 1) each warpgroup also double-buffers the
 *    temporary: block kb + 1's wgmma are issued before block kb is promoted (acc 64 + 2 x 64
 *    registers; 256-column tiles have no room for a second temporary: acc 128 + 64).
 *    Each consumer warp arrives on empty[s] (8 arrivals) after its last read of stage s.
 *  - kCluster = 2: CTA pairs (a cluster) take m-blocks 2u and 2u + 1 of the same (expert, n-block)
 *    unit u; each CTA loads half of the weight tile (one chunk, or 64 rows of the one chunk) and
 *    multicasts it into both CTAs' slot, halving L2 -> SMEM weight traffic. empty[s] then expects
 *    the consumer warps of both CTAs (16 arrivals, remote ones through mapa); an odd m-block count
 *    leaves one CTA a block past the expert's rows, computed and never stored; both CTAs meet at a
 *    cluster barrier before exit.
 *  - Tiles: (expert, m-block of 128 rows, n-block of 128 kChunks columns or 128 h columns), in
 *    m-major order (all n-blocks of an m-block consecutive, so CTAs running together share the A
 *    block and the weight stripe in L2). Each CTA builds the per-expert m-block prefix from the
 *    device counts at start (L <= kMaxExperts), then walks tiles blockIdx.x, + gridDim.x, ...
 *  - Epilogue per consumer warpgroup through its own 8 KB smem buffer (64 rows x 128 B, 16-byte
 *    chunks XOR-swizzled by row): BF16 via stmatrix, FP8 h via 16-bit stores, then 16-byte
 *    st.global of the rows below counts[e] only. SwiGLU: gate and up of an h column sit in the same
 *    register of the two chunks' fragments; FP8 requantisation reduces the row's amax over the
 *    128 h columns across the 4 lanes of a quad, then mf__fp8_block_scale / mf__fp8_from_float.
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/numerics.h"
#include "cuda/kernels/sm90_ptx.cuh"

/* ---- compile-time tile parameters and the shared-memory map ------------------------------------ */

static constexpr int kThreads = 384;            /* 1 producer + 2 consumer warpgroups */
static constexpr int kConsumerWGs = 2;
static constexpr int kBlockM = 128;             /* rows per tile */
static constexpr int kWgRows = 64;              /* rows per consumer warpgroup (one wgmma M) */
static constexpr int kRowBytes = 128;           /* K bytes per row per stage = one swizzle row */
static constexpr int kChunkN = 128;             /* weight rows per chunk (one TMA box) */
static constexpr int kTileABytes = kBlockM * kRowBytes;  /* 16 KB */
static constexpr int kChunkBBytes = kChunkN * kRowBytes; /* 16 KB */
static constexpr int kWgmmaKBytes = 32;         /* K bytes per wgmma: e4m3 k32 / bf16 k16 */
static constexpr int kKSteps = kRowBytes / kWgmmaKBytes; /* 4 wgmma per stage and chunk */
static constexpr int kScaleBlock = MF__QUANT_BLOCK;      /* 128: FP8 K block = one stage */
static constexpr int kProducerRegs = 40;
static constexpr int kConsumerRegs = 232;
static constexpr int kEpiBytes = kWgRows * 128; /* 8 KB staging buffer per consumer warpgroup */
static constexpr int kMaxExperts = 384;
static constexpr int kSmemLimit = 227 * 1024;
static constexpr int kEmptyArrivals = kConsumerWGs * 4;  /* one per consumer warp */
static constexpr int kScaleArrivals = 32;                /* FP8: one per lane of the scale warp */
static constexpr int kWScalesPerStage = 4;               /* kChunks used, padded to 16 B */
static constexpr int kBarEpiBase = 1;                    /* named barriers 1, 2: consumer WG epilogues */

static_assert(kRowBytes == kScaleBlock, "an FP8 stage must be exactly one 128-wide scale block");
static_assert(kBlockM == kConsumerWGs * kWgRows, "consumer warpgroups must cover the tile rows");

enum { kEpiPlain = 0, kEpiSwigluBf16 = 1, kEpiSwigluFp8 = 2 };

template <int kChunks>
struct smem_map {
    static constexpr int kStageBytes = kTileABytes + kChunks * kChunkBBytes;
    static constexpr int kFixed = kConsumerWGs * kEpiBytes + 3 * (kMaxExperts + 1) * 4 + 1024 /* align slack */;
    static constexpr int kPerStageExtra = (kBlockM + kWScalesPerStage) * 4 + 2 * 8;
    static constexpr int kStagesFit = (kSmemLimit - kFixed) / (kStageBytes + kPerStageExtra);
    static constexpr int kStages = kStagesFit > 8 ? 8 : kStagesFit;
    static constexpr int kRing = 0;
    static constexpr int kEpi = kRing + kStages * kStageBytes;
    static constexpr int kAScales = kEpi + kConsumerWGs * kEpiBytes;      /* [kStages][128] f32 */
    static constexpr int kWScales = kAScales + kStages * kBlockM * 4;     /* [kStages][4] f32 */
    static constexpr int kFull = kWScales + kStages * kWScalesPerStage * 4; /* [kStages] u64 */
    static constexpr int kEmpty = kFull + kStages * 8;
    static constexpr int kPrefix = kEmpty + kStages * 8;                  /* [L + 1] m-block prefix */
    static constexpr int kCounts = kPrefix + (kMaxExperts + 1) * 4;       /* [L] */
    static constexpr int kOffsets = kCounts + kMaxExperts * 4;            /* [L] */
    static constexpr int kBytes = kOffsets + kMaxExperts * 4 + 1024;      /* + base alignment slack */
    static_assert(kStages >= 2, "the ring needs two stages");
    static_assert(kBytes <= kSmemLimit, "must fit one sm_90 CTA");
    static_assert(kEpi % kMfSwizzleAtomBytes == 0, "tiles 1024-aligned");
};

/* ---- kernel parameters (one struct, by value, __grid_constant__) ------------------------------- */

struct gemm_params {
    CUtensorMap map_a;       /* a [rows, K], box [128 rows, 128 B], 128B swizzle */
    CUtensorMap map_w;       /* w [L * Nw, K], box [128 rows, 128 B], 128B swizzle */
    const int32_t *counts;   /* [L] device */
    const int32_t *offsets;  /* [L] device */
    const float *a_scales;   /* FP8: [rows, K / 128] */
    const float *w_scales;   /* FP8: [L, Nw / 128, K / 128] */
    uint8_t *out;            /* plain: bf16 [rows, N]; swiglu: h [rows, I] bf16 or fp8 */
    float *out_scales;       /* swiglu FP8: [rows, I / 128] */
    int32_t num_experts;     /* L */
    int32_t n;               /* plain: N; swiglu: I */
    int32_t k;               /* K */
    int32_t ue8m0;           /* swiglu FP8: power-of-two h scales */
};

/* One tile of the schedule. */
struct tile_info {
    int e;          /* expert */
    int nb;         /* n-block */
    int row0;       /* first receive row */
    int rows;       /* valid rows in [1, 128] */
};

/* Unit t of the m-major order: m-unit t / nblocks (counted across experts), n-block t % nblocks.
 * A unit is kCluster m-blocks, one per CTA of the cluster (`rank`); the last unit of an expert may
 * hold an m-block past its rows (rows <= 0: computed, never stored). `e` is the caller's cursor:
 * the units of one CTA only move forward. */
template <int kCluster>
__device__ __forceinline__ tile_info mf__tile_at(int t, int nblocks, const int32_t *prefix, const int32_t *cnt,
                                                 const int32_t *off, int rank, int &e) {
    tile_info ti;
    int gm = t / nblocks;
    ti.nb = t - gm * nblocks;
    while (prefix[e + 1] <= gm) e++;
    int mb = (gm - prefix[e]) * kCluster + rank;
    ti.e = e;
    ti.row0 = off[e] + mb * kBlockM;
    ti.rows = min(kBlockM, cnt[e] - mb * kBlockM);
    return ti;
}

/* Releases ring slot `bar` (one arrival per consumer warp): on every CTA of the cluster, whose
 * producers multicast into this CTA's slot too. */
template <int kCluster>
__device__ __forceinline__ void mf__release_slot(uint64_t *bar, int lane) {
    __syncwarp();
    if (lane == 0) {
        if (kCluster == 1) mf__mbar_arrive(bar);
        else
#pragma unroll
            for (int c = 0; c < kCluster; c++) mf__mbar_arrive_cluster(bar, (uint32_t)c);
    }
}

/* Weight row (of the [L * Nw, K] map) of chunk c of tile `ti`, and its 128-row scale block. */
template <int kEpi, int kChunks>
__device__ __forceinline__ int mf__weight_row(const gemm_params &p, const tile_info &ti, int c) {
    if (kEpi == kEpiPlain) return ti.e * p.n + ti.nb * kChunks * kChunkN + c * kChunkN;
    return ti.e * 2 * p.n + c * p.n + ti.nb * kChunkN; /* c = 0 gate, 1 up */
}

__device__ __forceinline__ uint32_t mf__pack_bf16x2(float lo, float hi) {
    return (uint32_t)mf__bf16_from_float(lo) | ((uint32_t)mf__bf16_from_float(hi) << 16);
}

/* Byte offset of 16-byte chunk `chunk` of row `row` in a 128-byte-row staging tile (XOR-swizzled
 * by row so that 8 rows at the same chunk hit 8 different bank groups). */
__device__ __forceinline__ int mf__epi_offset(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

/* The consumer warpgroup's copy of its 64 staged rows to global: 16 bytes per thread and row,
 * rows below `rows` only. `dst` is the tile's first row, column already applied; `ld` its row pitch. */
__device__ __forceinline__ void mf__epi_copy_out(const uint8_t *epi, uint8_t *dst, size_t ld, int rows, int wtid) {
#pragma unroll
    for (int i = 0; i < kWgRows * 8 / kMfWarpgroupThreads; i++) {
        int row = i * (kMfWarpgroupThreads / 8) + wtid / 8, chunk = wtid % 8;
        uint4 v = *(const uint4 *)(epi + mf__epi_offset(row, chunk));
        if (row < rows) *(uint4 *)(dst + (size_t)row * ld + chunk * 16) = v;
    }
}

/* FP8: issues the 4 wgmma of one stage (A rows of warpgroup cw, weight chunk at `b`) into `t`. */
__device__ __forceinline__ void mf__fp8_issue(float *t, const uint8_t *a, const uint8_t *b) {
    uint64_t desc_a = mf__wgmma_desc_sw128(a), desc_b = mf__wgmma_desc_sw128(b);
    mf__wgmma_fence();
#pragma unroll
    for (int k = 0; k < kKSteps; k++)
        mf__wgmma_e4m3<kChunkN>(t, desc_a + (k * kWgmmaKBytes >> 4), desc_b + (k * kWgmmaKBytes >> 4), k > 0);
    mf__wgmma_commit();
}

/* FP8 promotion of one 128-wide K block: acc += t * scale (rows r_lo: s_lo, r_lo + 8: s_hi). */
__device__ __forceinline__ void mf__fp8_promote(float *acc, const float *t, float s_lo, float s_hi) {
#pragma unroll
    for (int j = 0; j < kChunkN / 8; j++) {
        acc[4 * j + 0] += t[4 * j + 0] * s_lo;
        acc[4 * j + 1] += t[4 * j + 1] * s_lo;
        acc[4 * j + 2] += t[4 * j + 2] * s_hi;
        acc[4 * j + 3] += t[4 * j + 3] * s_hi;
    }
}

/* ---- the kernel ----------------------------------------------------------------------------------- */

template <int kFp8, int kEpi, int kChunks, int kCluster>
__global__ void __launch_bounds__(kThreads, 1) mf__sm90_gemm(const __grid_constant__ gemm_params p) {
    using SM = smem_map<kChunks>;
    static_assert(kCluster == 1 || kCluster == 2, "weight tiles are multicast to at most 2 CTAs");
    constexpr int kStages = SM::kStages;
    constexpr int kN = kChunks * kChunkN;       /* columns of the tile's accumulators */
    constexpr int kAcc = kN / 2;                /* accumulators per consumer thread */
    static_assert(kEpi == kEpiPlain || kChunks == 2, "SwiGLU tiles hold a gate and an up chunk");

    /* the ring needs 1024-byte alignment (128B swizzle atoms); pointer arithmetic on smem_raw (not
     * an integer round trip) keeps the shared address space visible to the compiler */
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = smem_raw + ((kMfSwizzleAtomBytes - (mf__smem_addr(smem_raw) & (kMfSwizzleAtomBytes - 1))) &
                                (kMfSwizzleAtomBytes - 1));
    uint8_t *ring = smem + SM::kRing;
    float *s_ascale = (float *)(smem + SM::kAScales);
    float *s_wscale = (float *)(smem + SM::kWScales);
    uint64_t *full = (uint64_t *)(smem + SM::kFull);
    uint64_t *empty = (uint64_t *)(smem + SM::kEmpty);
    int32_t *s_prefix = (int32_t *)(smem + SM::kPrefix);
    int32_t *s_cnt = (int32_t *)(smem + SM::kCounts);
    int32_t *s_off = (int32_t *)(smem + SM::kOffsets);

    const int tid = threadIdx.x;
    const int warp = mf__warp_id();
    const int lane = tid % 32;
    const int wg = mf__warpgroup_id();
    const int L = p.num_experts;
    const int num_kb = p.k / (kRowBytes / (kFp8 ? 1 : 2));
    const int nblocks = kEpi == kEpiPlain ? p.n / kN : p.n / kChunkN;
    const int kblocks_scale = p.k / kScaleBlock; /* FP8 scale columns */
    const int rank = kCluster > 1 ? (int)mf__cluster_ctarank() : 0;
    const int unit0 = blockIdx.x / kCluster, units_step = gridDim.x / kCluster;

    /* Phase 0: barriers, then the per-expert m-block prefix (all threads). */
    if (tid == 0) {
        for (int s = 0; s < kStages; s++) {
            mf__mbar_init(&full[s], kFp8 ? 1 + kScaleArrivals : 1);
            mf__mbar_init(&empty[s], kEmptyArrivals * kCluster);
        }
        mf__fence_mbarrier_init();
    }
    if (tid == 32) {
        mf__prefetch_tensormap(&p.map_a);
        mf__prefetch_tensormap(&p.map_w);
    }
    for (int e = tid; e < L; e += kThreads) {
        int c = max(p.counts[e], 0);
        s_cnt[e] = c;
        s_off[e] = p.offsets[e];
        s_prefix[e + 1] = (c + kBlockM * kCluster - 1) / (kBlockM * kCluster);
    }
    if (tid == 0) s_prefix[0] = 0;
    __syncthreads();
    if (warp == 0) {
        int per = (L + 31) / 32, b = lane * per, end = min(b + per, L), sum = 0;
        for (int i = b; i < end; i++) sum += s_prefix[i + 1];
        int incl = sum;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        int run = incl - sum;
        for (int i = b; i < end; i++) {
            run += s_prefix[i + 1];
            s_prefix[i + 1] = run;
        }
    }
    __syncthreads();
    if (kCluster > 1) mf__cluster_sync(); /* the peer's barriers are initialised before any multicast */

    if (wg == 0) {
        /* ---- producer warpgroup ---- */
        mf__setmaxnreg_dec<kProducerRegs>();
        /* (derived after setmaxnreg: a value live across it may be spilled) */
        const int num_tiles = s_prefix[L] * nblocks;
        if (warp == 0) {
            if (mf__elect_one()) {
                int s = 0, e = 0;
                uint32_t phase = 0;
                for (int t = unit0; t < num_tiles; t += units_step) {
                    tile_info ti = mf__tile_at<kCluster>(t, nblocks, s_prefix, s_cnt, s_off, rank, e);
                    int wrow[kChunks];
#pragma unroll
                    for (int c = 0; c < kChunks; c++) wrow[c] = mf__weight_row<kEpi, kChunks>(p, ti, c);
                    /* cluster: this CTA loads its share of the weight tile (chunk `rank`, or half of
                     * the one chunk) and multicasts it into both CTAs' slot s */
                    const int share_row = kChunks == 2 ? mf__weight_row<kEpi, kChunks>(p, ti, rank)
                                                       : wrow[0] + rank * (kChunkN / 2);
                    const int share_off = kTileABytes + rank * (kChunks == 2 ? kChunkBBytes : kChunkBBytes / 2);
                    for (int kb = 0; kb < num_kb; kb++) {
                        mf__mbar_wait_tag(&empty[s], phase ^ 1, 1);
                        uint8_t *sa = ring + s * SM::kStageBytes;
                        int kcoord = kb * (kRowBytes / (kFp8 ? 1 : 2));
                        mf__mbar_arrive_expect_tx(&full[s], SM::kStageBytes);
                        mf__tma_load_2d(sa, &p.map_a, &full[s], kcoord, ti.row0);
                        if (kCluster == 1) {
#pragma unroll
                            for (int c = 0; c < kChunks; c++)
                                mf__tma_load_2d(sa + kTileABytes + c * kChunkBBytes, &p.map_w, &full[s], kcoord, wrow[c]);
                        } else {
                            mf__tma_load_2d_multicast(sa + share_off, &p.map_w, &full[s], kcoord, share_row,
                                                      (uint16_t)((1u << kCluster) - 1));
                        }
                        if (++s == kStages) {
                            s = 0;
                            phase ^= 1;
                        }
                    }
                }
            }
        } else if (kFp8 && warp == 1) {
            /* the scales of each stage: 128 a_scales (rows below counts only), kChunks w_scales */
            int s = 0, e = 0;
            uint32_t phase = 0;
            for (int t = unit0; t < num_tiles; t += units_step) {
                tile_info ti = mf__tile_at<kCluster>(t, nblocks, s_prefix, s_cnt, s_off, rank, e);
                /* weight rows are global rows of [L * Nw, K]: row / 128 is the global scale row */
                const float *wsrc = NULL;
                if (lane < kChunks)
                    wsrc = p.w_scales + (size_t)(mf__weight_row<kEpi, kChunks>(p, ti, lane) / kChunkN) * kblocks_scale;
                for (int kb = 0; kb < num_kb; kb++) {
                    mf__mbar_wait_tag(&empty[s], phase ^ 1, 2);
#pragma unroll
                    for (int i = 0; i < kBlockM / 32; i++) {
                        int r = i * 32 + lane;
                        if (r < ti.rows)
                            mf__cp_async_4(&s_ascale[s * kBlockM + r], p.a_scales + (size_t)(ti.row0 + r) * kblocks_scale + kb);
                    }
                    if (lane < kChunks) mf__cp_async_4(&s_wscale[s * kWScalesPerStage + lane], wsrc + kb);
                    mf__cp_async_mbar_arrive_noinc(&full[s]);
                    if (++s == kStages) {
                        s = 0;
                        phase ^= 1;
                    }
                }
            }
        }
        __syncwarp();
    } else {
        /* ---- consumer warpgroups ---- */
        mf__setmaxnreg_inc<kConsumerRegs>();
        const int num_tiles = s_prefix[L] * nblocks;
        const int cw = wg - 1;                 /* 0: tile rows [0, 64), 1: [64, 128) */
        const int wtid = tid % kMfWarpgroupThreads;
        const int wq = warp % 4;               /* warp within the warpgroup */
        const int r_lo = cw * kWgRows + wq * 16 + lane / 4; /* tile row of acc[4j + 0, 1]; +8 for 4j + 2, 3 */
        uint8_t *epi = smem + SM::kEpi + cw * kEpiBytes;

        float acc[kAcc];
        constexpr int kTmp = kFp8 ? kChunkN / 2 : 1;
        constexpr int kTmp2 = kFp8 && kChunks == 1 ? kChunkN / 2 : 1; /* second buffer: 128-column tiles */
        float tmp[kTmp], tmp2[kTmp2];
#pragma unroll
        for (int i = 0; i < kTmp; i++) tmp[i] = 0.0f;
#pragma unroll
        for (int i = 0; i < kTmp2; i++) tmp2[i] = 0.0f;

        int s = 0, e = 0;
        uint32_t phase = 0;
        for (int t = unit0; t < num_tiles; t += units_step) {
            tile_info ti = mf__tile_at<kCluster>(t, nblocks, s_prefix, s_cnt, s_off, rank, e);
#pragma unroll
            for (int i = 0; i < kAcc; i++) acc[i] = 0.0f;

            if (kFp8 && kChunks == 1) {
                /* Two temporaries: block kb + 1's wgmma run while block kb is promoted. A block in
                 * flight is (tmp | tmp2, its slot, its scales, read when it was issued); a slot is
                 * released once its wgmma group has completed. */
                const int a_off = cw * kWgRows * kRowBytes;
                int slot_a = 0, slot_b = 0;
                float sa_lo = 0.0f, sa_hi = 0.0f, sb_lo = 0.0f, sb_hi = 0.0f;
#define MF__FP8_ISSUE(T, SLOT, S_LO, S_HI)                                                               \
    do {                                                                                                \
        mf__mbar_wait_tag(&full[s], phase, 3);                                                          \
        float sw_ = s_wscale[s * kWScalesPerStage];                                                     \
        S_LO = s_ascale[s * kBlockM + r_lo] * sw_;                                                      \
        S_HI = s_ascale[s * kBlockM + r_lo + 8] * sw_;                                                  \
        SLOT = s;                                                                                       \
        mf__fp8_issue(T, ring + s * SM::kStageBytes + a_off, ring + s * SM::kStageBytes + kTileABytes); \
        if (++s == kStages) {                                                                           \
            s = 0;                                                                                      \
            phase ^= 1;                                                                                 \
        }                                                                                               \
    } while (0)
#define MF__FP8_RETIRE(T, SLOT, S_LO, S_HI)                  \
    do {                                                    \
        mf__fence_fragment<kChunkN>(T);                     \
        mf__release_slot<kCluster>(&empty[SLOT], lane);     \
        mf__fp8_promote(acc, T, S_LO, S_HI);                \
    } while (0)
                MF__FP8_ISSUE(tmp, slot_a, sa_lo, sa_hi); /* block 0 */
                int kb = 0;
                for (; kb + 2 < num_kb; kb += 2) { /* steady state: blocks kb (tmp, in flight), kb + 1, kb + 2 */
                    MF__FP8_ISSUE(tmp2, slot_b, sb_lo, sb_hi);
                    mf__wgmma_wait<1>();
                    MF__FP8_RETIRE(tmp, slot_a, sa_lo, sa_hi);
                    MF__FP8_ISSUE(tmp, slot_a, sa_lo, sa_hi);
                    mf__wgmma_wait<1>();
                    MF__FP8_RETIRE(tmp2, slot_b, sb_lo, sb_hi);
                }
                if (kb + 1 < num_kb) { /* two blocks left: kb in flight, kb + 1 */
                    MF__FP8_ISSUE(tmp2, slot_b, sb_lo, sb_hi);
                    mf__wgmma_wait<1>();
                    MF__FP8_RETIRE(tmp, slot_a, sa_lo, sa_hi);
                    mf__wgmma_wait<0>();
                    MF__FP8_RETIRE(tmp2, slot_b, sb_lo, sb_hi);
                } else { /* one block left */
                    mf__wgmma_wait<0>();
                    MF__FP8_RETIRE(tmp, slot_a, sa_lo, sa_hi);
                }
#undef MF__FP8_ISSUE
#undef MF__FP8_RETIRE
            } else if (kFp8) {
                for (int kb = 0; kb < num_kb; kb++) {
                    mf__mbar_wait_tag(&full[s], phase, 3);
                    const uint8_t *sa = ring + s * SM::kStageBytes;
                    float sa_lo = s_ascale[s * kBlockM + r_lo], sa_hi = s_ascale[s * kBlockM + r_lo + 8];
#pragma unroll
                    for (int c = 0; c < kChunks; c++) {
                        mf__fp8_issue(tmp, sa + cw * kWgRows * kRowBytes, sa + kTileABytes + c * kChunkBBytes);
                        mf__wgmma_wait<0>();
                        mf__fence_fragment<kChunkN>(tmp);
                        float sw = s_wscale[s * kWScalesPerStage + c];
                        if (c == kChunks - 1) mf__release_slot<kCluster>(&empty[s], lane);
                        mf__fp8_promote(acc + c * (kChunkN / 2), tmp, sa_lo * sw, sa_hi * sw);
                    }
                    if (++s == kStages) {
                        s = 0;
                        phase ^= 1;
                    }
                }
            } else {
                int prev = -1;
                for (int kb = 0; kb < num_kb; kb++) {
                    mf__mbar_wait_tag(&full[s], phase, 4);
                    const uint8_t *sa = ring + s * SM::kStageBytes;
                    uint64_t desc_a = mf__wgmma_desc_sw128(sa + cw * kWgRows * kRowBytes);
                    uint64_t desc_b = mf__wgmma_desc_sw128(sa + kTileABytes);
                    mf__wgmma_fence();
#pragma unroll
                    for (int k = 0; k < kKSteps; k++)
                        mf__wgmma_bf16<kN>(acc, desc_a + (k * kWgmmaKBytes >> 4), desc_b + (k * kWgmmaKBytes >> 4), 1);
                    mf__wgmma_commit();
                    mf__wgmma_wait<1>();
                    if (prev >= 0) mf__release_slot<kCluster>(&empty[prev], lane);
                    prev = s;
                    if (++s == kStages) {
                        s = 0;
                        phase ^= 1;
                    }
                }
                mf__wgmma_wait<0>();
                if (prev >= 0) mf__release_slot<kCluster>(&empty[prev], lane);
                mf__fence_fragment<kN>(acc);
            }

            /* ---- epilogue ---- */
            const int rows_wg = ti.rows - cw * kWgRows; /* valid rows of this warpgroup (may be <= 0) */
            const int named = kBarEpiBase + cw;
            if (kEpi == kEpiPlain || kEpi == kEpiSwigluBf16) {
                if (kEpi == kEpiSwigluBf16) {
#pragma unroll
                    for (int i = 0; i < kChunkN / 2; i++) acc[i] = mf__silu(acc[i]) * acc[kChunkN / 2 + i];
                }
                constexpr int kOutCols = kEpi == kEpiPlain ? kN : kChunkN;
                const size_t ld = (size_t)p.n * 2;
                uint8_t *dst = p.out + (size_t)(ti.row0 + cw * kWgRows) * ld + (size_t)ti.nb * kOutCols * 2;
#pragma unroll
                for (int pass = 0; pass < kOutCols / 64; pass++) {
#pragma unroll
                    for (int jj = 0; jj < 8; jj += 2) {
                        int j = pass * 8 + jj;
                        int mi = lane / 8;
                        int row = wq * 16 + (mi & 1) * 8 + (lane & 7);
                        int chunk = jj + (mi >> 1);
                        mf__stmatrix_x4(epi + mf__epi_offset(row, chunk), mf__pack_bf16x2(acc[4 * j + 0], acc[4 * j + 1]),
                                        mf__pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]),
                                        mf__pack_bf16x2(acc[4 * j + 4], acc[4 * j + 5]),
                                        mf__pack_bf16x2(acc[4 * j + 6], acc[4 * j + 7]));
                    }
                    mf__named_barrier_sync(named, kMfWarpgroupThreads);
                    mf__epi_copy_out(epi, dst + pass * 128, ld, rows_wg, wtid);
                    mf__named_barrier_sync(named, kMfWarpgroupThreads);
                }
            } else {
                /* SwiGLU -> FP8 1x128: this tile's 128 h columns are exactly one scale block */
                float amax_lo = 0.0f, amax_hi = 0.0f;
#pragma unroll
                for (int j = 0; j < kChunkN / 8; j++) {
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        float h = mf__silu(acc[4 * j + i]) * acc[kChunkN / 2 + 4 * j + i];
                        acc[4 * j + i] = h;
                        if (i < 2) amax_lo = fmaxf(amax_lo, fabsf(h));
                        else amax_hi = fmaxf(amax_hi, fabsf(h));
                    }
                }
#pragma unroll
                for (int o = 1; o < 4; o <<= 1) {
                    amax_lo = fmaxf(amax_lo, __shfl_xor_sync(0xffffffffu, amax_lo, o));
                    amax_hi = fmaxf(amax_hi, __shfl_xor_sync(0xffffffffu, amax_hi, o));
                }
                float sc_lo, inv_lo, sc_hi, inv_hi;
                mf__fp8_block_scale(amax_lo, p.ue8m0, &sc_lo, &inv_lo);
                mf__fp8_block_scale(amax_hi, p.ue8m0, &sc_hi, &inv_hi);
                const int row = wq * 16 + lane / 4, q = lane % 4;
#pragma unroll
                for (int j = 0; j < kChunkN / 8; j++) {
                    uint16_t lo = (uint16_t)(mf__fp8_from_float(acc[4 * j + 0] * inv_lo) |
                                             (mf__fp8_from_float(acc[4 * j + 1] * inv_lo) << 8));
                    uint16_t hi = (uint16_t)(mf__fp8_from_float(acc[4 * j + 2] * inv_hi) |
                                             (mf__fp8_from_float(acc[4 * j + 3] * inv_hi) << 8));
                    int in_chunk = (j & 1) * 8 + 2 * q;
                    *(uint16_t *)(epi + mf__epi_offset(row, j >> 1) + in_chunk) = lo;
                    *(uint16_t *)(epi + mf__epi_offset(row + 8, j >> 1) + in_chunk) = hi;
                }
                if (q == 0) {
                    const int sblocks = p.n / kChunkN;
                    if (row < rows_wg) p.out_scales[(size_t)(ti.row0 + cw * kWgRows + row) * sblocks + ti.nb] = sc_lo;
                    if (row + 8 < rows_wg) p.out_scales[(size_t)(ti.row0 + cw * kWgRows + row + 8) * sblocks + ti.nb] = sc_hi;
                }
                mf__named_barrier_sync(named, kMfWarpgroupThreads);
                const size_t ld = (size_t)p.n;
                mf__epi_copy_out(epi, p.out + (size_t)(ti.row0 + cw * kWgRows) * ld + (size_t)ti.nb * kChunkN, ld, rows_wg, wtid);
                mf__named_barrier_sync(named, kMfWarpgroupThreads);
            }
        }
    }
    /* cluster: no CTA leaves while its peer may still arrive on its barriers */
    if (kCluster > 1) mf__cluster_sync();
}

/* ---- selftest kernel: one 64 x 64 x K tile, TMA -> smem -> wgmma -> fragment store ------------- */

/* a [64, K] and b [64, K] (K = 128 bytes: 128 e4m3 or 64 bf16), out fp32 [64, 64] row-major. */
struct selftest_params {
    CUtensorMap map_a, map_b;
    float *out;
};

template <int kFp8>
__global__ void __launch_bounds__(kMfWarpgroupThreads, 1) mf__sm90_selftest(const __grid_constant__ selftest_params p) {
    __shared__ __align__(1024) uint8_t s_a[64 * kRowBytes];
    __shared__ __align__(1024) uint8_t s_b[64 * kRowBytes];
    __shared__ uint64_t bar;
    if (threadIdx.x == 0) {
        mf__mbar_init(&bar, 1);
        mf__fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mf__mbar_arrive_expect_tx(&bar, 2 * 64 * kRowBytes);
        mf__tma_load_2d(s_a, &p.map_a, &bar, 0, 0);
        mf__tma_load_2d(s_b, &p.map_b, &bar, 0, 0);
    }
    mf__mbar_wait_tag(&bar, 0, 9);
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; i++) d[i] = 0.0f;
    uint64_t da = mf__wgmma_desc_sw128(s_a), db = mf__wgmma_desc_sw128(s_b);
    mf__wgmma_fence();
#pragma unroll
    for (int k = 0; k < kKSteps; k++) {
        if (kFp8) mf__wgmma_e4m3<64>(d, da + (k * kWgmmaKBytes >> 4), db + (k * kWgmmaKBytes >> 4), k > 0);
        else mf__wgmma_bf16<64>(d, da + (k * kWgmmaKBytes >> 4), db + (k * kWgmmaKBytes >> 4), k > 0);
    }
    mf__wgmma_commit();
    mf__wgmma_wait<0>();
    mf__fence_fragment<64>(d);
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        int r = 16 * w + l / 4, c = 8 * j + 2 * (l % 4);
        p.out[r * 64 + c] = d[4 * j + 0];
        p.out[r * 64 + c + 1] = d[4 * j + 1];
        p.out[(r + 8) * 64 + c] = d[4 * j + 2];
        p.out[(r + 8) * 64 + c + 1] = d[4 * j + 3];
    }
}

/* ====================================================================================================
 * Host side
 * ==================================================================================================== */

static const char *g_case = "(setup)";
static mf__sm90_fault_t *g_fault = NULL;
static int g_failures = 0;

static void report_fault(void) {
    if (g_fault && g_fault->magic == kMfSm90FaultMagic)
        fprintf(stderr, "  device wait timed out: block %u thread %u smem 0x%x parity %u site %u (%s)\n", g_fault->block,
                g_fault->thread, g_fault->smem, g_fault->parity, g_fault->tag,
                g_fault->tag == 1   ? "producer: empty slot"
                : g_fault->tag == 2 ? "scale warp: empty slot"
                : g_fault->tag == 3 ? "FP8 consumer: full slot (TMA bytes or scale arrivals missing)"
                : g_fault->tag == 4 ? "BF16 consumer: full slot (TMA bytes missing)"
                                    : "selftest");
}

#define CUDA_OK(call)                                                                                     \
    do {                                                                                                  \
        cudaError_t e_ = (call);                                                                          \
        if (e_ != cudaSuccess) {                                                                          \
            fprintf(stderr, "%s:%d: case %s: %s failed: %s\n", __FILE__, __LINE__, g_case, #call,          \
                    cudaGetErrorString(e_));                                                              \
            report_fault();                                                                               \
            exit(2);                                                                                      \
        }                                                                                                 \
    } while (0)

#define CU_OK(call)                                                                                       \
    do {                                                                                                  \
        CUresult r_ = (call);                                                                             \
        if (r_ != CUDA_SUCCESS) {                                                                         \
            fprintf(stderr, "%s:%d: case %s: %s failed: CUresult %d\n", __FILE__, __LINE__, g_case, #call, \
                    (int)r_);                                                                             \
            exit(2);                                                                                      \
        }                                                                                                 \
    } while (0)

static const double kDiffMaxBf16 = 1e-5;
static const double kDiffMaxFp8 = 1e-3;
static const int kWarmupRuns = 3;
static const int kTimedRuns = 20;
static const size_t kFlushBytes = 512ull << 20;

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rnd_unit(void) { return (double)(rnd_u64() >> 11) * (1.0 / 9007199254740992.0); }

/* A random E4M3 code, |x| in [2^-6, 2^3) or so, never zero or NaN. */
static uint8_t rnd_fp8(void) {
    for (;;) {
        uint8_t c = (uint8_t)rnd_u64();
        uint32_t ex = (c >> 3) & 0xf;
        if (ex >= 1 && ex <= 10) return c;
    }
}

static uint16_t rnd_bf16(void) {
    float v = (float)(2.0 * rnd_unit() - 1.0);
    if (v == 0.0f) v = 0.5f;
    return mf__bf16_from_float(v);
}

/* An FP8 scale in [2^-8, 2^-4). */
static float rnd_scale(void) { return exp2f((float)(-8.0 + 4.0 * rnd_unit())); }

template <typename T>
static T *dev_alloc(size_t n) {
    T *d = NULL;
    CUDA_OK(cudaMalloc((void **)&d, std::max<size_t>(n, 1) * sizeof(T)));
    return d;
}

static int num_sms(void) {
    int dev = 0, n = 0;
    CUDA_OK(cudaGetDevice(&dev));
    CUDA_OK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
}

/* ---- the launcher ---------------------------------------------------------------------------------- */

/* One GEMM on the device: what mf__sm90_gemm needs, all device pointers. */
struct gemm_args {
    int fp8, epi, chunks;
    int cluster;                /* 1, or 2: weight tiles multicast to a pair of CTAs */
    int L, n, k;                /* n: plain N, swiglu I */
    int64_t rows;               /* receive rows of a (for the tensor map) */
    int max_rows;               /* bound on counts (for the grid) */
    const int32_t *counts, *offsets;
    const uint8_t *a, *w;
    const float *a_scales, *w_scales;
    uint8_t *out;
    float *out_scales;
    int ue8m0;
};

/* Launches one variant on a persistent grid: one CTA per SM (clusters: as many pairs as can be
 * resident at once), at most one per unit of work. */
template <int kFp8, int kEpi, int kChunks, int kCluster>
static void launch_variant(const gemm_params &p, int64_t max_units, cudaStream_t st) {
    auto kern = mf__sm90_gemm<kFp8, kEpi, kChunks, kCluster>;
    constexpr int kBytes = smem_map<kChunks>::kBytes;
    static int resident = 0; /* CTAs resident at once */
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1] = {};
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kCluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = kBytes;
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (!resident) {
        CUDA_OK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
        if (kCluster > 1) {
            CUDA_OK(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 0));
            int clusters = 0;
            cfg.gridDim = dim3(num_sms() / kCluster * kCluster, 1, 1);
            CUDA_OK(cudaOccupancyMaxActiveClusters(&clusters, kern, &cfg));
            resident = clusters * kCluster;
        } else {
            resident = num_sms();
        }
        if (resident < kCluster) {
            fprintf(stderr, "case %s: no resident CTA for this variant\n", g_case);
            exit(2);
        }
    }
    int64_t grid = std::min<int64_t>(resident, std::max<int64_t>(1, max_units) * kCluster);
    cfg.gridDim = dim3((unsigned)grid, 1, 1);
    CUDA_OK(cudaLaunchKernelEx(&cfg, kern, p));
}

static void gemm_launch(const gemm_args &g, cudaStream_t st) {
    int nw = g.epi == kEpiPlain ? g.n : 2 * g.n;
    int esize = g.fp8 ? 1 : 2;
    if (g.L > kMaxExperts || g.k % kScaleBlock || g.n % (g.epi == kEpiPlain ? g.chunks * kChunkN : kChunkN) ||
        (g.epi != kEpiPlain && g.chunks != 2) || (g.cluster != 1 && g.cluster != 2) ||
        (!g.fp8 && g.epi == kEpiSwigluFp8)) {
        fprintf(stderr, "case %s: unsupported shape L=%d n=%d k=%d chunks=%d cluster=%d\n", g_case, g.L, g.n, g.k,
                g.chunks, g.cluster);
        exit(2);
    }
    gemm_params p;
    memset(&p, 0, sizeof p);
    CUtensorMapDataType dt = g.fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    /* the weight box is one chunk, or half of it when a pair of CTAs shares one chunk */
    uint32_t w_box_rows = (g.cluster == 2 && g.chunks == 1) ? kChunkN / 2 : kChunkN;
    CU_OK(mf__tma_encode_2d(&p.map_a, dt, g.a, (uint64_t)g.k, (uint64_t)std::max<int64_t>(g.rows, 1),
                            (uint64_t)g.k * esize, kRowBytes / esize, kBlockM, CU_TENSOR_MAP_SWIZZLE_128B));
    CU_OK(mf__tma_encode_2d(&p.map_w, dt, g.w, (uint64_t)g.k, (uint64_t)g.L * nw, (uint64_t)g.k * esize,
                            kRowBytes / esize, w_box_rows, CU_TENSOR_MAP_SWIZZLE_128B));
    p.counts = g.counts;
    p.offsets = g.offsets;
    p.a_scales = g.a_scales;
    p.w_scales = g.w_scales;
    p.out = g.out;
    p.out_scales = g.out_scales;
    p.num_experts = g.L;
    p.n = g.n;
    p.k = g.k;
    p.ue8m0 = g.ue8m0;
    int nblocks = g.epi == kEpiPlain ? g.n / (g.chunks * kChunkN) : g.n / kChunkN;
    int unit_rows = kBlockM * g.cluster;
    int64_t max_units = (int64_t)g.L * ((g.max_rows + unit_rows - 1) / unit_rows) * nblocks;
#define MF__LAUNCH(fp8, epi, chunks)                                                         \
    (g.cluster == 1 ? launch_variant<fp8, epi, chunks, 1>(p, max_units, st)                  \
                    : launch_variant<fp8, epi, chunks, 2>(p, max_units, st))
    if (g.fp8) {
        if (g.epi == kEpiPlain && g.chunks == 1) MF__LAUNCH(1, kEpiPlain, 1);
        else if (g.epi == kEpiPlain) MF__LAUNCH(1, kEpiPlain, 2);
        else if (g.epi == kEpiSwigluFp8) MF__LAUNCH(1, kEpiSwigluFp8, 2);
        else MF__LAUNCH(1, kEpiSwigluBf16, 2);
    } else {
        if (g.epi == kEpiPlain && g.chunks == 1) MF__LAUNCH(0, kEpiPlain, 1);
        else if (g.epi == kEpiPlain) MF__LAUNCH(0, kEpiPlain, 2);
        else MF__LAUNCH(0, kEpiSwigluBf16, 2);
    }
#undef MF__LAUNCH
}

/* ---- selftest -------------------------------------------------------------------------------------- */

static int run_selftest(int fp8) {
    const int esize = fp8 ? 1 : 2, kel = kRowBytes / esize;
    g_case = fp8 ? "selftest fp8 64x64x128" : "selftest bf16 64x64x64";
    std::vector<uint8_t> ha(64 * kRowBytes), hb(64 * kRowBytes);
    std::vector<double> fa(64 * kel), fb(64 * kel);
    for (int i = 0; i < 64 * kel; i++) {
        if (fp8) {
            ha[i] = rnd_fp8();
            hb[i] = rnd_fp8();
            fa[i] = mf__fp8_to_float(ha[i]);
            fb[i] = mf__fp8_to_float(hb[i]);
        } else {
            uint16_t x = rnd_bf16(), y = rnd_bf16();
            memcpy(&ha[2 * i], &x, 2);
            memcpy(&hb[2 * i], &y, 2);
            fa[i] = mf__bf16_to_float(x);
            fb[i] = mf__bf16_to_float(y);
        }
    }
    std::vector<double> ref(64 * 64);
    for (int r = 0; r < 64; r++)
        for (int c = 0; c < 64; c++) {
            double s = 0;
            for (int k = 0; k < kel; k++) s += fa[r * kel + k] * fb[c * kel + k];
            ref[r * 64 + c] = s;
        }
    uint8_t *da = dev_alloc<uint8_t>(ha.size()), *db = dev_alloc<uint8_t>(hb.size());
    float *dout = dev_alloc<float>(64 * 64);
    CUDA_OK(cudaMemcpy(da, ha.data(), ha.size(), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(db, hb.data(), hb.size(), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(dout, 0xFF, 64 * 64 * 4));
    selftest_params p;
    memset(&p, 0, sizeof p);
    CUtensorMapDataType dt = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    CU_OK(mf__tma_encode_2d(&p.map_a, dt, da, kel, 64, kRowBytes, kel, 64, CU_TENSOR_MAP_SWIZZLE_128B));
    CU_OK(mf__tma_encode_2d(&p.map_b, dt, db, kel, 64, kRowBytes, kel, 64, CU_TENSOR_MAP_SWIZZLE_128B));
    p.out = dout;
    if (fp8) mf__sm90_selftest<1><<<1, kMfWarpgroupThreads>>>(p);
    else mf__sm90_selftest<0><<<1, kMfWarpgroupThreads>>>(p);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> got(64 * 64);
    CUDA_OK(cudaMemcpy(got.data(), dout, got.size() * 4, cudaMemcpyDeviceToHost));
    int bad = 0, first = -1;
    for (int i = 0; i < 64 * 64; i++) {
        double tol = 1e-4 * (fabs(ref[i]) + 1.0);
        if (!(fabs(got[i] - ref[i]) <= tol)) {
            if (first < 0) first = i;
            bad++;
        }
    }
    if (bad) {
        int r = first / 64, c = first % 64;
        printf("FAIL %-28s %d of 4096 wrong; first at (row %d, col %d): expected %.6g, got %.6g\n", g_case, bad, r, c,
               ref[first], (double)got[first]);
        /* Where does the wrong value come from? A permutation names the layout bug. */
        for (int i = 0; i < 64 * 64; i++)
            if (fabs(got[first] - ref[i]) <= 1e-4 * (fabs(ref[i]) + 1.0)) {
                printf("     got(%d,%d) equals expected(%d,%d)\n", r, c, i / 64, i % 64);
                break;
            }
        for (int k = 0; k < 4 && k < bad; k++) {
            int n = 0;
            for (int i = 0; i < 64 * 64; i++)
                if (!(fabs(got[i] - ref[i]) <= 1e-4 * (fabs(ref[i]) + 1.0)) && n++ == k)
                    printf("     (row %d, col %d): expected %.6g got %.6g\n", i / 64, i % 64, ref[i], (double)got[i]);
        }
        g_failures++;
    } else {
        printf("PASS %-28s 4096 of 4096 within 1e-4 relative\n", g_case);
    }
    CUDA_OK(cudaFree(da));
    CUDA_OK(cudaFree(db));
    CUDA_OK(cudaFree(dout));
    return bad == 0;
}

/* ---- validation ------------------------------------------------------------------------------------ */

struct vcase {
    const char *name;
    int fp8, epi, chunks;
    int n, k;                 /* plain: N; swiglu: I */
    std::vector<int> counts;
    int capacity;             /* 0: EXPERT_MAJOR, else MASKED with C = capacity */
    int ue8m0;
};

static void parallel_for(int n, const std::function<void(int)> &f) {
    int nt = (int)std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
    std::vector<std::thread> th;
    for (int t = 0; t < nt; t++)
        th.emplace_back([&, t]() {
            for (int i = t; i < n; i += nt) f(i);
        });
    for (auto &x : th) x.join();
}

static void run_case(const vcase &c) {
    g_case = c.name;
    const int L = (int)c.counts.size(), K = c.k, nw = c.epi == kEpiPlain ? c.n : 2 * c.n;
    const int esize = c.fp8 ? 1 : 2, kb_n = K / kScaleBlock;
    std::vector<int32_t> offsets(L);
    int64_t at = 0;
    int max_rows = 0;
    for (int e = 0; e < L; e++) {
        if (c.capacity) at = (int64_t)e * c.capacity;
        else at = (at + kBlockM - 1) / kBlockM * kBlockM;
        offsets[e] = (int32_t)at;
        at += c.capacity ? c.capacity : c.counts[e];
        max_rows = std::max(max_rows, c.capacity ? c.capacity : c.counts[e]);
    }
    const int64_t rows = at; /* EXPERT_MAJOR: ends right after the last expert's last row */
    std::vector<int> owner((size_t)rows, -1);
    for (int e = 0; e < L; e++)
        for (int j = 0; j < c.counts[e]; j++) owner[(size_t)offsets[e] + j] = e;

    /* inputs: rows no expert owns hold NaN bytes and NaN scales */
    std::vector<uint8_t> a((size_t)rows * K * esize), w((size_t)L * nw * K * esize);
    std::vector<float> as((size_t)rows * kb_n), ws((size_t)L * (nw / kChunkN) * kb_n);
    for (int64_t r = 0; r < rows; r++) {
        bool live = owner[(size_t)r] >= 0;
        for (int k = 0; k < K; k++) {
            if (c.fp8) a[(size_t)r * K + k] = live ? rnd_fp8() : 0xFF;
            else {
                uint16_t v = live ? rnd_bf16() : 0xFFFF;
                memcpy(&a[((size_t)r * K + k) * 2], &v, 2);
            }
        }
        for (int b = 0; b < kb_n; b++) as[(size_t)r * kb_n + b] = live ? rnd_scale() : NAN;
    }
    for (size_t i = 0; i < (size_t)L * nw * K; i++) {
        if (c.fp8) w[i] = rnd_fp8();
        else {
            uint16_t v = rnd_bf16();
            memcpy(&w[i * 2], &v, 2);
        }
    }
    for (auto &x : ws) x = rnd_scale();

    /* device */
    uint8_t *d_a = dev_alloc<uint8_t>(a.size()), *d_w = dev_alloc<uint8_t>(w.size());
    float *d_as = dev_alloc<float>(as.size()), *d_ws = dev_alloc<float>(ws.size());
    int32_t *d_cnt = dev_alloc<int32_t>(L), *d_off = dev_alloc<int32_t>(L);
    const int out_cols = c.n, out_esize = c.epi == kEpiSwigluFp8 ? 1 : 2;
    const size_t out_bytes = (size_t)rows * out_cols * out_esize, sc_n = (size_t)rows * (c.n / kChunkN);
    uint8_t *d_out = dev_alloc<uint8_t>(out_bytes);
    float *d_osc = dev_alloc<float>(sc_n);
    CUDA_OK(cudaMemcpy(d_a, a.data(), a.size(), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_w, w.data(), w.size(), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_as, as.data(), as.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_ws, ws.data(), ws.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_cnt, c.counts.data(), L * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_off, offsets.data(), L * 4, cudaMemcpyHostToDevice));

    /* CPU reference: per row, per weight row, per 128-wide K block (FP8: partial * (sa * sw) in fp32
     * scale, fp64 sums); then the epilogue. Values compared: ref vs got as doubles. */
    std::vector<float> f8(256);
    for (int i = 0; i < 256; i++) f8[i] = mf__fp8_to_float((uint8_t)i);
    std::vector<double> ref((size_t)rows * out_cols, 0.0), got((size_t)rows * out_cols, 0.0);
    std::vector<double> amax_ref((size_t)rows * (c.n / kChunkN), 0.0);
    parallel_for((int)rows, [&](int r) {
        int e = owner[(size_t)r];
        if (e < 0) return;
        std::vector<double> accv(nw);
        std::vector<double> arow(K);
        for (int k = 0; k < K; k++) {
            if (c.fp8) arow[k] = f8[a[(size_t)r * K + k]];
            else {
                uint16_t v;
                memcpy(&v, &a[((size_t)r * K + k) * 2], 2);
                arow[k] = mf__bf16_to_float(v);
            }
        }
        for (int n = 0; n < nw; n++) {
            size_t wr = (size_t)e * nw + n;
            double acc = 0;
            for (int b = 0; b < (c.fp8 ? kb_n : 1); b++) {
                int k0 = c.fp8 ? b * kScaleBlock : 0, k1 = c.fp8 ? k0 + kScaleBlock : K;
                double part = 0;
                if (c.fp8) {
                    const uint8_t *wp = &w[wr * K];
                    for (int k = k0; k < k1; k++) part += arow[k] * f8[wp[k]];
                    float s = as[(size_t)r * kb_n + b] * ws[((size_t)e * (nw / kChunkN) + n / kChunkN) * kb_n + b];
                    acc += part * (double)s;
                } else {
                    for (int k = k0; k < k1; k++) {
                        uint16_t v;
                        memcpy(&v, &w[(wr * K + k) * 2], 2);
                        part += arow[k] * mf__bf16_to_float(v);
                    }
                    acc += part;
                }
            }
            accv[n] = acc;
        }
        if (c.epi == kEpiPlain) {
            for (int n = 0; n < c.n; n++) ref[(size_t)r * out_cols + n] = accv[n];
        } else {
            std::vector<float> h(c.n);
            for (int n = 0; n < c.n; n++) h[n] = mf__silu((float)accv[n]) * (float)accv[c.n + n];
            if (c.epi == kEpiSwigluBf16) {
                for (int n = 0; n < c.n; n++) ref[(size_t)r * out_cols + n] = h[n];
            } else {
                for (int b = 0; b < c.n / kChunkN; b++) {
                    float amax = 0, sc, inv;
                    for (int n = b * kChunkN; n < (b + 1) * kChunkN; n++) amax = fmaxf(amax, fabsf(h[n]));
                    mf__fp8_block_scale(amax, c.ue8m0, &sc, &inv);
                    amax_ref[(size_t)r * (c.n / kChunkN) + b] = amax;
                    for (int n = b * kChunkN; n < (b + 1) * kChunkN; n++)
                        ref[(size_t)r * out_cols + n] = (double)mf__fp8_to_float(mf__fp8_from_float(h[n] * inv)) * sc;
                }
            }
        }
    });

    /* element-wise bound: |got - ref| <= rtol |ref| + atol, atol a fraction of the reference's rms
     * (accumulation-order noise of near-zero outputs; FP8 wgmma accumulate with reduced precision) */
    double ref_ss = 0;
    long ref_n = 0;
    for (int64_t r = 0; r < rows; r++)
        if (owner[(size_t)r] >= 0)
            for (int n = 0; n < out_cols; n++, ref_n++) ref_ss += ref[(size_t)r * out_cols + n] * ref[(size_t)r * out_cols + n];
    const double ref_rms = ref_n ? sqrt(ref_ss / (double)ref_n) : 0.0;
    const double atol = (c.fp8 ? 1e-2 : 2e-3) * ref_rms;

    /* each variant: run twice (bitwise repeat), compare with the reference */
    for (int cluster = 1; cluster <= 2; cluster++) {
        char label[160];
        snprintf(label, sizeof label, "%s cluster=%d", c.name, cluster);
        g_case = label;
        CUDA_OK(cudaMemset(d_out, 0xFF, out_bytes));
        CUDA_OK(cudaMemset(d_osc, 0xFF, sc_n * 4));

        gemm_args g;
        memset(&g, 0, sizeof g);
        g.fp8 = c.fp8;
        g.epi = c.epi;
        g.chunks = c.chunks;
        g.L = L;
        g.n = c.n;
        g.k = K;
        g.rows = rows;
        g.max_rows = max_rows;
        g.counts = d_cnt;
        g.offsets = d_off;
        g.a = d_a;
        g.w = d_w;
        g.a_scales = c.fp8 ? d_as : NULL;
        g.w_scales = c.fp8 ? d_ws : NULL;
        g.out = d_out;
        g.out_scales = d_osc;
        g.ue8m0 = c.ue8m0;
        g.cluster = cluster;
        gemm_launch(g, 0);
        CUDA_OK(cudaDeviceSynchronize());
        std::vector<uint8_t> out(out_bytes);
        std::vector<float> osc(sc_n);
        CUDA_OK(cudaMemcpy(out.data(), d_out, out_bytes, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(osc.data(), d_osc, sc_n * 4, cudaMemcpyDeviceToHost));

        /* A second run must be bitwise identical (no races, deterministic order). */
        CUDA_OK(cudaMemset(d_out, 0xFF, out_bytes));
        gemm_launch(g, 0);
        CUDA_OK(cudaDeviceSynchronize());
        std::vector<uint8_t> out2(out_bytes);
        CUDA_OK(cudaMemcpy(out2.data(), d_out, out_bytes, cudaMemcpyDeviceToHost));
        bool repeat_ok = out == out2;
        /* compare */
        double sxy = 0, sxx = 0, syy = 0, max_abs = 0;
        long wrong = 0, nan_count = 0, unwritten = 0, overwritten = 0, checked = 0;
        int printed = 0;
        for (int64_t r = 0; r < rows; r++) {
            bool live = owner[(size_t)r] >= 0;
            for (int n = 0; n < out_cols; n++) {
                size_t i = (size_t)r * out_cols + n;
                bool poison = c.epi == kEpiSwigluFp8 ? out[i] == 0xFF
                                                     : (out[2 * i] == 0xFF && out[2 * i + 1] == 0xFF);
                if (!live) {
                    if (!poison) overwritten++;
                    continue;
                }
                double x;
                if (c.epi == kEpiSwigluFp8) {
                    float sc = osc[(size_t)r * (c.n / kChunkN) + n / kChunkN];
                    x = (double)mf__fp8_to_float(out[i]) * sc;
                } else {
                    uint16_t v;
                    memcpy(&v, &out[2 * i], 2);
                    x = mf__bf16_to_float(v);
                }
                if (poison) unwritten++;
                if (x != x) {
                    nan_count++;
                    continue;
                }
                double y = ref[i];
                got[i] = x;
                sxy += x * y;
                sxx += x * x;
                syy += y * y;
                double err = fabs(x - y);
                max_abs = std::max(max_abs, err);
                double tol;
                if (c.epi == kEpiSwigluFp8) tol = 0.13 * fabs(y) + amax_ref[(size_t)r * (c.n / kChunkN) + n / kChunkN] * (1.0 / 256);
                else tol = (1.0 / 64) * fabs(y) + atol;
                checked++;
                if (err > tol) {
                    wrong++;
                    if (printed++ < 4)
                        printf("     mismatch row %lld (expert %d, row %lld of it) col %d: ref %.6g got %.6g\n", (long long)r,
                               owner[(size_t)r], (long long)(r - offsets[owner[(size_t)r]]), n, y, x);
                }
            }
        }
        /* FP8 h scales: written exactly for live rows, untouched elsewhere */
        long scale_bad = 0;
        if (c.epi == kEpiSwigluFp8)
            for (int64_t r = 0; r < rows; r++)
                for (int b = 0; b < c.n / kChunkN; b++) {
                    uint32_t bits;
                    memcpy(&bits, &osc[(size_t)r * (c.n / kChunkN) + b], 4);
                    if (owner[(size_t)r] < 0) scale_bad += bits != 0xFFFFFFFFu;
                    else if (bits == 0xFFFFFFFFu) scale_bad++;
                }
        double diff = (sxx + syy) > 0 ? 1.0 - 2.0 * sxy / (sxx + syy) : 0.0;
        double thr = c.fp8 ? kDiffMaxFp8 : kDiffMaxBf16;
        bool ok = diff < thr && wrong == 0 && nan_count == 0 && unwritten == 0 && overwritten == 0 && scale_bad == 0 &&
                  repeat_ok && checked > 0;
        int total_rows = 0;
        for (int x : c.counts) total_rows += x;
        if (!ok) g_failures++;
        printf("%s %-54s rows %6d diff %.2e max_abs %.3e wrong %ld nan %ld unwritten %ld overwritten %ld scales %ld %s\n",
               ok ? "PASS" : "FAIL", label, total_rows, diff, max_abs, wrong, nan_count, unwritten, overwritten, scale_bad,
               repeat_ok ? "repeat-identical" : "REPEAT-DIFFERS");
        fflush(stdout);
    }
    CUDA_OK(cudaFree(d_a));
    CUDA_OK(cudaFree(d_w));
    CUDA_OK(cudaFree(d_as));
    CUDA_OK(cudaFree(d_ws));
    CUDA_OK(cudaFree(d_cnt));
    CUDA_OK(cudaFree(d_off));
    CUDA_OK(cudaFree(d_out));
    CUDA_OK(cudaFree(d_osc));
}

static void run_validate(void) {
    std::vector<vcase> cases;
    const int dts[2] = {1, 0};
    for (int di = 0; di < 2; di++) {
        int fp8 = dts[di];
        for (int masked = 0; masked < 2; masked++) {
            int cap = masked ? 320 : 0;
            const char *dn = fp8 ? "fp8" : "bf16", *ln = masked ? "masked" : "expert_major";
            char buf[128];
            snprintf(buf, sizeof buf, "%s %s plain N=512 K=384 chunks=2", dn, ln);
            cases.push_back({strdup(buf), fp8, kEpiPlain, 2, 512, 384, {130, 0, 257}, cap, 0});
            snprintf(buf, sizeof buf, "%s %s plain N=384 K=384 chunks=1", dn, ln);
            cases.push_back({strdup(buf), fp8, kEpiPlain, 1, 384, 384, {130, 0, 257}, cap, 0});
            snprintf(buf, sizeof buf, "%s %s swiglu-bf16 I=256 K=384", dn, ln);
            cases.push_back({strdup(buf), fp8, kEpiSwigluBf16, 2, 256, 384, {130, 0, 257}, cap, 0});
            if (fp8) {
                snprintf(buf, sizeof buf, "%s %s swiglu-fp8 I=256 K=384", dn, ln);
                cases.push_back({strdup(buf), fp8, kEpiSwigluFp8, 2, 256, 384, {130, 0, 257}, cap, 0});
                snprintf(buf, sizeof buf, "%s %s swiglu-fp8-ue8m0 I=384 K=512", dn, ln);
                cases.push_back({strdup(buf), fp8, kEpiSwigluFp8, 2, 384, 512, {1, 64, 300, 129}, cap, 1});
            }
        }
        /* many experts, a long persistent walk (more tiles than CTAs), empty experts mixed in */
        {
            std::vector<int> cnt;
            for (int e = 0; e < 40; e++) cnt.push_back(e % 5 == 3 ? 0 : (int)(1 + (rnd_u64() % 300)));
            char buf[128];
            snprintf(buf, sizeof buf, "%s expert_major plain L=40 N=256 K=256", fp8 ? "fp8" : "bf16");
            cases.push_back({strdup(buf), fp8, kEpiPlain, 2, 256, 256, cnt, 0, 0});
            /* the 128-column tile's double-buffered FP8 loop: even and single K-block counts */
            snprintf(buf, sizeof buf, "%s expert_major plain L=40 N=256 K=512 chunks=1", fp8 ? "fp8" : "bf16");
            cases.push_back({strdup(buf), fp8, kEpiPlain, 1, 256, 512, cnt, 0, 0});
            snprintf(buf, sizeof buf, "%s masked plain N=128 K=128 chunks=1", fp8 ? "fp8" : "bf16");
            cases.push_back({strdup(buf), fp8, kEpiPlain, 1, 128, 128, {200, 7, 0, 128}, 256, 0});
        }
        /* DeepSeek-V3 shapes with small counts */
        cases.push_back({fp8 ? "fp8 expert_major W13 swiglu I=2048 H=7168" : "bf16 expert_major W13 swiglu I=2048 H=7168",
                         fp8, fp8 ? kEpiSwigluFp8 : kEpiSwigluBf16, 2, 2048, 7168, {3, 130}, 0, 0});
        cases.push_back({fp8 ? "fp8 masked W2 plain H=7168 I=2048" : "bf16 masked W2 plain H=7168 I=2048", fp8,
                         kEpiPlain, 2, 7168, 2048, {5, 200, 0}, 256, 0});
        cases.push_back({fp8 ? "fp8 masked W2 plain H=7168 I=2048 chunks=1" : "bf16 masked W2 plain H=7168 I=2048 chunks=1",
                         fp8, kEpiPlain, 1, 7168, 2048, {129, 0, 64}, 256, 0});
    }
    for (auto &c : cases) run_case(c);
}

/* ---- bench ----------------------------------------------------------------------------------------- */

__global__ void fill_random_kernel(uint8_t *p, size_t n, uint64_t seed, int mode) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        if (mode == 0) { /* FP8 codes, exponent 1..10 */
            uint8_t c = (uint8_t)z;
            c = (uint8_t)((c & 0x87) | ((1 + ((z >> 8) % 10)) << 3));
            p[i] = c;
        } else if (mode == 1) { /* BF16 in [-1, 1) */
            float v = (float)((z >> 40) & 0xffffff) / 16777216.0f * 2.0f - 1.0f;
            ((uint16_t *)p)[i] = mf__bf16_from_float(v);
        } else { /* fp32 scales in [2^-8, 2^-4) */
            float v = exp2f(-8.0f + 4.0f * (float)((z >> 40) & 0xffffff) / 16777216.0f);
            ((float *)p)[i] = v;
        }
    }
}

static void fill_random(void *p, size_t n, int mode) {
    fill_random_kernel<<<1024, 256>>>((uint8_t *)p, n, rnd_u64(), mode);
    CUDA_OK(cudaGetLastError());
}

struct bench_row {
    std::string name, dtype, layout;
    int L, N, K, M;
    double us, tflops, tbps;
};

static void run_bench(const char *json_path, int argc, char **argv) {
    struct shape {
        const char *name;
        int epi_fp8, epi_bf16; /* epilogue per dtype */
        int n, k, nw;          /* n: plain N or swiglu I; nw: weight rows */
    };
    const shape shapes[3] = {
        {"W13 swiglu", kEpiSwigluFp8, kEpiSwigluBf16, 2048, 7168, 4096},
        {"W13 plain", kEpiPlain, kEpiPlain, 4096, 7168, 4096},
        {"W2 plain", kEpiPlain, kEpiPlain, 7168, 2048, 7168},
    };
    const int Ls[2] = {4, 32};
    const int Ms[4] = {256, 1024, 4096, 8192};
    const int kMaxRows = 32768;
    const int kMaxL = 32;

    /* one allocation per operand, sized for the largest case */
    size_t a_bytes = (size_t)kMaxRows * 7168 * 2;
    size_t w_bytes = std::max<size_t>((size_t)kMaxL * 4096 * 7168 * 2, (size_t)kMaxL * 7168 * 2048 * 2);
    g_case = "bench setup";
    uint8_t *d_a = dev_alloc<uint8_t>(a_bytes), *d_w = dev_alloc<uint8_t>(w_bytes);
    float *d_as = dev_alloc<float>((size_t)kMaxRows * 56), *d_ws = dev_alloc<float>((size_t)kMaxL * 56 * 56);
    uint8_t *d_out = dev_alloc<uint8_t>((size_t)kMaxRows * 7168 * 2);
    float *d_osc = dev_alloc<float>((size_t)kMaxRows * 16);
    int32_t *d_cnt = dev_alloc<int32_t>(kMaxL), *d_off = dev_alloc<int32_t>(kMaxL);
    uint8_t *d_flush = dev_alloc<uint8_t>(kFlushBytes);
    fill_random(d_as, (size_t)kMaxRows * 56, 2);
    fill_random(d_ws, (size_t)kMaxL * 56 * 56, 2);
    cudaEvent_t ev0, ev1;
    CUDA_OK(cudaEventCreate(&ev0));
    CUDA_OK(cudaEventCreate(&ev1));
    std::vector<bench_row> rows_out;

    printf("# sm90_gemm_lab bench: kernel time, median of %d, L2 flushed (%zu MB write) before each run\n",
           kTimedRuns, kFlushBytes >> 20);
    printf("# chunks: weight rows per tile / 128; cluster 2: the weight tile is TMA-multicast to a CTA pair\n");
    printf("# %-5s %-11s %3s %5s %5s %5s %6s %7s %10s %9s %8s\n", "dtype", "gemm", "L", "N", "K", "M", "chunks",
           "cluster", "time_us", "TFLOP/s", "W_TB/s");
    for (int di = 0; di < 2; di++) {
        int fp8 = di == 0, esize = fp8 ? 1 : 2;
        fill_random(d_a, a_bytes / esize, fp8 ? 0 : 1);
        fill_random(d_w, w_bytes / esize, fp8 ? 0 : 1);
        for (const shape &sh : shapes)
            for (int L : Ls)
                for (int M : Ms) {
                    if ((int64_t)L * M > kMaxRows) continue;
                    int epi = fp8 ? sh.epi_fp8 : sh.epi_bf16;
                    for (int variant = 0; variant < 4; variant++) {
                        int chunks = 1 + variant / 2, cluster = 1 + variant % 2;
                        if (epi != kEpiPlain && chunks == 1) continue;
                        /* the 128-column variant only where it is a real alternative (W2) */
                        if (chunks == 1 && sh.nw != 7168) continue;
                        char name[128];
                        snprintf(name, sizeof name, "bench %s %s L=%d M=%d chunks=%d cluster=%d", fp8 ? "fp8" : "bf16",
                                 sh.name, L, M, chunks, cluster);
                        g_case = name;
                        std::vector<int32_t> cnt(L, M), off(L);
                        for (int e = 0; e < L; e++) off[e] = e * M; /* M multiple of 128: EXPERT_MAJOR */
                        CUDA_OK(cudaMemcpy(d_cnt, cnt.data(), L * 4, cudaMemcpyHostToDevice));
                        CUDA_OK(cudaMemcpy(d_off, off.data(), L * 4, cudaMemcpyHostToDevice));
                        gemm_args g;
                        memset(&g, 0, sizeof g);
                        g.fp8 = fp8;
                        g.epi = epi;
                        g.chunks = chunks;
                        g.cluster = cluster;
                        g.L = L;
                        g.n = sh.n;
                        g.k = sh.k;
                        g.rows = (int64_t)L * M;
                        g.max_rows = M;
                        g.counts = d_cnt;
                        g.offsets = d_off;
                        g.a = d_a;
                        g.w = d_w;
                        g.a_scales = d_as;
                        g.w_scales = d_ws;
                        g.out = d_out;
                        g.out_scales = d_osc;
                        for (int i = 0; i < kWarmupRuns; i++) gemm_launch(g, 0);
                        CUDA_OK(cudaDeviceSynchronize());
                        std::vector<float> ts;
                        for (int i = 0; i < kTimedRuns; i++) {
                            CUDA_OK(cudaMemsetAsync(d_flush, i & 0xff, kFlushBytes, 0));
                            CUDA_OK(cudaEventRecord(ev0, 0));
                            gemm_launch(g, 0);
                            CUDA_OK(cudaEventRecord(ev1, 0));
                            CUDA_OK(cudaEventSynchronize(ev1));
                            float ms = 0;
                            CUDA_OK(cudaEventElapsedTime(&ms, ev0, ev1));
                            ts.push_back(ms);
                        }
                        std::sort(ts.begin(), ts.end());
                        double us = ts[ts.size() / 2] * 1e3;
                        double flops = 2.0 * L * M * (double)sh.nw * sh.k;
                        double wbytes = (double)L * sh.nw * sh.k * esize;
                        bench_row br;
                        br.name = std::string(sh.name) + (chunks == 1 ? " n128" : " n256") + (cluster == 2 ? " mc2" : "");
                        br.dtype = fp8 ? "fp8" : "bf16";
                        br.layout = "expert_major";
                        br.L = L;
                        br.N = sh.nw;
                        br.K = sh.k;
                        br.M = M;
                        br.us = us;
                        br.tflops = flops / us * 1e-6;
                        br.tbps = wbytes / us * 1e-6;
                        rows_out.push_back(br);
                        printf("  %-5s %-11s %3d %5d %5d %5d %6d %7d %10.1f %9.1f %8.2f\n", br.dtype.c_str(), sh.name,
                               L, sh.nw, sh.k, M, chunks, cluster, us, br.tflops, br.tbps);
                        fflush(stdout);
                    }
                }
    }
    if (json_path) {
        FILE *f = fopen(json_path, "w");
        if (!f) {
            fprintf(stderr, "cannot write %s\n", json_path);
            exit(2);
        }
        char date[32];
        time_t now = time(NULL);
        strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
        const char *commit = getenv("MF_COMMIT");
        std::string cmd;
        for (int i = 0; i < argc; i++) cmd += (i ? " " : "") + std::string(argv[i]);
        fprintf(f, "{\"meta\": {\"card\": \"h200\", \"date\": \"%s\", \"commit\": \"%s\", \"command\": \"%s\", "
                   "\"backend\": \"cuda\"},\n \"rows\": [\n", date, commit ? commit : "unknown", cmd.c_str());
        for (size_t i = 0; i < rows_out.size(); i++) {
            const bench_row &r = rows_out[i];
            fprintf(f, "  {\"op\": \"gemm\", \"name\": \"%s\", \"dtype\": \"%s\", \"layout\": \"%s\", \"shape\": "
                       "{\"E\": %d, \"N\": %d, \"K\": %d, \"M\": %d}, \"time_us\": %.2f, \"tflops\": %.1f, \"gbps\": %.1f, "
                       "\"peers\": []}%s\n",
                    r.name.c_str(), r.dtype.c_str(), r.layout.c_str(), r.L, r.N, r.K, r.M, r.us, r.tflops, r.tbps * 1e3,
                    i + 1 < rows_out.size() ? "," : "");
        }
        fprintf(f, " ]}\n");
        fclose(f);
        printf("# wrote %s\n", json_path);
    }
    CUDA_OK(cudaFree(d_a));
    CUDA_OK(cudaFree(d_w));
    CUDA_OK(cudaFree(d_as));
    CUDA_OK(cudaFree(d_ws));
    CUDA_OK(cudaFree(d_out));
    CUDA_OK(cudaFree(d_osc));
    CUDA_OK(cudaFree(d_cnt));
    CUDA_OK(cudaFree(d_off));
    CUDA_OK(cudaFree(d_flush));
}

/* ---- main ------------------------------------------------------------------------------------------ */

int main(int argc, char **argv) {
    bool selftest = false, validate = false, bench = false;
    const char *json = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--selftest")) selftest = true;
        else if (!strcmp(argv[i], "--validate")) validate = true;
        else if (!strcmp(argv[i], "--bench")) bench = true;
        else if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--selftest] [--validate] [--bench [--json FILE]]\n", argv[0]);
            return 2;
        }
    }
    if (!selftest && !validate && !bench) selftest = validate = bench = true;
    int dev = 0;
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDevice(&dev));
    CUDA_OK(cudaGetDeviceProperties(&prop, dev));
    printf("# device %s, sm_%d%d, %d SMs; smem per CTA: chunks=1 %d B (%d stages), chunks=2 %d B (%d stages)\n",
           prop.name, prop.major, prop.minor, prop.multiProcessorCount, smem_map<1>::kBytes, smem_map<1>::kStages,
           smem_map<2>::kBytes, smem_map<2>::kStages);
    if (prop.major != 9) {
        fprintf(stderr, "needs an sm_90 GPU\n");
        return 2;
    }
    CUDA_OK(cudaHostAlloc((void **)&g_fault, sizeof *g_fault, cudaHostAllocMapped));
    memset((void *)g_fault, 0, sizeof *g_fault);
    CUDA_OK(mf__sm90_set_fault_record(g_fault));
    if (selftest) {
        run_selftest(1);
        run_selftest(0);
    }
    if (validate) run_validate();
    if (bench) run_bench(json, argc, argv);
    if (selftest || validate) printf("# %d failure(s)\n", g_failures);
    return g_failures ? 1 : 0;
}
