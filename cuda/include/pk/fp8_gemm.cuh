/**
 * @file fp8_gemm.cuh
 * @brief The consumer-side pieces of the fp8 GEMMs, written once for matmul_fp8
 * (cuda/kernels/matmul_fp8.cuh) and grouped_matmul_fp8 (cuda/kernels/grouped_matmul_fp8.cuh):
 * one 128-deep k-block of fp8 wgmma into a warpgroup's m64nBN accumulator from K-major stage
 * tiles, the blockwise promotion of a k-block's product into the tile's sum, and the staging of
 * a round of output columns (fp32 times a scale -> bf16 / fp32) in a 128B-swizzled buffer for
 * TMA or masked stores. The index arithmetic is pk/fp8_layout.cuh's (CPU-tested).
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "pk/fp8_layout.cuh"
#include "pk/smem.cuh"
#include "pk/warpgroup.cuh"
#include "pk/wgmma.cuh"
#include "pk/wgmma_fp8.cuh"

namespace pk::fp8_gemm {

/** @brief The k-block: 128 fp8 = one 128-byte swizzled row per operand row. */
constexpr int BK = 128;

/**
 * @brief Issues (and commits) one k-block's 4 wgmma m64nBNk32 of a warpgroup into d: A from
 * `a` (its 64 rows of 128 bytes), B from `b` (BN rows of 128 bytes), both K-major and 128B
 * swizzled. `accumulate` false: the first MMA overwrites d (a tile's first k-block, or a fresh
 * blockwise part).
 */
template <typename XT, typename WT, int BN>
__device__ __forceinline__ void mma_k_block(float (&d)[BN / 2], const unsigned char* a,
                                            const unsigned char* b, bool accumulate) {
  wgmma::fence_regs(d);
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < BK / 32; ++kk) {
    // NOTES: a k32 step of fp8 is 32 bytes of the 128-byte swizzled row, the same byte step
    // as bf16's k16, so the descriptors are the bf16 K-major ones advanced by 32 bytes.
    const uint64_t da = wgmma::desc_k_major(a, kk * 32);
    const uint64_t db = wgmma::desc_k_major(b, kk * 32);
    wgmma::mma_fp8<XT, WT, BN>(d, da, db, (accumulate || kk > 0) ? 1 : 0);
  }
  wgmma::commit();
  wgmma::fence_regs(d);
}

/**
 * @brief Blockwise promotion (DeepSeek-V3): main (+)= part * scale of its row, s0 for this
 * thread's rows frag_row(t, 0), s1 for frag_row(t, 1) (x scale times w scale; BN = 128: one w
 * block a tile). `first`: the tile's first k-block, main is set instead of added to.
 */
template <int BN>
__device__ __forceinline__ void promote(float (&main)[BN / 2], const float (&part)[BN / 2],
                                        float s0, float s1, bool first) {
  if (first) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      main[4 * j + 0] = part[4 * j + 0] * s0;
      main[4 * j + 1] = part[4 * j + 1] * s0;
      main[4 * j + 2] = part[4 * j + 2] * s1;
      main[4 * j + 3] = part[4 * j + 3] * s1;
    }
  } else {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      main[4 * j + 0] = fmaf(part[4 * j + 0], s0, main[4 * j + 0]);
      main[4 * j + 1] = fmaf(part[4 * j + 1], s0, main[4 * j + 1]);
      main[4 * j + 2] = fmaf(part[4 * j + 2], s1, main[4 * j + 2]);
      main[4 * j + 3] = fmaf(part[4 * j + 3], s1, main[4 * j + 3]);
    }
  }
}

/** @brief A float of shared memory (a stage's address is generic to the compiler). */
__device__ __forceinline__ float ld_shared(const float* p) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(smem_addr(p)) : "memory");
  return v;
}

/**
 * @brief Blockwise, the scales of this thread's two accumulator rows for consumer c: x's of
 * rows frag_row(t, 0) and frag_row(t, 1) from the stage's x-scale box `sx` (loaded at
 * x_scale_box_inner(row0) for a tile whose first row is row0), times w's entry `w_slot` of the
 * stage's w-scale box `sw` (fp8_layout::w_scale_slot of the tile's first column).
 */
__device__ __forceinline__ void row_scales(const float* sx, const float* sw, int row0, int w_slot,
                                           int c, float& s0, float& s1) {
  namespace fl = fp8_layout;
  const int t = warpgroup::thread();
  const float w = ld_shared(&sw[w_slot]);
  s0 = ld_shared(&sx[fl::x_scale_slot(row0, c, fl::frag_row(t, 0))]) * w;
  s1 = ld_shared(&sx[fl::x_scale_slot(row0, c, fl::frag_row(t, 1))]) * w;
}

/** @brief Elements (row, col) and (row, col + 1) of a 64-row staging buffer (col even). */
template <typename OUT>
__device__ __forceinline__ void store_pair(unsigned char* out, int row, int col, float lo,
                                           float hi) {
  const uint32_t at = smem_addr(out) + fp8_layout::staging_offset<int(sizeof(OUT)), 64>(row, col);
  if constexpr (std::is_same_v<OUT, float>) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(at), "f"(lo), "f"(hi) : "memory");
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    const uint32_t v = *reinterpret_cast<uint32_t*>(&h);
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(at), "r"(v) : "memory");
  }
}

/**
 * @brief Store round e of a consumer's 64 x BN accumulator: its columns [e * EPI_N, (e + 1) *
 * EPI_N) times `scale`, as OUT, into the 64-row staging buffer `out` (EPI_N * sizeof(OUT) / 128
 * swizzled panels). The caller brackets it with the staging buffer's acquire and publish.
 */
template <typename OUT, int BN, int EPI_N>
__device__ __forceinline__ void stage_round(const float (&acc)[BN / 2], float scale,
                                            unsigned char* out, int e) {
  const int t = warpgroup::thread();
  const int r = fp8_layout::frag_row(t, 0);
#pragma unroll
  for (int j = 0; j < EPI_N / 8; ++j) {
    const int jj = e * (EPI_N / 8) + j;
    const int col = fp8_layout::frag_col(t, j, 0);
    store_pair<OUT>(out, r, col, acc[4 * jj] * scale, acc[4 * jj + 1] * scale);
    store_pair<OUT>(out, r + 8, col, acc[4 * jj + 2] * scale, acc[4 * jj + 3] * scale);
  }
}

}  // namespace pk::fp8_gemm
