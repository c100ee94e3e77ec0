// FFI handler and launcher of pk_all_to_all: block j of x's split axis goes to rank j (see
// cuda/kernels/all_to_all.cuh). Launches on XLA's stream; no host synchronisation.
#include "collective.h"
#include "comm_state.h"
#include "ffi_util.h"
#include "kernels/all_to_all.cuh"

namespace pk_ffi {

Status LaunchAllToAll(const Where& at, const CollArgs& a, const CommView& v) {
  pk::coll::globals g;
  if (Status s = CollectiveGlobals("all_to_all", kOpAllToAll, a, v, &g); !s.ok()) return s;
  const int64_t block = a.n / v.world;
  if (a.n_out != a.n || a.n % v.world != 0 ||
      (a.n > 0 && (a.p0 <= 0 || a.p1 <= 0 || a.n % (a.p0 * v.world) != 0 ||
                   block % a.p1 != 0))) {
    return Status::Invalid(
        "pk.all_to_all: output must match x in dtype and size, and the runs must divide it");
  }
  const pk::coll::launch_status st =
      ByteWidth(a.dtype) == 2
          ? pk::all_to_all::launch<uint16_t>(g, a.p0, a.p1, v.workspace_bytes, at.stream,
                                             at.device)
          : pk::all_to_all::launch<uint32_t>(g, a.p0, a.p1, v.workspace_bytes, at.stream,
                                             at.device);
  return CollectiveStatus("all_to_all", st, v.workspace_bytes);
}

namespace {

ffi::Error AllToAllCuda(cudaStream_t stream, int32_t device, CommState* state, ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> y,
                        int64_t /*comm_id*/, int64_t split_run, int64_t concat_run) {
  return RunCollective("all_to_all", kOpAllToAll, LaunchAllToAll, stream, device, state, x,
                       rank, *y, split_run, concat_run);
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAllToAll, pk_ffi::AllToAllCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                     // y
                                  .Attr<int64_t>("comm_id")                       // comm_id
                                  .Attr<int64_t>("split_run")    // x elements from split on
                                  .Attr<int64_t>("concat_run"),  // y elements from concat on,
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpAllToAll, "CUDA", PkAllToAll);
