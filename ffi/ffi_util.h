// Shared helpers for the FFI handlers: the CUDA error macro and the handler declarations.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "xla/ffi/api/ffi.h"

namespace pk_ffi {

namespace ffi = xla::ffi;

// NOTES: every CUDA call in a handler goes through PK_CUDA_CHECK so that a failure becomes an
// ffi::Error (a Python exception naming the call) instead of a crash or a silent wrong answer.
inline ffi::Error CudaError(cudaError_t err, const char* expr, const char* file, int line) {
  return ffi::Error::Internal(std::string("pk_jax CUDA error: ") + cudaGetErrorString(err) +
                              " in " + expr + " at " + file + ":" + std::to_string(line));
}

}  // namespace pk_ffi

#define PK_CUDA_CHECK(expr)                                                   \
  do {                                                                        \
    cudaError_t pk_err_ = (expr);                                             \
    if (pk_err_ != cudaSuccess) {                                             \
      return ::pk_ffi::CudaError(pk_err_, #expr, __FILE__, __LINE__);         \
    }                                                                         \
  } while (0)

// Checks the launch that was just issued on the current thread.
#define PK_CUDA_CHECK_LAUNCH() PK_CUDA_CHECK(cudaGetLastError())

// Traits of every CUDA handler: it only enqueues work on XLA's stream (no host
// synchronisation; epochs and counters live on the device), so XLA may record it into a
// command buffer (CUDA graph) and replay it.
#define PK_FFI_CUDA_TRAITS {xla::ffi::Traits::kCmdBufferCompatible}

// Handler symbols, one block per op; module.cc registers them.
XLA_FFI_DECLARE_HANDLER_SYMBOL(PkPing);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PkPingCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PkAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PkAllGather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PkReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PkAllToAll);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PkMatmul);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PkGemmRs);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PkAgGemm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PkGemmAr);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PkGroupedMatmul);
