/*
 * params.c — the environment variables (core/params.h): their one table, and the only reads of
 * them in the library.
 */
#include <stdlib.h>

#include "core/params.h"

/* MF_TIMEOUT_MS   bound on every wait for a peer, in milliseconds (default 30000)
 * MF_DEBUG        1: report each distinct expert-GEMM decision once on stderr (default 0; debug.c)
 * MF_PDL          0: the CUDA backend launches its kernels without programmatic dependent launch
 *                 (default 1; cuda/pdl.cuh), for A/B measurements
 * MF_SMALL        0: the CUDA backend never runs the small-batch kernel (W13 and W2 in one launch,
 *                 kernels/sm90_small_gemm.cuh) and launches the two decode GEMMs instead; 1: it runs it
 *                 but keeps the sum kernel after it; 2: at R = 1 it sums too; 3: at R = 1 it also
 *                 plans for itself (no plan kernel); 4: a W2 unit that waits for its expert's W13
 *                 sends the next round's W2 weights into L2; 5: 4, and at R = 1 the idle warps of
 *                 the small kernel's producer warpgroup make its first unit's W13 rows from x;
 *                 above 5 reads as 5. Default (unset): 4 — 5 was measured slower (H200,
 *                 2026-12-05: +34.5 % at deepseek-v3 T = 1), and so were three switches since
 *                 removed (bench/NOTES.md). Set, it sets the switch for the process; for A/B
 *                 measurements
 * MF_DECODE_L2    1: the decode GEMMs send their weights into L2 a ring ahead of their loads
 *                 (kernels/sm90_decode_gemm.cuh, "L2 a ring ahead"; default 0); for A/B measurements
 * MF_DECODE_TOKENS the largest decode tile the GEMM choice may take, 8, 16, 32 or 64 (default) tokens
 *                 (cuda/grouped_gemm.cu mf__gemm_choose: the tile that holds most experts' rows; an
 *                 expert past it takes more tiles); other values read as 64; for A/B measurements
 * MF_TMA_TAILS    0: the CUDA backend's TMA GEMMs (more than 64 rows per expert) compute every tile
 *                 at 128 rows, an expert's tail of at most 64 rows included (default 1: in FP8 GEMMs
 *                 such a tail runs as a 64-row tile, the same bits); for A/B measurements */

/* The integer value of `name`, or `fallback` when it is unset, not an integer, or below `min`. */
static int64_t mf__env_int(const char *name, int64_t fallback, int64_t min) {
    const char *s = getenv(name);
    if (!s || !*s) return fallback;
    char *end = NULL;
    long long v = strtoll(s, &end, 10);
    return (end && *end == '\0' && v >= min) ? (int64_t)v : fallback;
}

int64_t mf__param_timeout_ms(void) { return mf__env_int("MF_TIMEOUT_MS", 30000, 1); }

int32_t mf__param_pdl(void) { return mf__env_int("MF_PDL", 1, 0) != 0; }

int32_t mf__param_debug(void) { return mf__env_int("MF_DEBUG", 0, 1) > 0; }

int32_t mf__param_decode_tokens(void) {
    const int64_t v = mf__env_int("MF_DECODE_TOKENS", 64, 8);
    return v == 8 || v == 16 || v == 32 ? (int32_t)v : 64;
}

int32_t mf__param_decode_l2(void) { return mf__env_int("MF_DECODE_L2", 0, 0) == 1; }

int32_t mf__param_small(void) {
    const int64_t v = mf__env_int("MF_SMALL", -1, 0);
    return v > 5 ? 5 : (int32_t)v;
}

int32_t mf__param_tma_tails(void) { return mf__env_int("MF_TMA_TAILS", 1, 0) != 0; }
