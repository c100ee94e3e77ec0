// Shared helpers for the FFI handlers: the CUDA error macro and the handlers' registration.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "comm.h"
#include "launch.h"
#include "xla/ffi/api/ffi.h"

namespace pk_ffi {

namespace ffi = xla::ffi;

// A launch function's Status as the handler's ffi::Error.
inline ffi::Error ToError(const Status& s) {
  switch (s.code) {
    case Status::kOk:
      return ffi::Error::Success();
    case Status::kInvalidArgument:
      return ffi::Error::InvalidArgument(s.message);
    default:
      return ffi::Error::Internal(s.message);
  }
}

// The launchers' element type of an XLA buffer; false for types no launcher takes.
inline bool ToDType(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::S32: *out = DType::kS32; return true;
    default: return false;
  }
}

// Whether a launcher's element type is an fp8 format.
inline bool IsFp8(DType t) { return t == DType::kE4M3 || t == DType::kE5M2; }

// The launchers' code of an fp8 XLA buffer; false for any other type.
inline bool ToFp8(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F8E4M3FN: *out = DType::kE4M3; return true;
    case ffi::DataType::F8E5M2: *out = DType::kE5M2; return true;
    default: return false;
  }
}

struct CommState;  // comm_state.h: the executable's communicator, bound at instantiation

// The body of the four collective handlers: binds XLA's x, rank and y into CollArgs (p0, p1:
// the op's parameters, see launch.h), takes the communicator from the executable's state, and
// calls `launch`. op: the stem, op_id: its id (the fields it fills).
ffi::Error RunCollective(const char* op, int op_id,
                         Status (*launch)(const Where&, const CollArgs&, const CommView&),
                         cudaStream_t stream, int32_t device, CommState* state,
                         const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& rank,
                         ffi::AnyBuffer y, int64_t p0, int64_t p1);

// The FFI side of the field visitor (launch.h VisitFields). A handler marks the fields its op
// names, fills its args from XLA's buffers and attributes, and checks that it wrote every marked
// one before it launches: a field added to an args struct and its visitor (and so to the rank
// emulator's decoder) cannot reach a launch function unfilled from XLA. Marked are the fields
// with no fallback, other than flags (a bool has no spare value to mark); the marks are values
// no buffer, shape or sane attribute takes (an odd, non-canonical address; INT64_MIN; a
// signalling NaN's bits; DType -1). A handler whose op's fields depend on a flag (attention's
// backward) sets the flag first.
namespace filled {

inline constexpr uintptr_t kPointer = 0xDEAD000000000001u;
inline constexpr int64_t kInteger = INT64_MIN;
inline constexpr uint32_t kFloatBits = 0x7FA0D0EDu;
inline constexpr int32_t kDType = -1;

// Marks (Marker) or finds the first still marked (Finder) of the fields with no fallback.
struct Marker {
  bool When(bool cond) const { return cond; }
  template <class T>
  void operator()(const char*, T& field) const {
    if constexpr (std::is_pointer_v<T>) {
      field = reinterpret_cast<T>(kPointer);
    } else if constexpr (std::is_same_v<T, int64_t>) {
      field = kInteger;
    } else if constexpr (std::is_same_v<T, float>) {
      std::memcpy(&field, &kFloatBits, sizeof(field));
    } else if constexpr (std::is_same_v<T, DType>) {
      field = static_cast<DType>(kDType);
    } else {
      static_assert(std::is_same_v<T, bool>, "a field type the marks do not cover");
    }
  }
  template <class T>
  void operator()(const char*, T&, int64_t /*fallback*/) const {}
};

struct Finder {
  const char** first;  // the first marked field's name; stays nullptr when none is
  bool When(bool cond) const { return cond; }
  template <class T>
  void operator()(const char* name, const T& field) const {
    if (*first != nullptr) return;
    bool marked = false;
    if constexpr (std::is_pointer_v<T>) {
      marked = reinterpret_cast<uintptr_t>(field) == kPointer;
    } else if constexpr (std::is_same_v<T, int64_t>) {
      marked = field == kInteger;
    } else if constexpr (std::is_same_v<T, float>) {
      uint32_t bits;
      std::memcpy(&bits, &field, sizeof(bits));
      marked = bits == kFloatBits;
    } else if constexpr (std::is_same_v<T, DType>) {
      marked = static_cast<int32_t>(field) == kDType;
    }
    if (marked) *first = name;
  }
  template <class T>
  void operator()(const char*, const T&, int64_t /*fallback*/) const {}
};

}  // namespace filled

// The check is two visits of the args on the host in every call, and what it checks is the
// handlers' own code, the same in every call: release builds (NDEBUG: the wheels) leave it out,
// development builds (the GPU suite's, tests/cpp/fields.cc) run it.
#ifdef NDEBUG
template <class Args>
void MarkFields(int, Args*) {}
template <class Args>
ffi::Error CheckFilled(int, Args&) {
  return ffi::Error::Success();
}
#else
// Marks the fields op `op` (op_table.h OpId) must fill in `a`.
template <class Args>
void MarkFields(int op, Args* a) {
  VisitFields(filled::Marker{}, op, *a);
}

// Internal error naming the first field of `a` that op `op`'s handler left marked.
template <class Args>
ffi::Error CheckFilled(int op, Args& a) {
  const char* first = nullptr;
  VisitFields(filled::Finder{&first}, op, a);
  if (first == nullptr) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("pk_jax: the ") + op_table::Name(op) +
                              " handler did not fill its argument '" + first +
                              "' (ffi/launch.h VisitFields)");
}
#endif  // NDEBUG

// NOTES: every CUDA call in a handler goes through PK_CUDA_CHECK so that a failure becomes an
// ffi::Error (a Python exception naming the call) instead of a crash or a silent wrong answer.
inline ffi::Error CudaError(cudaError_t err, const char* expr, const char* file, int line) {
  return ffi::Error::Internal(std::string("pk_jax CUDA error: ") + cudaGetErrorString(err) +
                              " in " + expr + " at " + file + ":" + std::to_string(line));
}

// The q, k, v operands of the attention handlers (attention, ring, Ulysses, forward and
// backward): one 2-byte dtype, q [B, S, H, D] (S local for the sequence-parallel ops), k and v
// [B, S, Hkv, D]. Fills a's dtype, b, s, h, d, hkv, q, k and v; false when they do not fit, for
// the handler's own error message.
template <class A>
bool BindQkv(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, A* a) {
  const ffi::DataType dt = q.element_type();
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (!ToDType(dt, &a->dtype) || k.element_type() != dt || v.element_type() != dt ||
      qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || kd[0] != qd[0] ||
      kd[1] != qd[1] || kd[3] != qd[3] || vd[0] != kd[0] || vd[1] != kd[1] ||
      vd[2] != kd[2] || vd[3] != kd[3]) {
    return false;
  }
  a->b = qd[0];
  a->s = qd[1];
  a->h = qd[2];
  a->d = qd[3];
  a->hkv = kd[2];
  a->q = q.untyped_data();
  a->k = k.untyped_data();
  a->v = v.untyped_data();
  return true;
}

}  // namespace pk_ffi

#define PK_CUDA_CHECK(expr)                                                   \
  do {                                                                        \
    cudaError_t pk_err_ = (expr);                                             \
    if (pk_err_ != cudaSuccess) {                                             \
      return ::pk_ffi::CudaError(pk_err_, #expr, __FILE__, __LINE__);         \
    }                                                                         \
  } while (0)

// Checks the launch that was just issued on the current thread.
#define PK_CUDA_CHECK_LAUNCH() PK_CUDA_CHECK(cudaGetLastError())

// Traits of the CUDA handlers without a communicator: they only enqueue work on XLA's stream (no
// host synchronisation), so XLA may record them into a command buffer (CUDA graph) and replay
// them. The communicator handlers are not (comm_state.h PK_FFI_COMM_TRAITS).
#define PK_FFI_CUDA_TRAITS {xla::ffi::Traits::kCmdBufferCompatible}

// Every communicator handler's instantiate stage (comm_state.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(PkCommInstantiate);

// FFI targets register themselves: the file that defines a handler names its op right after it
// (PK_FFI_REGISTER), and module.cc's registrations() hands the list to Python, which registers
// each with jax.ffi. The target's name (pk_<stem>) and whether it takes a communicator (and so
// the shared instantiate stage) come from the op's row in the op table.
namespace pk_ffi {
struct Registration {
  int op;                // op_table.h OpId
  const char* platform;  // "CUDA" or "cpu"
  void* handler;         // XLA_FFI_Handler* (the execute stage)
};
// The registrations of every linked handler file (defined in module.cc).
std::vector<Registration>& Registrations();
inline bool Register(int op, const char* platform, void* handler) {
  Registrations().push_back({op, platform, handler});
  return true;
}
}  // namespace pk_ffi
#define PK_FFI_REGISTER(op, platform, handler)                   \
  [[maybe_unused]] static const bool pk_ffi_registered_##handler = \
      ::pk_ffi::Register(op, platform, reinterpret_cast<void*>(handler))
