/**
 * @file comm_ops.cuh
 * @brief The data-moving primitives of the P2P backend (signal/wait/barrier are in sync.cuh):
 *
 * - `store_async` / `store_add_async`: bulk copies (cp.async.bulk, UBLKCP in SASS) of a
 *   contiguous tile from shared memory into global memory, local or a peer's mapping; the add
 *   variant reduces into the destination (cp.reduce.async.bulk .add).
 * - `load_async`: the bulk copy in the other direction, completing on an mbarrier.
 * - `bulk_ring` / `bulk_move` / `bulk_copy`: one thread moving contiguous pieces global ->
 *   shared -> global through a ring of shared-memory stages, loads running ahead of stores
 *   (the collectives' data path and ag_gemm's communication blocks); `row_pieces`: strided
 *   rows the same way (the Ulysses kernels' head-group exchanges).
 * - `p2p::reduce` / `p2p::all_reduce`: 16-byte vector loads of the same offset from every peer, summed in
 *   fp32 registers; all_reduce also stores the sum back to every peer.
 *
 * The bulk-copy ring paces the pieces that cross ranks through the rank emulator's link
 * throttle (pk/link.cuh) when its view carries one; off (production), that is one branch.
 *
 * Bulk copies need 16-byte aligned addresses and sizes that are multiples of 16 bytes.
 */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "pk/link.cuh"
#include "pk/mbarrier.cuh"
#include "pk/sync.cuh"

namespace pk {

// ---------------------------------------------------------------------------------------------
// Bulk copies (1-D, contiguous bytes)

/** @brief Shared -> global bulk copy of `bytes`, part of this thread's open bulk group. */
__device__ inline void store_async(void* dst, const void* src_smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_addr(src_smem)), "r"(bytes)
               : "memory");
}

/** @brief Shared -> global bulk reduce-add of `bytes` (elements of T), into dst. */
template <typename T>
__device__ inline void store_add_async(T* dst, const T* src_smem, uint32_t bytes);

template <>
__device__ inline void store_add_async<float>(float* dst, const float* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(
                   dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
template <>
__device__ inline void store_add_async<__nv_bfloat16>(__nv_bfloat16* dst, const __nv_bfloat16* src,
                                                      uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16 [%0], [%1], %2;" ::"l"(
          dst),
      "r"(smem_addr(src)), "r"(bytes)
      : "memory");
}
template <>
__device__ inline void store_add_async<__half>(__half* dst, const __half* src, uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.f16 [%0], [%1], %2;" ::"l"(dst),
      "r"(smem_addr(src)), "r"(bytes)
      : "memory");
}

/** @brief Global -> shared bulk copy of `bytes`; completes `bytes` transactions on `bar`. */
__device__ inline void load_async(void* dst_smem, const void* src, uint32_t bytes, mbarrier* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst_smem)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

/** @brief Closes this thread's open bulk group. */
__device__ inline void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

/** @brief Waits until every bulk group of this thread has completed (writes visible). */
__device__ inline void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

/** @brief Waits until all but the N newest bulk groups of this thread have finished reading
 * shared memory. */
template <int N>
__device__ inline void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

/** @brief Orders generic-proxy shared-memory writes before later bulk-copy reads of them. */
__device__ inline void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/** @brief Orders generic-proxy global writes and async-proxy (bulk copy) accesses. */
__device__ inline void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// ---------------------------------------------------------------------------------------------
// Bulk-copy ring: global -> shared -> global moves of contiguous pieces, loads running ahead

/** @brief STAGES shared-memory stages with their mbarriers (dynamic shared memory). */
struct bulk_ring {
  static constexpr int STAGES = 4;
  static constexpr uint32_t STAGE_BYTES = 32 * 1024;

  mbarrier bar[STAGES];  ///< stage s loaded (transaction bytes)
  char* dst[STAGES];     ///< bulk_move: where stage s's piece goes
  uint32_t bytes[STAGES];
  uint32_t phase;        ///< bit s: parity of stage s's next completion (one thread writes)
  uint64_t due[STAGES];  ///< paced pieces: when stage s's piece has crossed the link (0: not)
  link_throttle link;    ///< bulk_copy's pacing (pk/link.cuh): off after init; set it to the
                         ///< throttle for copies that cross ranks
  alignas(128) char buf[STAGES][STAGE_BYTES];
  uint32_t rows[STAGES];        ///< bulk_move<true>: stage s's rows and their
  uint64_t dst_stride[STAGES];  ///< destination stride

  /** @brief One thread, before any use. */
  __device__ void init() {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&bar[s], 1);
      due[s] = 0;
    }
    phase = 0;
    link = link_throttle{};
    fence_mbar_init();
  }
};

/** @brief A contiguous copy of `bytes` (a multiple of 16, at most one stage); with
 * bulk_move<true>, `rows` rows of bytes / rows each, at src + i src_stride and
 * dst + i dst_stride (one stage holds them back to back). */
struct bulk_piece {
  const char* src;
  char* dst;
  uint32_t bytes;
  bool paced = false;  ///< crosses ranks: paced by bulk_move's link throttle (when on)
  uint32_t rows = 1;
  uint64_t src_stride = 0, dst_stride = 0;
};

/** @brief Parity bits of the stages after `n` more completions starting at stage 0. */
__device__ inline uint32_t advance_phase(uint32_t phase, int n) {
#pragma unroll
  for (int s = 0; s < bulk_ring::STAGES; ++s) {
    const int uses = n > s ? (n - 1 - s) / bulk_ring::STAGES + 1 : 0;
    phase ^= uint32_t(uses & 1) << s;
  }
  return phase;
}

/**
 * @brief One thread: copies every piece `next(&piece)` yields, global -> shared -> global,
 * with STORES stores in flight and STAGES - STORES loads ahead of them. Returns with every
 * store complete (not yet fenced for generic-proxy readers: see fence_proxy_async_global).
 * Pieces marked `paced` cross the link asynchronously (pk/link.cuh): each reserves its link
 * time as it is issued, a stage is reused only once its piece has crossed, and on return every
 * paced piece has crossed.
 * ROWS: pieces of strided rows (bulk_piece::rows), one bulk copy per row each way.
 * STORES: with 1, a stage is refilled as soon as its own store has read it, so one store is in
 * flight at a time and the copy runs at one store's latency per piece; a block that moves a
 * stream on its own (the ring's communication blocks) keeps more in flight.
 */
template <bool ROWS = false, int STORES = 1, class Next>
__device__ inline void bulk_move(bulk_ring& ring, Next next, const link_throttle& link = {}) {
  static_assert(STORES >= 1 && STORES < bulk_ring::STAGES, "bulk_move: 1 <= STORES < STAGES");
  uint32_t phase = ring.phase;
  int issued = 0;
  bool more = true;
  uint64_t due = 0;  // the latest end of a paced piece's link time
  auto issue = [&]() {
    bulk_piece pc;
    if (!next(&pc)) return false;
    const int s = issued % bulk_ring::STAGES;
    if (link.on()) {
      link_throttle::drain(ring.due[s]);  // the stage's last piece has crossed
      ring.due[s] = pc.paced ? link.issue(pc.bytes) : 0;
      if (ring.due[s] > due) due = ring.due[s];
    }
    ring.dst[s] = pc.dst;
    ring.bytes[s] = pc.bytes;
    mbar_arrive_expect_tx(&ring.bar[s], pc.bytes);
    if constexpr (ROWS) {
      ring.rows[s] = pc.rows;
      ring.dst_stride[s] = pc.dst_stride;
      const uint32_t rb = pc.bytes / pc.rows;
      for (uint32_t k = 0; k < pc.rows; ++k) {
        load_async(ring.buf[s] + k * rb, pc.src + k * pc.src_stride, rb, &ring.bar[s]);
      }
    } else {
      load_async(ring.buf[s], pc.src, pc.bytes, &ring.bar[s]);
    }
    ++issued;
    return true;
  };
  while (more && issued < bulk_ring::STAGES) more = issue();
  for (int i = 0; i < issued; ++i) {
    const int s = i % bulk_ring::STAGES;
    mbar_wait(&ring.bar[s], (phase >> s) & 1);
    phase ^= 1u << s;
    if constexpr (ROWS) {
      const uint32_t rb = ring.bytes[s] / ring.rows[s];
      for (uint32_t k = 0; k < ring.rows[s]; ++k) {
        store_async(ring.dst[s] + k * ring.dst_stride[s], ring.buf[s] + k * rb, rb);
      }
    } else {
      store_async(ring.dst[s], ring.buf[s], ring.bytes[s]);
    }
    bulk_commit();
    // Refill the stage of store i - STORES + 1 (issue() takes stage issued % STAGES, which is
    // that one) once it has read it: the STORES - 1 newer stores may still be reading.
    if (more && i >= STORES - 1) {
      bulk_wait_read<STORES - 1>();
      more = issue();
    }
  }
  bulk_wait_all();
  link_throttle::drain(due);
  ring.phase = phase;
}

/**
 * @brief One thread: dst[0, bytes) = src[0, bytes) (16-byte aligned, bytes % 16 == 0); every
 * piece paced by `ring.link` (off unless the caller set it: copies that cross ranks).
 */
__device__ inline void bulk_copy(bulk_ring& ring, void* dst, const void* src, uint64_t bytes) {
  uint64_t done = 0;
  bulk_move(ring, [&](bulk_piece* pc) {
    if (done >= bytes) return false;
    const uint64_t n = bytes - done < bulk_ring::STAGE_BYTES ? bytes - done
                                                              : bulk_ring::STAGE_BYTES;
    pc->src = static_cast<const char*>(src) + done;
    pc->dst = static_cast<char*>(dst) + done;
    pc->bytes = static_cast<uint32_t>(n);
    pc->paced = true;
    done += n;
    return true;
  }, ring.link);
}

/**
 * @brief The pieces of a copy of `n` rows of `row_bytes` (a multiple of 16) each, from
 * src + i src_stride to dst + i dst_stride, for bulk_move<true>: as many whole rows as fit in
 * a stage, or parts of one row when a row does not fit.
 */
struct row_pieces {
  const char* src;
  char* dst;
  uint64_t src_stride, dst_stride, row_bytes, n;
  uint64_t row = 0, col = 0;  // the next piece's first row and, for parts of rows, byte

  /** @brief The next piece into *pc (marked `paced`); false when none is left. */
  __device__ bool next(bulk_piece* pc, bool paced) {
    if (row >= n) return false;
    pc->src = src + row * src_stride + col;
    pc->dst = dst + row * dst_stride + col;
    pc->src_stride = src_stride;
    pc->dst_stride = dst_stride;
    pc->paced = paced;
    if (row_bytes <= bulk_ring::STAGE_BYTES) {
      const uint64_t fit = bulk_ring::STAGE_BYTES / row_bytes;
      const uint64_t k = n - row < fit ? n - row : fit;
      pc->rows = static_cast<uint32_t>(k);
      pc->bytes = static_cast<uint32_t>(k * row_bytes);
      row += k;
    } else {
      const uint64_t part = row_bytes - col < bulk_ring::STAGE_BYTES ? row_bytes - col
                                                                      : bulk_ring::STAGE_BYTES;
      pc->rows = 1;
      pc->bytes = static_cast<uint32_t>(part);
      col += part;
      if (col == row_bytes) {
        col = 0;
        ++row;
      }
    }
    return true;
  }
};

/**
 * @brief Copies the bytes of [src, src + bytes) past the last 16-byte multiple with plain
 * accesses; returns that multiple (the part left for bulk copies).
 */
__device__ inline uint32_t split_tail(const char* src, char* dst, int64_t bytes) {
  const int64_t bulk = bytes / 16 * 16;
  for (int64_t i = bulk; i < bytes; ++i) dst[i] = __ldcg(src + i);
  return static_cast<uint32_t>(bulk);
}

// ---------------------------------------------------------------------------------------------
// 16-byte vectors and register reductions (namespace p2p: the P2P backend of reduce/all_reduce)

namespace p2p {

/** @brief Loads 16 bytes, bypassing L1 (peer data written during this kernel). */
__device__ inline uint4 ld16(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

/** @brief Stores 16 bytes. */
__device__ inline void st16(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

/** @brief Number of T in a 16-byte vector. */
template <typename T>
constexpr int VEC_ELEMS = 16 / sizeof(T);

/** @brief fp32 accumulator of one 16-byte vector of T. */
template <typename T>
struct acc16 {
  float v[VEC_ELEMS<T>];
  __device__ void zero() {
#pragma unroll
    for (int i = 0; i < VEC_ELEMS<T>; ++i) v[i] = 0.f;
  }
  __device__ void add(uint4 raw) {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC_ELEMS<T>; ++i) v[i] += static_cast<float>(e[i]);
  }
  __device__ uint4 pack() const {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC_ELEMS<T>; ++i) e[i] = static_cast<T>(v[i]);
    return raw;
  }
};

/**
 * @brief Sum over the first `world` peers of the 16-byte vector at byte offset `off` of each
 * peer's buffer (peer loads + register reduction, in fp32). All loads issue before any add.
 * `bases` should live in the kernel's parameters (constant bank), not in local memory.
 */
template <typename T, int MAX_PEERS>
__device__ inline uint4 reduce(void* const (&bases)[MAX_PEERS], int world, uint64_t off) {
  acc16<T> acc;
  acc.zero();
  uint4 raw[MAX_PEERS];
#pragma unroll
  for (int p = 0; p < MAX_PEERS; ++p) {
    if (p < world) raw[p] = ld16(static_cast<const char*>(bases[p]) + off);
  }
#pragma unroll
  for (int p = 0; p < MAX_PEERS; ++p) {
    if (p < world) acc.add(raw[p]);
  }
  return acc.pack();
}

/** @brief reduce(), then the sum stored at `off` of every peer's buffer `dst`. */
template <typename T, int MAX_PEERS>
__device__ inline uint4 all_reduce(void* const (&bases)[MAX_PEERS], void* const (&dst)[MAX_PEERS],
                                   int world, uint64_t off) {
  const uint4 s = reduce<T, MAX_PEERS>(bases, world, off);
#pragma unroll
  for (int p = 0; p < MAX_PEERS; ++p) {
    if (p < world) st16(static_cast<char*>(dst[p]) + off, s);
  }
  return s;
}

/** @brief Scalar sum over peers of the T at byte offset `off` (tails). */
template <typename T, int MAX_PEERS>
__device__ inline T reduce_scalar(void* const (&bases)[MAX_PEERS], int world, uint64_t off) {
  float acc = 0.f;
#pragma unroll
  for (int p = 0; p < MAX_PEERS; ++p) {
    if (p < world) {
      acc += static_cast<float>(
          __ldcg(reinterpret_cast<const T*>(static_cast<const char*>(bases[p]) + off)));
    }
  }
  return static_cast<T>(acc);
}

}  // namespace p2p
}  // namespace pk
