// FFI handler and launcher of pk_gemm_ar: y = the sum over ranks of x @ w, on every rank (see
// cuda/kernels/gemm_ar.cuh). Launches on XLA's stream; no host synchronisation.
#include "kernels/gemm_ar.cuh"
#include "tp_rows.h"

namespace pk_ffi {

Status LaunchGemmAr(const Where& at, const GemmArgs& a, const CommView& v) {
  return tp::RowSplitGemm<true>("gemm_all_reduce", kOpGemmAr, at, a, v);
}

namespace {

ffi::Error GemmArCuda(cudaStream_t stream, int32_t device, CommState* state, ffi::AnyBuffer x,
                      ffi::AnyBuffer w, ffi::Buffer<ffi::S32> rank,
                      ffi::Result<ffi::AnyBuffer> y, int64_t /*comm_id*/, int64_t config,
                      int64_t group_m) {
  return tp::RunGemm("gemm_all_reduce", kOpGemmAr, LaunchGemmAr, stream, device, state, x, w,
                     rank, *y, nullptr, config, group_m, 0);
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkGemmAr, pk_ffi::GemmArCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()                     // x [M, K/P]
                                  .Arg<xla::ffi::AnyBuffer>()                     // w [K/P, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                     // y [M, N]  
                                  .Attr<int64_t>("comm_id")                       // comm_id
                                  .Attr<int64_t>("config")                        // tile config
                                  .Attr<int64_t>("group_m"),  // block-rows per band
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpGemmAr, "CUDA", PkGemmAr);
