// FFI handler for pk_ag_gemm: y = all_gather(x) @ w and x_full = all_gather(x) (see
// cuda/kernels/ag_gemm.cuh). Launches on XLA's stream; no host synchronisation.
#include <algorithm>
#include <cstring>

#include "kernels/ag_gemm.cuh"
#include "tp.h"

namespace pk_ffi {
namespace {

ffi::Error AgGemmCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> x_full, int64_t comm_id, int64_t config,
                      int64_t group_m, int64_t num_comm_sms) {
  constexpr const char* op = "all_gather_gemm";
  int64_t mp, k, n;
  int dtype;
  if (ffi::Error e = tp::GemmOperands(op, x, w, &mp, &k, &n, &dtype); e.failure()) return e;
  pk::tp::comm c;
  uint64_t ws_bytes = 0;
  if (ffi::Error e = tp::Comm(op, tp::kOpAgGemm, tp::kIndexAgGemm, comm_id, device,
                              rank.typed_data(), &c, &ws_bytes);
      e.failure()) {
    return e;
  }
  const int64_t m = mp * c.world;
  const auto yd = y->dimensions(), xd = x_full->dimensions();
  if (y->element_type() != x.element_type() || x_full->element_type() != x.element_type() ||
      yd.size() != 2 || yd[0] != m || yd[1] != n || xd.size() != 2 || xd[0] != m ||
      xd[1] != k) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op + ": expected y [" +
                                       std::to_string(m) + ", " + std::to_string(n) +
                                       "] and x_full [" + std::to_string(m) + ", " +
                                       std::to_string(k) + "].");
  }
  if (config != tp::kTile128x128 && config != tp::kTile128x256) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op + ": unknown tile config " +
                                       std::to_string(config));
  }
  if (m == 0) return ffi::Error::Success();
  if (m > INT32_MAX) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op + ": M must be below 2^31.");
  }
  if (k == 0 || n == 0) {
    // NOTES: nothing to gather or nothing to multiply; still a collective: take the reference
    // path in Python for these shapes (pk_jax/ops/ag_gemm.py never sends them here).
    return ffi::Error::InvalidArgument(std::string("pk.") + op + ": K and N must be positive.");
  }
  const int64_t tiles_m = (m + 127) / 128;
  if (static_cast<uint64_t>(tiles_m) > pk::tp::MAX_FLAGS) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op + ": M must be at most " +
                                       std::to_string(pk::tp::MAX_FLAGS * 128) + " rows.");
  }
  int num_sms = 0;
  if (ffi::Error e = NumSms(device, &num_sms); e.failure()) return e;
  const int comm_blocks = static_cast<int>(num_comm_sms);
  if (comm_blocks < 1 || comm_blocks > pk::tp::MAX_BLOCKS || comm_blocks >= num_sms) {
    return ffi::Error::InvalidArgument(std::string("pk.") + op + ": num_comm_sms must be in 1.." +
                                       std::to_string(std::min(pk::tp::MAX_BLOCKS, num_sms - 1)) +
                                       ", got " + std::to_string(num_comm_sms));
  }
  if (ffi::Error e = tp::WorkspaceCheck(op, uint64_t(mp) * uint64_t(k) * 2, ws_bytes);
      e.failure()) {
    return e;
  }
  pk::ag_gemm::globals g;
  std::memset(&g, 0, sizeof(g));
  g.m = static_cast<int>(m);
  g.n = static_cast<int>(n);
  g.k = static_cast<int>(k);
  g.group_m = static_cast<int>(group_m < 1 ? 1 : (group_m > 1024 ? 1024 : group_m));
  const struct {
    const void* ptr;
    uint64_t rows, cols;
    uint32_t box_rows, box_cols;
    CUtensorMap* out;
  } maps[] = {
      {x_full->untyped_data(), uint64_t(m), uint64_t(k), 128, 64, &g.x},
      {x.untyped_data(), uint64_t(mp), uint64_t(k), 128, 64, &g.xl},
      {w.untyped_data(), uint64_t(k), uint64_t(n), 64, 64, &g.w},
      {y->untyped_data(), uint64_t(m), uint64_t(n), 64, 64, &g.y},
  };
  for (const auto& mm : maps) {
    if (ffi::Error e = TensorMap(op, {mm.ptr, mm.rows, mm.cols, mm.box_rows, mm.box_cols, dtype},
                               mm.out);
        e.failure()) {
      return e;
    }
  }
  g.c = c;
  g.x_local = x.untyped_data();
  g.x_full = x_full->untyped_data();
  g.rows_per_rank = static_cast<int>(mp);
  PK_CUDA_CHECK(tp::WithConfig(dtype, config == tp::kTile128x256, [&](auto cfg) {
    return pk::ag_gemm::launch<decltype(cfg)>(g, stream, device, num_sms, comm_blocks);
  }));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAgGemm, pk_ffi::AgGemmCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x [M/P, K]
                                  .Arg<xla::ffi::AnyBuffer>()                     // w [K, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                     // y [M, N]
                                  .Ret<xla::ffi::AnyBuffer>()                     // x_full [M, K]
                                  .Attr<int64_t>("comm_id")                       // comm_id
                                  .Attr<int64_t>("config")                        // tile config
                                  .Attr<int64_t>("group_m")        // block-rows per band
                                  .Attr<int64_t>("num_comm_sms"),  // communication blocks
                              PK_FFI_CUDA_TRAITS);
