/**
 * @file attn/peers.cuh
 * @brief What the fused attention forwards over other ranks' rows share (namespace pk::attn):
 * step_stream, a K/V stream over the P ranks' keys that fwd_block's sources walk in order, and
 * comm_or_compute, a fused kernel's body (communication blocks first, then fwd_block).
 *
 * Used by ring_attn.cuh (ring_keys: the K/V blocks travel around the ring) and ulysses_attn.cuh
 * (pushed_keys: every rank pushes its rows of a head group to the group's owner). The sources
 * themselves stay with their ops: they read the ops' workspaces and wait on their signal slots.
 * G, the op's globals, has a communicator c (tp::comm: rank, world, bound()) and comm_blocks.
 *
 * Pitfalls: comm_or_compute's communication blocks come first in the grid, so they are
 * resident before any compute block spins on the rows they move; their count must be the same
 * on every rank (they pair across ranks).
 */
#pragma once

#include "pk/attn/common.cuh"
#include "pk/attn/fwd_mainloop.cuh"

namespace pk::attn {

/**
 * @brief What the fused forwards' fwd_block sources share (ring_attn.cuh ring_keys,
 * ulysses_attn.cuh pushed_keys): a K/V stream of P steps, step t holding the keys of rank
 * owner(t) = (r - t) mod P (the ring's K/V block, Ulysses' source), Self::count(g, t) tiles
 * of them; its total n; and softmax's place in it, which every consumer thread walks in order
 * (key tile at_kt of step at_t, whose owner is at_o and which has at_n tiles). Self's
 * constructor sets n and the place at the first tile (written out in each: shared, the loop
 * compiled differently for one of them). No division per step: with one, a Ulysses call at
 * P = 1 was markedly slower than pk.attention alone.
 * measured: ulysses_attention_notes.md, "Measurements moved from code comments (issue 37)".
 */
template <class Self>
struct step_stream {
  int n;
  mutable int at_t = 0, at_kt = 0, at_o, at_n;

  /** @brief The rank whose keys step t holds (0 <= t < P). */
  template <class G>
  __device__ static int owner(const G& g, int t) {
    return g.c.rank >= t ? g.c.rank - t : g.c.rank - t + g.c.world;
  }
  /** @brief Softmax's place moves past a tile. */
  template <class G>
  __device__ void next(const G& g) const {
    if (++at_kt == at_n) {
      at_kt = 0;
      do {
        ++at_t;
      } while (at_t < g.c.world && (at_n = static_cast<const Self&>(*this).count(g, at_t)) == 0);
      if (at_t < g.c.world) at_o = owner(g, at_t);
    }
  }
  /** @brief The compute blocks' mbarrier bound: the communicator's (peer_wait_bound, a quarter
   * longer than the signal waits, so a missing peer is named by a signal wait). */
  template <class G>
  __device__ wait_bound bound(const G& g) const {
    return g.c.bound();
  }
  __device__ int n_tiles() const { return n; }
};

/** @brief A fused forward kernel's body (ring_attn.cuh's and ulysses_attn.cuh's): blocks
 * [0, g.comm_blocks) run comm(smem), the exchange, on the block's shared memory; the others
 * are fwd_block over Src. */
template <class C, class Src, class G, class Comm>
__device__ __forceinline__ void comm_or_compute(const G& g, const Comm& comm) {
  if (static_cast<int>(blockIdx.x) < g.comm_blocks) {
    if (threadIdx.x == 0) block_wait_bound() = g.c.bound();
    __syncthreads();
    comm(&dynamic_smem<typename C::storage_t>());
    return;
  }
  fwd_block<C, Src>(g);
}

}  // namespace pk::attn
