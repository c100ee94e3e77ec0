// FFI handler and launcher of pk_ring_attn_bwd: the fused ring attention backward (see
// cuda/kernels/ring_attn_bwd.cuh). Launches on XLA's stream; no host synchronisation.
#include "kernels/ring_attn_bwd.cuh"
#include "sp_handler.h"

namespace pk_ffi {
namespace {

namespace ra = pk::ring_attn;
namespace rb = pk::ring_attn_bwd;

constexpr char kOp[] = "ring_attention (backward)";
constexpr char kFamily[] = "ring_attention";  // the name in BindComm's and the maps' errors

}  // namespace

Status LaunchRingAttnBwd(const Where& at, const RingAttnBwdArgs& a, const CommView& v) {
  if (Status s = sp::CheckComm(kOp, op_table::kRingSlots, v); !s.ok()) return s;
  if (v.world < 2) return sp::Invalid(kOp, "the fused backward needs at least 2 ranks.");
  if (Status s = sp::CheckOperands(kOp, "q, k, v and dO", a.dtype, a.d, a.h, a.hkv); !s.ok()) {
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
  const int64_t q_tiles = (a.s + 127) / 128;
  const int64_t items = q_tiles * a.hkv * a.b;
  if (items > int64_t(rb::MAX_LANES) * rb::MAX_ITEMS_PER_LANE) {
    return sp::Invalid(
        kOp, "too many 128-key tiles (ceil(S/P / 128) Hkv B) for the dK/dV lanes.");
  }
  const uint64_t block_bytes = uint64_t(a.b) * a.s * a.hkv * a.d * 2;
  if (Status s = sp::WorkspaceCheck(
          kOp, WorkspaceNeed(kOpRingAttnBwd, a, P), v.workspace_bytes,
          "2 (P-1) K/V blocks, P fp32 dK/dV blocks and an fp32 dQ");
      !s.ok()) {
    return s;
  }
  if (sp::Empty(a)) return Status::Ok();

  rb::globals g{};
  ra::globals& f = g.f;
  // The forward's range and epoch.
  tp::View(kOpRingAttnBwd, op_table::kRingSlots.base, v, a.rank, &f.c);
  f.d = pk::attention::dims{int(a.b), int(a.s), int(a.h), int(a.hkv), a.scale, a.causal ? 1 : 0};
  f.zigzag = a.causal && a.zigzag ? 1 : 0;
  f.comm_blocks = static_cast<int>(a.num_comm_sms);
  f.q_tiles = static_cast<int>(q_tiles);
  ra::set_chunks(f, a.s);
  f.block_bytes = block_bytes;
  f.k_local = a.k;
  f.v_local = a.v;
  g.lse = a.lse;
  g.delta = a.delta;
  g.sp = static_cast<int>(q_tiles * 128);
  g.dq = a.dq;
  g.dk = a.dk;
  g.dv = a.dv;
  g.n_items = static_cast<int>(items);
  g.lanes = static_cast<int>(items < rb::MAX_LANES ? items : rb::MAX_LANES);
  g.acc_off = 2 * uint64_t(P - 1) * block_bytes;
  g.acc_slot_bytes = uint64_t(items) * 2 * 128 * a.d * 4;
  char* ws = static_cast<char*>(v.workspace[v.rank]);
  g.dq_acc = reinterpret_cast<float*>(ws + g.acc_off + uint64_t(P) * g.acc_slot_bytes);
  const int64_t slots = int64_t(P - 1) * a.b;
  char* vs = ws + uint64_t(P - 1) * block_bytes;
  const int type = sp::MapType(a.dtype);
  if (Status s = sp::EncodeMaps(kFamily, a.s, a.d,
                                {{a.q, a.b, a.h, 64, type, &g.q64},
                                 {a.d_o, a.b, a.h, 64, type, &g.do64},
                                 {a.k, a.b, a.hkv, 128, type, &f.k},
                                 {a.v, a.b, a.hkv, 128, type, &f.v},
                                 {ws, slots, a.hkv, 128, type, &f.ks},
                                 {vs, slots, a.hkv, 128, type, &f.vs},
                                 // float32: the dQ reductions' boxes
                                 {g.dq_acc, a.b, a.h, 64, 2, &g.dq32}});
      !s.ok()) {
    return s;
  }
  return sp::Launch(kOp, at, f.c, a.dtype, a.d, [&](auto cfg) {
    using C = decltype(cfg);
    return rb::launch<typename C::T, C::D>(g, at.stream, at.device);
  });
}

namespace {

ffi::Error RingAttnBwdCuda(cudaStream_t stream, int32_t device, CommState* state,
                           ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer d_o, ffi::Buffer<ffi::F32> lse,
                           ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::S32> rank,
                           ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                           ffi::Result<ffi::AnyBuffer> dv, int64_t /*comm_id*/, float scale,
                           int64_t causal, int64_t zigzag, int64_t num_comm_sms) {
  return sp::Run(
      sp::Call{stream, device, state, rank, scale, causal, num_comm_sms}, kOpRingAttnBwd, kFamily,
      "pk.ring_attention (backward): expected q, dO [B, S/P, H, D], k and v "
      "[B, S/P, Hkv, D] and the gradients like them, of one 2-byte dtype; lse and delta "
      "float32 [B, H, S/P rounded up to 128].",
      LaunchRingAttnBwd, [&](const CommView&, RingAttnBwdArgs* a) {
        const ffi::DataType dt = q.element_type();
        const auto qd = q.dimensions(), od = d_o.dimensions(), ld = lse.dimensions(),
                   dd = delta.dimensions();
        if (!BindQkv(q, k, v, a) || d_o.element_type() != dt || dq->element_type() != dt ||
            dk->element_type() != dt || dv->element_type() != dt || od.size() != 4 ||
            ld.size() != 3 || dd.size() != 3 || od[0] != qd[0] || od[1] != qd[1] ||
            od[2] != qd[2] || od[3] != qd[3] || ld[0] != qd[0] || ld[1] != qd[2] ||
            ld[2] != (qd[1] + 127) / 128 * 128 || dd[0] != ld[0] || dd[1] != ld[1] ||
            dd[2] != ld[2]) {
          return false;
        }
        a->d_o = d_o.untyped_data();
        a->lse = lse.typed_data();
        a->delta = delta.typed_data();
        a->dq = dq->untyped_data();
        a->dk = dk->untyped_data();
        a->dv = dv->untyped_data();
        a->zigzag = zigzag != 0;
        return true;
      });
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkRingAttnBwd, pk_ffi::RingAttnBwdCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()              // q [B, S/P, H, D]
                                  .Arg<xla::ffi::AnyBuffer>()              // k [B, S/P, Hkv, D]
                                  .Arg<xla::ffi::AnyBuffer>()              // v [B, S/P, Hkv, D]
                                  .Arg<xla::ffi::AnyBuffer>()              // dO [B, S/P, H, D]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // lse [B, H, SP]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // delta [B, H, SP]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // rank
                                  .Ret<xla::ffi::AnyBuffer>()              // dq like q
                                  .Ret<xla::ffi::AnyBuffer>()              // dk like k
                                  .Ret<xla::ffi::AnyBuffer>()              // dv like v
                                  .Attr<int64_t>("comm_id")                // comm_id
                                  .Attr<float>("scale")                    // multiplies q . k
                                  .Attr<int64_t>("causal")                 // 1: causal mask
                                  .Attr<int64_t>("zigzag")                 // 1: zigzag layout
                                  .Attr<int64_t>("num_comm_sms"),          // comm blocks
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpRingAttnBwd, "CUDA", PkRingAttnBwd);
