/*
 * grouped_gemm.cu — the GEMM choice and the dispatchers of the grouped expert GEMMs
 * (cuda/grouped_gemm.h): mf__gemm_choose, the one place that decides the kernel family, its tile
 * and the dataflow of a layer call; mf__cuda_w13_swiglu / mf__cuda_w2, which run the family a choice
 * names and, where it declines the shape, the mma.sync fallback ("v1"), whose host launchers
 * (argument checks, the persistent grid, one kernel launch each) are here too. The fallback's
 * kernels are in kernels/sm90_grouped_gemm.cuh; the lab dev/cuda/gemm_lab.cu validates them
 * against the CPU oracle and times them.
 *
 * The launchers never synchronise and never allocate, so they are CUDA-graph capturable. On
 * first use per device and kernel they raise the kernel's dynamic shared-memory limit and read
 * its occupancy (host-only calls, cached in a per-device table; concurrent first calls from
 * several rank threads just do the same idempotent work twice).
 *
 * Shape support: FP8 needs H and I multiples of 128 (the scale blocks); BF16 needs H and I
 * multiples of 8 (16-byte rows); tails of the 64-row, 128/256-column and 64-element K tiles are
 * masked in the kernels. Every data pointer must be 16-byte aligned, every scale pointer 4-byte.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>

#include <atomic>

#include "core/debug.h" /* the core headers: C linkage through their own guards */
#include "core/errors.h"
#include "core/layout.h"
#include "core/tensor.h"
#include "cuda/configs.cuh"
#include "cuda/gemm_family.cuh" /* MF__GEMM_CUDA */
#include "cuda/grouped_gemm.h"
#include "cuda/kernels/sm90_grouped_gemm.cuh"
#include "cuda/pdl.cuh"



namespace {

enum { kKernelW13Bf16, kKernelW13Fp8, kKernelW2Bf16, kKernelW2Fp8, kNumKernels };

/* Blocks per SM of each kernel on each device (0 = not yet configured). */
std::atomic<int> g_blocks_per_sm[kNumKernels][kMfGemmMaxDevices];

/* Grid size of a persistent launch of `kernel`: SMs x resident blocks per SM (first use per device
 * also raises the kernel's dynamic shared-memory limit). */
template <typename Params>
mf_result_t persistent_grid(void (*kernel)(Params), int which, const char *who, int *blocks) {
    int dev = 0, sms = 0;
    MF__GEMM_CUDA(cudaGetDevice(&dev), who);
    MF__GEMM_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), who);
    int per_sm = dev >= 0 && dev < kMfGemmMaxDevices ? g_blocks_per_sm[which][dev].load() : 0;
    if (per_sm == 0) {
        MF__GEMM_CUDA(cudaFuncSetAttribute((const void *)kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            mf__gemm::kSmemBytes),
                       who);
        MF__GEMM_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, mf__gemm::kThreads,
                                                                     mf__gemm::kSmemBytes),
                       who);
        if (per_sm < 1)
            return mf__error(MF_ERR_CUDA, "%s: the kernel (%d threads, %d bytes of shared memory) fits no SM of device %d",
                             who, mf__gemm::kThreads, mf__gemm::kSmemBytes, dev);
        if (dev >= 0 && dev < kMfGemmMaxDevices) g_blocks_per_sm[which][dev].store(per_sm);
    }
    *blocks = sms * per_sm;
    return MF_SUCCESS;
}

/* The fallback's one launch: `kernel` (slot `which` of the occupancy table) on a persistent grid of
 * at most one block per tile. Under MF_DEBUG (`ran` not NULL) it says what ran into ran[ran_size]:
 * `what` (dtype and epilogue) and the tile's `block_n` columns. */
template <typename Params>
mf_result_t launch_fallback(void (*kernel)(Params), int which, int64_t tiles, const Params &p, cudaStream_t stream,
                            int32_t pdl, const char *who, const char *what, int block_n, char *ran, size_t ran_size) {
    int blocks = 0;
    MF_CHECK(persistent_grid(kernel, which, who, &blocks));
    if (tiles < blocks) blocks = (int)tiles;
    MF__GEMM_CUDA(mf__cuda_launch(kernel, dim3((unsigned)blocks), dim3(mf__gemm::kThreads), mf__gemm::kSmemBytes, stream,
                                   pdl, p),
                   who);
    if (ran)
        snprintf(ran, ran_size, "v1 %s: the mma.sync fallback (%dx%d tiles, %d stages, grid %d)", what,
                 mf__gemm::kBlockM, block_n, mf__gemm::kStages, blocks);
    return MF_SUCCESS;
}

bool aligned(const void *p, uintptr_t a) { return ((uintptr_t)p % a) == 0; }

/* Checks shared by both GEMMs. */
mf_result_t check_common(const char *who, const mf__gemm_segments_t *seg, int32_t dtype, int32_t H, int32_t I) {
    MF_REQUIRE(seg, "%s: seg must not be NULL", who);
    MF_REQUIRE(seg->num_experts >= 0 && seg->max_rows_per_expert >= 0,
               "%s: num_experts (%d) and max_rows_per_expert (%d) must be >= 0", who, seg->num_experts,
               seg->max_rows_per_expert);
    MF_REQUIRE(seg->num_experts == 0 || (seg->counts && seg->offsets), "%s: counts and offsets must not be NULL", who);
    MF_REQUIRE(H > 0 && I > 0, "%s: H (%d) and I (%d) must be positive", who, H, I);
    MF_REQUIRE(aligned(seg->sched, sizeof(int32_t)), "%s: seg->sched (%p) must be 4-byte aligned", who, (void *)seg->sched);
    if (dtype == MF_DTYPE_FP8_E4M3) {
        if (H % MF__QUANT_BLOCK || I % MF__QUANT_BLOCK)
            return mf__error(MF_ERR_NOT_SUPPORTED, "%s: FP8 needs H (%d) and I (%d) to be multiples of %d", who, H, I,
                             MF__QUANT_BLOCK);
    } else if (dtype == MF_DTYPE_BF16) {
        if (H % MF__VEC_ELEMS_BF16 || I % MF__VEC_ELEMS_BF16)
            return mf__error(MF_ERR_NOT_SUPPORTED, "%s: BF16 needs H (%d) and I (%d) to be multiples of %d", who, H, I,
                             MF__VEC_ELEMS_BF16);
    } else {
        return mf__error(MF_ERR_NOT_SUPPORTED, "%s: dtype %d is not BF16 or FP8 E4M3", who, dtype);
    }
    return MF_SUCCESS;
}

mf_result_t check_data(const char *who, const char *name, const void *p) {
    MF_REQUIRE(p, "%s: %s must not be NULL", who, name);
    MF_REQUIRE(aligned(p, kMfGemmDataAlign), "%s: %s (%p) must be %d-byte aligned", who, name, p, kMfGemmDataAlign);
    return MF_SUCCESS;
}

mf_result_t check_scales(const char *who, const char *name, const float *p) {
    MF_REQUIRE(p, "%s: %s must not be NULL for FP8", who, name);
    MF_REQUIRE(aligned(p, sizeof(float)), "%s: %s (%p) must be 4-byte aligned", who, name, (const void *)p);
    return MF_SUCCESS;
}

/* The W13 dispatcher's arguments (and the small kernel's W13 half). */
mf_result_t check_w13(const char *who, const mf__gemm_segments_t *seg, int32_t dtype, mf__gemm_operand_t a,
                      mf__gemm_operand_t w13, int32_t H, int32_t I, const void *h, const float *h_scales) {
    MF_CHECK(check_common(who, seg, dtype, H, I));
    const bool fp8 = dtype == MF_DTYPE_FP8_E4M3;
    if (a.gather) {
        const mf__heap_view_t *v = a.gather->view;
        MF_REQUIRE(v, "%s: a.gather->view must not be NULL", who);
        MF_CHECK(check_data(who, "a.gather->src", a.gather->src));
        MF_REQUIRE(v->x % kMfGemmDataAlign == 0 && (!fp8 || v->scales % kMfGemmScaleAlign == 0),
                   "%s: the view's row offset (%llu) must be %d-byte and its scale offset (%llu) %d-byte aligned", who,
                   (unsigned long long)v->x, kMfGemmDataAlign, (unsigned long long)v->scales, kMfGemmScaleAlign);
        for (int r = 0; r < MF_MAX_RANKS; r++)
            MF_REQUIRE(aligned(v->heap[r], kMfGemmDataAlign), "%s: the view's heap %d (%p) must be %d-byte aligned", who,
                       r, (void *)v->heap[r], kMfGemmDataAlign);
    } else {
        MF_CHECK(check_data(who, "a.data", a.data));
    }
    MF_CHECK(check_data(who, "w13.data", w13.data));
    MF_CHECK(check_data(who, "h", h));
    if (fp8) {
        if (!a.gather) MF_CHECK(check_scales(who, "a.scales", a.scales));
        MF_CHECK(check_scales(who, "w13.scales", w13.scales));
        MF_CHECK(check_scales(who, "h_scales", h_scales));
    }
    return MF_SUCCESS;
}

/* The W2 dispatcher's arguments (and the small kernel's W2 half). */
mf_result_t check_w2(const char *who, const mf__gemm_segments_t *seg, int32_t dtype, mf__gemm_operand_t h,
                     mf__gemm_operand_t w2, int32_t H, int32_t I, const uint16_t *out, const mf__gemm_return_t *ret) {
    MF_CHECK(check_common(who, seg, dtype, H, I));
    const bool fp8 = dtype == MF_DTYPE_FP8_E4M3;
    MF_CHECK(check_data(who, "h.data", h.data));
    MF_CHECK(check_data(who, "w2.data", w2.data));
    if (fp8) {
        MF_CHECK(check_scales(who, "h.scales", h.scales));
        MF_CHECK(check_scales(who, "w2.scales", w2.scales));
    }
    if (ret) {
        MF_REQUIRE(ret->view && ret->src, "%s: ret->view and ret->src must not be NULL", who);
        MF_REQUIRE(ret->num_topk > 0, "%s: ret->num_topk (%d) must be positive", who, ret->num_topk);
        for (int r = 0; r < MF_MAX_RANKS; r++) {
            const uint8_t *heap = ret->view->heap[r];
            MF_REQUIRE(!heap || aligned(heap + ret->view->combine, kMfGemmDataAlign),
                       "%s: rank %d's combine slots (%p) must be %d-byte aligned", who, r,
                       (const void *)(heap + ret->view->combine), kMfGemmDataAlign);
        }
    } else {
        MF_CHECK(check_data(who, "out", out));
    }
    return MF_SUCCESS;
}

/* Tiles of the largest possible problem: a bound for the grid (never more blocks than tiles). */
int64_t max_tiles(const mf__gemm_segments_t *seg, int32_t col_tiles) {
    return (int64_t)seg->num_experts * mf__ceil_div(seg->max_rows_per_expert, mf__gemm::kBlockM) * col_tiles;
}

/* ---- MF_DEBUG: the report of one dispatcher decision ------------------------------------------ */

/* The layer whose GEMMs this thread dispatches (mf__cuda_gemm_debug_layer). */
thread_local uint32_t g_debug_layer;

/* Families that declined one call and why, gathered while the dispatcher tries them. */
struct decision_t {
    char declined[768];
    size_t n;
};

void declined(decision_t *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void declined(decision_t *d, const char *fmt, ...) {
    if (d->n >= sizeof d->declined - 1) return;
    if (d->n) d->n += (size_t)snprintf(d->declined + d->n, sizeof d->declined - d->n, "; ");
    if (d->n >= sizeof d->declined - 1) return;
    va_list ap;
    va_start(ap, fmt);
    const int k = vsnprintf(d->declined + d->n, sizeof d->declined - d->n, fmt, ap);
    va_end(ap);
    d->n += k > 0 ? (size_t)k : 0;
    if (d->n > sizeof d->declined - 1) d->n = sizeof d->declined - 1;
}

/* 1 when this call's decision is new and must be reported: the key is the layer, the phase and the
 * shape class (everything the choice reads from the host: dtype, H, I, L, the rows bound and hint,
 * a gathered A, rows returned to the owners). */
bool debug_first(int phase, const mf__gemm_segments_t *seg, int32_t dtype, int32_t H, int32_t I, int gather, int ret) {
    const int64_t key[10] = {g_debug_layer, phase, dtype, H, I, seg->num_experts, seg->max_rows_per_expert,
                             seg->rows_hint, gather, ret};
    return mf__debug_first(mf__debug_key(key, 10)) != 0;
}

void debug_report(const char *phase, const mf__gemm_segments_t *seg, int32_t dtype, int32_t H, int32_t I, int gather,
                  int ret, const char *ran, const decision_t *d) {
    mf__debug("gemm layer %u %s %s H %d I %d L %d rows_hint %d max_rows %d%s%s: ran %s; declined: %s", g_debug_layer,
              phase, mf__dtype_name(dtype), H, I, seg->num_experts, seg->rows_hint, seg->max_rows_per_expert,
              gather ? " A gathered" : "", ret ? " to combine slots" : "", ran, d->n ? d->declined : "none");
}

} /* namespace */

void mf__cuda_gemm_debug_layer(uint32_t layer) { g_debug_layer = layer; }

/* ---- the choice -------------------------------------------------------------------------------- */

mf__gemm_choice_t mf__gemm_choose(int32_t rows_hint, int32_t max_rows_per_expert, int32_t dataflow) {
    mf__gemm_choice_t c;
    if (rows_hint <= kMfDecodeMaxRows) {
        /* decode: tokens per tile, the smallest of the variants' 8, 16, 32, 64 (gemm_decode.cu) that
         * holds what most experts get (0 = unknown: the bound), never more than the bound needs.
         * rows_hint is the MEAN; an expert's count spreads about it (Poisson-like under uniform
         * routing: sd ~ sqrt(mean)), and an expert past the tile takes a second tile that streams its
         * weights again: deepseek-v3 at T = 512 (mean 16) read 2935 us with 16-token tiles, T = 513
         * (mean 17: 32-token tiles) 2700 us (bench/NOTES.md, issue 25 third session). So the tile
         * holds the mean + 2 sd. A process may lower the largest tile (MF_DECODE_TOKENS, for A/B
         * measurements). */
        int32_t m = rows_hint > 0 ? rows_hint + (int32_t)ceil(2.0 * sqrt((double)rows_hint)) : max_rows_per_expert;
        if (max_rows_per_expert > 0 && max_rows_per_expert < m) m = max_rows_per_expert;
        c.family = kMfGemmFamilyDecode;
        c.block_rows = m <= 8 ? 8 : m <= 16 ? 16 : m <= 32 ? 32 : 64;
        const int32_t most = __atomic_load_n(&mf__cuda_decode_tokens, __ATOMIC_RELAXED); /* MF_DECODE_TOKENS */
        if (c.block_rows > most) c.block_rows = most;
        c.tail_rows = 0;
        c.tail_bf16 = 0;
    } else {
        c.family = kMfGemmFamilyTma;
        c.block_rows = mf__tma::kBlockM;
        /* an expert's last m-block of at most 64 rows as a 64-row tile: about half the experts at a
         * mean of ~128 rows (prefill) end in one (kernels/sm90_tma_gemm.cuh "Tail tiles") */
        const int32_t tails = __atomic_load_n(&mf__cuda_tma_tails, __ATOMIC_RELAXED);
        c.tail_rows = tails ? mf__tma::kHalfRows : 0;
        c.tail_bf16 = tails == 2; /* BF16 measured slower with them (grouped_gemm.h) */
    }
    /* rows read in place at their owners: only the decode family gathers them */
    const int32_t may_gather = dataflow == MF_DATAFLOW_AUTO || dataflow == MF_DATAFLOW_DIRECT;
    c.dataflow = !may_gather ? dataflow : c.family == kMfGemmFamilyDecode ? MF_DATAFLOW_DIRECT : MF_DATAFLOW_PULL;
    /* the small-batch kernel: both GEMMs in one launch where the tiles are its 8 tokens */
    c.fused = c.family == kMfGemmFamilyDecode && c.dataflow == MF_DATAFLOW_DIRECT && c.block_rows == mf__small::kTokens;
    return c;
}

/* MF_DEBUG: the families a call did not run and why; `r` is the chosen family's result. */
static void note_declines(decision_t *d, const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg,
                          mf_result_t r) {
    if (choice->family == kMfGemmFamilyDecode) {
        if (r == MF_ERR_NOT_SUPPORTED) declined(d, "decode: %s", mf__gemm_last_decline(kMfGemmFamilyDecode));
        declined(d, "tma: not tried (rows_hint %d <= kMfDecodeMaxRows %d)", seg->rows_hint, kMfDecodeMaxRows);
    } else {
        declined(d, "decode: rows_hint %d > kMfDecodeMaxRows %d", seg->rows_hint, kMfDecodeMaxRows);
        if (r == MF_ERR_NOT_SUPPORTED) declined(d, "tma: %s", mf__gemm_last_decline(kMfGemmFamilyTma));
    }
}

/* MF_DEBUG: what ran, when the chosen family launched (or found nothing to do). */
static const char *chosen_ran(const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg) {
    if (seg->num_experts == 0 || seg->max_rows_per_expert == 0) return "nothing (no rows)";
    return mf__gemm_last_launch(choice->family);
}

mf_result_t mf__cuda_gemm_preload(void) {
    MF_CHECK(mf__sm90_decode_preload());
    MF_CHECK(mf__sm90_tma_preload());
    MF_CHECK(mf__sm90_small_preload());
    int blocks = 0;
    MF_CHECK(persistent_grid(mf__gemm::sm90_w13_swiglu_kernel<true>, kKernelW13Fp8, "gemm preload", &blocks));
    MF_CHECK(persistent_grid(mf__gemm::sm90_w13_swiglu_kernel<false>, kKernelW13Bf16, "gemm preload", &blocks));
    MF_CHECK(persistent_grid(mf__gemm::sm90_w2_kernel<true>, kKernelW2Fp8, "gemm preload", &blocks));
    MF_CHECK(persistent_grid(mf__gemm::sm90_w2_kernel<false>, kKernelW2Bf16, "gemm preload", &blocks));
    return MF_SUCCESS;
}

mf_result_t mf__cuda_w13_swiglu(const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg, int32_t dtype,
                                int32_t ue8m0, mf__gemm_operand_t a, mf__gemm_operand_t w13, int32_t H, int32_t I, void *h,
                                float *h_scales, cudaStream_t stream, int32_t pdl) {
    static const char *who = "mf__cuda_w13_swiglu";
    MF_REQUIRE(choice, "%s: choice must not be NULL", who);
    MF_CHECK(check_w13(who, seg, dtype, a, w13, H, I, h, h_scales));
    const bool fp8 = dtype == MF_DTYPE_FP8_E4M3;
    const bool dbg = mf__debug_on() && debug_first(0, seg, dtype, H, I, a.gather != NULL, 0);
    decision_t d;
    d.n = 0;
    d.declined[0] = '\0';
    /* the TMA launcher declines a gathered A itself (TMA cannot gather rows; a choice never asks it) */
    const mf_result_t r =
        choice->family == kMfGemmFamilyDecode
            ? mf__sm90_decode_w13_swiglu(choice, seg, dtype, ue8m0, a, w13, H, I, h, h_scales, stream, pdl)
            : mf__sm90_tma_w13_swiglu(choice, seg, dtype, ue8m0, a, w13, H, I, h, h_scales, stream, pdl);
    if (dbg) note_declines(&d, choice, seg, r);
    if (r != MF_ERR_NOT_SUPPORTED) {
        if (dbg && r == MF_SUCCESS)
            debug_report("w13", seg, dtype, H, I, a.gather != NULL, 0, chosen_ran(choice, seg), &d);
        return r;
    }

    /* the chosen family declined the shape: the mma.sync fallback */
    const int32_t col_tiles = (int32_t)mf__ceil_div(I, mf__gemm::kW13BlockN);
    const int64_t tiles = max_tiles(seg, col_tiles);
    if (tiles == 0) {
        if (dbg) debug_report("w13", seg, dtype, H, I, a.gather != NULL, 0, "nothing (no rows)", &d);
        return MF_SUCCESS;
    }

    mf__gemm::w13_params p;
    memset(&p, 0, sizeof p);
    p.seg = *seg;
    if (a.gather) {
        p.view = *a.gather->view;
        p.src = a.gather->src;
        p.use_gather = 1;
    }
    p.a = (const uint8_t *)a.data;
    p.a_scales = a.scales;
    p.w = (const uint8_t *)w13.data;
    p.w_scales = w13.scales;
    p.h = (uint8_t *)h;
    p.h_scales = h_scales;
    p.H = H;
    p.I = I;
    p.ue8m0 = ue8m0 ? 1 : 0;

    void (*kernel)(mf__gemm::w13_params) =
        fp8 ? mf__gemm::sm90_w13_swiglu_kernel<true> : mf__gemm::sm90_w13_swiglu_kernel<false>;
    char ran[160];
    MF_CHECK(launch_fallback(kernel, fp8 ? kKernelW13Fp8 : kKernelW13Bf16, tiles, p, stream, pdl, who,
                             fp8 ? "fp8 swiglu" : "bf16 swiglu", mf__gemm::kW13BlockN, dbg ? ran : NULL, sizeof ran));
    if (dbg) debug_report("w13", seg, dtype, H, I, a.gather != NULL, 0, ran, &d);
    return MF_SUCCESS;
}

mf_result_t mf__cuda_w2(const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg, int32_t dtype,
                        mf__gemm_operand_t h, mf__gemm_operand_t w2, int32_t H, int32_t I, uint16_t *out,
                        const mf__gemm_return_t *ret, cudaStream_t stream, int32_t pdl) {
    static const char *who = "mf__cuda_w2";
    MF_REQUIRE(choice, "%s: choice must not be NULL", who);
    MF_CHECK(check_w2(who, seg, dtype, h, w2, H, I, out, ret));
    const bool fp8 = dtype == MF_DTYPE_FP8_E4M3;
    const mf_result_t r = choice->family == kMfGemmFamilyDecode
                              ? mf__sm90_decode_w2(choice, seg, dtype, h, w2, H, I, out, ret, stream, pdl)
                              : mf__sm90_tma_w2(choice, seg, dtype, h, w2, H, I, out, ret, stream, pdl);
    const bool dbg = mf__debug_on() && debug_first(1, seg, dtype, H, I, 0, ret != NULL);
    decision_t d;
    d.n = 0;
    d.declined[0] = '\0';
    if (dbg) note_declines(&d, choice, seg, r);
    if (r != MF_ERR_NOT_SUPPORTED) {
        if (dbg && r == MF_SUCCESS) debug_report("w2", seg, dtype, H, I, 0, ret != NULL, chosen_ran(choice, seg), &d);
        return r;
    }

    /* the chosen family declined the shape: the mma.sync fallback */
    const int32_t col_tiles = (int32_t)mf__ceil_div(H, mf__gemm::kW2BlockN);
    const int64_t tiles = max_tiles(seg, col_tiles);
    if (tiles == 0) {
        if (dbg) debug_report("w2", seg, dtype, H, I, 0, ret != NULL, "nothing (no rows)", &d);
        return MF_SUCCESS;
    }

    mf__gemm::w2_params p;
    p.seg = *seg;
    p.h = (const uint8_t *)h.data;
    p.h_scales = h.scales;
    p.w = (const uint8_t *)w2.data;
    p.w_scales = w2.scales;
    p.out = out;
    if (ret) {
        p.view = *ret->view;
        p.src = ret->src;
        p.num_topk = ret->num_topk;
        p.use_ret = 1;
    } else {
        memset(&p.view, 0, sizeof p.view);
        p.src = NULL;
        p.num_topk = 0;
        p.use_ret = 0;
    }
    p.H = H;
    p.I = I;

    void (*kernel)(mf__gemm::w2_params) = fp8 ? mf__gemm::sm90_w2_kernel<true> : mf__gemm::sm90_w2_kernel<false>;
    char ran[160];
    MF_CHECK(launch_fallback(kernel, fp8 ? kKernelW2Fp8 : kKernelW2Bf16, tiles, p, stream, pdl, who,
                             fp8 ? "fp8 plain" : "bf16 plain", mf__gemm::kW2BlockN, dbg ? ran : NULL, sizeof ran));
    if (dbg) debug_report("w2", seg, dtype, H, I, 0, ret != NULL, ran, &d);
    return MF_SUCCESS;
}

mf_result_t mf__cuda_w13_w2(const mf__gemm_choice_t *choice, const mf__gemm_segments_t *seg, int32_t *w2_sched,
                            int32_t dtype, int32_t ue8m0, mf__gemm_operand_t a, mf__gemm_operand_t w13,
                            mf__gemm_operand_t w2, int32_t H, int32_t I, void *h, float *h_scales,
                            const mf__gemm_return_t *ret, int32_t *sync, const mf__gemm_sum_t *sum,
                            const mf__gemm_own_t *own, int32_t *summed, cudaStream_t stream, int32_t pdl) {
    static const char *who = "mf__cuda_w13_w2";
    MF_REQUIRE(choice && summed, "%s: choice and summed must not be NULL", who);
    *summed = 0;
    const mf__gemm_operand_t hop = {h, h_scales, NULL};
    if (choice->fused) {
        MF_CHECK(check_w13(who, seg, dtype, a, w13, H, I, h, h_scales));
        MF_CHECK(check_w2(who, seg, dtype, hop, w2, H, I, NULL, ret));
        MF_REQUIRE(sync && aligned(sync, sizeof(int32_t)), "%s: sync (%p) must be a 4-byte aligned device buffer", who,
                   (void *)sync);
        if (sum) {
            MF_REQUIRE(sum->T >= 0 && sum->fault, "%s: sum->T (%d) must be >= 0 and sum->fault set", who, sum->T);
            MF_CHECK(check_data(who, "sum->y", sum->y));
        }
        MF_REQUIRE(!own || (sum && own->ids), "%s: its own plan (own) only with its sum and the routing", who);
        const mf_result_t r = mf__sm90_small_experts(choice, seg, dtype, ue8m0, a, w13, w2, H, I, h, h_scales, ret,
                                                     sync, sum, own, stream, pdl);
        if (r == MF_ERR_NOT_SUPPORTED && own)
            return mf__error(MF_ERR_INTERNAL, "%s: the small kernel declined a forward planned for it (%s)", who,
                             mf__gemm_last_decline(kMfGemmFamilySmall));
        if (r == MF_SUCCESS) *summed = sum != NULL;
        const bool dbg = mf__debug_on() && debug_first(2, seg, dtype, H, I, a.gather != NULL, ret != NULL);
        if (r != MF_ERR_NOT_SUPPORTED) {
            if (dbg && r == MF_SUCCESS) {
                decision_t d;
                d.n = 0;
                d.declined[0] = '\0';
                const char *ran = seg->num_experts == 0 || seg->max_rows_per_expert == 0
                                      ? "nothing (no rows)"
                                      : mf__gemm_last_launch(kMfGemmFamilySmall);
                debug_report("w13 + w2", seg, dtype, H, I, a.gather != NULL, ret != NULL, ran, &d);
            }
            return r;
        }
        if (dbg)
            mf__debug("gemm layer %u w13 + w2: the small kernel declined (%s): the two GEMMs run", g_debug_layer,
                      mf__gemm_last_decline(kMfGemmFamilySmall));
    }
    MF_CHECK(mf__cuda_w13_swiglu(choice, seg, dtype, ue8m0, a, w13, H, I, h, h_scales, stream, pdl));
    mf__gemm_segments_t seg2 = *seg;
    seg2.sched = w2_sched;
    return mf__cuda_w2(choice, &seg2, dtype, hop, w2, H, I, NULL, ret, stream, pdl);
}
