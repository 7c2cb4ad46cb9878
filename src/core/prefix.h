/*
 * prefix.h — the search over a prefix sum that every tile walk uses (host and device, MF_HD): which
 * segment holds a position. The CUDA kernels' tables count each expert's work units as a prefix sum
 * first[] (kernels/sm90_core.cuh next_tile, kernels/sm90_small_gemm.cuh locate); their cursors find
 * a unit's expert here. Also the small kernel's W2 unit mapping built on it (mf__w2_unit), here so
 * that the CPU tests check it (tests/test_plan.c).
 */
#ifndef MF_CORE_PREFIX_H
#define MF_CORE_PREFIX_H

#include <stdint.h>

#include "core/numerics.h" /* MF_HD */

/* The segment of position g in the prefix sum first[0 .. n] (nondecreasing; first[s0] <= g <
 * first[n]), searched from the cursor s0: the largest s with first[s] <= g, so first[s] <= g <
 * first[s + 1]. Positions that ascend keep the cursor moving forward. One load when g lies in
 * s0's segment, two in the next, else a gallop then a binary search: about 2 log2(n) loads however
 * many empty segments (first[s] == first[s + 1]) lie between. A walk one segment at a time cost a
 * dependent shared-memory load (~40 cycles) per segment on the GPU: at a few tokens over hundreds
 * of experts, most without rows, several microseconds per walk (bench/NOTES.md "Issue 25: the
 * cursors' walk"). */
MF_HD int32_t mf__prefix_find(const int32_t *first, int32_t n, int32_t s0, int32_t g) {
    if (first[s0 + 1] > g) return s0;
    int32_t lo = s0 + 1, hi = n; /* first[lo] <= g < first[hi] */
    for (int32_t step = 1;; step *= 2) {
        const int32_t probe = lo + step;
        if (probe >= n) break;
        if (first[probe] > g) {
            hi = probe;
            break;
        }
        lo = probe;
    }
    while (hi - lo > 1) {
        const int32_t mid = lo + (hi - lo) / 2;
        if (first[mid] <= g) lo = mid;
        else hi = mid;
    }
    return lo;
}

/* The small kernel's W2 unit j (counted from its first W2 unit; kernels/sm90_small_gemm.cuh): 0 past
 * the last; else 1 with its expert *e, n-block *nb and token block *blk (token blocks inner).
 * first[0 .. n]: the experts' token blocks as a prefix sum; nb2 n-blocks per expert; the expert
 * searched from `cursor` (at most the answer: ascending j may pass the last *e back). */
MF_HD int mf__w2_unit(const int32_t *first, int32_t n, int32_t nb2, int32_t j, int32_t cursor, int32_t *e, int32_t *nb,
                      int32_t *blk) {
    if (j >= nb2 * first[n]) return 0;
    *e = mf__prefix_find(first, n, cursor, j / nb2); /* nb2 first[e + 1] <= j: first[e + 1] <= j / nb2 */
    const int32_t blocks = first[*e + 1] - first[*e], local = j - nb2 * first[*e];
    *blk = local % blocks;
    *nb = local / blocks;
    return 1;
}

#endif /* MF_CORE_PREFIX_H */
