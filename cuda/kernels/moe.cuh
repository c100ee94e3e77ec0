/*
 * moe: expert-parallel token dispatch and combine across P ranks (pk.moe_dispatch,
 * pk.moe_combine; references in pk_jax/ops/moe.py, whose docstring defines the row order).
 *
 * Shardings (per rank r, P ranks, E experts, EL = E / P local experts, k slots per token):
 *   x [T, H], ids [T, k] int32        -> tokens [C, H] in r's rows, grouped by local expert
 *   y [C, H'], weights [T, k] (fp32)  -> out [T, H'] = sum_j w[t, j] y_{dest(t,j)}[pos(t,j)]
 * Rank d owns experts [d EL, (d+1) EL). Within expert e the rows are ordered by (source rank
 * s, token t, slot j); expert e of rank d starts at off[e] = sum of the totals of d's experts
 * before e, so (s, t, j) lands at
 *   pos = off[e] + sum_{s' < s} count[s'][e] + (index of (t, j) among s's slots of e),
 * kept when pos < C (dropped and counted otherwise; nothing is ever written at or past C).
 *
 * Kernels of one dispatch (one stream, in this order; "all" = every rank's kernels):
 *
 *     kernel      grid               rank r
 *     route       1 block            epoch e = ++EPOCH_D; count_r[e'] for every expert e';
 *                                    publish them to every peer's COUNTS[r][e'] as (e << 32 |
 *                                    count); wait all P x E counts; group sizes, then every
 *                                    slot's position and the handle (XLA outputs, each
 *                                    written once, after the wait)
 *     push        G_push (from T)    row x[t] -> ws_{dest}[pos] for every kept (t, j) (16-byte
 *                                    vector stores into the peer's mapping); then PUSHED[r][b]
 *                                    = e on every peer
 *     receive     G_recv (from C H)  wait PUSHED[s][b] >= e for every s, b < G_push; tokens =
 *                                    ws_r rows [0, n_kept), zeros after
 * The transpose of the combine (scatter mode) replaces route by `enter` (epoch and a barrier on
 * ENTER_D) and pushes one row per (t, j) with the handle's positions.
 *
 * Kernels of one combine (pull: the handle holds no inverse map row -> (s, t, j), so the
 * tokens' ranks read the rows they need instead of the experts' ranks pushing them):
 *
 *     enter       1 block            epoch e = ++EPOCH_C; ENTER_C[r] = e on every peer; wait all
 *     stage       G_stage (from C H) ws_r rows = y; STAGED[r][b] = e on every peer
 *     pull        G_pull (from T)    wait STAGED[s][b] >= e for all s, b; out[t] = sum_j w y
 *                                    (peer 16-byte loads, fp32 in registers); DONE[r][b] = e
 *     leave       1 block            wait DONE[s][b] >= e for all s, b < G_pull (no peer reads
 *                                    ws_r any more)
 * Gather mode (the combine's VJP) writes the k rows of each token unsummed: out [T, k, H'].
 *
 * Signal protocol. Slots SLOT_BASE.. of the pad (after the fused GEMMs' ranges, pk/tp.cuh);
 * every slot has one writer (rank, block) and only grows (red.release.sys.max); waits are
 * `>=` with the communicator's timeout and write the error record naming the missing peer.
 * Epochs are per op (EPOCH_D, EPOCH_C), raised by the first kernel of each call; all ranks run
 * the same calls, and every launcher check that can refuse a call depends on shapes only, so
 * epochs agree. COUNTS carry their data in the low 32 bits under the epoch.
 *
 * Workspace. Rows live at offset 0 of the symmetric workspace ([C, row_bytes]). Nobody writes
 * a peer's workspace before every peer has entered the call (the count exchange or ENTER is a
 * barrier: a peer that signalled has finished its previous kernels, so nothing of an earlier
 * op still reads any workspace), and each op returns only when nobody accesses this rank's
 * workspace any more (receive waits for every push; leave waits for every pull).
 *
 * NOTES: a late rank (tests/gpu/test_emulator.py::test_a_late_rank, rank 2 of 4 starting 200 ms
 * late) stretches every other rank's route kernel to 200 ms: it waits in the count exchange for
 * the late rank. The route kernel used to write each slot's local index into the `pos` output
 * before that wait and read it back after, to add the expert's start: an XLA output used as
 * scratch across a wait as long as the latest peer. Anything else that writes `pos` in that
 * window corrupts the positions, and the push then sends this rank's rows to wrong rows (or
 * drops them). The emulator did exactly that: its poison fills (cuMemsetD8 on the primary
 * context's legacy stream) are not ordered with the ranks' non-blocking green-context streams,
 * and the last rank's fills, which no later synchronous copy waits for, could land while the
 * kernels ran; with a 200 ms window they did: rank 0's tokens missed exactly rank 3's rows
 * (every nonzero element of them; the case is reproducible from the test's seed; the run:
 * bench/results/moe_notes.md, "Measurements moved from code comments (issue 37)"). Now every
 * output is written once, after the exchange (pass 2 runs after the wait; it no longer overlaps
 * the counts' flight, a few microseconds at T k = 32k), and the emulator orders its fills
 * (pk_jax.testing.DeviceBuffer). No cross-rank signal was at fault: counts are epoch-tagged,
 * every push waits for every rank's counts (an entry barrier), receive waits for every block of
 * every peer.
 *
 * Pitfalls: grids that pair across ranks (G_push, G_stage, G_pull: a receiver waits for every
 * block index of every peer) come from the problem's sizes only, never from the SM count or
 * pointer alignment (the vector unit may differ between ranks, the grids may not). No kernel
 * waits for a block of its own grid, so no residency is assumed. Peer data is read with ld.cg
 * (L1 is not coherent with the peers' stores). Rows move by generic-proxy vector loads and
 * stores only (the widest of 16/8/4/2 bytes dividing the row and the pointers), so the signals
 * need no proxy fences; a bulk-copy (cp.async.bulk) path would need fence.proxy.async before
 * the copies read generic writes and after they land, before the release.
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "pk/comm_ops.cuh"
#include "pk/sync.cuh"
#include "op_table.h"

#include <type_traits>

namespace pk::moe {

constexpr int MAX_PEERS = 16;
constexpr int MAX_BLOCKS = 64;       // of the grids that pair across ranks
constexpr int THREADS = 512;
constexpr int WARPS = THREADS / WARP_THREADS;
constexpr int MAX_EXPERTS = 1024;    // E (route kernel's shared memory)
constexpr int MAX_K = 32;            // slots per token (one lane each)

// Signal pad: SLOT_BASE + these offsets (the host passes pads already offset).
constexpr uint64_t SLOT_BASE = pk_ffi::op_table::kMoeSlots.base;  // after the fused GEMMs
constexpr uint64_t OP_SLOTS = 8192;
constexpr uint64_t SLOTS_NEEDED = SLOT_BASE + OP_SLOTS;
constexpr uint64_t EPOCH_D = 0;      // local: dispatch calls (and scatters) so far
constexpr uint64_t EPOCH_C = 1;      // local: combine calls so far
// Local slots 2 and 3 are moe_gemm_combine's (GC_TARGET, GC_ROWS).
constexpr uint64_t TILES = 4;        // local: moe_dispatch_gemm's next tile id (route zeroes it)
constexpr uint64_t ENTER_D = 32;     // [s]: the scatter's entry barrier
constexpr uint64_t ENTER_C = 48;     // [s]: the combine's entry barrier
constexpr uint64_t PUSHED = 64;      // [s][b]: block b of rank s pushed its rows
constexpr uint64_t STAGED = PUSHED + MAX_PEERS * MAX_BLOCKS;  // [s][b]: y staged
constexpr uint64_t DONE = STAGED + MAX_PEERS * MAX_BLOCKS;    // [s][b]: pulls finished
constexpr uint64_t COUNTS = DONE + MAX_PEERS * MAX_BLOCKS;    // [s][e]: (epoch << 32) | count
constexpr uint64_t MAX_COUNTS = OP_SLOTS - COUNTS;            // P x E at most
// moe_dispatch_gemm (kernels/moe_dispatch_gemm.cuh) splits the count range: COUNTS, then
// ARRIVED[s][e] (rank s pushed all its rows of expert e), P x E at most each.
constexpr uint64_t MAX_FUSED_COUNTS = MAX_COUNTS / 2;
constexpr uint64_t ARRIVED = COUNTS + MAX_FUSED_COUNTS;

/** @brief The communicator as the kernels see it (pads offset to SLOT_BASE). */
struct comm {
  void* ws[MAX_PEERS];
  uint64_t* sig[MAX_PEERS];
  int32_t* error;
  uint64_t timeout_ns;
  int32_t world, rank, op;
  const int32_t* rank_ptr;
  link_throttle link;  ///< the rank emulator's link cap (pk/link.cuh; off in production)

  __device__ fail_ctx fail() const { return fail_ctx{error, op, rank}; }
  /**
   * @brief Link throttle (emulator only): bytes of the kept rows this thread's share of the
   * block's items moved to or from other ranks: items it = blockIdx.x * WARPS + warp, + grid
   * stride, with `slots` (dest, pos) pairs each from it * slots (one from it when per_slot),
   * lanes over the slots. Counted after the block's pass, away from its registers.
   */
  __device__ uint64_t peer_row_bytes(const int32_t* dest, const int32_t* pos, int64_t items,
                                     int slots, bool per_slot, int64_t capacity,
                                     int64_t row_bytes) const {
    const int warp = threadIdx.x / WARP_THREADS, lane = threadIdx.x % WARP_THREADS;
    uint64_t n = 0;
    for (int64_t it = int64_t(blockIdx.x) * WARPS + warp; it < items;
         it += int64_t(gridDim.x) * WARPS) {
      for (int j = lane; j < (per_slot ? 1 : slots); j += WARP_THREADS) {
        const int64_t i = per_slot ? it : it * slots + j;
        const int32_t d = dest[i], p = pos[i];
        if (d >= 0 && d < world && d != rank && p >= 0 && p < capacity) n += uint64_t(row_bytes);
      }
    }
    return n;
  }
  __device__ uint64_t epoch(uint64_t slot) const {
    return *reinterpret_cast<volatile const uint64_t*>(sig[rank] + slot);
  }
  /**
   * @brief After the block's work: raises `slot` of every peer's pad to e, releasing the
   * block's writes and reads (bar.sync, then one thread's system fence and release).
   */
  __device__ void publish(uint64_t slot, uint64_t e) const {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      for (int p = 0; p < world; ++p) signal(sig[p] + slot, e);
    }
  }
  /** @brief The [s][b] slot of this rank's block b in a per-block row. */
  __device__ uint64_t block_slot(uint64_t row) const {
    return row + uint64_t(rank) * MAX_BLOCKS + blockIdx.x;
  }
  /** @brief Waits until slots row + s * stride + b >= e for every s < world, b < n. */
  __device__ void wait_all(uint64_t row, uint64_t stride, int n, uint64_t e) const {
    for (int i = threadIdx.x; i < world * n; i += blockDim.x) {
      const int s = i / n;
      wait(sig[rank] + row + uint64_t(s) * stride + (i - s * n), e, timeout_ns, fail(), s);
    }
    __syncthreads();
  }
};

/** @brief Dispatch (and scatter) arguments. */
struct dispatch_args {
  comm c;
  const int32_t* ids;       ///< [T k] expert ids (route)
  const void* x;            ///< [T, row] (dispatch) or [T k, row] (scatter)
  int32_t* dest;            ///< [T k] dest rank (route writes it; scatter reads it)
  int32_t* pos;             ///< [T k] row at the dest or -1 (same)
  int32_t* dropped;         ///< [1] (route)
  int32_t* recv_dropped;    ///< [1] (route)
  int32_t* group_sizes;     ///< [EL] (route writes it; scatter reads it)
  int32_t* order;           ///< [T k] or null: slots by (expert, local index) (fused op)
  int32_t* order_off;       ///< [E + 1] or null: expert e's first entry in order
  void* tokens;             ///< [C, row] XLA output
  int64_t T, capacity, row_bytes;
  int32_t k, E, EL;
  int32_t per_slot;         ///< 1: x has one row per (t, j) (scatter)
  int32_t push_grid;        ///< G_push, the same on every rank
};

/** @brief Combine (and gather) arguments. */
struct combine_args {
  comm c;
  const void* y;            ///< [C, row] this rank's expert outputs
  const float* weights;     ///< [T k] (sum mode)
  const int32_t* dest;      ///< [T k]
  const int32_t* pos;       ///< [T k]
  void* out;                ///< [T, row] (sum) or [T k, row] (gather)
  int64_t T, capacity, row_bytes;
  int32_t k;
  int32_t gather;           ///< 1: out[t, j] = the row of (t, j) (zero when dropped)
  int32_t stage_grid, pull_grid;
};

/** @brief Bytes of the route kernel's dynamic shared memory for P ranks and E experts. */
__host__ __device__ constexpr uint32_t route_smem(int P, int E) {
  return uint32_t(WARPS + 4) * E * 4 + uint32_t(P) * E * 4 + 68;
}
constexpr uint32_t ROUTE_SMEM_MAX = uint32_t(WARPS + 4) * MAX_EXPERTS * 4 + MAX_COUNTS * 4 + 68;

/** @brief Grid of the kernels that move `bytes` (the same on every rank). */
inline int bytes_grid(uint64_t bytes) {
  const uint64_t g = (bytes + 64 * 1024 - 1) / (64 * 1024);
  return g < 1 ? 1 : (g > uint64_t(MAX_BLOCKS) ? MAX_BLOCKS : static_cast<int>(g));
}

/** @brief Grid of the kernels with one warp per item (token or slot), 4 items per warp. */
inline int items_grid(int64_t items) {
  const int64_t g = (items + 4 * WARPS - 1) / (4 * WARPS);
  return g < 1 ? 1 : (g > MAX_BLOCKS ? MAX_BLOCKS : static_cast<int>(g));
}

__device__ inline uint32_t lanemask_lt() {
  uint32_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

/** @brief Waits until *slot >= floor and returns its value (bounded, as pk::wait). */
__device__ inline uint64_t wait_value(const uint64_t* slot, uint64_t floor, uint64_t timeout_ns,
                                      const fail_ctx& f, int peer) {
  wait(slot, floor, timeout_ns, f, peer);
  return ld_acquire_sys(slot);
}

/** @brief One block: checks the rank operand, starts a new epoch in `epoch_slot` and meets
 * every peer on row `row` (the scatter's and the combine's entry). */
__global__ void __launch_bounds__(WARP_THREADS) enter_kernel(const __grid_constant__ comm c,
                                                             uint64_t epoch_slot, uint64_t row) {
  __shared__ uint64_t s_e;
  if (threadIdx.x == 0) {
    const int32_t got = *c.rank_ptr;
    if (got != c.rank) fail(c.fail(), ERR_RANK_MISMATCH, got);
    const uint64_t e = c.epoch(epoch_slot) + 1;
    c.sig[c.rank][epoch_slot] = e;
    s_e = e;
  }
  __syncthreads();
  const uint64_t e = s_e;
  c.publish(row + c.rank, e);
  c.wait_all(row, 1, 1, e);
}

/**
 * @brief Routing (one block of THREADS): the local index of every slot among this rank's
 * slots of its expert, the count exchange, then positions, the handle and group sizes.
 *
 * Local index: warp w owns the contiguous slots [w n / WARPS, (w+1) n / WARPS); pass 1 counts
 * its slots per expert (lanes of one expert found with match.any, the lowest adds), an
 * exclusive scan over warps turns the counts into each warp's start; after the exchange pass 2
 * gives every slot the expert's start + start + earlier lanes of its expert and advances the
 * start. Slot order = (t, j) order.
 */
__global__ void __launch_bounds__(THREADS, 1)
    route_kernel(const __grid_constant__ dispatch_args a) {
  extern __shared__ __align__(16) int32_t sm[];
  const comm& c = a.c;
  const int E = a.E, P = c.world, me = c.rank;
  int32_t* seg = sm;                       // [WARPS][E]
  int32_t* tot = seg + WARPS * E;          // [E] all ranks' slots of e
  int32_t* before = tot + E;               // [E] slots of e on ranks < me
  int32_t* off = before + E;               // [E] first row of e at its rank
  int32_t* estart = off + E;               // [E + 1] my first slot of e in (e, index) order
  int32_t* all = estart + E + 1;           // [P][E] counts of every rank
  int32_t* misc = all + P * E;             // [0] dropped, [1] received dropped
  __shared__ uint64_t s_e;
  if (threadIdx.x == 0) {
    const int32_t got = *c.rank_ptr;
    if (got != me) fail(c.fail(), ERR_RANK_MISMATCH, got);
    const uint64_t e = c.epoch(EPOCH_D) + 1;
    c.sig[me][EPOCH_D] = e;
    c.sig[me][TILES] = 0;
    s_e = e;
    misc[0] = 0;
    misc[1] = 0;
  }
  for (int i = threadIdx.x; i < WARPS * E; i += THREADS) seg[i] = 0;
  __syncthreads();
  const uint64_t epoch = s_e;
  const int64_t n = a.T * a.k;
  const int warp = threadIdx.x / WARP_THREADS, lane = threadIdx.x % WARP_THREADS;
  const int64_t lo = n * warp / WARPS, hi = n * (warp + 1) / WARPS;
  int32_t* row = seg + warp * E;
  // Pass 1: per-warp counts. Invalid ids get a key of their own (no group, no count).
  for (int64_t b = lo; b < hi; b += WARP_THREADS) {
    const int64_t i = b + lane;
    const int e = i < hi ? a.ids[i] : -1;
    const bool ok = e >= 0 && e < E;
    const int key = ok ? e : E + lane;
    const uint32_t mask = __match_any_sync(0xffffffffu, key);
    if (ok && (__ffs(mask) - 1) == lane) row[e] += __popc(mask);
    __syncwarp();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += THREADS) {
    int32_t run = 0;
    for (int w = 0; w < WARPS; ++w) {
      const int32_t v = seg[w * E + e];
      seg[w * E + e] = run;
      run += v;
    }
    all[me * E + e] = run;
  }
  __syncthreads();
  if (a.order != nullptr && threadIdx.x == 0) {  // the fused op's (expert, index) order
    int32_t run = 0;
    for (int e = 0; e < E; ++e) {
      estart[e] = run;
      run += all[me * E + e];
    }
    estart[E] = run;
  }
  // Publish my counts to every peer, then wait for every rank's (mine through my own pad).
  for (int i = threadIdx.x; i < P * E; i += THREADS) {
    const int d = i / E, e = i - d * E;
    signal(c.sig[d] + COUNTS + uint64_t(me) * E + e,
           (epoch << 32) | uint32_t(all[me * E + e]));
  }
  for (int i = threadIdx.x; i < P * E; i += THREADS) {
    const int s = i / E;
    const uint64_t v = wait_value(c.sig[me] + COUNTS + i, epoch << 32, c.timeout_ns, c.fail(), s);
    if (s != me) all[i] = static_cast<int32_t>(v & 0xffffffffu);  // mine: already there
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += THREADS) {
    int32_t t = 0, b = 0;
    for (int s = 0; s < P; ++s) {
      const int32_t v = all[s * E + e];
      t += v;
      if (s < me) b += v;
    }
    tot[e] = t;
    before[e] = b;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < P; d += THREADS) {
    int32_t run = 0;
    for (int le = 0; le < a.EL; ++le) {
      off[d * a.EL + le] = run;
      run += tot[d * a.EL + le];
    }
  }
  __syncthreads();
  for (int le = threadIdx.x; le < a.EL; le += THREADS) {
    const int e = me * a.EL + le;
    const int64_t room = a.capacity - off[e];
    const int32_t kept = room <= 0 ? 0 : (room < tot[e] ? static_cast<int32_t>(room) : tot[e]);
    a.group_sizes[le] = kept;
    if (tot[e] > kept) atomicAdd(&misc[1], tot[e] - kept);
  }
  // Pass 2: every slot's position = the expert's start on its rank + the slots of earlier
  // ranks + its local index (the warp's start plus earlier lanes of its expert). dest and pos
  // are written once, here, after the exchange (NOTES in the file comment: never as scratch
  // across the wait).
  int32_t mine_dropped = 0;
  for (int64_t b = lo; b < hi; b += WARP_THREADS) {
    const int64_t i = b + lane;
    const int e = i < hi ? a.ids[i] : -1;
    const bool ok = e >= 0 && e < E;
    const int key = ok ? e : E + lane;
    const uint32_t mask = __match_any_sync(0xffffffffu, key);
    const int32_t start = ok ? row[e] : 0;
    __syncwarp();
    if (ok) {
      const int32_t local = start + __popc(mask & lanemask_lt());
      const int64_t p = int64_t(off[e]) + before[e] + local;
      if (a.order != nullptr) a.order[estart[e] + local] = static_cast<int32_t>(i);
      const bool kept = p < a.capacity;
      a.dest[i] = e / a.EL;
      a.pos[i] = kept ? static_cast<int32_t>(p) : -1;
      mine_dropped += kept ? 0 : 1;
      if ((__ffs(mask) - 1) == lane) row[e] = start + __popc(mask);
    } else if (i < hi) {  // outside [0, E): no rank, dropped
      a.dest[i] = -1;
      a.pos[i] = -1;
      ++mine_dropped;
    }
    __syncwarp();
  }
  if (mine_dropped) atomicAdd(&misc[0], mine_dropped);
  if (a.order_off != nullptr) {
    for (int e = threadIdx.x; e <= E; e += THREADS) a.order_off[e] = estart[e];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    a.dropped[0] = misc[0];
    a.recv_dropped[0] = misc[1];
  }
}

/**
 * @brief Push: warp per item (a token, or a (t, j) slot in scatter mode); its row is loaded
 * once (UNROLL units of U per lane in flight) and stored into the workspace of every kept
 * slot's rank at the slot's row. Then PUSHED[r][b] on every peer.
 */
template <typename U>
__global__ void __launch_bounds__(THREADS) push_kernel(const __grid_constant__ dispatch_args a) {
  constexpr int UNROLL = 4;
  // NOTES: 2-byte units are held as 32-bit registers (a ushort array went to the stack).
  using R = std::conditional_t<(sizeof(U) < 4), uint32_t, U>;
  __shared__ int32_t s_dest[WARPS][MAX_K];
  __shared__ int32_t s_pos[WARPS][MAX_K];
  const comm& c = a.c;
  const uint64_t epoch = c.epoch(EPOCH_D);
  const int warp = threadIdx.x / WARP_THREADS, lane = threadIdx.x % WARP_THREADS;
  const int slots = a.per_slot ? 1 : a.k;
  const int64_t items = a.per_slot ? a.T * a.k : a.T;
  const int64_t units = a.row_bytes / int64_t(sizeof(U));
  const int64_t stride = int64_t(gridDim.x) * WARPS;
  for (int64_t it = int64_t(blockIdx.x) * WARPS + warp; it < items; it += stride) {
    const int64_t first = a.per_slot ? it : it * a.k;
    if (lane < slots) {
      s_dest[warp][lane] = a.dest[first + lane];
      s_pos[warp][lane] = a.pos[first + lane];
    }
    __syncwarp();
    const U* src = reinterpret_cast<const U*>(static_cast<const char*>(a.x) + it * a.row_bytes);
    for (int64_t u0 = lane; u0 < units; u0 += UNROLL * WARP_THREADS) {
      R v[UNROLL];
#pragma unroll
      for (int q = 0; q < UNROLL; ++q) {
        const int64_t u = u0 + q * WARP_THREADS;
        v[q] = u < units ? R(src[u]) : R{};
      }
      for (int j = 0; j < slots; ++j) {
        const int32_t p = s_pos[warp][j];
        const int32_t d = s_dest[warp][j];
        if (p < 0 || p >= a.capacity || d < 0 || d >= c.world) continue;
        U* dst = reinterpret_cast<U*>(static_cast<char*>(c.ws[d]) + int64_t(p) * a.row_bytes);
#pragma unroll
        for (int q = 0; q < UNROLL; ++q) {
          const int64_t u = u0 + q * WARP_THREADS;
          if (u < units) dst[u] = U(v[q]);
        }
      }
    }
    __syncwarp();
  }
  if (c.link.on()) {
    c.link.pace_block_sum(
        c.peer_row_bytes(a.dest, a.pos, items, a.k, a.per_slot, a.capacity, a.row_bytes));
  }
  c.publish(c.block_slot(PUSHED), epoch);
}

/**
 * @brief Receive: waits for every block of every peer's push, then tokens = this rank's
 * workspace rows [0, n_kept) (n_kept = sum of the group sizes) and zeros after.
 */
template <typename U>
__global__ void __launch_bounds__(THREADS) receive_kernel(const __grid_constant__ dispatch_args a) {
  const comm& c = a.c;
  const uint64_t epoch = c.epoch(EPOCH_D);
  __shared__ int64_t s_kept;
  if (threadIdx.x < WARP_THREADS) {
    int64_t sum = 0;
    for (int le = threadIdx.x; le < a.EL; le += WARP_THREADS) sum += a.group_sizes[le];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (threadIdx.x == 0) s_kept = sum < a.capacity ? sum : a.capacity;
  }
  c.wait_all(PUSHED, MAX_BLOCKS, a.push_grid, epoch);
  const int64_t units = a.row_bytes / int64_t(sizeof(U));
  const int64_t total = a.capacity * units, kept = s_kept * units;
  const U* src = static_cast<const U*>(c.ws[c.rank]);
  U* out = static_cast<U*>(a.tokens);
  const U zero{};
  for (int64_t i = int64_t(blockIdx.x) * THREADS + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * THREADS) {
    out[i] = i < kept ? __ldcg(src + i) : zero;
  }
}

/** @brief Stage: this rank's workspace rows = y, then STAGED[r][b] on every peer. */
template <typename U>
__global__ void __launch_bounds__(THREADS) stage_kernel(const __grid_constant__ combine_args a) {
  const comm& c = a.c;
  const uint64_t epoch = c.epoch(EPOCH_C);
  const int64_t total = a.capacity * (a.row_bytes / int64_t(sizeof(U)));
  const U* y = static_cast<const U*>(a.y);
  U* mine = static_cast<U*>(c.ws[c.rank]);
  for (int64_t i = int64_t(blockIdx.x) * THREADS + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * THREADS) {
    mine[i] = y[i];
  }
  c.publish(c.block_slot(STAGED), epoch);
}

/**
 * @brief Pull: waits for every peer's stage, then warp per token: for each 16-byte (U) unit
 * of the row, the k slots' units are loaded from their ranks' workspaces and summed with their
 * weights in fp32 (sum), or written out one by one (gather). Then DONE[r][b] on every peer.
 */
template <typename T, typename U>
__global__ void __launch_bounds__(THREADS) pull_kernel(const __grid_constant__ combine_args a) {
  constexpr int VE = sizeof(U) / sizeof(T);
  constexpr int PULL = 4;
  __shared__ int32_t s_dest[WARPS][MAX_K];
  __shared__ int32_t s_pos[WARPS][MAX_K];
  __shared__ float s_w[WARPS][MAX_K];
  const comm& c = a.c;
  const uint64_t epoch = c.epoch(EPOCH_C);
  c.wait_all(STAGED, MAX_BLOCKS, a.stage_grid, epoch);
  const int warp = threadIdx.x / WARP_THREADS, lane = threadIdx.x % WARP_THREADS;
  const int64_t units = a.row_bytes / int64_t(sizeof(U));
  const int k = a.k;
  const int64_t stride = int64_t(gridDim.x) * WARPS;
  for (int64_t t = int64_t(blockIdx.x) * WARPS + warp; t < a.T; t += stride) {
    if (lane < k) {
      const int32_t d = a.dest[t * k + lane], p = a.pos[t * k + lane];
      const bool ok = p >= 0 && p < a.capacity && d >= 0 && d < c.world;
      s_dest[warp][lane] = ok ? d : -1;
      s_pos[warp][lane] = ok ? p : -1;
      s_w[warp][lane] = a.gather ? 1.f : a.weights[t * k + lane];
    }
    __syncwarp();
    for (int64_t u = lane; u < units; u += WARP_THREADS) {
      if (a.gather) {
        U* out = static_cast<U*>(a.out) + (t * k) * units + u;
        for (int j = 0; j < k; ++j) {
          const int32_t d = s_dest[warp][j];
          U v{};
          if (d >= 0) {
            v = __ldcg(reinterpret_cast<const U*>(static_cast<const char*>(c.ws[d]) +
                                                  int64_t(s_pos[warp][j]) * a.row_bytes) + u);
          }
          out[j * units] = v;
        }
        continue;
      }
      float acc[VE];
#pragma unroll
      for (int e = 0; e < VE; ++e) acc[e] = 0.f;
      // PULL slots' loads in flight before their adds; a dropped slot (or one past k) is
      // never read and adds w 0 = 0.
      for (int j0 = 0; j0 < k; j0 += PULL) {
        U v[PULL];
        float w[PULL];
#pragma unroll
        for (int q = 0; q < PULL; ++q) {
          const int j = j0 + q;
          const int32_t d = j < k ? s_dest[warp][j] : -1;
          v[q] = U{};
          w[q] = 0.f;
          if (d >= 0) {
            v[q] = __ldcg(reinterpret_cast<const U*>(static_cast<const char*>(c.ws[d]) +
                                                     int64_t(s_pos[warp][j]) * a.row_bytes) + u);
            w[q] = s_w[warp][j];
          }
        }
#pragma unroll
        for (int q = 0; q < PULL; ++q) {
          const T* x = reinterpret_cast<const T*>(&v[q]);
#pragma unroll
          for (int e = 0; e < VE; ++e) acc[e] += w[q] * static_cast<float>(x[e]);
        }
      }
      U o;
      T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int e = 0; e < VE; ++e) oe[e] = static_cast<T>(acc[e]);
      static_cast<U*>(a.out)[t * units + u] = o;
    }
    __syncwarp();
  }
  if (c.link.on()) {
    c.link.pace_block_sum(c.peer_row_bytes(a.dest, a.pos, a.T, k, false, a.capacity, a.row_bytes));
  }
  c.publish(c.block_slot(DONE), epoch);
}

/** @brief Leave (one block): waits until every peer finished pulling from this workspace. */
__global__ void __launch_bounds__(THREADS) leave_kernel(const __grid_constant__ combine_args a) {
  const comm& c = a.c;
  c.wait_all(DONE, MAX_BLOCKS, a.pull_grid, c.epoch(EPOCH_C));
}

}  // namespace pk::moe
