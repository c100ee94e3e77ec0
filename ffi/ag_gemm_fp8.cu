// FFI handler and launcher of pk_ag_gemm_fp8: ag_gemm with fp8 operands and per-tensor or
// blockwise scales, y = all_gather(x) @ w in bf16 with x_full and xs_full, the gathered rows
// and scales (see cuda/kernels/ag_gemm_fp8.cuh). w comes transposed, wt [N, K], as
// matmul_fp8's; the Python op (pk_jax/ops/ag_gemm.py) lays out the operands and scales.
// Launches on XLA's stream; no host synchronisation.
#include <cstring>
#include <string>

#include "kernels/ag_gemm_fp8.cuh"
#include "tp.h"

namespace pk_ffi {

Status LaunchAgGemmFp8(const Where& at, const GemmFp8Args& a, const CommView& v) {
  constexpr const char* op = "all_gather_gemm_fp8";
  const std::string pre = std::string("pk.") + op + ": ";
  pk::tp::comm c;
  if (Status s = tp::Comm(op, kOpAgGemmFp8, v, a.rank, &c); !s.ok()) return s;
  if (Status s = tp::Fp8Operands(pre, a); !s.ok()) return s;
  const int64_t mp = a.m, k = a.k, n = a.n, m = mp * c.world;
  if (a.y_rows != m || a.y_cols != n || a.x_full == nullptr || a.xs_full == nullptr) {
    return Status::Invalid(pre + "expected y [" + std::to_string(m) + ", " + std::to_string(n) +
                           "], x_full [" + std::to_string(m) + ", " + std::to_string(k) +
                           "] and xs_full.");
  }
  if (m == 0) return Status::Ok();
  constexpr int64_t kRows = pk::ag_gemm::BLOCK_ROWS;  // a row block (the kernel's BM)
  if (Status s = tp::GatherChecks(pre, m, kRows, a.num_comm_sms); !s.ok()) return s;
  if (k == 0 || n == 0) {  // pk_jax/ops/ag_gemm.py never sends these (ag_gemm.cu says why)
    return Status::Invalid(pre + "K and N must be positive.");
  }
  if (a.blockwise && mp % 4 != 0) {
    // NOTES: each rank's columns of xs_full [KB, M] start at rank Mp floats, and the scales
    // move in 16-byte bulk copies; Python routes other shapes to the serial form.
    return Status::Invalid(pre + "blockwise scaling needs each rank's rows, M/P, to be a "
                                 "multiple of 4.");
  }
  if (Status s = tp::WorkspaceCheck(op, WorkspaceNeed(kOpAgGemmFp8, a, c.world),
                                    v.workspace_bytes);
      !s.ok()) {
    return s;
  }
  const uint32_t bn = a.config == op_table::kTile128x256 ? 256 : 128;
  const int64_t kb = (k + 127) / 128;
  pk::ag_gemm_fp8::globals g;
  std::memset(&g, 0, sizeof(g));
  g.m = static_cast<int>(m);
  g.n = static_cast<int>(n);
  g.k = static_cast<int>(k);
  g.group_m = static_cast<int>(a.group_m < 1 ? 1 : (a.group_m > 1024 ? 1024 : a.group_m));
  g.bound = c.bound();
  g.x_scale = a.x_scale;
  g.w_scale = a.w_scale;
  const struct {
    const void* ptr;
    uint64_t rows, cols;
    uint32_t box_rows, box_cols;
    int type;
    CUtensorMap* out;
  } maps[] = {
      {a.x_full, uint64_t(m), uint64_t(k), kRows, 128, kMapFp8, &g.x},
      {a.x, uint64_t(mp), uint64_t(k), kRows, 128, kMapFp8, &g.xl},
      {a.w, uint64_t(n), uint64_t(k), bn, 128, kMapFp8, &g.w},
      {a.y, uint64_t(m), uint64_t(n), 64, 64, kMapBF16, &g.y},
  };
  for (const auto& mm : maps) {
    if (Status s = TensorMap(op, {mm.ptr, mm.rows, mm.cols, mm.box_rows, mm.box_cols, mm.type},
                             mm.out);
        !s.ok()) {
      return s;
    }
  }
  if (a.blockwise) {
    namespace fl = pk::fp8_layout;
    const struct {
      const void* ptr;
      uint64_t cols;
      uint32_t box;
      CUtensorMap* out;
    } scale_maps[] = {
        {a.xs_full, uint64_t(m), fl::X_SCALE_BOX, &g.xs},
        {a.x_scale, uint64_t(a.xs_cols), fl::X_SCALE_BOX, &g.xsl},
        {a.w_scale, uint64_t(a.ws_cols), fl::W_SCALE_BOX, &g.ws},
    };
    for (const auto& sm : scale_maps) {
      if (Status s = TensorMap(op, {sm.ptr, uint64_t(kb), sm.cols, 1, sm.box, kMapF32Plain},
                               sm.out);
          !s.ok()) {
        return s;
      }
    }
  }
  g.c = c;
  g.x_local = a.x;
  g.x_full = a.x_full;
  g.xs_full = a.xs_full;
  g.scale_off = (uint64_t(mp) * uint64_t(k) + 15) / 16 * 16;  // WorkspaceNeed's layout
  g.xs_ld = static_cast<int>(a.xs_cols);
  tp::PlaceGather(&g, c.rank, mp, m, kRows);
  const int comm_blocks = static_cast<int>(a.num_comm_sms);
  if (Status s = tp::StartEpoch(at.stream, c); !s.ok()) return s;
  return CudaStatus(tp::WithConfigFp8(a, [&](auto cfg) {
                      return pk::ag_gemm_fp8::launch<decltype(cfg)>(g, at.stream, at.device,
                                                                    at.num_sms, comm_blocks);
                    }),
                    op);
}

namespace {

ffi::Error AgGemmFp8Cuda(cudaStream_t stream, int32_t device, CommState* state,
                         ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> x_scale,
                         ffi::Buffer<ffi::F32> w_scale, ffi::Buffer<ffi::S32> rank,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> x_full,
                         ffi::Result<ffi::Buffer<ffi::F32>> xs_full, int64_t /*comm_id*/,
                         int64_t config, int64_t group_m, int64_t num_comm_sms) {
  ffi::AnyBuffer full = *x_full;
  ffi::Buffer<ffi::F32> scales = *xs_full;
  return tp::RunGemmFp8("all_gather_gemm_fp8", kOpAgGemmFp8, LaunchAgGemmFp8, stream, device,
                        state, x, w, x_scale, w_scale, rank, *y, config, group_m, &full,
                        &scales, num_comm_sms);
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAgGemmFp8, pk_ffi::AgGemmFp8Cuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()                     // x [M/P, K]
                                  .Arg<xla::ffi::AnyBuffer>()                     // wt [N, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // x_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()         // w_scale
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                     // y [M, N]
                                  .Ret<xla::ffi::AnyBuffer>()                     // x_full [M, K]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()         // xs_full
                                  .Attr<int64_t>("comm_id")                       // comm_id
                                  .Attr<int64_t>("config")                        // tile config
                                  .Attr<int64_t>("group_m")        // block-rows per band
                                  .Attr<int64_t>("num_comm_sms"),  // communication blocks
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpAgGemmFp8, "CUDA", PkAgGemmFp8);
