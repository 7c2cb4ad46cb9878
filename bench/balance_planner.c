/*
 * balance_planner.c — the balancing planner alone (src/balance/planner.h) on the CLI's routing: rows
 * per rank max / mean before (every expert on its home rank e / L) and after mf__balance_pick's
 * spare table, for E = 256, R = 8, K = 8, B = 2, over seeds 1..N. The per-step plan uses the
 * previous call's counts; here those are the call's own (a steady routing), as in `moeflow bench`.
 *
 *   make && cc -O2 -std=c11 -D_POSIX_C_SOURCE=200809L -Iinclude -Isrc -Iworkload -DMF_WITH_CUDA=0 \
 *      bench/balance_planner.c build/workload/problem.o build/workload/ref.o build/libmoeflow.a \
 *      -lm -pthread [-L$CUDA/lib64 -lcudart -lcuda -ldl -lrt -lstdc++ on a CUDA build] -o /tmp/bp
 *   /tmp/bp T ZIPF_S SEEDS        (ZIPF_S 0 = uniform routing)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "balance/planner.h"
#include "problem.h"
int main(int argc, char **argv) {
    int T = atoi(argv[1]); double zs = atof(argv[2]); int seeds = atoi(argv[3]);
    enum { E = 256, R = 8, B = 2, P = 256 };
    double worst = 0, sum = 0, bw = 0, bs = 0;
    for (int sd = 1; sd <= seeds; sd++) {
        mfp_spec_t s; memset(&s, 0, sizeof s);
        s.R = R, s.E = E, s.K = 8, s.H = 8, s.I = 8, s.S = T, s.T_per_rank = T, s.dtype = MF_DTYPE_BF16;
        s.routing = zs > 0 ? MFP_ROUTING_ZIPF : MFP_ROUTING_UNIFORM; s.zipf_s = zs; s.seed = sd;
        mfp_problem_t p; if (mfp_generate(&s, &p)) return 1;
        int64_t pe[E]; mfp_count_rows(&p, NULL, pe);
        int32_t counts[E], map[P], spare[R*B], ro[E+1], rr[P+R*B], rs[P+R*B], sh[P+R*B], scr[E+R*B]; int64_t load[R], home[R];
        for (int e = 0; e < E; e++) counts[e] = (int32_t)pe[e];
        for (int i = 0; i < P; i++) map[i] = i;
        mf__balance_replicas(E, R, P, 0, map, NULL, ro, rr, rs, scr);
        mf__balance_split(E, R, counts, ro, rr, sh, home, scr);
        mf__balance_pick(E, R, P, B, counts, map, NULL, spare, ro, rr, rs, sh, load, scr);
        mf__balance_replicas(E, R, P, B, map, spare, ro, rr, rs, scr);
        mf__balance_split(E, R, counts, ro, rr, sh, load, scr);
        int64_t tot = 0, mh = 0, ml = 0; for (int r = 0; r < R; r++) { tot += home[r]; mh = home[r] > mh ? home[r] : mh; ml = load[r] > ml ? load[r] : ml; }
        double a = (double)mh * R / tot, b = (double)ml * R / tot;
        if (b > worst) worst = b; sum += b; bs += a; if (a > bw) bw = a;
        if (seeds <= 3) { printf("seed %d: %.3f -> %.3f  spare:", sd, a, b); for (int i = 0; i < R*B; i++) printf(" %d", spare[i]); printf("\n  top counts:"); 
          for (int r = 0; r < R; r++) printf(" %lld", (long long)load[r]); printf("\n"); }
        mfp_free(&p);
    }
    printf("T %d zipf %.2f: before mean %.3f worst %.3f; after mean %.3f worst %.3f over %d seeds\n", T, zs, bs / seeds, bw, sum / seeds, worst, seeds);
}
