// FFI handler and launcher of pk_all_reduce: y = sum over the communicator's ranks of x (see
// cuda/kernels/all_reduce.cuh). Launches on XLA's stream; no host synchronisation.
#include "collective.h"
#include "comm_state.h"
#include "ffi_util.h"
#include "kernels/all_reduce.cuh"

namespace pk_ffi {

Status LaunchAllReduce(const Where& at, const CollArgs& a, const CommView& v) {
  pk::coll::globals g;
  if (Status s = CollectiveGlobals("all_reduce", kOpAllReduce, a, v, &g); !s.ok()) return s;
  if (a.dtype == DType::kS32 || a.n_out != a.n) {
    return Status::Invalid("pk.all_reduce: x and y must match, in bf16, fp16 or fp32");
  }
  pk::coll::launch_status st;
  const int algo = static_cast<int>(a.p0);
  switch (a.dtype) {
    case DType::kBF16:
      st = pk::all_reduce::launch<__nv_bfloat16>(g, algo, v.workspace_bytes, at.stream, at.device);
      break;
    case DType::kF16:
      st = pk::all_reduce::launch<__half>(g, algo, v.workspace_bytes, at.stream, at.device);
      break;
    default:
      st = pk::all_reduce::launch<float>(g, algo, v.workspace_bytes, at.stream, at.device);
      break;
  }
  return CollectiveStatus("all_reduce", st, v.workspace_bytes);
}

namespace {

ffi::Error AllReduceCuda(cudaStream_t stream, int32_t device, CommState* state, ffi::AnyBuffer x,
                         ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> y,
                         int64_t /*comm_id*/, int64_t algo) {
  return RunCollective("all_reduce", kOpAllReduce, LaunchAllReduce, stream, device, state, x,
                       rank, *y, algo, 0);
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAllReduce, pk_ffi::AllReduceCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()                     // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                     // y
                                  .Attr<int64_t>("comm_id")                       // comm_id
                                  .Attr<int64_t>("algo"),  // algo: 0 auto, 1 one-shot, 2 two-shot,
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpAllReduce, "CUDA", PkAllReduce);
