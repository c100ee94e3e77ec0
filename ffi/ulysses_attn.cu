// FFI handler and launcher of pk_ulysses_attn: the fused Ulysses attention forward (see
// cuda/kernels/ulysses_attn.cuh). Launches on XLA's stream; no host synchronisation.
#include <string>

#include "comm_state.h"
#include "ffi_util.h"
#include "kernels/ulysses_attn.cuh"
#include "launch.h"
#include "tensor_map.h"
#include "tp.h"

namespace pk_ffi {
namespace {

// The kernel's slot range and limits are the op table's (op_table.h).
static_assert(op_table::kUlyssesSlots.Is(pk::ulysses_attn::SLOT_BASE, pk::ulysses_attn::OP_SLOTS) &&
              pk::ulysses_attn::MAX_PEERS == op_table::kMaxPeers &&
              pk::ulysses_attn::MAX_COMM == op_table::kAttnMaxCommSms);

Status Invalid(const std::string& what) {
  return Status::Invalid("pk.ulysses_attention: " + what);
}

// The 4-D map of a workspace section or a local operand (tensor_map.h Map4d), boxes of `rows`
// positions; batch = P B for the sections.
Status Map(const void* ptr, int64_t batch, int64_t s, int64_t heads, int64_t d, int rows,
           int dtype, CUtensorMap* out) {
  return Map4d("ulysses_attention", ptr, batch, s, heads, d, rows, dtype, out);
}

}  // namespace

Status CheckUlysses(const std::string& op, DType dtype, int64_t d, int64_t h, int64_t hkv,
                    int64_t num_comm_sms, const CommView& v) {
  namespace ua = pk::ulysses_attn;
  auto invalid = [&](const std::string& what) { return Status::Invalid("pk." + op + ": " + what); };
  if (Status s = CheckRecord(op.c_str(), v); !s.ok()) return s;
  if (v.signal_count < op_table::kUlyssesSlots.end()) {
    return invalid("the signal pad has " + std::to_string(v.signal_count) +
                   " slots, the kernel needs " +
                   std::to_string(op_table::kUlyssesSlots.end()));
  }
  const int P = v.world;
  if (P > ua::MAX_PEERS) return invalid("at most " + std::to_string(ua::MAX_PEERS) + " ranks");
  if (dtype != DType::kBF16 && dtype != DType::kF16) {
    return invalid("the operands must all be bf16 or all fp16.");
  }
  if (d != 64 && d != 128) return invalid("head_dim must be 64 or 128, got " + std::to_string(d));
  if (hkv < 1 || h % hkv != 0) return invalid("the K/V heads must divide the query heads.");
  if (h % P != 0 || hkv % P != 0) {
    return invalid("the query heads (" + std::to_string(h) + ") and the K/V heads (" +
                   std::to_string(hkv) + ") must both be divisible by the world size " +
                   std::to_string(P) + ".");
  }
  if (num_comm_sms < 1 || num_comm_sms > ua::MAX_COMM) {
    return invalid("num_comm_sms must be in 1.." + std::to_string(ua::MAX_COMM) + ", got " +
                   std::to_string(num_comm_sms));
  }
  return Status::Ok();
}

Status LaunchUlyssesAttn(const Where& at, const UlyssesAttnArgs& a, const CommView& v) {
  namespace ua = pk::ulysses_attn;
  if (Status s = CheckUlysses("ulysses_attention", a.dtype, a.d, a.h, a.hkv, a.num_comm_sms, v);
      !s.ok()) {
    return s;
  }
  const int P = v.world;
  if (a.b < 0 || a.s < 0 || a.h < 0 || a.b * P > 65535 || a.h > 65535 ||
      a.s * a.h * a.d > INT32_MAX || a.s * int64_t(P) > INT32_MAX / 2 ||
      (a.s + 127) / 128 * P * (a.h / P) * a.b > INT32_MAX / 2) {
    return Invalid("sizes too large (P * batch and heads below 65536, S * H * D below 2^31).");
  }
  const ua::layout ws = ua::make_layout(P, a.b, a.s, a.h, a.hkv, a.d);
  if (ws.total > v.workspace_bytes) {
    return Invalid("the symmetric workspace has " + std::to_string(v.workspace_bytes) +
                   " bytes and this call needs " + std::to_string(ws.total) +
                   " (head-group copies of q, k, v, the output and lse); call pk.init(mesh, "
                   "workspace_bytes=...) with at least that.");
  }
  // Every check above depends on shapes, attributes and the world only: every rank refuses or
  // runs the call alike, so the epochs stay in step.
  if (a.b == 0 || a.s == 0 || a.h == 0) return Status::Ok();

  ua::globals g{};
  pk::tp::comm& c = g.c;
  tp::View(kOpUlyssesAttn, op_table::kUlyssesSlots.base, v, a.rank, &c);
  const int type = a.dtype == DType::kBF16 ? 0 : 1;
  const int64_t gh = a.h / P, gk = a.hkv / P;
  g.d = pk::attention::dims{int(a.b), int(a.s), int(gh), int(gk), a.scale, a.causal ? 1 : 0};
  g.heads = static_cast<int>(a.h);
  g.kv_heads = static_cast<int>(a.hkv);
  g.head_dim = static_cast<int>(a.d);
  g.comm_blocks = static_cast<int>(a.num_comm_sms);
  // The compute blocks' forward configuration (ulysses_attn.cuh): its query rows per block and
  // keys per tile are the maps' boxes.
  const int q_rows = ua::block_rows(int(a.d));
  const int kv_rows = ua::block_keys(int(a.d), a.causal);
  g.q_tiles = static_cast<int>((a.s + q_rows - 1) / q_rows);
  g.ws = ws;
  g.q = a.q;
  g.k = a.k;
  g.v = a.v;
  g.o = a.o;
  g.lse = a.lse;
  char* const mine = static_cast<char*>(v.workspace[v.rank]);
  const int64_t pb = int64_t(P) * a.b;
  if (Status s = Map(mine + ws.qw, pb, a.s, gh, a.d, q_rows, type, &g.qw); !s.ok()) return s;
  if (Status s = Map(mine + ws.kw, pb, a.s, gk, a.d, kv_rows, type, &g.kw); !s.ok()) return s;
  if (Status s = Map(mine + ws.vw, pb, a.s, gk, a.d, kv_rows, type, &g.vw); !s.ok()) return s;
  // My own head group is read in place: maps over the local operands, all heads.
  if (Status s = Map(a.q, a.b, a.s, a.h, a.d, q_rows, type, &g.ql); !s.ok()) return s;
  if (Status s = Map(a.k, a.b, a.s, a.hkv, a.d, kv_rows, type, &g.kl); !s.ok()) return s;
  if (Status s = Map(a.v, a.b, a.s, a.hkv, a.d, kv_rows, type, &g.vl); !s.ok()) return s;
  if (Status s = tp::StartEpoch(at.stream, c); !s.ok()) return s;
  cudaError_t err;
  if (type == 0) {
    err = a.d == 64 ? ua::launch<__nv_bfloat16, 64>(g, at.stream, at.device)
                    : ua::launch<__nv_bfloat16, 128>(g, at.stream, at.device);
  } else {
    err = a.d == 64 ? ua::launch<__half, 64>(g, at.stream, at.device)
                    : ua::launch<__half, 128>(g, at.stream, at.device);
  }
  return CudaStatus(err, "ulysses_attention");
}

namespace {

ffi::Error UlyssesAttnCuda(cudaStream_t stream, int32_t device, CommState* state,
                           ffi::AnyBuffer q,
                           ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> rank,
                           ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                           int64_t /*comm_id*/, float scale, int64_t causal, int64_t num_comm_sms) {
  const CommView* view = nullptr;
  if (ffi::Error e = BindComm("ulysses_attention", state, device, &view); e.failure()) {
    return e;
  }
  UlyssesAttnArgs a{};
  if (!BindQkv(q, k, v, &a) || o->element_type() != q.element_type() ||
      lse->element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument(
        "pk.ulysses_attention: expected q and o [B, S/P, H, D], k and v [B, S/P, Hkv, D] of "
        "one 2-byte dtype, lse float32.");
  }
  a.o = o->untyped_data();
  a.lse = static_cast<float*>(lse->untyped_data());
  a.rank = rank.typed_data();
  a.scale = scale;
  a.causal = causal != 0;
  a.num_comm_sms = num_comm_sms;
  return ToError(LaunchUlyssesAttn(Where{stream, device, 0}, a, *view));
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkUlyssesAttn, pk_ffi::UlyssesAttnCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()              // q [B, S/P, H, D]
                                  .Arg<xla::ffi::AnyBuffer>()              // k [B, S/P, Hkv, D]
                                  .Arg<xla::ffi::AnyBuffer>()              // v [B, S/P, Hkv, D]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // rank
                                  .Ret<xla::ffi::AnyBuffer>()              // o [B, S/P, H, D]
                                  .Ret<xla::ffi::AnyBuffer>()              // lse f32 [B, H, S/P]
                                  .Attr<int64_t>("comm_id")                // comm_id
                                  .Attr<float>("scale")                    // multiplies q . k
                                  .Attr<int64_t>("causal")                 // 1: causal mask
                                  .Attr<int64_t>("num_comm_sms"),          // comm blocks
                              PK_FFI_COMM_TRAITS);
