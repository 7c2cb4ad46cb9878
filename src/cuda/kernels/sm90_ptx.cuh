/*
 * sm90_ptx.cuh — thin C-style wrappers of the Hopper (sm_90a) instructions that the warp-specialised
 * kernels are built from: mbarriers, TMA (cp.async.bulk.tensor) 2D loads, wgmma, register
 * reallocation, and a host helper that encodes a CUtensorMap without linking libcuda (the driver
 * entry point is fetched through the runtime). Included by the sm90 kernels and the dev/cuda labs.
 * Only what the kernels use is here (3D, multicast and store forms were dropped unused).
 *
 * Every device function is `__device__ __forceinline__` and prefixed `mf__`; each is one
 * instruction (or one short, fixed sequence) from the PTX ISA, named after it. Shared-memory
 * addresses are passed as generic pointers and converted here. Every spin-wait is bounded by
 * %globaltimer: on expiry it records its block, thread and site in the comm's fault sink
 * (kernels/fault.cuh) and returns (the library's kernels) or traps (the labs' own), so the host
 * sees a fault instead of a hung GPU, and can say which wait expired.
 *
 * Dimension legend (wgmma): a warpgroup (4 warps, 128 threads) computes D[64, N] += A[64, K] . B[N, K]^T
 * with K = 16 (BF16) or 32 (E4M3) per instruction, fp32 accumulators. Both operands are read from
 * shared memory through matrix descriptors (mf__wgmma_desc); this file describes K-major tiles,
 * the only layout the E4M3 instructions accept. The accumulator fragment of thread t (warp w = t/32
 * of the warpgroup, lane l = t%32) holds, for j in [0, N/8): d[4j + 0,1] = D[16w + l/4][8j + 2(l%4) + 0,1]
 * and d[4j + 2,3] = D[16w + l/4 + 8][8j + 2(l%4) + 0,1].
 *
 * Shared-memory tile convention (TMA with CU_TENSOR_MAP_SWIZZLE_128B <-> wgmma swizzle mode 1): a
 * tile of R rows x 128 bytes of K, row r at byte 128 r, the 16-byte chunk c of row r stored at chunk
 * c ^ (r % 8); tile base aligned to 1024 bytes (one swizzle atom = 8 rows). Its descriptor has
 * SBO = 1024 (distance between 8-row groups), LBO unused (1), layout type 1; the k-th 32-byte
 * (E4M3 k32 / BF16 k16) slice of the 128-byte row is addressed by adding 32 k bytes to the start
 * address (the hardware applies the XOR on the final address bits, which is why the base must be
 * 1024-aligned). A 64-row wgmma operand starting at row 64 m is at byte 8192 m.
 */
#ifndef MF_CUDA_KERNELS_SM90_PTX_CUH
#define MF_CUDA_KERNELS_SM90_PTX_CUH

#include <cuda.h>        /* CUtensorMap and its enums: types only, no libcuda symbol is referenced */
#include <cuda_runtime.h>
#include <cudaTypedefs.h> /* PFN_cuTensorMapEncodeTiled_v12000 */
#include <stdint.h>
#include <stdio.h>

/* ---- constants: warpgroup and swizzle sizes, the default wait bound (cuda/gemm_configs.cuh) ---- */

#include "cuda/gemm_configs.cuh"
#include "cuda/kernels/fault.cuh" /* the comm's fault sink: where an expired wait records itself */
#include "cuda/pdl.cuh" /* mf__pdl_wait / mf__pdl_trigger: griddepcontrol, for every kernel built on this file */

/* wgmma descriptor layout types (bits 62-63). */
enum {
    kMfWgmmaInterleave = 0,
    kMfWgmmaSwizzle128B = 1,
    kMfWgmmaSwizzle64B = 2,
    kMfWgmmaSwizzle32B = 3
};

/* L2 cache policies for TMA loads (createpolicy results), by name. */
enum { kMfL2EvictNormal = 0, kMfL2EvictFirst = 1, kMfL2EvictLast = 2 };

/* ---- addresses, lanes, warps ------------------------------------------------------------------- */

__device__ __forceinline__ uint32_t mf__smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* The warp index of the calling thread, made warp-uniform (so the compiler keeps branches on it
 * uniform). */
__device__ __forceinline__ int mf__warp_id(void) { return __shfl_sync(0xffffffffu, (int)(threadIdx.x / 32), 0); }

/* The warpgroup index (threads [128 g, 128 g + 128)), warp-uniform. */
__device__ __forceinline__ int mf__warpgroup_id(void) {
    return __shfl_sync(0xffffffffu, (int)(threadIdx.x / kMfWarpgroupThreads), 0);
}

__device__ __forceinline__ uint64_t mf__globaltimer(void) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* bar.sync on named barrier `id` (1..15; 0 is __syncthreads) by `threads` threads (multiple of 32). */
__device__ __forceinline__ void mf__named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void mf__named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* ---- register reallocation (warpgroup-wide, immediate counts, multiples of 8 in [24, 256]) ---- */

template <int kRegs>
__device__ __forceinline__ void mf__setmaxnreg_inc(void) {
    static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg count");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

template <int kRegs>
__device__ __forceinline__ void mf__setmaxnreg_dec(void) {
    static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg count");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

/* ---- fences ------------------------------------------------------------------------------------ */

/* Makes mbarrier.init visible to the async proxy (TMA) and to the cluster. */
__device__ __forceinline__ void mf__fence_mbarrier_init(void) {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/* Orders this thread's generic-proxy shared-memory accesses before later async-proxy ones (a TMA
 * store reading what st.shared wrote, or a TMA load overwriting what ld.shared read). */
__device__ __forceinline__ void mf__fence_proxy_async_smem(void) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* ---- mbarrier (shared::cta, 64-bit) ------------------------------------------------------------ */

__device__ __forceinline__ void mf__mbar_init(uint64_t *bar, uint32_t arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(mf__smem_addr(bar)), "r"(arrivals) : "memory");
}

__device__ __forceinline__ void mf__mbar_arrive(uint64_t *bar) {
    asm volatile(
        "{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(mf__smem_addr(bar))
        : "memory");
}

/* Arrives and adds `bytes` to the transaction count the current phase waits for. */
__device__ __forceinline__ void mf__mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile(
        "{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(
            mf__smem_addr(bar)),
        "r"(bytes)
        : "memory");
}

/* One try: true when the phase of parity `parity` has completed. */
__device__ __forceinline__ bool mf__mbar_try_wait(uint64_t *bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(mf__smem_addr(bar)), "r"(parity)
        : "memory");
    return done != 0;
}

/* A pipeline wait that expired (drained = 0), or that returned because another wait of this
 * process had expired (1), records itself in the comm's fault sink (kernels/fault.cuh), in the
 * record's pipeline words: the first one wins; the host then reports MF_ERR_INTERNAL naming block,
 * thread and wait site, and breaks the comm. A sink without state (a caller outside a comm) records
 * nothing. The cold path is inline (no printf, no call: a call in a kernel that issues wgmma makes
 * ptxas serialise every wgmma). */
__device__ __forceinline__ void mf__pipeline_fault(const mf__fault_sink_t &sink, uint32_t tag, int32_t drained) {
    if (!sink.state || atomicCAS(&sink.state->pipeline, 0, 1) != 0) return;
    mf__device_error_t *r = sink.record;
    r->pipeline_drained = drained;
    r->pipeline_block = (long long)blockIdx.x;
    r->pipeline_thread = (long long)threadIdx.x;
    r->pipeline_site = (long long)tag;
    __threadfence_system();
    r->pipeline = 1;
    __threadfence_system();
}

/* Waits until the phase of parity `parity` has completed (the usual ring idiom: a consumer of slot s
 * waits full[s] with parity (round & 1), a producer waits empty[s] with parity ((round & 1) ^ 1)).
 * Bounded by kMfSm90WaitTimeoutNs; on expiry it records itself in `sink` and traps (the labs'
 * own kernels; the library's waits return instead: mf__mbar_wait_bounded). */
__device__ __forceinline__ void mf__mbar_wait_tag(uint64_t *bar, uint32_t parity, uint32_t tag,
                                                  const mf__fault_sink_t &sink) {
    if (mf__mbar_try_wait(bar, parity)) return;
    uint64_t t0 = mf__globaltimer();
    while (!mf__mbar_try_wait(bar, parity)) {
        if (mf__globaltimer() - t0 > kMfSm90WaitTimeoutNs) {
            mf__pipeline_fault(sink, tag, 0);
            __threadfence_system();
            asm volatile("trap;");
        }
    }
}

/* ---- cluster ----------------------------------------------------------------------------------- */

/* ---- TMA: tensor loads (global -> shared, completion on an mbarrier) -------------------------- */

/* A 64-bit L2 cache policy for the .L2::cache_hint forms (kMfL2Evict*). */
__device__ __forceinline__ uint64_t mf__l2_policy(int kind) {
    uint64_t p;
    if (kind == kMfL2EvictFirst)
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    else if (kind == kMfL2EvictLast)
        asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
    else
        asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(p));
    return p;
}

/* Prefetches the tensor map (a __grid_constant__ kernel parameter or global) into the cache. */
__device__ __forceinline__ void mf__prefetch_tensormap(const CUtensorMap *map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)map) : "memory");
}

/* Box of `map` at coordinates (c0 innermost, c1) into L2 only: a hint, nothing waits for it. */
__device__ __forceinline__ void mf__tma_prefetch_2d(const CUtensorMap *map, int c0, int c1) {
    asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];" ::"l"((uint64_t)map), "r"(c0),
                 "r"(c1)
                 : "memory");
}

/* Box of `map` at coordinates (c0 innermost, c1) into smem `dst`; the box's full byte count
 * (out-of-bounds elements are zero-filled and still counted) completes on `bar`. */
__device__ __forceinline__ void mf__tma_load_2d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
            mf__smem_addr(dst)),
        "l"((uint64_t)map), "r"(mf__smem_addr(bar)), "r"(c0), "r"(c1)
        : "memory");
}

__device__ __forceinline__ void mf__tma_load_2d_hint(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1,
                                                     uint64_t policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(mf__smem_addr(dst)),
        "l"((uint64_t)map), "r"(mf__smem_addr(bar)), "r"(c0), "r"(c1), "l"(policy)
        : "memory");
}

/* ---- TMA: tensor stores (shared -> global, bulk-group completion) ----------------------------- */

/* ---- shared-memory matrix stores --------------------------------------------------------------- */

/* stmatrix x4: four 8x8 b16 matrices; lane l supplies the row address of row l%8 of matrix l/8, and
 * its register r_i holds (as two b16) row l/4, columns 2(l%4) .. +1 of matrix i. */
__device__ __forceinline__ void mf__stmatrix_x4(void *row_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(mf__smem_addr(row_addr)),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

/* ---- wgmma ------------------------------------------------------------------------------------- */

/* Shared-memory matrix descriptor: start address, leading / stride byte offsets (multiples of 16),
 * layout type (kMfWgmma*). Base offset (bits 49-51) is 0: tiles are aligned to their swizzle atom. */
__device__ __forceinline__ uint64_t mf__wgmma_desc(const void *smem, uint32_t lbo_bytes, uint32_t sbo_bytes, int layout) {
    uint64_t d = 0;
    d |= (uint64_t)((mf__smem_addr(smem) & 0x3ffffu) >> 4);
    d |= (uint64_t)((lbo_bytes & 0x3ffffu) >> 4) << 16;
    d |= (uint64_t)((sbo_bytes & 0x3ffffu) >> 4) << 32;
    d |= (uint64_t)(layout & 3) << 62;
    return d;
}

/* Descriptor of a K-major, 128B-swizzled tile (rows of 128 bytes, base 1024-aligned) starting at
 * `smem`; `smem` may be offset by k x 32 bytes inside the row to address the k-th wgmma K slice. */
__device__ __forceinline__ uint64_t mf__wgmma_desc_sw128(const void *smem) {
    return mf__wgmma_desc(smem, 16, kMfSwizzleAtomBytes, kMfWgmmaSwizzle128B);
}

/* Advances a descriptor's start address by `bytes` (multiple of 16; stays inside its 256 KB window). */
__device__ __forceinline__ uint64_t mf__wgmma_desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

/* Orders prior register accesses of the accumulators before the next wgmma (required before the
 * first wgmma of a group and whenever registers were touched in between). */
__device__ __forceinline__ void mf__wgmma_fence(void) { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

__device__ __forceinline__ void mf__wgmma_commit(void) { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

/* Waits until at most kPending committed wgmma groups are in flight. */
template <int kPending>
__device__ __forceinline__ void mf__wgmma_wait(void) {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

/* Compiler-only fence on an accumulator register: keeps reads/writes of `r` from moving across the
 * wgmma issue/wait points (the asm above cannot name every register it touches). */
__device__ __forceinline__ void mf__fence_operand(float &r) { asm volatile("" : "+f"(r)::"memory"); }

template <int kN>
__device__ __forceinline__ void mf__fence_fragment(float *d) {
#pragma unroll
    for (int i = 0; i < kN / 2; i++) mf__fence_operand(d[i]);
}

/* D[64, kN] (+)= A[64, 32] . B[kN, 32]^T, E4M3 x E4M3 -> fp32; d: the kN/2 accumulators of this
 * thread; scale_d = 0 overwrites D, 1 accumulates. Specialised only for the kN a kernel uses (see
 * "wgmma specialisations" below); another kN is a link error, not a silent fallback. */
template <int kN>
__device__ __forceinline__ void mf__wgmma_e4m3(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d);

/* Same for BF16 x BF16 -> fp32 with K = 16, both operands K-major. */
template <int kN>
__device__ __forceinline__ void mf__wgmma_bf16(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d);

/* A hint: the 128-byte line holding `p` (global) into L1 (and L2); nothing waits for it. */
__device__ __forceinline__ void mf__prefetch_l1(const void *p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"((uint64_t)p) : "memory");
}

/* ---- cp.async (non-bulk) with mbarrier completion: small scattered loads (scales) --------------- */

/* Copies 4 bytes global -> shared asynchronously (both 4-byte aligned). */
__device__ __forceinline__ void mf__cp_async_4(void *dst, const void *src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(mf__smem_addr(dst)), "l"((uint64_t)src) : "memory");
}

/* Copies 16 bytes global -> shared asynchronously (both 16-byte aligned). */
__device__ __forceinline__ void mf__cp_async_16(void *dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(mf__smem_addr(dst)), "l"((uint64_t)src) : "memory");
}

/* Arrives on `bar` once every cp.async this thread issued before has landed. .noinc: the arrival is
 * one of the barrier's expected arrivals (count it in mf__mbar_init). */
__device__ __forceinline__ void mf__cp_async_mbar_arrive_noinc(uint64_t *bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(mf__smem_addr(bar)) : "memory");
}

/* ---- wgmma specialisations: exactly the N the kernels use ------------------------------------------
 * decode (kernels/sm90_decode_gemm.cuh): N = tokens per tile kBlockT in {8, 16, 32, 64}, both dtypes;
 * TMA (kernels/sm90_tma_gemm.cuh): FP8 N = kBoxRows = 128 (one weight box), BF16 N = kTileN = 256;
 * the TMA kernel's tail tiles: BF16 N = 128 (taken only under mf__cuda_tma_tails 2, the lab's).
 * A new tile size adds its N here, in the same regular form, and its operand lists below (the
 * other 14 of wgmma's N were written once and never used: deleted, issue 27). The specialisations
 * are alike on purpose: each is one instruction, whose PTX text (shape, dtype, operand numbers)
 * has to be a literal. */

/* The accumulator operands of an m64nN wgmma, N/2 fp32 registers per thread (d[0] .. d[N/2 - 1]):
 * as PTX operands (MF__WGMMA_REGS_N<N>: "%0, .., %(N/2 - 1)") and as the asm's in/out constraints
 * (MF__WGMMA_ACC_N<N>); the descriptors and scale-d follow as operands N/2, N/2 + 1, N/2 + 2.
 * Written once for both dtypes (each list extends the one of N/2). */
#define MF__WGMMA_REGS_N8 "%0, %1, %2, %3"
#define MF__WGMMA_ACC_N8 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#define MF__WGMMA_REGS_N16 MF__WGMMA_REGS_N8 ", %4, %5, %6, %7"
#define MF__WGMMA_ACC_N16 MF__WGMMA_ACC_N8, "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define MF__WGMMA_REGS_N32 MF__WGMMA_REGS_N16 \
    ",\n%8, %9, %10, %11, %12, %13, %14, %15"
#define MF__WGMMA_ACC_N32 MF__WGMMA_ACC_N16, \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define MF__WGMMA_REGS_N64 MF__WGMMA_REGS_N32 \
    ",\n%16, %17, %18, %19, %20, %21, %22, %23" \
    ",\n%24, %25, %26, %27, %28, %29, %30, %31"
#define MF__WGMMA_ACC_N64 MF__WGMMA_ACC_N32, \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define MF__WGMMA_REGS_N128 MF__WGMMA_REGS_N64 \
    ",\n%32, %33, %34, %35, %36, %37, %38, %39" \
    ",\n%40, %41, %42, %43, %44, %45, %46, %47" \
    ",\n%48, %49, %50, %51, %52, %53, %54, %55" \
    ",\n%56, %57, %58, %59, %60, %61, %62, %63"
#define MF__WGMMA_ACC_N128 MF__WGMMA_ACC_N64, \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define MF__WGMMA_REGS_N256 MF__WGMMA_REGS_N128 \
    ",\n%64, %65, %66, %67, %68, %69, %70, %71" \
    ",\n%72, %73, %74, %75, %76, %77, %78, %79" \
    ",\n%80, %81, %82, %83, %84, %85, %86, %87" \
    ",\n%88, %89, %90, %91, %92, %93, %94, %95" \
    ",\n%96, %97, %98, %99, %100, %101, %102, %103" \
    ",\n%104, %105, %106, %107, %108, %109, %110, %111" \
    ",\n%112, %113, %114, %115, %116, %117, %118, %119" \
    ",\n%120, %121, %122, %123, %124, %125, %126, %127"
#define MF__WGMMA_ACC_N256 MF__WGMMA_ACC_N128, \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

template <>
__device__ __forceinline__ void mf__wgmma_e4m3<8>(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3\n"
                 "{" MF__WGMMA_REGS_N8 "},\n %4, %5, p, 1, 1;\n}\n"
                 : MF__WGMMA_ACC_N8
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void mf__wgmma_e4m3<16>(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3\n"
                 "{" MF__WGMMA_REGS_N16 "},\n %8, %9, p, 1, 1;\n}\n"
                 : MF__WGMMA_ACC_N16
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void mf__wgmma_e4m3<32>(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3\n"
                 "{" MF__WGMMA_REGS_N32 "},\n %16, %17, p, 1, 1;\n}\n"
                 : MF__WGMMA_ACC_N32
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void mf__wgmma_e4m3<64>(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3\n"
                 "{" MF__WGMMA_REGS_N64 "},\n %32, %33, p, 1, 1;\n}\n"
                 : MF__WGMMA_ACC_N64
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void mf__wgmma_e4m3<128>(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3\n"
                 "{" MF__WGMMA_REGS_N128 "},\n %64, %65, p, 1, 1;\n}\n"
                 : MF__WGMMA_ACC_N128
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void mf__wgmma_bf16<8>(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16\n"
                 "{" MF__WGMMA_REGS_N8 "},\n %4, %5, p, 1, 1, 0, 0;\n}\n"
                 : MF__WGMMA_ACC_N8
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void mf__wgmma_bf16<16>(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16\n"
                 "{" MF__WGMMA_REGS_N16 "},\n %8, %9, p, 1, 1, 0, 0;\n}\n"
                 : MF__WGMMA_ACC_N16
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void mf__wgmma_bf16<32>(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16\n"
                 "{" MF__WGMMA_REGS_N32 "},\n %16, %17, p, 1, 1, 0, 0;\n}\n"
                 : MF__WGMMA_ACC_N32
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void mf__wgmma_bf16<64>(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16\n"
                 "{" MF__WGMMA_REGS_N64 "},\n %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : MF__WGMMA_ACC_N64
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void mf__wgmma_bf16<128>(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16\n"
                 "{" MF__WGMMA_REGS_N128 "},\n %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : MF__WGMMA_ACC_N128
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void mf__wgmma_bf16<256>(float *d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16\n"
                 "{" MF__WGMMA_REGS_N256 "},\n %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : MF__WGMMA_ACC_N256
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}


/* ---- host: tensor maps ------------------------------------------------------------------------- */

/* The driver's cuTensorMapEncodeTiled, fetched once through the runtime (no -lcuda needed). NULL
 * when the driver lacks it. */
static inline PFN_cuTensorMapEncodeTiled_v12000 mf__tma_encode_fn(void) {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = NULL;
    if (!fn) {
        void *p = NULL;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
        else
            (void)cudaGetLastError();
    }
    return fn;
}

/* Encodes `map` for a row-major tensor of `rank` (2 or 3) dims at `base`: dims[0] is the innermost
 * (contiguous) extent in elements, dims[1], dims[2] the outer ones; strides_bytes[i] is the byte
 * distance between consecutive indices of dims[i + 1] (multiples of 16). The box is box[0] x box[1]
 * (x box[2]) elements (box[0] * elem_bytes <= the swizzle span when swizzled); out-of-bounds
 * elements read as zero. Returns CUDA_SUCCESS or the driver's error (CUDA_ERROR_NOT_SUPPORTED when
 * the entry point is missing). */
static inline CUresult mf__tma_encode(CUtensorMap *map, CUtensorMapDataType dtype, int rank, const void *base,
                                      const uint64_t *dims, const uint64_t *strides_bytes, const uint32_t *box,
                                      CUtensorMapSwizzle swizzle) {
    PFN_cuTensorMapEncodeTiled_v12000 fn = mf__tma_encode_fn();
    if (!fn) return CUDA_ERROR_NOT_SUPPORTED;
    cuuint64_t gdim[3] = {1, 1, 1}, gstride[2] = {0, 0};
    cuuint32_t gbox[3] = {1, 1, 1}, estride[3] = {1, 1, 1};
    for (int i = 0; i < rank && i < 3; i++) {
        gdim[i] = dims[i];
        gbox[i] = box[i];
    }
    for (int i = 0; i + 1 < rank && i < 2; i++) gstride[i] = strides_bytes[i];
    return fn(map, dtype, (cuuint32_t)rank, (void *)base, gdim, gstride, gbox, estride, CU_TENSOR_MAP_INTERLEAVE_NONE,
              swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

/* 2D row-major [outer, inner] tensor with rows `row_bytes` apart; box [box_outer, box_inner]. */
static inline CUresult mf__tma_encode_2d(CUtensorMap *map, CUtensorMapDataType dtype, const void *base, uint64_t inner,
                                         uint64_t outer, uint64_t row_bytes, uint32_t box_inner, uint32_t box_outer,
                                         CUtensorMapSwizzle swizzle) {
    uint64_t dims[2] = {inner, outer}, strides[1] = {row_bytes};
    uint32_t box[2] = {box_inner, box_outer};
    return mf__tma_encode(map, dtype, 2, base, dims, strides, box, swizzle);
}

/* sm90_ptx: ready */

/* ---- appended: cp.async drain and a wait with an explicit bound (the library's decode GEMMs) ---- */

/* Waits until every cp.async of this thread has landed (a thread must not exit with copies still
 * writing its CTA's shared memory). */
__device__ __forceinline__ void mf__cp_async_wait_all(void) { asm volatile("cp.async.wait_all;" ::: "memory"); }

/* Set by the first bounded wait of the library's kernels that expired (never cleared: the process's
 * GEMM pipelines are no longer trusted); every bounded wait then returns at once. */
static __device__ volatile uint32_t mf__sm90_expired;

/* The library's pipeline wait: bounded by `timeout_ns` (far above any healthy wait) and no trap. A
 * trap kills the CUDA context of every rank of the process, so an expired wait records itself in
 * the comm's fault sink (mf__pipeline_fault: the comm breaks), raises mf__sm90_expired (one per
 * translation unit: per GEMM family) and returns: every other wait of the kernel, and of the
 * family's later kernels, then records itself as drained and returns at once too, so all warps
 * drain and the kernels end (their output is garbage). sink NULL: the wait drains and raises the
 * flag but records nothing: the producers' waits (the record code would cost the 40-register
 * producer a spill); each kernel's consumers record a raised flag at their end
 * (mf__pipeline_check), so an expiry is never silent. The host turns the first record of the
 * process into a broken comm for every comm (cuda/backend.cu). The labs' own kernels trap instead
 * (mf__mbar_wait_tag). Returns true when it gave up (expired or drained: the phase was not seen
 * complete), false when the phase completed. */
__device__ __forceinline__ bool mf__mbar_wait_bounded(uint64_t *bar, uint32_t parity, uint32_t tag, uint64_t timeout_ns,
                                                      const mf__fault_sink_t *sink) {
    if (mf__mbar_try_wait(bar, parity)) return false;
    uint64_t t0 = mf__globaltimer();
    while (!mf__mbar_try_wait(bar, parity)) {
        if (mf__sm90_expired) {
            if (sink) mf__pipeline_fault(*sink, tag, 1);
            return true;
        }
        if (mf__globaltimer() - t0 > timeout_ns) {
            if (sink) mf__pipeline_fault(*sink, tag, 0);
            mf__sm90_expired = 1;
            __threadfence();
            return true;
        }
    }
    return false;
}

/* Host: raises this translation unit's (this family's) mf__sm90_expired as its first expired wait
 * would, for the drain tests (cuda/grouped_gemm.h mf__sm90_decode_expire / mf__sm90_tma_expire).
 * 0, or -1 on a CUDA error. */
static inline int mf__sm90_raise_expired(void) {
    const uint32_t one = 1;
    return cudaMemcpyToSymbol(mf__sm90_expired, &one, sizeof one) == cudaSuccess ? 0 : -1;
}

/* At a GEMM kernel's end, one consumer thread per CTA: a wait of this family that expired (a
 * producer's records nothing) or drained is recorded in the comm's sink, whether or not this CTA's
 * consumers spun on a wait afterwards. */
__device__ __forceinline__ void mf__pipeline_check(const mf__fault_sink_t &sink, uint32_t tag) {
    if (mf__sm90_expired) mf__pipeline_fault(sink, tag, 1);
}

/* ---- appended: hardware float -> BF16 / E4M3 pair conversions (the library's TMA GEMMs) -------- */

/* Two floats to a BF16 pair, round to nearest even (cvt.rn.bf16x2.f32): `lo` in bits 0-15, `hi` in
 * bits 16-31. For every non-NaN input the bits equal mf__bf16_from_float's (core/numerics.h): both
 * are IEEE round-to-nearest-even, subnormals and overflow to infinity included (checked over all
 * 2^32 inputs by dev/cuda/sm90_gemm_lab.cu --selftest). NaN becomes a canonical NaN. */
__device__ __forceinline__ uint32_t mf__cvt_bf16x2(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

/* Two floats to an E4M3 pair, round to nearest even, saturating to +-448 (infinities too):
 * cvt.rn.satfinite.e4m3x2.f32, `lo` in bits 0-7, `hi` in bits 8-15. For every non-NaN input the
 * bits equal mf__fp8_from_float's (checked over all 2^32 inputs by the lab's --selftest). */
__device__ __forceinline__ uint16_t mf__cvt_e4m3x2(float lo, float hi) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

#endif /* MF_CUDA_KERNELS_SM90_PTX_CUH */
