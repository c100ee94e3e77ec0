/**
 * @file lcsc.cuh
 * @brief The Load-Compute-Store-Communicate (LCSC) kernel template.
 *
 * A kernel author describes one kernel as a struct K with four roles and a few constants; the
 * template owns everything else: the launch configuration (a persistent grid sized from the
 * device's SM count), the shared-memory carve-up, the full/empty mbarrier ring between the
 * loader and the consumers, the producer/consumer warpgroup split with setmaxnreg, the
 * storer's staging buffers and their reuse, and the split of SMs into compute SMs and
 * communication SMs (`comm_blocks`, 0 allowed).
 *
 * Compute block (1 + K::CONSUMERS warpgroups):
 *
 *   warpgroup 0 (producer, K::PRODUCER_REGS registers), one thread:
 *     for each tile, for k in k_iters: wait empty[s]; expect STAGE_BYTES on full[s];
 *                                      K::loader(g, stage[s], &full[s], tile, k)
 *   warpgroup 1..C (consumers, K::CONSUMER_REGS registers), consumer c:
 *     for each tile: for k: wait full[s]; K::consumer(g, acc, stage[s], c, t, k);
 *                           release stage s (one step late when K::ASYNC_MMA: wgmma reads it)
 *                    K::storer(g, acc, out[c], c, tile, sync)
 *                    after the last tile: K::finish(g, c) (the whole warpgroup)
 *
 * Communication block (the FIRST comm_blocks blocks of the grid): K::communicator(g, info,
 * smem), with the block's whole dynamic shared memory (sizeof(shared_storage<K>) bytes, 1024-
 * byte aligned) free for its own use.
 *
 * Residency: compute blocks may wait for what communication blocks produce (ag_gemm's row
 * flags), never the other way round. Blocks are dispatched in index order, so putting the
 * communication blocks first guarantees they are resident (or done) whenever a compute block
 * runs, even when another kernel holds part of the SMs and the grid does not fit at once; the
 * compute blocks' persistent loop then only slows down. The grid is min(tiles, num_sms -
 * comm_blocks) compute blocks (at least 1) plus comm_blocks, whatever num_sms is.
 *
 * What K provides:
 *   types    globals, stage_t (one pipeline stage of inputs), out_t (a consumer's staging
 *            buffer for stores), acc_t (a consumer's register state for one tile)
 *   consts   STAGES, CONSUMERS, STAGE_BYTES (TMA bytes per stage), PRODUCER_REGS,
 *            CONSUMER_REGS, ASYNC_MMA
 *   hooks    scheduler(g) -> tile_scheduler; k_iters(g) -> int (>= 1); setup(g, info) (one
 *            thread, before the roles start); loader; consumer; storer; finish; communicator;
 *            bound(g) -> pk::wait_bound (error record and timeout of its mbarrier waits)
 */
#pragma once

#include "pk/common.cuh"
#include "pk/link.cuh"
#include "pk/mbarrier.cuh"
#include "pk/scheduler.cuh"
#include "pk/tma.cuh"
#include "pk/warpgroup.cuh"
#include "pk/wgmma.cuh"

namespace pk::lcsc {

/** @brief Where a block sits in the SM split; passed to setup and the communicator. */
struct block_info {
  int compute_blocks;  // blocks running loader / consumers / storer
  int comm_blocks;     // blocks running the communicator
  int index;           // this block's index among its kind
};

/** @brief Shared memory of one compute block. */
template <class K>
struct shared_storage {
  typename K::stage_t stages[K::STAGES];
  typename K::out_t out[K::CONSUMERS];
  mbarrier full[K::STAGES];
  mbarrier empty[K::STAGES];
};

/**
 * @brief Hand-off of a consumer's staging buffer to TMA stores. The storer brackets every
 * write of the buffer with acquire() (the previous stores from it have finished reading) and
 * publish() (writes visible to TMA; true on the one thread that then issues the stores).
 * A storer whose stores cross ranks records their link time with linked() (the rank
 * emulator's throttle, pk/link.cuh): the buffer is free, and the kernel done, only once those
 * bytes have crossed, as on a real link; never set in production (one predicated branch).
 */
struct storer_sync {
  int barrier_id;
  bool leader;
  mutable uint64_t link_due = 0;  ///< leader: end of its last store's link time (0: none)

  __device__ void acquire() const {
    if (leader) {
      tma::store_wait_read<0>();
      link_throttle::drain(link_due);
    }
    warpgroup::sync(barrier_id);
  }
  /** @brief Leader: a store just issued crosses the link until `end` (link_throttle::issue). */
  __device__ void linked(uint64_t end) const {
    if (end > link_due) link_due = end;
  }
  __device__ bool publish() const {
    tma::fence_smem_to_async();
    warpgroup::sync(barrier_id);
    return leader;
  }
};

/** @brief The template kernel. The first `comm_blocks` blocks run the communicator. */
template <class K>
__global__ void __launch_bounds__((K::CONSUMERS + 1) * WARPGROUP_THREADS, 1)
    kernel(const __grid_constant__ typename K::globals g, const int comm_blocks) {
  extern __shared__ unsigned char smem_raw[];
  auto& s = *reinterpret_cast<shared_storage<K>*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const int compute_blocks = gridDim.x - comm_blocks;
  const int index = static_cast<int>(blockIdx.x) - comm_blocks;  // among the compute blocks
  if (threadIdx.x == 0) block_wait_bound() = K::bound(g);
  if (index < 0) {
    __syncthreads();
    K::communicator(g, block_info{compute_blocks, comm_blocks, static_cast<int>(blockIdx.x)},
                    static_cast<void*>(&s));
    return;
  }
  if (threadIdx.x == 0) {
    for (int i = 0; i < K::STAGES; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], K::CONSUMERS);
    }
    fence_mbar_init();
    K::setup(g, block_info{compute_blocks, comm_blocks, index});
  }
  __syncthreads();

  const tile_scheduler sched = K::scheduler(g);
  const int num_tiles = sched.num_tiles();
  const int iters = K::k_iters(g);
  const int wg = warpgroup::index();

  if (wg == 0) {
    // Loader: one thread issues every copy.
    warpgroup::decrease_registers<K::PRODUCER_REGS>();
    if (warpgroup::thread() != 0) return;
    pipeline_state<K::STAGES> pipe;
    for (int id = index; id < num_tiles; id += compute_blocks) {
      const tile_coord t = sched.coord(id);
      for (int k = 0; k < iters; ++k) {
        mbar_wait(&s.empty[pipe.stage], pipe.phase ^ 1);
        mbar_arrive_expect_tx(&s.full[pipe.stage], K::STAGE_BYTES);
        K::loader(g, s.stages[pipe.stage], &s.full[pipe.stage], t, k);
        pipe.advance();
      }
    }
    return;
  }

  // Consumers and storer.
  warpgroup::increase_registers<K::CONSUMER_REGS>();
  const int c = wg - 1;
  const bool leader = warpgroup::thread() == 0;
  const storer_sync sync{1 + c, leader};
  pipeline_state<K::STAGES> pipe;
  for (int id = index; id < num_tiles; id += compute_blocks) {
    const tile_coord t = sched.coord(id);
    typename K::acc_t acc;
    int prev = 0;
    for (int k = 0; k < iters; ++k) {
      mbar_wait(&s.full[pipe.stage], pipe.phase);
      K::consumer(g, acc, s.stages[pipe.stage], c, t, k);
      if constexpr (K::ASYNC_MMA) {
        // The MMAs of step k may still read stage s; those of step k-1 are done now.
        wgmma::wait<1>();
        if (k > 0 && leader) mbar_arrive(&s.empty[prev]);
      } else {
        if (leader) mbar_arrive(&s.empty[pipe.stage]);
      }
      prev = pipe.stage;
      pipe.advance();
    }
    if constexpr (K::ASYNC_MMA) {
      wgmma::wait<0>();
      if (leader) mbar_arrive(&s.empty[prev]);
    }
    K::storer(g, acc, s.out[c], c, t, sync);
  }
  if (leader) {
    tma::store_wait<0>();
    link_throttle::drain(sync.link_due);
  }
  K::finish(g, c);
}

/** @brief Dynamic shared memory the template kernel of K needs (with alignment slack). */
template <class K>
constexpr size_t smem_bytes() {
  return sizeof(shared_storage<K>) + 1024;
}

/**
 * @brief Launches K on `stream`: max(1, min(num_sms - comm_blocks, tiles)) compute blocks
 * after `comm_blocks` communication blocks, one block per SM (see "Residency" above).
 * @param device the CUDA device ordinal (the smem opt-in is per device).
 * @param num_sms SMs the grid may use: the device's, or an emulated rank's partition.
 */
template <class K>
inline cudaError_t launch(const typename K::globals& g, cudaStream_t stream, int device,
                          int num_sms, int comm_blocks, int tiles) {
  constexpr size_t SMEM = smem_bytes<K>();
  // NOTES: the static shared wait_bound (32 bytes) counts against the same 227 KiB.
  static_assert(SMEM + sizeof(wait_bound) <= 232448,
                "lcsc: shared memory over the sm_90 limit of 227 KiB");
  if (cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(&kernel<K>), device,
                                     static_cast<int>(SMEM));
      err != cudaSuccess) {
    return err;
  }
  if (comm_blocks < 0) return cudaErrorInvalidValue;
  int compute = num_sms - comm_blocks;
  if (tiles < compute) compute = tiles;
  if (compute < 1) compute = 1;
  kernel<K><<<compute + comm_blocks, (K::CONSUMERS + 1) * WARPGROUP_THREADS, SMEM, stream>>>(
      g, comm_blocks);
  return cudaGetLastError();
}

}  // namespace pk::lcsc
