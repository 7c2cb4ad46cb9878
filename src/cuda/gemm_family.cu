/*
 * gemm_family.cu — the launch scaffolding shared by the sm90 GEMM families (gemm_family.cuh).
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core/debug.h"
#include "cuda/gemm_family.cuh"

namespace {
/* Why the last call of this thread declined, and (MF_DEBUG) what its last launch ran, per family. */
thread_local char g_decline[kMfGemmFamilies][256];
thread_local char g_ran[kMfGemmFamilies][256];
/* Launches per family in this process (the tests check which family ran: a decline falls back
 * silently by design). */
std::atomic<uint64_t> g_launches[kMfGemmFamilies];
} /* namespace */

mf_result_t mf__gemm_decline(const mf__gemm_family_t *f, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_decline[f->id], sizeof g_decline[f->id], fmt, ap);
    va_end(ap);
    return MF_ERR_NOT_SUPPORTED;
}

void mf__gemm_report_launch(const mf__gemm_family_t *f, const char *fmt, ...) {
    g_launches[f->id].fetch_add(1, std::memory_order_relaxed);
    if (!mf__debug_on()) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_ran[f->id], sizeof g_ran[f->id], fmt, ap);
    va_end(ap);
}

const char *mf__gemm_last_decline(int family) { return g_decline[family]; }

const char *mf__gemm_last_launch(int family) { return g_ran[family]; }

uint64_t mf__gemm_launches(int family) { return g_launches[family].load(std::memory_order_relaxed); }

mf_result_t mf__gemm_configure(mf__gemm_family_t *f, const char *who, int *dev_out, int *sms_out) {
    int dev = 0;
    MF__GEMM_CUDA(cudaGetDevice(&dev), who);
    *dev_out = dev;
    if (dev < 0 || dev >= kMfGemmMaxDevices)
        return mf__gemm_decline(f, "device %d is beyond the launcher's table (%d)", dev, kMfGemmMaxDevices);
    if (f->usable[dev].load() != 0) {
        *sms_out = f->sms[dev].load();
        return MF_SUCCESS;
    }
    int major = 0, minor = 0, sms = 0;
    MF__GEMM_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), who);
    MF__GEMM_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), who);
    MF__GEMM_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), who);
    int64_t usable = kMfGemmConfigured;
    if (major == 9) {
        const int n = f->count();
        for (int i = 0; i < n && i < kMfGemmMaxVariants; i++) {
            const void *fn = f->fn(i);
            const int smem = f->info(i).smem_bytes;
            cudaFuncAttributes fa;
            MF__GEMM_CUDA(cudaFuncGetAttributes(&fa, fn), who);
            MF__GEMM_CUDA(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), who);
            if (fa.numRegs == f->launch_regs) usable |= (int64_t)1 << i;
        }
    }
    f->sms[dev].store(sms);
    f->cc[dev].store(10 * major + minor);
    f->usable[dev].store(usable);
    *sms_out = sms;
    return MF_SUCCESS;
}

mf_result_t mf__gemm_preload(mf__gemm_family_t *f, const char *who) {
    int dev = 0, sms = 0;
    mf_result_t r = mf__gemm_configure(f, who, &dev, &sms);
    return r == MF_ERR_NOT_SUPPORTED ? MF_SUCCESS : r; /* a device beyond the table: its calls decline */
}

mf_result_t mf__gemm_require(const mf__gemm_family_t *f, int dev, int vi) {
    if (f->usable[dev].load() & ((int64_t)1 << vi)) return MF_SUCCESS;
    const int cc = f->cc[dev].load();
    if (cc / 10 != 9) return mf__gemm_decline(f, "sm90 unsupported: device %d is sm_%d", dev, cc);
    return mf__gemm_decline(f, "variant %d unusable on device %d (registers != %d)", vi, dev, f->launch_regs);
}

int64_t mf__gemm_usable(const mf__gemm_family_t *f, int dev) {
    return dev >= 0 && dev < kMfGemmMaxDevices ? f->usable[dev].load() : 0;
}

int mf__gemm_variants(mf__gemm_family_t *f, const char *who, mf__gemm_variant_info_t *out, int max) {
    int dev = 0, sms = 0;
    if (mf__gemm_configure(f, who, &dev, &sms) == MF_ERR_CUDA) return -1;
    const int64_t usable = mf__gemm_usable(f, dev);
    const int n = f->count();
    for (int i = 0; i < n && out && i < max; i++) {
        cudaFuncAttributes fa;
        memset(&fa, 0, sizeof fa);
        if (cudaFuncGetAttributes(&fa, f->fn(i)) != cudaSuccess) {
            (void)cudaGetLastError();
            return -1;
        }
        mf__gemm_variant_info_t &o = out[i];
        o = f->info(i);
        o.num_regs = fa.numRegs;
        o.local_bytes = (int32_t)fa.localSizeBytes;
        o.usable = (usable >> i) & 1;
    }
    return n;
}

mf_result_t mf__gemm_check_segments(const mf__gemm_family_t *f, const mf__gemm_segments_t *seg, int64_t N,
                                    int32_t max_experts) {
    if (seg->num_experts > max_experts)
        return mf__gemm_decline(f, "L = %d > %d (the kernel's expert tables)", seg->num_experts, max_experts);
    if ((int64_t)seg->num_experts * N > kMfGemmMaxRowCoord)
        return mf__gemm_decline(f, "L * N = %lld rows exceed int32 TMA coordinates", (long long)seg->num_experts * N);
    return MF_SUCCESS;
}

