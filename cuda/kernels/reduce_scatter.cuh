/*
 * reduce_scatter: rank r gets slice r (along one axis) of the sum over ranks of x
 * (reference: lax.psum_scatter(..., tiled=True)).
 *
 * Shardings: x: [A, P, C] per rank (A = prod of x.shape before the scatter dimension, the
 * dimension split into P slices of C elements each, trailing dimensions folded into C),
 * y: [A, C], y_r[a, :] = sum_p x_p[a, r, :].
 *
 * Schedule (P2P engine, pk/collective.cuh; f in [0, A C) indexes y, chunk [lo, hi)):
 *
 *     step      rank r
 *     stage     ws_r[d][f - lo] <- x_r[a, d, j], f = a C + j, every d   (local transpose)
 *     barrier   ready[b][*] = q+1 on every peer
 *     pull      y_r[f] <- sum_p ws_p[r][f - lo]          (bulk loads, fp32 registers)
 *     signal    done[b][r] = q+1 on every peer
 *
 * Signal protocol: as all_reduce one-shot. Traffic per rank: (P - 1) n / P loaded over NVLink,
 * the minimum for a reduce-scatter.
 *
 * Pitfalls: staging groups slice d of every row a together, so a peer's slice for me is
 * contiguous in its workspace; the bulk-copy path needs C * itemsize % 16 == 0. Sums are fp32 in
 * rank order (bit-identical across ranks, may differ from XLA in the last bit for bf16/fp16).
 */
#pragma once

#include "pk/collective.cuh"

namespace pk::reduce_scatter {

struct config {
  static constexpr int THREADS = coll::THREADS;
};

/** @brief `g` needs the communicator fields, x, y, rank_ptr and n; `run_c` is C above. */
template <typename T>
inline coll::launch_status launch(coll::globals g, int64_t run_c, uint64_t ws_bytes,
                                  cudaStream_t stream, int device) {
  g.L = g.n_out = g.n / g.world;
  g.S = run_c > 0 ? run_c : 1;
  g.B = g.L > 0 ? g.L : 1;
  const int vec = coll::vec_bytes_for(sizeof(T), false, {g.S}, {g.x, g.y});
  return coll::run<T, coll::SCATTER_SUM>(g, ws_bytes, vec, stream, device);
}

}  // namespace pk::reduce_scatter
