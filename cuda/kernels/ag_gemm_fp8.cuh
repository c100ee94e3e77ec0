/*
 * ag_gemm_fp8: ag_gemm (ag_gemm.cuh) with fp8 operands: y = all_gather(x) @ w in bf16, where
 * each rank's row shard x_p comes with its own scales (each rank quantized its own rows), and
 * x_full / xs_full = the gathered fp8 rows and their scales. Reference: each rank's rows
 * dequantized with its scales, gathered, a float32 dot with the dequantized w, then bf16.
 *
 * Shardings: x: [Mp, K] fp8 (e4m3 or e5m2) per rank (rank p holds rows [p Mp, (p+1) Mp) of
 * M = P Mp), w TRANSPOSED wt: [N, K] fp8 per rank (matmul_fp8.cuh: fp8 wgmma reads both
 * operands K-major), y: bf16 [M, N], x_full: [M, K] fp8. Scales (float32, matmul_fp8's layouts):
 *   per tensor  x_scale one float per rank, w_scale one float; xs_full [P] (rank p's x_scale);
 *   blockwise   x_scale this rank's [Mp, KB] transposed, [KB, >= Mp] (row length a multiple
 *               of 4), w_scale [KB, >= ceil(N / 128)]; xs_full [KB, M], the gathered scales
 *               transposed (Mp a multiple of 4: each rank's columns start on 16 bytes).
 *
 * Kernel: ag_gemm's schedule, gather and signal protocol (ag_gemm.cuh: ag_gemm::gather, in
 * ag_gemm's slot range and epoch counter: every rank makes the same calls in the same order)
 * over matmul_fp8's pipeline (per tensor 128x256 with 4 stages or 128x128 with 6; blockwise
 * 128x128 with 5 and the per-k-block promotion). The comm blocks move the scales with the rows
 * (the gather's Scales hooks, scale_moves below): each rank stages its scales after its x in
 * ws_r (at scale_off); the comm block that copies owner o's rows of row block j into x_full
 * also copies their scales into xs_full before raising flag[j] (blockwise: KB rows of the
 * block's columns, bulk copies; per tensor: xs_full[o], a plain store), so the flag covers
 * both. A tile of an own row block reads x and its scales from this rank's inputs (maps xl and
 * xsl), others from x_full and xs_full.
 *
 * Epilogue: per tensor, a consumer's 64 rows are scaled by their owners' x scales times
 * w_scale: one scale when the 64 rows have one owner, else each thread's two rows' own (Mp not
 * a multiple of 64); owner r's is x_scale itself, a peer's is read from xs_full after an
 * acquire of the row block's flag (x_scale_of says why the loader's wait is not enough).
 * Blockwise, the promotion applied every scale and the epilogue scale is 1.
 *
 * Workspace: Mp K bytes of staged x, then the staged scales (16 bytes per tensor, KB Mp 4
 * blockwise).
 *
 * Pitfalls: as ag_gemm's; the scales are per rank, so a row block that straddles two owners
 * takes each part's scales from its owner. Blockwise, every scale copy moves whole 16-byte
 * units: rank p's columns of xs_full start at p Mp floats, hence Mp % 4 == 0 (the handler
 * refuses others; Python routes them to the serial form).
 */
#pragma once

#include <type_traits>

#include "kernels/ag_gemm.cuh"
#include "kernels/matmul_fp8.cuh"
#include "pk/tp.cuh"

namespace pk::ag_gemm_fp8 {

/** @brief matmul_fp8's globals (x = x_full map, xs = xs_full map blockwise; x_scale: this
 * rank's scales) plus ag_gemm's gather fields and the scales' places. */
struct globals : matmul_fp8::globals {
  CUtensorMap xl;   // x: dims {K, Mp}, box {128, BM}, 128B swizzle
  CUtensorMap xsl;  // blockwise: x_scale [KB, xs_ld]: dims {xs_ld, KB}, box {X_SCALE_BOX, 1}
  tp::comm c;
  const void* x_local;
  void* x_full;
  float* xs_full;      // per tensor [P]; blockwise [KB, M]
  uint64_t scale_off;  // the staged scales' offset in every rank's ws (after Mp K bytes of x)
  int xs_ld;           // blockwise: x_scale's row length
  int rows_per_rank;   // Mp
  int tiles_m, row_shift, own_lo, own_hi;  // ag_gemm's placement (ag_gemm.cuh globals)
};

/**
 * @brief `rows` copies of `row_bytes` (16-byte multiples and addresses) from src + i
 * src_stride to dst + i dst_stride by one thread, paced by `link` (off: a local copy).
 */
__device__ inline void copy_rows(bulk_ring& ring, char* dst, uint64_t dst_stride,
                                 const char* src, uint64_t src_stride, uint64_t row_bytes,
                                 uint64_t rows, const link_throttle& link) {
  if (rows == 0 || row_bytes == 0) return;
  row_pieces part{src, dst, src_stride, dst_stride, row_bytes, rows};
  bulk_move<true>(ring, [&](bulk_piece* pc) { return part.next(pc, link.on()); }, link);
}

/** @brief The gather's Scales hooks (ag_gemm::gather): the scales travel with their rows. */
template <bool BLOCKWISE>
struct scale_moves {
  __device__ static int kblocks(const globals& g) { return ceil_div(g.k, fp8_layout::BLOCK); }

  /** @brief My scales -> ws_r at scale_off, for the peers (blockwise: comm block cb's share of
   * the KB rows, as [KB, Mp]). */
  __device__ static void stage(const globals& g, bulk_ring& ring, int cb, int nc) {
    char* dst = static_cast<char*>(g.c.ws[g.c.rank]) + g.scale_off;
    if constexpr (BLOCKWISE) {
      const int kb = kblocks(g), lo = kb * cb / nc, hi = kb * (cb + 1) / nc;
      const uint64_t mp4 = uint64_t(g.rows_per_rank) * 4;
      copy_rows(ring, dst + lo * mp4, mp4,
                reinterpret_cast<const char*>(g.x_scale + int64_t(lo) * g.xs_ld),
                uint64_t(g.xs_ld) * 4, mp4, hi - lo, link_throttle{});
    } else if (cb == 0) {
      *reinterpret_cast<float*>(dst) = *g.x_scale;  // released with staged[0][r]
    }
  }

  /** @brief Owner o's rows [a, b) are in x_full: their scales into xs_full (the ring's link
   * is the gather's, set for owner o). */
  __device__ static void rows(const globals& g, bulk_ring& ring, int o, int64_t a, int64_t b) {
    const int r = g.c.rank;
    const int64_t mp = g.rows_per_rank;
    if constexpr (BLOCKWISE) {
      const char* src = o == r ? reinterpret_cast<const char*>(g.x_scale + (a - o * mp))
                               : static_cast<const char*>(g.c.ws[o]) + g.scale_off +
                                     uint64_t(a - o * mp) * 4;
      const uint64_t src_stride = o == r ? uint64_t(g.xs_ld) * 4 : uint64_t(mp) * 4;
      copy_rows(ring, reinterpret_cast<char*>(g.xs_full + a), uint64_t(g.m) * 4, src,
                src_stride, uint64_t(b - a) * 4, kblocks(g), ring.link);
    } else {
      g.xs_full[o] = o == r ? *g.x_scale
                            : *reinterpret_cast<const volatile float*>(
                                  static_cast<const char*>(g.c.ws[o]) + g.scale_off);
    }
  }

  /** @brief My own block-rows' scales into xs_full (no tile reads them from there: they are
   * for the caller). */
  __device__ static void own(const globals& g, bulk_ring& ring, int cb, int nc) {
    if constexpr (BLOCKWISE) {
      if (g.own_hi <= g.own_lo) return;
      const int64_t first = int64_t(g.own_lo) * ag_gemm::BLOCK_ROWS;
      const int64_t end = int64_t(g.own_hi) * ag_gemm::BLOCK_ROWS;
      const int64_t last = end < g.m ? end : g.m;
      const int kb = kblocks(g), lo = kb * cb / nc, hi = kb * (cb + 1) / nc;
      const int64_t col = first - int64_t(g.c.rank) * g.rows_per_rank;
      copy_rows(ring, reinterpret_cast<char*>(g.xs_full + int64_t(lo) * g.m + first),
                uint64_t(g.m) * 4,
                reinterpret_cast<const char*>(g.x_scale + int64_t(lo) * g.xs_ld + col),
                uint64_t(g.xs_ld) * 4, uint64_t(last - first) * 4, hi - lo, link_throttle{});
    } else if (cb == 0) {
      g.xs_full[g.c.rank] = *g.x_scale;
    }
  }
};

/** @brief matmul_fp8's pipeline with ag_gemm's placement, gather and waits. */
template <class C>
struct kernel_def : matmul_fp8::kernel_def<C> {
  using base = matmul_fp8::kernel_def<C>;
  using globals = ag_gemm_fp8::globals;
  using typename base::acc_t, typename base::out_t, typename base::stage_t;
  using rows = ag_gemm::gather<globals, 1, scale_moves<C::BLOCKWISE>>;
  static constexpr int BM = C::BM, BN = C::BN, BK = C::BK;
  static_assert(BM == ag_gemm::BLOCK_ROWS, "ag_gemm_fp8: the host places row blocks of 128");
  static_assert(std::is_same_v<typename C::out_type, __nv_bfloat16>, "ag_gemm_fp8: y is bf16");

  __device__ static void setup(const globals& g, lcsc::block_info) {
    tma::prefetch(&g.x);
    tma::prefetch(&g.xl);
    tma::prefetch(&g.w);
    tma::prefetch(&g.y);
    if constexpr (C::BLOCKWISE) {
      tma::prefetch(&g.xs);
      tma::prefetch(&g.xsl);
      tma::prefetch(&g.ws);
    }
  }

  /** @brief The first row of tile row m in the x (and x-scale) map the loader reads it from:
   * my shard's for an own row block, x_full's for the others. */
  __device__ static int source_row(const globals& g, int m) {
    return rows::own(g, m) ? m * BM - g.c.rank * g.rows_per_rank : m * BM;
  }

  __device__ static void loader(const globals& g, stage_t& s, mbarrier* full, tile_coord t,
                                int k) {
    // w first: it needs neither the placement nor the flag wait.
    tma::load_2d(s.b.data, &g.w, full, k * BK, t.n * BN);
    if constexpr (C::BLOCKWISE) {
      tma::load_2d(s.sw, &g.ws, full, fp8_layout::w_scale_box_inner(t.n, BN), k);
    }
    t = rows::place(g, t);
    const bool own = rows::own(g, t.m);
    const int row = own ? t.m * BM - g.c.rank * g.rows_per_rank : t.m * BM;
    if (!own && k == 0) rows::wait_rows(g, t.m);
    tma::load_2d(s.a.data, own ? &g.xl : &g.x, full, k * BK, row);
    if constexpr (C::BLOCKWISE) {
      tma::load_2d(s.sx, own ? &g.xsl : &g.xs, full, fp8_layout::x_scale_box_inner(row), k);
    }
  }

  __device__ static void consumer(const globals& g, acc_t& acc, const stage_t& s, int c,
                                  tile_coord t, int k) {
    if constexpr (C::BLOCKWISE) {
      t = rows::place(g, t);
      base::consume(acc, s, c, source_row(g, t.m), t.n, k);
    } else {
      base::consume(acc, s, c, 0, 0, k);  // per tensor: no scale in the k loop
    }
  }

  /**
   * @brief Owner o's x scale for a tile of row block m: mine from x_scale, a peer's from
   * xs_full after an acquire of flag[m] (raised: the loader waited for it), which the comm
   * block released after writing it. The loader's acquire alone does not order this thread's
   * read: its arrive on the stage's full barrier may precede its wait (a one-k-block tile).
   */
  __device__ static float x_scale_of(const globals& g, int o, int m) {
    if (o == g.c.rank) return __ldg(g.x_scale);
    ld_acquire_sys(g.c.sig[g.c.rank] + tp::FLAGS + m);
    return *reinterpret_cast<const volatile float*>(g.xs_full + o);
  }

  __device__ static void storer(const globals& g, acc_t& acc, out_t& out, int c, tile_coord t,
                                const lcsc::storer_sync& sync) {
    t = rows::place(g, t);
    const int row0 = t.m * BM + c * 64;
    if (row0 >= g.m) return;  // this consumer's half lies below y (uniform per warpgroup)
    const auto store = [&](const unsigned char* panel, int col) {
      tma::store_2d(&g.y, panel, col, row0);
    };
    if constexpr (C::BLOCKWISE) {
      base::epilogue(g, acc.main, 1.0f, out, t.n * BN, sync, store);
    } else {
      const int mp = g.rows_per_rank;
      const int last = row0 + 63 < g.m ? row0 + 63 : g.m - 1;
      float scale = __ldg(g.w_scale);
      if (row0 / mp == last / mp) {  // one owner (uniform per warpgroup)
        scale *= x_scale_of(g, row0 / mp, t.m);
      } else {  // this thread's two rows' owners, folded into the accumulator
        const int th = warpgroup::thread();
        const int ra = row0 + fp8_layout::frag_row(th, 0), rb = row0 + fp8_layout::frag_row(th, 1);
        fp8_gemm::promote<BN>(acc, acc, x_scale_of(g, (ra < last ? ra : last) / mp, t.m),
                              x_scale_of(g, (rb < last ? rb : last) / mp, t.m), true);
      }
      base::epilogue(g, acc, scale, out, t.n * BN, sync, store);
    }
  }

  __device__ static void finish(const globals& g, int) { rows::finish(g); }

  __device__ static void communicator(const globals& g, lcsc::block_info info, void* smem) {
    static_assert(sizeof(bulk_ring) <= sizeof(lcsc::shared_storage<kernel_def>),
                  "ag_gemm_fp8: the bulk-copy ring must fit in the block's shared memory");
    rows::communicator(g, info, *static_cast<bulk_ring*>(smem));
  }
};

/** @brief Launches configuration C (matmul_fp8's, bf16 y: ffi/tp.h WithConfigFp8 picks it),
 * the LCSC grid of one call (after the caller's epoch kernel). */
template <class C>
inline cudaError_t launch(const globals& g, cudaStream_t stream, int device, int num_sms,
                          int comm_blocks) {
  const int tiles = ceil_div(g.m, C::BM) * ceil_div(g.n, C::BN);
  return lcsc::launch<kernel_def<C>>(g, stream, device, num_sms, comm_blocks, tiles);
}

}  // namespace pk::ag_gemm_fp8
