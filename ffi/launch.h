// The plain C++ launch functions behind the FFI handlers: Launch<Op>(where, args, comm view).
//
// A handler only binds XLA's buffers and attributes into the op's args, finds its
// communicator, and calls its launch function; the rank emulator (pk_jax.testing, bound in
// module.cc) calls the same function with device buffers it owns, a view of an emulated rank
// and that rank's stream and SM partition. What the emulator proves is therefore what XLA runs.
// Nothing here includes XLA headers: a Status carries the error, and the handler turns it into
// an ffi::Error (ffi_util.h ToError).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>

#include "comm.h"
#include "op_table.h"

namespace pk_ffi {

// DType (the operands' element types) and the op ids: op_table.h.
// Bytes of the 2- and 4-byte types the collectives and MoE ops move (fp8 is matmul_fp8's).
inline int ByteWidth(DType t) { return t == DType::kBF16 || t == DType::kF16 ? 2 : 4; }

// The outcome of a launch function: ok, a bad argument (ValueError in Python) or an internal
// failure (a CUDA error).
struct Status {
  enum Code : int { kOk = 0, kInvalidArgument = 1, kInternal = 2 };
  Code code = kOk;
  std::string message;

  bool ok() const { return code == kOk; }
  static Status Ok() { return {}; }
  static Status Invalid(std::string m) { return {kInvalidArgument, std::move(m)}; }
  static Status Internal(std::string m) { return {kInternal, std::move(m)}; }
};

// The field visitor: each op's arguments, named once, next to its args struct.
//
// VisitFields(visit, op, a) calls, for every field of `a` that op `op` (op_table.h OpId) reads,
// in order:
//   visit(name, field)            a field every call gives;
//   visit(name, field, fallback)  one the rank emulator sets to `fallback` when a launch dict
//                                 leaves it out (XLA's typed attributes have no defaults);
// and guards the fields that only some calls of an op read with `if (visit.When(cond))`
// (attention's backward fields): a visitor that reads, writes or checks a struct follows cond,
// one that lists the names takes every branch. `name` is the field's key in the emulator's
// launch dicts (pk_jax/testing) and in _pk_ffi.op_fields(). A field an op does not name is no
// argument of its calls: it stays value-initialized, or the op itself sets it (the MoE modes),
// in the FFI handlers and in the emulator alike.
//
// Users: the emulator's decoder (emu_decode.h: a launch dict into the struct), the FFI handlers'
// check that they filled every named field (ffi_util.h MarkFields, CheckFilled), and the export
// of the names (module.cc OpFields), which tests/test_op_table.py holds pk_jax/testing's launch
// dicts to.

// Status of a CUDA runtime error, naming the call; Ok for cudaSuccess.
Status CudaStatus(cudaError_t err, const char* what);

struct PeerMaps;  // tensor_map.h

// Where a call runs: the stream, the device ordinal (shared-memory opt-ins are per device) and
// the SMs its persistent grids may use (the device's, or an emulated rank's partition).
// peer_maps: the executable's cache of tensor maps over the peers' workspaces (its FFI state,
// comm_state.h); nullptr (the rank emulator) encodes them through the process-wide cache.
struct Where {
  cudaStream_t stream;
  int device;
  int num_sms;
  PeerMaps* peer_maps = nullptr;
};

// The four collectives. x and y are device buffers of `dtype`; rank points at the int32 rank
// operand on the device (checked against the communicator's rank by the kernel).
struct CollArgs {
  DType dtype;
  const void* x;
  void* y;
  const int32_t* rank;
  int64_t n;      // elements of x
  int64_t n_out;  // elements of y
  int64_t p0;     // all_reduce: algorithm (0 auto, 1 one-shot, 2 two-shot); all_gather and
                  // reduce_scatter: run; all_to_all: split_run
  int64_t p1;     // all_to_all: concat_run
};

template <class V>
void VisitFields(V&& visit, int op, CollArgs& a) {
  visit("dtype", a.dtype);
  visit("x", a.x);
  visit("y", a.y);
  visit("rank", a.rank);
  visit("n", a.n);
  visit("n_out", a.n_out);
  if (op == kOpAllReduce) {
    visit("p0", a.p0, 0);  // 0: the launcher picks the algorithm
  } else {
    visit("p0", a.p0);
  }
  if (op == kOpAllToAll) visit("p1", a.p1);
}

Status LaunchAllReduce(const Where& at, const CollArgs& a, const CommView& v);
Status LaunchAllGather(const Where& at, const CollArgs& a, const CommView& v);
Status LaunchReduceScatter(const Where& at, const CollArgs& a, const CommView& v);
Status LaunchAllToAll(const Where& at, const CollArgs& a, const CommView& v);

// The fused tensor-parallel GEMMs. gemm_rs / gemm_ar: x [M, K], w [K, N], y [M/P or M, N];
// ag_gemm: x [Mp, K], w [K, N], y [P Mp, N], x_full [P Mp, K]. dtype bf16 or fp16.
struct GemmArgs {
  DType dtype;
  const void* x;
  const void* w;
  void* y;
  void* x_full;   // ag_gemm only
  const int32_t* rank;
  int64_t m, k, n;           // x's rows and columns, w's columns
  int64_t y_rows, y_cols;    // y as the caller allocated it (checked)
  int64_t config;            // tile config (op_table.h Tile: kTile128x128 or kTile128x256S3)
  int64_t group_m;           // block-rows per band of the tile order
  int64_t num_comm_sms;      // ag_gemm: communication blocks (the same on every rank)
};

template <class V>
void VisitFields(V&& visit, int op, GemmArgs& a) {
  visit("dtype", a.dtype);
  visit("x", a.x);
  visit("w", a.w);
  visit("y", a.y);
  if (op == kOpAgGemm) visit("x_full", a.x_full);
  if (op != kOpMatmul) visit("rank", a.rank);
  visit("m", a.m);
  visit("k", a.k);
  visit("n", a.n);
  visit("y_rows", a.y_rows);
  visit("y_cols", a.y_cols);
  visit("config", a.config, op_table::kTile128x128);
  visit("group_m", a.group_m, 8);
  if (op == kOpAgGemm) visit("num_comm_sms", a.num_comm_sms);
}

// The local GEMM (no communicator; x [m, k], w [k, n], y [m, n]; config: any op_table.h Tile).
Status LaunchMatmul(const Where& at, const GemmArgs& a);
Status LaunchGemmRs(const Where& at, const GemmArgs& a, const CommView& v);
Status LaunchGemmAr(const Where& at, const GemmArgs& a, const CommView& v);
Status LaunchAgGemm(const Where& at, const GemmArgs& a, const CommView& v);

// The fp8 GEMM (cuda/kernels/matmul_fp8.cuh): y [m, n] (bf16 or fp32) = (x [m, k] * its
// scale) @ (w * its scale), with w given transposed, wt [n, k] (fp8 wgmma reads B K-major).
// Per tensor (blockwise false): x_scale and w_scale are one float each. Blockwise: x_scale is
// x's [m, KB] scales transposed, [KB = ceil(k / 128), xs_cols >= m]; w_scale [KB, ws_cols >=
// ceil(n / 128)]; both row lengths multiples of 4 (TMA's 16-byte strides).
struct MatmulFp8Args {
  DType dtype;    // x's format: kE4M3 or kE5M2
  DType w_dtype;  // w's format
  DType y_dtype;  // kBF16 or kF32
  const void* x;
  const void* w;  // wt [n, k]
  const float* x_scale;
  const float* w_scale;
  void* y;
  int64_t m, k, n;
  int64_t y_rows, y_cols;    // y as the caller allocated it (checked)
  bool blockwise;            // the handler's: x_scale has rank 2
  int64_t xs_rows, xs_cols;  // the scales' shapes (per tensor: 1, 1)
  int64_t ws_rows, ws_cols;
  int64_t config;   // op_table.h Tile: kTile128x256 or kTile128x128 (blockwise: kTile128x128)
  int64_t group_m;  // block-rows per band of the tile order
};

template <class V>
void VisitFields(V&& visit, int /*op*/, MatmulFp8Args& a) {
  visit("dtype", a.dtype);
  visit("w_dtype", a.w_dtype);
  visit("y_dtype", a.y_dtype);
  visit("x", a.x);
  visit("w", a.w);
  visit("x_scale", a.x_scale);
  visit("w_scale", a.w_scale);
  visit("y", a.y);
  visit("m", a.m);
  visit("k", a.k);
  visit("n", a.n);
  visit("y_rows", a.y_rows);
  visit("y_cols", a.y_cols);
  visit("blockwise", a.blockwise);
  visit("xs_rows", a.xs_rows);
  visit("xs_cols", a.xs_cols);
  visit("ws_rows", a.ws_rows);
  visit("ws_cols", a.ws_cols);
  visit("config", a.config, op_table::kTile128x128);
  visit("group_m", a.group_m, 8);
}

Status LaunchMatmulFp8(const Where& at, const MatmulFp8Args& a);

// The masks' fields (AttnArgs, RingAttnArgs, RingAttnBwdArgs): masked (the masks below apply),
// the lengths q_len and kv_len (int32 [B]), the window (window_left, window_right; S, S: none),
// the soft cap (soft_cap; 0: none) and, with segments, the segment ids q_seg and kv_seg (int32
// [B, SP]) and their chunks' ranges q_info and kv_info (int32 [B, SP / 64, 4]). S and SP are
// the whole sequence's: the local one for pk_attention, S/P * P for ring attention, whose
// kernels read the ids by global position.
template <class V, class A>
void VisitMaskFields(V&& visit, A& a) {
  visit("masked", a.masked, 0);
  if (visit.When(a.masked)) {
    visit("q_len", a.q_len);
    visit("kv_len", a.kv_len);
    visit("window_left", a.window_left);
    visit("window_right", a.window_right);
    visit("soft_cap", a.soft_cap);
    visit("segments", a.segments, 0);
    if (visit.When(a.segments)) {
      visit("q_seg", a.q_seg);
      visit("kv_seg", a.kv_seg);
      visit("q_info", a.q_info);
      visit("kv_info", a.kv_info);
    }
  }
}

// The fused TP GEMMs in fp8 (cuda/kernels/gemm_rs_fp8.cuh): gemm_rs_fp8 / gemm_ar_fp8 are
// gemm_rs / gemm_ar with matmul_fp8's operands per rank, x [m, k] and wt [n, k] (k: K/P), and
// this rank's scales of its shard as matmul_fp8 takes them (per tensor, or blockwise with
// k = K/P); y bf16 [m/P or m, n].
// rank: the int32 rank operand on the device. ag_gemm_fp8 (cuda/kernels/ag_gemm_fp8.cuh): x
// [m, k] is this rank's row shard (m: Mp) and wt [n, k] its weight, y bf16 [P m, n]; it also
// returns x_full [P m, k] (x's format) and xs_full (per tensor [P]; blockwise [KB, P m]), the
// gathered rows and their scales, with num_comm_sms communication blocks.
struct GemmFp8Args : MatmulFp8Args {
  const int32_t* rank;
  void* x_full;          // ag_gemm_fp8 only
  float* xs_full;        // ag_gemm_fp8 only
  int64_t num_comm_sms;  // ag_gemm_fp8: communication blocks (the same on every rank)
};

template <class V>
void VisitFields(V&& visit, int op, GemmFp8Args& a) {
  VisitFields(visit, op, static_cast<MatmulFp8Args&>(a));
  visit("rank", a.rank);
  if (op == kOpAgGemmFp8) {
    visit("x_full", a.x_full);
    visit("xs_full", a.xs_full);
    visit("num_comm_sms", a.num_comm_sms);
  }
}

Status LaunchGemmRsFp8(const Where& at, const GemmFp8Args& a, const CommView& v);
Status LaunchGemmArFp8(const Where& at, const GemmFp8Args& a, const CommView& v);
Status LaunchAgGemmFp8(const Where& at, const GemmFp8Args& a, const CommView& v);

// Single-device attention (cuda/kernels/attention.cuh). Forward: q, k, v -> o, lse. Backward:
// q, k, v, d_o, lse and delta (both [B, H, SP], SP = S rounded up to 128) -> dq, dk, dv, with
// dq_acc a float32 [B, S, H, D] scratch. Masked (the masked kernels, either pass): the lengths
// q_len and kv_len (int32 [B]), the window (window_left, window_right; S, S: none), the soft
// cap (soft_cap; 0: none) and, with segments, the segment ids q_seg and kv_seg (int32 [B, SP])
// and their chunks' ranges q_info and kv_info (int32 [B, SP / 64, 4]: min, max, first, end;
// cuda/include/pk/attn/masks.cuh).
struct AttnArgs {
  DType dtype;
  const void *q, *k, *v, *d_o;
  const float *lse_in, *delta;
  void *o, *dq, *dk, *dv;
  float* dq_acc;
  float* lse;                 // forward output [B, H, S]
  int64_t b, s, h, hkv, d;    // q [b, s, h, d], k and v [b, s, hkv, d]
  int64_t sp;                 // backward: the padded length of lse_in and delta
  float scale;
  bool causal;
  bool backward;
  bool masked;                // the masks below apply
  const int32_t *q_len, *kv_len;
  int64_t window_left, window_right;
  float soft_cap;
  bool segments;              // masked: q_seg, kv_seg, q_info and kv_info given
  const int32_t *q_seg, *kv_seg, *q_info, *kv_info;
};

// q, k, v, the shape, the scale and the causal flag (with the dtype): the fields every attention
// op's args have (AttnArgs, RingAttnArgs, UlyssesAttnArgs, AttnBwdArgs).
template <class V, class A>
void VisitAttentionFields(V&& visit, A& a) {
  visit("dtype", a.dtype);
  visit("q", a.q);
  visit("k", a.k);
  visit("v", a.v);
  visit("b", a.b);
  visit("s", a.s);
  visit("h", a.h);
  visit("hkv", a.hkv);
  visit("d", a.d);
  visit("scale", a.scale);
  visit("causal", a.causal);
}

template <class V>
void VisitFields(V&& visit, int /*op*/, AttnArgs& a) {
  VisitAttentionFields(visit, a);
  visit("backward", a.backward, 0);
  if (visit.When(!a.backward)) {
    visit("o", a.o);
    visit("lse", a.lse);
  }
  if (visit.When(a.backward)) {
    visit("do", a.d_o);
    visit("lse_in", a.lse_in);
    visit("delta", a.delta);
    visit("dq", a.dq);
    visit("dk", a.dk);
    visit("dv", a.dv);
    visit("dq_acc", a.dq_acc);
    visit("sp", a.sp);
  }
  VisitMaskFields(visit, a);
}

Status LaunchAttention(const Where& at, const AttnArgs& a);

// Expert-parallel dispatch and combine (cuda/kernels/moe.cuh). Dispatch (mode 0): x [t, h] and
// ids [t, k] in; tokens [capacity, h] and the handle (dest, pos [t, k]; dropped,
// recv_dropped [1]; group_sizes [E / P]) out. Scatter (mode 1, the combine's transpose): x
// [t k, h] (one row per slot) with the handle's dest, pos and group_sizes in; tokens out.
struct MoeDispatchArgs {
  DType dtype;
  const void* x;
  const int32_t* ids;
  const int32_t* rank;
  int32_t* dest;
  int32_t* pos;
  int32_t* dropped;
  int32_t* recv_dropped;
  int32_t* group_sizes;
  void* tokens;
  int64_t t, k, h, num_experts, capacity;
  int64_t mode;  // 0 dispatch, 1 scatter
};

// mode is not a field of the call: the handler's (the scatter handler sets 1), or in the
// emulator the op's (moe_scatter).
template <class V>
void VisitFields(V&& visit, int op, MoeDispatchArgs& a) {
  const bool dispatch = op != kOpMoeScatter;  // the scatter reads the handle, counts no drops
  visit("dtype", a.dtype);
  visit("x", a.x);
  if (dispatch) visit("ids", a.ids);
  visit("rank", a.rank);
  visit("dest", a.dest);
  visit("pos", a.pos);
  if (dispatch) {
    visit("dropped", a.dropped);
    visit("recv_dropped", a.recv_dropped);
  }
  visit("group_sizes", a.group_sizes);
  visit("tokens", a.tokens);
  visit("t", a.t);
  visit("k", a.k);
  visit("h", a.h);
  visit("num_experts", a.num_experts);
  visit("capacity", a.capacity);
}

// Combine (mode 0): out [t, h] = sum_j weights[t, j] y_{dest}[pos] (fp32 weights, y's dtype
// out). Gather (mode 1, in the combine's VJP): out [t k, h] = the row of each slot (zero when
// dropped).
struct MoeCombineArgs {
  DType dtype;
  const void* y;
  const float* weights;
  const int32_t* dest;
  const int32_t* pos;
  const int32_t* rank;
  void* out;
  int64_t t, k, h, capacity;
  int64_t mode;  // 0 combine, 1 gather
};

// mode is not a field of the call: the combine's mode attribute, or in the emulator the op's
// (moe_gather).
template <class V>
void VisitFields(V&& visit, int /*op*/, MoeCombineArgs& a) {
  visit("dtype", a.dtype);
  visit("y", a.y);
  visit("weights", a.weights);
  visit("dest", a.dest);
  visit("pos", a.pos);
  visit("rank", a.rank);
  visit("out", a.out);
  visit("t", a.t);
  visit("k", a.k);
  visit("h", a.h);
  visit("capacity", a.capacity);
}

Status LaunchMoeDispatch(const Where& at, const MoeDispatchArgs& a, const CommView& v);

// Dispatch fused with the first expert GEMM (cuda/kernels/moe_dispatch_gemm.cuh): x [t, h],
// ids [t, k], w [E / P, h, n] in; y [capacity, n], group_sizes, the handle out; order [t k]
// and order_off [E + 1] int32 are scratch.
struct MoeDispatchGemmArgs {
  DType dtype;  // bf16 or fp16
  const void* x;
  const int32_t* ids;
  const void* w;
  const int32_t* rank;
  int32_t* dest;
  int32_t* pos;
  int32_t* dropped;
  int32_t* recv_dropped;
  int32_t* group_sizes;
  void* y;
  int32_t* order;
  int32_t* order_off;
  int64_t t, k, h, n, num_experts, capacity;
  int64_t num_comm_sms;  // 0: the launcher's choice
};

// num_comm_sms is the emulator's alone (benchmarks sweep it): pk_moe_dispatch_gemm has no such
// attribute, so XLA's calls take the fallback.
template <class V>
void VisitFields(V&& visit, int /*op*/, MoeDispatchGemmArgs& a) {
  visit("dtype", a.dtype);
  visit("x", a.x);
  visit("ids", a.ids);
  visit("w", a.w);
  visit("rank", a.rank);
  visit("dest", a.dest);
  visit("pos", a.pos);
  visit("dropped", a.dropped);
  visit("recv_dropped", a.recv_dropped);
  visit("group_sizes", a.group_sizes);
  visit("y", a.y);
  visit("order", a.order);
  visit("order_off", a.order_off);
  visit("t", a.t);
  visit("k", a.k);
  visit("h", a.h);
  visit("n", a.n);
  visit("num_experts", a.num_experts);
  visit("capacity", a.capacity);
  visit("num_comm_sms", a.num_comm_sms, 0);
}

Status LaunchMoeDispatchGemm(const Where& at, const MoeDispatchGemmArgs& a, const CommView& v);
Status LaunchMoeCombine(const Where& at, const MoeCombineArgs& a, const CommView& v);

// The second expert GEMM fused with the combine (cuda/kernels/moe_gemm_combine.cuh): h
// [capacity, f] (the rows this rank's experts received), w [groups, f, n], the handle (dest,
// pos [t, k], group_sizes [groups]) and weights [t, k] fp32 in; out [t, n] =
// moe_combine(grouped_matmul(h, w, group_sizes), weights) out.
struct MoeGemmCombineArgs {
  DType dtype;  // bf16 or fp16
  const void* h;
  const void* w;
  const float* weights;
  const int32_t* dest;
  const int32_t* pos;
  const int32_t* group_sizes;
  const int32_t* rank;
  void* out;
  int64_t t, k, f, n, groups, capacity;
};

template <class V>
void VisitFields(V&& visit, int /*op*/, MoeGemmCombineArgs& a) {
  visit("dtype", a.dtype);
  visit("h", a.h);
  visit("w", a.w);
  visit("weights", a.weights);
  visit("dest", a.dest);
  visit("pos", a.pos);
  visit("group_sizes", a.group_sizes);
  visit("rank", a.rank);
  visit("out", a.out);
  visit("t", a.t);
  visit("k", a.k);
  visit("f", a.f);
  visit("n", a.n);
  visit("groups", a.groups);
  visit("capacity", a.capacity);
}

Status LaunchMoeGemmCombine(const Where& at, const MoeGemmCombineArgs& a, const CommView& v);

// Ring attention forward (cuda/kernels/ring_attn.cuh): q [b, s, h, d], k and v [b, s, hkv, d]
// (this rank's S/P positions) -> o like q and lse float32 [b, h, s]. zigzag: the causal zigzag
// layout; num_comm_sms: communication blocks (the same on every rank).
struct RingAttnArgs {
  DType dtype;
  const void *q, *k, *v;
  void* o;
  float* lse;
  const int32_t* rank;
  int64_t b, s, h, hkv, d;
  float scale;
  bool causal, zigzag;
  int64_t num_comm_sms;
  // Masked (VisitMaskFields, over the whole sequence of S/P * P positions; the masked kernel
  // takes zigzag with any mask by position, not only causal).
  bool masked;
  const int32_t *q_len, *kv_len;
  int64_t window_left, window_right;
  float soft_cap;
  bool segments;
  const int32_t *q_seg, *kv_seg, *q_info, *kv_info;
};

template <class V>
void VisitFields(V&& visit, int /*op*/, RingAttnArgs& a) {
  VisitAttentionFields(visit, a);
  visit("o", a.o);
  visit("lse", a.lse);
  visit("rank", a.rank);
  visit("zigzag", a.zigzag);
  visit("num_comm_sms", a.num_comm_sms, 2);
  VisitMaskFields(visit, a);
}

Status LaunchRingAttn(const Where& at, const RingAttnArgs& a, const CommView& v);
// The grouped GEMM's forward (cuda/kernels/grouped_matmul.cuh, mode FWD) on `at`: y [m, n] =
// x [m, k] @ w[e] [k, n] over the row groups of group_sizes [groups] (device). The rank
// emulator's serial MoE path (bench/bench_moe.py: dispatch, then this on the tokens).
struct GroupedMatmulArgs {
  DType dtype;  // bf16 or fp16
  const void* x;
  const void* w;
  const int32_t* group_sizes;
  void* y;
  int64_t m, k, n, groups, group_m;
};

template <class V>
void VisitFields(V&& visit, int /*op*/, GroupedMatmulArgs& a) {
  visit("dtype", a.dtype);
  visit("x", a.x);
  visit("w", a.w);
  visit("group_sizes", a.group_sizes);
  visit("y", a.y);
  visit("m", a.m);
  visit("k", a.k);
  visit("n", a.n);
  visit("groups", a.groups);
  visit("group_m", a.group_m, 8);
}

Status LaunchGroupedMatmul(const Where& at, const GroupedMatmulArgs& a);

// The grouped GEMM's forward in fp8 (cuda/kernels/grouped_matmul_fp8.cuh) on `at`: y [m, n] =
// (x [m, k] * its scale) @ (w[e] * its scale) over the row groups of group_sizes [groups]
// (device), w given transposed per expert, wt [groups, n, k] (fp8 wgmma reads B K-major). Per
// tensor (blockwise false): x_scale one float, w_scale [groups] (per expert). Blockwise: x_scale
// is x's [m, KB] scales transposed, [KB = ceil(k / 128), xs_cols >= m]; w_scale the experts'
// [groups, KB, NB] 128 x 128 block scales as [ws_rows = groups * KB, ws_cols >= ceil(n / 128)];
// both row lengths multiples of 4 (TMA's 16-byte strides).
struct GroupedMatmulFp8Args {
  DType dtype;    // x's format: kE4M3 or kE5M2
  DType w_dtype;  // w's format
  DType y_dtype;  // kBF16 or kF32
  const void* x;
  const void* w;  // wt [groups, n, k]
  const float* x_scale;
  const float* w_scale;
  const int32_t* group_sizes;
  void* y;
  int64_t m, k, n, groups;
  int64_t y_rows, y_cols;    // y as the caller allocated it (checked)
  bool blockwise;            // the handler's: x_scale has rank 2
  int64_t xs_rows, xs_cols;  // the scales' shapes (per tensor: 1, 1 and groups, 1)
  int64_t ws_rows, ws_cols;
  int64_t config;   // op_table.h Tile: kTile128x256 or kTile128x128 (blockwise: kTile128x128)
  int64_t group_m;  // block-rows per band of the tile order
};

template <class V>
void VisitFields(V&& visit, int /*op*/, GroupedMatmulFp8Args& a) {
  visit("dtype", a.dtype);
  visit("w_dtype", a.w_dtype);
  visit("y_dtype", a.y_dtype);
  visit("x", a.x);
  visit("w", a.w);
  visit("x_scale", a.x_scale);
  visit("w_scale", a.w_scale);
  visit("group_sizes", a.group_sizes);
  visit("y", a.y);
  visit("m", a.m);
  visit("k", a.k);
  visit("n", a.n);
  visit("groups", a.groups);
  visit("y_rows", a.y_rows);
  visit("y_cols", a.y_cols);
  visit("blockwise", a.blockwise);
  visit("xs_rows", a.xs_rows);
  visit("xs_cols", a.xs_cols);
  visit("ws_rows", a.ws_rows);
  visit("ws_cols", a.ws_cols);
  visit("config", a.config, op_table::kTile128x256);
  visit("group_m", a.group_m, 8);
}

Status LaunchGroupedMatmulFp8(const Where& at, const GroupedMatmulFp8Args& a);

// Ulysses attention forward (cuda/kernels/ulysses_attn.cuh): q [b, s, h, d], k and v
// [b, s, hkv, d] (this rank's S/P positions; P divides h and hkv) -> o like q and lse float32
// [b, h, s]. num_comm_sms: communication blocks (the same on every rank).
struct UlyssesAttnArgs {
  DType dtype;
  const void *q, *k, *v;
  void* o;
  float* lse;
  const int32_t* rank;
  int64_t b, s, h, hkv, d;
  float scale;
  bool causal;
  int64_t num_comm_sms;
};

template <class V>
void VisitFields(V&& visit, int /*op*/, UlyssesAttnArgs& a) {
  VisitAttentionFields(visit, a);
  visit("o", a.o);
  visit("lse", a.lse);
  visit("rank", a.rank);
  visit("num_comm_sms", a.num_comm_sms, 2);
}

Status LaunchUlyssesAttn(const Where& at, const UlyssesAttnArgs& a, const CommView& v);
// The checks both Ulysses kernels make (ffi/ulysses_attn.cu): the error record, the signal
// pad, the world, the dtype, the head dim, P dividing H and Hkv, Hkv dividing H, the
// communication blocks; errors start with "pk." + op.
Status CheckUlysses(const std::string& op, DType dtype, int64_t d, int64_t h, int64_t hkv,
                    int64_t num_comm_sms, const CommView& v);

// The fused attention backwards' arguments (RingAttnBwdArgs, UlyssesAttnBwdArgs): q, k, v,
// d_o, the forward's lse and delta = rowsum(dO O) in; dq, dk, dv out; the rank operand, the
// shape (b, s = this rank's S/P positions, h, hkv, d), scale, causal, and the communication
// blocks (the same on every rank).
struct AttnBwdArgs {
  DType dtype;
  const void *q, *k, *v, *d_o;
  const float *lse, *delta;
  void *dq, *dk, *dv;
  const int32_t* rank;
  int64_t b, s, h, hkv, d;
  float scale;
  bool causal;
  int64_t num_comm_sms;
};

template <class V>
void VisitFields(V&& visit, int /*op*/, AttnBwdArgs& a) {
  VisitAttentionFields(visit, a);
  visit("do", a.d_o);
  visit("lse", a.lse);
  visit("delta", a.delta);
  visit("dq", a.dq);
  visit("dk", a.dk);
  visit("dv", a.dv);
  visit("rank", a.rank);
  visit("num_comm_sms", a.num_comm_sms, 2);
}

// Ulysses attention backward (cuda/kernels/ulysses_attn_bwd.cuh) after the composed forward:
// d_o [b, s, h, d] and delta float32 [b, h, s], the head shards q [b, P s, h/P, d], k and v
// [b, P s, hkv/P, d] and lse float32 [b, h/P, SP] (SP = P s rounded up to 128, +inf past P s)
// -> dq [b, s, h, d], dk and dv [b, s, hkv, d]. P >= 2 divides h and hkv.
using UlyssesAttnBwdArgs = AttnBwdArgs;

Status LaunchUlyssesAttnBwd(const Where& at, const UlyssesAttnBwdArgs& a, const CommView& v);

// Ring attention backward (cuda/kernels/ring_attn_bwd.cuh): q, d_o [b, s, h, d], k and v
// [b, s, hkv, d], lse and delta float32 [b, h, SP] (SP = s rounded up to 128; lse = +inf and
// delta = 0 past s) -> dq, dk, dv like q, k, v. P >= 2. zigzag: the causal zigzag layout.
struct RingAttnBwdArgs : AttnBwdArgs {
  bool zigzag;
};

template <class V>
void VisitFields(V&& visit, int op, RingAttnBwdArgs& a) {
  VisitFields(visit, op, static_cast<AttnBwdArgs&>(a));
  visit("zigzag", a.zigzag);
}

Status LaunchRingAttnBwd(const Where& at, const RingAttnBwdArgs& a, const CommView& v);

// The symmetric workspace, in bytes per rank, that one call of op `op` with `a` needs at world
// size `world`: the launch function checks the communicator's workspace against it, and the
// Python op checks pk.init's at trace time through the same function
// (_pk_ffi.workspace_need). The collectives use whatever workspace there is, in chunks; the
// single-GPU ops use none.
inline uint64_t WorkspaceNeed(int, const CollArgs&, int) { return 0; }
inline uint64_t WorkspaceNeed(int, const AttnArgs&, int) { return 0; }
inline uint64_t WorkspaceNeed(int, const GroupedMatmulArgs&, int) { return 0; }
inline uint64_t WorkspaceNeed(int, const MatmulFp8Args&, int) { return 0; }
inline uint64_t WorkspaceNeed(int, const GroupedMatmulFp8Args&, int) { return 0; }
// gemm_rs: the owner buffer of M/P rows of N; gemm_ar: of ceil(M/P) rows (its last owner's
// rows may run past M); ag_gemm: the staged shard, x's [Mp, K]. 2-byte dtypes.
inline uint64_t WorkspaceNeed(int op, const GemmArgs& a, int world) {
  if (op == kOpAgGemm) return uint64_t(a.m) * uint64_t(a.k) * 2;
  if (op != kOpGemmRs && op != kOpGemmAr) return 0;
  const int64_t mp = op == kOpGemmAr ? (a.m + world - 1) / world : a.m / world;
  return uint64_t(mp) * uint64_t(a.n) * 2;
}
// gemm_rs_fp8 / gemm_ar_fp8: gemm_rs's / gemm_ar's bf16 owner buffer (Mp rows of N);
// ag_gemm_fp8: the staged shard, x's [Mp, K] bytes, then its scales (16 bytes per tensor,
// blockwise [KB, Mp] floats).
inline uint64_t WorkspaceNeed(int op, const GemmFp8Args& a, int world) {
  if (op == kOpAgGemmFp8) {
    const uint64_t shard = (uint64_t(a.m) * uint64_t(a.k) + 15) / 16 * 16;
    return shard + (a.blockwise ? uint64_t((a.k + 127) / 128) * uint64_t(a.m) * 4 : 16);
  }
  const int64_t mp = op == kOpGemmArFp8 ? (a.m + world - 1) / world : a.m / world;
  return uint64_t(mp) * uint64_t(a.n) * 2;
}
// moe_dispatch / moe_scatter: the capacity rows of H this rank's experts receive.
inline uint64_t WorkspaceNeed(int, const MoeDispatchArgs& a, int) {
  return uint64_t(a.capacity) * uint64_t(a.h) * ByteWidth(a.dtype);
}
// moe_combine / moe_gather: the experts' capacity rows of y, read by the tokens' ranks.
inline uint64_t WorkspaceNeed(int, const MoeCombineArgs& a, int) {
  return uint64_t(a.capacity) * uint64_t(a.h) * ByteWidth(a.dtype);
}
// moe_dispatch_gemm: the capacity rows of H received (bf16 / fp16).
inline uint64_t WorkspaceNeed(int, const MoeDispatchGemmArgs& a, int) {
  return uint64_t(a.capacity) * uint64_t(a.h) * 2;
}
// moe_gemm_combine: T k slot rows of N (bf16 / fp16), then the inverse map (capacity x 8
// bytes) 256-byte aligned.
inline uint64_t WorkspaceNeed(int, const MoeGemmCombineArgs& a, int) {
  return (uint64_t(a.t) * uint64_t(a.k) * uint64_t(a.n) * 2 + 255) / 256 * 256 +
         uint64_t(a.capacity) * 8;
}
// Ring attention forward: P - 1 K blocks and P - 1 V blocks of [b, s, hkv, d].
inline uint64_t WorkspaceNeed(int, const RingAttnArgs& a, int world) {
  return 2 * uint64_t(world - 1) * uint64_t(a.b) * a.s * a.hkv * a.d * 2;
}
// Ring attention backward: the forward's K/V blocks, then P fp32 dK/dV blocks of
// ceil(s / 128) 128-row tiles per K/V head and batch, then an fp32 dQ of q's shape.
inline uint64_t WorkspaceNeed(int, const RingAttnBwdArgs& a, int world) {
  const uint64_t items = uint64_t((a.s + 127) / 128) * a.hkv * a.b;
  return 2 * uint64_t(world - 1) * uint64_t(a.b) * a.s * a.hkv * a.d * 2 +
         uint64_t(world) * items * 2 * 128 * a.d * 4 + uint64_t(a.b) * a.s * a.h * a.d * 4;
}
// Ulysses forward and backward: their kernels' workspace layouts (ulysses_attn::make_layout,
// ulysses_attn_bwd::make_layout), defined beside their launch functions.
uint64_t WorkspaceNeed(int op, const UlyssesAttnArgs& a, int world);
uint64_t WorkspaceNeed(int op, const UlyssesAttnBwdArgs& a, int world);

// Refuses a launch once the communicator's error record holds an error (a peer timed out in
// an earlier call): the message names op, rank and missing peer, and the call never starts
// kernels that would wait for peers that are gone.
Status CheckRecord(const char* op, const CommView& v);

// Rank-emulator helpers (ffi/emu.cu): a kernel that spins for `ns` nanoseconds on `stream`
// (a late rank), and `blocks` blocks with `smem_bytes` of shared memory each spinning `ns`
// (other work holding part of a partition's SMs).
Status LaunchDelay(cudaStream_t stream, uint64_t ns);
Status LaunchOccupy(cudaStream_t stream, int blocks, int smem_bytes, uint64_t ns);
// One block whose mbarrier never completes: the test of pk::mbar_wait's bound (it must write
// `error` as op `op`, rank `rank`, and trap after timeout_ns).
Status LaunchMbarStall(cudaStream_t stream, int32_t* error, int op, int rank,
                       uint64_t timeout_ns);

// The rank emulator's ops and their launch functions: calls f(launch) with the launch function
// of op `id` and returns what it returns, or none() for an op the emulator does not run. The
// args struct an op decodes is its launch function's parameter. module.cc checks at compile time
// that this map and the op table's emu and comm flags agree.
template <class F, class G>
constexpr auto WithLauncher(int id, F&& f, G&& none) {
  switch (id) {
    case kOpAllReduce: return f(LaunchAllReduce);
    case kOpAllGather: return f(LaunchAllGather);
    case kOpReduceScatter: return f(LaunchReduceScatter);
    case kOpAllToAll: return f(LaunchAllToAll);
    case kOpMatmul: return f(LaunchMatmul);
    case kOpMatmulFp8: return f(LaunchMatmulFp8);
    case kOpGemmRs: return f(LaunchGemmRs);
    case kOpAgGemm: return f(LaunchAgGemm);
    case kOpGemmAr: return f(LaunchGemmAr);
    case kOpGemmRsFp8: return f(LaunchGemmRsFp8);
    case kOpGemmArFp8: return f(LaunchGemmArFp8);
    case kOpAgGemmFp8: return f(LaunchAgGemmFp8);
    case kOpGroupedMatmul: return f(LaunchGroupedMatmul);
    case kOpGroupedMatmulFp8: return f(LaunchGroupedMatmulFp8);
    case kOpAttention: return f(LaunchAttention);
    case kOpMoeDispatch: return f(LaunchMoeDispatch);
    case kOpMoeScatter: return f(LaunchMoeDispatch);  // mode 1
    case kOpMoeCombine: return f(LaunchMoeCombine);
    case kOpMoeGather: return f(LaunchMoeCombine);  // mode 1
    case kOpMoeDispatchGemm: return f(LaunchMoeDispatchGemm);
    case kOpMoeGemmCombine: return f(LaunchMoeGemmCombine);
    case kOpRingAttn: return f(LaunchRingAttn);
    case kOpRingAttnBwd: return f(LaunchRingAttnBwd);
    case kOpUlyssesAttn: return f(LaunchUlyssesAttn);
    case kOpUlyssesAttnBwd: return f(LaunchUlyssesAttnBwd);
    default: return none();
  }
}

}  // namespace pk_ffi
