/*
 * ulysses_attn: the forward of Ulysses attention in one main kernel plus a small tail kernel:
 * the all-to-all of q, k, v from a sequence split to a head split, attention of one head group
 * over the whole sequence, and the all-to-all of the output back (reference:
 * pk_jax/ops/ulysses_attn.py).
 *
 * Shardings (rank r of P): q, o [B, Sl, H, D]; k, v [B, Sl, Hkv, D] (Sl = S / P; P divides H
 * and Hkv, Hkv divides H); lse float32 [B, H, Sl]. Rank r holds positions [r Sl, (r+1) Sl)
 * (contiguous). Head group g = query heads [g G, (g+1) G) (G = H / P) and K/V heads
 * [g Gk, (g+1) Gk) (Gk = Hkv / P); rank r computes head group r over all S positions.
 *
 * Workspace of rank r (sections 1024-aligned; "source s" = the rank whose rows they are):
 *   QW [P, B, Sl, G, D]   head group r of q, pushed by every source s != r into index s
 *   KW, VW [P, B, Sl, Gk, D]
 *   OW [P, B, Sl, G, D]   this rank's output of head group r, rows of source s at index s
 *   LW float32 [P, B, G, Sl]
 * Each section indexed by s * B + b is one 4-D TMA map {D, heads, Sl, P B}: a tile never reads
 * rows of the next source (rows past Sl arrive as zeros, as in the attention forward). Index r
 * stays unused: my own rows of head group r are read in place, through maps over the local
 * q, k, v ({D, H, Sl, B}, head r G + h), and their output goes straight to o and lse.
 *
 * Schedule (one call = epoch kernel, main kernel, tail kernel, on the caller's stream):
 *
 *   main kernel, comm block cb of rank r (C blocks first in the grid, so they are resident
 *   before any compute block spins on them): barrier ENTER with block cb of every peer; then
 *   for destinations g = r+1, ..., r+P-1 (mod P): thread 0 copies the block's 1/C share of
 *   the rows of q[:, :, head group g], k[...], v[...] into rank g's QW/KW/VW at index r (bulk
 *   copies through shared memory, pk/comm_ops.cuh row_pieces), then FULL[r][cb] on rank g
 *   (release at system scope); FULL[r][cb] on itself (no copy); finally wait FULL[s][cb] for
 *   every source s (after this kernel nobody writes my QW/KW/VW). One block copies too
 *   slowly for the exchange, which wants several (num_comm_sms).
 *   measured: ulysses_attention_notes.md, "Measurements moved from code comments (issue 37)".
 *
 *   main kernel, compute block (query tile of 128 rows of source s, local head h, batch b;
 *   not causal, the sources in the order r, r-1, ..., the order their rows arrive; causal,
 *   the longest rows first): pk.attention's forward block (attn::fwd_block: the same
 *   machine code around its source's hooks; two warpgroups at both head dims, 176-key tiles
 *   at D = 128 without a causal mask) over the source `pushed_keys`: its issuing thread
 *   waits FULL[s][*] before loading its Q tile (s != r), then streams the K/V tiles of the
 *   sources j = r, r-1, ..., r-P+1 (mod P: the order in which they arrive), waiting
 *   FULL[j][*] before its first tile of source j != r (each issuing thread once per source);
 *   causally hidden (source, tile) pairs are never loaded nor waited for. Stores O and lse of
 *   its rows into OW/LW (local), or of my own rows into o and lse.
 *
 *   tail kernel (TAIL blocks, the same count on every rank): block i barriers READY with block
 *   i of every peer (every peer's main kernel is over: its OW/LW are final), then copies its
 *   share of o[:, :, head group g] = OW of rank g at index r (thread 0, bulk copies), and lse
 *   likewise (warps 1..), for every g != r, then barriers DONE with block i of every peer:
 *   when my tail kernel is over, no peer reads my OW/LW any more (the next op may restage my
 *   workspace before any barrier of its own, as the collectives do).
 *
 * Signal protocol (slots SLOT_BASE.. of the pad; e = this call's epoch, pk/tp.cuh epoch_kernel):
 * ENTER[cb][s], FULL[s][cb] (written by source s's comm block cb on the rank that owns the head
 * group), READY[i][s], DONE[i][s]. Every wait is bounded and names the peer; compute blocks
 * wait 1/8 longer than the comm blocks, whose ENTER barrier names a dead rank first.
 *
 * Pitfalls: the signals are generic-proxy releases and acquires, the copies and the compute
 * blocks' TMA loads the async proxy: the copying thread fences (fence.proxy.async.global)
 * after its barrier and before its release, the compute block's issuer after its FULL
 * acquire. C (num_comm_sms) must be the same on every rank.
 * The output exchange is not overlapped with the compute (the tail kernel pulls once the main
 * kernel is over).
 */
#pragma once

#include "kernels/attention.cuh"
#include "kernels/ring_attn.cuh"
#include "pk/attn/peers.cuh"
#include "pk/collective.cuh"
#include "pk/tp.cuh"

namespace pk::ulysses_attn {

constexpr int MAX_PEERS = tp::MAX_PEERS;
constexpr int MAX_COMM = 16;   // communication blocks at most
constexpr int TAIL = 16;       // blocks of the tail kernel
constexpr int TAIL_THREADS = 512;

// Signal pad: slots SLOT_BASE + these offsets, right after ring attention's range.
constexpr uint64_t SLOT_BASE = ring_attn::SLOT_BASE + ring_attn::OP_SLOTS;
constexpr uint64_t OP_SLOTS = 1152;
constexpr uint64_t EPOCH = tp::EPOCH;                                  // local: calls so far
constexpr uint64_t ENTER = 16;                                         // [cb][s]
constexpr uint64_t FULL = ENTER + uint64_t(MAX_COMM) * MAX_PEERS;     // [s][cb]
constexpr uint64_t READY = FULL + uint64_t(MAX_PEERS) * MAX_COMM;     // [i][s]
constexpr uint64_t DONE = READY + uint64_t(TAIL) * MAX_PEERS;         // [i][s]
constexpr uint64_t END = DONE + uint64_t(TAIL) * MAX_PEERS;
constexpr uint64_t SLOTS_NEEDED = SLOT_BASE + OP_SLOTS;
static_assert(EPOCH < ENTER && END <= OP_SLOTS, "ulysses_attn: slot layout");
static_assert(SLOT_BASE >= ring_attn::SLOT_BASE + ring_attn::OP_SLOTS &&
                  SLOTS_NEEDED <= tp::SLOT_BASE,
              "ulysses_attn: the slot range must lie between ring attention's and the GEMMs'");

/** @brief Byte offsets of the workspace sections (see the header). */
struct layout {
  uint64_t qw, kw, vw, ow, lw, total;
};

__host__ __device__ inline uint64_t align1k(uint64_t x) { return (x + 1023) & ~uint64_t(1023); }

/** @brief The workspace layout for per-rank shapes b, sl, h, hkv, d (2-byte elements). */
__host__ __device__ inline layout make_layout(int64_t p, int64_t b, int64_t sl, int64_t h,
                                              int64_t hkv, int64_t d) {
  layout l{};
  const uint64_t qb = uint64_t(b) * sl * h * d * 2;     // = P B Sl G D 2
  const uint64_t kb = uint64_t(b) * sl * hkv * d * 2;
  l.qw = 0;
  l.kw = align1k(l.qw + qb);
  l.vw = align1k(l.kw + kb);
  l.ow = align1k(l.vw + kb);
  l.lw = align1k(l.ow + qb);
  l.total = align1k(l.lw + uint64_t(b) * h * sl * 4);
  (void)p;
  return l;
}

/** @brief Kernel arguments. Maps: {D, heads, Sl, P B} (ql, kl, vl: {D, H or Hkv, Sl, B}) with
 * boxes {64, 1, rows, 1}: rows = block_rows(D) for q, block_keys(D, causal) for k and v (the
 * compute blocks' configuration, launch_as). */
struct globals {
  CUtensorMap qw, kw, vw;  // my workspace's sections, index s B + b
  CUtensorMap ql, kl, vl;  // the local q, k, v: {D, H (Hkv), Sl, B}, boxes as above
  const void* q;           // local operands
  const void* k;
  const void* v;
  void* o;                 // [B, Sl, H, D]
  float* lse;              // [B, H, Sl]
  tp::comm c;
  attn::dims d;            // s = Sl, h = G, hkv = Gk (per head group)
  int heads, kv_heads;     // H, Hkv
  int head_dim;            // D
  int comm_blocks;         // C
  int q_tiles;             // ceil(Sl / block_rows(D))
  layout ws;
};

/** @brief After comm block cb's stores into rank dst's workspace: FULL[my rank][cb] there
 * (every thread fences its stores for the peer's TMA reads, then thread 0 releases them at
 * system scope). Call from all threads. */
__device__ inline void publish_full(const tp::comm& c, int dst, int cb, uint64_t e) {
  fence_proxy_async_global();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    signal(c.sig[dst] + FULL + uint64_t(c.rank) * MAX_COMM + cb, e);
  }
}

/** @brief Waits FULL[s][cb] of every source s on my pad: after it, no peer's comm block cb
 * writes my workspace in this call. */
__device__ inline void wait_all_full(const tp::comm& c, int cb, uint64_t e) {
  if (static_cast<int>(threadIdx.x) < c.world) {
    const int s = threadIdx.x;
    wait(c.sig[c.rank] + FULL + uint64_t(s) * MAX_COMM + cb, e, c.timeout_ns, c.fail(), s);
  }
}

/** @brief One communication block (see the schedule): thread 0 moves the block's share of
 * the rows with bulk copies through the block's shared memory. Call from all threads. */
template <class C>
__device__ void communicate(const globals& g, int cb, void* smem) {
  static_assert(sizeof(bulk_ring) + 1024 <= C::SMEM,
                "ulysses_attn: the bulk-copy ring must fit in the block's shared memory");
  bulk_ring& ring = *static_cast<bulk_ring*>(smem);
  const tp::comm& c = g.c;
  const int P = c.world, r = c.rank;
  const int nc = g.comm_blocks;
  const uint64_t e = c.epoch();
  const bool lead = threadIdx.x == 0;
  if (lead) ring.init();
  barrier<MAX_PEERS>(c.sig, P, r, ENTER + uint64_t(cb) * MAX_PEERS, e, c.timeout_ns, c.fail());
  const uint64_t rows = uint64_t(g.d.b) * g.d.s;  // (b, i) rows of the local operands
  const uint64_t lo = rows * cb / nc, n = rows * (cb + 1) / nc - lo;
  const uint64_t D2 = uint64_t(g.head_dim) * 2;
  const uint64_t gq = uint64_t(g.d.h) * D2, gk = uint64_t(g.d.hkv) * D2;  // bytes per row
  if (lead) fence_proxy_async_global();  // the barrier's acquires before the bulk writes
  // My own head group is read in place by my compute blocks: destinations r+1, ..., r+P-1.
  for (int i = 1; i < P; ++i) {
    const int dst = (r + i) % P;
    if (lead) {
      char* const ws = static_cast<char*>(c.ws[dst]);
      // Rows [lo, lo + n) of head group dst of q (t = 0), then of k and v, into index r there.
      auto rows_of = [&](int t) {
        const uint64_t heads = t == 0 ? g.heads : g.kv_heads, gb = t == 0 ? gq : gk;
        const void* src = t == 0 ? g.q : t == 1 ? g.k : g.v;
        const uint64_t sec = t == 0 ? g.ws.qw : t == 1 ? g.ws.kw : g.ws.vw;
        return row_pieces{static_cast<const char*>(src) + lo * heads * D2 + dst * gb,
                          ws + sec + (uint64_t(r) * rows + lo) * gb, heads * D2, gb, gb, n};
      };
      int t = 0;
      row_pieces part = rows_of(0);
      ring.link = c.link.peer(dst, r);  // the emulator's link throttle paces the pushes
      bulk_move<true>(ring, [&](bulk_piece* pc) {
        while (!part.next(pc, true)) {
          if (++t == 3) return false;
          part = rows_of(t);
        }
        return true;
      }, ring.link);
    }
    publish_full(c, dst, cb, e);
  }
  publish_full(c, r, cb, e);  // nothing to copy: my own rows are read in place
  wait_all_full(c, cb, e);
}

/**
 * @brief attn::fwd_block's source in a compute block (see the schedule): the block's
 * query tile (q_tiles tiles of BM rows per source, for every source, local head and batch),
 * its K/V stream over the sources in the order their rows arrive (mine, read in place, then
 * r-1, r-2, ...; causally hidden tiles left out), and where its O and lse go. Each thread has
 * its own copy: `seen`, the sources whose FULL signals this thread has acquired.
 */
template <class C, bool CAUSAL>
struct pushed_keys : attn::step_stream<pushed_keys<C, CAUSAL>> {
  using attn::step_stream<pushed_keys>::owner;
  int h, hk, b, src, q0, n_kv, own;  // own: causal, the visible key tiles of source src
  mutable uint32_t seen = 0;

  __device__ explicit pushed_keys(const globals& g) {
    const attn::dims& dm = g.d;
    const int P = g.c.world, rank = g.c.rank;
    const int idx = blockIdx.x - g.comm_blocks;
    h = idx % dm.h;
    const int rest = idx / dm.h;
    const int qt_all = rest % (g.q_tiles * P);  // over (source, tile)
    b = rest / (g.q_tiles * P);
    // Causal: the longest rows (late sources, late tiles) first. Otherwise the sources in the
    // order their rows arrive: mine (read in place), then r-1, r-2, ... (their comm blocks push
    // to r+1 first).
    const int qt = CAUSAL ? g.q_tiles * P - 1 - qt_all : qt_all;
    src = CAUSAL ? qt / g.q_tiles : (rank - qt / g.q_tiles + P) % P;
    q0 = (qt % g.q_tiles) * C::BM;
    hk = h / (dm.h / dm.hkv);
    n_kv = ceil_div(dm.s, C::BN);
    own = ceil_div(min(q0 + C::BM, dm.s), C::BN);
    this->n = 0;
    for (int t = 0; t < P; ++t) this->n += count(g, t);
    this->at_n = count(g, 0);
    while (this->at_n == 0) this->at_n = count(g, ++this->at_t);
    this->at_o = owner(g, this->at_t);
  }
  /** @brief The key tiles of the t-th source that the block's rows see: all of an earlier
   * source's, a prefix of its own, none of a later one's. */
  __device__ int count(const globals& g, int t) const {
    if (!CAUSAL) return n_kv;
    const int o = owner(g, t);
    return o < src ? n_kv : o == src ? own : 0;
  }
  /** @brief Stream tile j: key tile *kt of the t-th source (returned). */
  __device__ int item(const globals& g, int j, int* kt) const {
    if (!CAUSAL) {
      const int t = j / n_kv;
      *kt = j - t * n_kv;
      return t;
    }
    int t = 0;
    for (int c = count(g, 0); j >= c; c = count(g, ++t)) j -= c;
    *kt = j;
    return t;
  }
  /** @brief Before a TMA read of source o's rows in my workspace: FULL[o][*] acquired (once
   * per source and thread). My own rows are read in place. */
  __device__ void acquire(const globals& g, int o) const {
    if (o == g.c.rank || (seen >> o & 1)) return;
    const tp::comm& cm = g.c;
    const uint64_t e = cm.epoch(), long_wait = cm.timeout_ns + cm.timeout_ns / 8;
    for (int cb = 0; cb < g.comm_blocks; ++cb) {
      wait(cm.sig[cm.rank] + FULL + uint64_t(o) * MAX_COMM + cb, e, long_wait, cm.fail(), o);
    }
    fence_proxy_async_global();  // the acquires before the TMA reads of the section
    seen |= 1u << o;
  }
  __device__ int row0() const { return q0; }
  __device__ void load_q(const globals& g, typename C::q_tile& t, mbarrier* bar) const {
    const int rank = g.c.rank;
    if (src == rank) {
      attn::load_rows(t, &g.ql, bar, b, q0, rank * g.d.h + h);
    } else {
      acquire(g, src);
      attn::load_rows(t, &g.qw, bar, src * g.d.b + b, q0, h);
    }
  }
  /** @brief K (v = false) or V of stream tile j: my local k, v (head r Gk + hk) or my
   * workspace's copy. */
  __device__ void load_kv(const globals& g, typename C::kv_tile& t, mbarrier* bar, int j,
                          bool v) const {
    int kt;
    const int o = owner(g, item(g, j, &kt)), rank = g.c.rank;
    acquire(g, o);
    const bool local = o == rank;
    const CUtensorMap* map = local ? (v ? &g.vl : &g.kl) : (v ? &g.vw : &g.kw);
    attn::load_rows(t, map, bar, local ? b : o * g.d.b + b, kt * C::BN,
                         local ? rank * g.d.hkv + hk : hk);
  }
  __device__ void load_k(const globals& g, typename C::kv_tile& t, mbarrier* bar, int j) const {
    load_kv(g, t, bar, j, false);
  }
  __device__ void load_v(const globals& g, typename C::kv_tile& t, mbarrier* bar, int j) const {
    load_kv(g, t, bar, j, true);
  }
  /** @brief Masks keys past Sl and, in the block's own source, keys after the row (local
   * positions of one source compare as global ones); then the online-softmax update. Called
   * for stream tiles 0, 1, .. in order (j is at_t's tile at_kt). */
  __device__ void softmax(const globals& g, attn::fwd_rows<C>& r, int /*j*/, int wg_row0,
                          const int (&rows)[2], float sl2) const {
    const int k0 = this->at_kt * C::BN;
    const bool tail = k0 + C::BN > g.d.s;
    const bool diag = CAUSAL && this->at_o == src && k0 + C::BN - 1 > wg_row0;
    if (tail || diag) r.mask(k0, g.d.s, diag, [](int key) { return key; }, rows);
    r.softmax(sl2);
    this->next(g);
  }
  /** @brief O and lse of the warpgroup's rows: mine straight into o and lse (head r G + h),
   * a peer's into my OW / LW at index src B + b. */
  __device__ void store(const globals& g, attn::fwd_rows<C>& r, int wg_row0) const {
    const attn::dims& dm = g.d;
    const int rank = g.c.rank, sl = dm.s;
    if (src == rank) {
      const int hh = rank * dm.h + h;
      r.store(g.o, g.lse + (int64_t(b) * g.heads + hh) * sl, b, wg_row0, hh, g.heads, sl,
              dm.scale);
      return;
    }
    const int bz = src * dm.b + b;
    char* const ws = static_cast<char*>(g.c.ws[rank]);
    float* const lw = reinterpret_cast<float*>(ws + g.ws.lw);
    r.store(ws + g.ws.ow, lw + (int64_t(bz) * dm.h + h) * sl, bz, wg_row0, h, dm.h, sl,
            dm.scale);
  }
};

/** @brief The main kernel (see the schedule); CAUSAL = g.d.causal. */
template <class C, bool CAUSAL>
__global__ void __launch_bounds__(C::THREADS, 1) kernel(const __grid_constant__ globals g) {
  attn::comm_or_compute<C, pushed_keys<C, CAUSAL>>(
      g, [&](void* smem) { communicate<C>(g, blockIdx.x, smem); });
}

/** @brief The tail kernel (see the schedule): o and lse of my rows from every other head
 * group's owner (my own group's were stored in place). Thread 0 pulls the block's share of
 * each group's o rows with bulk copies; the other warps copy lse. */
static __global__ void __launch_bounds__(TAIL_THREADS) tail_kernel(
    const __grid_constant__ globals g) {
  bulk_ring& ring = dynamic_smem<bulk_ring>();
  const tp::comm& c = g.c;
  const int P = c.world, r = c.rank;
  const uint64_t e = c.epoch();
  const bool lead = threadIdx.x == 0;
  if (lead) ring.init();
  barrier<MAX_PEERS>(c.sig, P, r, READY + uint64_t(blockIdx.x) * MAX_PEERS, e, c.timeout_ns,
                     c.fail());
  const uint64_t rows = uint64_t(g.d.b) * g.d.s;
  const uint64_t gq = uint64_t(g.d.h) * g.head_dim * 2;  // bytes of a row of a head group
  const uint64_t lo = rows * blockIdx.x / gridDim.x, n = rows * (blockIdx.x + 1) / gridDim.x - lo;
  const uint64_t o_row = uint64_t(g.heads) * g.head_dim * 2;
  if (lead) {
    fence_proxy_async_global();  // READY's acquires before the bulk reads of the peers' OW
    // Rows [lo, lo + n) of o[:, :, head group grp] = OW of rank grp at index r; the blocks
    // start at different peers.
    for (int i = 1; i < P; ++i) {
      const int grp = (r + 1 + (i - 1 + blockIdx.x) % (P - 1)) % P;
      const char* const ow = static_cast<const char*>(c.ws[grp]) + g.ws.ow;
      row_pieces part{ow + (uint64_t(r) * rows + lo) * gq,
                      static_cast<char*>(g.o) + lo * o_row + grp * gq, gq, o_row, gq, n};
      ring.link = c.link.peer(grp, r);  // the emulator's link throttle paces the pulls
      bulk_move<true>(ring, [&](bulk_piece* pc) { return part.next(pc, true); }, ring.link);
    }
    fence_proxy_async_global();  // my bulk reads of the peers' OW before DONE's release
  } else if (threadIdx.x >= 32) {
    // lse [B, H, Sl]: head grp G + hl of batch bb = LW of rank grp at [r, bb, hl, :].
    const int G = g.d.h, sl = g.d.s;
    for (int row = blockIdx.x; row < g.d.b * g.heads; row += gridDim.x) {
      const int bb = row / g.heads, hh = row % g.heads, grp = hh / G;
      if (grp == r) continue;
      const float* lw = reinterpret_cast<const float*>(static_cast<const char*>(c.ws[grp]) +
                                                       g.ws.lw) +
                        ((int64_t(r) * g.d.b + bb) * G + hh % G) * sl;
      float* const out = g.lse + int64_t(row) * sl;
      for (int i = threadIdx.x - 32; i < sl; i += TAIL_THREADS - 32) out[i] = __ldcg(lw + i);
    }
  }
  barrier<MAX_PEERS>(c.sig, P, r, DONE + uint64_t(blockIdx.x) * MAX_PEERS, e, c.timeout_ns,
                     c.fail());
}

/** @brief The compute blocks' forward configuration: pk.attention's keys per tile
 * (attention::fwd_block_keys), two warpgroups at both head dims (the third that pk.attention
 * runs at D = 64 caps registers at 168, and this kernel's source spilled there). Its rows per
 * block and keys per tile are the maps' boxes. */
constexpr int block_rows(int /*d*/) { return 128; }
constexpr int block_keys(int d, bool causal) { return attention::fwd_block_keys(d, causal); }

/** @brief Launches the main grid (C comm blocks, then q_tiles P G B compute blocks, q_tiles
 * of block_rows(D)) and the tail kernel of one call (after the caller's epoch kernel). */
template <typename T, int D, int KEYS, bool CAUSAL>
inline cudaError_t launch_as(const globals& g, cudaStream_t stream, int device) {
  using C = attention::fwd_config<T, D, 2, KEYS>;
  static_assert(C::BM == block_rows(D), "ulysses_attn: rows per block");
  static_assert(C::SMEM + sizeof(wait_bound) <= 232448,
                "ulysses_attn: shared memory over the sm_90 limit of 227 KiB");
  const void* fn = reinterpret_cast<const void*>(&kernel<C, CAUSAL>);
  if (cudaError_t err = opt_in_smem(fn, device, static_cast<int>(C::SMEM)); err != cudaSuccess) {
    return err;
  }
  const int64_t blocks =
      int64_t(g.comm_blocks) + int64_t(g.q_tiles) * g.c.world * g.d.h * g.d.b;
  kernel<C, CAUSAL><<<static_cast<unsigned>(blocks), C::THREADS, C::SMEM, stream>>>(g);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  constexpr int TAIL_SMEM = sizeof(bulk_ring) + 1024;
  const void* tail = reinterpret_cast<const void*>(&tail_kernel);
  if (cudaError_t err = opt_in_smem(tail, device, TAIL_SMEM); err != cudaSuccess) return err;
  tail_kernel<<<TAIL, TAIL_THREADS, TAIL_SMEM, stream>>>(g);
  return cudaGetLastError();
}

/** @brief The call for head dim D (maps' boxes: block_rows(D), block_keys(D, g.d.causal)). */
template <typename T, int D>
inline cudaError_t launch(const globals& g, cudaStream_t stream, int device) {
  if (g.d.causal) return launch_as<T, D, block_keys(D, true), true>(g, stream, device);
  return launch_as<T, D, block_keys(D, false), false>(g, stream, device);
}

}  // namespace pk::ulysses_attn
