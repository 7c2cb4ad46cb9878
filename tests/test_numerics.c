/*
 * test_numerics.c — the FP8 E4M3 and BF16 conversions of the public header
 * (mf_fp8_e4m3_from_float and friends, which wrap src/core/numerics.h) against docs/DESIGN.md
 * "Numerics": OCP E4M3 "fn" (max 448, no inf, NaN = 0x7f/0xff), round-to-nearest-even,
 * saturation to +-448; BF16 the top half of an fp32, RNE, NaN stays NaN.
 *
 * Expected values come from an independent decoder written here from the format's definition
 * (ldexp of sign, exponent, mantissa), never from the library's own tables.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "harness.h"

static uint32_t bits_of(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float float_of(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* E4M3 by definition: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN. */
static float e4m3_decode(uint8_t c) {
    int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) return s ? -NAN : NAN;
    double v = e == 0 ? ldexp((double)m, -9) : ldexp(1.0 + m / 8.0, e - 7);
    return (float)(s ? -v : v);
}

static int test_fp8_all_codes(void) {
    for (int c = 0; c < 256; c++) {
        uint8_t code = (uint8_t)c;
        float want = e4m3_decode(code), got = mf_fp8_e4m3_to_float(code);
        if (isnan(want)) {
            MFT_CHECK_MSG(isnan(got), "code 0x%02x decodes to %g, expected NaN", c, got);
            MFT_CHECK_MSG(!!signbit(got) == !!(c & 0x80), "code 0x%02x: NaN sign lost", c);
        } else {
            MFT_CHECK_MSG(bits_of(got) == bits_of(want),
                          "code 0x%02x decodes to %a (0x%08x), expected %a (0x%08x)", c,
                          (double)got, bits_of(got), (double)want, bits_of(want));
        }
        uint8_t back = mf_fp8_e4m3_from_float(got);
        MFT_CHECK_MSG(back == code, "code 0x%02x -> %a -> 0x%02x", c, (double)got, back);
    }
    /* The named codes. */
    MFT_CHECK_EQ_INT(mf_fp8_e4m3_from_float(-0.0f), 0x80);
    MFT_CHECK_EQ_INT(mf_fp8_e4m3_from_float(0.0f), 0x00);
    MFT_CHECK(mf_fp8_e4m3_to_float(0x7e) == 448.0f);
    MFT_CHECK(mf_fp8_e4m3_to_float(0xfe) == -448.0f);
    MFT_CHECK(mf_fp8_e4m3_to_float(0x01) == 0x1p-9f);
    MFT_CHECK(mf_fp8_e4m3_to_float(0x08) == 0x1p-6f);
    MFT_CHECK(signbit(mf_fp8_e4m3_to_float(0x80)) && mf_fp8_e4m3_to_float(0x80) == 0.0f);
    return 0;
}

/* The midpoint of every pair of adjacent finite codes goes to the even code; a hair above goes up,
 * a hair below goes down. Covers subnormals, the subnormal/normal edge and exponent carries. */
static int test_fp8_rne_ties(void) {
    for (int sign = 0; sign < 2; sign++) {
        for (int c = 0; c < 0x7e; c++) {
            uint8_t lo = (uint8_t)(c | (sign << 7)), hi = (uint8_t)((c + 1) | (sign << 7));
            float a = e4m3_decode(lo), b = e4m3_decode(hi);
            float mid = (float)(((double)a + (double)b) / 2.0); /* exact: 4 significant bits */
            MFT_CHECK_MSG((double)mid == ((double)a + (double)b) / 2.0, "midpoint not exact");
            uint8_t even = (c & 1) ? hi : lo;
            uint8_t got = mf_fp8_e4m3_from_float(mid);
            MFT_CHECK_MSG(got == even, "tie %a between 0x%02x and 0x%02x -> 0x%02x, expected 0x%02x",
                          (double)mid, lo, hi, got, even);
            float toward_b = nextafterf(mid, b), toward_a = nextafterf(mid, a);
            got = mf_fp8_e4m3_from_float(toward_b);
            MFT_CHECK_MSG(got == hi, "%a (just past the tie) -> 0x%02x, expected 0x%02x",
                          (double)toward_b, got, hi);
            got = mf_fp8_e4m3_from_float(toward_a);
            MFT_CHECK_MSG(got == lo, "%a (just short of the tie) -> 0x%02x, expected 0x%02x",
                          (double)toward_a, got, lo);
        }
    }
    return 0;
}

static int test_fp8_saturation_and_nan(void) {
    const float big[] = {448.0f, nextafterf(448.0f, 1e9f), 449.0f, 464.0f, 479.0f, 480.0f,
                         1e6f, 3.4e38f, INFINITY};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        uint8_t p = mf_fp8_e4m3_from_float(big[i]), n = mf_fp8_e4m3_from_float(-big[i]);
        MFT_CHECK_MSG(p == 0x7e, "%g -> 0x%02x, expected 0x7e (saturate to 448)", (double)big[i], p);
        MFT_CHECK_MSG(n == 0xfe, "%g -> 0x%02x, expected 0xfe", (double)-big[i], n);
    }
    /* Just below 448 still rounds to it; the tie at 432 (416 and 448) goes to the even 448. */
    MFT_CHECK_EQ_INT(mf_fp8_e4m3_from_float(440.0f), 0x7e);
    MFT_CHECK_EQ_INT(mf_fp8_e4m3_from_float(432.0f), 0x7e);
    MFT_CHECK_EQ_INT(mf_fp8_e4m3_from_float(431.0f), 0x7d);

    const uint32_t nans[] = {0x7fc00000u, 0x7f800001u, 0x7fffffffu, 0x7fa00000u};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        for (int s = 0; s < 2; s++) {
            float x = float_of(nans[i] | (s ? 0x80000000u : 0u));
            uint8_t q = mf_fp8_e4m3_from_float(x);
            MFT_CHECK_MSG((q & 0x7f) == 0x7f, "NaN 0x%08x -> 0x%02x, expected a NaN code",
                          bits_of(x), q);
            MFT_CHECK_MSG(isnan(mf_fp8_e4m3_to_float(q)), "NaN code 0x%02x does not decode to NaN",
                          q);
            MFT_CHECK_MSG((q & 0x80) == (s ? 0x80 : 0), "NaN 0x%08x -> 0x%02x: sign", bits_of(x), q);
        }
    }
    return 0;
}

static int test_fp8_underflow(void) {
    /* Half the smallest subnormal (2^-10) is a tie between 0 and 0x01: even -> 0. Anything below
     * flushes to a signed zero; anything above rounds up to the smallest subnormal. */
    const float half_min = 0x1p-10f;
    const float below[] = {0x1p-149f, 0x1p-126f, 1e-10f, 0x1p-11f, nextafterf(half_min, 0.0f),
                           half_min};
    for (size_t i = 0; i < sizeof below / sizeof below[0]; i++) {
        uint8_t p = mf_fp8_e4m3_from_float(below[i]), n = mf_fp8_e4m3_from_float(-below[i]);
        MFT_CHECK_MSG(p == 0x00, "%a -> 0x%02x, expected 0x00", (double)below[i], p);
        MFT_CHECK_MSG(n == 0x80, "%a -> 0x%02x, expected 0x80", (double)-below[i], n);
    }
    MFT_CHECK_EQ_INT(mf_fp8_e4m3_from_float(nextafterf(half_min, 1.0f)), 0x01);
    MFT_CHECK_EQ_INT(mf_fp8_e4m3_from_float(-nextafterf(half_min, 1.0f)), 0x81);
    MFT_CHECK_EQ_INT(mf_fp8_e4m3_from_float(0x1.8p-9f), 0x02); /* 1.5 units: tie -> even 2 */
    MFT_CHECK_EQ_INT(mf_fp8_e4m3_from_float(0x1.8p-8f), 0x03); /* 3 units exactly */
    return 0;
}

/* Dense sweep of positive floats up to past 448: the result is monotone in x and is a nearest
 * code (no code is strictly closer); the sign is symmetric. */
static int test_fp8_monotone_nearest(void) {
    float table[0x7f]; /* decoded 0x00..0x7e, ascending */
    for (int c = 0; c < 0x7f; c++) table[c] = e4m3_decode((uint8_t)c);
    const uint32_t end = bits_of(500.0f), step = 97;
    int prev = -1;
    for (uint32_t u = 0; u <= end; u += step) {
        float x = float_of(u);
        uint8_t q = mf_fp8_e4m3_from_float(x);
        MFT_CHECK_MSG(q <= 0x7e, "%a -> 0x%02x (not a finite positive code)", (double)x, q);
        MFT_CHECK_MSG((int)q >= prev, "not monotone: %a -> 0x%02x after 0x%02x", (double)x, q,
                      prev);
        prev = q;
        if (x <= 448.0f) {
            double err = fabs((double)table[q] - (double)x);
            if (q > 0)
                MFT_CHECK_MSG(fabs((double)table[q - 1] - (double)x) >= err,
                              "%a -> 0x%02x but 0x%02x is closer", (double)x, q, q - 1);
            if (q < 0x7e)
                MFT_CHECK_MSG(fabs((double)table[q + 1] - (double)x) >= err,
                              "%a -> 0x%02x but 0x%02x is closer", (double)x, q, q + 1);
        } else {
            MFT_CHECK_EQ_INT(q, 0x7e);
        }
        uint8_t n = mf_fp8_e4m3_from_float(-x);
        MFT_CHECK_MSG(n == (uint8_t)(q | 0x80), "%a -> 0x%02x but %a -> 0x%02x", (double)x, q,
                      (double)-x, n);
    }
    return 0;
}

static int test_bf16_all_patterns(void) {
    for (uint32_t h = 0; h < 65536; h++) {
        float f = mf_bf16_to_float((uint16_t)h);
        MFT_CHECK_MSG(bits_of(f) == h << 16, "bf16 0x%04x -> float bits 0x%08x", h, bits_of(f));
        uint16_t back = mf_bf16_from_float(f);
        int is_nan = (h & 0x7f80) == 0x7f80 && (h & 0x007f) != 0;
        if (is_nan) {
            MFT_CHECK_MSG((back & 0x7f80) == 0x7f80 && (back & 0x007f) != 0,
                          "NaN 0x%04x -> 0x%04x, not a NaN", h, back);
            MFT_CHECK_MSG((back & 0x8000) == (h & 0x8000), "NaN 0x%04x -> 0x%04x: sign", h, back);
        } else {
            MFT_CHECK_MSG(back == h, "bf16 0x%04x -> %a -> 0x%04x", h, (double)f, back);
        }
    }
    /* NaNs whose payload lives only in the low half must not turn into infinities. */
    const uint32_t nans[] = {0x7f800001u, 0xff800001u, 0x7f80ffffu, 0x7fc00000u};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        uint16_t b = mf_bf16_from_float(float_of(nans[i]));
        MFT_CHECK_MSG((b & 0x7f80) == 0x7f80 && (b & 0x007f) != 0, "NaN 0x%08x -> 0x%04x",
                      nans[i], b);
    }
    return 0;
}

/* For every finite bf16 h: h + exactly half an ulp goes to the even of (h, h + 1); a hair more
 * goes up; a hair less stays. Crossing into the exponent above (and to inf past the max) is RNE. */
static int test_bf16_rne_ties(void) {
    for (uint32_t h = 0; h < 65536; h++) {
        if ((h & 0x7f80) == 0x7f80) continue; /* inf / NaN */
        uint32_t base = h << 16;
        uint16_t up = (uint16_t)(h + 1), even = (h & 1) ? up : (uint16_t)h;
        uint16_t got = mf_bf16_from_float(float_of(base | 0x8000u));
        MFT_CHECK_MSG(got == even, "tie 0x%08x -> 0x%04x, expected 0x%04x", base | 0x8000u, got,
                      even);
        got = mf_bf16_from_float(float_of(base | 0x8001u));
        MFT_CHECK_MSG(got == up, "0x%08x -> 0x%04x, expected 0x%04x", base | 0x8001u, got, up);
        got = mf_bf16_from_float(float_of(base | 0x7fffu));
        MFT_CHECK_MSG(got == h, "0x%08x -> 0x%04x, expected 0x%04x", base | 0x7fffu, got, h);
    }
    MFT_CHECK_EQ_INT(mf_bf16_from_float(INFINITY), 0x7f80);
    MFT_CHECK_EQ_INT(mf_bf16_from_float(-INFINITY), 0xff80);
    MFT_CHECK_EQ_INT(mf_bf16_from_float(3.4028235e38f), 0x7f80); /* FLT_MAX rounds to inf */
    MFT_CHECK_EQ_INT(mf_bf16_from_float(1.0f), 0x3f80);
    MFT_CHECK_EQ_INT(mf_bf16_from_float(-2.0f), 0xc000);
    return 0;
}

const mft_test_t mft_tests_numerics[] = {
    {"numerics_fp8_all_codes", test_fp8_all_codes, 10},
    {"numerics_fp8_rne_ties", test_fp8_rne_ties, 10},
    {"numerics_fp8_saturation_nan", test_fp8_saturation_and_nan, 10},
    {"numerics_fp8_underflow", test_fp8_underflow, 10},
    {"numerics_fp8_monotone_nearest", test_fp8_monotone_nearest, 30},
    {"numerics_bf16_all_patterns", test_bf16_all_patterns, 10},
    {"numerics_bf16_rne_ties", test_bf16_rne_ties, 10},
    {NULL, NULL, 0},
};
