/*
 * grouped_matmul_fp8: y[rows of group e] = (x * x_scale)[rows of e] @ (w[e] * w_scale[e]) on one
 * GPU with fp8 operands (e4m3 or e5m2 each), fp32 accumulation, y in bf16 or fp32: the MoE
 * experts' forward in fp8 (the bf16 one is grouped_matmul.cuh's mode FWD).
 *
 * Shapes: x [M, K] row-major (K-major A); w given TRANSPOSED per expert, wt [E, N, K] row-major
 * (K-major B: fp8 wgmma reads both operands K-major); y [M, N]; group_sizes [E] int32 on the
 * device. K a multiple of 16 (16-byte TMA rows of fp8), N a multiple of 8 (y's rows). Groups and
 * rows past their sum as grouped_matmul.cuh (pk/grouped_walk.cuh): sizes clamped to >= 0, ranges
 * cut at M, rows past sum(sizes) zero.
 * Scales (pk_jax/fp8.py), float32:
 *   per tensor  x_scale one float, w_scale [E] (one per expert): y = x_scale * w_scale[e] *
 *               (x_e @ w[e]) in the epilogue;
 *   blockwise   x's per row and k-block of 128, TRANSPOSED, xs [KB, >= M] (KB = ceil(K / 128),
 *               rows a multiple of 4 floats); w's per expert and 128 x 128 block of w[e] [K, N],
 *               ws [E * KB, >= ceil(N / 128)] (expert e's k-block kb is row e * KB + kb, rows a
 *               multiple of 4). Promotion as matmul_fp8.cuh: each k-block's product goes into a
 *               fresh fp32 accumulator, added into the tile's times xs[kb, row] * ws[e KB + kb,
 *               col / 128].
 * No shardings: a local GEMM, no communicator.
 *
 * Schedule: the persistent block of pk/grouped_walk.cuh (one per SM; row tiles of BM = 128 rows
 * starting at each group's first row, so not 128-aligned; tile ids over (row tiles x N tiles) in
 * the banded order), the fp8 k-block of matmul_fp8 (pk/fp8_gemm.cuh):
 *
 *   warpgroup | role                                | per k step (BK = 128)
 *   ----------+-------------------------------------+--------------------------------------------
 *   0         | loader: 1 thread                    | TMA x box [BM x 128] at the tile's first
 *             |                                     | row, wt box [BN x 128] of expert e (3-D)
 *             |                                     | (+ blockwise: xs box [BM], ws box [4])
 *   1, 2      | consumer rows 0..63 / 64..127       | 4 x wgmma m64nBNk32 from stage s
 *   1, 2      | blockwise: promotion after each k   | wait for the 4 MMAs, acc += part * scale
 *   1, 2      | storer (after the last k step)      | fp32 (x scale) -> bf16 / fp32 -> swizzled
 *             |                                     | smem, 2 panels a round -> TMA store when
 *             |                                     | the consumer's 64 rows lie in the group,
 *             |                                     | else 16-byte st.global of the rows that do
 *
 * Configurations: per tensor 128x256 (3 stages: the row offsets take 8 KiB of shared memory
 * beside the stages, so matmul_fp8's 4 do not fit) or 128x128 (5 stages); blockwise 128x128 (5
 * stages; its two accumulators fit in registers only at BN = 128). Per tensor a consumer frees
 * a stage one step late (its MMAs run while the next step's are issued); blockwise it waits for
 * its step's MMAs, promotes, then frees the stage at once.
 *
 * Signals: none (no peers).
 *
 * Pitfalls: a row tile's TMA boxes may read the next group's rows (x and, blockwise, their
 * scales): those output rows are never stored. wt and its map are 3-D {K, N, E}, so N and K
 * edges zero-fill per expert instead of reading the next expert's rows. The blockwise w scales
 * are one 4-float box of one row, which holds one expert's k-block only. Tensor maps hold buffer
 * addresses: the handler encodes them per call from its cache (ffi/grouped_matmul_fp8.cu).
 */
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "pk/common.cuh"
#include "pk/fp8_gemm.cuh"
#include "pk/fp8_layout.cuh"
#include "pk/grouped_walk.cuh"
#include "pk/lcsc.cuh"
#include "pk/mbarrier.cuh"
#include "pk/scheduler.cuh"
#include "pk/smem.cuh"
#include "pk/tma.cuh"
#include "pk/tma_3d.cuh"
#include "pk/warpgroup.cuh"
#include "pk/wgmma.cuh"

namespace pk::grouped_matmul_fp8 {

/** @brief Most groups one call takes (grouped_matmul.cuh's MAX_GROUPS, the op table's). */
constexpr int MAX_GROUPS = 1024;

/** @brief Kernel arguments: tensor maps (boxes as in the table above), scales and sizes. */
struct globals {
  CUtensorMap a;    // x [M, K] fp8: dims {K, M}, box {128, BM}, 128B swizzle
  CUtensorMap b;    // wt [E, N, K] fp8: dims {K, N, E}, box {128, BN, 1}, 128B swizzle
  CUtensorMap out;  // y [M, N]: dims {N, M}, box {128 / sizeof(OUT), 64}, 128B swizzle
  CUtensorMap xs;   // blockwise: xs [KB, ld] f32: dims {ld, KB}, box {BM, 1}, no swizzle
  CUtensorMap ws;   // blockwise: ws [E * KB, ld] f32: dims {ld, E * KB}, box {4, 1}, no swizzle
  void* y;          // the output (masked stores and zeroed tail rows)
  const float* x_scale;    // per tensor: one float (device)
  const float* w_scale;    // per tensor: [E] floats (device)
  const int* group_sizes;  // [E] int32, on the device
  int m, n, k, groups;
  int group_m;  // block-rows per band of the tile order
};

/** @brief A unit of work: an output tile and the rows of its group (grouped_matmul.cuh's). */
struct work {
  int e;        // group
  int row0;     // first row of the tile
  int row_end;  // end of the group's rows
  int nt;       // column tile
};

/**
 * @brief One kernel configuration.
 * @tparam XT, WT __nv_fp8_e4m3 or __nv_fp8_e5m2. @tparam OUT __nv_bfloat16 or float.
 * @tparam BN 128 or 256 (BM = 128, BK = 128). @tparam BLOCKWISE blockwise scales (BN = 128).
 */
template <typename XT, typename WT, typename OUT, int BN_, int STAGES_, bool BLOCKWISE_>
struct config {
  using x_type = XT;
  using w_type = WT;
  using out_type = OUT;
  static constexpr int BM = 128, BN = BN_, BK = fp8_gemm::BK;
  static constexpr int STAGES = STAGES_;
  static constexpr bool BLOCKWISE = BLOCKWISE_;
  static_assert(BN == 128 || BN == 256, "grouped_matmul_fp8: BN is 128 or 256");
  static_assert(!BLOCKWISE || BN == 128, "grouped_matmul_fp8: blockwise scaling needs BN = 128");
  static_assert(std::is_same_v<OUT, __nv_bfloat16> || std::is_same_v<OUT, float>,
                "grouped_matmul_fp8: y is bf16 or fp32");
};

template <typename XT, typename WT, typename OUT>
using config_128x256 = config<XT, WT, OUT, 256, 3, false>;
template <typename XT, typename WT, typename OUT>
using config_128x128 = config<XT, WT, OUT, 128, 5, false>;
template <typename XT, typename WT, typename OUT>
using config_block = config<XT, WT, OUT, 128, 5, true>;

/** @brief The kernel description for pk/grouped_walk.cuh's persistent block. */
template <class C>
struct kernel_def {
  using globals = grouped_matmul_fp8::globals;
  using work = grouped_matmul_fp8::work;
  using XT = typename C::x_type;
  using WT = typename C::w_type;
  using OUT = typename C::out_type;
  static constexpr int BM = C::BM, BN = C::BN, BK = C::BK, STAGES = C::STAGES;
  static constexpr bool BLOCKWISE = C::BLOCKWISE;
  static constexpr int CONSUMERS = 2;
  static constexpr int THREADS = (CONSUMERS + 1) * WARPGROUP_THREADS;

  using a_tile = st_bytes<BM, 1>;  // BM rows of 128 k (one 128-byte swizzled row each)
  using b_tile = st_bytes<BN, 1>;  // BN rows (output columns) of 128 k
  struct plain_stage {
    a_tile a;
    b_tile b;
  };
  struct scaled_stage {
    a_tile a;
    b_tile b;
    float sx[fp8_layout::X_SCALE_BOX];               // x scales of the tile's rows, this k-block
    alignas(128) float sw[fp8_layout::W_SCALE_BOX];  // w scales around the tile's w block
  };
  using stage_t = std::conditional_t<BLOCKWISE, scaled_stage, plain_stage>;
  static constexpr uint32_t SCALE_BYTES =
      BLOCKWISE ? (fp8_layout::X_SCALE_BOX + fp8_layout::W_SCALE_BOX) * 4 : 0;
  static constexpr uint32_t STAGE_BYTES = a_tile::BYTES + b_tile::BYTES + SCALE_BYTES;

  // Store staging: 64 rows of two 128-byte panels a consumer (EPI_N columns a round).
  using out_t = st_bytes<64, 2>;
  static constexpr int ELEM = int(sizeof(OUT));
  static constexpr int PANEL_COLS = 128 / ELEM;
  static constexpr int EPI_N = 2 * PANEL_COLS;
  static_assert(BN % EPI_N == 0, "grouped_matmul_fp8: whole store rounds");

  struct block_acc {
    float main[BN / 2];  // the tile's sum of promoted k-blocks
    float part[BN / 2];  // this k-block's product, unscaled
  };
  using acc_t = std::conditional_t<BLOCKWISE, block_acc, float[BN / 2]>;

  struct shared_storage {
    stage_t stages[STAGES];
    out_t out[CONSUMERS];
    mbarrier full[STAGES];
    mbarrier empty[STAGES];
    int row_off[MAX_GROUPS + 1];   // first row of group e (clamped to M); [E] = end of rows
    int tile_off[MAX_GROUPS + 1];  // first virtual row tile of group e; [E] = total
  };

  /** @brief Thread 0, before the block's first barrier: the ring, `bound`, the maps. */
  __device__ static void init_ring(const globals& g, shared_storage& s, const wait_bound& bound) {
    block_wait_bound() = bound;
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], CONSUMERS);
    }
    fence_mbar_init();
    tma::prefetch(&g.a);
    tma::prefetch(&g.b);
    if constexpr (BLOCKWISE) {
      tma::prefetch(&g.xs);
      tma::prefetch(&g.ws);
    }
  }

  __device__ static void scan_groups(const globals& g, shared_storage& s) {
    grouped_walk::scan_groups<BM>(g, s.row_off, s.tile_off);
  }

  __device__ static int num_tiles(const globals& g, const shared_storage& s) {
    return s.tile_off[g.groups] * ceil_div(g.n, BN);
  }

  __device__ static int k_iters(const globals& g) { return ceil_div(g.k, BK); }

  __device__ static work tile(const globals& g, const shared_storage& s, int id) {
    const tile_coord t =
        tile_scheduler(s.tile_off[g.groups], ceil_div(g.n, BN), g.group_m).coord(id);
    const grouped_walk::row_tile r = grouped_walk::locate<BM>(g, s.row_off, s.tile_off, t.m);
    return work{r.e, r.row0, r.row_end, t.n};
  }

  __device__ static void loader(const globals& g, stage_t& st, mbarrier* full, const work& w,
                                int k) {
    tma::load_2d(st.a.data, &g.a, full, k * BK, w.row0);
    tma::load_3d(st.b.data, &g.b, full, k * BK, w.nt * BN, w.e);
    if constexpr (BLOCKWISE) {
      namespace fl = fp8_layout;
      tma::load_2d(st.sx, &g.xs, full, fl::x_scale_box_inner(w.row0), k);
      tma::load_2d(st.sw, &g.ws, full, fl::w_scale_box_inner(w.nt, BN),
                   fl::grouped_w_scale_row(w.e, k, k_iters(g)));
    }
  }

  /** @brief The producer thread: this block's tiles in order, each k step into the ring. */
  __device__ static void produce_tiles(const globals& g, shared_storage& s, int num_tiles) {
    pipeline_state<STAGES> pipe;
    const int iters = k_iters(g);
    for (int id = blockIdx.x; id < num_tiles; id += gridDim.x) {
      const work w = tile(g, s, id);
      for (int k = 0; k < iters; ++k) {
        mbar_wait(&s.empty[pipe.stage], pipe.phase ^ 1);
        mbar_arrive_expect_tx(&s.full[pipe.stage], STAGE_BYTES);
        loader(g, s.stages[pipe.stage], &s.full[pipe.stage], w, k);
        pipe.advance();
      }
    }
  }

  /**
   * @brief Consumer c over tile w: per tensor, each k-block's MMAs into acc, the stage freed one
   * step late (the MMAs of step k may still read it); blockwise, each k-block into acc.part,
   * waited for, promoted into acc.main, the stage freed at once. Returns with every MMA done
   * and every stage of the tile freed; `pipe` carries over to the next tile.
   */
  __device__ static void mainloop(const globals& g, acc_t& acc, shared_storage& s, const work& w,
                                  pipeline_state<STAGES>& pipe, int c, bool leader) {
    const int iters = k_iters(g);
    if constexpr (BLOCKWISE) {
      for (int k = 0; k < iters; ++k) {
        mbar_wait(&s.full[pipe.stage], pipe.phase);
        const stage_t& st = s.stages[pipe.stage];
        // The scales are read before the MMAs are issued, so their latency hides behind them.
        float s0, s1;
        fp8_gemm::row_scales(st.sx, st.sw, w.row0, fp8_layout::w_scale_slot(w.nt, BN, 0), c, s0,
                             s1);
        fp8_gemm::mma_k_block<XT, WT, BN>(acc.part, st.a.data + c * 64 * 128, st.b.data, false);
        wgmma::wait<0>();
        wgmma::fence_regs(acc.part);
        // NOTES: every warp's scale reads must be done before the leader frees the stage (the
        // loader may refill it): the warpgroup's named barrier, the storer's (same threads).
        warpgroup::sync(1 + c);
        fp8_gemm::promote<BN>(acc.main, acc.part, s0, s1, k == 0);
        if (leader) mbar_arrive(&s.empty[pipe.stage]);
        pipe.advance();
      }
    } else {
      int prev = 0;
      for (int k = 0; k < iters; ++k) {
        mbar_wait(&s.full[pipe.stage], pipe.phase);
        const stage_t& st = s.stages[pipe.stage];
        fp8_gemm::mma_k_block<XT, WT, BN>(acc, st.a.data + c * 64 * 128, st.b.data, k > 0);
        wgmma::wait<1>();  // the MMAs of step k may still read stage s; those of k-1 are done
        if (k > 0 && leader) mbar_arrive(&s.empty[prev]);
        prev = pipe.stage;
        pipe.advance();
      }
      wgmma::wait<0>();
      if (leader) mbar_arrive(&s.empty[prev]);  // k_iters >= 1: the handler checks K > 0
    }
  }

  /** @brief Consumer c over this block's tiles (produce_tiles' order): mainloop, epilogue. */
  template <class Epilogue>
  __device__ static void consume_tiles(const globals& g, shared_storage& s, int num_tiles, int c,
                                       bool leader, Epilogue&& epilogue) {
    pipeline_state<STAGES> pipe;
    for (int id = blockIdx.x; id < num_tiles; id += gridDim.x) {
      const work w = tile(g, s, id);
      acc_t acc;
      mainloop(g, acc, s, w, pipe, c, leader);
      epilogue(acc, w);
    }
  }

  /**
   * @brief The storer: consumer c's 64 rows of tile w, EPI_N columns a round, times the scale
   * (per tensor x_scale * w_scale[e]; blockwise already applied) in its staging buffer; a round
   * goes out by TMA when all 64 rows lie in the group, else the group's rows by 16-byte
   * st.global from staging (never past the group: the next group's tiles own those rows).
   */
  __device__ static void storer(const globals& g, const acc_t& acc, out_t& out, int c,
                                const work& w, const lcsc::storer_sync& sync) {
    const int row0 = w.row0 + c * 64;
    const int valid = min(64, w.row_end - row0);
    if (valid <= 0) return;  // this consumer's rows lie past the group (uniform)
    const int col_base = w.nt * BN;
    if constexpr (BLOCKWISE) {
      store_rounds(g, acc.main, 1.0f, out, row0, valid, col_base, sync);
    } else {
      store_rounds(g, acc, __ldg(g.x_scale) * __ldg(g.w_scale + w.e), out, row0, valid, col_base,
                   sync);
    }
  }

  /** @brief Rows [row_off[E], M) of y are zeros, grid-stride over the consumer threads. */
  __device__ static void zero_tail(const globals& g, const shared_storage& s) {
    grouped_walk::zero_rows<OUT, CONSUMERS * WARPGROUP_THREADS>(g, s.row_off[g.groups]);
  }

 private:
  __device__ static void store_rounds(const globals& g, const float (&acc)[BN / 2], float scale,
                                      out_t& out, int row0, int valid, int col_base,
                                      const lcsc::storer_sync& sync) {
#pragma unroll
    for (int e = 0; e < BN / EPI_N; ++e) {
      const int col0 = col_base + e * EPI_N;
      if (col0 >= g.n) break;
      sync.acquire();
      fp8_gemm::stage_round<OUT, BN, EPI_N>(acc, scale, out.data, e);
      if (valid == 64) {
        if (sync.publish()) {
#pragma unroll
          for (int p = 0; p < out_t::PANELS; ++p) {
            if (col0 + p * PANEL_COLS < g.n) {
              tma::store_2d(&g.out, out.panel(p), col0 + p * PANEL_COLS, row0);
            }
          }
          tma::store_commit();
        }
      } else {
        // Boundary tile: the group's rows only, 16-byte chunks straight from staging (generic
        // proxy on both sides: the warpgroup barrier orders the staging writes before them).
        warpgroup::sync(sync.barrier_id);
        constexpr int CHUNK_COLS = 16 / ELEM;
        constexpr int CHUNKS = EPI_N / CHUNK_COLS;  // per row of a round
        char* y = static_cast<char*>(g.y);
        for (int i = warpgroup::thread(); i < valid * CHUNKS; i += WARPGROUP_THREADS) {
          const int r = i / CHUNKS, col = (i % CHUNKS) * CHUNK_COLS;
          if (col0 + col < g.n) {
            const uint4 v = *reinterpret_cast<const uint4*>(
                out.data + fp8_layout::staging_offset<ELEM, 64>(r, col));
            *reinterpret_cast<uint4*>(
                y + (static_cast<size_t>(row0 + r) * g.n + col0 + col) * ELEM) = v;
          }
        }
      }
    }
  }
};

/** @brief The persistent kernel: pk/grouped_walk.cuh persistent_block over kernel_def K. */
template <class K>
__global__ void __launch_bounds__(K::THREADS, 1) kernel(const __grid_constant__ globals g) {
  grouped_walk::persistent_block<K>(g);
}

/**
 * @brief Launches configuration C: one block per SM, at most the upper bound of tiles
 * (`max_tiles`: (ceil(M / BM) + E) x ceil(N / BN), from the caller), at least one block.
 */
template <class C>
inline cudaError_t launch(const globals& g, cudaStream_t stream, int device, int num_sms,
                          long long max_tiles) {
  using K = kernel_def<C>;
  constexpr size_t SMEM = sizeof(typename K::shared_storage) + 1024;
  // NOTES: the static shared wait_bound (pk/mbarrier.cuh) counts against the same 227 KiB.
  static_assert(SMEM + sizeof(wait_bound) <= 232448,
                "grouped_matmul_fp8: shared memory over the sm_90 limit");
  if (cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(&kernel<K>), device,
                                     static_cast<int>(SMEM));
      err != cudaSuccess) {
    return err;
  }
  int grid = num_sms;
  if (max_tiles < grid) grid = max_tiles > 0 ? static_cast<int>(max_tiles) : 1;
  kernel<K><<<grid, K::THREADS, SMEM, stream>>>(g);
  return cudaGetLastError();
}

}  // namespace pk::grouped_matmul_fp8
