/*
 * ipc.c — the `ipc` transport: every rank is a process of this host. A symmetric allocation is
 * exported as a handle that crosses the bootstrap as plain bytes, so any allgather carries it (an
 * engine's process group too):
 *   CPU backend   POSIX shared memory: the handle is the object's name; each peer opens and maps
 *                 it; once all have mapped it, the owner unlinks the name (the mappings live on,
 *                 and a crash later leaves nothing behind in /dev/shm).
 *   CUDA backend  cudaMalloc + a CUDA IPC handle (cudaIpcGetMemHandle / cudaIpcOpenMemHandle).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if MF_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "core/backend.h"
#include "core/errors.h"
#include "core/handles.h"
#include "core/layout.h"
#include "transport/transport.h"

#define MF__IPC_HANDLE_BYTES 64

typedef struct mf__ipc_handle {
    int32_t status;
    int32_t pad;
    char bytes[MF__IPC_HANDLE_BYTES]; /* a shm name (NUL-terminated) or a cudaIpcMemHandle_t */
} mf__ipc_handle_t;

/* Maps peer q's memory from its handle into this process; NULL with the error set on failure. */
typedef void *(*mf__ipc_import_fn)(mf_comm_t comm, int32_t q, const mf__ipc_handle_t *handle, size_t bytes);

/* The exchange both kinds of memory share: every rank's export verdict agreed, the handles
 * allgathered, every peer's imported, the imports agreed. Fills sym (local = p); on failure the
 * peers mapped so far stay in sym for the caller to undo. */
static mf_result_t mf__ipc_exchange(mf_comm_t comm, size_t bytes, void *p, const mf__ipc_handle_t *mine,
                                    mf__ipc_import_fn import, mf__sym_t *sym) {
    mf__ipc_handle_t all[MF_MAX_RANKS];
    mf_result_t res = mf__agree(comm, (mf_result_t)mine->status, "symmetric allocation (ipc)");
    if (res == MF_SUCCESS) res = mf__allgather(comm, mine, all, sizeof *mine, "symmetric allocation (ipc)");
    sym->bytes = bytes;
    sym->local = sym->peers[comm->rank] = p;
    mf_result_t mapped = MF_SUCCESS;
    for (int32_t q = 0; res == MF_SUCCESS && q < comm->num_ranks && mapped == MF_SUCCESS; q++) {
        if (q == comm->rank) continue;
        sym->peers[q] = import(comm, q, &all[q], bytes);
        if (!sym->peers[q]) mapped = comm->backend == MF_BACKEND_CUDA ? MF_ERR_CUDA : MF_ERR_SYSTEM;
    }
    if (res == MF_SUCCESS) res = mf__agree(comm, mapped, "mapping the peers' memory (ipc)");
    return res;
}

/* ---- host memory: POSIX shared memory ------------------------------------------------------ */

static void mf__shm_unmap(mf_comm_t comm, mf__sym_t *sym) {
    for (int32_t q = 0; q < comm->num_ranks; q++)
        if (sym->peers[q]) munmap(sym->peers[q], sym->bytes);
}

static void *mf__shm_map(const char *name, size_t bytes, int create) {
    int fd = shm_open(name, O_RDWR | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0), 0600);
    if (fd < 0) return NULL;
    if (create && ftruncate(fd, (off_t)bytes) != 0) {
        close(fd);
        shm_unlink(name);
        return NULL;
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        if (create) shm_unlink(name);
        return NULL;
    }
    return p;
}

static void *mf__shm_import(mf_comm_t comm, int32_t q, const mf__ipc_handle_t *h, size_t bytes) {
    void *p = mf__shm_map(h->bytes, bytes, 0);
    if (!p)
        mf__error(MF_ERR_SYSTEM, "ipc transport: rank %d cannot map rank %d's shared memory %s: %s", comm->rank, q,
                  h->bytes, strerror(errno));
    return p;
}

static mf_result_t mf__shm_alloc(mf_comm_t comm, size_t bytes, mf__sym_t *sym) {
    static int counter;
    mf__ipc_handle_t mine;
    memset(&mine, 0, sizeof mine);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    snprintf(mine.bytes, sizeof mine.bytes, "/moeflow-%ld-%d-%d-%lx", (long)getpid(), comm->rank,
             __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED), (unsigned long)ts.tv_nsec);
    void *p = mf__shm_map(mine.bytes, bytes, 1);
    if (!p)
        mine.status = mf__error(MF_ERR_SYSTEM, "ipc transport: rank %d: shared memory %s of %zu bytes: %s",
                                comm->rank, mine.bytes, bytes, strerror(errno));
    mf_result_t res = mf__ipc_exchange(comm, bytes, p, &mine, mf__shm_import, sym);
    if (p) shm_unlink(mine.bytes); /* every peer has mapped it (or given up): the name can go */
    if (res != MF_SUCCESS) {
        mf__shm_unmap(comm, sym);
        memset(sym, 0, sizeof *sym);
    }
    return res;
}

/* ---- device memory: CUDA IPC --------------------------------------------------------------- */

#if MF_WITH_CUDA
static void mf__cuda_ipc_close(mf_comm_t comm, mf__sym_t *sym) {
    for (int32_t q = 0; q < comm->num_ranks; q++)
        if (q != comm->rank && sym->peers[q]) cudaIpcCloseMemHandle(sym->peers[q]);
    if (sym->local) comm->ops->mem_free(comm, sym->local);
    (void)cudaGetLastError();
}

static void *mf__cuda_ipc_import(mf_comm_t comm, int32_t q, const mf__ipc_handle_t *handle, size_t bytes) {
    (void)bytes;
    cudaIpcMemHandle_t h;
    memcpy(&h, handle->bytes, sizeof h);
    void *p = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e == cudaSuccess) return p;
    (void)cudaGetLastError();
    mf__error(MF_ERR_CUDA, "ipc transport: rank %d cannot open rank %d's CUDA IPC handle: %s", comm->rank, q,
              cudaGetErrorString(e));
    return NULL;
}

static mf_result_t mf__cuda_ipc_alloc(mf_comm_t comm, size_t bytes, mf__sym_t *sym) {
    _Static_assert(sizeof(cudaIpcMemHandle_t) <= MF__IPC_HANDLE_BYTES, "a CUDA IPC handle fits the exchange");
    mf__ipc_handle_t mine;
    memset(&mine, 0, sizeof mine);
    void *p = NULL;
    mine.status = comm->ops->mem_alloc(comm, bytes, &p);
    if (mine.status == MF_SUCCESS) {
        cudaIpcMemHandle_t h;
        cudaError_t e = cudaIpcGetMemHandle(&h, p);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            mine.status = mf__error(MF_ERR_CUDA, "ipc transport: rank %d: cudaIpcGetMemHandle: %s", comm->rank,
                                    cudaGetErrorString(e));
        }
        memcpy(mine.bytes, &h, sizeof h);
    }
    mf_result_t res = mf__ipc_exchange(comm, bytes, p, &mine, mf__cuda_ipc_import, sym);
    if (res != MF_SUCCESS) {
        mf__cuda_ipc_close(comm, sym);
        memset(sym, 0, sizeof *sym);
    }
    return res;
}
#endif

static mf_result_t mf__ipc_sym_alloc(mf_comm_t comm, size_t bytes, mf__sym_t *sym) {
    memset(sym, 0, sizeof *sym);
#if MF_WITH_CUDA
    if (comm->backend == MF_BACKEND_CUDA) return mf__cuda_ipc_alloc(comm, bytes, sym);
#endif
    return mf__shm_alloc(comm, bytes, sym);
}

static void mf__ipc_sym_free(mf_comm_t comm, mf__sym_t *sym) {
    if (!sym->local) return;
#if MF_WITH_CUDA
    if (comm->backend == MF_BACKEND_CUDA) {
        mf__cuda_ipc_close(comm, sym);
        memset(sym, 0, sizeof *sym);
        return;
    }
#endif
    mf__shm_unmap(comm, sym);
    memset(sym, 0, sizeof *sym);
}

const mf__transport_ops_t mf__transport_ipc = {"ipc", mf__ipc_sym_alloc, mf__ipc_sym_free};
