/*
 * test_quant.c — mf_quantize_fp8 (1x128 activation blocks, 128x128 weight blocks, batched
 * [L, M, N], UE8M0 scales) against the contract of docs/DESIGN.md "Numerics", computed independently:
 * amax = max |x| over the block in fp32, clamped below at 1e-4; scale = amax / 448;
 * q = e4m3(x * (448 / amax)); UE8M0: scale = 2^ceil(log2(amax / 448)), q = e4m3(x * (1 / scale))
 * (mft_quant_blocks in harness.c, written from the contract, not from the library).
 * Outputs are compared bitwise (codes and scales). Misuse must return INVALID_ARGUMENT with a
 * message and leave both outputs untouched.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define QBLOCK 128

static uint32_t bits_of(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* 2^ceil(log2(s)) for a positive normal float, from frexp (s = m * 2^e, m in [0.5, 1)). */
static float pow2_ceil(float s) {
    int e;
    float m = frexpf(s, &e);
    return m == 0.5f ? s : ldexpf(1.0f, e);
}

/* Input with a different magnitude per block (down to below the amax clamp), signs mixed, and one
 * all-zero block. */
static void fill_input(uint16_t *in, int64_t nb, int64_t M, int64_t N, int br, uint64_t seed) {
    mft_rng_t rng = {seed};
    const float mags[] = {1.0f, 300.0f, 0.01f, 5e-5f, 1e4f, 0.5f, 3e-6f, 17.0f};
    int64_t nbc = N / QBLOCK;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                int64_t blk = (b * (M / br) + i / br) * nbc + j / QBLOCK;
                float mag = mags[blk % 8];
                float v = (float)(mft_rng_uniform(&rng) * 2.0 - 1.0) * mag;
                if (blk == 1) v = 0.0f; /* the all-zero block */
                in[(b * M + i) * N + j] = mf_bf16_from_float(v);
            }
}

static int compare(const uint8_t *q, const uint8_t *q_ref, const float *s, const float *s_ref,
                   int64_t nq, int64_t ns, int64_t N, int64_t nbc) {
    int64_t bad = 0;
    for (int64_t i = 0; i < ns; i++)
        if (bits_of(s[i]) != bits_of(s_ref[i])) {
            if (bad++ < 5)
                mft_note("scale[%lld] (row-block %lld, col-block %lld) = %a, expected %a",
                         (long long)i, (long long)(i / nbc), (long long)(i % nbc), (double)s[i],
                         (double)s_ref[i]);
        }
    for (int64_t i = 0; i < nq; i++)
        if (q[i] != q_ref[i]) {
            if (bad++ < 10)
                mft_note("q[%lld] (row %lld, col %lld) = 0x%02x (%g), expected 0x%02x (%g)",
                         (long long)i, (long long)(i / N), (long long)(i % N), q[i],
                         (double)mf_fp8_e4m3_to_float(q[i]), q_ref[i],
                         (double)mf_fp8_e4m3_to_float(q_ref[i]));
        }
    if (bad) MFT_FAIL("%lld mismatches", (long long)bad);
    return 0;
}

/* Quantises [nb, M, N] (nb = 0: a plain 2-D [M, N]) and compares with the independent result. */
static int check_case(int64_t nb, int64_t M, int64_t N, int br, int ue8m0, uint64_t seed) {
    int64_t b = nb ? nb : 1, n = b * M * N, ns = b * (M / br) * (N / QBLOCK);
    uint16_t *in = (uint16_t *)mft_alloc((size_t)n * 2);
    uint8_t *q = (uint8_t *)mft_alloc((size_t)n), *q_ref = (uint8_t *)mft_alloc((size_t)n);
    float *s = (float *)mft_alloc((size_t)ns * 4), *s_ref = (float *)mft_alloc((size_t)ns * 4);
    fill_input(in, b, M, N, br, seed);
    mft_quant_blocks(in, b, M, N, br, ue8m0, q_ref, s_ref); /* harness.c: the contract */
    mft_poison(q, (size_t)n);
    mft_poison(s, (size_t)ns * 4);
    mf_tensor_t tin, tq, ts;
    if (nb) {
        tin = mft_t3(in, MF_DTYPE_BF16, nb, M, N);
        tq = mft_t3(q, MF_DTYPE_FP8_E4M3, nb, M, N);
        ts = mft_t3(s, MF_DTYPE_FP32, nb, M / br, N / QBLOCK);
    } else {
        tin = mft_t2(in, MF_DTYPE_BF16, M, N);
        tq = mft_t2(q, MF_DTYPE_FP8_E4M3, M, N);
        ts = mft_t2(s, MF_DTYPE_FP32, M / br, N / QBLOCK);
    }
    int rc = 0;
    mf_result_t r = mf_quantize_fp8(&tin, &tq, &ts, br, ue8m0);
    if (r != MF_SUCCESS) {
        rc = mft_fail(__FILE__, __LINE__, "mf_quantize_fp8 -> %s: %s", mft_result_name(r),
                      mf_last_error());
    } else if (compare(q, q_ref, s, s_ref, n, ns, N, N / QBLOCK)) {
        rc = mft_fail(__FILE__, __LINE__, "case nb=%lld M=%lld N=%lld block_rows=%d ue8m0=%d",
                      (long long)nb, (long long)M, (long long)N, br, ue8m0);
    }
    free(in);
    free(q);
    free(q_ref);
    free(s);
    free(s_ref);
    return rc;
}

static int test_quant_1x128(void) {
    if (check_case(0, 7, 384, 1, 0, 11)) return 1;
    if (check_case(0, 1, 128, 1, 0, 12)) return 1;
    if (check_case(0, 64, 1024, 1, 0, 13)) return 1;
    return 0;
}

static int test_quant_128x128(void) {
    if (check_case(0, 128, 128, 128, 0, 21)) return 1;
    if (check_case(0, 256, 384, 128, 0, 22)) return 1;
    if (check_case(0, 512, 1024, 128, 0, 23)) return 1;
    return 0;
}

static int test_quant_batched(void) {
    if (check_case(3, 5, 256, 1, 0, 31)) return 1;
    if (check_case(3, 256, 128, 128, 0, 32)) return 1;
    if (check_case(2, 128, 256, 128, 1, 33)) return 1;
    if (check_case(4, 64, 512, 1, 0, 34)) return 1;
    return 0;
}

static int test_quant_ue8m0(void) {
    if (check_case(0, 9, 512, 1, 1, 41)) return 1;
    if (check_case(0, 128, 256, 128, 1, 42)) return 1;
    /* Every UE8M0 scale is a power of two, and q is x / scale rounded. */
    uint16_t in[256];
    uint8_t q[256];
    float s[2];
    for (int j = 0; j < 256; j++) in[j] = mf_bf16_from_float((float)(j - 100) * 0.37f);
    mf_tensor_t tin = mft_t2(in, MF_DTYPE_BF16, 1, 256), tq = mft_t2(q, MF_DTYPE_FP8_E4M3, 1, 256),
                ts = mft_t2(s, MF_DTYPE_FP32, 1, 2);
    MFT_CHECK_OK(mf_quantize_fp8(&tin, &tq, &ts, 1, 1));
    for (int i = 0; i < 2; i++) {
        int e;
        MFT_CHECK_MSG(frexpf(s[i], &e) == 0.5f, "scale %a is not a power of two", (double)s[i]);
    }
    return 0;
}

/* An all-zero block (and one below the clamp) gets scale 1e-4 / 448 and zero codes. */
static int test_quant_zero_block(void) {
    uint16_t in[2 * 256];
    uint8_t q[2 * 256];
    float s[4];
    memset(in, 0, sizeof in);
    for (int j = 128; j < 256; j++) in[j] = mf_bf16_from_float(j % 2 ? 1e-5f : -2e-5f);
    for (int ue = 0; ue < 2; ue++) {
        mft_poison(q, sizeof q);
        mft_poison(s, sizeof s);
        mf_tensor_t tin = mft_t2(in, MF_DTYPE_BF16, 2, 256);
        mf_tensor_t tq = mft_t2(q, MF_DTYPE_FP8_E4M3, 2, 256);
        mf_tensor_t ts = mft_t2(s, MF_DTYPE_FP32, 2, 2);
        MFT_CHECK_OK(mf_quantize_fp8(&tin, &tq, &ts, 1, ue));
        float want = ue ? pow2_ceil(1e-4f / 448.0f) : 1e-4f / 448.0f;
        for (int i = 0; i < 4; i++)
            MFT_CHECK_MSG(bits_of(s[i]) == bits_of(want), "ue8m0=%d scale[%d] = %a, expected %a",
                          ue, i, (double)s[i], (double)want);
        for (int j = 0; j < 128; j++) MFT_CHECK_EQ_INT(q[j], 0);
        for (int j = 256; j < 512; j++) MFT_CHECK_EQ_INT(q[j], 0);
        /* the 1e-5 block is quantised against the clamped amax, not its own */
        for (int j = 128; j < 256; j++) {
            volatile float prod = mf_bf16_to_float(in[j]) * (ue ? 1.0f / want : 448.0f / 1e-4f);
            MFT_CHECK_EQ_INT(q[j], mf_fp8_e4m3_from_float(prod));
        }
    }
    return 0;
}

/* ---- misuse --------------------------------------------------------------------------------- */

typedef struct misuse_bufs {
    uint16_t in[256 * 256];
    uint8_t q[256 * 256];
    float s[256 * 2];
} misuse_bufs_t;

/* Calls mf_quantize_fp8 on poisoned outputs; it must fail with INVALID_ARGUMENT, a message, and
 * not touch q or s. */
static int expect_rejected(const char *what, misuse_bufs_t *b, const mf_tensor_t *in,
                           const mf_tensor_t *q, const mf_tensor_t *s, int32_t br, int32_t ue) {
    mft_poison(b->q, sizeof b->q);
    mft_poison(b->s, sizeof b->s);
    mf_result_t r = mf_quantize_fp8(in, q, s, br, ue);
    if (r != MF_ERR_INVALID_ARGUMENT)
        MFT_FAIL("%s: -> %s (%s), expected MF_ERR_INVALID_ARGUMENT", what, mft_result_name(r),
                 mf_last_error());
    if (!mf_last_error() || !mf_last_error()[0]) MFT_FAIL("%s: empty mf_last_error()", what);
    mft_verbose("  %s: %s\n", what, mf_last_error());
    int64_t i = mft_first_unpoisoned(b->q, sizeof b->q);
    if (i >= 0) MFT_FAIL("%s: output q written at byte %lld", what, (long long)i);
    i = mft_first_unpoisoned(b->s, sizeof b->s);
    if (i >= 0) MFT_FAIL("%s: scales written at byte %lld", what, (long long)i);
    return 0;
}

static int test_quant_misuse(void) {
    misuse_bufs_t *b = (misuse_bufs_t *)mft_alloc(sizeof *b);
    for (size_t i = 0; i < sizeof b->in / 2; i++) b->in[i] = mf_bf16_from_float((float)(i % 13));
    int rc = 1;
    mf_tensor_t in, q, s;
#define REJECT(what, br, ue)                                  \
    if (expect_rejected(what, b, &in, &q, &s, br, ue)) goto done

    /* The valid baseline, so every rejection below is caused by the one thing it changes. */
    in = mft_t2(b->in, MF_DTYPE_BF16, 4, 256);
    q = mft_t2(b->q, MF_DTYPE_FP8_E4M3, 4, 256);
    s = mft_t2(b->s, MF_DTYPE_FP32, 4, 2);
    if (mf_quantize_fp8(&in, &q, &s, 1, 0) != MF_SUCCESS) {
        mft_fail(__FILE__, __LINE__, "valid baseline failed: %s", mf_last_error());
        goto done;
    }

    in = mft_t2(b->in, MF_DTYPE_BF16, 4, 200);
    q = mft_t2(b->q, MF_DTYPE_FP8_E4M3, 4, 200);
    s = mft_t2(b->s, MF_DTYPE_FP32, 4, 2);
    REJECT("N = 200 not a multiple of 128", 1, 0);

    in = mft_t2(b->in, MF_DTYPE_BF16, 100, 256);
    q = mft_t2(b->q, MF_DTYPE_FP8_E4M3, 100, 256);
    s = mft_t2(b->s, MF_DTYPE_FP32, 1, 2);
    REJECT("M = 100 with block_rows = 128", 128, 0);

    in = mft_t2(b->in, MF_DTYPE_BF16, 4, 256);
    q = mft_t2(b->q, MF_DTYPE_FP8_E4M3, 4, 256);
    s = mft_t2(b->s, MF_DTYPE_FP32, 4, 2);
    REJECT("block_rows = 64", 64, 0);
    REJECT("block_rows = 0", 0, 0);
    REJECT("block_rows = -1", -1, 0);

    in = mft_t2(b->in, MF_DTYPE_FP32, 4, 256);
    REJECT("input dtype FP32", 1, 0);
    in = mft_t2(b->in, MF_DTYPE_BF16, 4, 256);
    q = mft_t2(b->q, MF_DTYPE_BF16, 4, 256);
    REJECT("output dtype BF16", 1, 0);
    q = mft_t2(b->q, MF_DTYPE_FP8_E4M3, 4, 256);
    s = mft_t2(b->s, MF_DTYPE_BF16, 4, 2);
    REJECT("scales dtype BF16", 1, 0);
    s = mft_t2(b->s, MF_DTYPE_FP32, 4, 2);

    in.data = NULL;
    REJECT("NULL input data", 1, 0);
    in.data = b->in;
    q.data = NULL;
    REJECT("NULL output data", 1, 0);
    q.data = b->q;
    s.data = NULL;
    REJECT("NULL scales data", 1, 0);
    s.data = b->s;

    q = mft_t2(b->q, MF_DTYPE_FP8_E4M3, 4, 384);
    REJECT("output [4, 384] for input [4, 256]", 1, 0);
    q = mft_t2(b->q, MF_DTYPE_FP8_E4M3, 5, 256);
    REJECT("output [5, 256] for input [4, 256]", 1, 0);
    q = mft_t3(b->q, MF_DTYPE_FP8_E4M3, 1, 4, 256);
    REJECT("output rank 3 for input rank 2", 1, 0);
    q = mft_t2(b->q, MF_DTYPE_FP8_E4M3, 4, 256);
    s = mft_t2(b->s, MF_DTYPE_FP32, 4, 3);
    REJECT("scales [4, 3] for 1x128 blocks of [4, 256]", 1, 0);
    s = mft_t2(b->s, MF_DTYPE_FP32, 2, 2);
    REJECT("scales [2, 2] for 1x128 blocks of [4, 256]", 1, 0);
    in = mft_t2(b->in, MF_DTYPE_BF16, 256, 256);
    q = mft_t2(b->q, MF_DTYPE_FP8_E4M3, 256, 256);
    s = mft_t2(b->s, MF_DTYPE_FP32, 256, 2);
    REJECT("scales [256, 2] for 128x128 blocks of [256, 256]", 128, 0);
    s = mft_t2(b->s, MF_DTYPE_FP32, 2, 2);
    in = mft_t1(b->in, MF_DTYPE_BF16, 256);
    q = mft_t1(b->q, MF_DTYPE_FP8_E4M3, 256);
    s = mft_t1(b->s, MF_DTYPE_FP32, 2);
    REJECT("rank-1 input", 1, 0);

    in = mft_t2(b->in, MF_DTYPE_BF16, 4, 256);
    q = mft_t2(b->q, MF_DTYPE_FP8_E4M3, 4, 256);
    s = mft_t2(b->s, MF_DTYPE_FP32, 4, 2);
    mft_poison(b->q, sizeof b->q);
    mft_poison(b->s, sizeof b->s);
    if (mf_quantize_fp8(NULL, &q, &s, 1, 0) != MF_ERR_INVALID_ARGUMENT ||
        mf_quantize_fp8(&in, NULL, &s, 1, 0) != MF_ERR_INVALID_ARGUMENT ||
        mf_quantize_fp8(&in, &q, NULL, 1, 0) != MF_ERR_INVALID_ARGUMENT) {
        mft_fail(__FILE__, __LINE__, "a NULL descriptor pointer was not INVALID_ARGUMENT");
        goto done;
    }
    if (mft_first_unpoisoned(b->q, sizeof b->q) >= 0 ||
        mft_first_unpoisoned(b->s, sizeof b->s) >= 0) {
        mft_fail(__FILE__, __LINE__, "a NULL-descriptor call wrote an output");
        goto done;
    }
    rc = 0;
#undef REJECT
done:
    free(b);
    return rc;
}

const mft_test_t mft_tests_quant[] = {
    {"quant_1x128", test_quant_1x128, 20},
    {"quant_128x128", test_quant_128x128, 20},
    {"quant_batched", test_quant_batched, 20},
    {"quant_ue8m0", test_quant_ue8m0, 20},
    {"quant_zero_block", test_quant_zero_block, 10},
    {"quant_misuse", test_quant_misuse, 10},
    {NULL, NULL, 0},
};
