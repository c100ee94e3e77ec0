/*
 * attention: softmax(scale q k^T) v on one GPU (flash attention), forward and backward.
 *
 * Shapes: q, o, dq [B, S, H, D]; k, v, dk, dv [B, S, Hkv, D] (Hkv divides H: query head h uses
 * K/V head h / (H / Hkv)); lse float32 [B, H, S]; D 64 or 128; bf16 or fp16; any S. Causal:
 * query i sees keys 0..i. Every operand is read through a 4-D TMA map (tma_4d.cuh), so rows
 * past S arrive as zeros; the kernels mask those keys and never store those rows.
 *
 * Two kernels, one block of 2 consumer warpgroups each (the forward at D = 64: 3), 64 rows
 * each of the block's stationary tile, streaming the other operand through a ring of STAGES
 * buffers with full mbarriers. Thread 0 issues the first STAGES tiles before the loop; each
 * later one is issued by the leader of whichever warpgroup releases its stage last
 * (release_stage), so no warpgroup waits for another to free a stage (see NOTES at THREADS
 * for why there is no producer warpgroup; the forward with 176-key tiles frees K and V apart,
 * fwd_config::SPLIT_RELEASE):
 *
 *   kernel | block owns (stationary)  | streams (per step)      | consumer step
 *   -------+--------------------------+-------------------------+-------------------------------
 *   fwd    | 128 query rows: Q (192   | 128 keys: K, V (176 at  | S = Q K^T (smem x smem);
 *          | at D = 64)               | D = 128, not causal)    | online softmax in registers;
 *          |                          |                         | O += P V (P from registers)
 *   bwd    | 128 keys of head hk: K,V | 64 query rows of each   | S^T = K Q^T, dP^T = V dO^T;
 *          |                          | head of hk's group: Q,  | dV += P^T dO; dK += dS^T Q;
 *          |                          | dO, lse, delta          | dS^T to smem, dq_acc += dS K
 *
 * The forward overlaps each step's softmax with the previous step's P V: step j issues
 * S_j = Q K_j^T and O += P_{j-1} V_{j-1}, waits for S_j only, runs the softmax of S_j while the
 * tensor cores finish P V, then rescales O. The warpgroups also take turns issuing their
 * GEMMs (named barriers FWD_TURN + c: ping-pong), so one's softmax runs under the others'
 * GEMMs. At D = 64 the softmax's exponentials take as long as the GEMMs, so a third
 * warpgroup gives each softmax two GEMMs to hide under. It writes O and lse = scale * max +
 * log(sum) per row. The backward recomputes P = exp(scale q k^T - lse) from the saved lse;
 * delta = rowsum(dO * O) comes from the caller (padded with lse = +inf past S, so padded rows
 * give P = 0). It runs in one pass, five GEMMs per step: dK and dV sum over the group's query heads
 * in registers, and dQ's parts are summed into a float32 scratch dq_acc (zeroed by the launcher,
 * converted to dq by a second small kernel) by TMA reductions (cp.reduce.async.bulk.tensor add)
 * from shared memory, so dq is not bitwise reproducible (dk and dv are). ring_attn_bwd.cuh's
 * lanes run bwd_block's steps (dkdv_step, dq_part on bwd_config's storage) over K/V tiles that
 * change with the ring's steps.
 *
 * The forward's block is fwd_block<C, Src> and the backward's bwd_block<C, Src>: the source
 * says where the streamed tiles come from (local_keys, local_rows here; the fused ring and
 * Ulysses kernels' wait for other ranks' rows).
 *
 * Grid: fwd (H, ceil(S / BM), B), BM = fwd_block_rows(D); bwd (Hkv, ceil(S / 128), B).
 * Causal blocks run the longest rows first (fwd: block y counts down; bwd: key block y meets
 * the query rows from 128 y on) and skip the tiles wholly above the diagonal.
 *
 * Signals: none (no peers).
 *
 * Pitfalls: a register A operand (P, dS) is read asynchronously by wgmma until its group
 * completes, so the registers are fenced (frag::fence_regs) until after the wait. The full
 * barriers expect whole boxes, zero-filled past S. A row that sees only masked keys in a step
 * keeps max = -inf; exponents are then taken against 0, never -inf - (-inf).
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
#include "pk/wgmma_ta.cuh"

namespace pk::attention {

constexpr float LOG2E = 1.4426950408889634f;
constexpr int CONSUMERS = 2;
// NOTES: two warpgroups and no separate producer warpgroup. Registers are split per SM
// sub-partition: a third warpgroup (or a ninth warp) puts 3 warps on one sub-partition and
// ptxas (nvcc 13.0) then caps every thread at 168 registers, ignoring the setmaxnreg that
// would hand the producer's share to the consumers; the forward's O, S and P (D = 128) and
// the dK/dV kernel's two accumulators spilled there. With 256 threads they get up to 255.
// The forward at D = 64 fits the cap (158 registers): it runs 3 warpgroups (fwd_warpgroups).
constexpr int THREADS = CONSUMERS * WARPGROUP_THREADS;

/** @brief Sizes shared by the kernels. */
struct dims {
  int b, s, h, hkv;
  float scale;  // multiplies q . k
  int causal;
};

/** @brief Forward arguments: maps {D, heads, S, B} with boxes {64, 1, rows, 1}, rows
 * fwd_block_keys(D, causal) for k and v and fwd_block_rows(D) for q. */
struct fwd_globals {
  CUtensorMap q, k, v;
  void* o;     // [B, S, H, D]
  float* lse;  // [B, H, S]
  dims d;
};

/** @brief Backward arguments: q, d_o with boxes of 64 rows (q64, do64), k, v with boxes of 128
 * (k128, v128); dq32 maps dq_acc (float32 {D, H, S, B}) with boxes {32, 1, 64, 1}, 128B-swizzled,
 * for the dQ reductions. lse and delta are [B, H, SP] with SP = S rounded up to 128, lse = +inf
 * and delta = 0 past S. */
struct bwd_globals {
  CUtensorMap q64, do64, k128, v128, dq32;
  const float* lse;
  const float* delta;
  int sp;
  void* dq;  // [B, S, H, D]
  void* dk;  // [B, S, Hkv, D]
  float* dq_acc;  // [B, S, H, D] float32 scratch (zeroed by the launcher)
  void* dv;
  dims d;
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

// Named barriers of the forward's ping-pong: warpgroup c issues its GEMMs after passing
// FWD_TURN + c, and then lets the next warpgroup pass.
constexpr int FWD_TURN = 1;

/**
 * @brief The forward's ping-pong (ENABLED): the WGS warpgroups of a block take turns issuing
 * their GEMMs, in order 0, 1, .., WGS - 1, 0, .., so one's softmax runs under the others'
 * GEMMs instead of all at once. Each turn's named barrier joins two warpgroups: the last
 * warpgroup opens warpgroup 0's first turn (constructor), and every turn but the last
 * warpgroup's final one hands the next warpgroup its turn (fwd_block's end_turn). Disabled:
 * no-ops.
 */
template <int WGS, bool ENABLED>
struct turns {
  int c;
  __device__ explicit turns(int wg) : c(wg) {
    if (ENABLED && c == WGS - 1) warpgroup::arrive(FWD_TURN, 2 * WARPGROUP_THREADS);
  }
  __device__ void take() const {
    if constexpr (ENABLED) warpgroup::sync(FWD_TURN + c, 2 * WARPGROUP_THREADS);
  }
};

/**
 * @brief One forward consumer warpgroup's 64 query rows over a stream of BN-key tiles: its
 * registers (O, the scores S, P packed for the next P V, the row max m and sum l) and the steps
 * every forward kernel takes with them (fwd_block's, on fwd_config's storage). Each thread
 * holds rows row_lo and row_lo + 8 of the warpgroup.
 */
template <class C>
struct fwd_rows {
  using T = typename C::dtype;
  static constexpr int D = C::HEAD_DIM, BN = C::BN;
  float o[D / 2];
  float sc[BN / 2];
  uint32_t p[BN / 4];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2];

  __device__ fwd_rows() {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  }

  /** @brief Issues S = Q K^T for warpgroup c's rows and stage st's keys (committed). */
  __device__ void qk(const typename C::storage_t& s, int c, int st) {
    wgmma::fence();
    mma_rows_bt<T, BN, D>(sc, s.q, c, s.k[st]);
    wgmma::commit();
  }

  /** @brief Issues O += P V with stage st's values (committed). */
  __device__ void pv(const typename C::storage_t& s, int st) {
    wgmma::fence();
    const uint64_t db0 = wgmma::desc_mn_major(s.v[st].data, 0, C::kv_tile::PANEL_BYTES);
    frag::static_for<BN / 16>([&](auto kk) {
      const uint32_t at = wgmma::mn_major_k_bytes(16 * kk);
      frag::mma_rs<T, D, 1, kk>(o, p, wgmma::desc_advance(db0, at), 1);
    });
    wgmma::commit();
  }

  /** @brief Sets to -inf the scores of the tile's keys k0.. at or past `len` and, when
   * `by_pos`, of keys whose position pos(key) is past the row's limit lim[i] (row row_lo + 8 i):
   * causal masking in whatever numbering the caller's keys and rows have. */
  template <class Pos>
  __device__ void mask(int k0, int len, bool by_pos, const Pos& pos, const int (&lim)[2]) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int jj = 0; jj < BN / 8; ++jj) {
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const int key = k0 + 8 * jj + 2 * (lane % 4) + cc;
        const int kp = by_pos ? pos(key) : 0;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          if (key >= len || (by_pos && kp > lim[i])) sc[4 * jj + 2 * i + cc] = -INFINITY;
        }
      }
    }
  }

  /** @brief The online-softmax update of the (masked) scores: new max, alpha = the factor for
   * the old O and l, P = exp2(S scale log2e - max) in sc, l updated. A row that sees only
   * masked keys keeps max = -inf and takes exponents against 0. */
  __device__ void softmax(float sl2) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = m[i];
#pragma unroll
      for (int jj = 0; jj < BN / 8; ++jj) {
        mx = fmaxf(mx, fmaxf(sc[4 * jj + 2 * i], sc[4 * jj + 2 * i + 1]));
      }
      mx = frag::quad_max(mx);
      const float ref = mx == -INFINITY ? 0.f : mx * sl2;
      alpha[i] = frag::exp2_approx(m[i] * sl2 - ref);
      m[i] = mx;
      float sum = 0.f;
#pragma unroll
      for (int jj = 0; jj < BN / 8; ++jj) {
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          float& x = sc[4 * jj + 2 * i + cc];
          x = frag::exp2_approx(fmaf(x, sl2, -ref));
          sum += x;
        }
      }
      l[i] = l[i] * alpha[i] + sum;
    }
  }

  /** @brief O *= alpha, row by row. */
  __device__ void rescale() {
#pragma unroll
    for (int jj = 0; jj < D / 8; ++jj) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        o[4 * jj + 2 * i] *= alpha[i];
        o[4 * jj + 2 * i + 1] *= alpha[i];
      }
    }
  }

  /** @brief Writes O / l to rows row0.. of out ([.., s, heads, D] at batch b, head h) and
   * lse = scale max + log(l) (+inf for a row without keys) to lse_rows[row], rows past s
   * dropped. */
  __device__ void store(void* out, float* lse_rows, int b, int row0, int h, int heads, int s,
                        float scale) {
    const int t = threadIdx.x % WARPGROUP_THREADS;
    const int lane = t % 32;
    const int row_lo = row0 + 16 * (t / 32) + lane / 4;
    float inv[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l[i] = frag::quad_sum(l[i]);
      inv[i] = l[i] > 0.f ? 1.f / l[i] : 0.f;
      const int row = row_lo + 8 * i;
      if (lane % 4 == 0 && row < s) {
        lse_rows[row] = l[i] > 0.f ? m[i] * scale + logf(l[i]) : INFINITY;
      }
    }
    store_rows<T, D>(out, o, inv[0], inv[1], b, row0, h, heads, s);
  }
};

/** @brief The calling warpgroup is done with streamed tile r (its GEMMs reading r's stage have
 * completed). `released` counts the warpgroups' releases of each stage, forever (WGS per
 * round); the leader of the last warpgroup to release refills the stage with tile
 * r + STAGES (`issue`), so no warpgroup ever waits for another to free a stage. */
template <int WGS = CONSUMERS, int STAGES, class Issue>
__device__ inline void release_stage(int (&released)[STAGES], int r, int n_tiles,
                                     const Issue& issue) {
  if (warpgroup::thread() == 0) {
    __threadfence_block();
    const int before = atomicAdd(&released[r % STAGES], 1);
    if (before % WGS == WGS - 1 && r + STAGES < n_tiles) issue(r + STAGES);
  }
  __syncwarp();
}

// ---------------------------------------------------------------------------------------------
// Forward.

template <typename T, int D, int WGS = CONSUMERS, int KEYS = 128>
struct fwd_config {
  using dtype = T;
  static constexpr int HEAD_DIM = D;
  static constexpr int WARPGROUPS = WGS, THREADS = WGS * WARPGROUP_THREADS;
  static constexpr int BM = 64 * WGS, BN = KEYS;
  static constexpr int STAGES = D == 64 ? 5 : BN == 128 ? 3 : 2;
  // fwd_kernel frees a stage's K after the step's S = Q K^T and its V after P V, each refilled
  // on its own, where only 2 stages fit (wider key tiles): freeing both after P V, the next K
  // was issued one step before it was needed, 25% slower (H200, 2026-12-02). With 3 stages,
  // freeing them apart cost 5% at D = 64 (two releases per step), so those free both at once.
  static constexpr bool SPLIT_RELEASE = STAGES == 2;
  using q_tile = st_panels<T, BM, D>;
  using kv_tile = st_panels<T, BN, D>;
  struct storage_t {
    q_tile q;
    kv_tile k[STAGES];
    kv_tile v[STAGES];
    mbarrier q_full, k_full[STAGES], v_full[STAGES];
    mbarrier empty[STAGES];  // unused (fwd_block frees stages by release_stage); kept, so that
                             // fwd_kernel's machine code stays the one measured
    int released[STAGES];    // see release_stage
    int released_v[STAGES];  // fwd_kernel with SPLIT_RELEASE: V's (released: K's)
  };
  static constexpr size_t SMEM = sizeof(storage_t) + 1024;
};

/**
 * @brief Where fwd_block's Q tile and K/V stream come from, and where its rows go:
 * pk.attention's operands, all present from the start, key tile j at keys j BN (the tiles
 * wholly above the diagonal left out). ring_attn.cuh's source (ring_keys) and
 * ulysses_attn.cuh's (pushed_keys) also wait for the rows other ranks push. fwd_block
 * builds one per thread from the kernel's arguments; load_* are called by the issuing thread
 * (tiles in increasing order), softmax by every consumer thread for tiles 0, 1, .. in order,
 * store by every consumer thread.
 */
template <class C>
struct local_keys {
  int h, b, q0, hk, n;  // n: the stream's tiles
  __device__ explicit local_keys(const fwd_globals& g) {
    const dims& dm = g.d;
    h = blockIdx.x;
    b = blockIdx.z;
    const int qb = dm.causal ? static_cast<int>(gridDim.y - 1 - blockIdx.y) : blockIdx.y;
    q0 = qb * C::BM;
    hk = h / (dm.h / dm.hkv);
    const int kv_end = dm.causal ? min(dm.s, q0 + C::BM) : dm.s;
    n = ceil_div(kv_end, C::BN);
  }
  __device__ wait_bound bound(const fwd_globals& /*g*/) const { return wait_bound{}; }
  __device__ int n_tiles() const { return n; }
  __device__ int row0() const { return q0; }
  __device__ void load_q(const fwd_globals& g, typename C::q_tile& t, mbarrier* bar) const {
    load_rows(t, &g.q, bar, b, q0, h);
  }
  __device__ void load_k(const fwd_globals& g, typename C::kv_tile& t, mbarrier* bar,
                         int j) const {
    load_rows(t, &g.k, bar, b, j * C::BN, hk);
  }
  __device__ void load_v(const fwd_globals& g, typename C::kv_tile& t, mbarrier* bar,
                         int j) const {
    load_rows(t, &g.v, bar, b, j * C::BN, hk);
  }
  /** @brief Masks tile j's scores (keys past S; when causal, keys after the row) for the
   * warpgroup's 64 rows from wg_row0 (the thread's: `rows`), then the online-softmax update. */
  __device__ void softmax(const fwd_globals& g, fwd_rows<C>& r, int j, int wg_row0,
                          const int (&rows)[2], float sl2) const {
    const dims& dm = g.d;
    const int k0 = j * C::BN;
    const bool tail = k0 + C::BN > dm.s;
    const bool diag = dm.causal && k0 + C::BN - 1 > wg_row0;
    if (tail || diag) r.mask(k0, dm.s, dm.causal, [](int key) { return key; }, rows);
    r.softmax(sl2);
  }
  /** @brief O and lse of the warpgroup's 64 rows from wg_row0. */
  __device__ void store(const fwd_globals& g, fwd_rows<C>& r, int wg_row0) const {
    const dims& dm = g.d;
    r.store(g.o, g.lse + (int64_t(b) * dm.h + h) * dm.s, b, wg_row0, h, dm.h, dm.s, dm.scale);
  }
};

/**
 * @brief The forward's block: BM query rows (src.row0()..) against src's stream of key tiles,
 * O and lse out through src. Thread 0 issues the Q tile and the first STAGES tiles; each
 * later one is issued by the leader of whichever warpgroup releases its stage last
 * (release_stage; with SPLIT_RELEASE K and V apart). The warpgroups take turns issuing their
 * GEMMs (ping-pong), and each step's softmax overlaps the previous step's P V.
 */
template <class C, class Src, class G>
__device__ __forceinline__ void fwd_block(const G& g) {
  using T = typename C::dtype;
  constexpr int STAGES = C::STAGES, WGS = C::WARPGROUPS;
  auto& s = dynamic_smem<typename C::storage_t>();
  const Src src(g);
  const int q0 = src.row0();
  const int n_tiles = src.n_tiles();
  const bool issuer = threadIdx.x == 0;
  // Streamed tile j's K or V into stage j % STAGES (free); issue: both.
  auto issue_k = [&](int j) {
    const int st = j % STAGES;
    mbar_arrive_expect_tx(&s.k_full[st], C::kv_tile::BYTES);
    src.load_k(g, s.k[st], &s.k_full[st], j);
  };
  auto issue_v = [&](int j) {
    const int st = j % STAGES;
    mbar_arrive_expect_tx(&s.v_full[st], C::kv_tile::BYTES);
    src.load_v(g, s.v[st], &s.v_full[st], j);
  };
  auto issue = [&](int j) {
    issue_k(j);
    issue_v(j);
  };
  if (issuer) {
    block_wait_bound() = src.bound(g);
    mbar_init(&s.q_full, 1);
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&s.k_full[i], 1);
      mbar_init(&s.v_full[i], 1);
      s.released[i] = 0;
      if constexpr (C::SPLIT_RELEASE) s.released_v[i] = 0;
    }
    fence_mbar_init();
    mbar_arrive_expect_tx(&s.q_full, C::q_tile::BYTES);
    src.load_q(g, s.q, &s.q_full);
    for (int j = 0; j < min(STAGES, n_tiles); ++j) issue(j);
  }
  __syncthreads();

  const int c = warpgroup::index();
  const int t = warpgroup::thread();
  const int lane = t % 32;
  // K of tile r is done (SPLIT_RELEASE), V (or with 3 stages both) of tile r is done.
  auto release_k = [&](int r) {
    if constexpr (C::SPLIT_RELEASE) release_stage<WGS>(s.released, r, n_tiles, issue_k);
  };
  auto release_v = [&](int r) {
    if constexpr (C::SPLIT_RELEASE) release_stage<WGS>(s.released_v, r, n_tiles, issue_v);
    else release_stage<WGS>(s.released, r, n_tiles, issue);
  };
  // Ping-pong, written out here: through a shared fold (fwd_rows::fold, since removed), nvcc
  // 13.0 compiled the D = 64 kernel to one more register and a 2-3% slower forward (H200,
  // 2026-12-02), and marking the final turn at its call site changes the code too. This is the
  // code that was measured: the last warpgroup's last turn (n_tiles + 1 each) hands none over.
  const turns<WGS, true> turn(c);
  int turns_left = n_tiles + 1;
  auto end_turn = [&]() {
    if (--turns_left > 0 || c != WGS - 1) {
      warpgroup::arrive(FWD_TURN + (c + 1) % WGS, 2 * WARPGROUP_THREADS);
    }
  };
  const int row_lo = q0 + c * 64 + 16 * (t / 32) + lane / 4;
  const int rows[2] = {row_lo, row_lo + 8};
  const float sl2 = g.d.scale * LOG2E;
  fwd_rows<C> r;
  auto softmax = [&](int j) { src.softmax(g, r, j, q0 + c * 64, rows, sl2); };

  mbar_wait(&s.q_full, 0);
  mbar_wait(&s.k_full[0], 0);
  turn.take();
  r.qk(s, c, 0);
  end_turn();
  wgmma::wait<0>();
  wgmma::fence_regs(r.sc);
  release_k(0);
  softmax(0);
  frag::to_a<T>(r.p, r.sc);
  for (int j = 1; j < n_tiles; ++j) {
    const int st = j % STAGES, prev = (j - 1) % STAGES;
    mbar_wait(&s.k_full[st], (j / STAGES) & 1);
    mbar_wait(&s.v_full[prev], ((j - 1) / STAGES) & 1);
    turn.take();
    r.qk(s, c, st);
    wgmma::fence_regs(r.o);
    r.pv(s, prev);
    end_turn();
    wgmma::wait<1>();
    wgmma::fence_regs(r.sc);
    release_k(j);
    softmax(j);
    wgmma::wait<0>();
    wgmma::fence_regs(r.o);
    frag::fence_regs(r.p);
    release_v(j - 1);
    r.rescale();
    frag::to_a<T>(r.p, r.sc);
  }
  const int last = (n_tiles - 1) % STAGES;
  mbar_wait(&s.v_full[last], ((n_tiles - 1) / STAGES) & 1);
  turn.take();
  wgmma::fence_regs(r.o);
  r.pv(s, last);
  end_turn();
  wgmma::wait<0>();
  wgmma::fence_regs(r.o);
  frag::fence_regs(r.p);
  release_v(n_tiles - 1);
  src.store(g, r, q0 + c * 64);
}

template <class C>
__global__ void __launch_bounds__(C::THREADS, 1)
    fwd_kernel(const __grid_constant__ fwd_globals g) {
  fwd_block<C, local_keys<C>>(g);
}

// ---------------------------------------------------------------------------------------------
// Backward: dK and dV.

/** @brief The backward's tile shapes: 128 keys of K/V stationary, 64 query rows per stage (q,
 * dO, and their lse and delta). */
template <typename T, int D>
struct dkdv_config {
  using dtype = T;
  static constexpr int HEAD_DIM = D;
  static constexpr int BN = 128, BQ = 64;
  using kv_tile = st_panels<T, BN, D>;
  using q_tile = st_panels<T, BQ, D>;
  static constexpr uint32_t STAGE_BYTES = 2 * q_tile::BYTES + 2 * BQ * sizeof(float);
};

/**
 * @brief One dK/dV consumer warpgroup's step over a stage of 64 query rows (bwd_block's, on
 * bwd_config's storage): S^T, dP^T, P^T and dS^T for its 64 keys (keys key_lo and key_lo + 8
 * per thread); dK and dV stay the caller's.
 */
template <class C>
struct dkdv_step {
  using T = typename C::dtype;
  static constexpr int D = C::HEAD_DIM, BQ = C::BQ;
  using stage_t = typename C::stage_t;
  float sc[BQ / 2], dp[BQ / 2];
  uint32_t pa[BQ / 4], dsa[BQ / 4];

  /** @brief S^T = K Q^T and dP^T = V dO^T for warpgroup c's keys (waited for). */
  __device__ void scores(const typename C::storage_t& s, const stage_t& stage, int c) {
    issue_scores(s, stage, c);
    wait_scores();
  }

  /** @brief Issues `scores`' GEMMs as one committed group; sc and dp are the tensor cores' until
   * `wait_scores`. */
  __device__ void issue_scores(const typename C::storage_t& s, const stage_t& stage, int c) {
    wgmma::fence();
    mma_rows_bt<T, BQ, D>(sc, s.k, c, stage.q);
    mma_rows_bt<T, BQ, D>(dp, s.v, c, stage.d_o);
    wgmma::commit();
  }

  /** @brief Waits for every GEMM the warpgroup has issued (`issue_scores`' the last). */
  __device__ void wait_scores() {
    wgmma::wait<0>();
    wgmma::fence_regs(sc);
    wgmma::fence_regs(dp);
  }

  /** @brief P^T = exp2(S^T scale log2e - lse2) into sc and dS^T = P^T (dP^T - delta) into dp,
   * from the stage's 64 lse and delta values at `lse` and `delta` (+inf / 0 past S; bwd_config
   * keeps them apart from its stages); on a `masked` stage P = 0 where the query's position
   * qpos(col) is before the key's limit lim[i] (key key_lo + 8 i). */
  template <class QPos>
  __device__ void grad_scores(const float* lse, const float* delta, float sl2, bool masked,
                              const QPos& qpos, const int (&lim)[2]) {
    // Two code paths: one shared path with the mask as a runtime flag costs an unmasked step
    // about 100 instructions of comparisons and selects (ncu, D = 64).
    if (masked) grad_scores_as<true>(lse, delta, sl2, qpos, lim);
    else grad_scores_as<false>(lse, delta, sl2, qpos, lim);
  }

  template <bool MASKED, class QPos>
  __device__ void grad_scores_as(const float* lse, const float* delta, float sl2,
                                 const QPos& qpos, const int (&lim)[2]) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int jj = 0; jj < BQ / 8; ++jj) {
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const int col = 8 * jj + 2 * (lane % 4) + cc;
        const float l2 = lse[col] * LOG2E;  // +inf past S: p = 0
        const float dl = delta[col];
        const int qp = MASKED ? qpos(col) : 0;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int el = 4 * jj + 2 * i + cc;
          float pr = frag::exp2_approx(fmaf(sc[el], sl2, -l2));
          if (MASKED && qp < lim[i]) pr = 0.f;
          sc[el] = pr;
          dp[el] = pr * (dp[el] - dl);
        }
      }
    }
  }

  /** @brief dV += P^T dO and dK += dS^T Q with the stage's rows (waited for). */
  __device__ void accumulate(const stage_t& stage, float (&dk)[D / 2], float (&dv)[D / 2]) {
    issue(stage, dk, dv);
    wgmma::wait<0>();
    finish(dk, dv);
  }

  /** @brief Issues dV += P^T dO and dK += dS^T Q (one committed group; pa and dsa hold P^T and
   * dS^T rounded to T until `finish`, after the caller's wait). */
  __device__ void issue(const stage_t& stage, float (&dk)[D / 2], float (&dv)[D / 2]) {
    frag::to_a<T>(pa, sc);
    frag::to_a<T>(dsa, dp);
    wgmma::fence_regs(dv);
    wgmma::fence_regs(dk);
    wgmma::fence();
    const uint64_t d_o = wgmma::desc_mn_major(stage.d_o.data, 0, C::q_tile::PANEL_BYTES);
    const uint64_t q = wgmma::desc_mn_major(stage.q.data, 0, C::q_tile::PANEL_BYTES);
    frag::static_for<BQ / 16>([&](auto kk) {
      const uint32_t at = wgmma::mn_major_k_bytes(16 * kk);
      frag::mma_rs<T, D, 1, kk>(dv, pa, wgmma::desc_advance(d_o, at), 1);
    });
    frag::static_for<BQ / 16>([&](auto kk) {
      const uint32_t at = wgmma::mn_major_k_bytes(16 * kk);
      frag::mma_rs<T, D, 1, kk>(dk, dsa, wgmma::desc_advance(q, at), 1);
    });
    wgmma::commit();
  }

  /** @brief After the wait for `issue`'s group: dK, dV, pa and dsa are the threads' again. */
  __device__ void finish(float (&dk)[D / 2], float (&dv)[D / 2]) {
    wgmma::fence_regs(dv);
    wgmma::fence_regs(dk);
    frag::fence_regs(pa);
    frag::fence_regs(dsa);
  }
};

// ---------------------------------------------------------------------------------------------
// Backward in one pass: dK, dV and dQ.

/** @brief The one-pass backward's storage on dkdv_config's shapes (STAGES fit two dS^T tiles). */
template <typename T, int D>
struct bwd_config : dkdv_config<T, D> {
  using base = dkdv_config<T, D>;
  static constexpr int THREADS = attention::THREADS;  // bwd_kernel's launch bounds
  static constexpr int STAGES = D == 128 ? 3 : 6;
  using ds_tile = st_panels<T, base::BN, base::BQ>;  // dS^T: 128 keys (k rows) x 64 queries
  // A warpgroup's dQ part of a step, 64 queries x D/2 columns of float32, staged for the TMA
  // reduction into dq_acc: D/64 boxes of 64 rows x 32 columns, each row 128 bytes, swizzled.
  static constexpr int DQ_BOXES = D / 64;
  struct alignas(1024) dq_box {
    float v[base::BQ * 32];
  };
  // A stage's q and dO tiles; its lse and delta sit in storage_t's tail, where they do not
  // round each stage up to the tiles' 1 KiB alignment (D = 128 fits in 227 KiB only so).
  struct stage_t {
    typename base::q_tile q, d_o;
  };
  struct storage_t {
    typename base::kv_tile k, v;
    dq_box dqs[CONSUMERS][DQ_BOXES];  // warpgroup c's staged dQ part (dq_part::reduce)
    stage_t st[STAGES];
    ds_tile ds[2];  // step j writes ds[j % 2]; see bwd_kernel
    float lse[STAGES][base::BQ], delta[STAGES][base::BQ];  // stage st's
    mbarrier kv_full, full[STAGES];
    int released[STAGES];  // see release_stage
  };
  // The bytes used, not sizeof (which rounds the tail up to 1 KiB), and 1 KiB for aligning the
  // base (dynamic_smem).
  static constexpr size_t SMEM = offsetof(storage_t, released) + sizeof(int) * STAGES + 1024;
};

// Named barriers of the one-pass backward: both warpgroups' dS^T rows of a step are in shared
// memory (BWD_DS); warpgroup c's dQ part is staged (BWD_DQ + c).
constexpr int BWD_DS = 1, BWD_DQ = 2;

/** @brief m64nNk16 (N = 32, 64) with A and B MN-major from shared memory: dQ += dS K, dS
 * stored transposed. */
template <typename T, int N>
__device__ inline void mma_dq(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
  constexpr bool BF16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 64) {
    if constexpr (BF16) wgmma::ta::mma_m64n64k16_bf16<1, 1>(d, da, db, scale_d);
    else wgmma::ta::mma_m64n64k16_f16<1, 1>(d, da, db, scale_d);
  } else {
    static_assert(N == 32, "mma_dq: N must be 32 or 64");
    if constexpr (BF16) wgmma::ta::mma_m64n32k16_bf16<1, 1>(d, da, db, scale_d);
    else wgmma::ta::mma_m64n32k16_f16<1, 1>(d, da, db, scale_d);
  }
}

/** @brief Warpgroup c's part of a backward step's dQ: it shares its dS^T rows with the other
 * warpgroup through the step's ds tile, computes columns [c D/2, (c + 1) D/2) of dQ_step = dS K
 * over all 128 keys, and adds them to dq_acc. */
template <class C>
struct dq_part {
  using T = typename C::dtype;
  static constexpr int D = C::HEAD_DIM, BN = C::BN, BQ = C::BQ, DQN = D / 2;
  float dq[DQN / 2];

  /** @brief Stores dS^T rows `row` and row + 8 (packed register 2 jj + i holds queries
   * 8 jj + 2 (lane % 4) and the next one of row + 8 i, fragment.cuh) and waits until the other
   * warpgroup has stored its rows (named barrier BWD_DS). Before that barrier each warpgroup's
   * leader waits until its last dQ reduction (`reduce`, a step ago) has read its staging, so
   * both warpgroups may restage after it. */
  __device__ static void share(typename C::ds_tile& ds, const uint32_t (&dsa)[BQ / 4], int row,
                               int lane) {
#pragma unroll
    for (int jj = 0; jj < BQ / 8; ++jj) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        *reinterpret_cast<uint32_t*>(ds.at(row + 8 * i, 8 * jj + 2 * (lane % 4))) =
            dsa[2 * jj + i];
      }
    }
    tma::fence_smem_to_async();
    if (threadIdx.x % WARPGROUP_THREADS == 0) tma::store_wait_read<0>();
    warpgroup::sync(BWD_DS, THREADS);
  }

  /** @brief Issues dq = dS K for columns nbeg.. (one committed group). */
  __device__ void issue(const typename C::ds_tile& ds, const typename C::kv_tile& k, int nbeg) {
    wgmma::fence();
    // D = 64: columns 32.. start 64 bytes into the swizzled panel rows, like a k offset of a
    // K-major operand (the hardware swizzles the final address).
    const uint64_t da = wgmma::desc_mn_major(ds.data, 0, C::ds_tile::PANEL_BYTES);
    const uint64_t db = wgmma::desc_mn_major(k.panel(nbeg / 64) + nbeg % 64, 0,
                                             C::kv_tile::PANEL_BYTES);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint32_t at = wgmma::mn_major_k_bytes(16 * kk);
      mma_dq<T, DQN>(dq, wgmma::desc_advance(da, at), wgmma::desc_advance(db, at),
                     kk > 0 ? 1 : 0);
    }
    wgmma::commit();
  }

  /** @brief A backward step after its S^T and dP^T: the softmax gradient (`mask`: the causal
   * diagonal, queries from q0), dV += P^T dO and dK += dS^T Q, dS^T shared, dq = dS K; returns
   * once all of them have completed. */
  __device__ void after_scores(dkdv_step<C>& step, const typename C::stage_t& stage,
                               const float* lse, const float* delta,
                               typename C::ds_tile& ds, const typename C::kv_tile& k,
                               float (&dk)[D / 2], float (&dv)[D / 2], bool mask, float sl2,
                               int q0, const int (&keys)[2], int row, int lane, int nbeg) {
    step.grad_scores(lse, delta, sl2, mask, [&](int col) { return q0 + col; }, keys);
    step.issue(stage, dk, dv);
    share(ds, step.dsa, row, lane);
    issue(ds, k, nbeg);
    wgmma::wait<0>();
    wgmma::fence_regs(dq);
    step.finish(dk, dv);
  }

  /** @brief dq_acc rows q0.. of head h, columns nbeg.. (rows past S dropped) += dq: warpgroup
   * c's thread t stages its part in `box` (row r = 16 (t / 32) + lane / 4 (+ 8), columns
   * 8 jj + 2 (lane % 4) (+ 1): 16-byte chunk j of a 128-byte row sits at chunk j ^ (r % 8), the
   * 128B swizzle, so a warp's 8-byte stores hit every bank), then, once the warpgroup has
   * (named barrier BWD_DQ + c), its leader adds the boxes into dq_acc by TMA (one bulk group).
   * The float32 adds run in the L2 while the warpgroup goes on; `share` waits for their reads. */
  template <class G>  // bwd_globals, ring_attn_bwd::globals: their dq32
  __device__ void reduce(const G& g, typename C::dq_box (&box)[C::DQ_BOXES], int b,
                         int h, int q0, int nbeg, int t, int c) const {
    const int lane = t % 32;
    const int r0 = 16 * (t / 32) + lane / 4;
#pragma unroll
    for (int jj = 0; jj < DQN / 8; ++jj) {
      const int chunk = 2 * (jj % 4) + (lane % 4) / 2;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = r0 + 8 * i;
        float* at = box[jj / 4].v + r * 32 + (chunk ^ (r % 8)) * 4 + (lane % 2) * 2;
        *reinterpret_cast<float2*>(at) = make_float2(dq[4 * jj + 2 * i], dq[4 * jj + 2 * i + 1]);
      }
    }
    tma::fence_smem_to_async();
    warpgroup::sync(BWD_DQ + c);
    if (t == 0) {
#pragma unroll
      for (int x = 0; x < C::DQ_BOXES; ++x) {
        tma::store_add_4d(&g.dq32, box[x].v, nbeg + 32 * x, h, q0, b);
      }
      tma::store_commit();
    }
  }
};

/** @brief Where bwd_block's q/dO stages come from: pk.attention's operands, all present from
 * the start, each head's query tiles in order (`tile`: the stream's tile qi of a head, from
 * qb0, to its query tile). ulysses_attn_bwd.cuh's source also waits for the rows other ranks
 * push, and starts each head at the rows that arrive first. */
struct local_rows {
  __device__ wait_bound bound() const { return wait_bound{}; }
  __device__ void before_load(int /*q0*/) const {}
  __device__ int tile(int qb0, int qi, int /*nq*/) const { return qb0 + qi; }
};

/**
 * The backward in one pass, five GEMMs per step (a dQ pass and a dK/dV pass took seven): each
 * block holds 128 keys of K/V head hk and streams 64-query stages of every query head of hk's
 * group (dkdv_step: dK and dV in registers); after dS^T is computed, each warpgroup stores its
 * 64 key rows of it (rounded to T) into the step's ds tile; once both have (named barrier
 * BWD_DS), warpgroup c computes columns [c D/2, (c + 1) D/2) of dQ_step = dS K for the stage's
 * 64 queries over all 128 keys, stages them in shared memory and its leader adds them to
 * dq_acc with TMA reductions (dq_part::reduce). With per-thread vector reductions
 * (red.global.add.v2.f32) in their place, 16 per thread and step at D = 128, the backward's
 * forward + backward geomean was 0.816x of cuDNN at three shapes against 0.910x with these
 * (H200, 2026-12-02, attention_notes.md). At D = 64 the next step's S^T and dP^T are issued
 * before those reductions. ds is double-buffered: a warpgroup writes ds[j % 2] in step j only
 * after passing step j - 1's barrier, which the other passed after its step j - 2 wait, the
 * last read of that buffer. The staging is single-buffered: `share` waits for its last read.
 * The block's dQ partials of a query row are summed in fp32 by the L2 in any order, so dq is
 * not bitwise reproducible (dk and dv are). This is key block kb (128 keys) of K/V head hk,
 * batch b, its q/dO stages from `src`.
 */
template <class C, class Src>
__device__ __forceinline__ void bwd_block(const bwd_globals& g, int hk, int kb, int b,
                                          const Src& src) {
  using T = typename C::dtype;
  constexpr int D = C::HEAD_DIM, BN = C::BN, BQ = C::BQ, STAGES = C::STAGES;
  constexpr int DQN = D / 2;  // the warpgroup's dQ columns
  auto& s = dynamic_smem<typename C::storage_t>();
  const dims& dm = g.d;
  // causal: key block kb meets query rows from 128 kb on, so the blocks with the most work
  // come first
  const int k0 = kb * BN;
  const int group = dm.h / dm.hkv;
  const int nq = ceil_div(dm.s, BQ);
  const int qb0 = dm.causal ? k0 / BQ : 0;
  const int per_head = nq - qb0;
  const int n_tiles = group * per_head;
  const bool issuer = threadIdx.x == 0;
  auto issue = [&](int j) {
    const int st = j % STAGES;
    const int h = hk * group + j / per_head;
    const int q0 = src.tile(qb0, j % per_head, nq) * BQ;
    src.before_load(q0);
    auto& stage = s.st[st];
    mbar_arrive_expect_tx(&s.full[st], C::STAGE_BYTES);
    load_rows(stage.q, &g.q64, &s.full[st], b, q0, h);
    load_rows(stage.d_o, &g.do64, &s.full[st], b, q0, h);
    const int64_t at = (int64_t(b) * dm.h + h) * g.sp + q0;  // q0 + 64 <= SP: padded
    tma::load_1d(s.lse[st], g.lse + at, BQ * sizeof(float), &s.full[st]);
    tma::load_1d(s.delta[st], g.delta + at, BQ * sizeof(float), &s.full[st]);
  };
  if (issuer) {
    block_wait_bound() = src.bound();
    mbar_init(&s.kv_full, 1);
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&s.full[i], 1);
      s.released[i] = 0;
    }
    fence_mbar_init();
    mbar_arrive_expect_tx(&s.kv_full, 2 * C::kv_tile::BYTES);
    load_rows(s.k, &g.k128, &s.kv_full, b, k0, hk);
    load_rows(s.v, &g.v128, &s.kv_full, b, k0, hk);
    for (int j = 0; j < min(STAGES, n_tiles); ++j) issue(j);
  }
  __syncthreads();

  const int c = warpgroup::index();
  const int t = warpgroup::thread();
  const int lane = t % 32;
  auto release = [&](int r) { release_stage(s.released, r, n_tiles, issue); };
  const int key_lo = k0 + c * 64 + 16 * (t / 32) + lane / 4;  // keys key_lo, key_lo + 8
  const float sl2 = dm.scale * LOG2E;
  const int nbeg = DQN * c;  // the warpgroup's first dQ column

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
  const int keys[2] = {key_lo, key_lo + 8};
  dkdv_step<C> step;

  mbar_wait(&s.kv_full, 0);
  // Tile j is query block qb0 + qi of head h (qi = j % per_head) in stage st = j % STAGES,
  // phase ph: counters, not divisions, in the loop. Each loop below advances them itself: the
  // same steps in a shared lambda or struct change both loops' machine code, and these are the
  // forms measured (attention_notes.md, "the D = 64 backward pipelined").
  int h = hk * group, qi = 0, st = 0;
  uint32_t ph = 0;
  if constexpr (D == 128) {
    for (int j = 0; j < n_tiles; ++j) {
      const int q0 = src.tile(qb0, qi, nq) * BQ;
      auto& stage = s.st[st];
      auto& ds = s.ds[j & 1];
      mbar_wait(&s.full[st], ph);
      step.scores(s, stage, c);
      dq_part<C> part;
      part.after_scores(step, stage, s.lse[st], s.delta[st], ds, s.k, dk, dv,
                        dm.causal && q0 < k0 + c * 64 + 63, sl2, q0, keys, key_lo - k0, lane,
                        nbeg);
      release(j);
      part.reduce(g, s.dqs[c], b, h, q0, nbeg, t, c);
      if (++qi == per_head) {
        qi = 0;
        ++h;
      }
      if (++st == STAGES) {
        st = 0;
        ph ^= 1;
      }
    }
  } else {
    // D = 64: step j's S^T and dP^T are issued at the end of step j - 1, before that step's
    // dQ reductions, so the tensor cores run them while the reductions issue (forward +
    // backward 1.7-4.4% faster; at D = 128, 250 registers and 1-2% slower: H200, 2026-12-02).
    // The last step is peeled off (`last`): with the issue under a condition inside the loop,
    // ptxas waits for the GEMMs early (warning C7517), which undoes the overlap. The step
    // spells out dq_part::after_scores: called through it, this loop compiles to other code
    // than the one measured.
    mbar_wait(&s.full[0], 0);
    step.issue_scores(s, s.st[0], c);
    auto tile = [&](int j, auto last) {
      const int q0 = src.tile(qb0, qi, nq) * BQ, hq = h;
      auto& stage = s.st[st];
      auto& ds = s.ds[j & 1];
      step.wait_scores();
      const bool mask = dm.causal && q0 < k0 + c * 64 + 63;
      step.grad_scores(s.lse[st], s.delta[st], sl2, mask, [&](int col) { return q0 + col; },
                       keys);
      step.issue(stage, dk, dv);
      dq_part<C> part;
      part.share(ds, step.dsa, key_lo - k0, lane);
      part.issue(ds, s.k, nbeg);
      wgmma::wait<0>();
      wgmma::fence_regs(part.dq);
      step.finish(dk, dv);
      release(j);
      if constexpr (!decltype(last)::value) {
        if (++qi == per_head) {
          qi = 0;
          ++h;
        }
        if (++st == STAGES) {
          st = 0;
          ph ^= 1;
        }
        mbar_wait(&s.full[st], ph);
        step.issue_scores(s, s.st[st], c);
      }
      part.reduce(g, s.dqs[c], b, hq, q0, nbeg, t, c);
    };
    for (int j = 0; j + 1 < n_tiles; ++j) tile(j, std::false_type{});
    tile(n_tiles - 1, std::true_type{});
  }
  if (t == 0) tma::store_wait<0>();  // the staging stays valid until the last reduction is done
  store_rows<T, D>(g.dk, dk, dm.scale, dm.scale, b, k0 + c * 64, hk, dm.hkv, dm.s);
  store_rows<T, D>(g.dv, dv, 1.f, 1.f, b, k0 + c * 64, hk, dm.hkv, dm.s);
}

/** @brief The one-pass backward (bwd_block), grid (Hkv, key blocks, B). */
template <class C>
__global__ void __launch_bounds__(THREADS, 1) bwd_kernel(const __grid_constant__ bwd_globals g) {
  bwd_block<C>(g, blockIdx.x, blockIdx.y, blockIdx.z, local_rows{});
}

/** @brief dq = T(scale dq_acc), n elements (a multiple of 4). */
template <typename T>
__global__ void dq_convert_kernel(const float4* __restrict__ acc, uint2* __restrict__ dq,
                                  int64_t n4, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float4 a = acc[i];
    dq[i] = make_uint2(frag::pack<T>(a.x * scale, a.y * scale), frag::pack<T>(a.z * scale, a.w * scale));
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers.

/** @brief dq = T(scale dq_acc) over n elements (a multiple of 4): the backwards' last kernel. */
template <typename T>
inline cudaError_t launch_dq_convert(const float* dq_acc, void* dq, int64_t n, float scale,
                                     cudaStream_t stream) {
  const int64_t n4 = n / 4;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(n4, int64_t(256)), 132 * 8));
  dq_convert_kernel<T><<<blocks, 256, 0, stream>>>(reinterpret_cast<const float4*>(dq_acc),
                                                   reinterpret_cast<uint2*>(dq), n4, scale);
  return cudaGetLastError();
}

template <class C, class G>
inline cudaError_t launch_kernel(void (*kernel)(G), const G& g, dim3 grid, cudaStream_t stream,
                                 int device) {
  static_assert(C::SMEM + sizeof(wait_bound) <= 232448,
                "attention: shared memory over the sm_90 limit of 227 KiB");
  if (cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(kernel), device,
                                     static_cast<int>(C::SMEM));
      err != cudaSuccess) {
    return err;
  }
  kernel<<<grid, C::THREADS, C::SMEM, stream>>>(g);
  return cudaGetLastError();
}

/** @brief The forward's consumer warpgroups at head dim D: three at D = 64, where a softmax
 * takes as long as a GEMM (file comment), two at 128 (registers: NOTES at THREADS); and its
 * query rows per block, 64 per warpgroup, which are also the rows of the q map's box. */
constexpr int fwd_warpgroups(int d) { return d == 64 ? 3 : 2; }
constexpr int fwd_block_rows(int d) { return 64 * fwd_warpgroups(d); }
/** @brief The forward's keys per streamed tile, also the rows of the k and v maps' boxes: 176
 * at D = 128 without a causal mask (FlashAttention-3's tile; 2 stages, SPLIT_RELEASE, 235
 * registers), where a step's fixed costs (waits, turns, the O rescale) spread over more keys:
 * 2.5-6% faster than 128 keys on the H200 (2026-12-02). Causal calls keep 128, whose blocks
 * end on the diagonal. */
constexpr int fwd_block_keys(int d, bool causal) { return d == 128 && !causal ? 176 : 128; }

template <typename T, int D, int KEYS>
inline cudaError_t launch_fwd_as(const fwd_globals& g, cudaStream_t stream, int device) {
  using C = fwd_config<T, D, fwd_warpgroups(D), KEYS>;
  const dim3 grid(g.d.h, ceil_div(g.d.s, C::BM), g.d.b);
  return launch_kernel<C>(&fwd_kernel<C>, g, grid, stream, device);
}

/** @brief The forward for head dim D: O and lse. */
template <typename T, int D>
inline cudaError_t launch_fwd(const fwd_globals& g, cudaStream_t stream, int device) {
  if (g.d.causal) return launch_fwd_as<T, D, fwd_block_keys(D, true)>(g, stream, device);
  return launch_fwd_as<T, D, fwd_block_keys(D, false)>(g, stream, device);
}

/** @brief The backward for head dim D: zero dq_acc, bwd_kernel (dK, dV, and dQ summed into
 * dq_acc), then dq = T(scale dq_acc). */
template <typename T, int D>
inline cudaError_t launch_bwd(const bwd_globals& g, cudaStream_t stream, int device) {
  using C = bwd_config<T, D>;
  const int64_t n = int64_t(g.d.b) * g.d.s * g.d.h * D;
  if (cudaError_t err = cudaMemsetAsync(g.dq_acc, 0, n * sizeof(float), stream);
      err != cudaSuccess) {
    return err;
  }
  if (cudaError_t err = launch_kernel<C>(&bwd_kernel<C>, g,
                                         dim3(g.d.hkv, ceil_div(g.d.s, C::BN), g.d.b), stream,
                                         device);
      err != cudaSuccess) {
    return err;
  }
  return launch_dq_convert<T>(g.dq_acc, g.dq, n, g.d.scale, stream);
}

}  // namespace pk::attention
