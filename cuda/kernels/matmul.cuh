/*
 * matmul: y = x @ w on one GPU, fp32 accumulation, output in the input dtype (bf16 or fp16).
 *
 * Shapes: x [M, K] row-major (K-major A), w [K, N] row-major (N-major "transposed" B),
 * y [M, N] row-major; K and N multiples of 8 (TMA needs 16-byte row strides), any M. No
 * shardings: this is the local GEMM every fused op builds on, written on the LCSC template
 * (cuda/include/pk/lcsc.cuh) with no communicator (num_comm_sms = 0).
 *
 * Schedule of one persistent block (one per SM, BM x BN output tiles in grouped order):
 *
 *   warpgroup | role                                   | per k step (BK = 64)
 *   ----------+----------------------------------------+--------------------------------------
 *   0         | loader: 1 thread, 40 registers         | TMA x box [BM x 64] + BN/64 w boxes
 *             |                                        | [64 x 64] into stage s, on full[s]
 *   1         | consumer rows 0..63 of the tile        | 4 x wgmma m64nBNk16 from stage s
 *   2         | consumer rows 64..127 of the tile      | 4 x wgmma m64nBNk16 from stage s
 *   1, 2      | storer (after the last k step)         | fp32 -> T -> swizzled smem -> TMA store
 *
 * Stages form a ring of STAGES buffers with full/empty mbarriers; a consumer frees stage s one
 * step late (after wgmma.wait_group 1 shows step s's MMAs are done). The storer's TMA stores
 * drain while the next tile's main loop runs; a staging buffer is rewritten only after its
 * previous stores finished reading it. Partial tiles at the M, N and K edges come from TMA
 * bounds: loads fill zeros, stores drop what lies outside y.
 *
 * Signals: none (no peers).
 *
 * Pitfalls: the STAGE_BYTES a full barrier expects count whole boxes, including the zero-filled
 * out-of-bounds part, so every box is loaded even past the edge. The w boxes are MN-major
 * 128B-swizzled panels; the wgmma B descriptor's leading byte offset is the panel size and its
 * stride byte offset the 8-row atom (1024 B). Tensor maps hold buffer addresses, which XLA may
 * change between calls: the handler re-encodes when an address changes (ffi/matmul.cu).
 */
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "op_table.h"
#include "pk/lcsc.cuh"
#include "pk/smem.cuh"

namespace pk::matmul {

/** @brief Kernel arguments: tensor maps of x, w, y (boxes as in the table above) and sizes. */
struct globals {
  CUtensorMap x;  // dims {K, M}, box {64, BM}
  CUtensorMap w;  // dims {N, K}, box {64, 64}
  CUtensorMap y;  // dims {N, M}, box {64, 64}
  int m, n, k;
  int group_m;    // block-rows per band of the tile order (L2 reuse)
  wait_bound bound;  // error record and timeout of the mbarrier waits (zeros: trap at 60 s)
};

/**
 * @brief One tile configuration.
 * @tparam T __nv_bfloat16 or __half. @tparam BN tile width (128 or 256; BM = 128, BK = 64).
 * @tparam STAGES pipeline depth. @tparam EPI_N columns a consumer stages per TMA store round.
 */
template <typename T, int BN_, int STAGES_, int EPI_N_>
struct config {
  using dtype = T;
  static constexpr int BM = 128, BN = BN_, BK = 64;
  static constexpr int STAGES = STAGES_, EPI_N = EPI_N_;
  static_assert(BN % EPI_N == 0 && EPI_N % 64 == 0, "matmul: EPI_N must divide BN, 64 | EPI_N");
};

/** @brief The LCSC description of the matmul kernel for configuration C. */
template <class C>
struct kernel_def {
  using T = typename C::dtype;
  static constexpr int BM = C::BM, BN = C::BN, BK = C::BK;
  static constexpr int STAGES = C::STAGES;
  static constexpr int CONSUMERS = BM / 64;
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = 232;
  static constexpr bool ASYNC_MMA = true;

  using globals = pk::matmul::globals;
  using a_tile = st_panels<T, BM, BK>;   // K-major: one panel, BM rows of 64 k
  using b_tile = st_panels<T, BK, BN>;   // N-major: BN/64 panels of 64 k-rows
  struct stage_t {
    a_tile a;
    b_tile b;
  };
  using out_t = st_panels<T, 64, C::EPI_N>;
  using acc_t = float[BN / 2];
  static constexpr uint32_t STAGE_BYTES = a_tile::BYTES + b_tile::BYTES;

  __device__ static tile_scheduler scheduler(const globals& g) {
    return tile_scheduler(ceil_div(g.m, BM), ceil_div(g.n, BN), g.group_m);
  }
  __device__ static int k_iters(const globals& g) { return ceil_div(g.k, BK); }
  __device__ static pk::wait_bound bound(const globals& g) { return g.bound; }

  __device__ static void setup(const globals& g, lcsc::block_info) {
    tma::prefetch(&g.x);
    tma::prefetch(&g.w);
    tma::prefetch(&g.y);
  }

  __device__ static void loader(const globals& g, stage_t& s, mbarrier* full, tile_coord t,
                                int k) {
    tma::load_2d(s.a.data, &g.x, full, k * BK, t.m * BM);
#pragma unroll
    for (int p = 0; p < b_tile::PANELS; ++p) {
      tma::load_2d(s.b.panel(p), &g.w, full, t.n * BN + p * 64, k * BK);
    }
  }

  __device__ static void consumer(const globals&, acc_t& acc, const stage_t& s, int c, tile_coord,
                                  int k) {
    const T* a = s.a.data + c * 64 * BK;  // this consumer's 64 rows (8 KiB, atom-aligned)
    wgmma::fence_regs(acc);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const uint64_t da = wgmma::desc_k_major(a, kk * 16);
      const uint64_t db = wgmma::desc_mn_major(s.b.data, kk * 16, b_tile::PANEL_BYTES);
      wgmma::mma<T, BN, 1>(acc, da, db, (k > 0 || kk > 0) ? 1 : 0);
    }
    wgmma::commit();
    wgmma::fence_regs(acc);
  }

  __device__ static void storer(const globals& g, acc_t& acc, out_t& out, int c, tile_coord t,
                                const lcsc::storer_sync& sync) {
    const int row0 = t.m * BM + c * 64;
    if (row0 >= g.m) return;  // this consumer's half lies below y (uniform per warpgroup)
    epilogue(g, acc, out, t.n * BN, sync, [&](const T* panel, int col) {
      tma::store_2d(&g.y, panel, col, row0);
    });
  }

  __device__ static void communicator(const globals&, lcsc::block_info, void*) {}
  __device__ static void finish(const globals&, int) {}

 protected:
  /**
   * @brief The storers' epilogue: a consumer's 64 x BN fp32 accumulator -> T in its staging
   * buffer, EPI_N columns a round from column `col_base`; after each round one thread calls
   * store(panel, column) for every 64-column panel inside the output (the TMA store of the
   * caller's choice), then commits the bulk group.
   */
  template <class Store>
  __device__ static void epilogue(const globals& g, acc_t& acc, out_t& out, int col_base,
                                  const lcsc::storer_sync& sync, Store store) {
    const int lane = threadIdx.x % 32;
    const int r = 16 * ((threadIdx.x % WARPGROUP_THREADS) / 32) + lane / 4;
#pragma unroll
    for (int e = 0; e < BN / C::EPI_N; ++e) {
      const int col0 = col_base + e * C::EPI_N;
      if (col0 >= g.n) break;
      sync.acquire();
#pragma unroll
      for (int j = 0; j < C::EPI_N / 8; ++j) {
        const int jj = e * (C::EPI_N / 8) + j;
        const int col = 8 * j + 2 * (lane % 4);
        store_pair(out.at(r, col), acc[4 * jj], acc[4 * jj + 1]);
        store_pair(out.at(r + 8, col), acc[4 * jj + 2], acc[4 * jj + 3]);
      }
      if (sync.publish()) {
#pragma unroll
        for (int p = 0; p < out_t::PANELS; ++p) {
          if (col0 + p * 64 < g.n) store(out.panel(p), col0 + p * 64);
        }
        tma::store_commit();
      }
    }
  }

 private:
  __device__ static void store_pair(char* dst, float lo, float hi) {
    uint32_t v;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
      v = *reinterpret_cast<uint32_t*>(&h);
    } else {
      __half2 h = __floats2half2_rn(lo, hi);
      v = *reinterpret_cast<uint32_t*>(&h);
    }
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_addr(dst)), "r"(v) : "memory");
  }
};

/** @brief Tile configurations, indexed by the `config` attribute of pk_matmul and of the fused
 *  TP GEMMs: the op table's ids (ffi/op_table.h Tile). */
enum config_id : int {
  TILE_128x256 = pk_ffi::op_table::kTile128x256,       // large outputs: most reuse per byte
  TILE_128x128 = pk_ffi::op_table::kTile128x128,       // small outputs: twice the tiles
  TILE_128x256_S3 = pk_ffi::op_table::kTile128x256S3,  // 3 stages, whole-tile store staging
  NUM_CONFIGS = pk_ffi::op_table::kNumTiles,
};

template <typename T>
using config_128x256 = config<T, 256, 4, 128>;
template <typename T>
using config_128x128 = config<T, 128, 6, 128>;
template <typename T>
using config_128x256_s3 = config<T, 256, 3, 256>;

/** @brief Block tile (BM, BN) of configuration `id`, for the handler's tile counts. */
inline void tile_shape(int id, int* bm, int* bn) {
  *bm = 128;
  *bn = id == TILE_128x128 ? 128 : 256;
}

/** @brief Launches configuration C of the matmul kernel (no communication SMs). */
template <class C>
inline cudaError_t launch(const globals& g, cudaStream_t stream, int device, int num_sms) {
  const int tiles = ceil_div(g.m, C::BM) * ceil_div(g.n, C::BN);
  return lcsc::launch<kernel_def<C>>(g, stream, device, num_sms, /*comm_blocks=*/0, tiles);
}

}  // namespace pk::matmul
