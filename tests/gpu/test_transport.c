/*
 * test_transport.c (CUDA) — ranks as processes sharing the one GPU over the ipc transport (CUDA IPC
 * handles exchanged through the built-in rendezvous): y bit-identical to the same problem on
 * virtual ranks of one process (local transport).
 *
 * Without MPS the GPU time-slices between processes (a round trip of two processes spinning on each
 * other's flags took ~4.5 ms on the H200), so the cases are small and the peer timeout generous.
 * The ipc run goes first: the test process must not have touched CUDA when it forks the ranks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../harness.h"
#include "../problem.h"
#include "../ref.h"

#define IPC_TIMEOUT_MS 30000

static int ipc_case(int32_t R, int32_t dtype, int32_t layout, const int32_t *T_of_rank, int32_t dataflow,
                    uint64_t seed) {
    mfp_spec_t spec;
    memset(&spec, 0, sizeof spec);
    spec.R = R, spec.E = 4 * R, spec.K = 4, spec.H = 512, spec.I = 256, spec.S = 24, spec.T_per_rank = 24;
    spec.dtype = dtype, spec.layout = layout, spec.T_of_rank = T_of_rank, spec.routing = MFP_ROUTING_ZIPF;
    spec.zipf_s = 1.2, spec.drop_prob = 0.05, spec.seed = seed;
    mfp_problem_t p;
    MFT_CHECK(mfp_generate(&spec, &p) == 0);
    uint16_t *y_ipc[MF_MAX_RANKS], *y_local[MF_MAX_RANKS];
    for (int32_t r = 0; r < R; r++) {
        y_ipc[r] = mft_alloc((size_t)p.T[r] * spec.H * 2 + 2);
        y_local[r] = mft_alloc((size_t)p.T[r] * spec.H * 2 + 2);
    }
    mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
    o.backend = MF_BACKEND_CUDA;
    o.iters = 2;
    o.timeout_ms = IPC_TIMEOUT_MS;
    o.dataflow = dataflow;
    o.transport = MF_TRANSPORT_IPC;
    char err[512] = "";
    mf_result_t res = mfp_run(&p, &o, y_ipc, NULL, err, sizeof err);
    MFT_CHECK_MSG(res == MF_SUCCESS, "ipc (R = %d processes): %s", (int)R, err);
    o.transport = MF_TRANSPORT_LOCAL;
    res = mfp_run(&p, &o, y_local, NULL, err, sizeof err);
    MFT_CHECK_MSG(res == MF_SUCCESS, "local (R = %d threads): %s", (int)R, err);
    for (int32_t r = 0; r < R; r++) {
        const size_t bytes = (size_t)p.T[r] * spec.H * 2;
        MFT_CHECK_MSG(memcmp(y_ipc[r], y_local[r], bytes) == 0, "R %d %s %s: rank %d: ipc y differs from local y "
                      "(diff %.3g)", (int)R, dtype == MF_DTYPE_FP8_E4M3 ? "fp8" : "bf16",
                      layout == MF_LAYOUT_MASKED ? "masked" : "expert_major", (int)r,
                      mfref_diff_bf16(y_ipc[r], y_local[r], (int64_t)p.T[r] * spec.H));
        free(y_ipc[r]);
        free(y_local[r]);
    }
    mft_verbose("  R %d %s: ipc == local, bit for bit\n", (int)R, dtype == MF_DTYPE_FP8_E4M3 ? "fp8" : "bf16");
    mfp_free(&p);
    return 0;
}

static int cuda_ipc_bitwise(void) {
    static const int32_t uneven[4] = {24, 0, 7, 1};
    return ipc_case(2, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, NULL, MF_DATAFLOW_AUTO, 61) ||
           ipc_case(4, MF_DTYPE_BF16, MF_LAYOUT_MASKED, uneven, MF_DATAFLOW_PULL, 62) ||
           ipc_case(4, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, uneven, MF_DATAFLOW_UNFUSED, 63);
}

const mft_test_t mft_tests_cuda_transport[] = {
    {"cuda_ipc_bitwise", cuda_ipc_bitwise, 300},
    {NULL, NULL, 0},
};
