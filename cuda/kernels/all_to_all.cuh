/*
 * all_to_all: block j of x's split axis goes to rank j; rank r concatenates the blocks it
 * receives along the concat axis in sender order (reference: lax.all_to_all(..., tiled=True)).
 * The Ulysses shape: [B, S/P, H, D] -> [B, S, H/P, D] (split 2, concat 1).
 *
 * Shardings: x_p viewed as [A1, P, C1] (split axis cut into P blocks, C1 = block's trailing
 * elements); the block for rank r, blk = x_p[:, r, :] ([A1 C1] elements in x's order with the
 * split axis shortened) is viewed as [A2, C2] at the concat axis, and y_r: [A2, P, C2] with
 * y_r[a2, p, :] = blk_p[a2, :].
 *
 * Schedule (P2P engine, pk/collective.cuh; f in [0, n / P) indexes one block, chunk [lo, hi)):
 *
 *     step      rank r
 *     stage     ws_r[d][f - lo] <- x_r[a1, d, j1], f = a1 C1 + j1, every d    (local)
 *     barrier   ready[b][*] = q+1 on every peer
 *     pull      y_r[a2, p, j2] <- ws_p[r][f - lo], f = a2 C2 + j2, every p   (bulk copies)
 *     signal    done[b][r] = q+1 on every peer
 *
 * Signal protocol: as all_reduce one-shot. Traffic per rank: (P - 1) n / P over NVLink.
 *
 * Pitfalls: both index maps are pure index arithmetic, so no XLA transposes are needed for any
 * (split, concat) pair; the bulk-copy path needs C1 and C2 (in bytes) to be multiples of 16,
 * otherwise a narrower unit is used. Raw bits are moved (int32 and floats alike).
 */
#pragma once

#include "pk/collective.cuh"

namespace pk::all_to_all {

struct config {
  static constexpr int THREADS = coll::THREADS;
};

/** @brief `g` needs the communicator fields, x, y, rank_ptr and n; C1, C2 as above. */
template <typename T>
inline coll::launch_status launch(coll::globals g, int64_t c1, int64_t c2, uint64_t ws_bytes,
                                  cudaStream_t stream, int device) {
  g.L = g.n / g.world;
  g.n_out = g.n;
  g.S = c1 > 0 ? c1 : 1;
  g.B = c2 > 0 ? c2 : 1;
  const int vec = coll::vec_bytes_for(sizeof(T), true, {g.S, g.B}, {g.x, g.y});
  return coll::run<T, coll::ALL_TO_ALL>(g, ws_bytes, vec, stream, device);
}

}  // namespace pk::all_to_all
