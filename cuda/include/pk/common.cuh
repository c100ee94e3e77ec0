/**
 * @file common.cuh
 * @brief Basic definitions shared by the whole pk tile library.
 */
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

namespace pk {

/** @brief Threads in a warp and warps in a warpgroup (the wgmma issue unit). */
constexpr int WARP_THREADS = 32;
constexpr int WARPGROUP_WARPS = 4;
constexpr int WARPGROUP_THREADS = WARP_THREADS * WARPGROUP_WARPS;

/** @brief Ceiling division for sizes and grid dimensions. */
template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

}  // namespace pk
