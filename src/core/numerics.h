/*
 * numerics.h — the one definition of moeflow's number formats (docs/DESIGN.md "Numerics"), shared by the
 * CPU backend, the CUDA kernels (the functions are host+device inline) and the public helpers.
 *
 * FP8 is OCP E4M3 "fn": 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448; no infinities;
 * 0x7f / 0xff are NaN. float -> E4M3 rounds to nearest even and saturates to +-448 (infinities
 * too); NaN -> 0x7f | sign. BF16 is the top half of an fp32, rounded to nearest even.
 * Block quantisation: amax over the block in fp32, clamped below at MF__FP8_AMAX_MIN;
 * scale = amax / 448; q = e4m3(x * (448 / amax)) — IEEE division, no fast-math. With UE8M0 the
 * scale is rounded up to a power of two and q = e4m3(x * (1 / scale)).
 */
#ifndef MF_CORE_NUMERICS_H
#define MF_CORE_NUMERICS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define MF_HD __host__ __device__ __forceinline__
#else
#define MF_HD static inline
#endif

#define MF__FP8_MAX 448.0f
#define MF__FP8_AMAX_MIN 1e-4f
#define MF__QUANT_BLOCK 128 /* FP8 block edge: 1x128 activations, 128x128 weights */

MF_HD uint32_t mf__float_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

MF_HD float mf__bits_float(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* Shift `mant` right by `s` (1..31), rounding to nearest even. */
MF_HD uint32_t mf__shift_rne(uint32_t mant, int s) {
    uint32_t q = mant >> s;
    uint32_t rem = mant & ((1u << s) - 1u);
    uint32_t half = 1u << (s - 1);
    if (rem > half || (rem == half && (q & 1u))) q += 1u;
    return q;
}

MF_HD uint8_t mf__fp8_from_float(float x) {
    uint32_t u = mf__float_bits(x);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);         /* NaN */
    if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7eu);        /* >= 448 (inf too): saturate */
    int e = (int)(a >> 23) - 127;                                /* unbiased fp32 exponent */
    uint32_t mant = (a & 0x7fffffu) | (e > -127 ? 0x800000u : 0u); /* with the implicit bit */
    uint32_t q;
    if (e >= -6) {
        /* normal E4M3: keep 3 of 23 mantissa bits; a carry moves into the exponent field */
        q = ((uint32_t)(e + 7) << 3) + mf__shift_rne(mant & 0x7fffffu, 20);
        if (q > 0x7eu) q = 0x7eu;
    } else {
        /* subnormal E4M3, in units of 2^-9: mant * 2^(e - 23 + 9) */
        int s = 14 - e;
        q = s >= 32 ? 0u : mf__shift_rne(mant, s);
    }
    return (uint8_t)(sign | q);
}

MF_HD float mf__fp8_to_float(uint8_t c) {
    uint32_t sign = (uint32_t)(c & 0x80u) << 24;
    uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
    if (e == 15u && m == 7u) return mf__bits_float(sign | 0x7fc00000u);
    if (e == 0u) {
        float v = (float)m * 0.001953125f; /* m * 2^-9, exact */
        return sign ? -v : v;
    }
    return mf__bits_float(sign | ((e + 120u) << 23) | (m << 20));
}

MF_HD uint16_t mf__bf16_from_float(float x) {
    uint32_t u = mf__float_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

MF_HD float mf__bf16_to_float(uint16_t h) { return mf__bits_float((uint32_t)h << 16); }

/* The scale of a block whose max |x| is `amax`, and the factor that maps x to FP8 range. */
MF_HD void mf__fp8_block_scale(float amax, int ue8m0, float *scale, float *inv_scale) {
    if (!(amax >= MF__FP8_AMAX_MIN)) amax = amax != amax ? amax : MF__FP8_AMAX_MIN;
    if (ue8m0) {
        uint32_t s = mf__float_bits(amax / MF__FP8_MAX);
        if (s & 0x7fffffu) s = (s & 0xff800000u) + 0x800000u; /* round up to 2^ceil(log2) */
        *scale = mf__bits_float(s);
        *inv_scale = 1.0f / *scale;
    } else {
        *scale = amax / MF__FP8_MAX;
        *inv_scale = MF__FP8_MAX / amax;
    }
}

/* SwiGLU's activation in fp32: silu(g) = g / (1 + exp(-g)). */
MF_HD float mf__silu(float g) { return g / (1.0f + expf(-g)); }

#endif /* MF_CORE_NUMERICS_H */
