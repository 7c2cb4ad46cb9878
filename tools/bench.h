/*
 * bench.h — what the CLI's benchmarks share: the H200 ceilings of docs/DESIGN.md "Performance doctrine"
 * (tools/moeflow.c and tools/bench_gemm.c compute their floors from them; bench/peers.py reads
 * them from this file), the entry of `moeflow bench gemm` (tools/bench_gemm.c, CUDA builds only) and
 * the JSON record writer (tools/bench_json.c).
 */
#ifndef MF_TOOLS_BENCH_H
#define MF_TOOLS_BENCH_H

#include <stdio.h>

/* docs/DESIGN.md "Performance doctrine": ceilings measured on one H200. */
#define H200_COPY_BYTES_PER_S 4.24e12
#define H200_BF16_FLOPS 795e12
#define H200_FP8_FLOPS 1436e12

/* `moeflow bench gemm [options]`: argv[0] the program, argv[1] "bench", argv[2] "gemm", options
 * from argv[3]. Returns the exit status (0 every case passed, 1 a case failed, 2 bad usage). */
int mf__bench_gemm_main(int argc, char **argv);

/* tools/bench_json.c: a JSON string (", \ and control characters escaped), a number (null when not
 * finite), and the record's start: {"meta": {card, date, commit, command = argv, backend}, "rows": [
 * (card: "cpu" for the CPU backend, else MF_CARD or "h200"; commit: MF_COMMIT, else git). */
void mf__json_string(FILE *f, const char *s);
void mf__json_number(FILE *f, double x);
void mf__json_meta(FILE *f, const char *backend, int argc, char **argv);

#endif /* MF_TOOLS_BENCH_H */
