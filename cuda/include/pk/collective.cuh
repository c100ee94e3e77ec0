/**
 * @file collective.cuh
 * @brief The engine of the four P2P collectives (kernels/{all_reduce,all_gather,
 * reduce_scatter,all_to_all}.cuh): chunked rounds of "stage into my symmetric workspace,
 * barrier, pull from every peer's workspace, signal done".
 *
 * Every op is described by a per-destination index space f in [0, L) and two index maps:
 *
 *   stage-in  ws_me[d][f - lo] = x[(f / S) * P * S + d * S + f % S]   for d < D (1 or P)
 *   consume   SUM:    y[f] = sum_p ws_p[slot][f - lo]                     (slot 0 or rank)
 *             GATHER: y[(f / B) * P * B + p * B + f % B] = ws_p[slot][f - lo]
 *
 * all_reduce one-shot = D 1 + SUM; two-shot = D P + SUM into a second buffer, barrier, GATHER
 * from it; all_gather = D 1 + GATHER; reduce_scatter = D P + SUM; all_to_all = D P + GATHER.
 *
 * Data path. When every run and pointer is 16-byte aligned (the common case) data moves in bulk
 * copies (cp.async.bulk, the TMA engine's 1-D form) through the shared-memory ring of
 * pk/comm_ops.cuh (bulk_ring): moves (stage-in, GATHER) are runs of up to one stage loaded
 * global -> shared and stored shared -> global by one thread, loads running ahead of stores; SUM
 * loads the same piece from all P peers into one stage and every thread adds the P copies in
 * fp32 registers. Only the last < 16 bytes of an array go through plain loads and stores.
 * Otherwise (odd runs or pointers) the same schedule runs on per-thread vector loads and
 * stores of the widest unit that divides every run (8, 4 bytes or one element).
 *
 * Blocks are independent: block b owns region (parity, b) of every workspace and its own
 * signal slots, so there is no grid-wide synchronisation and the grid needs no residency
 * guarantee beyond "block b of every rank eventually runs".
 *
 * Signal pad layout (uint64 slots, from SLOT_BASE; SLOTS in total):
 *   counter[b]                  rounds block b has run on this communicator (local only)
 *   ready[b][s], ready2[b][s]   rank s staged round q (value q + 1) / wrote its reduced slice
 *   done[b][s]                  rank s finished reading my region of round q (value q + 1)
 * Round q of block b uses region parity q & 1; before staging it waits done >= q - 1, i.e.
 * every peer finished round q - 2, the last user of that region (double buffering, no end
 * barrier). All ranks run the same sequence of calls with the same grids, so counter[b] agrees
 * across ranks without any host help, and signals only grow (red.max), so a fast peer already
 * in the next round never confuses a slow one.
 *
 * Link throttle (rank emulator only, pk/link.cuh): bytes read from other ranks' workspaces are
 * paced on `g.link` when it is on: the bulk path per piece (gather: each run from a peer; sum:
 * each piece's P - 1 peer loads), the per-thread path per block and round; staging and reads
 * of the own workspace are local and never paced. Off, it is one branch per piece.
 *
 * Pitfalls: when a collective kernel returns, peers may still be reading this rank's regions
 * of its last rounds (the done-wait is deferred to the next collective on the communicator).
 * Another op that writes the same workspace must first meet every peer at a barrier (by stream
 * order each peer's previous kernel, hence its reads, has then finished) and must not itself
 * leave peers reading this rank's workspace when it returns. Calls on one communicator must be
 * issued on one stream in the same order on every rank.
 */
#pragma once

#include "pk/comm_ops.cuh"
#include "pk/sync.cuh"

#include <initializer_list>

namespace pk::coll {

constexpr int MAX_PEERS = 16;
constexpr int MAX_BLOCKS = 128;
constexpr int THREADS = 256;

constexpr uint64_t SLOT_BASE = 0;
constexpr uint64_t SLOT_COUNTER = SLOT_BASE;
constexpr uint64_t SLOT_READY = SLOT_COUNTER + MAX_BLOCKS;
constexpr uint64_t SLOT_READY2 = SLOT_READY + MAX_BLOCKS * MAX_PEERS;
constexpr uint64_t SLOT_DONE = SLOT_READY2 + MAX_BLOCKS * MAX_PEERS;
constexpr uint64_t SLOTS = SLOT_DONE + MAX_BLOCKS * MAX_PEERS;

/** @brief What the engine does after staging. */
enum kind : int { AR_ONESHOT = 0, AR_TWOSHOT = 1, GATHER = 2, SCATTER_SUM = 3, ALL_TO_ALL = 4 };

/** @brief Kernel arguments (by value, __grid_constant__). */
struct globals {
  void* ws[MAX_PEERS];       ///< every peer's workspace, mapped here
  uint64_t* sig[MAX_PEERS];  ///< every peer's signal pad, mapped here
  int32_t* error;            ///< host-mapped error record
  uint64_t timeout_ns;
  int32_t world, rank, op;
  const void* x;             ///< XLA input
  void* y;                   ///< XLA output
  const int32_t* rank_ptr;   ///< the rank operand (checked against `rank`)
  int64_t n;                 ///< elements of x
  int64_t n_out;             ///< elements of y
  int64_t L;                 ///< per-destination index space
  int64_t S;                 ///< stage-in run (elements)
  int64_t B;                 ///< gather run (elements)
  int64_t chunk;             ///< elements per destination per block per round (multiple of VEC)
  uint64_t region_bytes;     ///< bytes of one (parity, block) region, multiple of 16
  link_throttle link;        ///< the rank emulator's link cap (off: clock == nullptr)
};

template <int BYTES>
struct unit;
template <>
struct unit<16> { using type = uint4; };
template <>
struct unit<8> { using type = uint2; };
template <>
struct unit<4> { using type = unsigned int; };
template <>
struct unit<2> { using type = unsigned short; };

/** @brief Element type for sums (bf16/fp16/fp32) or a raw type of the element size (moves). */
template <typename T, int VEC>
struct engine {
  using U = typename unit<VEC * int(sizeof(T))>::type;

  __device__ static U load_unit(const T* p) { return __ldcg(reinterpret_cast<const U*>(p)); }
  __device__ static void store_unit(T* p, U v) { *reinterpret_cast<U*>(p) = v; }

  /** @brief ws_me[d][f - lo] for every d < D and f in [lo, hi). */
  __device__ static void stage(const globals& g, T* mine, int D, int64_t lo, int64_t hi) {
    const int64_t units = ceil_div<int64_t>(hi - lo, VEC);
    const T* x = static_cast<const T*>(g.x);
    for (int64_t i = threadIdx.x; i < D * units; i += THREADS) {
      const int d = static_cast<int>(i / units);
      const int64_t f = lo + (i - d * units) * VEC;
      const int64_t idx = (f / g.S) * g.world * g.S + d * g.S + f % g.S;
      T* dst = mine + d * g.chunk + (f - lo);
      if (f + VEC <= hi && idx + VEC <= g.n) {
        store_unit(dst, *reinterpret_cast<const U*>(x + idx));
      } else {
        for (int e = 0; e < VEC; ++e) {
          dst[e] = (f + e < hi && idx + e < g.n) ? x[idx + e] : T{};
        }
      }
    }
  }

  /** @brief dst[f] = sum over peers of src_p[f - lo], f in [lo, hi). */
  __device__ static void sum(const globals& g, uint64_t src_off, T* dst, int64_t lo, int64_t hi) {
    const int64_t units = ceil_div<int64_t>(hi - lo, VEC);
    for (int64_t u = threadIdx.x; u < units; u += THREADS) {
      const int64_t f = lo + u * VEC;
      const uint64_t off = src_off + (f - lo) * sizeof(T);
      if constexpr (VEC * sizeof(T) == 16) {
        if (f + VEC <= hi) {
          store_unit(dst + f, p2p::reduce<T, MAX_PEERS>(g.ws, g.world, off));
          continue;
        }
      }
      for (int e = 0; e < VEC && f + e < hi; ++e) {
        dst[f + e] = p2p::reduce_scalar<T, MAX_PEERS>(g.ws, g.world, off + e * sizeof(T));
      }
    }
  }

  /** @brief y[(f / B) * P * B + p * B + f % B] = src_p[f - lo] for every peer p. */
  __device__ static void gather(const globals& g, uint64_t src_off, int64_t lo, int64_t hi) {
    const int64_t units = ceil_div<int64_t>(hi - lo, VEC);
    T* y = static_cast<T*>(g.y);
    for (int64_t i = threadIdx.x; i < g.world * units; i += THREADS) {
      const int p = static_cast<int>(i / units);
      const int64_t f = lo + (i - p * units) * VEC;
      const int64_t o = (f / g.B) * g.world * g.B + p * g.B + f % g.B;
      const T* src = reinterpret_cast<const T*>(static_cast<const char*>(g.ws[p]) + src_off) +
                     (f - lo);
      if (f + VEC <= hi && o + VEC <= g.n_out) {
        store_unit(y + o, load_unit(src));
      } else {
        for (int e = 0; e < VEC; ++e) {
          if (f + e < hi && o + e < g.n_out) y[o + e] = __ldcg(src + e);
        }
      }
    }
  }
};

/** @brief Walks lanes d < D over f in [lo, hi) in runs cut at multiples of R and at `max`. */
struct run_walker {
  int D;
  int64_t lo, hi, R, max;
  int d = 0;
  int64_t f;

  __device__ run_walker(int D_, int64_t lo_, int64_t hi_, int64_t R_, int64_t max_)
      : D(D_), lo(lo_), hi(hi_), R(R_), max(max_), f(lo_) {}
  /** @brief The next run [*f0, *f1) of lane *lane; false when every lane is done. */
  __device__ bool next(int* lane, int64_t* f0, int64_t* f1) {
    if (d >= D || lo >= hi) return false;
    int64_t e = (f / R + 1) * R;
    e = e < hi ? e : hi;
    e = e < f + max ? e : f + max;
    *lane = d;
    *f0 = f;
    *f1 = e;
    f = e;
    if (f >= hi) {
      f = lo;
      ++d;
    }
    return true;
  }
};

/** @brief The 16-byte (bulk-copy) data path of the engine; same maps as `engine`. */
template <typename T>
struct bulk {
  static constexpr int64_t UNIT = 16 / sizeof(T);
  static constexpr int64_t MOVE_MAX = bulk_ring::STAGE_BYTES / sizeof(T);

  /** @brief Where run [f0, ...) of lane d goes: addresses and elements left in the array. */
  struct run_at {
    const T* src;
    T* dst;
    int64_t room;
  };

  /**
   * @brief Thread 0: moves lanes d < D over [lo, hi) in runs cut at multiples of R; at(d, f0)
   * places each run, which is clipped to its room (array ends; the last < 16 bytes go through
   * plain accesses). Lanes other than `local` (a peer's data; -1: none) are paced on `link`.
   */
  template <class At>
  __device__ static void move_runs(bulk_ring& sm, int D, int64_t lo, int64_t hi, int64_t R,
                                   At at, const link_throttle& link = {}, int local = -1) {
    run_walker w(D, lo, hi, R, MOVE_MAX);
    bulk_move(sm, [&](bulk_piece* pc) {
      int d;
      int64_t f0, f1;
      while (w.next(&d, &f0, &f1)) {
        const run_at r = at(d, f0);
        const int64_t len = f1 - f0 < r.room ? f1 - f0 : r.room;
        if (len <= 0) continue;
        pc->src = reinterpret_cast<const char*>(r.src);
        pc->dst = reinterpret_cast<char*>(r.dst);
        pc->bytes = split_tail(pc->src, pc->dst, len * int64_t(sizeof(T)));
        pc->paced = d != local;
        if (pc->bytes > 0) return true;
      }
      return false;
    }, link);
  }

  /** @brief ws_me[d][f - lo] = x[...] (thread 0). Elements past n are left as they are. */
  __device__ static void stage(const globals& g, bulk_ring& sm, T* mine, int D, int64_t lo,
                               int64_t hi) {
    const T* x = static_cast<const T*>(g.x);
    move_runs(sm, D, lo, hi, g.S, [&](int d, int64_t f0) {
      const int64_t idx = (f0 / g.S) * g.world * g.S + d * g.S + f0 % g.S;
      return run_at{x + idx, mine + d * g.chunk + (f0 - lo), g.n - idx};
    });  // local: never paced
  }

  /** @brief y[(f / B) P B + p B + f % B] = src_p[f - lo] for every peer p (thread 0). */
  __device__ static void gather(const globals& g, bulk_ring& sm, uint64_t src_off, int64_t lo,
                                int64_t hi) {
    T* y = static_cast<T*>(g.y);
    move_runs(sm, g.world, lo, hi, g.B, [&](int p, int64_t f0) {
      const int64_t o = (f0 / g.B) * g.world * g.B + p * g.B + f0 % g.B;
      const T* src = reinterpret_cast<const T*>(static_cast<const char*>(g.ws[p]) + src_off);
      return run_at{src + (f0 - lo), y + o, g.n_out - o};
    }, g.link, g.rank);
  }

  /**
   * @brief dst[f] = sum over peers of src_p[f - lo], f in [lo, hi) (all threads): each piece
   * is loaded from the P peers into one stage, then summed from shared memory in fp32.
   */
  __device__ static void sum(const globals& g, bulk_ring& sm, uint64_t src_off, T* dst,
                             int64_t lo, int64_t hi) {
    const int P = g.world;
    const int64_t piece_elems = (bulk_ring::STAGE_BYTES / P) / 16 * UNIT;  // per peer
    const int64_t bulk_hi = lo + (hi - lo) / UNIT * UNIT;
    const int n = static_cast<int>(ceil_div<int64_t>(bulk_hi - lo, piece_elems));
    const uint32_t phase = sm.phase;
    uint64_t due = 0;  // thread 0: end of the last piece's link time
    auto issue = [&](int i) {
      const int s = i % bulk_ring::STAGES;
      const int64_t f = lo + i * piece_elems;
      const int64_t len = bulk_hi - f < piece_elems ? bulk_hi - f : piece_elems;
      const uint32_t bytes = static_cast<uint32_t>(len * sizeof(T));
      if (g.link.on()) due = g.link.pace(uint64_t(bytes) * (P - 1));  // the peers' copies
      mbar_arrive_expect_tx(&sm.bar[s], bytes * P);
      for (int p = 0; p < P; ++p) {
        load_async(sm.buf[s] + p * piece_elems * sizeof(T),
                   static_cast<const char*>(g.ws[p]) + src_off + (f - lo) * sizeof(T), bytes,
                   &sm.bar[s]);
      }
    };
    if (threadIdx.x == 0) {
      for (int i = 0; i < n && i < bulk_ring::STAGES; ++i) issue(i);
    }
    for (int i = 0; i < n; ++i) {
      const int s = i % bulk_ring::STAGES;
      mbar_wait(&sm.bar[s], ((phase >> s) ^ (i / bulk_ring::STAGES)) & 1);
      const int64_t f = lo + i * piece_elems;
      const int64_t units = (bulk_hi - f < piece_elems ? bulk_hi - f : piece_elems) / UNIT;
      for (int64_t u = threadIdx.x; u < units; u += THREADS) {
        p2p::acc16<T> acc;
        acc.zero();
#pragma unroll 4
        for (int p = 0; p < P; ++p) {
          acc.add(*reinterpret_cast<const uint4*>(sm.buf[s] + (p * piece_elems + u * UNIT) *
                                                                   sizeof(T)));
        }
        p2p::st16(dst + f + u * UNIT, acc.pack());
      }
      __syncthreads();  // stage s read by every thread
      if (threadIdx.x == 0 && i + bulk_ring::STAGES < n) issue(i + bulk_ring::STAGES);
    }
    for (int64_t f = bulk_hi + threadIdx.x; f < hi; f += THREADS) {
      dst[f] = p2p::reduce_scalar<T, MAX_PEERS>(g.ws, P, src_off + (f - lo) * sizeof(T));
    }
    if (threadIdx.x == 0) {
      g.link.drain(due);
      sm.phase = advance_phase(phase, n);
    }
  }
};

/** @brief Whether kernel<T, VEC, KIND> runs the bulk-copy path (16-byte units). */
template <typename T, int VEC>
constexpr bool BULK = VEC * sizeof(T) == 16;

/** @brief One collective; see the file comment. */
template <typename T, int VEC, int KIND>
__global__ void __launch_bounds__(THREADS, 1) kernel(const __grid_constant__ globals g) {
  using E = engine<T, VEC>;
  using X = bulk<T>;
  constexpr bool B16 = BULK<T, VEC>;
  extern __shared__ __align__(128) char dyn_smem[];  // bulk_ring when B16, else empty
  bulk_ring& sm = *reinterpret_cast<bulk_ring*>(dyn_smem);
  const int P = g.world;
  const int r = g.rank;
  const int b = blockIdx.x;
  const bool lead = threadIdx.x == 0;
  const fail_ctx fc{g.error, g.op, r};
  __shared__ uint64_t s_base;
  if (lead) {
    block_wait_bound() = peer_wait_bound(g.error, g.op, r, g.timeout_ns);
    const int32_t got = *g.rank_ptr;
    if (got != r) fail(fc, ERR_RANK_MISMATCH, got);
    s_base = g.sig[r][SLOT_COUNTER + b];  // only this block of this device writes it
    if constexpr (B16) {
      sm.init();
    }
  }
  __syncthreads();
  const int D = (KIND == AR_ONESHOT || KIND == GATHER) ? 1 : P;
  const int slot = (KIND == AR_ONESHOT || KIND == GATHER) ? 0 : r;
  const int64_t c = g.chunk;
  // The barriers' signals are generic-proxy releases and acquires; bulk copies are the async
  // proxy, so the thread issuing them fences between the two (both directions).
  auto peer_barrier = [&](uint64_t row, uint64_t e) {
    if (B16 && lead) fence_proxy_async_global();
    barrier<MAX_PEERS>(g.sig, P, r, row + b * MAX_PEERS, e, g.timeout_ns, fc);
    if (B16 && lead) fence_proxy_async_global();
  };
  auto gather = [&](uint64_t src_off, int64_t lo, int64_t hi) {
    if constexpr (B16) {
      if (lead) X::gather(g, sm, src_off, lo, hi);
    } else {
      E::gather(g, src_off, lo, hi);
    }
  };
  auto sum = [&](uint64_t src_off, T* dst, int64_t lo, int64_t hi) {
    if constexpr (B16) {
      X::sum(g, sm, src_off, dst, lo, hi);
    } else {
      E::sum(g, src_off, dst, lo, hi);
    }
  };
  uint64_t q = s_base;
  for (int64_t lo = int64_t(b) * c; lo < g.L; lo += c * gridDim.x, ++q) {
    const int64_t hi = lo + c < g.L ? lo + c : g.L;
    const uint64_t roff = uint64_t((q & 1) * MAX_BLOCKS + b) * g.region_bytes;
    T* mine = reinterpret_cast<T*>(static_cast<char*>(g.ws[r]) + roff);

    // Region (q & 1, b) was last read by the peers in round q - 2.
    if (q >= 2 && static_cast<int>(threadIdx.x) < P) {
      wait(g.sig[r] + SLOT_DONE + b * MAX_PEERS + threadIdx.x, q - 1, g.timeout_ns, fc,
           threadIdx.x);
    }
    __syncthreads();
    // The done acquires (generic proxy) before the bulk stores that restage the region.
    if (B16 && lead) fence_proxy_async_global();
    if constexpr (B16) {
      if (lead) X::stage(g, sm, mine, D, lo, hi);
    } else {
      E::stage(g, mine, D, lo, hi);
    }
    peer_barrier(SLOT_READY, q + 1);

    const uint64_t src_off = roff + uint64_t(slot) * c * sizeof(T);
    if constexpr (KIND == AR_ONESHOT || KIND == SCATTER_SUM) {
      sum(src_off, static_cast<T*>(g.y), lo, hi);
    } else if constexpr (KIND == AR_TWOSHOT) {
      // Reduce my slice into buffer B of my region, then gather every rank's slice from theirs.
      const uint64_t red_off = roff + uint64_t(D) * c * sizeof(T);
      sum(src_off, reinterpret_cast<T*>(static_cast<char*>(g.ws[r]) + red_off) - lo, lo, hi);
      peer_barrier(SLOT_READY2, q + 1);
      gather(red_off, lo, hi);
    } else {
      gather(src_off, lo, hi);
    }
    if constexpr (!B16) {
      // Per-thread path: the block's peer reads of this round, paced after the fact.
      const int64_t peer_bytes = (hi - lo) * int64_t(sizeof(T)) * (P - 1);
      g.link.pace_block(uint64_t(KIND == AR_TWOSHOT ? 2 * peer_bytes : peer_bytes));
    }

    __syncthreads();
    if (lead) {
      // The peers' regions were read by bulk copies (async proxy) and by plain loads: order
      // both before the done release, so a peer never restages under an unfinished read.
      if constexpr (B16) fence_proxy_async_global();
      __threadfence_system();
      for (int p = 0; p < P; ++p) signal(g.sig[p] + SLOT_DONE + b * MAX_PEERS + r, q + 1);
    }
  }
  if (lead) g.sig[r][SLOT_COUNTER + b] = q;
}

/** @brief Host-side plan of one call: grid, chunk and vector width. */
struct plan {
  int grid;
  int vec_bytes;
  int64_t chunk;
  uint64_t region_bytes;
};

/**
 * @brief Plans a call over L per-destination elements of `esize` bytes with D staged
 * destinations (+1 buffer for two-shot). Returns false when the workspace cannot hold one
 * 16-byte unit per destination; `need` is then the smallest workspace that can.
 */
inline bool make_plan(int64_t L, int esize, int D, bool twoshot, uint64_t ws_bytes,
                      int vec_bytes, plan* out, uint64_t* need) {
  const uint64_t bufs = uint64_t(D) + (twoshot ? 1 : 0);
  const uint64_t region = (ws_bytes / (2 * MAX_BLOCKS)) / 16 * 16;
  const uint64_t chunk_max_bytes = region / bufs / 16 * 16;
  *need = 2ull * MAX_BLOCKS * bufs * 16;
  if (chunk_max_bytes < 16) return false;
  const int64_t bytes = L * esize;
  int64_t grid = ceil_div<int64_t>(bytes, 8192);
  grid = grid < 1 ? 1 : (grid > MAX_BLOCKS ? MAX_BLOCKS : grid);
  const int64_t unit_elems = 16 / esize;
  int64_t chunk = ceil_div<int64_t>(ceil_div<int64_t>(L, grid), unit_elems) * unit_elems;
  const int64_t chunk_max = int64_t(chunk_max_bytes) / esize;
  if (chunk > chunk_max) chunk = chunk_max;
  if (chunk < 1) chunk = unit_elems;
  // Fewer blocks when the chunk already covers the data.
  const int64_t used = ceil_div<int64_t>(L, chunk);
  if (used < grid) grid = used < 1 ? 1 : used;
  out->grid = static_cast<int>(grid);
  out->vec_bytes = vec_bytes;
  out->chunk = chunk;
  out->region_bytes = region;
  return true;
}

/** @brief Launches kernel<T, VEC, KIND> with the shared memory its path needs. */
template <typename T, int VEC, int KIND>
inline cudaError_t launch_vec(const globals& g, const plan& pl, cudaStream_t stream, int device) {
  const void* fn = reinterpret_cast<const void*>(&kernel<T, VEC, KIND>);
  const int smem = BULK<T, VEC> ? int(sizeof(bulk_ring)) : 0;
  if (smem > 0) {
    if (cudaError_t err = opt_in_smem(fn, device, smem); err != cudaSuccess) return err;
  }
  kernel<T, VEC, KIND><<<pl.grid, THREADS, smem, stream>>>(g);
  return cudaGetLastError();
}

/** @brief Launches kernel<T, VEC, KIND> for the plan's vector width. */
template <typename T, int KIND>
inline cudaError_t launch(const globals& g, const plan& pl, cudaStream_t stream, int device) {
  if (pl.vec_bytes == 16) return launch_vec<T, 16 / sizeof(T), KIND>(g, pl, stream, device);
  if constexpr (KIND == GATHER || KIND == ALL_TO_ALL) {
    if (pl.vec_bytes == 8) return launch_vec<T, 8 / sizeof(T), KIND>(g, pl, stream, device);
    if constexpr (sizeof(T) <= 2) {
      if (pl.vec_bytes == 4) return launch_vec<T, 4 / sizeof(T), KIND>(g, pl, stream, device);
    }
  }
  return launch_vec<T, 1, KIND>(g, pl, stream, device);
}

/** @brief Largest unit (16, 8, 4 bytes or the element) dividing every run and aligned. */
inline int vec_bytes_for(int esize, bool moves, std::initializer_list<int64_t> runs,
                         std::initializer_list<const void*> ptrs) {
  for (int vb : {16, 8, 4}) {
    if (vb < esize) break;
    if (!moves && vb != 16) break;
    bool ok = true;
    for (int64_t run : runs) ok = ok && (run * esize) % vb == 0;
    for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % vb == 0;
    if (ok) return vb;
  }
  return esize;
}

}  // namespace pk::coll

namespace pk::coll {

/** @brief Result of a host-side launch: a CUDA error, or a workspace too small. */
struct launch_status {
  cudaError_t err = cudaSuccess;
  uint64_t ws_needed = 0;  ///< nonzero: the workspace is too small; this many bytes would do
};

/**
 * @brief Plans and launches KIND on elements of type T. `g` has the communicator, buffers,
 * n, n_out, L, S and B filled in; chunk and region_bytes are set here.
 */
template <typename T, int KIND>
inline launch_status run(globals g, uint64_t ws_bytes, int vec_bytes, cudaStream_t stream,
                         int device) {
  launch_status st;
  const int D = (KIND == AR_ONESHOT || KIND == GATHER) ? 1 : g.world;
  plan pl;
  uint64_t need = 0;
  if (!make_plan(g.L, sizeof(T), D, KIND == AR_TWOSHOT, ws_bytes, vec_bytes, &pl, &need)) {
    st.ws_needed = need;
    return st;
  }
  if (g.L == 0) return st;
  g.chunk = pl.chunk;
  g.region_bytes = pl.region_bytes;
  st.err = launch<T, KIND>(g, pl, stream, device);
  return st;
}

}  // namespace pk::coll
