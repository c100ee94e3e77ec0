// Host code shared by every launcher and handler (see launch.h): CUDA statuses, the error
// record check, and the body of the collective handlers.
#include <string>

#include "comm_state.h"
#include "ffi_util.h"
#include "launch.h"
#include "tensor_map.h"

namespace pk_ffi {

Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string("pk_jax CUDA error: ") + cudaGetErrorString(err) +
                          " in " + what);
}

Status CheckRecord(const char* op, const CommView& v) {
  // NOTES: the record is pinned host memory mapped with DEVICEMAP; under UVA (every 64-bit
  // Linux CUDA process) the device address the view holds is also its host address.
  const volatile int32_t* rec = v.error;
  if (rec == nullptr || rec[comm_error::kCode] == comm_error::kNone) return Status::Ok();
  const int code = rec[comm_error::kCode];
  std::string what = code == comm_error::kTimeout        ? "timed out"
                     : code == comm_error::kMbarTimeout  ? "had a copy that never completed"
                     : code == comm_error::kRankMismatch ? "got a rank operand that does not "
                                                           "match its communicator"
                                                         : "failed";
  return Status::Invalid(
      std::string("pk.") + op + ": refused, an earlier call failed: " +
      op_table::Name(rec[comm_error::kOp]) + " " + what + " on rank " +
      std::to_string(rec[comm_error::kRank]) + " (missing peer " +
      std::to_string(rec[comm_error::kPeer]) +
      "). The CUDA context may be unusable after that kernel's trap: restart the job (or "
      "pk.shutdown() and pk.init() once every process is back).");
}

ffi::Error RunCollective(const char* op, int op_id,
                         Status (*launch)(const Where&, const CollArgs&, const CommView&),
                         cudaStream_t stream, int32_t device, CommState* state,
                         const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& rank,
                         ffi::AnyBuffer y, int64_t p0, int64_t p1) {
  const CommView* v = nullptr;
  int num_sms = 0;
  if (ffi::Error e = BindComm(op, state, device, &v, &num_sms); e.failure()) return e;
  CollArgs a{};
  MarkFields(op_id, &a);
  if (!ToDType(x.element_type(), &a.dtype) || y.element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op +
                                       ": x and y must have one dtype of bf16, fp16, fp32 or "
                                       "int32");
  }
  a.x = x.untyped_data();
  a.y = y.untyped_data();
  a.rank = rank.typed_data();
  a.n = static_cast<int64_t>(x.element_count());
  a.n_out = static_cast<int64_t>(y.element_count());
  a.p0 = p0;
  a.p1 = p1;
  if (ffi::Error e = CheckFilled(op_id, a); e.failure()) return e;
  return ToError(launch(Where{stream, device, num_sms}, a, *v));
}

}  // namespace pk_ffi
