// FFI handler and launcher of pk_attention: flash attention on one GPU, forward and backward in
// one target (attribute `backward`), with or without masks (attribute `masked`: the masked
// kernels, their operands after the pass's own), see cuda/kernels/attention.cuh. Operands are
// read through 4-D tensor maps encoded here on every call.
#include <algorithm>
#include <cmath>
#include <string>

#include "ffi_util.h"
#include "kernels/attention.cuh"
#include "launch.h"
#include "mask_args.h"
#include "tensor_map.h"

namespace pk_ffi {
namespace {

// The operands' 4-D map (tensor_map.h Map4d): one swizzled panel of `rows` positions of one head
// (dtype 2: float32, dq_acc).
Status Map(const void* ptr, int64_t b, int64_t s, int64_t heads, int64_t d, int rows, int dtype,
           CUtensorMap* out) {
  return Map4d("attention", ptr, b, s, heads, d, uint32_t(rows), dtype, out);
}

template <typename T>
cudaError_t Launch(const AttnArgs& a, const pk::attention::fwd_globals* f,
                   const pk::attention::bwd_globals* g, cudaStream_t stream, int device) {
  if (a.d == 64) {
    return f ? pk::attention::launch_fwd<T, 64>(*f, stream, device)
             : pk::attention::launch_bwd<T, 64>(*g, stream, device);
  }
  return f ? pk::attention::launch_fwd<T, 128>(*f, stream, device)
           : pk::attention::launch_bwd<T, 128>(*g, stream, device);
}

// The masked kernels: f or g also carries the masks (fwd_masked_globals, bwd_masked_globals).
template <typename T>
cudaError_t LaunchMasked(const AttnArgs& a, const pk::attention::fwd_masked_globals* f,
                         const pk::attention::bwd_masked_globals* g, cudaStream_t stream,
                         int device) {
  if (a.d == 64) {
    return f ? pk::attention::launch_fwd_masked<T, 64>(*f, stream, device)
             : pk::attention::launch_bwd_masked<T, 64>(*g, stream, device);
  }
  return f ? pk::attention::launch_fwd_masked<T, 128>(*f, stream, device)
           : pk::attention::launch_bwd_masked<T, 128>(*g, stream, device);
}

}  // namespace

Status LaunchAttention(const Where& at, const AttnArgs& a) {
  if (a.dtype != DType::kBF16 && a.dtype != DType::kF16) {
    return Status::Invalid("pk_attention: q, k and v must all be bf16 or all fp16.");
  }
  if (a.d != 64 && a.d != 128) {
    return Status::Invalid("pk_attention: head_dim must be 64 or 128, got " +
                           std::to_string(a.d));
  }
  if (a.hkv < 1 || a.h % a.hkv != 0) {
    return Status::Invalid("pk_attention: the K/V heads must divide the query heads.");
  }
  if (a.b == 0 || a.s == 0 || a.h == 0) return Status::Ok();
  if (a.b > 65535 || a.h > 65535 || a.s * a.h * a.d > INT32_MAX || a.s > INT32_MAX / 2) {
    return Status::Invalid("pk_attention: sizes too large (batch and heads below 65536, "
                           "S * H * D below 2^31).");
  }
  if (a.backward && a.sp < (a.s + 127) / 128 * 128) {
    return Status::Invalid("pk_attention: lse and delta must be padded to S rounded up to 128.");
  }
  if (a.backward && a.dq_acc == nullptr) {
    return Status::Invalid("pk_attention: the backward needs dq_acc, a float32 scratch of q's "
                           "shape.");
  }
  if (a.masked) {
    if (Status s = CheckMasks("pk_attention", a); !s.ok()) return s;
  }
  const int type = a.dtype == DType::kBF16 ? 0 : 1;
  pk::attention::dims dm{int(a.b), int(a.s), int(a.h), int(a.hkv), a.scale, a.causal ? 1 : 0};
  cudaError_t err;
  if (!a.backward) {
    pk::attention::fwd_masked_globals f{};
    f.o = a.o;
    f.lse = a.lse;
    f.d = dm;
    const int q_rows = a.masked ? pk::attention::fwd_masked_rows(int(a.d), a.soft_cap > 0.f)
                                : pk::attention::fwd_block_rows(int(a.d));
    if (Status s = Map(a.q, a.b, a.s, a.h, a.d, q_rows, type, &f.q); !s.ok()) return s;
    const int kv_rows = a.masked ? pk::attention::fwd_masked_keys()
                                 : pk::attention::fwd_block_keys(int(a.d), a.causal);
    if (Status s = Map(a.k, a.b, a.s, a.hkv, a.d, kv_rows, type, &f.k); !s.ok()) return s;
    if (Status s = Map(a.v, a.b, a.s, a.hkv, a.d, kv_rows, type, &f.v); !s.ok()) return s;
    if (a.masked) {
      f.m = MaskArgs(a, a.s);
      err = type == 0 ? LaunchMasked<__nv_bfloat16>(a, &f, nullptr, at.stream, at.device)
                      : LaunchMasked<__half>(a, &f, nullptr, at.stream, at.device);
    } else {
      err = type == 0 ? Launch<__nv_bfloat16>(a, &f, nullptr, at.stream, at.device)
                      : Launch<__half>(a, &f, nullptr, at.stream, at.device);
    }
  } else {
    pk::attention::bwd_masked_globals g{};
    g.lse = a.lse_in;
    g.delta = a.delta;
    g.sp = int(a.sp);
    g.dq = a.dq;
    g.dk = a.dk;
    g.dv = a.dv;
    g.dq_acc = a.dq_acc;
    g.d = dm;
    const struct {
      const void* ptr;
      int64_t heads;
      int rows;
      CUtensorMap* out;
    } maps[] = {{a.q, a.h, 64, &g.q64}, {a.d_o, a.h, 64, &g.do64}, {a.k, a.hkv, 128, &g.k128},
                {a.v, a.hkv, 128, &g.v128}};
    for (const auto& m : maps) {
      if (Status s = Map(m.ptr, a.b, a.s, m.heads, a.d, m.rows, type, m.out); !s.ok()) {
        return s;
      }
    }
    // dq_acc, float32: the dQ reductions' boxes of 64 query rows.
    if (Status s = Map(a.dq_acc, a.b, a.s, a.h, a.d, 64, 2, &g.dq32); !s.ok()) return s;
    if (a.masked) {
      g.m = MaskArgs(a, a.s);
      err = type == 0 ? LaunchMasked<__nv_bfloat16>(a, nullptr, &g, at.stream, at.device)
                      : LaunchMasked<__half>(a, nullptr, &g, at.stream, at.device);
    } else {
      err = type == 0 ? Launch<__nv_bfloat16>(a, nullptr, &g, at.stream, at.device)
                      : Launch<__half>(a, nullptr, &g, at.stream, at.device);
    }
  }
  return CudaStatus(err, "attention");
}

namespace {

ffi::Error AttentionCuda(cudaStream_t stream, int32_t device, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, float scale, int64_t causal,
                         int64_t backward, int64_t masked, int64_t window_left,
                         int64_t window_right, float soft_cap, int64_t segments) {
  AttnArgs a{};
  a.backward = backward != 0;
  a.masked = masked != 0;
  a.segments = a.masked && segments != 0;
  MarkFields(kOpAttention, &a);  // after the flags, which decide the fields
  a.causal = causal != 0;
  a.scale = scale;
  const size_t own = a.backward ? 6 : 3;  // the pass's operands; the masks' follow
  const size_t want_args = own + (a.masked ? 2 : 0) + (a.segments ? 4 : 0);
  const size_t want_rets = a.backward ? 4 : 2;
  if (args.size() != want_args || rets.size() != want_rets) {
    return ffi::Error::InvalidArgument(
        "pk_attention: expected (q, k, v) -> (o, lse) forward, (q, k, v, do, lse, delta) -> "
        "(dq, dk, dv, dq_acc) backward, masked with (q_len, kv_len) after them and, with "
        "segments, (q_seg, kv_seg, q_info, kv_info).");
  }
  ffi::AnyBuffer q = *args.get<ffi::AnyBuffer>(0), k = *args.get<ffi::AnyBuffer>(1),
                 v = *args.get<ffi::AnyBuffer>(2);
  if (!BindQkv(q, k, v, &a)) {
    return ffi::Error::InvalidArgument(
        "pk_attention: expected q [B, S, H, D], k and v [B, S, Hkv, D], all bf16 or all fp16.");
  }
  if (!a.backward) {
    a.o = (*rets.get<ffi::AnyBuffer>(0))->untyped_data();
    ffi::Result<ffi::AnyBuffer> lse = *rets.get<ffi::AnyBuffer>(1);
    if (lse->element_type() != ffi::DataType::F32) {
      return ffi::Error::InvalidArgument("pk_attention: lse must be float32 [B, H, S].");
    }
    a.lse = static_cast<float*>(lse->untyped_data());
  } else {
    ffi::AnyBuffer d_o = *args.get<ffi::AnyBuffer>(3), lse = *args.get<ffi::AnyBuffer>(4),
                   delta = *args.get<ffi::AnyBuffer>(5);
    if (d_o.element_type() != q.element_type() || lse.element_type() != ffi::DataType::F32 ||
        delta.element_type() != ffi::DataType::F32 || lse.dimensions().size() != 3) {
      return ffi::Error::InvalidArgument(
          "pk_attention: do must match q; lse and delta must be float32 [B, H, SP].");
    }
    a.d_o = d_o.untyped_data();
    a.lse_in = static_cast<const float*>(lse.untyped_data());
    a.delta = static_cast<const float*>(delta.untyped_data());
    a.sp = lse.dimensions()[2];
    a.dq = (*rets.get<ffi::AnyBuffer>(0))->untyped_data();
    a.dk = (*rets.get<ffi::AnyBuffer>(1))->untyped_data();
    a.dv = (*rets.get<ffi::AnyBuffer>(2))->untyped_data();
    ffi::Result<ffi::AnyBuffer> acc = *rets.get<ffi::AnyBuffer>(3);  // dq's float32 scratch
    if (acc->element_type() != ffi::DataType::F32 ||
        acc->element_count() != size_t(a.b * a.s * a.h * a.d)) {
      return ffi::Error::InvalidArgument("pk_attention: dq_acc must be float32 of q's shape.");
    }
    a.dq_acc = static_cast<float*>(acc->untyped_data());
  }
  if (a.masked) {
    a.window_left = window_left;
    a.window_right = window_right;
    a.soft_cap = soft_cap;
    const int64_t sp = (a.s + 127) / 128 * 128;
    // int32 operands of `count` elements, in order after the pass's own.
    auto int32_arg = [&](size_t i, int64_t count, const int32_t** out) {
      ffi::AnyBuffer x = *args.get<ffi::AnyBuffer>(i);
      if (x.element_type() != ffi::DataType::S32 || int64_t(x.element_count()) != count) {
        return false;
      }
      *out = static_cast<const int32_t*>(x.untyped_data());
      return true;
    };
    if (!int32_arg(own, a.b, &a.q_len) || !int32_arg(own + 1, a.b, &a.kv_len)) {
      return ffi::Error::InvalidArgument("pk_attention: q_len and kv_len must be int32 [B].");
    }
    if (a.segments &&
        (!int32_arg(own + 2, a.b * sp, &a.q_seg) || !int32_arg(own + 3, a.b * sp, &a.kv_seg) ||
         !int32_arg(own + 4, a.b * (sp / 64) * 4, &a.q_info) ||
         !int32_arg(own + 5, a.b * (sp / 64) * 4, &a.kv_info))) {
      return ffi::Error::InvalidArgument(
          "pk_attention: q_seg and kv_seg must be int32 [B, SP], q_info and kv_info int32 "
          "[B, SP / 64, 4], SP = S rounded up to 128.");
    }
  }
  if (ffi::Error e = CheckFilled(kOpAttention, a); e.failure()) return e;
  return ToError(LaunchAttention(Where{stream, device, 0}, a));
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkAttention, pk_ffi::AttentionCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .RemainingArgs()  // q, k, v (+ do, lse, delta backward;
                                                    // + the masks' operands, masked)
                                  .RemainingRets()  // o, lse (dq, dk, dv, dq_acc backward)
                                  .Attr<float>("scale")       // multiplies q . k
                                  .Attr<int64_t>("causal")    // 1: query i sees keys 0..i
                                  .Attr<int64_t>("backward")  // 0 forward, 1 backward
                                  .Attr<int64_t>("masked")    // 1: the masked kernels
                                  .Attr<int64_t>("window_left")   // masked: S, S for none
                                  .Attr<int64_t>("window_right")
                                  .Attr<float>("soft_cap")        // masked: 0 for none
                                  .Attr<int64_t>("segments"),     // masked: ids given
                              PK_FFI_CUDA_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpAttention, "CUDA", PkAttention);
