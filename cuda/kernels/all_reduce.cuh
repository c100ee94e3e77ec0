/*
 * all_reduce: y = sum over ranks p of x_p, on every rank (reference: lax.psum).
 *
 * Shardings: x: [n] per rank (any shape, flattened), y: [n] per rank, identical everywhere.
 *
 * Two schedules on the P2P engine (pk/collective.cuh), chosen by size (overridable):
 *
 *   one-shot (small): every rank stages its chunk, then reads the same chunk from all P peers
 *   and sums in fp32 registers. Traffic per rank (P-1) n, latency one barrier.
 *
 *     step      rank 0          rank 1          ...   rank P-1
 *     stage     ws0 <- x0       ws1 <- x1             wsP-1 <- xP-1
 *     barrier   ready[b][*] = q+1 on every peer
 *     pull      y = sum_p wsp   y = sum_p wsp         y = sum_p wsp
 *
 *   two-shot (large): reduce-scatter then all-gather through the workspace. Slice s of x is
 *   elements [s L, (s + 1) L), L = ceil(n / P) rounded up to a 16-byte unit.
 *
 *     step      rank r
 *     stage     ws_r[d] <- x_r slice d (chunk), d < P           (zero past n)
 *     barrier   ready
 *     reduce    red_r <- sum_p ws_p[r]              (my slice: bulk loads, fp32 registers)
 *     barrier   ready2
 *     gather    y slice d <- red_d, every d                     (bulk copies from peers)
 *
 * Signal protocol (per block b, round q; values only grow): ready[b][r] and ready2[b][r] are
 * raised to q + 1 on every peer after staging / reducing; done[b][r] is raised to q + 1 on
 * every peer after the last read of their regions; before re-staging region parity q & 1 a rank
 * waits done[b][*] >= q - 1. Counters live in the pads, so calls and graph replays need no reset.
 *
 * Pitfalls: the sum is computed in fp32 and rounded once, so bf16/fp16 results can differ from
 * XLA's in the last bit (XLA may sum in the input type); the order of summation is rank order
 * on every rank, so all ranks hold bit-identical results. Mixing the two schedules between
 * calls is safe: both use the same per-block counters and regions.
 */
#pragma once

#include "pk/collective.cuh"

namespace pk::all_reduce {

struct config {
  static constexpr int THREADS = coll::THREADS;
  /** One-shot up to this many bytes (and always for P <= 2); two-shot above. */
  static constexpr int64_t ONESHOT_MAX_BYTES = 512 * 1024;
};

enum algo : int { AUTO = 0, ONESHOT = 1, TWOSHOT = 2 };

/** @brief The schedule actually used for `bytes` at world size `world`. */
inline int choose(int requested, int64_t bytes, int world) {
  if (requested == ONESHOT || requested == TWOSHOT) return requested;
  return (world <= 2 || bytes <= config::ONESHOT_MAX_BYTES) ? ONESHOT : TWOSHOT;
}

/** @brief `g` needs the communicator fields, x, y, rank_ptr and n. */
template <typename T>
inline coll::launch_status launch(coll::globals g, int requested, uint64_t ws_bytes,
                                  cudaStream_t stream, int device) {
  const int a = choose(requested, g.n * int64_t(sizeof(T)), g.world);
  g.n_out = g.n;
  const int vec = coll::vec_bytes_for(sizeof(T), false, {}, {g.x, g.y});
  if (a == ONESHOT) {
    g.L = g.S = g.B = g.n;
    return coll::run<T, coll::AR_ONESHOT>(g, ws_bytes, vec, stream, device);
  }
  const int64_t unit = 16 / sizeof(T);
  g.L = ceil_div<int64_t>(ceil_div<int64_t>(g.n, g.world), unit) * unit;
  g.S = g.B = g.L;
  return coll::run<T, coll::AR_TWOSHOT>(g, ws_bytes, vec, stream, device);
}

}  // namespace pk::all_reduce
