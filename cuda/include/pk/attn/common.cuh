/**
 * @file attn/common.cuh
 * @brief The attention engine's shared pieces (namespace pk::attn): the block's consumer
 * warpgroups, the problem's sizes, row loads and stores of [B, S, heads, D] operands, the
 * K-major A B^T GEMM over the head dim, and the release that refills a ring stage.
 *
 * The engine is a library layer under the attention ops, split as mainloop, softmax and source
 * policies:
 *
 *   header            | what
 *   ------------------+------------------------------------------------------------------------
 *   common.cuh        | this file
 *   softmax.cuh       | registers and steps of the forward's online softmax and of the
 *                     | backward's softmax gradient
 *   fwd_mainloop.cuh  | fwd_config (tiles, stages, shared storage), fwd_rows (a warpgroup's O
 *                     | and scores), fwd_block (the forward's block over a source)
 *   bwd_mainloop.cuh  | dkdv_config and bwd_config, dkdv_step (dK and dV), dq_part (dQ by TMA
 *                     | reductions), bwd_block (the one-pass backward's block over a source)
 *   local.cuh         | local_keys, local_rows: sources over operands present from the start
 *   masks.cuh         | the masks as pure host and device functions (rows' keys, keys' rows,
 *                     | tile ranges, which sub-tiles need element masks, tanh): tested on a CPU
 *   masked.cuh        | masked_keys, masked_rows: local.cuh's sources with segment ids, a
 *                     | window, lengths and a soft cap (pk.attention's masked kernels)
 *   peers.cuh         | step_stream (a K/V stream over the P ranks' keys) and comm_or_compute
 *                     | (communication blocks, else fwd_block), for the fused kernels
 *
 * A mainloop is templated on its config C and its source Src, and takes the op's globals as a
 * template parameter G: it reads only the fields its source and its own loads name. The ops
 * (cuda/kernels/attention.cuh, ring_attn*.cuh, ulysses_attn*.cuh) keep their globals, the
 * sources that read them or wait on their signal slots, their kernels and launchers. The
 * numbers behind the choices here are in bench/results ("measured:" lines name the notes file
 * and its section).
 *
 * Pitfalls: these are device templates inlined into each op's kernels, whose machine code was
 * measured; reshaping a helper (a lambda or a struct around a loop's steps, a call site moved)
 * changes it, so a change here is checked against every kernel's .text (tests/gpu/
 * sass_report.py).
 */
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "pk/fragment.cuh"
#include "pk/mbarrier.cuh"
#include "pk/smem.cuh"
#include "pk/tma.cuh"
#include "pk/tma_4d.cuh"
#include "pk/warpgroup.cuh"
#include "pk/wgmma.cuh"

namespace pk::attn {

constexpr float LOG2E = 1.4426950408889634f;
constexpr int CONSUMERS = 2;
// NOTES: two warpgroups and no separate producer warpgroup. Registers are split per SM
// sub-partition: a third warpgroup (or a ninth warp) puts 3 warps on one sub-partition and
// ptxas (nvcc 13.0) then caps every thread at 168 registers, ignoring the setmaxnreg that
// would hand the producer's share to the consumers; the forward's O, S and P (D = 128) and
// the dK/dV kernel's two accumulators spilled there. With 256 threads they get up to 255.
// The forward at D = 64 fits the cap: it runs 3 warpgroups (attention::fwd_warpgroups).
// measured: attention_notes.md, "Measurements moved from code comments (issue 37)".
constexpr int THREADS = CONSUMERS * WARPGROUP_THREADS;

/** @brief Sizes shared by the kernels. */
struct dims {
  int b, s, h, hkv;
  float scale;  // multiplies q . k
  int causal;
};

/** @brief Loads rows [row0, row0 + ROWS) of head `head` of batch `b` into `tile` (D/64 boxes). */
template <class Tile>
__device__ inline void load_rows(Tile& tile, const CUtensorMap* map, mbarrier* bar, int b,
                                 int row0, int head) {
#pragma unroll
  for (int p = 0; p < Tile::PANELS; ++p) tma::load_4d(tile.panel(p), map, bar, p * 64, head, row0, b);
}

/** @brief Stores a consumer's 64 x D fp32 accumulator (times `mul`) to rows `row0`.. of
 * [.., S, heads, D] at head `head`, dropping rows past S. */
template <typename T, int D>
__device__ inline void store_rows(void* out, const float (&acc)[D / 2], float mul0, float mul1,
                                  int b, int row0, int head, int heads, int s) {
  const int t = threadIdx.x % WARPGROUP_THREADS;
  const int lane = t % 32;
  const int r = row0 + 16 * (t / 32) + lane / 4;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = r + 8 * i;
    if (row >= s) continue;
    const float mul = i ? mul1 : mul0;
    T* dst = reinterpret_cast<T*>(out) + ((int64_t(b) * s + row) * heads + head) * D;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int col = 8 * j + 2 * (lane % 4);
      *reinterpret_cast<uint32_t*>(dst + col) =
          frag::pack<T>(acc[4 * j + 2 * i] * mul, acc[4 * j + 2 * i + 1] * mul);
    }
  }
}

/** @brief acc = A B^T over the head dim D (issued, not committed): A = warpgroup c's 64 rows of
 * tile `a`, B = every row of tile `b` (N of them), both K-major tiles of D / 64 panels. */
template <typename T, int N, int D, class TA, class TB>
__device__ inline void mma_rows_bt(float (&acc)[N / 2], const TA& a, int c, const TB& b) {
  const uint64_t da0 = wgmma::desc_k_major(a.panel(0) + c * 64 * 64, 0);
  const uint64_t db0 = wgmma::desc_k_major(b.panel(0), 0);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t at = (kk / 4) * TA::PANEL_BYTES + (kk % 4) * 16 * sizeof(T);
    const uint32_t bt = (kk / 4) * TB::PANEL_BYTES + (kk % 4) * 16 * sizeof(T);
    wgmma::mma<T, N, 0>(acc, wgmma::desc_advance(da0, at), wgmma::desc_advance(db0, bt),
                        kk > 0 ? 1 : 0);
  }
}

/** @brief The calling warpgroup is done with streamed tile r (its GEMMs reading r's stage have
 * completed). `released` counts the warpgroups' releases of each stage, forever (WGS per
 * round); the leader of the last warpgroup to release refills the stage with tile
 * r + STAGES (`issue`), so no warpgroup ever waits for another to free a stage. */
template <int WGS = CONSUMERS, int STAGES, class Issue>
__device__ inline void release_stage(int (&released)[STAGES], int r, int n_tiles,
                                     const Issue& issue) {
  if (warpgroup::thread() == 0) {
    __threadfence_block();
    const int before = atomicAdd(&released[pipeline_state<STAGES>::stage_of(r)], 1);
    if (before % WGS == WGS - 1 && r + STAGES < n_tiles) issue(r + STAGES);
  }
  __syncwarp();
}

}  // namespace pk::attn
