// The nanobind module: one registration table for every FFI target, registered by one Python
// loop in pk_jax/_ffi.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <nanobind/stl/string.h>

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "comm.h"
#include "comm_state.h"
#include "ffi_util.h"
#include "launch.h"
#include "op_table.h"

namespace nb = nanobind;

// ffi/moe.cu's fused MoE handlers (declared here; ffi_util.h declares the other ops' handlers).
XLA_FFI_DECLARE_HANDLER_SYMBOL(PkMoeDispatchGemm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PkMoeGemmCombine);

namespace {

struct Registration {
  const char* target;    // FFI target name, pk_<stem>
  const char* platform;  // "CUDA" or "cpu"
  void* handler;         // XLA_FFI_Handler* (the execute stage)
  bool comm = false;     // takes its communicator from a CommState (comm_state.h), made by
                         // the shared instantiate stage PkCommInstantiate
};

// One line per (target, platform).
const Registration kRegistrations[] = {
    {"pk_ping", "CUDA", reinterpret_cast<void*>(PkPing)},
    {"pk_ping", "cpu", reinterpret_cast<void*>(PkPingCpu)},
    {"pk_all_reduce", "CUDA", reinterpret_cast<void*>(PkAllReduce), true},
    {"pk_all_gather", "CUDA", reinterpret_cast<void*>(PkAllGather), true},
    {"pk_reduce_scatter", "CUDA", reinterpret_cast<void*>(PkReduceScatter), true},
    {"pk_all_to_all", "CUDA", reinterpret_cast<void*>(PkAllToAll), true},
    {"pk_matmul", "CUDA", reinterpret_cast<void*>(PkMatmul)},
    {"pk_gemm_rs", "CUDA", reinterpret_cast<void*>(PkGemmRs), true},
    {"pk_ag_gemm", "CUDA", reinterpret_cast<void*>(PkAgGemm), true},
    {"pk_gemm_ar", "CUDA", reinterpret_cast<void*>(PkGemmAr), true},
    {"pk_grouped_matmul", "CUDA", reinterpret_cast<void*>(PkGroupedMatmul)},
    {"pk_attention", "CUDA", reinterpret_cast<void*>(PkAttention)},
    {"pk_moe_dispatch", "CUDA", reinterpret_cast<void*>(PkMoeDispatch), true},
    {"pk_moe_scatter", "CUDA", reinterpret_cast<void*>(PkMoeScatter), true},
    {"pk_moe_combine", "CUDA", reinterpret_cast<void*>(PkMoeCombine), true},
    {"pk_ring_attn", "CUDA", reinterpret_cast<void*>(PkRingAttn), true},
    {"pk_moe_dispatch_gemm", "CUDA", reinterpret_cast<void*>(PkMoeDispatchGemm), true},
    {"pk_moe_gemm_combine", "CUDA", reinterpret_cast<void*>(PkMoeGemmCombine), true},
    {"pk_ulysses_attn", "CUDA", reinterpret_cast<void*>(PkUlyssesAttn), true},
    {"pk_ring_attn_bwd", "CUDA", reinterpret_cast<void*>(PkRingAttnBwd), true},
    {"pk_ulysses_attn_bwd", "CUDA", reinterpret_cast<void*>(PkUlyssesAttnBwd), true},
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

int64_t Get(const nb::dict& d, const char* key, int64_t fallback = 0) {
  return d.contains(key) ? nb::cast<int64_t>(d[key]) : fallback;
}

template <class T>
T* Ptr(const nb::dict& d, const char* key) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(Get(d, key)));
}

// The fields the attention launchers' arguments share (AttnArgs, RingAttnArgs,
// UlyssesAttnArgs, AttnBwdArgs): q, k, v, the shape, the scale and the causal flag.
template <class A>
void AttentionFields(const nb::dict& d, A* a) {
  a->q = Ptr<const void>(d, "q");
  a->k = Ptr<const void>(d, "k");
  a->v = Ptr<const void>(d, "v");
  a->b = Get(d, "b");
  a->s = Get(d, "s");
  a->h = Get(d, "h");
  a->hkv = Get(d, "hkv");
  a->d = Get(d, "d");
  a->scale = static_cast<float>(nb::cast<double>(d["scale"]));
  a->causal = Get(d, "causal") != 0;
}

// The fields of the fused attention backwards' arguments (AttnBwdArgs): AttentionFields', dO,
// lse, delta, the gradients, the rank operand and the communication blocks.
void BackwardFields(const nb::dict& d, pk_ffi::AttnBwdArgs* a) {
  AttentionFields(d, a);
  a->d_o = Ptr<const void>(d, "do");
  a->lse = Ptr<const float>(d, "lse");
  a->delta = Ptr<const float>(d, "delta");
  a->dq = Ptr<void>(d, "dq");
  a->dk = Ptr<void>(d, "dk");
  a->dv = Ptr<void>(d, "dv");
  a->rank = Ptr<const int32_t>(d, "rank");
  a->num_comm_sms = Get(d, "num_comm_sms", 2);
}

// Runs op `op` ("all_reduce", ..., "ulysses_attn"; "matmul", "attention" and "grouped_matmul"
// without a communicator) for the communicator registered under (comm_id, device) on
// `stream`, with `num_sms` SMs; `args` holds the launcher's fields (ffi/launch.h) by name,
// buffers as device addresses.
void EmuLaunch(const std::string& op, int64_t comm_id, int device, uint64_t stream,
               int num_sms, const nb::dict& args) {
  const pk_ffi::op_table::Op* entry = pk_ffi::op_table::Find(op.c_str());
  if (entry == nullptr || !entry->emu) {
    throw std::invalid_argument("pk_jax emulator: unknown op '" + op + "'");
  }
  const pk_ffi::Where at{reinterpret_cast<cudaStream_t>(stream), device, num_sms};
  auto gemm_args = [&]() {
    return pk_ffi::GemmArgs{static_cast<pk_ffi::DType>(Get(args, "dtype")),
                            Ptr<const void>(args, "x"),
                            Ptr<const void>(args, "w"),
                            Ptr<void>(args, "y"),
                            Ptr<void>(args, "x_full"),
                            Ptr<const int32_t>(args, "rank"),
                            Get(args, "m"),
                            Get(args, "k"),
                            Get(args, "n"),
                            Get(args, "y_rows"),
                            Get(args, "y_cols"),
                            Get(args, "config", 1),
                            Get(args, "group_m", 8),
                            Get(args, "num_comm_sms")};
  };
  if (op == "matmul") {  // local: no communicator (the serial path's GEMM)
    Raise(pk_ffi::LaunchMatmul(at, gemm_args()));
    return;
  }
  if (op == "attention") {  // local, no communicator (the unfused ring's per-block step)
    pk_ffi::AttnArgs a{};
    a.dtype = static_cast<pk_ffi::DType>(Get(args, "dtype"));
    AttentionFields(args, &a);
    a.o = Ptr<void>(args, "o");
    a.lse = Ptr<float>(args, "lse");
    a.backward = Get(args, "backward", 0) != 0;  // the unfused ring backward's per-block step
    if (a.backward) {
      a.d_o = Ptr<const void>(args, "do");
      a.lse_in = Ptr<const float>(args, "lse_in");
      a.delta = Ptr<const float>(args, "delta");
      a.dq = Ptr<void>(args, "dq");
      a.dk = Ptr<void>(args, "dk");
      a.dv = Ptr<void>(args, "dv");
      a.dq_acc = Ptr<float>(args, "dq_acc");  // float32 scratch of q's shape
      a.sp = Get(args, "sp");
    }
    Raise(pk_ffi::LaunchAttention(at, a));
    return;
  }
  if (op == "grouped_matmul") {  // local: the serial MoE path's expert GEMM (FWD)
    const pk_ffi::GroupedMatmulArgs a{static_cast<pk_ffi::DType>(Get(args, "dtype")),
                                      Ptr<const void>(args, "x"),
                                      Ptr<const void>(args, "w"),
                                      Ptr<const int32_t>(args, "group_sizes"),
                                      Ptr<void>(args, "y"),
                                      Get(args, "m"),
                                      Get(args, "k"),
                                      Get(args, "n"),
                                      Get(args, "groups"),
                                      Get(args, "group_m", 8)};
    Raise(pk_ffi::LaunchGroupedMatmul(at, a));
    return;
  }
  const pk_ffi::CommView* v = pk_ffi::FindComm(comm_id, device);
  if (v == nullptr) {
    throw std::invalid_argument("pk_jax emulator: no communicator " + std::to_string(comm_id) +
                                " on device " + std::to_string(device));
  }
  const auto dtype = static_cast<pk_ffi::DType>(Get(args, "dtype"));
  using Coll = pk_ffi::Status (*)(const pk_ffi::Where&, const pk_ffi::CollArgs&,
                                  const pk_ffi::CommView&);
  using Gemm = pk_ffi::Status (*)(const pk_ffi::Where&, const pk_ffi::GemmArgs&,
                                  const pk_ffi::CommView&);
  Coll coll = op == "all_reduce"       ? pk_ffi::LaunchAllReduce
              : op == "all_gather"     ? pk_ffi::LaunchAllGather
              : op == "reduce_scatter" ? pk_ffi::LaunchReduceScatter
              : op == "all_to_all"     ? pk_ffi::LaunchAllToAll
                                       : nullptr;
  Gemm gemm = op == "gemm_rs"   ? pk_ffi::LaunchGemmRs
              : op == "gemm_ar" ? pk_ffi::LaunchGemmAr
              : op == "ag_gemm" ? pk_ffi::LaunchAgGemm
                                : nullptr;
  if (coll != nullptr) {
    const pk_ffi::CollArgs a{dtype,
                             Ptr<const void>(args, "x"),
                             Ptr<void>(args, "y"),
                             Ptr<const int32_t>(args, "rank"),
                             Get(args, "n"),
                             Get(args, "n_out"),
                             Get(args, "p0"),
                             Get(args, "p1")};
    Raise(coll(at, a, *v));
    return;
  }
  if (gemm != nullptr) {
    Raise(gemm(at, gemm_args(), *v));
    return;
  }
  if (op == "moe_dispatch" || op == "moe_scatter") {
    pk_ffi::MoeDispatchArgs a{dtype,
                              Ptr<const void>(args, "x"),
                              Ptr<const int32_t>(args, "ids"),
                              Ptr<const int32_t>(args, "rank"),
                              Ptr<int32_t>(args, "dest"),
                              Ptr<int32_t>(args, "pos"),
                              Ptr<int32_t>(args, "dropped"),
                              Ptr<int32_t>(args, "recv_dropped"),
                              Ptr<int32_t>(args, "group_sizes"),
                              Ptr<void>(args, "tokens"),
                              Get(args, "t"),
                              Get(args, "k"),
                              Get(args, "h"),
                              Get(args, "num_experts"),
                              Get(args, "capacity"),
                              op == "moe_scatter" ? 1 : 0};
    Raise(pk_ffi::LaunchMoeDispatch(at, a, *v));
    return;
  }
  if (op == "moe_dispatch_gemm") {  // the fused dispatch + first expert GEMM
    const pk_ffi::MoeDispatchGemmArgs a{dtype,
                                        Ptr<const void>(args, "x"),
                                        Ptr<const int32_t>(args, "ids"),
                                        Ptr<const void>(args, "w"),
                                        Ptr<const int32_t>(args, "rank"),
                                        Ptr<int32_t>(args, "dest"),
                                        Ptr<int32_t>(args, "pos"),
                                        Ptr<int32_t>(args, "dropped"),
                                        Ptr<int32_t>(args, "recv_dropped"),
                                        Ptr<int32_t>(args, "group_sizes"),
                                        Ptr<void>(args, "y"),
                                        Ptr<int32_t>(args, "order"),
                                        Ptr<int32_t>(args, "order_off"),
                                        Get(args, "t"),
                                        Get(args, "k"),
                                        Get(args, "h"),
                                        Get(args, "n"),
                                        Get(args, "num_experts"),
                                        Get(args, "capacity"),
                                        Get(args, "num_comm_sms")};
    Raise(pk_ffi::LaunchMoeDispatchGemm(at, a, *v));
    return;
  }
  if (op == "moe_gemm_combine") {  // the fused second expert GEMM + combine
    const pk_ffi::MoeGemmCombineArgs a{dtype,
                                       Ptr<const void>(args, "h"),
                                       Ptr<const void>(args, "w"),
                                       Ptr<const float>(args, "weights"),
                                       Ptr<const int32_t>(args, "dest"),
                                       Ptr<const int32_t>(args, "pos"),
                                       Ptr<const int32_t>(args, "group_sizes"),
                                       Ptr<const int32_t>(args, "rank"),
                                       Ptr<void>(args, "out"),
                                       Get(args, "t"),
                                       Get(args, "k"),
                                       Get(args, "f"),
                                       Get(args, "n"),
                                       Get(args, "groups"),
                                       Get(args, "capacity")};
    Raise(pk_ffi::LaunchMoeGemmCombine(at, a, *v));
    return;
  }
  if (op == "moe_combine" || op == "moe_gather") {
    const pk_ffi::MoeCombineArgs a{dtype,
                                   Ptr<const void>(args, "y"),
                                   Ptr<const float>(args, "weights"),
                                   Ptr<const int32_t>(args, "dest"),
                                   Ptr<const int32_t>(args, "pos"),
                                   Ptr<const int32_t>(args, "rank"),
                                   Ptr<void>(args, "out"),
                                   Get(args, "t"),
                                   Get(args, "k"),
                                   Get(args, "h"),
                                   Get(args, "capacity"),
                                   op == "moe_gather" ? 1 : 0};
    Raise(pk_ffi::LaunchMoeCombine(at, a, *v));
    return;
  }
  if (op == "ring_attn") {
    pk_ffi::RingAttnArgs a{};
    a.dtype = dtype;
    AttentionFields(args, &a);
    a.o = Ptr<void>(args, "o");
    a.lse = Ptr<float>(args, "lse");
    a.rank = Ptr<const int32_t>(args, "rank");
    a.zigzag = Get(args, "zigzag") != 0;
    a.num_comm_sms = Get(args, "num_comm_sms", 2);
    Raise(pk_ffi::LaunchRingAttn(at, a, *v));
    return;
  }
  if (op == "ulysses_attn") {
    pk_ffi::UlyssesAttnArgs a{};
    a.dtype = dtype;
    AttentionFields(args, &a);
    a.o = Ptr<void>(args, "o");
    a.lse = Ptr<float>(args, "lse");
    a.rank = Ptr<const int32_t>(args, "rank");
    a.num_comm_sms = Get(args, "num_comm_sms", 2);
    Raise(pk_ffi::LaunchUlyssesAttn(at, a, *v));
    return;
  }
  if (op == "ulysses_attn_bwd") {
    pk_ffi::UlyssesAttnBwdArgs a{};
    a.dtype = dtype;
    BackwardFields(args, &a);
    Raise(pk_ffi::LaunchUlyssesAttnBwd(at, a, *v));
    return;
  }
  if (op == "ring_attn_bwd") {
    pk_ffi::RingAttnBwdArgs a{};
    a.dtype = dtype;
    BackwardFields(args, &a);
    a.zigzag = Get(args, "zigzag") != 0;
    Raise(pk_ffi::LaunchRingAttnBwd(at, a, *v));
    return;
  }
  throw std::invalid_argument("pk_jax emulator: unknown op '" + op + "'");
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

// (target, platform, handler): handler is the execute stage's capsule, or for a communicator
// handler the dict of its stages {"instantiate": ..., "execute": ...}.
nb::list Registrations() {
  nb::list out;
  for (const Registration& r : kRegistrations) {
    if (!r.comm) {
      out.append(nb::make_tuple(r.target, r.platform, nb::capsule(r.handler)));
      continue;
    }
    nb::dict stages;
    stages["instantiate"] = nb::capsule(reinterpret_cast<void*>(PkCommInstantiate));
    stages["execute"] = nb::capsule(r.handler);
    out.append(nb::make_tuple(r.target, r.platform, stages));
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
  m.def("registrations", &Registrations,
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
  m.def("emu_delay", &EmuDelay, nb::arg("stream"), nb::arg("ns"),
        "Queues a kernel that spins for ns nanoseconds.");
  m.def("emu_occupy", &EmuOccupy, nb::arg("stream"), nb::arg("blocks"), nb::arg("smem_bytes"),
        nb::arg("ns"), "Queues blocks that each hold smem_bytes of shared memory for ns.");
  m.def("emu_mbar_stall", &EmuMbarStall, nb::arg("stream"), nb::arg("error_ptr"),
        nb::arg("op"), nb::arg("rank"), nb::arg("timeout_ns"),
        "Queues a block whose mbarrier never completes (tests the bounded mbarrier wait).");

}
