// FFI handler and launcher of pk_reduce_scatter: y = my slice of the sum over ranks of x (see
// cuda/kernels/reduce_scatter.cuh). Launches on XLA's stream; no host synchronisation.
#include "collective.h"
#include "comm_state.h"
#include "ffi_util.h"
#include "kernels/reduce_scatter.cuh"

namespace pk_ffi {

Status LaunchReduceScatter(const Where& at, const CollArgs& a, const CommView& v) {
  pk::coll::globals g;
  if (Status s = CollectiveGlobals("reduce_scatter", kOpReduceScatter, a, v, &g); !s.ok()) return s;
  if (a.dtype == DType::kS32 || a.n % v.world != 0 || a.n_out != a.n / v.world ||
      (a.n > 0 && (a.p0 <= 0 || a.n % (a.p0 * v.world) != 0))) {
    return Status::Invalid(
        "pk.reduce_scatter: bf16, fp16 or fp32 output with 1/P of x's elements, and P * run "
        "must divide x's size");
  }
  pk::coll::launch_status st;
  switch (a.dtype) {
    case DType::kBF16:
      st = pk::reduce_scatter::launch<__nv_bfloat16>(g, a.p0, v.workspace_bytes, at.stream,
                                                     at.device);
      break;
    case DType::kF16:
      st = pk::reduce_scatter::launch<__half>(g, a.p0, v.workspace_bytes, at.stream, at.device);
      break;
    default:
      st = pk::reduce_scatter::launch<float>(g, a.p0, v.workspace_bytes, at.stream, at.device);
      break;
  }
  return CollectiveStatus("reduce_scatter", st, v.workspace_bytes);
}

namespace {

ffi::Error ReduceScatterCuda(cudaStream_t stream, int32_t device, CommState* state,
                             ffi::AnyBuffer x,
                             ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> y,
                             int64_t /*comm_id*/, int64_t run) {
  return RunCollective("reduce_scatter", kOpReduceScatter, LaunchReduceScatter, stream, device,
                       state, x, rank, *y, run, 0);
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkReduceScatter, pk_ffi::ReduceScatterCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                     // y
                                  .Attr<int64_t>("comm_id")                       // comm_id
                                  .Attr<int64_t>("run"),  // run: elements of one slice row,
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpReduceScatter, "CUDA", PkReduceScatter);
