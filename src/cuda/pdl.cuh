/*
 * pdl.cuh — programmatic dependent launch (PDL, sm_90) in one place: the two device instructions
 * every kernel of the data path calls (mf__pdl_wait, mf__pdl_trigger), the one host launch that
 * asks for it (mf__cuda_launch, defined in pdl.cu) and its switch (mf__cuda_pdl, MF_PDL). Included
 * by the kernel headers (kernels/sync.cuh and so movement.cuh, kernels/sm90_ptx.cuh and so the
 * decode and TMA GEMMs, kernels/sm90_grouped_gemm.cuh) and by the launchers.
 *
 * A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may start once every
 * CTA of the previous kernel on its stream has executed griddepcontrol.launch_dependents (or
 * exited), instead of when that kernel has completed: its launch latency and prologue then run
 * under the previous kernel's tail. Its griddepcontrol.wait returns once the previous kernel has
 * completed and that kernel's memory operations are visible. For a kernel launched without the
 * attribute both instructions do nothing. The rules every kernel here follows:
 *  - wait: every thread calls mf__pdl_wait() once, on every path (before any early return), before
 *    its first global read of anything an earlier kernel or the caller wrote and before its first
 *    global write. Only independent prologue work may precede it: mbarrier init and fences,
 *    tensor-map prefetch, shared-memory zeroing, reading the kernel's parameters. So a kernel
 *    completes only after the kernel before it, and completion stays transitive along the stream:
 *    whatever waits for the last kernel of a call (an event, the caller's next kernel) waits for
 *    all of them.
 *  - trigger: mf__pdl_trigger() only after the kernel's own wait returned, so at most one grid per
 *    stream is ever resident ahead of the kernel it waits for.
 *  - attribute: the host sets it per launch (`pdl` below) only on the edges listed in
 *    src/cuda/backend.cu's file comment, which also says why they are safe with virtual ranks.
 */
#ifndef MF_CUDA_PDL_CUH
#define MF_CUDA_PDL_CUH

#include <cuda_runtime.h>
#include <stdint.h>

/* Waits until the previous kernel on the stream has completed and its writes are visible (when
 * this kernel was launched with the attribute; otherwise returns at once). */
__device__ __forceinline__ void mf__pdl_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* Lets the next kernel on the stream start, once every CTA of this one has called this or exited
 * (when it was launched with the attribute). Promises nothing about this kernel's writes. The
 * memory clobber keeps it after the wait. */
__device__ __forceinline__ void mf__pdl_trigger(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* The switch (default 1): 0 launches every kernel without the attribute. A comm's init clears it
 * when the environment has MF_PDL=0 (mf__param_pdl, core/params.c); it is never set back, so one
 * process compares both by running twice. Tests and tools may write it; read and written with
 * relaxed atomics. */
extern "C" int32_t mf__cuda_pdl;

/* Launches fn<<<grid, block, smem, stream>>> with `args` (one pointer per kernel parameter, as
 * cudaLaunchKernel takes them), with the programmatic-serialization attribute when `pdl` is set
 * and the switch is on. Returns the launch's error (not cleared). Capturable: a captured launch
 * with the attribute becomes a programmatic edge of the graph. */
cudaError_t mf__cuda_launch(const void *fn, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int32_t pdl,
                            void **args);

/* The same for a kernel that takes one parameter struct (every kernel here but the small plan,
 * which takes two and uses the form above), type-checked. */
template <typename P>
static inline cudaError_t mf__cuda_launch(void (*fn)(P), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                          int32_t pdl, const P &params) {
    void *args[] = {(void *)&params};
    return mf__cuda_launch((const void *)fn, grid, block, smem, stream, pdl, args);
}

#endif /* MF_CUDA_PDL_CUH */
