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
using E4M3 = __nv_fp8_e4m3;
using E5M2 = __nv_fp8_e5m2;

// Calls launch(C{}) for the configuration of the call's formats, scales and tile: the one place
// mapping them (12 kernels: 2 x formats x 2 w formats x (2 per-tensor tiles + blockwise)).
template <typename XT, typename WT, class F>
cudaError_t WithTile(const GemmFp8Args& a, F&& launch) {
  if (a.blockwise) return launch(rf::config_block<XT, WT>{});
  return a.config == op_table::kTile128x256 ? launch(rf::config_128x256<XT, WT>{})
                                            : launch(rf::config_128x128<XT, WT>{});
}
template <typename XT, class F>
cudaError_t WithW(const GemmFp8Args& a, F&& launch) {
  return a.w_dtype == DType::kE5M2 ? WithTile<XT, E5M2>(a, launch)
                                   : WithTile<XT, E4M3>(a, launch);
}
template <class F>
cudaError_t WithConfigFp8(const GemmFp8Args& a, F&& launch) {
  return a.dtype == DType::kE5M2 ? WithW<E5M2>(a, launch) : WithW<E4M3>(a, launch);
}

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
  if (!IsFp8(a.dtype) || !IsFp8(a.w_dtype)) {
    return Status::Invalid(pre + "x and w must be float8_e4m3fn or float8_e5m2.");
  }
  if (a.y_dtype != DType::kBF16) return Status::Invalid(pre + "y must be bfloat16.");
  const int64_t m = a.m, k = a.k, n = a.n;
  if (m < 0 || k < 0 || n < 0 || k % 16 != 0 || n % 8 != 0) {
    return Status::Invalid(pre +
                           "K/P must be a multiple of 16 and N of 8 (16-byte TMA row strides of "
                           "x, wt and y); pk_jax pads N.");
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
  // matmul_fp8's scale layouts, of this rank's shard (K = K/P): blockwise x_scale transposed
  // [KB, >= M] and w_scale [KB, >= NB], rows padded to multiples of 4 (16-byte TMA strides).
  const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
  if (a.blockwise) {
    if (a.xs_rows != kb || a.xs_cols < m || a.xs_cols % 4 != 0 || a.ws_rows != kb ||
        a.ws_cols < nb || a.ws_cols % 4 != 0) {
      return Status::Invalid(
          pre + "blockwise scales must be x_scale transposed [ceil(K/128), >= M] and w_scale "
                "[ceil(K/128), >= ceil(N/128)], rows padded to multiples of 4; got [" +
          std::to_string(a.xs_rows) + ", " + std::to_string(a.xs_cols) + "] and [" +
          std::to_string(a.ws_rows) + ", " + std::to_string(a.ws_cols) + "].");
    }
  } else if (a.xs_rows * a.xs_cols != 1 || a.ws_rows * a.ws_cols != 1) {
    return Status::Invalid(pre + "per-tensor scales must be one float each.");
  }
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
  if (Status s = CudaStatus(WithConfigFp8(a, [&](auto cfg) {
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

// Binds XLA's buffers into GemmFp8Args, takes the communicator, SM count and peer-map cache
// from the executable's state and calls `launch` (tp.h RunGemm's steps with the scales).
ffi::Error RunGemmFp8(const char* op, int op_id,
                      Status (*launch)(const Where&, const GemmFp8Args&, const CommView&),
                      cudaStream_t stream, int32_t device, CommState* state,
                      const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                      const ffi::Buffer<ffi::F32>& x_scale, const ffi::Buffer<ffi::F32>& w_scale,
                      const ffi::Buffer<ffi::S32>& rank, ffi::AnyBuffer y, int64_t config,
                      int64_t group_m) {
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
    return ffi::Error::InvalidArgument(pre + "expected x [M, K/P], wt [N, K/P] and a 2-D y.");
  }
  const auto sxd = x_scale.dimensions(), swd = w_scale.dimensions();
  if (sxd.size() != swd.size() || (sxd.size() != 0 && sxd.size() != 2)) {
    return ffi::Error::InvalidArgument(
        pre + "x_scale and w_scale must both be scalars (per tensor) or both rank 2 (blockwise).");
  }
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
  return RunGemmFp8("gemm_reduce_scatter_fp8", kOpGemmRsFp8, LaunchGemmRsFp8, stream, device,
                    state, x, w, x_scale, w_scale, rank, *y, config, group_m);
}

ffi::Error GemmArFp8Cuda(cudaStream_t stream, int32_t device, CommState* state, ffi::AnyBuffer x,
                         ffi::AnyBuffer w, ffi::Buffer<ffi::F32> x_scale,
                         ffi::Buffer<ffi::F32> w_scale, ffi::Buffer<ffi::S32> rank,
                         ffi::Result<ffi::AnyBuffer> y, int64_t /*comm_id*/, int64_t config,
                         int64_t group_m) {
  return RunGemmFp8("gemm_all_reduce_fp8", kOpGemmArFp8, LaunchGemmArFp8, stream, device, state,
                    x, w, x_scale, w_scale, rank, *y, config, group_m);
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
