// FFI handler and launcher of pk_grouped_matmul_fp8: the MoE experts' forward with fp8 x and w,
// y[rows of e] = (x * x_scale) @ (w[e] * w_scale[e]) (see cuda/kernels/grouped_matmul_fp8.cuh).
// w comes transposed per expert, wt [E, N, K]; the Python op (pk_jax/ops/grouped_matmul.py
// fp8_grouped_operands) lays out the operands and scales. 2-D tensor maps come from the cache in
// tensor_map.h, the 3-D map over wt is encoded per call.
#include <string>

#include "ffi_util.h"
#include "kernels/grouped_matmul_fp8.cuh"
#include "launch.h"
#include "tensor_map.h"

namespace pk_ffi {
namespace {

namespace gf = pk::grouped_matmul_fp8;
static_assert(gf::MAX_GROUPS == op_table::kMaxGroups, "op_table.h kMaxGroups");
using E4M3 = __nv_fp8_e4m3;
using E5M2 = __nv_fp8_e5m2;

struct Dispatch {
  const GroupedMatmulFp8Args& a;
  const gf::globals& g;
  const Where& at;
  long long max_tiles;

  template <class C>
  cudaError_t Run() const {
    return gf::launch<C>(g, at.stream, at.device, at.num_sms, max_tiles);
  }
  template <typename XT, typename WT, typename OUT>
  cudaError_t Config() const {
    if (a.blockwise) return Run<gf::config_block<XT, WT, OUT>>();
    if (a.config == op_table::kTile128x256) return Run<gf::config_128x256<XT, WT, OUT>>();
    return Run<gf::config_128x128<XT, WT, OUT>>();
  }
  template <typename XT, typename WT>
  cudaError_t Out() const {
    return a.y_dtype == DType::kF32 ? Config<XT, WT, float>() : Config<XT, WT, __nv_bfloat16>();
  }
  template <typename XT>
  cudaError_t W() const {
    return a.w_dtype == DType::kE5M2 ? Out<XT, E5M2>() : Out<XT, E4M3>();
  }
  cudaError_t operator()() const {
    return a.dtype == DType::kE5M2 ? W<E5M2>() : W<E4M3>();
  }
};

}  // namespace

Status LaunchGroupedMatmulFp8(const Where& at, const GroupedMatmulFp8Args& a) {
  const char* op = "grouped_matmul_fp8";
  if (!IsFp8(a.dtype) || !IsFp8(a.w_dtype)) {
    return Status::Invalid("pk_grouped_matmul_fp8: x and w must be float8_e4m3fn or "
                           "float8_e5m2.");
  }
  if (a.y_dtype != DType::kBF16 && a.y_dtype != DType::kF32) {
    return Status::Invalid("pk_grouped_matmul_fp8: y must be bfloat16 or float32.");
  }
  const int64_t m = a.m, k = a.k, n = a.n, e = a.groups;
  if (a.y_rows != m || a.y_cols != n || m < 0 || k < 0 || n < 0) {
    return Status::Invalid(
        "pk_grouped_matmul_fp8: expected x [M, K], wt [E, N, K], group_sizes [E], y [M, N].");
  }
  if (e < 1 || e > gf::MAX_GROUPS) {
    return Status::Invalid("pk_grouped_matmul_fp8: 1 to " + std::to_string(gf::MAX_GROUPS) +
                           " groups supported, got " + std::to_string(e) + ".");
  }
  if (k % 16 != 0 || n % 8 != 0) {
    return Status::Invalid(
        "pk_grouped_matmul_fp8: K must be a multiple of 16 and N of 8 (16-byte TMA row strides "
        "of x, wt and y); pk_jax pads N.");
  }
  if (a.config != op_table::kTile128x256 && a.config != op_table::kTile128x128) {
    return Status::Invalid("pk_grouped_matmul_fp8: tile config must be 128x256 or 128x128, got " +
                           std::to_string(a.config));
  }
  if (a.blockwise && a.config != op_table::kTile128x128) {
    return Status::Invalid(
        "pk_grouped_matmul_fp8: blockwise scaling takes the 128x128 tile config.");
  }
  const int64_t kb = (k + 127) / 128, nb = (n + 127) / 128;
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || e * kb > INT32_MAX) {
    return Status::Invalid("pk_grouped_matmul_fp8: dimensions must be below 2^31.");
  }
  if (a.blockwise) {
    if (a.xs_rows != kb || a.xs_cols < m || a.xs_cols % 4 != 0 || a.ws_rows != e * kb ||
        a.ws_cols < nb || a.ws_cols % 4 != 0) {
      return Status::Invalid(
          "pk_grouped_matmul_fp8: blockwise scales must be x_scale transposed [ceil(K/128), >= "
          "M] and w_scale [E * ceil(K/128), >= ceil(N/128)] (the experts' [E, KB, NB] blocks), "
          "rows padded to multiples of 4; got [" +
          std::to_string(a.xs_rows) + ", " + std::to_string(a.xs_cols) + "] and [" +
          std::to_string(a.ws_rows) + ", " + std::to_string(a.ws_cols) + "].");
    }
  } else if (a.xs_rows * a.xs_cols != 1 || a.ws_rows != e || a.ws_cols != 1) {
    return Status::Invalid(
        "pk_grouped_matmul_fp8: per-tensor scales must be one float for x and one per expert "
        "([E]) for w.");
  }
  const int out_bytes = a.y_dtype == DType::kF32 ? 4 : 2;
  if (m == 0 || n == 0) return Status::Ok();
  if (k == 0) {  // no products: y is all zeros
    return CudaStatus(cudaMemsetAsync(a.y, 0, uint64_t(m) * uint64_t(n) * out_bytes, at.stream),
                      "cudaMemsetAsync");
  }
  const uint32_t bn = a.config == op_table::kTile128x256 && !a.blockwise ? 256 : 128;
  gf::globals g{};
  g.y = a.y;
  g.x_scale = a.x_scale;
  g.w_scale = a.w_scale;
  g.group_sizes = a.group_sizes;
  g.m = static_cast<int>(m);
  g.n = static_cast<int>(n);
  g.k = static_cast<int>(k);
  g.groups = static_cast<int>(e);
  g.group_m = static_cast<int>(a.group_m < 1 ? 1 : (a.group_m > 1024 ? 1024 : a.group_m));
  const int y_type = a.y_dtype == DType::kF32 ? kMapF32 : kMapBF16;
  const MapKey maps[] = {
      {a.x, uint64_t(m), uint64_t(k), 128, 128, kMapFp8},
      {a.y, uint64_t(m), uint64_t(n), 64, uint32_t(128 / out_bytes), y_type},
      {a.x_scale, uint64_t(kb), uint64_t(a.xs_cols), 1, pk::fp8_layout::X_SCALE_BOX,
       kMapF32Plain},
      {a.w_scale, uint64_t(e * kb), uint64_t(a.ws_cols), 1, pk::fp8_layout::W_SCALE_BOX,
       kMapF32Plain},
  };
  CUtensorMap* outs[] = {&g.a, &g.out, &g.xs, &g.ws};
  for (int i = 0; i < (a.blockwise ? 4 : 2); ++i) {
    if (Status s = TensorMap(op, maps[i], outs[i]); !s.ok()) return s;
  }
  if (Status s = TensorMap3d(op, a.w, uint64_t(e), uint64_t(n), uint64_t(k), bn, 128, kMapFp8,
                             &g.b);
      !s.ok()) {
    return s;
  }
  const long long max_tiles = ((m + 127) / 128 + e) * ((n + bn - 1) / bn);
  return CudaStatus(Dispatch{a, g, at, max_tiles}(), op);
}

namespace {

ffi::Error GroupedMatmulFp8Cuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                ffi::AnyBuffer w, ffi::Buffer<ffi::F32> x_scale,
                                ffi::Buffer<ffi::F32> w_scale,
                                ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> y,
                                int64_t config, int64_t group_m) {
  GroupedMatmulFp8Args a{};
  a.blockwise = x_scale.dimensions().size() == 2;  // the flag first: it says what the scales are
  MarkFields(kOpGroupedMatmulFp8, &a);
  if (!ToFp8(x.element_type(), &a.dtype) || !ToFp8(w.element_type(), &a.w_dtype)) {
    return ffi::Error::InvalidArgument(
        "pk_grouped_matmul_fp8: x and w must be float8_e4m3fn or float8_e5m2.");
  }
  switch (y->element_type()) {
    case ffi::DataType::BF16: a.y_dtype = DType::kBF16; break;
    case ffi::DataType::F32: a.y_dtype = DType::kF32; break;
    default:
      return ffi::Error::InvalidArgument("pk_grouped_matmul_fp8: y must be bf16 or float32.");
  }
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const auto gd = group_sizes.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || gd.size() != 1 || xd[1] != wd[2] ||
      gd[0] != wd[0]) {
    return ffi::Error::InvalidArgument(
        "pk_grouped_matmul_fp8: expected x [M, K], wt [E, N, K], group_sizes [E], y [M, N].");
  }
  // Per tensor: x_scale a scalar, w_scale [E]; blockwise: both rank 2 (xs [KB, >= M], ws
  // [E * KB, >= NB]).
  const auto sxd = x_scale.dimensions(), swd = w_scale.dimensions();
  if (!(sxd.size() == 0 && swd.size() == 1) && !(sxd.size() == 2 && swd.size() == 2)) {
    return ffi::Error::InvalidArgument(
        "pk_grouped_matmul_fp8: scales must be x_scale a scalar and w_scale [E] (per tensor), "
        "or both rank 2 (blockwise).");
  }
  a.x = x.untyped_data();
  a.w = w.untyped_data();
  a.x_scale = x_scale.typed_data();
  a.w_scale = w_scale.typed_data();
  a.group_sizes = group_sizes.typed_data();
  a.y = y->untyped_data();
  a.m = xd[0];
  a.k = xd[1];
  a.n = wd[1];
  a.groups = wd[0];
  a.y_rows = yd[0];
  a.y_cols = yd[1];
  a.xs_rows = a.blockwise ? sxd[0] : 1;
  a.xs_cols = a.blockwise ? sxd[1] : 1;
  a.ws_rows = swd[0];
  a.ws_cols = a.blockwise ? swd[1] : 1;
  a.config = config;
  a.group_m = group_m;
  if (ffi::Error e = CheckFilled(kOpGroupedMatmulFp8, a); e.failure()) return e;
  int num_sms = 0;
  if (ffi::Error e = NumSms(device, &num_sms); e.failure()) return e;
  return ToError(LaunchGroupedMatmulFp8(Where{stream, device, num_sms}, a));
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkGroupedMatmulFp8, pk_ffi::GroupedMatmulFp8Cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x [M, K]
                                  .Arg<xla::ffi::AnyBuffer>()                     // wt [E, N, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // x_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // w_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // group_sizes [E]
                                  .Ret<xla::ffi::AnyBuffer>()              // y [M, N]
                                  .Attr<int64_t>("config")                 // tile config
                                  .Attr<int64_t>("group_m"),  // block-rows per band
                              PK_FFI_CUDA_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpGroupedMatmulFp8, "CUDA", PkGroupedMatmulFp8);
