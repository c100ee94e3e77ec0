/**
 * @file attn/local.cuh
 * @brief The mainloops' sources over operands that are all present from the start (namespace
 * pk::attn): local_keys (fwd_block's Q tile and K/V stream, pk.attention's forward) and
 * local_rows (bwd_block's q/dO stages, pk.attention's backward).
 *
 * Both read the kernel's globals G through fields only, so any op whose operands sit in
 * memory before the kernel starts can use them; the sources that wait for other ranks' rows
 * stay with their ops (ring_attn.cuh ring_keys, ulysses_attn.cuh pushed_keys,
 * ulysses_attn_bwd.cuh pushed_rows), as they read those ops' workspaces and signal slots; the
 * same sources with masks are masked.cuh's.
 */
#pragma once

#include "pk/attn/common.cuh"
#include "pk/attn/fwd_mainloop.cuh"

namespace pk::attn {

/**
 * @brief fwd_block's source over operands all present from the start: the block's query tile
 * (head blockIdx.x, tile blockIdx.y counted down when causal, batch blockIdx.z), key tile j at
 * keys j BN (the tiles wholly above the diagonal left out), O and lse stored in place. G has
 * attention::fwd_globals' fields: maps q, k, v (boxes of BM and BN rows), o, lse, dims d.
 * fwd_block builds one per thread from the kernel's arguments; load_* are called by the
 * issuing thread (tiles in increasing order), softmax by every consumer thread for tiles 0,
 * 1, .. in order, store by every consumer thread.
 */
template <class C>
struct local_keys {
  int h, b, q0, hk, n;  // n: the stream's tiles
  template <class G>
  __device__ explicit local_keys(const G& g) {
    const dims& dm = g.d;
    h = blockIdx.x;
    b = blockIdx.z;
    const int qb = dm.causal ? static_cast<int>(gridDim.y - 1 - blockIdx.y) : blockIdx.y;
    q0 = qb * C::BM;
    hk = h / (dm.h / dm.hkv);
    const int kv_end = dm.causal ? min(dm.s, q0 + C::BM) : dm.s;
    n = ceil_div(kv_end, C::BN);
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
    load_rows(t, &g.k, bar, b, j * C::BN, hk);
  }
  template <class G>
  __device__ void load_v(const G& g, typename C::kv_tile& t, mbarrier* bar, int j) const {
    load_rows(t, &g.v, bar, b, j * C::BN, hk);
  }
  /** @brief Masks tile j's scores (keys past S; when causal, keys after the row) for the
   * warpgroup's 64 rows from wg_row0 (the thread's: `rows`), then the online-softmax update. */
  template <class G>
  __device__ void softmax(const G& g, fwd_rows<C>& r, int j, int wg_row0, const int (&rows)[2],
                          float sl2) const {
    const dims& dm = g.d;
    const int k0 = j * C::BN;
    const bool tail = k0 + C::BN > dm.s;
    const bool diag = dm.causal && k0 + C::BN - 1 > wg_row0;
    if (tail || diag) r.mask(k0, dm.s, dm.causal, [](int key) { return key; }, rows);
    r.softmax(sl2);
  }
  /** @brief O and lse of the warpgroup's 64 rows from wg_row0. */
  template <class G>
  __device__ void store(const G& g, fwd_rows<C>& r, int wg_row0) const {
    const dims& dm = g.d;
    r.store(g.o, g.lse + (int64_t(b) * dm.h + h) * dm.s, b, wg_row0, h, dm.h, dm.s, dm.scale);
  }
};

/** @brief bwd_block's source of q/dO stages over operands all present from the start, each
 * head's query tiles in order (`tile`: the stream's tile qi of a head, from qb0, to its query
 * tile). ulysses_attn_bwd.cuh's source also waits for the rows other ranks push, and starts
 * each head at the rows that arrive first. */
struct local_rows {
  __device__ wait_bound bound() const { return wait_bound{}; }
  __device__ void before_load(int /*q0*/) const {}
  __device__ int tile(int qb0, int qi, int /*nq*/) const { return qb0 + qi; }
};

}  // namespace pk::attn
