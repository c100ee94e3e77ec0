/*
 * ping: y = x + rank, elementwise, in fp32.
 *
 * The smallest kernel that proves the whole path works: Python check -> jax.ffi.ffi_call with
 * the rank as an int32 operand -> FFI handler on XLA's stream -> kernel -> XLA's output buffer.
 * It has no shardings, no schedule and no signals.
 *
 * Pitfalls: the rank lives in device memory (it is an XLA operand), so the kernel reads it
 * there; copying it to the host would add a synchronisation to every call.
 */
#pragma once

#include "pk/common.cuh"

namespace pk::ping {

struct config {
  static constexpr int THREADS = 256;
};

struct globals {
  const float* x;
  const int32_t* rank;
  float* y;
  int64_t n;
};

__global__ void __launch_bounds__(config::THREADS) kernel(const __grid_constant__ globals g) {
  const float r = static_cast<float>(*g.rank);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < g.n;
       i += int64_t(gridDim.x) * blockDim.x) {
    g.y[i] = g.x[i] + r;
  }
}

inline cudaError_t launch(const globals& g, cudaStream_t stream) {
  const int64_t blocks = ceil_div<int64_t>(g.n, config::THREADS);
  const int grid = static_cast<int>(blocks < 1024 ? (blocks > 0 ? blocks : 1) : 1024);
  kernel<<<grid, config::THREADS, 0, stream>>>(g);
  return cudaGetLastError();
}

}  // namespace pk::ping
