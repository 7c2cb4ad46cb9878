/*
 * grouped_gemm.h — host launchers of the CUDA backend's grouped expert GEMMs (CUDA C++ linkage,
 * included only by .cu files). The kernels live in kernels/sm90_*.cuh; the dev/cuda lab holds
 * their variants and validate-then-bench mains.
 *
 * Dimension legend: H hidden, I intermediate, L local experts, rows = receive rows of this rank.
 * Rows of local expert e are [offsets[e], offsets[e] + counts[e]) of the receive tensor (both
 * layouts: MASKED has offsets[e] = e * C). counts/offsets are DEVICE memory, read by the kernels:
 * no host synchronisation, CUDA-graph capturable. Rows past counts[e] never reach a result and
 * are never written (a kernel may load them inside a TMA box; garbage or NaN there is harmless).
 *
 * Numerics (docs/DESIGN.md): fp32 accumulation; FP8: for each 128-wide K block the partial sum of
 * E4M3 x E4M3 products is scaled by a_scale[row, kb] * w_scale[n / 128, kb] and added into the
 * fp32 accumulator. W13: gate = rows [0, I) and up = rows [I, 2I) of the expert's [2I, H] weight;
 * h = silu(gate) * up in fp32; FP8: h requantised 1x128 along I with mf__fp8_block_scale and
 * mf__fp8_from_float (numerics.h), BF16: h rounded with mf__bf16_from_float. W2: out = h . W2^T,
 * rounded to BF16 and written either to out[row] or, when `ret` is given, to the token owner's
 * combine slot (token * K + k) * H BF16 into ret->view->heap[rank] + ret->view->combine, with
 * (rank, token, k) = ret->src[row].
 *
 * The choice (mf__gemm_choose, below): the kernel family, its tile and the dataflow of one layer call
 * are decided once, from host facts only, and carried in a mf__gemm_choice_t to both GEMMs of the
 * call; no launcher re-decides (a family that declines a shape falls back to the mma.sync kernels).
 *
 * `pdl` (every launcher, last): 1 launches the kernel with programmatic dependent launch
 * (cuda/pdl.cuh): it may start while the previous kernel on `stream` drains and waits for it
 * before reading anything. Only the forward's chain passes 1 (src/cuda/backend.cu); benchmarks and
 * labs pass 0, so that back-to-back launches are timed as they were.
 */
#ifndef MF_CUDA_GROUPED_GEMM_H
#define MF_CUDA_GROUPED_GEMM_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/heap_view.h"
#include "cuda/kernels/fault.cuh"
#include "moeflow.h"

typedef struct mf__gemm_segments {
    const int32_t *counts;       /* [L] device: rows of each expert */
    const int32_t *offsets;      /* [L + 1] device: first receive row of each expert */
    int32_t num_experts;         /* L */
    int32_t max_rows_per_expert; /* host bound on counts[e], for sizing grids (C or R * S) */
    int32_t rows_hint;           /* host estimate of rows per expert (0 = unknown), the fact the
                                    call's mf__gemm_choose read; MF_DEBUG reports it, no launcher
                                    reads it */
    int32_t *sched;              /* device, NULL or two zeroed int32 (tile ticket, finished CTAs):
                                    the decode and TMA kernels hand out tiles from it in order
                                    (dynamic schedule) and zero it again when they end; a launch that can
                                    run while another still does (programmatic dependent launch
                                    included) needs its own pair. NULL: the static walk */
    mf__fault_sink_t sink;       /* the calling comm's (kernels/fault.cuh): an expired pipeline wait
                                    records itself there (the comm breaks); zero (no state) outside a
                                    comm: recorded nowhere */
} mf__gemm_segments_t;

/* Activation rows read in place at their owners (the direct dataflow), through the heap view of
 * the call's heap slot (cuda/heap_view.h): receive row i is token src[i] = (rank, token, k) of
 * `rank`, at view->heap[rank] + view->x + token * row_bytes, its FP8 scales at view->heap[rank] +
 * view->scales + token * H/128 floats. The launcher copies the view into the kernel's parameters. */
typedef struct mf__gemm_gather {
    const mf__heap_view_t *view; /* host memory: every rank's heap and the slot's region offsets */
    const int32_t *src;          /* [rows, 3] device: the plan's source rows */
} mf__gemm_gather_t;

typedef struct mf__gemm_operand {
    const void *data;     /* rows x cols, FP8 (uint8) or BF16 (uint16), row-major */
    const float *scales;  /* FP8 activations: [rows, cols / 128]; FP8 weights: [L, N/128, K/128] */
    const mf__gemm_gather_t *gather; /* W13's A only: when set, rows come from here and data /
                                        scales are unused */
} mf__gemm_operand_t;

/* Where W2 sends its BF16 rows when not to a local `out`: the combine slots [S, K, H] of every rank,
 * at view->heap[rank] + view->combine (the heap view of the call's heap slot; a NULL heap entry
 * takes no rows). The launcher copies the view into the kernel's parameters. */
typedef struct mf__gemm_return {
    const mf__heap_view_t *view; /* host memory: every rank's heap and the slot's region offsets */
    const int32_t *src;          /* [rows, 3] device: (rank, token, k) of each receive row */
    int32_t num_topk;            /* K */
} mf__gemm_return_t;

/* Loads every GEMM kernel and sets its shared-memory limit on the current device. Call before any
 * rank can spin in a wait kernel: with lazy module loading, a first launch may otherwise wait for
 * the module to load while peers' waiting kernels hold the GPU. */
mf_result_t mf__cuda_gemm_preload(void);


/* ---- the choice ------------------------------------------------------------------------------
 * Three kernel families; what differs between them is all the choice carries:
 *   decode   (rows_hint <= kMfDecodeMaxRows): kernels/sm90_decode_gemm.cuh, gemm_decode.cu — the
 *            weights are the wgmma A operand and stream at HBM rate; block_rows = tokens per tile
 *            (8, 16, 32 or 64); the only family that is chosen with gathered A rows (DIRECT)
 *   tma      (larger): kernels/sm90_tma_gemm.cuh, gemm_tma.cu — TMA + wgmma, 128-row tiles
 *   mma.sync kernels/sm90_grouped_gemm.cuh, this file — never chosen: the fallback the dispatchers
 *            run for any shape the chosen family declines (MF_ERR_NOT_SUPPORTED without launching);
 *            it takes gathered rows too, so DIRECT stays correct after a decode decline
 * The family never depends on the dataflow, so DIRECT and PULL run the same arithmetic and give the
 * same bits; the dataflow depends on the family (TMA cannot gather rows).
 *   small    (decode with 8-token tiles and DIRECT: `fused`): kernels/sm90_small_gemm.cuh,
 *            gemm_small.cu — the decode family's W13 and W2 tiles in ONE launch, W2's weights
 *            streamed while W13 drains (a per-expert dependency instead of the kernel boundary); the
 *            same arithmetic as the two decode kernels, so the same bits */
enum { kMfGemmFamilyDecode = 0, kMfGemmFamilyTma = 1, kMfGemmFamilySmall = 2, kMfGemmFamilyMmaSync = 3 };

typedef struct mf__gemm_choice {
    int32_t family;     /* kMfGemmFamilyDecode or kMfGemmFamilyTma */
    int32_t block_rows; /* receive rows per tile: decode 8, 16, 32 or 64 tokens; TMA 128 */
    int32_t tail_rows;  /* TMA: 64, an FP8 GEMM's expert whose last m-block has at most 64 rows runs it
                           as a 64-row tail tile (kernels/sm90_tma_gemm.cuh "Tail tiles"; the same
                           bits), or 0: full tiles only (MF_TMA_TAILS=0); decode: 0. BF16 GEMMs take
                           them only with tail_bf16: measured 7-10 % slower on W13 + SwiGLU (H100,
                           2026-12-05, bench/results/h100/), where FP8 gained 7-11 % */
    int32_t tail_bf16;  /* 1: BF16 GEMMs take the tail tiles too (mf__cuda_tma_tails 2: the lab's A/B and
                           validate, which keep that path measured and checked); 0 otherwise */
    int32_t dataflow;   /* MF_DATAFLOW_*: DIRECT only with the decode family */
    int32_t fused;      /* 1: W13 and W2 in one launch, the small-batch kernel (kernels/sm90_small_gemm.cuh):
                           decode with 8-token tiles and DIRECT (mf__cuda_w13_w2; a layer with spare
                           slots, or MF_SMALL=0, clears it: cuda/backend.cu) */
} mf__gemm_choice_t;

/* The choice for one layer call (a forward, an mf_moe_experts call, a benchmark launch), from host
 * facts only: `rows_hint` the expected rows per expert (0 = unknown: the bound),
 * `max_rows_per_expert` the bound on any expert's rows, `dataflow` the one asked for (MF_DATAFLOW_*;
 * AUTO and DIRECT: rows may be read in place at their owners, which only the decode family can
 * do: DIRECT with decode, else PULL; PULL and UNFUSED are kept; rows that are already contiguous
 * pass PULL). Pure host arithmetic: never fails, never launches. */
mf__gemm_choice_t mf__gemm_choose(int32_t rows_hint, int32_t max_rows_per_expert, int32_t dataflow);

/* The TMA family's tail tiles (defined in cuda/backend.cu): 1 (the default) lets mf__gemm_choose
 * choose them for FP8 GEMMs, 0 never (MF_TMA_TAILS=0, read by each CUDA comm's init and by `moeflow
 * bench gemm`, for A/B measurements), 2 for BF16 GEMMs too (set by the TMA lab only). */
extern "C" int32_t mf__cuda_tma_tails;

/* The small-batch kernel's switch (defined in cuda/backend.cu): 0 clears choice->fused in every
 * forward, 1 keeps the sum kernel after it, 2 lets it sum at R = 1 too, 3 lets it plan for itself
 * there as well (no plan kernel), 4 lets a W2 unit that waits for its expert's W13 send the next
 * round's W2 weights into L2 (kernels/sm90_small_gemm.cuh, `l2_ahead`), 5 is 4 and has the producer
 * warpgroup's idle warps make the first unit's W13 rows from x where it plans for itself (`x`); the
 * default is 4 (5 measured slower: cuda/backend.cu); a comm init sets it to MF_SMALL
 * (core/params.c) for the rest of the process. */
extern "C" int32_t mf__cuda_small;
/* The routed rows (T K R L / E) up to which AUTO takes the small-batch kernel: mf__small::kMaxRows
 * (defined in cuda/backend.cu); the GPU tests raise it to run the kernel at every shape it takes. */
extern "C" int32_t mf__cuda_small_rows;
/* The largest decode tile (tokens) mf__gemm_choose may take: 64, lowered by MF_DECODE_TOKENS
 * (core/params.c) at a comm init for every choice of the rest of the process (defined in
 * cuda/backend.cu). */
extern "C" int32_t mf__cuda_decode_tokens;
/* 1: the decode GEMMs send their weights into L2 a ring ahead of their loads (gemm_params.l2_ring);
 * 0 (the default), raised to 1 by MF_DECODE_L2=1 (core/params.c) at a comm init for the rest of the
 * process (defined in cuda/backend.cu). */
extern "C" int32_t mf__cuda_decode_l2;

/* The types of a W13 and of a W2 launcher: the dispatchers' (below) and the decode family's, so
 * that their arguments are written once. */
typedef mf_result_t mf__gemm_w13_swiglu_fn(const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg,
                                           int32_t dtype, int32_t ue8m0, mf__gemm_operand_t a, mf__gemm_operand_t w13,
                                           int32_t H, int32_t I, void *h, float *h_scales, cudaStream_t stream,
                                           int32_t pdl);
typedef mf_result_t mf__gemm_w2_fn(const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg, int32_t dtype,
                                   mf__gemm_operand_t h, mf__gemm_operand_t w2, int32_t H, int32_t I, uint16_t *out,
                                   const mf__gemm_return_t *ret, cudaStream_t stream, int32_t pdl);

/* The families' launchers: every variant takes the arguments of its dispatcher (the dispatchers'
 * types: the choice gives decode its tokens per tile, TMA its tail tiles) and honours the same
 * contract. decode and tma configure, decline and report through one skeleton
 * (cuda/gemm_family.cuh). */
mf__gemm_w13_swiglu_fn mf__sm90_decode_w13_swiglu;
mf__gemm_w2_fn mf__sm90_decode_w2;
mf_result_t mf__sm90_decode_preload(void);
mf__gemm_w13_swiglu_fn mf__sm90_tma_w13_swiglu;
mf__gemm_w2_fn mf__sm90_tma_w2;
mf_result_t mf__sm90_tma_preload(void);
/* Raise the decode or the TMA family's expired flag (kernels/sm90_ptx.cuh mf__sm90_expired: one per
 * family's translation unit) as its first expired wait would: every later wait of the family that
 * has to wait gives up at once and the kernels drain. Never cleared (the process's GEMMs are no
 * longer trusted): for the drain's test only (cuda/gemm_bench.h mf__gemm_bench_expire). 0, or -1
 * on a CUDA error. */
int mf__sm90_decode_expire(void);
int mf__sm90_tma_expire(void);
/* The owner's K-sum done by the small-batch kernel itself (R = 1): y [T, H] BF16 = the sum of the
 * token's partials in its combine slots, with its published ids and weights (the heap view's ids
 * and weights regions), the sum kernel's arithmetic (kernels/sum.cuh); `fault` the comm's sticky
 * fault word (set: y untouched). */
typedef struct mf__gemm_sum {
    uint16_t *y;
    int32_t T;
    const int32_t *fault;
} mf__gemm_sum_t;

/* The small kernel's own plan (R = 1, with its sum): the caller's routing `ids` [T, K], from which it
 * plans for itself, and (switch 5; NULL: every row is publish's) the caller's `x` [T, H] BF16, from
 * which idle warps make the CTA's first unit's W13 rows (publish writes x as always). */
typedef struct mf__gemm_own {
    const int32_t *ids;
    const uint16_t *x;
} mf__gemm_own_t;

/* The small-batch kernel (choice->fused): W13 + SwiGLU into h (+ h_scales), then W2 of h returned to
 * the owners' combine slots (`ret`), in one launch; rows gathered at their owners (a.gather); with
 * `sum` (one rank) also y. `sync`: device, zeroed int32 of this launch alone, 2 + L (+ T H/128 with
 * the sum); the kernel zeroes them again at its end. `own` (with `sum`; NULL: the plan's
 * seg->counts, seg->offsets and a.gather->src): the caller's routing (and x), from which the kernel
 * plans for itself, launched right after a publish that ran the DISPATCH sync
 * (kernels/movement.cuh mf__publish_sync_kernel) with no plan kernel between (kernels/sm90_small_gemm.cuh
 * own_tables: the caller makes sure the plan could not have faulted). Declines (MF_ERR_NOT_SUPPORTED)
 * what it does not take: tiles other than 8 tokens, rows not gathered or not returned, a sum over
 * more than one rank, its own plan beyond its limits, shapes the decode kernels decline. */
mf_result_t mf__sm90_small_experts(const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg, int32_t dtype,
                                   int32_t ue8m0, mf__gemm_operand_t a, mf__gemm_operand_t w13, mf__gemm_operand_t w2,
                                   int32_t H, int32_t I, void *h, float *h_scales, const mf__gemm_return_t *ret,
                                   int32_t *sync, const mf__gemm_sum_t *sum, const mf__gemm_own_t *own,
                                   cudaStream_t stream, int32_t pdl);
/* MF_SUCCESS when the small kernel with its own plan takes these shapes (8-token tiles, L experts,
 * dtype, H, I) on the current device, else its decline (MF_ERR_NOT_SUPPORTED; or MF_ERR_CUDA): the
 * forward asks before it publishes without a plan kernel, since nothing can fall back after. */
mf_result_t mf__sm90_small_takes(const mf__gemm_choice_t *choice, int32_t L, int32_t dtype, int32_t H, int32_t I);
mf_result_t mf__sm90_small_preload(void);

/* MF_DEBUG (core/debug.h): the layer id the calling thread's next dispatcher calls report under
 * (a thread-local label; nothing else reads it). */
void mf__cuda_gemm_debug_layer(uint32_t layer);

/* The dispatchers: the family `choice` names (mf__gemm_choose), or the mma.sync fallback where that
 * family declines the shape. a.gather (W13) only with choice->dataflow DIRECT. */

/* h[rows, I] (+ h_scales [rows, I/128] for FP8) = swiglu(a[rows, H] . w13[e]^T) per expert. */
mf__gemm_w13_swiglu_fn mf__cuda_w13_swiglu;

/* out = bf16(h[rows, I] . w2[e]^T) per expert: into out[rows, H] when `ret` is NULL, else into
 * the owners' combine slots. */
mf__gemm_w2_fn mf__cuda_w2;

/* Both GEMMs of a DIRECT forward, rows returned to the owners: with choice->fused the small-batch
 * kernel (one launch, `sync` its zeroed words), and with `sum` (not NULL) the owner's K-sum in it too
 * (*summed = 1: y is written); where it declines (or without `fused`) mf__cuda_w13_swiglu then
 * mf__cuda_w2 (seg->sched W13's schedule pair, w2_sched W2's) and *summed = 0: the caller sums. The
 * same bits either way. The small kernel takes the rows through one heap view and plan: a.gather and
 * ret with the same view and src (else it declines). With `own` (the small kernel's own plan,
 * mf__sm90_small_experts) nothing can fall back: no plan kernel ran, so a decline is an error
 * (MF_ERR_INTERNAL: the caller asked mf__sm90_small_takes first; only the weight tensor maps' encoding
 * is not asked there, which the argument checks' alignment rules leave nothing to fail on). */
mf_result_t mf__cuda_w13_w2(const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg, int32_t *w2_sched,
                            int32_t dtype, int32_t ue8m0, mf__gemm_operand_t a, mf__gemm_operand_t w13,
                            mf__gemm_operand_t w2, int32_t H, int32_t I, void *h, float *h_scales,
                            const mf__gemm_return_t *ret, int32_t *sync, const mf__gemm_sum_t *sum,
                            const mf__gemm_own_t *own, int32_t *summed, cudaStream_t stream, int32_t pdl);

#endif /* MF_CUDA_GROUPED_GEMM_H */
