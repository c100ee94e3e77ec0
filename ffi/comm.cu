// The communicator table (see comm.h). NOTES: views live in shared entries so the pointer
// FindComm returns stays valid while other keys are added or removed; a handler copies the
// view into its kernel's arguments at launch, so no lock is held across a launch, only a hold
// (a counter in the entry) that UnregisterComm waits out.
#include "comm.h"

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

namespace pk_ffi {

struct CommEntry {
  CommView view;
  std::atomic<int64_t> holds{0};     // handlers between HoldComm and ReleaseComm
  std::atomic<bool> retired{false};  // set once by UnregisterComm, before it waits
};

namespace {

using Key = std::pair<int64_t, int>;

std::mutex& TableMutex() {
  static std::mutex mu;
  return mu;
}

std::map<Key, std::shared_ptr<CommEntry>>& Table() {
  static auto* table = new std::map<Key, std::shared_ptr<CommEntry>>();  // never destroyed
  return *table;
}

// Where UnregisterComm waits for the last hold on a retired entry to go.
std::mutex& HoldMutex() {
  static auto* mu = new std::mutex();  // never destroyed: handlers may outlive static teardown
  return *mu;
}
std::condition_variable& HoldReleased() {
  static auto* cv = new std::condition_variable();
  return *cv;
}

std::atomic<uint64_t> g_version{0};  // CommTableVersion
uint64_t g_serial = 0;                 // the last serial given out (under TableMutex)

std::string KeyName(int64_t comm_id, int device_ordinal) {
  return "communicator " + std::to_string(comm_id) + " on device " +
         std::to_string(device_ordinal);
}

}  // namespace

const CommView* FindComm(int64_t comm_id, int device_ordinal) {
  std::lock_guard<std::mutex> lock(TableMutex());
  auto it = Table().find({comm_id, device_ordinal});
  return it == Table().end() ? nullptr : &it->second->view;
}

void RegisterComm(int64_t comm_id, int device_ordinal, int rank, int world,
                  const std::vector<uint64_t>& workspace_ptrs,
                  const std::vector<uint64_t>& signal_ptrs, uint64_t workspace_bytes,
                  uint64_t signal_count, uint64_t timeout_ns, uint64_t error_ptr) {
  const std::string name = KeyName(comm_id, device_ordinal);
  if (world < 1 || world > kMaxPeers) {
    throw std::invalid_argument("pk_jax comm_register: " + name + " has world " +
                                std::to_string(world) + ", outside 1.." +
                                std::to_string(kMaxPeers));
  }
  if (rank < 0 || rank >= world) {
    throw std::invalid_argument("pk_jax comm_register: " + name + " has rank " +
                                std::to_string(rank) + " outside 0.." +
                                std::to_string(world - 1));
  }
  if (workspace_ptrs.size() != static_cast<size_t>(world) ||
      signal_ptrs.size() != static_cast<size_t>(world)) {
    throw std::invalid_argument("pk_jax comm_register: " + name + " needs " +
                                std::to_string(world) + " workspace and signal pointers, got " +
                                std::to_string(workspace_ptrs.size()) + " and " +
                                std::to_string(signal_ptrs.size()));
  }
  for (int p = 0; p < world; ++p) {
    if (workspace_ptrs[p] == 0 || signal_ptrs[p] == 0) {
      throw std::invalid_argument("pk_jax comm_register: " + name +
                                  " has a null pointer for peer " + std::to_string(p));
    }
  }
  if (error_ptr == 0) {
    throw std::invalid_argument("pk_jax comm_register: " + name + " has no error record");
  }
  auto entry = std::make_shared<CommEntry>();
  CommView* view = &entry->view;
  view->rank = rank;
  view->world = world;
  view->timeout_ns = timeout_ns;
  for (int p = 0; p < kMaxPeers; ++p) {
    view->workspace[p] = p < world ? reinterpret_cast<void*>(workspace_ptrs[p]) : nullptr;
    view->signals[p] = p < world ? reinterpret_cast<uint64_t*>(signal_ptrs[p]) : nullptr;
  }
  view->workspace_bytes = workspace_bytes;
  view->signal_count = signal_count;
  view->error = reinterpret_cast<int32_t*>(error_ptr);

  std::lock_guard<std::mutex> lock(TableMutex());
  auto [it, inserted] = Table().emplace(Key{comm_id, device_ordinal}, nullptr);
  if (!inserted) {
    throw std::invalid_argument("pk_jax comm_register: " + name +
                                " is already registered; unregister it first");
  }
  view->serial = ++g_serial;
  it->second = std::move(entry);
}

void SetCommLink(int64_t comm_id, int device_ordinal, double gbps, uint64_t clock_ptr) {
  const std::string name = KeyName(comm_id, device_ordinal);
  std::lock_guard<std::mutex> lock(TableMutex());
  auto it = Table().find({comm_id, device_ordinal});
  if (it == Table().end()) {
    throw std::invalid_argument("pk_jax comm_set_link: " + name + " is not registered");
  }
  if (gbps > 0 && clock_ptr == 0) {
    throw std::invalid_argument("pk_jax comm_set_link: " + name + " needs a link clock");
  }
  if (gbps > 0 && gbps < 0.1) {  // keeps bytes * ps_per_kib far from overflow
    throw std::invalid_argument("pk_jax comm_set_link: " + name + ": a cap below 0.1 GB/s");
  }
  // ps per KiB: 1024 bytes at gbps * 1e9 bytes/s (pk/link.cuh).
  const uint64_t ps = gbps > 0 ? static_cast<uint64_t>(1024.0 * 1000.0 / gbps + 0.5) : 0;
  it->second->view.link_clock = ps > 0 ? reinterpret_cast<uint64_t*>(clock_ptr) : nullptr;
  it->second->view.link_ps_per_kib = ps;
}

bool UnregisterComm(int64_t comm_id, int device_ordinal) {
  std::shared_ptr<CommEntry> entry;
  {
    std::lock_guard<std::mutex> lock(TableMutex());
    auto it = Table().find({comm_id, device_ordinal});
    if (it == Table().end()) return false;
    entry = std::move(it->second);
    Table().erase(it);
    entry->retired.store(true);  // seq_cst: pairs with HoldComm's increment, then check
    g_version.fetch_add(1, std::memory_order_release);
  }
  // NOTES: from here no HoldComm of this entry succeeds; wait out the holds taken before, so
  // that their kernels are enqueued before the caller synchronises the device and unmaps.
  std::unique_lock<std::mutex> lock(HoldMutex());
  HoldReleased().wait(lock, [&] { return entry->holds.load() == 0; });
  return true;
}

uint64_t CommTableVersion() { return g_version.load(std::memory_order_acquire); }

std::vector<CommMember> CommMembers(int64_t comm_id) {
  std::lock_guard<std::mutex> lock(TableMutex());
  std::vector<CommMember> out;
  for (const auto& [key, entry] : Table()) {
    if (key.first == comm_id) out.push_back(CommMember{key.second, entry->view, entry});
  }
  return out;
}

bool HoldComm(CommEntry* entry) {
  if (entry->retired.load(std::memory_order_acquire)) return false;
  // NOTES: increment, then check (seq_cst), against UnregisterComm's retire, then read of the
  // count: either this sees the entry retired, or UnregisterComm sees the hold and waits.
  entry->holds.fetch_add(1);
  if (entry->retired.load()) {
    ReleaseComm(entry);
    return false;
  }
  return true;
}

void ReleaseComm(CommEntry* entry) {
  if (entry->holds.fetch_sub(1) == 1 && entry->retired.load()) {
    // Under the mutex, so that the waiter is either before its check or already waiting.
    std::lock_guard<std::mutex> lock(HoldMutex());
    HoldReleased().notify_all();
  }
}

int CommCount() {
  std::lock_guard<std::mutex> lock(TableMutex());
  return static_cast<int>(Table().size());
}

}  // namespace pk_ffi
