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
#include "kernels/matmul_fp8.cuh"
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

// Returns launch(C{}) for the fp8 kernel configuration of the call's formats, scales and tile
// (matmul_fp8's, bf16 y): the one place mapping them for the fused fp8 ops (12 kernels each:
// 2 x formats x 2 w formats x (2 per-tensor tiles + blockwise)).
template <typename XT, typename WT, class F>
cudaError_t WithTileFp8(const GemmFp8Args& a, F&& launch) {
  namespace mf = pk::matmul_fp8;
  if (a.blockwise) return launch(mf::config_block<XT, WT, __nv_bfloat16>{});
  return a.config == op_table::kTile128x256 ? launch(mf::config_128x256<XT, WT, __nv_bfloat16>{})
                                            : launch(mf::config_128x128<XT, WT, __nv_bfloat16>{});
}
template <typename XT, class F>
cudaError_t WithWFp8(const GemmFp8Args& a, F&& launch) {
  return a.w_dtype == DType::kE5M2 ? WithTileFp8<XT, __nv_fp8_e5m2>(a, launch)
                                   : WithTileFp8<XT, __nv_fp8_e4m3>(a, launch);
}
template <class F>
cudaError_t WithConfigFp8(const GemmFp8Args& a, F&& launch) {
  return a.dtype == DType::kE5M2 ? WithWFp8<__nv_fp8_e5m2>(a, launch)
                                 : WithWFp8<__nv_fp8_e4m3>(a, launch);
}

// The fp8 operands of a fused fp8 op (`pre`: "pk.<op>: "): formats, y bf16, x [m, k] and
// wt [n, k] (k this rank's depth) with k % 16 == 0 and n % 8 == 0, a per-tensor tile or
// blockwise with 128x128, and matmul_fp8's scale layouts of this rank's x: blockwise x_scale
// transposed [KB, >= m] and w_scale [KB, >= NB], rows padded to multiples of 4 (16-byte TMA
// strides); per tensor one float each.
inline Status Fp8Operands(const std::string& pre, const GemmFp8Args& a) {
  if (!IsFp8(a.dtype) || !IsFp8(a.w_dtype)) {
    return Status::Invalid(pre + "x and w must be float8_e4m3fn or float8_e5m2.");
  }
  if (a.y_dtype != DType::kBF16) return Status::Invalid(pre + "y must be bfloat16.");
  const int64_t m = a.m, k = a.k, n = a.n;
  if (m < 0 || k < 0 || n < 0 || k % 16 != 0 || n % 8 != 0) {
    return Status::Invalid(pre +
                           "each rank's K must be a multiple of 16 and N of 8 (16-byte TMA row "
                           "strides of x, wt and y); pk_jax pads N.");
  }
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
    return Status::Invalid(pre + "dimensions must be below 2^31.");
  }
  if (a.config != op_table::kTile128x256 && a.config != op_table::kTile128x128) {
    return Status::Invalid(pre + "tile config must be 128x256 or 128x128, got " +
                           std::to_string(a.config));
  }
  if (a.blockwise && a.config != op_table::kTile128x128) {
    return Status::Invalid(pre + "blockwise scaling takes the 128x128 tile config.");
  }
  const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
  if (a.blockwise) {
    if (a.xs_rows != kb || a.xs_cols < m || a.xs_cols % 4 != 0 || a.ws_rows != kb ||
        a.ws_cols < nb || a.ws_cols % 4 != 0) {
      return Status::Invalid(
          pre + "blockwise scales must be x_scale transposed [ceil(K/128), >= x's rows] and "
                "w_scale [ceil(K/128), >= ceil(N/128)], rows padded to multiples of 4; got [" +
          std::to_string(a.xs_rows) + ", " + std::to_string(a.xs_cols) + "] and [" +
          std::to_string(a.ws_rows) + ", " + std::to_string(a.ws_cols) + "].");
    }
  } else if (a.xs_rows * a.xs_cols != 1 || a.ws_rows * a.ws_cols != 1) {
    return Status::Invalid(pre + "per-tensor scales must be one float each.");
  }
  return Status::Ok();
}

// ag_gemm's gather (cuda/kernels/ag_gemm.cuh, ag_gemm::gather), shared by ag_gemm and
// ag_gemm_fp8: the checks of M rows in row blocks of `block_rows` and of the communication
// blocks, then the placement of rank `rank`'s tile order into g (G: the op's globals).
inline Status GatherChecks(const std::string& pre, int64_t m, int64_t block_rows,
                           int64_t num_comm_sms) {
  if (m > INT32_MAX) return Status::Invalid(pre + "M must be below 2^31.");
  const int64_t tiles_m = (m + block_rows - 1) / block_rows;
  if (static_cast<uint64_t>(tiles_m) > pk::tp::MAX_FLAGS) {
    return Status::Invalid(pre + "M must be at most " +
                           std::to_string(pk::tp::MAX_FLAGS * block_rows) + " rows.");
  }
  // NOTES: comm blocks pair up across ranks, so their number is the call's attribute and is
  // never clipped by the local SM count; the compute grid adapts to the SMs (lcsc::launch).
  if (num_comm_sms < 1 || num_comm_sms > pk::tp::MAX_BLOCKS) {
    return Status::Invalid(pre + "num_comm_sms must be in 1.." +
                           std::to_string(pk::tp::MAX_BLOCKS) + ", got " +
                           std::to_string(num_comm_sms));
  }
  return Status::Ok();
}
template <class G>
void PlaceGather(G* g, int rank, int64_t mp, int64_t m, int64_t block_rows) {
  // Block-rows [own_lo, own_hi) lie wholly in rows [first, first + mp) (the last one may be
  // partial only on the last rank); the tile order starts at own_lo (see ag_gemm.cuh).
  const int64_t tiles_m = (m + block_rows - 1) / block_rows;
  const int64_t first = int64_t(rank) * mp, own_lo = (first + block_rows - 1) / block_rows;
  const int64_t own_hi = first + mp >= m ? tiles_m : (first + mp) / block_rows;
  g->rows_per_rank = static_cast<int>(mp);
  g->own_lo = static_cast<int>(own_lo);
  g->own_hi = static_cast<int>(own_hi > own_lo ? own_hi : own_lo);
  g->tiles_m = static_cast<int>(tiles_m);
  g->row_shift = static_cast<int>(own_lo % tiles_m);
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

// The body of the fp8 handlers (gemm_rs_fp8, gemm_ar_fp8, ag_gemm_fp8): RunGemm's steps with
// the scales. x_full and xs_full are ag_gemm_fp8's second and third results (nullptr for the
// others): x_full [y's rows, K] in x's format, xs_full per tensor [y's rows / x's rows] (P),
// blockwise [KB, y's rows].
inline ffi::Error RunGemmFp8(const char* op, int op_id,
                             Status (*launch)(const Where&, const GemmFp8Args&, const CommView&),
                             cudaStream_t stream, int32_t device, CommState* state,
                             const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                             const ffi::Buffer<ffi::F32>& x_scale,
                             const ffi::Buffer<ffi::F32>& w_scale,
                             const ffi::Buffer<ffi::S32>& rank, ffi::AnyBuffer y, int64_t config,
                             int64_t group_m, ffi::AnyBuffer* x_full = nullptr,
                             ffi::Buffer<ffi::F32>* xs_full = nullptr, int64_t num_comm_sms = 0) {
  const CommView* v = nullptr;
  int num_sms = 0;
  PeerMaps* maps = nullptr;
  if (ffi::Error e = BindComm(op, state, device, &v, &num_sms, &maps); e.failure()) return e;
  const std::string pre = std::string("pk.") + op + ": ";
  GemmFp8Args a{};
  a.blockwise = x_scale.dimensions().size() == 2;  // the flag first: it says what the scales are
  MarkFields(op_id, &a);
  if (!ToFp8(x.element_type(), &a.dtype) || !ToFp8(w.element_type(), &a.w_dtype)) {
    return ffi::Error::InvalidArgument(pre + "x and w must be float8_e4m3fn or float8_e5m2.");
  }
  if (y.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument(pre + "y must be bfloat16.");
  }
  a.y_dtype = DType::kBF16;
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument(pre + "expected x and wt of one depth, K, and a 2-D y.");
  }
  const auto sxd = x_scale.dimensions(), swd = w_scale.dimensions();
  if (sxd.size() != swd.size() || (sxd.size() != 0 && sxd.size() != 2)) {
    return ffi::Error::InvalidArgument(
        pre + "x_scale and w_scale must both be scalars (per tensor) or both rank 2 (blockwise).");
  }
  if (x_full != nullptr) {
    const auto fd = x_full->dimensions(), sd = xs_full->dimensions();
    const int64_t kb = (xd[1] + 127) / 128;
    const bool scales_ok = a.blockwise ? sd.size() == 2 && sd[0] == kb && sd[1] == yd[0]
                                       : sd.size() == 1 && xd[0] > 0 && sd[0] * xd[0] == yd[0];
    if (x_full->element_type() != x.element_type() || fd.size() != 2 || fd[0] != yd[0] ||
        fd[1] != xd[1] || (xd[0] > 0 && !scales_ok)) {
      return ffi::Error::InvalidArgument(
          pre + "x_full must be [M, K] in x's format and xs_full [P] (per tensor) or "
                "[ceil(K / 128), M] (blockwise), with y's M rows.");
    }
    a.x_full = x_full->untyped_data();
    a.xs_full = xs_full->typed_data();
  }
  a.num_comm_sms = num_comm_sms;
  a.x = x.untyped_data();
  a.w = w.untyped_data();
  a.x_scale = x_scale.typed_data();
  a.w_scale = w_scale.typed_data();
  a.y = y.untyped_data();
  a.rank = rank.typed_data();
  a.m = xd[0];
  a.k = xd[1];
  a.n = wd[0];
  a.y_rows = yd[0];
  a.y_cols = yd[1];
  a.xs_rows = a.blockwise ? sxd[0] : 1;
  a.xs_cols = a.blockwise ? sxd[1] : 1;
  a.ws_rows = a.blockwise ? swd[0] : 1;
  a.ws_cols = a.blockwise ? swd[1] : 1;
  a.config = config;
  a.group_m = group_m;
  if (ffi::Error e = CheckFilled(op_id, a); e.failure()) return e;
  return ToError(launch(Where{stream, device, num_sms, maps}, a, *v));
}

}  // namespace pk_ffi::tp
