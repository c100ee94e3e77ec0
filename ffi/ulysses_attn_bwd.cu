// FFI handler and launcher of pk_ulysses_attn_bwd: the fused Ulysses attention backward (see
// cuda/kernels/ulysses_attn_bwd.cuh). Launches on XLA's stream; no host synchronisation.
#include "kernels/ulysses_attn_bwd.cuh"
#include "sp_handler.h"

namespace pk_ffi {
namespace {

namespace ub = pk::ulysses_attn_bwd;

constexpr char kOp[] = "ulysses_attention (backward)";
constexpr char kFamily[] = "ulysses_attention";  // the name in BindComm's and the maps' errors

}  // namespace

uint64_t WorkspaceNeed(int, const UlyssesAttnBwdArgs& a, int world) {
  return ub::make_layout(world, a.b, a.s, a.h, a.hkv, a.d).total;
}

Status LaunchUlyssesAttnBwd(const Where& at, const UlyssesAttnBwdArgs& a, const CommView& v) {
  if (Status s = CheckUlysses(kOp, a.dtype, a.d, a.h, a.hkv, a.num_comm_sms, v); !s.ok()) {
    return s;
  }
  const int P = v.world;
  if (P < 2) return sp::Invalid(kOp, "the fused backward needs at least 2 ranks.");
  const int64_t S = a.s * P;
  if (a.b < 0 || a.s < 0 || a.h < 0 || a.b > 65535 || a.h > 65535 ||
      a.b * S * (a.h / P) * a.d > INT32_MAX || S > INT32_MAX / 2) {
    // The tail kernel indexes the head group's B S H/P D elements in 32 bits.
    return sp::Invalid(
        kOp, "sizes too large (batch and heads below 65536, B * S * H/P * D below 2^31).");
  }
  const ub::layout ws = ub::make_layout(P, a.b, a.s, a.h, a.hkv, a.d);
  if (Status s = sp::WorkspaceCheck(kOp, WorkspaceNeed(kOpUlyssesAttnBwd, a, P),
                                    v.workspace_bytes,
                                    "the head group's dO, delta, float32 dq and dk, dv");
      !s.ok()) {
    return s;
  }
  if (sp::Empty(a)) return Status::Ok();

  ub::globals g{};
  tp::View(kOpUlyssesAttnBwd, op_table::kUlyssesSlots.base, v, a.rank, &g.c);
  const int64_t gh = a.h / P, gk = a.hkv / P;
  char* const mine = static_cast<char*>(v.workspace[v.rank]);
  pk::attention::bwd_globals& f = g.a;
  f.d = pk::attention::dims{int(a.b), int(S), int(gh), int(gk), a.scale, a.causal ? 1 : 0};
  f.sp = int((S + 127) / 128 * 128);
  f.lse = a.lse;
  f.delta = reinterpret_cast<const float*>(mine + ws.dlw);
  f.dq_acc = reinterpret_cast<float*>(mine + ws.dqa);
  f.dk = mine + ws.dkw;
  f.dv = mine + ws.dvw;
  g.d_o = a.d_o;
  g.delta = a.delta;
  g.dq = a.dq;
  g.dk = a.dk;
  g.dv = a.dv;
  g.sl = int(a.s);
  g.heads = int(a.h);
  g.kv_heads = int(a.hkv);
  g.head_dim = int(a.d);
  g.comm_blocks = int(a.num_comm_sms);
  g.key_blocks = int((S + 127) / 128);
  g.ws = ws;
  const int type = sp::MapType(a.dtype);
  if (Status s = sp::EncodeMaps(kFamily, S, a.d,
                                {{a.q, a.b, gh, 64, type, &f.q64},
                                 {mine + ws.dow, a.b, gh, 64, type, &f.do64},
                                 {a.k, a.b, gk, 128, type, &f.k128},
                                 {a.v, a.b, gk, 128, type, &f.v128},
                                 {mine + ws.dqa, a.b, gh, 64, 2, &f.dq32}});
      !s.ok()) {
    return s;
  }
  return sp::Launch(kOp, at, g.c, a.dtype, a.d, [&](auto cfg) {
    using C = decltype(cfg);
    return ub::launch<typename C::T, C::D>(g, at.stream, at.device);
  });
}

namespace {

ffi::Error UlyssesAttnBwdCuda(cudaStream_t stream, int32_t device, CommState* state,
                              ffi::AnyBuffer d_o, ffi::AnyBuffer q, ffi::AnyBuffer k,
                              ffi::AnyBuffer v, ffi::Buffer<ffi::F32> lse,
                              ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::S32> rank,
                              ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                              ffi::Result<ffi::AnyBuffer> dv, int64_t /*comm_id*/, float scale,
                              int64_t causal, int64_t num_comm_sms) {
  // q, k, v are head shards [B, S, H/P, D], [B, S, Hkv/P, D]; d_o and the gradients sequence
  // shards [B, S/P, H, D], [B, S/P, Hkv, D].
  return sp::Run(
      sp::Call{stream, device, state, rank, scale, causal, num_comm_sms}, kOpUlyssesAttnBwd,
      kFamily,
      "pk.ulysses_attention (backward): expected dO [B, S/P, H, D], the head shards q "
      "[B, S, H/P, D], k and v [B, S, Hkv/P, D] of one 2-byte dtype, lse float32 [B, H/P, S "
      "rounded up to 128], delta float32 [B, H, S/P], and dq, dk, dv like dO and the "
      "sequence shards of k, v.",
      LaunchUlyssesAttnBwd, [&](const CommView& view, UlyssesAttnBwdArgs* a) {
        const int64_t P = view.world;
        const ffi::DataType dt = d_o.element_type();
        const auto od = d_o.dimensions(), qd = q.dimensions(), kd = k.dimensions(),
                   ld = lse.dimensions(), dd = delta.dimensions(), kod = dk->dimensions();
        auto same = [](auto x, auto y) {
          if (x.size() != y.size()) return false;
          for (size_t i = 0; i < x.size(); ++i) {
            if (x[i] != y[i]) return false;
          }
          return true;
        };
        if (!BindQkv(q, k, v, a) || q.element_type() != dt || od.size() != 4 ||
            ld.size() != 3 || dd.size() != 3 || kod.size() != 4 || od[0] != qd[0] ||
            od[1] * P != qd[1] || od[2] != qd[2] * P || od[3] != qd[3] || ld[0] != qd[0] ||
            ld[1] != qd[2] || ld[2] != (qd[1] + 127) / 128 * 128 || dd[0] != od[0] ||
            dd[1] != od[2] || dd[2] != od[1] || dq->element_type() != dt ||
            dk->element_type() != dt || dv->element_type() != dt ||
            !same(dq->dimensions(), od) || kod[0] != od[0] || kod[1] != od[1] ||
            kod[2] != kd[2] * P || kod[3] != od[3] || !same(dv->dimensions(), kod)) {
          return false;
        }
        // BindQkv took q's head-shard shape; the launcher takes the sequence shards'.
        a->s = od[1];
        a->h = od[2];
        a->hkv = kod[2];
        a->d_o = d_o.untyped_data();
        a->lse = lse.typed_data();
        a->delta = delta.typed_data();
        a->dq = dq->untyped_data();
        a->dk = dk->untyped_data();
        a->dv = dv->untyped_data();
        return true;
      });
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkUlyssesAttnBwd, pk_ffi::UlyssesAttnBwdCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Ctx<PK_FFI_COMM_STATE>()  // the executable's communicator
                                  .Arg<xla::ffi::AnyBuffer>()              // dO [B, S/P, H, D]
                                  .Arg<xla::ffi::AnyBuffer>()              // q [B, S, H/P, D]
                                  .Arg<xla::ffi::AnyBuffer>()              // k [B, S, Hkv/P, D]
                                  .Arg<xla::ffi::AnyBuffer>()              // v like k
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // lse [B, H/P, SP]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // delta [B, H, S/P]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // rank
                                  .Ret<xla::ffi::AnyBuffer>()              // dq like dO
                                  .Ret<xla::ffi::AnyBuffer>()              // dk [B, S/P, Hkv, D]
                                  .Ret<xla::ffi::AnyBuffer>()              // dv like dk
                                  .Attr<int64_t>("comm_id")                // comm_id
                                  .Attr<float>("scale")                    // multiplies q . k
                                  .Attr<int64_t>("causal")                 // 1: causal mask
                                  .Attr<int64_t>("num_comm_sms"),          // comm blocks
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpUlyssesAttnBwd, "CUDA", PkUlyssesAttnBwd);
