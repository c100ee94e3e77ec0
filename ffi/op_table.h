// The op table: every fact about an op that more than one layer needs, written once.
//
// For each op: its id (the op field of the error record, comm.h comm_error::kOp), its stem
// (FFI target pk_<stem>, emulator op <stem>), its family (the stem of its files: ffi/<family>.cu,
// cuda/kernels/<family>.cuh, pk_jax/ops/<family>.py, tests/test_<family>.py,
// bench/bench_<family>.py), the range of the signal pad its kernels use, and its limits. Beside
// them: the operand dtype codes, the GEMM tile configuration ids and the pad's size.
//
// Readers: the FFI handlers and the emulator's entry point (module.cc), the GEMM kernel header
// (tile ids), the kernels' own slot and limit constants (checked against these by static_assert
// in the handler that launches them), and Python: the module exports the table
// (_pk_ffi.op_table()) and pk_jax/_op_table.py reads it there, or without the extension from
// pk_jax/_op_table_data.py, written from the module by `python -m pk_jax._gen_op_table`
// (tests/test_op_table.py checks that they agree).
//
// Plain C++17, no CUDA headers: host-only translation units include it too.
#pragma once

#include <cstdint>
#include <cstring>

namespace pk_ffi {

// Element types of the operands (the launchers dispatch on them; Python passes these codes).
// The fp8 formats are the fp8 GEMMs' operands only (pk_matmul_fp8, pk_grouped_matmul_fp8,
// pk_gemm_rs_fp8, pk_gemm_ar_fp8, pk_ag_gemm_fp8).
enum class DType : int32_t { kBF16 = 0, kF16 = 1, kF32 = 2, kS32 = 3, kE4M3 = 4, kE5M2 = 5 };

// Op ids. The error record carries them (an op whose kernels share another op's protocol
// records that op's id: moe_scatter and moe_dispatch_gemm record moe_dispatch's, moe_gather
// moe_combine's). Never reuse an id: records from older builds name ops by it.
enum OpId : int {
  kOpAllReduce = 1,
  kOpAllGather = 2,
  kOpReduceScatter = 3,
  kOpAllToAll = 4,
  kOpGemmRs = 5,
  kOpAgGemm = 6,
  kOpGemmAr = 7,
  kOpMatmul = 8,
  kOpGroupedMatmul = 9,
  kOpAttention = 10,
  kOpPing = 11,
  kOpMoeDispatch = 12,
  kOpMoeCombine = 13,
  kOpRingAttn = 14,
  kOpUlyssesAttn = 15,
  kOpRingAttnBwd = 16,
  kOpMoeGemmCombine = 17,
  kOpUlyssesAttnBwd = 18,
  kOpMoeScatter = 19,
  kOpMoeGather = 20,
  kOpMoeDispatchGemm = 21,
  kOpMatmulFp8 = 22,
  kOpGroupedMatmulFp8 = 23,
  kOpGemmRsFp8 = 24,
  kOpGemmArFp8 = 25,
  kOpAgGemmFp8 = 26,
};

namespace op_table {

struct DTypeEntry {
  const char* name;  // numpy's name
  DType code;
  int bytes;
};
inline constexpr DTypeEntry kDTypes[] = {
    {"bfloat16", DType::kBF16, 2},
    {"float16", DType::kF16, 2},
    {"float32", DType::kF32, 4},
    {"int32", DType::kS32, 4},
    {"float8_e4m3fn", DType::kE4M3, 1},
    {"float8_e5m2", DType::kE5M2, 1},
};

// GEMM tile configurations (cuda/kernels/matmul.cuh config_id): the `config` attribute of
// pk_matmul (any of them) and of the fused TP GEMMs (kTile128x128 or kTile128x256S3); of
// pk_matmul_fp8 the tile shape alone (kTile128x256 or kTile128x128: cuda/kernels/matmul_fp8.cuh
// has its own stage counts, and its blockwise scaling takes kTile128x128) and of its fused TP
// forms pk_gemm_rs_fp8 / pk_gemm_ar_fp8 / pk_ag_gemm_fp8 (per tensor: kTile128x256 or
// kTile128x128).
enum Tile : int {
  kTile128x256 = 0,    // 4 stages, stores staged in two 128-column rounds
  kTile128x128 = 1,    // 6 stages: small outputs, twice the tiles to spread over the SMs
  kTile128x256S3 = 2,  // 3 stages, whole-tile store staging
  kNumTiles = 3,
};
struct TileEntry {
  const char* name;
  int id;
};
inline constexpr TileEntry kTiles[] = {
    {"128x256", kTile128x256},
    {"128x128", kTile128x128},
    {"128x256_s3", kTile128x256S3},
};

// The signal pad: kSignalCount uint64 slots per rank (pk.init's default, signal_count), cut
// into ranges that each start where the previous one ends. A kernel's slots are offsets into
// its op's range (the handlers pass pads already offset).
struct Range {
  uint64_t base;
  uint64_t count;
  constexpr uint64_t end() const { return base + count; }
  constexpr bool Is(uint64_t b, uint64_t c) const { return base == b && count == c; }
};
inline constexpr uint64_t kSignalCount = uint64_t(1) << 16;
inline constexpr Range kNoSlots{0, 0};
// The four collectives (pk/collective.cuh uses SLOTS of them; the rest is spare).
inline constexpr Range kCollSlots{0, 6400};
// Ring attention, forward and backward (kernels/ring_attn.cuh, ring_attn_bwd.cuh).
inline constexpr Range kRingSlots{kCollSlots.end(), 640};
// Ulysses attention, forward and backward (kernels/ulysses_attn.cuh, ulysses_attn_bwd.cuh).
inline constexpr Range kUlyssesSlots{kRingSlots.end(), 1152};
// The fused TP GEMMs, one range each (pk/tp.cuh: SLOT_BASE + index * OP_SLOTS).
inline constexpr uint64_t kTpOpSlots = 16384;
inline constexpr Range kGemmRsSlots{kUlyssesSlots.end(), kTpOpSlots};
inline constexpr Range kAgGemmSlots{kGemmRsSlots.end(), kTpOpSlots};
inline constexpr Range kGemmArSlots{kAgGemmSlots.end(), kTpOpSlots};
// Expert parallelism: dispatch, combine and their fused GEMM forms (kernels/moe.cuh).
inline constexpr Range kMoeSlots{kGemmArSlots.end(), 8192};
static_assert(kMoeSlots.end() <= kSignalCount, "the ops' slot ranges must fit the signal pad");

// Limits shared by several ops.
inline constexpr int64_t kMaxPeers = 16;          // ranks of a communicator
inline constexpr int64_t kMaxDim = INT32_MAX;     // sizes and products indexed in int32
inline constexpr int64_t kMaxGridY = 65535;       // batch and heads: a grid's y and z extents
inline constexpr int64_t kMaxGroups = 1024;       // grouped GEMM groups (experts per rank)
inline constexpr int64_t kGroupedFewMaxRows = 64;  // grouped GEMM: M of its few-rows kernel
inline constexpr int64_t kMaxExperts = 1024;      // moe: E (the route kernel's shared memory)
inline constexpr int64_t kMaxSlotsPerToken = 32;  // moe: k (one lane each)
// moe: P x E counts fit the range after the barriers (kernels/moe.cuh COUNTS); the fused
// dispatch + GEMM splits them in two (counts, then arrivals).
inline constexpr int64_t kMoeMaxCounts = int64_t(kMoeSlots.count) - 64 - 3 * kMaxPeers * 64;
inline constexpr int64_t kMoeMaxFusedCounts = kMoeMaxCounts / 2;
inline constexpr int64_t kAttnMaxCommSms = 16;    // ring / Ulysses communication blocks
inline constexpr int64_t kAgGemmMaxCommSms = 128;  // ag_gemm communication blocks

struct Limit {
  const char* name;
  int64_t value;
};
inline constexpr Limit kLimits[] = {
    {"max_peers", kMaxPeers},
    {"max_dim", kMaxDim},
    {"max_grid_y", kMaxGridY},
    {"max_groups", kMaxGroups},
    {"grouped_few_max_rows", kGroupedFewMaxRows},
    {"max_experts", kMaxExperts},
    {"max_slots_per_token", kMaxSlotsPerToken},
    {"moe_max_counts", kMoeMaxCounts},
    {"moe_max_fused_counts", kMoeMaxFusedCounts},
    {"attn_max_comm_sms", kAttnMaxCommSms},
    {"ag_gemm_max_comm_sms", kAgGemmMaxCommSms},
};

struct Op {
  int id;
  const char* name;    // stem: FFI target pk_<name>, emulator op <name>
  const char* family;  // the stem of its files
  Range slots;         // its range of the signal pad (kNoSlots: no communicator)
  bool comm;           // takes a communicator (pk.init's symmetric memory)
  bool target;         // an FFI target pk_<name> (its handler file's PK_FFI_REGISTER)
  bool emu;            // the rank emulator runs it (its launch function: launch.h WithLauncher)
  int record_id;       // the id its kernels write into the error record
};

inline constexpr Op kOps[] = {
    // id, stem, family, slots, comm, target, emu, record id
    {kOpPing, "ping", "ping", kNoSlots, false, true, false, kOpPing},
    {kOpAllReduce, "all_reduce", "all_reduce", kCollSlots, true, true, true, kOpAllReduce},
    {kOpAllGather, "all_gather", "all_gather", kCollSlots, true, true, true, kOpAllGather},
    {kOpReduceScatter, "reduce_scatter", "reduce_scatter", kCollSlots, true, true, true,
     kOpReduceScatter},
    {kOpAllToAll, "all_to_all", "all_to_all", kCollSlots, true, true, true, kOpAllToAll},
    {kOpMatmul, "matmul", "matmul", kNoSlots, false, true, true, kOpMatmul},
    {kOpMatmulFp8, "matmul_fp8", "matmul", kNoSlots, false, true, true, kOpMatmulFp8},
    {kOpGemmRs, "gemm_rs", "gemm_rs", kGemmRsSlots, true, true, true, kOpGemmRs},
    {kOpAgGemm, "ag_gemm", "ag_gemm", kAgGemmSlots, true, true, true, kOpAgGemm},
    {kOpGemmAr, "gemm_ar", "gemm_ar", kGemmArSlots, true, true, true, kOpGemmAr},
    // The fp8 forms run gemm_rs's / gemm_ar's / ag_gemm's protocol in those ops' ranges (one
    // epoch counter each: every rank makes the same calls in the same order); their records
    // name the fp8 op.
    {kOpGemmRsFp8, "gemm_rs_fp8", "gemm_rs", kGemmRsSlots, true, true, true, kOpGemmRsFp8},
    {kOpGemmArFp8, "gemm_ar_fp8", "gemm_ar", kGemmArSlots, true, true, true, kOpGemmArFp8},
    {kOpAgGemmFp8, "ag_gemm_fp8", "ag_gemm", kAgGemmSlots, true, true, true, kOpAgGemmFp8},
    {kOpGroupedMatmul, "grouped_matmul", "grouped_matmul", kNoSlots, false, true, true,
     kOpGroupedMatmul},
    {kOpGroupedMatmulFp8, "grouped_matmul_fp8", "grouped_matmul", kNoSlots, false, true, true,
     kOpGroupedMatmulFp8},
    {kOpAttention, "attention", "attention", kNoSlots, false, true, true, kOpAttention},
    {kOpMoeDispatch, "moe_dispatch", "moe", kMoeSlots, true, true, true, kOpMoeDispatch},
    {kOpMoeScatter, "moe_scatter", "moe", kMoeSlots, true, true, true, kOpMoeDispatch},
    {kOpMoeCombine, "moe_combine", "moe", kMoeSlots, true, true, true, kOpMoeCombine},
    {kOpMoeGather, "moe_gather", "moe", kMoeSlots, true, false, true, kOpMoeCombine},
    {kOpMoeDispatchGemm, "moe_dispatch_gemm", "moe", kMoeSlots, true, true, true, kOpMoeDispatch},
    {kOpMoeGemmCombine, "moe_gemm_combine", "moe", kMoeSlots, true, true, true, kOpMoeGemmCombine},
    {kOpRingAttn, "ring_attn", "ring_attn", kRingSlots, true, true, true, kOpRingAttn},
    {kOpRingAttnBwd, "ring_attn_bwd", "ring_attn", kRingSlots, true, true, true, kOpRingAttnBwd},
    {kOpUlyssesAttn, "ulysses_attn", "ulysses_attn", kUlyssesSlots, true, true, true,
     kOpUlyssesAttn},
    {kOpUlyssesAttnBwd, "ulysses_attn_bwd", "ulysses_attn", kUlyssesSlots, true, true, true,
     kOpUlyssesAttnBwd},
};

// The op of `id`, nullptr when there is none.
constexpr const Op* Find(int id) {
  for (const Op& op : kOps) {
    if (op.id == id) return &op;
  }
  return nullptr;
}

// The op named `name`, nullptr when there is none.
inline const Op* Find(const char* name) {
  for (const Op& op : kOps) {
    if (std::strcmp(op.name, name) == 0) return &op;
  }
  return nullptr;
}

// The stem of op `id`, or "an op" for an id no op has (a corrupt record).
constexpr const char* Name(int id) {
  const Op* op = Find(id);
  return op != nullptr ? op->name : "an op";
}

constexpr bool IdsUnique() {
  for (const Op& a : kOps) {
    int same = 0;
    for (const Op& b : kOps) same += a.id == b.id;
    if (same != 1 || a.id <= 0 || Find(a.record_id) == nullptr) return false;
  }
  return true;
}
static_assert(IdsUnique(), "op ids must be unique and positive, record ids those of ops");

}  // namespace op_table
}  // namespace pk_ffi
