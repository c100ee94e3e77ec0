/*
 * ag_gemm: y = all_gather(x) @ w and x_full = all_gather(x) (reference: lax.all_gather(x, axis,
 * axis=0, tiled=True) @ w; x_full is kept for the backward pass). Inter-SM overlap on the LCSC
 * template: num_comm_sms communication blocks gather the row shards into x_full while the
 * compute blocks multiply, starting on the local rows, which need no communication.
 *
 * Shardings: x: [Mp, K] per rank (rank p holds rows [p Mp, (p+1) Mp) of the M = P Mp rows),
 * w: [K, N] per rank, y: [M, N], x_full: [M, K]. No cross-rank arithmetic (fp32 accumulation
 * inside each tile, as pk.matmul).
 *
 * Schedule of rank r (row block j = rows [128 j, 128 j + 128) of x_full and of y; "own" =
 * every row of the block is in my shard; m0 = first own block, m_end = first block after them):
 *
 *     comm block cb (of C)                         compute blocks (persistent, grouped order)
 *     barrier 0 with peers' block cb               tiles with rows rotated to start at m0:
 *     stage x[cb-th 1/C] -> ws_r (bulk; P > 1      own block: TMA A from x itself, no wait
 *       only), signal staged[cb][r] on every peer  other block j: wait flag[j] >= e, then
 *     for row blocks j = m_end, m_end + 1, ...       TMA A from x_full
 *       (u-th block to comm block u % C):          storer: y tiles (TMA store), as matmul
 *       skip j if it is an own block; rows of
 *       owner o != r: wait staged[*][o] >= e,
 *       x_full rows <- ws_o; my own rows: x_full
 *       rows <- x (bulk copies); flag[j] = e     after the last tile: every consumer warp
 *     my own blocks' rows of x_full <- x, 128     copies 16 KiB units of my own block-rows
 *       KiB claims (bulk copies; no flag)           of x_full that are still unclaimed
 *     barrier 2 with peers' block cb
 *
 * Signal protocol (e = this call's epoch, pk/tp.cuh): barrier 0 (slot bar_row(0, cb) + r on
 * every peer) proves every peer's earlier kernels are over, so none still reads my workspace
 * when I restage it; staged: comm block cb of rank s raises bar_row(1, cb) + s on every peer
 * after its share of x_s is in ws_s; flag[j] (slot FLAGS + j, local pad) is raised to e by the
 * comm block that wrote row block j of x_full (own blocks have none: no compute block waits for
 * them); barrier 2 keeps my kernel alive until every peer has pulled what it needs from my
 * workspace.
 *
 * Data movement: one thread of each comm block moves whole rows with bulk copies (global ->
 * shared -> global through pk/comm_ops.cuh's bulk_ring in the block's otherwise unused shared
 * memory), four 32 KiB stages in flight, instead of 16-byte loads and stores by every thread.
 * Per call: Mp K staged into ws_r for the peers (skipped at P = 1, where nobody reads it), the
 * rows of x_full outside my own row blocks (none at P = 1), then my own row blocks' rows (all of
 * x at P = 1); my rows come straight from x (never through ws_r).
 *
 * Own rows of x_full: nobody waits for them, so they are copied last: a work list of 16 KiB
 * units behind one counter (tp::claim; CLAIMS slot, zeroed by the epoch kernel). The comm
 * blocks claim 8 units at a time after every row block the compute blocks wait for, and every
 * consumer warp of the compute blocks claims one at a time after its last tile, so the copy
 * runs under the GEMM on the comm SMs and what is left when the tiles end takes all SMs (HBM
 * rate). The comm SMs alone copy too slowly: at P = 1 (all of x) the copy outlasted the GEMM at
 * 4096^3 with 4 of them, and 8 cost the GEMM a fifth wave. The loaders used to store them
 * instead, from the A tiles they had loaded (one HBM write, no comm SM time), but the store's
 * bookkeeping and its waits sat in the loader, whose work per k step is on the pipeline's
 * critical path (3 stages of 128x256 tiles). The loader issues the B panels first (they need
 * neither the placement nor the flag wait); the tile order's rotation and "own" are a few
 * compares against values the host computed (computing them from rank and Mp per k step, a
 * remainder and 64-bit products, took a large share of the kernel in ncu).
 * measured: bench/results/tp_notes.md, "Measurements moved from code comments (issue 37)".
 *
 * The placement, the loader's wait, the comm blocks and the own-row copy are ag_gemm::gather,
 * which ag_gemm_fp8.cuh shares (its x scales travel with the rows through the Scales hooks).
 *
 * Pitfalls: bulk copies and TMA loads are the async proxy, the signals the generic proxy, so
 * the copying thread and the loader fence.proxy.async.global around the release/acquire.
 * Compute blocks spin on flags written by comm blocks of the same grid, so every comm block
 * must be resident whenever a compute block is: lcsc puts the comm blocks first in the grid
 * (blocks dispatch in index order), which holds even when other work occupies some SMs. The
 * comm blocks pair up across ranks (barriers, staged[cb]), so num_comm_sms must be the same on
 * every rank: it is an attribute of the call, not derived from the local SM count; the compute
 * grid may differ between ranks. The staging buffer takes Mp K sizeof(T) bytes of workspace.
 * The loader runs with PRODUCER_REGS = 40 registers (the consumers' setmaxnreg needs every
 * register it frees): moving the rotation into the tile scheduler spilled it (ptxas).
 */
#pragma once

#include "kernels/matmul.cuh"
#include "pk/tp.cuh"

namespace pk::ag_gemm {

/** @brief Rows of a row block (every configuration's BM): the host computes the placement
 * below (tiles_m, row_shift, own_lo, own_hi) and the A maps' boxes in these units. */
constexpr int BLOCK_ROWS = 128;

/** @brief Bytes of one unit of the own-row copy that comm blocks and compute warps share, and
 * the units a comm block claims at once (COMM_CLAIM x OWN_UNIT = 4 bulk-ring stages). */
constexpr uint64_t OWN_UNIT = 16 * 1024;
constexpr uint64_t COMM_CLAIM = 8;

/** @brief matmul's globals (x = x_full map, w, y) plus the local shard and the communicator. */
struct globals : matmul::globals {
  CUtensorMap xl;     // x: dims {K, Mp}, box {64, BM}
  tp::comm c;
  const void* x_local;
  void* x_full;
  int rows_per_rank;  // Mp
  // Set by the host from rank and Mp, so the loader's per-k-step work is a few compares:
  int tiles_m;          // ceil(M / BM)
  int row_shift;        // the tile order starts at block-row ceil(rank Mp / BM) (mod tiles_m)
  int own_lo, own_hi;   // block-rows [own_lo, own_hi) lie wholly in my shard
};

/** @brief What travels with the rows: nothing for the 16-bit op (ag_gemm_fp8.cuh moves the
 * fp8 rows' scales through these hooks). */
struct no_scales {
  template <class G>
  __device__ static void stage(const G&, bulk_ring&, int, int) {}
  template <class G>
  __device__ static void rows(const G&, bulk_ring&, int, int64_t, int64_t) {}
  template <class G>
  __device__ static void own(const G&, bulk_ring&, int, int) {}
};

/**
 * @brief The gather of the schedule above, shared by ag_gemm and ag_gemm_fp8: the tile order's
 * placement, the loader's wait for a row block, the compute warps' share of the own-row copy
 * and the communication blocks. G: the op's globals (the fields of `globals` above, by name);
 * ROW_ELEM: bytes of an element of x; Scales: hooks that move what travels with the rows
 * (stage: my share into ws_r; rows: after owner o's rows [a, b) reached x_full; own: my own
 * block-rows), called by the comm blocks' copying thread.
 */
template <class G, int ROW_ELEM, class Scales = no_scales>
struct gather {
  static constexpr int BM = BLOCK_ROWS;

  __device__ static bool own(const G& g, int m) { return m >= g.own_lo && m < g.own_hi; }
  /** @brief Rotates the tile order's block-rows to start at mine (row_shift from the host). */
  __device__ static tile_coord place(const G& g, tile_coord t) {
    t.m += g.row_shift;
    if (t.m >= g.tiles_m) t.m -= g.tiles_m;
    return t;
  }

  /** @brief The loader, before its first TMA load of row block m (not an own one) of x_full. */
  __device__ static void wait_rows(const G& g, int m) {
    // NOTES: a flag stays down when a comm block waits for a missing peer; that block's
    // timeout names the peer, so the flag wait allows 1/8 more before naming the row
    // block's owner itself.
    const int owner = static_cast<int>(int64_t(m) * BM / g.rows_per_rank);
    wait(g.c.sig[g.c.rank] + tp::FLAGS + m, g.c.epoch(), g.c.timeout_ns + g.c.timeout_ns / 8,
         g.c.fail(), owner < g.c.world ? owner : g.c.world - 1);
    fence_proxy_async_global();
  }

  /** @brief My own block-rows of x_full and where they come from in x: `units` of OWN_UNIT. */
  struct own_rows {
    char* dst;
    const char* src;
    uint64_t bytes, units;
  };
  __device__ static own_rows own_rows_of(const G& g) {
    const uint64_t row_bytes = uint64_t(g.k) * ROW_ELEM;
    const int64_t first = int64_t(g.own_lo) * BM;
    const int64_t last = int64_t(g.own_hi) * BM < g.m ? int64_t(g.own_hi) * BM : g.m;
    const uint64_t bytes = uint64_t(last - first) * row_bytes;
    return own_rows{static_cast<char*>(g.x_full) + first * row_bytes,
                    static_cast<const char*>(g.x_local) +
                        (first - int64_t(g.c.rank) * g.rows_per_rank) * row_bytes,
                    bytes, (bytes + OWN_UNIT - 1) / OWN_UNIT};
  }

  /**
   * @brief After its last tile, each warp of a consumer warpgroup copies units of my own rows
   * of x_full that the comm blocks have not claimed yet (16-byte loads and stores, 8 in flight
   * per thread), until none is left.
   */
  __device__ static void finish(const G& g) {
    if (g.own_hi <= g.own_lo) return;  // uniform: no own block-row
    const own_rows own = own_rows_of(g);
    const int lane = static_cast<int>(threadIdx.x % 32);
    for (;;) {
      uint64_t u = 0;
      if (lane == 0) u = tp::claim(g.c, 1, own.units);
      u = __shfl_sync(0xffffffffu, u, 0);
      if (u >= own.units) return;
      const uint64_t hi = (u + 1) * OWN_UNIT < own.bytes ? (u + 1) * OWN_UNIT : own.bytes;
      const uint4* src = reinterpret_cast<const uint4*>(own.src);
      tp::copy_units(reinterpret_cast<uint4*>(own.dst), [&](uint64_t i) { return src + i; },
                     u * OWN_UNIT / 16 + lane, 32, hi / 16);
    }
  }

  /** @brief One block of the gather: thread 0 moves the data with bulk copies (see above). */
  __device__ static void communicator(const G& g, lcsc::block_info info, bulk_ring& ring) {
    const bool lead = threadIdx.x == 0;
    const tp::comm& c = g.c;
    const int nc = info.comm_blocks, cb = info.index, r = c.rank;
    const uint64_t e = c.epoch();
    const int64_t mp = g.rows_per_rank;
    const uint64_t row_bytes = uint64_t(g.k) * ROW_ELEM;
    const uint64_t shard_units = uint64_t(mp) * row_bytes / 16;
    if (lead) ring.init();
    c.barrier(0, cb, e);
    if (lead && c.world > 1) {  // my share of x -> ws_r, for the peers only
      fence_proxy_async_global();  // barrier 0's acquires before the bulk stores into ws_r
      const uint64_t lo = shard_units * cb / nc * 16, hi = shard_units * (cb + 1) / nc * 16;
      bulk_copy(ring, static_cast<char*>(c.ws[r]) + lo,
                static_cast<const char*>(g.x_local) + lo, hi - lo);
      Scales::stage(g, ring, cb, nc);
    }
    tp::publish(c, tp::bar_row(1, cb) + r, e, /*local=*/false);  // staged[cb][r]
    const int tiles_m = ceil_div(g.m, BM);
    const int m_end = int64_t(r + 1) * mp >= g.m ? 0 : static_cast<int>((r + 1) * mp / BM);
    uint32_t staged = 0;  // owners whose whole shard is staged (uniform across the block)
    for (int u = cb; u < tiles_m; u += nc) {
      const int j = (u + m_end) % tiles_m;
      if (own(g, j)) continue;  // copied after the others (uniform per block)
      const int64_t lo = int64_t(j) * BM, hi = lo + BM < g.m ? lo + BM : g.m;
      const int o_lo = static_cast<int>(lo / mp), o_hi = static_cast<int>((hi - 1) / mp);
      for (int o = o_lo; o <= o_hi; ++o) {
        if (o != r && !((staged >> o) & 1u)) {  // my own rows come from x: no wait
          if (static_cast<int>(threadIdx.x) < nc) {
            wait(c.sig[r] + tp::bar_row(1, threadIdx.x) + o, e, c.timeout_ns, c.fail(), o);
          }
          staged |= 1u << o;
        }
      }
      __syncthreads();
      if (lead) {  // rows [lo, hi) of x_full from their owners' workspaces, mine from x
        fence_proxy_async_global();  // the staged acquires before the bulk loads
        for (int o = o_lo; o <= o_hi; ++o) {
          ring.link = c.link.peer(o, r);  // emulator's link throttle: paces a peer's rows
          const int64_t a = lo > o * mp ? lo : o * mp;
          const int64_t b = hi < (o + 1) * mp ? hi : (o + 1) * mp;
          const char* src = o == r ? static_cast<const char*>(g.x_local)
                                   : static_cast<const char*>(c.ws[o]);
          bulk_copy(ring, static_cast<char*>(g.x_full) + a * row_bytes,
                    src + (a - o * mp) * row_bytes, (b - a) * row_bytes);
          Scales::rows(g, ring, o, a, b);
        }
      }
      tp::publish(c, tp::FLAGS + j, e, /*local=*/true);  // flag[j]
    }
    if (lead) Scales::own(g, ring, cb, nc);
    if (lead && g.own_hi > g.own_lo) {  // my own block-rows of x_full, claimed 128 KiB at a time
      const own_rows own = own_rows_of(g);
      uint64_t cur = 0, end = 0;
      bulk_move(ring, [&](bulk_piece* pc) {  // not paced: a local copy
        if (cur >= end) {
          const uint64_t u = tp::claim(c, COMM_CLAIM, own.units);
          if (u >= own.units) return false;
          cur = u * OWN_UNIT;
          end = (u + COMM_CLAIM) * OWN_UNIT < own.bytes ? (u + COMM_CLAIM) * OWN_UNIT : own.bytes;
        }
        const uint64_t n = end - cur < bulk_ring::STAGE_BYTES ? end - cur : bulk_ring::STAGE_BYTES;
        pc->src = own.src + cur;
        pc->dst = own.dst + cur;
        pc->bytes = static_cast<uint32_t>(n);
        cur += n;
        return true;
      });
    }
    if (lead) fence_proxy_async_global();  // my bulk reads of peers' ws before the release
    c.barrier(2, cb, e);
  }
};

template <class C>
struct kernel_def : matmul::kernel_def<C> {
  using base = matmul::kernel_def<C>;
  using globals = ag_gemm::globals;
  using typename base::acc_t, typename base::out_t, typename base::stage_t;
  using rows = gather<globals, int(sizeof(typename C::dtype))>;
  static constexpr int BM = C::BM, BN = C::BN, BK = C::BK;
  static_assert(BM == BLOCK_ROWS, "ag_gemm: the host places row blocks of BLOCK_ROWS rows");

  __device__ static void setup(const globals& g, lcsc::block_info) {
    const CUtensorMap* maps[] = {&g.x, &g.xl, &g.w, &g.y};
    for (const CUtensorMap* m : maps) tma::prefetch(m);
  }

  __device__ static void loader(const globals& g, stage_t& s, mbarrier* full, tile_coord t,
                                int k) {
    // B first: it needs neither the placement nor the flag wait.
#pragma unroll
    for (int p = 0; p < base::b_tile::PANELS; ++p) {
      tma::load_2d(s.b.panel(p), &g.w, full, t.n * BN + p * 64, k * BK);
    }
    t = rows::place(g, t);
    if (rows::own(g, t.m)) {
      tma::load_2d(s.a.data, &g.xl, full, k * BK, t.m * BM - g.c.rank * g.rows_per_rank);
      return;
    }
    if (k == 0) rows::wait_rows(g, t.m);
    tma::load_2d(s.a.data, &g.x, full, k * BK, t.m * BM);
  }

  __device__ static void storer(const globals& g, acc_t& acc, out_t& out, int c, tile_coord t,
                                const lcsc::storer_sync& sync) {
    base::storer(g, acc, out, c, rows::place(g, t), sync);
  }

  __device__ static void finish(const globals& g, int) { rows::finish(g); }

  __device__ static void communicator(const globals& g, lcsc::block_info info, void* smem) {
    static_assert(sizeof(bulk_ring) <= sizeof(lcsc::shared_storage<kernel_def>),
                  "ag_gemm: the bulk-copy ring must fit in the block's shared memory");
    rows::communicator(g, info, *static_cast<bulk_ring*>(smem));
  }
};

/** @brief Launches the LCSC grid of one call (after the caller's epoch kernel). */
template <class C>
inline cudaError_t launch(const globals& g, cudaStream_t stream, int device, int num_sms,
                          int comm_blocks) {
  const int tiles = ceil_div(g.m, C::BM) * ceil_div(g.n, C::BN);
  return lcsc::launch<kernel_def<C>>(g, stream, device, num_sms, comm_blocks, tiles);
}

}  // namespace pk::ag_gemm
