/*
 * bench.h — what the CLI's benchmarks share: the H200 ceilings of docs/DESIGN.md "Performance doctrine"
 * (tools/moeflow.c and tools/bench_gemm.c compute their floors from them; bench/peers.py reads
 * them from this file), the exit statuses, the entry of `moeflow bench gemm` (tools/bench_gemm.c,
 * CUDA builds only) and the JSON record writer with the CLI's small helpers (tools/bench_json.c).
 */
#ifndef MF_TOOLS_BENCH_H
#define MF_TOOLS_BENCH_H

#include <stdio.h>

/* docs/DESIGN.md "Performance doctrine": ceilings measured on one H200. */
#define H200_COPY_BYTES_PER_S 4.24e12
#define H200_BF16_FLOPS 795e12
#define H200_FP8_FLOPS 1436e12

/* The exit status of `moeflow` and of `moeflow bench gemm` alike (README "The `moeflow` command");
 * 0 is success: every row or case ran and passed, or --help / --version. */
#define EXIT_FAIL 1  /* a check failed: a row or case did not pass, or the library returned an error */
#define EXIT_USAGE 2 /* bad flags, or a request this build or machine cannot serve (no CUDA GPU, a
                        problem larger than the memory check allows) */
#define EXIT_IO 3    /* an I/O or system failure: --json not writable, out of host memory, CUDA
                        setup */

/* Prints "<who>: <message>" on stderr and exits with `status` (one of the above). */
void cli_die(int status, const char *who, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4), noreturn))
#endif
    ;

/* --json FILE, checked before any work: opens FILE for writing without truncating it, and removes
 * it again where it did not exist. 0 when it can be written, else -1 with errno set. */
int cli_json_check_writable(const char *path);

/* `moeflow bench gemm [options]`: argv[0] the program, argv[1] "bench", argv[2] "gemm", options
 * from argv[3]. Returns the exit status (above). */
int cli_bench_gemm_main(int argc, char **argv);

/* `moeflow bench overlap [options]` (tools/bench_overlap.c, CUDA builds only): two micro-batches
 * through the split halves beside the same pair back to back. As cli_bench_gemm_main. */
int cli_bench_overlap_main(int argc, char **argv);

/* tools/bench_json.c: a JSON string (", \ and control characters escaped), a number (null when not
 * finite), and the record's start: {"meta": {card, date, commit, command = argv, backend[, env]},
 * "rows": [ (card: "cpu" for the CPU backend, else MF_CARD or "h200"; commit: MF_COMMIT, else git;
 * env: the MF_* environment variables set, e.g. {"MF_PDL": "0"}, where any). */
void cli_json_string(FILE *f, const char *s);
void cli_json_number(FILE *f, double x);
void cli_json_meta(FILE *f, const char *backend, int argc, char **argv);

#endif /* MF_TOOLS_BENCH_H */
