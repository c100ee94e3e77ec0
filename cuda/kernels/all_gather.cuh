/*
 * all_gather: y = the concatenation of every rank's x along one axis, in rank order
 * (reference: lax.all_gather(..., tiled=True)).
 *
 * Shardings: x: [A, B] per rank (A = prod of x.shape before `axis`, B = the rest, flattened),
 * y: [A, P, B], y[a, p, :] = x_p[a, :]. axis = 0 is A = 1: y is the P shards back to back.
 *
 * Schedule (P2P engine, pk/collective.cuh; chunk k of block b covers x elements [lo, hi)):
 *
 *     step      rank r
 *     stage     ws_r <- x_r[lo:hi]                              (local bulk copies)
 *     barrier   ready[b][*] = q+1 on every peer
 *     pull      y[a, p, j] <- ws_p[f - lo], f = a B + j, every p  (bulk copies from peers)
 *     signal    done[b][r] = q+1 on every peer
 *
 * Signal protocol: as all_reduce one-shot (ready, then done; a region is restaged only after
 * done[b][*] >= q - 1). Traffic per rank: (P - 1) n loaded over NVLink.
 *
 * Pitfalls: the bulk-copy path needs B * itemsize % 16 == 0 (every row of y starts aligned);
 * otherwise the widest unit dividing it is used (down to one element), so odd shapes are
 * correct but slower. Data is moved as raw bits (int32 and floats alike).
 */
#pragma once

#include "pk/collective.cuh"

namespace pk::all_gather {

struct config {
  static constexpr int THREADS = coll::THREADS;
};

/** @brief `g` needs the communicator fields, x, y, rank_ptr and n; `run_b` is B above. */
template <typename T>
inline coll::launch_status launch(coll::globals g, int64_t run_b, uint64_t ws_bytes,
                                  cudaStream_t stream, int device) {
  g.n_out = g.n * g.world;
  g.L = g.S = g.n;
  g.B = run_b > 0 ? run_b : 1;
  const int vec = coll::vec_bytes_for(sizeof(T), true, {g.B}, {g.x, g.y});
  return coll::run<T, coll::GATHER>(g, ws_bytes, vec, stream, device);
}

}  // namespace pk::all_gather
