/**
 * @file warpgroup.cuh
 * @brief Warpgroup-level control: register reallocation (setmaxnreg), named barriers and
 * thread indices inside a warpgroup.
 */
#pragma once

#include "pk/common.cuh"

namespace pk::warpgroup {

/** @brief Index of the calling thread's warpgroup in the block. */
__device__ inline int index() { return threadIdx.x / WARPGROUP_THREADS; }

/** @brief Index of the calling thread inside its warpgroup (0..127). */
__device__ inline int thread() { return threadIdx.x % WARPGROUP_THREADS; }

/** @brief Lowers this warpgroup's register budget to REGS per thread (all 128 threads call). */
template <int REGS>
__device__ inline void decrease_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}

/** @brief Raises this warpgroup's register budget to REGS per thread (all 128 threads call). */
template <int REGS>
__device__ inline void increase_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}

/** @brief Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads. */
__device__ inline void sync(int id, int threads = WARPGROUP_THREADS) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/** @brief Arrives at named barrier `id` over `threads` threads without waiting (the partner
 * of `sync`: the barrier completes when `threads` threads have arrived or synced). */
__device__ inline void arrive(int id, int threads = WARPGROUP_THREADS) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace pk::warpgroup
