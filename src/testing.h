/*
 * testing.h — the library's test-and-bench interface: what the tools (tools/: `moeflow bench gemm`,
 * `moeflow bench --rebalance`) and the GEMM bound tests use beyond the public header, in one place,
 * so that a reader sees which internals they reach and why. Everything here is internal (`mf__`):
 * hidden in libmoeflow.so (src/moeflow.map exports the public API only), so its users link
 * libmoeflow.a, and it may change with the library; engines use include/moeflow.h alone.
 *
 *   internal                                  from               why
 *   the grouped GEMMs as plain C:             cuda/gemm_bench.h  `moeflow bench gemm` times one GEMM of
 *     mf__gemm_bench_run / _supported / _fill                    the layer alone (the public API runs the
 *                                                                whole layer) and fills operands too large
 *                                                                to draw on the host
 *   the GEMM choice: mf__gemm_bench_choose      cuda/gemm_bench.h  tests/test_gemm_bounds.c pins the decode
 *                                                                tile rule and when the small-batch kernel
 *                                                                runs (CUDA builds, no GPU needed)
 *   mf__gemm_small_counts                       cuda/gemm_bench.h  tests/gpu/test_cuda.c checks which of
 *                                                                the small kernel, its sum, its own
 *                                                                plan, its first rows and the two GEMMs
 *                                                                ran
 *   mf__gemm_bench_launches                     cuda/gemm_bench.h  tests/gpu/test_gemm_bounds.c checks that
 *                                                                the family it tests ran (a decline falls
 *                                                                back to the mma.sync kernels silently)
 *   mf__gemm_small_set_timeline                 cuda/gemm_bench.h  `moeflow bench layer --timeline`: the
 *                                                                small kernel's per-CTA stamps
 *   the GEMM element bounds: mf__gemm_ref_dot,  cuda/gemm_bench.h  `bench gemm --check` and
 *     mf__gemm_swiglu, mf__gemm_bound_*,                         tests/{,gpu/}test_gemm_bounds.c judge
 *     mf__gemm_fp8_scale_ok                                      each element by the same bound
 *   the exact numerics: mf__bf16_*, mf__fp8_*,  core/numerics.h    the --check reference rounds where the
 *     mf__fp8_block_scale, MF__FP8_MAX,                          kernels round (the FP8 block scale has no
 *     MF__FP8_AMAX_MIN, MF__QUANT_BLOCK                          public form; inline, per element)
 *   the staged-map schedule: mf__stage_*        balance/stage.h    `moeflow bench --rebalance` prints the
 *                                                                steps and bytes a stage takes
 *
 * Plain C, no CUDA types: streams are void * (cudaStream_t).
 */
#ifndef MF_TESTING_H
#define MF_TESTING_H

#include "moeflow.h"
#include "core/numerics.h"
#include "cuda/gemm_bench.h"
#include "balance/stage.h"

#endif /* MF_TESTING_H */
