/*
 * test_balance.c (gpu) — balanced EP on the CUDA backend (docs/DESIGN.md "Balanced EP"):
 *   cuda_balance_pick      the planner of src/balance/planner.h in a CUDA kernel gives the host's
 *                          spare table bit for bit (random counts, maps with replicas, residents);
 *   cuda_balance_bitwise   tests/test_balance.c's layer cases on CUDA (virtual ranks R = 1, 2, 4, 8,
 *                          both dtypes and layouts, DIRECT / PULL / UNFUSED pinned): any map and any
 *                          spare slots give y bit-identical to the same CUDA layer without replicas;
 *                          the plain CUDA layer is within the contract's bounds of the CPU backend;
 *                          and the device's balance stats (rows per rank with and without replicas,
 *                          bytes pushed by the first and last prefetch, slots resident) equal the CPU
 *                          backend's exactly (the same planner on the same counts);
 *   cuda_balance_graph     the forward captured in a CUDA graph and replayed with routing redrawn every
 *                          iteration, mf_moe_prefetch between replays: y of every iteration (digests)
 *                          equals the plain layer's, and the eager balanced layer's;
 *   cuda_balance_capture   prefetch + forward captured together in one graph per rank and replayed with
 *                          changing routing: y equals the plain layer's every time;
 *   cuda_balance_disagree  ranks that set different maps, or prefetch a different number of times,
 *                          fail the call on every rank (INVALID_USAGE, y untouched) and recover once
 *                          they agree; bad maps are rejected with nothing changed;
 *   cuda_balance_stage     mf_moe_stage_expert_map on virtual ranks (R 2, 4, 8; both dtypes; B 0 and
 *                          2; 1, 2 or all experts per step), routing redrawn every call: y of every
 *                          call equals the plain CUDA layer's bit for bit, while staging (old map) and
 *                          after the switch (new map); next_weights equal the experts byte for byte
 *                          (mfp_run checks); steps, forwards while staging and bytes equal the CPU's;
 *   cuda_balance_stage_ipc the same with ranks as processes (CUDA IPC pushes; one or more GPUs);
 *   cuda_placement_bitwise uneven LINEAR and ROUND_ROBIN layers (every dataflow, both dtypes and
 *                          layouts, E = 3..128, the decode and the TMA GEMMs): linear = round robin
 *                          = the same tokens on one rank, bit for bit; within bounds of the CPU; the
 *                          rows each rank computed equal the CPU's;
 *   cuda_placement_comm    mf_dispatch + mf_combine on placed layers and on layers with an expert map
 *                          (B = 0): the dispatch outputs and y equal the CPU backend's call by call,
 *                          and y the plain layer's.
 * Every failure names the case (R, dtype, layout, dataflow, P, B) and, for y, the first differing
 * element, so one GPU run tells where a misroute is.
 */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../harness.h"
#include "balance/planner.h"
#include "balance/prefetch.h"
#include "balance/stage.h"
#include "cuda_test.h"
#include "plan/placement.h"
#include "problem.h"
#include "ref.h"

enum { MAXE = 384, MAXR = 8, MAXB = 4, MAXP = MAXE + MAXR * 4 };

static int pick_case(mft_rng_t *rng, int32_t E, int32_t R, int32_t P, int32_t B, int skew) {
    int32_t counts[MAXE], map[MAXP], resident[MAXR * MAXB], host[MAXR * MAXB], dev_out[MAXR * MAXB];
    int32_t rep_off[MAXE + 1], rep_rank[MAXP + MAXR * MAXB], rep_slot[MAXP + MAXR * MAXB];
    int32_t share[MAXP + MAXR * MAXB], scratch[MAXE + MAXR * MAXB];
    int64_t load[MAXR];
    for (int32_t e = 0; e < E; e++)
        counts[e] = skew ? (int32_t)(4096.0 / (1.0 + mft_rng_int(rng, E))) : 10 + mft_rng_int(rng, 20);
    for (int32_t p = 0; p < P; p++) map[p] = p < E ? p : mft_rng_int(rng, E);
    for (int32_t i = 0; i < R * B; i++) resident[i] = mft_rng_int(rng, 3) ? -1 : mft_rng_int(rng, E);
    mf__balance_pick(E, R, P, B, counts, map, resident, host, rep_off, rep_rank, rep_slot, share, load, scratch);

    int32_t *d_counts, *d_map, *d_res, *d_spare, *d_scratch;
    const int64_t words = mf__balance_scratch_words(E, R, P, B);
    CUDA_OK(cudaMalloc((void **)&d_counts, sizeof counts));
    CUDA_OK(cudaMalloc((void **)&d_map, sizeof map));
    CUDA_OK(cudaMalloc((void **)&d_res, sizeof resident));
    CUDA_OK(cudaMalloc((void **)&d_spare, sizeof dev_out));
    CUDA_OK(cudaMalloc((void **)&d_scratch, (size_t)words * sizeof(int32_t)));
    CUDA_OK(cudaMemcpy(d_counts, counts, sizeof counts, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_map, map, sizeof map, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_res, resident, sizeof resident, cudaMemcpyHostToDevice));
    mf__balance_pick_params_t prm = {E, R, P, B, d_counts, d_map, d_res, d_spare, d_scratch};
    MFT_CHECK_OK(mf__cuda_balance_pick(&prm, NULL));
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(dev_out, d_spare, (size_t)R * B * sizeof(int32_t), cudaMemcpyDeviceToHost));
    cudaFree(d_counts), cudaFree(d_map), cudaFree(d_res), cudaFree(d_spare), cudaFree(d_scratch);
    for (int32_t i = 0; i < R * B; i++)
        MFT_CHECK_MSG(dev_out[i] == host[i], "E %d R %d P %d B %d: spare[%d] device %d, host %d", (int)E, (int)R,
                      (int)P, (int)B, (int)i, (int)dev_out[i], (int)host[i]);
    return 0;
}

static int cuda_balance_pick(void) {
    mft_rng_t rng = {0xb4};
    static const int32_t shapes[][4] = {{256, 8, 256, 2}, {256, 8, 288, 2}, {384, 8, 384, 4}, {16, 4, 20, 1},
                                        {8, 2, 8, 3}, {64, 1, 64, 2}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int skew = 0; skew < 2; skew++)
            if (pick_case(&rng, shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3], skew)) return 1;
    return 0;
}


/* mf__balance_plan_par on the device (one block, shared memory, atomics) == the same code as plain
 * loops on the host (which tests/test_balance.c holds equal to the serial planner), over random
 * plans: slot tables, capacity verdicts, loads, home loads; a quarter of them over a placement's
 * slot grid (E not a multiple of R, round robin: empty slots, -1). */
static int cuda_balance_plan_par(void) {
    enum { MAXN = MAXP + MAXR * MAXB, MAXL = MAXP + MAXB };
    static int32_t counts[MAXE], map[MAXP], spare[MAXR * MAXB + 1], cs[MAXE], cp[MAXE], off[MAXE + 1], rk[MAXN], sl[MAXN],
        sh[MAXN], order[MAXE], small[4], over[MAXR], hc[MAXL], hb[MAXL], he[MAXL], dc[MAXL], db[MAXL], de[MAXL], dv[2];
    static int64_t load[MAXR], home[MAXR], rows[MAXR], dload[MAXR], dhome[MAXR];
    int32_t *d_map, *d_spare, *d_counts, *d_c, *d_b, *d_e, *d_v;
    int64_t *d_load, *d_home;
    CUDA_OK(cudaMalloc((void **)&d_map, sizeof map));
    CUDA_OK(cudaMalloc((void **)&d_spare, sizeof spare));
    CUDA_OK(cudaMalloc((void **)&d_counts, sizeof counts));
    CUDA_OK(cudaMalloc((void **)&d_c, sizeof dc));
    CUDA_OK(cudaMalloc((void **)&d_b, sizeof db));
    CUDA_OK(cudaMalloc((void **)&d_e, sizeof de));
    CUDA_OK(cudaMalloc((void **)&d_v, sizeof dv));
    CUDA_OK(cudaMalloc((void **)&d_load, sizeof dload));
    CUDA_OK(cudaMalloc((void **)&d_home, sizeof dhome));
    mft_rng_t rng = {0x9a7b};
    for (int32_t it = 0; it < 400; it++) {
        const int32_t grid = it % 4 == 3, placement = grid ? mft_rng_int(&rng, 2) : MF_PLACEMENT_LINEAR;
        const int32_t R = 1 + mft_rng_int(&rng, MAXR);
        const int32_t E = grid ? R + mft_rng_int(&rng, 256 - R) : R * (1 + mft_rng_int(&rng, 256 / R));
        const int32_t Ls = mf__placement_slots(E, R);
        const int32_t P = grid ? R * Ls : E + R * mft_rng_int(&rng, 5), B = grid ? 0 : mft_rng_int(&rng, MAXB + 1);
        const int32_t L = P / R + B;
        const int32_t masked = mft_rng_int(&rng, 2), block_m = 1 << mft_rng_int(&rng, 8), me = mft_rng_int(&rng, R);
        for (int32_t e = 0; e < E; e++)
            counts[e] = mft_rng_int(&rng, 2) ? (int32_t)(4096.0 / (1.0 + mft_rng_int(&rng, E))) : mft_rng_int(&rng, 50);
        for (int32_t p = 0; p < P; p++)
            map[p] = grid ? mf__placement_expert(E, R, placement, p / Ls, p % Ls) : p < E ? p : mft_rng_int(&rng, E);
        for (int32_t p = P - 1; p > 0 && !grid; p--) {
            int32_t j = mft_rng_int(&rng, p + 1), t = map[p];
            map[p] = map[j], map[j] = t;
        }
        for (int32_t i = 0; i < R * B; i++) spare[i] = mft_rng_int(&rng, 2) ? -1 : mft_rng_int(&rng, E);
        const int32_t capacity = 1 + mft_rng_int(&rng, 3000), max_rows = mft_rng_int(&rng, 20000);
        mf__balance_ws_t ws = {cs, cp, off, rk, sl, sh, order, small, over, load, home, rows};
        mf__balance_plan_par(E, R, P, B, placement, me, masked, block_m, capacity, max_rows, map, spare, counts, &ws, hc,
                             hb, he);
        CUDA_OK(cudaMemcpy(d_map, map, (size_t)P * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(d_spare, spare, (size_t)(R * B + 1) * 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(d_counts, counts, (size_t)E * 4, cudaMemcpyHostToDevice));
        MFT_CHECK_OK(mf__cuda_plan_par_test(E, R, P, B, placement, me, masked, block_m, capacity, max_rows, d_map, d_spare,
                                            d_counts, d_c, d_b, d_e, d_v, d_load, d_home, NULL));
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(dc, d_c, (size_t)L * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(db, d_b, (size_t)L * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(de, d_e, (size_t)L * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(dv, d_v, sizeof dv, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(dload, d_load, (size_t)R * 8, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(dhome, d_home, (size_t)R * 8, cudaMemcpyDeviceToHost));
        const char *fmt = "case %d (E %d R %d P %d B %d masked %d me %d): %s";
        MFT_CHECK_MSG(dv[0] == small[1] && (!masked || dv[1] == small[2]), fmt, (int)it, (int)E, (int)R, (int)P, (int)B,
                      (int)masked, (int)me, "capacity verdict differs");
        for (int32_t r = 0; r < R; r++)
            MFT_CHECK_MSG(dload[r] == load[r] && dhome[r] == home[r], fmt, (int)it, (int)E, (int)R, (int)P, (int)B,
                          (int)masked, (int)me, "rows per rank (with or without replicas) differ");
        for (int32_t s2 = 0; s2 < L; s2++)
            MFT_CHECK_MSG(dc[s2] == hc[s2] && db[s2] == hb[s2] && de[s2] == he[s2], fmt, (int)it, (int)E, (int)R, (int)P,
                          (int)B, (int)masked, (int)me, "a slot's count, begin or expert differs");
    }
    cudaFree(d_map), cudaFree(d_spare), cudaFree(d_counts), cudaFree(d_c), cudaFree(d_b), cudaFree(d_e), cudaFree(d_v);
    cudaFree(d_load), cudaFree(d_home);
    mft_verbose("  400 random plans (100 over placement grids): the device's block-parallel plan equals the host's\n");
    return 0;
}

/* ---- layers through the public API ---------------------------------------------------------- */

#define BAL_BIG_TIMEOUT_MS 20000

static int64_t bal_timeout_ms(void) {
    const char *env = getenv("MFT_PEER_TIMEOUT_MS");
    long long v = env ? atoll(env) : 0;
    return v > 0 ? (int64_t)v : BAL_BIG_TIMEOUT_MS;
}

static const char *flow_name(int32_t f) {
    return f == MF_DATAFLOW_DIRECT ? "direct" : f == MF_DATAFLOW_PULL ? "pull" : f == MF_DATAFLOW_UNFUSED ? "unfused" : "auto";
}

/* y[r] == want[r] bit for bit on every rank, else the first differing element. */
static int same_y(const char *label, const mfp_problem_t *p, uint16_t *const *got, uint16_t *const *want) {
    const int64_t H = p->spec.H;
    for (int32_t r = 0; r < p->spec.R; r++) {
        const int64_t n = (int64_t)p->T[r] * H;
        for (int64_t i = 0; i < n; i++)
            if (got[r][i] != want[r][i])
                MFT_FAIL("%s: rank %d: y[t=%lld, h=%lld] = 0x%04x (%g), without replicas 0x%04x (%g)", label, (int)r,
                         (long long)(i / H), (long long)(i % H), got[r][i], mf_bf16_to_float(got[r][i]), want[r][i],
                         mf_bf16_to_float(want[r][i]));
    }
    return 0;
}

/* got within the contract's bounds of want (the CPU backend), per rank. */
static int close_y(const char *label, const mfp_problem_t *p, uint16_t *const *got, uint16_t *const *want) {
    const int fp8 = p->spec.dtype == MF_DTYPE_FP8_E4M3;
    const double atol = fp8 ? MFREF_ATOL_FP8 : MFREF_ATOL_BF16, rtol = fp8 ? MFREF_RTOL_FP8 : MFREF_RTOL_BF16;
    const double dmax = fp8 ? MFREF_DIFF_MAX_FP8 : MFREF_DIFF_MAX_BF16;
    const int64_t H = p->spec.H;
    for (int32_t r = 0; r < p->spec.R; r++) {
        int64_t n = (int64_t)p->T[r] * H, first = -1;
        double max_err = 0, d = mfref_diff_bf16(got[r], want[r], n);
        int64_t wrong = mfref_count_wrong_bf16(got[r], want[r], n, atol, rtol, &first, &max_err);
        if (wrong)
            MFT_FAIL("%s: rank %d: %lld of %lld values outside bounds vs cpu; first y[t=%lld, h=%lld] = %g, cpu %g", label,
                     (int)r, (long long)wrong, (long long)n, (long long)(first / H), (long long)(first % H),
                     mf_bf16_to_float(got[r][first]), mf_bf16_to_float(want[r][first]));
        if (!(d < dmax)) MFT_FAIL("%s: rank %d: diff vs cpu %.3g >= %.0e", label, (int)r, d, dmax);
    }
    return 0;
}

typedef struct bal_case {
    int32_t R, dtype, layout, routing, flow, extra, B, T, E, K;
    uint64_t seed;
} bal_case_t;

static int bal_problem(const bal_case_t *c, mfp_problem_t *p) {
    mfp_spec_t s;
    memset(&s, 0, sizeof s);
    s.R = c->R, s.E = c->E ? c->E : 4 * c->R, s.K = c->K ? c->K : 3, s.H = 256, s.I = 256;
    s.S = c->T, s.T_per_rank = c->T;
    s.dtype = c->dtype, s.layout = c->layout, s.routing = c->routing, s.zipf_s = 1.2, s.hot_expert = 1, s.seed = c->seed;
    return mfp_generate(&s, p);
}

static void bal_label(const bal_case_t *c, int32_t P, char *label, size_t n) {
    snprintf(label, n, "R=%d E=%d T=%d %s %s %s routing %d P=%d B=%d", (int)c->R, (int)(c->E ? c->E : 4 * c->R),
             (int)c->T, c->dtype == MF_DTYPE_FP8_E4M3 ? "fp8" : "bf16",
             c->layout == MF_LAYOUT_MASKED ? "masked" : "expert_major", flow_name(c->flow), (int)c->routing, (int)P,
             (int)c->B);
}

static uint16_t **alloc_ys(const mfp_problem_t *p, uint16_t **y) {
    for (int32_t r = 0; r < p->spec.R; r++) {
        y[r] = mft_alloc((size_t)p->T[r] * p->spec.H * 2 + 2);
        mft_poison(y[r], (size_t)p->T[r] * p->spec.H * 2);
    }
    return y;
}

static void free_ys(const mfp_problem_t *p, uint16_t **y) {
    for (int32_t r = 0; r < p->spec.R; r++) free(y[r]);
}

/* One case: plain CUDA (the dataflow pinned) vs balanced CUDA bit for bit; plain CUDA vs CPU within
 * bounds; the balance stats of CUDA and CPU (same map, B, iterations) equal. */
static int bitwise_case(const bal_case_t *c) {
    mfp_problem_t p;
    MFT_CHECK(bal_problem(c, &p) == 0);
    const int32_t E = p.spec.E, P = E + c->extra * c->R;
    int32_t map[1024];
    mft_random_map(E, P, 7000 + c->seed, map);
    char label[256], err[512] = "";
    bal_label(c, P, label, sizeof label);
    uint16_t *y0[MF_MAX_RANKS], *y1[MF_MAX_RANKS], *yc[MF_MAX_RANKS], *yc1[MF_MAX_RANKS];
    alloc_ys(&p, y0), alloc_ys(&p, y1), alloc_ys(&p, yc), alloc_ys(&p, yc1);
    mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
    o.backend = MF_BACKEND_CUDA, o.iters = 1, o.timeout_ms = bal_timeout_ms(), o.dataflow = c->flow;
    mf_result_t res = mfp_run(&p, &o, y0, NULL, err, sizeof err);
    MFT_CHECK_MSG(res == MF_SUCCESS, "%s: plain cuda: %s", label, err);
    mfp_run_opts_t ob = o;
    ob.iters = 3; /* forward, prefetch, forward (spares in use), prefetch (steady), forward */
    ob.expert_map = c->extra || (c->seed & 1) ? map : NULL;
    ob.num_physical = ob.expert_map ? P : 0;
    ob.spare_slots = c->B;
    ob.prefetch = c->B > 0;
    mfp_timing_t tg, tc;
    memset(&tg, 0, sizeof tg), memset(&tc, 0, sizeof tc);
    res = mfp_run(&p, &ob, y1, &tg, err, sizeof err);
    MFT_CHECK_MSG(res == MF_SUCCESS, "%s: balanced cuda: %s", label, err);
    /* The CPU backend: the plain layer within bounds; the same balancing, the same stats (checked
     * first: a plan that differs from the CPU's names itself before y does). */
    mfp_run_opts_t oc = MFP_RUN_OPTS_INIT;
    oc.backend = MF_BACKEND_CPU, oc.iters = 1, oc.timeout_ms = bal_timeout_ms();
    res = mfp_run(&p, &oc, yc, NULL, err, sizeof err);
    MFT_CHECK_MSG(res == MF_SUCCESS, "%s: cpu: %s", label, err);
    mfp_run_opts_t ocb = ob;
    ocb.backend = MF_BACKEND_CPU, ocb.dataflow = MF_DATAFLOW_AUTO;
    res = mfp_run(&p, &ocb, yc1, &tc, err, sizeof err);
    MFT_CHECK_MSG(res == MF_SUCCESS, "%s: balanced cpu: %s", label, err);
    MFT_CHECK_MSG(tg.have_balance && tc.have_balance, "%s: no balance stats (cuda %d, cpu %d)", label,
                  (int)tg.have_balance, (int)tc.have_balance);
    for (int32_t r = 0; r < c->R; r++)
        MFT_CHECK_MSG(tg.balance.recv_rows[r] == tc.balance.recv_rows[r] &&
                          tg.balance.home_rows[r] == tc.balance.home_rows[r],
                      "%s: rank %d computed %lld rows on cuda, %lld on cpu (home %lld / %lld): the device plan differs",
                      label, (int)r, (long long)tg.balance.recv_rows[r], (long long)tc.balance.recv_rows[r],
                      (long long)tg.balance.home_rows[r], (long long)tc.balance.home_rows[r]);
    MFT_CHECK_MSG(tg.prefetch_first_bytes == tc.prefetch_first_bytes && tg.prefetch_last_bytes == tc.prefetch_last_bytes &&
                      tg.balance.spare_resident == tc.balance.spare_resident,
                  "%s: prefetch moved %lld then %lld bytes (%d resident) on cuda, %lld then %lld (%d) on cpu", label,
                  (long long)tg.prefetch_first_bytes, (long long)tg.prefetch_last_bytes, (int)tg.balance.spare_resident,
                  (long long)tc.prefetch_first_bytes, (long long)tc.prefetch_last_bytes, (int)tc.balance.spare_resident);
    if (same_y(label, &p, y1, y0)) {
        mft_verbose("  %s: the device plan equals the CPU's (rows per rank, bytes, residents): the expert compute "
                    "or the spare weights differ\n", label);
        return 1;
    }
    if (close_y(label, &p, y0, yc)) return 1;
    const int64_t before = mft_max_i64(tg.balance.home_rows, c->R), after = mft_max_i64(tg.balance.recv_rows, c->R);
    mft_verbose("  %s: busiest rank %lld -> %lld rows; moved %lld then %lld bytes; %d resident; bitwise ok\n", label,
                (long long)before, (long long)after, (long long)tg.prefetch_first_bytes,
                (long long)tg.prefetch_last_bytes, (int)tg.balance.spare_resident);
    /* (Whether the pick adds spares depends on the map's replicas: the stats equal the CPU's above.) */
    MFT_CHECK_MSG(after <= before, "%s: balancing made the busiest rank heavier (%lld -> %lld rows)", label,
                  (long long)before, (long long)after);
    if ((c->B > 0 || c->extra > 0) && c->routing == MFP_ROUTING_HOT && c->R > 1)
        MFT_CHECK_MSG(after < before, "%s: hot routing: the busiest rank is not lighter (%lld rows)", label,
                      (long long)after);
    if (c->B > 0) MFT_CHECK_MSG(tg.prefetch_last_bytes == 0, "%s: a steady routing moved %lld bytes", label,
                                (long long)tg.prefetch_last_bytes);
    free_ys(&p, y0), free_ys(&p, y1), free_ys(&p, yc), free_ys(&p, yc1);
    mfp_free(&p);
    return 0;
}

static int bitwise_cases(size_t first, size_t count);

static int cuda_balance_bitwise(void) { return bitwise_cases(0, 100); }

/* The same with the balanced plan's serial variant (thread 0 runs the CPU's functions), a subset. */
static int cuda_balance_bitwise_serial(void) {
    mf__cuda_plan_serial = 1;
    return bitwise_cases(2, 6);
}

static int bitwise_cases(size_t first, size_t count) {
    const int32_t BF = MF_DTYPE_BF16, F8 = MF_DTYPE_FP8_E4M3, EM = MF_LAYOUT_EXPERT_MAJOR, MA = MF_LAYOUT_MASKED;
    const int32_t DI = MF_DATAFLOW_DIRECT, PU = MF_DATAFLOW_PULL, UN = MF_DATAFLOW_UNFUSED;
    const int32_t UNI = MFP_ROUTING_UNIFORM, HOT = MFP_ROUTING_HOT, ZIPF = MFP_ROUTING_ZIPF;
    static bal_case_t cases[] = {
        /* R, dtype, layout, routing, flow, extra slots per rank, B, T, E, K, seed */
        {1, BF, EM, HOT, PU, 0, 2, 12, 0, 0, 1},     /* R = 1: spare slots of the only rank */
        {1, F8, MA, UNI, DI, 1, 0, 12, 0, 0, 2},     /* a map with replicas, no spares */
        {2, BF, EM, UNI, PU, 0, 0, 12, 0, 0, 3},     /* a permutation only */
        {2, F8, MA, HOT, DI, 1, 1, 12, 0, 0, 4},
        {2, BF, EM, HOT, UN, 2, 2, 12, 0, 0, 5},
        {4, F8, EM, ZIPF, PU, 2, 0, 12, 0, 0, 6},
        {4, BF, MA, HOT, PU, 0, 2, 12, 0, 0, 7},
        {4, F8, MA, HOT, UN, 1, 2, 12, 0, 0, 8},
        {4, F8, EM, ZIPF, DI, 0, 2, 12, 0, 0, 9},
        {8, BF, EM, HOT, PU, 3, 2, 12, 0, 0, 10},
        {8, F8, EM, ZIPF, DI, 1, 2, 12, 0, 0, 11},
        {8, F8, MA, HOT, UN, 0, 3, 12, 0, 0, 12},
        /* rows past one TMA tile per slot (T K R / E > kMfDecodeMaxRows): the TMA GEMM twice */
        {4, F8, EM, HOT, PU, 1, 2, 256, 16, 8, 13},
        {8, BF, MA, ZIPF, PU, 0, 2, 192, 16, 6, 14},
    };
    int failed = 0; /* every case runs, so that one GPU run shows every failing one */
    for (size_t i = first; i < sizeof cases / sizeof cases[0] && i < first + count; i++)
        if (bitwise_case(&cases[i])) failed++, mft_fail(__FILE__, __LINE__, "bitwise case %zu failed", i);
    return failed ? mft_fail(__FILE__, __LINE__, "%d of %zu bitwise cases failed", failed, sizeof cases / sizeof cases[0])
                  : 0;
}

/* The forward in a CUDA graph, replayed with the routing redrawn every iteration, prefetch between
 * replays: y of every iteration equals the plain layer's (digests), and the eager balanced run's. */
static int graph_case(const bal_case_t *c) {
    mfp_problem_t p;
    MFT_CHECK(bal_problem(c, &p) == 0);
    const int32_t E = p.spec.E, P = E + c->extra * c->R, iters = 5;
    int32_t map[1024];
    mft_random_map(E, P, 8000 + c->seed, map);
    char label[256], err[512] = "";
    bal_label(c, P, label, sizeof label);
    uint16_t *y[3][MF_MAX_RANKS];
    uint64_t *dig[3];
    for (int k = 0; k < 3; k++) {
        alloc_ys(&p, y[k]);
        dig[k] = mft_alloc((size_t)c->R * iters * 2 * sizeof(uint64_t));
        memset(dig[k], 0, (size_t)c->R * iters * 2 * sizeof(uint64_t));
    }
    for (int k = 0; k < 3; k++) { /* 0: plain graph; 1: balanced graph; 2: balanced eager */
        mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
        o.backend = MF_BACKEND_CUDA, o.iters = iters, o.timeout_ms = bal_timeout_ms(), o.dataflow = c->flow;
        o.graph = k < 2, o.redraw = 1, o.redraw_seed = 100 + c->seed, o.digests = dig[k];
        if (k > 0) o.expert_map = map, o.num_physical = P, o.spare_slots = c->B, o.prefetch = c->B > 0;
        mf_result_t res = mfp_run(&p, &o, y[k], NULL, err, sizeof err);
        MFT_CHECK_MSG(res == MF_SUCCESS, "%s: run %d (%s): %s", label, k,
                      k == 0 ? "plain graph" : k == 1 ? "balanced graph" : "balanced eager", err);
    }
    for (int32_t r = 0; r < c->R; r++)
        for (int32_t it = 0; it < iters; it++) {
            const size_t at = ((size_t)r * iters + it) * 2 + 1;
            MFT_CHECK_MSG(dig[0][at] == dig[1][at] && dig[1][at] == dig[2][at],
                          "%s: rank %d iteration %d: y digest plain graph %016llx, balanced graph %016llx, balanced "
                          "eager %016llx", label, (int)r, (int)it, (unsigned long long)dig[0][at],
                          (unsigned long long)dig[1][at], (unsigned long long)dig[2][at]);
        }
    if (same_y(label, &p, y[1], y[0])) return 1;
    mft_verbose("  %s: %d replays with redrawn routing, y equal every time\n", label, iters);
    for (int k = 0; k < 3; k++) free_ys(&p, y[k]), free(dig[k]);
    mfp_free(&p);
    return 0;
}

static int cuda_balance_graph(void) {
    static bal_case_t cases[] = {
        {2, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_HOT, MF_DATAFLOW_DIRECT, 1, 2, 12, 0, 0, 21},
        {4, MF_DTYPE_BF16, MF_LAYOUT_MASKED, MFP_ROUTING_ZIPF, MF_DATAFLOW_PULL, 0, 2, 12, 0, 0, 22},
        {4, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_HOT, MF_DATAFLOW_UNFUSED, 1, 1, 12, 0, 0, 23},
    };
    int failed = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (graph_case(&cases[i])) failed++, mft_fail(__FILE__, __LINE__, "graph case %zu failed", i);
    return failed ? mft_fail(__FILE__, __LINE__, "%d of %zu graph cases failed", failed, sizeof cases / sizeof cases[0])
                  : 0;
}

/* ---- rank threads: capture of prefetch + forward, disagreement, bad maps --------------------- */

#define CUDA_OK_R(call)                                                                               \
    do {                                                                                              \
        cudaError_t e_ = (call);                                                                      \
        if (e_ != cudaSuccess) MFT_FAIL("rank %d: %s failed: %s", (int)rank, #call, cudaGetErrorString(e_)); \
    } while (0)

typedef struct rank_ctx {
    mf_group_t group;
    const mfp_problem_t *p[2]; /* the same weights, two routings */
    uint16_t *yref[2][MF_MAX_RANKS]; /* plain layer's y of each routing (host) */
    int32_t maps[2][1024];
    int32_t P, B;
    pthread_barrier_t ready;
    int mode; /* 0: capture prefetch + forward; 1: disagreement */
} rank_ctx_t;

/* This rank's device weights laid out from `map` (slot l holds logical map[rank * Lp + l]). */
static int upload_weights(const mfp_problem_t *p, const int32_t *map, int32_t P, int32_t rank, void *w13, void *w2) {
    const int32_t Lp = P / p->spec.R, L = p->L;
    const size_t n13 = (size_t)2 * p->spec.I * p->spec.H * 2, n2 = (size_t)p->spec.H * p->spec.I * 2;
    for (int32_t l = 0; l < Lp; l++) {
        int32_t e = map[rank * Lp + l];
        if (cudaMemcpy((uint8_t *)w13 + l * n13, (const uint8_t *)p->w13[e / L] + (size_t)(e % L) * n13, n13,
                       cudaMemcpyHostToDevice) != cudaSuccess ||
            cudaMemcpy((uint8_t *)w2 + l * n2, (const uint8_t *)p->w2[e / L] + (size_t)(e % L) * n2, n2,
                       cudaMemcpyHostToDevice) != cudaSuccess)
            return 1;
    }
    return 0;
}

static int y_matches(const void *y_dev, const uint16_t *want, size_t bytes, int32_t rank, const char *what) {
    uint16_t *h = mft_alloc(bytes + 2);
    if (bytes && cudaMemcpy(h, y_dev, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) MFT_FAIL("copy y");
    for (size_t i = 0; i < bytes / 2; i++)
        if (h[i] != want[i]) {
            uint16_t g = h[i];
            free(h);
            MFT_FAIL("rank %d: %s: y[%zu] = 0x%04x, without replicas 0x%04x", (int)rank, what, i, g, want[i]);
        }
    free(h);
    return 0;
}

static int y_poison(const void *y_dev, size_t bytes) {
    uint8_t *h = mft_alloc(bytes + 1);
    if (bytes && cudaMemcpy(h, y_dev, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) return 0;
    int ok = mft_first_unpoisoned(h, bytes) < 0;
    free(h);
    return ok;
}

static int rank_body(int32_t rank, rank_ctx_t *c, cudaStream_t stream, mf_comm_t comm, mf_moe_t moe, void *w13,
                     void *w2, void *x[2], void *ids[2], void *wt[2], void *y, void *xin, void *idsin, void *wtin) {
    const mfp_problem_t *p = c->p[0];
    const int64_t T = p->T[rank], H = p->spec.H, I = p->spec.I, K = p->spec.K, Lp = c->P / p->spec.R;
    const size_t ybytes = (size_t)T * H * 2;
    mf_moe_weights_t w = {mft_t3(w13, MF_DTYPE_BF16, Lp, 2 * I, H), mft_none(), mft_t3(w2, MF_DTYPE_BF16, Lp, H, I),
                          mft_none()};
    mf_moe_forward_in_t in = {mft_t2(xin, MF_DTYPE_BF16, T, H), mft_t2(idsin, MF_DTYPE_INT32, T, K),
                              mft_t2(wtin, MF_DTYPE_FP32, T, K)};
    mf_moe_forward_out_t out = {mft_t2(y, MF_DTYPE_BF16, T, H)};
    /* Bad maps: rejected, nothing changed (the forward below still runs the good map). */
    int32_t bad[1024];
    memcpy(bad, c->maps[0], sizeof bad);
    bad[3] = p->spec.E;
    MFT_CHECK_ERR(mf_moe_set_expert_map(moe, bad, c->P), MF_ERR_INVALID_ARGUMENT);
    for (int32_t q = 0; q < c->P; q++) bad[q] = c->maps[0][q] == 0 ? 1 : c->maps[0][q];
    MFT_CHECK_ERR(mf_moe_set_expert_map(moe, bad, c->P), MF_ERR_INVALID_ARGUMENT); /* expert 0 has no slot */
    MFT_CHECK_ERR(mf_moe_set_expert_map(moe, c->maps[0], c->P - 1), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_OK(mf_moe_set_expert_map(moe, c->maps[0], c->P));
    if (upload_weights(p, c->maps[0], c->P, rank, w13, w2)) MFT_FAIL("rank %d: weights upload", (int)rank);
    MFT_CHECK_OK(mf_moe_set_weights(moe, &w));
    const size_t xb = (size_t)T * H * 2, ib = (size_t)T * K * 4;
    if (c->mode == 0) {
        /* One graph: prefetch, then forward; replayed with the routing alternating (copied into the
         * captured input tensors between replays, device to device). */
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CUDA_OK_R(cudaMemcpyAsync(xin, x[0], xb, cudaMemcpyDeviceToDevice, stream));
        CUDA_OK_R(cudaMemcpyAsync(idsin, ids[0], ib, cudaMemcpyDeviceToDevice, stream));
        CUDA_OK_R(cudaMemcpyAsync(wtin, wt[0], ib, cudaMemcpyDeviceToDevice, stream));
        CUDA_OK_R(cudaStreamSynchronize(stream));
        CUDA_OK_R(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        mf_result_t r1 = mf_moe_prefetch(moe, stream);
        mf_result_t r2 = mf_moe_forward(moe, &in, &out, stream);
        cudaError_t ce = cudaStreamEndCapture(stream, &graph);
        MFT_CHECK_MSG(r1 == MF_SUCCESS && r2 == MF_SUCCESS, "rank %d: captured prefetch %s, forward %s: %s", (int)rank,
                      mft_result_name(r1), mft_result_name(r2), mf_last_error());
        if (ce == cudaSuccess) ce = cudaGraphInstantiate(&exec, graph, 0);
        if (ce == cudaSuccess) ce = cudaGraphUpload(exec, stream);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(stream);
        MFT_CHECK_MSG(ce == cudaSuccess, "rank %d: capturing prefetch + forward: %s", (int)rank, cudaGetErrorString(ce));
        pthread_barrier_wait(&c->ready);
        for (int it = 0; it < 6; it++) {
            const int which = (it / 2) % 2; /* routing 0, 0, 1, 1, 0, 0: the spares follow with one step's lag */
            CUDA_OK_R(cudaMemcpyAsync(xin, x[which], xb, cudaMemcpyDeviceToDevice, stream));
            CUDA_OK_R(cudaMemcpyAsync(idsin, ids[which], ib, cudaMemcpyDeviceToDevice, stream));
            CUDA_OK_R(cudaMemcpyAsync(wtin, wt[which], ib, cudaMemcpyDeviceToDevice, stream));
            CUDA_OK_R(cudaGraphLaunch(exec, stream));
            CUDA_OK_R(cudaStreamSynchronize(stream));
            MFT_CHECK_OK(mf_comm_get_async_error(comm));
            char what[64];
            snprintf(what, sizeof what, "graph replay %d (routing %d)", it, which);
            if (y_matches(y, c->yref[which][rank], ybytes, rank, what)) return 1;
        }
        mf_moe_balance_stats_t st = {.size = sizeof st};
        MFT_CHECK_OK(mf_moe_get_balance_stats(moe, &st));
        if (rank == 0)
            mft_verbose("  capture: 6 replays of prefetch + forward equal the plain layer; %d spares resident, "
                        "busiest rank %lld rows (home %lld)\n", (int)st.spare_resident,
                        (long long)mft_max_i64(st.recv_rows, p->spec.R), (long long)mft_max_i64(st.home_rows, p->spec.R));
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        return 0;
    }
    /* mode 1: disagreement. Inputs of routing 0. */
    CUDA_OK_R(cudaMemcpyAsync(xin, x[0], xb, cudaMemcpyDeviceToDevice, stream));
    CUDA_OK_R(cudaMemcpyAsync(idsin, ids[0], ib, cudaMemcpyDeviceToDevice, stream));
    CUDA_OK_R(cudaMemcpyAsync(wtin, wt[0], ib, cudaMemcpyDeviceToDevice, stream));
    CUDA_OK_R(cudaStreamSynchronize(stream));
    pthread_barrier_wait(&c->ready);
    MFT_CHECK_OK(mf_moe_forward(moe, &in, &out, stream));
    MFT_CHECK_OK(mf_moe_prefetch(moe, stream));
    MFT_CHECK_OK(mf_moe_forward(moe, &in, &out, stream));
    CUDA_OK_R(cudaStreamSynchronize(stream));
    MFT_CHECK_OK(mf_comm_get_async_error(comm));
    if (y_matches(y, c->yref[0][rank], ybytes, rank, "agreeing ranks")) return 1;
    /* Rank 0 alone changes its map (and its weights): every rank fails the next forward. */
    if (rank == 0) {
        MFT_CHECK_OK(mf_moe_set_expert_map(moe, c->maps[1], c->P));
        if (upload_weights(p, c->maps[1], c->P, rank, w13, w2)) MFT_FAIL("weights upload");
    }
    pthread_barrier_wait(&c->ready);
    CUDA_OK_R(cudaMemset(y, MFT_POISON_BYTE, ybytes));
    MFT_CHECK_OK(mf_moe_prefetch(moe, stream));
    mf_result_t f = mf_moe_forward(moe, &in, &out, stream);
    CUDA_OK_R(cudaStreamSynchronize(stream));
    mf_result_t a = f == MF_SUCCESS ? mf_comm_get_async_error(comm) : f;
    char msg[512];
    snprintf(msg, sizeof msg, "%s", mf_last_error());
    mft_verbose("  rank %d: maps differ: forward %s, async %s: %s\n", (int)rank, mft_result_name(f), mft_result_name(a),
                msg);
    MFT_CHECK_MSG(a == MF_ERR_INVALID_USAGE, "rank %d: ranks with different maps: %s (%s)", (int)rank,
                  mft_result_name(a), msg);
    MFT_CHECK_MSG(mft_contains_ci(msg, "expert map"), "rank %d: message: %s", (int)rank, msg);
    MFT_CHECK_MSG(y_poison(y, ybytes), "rank %d: a failed forward wrote y", (int)rank);
    /* Agreeing again (every rank on map 1): it runs and gives the plain layer's y. */
    if (rank != 0) {
        MFT_CHECK_OK(mf_moe_set_expert_map(moe, c->maps[1], c->P));
        if (upload_weights(p, c->maps[1], c->P, rank, w13, w2)) MFT_FAIL("weights upload");
    }
    MFT_CHECK_OK(mf_moe_set_weights(moe, &w));
    pthread_barrier_wait(&c->ready);
    MFT_CHECK_OK(mf_moe_prefetch(moe, stream));
    MFT_CHECK_OK(mf_moe_forward(moe, &in, &out, stream));
    MFT_CHECK_OK(mf_moe_prefetch(moe, stream));
    MFT_CHECK_OK(mf_moe_forward(moe, &in, &out, stream));
    CUDA_OK_R(cudaStreamSynchronize(stream));
    MFT_CHECK_OK(mf_comm_get_async_error(comm));
    if (y_matches(y, c->yref[0][rank], ybytes, rank, "agreeing again")) return 1;
    /* Only rank 1 prefetches: every rank fails the next forward. */
    pthread_barrier_wait(&c->ready);
    CUDA_OK_R(cudaMemset(y, MFT_POISON_BYTE, ybytes));
    if (rank == 1) MFT_CHECK_OK(mf_moe_prefetch(moe, stream));
    f = mf_moe_forward(moe, &in, &out, stream);
    CUDA_OK_R(cudaStreamSynchronize(stream));
    a = f == MF_SUCCESS ? mf_comm_get_async_error(comm) : f;
    snprintf(msg, sizeof msg, "%s", mf_last_error());
    mft_verbose("  rank %d: prefetch counts differ: forward %s, async %s: %s\n", (int)rank, mft_result_name(f),
                mft_result_name(a), msg);
    MFT_CHECK_MSG(a == MF_ERR_INVALID_USAGE, "rank %d: ranks with different prefetch counts: %s (%s)", (int)rank,
                  mft_result_name(a), msg);
    MFT_CHECK_MSG(mft_contains_ci(msg, "prefetch"), "rank %d: message: %s", (int)rank, msg);
    MFT_CHECK_MSG(y_poison(y, ybytes), "rank %d: a failed forward wrote y", (int)rank);
    return 0;
}

static int rank_main(int32_t rank, void *arg) {
    rank_ctx_t *c = arg;
    const mfp_problem_t *p = c->p[0];
    const int64_t T = p->T[rank], H = p->spec.H, I = p->spec.I, K = p->spec.K, Lp = c->P / p->spec.R;
    CUDA_OK_R(cudaSetDevice(0));
    cudaStream_t stream;
    CUDA_OK_R(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    mf_comm_t comm;
    MFT_CHECK_OK(mf_group_get_comm(c->group, rank, &comm));
    mf_moe_config_t cfg = MF_MOE_CONFIG_INIT;
    cfg.num_experts = p->spec.E, cfg.num_topk = (int32_t)K, cfg.hidden = (int32_t)H, cfg.intermediate = (int32_t)I;
    cfg.max_tokens_per_rank = p->spec.S, cfg.dtype = MF_DTYPE_BF16, cfg.layout = p->spec.layout;
    cfg.dataflow = MF_DATAFLOW_PULL;
    cfg.num_physical_experts = c->P, cfg.spare_slots = c->B;
    mf_moe_t moe;
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, &moe));
    void *w13 = mft_to_dev(NULL, (size_t)Lp * 2 * I * H * 2), *w2 = mft_to_dev(NULL, (size_t)Lp * H * I * 2);
    void *x[2], *ids[2], *wt[2];
    for (int k = 0; k < 2; k++) {
        x[k] = mft_to_dev(c->p[k]->x[rank], (size_t)T * H * 2);
        ids[k] = mft_to_dev(c->p[k]->topk_ids[rank], (size_t)T * K * 4);
        wt[k] = mft_to_dev(c->p[k]->topk_weights[rank], (size_t)T * K * 4);
    }
    void *y = mft_to_dev(NULL, (size_t)T * H * 2), *xin = mft_to_dev(NULL, (size_t)T * H * 2);
    void *idsin = mft_to_dev(NULL, (size_t)T * K * 4), *wtin = mft_to_dev(NULL, (size_t)T * K * 4);
    MFT_CHECK(w13 && w2 && x[0] && x[1] && ids[0] && ids[1] && wt[0] && wt[1] && y && xin && idsin && wtin);
    CUDA_OK_R(cudaMemsetAsync(y, 0, 2, stream)); /* the stream's first work, finished before any collective */
    CUDA_OK_R(cudaStreamSynchronize(stream));
    int rc = rank_body(rank, c, stream, comm, moe, w13, w2, x, ids, wt, y, xin, idsin, wtin);
    cudaStreamSynchronize(stream);
    mf_result_t d = mf_moe_destroy(moe);
    void *bufs[] = {w13, w2, x[0], x[1], ids[0], ids[1], wt[0], wt[1], y, xin, idsin, wtin};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaFree(bufs[i]);
    cudaStreamDestroy(stream);
    if (!rc) MFT_CHECK_OK(d);
    return rc;
}

/* Two routings of one problem (same weights), their plain CUDA outputs, two maps; runs mode. */
static int threads_case(int mode, int32_t R, int32_t layout, int32_t extra, int32_t B) {
    mfp_spec_t s;
    memset(&s, 0, sizeof s);
    s.R = R, s.E = 4 * R, s.K = 2, s.H = 256, s.I = 256, s.S = 16, s.T_per_rank = 16;
    s.dtype = MF_DTYPE_BF16, s.layout = layout, s.routing = MFP_ROUTING_HOT, s.zipf_s = 1.2, s.hot_expert = 1;
    s.seed = 300 + (uint64_t)mode;
    mfp_problem_t p0, p1;
    MFT_CHECK(mfp_generate(&s, &p0) == 0);
    MFT_CHECK(mfp_generate(&s, &p1) == 0); /* the same weights; its routing redrawn with another hot expert */
    p1.spec.hot_expert = 2 * R + 1;
    for (int32_t r = 0; r < R; r++)
        MFT_CHECK(mfp_draw_rank_inputs(&p1, r, 4242 + (uint64_t)r, (uint16_t *)p1.x[r], p1.topk_ids[r],
                                       p1.topk_weights[r]) == 0);
    static rank_ctx_t c;
    memset(&c, 0, sizeof c);
    c.p[0] = &p0, c.p[1] = &p1;
    c.P = s.E + extra * R, c.B = B, c.mode = mode;
    mft_random_map(s.E, c.P, 900 + (uint64_t)mode, c.maps[0]);
    mft_random_map(s.E, c.P, 901 + (uint64_t)mode, c.maps[1]);
    char err[512] = "";
    for (int k = 0; k < 2; k++) {
        alloc_ys(c.p[k], c.yref[k]);
        mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
        o.backend = MF_BACKEND_CUDA, o.iters = 1, o.timeout_ms = bal_timeout_ms(), o.dataflow = MF_DATAFLOW_PULL;
        MFT_CHECK_MSG(mfp_run(c.p[k], &o, c.yref[k], NULL, err, sizeof err) == MF_SUCCESS, "plain run %d: %s", k, err);
    }
    mf_group_config_t gc = MF_GROUP_CONFIG_INIT;
    gc.backend = MF_BACKEND_CUDA, gc.num_ranks = R, gc.timeout_ms = bal_timeout_ms();
    pthread_barrier_init(&c.ready, NULL, (unsigned)R);
    MFT_CHECK_OK(mf_group_create(&gc, &c.group));
    int rc = mft_run_ranks(R, rank_main, &c);
    mf_result_t g = mf_group_destroy(c.group);
    pthread_barrier_destroy(&c.ready);
    for (int k = 0; k < 2; k++) free_ys(c.p[k], c.yref[k]);
    mfp_free(&p0), mfp_free(&p1);
    if (rc) return rc;
    MFT_CHECK_OK(g);
    return 0;
}

static int cuda_balance_capture(void) {
    return threads_case(0, 2, MF_LAYOUT_EXPERT_MAJOR, 1, 2) || threads_case(0, 4, MF_LAYOUT_MASKED, 0, 1);
}

static int cuda_balance_disagree(void) { return threads_case(1, 2, MF_LAYOUT_EXPERT_MAJOR, 1, 1); }

/* ---- rebalancing without a stall ----------------------------------------------------------- */

/* tests/test_balance.c's stage case on CUDA (dataflow pinned): plain vs staged, call by call. */
static int stage_case(int32_t R, int32_t dtype, int32_t B, int32_t extra, int32_t n, int32_t transport, uint64_t seed) {
    bal_case_t c = {R, dtype, MF_LAYOUT_EXPERT_MAJOR, MFP_ROUTING_ZIPF, MF_DATAFLOW_PULL, extra, B, 16, 0, 2, seed};
    mfp_problem_t p;
    MFT_CHECK(bal_problem(&c, &p) == 0);
    const int32_t E = p.spec.E, P = E + extra * R, Lp = P / R;
    int32_t prev[1024], next[1024];
    mft_random_map(E, P, seed + 1, prev);
    mft_random_map(E, P, seed + 2, next);
    int32_t most = 0;
    for (int32_t q = 0; q < R; q++) {
        int32_t m = mf__stage_moved(prev, next, Lp, q);
        most = m > most ? m : most;
    }
    mf__stage_slot_t plan[1024];
    const int32_t steps = mf__stage_schedule(prev, next, P, R, n ? n : (most ? most : 1), plan), total = steps + 3;
    char label[256], err[512] = "";
    snprintf(label, sizeof label, "stage R=%d %s B=%d P=%d n=%d %s", (int)R, dtype == MF_DTYPE_FP8_E4M3 ? "fp8" : "bf16",
             (int)B, (int)P, (int)n, transport == MF_TRANSPORT_IPC ? "ipc" : "local");
    uint64_t *d[3];
    uint16_t *y[3][MF_MAX_RANKS];
    mfp_timing_t t[3];
    memset(t, 0, sizeof t);
    for (int k = 0; k < 3; k++) d[k] = (uint64_t *)calloc((size_t)R * total * 2, sizeof(uint64_t)), alloc_ys(&p, y[k]);
    int rc = 0;
    for (int k = 0; k < 3 && !rc; k++) { /* plain cuda, staged cuda, staged cpu */
        mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
        o.backend = k == 2 ? MF_BACKEND_CPU : MF_BACKEND_CUDA, o.iters = total, o.timeout_ms = bal_timeout_ms();
        o.dataflow = k == 2 ? MF_DATAFLOW_AUTO : c.flow, o.transport = transport;
        o.redraw = 1, o.redraw_seed = seed * 100, o.digests = d[k];
        if (k) {
            o.expert_map = prev, o.num_physical = P, o.spare_slots = B, o.prefetch = 1;
            o.stage_map = next, o.stage_at = 1, o.stage_per_step = n;
        }
        if (mfp_run(&p, &o, y[k], k ? &t[k] : NULL, err, sizeof err) != MF_SUCCESS)
            rc = mft_fail(__FILE__, __LINE__, "%s: %s run: %s", label, k == 0 ? "plain cuda" : k == 1 ? "staged cuda"
                          : "staged cpu", err);
    }
    for (int32_t i = 0; i < R * total && !rc; i++)
        if (d[0][2 * i + 1] != d[1][2 * i + 1])
            rc = mft_fail(__FILE__, __LINE__, "%s: rank %d call %d: y differs from the plain layer's (%s; stage at call 1, "
                          "switch after %d steps)", label, (int)(i / total), (int)(i % total),
                          i % total >= 1 && i % total < steps ? "staging, old map" : "new map", (int)steps);
    if (!rc && (t[1].stage_steps != t[2].stage_steps || t[1].stage_forwards != t[2].stage_forwards ||
                t[1].stage_bytes_total != t[2].stage_bytes_total || t[1].stage_steps != steps))
        rc = mft_fail(__FILE__, __LINE__, "%s: cuda %d steps, %d forwards while staging, %lld bytes; cpu %d, %d, %lld; "
                      "schedule %d steps", label, (int)t[1].stage_steps, (int)t[1].stage_forwards,
                      (long long)t[1].stage_bytes_total, (int)t[2].stage_steps, (int)t[2].stage_forwards,
                      (long long)t[2].stage_bytes_total, (int)steps);
    if (!rc)
        mft_verbose("  %s: %d steps, %d forwards while staging, %lld bytes pushed: bitwise ok\n", label,
                    (int)t[1].stage_steps, (int)t[1].stage_forwards, (long long)t[1].stage_bytes_total);
    for (int k = 0; k < 3; k++) free(d[k]), free_ys(&p, y[k]);
    mfp_free(&p);
    return rc;
}

static int cuda_balance_stage(void) {
    return stage_case(2, MF_DTYPE_BF16, 0, 1, 1, MF_TRANSPORT_LOCAL, 71) ||
           stage_case(4, MF_DTYPE_FP8_E4M3, 2, 1, 2, MF_TRANSPORT_LOCAL, 72) ||
           stage_case(4, MF_DTYPE_BF16, 1, 2, 0, MF_TRANSPORT_LOCAL, 73) ||
           stage_case(8, MF_DTYPE_FP8_E4M3, 0, 0, 3, MF_TRANSPORT_LOCAL, 74);
}

static int cuda_balance_stage_ipc(void) { return stage_case(2, MF_DTYPE_FP8_E4M3, 2, 1, 1, MF_TRANSPORT_IPC, 81); }

/* ---- placements, and dispatch / combine on mapped layers (issue 24) ------------------------- */

typedef struct place_case {
    int32_t R, E, dtype, layout, flow, T, K;
    uint64_t seed;
} place_case_t;

static int place_problem(const place_case_t *c, int32_t placement, mfp_problem_t *p) {
    mfp_spec_t s;
    memset(&s, 0, sizeof s);
    s.R = c->R, s.E = c->E, s.K = c->K, s.H = 256, s.I = 256, s.S = c->T, s.T_per_rank = c->T;
    s.dtype = c->dtype, s.layout = c->layout, s.routing = MFP_ROUTING_ZIPF, s.zipf_s = 1.2, s.drop_prob = 0.05;
    s.placement = placement, s.seed = c->seed;
    return mfp_generate(&s, p);
}

/* One shape (T equal on every rank, so that every layer below has the same rows hint T K R / E and
 * runs the same GEMM family): on CUDA with the dataflow pinned, the LINEAR and the ROUND_ROBIN
 * layer give y bit for bit equal to each other and to the same tokens on one rank (the identity
 * placement); within the contract's bounds of the CPU backend; and each rank's rows (balance stats
 * of the mapped layers) equal the CPU's. */
static int placement_case(const place_case_t *c) {
    mfp_problem_t p[2], one;
    MFT_CHECK(place_problem(c, MF_PLACEMENT_LINEAR, &p[0]) == 0 && place_problem(c, MF_PLACEMENT_ROUND_ROBIN, &p[1]) == 0);
    MFT_CHECK(mfp_gather_ranks(&p[0], &one) == 0);
    char label[200], err[512] = "";
    snprintf(label, sizeof label, "R=%d E=%d T=%d K=%d %s %s %s", (int)c->R, (int)c->E, (int)c->T, (int)c->K,
             c->dtype == MF_DTYPE_FP8_E4M3 ? "fp8" : "bf16", c->layout == MF_LAYOUT_MASKED ? "masked" : "expert_major",
             flow_name(c->flow));
    uint16_t *yg[2][MF_MAX_RANKS], *yc[2][MF_MAX_RANKS], *y1[1];
    alloc_ys(&p[0], yg[0]), alloc_ys(&p[0], yg[1]), alloc_ys(&p[0], yc[0]), alloc_ys(&p[0], yc[1]), alloc_ys(&one, y1);
    mfp_timing_t tg[2], tc[2];
    memset(tg, 0, sizeof tg), memset(tc, 0, sizeof tc);
    int rc = 0;
    for (int k = 0; k < 5 && !rc; k++) { /* cuda linear, cuda round robin, cpu linear, cpu round robin, cuda one rank */
        mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
        o.backend = k == 2 || k == 3 ? MF_BACKEND_CPU : MF_BACKEND_CUDA, o.iters = 2, o.timeout_ms = bal_timeout_ms();
        o.dataflow = k == 2 || k == 3 ? MF_DATAFLOW_AUTO : c->flow;
        const mfp_problem_t *q = k == 4 ? &one : &p[k % 2];
        uint16_t **y = k == 4 ? y1 : k < 2 ? yg[k] : yc[k - 2];
        mfp_timing_t *t = k < 2 ? &tg[k] : k < 4 ? &tc[k - 2] : NULL;
        if (mfp_run(q, &o, y, t, err, sizeof err) != MF_SUCCESS)
            rc = mft_fail(__FILE__, __LINE__, "%s: run %d (%s %s): %s", label, k, k == 2 || k == 3 ? "cpu" : "cuda",
                          k == 4 ? "one rank" : k % 2 ? "round robin" : "linear", err);
    }
    if (!rc) rc = same_y(label, &p[0], yg[1], yg[0]);
    for (int32_t r = 0, t0 = 0; r < c->R && !rc; t0 += p[0].T[r], r++)
        if (memcmp(yg[0][r], y1[0] + (size_t)t0 * p[0].spec.H, (size_t)p[0].T[r] * p[0].spec.H * 2) != 0)
            rc = mft_fail(__FILE__, __LINE__, "%s: rank %d: y of the linear layer differs from the same tokens on one rank",
                          label, (int)r);
    for (int k = 0; k < 2 && !rc; k++) rc = close_y(label, &p[k], yg[k], yc[k]);
    for (int k = 0; k < 2 && !rc; k++)
        for (int32_t r = 0; r < c->R && !rc && tg[k].have_balance; r++)
            if (!tc[k].have_balance || tg[k].balance.recv_rows[r] != tc[k].balance.recv_rows[r] ||
                tg[k].balance.home_rows[r] != tc[k].balance.home_rows[r])
                rc = mft_fail(__FILE__, __LINE__, "%s %s: rank %d computed %lld rows (home %lld) on cuda, %lld (%lld) on cpu",
                              label, k ? "round robin" : "linear", (int)r, (long long)tg[k].balance.recv_rows[r],
                              (long long)tg[k].balance.home_rows[r], (long long)tc[k].balance.recv_rows[r],
                              (long long)tc[k].balance.home_rows[r]);
    if (!rc) mft_verbose("  %s: linear = round robin = one rank bit for bit, within bounds of the cpu\n", label);
    for (int k = 0; k < 2; k++) free_ys(&p[0], yg[k]), free_ys(&p[0], yc[k]);
    free_ys(&one, y1);
    mfp_free(&p[0]), mfp_free(&p[1]), mfp_free(&one);
    return rc;
}

static int cuda_placement_bitwise(void) {
    const int32_t BF = MF_DTYPE_BF16, F8 = MF_DTYPE_FP8_E4M3, EM = MF_LAYOUT_EXPERT_MAJOR, MA = MF_LAYOUT_MASKED;
    const int32_t DI = MF_DATAFLOW_DIRECT, PU = MF_DATAFLOW_PULL, UN = MF_DATAFLOW_UNFUSED;
    static place_case_t cases[] = {
        /* R, E, dtype, layout, flow, T, K, seed */
        {3, 10, 0, 0, 0, 12, 3, 1}, {4, 10, 0, 0, 0, 12, 3, 2}, {4, 12, 0, 0, 0, 12, 3, 3}, {6, 26, 0, 0, 0, 8, 4, 4},
        {8, 9, 0, 0, 0, 8, 2, 5},   {2, 3, 0, 0, 0, 12, 2, 6},  {4, 18, 0, 0, 0, 256, 8, 7}, {6, 128, 0, 0, 0, 64, 8, 8},
    };
    static const int32_t kinds[][3] = {{BF, EM, PU}, {F8, MA, DI}, {F8, EM, UN}, {BF, MA, DI},
                                       {F8, EM, PU}, {BF, MA, UN}, {F8, MA, PU}, {BF, EM, PU}};
    int failed = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cases[i].dtype = kinds[i][0], cases[i].layout = kinds[i][1], cases[i].flow = kinds[i][2];
        if (placement_case(&cases[i])) failed++, mft_fail(__FILE__, __LINE__, "placement case %zu failed", i);
    }
    return failed ? mft_fail(__FILE__, __LINE__, "%d placement cases failed", failed) : 0;
}

/* mf_dispatch + mf_combine (the identity expert) on CUDA against the CPU backend call by call, the
 * routing redrawn every call: the dispatch outputs (counts, offsets, every row's source, payload
 * and scales) and y bit for bit; on both placements and on layers with an expert map (B = 0), whose
 * y equals the plain layer's. */
static int comm_digests(const mfp_problem_t *p, int32_t backend, const int32_t *map, int32_t P, uint64_t *d,
                        const char *label) {
    uint16_t *y[MF_MAX_RANKS];
    alloc_ys(p, y);
    mfp_run_opts_t o = MFP_RUN_OPTS_INIT;
    o.backend = backend, o.iters = 3, o.timeout_ms = bal_timeout_ms(), o.op = MFP_OP_DISPATCH_COMBINE;
    o.redraw = 1, o.redraw_seed = 4242, o.digests = d, o.expert_map = map, o.num_physical = map ? P : 0;
    char err[512] = "";
    mf_result_t res = mfp_run(p, &o, y, NULL, err, sizeof err);
    free_ys(p, y);
    MFT_CHECK_MSG(res == MF_SUCCESS, "%s on %s: %s", label, backend == MF_BACKEND_CUDA ? "cuda" : "cpu", err);
    return 0;
}

static int cuda_placement_comm(void) {
    static const struct {
        int32_t R, E, placement, dtype, layout, extra; /* extra < 0: no map; else a map of E + extra * R slots */
    } cases[] = {
        {3, 10, MF_PLACEMENT_LINEAR, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, -1},
        {4, 10, MF_PLACEMENT_ROUND_ROBIN, MF_DTYPE_BF16, MF_LAYOUT_MASKED, -1},
        {4, 12, MF_PLACEMENT_ROUND_ROBIN, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, -1},
        {8, 9, MF_PLACEMENT_LINEAR, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, -1},
        {2, 8, MF_PLACEMENT_LINEAR, MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR, 2},
        {4, 16, MF_PLACEMENT_LINEAR, MF_DTYPE_BF16, MF_LAYOUT_MASKED, 1},
        {4, 16, MF_PLACEMENT_LINEAR, MF_DTYPE_FP8_E4M3, MF_LAYOUT_MASKED, 0},
        {8, 32, MF_PLACEMENT_LINEAR, MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR, 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const place_case_t c = {cases[i].R, cases[i].E, cases[i].dtype, cases[i].layout, MF_DATAFLOW_AUTO, 12, 3, 50 + i};
        mfp_problem_t p, plain;
        MFT_CHECK(place_problem(&c, cases[i].placement, &p) == 0 && place_problem(&c, MF_PLACEMENT_LINEAR, &plain) == 0);
        const int32_t P = c.E + (cases[i].extra > 0 ? cases[i].extra : 0) * c.R, n = c.R * 3 * 2;
        int32_t map[256];
        mft_random_map(c.E, P, 60 + i, map);
        const int32_t *m = cases[i].extra >= 0 ? map : NULL;
        char label[160];
        snprintf(label, sizeof label, "dispatch + combine R=%d E=%d %s P=%d %s %s", (int)c.R, (int)c.E,
                 cases[i].placement ? "round_robin" : "linear", m ? (int)P : 0, c.dtype == MF_DTYPE_FP8_E4M3 ? "fp8" : "bf16",
                 c.layout == MF_LAYOUT_MASKED ? "masked" : "expert_major");
        uint64_t dg[MF_MAX_RANKS * 6], dc[MF_MAX_RANKS * 6], d0[MF_MAX_RANKS * 6];
        int rc = comm_digests(&p, MF_BACKEND_CUDA, m, P, dg, label) || comm_digests(&p, MF_BACKEND_CPU, m, P, dc, label) ||
                 comm_digests(&plain, MF_BACKEND_CUDA, NULL, 0, d0, label);
        for (int32_t j = 0; j < n && !rc; j++)
            if (dg[j] != dc[j] || (j % 2 && dg[j] != d0[j]))
                rc = mft_fail(__FILE__, __LINE__, "%s: rank %d call %d: the %s digest differs (cuda %016llx, cpu %016llx, "
                              "plain cuda %016llx)", label, (int)(j / 6), (int)(j / 2 % 3), j % 2 ? "y" : "dispatch",
                              (unsigned long long)dg[j], (unsigned long long)dc[j], (unsigned long long)d0[j]);
        if (!rc) mft_verbose("  %s: cuda = cpu call by call, y = the plain layer's\n", label);
        mfp_free(&p), mfp_free(&plain);
        if (rc) return rc;
    }
    return 0;
}

const mft_test_t mft_tests_cuda_balance[] = {
    {"cuda_placement_bitwise", cuda_placement_bitwise, 180},
    {"cuda_placement_comm", cuda_placement_comm, 120},
    {"cuda_balance_stage", cuda_balance_stage, 120},
    {"cuda_balance_stage_ipc", cuda_balance_stage_ipc, 120},
    {"cuda_balance_pick", cuda_balance_pick, 120},
    {"cuda_balance_plan_par", cuda_balance_plan_par, 60},
    {"cuda_balance_bitwise", cuda_balance_bitwise, 180},
    {"cuda_balance_bitwise_serial", cuda_balance_bitwise_serial, 120},
    {"cuda_balance_graph", cuda_balance_graph, 120},
    {"cuda_balance_capture", cuda_balance_capture, 60},
    {"cuda_balance_disagree", cuda_balance_disagree, 60},
    {NULL, NULL, 0},
};
