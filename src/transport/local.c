/*
 * local.c — the `local` transport: every rank is a thread of this process, so a rank's memory is
 * reachable through its own pointer, and the exported handle is that pointer. With the CUDA
 * backend the ranks share one device (virtual ranks) or use one device each; then peer access is
 * enabled towards every other rank's device.
 */
#include <string.h>

#if MF_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "core/alloc.h"
#include "core/backend.h"
#include "core/errors.h"
#include "core/handles.h"
#include "core/layout.h"
#include "transport/transport.h"

typedef struct mf__local_handle {
    uint64_t ptr;
    int32_t device;
    int32_t status;
} mf__local_handle_t;

/* The ranks share one address space, so a rank's free unmaps its memory for every peer at once.
 * On a broken or aborted comm no barrier told this rank that its peers stopped: a peer that has not
 * seen the fault yet may still copy into this memory from its host (a staged map's step, a
 * prefetch), and a copy into freed device memory is a host memory access (cudaMemcpyDefault reads
 * an unmapped address as pageable memory: a segfault). The memory then stays until the comm is
 * destroyed, which for virtual ranks is mf_group_destroy, after every rank's thread is done. */
static void mf__local_sym_free(mf_comm_t comm, mf__sym_t *sym) {
    mf__deferred_free_t *later = NULL;
    if (sym->local && (comm->broken || __atomic_load_n(&comm->aborted, __ATOMIC_ACQUIRE)))
        later = mf__malloc(sizeof *later);
    if (later) {
        later->ptr = sym->local;
        later->next = comm->deferred;
        comm->deferred = later;
    } else if (sym->local) {
        comm->ops->mem_free(comm, sym->local);
    }
    memset(sym, 0, sizeof *sym);
}

static mf_result_t mf__local_peer_access(mf_comm_t comm, const mf__local_handle_t *all) {
#if MF_WITH_CUDA
    if (comm->backend != MF_BACKEND_CUDA) return MF_SUCCESS;
    for (int32_t q = 0; q < comm->num_ranks; q++) {
        if (all[q].device == comm->device) continue;
        cudaError_t e = cudaDeviceEnablePeerAccess(all[q].device, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) e = cudaSuccess;
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            return mf__error(MF_ERR_CUDA, "local transport: rank %d (device %d) cannot access rank %d's device %d: %s",
                             comm->rank, comm->device, q, all[q].device, cudaGetErrorString(e));
        }
    }
#else
    (void)comm;
    (void)all;
#endif
    return MF_SUCCESS;
}

static mf_result_t mf__local_sym_alloc(mf_comm_t comm, size_t bytes, mf__sym_t *sym) {
    memset(sym, 0, sizeof *sym);
    mf__local_handle_t mine = {0, comm->device, MF_SUCCESS}, all[MF_MAX_RANKS];
    void *p = NULL;
    mine.status = comm->ops->mem_alloc(comm, bytes, &p);
    mine.ptr = (uint64_t)(uintptr_t)p;
    mf_result_t res = mf__agree(comm, mine.status, "symmetric allocation (local)");
    if (res == MF_SUCCESS) res = mf__allgather(comm, &mine, all, sizeof mine, "symmetric allocation (local)");
    if (res == MF_SUCCESS) res = mf__agree(comm, mf__local_peer_access(comm, all), "peer access (local)");
    if (res != MF_SUCCESS) {
        if (p) comm->ops->mem_free(comm, p);
        return res;
    }
    sym->local = p;
    sym->bytes = bytes;
    for (int32_t q = 0; q < comm->num_ranks; q++) sym->peers[q] = (void *)(uintptr_t)all[q].ptr;
    return MF_SUCCESS;
}

const mf__transport_ops_t mf__transport_local = {"local", mf__local_sym_alloc, mf__local_sym_free};
