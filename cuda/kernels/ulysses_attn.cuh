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
 *   QW [P, B, Sl, G, D]   head group r of q, pushed by every source s into index s
 *   KW, VW [P, B, Sl, Gk, D]
 *   OW [P, B, Sl, G, D]   this rank's output of head group r, rows of source s at index s
 *   LW float32 [P, B, G, Sl]
 * Each section indexed by s * B + b is one 4-D TMA map {D, heads, Sl, P B}: a tile never reads
 * rows of the next source (rows past Sl arrive as zeros, as in the attention forward).
 *
 * Schedule (one call = epoch kernel, main kernel, tail kernel, on the caller's stream):
 *
 *   main kernel, comm block cb of rank r (C blocks first in the grid, so they are resident
 *   before any compute block spins on them): barrier ENTER with block cb of every peer; then
 *   for destinations g = r, r+1, ..., r+P-1 (mod P): all 256 threads copy their 1/C share of
 *   q[:, :, head group g], k[...], v[...] into rank g's QW/KW/VW at index r (16-byte units;
 *   peer stores), then FULL[r][cb] on rank g (release at system scope); finally wait
 *   FULL[s][cb] for every source s (after this kernel nobody writes my QW/KW/VW).
 *
 *   main kernel, compute block (query tile of 128 rows of source s, local head h, batch b):
 *   the attention forward's block (kernels/attention.cuh) with the ring kernel's item stream:
 *   waits FULL[s][*] before loading its Q tile, then folds the K/V tiles of the sources
 *   j = r, r-1, ..., r-P+1 (mod P: the order in which they arrive), waiting FULL[j][*] before
 *   the first tile of source j; causally hidden (source, tile) pairs are never loaded nor
 *   waited for. Stores O and lse of its rows into OW/LW (local).
 *
 *   tail kernel (TAIL blocks, the same count on every rank): block i barriers READY with block
 *   i of every peer (every peer's main kernel is over: its OW/LW are final), then copies its
 *   share of o[:, :, head group g] = OW of rank g at index r, and lse likewise, for every g
 *   (peer loads), then barriers DONE with block i of every peer: when my tail kernel is over,
 *   no peer reads my OW/LW any more (the next op may restage my workspace before any barrier
 *   of its own, as the collectives do).
 *
 * Signal protocol (slots SLOT_BASE.. of the pad; e = this call's epoch, pk/tp.cuh epoch_kernel):
 * ENTER[cb][s], FULL[s][cb] (written by source s's comm block cb on the rank that owns the head
 * group), READY[i][s], DONE[i][s]. Every wait is bounded and names the peer; compute blocks
 * wait 1/8 longer than the comm blocks, whose ENTER barrier names a dead rank first.
 *
 * Pitfalls: the comm blocks write with generic stores and the compute blocks read with TMA
 * (async proxy): writers fence (fence.proxy.async.global) before their release, the compute
 * block's issuer after its FULL acquire. C (num_comm_sms) must be the same on every rank.
 * The output exchange is not overlapped with the compute (the tail kernel pulls once the main
 * kernel is over).
 */
#pragma once

#include "kernels/attention.cuh"
#include "kernels/ring_attn.cuh"
#include "pk/collective.cuh"
#include "pk/tp.cuh"

namespace pk::ulysses_attn {

using attention::CONSUMERS;
using attention::LOG2E;
using attention::THREADS;

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

/** @brief Kernel arguments. Maps: {D, heads, Sl, P B} with boxes {64, 1, 128, 1}. */
struct globals {
  CUtensorMap qw, kw, vw;  // my workspace's sections, index s B + b
  const void* q;           // local operands
  const void* k;
  const void* v;
  void* o;                 // [B, Sl, H, D]
  float* lse;              // [B, H, Sl]
  tp::comm c;
  attention::dims d;       // s = Sl, h = G, hkv = Gk (per head group)
  int heads, kv_heads;     // H, Hkv
  int head_dim;            // D
  int comm_blocks;         // C
  int q_tiles;             // ceil(Sl / 128)
  layout ws;
};

enum tile_kind : int { HIDDEN = 0, FULL_TILE = 1, PARTIAL = 2 };

/** @brief Copies 16-byte units [lo, hi) of a row-chunked gather: unit u of row u / upr goes
 * from src + row * src_row + col to dst + row * dst_row + col (bytes), by all threads. */
__device__ inline void copy_rows(char* dst, const char* src, uint64_t upr, uint64_t src_row,
                                 uint64_t dst_row, uint64_t lo, uint64_t hi) {
  constexpr int U = 4;
  const uint64_t step = blockDim.x;
  auto s_at = [&](uint64_t u) { return src + (u / upr) * src_row + (u % upr) * 16; };
  auto d_at = [&](uint64_t u) { return dst + (u / upr) * dst_row + (u % upr) * 16; };
  uint64_t u = lo + threadIdx.x;
  for (; u + (U - 1) * step < hi; u += U * step) {
    uint4 x[U];
#pragma unroll
    for (int i = 0; i < U; ++i) x[i] = p2p::ld16(s_at(u + i * step));
#pragma unroll
    for (int i = 0; i < U; ++i) p2p::st16(d_at(u + i * step), x[i]);
  }
  for (; u < hi; u += step) p2p::st16(d_at(u), p2p::ld16(s_at(u)));
}

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

/** @brief One communication block (see the schedule). Call from all threads. */
__device__ inline void communicate(const globals& g, int cb) {
  const tp::comm& c = g.c;
  const int P = c.world, r = c.rank;
  const int nc = g.comm_blocks;
  const uint64_t e = c.epoch();
  barrier<MAX_PEERS>(c.sig, P, r, ENTER + uint64_t(cb) * MAX_PEERS, e, c.timeout_ns, c.fail());
  const uint64_t rows = uint64_t(g.d.b) * g.d.s;  // (b, i) rows of the local operands
  const uint64_t D2 = uint64_t(g.head_dim) * 2;
  const uint64_t gq = uint64_t(g.d.h) * D2, gk = uint64_t(g.d.hkv) * D2;  // bytes per row
  for (int i = 0; i < P; ++i) {
    const int dst = (r + i) % P;
    char* const ws = static_cast<char*>(c.ws[dst]);
    // Q: units of this block over rows * gq / 16, then K and V likewise.
    const uint64_t uq = gq / 16, uk = gk / 16;
    const uint64_t nq = rows * uq, nk = rows * uk;
    copy_rows(ws + g.ws.qw + uint64_t(r) * rows * gq,
              static_cast<const char*>(g.q) + uint64_t(dst) * gq, uq, uint64_t(g.heads) * D2,
              gq, nq * cb / nc, nq * (cb + 1) / nc);
    copy_rows(ws + g.ws.kw + uint64_t(r) * rows * gk,
              static_cast<const char*>(g.k) + uint64_t(dst) * gk, uk,
              uint64_t(g.kv_heads) * D2, gk, nk * cb / nc, nk * (cb + 1) / nc);
    copy_rows(ws + g.ws.vw + uint64_t(r) * rows * gk,
              static_cast<const char*>(g.v) + uint64_t(dst) * gk, uk,
              uint64_t(g.kv_heads) * D2, gk, nk * cb / nc, nk * (cb + 1) / nc);
    publish_full(c, dst, cb, e);
  }
  wait_all_full(c, cb, e);
}

template <class C>
__global__ void __launch_bounds__(THREADS, 1) kernel(const __grid_constant__ globals g) {
  using T = typename C::dtype;
  constexpr int BM = C::BM, BN = C::BN, STAGES = C::STAGES;
  auto& s = dynamic_smem<typename C::storage_t>();
  if (threadIdx.x == 0) {
    // NOTES: mbarrier waits get a quarter more than the signal waits, so a missing peer is
    // named by the signal wait (peer known) before an mbarrier wait gives up (peer -1).
    block_wait_bound() =
        wait_bound{g.c.error, g.c.op, g.c.rank, g.c.timeout_ns + g.c.timeout_ns / 4};
  }
  if (static_cast<int>(blockIdx.x) < g.comm_blocks) {
    __syncthreads();
    communicate(g, blockIdx.x);
    return;
  }
  const attention::dims& dm = g.d;
  const tp::comm& cm = g.c;
  const int P = cm.world, rank = cm.rank;
  const int idx = blockIdx.x - g.comm_blocks;
  const int h = idx % dm.h;
  const int rest = idx / dm.h;
  const int qt_all = rest % (g.q_tiles * P);  // over (source, tile)
  const int b = rest / (g.q_tiles * P);
  // Causal: the longest rows (late sources, late tiles) first.
  const int qt = dm.causal ? g.q_tiles * P - 1 - qt_all : qt_all;
  const int src = qt / g.q_tiles;
  const int q0 = (qt % g.q_tiles) * BM;
  const int hk = h / (dm.h / dm.hkv);
  const int n_kv = ceil_div(dm.s, BN);
  const int sl = dm.s;
  const int q_first = src * sl + q0, q_last = src * sl + min(q0 + BM, sl) - 1;
  const uint64_t e = cm.epoch();
  const uint64_t long_wait = cm.timeout_ns + cm.timeout_ns / 8;

  // Item (t, n): key tile n of source (rank - t) mod P.
  auto owner_of = [&](int t) { return (rank - t + P) % P; };
  auto kind = [&](int t, int n) -> int {
    if (!dm.causal) return FULL_TILE;
    const int k_first = owner_of(t) * sl + n * BN;
    const int k_last = owner_of(t) * sl + min(n * BN + BN, sl) - 1;
    if (k_first > q_last) return HIDDEN;
    return k_last <= q_first ? FULL_TILE : PARTIAL;
  };
  struct item {
    int t, n;
  };
  auto advance = [&](item it) {
    do {
      if (++it.n == n_kv) {
        it.n = 0;
        ++it.t;
      }
    } while (it.t < P && kind(it.t, it.n) == HIDDEN);
    return it;
  };
  auto wait_source = [&](int j) {
    for (int cb = 0; cb < g.comm_blocks; ++cb) {
      wait(cm.sig[rank] + FULL + uint64_t(j) * MAX_COMM + cb, e, long_wait, cm.fail(), j);
    }
    fence_proxy_async_global();  // the acquires before the TMA reads of the section
  };

  const bool issuer = threadIdx.x == attention::LAST_LEADER;
  item pit{0, -1};  // the issuer's next item to load
  int waited = -1;  // the issuer has seen FULL for the sources of items t <= waited
  auto issue = [&](int j) {
    const int st = j % STAGES;
    const item it = pit;
    if (it.t > waited) {
      const int own = owner_of(it.t);
      if (own != src) wait_source(own);  // the Q source was waited for before the Q load
      waited = it.t;
    }
    const int bz = owner_of(it.t) * dm.b + b;
    mbar_arrive_expect_tx(&s.k_full[st], C::kv_tile::BYTES);
    attention::load_rows(s.k[st], &g.kw, &s.k_full[st], bz, it.n * BN, hk);
    mbar_arrive_expect_tx(&s.v_full[st], C::kv_tile::BYTES);
    attention::load_rows(s.v[st], &g.vw, &s.v_full[st], bz, it.n * BN, hk);
    pit = advance(pit);
  };
  if (issuer) {
    pit = advance(pit);
    mbar_init(&s.q_full, 1);
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&s.k_full[i], 1);
      mbar_init(&s.v_full[i], 1);
      mbar_init(&s.empty[i], CONSUMERS);
    }
    fence_mbar_init();
    wait_source(src);
    mbar_arrive_expect_tx(&s.q_full, C::q_tile::BYTES);
    attention::load_rows(s.q, &g.qw, &s.q_full, src * dm.b + b, q0, h);
    for (int j = 0; j < STAGES && pit.t < P; ++j) issue(j);
  }
  __syncthreads();

  const int c = warpgroup::index();
  const int t = warpgroup::thread();
  const int lane = t % 32;
  auto release = [&](int r) {
    const int st = r % STAGES;
    if (t == 0) mbar_arrive(&s.empty[st]);
    if (issuer && pit.t < P) {
      mbar_wait(&s.empty[st], (r / STAGES) & 1);
      issue(r + STAGES);
    }
    __syncwarp();
  };
  const int row_lo = q0 + c * 64 + 16 * (t / 32) + lane / 4;  // rows row_lo, row_lo + 8
  const int qg[2] = {src * sl + row_lo, src * sl + row_lo + 8};
  const float sl2 = dm.scale * LOG2E;
  attention::fwd_rows<C> r;
  // Masks keys past Sl and, on partial tiles, keys at later global positions than the row;
  // then the online-softmax update (as the attention forward).
  auto softmax = [&](item it) {
    const int k0 = it.n * BN;
    const bool tail = k0 + BN > sl;
    const bool part = kind(it.t, it.n) == PARTIAL;
    const int kbase = owner_of(it.t) * sl;
    if (tail || part) {
      r.mask(k0, sl, part, [&](int key) { return kbase + key; }, qg);
    }
    r.softmax(sl2);
  };

  // The warpgroups take turns issuing their GEMMs (ping-pong), as in the attention forward.
  r.template fold<true>(s, c, advance(item{0, -1}), advance,
                        [&](item it) { return it.t < P; }, softmax, release);

  // O and lse of rows of source `src` into my OW / LW at index src B + b.
  const int bz = src * dm.b + b;
  char* const ws = static_cast<char*>(cm.ws[rank]);
  float* const lw = reinterpret_cast<float*>(ws + g.ws.lw);
  r.store(ws + g.ws.ow, lw + (int64_t(bz) * dm.h + h) * sl, bz, q0 + c * 64, h, dm.h, sl,
          dm.scale);
}

/** @brief The tail kernel (see the schedule): o and lse of my rows from every head group. */
static __global__ void __launch_bounds__(TAIL_THREADS) tail_kernel(
    const __grid_constant__ globals g) {
  const tp::comm& c = g.c;
  const int P = c.world, r = c.rank;
  const uint64_t e = c.epoch();
  barrier<MAX_PEERS>(c.sig, P, r, READY + uint64_t(blockIdx.x) * MAX_PEERS, e, c.timeout_ns,
                     c.fail());
  const uint64_t rows = uint64_t(g.d.b) * g.d.s;
  const uint64_t gq = uint64_t(g.d.h) * g.head_dim * 2;  // bytes of a row of a head group
  const uint64_t upr = gq / 16;
  const uint64_t per_group = rows * upr, total = per_group * P;
  const uint64_t step = uint64_t(gridDim.x) * blockDim.x;
  char* const o = static_cast<char*>(g.o);
  const uint64_t o_row = uint64_t(g.heads) * g.head_dim * 2;
  auto src = [&](uint64_t u) {
    const uint64_t grp = u / per_group, w = u % per_group;
    return static_cast<const char*>(c.ws[grp]) + g.ws.ow + (uint64_t(r) * rows + w / upr) * gq +
           (w % upr) * 16;
  };
  auto dst = [&](uint64_t u) {
    const uint64_t grp = u / per_group, w = u % per_group;
    return o + (w / upr) * o_row + grp * gq + (w % upr) * 16;
  };
  constexpr int U = 4;  // peer loads in flight per thread
  uint64_t u = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; u + (U - 1) * step < total; u += U * step) {
    uint4 x[U];
#pragma unroll
    for (int i = 0; i < U; ++i) x[i] = p2p::ld16(src(u + i * step));
#pragma unroll
    for (int i = 0; i < U; ++i) p2p::st16(dst(u + i * step), x[i]);
  }
  for (; u < total; u += step) p2p::st16(dst(u), p2p::ld16(src(u)));
  // lse [B, H, Sl]: head grp G + hh of batch b = LW of rank grp at [r, b, hh, :].
  const uint64_t n = uint64_t(g.d.b) * g.heads * g.d.s;
  const int G = g.d.h, sl = g.d.s;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const uint64_t row = i % sl, bh = i / sl, hh = bh % g.heads, bb = bh / g.heads;
    const uint64_t grp = hh / G, hl = hh % G;
    const float* lw =
        reinterpret_cast<const float*>(static_cast<const char*>(c.ws[grp]) + g.ws.lw);
    g.lse[i] = __ldcg(lw + ((uint64_t(r) * g.d.b + bb) * G + hl) * sl + row);
  }
  barrier<MAX_PEERS>(c.sig, P, r, DONE + uint64_t(blockIdx.x) * MAX_PEERS, e, c.timeout_ns,
                     c.fail());
}

/** @brief Launches the main grid (C comm blocks, then ceil(Sl/128) P G B compute blocks) and
 * the tail kernel of one call (after the caller's epoch kernel). */
template <typename T, int D>
inline cudaError_t launch(const globals& g, cudaStream_t stream, int device) {
  using C = attention::fwd_config<T, D>;
  static_assert(C::SMEM + sizeof(wait_bound) <= 232448,
                "ulysses_attn: shared memory over the sm_90 limit of 227 KiB");
  const void* fn = reinterpret_cast<const void*>(&kernel<C>);
  if (cudaError_t err = opt_in_smem(fn, device, static_cast<int>(C::SMEM)); err != cudaSuccess) {
    return err;
  }
  const int64_t blocks =
      int64_t(g.comm_blocks) + int64_t(g.q_tiles) * g.c.world * g.d.h * g.d.b;
  kernel<C><<<static_cast<unsigned>(blocks), THREADS, C::SMEM, stream>>>(g);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  tail_kernel<<<TAIL, TAIL_THREADS, 0, stream>>>(g);
  return cudaGetLastError();
}

}  // namespace pk::ulysses_attn
