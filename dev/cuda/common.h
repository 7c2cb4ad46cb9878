/*
 * common.h — what the kernel labs (dev/cuda/<name>.cu) share, host code only: the fatal check of
 * every CUDA runtime and driver call (naming the case running, then the lab's own report, e.g. a
 * timed-out device wait, then exit 2), the failure count and the poison byte of the checks, the host
 * random stream (splitmix64) and random BF16 data, and vectors to and from the device. Each lab is
 * one translation unit that includes this after the library's headers; everything here is inline, so
 * a lab that leaves a helper unused compiles without a warning.
 */
#ifndef MF_DEV_CUDA_COMMON_H
#define MF_DEV_CUDA_COMMON_H

#include <cuda.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "core/numerics.h"
#include "cuda/kernels/fault.cuh" /* the labs' fault sink */

/* ---- errors ------------------------------------------------------------------------------------ */

inline const char *g_case = NULL;        /* the case running now, named in every fatal error (NULL: none) */
inline void (*g_on_fatal)(void) = NULL;  /* the lab's own report after a fatal error (its device-wait fault) */
inline int g_failures = 0;               /* failed checks; a lab exits 1 when any */
inline const uint8_t kPoison = 0xFF;     /* output poison: NaN in E4M3, BF16 and fp32 */

inline void lab_fatal(const char *file, int line, const char *what, const char *why) {
    if (g_case) fprintf(stderr, "FATAL %s:%d: case %s: %s failed: %s\n", file, line, g_case, what, why);
    else fprintf(stderr, "FATAL %s:%d: %s failed: %s\n", file, line, what, why);
    if (g_on_fatal) g_on_fatal();
    exit(2);
}

#define CUDA_OK(call)                                                                                   \
    do {                                                                                                \
        cudaError_t e_ = (call);                                                                        \
        if (e_ != cudaSuccess) lab_fatal(__FILE__, __LINE__, #call, cudaGetErrorString(e_));            \
    } while (0)

#define CU_OK(call)                                                                                     \
    do {                                                                                                \
        CUresult r_ = (call);                                                                           \
        if (r_ != CUDA_SUCCESS) {                                                                       \
            char why_[32];                                                                              \
            snprintf(why_, sizeof why_, "CUresult %d", (int)r_);                                        \
            lab_fatal(__FILE__, __LINE__, #call, why_);                                                 \
        }                                                                                               \
    } while (0)

/* ---- the labs' fault sink ----------------------------------------------------------------------- */

/* The sink every lab launch passes (mf__gemm_segments_t.sink, the selftests' params): the GEMMs'
 * bounded waits record an expiry there as they would in a comm's (kernels/fault.cuh; sm90_ptx.cuh
 * mf__pipeline_fault), the labs' own trapping waits too; the record is mapped host memory, so it
 * stays readable after a trap. Made once by lab_sink(), read by lab_report_sink(). */
inline mf__fault_sink_t g_sink = {NULL, NULL, 0};

inline void lab_sink(void) {
    CUDA_OK(cudaMalloc((void **)&g_sink.state, sizeof *g_sink.state));
    CUDA_OK(cudaMemset(g_sink.state, 0, sizeof *g_sink.state));
    CUDA_OK(cudaHostAlloc((void **)&g_sink.record, sizeof *g_sink.record, cudaHostAllocMapped));
    memset((void *)g_sink.record, 0, sizeof *g_sink.record);
}

/* Prints the recorded expiry, if any: the case, block, thread and the wait site (`site` names it).
 * The library's waits return instead of trapping, so a lab also calls lab_sink_failed() at its end. */
inline void lab_report_sink(const char *(*site)(long long tag)) {
    const mf__device_error_t *r = g_sink.record;
    if (!r || !r->pipeline) return;
    fprintf(stderr, "  device wait %s in case %s: block %lld thread %lld site %lld (%s)\n",
            r->pipeline_drained ? "drained after another expired" : "timed out", g_case ? g_case : "-",
            r->pipeline_block, r->pipeline_thread, r->pipeline_site, site(r->pipeline_site));
}

/* 1 (and the expiry printed) when a wait of the run expired: a failure of the run. */
inline int lab_sink_failed(const char *(*site)(long long tag)) {
    if (!g_sink.record || !g_sink.record->pipeline) return 0;
    printf("FAIL a device wait expired during the run (details on stderr)\n");
    lab_report_sink(site);
    return 1;
}

/* ---- host random data -------------------------------------------------------------------------- */

inline uint64_t g_rng = 0x9E3779B97F4A7C15ull;
inline uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
inline double rnd_unit(void) { return (double)(rnd_u64() >> 11) * (1.0 / 9007199254740992.0); } /* [0, 1) */

/* Random BF16 [rows, cols]: uniform in [-mag, mag) with a per-128-block magnitude spread of 2^[-2, 2]
 * (so that 1x128 and 128x128 scales differ), never zero. */
inline void fill_bf16(uint16_t *x, int64_t rows, int64_t cols, float mag) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c0 = 0; c0 < cols; c0 += 128) {
            const float m = mag * exp2f((float)(4.0 * rnd_unit() - 2.0));
            for (int64_t c = c0; c < cols && c < c0 + 128; c++) {
                float v = (float)(2.0 * rnd_unit() - 1.0) * m;
                if (v == 0.0f) v = 0.5f * m;
                x[r * cols + c] = mf__bf16_from_float(v);
            }
        }
}

/* ---- device vectors ---------------------------------------------------------------------------- */

/* n elements of T on the device (at least 16 bytes, so that an empty one is a valid pointer). */
template <typename T>
inline T *dev_alloc(size_t n) {
    T *d = NULL;
    CUDA_OK(cudaMalloc((void **)&d, std::max<size_t>(n * sizeof(T), 16)));
    return d;
}

template <typename T>
inline T *to_device(const std::vector<T> &v) {
    T *d = dev_alloc<T>(v.size());
    if (!v.empty()) CUDA_OK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

template <typename T>
inline std::vector<T> to_host(const T *d, size_t n) {
    std::vector<T> v(n);
    if (n) CUDA_OK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
}

#endif /* MF_DEV_CUDA_COMMON_H */
