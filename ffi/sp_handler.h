// Shared glue for the sequence-parallel attention ops, ring and Ulysses, forward and backward
// (ring_attn.cu, ring_attn_bwd.cu, ulysses_attn.cu, ulysses_attn_bwd.cu): the checks every
// launcher makes, the workspace-too-small error, the tensor maps, the epoch and the launch by
// dtype and head dim, and the body of the four FFI handlers. Each op's file keeps what is its
// own: its operand checks and args fill, its kernel's arguments (globals) and its kernel.
//
// Every message names the op as its callers know it ("pk.ring_attention (backward): ..."), so
// the op passes that name; Python and the tests match on these texts.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "comm_state.h"
#include "ffi_util.h"
#include "launch.h"
#include "tensor_map.h"
#include "tp.h"

namespace pk_ffi::sp {

// An argument error of op `op`: "pk." + op + ": " + what.
inline Status Invalid(const std::string& op, const std::string& what) {
  return Status::Invalid("pk." + op + ": " + what);
}

// The communicator checks every launcher makes first: the error record (no call starts after a
// peer timed out), a signal pad reaching the end of the op's slot range, and a world within
// the kernels' peers (each op's file asserts that its kernel's MAX_PEERS is the op table's).
inline Status CheckComm(const std::string& op, const op_table::Range& slots,
                        const CommView& v) {
  if (Status s = CheckRecord(op.c_str(), v); !s.ok()) return s;
  if (v.signal_count < slots.end()) {
    return Invalid(op, "the signal pad has " + std::to_string(v.signal_count) +
                           " slots, the kernel needs " + std::to_string(slots.end()));
  }
  if (v.world > op_table::kMaxPeers) {
    return Invalid(op, "at most " + std::to_string(op_table::kMaxPeers) + " ranks");
  }
  return Status::Ok();
}

// The operand checks every launcher makes: one 2-byte float dtype (`operands` names them in the
// message), a head dim the kernels are compiled for, and K/V heads dividing the query heads.
inline Status CheckOperands(const std::string& op, const char* operands, DType dtype, int64_t d,
                            int64_t h, int64_t hkv) {
  if (dtype != DType::kBF16 && dtype != DType::kF16) {
    return Invalid(op, std::string(operands) + " must all be bf16 or all fp16.");
  }
  if (d != 64 && d != 128) {
    return Invalid(op, "head_dim must be 64 or 128, got " + std::to_string(d));
  }
  if (hkv < 1 || h % hkv != 0) return Invalid(op, "the K/V heads must divide the query heads.");
  return Status::Ok();
}

// The communication blocks (the same on every rank): 1 to the kernels' MAX_COMM, which each
// op's file asserts is the op table's.
inline Status CheckCommSms(const std::string& op, int64_t num_comm_sms) {
  if (num_comm_sms >= 1 && num_comm_sms <= op_table::kAttnMaxCommSms) return Status::Ok();
  return Invalid(op, "num_comm_sms must be in 1.." + std::to_string(op_table::kAttnMaxCommSms) +
                         ", got " + std::to_string(num_comm_sms));
}

// The error of a call whose symmetric workspace is too small; `what` says what it holds.
inline Status WorkspaceCheck(const std::string& op, uint64_t need, uint64_t have,
                             const char* what) {
  if (need <= have) return Status::Ok();
  return Invalid(op, "the symmetric workspace has " + std::to_string(have) +
                         " bytes and this call needs " + std::to_string(need) + " (" + what +
                         "); call pk.init(mesh, workspace_bytes=...) with at least that.");
}

// Whether a call has nothing to compute: its launcher then returns Ok without a launch, after
// every check.
//
// NOTES: every check before this point depends on the call's shapes, attributes and the world
// only, which all ranks share: every rank refuses or runs each call alike, so the epochs
// (tp::StartEpoch) stay in step.
template <class A>
bool Empty(const A& a) {
  return a.b == 0 || a.s == 0 || a.h == 0;
}

// The tensor maps' type code (tensor_map.h Map4d) of the operands' dtype, bf16 or fp16.
inline int MapType(DType dtype) { return dtype == DType::kBF16 ? 0 : 1; }

// One 4-D tensor map to encode (tensor_map.h Map4d): an operand or a workspace section
// [batch, S, heads, D] read in boxes of `rows` positions, type 0 bf16, 1 fp16 or 2 float32.
struct Map {
  const void* ptr;
  int64_t batch, heads;
  uint32_t rows;
  int type;
  CUtensorMap* out;
};

// Encodes `maps` in order, each with s positions and head dim d; errors name `op`.
inline Status EncodeMaps(const char* op, int64_t s, int64_t d, std::initializer_list<Map> maps) {
  for (const Map& m : maps) {
    if (Status st = Map4d(op, m.ptr, m.batch, s, m.heads, d, m.rows, m.type, m.out); !st.ok()) {
      return st;
    }
  }
  return Status::Ok();
}

// A kernel configuration: element type T and head dim D (the kernels' launch<T, D>).
template <class Elem, int kHeadDim>
struct Config {
  using T = Elem;
  static constexpr int D = kHeadDim;
};

// Starts the call's epoch (tp::StartEpoch, after every check), then returns what
// launch(Config<T, D>{}) returns for the element type T of `dtype` (bf16 or fp16) and the head
// dim d (64 or 128): the one place mapping them. CUDA errors name `op`.
template <class F>
Status Launch(const std::string& op, const Where& at, const pk::tp::comm& c, DType dtype,
              int64_t d, F&& launch) {
  if (Status s = tp::StartEpoch(at.stream, c); !s.ok()) return s;
  cudaError_t err;
  if (dtype == DType::kBF16) {
    err = d == 64 ? launch(Config<__nv_bfloat16, 64>{}) : launch(Config<__nv_bfloat16, 128>{});
  } else {
    err = d == 64 ? launch(Config<__half, 64>{}) : launch(Config<__half, 128>{});
  }
  return CudaStatus(err, op.c_str());
}

// What every handler gets besides its buffers: XLA's stream and device, the executable's
// communicator, the rank operand, and the attributes every op takes (comm_id is the
// instantiate stage's, comm_state.h).
struct Call {
  cudaStream_t stream;
  int32_t device;
  CommState* state;
  const ffi::Buffer<ffi::S32>& rank;
  float scale;
  int64_t causal;
  int64_t num_comm_sms;
};

// The body of the four handlers: binds the call's communicator (errors name `name`), lets
// `bind(view, &args)` fill the op's own fields from XLA's buffers and attributes (false when
// they do not fit: an InvalidArgument of `shapes`), sets the fields every op shares, checks that
// every field of op `op_id` is filled (ffi_util.h CheckFilled) and runs `launch` on XLA's
// stream.
//
// `a` starts as `init`: the flags that decide which fields the op needs (ring attention's
// masked and segments) are set there, before the fields are marked.
template <class Args, class Bind>
ffi::Error Run(const Call& call, int op_id, const char* name, const char* shapes,
               Status (*launch)(const Where&, const Args&, const CommView&), Bind&& bind,
               const Args& init = Args{}) {
  const CommView* view = nullptr;
  int num_sms = 0;
  if (ffi::Error e = BindComm(name, call.state, call.device, &view, &num_sms); e.failure()) {
    return e;
  }
  Args a = init;
  MarkFields(op_id, &a);
  if (!bind(*view, &a)) return ffi::Error::InvalidArgument(shapes);
  a.rank = call.rank.typed_data();
  a.scale = call.scale;
  a.causal = call.causal != 0;
  a.num_comm_sms = call.num_comm_sms;
  if (ffi::Error e = CheckFilled(op_id, a); e.failure()) return e;
  return ToError(launch(Where{call.stream, call.device, num_sms}, a, *view));
}

}  // namespace pk_ffi::sp
