/**
 * @file link.cuh
 * @brief The rank emulator's link throttle: a per-rank cap on the rate at which a rank's
 * kernels move bytes to or from other ranks' memory (emulation only; off in production).
 *
 * Why: in the rank emulator (pk_jax.testing.World) every rank is a partition of one GPU and
 * "links" at the shared HBM's rate, about 240 FLOP per byte of compute against a real NVLink
 * node's ~1750, so communication is nearly free there and overlap barely matters. The
 * throttle slows each emulated rank's cross-rank traffic to a chosen rate so the emulated
 * machine has a real node's FLOP/byte ratio.
 *
 * How: each rank owns a link clock (one uint64 of device memory, nanoseconds of %globaltimer)
 * shared by all of its blocks and kernels: the time until which its link is busy. A transfer
 * of n bytes reserves [start, start + n / rate) on the clock, so the reservations of all
 * threads of the rank follow each other and the rank's aggregate rate never exceeds the cap,
 * however many blocks move data. The clock banks at most SLACK_NS of idle time (a link that
 * was idle does not save up bandwidth), which also absorbs the timer's granularity. Durations
 * round up to whole nanoseconds (never faster than the cap).
 *
 * The link is asynchronous, as on a real GPU: a store, TMA store or reduce-add to a peer is
 * issued and its thread goes on computing (`issue`: reserve and return the reservation's end,
 * no wait). What waits for the bytes is what waits on a real GPU: reusing the shared memory
 * the transfer reads from (the bulk group's read wait: `wait_until(end)` there), the signal
 * that tells the peer the bytes landed, and the kernel's end (`drain(end)`). A pull is paced
 * (`pace`: wait for the reservation's start before the load) because the puller needs the
 * data it loads; vector paths that moved their bytes first reserve them after the fact and
 * wait for their end before signalling (`pace_block`).
 *
 * What counts as link traffic: bytes a rank's threads load from or store into another rank's
 * workspace (bulk copies, TMA reduce-adds, vector loads and stores), in the direction they are
 * initiated (a pull counts at the puller, a push at the pusher); a rank's own workspace and
 * its local buffers are not paced. Every op here is symmetric, so that is each direction's
 * load of a real link.
 *
 * Cost when off: `clock == nullptr` (production never sets it: the communicator table's entry
 * is zeroed at pk.init; only pk_jax.testing sets it), one uniform, predictable branch per
 * paced piece (a bulk copy of up to 32 KiB, a 64 x 64 TMA panel, a block's share of a pass).
 */
#pragma once

#include "pk/sync.cuh"

namespace pk {

struct link_throttle {
  static constexpr uint64_t SLACK_NS = 2000;  ///< idle time a link may bank (a burst)

  // No default member initializers: the kernels' argument structs stay trivial (memset,
  // value-initialisation `{}` zero them, which is off).
  uint64_t* clock;      ///< this rank's link clock (device memory); nullptr = off
  uint64_t ps_per_kib;  ///< picoseconds per KiB at the cap: 1024 * 1000 / (GB/s)

  __host__ __device__ bool on() const { return clock != nullptr; }

  /** @brief This throttle when moving to or from peer `p`, off when p is `me` (local). */
  __host__ __device__ link_throttle peer(int p, int me) const {
    return p == me ? link_throttle{} : *this;
  }

  /** @brief Reserves n bytes of link time; returns the reservation's [start, end) in ns. */
  __device__ void reserve(uint64_t bytes, uint64_t* start, uint64_t* end) const {
    const uint64_t dur = (bytes * ps_per_kib + 1024ull * 1000 - 1) / (1024ull * 1000);
    const uint64_t now = globaltimer_ns();
    atomicMax(reinterpret_cast<unsigned long long*>(clock),
              static_cast<unsigned long long>(now - SLACK_NS));
    *start = atomicAdd(reinterpret_cast<unsigned long long*>(clock),
                       static_cast<unsigned long long>(dur));
    *end = *start + dur;
  }

  /** @brief Spins (with short sleeps) until the global timer reaches `t`. */
  __device__ static void wait_until(uint64_t t) {
    while (globaltimer_ns() < t) __nanosleep(128);
  }

  /**
   * @brief One thread, as it issues an asynchronous transfer of `bytes` to a peer (a TMA store
   * or bulk copy out of shared memory): reserves them and returns the reservation's end, when
   * the bytes have crossed, without waiting (0 when off). Whoever next needs the transfer done
   * (the source's reuse, the peer's signal, the kernel's end) waits for it with `drain`.
   */
  __device__ uint64_t issue(uint64_t bytes) const {
    if (!on()) return 0;
    uint64_t start, end;
    reserve(bytes, &start, &end);
    return end;
  }

  /**
   * @brief One thread, before it starts pulling `bytes` from a peer (it needs them): waits for
   * its turn on the link; returns the reservation's end (for `drain`), 0 when off.
   */
  __device__ uint64_t pace(uint64_t bytes) const {
    if (!on()) return 0;
    uint64_t start, end;
    reserve(bytes, &start, &end);
    wait_until(start);
    return end;
  }

  /** @brief Waits until `end` (an `issue` or `pace` result): those bytes have crossed. */
  __device__ static void drain(uint64_t end) {
    if (end != 0) wait_until(end);
  }

  /**
   * @brief Thread 0 of the block, after the block moved `bytes` across ranks without pacing
   * (per-thread vector paths): reserves them and waits for their end, so the block signals no
   * earlier than the link would have delivered them. Call from all threads (it synchronises
   * the block when on).
   */
  __device__ void pace_block(uint64_t bytes) const {
    if (!on()) return;
    __syncthreads();
    if (threadIdx.x == 0 && bytes != 0) drain(pace(bytes));
    __syncthreads();
  }

  /** @brief pace_block of the sum over the block's threads of `mine` (bytes each moved). */
  __device__ void pace_block_sum(uint64_t mine) const {
    if (!on()) return;
    __shared__ unsigned long long total;
    __syncthreads();
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    if (mine != 0) atomicAdd(&total, static_cast<unsigned long long>(mine));
    __syncthreads();
    if (threadIdx.x == 0 && total != 0) drain(pace(total));
    __syncthreads();
  }
};

}  // namespace pk
