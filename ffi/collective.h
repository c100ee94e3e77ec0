// Shared glue for the four collective handlers (all_reduce, all_gather, reduce_scatter,
// all_to_all): communicator lookup, the kernel's communicator fields, dtype dispatch and the
// workspace-too-small error.
#pragma once

#include <string>

#include "comm.h"
#include "ffi_util.h"
#include "pk/collective.cuh"

namespace pk_ffi {

// Op ids of the error record (pk_jax/runtime/errors.py).
constexpr int kOpAllReduce = 1;
constexpr int kOpAllGather = 2;
constexpr int kOpReduceScatter = 3;
constexpr int kOpAllToAll = 4;

// Fills the communicator fields of `g` from communicator `comm_id` of device `device`.
inline ffi::Error CollectiveGlobals(const char* op, int op_id, int64_t comm_id, int32_t device,
                                    const void* x, void* y, const int32_t* rank_ptr, int64_t n,
                                    pk::coll::globals* g, uint64_t* ws_bytes) {
  const CommView* v = FindComm(comm_id, device);
  if (v == nullptr) {
    return ffi::Error::InvalidArgument(
        std::string("pk.") + op + ": no communicator " + std::to_string(comm_id) +
        " on device " + std::to_string(device) +
        "; call pk.init(mesh) on every process before using the op (and not after "
        "pk.shutdown()).");
  }
  if (v->signal_count < pk::coll::SLOTS) {
    return ffi::Error::InvalidArgument(
        std::string("pk.") + op + ": the signal pad has " + std::to_string(v->signal_count) +
        " slots, the collectives need " + std::to_string(pk::coll::SLOTS));
  }
  *g = pk::coll::globals{};
  for (int p = 0; p < pk::coll::MAX_PEERS; ++p) {
    g->ws[p] = p < v->world ? v->workspace[p] : nullptr;
    g->sig[p] = p < v->world ? v->signals[p] : nullptr;
  }
  g->error = v->error;
  g->timeout_ns = v->timeout_ns;
  g->world = v->world;
  g->rank = v->rank;
  g->op = op_id;
  g->x = x;
  g->y = y;
  g->rank_ptr = rank_ptr;
  g->n = n;
  *ws_bytes = v->workspace_bytes;
  return ffi::Error::Success();
}

// Turns a launch status into an ffi::Error: CUDA errors, or a workspace that is too small.
inline ffi::Error CollectiveStatus(const char* op, const pk::coll::launch_status& st,
                                   uint64_t ws_bytes) {
  if (st.ws_needed != 0) {
    return ffi::Error::InvalidArgument(
        std::string("pk.") + op + ": the symmetric workspace has " + std::to_string(ws_bytes) +
        " bytes and this op needs at least " + std::to_string(st.ws_needed) +
        " at this world size; call pk.init(mesh, workspace_bytes=...) with more.");
  }
  PK_CUDA_CHECK(st.err);
  return ffi::Error::Success();
}

}  // namespace pk_ffi
