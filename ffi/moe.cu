// FFI handlers and launchers of pk_moe_dispatch, pk_moe_scatter and pk_moe_combine: expert-
// parallel token dispatch, its per-slot form (the combine's transpose) and the weighted combine
// (see cuda/kernels/moe.cuh); and of the fused forms pk_moe_dispatch_gemm and
// pk_moe_gemm_combine (cuda/kernels/moe_dispatch_gemm.cuh, moe_gemm_combine.cuh; work in
// progress). Launch on XLA's stream; no host synchronisation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <initializer_list>
#include <string>

#include "comm_state.h"
#include "ffi_util.h"
#include "kernels/moe.cuh"
#include "kernels/moe_dispatch_gemm.cuh"
#include "kernels/moe_gemm_combine.cuh"
#include "launch.h"
#include "tensor_map.h"

namespace pk_ffi {
namespace {

// The kernels' slot range and limits are the op table's (op_table.h).
static_assert(op_table::kMoeSlots.Is(pk::moe::SLOT_BASE, pk::moe::OP_SLOTS),
              "kernels/moe.cuh's slot range must be op_table.h's");
static_assert(pk::moe::MAX_PEERS == op_table::kMaxPeers &&
                  pk::moe::MAX_EXPERTS == op_table::kMaxExperts &&
                  pk::moe::MAX_K == op_table::kMaxSlotsPerToken &&
                  pk::moe::MAX_COUNTS == op_table::kMoeMaxCounts &&
                  pk::moe::MAX_FUSED_COUNTS == op_table::kMoeMaxFusedCounts,
              "kernels/moe.cuh's limits must be op_table.h's");

Status Invalid(const char* op, const std::string& what) {
  return Status::Invalid(std::string("pk.") + op + ": " + what);
}

// The kernels' view of `v` (pads offset to the moe slot range), after the checks every rank
// makes alike (they depend on the communicator's world and the call's shapes only).
Status MoeComm(const char* op, int op_id, const CommView& v, const int32_t* rank,
               pk::moe::comm* c) {
  if (Status s = CheckRecord(op, v); !s.ok()) return s;
  if (v.signal_count < op_table::kMoeSlots.end()) {
    return Invalid(op, "the signal pad has " + std::to_string(v.signal_count) +
                           " slots, the MoE kernels need " +
                           std::to_string(op_table::kMoeSlots.end()));
  }
  if (v.world > pk::moe::MAX_PEERS) {
    return Invalid(op, "at most " + std::to_string(pk::moe::MAX_PEERS) + " ranks");
  }
  *c = pk::moe::comm{};
  for (int p = 0; p < v.world; ++p) {
    c->ws[p] = v.workspace[p];
    c->sig[p] = v.signals[p] + op_table::kMoeSlots.base;
  }
  c->error = v.error;
  c->timeout_ns = v.timeout_ns;
  c->world = v.world;
  c->rank = v.rank;
  c->op = op_id;
  c->rank_ptr = rank;
  c->link = pk::link_throttle{v.link_clock, v.link_ps_per_kib};  // off unless emulated
  return Status::Ok();
}

// Shape checks shared by the MoE launchers: k slots, capacity, and the call's workspace `need`
// (launch.h WorkspaceNeed), which the message explains as `what`.
Status CheckRows(const char* op, const CommView& v, int64_t t, int64_t k, int64_t capacity,
                 uint64_t need, const char* what) {
  if (k < 1 || k > pk::moe::MAX_K) {
    return Invalid(op, "k (slots per token) must be in [1, " + std::to_string(pk::moe::MAX_K) +
                           "], got " + std::to_string(k));
  }
  if (t < 0 || capacity < 1 || capacity > INT32_MAX || t * k * v.world > INT32_MAX) {
    return Invalid(op, "T k P and capacity must be below 2^31 (capacity at least 1)");
  }
  if (need > v.workspace_bytes) {
    return Invalid(op, "the symmetric workspace has " + std::to_string(v.workspace_bytes) +
                           " bytes and this call needs " + std::to_string(need) + " (" + what +
                           "); call pk.init(mesh, workspace_bytes=...) with at least that.");
  }
  return Status::Ok();
}

// Largest vector unit (16, 8, 4, 2 bytes, at least `min_bytes`) dividing the row and every
// pointer. NOTES: it may differ between ranks (XLA's buffer alignment); no grid depends on it.
int UnitBytes(int64_t row_bytes, int min_bytes, std::initializer_list<const void*> ptrs) {
  for (int u : {16, 8, 4, 2}) {
    if (u < min_bytes) break;
    bool ok = row_bytes % u == 0;
    for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % u == 0;
    if (ok) return u;
  }
  return 0;
}

template <class F>
cudaError_t WithUnit(int unit, F&& f) {
  switch (unit) {
    case 16: return f(uint4{});
    case 8: return f(uint2{});
    case 4: return f(0u);
    default: return f(static_cast<unsigned short>(0));
  }
}

}  // namespace

Status LaunchMoeDispatch(const Where& at, const MoeDispatchArgs& a, const CommView& v) {
  const char* op = "moe_dispatch";
  pk::moe::comm c;
  if (Status s = MoeComm(op, kOpMoeDispatch, v, a.rank, &c); !s.ok()) return s;
  const int P = v.world;
  const int64_t E = a.num_experts;
  const bool routes = a.mode == 0;  // the count exchange bounds E; the scatter has none
  if (E < 1 || E % P != 0 ||
      (routes && (E > pk::moe::MAX_EXPERTS || uint64_t(P) * E > pk::moe::MAX_COUNTS))) {
    return Invalid(op, "num_experts must be divisible by P, at most " +
                           std::to_string(pk::moe::MAX_EXPERTS) + ", and P x num_experts at most " +
                           std::to_string(pk::moe::MAX_COUNTS) + "; got " + std::to_string(E));
  }
  if (a.mode != 0 && a.mode != 1) return Invalid(op, "unknown mode " + std::to_string(a.mode));
  const int64_t row_bytes = a.h * ByteWidth(a.dtype);
  if (Status s = CheckRows(op, v, a.t, a.k, a.capacity, WorkspaceNeed(kOpMoeDispatch, a, P),
                           "capacity x row bytes");
      !s.ok()) {
    return s;
  }
  const int unit = UnitBytes(row_bytes, 2, {a.x, a.tokens});
  if (unit == 0) return Invalid(op, "rows and buffers must be 2-byte aligned");

  pk::moe::dispatch_args g{};
  g.c = c;
  g.ids = a.ids;
  g.x = a.x;
  g.dest = a.dest;
  g.pos = a.pos;
  g.dropped = a.dropped;
  g.recv_dropped = a.recv_dropped;
  g.group_sizes = a.group_sizes;
  g.tokens = a.tokens;
  g.T = a.t;
  g.capacity = a.capacity;
  g.row_bytes = row_bytes;
  g.k = static_cast<int32_t>(a.k);
  g.E = static_cast<int32_t>(E);
  g.EL = static_cast<int32_t>(E / P);
  g.per_slot = a.mode == 1 ? 1 : 0;
  g.push_grid = pk::moe::items_grid(a.mode == 1 ? a.t * a.k : a.t);

  // Every check is done: from here on the call runs on every rank (epochs stay in step).
  if (a.mode == 0) {
    const void* fn = reinterpret_cast<const void*>(&pk::moe::route_kernel);
    if (Status s = CudaStatus(pk::opt_in_smem(fn, at.device, pk::moe::ROUTE_SMEM_MAX),
                              "moe_dispatch (shared memory)");
        !s.ok()) {
      return s;
    }
    pk::moe::route_kernel<<<1, pk::moe::THREADS, pk::moe::route_smem(P, g.E), at.stream>>>(g);
  } else {
    pk::moe::enter_kernel<<<1, pk::WARP_THREADS, 0, at.stream>>>(c, pk::moe::EPOCH_D,
                                                                  pk::moe::ENTER_D);
  }
  if (Status s = CudaStatus(cudaGetLastError(), "moe_dispatch (route)"); !s.ok()) return s;
  const int recv_grid = pk::moe::bytes_grid(uint64_t(a.capacity) * row_bytes);
  const cudaError_t err = WithUnit(unit, [&](auto u) {
    using U = decltype(u);
    pk::moe::push_kernel<U><<<g.push_grid, pk::moe::THREADS, 0, at.stream>>>(g);
    pk::moe::receive_kernel<U><<<recv_grid, pk::moe::THREADS, 0, at.stream>>>(g);
    return cudaGetLastError();
  });
  return CudaStatus(err, "moe_dispatch (push, receive)");
}

Status LaunchMoeCombine(const Where& at, const MoeCombineArgs& a, const CommView& v) {
  const char* op = "moe_combine";
  pk::moe::comm c;
  if (Status s = MoeComm(op, kOpMoeCombine, v, a.rank, &c); !s.ok()) return s;
  if (a.dtype == DType::kS32) return Invalid(op, "y must be bf16, fp16 or fp32");
  if (a.mode != 0 && a.mode != 1) return Invalid(op, "unknown mode " + std::to_string(a.mode));
  const int esize = ByteWidth(a.dtype);
  const int64_t row_bytes = a.h * esize;
  if (Status s = CheckRows(op, v, a.t, a.k, a.capacity, WorkspaceNeed(kOpMoeCombine, a, v.world),
                           "capacity x row bytes");
      !s.ok()) {
    return s;
  }
  const int unit = UnitBytes(row_bytes, esize, {a.y, a.out});
  if (unit == 0) return Invalid(op, "rows and buffers must be aligned to the element size");

  pk::moe::combine_args g{};
  g.c = c;
  g.y = a.y;
  g.weights = a.weights;
  g.dest = a.dest;
  g.pos = a.pos;
  g.out = a.out;
  g.T = a.t;
  g.capacity = a.capacity;
  g.row_bytes = row_bytes;
  g.k = static_cast<int32_t>(a.k);
  g.gather = a.mode == 1 ? 1 : 0;
  g.stage_grid = pk::moe::bytes_grid(uint64_t(a.capacity) * row_bytes);
  g.pull_grid = pk::moe::items_grid(a.t);

  pk::moe::enter_kernel<<<1, pk::WARP_THREADS, 0, at.stream>>>(c, pk::moe::EPOCH_C,
                                                                pk::moe::ENTER_C);
  if (Status s = CudaStatus(cudaGetLastError(), "moe_combine (enter)"); !s.ok()) return s;
  auto run = [&](auto elem) {
    using T = decltype(elem);
    return WithUnit(unit, [&](auto u) {
      using U = decltype(u);
      if constexpr (sizeof(U) < sizeof(T)) {
        return cudaErrorInvalidValue;  // excluded by UnitBytes' minimum
      } else {
        pk::moe::stage_kernel<U><<<g.stage_grid, pk::moe::THREADS, 0, at.stream>>>(g);
        pk::moe::pull_kernel<T, U><<<g.pull_grid, pk::moe::THREADS, 0, at.stream>>>(g);
        pk::moe::leave_kernel<<<1, pk::moe::THREADS, 0, at.stream>>>(g);
        return cudaGetLastError();
      }
    });
  };
  const cudaError_t err = a.dtype == DType::kBF16  ? run(__nv_bfloat16{})
                          : a.dtype == DType::kF16 ? run(__half{})
                                                   : run(0.f);
  return CudaStatus(err, "moe_combine (stage, pull, leave)");
}

namespace {

// A 128B-swizzled map over w [depth, rows, cols] (2-byte elements), box {64, box_rows, 1}: as
// ffi/grouped_matmul.cu encodes it for the grouped GEMM's FWD mode.
Status WeightMap(const void* ptr, uint64_t depth, uint64_t rows, uint64_t cols, int dtype,
                 CUtensorMap* out) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = EncodeFn();
  if (encode == nullptr) return Status::Internal("cuTensorMapEncodeTiled is not available");
  const cuuint64_t dims[3] = {cols, rows, depth};
  const cuuint64_t strides[2] = {cols * 2, rows * cols * 2};
  const cuuint32_t box[3] = {64, 64, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(out,
                            dtype == 0 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                            3, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal("pk.moe_dispatch_gemm: cuTensorMapEncodeTiled (w) failed with " +
                            std::to_string(static_cast<int>(r)));
  }
  return Status::Ok();
}

}  // namespace

Status LaunchMoeDispatchGemm(const Where& at, const MoeDispatchGemmArgs& a, const CommView& v) {
  const char* op = "moe_dispatch_gemm";
  namespace gm = pk::grouped_matmul;
  pk::moe::comm c;
  if (Status s = MoeComm(op, kOpMoeDispatch, v, a.rank, &c); !s.ok()) return s;
  const int P = v.world;
  const int64_t E = a.num_experts;
  if (E < 1 || E % P != 0 || E > pk::moe::MAX_EXPERTS ||
      uint64_t(P) * E > pk::moe::MAX_FUSED_COUNTS || E / P > gm::MAX_GROUPS) {
    return Invalid(op, "num_experts must be divisible by P, at most " +
                           std::to_string(pk::moe::MAX_EXPERTS) + ", and P x num_experts at most " +
                           std::to_string(pk::moe::MAX_FUSED_COUNTS) + "; got " +
                           std::to_string(E));
  }
  if (a.dtype != DType::kBF16 && a.dtype != DType::kF16) return Invalid(op, "bf16 or fp16");
  if (a.h % 8 != 0 || a.n % 8 != 0 || a.h < 8 || a.n < 8 || a.n > INT32_MAX) {
    return Invalid(op, "H and N must be multiples of 8 (16-byte rows)");
  }
  const int64_t row_bytes = a.h * 2;
  if (Status s = CheckRows(op, v, a.t, a.k, a.capacity, WorkspaceNeed(kOpMoeDispatchGemm, a, P),
                           "capacity x row bytes");
      !s.ok()) {
    return s;
  }
  // NOTES: XLA's buffers are at least 16-byte aligned, so every rank takes the same branch.
  if (reinterpret_cast<uintptr_t>(a.x) % 16 != 0) return Invalid(op, "x must be 16-byte aligned");
  const int type = a.dtype == DType::kBF16 ? 0 : 1;
  const int EL = static_cast<int>(E / P);

  gm::globals g{};
  g.y = a.y;
  g.group_sizes = a.group_sizes;
  g.m = static_cast<int>(a.capacity);
  g.n = static_cast<int>(a.n);
  g.k = static_cast<int>(a.h);
  g.groups = EL;
  g.group_m = 8;
  if (Status s = TensorMap(op, {v.workspace[v.rank], uint64_t(a.capacity), uint64_t(a.h), 128,
                                64, type},
                           &g.a);
      !s.ok()) {
    return s;
  }
  if (Status s = WeightMap(a.w, EL, a.h, a.n, type, &g.b); !s.ok()) return s;
  if (Status s = TensorMap(op, {a.y, uint64_t(a.capacity), uint64_t(a.n), 64, 64, type}, &g.out);
      !s.ok()) {
    return s;
  }

  pk::moe::dispatch_args r{};
  r.c = c;
  r.ids = a.ids;
  r.x = a.x;
  r.dest = a.dest;
  r.pos = a.pos;
  r.dropped = a.dropped;
  r.recv_dropped = a.recv_dropped;
  r.group_sizes = a.group_sizes;
  r.order = a.order;
  r.order_off = a.order_off;
  r.T = a.t;
  r.capacity = a.capacity;
  r.row_bytes = row_bytes;
  r.k = static_cast<int32_t>(a.k);
  r.E = static_cast<int32_t>(E);
  r.EL = EL;

  pk::moe::fused_args f{};
  f.c = c;
  f.x = a.x;
  f.dest = a.dest;
  f.pos = a.pos;
  f.order = a.order;
  f.order_off = a.order_off;
  f.capacity = a.capacity;
  f.row_bytes = row_bytes;
  f.k = static_cast<int32_t>(a.k);
  f.E = static_cast<int32_t>(E);
  f.EL = EL;
  // The comm blocks join the GEMM once they have pushed, so a comm block costs the GEMM only
  // while it pushes. With one local expert the GEMM waits for every row anyway: push on half
  // the SMs. Otherwise the GEMM runs under the push: an eighth. Each was the best of 2, 4 and 8
  // comm blocks at emulated P = 8 on the H200, 16 SMs per rank (Mixtral-like with one local
  // expert, DeepSeek-V3-like with 32; measured: bench/results/moe_notes.md, "Measurements moved
  // from code comments (issue 37)").
  const int auto_comm = EL == 1 ? at.num_sms / 2 : at.num_sms / 8;
  int comm = static_cast<int>(a.num_comm_sms > 0 ? a.num_comm_sms : auto_comm);
  comm = comm < 1 ? 1 : (comm > E ? static_cast<int>(E) : comm);
  if (comm >= at.num_sms) comm = at.num_sms > 1 ? at.num_sms - 1 : 1;
  f.comm_blocks = comm;
  const int64_t max_tiles = ((a.capacity + 127) / 128 + EL) * ((a.n + 255) / 256);
  int gemm_blocks = at.num_sms - comm;
  if (gemm_blocks < 1) gemm_blocks = 1;
  if (max_tiles < gemm_blocks) gemm_blocks = static_cast<int>(max_tiles < 1 ? 1 : max_tiles);

  // Every check is done: from here on the call runs on every rank (epochs stay in step).
  const void* fn = reinterpret_cast<const void*>(&pk::moe::route_kernel);
  if (Status s = CudaStatus(pk::opt_in_smem(fn, at.device, pk::moe::ROUTE_SMEM_MAX),
                            "moe_dispatch_gemm (shared memory)");
      !s.ok()) {
    return s;
  }
  pk::moe::route_kernel<<<1, pk::moe::THREADS, pk::moe::route_smem(P, r.E), at.stream>>>(r);
  if (Status s = CudaStatus(cudaGetLastError(), "moe_dispatch_gemm (route)"); !s.ok()) return s;
  const cudaError_t err =
      type == 0
          ? pk::moe::launch_dispatch_gemm<gm::config<__nv_bfloat16, gm::FWD>>(g, f, at.stream,
                                                                              at.device,
                                                                              gemm_blocks)
          : pk::moe::launch_dispatch_gemm<gm::config<__half, gm::FWD>>(g, f, at.stream,
                                                                       at.device, gemm_blocks);
  return CudaStatus(err, "moe_dispatch_gemm (fused)");
}

Status LaunchMoeGemmCombine(const Where& at, const MoeGemmCombineArgs& a, const CommView& v) {
  const char* op = "moe_gemm_combine";
  namespace gm = pk::grouped_matmul;
  pk::moe::comm c;
  if (Status s = MoeComm(op, kOpMoeGemmCombine, v, a.rank, &c); !s.ok()) return s;
  if (a.dtype != DType::kBF16 && a.dtype != DType::kF16) return Invalid(op, "bf16 or fp16");
  if (a.groups < 1 || a.groups > gm::MAX_GROUPS) {
    return Invalid(op, "E / P must be in [1, " + std::to_string(gm::MAX_GROUPS) + "]");
  }
  if (a.f % 8 != 0 || a.n % 8 != 0 || a.f < 8 || a.n < 8 || a.n > INT32_MAX ||
      a.f > INT32_MAX) {
    return Invalid(op, "F and H must be multiples of 8 (16-byte rows)");
  }
  const int64_t row_bytes = a.n * 2;
  const uint64_t need = WorkspaceNeed(kOpMoeGemmCombine, a, v.world);
  if (Status s = CheckRows(op, v, a.t, a.k, a.capacity, need,
                           "T k x H x 2 for the slot rows + capacity x 8");
      !s.ok()) {
    return s;
  }
  // Workspace: T k slot rows of H, then the inverse map (C x 8 bytes) 256-byte aligned.
  const uint64_t inv_off = (uint64_t(a.t) * a.k * row_bytes + 255) / 256 * 256;
  const int type = a.dtype == DType::kBF16 ? 0 : 1;

  gm::globals g{};
  g.y = nullptr;
  g.group_sizes = a.group_sizes;
  g.m = static_cast<int>(a.capacity);
  g.n = static_cast<int>(a.n);
  g.k = static_cast<int>(a.f);
  g.groups = static_cast<int>(a.groups);
  g.group_m = 8;
  if (Status s = TensorMap(op, {a.h, uint64_t(a.capacity), uint64_t(a.f), 128, 64, type}, &g.a);
      !s.ok()) {
    return s;
  }
  if (Status s = WeightMap(a.w, a.groups, a.f, a.n, type, &g.b); !s.ok()) return s;

  pk::moe::gemm_combine_args f{};
  f.c = c;
  f.weights = a.weights;
  f.dest = a.dest;
  f.pos = a.pos;
  f.out = a.out;
  f.T = a.t;
  f.capacity = a.capacity;
  f.row_bytes = row_bytes;
  f.inv_off = static_cast<int64_t>(inv_off);
  f.k = static_cast<int32_t>(a.k);
  constexpr int64_t kBn = gm::config<__nv_bfloat16, gm::FWD>::BN;  // both dtypes' tile width
  static_assert(kBn == gm::config<__half, gm::FWD>::BN);
  f.tiles_n = static_cast<int32_t>((a.n + kBn - 1) / kBn);
  f.inv_grid = pk::moe::items_grid(a.t);
  const int64_t max_tiles = ((a.capacity + 127) / 128 + a.groups) * f.tiles_n;
  int gemm_blocks = at.num_sms;
  if (max_tiles < gemm_blocks) gemm_blocks = static_cast<int>(max_tiles < 1 ? 1 : max_tiles);
  const int sum_grid = pk::moe::items_grid(a.t);

  // Every check is done: from here on the call runs on every rank (epochs stay in step).
  pk::moe::gc_enter_kernel<<<1, pk::moe::THREADS, 0, at.stream>>>(f);
  pk::moe::gc_invert_kernel<<<f.inv_grid, pk::moe::THREADS, 0, at.stream>>>(f);
  if (Status s = CudaStatus(cudaGetLastError(), "moe_gemm_combine (enter, invert)"); !s.ok()) {
    return s;
  }
  cudaError_t err =
      type == 0
          ? pk::moe::launch_gemm_combine<gm::config<__nv_bfloat16, gm::FWD>>(g, f, at.stream,
                                                                             at.device,
                                                                             gemm_blocks)
          : pk::moe::launch_gemm_combine<gm::config<__half, gm::FWD>>(g, f, at.stream, at.device,
                                                                      gemm_blocks);
  if (Status s = CudaStatus(err, "moe_gemm_combine (gemm)"); !s.ok()) return s;
  if (type == 0) {
    pk::moe::gc_sum_kernel<__nv_bfloat16><<<sum_grid, pk::moe::THREADS, 0, at.stream>>>(f);
  } else {
    pk::moe::gc_sum_kernel<__half><<<sum_grid, pk::moe::THREADS, 0, at.stream>>>(f);
  }
  return CudaStatus(cudaGetLastError(), "moe_gemm_combine (sum)");
}

namespace {

bool Is2d(const ffi::AnyBuffer& b) { return b.dimensions().size() == 2; }

ffi::Error DispatchCuda(cudaStream_t stream, int32_t device, CommState* state,
                        ffi::AnyBuffer x,
                        ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> rank,
                        ffi::Result<ffi::AnyBuffer> tokens,
                        ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                        ffi::Result<ffi::Buffer<ffi::S32>> dest,
                        ffi::Result<ffi::Buffer<ffi::S32>> pos,
                        ffi::Result<ffi::Buffer<ffi::S32>> dropped,
                        ffi::Result<ffi::Buffer<ffi::S32>> recv_dropped, int64_t /*comm_id*/,
                        int64_t num_experts, int64_t capacity) {
  const CommView* v = nullptr;
  int num_sms = 0;
  if (ffi::Error e = BindComm("moe_dispatch", state, device, &v, &num_sms); e.failure()) return e;
  MoeDispatchArgs a{};
  MarkFields(kOpMoeDispatch, &a);
  const auto id = ids.dimensions();
  if (!ToDType(x.element_type(), &a.dtype) || tokens->element_type() != x.element_type() ||
      !Is2d(x) || id.size() != 2 || id[0] != x.dimensions()[0] || !Is2d(*tokens) ||
      tokens->dimensions()[0] != capacity || tokens->dimensions()[1] != x.dimensions()[1] ||
      pos->element_count() != ids.element_count() ||
      dest->element_count() != ids.element_count() ||
      group_sizes->element_count() * v->world != num_experts) {
    return ffi::Error::InvalidArgument(
        "pk.moe_dispatch: expected x [T, H], ids [T, k], tokens [capacity, H] of x's dtype, "
        "dest/pos [T, k] and group_sizes [E / P]");
  }
  a.x = x.untyped_data();
  a.ids = ids.typed_data();
  a.rank = rank.typed_data();
  a.dest = dest->typed_data();
  a.pos = pos->typed_data();
  a.dropped = dropped->typed_data();
  a.recv_dropped = recv_dropped->typed_data();
  a.group_sizes = group_sizes->typed_data();
  a.tokens = tokens->untyped_data();
  a.t = id[0];
  a.k = id[1];
  a.h = x.dimensions()[1];
  a.num_experts = num_experts;
  a.capacity = capacity;
  a.mode = 0;
  if (ffi::Error e = CheckFilled(kOpMoeDispatch, a); e.failure()) return e;
  return ToError(LaunchMoeDispatch(Where{stream, device, num_sms}, a, *v));
}

ffi::Error ScatterCuda(cudaStream_t stream, int32_t device, CommState* state,
                       ffi::AnyBuffer rows,
                       ffi::Buffer<ffi::S32> dest, ffi::Buffer<ffi::S32> pos,
                       ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S32> rank,
                       ffi::Result<ffi::AnyBuffer> tokens, int64_t /*comm_id*/, int64_t num_experts,
                       int64_t capacity) {
  const CommView* v = nullptr;
  int num_sms = 0;
  if (ffi::Error e = BindComm("moe_dispatch", state, device, &v, &num_sms); e.failure()) return e;
  MoeDispatchArgs a{};
  MarkFields(kOpMoeScatter, &a);
  const auto dd = dest.dimensions();
  if (!ToDType(rows.element_type(), &a.dtype) || tokens->element_type() != rows.element_type() ||
      !Is2d(rows) || dd.size() != 2 || rows.dimensions()[0] != dd[0] * dd[1] ||
      pos.element_count() != dest.element_count() || !Is2d(*tokens) ||
      tokens->dimensions()[0] != capacity || tokens->dimensions()[1] != rows.dimensions()[1] ||
      group_sizes.element_count() * v->world != num_experts) {
    return ffi::Error::InvalidArgument(
        "pk.moe_dispatch (transpose): expected rows [T k, H], dest/pos [T, k], group_sizes "
        "[E / P] and tokens [capacity, H] of the rows' dtype");
  }
  a.x = rows.untyped_data();
  a.rank = rank.typed_data();
  a.dest = const_cast<int32_t*>(dest.typed_data());  // read only in scatter mode
  a.pos = const_cast<int32_t*>(pos.typed_data());
  a.group_sizes = const_cast<int32_t*>(group_sizes.typed_data());
  a.tokens = tokens->untyped_data();
  a.t = dd[0];
  a.k = dd[1];
  a.h = rows.dimensions()[1];
  a.num_experts = num_experts;
  a.capacity = capacity;
  a.mode = 1;
  if (ffi::Error e = CheckFilled(kOpMoeScatter, a); e.failure()) return e;
  return ToError(LaunchMoeDispatch(Where{stream, device, num_sms}, a, *v));
}

ffi::Error CombineCuda(cudaStream_t stream, int32_t device, CommState* state,
                       ffi::AnyBuffer y,
                       ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> dest,
                       ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> rank,
                       ffi::Result<ffi::AnyBuffer> out, int64_t /*comm_id*/, int64_t mode) {
  const CommView* v = nullptr;
  int num_sms = 0;
  if (ffi::Error e = BindComm("moe_combine", state, device, &v, &num_sms); e.failure()) return e;
  MoeCombineArgs a{};
  MarkFields(kOpMoeCombine, &a);
  const auto dd = dest.dimensions();
  const int64_t out_rows = dd.size() == 2 ? (mode == 1 ? dd[0] * dd[1] : dd[0]) : -1;
  if (!ToDType(y.element_type(), &a.dtype) || out->element_type() != y.element_type() ||
      !Is2d(y) || dd.size() != 2 || pos.element_count() != dest.element_count() ||
      weights.element_count() != dest.element_count() || !Is2d(*out) ||
      out->dimensions()[0] != out_rows || out->dimensions()[1] != y.dimensions()[1]) {
    return ffi::Error::InvalidArgument(
        "pk.moe_combine: expected y [capacity, H], weights/dest/pos [T, k] and out [T, H] "
        "([T k, H] when gathering) of y's dtype");
  }
  a.y = y.untyped_data();
  a.weights = weights.typed_data();
  a.dest = dest.typed_data();
  a.pos = pos.typed_data();
  a.rank = rank.typed_data();
  a.out = out->untyped_data();
  a.t = dd[0];
  a.k = dd[1];
  a.h = y.dimensions()[1];
  a.capacity = y.dimensions()[0];
  a.mode = mode;
  if (ffi::Error e = CheckFilled(kOpMoeCombine, a); e.failure()) return e;
  return ToError(LaunchMoeCombine(Where{stream, device, num_sms}, a, *v));
}

ffi::Error DispatchGemmCuda(cudaStream_t stream, int32_t device, CommState* state,
                            ffi::AnyBuffer x,
                            ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                            ffi::Result<ffi::Buffer<ffi::S32>> dest,
                            ffi::Result<ffi::Buffer<ffi::S32>> pos,
                            ffi::Result<ffi::Buffer<ffi::S32>> dropped,
                            ffi::Result<ffi::Buffer<ffi::S32>> recv_dropped,
                            ffi::Result<ffi::Buffer<ffi::S32>> order,
                            ffi::Result<ffi::Buffer<ffi::S32>> order_off, int64_t /*comm_id*/,
                            int64_t num_experts, int64_t capacity) {
  const CommView* v = nullptr;
  int num_sms = 0;
  if (ffi::Error e = BindComm("moe_dispatch_gemm", state, device, &v, &num_sms); e.failure()) {
    return e;
  }
  MoeDispatchGemmArgs a{};
  MarkFields(kOpMoeDispatchGemm, &a);
  const auto id = ids.dimensions();
  const auto wd = w.dimensions();
  if (!ToDType(x.element_type(), &a.dtype) || w.element_type() != x.element_type() ||
      y->element_type() != x.element_type() || !Is2d(x) || id.size() != 2 ||
      id[0] != x.dimensions()[0] || wd.size() != 3 || wd[1] != x.dimensions()[1] ||
      wd[0] * v->world != num_experts || !Is2d(*y) || y->dimensions()[0] != capacity ||
      y->dimensions()[1] != wd[2] || pos->element_count() != ids.element_count() ||
      dest->element_count() != ids.element_count() ||
      order->element_count() != ids.element_count() ||
      order_off->element_count() != num_experts + 1 ||
      group_sizes->element_count() * v->world != num_experts) {
    return ffi::Error::InvalidArgument(
        "pk.moe_dispatch_gemm: expected x [T, H], ids [T, k], w1 [E / P, H, N] and y "
        "[capacity, N] of x's dtype, dest/pos/order [T, k], order_off [E + 1], group_sizes "
        "[E / P]");
  }
  a.x = x.untyped_data();
  a.ids = ids.typed_data();
  a.w = w.untyped_data();
  a.rank = rank.typed_data();
  a.dest = dest->typed_data();
  a.pos = pos->typed_data();
  a.dropped = dropped->typed_data();
  a.recv_dropped = recv_dropped->typed_data();
  a.group_sizes = group_sizes->typed_data();
  a.y = y->untyped_data();
  a.order = order->typed_data();
  a.order_off = order_off->typed_data();
  a.t = id[0];
  a.k = id[1];
  a.h = x.dimensions()[1];
  a.n = wd[2];
  a.num_experts = num_experts;
  a.capacity = capacity;
  if (ffi::Error e = CheckFilled(kOpMoeDispatchGemm, a); e.failure()) return e;
  return ToError(LaunchMoeDispatchGemm(Where{stream, device, num_sms}, a, *v));
}

ffi::Error GemmCombineCuda(cudaStream_t stream, int32_t device, CommState* state,
                           ffi::AnyBuffer h,
                           ffi::AnyBuffer w, ffi::Buffer<ffi::F32> weights,
                           ffi::Buffer<ffi::S32> dest, ffi::Buffer<ffi::S32> pos,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S32> rank,
                           ffi::Result<ffi::AnyBuffer> out, int64_t /*comm_id*/) {
  const CommView* v = nullptr;
  int num_sms = 0;
  if (ffi::Error e = BindComm("moe_gemm_combine", state, device, &v, &num_sms); e.failure()) {
    return e;
  }
  MoeGemmCombineArgs a{};
  MarkFields(kOpMoeGemmCombine, &a);
  const auto dd = dest.dimensions();
  const auto wd = w.dimensions();
  if (!ToDType(h.element_type(), &a.dtype) || w.element_type() != h.element_type() ||
      out->element_type() != h.element_type() || !Is2d(h) || wd.size() != 3 ||
      wd[1] != h.dimensions()[1] || dd.size() != 2 || pos.element_count() != dest.element_count() ||
      weights.element_count() != dest.element_count() ||
      group_sizes.element_count() != wd[0] || !Is2d(*out) || out->dimensions()[0] != dd[0] ||
      out->dimensions()[1] != wd[2]) {
    return ffi::Error::InvalidArgument(
        "pk.moe_gemm_combine: expected h [capacity, F], w2 [E / P, F, H] and out [T, H] of h's "
        "dtype, weights/dest/pos [T, k] and group_sizes [E / P]");
  }
  a.h = h.untyped_data();
  a.w = w.untyped_data();
  a.weights = weights.typed_data();
  a.dest = dest.typed_data();
  a.pos = pos.typed_data();
  a.group_sizes = group_sizes.typed_data();
  a.rank = rank.typed_data();
  a.out = out->untyped_data();
  a.t = dd[0];
  a.k = dd[1];
  a.f = h.dimensions()[1];
  a.n = wd[2];
  a.groups = wd[0];
  a.capacity = h.dimensions()[0];
  if (ffi::Error e = CheckFilled(kOpMoeGemmCombine, a); e.failure()) return e;
  return ToError(LaunchMoeGemmCombine(Where{stream, device, num_sms}, a, *v));
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkMoeDispatchGemm, pk_ffi::DispatchGemmCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()                     // x [T, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids [T, k]
                                  .Arg<xla::ffi::AnyBuffer>()                  // w1 [EL, H, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                  // y [C, N]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // group_sizes
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // dest [T, k]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // pos [T, k]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // dropped [1]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // recv_dropped
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // order (scratch)
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // order_off
                                  .Attr<int64_t>("comm_id")                    // comm_id
                                  .Attr<int64_t>("num_experts")                // E
                                  .Attr<int64_t>("capacity"),                  // C
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpMoeDispatchGemm, "CUDA", PkMoeDispatchGemm);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkMoeDispatch, pk_ffi::DispatchCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()                     // x [T, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // ids [T, k]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()         // rank
                                  .Ret<xla::ffi::AnyBuffer>()                  // tokens [C, H]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // group_sizes
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // dest [T, k]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // pos [T, k]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // dropped [1]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // recv_dropped
                                  .Attr<int64_t>("comm_id")                    // comm_id
                                  .Attr<int64_t>("num_experts")                // E
                                  .Attr<int64_t>("capacity"),                  // C
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpMoeDispatch, "CUDA", PkMoeDispatch);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkMoeScatter, pk_ffi::ScatterCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()                  // rows [T k, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // dest [T, k]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // pos [T, k]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // group_sizes
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // rank
                                  .Ret<xla::ffi::AnyBuffer>()                  // tokens [C, H]
                                  .Attr<int64_t>("comm_id")                    // comm_id
                                  .Attr<int64_t>("num_experts")                // E
                                  .Attr<int64_t>("capacity"),                  // C
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpMoeScatter, "CUDA", PkMoeScatter);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkMoeCombine, pk_ffi::CombineCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()                  // y [C, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()      // weights [T, k]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // dest [T, k]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // pos [T, k]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // rank
                                  .Ret<xla::ffi::AnyBuffer>()                  // out
                                  .Attr<int64_t>("comm_id")                    // comm_id
                                  .Attr<int64_t>("mode"),   // 0 combine, 1 gather (VJP)
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpMoeCombine, "CUDA", PkMoeCombine);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkMoeGemmCombine, pk_ffi::GemmCombineCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()                  // h [C, F]
                                  .Arg<xla::ffi::AnyBuffer>()                  // w2 [EL, F, H]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()      // weights [T, k]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // dest [T, k]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // pos [T, k]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // group_sizes
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // rank
                                  .Ret<xla::ffi::AnyBuffer>()                  // out [T, H]
                                  .Attr<int64_t>("comm_id"),                   // comm_id
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpMoeGemmCombine, "CUDA", PkMoeGemmCombine);
