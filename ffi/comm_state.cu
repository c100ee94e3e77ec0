// The per-executable communicator state (see comm_state.h) and the instantiate stage every
// communicator handler shares (PkCommInstantiate; module.cc pairs it with each execute stage).
#include "comm_state.h"

#include <string>
#include <utility>
#include <vector>

namespace pk_ffi {
namespace {

// This thread's open CommCall scopes, and the registrations BindComm holds for them.
thread_local int t_calls = 0;
thread_local std::vector<CommEntry*> t_holds;

}  // namespace

CommCall::CommCall(CommState* state) : state_(state), mark_(t_holds.size()), open_(true) {
  ++t_calls;
}

CommCall::CommCall(CommCall&& other) noexcept
    : state_(other.state_), mark_(other.mark_), open_(other.open_) {
  other.open_ = false;
}

CommCall::~CommCall() {
  if (!open_) return;
  for (size_t i = mark_; i < t_holds.size(); ++i) ReleaseComm(t_holds[i]);
  t_holds.resize(mark_);
  --t_calls;
}

ffi::TypeId CommState::id = {};
ffi::TypeInfo CommState::info = ffi::MakeTypeInfo<CommState>();

ffi::ErrorOr<std::unique_ptr<CommState>> CommState::Create(ffi::Dictionary attrs) {
  ffi::ErrorOr<int64_t> comm_id = attrs.get<int64_t>("comm_id");
  if (!comm_id.has_value()) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "pk_jax: a communicator handler was instantiated without its comm_id attribute"));
  }
  auto state = std::make_unique<CommState>();
  state->comm_id = *comm_id;
  for (CommMember& c : CommMembers(state->comm_id)) {
    Member& m = state->members[c.device];
    m.view = c.view;
    m.entry = std::move(c.entry);
    if (cudaDeviceGetAttribute(&m.num_sms, cudaDevAttrMultiProcessorCount, c.device) !=
        cudaSuccess) {
      return ffi::Unexpected(ffi::Error::Internal(
          "pk_jax: cudaDeviceGetAttribute(MultiProcessorCount) failed for device " +
          std::to_string(c.device)));
    }
  }
  if (state->members.empty()) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "pk_jax: this function uses communicator " + std::to_string(state->comm_id) +
        ", which this process does not have (pk.shutdown() was called after it was traced?). "
        "Call pk.init(mesh) before compiling it, and jit it again after pk.shutdown()."));
  }
  return ffi::ErrorOr<std::unique_ptr<CommState>>(std::move(state));
}

ffi::Error BindComm(const char* op, CommState* state, int32_t device, const CommView** view,
                    int* num_sms, PeerMaps** peer_maps) {
  auto it = state->members.find(device);
  if (it == state->members.end()) {
    return ffi::Error::InvalidArgument(
        std::string("pk.") + op + ": this executable was compiled when communicator " +
        std::to_string(state->comm_id) + " had no member on device " + std::to_string(device) +
        "; call pk.init(mesh) with a mesh holding this device before compiling it.");
  }
  CommState::Member& m = it->second;
  if (t_calls == 0) {
    return ffi::Error::Internal(std::string("pk.") + op +
                                ": BindComm outside a handler call; bind the handler's state "
                                "with Ctx<PK_FFI_COMM_STATE> (comm_state.h)");
  }
  // Held until the handler returns (~CommCall), so pk.shutdown cannot unmap the workspaces
  // between this check and the kernel's launch.
  t_holds.push_back(m.entry.get());
  if (!HoldComm(m.entry.get())) {
    t_holds.pop_back();
    return ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        std::string("pk.") + op + ": this executable was compiled for communicator " +
        std::to_string(state->comm_id) + " on device " + std::to_string(device) +
        ", which pk.shutdown() released; its workspaces are gone. Compile the function "
        "again (call the jitted function anew, or lower and compile again) after pk.init.");
  }
  *view = &m.view;
  if (num_sms != nullptr) *num_sms = m.num_sms;
  if (peer_maps != nullptr) *peer_maps = &m.peer_maps;
  return ffi::Error::Success();
}

}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkCommInstantiate, pk_ffi::CommState::Create,
                              xla::ffi::Ffi::BindInstantiate().Attrs());
