/*
 * transport.h — how ranks reach each other: setup-only operations over a bootstrap (allgather,
 * barrier) and symmetric allocations, one file per transport under src/transport/.
 *
 * A symmetric allocation is: allocate `bytes` of the backend's memory on every rank (host memory
 * for the CPU backend, device memory for CUDA), export a handle, allgather the handles, import
 * every peer's. The result is a peer table, `sym->peers[r]`, that this process can load from and
 * store to; core passes that table to the backend, and kernels only ever see the table. Nothing
 * here runs on the data path.
 *
 *   local.c       ranks are threads of one process: the handle is the pointer itself (CUDA: peer
 *                 access is enabled between the ranks' devices when they differ)
 *   ipc.c         ranks are processes of one host: POSIX shared memory (CPU backend) or CUDA IPC
 *                 handles (CUDA backend)
 *   nccl.c        the caller's ncclComm_t: its allgather as the bootstrap, and NCCL symmetric
 *                 windows where the comm supports them (else the ipc transport maps the memory)
 *   rendezvous.c  the built-in bootstrap for tools and tests (mf_rendezvous_*)
 */
#ifndef MF_TRANSPORT_TRANSPORT_H
#define MF_TRANSPORT_TRANSPORT_H

#include "core/handles.h"
#include "core/layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* mf__sym_t, one symmetric allocation as this process sees it, is in core/layout.h. */

struct mf__transport_ops {
    const char *name;
    /* Collective over the comm's ranks (uses the comm's bootstrap); blocking. On failure nothing
     * stays allocated or mapped, and every rank fails (the verdict is agreed over the bootstrap). */
    mf_result_t (*sym_alloc)(mf_comm_t comm, size_t bytes, mf__sym_t *sym);
    /* Local: unmaps the peers' memory and frees this rank's. The caller has made sure (a barrier,
     * unless the comm is broken) that no peer still uses it. NULL-safe on a zeroed sym. */
    void (*sym_free)(mf_comm_t comm, mf__sym_t *sym);
};

extern const mf__transport_ops_t mf__transport_local;
extern const mf__transport_ops_t mf__transport_ipc;

/* Setup-time collectives over the comm's bootstrap. mf__allgather gathers `bytes` of every rank
 * into all[r * bytes]; mf__barrier returns when every rank has entered it. Failures of the
 * caller's allgather come back as MF_ERR_SYSTEM naming `what`. */
mf_result_t mf__allgather(mf_comm_t comm, const void *mine, void *all, size_t bytes, const char *what);
mf_result_t mf__barrier(mf_comm_t comm, const char *what);

/* Agrees on a verdict: every rank passes its own result; all get MF_SUCCESS or the same failure
 * (the lowest failing rank's code, with a message naming that rank and `what`; the failing rank
 * keeps its own message). */
mf_result_t mf__agree(mf_comm_t comm, mf_result_t mine, const char *what);

#if MF_WITH_CUDA
/* nccl.c. Fills *bootstrap with an allgather over the caller's ncclComm_t (borrowed; the
 * bootstrap's destroy frees only moeflow's context) and reads the comm's rank, size and CUDA
 * device. NCCL's symbols are resolved in this process (the libnccl that made the comm), never
 * linked: MF_ERR_NOT_SUPPORTED when no libnccl is loaded or loadable, MF_ERR_NCCL when a call
 * fails. */
mf_result_t mf__nccl_bootstrap(void *nccl_comm, mf_bootstrap_t *bootstrap, int32_t *rank,
                               int32_t *num_ranks, int32_t *device);
/* A symmetric allocation in NCCL symmetric-memory windows with LSA (NVLink load/store) pointers to
 * every peer: MF_ERR_NOT_SUPPORTED (nothing allocated, on every rank alike) when the comm has no
 * symmetric support or some peer is not LSA-reachable; the caller then uses mf__transport_ipc. */
extern const mf__transport_ops_t mf__transport_nccl;
#endif

#ifdef __cplusplus
}
#endif

#endif /* MF_TRANSPORT_TRANSPORT_H */
