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

/* a / b rounded to nearest even: IEEE division everywhere. On the device it is computed without
 * div.rn.f32's called slow path (a call while wgmmas are in flight makes ptxas serialise every
 * wgmma of the kernel: docs/DESIGN.md "Numerics"): the reciprocal refined by one Newton step, then
 * one FMA correction of the quotient (div.rn's own fast path), with |b| >= 2^126 scaled by 1/4
 * first and the infinite and NaN cases selected explicitly. Its bits equal div.rn's wherever the
 * quotient is normal or zero and b is not subnormal; every use below is proved equal to IEEE
 * division over all 2^32 inputs by sm90_gemm_lab --selftest (`make test-gpu`). */
MF_HD float mf__div(float a, float b) {
#if defined(__CUDA_ARCH__)
    const float s = fabsf(b) >= 0x1p126f ? 0.25f : 1.0f; /* 1/b would be subnormal: exact rescale */
    const float as = a * s, bs = b * s;
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(bs));
    r = fmaf(fmaf(-bs, r, 1.0f), r, r);
    const float q0 = as * r;
    const float rem = fmaf(-bs, q0, as);
    const float q = rem == 0.0f ? q0 : fmaf(rem, r, q0); /* exact: q0 (keeps the sign of a zero) */
    if (q == q || a != a || b != b) return q; /* NaN only from the infinities below */
    const uint32_t sign = (__float_as_uint(a) ^ __float_as_uint(b)) & 0x80000000u;
    if (isinf(b)) return isinf(a) ? q : __uint_as_float(sign);               /* inf/inf: NaN; x/inf: +-0 */
    if (b == 0.0f) return a == 0.0f ? q : __uint_as_float(sign | 0x7f800000u); /* 0/0: NaN; x/0: +-inf */
    return q0; /* inf/finite, or a quotient past FLT_MAX: +-inf */
#else
    return a / b;
#endif
}

/* The scale of a block whose max |x| is `amax`, and the factor that maps x to FP8 range. */
MF_HD void mf__fp8_block_scale(float amax, int ue8m0, float *scale, float *inv_scale) {
    if (!(amax >= MF__FP8_AMAX_MIN)) amax = amax != amax ? amax : MF__FP8_AMAX_MIN;
    if (ue8m0) {
        uint32_t s = mf__float_bits(mf__div(amax, MF__FP8_MAX));
        if (s & 0x7fffffu) s = (s & 0xff800000u) + 0x800000u; /* round up to 2^ceil(log2) */
        *scale = mf__bits_float(s);
        *inv_scale = mf__div(1.0f, *scale);
    } else {
        *scale = mf__div(amax, MF__FP8_MAX);
        *inv_scale = mf__div(MF__FP8_MAX, amax);
    }
}

/* SwiGLU's activation in fp32: silu(g) = g / (1 + exp(-g)). */
MF_HD float mf__silu(float g) { return mf__div(g, 1.0f + expf(-g)); }

#endif /* MF_CORE_NUMERICS_H */
