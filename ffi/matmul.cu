// FFI handler for pk_matmul: y = x @ w on XLA's stream (see cuda/kernels/matmul.cuh). Tensor
// maps come from the cache in tensor_map.h.
#include <string>

#include "ffi_util.h"
#include "kernels/matmul.cuh"
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

ffi::Error MatmulCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::Result<ffi::AnyBuffer> y, int64_t config, int64_t group_m) {
  const ffi::DataType dt = x.element_type();
  if ((dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) || w.element_type() != dt ||
      y->element_type() != dt) {
    return ffi::Error::InvalidArgument("pk_matmul: x, w and y must all be bf16 or all fp16.");
  }
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[0] || yd[0] != xd[0] ||
      yd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("pk_matmul: expected x [M, K], w [K, N], y [M, N].");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  if (k % 8 != 0 || n % 8 != 0) {
    return ffi::Error::InvalidArgument(
        "pk_matmul: K and N must be multiples of 8 (16-byte TMA row strides); pk_jax pads N.");
  }
  if (config < 0 || config >= pk::matmul::NUM_CONFIGS) {
    return ffi::Error::InvalidArgument("pk_matmul: unknown tile config " + std::to_string(config));
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    PK_CUDA_CHECK(cudaMemsetAsync(y->untyped_data(), 0, y->size_bytes(), stream));
    return ffi::Error::Success();
  }
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
    return ffi::Error::InvalidArgument("pk_matmul: dimensions must be below 2^31.");
  }
  int bm, bn;
  pk::matmul::tile_shape(static_cast<int>(config), &bm, &bn);
  const int type = dt == ffi::DataType::BF16 ? 0 : 1;
  pk::matmul::globals g;
  g.m = static_cast<int>(m);
  g.n = static_cast<int>(n);
  g.k = static_cast<int>(k);
  g.group_m = static_cast<int>(group_m < 1 ? 1 : (group_m > 1024 ? 1024 : group_m));
  const char* op = "matmul";
  if (ffi::Error e = TensorMap(op, {x.untyped_data(), uint64_t(m), uint64_t(k), uint32_t(bm), 64,
                                    type}, &g.x);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = TensorMap(op, {w.untyped_data(), uint64_t(k), uint64_t(n), 64, 64, type},
                               &g.w);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = TensorMap(op, {y->untyped_data(), uint64_t(m), uint64_t(n), 64, 64, type},
                               &g.y);
      e.failure()) {
    return e;
  }
  int num_sms = 0;
  if (ffi::Error e = NumSms(device, &num_sms); e.failure()) return e;
  if (type == 0) {
    PK_CUDA_CHECK((Launch<__nv_bfloat16>(config, g, stream, device, num_sms)));
  } else {
    PK_CUDA_CHECK((Launch<__half>(config, g, stream, device, num_sms)));
  }
  return ffi::Error::Success();
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
