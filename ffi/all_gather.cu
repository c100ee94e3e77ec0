// FFI handler for pk_all_gather: y = every rank's x concatenated along one axis (see
// cuda/kernels/all_gather.cuh). Launches on XLA's stream; no host synchronisation.
#include "collective.h"
#include "kernels/all_gather.cuh"

namespace pk_ffi {
namespace {

ffi::Error AllGatherCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                         ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> y,
                         int64_t comm_id, int64_t run) {
  pk::coll::globals g;
  uint64_t ws_bytes = 0;
  if (ffi::Error e = CollectiveGlobals("all_gather", kOpAllGather, comm_id, device,
                                       x.untyped_data(), y->untyped_data(), rank.typed_data(),
                                       static_cast<int64_t>(x.element_count()), &g, &ws_bytes);
      e.failure()) {
    return e;
  }
  if (x.element_type() != y->element_type() ||
      y->element_count() != x.element_count() * static_cast<size_t>(g.world) ||
      (x.element_count() > 0 && (run <= 0 || x.element_count() % run != 0))) {
    return ffi::Error::InvalidArgument(
        "pk.all_gather: output must be x's dtype with P times its elements, and run must "
        "divide x's size");
  }
  pk::coll::launch_status st;
  switch (ffi::ByteWidth(x.element_type())) {
    case 2:
      st = pk::all_gather::launch<uint16_t>(g, run, ws_bytes, stream, device);
      break;
    case 4:
      st = pk::all_gather::launch<uint32_t>(g, run, ws_bytes, stream, device);
      break;
    default:
      return ffi::Error::InvalidArgument(
          "pk.all_gather: dtype must be bf16, fp16, fp32 or int32");
  }
  return CollectiveStatus("all_gather", st, ws_bytes);
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAllGather, pk_ffi::AllGatherCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                     // y
                                  .Attr<int64_t>("comm_id")                       // comm_id
                                  .Attr<int64_t>("run"),  // run: x elements from axis on
                              PK_FFI_CUDA_TRAITS);
