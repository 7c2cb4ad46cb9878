/*
 * sm90_grouped_gemm.cuh — the grouped expert GEMMs of the CUDA backend, v1: warp-level tensor-core
 * MMAs (mma.sync), operands staged through shared memory by a cp.async pipeline. Included only by
 * src/cuda/grouped_gemm.cu, whose launchers validate the arguments; see cuda/grouped_gemm.h for the
 * contract and docs/DESIGN.md "Numerics" for the one definition of the arithmetic.
 *
 * Dimension legend: H hidden, I intermediate, L local experts, rows = receive rows of this rank,
 * C rows per expert bound (max_rows_per_expert), K_ the GEMM's reduction dim (H for W13, I for
 * W2), N_ its output dim (2I for W13, H for W2). BM/BN are the tile sizes below.
 *
 *   W13:  h[rows, I]  = silu(A . Wg^T) * (A . Wu^T)   A [rows, H], W13[e] = [Wg; Wu] = [2I, H]
 *   W2:   out[rows, H] = bf16(h . W2^T)                h [rows, I], W2[e] = [H, I]
 *
 * Work decomposition. A tile is kBlockM receive rows of one expert x kBlockN = 256 weight rows,
 * made of two 128-row halves: W13 takes gate rows [n0, n0 + 128) and up rows [I + n0, I + n0 + 128)
 * so that one tile holds the gate and the up column of every h column of [n0, n0 + 128) (the
 * [rows, 2I] intermediate never reaches memory, and the 128 h columns of an FP8 1x128 scale block
 * are all in one tile, so the requantisation's amax is a block-local reduction); W2 takes output
 * columns [n0, n0 + 256). The grid is persistent (one block per SM slot): block b walks the tile
 * list b, b + gridDim.x, ..., ordered expert-major, then column tile, then row tile, so that the
 * blocks running at one time share weight tiles through L2. Tiles exist only for rows below
 * counts[e] (read from device memory), so a MASKED layout with C >> counts costs nothing: no
 * block is ever launched just to find its rows empty.
 *
 * Main loop. K_ is consumed in stages of kStageBytes = 128 bytes per row (BF16: 64 elements; FP8:
 * 128 elements = exactly one scale block, so FP8 promotion happens once per stage). Each stage
 * holds A [kBlockM][128 B] and B [kBlockN][128 B] in shared memory, rows of eight 16-byte chunks
 * stored at chunk ^ (row & 7) (an XOR swizzle that keeps both the cp.async writes and the ldmatrix
 * reads free of bank conflicts). Rows past counts[e], weight rows past N_ and (BF16) K chunks past
 * K_ are zero-filled by cp.async's src-size operand: they are never read from global memory.
 * kStages stages are in flight (cp.async groups); 8 warps as 2 (M) x 4 (N), each owning 32 rows x
 * (32 rows of each weight half) = 2 x 8 MMA tiles of m16n8. A 32-byte k-step is one m16n8k16
 * bf16 MMA, or for FP8 the 32 E4M3 of an m16n8k32 fragment (same bytes in the same registers, so
 * one ldmatrix path feeds both) converted exactly to f16 and fed to two f16 m16n8k16 MMAs: sm_90
 * has no E4M3 mma.sync in hardware (see mma_k32bytes). Warps whose 16-row MMA tiles lie wholly
 * past counts[e] skip them (decode: a handful of rows per expert).
 *
 * FP8 promotion (docs/DESIGN.md): each stage (= 128-wide K block kb) is accumulated into a separate
 * fp32 fragment `part`, then acc += part * (a_scale[row][kb] * w_scale[n / 128][kb]), part = 0.
 *
 * Both kernels start with mf__pdl_wait() (the tile walk reads the plan's counts) and then
 * mf__pdl_trigger(): cuda/pdl.cuh.
 */
#ifndef MF_CUDA_KERNELS_SM90_GROUPED_GEMM_CUH
#define MF_CUDA_KERNELS_SM90_GROUPED_GEMM_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "core/numerics.h"
#include "cuda/gemm_configs.cuh"
#include "cuda/grouped_gemm.h"
#include "cuda/pdl.cuh"

namespace mf__gemm {

/* ---- tile sizes and the shared-memory map ----------------------------------------------------- */

/* Warp grid, tile and stage sizes: cuda/gemm_configs.cuh. */
static_assert(kStages >= 2, "the pipeline needs at least two stages");

static_assert(kWarpsM * kWarpsN * 32 == kThreads, "warp grid must cover the block");
static_assert(kStageBytes == MF__QUANT_BLOCK, "an FP8 stage must be exactly one scale block");
static_assert(kW13BlockN == MF__QUANT_BLOCK, "a W13 tile must hold whole FP8 h scale blocks");
static_assert(kBlockM <= kThreads, "one thread per row loads the activation scales");

constexpr int kStageABytes = kBlockM * kStageBytes;   /* 8 KB */
constexpr int kStageBBytes = kBlockN * kStageBytes;   /* 32 KB */
constexpr int kStageTileBytes = kStageABytes + kStageBBytes;
constexpr int kWScalesPerStage = 4;                   /* 2 used (one per half), padded to 16 B */

/* Epilogue staging (aliases stage 0 once the main loop is done): rows padded by 16 bytes so that
 * the fragment stores of 8 rows x 4 lanes hit 32 distinct banks. */
constexpr int kPadBytes = 16;
constexpr int kEpiRowBytesW13Fp8 = kW13BlockN * 1 + kPadBytes;  /* 144 */
constexpr int kEpiRowBytesW13Bf16 = kW13BlockN * 2 + kPadBytes; /* 272 */
constexpr int kEpiRowBytesW2 = kW2BlockN * 2 + kPadBytes;       /* 528 */
static_assert(kBlockM * kEpiRowBytesW2 <= kStageTileBytes, "W2 epilogue tile must fit in stage 0");
static_assert(kBlockM * kEpiRowBytesW13Bf16 <= kStageTileBytes, "W13 epilogue tile must fit in stage 0");

constexpr int kSmemTilesOffset = 0;
constexpr int kSmemAScalesOffset = kStages * kStageTileBytes;                       /* [kStages][kBlockM] f32 */
constexpr int kSmemWScalesOffset = kSmemAScalesOffset + kStages * kBlockM * 4;       /* [kStages][4] f32 */
constexpr int kSmemAmaxOffset = kSmemWScalesOffset + kStages * kWScalesPerStage * 4; /* [kWarpsN][kBlockM] f32 */
constexpr int kSmemARowsOffset = kSmemAmaxOffset + kWarpsN * kBlockM * 4;            /* [kBlockM] A row pointers */
constexpr int kSmemAScaleRowsOffset = kSmemARowsOffset + kBlockM * 8;                  /* [kBlockM] their scales */
constexpr int kSmemBytes = kSmemAScaleRowsOffset + kBlockM * 8;                        /* 166,976 B */
static_assert(kSmemBytes <= 227 * 1024, "must fit one sm_90 block");

/* ---- kernel parameters (one struct per kernel, passed by value) -------------------------------- */

struct w13_params {
    mf__gemm_segments_t seg;
    const uint8_t *a;        /* [rows, H] FP8 or BF16 (bytes), when use_gather == 0 */
    const float *a_scales;   /* FP8: [rows, H/128] */
    mf__heap_view_t view;    /* when use_gather == 1: rows read in place at their owners (heap_view.h) */
    const int32_t *src;      /* when use_gather == 1: [rows, 3] (rank, token, k) of each receive row */
    int32_t use_gather;
    const uint8_t *w;        /* [L, 2I, H] */
    const float *w_scales;   /* FP8: [L, 2I/128, H/128] */
    uint8_t *h;              /* [rows, I] FP8 or BF16 (bytes) */
    float *h_scales;         /* FP8: [rows, I/128] */
    int32_t H, I;
    int32_t ue8m0;
};

struct w2_params {
    mf__gemm_segments_t seg;
    const uint8_t *h;        /* [rows, I] */
    const float *h_scales;   /* FP8: [rows, I/128] */
    const uint8_t *w;        /* [L, H, I] */
    const float *w_scales;   /* FP8: [L, H/128, I/128] */
    uint16_t *out;           /* [rows, H] BF16, when use_ret == 0 */
    mf__heap_view_t view;    /* when use_ret == 1: rows to the owners' combine slots (heap_view.h) */
    const int32_t *src;      /* when use_ret == 1: [rows, 3] (rank, token, k) of each receive row */
    int32_t num_topk;        /* K, when use_ret == 1 */
    int32_t use_ret;
    int32_t H, I;
};

/* ---- PTX wrappers ------------------------------------------------------------------------------ */

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared; with valid == false nothing is read and the 16 bytes are zeroed. */
__device__ __forceinline__ void global_to_shared_16(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                 "l"(__cvta_generic_to_global(src)), "r"(valid ? 16 : 0)
                 : "memory");
}

/* 4 bytes global -> shared (one scale); zero-filled when !valid. */
__device__ __forceinline__ void global_to_shared_4(uint32_t dst, const void *src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst),
                 "l"(__cvta_generic_to_global(src)), "r"(valid ? 4 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

/* Four 8x8 b16 matrices (8 rows x 16 bytes each); lane l gives the row address of matrix l / 8. */
__device__ __forceinline__ void shared_to_reg_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

/* d += a . b, m16n8k16, bf16 or f16 operands, fp32 accumulators (HMMA.16816.F32[.BF16]). */
template <bool kF16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    if constexpr (kF16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* Four E4M3 bytes -> two f16x2 words: lo = bytes 0, 1; hi = bytes 2, 3. Exact (every E4M3 value,
 * subnormals included, is an f16), so f16 MMAs on the converted operands give the products an
 * E4M3 MMA would, accumulated in fp32. */
struct f16x2_pair {
    uint32_t lo, hi;
};
__device__ __forceinline__ f16x2_pair e4m3x4_to_f16x2x2(uint32_t x) {
    f16x2_pair r;
    asm("{\n"
        "  .reg .b16 l, h;\n"
        "  mov.b32 {l, h}, %2;\n"
        "  cvt.rn.f16x2.e4m3x2 %0, l;\n"
        "  cvt.rn.f16x2.e4m3x2 %1, h;\n"
        "}\n"
        : "=r"(r.lo), "=r"(r.hi)
        : "r"(x));
    return r;
}

/* d += a . b over one 32-byte k-step: a = the m16 x 32-byte A fragment (ldmatrix x4), b0/b1 = the
 * n8 x 32-byte B fragment. BF16: one m16n8k16. FP8: E4M3 m16n8k32 would be the natural
 * instruction, but sm_90 has no E4M3 mma.sync in hardware: ptxas lowers it to 2 f16 HMMAs on
 * zero accumulators plus 4 FADDs into d. Converting here and chaining two f16 m16n8k16 MMAs into
 * d does the same arithmetic without the FADDs. Any permutation of k applied alike to A and B
 * leaves the dot product unchanged; the lo and hi halves below pair A's and B's k identically
 * (the A register holding bytes 4q..4q+3 of a row meets the B register holding the same bytes of
 * a column), so the two MMAs cover the 32 k exactly once. */
template <bool kFp8>
__device__ __forceinline__ void mma_k32bytes(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (kFp8) {
        const f16x2_pair a0 = e4m3x4_to_f16x2x2(a[0]), a1 = e4m3x4_to_f16x2x2(a[1]);
        const f16x2_pair a2 = e4m3x4_to_f16x2x2(a[2]), a3 = e4m3x4_to_f16x2x2(a[3]);
        const f16x2_pair c0 = e4m3x4_to_f16x2x2(b0), c1 = e4m3x4_to_f16x2x2(b1);
        mma_m16n8k16<true>(d, a0.lo, a1.lo, a2.lo, a3.lo, c0.lo, c1.lo);
        mma_m16n8k16<true>(d, a0.hi, a1.hi, a2.hi, a3.hi, c0.hi, c1.hi);
    } else {
        mma_m16n8k16<false>(d, a[0], a[1], a[2], a[3], b0, b1);
    }
}

/* Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][128 B] stage tile. */
__device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
    return (uint32_t)(row * kStageBytes + ((chunk ^ (row & 7)) << 4));
}

/* ---- thread coordinates ------------------------------------------------------------------------ */

struct coords {
    int tid, lane, warp_m, warp_n;
    int group, quad;  /* MMA fragment row (lane / 4) and column pair (lane % 4) */
};

__device__ __forceinline__ coords thread_coords() {
    coords c;
    c.tid = (int)threadIdx.x;
    c.lane = c.tid & 31;
    int warp = c.tid >> 5;
    c.warp_m = warp / kWarpsN;
    c.warp_n = warp % kWarpsN;
    c.group = c.lane >> 2;
    c.quad = c.lane & 3;
    return c;
}

/* ---- the tile walk ----------------------------------------------------------------------------- */

/* Rows of expert e, read from device memory and clamped to [0, C] (a corrupt count never makes a
 * kernel touch another expert's rows). */
__device__ __forceinline__ int32_t expert_rows(const mf__gemm_segments_t &seg, int32_t e) {
    int32_t n = seg.counts[e];
    n = n < 0 ? 0 : n;
    return n < seg.max_rows_per_expert ? n : seg.max_rows_per_expert;
}

struct tile {
    int32_t expert;
    int32_t col;     /* column tile */
    int64_t row0;    /* first receive row */
    int32_t rows;    /* valid rows, 1..kBlockM */
};

/* Walks this block's tiles (b, b + gridDim.x, ...) in expert-major, column, row-tile order.
 * Every thread runs it redundantly with the same (uniform) result. */
struct tile_walker {
    int32_t e = -1;
    int64_t base = 0;        /* tiles of the experts before e */
    int64_t e_tiles = 0;
    int32_t e_rows = 0, e_row_tiles = 1;

    __device__ __forceinline__ bool next(const mf__gemm_segments_t &seg, int32_t col_tiles, int64_t index, tile &t) {
        while (index >= base + e_tiles) {
            base += e_tiles;
            if (++e >= seg.num_experts) return false;
            e_rows = expert_rows(seg, e);
            e_row_tiles = (e_rows + kBlockM - 1) / kBlockM;
            e_tiles = (int64_t)e_row_tiles * col_tiles;
        }
        int64_t local = index - base;
        int32_t row_tile = (int32_t)(local % e_row_tiles);
        t.expert = e;
        t.col = (int32_t)(local / e_row_tiles);
        t.row0 = (int64_t)seg.offsets[e] + (int64_t)row_tile * kBlockM;
        int32_t left = e_rows - row_tile * kBlockM;
        t.rows = left < kBlockM ? left : kBlockM;
        return true;
    }
};

/* ---- main loop --------------------------------------------------------------------------------- */

/* What the main loop reads for one tile: the A rows through the pointer table in shared memory
 * (set_a_rows: contiguous rows or rows gathered from their owners), the weight halves from row 0
 * of each; every row is k_bytes long (A [rows, K_] and W [N_, K_] share K_). */
struct operands {
    const uint8_t *b[2];
    const float *b_scales[2];   /* FP8: the half's [K_/128] scales */
    int32_t rows;               /* valid A rows, 1..kBlockM */
    int32_t b_rows[2];          /* valid rows of each weight half, 0..kHalfN (half 0 >= 1) */
    int32_t k_bytes;
};

/* Fills the tile's A row pointer table: row i of the tile (i < rows) starts at a + i * k_bytes
 * (scales at a_scales + i * K_/128), or, with a heap view (a gather), at its owner's published row
 * (the direct dataflow: src_rows[row] = (rank, token, k), no receive tensor). The main loop's
 * first barrier publishes the table; the previous tile's main loop is past its last read of it. */
__device__ __forceinline__ void set_a_rows(uint8_t *smem, const coords &c, const tile &t, int32_t k_bytes,
                                           const uint8_t *a, const float *a_scales,
                                           const mf__heap_view_t *view, const int32_t *src_rows) {
    if (c.tid >= kBlockM) return;
    const int32_t kb = k_bytes / kStageBytes; /* FP8 scale columns (FP8: one byte per element) */
    const uint8_t **rows = (const uint8_t **)(smem + kSmemARowsOffset);
    const float **scale_rows = (const float **)(smem + kSmemAScaleRowsOffset);
    const int64_t row = t.row0 + c.tid;
    const uint8_t *r = a;
    const float *sr = a_scales;
    if (c.tid < t.rows) {
        if (view) {
            const int32_t *src = src_rows + 3 * row;
            const uint8_t *heap = view->heap[src[0]];
            r = heap + view->x + (int64_t)src[1] * k_bytes;
            sr = (const float *)(heap + view->scales) + (int64_t)src[1] * kb;
        } else {
            r = a + row * k_bytes;
            sr = a_scales ? a_scales + row * kb : nullptr;
        }
    }
    rows[c.tid] = r;
    scale_rows[c.tid] = sr;
}

template <bool kFp8>
__device__ __forceinline__ void load_stage(const operands &op, const coords &c, uint8_t *smem, int slot, int ks) {
    const uint8_t *const *a_rows = (const uint8_t *const *)(smem + kSmemARowsOffset);
    const float *const *a_scale_rows = (const float *const *)(smem + kSmemAScaleRowsOffset);
    uint8_t *tiles = smem + kSmemTilesOffset + slot * kStageTileBytes;
    const uint32_t sa = smem_addr(tiles), sb = smem_addr(tiles + kStageABytes);
    const int k0 = ks * kStageBytes;
#pragma unroll
    for (int i = 0; i < kStageABytes / kChunk / kThreads; i++) {
        int idx = c.tid + i * kThreads, row = idx / kChunksPerRow, chunk = idx % kChunksPerRow;
        int kb = k0 + chunk * kChunk;
        bool valid = row < op.rows && kb < op.k_bytes;
        const uint8_t *src = valid ? a_rows[row] + kb : op.b[0];
        global_to_shared_16(sa + swizzle(row, chunk), src, valid);
    }
    /* Pass i covers rows [32 i, 32 i + 32): the half is a compile-time constant. */
    constexpr int kRowsPerPass = kThreads / kChunksPerRow;
    static_assert(kHalfN % kRowsPerPass == 0, "a pass must not straddle the two weight halves");
#pragma unroll
    for (int i = 0; i < kStageBBytes / kChunk / kThreads; i++) {
        constexpr int kPassesPerHalf = kHalfN / kRowsPerPass;
        const int half = i / kPassesPerHalf;
        const int r = (i % kPassesPerHalf) * kRowsPerPass + c.tid / kChunksPerRow, chunk = c.tid % kChunksPerRow;
        int kb = k0 + chunk * kChunk;
        bool valid = r < op.b_rows[half] && kb < op.k_bytes;
        const uint8_t *src = valid ? op.b[half] + (int64_t)r * op.k_bytes + kb : op.b[0];
        global_to_shared_16(sb + swizzle(half * kHalfN + r, chunk), src, valid);
    }
    if constexpr (kFp8) {
        if (c.tid < kBlockM) {
            bool valid = c.tid < op.rows;
            const float *src = valid ? a_scale_rows[c.tid] + ks : op.b_scales[0];
            float *dst = (float *)(smem + kSmemAScalesOffset) + slot * kBlockM + c.tid;
            global_to_shared_4(smem_addr(dst), src, valid);
        } else if (c.tid < kBlockM + 2) {
            const int half = c.tid - kBlockM;
            const bool valid = (half ? op.b_rows[1] : op.b_rows[0]) > 0;
            const float *src = valid ? (half ? op.b_scales[1] : op.b_scales[0]) + ks : op.b_scales[0];
            float *dst = (float *)(smem + kSmemWScalesOffset) + slot * kWScalesPerStage + half;
            global_to_shared_4(smem_addr(dst), src, valid);
        }
    }
}

/* acc[mi][ni][*] (fp32, m16n8 fragment layout) = A[tile rows] . B[tile weight rows]^T over K_. On
 * return the shared memory is free (no copy in flight, every warp past its last read). */
template <bool kFp8>
__device__ __forceinline__ void mainloop(const operands &op, const coords &c, uint8_t *smem,
                                         float (&acc)[kMTiles][kNTiles][4]) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; mi++)
#pragma unroll
        for (int ni = 0; ni < kNTiles; ni++)
#pragma unroll
            for (int r = 0; r < 4; r++) acc[mi][ni][r] = 0.0f;
    float part[kMTiles][kNTiles][4];
    if constexpr (kFp8) {
#pragma unroll
        for (int mi = 0; mi < kMTiles; mi++)
#pragma unroll
            for (int ni = 0; ni < kNTiles; ni++)
#pragma unroll
                for (int r = 0; r < 4; r++) part[mi][ni][r] = 0.0f;
    }

    /* Warp-uniform: which 16-row MMA tiles hold at least one valid row. */
    bool m_active[kMTiles];
#pragma unroll
    for (int mi = 0; mi < kMTiles; mi++) m_active[mi] = c.warp_m * kWarpRows + mi * kMmaM < op.rows;

    /* ldmatrix lane roles. A (x4 = rows 0-7 / 8-15 x chunk 0 / 1 of a k-step): row, chunk offset.
     * B (x4 = two n8 tiles x chunk 0 / 1): row within the 16-row pair, chunk offset. */
    const int a_row = (c.lane & 7) + (((c.lane >> 3) & 1) << 3), a_chunk = c.lane >> 4;
    const int b_row = (c.lane & 7) + ((c.lane >> 4) << 3), b_chunk = (c.lane >> 3) & 1;

    const int num_k = (op.k_bytes + kStageBytes - 1) / kStageBytes;
    __syncthreads(); /* the A row table (set_a_rows) is complete */
#pragma unroll
    for (int s = 0; s < kStages - 1; s++) {
        if (s < num_k) load_stage<kFp8>(op, c, smem, s, s);
        cp_async_commit();
    }

    for (int kt = 0; kt < num_k; kt++) {
        cp_async_wait<kStages - 2>(); /* stage kt has landed (for this thread) ... */
        __syncthreads();              /* ... for every thread; and slot (kt - 1) % kStages is free */
        {
            int pre = kt + kStages - 1;
            if (pre < num_k) load_stage<kFp8>(op, c, smem, pre % kStages, pre);
            cp_async_commit();
        }
        const int slot = kt % kStages;
        const uint8_t *tiles = smem + kSmemTilesOffset + slot * kStageTileBytes;
        const uint32_t sa = smem_addr(tiles), sb = smem_addr(tiles + kStageABytes);
        /* Warps whose rows are all past counts[e] only help with the copies. */
        if (m_active[0]) {
#pragma unroll
            for (int s = 0; s < kKSteps; s++) {
                uint32_t af[kMTiles][4];
                uint32_t bf[kNTiles / 2][4]; /* [pair]: n8 tile 2p (regs 0, 1) and 2p + 1 (regs 2, 3) */
#pragma unroll
                for (int mi = 0; mi < kMTiles; mi++) {
                    if (m_active[mi])
                        shared_to_reg_x4(af[mi], sa + swizzle(c.warp_m * kWarpRows + mi * kMmaM + a_row, 2 * s + a_chunk));
                    else
                        af[mi][0] = af[mi][1] = af[mi][2] = af[mi][3] = 0u;
                }
#pragma unroll
                for (int p = 0; p < kNTiles / 2; p++) {
                    const int half = p / (kNTilesHalf / 2), in_half = p % (kNTilesHalf / 2);
                    const int row = half * kHalfN + c.warp_n * kWarpHalfN + in_half * 2 * kMmaN + b_row;
                    shared_to_reg_x4(bf[p], sb + swizzle(row, 2 * s + b_chunk));
                }
#pragma unroll
                for (int mi = 0; mi < kMTiles; mi++) {
                    if (!m_active[mi]) continue;
#pragma unroll
                    for (int ni = 0; ni < kNTiles; ni++) {
                        const uint32_t b0 = bf[ni / 2][(ni % 2) * 2], b1 = bf[ni / 2][(ni % 2) * 2 + 1];
                        if constexpr (kFp8)
                            mma_k32bytes<true>(part[mi][ni], af[mi], b0, b1);
                        else
                            mma_k32bytes<false>(acc[mi][ni], af[mi], b0, b1);
                    }
                }
            }
        }
        if constexpr (kFp8) {
            /* Promotion of K block kt: acc += part * (a_scale[row][kt] * w_scale[half][kt]). */
            const float *as = (const float *)(smem + kSmemAScalesOffset) + slot * kBlockM;
            const float *ws = (const float *)(smem + kSmemWScalesOffset) + slot * kWScalesPerStage;
            const float w_scale[2] = {ws[0], ws[1]};
#pragma unroll
            for (int mi = 0; mi < kMTiles; mi++) {
                if (!m_active[mi]) continue;
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    const float a_scale = as[c.warp_m * kWarpRows + mi * kMmaM + rr * 8 + c.group];
#pragma unroll
                    for (int ni = 0; ni < kNTiles; ni++) {
                        const float s = a_scale * w_scale[ni / kNTilesHalf];
#pragma unroll
                        for (int j = 0; j < 2; j++) {
                            acc[mi][ni][rr * 2 + j] += part[mi][ni][rr * 2 + j] * s;
                            part[mi][ni][rr * 2 + j] = 0.0f;
                        }
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();
}

/* The first kTiles n-tiles of the fp32 fragments, rounded to BF16, into the staging tile `epi` (rows
 * kRowBytes apart): tile ni < kNTilesHalf is weight half 0, ni >= kNTilesHalf half 1. W13 stages its
 * h columns (half 0), W2 its whole [kBlockM][256] output tile. */
template <int kTiles, int kRowBytes>
__device__ __forceinline__ void stage_bf16(const float (&acc)[kMTiles][kNTiles][4], const coords &c, uint8_t *epi) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; mi++)
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            const int row = c.warp_m * kWarpRows + mi * kMmaM + rr * 8 + c.group;
#pragma unroll
            for (int ni = 0; ni < kTiles; ni++) {
                const int col = (ni / kNTilesHalf) * kHalfN + c.warp_n * kWarpHalfN + (ni % kNTilesHalf) * kMmaN + 2 * c.quad;
                uint32_t lo = mf__bf16_from_float(acc[mi][ni][rr * 2]);
                uint32_t hi = mf__bf16_from_float(acc[mi][ni][rr * 2 + 1]);
                *(uint32_t *)(epi + row * kRowBytes + col * 2) = lo | (hi << 16);
            }
        }
}

/* ---- W13 + SwiGLU (+ FP8 1x128 requantisation) ---------------------------------------------------- */

/* Both kernels open and walk their tiles alike on purpose (the prologue of every kernel here:
 * coordinates once at the top, PDL, the persistent tile walk); what differs is the operands'
 * set-up and the epilogue, so each kernel keeps its own. */
template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) sm90_w13_swiglu_kernel(const __grid_constant__ w13_params p) {
    extern __shared__ __align__(128) uint8_t smem[];
    const coords c = thread_coords();
    mf__pdl_wait(); /* the tile walk reads the plan's counts (cuda/pdl.cuh) */
    mf__pdl_trigger();
    constexpr int kEsz = kFp8 ? 1 : 2;
    constexpr int kRowBytes = kFp8 ? kEpiRowBytesW13Fp8 : kEpiRowBytesW13Bf16;
    const int32_t col_tiles = (p.I + kW13BlockN - 1) / kW13BlockN;
    const int32_t k_bytes = p.H * kEsz;
    const int64_t h_row_bytes = (int64_t)p.I * kEsz;
    const int32_t h_blocks = p.I / MF__QUANT_BLOCK; /* FP8 scale columns */
    float *amax_s = (float *)(smem + kSmemAmaxOffset);
    uint8_t *epi = smem + kSmemTilesOffset;

    tile_walker walker;
    tile t;
    for (int64_t index = blockIdx.x; walker.next(p.seg, col_tiles, index, t); index += gridDim.x) {
        const int32_t n0 = t.col * kW13BlockN;
        const int32_t n_valid = p.I - n0 < kHalfN ? p.I - n0 : kHalfN;
        const uint8_t *w_e = p.w + (int64_t)t.expert * 2 * p.I * k_bytes;
        set_a_rows(smem, c, t, k_bytes, p.a, p.a_scales, p.use_gather ? &p.view : nullptr, p.src);
        operands op;
        op.b[0] = w_e + (int64_t)n0 * k_bytes;          /* gate rows [n0, n0 + 128) */
        op.b[1] = w_e + (int64_t)(p.I + n0) * k_bytes;  /* up rows [I + n0, I + n0 + 128) */
        op.rows = t.rows;
        op.b_rows[0] = op.b_rows[1] = n_valid;
        op.k_bytes = k_bytes;
        if constexpr (kFp8) {
            const int32_t kb = p.H / MF__QUANT_BLOCK;
            const float *ws_e = p.w_scales + (int64_t)t.expert * (2 * p.I / MF__QUANT_BLOCK) * kb;
            op.b_scales[0] = ws_e + (int64_t)(n0 / MF__QUANT_BLOCK) * kb;
            op.b_scales[1] = ws_e + (int64_t)((p.I + n0) / MF__QUANT_BLOCK) * kb;
        } else {
            op.b_scales[0] = op.b_scales[1] = nullptr;
        }

        float acc[kMTiles][kNTiles][4];
        mainloop<kFp8>(op, c, smem, acc);

        /* h = silu(gate) * up, in place of the gate fragments: tile ni (gate) and ni + 4 (up) hold
         * the same h columns. */
#pragma unroll
        for (int mi = 0; mi < kMTiles; mi++)
#pragma unroll
            for (int ni = 0; ni < kNTilesHalf; ni++)
#pragma unroll
                for (int r = 0; r < 4; r++) acc[mi][ni][r] = mf__silu(acc[mi][ni][r]) * acc[mi][ni + kNTilesHalf][r];

        if constexpr (kFp8) {
            /* amax of each row over the tile's 128 columns: quad lanes, then the 4 column warps. */
            float amax[kMTiles][2];
#pragma unroll
            for (int mi = 0; mi < kMTiles; mi++)
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    float m = 0.0f;
#pragma unroll
                    for (int ni = 0; ni < kNTilesHalf; ni++)
#pragma unroll
                        for (int j = 0; j < 2; j++) {
                            float v = fabsf(acc[mi][ni][rr * 2 + j]);
                            m = v > m ? v : m; /* NaN never wins, as in the host quantiser */
                        }
#pragma unroll
                    for (int off = 1; off < 4; off <<= 1) {
                        float o = __shfl_xor_sync(0xffffffffu, m, off);
                        m = o > m ? o : m;
                    }
                    amax[mi][rr] = m;
                }
            if (c.quad == 0)
#pragma unroll
                for (int mi = 0; mi < kMTiles; mi++)
#pragma unroll
                    for (int rr = 0; rr < 2; rr++)
                        amax_s[c.warp_n * kBlockM + c.warp_m * kWarpRows + mi * kMmaM + rr * 8 + c.group] = amax[mi][rr];
            __syncthreads();
#pragma unroll
            for (int mi = 0; mi < kMTiles; mi++)
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    const int row = c.warp_m * kWarpRows + mi * kMmaM + rr * 8 + c.group;
                    float m = amax_s[row];
#pragma unroll
                    for (int w = 1; w < kWarpsN; w++) {
                        float o = amax_s[w * kBlockM + row];
                        m = o > m ? o : m;
                    }
                    float scale, inv;
                    mf__fp8_block_scale(m, p.ue8m0, &scale, &inv);
#pragma unroll
                    for (int ni = 0; ni < kNTilesHalf; ni++) {
                        const int col = c.warp_n * kWarpHalfN + ni * kMmaN + 2 * c.quad;
                        uint32_t q0 = mf__fp8_from_float(acc[mi][ni][rr * 2] * inv);
                        uint32_t q1 = mf__fp8_from_float(acc[mi][ni][rr * 2 + 1] * inv);
                        *(uint16_t *)(epi + row * kRowBytes + col) = (uint16_t)(q0 | (q1 << 8));
                    }
                    if (c.warp_n == 0 && c.quad == 0 && row < t.rows)
                        p.h_scales[(t.row0 + row) * h_blocks + n0 / MF__QUANT_BLOCK] = scale;
                }
        } else {
            stage_bf16<kNTilesHalf, kRowBytes>(acc, c, epi);
        }
        __syncthreads();

        /* 16-byte stores of the valid rows and columns. */
        constexpr int kChunksPerHRow = kW13BlockN * kEsz / kChunk;
        constexpr int kColsPerChunk = kChunk / kEsz;
        uint8_t *h_tile = p.h + t.row0 * h_row_bytes + (int64_t)n0 * kEsz;
#pragma unroll
        for (int i = 0; i < kBlockM * kChunksPerHRow / kThreads; i++) {
            const int idx = c.tid + i * kThreads, row = idx / kChunksPerHRow, chunk = idx % kChunksPerHRow;
            if (row < t.rows && chunk * kColsPerChunk < n_valid)
                *(uint4 *)(h_tile + row * h_row_bytes + chunk * kChunk) = *(const uint4 *)(epi + row * kRowBytes + chunk * kChunk);
        }
        __syncthreads(); /* the staging tile and amax_s are reused by the next tile */
    }
}

/* ---- W2 (BF16 rows to out or to the token owners' combine slots) ---------------------------------- */

/* Opens and walks its tiles like sm90_w13_swiglu_kernel, on purpose (there). */
template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) sm90_w2_kernel(const __grid_constant__ w2_params p) {
    extern __shared__ __align__(128) uint8_t smem[];
    const coords c = thread_coords();
    mf__pdl_wait(); /* the tile walk reads the plan's counts (cuda/pdl.cuh) */
    mf__pdl_trigger();
    constexpr int kEsz = kFp8 ? 1 : 2;
    const int32_t col_tiles = (p.H + kW2BlockN - 1) / kW2BlockN;
    const int32_t k_bytes = p.I * kEsz;
    uint8_t *epi = smem + kSmemTilesOffset;

    tile_walker walker;
    tile t;
    for (int64_t index = blockIdx.x; walker.next(p.seg, col_tiles, index, t); index += gridDim.x) {
        const int32_t n0 = t.col * kW2BlockN;
        const uint8_t *w_e = p.w + (int64_t)t.expert * p.H * k_bytes;
        set_a_rows(smem, c, t, k_bytes, p.h, p.h_scales, nullptr, nullptr);
        operands op;
        op.rows = t.rows;
        op.k_bytes = k_bytes;
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int32_t first = n0 + half * kHalfN, left = p.H - first;
            op.b_rows[half] = left <= 0 ? 0 : (left < kHalfN ? left : kHalfN);
            op.b[half] = op.b_rows[half] ? w_e + (int64_t)first * k_bytes : w_e + (int64_t)n0 * k_bytes;
        }
        if constexpr (kFp8) {
            const int32_t kb = p.I / MF__QUANT_BLOCK;
            const float *ws_e = p.w_scales + (int64_t)t.expert * (p.H / MF__QUANT_BLOCK) * kb;
            op.b_scales[0] = ws_e + (int64_t)(n0 / MF__QUANT_BLOCK) * kb;
            op.b_scales[1] = op.b_rows[1] ? op.b_scales[0] + kb : op.b_scales[0];
        } else {
            op.b_scales[0] = op.b_scales[1] = nullptr;
        }

        float acc[kMTiles][kNTiles][4];
        mainloop<kFp8>(op, c, smem, acc);

        /* BF16 tile [kBlockM][256] in shared memory. */
        stage_bf16<kNTiles, kEpiRowBytesW2>(acc, c, epi);
        __syncthreads();

        /* One warp per row per pass: 32 chunks of 8 columns = the tile's 256 columns. */
        constexpr int kChunksPerOutRow = kW2BlockN * 2 / kChunk;
#pragma unroll 2
        for (int i = 0; i < kBlockM * kChunksPerOutRow / kThreads; i++) {
            const int idx = c.tid + i * kThreads, row = idx / kChunksPerOutRow, chunk = idx % kChunksPerOutRow;
            const int32_t n = n0 + chunk * (kChunk / 2);
            if (row >= t.rows || n >= p.H) continue;
            const int64_t grow = t.row0 + row;
            uint16_t *dst;
            if (p.use_ret) {
                const int32_t *src = p.src + 3 * grow;
                const int32_t rank = src[0], token = src[1], k = src[2];
                if (rank < 0 || rank >= MF_MAX_RANKS || token < 0 || k < 0 || k >= p.num_topk) continue;
                uint8_t *heap = p.view.heap[rank];
                if (!heap) continue;
                dst = (uint16_t *)(heap + p.view.combine) + ((int64_t)token * p.num_topk + k) * p.H + n;
            } else {
                dst = p.out + grow * p.H + n;
            }
            *(uint4 *)dst = *(const uint4 *)(epi + row * kEpiRowBytesW2 + chunk * kChunk);
        }
        __syncthreads();
    }
}

} /* namespace mf__gemm */

#endif /* MF_CUDA_KERNELS_SM90_GROUPED_GEMM_CUH */
