// FFI handler for pk_all_reduce: y = sum over the communicator's ranks of x (see
// cuda/kernels/all_reduce.cuh). Launches on XLA's stream; no host synchronisation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "collective.h"
#include "kernels/all_reduce.cuh"

namespace pk_ffi {
namespace {

ffi::Error AllReduceCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                         ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> y,
                         int64_t comm_id, int64_t algo) {
  if (x.element_type() != y->element_type() || x.element_count() != y->element_count()) {
    return ffi::Error::InvalidArgument("pk.all_reduce: output must match x in dtype and size");
  }
  pk::coll::globals g;
  uint64_t ws_bytes = 0;
  if (ffi::Error e = CollectiveGlobals("all_reduce", kOpAllReduce, comm_id, device,
                                       x.untyped_data(), y->untyped_data(), rank.typed_data(),
                                       static_cast<int64_t>(x.element_count()), &g, &ws_bytes);
      e.failure()) {
    return e;
  }
  const int a = static_cast<int>(algo);
  pk::coll::launch_status st;
  switch (x.element_type()) {
    case ffi::DataType::BF16:
      st = pk::all_reduce::launch<__nv_bfloat16>(g, a, ws_bytes, stream, device);
      break;
    case ffi::DataType::F16:
      st = pk::all_reduce::launch<__half>(g, a, ws_bytes, stream, device);
      break;
    case ffi::DataType::F32:
      st = pk::all_reduce::launch<float>(g, a, ws_bytes, stream, device);
      break;
    default:
      return ffi::Error::InvalidArgument("pk.all_reduce: dtype must be bf16, fp16 or fp32");
  }
  return CollectiveStatus("all_reduce", st, ws_bytes);
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAllReduce, pk_ffi::AllReduceCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                     // y
                                  .Attr<int64_t>("comm_id")                       // comm_id
                                  .Attr<int64_t>("algo"),  // algo: 0 auto, 1 one-shot, 2 two-shot
                              PK_FFI_CUDA_TRAITS);
