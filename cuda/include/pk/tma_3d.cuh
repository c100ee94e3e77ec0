/**
 * @file tma_3d.cuh
 * @brief 3-D TMA tile copies (sm_90): a batch of matrices [E][rows][cols] described by one
 * CUtensorMap with dims {cols, rows, E}. A box of depth 1 never crosses into the neighbouring
 * matrix: loads past a matrix's rows or columns fill zeros and stores drop those elements,
 * per matrix, which a 2-D map over the stacked [E * rows, cols] view cannot do.
 */
#pragma once

#include <cuda.h>

#include "pk/mbarrier.cuh"

namespace pk::tma {

/** @brief Loads the 3-D box at (c0, c1, c2) into `dst`; completes `bar` with the box's bytes. */
__device__ inline void load_3d(void* dst, const CUtensorMap* map, mbarrier* bar, int c0, int c1,
                               int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

/** @brief Stores `src` to the 3-D box at (c0, c1, c2); part of the open bulk group. */
__device__ inline void store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];"
      ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

}  // namespace pk::tma
