/**
 * @file attn/fwd_mainloop.cuh
 * @brief The attention forward's mainloop (namespace pk::attn): fwd_block<C, Src>, a block of
 * WGS consumer warpgroups that holds BM query rows and streams K/V tiles of BN keys from a
 * source, with its configuration (fwd_config: tiles, stages, shared storage) and a warpgroup's
 * registers and steps (fwd_rows).
 *
 * Schedule: thread 0 issues the Q tile and the first STAGES K/V tiles; each later tile is
 * issued by the leader of whichever warpgroup releases its stage last (release_stage), so no
 * warpgroup waits for another to free a stage (no producer warpgroup: NOTES at THREADS in
 * common.cuh). Step j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1}, waits for S_j only, runs
 * the softmax of S_j while the tensor cores finish P V, then rescales O. The warpgroups take
 * turns issuing their GEMMs (named barriers FWD_TURN + c: ping-pong), so one's softmax runs
 * under the others' GEMMs. With 2 stages (wider key tiles) K and V of a stage are freed and
 * refilled apart (fwd_config::SPLIT_RELEASE).
 *
 * The source Src says where the Q tile and the K/V stream come from and where the rows go
 * (local.cuh local_keys; the ring and Ulysses kernels' sources in their op headers): built per
 * thread from the kernel's globals G, it answers bound(g), n_tiles(), row0(), load_q, load_k
 * and load_v (issuing thread, tiles in increasing order), softmax(g, rows, j, ..) (every
 * consumer thread, tiles 0, 1, .. in order: its masks, then the online-softmax update) and
 * store(g, rows, wg_row0) (every consumer thread).
 *
 * Pitfalls: P is a register A operand of wgmma, read asynchronously until its group completes,
 * so it is fenced (frag::fence_regs) until after the wait. The full barriers expect whole
 * boxes, zero-filled past S.
 */
#pragma once

#include "pk/attn/common.cuh"
#include "pk/attn/softmax.cuh"

namespace pk::attn {

/**
 * @brief The forward's tiles and shared storage: WGS consumer warpgroups of 64 query rows
 * (BM = 64 WGS), key tiles of KEYS (BN), head dim D, a ring of STAGES K and V buffers.
 */
template <typename T, int D, int WGS = CONSUMERS, int KEYS = 128>
struct fwd_config {
  using dtype = T;
  static constexpr int HEAD_DIM = D;
  static constexpr int WARPGROUPS = WGS, THREADS = WGS * WARPGROUP_THREADS;
  static constexpr int BM = 64 * WGS, BN = KEYS;
  static constexpr int STAGES = D == 64 ? 5 : BN == 128 ? 3 : 2;
  // fwd_block frees a stage's K after the step's S = Q K^T and its V after P V, each refilled
  // on its own, where only 2 stages fit (wider key tiles): freeing both after P V, the next K
  // was issued one step before it was needed. With 3 stages, freeing them apart costs two
  // releases per step, so those free both at once.
  // measured: attention_notes.md, "Measurements moved from code comments (issue 37)".
  static constexpr bool SPLIT_RELEASE = STAGES == 2;
  using q_tile = st_panels<T, BM, D>;
  using kv_tile = st_panels<T, BN, D>;
  struct storage_t {
    q_tile q;
    kv_tile k[STAGES];
    kv_tile v[STAGES];
    mbarrier q_full, k_full[STAGES], v_full[STAGES];
    int released[STAGES];    // see release_stage
    int released_v[STAGES];  // fwd_block with SPLIT_RELEASE: V's (released: K's)
  };
  static constexpr size_t SMEM = sizeof(storage_t) + 1024;
};

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
 * registers (O, P packed for the next P V, and the online softmax's scores, row max m and sum
 * l) and the steps every forward kernel takes with them (fwd_block's, on fwd_config's storage).
 * Each thread holds rows row_lo and row_lo + 8 of the warpgroup.
 */
template <class C>
struct fwd_rows : online_softmax<C::BN> {
  using T = typename C::dtype;
  static constexpr int D = C::HEAD_DIM, BN = C::BN;
  using online_softmax<BN>::sc;
  using online_softmax<BN>::m;
  using online_softmax<BN>::l;
  using online_softmax<BN>::alpha;
  float o[D / 2];
  uint32_t p[BN / 4];

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

/**
 * @brief The forward's block: BM query rows (src.row0()..) against src's stream of key tiles,
 * O and lse out through src (see the file comment). C: a fwd_config; Src: the source, built
 * from g.
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
  // Streamed tile j's K or V into its stage (free); issue: both.
  using pipe = pipeline_state<STAGES>;
  auto issue_k = [&](int j) {
    const int st = pipe::stage_of(j);
    mbar_arrive_expect_tx(&s.k_full[st], C::kv_tile::BYTES);
    src.load_k(g, s.k[st], &s.k_full[st], j);
  };
  auto issue_v = [&](int j) {
    const int st = pipe::stage_of(j);
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
  // 13.0 compiled the D = 64 kernel to more registers and a slower forward, and marking the
  // final turn at its call site changes the code too. This is the code that was measured: the
  // last warpgroup's last turn (n_tiles + 1 each) hands none over.
  // measured: attention_notes.md, "Measurements moved from code comments (issue 37)".
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
    const int st = pipe::stage_of(j), prev = pipe::stage_of(j - 1);
    mbar_wait(&s.k_full[st], pipe::phase_of(j));
    mbar_wait(&s.v_full[prev], pipe::phase_of(j - 1));
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
  const int last = pipe::stage_of(n_tiles - 1);
  mbar_wait(&s.v_full[last], pipe::phase_of(n_tiles - 1));
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

}  // namespace pk::attn
