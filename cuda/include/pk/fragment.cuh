/**
 * @file fragment.cuh
 * @brief Register-fragment helpers for chained wgmmas (attention): row reductions over the
 * m64nN accumulator layout, rounding an fp32 accumulator into the register A operand of the
 * next wgmma, and the register-A wgmma itself.
 *
 * Accumulator layout (wgmma.cuh): thread t of the warpgroup holds rows
 * 16 * (t / 32) + (t % 32) / 4 + 8 * i (i = 0, 1) and, per row, columns
 * 8 * j + 2 * (t % 4) + c; element d[4j + 2i + c]. A row is thus spread over the 4 threads of
 * a quad (lanes 4q..4q+3), whose partial reductions combine with two xor shuffles.
 *
 * Register A operand of m64nNk16 (wgmma_rs.cuh): for k step kk, register x of 4 holds rows
 * (r, r + 8) and column pairs (0, 8) of the 64 x 16 slice in the same thread mapping, which is
 * exactly elements 8kk + 2x, 8kk + 2x + 1 of the accumulator of the product that made it: so
 * packed register n = (d[2n], d[2n + 1]) rounded to 16 bits, no data movement.
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>
#include <utility>

#include "pk/common.cuh"
#include "pk/wgmma_rs.cuh"

namespace pk::frag {

/** @brief Max over the 4 threads of a quad (one accumulator row). */
__device__ inline float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

/** @brief Sum over the 4 threads of a quad (one accumulator row). */
__device__ inline float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/** @brief 2^x on the special-function unit (flushes denormals; 2^-inf = 0). */
__device__ inline float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/** @brief Two floats rounded to T (bf16 or fp16) and packed into one 32-bit register. */
template <typename T>
__device__ inline uint32_t pack(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

/** @brief The accumulator `d` (N/2 floats) as the register A operand of the next wgmma. */
template <typename T, int R>
__device__ inline void to_a(uint32_t (&a)[R / 2], const float (&d)[R]) {
#pragma unroll
  for (int n = 0; n < R / 2; ++n) a[n] = pack<T>(d[2 * n], d[2 * n + 1]);
}

/** @brief Keeps the compiler from moving accesses of a register A operand across wgmma
 * boundaries (its registers are read asynchronously until the wgmma's group completes). */
template <int R>
__device__ inline void fence_regs(uint32_t (&a)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

/**
 * @brief D (+)= A * B for one warpgroup, A (64 x 16) = k step KK of the register fragment `a`
 * (registers 4KK..4KK+3), B 16 x N from a shared-memory descriptor (TRANS_B = 1: MN-major).
 * The step is a template parameter so that `a` stays in registers (no address is taken).
 */
template <typename T, int N, int TRANS_B, int KK, int R>
__device__ inline void mma_rs(float (&d)[N / 2], const uint32_t (&a)[R], uint64_t desc_b,
                              int scale_d) {
  static_assert(4 * KK + 3 < R, "mma_rs: k step outside the fragment");
  constexpr bool BF16 = std::is_same_v<T, __nv_bfloat16>;
  const uint32_t a0 = a[4 * KK], a1 = a[4 * KK + 1], a2 = a[4 * KK + 2], a3 = a[4 * KK + 3];
  if constexpr (N == 128) {
    if constexpr (BF16) wgmma::rs::mma_m64n128k16_bf16<TRANS_B>(d, a0, a1, a2, a3, desc_b, scale_d);
    else wgmma::rs::mma_m64n128k16_f16<TRANS_B>(d, a0, a1, a2, a3, desc_b, scale_d);
  } else {
    static_assert(N == 64, "mma_rs: N must be 64 or 128");
    if constexpr (BF16) wgmma::rs::mma_m64n64k16_bf16<TRANS_B>(d, a0, a1, a2, a3, desc_b, scale_d);
    else wgmma::rs::mma_m64n64k16_f16<TRANS_B>(d, a0, a1, a2, a3, desc_b, scale_d);
  }
}

template <class F, int... I>
__device__ inline void static_for_impl(F& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}

/** @brief Calls f(std::integral_constant<int, i>) for i = 0..N-1 (compile-time loop; C++17, the
 *  build's standard: no explicit lambda template parameters). */
template <int N, class F>
__device__ inline void static_for(F&& f) {
  static_for_impl(f, std::make_integer_sequence<int, N>{});
}

}  // namespace pk::frag
