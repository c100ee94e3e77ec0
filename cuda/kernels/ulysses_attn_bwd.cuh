/*
 * ulysses_attn_bwd: the backward of Ulysses attention in one main kernel plus a tail kernel,
 * after the composed forward (pk_jax/ops/ulysses_attn.py), which keeps q, k, v and lse in head
 * shards: the all-to-all of dO from a sequence split to a head split, the attention backward
 * of one head group over the whole sequence, and the all-to-all of dq, dk, dv back.
 *
 * Shardings (rank r of P, Sl = S / P, head group r = query heads [r G, (r+1) G) with G = H / P
 * and K/V heads [r Gk, (r+1) Gk) with Gk = Hkv / P):
 *   d_o [B, Sl, H, D], delta float32 [B, H, Sl] = rowsum(dO O) (the rank's rows, all heads);
 *   q [B, S, G, D], k, v [B, S, Gk, D], lse float32 [B, G, SP] (head group r, global rows;
 *   SP = S rounded up to 128, lse = +inf past S);
 *   dq [B, Sl, H, D], dk, dv [B, Sl, Hkv, D] out.
 *
 * Workspace of rank r (sections 1024-aligned):
 *   DOW [B, S, G, D]       dO of head group r, rows s Sl.. pushed by source s
 *   DLW float32 [B, G, SP] delta likewise (zeroed past S by the launcher)
 *   DQA float32 [B, S, G, D] dq_acc of head group r (zeroed by the launcher)
 *   DKW, DVW [B, S, Gk, D] dk (scaled) and dv of head group r
 *
 * Schedule (one call = epoch kernel, two memsets of my workspace, main kernel, tail kernel):
 *
 *   main kernel, comm block cb of rank r (the C blocks first in the grid): barrier ENTER with
 *   block cb of every peer (every peer's call has started: its last call's tail no longer
 *   reads it); then for destinations g = r, r-1, ..., r-P+1 (mod P): its 1/C share of the
 *   rows of d_o[:, :, head group g] (thread 0, bulk copies, as the forward's) and of
 *   delta[:, head group g, :] (warps 1..) into rank g's DOW/DLW at rows r Sl..,
 *   then FULL[r][cb] on rank g (release at system scope); finally it waits FULL[s][cb] for
 *   every source s. So rank g receives the sources g, g+1, ... in that order.
 *
 *   main kernel, compute block (key block kb, K/V head hk, batch b): the attention backward's
 *   block (attn::bwd_block, pk/attn/bwd_mainloop.cuh) over head group r, its q/dO stages
 *   through `pushed_rows`: before loading the stage of query rows [q0, q0 + 64) the issuer
 *   waits FULL[s][*] of the sources s of those rows; each head's query tiles start at the
 *   first tile of source r's rows and go up, wrapping around (the order in which they
 *   arrive). dQ is added to DQA by TMA reductions, dk and dv stored into DKW/DVW.
 *
 *   tail kernel (TAIL blocks): block i barriers READY with block i of every peer (every main
 *   kernel is over), then pulls my rows of every head group g from rank g: dq = T(scale DQA),
 *   dk, dv; then barriers DONE with block i of every peer, after which no peer reads my
 *   workspace (the next op may restage it).
 *
 * Signals: Ulysses attention's slot range, EPOCH and slots ENTER, FULL, READY, DONE, with the
 * forward's meaning (a backward call is one more call of the family: its epoch differs from
 * every forward's, as consecutive forward calls' do). Every wait is bounded and names the peer;
 * compute blocks wait 1/8 longer than the comm blocks (a dead rank is named by ENTER).
 *
 * Pitfalls: dO moves by bulk copies, delta by generic stores, and the compute blocks read both
 * with TMA: writers fence the async proxy before their release, the issuer after its acquire
 * (as the forward, ulysses_attn.cuh). C must be the same on every rank.
 */
#pragma once

#include "kernels/ulysses_attn.cuh"

namespace pk::ulysses_attn_bwd {

using attn::THREADS;
using ulysses_attn::MAX_COMM;
using ulysses_attn::MAX_PEERS;
using ulysses_attn::TAIL;

// Signals: the forward's slots, with the same meaning (ulysses_attn.cuh).
using ulysses_attn::DONE;
using ulysses_attn::ENTER;
using ulysses_attn::FULL;
using ulysses_attn::READY;

/** @brief Byte offsets of the workspace sections (see the header). */
struct layout {
  uint64_t dow, dlw, dqa, dkw, dvw, total;
};

/** @brief The workspace layout for per-rank shapes b, sl, h, hkv, d (2-byte elements). */
__host__ __device__ inline layout make_layout(int64_t p, int64_t b, int64_t sl, int64_t h,
                                              int64_t hkv, int64_t d) {
  using ulysses_attn::align1k;
  const int64_t sp = (p * sl + 127) / 128 * 128;
  const uint64_t qb = uint64_t(b) * sl * h * d * 2;  // = B S G D 2
  const uint64_t kb = uint64_t(b) * sl * hkv * d * 2;
  layout l{};
  l.dow = 0;
  l.dlw = align1k(l.dow + qb);
  l.dqa = align1k(l.dlw + uint64_t(b) * (h / p) * sp * 4);
  l.dkw = align1k(l.dqa + 2 * qb);
  l.dvw = align1k(l.dkw + kb);
  l.total = align1k(l.dvw + kb);
  return l;
}

/** @brief Kernel arguments. a: the attention backward's over head group r (d.s = S, d.h = G,
 * d.hkv = Gk; maps q64, k128, v128 over q, k, v, do64 over DOW, dq32 over DQA; lse, delta =
 * DLW; dk, dv = DKW, DVW). */
struct globals {
  attention::bwd_globals a;
  const void* d_o;     // [B, Sl, H, D]
  const float* delta;  // [B, H, Sl]
  void* dq;            // [B, Sl, H, D]
  void* dk;            // [B, Sl, Hkv, D]
  void* dv;
  tp::comm c;
  int sl;                  // Sl
  int heads, kv_heads;     // H, Hkv
  int head_dim;            // D
  int comm_blocks;         // C
  int key_blocks;          // ceil(S / 128)
  layout ws;
};

/** @brief One communication block (see the schedule): thread 0 moves the block's share of
 * the dO rows with bulk copies through the block's shared memory, warps 1.. the delta values.
 * Call from all threads. */
template <class C>
__device__ void communicate(const globals& g, int cb, void* smem) {
  static_assert(sizeof(bulk_ring) + 1024 <= C::SMEM,
                "ulysses_attn_bwd: the bulk-copy ring must fit in the block's shared memory");
  bulk_ring& ring = *static_cast<bulk_ring*>(smem);
  const tp::comm& c = g.c;
  const int P = c.world, r = c.rank;
  const int nc = g.comm_blocks;
  const uint64_t e = c.epoch();
  const bool lead = threadIdx.x == 0;
  if (lead) ring.init();
  barrier<MAX_PEERS>(c.sig, P, r, ENTER + uint64_t(cb) * MAX_PEERS, e, c.timeout_ns, c.fail());
  const int B = g.a.d.b, G = g.a.d.h, S = g.a.d.s, sl = g.sl, sp = g.a.sp;
  const uint64_t D2 = uint64_t(g.head_dim) * 2;
  const uint64_t gq = uint64_t(G) * D2;  // bytes of a row of a head group
  const uint64_t lo = uint64_t(sl) * cb / nc, n = uint64_t(sl) * (cb + 1) / nc - lo;
  const uint64_t nd = uint64_t(B) * G * sl;  // delta values per destination
  if (lead) fence_proxy_async_global();  // the barrier's acquires before the bulk writes
  for (int i = 0; i < P; ++i) {
    const int dst = (r - i + P) % P;
    char* const ws = static_cast<char*>(c.ws[dst]);
    if (lead) {
      // Rows [lo, lo + n) of every batch of d_o[:, :, head group dst] to rows r Sl + lo.. there.
      int b = 0;
      auto rows_of = [&](int bb) {
        return row_pieces{
            static_cast<const char*>(g.d_o) + (uint64_t(bb) * sl + lo) * g.heads * D2 + dst * gq,
            ws + g.ws.dow + (uint64_t(bb) * S + uint64_t(r) * sl + lo) * gq,
            uint64_t(g.heads) * D2, gq, gq, n};
      };
      row_pieces part = rows_of(0);
      ring.link = c.link.peer(dst, r);  // the emulator's link throttle paces the pushes
      bulk_move<true>(ring, [&](bulk_piece* pc) {
        while (!part.next(pc, true)) {
          if (++b >= B) return false;
          part = rows_of(b);
        }
        return true;
      }, ring.link);
    } else if (threadIdx.x >= 32) {
      float* const dlw = reinterpret_cast<float*>(ws + g.ws.dlw);
      for (uint64_t x = nd * cb / nc + threadIdx.x - 32; x < nd * (cb + 1) / nc;
           x += blockDim.x - 32) {
        const uint64_t row = x % sl, bh = x / sl;  // bh = b G + hl
        const uint64_t bb = bh / G, hl = bh % G;
        dlw[bh * sp + uint64_t(r) * sl + row] =
            __ldg(g.delta + (bb * g.heads + uint64_t(dst) * G + hl) * sl + row);
      }
    }
    ulysses_attn::publish_full(c, dst, cb, e);
  }
  ulysses_attn::wait_all_full(c, cb, e);
}

/** @brief attn::bwd_block's source of q/dO stages here (as pk/attn/local.cuh local_rows): dO
 * and delta rows of source s are in my workspace once FULL[s][*] is raised; each head's tiles
 * start at the first tile wholly of my own rows (pushed first, locally) and go up, wrapping
 * around. */
template <class C>
struct pushed_rows {
  const globals* g;
  uint64_t e;
  int first;  // that tile
  mutable uint32_t seen = 0;  // sources this thread has waited for (each thread its own copy)
  __device__ wait_bound bound() const { return g->c.bound(); }
  /** @brief Waits until rows [q0, q0 + 64) have arrived. Called by the thread that issues; it
   * acquires each source once (its later TMA loads follow its fence in program order). */
  __device__ void before_load(int q0) const {
    const tp::comm& cm = g->c;
    const int last = min(q0 + C::BQ, g->a.d.s) - 1;
    const uint64_t long_wait = cm.timeout_ns + cm.timeout_ns / 8;
    bool waited = false;
    for (int s = q0 / g->sl; s <= last / g->sl; ++s) {
      if (seen >> s & 1) continue;
      for (int cb = 0; cb < g->comm_blocks; ++cb) {
        wait(cm.sig[cm.rank] + FULL + uint64_t(s) * MAX_COMM + cb, e, long_wait, cm.fail(), s);
      }
      seen |= 1u << s;
      waited = true;
    }
    if (waited) fence_proxy_async_global();  // the acquires before the TMA reads
  }
  __device__ int tile(int qb0, int qi, int nq) const {
    const int off = first > qb0 ? first - qb0 : 0;
    const int t = qb0 + qi + off;
    return t < nq ? t : t - (nq - qb0);
  }
};

template <class C>
__global__ void __launch_bounds__(THREADS, 1) kernel(const __grid_constant__ globals g) {
  if (static_cast<int>(blockIdx.x) < g.comm_blocks) {
    if (threadIdx.x == 0) block_wait_bound() = g.c.bound();
    __syncthreads();
    communicate<C>(g, blockIdx.x, &dynamic_smem<typename C::storage_t>());
    return;
  }
  const int idx = blockIdx.x - g.comm_blocks;
  const int hk = idx % g.a.d.hkv, rest = idx / g.a.d.hkv;
  const int kb = rest % g.key_blocks, b = rest / g.key_blocks;
  const int nq = ceil_div(g.a.d.s, C::BQ);
  const int first = min(ceil_div(g.c.rank * g.sl, C::BQ), nq - 1);
  attn::bwd_block<C>(g.a, hk, kb, b, pushed_rows<C>{&g, g.c.epoch(), first});
}

/** @brief Units first, first + step, .. below total: store(u, load(u)), U loads in flight. */
template <int U, class Load, class Store>
__device__ inline void copy_units(uint32_t first, uint32_t step, uint32_t total,
                                  const Load& load, const Store& store) {
  uint32_t u = first;
  for (; u + (U - 1) * step < total; u += U * step) {
    decltype(load(u)) x[U];
#pragma unroll
    for (int i = 0; i < U; ++i) x[i] = load(u + i * step);
#pragma unroll
    for (int i = 0; i < U; ++i) store(x[i]);
  }
  for (; u < total; u += step) store(load(u));
}

constexpr int BWD_TAIL_THREADS = 1024;

/** @brief Copies my rows of every head group back (see the schedule): dq from float32, dk, dv.
 * Latency-bound peer loads: 4 units in flight per thread, 32-bit index arithmetic (the handler
 * bounds B S H D below 2^31). */
template <typename T>
static __global__ void __launch_bounds__(BWD_TAIL_THREADS) tail_kernel(
    const __grid_constant__ globals g) {
  const tp::comm& c = g.c;
  const int P = c.world, r = c.rank;
  const uint64_t e = c.epoch();
  barrier<MAX_PEERS>(c.sig, P, r, READY + uint64_t(blockIdx.x) * MAX_PEERS, e, c.timeout_ns,
                     c.fail());
  const uint32_t sl = g.sl, S = g.a.d.s, D = g.head_dim;
  const uint32_t rows = uint32_t(g.a.d.b) * sl;
  // Row w of my rows (batch w / sl, position w % sl) is row b S + r Sl + w % sl of a section.
  auto at = [&](uint32_t w) { return uint64_t(w / sl) * S + uint64_t(r) * sl + w % sl; };
  const uint32_t first = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
  // dq: units of 8 elements (32 bytes of DQA, 16 of dq).
  struct dq_unit {
    float4 x0, x1;
    char* dst;
  };
  const uint32_t uq = uint32_t(g.a.d.h) * D / 8, per_q = rows * uq;
  const float scale = g.a.d.scale;
  copy_units<4>(
      first, step, per_q * P,
      [&](uint32_t u) {
        const uint32_t grp = u / per_q, v = u - grp * per_q, w = v / uq, col = v - w * uq;
        const float4* src = reinterpret_cast<const float4*>(
            static_cast<const char*>(c.ws[grp]) + g.ws.dqa + (at(w) * uq + col) * 32);
        return dq_unit{__ldcg(src), __ldcg(src + 1),
                       static_cast<char*>(g.dq) +
                           (uint64_t(w) * g.heads * D + (uint64_t(grp) * uq + col) * 8) * 2};
      },
      [&](const dq_unit& x) {
        p2p::st16(x.dst, make_uint4(frag::pack<T>(x.x0.x * scale, x.x0.y * scale),
                                    frag::pack<T>(x.x0.z * scale, x.x0.w * scale),
                                    frag::pack<T>(x.x1.x * scale, x.x1.y * scale),
                                    frag::pack<T>(x.x1.z * scale, x.x1.w * scale)));
      });
  // dk, then dv: 16-byte units.
  struct unit {
    uint4 x;
    char* dst;
  };
  const uint32_t uk = uint32_t(g.a.d.hkv) * D * 2 / 16, per_k = rows * uk;
  copy_units<4>(
      first, step, 2 * per_k * P,
      [&](uint32_t u) {
        const uint32_t which = u / (per_k * P), v0 = u - which * (per_k * P);
        const uint32_t grp = v0 / per_k, v = v0 - grp * per_k, w = v / uk, col = v - w * uk;
        const char* src = static_cast<const char*>(c.ws[grp]) + (which ? g.ws.dvw : g.ws.dkw) +
                          (at(w) * uk + col) * 16;
        return unit{p2p::ld16(src), static_cast<char*>(which ? g.dv : g.dk) +
                                        (uint64_t(w) * g.kv_heads * D * 2 +
                                         (uint64_t(grp) * uk + col) * 16)};
      },
      [&](const unit& x) { p2p::st16(x.dst, x.x); });
  barrier<MAX_PEERS>(c.sig, P, r, DONE + uint64_t(blockIdx.x) * MAX_PEERS, e, c.timeout_ns,
                     c.fail());
}

/** @brief Zeroes DQA and DLW past S, launches the main grid (C comm blocks, then Gk x key
 * blocks x B compute blocks) and the tail kernel of one call (after the caller's epoch
 * kernel). */
template <typename T, int D>
inline cudaError_t launch(const globals& g, cudaStream_t stream, int device) {
  using C = attention::bwd_config<T, D>;
  const attn::dims& dm = g.a.d;
  char* const mine = static_cast<char*>(g.c.ws[g.c.rank]);
  if (cudaError_t err = cudaMemsetAsync(mine + g.ws.dqa, 0,
                                        uint64_t(dm.b) * dm.s * dm.h * D * sizeof(float), stream);
      err != cudaSuccess) {
    return err;
  }
  if (g.a.sp > dm.s) {
    if (cudaError_t err = cudaMemset2DAsync(mine + g.ws.dlw + uint64_t(dm.s) * 4,
                                            uint64_t(g.a.sp) * 4, 0,
                                            uint64_t(g.a.sp - dm.s) * 4,
                                            uint64_t(dm.b) * dm.h, stream);
        err != cudaSuccess) {
      return err;
    }
  }
  static_assert(C::SMEM + sizeof(wait_bound) <= 232448,
                "ulysses_attn_bwd: shared memory over the sm_90 limit of 227 KiB");
  const void* fn = reinterpret_cast<const void*>(&kernel<C>);
  if (cudaError_t err = opt_in_smem(fn, device, static_cast<int>(C::SMEM)); err != cudaSuccess) {
    return err;
  }
  const int64_t blocks = int64_t(g.comm_blocks) + int64_t(dm.hkv) * g.key_blocks * dm.b;
  kernel<C><<<static_cast<unsigned>(blocks), THREADS, C::SMEM, stream>>>(g);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  tail_kernel<T><<<TAIL, BWD_TAIL_THREADS, 0, stream>>>(g);
  return cudaGetLastError();
}

}  // namespace pk::ulysses_attn_bwd
