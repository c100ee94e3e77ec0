/**
 * @file common.cuh
 * @brief Basic definitions shared by the whole pk tile library.
 */
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <set>
#include <utility>

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

/**
 * @brief Raises kernel `fn`'s dynamic shared-memory limit to `bytes`, once per (kernel copy,
 * device). Host only.
 *
 * NOTES: without relocatable device code every .cu file that instantiates a kernel template
 * gets its own copy, with its own host entry point. A plain static "done" flag in an inline
 * template is shared by all of them, so a second file's copy once launched without the opt-in
 * (cudaErrorInvalidValue, seen on the H200); keying by the entry point keeps them apart.
 */
inline cudaError_t opt_in_smem(const void* fn, int device, int bytes) {
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> done;
  const auto key = std::make_pair(fn, device);
  std::lock_guard<std::mutex> lock(mu);
  if (done.count(key)) return cudaSuccess;
  cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) done.insert(key);
  return err;
}

}  // namespace pk
