/*
 * sm90_gemm_lab.cu — validate-then-bench main of the sm90 TMA grouped GEMM (the dispatcher's family
 * for more than kMfDecodeMaxRows rows per expert): the kernel is src/cuda/kernels/sm90_tma_gemm.cuh
 * (its design is described there), the launchers src/cuda/gemm_tma.cu. Every shipped GEMM here runs
 * through the library's launchers (mf__sm90_tma_w13_swiglu / mf__sm90_tma_w2, linked from
 * libmoeflow.a), so the lab validates and times exactly what ships; the A/B kernels and timing
 * probes are the lab's own fork of the kernel with its own launcher (sm90_tma_lab_kernel.cuh,
 * selected by the lab switch kMfTmaLab*), never in the library. The plain W13 GEMM (for measuring the SwiGLU
 * epilogue's cost) is mf__sm90_tma_w2 with W13's shapes: out[rows, 2I] = a[rows, H] . W13[e]^T.
 * Built by `make lab` into build/dev/sm90_gemm_lab; needs one sm_90a GPU.
 *
 *   sm90_gemm_lab --selftest    the shipped variants (registers, local memory), one 64 x 64 wgmma
 *                               tile from TMA-loaded smem vs the CPU, the hardware conversions
 *                               (cvt.rn.bf16x2 / cvt.rn.satfinite.e4m3x2) against numerics.h's
 *                               mf__bf16_from_float / mf__fp8_from_float over all 2^32 floats, and
 *                               three small cases of the shipped kernels (memchecked by test-gpu)
 *   sm90_gemm_lab --validate    small, awkward and DeepSeek-shaped cases vs the CPU reference below
 *   sm90_gemm_lab --bench [--json FILE]   DeepSeek-V3 W13 / W2 shapes, kernel time, L2 flushed
 *   sm90_gemm_lab --ab [--json FILE]    only the interleaved A/Bs (no bench table): epilogue overlap,
 *                                       staggered turns, tail tiles, probes, schedule (with --json:
 *                                       one row per A/B side B, side A as its peer, and ab_gain_pct)
 *   sm90_gemm_lab               selftest, validate, bench
 *
 * Dimension legend: L local experts, N weight rows per expert of a plain GEMM (its output columns),
 * I the h columns of a fused W13 (weight rows 2I: gate [0, I), up [I, 2I)), K the reduction dim,
 * M rows per expert, C masked capacity, R ranks and Kt top-k of the fake combine slots.
 *
 * Validation, one PASS/FAIL line per case (first mismatches printed with their coordinates):
 *   inputs      random, never zero; rows no expert owns hold NaN bytes and NaN scales; outputs (and
 *               combine slots) are poisoned with 0xFF bytes first
 *   reference   double sums per 128-wide K block, FP8: partial * fp32(a_scale * w_scale) (docs/DESIGN.md);
 *               then silu(g) * u in fp32 and the 1x128 requantisation of numerics.h
 *   diff        1 - 2 sum(x y) / sum(x^2 + y^2) < 1e-3 (FP8) / 1e-5 (BF16) over every checked value
 *   elements    BF16 out or h:  |x - y| <= |y| / 64 + 2e-3 rms(y)
 *               FP8 plain:      |x - y| <= |y| / 64 + 1e-2 rms(y)   (wgmma E4M3 accumulates with
 *                               reduced precision inside a K block: ~5e-4 relative per element)
 *               FP8 h:          dequantised x = q s against the reference's dequantised y:
 *                               |x - y| <= 0.13 |y| + amax(row block) / 256 (one E4M3 step where the
 *                               block scale moved), and each h scale s within 1e-2 relative of the
 *                               reference's (the FP8 GEMM's ~5e-4, amplified up to ~4x by silu' for
 *                               negative gates; a wrong row or block is off by far more; UE8M0: the
 *                               neighbouring power of two where the reference amax lies within 1e-2
 *                               of the boundary)
 *   untouched   every byte of rows no expert owns (and of slots no row returns to) still 0xFF;
 *               every owned row written
 *   repeat      a second launch writes the same bits; the dispatcher (mf__cuda_w13_swiglu /
 *               mf__cuda_w2 with rows_hint 128) writes the same bits too; a lab variant's case
 *               ("[unordered]", "[tail tiles]", ...) writes the bits of what ships (a
 *               "[tail tiles]" case: the full tiles' kernel, kMfTmaLabFullTiles, against the
 *               shipped one with its 64-row tail tiles, which the lab turns on for BF16 too:
 *               mf__cuda_tma_tails 2)
 *   ret         W2 into R fake owners' combine slots [S, Kt, N]: row -> (token Kt + k) N of its
 *               rank's slots; rows whose src entry is invalid are dropped
 *   declines    shapes the kernel does not take return MF_ERR_NOT_SUPPORTED
 *
 * Bench: W13 SwiGLU, W13 plain, W2 plain (+ W2 ret at two sizes), L in {4, 32}, M in {256, 1024,
 * 4096, 8192} rows per expert (L M <= 32768), EXPERT_MAJOR, random data generated on the device;
 * then an A/B of the FP8 kernels without the issue order (the lab switch, mf__tma_lab::set_switch,
 * sm90_tma_lab_kernel.cuh; validated above with "[unordered]" cases) and the SwiGLU epilogue's
 * cost against plain W13; then, interleaved over 3 rounds on the same data: the FP8 SwiGLU
 * epilogue overlap (ships against kMfTmaLabNoOverlap), the staggered turns of the FP8 consumers
 * (kMfTmaLabStagger against what ships, W13 swiglu and W2 plain), the 64-row tail tiles
 * (what ships against full tiles only, kMfTmaLabFullTiles, on uneven counts of mean 128 and 256
 * rows, and on equal counts: what the tails' code costs where there is no tail), and two timing probes, whose results are not the GEMM (so they are never validated):
 * the FP8 promotion's cost (no overlap against no overlap without the promotion,
 * kMfTmaLabNoPromote) and the BF16 epilogue's (ships against no epilogue, kMfTmaLabNoStore).
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
#include "cuda/gemm_family.cuh" /* mf__gemm_variant_info_t */
#include "cuda/grouped_gemm.h"
#include "cuda/kernels/sm90_ptx.cuh"
#include "cuda/kernels/sm90_tma_gemm.cuh"
#include "sm90_tma_lab_kernel.cuh" /* the lab's fork: A/B kernels and timing probes */
#include "common.h"               /* the labs' CUDA_OK, random data, device vectors */

static const int kScaleBlock = MF__QUANT_BLOCK; /* FP8 K block and h scale block */
static const int kBlockM = mf__tma::kBlockM;
static const int kRowBytes = 128;               /* K bytes of one 128B-swizzle row (selftest tile) */
static const int kWgmmaKBytes = 32;
static const int kKSteps = kRowBytes / kWgmmaKBytes;

/* ====================================================================================================
 * errors
 * ==================================================================================================== */

static const char *wait_site(long long tag) {
    return tag == mf__tma::kTagProducerEmpty   ? "producer: empty slot"
           : tag == mf__tma::kTagConsumerFull ? "consumer: full slot (TMA bytes or scale arrivals missing)"
                                              : "selftest";
}

static void report_fault(void) { lab_report_sink(wait_site); }

static const double kDiffMaxBf16 = 1e-5;
static const double kDiffMaxFp8 = 1e-3;
static const int kWarmupRuns = 3;
static const int kTimedRuns = 20;
static const size_t kFlushBytes = 512ull << 20;

/* ====================================================================================================
 * random data
 * ==================================================================================================== */

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

/* ====================================================================================================
 * one launcher call
 * ==================================================================================================== */

/* Everything a GEMM call needs, device pointers. plain: out[rows, n] = a[rows, k] . w[e][n, k]^T
 * (mf__sm90_tma_w2 with H = n, I = k); swiglu: h[rows, n] from w[e][2n, k] (mf__sm90_tma_w13_swiglu
 * with H = k, I = n). */
struct gemm_call {
    int fp8, swiglu, n, k, L, max_rows, ue8m0;
    const int32_t *counts, *offsets;
    const uint8_t *a, *w;
    const float *a_scales, *w_scales;
    uint8_t *out;
    float *out_scales;
    const mf__gemm_return_t *ret; /* plain only: rows to combine slots instead of out */
    const mf__gemm_gather_t *gather; /* swiglu only: must decline */
    int32_t *sched;                  /* the dynamic schedule's pair (zeroed), or NULL: the static walk */
};

/* Runs the launcher (dispatcher = 0) or the library's dispatcher with rows_hint 128 (which picks
 * this kernel family); returns its result. */
static mf_result_t run_call(const gemm_call &c, cudaStream_t st, int dispatcher = 0) {
    mf__gemm_segments_t seg;
    seg.counts = c.counts;
    seg.offsets = c.offsets;
    seg.num_experts = c.L;
    seg.max_rows_per_expert = c.max_rows;
    seg.rows_hint = 128;
    seg.sched = c.sched;
    seg.sink = g_sink;
    const mf__gemm_choice_t choice = mf__gemm_choose(seg.rows_hint, seg.max_rows_per_expert, MF_DATAFLOW_PULL);
    const int32_t dtype = c.fp8 ? MF_DTYPE_FP8_E4M3 : MF_DTYPE_BF16;
    mf__gemm_operand_t a = {c.a, c.a_scales, c.gather};
    mf__gemm_operand_t w = {c.w, c.w_scales, NULL};
    /* the lab switch selects a lab kernel: the dispatcher cannot run it, the lab's launcher does */
    if (mf__tma_lab::get_switch() != kMfTmaLabShipped) dispatcher = 0;
    if (c.swiglu)
        return dispatcher ? mf__cuda_w13_swiglu(&choice, &seg, dtype, c.ue8m0, a, w, c.k, c.n, c.out, c.out_scales, st, 0)
                          : tma_lab_w13_swiglu(&seg, dtype, c.ue8m0, a, w, c.k, c.n, c.out, c.out_scales, st);
    return dispatcher ? mf__cuda_w2(&choice, &seg, dtype, a, w, c.n, c.k, (uint16_t *)c.out, c.ret, st, 0)
                      : tma_lab_w2(&seg, dtype, a, w, c.n, c.k, (uint16_t *)c.out, c.ret, st);
}

/* A call that must launch: on any other result, the case fails loudly. */
static bool launched(mf_result_t r) {
    if (r == MF_SUCCESS) return true;
    printf("FAIL %-60s launcher returned %d: %s\n", g_case, (int)r,
           r == MF_ERR_NOT_SUPPORTED ? mf__gemm_last_decline(kMfGemmFamilyTma) : mf_last_error());
    g_failures++;
    return false;
}

/* ====================================================================================================
 * selftest
 * ==================================================================================================== */

static void list_variants(void) {
    mf__gemm_variant_info_t v[16];
    const int n = mf__sm90_tma_variants(v, 16);
    if (n < 0) {
        fprintf(stderr, "FATAL: mf__sm90_tma_variants failed: %s\n", mf_last_error());
        exit(2);
    }
    printf("# shipped variants (smem %d B, %d stages; must be usable: %d registers, no local memory)\n",
           n ? v[0].smem_bytes : 0, n ? v[0].stages : 0, mf__tma::kLaunchRegs);
    for (int i = 0; i < n; i++) {
        bool ok = v[i].usable && v[i].local_bytes == 0;
        if (!ok) g_failures++;
        printf("%s variant %2d %-4s %-6s regs %3d local %d B usable %d\n", ok ? "PASS" : "FAIL", i,
               v[i].fp8 ? "fp8" : "bf16", v[i].swiglu ? "swiglu" : "plain", v[i].num_regs, v[i].local_bytes, v[i].usable);
    }
    /* the lab's fork (sm90_tma_lab_kernel.cuh): the same register contract */
    for (int i = 0; i < mf__tma_lab::kNumVariants; i++) {
        const mf__tma_lab::variant_t &lv = mf__tma_lab::kVariants[i];
        cudaFuncAttributes fa;
        CUDA_OK(cudaFuncGetAttributes(&fa, lv.fn));
        const bool ok = fa.numRegs == mf__tma::kLaunchRegs && fa.localSizeBytes == 0;
        if (!ok) g_failures++;
        printf("%s lab     %2d %-4s %-6s %-20s regs %3d local %d B\n", ok ? "PASS" : "FAIL", i, lv.fp8 ? "fp8" : "bf16",
               lv.swiglu ? "swiglu" : "plain", lv.tag, fa.numRegs, (int)fa.localSizeBytes);
    }
}

/* a [64, K] and b [64, K] (K = 128 bytes: 128 e4m3 or 64 bf16), out fp32 [64, 64] row-major. */
struct selftest_params {
    CUtensorMap map_a, map_b;
    float *out;
    mf__fault_sink_t sink;
};

template <int kFp8>
__global__ void __launch_bounds__(kMfWarpgroupThreads, 1) selftest_kernel(const __grid_constant__ selftest_params p) {
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
    mf__mbar_wait_tag(&bar, 0, 9, p.sink);
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

static void selftest_tile(int fp8) {
    const int esize = fp8 ? 1 : 2, kel = kRowBytes / esize;
    g_case = fp8 ? "selftest fp8 64x64x128 tile" : "selftest bf16 64x64x64 tile";
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
    uint8_t *da = to_device(ha), *db = to_device(hb);
    float *dout = dev_alloc<float>(64 * 64);
    CUDA_OK(cudaMemset(dout, kPoison, 64 * 64 * 4));
    selftest_params p;
    memset(&p, 0, sizeof p);
    CUtensorMapDataType dt = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    CU_OK(mf__tma_encode_2d(&p.map_a, dt, da, kel, 64, kRowBytes, kel, 64, CU_TENSOR_MAP_SWIZZLE_128B));
    CU_OK(mf__tma_encode_2d(&p.map_b, dt, db, kel, 64, kRowBytes, kel, 64, CU_TENSOR_MAP_SWIZZLE_128B));
    p.out = dout;
    p.sink = g_sink;
    if (fp8) selftest_kernel<1><<<1, kMfWarpgroupThreads>>>(p);
    else selftest_kernel<0><<<1, kMfWarpgroupThreads>>>(p);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> got = to_host(dout, 64 * 64);
    int bad = 0, first = -1;
    double rms = 0;
    for (int i = 0; i < 64 * 64; i++) rms += (double)ref[i] * ref[i];
    rms = sqrt(rms / (64 * 64));
    for (int i = 0; i < 64 * 64; i++) {
        /* FP8 wgmma accumulates a K block with reduced precision (docs/DECISIONS.md): the error
         * scales with the partial sums, so the bound takes the tile's rms as well as |ref| */
        double tol = 2e-3 * (fabs(ref[i]) + rms + 1.0);
        if (!(fabs(got[i] - ref[i]) <= tol)) {
            if (first < 0) first = i;
            bad++;
        }
    }
    if (bad) {
        printf("FAIL %-60s %d of 4096 wrong; first at (row %d, col %d): expected %.6g, got %.6g\n", g_case, bad,
               first / 64, first % 64, ref[first], (double)got[first]);
        g_failures++;
    } else {
        printf("PASS %-60s 4096 of 4096 within 2e-3 (|ref| + rms)\n", g_case);
    }
    CUDA_OK(cudaFree(da));
    CUDA_OK(cudaFree(db));
    CUDA_OK(cudaFree(dout));
}

/* Every float bit pattern u (NaNs skipped): the hardware pair conversions of (x, -x) against the
 * software definitions. bad[0..1]: mismatches (BF16, E4M3); first[0..1]: the smallest mismatching u. */
__global__ void conversions_kernel(unsigned long long *bad, unsigned int *first) {
    const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < (1ull << 32); i += step) {
        const uint32_t u = (uint32_t)i;
        const float x = __uint_as_float(u);
        if (x != x) continue;
        const uint32_t b = mf__cvt_bf16x2(x, -x);
        const uint32_t be = (uint32_t)mf__bf16_from_float(x) | ((uint32_t)mf__bf16_from_float(-x) << 16);
        const uint32_t f = mf__cvt_e4m3x2(x, -x);
        const uint32_t fe = (uint32_t)mf__fp8_from_float(x) | ((uint32_t)mf__fp8_from_float(-x) << 8);
        if (b != be) {
            atomicAdd(&bad[0], 1ull);
            atomicMin(&first[0], u);
        }
        if (f != fe) {
            atomicAdd(&bad[1], 1ull);
            atomicMin(&first[1], u);
        }
    }
}

__global__ void conversion_one_kernel(uint32_t u, uint32_t *out) {
    const float x = __uint_as_float(u);
    out[0] = mf__cvt_bf16x2(x, -x);
    out[1] = (uint32_t)mf__bf16_from_float(x) | ((uint32_t)mf__bf16_from_float(-x) << 16);
    out[2] = mf__cvt_e4m3x2(x, -x);
    out[3] = (uint32_t)mf__fp8_from_float(x) | ((uint32_t)mf__fp8_from_float(-x) << 8);
}

static void selftest_conversions(void) {
    g_case = "selftest conversions (all 2^32 floats)";
    unsigned long long *d_bad = dev_alloc<unsigned long long>(2);
    unsigned int *d_first = dev_alloc<unsigned int>(2);
    uint32_t *d_one = dev_alloc<uint32_t>(4);
    CUDA_OK(cudaMemset(d_bad, 0, 2 * sizeof(unsigned long long)));
    CUDA_OK(cudaMemset(d_first, 0xFF, 2 * sizeof(unsigned int)));
    int sms = 0, dev = 0;
    CUDA_OK(cudaGetDevice(&dev));
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    conversions_kernel<<<sms * 8, 256>>>(d_bad, d_first);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<unsigned long long> bad = to_host(d_bad, 2);
    std::vector<unsigned int> first = to_host(d_first, 2);
    const char *names[2] = {"cvt.rn.bf16x2.f32 == mf__bf16_from_float", "cvt.rn.satfinite.e4m3x2.f32 == mf__fp8_from_float"};
    for (int i = 0; i < 2; i++) {
        if (bad[i] == 0) {
            printf("PASS selftest %-54s every non-NaN float (x, -x pairs)\n", names[i]);
            continue;
        }
        g_failures++;
        conversion_one_kernel<<<1, 1>>>(first[i], d_one);
        CUDA_OK(cudaGetLastError());
        std::vector<uint32_t> one = to_host(d_one, 4);
        float x;
        memcpy(&x, &first[i], 4);
        printf("FAIL selftest %-54s %llu mismatches; first at bits 0x%08x (%.9g): hardware 0x%x, numerics.h 0x%x\n",
               names[i], bad[i], first[i], (double)x, one[2 * i], one[2 * i + 1]);
    }
    CUDA_OK(cudaFree(d_bad));
    CUDA_OK(cudaFree(d_first));
    CUDA_OK(cudaFree(d_one));
}


/* Every float bit pattern x: the device's call-free numerics.h functions (mf__div) against the
 * same formulas with IEEE division (div.rn.f32, its called slow path included): mf__silu(x) and
 * mf__fp8_block_scale(x, ue8m0) for both scale formats, bit for bit (a NaN matches any NaN).
 * bad[0..2] / first[0..2]: silu, block scale, UE8M0 block scale. */
__device__ bool same_bits(float a, float b) { return (a != a && b != b) || __float_as_uint(a) == __float_as_uint(b); }

__device__ void ieee_block_scale(float amax, int ue8m0, float *scale, float *inv_scale) {
    if (!(amax >= MF__FP8_AMAX_MIN)) amax = amax != amax ? amax : MF__FP8_AMAX_MIN;
    if (ue8m0) {
        uint32_t s = __float_as_uint(amax / MF__FP8_MAX);
        if (s & 0x7fffffu) s = (s & 0xff800000u) + 0x800000u;
        *scale = __uint_as_float(s);
        *inv_scale = 1.0f / *scale;
    } else {
        *scale = amax / MF__FP8_MAX;
        *inv_scale = MF__FP8_MAX / amax;
    }
}

__global__ void division_kernel(unsigned long long *bad, unsigned int *first) {
    const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < (1ull << 32); i += step) {
        const uint32_t u = (uint32_t)i;
        const float x = __uint_as_float(u);
        bool wrong[3];
        wrong[0] = !same_bits(mf__silu(x), x / (1.0f + expf(-x)));
        for (int ue = 0; ue < 2; ue++) {
            float s, v, rs, rv;
            mf__fp8_block_scale(x, ue, &s, &v);
            ieee_block_scale(x, ue, &rs, &rv);
            wrong[1 + ue] = !same_bits(s, rs) || !same_bits(v, rv);
        }
        for (int k = 0; k < 3; k++)
            if (wrong[k]) {
                atomicAdd(&bad[k], 1ull);
                atomicMin(&first[k], u);
            }
    }
}

static void selftest_division(void) {
    g_case = "selftest call-free division (all 2^32 floats)";
    unsigned long long *d_bad = dev_alloc<unsigned long long>(3);
    unsigned int *d_first = dev_alloc<unsigned int>(3);
    CUDA_OK(cudaMemset(d_bad, 0, 3 * sizeof(unsigned long long)));
    CUDA_OK(cudaMemset(d_first, 0xFF, 3 * sizeof(unsigned int)));
    int sms = 0, dev = 0;
    CUDA_OK(cudaGetDevice(&dev));
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    division_kernel<<<sms * 8, 256>>>(d_bad, d_first);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<unsigned long long> bad = to_host(d_bad, 3);
    std::vector<unsigned int> first = to_host(d_first, 3);
    const char *names[3] = {"mf__silu == g / (1 + expf(-g))", "mf__fp8_block_scale == IEEE (E4M3 scales)",
                            "mf__fp8_block_scale == IEEE (UE8M0 scales)"};
    for (int i = 0; i < 3; i++) {
        if (bad[i] == 0) {
            printf("PASS selftest %-54s every float, bit for bit\n", names[i]);
            continue;
        }
        g_failures++;
        float x;
        memcpy(&x, &first[i], 4);
        printf("FAIL selftest %-54s %llu mismatches; first at bits 0x%08x (%.9g)\n", names[i], bad[i], first[i],
               (double)x);
    }
    CUDA_OK(cudaFree(d_bad));
    CUDA_OK(cudaFree(d_first));
}

/* ====================================================================================================
 * validation
 * ==================================================================================================== */

struct vcase {
    const char *name;
    int fp8, swiglu;
    int n, k;                 /* plain: N; swiglu: I */
    std::vector<int> counts;
    int capacity;             /* 0: EXPERT_MAJOR (128-aligned segments), else MASKED with C = capacity */
    int ue8m0;
    int ret;                  /* plain: rows to R fake owners' combine slots */
    int unordered;            /* FP8 lab-only GEMM kernels (A/B): kMfTmaLabUnordered, kMfTmaLabNoOverlap,
                                 kMfTmaLabStagger, kMfTmaLabFullTiles (then what ships has its
                                 tail tiles); 0 ships */
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

static const int kRetRanks = 3, kRetTopk = 2;

static bool same_bits(const std::vector<float> &x, const std::vector<float> &y) {
    return x.size() == y.size() && (x.empty() || memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0);
}

static void run_case(const vcase &c) {
    g_case = c.name;
    const int L = (int)c.counts.size(), K = c.k, nw = c.swiglu ? 2 * c.n : c.n;
    const int esize = c.fp8 ? 1 : 2, kb_n = c.fp8 ? K / kScaleBlock : 0;
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
    std::vector<float> as((size_t)rows * kb_n), ws((size_t)L * (nw / kScaleBlock) * kb_n);
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

    /* CPU reference: per row, per weight row, per 128-wide K block (FP8: partial * fp32(sa * sw),
     * double sums), then the epilogue */
    const int out_cols = c.n, out_esize = (c.swiglu && c.fp8) ? 1 : 2, sblocks = c.n / kScaleBlock;
    std::vector<float> f8(256);
    for (int i = 0; i < 256; i++) f8[i] = mf__fp8_to_float((uint8_t)i);
    std::vector<double> ref((size_t)rows * out_cols, 0.0), amax_ref((size_t)rows * sblocks, 0.0);
    std::vector<float> sc_ref((size_t)rows * sblocks, 0.0f);
    parallel_for((int)rows, [&](int r) {
        int e = owner[(size_t)r];
        if (e < 0) return;
        std::vector<double> accv(nw), arow(K);
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
            if (c.fp8) {
                for (int b = 0; b < kb_n; b++) {
                    double part = 0;
                    const uint8_t *wp = &w[wr * K];
                    for (int k = b * kScaleBlock; k < (b + 1) * kScaleBlock; k++) part += arow[k] * f8[wp[k]];
                    float s = as[(size_t)r * kb_n + b] * ws[((size_t)e * (nw / kScaleBlock) + n / kScaleBlock) * kb_n + b];
                    acc += part * (double)s;
                }
            } else {
                for (int k = 0; k < K; k++) {
                    uint16_t v;
                    memcpy(&v, &w[(wr * K + k) * 2], 2);
                    acc += arow[k] * mf__bf16_to_float(v);
                }
            }
            accv[n] = acc;
        }
        if (!c.swiglu) {
            for (int n = 0; n < c.n; n++) ref[(size_t)r * out_cols + n] = accv[n];
            return;
        }
        std::vector<float> h(c.n);
        for (int n = 0; n < c.n; n++) h[n] = mf__silu((float)accv[n]) * (float)accv[c.n + n];
        if (!c.fp8) {
            for (int n = 0; n < c.n; n++) ref[(size_t)r * out_cols + n] = h[n];
            return;
        }
        for (int b = 0; b < sblocks; b++) {
            float amax = 0, sc, inv;
            for (int n = b * kScaleBlock; n < (b + 1) * kScaleBlock; n++) amax = fmaxf(amax, fabsf(h[n]));
            mf__fp8_block_scale(amax, c.ue8m0, &sc, &inv);
            amax_ref[(size_t)r * sblocks + b] = amax;
            sc_ref[(size_t)r * sblocks + b] = sc;
            for (int n = b * kScaleBlock; n < (b + 1) * kScaleBlock; n++)
                ref[(size_t)r * out_cols + n] = (double)mf__fp8_to_float(mf__fp8_from_float(h[n] * inv)) * sc;
        }
    });
    double ref_ss = 0;
    long ref_n = 0;
    for (int64_t r = 0; r < rows; r++)
        if (owner[(size_t)r] >= 0)
            for (int n = 0; n < out_cols; n++, ref_n++) ref_ss += ref[(size_t)r * out_cols + n] * ref[(size_t)r * out_cols + n];
    const double ref_rms = ref_n ? sqrt(ref_ss / (double)ref_n) : 0.0;
    const double atol = (c.fp8 ? 1e-2 : 2e-3) * ref_rms;

    /* combine slots (ret): R ranks x [S, Kt, N]; live row i gets a unique (rank, token, k), every
     * 11th an invalid entry (dropped); rows no expert owns point at a trap slot that must stay poisoned */
    const int64_t live_rows = std::count_if(owner.begin(), owner.end(), [](int o) { return o >= 0; });
    const int64_t S = live_rows / (kRetRanks * kRetTopk) + 2, slot_rows = S * kRetTopk;
    std::vector<int32_t> src((size_t)rows * 3, 0);
    std::vector<int64_t> slot_of((size_t)rows, -1); /* rank * slot_rows + token * Kt + k */
    if (c.ret) {
        std::vector<int64_t> free_slots;
        for (int64_t s = 0; s + 1 < kRetRanks * slot_rows; s++) free_slots.push_back(s); /* the last one: trap */
        for (size_t i = free_slots.size(); i > 1; i--) std::swap(free_slots[i - 1], free_slots[rnd_u64() % i]);
        size_t next = 0;
        int64_t nlive = 0;
        for (int64_t r = 0; r < rows; r++) {
            int64_t s = kRetRanks * slot_rows - 1; /* trap */
            if (owner[(size_t)r] >= 0) {
                if (nlive++ % 11 == 5) {
                    src[(size_t)r * 3 + 0] = -1;
                    continue;
                }
                s = free_slots[next++];
                slot_of[(size_t)r] = s;
            }
            src[(size_t)r * 3 + 0] = (int32_t)(s / slot_rows);
            src[(size_t)r * 3 + 1] = (int32_t)((s % slot_rows) / kRetTopk);
            src[(size_t)r * 3 + 2] = (int32_t)(s % kRetTopk);
        }
    }

    /* device */
    uint8_t *d_a = to_device(a), *d_w = to_device(w);
    float *d_as = to_device(as), *d_ws = to_device(ws);
    int32_t *d_cnt = to_device(std::vector<int32_t>(c.counts.begin(), c.counts.end())), *d_off = to_device(offsets);
    const size_t out_bytes = c.ret ? (size_t)kRetRanks * slot_rows * c.n * 2 : (size_t)rows * out_cols * out_esize;
    const size_t sc_n = c.swiglu && c.fp8 ? (size_t)rows * sblocks : 0;
    uint8_t *d_out = dev_alloc<uint8_t>(out_bytes);
    float *d_osc = dev_alloc<float>(sc_n);
    int32_t *d_src = to_device(src);
    mf__heap_view_t owners; /* rank r's combine slots at heap[r] (combine offset 0) */
    memset(&owners, 0, sizeof owners);
    for (int r = 0; r < kRetRanks; r++) owners.heap[r] = d_out + (size_t)r * slot_rows * c.n * 2;
    mf__gemm_return_t ret;
    memset(&ret, 0, sizeof ret);
    ret.view = &owners;
    ret.src = d_src;
    ret.num_topk = kRetTopk;

    gemm_call g;
    memset(&g, 0, sizeof g);
    g.fp8 = c.fp8;
    g.swiglu = c.swiglu;
    g.n = c.n;
    g.k = K;
    g.L = L;
    g.max_rows = max_rows;
    g.ue8m0 = c.ue8m0;
    g.counts = d_cnt;
    g.offsets = d_off;
    g.a = d_a;
    g.w = d_w;
    g.a_scales = c.fp8 ? d_as : NULL;
    g.w_scales = c.fp8 ? d_ws : NULL;
    g.out = c.ret ? NULL : d_out;
    g.out_scales = sc_n ? d_osc : NULL;
    g.ret = c.ret ? &ret : NULL;

    /* three runs: the launcher with the static walk, again with the dynamic schedule (bitwise the
     * same: a tile's arithmetic does not depend on which CTA runs it), the dispatcher (dynamic,
     * bitwise the same; for a lab case the library's kernel: every lab variant computes each element
     * with the shipped kernel's instructions in the same order, so it must write the same bits);
     * after each dynamic run the schedule pair must be zero again */
    std::vector<uint8_t> out[3];
    std::vector<float> osc[3];
    int32_t *d_sched = dev_alloc<int32_t>(2);
    CUDA_OK(cudaMemset(d_sched, 0, 8));
    bool sched_ok = true;
    for (int run = 0; run < 3; run++) {
        mf__tma_lab::set_switch(run < 2 ? c.unordered : kMfTmaLabShipped);
        CUDA_OK(cudaMemset(d_out, kPoison, out_bytes));
        if (sc_n) CUDA_OK(cudaMemset(d_osc, kPoison, sc_n * 4));
        g.sched = run == 0 ? NULL : d_sched;
        if (!launched(run_call(g, 0, run == 2))) {
            mf__tma_lab::set_switch(kMfTmaLabShipped);
            CUDA_OK(cudaFree(d_sched));
            return;
        }
        CUDA_OK(cudaDeviceSynchronize());
        out[run] = to_host(d_out, out_bytes);
        osc[run] = to_host(d_osc, sc_n);
        const std::vector<int32_t> pair = to_host(d_sched, 2);
        sched_ok = sched_ok && pair[0] == 0 && pair[1] == 0;
    }
    CUDA_OK(cudaFree(d_sched));
    mf__tma_lab::set_switch(kMfTmaLabShipped);
    /* bitwise: the scales of rows no expert owns keep the NaN poison, and NaN != NaN as floats (a
     * float == here reported the FP8 SwiGLU variant as non-repeatable on 2026-12-02) */
    const bool repeat_ok = out[0] == out[1] && same_bits(osc[0], osc[1]) && sched_ok;
    const bool dispatch_ok = out[0] == out[2] && same_bits(osc[0], osc[2]);

    /* compare */
    double sxy = 0, sxx = 0, syy = 0, max_abs = 0;
    long wrong = 0, nan_count = 0, unwritten = 0, overwritten = 0, checked = 0, scale_bad = 0;
    int printed = 0;
    const std::vector<uint8_t> &o = out[0];
    std::vector<char> slot_used(c.ret ? (size_t)kRetRanks * slot_rows : 0, 0);
    for (int64_t r = 0; r < rows; r++) {
        const bool live = owner[(size_t)r] >= 0;
        const uint8_t *row = NULL; /* where the kernel should have written this row (NULL: nowhere) */
        if (c.ret) {
            if (live && slot_of[(size_t)r] >= 0) {
                slot_used[(size_t)slot_of[(size_t)r]] = 1;
                row = &o[(size_t)slot_of[(size_t)r] * c.n * 2];
            }
        } else {
            row = &o[(size_t)r * out_cols * out_esize];
            if (!live) {
                for (int i = 0; i < out_cols * out_esize; i++) overwritten += row[i] != kPoison;
                continue;
            }
        }
        if (!row) continue;
        for (int n = 0; n < out_cols; n++) {
            const size_t i = (size_t)r * out_cols + n;
            const bool poison = out_esize == 1 ? row[n] == kPoison : (row[2 * n] == kPoison && row[2 * n + 1] == kPoison);
            double x;
            if (out_esize == 1) {
                x = (double)mf__fp8_to_float(row[n]) * osc[0][(size_t)r * sblocks + n / kScaleBlock];
            } else {
                uint16_t v;
                memcpy(&v, &row[2 * n], 2);
                x = mf__bf16_to_float(v);
            }
            if (poison) unwritten++;
            if (x != x) {
                nan_count++;
                continue;
            }
            const double y = ref[i];
            sxy += x * y;
            sxx += x * x;
            syy += y * y;
            const double err = fabs(x - y);
            max_abs = std::max(max_abs, err);
            const double tol = out_esize == 1 ? 0.13 * fabs(y) + amax_ref[(size_t)r * sblocks + n / kScaleBlock] / 256
                                              : fabs(y) / 64 + atol;
            checked++;
            if (err > tol) {
                wrong++;
                if (printed++ < 4)
                    printf("     mismatch row %lld (expert %d, its row %lld) col %d: ref %.6g got %.6g\n", (long long)r,
                           owner[(size_t)r], (long long)(r - offsets[owner[(size_t)r]]), n, y, x);
            }
        }
    }
    if (c.ret) /* slot rows no live row returns to (the trap, invalid entries' would-be slots) */
        for (size_t s = 0; s < slot_used.size(); s++)
            if (!slot_used[s])
                for (int i = 0; i < c.n * 2; i++) overwritten += o[s * c.n * 2 + i] != kPoison;
    /* FP8 h scales: relative to the reference's, untouched for rows no expert owns */
    for (size_t i = 0; i < sc_n; i++) {
        const int64_t r = (int64_t)(i / sblocks);
        uint32_t bits;
        memcpy(&bits, &osc[0][i], 4);
        if (owner[(size_t)r] < 0) {
            scale_bad += bits != 0xFFFFFFFFu;
            continue;
        }
        const double s = osc[0][i], sr = sc_ref[i];
        bool ok = fabs(s - sr) <= 1e-2 * sr;
        if (!ok && c.ue8m0) {
            const double lo = std::min(s, sr), edge = lo * MF__FP8_MAX; /* the power-of-two boundary in amax */
            ok = (s == 2 * sr || sr == 2 * s) && fabs(amax_ref[i] - edge) <= 1e-2 * edge;
        }
        if (!ok) {
            scale_bad++;
            if (printed++ < 4)
                printf("     h scale row %lld block %d: ref %.6g got %.6g\n", (long long)r, (int)(i % sblocks), sr, s);
        }
    }
    const double diff = (sxx + syy) > 0 ? 1.0 - 2.0 * sxy / (sxx + syy) : 0.0;
    const double thr = c.fp8 ? kDiffMaxFp8 : kDiffMaxBf16;
    const bool ok = diff < thr && wrong == 0 && nan_count == 0 && unwritten == 0 && overwritten == 0 && scale_bad == 0 &&
                    repeat_ok && dispatch_ok && (checked > 0 || live_rows == 0);
    if (!ok) g_failures++;
    printf("%s %-60s rows %6lld diff %.2e max_abs %.3e wrong %ld nan %ld unwritten %ld overwritten %ld scales %ld %s %s\n",
           ok ? "PASS" : "FAIL", c.name, (long long)live_rows, diff, max_abs, wrong, nan_count, unwritten, overwritten,
           scale_bad, repeat_ok ? "static-dynamic-identical" : "STATIC-DYNAMIC-DIFFER",
           c.unordered ? (dispatch_ok ? "ships-identical" : "DIFFERS-FROM-SHIPS")
                       : (dispatch_ok ? "dispatcher-identical" : "DISPATCHER-DIFFERS"));
    fflush(stdout);
    CUDA_OK(cudaFree(d_a));
    CUDA_OK(cudaFree(d_w));
    CUDA_OK(cudaFree(d_as));
    CUDA_OK(cudaFree(d_ws));
    CUDA_OK(cudaFree(d_cnt));
    CUDA_OK(cudaFree(d_off));
    CUDA_OK(cudaFree(d_out));
    CUDA_OK(cudaFree(d_osc));
    CUDA_OK(cudaFree(d_src));
}

/* The selftest ends with the shipped kernels on three small cases (so that `make test-gpu`, which
 * memchecks --selftest, covers them): FP8 W13 SwiGLU, BF16 W13 SwiGLU (MASKED), FP8 W2 into
 * combine slots. */
static void run_selftest(void) {
    list_variants();
    selftest_tile(1);
    selftest_tile(0);
    selftest_conversions();
    selftest_division();
    run_case({"selftest fp8 expert_major W13 swiglu I=256 K=384", 1, 1, 256, 384, {130, 0, 257}, 0, 0, 0, 0});
    run_case({"selftest bf16 masked W13 swiglu I=128 K=256", 0, 1, 128, 256, {1, 200}, 256, 0, 0, 0});
    run_case({"selftest fp8 expert_major W2 ret N=256 K=256", 1, 0, 256, 256, {77, 130}, 0, 0, 1, 0});
}

/* Shapes the kernel does not take: MF_ERR_NOT_SUPPORTED, nothing written. */
static void run_declines(void) {
    struct decline_case {
        const char *name;
        int fp8, swiglu, n, k, L, gather;
    };
    const decline_case cases[] = {
        {"decline W2 H=384 (not a multiple of 256)", 1, 0, 384, 256, 2, 0},
        {"decline W13 I=192 (not a multiple of 128)", 0, 1, 192, 256, 2, 0},
        {"decline W13 with a.gather", 1, 1, 256, 256, 2, 1},
        {"decline FP8 K=192 (not a multiple of 128)", 1, 0, 256, 192, 2, 0},
        {"decline BF16 K=4 (rows not 16-byte multiples)", 0, 0, 256, 4, 2, 0},
        {"decline L=kMaxExperts+1", 0, 0, 256, 64, mf__tma::kMaxExperts + 1, 0},
    };
    const size_t bytes = 1 << 20;
    uint8_t *buf = dev_alloc<uint8_t>(bytes);
    int32_t *cnt = dev_alloc<int32_t>(mf__tma::kMaxExperts + 2);
    CUDA_OK(cudaMemset(cnt, 0, (mf__tma::kMaxExperts + 2) * 4));
    CUDA_OK(cudaMemset(buf, kPoison, bytes));
    mf__heap_view_t owners;
    memset(&owners, 0, sizeof owners);
    mf__gemm_gather_t gather;
    memset(&gather, 0, sizeof gather);
    gather.view = &owners;
    gather.src = cnt;
    for (const decline_case &d : cases) {
        g_case = d.name;
        gemm_call g;
        memset(&g, 0, sizeof g);
        g.fp8 = d.fp8;
        g.swiglu = d.swiglu;
        g.n = d.n;
        g.k = d.k;
        g.L = d.L;
        g.max_rows = 128;
        g.counts = cnt;
        g.offsets = cnt;
        g.a = buf;
        g.w = buf;
        g.a_scales = (const float *)buf;
        g.w_scales = (const float *)buf;
        g.out = buf;
        g.out_scales = (float *)buf;
        g.gather = d.gather ? &gather : NULL;
        const mf_result_t r = run_call(g, 0);
        CUDA_OK(cudaDeviceSynchronize());
        const bool ok = r == MF_ERR_NOT_SUPPORTED;
        if (!ok) g_failures++;
        printf("%s %-60s returned %d (%s)\n", ok ? "PASS" : "FAIL", d.name, (int)r,
               mf__gemm_last_decline(kMfGemmFamilyTma));
    }
    /* no rows at all: success, nothing written */
    {
        g_case = "empty: every count 0";
        gemm_call g;
        memset(&g, 0, sizeof g);
        g.fp8 = 1;
        g.n = 256;
        g.k = 256;
        g.L = 4;
        g.max_rows = 256;
        g.counts = cnt;
        g.offsets = cnt;
        g.a = buf;
        g.w = buf;
        g.a_scales = (const float *)buf;
        g.w_scales = (const float *)buf;
        g.out = buf + bytes / 2;
        const mf_result_t r = run_call(g, 0);
        CUDA_OK(cudaDeviceSynchronize());
        std::vector<uint8_t> h = to_host(buf + bytes / 2, bytes / 2);
        long touched = 0;
        for (uint8_t x : h) touched += x != kPoison;
        const bool ok = r == MF_SUCCESS && touched == 0;
        if (!ok) g_failures++;
        printf("%s %-60s returned %d, %ld bytes written\n", ok ? "PASS" : "FAIL", g_case, (int)r, touched);
    }
    CUDA_OK(cudaFree(buf));
    CUDA_OK(cudaFree(cnt));
}

static void run_validate(void) {
    std::vector<vcase> cases;
    char buf[160];
    for (int fp8 = 1; fp8 >= 0; fp8--) {
        const char *dn = fp8 ? "fp8" : "bf16";
        for (int masked = 0; masked < 2; masked++) {
            const int cap = masked ? 320 : 0;
            const char *ln = masked ? "masked" : "expert_major";
            snprintf(buf, sizeof buf, "%s %s W13 swiglu I=256 K=384", dn, ln);
            cases.push_back({strdup(buf), fp8, 1, 256, 384, {130, 0, 257}, cap, 0, 0});
            /* expert 0 with 1 row: its m-block starts at row -127 (TMA zero fill below row 0) */
            snprintf(buf, sizeof buf, "%s %s W13 swiglu%s I=384 K=512 counts 1,64,300,129", dn, ln, fp8 ? " ue8m0" : "");
            cases.push_back({strdup(buf), fp8, 1, 384, 512, {1, 64, 300, 129}, cap, fp8, 0});
            snprintf(buf, sizeof buf, "%s %s W2 plain N=512 K=384", dn, ln);
            cases.push_back({strdup(buf), fp8, 0, 512, 384, {130, 0, 257}, cap, 0, 0});
            snprintf(buf, sizeof buf, "%s %s W2 ret N=512 K=384", dn, ln);
            cases.push_back({strdup(buf), fp8, 0, 512, 384, {130, 0, 257}, cap, 0, 1});
        }
        if (!fp8) { /* K tails inside a 64-element BF16 stage: TMA zero fill along K */
            cases.push_back({"bf16 expert_major W13 swiglu I=128 K=200", 0, 1, 128, 200, {77, 129}, 0, 0, 0});
            cases.push_back({"bf16 masked W2 plain N=256 K=136", 0, 0, 256, 136, {77, 200}, 256, 0, 0});
        }
        /* many experts, empty experts mixed in (56-112 tiles: one per CTA on 132 SMs; the [tail tiles]
         * cases below walk several per CTA) */
        std::vector<int> cnt;
        for (int e = 0; e < 40; e++) cnt.push_back(e % 5 == 3 ? 0 : (int)(1 + (rnd_u64() % 300)));
        snprintf(buf, sizeof buf, "%s expert_major W2 plain L=40 N=256 K=256", dn);
        cases.push_back({strdup(buf), fp8, 0, 256, 256, cnt, 0, 0, 0});
        snprintf(buf, sizeof buf, "%s masked W13 swiglu L=40 I=128 K=256", dn);
        cases.push_back({strdup(buf), fp8, 1, 128, 256, cnt, 300, 0, 0});
        /* DeepSeek-V3 shapes with small counts */
        snprintf(buf, sizeof buf, "%s expert_major W13 swiglu I=2048 H=7168", dn);
        cases.push_back({strdup(buf), fp8, 1, 2048, 7168, {3, 130}, 0, 0, 0});
        snprintf(buf, sizeof buf, "%s masked W2 plain H=7168 I=2048", dn);
        cases.push_back({strdup(buf), fp8, 0, 7168, 2048, {5, 200, 0}, 256, 0, 0});
        snprintf(buf, sizeof buf, "%s expert_major W2 ret H=7168 I=2048", dn);
        cases.push_back({strdup(buf), fp8, 0, 7168, 2048, {70, 129}, 0, 0, 1});
    }
    /* the lab-only FP8 kernels without the issue order, so that their bench numbers are trusted */
    cases.push_back({"fp8 expert_major W13 swiglu I=2048 H=7168 [unordered]", 1, 1, 2048, 7168, {3, 130}, 0, 0, 0, 1});
    cases.push_back({"fp8 masked W2 plain N=512 K=384 [unordered]", 1, 0, 512, 384, {130, 0, 257}, 320, 0, 0, 1});
    cases.push_back({"fp8 expert_major W13 swiglu I=2048 H=7168 [no overlap]", 1, 1, 2048, 7168, {3, 130}, 0, 0, 0,
                     kMfTmaLabNoOverlap});
    cases.push_back({"fp8 masked W2 plain N=512 K=384 [no overlap]", 1, 0, 512, 384, {130, 0, 257}, 320, 0, 0,
                     kMfTmaLabNoOverlap});
    cases.push_back({"fp8 expert_major W2 plain L=40 N=256 K=256 [unordered]", 1, 0, 256, 256,
                     {1, 300, 0, 129, 128, 77, 256, 5, 0, 200}, 0, 0, 0, 1});
    /* the staggered turns (kMfTmaLabStagger): tails, masked, one K block per tile, ret */
    cases.push_back({"fp8 expert_major W13 swiglu I=2048 H=7168 [staggered]", 1, 1, 2048, 7168, {3, 130}, 0, 0, 0,
                     kMfTmaLabStagger});
    cases.push_back({"fp8 masked W2 plain N=512 K=384 [staggered]", 1, 0, 512, 384, {130, 0, 257}, 320, 0, 0,
                     kMfTmaLabStagger});
    cases.push_back({"fp8 masked W13 swiglu ue8m0 L=10 I=128 K=128 [staggered]", 1, 1, 128, 128,
                     {1, 300, 0, 129, 128, 77, 256, 5, 0, 200}, 300, 1, 0, kMfTmaLabStagger});
    cases.push_back({"fp8 expert_major W2 ret H=7168 I=2048 [staggered]", 1, 0, 7168, 2048, {70, 129}, 0, 0, 1,
                     kMfTmaLabStagger});
    /* the 64-row tail tiles (what ships against kMfTmaLabFullTiles): tails of 1 (expert 0's box at row -63: zero fill), 2, 44,
     * 63, 64 (lo = 64 exactly) rows and 65 (a full tile), whole experts of <= 64 rows, masked, ue8m0,
     * ret, one K block; and walks of several tiles per CTA (over 132 tiles: tail and full tiles
     * alternating, the overlap's next-tile kind, runs of tail tiles: the amax buffers' turns) */
    cases.push_back({"fp8 expert_major W13 swiglu ue8m0 I=384 K=512 counts 1,64,300,129 [tail tiles]", 1, 1, 384, 512,
                     {1, 64, 300, 129}, 0, 1, 0, kMfTmaLabFullTiles});
    cases.push_back({"fp8 masked W2 plain N=512 K=384 [tail tiles]", 1, 0, 512, 384, {130, 0, 257, 63, 65}, 320, 0, 0,
                     kMfTmaLabFullTiles});
    cases.push_back({"fp8 expert_major W13 swiglu I=2048 H=7168 [tail tiles]", 1, 1, 2048, 7168, {3, 130, 192}, 0, 0, 0,
                     kMfTmaLabFullTiles});
    cases.push_back({"fp8 expert_major W2 ret H=7168 I=2048 [tail tiles]", 1, 0, 7168, 2048, {70, 129, 44}, 0, 0, 1,
                     kMfTmaLabFullTiles});
    cases.push_back({"fp8 masked W13 swiglu L=10 I=128 K=128 [tail tiles]", 1, 1, 128, 128,
                     {1, 300, 0, 129, 128, 77, 256, 5, 0, 200}, 300, 0, 0, kMfTmaLabFullTiles});
    {
        /* ~1000 tiles, tails and full tiles mixed; 600 or 1200 tail tiles only (runs of them in every CTA) */
        std::vector<int> mixed, tails;
        for (int e = 0; e < 300; e++) mixed.push_back(e % 7 == 3 ? 0 : (int)(1 + (rnd_u64() % 300)));
        for (int e = 0; e < 600; e++) tails.push_back((int)(1 + (rnd_u64() % 64)));
        cases.push_back({"fp8 expert_major W13 swiglu L=300 I=256 K=128 [tail tiles]", 1, 1, 256, 128, mixed, 0, 0, 0,
                         kMfTmaLabFullTiles});
        cases.push_back({"fp8 expert_major W13 swiglu ue8m0 L=600 I=256 K=256 all tails [tail tiles]", 1, 1, 256, 256,
                         tails, 0, 1, 0, kMfTmaLabFullTiles});
        cases.push_back({"fp8 expert_major W2 plain L=300 N=512 K=256 [tail tiles]", 1, 0, 512, 256, mixed, 0, 0, 0,
                         kMfTmaLabFullTiles});
        cases.push_back({"bf16 expert_major W13 swiglu L=300 I=256 K=128 [tail tiles]", 0, 1, 256, 128, mixed, 0, 0, 0,
                         kMfTmaLabFullTiles});
        cases.push_back({"bf16 expert_major W2 plain L=600 N=256 K=192 all tails [tail tiles]", 0, 0, 256, 192, tails, 0,
                         0, 0, kMfTmaLabFullTiles});
    }
    {
        std::vector<int> cnt; /* 40 experts of up to 300 rows */
        for (int e = 0; e < 40; e++) cnt.push_back(e % 5 == 3 ? 0 : (int)(1 + (rnd_u64() % 300)));
        cases.push_back({"fp8 expert_major W2 plain L=40 N=256 K=256 [tail tiles]", 1, 0, 256, 256, cnt, 0, 0, 0,
                         kMfTmaLabFullTiles});
        cases.push_back({"fp8 expert_major W13 swiglu L=40 I=256 K=256 [tail tiles]", 1, 1, 256, 256, cnt, 0, 0, 0,
                         kMfTmaLabFullTiles});
        cases.push_back({"bf16 expert_major W2 plain L=40 N=256 K=256 [tail tiles]", 0, 0, 256, 256, cnt, 0, 0, 0,
                         kMfTmaLabFullTiles});
        cases.push_back({"bf16 masked W13 swiglu L=40 I=128 K=256 [tail tiles]", 0, 1, 128, 256, cnt, 300, 0, 0,
                         kMfTmaLabFullTiles});
    }
    /* BF16 tail tiles: K tails inside a 64-element stage (TMA zero fill along K), ret, DeepSeek shapes */
    cases.push_back({"bf16 expert_major W13 swiglu I=128 K=200 counts 77,129,1 [tail tiles]", 0, 1, 128, 200, {77, 129, 1},
                     0, 0, 0, kMfTmaLabFullTiles});
    cases.push_back({"bf16 masked W2 plain N=256 K=136 [tail tiles]", 0, 0, 256, 136, {77, 200, 63}, 256, 0, 0,
                     kMfTmaLabFullTiles});
    cases.push_back({"bf16 expert_major W2 ret N=512 K=384 [tail tiles]", 0, 0, 512, 384, {130, 0, 257}, 0, 0, 1,
                     kMfTmaLabFullTiles});
    cases.push_back({"bf16 expert_major W13 swiglu I=2048 H=7168 [tail tiles]", 0, 1, 2048, 7168, {3, 130, 192}, 0, 0, 0,
                     kMfTmaLabFullTiles});
    for (auto &c : cases) run_case(c);
    run_declines();
}

/* ====================================================================================================
 * bench
 * ==================================================================================================== */

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
    std::string name, dtype;
    int L, N, K, M;
    double us, tflops;
    std::string peer; /* an A/B row: the other side's name and time, and the gain of this side */
    double peer_us, gain_pct;
    int rows;         /* an A/B row on uneven counts: the rows of all experts (M is then 0) */
};

/* One GEMM call timed as the bench times every call: kWarmupRuns untimed then kTimedRuns timed
 * launches, each after a kFlushBytes memset (L2 flushed, outside the events); the median in us. */
static double time_call_us(const gemm_call &g, uint8_t *d_flush, cudaEvent_t ev0, cudaEvent_t ev1) {
    std::vector<float> ts;
    for (int i = 0; i < kWarmupRuns + kTimedRuns; i++) {
        CUDA_OK(cudaMemsetAsync(d_flush, i & 0xff, kFlushBytes, 0));
        CUDA_OK(cudaEventRecord(ev0, 0));
        if (!launched(run_call(g, 0))) exit(1);
        CUDA_OK(cudaEventRecord(ev1, 0));
        CUDA_OK(cudaEventSynchronize(ev1));
        float ms = 0;
        CUDA_OK(cudaEventElapsedTime(&ms, ev0, ev1));
        if (i >= kWarmupRuns) ts.push_back(ms);
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2] * 1e3;
}

/* Lab switch settings a and b (kMfTmaLab*) on the same call, interleaved over 3 rounds so that the
 * card's drift hits both alike: the median round of each, us. */
static void time_ab_us(const gemm_call &g, int a, int b, uint8_t *d_flush, cudaEvent_t ev0, cudaEvent_t ev1, double *us_a,
                       double *us_b) {
    std::vector<double> med[2];
    for (int round = 0; round < 3; round++)
        for (int v = 0; v < 2; v++) {
            mf__tma_lab::set_switch(v ? b : a);
            med[v].push_back(time_call_us(g, d_flush, ev0, ev1));
            mf__tma_lab::set_switch(kMfTmaLabShipped);
        }
    for (int v = 0; v < 2; v++) std::sort(med[v].begin(), med[v].end());
    *us_a = med[0][1];
    *us_b = med[1][1];
}

static void run_bench(const char *json_path, int argc, char **argv, bool ab_only) {
    struct shape {
        const char *name;
        int swiglu, ret;
        int n, k, nw; /* n: plain N or swiglu I; nw: weight rows per expert */
    };
    const shape shapes[4] = {
        {"W13 swiglu", 1, 0, 2048, 7168, 4096},
        {"W13 plain", 0, 0, 4096, 7168, 4096},
        {"W2 plain", 0, 0, 7168, 2048, 7168},
        {"W2 ret", 0, 1, 7168, 2048, 7168},
    };
    const int Ls[2] = {4, 32};
    const int Ms[4] = {256, 1024, 4096, 8192};
    const int kMaxRows = 32768;
    const int kMaxL = 32;

    g_case = "bench setup";
    size_t a_bytes = (size_t)kMaxRows * 7168 * 2;
    size_t w_bytes = std::max<size_t>((size_t)kMaxL * 4096 * 7168 * 2, (size_t)kMaxL * 7168 * 2048 * 2);
    uint8_t *d_a = dev_alloc<uint8_t>(a_bytes), *d_w = dev_alloc<uint8_t>(w_bytes);
    float *d_as = dev_alloc<float>((size_t)kMaxRows * 56), *d_ws = dev_alloc<float>((size_t)kMaxL * 56 * 56);
    uint8_t *d_out = dev_alloc<uint8_t>((size_t)kMaxRows * 7168 * 2);
    float *d_osc = dev_alloc<float>((size_t)kMaxRows * 16);
    int32_t *d_cnt = dev_alloc<int32_t>(kMaxL), *d_off = dev_alloc<int32_t>(kMaxL);
    int32_t *d_src = dev_alloc<int32_t>((size_t)kMaxRows * 3);
    uint8_t *d_flush = dev_alloc<uint8_t>(kFlushBytes);
    fill_random(d_as, (size_t)kMaxRows * 56, 2);
    fill_random(d_ws, (size_t)kMaxL * 56 * 56, 2);
    {
        std::vector<int32_t> src((size_t)kMaxRows * 3);
        for (int r = 0; r < kMaxRows; r++) {
            src[(size_t)r * 3 + 0] = 0;
            src[(size_t)r * 3 + 1] = r; /* ret: token r, k 0 of rank 0: the same rows as out */
            src[(size_t)r * 3 + 2] = 0;
        }
        CUDA_OK(cudaMemcpy(d_src, src.data(), src.size() * 4, cudaMemcpyHostToDevice));
    }
    mf__heap_view_t owners; /* rank 0's combine slots: out itself */
    memset(&owners, 0, sizeof owners);
    owners.heap[0] = d_out;
    mf__gemm_return_t ret;
    memset(&ret, 0, sizeof ret);
    ret.view = &owners;
    ret.src = d_src;
    ret.num_topk = 1;
    cudaEvent_t ev0, ev1;
    CUDA_OK(cudaEventCreate(&ev0));
    CUDA_OK(cudaEventCreate(&ev1));
    int32_t *d_sched = dev_alloc<int32_t>(2);
    CUDA_OK(cudaMemset(d_sched, 0, 8));
    std::vector<bench_row> rows_out;
    /* An interleaved A/B's result for the JSON record: side b (the row) against side a (its peer) */
    auto ab_row = [&](const std::string &name, int fp8, int L, int nw, int k, int M, int rows, const char *a,
                      double a_us, const char *b, double b_us, double flop) {
        bench_row r{};
        r.name = name + ": " + b + " vs " + a;
        r.dtype = fp8 ? "fp8" : "bf16";
        r.L = L, r.N = nw, r.K = k, r.M = M, r.rows = rows;
        r.us = b_us, r.tflops = flop / b_us * 1e-6;
        r.peer = a, r.peer_us = a_us, r.gain_pct = 100.0 * (a_us / b_us - 1.0);
        rows_out.push_back(r);
    };
    /* The call on L experts of M rows each (EXPERT_MAJOR, offsets e M; M a multiple of 128), its
     * counts and offsets uploaded; W2 ret shapes send rows to the combine slots. */
    auto equal_call = [&](int fp8, const shape &sh, int L, int M) {
        std::vector<int32_t> cnt(L, M), off(L);
        for (int e = 0; e < L; e++) off[e] = e * M;
        CUDA_OK(cudaMemcpy(d_cnt, cnt.data(), L * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(d_off, off.data(), L * 4, cudaMemcpyHostToDevice));
        gemm_call g;
        memset(&g, 0, sizeof g);
        g.fp8 = fp8, g.swiglu = sh.swiglu, g.n = sh.n, g.k = sh.k, g.L = L, g.max_rows = M;
        g.counts = d_cnt, g.offsets = d_off, g.a = d_a, g.w = d_w;
        g.a_scales = fp8 ? d_as : NULL, g.w_scales = fp8 ? d_ws : NULL;
        g.out = sh.ret ? NULL : d_out, g.out_scales = d_osc, g.ret = sh.ret ? &ret : NULL;
        g.sched = d_sched; /* the dynamic schedule, as the layer runs it */
        return g;
    };

    printf("# sm90_gemm_lab bench: the library's TMA launchers, kernel time, median of %d after %d warm-up, L2 flushed "
           "(%zu MB memset) before each run\n", kTimedRuns, kWarmupRuns, kFlushBytes >> 20);
    printf("# W13 plain = mf__sm90_tma_w2 on W13's shapes (the SwiGLU epilogue's baseline); W2 ret = rows to combine "
           "slots (one rank); %% = of the H200 dense ceiling (FP8 1436, BF16 795 TFLOP/s)\n");
    printf("# %-5s %-11s %3s %5s %5s %5s %10s %9s %6s\n", "dtype", "gemm", "L", "N", "K", "M", "time_us", "TFLOP/s", "%peak");
    for (int di = 0; di < 2 && !ab_only; di++) {
        const int fp8 = di == 0, esize = fp8 ? 1 : 2;
        fill_random(d_a, a_bytes / esize, fp8 ? 0 : 1);
        fill_random(d_w, w_bytes / esize, fp8 ? 0 : 1);
        for (const shape &sh : shapes)
            for (int L : Ls)
                for (int M : Ms) {
                    if ((int64_t)L * M > kMaxRows) continue;
                    if (sh.ret && !((L == 32 && M == 256) || (L == 4 && M == 4096))) continue;
                    char name[128];
                    snprintf(name, sizeof name, "bench %s %s L=%d M=%d", fp8 ? "fp8" : "bf16", sh.name, L, M);
                    g_case = name;
                    const gemm_call g = equal_call(fp8, sh, L, M);
                    const double median_us = time_call_us(g, d_flush, ev0, ev1);
                    bench_row br{};
                    br.name = sh.name;
                    br.dtype = fp8 ? "fp8" : "bf16";
                    br.L = L;
                    br.N = sh.nw;
                    br.K = sh.k;
                    br.M = M;
                    br.us = median_us;
                    br.tflops = 2.0 * L * M * (double)sh.nw * sh.k / br.us * 1e-6;
                    rows_out.push_back(br);
                    printf("  %-5s %-11s %3d %5d %5d %5d %10.1f %9.1f %6.1f\n", br.dtype.c_str(), sh.name, L, sh.nw, sh.k, M,
                           br.us, br.tflops, 100.0 * br.tflops / (fp8 ? 1436.0 : 795.0));
                    fflush(stdout);
                }
    }
    /* A/B: the FP8 kernels without the issue order (lab only), the same data */
    if (!ab_only) {
        const int fp8 = 1;
        fill_random(d_a, a_bytes, 0);
        fill_random(d_w, w_bytes, 0);
        printf("# A/B: FP8 without the issue order (the lab's fork, kMfTmaLabUnordered); compare with the rows above\n");
        const int ab[2][2] = {{4, 4096}, {32, 256}};
        for (const shape &sh : shapes) {
            if (sh.ret) continue;
            for (int ci = 0; ci < 2; ci++) {
                const int L = ab[ci][0], M = ab[ci][1];
                char name[128];
                snprintf(name, sizeof name, "bench fp8 %s L=%d M=%d unordered", sh.name, L, M);
                g_case = name;
                const gemm_call g = equal_call(fp8, sh, L, M);
                mf__tma_lab::set_switch(kMfTmaLabUnordered);
                const double us = time_call_us(g, d_flush, ev0, ev1);
                mf__tma_lab::set_switch(kMfTmaLabShipped);
                const double tf = 2.0 * L * M * (double)sh.nw * sh.k / us * 1e-6;
                printf("  %-5s %-11s %3d %5d %5d %5d %10.1f %9.1f %6.1f  unordered\n", "fp8", sh.name, L, sh.nw, sh.k, M, us,
                       tf, 100.0 * tf / 1436.0);
                fflush(stdout);
            }
        }
    }
    /* A/B: FP8 W13 SwiGLU with (ships) and without the epilogue overlap (lab), interleaved over 3
     * rounds on the same data so that the card's drift hits both alike; median of the rounds */
    {
        fill_random(d_a, a_bytes, 0);
        fill_random(d_w, w_bytes, 0);
        printf("# A/B: FP8 W13 swiglu, epilogue overlapped (ships) vs not (kMfTmaLabNoOverlap), 3 rounds interleaved\n");
        const int ab[4][2] = {{4, 4096}, {4, 8192}, {32, 256}, {32, 1024}}; /* L M <= kMaxRows */
        const shape &sh = shapes[0];
        for (int ci = 0; ci < 4; ci++) {
            const int L = ab[ci][0], M = ab[ci][1];
            const gemm_call g = equal_call(1, sh, L, M);
            char name[128];
            snprintf(name, sizeof name, "bench fp8 W13 swiglu L=%d M=%d overlap A/B", L, M);
            g_case = name;
            double on = 0, off_us = 0;
            time_ab_us(g, kMfTmaLabShipped, kMfTmaLabNoOverlap, d_flush, ev0, ev1, &on, &off_us);
            const double fl = 2.0 * L * M * (double)sh.nw * sh.k * 1e-6;
            ab_row("ab overlap W13 swiglu", 1, L, sh.nw, sh.k, M, 0, "no overlap", off_us, "ships (overlap)", on, fl * 1e6);
            printf("  fp8   W13 swiglu  L=%2d M=%5d  overlap %9.1f us %7.1f TF/s   no overlap %9.1f us %7.1f TF/s   gain %+5.1f %%\n",
                   L, M, on, fl / on, off_us, fl / off_us, 100.0 * (off_us / on - 1.0));
            fflush(stdout);
        }
    }
    /* A/B: FP8 with the staggered turns (lab) against what ships (the issue order), W13 swiglu and W2
     * plain, interleaved over 3 rounds on the same data */
    {
        fill_random(d_a, a_bytes, 0);
        fill_random(d_w, w_bytes, 0);
        printf("# A/B: FP8 staggered turns (kMfTmaLabStagger) vs the issue order (ships), 3 rounds interleaved\n");
        const int ab[4][2] = {{4, 4096}, {4, 8192}, {32, 256}, {32, 1024}};
        for (int si : {0, 2})
            for (int ci = 0; ci < 4; ci++) {
                const shape &sh = shapes[si];
                const int L = ab[ci][0], M = ab[ci][1];
                const gemm_call g = equal_call(1, sh, L, M);
                char name[128];
                snprintf(name, sizeof name, "bench fp8 %s L=%d M=%d stagger A/B", sh.name, L, M);
                g_case = name;
                double ships = 0, stag = 0;
                time_ab_us(g, kMfTmaLabShipped, kMfTmaLabStagger, d_flush, ev0, ev1, &ships, &stag);
                const double fl = 2.0 * L * M * (double)sh.nw * sh.k * 1e-6;
                ab_row(std::string("ab stagger ") + sh.name, 1, L, sh.nw, sh.k, M, 0, "ships", ships, "staggered", stag,
                       fl * 1e6);
                printf("  fp8   %-11s L=%2d M=%5d  ships %9.1f us %7.1f TF/s   staggered %9.1f us %7.1f TF/s   gain %+5.1f %%\n",
                       sh.name, L, M, ships, fl / ships, stag, fl / stag, 100.0 * (ships / stag - 1.0));
                fflush(stdout);
            }
    }
    /* A/B: the 64-row tail tiles (what ships) against full tiles only (lab), FP8 then BF16, W13 swiglu and W2 plain, on the
     * counts of a layer at T = 4096 per rank (L = 32 experts drawn like deepseek-v3's 256 at mean 128
     * rows, qwen3's 128 at mean 256: mean + sqrt(mean) z, z standard normal, offsets contiguous as
     * the layer's receive rows; about half the experts end in a tail of <= 64 rows), and on equal
     * counts M = 256 (no tail tile: what the kind's bookkeeping costs), 3 rounds interleaved */
    for (int fp8 = 1; fp8 >= 0; fp8--) {
        fill_random(d_a, a_bytes / (fp8 ? 1 : 2), fp8 ? 0 : 1);
        fill_random(d_w, w_bytes / (fp8 ? 1 : 2), fp8 ? 0 : 1);
        printf("# A/B: %s 64-row tail tiles (ships) vs full tiles only (kMfTmaLabFullTiles), L = 32, 3 rounds interleaved\n",
               fp8 ? "FP8" : "BF16");
        for (int mean : {128, 256, 0}) {
            const int L = 32;
            std::vector<int32_t> cnt(L, 256), off(L);
            int tails = 0, max_rows = 0, rows = 0;
            for (int e = 0; e < L && mean > 0; e++) {
                const double u1 = ((double)(rnd_u64() >> 11) + 0.5) / 9007199254740992.0, u2 = (double)(rnd_u64() >> 11) / 9007199254740992.0;
                const double z = sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
                cnt[e] = std::max(1, (int)lround(mean + sqrt((double)mean) * z));
            }
            for (int e = 0; e < L; e++) {
                off[e] = rows;
                rows += cnt[e];
                max_rows = std::max(max_rows, (int)cnt[e]);
                tails += cnt[e] % kBlockM != 0 && cnt[e] % kBlockM <= 64;
            }
            for (int si : {0, 2}) {
                const shape &sh = shapes[si];
                gemm_call g = equal_call(fp8, sh, L, 256); /* then the counts above */
                CUDA_OK(cudaMemcpy(d_cnt, cnt.data(), L * 4, cudaMemcpyHostToDevice));
                CUDA_OK(cudaMemcpy(d_off, off.data(), L * 4, cudaMemcpyHostToDevice));
                g.max_rows = max_rows;
                char name[128];
                snprintf(name, sizeof name, "bench %s %s L=%d mean=%d tail A/B", fp8 ? "fp8" : "bf16", sh.name, L, mean);
                g_case = name;
                double full = 0, ships = 0;
                time_ab_us(g, kMfTmaLabFullTiles, kMfTmaLabShipped, d_flush, ev0, ev1, &full, &ships);
                const double fl = 2.0 * rows * (double)sh.nw * sh.k * 1e-6;
                ab_row(std::string("ab tails ") + sh.name + (mean ? (mean == 128 ? " mean 128" : " mean 256") : " M 256"), fp8, L,
                       sh.nw, sh.k, mean ? 0 : 256, rows, "full tiles", full, "ships (tail tiles)", ships, fl * 1e6);
                printf("  %-5s %-11s L=%2d rows %5d (%s, %2d tails)  full tiles %9.1f us %7.1f TF/s   ships (tails) %9.1f us %7.1f TF/s   "
                       "gain %+5.1f %%\n", fp8 ? "fp8" : "bf16", sh.name, L, rows, mean ? (mean == 128 ? "mean 128" : "mean 256") : "M = 256 ",
                       tails, full, fl / full, ships, fl / ships, 100.0 * (full / ships - 1.0));
                fflush(stdout);
            }
        }
    }
    /* The interleaved A/Bs below: body(fp8, shape, L, M, call) for FP8 then BF16, W13 swiglu and W2
     * plain, over the (L, M) pairs `ab`, with the case named for error messages. */
    auto each_ab_case = [&](const std::vector<std::pair<int, int>> &ab, const char *what,
                            const std::function<void(int, const shape &, int, int, gemm_call &)> &body) {
        for (int fp8 = 1; fp8 >= 0; fp8--) {
            fill_random(d_a, a_bytes / (fp8 ? 1 : 2), fp8 ? 0 : 1);
            fill_random(d_w, w_bytes / (fp8 ? 1 : 2), fp8 ? 0 : 1);
            for (int si : {0, 2})
                for (const auto &lm : ab) {
                    const shape &sh = shapes[si];
                    gemm_call g = equal_call(fp8, sh, lm.first, lm.second);
                    char name[128];
                    snprintf(name, sizeof name, "bench %s %s L=%d M=%d %s", fp8 ? "fp8" : "bf16", sh.name, lm.first,
                             lm.second, what);
                    g_case = name;
                    body(fp8, sh, lm.first, lm.second, g);
                    fflush(stdout);
                }
        }
    };
    /* Timing probes (their outputs are not the GEMM): the FP8 promotion's cost (no overlap, with
     * against without the promotion) and the BF16 epilogue's (ships against no epilogue); cost =
     * time(with) / time(without) - 1 */
    printf("# probes, 3 rounds interleaved: FP8 promotion cost (no overlap vs no overlap + no promotion, "
           "kMfTmaLabNoPromote), BF16 epilogue cost (ships vs no epilogue, kMfTmaLabNoStore)\n");
    each_ab_case({{4, 4096}, {32, 256}, {32, 1024}}, "probe A/B", [&](int fp8, const shape &sh, int L, int M, gemm_call &g) {
        double with_us = 0, without_us = 0;
        if (fp8)
            time_ab_us(g, kMfTmaLabNoOverlap, kMfTmaLabNoPromote, d_flush, ev0, ev1, &with_us, &without_us);
        else
            time_ab_us(g, kMfTmaLabShipped, kMfTmaLabNoStore, d_flush, ev0, ev1, &with_us, &without_us);
        const double fl = 2.0 * L * M * (double)sh.nw * sh.k * 1e-6;
        ab_row(std::string("probe ") + sh.name, fp8, L, sh.nw, sh.k, M, 0, fp8 ? "no promotion" : "no epilogue", without_us,
               fp8 ? "promotion" : "epilogue", with_us, fl * 1e6);
        printf("  %-5s %-11s L=%2d M=%5d  %-12s %9.1f us %7.1f TF/s   %-14s %9.1f us %7.1f TF/s   cost %+5.1f %%\n",
               fp8 ? "fp8" : "bf16", sh.name, L, M, fp8 ? "promotion" : "epilogue", with_us, fl / with_us,
               fp8 ? "no promotion" : "no epilogue", without_us, fl / without_us, 100.0 * (with_us / without_us - 1.0));
    });
    /* A/B: the dynamic schedule (what the layer runs) against the static walk, 3 rounds interleaved */
    printf("# A/B: dynamic schedule (a ticket per tile; what the layer runs) vs the static walk, 3 rounds interleaved\n");
    each_ab_case({{4, 8192}, {32, 256}, {32, 1024}}, "schedule A/B", [&](int fp8, const shape &sh, int L, int M, gemm_call &g) {
        std::vector<double> med[2];
        for (int round = 0; round < 3; round++)
            for (int v = 0; v < 2; v++) {
                g.sched = v ? NULL : d_sched;
                med[v].push_back(time_call_us(g, d_flush, ev0, ev1));
            }
        for (int v = 0; v < 2; v++) std::sort(med[v].begin(), med[v].end());
        const double dyn = med[0][1], stat = med[1][1], fl = 2.0 * L * M * (double)sh.nw * sh.k * 1e-6;
        ab_row(std::string("ab schedule ") + sh.name, fp8, L, sh.nw, sh.k, M, 0, "static", stat, "dynamic", dyn, fl * 1e6);
        printf("  %-5s %-11s L=%2d M=%5d  dynamic %9.1f us %7.1f TF/s   static %9.1f us %7.1f TF/s   gain %+5.1f %%\n",
               fp8 ? "fp8" : "bf16", sh.name, L, M, dyn, fl / dyn, stat, fl / stat, 100.0 * (stat / dyn - 1.0));
    });
    /* the SwiGLU epilogue's cost: W13 swiglu against W13 plain (same GEMM, plain BF16 epilogue) */
    printf("# swiglu epilogue cost = time(W13 swiglu) / time(W13 plain) - 1\n");
    for (const bench_row &s : rows_out) {
        if (s.name != "W13 swiglu") continue;
        for (const bench_row &p : rows_out)
            if (p.name == "W13 plain" && p.dtype == s.dtype && p.L == s.L && p.M == s.M)
                printf("  %-5s swiglu-cost L=%2d M=%5d %+6.1f %%\n", s.dtype.c_str(), s.L, s.M, 100.0 * (s.us / p.us - 1.0));
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
        const char *commit = getenv("MF_COMMIT"), *card = getenv("MF_CARD");
        std::string cmd;
        for (int i = 0; i < argc; i++) cmd += (i ? " " : "") + std::string(argv[i]);
        fprintf(f, "{\"meta\": {\"card\": \"%s\", \"date\": \"%s\", \"commit\": \"%s\", \"command\": \"%s\", "
                   "\"backend\": \"cuda\"},\n \"rows\": [\n", card && *card ? card : "h200", date, commit ? commit : "unknown",
                cmd.c_str());
        for (size_t i = 0; i < rows_out.size(); i++) {
            const bench_row &r = rows_out[i];
            char shape[128], peers[256];
            if (r.M > 0 || r.rows == 0)
                snprintf(shape, sizeof shape, "{\"E\": %d, \"N\": %d, \"K\": %d, \"M\": %d}", r.L, r.N, r.K, r.M);
            else /* uneven counts: the rows of all experts, no M */
                snprintf(shape, sizeof shape, "{\"E\": %d, \"N\": %d, \"K\": %d, \"rows\": %d}", r.L, r.N, r.K, r.rows);
            if (r.peer.empty())
                snprintf(peers, sizeof peers, "[]");
            else
                snprintf(peers, sizeof peers, "[{\"name\": \"%s\", \"time_us\": %.2f}], \"ab_gain_pct\": %.2f", r.peer.c_str(),
                         r.peer_us, r.gain_pct);
            fprintf(f, "  {\"op\": \"gemm\", \"name\": \"tma %s\", \"dtype\": \"%s\", \"layout\": \"expert_major\", \"shape\": "
                       "%s, \"time_us\": %.2f, \"tflops\": %.1f, \"peers\": %s}%s\n",
                    r.name.c_str(), r.dtype.c_str(), shape, r.us, r.tflops, peers, i + 1 < rows_out.size() ? "," : "");
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
    CUDA_OK(cudaFree(d_src));
    CUDA_OK(cudaFree(d_flush));
    CUDA_OK(cudaFree(d_sched));
}

/* ====================================================================================================
 * main
 * ==================================================================================================== */

int main(int argc, char **argv) {
    bool selftest = false, validate = false, bench = false, ab_only = false;
    g_on_fatal = report_fault;
    /* what ships, with the tail tiles for BF16 too (the library takes them for FP8 only: BF16 measured
     * slower), so that validate checks that path's bits and --ab keeps measuring it; equal counts of
     * a multiple of 128 rows (the bench table) have no tail */
    __atomic_store_n(&mf__cuda_tma_tails, 2, __ATOMIC_RELAXED);
    const char *json = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--selftest")) selftest = true;
        else if (!strcmp(argv[i], "--validate")) validate = true;
        else if (!strcmp(argv[i], "--bench")) bench = true;
        else if (!strcmp(argv[i], "--ab")) bench = ab_only = true;
        else if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--selftest] [--validate] [--bench | --ab] [--json FILE]\n", argv[0]);
            return 2;
        }
    }
    if (!selftest && !validate && !bench) selftest = validate = bench = true;
    int dev = 0;
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDevice(&dev));
    CUDA_OK(cudaGetDeviceProperties(&prop, dev));
    printf("# device %s, sm_%d%d, %d SMs; TMA GEMM: %d B smem per CTA, %d stages, tiles 128 x 256, wait bound %.0f s\n",
           prop.name, prop.major, prop.minor, prop.multiProcessorCount, mf__tma::kSmemBytes, mf__tma::kStages,
           mf__tma::kWaitTimeoutNs * 1e-9);
    if (prop.major != 9) {
        fprintf(stderr, "needs an sm_90 GPU\n");
        return 2;
    }
    lab_sink(); /* this file's selftest kernels, the lab's fork and the library's TMA kernels report there */
    if (selftest) run_selftest();
    if (validate) run_validate();
    if (bench) run_bench(json, argc, argv, ab_only);
    g_failures += lab_sink_failed(wait_site);
    if (selftest || validate) printf("# %d failure(s)\n", g_failures);
    return g_failures ? 1 : 0;
}
