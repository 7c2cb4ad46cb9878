/*
 * cuda_test.h — what the CUDA suite's test files share (tests/gpu/test_*.c): the check of a CUDA
 * runtime call, which fails the running test (MFT_FAIL, tests/harness.h) with the call and CUDA's
 * message, and the device copy of a host array. Header-only; include it after tests/harness.h.
 */
#ifndef MFT_GPU_CUDA_TEST_H
#define MFT_GPU_CUDA_TEST_H

#include <cuda_runtime_api.h>
#include <stddef.h>

/* Fails the running test unless `call` returns cudaSuccess. */
#define CUDA_OK(call)                                                                                 \
    do {                                                                                              \
        cudaError_t e_ = (call);                                                                      \
        if (e_ != cudaSuccess) MFT_FAIL("%s failed: %s", #call, cudaGetErrorString(e_));             \
    } while (0)

/* A device copy of `bytes` bytes of `host` (NULL: uninitialised; bytes may be 0: 16 bytes are
 * allocated so that the pointer is valid); NULL when cudaMalloc or cudaMemcpy fails. The caller
 * cudaFree()s it. */
static inline void *mft_to_dev(const void *host, size_t bytes) {
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 16) != cudaSuccess) return NULL;
    if (bytes && host && cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) return NULL;
    return d;
}

#endif /* MFT_GPU_CUDA_TEST_H */
