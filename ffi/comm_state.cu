// The per-executable communicator state (see comm_state.h) and the instantiate stage every
// communicator handler shares (PkCommInstantiate, registered in ffi/module.cc).
#include "comm_state.h"

#include <string>
#include <utility>

namespace pk_ffi {

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
  // NOTES: the version is read before the copies, so an unregister that races with them moves
  // it past the recorded value and the first call checks the serials again.
  const uint64_t version = CommTableVersion();
  for (const auto& [device, view] : CommMembers(state->comm_id)) {
    Member& m = state->members[device];
    m.view = view;
    if (cudaDeviceGetAttribute(&m.num_sms, cudaDevAttrMultiProcessorCount, device) !=
        cudaSuccess) {
      return ffi::Unexpected(ffi::Error::Internal(
          "pk_jax: cudaDeviceGetAttribute(MultiProcessorCount) failed for device " +
          std::to_string(device)));
    }
    m.checked.store(version + 1, std::memory_order_relaxed);
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
  const uint64_t version = CommTableVersion() + 1;
  if (m.checked.load(std::memory_order_acquire) != version) {
    // Something was unregistered since the last check: is this member's registration live?
    if (CommSerial(state->comm_id, device) != m.view.serial) {
      return ffi::Error(
          ffi::ErrorCode::kFailedPrecondition,
          std::string("pk.") + op + ": this executable was compiled for communicator " +
          std::to_string(state->comm_id) + " on device " + std::to_string(device) +
          ", which pk.shutdown() released; its workspaces are gone. Compile the function "
          "again (call the jitted function anew, or lower and compile again) after pk.init.");
    }
    m.checked.store(version, std::memory_order_release);
  }
  *view = &m.view;
  if (num_sms != nullptr) *num_sms = m.num_sms;
  if (peer_maps != nullptr) *peer_maps = &m.peer_maps;
  return ffi::Error::Success();
}

}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkCommInstantiate, pk_ffi::CommState::Create,
                              xla::ffi::Ffi::BindInstantiate().Attrs());
