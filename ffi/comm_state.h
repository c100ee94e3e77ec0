// Per-executable communicator state: what a communicator handler binds when XLA instantiates
// its executable (the FFI instantiate stage), instead of a lookup in the communicator table on
// every call.
//
// XLA runs the instantiate stage once per executable, when it compiles or loads it, with the
// call's attributes only: no device, stream or buffers, and one executable serves every local
// device of a single-process mesh. CommState::Create copies, for every device ordinal of this
// process, the view registered under the call's comm_id (with its serial) and the device's SM
// count. A call (the execute stage, Ctx<State<CommState>>) takes its device's copy with
// BindComm, which reads one counter while nothing was unregistered since its last check. After
// pk.shutdown the copied registration is gone (a later pk.init registers new serials, even
// under the same ids), so the call fails with an error naming the fix, before any kernel can
// touch released memory.
//
// NOTES: handlers with this state are not marked command-buffer compatible (PK_FFI_COMM_TRAITS
// is empty). XLA replays a CUDA graph it recorded without calling the handler again, so a
// graph kept by an executable from before pk.shutdown would launch kernels on unmapped
// workspaces; without the trait, every call of such an executable goes through BindComm.
#pragma once

#include <atomic>
#include <map>
#include <memory>

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
    int num_sms = 0;
    std::atomic<uint64_t> checked{0};  // a CommTableVersion() + 1 at which view was live
    PeerMaps peer_maps;                // maps over the peers' workspaces, per call shape
  };

  int64_t comm_id = -1;
  std::map<int, Member> members;  // by device ordinal; fixed once Create returns

  // The instantiate stage: reads the call's comm_id attribute.
  static ffi::ErrorOr<std::unique_ptr<CommState>> Create(ffi::Dictionary attrs);
};

// The communicator of this call's device from the executable's state; an error when the
// executable has none for this device or its communicator was shut down since it was compiled.
// num_sms and peer_maps may be nullptr.
ffi::Error BindComm(const char* op, CommState* state, int32_t device, const CommView** view,
                    int* num_sms = nullptr, PeerMaps** peer_maps = nullptr);

}  // namespace pk_ffi

// The execute-stage binding of the state, placed after Ctx<DeviceOrdinal>.
#define PK_FFI_COMM_STATE xla::ffi::State<pk_ffi::CommState>

// Traits of the communicator handlers: none (see NOTES above).
#define PK_FFI_COMM_TRAITS {}
