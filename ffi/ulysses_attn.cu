// FFI handler and launcher of pk_ulysses_attn: the fused Ulysses attention forward (see
// cuda/kernels/ulysses_attn.cuh). Launches on XLA's stream; no host synchronisation.
#include <string>

#include "kernels/ulysses_attn.cuh"
#include "sp_handler.h"

namespace pk_ffi {
namespace {

namespace ua = pk::ulysses_attn;

// The kernel's slot range and limits are the op table's (op_table.h).
static_assert(op_table::kUlyssesSlots.Is(ua::SLOT_BASE, ua::OP_SLOTS) &&
              ua::MAX_PEERS == op_table::kMaxPeers && ua::MAX_COMM == op_table::kAttnMaxCommSms);

constexpr char kOp[] = "ulysses_attention";

}  // namespace

Status CheckUlysses(const std::string& op, DType dtype, int64_t d, int64_t h, int64_t hkv,
                    int64_t num_comm_sms, const CommView& v) {
  if (Status s = sp::CheckComm(op, op_table::kUlyssesSlots, v); !s.ok()) return s;
  if (Status s = sp::CheckOperands(op, "the operands", dtype, d, h, hkv); !s.ok()) return s;
  const int P = v.world;
  if (h % P != 0 || hkv % P != 0) {
    return sp::Invalid(op, "the query heads (" + std::to_string(h) + ") and the K/V heads (" +
                               std::to_string(hkv) +
                               ") must both be divisible by the world size " +
                               std::to_string(P) + ".");
  }
  return sp::CheckCommSms(op, num_comm_sms);
}

uint64_t WorkspaceNeed(int, const UlyssesAttnArgs& a, int world) {
  return ua::make_layout(world, a.b, a.s, a.h, a.hkv, a.d).total;
}

Status LaunchUlyssesAttn(const Where& at, const UlyssesAttnArgs& a, const CommView& v) {
  if (Status s = CheckUlysses(kOp, a.dtype, a.d, a.h, a.hkv, a.num_comm_sms, v); !s.ok()) {
    return s;
  }
  const int P = v.world;
  if (a.b < 0 || a.s < 0 || a.h < 0 || a.b * P > 65535 || a.h > 65535 ||
      a.s * a.h * a.d > INT32_MAX || a.s * int64_t(P) > INT32_MAX / 2 ||
      (a.s + 127) / 128 * P * (a.h / P) * a.b > INT32_MAX / 2) {
    return sp::Invalid(
        kOp, "sizes too large (P * batch and heads below 65536, S * H * D below 2^31).");
  }
  const ua::layout ws = ua::make_layout(P, a.b, a.s, a.h, a.hkv, a.d);
  if (Status s = sp::WorkspaceCheck(kOp, WorkspaceNeed(kOpUlyssesAttn, a, P),
                                    v.workspace_bytes,
                                    "head-group copies of q, k, v, the output and lse");
      !s.ok()) {
    return s;
  }
  if (sp::Empty(a)) return Status::Ok();

  ua::globals g{};
  tp::View(kOpUlyssesAttn, op_table::kUlyssesSlots.base, v, a.rank, &g.c);
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
  const uint32_t q_box = q_rows, kv_box = kv_rows;
  const int type = sp::MapType(a.dtype);
  // The workspace sections hold P B batches. My own head group is read in place: maps over
  // the local operands, all heads.
  if (Status s = sp::EncodeMaps(kOp, a.s, a.d,
                                {{mine + ws.qw, pb, gh, q_box, type, &g.qw},
                                 {mine + ws.kw, pb, gk, kv_box, type, &g.kw},
                                 {mine + ws.vw, pb, gk, kv_box, type, &g.vw},
                                 {a.q, a.b, a.h, q_box, type, &g.ql},
                                 {a.k, a.b, a.hkv, kv_box, type, &g.kl},
                                 {a.v, a.b, a.hkv, kv_box, type, &g.vl}});
      !s.ok()) {
    return s;
  }
  return sp::Launch(kOp, at, g.c, a.dtype, a.d, [&](auto cfg) {
    using C = decltype(cfg);
    return ua::launch<typename C::T, C::D>(g, at.stream, at.device);
  });
}

namespace {

ffi::Error UlyssesAttnCuda(cudaStream_t stream, int32_t device, CommState* state,
                           ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> rank, ffi::Result<ffi::AnyBuffer> o,
                           ffi::Result<ffi::AnyBuffer> lse, int64_t /*comm_id*/, float scale,
                           int64_t causal, int64_t num_comm_sms) {
  return sp::Run(
      sp::Call{stream, device, state, rank, scale, causal, num_comm_sms}, kOpUlyssesAttn, kOp,
      "pk.ulysses_attention: expected q and o [B, S/P, H, D], k and v [B, S/P, Hkv, D] of "
      "one 2-byte dtype, lse float32.",
      LaunchUlyssesAttn, [&](const CommView&, UlyssesAttnArgs* a) {
        if (!BindQkv(q, k, v, a) || o->element_type() != q.element_type() ||
            lse->element_type() != ffi::DataType::F32) {
          return false;
        }
        a->o = o->untyped_data();
        a->lse = static_cast<float*>(lse->untyped_data());
        return true;
      });
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
PK_FFI_REGISTER(pk_ffi::kOpUlyssesAttn, "CUDA", PkUlyssesAttn);
