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
 * gemm_ar runs the same kernels with its gather under the GEMM (g.ga.on: another walk order,
 * band counts from the storer, the producer's spare warps copying finished bands into y; its
 * leave kernel is barrier 3 alone): gemm_ar.cuh describes it.
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
  tp::gather_args ga;              // gemm_ar at P > 1: the gather under the GEMM (below)
};

/**
 * @brief The tile a block's walk index `t` stands for. gemm_rs: rank r starts on owner r + 1's
 * rows (see the table). gemm_ar (g.ga.on): band by band, and within band b rank r takes the
 * owners from r + 1 on (band b of owner r + 1 + u is walk rows [(b P + u) H, (b P + u + 1) H)),
 * so band b of every owner is complete after the first b + 1 band steps of every rank. G: any
 * globals with the owner fields (gemm_rs's, gemm_rs_fp8's).
 */
template <class G>
__device__ inline tile_coord owner_place(const G& g, tile_coord t) {
  const int P = g.world, T = g.tiles_per_owner;
  if (!g.ga.on) {
    t.m = (t.m + ((g.rank + 1) % P) * T) % (P * T);
    return t;
  }
  const int H = g.ga.band_tiles, full = (g.ga.bands - 1) * P * H;
  int b, u, i;
  if (t.m < full) {
    b = t.m / (P * H);
    const int rest = t.m - b * P * H;
    u = rest / H;
    i = rest - u * H;
  } else {  // the last band: T - (B - 1) H rows per owner
    b = g.ga.bands - 1;
    const int rows = T - b * H, rest = t.m - full;
    u = rest / rows;
    i = rest - u * rows;
  }
  t.m = ((g.rank + 1 + u) % P) * T + b * H + i;
  return t;
}

/**
 * @brief The tile order of gemm_rs and gemm_ar: P owners' tile rows in groups of group_m rows
 * (L2 reuse of w's column panels). gemm_ar: groups that divide a band's P H walk rows, so a
 * group never spans two bands (band b of every owner still completes after band b's rows of
 * every rank, whichever owners a group spans); a group of H rows alone re-read all of w per
 * band step and ran the GEMM at half speed at the scale model (bench/results/overlap.md).
 */
template <int BN, class G>
__device__ inline tile_scheduler owner_scheduler(const G& g) {
  int group = g.group_m;
  if (g.ga.on) {
    int a = g.world * g.ga.band_tiles, b = group;  // gcd(P H, group_m)
    while (b != 0) {
      const int t = a % b;
      a = b;
      b = t;
    }
    group = a;
  }
  return tile_scheduler(g.world * g.tiles_per_owner, ceil_div(g.n, BN), group);
}

/**
 * @brief gemm_ar, one consumer's leader: counts the tile it parked at its previous call (or,
 * from finish, its last tile) once that tile's reduce-adds have landed (and, in the emulator,
 * crossed the link: sync.link_due); the last count of a band (every tile of my walk in it,
 * both consumers) tells every rank that my adds into that band landed.
 */
template <int BN, int CONSUMERS, class G>
__device__ inline void gather_count(const G& g, const lcsc::storer_sync& sync) {
  const int band = sync.parked;
  if (band < 0) return;
  sync.parked = -1;
  tma::store_wait<0>();               // the adds have landed (writes, not just reads, done)
  link_throttle::drain(sync.link_due);  // and crossed the emulator's link
  fence_proxy_async_global();          // the async-proxy adds before the generic release
  __threadfence_system();
  const tp::comm& c = g.ga.c;
  const int b = band % g.ga.bands, H = g.ga.band_tiles;
  const int rows = min(H, g.tiles_per_owner - b * H);
  const unsigned long long need =
      static_cast<unsigned long long>(rows) * ceil_div(g.n, BN) * CONSUMERS;
  auto* done = reinterpret_cast<unsigned long long*>(c.sig[c.rank] + tp::GATHER_DONE + band);
  if (atomicAdd(done, 1ull) == need - 1) {
    __threadfence_system();  // the count read, then this fence: the other consumers' adds
    const uint64_t e = c.epoch();
    for (int q = 0; q < c.world; ++q) {
      signal(c.sig[q] + tp::GATHER_ARRIVED + uint64_t(band) * c.world + c.rank, e);
    }
  }
}

/** @brief gemm_ar's storer hook (leader): counts the previous tile, parks tile row `tm`. */
template <int BN, int CONSUMERS, class G>
__device__ inline void gather_park(const G& g, int tm, const lcsc::storer_sync& sync) {
  if (!g.ga.on || !sync.leader) return;
  gather_count<BN, CONSUMERS>(g, sync);
  const int T = g.tiles_per_owner;
  sync.parked = (tm / T) * g.ga.bands + (tm % T) / g.ga.band_tiles;
}

/**
 * @brief gemm_ar's gather, run by the producer warpgroup's spare warps (lcsc.cuh helper) of
 * every compute block, threads t = 0..nt-1: for each (band, owner) pair in the order they
 * finish (band-major, owners from r + 1 on), each warp waits for the band's P arrivals (lane p
 * for rank p), then the block's threads copy its 1/G of the band's rows from ws_o into y with
 * 16-byte loads (from a peer's memory unless o = r). In the emulator each warp then reserves the
 * link time of what it pulled and waits for its end (pk/link.cuh: a vector path paced after
 * the fact), so the pulls cross at the link's rate.
 */
template <class G>
__device__ inline void gather_help(const G& g, lcsc::block_info info, int t, int nt) {
  if (!g.ga.on) return;
  const tp::comm& c = g.ga.c;
  const int lane = t % WARP_THREADS, P = c.world, r = c.rank;
  const uint64_t e = c.epoch();
  const int64_t mp = g.rows_per_owner, rows_band = int64_t(g.ga.band_tiles) * 128;
  const uint64_t row_bytes = uint64_t(g.n) * 2;
  for (int j = 0; j < g.ga.bands * P; ++j) {
    const int b = j / P, o = (r + 1 + j % P) % P;
    const int64_t lo = b * rows_band;
    int64_t hi = lo + rows_band < mp ? lo + rows_band : mp;
    if (hi > g.ga.m - o * mp) hi = g.ga.m - o * mp;  // gemm_ar: the last owners may hold fewer
    if (hi <= lo) continue;
    const uint64_t units = uint64_t(hi - lo) * row_bytes / 16;
    const uint64_t per = (units + info.compute_blocks - 1) / info.compute_blocks;
    const uint64_t u0 = per * info.index, u1 = u0 + per < units ? u0 + per : units;
    if (u0 >= u1) continue;
    if (lane < P) {
      const uint64_t band = uint64_t(o) * g.ga.bands + b;
      wait(c.sig[r] + tp::GATHER_ARRIVED + band * P + lane, e, c.timeout_ns, c.fail(), lane);
    }
    __syncwarp();
    fence_proxy_async_global();  // the peers' TMA adds (async proxy) before my generic loads
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(c.ws[o]) +
                                                      uint64_t(lo) * row_bytes);
    uint4* dst = reinterpret_cast<uint4*>(g.ga.y + uint64_t(o * mp + lo) * row_bytes);
    tp::copy_units<4>(dst, [&](uint64_t i) { return src + i; }, u0 + t, nt, u1);
    if (c.link.on() && o != r) {
      __syncwarp();
      const int warps = nt / WARP_THREADS;
      if (lane == 0) link_throttle::drain(c.link.issue((u1 - u0 + warps - 1) / warps * 16));
      __syncwarp();
    }
  }
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
    return owner_scheduler<BN>(g);
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
    gather_park<BN, base::CONSUMERS>(g, t.m, sync);
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

  __device__ static void finish(const globals& g, int, const lcsc::storer_sync& sync) {
    if (g.ga.on && sync.leader) gather_count<BN, base::CONSUMERS>(g, sync);
  }
  static constexpr bool HELPERS = true;  // gemm_ar's gather (gather_help; off for gemm_rs)
  // The gathering warps' 16-byte loads need more than the producer's usual 40 registers
  // (spills at 40); 128 x 56 + 256 x 224 still fits the SM's 64K.
  static constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;
  __device__ static void helper(const globals& g, lcsc::block_info info, int t, int nt) {
    gather_help(g, info, t, nt);
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
