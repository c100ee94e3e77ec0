/*
 * attention: softmax(scale q k^T) v on one GPU (flash attention), forward and backward.
 *
 * Shapes: q, o, dq [B, S, H, D]; k, v, dk, dv [B, S, Hkv, D] (Hkv divides H: query head h uses
 * K/V head h / (H / Hkv)); lse float32 [B, H, S]; D 64 or 128; bf16 or fp16; any S. Causal:
 * query i sees keys 0..i. Every operand is read through a 4-D TMA map (tma_4d.cuh), so rows
 * past S arrive as zeros; the kernels mask those keys and never store those rows.
 *
 * Two kernels, one block of 2 consumer warpgroups each (the forward at D = 64: 3), 64 rows
 * each of the block's stationary tile, streaming the other operand through a ring of STAGES
 * buffers with full mbarriers. Thread 0 issues the first STAGES tiles before the loop; each
 * later one is issued by the leader of whichever warpgroup releases its stage last
 * (attn::release_stage), so no warpgroup waits for another to free a stage (see NOTES at
 * THREADS in pk/attn/common.cuh for why there is no producer warpgroup; the forward with
 * 176-key tiles frees K and V apart, fwd_config::SPLIT_RELEASE):
 *
 *   kernel | block owns (stationary)  | streams (per step)      | consumer step
 *   -------+--------------------------+-------------------------+-------------------------------
 *   fwd    | 128 query rows: Q (192   | 128 keys: K, V (176 at  | S = Q K^T (smem x smem);
 *          | at D = 64)               | D = 128, not causal)    | online softmax in registers;
 *          |                          |                         | O += P V (P from registers)
 *   bwd    | 128 keys of head hk: K,V | 64 query rows of each   | S^T = K Q^T, dP^T = V dO^T;
 *          |                          | head of hk's group: Q,  | dV += P^T dO; dK += dS^T Q;
 *          |                          | dO, lse, delta          | dS^T to smem, dq_acc += dS K
 *
 * The forward overlaps each step's softmax with the previous step's P V: step j issues
 * S_j = Q K_j^T and O += P_{j-1} V_{j-1}, waits for S_j only, runs the softmax of S_j while the
 * tensor cores finish P V, then rescales O. The warpgroups also take turns issuing their
 * GEMMs (named barriers FWD_TURN + c: ping-pong), so one's softmax runs under the others'
 * GEMMs. At D = 64 the softmax's exponentials take as long as the GEMMs, so a third
 * warpgroup gives each softmax two GEMMs to hide under. It writes O and lse = scale * max +
 * log(sum) per row. The backward recomputes P = exp(scale q k^T - lse) from the saved lse;
 * delta = rowsum(dO * O) comes from the caller (padded with lse = +inf past S, so padded rows
 * give P = 0). It runs in one pass, five GEMMs per step: dK and dV sum over the group's query heads
 * in registers, and dQ's parts are summed into a float32 scratch dq_acc (zeroed by the launcher,
 * converted to dq by a second small kernel) by TMA reductions (cp.reduce.async.bulk.tensor add)
 * from shared memory, so dq is not bitwise reproducible (dk and dv are).
 *
 * The blocks are the attention engine's (cuda/include/pk/attn, namespace pk::attn): the
 * forward's is attn::fwd_block<C, Src> (fwd_mainloop.cuh) and the backward's
 * attn::bwd_block<C> (bwd_mainloop.cuh); the source says where the streamed tiles come from
 * (here attn::local_keys and attn::local_rows, local.cuh; the fused ring and Ulysses kernels'
 * wait for other ranks' rows). ring_attn_bwd.cuh's lanes run bwd_block's steps (dkdv_step,
 * dq_part on bwd_config's storage) over K/V tiles that change with the ring's steps. This file
 * keeps pk.attention's globals, the kernels and their launchers, and the choice of the
 * forward's warpgroups and key tile per head dim.
 *
 * Grid: fwd (H, ceil(S / BM), B), BM = fwd_block_rows(D); bwd (Hkv, ceil(S / 128), B).
 * Causal blocks run the longest rows first (fwd: block y counts down; bwd: key block y meets
 * the query rows from 128 y on) and skip the tiles wholly above the diagonal.
 *
 * Masks (fwd_masked_kernel, bwd_masked_kernel: the same mainloops over attn::masked_keys and
 * attn::masked_rows, pk/attn/masked.cuh): segment ids, a local window, query and key lengths and
 * a logits soft cap (template CAP), as pk_jax/ops/_attention.py's reference defines them. A
 * query tile streams only the key tiles that hold a visible pair by position and whose
 * documents' chunks meet its own (a window of W keys: O(W) tiles; packed documents: their own),
 * a key block only the query tiles likewise; element masks run only on sub-tiles that may hide
 * a pair (pk/attn/masks.cuh, the same functions tests/cpp/masks.cc runs on a CPU). A block with
 * nothing to stream writes its zeros and returns (rows no key sees: O = 0, lse = +inf). The
 * masked forward takes 128-key tiles at every head dim (fwd_masked_keys) and, with the soft
 * cap, two warpgroups at D = 64 (fwd_masked_warpgroups). The unmasked kernels' machine code is
 * the same with or without these (bwd_block's masked branch is under if constexpr).
 *
 * Signals: none (no peers).
 *
 * Pitfalls: a register A operand (P, dS) is read asynchronously by wgmma until its group
 * completes, so the registers are fenced (frag::fence_regs) until after the wait. The full
 * barriers expect whole boxes, zero-filled past S. A row that sees only masked keys in a step
 * keeps max = -inf; exponents are then taken against 0, never -inf - (-inf).
 */
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "pk/attn/bwd_mainloop.cuh"
#include "pk/attn/common.cuh"
#include "pk/attn/fwd_mainloop.cuh"
#include "pk/attn/local.cuh"
#include "pk/attn/masked.cuh"

namespace pk::attention {

// The problem's sizes (attn::dims), also spelled attention::dims (the FFI handlers).
using attn::dims;

/** @brief Forward arguments: maps {D, heads, S, B} with boxes {64, 1, rows, 1}, rows
 * fwd_block_keys(D, causal) for k and v and fwd_block_rows(D) for q. */
struct fwd_globals {
  CUtensorMap q, k, v;
  void* o;     // [B, S, H, D]
  float* lse;  // [B, H, S]
  dims d;
};

/** @brief Backward arguments: q, d_o with boxes of 64 rows (q64, do64), k, v with boxes of 128
 * (k128, v128); dq32 maps dq_acc (float32 {D, H, S, B}) with boxes {32, 1, 64, 1}, 128B-swizzled,
 * for the dQ reductions. lse and delta are [B, H, SP] with SP = S rounded up to 128, lse = +inf
 * and delta = 0 past S. */
struct bwd_globals {
  CUtensorMap q64, do64, k128, v128, dq32;
  const float* lse;
  const float* delta;
  int sp;
  void* dq;  // [B, S, H, D]
  void* dk;  // [B, S, Hkv, D]
  float* dq_acc;  // [B, S, H, D] float32 scratch (zeroed by the launcher)
  void* dv;
  dims d;
};

/** @brief The masked forward's arguments: the forward's (k and v boxes of 128 rows) and the
 * masks (attn::mask_args). */
struct fwd_masked_globals : fwd_globals {
  attn::mask_args m;
};

/** @brief The masked backward's arguments: the backward's and the masks. */
struct bwd_masked_globals : bwd_globals {
  attn::mask_args m;
};

/** @brief The forward kernels' configuration (attn::fwd_config), named here: it is the template
 * argument of fwd_kernel and of the fused ring and Ulysses forwards, so their symbols (which
 * profiles and machine-code reports key on) keep this name. */
template <typename T, int D, int WGS = attn::CONSUMERS, int KEYS = 128>
struct fwd_config : attn::fwd_config<T, D, WGS, KEYS> {};

/** @brief The one-pass backward's configuration (attn::bwd_config), named here for the same
 * reason (bwd_kernel, the fused Ulysses backward). */
template <typename T, int D>
struct bwd_config : attn::bwd_config<T, D> {};

/** @brief The forward (attn::fwd_block over attn::local_keys), grid (H, ceil(S / BM), B). */
template <class C>
__global__ void __launch_bounds__(C::THREADS, 1)
    fwd_kernel(const __grid_constant__ fwd_globals g) {
  attn::fwd_block<C, attn::local_keys<C>>(g);
}

/** @brief The one-pass backward (bwd_block), grid (Hkv, key blocks, B). */
template <class C>
__global__ void __launch_bounds__(attn::THREADS, 1)
    bwd_kernel(const __grid_constant__ bwd_globals g) {
  attn::bwd_block<C>(g, blockIdx.x, blockIdx.y, blockIdx.z, attn::local_rows{});
}

/** @brief The forward with masks (attn::fwd_block over attn::masked_keys; CAP: the soft cap),
 * grid (H, ceil(S / BM), B). A query tile that no key is visible to streams no key tile: the
 * mainloop needs one, so the block writes its zeros (O = 0, lse = +inf) and returns. */
template <class C, bool CAP>
__global__ void __launch_bounds__(C::THREADS, 1)
    fwd_masked_kernel(const __grid_constant__ fwd_masked_globals g) {
  using Src = attn::masked_keys<C, CAP>;
  {
    const Src src(g);
    if (src.n_tiles() == 0) {
      attn::fwd_rows<C> none;  // O = 0, l = 0
      src.store(g, none, src.row0() + 64 * warpgroup::index());
      return;
    }
  }
  attn::fwd_block<C, Src>(g);
}

/** @brief The backward with masks (attn::bwd_block over attn::masked_rows), grid (Hkv, key
 * blocks, B). A key block that no query row sees streams no stage: it writes dK = dV = 0 and
 * returns (the mainloop needs one stage); dQ's scratch is zeroed by the launcher. */
template <class C, bool CAP>
__global__ void __launch_bounds__(attn::THREADS, 1)
    bwd_masked_kernel(const __grid_constant__ bwd_masked_globals g) {
  const attn::masked_rows<C, CAP> src(g, blockIdx.y, blockIdx.z);
  if (src.tiles().empty()) {
    constexpr int D = C::HEAD_DIM;
    float zero[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) zero[i] = 0.f;
    const int row0 = blockIdx.y * C::BN + 64 * warpgroup::index();
    using T = typename C::dtype;
    attn::store_rows<T, D>(g.dk, zero, 1.f, 1.f, blockIdx.z, row0, blockIdx.x, g.d.hkv, g.d.s);
    attn::store_rows<T, D>(g.dv, zero, 1.f, 1.f, blockIdx.z, row0, blockIdx.x, g.d.hkv, g.d.s);
    return;
  }
  attn::bwd_block<C>(g, blockIdx.x, blockIdx.y, blockIdx.z, src);
}

/** @brief dq = T(scale dq_acc), n elements (a multiple of 4). */
template <typename T>
__global__ void dq_convert_kernel(const float4* __restrict__ acc, uint2* __restrict__ dq,
                                  int64_t n4, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float4 a = acc[i];
    dq[i] = make_uint2(frag::pack<T>(a.x * scale, a.y * scale), frag::pack<T>(a.z * scale, a.w * scale));
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers.

/** @brief dq = T(scale dq_acc) over n elements (a multiple of 4): the backwards' last kernel. */
template <typename T>
inline cudaError_t launch_dq_convert(const float* dq_acc, void* dq, int64_t n, float scale,
                                     cudaStream_t stream) {
  const int64_t n4 = n / 4;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(n4, int64_t(256)), 132 * 8));
  dq_convert_kernel<T><<<blocks, 256, 0, stream>>>(reinterpret_cast<const float4*>(dq_acc),
                                                   reinterpret_cast<uint2*>(dq), n4, scale);
  return cudaGetLastError();
}

template <class C, class G>
inline cudaError_t launch_kernel(void (*kernel)(G), const G& g, dim3 grid, cudaStream_t stream,
                                 int device) {
  static_assert(C::SMEM + sizeof(wait_bound) <= 232448,
                "attention: shared memory over the sm_90 limit of 227 KiB");
  if (cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(kernel), device,
                                     static_cast<int>(C::SMEM));
      err != cudaSuccess) {
    return err;
  }
  kernel<<<grid, C::THREADS, C::SMEM, stream>>>(g);
  return cudaGetLastError();
}

/** @brief The forward's consumer warpgroups at head dim D: three at D = 64, where a softmax
 * takes as long as a GEMM (file comment), two at 128 (registers: NOTES at THREADS in
 * pk/attn/common.cuh); and its query rows per block, 64 per warpgroup, which are also the rows
 * of the q map's box. */
constexpr int fwd_warpgroups(int d) { return d == 64 ? 3 : 2; }
constexpr int fwd_block_rows(int d) { return 64 * fwd_warpgroups(d); }
/** @brief The forward's keys per streamed tile, also the rows of the k and v maps' boxes: 176
 * at D = 128 without a causal mask (FlashAttention-3's tile; 2 stages, SPLIT_RELEASE), where a
 * step's fixed costs (waits, turns, the O rescale) spread over more keys, which measured
 * faster than 128 keys. Causal calls keep 128, whose blocks end on the diagonal.
 * measured: attention_notes.md, "Measurements moved from code comments (issue 37)". */
constexpr int fwd_block_keys(int d, bool causal) { return d == 128 && !causal ? 176 : 128; }

template <typename T, int D, int KEYS>
inline cudaError_t launch_fwd_as(const fwd_globals& g, cudaStream_t stream, int device) {
  using C = fwd_config<T, D, fwd_warpgroups(D), KEYS>;
  const dim3 grid(g.d.h, ceil_div(g.d.s, C::BM), g.d.b);
  return launch_kernel<C>(&fwd_kernel<C>, g, grid, stream, device);
}

/** @brief The forward for head dim D: O and lse. */
template <typename T, int D>
inline cudaError_t launch_fwd(const fwd_globals& g, cudaStream_t stream, int device) {
  if (g.d.causal) return launch_fwd_as<T, D, fwd_block_keys(D, true)>(g, stream, device);
  return launch_fwd_as<T, D, fwd_block_keys(D, false)>(g, stream, device);
}

/** @brief The backward for head dim D: zero dq_acc, bwd_kernel (dK, dV, and dQ summed into
 * dq_acc), then dq = T(scale dq_acc). */
template <typename T, int D>
inline cudaError_t launch_bwd(const bwd_globals& g, cudaStream_t stream, int device) {
  using C = bwd_config<T, D>;
  const int64_t n = int64_t(g.d.b) * g.d.s * g.d.h * D;
  if (cudaError_t err = cudaMemsetAsync(g.dq_acc, 0, n * sizeof(float), stream);
      err != cudaSuccess) {
    return err;
  }
  if (cudaError_t err = launch_kernel<C>(&bwd_kernel<C>, g,
                                         dim3(g.d.hkv, ceil_div(g.d.s, C::BN), g.d.b), stream,
                                         device);
      err != cudaSuccess) {
    return err;
  }
  return launch_dq_convert<T>(g.dq_acc, g.dq, n, g.d.scale, stream);
}

/** @brief The masked forward's keys per streamed tile, also the rows of the k and v maps'
 * boxes: 128 at every head dim, a multiple of the segment ids' chunks (attn::masks::CHUNK),
 * whose tiles end on the causal diagonal. */
constexpr int fwd_masked_keys() { return 128; }
/** @brief The masked forward's consumer warpgroups: fwd_warpgroups', but two at D = 64 with
 * the soft cap, whose tanh does not fit the 168 registers a thread of three warpgroups gets
 * (NOTES at THREADS in pk/attn/common.cuh; it spilled there); and its query rows per block,
 * also the rows of the q map's box. */
constexpr int fwd_masked_warpgroups(int d, bool cap) { return cap ? 2 : fwd_warpgroups(d); }
constexpr int fwd_masked_rows(int d, bool cap) { return 64 * fwd_masked_warpgroups(d, cap); }

template <typename T, int D, bool CAP>
inline cudaError_t launch_fwd_masked_as(const fwd_masked_globals& g, cudaStream_t stream,
                                        int device) {
  using C = fwd_config<T, D, fwd_masked_warpgroups(D, CAP), fwd_masked_keys()>;
  const dim3 grid(g.d.h, ceil_div(g.d.s, C::BM), g.d.b);
  return launch_kernel<C>(&fwd_masked_kernel<C, CAP>, g, grid, stream, device);
}

/** @brief The forward with masks for head dim D: O and lse (g.m.cap_in > 0: the soft cap). */
template <typename T, int D>
inline cudaError_t launch_fwd_masked(const fwd_masked_globals& g, cudaStream_t stream,
                                     int device) {
  if (g.m.cap_in > 0.f) return launch_fwd_masked_as<T, D, true>(g, stream, device);
  return launch_fwd_masked_as<T, D, false>(g, stream, device);
}

/** @brief The backward with masks for head dim D, as launch_bwd. */
template <typename T, int D>
inline cudaError_t launch_bwd_masked(const bwd_masked_globals& g, cudaStream_t stream,
                                     int device) {
  using C = bwd_config<T, D>;
  const int64_t n = int64_t(g.d.b) * g.d.s * g.d.h * D;
  if (cudaError_t err = cudaMemsetAsync(g.dq_acc, 0, n * sizeof(float), stream);
      err != cudaSuccess) {
    return err;
  }
  const dim3 grid(g.d.hkv, ceil_div(g.d.s, C::BN), g.d.b);
  cudaError_t err = g.m.cap_in > 0.f
                        ? launch_kernel<C>(&bwd_masked_kernel<C, true>, g, grid, stream, device)
                        : launch_kernel<C>(&bwd_masked_kernel<C, false>, g, grid, stream, device);
  if (err != cudaSuccess) return err;
  return launch_dq_convert<T>(g.dq_acc, g.dq, n, g.d.scale, stream);
}

}  // namespace pk::attention
