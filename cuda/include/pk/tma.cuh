/**
 * @file tma.cuh
 * @brief Tensor Memory Accelerator (TMA) tile copies described by a CUtensorMap (sm_90).
 *
 * Loads complete on an mbarrier (transaction bytes, see mbarrier.cuh); stores and reduce-add
 * stores complete in bulk groups that the issuing thread waits on. The tensor map names the
 * global memory, so the same calls write local memory or a peer's mapping (pgl) alike.
 * Coordinates are in elements, innermost dimension first, and may lie partly or wholly out of
 * bounds: loads fill zeros there, stores drop those elements.
 */
#pragma once

#include <cuda.h>

#include "pk/mbarrier.cuh"

namespace pk::tma {

/** @brief Fetches the tensor map into the TMA descriptor cache ahead of the first copy. */
__device__ inline void prefetch(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

/**
 * @brief Loads the 2-D box at (c0, c1) into shared memory `dst`; completes `bar` with the box's
 * bytes (zero-filled out-of-bounds elements count too).
 */
__device__ inline void load_2d(void* dst, const CUtensorMap* map, mbarrier* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

/**
 * @brief Like load_2d, and also delivers the box to the same shared-memory offset of every CTA
 * in `cta_mask` of the cluster, completing each CTA's barrier at `bar`'s offset.
 */
__device__ inline void load_2d_multicast(void* dst, const CUtensorMap* map, mbarrier* bar,
                                         int c0, int c1, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1),
      "h"(cta_mask)
      : "memory");
}

/** @brief Stores shared memory `src` to the 2-D box at (c0, c1); part of the open bulk group. */
__device__ inline void store_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(src)), "r"(c0), "r"(c1)
               : "memory");
}

/** @brief Adds shared memory `src` element-wise into the 2-D box at (c0, c1) (atomic per element). */
__device__ inline void store_add_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], [%1];"
      ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(src)), "r"(c0), "r"(c1)
      : "memory");
}

/** @brief Closes the bulk group of the stores issued so far by this thread. */
__device__ inline void store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

/** @brief Waits until at most N bulk groups still read their shared-memory source. */
template <int N = 0>
__device__ inline void store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

/** @brief Waits until at most N bulk groups are still in flight (writes globally visible). */
template <int N = 0>
__device__ inline void store_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

/** @brief Orders this thread's generic-proxy shared-memory writes before later TMA reads. */
__device__ inline void fence_smem_to_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

}  // namespace pk::tma
