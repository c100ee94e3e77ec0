// FFI handler for pk_reduce_scatter: y = slice `rank` of the sum over ranks of x (see
// cuda/kernels/reduce_scatter.cuh). Launches on XLA's stream; no host synchronisation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "collective.h"
#include "kernels/reduce_scatter.cuh"

namespace pk_ffi {
namespace {

ffi::Error ReduceScatterCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                             ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> y,
                             int64_t comm_id, int64_t run) {
  pk::coll::globals g;
  uint64_t ws_bytes = 0;
  if (ffi::Error e = CollectiveGlobals("reduce_scatter", kOpReduceScatter, comm_id, device,
                                       x.untyped_data(), y->untyped_data(), rank.typed_data(),
                                       static_cast<int64_t>(x.element_count()), &g, &ws_bytes);
      e.failure()) {
    return e;
  }
  const size_t n = x.element_count();
  if (x.element_type() != y->element_type() || n % g.world != 0 ||
      y->element_count() != n / g.world ||
      (n > 0 && (run <= 0 || n % (run * g.world) != 0))) {
    return ffi::Error::InvalidArgument(
        "pk.reduce_scatter: output must be x's dtype with 1/P of its elements, and P * run "
        "must divide x's size");
  }
  pk::coll::launch_status st;
  switch (x.element_type()) {
    case ffi::DataType::BF16:
      st = pk::reduce_scatter::launch<__nv_bfloat16>(g, run, ws_bytes, stream, device);
      break;
    case ffi::DataType::F16:
      st = pk::reduce_scatter::launch<__half>(g, run, ws_bytes, stream, device);
      break;
    case ffi::DataType::F32:
      st = pk::reduce_scatter::launch<float>(g, run, ws_bytes, stream, device);
      break;
    default:
      return ffi::Error::InvalidArgument("pk.reduce_scatter: dtype must be bf16, fp16 or fp32");
  }
  return CollectiveStatus("reduce_scatter", st, ws_bytes);
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkReduceScatter, pk_ffi::ReduceScatterCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                     // y
                                  .Attr<int64_t>("comm_id")                       // comm_id
                                  .Attr<int64_t>("run"),  // run: C, elements of one slice row
                              PK_FFI_CUDA_TRAITS);
