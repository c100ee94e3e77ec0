/**
 * @file grouped_walk.cuh
 * @brief The grouped GEMM's walk over row groups, written once for every grouped kernel (the
 * bf16/fp16 grouped_matmul and the fused MoE kernels on it, cuda/kernels/grouped_matmul.cuh, and
 * the fp8 grouped_matmul_fp8, cuda/kernels/grouped_matmul_fp8.cuh): the scan of the device-side
 * group sizes into row and row-tile offsets, the search of a row tile's group, the zeroing of
 * the rows past the groups, and the persistent block that runs a kernel description over them.
 *
 * Groups are consecutive row ranges of x: group e owns rows [off_e, off_e + size_e) with off_e
 * the sum of the sizes before it, each size clamped to >= 0 and every range cut at M. Group e has
 * ceil(size_e / BM) row tiles starting at off_e (not tile aligned); the row tiles of all groups
 * form one virtual column, numbered in group order (an empty group has none).
 */
#pragma once

#include "pk/common.cuh"
#include "pk/lcsc.cuh"
#include "pk/mbarrier.cuh"
#include "pk/tma.cuh"
#include "pk/warpgroup.cuh"

namespace pk::grouped_walk {

/**
 * @brief Warp 0: exclusive prefix sums of the clamped group sizes (rows, cut at g.m) into
 * row_off[0..E] and of their BM-row tiles into tile_off[0..E], 32 groups a round with a carry;
 * row_off[E] is the end of the grouped rows, tile_off[E] the row tile count. G: a kernel's
 * globals with group_sizes (device, [E] int32), groups (E) and m.
 */
// NOTES: the functions here read the sizes from the kernel's globals (a __grid_constant__
// parameter) rather than taking them as ints: the kernels' machine code then stays what it was
// when each kernel had its own copy.
template <int BM, class G>
__device__ __forceinline__ void scan_groups(const G& g, int* row_off, int* tile_off) {
  const int lane = threadIdx.x % 32;
  long long rows = 0;
  int tiles = 0;
  for (int base = 0; base < g.groups; base += 32) {
    const int e = base + lane;
    long long v = e < g.groups ? g.group_sizes[e] : 0;
    v = v < 0 ? 0 : v;
    long long incl = v;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const long long o = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += o;
    }
    const long long lo = rows + incl - v, hi = rows + incl;
    const int start = static_cast<int>(lo < g.m ? lo : g.m);
    const int end = static_cast<int>(hi < g.m ? hi : g.m);
    const int t = ceil_div(end - start, BM);
    int tincl = t;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int o = __shfl_up_sync(0xffffffffu, tincl, d);
      if (lane >= d) tincl += o;
    }
    if (e < g.groups) {
      row_off[e] = start;
      tile_off[e] = tiles + tincl - t;
    }
    rows += __shfl_sync(0xffffffffu, incl, 31);
    tiles += __shfl_sync(0xffffffffu, tincl, 31);
  }
  if (lane == 0) {
    row_off[g.groups] = static_cast<int>(rows < g.m ? rows : g.m);
    tile_off[g.groups] = tiles;
  }
}

/** @brief A row tile's place: its group, its first row and the end of the group's rows. */
struct row_tile {
  int e;
  int row0;
  int row_end;
};

/**
 * @brief The group of virtual row tile `mt` (0 <= mt < tile_off[groups]): the largest e with
 * tile_off[e] <= mt (a non-empty group, by binary search), and the tile's rows in it.
 */
template <int BM, class G>
__device__ __forceinline__ row_tile locate(const G& g, const int* row_off, const int* tile_off,
                                           int mt) {
  int lo = 0, hi = g.groups;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (tile_off[mid] <= mt) lo = mid;
    else hi = mid;
  }
  return row_tile{lo, row_off[lo] + (mt - tile_off[lo]) * BM, row_off[lo + 1]};
}

/**
 * @brief Zero rows [total, g.m) of the row-major [g.m, g.n] output g.y of T (g.n * sizeof(T)
 * a multiple of 16), 16 bytes a store, grid-stride over the THREADS consumer threads of every
 * block (thread ids WARPGROUP_THREADS and up: the producer warpgroup has returned).
 */
template <typename T, int THREADS, class G>
__device__ __forceinline__ void zero_rows(const G& g, int total) {
  if (total >= g.m) return;
  const size_t chunks = static_cast<size_t>(g.m - total) * g.n / (16 / sizeof(T));
  uint4* out = reinterpret_cast<uint4*>(static_cast<T*>(g.y) + static_cast<size_t>(total) * g.n);
  const size_t stride = static_cast<size_t>(gridDim.x) * THREADS;
  for (size_t i = blockIdx.x * THREADS + (threadIdx.x - WARPGROUP_THREADS); i < chunks;
       i += stride) {
    out[i] = make_uint4(0, 0, 0, 0);
  }
}

/**
 * @brief The body of a persistent grouped kernel (one block per SM, grid-stride over tile ids):
 * thread 0 sets up K's ring and prefetches the output map, warp 0 scans the groups, then
 * warpgroup 0's first thread produces and the consumer warpgroups consume K's tiles, each
 * finished tile going through K::storer; at the end the rows past the groups are zeroed.
 *
 * K provides: globals (with `out`, the output's tensor map), shared_storage, acc_t, work,
 * THREADS; init_ring(g, s, bound), scan_groups(g, s), num_tiles(g, s), produce_tiles(g, s, n),
 * consume_tiles(g, s, n, c, leader, epilogue), storer(g, acc, out, c, work, sync),
 * zero_tail(g, s).
 */
template <class K>
__device__ __forceinline__ void persistent_block(const typename K::globals& g) {
  using shared_storage = typename K::shared_storage;
  extern __shared__ unsigned char smem_raw[];
  auto& s = *reinterpret_cast<shared_storage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  if (threadIdx.x == 0) {
    K::init_ring(g, s, wait_bound{});  // no communicator: a stalled mbarrier traps at 60 s
    tma::prefetch(&g.out);
  }
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
  const int c = wg - 1;
  const bool leader = warpgroup::thread() == 0;
  const lcsc::storer_sync sync{1 + c, leader};
  K::consume_tiles(g, s, num_tiles, c, leader,
                   [&](const typename K::acc_t& acc, const typename K::work& w) {
                     K::storer(g, acc, s.out[c], c, w, sync);
                   });
  if (leader) tma::store_wait<0>();
  K::zero_tail(g, s);
}

}  // namespace pk::grouped_walk
