/*
 * grouped_matmul: y[rows of group e] = x[rows of group e] @ w[e] on one GPU (reference:
 * jax.lax.ragged_dot), fp32 accumulation, output in the input dtype (bf16 or fp16), and the
 * two products of its VJP. One kernel template, three modes:
 *
 *   mode | computes                          | A (smem)              | B (smem)
 *   -----+-----------------------------------+-----------------------+---------------------------
 *   FWD  | y  [M, N]    = x_e  @ w[e]        | x  [M, K], K-major    | w  [E, K, N], N-major
 *   DX   | dx [M, K]    = dy_e @ w[e]^T      | dy [M, N], K-major    | w  [E, K, N], K-major (B^T)
 *   DW   | dw [E, K, N] = x_e^T @ dy_e       | x  [M, K], MN-major   | dy [M, N], N-major
 *
 * Groups are consecutive row ranges of x: group e owns rows [off_e, off_e + size_e) with
 * off_e = group_sizes[0] + ... + group_sizes[e - 1] (each size clamped to >= 0, ranges clamped
 * to M). Rows past sum(group_sizes) are zero in y and dx. group_sizes lives on the device: every
 * block scans it into shared memory at start (warp 0, E <= MAX_GROUPS), so sizes are traced
 * values (no recompile, no host sync).
 *
 * Schedule (one persistent block per SM, grid-stride over tile ids like the LCSC template):
 *   FWD/DX: group e has tiles_e = ceil(size_e / BM) row tiles starting at off_e (not tile
 *     aligned), so the row tiles of all groups form one virtual column of T = sum tiles_e;
 *     tile ids walk (T x tiles_n) in matmul's banded order and a binary search over the
 *     prefix sums of tiles_e finds each row tile's group:
 *
 *       row tile  | 0        1        2        3          4        ...
 *       group     | 0        0        0 (part) 2          2 (part) ...  (group 1 empty)
 *       rows      | off0+0   off0+128 off0+256 off2+0     off2+128
 *
 *   DW: output tiles (e, BM rows of K, BN cols of N), id = e * tiles_per_group + banded id;
 *     the k loop runs over the group's rows, ceil(size_e / BK) steps (0 for an empty group:
 *     the tile is stored as zeros).
 *
 *   warpgroup | role
 *   ----------+----------------------------------------------------------------------------
 *   0         | loader: 1 thread; TMA A box(es) and B boxes into stage s, on full[s]
 *   1, 2      | consumers: rows 0..63 / 64..127 of the tile, 4 x wgmma m64n256k16 per stage,
 *             | then storer (fp32 -> T -> swizzled smem -> TMA store, or masked stores)
 *
 *   FWD_PP, DX_PP (config_pingpong, 128 x 128 tiles): consumer c computes whole tiles, the
 *   block's tiles c, c + 2, ..; 2 x 4 wgmma m64n128k16 per stage; the consumers take turns at
 *   the MMAs (named barriers), so one stores while the other computes. Each stage is consumed
 *   by one consumer (empty[s] counts 1).
 *
 * Signals: none (no peers).
 *
 * Pitfalls: TMA loads of a row tile may read rows of the next group (FWD/DX: those output rows
 * are never stored; DW: they are in the contraction, so both consumers zero the rows past the
 * group in the stage's A and B before the MMAs of the last k step, behind a fence.proxy.async
 * and a 256-thread named barrier). Stores never leave the group: a consumer's 64 rows go out by
 * TMA only when all 64 lie inside it, else by 16-byte st.global of the rows that do. w and dw
 * use 3-D tensor maps {N, K, E} so that K or N edges zero-fill/drop per expert instead of
 * reading/writing the neighbouring expert. The grid is sized on the host from an upper bound of
 * the tile count (ceil(M / BM) + E row tiles); blocks without tiles only zero the tail rows.
 */
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "pk/common.cuh"
#include "pk/grouped_walk.cuh"
#include "pk/lcsc.cuh"
#include "pk/mbarrier.cuh"
#include "pk/scheduler.cuh"
#include "pk/smem.cuh"
#include "pk/tma.cuh"
#include "pk/tma_3d.cuh"
#include "pk/warpgroup.cuh"
#include "pk/wgmma.cuh"
#include "pk/wgmma_ta.cuh"

namespace pk::grouped_matmul {

/** @brief Most groups (experts) one call takes; the op falls back to the reference above. */
constexpr int MAX_GROUPS = 1024;

// FEW: FWD for calls of at most FEW_MAX_ROWS rows in all (decode), by the few_rows kernel
// below instead of the tiled GEMM. FWD_PP, DX_PP: FWD and DX by the ping-pong schedule
// (config_pingpong).
enum mode_id : int { FWD = 0, DX = 1, DW = 2, FEW = 3, FWD_PP = 4, DX_PP = 5, NUM_MODES = 6 };

/** @brief Kernel arguments (see the mode table above for a, b, out). */
struct globals {
  CUtensorMap a;    // FWD/DX: dims {K', M}, box {64, 128}; DW: x dims {K, M}, box {64, 64}
  CUtensorMap b;    // FWD: w {N, K, E} box {64, 64, 1}; DX: w {N, K, E} box {64, BN, 1};
                    // DW: dy {N, M} box {64, 64}
  CUtensorMap out;  // FWD/DX: y {N', M} box {64, 64}; DW: dw {N, K, E} box {64, 64, 1}
  void* y;          // FWD/DX: the output (masked stores and zeroed tail rows)
  const int* group_sizes;  // [E] int32, on the device
  int m;            // rows of x (and of y)
  int n;            // output columns (FWD: N, DX: K, DW: N)
  int k;            // FWD/DX: contraction (K, N); DW: output rows per group (K)
  int groups;       // E
  int group_m;      // block-rows per band of the tile order
};

/**
 * @brief One tile configuration. Cooperative (PINGPONG false): BM = 128, BN = 256, BK = 64, 3
 * stages, whole-tile staging; the two consumers split each tile's rows.
 *
 * Ping-pong (FWD or DX, config_pingpong): each consumer computes whole 128 x 128 tiles, the two
 * taking turns (a block's tiles 0, 2, 4, .. and 1, 3, 5, ..), so that one consumer's epilogue
 * runs while the other's MMAs keep the tensor cores busy; 5 stages of 32 KiB and one 128 x 64
 * staging panel per consumer (two store rounds a tile). The op takes it for output widths that
 * 256-wide tiles would pad (pk_jax grouped_matmul.pingpong_width; elsewhere the 128 x 256 tiles
 * are faster: bench/results/grouped_matmul_notes.md).
 */
template <typename T, int MODE, bool PINGPONG_ = false>
struct config {
  using dtype = T;
  static constexpr int mode = MODE;
  static constexpr bool PINGPONG = PINGPONG_;
  static constexpr int BM = 128, BN = PINGPONG ? 128 : 256, BK = 64, STAGES = PINGPONG ? 5 : 3;
};

template <typename T, int MODE>
using config_pingpong = config<T, MODE, true>;

/** @brief A unit of work: an output tile and the rows of its group. */
struct work {
  int e;        // group
  int row0;     // FWD/DX: first output row of the tile; DW: first row of the group
  int row_end;  // end of the group's rows
  int mt, nt;   // DW: row tile inside the group's [K, N] output; nt: column tile
  int k_iters;
};

template <class C>
struct kernel_def {
  using globals = grouped_matmul::globals;
  using work = grouped_matmul::work;
  using T = typename C::dtype;
  static constexpr int MODE = C::mode;
  static constexpr int BM = C::BM, BN = C::BN, BK = C::BK, STAGES = C::STAGES;
  static constexpr int CONSUMERS = 2;
  static constexpr int THREADS = (CONSUMERS + 1) * WARPGROUP_THREADS;
  static constexpr bool PINGPONG = C::PINGPONG;
  static_assert(!PINGPONG || (MODE != DW && BM == 128),
                "grouped_matmul: the ping-pong schedule runs FWD or DX, one 128-row tile a "
                "consumer");
  // Rows of a tile one consumer computes: half the tile (cooperative) or all of it (ping-pong).
  static constexpr int CONSUMER_ROWS = PINGPONG ? BM : BM / CONSUMERS;
  static constexpr int ACC = CONSUMER_ROWS / 64 * (BN / 2);  // fp32 accumulators per thread
  // Named barriers: 1 + c the storers' (lcsc::storer_sync), 3 DW's tail zeroing, TURN + c the
  // ping-pong consumers' turns at the tensor cores.
  static constexpr int TURN = 4;

  // A: FWD/DX one K-major panel of BM rows; DW two MN-major panels of BK rows x 64.
  using a_tile = std::conditional_t<MODE == DW, st_panels<T, BK, BM>, st_panels<T, BM, BK>>;
  // B: FWD/DW BN/64 N-major panels of BK rows; DX one K-major panel of BN rows.
  using b_tile = std::conditional_t<MODE == DX, st_panels<T, BN, BK>, st_panels<T, BK, BN>>;
  struct stage_t {
    a_tile a;
    b_tile b;
  };
  // Staging of a consumer's stores: its 64 rows whole, or (ping-pong) 64 columns of its 128 rows.
  using out_t = std::conditional_t<PINGPONG, st_panels<T, BM, 64>, st_panels<T, 64, BN>>;
  using acc_t = float[ACC];
  static constexpr uint32_t STAGE_BYTES = a_tile::BYTES + b_tile::BYTES;

  struct shared_storage {
    stage_t stages[STAGES];
    out_t out[CONSUMERS];
    mbarrier full[STAGES];
    mbarrier empty[STAGES];
    int row_off[MAX_GROUPS + 1];   // first row of group e (clamped to M); [E] = end of rows
    int tile_off[MAX_GROUPS + 1];  // FWD/DX: first virtual row tile of group e; [E] = total
  };

  /**
   * @brief Thread 0, before the block's first barrier: the stage ring's mbarriers, `bound` for
   * every wait of the block, and the A and B maps prefetched.
   */
  __device__ static void init_ring(const globals& g, shared_storage& s, const wait_bound& bound) {
    block_wait_bound() = bound;
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], PINGPONG ? 1 : CONSUMERS);  // ping-pong: one consumer per stage
    }
    fence_mbar_init();
    tma::prefetch(&g.a);
    tma::prefetch(&g.b);
  }

  /**
   * @brief The producer thread: loads tile w's k-steps in order into the ring, each into the
   * next stage once the consumers have freed it (`pipe` carries over between tiles).
   * IDS: also writes `id` into ids[stage] for the tile's first stage, before that stage's
   * arrival (consumers of a dynamically claimed tile order read it there).
   */
  template <bool IDS = false>
  __device__ static void produce(const globals& g, shared_storage& s, const work& w,
                                 pipeline_state<STAGES>& pipe, int* ids = nullptr, int id = 0) {
    for (int k = 0; k < w.k_iters; ++k) {
      mbar_wait(&s.empty[pipe.stage], pipe.phase ^ 1);
      if constexpr (IDS) {
        if (k == 0) ids[pipe.stage] = id;
      }
      mbar_arrive_expect_tx(&s.full[pipe.stage], STAGE_BYTES);
      loader(g, s.stages[pipe.stage], &s.full[pipe.stage], w, k);
      pipe.advance();
    }
  }

  /**
   * @brief The producer thread of the static schedule (grouped_matmul, moe_gemm_combine): this
   * block's tile ids blockIdx.x, + gridDim.x, ... in order, through one ring.
   */
  __device__ static void produce_tiles(const globals& g, shared_storage& s, int num_tiles) {
    pipeline_state<STAGES> pipe;
    for (int id = blockIdx.x; id < num_tiles; id += gridDim.x) {
      produce(g, s, tile(g, s, id), pipe);
    }
  }

  /**
   * @brief Consumer c's mainloop over tile w, shared by every grouped GEMM kernel (this file's
   * and the fused MoE kernels', which differ only in where tiles come from and in the
   * epilogue): acc zeroed, then per k step: wait full[stage], DW's tail rows zeroed, the MMAs
   * into acc, and the stage freed one step late (the MMAs of step k may still read it; those of
   * step k-1 are done). Returns with every MMA done and every stage of the tile freed; `pipe`
   * (the consumer's place in the ring) carries over to the next tile.
   */
  __device__ static void mainloop(acc_t& acc, shared_storage& s, const work& w,
                                  pipeline_state<STAGES>& pipe, int c, bool leader) {
    // NOTES: zeroed on every tile (not only for empty DW groups): a write of the accumulator
    // under a data-dependent branch makes ptxas serialize every wgmma of the kernel.
#pragma unroll
    for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
    int prev = 0;
    for (int k = 0; k < w.k_iters; ++k) {
      mbar_wait(&s.full[pipe.stage], pipe.phase);
      if constexpr (MODE == DW) {
        const int valid = w.row_end - (w.row0 + k * BK);
        if (valid < BK) zero_tail_rows(s.stages[pipe.stage], c, valid);
      }
      consumer(acc, s.stages[pipe.stage], c, k);
      wgmma::wait<1>();  // the MMAs of step k may still read stage s; those of k-1 are done
      if (k > 0 && leader) mbar_arrive(&s.empty[prev]);
      prev = pipe.stage;
      pipe.advance();
    }
    wgmma::wait<0>();
    if (w.k_iters > 0 && leader) mbar_arrive(&s.empty[prev]);
  }

  /**
   * @brief Consumer c over the static schedule (produce_tiles' tiles, in its order): per tile,
   * mainloop, then epilogue(acc, w) with the finished accumulator, the one per-op part
   * (grouped_matmul's storer, moe_gemm_combine's stores to the token owners).
   */
  template <class Epilogue>
  __device__ static void consume_tiles(const globals& g, shared_storage& s, int num_tiles, int c,
                                       bool leader, Epilogue&& epilogue) {
    pipeline_state<STAGES> pipe;
    if constexpr (PINGPONG) {
      // Consumer c takes the block's tiles c, c + 2, ..; the ring holds every tile's k steps in
      // order, so it skips the other consumer's (FWD, DX: k_iters steps a tile). Turns: consumer c
      // starts a tile's MMAs only once the other finished its previous tile's (the first tile
      // goes to consumer 0 at once), so that one's epilogue overlaps the other's mainloop
      // rather than both computing together and then both storing. The turns also keep the
      // parity waits right: a consumer waits on a stage's full barrier only after every earlier
      // use of that stage completed (a wait two phases ahead would pass at once).
      const int k_iters = ceil_div(g.k, BK);
      const int step = CONSUMERS * gridDim.x;
      if (c == 1) {
        for (int j = 0; j < k_iters; ++j) pipe.advance();
      }
      for (int id = blockIdx.x + c * gridDim.x; id < num_tiles; id += step) {
        const work w = tile(g, s, id);
        acc_t acc;
        if (id >= step || c == 1) warpgroup::sync(TURN + c, CONSUMERS * WARPGROUP_THREADS);
        mainloop(acc, s, w, pipe, c, leader);
        // The other consumer's next tile (id + gridDim.x) waits for this turn.
        if (id + gridDim.x < num_tiles) {
          warpgroup::arrive(TURN + 1 - c, CONSUMERS * WARPGROUP_THREADS);
        }
        epilogue(acc, w);
        for (int j = 0; j < k_iters; ++j) pipe.advance();
      }
    } else {
      for (int id = blockIdx.x; id < num_tiles; id += gridDim.x) {
        const work w = tile(g, s, id);
        acc_t acc;
        mainloop(acc, s, w, pipe, c, leader);
        epilogue(acc, w);
      }
    }
  }

  /** @brief Warp 0: the group scan (pk/grouped_walk.cuh) into row_off and tile_off. */
  __device__ static void scan_groups(const globals& g, shared_storage& s) {
    grouped_walk::scan_groups<BM>(g, s.row_off, s.tile_off);
  }

  __device__ static int tiles_m_dw(const globals& g) { return ceil_div(g.k, BM); }

  __device__ static int num_tiles(const globals& g, const shared_storage& s) {
    if constexpr (MODE == DW) {
      return g.groups * tiles_m_dw(g) * ceil_div(g.n, BN);
    } else {
      return s.tile_off[g.groups] * ceil_div(g.n, BN);
    }
  }

  __device__ static work tile(const globals& g, const shared_storage& s, int id) {
    work w;
    const int tiles_n = ceil_div(g.n, BN);
    if constexpr (MODE == DW) {
      const int per_group = tiles_m_dw(g) * tiles_n;
      w.e = id / per_group;
      const tile_coord t = tile_scheduler(tiles_m_dw(g), tiles_n, g.group_m).coord(id % per_group);
      w.mt = t.m;
      w.nt = t.n;
      w.row0 = s.row_off[w.e];
      w.row_end = s.row_off[w.e + 1];
      w.k_iters = ceil_div(w.row_end - w.row0, BK);
    } else {
      const tile_coord t = tile_scheduler(s.tile_off[g.groups], tiles_n, g.group_m).coord(id);
      const grouped_walk::row_tile r =
          grouped_walk::locate<BM>(g, s.row_off, s.tile_off, t.m);
      w.e = r.e;
      w.mt = t.m;
      w.nt = t.n;
      w.row0 = r.row0;
      w.row_end = r.row_end;
      w.k_iters = ceil_div(g.k, BK);
    }
    return w;
  }

  __device__ static void loader(const globals& g, stage_t& st, mbarrier* full, const work& w,
                                int k) {
    if constexpr (MODE == DW) {
      const int row = w.row0 + k * BK;
#pragma unroll
      for (int p = 0; p < a_tile::PANELS; ++p) {
        tma::load_2d(st.a.panel(p), &g.a, full, w.mt * BM + p * 64, row);
      }
#pragma unroll
      for (int p = 0; p < b_tile::PANELS; ++p) {
        tma::load_2d(st.b.panel(p), &g.b, full, w.nt * BN + p * 64, row);
      }
    } else {
      tma::load_2d(st.a.data, &g.a, full, k * BK, w.row0);
      if constexpr (MODE == DX) {
        tma::load_3d(st.b.data, &g.b, full, k * BK, w.nt * BN, w.e);
      } else {
#pragma unroll
        for (int p = 0; p < b_tile::PANELS; ++p) {
          tma::load_3d(st.b.panel(p), &g.b, full, w.nt * BN + p * 64, k * BK, w.e);
        }
      }
    }
  }

  /** @brief DW, last k step of a group: zero the stage's rows past the group (see Pitfalls). */
  __device__ static void zero_tail_rows(stage_t& st, int c, int valid) {
    const int t = warpgroup::thread();
    const int chunks = (BK - valid) * 8;  // 16-byte chunks per panel past the valid rows
    const uint4 z = make_uint4(0, 0, 0, 0);
    char* a = reinterpret_cast<char*>(st.a.panel(c)) + valid * 128;
    for (int i = t; i < chunks; i += WARPGROUP_THREADS) reinterpret_cast<uint4*>(a)[i] = z;
#pragma unroll
    for (int p = c; p < b_tile::PANELS; p += CONSUMERS) {
      char* b = reinterpret_cast<char*>(st.b.panel(p)) + valid * 128;
      for (int i = t; i < chunks; i += WARPGROUP_THREADS) reinterpret_cast<uint4*>(b)[i] = z;
    }
    tma::fence_smem_to_async();
    warpgroup::sync(3, CONSUMERS * WARPGROUP_THREADS);
  }

  /** @brief The accumulators of rows [64 h, 64 h + 64) of a consumer's tile (ping-pong). */
  __device__ static float (&acc_rows(acc_t& acc, int h))[BN / 2] {
    return *reinterpret_cast<float(*)[BN / 2]>(acc + h * (BN / 2));
  }

  __device__ static void consumer(acc_t& acc, const stage_t& st, int c, int k) {
    wgmma::fence_regs(acc);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const int scale = (k > 0 || kk > 0) ? 1 : 0;
      if constexpr (MODE == DW) {
        const uint64_t da = wgmma::desc_mn_major(st.a.panel(c), kk * 16, a_tile::PANEL_BYTES);
        const uint64_t db = wgmma::desc_mn_major(st.b.data, kk * 16, b_tile::PANEL_BYTES);
        if constexpr (std::is_same_v<T, __nv_bfloat16>) {
          wgmma::ta::mma_m64n256k16_bf16<1, 1>(acc, da, db, scale);
        } else {
          wgmma::ta::mma_m64n256k16_f16<1, 1>(acc, da, db, scale);
        }
      } else if constexpr (PINGPONG) {
        // The consumer's whole tile: an m64 MMA per 64 rows, both on the same B.
        constexpr int TRANS_B = MODE == DX ? 0 : 1;
        const uint64_t db = MODE == DX
                                ? wgmma::desc_k_major(st.b.data, kk * 16)
                                : wgmma::desc_mn_major(st.b.data, kk * 16, b_tile::PANEL_BYTES);
#pragma unroll
        for (int h = 0; h < BM / 64; ++h) {
          const uint64_t da = wgmma::desc_k_major(st.a.data + h * 64 * BK, kk * 16);
          wgmma::mma<T, BN, TRANS_B>(acc_rows(acc, h), da, db, scale);
        }
      } else {
        const uint64_t da = wgmma::desc_k_major(st.a.data + c * 64 * BK, kk * 16);
        if constexpr (MODE == DX) {
          const uint64_t db = wgmma::desc_k_major(st.b.data, kk * 16);
          wgmma::mma<T, BN, 0>(acc, da, db, scale);
        } else {
          const uint64_t db = wgmma::desc_mn_major(st.b.data, kk * 16, b_tile::PANEL_BYTES);
          wgmma::mma<T, BN, 1>(acc, da, db, scale);
        }
      }
    }
    wgmma::commit();
    wgmma::fence_regs(acc);
  }

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

  /** @brief A consumer's 64 x BN accumulator -> T in its (swizzled) staging buffer. */
  __device__ static void stage_out(const acc_t& acc, out_t& out) {
    const int lane = threadIdx.x % 32;
    const int r = 16 * ((threadIdx.x % WARPGROUP_THREADS) / 32) + lane / 4;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int col = 8 * j + 2 * (lane % 4);
      store_pair(out.at(r, col), acc[4 * j], acc[4 * j + 1]);
      store_pair(out.at(r + 8, col), acc[4 * j + 2], acc[4 * j + 3]);
    }
  }

  /**
   * @brief Ping-pong: columns [64 q, 64 q + 64) of the consumer's 128 x BN accumulator -> T in
   * its one-panel staging buffer (all 128 rows).
   */
  __device__ static void stage_out_panel(const acc_t& acc, out_t& out, int q) {
    const int lane = threadIdx.x % 32;
    const int r = 16 * ((threadIdx.x % WARPGROUP_THREADS) / 32) + lane / 4;
#pragma unroll
    for (int h = 0; h < BM / 64; ++h) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int jj = q * 8 + j, col = 8 * j + 2 * (lane % 4);
        const float* a = acc + h * (BN / 2);
        store_pair(out.at(64 * h + r, col), a[4 * jj], a[4 * jj + 1]);
        store_pair(out.at(64 * h + r + 8, col), a[4 * jj + 2], a[4 * jj + 3]);
      }
    }
  }

  /**
   * @brief Ping-pong storer: the consumer's 128 x BN tile in BN / 64 rounds of one 64-column
   * panel; whole tiles by two TMA boxes of 64 rows a round, a tile past its group's end by
   * 16-byte stores of the group's rows.
   */
  __device__ static void store_tile(const globals& g, const acc_t& acc, out_t& out,
                                    const work& w, const lcsc::storer_sync& sync) {
    const int valid = min(BM, w.row_end - w.row0);
#pragma unroll
    for (int q = 0; q < BN / 64; ++q) {
      const int col0 = w.nt * BN + q * 64;
      if (col0 >= g.n) break;
      sync.acquire();
      stage_out_panel(acc, out, q);
      if (valid == BM) {
        if (sync.publish()) {
#pragma unroll
          for (int h = 0; h < BM / 64; ++h) {
            tma::store_2d(&g.out, out.data + h * 64 * 64, col0, w.row0 + 64 * h);
          }
          tma::store_commit();
        }
      } else {
        warpgroup::sync(sync.barrier_id);
        T* y = static_cast<T*>(g.y);
        for (int i = warpgroup::thread(); i < valid * 8; i += WARPGROUP_THREADS) {
          const int r = i / 8, col = (i % 8) * 8;
          if (col0 + col < g.n) {
            const uint4 v = *reinterpret_cast<const uint4*>(out.at(r, col));
            *reinterpret_cast<uint4*>(y + static_cast<size_t>(w.row0 + r) * g.n + col0 + col) =
                v;
          }
        }
      }
    }
  }

  __device__ static void storer(const globals& g, const acc_t& acc, out_t& out, int c,
                                const work& w, const lcsc::storer_sync& sync) {
    if constexpr (PINGPONG) {
      store_tile(g, acc, out, w, sync);
      return;
    }
    const int col0 = w.nt * BN;
    if constexpr (MODE == DW) {
      const int row0 = w.mt * BM + c * 64;
      if (row0 >= g.k) return;  // below this expert's K rows (uniform per warpgroup)
      sync.acquire();
      stage_out(acc, out);
      if (sync.publish()) {
#pragma unroll
        for (int p = 0; p < out_t::PANELS; ++p) {
          if (col0 + p * 64 < g.n) tma::store_3d(&g.out, out.panel(p), col0 + p * 64, row0, w.e);
        }
        tma::store_commit();
      }
    } else {
      const int row0 = w.row0 + c * 64;
      const int valid = min(64, w.row_end - row0);
      if (valid <= 0) return;  // this consumer's rows lie past the group (uniform)
      sync.acquire();
      stage_out(acc, out);
      if (valid == 64) {
        if (sync.publish()) {
#pragma unroll
          for (int p = 0; p < out_t::PANELS; ++p) {
            if (col0 + p * 64 < g.n) tma::store_2d(&g.out, out.panel(p), col0 + p * 64, row0);
          }
          tma::store_commit();
        }
      } else {
        // Boundary tile: only the group's rows, 16-byte chunks straight from staging.
        warpgroup::sync(sync.barrier_id);
        constexpr int CHUNKS = BN / 8;
        T* y = static_cast<T*>(g.y);
        for (int i = warpgroup::thread(); i < valid * CHUNKS; i += WARPGROUP_THREADS) {
          const int r = i / CHUNKS, col = (i % CHUNKS) * 8;
          if (col0 + col < g.n) {
            const uint4 v = *reinterpret_cast<const uint4*>(out.at(r, col));
            *reinterpret_cast<uint4*>(y + static_cast<size_t>(row0 + r) * g.n + col0 + col) = v;
          }
        }
      }
    }
  }

  /** @brief FWD/DX: zero rows [row_off[E], M) of y, grid-stride over the consumer threads. */
  __device__ static void zero_tail(const globals& g, const shared_storage& s) {
    if constexpr (MODE != DW) {
      grouped_walk::zero_rows<T, CONSUMERS * WARPGROUP_THREADS>(g, s.row_off[g.groups]);
    }
  }
};

/** @brief The persistent kernel: pk/grouped_walk.cuh persistent_block over kernel_def K. */
template <class K>
__global__ void __launch_bounds__(K::THREADS, 1) kernel(const __grid_constant__ globals g) {
  grouped_walk::persistent_block<K>(g);
}

template <class K>
constexpr size_t smem_bytes() {
  return sizeof(typename K::shared_storage) + 1024;
}

/**
 * @brief Launches configuration C: one block per SM, at most the upper bound of tiles
 * (`max_tiles`, computed by the caller from M, E and the tile shape), at least one block.
 */
template <class C>
inline cudaError_t launch(const globals& g, cudaStream_t stream, int device, int num_sms,
                          long long max_tiles) {
  using K = kernel_def<C>;
  constexpr size_t SMEM = smem_bytes<K>();
  // NOTES: the static shared wait_bound (pk/mbarrier.cuh) counts against the same 227 KiB.
  static_assert(SMEM + sizeof(wait_bound) <= 232448,
                "grouped_matmul: shared memory over the sm_90 limit");
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

/*
 * FEW: y = x_e @ w[e] for calls of at most FEW_MAX_ROWS rows (decode: a few tokens per expert),
 * on the CUDA cores. There the tiled kernel computes 128-row tiles for a row or two and streams
 * each w tile through one TMA pipeline per SM; the call is bound by reading every nonempty
 * group's w once, so this kernel is a streaming product: each w element is loaded once per pass
 * of up to FEW_ROWS rows, by plain 16-byte loads spread over many blocks, and used for every row
 * of the pass from registers.
 *
 *   block (chunk c, group e) | columns [128 c, 128 c + 128) of group e's rows; e = E: the rows
 *                            | past sum(sizes) (zeros)
 *   thread (lane, slice)     | lane = tid % 16: columns 8 lane .. + 8 of the chunk (one 16-byte
 *                            | load of a w row); slice = tid / 16: k blocks slice, slice + 16,
 *                            | .. of 8 consecutive k (8 w rows, one 16-byte load of x per row)
 *
 * Per pass of R rows (R = 1, 2 or 4: the pass's rows rounded up, the extra rows read as
 * zero; more rows take more passes, whose w reads then come from L2), each thread accumulates
 * R x 8 fp32 sums over its k blocks; the two slices of a warp are added by a shuffle, the
 * block's 8 warps through shared memory, and the sums are stored in T. Groups follow the
 * kernel's rule (sizes clamped to >= 0, ranges cut at M).
 *
 * Pitfalls: K and N are multiples of 8 (the handler checks), so a thread's 8 columns and 8 k
 * are whole or wholly outside. A pass reads its x rows as 16-byte vectors: x rows start at
 * multiples of 16 bytes because K % 8 == 0 and XLA aligns buffers.
 */
constexpr int FEW_MAX_ROWS = 64;  // M of a FEW call (the op table's kGroupedFewMaxRows)
constexpr int FEW_ROWS = 4;       // rows per pass: R x 8 fp32 sums per thread
constexpr int FEW_LANES = 16;     // threads along N: 128 columns, 256 contiguous bytes per w row
constexpr int FEW_BN = FEW_LANES * 8;
constexpr int FEW_THREADS = 256;
constexpr int FEW_SLICES = FEW_THREADS / FEW_LANES;
constexpr int FEW_WARPS = FEW_THREADS / 32;

/** @brief FEW mode's arguments: row-major x [M, K], w [E, K, N], y [M, N]. */
struct few_globals {
  const void* x;
  const void* w;
  void* y;
  const int* group_sizes;
  int m, n, k, groups;
};

/** @brief 8 elements of T (one 16-byte vector) as floats. */
template <typename T>
__device__ __forceinline__ void few_unpack(const uint4& v, float (&f)[8]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      f[2 * i] = __uint_as_float(u[i] << 16);
      f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    } else {
      const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&u[i]));
      f[2 * i] = h.x;
      f[2 * i + 1] = h.y;
    }
  }
}

/** @brief Element u (0..7) of 8 packed elements of T, as a float. */
template <typename T>
__device__ __forceinline__ float few_elem(const uint4& v, int u) {
  const uint32_t word = u < 2 ? v.x : u < 4 ? v.y : u < 6 ? v.z : v.w;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(u % 2 == 0 ? word << 16 : word & 0xffff0000u);
  } else {
    const unsigned short bits = static_cast<unsigned short>(u % 2 == 0 ? word : word >> 16);
    return __half2float(__ushort_as_half(bits));
  }
}

/** @brief A 16-byte load of data read once (w): not kept in L1. */
__device__ __forceinline__ uint4 few_load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

/**
 * @brief One pass: rows [r0, r0 + rows) (rows <= R) of group e times columns [col0, col0 + 8)
 * of w[e], summed over this thread's k blocks, then over the block, stored into y. `red` is the
 * block's shared memory for the sum over warps (FEW_WARPS x R x FEW_BN floats).
 */
template <typename T, int R>
__device__ void few_pass(const few_globals& g, int e, int r0, int rows, int chunk, float* red) {
  const int lane = threadIdx.x % FEW_LANES, slice = threadIdx.x / FEW_LANES;
  const int col0 = chunk * FEW_BN + lane * 8;
  const bool col_ok = col0 < g.n;
  const T* x = static_cast<const T*>(g.x);
  const char* w = static_cast<const char*>(g.w) +
                  (static_cast<size_t>(e) * g.k * g.n + col0) * sizeof(T);
  const size_t w_row = static_cast<size_t>(g.n) * sizeof(T);
  float acc[R][8];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[r][c] = 0.f;
  }
  const int kblocks = g.k / 8;
  for (int kb = slice; kb < kblocks; kb += FEW_SLICES) {
    uint4 wv[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      wv[u] = col_ok ? few_load_stream(w + (static_cast<size_t>(kb) * 8 + u) * w_row)
                     : make_uint4(0, 0, 0, 0);
    }
    uint4 xv[R];  // packed: unpacked one element at a time below (registers)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      xv[r] = r < rows ? __ldg(reinterpret_cast<const uint4*>(
                             x + static_cast<size_t>(r0 + r) * g.k + kb * 8))
                       : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      float wf[8];
      few_unpack<T>(wv[u], wf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float xu = few_elem<T>(xv[r], u);
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[r][c] = fmaf(xu, wf[c], acc[r][c]);
      }
    }
  }
  // Lanes l and l + 16 of a warp hold the same columns (slices 2 w and 2 w + 1).
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[r][c] += __shfl_xor_sync(0xffffffffu, acc[r][c], 16);
  }
  const int warp = threadIdx.x / 32;
  __syncthreads();  // red is free (the previous pass's sums are stored)
  if (threadIdx.x % 32 < FEW_LANES) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int c = 0; c < 8; ++c) red[(warp * R + r) * FEW_BN + lane * 8 + c] = acc[r][c];
    }
  }
  __syncthreads();
  T* y = static_cast<T*>(g.y);
  for (int i = threadIdx.x; i < R * FEW_BN; i += FEW_THREADS) {
    const int r = i / FEW_BN, col = i % FEW_BN;
    const int gc = chunk * FEW_BN + col;
    if (r >= rows || gc >= g.n) continue;
    float sum = 0.f;
#pragma unroll
    for (int wi = 0; wi < FEW_WARPS; ++wi) sum += red[(wi * R + r) * FEW_BN + col];
    y[static_cast<size_t>(r0 + r) * g.n + gc] = static_cast<T>(sum);
  }
}

/** @brief FEW mode: grid (column chunks, E + 1); see the comment above few_globals. */
template <typename T>
__global__ void __launch_bounds__(FEW_THREADS, 2) few_rows_kernel(const few_globals g) {
  __shared__ float red[FEW_WARPS * FEW_ROWS * FEW_BN];
  __shared__ unsigned long long before, total;
  const int e = blockIdx.y, chunk = blockIdx.x;
  if (threadIdx.x == 0) before = total = 0;
  __syncthreads();
  // The group's first row: the clamped sizes of groups 0 .. e-1 (e = E: all of them).
  unsigned long long mine = 0, all = 0;
  for (int i = threadIdx.x; i < g.groups; i += FEW_THREADS) {
    const int sz = max(g.group_sizes[i], 0);
    all += sz;
    if (i < e) mine += sz;
  }
  atomicAdd(&before, mine);
  atomicAdd(&total, all);
  __syncthreads();
  const long long lo = min(static_cast<long long>(before), static_cast<long long>(g.m));
  if (e == g.groups) {  // rows past sum(sizes): zeros
    T* y = static_cast<T*>(g.y);
    const int start = static_cast<int>(min(total, static_cast<unsigned long long>(g.m)));
    for (int i = threadIdx.x; i < (g.m - start) * FEW_BN; i += FEW_THREADS) {
      const int r = start + i / FEW_BN, gc = chunk * FEW_BN + i % FEW_BN;
      if (gc < g.n) y[static_cast<size_t>(r) * g.n + gc] = static_cast<T>(0.f);
    }
    return;
  }
  const int sz = max(g.group_sizes[e], 0);
  const int hi = static_cast<int>(min(lo + sz, static_cast<long long>(g.m)));
  for (int r0 = static_cast<int>(lo); r0 < hi; r0 += FEW_ROWS) {
    const int rows = min(FEW_ROWS, hi - r0);
    if (rows == 1) few_pass<T, 1>(g, e, r0, rows, chunk, red);
    else if (rows == 2) few_pass<T, 2>(g, e, r0, rows, chunk, red);
    else few_pass<T, 4>(g, e, r0, rows, chunk, red);
  }
}

/** @brief Launches FEW mode (the caller checked M <= FEW_MAX_ROWS, K and N multiples of 8). */
template <typename T>
inline cudaError_t launch_few(const few_globals& g, cudaStream_t stream) {
  const dim3 grid((g.n + FEW_BN - 1) / FEW_BN, g.groups + 1);
  few_rows_kernel<T><<<grid, FEW_THREADS, 0, stream>>>(g);
  return cudaGetLastError();
}

}  // namespace pk::grouped_matmul
