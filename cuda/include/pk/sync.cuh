/**
 * @file sync.cuh
 * @brief Cross-device signals for the P2P backend: monotonic epoch counters in every peer's
 * signal pad, bounded waits, and the error record a timed-out wait leaves behind.
 *
 * A signal slot is written by exactly one sender (one rank, one block) and only ever grows:
 * the sender raises it to the epoch it has reached (`red.release.sys.max`), the receiver waits
 * until it is `>=` the epoch it needs (`ld.acquire.sys`). Epochs come from counters that the
 * kernels themselves keep in device memory, so repeated calls and CUDA-graph replay need no
 * host reset, and a sender that is one epoch ahead never confuses a waiter.
 *
 * Every wait is bounded by `%globaltimer`: past the timeout the waiting thread writes the error
 * record (code, op, rank, peer) to host-mapped memory and traps, so the XLA call fails loudly
 * and pk_jax.runtime.errors reads which peer never arrived. A silent wrong result is never
 * returned.
 */
#pragma once

#include "pk/common.cuh"

namespace pk {

/** @brief Error codes and record fields, as in ffi/comm.h and pk_jax/runtime/errors.py. */
constexpr int ERR_TIMEOUT = 1;
constexpr int ERR_RANK_MISMATCH = 2;
constexpr int ERR_MBAR_TIMEOUT = 3;  ///< an mbarrier phase (TMA / bulk bytes) never came

/** @brief What a failing wait reports: the record and who is waiting. */
struct fail_ctx {
  int32_t* error;  ///< host-mapped int32[8] record: {code, op, rank, peer, ...}
  int32_t op;      ///< op id (1 all_reduce, 2 all_gather, 3 reduce_scatter, 4 all_to_all, ...)
  int32_t rank;    ///< this device's rank
};

/** @brief Nanoseconds of the global timer (wall clock, shared by all SMs). */
__device__ inline uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/**
 * @brief Writes the error record and stops the kernel with a trap.
 *
 * NOTES: the record lives in host memory, where device atomics are not guaranteed, so the
 * fields are plain stores and the code is written last after a system fence; two blocks failing
 * at once write equivalent records (the mbarrier waits of cross-rank kernels are bounded after
 * their signal waits, pk/mbarrier.cuh peer_wait_bound, so they do not race them). No claim: a
 * first-failure claim in device memory was tried and lost records on the H200 (MoE dispatch,
 * P = 8, one dead rank: code 0; bench/results/moe_notes.md, "Measurements moved from code
 * comments (issue 37)"), most likely because a losing block trapped the context before the
 * winner's stores to host memory had landed. The trap makes the XLA call fail (the CUDA
 * context is then unusable, as after any fatal peer loss); the host reads the record to name
 * the culprit.
 */
__device__ inline void fail(const fail_ctx& f, int code, int peer) {
  volatile int32_t* rec = f.error;
  if (rec != nullptr && rec[0] == 0) {
    rec[1] = f.op;
    rec[2] = f.rank;
    rec[3] = peer;
    __threadfence_system();
    rec[0] = code;
    __threadfence_system();
  }
  __trap();
}

/** @brief Acquire load of a signal slot at system scope. */
__device__ inline uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

/** @brief Relaxed load of a signal slot at system scope: several side by side, then one
 * fence_acq_rel_sys, make one acquire of them all. */
__device__ inline uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

/** @brief Fence at system scope: after relaxed loads that saw a release, an acquire. */
__device__ inline void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

/**
 * @brief Raises `slot` (in any peer's pad) to at least `epoch`, releasing this thread's earlier
 * writes (and, through a preceding __syncthreads, its block's) at system scope.
 */
__device__ inline void signal(uint64_t* slot, uint64_t epoch) {
  asm volatile("red.release.sys.global.max.u64 [%0], %1;" ::"l"(slot), "l"(epoch) : "memory");
}

/**
 * @brief Signals the same slot index in every peer's pad: P unicast signals (the P2P
 * backend's signal_all).
 */
template <int MAX_PEERS>
__device__ inline void signal_all(uint64_t* const (&pads)[MAX_PEERS], int world, uint64_t slot,
                                  uint64_t epoch) {
  for (int p = 0; p < world; ++p) signal(pads[p] + slot, epoch);
}

/**
 * @brief Waits until `*slot >= epoch`, at most `timeout_ns`; on timeout reports `peer` through
 * `f` and traps.
 */
__device__ inline void wait(const uint64_t* slot, uint64_t epoch, uint64_t timeout_ns,
                            const fail_ctx& f, int peer) {
  if (ld_acquire_sys(slot) >= epoch) return;
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (ld_acquire_sys(slot) < epoch) {
    if ((++spins & 63) == 0) {
      if (globaltimer_ns() - start > timeout_ns) fail(f, ERR_TIMEOUT, peer);
      __nanosleep(64);
    }
  }
}

/**
 * @brief Block-wide barrier with every peer on slot row `row` of the local pad: thread 0 fences
 * and signals `row + rank` on every peer, threads 0..world-1 wait for `row + peer >= epoch`,
 * then the block synchronises. Call from all threads of the block.
 */
template <int MAX_PEERS>
__device__ inline void barrier(uint64_t* const (&pads)[MAX_PEERS], int world, int rank,
                               uint64_t row, uint64_t epoch, uint64_t timeout_ns,
                               const fail_ctx& f) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int p = 0; p < world; ++p) signal(pads[p] + row + rank, epoch);
  }
  if (static_cast<int>(threadIdx.x) < world) {
    wait(pads[rank] + row + threadIdx.x, epoch, timeout_ns, f, threadIdx.x);
  }
  __syncthreads();
}

}  // namespace pk
