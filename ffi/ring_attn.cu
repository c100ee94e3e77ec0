// FFI handler and launcher of pk_ring_attn: the fused ring attention forward (see
// cuda/kernels/ring_attn.cuh). Launches on XLA's stream; no host synchronisation.
#include "kernels/ring_attn.cuh"
#include "mask_args.h"
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
  if (a.masked) {
    if (Status s = CheckMasks("pk." + std::string(kOp), a); !s.ok()) return s;
  }
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

  ra::masked_globals g{};
  tp::View(kOpRingAttn, op_table::kRingSlots.base, v, a.rank, &g.c);
  g.d = pk::attention::dims{int(a.b), int(a.s), int(a.h), int(a.hkv), a.scale, a.causal ? 1 : 0};
  // The unmasked kernel takes zigzag with causal only (the one mask by position it has); the
  // masked kernel with any (the caller passes zigzag = 0 when no mask is by position).
  g.zigzag = (a.causal || a.masked) && a.zigzag ? 1 : 0;
  if (a.masked) g.m = MaskArgs(a, a.s * P);
  g.comm_blocks = static_cast<int>(a.num_comm_sms);
  // The kernel's query rows and keys per tile (ra::block_rows, ra::block_keys; the masked
  // kernel: 128 and 128), the maps' boxes.
  const uint32_t rows = a.masked ? 128 : ra::block_rows(int(a.d), a.causal);
  const uint32_t keys = a.masked ? 128 : ra::block_keys(int(a.d), a.causal);
  g.q_tiles = static_cast<int>((a.s + rows - 1) / rows);
  const int64_t items = int64_t(g.q_tiles) * a.h * a.b;
  if (items > (INT32_MAX - ra::MAX_COMM) / 2) {  // the grid: C + G items blocks, G <= 2
    return sp::Invalid(kOp, "sizes too large (query tiles x heads x batch below 2^30).");
  }
  ra::set_chunks(g, a.s);
  g.block_bytes = block_bytes;
  // Step groups where ra::step_groups takes them (its rule says why; at.num_sms is the device's
  // or the emulated rank's, cached by the caller) and the workspace holds their states past the
  // K/V slots; else one group (the same result, less overlap).
  const uint64_t slots_end = uint64_t(P > 1 ? 2 * (P - 1) : 0) * block_bytes;
  g.groups = a.masked ? 1 : ra::step_groups(P, a.causal, items, at.num_sms - int(a.num_comm_sms));
  const uint64_t states_at = (slots_end + 255) / 256 * 256;
  const ra::state_sizes st = ra::state_bytes(g.groups, items, int(a.d), a.causal);
  if (states_at + st.records + st.flags > v.workspace_bytes) g.groups = 1;
  g.o = a.o;
  g.lse = a.lse;
  g.k_local = a.k;
  g.v_local = a.v;
  g.items = static_cast<int>(items);
  for (int i = 0; i <= g.groups; ++i) g.first_step[i] = i * P / g.groups;
  if (g.groups > 1) {
    char* const base = static_cast<char*>(v.workspace[v.rank]) + states_at;
    g.states = reinterpret_cast<float4*>(base);
    g.state_full = reinterpret_cast<uint64_t*>(base + st.records);
    g.state_flags = static_cast<int64_t>(st.flags / sizeof(uint64_t));
  }
  char* ws = static_cast<char*>(v.workspace[v.rank]);
  const int64_t slots = P > 1 ? int64_t(P - 1) * a.b : a.b;
  const int type = sp::MapType(a.dtype);
  // At P = 1 there are no slots: their maps are never used, and any valid map will do.
  if (Status s = sp::EncodeMaps(
          kOp, a.s, a.d,
          {{a.q, a.b, a.h, rows, type, &g.q},
           {a.k, a.b, a.hkv, keys, type, &g.k},
           {a.v, a.b, a.hkv, keys, type, &g.v},
           {P > 1 ? ws : a.k, slots, a.hkv, keys, type, &g.ks},
           {P > 1 ? ws + uint64_t(P - 1) * block_bytes : a.v, slots, a.hkv, keys, type, &g.vs}});
      !s.ok()) {
    return s;
  }
  return sp::Launch(kOp, at, g.c, a.dtype, a.d, [&](auto cfg) {
    using C = decltype(cfg);
    if (a.masked) return ra::launch_masked<typename C::T, C::D>(g, at.stream, at.device);
    return ra::launch<typename C::T, C::D>(g, at.stream, at.device);
  });
}

namespace {

// The mask operands after the rank (RemainingArgs: none unmasked; q_len, kv_len and, with
// segments, q_seg, kv_seg, q_info, kv_info over the whole sequence), checked into `a`.
bool BindMasks(const ffi::RemainingArgs& masks, RingAttnArgs* a, int world) {
  const size_t want = a->masked ? (a->segments ? 6 : 2) : 0;
  if (masks.size() != want) return false;
  if (!a->masked) return true;
  const int64_t sp = (a->s * world + 127) / 128 * 128;
  auto int32_arg = [&](size_t i, int64_t count, const int32_t** out) {
    ffi::AnyBuffer x = *masks.get<ffi::AnyBuffer>(i);
    if (x.element_type() != ffi::DataType::S32 || int64_t(x.element_count()) != count) {
      return false;
    }
    *out = static_cast<const int32_t*>(x.untyped_data());
    return true;
  };
  if (!int32_arg(0, a->b, &a->q_len) || !int32_arg(1, a->b, &a->kv_len)) return false;
  return !a->segments ||
         (int32_arg(2, a->b * sp, &a->q_seg) && int32_arg(3, a->b * sp, &a->kv_seg) &&
          int32_arg(4, a->b * (sp / 64) * 4, &a->q_info) &&
          int32_arg(5, a->b * (sp / 64) * 4, &a->kv_info));
}

ffi::Error RingAttnCuda(cudaStream_t stream, int32_t device, CommState* state, ffi::AnyBuffer q,
                        ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> rank,
                        ffi::RemainingArgs masks, ffi::Result<ffi::AnyBuffer> o,
                        ffi::Result<ffi::AnyBuffer> lse, int64_t /*comm_id*/, float scale,
                        int64_t causal, int64_t zigzag, int64_t num_comm_sms, int64_t masked,
                        int64_t window_left, int64_t window_right, float soft_cap,
                        int64_t segments) {
  RingAttnArgs init{};
  init.masked = masked != 0;
  init.segments = init.masked && segments != 0;
  return sp::Run(
      sp::Call{stream, device, state, rank, scale, causal, num_comm_sms}, kOpRingAttn, kOp,
      "pk.ring_attention: expected q and o [B, S/P, H, D], k and v [B, S/P, Hkv, D] of one "
      "2-byte dtype, lse float32; masked: q_len, kv_len int32 [B] and, with segments, q_seg, "
      "kv_seg int32 [B, SP], q_info, kv_info int32 [B, SP / 64, 4] (SP = S rounded up to 128).",
      LaunchRingAttn, [&](const CommView& view, RingAttnArgs* a) {
        if (!BindQkv(q, k, v, a) || o->element_type() != q.element_type() ||
            lse->element_type() != ffi::DataType::F32) {
          return false;
        }
        a->o = o->untyped_data();
        a->lse = static_cast<float*>(lse->untyped_data());
        a->zigzag = zigzag != 0;
        if (a->masked) {
          a->window_left = window_left;
          a->window_right = window_right;
          a->soft_cap = soft_cap;
        }
        return BindMasks(masks, a, view.world);
      },
      init);
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
                                  .RemainingArgs()  // masked: q_len, kv_len (+ q_seg, kv_seg,
                                                    // q_info, kv_info with segments)
                                  .Ret<xla::ffi::AnyBuffer>()              // o [B, S/P, H, D]
                                  .Ret<xla::ffi::AnyBuffer>()              // lse f32 [B, H, S/P]
                                  .Attr<int64_t>("comm_id")                // comm_id
                                  .Attr<float>("scale")                    // multiplies q . k
                                  .Attr<int64_t>("causal")                 // 1: causal mask
                                  .Attr<int64_t>("zigzag")                 // 1: zigzag layout
                                  .Attr<int64_t>("num_comm_sms")           // comm blocks
                                  .Attr<int64_t>("masked")        // 1: the masked kernel
                                  .Attr<int64_t>("window_left")   // masked: S, S for none
                                  .Attr<int64_t>("window_right")
                                  .Attr<float>("soft_cap")        // masked: 0 for none
                                  .Attr<int64_t>("segments"),     // masked: ids given
                              PK_FFI_COMM_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpRingAttn, "CUDA", PkRingAttn);
