/**
 * @file wgmma.cuh
 * @brief Warpgroup matrix multiply-accumulate (wgmma, sm_90a): shared-memory matrix
 * descriptors for 128-byte-swizzled tiles, the m64nNk16 MMA for bf16/fp16 with fp32
 * accumulators, and the fence / commit / wait protocol.
 *
 * Shared layouts (see smem.cuh): a tile is stored as 64-element-wide "panels" of 128-byte rows,
 * swizzled in 1024-byte atoms of 8 rows (the layout TMA writes with CU_TENSOR_MAP_SWIZZLE_128B).
 * - K-major operand (A = x [M, K]): one panel of BM rows x 64 k; 8-row groups 1024 B apart.
 * - MN-major operand (B = w [K, N]): BN/64 panels of 64 k-rows x 64 n, PANEL_BYTES apart.
 *
 * Accumulator fragment of m64nN (fp32, per thread t of the warpgroup): d[4j + 2i + c] holds
 * row 16 * (t / 32) + (t % 32) / 4 + 8 * i, column 8 * j + 2 * (t % 4) + c.
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "pk/common.cuh"
#include "pk/mbarrier.cuh"
#include "pk/wgmma_ops.cuh"

namespace pk::wgmma {

/** @brief Swizzle mode field of a descriptor (bits 62-63). */
enum class swizzle : uint64_t { none = 0, b128 = 1, b64 = 2, b32 = 3 };

/**
 * @brief Builds a shared-memory matrix descriptor.
 * @param addr shared address (16-byte aligned; 1024-aligned atoms for 128B swizzle).
 * @param lbo leading-dimension byte offset, @param sbo stride-dimension byte offset.
 */
__device__ inline uint64_t make_desc(uint32_t addr, uint32_t lbo, uint32_t sbo,
                                     swizzle sw = swizzle::b128) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16;
  d |= static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32;
  d |= static_cast<uint64_t>(sw) << 62;
  return d;
}

/**
 * @brief Descriptor `d` with its start address moved `bytes` (a multiple of 16) further: one
 * 32-bit add on the low word. Shared addresses are below 2^18 (the sm_90 window is 228 KiB),
 * so the 14-bit start field never carries into the leading offset. Loops over k build one
 * descriptor and advance it, instead of rebuilding (mask, shift, or) at every step.
 */
__device__ inline uint64_t desc_advance(uint64_t d, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(d) + (bytes >> 4);
  return (d & 0xFFFFFFFF00000000ull) | lo;
}

/**
 * @brief Descriptor of a K-major 128B-swizzled operand (64 k per 128-byte row) starting at
 * row 0 of `tile`, advanced to k offset `k` (a multiple of 16 within the 64-wide panel).
 */
template <typename T>
__device__ inline uint64_t desc_k_major(const T* tile, int k) {
  // NOTES: inside a 128B-swizzle atom a k step is a plain byte offset of the start address;
  // the hardware applies the XOR pattern to the final address, so the atom must be 1024-aligned.
  return make_desc(smem_addr(tile) + k * sizeof(T), 16, 1024);
}

/** @brief Bytes from k row 0 to k row `k` of an MN-major 128B-swizzled panel (one 128-byte
 * row per k): the offset desc_mn_major applies and desc_advance moves by. */
__device__ __host__ constexpr uint32_t mn_major_k_bytes(int k) { return uint32_t(k) * 128; }

/**
 * @brief Descriptor of an MN-major 128B-swizzled operand made of 64-wide panels
 * `panel_bytes` apart (each panel: rows of 64 MN elements, one row per k), at k row `k`
 * (a multiple of 8).
 */
template <typename T>
__device__ inline uint64_t desc_mn_major(const T* tile, int k, uint32_t panel_bytes) {
  return make_desc(smem_addr(tile) + mn_major_k_bytes(k), panel_bytes, 1024);
}

/** @brief Orders register accesses before the next wgmma (call before a batch of MMAs). */
__device__ inline void fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }

/** @brief Closes the group of wgmmas issued since the last commit. */
__device__ inline void commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

/** @brief Waits until at most N committed groups are still running. */
template <int N>
__device__ inline void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

/** @brief Keeps the compiler from moving accumulator accesses across wgmma boundaries. */
template <int R>
__device__ inline void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/**
 * @brief D (+)= A * B for one warpgroup: A 64x16 (K-major), B 16xN, D 64xN fp32 in registers.
 * @tparam T __nv_bfloat16 or __half. @tparam N 64, 128, 176 or 256.
 * @tparam TRANS_B 1: B MN-major.
 * @param scale_d 0 overwrites D (first k step), 1 accumulates.
 */
template <typename T, int N, int TRANS_B>
__device__ inline void mma(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  constexpr bool BF16 = std::is_same_v<T, __nv_bfloat16>;
  static_assert(BF16 || std::is_same_v<T, __half>, "wgmma: T must be bf16 or fp16");
  if constexpr (N == 256) {
    if constexpr (BF16) ops::mma_m64n256k16_bf16<TRANS_B>(d, desc_a, desc_b, scale_d);
    else ops::mma_m64n256k16_f16<TRANS_B>(d, desc_a, desc_b, scale_d);
  } else if constexpr (N == 176) {
    if constexpr (BF16) ops::mma_m64n176k16_bf16<TRANS_B>(d, desc_a, desc_b, scale_d);
    else ops::mma_m64n176k16_f16<TRANS_B>(d, desc_a, desc_b, scale_d);
  } else if constexpr (N == 128) {
    if constexpr (BF16) ops::mma_m64n128k16_bf16<TRANS_B>(d, desc_a, desc_b, scale_d);
    else ops::mma_m64n128k16_f16<TRANS_B>(d, desc_a, desc_b, scale_d);
  } else {
    static_assert(N == 64, "wgmma: N must be 64, 128, 176 or 256");
    if constexpr (BF16) ops::mma_m64n64k16_bf16<TRANS_B>(d, desc_a, desc_b, scale_d);
    else ops::mma_m64n64k16_f16<TRANS_B>(d, desc_a, desc_b, scale_d);
  }
}

}  // namespace pk::wgmma
