// FFI handler and launcher of pk_ring_attn: the fused ring attention forward (see
// cuda/kernels/ring_attn.cuh). Launches on XLA's stream; no host synchronisation.
#include "kernels/ring_attn.cuh"
#include "sp_handler.h"

namespace pk_ffi {
namespace {

namespace ra = pk::ring_attn;

// The kernel's slot range and limits are the op table's (op_table.h).
static_assert(op_table::kRingSlots.Is(ra::SLOT_BASE, ra::OP_SLOTS) &&
              ra::MAX_PEERS == op_table::kMaxPeers && ra::MAX_COMM == op_table::kAttnMaxCommSms);

constexpr char kOp[] = "ring_attention";

}  // namespace

Status LaunchRingAttn(const Where& at, const RingAttnArgs& a, const CommView& v) {
  if (Status s = sp::CheckComm(kOp, op_table::kRingSlots, v); !s.ok()) return s;
  if (Status s = sp::CheckOperands(kOp, "q, k and v", a.dtype, a.d, a.h, a.hkv); !s.ok()) {
    return s;
  }
  if (a.zigzag && a.s % 2 != 0) {
    return sp::Invalid(kOp, "zigzag needs an even local sequence length.");
  }
  if (Status s = sp::CheckCommSms(kOp, a.num_comm_sms); !s.ok()) return s;
  if (a.b < 0 || a.s < 0 || a.h < 0 || a.b > 65535 || a.h > 65535 ||
      a.s * a.h * a.d > INT32_MAX || a.s * int64_t(v.world) > INT32_MAX / 2) {
    return sp::Invalid(kOp,
                       "sizes too large (batch and heads below 65536, S * H * D below 2^31).");
  }
  const int P = v.world;
  if (Status s = sp::WorkspaceCheck(kOp, WorkspaceNeed(kOpRingAttn, a, P),
                                    v.workspace_bytes, "2 (P-1) K/V blocks");
      !s.ok()) {
    return s;
  }
  if (sp::Empty(a)) return Status::Ok();
  const uint64_t block_bytes = uint64_t(a.b) * a.s * a.hkv * a.d * 2;

  ra::globals g{};
  tp::View(kOpRingAttn, op_table::kRingSlots.base, v, a.rank, &g.c);
  g.d = pk::attention::dims{int(a.b), int(a.s), int(a.h), int(a.hkv), a.scale, a.causal ? 1 : 0};
  g.zigzag = a.causal && a.zigzag ? 1 : 0;
  g.comm_blocks = static_cast<int>(a.num_comm_sms);
  g.q_tiles = static_cast<int>((a.s + 127) / 128);
  g.chunk_tiles = (g.q_tiles + ra::MAX_CHUNKS - 1) / ra::MAX_CHUNKS;
  g.n_chunks = (g.q_tiles + g.chunk_tiles - 1) / g.chunk_tiles;
  g.block_bytes = block_bytes;
  g.o = a.o;
  g.lse = a.lse;
  g.k_local = a.k;
  g.v_local = a.v;
  char* ws = static_cast<char*>(v.workspace[v.rank]);
  const int64_t slots = P > 1 ? int64_t(P - 1) * a.b : a.b;
  const int type = sp::MapType(a.dtype);
  // Panels of 128 positions. At P = 1 there are no slots: their maps are never used, and any
  // valid map will do.
  if (Status s = sp::EncodeMaps(
          kOp, a.s, a.d,
          {{a.q, a.b, a.h, 128, type, &g.q},
           {a.k, a.b, a.hkv, 128, type, &g.k},
           {a.v, a.b, a.hkv, 128, type, &g.v},
           {P > 1 ? ws : a.k, slots, a.hkv, 128, type, &g.ks},
           {P > 1 ? ws + uint64_t(P - 1) * block_bytes : a.v, slots, a.hkv, 128, type, &g.vs}});
      !s.ok()) {
    return s;
  }
  return sp::Launch(kOp, at, g.c, a.dtype, a.d, [&](auto cfg) {
    using C = decltype(cfg);
    return ra::launch<typename C::T, C::D>(g, at.stream, at.device);
  });
}

namespace {

ffi::Error RingAttnCuda(cudaStream_t stream, int32_t device, CommState* state, ffi::AnyBuffer q,
                        ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> rank,
                        ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                        int64_t /*comm_id*/, float scale, int64_t causal, int64_t zigzag,
                        int64_t num_comm_sms) {
  return sp::Run(
      sp::Call{stream, device, state, rank, scale, causal, num_comm_sms}, kOpRingAttn, kOp,
      "pk.ring_attention: expected q and o [B, S/P, H, D], k and v [B, S/P, Hkv, D] of one "
      "2-byte dtype, lse float32.",
      LaunchRingAttn, [&](const CommView&, RingAttnArgs* a) {
        if (!BindQkv(q, k, v, a) || o->element_type() != q.element_type() ||
            lse->element_type() != ffi::DataType::F32) {
          return false;
        }
        a->o = o->untyped_data();
        a->lse = static_cast<float*>(lse->untyped_data());
        a->zigzag = zigzag != 0;
        return true;
      });
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkRingAttn, pk_ffi::RingAttnCuda,
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
                                  .Attr<int64_t>("zigzag")                 // 1: zigzag layout
                                  .Attr<int64_t>("num_comm_sms"),          // comm blocks
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpRingAttn, "CUDA", PkRingAttn);
