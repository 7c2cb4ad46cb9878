/*
 * pdl.cu — the host half of programmatic dependent launch (cuda/pdl.cuh): the switch and the one
 * launch that sets the attribute, shared by the backend's movement kernels and the GEMM launchers.
 * Nothing here synchronises or allocates.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda/pdl.cuh"

extern "C" int32_t mf__cuda_pdl = 1;

cudaError_t mf__cuda_launch(const void *fn, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int32_t pdl,
                            void **args) {
    cudaLaunchAttribute attr[1] = {};
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = pdl && __atomic_load_n(&mf__cuda_pdl, __ATOMIC_RELAXED) ? 1 : 0;
    return cudaLaunchKernelExC(&config, fn, args);
}
