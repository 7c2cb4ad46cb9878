/*
 * sm90_decode_lab.cu — the Hopper (sm_90a) grouped expert GEMM for DECODE (a handful of rows per
 * expert), BF16 and block-FP8, and its validate-then-bench main. Built by `make lab` into
 * build/dev/sm90_decode_lab; needs one sm_90a GPU. The job of the kernel is to stream the routed
 * experts' weights at full HBM bandwidth: at 8..64 rows per expert the GEMM is a weight copy with
 * a little arithmetic on the side.
 *
 *   sm90_decode_lab                 selftest, validate, then bench
 *   sm90_decode_lab --selftest      one tile, structured inputs; prints the first mismatch
 *   sm90_decode_lab --validate      small and DeepSeek-shaped cases against the CPU oracle
 *   sm90_decode_lab --bench [--json FILE] [--no-peers] [--quick]
 *
 * Dimension legend: L local experts, N weight rows per expert (the GEMM's output dim: 2I for W13,
 * H for W2), K the reduction dim (H for W13, I for W2), I intermediate, M rows per expert,
 * T = kBlockT rows of one expert per tile, C masked capacity.
 *
 *   plain:   out[rows, N]  = bf16(a[rows, K] . W[e]^T)            W[e] = [N, K]
 *   swiglu:  h[rows, I]    = silu(a . Wg^T) * (a . Wu^T)            W[e] = [Wg; Wu] = [2I, K]
 *            BF16 path: h rounded to BF16; FP8 path: h requantised 1x128 (h_fp8 + h_scales [rows, I/128])
 *
 * Swap A/B. The weights are wgmma's A operand (64 weight rows per warpgroup, K-major, 128B swizzle,
 * loaded by TMA) and the expert's activation rows are the B operand (wgmma N = kBlockT in
 * {8, 16, 32, 64}, one TMA box of kBlockT rows x 128 bytes): D[w_row, token] accumulates in fp32 and
 * the epilogue stores it transposed, out[token, n], for tokens below counts[e] only. Rows of the box
 * past counts[e] are garbage, padding or the next expert's rows: each only reaches its own D column
 * (D[:, j] depends on B row j alone), and those columns are never stored, so even NaN rows are
 * harmless. Past the tensor's last row TMA reads zeros.
 *
 * Work. A tile is (expert with rows, n-block, token block): plain n-blocks are 128 weight rows
 * (= 128 output columns; consumer warpgroup g takes rows [64g, 64g + 64)); swiglu n-blocks are 128
 * h columns: gate rows [n0, n0 + 128) and up rows [I + n0, I + n0 + 128), warpgroup g takes gate
 * and up rows [64g, 64g + 64) of each, so that h = silu(g) * u is element-wise on two fragments of
 * the same layout and a token's 128 h columns (one FP8 scale block) are all in the tile. Token
 * blocks (more than kBlockT rows in one expert) are the innermost tile index: their CTAs run at the
 * same time and read the same weights, the second one from L2. The grid is persistent (one CTA per
 * SM, tiles b, b + grid, ...); experts without rows have no tiles, so they cost nothing. The
 * counts and offsets are read on the device (CUDA-graph capturable) into shared-memory tables
 * at kernel start (a warp scan gives each expert's first tile).
 *
 * Pipeline. Warpgroup 0 is the producer (setmaxnreg 40; one warp issues everything), warpgroups 1
 * and 2 are the consumers (setmaxnreg 232). kStages stages ring through shared memory, each holding
 * kSubK K blocks of 128 bytes (FP8: 128 elements = one scale block; BF16: 64): the weight boxes
 * (1 or 2 x [128 rows x 128 B] = 16 / 32 KB), the activation box [kBlockT x 128 B] and, for FP8, the
 * scales of that K block (a_scale of each token by cp.async, the last valid token's past counts[e];
 * w_scale of each weight box). full[s]: the producer's arrive.expect_tx of the stage's bytes (a
 * partly out-of-bounds box still delivers its full size) + for FP8 one cp.async.mbarrier.arrive.noinc
 * per producer lane (init count 1 + 32); empty[s]: one arrival per consumer warp after its wgmmas
 * completed and its scale reads were done. The producer runs ahead across tile boundaries, so the
 * consumers' epilogue hides under the next tile's loads. The ring index `it` counts stages over the
 * whole persistent loop in both roles: slot = it % kStages, parity = (it / kStages) & 1 (the
 * producer waits empty with the opposite parity; a fresh barrier's "previous phase" counts as done).
 *
 * FP8 (DESIGN.md "Numerics"): for each 128-wide K block the four k32 wgmmas go into a temporary
 * fragment (scale-d = 0 on the first), then acc += tmp * (a_scale[token][kb] * w_scale[n/128][kb]):
 * w_scale is one scalar per (weight box, kb) since a box is one 128-row scale block, a_scale varies
 * along D's columns (tokens). Same arithmetic as the CPU oracle (src/cpu/gemm.c), other order.
 *
 * Epilogue (consumer warpgroups, named barrier 1 over their 256 threads): fragments -> BF16 or FP8
 * in a padded [kBlockT][128] staging tile -> 16-byte stores of the rows below counts[e]. FP8 h:
 * amax of a token over its 128 h columns = max over the thread's two rows, the 8 lanes sharing the
 * column (shfl xor 4, 8, 16) and the 8 consumer warps (smem); then mf__fp8_block_scale and
 * mf__fp8_from_float from core/numerics.h, as the CPU does it.
 *
 * Limits (checked by make_plan): N a multiple of 128 (plain) or 256 (swiglu), K * elem bytes a
 * multiple of 128 * kSubK, L <= kMaxExperts, 16-byte aligned data.
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
#include <string>
#include <vector>

extern "C" {
#include "core/internal.h"
#include "core/quant.h"
#include "cpu/gemm.h"
}
#include "core/numerics.h"
#include "cuda/grouped_gemm.h"
#include "cuda/kernels/sm90_ptx.cuh"

/* ================================================================================================
 * to move into sm90_ptx.cuh — wrappers this kernel needs that the header does not have (yet)
 * ============================================================================================== */

/* Waits until every cp.async of this thread has landed (a thread must not exit with copies still
 * writing its CTA's shared memory). */
__device__ __forceinline__ void mf__cp_async_wait_all(void) { asm volatile("cp.async.wait_all;" ::: "memory"); }

/* ================================================================================================
 * the kernel
 * ============================================================================================== */

namespace mf__decode {

enum { kEpiPlain = 0, kEpiSwiglu = 1 };

constexpr int kThreads = 3 * kMfWarpgroupThreads;         /* WG 0 producer, WG 1-2 consumers */
constexpr int kConsumerThreads = 2 * kMfWarpgroupThreads;
constexpr int kConsumerWarps = kConsumerThreads / 32;
constexpr int kLaunchRegs = 168;                          /* 65536 / 384, rounded down to 8 */
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(kProducerRegs * kMfWarpgroupThreads + kConsumerRegs * kConsumerThreads <= kLaunchRegs * kThreads,
              "setmaxnreg.inc would wait forever for registers the CTA does not have");

constexpr int kWgRows = 64;                               /* weight rows per consumer warpgroup per box */
constexpr int kBoxRows = 2 * kWgRows;                     /* 128 rows per weight box (= scale block) */
constexpr int kKBlock = 128;                              /* K bytes per K block (FP8: one scale block) */
constexpr int kBoxBytes = kBoxRows * kKBlock;             /* 16 KB */
constexpr int kWgOperandBytes = kWgRows * kKBlock;        /* 8 KB: warpgroup g's A operand at 8 KB g */
constexpr int kKStepBytes = 32;                           /* K bytes per wgmma: BF16 k16, E4M3 k32 */
constexpr int kKSteps = kKBlock / kKStepBytes;            /* 4 */
constexpr int kTileCols = kBoxRows;                       /* output (or h) columns per tile */
constexpr int kMaxExperts = 512;                          /* shared-memory tables */
constexpr int kMaxStages = 16;
constexpr int kSmemLimit = 227 * 1024;                    /* dynamic smem per block on sm_90 */
constexpr int kScalePad = 4;                              /* w_scale slots after a K block's a_scales */
constexpr int kEpiPadBytes = 16;                          /* staging row pad (bank spread) */
constexpr int kBarEpilogue = 1;                           /* named barrier of the 256 consumer threads */
constexpr int kChunk = 16;                                /* bytes per epilogue store */
enum { kTagProducerEmpty = 1, kTagConsumerFull = 2 };     /* fault-record tags of the two waits */

static_assert(kKBlock == kMfSwizzleBytes, "a K block is one 128B-swizzle row");
static_assert(kKBlock == MF__QUANT_BLOCK, "an FP8 K block must be exactly one scale block");
static_assert(kTileCols == MF__QUANT_BLOCK, "a swiglu tile must hold whole FP8 h scale blocks");
static_assert(kWgOperandBytes % kMfSwizzleAtomBytes == 0, "wgmma operands must start on a swizzle atom");

__host__ __device__ constexpr int align_up(int x, int a) { return (x + a - 1) / a * a; }
__host__ __device__ constexpr int min_int(int a, int b) { return a < b ? a : b; }

/* Compile-time tile parameters and the shared-memory map. */
template <bool kFp8, int kEpi, int kBlockT, int kSubK>
struct cfg {
    static constexpr int kEsz = kFp8 ? 1 : 2;
    static constexpr int kBoxes = kEpi == kEpiSwiglu ? 2 : 1;          /* weight boxes per K block */
    static constexpr int kActBytes = kBlockT * kKBlock;
    static constexpr int kKBlockBytes = kBoxes * kBoxBytes + kActBytes; /* one K block of a stage */
    static constexpr int kStageBytes = kSubK * kKBlockBytes;            /* = the stage's expect_tx */
    static constexpr int kOutEsz = (kEpi == kEpiSwiglu && kFp8) ? 1 : 2;
    static constexpr int kEpiRowBytes = kTileCols * kOutEsz + kEpiPadBytes;
    static constexpr int kScaleStride = kBlockT + kScalePad;            /* floats per K block */
    static constexpr int kScaleBytes = kFp8 ? kSubK * kScaleStride * 4 : 0; /* per stage */
    static constexpr int kEpiBytes = align_up(kBlockT * kEpiRowBytes, 128);
    static constexpr int kRedBytes = kConsumerWarps * kBlockT * 4;
    static constexpr int kTableBytes = align_up((3 * kMaxExperts + 1) * 4, 16);
    static constexpr int kFixedBytes = kMfSwizzleAtomBytes /* base alignment slack */ + kEpiBytes + kRedBytes + kTableBytes;
    static constexpr int kPerStageBytes = kStageBytes + kScaleBytes + 2 * 8;
    static constexpr int kStages = min_int(kMaxStages, (kSmemLimit - kFixedBytes - 16) / kPerStageBytes);

    static constexpr int kOffStages = 0;
    static constexpr int kOffEpi = kStages * kStageBytes;
    static constexpr int kOffScales = kOffEpi + kEpiBytes;
    static constexpr int kOffRed = kOffScales + align_up(kStages * kScaleBytes, 16);
    static constexpr int kOffTables = kOffRed + kRedBytes;
    static constexpr int kOffBars = align_up(kOffTables + kTableBytes, 8);
    static constexpr int kSmemBytes = kOffBars + kStages * 2 * 8 + kMfSwizzleAtomBytes;

    static_assert(kBlockT == 8 || kBlockT == 16 || kBlockT == 32 || kBlockT == 64, "wgmma N (tokens per tile)");
    static_assert(kSubK == 1 || kSubK == 2, "K blocks per stage");
    static_assert(kStages >= 2, "the ring needs two stages");
    static_assert(kSmemBytes <= kSmemLimit, "shared memory map exceeds 227 KB");
    static_assert(kActBytes % kMfSwizzleAtomBytes == 0 && kStageBytes % kMfSwizzleAtomBytes == 0,
                  "every box must start on a 1024-byte swizzle atom");
    static_assert(kEpiRowBytes % kChunk == 0, "staging rows must be 16-byte aligned");
};

/* One struct per kernel, passed by value (__grid_constant__: the tensor maps stay in param space). */
struct decode_params {
    CUtensorMap tmap_w;        /* weights [L * N, K], box [128 rows, 128 bytes], 128B swizzle */
    CUtensorMap tmap_a;        /* activations [a_rows, K], box [kBlockT rows, 128 bytes], 128B swizzle */
    const int32_t *counts;     /* [L] device: rows of each expert */
    const int32_t *offsets;    /* [L] device: first row of each expert */
    const float *a_scales;     /* FP8: [a_rows, K/128] */
    const float *w_scales;     /* FP8: [L, N/128, K/128] */
    uint8_t *out;              /* plain: [a_rows, N] BF16; swiglu: [a_rows, N/2] BF16 or FP8 */
    float *out_scales;         /* swiglu FP8: [a_rows, N/256] */
    int32_t num_experts;       /* L */
    int32_t max_rows;          /* counts are clamped to [0, max_rows] (C for MASKED) */
    int32_t N, K;              /* weight rows per expert, reduction elements */
    int32_t ue8m0;             /* swiglu FP8: power-of-two h scales */
};

/* One tile of work: expert, n-block, first row of its token block, valid rows (1..kBlockT). */
struct tile_t {
    int32_t e, nb, row0, valid;
};

/* Shared-memory tables built at kernel start. */
struct tables_t {
    int32_t *rows;   /* [L] clamped counts */
    int32_t *row0;   /* [L] offsets */
    int32_t *first;  /* [L + 1] first tile of each expert; first[L] = number of tiles */
};

/* Tile `idx` of the walk (monotonic idx; `e` is the walker's cursor, starting at 0). */
template <int kBlockT>
__device__ __forceinline__ bool next_tile(const tables_t &tb, int32_t L, int32_t idx, int32_t &e, tile_t &t) {
    if (idx >= tb.first[L]) return false;
    while (tb.first[e + 1] <= idx) e++;
    const int32_t rows = tb.rows[e], blocks = (rows + kBlockT - 1) / kBlockT, local = idx - tb.first[e];
    const int32_t tok = local % blocks;
    t.e = e;
    t.nb = local / blocks;
    t.row0 = tb.row0[e] + tok * kBlockT;
    const int32_t left = rows - tok * kBlockT;
    t.valid = left < kBlockT ? left : kBlockT;
    return true;
}

/* ---- producer: one warp; lane 0 issues the TMA, all lanes the FP8 scale cp.asyncs ------------- */

template <bool kFp8, int kEpi, int kBlockT, int kSubK>
__device__ __forceinline__ void producer(const decode_params &p, const tables_t &tb, uint8_t *stages, float *scales,
                                         uint64_t *full, uint64_t *empty) {
    using C = cfg<kFp8, kEpi, kBlockT, kSubK>;
    const int lane = (int)(threadIdx.x & 31);
    const int32_t kblocks = p.K * C::kEsz / kKBlock;           /* = K/128 scale columns for FP8 */
    const int32_t nstages = kblocks / kSubK;
    const int32_t scale_rows = p.N / kBoxRows;                 /* weight scale rows per expert */
    const int32_t half = p.N / 2;                              /* swiglu: first up row */
    const uint64_t pol_w = mf__l2_policy(kMfL2EvictFirst);    /* weights: read once */
    const uint64_t pol_a = mf__l2_policy(kMfL2EvictLast);     /* activations: read by every n-block */
    if (lane == 0) {
        mf__prefetch_tensormap(&p.tmap_w);
        mf__prefetch_tensormap(&p.tmap_a);
    }
    uint32_t it = 0;
    int32_t cursor = 0;
    tile_t t;
    for (int32_t idx = (int32_t)blockIdx.x; next_tile<kBlockT>(tb, p.num_experts, idx, cursor, t);
         idx += (int32_t)gridDim.x) {
        /* weight rows of box b (gate, up) and its scale row */
        const int32_t wrow0 = t.e * p.N + t.nb * kBoxRows;
        const int32_t srow0 = t.e * scale_rows + t.nb;
        for (int32_t ks = 0; ks < nstages; ks++, it++) {
            const uint32_t slot = it % C::kStages;
            mf__mbar_wait_tag(&empty[slot], ((it / C::kStages) & 1u) ^ 1u, kTagProducerEmpty);
            uint8_t *st = stages + slot * C::kStageBytes;
            if constexpr (kFp8) {
                float *sc = scales + slot * (kSubK * C::kScaleStride);
#pragma unroll
                for (int s = 0; s < kSubK; s++) {
                    const int32_t kb = ks * kSubK + s;
#pragma unroll
                    for (int tk = lane; tk < kBlockT; tk += 32) {
                        /* tokens past counts[e] copy the last valid token's scale: their D columns are
                         * never stored, and the row past the expert may lie past the tensor */
                        const int32_t row = t.row0 + (tk < t.valid ? tk : t.valid - 1);
                        mf__cp_async_4(sc + s * C::kScaleStride + tk, p.a_scales + (int64_t)row * kblocks + kb);
                    }
                    if (lane < C::kBoxes) {
                        const int32_t srow = srow0 + (kEpi == kEpiSwiglu ? lane * (half / kBoxRows) : 0);
                        mf__cp_async_4(sc + s * C::kScaleStride + kBlockT + lane, p.w_scales + (int64_t)srow * kblocks + kb);
                    }
                }
                mf__cp_async_mbar_arrive_noinc(&full[slot]); /* one of full's 1 + 32 arrivals */
            }
            __syncwarp();
            if (lane == 0) {
                mf__mbar_arrive_expect_tx(&full[slot], (uint32_t)C::kStageBytes);
#pragma unroll
                for (int s = 0; s < kSubK; s++) {
                    const int32_t kc = (ks * kSubK + s) * (kKBlock / C::kEsz); /* K coordinate, elements */
                    uint8_t *base = st + s * C::kKBlockBytes;
#pragma unroll
                    for (int b = 0; b < C::kBoxes; b++)
                        mf__tma_load_2d_hint(base + b * kBoxBytes, &p.tmap_w, &full[slot], kc, wrow0 + b * half, pol_w);
                    mf__tma_load_2d_hint(base + C::kBoxes * kBoxBytes, &p.tmap_a, &full[slot], kc, t.row0, pol_a);
                }
            }
        }
    }
    if constexpr (kFp8) mf__cp_async_wait_all();
}

/* ---- consumers: two warpgroups, 64 weight rows each per box ----------------------------------- */

/* Staging tile -> out rows [row0, row0 + valid), columns [col0, col0 + 128), 16 bytes per store. */
template <int kBlockT, int kOutEsz, int kEpiRowBytes>
__device__ __forceinline__ void store_tile(const uint8_t *epi, uint8_t *out, int64_t out_ld, const tile_t &t, int ctid) {
    constexpr int kChunksPerRow = kTileCols * kOutEsz / kChunk;
    const int64_t col0 = (int64_t)t.nb * kTileCols;
#pragma unroll
    for (int c = ctid; c < kBlockT * kChunksPerRow; c += kConsumerThreads) {
        const int token = c / kChunksPerRow, ch = c % kChunksPerRow;
        if (token < t.valid)
            *(uint4 *)(out + ((int64_t)(t.row0 + token) * out_ld + col0) * kOutEsz + ch * kChunk) =
                *(const uint4 *)(epi + token * kEpiRowBytes + ch * kChunk);
    }
}

template <bool kFp8, int kEpi, int kBlockT, int kSubK>
__device__ __forceinline__ void consumer(const decode_params &p, const tables_t &tb, uint8_t *stages, const float *scales,
                                         uint8_t *epi, float *red, uint64_t *full, uint64_t *empty) {
    using C = cfg<kFp8, kEpi, kBlockT, kSubK>;
    constexpr int kFrag = kBlockT / 2;          /* accumulators per thread per 64-row block */
    const int ctid = (int)threadIdx.x - kMfWarpgroupThreads; /* 0..255 */
    const int wg = ctid / kMfWarpgroupThreads;  /* consumer warpgroup: weight rows [64 wg, 64 wg + 64) */
    const int warp = (ctid / 32) % 4, lane = ctid & 31;
    const int quad = lane & 3, group = lane >> 2;
    const int32_t kblocks = p.K * C::kEsz / kKBlock;
    const int32_t nstages = kblocks / kSubK;
    const int64_t out_ld = kEpi == kEpiSwiglu ? p.N / 2 : p.N;
    const uint64_t desc_stages = mf__wgmma_desc_sw128(stages);
    /* fragment (j, h, b) = acc[4j + 2h + b] sits at D[row 16 warp + group + 8h][token 8j + 2 quad + b] */
    const int col_base = wg * kWgRows + warp * 16 + group; /* tile column (weight row) of h = 0 */

    float tmp[C::kBoxes][kFrag];
#pragma unroll
    for (int b = 0; b < C::kBoxes; b++)
#pragma unroll
        for (int i = 0; i < kFrag; i++) tmp[b][i] = 0.0f;

    uint32_t it = 0;
    int32_t cursor = 0;
    tile_t t;
    for (int32_t idx = (int32_t)blockIdx.x; next_tile<kBlockT>(tb, p.num_experts, idx, cursor, t);
         idx += (int32_t)gridDim.x) {
        float acc[C::kBoxes][kFrag];
#pragma unroll
        for (int b = 0; b < C::kBoxes; b++)
#pragma unroll
            for (int i = 0; i < kFrag; i++) acc[b][i] = 0.0f;

        for (int32_t ks = 0; ks < nstages; ks++, it++) {
            const uint32_t slot = it % C::kStages;
            mf__mbar_wait_tag(&full[slot], (it / C::kStages) & 1u, kTagConsumerFull);
            const uint64_t dslot = desc_stages + (uint64_t)((slot * C::kStageBytes) >> 4);
#pragma unroll
            for (int s = 0; s < kSubK; s++) {
                const uint32_t koff = (uint32_t)(s * C::kKBlockBytes);
                uint64_t da[C::kBoxes];
#pragma unroll
                for (int b = 0; b < C::kBoxes; b++)
                    da[b] = mf__wgmma_desc_advance(dslot, koff + b * kBoxBytes + wg * kWgOperandBytes);
                const uint64_t db = mf__wgmma_desc_advance(dslot, koff + C::kBoxes * kBoxBytes);
                if constexpr (kFp8) {
#pragma unroll
                    for (int b = 0; b < C::kBoxes; b++) mf__fence_fragment<kBlockT>(tmp[b]); /* last promotion's reads first */
                    mf__wgmma_fence();
#pragma unroll
                    for (int k = 0; k < kKSteps; k++)
#pragma unroll
                        for (int b = 0; b < C::kBoxes; b++)
                            mf__wgmma_e4m3<kBlockT>(tmp[b], mf__wgmma_desc_advance(da[b], k * kKStepBytes),
                                                    mf__wgmma_desc_advance(db, k * kKStepBytes), k > 0 ? 1 : 0);
                    mf__wgmma_commit();
                    mf__wgmma_wait<0>();
#pragma unroll
                    for (int b = 0; b < C::kBoxes; b++) mf__fence_fragment<kBlockT>(tmp[b]);
                    /* promotion of this K block: acc += tmp * (a_scale[token] * w_scale[box]) */
                    const float *sc = scales + slot * (kSubK * C::kScaleStride) + s * C::kScaleStride;
                    float ws[C::kBoxes];
#pragma unroll
                    for (int b = 0; b < C::kBoxes; b++) ws[b] = sc[kBlockT + b];
#pragma unroll
                    for (int j = 0; j < kBlockT / 8; j++) {
                        const float2 as = *(const float2 *)(sc + 8 * j + 2 * quad);
#pragma unroll
                        for (int b = 0; b < C::kBoxes; b++) {
                            const float s0 = as.x * ws[b], s1 = as.y * ws[b];
                            acc[b][4 * j + 0] += tmp[b][4 * j + 0] * s0;
                            acc[b][4 * j + 1] += tmp[b][4 * j + 1] * s1;
                            acc[b][4 * j + 2] += tmp[b][4 * j + 2] * s0;
                            acc[b][4 * j + 3] += tmp[b][4 * j + 3] * s1;
                        }
                    }
                } else {
#pragma unroll
                    for (int b = 0; b < C::kBoxes; b++) mf__fence_fragment<kBlockT>(acc[b]); /* zeroing first */
                    mf__wgmma_fence();
#pragma unroll
                    for (int k = 0; k < kKSteps; k++)
#pragma unroll
                        for (int b = 0; b < C::kBoxes; b++)
                            mf__wgmma_bf16<kBlockT>(acc[b], mf__wgmma_desc_advance(da[b], k * kKStepBytes),
                                                    mf__wgmma_desc_advance(db, k * kKStepBytes), 1);
                    mf__wgmma_commit();
                }
            }
            if constexpr (!kFp8) {
                mf__wgmma_wait<0>();
#pragma unroll
                for (int b = 0; b < C::kBoxes; b++) mf__fence_fragment<kBlockT>(acc[b]);
            }
            __syncwarp();
            if (lane == 0) mf__mbar_arrive(&empty[slot]); /* this warp is done with the stage */
        }

        /* ---- epilogue ---- */
        if constexpr (kEpi == kEpiSwiglu) {
#pragma unroll
            for (int i = 0; i < kFrag; i++) acc[0][i] = mf__silu(acc[0][i]) * acc[1][i];
        }
        mf__named_barrier_sync(kBarEpilogue, kConsumerThreads); /* the previous tile's stores are done */
        if constexpr (C::kOutEsz == 2) {
#pragma unroll
            for (int j = 0; j < kBlockT / 8; j++)
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int b = 0; b < 2; b++) {
                        const int token = 8 * j + 2 * quad + b, col = col_base + 8 * h;
                        *(uint16_t *)(epi + token * C::kEpiRowBytes + col * 2) = mf__bf16_from_float(acc[0][4 * j + 2 * h + b]);
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
            const int32_t h_blocks = (int32_t)(out_ld / MF__QUANT_BLOCK);
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
                    mf__fp8_block_scale(amax, p.ue8m0, &scale, &inv);
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        epi[token * C::kEpiRowBytes + col_base + 8 * h] = mf__fp8_from_float(acc[0][4 * j + 2 * h + b] * inv);
                    if (wg == 0 && warp == 0 && group == 0 && token < t.valid)
                        p.out_scales[(int64_t)(t.row0 + token) * h_blocks + t.nb] = scale;
                }
        }
        mf__named_barrier_sync(kBarEpilogue, kConsumerThreads); /* the staging tile is complete */
        store_tile<kBlockT, C::kOutEsz, C::kEpiRowBytes>(epi, p.out, out_ld, t, ctid);
    }
}

template <bool kFp8, int kEpi, int kBlockT, int kSubK>
__global__ void __launch_bounds__(kThreads, 1) sm90_decode_kernel(const __grid_constant__ decode_params p) {
    using C = cfg<kFp8, kEpi, kBlockT, kSubK>;
    /* full[s]: the producer's arrive.expect_tx, + (FP8) one cp.async arrival per producer lane */
    constexpr uint32_t kFullArrivals = kFp8 ? 1 + 32 : 1;
    extern __shared__ uint8_t smem_raw[];
    /* 128B-swizzled TMA boxes and wgmma operands need 1024-byte aligned shared addresses */
    uint8_t *smem = smem_raw + ((kMfSwizzleAtomBytes - (mf__smem_addr(smem_raw) & (kMfSwizzleAtomBytes - 1))) &
                                (kMfSwizzleAtomBytes - 1));
    uint8_t *stages = smem + C::kOffStages;
    uint8_t *epi = smem + C::kOffEpi;
    float *scales = (float *)(smem + C::kOffScales);
    float *red = (float *)(smem + C::kOffRed);
    tables_t tb;
    tb.rows = (int32_t *)(smem + C::kOffTables);
    tb.row0 = tb.rows + kMaxExperts;
    tb.first = tb.row0 + kMaxExperts;
    uint64_t *full = (uint64_t *)(smem + C::kOffBars);
    uint64_t *empty = full + C::kStages;

    /* ---- setup: expert tables, barriers ---- */
    const int L = p.num_experts;
    const int32_t nblocks = kEpi == kEpiSwiglu ? p.N / (2 * kTileCols) : p.N / kTileCols; /* n-blocks per expert */
    for (int e = (int)threadIdx.x; e < L; e += kThreads) {
        int32_t n = p.counts[e];
        n = n < 0 ? 0 : (n > p.max_rows ? p.max_rows : n);
        tb.rows[e] = n;
        tb.row0[e] = p.offsets[e];
    }
    if (threadIdx.x == 0) {
        for (int s = 0; s < C::kStages; s++) {
            mf__mbar_init(&full[s], kFullArrivals);
            mf__mbar_init(&empty[s], kConsumerWarps);
        }
        mf__fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        /* first[e] = sum of the tiles of experts < e: each lane sums a run of experts, then a warp scan */
        const int lane = (int)threadIdx.x, per = (L + 31) / 32;
        const int lo = min_int(L, lane * per), hi = min_int(L, lo + per);
        int32_t local = 0;
        for (int e = lo; e < hi; e++) local += tb.rows[e] > 0 ? nblocks * ((tb.rows[e] + kBlockT - 1) / kBlockT) : 0;
        int32_t incl = local;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int32_t v = __shfl_up_sync(0xffffffffu, incl, off);
            if (lane >= off) incl += v;
        }
        int32_t base = incl - local;
        for (int e = lo; e < hi; e++) {
            tb.first[e] = base;
            base += tb.rows[e] > 0 ? nblocks * ((tb.rows[e] + kBlockT - 1) / kBlockT) : 0;
        }
        if (lane == 31) tb.first[L] = incl;
    }
    __syncthreads();

    if (mf__warpgroup_id() == 0) {
        mf__setmaxnreg_dec<kProducerRegs>();
        if (mf__warp_id() == 0) producer<kFp8, kEpi, kBlockT, kSubK>(p, tb, stages, scales, full, empty);
    } else {
        mf__setmaxnreg_inc<kConsumerRegs>();
        consumer<kFp8, kEpi, kBlockT, kSubK>(p, tb, stages, scales, epi, red, full, empty);
    }
}

} /* namespace mf__decode */

/* ================================================================================================
 * host: launch plans
 * ============================================================================================== */

using namespace mf__decode;

#define CUDA_OK(call)                                                                                    \
    do {                                                                                                 \
        cudaError_t e_ = (call);                                                                         \
        if (e_ != cudaSuccess) cuda_fatal(e_, #call, __FILE__, __LINE__);                                \
    } while (0)

static const char *g_case = "setup";          /* the case running now, named in every fatal error */
static mf__sm90_fault_t *g_fault = NULL;      /* mapped host memory: timed-out waits report here */

static void cuda_fatal(cudaError_t e, const char *what, const char *file, int line) {
    fprintf(stderr, "FATAL [case %s] %s:%d: %s failed: %s\n", g_case, file, line, what, cudaGetErrorString(e));
    if (g_fault && g_fault->magic == kMfSm90FaultMagic)
        fprintf(stderr, "FATAL [case %s] mbarrier wait timed out: block %u thread %u smem 0x%x parity %u tag %u (%s)\n",
                g_case, g_fault->block, g_fault->thread, g_fault->smem, g_fault->parity, g_fault->tag,
                g_fault->tag == kTagProducerEmpty ? "producer waiting for a free stage"
                : g_fault->tag == kTagConsumerFull ? "consumer waiting for a full stage" : "?");
    exit(3);
}

struct kernel_info {
    const void *fn;
    int smem, stages;
};

template <bool kFp8, int kEpi, int kBlockT, int kSubK>
static kernel_info info_of() {
    using C = cfg<kFp8, kEpi, kBlockT, kSubK>;
    kernel_info k = {(const void *)sm90_decode_kernel<kFp8, kEpi, kBlockT, kSubK>, C::kSmemBytes, C::kStages};
    return k;
}

template <bool kFp8, int kEpi, int kBlockT>
static bool pick_subk(int sub_k, kernel_info *k) {
    if (sub_k == 1) *k = info_of<kFp8, kEpi, kBlockT, 1>();
    else if (sub_k == 2) *k = info_of<kFp8, kEpi, kBlockT, 2>();
    else return false;
    return true;
}

template <bool kFp8, int kEpi>
static bool pick_block(int block_t, int sub_k, kernel_info *k) {
    switch (block_t) {
    case 8: return pick_subk<kFp8, kEpi, 8>(sub_k, k);
    case 16: return pick_subk<kFp8, kEpi, 16>(sub_k, k);
    case 32: return pick_subk<kFp8, kEpi, 32>(sub_k, k);
    case 64: return pick_subk<kFp8, kEpi, 64>(sub_k, k);
    default: return false;
    }
}

static bool pick_kernel(int fp8, int epi, int block_t, int sub_k, kernel_info *k) {
    if (fp8) return epi == kEpiSwiglu ? pick_block<true, kEpiSwiglu>(block_t, sub_k, k) : pick_block<true, kEpiPlain>(block_t, sub_k, k);
    return epi == kEpiSwiglu ? pick_block<false, kEpiSwiglu>(block_t, sub_k, k) : pick_block<false, kEpiPlain>(block_t, sub_k, k);
}

/* What one call computes (host description; all pointers device memory). */
struct decode_args {
    int fp8, epi, ue8m0;
    int L, N, K;                 /* N weight rows per expert (2I for swiglu) */
    const void *a;               /* [a_rows, K] */
    const float *a_scales;       /* FP8 [a_rows, K/128] */
    int64_t a_rows;
    const void *w;               /* [L, N, K] */
    const float *w_scales;       /* FP8 [L, N/128, K/128] */
    const int32_t *counts, *offsets;
    int max_rows;                /* clamp of counts[e] */
    int rows_hint;               /* host bound on counts, picks kBlockT (correct for any counts) */
    void *out;
    float *out_scales;
    int block_t, sub_k;          /* 0 = auto */
};

struct launch_plan {
    kernel_info k;
    decode_params params;
    int grid, block_t, sub_k;
};

static int auto_block_t(int rows_hint) { return rows_hint <= 8 ? 8 : rows_hint <= 16 ? 16 : rows_hint <= 32 ? 32 : 64; }

/* Checks the arguments, picks the kernel, encodes the tensor maps; false with `why` on refusal. */
static bool make_plan(const decode_args &a, launch_plan *pl, std::string *why) {
    char buf[256];
    const int esz = a.fp8 ? 1 : 2;
    pl->block_t = a.block_t ? a.block_t : auto_block_t(a.rows_hint);
    pl->sub_k = a.sub_k ? a.sub_k : 1;
    const int64_t kbytes = (int64_t)a.K * esz;
    const int nmult = a.epi == kEpiSwiglu ? 2 * kTileCols : kTileCols;
#define REFUSE(...)                              \
    do {                                         \
        snprintf(buf, sizeof buf, __VA_ARGS__);  \
        *why = buf;                              \
        return false;                            \
    } while (0)
    if (a.L < 1 || a.L > kMaxExperts) REFUSE("L = %d outside [1, %d]", a.L, kMaxExperts);
    if (a.N <= 0 || a.N % nmult) REFUSE("N = %d not a positive multiple of %d", a.N, nmult);
    if (a.K <= 0 || kbytes % (kKBlock * pl->sub_k)) REFUSE("K = %d: K bytes not a multiple of %d", a.K, kKBlock * pl->sub_k);
    if ((int64_t)a.L * a.N > INT32_MAX || a.a_rows > INT32_MAX) REFUSE("tensor too large for int32 TMA coordinates");
    if (a.fp8 && (!a.a_scales || !a.w_scales)) REFUSE("FP8 needs a_scales and w_scales");
    if (a.fp8 && a.epi == kEpiSwiglu && !a.out_scales) REFUSE("FP8 swiglu needs out_scales");
    if (((uintptr_t)a.a | (uintptr_t)a.w | (uintptr_t)a.out) % 16) REFUSE("a, w, out must be 16-byte aligned");
    if (!pick_kernel(a.fp8, a.epi, pl->block_t, pl->sub_k, &pl->k)) REFUSE("no kernel for block_t %d sub_k %d", pl->block_t, pl->sub_k);
    memset(&pl->params, 0, sizeof pl->params);
    decode_params &p = pl->params;
    const CUtensorMapDataType dt = a.fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    CUresult r = mf__tma_encode_2d(&p.tmap_w, dt, a.w, (uint64_t)a.K, (uint64_t)a.L * a.N, (uint64_t)kbytes,
                                   (uint32_t)(kKBlock / esz), (uint32_t)kBoxRows, CU_TENSOR_MAP_SWIZZLE_128B);
    if (r != CUDA_SUCCESS) REFUSE("weight tensor map: CUresult %d", (int)r);
    r = mf__tma_encode_2d(&p.tmap_a, dt, a.a, (uint64_t)a.K, (uint64_t)a.a_rows, (uint64_t)kbytes, (uint32_t)(kKBlock / esz),
                          (uint32_t)pl->block_t, CU_TENSOR_MAP_SWIZZLE_128B);
    if (r != CUDA_SUCCESS) REFUSE("activation tensor map: CUresult %d", (int)r);
#undef REFUSE
    p.counts = a.counts;
    p.offsets = a.offsets;
    p.a_scales = a.a_scales;
    p.w_scales = a.w_scales;
    p.out = (uint8_t *)a.out;
    p.out_scales = a.out_scales;
    p.num_experts = a.L;
    p.max_rows = a.max_rows;
    p.N = a.N;
    p.K = a.K;
    p.ue8m0 = a.ue8m0;
    int dev = 0, sms = 0;
    CUDA_OK(cudaGetDevice(&dev));
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    pl->grid = sms;
    CUDA_OK(cudaFuncSetAttribute(pl->k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, pl->k.smem));
    cudaFuncAttributes fa;
    CUDA_OK(cudaFuncGetAttributes(&fa, pl->k.fn));
    if (fa.numRegs != kLaunchRegs) {
        /* setmaxnreg balances a CTA of exactly kLaunchRegs registers per thread; with fewer, the
         * consumers' setmaxnreg.inc would wait forever. */
        snprintf(buf, sizeof buf, "kernel has %d registers per thread, setmaxnreg assumes %d", fa.numRegs, kLaunchRegs);
        *why = buf;
        return false;
    }
    return true;
}

static void launch(const launch_plan &pl, cudaStream_t stream) {
    void *args[] = {(void *)&pl.params};
    CUDA_OK(cudaLaunchKernel(pl.k.fn, dim3((unsigned)pl.grid), dim3(kThreads), args, (size_t)pl.k.smem, stream));
}

/* ================================================================================================
 * host: data, layouts, the CPU oracle
 * ============================================================================================== */

static int g_failures = 0;

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rnd_unit(void) { return (double)(rnd_u64() >> 11) * (1.0 / 9007199254740992.0); }

/* Random BF16 [rows, cols] in [-mag, mag) with a per-128-block magnitude spread of 2^[-2, 2], never 0. */
static void fill_bf16(uint16_t *x, int64_t rows, int64_t cols, float mag) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c0 = 0; c0 < cols; c0 += 128) {
            const float m = mag * exp2f((float)(4.0 * rnd_unit() - 2.0));
            for (int64_t c = c0; c < cols && c < c0 + 128; c++) {
                float v = (float)(2.0 * rnd_unit() - 1.0) * m;
                if (v == 0.0f) v = 0.5f * m;
                x[r * cols + c] = mf__bf16_from_float(v);
            }
        }
}

/* [batch, rows, cols] BF16 -> FP8 in 128x128 blocks (weights), with numerics.h as the library does. */
static void quant_128x128(const uint16_t *x, int64_t batch, int64_t rows, int64_t cols, uint8_t *q, float *scales) {
    const int64_t rb = rows / 128, cb = cols / 128;
    for (int64_t z = 0; z < batch; z++)
        for (int64_t br = 0; br < rb; br++)
            for (int64_t bc = 0; bc < cb; bc++) {
                const int64_t base = z * rows * cols + br * 128 * cols + bc * 128;
                float amax = 0.0f, scale, inv;
                for (int r = 0; r < 128; r++)
                    for (int c = 0; c < 128; c++) {
                        const float v = fabsf(mf__bf16_to_float(x[base + r * cols + c]));
                        amax = v > amax ? v : amax;
                    }
                mf__fp8_block_scale(amax, 0, &scale, &inv);
                scales[(z * rb + br) * cb + bc] = scale;
                for (int r = 0; r < 128; r++)
                    for (int c = 0; c < 128; c++)
                        q[base + r * cols + c] = mf__fp8_from_float(mf__bf16_to_float(x[base + r * cols + c]) * inv);
            }
}

/* Rows of the activation tensor and who owns them. */
struct layout_t {
    std::vector<int32_t> counts, offsets; /* [L], [L + 1] */
    std::vector<int> owner;               /* [rows]: expert or -1 */
    int64_t rows = 0;
    int max_rows = 0;                     /* clamp passed to the kernel */
    int max_count = 0;
};

/* EXPERT_MAJOR (C == 0): segments start at multiples of 128 and the tensor ends right after the last
 * expert's last row (a box past it reads TMA zeros); MASKED: offsets e * C, rows = L * C. */
static layout_t make_layout(const std::vector<int> &counts, int C) {
    layout_t lo;
    const int L = (int)counts.size();
    lo.counts.assign(counts.begin(), counts.end());
    lo.offsets.resize((size_t)L + 1);
    int64_t at = 0;
    for (int e = 0; e < L; e++) {
        at = C ? (int64_t)e * C : (at + MF__DEFAULT_BLOCK_M - 1) / MF__DEFAULT_BLOCK_M * MF__DEFAULT_BLOCK_M;
        lo.offsets[(size_t)e] = (int32_t)at;
        at += C ? C : counts[(size_t)e];
        lo.max_count = std::max(lo.max_count, counts[(size_t)e]);
    }
    lo.rows = std::max<int64_t>(at, 1);
    lo.offsets[(size_t)L] = (int32_t)at;
    lo.max_rows = C ? C : std::max(lo.max_count, 1);
    lo.owner.assign((size_t)lo.rows, -1);
    for (int e = 0; e < L; e++)
        for (int j = 0; j < counts[(size_t)e]; j++) lo.owner[(size_t)(lo.offsets[(size_t)e] + j)] = e;
    return lo;
}

/* Garbage in every row no expert owns: random bytes with NaN / Inf patterns sprinkled in. */
static void garble_rows(const layout_t &lo, uint8_t *data, int64_t row_bytes, float *scales, int64_t scale_cols) {
    for (int64_t r = 0; r < lo.rows; r++) {
        if (lo.owner[(size_t)r] >= 0) continue;
        for (int64_t b = 0; b < row_bytes; b++) {
            uint8_t v = (uint8_t)rnd_u64();
            if (b % 7 == 0) v = (b / 7) % 2 ? 0xFF : 0x7F; /* E4M3 NaN; BF16 NaN/Inf halves */
            data[r * row_bytes + b] = v;
        }
        for (int64_t c = 0; scales && c < scale_cols; c++) {
            const uint32_t pat[4] = {0xFFFFFFFFu, 0x7F800000u, 0x7FC00000u, (uint32_t)rnd_u64()};
            memcpy(&scales[r * scale_cols + c], &pat[c % 4], 4);
        }
    }
}

template <typename T>
static T *to_device(const std::vector<T> &v) {
    T *d = NULL;
    CUDA_OK(cudaMalloc((void **)&d, std::max<size_t>(v.size() * sizeof(T), 16)));
    if (!v.empty()) CUDA_OK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

template <typename T>
static std::vector<T> to_host(const T *d, size_t n) {
    std::vector<T> v(n);
    if (n) CUDA_OK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
}

/* One validation problem on the host. */
struct problem {
    int fp8, epi, L, N, K, ue8m0;
    layout_t lo;
    std::vector<uint8_t> a, w;       /* FP8 codes or BF16 bytes */
    std::vector<float> as, ws;       /* FP8 scales */
    int64_t out_cols() const { return epi == kEpiSwiglu ? N / 2 : N; }
    int out_esz() const { return (epi == kEpiSwiglu && fp8) ? 1 : 2; }
};

/* CPU oracle (src/cpu/gemm.c: same per-K-block promotion) for the owned rows. Fills `want` with the
 * expected value of every output element ([rows, out_cols]; swiglu FP8: the dequantised
 * requantisation) and, for FP8 h, `want_scales` [rows, I/128]. */
static void oracle(const problem &pb, std::vector<float> &want, std::vector<float> &want_scales) {
    const int64_t K = pb.K, N = pb.N, oc = pb.out_cols(), kb = K / 128;
    const int esz = pb.fp8 ? 1 : 2;
    want.assign((size_t)(pb.lo.rows * oc), 0.0f);
    want_scales.assign((size_t)(pb.lo.rows * std::max<int64_t>(oc / 128, 1)), 0.0f);
    std::vector<float> A((size_t)(MF__CPU_ROWS * K)), As((size_t)(MF__CPU_ROWS * std::max<int64_t>(kb, 1)));
    std::vector<float> Cm((size_t)(MF__CPU_ROWS * N)), hrow((size_t)oc);
    std::vector<uint8_t> q((size_t)oc);
    std::vector<float> qs((size_t)std::max<int64_t>(oc / 128, 1));
    for (int e = 0; e < pb.L; e++) {
        mf__cpu_weight_t w = {pb.w.data() + (size_t)e * N * K * esz, pb.fp8 ? pb.ws.data() + (size_t)e * (N / 128) * kb : NULL,
                              pb.fp8};
        for (int j = 0; j < pb.lo.counts[(size_t)e]; j += MF__CPU_ROWS) {
            const int m = std::min(MF__CPU_ROWS, pb.lo.counts[(size_t)e] - j);
            const int64_t row = pb.lo.offsets[(size_t)e] + j;
            for (int i = 0; i < m; i++)
                for (int64_t k = 0; k < K; k++) {
                    const size_t at = (size_t)((row + i) * K + k);
                    if (pb.fp8) A[(size_t)(i * K + k)] = mf__fp8_to_float(pb.a[at]);
                    else {
                        uint16_t v;
                        memcpy(&v, &pb.a[2 * at], 2);
                        A[(size_t)(i * K + k)] = mf__bf16_to_float(v);
                    }
                }
            if (pb.fp8) memcpy(As.data(), pb.as.data() + row * kb, (size_t)(m * kb) * sizeof(float));
            mf__cpu_gemm_nt(A.data(), As.data(), m, &w, N, K, Cm.data());
            for (int i = 0; i < m; i++) {
                float *dst = want.data() + (row + i) * oc;
                const float *c = Cm.data() + (size_t)i * N;
                if (pb.epi == kEpiPlain) {
                    memcpy(dst, c, (size_t)oc * sizeof(float));
                    continue;
                }
                for (int64_t n = 0; n < oc; n++) hrow[(size_t)n] = mf__silu(c[n]) * c[oc + n];
                if (!pb.fp8) {
                    memcpy(dst, hrow.data(), (size_t)oc * sizeof(float));
                    continue;
                }
                mf__quant_1x128_f32(hrow.data(), oc, pb.ue8m0, q.data(), qs.data());
                for (int64_t n = 0; n < oc; n++) dst[n] = mf__fp8_to_float(q[(size_t)n]) * qs[(size_t)(n / 128)];
                memcpy(want_scales.data() + (row + i) * (oc / 128), qs.data(), (size_t)(oc / 128) * sizeof(float));
            }
        }
    }
}

/* Random problem: activations 1x128-quantised (FP8) or BF16, weights 128x128-quantised or BF16,
 * garbage in every row no expert owns. */
static problem make_problem(int fp8, int epi, int N, int K, const std::vector<int> &counts, int C, int ue8m0) {
    problem pb;
    pb.fp8 = fp8;
    pb.epi = epi;
    pb.L = (int)counts.size();
    pb.N = N;
    pb.K = K;
    pb.ue8m0 = ue8m0;
    pb.lo = make_layout(counts, C);
    const int64_t rows = pb.lo.rows;
    std::vector<uint16_t> ab((size_t)(rows * K)), wb((size_t)pb.L * N * K);
    fill_bf16(ab.data(), rows, K, 1.0f);
    fill_bf16(wb.data(), (int64_t)pb.L * N, K, 1.0f / sqrtf((float)K));
    if (fp8) {
        pb.a.resize((size_t)(rows * K));
        pb.as.resize((size_t)(rows * (K / 128)));
        for (int64_t r = 0; r < rows; r++)
            mf__quant_1x128_bf16(ab.data() + r * K, K, 0, pb.a.data() + r * K, pb.as.data() + r * (K / 128));
        pb.w.resize(wb.size());
        pb.ws.resize((size_t)pb.L * (N / 128) * (K / 128));
        quant_128x128(wb.data(), pb.L, N, K, pb.w.data(), pb.ws.data());
        garble_rows(pb.lo, pb.a.data(), K, pb.as.data(), K / 128);
    } else {
        pb.a.resize(ab.size() * 2);
        memcpy(pb.a.data(), ab.data(), pb.a.size());
        pb.w.resize(wb.size() * 2);
        memcpy(pb.w.data(), wb.data(), pb.w.size());
        garble_rows(pb.lo, pb.a.data(), 2 * (int64_t)K, NULL, 0);
    }
    return pb;
}

/* A problem on the device + its outputs (poisoned). */
struct device_problem {
    uint8_t *a = NULL, *w = NULL, *out = NULL;
    float *as = NULL, *ws = NULL, *out_scales = NULL;
    int32_t *counts = NULL, *offsets = NULL;
    size_t out_bytes = 0, out_scale_count = 0;
    void release() {
        cudaFree(a), cudaFree(w), cudaFree(out), cudaFree(as), cudaFree(ws), cudaFree(out_scales), cudaFree(counts),
            cudaFree(offsets);
    }
};

static const uint8_t kPoison = 0xFF; /* NaN in E4M3, BF16 and fp32 */

static device_problem upload(const problem &pb) {
    device_problem d;
    d.a = to_device(pb.a);
    d.w = to_device(pb.w);
    if (pb.fp8) {
        d.as = to_device(pb.as);
        d.ws = to_device(pb.ws);
    }
    d.counts = to_device(pb.lo.counts);
    d.offsets = to_device(pb.lo.offsets);
    d.out_bytes = (size_t)(pb.lo.rows * pb.out_cols() * pb.out_esz());
    CUDA_OK(cudaMalloc((void **)&d.out, d.out_bytes));
    CUDA_OK(cudaMemset(d.out, kPoison, d.out_bytes));
    if (pb.fp8 && pb.epi == kEpiSwiglu) {
        d.out_scale_count = (size_t)(pb.lo.rows * (pb.out_cols() / 128));
        CUDA_OK(cudaMalloc((void **)&d.out_scales, d.out_scale_count * 4));
        CUDA_OK(cudaMemset(d.out_scales, kPoison, d.out_scale_count * 4));
    }
    return d;
}

static decode_args args_of(const problem &pb, const device_problem &d, int block_t, int sub_k) {
    decode_args a;
    memset(&a, 0, sizeof a);
    a.fp8 = pb.fp8;
    a.epi = pb.epi;
    a.ue8m0 = pb.ue8m0;
    a.L = pb.L;
    a.N = pb.N;
    a.K = pb.K;
    a.a = d.a;
    a.a_scales = d.as;
    a.a_rows = pb.lo.rows;
    a.w = d.w;
    a.w_scales = d.ws;
    a.counts = d.counts;
    a.offsets = d.offsets;
    a.max_rows = pb.lo.max_rows;
    a.rows_hint = pb.lo.max_count;
    a.out = d.out;
    a.out_scales = d.out_scales;
    a.block_t = block_t;
    a.sub_k = sub_k;
    return a;
}

/* Decoded output element (row, col): BF16, or FP8 code x its h scale. */
static double got_value(const problem &pb, const std::vector<uint8_t> &out, const std::vector<float> &scales, int64_t r,
                        int64_t c) {
    const int64_t oc = pb.out_cols();
    if (pb.out_esz() == 2) {
        uint16_t v;
        memcpy(&v, &out[(size_t)(2 * (r * oc + c))], 2);
        return mf__bf16_to_float(v);
    }
    return (double)mf__fp8_to_float(out[(size_t)(r * oc + c)]) * scales[(size_t)(r * (oc / 128) + c / 128)];
}

/* Compares the owned rows (diff measure + element bounds, first mismatches printed) and checks that
 * nothing outside them was written. Returns true when it passes. */
static bool check_outputs(const char *name, const problem &pb, const std::vector<uint8_t> &out,
                          const std::vector<float> &out_scales, const std::vector<float> &want,
                          const std::vector<float> &want_scales, int max_print) {
    const int64_t oc = pb.out_cols(), rows = pb.lo.rows;
    const bool fp8_out = pb.out_esz() == 1;
    const double diff_max = pb.fp8 ? 1e-3 : 1e-5;
    const double rtol = fp8_out ? 0.13 : 1.0 / 128; /* one E4M3 / BF16 ulp */
    double rms = 0;
    int64_t n = 0;
    for (int64_t r = 0; r < rows; r++)
        if (pb.lo.owner[(size_t)r] >= 0)
            for (int64_t c = 0; c < oc; c++, n++) rms += (double)want[(size_t)(r * oc + c)] * want[(size_t)(r * oc + c)];
    rms = n ? sqrt(rms / (double)n) : 0.0;
    const double atol = 1e-5 * rms;
    double sxy = 0, sxx = 0, syy = 0, worst = 0;
    int64_t wrong = 0, scale_wrong = 0, touched = 0;
    bool nonfinite = false;
    for (int64_t r = 0; r < rows; r++) {
        const int owner = pb.lo.owner[(size_t)r];
        if (owner < 0) {
            const size_t rb = (size_t)(oc * pb.out_esz());
            bool t = false;
            for (size_t b = 0; b < rb; b++) t = t || out[(size_t)r * rb + b] != kPoison;
            for (int64_t c = 0; fp8_out && c < oc / 128; c++) {
                uint32_t u;
                memcpy(&u, &out_scales[(size_t)(r * (oc / 128) + c)], 4);
                t = t || u != 0xFFFFFFFFu;
            }
            if (t && touched++ < max_print) printf("    %s: row %lld (no expert owns it) was written\n", name, (long long)r);
            continue;
        }
        for (int64_t c = 0; c < oc; c++) {
            const double x = got_value(pb, out, out_scales, r, c), y = want[(size_t)(r * oc + c)];
            if (!std::isfinite(x) || !std::isfinite(y)) nonfinite = true;
            sxy += x * y;
            sxx += x * x;
            syy += y * y;
            const double hs = fp8_out ? want_scales[(size_t)(r * (oc / 128) + c / 128)] : 0.0;
            const double err = fabs(x - y), bound = rtol * std::max(fabs(x), fabs(y)) + atol + hs / 256.0;
            if (!(err <= bound)) {
                if (wrong < max_print)
                    printf("    %s mismatch: row %lld (expert %d, token %lld of it) col %lld: expected %.8g actual %.8g\n", name,
                           (long long)r, owner, (long long)(r - pb.lo.offsets[(size_t)owner]), (long long)c, y, x);
                wrong++;
            }
            if (err > worst || err != err) worst = err;
        }
        for (int64_t c = 0; fp8_out && c < oc / 128; c++) {
            const double g = out_scales[(size_t)(r * (oc / 128) + c)], w = want_scales[(size_t)(r * (oc / 128) + c)];
            if (!(fabs(g - w) <= 1e-4 * w)) {
                if (scale_wrong < max_print)
                    printf("    %s h_scale mismatch: row %lld block %lld: expected %.8g actual %.8g\n", name, (long long)r,
                           (long long)c, w, g);
                scale_wrong++;
            }
        }
    }
    double diff = (sxx + syy) == 0 ? 0.0 : 1.0 - 2.0 * sxy / (sxx + syy);
    if (nonfinite) diff = INFINITY;
    const bool ok = !nonfinite && diff < diff_max && wrong == 0 && scale_wrong == 0 && touched == 0;
    printf("%s %-44s diff %.2e (max %.0e)  max|err| %.3g  wrong %lld/%lld%s%s\n", ok ? "PASS" : "FAIL", name, diff, diff_max,
           worst, (long long)wrong, (long long)n, scale_wrong ? "  h_scales wrong" : "", touched ? "  rows outside counts written" : "");
    if (!ok) g_failures++;
    return ok;
}

/* ================================================================================================
 * --validate
 * ============================================================================================== */

struct vcase {
    std::string name;
    int fp8, epi, N, K;
    std::vector<int> counts;
    int C;             /* 0: EXPERT_MAJOR, else MASKED capacity */
    int block_t;       /* 0: auto from max count */
    int sub_k;
    int ue8m0;
    bool graph;        /* also replay through a captured CUDA graph (bitwise equal) */
};

static void run_vcase(const vcase &vc, int max_print) {
    char name[160];
    snprintf(name, sizeof name, "%s", vc.name.c_str());
    g_case = vc.name.c_str();
    problem pb = make_problem(vc.fp8, vc.epi, vc.N, vc.K, vc.counts, vc.C, vc.ue8m0);
    device_problem d = upload(pb);
    launch_plan pl;
    std::string why;
    if (!make_plan(args_of(pb, d, vc.block_t, vc.sub_k), &pl, &why)) {
        printf("FAIL %-44s refused: %s\n", name, why.c_str());
        g_failures++;
        d.release();
        return;
    }
    snprintf(name, sizeof name, "%s [T%d S%d st%d]", vc.name.c_str(), pl.block_t, pl.sub_k, pl.k.stages);
    launch(pl, 0);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> out = to_host(d.out, d.out_bytes);
    std::vector<float> out_scales = to_host(d.out_scales, d.out_scale_count);
    std::vector<float> want, want_scales;
    oracle(pb, want, want_scales);
    check_outputs(name, pb, out, out_scales, want, want_scales, max_print);

    /* determinism: a second run (and a graph replay) must write the same bits */
    CUDA_OK(cudaMemset(d.out, kPoison, d.out_bytes));
    if (vc.graph) {
        cudaStream_t s;
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        launch(pl, s);
        CUDA_OK(cudaStreamEndCapture(s, &g));
        CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
        CUDA_OK(cudaGraphLaunch(ge, s));
        CUDA_OK(cudaStreamSynchronize(s));
        CUDA_OK(cudaGraphExecDestroy(ge));
        CUDA_OK(cudaGraphDestroy(g));
        CUDA_OK(cudaStreamDestroy(s));
    } else {
        launch(pl, 0);
        CUDA_OK(cudaDeviceSynchronize());
    }
    std::vector<uint8_t> out2 = to_host(d.out, d.out_bytes);
    std::vector<float> out_scales2 = to_host(d.out_scales, d.out_scale_count);
    const bool same = out == out2 && !memcmp(out_scales.data(), out_scales2.data(), out_scales.size() * 4);
    printf("%s %-44s %s bitwise equal to the first run\n", same ? "PASS" : "FAIL", name, vc.graph ? "graph replay" : "second run");
    if (!same) g_failures++;
    d.release();
}

static void run_validate(void) {
    printf("# --validate: CPU oracle (src/cpu/gemm.c per-K-block promotion), outputs poisoned with 0xFF,\n"
           "# garbage (incl. NaN) in every row no expert owns; diff = 1 - 2 sum(xy) / sum(x^2 + y^2)\n");
    const int P = kEpiPlain, S = kEpiSwiglu;
    const std::vector<int> c1 = {5, 0, 64}, c2 = {1, 17, 33};
    std::vector<vcase> cases;
    for (int fp8 = 1; fp8 >= 0; fp8--)
        for (int epi = 0; epi < 2; epi++) {
            const int N = epi == S ? 512 : 384;
            const char *tag = fp8 ? (epi == S ? "fp8 swiglu" : "fp8 plain") : (epi == S ? "bf16 swiglu" : "bf16 plain");
            struct {
                const char *what;
                std::vector<int> counts;
                int C, block_t;
            } v[] = {
                {"{5,0,64} expert-major", c1, 0, 0},      {"{5,0,64} masked C=72", c1, 72, 0},
                {"{1,17,33} expert-major", c2, 0, 0},     {"{1,17,33} masked C=40", c2, 40, 0},
                {"{5,0,64} masked C=72 T16", c1, 72, 16}, {"{1,17,33} expert-major T8", c2, 0, 8},
                {"{1,17,33} masked C=40 T32", c2, 40, 32},
            };
            for (auto &x : v) cases.push_back({std::string(tag) + " " + x.what, fp8, epi, N, 384, x.counts, x.C, x.block_t, 1, 0, false});
        }
    /* two K blocks per stage, UE8M0 h scales, a graph replay */
    cases.push_back({"fp8 plain K=512 S2 masked C=40", 1, P, 384, 512, c2, 40, 0, 2, 0, true});
    cases.push_back({"fp8 swiglu K=512 S2 expert-major", 1, S, 512, 512, c1, 0, 0, 2, 0, false});
    cases.push_back({"bf16 plain K=512 S2 expert-major", 0, P, 384, 512, c1, 0, 0, 2, 0, true});
    cases.push_back({"bf16 swiglu K=512 S2 masked C=40 T16", 0, S, 512, 512, c2, 40, 16, 2, 0, false});
    cases.push_back({"fp8 swiglu ue8m0 masked C=72", 1, S, 512, 384, c1, 72, 0, 1, 1, false});
    /* many experts, most empty, one over kBlockT (two token blocks) */
    cases.push_back({"fp8 plain L=40 sparse masked C=80", 1, P, 256, 256,
                     {0, 3, 0, 0, 70, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2},
                     80, 0, 1, 0, false});
    {
        std::vector<int> many(300, 0);
        for (int e = 0; e < 300; e += 7) many[(size_t)e] = 1 + e % 5;
        many[299] = 3;
        cases.push_back({"bf16 plain L=300 sparse expert-major", 0, P, 128, 128, many, 0, 0, 1, 0, false});
    }
    /* DeepSeek-V3 shapes (W13: N = 2I = 4096, K = H = 7168; W2: N = H = 7168, K = I = 2048) */
    const std::vector<int> ds = {8, 8, 8, 8};
    cases.push_back({"deepseek w13 fp8 swiglu {8,8,8,8} masked", 1, S, 4096, 7168, ds, 16, 0, 1, 0, true});
    cases.push_back({"deepseek w2 fp8 plain {8,8,8,8} expert-major", 1, P, 7168, 2048, ds, 0, 0, 1, 0, false});
    cases.push_back({"deepseek w13 bf16 swiglu {8,8,8,8} expert-major", 0, S, 4096, 7168, ds, 0, 0, 1, 0, false});
    cases.push_back({"deepseek w2 bf16 plain {8,8,8,8} masked", 0, P, 7168, 2048, ds, 16, 0, 1, 0, false});
    for (const vcase &vc : cases) run_vcase(vc, 4);
}

/* ================================================================================================
 * --selftest: one tile, structured inputs, first mismatch printed
 * ============================================================================================== */

/* Runs one tile and prints the first mismatches as (token, column, expected, actual). */
static void selftest_case(const char *name, problem &pb, int max_print) {
    g_case = name;
    device_problem d = upload(pb);
    launch_plan pl;
    std::string why;
    if (!make_plan(args_of(pb, d, 0, 1), &pl, &why)) {
        printf("FAIL %-44s refused: %s\n", name, why.c_str());
        g_failures++;
        d.release();
        return;
    }
    launch(pl, 0);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> out = to_host(d.out, d.out_bytes);
    std::vector<float> out_scales = to_host(d.out_scales, d.out_scale_count);
    std::vector<float> want, want_scales;
    oracle(pb, want, want_scales);
    if (!check_outputs(name, pb, out, out_scales, want, want_scales, max_print)) {
        /* the pattern of a mapping bug is easier to read as a picture: token 0 across the columns,
         * column 0 across the tokens */
        printf("    token 0, columns 0..15  expected:");
        for (int c = 0; c < 16; c++) printf(" %g", want[(size_t)c]);
        printf("\n    token 0, columns 0..15  actual:  ");
        for (int c = 0; c < 16; c++) printf(" %g", got_value(pb, out, out_scales, 0, c));
        printf("\n    column 0, tokens 0..15  expected:");
        for (int r = 0; r < 16 && r < pb.lo.rows; r++) printf(" %g", want[(size_t)(r * pb.out_cols())]);
        printf("\n    column 0, tokens 0..15  actual:  ");
        for (int r = 0; r < 16 && r < pb.lo.rows; r++) printf(" %g", got_value(pb, out, out_scales, r, 0));
        printf("\n");
    }
    d.release();
}

static void run_selftest(void) {
    printf("# --selftest: one tile (L = 1, 16 tokens, 128 output columns)\n"
           "# structured BF16: (a) W[n][k] = n, a[t][k] = (k == t): out[t][n] = n tells the weight-row (A operand,\n"
           "#   fragment row) mapping; (b) W[n][k] = k, a[t][k] = (k == t): out[t][n] = t tells the token / K mapping\n");
    const int T = 16, N = 128, K = 64;
    for (int variant = 0; variant < 2; variant++) {
        problem pb = make_problem(0, kEpiPlain, N, K, {T}, 0, 0);
        for (int t = 0; t < T; t++)
            for (int k = 0; k < K; k++) {
                const uint16_t v = mf__bf16_from_float(k == t ? 1.0f : 0.0f);
                memcpy(&pb.a[(size_t)(2 * (t * K + k))], &v, 2);
            }
        for (int n = 0; n < N; n++)
            for (int k = 0; k < K; k++) {
                const uint16_t v = mf__bf16_from_float(variant == 0 ? (float)n : (float)k);
                memcpy(&pb.w[(size_t)(2 * (n * K + k))], &v, 2);
            }
        selftest_case(variant == 0 ? "selftest bf16 W[n][k]=n one-hot tokens" : "selftest bf16 W[n][k]=k one-hot tokens", pb, 8);
    }
    problem r1 = make_problem(0, kEpiPlain, N, 2 * K, {T}, 0, 0);
    selftest_case("selftest bf16 random K=128 (2 K blocks)", r1, 8);
    problem r2 = make_problem(1, kEpiPlain, N, 128, {T}, 0, 0);
    selftest_case("selftest fp8 random K=128 (1 K block)", r2, 8);
    problem r3 = make_problem(1, kEpiPlain, N, 256, {T - 3}, 0, 0);
    selftest_case("selftest fp8 random K=256, 13 tokens", r3, 8);
    problem r4 = make_problem(1, kEpiSwiglu, 2 * N, 128, {T}, 0, 0);
    selftest_case("selftest fp8 swiglu random K=128", r4, 8);
    problem r5 = make_problem(0, kEpiSwiglu, 2 * N, 128, {T}, 0, 0);
    selftest_case("selftest bf16 swiglu random K=128", r5, 8);
}

/* ================================================================================================
 * --bench
 * ============================================================================================== */

__device__ __forceinline__ uint32_t hash32(uint64_t i, uint32_t seed) {
    uint64_t z = i * 0x9E3779B97F4A7C15ull + seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (uint32_t)(z ^ (z >> 31));
}

/* Random E4M3 codes with magnitudes 2^-3 .. 2^3 (never NaN, never 0), four per thread step. */
__global__ void init_fp8_kernel(uint32_t *x, int64_t n4, uint32_t seed) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4; i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t v = 0;
        for (int b = 0; b < 4; b++) {
            const uint32_t r = hash32((uint64_t)i * 4 + b, seed);
            v |= ((r & 0x80u) | ((4u + (r >> 8) % 7u) << 3) | ((r >> 16) & 7u)) << (8 * b);
        }
        x[i] = v;
    }
}

__global__ void init_bf16_kernel(uint32_t *x, int64_t n2, uint32_t seed, float mag) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n2; i += (int64_t)gridDim.x * blockDim.x) {
        const uint32_t r = hash32((uint64_t)i, seed);
        const float v0 = ((float)(r & 0xffff) * (1.0f / 65536.0f) * 2.0f - 1.0f) * mag;
        const float v1 = ((float)(r >> 16) * (1.0f / 65536.0f) * 2.0f - 1.0f) * mag;
        x[i] = (uint32_t)mf__bf16_from_float(v0 == 0.0f ? mag : v0) | ((uint32_t)mf__bf16_from_float(v1 == 0.0f ? mag : v1) << 16);
    }
}

__global__ void init_scale_kernel(float *x, int64_t n, uint32_t seed, float lo, float hi) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = lo + (hi - lo) * (float)(hash32((uint64_t)i, seed) >> 8) * (1.0f / 16777216.0f);
}

static void init_data(int fp8, void *data, size_t bytes, float *scales, size_t nscales, uint32_t seed, float mag) {
    if (fp8) init_fp8_kernel<<<2048, 256>>>((uint32_t *)data, (int64_t)(bytes / 4), seed);
    else init_bf16_kernel<<<2048, 256>>>((uint32_t *)data, (int64_t)(bytes / 4), seed, mag);
    CUDA_OK(cudaGetLastError());
    if (scales && nscales) {
        init_scale_kernel<<<256, 256>>>(scales, (int64_t)nscales, seed + 1, 0.5f * mag / 8, mag / 8);
        CUDA_OK(cudaGetLastError());
    }
}

struct bmodel {
    const char *name;
    int H, I, L;
};

struct bench_ctx {
    /* shared buffers, sized for the largest case, reused (random content, rewritten per dtype) */
    uint8_t *w = NULL, *a = NULL, *out = NULL, *flush = NULL;
    float *ws = NULL, *as = NULL, *out_scales = NULL;
    int32_t *counts = NULL, *offsets = NULL;
    size_t w_bytes = 0, a_bytes = 0, out_bytes = 0, ws_count = 0, as_count = 0, out_scale_count = 0;
    cudaStream_t stream;
    cudaEvent_t ev0, ev1;
    bool peers = true;
    std::vector<std::string> json_rows;
};

static const int kWarmupRuns = 3;
static const int kTimedRuns = 20;
static const size_t kFlushBytes = 512ull << 20;
static const int kBenchCapacity = 256;        /* MASKED C (>= 1.3 x the largest M) */

/* Median time (us) of `fn` with the L2 flushed before every run. */
template <typename F>
static double time_median(bench_ctx &bc, F fn) {
    std::vector<float> ms;
    for (int run = 0; run < kWarmupRuns + kTimedRuns; run++) {
        CUDA_OK(cudaMemsetAsync(bc.flush, run & 0xff, kFlushBytes, bc.stream));
        CUDA_OK(cudaEventRecord(bc.ev0, bc.stream));
        fn();
        CUDA_OK(cudaEventRecord(bc.ev1, bc.stream));
        CUDA_OK(cudaEventSynchronize(bc.ev1));
        CUDA_OK(cudaGetLastError());
        float t;
        CUDA_OK(cudaEventElapsedTime(&t, bc.ev0, bc.ev1));
        if (run >= kWarmupRuns) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2] * 1e3;
}

/* Counts: all M, or M +- 30% (seeded, at least 1). */
static std::vector<int> bench_counts(int L, int M, bool uneven, uint64_t seed) {
    std::vector<int> c((size_t)L, M);
    if (uneven) {
        uint64_t saved = g_rng;
        g_rng = seed;
        for (int e = 0; e < L; e++) c[(size_t)e] = std::max(1, (int)lround(M * (0.7 + 0.6 * rnd_unit())));
        g_rng = saved;
    }
    return c;
}

static void bench_case(bench_ctx &bc, const bmodel &m, int gemm, int fp8, int masked, bool uneven, int M, int block_t,
                       int sub_k, const char *variant) {
    char name[160];
    const int epi = gemm == 13 ? kEpiSwiglu : kEpiPlain;
    const int N = gemm == 13 ? 2 * m.I : m.H, K = gemm == 13 ? m.H : m.I, L = m.L, esz = fp8 ? 1 : 2;
    snprintf(name, sizeof name, "%s w%d %s %s %s L=%d M=%d %s", m.name, gemm, fp8 ? "fp8" : "bf16", masked ? "masked" : "expert-major",
             uneven ? "uneven" : "equal", L, M, variant);
    g_case = name;
    std::vector<int> counts = bench_counts(L, M, uneven, 0x1234567ull * (uint64_t)(M + 7 * L));
    layout_t lo = make_layout(counts, masked ? kBenchCapacity : 0);
    CUDA_OK(cudaMemcpy(bc.counts, lo.counts.data(), (size_t)L * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(bc.offsets, lo.offsets.data(), ((size_t)L + 1) * 4, cudaMemcpyHostToDevice));
    decode_args a;
    memset(&a, 0, sizeof a);
    a.fp8 = fp8;
    a.epi = epi;
    a.L = L;
    a.N = N;
    a.K = K;
    a.a = bc.a;
    a.a_scales = bc.as;
    a.a_rows = lo.rows;
    a.w = bc.w;
    a.w_scales = bc.ws;
    a.counts = bc.counts;
    a.offsets = bc.offsets;
    a.max_rows = lo.max_rows;
    a.rows_hint = lo.max_count;
    a.out = bc.out;
    a.out_scales = bc.out_scales;
    a.block_t = block_t;
    a.sub_k = sub_k;
    const size_t need_w = (size_t)L * N * K * esz, need_a = (size_t)lo.rows * K * esz;
    if (need_w > bc.w_bytes || need_a > bc.a_bytes || (size_t)lo.rows * N * 2 > bc.out_bytes) {
        printf("FAIL %s: bench buffers too small\n", name);
        g_failures++;
        return;
    }
    launch_plan pl;
    std::string why;
    if (!make_plan(a, &pl, &why)) {
        printf("FAIL %s: refused: %s\n", name, why.c_str());
        g_failures++;
        return;
    }
    const double us = time_median(bc, [&] { launch(pl, bc.stream); });
    double v1_us = 0;
    if (bc.peers && block_t == 0 && sub_k == 0) {
        mf__gemm_segments_t seg = {bc.counts, bc.offsets, L, lo.max_rows};
        mf__gemm_operand_t act = {bc.a, bc.as}, wt = {bc.w, bc.ws};
        const int dtype = fp8 ? MF_DTYPE_FP8_E4M3 : MF_DTYPE_BF16;
        bool ok = true;
        v1_us = time_median(bc, [&] {
            mf_result_t r = gemm == 13 ? mf__cuda_w13_swiglu(&seg, dtype, 0, act, wt, K, N / 2, bc.out, bc.out_scales, bc.stream)
                                       : mf__cuda_w2(&seg, dtype, act, wt, N, K, (uint16_t *)bc.out, NULL, bc.stream);
            if (r != MF_SUCCESS && ok) {
                printf("# v1 refused %s: %s\n", name, mf_last_error());
                ok = false;
            }
        });
        if (!ok) v1_us = 0;
    }
    int64_t rows = 0;
    int active = 0;
    for (int e = 0; e < L; e++) {
        rows += counts[(size_t)e];
        active += counts[(size_t)e] > 0;
    }
    const double wbytes = (double)active * N * K * esz + (fp8 ? (double)active * (N / 128) * (K / 128) * 4 : 0.0);
    const double flops = 2.0 * (double)rows * N * K;
    const double tbs = wbytes / us / 1e6, tflops = flops / us / 1e6;
    printf("%-12s w%-2d %-4s %-12s %-6s %4d %5d %5d %4d %3d %2d %2d %-8s %9.1f %7.2f %8.1f", m.name, gemm, fp8 ? "fp8" : "bf16",
           masked ? "masked" : "expert-major", uneven ? "uneven" : "equal", L, N, K, M, pl.block_t, pl.sub_k, pl.k.stages, variant,
           us, tbs, tflops);
    if (v1_us > 0) printf(" %9.1f %6.2fx\n", v1_us, v1_us / us);
    else printf(" %9s %7s\n", "-", "-");
    char row[1024];
    char peers[128] = "[]";
    if (v1_us > 0) snprintf(peers, sizeof peers, "[{\"name\": \"v1\", \"time_us\": %.2f}]", v1_us);
    snprintf(row, sizeof row,
             "{\"op\": \"gemm\", \"dtype\": \"%s\", \"layout\": \"%s\", \"shape\": {\"E\": %d, \"N\": %d, \"K\": %d, \"M\": %d}, "
             "\"time_us\": %.2f, \"tflops\": %.2f, \"gbps\": %.1f, \"peers\": %s, \"model\": \"%s\", \"gemm\": \"w%d\", "
             "\"counts\": \"%s\", \"variant\": \"%s\", \"block_t\": %d, \"sub_k\": %d, \"stages\": %d}",
             fp8 ? "fp8" : "bf16", masked ? "masked" : "expert_major", L, N, K, M, us, tflops, wbytes / us / 1e3, peers, m.name, gemm,
             uneven ? "uneven" : "equal", variant, pl.block_t, pl.sub_k, pl.k.stages);
    bc.json_rows.push_back(row);
}

static void run_bench(const char *json_path, bool peers, bool quick, const std::string &command) {
    const bmodel models[] = {
        {"deepseek-v3", 7168, 2048, 32}, {"deepseek-v3", 7168, 2048, 256}, {"qwen3-235b", 4096, 1536, 16}, {"kimi-k2", 7168, 2048, 48}};
    const int Ms[] = {8, 16, 32, 64, 128};
    bench_ctx bc;
    bc.peers = peers;
    /* buffers: the largest W13 or W2 of any model (DeepSeek L = 256 BF16: 15 GB), activations for
     * L x kBenchCapacity rows of the largest K */
    size_t w_max = 0, a_rows_max = 0, k_max = 0, n_max = 0;
    for (const bmodel &m : models) {
        w_max = std::max(w_max, (size_t)m.L * 2 * m.I * m.H * 2);
        a_rows_max = std::max(a_rows_max, (size_t)m.L * kBenchCapacity);
        k_max = std::max(k_max, (size_t)std::max(m.H, m.I));
        n_max = std::max(n_max, (size_t)std::max(2 * m.I, m.H));
    }
    bc.w_bytes = w_max;
    bc.a_bytes = a_rows_max * k_max * 2;
    bc.out_bytes = a_rows_max * n_max * 2;
    bc.ws_count = w_max / (128 * 128);
    bc.as_count = a_rows_max * (k_max / 128);
    bc.out_scale_count = a_rows_max * (n_max / 128);
    g_case = "bench allocation";
    CUDA_OK(cudaMalloc((void **)&bc.w, bc.w_bytes));
    CUDA_OK(cudaMalloc((void **)&bc.a, bc.a_bytes));
    CUDA_OK(cudaMalloc((void **)&bc.out, bc.out_bytes));
    CUDA_OK(cudaMalloc((void **)&bc.flush, kFlushBytes));
    CUDA_OK(cudaMalloc((void **)&bc.ws, bc.ws_count * 4));
    CUDA_OK(cudaMalloc((void **)&bc.as, bc.as_count * 4));
    CUDA_OK(cudaMalloc((void **)&bc.out_scales, bc.out_scale_count * 4));
    CUDA_OK(cudaMalloc((void **)&bc.counts, 1024 * 4));
    CUDA_OK(cudaMalloc((void **)&bc.offsets, 1025 * 4));
    CUDA_OK(cudaStreamCreateWithFlags(&bc.stream, cudaStreamNonBlocking));
    CUDA_OK(cudaEventCreate(&bc.ev0));
    CUDA_OK(cudaEventCreate(&bc.ev1));

    printf("\n# --bench: median of %d runs after %d warm-up, L2 flushed (512 MB memset) before each run\n", kTimedRuns, kWarmupRuns);
    printf("# wTB/s = weight bytes of the experts with rows (FP8: + their 128x128 scales) / time; TFLOP/s = 2 rows N K / time\n");
    printf("# T = tokens per tile (wgmma N), S = K blocks per stage, st = stages; v1 = src/cuda/kernels/sm90_grouped_gemm.cuh\n");
    printf("# MASKED: C = %d; EXPERT_MAJOR: segments aligned to 128; uneven: counts M +- 30%%\n", kBenchCapacity);
    printf("%-12s %-3s %-4s %-12s %-6s %4s %5s %5s %4s %3s %2s %2s %-8s %9s %7s %8s %9s %7s\n", "# model", "gemm", "dt", "layout",
           "counts", "L", "N", "K", "M", "T", "S", "st", "variant", "time_us", "wTB/s", "TFLOP/s", "v1_us", "speedup");
    for (int fp8 = 1; fp8 >= 0; fp8--) {
        g_case = "bench init";
        init_data(fp8, bc.w, bc.w_bytes, bc.ws, bc.ws_count, 11, 0.02f);
        init_data(fp8, bc.a, bc.a_bytes, bc.as, bc.as_count, 13, 1.0f);
        CUDA_OK(cudaDeviceSynchronize());
        for (const bmodel &m : models)
            for (int gemm : {13, 2})
                for (int M : Ms)
                    for (int masked = 1; masked >= 0; masked--)
                        for (int uneven = 0; uneven < 2; uneven++) {
                            if (quick && (uneven || !masked || (M != 8 && M != 64))) continue;
                            bench_case(bc, m, gemm, fp8, masked, uneven != 0, M, 0, 0, "default");
                        }
        /* variants: tokens per tile and K blocks per stage, on DeepSeek L = 32 masked equal */
        for (int gemm : {13, 2})
            for (int M : {8, 32, 64}) {
                bench_case(bc, models[0], gemm, fp8, 1, false, M, 0, 2, "S2");
                if (M <= 32) bench_case(bc, models[0], gemm, fp8, 1, false, M, 64, 1, "T64");
            }
    }

    if (json_path) {
        FILE *f = fopen(json_path, "w");
        if (!f) {
            fprintf(stderr, "cannot write %s\n", json_path);
            g_failures++;
        } else {
            char date[64];
            const time_t now = time(NULL);
            strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
            char commit[64] = "unknown";
            FILE *g = popen("git rev-parse --short HEAD 2>/dev/null", "r");
            if (g) {
                if (fgets(commit, sizeof commit, g)) commit[strcspn(commit, "\r\n")] = 0;
                if (pclose(g) != 0 || !commit[0]) snprintf(commit, sizeof commit, "unknown");
            }
            std::string cmd;
            for (char ch : command) cmd += (ch == '"' || ch == '\\') ? std::string("\\") + ch : std::string(1, ch);
            fprintf(f, "{\"meta\": {\"card\": \"h200\", \"date\": \"%s\", \"commit\": \"%s\", \"command\": \"%s\", \"backend\": \"cuda\"},\n"
                       " \"rows\": [\n",
                    date, commit, cmd.c_str());
            for (size_t i = 0; i < bc.json_rows.size(); i++)
                fprintf(f, "  %s%s\n", bc.json_rows[i].c_str(), i + 1 < bc.json_rows.size() ? "," : "");
            fprintf(f, " ]}\n");
            fclose(f);
            printf("# wrote %s (%zu rows)\n", json_path, bc.json_rows.size());
        }
    }
    cudaFree(bc.w), cudaFree(bc.a), cudaFree(bc.out), cudaFree(bc.flush), cudaFree(bc.ws), cudaFree(bc.as);
    cudaFree(bc.out_scales), cudaFree(bc.counts), cudaFree(bc.offsets);
    cudaStreamDestroy(bc.stream);
    cudaEventDestroy(bc.ev0);
    cudaEventDestroy(bc.ev1);
}

/* ================================================================================================
 * main
 * ============================================================================================== */

int main(int argc, char **argv) {
    bool selftest = false, validate = false, bench = false, peers = true, quick = false;
    const char *json = NULL;
    std::string command;
    for (int i = 0; i < argc; i++) command += (i ? " " : "") + std::string(argv[i]);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--selftest")) selftest = true;
        else if (!strcmp(argv[i], "--validate")) validate = true;
        else if (!strcmp(argv[i], "--bench")) bench = true;
        else if (!strcmp(argv[i], "--no-peers")) peers = false;
        else if (!strcmp(argv[i], "--quick")) quick = true;
        else if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--selftest] [--validate] [--bench [--json FILE] [--no-peers] [--quick]]\n", argv[0]);
            return 2;
        }
    }
    if (!selftest && !validate && !bench) selftest = validate = bench = true;
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    printf("# device: %s, sm_%d%d, %d SMs, %.0f MB L2, %zu KB smem/block opt-in\n", prop.name, prop.major, prop.minor,
           prop.multiProcessorCount, prop.l2CacheSize / 1e6, prop.sharedMemPerBlockOptin / 1024);
    if (prop.major != 9) {
        fprintf(stderr, "FATAL: needs an sm_90a GPU\n");
        return 2;
    }
    CUDA_OK(cudaHostAlloc((void **)&g_fault, sizeof *g_fault, cudaHostAllocMapped));
    memset((void *)g_fault, 0, sizeof *g_fault);
    CUDA_OK(mf__sm90_set_fault_record(g_fault));
    if (selftest) run_selftest();
    if (validate) run_validate();
    if (bench) run_bench(json, peers, quick, command);
    printf("%s: %d failure%s\n", g_failures ? "FAIL" : "PASS", g_failures, g_failures == 1 ? "" : "s");
    return g_failures ? 1 : 0;
}
