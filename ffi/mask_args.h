// The attention masks' arguments as the masked kernels read them (pk::attn::mask_args), from an
// op's args (ffi/launch.h VisitMaskFields: AttnArgs, RingAttnArgs), and the checks every
// launcher of a masked kernel makes: pk_attention's (attention.cu) over its S positions, ring
// attention's (ring_attn.cu, ring_attn_bwd.cu) over the whole sequence of S/P * P positions.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "launch.h"
#include "pk/attn/masked.cuh"

namespace pk_ffi {

// The mask fields' checks (`op` names the op in the messages): the lengths given, a window of
// (left, right) >= 0, a finite cap >= 0 (0: none), and with segments their four operands.
template <class A>
Status CheckMasks(const std::string& op, const A& a) {
  if (a.q_len == nullptr || a.kv_len == nullptr) {
    return Status::Invalid(op + ": a masked call needs q_len and kv_len, int32 [B].");
  }
  if (a.window_left < 0 || a.window_right < 0) {
    return Status::Invalid(op + ": window_left and window_right must be >= 0 (S for no "
                           "window).");
  }
  if (!(a.soft_cap >= 0.f) || std::isinf(a.soft_cap)) {
    return Status::Invalid(op + ": soft_cap must be finite and >= 0 (0: no cap).");
  }
  if (a.segments && (a.q_seg == nullptr || a.kv_seg == nullptr || a.q_info == nullptr ||
                     a.kv_info == nullptr)) {
    return Status::Invalid(op + ": segments need q_seg, kv_seg, q_info and kv_info.");
  }
  return Status::Ok();
}

// The masks of `a` over a sequence of `s` positions (after CheckMasks): ids padded to
// sp = s rounded up to 128, the window clamped to s, the cap as its two factors.
template <class A>
pk::attn::mask_args MaskArgs(const A& a, int64_t s) {
  pk::attn::mask_args m{};
  m.q_len = a.q_len;
  m.kv_len = a.kv_len;
  m.sp = int((s + 127) / 128 * 128);
  m.left = int(std::min<int64_t>(a.window_left, s));
  m.right = int(std::min<int64_t>(a.window_right, s));
  m.cap_in = a.soft_cap > 0.f ? a.scale / a.soft_cap : 0.f;
  m.cap_out = a.soft_cap > 0.f ? a.soft_cap / a.scale : 0.f;
  m.segments = a.segments ? 1 : 0;
  if (a.segments) {
    m.q_seg = a.q_seg;
    m.kv_seg = a.kv_seg;
    m.q_info = reinterpret_cast<const pk::attn::masks::chunk_info*>(a.q_info);
    m.kv_info = reinterpret_cast<const pk::attn::masks::chunk_info*>(a.kv_info);
  }
  return m;
}

}  // namespace pk_ffi
