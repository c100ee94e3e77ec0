// FFI handler and launcher of pk_ag_gemm: y = all_gather(x) @ w and x_full = all_gather(x) (see
// cuda/kernels/ag_gemm.cuh). Launches on XLA's stream; no host synchronisation.
#include <cstring>

#include "kernels/ag_gemm.cuh"
#include "tp.h"

namespace pk_ffi {

Status LaunchAgGemm(const Where& at, const GemmArgs& a, const CommView& v) {
  constexpr const char* op = "all_gather_gemm";
  pk::tp::comm c;
  if (Status s = tp::Comm(op, kOpAgGemm, v, a.rank, &c); !s.ok()) return s;
  if (Status s = tp::GemmOperands(op, a); !s.ok()) return s;
  const int64_t mp = a.m, k = a.k, n = a.n, m = mp * c.world;
  if (a.y_rows != m || a.y_cols != n || a.x_full == nullptr) {
    return Status::Invalid(std::string("pk.") + op + ": expected y [" + std::to_string(m) +
                           ", " + std::to_string(n) + "] and x_full [" + std::to_string(m) +
                           ", " + std::to_string(k) + "].");
  }
  if (m == 0) return Status::Ok();
  constexpr int64_t kRows = pk::ag_gemm::BLOCK_ROWS;  // a row block (the kernel's BM)
  if (Status s = tp::GatherChecks(std::string("pk.") + op + ": ", m, kRows, a.num_comm_sms);
      !s.ok()) {
    return s;
  }
  if (k == 0 || n == 0) {
    // NOTES: nothing to gather or nothing to multiply; still a collective: take the reference
    // path in Python for these shapes (pk_jax/ops/ag_gemm.py never sends them here).
    return Status::Invalid(std::string("pk.") + op + ": K and N must be positive.");
  }
  const int comm_blocks = static_cast<int>(a.num_comm_sms);
  if (Status s = tp::WorkspaceCheck(op, WorkspaceNeed(kOpAgGemm, a, c.world), v.workspace_bytes);
      !s.ok()) {
    return s;
  }
  pk::ag_gemm::globals g;
  std::memset(&g, 0, sizeof(g));
  g.m = static_cast<int>(m);
  g.n = static_cast<int>(n);
  g.k = static_cast<int>(k);
  g.group_m = static_cast<int>(a.group_m < 1 ? 1 : (a.group_m > 1024 ? 1024 : a.group_m));
  g.bound = c.bound();
  const int dt = a.dtype == DType::kBF16 ? 0 : 1;
  const struct {
    const void* ptr;
    uint64_t rows, cols;
    uint32_t box_rows, box_cols;
    CUtensorMap* out;
  } maps[] = {
      {a.x_full, uint64_t(m), uint64_t(k), kRows, 64, &g.x},
      {a.x, uint64_t(mp), uint64_t(k), kRows, 64, &g.xl},
      {a.w, uint64_t(k), uint64_t(n), 64, 64, &g.w},
      {a.y, uint64_t(m), uint64_t(n), 64, 64, &g.y},
  };
  for (const auto& mm : maps) {
    if (Status s = TensorMap(op, {mm.ptr, mm.rows, mm.cols, mm.box_rows, mm.box_cols, dt},
                             mm.out);
        !s.ok()) {
      return s;
    }
  }
  g.c = c;
  g.x_local = a.x;
  g.x_full = a.x_full;
  tp::PlaceGather(&g, c.rank, mp, m, kRows);
  if (Status s = tp::StartEpoch(at.stream, c); !s.ok()) return s;
  return CudaStatus(tp::WithConfig(a.dtype, a.config == op_table::kTile128x256S3, [&](auto cfg) {
                      return pk::ag_gemm::launch<decltype(cfg)>(g, at.stream, at.device,
                                                                at.num_sms, comm_blocks);
                    }),
                    op);
}

namespace {

ffi::Error AgGemmCuda(cudaStream_t stream, int32_t device, CommState* state, ffi::AnyBuffer x,
                      ffi::AnyBuffer w,
                      ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> x_full, int64_t /*comm_id*/, int64_t config,
                      int64_t group_m, int64_t num_comm_sms) {
  ffi::AnyBuffer full = *x_full;
  return tp::RunGemm("all_gather_gemm", kOpAgGemm, LaunchAgGemm, stream, device, state, x, w,
                     rank, *y, &full, config, group_m, num_comm_sms);
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAgGemm, pk_ffi::AgGemmCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()                     // x [M/P, K]
                                  .Arg<xla::ffi::AnyBuffer>()                     // w [K, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                     // y [M, N]
                                  .Ret<xla::ffi::AnyBuffer>()                     // x_full [M, K]
                                  .Attr<int64_t>("comm_id")                       // comm_id
                                  .Attr<int64_t>("config")                        // tile config
                                  .Attr<int64_t>("group_m")        // block-rows per band
                                  .Attr<int64_t>("num_comm_sms"),  // communication blocks
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpAgGemm, "CUDA", PkAgGemm);
