// FFI handlers for pk_ping: y = x + rank (CUDA and CPU). They prove the wiring from
// jax.ffi.ffi_call to a kernel on XLA's stream; see cuda/kernels/ping.cuh.
#include "ffi_util.h"
#include "kernels/ping.cuh"

namespace pk_ffi {
namespace {

ffi::Error PingCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> rank,
                    ffi::ResultBuffer<ffi::F32> y) {
  pk::ping::globals g{x.typed_data(), rank.typed_data(), y->typed_data(),
                      static_cast<int64_t>(x.element_count())};
  PK_CUDA_CHECK(pk::ping::launch(g, stream));
  return ffi::Error::Success();
}

ffi::Error PingCpu(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> rank,
                   ffi::ResultBuffer<ffi::F32> y) {
  const float r = static_cast<float>(rank.typed_data()[0]);
  const float* in = x.typed_data();
  float* out = y->typed_data();
  for (size_t i = 0; i < x.element_count(); ++i) out[i] = in[i] + r;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkPing, pk_ffi::PingCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>(),       // y
                              PK_FFI_CUDA_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpPing, "CUDA", PkPing);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkPingCpu, pk_ffi::PingCpu,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // rank
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());
PK_FFI_REGISTER(pk_ffi::kOpPing, "cpu", PkPingCpu);  // y
