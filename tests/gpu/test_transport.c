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

typedef struct ipc_case {
    int32_t R, dtype, layout, dataflow;
    const int32_t *T_of_rank;
    uint64_t seed;
    mfp_problem_t p;
    uint16_t *y_ipc[MF_MAX_RANKS], *y_local[MF_MAX_RANKS];
} ipc_case_t;

static mf_result_t run_case(ipc_case_t *c, int32_t transport, char *err, int errlen) {
    mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
    o.backend = MF_BACKEND_CUDA;
    o.iters = 2;
    o.timeout_ms = IPC_TIMEOUT_MS;
    o.dataflow = c->dataflow;
    o.transport = transport;
    return mfp_run(&c->p, &o, transport == MF_TRANSPORT_IPC ? c->y_ipc : c->y_local, NULL, err, errlen);
}

/* Every case's ipc run first (this process must not touch CUDA before it forks rank processes),
 * then every local run, then the comparison. */
static int cuda_ipc_bitwise(void) {
    static const int32_t uneven[4] = {24, 0, 7, 1};
    ipc_case_t cases[3];
    memset(cases, 0, sizeof cases);
    cases[0].R = 2, cases[0].dtype = MF_DTYPE_FP8_E4M3, cases[0].layout = MF_LAYOUT_EXPERT_MAJOR;
    cases[0].dataflow = MF_DATAFLOW_AUTO, cases[0].seed = 61;
    cases[1].R = 4, cases[1].dtype = MF_DTYPE_BF16, cases[1].layout = MF_LAYOUT_MASKED;
    cases[1].dataflow = MF_DATAFLOW_PULL, cases[1].T_of_rank = uneven, cases[1].seed = 62;
    cases[2].R = 4, cases[2].dtype = MF_DTYPE_FP8_E4M3, cases[2].layout = MF_LAYOUT_MASKED;
    cases[2].dataflow = MF_DATAFLOW_UNFUSED, cases[2].T_of_rank = uneven, cases[2].seed = 63;
    const int n = (int)(sizeof cases / sizeof cases[0]);
    char err[512] = "";
    for (int i = 0; i < n; i++) {
        ipc_case_t *c = &cases[i];
        mfp_spec_t spec;
        memset(&spec, 0, sizeof spec);
        spec.R = c->R, spec.E = 4 * c->R, spec.K = 4, spec.H = 512, spec.I = 256, spec.S = 24, spec.T_per_rank = 24;
        spec.dtype = c->dtype, spec.layout = c->layout, spec.T_of_rank = c->T_of_rank;
        spec.routing = MFP_ROUTING_ZIPF, spec.zipf_s = 1.2, spec.drop_prob = 0.05, spec.seed = c->seed;
        MFT_CHECK(mfp_generate(&spec, &c->p) == 0);
        for (int32_t r = 0; r < c->R; r++) {
            c->y_ipc[r] = mft_alloc((size_t)c->p.T[r] * spec.H * 2 + 2);
            c->y_local[r] = mft_alloc((size_t)c->p.T[r] * spec.H * 2 + 2);
        }
        MFT_CHECK_MSG(run_case(c, MF_TRANSPORT_IPC, err, sizeof err) == MF_SUCCESS, "case %d: ipc (R = %d processes): %s",
                      i, (int)c->R, err);
    }
    for (int i = 0; i < n; i++) {
        ipc_case_t *c = &cases[i];
        MFT_CHECK_MSG(run_case(c, MF_TRANSPORT_LOCAL, err, sizeof err) == MF_SUCCESS, "case %d: local (R = %d threads): %s",
                      i, (int)c->R, err);
        for (int32_t r = 0; r < c->R; r++) {
            const int64_t n_el = (int64_t)c->p.T[r] * c->p.spec.H;
            MFT_CHECK_MSG(memcmp(c->y_ipc[r], c->y_local[r], (size_t)n_el * 2) == 0,
                          "case %d (R %d): rank %d: ipc y differs from local y (diff %.3g)", i, (int)c->R, (int)r,
                          mfref_diff_bf16(c->y_ipc[r], c->y_local[r], n_el));
            free(c->y_ipc[r]);
            free(c->y_local[r]);
        }
        mft_verbose("  case %d: R %d: ipc == local, bit for bit\n", i, (int)c->R);
        mfp_free(&c->p);
    }
    return 0;
}

const mft_test_t mft_tests_cuda_transport[] = {
    {"cuda_ipc_bitwise", cuda_ipc_bitwise, 300},
    {NULL, NULL, 0},
};
