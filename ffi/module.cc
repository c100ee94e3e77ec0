// The nanobind module: the FFI targets the handler files registered (ffi_util.h PK_FFI_REGISTER),
// for one Python loop in pk_jax/_ffi.py, the op table, the communicator table and the rank
// emulator's entry points.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <nanobind/stl/string.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

#include "comm.h"
#include "comm_state.h"
#include "emu_decode.h"
#include "ffi_util.h"
#include "launch.h"
#include "op_table.h"

namespace nb = nanobind;

namespace pk_ffi {
std::vector<Registration>& Registrations() {
  static std::vector<Registration> registrations;  // filled as the module loads, in any order
  return registrations;
}
}  // namespace pk_ffi

namespace {

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
  d["link_clock"] = reinterpret_cast<uint64_t>(v->link_clock);
  d["link_ps_per_kib"] = v->link_ps_per_kib;
  d["serial"] = v->serial;
  return d;
}

// The op table (op_table.h) for Python (pk_jax/_op_table.py): {"ops": [{"id", "name",
// "family", "slot_base", "slot_count", "comm", "target", "emu", "record_id"}, ...], "dtypes":
// {name: code}, "tiles": {name: id}, "limits": {name: value}, "signal_count": slots per pad}.
nb::dict OpTable() {
  namespace t = pk_ffi::op_table;
  nb::list ops;
  for (const t::Op& o : t::kOps) {
    nb::dict d;
    d["id"] = o.id;
    d["name"] = o.name;
    d["family"] = o.family;
    d["slot_base"] = o.slots.base;
    d["slot_count"] = o.slots.count;
    d["comm"] = o.comm;
    d["target"] = o.target;
    d["emu"] = o.emu;
    d["record_id"] = o.record_id;
    ops.append(d);
  }
  nb::dict dtypes, tiles, limits;
  for (const t::DTypeEntry& e : t::kDTypes) dtypes[e.name] = static_cast<int>(e.code);
  for (const t::TileEntry& e : t::kTiles) tiles[e.name] = e.id;
  for (const t::Limit& e : t::kLimits) limits[e.name] = e.value;
  nb::dict out;
  out["ops"] = ops;
  out["dtypes"] = dtypes;
  out["tiles"] = tiles;
  out["limits"] = limits;
  out["signal_count"] = t::kSignalCount;
  return out;
}

// ---------------------------------------------------------------------------------------------
// The rank emulator's entry points (pk_jax/testing/emulator.py): the same launch functions the
// FFI handlers call, on an emulated rank's stream, SM partition and communicator.

void Raise(const pk_ffi::Status& s) {
  if (s.ok()) return;
  if (s.code == pk_ffi::Status::kInvalidArgument) throw std::invalid_argument(s.message);
  throw std::runtime_error(s.message);
}

// A launch dict of Python's for the emulator's decoder (emu_decode.h): a missing float raises
// KeyError, as indexing the dict does.
class PyDict {
 public:
  explicit PyDict(const nb::dict& d) : d_(d) {}
  bool Has(const char* key) const { return d_.contains(key); }
  int64_t Int(const char* key) const { return nb::cast<int64_t>(d_[key]); }
  double Float(const char* key) const { return nb::cast<double>(d_[key]); }

 private:
  const nb::dict& d_;
};

// Op `op`'s args decoded from a Python launch dict.
template <class A>
A Decode(int op, const nb::dict& d, bool floats_required = true) {
  return pk_ffi::emu::Decode<A>(op, PyDict(d), floats_required);
}

using pk_ffi::emu::ArgsOf;
using pk_ffi::emu::EmuOp;

// 1 for a launch function without a communicator, 2 for one with.
template <class A>
constexpr int LauncherKind(pk_ffi::Status (*)(const pk_ffi::Where&, const A&)) {
  return 1;
}
template <class A>
constexpr int LauncherKind(pk_ffi::Status (*)(const pk_ffi::Where&, const A&,
                                              const pk_ffi::CommView&)) {
  return 2;
}

// An op runs in the emulator exactly when it has a launch function (launch.h WithLauncher), and
// takes a communicator exactly when that function takes a CommView.
constexpr bool LaunchersMatchTable() {
  for (const pk_ffi::op_table::Op& op : pk_ffi::op_table::kOps) {
    const int kind = pk_ffi::WithLauncher(
        op.id, [](auto launch) { return LauncherKind(launch); }, [] { return 0; });
    if (kind != (op.emu ? (op.comm ? 2 : 1) : 0)) return false;
  }
  return true;
}
static_assert(LaunchersMatchTable(),
              "op_table.h's emu and comm flags must match launch.h WithLauncher");

// A launch without a communicator (matmul, grouped_matmul, attention).
template <class A>
void Run(pk_ffi::Status (*launch)(const pk_ffi::Where&, const A&), int op,
         const pk_ffi::Where& at, int64_t /*comm_id*/, const nb::dict& args) {
  Raise(launch(at, Decode<A>(op, args)));
}

// A launch on the communicator registered under (comm_id, the device), found before decoding.
template <class A>
void Run(pk_ffi::Status (*launch)(const pk_ffi::Where&, const A&, const pk_ffi::CommView&),
         int op, const pk_ffi::Where& at, int64_t comm_id, const nb::dict& args) {
  const pk_ffi::CommView* v = pk_ffi::FindComm(comm_id, at.device);
  if (v == nullptr) {
    throw std::invalid_argument("pk_jax emulator: no communicator " + std::to_string(comm_id) +
                                " on device " + std::to_string(at.device));
  }
  Raise(launch(at, Decode<A>(op, args), *v));
}

// Runs op `op` (an emulator op of the op table) for the communicator registered under
// (comm_id, device) on `stream`, with `num_sms` SMs; `args` holds the launcher's fields by the
// names its visitor gives them (launch.h VisitFields), buffers as device addresses.
void EmuLaunch(const std::string& op, int64_t comm_id, int device, uint64_t stream,
               int num_sms, const nb::dict& args) {
  const int id = EmuOp(op);
  const pk_ffi::Where at{reinterpret_cast<cudaStream_t>(stream), device, num_sms};
  pk_ffi::WithLauncher(
      id, [&](auto launch) { Run(launch, id, at, comm_id, args); },
      [&] { throw std::invalid_argument("pk_jax emulator: unknown op '" + op + "'"); });
}

// The symmetric workspace (bytes per rank) a call of op `op` needs at world size `world`
// (launch.h WorkspaceNeed, what its launch function checks): `args` holds the call's sizes by
// its launch field names, as for emu_launch; fields left out read 0.
uint64_t WorkspaceNeedOf(const std::string& op, const nb::dict& args, int world) {
  const int id = EmuOp(op);
  if (world < 1) throw std::invalid_argument("pk_jax: workspace_need: world must be positive");
  return pk_ffi::WithLauncher(
      id,
      [&](auto launch) {
        return pk_ffi::WorkspaceNeed(id, Decode<decltype(ArgsOf(launch))>(id, args, false),
                                     world);
      },
      [] { return uint64_t{0}; });
}

// Every name VisitFields gives, taking every branch, with its fallback (None: none).
class NameRecorder {
 public:
  explicit NameRecorder(nb::dict& out) : out_(out) {}

  bool When(bool) const { return true; }

  template <class T>
  void operator()(const char* key, T& /*field*/) const {
    Add(key, nb::none());
  }

  template <class T>
  void operator()(const char* key, T& /*field*/, int64_t fallback) const {
    Add(key, nb::int_(fallback));
  }

 private:
  void Add(const char* key, nb::object fallback) const {
    if (out_.contains(key)) throw std::logic_error(std::string("field named twice: ") + key);
    out_[key] = fallback;
  }

  nb::dict& out_;
};

// {op stem: {field name: fallback or None}} for every emulator op, fields in decoding order.
nb::dict OpFields() {
  nb::dict out;
  for (const pk_ffi::op_table::Op& o : pk_ffi::op_table::kOps) {
    nb::dict fields;
    pk_ffi::WithLauncher(
        o.id,
        [&](auto launch) {
          decltype(ArgsOf(launch)) a{};
          pk_ffi::VisitFields(NameRecorder(fields), o.id, a);
          out[o.name] = fields;
        },
        [] {});
  }
  return out;
}

void EmuDelay(uint64_t stream, uint64_t ns) {
  Raise(pk_ffi::LaunchDelay(reinterpret_cast<cudaStream_t>(stream), ns));
}

void EmuOccupy(uint64_t stream, int blocks, int smem_bytes, uint64_t ns) {
  Raise(pk_ffi::LaunchOccupy(reinterpret_cast<cudaStream_t>(stream), blocks, smem_bytes, ns));
}

void EmuMbarStall(uint64_t stream, uint64_t error_ptr, int op, int rank, uint64_t timeout_ns) {
  Raise(pk_ffi::LaunchMbarStall(reinterpret_cast<cudaStream_t>(stream),
                                reinterpret_cast<int32_t*>(error_ptr), op, rank, timeout_ns));
}

// (target, platform, handler) for every handler file's PK_FFI_REGISTER, by op id: handler is
// the execute stage's capsule, or for a communicator op the dict of its stages {"instantiate":
// ..., "execute": ...}.
nb::list RegistrationList() {
  std::vector<pk_ffi::Registration> regs = pk_ffi::Registrations();
  std::sort(regs.begin(), regs.end(), [](const auto& a, const auto& b) {
    return a.op != b.op ? a.op < b.op : std::strcmp(a.platform, b.platform) < 0;
  });
  nb::list out;
  for (const pk_ffi::Registration& r : regs) {
    const pk_ffi::op_table::Op* op = pk_ffi::op_table::Find(r.op);
    if (op == nullptr || !op->target) {
      throw std::logic_error(std::string("pk_jax: a handler registered for ") +
                             pk_ffi::op_table::Name(r.op) + ", which the op table does not "
                             "list as an FFI target");
    }
    const std::string target = std::string("pk_") + op->name;
    if (!op->comm) {
      out.append(nb::make_tuple(target, r.platform, nb::capsule(r.handler)));
      continue;
    }
    nb::dict stages;
    stages["instantiate"] = nb::capsule(reinterpret_cast<void*>(PkCommInstantiate));
    stages["execute"] = nb::capsule(r.handler);
    out.append(nb::make_tuple(target, r.platform, stages));
  }
  return out;
}

// The state type of the communicator handlers, for jax.ffi.register_ffi_type: its TypeId (XLA
// writes the id it assigns into it) and TypeInfo (the deleter XLA calls with the executable).
nb::dict CommStateType() {
  nb::dict d;
  d["type_id"] = nb::capsule(reinterpret_cast<void*>(&pk_ffi::CommState::id));
  d["type_info"] = nb::capsule(reinterpret_cast<void*>(&pk_ffi::CommState::info));
  return d;
}

// The id XLA gave the state type (0 until registered), for tests.
int64_t CommStateTypeId() { return pk_ffi::CommState::id.type_id; }

}  // namespace

NB_MODULE(_pk_ffi, m) {
  m.doc() = "pk_jax XLA FFI handlers";
  m.def("registrations", &RegistrationList,
        "List of (target_name, platform, handler capsule or dict of stage capsules) for "
        "jax.ffi.register_ffi_target.");
  m.def("op_table", &OpTable,
        "The op table (ffi/op_table.h): ops with their ids, stems, slot ranges and flags; "
        "dtype codes, tile ids, limits and the signal pad's size.");
  m.def("comm_state_type", &CommStateType,
        "{'type_id', 'type_info'} capsules of the communicator handlers' state type, for "
        "jax.ffi.register_ffi_type.");
  m.def("comm_state_type_id", &CommStateTypeId,
        "The id XLA assigned the communicator state type (0 before registration).");
  // The communicator table (ffi/comm.h), filled by pk_jax/runtime/comm.py.
  m.def("comm_register", &pk_ffi::RegisterComm, nb::arg("comm_id"), nb::arg("device_ordinal"),
        nb::arg("rank"), nb::arg("world"), nb::arg("workspace_ptrs"), nb::arg("signal_ptrs"),
        nb::arg("workspace_bytes"), nb::arg("signal_count"), nb::arg("timeout_ns"),
        nb::arg("error_ptr"), "Registers a communicator for (comm_id, device_ordinal).");
  m.def("comm_unregister", &pk_ffi::UnregisterComm, nb::arg("comm_id"),
        nb::arg("device_ordinal"), "Removes a communicator; returns whether one was registered.");
  m.def("comm_count", &pk_ffi::CommCount, "Number of registered communicators.");
  m.def("comm_table_version", &pk_ffi::CommTableVersion,
        "A counter that moves whenever a communicator is unregistered.");
  m.def("comm_set_link", &pk_ffi::SetCommLink, nb::arg("comm_id"), nb::arg("device_ordinal"),
        nb::arg("gbps"), nb::arg("clock_ptr"),
        "Rank emulator only: caps a communicator's link at gbps (0: off), clock at clock_ptr.");
  m.def("comm_info", &CommInfo, nb::arg("comm_id"), nb::arg("device_ordinal"),
        "The registered view of (comm_id, device_ordinal) as a dict, or None.");
  // The rank emulator (pk_jax/testing).
  m.def("emu_launch", &EmuLaunch, nb::arg("op"), nb::arg("comm_id"), nb::arg("device"),
        nb::arg("stream"), nb::arg("num_sms"), nb::arg("args"),
        "Runs an op's launch function (the one its FFI handler calls) on a stream.");
  m.def("workspace_need", &WorkspaceNeedOf, nb::arg("op"), nb::arg("args"), nb::arg("world"),
        "Bytes of symmetric workspace per rank a call of `op` needs at `world` ranks, from its "
        "launch fields by name (ffi/launch.h WorkspaceNeed, the launch function's own check).");
  m.def("op_fields", &OpFields,
        "{op: {field: fallback or None}}: each emulator op's launch fields (ffi/launch.h "
        "VisitFields), in order.");
  m.def("emu_delay", &EmuDelay, nb::arg("stream"), nb::arg("ns"),
        "Queues a kernel that spins for ns nanoseconds.");
  m.def("emu_occupy", &EmuOccupy, nb::arg("stream"), nb::arg("blocks"), nb::arg("smem_bytes"),
        nb::arg("ns"), "Queues blocks that each hold smem_bytes of shared memory for ns.");
  m.def("emu_mbar_stall", &EmuMbarStall, nb::arg("stream"), nb::arg("error_ptr"),
        nb::arg("op"), nb::arg("rank"), nb::arg("timeout_ns"),
        "Queues a block whose mbarrier never completes (tests the bounded mbarrier wait).");

}
