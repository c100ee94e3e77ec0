// The launcher shared by pk_gemm_rs and pk_gemm_ar: both reduce-add their GEMM tiles into the
// row owners' workspaces (cuda/kernels/gemm_rs.cuh) and differ only in the leave kernel (copy
// my rows, or gather every owner's rows).
#pragma once

#include <cstring>

#include "kernels/gemm_rs.cuh"
#include "tp.h"

namespace pk_ffi::tp {

// y = x @ w summed over ranks: rows [r Mp, (r+1) Mp) (GATHER = false, gemm_rs, Mp = M / P) or
// all M rows (GATHER = true, gemm_ar, Mp = ceil(M / P)). Always the fused kernels, also at
// P = 1: whether to run them was decided in Python (pk_jax._backend.route), which calls
// pk.matmul instead where the fused protocol does not pay.
template <bool GATHER>
Status RowSplitGemm(const char* op, int op_id, const Where& at, const GemmArgs& a,
                    const CommView& v) {
  pk::tp::comm c;
  if (Status s = Comm(op, op_id, v, a.rank, &c); !s.ok()) return s;
  const int world = c.world;
  if (Status s = GemmOperands(op, a); !s.ok()) return s;
  const int64_t m = a.m, k = a.k, n = a.n;
  if (!GATHER && m % world != 0) {
    return Status::Invalid(std::string("pk.") + op + ": M must be divisible by P.");
  }
  const int64_t m_out = GATHER ? m : m / world;
  if (a.y_rows != m_out || a.y_cols != n) {
    return Status::Invalid(std::string("pk.") + op + ": expected y [" + std::to_string(m_out) +
                           ", " + std::to_string(n) + "].");
  }
  const uint64_t y_bytes = uint64_t(m_out) * uint64_t(n) * 2;
  if (m_out == 0 || n == 0) return Status::Ok();
  if (k == 0) {  // every partial product is zero: so is the sum
    return CudaStatus(cudaMemsetAsync(a.y, 0, y_bytes, at.stream), "cudaMemsetAsync");
  }
  const bool big = a.config == op_table::kTile128x256S3;
  const uint32_t bm = 128;
  const int dt = a.dtype == DType::kBF16 ? 0 : 1;
  pk::matmul::globals base;
  std::memset(&base, 0, sizeof(base));
  base.m = static_cast<int>(m);
  base.n = static_cast<int>(n);
  base.k = static_cast<int>(k);
  base.group_m = static_cast<int>(a.group_m < 1 ? 1 : (a.group_m > 1024 ? 1024 : a.group_m));
  base.bound = c.bound();
  if (Status s = TensorMap(op, {a.x, uint64_t(m), uint64_t(k), bm, 64, dt}, &base.x); !s.ok()) {
    return s;
  }
  if (Status s = TensorMap(op, {a.w, uint64_t(k), uint64_t(n), 64, 64, dt}, &base.w); !s.ok()) {
    return s;
  }

  const int64_t mp = GATHER ? (m + world - 1) / world : m / world;
  const uint64_t owner_bytes = WorkspaceNeed(op_id, a, world);  // 16-byte multiple: n % 8 == 0
  if (Status s = WorkspaceCheck(op, owner_bytes, v.workspace_bytes); !s.ok()) return s;
  pk::gemm_rs::globals g;
  std::memset(&g, 0, sizeof(g));
  static_cast<pk::matmul::globals&>(g) = base;
  g.link = c.link;  // the rank emulator's link throttle (off unless pk_jax.testing set it)
  // The owners' buffers: fixed for the communicator and the shapes, so the executable's state
  // keeps their maps (Where::peer_maps).
  if (Status s = PeerTensorMaps(op, c.ws, world, uint64_t(mp), uint64_t(n), 64, 64, dt,
                                at.peer_maps, g.acc);
      !s.ok()) {
    return s;
  }
  g.rows_per_owner = static_cast<int>(mp);
  g.tiles_per_owner = static_cast<int>((mp + bm - 1) / bm);
  g.world = world;
  g.rank = c.rank;
  // P = 1: no peer adds into or gathers from the owner buffer, so the tiles go straight to y
  // and the enter and leave kernels are not launched (cuda/kernels/gemm_rs.cuh, direct mode).
  g.direct = world == 1 ? 1 : 0;
  if (g.direct) {
    if (Status s = TensorMap(op, {a.y, uint64_t(m_out), uint64_t(n), 64, 64, dt}, &g.y);
        !s.ok()) {
      return s;
    }
  }
  pk::tp::rows_args r;
  r.c = c;
  r.y = a.y;
  r.owner_units = owner_bytes / 16;
  r.out_units = y_bytes / 16;
  // The helper kernels' blocks pair up across ranks: a grid from the problem, not the SMs.
  const int grid = pk::tp::helper_grid(r.owner_units > r.out_units ? r.owner_units
                                                                   : r.out_units);
  if (Status s = StartEpoch(at.stream, c); !s.ok()) return s;
  if (Status s = CudaStatus(WithConfig(a.dtype, big, [&](auto cfg) {
                              return pk::gemm_rs::launch_front<decltype(cfg)>(
                                  g, r, grid, at.stream, at.device, at.num_sms);
                            }),
                            op);
      !s.ok()) {
    return s;
  }
  if (g.direct) return Status::Ok();
  pk::tp::leave_kernel<GATHER><<<grid, pk::tp::THREADS, 0, at.stream>>>(r);
  return CudaStatus(cudaGetLastError(), op);
}

}  // namespace pk_ffi::tp
