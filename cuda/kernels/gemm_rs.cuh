/*
 * gemm_rs: y = rows [r Mp, (r+1) Mp) of sum over ranks p of x_p @ w_p, on rank r (reference:
 * lax.psum_scatter(x @ w, axis, scatter_dimension=0, tiled=True)). Intra-SM overlap: the GEMM's
 * own storer pushes every finished tile into its owner's symmetric workspace with a TMA
 * reduce-add, so the traffic drains while the next tile's main loop runs.
 *
 * Shardings: x: [M, K/P], w: [K/P, N] per rank, y: [Mp, N] with Mp = M / P. Cross-rank
 * accumulation is in T (bf16/fp16: TMA .add on the owner's buffer; each rank's tile is fp32
 * accumulated and rounded once before the add), like XLA's own reduce-scatter in T.
 *
 * Tiles: the output is cut per owner: owner o's rows are tiles_per_owner = ceil(Mp / 128)
 * row blocks starting at row o Mp (the last block of an owner reads rows of the next owner or
 * zeros and its extra rows are dropped by the owner's tensor-map bounds), so no tile straddles
 * two owners and the stores never use negative coordinates. Rank r walks the tile rows rotated
 * by (r + 1) owners, so at any time the P ranks push to P different owners:
 *
 *     step (tile rows)   rank 0        rank 1        rank 2        rank 3      (P = 4)
 *     first quarter      add -> ws1    add -> ws2    add -> ws3    add -> ws0
 *     second quarter     add -> ws2    add -> ws3    add -> ws0    add -> ws1
 *     ...                ...           ...           ...           ...
 *     last quarter       add -> ws0    add -> ws1    add -> ws2    add -> ws3
 *
 * Kernels of one call (XLA's stream; at P = 1 without mode=fused only the matmul kernel):
 *   epoch   (1 thread)   EPOCH += 1 (the epoch e of this call's signals), rank operand check;
 *                        launched after the call's arguments are checked (ffi/tp.h)
 *   enter   (G blocks)   barrier 0; zero my buffer ws_r[Mp, N]; barrier 1 (G from the problem
 *                        size only, the same on every rank: block b meets block b of peers)
 *   gemm    (LCSC)       tiles of x @ w, reduce-added into ws_owner (tensor maps of the peers)
 *   leave   (G blocks)   barrier 2; y <- ws_r                     (pk/tp.cuh)
 *
 * Direct mode (`direct`, set by the launcher at P = 1, the fused protocol forced there): the
 * owner buffer only ever collects peers' contributions, and with no peers the GEMM's storer
 * TMA-stores every tile (all of them are mine) straight into y, as pk.matmul does. The enter
 * and leave kernels have nothing to zero, wait for or copy and are not launched: one call is
 * the epoch kernel plus the GEMM. At P > 1 the protocol above runs unchanged (my own tiles
 * are reduce-added into ws_r like every other tile, because gemm_ar's peers gather ws_r and
 * gemm_rs's leave copy is cheaper than a read-modify-write of y in the tail).
 *
 * Signal protocol: barrier i of helper block b raises slot bar_row(i, b) + r to e on every
 * peer and waits for bar_row(i, b) + s >= e for every s. Barrier 0 proves that every peer's
 * earlier kernels (collectives may still read my workspace when their kernel ends) are over
 * before I zero; barrier 1 that every owner buffer is zero before any add; barrier 2 that every
 * peer's GEMM (all of its adds) completed before I read my buffer. The next call's adds into my
 * buffer wait for its barrier 1, which I join only after this call's leave kernel.
 *
 * Pitfalls: bf16 adds from P ranks land in an order that varies from run to run, so results
 * can differ in the last bit between runs (exact for integer-valued data in range). The
 * buffer lives at workspace offset 0: Mp * N * sizeof(T) bytes must fit (the handler and the
 * Python op check). Zeroing at the start (not the end) is required because the collectives
 * reuse the same workspace between calls.
 */
#pragma once

#include "kernels/matmul.cuh"
#include "pk/tp.cuh"

namespace pk::gemm_rs {

/** @brief matmul's globals (x, w maps; y only in direct mode) plus the owners' buffers. */
struct globals : matmul::globals {
  CUtensorMap acc[tp::MAX_PEERS];  // owner o's buffer: dims {N, Mp}, box {64, 64}
  link_throttle link;              // the rank emulator's link cap (pk/link.cuh; off: one branch)
  int rows_per_owner;              // Mp
  int tiles_per_owner;             // ceil(Mp / BM)
  int world, rank;
  int direct;                      // 1: P = 1, tiles go straight to y (matmul's y map: {N, Mp})
};

/**
 * @brief Rank r starts on owner r + 1's rows (see the table): the tile a block's walk index `t`
 * stands for. G: any globals with the owner fields (gemm_rs's, gemm_rs_fp8's).
 */
template <class G>
__device__ inline tile_coord owner_place(const G& g, tile_coord t) {
  t.m = (t.m + ((g.rank + 1) % g.world) * g.tiles_per_owner) % (g.world * g.tiles_per_owner);
  return t;
}

/**
 * @brief x's first row for placed tile row `tm`. gemm_ar: an owner whose rows all lie past M
 * loads row M - 1 instead of a box wholly out of bounds; its buffer rows are never gathered.
 */
template <int BM, class G>
__device__ inline int owner_x_row(const G& g, int tm) {
  const int o = tm / g.tiles_per_owner, i = tm % g.tiles_per_owner;
  const int row = o * g.rows_per_owner + i * BM;
  return row < g.m ? row : g.m - 1;
}

/** @brief matmul's pipeline with the owner split of the tile rows and a reduce-add storer. */
template <class C>
struct kernel_def : matmul::kernel_def<C> {
  using T = typename C::dtype;
  using base = matmul::kernel_def<C>;
  using globals = gemm_rs::globals;
  using typename base::acc_t, typename base::out_t, typename base::stage_t;
  static constexpr int BM = C::BM, BN = C::BN, BK = C::BK;

  __device__ static tile_scheduler scheduler(const globals& g) {
    return tile_scheduler(g.world * g.tiles_per_owner, ceil_div(g.n, BN), g.group_m);
  }
  __device__ static tile_coord place(const globals& g, tile_coord t) { return owner_place(g, t); }
  __device__ static void setup(const globals& g, lcsc::block_info) {
    tma::prefetch(&g.x);
    tma::prefetch(&g.w);
    if (g.direct) {
      tma::prefetch(&g.y);
    } else {
      for (int o = 0; o < g.world; ++o) tma::prefetch(&g.acc[o]);
    }
  }

  __device__ static void loader(const globals& g, stage_t& s, mbarrier* full, tile_coord t,
                                int k) {
    t = place(g, t);
    tma::load_2d(s.a.data, &g.x, full, k * BK, owner_x_row<BM>(g, t.m));
#pragma unroll
    for (int p = 0; p < base::b_tile::PANELS; ++p) {
      tma::load_2d(s.b.panel(p), &g.w, full, t.n * BN + p * 64, k * BK);
    }
  }

  __device__ static void storer(const globals& g, acc_t& acc, out_t& out, int c, tile_coord t,
                                const lcsc::storer_sync& sync) {
    t = place(g, t);
    const int o = t.m / g.tiles_per_owner;
    const int row0 = (t.m % g.tiles_per_owner) * BM + c * 64;  // row in owner o's buffer
    if (row0 >= g.rows_per_owner) return;  // uniform per warpgroup
    if (g.direct) {  // P = 1: o == rank == 0 and y is my rows (see "Direct mode")
      base::epilogue(g, acc, out, t.n * BN, sync, [&](const T* panel, int col) {
        tma::store_2d(&g.y, panel, col, row0);
      });
      return;
    }
    base::epilogue(g, acc, out, t.n * BN, sync, [&](const T* panel, int col) {
      tma::store_add_2d(&g.acc[o], panel, col, row0);
      if (g.link.on() && o != g.rank) sync.linked(g.link.issue(64 * 64 * sizeof(T)));
    });
  }
};

/**
 * @brief The enter and GEMM kernels of one call (gemm_rs and gemm_ar), after the caller's
 * epoch kernel; the caller then launches its leave kernel with `a` unless `g.direct`. `g` has
 * x, w, m, n, k, group_m, bound and the owner fields (and y when direct); `helper_grid` is the
 * same on every rank. Direct mode (P = 1) launches the GEMM alone.
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

}  // namespace pk::gemm_rs
