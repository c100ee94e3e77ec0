/*
 * matmul_fp8: y = (x * x_scale) @ (w * w_scale) on one GPU with fp8 operands (e4m3 or e5m2
 * each), fp32 accumulation, y in bf16 or fp32.
 *
 * Shapes: x [M, K] row-major (K-major A); w given TRANSPOSED, wt [N, K] row-major (K-major B:
 * fp8 wgmma reads both operands K-major, it has no transpose); y [M, N] row-major. K a multiple
 * of 16 (TMA needs 16-byte row strides: K bytes of fp8), N a multiple of 8 (y's rows), any M.
 * Scales (pk_jax/fp8.py), float32:
 *   per tensor  x_scale, w_scale one float each: y = x_scale * w_scale * (x @ w) in the epilogue;
 *   blockwise   x's scales per row and k-block of 128, passed TRANSPOSED as xs [KB, >= M]
 *               (KB = ceil(K / 128), row length a multiple of 4); w's per 128 x 128 block,
 *               ws [KB, >= ceil(N / 128)] (row length a multiple of 4). Promotion (DeepSeek-V3):
 *               each k-block's product goes into a fresh fp32 accumulator, which is then added
 *               into the tile's accumulator times xs[kb, row] * ws[kb, col / 128].
 * No shardings: a local GEMM on the LCSC template (cuda/include/pk/lcsc.cuh), no communicator.
 *
 * Schedule of one persistent block (one per SM, BM x BN output tiles in grouped order; BM = 128,
 * BK = 128 fp8 = 128 bytes, one 128B-swizzled row per operand row):
 *
 *   warpgroup | role                                | per k step (BK = 128)
 *   ----------+-------------------------------------+--------------------------------------------
 *   0         | loader: 1 thread, 40 registers      | TMA x box [BM x 128] + wt box [BN x 128]
 *             |                                     | (+ blockwise: xs box [BM], ws box [4])
 *   1         | consumer rows 0..63 of the tile     | 4 x wgmma m64nBNk32 from stage s
 *   2         | consumer rows 64..127 of the tile   | 4 x wgmma m64nBNk32 from stage s
 *   1, 2      | blockwise: promotion after each k   | wait for the 4 MMAs, acc += part * scale
 *   1, 2      | storer (after the last k step)      | fp32 (x scale) -> bf16 / fp32 -> swizzled
 *             |                                     | smem -> TMA store, 2 panels a round
 *
 * A stage holds the same bytes as the bf16 kernel's (BK = 64 of 2 bytes), so the stage counts
 * carry over: 128x256 per tensor 4 stages, 128x128 6 (per tensor) or 5 (blockwise, which also
 * carries 528 bytes of scales a stage). Per tensor, a consumer frees stage s one step late (its
 * MMAs run while the next step's are issued), as in the bf16 kernel. Blockwise, a consumer
 * waits for its step's MMAs before it promotes, then frees the stage at once; the other
 * consumer warpgroup's MMAs keep the tensor cores busy meanwhile.
 *
 * Signals: none (no peers).
 *
 * Pitfalls: blockwise needs BN = 128: the tile's accumulator and the fresh one take 2 x 64
 * registers a thread (at BN = 256 they would take 256, past the 232 a consumer has), and a tile
 * then sits in one w block per k-block. Partial tiles at the M, N and K edges come from TMA
 * bounds: loads fill zeros (a zero K tail adds nothing; scales past M or N are zeros that only
 * reach rows and columns the store drops), stores drop what lies outside y. The boxes a full
 * barrier expects count whole boxes, zero-filled parts included. Tensor maps hold buffer
 * addresses: the handler re-encodes when XLA moves a buffer (ffi/matmul_fp8.cu).
 */
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "op_table.h"
#include "pk/fp8_gemm.cuh"
#include "pk/fp8_layout.cuh"
#include "pk/lcsc.cuh"
#include "pk/smem.cuh"
#include "pk/wgmma_fp8.cuh"

namespace pk::matmul_fp8 {

/** @brief Kernel arguments: tensor maps (boxes as in the table above), scales and sizes. */
struct globals {
  CUtensorMap x;   // x [M, K] fp8: dims {K, M}, box {128, BM}, 128B swizzle
  CUtensorMap w;   // wt [N, K] fp8: dims {K, N}, box {128, BN}, 128B swizzle
  CUtensorMap y;   // y [M, N]: dims {N, M}, box {128 / sizeof(out), 64}, 128B swizzle
  CUtensorMap xs;  // blockwise: xs [KB, ld] f32: dims {ld, KB}, box {BM, 1}, no swizzle
  CUtensorMap ws;  // blockwise: ws [KB, ld] f32: dims {ld, KB}, box {4, 1}, no swizzle
  const float* x_scale;  // per tensor: the two scales (device scalars)
  const float* w_scale;
  int m, n, k;
  int group_m;       // block-rows per band of the tile order (L2 reuse)
  wait_bound bound;  // error record and timeout of the mbarrier waits (zeros: trap at 60 s)
};

/**
 * @brief One kernel configuration.
 * @tparam XT, WT __nv_fp8_e4m3 or __nv_fp8_e5m2 (x's and w's formats).
 * @tparam OUT __nv_bfloat16 or float. @tparam BN 128 or 256 (BM = 128, BK = 128).
 * @tparam BLOCKWISE blockwise scales with promotion (BN = 128), else per tensor.
 */
template <typename XT, typename WT, typename OUT, int BN_, int STAGES_, bool BLOCKWISE_>
struct config {
  using x_type = XT;
  using w_type = WT;
  using out_type = OUT;
  static constexpr int BM = 128, BN = BN_, BK = 128;
  static constexpr int STAGES = STAGES_;
  static constexpr bool BLOCKWISE = BLOCKWISE_;
  static_assert(BN == 128 || BN == 256, "matmul_fp8: BN is 128 or 256");
  static_assert(!BLOCKWISE || BN == 128, "matmul_fp8: blockwise scaling needs BN = 128");
  static_assert(std::is_same_v<OUT, __nv_bfloat16> || std::is_same_v<OUT, float>,
                "matmul_fp8: y is bf16 or fp32");
};

/** @brief The LCSC description of the fp8 matmul kernel for configuration C. */
template <class C>
struct kernel_def {
  using XT = typename C::x_type;
  using WT = typename C::w_type;
  using OUT = typename C::out_type;
  static constexpr int BM = C::BM, BN = C::BN, BK = C::BK;
  static constexpr int STAGES = C::STAGES;
  static constexpr bool BLOCKWISE = C::BLOCKWISE;
  static constexpr int CONSUMERS = BM / 64;
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = 232;
  // Blockwise consumers wait for their own MMAs (the promotion reads them), so the template
  // may free a stage as soon as the consumer returns.
  static constexpr bool ASYNC_MMA = !BLOCKWISE;

  using globals = pk::matmul_fp8::globals;
  using a_tile = st_bytes<BM, 1>;  // BM rows of 128 k (one 128-byte swizzled row each)
  using b_tile = st_bytes<BN, 1>;  // BN rows (output columns) of 128 k
  struct plain_stage {
    a_tile a;
    b_tile b;
  };
  struct scaled_stage {
    a_tile a;
    b_tile b;
    float sx[fp8_layout::X_SCALE_BOX];      // x scales of the tile's rows, this k-block
    alignas(128) float sw[fp8_layout::W_SCALE_BOX];  // w scales around the tile's w block
  };
  using stage_t = std::conditional_t<BLOCKWISE, scaled_stage, plain_stage>;
  static constexpr uint32_t SCALE_BYTES =
      BLOCKWISE ? (fp8_layout::X_SCALE_BOX + fp8_layout::W_SCALE_BOX) * 4 : 0;
  static constexpr uint32_t STAGE_BYTES = a_tile::BYTES + b_tile::BYTES + SCALE_BYTES;

  // Store staging: 64 rows of two 128-byte panels a consumer (EPI_N columns a round).
  using out_t = st_bytes<64, 2>;
  static constexpr int PANEL_COLS = 128 / int(sizeof(OUT));
  static constexpr int EPI_N = 2 * PANEL_COLS;
  static_assert(BN % EPI_N == 0, "matmul_fp8: whole store rounds");

  struct block_acc {
    float main[BN / 2];  // the tile's sum of promoted k-blocks
    float part[BN / 2];  // this k-block's product, unscaled
  };
  using acc_t = std::conditional_t<BLOCKWISE, block_acc, float[BN / 2]>;

  __device__ static tile_scheduler scheduler(const globals& g) {
    return tile_scheduler(ceil_div(g.m, BM), ceil_div(g.n, BN), g.group_m);
  }
  __device__ static int k_iters(const globals& g) { return ceil_div(g.k, BK); }
  __device__ static pk::wait_bound bound(const globals& g) { return g.bound; }

  __device__ static void setup(const globals& g, lcsc::block_info) {
    tma::prefetch(&g.x);
    tma::prefetch(&g.w);
    tma::prefetch(&g.y);
    if constexpr (BLOCKWISE) {
      tma::prefetch(&g.xs);
      tma::prefetch(&g.ws);
    }
  }

  __device__ static void loader(const globals& g, stage_t& s, mbarrier* full, tile_coord t,
                                int k) {
    tma::load_2d(s.a.data, &g.x, full, k * BK, t.m * BM);
    tma::load_2d(s.b.data, &g.w, full, k * BK, t.n * BN);
    if constexpr (BLOCKWISE) {
      tma::load_2d(s.sx, &g.xs, full, fp8_layout::x_scale_box_inner(t.m * BM), k);
      tma::load_2d(s.sw, &g.ws, full, fp8_layout::w_scale_box_inner(t.n, BN), k);
    }
  }

  __device__ static void consumer(const globals&, acc_t& acc, const stage_t& s, int c,
                                  tile_coord t, int k) {
    consume(acc, s, c, t.m * BM, t.n, k);
  }

  /** @brief Consumer c's k step k of a tile whose first row (of x and x_scale) is row0. */
  __device__ static void consume(acc_t& acc, const stage_t& s, int c, int row0, int tile_n,
                                 int k) {
    const unsigned char* a = s.a.data + c * 64 * 128;  // this consumer's 64 rows (8 KiB)
    if constexpr (BLOCKWISE) {
      // The scales are read before the MMAs are issued, so their latency hides behind them.
      float s0, s1;
      fp8_gemm::row_scales(s.sx, s.sw, row0, fp8_layout::w_scale_slot(tile_n, BN, 0), c, s0, s1);
      fp8_gemm::mma_k_block<XT, WT, BN>(acc.part, a, s.b.data, false);  // a fresh accumulator
      wgmma::wait<0>();
      wgmma::fence_regs(acc.part);
      // NOTES: the leader frees the stage (the loader may refill it) as soon as this returns,
      // so every warp's reads of its scales must be done first: the warpgroup's named barrier
      // (the storer's, lcsc.cuh storer_sync; the same 128 threads, in program order).
      warpgroup::sync(1 + c);
      fp8_gemm::promote<BN>(acc.main, acc.part, s0, s1, k == 0);
    } else {
      fp8_gemm::mma_k_block<XT, WT, BN>(acc, a, s.b.data, k > 0);
    }
  }

  __device__ static void storer(const globals& g, acc_t& acc, out_t& out, int c, tile_coord t,
                                const lcsc::storer_sync& sync) {
    const int row0 = t.m * BM + c * 64;
    if (row0 >= g.m) return;  // this consumer's half lies below y (uniform per warpgroup)
    const auto store = [&](const unsigned char* panel, int col) {
      tma::store_2d(&g.y, panel, col, row0);
    };
    if constexpr (BLOCKWISE) {
      epilogue(g, acc.main, 1.0f, out, t.n * BN, sync, store);
    } else {
      epilogue(g, acc, __ldg(g.x_scale) * __ldg(g.w_scale), out, t.n * BN, sync, store);
    }
  }

  __device__ static void communicator(const globals&, lcsc::block_info, void*) {}
  __device__ static void finish(const globals&, int) {}

  /**
   * @brief The storers' epilogue: a consumer's 64 x BN fp32 accumulator times `scale` -> OUT
   * in its staging buffer, EPI_N columns a round from column `col_base`; after each round one
   * thread calls store(panel, col) for every 128-byte panel that lies inside the output (col:
   * the panel's first output column; the TMA store of this kernel's y, or a fused op's own)
   * and commits the bulk group.
   */
  template <class Store>
  __device__ static void epilogue(const globals& g, float (&acc)[BN / 2], float scale,
                                  out_t& out, int col_base, const lcsc::storer_sync& sync,
                                  Store&& store) {
#pragma unroll
    for (int e = 0; e < BN / EPI_N; ++e) {
      const int col0 = col_base + e * EPI_N;
      if (col0 >= g.n) break;
      sync.acquire();
      fp8_gemm::stage_round<OUT, BN, EPI_N>(acc, scale, out.data, e);
      if (sync.publish()) {
#pragma unroll
        for (int p = 0; p < out_t::PANELS; ++p) {
          if (col0 + p * PANEL_COLS < g.n) store(out.panel(p), col0 + p * PANEL_COLS);
        }
        tma::store_commit();
      }
    }
  }
};

/** @brief The configurations, by the op table's tile ids (the `config` attribute of
 *  pk_matmul_fp8: kTile128x256 or kTile128x128; blockwise scaling always takes 128x128). */
template <typename XT, typename WT, typename OUT>
using config_128x256 = config<XT, WT, OUT, 256, 4, false>;
template <typename XT, typename WT, typename OUT>
using config_128x128 = config<XT, WT, OUT, 128, 6, false>;
template <typename XT, typename WT, typename OUT>
using config_block = config<XT, WT, OUT, 128, 5, true>;

/** @brief Launches configuration C of the fp8 matmul kernel (no communication SMs). */
template <class C>
inline cudaError_t launch(const globals& g, cudaStream_t stream, int device, int num_sms) {
  const int tiles = ceil_div(g.m, C::BM) * ceil_div(g.n, C::BN);
  return lcsc::launch<kernel_def<C>>(g, stream, device, num_sms, /*comm_blocks=*/0, tiles);
}

}  // namespace pk::matmul_fp8
