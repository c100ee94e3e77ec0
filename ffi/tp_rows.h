// The host side shared by pk_gemm_rs and pk_gemm_ar: both reduce-add their GEMM tiles into the
// row owners' workspaces (cuda/kernels/gemm_rs.cuh) and differ only in the leave kernel (copy
// my rows, or gather every owner's rows).
#pragma once

#include <cstring>

#include "kernels/gemm_rs.cuh"
#include "tp.h"

namespace pk_ffi::tp {

// y = x @ w summed over ranks: rows [r Mp, (r+1) Mp) (GATHER = false, gemm_rs, Mp = M / P) or
// all M rows (GATHER = true, gemm_ar, Mp = ceil(M / P)). mode 1 forces the fused kernels at
// P = 1 (otherwise P = 1 is one matmul kernel writing y).
template <bool GATHER>
ffi::Error RowSplitGemm(const char* op, int op_id, int index, cudaStream_t stream, int32_t device,
                        const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                        const ffi::Buffer<ffi::S32>& rank, ffi::AnyBuffer y, int64_t comm_id,
                        int64_t config, int64_t group_m, int64_t mode) {
  int64_t m, k, n;
  int dtype;
  if (ffi::Error e = GemmOperands(op, x, w, &m, &k, &n, &dtype); e.failure()) return e;
  pk::tp::comm c;
  uint64_t ws_bytes = 0;
  if (ffi::Error e = Comm(op, op_id, index, comm_id, device, rank.typed_data(), &c, &ws_bytes);
      e.failure()) {
    return e;
  }
  const int world = c.world;
  if (!GATHER && m % world != 0) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op + ": M must be divisible by P.");
  }
  const int64_t m_out = GATHER ? m : m / world;
  const auto yd = y.dimensions();
  if (y.element_type() != x.element_type() || yd.size() != 2 || yd[0] != m_out || yd[1] != n) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op + ": expected y [" +
                                       std::to_string(m_out) + ", " + std::to_string(n) + "].");
  }
  if (config != kTile128x128 && config != kTile128x256) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op + ": unknown tile config " +
                                       std::to_string(config));
  }
  if (m_out == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {  // every partial product is zero: so is the sum
    PK_CUDA_CHECK(cudaMemsetAsync(y.untyped_data(), 0, y.size_bytes(), stream));
    return ffi::Error::Success();
  }
  int num_sms = 0;
  if (ffi::Error e = NumSms(device, &num_sms); e.failure()) return e;
  const bool big = config == kTile128x256;
  const uint32_t bm = 128;
  pk::matmul::globals base;
  std::memset(&base, 0, sizeof(base));
  base.m = static_cast<int>(m);
  base.n = static_cast<int>(n);
  base.k = static_cast<int>(k);
  base.group_m = static_cast<int>(group_m < 1 ? 1 : (group_m > 1024 ? 1024 : group_m));
  if (ffi::Error e =
          TensorMap(op, {x.untyped_data(), uint64_t(m), uint64_t(k), bm, 64, dtype}, &base.x);
      e.failure()) {
    return e;
  }
  if (ffi::Error e =
          TensorMap(op, {w.untyped_data(), uint64_t(k), uint64_t(n), 64, 64, dtype}, &base.w);
      e.failure()) {
    return e;
  }

  if (world == 1 && mode != 1) {  // P = 1: the matmul kernel, stores straight into y
    if (ffi::Error e =
            TensorMap(op, {y.untyped_data(), uint64_t(m), uint64_t(n), 64, 64, dtype}, &base.y);
        e.failure()) {
      return e;
    }
    PK_CUDA_CHECK(WithConfig(dtype, big, [&](auto cfg) {
      return pk::matmul::launch<decltype(cfg)>(base, stream, device, num_sms);
    }));
    return ffi::Error::Success();
  }

  const int64_t mp = GATHER ? (m + world - 1) / world : m / world;
  const uint64_t owner_bytes = uint64_t(mp) * uint64_t(n) * 2;  // 16-byte multiple: n % 8 == 0
  if (ffi::Error e = WorkspaceCheck(op, owner_bytes, ws_bytes); e.failure()) return e;
  pk::gemm_rs::globals g;
  std::memset(&g, 0, sizeof(g));
  static_cast<pk::matmul::globals&>(g) = base;
  for (int o = 0; o < world; ++o) {
    if (ffi::Error e =
            TensorMap(op, {c.ws[o], uint64_t(mp), uint64_t(n), 64, 64, dtype}, &g.acc[o]);
        e.failure()) {
      return e;
    }
  }
  g.rows_per_owner = static_cast<int>(mp);
  g.tiles_per_owner = static_cast<int>((mp + bm - 1) / bm);
  g.world = world;
  g.rank = c.rank;
  pk::tp::rows_args a;
  a.c = c;
  a.y = y.untyped_data();
  a.owner_units = owner_bytes / 16;
  a.out_units = y.size_bytes() / 16;
  const int grid = pk::tp::helper_grid(a.owner_units > a.out_units ? a.owner_units : a.out_units,
                                       num_sms);
  PK_CUDA_CHECK(WithConfig(dtype, big, [&](auto cfg) {
    return pk::gemm_rs::launch_front<decltype(cfg)>(g, a, grid, stream, device, num_sms);
  }));
  pk::tp::leave_kernel<GATHER><<<grid, pk::tp::THREADS, 0, stream>>>(a);
  PK_CUDA_CHECK_LAUNCH();
  return ffi::Error::Success();
}

}  // namespace pk_ffi::tp
