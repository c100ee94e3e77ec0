/**
 * @file attn/bwd_mainloop.cuh
 * @brief The attention backward's mainloop (namespace pk::attn): bwd_block<C>, the one-pass
 * backward's block (128 keys of K/V stationary, 64-row q/dO stages streamed from a source, five
 * GEMMs per step), with its configurations (dkdv_config, bwd_config: tiles, stages, shared
 * storage) and the steps its warpgroups take (dkdv_step: dK and dV; dq_part: dQ by TMA
 * reductions), which ring_attn_bwd.cuh's lanes also run over K/V tiles that change with the
 * ring's steps.
 *
 * Per step, warpgroup c: S^T = K Q^T and dP^T = V dO^T for its 64 keys; P^T recomputed from the
 * saved lse and dS^T = P^T (dP^T - delta) (softmax.cuh softmax_grad); dV += P^T dO and
 * dK += dS^T Q (P^T and dS^T from registers); dS^T to the step's ds tile in shared memory;
 * then columns [c D/2, (c + 1) D/2) of dQ_step = dS K, staged in shared memory and added into
 * a float32 dq_acc by TMA reductions (cp.reduce.async.bulk.tensor add), so dq is not bitwise
 * reproducible (dk and dv are).
 *
 * The source Src says where the stages come from: bound() (the mbarrier wait bound),
 * before_load(q0) (the issuing thread, before the loads of rows q0..: waits for rows other
 * ranks push) and tile(qb0, qi, nq) (the stream's tile qi of a head, from qb0, to its query
 * tile). local.cuh local_rows reads operands present from the start;
 * ulysses_attn_bwd.cuh pushed_rows waits for the rows other ranks push. A source with masks
 * (masked.cuh masked_rows, `masked_source`) also gives each key block's query tiles and each
 * step's softmax gradient; the other sources' code is the same with or without that branch.
 *
 * Pitfalls: P^T and dS^T are register A operands of wgmma, read asynchronously until their
 * group completes, so they are fenced (frag::fence_regs) until after the wait. Padded query
 * rows have lse = +inf (P = 0) and delta = 0.
 */
#pragma once

#include <type_traits>

#include "pk/attn/common.cuh"
#include "pk/attn/softmax.cuh"
#include "pk/wgmma_ta.cuh"

namespace pk::attn {

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
struct dkdv_step : softmax_grad<C::BQ> {
  using T = typename C::dtype;
  static constexpr int D = C::HEAD_DIM, BQ = C::BQ;
  using stage_t = typename C::stage_t;
  using softmax_grad<BQ>::sc;
  using softmax_grad<BQ>::dp;
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

/** @brief Whether bwd_block's source Src has masks (masked.cuh masked_rows: Src::MASKED): then
 * it gives each key block's query tiles (tiles()) and each step's softmax gradient
 * (grad_scores); else the causal diagonal is the only mask. */
template <class Src, class = void>
struct masked_source : std::false_type {};
template <class Src>
struct masked_source<Src, std::void_t<decltype(Src::MASKED)>>
    : std::bool_constant<Src::MASKED> {};

/** @brief The one-pass backward's storage on dkdv_config's shapes (STAGES fit two dS^T tiles). */
template <typename T, int D>
struct bwd_config : dkdv_config<T, D> {
  using base = dkdv_config<T, D>;
  static constexpr int THREADS = attn::THREADS;  // the backward kernels' launch bounds
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

  /** @brief after_scores with the softmax gradient `grad` of a masked source (masked.cuh
   * masked_rows::grad_scores) instead of softmax_grad::grad_scores. */
  template <class Grad>
  __device__ void after_scores_with(dkdv_step<C>& step, const typename C::stage_t& stage,
                                    typename C::ds_tile& ds, const typename C::kv_tile& k,
                                    float (&dk)[D / 2], float (&dv)[D / 2], int row, int lane,
                                    int nbeg, const Grad& grad) {
    grad();
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
  template <class G>  // attention::bwd_globals, ring_attn_bwd::globals: their dq32
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

/**
 * @brief The backward in one pass, five GEMMs per step (a dQ pass and a dK/dV pass took
 * seven): each block holds 128 keys of K/V head hk and streams 64-query stages of every query
 * head of hk's group (dkdv_step: dK and dV in registers); after dS^T is computed, each
 * warpgroup stores its 64 key rows of it (rounded to T) into the step's ds tile; once both
 * have (named barrier BWD_DS), warpgroup c computes columns [c D/2, (c + 1) D/2) of
 * dQ_step = dS K for the stage's 64 queries over all 128 keys, stages them in shared memory
 * and its leader adds them to dq_acc with TMA reductions (dq_part::reduce): per-thread vector
 * reductions (red.global.add.v2.f32) in their place, 16 per thread and step at D = 128, were
 * slower. At D = 64 the next step's S^T and dP^T are issued before those reductions. ds is
 * double-buffered: a warpgroup writes ds[j % 2] in step j only after passing step j - 1's
 * barrier, which the other passed after its step j - 2 wait, the last read of that buffer.
 * The staging is single-buffered: `share` waits for its last read. The block's dQ partials of
 * a query row are summed in fp32 by the L2 in any order, so dq is not bitwise reproducible (dk
 * and dv are). This is key block kb (128 keys) of K/V head hk, batch b, its q/dO stages from
 * `src`; g has attention::bwd_globals' fields (maps q64, do64, k128, v128, dq32; lse, delta,
 * sp, dk, dv, d).
 * measured: attention_notes.md, "Measurements moved from code comments (issue 37)".
 */
template <class C, class G, class Src>
__device__ __forceinline__ void bwd_block(const G& g, int hk, int kb, int b, const Src& src) {
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
  constexpr bool MASKED = masked_source<Src>::value;
  const int qb0 = [&] {
    if constexpr (MASKED) return src.tiles().lo;
    else return dm.causal ? k0 / BQ : 0;
  }();
  const int per_head = [&] {
    if constexpr (MASKED) return src.tiles().hi - qb0;
    else return nq - qb0;
  }();
  const int n_tiles = group * per_head;
  const bool issuer = threadIdx.x == 0;
  auto issue = [&](int j) {
    const int st = pipeline_state<STAGES>::stage_of(j);
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
  // Tile j is query block qb0 + qi of head h (qi = j % per_head) in stage
  // pipe.stage = j % STAGES: counters, not divisions, in the loop. Each loop below advances
  // them itself: the head and block steps in a shared lambda change both loops' machine code,
  // and these are the forms measured (attention_notes.md, "Full benchmark on the 176-key
  // forward; the D = 64 backward pipelined").
  pipeline_state<STAGES> pipe;
  int h = hk * group, qi = 0;
  if constexpr (D == 128) {
    for (int j = 0; j < n_tiles; ++j) {
      const int q0 = src.tile(qb0, qi, nq) * BQ;
      auto& stage = s.st[pipe.stage];
      auto& ds = s.ds[j & 1];
      mbar_wait(&s.full[pipe.stage], pipe.phase);
      step.scores(s, stage, c);
      dq_part<C> part;
      if constexpr (MASKED) {
        part.after_scores_with(step, stage, ds, s.k, dk, dv, key_lo - k0, lane, nbeg, [&] {
          src.grad_scores(g, step, s.lse[pipe.stage], s.delta[pipe.stage], sl2, q0,
                          k0 + c * 64, keys);
        });
      } else {
        part.after_scores(step, stage, s.lse[pipe.stage], s.delta[pipe.stage], ds, s.k, dk, dv,
                          dm.causal && q0 < k0 + c * 64 + 63, sl2, q0, keys, key_lo - k0, lane,
                          nbeg);
      }
      release(j);
      part.reduce(g, s.dqs[c], b, h, q0, nbeg, t, c);
      if (++qi == per_head) {
        qi = 0;
        ++h;
      }
      pipe.advance();
    }
  } else {
    // D = 64: step j's S^T and dP^T are issued at the end of step j - 1, before that step's
    // dQ reductions, so the tensor cores run them while the reductions issue (at D = 128 it
    // took more registers and was slower).
    // measured: attention_notes.md, "Measurements moved from code comments (issue 37)".
    // The last step is peeled off (`last`): with the issue under a condition inside the loop,
    // ptxas waits for the GEMMs early (warning C7517), which undoes the overlap. The step
    // spells out dq_part::after_scores: called through it, this loop compiles to other code
    // than the one measured.
    mbar_wait(&s.full[0], 0);
    step.issue_scores(s, s.st[0], c);
    auto tile = [&](int j, auto last) {
      const int q0 = src.tile(qb0, qi, nq) * BQ, hq = h;
      auto& stage = s.st[pipe.stage];
      auto& ds = s.ds[j & 1];
      step.wait_scores();
      if constexpr (MASKED) {
        src.grad_scores(g, step, s.lse[pipe.stage], s.delta[pipe.stage], sl2, q0, k0 + c * 64,
                        keys);
      } else {
        const bool mask = dm.causal && q0 < k0 + c * 64 + 63;
        step.grad_scores(s.lse[pipe.stage], s.delta[pipe.stage], sl2, mask,
                         [&](int col) { return q0 + col; }, keys);
      }
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
        pipe.advance();
        mbar_wait(&s.full[pipe.stage], pipe.phase);
        step.issue_scores(s, s.st[pipe.stage], c);
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

}  // namespace pk::attn
