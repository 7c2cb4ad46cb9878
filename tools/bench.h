/*
 * bench.h — what the CLI's benchmarks share: the H200 ceilings of DESIGN.md "Performance doctrine"
 * (tools/moeflow.c and tools/bench_gemm.c compute their floors from them; bench/peers.py reads
 * them from this file) and the entry of `moeflow bench gemm` (tools/bench_gemm.c, CUDA builds only).
 */
#ifndef MF_TOOLS_BENCH_H
#define MF_TOOLS_BENCH_H

/* DESIGN.md "Performance doctrine": ceilings measured on one H200. */
#define H200_COPY_BYTES_PER_S 4.24e12
#define H200_BF16_FLOPS 795e12
#define H200_FP8_FLOPS 1436e12

/* `moeflow bench gemm [options]`: argv[0] the program, argv[1] "bench", argv[2] "gemm", options
 * from argv[3]. Returns the exit status (0 every case passed, 1 a case failed, 2 bad usage). */
int mf__bench_gemm_main(int argc, char **argv);

#endif /* MF_TOOLS_BENCH_H */
