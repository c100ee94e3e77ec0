// The nanobind module: one registration table for every FFI target, registered by one Python
// loop in pk_jax/_ffi.py.
#include <nanobind/nanobind.h>

#include <tuple>

#include "ffi_util.h"

namespace nb = nanobind;

namespace {

struct Registration {
  const char* target;    // FFI target name, pk_<stem>
  const char* platform;  // "CUDA" or "cpu"
  void* handler;         // XLA_FFI_Handler*
};

// One line per (target, platform).
const Registration kRegistrations[] = {
    {"pk_ping", "CUDA", reinterpret_cast<void*>(PkPing)},
    {"pk_ping", "cpu", reinterpret_cast<void*>(PkPingCpu)},
};

nb::list Registrations() {
  nb::list out;
  for (const Registration& r : kRegistrations) {
    out.append(nb::make_tuple(r.target, r.platform, nb::capsule(r.handler)));
  }
  return out;
}

}  // namespace

NB_MODULE(_pk_ffi, m) {
  m.doc() = "pk_jax XLA FFI handlers";
  m.def("registrations", &Registrations,
        "List of (target_name, platform, handler capsule) for jax.ffi.register_ffi_target.");
}
