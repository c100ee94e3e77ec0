// The communicator table: per (communicator id, device ordinal), the symmetric workspaces and
// signal pads of every peer as mapped in this process. pk_jax/runtime/comm.py fills it at
// pk.init (comm_register) and empties it at pk.shutdown (comm_unregister). FFI handlers do not
// read it on every call: their instantiate stage copies the views of their comm_id into a
// per-executable state (comm_state.h), with a reference to each registration (CommEntry), and
// each call holds its registration from the check that it is still registered through its
// kernel's launch (HoldComm, ReleaseComm). UnregisterComm waits until no call holds the
// registration, so once it returns every kernel that can use the registration's memory has
// been enqueued, and a device synchronisation covers them all before that memory is unmapped.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace pk_ffi {

constexpr int kMaxPeers = 16;

struct CommView {                  // passed to kernels by value
  int32_t rank, world;
  uint64_t timeout_ns;             // spin-wait bound
  void* workspace[kMaxPeers];      // peer p's symmetric workspace, as mapped in this process
  uint64_t* signals[kMaxPeers];    // peer p's signal pad (zeroed at creation), mapped here
  uint64_t workspace_bytes;
  uint64_t signal_count;           // number of uint64 counters in each pad
  int32_t* error;                  // device pointer to a host-mapped int32[8] error record
  // The rank emulator's link throttle (cuda/include/pk/link.cuh): this rank's link clock in
  // device memory and the cap in ps per KiB. nullptr / 0 (off) unless pk_jax.testing set them
  // through SetCommLink; pk.init never does.
  uint64_t* link_clock;
  uint64_t link_ps_per_kib;
  // Unique per registration in this process (never 0, never reused): a view copied from the
  // table is current while the table holds a view of the same serial under its key.
  uint64_t serial;
};

// nullptr when no communicator comm_id is registered for this device ordinal.
const CommView* FindComm(int64_t comm_id, int device_ordinal);

// Fields of the int32[8] error record (see pk_jax/runtime/errors.py).
namespace comm_error {
constexpr int kCode = 0;   // 0 ok, then one of the codes below; the first error wins
constexpr int kOp = 1;     // op id (errors.OP_NAMES)
constexpr int kRank = 2;   // the rank that stopped waiting
constexpr int kPeer = 3;   // the peer it waited for
constexpr int kNone = 0;
constexpr int kTimeout = 1;
constexpr int kRankMismatch = 2;
constexpr int kMbarTimeout = 3;
}  // namespace comm_error

// Host side, called from the nanobind module. Both throw std::invalid_argument (ValueError in
// Python) on bad arguments; register refuses a key that is already taken.
void RegisterComm(int64_t comm_id, int device_ordinal, int rank, int world,
                  const std::vector<uint64_t>& workspace_ptrs,
                  const std::vector<uint64_t>& signal_ptrs, uint64_t workspace_bytes,
                  uint64_t signal_count, uint64_t timeout_ns, uint64_t error_ptr);
// Returns whether a communicator was registered under the key. Blocks until no handler holds
// that registration (HoldComm): a handler that checked it before this call has enqueued its
// kernel by the time this returns.
bool UnregisterComm(int64_t comm_id, int device_ordinal);
// Rank emulator only: caps the registered communicator's link at `gbps` (1e9 bytes/s) using
// the uint64 link clock at device address `clock_ptr`; gbps <= 0 turns the throttle off.
// Throws std::invalid_argument when nothing is registered under the key or clock_ptr is 0.
void SetCommLink(int64_t comm_id, int device_ordinal, double gbps, uint64_t clock_ptr);
// Number of registered communicators (for tests).
int CommCount();

// Moves whenever a communicator is unregistered (pk.shutdown, or a pk.init that failed
// halfway): while it has not moved, every view copied from the table is still registered.
uint64_t CommTableVersion();

// One registration (comm.cu). The table and every executable state that copied its view share
// it; it outlives its unregistration while a state refers to it, but only as a retired entry
// that no handler can hold again.
struct CommEntry;

struct CommMember {
  int device;
  CommView view;                     // a copy, as registered
  std::shared_ptr<CommEntry> entry;  // what HoldComm takes
};
// Every registration under comm_id, by device ordinal.
std::vector<CommMember> CommMembers(int64_t comm_id);

// Takes a hold on a registration: false (and no hold) once it is unregistered. While held,
// UnregisterComm of it waits; a handler holds it from its check through its kernel's launch.
bool HoldComm(CommEntry* entry);
// Gives back a hold that HoldComm took.
void ReleaseComm(CommEntry* entry);

}  // namespace pk_ffi
