/*
 * gemm_rs_fp8 / gemm_ar_fp8: the fused TP GEMMs of gemm_rs.cuh and gemm_ar.cuh with fp8
 * operands. On rank r, with rank p's own scales (per tensor: one float per rank and operand):
 *
 *   gemm_rs_fp8   y = rows [r Mp, (r+1) Mp) of  sum_p xs_p ws_p (x_p @ w_p),  Mp = M / P
 *   gemm_ar_fp8   y = all M rows of the same sum (every rank),  owners of Mp = ceil(M / P) rows
 *
 * (reference: lax.psum_scatter / lax.psum of each rank's dequantized product in float32,
 * rounded to bf16). Each rank's partial tile is accumulated in fp32, scaled by its own
 * xs_p * ws_p (blockwise: its own block scales, by matmul_fp8's per-k-block promotion), rounded
 * to bf16 once and reduce-added in bf16 into the owner's buffer, as the bf16 kernels do: the
 * cross-rank sum is in bf16, like XLA's reduce-scatter of a bf16 product.
 *
 * Shardings: x: [M, K/P] fp8 (e4m3 or e5m2), w TRANSPOSED wt: [N, K/P] fp8 (matmul_fp8.cuh: fp8
 * wgmma reads both operands K-major), x_scale, w_scale: float32 scalars per rank, or this rank's
 * blocks of its shard in matmul_fp8's layout (x 1 x 128 transposed [KB, >= M], w 128 x 128
 * [KB, >= NB], KB = ceil(K/P / 128)); y: bf16 [Mp, N] (rs) or [M, N] (ar). K/P a multiple of
 * 16, N of 8.
 *
 * Kernel: matmul_fp8's kernel_def (per tensor: 128x256 with 4 stages, 128x128 with 6;
 * blockwise: 128x128 with 5) with gemm_rs's owner split of the tile rows (gemm_rs::owner_place:
 * rank r starts on owner r + 1, so the P ranks push to P different owners at a time; schedule
 * table in gemm_rs.cuh) and a storer whose panel store is a TMA reduce-add into owner o's
 * buffer. The fp8
 * epilogue stages 64-row x 128-byte bf16 panels (64 columns): the box of the owners' maps, the
 * same maps as the bf16 ops' ({64, 64} bf16 over ws_o [Mp, N]).
 *
 * Kernels of one call, signal protocol, direct mode (P = 1: tiles stored straight into y, no
 * enter or leave kernel) and workspace (the owner buffer at offset 0, Mp N 2 bytes): exactly
 * gemm_rs.cuh's and gemm_ar.cuh's, in their ops' slot ranges (gemm_rs_fp8 shares gemm_rs's
 * range and epoch counter, gemm_ar_fp8 gemm_ar's: every rank runs the same calls in the same
 * order, so a shared counter still agrees across ranks); the error record names the fp8 op.
 *
 * Pitfalls: the scales are per rank (each rank quantized its own shard), so they scale the
 * partial product before the cross-rank add, never the sum. Blockwise, a tile's rows start at
 * an owner's row (o Mp + i BM, not a multiple of BM when BM does not divide Mp), and so does
 * its x-scale box (as a grouped GEMM's row tile's does); rows past an owner's end read the next
 * owner's scales or zeros and are dropped by the owner map's bounds. As in gemm_rs, bf16 adds
 * from P ranks land in a varying order (last-bit differences between runs; exact for
 * integer-valued data whose sums are bf16-exact).
 */
#pragma once

#include <type_traits>

#include "kernels/gemm_rs.cuh"
#include "kernels/matmul_fp8.cuh"
#include "pk/tp.cuh"

namespace pk::gemm_rs_fp8 {

/** @brief matmul_fp8's globals (x, w maps, scales; y only in direct mode) + the owner fields. */
struct globals : matmul_fp8::globals {
  CUtensorMap acc[tp::MAX_PEERS];  // owner o's buffer: dims {N, Mp}, box {64, 64} bf16
  link_throttle link;              // the rank emulator's link cap (pk/link.cuh; off: one branch)
  int rows_per_owner;              // Mp
  int tiles_per_owner;             // ceil(Mp / BM)
  int world, rank;
  int direct;                      // 1: P = 1, tiles go straight to y (matmul_fp8's y map)
};

/** @brief matmul_fp8's pipeline with the owner split of the tile rows and a reduce-add storer. */
template <class C>
struct kernel_def : matmul_fp8::kernel_def<C> {
  using base = matmul_fp8::kernel_def<C>;
  using globals = gemm_rs_fp8::globals;
  using typename base::acc_t, typename base::out_t, typename base::stage_t;
  static constexpr int BM = C::BM, BN = C::BN, BK = C::BK;
  static_assert(std::is_same_v<typename C::out_type, __nv_bfloat16>,
                "gemm_rs_fp8: the owners' buffers and y are bf16");

  __device__ static tile_scheduler scheduler(const globals& g) {
    return tile_scheduler(g.world * g.tiles_per_owner, ceil_div(g.n, BN), g.group_m);
  }
  __device__ static void setup(const globals& g, lcsc::block_info) {
    tma::prefetch(&g.x);
    tma::prefetch(&g.w);
    if (g.direct) {
      tma::prefetch(&g.y);
    } else {
      for (int o = 0; o < g.world; ++o) tma::prefetch(&g.acc[o]);
    }
    if constexpr (C::BLOCKWISE) {
      tma::prefetch(&g.xs);
      tma::prefetch(&g.ws);
    }
  }

  __device__ static void loader(const globals& g, stage_t& s, mbarrier* full, tile_coord t,
                                int k) {
    t = gemm_rs::owner_place(g, t);
    const int row = gemm_rs::owner_x_row<BM>(g, t.m);
    tma::load_2d(s.a.data, &g.x, full, k * BK, row);
    tma::load_2d(s.b.data, &g.w, full, k * BK, t.n * BN);
    if constexpr (C::BLOCKWISE) {
      // The tile's rows start at an owner's row, not at a multiple of BM: the x-scale box
      // starts at or below it (as a grouped GEMM's row tile does), and consume reads from there.
      tma::load_2d(s.sx, &g.xs, full, fp8_layout::x_scale_box_inner(row), k);
      tma::load_2d(s.sw, &g.ws, full, fp8_layout::w_scale_box_inner(t.n, BN), k);
    }
  }

  __device__ static void consumer(const globals& g, acc_t& acc, const stage_t& s, int c,
                                  tile_coord t, int k) {
    t = gemm_rs::owner_place(g, t);
    base::consume(acc, s, c, gemm_rs::owner_x_row<BM>(g, t.m), t.n, k);
  }

  __device__ static void storer(const globals& g, acc_t& acc, out_t& out, int c, tile_coord t,
                                const lcsc::storer_sync& sync) {
    t = gemm_rs::owner_place(g, t);
    const int o = t.m / g.tiles_per_owner;
    const int row0 = (t.m % g.tiles_per_owner) * BM + c * 64;  // row in owner o's buffer
    if (row0 >= g.rows_per_owner) return;  // uniform per warpgroup
    // This rank's own scales: its partial product is dequantized before the cross-rank add
    // (per tensor here; blockwise, the promotion applied them per k-block).
    if constexpr (C::BLOCKWISE) {
      store_tile(g, acc.main, 1.0f, out, o, row0, t, sync);
    } else {
      store_tile(g, acc, __ldg(g.x_scale) * __ldg(g.w_scale), out, o, row0, t, sync);
    }
  }

  /** @brief The epilogue of one consumer's rows into owner o's buffer (or y when direct). */
  __device__ static void store_tile(const globals& g, float (&sum)[BN / 2], float scale,
                                    out_t& out, int o, int row0, tile_coord t,
                                    const lcsc::storer_sync& sync) {
    if (g.direct) {  // P = 1: o == rank == 0 and y is my rows (gemm_rs.cuh, "Direct mode")
      base::epilogue(g, sum, scale, out, t.n * BN, sync, [&](const unsigned char* panel, int col) {
        tma::store_2d(&g.y, panel, col, row0);
      });
      return;
    }
    base::epilogue(g, sum, scale, out, t.n * BN, sync, [&](const unsigned char* panel, int col) {
      tma::store_add_2d(&g.acc[o], panel, col, row0);
      if (g.link.on() && o != g.rank) sync.linked(g.link.issue(64 * 128));
    });
  }
};

/**
 * @brief The enter and GEMM kernels of one call (gemm_rs_fp8 and gemm_ar_fp8), after the
 * caller's epoch kernel; the caller then launches its leave kernel with `a` unless `g.direct`
 * (gemm_rs::launch_front with the fp8 kernel).
 */
template <class C>
inline cudaError_t launch_front(const globals& g, const tp::rows_args& a, int helper_grid,
                                cudaStream_t stream, int device, int num_sms) {
  if (!g.direct) {
    tp::enter_kernel<<<helper_grid, tp::THREADS, 0, stream>>>(a);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  const int tiles = g.world * g.tiles_per_owner * ceil_div(g.n, C::BN);
  return lcsc::launch<kernel_def<C>>(g, stream, device, num_sms, /*comm_blocks=*/0, tiles);
}

}  // namespace pk::gemm_rs_fp8
