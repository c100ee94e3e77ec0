// FFI handlers and launchers of pk_gemm_rs_fp8 and pk_gemm_ar_fp8: gemm_rs / gemm_ar with fp8
// operands and per-tensor or blockwise scales (see cuda/kernels/gemm_rs_fp8.cuh). w comes
// transposed per rank, wt [N, K/P], as matmul_fp8's; the Python ops (pk_jax/ops/gemm_rs.py,
// gemm_ar.py) lay out the operands and scales. Launches on XLA's stream; no host
// synchronisation.
#include <cstring>
#include <string>

#include "kernels/gemm_rs_fp8.cuh"
#include "tp.h"

namespace pk_ffi {
namespace {

namespace rf = pk::gemm_rs_fp8;

// y = the sum over ranks of (x_p x_scale_p) @ (w_p w_scale_p): rows [r Mp, (r+1) Mp) (GATHER =
// false, gemm_rs_fp8, Mp = M / P) or all M rows (GATHER = true, gemm_ar_fp8, Mp = ceil(M / P)).
// tp_rows.h RowSplitGemm's steps with matmul_fp8's operands: always the fused kernels, also at
// P = 1 (Python decides whether to call them).
template <bool GATHER>
Status RowSplitGemmFp8(const char* op, int op_id, const Where& at, const GemmFp8Args& a,
                       const CommView& v) {
  pk::tp::comm c;
  if (Status s = tp::Comm(op, op_id, v, a.rank, &c); !s.ok()) return s;
  const int world = c.world;
  const std::string pre = std::string("pk.") + op + ": ";
  if (Status s = tp::Fp8Operands(pre, a); !s.ok()) return s;
  const int64_t m = a.m, k = a.k, n = a.n, kb = (k + 127) / 128;
  if (!GATHER && m % world != 0) return Status::Invalid(pre + "M must be divisible by P.");
  const int64_t m_out = GATHER ? m : m / world;
  if (a.y_rows != m_out || a.y_cols != n) {
    return Status::Invalid(pre + "expected y [" + std::to_string(m_out) + ", " +
                           std::to_string(n) + "].");
  }
  const uint64_t y_bytes = uint64_t(m_out) * uint64_t(n) * 2;
  if (m_out == 0 || n == 0) return Status::Ok();
  if (k == 0) {  // every partial product is zero: so is the sum
    return CudaStatus(cudaMemsetAsync(a.y, 0, y_bytes, at.stream), "cudaMemsetAsync");
  }
  const uint32_t bm = 128, bn = a.config == op_table::kTile128x256 ? 256 : 128;
  rf::globals g;
  std::memset(&g, 0, sizeof(g));
  g.m = static_cast<int>(m);
  g.n = static_cast<int>(n);
  g.k = static_cast<int>(k);
  g.group_m = static_cast<int>(a.group_m < 1 ? 1 : (a.group_m > 1024 ? 1024 : a.group_m));
  g.bound = c.bound();
  g.x_scale = a.x_scale;
  g.w_scale = a.w_scale;
  if (Status s = TensorMap(op, {a.x, uint64_t(m), uint64_t(k), bm, 128, kMapFp8}, &g.x);
      !s.ok()) {
    return s;
  }
  if (Status s = TensorMap(op, {a.w, uint64_t(n), uint64_t(k), bn, 128, kMapFp8}, &g.w);
      !s.ok()) {
    return s;
  }
  if (a.blockwise) {
    if (Status s = TensorMap(op, {a.x_scale, uint64_t(kb), uint64_t(a.xs_cols), 1,
                                  pk::fp8_layout::X_SCALE_BOX, kMapF32Plain},
                             &g.xs);
        !s.ok()) {
      return s;
    }
    if (Status s = TensorMap(op, {a.w_scale, uint64_t(kb), uint64_t(a.ws_cols), 1,
                                  pk::fp8_layout::W_SCALE_BOX, kMapF32Plain},
                             &g.ws);
        !s.ok()) {
      return s;
    }
  }
  const int64_t mp = GATHER ? (m + world - 1) / world : m / world;
  const uint64_t owner_bytes = WorkspaceNeed(op_id, a, world);  // 16-byte multiple: n % 8 == 0
  if (Status s = tp::WorkspaceCheck(op, owner_bytes, v.workspace_bytes); !s.ok()) return s;
  g.link = c.link;  // the rank emulator's link throttle (off unless pk_jax.testing set it)
  // The owners' buffers, bf16 {64, 64} boxes: the fp8 epilogue's 128-byte panels of 64 rows.
  if (Status s = PeerTensorMaps(op, c.ws, world, uint64_t(mp), uint64_t(n), 64, 64, kMapBF16,
                                at.peer_maps, g.acc);
      !s.ok()) {
    return s;
  }
  g.rows_per_owner = static_cast<int>(mp);
  g.tiles_per_owner = static_cast<int>((mp + bm - 1) / bm);
  g.world = world;
  g.rank = c.rank;
  // P = 1: no peer adds into or gathers from the owner buffer (gemm_rs.cuh, direct mode).
  g.direct = world == 1 ? 1 : 0;
  if (g.direct) {
    if (Status s = TensorMap(op, {a.y, uint64_t(m_out), uint64_t(n), 64, 64, kMapBF16}, &g.y);
        !s.ok()) {
      return s;
    }
  }
  pk::tp::rows_args r;
  r.c = c;
  r.y = a.y;
  r.owner_units = owner_bytes / 16;
  r.out_units = y_bytes / 16;
  // The helper kernels' blocks pair up across ranks: a grid from the problem, not the SMs.
  const int grid = pk::tp::helper_grid(r.owner_units > r.out_units ? r.owner_units
                                                                   : r.out_units);
  if (Status s = tp::StartEpoch(at.stream, c); !s.ok()) return s;
  if (Status s = CudaStatus(tp::WithConfigFp8(a, [&](auto cfg) {
                              return rf::launch_front<decltype(cfg)>(g, r, grid, at.stream,
                                                                     at.device, at.num_sms);
                            }),
                            op);
      !s.ok()) {
    return s;
  }
  if (g.direct) return Status::Ok();
  pk::tp::leave_kernel<GATHER><<<grid, pk::tp::THREADS, 0, at.stream>>>(r);
  return CudaStatus(cudaGetLastError(), op);
}

}  // namespace

Status LaunchGemmRsFp8(const Where& at, const GemmFp8Args& a, const CommView& v) {
  return RowSplitGemmFp8<false>("gemm_reduce_scatter_fp8", kOpGemmRsFp8, at, a, v);
}

Status LaunchGemmArFp8(const Where& at, const GemmFp8Args& a, const CommView& v) {
  return RowSplitGemmFp8<true>("gemm_all_reduce_fp8", kOpGemmArFp8, at, a, v);
}

namespace {

ffi::Error GemmRsFp8Cuda(cudaStream_t stream, int32_t device, CommState* state, ffi::AnyBuffer x,
                         ffi::AnyBuffer w, ffi::Buffer<ffi::F32> x_scale,
                         ffi::Buffer<ffi::F32> w_scale, ffi::Buffer<ffi::S32> rank,
                         ffi::Result<ffi::AnyBuffer> y, int64_t /*comm_id*/, int64_t config,
                         int64_t group_m) {
  return tp::RunGemmFp8("gemm_reduce_scatter_fp8", kOpGemmRsFp8, LaunchGemmRsFp8, stream,
                        device, state, x, w, x_scale, w_scale, rank, *y, config, group_m);
}

ffi::Error GemmArFp8Cuda(cudaStream_t stream, int32_t device, CommState* state, ffi::AnyBuffer x,
                         ffi::AnyBuffer w, ffi::Buffer<ffi::F32> x_scale,
                         ffi::Buffer<ffi::F32> w_scale, ffi::Buffer<ffi::S32> rank,
                         ffi::Result<ffi::AnyBuffer> y, int64_t /*comm_id*/, int64_t config,
                         int64_t group_m) {
  return tp::RunGemmFp8("gemm_all_reduce_fp8", kOpGemmArFp8, LaunchGemmArFp8, stream, device,
                        state, x, w, x_scale, w_scale, rank, *y, config, group_m);
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkGemmRsFp8, pk_ffi::GemmRsFp8Cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()                     // x [M, K/P]
                                  .Arg<xla::ffi::AnyBuffer>()                     // wt [N, K/P]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // x_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // w_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                     // y [M/P, N]
                                  .Attr<int64_t>("comm_id")                       // comm_id
                                  .Attr<int64_t>("config")                        // tile config
                                  .Attr<int64_t>("group_m"),  // block-rows per band
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpGemmRsFp8, "CUDA", PkGemmRsFp8);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkGemmArFp8, pk_ffi::GemmArFp8Cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()                     // x [M, K/P]
                                  .Arg<xla::ffi::AnyBuffer>()                     // wt [N, K/P]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // x_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // w_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                     // y [M, N]
                                  .Attr<int64_t>("comm_id")                       // comm_id
                                  .Attr<int64_t>("config")                        // tile config
                                  .Attr<int64_t>("group_m"),  // block-rows per band
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpGemmArFp8, "CUDA", PkGemmArFp8);
