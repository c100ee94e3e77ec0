/**
 * @file mbarrier.cuh
 * @brief Shared-memory mbarriers: arrival counts plus transaction bytes, the completion
 * mechanism of TMA and bulk copies (sm_90).
 *
 * A phase completes when the expected arrivals have arrived and the expected transaction
 * bytes have landed; waiters poll the phase parity bit.
 */
#pragma once

#include "pk/common.cuh"

namespace pk {

/** @brief An mbarrier in shared memory (8 bytes, 8-byte aligned). */
struct alignas(8) mbarrier {
  uint64_t state;
};

__device__ inline uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/** @brief Initialises `bar` to expect `arrivals` arrivals per phase. One thread calls it. */
__device__ inline void mbar_init(mbarrier* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals));
}

/** @brief Makes mbarrier initialisation visible to the async proxy (TMA) and other threads. */
__device__ inline void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/** @brief Arrives once and adds `bytes` to the transaction count of the current phase. */
__device__ inline void mbar_arrive_expect_tx(mbarrier* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

/** @brief Plain arrival (no transaction bytes). */
__device__ inline void mbar_arrive(mbarrier* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

/** @brief Arrival on the barrier at the same offset in CTA `cta` of the cluster. */
__device__ inline void mbar_arrive_cluster(mbarrier* bar, uint32_t cta) {
  asm volatile(
      "{\n\t.reg .b32 remote;\n\t"
      "mapa.shared::cluster.u32 remote, %0, %1;\n\t"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n\t}" ::"r"(
          smem_addr(bar)),
      "r"(cta)
      : "memory");
}

/** @brief True once the phase with parity `parity` has completed. */
__device__ inline bool mbar_test(mbarrier* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

/** @brief Blocks until the phase with parity `parity` has completed. */
__device__ inline void mbar_wait(mbarrier* bar, uint32_t parity) {
  while (!mbar_test(bar, parity)) {
  }
}

}  // namespace pk
