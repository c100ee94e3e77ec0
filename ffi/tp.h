// Shared glue for the fused tensor-parallel GEMM launchers (gemm_rs, ag_gemm, gemm_ar): operand
// checks, the kernels' communicator view, the epoch, the workspace-too-small error, and the
// body of their FFI handlers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "comm_state.h"
#include "ffi_util.h"
#include "kernels/matmul.cuh"
#include "launch.h"
#include "tensor_map.h"
#include "pk/tp.cuh"

namespace pk_ffi::tp {

// The fused GEMMs' slot ranges and limits are the op table's (op_table.h): op i of pk/tp.cuh
// (0 gemm_rs, 1 ag_gemm, 2 gemm_ar) owns SLOT_BASE + i * OP_SLOTS.
static_assert(pk::tp::SLOT_BASE == op_table::kGemmRsSlots.base &&
                  pk::tp::OP_SLOTS == op_table::kTpOpSlots &&
                  pk::tp::SLOT_BASE + pk::tp::OP_SLOTS == op_table::kAgGemmSlots.base &&
                  pk::tp::SLOT_BASE + 2 * pk::tp::OP_SLOTS == op_table::kGemmArSlots.base &&
                  pk::tp::SLOTS_NEEDED == op_table::kGemmArSlots.end(),
              "pk/tp.cuh's slot ranges must be op_table.h's");
static_assert(pk::tp::MAX_PEERS == op_table::kMaxPeers &&
                  pk::tp::MAX_BLOCKS == op_table::kAgGemmMaxCommSms,
              "pk/tp.cuh's limits must be op_table.h's");

// Returns launch(C{}) for the kernel configuration C of `dtype` and tile (`big`:
// op_table::kTile128x256S3, 128x256 with 3 stages; else 128x128): the one place mapping them.
template <class F>
cudaError_t WithConfig(DType dtype, bool big, F&& launch) {
  using pk::matmul::config_128x128, pk::matmul::config_128x256_s3;
  if (dtype == DType::kBF16) {
    return big ? launch(config_128x256_s3<__nv_bfloat16>{})
               : launch(config_128x128<__nv_bfloat16>{});
  }
  return big ? launch(config_128x256_s3<__half>{}) : launch(config_128x128<__half>{});
}

// x [m, k] and w [k, n] of one 2-byte float dtype, k and n multiples of 8, a known tile config.
inline Status GemmOperands(const char* op, const GemmArgs& a) {
  if (a.dtype != DType::kBF16 && a.dtype != DType::kF16) {
    return Status::Invalid(std::string("pk.") + op + ": x and w must both be bf16 or both fp16.");
  }
  if (a.m < 0 || a.k < 0 || a.n < 0 || a.k % 8 != 0 || a.n % 8 != 0) {
    return Status::Invalid(std::string("pk.") + op +
                           ": K and N must be multiples of 8 (pk_jax pads N).");
  }
  if (a.m > INT32_MAX || a.n > INT32_MAX || a.k > INT32_MAX) {
    return Status::Invalid(std::string("pk.") + op + ": dimensions must be below 2^31.");
  }
  if (a.config != op_table::kTile128x128 && a.config != op_table::kTile128x256S3) {
    return Status::Invalid(std::string("pk.") + op + ": unknown tile config " +
                           std::to_string(a.config));
  }
  return Status::Ok();
}

// The kernels' view of communicator `v` with every pad offset to `slot_base` (no checks: the
// caller checked the record, the pad's size and the world). Also the attention ops' view, whose
// slot ranges are their own (kernels/ring_attn.cuh, ulysses_attn.cuh).
inline void View(int op_id, uint64_t slot_base, const CommView& v, const int32_t* rank_ptr,
                 pk::tp::comm* c) {
  *c = pk::tp::comm{};
  for (int p = 0; p < v.world; ++p) {
    c->ws[p] = v.workspace[p];
    c->sig[p] = v.signals[p] + slot_base;
  }
  c->error = v.error;
  c->timeout_ns = v.timeout_ns;
  c->world = v.world;
  c->rank = v.rank;
  c->op = op_id;
  c->rank_ptr = rank_ptr;
  c->link = pk::link_throttle{v.link_clock, v.link_ps_per_kib};  // off unless emulated
}

// The kernels' view of communicator `v`, pads offset to op `op_id`'s range (op_table.h).
inline Status Comm(const char* op, int op_id, const CommView& v, const int32_t* rank_ptr,
                   pk::tp::comm* c) {
  if (Status s = CheckRecord(op, v); !s.ok()) return s;
  if (v.signal_count < op_table::kGemmArSlots.end()) {
    return Status::Invalid(std::string("pk.") + op + ": the signal pad has " +
                           std::to_string(v.signal_count) + " slots, the fused GEMM ops need " +
                           std::to_string(op_table::kGemmArSlots.end()));
  }
  if (v.world > pk::tp::MAX_PEERS) {
    return Status::Invalid(std::string("pk.") + op + ": at most " +
                           std::to_string(pk::tp::MAX_PEERS) + " ranks.");
  }
  View(op_id, op_table::Find(op_id)->slots.base, v, rank_ptr, c);
  return Status::Ok();
}

// Starts this call's epoch (pk/tp.cuh epoch_kernel), after every check of the call.
//
// NOTES: epochs count the calls each rank ran, so they agree across ranks only if every rank
// refuses or runs each call alike. Every check before this point depends on the call's shapes,
// attributes and the communicator's world alone (never on the local SM count or partition),
// which all ranks share: a refused call is refused everywhere and no epoch moves.
inline Status StartEpoch(cudaStream_t stream, const pk::tp::comm& c) {
  pk::tp::epoch_kernel<<<1, 1, 0, stream>>>(c);
  return CudaStatus(cudaGetLastError(), "the epoch kernel");
}

inline Status WorkspaceCheck(const char* op, uint64_t need, uint64_t have) {
  if (need <= have) return Status::Ok();
  return Status::Invalid(std::string("pk.") + op + ": the symmetric workspace has " +
                         std::to_string(have) + " bytes and this call needs " +
                         std::to_string(need) +
                         "; call pk.init(mesh, workspace_bytes=...) with at least that.");
}

// The body of the three handlers: binds XLA's buffers into GemmArgs, takes the communicator,
// SM count and peer-map cache from the executable's state and calls `launch`. x_full is
// ag_gemm's second result (nullptr for the others); op_id: the op (the fields it fills).
inline ffi::Error RunGemm(const char* op, int op_id,
                          Status (*launch)(const Where&, const GemmArgs&, const CommView&),
                          cudaStream_t stream, int32_t device, CommState* state,
                          const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                          const ffi::Buffer<ffi::S32>& rank, ffi::AnyBuffer y,
                          ffi::AnyBuffer* x_full, int64_t config, int64_t group_m,
                          int64_t num_comm_sms) {
  const CommView* v = nullptr;
  int num_sms = 0;
  PeerMaps* maps = nullptr;
  if (ffi::Error e = BindComm(op, state, device, &v, &num_sms, &maps); e.failure()) return e;
  GemmArgs a{};
  MarkFields(op_id, &a);
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y.dimensions();
  const bool same = w.element_type() == x.element_type() &&
                    y.element_type() == x.element_type() &&
                    (x_full == nullptr || x_full->element_type() == x.element_type());
  if (!ToDType(x.element_type(), &a.dtype) || !same) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op +
                                       ": x, w and the results must share one dtype.");
  }
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[0]) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op +
                                       ": expected x [M, K], w [K, N] and a 2-D y.");
  }
  if (x_full != nullptr) {
    const auto fd = x_full->dimensions();
    if (fd.size() != 2 || fd[1] != xd[1] || fd[0] != yd[0]) {
      return ffi::Error::InvalidArgument(std::string("pk.") + op +
                                         ": x_full must be [M, K] with y's M rows.");
    }
  }
  a.x = x.untyped_data();
  a.w = w.untyped_data();
  a.y = y.untyped_data();
  a.x_full = x_full != nullptr ? x_full->untyped_data() : nullptr;
  a.rank = rank.typed_data();
  a.m = xd[0];
  a.k = xd[1];
  a.n = wd[1];
  a.y_rows = yd[0];
  a.y_cols = yd[1];
  a.config = config;
  a.group_m = group_m;
  a.num_comm_sms = num_comm_sms;
  if (ffi::Error e = CheckFilled(op_id, a); e.failure()) return e;
  return ToError(launch(Where{stream, device, num_sms, maps}, a, *v));
}

}  // namespace pk_ffi::tp
