// Shared glue for the fused tensor-parallel GEMM handlers (gemm_rs, ag_gemm, gemm_ar): operand
// checks, the communicator view and the workspace-too-small error.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "comm.h"
#include "ffi_util.h"
#include "kernels/matmul.cuh"
#include "tensor_map.h"
#include "pk/tp.cuh"

namespace pk_ffi::tp {

// Op ids of the error record (pk_jax/runtime/errors.py) and each op's slot range index.
constexpr int kOpGemmRs = 5, kOpAgGemm = 6, kOpGemmAr = 7;
constexpr int kIndexGemmRs = 0, kIndexAgGemm = 1, kIndexGemmAr = 2;
// Tile configurations the fused kernels instantiate (cuda/kernels/matmul.cuh, enum config_id).
constexpr int kTile128x128 = 1, kTile128x256 = 2;

// Returns launch(C{}) for the kernel configuration C of `dtype` (0 bf16, 1 fp16) and tile
// (`big`: kTile128x256, run as 128x256 with 3 stages; else 128x128): the one place mapping them.
template <class F>
cudaError_t WithConfig(int dtype, bool big, F&& launch) {
  using pk::matmul::config_128x128, pk::matmul::config_128x256_s3;
  if (dtype == 0) {
    return big ? launch(config_128x256_s3<__nv_bfloat16>{})
               : launch(config_128x128<__nv_bfloat16>{});
  }
  return big ? launch(config_128x256_s3<__half>{}) : launch(config_128x128<__half>{});
}

// x [M, K] and w [K, N] of one 2-byte float dtype (0 bf16, 1 fp16), K and N multiples of 8.
inline ffi::Error GemmOperands(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                               int64_t* m, int64_t* k, int64_t* n, int* dtype) {
  const ffi::DataType dt = x.element_type();
  if ((dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) || w.element_type() != dt) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op +
                                       ": x and w must both be bf16 or both fp16.");
  }
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0]) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op +
                                       ": expected x [M, K] and w [K, N].");
  }
  *m = xd[0];
  *k = xd[1];
  *n = wd[1];
  if (*k % 8 != 0 || *n % 8 != 0) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op +
                                       ": K and N must be multiples of 8 (pk_jax pads N).");
  }
  if (*m > INT32_MAX || *n > INT32_MAX || *k > INT32_MAX) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op +
                                       ": dimensions must be below 2^31.");
  }
  *dtype = dt == ffi::DataType::BF16 ? 0 : 1;
  return ffi::Error::Success();
}

// The kernel's view of communicator `comm_id` on `device`, pads offset to op `index`'s range.
inline ffi::Error Comm(const char* op, int op_id, int index, int64_t comm_id, int32_t device,
                       const int32_t* rank_ptr, pk::tp::comm* c, uint64_t* ws_bytes) {
  const CommView* v = FindComm(comm_id, device);
  if (v == nullptr) {
    return ffi::Error::InvalidArgument(
        std::string("pk.") + op + ": no communicator " + std::to_string(comm_id) +
        " on device " + std::to_string(device) +
        "; call pk.init(mesh) on every process before using the op.");
  }
  if (v->signal_count < pk::tp::SLOTS_NEEDED) {
    return ffi::Error::InvalidArgument(
        std::string("pk.") + op + ": the signal pad has " + std::to_string(v->signal_count) +
        " slots, the fused GEMM ops need " + std::to_string(pk::tp::SLOTS_NEEDED));
  }
  if (v->world > pk::tp::MAX_PEERS) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op + ": at most " +
                                       std::to_string(pk::tp::MAX_PEERS) + " ranks.");
  }
  *c = pk::tp::comm{};
  const uint64_t base = pk::tp::SLOT_BASE + uint64_t(index) * pk::tp::OP_SLOTS;
  for (int p = 0; p < v->world; ++p) {
    c->ws[p] = v->workspace[p];
    c->sig[p] = v->signals[p] + base;
  }
  c->error = v->error;
  c->timeout_ns = v->timeout_ns;
  c->world = v->world;
  c->rank = v->rank;
  c->op = op_id;
  c->rank_ptr = rank_ptr;
  *ws_bytes = v->workspace_bytes;
  return ffi::Error::Success();
}

inline ffi::Error WorkspaceCheck(const char* op, uint64_t need, uint64_t have) {
  if (need <= have) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      std::string("pk.") + op + ": the symmetric workspace has " + std::to_string(have) +
      " bytes and this call needs " + std::to_string(need) +
      "; call pk.init(mesh, workspace_bytes=...) with at least that.");
}

}  // namespace pk_ffi::tp
