/*
 * moe_gemm_combine: every local expert's second GEMM fused with the combine
 * (pk.moe_gemm_combine; reference: grouped_matmul then moe_combine, pk_jax/ops/moe.py).
 * Exact on the H200 in the rank emulator (tests/gpu/test_emulator_moe_fused.py) and through
 * JAX (tests/gpu/moe_fused_mp.py). pk.moe_gemm_combine runs it where the one decider
 * (pk_jax/cost_model.py, choose) picks it for the shape and the workspace fits, or with
 * PK_JAX_MOE_FUSED=1, and composes grouped_matmul and moe_combine otherwise (measured:
 * bench/results/overlap.md, moe_notes.md).
 *
 * Per rank r (P ranks, EL local experts, k slots per token, T tokens, C rows):
 *   h [C, F] (the rows r's experts received, moe_dispatch's order), w2 [EL, F, H], the
 *   handle (dest, pos [T, k], group_sizes [EL]), weights [T, k] fp32
 *     ->  out [T, H], out[t] = sum_j w[t, j] y_{dest(t,j)}[pos(t,j)], y = grouped GEMM in T
 *   (the same rounding as the composition: y rounded to T, summed in fp32).
 *
 * Design: the GEMM epilogue stores to peers, the owner only waits and sums. Each output row
 * of the grouped GEMM (slot (s, t, j) of a token of rank s) goes straight into rank s's
 * symmetric workspace, at that slot's row t k + j of a [T k, H] slot buffer; then rank s sums
 * its k slot rows with the weights. The expert's rank needs the inverse of the handle (row ->
 * (s, t k + j)), which only the tokens' ranks have: each of them writes it into the experts'
 * ranks' workspaces first (8 bytes per kept slot).
 *
 *     kernel      grid                      rank r
 *     enter       1 block                   epoch e = ++EPOCH_C (shared with moe_combine);
 *                                           TARGET += (r's kept slots) x ceil(H / BN);
 *                                           ENTER_C[r] = e on every peer; wait all
 *     invert      G_inv (from T)            for every kept (t, j) of r: INV_{dest}[pos] =
 *                                           (r, t k + j) (8-byte stores into the peer's
 *                                           workspace); then STAGED[r][b] = e on every peer
 *     gemm        min(SMs, tiles)           grouped_matmul.cuh's persistent FWD loop over A = h
 *                                           (TMA, local), B = w2; epilogue of a consumer's 64
 *                                           rows x BN columns: (first time) wait STAGED[s][b]
 *                                           >= e for all s, b < G_inv; stage in smem; each
 *                                           row's BN columns -> ws_{s}[slot] (16-byte stores);
 *                                           after the consumer's last piece, per owner s
 *                                           with n_s rows stored: ROWS[s] += n_s (a system
 *                                           fence, then red.add.relaxed.sys on s's pad)
 *     sum         G_sum (from T)            wait ROWS[r] >= TARGET; warp per token: out[t] =
 *                                           sum over kept j of w[t, j] ws_r[t k + j] (fp32)
 *
 * Workspace of every rank: slot rows [T k, H] at offset 0 (T k row_bytes), then the inverse
 * map INV [C] of int2 at INV_OFF = that, rounded up to 256 bytes.
 *
 * Signals. ENTER_C and STAGED (epoch-tagged, max) are moe_combine's rows: the two ops share
 * EPOCH_C, so a slot's value is always the epoch of the latest call of either op. ROWS
 * (GC_ROWS, local pad, written by every peer) is a counter that only grows by adds; TARGET
 * (GC_TARGET, local) is how far it must have grown after this call: every kept slot of r is
 * one row on one expert rank, stored in ceil(H / BN) column pieces, each counted once. No
 * add of a later call can land before this call's sum kernel ends: a later call starts with
 * the entry barrier, which r joins only after its sum kernel.
 *
 * Workspace safety. Nobody writes a peer's workspace before every rank entered (the barrier);
 * INV_d is read by d's epilogue only after every rank's invert blocks signalled; a rank's
 * call ends (sum kernel) only after every row for it arrived, and it wrote nothing that a
 * peer still reads: the INV_d entries r wrote are d's own workspace, which r does not touch
 * again before d joins r's next entry barrier (after d's sum kernel, after d's GEMM); a rank
 * d that receives no row never reads INV_d, and r's INV stores into it finish with r's invert
 * kernel, before r can join the next entry barrier.
 *
 * Pitfalls: rows of a tile past its group are never stored (valid rows only), and rows past
 * sum(group_sizes) have no INV entry (they are never visited). A row's owner is read from
 * INV with ld.cg (peer-written). The epilogue does not use TMA stores (the destination rows of
 * one tile belong to many ranks, at scattered slots), so the only proxy fence is the
 * loader's (none needed: h is local, written by XLA before the kernel). The dead-rank path:
 * a rank that never enters stops the others in the entry barrier, which names it.
 */
#pragma once

#include "kernels/grouped_matmul.cuh"
#include "kernels/moe.cuh"

namespace pk::moe {

constexpr uint64_t GC_TARGET = 2;  // local: cumulative ROWS this rank waits for
constexpr uint64_t GC_ROWS = 3;    // local, added to by every peer: row pieces received
static_assert(GC_TARGET != TILES && GC_ROWS != TILES && GC_TARGET > EPOCH_C,
              "moe_gemm_combine's slots clash with moe.cuh's local slots");

/** @brief The fused second GEMM + combine (besides grouped_matmul::globals for the GEMM). */
struct gemm_combine_args {
  comm c;
  const float* weights;  ///< [T k]
  const int32_t* dest;   ///< [T k]
  const int32_t* pos;    ///< [T k]
  void* out;             ///< [T, H]
  int64_t T, capacity, row_bytes;  ///< row_bytes = H x 2
  int64_t inv_off;       ///< byte offset of INV in every workspace
  int32_t k;
  int32_t tiles_n;       ///< ceil(H / BN): column pieces per row
  int32_t inv_grid;      ///< G_inv, the same on every rank
};

/** @brief Adds `v` to a (peer's) counter slot; after a system fence, that is a release. */
__device__ inline void add_relaxed(uint64_t* slot, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(slot), "l"(v) : "memory");
}

/** @brief Enter (one block of THREADS): rank check, epoch, this call's TARGET, barrier. */
__global__ void __launch_bounds__(THREADS) gc_enter_kernel(const __grid_constant__
                                                           gemm_combine_args a) {
  __shared__ uint64_t s_e;
  __shared__ unsigned long long s_kept;
  const comm& c = a.c;
  if (threadIdx.x == 0) {
    const int32_t got = *c.rank_ptr;
    if (got != c.rank) fail(c.fail(), ERR_RANK_MISMATCH, got);
    s_e = c.epoch(EPOCH_C) + 1;
    s_kept = 0;
  }
  __syncthreads();
  unsigned long long mine = 0;
  for (int64_t i = threadIdx.x; i < a.T * a.k; i += THREADS) {
    const int32_t d = a.dest[i], p = a.pos[i];
    if (d >= 0 && d < c.world && p >= 0 && p < a.capacity) ++mine;
  }
  if (mine) atomicAdd(&s_kept, mine);
  __syncthreads();
  const uint64_t e = s_e;
  if (threadIdx.x == 0) {
    c.sig[c.rank][EPOCH_C] = e;
    c.sig[c.rank][GC_TARGET] = c.epoch(GC_TARGET) + uint64_t(s_kept) * uint64_t(a.tiles_n);
  }
  c.publish(ENTER_C + c.rank, e);
  c.wait_all(ENTER_C, 1, 1, e);
}

/** @brief Invert: INV_{dest}[pos] = (rank, slot) for every kept slot; then STAGED[r][b]. */
__global__ void __launch_bounds__(THREADS) gc_invert_kernel(const __grid_constant__
                                                            gemm_combine_args a) {
  const comm& c = a.c;
  const uint64_t epoch = c.epoch(EPOCH_C);
  for (int64_t i = int64_t(blockIdx.x) * THREADS + threadIdx.x; i < a.T * a.k;
       i += int64_t(gridDim.x) * THREADS) {
    const int32_t d = a.dest[i], p = a.pos[i];
    if (d < 0 || d >= c.world || p < 0 || p >= a.capacity) continue;
    int2* inv = reinterpret_cast<int2*>(static_cast<char*>(c.ws[d]) + a.inv_off);
    inv[p] = make_int2(c.rank, static_cast<int>(i));
  }
  c.publish(c.block_slot(STAGED), epoch);
}

/**
 * @brief The GEMM with the peer-storing epilogue: grouped_matmul's FWD loop (its produce_tiles
 * and consume_tiles), every finished 64-row piece sent row by row to its owners.
 */
template <class K>
__global__ void __launch_bounds__(K::THREADS, 1)
    gemm_combine_kernel(const __grid_constant__ grouped_matmul::globals g,
                        const __grid_constant__ gemm_combine_args f) {
  static_assert(K::MODE == grouped_matmul::FWD, "moe_gemm_combine: the forward GEMM only");
  using T = typename K::T;
  using shared_storage = typename K::shared_storage;
  extern __shared__ unsigned char smem_raw[];
  __shared__ int s_count[K::CONSUMERS][MAX_PEERS];
  __shared__ int2 s_owner[K::CONSUMERS][64];  // (rank, slot) of each row of the piece
  auto& s = *reinterpret_cast<shared_storage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const comm& c = f.c;
  if (threadIdx.x == 0) K::init_ring(g, s, wait_bound{c.error, c.op, c.rank, 2 * c.timeout_ns});
  if (threadIdx.x < 32) K::scan_groups(g, s);
  __syncthreads();

  const int num_tiles = K::num_tiles(g, s);
  const int wg = warpgroup::index();

  if (wg == 0) {
    warpgroup::decrease_registers<40>();
    if (warpgroup::thread() != 0) return;
    K::produce_tiles(g, s, num_tiles);
    return;
  }

  warpgroup::increase_registers<232>();
  const int cw = wg - 1;
  const int bar = 1 + cw;
  const int t = warpgroup::thread();
  const bool leader = t == 0;
  const uint64_t epoch = c.epoch(EPOCH_C);
  const int2* inv = reinterpret_cast<const int2*>(static_cast<const char*>(c.ws[c.rank]) +
                                                  f.inv_off);
  bool ready = false;  // this consumer has seen every rank's inverse map
  uint64_t link_due = 0;  // leader: when its last piece's peer rows have crossed (emulator)
  if (t < MAX_PEERS) s_count[cw][t] = 0;  // rows sent to each owner, over the whole kernel
  // The epilogue of a consumer's 64-row piece: rows [row0, row0 + valid) of the group, columns
  // col0..., each row sent to its owner's slot.
  const auto epilogue = [&](const typename K::acc_t& acc, const grouped_matmul::work& w) {
    const int row0 = w.row0 + cw * 64;
    const int valid = min(64, w.row_end - row0);
    if (valid <= 0) return;  // uniform over the warpgroup
    if (!ready) {
      for (int i = t; i < c.world * f.inv_grid; i += WARPGROUP_THREADS) {
        const int src = i / f.inv_grid;
        wait(c.sig[c.rank] + STAGED + uint64_t(src) * MAX_BLOCKS + (i - src * f.inv_grid),
             epoch, c.timeout_ns, c.fail(), src);
      }
      ready = true;
    }
    // The emulator's link throttle (pk/link.cuh; off in production): one piece in flight, as
    // the stores of a real link back up into the SM.
    if (leader) link_throttle::drain(link_due);
    warpgroup::sync(bar);  // the previous piece's reads of staging and owners are done
    K::stage_out(acc, s.out[cw]);
    // NOTES: the piece's owners are read once, into shared memory, before the stores. Read per
    // 16-byte chunk, each store waited for an L2 round trip, and the epilogue, not the GEMM,
    // set the fused time.
    if (t < valid) s_owner[cw][t] = __ldcg(inv + row0 + t);
    warpgroup::sync(bar);
    if (t < valid) atomicAdd(&s_count[cw][s_owner[cw][t].x], 1);
    const int col0 = w.nt * K::BN;
    if (leader && c.link.on()) {
      int peer_rows = 0;
      for (int r = 0; r < valid; ++r) peer_rows += s_owner[cw][r].x != c.rank;
      const int cols = min(K::BN, g.n - col0);
      link_due = c.link.issue(uint64_t(peer_rows) * cols * sizeof(T));
    }
    constexpr int CHUNKS = K::BN / 8;
    for (int i = t; i < valid * CHUNKS; i += WARPGROUP_THREADS) {
      const int r = i / CHUNKS, col = (i % CHUNKS) * 8;
      const int2 o = s_owner[cw][r];
      if (col0 + col < g.n) {
        const uint4 v = *reinterpret_cast<const uint4*>(s.out[cw].at(r, col));
        T* dst = reinterpret_cast<T*>(static_cast<char*>(c.ws[o.x]) + int64_t(o.y) * f.row_bytes);
        *reinterpret_cast<uint4*>(dst + col0 + col) = v;
      }
    }
  };
  K::consume_tiles(g, s, num_tiles, cw, leader, epilogue);
  // NOTES: the counts are sent once, when the consumer's last piece is stored. The owners'
  // sums wait for every piece anyway, and a system fence plus up to P system-scope releases
  // after every piece stalled the leader's warp, so the warpgroup's next wgmma.
  warpgroup::sync(bar);
  if (leader) {
    link_throttle::drain(link_due);  // the peer rows have crossed before the counts release them
    __threadfence_system();
    for (int p = 0; p < c.world; ++p) {
      const int n = s_count[cw][p];
      if (n > 0) add_relaxed(c.sig[p] + GC_ROWS, uint64_t(n));
    }
  }
}

/** @brief Sum: waits for every row piece of this rank, then out[t] = sum_j w ws_r[t k + j]. */
template <typename T>
__global__ void __launch_bounds__(THREADS) gc_sum_kernel(const __grid_constant__
                                                         gemm_combine_args a) {
  constexpr int VE = 16 / sizeof(T);
  __shared__ float s_w[WARPS][MAX_K];
  __shared__ bool s_ok[WARPS][MAX_K];
  const comm& c = a.c;
  if (threadIdx.x == 0) {
    // NOTES: the counter has many writers; the peer named on a timeout is this rank itself.
    wait(c.sig[c.rank] + GC_ROWS, c.epoch(GC_TARGET), c.timeout_ns, c.fail(), c.rank);
  }
  __syncthreads();
  const int warp = threadIdx.x / WARP_THREADS, lane = threadIdx.x % WARP_THREADS;
  const int64_t units = a.row_bytes / 16;
  const char* slots = static_cast<const char*>(c.ws[c.rank]);
  for (int64_t tok = int64_t(blockIdx.x) * WARPS + warp; tok < a.T;
       tok += int64_t(gridDim.x) * WARPS) {
    if (lane < a.k) {
      const int64_t i = tok * a.k + lane;
      const int32_t d = a.dest[i], p = a.pos[i];
      const bool ok = d >= 0 && d < c.world && p >= 0 && p < a.capacity;
      s_ok[warp][lane] = ok;
      s_w[warp][lane] = ok ? a.weights[i] : 0.f;
    }
    __syncwarp();
    for (int64_t u = lane; u < units; u += WARP_THREADS) {
      float acc[VE];
#pragma unroll
      for (int e = 0; e < VE; ++e) acc[e] = 0.f;
      for (int j = 0; j < a.k; ++j) {
        if (!s_ok[warp][j]) continue;  // dropped: never written, adds zero
        const float wj = s_w[warp][j];
        const uint4 v = __ldcg(reinterpret_cast<const uint4*>(slots + (tok * a.k + j) *
                                                                          a.row_bytes) + u);
        const T* x = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int e = 0; e < VE; ++e) acc[e] += wj * static_cast<float>(x[e]);
      }
      uint4 o;
      T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int e = 0; e < VE; ++e) oe[e] = static_cast<T>(acc[e]);
      reinterpret_cast<uint4*>(static_cast<char*>(a.out) + tok * a.row_bytes)[u] = o;
    }
    __syncwarp();
  }
}

/** @brief Launches the fused GEMM: `gemm_blocks` persistent blocks. */
template <class C>
inline cudaError_t launch_gemm_combine(const grouped_matmul::globals& g,
                                       const gemm_combine_args& f, cudaStream_t stream,
                                       int device, int gemm_blocks) {
  using K = grouped_matmul::kernel_def<C>;
  constexpr size_t SMEM = grouped_matmul::smem_bytes<K>();
  static_assert(SMEM + sizeof(wait_bound) + sizeof(int) * K::CONSUMERS * MAX_PEERS <= 232448,
                "moe_gemm_combine: shared memory over the sm_90 limit");
  if (cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(&gemm_combine_kernel<K>),
                                    device, static_cast<int>(SMEM));
      err != cudaSuccess) {
    return err;
  }
  gemm_combine_kernel<K><<<gemm_blocks, K::THREADS, SMEM, stream>>>(g, f);
  return cudaGetLastError();
}

}  // namespace pk::moe
