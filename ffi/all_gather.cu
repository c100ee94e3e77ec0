// FFI handler and launcher of pk_all_gather: y = every rank's x concatenated along one axis
// (see cuda/kernels/all_gather.cuh). Launches on XLA's stream; no host synchronisation.
#include "collective.h"
#include "comm_state.h"
#include "ffi_util.h"
#include "kernels/all_gather.cuh"

namespace pk_ffi {

Status LaunchAllGather(const Where& at, const CollArgs& a, const CommView& v) {
  pk::coll::globals g;
  if (Status s = CollectiveGlobals("all_gather", kOpAllGather, a, v, &g); !s.ok()) return s;
  if (a.n_out != a.n * v.world || (a.n > 0 && (a.p0 <= 0 || a.n % a.p0 != 0))) {
    return Status::Invalid(
        "pk.all_gather: output must be x's dtype with P times its elements, and run must "
        "divide x's size");
  }
  const pk::coll::launch_status st =
      ByteWidth(a.dtype) == 2
          ? pk::all_gather::launch<uint16_t>(g, a.p0, v.workspace_bytes, at.stream, at.device)
          : pk::all_gather::launch<uint32_t>(g, a.p0, v.workspace_bytes, at.stream, at.device);
  return CollectiveStatus("all_gather", st, v.workspace_bytes);
}

namespace {

ffi::Error AllGatherCuda(cudaStream_t stream, int32_t device, CommState* state, ffi::AnyBuffer x,
                         ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> y,
                         int64_t /*comm_id*/, int64_t run) {
  return RunCollective("all_gather", kOpAllGather, LaunchAllGather, stream, device, state, x,
                       rank, *y, run, 0);
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAllGather, pk_ffi::AllGatherCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                     // y
                                  .Attr<int64_t>("comm_id")                       // comm_id
                                  .Attr<int64_t>("run"),  // run: x elements from axis on,
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpAllGather, "CUDA", PkAllGather);
