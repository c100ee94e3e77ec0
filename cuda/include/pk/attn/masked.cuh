/**
 * @file attn/masked.cuh
 * @brief The mainloops' sources with masks (namespace pk::attn): masked_keys (fwd_block's Q
 * tile and K/V stream) and masked_rows (bwd_block's q/dO stages), over operands all present from
 * the start, as local.cuh's local_keys and local_rows, plus segment ids, a local window, the
 * sequence lengths and the logits soft cap (masks.cuh says what each hides).
 *
 * Whole tiles: a query tile streams only the key tiles masks::fwd_key_tiles gives (a window of
 * W keys: O(W) of them; packed documents: those of its own documents), a key block only the
 * query tiles masks::bwd_query_tiles gives; a block with none writes its zeros and returns
 * before the mainloop (attention.cuh's masked kernels), which needs at least one tile. Elements:
 * a 64-row (forward) or 64-key (backward) warpgroup's sub-tile runs the element masks only
 * where masks::needs_mask says some pair may be hidden, as the unmasked kernels mask only the
 * diagonal and the tail.
 *
 * Soft cap (template CAP): a score x = q . k becomes (c / scale) tanh(x scale / c), so that
 * scale times it is the capped logit and the rest of the softmax is unchanged; the backward
 * recomputes tanh from the scores and multiplies dS by its derivative 1 - tanh^2.
 *
 * Rows no key is visible to keep l = 0 in the forward: O = 0 and lse = +inf (fwd_rows::store),
 * so their P is 0 in the backward and their gradients are 0, as in the reference
 * (pk_jax/ops/_attention.py).
 *
 * The globals G of the masked kernels have their unmasked kernels' fields and `m`, a
 * mask_args.
 */
#pragma once

#include "pk/attn/bwd_mainloop.cuh"
#include "pk/attn/common.cuh"
#include "pk/attn/fwd_mainloop.cuh"
#include "pk/attn/masks.cuh"
#include "pk/attn/softmax.cuh"

namespace pk::attn {

/** @brief The masks of a masked call, as the kernels read them (pk_attention's masked
 * operands: ffi/attention.cu). Lengths and segment arrays are per batch row b at b, b * sp and
 * b * (sp / CHUNK). */
struct mask_args {
  const int* q_len;   // [B]: rows at or past it see no key
  const int* kv_len;  // [B]: keys at or past it are hidden
  const int* q_seg;   // [B, sp] (segments): each row's id, padded past S
  const int* kv_seg;  // [B, sp]
  const masks::chunk_info* q_info;   // [B, sp / CHUNK] (segments): query chunks
  const masks::chunk_info* kv_info;  // [B, sp / CHUNK]: key chunks
  int sp;             // S rounded up to 128
  int left, right;    // the window (S, S: none)
  float cap_in;       // soft cap c: scale / c
  float cap_out;      // c / scale
  int segments;       // q_seg, kv_seg, q_info, kv_info given
};

/** @brief Scores x of a fragment become (c / scale) tanh(x scale / c) (the soft cap in the
 * scores' units). */
template <int N>
__device__ __forceinline__ void soft_cap(float (&sc)[N], float cap_in, float cap_out) {
#pragma unroll
  for (int i = 0; i < N; ++i) sc[i] = cap_out * masks::tanh_fast(sc[i] * cap_in);
}

/**
 * @brief fwd_block's source with masks: the block's query tile as local_keys' (head
 * blockIdx.x, tile blockIdx.y counted down when causal, batch blockIdx.z), and the key tiles
 * t0, t0 + 1, .. of masks::fwd_key_tiles; O and lse stored in place. CAP: the soft cap.
 */
template <class C, bool CAP>
struct masked_keys {
  int h, b, q0, hk, t0, n;
  masks::positions p;

  template <class G>
  __device__ explicit masked_keys(const G& g) {
    const dims& dm = g.d;
    h = blockIdx.x;
    b = blockIdx.z;
    const int qb = dm.causal ? static_cast<int>(gridDim.y - 1 - blockIdx.y) : blockIdx.y;
    q0 = qb * C::BM;
    hk = h / (dm.h / dm.hkv);
    p = masks::positions::of(dm.s, g.m.q_len[b], g.m.kv_len[b], g.m.left, g.m.right,
                             dm.causal != 0);
    const masks::span t = masks::fwd_key_tiles(p, g.m.q_info + b * (g.m.sp / masks::CHUNK),
                                               g.m.segments != 0, q0, C::BM, C::BN);
    t0 = t.lo;
    n = t.empty() ? 0 : t.hi - t.lo;
  }
  template <class G>
  __device__ wait_bound bound(const G& /*g*/) const { return wait_bound{}; }
  __device__ int n_tiles() const { return n; }
  __device__ int row0() const { return q0; }
  template <class G>
  __device__ void load_q(const G& g, typename C::q_tile& t, mbarrier* bar) const {
    load_rows(t, &g.q, bar, b, q0, h);
  }
  template <class G>
  __device__ void load_k(const G& g, typename C::kv_tile& t, mbarrier* bar, int j) const {
    load_rows(t, &g.k, bar, b, (t0 + j) * C::BN, hk);
  }
  template <class G>
  __device__ void load_v(const G& g, typename C::kv_tile& t, mbarrier* bar, int j) const {
    load_rows(t, &g.v, bar, b, (t0 + j) * C::BN, hk);
  }
  /** @brief Tile j's scores capped (CAP), their hidden pairs set to -inf where the
   * warpgroup's 64 rows from wg_row0 need it (the thread's rows: `rows`), then the
   * online-softmax update. */
  template <class G>
  __device__ void softmax(const G& g, fwd_rows<C>& r, int j, int wg_row0, const int (&rows)[2],
                          float sl2) const {
    constexpr int BN = C::BN;
    const int k0 = (t0 + j) * BN;
    if constexpr (CAP) soft_cap(r.sc, g.m.cap_in, g.m.cap_out);
    const int chunks = g.m.sp / masks::CHUNK;
    const bool seg = g.m.segments != 0;
    if (masks::needs_mask(p, g.m.q_info + b * chunks, g.m.kv_info + b * chunks, seg, wg_row0, 64,
                          k0, BN)) {
      const int lane = threadIdx.x % 32;
      masks::span keys[2];
      int qs[2] = {0, 0};
      const int* kseg = g.m.kv_seg + int64_t(b) * g.m.sp + k0 + 2 * (lane % 4);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        keys[i] = masks::keys_of_row(p, rows[i]);
        if (seg && rows[i] < p.s) qs[i] = g.m.q_seg[int64_t(b) * g.m.sp + rows[i]];
      }
#pragma unroll
      for (int jj = 0; jj < BN / 8; ++jj) {
        const int2 ks = seg ? *reinterpret_cast<const int2*>(kseg + 8 * jj) : make_int2(0, 0);
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const int key = k0 + 8 * jj + 2 * (lane % 4) + cc;
          const int id = cc ? ks.y : ks.x;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            if (!keys[i].contains(key) || id != qs[i]) r.sc[4 * jj + 2 * i + cc] = -INFINITY;
          }
        }
      }
    }
    r.softmax(sl2);
  }
  /** @brief O and lse of the warpgroup's 64 rows from wg_row0. */
  template <class G>
  __device__ void store(const G& g, fwd_rows<C>& r, int wg_row0) const {
    const dims& dm = g.d;
    r.store(g.o, g.lse + (int64_t(b) * dm.h + h) * dm.s, b, wg_row0, h, dm.h, dm.s, dm.scale);
  }
};

/**
 * @brief The softmax gradient of a masked backward step, for a warpgroup's keys (softmax_grad's
 * layout: keys key_lo and key_lo + 8 i): P^T from the saved lse on the (CAP: capped) scores,
 * zero where MASK and the pair is hidden (row q0 + col outside rows[i], or its id qseg[col]
 * other than the key's kseg[i]), dS^T = P^T (dP^T - delta) (CAP: times 1 - tanh^2).
 */
template <bool CAP, bool MASK, int BQ>
__device__ __forceinline__ void masked_grad(softmax_grad<BQ>& sg, const float* lse,
                                            const float* delta, float sl2, float cap_in,
                                            float cap_out, int q0, const masks::span (&rows)[2],
                                            const int* qseg, const int (&kseg)[2]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int jj = 0; jj < BQ / 8; ++jj) {
    const int2 qs = MASK && qseg ? *reinterpret_cast<const int2*>(qseg + 8 * jj + 2 * (lane % 4))
                                 : make_int2(0, 0);
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const int col = 8 * jj + 2 * (lane % 4) + cc;
      const float l2 = lse[col] * LOG2E;  // +inf past S and for rows that see no key: p = 0
      const float dl = delta[col];
      const int id = cc ? qs.y : qs.x;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int el = 4 * jj + 2 * i + cc;
        float x = sg.sc[el], t = 0.f;
        if constexpr (CAP) {
          t = masks::tanh_fast(x * cap_in);
          x = cap_out * t;
        }
        float pr = frag::exp2_approx(fmaf(x, sl2, -l2));
        if (MASK && (!rows[i].contains(q0 + col) || id != kseg[i])) pr = 0.f;
        sg.sc[el] = pr;
        float ds = pr * (sg.dp[el] - dl);
        if constexpr (CAP) ds *= 1.f - t * t;
        sg.dp[el] = ds;
      }
    }
  }
}

/**
 * @brief bwd_block's source of q/dO stages with masks: key block kb of batch b streams, for
 * each head of its group, the query tiles masks::bwd_query_tiles gives, in order (`tiles`,
 * `tile`); its steps' softmax gradient is `grad_scores`. MASKED tells bwd_block to ask it for
 * both (local_rows has neither).
 */
template <class C, bool CAP>
struct masked_rows {
  static constexpr bool MASKED = true;
  static constexpr int BN = C::BN, BQ = C::BQ;
  masks::positions p;
  masks::span t;  // the query tiles
  int b;
  int kseg[2];    // the ids of the thread's keys (segments)

  template <class G>
  __device__ masked_rows(const G& g, int kb, int batch) : b(batch) {
    const dims& dm = g.d;
    p = masks::positions::of(dm.s, g.m.q_len[b], g.m.kv_len[b], g.m.left, g.m.right,
                             dm.causal != 0);
    t = masks::bwd_query_tiles(p, g.m.kv_info + b * (g.m.sp / masks::CHUNK),
                               g.m.segments != 0, kb * BN, BN, BQ);
    const int lane = threadIdx.x % 32;
    const int key_lo = kb * BN + 64 * warpgroup::index() + 16 * (warpgroup::thread() / 32) +
                       lane / 4;
    // keys < kb BN + 128 <= sp: inside the padded ids
    kseg[0] = g.m.segments ? g.m.kv_seg[int64_t(b) * g.m.sp + key_lo] : 0;
    kseg[1] = g.m.segments ? g.m.kv_seg[int64_t(b) * g.m.sp + key_lo + 8] : 0;
  }
  __device__ wait_bound bound() const { return wait_bound{}; }
  __device__ void before_load(int /*q0*/) const {}
  /** @brief The query tiles each head streams (empty: the kernel returns before bwd_block). */
  __device__ masks::span tiles() const { return t; }
  __device__ int tile(int qb0, int qi, int /*nq*/) const { return qb0 + qi; }

  /** @brief The step's softmax gradient (step's sc and dp: S^T and dP^T in, P^T and dS^T out)
   * for query rows q0.. (the stage's lse and delta) and the warpgroup's keys kw0.. (the
   * thread's: `keys`). */
  template <class G, class Step>
  __device__ void grad_scores(const G& g, Step& step, const float* lse, const float* delta,
                              float sl2, int q0, int kw0, const int (&keys)[2]) const {
    const int chunks = g.m.sp / masks::CHUNK;
    const bool seg = g.m.segments != 0;
    const masks::span rows[2] = {masks::rows_of_key(p, keys[0]), masks::rows_of_key(p, keys[1])};
    if (masks::needs_mask(p, g.m.q_info + b * chunks, g.m.kv_info + b * chunks, seg, q0, BQ, kw0,
                          64)) {
      // q0 + 64 <= sp: the stage's ids are inside the padded ids
      const int* qseg = seg ? g.m.q_seg + int64_t(b) * g.m.sp + q0 : nullptr;
      masked_grad<CAP, true, BQ>(step, lse, delta, sl2, g.m.cap_in, g.m.cap_out, q0, rows, qseg,
                                 kseg);
    } else {
      masked_grad<CAP, false, BQ>(step, lse, delta, sl2, g.m.cap_in, g.m.cap_out, q0, rows,
                                  nullptr, kseg);
    }
  }
};

}  // namespace pk::attn
