// FFI handler for pk_all_to_all: block j of x's split axis to rank j, received blocks
// concatenated along the concat axis (see cuda/kernels/all_to_all.cuh). Launches on XLA's
// stream; no host synchronisation.
#include "collective.h"
#include "kernels/all_to_all.cuh"

namespace pk_ffi {
namespace {

ffi::Error AllToAllCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> y,
                        int64_t comm_id, int64_t split_run, int64_t concat_run) {
  pk::coll::globals g;
  uint64_t ws_bytes = 0;
  if (ffi::Error e = CollectiveGlobals("all_to_all", kOpAllToAll, comm_id, device,
                                       x.untyped_data(), y->untyped_data(), rank.typed_data(),
                                       static_cast<int64_t>(x.element_count()), &g, &ws_bytes);
      e.failure()) {
    return e;
  }
  const size_t n = x.element_count();
  const size_t block = n / g.world;
  if (x.element_type() != y->element_type() || y->element_count() != n || n % g.world != 0 ||
      (n > 0 && (split_run <= 0 || concat_run <= 0 || n % (split_run * g.world) != 0 ||
                 block % concat_run != 0))) {
    return ffi::Error::InvalidArgument(
        "pk.all_to_all: output must match x in dtype and size, and the runs must divide it");
  }
  pk::coll::launch_status st;
  switch (ffi::ByteWidth(x.element_type())) {
    case 2:
      st = pk::all_to_all::launch<uint16_t>(g, split_run, concat_run, ws_bytes, stream,
                                            device);
      break;
    case 4:
      st = pk::all_to_all::launch<uint32_t>(g, split_run, concat_run, ws_bytes, stream,
                                            device);
      break;
    default:
      return ffi::Error::InvalidArgument(
          "pk.all_to_all: dtype must be bf16, fp16, fp32 or int32");
  }
  return CollectiveStatus("all_to_all", st, ws_bytes);
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAllToAll, pk_ffi::AllToAllCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                     // y
                                  .Attr<int64_t>("comm_id")                       // comm_id
                                  .Attr<int64_t>("split_run")    // C1: block row elements
                                  .Attr<int64_t>("concat_run"),  // C2: received row elements
                              PK_FFI_CUDA_TRAITS);
