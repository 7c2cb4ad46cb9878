/*
 * gemm_family.cuh — the launch scaffolding every sm90 expert-GEMM family shares: the decode kernels
 * (gemm_decode.cu) and the large-M TMA kernels (gemm_tma.cu) configure, decline and report through
 * these functions, one path for both (the mma.sync kernels of grouped_gemm.cu are the dispatcher's
 * named fallback, "v1", and size their grids by occupancy instead).
 *
 *   configure  per device, once: every variant loaded (cudaFuncGetAttributes: no lazy module load
 *              can happen later on the data path), its dynamic shared-memory limit raised, and its
 *              register count checked against the family's launch_regs (setmaxnreg's assumption:
 *              with fewer, the consumers' setmaxnreg.inc would wait forever); the usable variants
 *              form a bit mask. Concurrent first calls from several rank threads do the same
 *              idempotent work.
 *   decline    a shape or argument the family does not take returns MF_ERR_NOT_SUPPORTED without
 *              launching and without a library error (the dispatcher then tries the next family);
 *              the reason is kept per thread and family (the dispatcher's MF_DEBUG report, the labs).
 *   report     under MF_DEBUG, what the last launch of this thread ran.
 *   list       each variant's template parameters, shared-memory map and registers, for the labs
 *              and diagnostics (mf__gemm_variants).
 *
 * C++ (CUDA) linkage, included by .cu files only.
 */
#ifndef MF_CUDA_GEMM_FAMILY_CUH
#define MF_CUDA_GEMM_FAMILY_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "core/errors.h"
#include "cuda/gemm_configs.cuh" /* kMfGemmMaxDevices, kMfGemmMaxVariants, the alignments */
#include "cuda/grouped_gemm.h"

enum { kMfGemmFamilies = 3 }; /* the families on this skeleton: decode, tma and small (grouped_gemm.h) */
static_assert(kMfGemmMaxVariants < 63, "one usable bit per variant, below kMfGemmConfigured");
constexpr int64_t kMfGemmConfigured = (int64_t)1 << 62; /* usable[dev]: the device was examined */

/* What a family ships, for the labs and for diagnostics: one entry per kernel variant. */
typedef struct mf__gemm_variant_info {
    int32_t fp8, swiglu, block_t, gather; /* the template parameters (TMA: block_t and gather 0) */
    int32_t smem_bytes, stages;           /* the shared-memory map */
    int32_t num_regs, local_bytes;        /* cudaFuncGetAttributes on the current device */
    int32_t usable;                       /* num_regs == launch_regs (setmaxnreg's assumption) */
} mf__gemm_variant_info_t;

typedef struct mf__gemm_family {
    int id;                           /* kMfGemmFamily*: the per-thread report buffers */
    int launch_regs;                  /* registers every usable variant was compiled to */
    int (*count)(void);               /* variants, at most kMfGemmMaxVariants */
    const void *(*fn)(int variant);   /* its kernel */
    mf__gemm_variant_info_t (*info)(int variant); /* its parameters and smem_bytes (dynamic), stages */
    std::atomic<int64_t> usable[kMfGemmMaxDevices]; /* kMfGemmConfigured | a bit per usable variant; 0: not yet */
    std::atomic<int> sms[kMfGemmMaxDevices];
    std::atomic<int> cc[kMfGemmMaxDevices]; /* 10 * major + minor */
} mf__gemm_family_t;

/* Evaluates a CUDA runtime call; on failure clears the error and returns MF_ERR_CUDA naming it. */
#define MF__GEMM_CUDA(call, who)                                                                   \
    do {                                                                                           \
        cudaError_t mf__e = (call);                                                                \
        if (mf__e != cudaSuccess) {                                                                \
            (void)cudaGetLastError();                                                              \
            return mf__error(MF_ERR_CUDA, "%s: %s failed: %s", who, #call, cudaGetErrorString(mf__e)); \
        }                                                                                          \
    } while (0)

static inline bool mf__gemm_aligned(const void *p, uintptr_t a) { return ((uintptr_t)p % a) == 0; }

/* Records why this thread's call declined and returns MF_ERR_NOT_SUPPORTED. */
mf_result_t mf__gemm_decline(const mf__gemm_family_t *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Counts a launch of family f (mf__gemm_launches) and, under MF_DEBUG (mf__debug_on), records what
 * this thread's launch ran. Every family calls it once per launch. */
void mf__gemm_report_launch(const mf__gemm_family_t *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Why the calling thread's last call of family `family` (kMfGemmFamily*) declined
 * (MF_ERR_NOT_SUPPORTED is returned without a library error, so that the dispatcher's fallback
 * stays quiet); "" before any. */
const char *mf__gemm_last_decline(int family);
/* Under MF_DEBUG: what the calling thread's last launch of family `family` ran (variant, stages,
 * grid); "" before any. Not written when MF_DEBUG is off. */
const char *mf__gemm_last_launch(int family);

/* The launches of family `family` (kMfGemmFamily*) in this process so far. */
uint64_t mf__gemm_launches(int family);

/* The current device (dev) and its SM count (sms), the device examined first if it was not yet
 * (see the file comment). A device beyond the tables declines; CUDA errors are MF_ERR_CUDA. */
mf_result_t mf__gemm_configure(mf__gemm_family_t *f, const char *who, int *dev, int *sms);

/* Configures the current device as mf__gemm_configure does, before any rank can spin (group
 * init); a device beyond the tables is not an error here (its calls decline). */
mf_result_t mf__gemm_preload(mf__gemm_family_t *f, const char *who);

/* MF_SUCCESS when variant `vi` can launch on configured device `dev`; else declines saying why
 * (not an sm_90 device, or the wrong register count). */
mf_result_t mf__gemm_require(const mf__gemm_family_t *f, int dev, int vi);

/* The usable mask of device `dev` (0 beyond the tables or before configure). */
int64_t mf__gemm_usable(const mf__gemm_family_t *f, int dev);

/* Fills up to `max` entries (NULL: none) for the current device (configuring it: loads the kernels)
 * and returns the number of variants, or -1 on a CUDA error. */
int mf__gemm_variants(mf__gemm_family_t *f, const char *who, mf__gemm_variant_info_t *out, int max);

/* What both families can run of the segments: L <= max_experts (their shared-memory tables), L * N
 * weight rows within int32 TMA coordinates. MF_SUCCESS or a decline saying which (the shape's own
 * multiples stay with each family). The arguments themselves (NULLs, alignment, dtype, counts) were
 * checked once, by the dispatcher (cuda/grouped_gemm.cu): a family only declines what it cannot run. */
mf_result_t mf__gemm_check_segments(const mf__gemm_family_t *f, const mf__gemm_segments_t *seg, int64_t N,
                                    int32_t max_experts);

#endif /* MF_CUDA_GEMM_FAMILY_CUH */
