/**
 * @file mbarrier.cuh
 * @brief Shared-memory mbarriers: arrival counts plus transaction bytes, the completion
 * mechanism of TMA and bulk copies (sm_90).
 *
 * A phase completes when the expected arrivals have arrived and the expected transaction
 * bytes have landed; waiters poll the phase parity bit.
 */
#pragma once

#include "pk/common.cuh"
#include "pk/sync.cuh"

namespace pk {

/** @brief An mbarrier in shared memory (8 bytes, 8-byte aligned). */
struct alignas(8) mbarrier {
  uint64_t state;
};

__device__ inline uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/** @brief Initialises `bar` to expect `arrivals` arrivals per phase. One thread calls it. */
__device__ inline void mbar_init(mbarrier* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals));
}

/** @brief Makes mbarrier initialisation visible to the async proxy (TMA) and other threads. */
__device__ inline void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/** @brief Arrives once and adds `bytes` to the transaction count of the current phase. */
__device__ inline void mbar_arrive_expect_tx(mbarrier* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

/** @brief Plain arrival (no transaction bytes). */
__device__ inline void mbar_arrive(mbarrier* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

/** @brief Arrival on the barrier at the same offset in CTA `cta` of the cluster. */
__device__ inline void mbar_arrive_cluster(mbarrier* bar, uint32_t cta) {
  asm volatile(
      "{\n\t.reg .b32 remote;\n\t"
      "mapa.shared::cluster.u32 remote, %0, %1;\n\t"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n\t}" ::"r"(
          smem_addr(bar)),
      "r"(cta)
      : "memory");
}

/** @brief True once the phase with parity `parity` has completed. */
__device__ inline bool mbar_test(mbarrier* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

/**
 * @brief Where one side of a STAGES-deep ring of full/empty mbarriers stands: the stage it
 * uses next and the parity of that stage's phase it waits for.
 *
 * Every pass over the ring completes one more phase of each stage's barriers, so the parity a
 * side waits for flips exactly when the stage index wraps; advance() does both in one place,
 * so a loop can neither wrap without flipping nor flip on the wrong step. The producer and
 * each consumer keep their own state, both starting at stage 0, phase 0: the consumer waits
 * full[stage] for `phase`, the producer waits empty[stage] for `phase ^ 1` (the first pass
 * finds every stage free). Two registers: a local of the role's loop, passed by reference
 * into the helpers that move it (grouped_matmul's produce).
 *
 * Loops that number their uses (the attention mainloops: tile j of a stream, issued by
 * whichever warpgroup frees its stage last, so the issuer knows j and not a running state) take
 * the same mapping from the number: stage_of(j) and phase_of(j) are where a state started at
 * 0 stands after j advances.
 *
 * NOTES: phase is declared before stage. The member order decides the order of the two
 * registers in the PTX, which ptxas's register allocation and schedule follow: in this order
 * the loops that use the type (lcsc's, the grouped GEMM producers') compile to the machine code
 * of the two separate variables they replaced.
 */
template <int STAGES>
struct pipeline_state {
  static_assert(STAGES >= 1, "pipeline_state: at least one stage");
  uint32_t phase = 0;  ///< parity of stage's current phase (see NOTES for the member order)
  int stage = 0;       ///< index in [0, STAGES)

  /** @brief Moves to the next stage; past the last one, back to 0 with the parity flipped. */
  __device__ void advance() {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }

  /** @brief The stage of use j (j >= 0), numbered from 0: a state's after j advances. */
  __device__ static int stage_of(int j) { return j % STAGES; }
  /** @brief The parity use j (j >= 0) waits for: a state's phase after j advances. */
  __device__ static uint32_t phase_of(int j) { return (j / STAGES) & 1; }
};

/**
 * @brief What an mbarrier wait that never completes reports, per block: the error record, op
 * and rank of the kernel, and the bound (0: MBAR_DEFAULT_TIMEOUT_NS). Every kernel that waits
 * on mbarriers sets it (one thread, before its first __syncthreads): lcsc::kernel from
 * K::bound(g), the collectives from their communicator, grouped_matmul with zeros.
 */
struct wait_bound {
  int32_t* error;  ///< host-mapped record, or nullptr (local kernels: trap only)
  int32_t op, rank;
  uint64_t timeout_ns;
};
constexpr uint64_t MBAR_DEFAULT_TIMEOUT_NS = 60ull * 1000 * 1000 * 1000;

/**
 * @brief The bound of a cross-rank kernel's mbarrier waits: a quarter longer than its signal
 * waits (`timeout_ns`).
 *
 * NOTES: when a peer never arrives, the block waiting on its signal and the warps waiting on an
 * mbarrier that block would have filled start waiting at about the same time; the signal wait
 * knows the missing peer, the mbarrier wait does not (peer -1). Seen on the H200 (ag_gemm, P =
 * 8, one dead rank): the mbarrier timed out first and the record named peer -1.
 */
__host__ __device__ inline wait_bound peer_wait_bound(int32_t* error, int32_t op, int32_t rank,
                                                      uint64_t timeout_ns) {
  return wait_bound{error, op, rank, timeout_ns + timeout_ns / 4};
}

/** @brief This block's wait_bound (a static shared variable of every kernel that uses it). */
__device__ inline wait_bound& block_wait_bound() {
  __shared__ wait_bound bound;
  return bound;
}

/**
 * @brief Blocks until the phase with parity `parity` has completed, at most the block's
 * wait_bound; then writes the error record (code ERR_MBAR_TIMEOUT, peer -1) and traps.
 *
 * NOTES: a transaction count that never completes (expected bytes that no copy delivers, a copy
 * from an unmapped peer) would otherwise hang the kernel forever; the timer is read only every
 * 256 failed polls, so the completed-phase path costs one try_wait as before.
 */
__device__ inline void mbar_wait(mbarrier* bar, uint32_t parity) {
  if (mbar_test(bar, parity)) return;
  const uint64_t start = globaltimer_ns();
  uint32_t polls = 0;
  while (!mbar_test(bar, parity)) {
    if ((++polls & 255) == 0) {
      const wait_bound& w = block_wait_bound();
      const uint64_t limit = w.timeout_ns ? w.timeout_ns : MBAR_DEFAULT_TIMEOUT_NS;
      if (globaltimer_ns() - start > limit) {
        fail(fail_ctx{w.error, w.op, w.rank}, ERR_MBAR_TIMEOUT, -1);
      }
    }
  }
}

}  // namespace pk
