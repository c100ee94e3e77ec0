// FFI handler and launcher of pk_ring_attn: the fused ring attention forward (see
// cuda/kernels/ring_attn.cuh). Launches on XLA's stream; no host synchronisation.
#include <string>

#include "comm_state.h"
#include "ffi_util.h"
#include "kernels/ring_attn.cuh"
#include "launch.h"
#include "tensor_map.h"
#include "tp.h"

namespace pk_ffi {
namespace {

// The kernel's slot range and limits are the op table's (op_table.h).
static_assert(op_table::kRingSlots.Is(pk::ring_attn::SLOT_BASE, pk::ring_attn::OP_SLOTS) &&
              pk::ring_attn::MAX_PEERS == op_table::kMaxPeers &&
              pk::ring_attn::MAX_COMM == op_table::kAttnMaxCommSms);

Status Invalid(const std::string& what) {
  return Status::Invalid("pk.ring_attention: " + what);
}

// The 4-D map of an operand or slot section (tensor_map.h Map4d), panels of 128 positions.
Status Map(const void* ptr, int64_t batch, int64_t s, int64_t heads, int64_t d, int dtype,
           CUtensorMap* out) {
  return Map4d("ring_attention", ptr, batch, s, heads, d, 128, dtype, out);
}

}  // namespace

Status LaunchRingAttn(const Where& at, const RingAttnArgs& a, const CommView& v) {
  namespace ra = pk::ring_attn;
  if (Status s = CheckRecord("ring_attention", v); !s.ok()) return s;
  if (v.signal_count < op_table::kRingSlots.end()) {
    return Invalid("the signal pad has " + std::to_string(v.signal_count) +
                   " slots, the kernel needs " +
                   std::to_string(op_table::kRingSlots.end()));
  }
  if (v.world > ra::MAX_PEERS) return Invalid("at most " + std::to_string(ra::MAX_PEERS) + " ranks");
  if (a.dtype != DType::kBF16 && a.dtype != DType::kF16) {
    return Invalid("q, k and v must all be bf16 or all fp16.");
  }
  if (a.d != 64 && a.d != 128) return Invalid("head_dim must be 64 or 128, got " + std::to_string(a.d));
  if (a.hkv < 1 || a.h % a.hkv != 0) return Invalid("the K/V heads must divide the query heads.");
  if (a.zigzag && a.s % 2 != 0) return Invalid("zigzag needs an even local sequence length.");
  if (a.num_comm_sms < 1 || a.num_comm_sms > ra::MAX_COMM) {
    return Invalid("num_comm_sms must be in 1.." + std::to_string(ra::MAX_COMM) + ", got " +
                   std::to_string(a.num_comm_sms));
  }
  if (a.b < 0 || a.s < 0 || a.h < 0 || a.b > 65535 || a.h > 65535 ||
      a.s * a.h * a.d > INT32_MAX || a.s * int64_t(v.world) > INT32_MAX / 2) {
    return Invalid("sizes too large (batch and heads below 65536, S * H * D below 2^31).");
  }
  const int P = v.world;
  const uint64_t block_bytes = uint64_t(a.b) * a.s * a.hkv * a.d * 2;
  const uint64_t need = 2 * uint64_t(P - 1) * block_bytes;
  if (need > v.workspace_bytes) {
    return Invalid("the symmetric workspace has " + std::to_string(v.workspace_bytes) +
                   " bytes and this call needs " + std::to_string(need) +
                   " (2 (P-1) K/V blocks); call pk.init(mesh, workspace_bytes=...) with at "
                   "least that.");
  }
  // Every check above depends on shapes, attributes and the world only: every rank refuses or
  // runs the call alike, so the epochs stay in step.
  if (a.b == 0 || a.s == 0 || a.h == 0) return Status::Ok();

  pk::ring_attn::globals g{};
  pk::tp::comm& c = g.c;
  tp::View(kOpRingAttn, op_table::kRingSlots.base, v, a.rank, &c);
  const int type = a.dtype == DType::kBF16 ? 0 : 1;
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
  if (Status s = Map(a.q, a.b, a.s, a.h, a.d, type, &g.q); !s.ok()) return s;
  if (Status s = Map(a.k, a.b, a.s, a.hkv, a.d, type, &g.k); !s.ok()) return s;
  if (Status s = Map(a.v, a.b, a.s, a.hkv, a.d, type, &g.v); !s.ok()) return s;
  // P = 1: no slots (the maps are never used; any valid map will do).
  if (Status s = Map(P > 1 ? ws : a.k, slots, a.s, a.hkv, a.d, type, &g.ks); !s.ok()) return s;
  if (Status s = Map(P > 1 ? ws + uint64_t(P - 1) * block_bytes : a.v, slots, a.s, a.hkv,
                       a.d, type, &g.vs);
      !s.ok()) {
    return s;
  }
  if (Status s = tp::StartEpoch(at.stream, c); !s.ok()) return s;
  cudaError_t err;
  if (type == 0) {
    err = a.d == 64 ? pk::ring_attn::launch<__nv_bfloat16, 64>(g, at.stream, at.device)
                    : pk::ring_attn::launch<__nv_bfloat16, 128>(g, at.stream, at.device);
  } else {
    err = a.d == 64 ? pk::ring_attn::launch<__half, 64>(g, at.stream, at.device)
                    : pk::ring_attn::launch<__half, 128>(g, at.stream, at.device);
  }
  return CudaStatus(err, "ring_attention");
}

namespace {

ffi::Error RingAttnCuda(cudaStream_t stream, int32_t device, CommState* state,
                        ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::Buffer<ffi::S32> rank,
                        ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                        int64_t /*comm_id*/, float scale, int64_t causal, int64_t zigzag,
                        int64_t num_comm_sms) {
  const CommView* view = nullptr;
  if (ffi::Error e = BindComm("ring_attention", state, device, &view); e.failure()) return e;
  RingAttnArgs a{};
  if (!BindQkv(q, k, v, &a) || o->element_type() != q.element_type() ||
      lse->element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument(
        "pk.ring_attention: expected q and o [B, S/P, H, D], k and v [B, S/P, Hkv, D] of one "
        "2-byte dtype, lse float32.");
  }
  a.o = o->untyped_data();
  a.lse = static_cast<float*>(lse->untyped_data());
  a.rank = rank.typed_data();
  a.scale = scale;
  a.causal = causal != 0;
  a.zigzag = zigzag != 0;
  a.num_comm_sms = num_comm_sms;
  return ToError(LaunchRingAttn(Where{stream, device, 0}, a, *view));
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
