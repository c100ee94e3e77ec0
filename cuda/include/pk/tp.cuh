/**
 * @file tp.cuh
 * @brief What the fused tensor-parallel GEMM kernels (kernels/{gemm_rs,ag_gemm,gemm_ar}.cuh)
 * share: each op's range of the signal pad, the per-call epoch, the communicator view passed
 * to kernels, and flat 16-byte copy loops.
 *
 * Epochs: every call of a fused op first runs `epoch_kernel` (one thread), which checks the
 * rank operand and raises the op's EPOCH slot in the local pad by one. Every later kernel of
 * the same call reads that slot and uses the value as the epoch of its signals; nothing else
 * writes it, so all blocks of all kernels of a call agree on it without grid-wide
 * synchronisation. All ranks make the same sequence of calls, so epochs agree across ranks.
 *
 * Signal pad: the collectives (pk/collective.cuh) use slots [0, 6272). Op i (0 gemm_rs,
 * 1 ag_gemm, 2 gemm_ar) owns OP_SLOTS slots from SLOT_BASE + i * OP_SLOTS; the host passes
 * pads already offset to that range, so device code uses the small offsets below.
 */
#pragma once

#include "pk/comm_ops.cuh"
#include "pk/sync.cuh"

namespace pk::tp {

constexpr int MAX_PEERS = 16;
constexpr int MAX_BLOCKS = 128;  // blocks of the helper kernels; comm blocks of ag_gemm
constexpr int THREADS = 512;     // threads of the helper kernels

constexpr uint64_t SLOT_BASE = 8192;
constexpr uint64_t OP_SLOTS = 16384;
constexpr uint64_t SLOTS_NEEDED = SLOT_BASE + 3 * OP_SLOTS;
constexpr uint64_t EPOCH = 0;                                // local: calls of this op so far
constexpr uint64_t CLAIMS = 1;  // local: ag_gemm's own-row copy units claimed this call (claim)
constexpr uint64_t ROW = uint64_t(MAX_BLOCKS) * MAX_PEERS;   // slots of one per-block barrier
constexpr uint64_t BAR0 = 64;                                // barrier i: BAR0 + i * ROW
constexpr uint64_t FLAGS = BAR0 + 4 * ROW;                   // ag_gemm: local row-block flags
constexpr uint64_t MAX_FLAGS = OP_SLOTS - FLAGS;

/** @brief Slot row of per-block barrier `i` for block `b` (sender rank s at + s). */
__host__ __device__ constexpr uint64_t bar_row(int i, int b) {
  return BAR0 + uint64_t(i) * ROW + uint64_t(b) * MAX_PEERS;
}

/** @brief The communicator as a kernel sees it (by value, in the kernel's parameters). */
struct comm {
  void* ws[MAX_PEERS];       ///< every peer's workspace, mapped here
  uint64_t* sig[MAX_PEERS];  ///< every peer's pad, offset to this op's slot range
  int32_t* error;            ///< host-mapped error record
  uint64_t timeout_ns;
  int32_t world, rank, op;
  const int32_t* rank_ptr;   ///< XLA's rank operand (checked against `rank`)
  link_throttle link;        ///< the rank emulator's link cap (pk/link.cuh; off in production)

  __device__ fail_ctx fail() const { return fail_ctx{error, op, rank}; }
  /** @brief The same record for the kernel's mbarrier waits, bounded after the signal waits. */
  __host__ __device__ wait_bound bound() const {
    return peer_wait_bound(error, op, rank, timeout_ns);
  }
  /** @brief This call's epoch (set by epoch_kernel before any other kernel of the call). */
  __device__ uint64_t epoch() const {
    return *reinterpret_cast<volatile const uint64_t*>(sig[rank] + EPOCH);
  }
  /** @brief Block-wide barrier `i` of block `b` with the same block of every peer. */
  __device__ void barrier(int i, int b, uint64_t e) const {
    pk::barrier<MAX_PEERS>(sig, world, rank, bar_row(i, b), e, timeout_ns, fail());
  }
};

/**
 * @brief After the block's writes: every thread fences its writes for the async proxy too,
 * then thread 0 raises slot `slot_of(p)` of every peer p's pad (just `slot` on mine when
 * `local`) to e, releasing the block's writes at system scope.
 */
__device__ inline void publish(const comm& c, uint64_t slot, uint64_t e, bool local) {
  fence_proxy_async_global();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    if (local) {
      signal(c.sig[c.rank] + slot, e);
    } else {
      for (int p = 0; p < c.world; ++p) signal(c.sig[p] + slot, e);
    }
  }
}

/**
 * @brief One thread: checks the rank operand, starts a new epoch of this op and zeroes its
 * CLAIMS counter (the call's kernels start after this one ends, so none claims before).
 */
static __global__ void epoch_kernel(const __grid_constant__ comm c) {
  const int32_t got = *c.rank_ptr;
  if (got != c.rank) fail(c.fail(), ERR_RANK_MISMATCH, got);
  c.sig[c.rank][EPOCH] += 1;
  c.sig[c.rank][CLAIMS] = 0;
}

/**
 * @brief Claims `n` units of this call's shared work list (counter `CLAIMS` of my pad, zeroed by
 * epoch_kernel): returns the first unit, `total` or more once every unit is taken. One thread.
 */
__device__ inline uint64_t claim(const comm& c, uint64_t n, uint64_t total) {
  unsigned long long* slot = reinterpret_cast<unsigned long long*>(c.sig[c.rank] + CLAIMS);
  // A plain read first: once the list is empty, the late claimers leave without an atomic.
  if (*reinterpret_cast<volatile unsigned long long*>(slot) >= total) return total;
  return atomicAdd(slot, static_cast<unsigned long long>(n));
}

/**
 * @brief dst[i] = *src(i) for the 16-byte units i = start, start + step, ... below hi, with U
 * loads in flight per thread before their stores (peer loads over NVLink take microseconds).
 */
template <int U = 8, class Src>
__device__ inline void copy_units(uint4* dst, Src src, uint64_t start, uint64_t step,
                                  uint64_t hi) {
  uint64_t i = start;
  for (; i + (U - 1) * step < hi; i += U * step) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = p2p::ld16(src(i + u * step));
#pragma unroll
    for (int u = 0; u < U; ++u) dst[i + u * step] = v[u];
  }
  for (; i < hi; i += step) dst[i] = p2p::ld16(src(i));
}

/** @brief Arguments of the helper kernels around the GEMM of gemm_rs / gemm_ar. */
struct rows_args {
  comm c;
  void* y;                    ///< XLA's output
  uint64_t owner_units;       ///< 16-byte units of one owner's accumulation buffer [Mp, N]
  uint64_t out_units;         ///< 16-byte units of y
};

/**
 * @brief Before the GEMM: barrier 0 (every peer's earlier kernels, which may read my
 * workspace, are over), zero my accumulation buffer, barrier 1 (every buffer is zero).
 */
static __global__ void __launch_bounds__(THREADS)
    enter_kernel(const __grid_constant__ rows_args a) {
  const comm& c = a.c;
  const uint64_t e = c.epoch();
  c.barrier(0, blockIdx.x, e);
  uint4* mine = static_cast<uint4*>(c.ws[c.rank]);
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < a.owner_units;
       i += uint64_t(gridDim.x) * blockDim.x) {
    mine[i] = zero;
  }
  fence_proxy_async_global();  // peers reduce-add into it with TMA (async proxy)
  c.barrier(1, blockIdx.x, e);
}

/**
 * @brief After the GEMM. barrier 2 (every peer's reduce-adds into my buffer have landed:
 * their GEMM kernel completed before this kernel started), then
 *   GATHER = false (gemm_rs): y = my buffer;
 *   GATHER = true (gemm_ar):  y = the owners' buffers back to back (peer loads), then
 *                             barrier 3 (no peer reads my buffer any more).
 */
template <bool GATHER>
static __global__ void __launch_bounds__(THREADS)
    leave_kernel(const __grid_constant__ rows_args a) {
  const comm& c = a.c;
  const uint64_t e = c.epoch();
  fence_proxy_async_global();  // my GEMM's TMA adds (async proxy) before the release
  c.barrier(2, blockIdx.x, e);
  fence_proxy_async_global();  // peers' TMA adds before my generic loads
  const uint4* const* ws = reinterpret_cast<const uint4* const*>(c.ws);
  const uint64_t owner_units = a.owner_units;
  const int r = c.rank;
  copy_units(static_cast<uint4*>(a.y),
             [&](uint64_t i) {
               const uint64_t o = GATHER ? i / owner_units : uint64_t(r);
               return ws[o] + (GATHER ? i - o * owner_units : i);
             },
             uint64_t(blockIdx.x) * blockDim.x + threadIdx.x, uint64_t(gridDim.x) * blockDim.x,
             a.out_units);
  if constexpr (GATHER) {
    // Link throttle (emulator only): this block's share of the peer loads, after the fact.
    c.link.pace_block((a.out_units - a.owner_units) * 16 / gridDim.x);
    c.barrier(3, blockIdx.x, e);
  }
}

/**
 * @brief Grid of the helper kernels for `units` 16-byte units.
 *
 * NOTES: block b of every rank meets block b of every peer at the per-block barriers, so all
 * ranks must launch the same grid: it comes from the problem alone, never from the local SM
 * count (emulated ranks, or GPUs partly held by other work, differ there). The grid need not
 * fit at once: a block only waits for same-index blocks of peers, which their own in-order
 * dispatch runs no later than it.
 */
inline int helper_grid(uint64_t units) {
  const uint64_t g = (units + 8 * THREADS - 1) / (8 * THREADS);
  if (g < 1) return 1;
  return g > uint64_t(MAX_BLOCKS) ? MAX_BLOCKS : static_cast<int>(g);
}

}  // namespace pk::tp
