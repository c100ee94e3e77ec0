/**
 * @file tma_4d.cuh
 * @brief 4-D TMA tile loads and reductions, and 1-D bulk loads (sm_90).
 *
 * A 4-D map describes a [B, S, H, D] activation as dims {D, H, S, B}: a box {64, 1, ROWS, 1}
 * is ROWS consecutive positions of one head of one batch element, 64 features wide, which lands
 * in shared memory as one 128B-swizzled panel of ROWS rows (the layout of st_panels). Rows past
 * S fill zeros inside each batch element, which a 2-D map over [B * S, H * D] cannot do.
 */
#pragma once

#include <cuda.h>

#include "pk/mbarrier.cuh"

namespace pk::tma {

/** @brief Loads the 4-D box at (c0, c1, c2, c3) into `dst`; completes `bar` with its bytes. */
__device__ inline void load_4d(void* dst, const CUtensorMap* map, mbarrier* bar, int c0, int c1,
                               int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2),
      "r"(c3)
      : "memory");
}

/** @brief Adds shared memory `src` element-wise into the 4-D box at (c0, c1, c2, c3) (atomic per
 * element; elements outside the tensor are dropped); part of the open bulk group. */
__device__ inline void store_add_4d(const CUtensorMap* map, const void* src, int c0, int c1,
                                    int c2, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%2, %3, %4, %5}], [%1];" ::"l"(reinterpret_cast<uint64_t>(map)),
      "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

/**
 * @brief Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global `src`
 * to shared `dst`; completes `bar` with `bytes` transactions.
 */
__device__ inline void load_1d(void* dst, const void* src, uint32_t bytes, mbarrier* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

}  // namespace pk::tma
