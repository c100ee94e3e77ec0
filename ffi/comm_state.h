// Per-executable communicator state: what a communicator handler binds when XLA instantiates
// its executable (the FFI instantiate stage), instead of a lookup in the communicator table on
// every call.
//
// XLA runs the instantiate stage once per executable, when it compiles or loads it, with the
// call's attributes only: no device, stream or buffers, and one executable serves every local
// device of a single-process mesh. CommState::Create copies, for every device ordinal of this
// process, the view registered under the call's comm_id (with a reference to its registration,
// comm.h CommEntry) and the device's SM count. A call (the execute stage, bound with
// Ctx<PK_FFI_COMM_STATE>) takes its device's copy with BindComm, which holds the registration
// until the handler returns, so through its kernel's launch: pk.shutdown's unregistration
// waits for that, then synchronises the device, then unmaps. After pk.shutdown the copied
// registration is retired (a later pk.init registers new ones, even under the same ids), so the
// call fails with an error naming the fix, before any kernel can touch released memory.
//
// NOTES: handlers with this state are not marked command-buffer compatible (PK_FFI_COMM_TRAITS
// is empty). XLA replays a CUDA graph it recorded without calling the handler again, so a
// graph kept by an executable from before pk.shutdown would launch kernels on unmapped
// workspaces; without the trait, every call of such an executable goes through BindComm.
//
// The hold ends when the handler returns: PK_FFI_COMM_STATE decodes to a CommCall, which XLA's
// FFI keeps among the decoded arguments until the handler has returned, and whose destructor
// gives back the holds BindComm took on this thread meanwhile. Handlers take it as CommState*.
#pragma once

#include <map>
#include <memory>
#include <optional>

#include "comm.h"
#include "ffi_util.h"
#include "tensor_map.h"

namespace pk_ffi {

struct CommState {
  static ffi::TypeId id;      // assigned when pk_jax/_ffi.py registers the type with XLA
  static ffi::TypeInfo info;  // its deleter

  // One device ordinal's communicator, as registered when the executable was instantiated.
  struct Member {
    CommView view;
    std::shared_ptr<CommEntry> entry;  // its registration, held by each call (BindComm)
    int num_sms = 0;
    PeerMaps peer_maps;                // maps over the peers' workspaces, per call shape
  };

  int64_t comm_id = -1;
  std::map<int, Member> members;  // by device ordinal; fixed once Create returns

  // The instantiate stage: reads the call's comm_id attribute.
  static ffi::ErrorOr<std::unique_ptr<CommState>> Create(ffi::Dictionary attrs);
};

// The communicator of this call's device from the executable's state, held until the handler
// returns (see CommCall); an error when the executable has none for this device or its
// communicator was shut down since it was compiled. num_sms and peer_maps may be nullptr.
ffi::Error BindComm(const char* op, CommState* state, int32_t device, const CommView** view,
                    int* num_sms = nullptr, PeerMaps** peer_maps = nullptr);

// The execute stage's decoded state: the handler's CommState*, and the scope of one call on
// this thread. BindComm outside such a scope is refused.
class CommCall {
 public:
  explicit CommCall(CommState* state);
  CommCall(CommCall&& other) noexcept;
  CommCall(const CommCall&) = delete;
  CommCall& operator=(const CommCall&) = delete;
  CommCall& operator=(CommCall&&) = delete;
  ~CommCall();  // gives back the holds BindComm took since this scope opened

  operator CommState*() const { return state_; }  // NOLINT: handlers take CommState*

 private:
  CommState* state_;
  size_t mark_ = 0;    // holds this thread had when the scope opened
  bool open_ = false;  // this object (not one it was moved from) closes the scope
};

struct CommCallTag {};  // what PK_FFI_COMM_STATE names in Ctx<>

}  // namespace pk_ffi

namespace xla::ffi {

template <>
struct CtxDecoding<pk_ffi::CommCallTag> {
  using Type = pk_ffi::CommCall;

  template <typename Context>
  static std::optional<Type> Decode(const XLA_FFI_Api* api, Context* ctx,
                                    DiagnosticEngine& diagnostic) {
    std::optional<pk_ffi::CommState*> state =
        CtxDecoding<State<pk_ffi::CommState>>::Decode(api, ctx, diagnostic);
    if (!state.has_value()) return std::nullopt;
    return std::optional<Type>(std::in_place, *state);
  }
};

}  // namespace xla::ffi

// The execute-stage binding of the state, placed after Ctx<DeviceOrdinal>.
#define PK_FFI_COMM_STATE pk_ffi::CommCallTag

// Traits of the communicator handlers: none (see NOTES above).
#define PK_FFI_COMM_TRAITS {}
