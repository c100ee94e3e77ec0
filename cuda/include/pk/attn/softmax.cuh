/**
 * @file attn/softmax.cuh
 * @brief The softmax of the attention mainloops on register fragments (namespace pk::attn): the
 * forward's online softmax (masked scores, running max and sum, the rescale factor) and the
 * backward's softmax gradient (P^T recomputed from the saved lse, dS^T = P^T (dP^T - delta)).
 *
 * Both are bases of the mainloops' per-warpgroup state (fwd_mainloop.cuh fwd_rows,
 * bwd_mainloop.cuh dkdv_step), holding the score fragment the GEMMs write. A thread holds two
 * rows of a wgmma m64nN accumulator: rows r and r + 8 (r = 16 (warp % 4) + lane / 4), element
 * 4 jj + 2 i + cc of row r + 8 i at column 8 jj + 2 (lane % 4) + cc (fragment.cuh); a row's
 * other columns are in the lane's quad, so row reductions are quad reductions.
 *
 * Pitfalls: a row that sees only masked keys keeps max = -inf; its exponents are taken against
 * 0, never -inf - (-inf). Padded query rows of the backward have lse = +inf, so P = 0 there.
 */
#pragma once

#include "pk/attn/common.cuh"

namespace pk::attn {

/**
 * @brief The forward's online softmax over streamed key tiles of BN keys: the scores S (then
 * P = exp(S - max), in place), each row's running max m and sum l, and alpha, the factor by
 * which the latest update scaled the old max's terms (the caller rescales O by it).
 */
template <int BN>
struct online_softmax {
  float sc[BN / 2];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2];

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
};

/**
 * @brief The backward's softmax gradient over a stage of BQ query rows, for a warpgroup's keys
 * (the transposed scores: a thread holds keys key_lo and key_lo + 8): S^T (then P^T, in place)
 * and dP^T (then dS^T, in place), as the GEMMs S^T = K Q^T and dP^T = V dO^T wrote them.
 */
template <int BQ>
struct softmax_grad {
  float sc[BQ / 2], dp[BQ / 2];

  /** @brief P^T = exp2(S^T scale log2e - lse2) into sc and dS^T = P^T (dP^T - delta) into dp,
   * from the stage's 64 lse and delta values at `lse` and `delta` (+inf / 0 past S; bwd_config
   * keeps them apart from its stages); on a `masked` stage P = 0 where the query's position
   * qpos(col) is before the key's limit lim[i] (key key_lo + 8 i). */
  template <class QPos>
  __device__ void grad_scores(const float* lse, const float* delta, float sl2, bool masked,
                              const QPos& qpos, const int (&lim)[2]) {
    // Two code paths: in one shared path with the mask as a runtime flag, an unmasked step
    // would also run the mask's comparisons and selects.
    // measured: attention_notes.md, "Measurements moved from code comments (issue 37)".
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
};

}  // namespace pk::attn
