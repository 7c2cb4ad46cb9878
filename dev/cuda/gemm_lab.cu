/*
 * gemm_lab.cu — validate-then-bench main of the grouped expert GEMMs (src/cuda/grouped_gemm.cu,
 * kernels/sm90_grouped_gemm.cuh). Built by `make lab` into build/dev/gemm_lab; links
 * build/libmoeflow.a. Needs one sm_90 GPU; finishes in seconds.
 *
 *   gemm_lab              validate every case, then time the DeepSeek-V3 shapes
 *   gemm_lab --validate   validation only (e.g. under compute-sanitizer --tool memcheck)
 *   gemm_lab --bench      timing only
 *
 * Validation: for each case (dtype, H, I, rows per expert incl. 0 and non-multiples of the 64-row
 * tile, EXPERT_MAJOR with 128-aligned segments or MASKED with capacity C) the inputs are random
 * (never zero), FP8 operands are quantised with the library's own host quantiser
 * (mf_quantize_fp8: 1x128 activations, 128x128 weights), every row that no expert owns holds
 * garbage (NaN bytes), and every output is poisoned with 0xFF bytes (NaN in E4M3, BF16 and fp32)
 * first. W13 is checked against the CPU oracle (mf__cpu_gemm_nt + silu + the same requantisation
 * as src/cpu/backend.c) on h after dequantisation; W2 against mf__cpu_gemm_nt on the same h, both
 * by diff = 1 - 2 sum(xy) / sum(x^2 + y^2) plus element-wise bounds, and by the poison: every row
 * below counts[e] written, nothing else. W2 is also run into combine slots (ret) and must place
 * every row bitwise at its (rank, token, k); a repeat run and a CUDA-graph replay (captured as the
 * very first use of the kernels) must be bitwise identical; bad shapes and pointers must be refused.
 *
 * Bench: DeepSeek-V3 expert shapes, L = 32 local experts, M rows per expert in {8, 64, 256, 1024},
 * MASKED layout with C = 1024 (so the empty-row-tile cost of decode is in the numbers); each GEMM
 * timed with CUDA events, median of kTimedRuns after kWarmupRuns. The weights are generated on the
 * device (random E4M3 codes and scales, random BF16): they are 0.9-1.9 GB per GEMM, which the host
 * quantiser would take minutes over, and timing needs no oracle.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

extern "C" {
#include "core/layout.h"
#include "core/quant.h"
#include "cpu/gemm.h"
}
#include "core/numerics.h"
#include "cuda/grouped_gemm.h"
#include "common.h" /* the labs' CUDA_OK, random data, device vectors */

static const double kDiffMaxBf16 = 1e-5;
static const double kDiffMaxFp8 = 1e-3;
static const int kMaxPrinted = 8;     /* mismatches printed per check */
static const int kWarmupRuns = 3;
static const int kTimedRuns = 25;
static const int kRetRanks = 2;       /* ranks of combine slots in the ret check */
static const int kRetTopk = 4;

/* ---- host helpers ------------------------------------------------------------------------------ */

static mf_tensor_t tensor(void *data, int32_t dtype, int64_t d0, int64_t d1, int64_t d2) {
    mf_tensor_t t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dtype;
    t.ndim = d2 > 0 ? 3 : 2;
    t.dims[0] = d0;
    t.dims[1] = d1;
    if (d2 > 0) t.dims[2] = d2;
    return t;
}

/* An operand on the host: bytes (FP8 codes or BF16) + FP8 scales. */
struct host_operand {
    std::vector<uint8_t> data;
    std::vector<float> scales;
};

/* Random operand [batch, rows, cols] in `dtype`; FP8 via mf_quantize_fp8 with `block_rows`. */
static host_operand make_operand(int dtype, int64_t batch, int64_t rows, int64_t cols, int block_rows, float mag) {
    host_operand op;
    std::vector<uint16_t> b((size_t)(batch * rows * cols));
    fill_bf16(b.data(), batch * rows, cols, mag);
    if (dtype == MF_DTYPE_BF16) {
        op.data.resize(b.size() * 2);
        memcpy(op.data.data(), b.data(), op.data.size());
        return op;
    }
    op.data.resize(b.size());
    op.scales.resize((size_t)(batch * (rows / block_rows) * (cols / 128)));
    mf_tensor_t in = tensor(b.data(), MF_DTYPE_BF16, batch, rows, cols);
    mf_tensor_t out = tensor(op.data.data(), MF_DTYPE_FP8_E4M3, batch, rows, cols);
    mf_tensor_t sc = tensor(op.scales.data(), MF_DTYPE_FP32, batch, rows / block_rows, cols / 128);
    if (batch == 1) {
        in = tensor(b.data(), MF_DTYPE_BF16, rows, cols, 0);
        out = tensor(op.data.data(), MF_DTYPE_FP8_E4M3, rows, cols, 0);
        sc = tensor(op.scales.data(), MF_DTYPE_FP32, rows / block_rows, cols / 128, 0);
    }
    if (mf_quantize_fp8(&in, &out, &sc, block_rows, 0) != MF_SUCCESS) {
        fprintf(stderr, "mf_quantize_fp8 failed: %s\n", mf_last_error());
        exit(2);
    }
    return op;
}

/* The value of element (row, col) of an operand: FP8 code * its 1x128 scale, or BF16. */
static double value_of(int dtype, const uint8_t *data, const float *scales, int64_t cols, int64_t row, int64_t col) {
    if (dtype == MF_DTYPE_BF16) {
        uint16_t v;
        memcpy(&v, data + 2 * (row * cols + col), 2);
        return mf__bf16_to_float(v);
    }
    return (double)mf__fp8_to_float(data[row * cols + col]) * scales[row * (cols / 128) + col / 128];
}

/* ---- one validation case ----------------------------------------------------------------------- */

struct gemm_case {
    const char *name;
    int dtype, ue8m0;
    int H, I;
    std::vector<int> counts;
    int masked_capacity; /* 0: EXPERT_MAJOR (segments aligned to 128); else MASKED with this C */
    bool graph;          /* also capture + replay both GEMMs in a CUDA graph */
};

/* Rows of the receive tensor owned by an expert. */
struct layout {
    std::vector<int32_t> offsets; /* [L + 1] */
    std::vector<int> owner;       /* [rows]: expert of the row, or -1 */
    int64_t rows = 0;
    int max_rows = 0;
};

static layout make_layout(const gemm_case &c) {
    layout lo;
    int L = (int)c.counts.size();
    lo.offsets.resize(L + 1);
    int64_t at = 0;
    for (int e = 0; e < L; e++) {
        if (c.masked_capacity) at = (int64_t)e * c.masked_capacity;
        else at = (at + MF__DEFAULT_BLOCK_M - 1) / MF__DEFAULT_BLOCK_M * MF__DEFAULT_BLOCK_M;
        lo.offsets[e] = (int32_t)at;
        at += c.masked_capacity ? c.masked_capacity : c.counts[e];
        lo.max_rows = std::max(lo.max_rows, c.masked_capacity ? c.masked_capacity : c.counts[e]);
    }
    /* EXPERT_MAJOR: the tensor ends right after the last expert's last row, so that a read past
     * counts[L-1] is out of bounds for compute-sanitizer. */
    lo.rows = at;
    lo.offsets[L] = (int32_t)at;
    lo.owner.assign((size_t)lo.rows, -1);
    for (int e = 0; e < L; e++)
        for (int j = 0; j < c.counts[e]; j++) lo.owner[(size_t)lo.offsets[e] + j] = e;
    return lo;
}

/* Fills the rows no expert owns with NaN bytes (codes, BF16 and scales alike). */
static void garble_unowned(host_operand &op, const layout &lo, int64_t cols, int esz) {
    for (int64_t r = 0; r < lo.rows; r++) {
        if (lo.owner[(size_t)r] >= 0) continue;
        memset(op.data.data() + r * cols * esz, 0xFF, (size_t)(cols * esz));
        if (!op.scales.empty()) memset(op.scales.data() + r * (cols / 128), 0xFF, (size_t)(cols / 128) * sizeof(float));
    }
}

/* Records one failure with its message. */
static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("  FAIL ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    g_failures++;
}

/* Compares two operands [rows, cols] on the rows owned by an expert: diff measure + bounds
 * |x - y| <= rtol * max(|x|, |y|) + atol_abs + atol_scale * scale(y). */
static void compare_rows(const char *what, int dtype, const layout &lo, int64_t cols, const uint8_t *got,
                         const float *got_scales, const uint8_t *want, const float *want_scales, double diff_max,
                         double rtol, double atol_scale_ulps) {
    double sxy = 0, sxx = 0, syy = 0, worst = 0;
    int64_t wrong = 0, code_diffs = 0, n = 0;
    bool nonfinite = false;
    /* an absolute floor from the reference's rms (cancellation in fp32 sums) */
    double rms = 0;
    for (int64_t r = 0; r < lo.rows; r++) {
        if (lo.owner[(size_t)r] < 0) continue;
        for (int64_t c = 0; c < cols; c++) {
            double y = value_of(dtype, want, want_scales, cols, r, c);
            rms += y * y;
            n++;
        }
    }
    rms = n ? sqrt(rms / (double)n) : 0.0;
    const double atol = 1e-5 * rms;
    for (int64_t r = 0; r < lo.rows; r++) {
        if (lo.owner[(size_t)r] < 0) continue;
        for (int64_t c = 0; c < cols; c++) {
            double x = value_of(dtype, got, got_scales, cols, r, c);
            double y = value_of(dtype, want, want_scales, cols, r, c);
            int esz = dtype == MF_DTYPE_BF16 ? 2 : 1;
            if (memcmp(got + (r * cols + c) * esz, want + (r * cols + c) * esz, (size_t)esz)) code_diffs++;
            if (!isfinite(x) || !isfinite(y)) nonfinite = true;
            sxy += x * y;
            sxx += x * x;
            syy += y * y;
            double scale_abs = dtype == MF_DTYPE_BF16 ? 0.0 : atol_scale_ulps * want_scales[r * (cols / 128) + c / 128];
            double err = fabs(x - y), bound = rtol * std::max(fabs(x), fabs(y)) + atol + scale_abs;
            if (!(err <= bound)) {
                if (wrong < kMaxPrinted)
                    printf("    %s mismatch: row %lld (expert %d, row %lld of it) col %lld: gpu %.8g cpu %.8g\n", what,
                           (long long)r, lo.owner[(size_t)r], (long long)(r - lo.offsets[(size_t)lo.owner[(size_t)r]]),
                           (long long)c, x, y);
                wrong++;
            }
            if (err > worst || err != err) worst = err;
        }
    }
    double diff = (sxx + syy) == 0 ? 0.0 : 1.0 - 2.0 * sxy / (sxx + syy);
    if (nonfinite) diff = INFINITY;
    bool ok = !nonfinite && diff < diff_max && wrong == 0;
    printf("  %-4s %-22s diff %.3e (max %.0e)  wrong %lld / %lld  codes differing %lld  max|err| %.3g  %s\n",
           ok ? "ok" : "FAIL", what, diff, diff_max, (long long)wrong, (long long)n, (long long)code_diffs, worst,
           nonfinite ? "NaN/Inf present" : "");
    if (!ok) g_failures++;
}

/* Every byte of the rows no expert owns must still be the poison. */
static void check_untouched(const char *what, const layout &lo, const uint8_t *bytes, int64_t row_bytes) {
    int64_t touched = 0, first = -1;
    for (int64_t r = 0; r < lo.rows; r++) {
        if (lo.owner[(size_t)r] >= 0) continue;
        for (int64_t b = 0; b < row_bytes; b++)
            if (bytes[r * row_bytes + b] != kPoison) {
                if (first < 0) first = r;
                touched++;
                break;
            }
    }
    if (touched) fail("%s: %lld rows that no expert owns were written (first: row %lld)", what, (long long)touched, (long long)first);
    else printf("  ok   %-22s rows outside counts untouched\n", what);
}

/* CPU oracle of W13 + SwiGLU + requant for one expert's rows, as src/cpu/backend.c does it. */
static void oracle_w13(const gemm_case &c, const layout &lo, const host_operand &a, const host_operand &w13,
                       uint8_t *h, float *h_scales) {
    const int fp8 = c.dtype == MF_DTYPE_FP8_E4M3, esz = fp8 ? 1 : 2;
    const int64_t H = c.H, I = c.I, hb = H / 128, ib = I / 128;
    std::vector<float> A((size_t)(MF__CPU_ROWS * H)), As((size_t)(MF__CPU_ROWS * std::max<int64_t>(hb, 1)));
    std::vector<float> C((size_t)(MF__CPU_ROWS * 2 * I)), hrow((size_t)I);
    for (int e = 0; e < (int)c.counts.size(); e++) {
        mf__cpu_weight_t w = {w13.data.data() + (size_t)e * 2 * I * H * esz,
                              fp8 ? w13.scales.data() + (size_t)e * (2 * I / 128) * hb : NULL, fp8};
        for (int j = 0; j < c.counts[e]; j += MF__CPU_ROWS) {
            int m = std::min(MF__CPU_ROWS, c.counts[e] - j);
            int64_t row = lo.offsets[e] + j;
            for (int i = 0; i < m; i++)
                for (int64_t k = 0; k < H; k++) {
                    if (fp8) A[(size_t)(i * H + k)] = mf__fp8_to_float(a.data[(size_t)((row + i) * H + k)]);
                    else A[(size_t)(i * H + k)] = (float)value_of(MF_DTYPE_BF16, a.data.data(), NULL, H, row + i, k);
                }
            if (fp8) memcpy(As.data(), a.scales.data() + row * hb, (size_t)(m * hb) * sizeof(float));
            mf__cpu_gemm_nt(A.data(), As.data(), m, &w, 2 * I, H, C.data());
            for (int i = 0; i < m; i++) {
                const float *g = C.data() + (size_t)i * 2 * I, *u = g + I;
                for (int64_t k = 0; k < I; k++) hrow[(size_t)k] = mf__silu(g[k]) * u[k];
                if (fp8) {
                    mf__quant_1x128_f32(hrow.data(), I, c.ue8m0, h + (row + i) * I, h_scales + (row + i) * ib);
                } else {
                    for (int64_t k = 0; k < I; k++) {
                        uint16_t v = mf__bf16_from_float(hrow[(size_t)k]);
                        memcpy(h + 2 * ((row + i) * I + k), &v, 2);
                    }
                }
            }
        }
    }
}

/* CPU oracle of W2 (BF16 rows). */
static void oracle_w2(const gemm_case &c, const layout &lo, const host_operand &h, const host_operand &w2, uint16_t *out) {
    const int fp8 = c.dtype == MF_DTYPE_FP8_E4M3, esz = fp8 ? 1 : 2;
    const int64_t H = c.H, I = c.I, ib = I / 128;
    std::vector<float> A((size_t)(MF__CPU_ROWS * I)), As((size_t)(MF__CPU_ROWS * std::max<int64_t>(ib, 1)));
    std::vector<float> C((size_t)(MF__CPU_ROWS * H));
    for (int e = 0; e < (int)c.counts.size(); e++) {
        mf__cpu_weight_t w = {w2.data.data() + (size_t)e * H * I * esz,
                              fp8 ? w2.scales.data() + (size_t)e * (H / 128) * ib : NULL, fp8};
        for (int j = 0; j < c.counts[e]; j += MF__CPU_ROWS) {
            int m = std::min(MF__CPU_ROWS, c.counts[e] - j);
            int64_t row = lo.offsets[e] + j;
            for (int i = 0; i < m; i++)
                for (int64_t k = 0; k < I; k++) {
                    if (fp8) A[(size_t)(i * I + k)] = mf__fp8_to_float(h.data[(size_t)((row + i) * I + k)]);
                    else A[(size_t)(i * I + k)] = (float)value_of(MF_DTYPE_BF16, h.data.data(), NULL, I, row + i, k);
                }
            if (fp8) memcpy(As.data(), h.scales.data() + row * ib, (size_t)(m * ib) * sizeof(float));
            mf__cpu_gemm_nt(A.data(), As.data(), m, &w, H, I, C.data());
            for (int i = 0; i < m; i++)
                for (int64_t n = 0; n < H; n++) out[(row + i) * H + n] = mf__bf16_from_float(C[(size_t)(i * H + n)]);
        }
    }
}

static void expect_result(const char *what, mf_result_t got, mf_result_t want) {
    if (got != want) fail("%s: got %s, want %s (%s)", what, mf_result_string(got), mf_result_string(want), mf_last_error());
    else printf("  ok   refused: %s -> %s\n", what, mf_last_error());
}

static void run_case(const gemm_case &c) {
    const int fp8 = c.dtype == MF_DTYPE_FP8_E4M3, esz = fp8 ? 1 : 2;
    const int L = (int)c.counts.size();
    const int64_t H = c.H, I = c.I;
    layout lo = make_layout(c);
    printf("case %s: %s H=%d I=%d L=%d counts={", c.name, fp8 ? "FP8" : "BF16", c.H, c.I, L);
    for (int e = 0; e < L; e++) printf("%s%d", e ? "," : "", c.counts[e]);
    printf("} %s rows=%lld ue8m0=%d\n", c.masked_capacity ? "MASKED" : "EXPERT_MAJOR", (long long)lo.rows, c.ue8m0);

    /* Inputs: g, u, h, partials all O(1) (weights ~ 1/sqrt(K)). */
    host_operand a = make_operand(c.dtype, 1, lo.rows, H, 1, 1.0f);
    host_operand w13 = make_operand(c.dtype, L, 2 * I, H, 128, 2.0f / sqrtf((float)H));
    host_operand hin = make_operand(c.dtype, 1, lo.rows, I, 1, 1.0f);
    host_operand w2 = make_operand(c.dtype, L, H, I, 128, 2.0f / sqrtf((float)I));
    garble_unowned(a, lo, H, esz);
    garble_unowned(hin, lo, I, esz);

    std::vector<int32_t> counts(c.counts.begin(), c.counts.end());
    int32_t *d_counts = to_device(counts), *d_offsets = to_device(lo.offsets);
    uint8_t *d_a = to_device(a.data), *d_w13 = to_device(w13.data), *d_hin = to_device(hin.data), *d_w2 = to_device(w2.data);
    float *d_as = fp8 ? to_device(a.scales) : NULL, *d_w13s = fp8 ? to_device(w13.scales) : NULL;
    float *d_hins = fp8 ? to_device(hin.scales) : NULL, *d_w2s = fp8 ? to_device(w2.scales) : NULL;
    const size_t h_bytes = (size_t)(lo.rows * I * esz), hs_count = (size_t)(lo.rows * (I / 128));
    const size_t out_count = (size_t)(lo.rows * H);
    uint8_t *d_h;
    float *d_hs = NULL;
    uint16_t *d_out;
    CUDA_OK(cudaMalloc((void **)&d_h, h_bytes));
    if (fp8) CUDA_OK(cudaMalloc((void **)&d_hs, std::max<size_t>(hs_count, 1) * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&d_out, out_count * 2));

    mf__gemm_segments_t seg = {d_counts, d_offsets, L, lo.max_rows + 7 /* a loose bound is fine */};
    const mf__gemm_choice_t choice = mf__gemm_choose(seg.rows_hint, seg.max_rows_per_expert, MF_DATAFLOW_PULL);
    mf__gemm_operand_t op_a = {d_a, d_as}, op_w13 = {d_w13, d_w13s}, op_hin = {d_hin, d_hins}, op_w2 = {d_w2, d_w2s};
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    auto poison = [&]() {
        CUDA_OK(cudaMemset(d_h, kPoison, h_bytes));
        if (fp8) CUDA_OK(cudaMemset(d_hs, kPoison, hs_count * sizeof(float)));
        CUDA_OK(cudaMemset(d_out, kPoison, out_count * 2));
    };

    /* CUDA graph first: capture both GEMMs before the kernels were ever launched (first-use setup
     * must be capture-safe), replay, keep the results for the bitwise comparison below. */
    std::vector<uint8_t> graph_h;
    std::vector<uint16_t> graph_out;
    if (c.graph) {
        poison();
        CUDA_OK(cudaDeviceSynchronize());
        cudaGraph_t graph;
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        mf_result_t r1 = mf__cuda_w13_swiglu(&choice, &seg, c.dtype, c.ue8m0, op_a, op_w13, c.H, c.I, d_h, d_hs, stream, 0);
        mf_result_t r2 = mf__cuda_w2(&choice, &seg, c.dtype, op_hin, op_w2, c.H, c.I, d_out, NULL, stream, 0);
        cudaError_t ec = cudaStreamEndCapture(stream, &graph);
        if (r1 != MF_SUCCESS || r2 != MF_SUCCESS || ec != cudaSuccess) {
            fail("graph capture: w13 %s, w2 %s, end capture %s (%s)", mf_result_string(r1), mf_result_string(r2),
                 cudaGetErrorString(ec), mf_last_error());
            (void)cudaGetLastError();
        } else {
            cudaGraphExec_t exec;
            CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
            CUDA_OK(cudaGraphLaunch(exec, stream));
            CUDA_OK(cudaStreamSynchronize(stream));
            graph_h = to_host(d_h, h_bytes);
            graph_out = to_host(d_out, out_count);
            CUDA_OK(cudaGraphExecDestroy(exec));
            CUDA_OK(cudaGraphDestroy(graph));
            printf("  ok   graph capture + replay\n");
        }
    }

    /* W13 */
    poison();
    if (mf__cuda_w13_swiglu(&choice, &seg, c.dtype, c.ue8m0, op_a, op_w13, c.H, c.I, d_h, d_hs, stream, 0) != MF_SUCCESS) {
        fail("mf__cuda_w13_swiglu: %s", mf_last_error());
        return;
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<uint8_t> h = to_host(d_h, h_bytes);
    std::vector<float> hs = fp8 ? to_host(d_hs, hs_count) : std::vector<float>();
    std::vector<uint8_t> ref_h(h_bytes, kPoison);
    std::vector<float> ref_hs(hs_count, 0.0f);
    oracle_w13(c, lo, a, w13, ref_h.data(), ref_hs.data());
    /* FP8: a requantised code may flip by one E4M3 ulp where the fp32 sums differ in order (<= 2^-3
     * relative for normals, 2^-9 x scale for subnormals). BF16: one BF16 ulp (<= 2^-7). */
    compare_rows("w13 h (dequantised)", c.dtype, lo, I, h.data(), hs.data(), ref_h.data(), ref_hs.data(),
                 fp8 ? kDiffMaxFp8 : kDiffMaxBf16, fp8 ? 0.126 : 0.0079, fp8 ? 1.01 / 512 : 0.0);
    check_untouched("w13 h", lo, h.data(), I * esz);
    if (fp8) check_untouched("w13 h_scales", lo, (const uint8_t *)hs.data(), (I / 128) * 4);
    if (!graph_h.empty() && memcmp(graph_h.data(), h.data(), h_bytes)) fail("w13: graph replay differs from a direct launch");

    /* W13 again: deterministic, bit for bit. */
    poison();
    if (mf__cuda_w13_swiglu(&choice, &seg, c.dtype, c.ue8m0, op_a, op_w13, c.H, c.I, d_h, d_hs, stream, 0) != MF_SUCCESS)
        fail("mf__cuda_w13_swiglu (repeat): %s", mf_last_error());
    CUDA_OK(cudaStreamSynchronize(stream));
    if (to_host(d_h, h_bytes) != h) fail("w13: a repeated launch is not bitwise identical");
    else printf("  ok   w13 repeat bitwise identical\n");

    /* W2 into out */
    if (mf__cuda_w2(&choice, &seg, c.dtype, op_hin, op_w2, c.H, c.I, d_out, NULL, stream, 0) != MF_SUCCESS) {
        fail("mf__cuda_w2: %s", mf_last_error());
        return;
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<uint16_t> out = to_host(d_out, out_count);
    std::vector<uint16_t> ref_out(out_count, 0xFFFF);
    oracle_w2(c, lo, hin, w2, ref_out.data());
    compare_rows("w2 out", MF_DTYPE_BF16, lo, H, (const uint8_t *)out.data(), NULL, (const uint8_t *)ref_out.data(), NULL,
                 fp8 ? kDiffMaxFp8 : kDiffMaxBf16, 0.0079, 0.0);
    check_untouched("w2 out", lo, (const uint8_t *)out.data(), H * 2);
    if (!graph_out.empty() && graph_out != out) fail("w2: graph replay differs from a direct launch");

    /* W2 into combine slots: row -> a unique (rank, token, k); rows no expert owns point at slot
     * (0, 0, 0) too, which a wrong write would therefore clobber. */
    {
        int64_t owned = 0;
        for (int64_t r = 0; r < lo.rows; r++) owned += lo.owner[(size_t)r] >= 0;
        const int64_t S = owned / (kRetRanks * kRetTopk) + 2;
        std::vector<int64_t> perm((size_t)(kRetRanks * S * kRetTopk));
        for (size_t i = 0; i < perm.size(); i++) perm[i] = (int64_t)i;
        for (size_t i = perm.size() - 1; i > 0; i--) std::swap(perm[i], perm[(size_t)(rnd_u64() % (i + 1))]);
        std::vector<int32_t> src((size_t)(lo.rows * 3), 0);
        std::vector<int64_t> slot_of_row((size_t)lo.rows, -1);
        int64_t next = 0;
        for (int64_t r = 0; r < lo.rows; r++) {
            if (lo.owner[(size_t)r] < 0) continue;
            int64_t s = perm[(size_t)next++];
            slot_of_row[(size_t)r] = s;
            src[(size_t)(3 * r)] = (int32_t)(s / (S * kRetTopk));
            src[(size_t)(3 * r + 1)] = (int32_t)((s / kRetTopk) % S);
            src[(size_t)(3 * r + 2)] = (int32_t)(s % kRetTopk);
        }
        mf__heap_view_t owners; /* rank r's combine slots at heap[r] (combine offset 0) */
        memset(&owners, 0, sizeof owners);
        const size_t slot_count = (size_t)(S * kRetTopk * H);
        for (int r = 0; r < kRetRanks; r++) {
            CUDA_OK(cudaMalloc((void **)&owners.heap[r], slot_count * 2));
            CUDA_OK(cudaMemset(owners.heap[r], kPoison, slot_count * 2));
        }
        int32_t *d_src = to_device(src);
        mf__gemm_return_t ret;
        memset(&ret, 0, sizeof ret);
        ret.view = &owners;
        ret.src = d_src;
        ret.num_topk = kRetTopk;
        if (mf__cuda_w2(&choice, &seg, c.dtype, op_hin, op_w2, c.H, c.I, NULL, &ret, stream, 0) != MF_SUCCESS) {
            fail("mf__cuda_w2 (ret): %s", mf_last_error());
        } else {
            CUDA_OK(cudaStreamSynchronize(stream));
            std::vector<uint16_t> slots((size_t)kRetRanks * slot_count);
            for (int r = 0; r < kRetRanks; r++)
                CUDA_OK(cudaMemcpy(slots.data() + r * slot_count, owners.heap[r], slot_count * 2, cudaMemcpyDeviceToHost));
            std::vector<char> used(perm.size(), 0);
            int64_t bad_rows = 0, bad_slots = 0;
            for (int64_t r = 0; r < lo.rows; r++) {
                int64_t s = slot_of_row[(size_t)r];
                if (s < 0) continue;
                used[(size_t)s] = 1;
                if (memcmp(slots.data() + s * H, out.data() + r * H, (size_t)H * 2)) {
                    if (bad_rows < kMaxPrinted) printf("    ret: row %lld differs in its slot %lld\n", (long long)r, (long long)s);
                    bad_rows++;
                }
            }
            for (size_t s = 0; s < used.size(); s++) {
                if (used[s]) continue;
                for (int64_t n = 0; n < H; n++)
                    if (slots[s * (size_t)H + (size_t)n] != 0xFFFF) {
                        bad_slots++;
                        break;
                    }
            }
            if (bad_rows || bad_slots) fail("w2 ret: %lld rows misplaced, %lld unused slots written", (long long)bad_rows, (long long)bad_slots);
            else printf("  ok   w2 ret: %lld rows bitwise in their (rank, token, k) slots, other slots untouched\n", (long long)owned);
        }
        for (int r = 0; r < kRetRanks; r++) CUDA_OK(cudaFree(owners.heap[r]));
        CUDA_OK(cudaFree(d_src));
    }

    CUDA_OK(cudaStreamDestroy(stream));
    cudaFree(d_counts), cudaFree(d_offsets), cudaFree(d_a), cudaFree(d_w13), cudaFree(d_hin), cudaFree(d_w2);
    cudaFree(d_as), cudaFree(d_w13s), cudaFree(d_hins), cudaFree(d_w2s), cudaFree(d_h), cudaFree(d_hs), cudaFree(d_out);
}

/* Arguments outside the supported shapes must be refused before any launch. */
static void run_refusals(void) {
    printf("case refusals\n");
    int32_t *d_i;
    uint8_t *d_b;
    CUDA_OK(cudaMalloc((void **)&d_i, 64));
    CUDA_OK(cudaMalloc((void **)&d_b, 1 << 16));
    float *d_f = (float *)d_b;
    mf__gemm_segments_t seg = {d_i, d_i, 1, 8};
    const mf__gemm_choice_t choice = mf__gemm_choose(seg.rows_hint, seg.max_rows_per_expert, MF_DATAFLOW_PULL);
    mf__gemm_operand_t op = {d_b, d_f}, bad = {d_b + 8, d_f};
    expect_result("BF16 H = 1004 (not a multiple of 8)",
                  mf__cuda_w13_swiglu(&choice, &seg, MF_DTYPE_BF16, 0, op, op, 1004, 64, d_b, NULL, 0, 0), MF_ERR_NOT_SUPPORTED);
    expect_result("FP8 I = 200 (not a multiple of 128)",
                  mf__cuda_w2(&choice, &seg, MF_DTYPE_FP8_E4M3, op, op, 256, 200, (uint16_t *)d_b, NULL, 0, 0), MF_ERR_NOT_SUPPORTED);
    expect_result("FP32 dtype", mf__cuda_w2(&choice, &seg, MF_DTYPE_FP32, op, op, 256, 256, (uint16_t *)d_b, NULL, 0, 0),
                  MF_ERR_NOT_SUPPORTED);
    expect_result("a.data 8 bytes off 16", mf__cuda_w13_swiglu(&choice, &seg, MF_DTYPE_BF16, 0, bad, op, 64, 64, d_b, NULL, 0, 0),
                  MF_ERR_INVALID_ARGUMENT);
    expect_result("FP8 without h_scales", mf__cuda_w13_swiglu(&choice, &seg, MF_DTYPE_FP8_E4M3, 0, op, op, 128, 128, d_b, NULL, 0, 0),
                  MF_ERR_INVALID_ARGUMENT);
    CUDA_OK(cudaFree(d_i));
    CUDA_OK(cudaFree(d_b));
}

/* ---- bench ------------------------------------------------------------------------------------- */

__device__ __forceinline__ uint32_t hash32(uint64_t i, uint32_t seed) {
    uint64_t z = i * 0x9E3779B97F4A7C15ull + seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (uint32_t)(z ^ (z >> 31));
}

/* Random E4M3 codes with exponents 2^-3 .. 2^3 and random sign/mantissa (never NaN, never 0). */
__global__ void init_fp8_kernel(uint8_t *x, int64_t n, uint32_t seed) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t r = hash32((uint64_t)i, seed);
        x[i] = (uint8_t)((r & 0x80u) | ((4u + (r >> 8) % 7u) << 3) | ((r >> 16) & 7u));
    }
}

__global__ void init_bf16_kernel(uint16_t *x, int64_t n, uint32_t seed, float mag) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = ((float)(hash32((uint64_t)i, seed) >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * mag;
        x[i] = mf__bf16_from_float(v == 0.0f ? mag : v);
    }
}

__global__ void init_scale_kernel(float *x, int64_t n, uint32_t seed, float lo, float hi) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = lo + (hi - lo) * (float)(hash32((uint64_t)i, seed) >> 8) * (1.0f / 16777216.0f);
}

static void init_operand(int dtype, void *data, int64_t n, float *scales, int64_t ns, uint32_t seed, float mag) {
    if (dtype == MF_DTYPE_FP8_E4M3) {
        init_fp8_kernel<<<1024, 256>>>((uint8_t *)data, n, seed);
        init_scale_kernel<<<64, 256>>>(scales, ns, seed + 1, 0.5f * mag / 8, mag / 8);
    } else {
        init_bf16_kernel<<<1024, 256>>>((uint16_t *)data, n, seed, mag);
    }
    CUDA_OK(cudaGetLastError());
}

static void run_bench(void) {
    const int L = 32, H = 7168, I = 2048, C = 1024;
    const int Ms[] = {8, 64, 256, 1024};
    const double kPeakBf16 = 795e12, kPeakFp8 = 1436e12, kCopyBw = 4.24e12; /* docs/DESIGN.md ceilings */
    const int64_t rows = (int64_t)L * C;
    const size_t w13_elems = (size_t)L * 2 * I * H, w2_elems = (size_t)L * H * I;
    void *w13, *w2, *a, *hin, *h, *out;
    float *w13s, *w2s, *as, *hins, *hs;
    int32_t *counts, *offsets;
    CUDA_OK(cudaMalloc(&w13, w13_elems * 2));
    CUDA_OK(cudaMalloc(&w2, w2_elems * 2));
    CUDA_OK(cudaMalloc(&a, (size_t)rows * H * 2));
    CUDA_OK(cudaMalloc(&hin, (size_t)rows * I * 2));
    CUDA_OK(cudaMalloc(&h, (size_t)rows * I * 2));
    CUDA_OK(cudaMalloc(&out, (size_t)rows * H * 2));
    CUDA_OK(cudaMalloc((void **)&w13s, w13_elems / (128 * 128) * 4));
    CUDA_OK(cudaMalloc((void **)&w2s, w2_elems / (128 * 128) * 4));
    CUDA_OK(cudaMalloc((void **)&as, (size_t)rows * (H / 128) * 4));
    CUDA_OK(cudaMalloc((void **)&hins, (size_t)rows * (I / 128) * 4));
    CUDA_OK(cudaMalloc((void **)&hs, (size_t)rows * (I / 128) * 4));
    CUDA_OK(cudaMalloc((void **)&counts, L * 4));
    CUDA_OK(cudaMalloc((void **)&offsets, (L + 1) * 4));
    std::vector<int32_t> off(L + 1);
    for (int e = 0; e <= L; e++) off[e] = e * C;
    CUDA_OK(cudaMemcpy(offsets, off.data(), (L + 1) * 4, cudaMemcpyHostToDevice));
    cudaEvent_t ev0, ev1;
    CUDA_OK(cudaEventCreate(&ev0));
    CUDA_OK(cudaEventCreate(&ev1));
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    printf("\n# grouped GEMM v1 (mma.sync) on DeepSeek-V3 shapes: L=%d H=%d I=%d, MASKED C=%d, median of %d runs\n", L,
           H, I, C, kTimedRuns);
    printf("# floor = max(FLOPs / %.0f|%.0f TFLOP/s, bytes / %.2f TB/s); bytes = weights + activations in + out\n",
           kPeakBf16 / 1e12, kPeakFp8 / 1e12, kCopyBw / 1e12);
    printf("%-4s %-5s %5s %10s %9s %10s %10s %7s\n", "gemm", "dtype", "M", "time_us", "TFLOP/s", "weight_TB/s", "floor_us",
           "%floor");
    for (int fp8 = 0; fp8 <= 1; fp8++) {
        const int dtype = fp8 ? MF_DTYPE_FP8_E4M3 : MF_DTYPE_BF16, esz = fp8 ? 1 : 2;
        init_operand(dtype, w13, (int64_t)w13_elems, w13s, (int64_t)(w13_elems / (128 * 128)), 11, 1.0f / sqrtf((float)H));
        init_operand(dtype, w2, (int64_t)w2_elems, w2s, (int64_t)(w2_elems / (128 * 128)), 12, 1.0f / sqrtf((float)I));
        init_operand(dtype, a, rows * H, as, rows * (H / 128), 13, 1.0f);
        init_operand(dtype, hin, rows * I, hins, rows * (I / 128), 14, 1.0f);
        CUDA_OK(cudaDeviceSynchronize());
        for (int gemm = 0; gemm < 2; gemm++) {
            for (int M : Ms) {
                std::vector<int32_t> cnt(L, M);
                CUDA_OK(cudaMemcpy(counts, cnt.data(), L * 4, cudaMemcpyHostToDevice));
                mf__gemm_segments_t seg = {counts, offsets, L, C};
                const mf__gemm_choice_t choice = mf__gemm_choose(seg.rows_hint, seg.max_rows_per_expert, MF_DATAFLOW_PULL);
                std::vector<float> ms;
                for (int run = 0; run < kWarmupRuns + kTimedRuns; run++) {
                    CUDA_OK(cudaEventRecord(ev0, stream));
                    mf_result_t r = gemm == 0
                        ? mf__cuda_w13_swiglu(&choice, &seg, dtype, 0, mf__gemm_operand_t{a, as}, mf__gemm_operand_t{w13, w13s}, H, I, h, hs, stream, 0)
                        : mf__cuda_w2(&choice, &seg, dtype, mf__gemm_operand_t{hin, hins}, mf__gemm_operand_t{w2, w2s}, H, I,
                                      (uint16_t *)out, NULL, stream, 0);
                    if (r != MF_SUCCESS) {
                        fail("bench launch: %s", mf_last_error());
                        return;
                    }
                    CUDA_OK(cudaEventRecord(ev1, stream));
                    CUDA_OK(cudaEventSynchronize(ev1));
                    float t;
                    CUDA_OK(cudaEventElapsedTime(&t, ev0, ev1));
                    if (run >= kWarmupRuns) ms.push_back(t);
                }
                std::sort(ms.begin(), ms.end());
                const double us = ms[ms.size() / 2] * 1e3;
                const double N = gemm == 0 ? 2.0 * I : H, K = gemm == 0 ? H : I, Nout = gemm == 0 ? I : H;
                const double flops = 2.0 * L * M * N * K;
                const double wbytes = (double)L * N * K * esz;
                const double bytes = wbytes + (double)L * M * K * esz + (double)L * M * Nout * (gemm == 0 ? esz : 2);
                const double floor_us = std::max(flops / (fp8 ? kPeakFp8 : kPeakBf16), bytes / kCopyBw) * 1e6;
                printf("%-4s %-5s %5d %10.1f %9.1f %10.2f %10.1f %6.1f%%\n", gemm == 0 ? "w13" : "w2", fp8 ? "fp8" : "bf16",
                       M, us, flops / us / 1e6, wbytes / us / 1e6, floor_us, 100.0 * floor_us / us);
            }
        }
    }
    CUDA_OK(cudaStreamDestroy(stream));
    cudaFree(w13), cudaFree(w2), cudaFree(a), cudaFree(hin), cudaFree(h), cudaFree(out);
    cudaFree(w13s), cudaFree(w2s), cudaFree(as), cudaFree(hins), cudaFree(hs), cudaFree(counts), cudaFree(offsets);
}

int main(int argc, char **argv) {
    bool validate = true, bench = true;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--validate")) bench = false;
        else if (!strcmp(argv[i], "--bench")) validate = false;
        else {
            fprintf(stderr, "usage: %s [--validate | --bench]\n", argv[0]);
            return 2;
        }
    }
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    printf("# device: %s, sm_%d%d, %d SMs, %.0f MB L2\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
           prop.l2CacheSize / 1e6);
    if (validate) {
        const gemm_case cases[] = {
            /* name, dtype, ue8m0, H, I, counts, masked C, graph */
            {"fp8-expert-major", MF_DTYPE_FP8_E4M3, 0, 2048, 512, {0, 1, 17, 64, 65, 130}, 0, true},
            {"fp8-masked-ue8m0-longK", MF_DTYPE_FP8_E4M3, 1, 7168, 256, {3, 40, 0, 96}, 96, false},
            {"bf16-expert-major", MF_DTYPE_BF16, 0, 2048, 512, {0, 1, 17, 64, 65, 130}, 0, true},
            {"bf16-odd-shapes", MF_DTYPE_BF16, 0, 1032, 200, {5, 0, 70, 129}, 0, false},
            {"bf16-masked-tiny", MF_DTYPE_BF16, 0, 24, 8, {1, 64, 0}, 70, false},
        };
        for (const gemm_case &c : cases) run_case(c);
        run_refusals();
    }
    if (bench) run_bench();
    printf("%s: %d failure%s\n", g_failures ? "FAIL" : "PASS", g_failures, g_failures == 1 ? "" : "s");
    return g_failures ? 1 : 0;
}
