/*
 * ref.h — the independent naive reference of the EP MoE layer, used by the tests and by
 * `moeflow run` to judge every backend.
 *
 * The layer is computed token by token in double on one "rank" with no expert parallelism and no
 * code shared with the library beyond the public FP8/BF16 conversions (mf_fp8_e4m3_from_float and
 * friends). It follows DESIGN.md "Numerics": FP8 activations are quantised 1x128 exactly as the
 * contract says (re-implemented here), FP8 weights are dequantised q * scale per 128x128 block,
 * h = silu(g) * u is requantised to FP8 1x128 (FP8) or rounded to BF16 (BF16), each W2 partial is
 * rounded to BF16 and y = bf16(sum over k ascending of w * partial).
 */
#ifndef MF_TESTS_REF_H
#define MF_TESTS_REF_H

#include <stdint.h>

#include "moeflow.h"

/* One layer's inputs for all R ranks, in host memory. Expert e lives on rank e / L as local expert
 * e % L, in exactly the arrays passed to mf_moe_set_weights on that rank. */
typedef struct mfref_problem {
    int32_t R, E, K, H, I;
    int32_t dtype;               /* MF_DTYPE_BF16 or MF_DTYPE_FP8_E4M3 */
    int32_t ue8m0;               /* activation scales rounded up to powers of two */
    const int32_t *T;            /* [R] tokens per rank */
    const uint16_t *const *x;    /* [R] -> [T_r, H] bf16 */
    const int32_t *const *topk_ids;   /* [R] -> [T_r, K] */
    const float *const *topk_weights; /* [R] -> [T_r, K] */
    const void *const *w13;      /* [R] -> [L, 2I, H] bf16 (uint16_t) or fp8 (uint8_t) */
    const float *const *w13_scales; /* [R] -> [L, 2I/128, H/128] (FP8) */
    const void *const *w2;       /* [R] -> [L, H, I] */
    const float *const *w2_scales;  /* [R] -> [L, H/128, I/128] (FP8) */
    /* Optional (NULL: none): called after every token with (tokens done, tokens of all ranks). */
    void (*progress)(void *ctx, int64_t done, int64_t total);
    void *progress_ctx;
} mfref_problem_t;

/* y[r] -> [T_r, H] bf16 for every rank. Returns 0 on success, -1 on bad input or no memory. */
int mfref_layer(const mfref_problem_t *p, uint16_t *const *y);
/* The same on `threads` threads (each a slice of every rank's tokens); bitwise the same result. */
int mfref_layer_mt(const mfref_problem_t *p, uint16_t *const *y, int32_t threads);

/* diff = 1 - 2 * sum(a * b) / sum(a * a + b * b) over n bf16 values, in double (0 when both are
 * all zero; 1 or more and NaN-safe: any NaN or infinity gives MFREF_DIFF_NAN). */
#define MFREF_DIFF_NAN 1e9
double mfref_diff_bf16(const uint16_t *a, const uint16_t *b, int64_t n);

/* Pass marks of a layer output against mfref_layer (DESIGN.md "Numerics"). */
#define MFREF_DIFF_MAX_BF16 1e-5
#define MFREF_DIFF_MAX_FP8 1e-3

/* Element-wise bounds |out - ref| <= atol + rtol * |ref| for layer outputs of O(1) (the mfp
 * problems are scaled so that x, g, u, h, partials and y are O(1), |partial| < 4 in practice).
 * A backend and the reference see the same quantised inputs and differ before each rounding only
 * by fp32 vs fp64 arithmetic (~1e-6 relative), so a rounding can land one unit in the last place
 * (ulp) apart, rarely (~1e-6 / ulp of the time):
 *  - y itself: 1 bf16 ulp <= 2^-7 |y|                                       -> rtol = 2^-7
 *  - each bf16 partial: 1 ulp <= 2^-7 |partial| <= 2^-5 for |partial| < 4, weighted by w_k <= 1;
 *    a flipped bf16 h_i moves a partial by ~2^-7 |h_i| sqrt(3 / I), far less -> BF16 atol = 2^-6
 *    (one flipped partial of magnitude < 2, or two of < 1 with w = 1/2; seen: max |err| = 2^-8)
 *  - FP8: a flipped e4m3 h_i is 1 ulp <= 2^-3 |h_i| (and an amax one fp32 ulp apart rescales its
 *    block by 1e-7), moving a partial by <= 2^-3 |h_i| |w2| ~ 2^-3 * 4 * sqrt(3 / 128) ~ 0.08 in
 *    the worst case (I = 128, |h_i| = 4), ~0.01 typically            -> FP8 atol = 2^-4
 * NaN is always wrong. Measured on the CPU backend over ~30 seeds, shapes and routings: max |err|
 * is one bf16 ulp of y (2^-8 .. 2^-7) for both dtypes, well inside atol + rtol |y|. */
#define MFREF_ATOL_BF16 0.015625
#define MFREF_RTOL_BF16 0.0078125
#define MFREF_ATOL_FP8 0.0625
#define MFREF_RTOL_FP8 0.0078125

/* Counts the elements of out [n] outside atol + rtol * |ref| (NaN in either is wrong); stores the
 * index of the first (-1 if none) and the largest |out - ref| (NaN if any) where not NULL. */
int64_t mfref_count_wrong_bf16(const uint16_t *out, const uint16_t *ref, int64_t n, double atol,
                               double rtol, int64_t *first_wrong, double *max_abs_err);

#endif /* MF_TESTS_REF_H */
