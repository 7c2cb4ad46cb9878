/*
 * nccl.c — the `nccl` transport: ranks built from the caller's ncclComm_t.
 *
 * Bootstrap: the comm's own ncclAllGather (through a device staging buffer, on a private stream,
 * synchronised: setup only) carries every setup collective, so an engine hands over its process
 * group as the ncclComm it already has. NCCL's symbols are resolved in this process (dlsym on the
 * libnccl already loaded, else dlopen of libnccl.so.2), never linked: the comm must be driven by
 * the same libnccl that created it (an engine's NCCL may be its own copy, e.g. torch's).
 *
 * Memory: symmetric allocations use the ipc transport's CUDA IPC mappings; see docs/API.md
 * "Transports" for NCCL symmetric windows (LSA pointers), which need every peer NVLink-reachable.
 */
#define _GNU_SOURCE
#include "core/alloc.h"
#include "core/errors.h"
#include "core/handles.h"
#include "core/layout.h"
#include "transport/transport.h"

#if MF_WITH_CUDA
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include <cuda_runtime.h>
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes" /* nccl.h declares f() for f(void) */
#include <nccl.h>
#pragma GCC diagnostic pop

typedef ncclResult_t (*mf__nccl_allgather_fn)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
typedef ncclResult_t (*mf__nccl_int_fn)(const ncclComm_t, int *);
typedef const char *(*mf__nccl_error_fn)(ncclResult_t);

typedef struct mf__nccl_boot {
    ncclComm_t comm;
    int device;
    int num_ranks;
    cudaStream_t stream;
    void *staging; /* device: num_ranks * staging_bytes */
    size_t staging_bytes;
    mf__nccl_allgather_fn allgather;
    mf__nccl_error_fn error_string;
} mf__nccl_boot_t;

static void *mf__nccl_symbol(const char *name) {
    void *f = dlsym(RTLD_DEFAULT, name);
    if (f) return f;
    void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
    return lib ? dlsym(lib, name) : NULL;
}

static void mf__nccl_boot_destroy(void *ctx) {
    mf__nccl_boot_t *b = ctx;
    if (!b) return;
    cudaSetDevice(b->device);
    if (b->staging) cudaFree(b->staging);
    if (b->stream) cudaStreamDestroy(b->stream);
    (void)cudaGetLastError();
    mf__free(b);
}

static int32_t mf__nccl_allgather(void *ctx, const void *send, void *recv, size_t bytes) {
    mf__nccl_boot_t *b = ctx;
    if (cudaSetDevice(b->device) != cudaSuccess) goto cuda_fail;
    if (bytes > b->staging_bytes) {
        if (b->staging) cudaFree(b->staging);
        b->staging = NULL;
        b->staging_bytes = 0;
        if (cudaMalloc(&b->staging, bytes * (size_t)(b->num_ranks + 1)) != cudaSuccess) goto cuda_fail;
        b->staging_bytes = bytes;
    }
    if (!bytes) return 0;
    uint8_t *mine = (uint8_t *)b->staging + bytes * (size_t)b->num_ranks;
    if (cudaMemcpyAsync(mine, send, bytes, cudaMemcpyHostToDevice, b->stream) != cudaSuccess) goto cuda_fail;
    ncclResult_t nr = b->allgather(mine, b->staging, bytes, ncclUint8, b->comm, b->stream);
    if (nr != ncclSuccess) {
        mf__error(MF_ERR_NCCL, "ncclAllGather of %zu bytes: %s", bytes, b->error_string ? b->error_string(nr) : "failed");
        return 1;
    }
    if (cudaMemcpyAsync(recv, b->staging, bytes * (size_t)b->num_ranks, cudaMemcpyDeviceToHost, b->stream) != cudaSuccess ||
        cudaStreamSynchronize(b->stream) != cudaSuccess)
        goto cuda_fail;
    return 0;
cuda_fail:
    mf__error(MF_ERR_CUDA, "nccl bootstrap: %s", cudaGetErrorString(cudaGetLastError()));
    return 1;
}

mf_result_t mf__nccl_bootstrap(void *nccl_comm, mf_bootstrap_t *bootstrap, int32_t *rank, int32_t *num_ranks,
                               int32_t *device) {
    mf__nccl_int_fn user_rank = (mf__nccl_int_fn)mf__nccl_symbol("ncclCommUserRank");
    mf__nccl_int_fn count = (mf__nccl_int_fn)mf__nccl_symbol("ncclCommCount");
    mf__nccl_int_fn cu_device = (mf__nccl_int_fn)mf__nccl_symbol("ncclCommCuDevice");
    mf__nccl_allgather_fn allgather = (mf__nccl_allgather_fn)mf__nccl_symbol("ncclAllGather");
    if (!user_rank || !count || !cu_device || !allgather)
        return mf__error(MF_ERR_NOT_SUPPORTED, "nccl transport: no libnccl is loaded in this process or loadable as "
                         "libnccl.so.2 (dlerror: %s)", dlerror() ? dlerror() : "none");
    ncclComm_t comm = (ncclComm_t)nccl_comm;
    int r = -1, n = -1, dev = -1;
    if (user_rank(comm, &r) != ncclSuccess || count(comm, &n) != ncclSuccess || cu_device(comm, &dev) != ncclSuccess)
        return mf__error(MF_ERR_NCCL, "nccl transport: the ncclComm does not answer its rank, size or device");
    mf__nccl_boot_t *b = mf__calloc(1, sizeof *b);
    if (!b) return mf__error(MF_ERR_OUT_OF_MEMORY, "nccl transport: out of host memory");
    b->comm = comm;
    b->device = dev;
    b->num_ranks = n;
    b->allgather = allgather;
    b->error_string = (mf__nccl_error_fn)mf__nccl_symbol("ncclGetErrorString");
    if (cudaSetDevice(dev) != cudaSuccess || cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking) != cudaSuccess) {
        mf__nccl_boot_destroy(b);
        return mf__error(MF_ERR_CUDA, "nccl transport: %s", cudaGetErrorString(cudaGetLastError()));
    }
    bootstrap->allgather = mf__nccl_allgather;
    bootstrap->ctx = b;
    bootstrap->destroy = mf__nccl_boot_destroy;
    *rank = r;
    *num_ranks = n;
    *device = dev;
    return MF_SUCCESS;
}

static mf_result_t mf__nccl_sym_alloc(mf_comm_t comm, size_t bytes, mf__sym_t *sym) {
    return mf__transport_ipc.sym_alloc(comm, bytes, sym);
}

static void mf__nccl_sym_free(mf_comm_t comm, mf__sym_t *sym) { mf__transport_ipc.sym_free(comm, sym); }

const mf__transport_ops_t mf__transport_nccl = {"nccl", mf__nccl_sym_alloc, mf__nccl_sym_free};

#else
typedef int mf__nccl_needs_cuda; /* a CPU-only build has no nccl transport */
#endif
