// Shared glue for the four collective launchers (all_reduce, all_gather, reduce_scatter,
// all_to_all): the kernel's communicator fields, the dtype dispatch and the workspace-too-small
// error.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "launch.h"
#include "pk/collective.cuh"

namespace pk_ffi {

// The collectives' slots and peers are the op table's (op_table.h).
static_assert(pk::coll::SLOT_BASE == op_table::kCollSlots.base &&
                  pk::coll::SLOTS <= op_table::kCollSlots.end(),
              "the collectives' slots must lie in their op_table.h range");
static_assert(pk::coll::MAX_PEERS == op_table::kMaxPeers, "op_table.h kMaxPeers");

// The kernel arguments of a collective call from the view of its communicator and the args.
inline Status CollectiveGlobals(const char* op, int op_id, const CollArgs& a, const CommView& v,
                                pk::coll::globals* g) {
  if (Status s = CheckRecord(op, v); !s.ok()) return s;
  if (v.signal_count < pk::coll::SLOTS) {
    return Status::Invalid(std::string("pk.") + op + ": the signal pad has " +
                           std::to_string(v.signal_count) + " slots, the collectives need " +
                           std::to_string(pk::coll::SLOTS));
  }
  *g = pk::coll::globals{};
  for (int p = 0; p < pk::coll::MAX_PEERS; ++p) {
    g->ws[p] = p < v.world ? v.workspace[p] : nullptr;
    g->sig[p] = p < v.world ? v.signals[p] : nullptr;
  }
  g->error = v.error;
  g->timeout_ns = v.timeout_ns;
  g->world = v.world;
  g->rank = v.rank;
  g->op = op_id;
  g->x = a.x;
  g->y = a.y;
  g->rank_ptr = a.rank;
  g->n = a.n;
  g->link = pk::link_throttle{v.link_clock, v.link_ps_per_kib};  // off unless emulated
  return Status::Ok();
}

// Turns a launch status into a Status: CUDA errors, or a workspace that is too small.
inline Status CollectiveStatus(const char* op, const pk::coll::launch_status& st,
                               uint64_t ws_bytes) {
  if (st.ws_needed != 0) {
    return Status::Invalid(
        std::string("pk.") + op + ": the symmetric workspace has " + std::to_string(ws_bytes) +
        " bytes and this op needs at least " + std::to_string(st.ws_needed) +
        " at this world size; call pk.init(mesh, workspace_bytes=...) with more.");
  }
  return CudaStatus(st.err, op);
}

}  // namespace pk_ffi
