// The nanobind module: one registration table for every FFI target, registered by one Python
// loop in pk_jax/_ffi.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <tuple>

#include "comm.h"
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
    {"pk_all_reduce", "CUDA", reinterpret_cast<void*>(PkAllReduce)},
    {"pk_all_gather", "CUDA", reinterpret_cast<void*>(PkAllGather)},
    {"pk_reduce_scatter", "CUDA", reinterpret_cast<void*>(PkReduceScatter)},
    {"pk_all_to_all", "CUDA", reinterpret_cast<void*>(PkAllToAll)},
    {"pk_matmul", "CUDA", reinterpret_cast<void*>(PkMatmul)},
    {"pk_gemm_rs", "CUDA", reinterpret_cast<void*>(PkGemmRs)},
    {"pk_ag_gemm", "CUDA", reinterpret_cast<void*>(PkAgGemm)},
    {"pk_gemm_ar", "CUDA", reinterpret_cast<void*>(PkGemmAr)},
    {"pk_grouped_matmul", "CUDA", reinterpret_cast<void*>(PkGroupedMatmul)},
};

// The communicator table's view of one key, for tests; None when nothing is registered.
nb::object CommInfo(int64_t comm_id, int device_ordinal) {
  const pk_ffi::CommView* v = pk_ffi::FindComm(comm_id, device_ordinal);
  if (v == nullptr) return nb::none();
  nb::list ws, sig;
  for (int p = 0; p < v->world; ++p) {
    ws.append(reinterpret_cast<uint64_t>(v->workspace[p]));
    sig.append(reinterpret_cast<uint64_t>(v->signals[p]));
  }
  nb::dict d;
  d["rank"] = v->rank;
  d["world"] = v->world;
  d["timeout_ns"] = v->timeout_ns;
  d["workspace_ptrs"] = ws;
  d["signal_ptrs"] = sig;
  d["workspace_bytes"] = v->workspace_bytes;
  d["signal_count"] = v->signal_count;
  d["error_ptr"] = reinterpret_cast<uint64_t>(v->error);
  return d;
}

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
  // The communicator table (ffi/comm.h), filled by pk_jax/runtime/comm.py.
  m.def("comm_register", &pk_ffi::RegisterComm, nb::arg("comm_id"), nb::arg("device_ordinal"),
        nb::arg("rank"), nb::arg("world"), nb::arg("workspace_ptrs"), nb::arg("signal_ptrs"),
        nb::arg("workspace_bytes"), nb::arg("signal_count"), nb::arg("timeout_ns"),
        nb::arg("error_ptr"), "Registers a communicator for (comm_id, device_ordinal).");
  m.def("comm_unregister", &pk_ffi::UnregisterComm, nb::arg("comm_id"),
        nb::arg("device_ordinal"), "Removes a communicator; returns whether one was registered.");
  m.def("comm_count", &pk_ffi::CommCount, "Number of registered communicators.");
  m.def("comm_info", &CommInfo, nb::arg("comm_id"), nb::arg("device_ordinal"),
        "The registered view of (comm_id, device_ordinal) as a dict, or None.");
}
