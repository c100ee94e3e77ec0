/*
 * moe_dispatch_gemm: expert-parallel dispatch fused with every local expert's first GEMM
 * (pk.moe_dispatch_gemm; reference: moe_dispatch then grouped_matmul, pk_jax/ops/moe.py).
 * Exact on the H200 in the rank emulator (tests/gpu/test_emulator_moe_fused.py) and through
 * JAX (tests/gpu/moe_fused_mp.py). pk.moe_dispatch_gemm runs it where the one decider
 * (pk_jax/cost_model.py, choose) picks it for the shape, or with PK_JAX_MOE_FUSED=1, and
 * composes the two ops otherwise (measured: bench/results/overlap.md, moe_notes.md).
 *
 * Per rank r (P ranks, E experts, EL = E / P local experts, k slots per token):
 *   x [T, H], ids [T, k] int32, w1 [EL, H, N]  ->  h [C, N] = grouped GEMM of the rows r's
 *   experts received (the rows moe_dispatch would return, in its order), group sizes [EL],
 *   the handle (dest, pos [T, k], dropped, recv_dropped).
 *
 * Kernels (one stream, in this order):
 *
 *     kernel      grid                       rank r
 *     route       1 block                    moe.cuh's route (count exchange, positions,
 *                                            group sizes) plus `order`: r's slots sorted by
 *                                            (expert, local index), and order_off [E + 1]
 *     fused       G_comm + G_gemm blocks     comm blocks b < G_comm: for n = b, b + G_comm,
 *                                            ... < E, expert e = d EL + j with j = n / P and
 *                                            d = (r + n) % P: push r's kept rows of e into
 *                                            ws_d at their positions (16-byte vector
 *                                            stores), then ARRIVED[r][e] = epoch on d's
 *                                            pad (each warp: system fence, a count in
 *                                            shared memory; the expert's last warp: fence,
 *                                            release);
 *                                            every block (the comm blocks once their pushes
 *                                            are done): grouped_matmul.cuh's (group, tile)
 *                                            GEMM over A = ws_r [C, H] (TMA), tile ids
 *                                            claimed in increasing order from TILES (local
 *                                            pad, zeroed by route); the loader waits
 *                                            ARRIVED[s][e] >= epoch for every s before the
 *                                            first load of a tile of local expert e, then
 *                                            fence.proxy.async
 *
 * The GEMM of expert e starts as soon as every rank has pushed its rows of e, while the
 * comm blocks still push the later experts. Every rank pushes local expert j of every
 * destination before local expert j + 1 (destinations rotated by the source's rank, so the
 * ranks push to different destinations at a time), and each rank's blocks claim its local
 * experts' tiles in increasing order too. (Pushed in global expert order, rank P - 1's first
 * rows arrived only after every rank had pushed to ranks 0..P-2, so its GEMM started near the
 * end of the exchange.) Dispatch is a few percent of the serial time at some shapes, so the
 * comm SMs join the GEMM instead of idling once they have pushed.
 *
 * Signals: ARRIVED[s][e] (moe.cuh's slot map: the count range's second half) has one writer,
 * comm block n % G_comm of rank s, where n is e's place in s's push order; G_comm may differ
 * between ranks (nobody waits for a block index). Epoch: the route kernel's EPOCH_D (shared
 * with moe_dispatch: the two ops count calls together, every rank makes the same calls).
 * ARRIVED carries epoch << 32, as COUNTS do, because a plain moe_dispatch with P x E above
 * MAX_FUSED_COUNTS writes its counts into these slots: (e << 32 | count) of an earlier epoch
 * stays below a later (e' << 32), and a later count exchange's values stay above an earlier
 * ARRIVED.
 *
 * Workspace. Peers write ws_r only after every rank published its counts for this call (the
 * exchange is the entry barrier, as in moe_dispatch). When the kernel ends no peer writes
 * ws_r any more: every expert with kept rows has at least one tile, whose loader waited for
 * every source's ARRIVED; an expert without kept rows receives no row.
 *
 * Pitfalls: a tile's A box may cover rows of the next expert, still being pushed (or stale
 * rows past the kept ones): those output rows are never stored (grouped_matmul stores stay
 * inside the group), so the race is harmless. Comm blocks come first in the grid, so they
 * are resident before any compute block spins. Rows move by generic 16-byte stores (row
 * bytes, x and the workspace 16-byte aligned: H % 8 == 0, checked on the host), released by
 * the system fences before the signal (each warp's before its count, the last warp's after
 * reading the count); the loader orders its acquire before the async-proxy
 * TMA reads with fence.proxy.async (as ag_gemm's loader). Peer data is read by TMA only
 * (no L1).
 */
#pragma once

#include "kernels/grouped_matmul.cuh"
#include "kernels/moe.cuh"

namespace pk::moe {

/** @brief The fused kernel's dispatch half (the GEMM half is grouped_matmul::globals). */
struct fused_args {
  comm c;
  const void* x;             ///< [T, row] tokens
  const int32_t* dest;       ///< [T k] (route)
  const int32_t* pos;        ///< [T k] (route)
  const int32_t* order;      ///< [T k] (route)
  const int32_t* order_off;  ///< [E + 1] (route)
  int64_t capacity, row_bytes;
  int32_t k, E, EL;
  int32_t comm_blocks;       ///< G_comm
};

/** @brief Comm block b: pushes this rank's kept rows of the experts of n = b, b + G_comm, ...
 * (local expert n / P of destination (rank + n) % P; one writer per ARRIVED slot). `done`:
 * shared memory for MAX_EXPERTS counters (the GEMM's, free until the block joins it). */
template <int THREADS_>
__device__ inline void push_experts(const fused_args& f, int* done) {
  constexpr int NW = THREADS_ / WARP_THREADS;
  constexpr int PUSH_UNROLL = 8;  // 16-byte loads in flight per lane
  const comm& c = f.c;
  const uint64_t epoch = c.epoch(EPOCH_D);
  const int warp = threadIdx.x / WARP_THREADS, lane = threadIdx.x % WARP_THREADS;
  const int64_t units = f.row_bytes / 16;
  for (int i = threadIdx.x; i < MAX_EXPERTS; i += THREADS_) done[i] = 0;
  __syncthreads();
  int it = 0;  // this block's expert count so far
  for (int n = blockIdx.x; n < f.E; n += f.comm_blocks, ++it) {
    const int d = (c.rank + n) % c.world;
    const int e = d * f.EL + n / c.world;
    const int lo = f.order_off[e], hi = f.order_off[e + 1];
    char* dst_ws = static_cast<char*>(c.ws[d]);
    // NOTES: the copy is bound by loads in flight, not by bandwidth. A lane first looks up
    // the rows of 32 of the warp's slots at once (one round trip, not two per row); then every
    // load of a chunk is issued before its stores (a plain copy loop kept one 16-byte load in
    // flight per lane, as the stores may alias the source: about 6 KB per SM).
    int64_t pushed = 0;  // rows this warp stored into a peer's workspace (the link throttle)
    for (int q0 = lo + warp; q0 < hi; q0 += NW * WARP_THREADS) {
      const int q = q0 + lane * NW;
      int32_t src_row = -1, dst_row = -1;
      if (q < hi) {
        const int32_t i = f.order[q];
        const int32_t p = f.pos[i];
        if (p >= 0 && p < f.capacity) src_row = i / f.k, dst_row = p;  // else dropped
      }
      const int rows = min(WARP_THREADS, (hi - q0 + NW - 1) / NW);
      for (int j = 0; j < rows; ++j) {
        const int32_t sr = __shfl_sync(0xffffffffu, src_row, j);
        const int32_t dr = __shfl_sync(0xffffffffu, dst_row, j);
        if (dr < 0) continue;  // uniform over the warp
        pushed += d != c.rank;
        const uint4* src =
            reinterpret_cast<const uint4*>(static_cast<const char*>(f.x) + sr * f.row_bytes);
        uint4* dst = reinterpret_cast<uint4*>(dst_ws + int64_t(dr) * f.row_bytes);
        for (int64_t u0 = lane; u0 < units; u0 += PUSH_UNROLL * WARP_THREADS) {
          uint4 v[PUSH_UNROLL];
#pragma unroll
          for (int u = 0; u < PUSH_UNROLL; ++u) {
            if (u0 + u * WARP_THREADS < units) v[u] = src[u0 + u * WARP_THREADS];
          }
#pragma unroll
          for (int u = 0; u < PUSH_UNROLL; ++u) {
            if (u0 + u * WARP_THREADS < units) dst[u0 + u * WARP_THREADS] = v[u];
          }
        }
      }
    }
    // NOTES: the warps do not wait for each other between experts. Each fences its own rows
    // and counts itself in; the last one of an expert signals it. (A block barrier and one
    // fence per expert held every warp until the slowest warp's rows had landed.)
    __syncwarp();
    if (lane == 0) {
      // The emulator's link throttle (pk/link.cuh; off in production): the rows cross the
      // link before the count that releases them.
      if (c.link.on() && pushed > 0) c.link.drain(c.link.issue(uint64_t(pushed) * f.row_bytes));
      __threadfence_system();  // this warp's rows, then its count: a release
      if (atomicAdd(&done[it], 1) == NW - 1) {
        __threadfence_system();  // the count read, then this fence: the other warps' rows
        signal(c.sig[d] + ARRIVED + uint64_t(c.rank) * f.E + e, epoch << 32);
      }
    }
  }
  __syncthreads();  // `done` goes back to the GEMM
}

/**
 * @brief The fused launch: comm blocks first, then grouped_matmul's persistent loop (FWD)
 * with the arrival wait in the loader. Every block's loader claims tile ids in increasing
 * order from the TILES counter (local pad, zeroed by the route kernel) and writes each into
 * `tile_of`[stage] of the tile's first stage; its consumers read it there, and id -1 (a stage
 * with no loads) ends them. The comm blocks claim tiles too once their pushes are done.
 */
template <class K>
__global__ void __launch_bounds__(K::THREADS, 1)
    dispatch_gemm_kernel(const __grid_constant__ grouped_matmul::globals g,
                         const __grid_constant__ fused_args f) {
  static_assert(K::MODE == grouped_matmul::FWD, "moe_dispatch_gemm: the forward GEMM only");
  using shared_storage = typename K::shared_storage;
  static_assert(sizeof(shared_storage) >= MAX_EXPERTS * sizeof(int),
                "moe_dispatch_gemm: the push's counters live in the GEMM's shared memory");
  extern __shared__ unsigned char smem_raw[];
  auto& s = *reinterpret_cast<shared_storage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const bool comm_block = static_cast<int>(blockIdx.x) < f.comm_blocks;
  if (comm_block) push_experts<K::THREADS>(f, reinterpret_cast<int*>(&s));
  __shared__ int tile_of[K::STAGES];
  const comm& c = f.c;
  if (threadIdx.x == 0) {
    // NOTES: twice the signal bound, so that a missing peer is named by the loader's signal
    // wait, not by a consumer's mbarrier wait on the loads that never start.
    K::init_ring(g, s, wait_bound{c.error, c.op, c.rank, 2 * c.timeout_ns});
    tma::prefetch(&g.out);
  }
  if (threadIdx.x < 32) K::scan_groups(g, s);
  __syncthreads();

  const int num_tiles = K::num_tiles(g, s);
  const int wg = warpgroup::index();

  if (wg == 0) {
    warpgroup::decrease_registers<40>();
    if (warpgroup::thread() != 0) return;
    const uint64_t epoch = c.epoch(EPOCH_D);
    auto* next_tile = reinterpret_cast<unsigned long long*>(c.sig[c.rank] + TILES);
    pipeline_state<K::STAGES> pipe;
    int ready = -1;  // the last expert whose arrivals this loader has seen
    for (;;) {
      const int id = static_cast<int>(atomicAdd(next_tile, 1ull));
      if (id >= num_tiles) break;
      const grouped_matmul::work w = K::tile(g, s, id);
      if (w.e != ready) {
        const uint64_t e = uint64_t(c.rank) * f.EL + w.e;
        for (int src = 0; src < c.world; ++src) {
          wait(c.sig[c.rank] + ARRIVED + uint64_t(src) * f.E + e, epoch << 32, c.timeout_ns,
               c.fail(), src);
        }
        fence_proxy_async_global();
        ready = w.e;
      }
      K::template produce<true>(g, s, w, pipe, tile_of, id);
    }
    mbar_wait(&s.empty[pipe.stage], pipe.phase ^ 1);
    tile_of[pipe.stage] = -1;
    mbar_arrive(&s.full[pipe.stage]);
    return;
  }

  warpgroup::increase_registers<232>();
  const int cw = wg - 1;
  const bool leader = warpgroup::thread() == 0;
  const lcsc::storer_sync sync{1 + cw, leader};
  pipeline_state<K::STAGES> pipe;
  for (;;) {
    mbar_wait(&s.full[pipe.stage], pipe.phase);
    const int id = *static_cast<volatile int*>(&tile_of[pipe.stage]);
    if (id < 0) break;
    const grouped_matmul::work w = K::tile(g, s, id);
    typename K::acc_t acc;
    K::mainloop(acc, s, w, pipe, cw, leader);
    K::storer(g, acc, s.out[cw], cw, w, sync);
  }
  if (leader) tma::store_wait<0>();
  // Rows past the kept ones are zero (grouped_matmul's zero_tail over the compute blocks).
  const int total = s.row_off[g.groups];
  if (!comm_block && total < g.m) {
    using T = typename K::T;
    constexpr int CT = K::CONSUMERS * WARPGROUP_THREADS;
    const int bid = static_cast<int>(blockIdx.x) - f.comm_blocks;
    const int nblk = static_cast<int>(gridDim.x) - f.comm_blocks;
    const size_t chunks = static_cast<size_t>(g.m - total) * g.n / 8;
    uint4* y = reinterpret_cast<uint4*>(static_cast<T*>(g.y) + static_cast<size_t>(total) * g.n);
    for (size_t i = size_t(bid) * CT + (threadIdx.x - WARPGROUP_THREADS); i < chunks;
         i += size_t(nblk) * CT) {
      y[i] = make_uint4(0, 0, 0, 0);
    }
  }
}

/** @brief Launches the fused kernel: `comm_blocks` + `gemm_blocks` blocks, one per SM. */
template <class C>
inline cudaError_t launch_dispatch_gemm(const grouped_matmul::globals& g, const fused_args& f,
                                        cudaStream_t stream, int device, int gemm_blocks) {
  using K = grouped_matmul::kernel_def<C>;
  constexpr size_t SMEM = grouped_matmul::smem_bytes<K>();
  if (cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(&dispatch_gemm_kernel<K>),
                                    device, static_cast<int>(SMEM));
      err != cudaSuccess) {
    return err;
  }
  dispatch_gemm_kernel<K><<<f.comm_blocks + gemm_blocks, K::THREADS, SMEM, stream>>>(g, f);
  return cudaGetLastError();
}

}  // namespace pk::moe
