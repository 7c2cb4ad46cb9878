/*
 * sm90_decode_lab.cu — validate-then-bench main of the sm90 decode grouped GEMM: the kernel is
 * src/cuda/kernels/sm90_decode_gemm.cuh (its design is described there), the launchers
 * src/cuda/gemm_decode.cu. Every case runs through the library's launchers
 * (mf__sm90_decode_w13_swiglu / mf__sm90_decode_w2, linked from libmoeflow.a), so the lab validates
 * exactly what ships: the same kernel variants, the same choice of tokens per tile from rows_hint,
 * the same tensor maps. Built by `make lab` into build/dev/sm90_decode_lab; needs one sm_90a GPU.
 *
 *   sm90_decode_lab                 variants, selftest, validate, then bench
 *   sm90_decode_lab --selftest      one tile, structured inputs; prints the first mismatch
 *   sm90_decode_lab --validate      small and DeepSeek-shaped cases against the CPU oracle, gathered
 *                                   A, `ret`, the dispatcher, declines (meant to stay well under
 *                                   60 s on an H200; most of it is the CPU oracle)
 *   sm90_decode_lab --bench [--json FILE] [--no-peers] [--quick]
 *   sm90_decode_lab --timeline      per-CTA %globaltimer stamps of the T = 1 shapes (where a launch's
 *                                   time goes: launch, prologue, work, tail)
 *   sm90_decode_lab --small         the small-batch kernel (kernels/sm90_small_gemm.cuh: W13 + W2 in
 *                                   one launch) timed against the two decode kernels it fuses, at the
 *                                   layer's R = 1 decode shapes (T = 1..8 tokens, three models)
 *
 * Dimension legend: L local experts, N weight rows per expert (2I for W13, H for W2), K the
 * reduction dim (H for W13, I for W2), M rows per expert, T tokens per tile, C masked capacity,
 * R ranks (fake owners of gathered rows and of combine slots).
 *
 *   plain  = W2:   out[rows, N] = bf16(a[rows, K] . W[e]^T)           (mf__sm90_decode_w2)
 *   swiglu = W13:  h[rows, N/2] = silu(a . Wg^T) * (a . Wu^T)          (mf__sm90_decode_w13_swiglu)
 *
 * Checks, one PASS/FAIL line each (the first mismatches are printed with their coordinates):
 *   oracle      the CPU GEMM (src/cpu/gemm.c, same per-K-block FP8 promotion): diff =
 *               1 - 2 sum(x y) / sum(x^2 + y^2) below 1e-3 (FP8) / 1e-5 (BF16), and element bounds:
 *                 BF16 data:  |x - y| <= max(|x|, |y|) / 128 + 1e-5 rms(y)
 *                 FP8 data:   wgmma E4M3 accumulates with reduced precision inside a K block (~5e-4
 *                 relative per element on the H200), so each exact-fp32 GEMM value c carries the
 *                 bound e(c) = 2e-3 (|c| + rms(C)) (C = every GEMM output of the case), propagated:
 *                   W2 (BF16 out):  |x - y| <= e(y) + half a BF16 ulp at |y| + e(y)
 *                   W13 (FP8 h):    h = silu(g) u, e(h) = 1.1 |u| e(g) + |silu(g)| e(u) + 1.1 e(g) e(u);
 *                     each h scale s in [block_scale(amax_lo), block_scale(amax_hi)] (amax_lo / hi:
 *                     max over the block of |h| -/+ e(h); block_scale of numerics.h, ue8m0 too),
 *                     dequantised x = q s:  |x - h| <= e(h) + s * half an E4M3 ulp at (|h| + e(h)) / s
 *                 so a correct kernel passes whatever its rounding, and a wrong scale, row, column or
 *                 K block (errors of the order of |y| or rms) fails. "err/bound" prints the worst ratio,
 *                 "h_scale dev" the largest relative distance of an h scale from the CPU's.
 *   untouched   outputs are poisoned with 0xFF first; every byte of rows no expert owns (and every
 *               combine slot no row returns to) must still read 0xFF
 *   repeat      a second run, or a CUDA graph replay, writes the same bits
 *   gathered A  W13 with a.gather (rows scattered over R fake heaps with their FP8 scales; every
 *               unused heap row is NaN garbage): bitwise equal to the contiguous-A run
 *   ret         W2 with `ret` into R fake owners' combine slots [S, K, H]: each row lands at
 *               (token K + k) H of its rank's slots, bitwise equal to the out[] run; nothing else written
 *   dispatcher  mf__cuda_w13_swiglu / mf__cuda_w2 with the same rows_hint (<= kMfDecodeMaxRows) give
 *               the same bits (they run this kernel)
 *   declines    shapes the kernel does not take return MF_ERR_NOT_SUPPORTED, launch nothing and leave
 *               no library error
 *   small       (also in --validate) the small-batch kernel, W13 gathered through R fake heaps and W2
 *               returned into their combine regions: h, h scales and every combine slot bitwise equal to
 *               the two decode kernels' (first mismatches printed), again on a second run or graph
 *               replays, and its sync words zero after
 * At start the lab lists every shipped variant with its registers (must be 168, no local memory).
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
#include "core/errors.h"
#include "core/layout.h"
#include "core/quant.h"
#include "cpu/gemm.h"
}
#include "core/numerics.h"
#include "cuda/configs.cuh"
#include "cuda/gemm_family.cuh" /* mf__gemm_variant_info_t */
#include "cuda/grouped_gemm.h"
#include "cuda/kernels/sm90_decode_gemm.cuh"
#include "cuda/kernels/sm90_small_gemm.cuh" /* mf__sm90_small_variants */
#include "cuda/kernels/sm90_small_gemm.cuh" /* mf__small::kTagDepends */
#include "common.h" /* the labs' CUDA_OK, random data, device vectors */

using mf__decode::kEpiPlain;
using mf__decode::kEpiSwiglu;

/* ================================================================================================
 * errors, the shipped variants, one launcher call
 * ============================================================================================== */

static const char *wait_site(long long tag) {
    return tag == mf__decode::kTagProducerEmpty ? "producer waiting for a free stage"
           : tag == mf__decode::kTagConsumerFull ? "consumer waiting for a full stage"
           : tag == mf__small::kTagDepends     ? "small kernel: a W2 tile waiting for its expert's W13 tiles"
                                               : "?";
}

static void report_fault(void) { lab_report_sink(wait_site); }

static std::vector<mf__gemm_variant_info_t> g_variants;

static const mf__gemm_variant_info_t *variant_info(int fp8, int swiglu, int block_t, int gather) {
    for (const mf__gemm_variant_info_t &v : g_variants)
        if (v.fp8 == fp8 && v.swiglu == swiglu && v.block_t == block_t && v.gather == gather) return &v;
    return NULL;
}

/* Lists the shipped variants (registers from cudaFuncGetAttributes); FAIL when one is unusable or
 * uses local memory (spills). */
static void list_variants(void) {
    g_case = "variants";
    const int n = mf__sm90_decode_variants(NULL, 0);
    if (n <= 0) {
        printf("FAIL variants: mf__sm90_decode_variants returned %d (%s)\n", n, mf_last_error());
        g_failures++;
        return;
    }
    g_variants.resize((size_t)n);
    mf__sm90_decode_variants(g_variants.data(), n);
    printf("# shipped variants (src/cuda/gemm_decode.cu): registers must be %d (setmaxnreg), local memory 0\n",
           mf__decode::kLaunchRegs);
    printf("%-6s %-4s %-7s %3s %-6s %7s %6s %4s %6s %s\n", "# gemm", "dt", "A", "T", "epi", "smem", "stages", "regs",
           "local", "");
    int bad = 0;
    for (const mf__gemm_variant_info_t &v : g_variants) {
        const bool ok = v.usable && v.num_regs == mf__decode::kLaunchRegs && v.local_bytes == 0;
        bad += !ok;
        printf("%-6s %-4s %-7s %3d %-6s %7d %6d %4d %6d %s\n", v.swiglu ? "w13" : "w2", v.fp8 ? "fp8" : "bf16",
               v.gather ? "gather" : "tma", v.block_t, v.swiglu ? (v.fp8 ? "h fp8" : "h bf16") : "bf16", v.smem_bytes, v.stages,
               v.num_regs, v.local_bytes, ok ? "" : "<- FAIL");
    }
    /* the small-batch kernel (src/cuda/gemm_small.cu): variants 0 / 1 FP8 / BF16 on the plan's tables,
     * 2 / 3 the same with their own plan */
    mf__gemm_variant_info_t sv[mf__small::kMaxVariants];
    const int ns = mf__sm90_small_variants(sv, mf__small::kMaxVariants);
    if (ns <= 0) {
        printf("FAIL variants: mf__sm90_small_variants returned %d (%s)\n", ns, mf_last_error());
        bad++;
    }
    for (int i = 0; i < ns; i++) {
        const mf__gemm_variant_info_t &v = sv[i];
        const bool ok = v.usable && v.num_regs == mf__decode::kLaunchRegs && v.local_bytes == 0;
        bad += !ok;
        printf("%-6s %-4s %-7s %3d %-6s %7d %6d %4d %6d %s\n", "small", v.fp8 ? "fp8" : "bf16", i >= 2 ? "own" : "plan",
               v.block_t, "w13+w2", v.smem_bytes, v.stages, v.num_regs, v.local_bytes, ok ? "" : "<- FAIL");
    }
    printf("%s variants: %d shipped (and %d of the small kernel), %d unusable or spilling\n", bad ? "FAIL" : "PASS", n,
           ns, bad);
    if (bad) g_failures++;
}

/* One launcher call (host description; all pointers device memory). */
struct call_t {
    int fp8, epi, ue8m0;
    int L, N, K;                       /* N weight rows per expert (2I for swiglu) */
    const void *a;                     /* [rows, K] */
    const float *a_scales;             /* FP8 [rows, K/128] */
    const mf__gemm_gather_t *gather;   /* swiglu: rows at their owners instead of a */
    const void *w;                     /* [L, N, K] */
    const float *w_scales;             /* FP8 [L, N/128, K/128] */
    const int32_t *counts, *offsets;
    int max_rows, rows_hint;
    void *out;                         /* plain: [rows, N] BF16; swiglu: [rows, N/2] BF16 or FP8 */
    float *out_scales;                 /* swiglu FP8: [rows, N/256] */
    const mf__gemm_return_t *ret;      /* plain: rows to the owners' slots instead of out */
};

/* The schedule pair every call passes (mf__gemm_segments_t.sched), as the layer does: tiles by
 * ticket where a launch has more tiles than CTAs (zeroed once; every launch leaves it zero). */
static int32_t *g_sched = NULL;

static mf__gemm_segments_t seg_of(const call_t &c) {
    mf__gemm_segments_t s;
    s.counts = c.counts;
    s.offsets = c.offsets;
    s.num_experts = c.L;
    s.max_rows_per_expert = c.max_rows;
    s.rows_hint = c.rows_hint;
    s.sched = g_sched;
    s.sink = g_sink;
    return s;
}

/* The library's choice for the call (mf__gemm_choose; rows may be gathered: AUTO); for the decode
 * launcher itself (dispatcher = 0) the choice for at most kMfDecodeMaxRows rows, which is the decode
 * family with the tokens per tile the hint asks for (64 above it). */
static mf__gemm_choice_t choice_of(const call_t &c, int dispatcher) {
    const int hint = dispatcher || c.rows_hint <= kMfDecodeMaxRows ? c.rows_hint : kMfDecodeMaxRows;
    return mf__gemm_choose(hint, c.max_rows, MF_DATAFLOW_AUTO);
}

/* The decode launcher (dispatcher = 0) or the library's dispatcher (1). */
static mf_result_t run_call(const call_t &c, cudaStream_t stream, int dispatcher = 0) {
    const mf__gemm_segments_t seg = seg_of(c);
    const mf__gemm_choice_t choice = choice_of(c, dispatcher);
    const int32_t dtype = c.fp8 ? MF_DTYPE_FP8_E4M3 : MF_DTYPE_BF16;
    const mf__gemm_operand_t w = {c.w, c.w_scales, NULL};
    if (c.epi == kEpiSwiglu) {
        const mf__gemm_operand_t a = {c.a, c.a_scales, c.gather};
        return dispatcher ? mf__cuda_w13_swiglu(&choice, &seg, dtype, c.ue8m0, a, w, c.K, c.N / 2, c.out, c.out_scales, stream, 0)
                          : mf__sm90_decode_w13_swiglu(&choice, &seg, dtype, c.ue8m0, a, w, c.K, c.N / 2, c.out, c.out_scales,
                                                       stream, 0);
    }
    const mf__gemm_operand_t h = {c.a, c.a_scales, NULL};
    return dispatcher ? mf__cuda_w2(&choice, &seg, dtype, h, w, c.N, c.K, (uint16_t *)c.out, c.ret, stream, 0)
                      : mf__sm90_decode_w2(&choice, &seg, dtype, h, w, c.N, c.K, (uint16_t *)c.out, c.ret, stream, 0);
}

/* True when the call launched; else prints FAIL (declined: the reason; CUDA: the error). */
static bool launched(mf_result_t r, const char *name) {
    if (r == MF_SUCCESS) return true;
    if (r == MF_ERR_NOT_SUPPORTED)
        printf("FAIL %-52s declined: %s%s\n", name, mf__gemm_last_decline(kMfGemmFamilyDecode), mf_last_error());
    else
        printf("FAIL %-52s %s: %s\n", name, mf_result_string(r), mf_last_error());
    g_failures++;
    if (r == MF_ERR_CUDA) {
        report_fault();
        exit(3);
    }
    return false;
}

/* ================================================================================================
 * host: data, layouts, the CPU oracle
 * ============================================================================================== */

template <typename T>
static void shuffle(std::vector<T> &v) {
    for (size_t i = v.size(); i > 1; i--) std::swap(v[i - 1], v[(size_t)(rnd_u64() % i)]);
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
    int max_rows = 0;                     /* max_rows_per_expert passed to the launcher */
    int max_count = 0;
};

/* EXPERT_MAJOR (C == 0): segments start at multiples of 128 and the tensor ends right after the last
 * expert's last row; MASKED: offsets e * C, rows = L * C. */
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

/* Garbage bytes with NaN / Inf patterns sprinkled in (E4M3 NaN; BF16 NaN/Inf halves). */
static void garble(uint8_t *data, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b++) {
        uint8_t v = (uint8_t)rnd_u64();
        if (b % 7 == 0) v = (b / 7) % 2 ? 0xFF : 0x7F;
        data[b] = v;
    }
}

static void garble_scales(float *scales, int64_t n) {
    for (int64_t c = 0; c < n; c++) {
        const uint32_t pat[4] = {0xFFFFFFFFu, 0x7F800000u, 0x7FC00000u, (uint32_t)rnd_u64()};
        memcpy(&scales[c], &pat[c % 4], 4);
    }
}

/* Garbage in every row no expert owns. */
static void garble_rows(const layout_t &lo, uint8_t *data, int64_t row_bytes, float *scales, int64_t scale_cols) {
    for (int64_t r = 0; r < lo.rows; r++) {
        if (lo.owner[(size_t)r] >= 0) continue;
        garble(data + r * row_bytes, row_bytes);
        if (scales) garble_scales(scales + r * scale_cols, scale_cols);
    }
}

/* One validation problem on the host. */
struct problem {
    int fp8, epi, L, N, K, ue8m0;
    layout_t lo;
    std::vector<uint8_t> a, w;       /* FP8 codes or BF16 bytes */
    std::vector<float> as, ws;       /* FP8 scales */
    int64_t out_cols() const { return epi == kEpiSwiglu ? N / 2 : N; }
    int out_esz() const { return (epi == kEpiSwiglu && fp8) ? 1 : 2; }
    int esz() const { return fp8 ? 1 : 2; }
};

/* What the outputs of the owned rows must be (see "Checks" at the top). */
struct expect_t {
    std::vector<float> y;                /* [rows, oc] exact fp32 value (plain: the GEMM; swiglu: h before rounding) */
    std::vector<float> tol;              /* [rows, oc] FP8: accumulation bound e(y); BF16: 0 */
    std::vector<float> ref;              /* [rows, oc] the CPU's own output (FP8 h: its requantisation, dequantised) */
    std::vector<float> amax_lo, amax_hi; /* FP8 h: [rows, oc/128] the range of the amax the GPU may see */
    std::vector<float> scales;           /* FP8 h: [rows, oc/128] the CPU's own h scales (reported, not a bound) */
};

static const double kFp8AccRel = 2e-3;    /* e(c) = kFp8AccRel (|c| + rms(C)) */
static const double kSiluSlope = 1.1;     /* max |silu'| = 1.0998 */

/* CPU oracle (src/cpu/gemm.c: same per-K-block promotion) for the owned rows. */
static void oracle(const problem &pb, expect_t &ex) {
    const int64_t K = pb.K, N = pb.N, oc = pb.out_cols(), kb = K / 128, rows = pb.lo.rows, hb = std::max<int64_t>(oc / 128, 1);
    const int esz = pb.esz();
    std::vector<float> C((size_t)(rows * N), 0.0f);
    std::vector<float> A((size_t)(MF__CPU_ROWS * K)), As((size_t)(MF__CPU_ROWS * std::max<int64_t>(kb, 1)));
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
            mf__cpu_gemm_nt(A.data(), As.data(), m, &w, N, K, C.data() + row * N);
        }
    }
    double rms_c = 0;
    int64_t n = 0;
    for (int64_t r = 0; r < rows; r++)
        if (pb.lo.owner[(size_t)r] >= 0)
            for (int64_t c = 0; c < N; c++, n++) rms_c += (double)C[(size_t)(r * N + c)] * C[(size_t)(r * N + c)];
    rms_c = n ? sqrt(rms_c / (double)n) : 0.0;
    const size_t cells = (size_t)(rows * oc);
    ex.y.assign(cells, 0.0f);
    ex.tol.assign(cells, 0.0f);
    ex.ref.assign(cells, 0.0f);
    ex.amax_lo.assign((size_t)(rows * hb), 0.0f);
    ex.amax_hi.assign((size_t)(rows * hb), 0.0f);
    ex.scales.assign((size_t)(rows * hb), 0.0f);
    std::vector<float> hrow((size_t)oc), qs((size_t)hb);
    std::vector<uint8_t> q((size_t)oc);
    for (int64_t r = 0; r < rows; r++) {
        if (pb.lo.owner[(size_t)r] < 0) continue;
        const float *c = C.data() + r * N;
        float *y = ex.y.data() + r * oc, *tol = ex.tol.data() + r * oc, *ref = ex.ref.data() + r * oc;
        for (int64_t i = 0; i < oc; i++) {
            if (pb.epi == kEpiPlain) {
                y[i] = c[i];
                tol[i] = pb.fp8 ? (float)(kFp8AccRel * (fabs(c[i]) + rms_c)) : 0.0f;
            } else {
                const float g = c[i], u = c[oc + i], sg = mf__silu(g);
                y[i] = sg * u;
                if (pb.fp8) {
                    const double eg = kFp8AccRel * (fabs(g) + rms_c), eu = kFp8AccRel * (fabs(u) + rms_c);
                    tol[i] = (float)(kSiluSlope * fabs(u) * eg + fabs(sg) * eu + kSiluSlope * eg * eu + 1e-6 * fabs(y[i]));
                }
            }
            ref[i] = y[i];
        }
        if (pb.epi == kEpiSwiglu && pb.fp8) {
            memcpy(hrow.data(), y, (size_t)oc * sizeof(float));
            mf__quant_1x128_f32(hrow.data(), oc, pb.ue8m0, q.data(), qs.data());
            for (int64_t i = 0; i < oc; i++) ref[i] = mf__fp8_to_float(q[(size_t)i]) * qs[(size_t)(i / 128)];
            memcpy(ex.scales.data() + r * hb, qs.data(), (size_t)(oc / 128) * sizeof(float));
            for (int64_t b = 0; b < oc / 128; b++) {
                float lo = 0.0f, hi = 0.0f;
                for (int64_t i = 128 * b; i < 128 * b + 128; i++) {
                    lo = std::max(lo, fabsf(y[i]) - tol[i]);
                    hi = std::max(hi, fabsf(y[i]) + tol[i]);
                }
                ex.amax_lo[(size_t)(r * hb + b)] = lo;
                ex.amax_hi[(size_t)(r * hb + b)] = hi;
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
    void poison() const;
    void release() {
        cudaFree(a), cudaFree(w), cudaFree(out), cudaFree(as), cudaFree(ws), cudaFree(out_scales), cudaFree(counts),
            cudaFree(offsets);
    }
};


void device_problem::poison() const {
    CUDA_OK(cudaMemset(out, kPoison, out_bytes));
    if (out_scales) CUDA_OK(cudaMemset(out_scales, kPoison, out_scale_count * 4));
}

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
    if (pb.fp8 && pb.epi == kEpiSwiglu) {
        d.out_scale_count = (size_t)(pb.lo.rows * (pb.out_cols() / 128));
        CUDA_OK(cudaMalloc((void **)&d.out_scales, d.out_scale_count * 4));
    }
    d.poison();
    return d;
}

static call_t call_of(const problem &pb, const device_problem &d, int rows_hint) {
    call_t c;
    memset(&c, 0, sizeof c);
    c.fp8 = pb.fp8;
    c.epi = pb.epi;
    c.ue8m0 = pb.ue8m0;
    c.L = pb.L;
    c.N = pb.N;
    c.K = pb.K;
    c.a = d.a;
    c.a_scales = d.as;
    c.w = d.w;
    c.w_scales = d.ws;
    c.counts = d.counts;
    c.offsets = d.offsets;
    c.max_rows = pb.lo.max_rows;
    c.rows_hint = rows_hint;
    c.out = d.out;
    c.out_scales = d.out_scales;
    return c;
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

/* Half a unit in the last place at magnitude v: BF16 (8 significant bits), E4M3 (4, subnormal
 * spacing 2^-9 below 2^-6). */
static double bf16_half_ulp(double v) {
    if (!(v > 0)) return 0.0;
    int e;
    frexp(v, &e); /* v = m 2^e, m in [0.5, 1): floor(log2 v) = e - 1 */
    return ldexp(1.0, e - 1 - 8);
}
static double e4m3_half_ulp(double v) {
    if (!(v >= 0.015625)) return 1.0 / 1024;
    int e;
    frexp(v, &e);
    return ldexp(1.0, e - 1 - 4);
}

/* Compares the owned rows with the oracle (diff measure + element bounds, first mismatches printed)
 * and checks that nothing outside them was written. Returns true when it passes. */
static bool check_outputs(const char *name, const problem &pb, const std::vector<uint8_t> &out,
                          const std::vector<float> &out_scales, const expect_t &ex, int max_print) {
    const int64_t oc = pb.out_cols(), rows = pb.lo.rows, hb = oc / 128;
    const bool fp8_out = pb.out_esz() == 1;
    const double diff_max = pb.fp8 ? 1e-3 : 1e-5;
    double rms = 0;
    int64_t n = 0;
    for (int64_t r = 0; r < rows; r++)
        if (pb.lo.owner[(size_t)r] >= 0)
            for (int64_t c = 0; c < oc; c++, n++) rms += (double)ex.y[(size_t)(r * oc + c)] * ex.y[(size_t)(r * oc + c)];
    rms = n ? sqrt(rms / (double)n) : 0.0;
    double sxy = 0, sxx = 0, syy = 0, worst = 0, ratio = 0, scale_dev = 0;
    int64_t wrong = 0, scale_wrong = 0, touched = 0;
    bool nonfinite = false;
    for (int64_t r = 0; r < rows; r++) {
        const int owner = pb.lo.owner[(size_t)r];
        if (owner < 0) {
            const size_t rb = (size_t)(oc * pb.out_esz());
            bool t = false;
            for (size_t b = 0; b < rb; b++) t = t || out[(size_t)r * rb + b] != kPoison;
            for (int64_t c = 0; fp8_out && c < hb; c++) {
                uint32_t u;
                memcpy(&u, &out_scales[(size_t)(r * hb + c)], 4);
                t = t || u != 0xFFFFFFFFu;
            }
            if (t && touched++ < max_print) printf("    %s: row %lld (no expert owns it) was written\n", name, (long long)r);
            continue;
        }
        for (int64_t c = 0; c < oc; c++) {
            const size_t at = (size_t)(r * oc + c);
            const double x = got_value(pb, out, out_scales, r, c), y = ex.y[at], ref = ex.ref[at], tol = ex.tol[at];
            if (!std::isfinite(x) || !std::isfinite(y)) nonfinite = true;
            sxy += x * ref;
            sxx += x * x;
            syy += ref * ref;
            const double err = fabs(x - y);
            double bound;
            if (!pb.fp8) {
                bound = std::max(fabs(x), fabs(y)) / 128.0 + 1e-5 * rms;
            } else if (!fp8_out) {
                bound = tol + bf16_half_ulp(fabs(y) + tol);
            } else {
                const double s = out_scales[(size_t)(r * hb + c / 128)];
                bound = tol + s * e4m3_half_ulp((fabs(y) + tol) / s) + 1e-6 * fabs(y);
            }
            if (!(err <= bound)) {
                if (wrong < max_print)
                    printf("    %s mismatch: row %lld (expert %d, token %lld of it) col %lld: expected %.8g actual %.8g bound %.3g\n",
                           name, (long long)r, owner, (long long)(r - pb.lo.offsets[(size_t)owner]), (long long)c, y, x, bound);
                wrong++;
            }
            if (err > worst || err != err) worst = err;
            const double q = bound > 0 ? err / bound : (err > 0 ? INFINITY : 0.0);
            if (q > ratio || q != q) ratio = q;
        }
        for (int64_t b = 0; fp8_out && b < hb; b++) {
            const size_t at = (size_t)(r * hb + b);
            float lo, hi, inv;
            mf__fp8_block_scale(ex.amax_lo[at], pb.ue8m0, &lo, &inv);
            mf__fp8_block_scale(ex.amax_hi[at], pb.ue8m0, &hi, &inv);
            const double s = out_scales[at];
            scale_dev = std::max(scale_dev, fabs(s - ex.scales[at]) / ex.scales[at]);
            if (!(s >= lo * (1 - 1e-6) && s <= hi * (1 + 1e-6))) {
                if (scale_wrong < max_print)
                    printf("    %s h_scale out of range: row %lld block %lld: allowed [%.8g, %.8g] actual %.8g\n", name, (long long)r,
                           (long long)b, lo, hi, s);
                scale_wrong++;
            }
        }
    }
    double diff = (sxx + syy) == 0 ? 0.0 : 1.0 - 2.0 * sxy / (sxx + syy);
    if (nonfinite) diff = INFINITY;
    const bool ok = !nonfinite && diff < diff_max && wrong == 0 && scale_wrong == 0 && touched == 0;
    char dev[64] = "";
    if (fp8_out) snprintf(dev, sizeof dev, "  h_scale dev %.1e", scale_dev);
    printf("%s %-52s diff %.2e (max %.0e)  max|err| %.3g  err/bound %.2f  wrong %lld/%lld%s%s%s\n", ok ? "PASS" : "FAIL", name,
           diff, diff_max, worst, ratio, (long long)wrong, (long long)n, dev, scale_wrong ? "  h_scales wrong" : "",
           touched ? "  rows outside counts written" : "");
    if (!ok) g_failures++;
    return ok;
}

/* ================================================================================================
 * fake owners: heaps of gathered rows (W13 a.gather), combine slots (W2 ret)
 * ============================================================================================== */

static const size_t kHeapAlign = MF__HEAP_ALIGN;

static size_t align_size(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* R heaps, each [x: S rows of K bytes][scales: S x K/128 floats] (+ with topk > 0 [combine: S x topk x
 * hidden BF16], poisoned: a layer's heap slot, whose one view and src the small kernel gathers and
 * returns through); every owned receive row is copied to a distinct random (rank, token) with token
 * >= 1 and a random k < topk (8 without); token 0 of rank 0 (NaN garbage) is what the rows no expert
 * owns point at, and every unused heap row is garbage too. */
struct heaps_t {
    std::vector<uint8_t *> dev;
    int32_t *src = NULL;
    mf__heap_view_t view; /* the R heaps, x and scales (and combine) offsets */
    int64_t S = 0;
    size_t bytes = 0;     /* of each heap */
    void release() {
        for (uint8_t *p : dev) cudaFree(p);
        cudaFree(src);
    }
};

static heaps_t make_heaps(const problem &pb, int R, int topk = 0, int64_t hidden = 0) {
    heaps_t hp;
    const int64_t rows = pb.lo.rows, row_bytes = (int64_t)pb.K * pb.esz(), kb = pb.K / 128;
    std::vector<int64_t> owned;
    for (int64_t r = 0; r < rows; r++)
        if (pb.lo.owner[(size_t)r] >= 0) owned.push_back(r);
    const int64_t S = (int64_t)owned.size() / R + 2;
    std::vector<std::pair<int, int64_t>> slots;
    for (int q = 0; q < R; q++)
        for (int64_t t = 1; t < S; t++) slots.push_back({q, t});
    shuffle(slots);
    const size_t x_off = kHeapAlign, sc_off = align_size(x_off + (size_t)(S * row_bytes), kHeapAlign);
    const size_t cb_off = align_size(sc_off + (size_t)(S * kb) * 4, kHeapAlign);
    const size_t bytes = topk ? cb_off + (size_t)(S * topk * hidden) * 2 : sc_off + (size_t)(S * kb) * 4;
    std::vector<std::vector<uint8_t>> host((size_t)R, std::vector<uint8_t>(bytes, kPoison));
    for (int q = 0; q < R; q++) {
        garble(host[(size_t)q].data(), (int64_t)sc_off);
        garble_scales((float *)(host[(size_t)q].data() + sc_off), S * kb);
    }
    std::vector<int32_t> src((size_t)(rows * 3), 0);
    for (size_t i = 0; i < owned.size(); i++) {
        const int64_t r = owned[i];
        const int q = slots[i].first;
        const int64_t t = slots[i].second;
        memcpy(host[(size_t)q].data() + x_off + t * row_bytes, pb.a.data() + r * row_bytes, (size_t)row_bytes);
        if (pb.fp8) memcpy(host[(size_t)q].data() + sc_off + t * kb * 4, pb.as.data() + r * kb, (size_t)kb * 4);
        src[(size_t)(3 * r)] = q;
        src[(size_t)(3 * r + 1)] = (int32_t)t;
        src[(size_t)(3 * r + 2)] = (int32_t)(rnd_u64() % (uint64_t)(topk ? topk : 8));
    }
    memset(&hp.view, 0, sizeof hp.view);
    for (int q = 0; q < R; q++) {
        hp.dev.push_back(to_device(host[(size_t)q]));
        hp.view.heap[q] = hp.dev.back();
    }
    hp.src = to_device(src);
    hp.view.x = x_off;
    hp.view.scales = sc_off;
    hp.view.combine = topk ? cb_off : 0;
    hp.S = S;
    hp.bytes = bytes;
    return hp;
}

/* R ranks' combine slots [S, K, H] (K = num_topk) poisoned; every owned receive row returns to a
 * distinct random (rank, token, k) other than (0, 0, 0), which the rows no expert owns point at. */
struct slots_t {
    std::vector<uint16_t *> dev;
    int32_t *src = NULL;
    std::vector<int32_t> host_src;
    int64_t S = 0;
    int K = 0;
    mf__heap_view_t view; /* the R ranks' slots, combine offset 0 */
    void release() {
        for (uint16_t *p : dev) cudaFree(p);
        cudaFree(src);
    }
};

static slots_t make_slots(const problem &pb, int R, int K) {
    slots_t sl;
    const int64_t rows = pb.lo.rows, H = pb.N;
    std::vector<int64_t> owned;
    for (int64_t r = 0; r < rows; r++)
        if (pb.lo.owner[(size_t)r] >= 0) owned.push_back(r);
    sl.K = K;
    sl.S = (int64_t)owned.size() / ((int64_t)R * K) + 2;
    std::vector<int64_t> free_slots; /* (rank S + token) K + k */
    for (int64_t i = 1; i < R * sl.S * K; i++) free_slots.push_back(i);
    shuffle(free_slots);
    sl.host_src.assign((size_t)(rows * 3), 0);
    for (size_t i = 0; i < owned.size(); i++) {
        const int64_t s = free_slots[i], r = owned[i];
        sl.host_src[(size_t)(3 * r)] = (int32_t)(s / (sl.S * K));
        sl.host_src[(size_t)(3 * r + 1)] = (int32_t)(s / K % sl.S);
        sl.host_src[(size_t)(3 * r + 2)] = (int32_t)(s % K);
    }
    memset(&sl.view, 0, sizeof sl.view);
    for (int q = 0; q < R; q++) {
        uint16_t *p = NULL;
        CUDA_OK(cudaMalloc((void **)&p, (size_t)(sl.S * K * H) * 2));
        CUDA_OK(cudaMemset(p, kPoison, (size_t)(sl.S * K * H) * 2));
        sl.dev.push_back(p);
        sl.view.heap[q] = (uint8_t *)p;
    }
    sl.src = to_device(sl.host_src);
    return sl;
}

/* ================================================================================================
 * --validate
 * ============================================================================================== */

struct vcase {
    std::string name;
    int fp8, epi, N, K;
    std::vector<int> counts;
    int C;             /* 0: EXPERT_MAJOR, else MASKED capacity */
    int block_t;       /* 0: rows_hint = the largest count; else rows_hint = block_t (forces T) */
    int ue8m0;
    bool graph;        /* the repeat is a captured CUDA graph's replay */
    int gather_heaps;  /* swiglu: also with A gathered from this many fake heaps */
    int ret_ranks;     /* plain: also with `ret` into this many fake owners' slots */
    bool dispatcher;   /* also through mf__cuda_w13_swiglu / mf__cuda_w2 */
};

static bool same_bits(const device_problem &d, const std::vector<uint8_t> &out, const std::vector<float> &out_scales) {
    const std::vector<uint8_t> o = to_host(d.out, d.out_bytes);
    const std::vector<float> s = to_host(d.out_scales, d.out_scale_count);
    return o == out && !memcmp(s.data(), out_scales.data(), s.size() * 4);
}

static void run_vcase(const vcase &vc, int max_print) {
    char name[192];
    g_case = vc.name.c_str();
    problem pb = make_problem(vc.fp8, vc.epi, vc.N, vc.K, vc.counts, vc.C, vc.ue8m0);
    device_problem d = upload(pb);
    const int rows_hint = vc.block_t ? vc.block_t : pb.lo.max_count;
    call_t c = call_of(pb, d, rows_hint);
    const int block_t = choice_of(c, 0).block_rows;
    const mf__gemm_variant_info_t *vi = variant_info(pb.fp8, pb.epi == kEpiSwiglu, block_t, 0);
    snprintf(name, sizeof name, "%s [T%d st%d]", vc.name.c_str(), block_t, vi ? vi->stages : 0);
    if (!launched(run_call(c, 0), name)) {
        d.release();
        return;
    }
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> out = to_host(d.out, d.out_bytes);
    const std::vector<float> out_scales = to_host(d.out_scales, d.out_scale_count);
    expect_t ex;
    oracle(pb, ex);
    check_outputs(name, pb, out, out_scales, ex, max_print);

    /* repeat: a second run (or a graph replay) must write the same bits */
    d.poison();
    if (vc.graph) {
        cudaStream_t s;
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        const mf_result_t r = run_call(c, s);
        CUDA_OK(cudaStreamEndCapture(s, &g));
        if (launched(r, name)) {
            CUDA_OK(cudaGraphInstantiate(&ge, g, 0));
            CUDA_OK(cudaGraphLaunch(ge, s));
            CUDA_OK(cudaStreamSynchronize(s));
            CUDA_OK(cudaGraphExecDestroy(ge));
        }
        CUDA_OK(cudaGraphDestroy(g));
        CUDA_OK(cudaStreamDestroy(s));
    } else if (launched(run_call(c, 0), name)) {
        CUDA_OK(cudaDeviceSynchronize());
    }
    bool same = same_bits(d, out, out_scales);
    printf("%s %-52s %s bitwise equal to the first run\n", same ? "PASS" : "FAIL", name, vc.graph ? "graph replay" : "second run");
    if (!same) g_failures++;

    if (vc.gather_heaps && pb.epi == kEpiSwiglu) {
        heaps_t hp = make_heaps(pb, vc.gather_heaps);
        call_t cg = c;
        cg.a = NULL;
        cg.a_scales = NULL;
        const mf__gemm_gather_t g = {&hp.view, hp.src};
        cg.gather = &g;
        vi = variant_info(pb.fp8, 1, block_t, 1);
        char gname[192];
        snprintf(gname, sizeof gname, "%s gathered A, %d heaps [st%d]", vc.name.c_str(), vc.gather_heaps, vi ? vi->stages : 0);
        d.poison();
        if (launched(run_call(cg, 0), gname)) {
            CUDA_OK(cudaDeviceSynchronize());
            same = same_bits(d, out, out_scales);
            printf("%s %-52s bitwise equal to contiguous A (untouched rows included)\n", same ? "PASS" : "FAIL", gname);
            if (!same) g_failures++;
        }
        hp.release();
    }

    if (vc.ret_ranks && pb.epi == kEpiPlain) {
        const int K = 3;
        slots_t sl = make_slots(pb, vc.ret_ranks, K);
        call_t cr = c;
        cr.out = NULL;
        const mf__gemm_return_t ret = {&sl.view, sl.src, K};
        cr.ret = &ret;
        char rname[192];
        snprintf(rname, sizeof rname, "%s ret, %d ranks K=%d", vc.name.c_str(), vc.ret_ranks, K);
        if (launched(run_call(cr, 0), rname)) {
            CUDA_OK(cudaDeviceSynchronize());
            const int64_t H = pb.N, row_bytes = H * 2;
            std::vector<std::vector<uint8_t>> got;
            for (uint16_t *p : sl.dev) got.push_back(to_host((const uint8_t *)p, (size_t)(sl.S * K * row_bytes)));
            std::vector<std::vector<char>> hit((size_t)vc.ret_ranks, std::vector<char>((size_t)(sl.S * K), 0));
            int64_t bad_rows = 0, stray = 0;
            for (int64_t r = 0; r < pb.lo.rows; r++) {
                if (pb.lo.owner[(size_t)r] < 0) continue;
                const int q = sl.host_src[(size_t)(3 * r)];
                const int64_t slot = (int64_t)sl.host_src[(size_t)(3 * r + 1)] * K + sl.host_src[(size_t)(3 * r + 2)];
                hit[(size_t)q][(size_t)slot] = 1;
                if (memcmp(got[(size_t)q].data() + slot * row_bytes, out.data() + r * row_bytes, (size_t)row_bytes)) {
                    if (bad_rows++ < max_print)
                        printf("    %s: row %lld -> rank %d slot (token %lld, k %lld) differs from out[row]\n", rname,
                               (long long)r, q, (long long)(slot / K), (long long)(slot % K));
                }
            }
            for (int q = 0; q < vc.ret_ranks; q++)
                for (int64_t s = 0; s < sl.S * K; s++) {
                    if (hit[(size_t)q][(size_t)s]) continue;
                    const uint8_t *p = got[(size_t)q].data() + s * row_bytes;
                    bool t = false;
                    for (int64_t b = 0; b < row_bytes; b++) t = t || p[b] != kPoison;
                    if (t && stray++ < max_print)
                        printf("    %s: rank %d slot (token %lld, k %lld) was written but no row returns there\n", rname, q,
                               (long long)(s / K), (long long)(s % K));
                }
            const bool ok = bad_rows == 0 && stray == 0;
            printf("%s %-52s rows at (token K + k) H of their rank, bitwise = out[]; %lld wrong, %lld stray\n", ok ? "PASS" : "FAIL",
                   rname, (long long)bad_rows, (long long)stray);
            if (!ok) g_failures++;
        }
        sl.release();
    }

    if (vc.dispatcher) {
        char dname[192];
        snprintf(dname, sizeof dname, "%s dispatcher (rows_hint %d)", vc.name.c_str(), rows_hint);
        d.poison();
        if (launched(run_call(c, 0, 1), dname)) {
            CUDA_OK(cudaDeviceSynchronize());
            same = same_bits(d, out, out_scales);
            printf("%s %-52s bitwise equal to the decode launcher (the dispatcher runs it)\n", same ? "PASS" : "FAIL", dname);
            if (!same) g_failures++;
        }
    }
    d.release();
}

/* Shapes the kernel does not take: MF_ERR_NOT_SUPPORTED, no launch (outputs untouched), no error. */
static void run_declines(void) {
    struct {
        const char *what;
        int fp8, epi, N, K, L;
    } v[] = {
        {"w13 bf16 I=192 (2I not a multiple of 256)", 0, kEpiSwiglu, 384, 128, 2},
        {"w13 bf16 H=96 (K bytes not a multiple of 128)", 0, kEpiSwiglu, 256, 96, 2},
        {"w2 fp8 H=192 (not a multiple of 128)", 1, kEpiPlain, 192, 128, 2},
        {"w2 bf16 L=513 (> kMaxExperts)", 0, kEpiPlain, 128, 128, mf__decode::kMaxExperts + 1},
    };
    for (auto &x : v) {
        g_case = x.what;
        std::vector<int> counts((size_t)x.L, 1);
        problem pb = make_problem(x.fp8, x.epi, x.N, x.K, counts, 4, 0);
        device_problem d = upload(pb);
        call_t c = call_of(pb, d, 1);
        mf__clear_error();
        const mf_result_t r = run_call(c, 0);
        CUDA_OK(cudaDeviceSynchronize());
        const std::vector<uint8_t> out = to_host(d.out, d.out_bytes);
        bool untouched = true;
        for (uint8_t b : out) untouched = untouched && b == kPoison;
        const bool ok = r == MF_ERR_NOT_SUPPORTED && untouched && mf_last_error()[0] == '\0';
        printf("%s decline: %-52s %s%s%s (%s)\n", ok ? "PASS" : "FAIL", x.what, mf_result_string(r), untouched ? "" : ", output written",
               mf_last_error()[0] ? ", library error set" : "", mf__gemm_last_decline(kMfGemmFamilyDecode));
        if (!ok) g_failures++;
        d.release();
    }
}

static void run_validate(void) {
    printf("# --validate: through the library's launchers; CPU oracle (src/cpu/gemm.c per-K-block promotion);\n"
           "# outputs poisoned with 0xFF, garbage (incl. NaN) in every row no expert owns; bounds: see the file comment\n");
    const int P = kEpiPlain, S = kEpiSwiglu;
    const std::vector<int> c1 = {5, 0, 64}, c2 = {1, 17, 33}, c3 = {70, 3, 0, 129};
    std::vector<vcase> cases;
    for (int fp8 = 1; fp8 >= 0; fp8--)
        for (int epi = 0; epi < 2; epi++) {
            const int N = epi == S ? 512 : 384;
            const char *tag = fp8 ? (epi == S ? "fp8 swiglu" : "fp8 plain") : (epi == S ? "bf16 swiglu" : "bf16 plain");
            struct {
                const char *what;
                std::vector<int> counts;
                int C, block_t, owners;
                bool dispatcher;
            } v[] = {
                {"{5,0,64} expert-major", c1, 0, 0, 3, false},     {"{5,0,64} masked C=72", c1, 72, 0, 0, false},
                {"{1,17,33} expert-major", c2, 0, 0, 0, false},    {"{1,17,33} masked C=40", c2, 40, 0, 0, true},
                {"{5,0,64} masked C=72 T16", c1, 72, 16, 2, false}, {"{1,17,33} expert-major T8", c2, 0, 8, 4, false},
                {"{1,17,33} masked C=40 T32", c2, 40, 32, 2, false}, {"{70,3,0,129} expert-major T32", c3, 0, 32, 3, false},
            };
            for (auto &x : v)
                cases.push_back({std::string(tag) + " " + x.what, fp8, epi, N, 384, x.counts, x.C, x.block_t, 0, false,
                                 epi == S ? x.owners : 0, epi == P ? x.owners : 0, x.dispatcher});
        }
    /* four K blocks, UE8M0 h scales, graph replays */
    cases.push_back({"fp8 plain K=512 masked C=40", 1, P, 384, 512, c2, 40, 0, 0, true, 0, 2, false});
    cases.push_back({"fp8 swiglu K=512 expert-major", 1, S, 512, 512, c1, 0, 0, 0, true, 2, 0, false});
    cases.push_back({"bf16 plain K=512 expert-major", 0, P, 384, 512, c1, 0, 0, 0, true, 0, 0, false});
    cases.push_back({"bf16 swiglu K=512 masked C=40 T16", 0, S, 512, 512, c2, 40, 16, 0, false, 2, 0, false});
    cases.push_back({"fp8 swiglu ue8m0 masked C=72", 1, S, 512, 384, c1, 72, 0, 1, false, 3, 0, false});
    /* many experts, most empty, one over the tile (two token blocks); the table limit */
    cases.push_back({"fp8 plain L=40 sparse masked C=80", 1, P, 256, 256,
                     {0, 3, 0, 0, 70, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2},
                     80, 0, 0, false, 0, 2, false});
    {
        std::vector<int> many((size_t)mf__decode::kMaxExperts, 0);
        for (int e = 0; e < mf__decode::kMaxExperts; e += 7) many[(size_t)e] = 1 + e % 5;
        many.back() = 3;
        cases.push_back({"bf16 plain L=512 sparse expert-major", 0, P, 128, 128, many, 0, 0, 0, false, 0, 0, false});
        cases.push_back({"fp8 swiglu L=512 sparse expert-major", 1, S, 256, 128, many, 0, 0, 0, false, 4, 0, false});
    }
    /* DeepSeek-V3 shapes (W13: N = 2I = 4096, K = H = 7168; W2: N = H = 7168, K = I = 2048) */
    const std::vector<int> ds = {8, 8, 8, 8};
    cases.push_back({"deepseek w13 fp8 swiglu {8,8,8,8} masked", 1, S, 4096, 7168, ds, 16, 0, 0, true, 4, 0, true});
    cases.push_back({"deepseek w2 fp8 plain {8,8,8,8} expert-major", 1, P, 7168, 2048, ds, 0, 0, 0, false, 0, 4, true});
    cases.push_back({"deepseek w13 bf16 swiglu {8,8,8,8} expert-major", 0, S, 4096, 7168, ds, 0, 0, 0, false, 2, 0, false});
    cases.push_back({"deepseek w2 bf16 plain {8,8,8,8} masked", 0, P, 7168, 2048, ds, 16, 0, 0, false, 0, 2, false});
    for (const vcase &vc : cases) run_vcase(vc, 4);
    run_declines();
}

/* ================================================================================================
 * --selftest: one tile, structured inputs, first mismatch printed
 * ============================================================================================== */

/* Runs one tile and prints the first mismatches as (token, column, expected, actual). */
static void selftest_case(const char *name, problem &pb, int max_print) {
    g_case = name;
    device_problem d = upload(pb);
    call_t c = call_of(pb, d, pb.lo.max_count);
    if (!launched(run_call(c, 0), name)) {
        d.release();
        return;
    }
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> out = to_host(d.out, d.out_bytes);
    std::vector<float> out_scales = to_host(d.out_scales, d.out_scale_count);
    expect_t ex;
    oracle(pb, ex);
    if (!check_outputs(name, pb, out, out_scales, ex, max_print)) {
        /* the pattern of a mapping bug is easier to read as a picture: token 0 across the columns,
         * column 0 across the tokens */
        printf("    token 0, columns 0..15  expected:");
        for (int c = 0; c < 16; c++) printf(" %g", ex.y[(size_t)c]);
        printf("\n    token 0, columns 0..15  actual:  ");
        for (int c = 0; c < 16; c++) printf(" %g", got_value(pb, out, out_scales, 0, c));
        printf("\n    column 0, tokens 0..15  expected:");
        for (int r = 0; r < 16 && r < pb.lo.rows; r++) printf(" %g", ex.y[(size_t)(r * pb.out_cols())]);
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
    selftest_case("selftest fp8 random K=256, 13 tokens (shifted tile)", r3, 8);
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
    uint8_t *w = NULL, *a = NULL, *out = NULL, *flush = NULL, *heap = NULL;
    float *ws = NULL, *as = NULL, *out_scales = NULL;
    int32_t *counts = NULL, *offsets = NULL, *src = NULL;
    size_t w_bytes = 0, a_bytes = 0, out_bytes = 0, ws_count = 0, as_count = 0, out_scale_count = 0, heap_bytes = 0;
    int64_t src_rows = 0;
    cudaStream_t stream;
    cudaEvent_t ev0, ev1;
    bool peers = true;
    std::vector<std::string> json_rows;
};

static const int kWarmupRuns = 3;
static const int kTimedRuns = 20;
static const size_t kFlushBytes = 512ull << 20;
static const int kBenchCapacity = 256;        /* MASKED C (>= 1.3 x the largest M) */
static const int kBenchGatherL = 32;          /* gather / ret variants: DeepSeek L = 32 */

/* Median time (us) of `fn` with the L2 flushed before every run. The flush is queued first, so the
 * launcher's host work (tensor maps) overlaps it and is not timed. */
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

/* variant: "default" (rows_hint = M), "T64" (rows_hint = 64), "gather" (W13: A rows read from a
 * heap copy at permuted rows), "ret" (W2: rows to one owner's slots at permuted tokens). */
static void bench_case(bench_ctx &bc, const bmodel &m, int gemm, int fp8, int masked, bool uneven, int M, const char *variant) {
    char name[160];
    const int epi = gemm == 13 ? kEpiSwiglu : kEpiPlain;
    const int N = gemm == 13 ? 2 * m.I : m.H, K = gemm == 13 ? m.H : m.I, L = m.L, esz = fp8 ? 1 : 2;
    const bool gather = !strcmp(variant, "gather"), ret = !strcmp(variant, "ret"), t64 = !strcmp(variant, "T64");
    snprintf(name, sizeof name, "%s w%d %s %s %s L=%d M=%d %s", m.name, gemm, fp8 ? "fp8" : "bf16", masked ? "masked" : "expert-major",
             uneven ? "uneven" : "equal", L, M, variant);
    g_case = name;
    std::vector<int> counts = bench_counts(L, M, uneven, 0x1234567ull * (uint64_t)(M + 7 * L));
    layout_t lo = make_layout(counts, masked ? kBenchCapacity : 0);
    CUDA_OK(cudaMemcpy(bc.counts, lo.counts.data(), (size_t)L * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(bc.offsets, lo.offsets.data(), ((size_t)L + 1) * 4, cudaMemcpyHostToDevice));
    const size_t need_w = (size_t)L * N * K * esz, need_a = (size_t)lo.rows * K * esz;
    if (need_w > bc.w_bytes || need_a > bc.a_bytes || (size_t)lo.rows * N * 2 > bc.out_bytes ||
        ((gather || ret) && (lo.rows > bc.src_rows || need_a + (size_t)lo.rows * (K / 128) * 4 + kHeapAlign > bc.heap_bytes))) {
        printf("FAIL %s: bench buffers too small\n", name);
        g_failures++;
        return;
    }
    call_t c;
    memset(&c, 0, sizeof c);
    c.fp8 = fp8;
    c.epi = epi;
    c.L = L;
    c.N = N;
    c.K = K;
    c.a = bc.a;
    c.a_scales = bc.as;
    c.w = bc.w;
    c.w_scales = bc.ws;
    c.counts = bc.counts;
    c.offsets = bc.offsets;
    c.max_rows = lo.max_rows;
    c.rows_hint = t64 ? 64 : M;
    c.out = bc.out;
    c.out_scales = bc.out_scales;
    mf__heap_view_t owner; /* rank 0: the gathered rows' heap, or the combine slots (out itself) */
    mf__gemm_gather_t g;
    mf__gemm_return_t rt;
    memset(&owner, 0, sizeof owner);
    memset(&g, 0, sizeof g);
    memset(&rt, 0, sizeof rt);
    if (gather || ret) {
        /* row i of the receive tensor <-> permuted token perm[i] of rank 0 */
        std::vector<int32_t> perm((size_t)lo.rows), src((size_t)(3 * lo.rows), 0);
        for (int64_t i = 0; i < lo.rows; i++) perm[(size_t)i] = (int32_t)i;
        shuffle(perm);
        for (int64_t i = 0; i < lo.rows; i++) src[(size_t)(3 * i + 1)] = perm[(size_t)i];
        CUDA_OK(cudaMemcpy(bc.src, src.data(), src.size() * 4, cudaMemcpyHostToDevice));
        if (gather) {
            const size_t sc_off = align_size(kHeapAlign + need_a, kHeapAlign);
            CUDA_OK(cudaMemcpy(bc.heap + kHeapAlign, bc.a, need_a, cudaMemcpyDeviceToDevice));
            if (fp8) CUDA_OK(cudaMemcpy(bc.heap + sc_off, bc.as, (size_t)lo.rows * (K / 128) * 4, cudaMemcpyDeviceToDevice));
            owner.heap[0] = bc.heap;
            owner.x = kHeapAlign;
            owner.scales = sc_off;
            g.view = &owner;
            g.src = bc.src;
            c.gather = &g;
        } else {
            owner.heap[0] = (uint8_t *)bc.out;
            rt.view = &owner;
            rt.src = bc.src;
            rt.num_topk = 1;
            c.ret = &rt;
            c.out = NULL;
        }
    }
    mf_result_t r = run_call(c, bc.stream);
    if (!launched(r, name)) return;
    const int block_t = choice_of(c, 0).block_rows;
    const mf__gemm_variant_info_t *vi = variant_info(fp8, epi == kEpiSwiglu, block_t, gather);
    const double us = time_median(bc, [&] { r = run_call(c, bc.stream); });
    if (!launched(r, name)) return;
    double alt_us = 0;
    if (bc.peers && !strcmp(variant, "default")) {
        call_t ca = c;
        ca.rows_hint = kMfDecodeMaxRows + 1;
        bool ok = true;
        alt_us = time_median(bc, [&] {
            mf_result_t ra = run_call(ca, bc.stream, 1);
            if (ra != MF_SUCCESS && ok) {
                printf("# non-decode dispatch refused %s: %s\n", name, mf_last_error());
                ok = false;
            }
        });
        if (!ok) alt_us = 0;
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
    printf("%-12s w%-2d %-4s %-12s %-6s %4d %5d %5d %4d %3d %2d %-8s %9.1f %7.2f %8.1f", m.name, gemm, fp8 ? "fp8" : "bf16",
           masked ? "masked" : "expert-major", uneven ? "uneven" : "equal", L, N, K, M, block_t, vi ? vi->stages : 0, variant, us, tbs,
           tflops);
    if (alt_us > 0) printf(" %9.1f %6.2fx\n", alt_us, alt_us / us);
    else printf(" %9s %7s\n", "-", "-");
    char row[1024];
    char peers[128] = "[]";
    if (alt_us > 0) snprintf(peers, sizeof peers, "[{\"name\": \"dispatch_non_decode\", \"time_us\": %.2f}]", alt_us);
    snprintf(row, sizeof row,
             "{\"op\": \"gemm\", \"dtype\": \"%s\", \"layout\": \"%s\", \"shape\": {\"E\": %d, \"N\": %d, \"K\": %d, \"M\": %d}, "
             "\"time_us\": %.2f, \"tflops\": %.2f, \"gbps\": %.1f, \"peers\": %s, \"model\": \"%s\", \"gemm\": \"w%d\", "
             "\"counts\": \"%s\", \"variant\": \"%s\", \"block_t\": %d, \"stages\": %d}",
             fp8 ? "fp8" : "bf16", masked ? "masked" : "expert_major", L, N, K, M, us, tflops, wbytes / us / 1e3, peers, m.name, gemm,
             uneven ? "uneven" : "equal", variant, block_t, vi ? vi->stages : 0);
    bc.json_rows.push_back(row);
}

static void run_bench(const char *json_path, bool peers, bool quick, const std::string &command) {
    const bmodel models[] = {
        {"deepseek-v3", 7168, 2048, 32}, {"deepseek-v3", 7168, 2048, 256}, {"qwen3-235b", 4096, 1536, 16}, {"kimi-k2", 7168, 2048, 48}};
    const int Ms[] = {8, 16, 32, 64, 128};
    bench_ctx bc;
    bc.peers = peers;
    /* buffers: the largest W13 or W2 of any model (DeepSeek L = 256 BF16: 15 GB), activations for
     * L x kBenchCapacity rows of the largest K; the gather heap for kBenchGatherL x kBenchCapacity rows */
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
    bc.src_rows = (int64_t)kBenchGatherL * kBenchCapacity;
    bc.heap_bytes = 2 * kHeapAlign + (size_t)bc.src_rows * k_max * 2 + (size_t)bc.src_rows * (k_max / 128) * 4;
    g_case = "bench allocation";
    CUDA_OK(cudaMalloc((void **)&bc.w, bc.w_bytes));
    CUDA_OK(cudaMalloc((void **)&bc.a, bc.a_bytes));
    CUDA_OK(cudaMalloc((void **)&bc.out, bc.out_bytes));
    CUDA_OK(cudaMalloc((void **)&bc.flush, kFlushBytes));
    CUDA_OK(cudaMalloc((void **)&bc.heap, bc.heap_bytes));
    CUDA_OK(cudaMalloc((void **)&bc.ws, bc.ws_count * 4));
    CUDA_OK(cudaMalloc((void **)&bc.as, bc.as_count * 4));
    CUDA_OK(cudaMalloc((void **)&bc.out_scales, bc.out_scale_count * 4));
    CUDA_OK(cudaMalloc((void **)&bc.counts, 1024 * 4));
    CUDA_OK(cudaMalloc((void **)&bc.offsets, 1025 * 4));
    CUDA_OK(cudaMalloc((void **)&bc.src, (size_t)bc.src_rows * 3 * 4));
    CUDA_OK(cudaStreamCreateWithFlags(&bc.stream, cudaStreamNonBlocking));
    CUDA_OK(cudaEventCreate(&bc.ev0));
    CUDA_OK(cudaEventCreate(&bc.ev1));

    printf("\n# --bench: the library's decode launchers; median of %d runs after %d warm-up, L2 flushed (512 MB memset) before each run\n",
           kTimedRuns, kWarmupRuns);
    printf("# wTB/s = weight bytes of the experts with rows (FP8: + their 128x128 scales) / time; TFLOP/s = 2 rows N K / time\n");
    printf("# T = tokens per tile (from rows_hint = M, or 64 for T64), st = stages; gather: W13 A rows read at permuted rows of a\n"
           "# heap by cp.async; ret: W2 rows to permuted slots of one owner; alt = the dispatcher with rows_hint > kMfDecodeMaxRows\n"
           "# (v1 today; the TMA kernel once it lands), speedup = alt / decode\n");
    printf("# MASKED: C = %d; EXPERT_MAJOR: segments aligned to 128; uneven: counts M +- 30%%\n", kBenchCapacity);
    printf("%-12s %-3s %-4s %-12s %-6s %4s %5s %5s %4s %3s %2s %-8s %9s %7s %8s %9s %7s\n", "# model", "gemm", "dt", "layout", "counts",
           "L", "N", "K", "M", "T", "st", "variant", "time_us", "wTB/s", "TFLOP/s", "alt_us", "speedup");
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
                            bench_case(bc, m, gemm, fp8, masked, uneven != 0, M, "default");
                        }
        /* variants on DeepSeek L = 32 masked equal: a larger tile, gathered A, rows returned to owners */
        for (int gemm : {13, 2})
            for (int M : {8, 32, 64}) {
                if (M <= 32) bench_case(bc, models[0], gemm, fp8, 1, false, M, "T64");
                if (M != 32) bench_case(bc, models[0], gemm, fp8, 1, false, M, gemm == 13 ? "gather" : "ret");
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
            FILE *gp = popen("git rev-parse --short HEAD 2>/dev/null", "r");
            if (gp) {
                if (fgets(commit, sizeof commit, gp)) commit[strcspn(commit, "\r\n")] = 0;
                if (pclose(gp) != 0 || !commit[0]) snprintf(commit, sizeof commit, "unknown");
            }
            std::string cmd;
            for (char ch : command) cmd += (ch == '"' || ch == '\\') ? std::string("\\") + ch : std::string(1, ch);
            fprintf(f, "{\"meta\": {\"card\": \"h200\", \"date\": \"%s\", \"commit\": \"%s\", \"command\": \"%s\", \"backend\": \"cuda\", "
                       "\"note\": \"sm90 decode kernel through the library launchers; peer dispatch_non_decode = the dispatcher with "
                       "rows_hint > kMfDecodeMaxRows\"},\n"
                       " \"rows\": [\n",
                    date, commit, cmd.c_str());
            for (size_t i = 0; i < bc.json_rows.size(); i++)
                fprintf(f, "  %s%s\n", bc.json_rows[i].c_str(), i + 1 < bc.json_rows.size() ? "," : "");
            fprintf(f, " ]}\n");
            fclose(f);
            printf("# wrote %s (%zu rows)\n", json_path, bc.json_rows.size());
        }
    }
    cudaFree(bc.w), cudaFree(bc.a), cudaFree(bc.out), cudaFree(bc.flush), cudaFree(bc.heap), cudaFree(bc.ws), cudaFree(bc.as);
    cudaFree(bc.out_scales), cudaFree(bc.counts), cudaFree(bc.offsets), cudaFree(bc.src);
    cudaStreamDestroy(bc.stream);
    cudaEventDestroy(bc.ev0);
    cudaEventDestroy(bc.ev1);
}

/* ================================================================================================
 * --timeline: where a decode launch's time goes, per CTA (%globaltimer stamps of the kernel,
 * mf__sm90_decode_set_timeline), for the one-row-per-expert shapes of T = 1 (issue 25)
 * ============================================================================================== */

static double pct(std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[(size_t)std::min((double)v.size() - 1, q * (double)(v.size() - 1) + 0.5)];
}

static void run_timeline(void) {
    struct tcase { const char *name; int H, I, L, gemm; };
    const tcase cases[] = {{"deepseek-v3", 7168, 2048, 8, 13}, {"deepseek-v3", 7168, 2048, 8, 2}, {"deepseek-v3", 7168, 2048, 32, 13},
                           {"deepseek-v3", 7168, 2048, 32, 2},  {"qwen3-235b", 4096, 1536, 8, 13}, {"qwen3-235b", 4096, 1536, 8, 2}};
    const size_t w_bytes = (size_t)32 * 4096 * 7168, a_rows = 64, k_max = 7168;
    uint8_t *w, *a, *out, *flush;
    float *ws, *as, *os;
    int32_t *counts, *offsets;
    uint64_t *stamps;
    g_case = "timeline allocation";
    CUDA_OK(cudaMalloc((void **)&w, w_bytes));
    CUDA_OK(cudaMalloc((void **)&ws, w_bytes / (128 * 128) * 4));
    CUDA_OK(cudaMalloc((void **)&a, a_rows * k_max));
    CUDA_OK(cudaMalloc((void **)&as, a_rows * (k_max / 128) * 4));
    CUDA_OK(cudaMalloc((void **)&out, a_rows * k_max * 2));
    CUDA_OK(cudaMalloc((void **)&os, a_rows * (k_max / 128) * 4));
    CUDA_OK(cudaMalloc((void **)&flush, kFlushBytes));
    CUDA_OK(cudaMalloc((void **)&counts, 64 * 4));
    CUDA_OK(cudaMalloc((void **)&offsets, 65 * 4));
    CUDA_OK(cudaMalloc((void **)&stamps, mf__decode::kTimelineStamps * 1024 * 8));
    init_data(1, w, w_bytes, ws, w_bytes / (128 * 128), 11, 0.02f);
    init_data(1, a, a_rows * k_max, as, a_rows * (k_max / 128), 13, 1.0f);
    cudaStream_t st;
    cudaEvent_t ev0, ev1;
    CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CUDA_OK(cudaEventCreate(&ev0));
    CUDA_OK(cudaEventCreate(&ev1));
    int sms = 0;
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    printf("\n# --timeline: FP8, one row per expert (T = 1 at R = 1), L2 flushed before each launch; per CTA, from its\n"
           "# %%globaltimer stamps: entry, prologue done (tables), last store. Times in us; 'launch' = event time -\n"
           "# (last store - first entry); work = last store - prologue; rate = the CTA's weight bytes / work\n");
    printf("%-12s %-4s %3s %5s %4s %-6s | %7s %7s %6s | %6s %8s | %6s %6s %6s | %6s | %5s %5s %5s\n", "# model", "gemm", "L",
           "tiles", "grid", "sched", "event", "span", "launch", "start", "prologue", "work", "min", "max", "end", "GB/s", "min", "max");
    int32_t *const sched = g_sched;
    for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]) * 2; i++) {
        const tcase &tc = cases[i / 2];
        const int dynamic = i % 2;
        g_sched = dynamic ? sched : NULL; /* the static walk, then the layer's (tickets where tiles > CTAs) */
        const int epi = tc.gemm == 13 ? kEpiSwiglu : kEpiPlain;
        const int N = tc.gemm == 13 ? 2 * tc.I : tc.H, K = tc.gemm == 13 ? tc.H : tc.I;
        std::vector<int32_t> hc((size_t)tc.L, 1), ho((size_t)tc.L + 1);
        for (int e = 0; e <= tc.L; e++) ho[(size_t)e] = e;
        CUDA_OK(cudaMemcpy(counts, hc.data(), (size_t)tc.L * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(offsets, ho.data(), ((size_t)tc.L + 1) * 4, cudaMemcpyHostToDevice));
        call_t c;
        memset(&c, 0, sizeof c);
        c.fp8 = 1, c.epi = epi, c.L = tc.L, c.N = N, c.K = K, c.a = a, c.a_scales = as, c.w = w, c.w_scales = ws;
        c.counts = counts, c.offsets = offsets, c.max_rows = 1, c.rows_hint = 1, c.out = out, c.out_scales = os;
        const int tiles = tc.L * (tc.gemm == 13 ? N / 256 : N / 128), grid = std::min(tiles, sms);
        const double tile_bytes = (double)(tc.gemm == 13 ? 256 : 128) * K;
        for (int run = 0; run < 6; run++) {
            const bool on = run >= 3; /* three warm-up launches without stamps, then three stamped */
            CUDA_OK(mf__sm90_decode_set_timeline(on ? stamps : NULL));
            CUDA_OK(cudaMemsetAsync(stamps, 0, mf__decode::kTimelineStamps * 1024 * 8, st));
            CUDA_OK(cudaMemsetAsync(flush, run, kFlushBytes, st));
            CUDA_OK(cudaEventRecord(ev0, st));
            if (!launched(run_call(c, st), "timeline")) break;
            CUDA_OK(cudaEventRecord(ev1, st));
            CUDA_OK(cudaEventSynchronize(ev1));
            if (!on) continue;
            float ms = 0;
            CUDA_OK(cudaEventElapsedTime(&ms, ev0, ev1));
            std::vector<uint64_t> s((size_t)grid * mf__decode::kTimelineStamps);
            CUDA_OK(cudaMemcpy(s.data(), stamps, s.size() * 8, cudaMemcpyDeviceToHost));
            uint64_t t0 = UINT64_MAX, tend = 0, tfirst_end = UINT64_MAX;
            for (int b = 0; b < grid; b++) {
                t0 = std::min(t0, s[mf__decode::kTimelineStamps * b]);
                tend = std::max(tend, s[mf__decode::kTimelineStamps * b + 2]);
                tfirst_end = std::min(tfirst_end, s[mf__decode::kTimelineStamps * b + 2]);
            }
            std::vector<double> start, pro, work, rate;
            for (int b = 0; b < grid; b++) {
                const uint64_t *x = &s[mf__decode::kTimelineStamps * b];
                const int mine = (tiles - b + grid - 1) / grid; /* the static walk's tiles */
                start.push_back((x[0] - t0) * 1e-3);
                pro.push_back((x[1] - x[0]) * 1e-3);
                work.push_back((x[2] - x[1]) * 1e-3);
                rate.push_back(mine * tile_bytes / ((x[2] - x[1]) * 1e-9) / 1e9);
            }
            const double span = (tend - t0) * 1e-3;
            printf("%-12s w%-3d %3d %5d %4d %-6s | %7.1f %7.1f %6.1f | %6.1f %8.1f | %6.1f %6.1f %6.1f | %6.1f | ", tc.name,
                   tc.gemm, tc.L, tiles, grid, dynamic ? "layer" : "static", ms * 1e3, span, ms * 1e3 - span, pct(start, 1.0),
                   pct(pro, 0.5), pct(work, 0.5), pct(work, 0.0), pct(work, 1.0), (tend - tfirst_end) * 1e-3);
            if (dynamic && tiles > grid) printf("%5s %5s %5s\n", "-", "-", "-"); /* tiles per CTA unknown */
            else printf("%5.0f %5.0f %5.0f\n", pct(rate, 0.5), pct(rate, 0.0), pct(rate, 1.0));
        }
    }
    g_sched = sched;
    CUDA_OK(mf__sm90_decode_set_timeline(NULL));
    printf("# columns: start = the last CTA's entry after the first's; prologue: median over CTAs; work: median, min, max\n"
           "# over CTAs; end = last CTA's last store - first CTA's last store; GB/s: median, min, max per CTA\n");
    cudaFree(w), cudaFree(ws), cudaFree(a), cudaFree(as), cudaFree(out), cudaFree(os), cudaFree(flush), cudaFree(counts);
    cudaFree(offsets), cudaFree(stamps);
    cudaStreamDestroy(st);
    cudaEventDestroy(ev0);
    cudaEventDestroy(ev1);
}

/* ================================================================================================
 * main
 * ============================================================================================== */

/* ================================================================================================
 * the small-batch kernel (kernels/sm90_small_gemm.cuh, mf__sm90_small_experts): W13 + W2 in one
 * launch against the two decode kernels it fuses (part of --validate), then both timed (--small)
 * ============================================================================================== */

static int32_t *g_small_sync = NULL; /* [2 + kMaxExperts] zeroed: the small kernel's ticket, count, counters */

/* Both GEMMs of one problem: W13 (p13: N = 2I, K = H; rows gathered through hp) then W2 (w2 [L, H, I]
 * of p2) with the rows returned through the same heaps; small = 0: the two decode kernels, 1: the
 * small kernel. h / h_scales are d13's outputs. */
static mf_result_t run_pair(int small, const problem &p13, const device_problem &d13, const device_problem &d2,
                            const heaps_t &hp, int topk, cudaStream_t stream) {
    mf__gemm_segments_t seg;
    seg.counts = d13.counts;
    seg.offsets = d13.offsets;
    seg.num_experts = p13.L;
    seg.max_rows_per_expert = p13.lo.max_rows;
    seg.rows_hint = 1;
    seg.sched = g_sched;
    seg.sink = g_sink;
    mf__gemm_choice_t choice = mf__gemm_choose(1, p13.lo.max_rows, MF_DATAFLOW_AUTO); /* 8-token tiles, fused */
    const int32_t dtype = p13.fp8 ? MF_DTYPE_FP8_E4M3 : MF_DTYPE_BF16;
    const int H = p13.K, I = p13.N / 2;
    const mf__gemm_gather_t g = {&hp.view, hp.src};
    const mf__gemm_return_t ret = {&hp.view, hp.src, topk};
    const mf__gemm_operand_t a = {NULL, NULL, &g}, w13 = {d13.w, d13.ws, NULL}, w2 = {d2.w, d2.ws, NULL};
    const mf__gemm_operand_t h = {d13.out, d13.out_scales, NULL};
    if (small)
        return mf__sm90_small_experts(&choice, &seg, dtype, p13.ue8m0, a, w13, w2, H, I, d13.out, d13.out_scales, &ret,
                                      g_small_sync, NULL, NULL, stream, 0);
    const mf_result_t r =
        mf__sm90_decode_w13_swiglu(&choice, &seg, dtype, p13.ue8m0, a, w13, H, I, d13.out, d13.out_scales, stream, 0);
    if (r != MF_SUCCESS) return r;
    return mf__sm90_decode_w2(&choice, &seg, dtype, h, w2, H, I, NULL, &ret, stream, 1);
}

/* Every heap's combine region and h / h_scales after one run of run_pair (the first mismatch printed
 * by compare_small). */
struct small_out {
    std::vector<uint8_t> h;
    std::vector<float> hs;
    std::vector<std::vector<uint8_t>> combine;
};

static small_out read_small(const device_problem &d13, const heaps_t &hp) {
    small_out o;
    o.h = to_host(d13.out, d13.out_bytes);
    o.hs = to_host(d13.out_scales, d13.out_scale_count);
    for (uint8_t *p : hp.dev) {
        std::vector<uint8_t> all = to_host(p, hp.bytes);
        o.combine.push_back(std::vector<uint8_t>(all.begin() + (long)hp.view.combine, all.end()));
    }
    return o;
}

static void poison_small(const device_problem &d13, const heaps_t &hp) {
    d13.poison();
    for (uint8_t *p : hp.dev) CUDA_OK(cudaMemset(p + hp.view.combine, kPoison, hp.bytes - hp.view.combine));
}

static bool compare_small(const char *name, const problem &p13, const small_out &want, const small_out &got, int topk,
                          int64_t H) {
    const int64_t I = p13.N / 2, h_row = I * p13.out_esz();
    int64_t bad = 0;
    for (size_t b = 0; b < want.h.size(); b++)
        if (want.h[b] != got.h[b] && bad++ < 3)
            printf("    %s: h row %lld (expert %d) column %lld: %02x, the two kernels %02x\n", name, (long long)(b / h_row),
                   p13.lo.owner[b / (size_t)h_row], (long long)(b % h_row / p13.out_esz()), got.h[b], want.h[b]);
    if (memcmp(want.hs.data(), got.hs.data(), want.hs.size() * 4) && bad++ < 3) printf("    %s: h scales differ\n", name);
    for (size_t q = 0; q < want.combine.size(); q++)
        for (size_t b = 0; b < want.combine[q].size(); b += 2)
            if ((want.combine[q][b] != got.combine[q][b] || want.combine[q][b + 1] != got.combine[q][b + 1]) && bad++ < 3) {
                const int64_t e = (int64_t)b / 2, slot = e / H;
                printf("    %s: rank %zu slot (token %lld, k %lld) column %lld differs\n", name, q, (long long)(slot / topk),
                       (long long)(slot % topk), (long long)(e % H));
            }
    return bad == 0;
}

/* One case: the two decode kernels, then the small kernel twice (the second a graph replay when
 * `graph`): h, h scales and every combine slot bit for bit, the sync words zero after. */
static void small_case(const char *what, int fp8, int H, int I, const std::vector<int> &counts, int C, int R, int topk,
                       int ue8m0, bool graph) {
    char name[192];
    snprintf(name, sizeof name, "small %s %s H=%d I=%d R=%d", fp8 ? "fp8" : "bf16", what, H, I, R);
    g_case = name;
    problem p13 = make_problem(fp8, kEpiSwiglu, 2 * I, H, counts, C, ue8m0);
    problem p2 = make_problem(fp8, kEpiPlain, H, I, counts, C, 0); /* its weights only */
    device_problem d13 = upload(p13), d2 = upload(p2);
    heaps_t hp = make_heaps(p13, R, topk, H);
    bool ok = launched(run_pair(0, p13, d13, d2, hp, topk, 0), name);
    if (ok) {
        CUDA_OK(cudaDeviceSynchronize());
        const small_out want = read_small(d13, hp);
        poison_small(d13, hp);
        ok = launched(run_pair(1, p13, d13, d2, hp, topk, 0), name);
        if (ok) {
            CUDA_OK(cudaDeviceSynchronize());
            const small_out got = read_small(d13, hp);
            const bool same = compare_small(name, p13, want, got, topk, H);
            printf("%s %-52s h, h scales, combine slots bitwise = the two decode kernels\n", same ? "PASS" : "FAIL", name);
            g_failures += same ? 0 : 1;
            poison_small(d13, hp);
            if (graph) {
                cudaStream_t st;
                cudaGraph_t gr;
                cudaGraphExec_t ge;
                CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
                CUDA_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                const mf_result_t r = run_pair(1, p13, d13, d2, hp, topk, st);
                CUDA_OK(cudaStreamEndCapture(st, &gr));
                if (launched(r, name)) {
                    CUDA_OK(cudaGraphInstantiate(&ge, gr, 0));
                    CUDA_OK(cudaGraphLaunch(ge, st));
                    CUDA_OK(cudaGraphLaunch(ge, st)); /* twice: the sync words were zeroed by the first */
                    CUDA_OK(cudaStreamSynchronize(st));
                    CUDA_OK(cudaGraphExecDestroy(ge));
                }
                CUDA_OK(cudaGraphDestroy(gr));
                CUDA_OK(cudaStreamDestroy(st));
            } else if (launched(run_pair(1, p13, d13, d2, hp, topk, 0), name)) {
                CUDA_OK(cudaDeviceSynchronize());
            }
            const bool again = compare_small(name, p13, want, read_small(d13, hp), topk, H);
            printf("%s %-52s %s bitwise equal\n", again ? "PASS" : "FAIL", name, graph ? "graph replays" : "second run");
            g_failures += again ? 0 : 1;
            int32_t words[2 + 64];
            const int n = 2 + std::min(p13.L, 64);
            CUDA_OK(cudaMemcpy(words, g_small_sync, (size_t)n * 4, cudaMemcpyDeviceToHost));
            bool zero = true;
            for (int i = 0; i < n; i++) zero = zero && words[i] == 0;
            printf("%s %-52s ticket, count and counters zero after\n", zero ? "PASS" : "FAIL", name);
            g_failures += zero ? 0 : 1;
        }
    }
    hp.release();
    d13.release();
    d2.release();
}

static void run_small_validate(void) {
    printf("# the small-batch kernel (mf__sm90_small_experts) against the two decode kernels it fuses\n");
    std::vector<int> sparse(64, 0);
    for (int e = 0; e < 64; e += 5) sparse[(size_t)e] = 1 + e % 7;
    for (int fp8 = 1; fp8 >= 0; fp8--) {
        small_case("{1,0,3,8} expert-major", fp8, 512, 384, {1, 0, 3, 8}, 0, 1, 4, 0, false);
        small_case("{2,13,0,5,1} masked C=16", fp8, 512, 384, {2, 13, 0, 5, 1}, 16, 3, 4, 0, true);
        small_case("{8,8,8,8} expert-major (rings wrap)", fp8, 1024, 2048, {8, 8, 8, 8}, 0, 2, 8, 0, false);
        small_case("L=64 sparse expert-major", fp8, 256, 256, sparse, 0, 4, 8, 0, false);
    }
    small_case("{3,9,1} ue8m0 masked C=12", 1, 512, 384, {3, 9, 1}, 12, 2, 4, 1, false);
    small_case("deepseek {1,1,1,1}", 1, 7168, 2048, {1, 1, 1, 1}, 0, 1, 8, 0, false);
}

/* --small: the small kernel against the two decode kernels (the second with PDL, as in the layer),
 * the layer's shapes at R = 1 and T = 1..8 tokens (uniform routing, K distinct experts per token),
 * weights read once per active expert; L2 flushed before every run. */
static void run_small_bench(void) {
    const struct {
        const char *name;
        int H, I, L, K;
    } models[] = {{"deepseek-v3", 7168, 2048, 256, 8}, {"kimi-k2", 7168, 2048, 384, 8}, {"qwen3-235b", 4096, 1536, 128, 8}};
    bench_ctx bc;
    CUDA_OK(cudaStreamCreateWithFlags(&bc.stream, cudaStreamNonBlocking));
    CUDA_OK(cudaEventCreate(&bc.ev0));
    CUDA_OK(cudaEventCreate(&bc.ev1));
    CUDA_OK(cudaMalloc((void **)&bc.flush, kFlushBytes));
    printf("# --small: FP8, R = 1; us = median of %d runs, L2 flushed; floor = active experts' weights / 4.24 TB/s\n",
           kTimedRuns);
    printf("%-12s %3s %4s %9s %9s %9s %7s\n", "model", "T", "rows", "floor", "2 kernels", "small", "change");
    for (const auto &m : models) {
        const int64_t w13_bytes = (int64_t)m.L * 2 * m.I * m.H, w2_bytes = (int64_t)m.L * m.H * m.I;
        device_problem d13, d2; /* weights, scales and h only; counts and offsets per T */
        CUDA_OK(cudaMalloc((void **)&d13.w, (size_t)w13_bytes));
        CUDA_OK(cudaMalloc((void **)&d2.w, (size_t)w2_bytes));
        CUDA_OK(cudaMalloc((void **)&d13.ws, (size_t)(w13_bytes / (128 * 128)) * 4));
        CUDA_OK(cudaMalloc((void **)&d2.ws, (size_t)(w2_bytes / (128 * 128)) * 4));
        init_data(1, d13.w, (size_t)w13_bytes, d13.ws, (size_t)(w13_bytes / (128 * 128)), 11, 1.0f);
        init_data(1, d2.w, (size_t)w2_bytes, d2.ws, (size_t)(w2_bytes / (128 * 128)), 12, 1.0f);
        for (int T : {1, 2, 4, 8}) {
            char name[96];
            snprintf(name, sizeof name, "small bench %s T=%d", m.name, T);
            g_case = name;
            std::vector<int> counts((size_t)m.L, 0);
            for (int t = 0; t < T; t++) {
                std::vector<int> pick;
                while ((int)pick.size() < m.K) {
                    const int e = (int)(rnd_u64() % (uint64_t)m.L);
                    if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
                }
                for (int e : pick) counts[(size_t)e]++;
            }
            /* a host problem of the shape (rows and the receive layout) without its weights */
            problem p13;
            p13.fp8 = 1, p13.epi = kEpiSwiglu, p13.L = m.L, p13.N = 2 * m.I, p13.K = m.H, p13.ue8m0 = 0;
            p13.lo = make_layout(counts, 0);
            p13.lo.max_rows = T;
            p13.a.assign((size_t)(p13.lo.rows * m.H), 0x38); /* 1.0 in E4M3 */
            p13.as.assign((size_t)(p13.lo.rows * (m.H / 128)), 0.01f);
            d13.counts = to_device(p13.lo.counts);
            d13.offsets = to_device(p13.lo.offsets);
            d13.out_bytes = (size_t)(p13.lo.rows * m.I);
            d13.out_scale_count = (size_t)(p13.lo.rows * (m.I / 128));
            CUDA_OK(cudaMalloc((void **)&d13.out, d13.out_bytes));
            CUDA_OK(cudaMalloc((void **)&d13.out_scales, d13.out_scale_count * 4));
            heaps_t hp = make_heaps(p13, 1, m.K, m.H);
            double us[2] = {0, 0};
            for (int small = 0; small < 2; small++) {
                mf_result_t r = MF_SUCCESS;
                us[small] = time_median(bc, [&] {
                    const mf_result_t x = run_pair(small, p13, d13, d2, hp, m.K, bc.stream);
                    if (x != MF_SUCCESS) r = x;
                });
                if (!launched(r, name)) us[small] = 0;
            }
            int active = 0;
            for (int c : counts) active += c > 0;
            const double floor_us = (double)active * 3 * m.I * m.H / 4.24e12 * 1e6;
            printf("%-12s %3d %4lld %9.1f %9.1f %9.1f %6.1f%%\n", m.name, T, (long long)p13.lo.rows, floor_us, us[0], us[1],
                   us[0] > 0 ? 100.0 * (us[1] / us[0] - 1) : 0.0);
            hp.release();
            cudaFree(d13.counts), cudaFree(d13.offsets), cudaFree(d13.out), cudaFree(d13.out_scales);
            d13.counts = d13.offsets = NULL, d13.out = NULL, d13.out_scales = NULL;
        }
        d13.release();
        d2.release();
    }
    g_case = NULL;
}

int main(int argc, char **argv) {
    bool selftest = false, validate = false, bench = false, peers = true, quick = false, timeline = false, small = false;
    g_on_fatal = report_fault;
    const char *json = NULL;
    std::string command;
    for (int i = 0; i < argc; i++) command += (i ? " " : "") + std::string(argv[i]);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--selftest")) selftest = true;
        else if (!strcmp(argv[i], "--validate")) validate = true;
        else if (!strcmp(argv[i], "--bench")) bench = true;
        else if (!strcmp(argv[i], "--no-peers")) peers = false;
        else if (!strcmp(argv[i], "--quick")) quick = true;
        else if (!strcmp(argv[i], "--timeline")) timeline = true;
        else if (!strcmp(argv[i], "--small")) small = true;
        else if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--selftest] [--validate] [--bench [--json FILE] [--no-peers] [--quick]] [--timeline] [--small]\n",
                    argv[0]);
            return 2;
        }
    }
    if (!selftest && !validate && !bench && !timeline && !small) selftest = validate = bench = true;
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    printf("# device: %s, sm_%d%d, %d SMs, %.0f MB L2, %zu KB smem/block opt-in\n", prop.name, prop.major, prop.minor,
           prop.multiProcessorCount, prop.l2CacheSize / 1e6, prop.sharedMemPerBlockOptin / 1024);
    if (prop.major != 9) {
        fprintf(stderr, "FATAL: needs an sm_90a GPU\n");
        return 2;
    }
    lab_sink();
    if (mf__sm90_decode_preload() != MF_SUCCESS) {
        fprintf(stderr, "FATAL: mf__sm90_decode_preload: %s\n", mf_last_error());
        return 3;
    }
    if (mf__sm90_small_preload() != MF_SUCCESS) {
        fprintf(stderr, "FATAL: mf__sm90_small_preload: %s\n", mf_last_error());
        return 3;
    }
    CUDA_OK(cudaMalloc((void **)&g_sched, 2 * sizeof(int32_t)));
    CUDA_OK(cudaMemset(g_sched, 0, 2 * sizeof(int32_t)));
    CUDA_OK(cudaMalloc((void **)&g_small_sync, (2 + mf__decode::kMaxExperts) * sizeof(int32_t)));
    CUDA_OK(cudaMemset(g_small_sync, 0, (2 + mf__decode::kMaxExperts) * sizeof(int32_t)));
    list_variants();
    if (selftest) run_selftest();
    if (validate) {
        run_validate();
        run_small_validate();
        int32_t pair[2] = {-1, -1};
        CUDA_OK(cudaMemcpy(pair, g_sched, sizeof pair, cudaMemcpyDeviceToHost));
        const bool zero = pair[0] == 0 && pair[1] == 0;
        printf("%s schedule pair zero after validate (ticket %d, finished %d)\n", zero ? "PASS" : "FAIL", pair[0], pair[1]);
        g_failures += zero ? 0 : 1;
    }
    if (bench) run_bench(json, peers, quick, command);
    if (timeline) run_timeline();
    if (small) run_small_bench();
    g_failures += lab_sink_failed(wait_site);
    printf("%s: %d failure%s\n", g_failures ? "FAIL" : "PASS", g_failures, g_failures == 1 ? "" : "s");
    return g_failures ? 1 : 0;
}
