// FFI handler and launcher of pk_matmul: y = x @ w on one GPU (see cuda/kernels/matmul.cuh).
// Tensor maps come from the cache in tensor_map.h.
#include <string>

#include "ffi_util.h"
#include "kernels/matmul.cuh"
#include "launch.h"
#include "tensor_map.h"

namespace pk_ffi {
namespace {

template <typename T>
cudaError_t Launch(int64_t config, const pk::matmul::globals& g, cudaStream_t stream, int device,
                   int num_sms) {
  switch (config) {
    case pk::matmul::TILE_128x256:
      return pk::matmul::launch<pk::matmul::config_128x256<T>>(g, stream, device, num_sms);
    case pk::matmul::TILE_128x256_S3:
      return pk::matmul::launch<pk::matmul::config_128x256_s3<T>>(g, stream, device, num_sms);
    default:
      return pk::matmul::launch<pk::matmul::config_128x128<T>>(g, stream, device, num_sms);
  }
}

}  // namespace

Status LaunchMatmul(const Where& at, const GemmArgs& a) {
  if (a.dtype != DType::kBF16 && a.dtype != DType::kF16) {
    return Status::Invalid("pk_matmul: x, w and y must all be bf16 or all fp16.");
  }
  const int64_t m = a.m, k = a.k, n = a.n;
  if (a.y_rows != m || a.y_cols != n) {
    return Status::Invalid("pk_matmul: expected x [M, K], w [K, N], y [M, N].");
  }
  if (k % 8 != 0 || n % 8 != 0) {
    return Status::Invalid(
        "pk_matmul: K and N must be multiples of 8 (16-byte TMA row strides); pk_jax pads N.");
  }
  if (a.config < 0 || a.config >= pk::matmul::NUM_CONFIGS) {
    return Status::Invalid("pk_matmul: unknown tile config " + std::to_string(a.config));
  }
  if (m == 0 || n == 0) return Status::Ok();
  if (k == 0) {
    return CudaStatus(cudaMemsetAsync(a.y, 0, uint64_t(m) * uint64_t(n) * 2, at.stream),
                      "cudaMemsetAsync");
  }
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
    return Status::Invalid("pk_matmul: dimensions must be below 2^31.");
  }
  int bm, bn;
  pk::matmul::tile_shape(static_cast<int>(a.config), &bm, &bn);
  const int type = a.dtype == DType::kBF16 ? 0 : 1;
  pk::matmul::globals g;
  g.m = static_cast<int>(m);
  g.n = static_cast<int>(n);
  g.k = static_cast<int>(k);
  g.group_m = static_cast<int>(a.group_m < 1 ? 1 : (a.group_m > 1024 ? 1024 : a.group_m));
  g.bound = pk::wait_bound{};  // no communicator: an mbarrier that never completes traps
  const char* op = "matmul";
  const MapKey maps[] = {{a.x, uint64_t(m), uint64_t(k), uint32_t(bm), 64, type},
                         {a.w, uint64_t(k), uint64_t(n), 64, 64, type},
                         {a.y, uint64_t(m), uint64_t(n), 64, 64, type}};
  CUtensorMap* outs[] = {&g.x, &g.w, &g.y};
  for (int i = 0; i < 3; ++i) {
    if (Status s = TensorMap(op, maps[i], outs[i]); !s.ok()) return s;
  }
  return CudaStatus(type == 0 ? Launch<__nv_bfloat16>(a.config, g, at.stream, at.device,
                                                      at.num_sms)
                              : Launch<__half>(a.config, g, at.stream, at.device, at.num_sms),
                    op);
}

namespace {

ffi::Error MatmulCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::Result<ffi::AnyBuffer> y, int64_t config, int64_t group_m) {
  GemmArgs a{};
  MarkFields(kOpMatmul, &a);
  const ffi::DataType dt = x.element_type();
  if (!ToDType(dt, &a.dtype) || w.element_type() != dt || y->element_type() != dt) {
    return ffi::Error::InvalidArgument("pk_matmul: x, w and y must all be bf16 or all fp16.");
  }
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[0]) {
    return ffi::Error::InvalidArgument("pk_matmul: expected x [M, K], w [K, N], y [M, N].");
  }
  a.x = x.untyped_data();
  a.w = w.untyped_data();
  a.y = y->untyped_data();
  a.m = xd[0];
  a.k = xd[1];
  a.n = wd[1];
  a.y_rows = yd[0];
  a.y_cols = yd[1];
  a.config = config;
  a.group_m = group_m;
  if (ffi::Error e = CheckFilled(kOpMatmul, a); e.failure()) return e;
  int num_sms = 0;
  if (ffi::Error e = NumSms(device, &num_sms); e.failure()) return e;
  return ToError(LaunchMatmul(Where{stream, device, num_sms}, a));
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkMatmul, pk_ffi::MatmulCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x [M, K]
                                  .Arg<xla::ffi::AnyBuffer>()                     // w [K, N]
                                  .Ret<xla::ffi::AnyBuffer>()                     // y [M, N]
                                  .Attr<int64_t>("config")                        // tile config
                                  .Attr<int64_t>("group_m"),  // block-rows per band
                              PK_FFI_CUDA_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpMatmul, "CUDA", PkMatmul);
