// FFI handler and launcher of pk_matmul_fp8: y = (x * x_scale) @ (w * w_scale) with fp8 x and
// w on one GPU (see cuda/kernels/matmul_fp8.cuh). w comes transposed, wt [N, K]; the Python op
// (pk_jax/ops/matmul.py) lays out the operands and scales. Tensor maps come from the cache in
// tensor_map.h.
#include <string>

#include "ffi_util.h"
#include "kernels/matmul_fp8.cuh"
#include "launch.h"
#include "tensor_map.h"

namespace pk_ffi {
namespace {

namespace mf = pk::matmul_fp8;
using E4M3 = __nv_fp8_e4m3;
using E5M2 = __nv_fp8_e5m2;

template <typename XT, typename WT, typename OUT>
cudaError_t LaunchConfig(const MatmulFp8Args& a, const mf::globals& g, const Where& at) {
  if (a.blockwise) {
    return mf::launch<mf::config_block<XT, WT, OUT>>(g, at.stream, at.device, at.num_sms);
  }
  if (a.config == op_table::kTile128x256) {
    return mf::launch<mf::config_128x256<XT, WT, OUT>>(g, at.stream, at.device, at.num_sms);
  }
  return mf::launch<mf::config_128x128<XT, WT, OUT>>(g, at.stream, at.device, at.num_sms);
}

template <typename XT, typename WT>
cudaError_t LaunchOut(const MatmulFp8Args& a, const mf::globals& g, const Where& at) {
  return a.y_dtype == DType::kF32 ? LaunchConfig<XT, WT, float>(a, g, at)
                                  : LaunchConfig<XT, WT, __nv_bfloat16>(a, g, at);
}

template <typename XT>
cudaError_t LaunchW(const MatmulFp8Args& a, const mf::globals& g, const Where& at) {
  return a.w_dtype == DType::kE5M2 ? LaunchOut<XT, E5M2>(a, g, at) : LaunchOut<XT, E4M3>(a, g, at);
}

}  // namespace

Status LaunchMatmulFp8(const Where& at, const MatmulFp8Args& a) {
  const char* op = "matmul_fp8";
  if (!IsFp8(a.dtype) || !IsFp8(a.w_dtype)) {
    return Status::Invalid("pk_matmul_fp8: x and w must be float8_e4m3fn or float8_e5m2.");
  }
  if (a.y_dtype != DType::kBF16 && a.y_dtype != DType::kF32) {
    return Status::Invalid("pk_matmul_fp8: y must be bfloat16 or float32.");
  }
  const int64_t m = a.m, k = a.k, n = a.n;
  if (a.y_rows != m || a.y_cols != n || m < 0 || k < 0 || n < 0) {
    return Status::Invalid("pk_matmul_fp8: expected x [M, K], wt [N, K], y [M, N].");
  }
  if (k % 16 != 0 || n % 8 != 0) {
    return Status::Invalid(
        "pk_matmul_fp8: K must be a multiple of 16 and N of 8 (16-byte TMA row strides of x, "
        "wt and y); pk_jax pads N.");
  }
  if (a.config != op_table::kTile128x256 && a.config != op_table::kTile128x128) {
    return Status::Invalid("pk_matmul_fp8: tile config must be 128x256 or 128x128, got " +
                           std::to_string(a.config));
  }
  if (a.blockwise && a.config != op_table::kTile128x128) {
    return Status::Invalid("pk_matmul_fp8: blockwise scaling takes the 128x128 tile config.");
  }
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
    return Status::Invalid("pk_matmul_fp8: dimensions must be below 2^31.");
  }
  const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
  if (a.blockwise) {
    if (a.xs_rows != kb || a.xs_cols < m || a.xs_cols % 4 != 0 || a.ws_rows != kb ||
        a.ws_cols < nb || a.ws_cols % 4 != 0) {
      return Status::Invalid(
          "pk_matmul_fp8: blockwise scales must be x_scale transposed [ceil(K/128), >= M] and "
          "w_scale [ceil(K/128), >= ceil(N/128)], rows padded to multiples of 4; got [" +
          std::to_string(a.xs_rows) + ", " + std::to_string(a.xs_cols) + "] and [" +
          std::to_string(a.ws_rows) + ", " + std::to_string(a.ws_cols) + "].");
    }
  } else if (a.xs_rows * a.xs_cols != 1 || a.ws_rows * a.ws_cols != 1) {
    return Status::Invalid("pk_matmul_fp8: per-tensor scales must be one float each.");
  }
  const int out_bytes = a.y_dtype == DType::kF32 ? 4 : 2;
  if (m == 0 || n == 0) return Status::Ok();
  if (k == 0) {
    return CudaStatus(cudaMemsetAsync(a.y, 0, uint64_t(m) * uint64_t(n) * out_bytes, at.stream),
                      "cudaMemsetAsync");
  }
  const uint32_t bn = a.config == op_table::kTile128x256 && !a.blockwise ? 256 : 128;
  mf::globals g{};
  g.m = static_cast<int>(m);
  g.n = static_cast<int>(n);
  g.k = static_cast<int>(k);
  g.group_m = static_cast<int>(a.group_m < 1 ? 1 : (a.group_m > 1024 ? 1024 : a.group_m));
  g.bound = pk::wait_bound{};  // no communicator: an mbarrier that never completes traps
  g.x_scale = a.x_scale;
  g.w_scale = a.w_scale;
  const int y_type = a.y_dtype == DType::kF32 ? kMapF32 : kMapBF16;
  const MapKey maps[] = {
      {a.x, uint64_t(m), uint64_t(k), 128, 128, kMapFp8},
      {a.w, uint64_t(n), uint64_t(k), bn, 128, kMapFp8},
      {a.y, uint64_t(m), uint64_t(n), 64, uint32_t(128 / out_bytes), y_type},
      {a.x_scale, uint64_t(kb), uint64_t(a.xs_cols), 1, pk::fp8_layout::X_SCALE_BOX,
       kMapF32Plain},
      {a.w_scale, uint64_t(kb), uint64_t(a.ws_cols), 1, pk::fp8_layout::W_SCALE_BOX,
       kMapF32Plain},
  };
  CUtensorMap* outs[] = {&g.x, &g.w, &g.y, &g.xs, &g.ws};
  for (int i = 0; i < (a.blockwise ? 5 : 3); ++i) {
    if (Status s = TensorMap(op, maps[i], outs[i]); !s.ok()) return s;
  }
  return CudaStatus(a.dtype == DType::kE5M2 ? LaunchW<E5M2>(a, g, at) : LaunchW<E4M3>(a, g, at),
                    op);
}

namespace {

ffi::Error MatmulFp8Cuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::Buffer<ffi::F32> x_scale, ffi::Buffer<ffi::F32> w_scale,
                         ffi::Result<ffi::AnyBuffer> y, int64_t config, int64_t group_m) {
  MatmulFp8Args a{};
  a.blockwise = x_scale.dimensions().size() == 2;  // the flag first: it says what the scales are
  MarkFields(kOpMatmulFp8, &a);
  if (!ToFp8(x.element_type(), &a.dtype) || !ToFp8(w.element_type(), &a.w_dtype)) {
    return ffi::Error::InvalidArgument(
        "pk_matmul_fp8: x and w must be float8_e4m3fn or float8_e5m2.");
  }
  switch (y->element_type()) {
    case ffi::DataType::BF16: a.y_dtype = DType::kBF16; break;
    case ffi::DataType::F32: a.y_dtype = DType::kF32; break;
    default: return ffi::Error::InvalidArgument("pk_matmul_fp8: y must be bf16 or float32.");
  }
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("pk_matmul_fp8: expected x [M, K], wt [N, K], y [M, N].");
  }
  const auto sxd = x_scale.dimensions(), swd = w_scale.dimensions();
  if (sxd.size() != swd.size() || (sxd.size() != 0 && sxd.size() != 2)) {
    return ffi::Error::InvalidArgument(
        "pk_matmul_fp8: x_scale and w_scale must both be scalars (per tensor) or both rank 2 "
        "(blockwise).");
  }
  a.x = x.untyped_data();
  a.w = w.untyped_data();
  a.x_scale = x_scale.typed_data();
  a.w_scale = w_scale.typed_data();
  a.y = y->untyped_data();
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
  if (ffi::Error e = CheckFilled(kOpMatmulFp8, a); e.failure()) return e;
  int num_sms = 0;
  if (ffi::Error e = NumSms(device, &num_sms); e.failure()) return e;
  return ToError(LaunchMatmulFp8(Where{stream, device, num_sms}, a));
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkMatmulFp8, pk_ffi::MatmulFp8Cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x [M, K]
                                  .Arg<xla::ffi::AnyBuffer>()                     // wt [N, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // x_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // w_scale
                                  .Ret<xla::ffi::AnyBuffer>()                     // y [M, N]
                                  .Attr<int64_t>("config")                        // tile config
                                  .Attr<int64_t>("group_m"),  // block-rows per band
                              PK_FFI_CUDA_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpMatmulFp8, "CUDA", PkMatmulFp8);
