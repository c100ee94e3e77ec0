/*
 * ring_attn_bwd: the backward of ring attention in one kernel (reference: the ring VJP of
 * pk_jax/ops/ring_attn.py). dQ of the local queries, dK and dV of the local K/V block, from
 * q, k, v, dO and the forward's lse and delta = rowsum(dO * O) (both [B, H, SP], SP = Sl
 * rounded up to 128, lse = +inf and delta = 0 past Sl).
 *
 * Shardings and layouts as the forward (kernels/ring_attn.cuh): rank r of P holds Sl = S / P
 * positions (contiguous, or the zigzag chunks r and 2P-1-r); step t holds the K/V block of
 * rank (r - t) mod P.
 *
 * Schedule. One grid per call (after the epoch kernel and the zeroing of dq_acc), two kinds of
 * block, then dq = T(scale dq_acc) (attention::dq_convert_kernel):
 *
 *   blocks       what                                   waits for
 *   ----------   ------------------------------------   ------------------------------------
 *   C comm       the forward's communication blocks     (see ring_attn.cuh): K/V travel
 *                (ring_attn::communicate): push K/V      through P - 1 slots, FULL[t][ch]
 *                chunks around the ring
 *   L lanes      work items (128-key tile n, K/V head,  FULL[t][ch] of the tile's chunk; the
 *                batch) l, l + L, ...; per item and      partial dK/dV of the item from rank
 *                step t: the K/V tile of slot t          r-1 (DKV[l] >= code(e, i, t));
 *                against the 64-row q/dO tiles of every  FULL[1][ch] before the first write
 *                head of the group it meets, as          to rank r+1 (rank r-1 signals it
 *                attention's one-pass backward           after its entry barrier with every
 *                (attn::bwd_block: dK/dV in registers,   rank, so r+1's earlier kernels are
 *                dQ parts added to the local dq_acc by   over)
 *                TMA reductions); + the incoming
 *                partial; the sum to slot t+1 of rank
 *                r+1, DKV[l] there. Slot P is home:
 *                after the last step the lane waits for
 *                its item's sum, scales, stores dk, dv
 *
 * Five GEMMs per (query tile, key tile) pair: the lanes compute dQ's parts themselves, from the
 * dS^T they already hold. Separate dq blocks used to recompute S and dP for dQ, seven GEMMs per
 * pair, as the two-pass attention backward did.
 * measured: ring_attention_notes.md, "Measurements moved from code comments (issue 37)".
 *
 * "dK and dV travel with their K/V block": the partial sum of block j is at rank j + t after
 * step t and goes home to j after step P - 1 (one more hop). Tile classes as the forward:
 * a (query tile, key tile) pair is hidden (never loaded), full, or partial (masked element by
 * element on global positions); a lane still forwards the partial of a step it has no visible
 * tile in.
 *
 * Workspace (bytes): [K slots 1..P-1][V slots 1..P-1] (the forward's K/V ring) then P
 * accumulator slots (slot s = 1..P at acc_off + (s - 1) acc_slot_bytes), each n_items regions
 * of 2 x 128 x D fp32 (dK then dV), in the lanes' register order: float4 i4 of thread tid at
 * (i4 * 256 + tid) * 16 (coalesced; sender and receiver are the same lane of the same shape);
 * then dq_acc, float32 [B, Sl, H, D] (local: no peer writes it).
 *
 * Signals: the forward's slot range and EPOCH (a backward call is one more call of the family:
 * its epoch differs from every forward's), ENTER and FULL as there, plus DKV[lane] (one
 * sender: lane l of rank r-1), raised to code(e, i, s) = e << 24 | i << 5 | s for work item
 * iteration i and slot s: monotonic within a call (a lane sends its items in order and, per
 * item, slots 1..P in order) and across calls. Every wait is bounded and names the peer;
 * lane waits get 1/8 longer than the comm blocks' (a dead rank is named by the entry
 * barrier), mbarrier waits 1/4 longer.
 *
 * The rank emulator's link throttle (pk/link.cuh) paces the comm blocks' bulk copies and, per
 * step, each lane's partial (pace_block before its signal); off in production.
 *
 * Pitfalls: remote fp32 stores are the generic proxy: every thread fences (system scope),
 * the block synchronises, thread 0 releases the signal; the receiver's thread 0 acquires, the
 * block synchronises, then reads with ld.global.cg (not L1). The issuer fences the async proxy
 * after a FULL acquire before its TMA loads of the slot (as the forward).
 */
#pragma once

#include "kernels/ring_attn.cuh"

namespace pk::ring_attn_bwd {

using attn::CONSUMERS;
using attn::LOG2E;
using attn::THREADS;
using ring_attn::FULL;
using ring_attn::FULL_TILE;
using ring_attn::HIDDEN;
using ring_attn::MAX_CHUNKS;
using ring_attn::MAX_PEERS;
using ring_attn::PARTIAL;

// Lanes at most: one DKV slot each, in what the ring's 640 slots leave (a lane per work item,
// where there are at most this many; more go round-robin).
constexpr int MAX_LANES = 112;
constexpr uint64_t DKV = ring_attn::END;  // [lane]
constexpr uint64_t END = DKV + MAX_LANES;
static_assert(END <= ring_attn::OP_SLOTS, "ring_attn_bwd: slot layout");
// The ring's range shrinks to 640 slots where Ulysses attention's follow it (branch uly).
static_assert(END <= 640, "ring_attn_bwd: the layout must fit the ring's 640 slots");
constexpr int MAX_ITEMS_PER_LANE = 1 << 18;

__device__ inline uint64_t code(uint64_t e, int i, int s) {
  return (e << 24) | (uint64_t(i) << 5) | uint64_t(s);
}

template <typename T, int D>
struct config {
  using dtype = T;
  static constexpr int HEAD_DIM = D;
  using CB = attention::bwd_config<T, D>;  // the lanes' storage and steps: attn::bwd_block's
  static constexpr int BN = CB::BN;        // key tile of the K/V ring chunks and of the lanes
  static constexpr size_t SMEM = CB::SMEM;
};

/** @brief Kernel arguments. f: the K/V ring (f.k, f.v, f.ks, f.vs: the lanes' 128-row K/V
 * tiles); q64 and do64: their 64-row q/dO tiles; dq32 maps dq_acc as attention::bwd_globals'. */
struct globals {
  ring_attn::globals f;
  CUtensorMap q64, do64;  // 64 rows
  CUtensorMap dq32;       // float32, boxes {32, 1, 64, 1}
  const float* lse;    // [B, H, sp]
  const float* delta;  // [B, H, sp]
  int sp;
  float* dq_acc;  // [B, Sl, H, D] float32 in my workspace (zeroed by the launcher)
  void* dq;       // [B, Sl, H, D]
  void* dk;       // [B, Sl, Hkv, D]
  void* dv;
  int lanes;
  int n_items;  // ceil(Sl / 128) Hkv B
  uint64_t acc_off, acc_slot_bytes;
};

/** @brief p, hidden from the optimizer (an empty asm): what is computed from it is computed
 * where it is used, not hoisted out of the caller's loop. */
template <class T>
__device__ __forceinline__ T* opaque(T* p) {
  asm volatile("" : "+l"(p));
  return p;
}

/** @brief A q/dO tile of a lane's stream: work item id, step t, head h of the group, 64-row
 * tile qb (the stream: its visible tiles in order, then id >= n_items). */
struct stream_tile {
  int id, t, h, qb;
};

/** @brief Lane `ln`: its work items over the P steps (see the schedule). A step's tiles run as
 * attn::bwd_block's D = 128 loop does: S^T and dP^T, dS^T, dV and dK, dS^T shared through the
 * ds tile, dQ's part (dq_part) added to dq_acc. The q/dO stream runs on across steps and items;
 * both warpgroup leaders walk it (their cursors next_tile[c] advance together, one tile per
 * release), so whichever releases a stage last refills it (as attn::release_stage). */
template <class C>
__device__ void lane(const globals& g, int ln) {
  using CB = typename C::CB;
  using T = typename C::dtype;
  constexpr int D = C::HEAD_DIM, BN = CB::BN, BQ = CB::BQ, STAGES = CB::STAGES;
  static_assert(BN == C::BN && BN == ring_attn::CHUNK_TILE_ROWS,
                "ring_attn_bwd: the lanes' key tile is the ring's chunk tile");
  auto& s = dynamic_smem<typename CB::storage_t>();
  const ring_attn::globals& f = g.f;
  const attn::dims& dm = f.d;
  const tp::comm& cm = f.c;
  const int P = cm.world, rank = cm.rank, next = (rank + 1) % P, prev = (rank + P - 1) % P;
  const int group = dm.h / dm.hkv;
  const int nq = ceil_div(dm.s, BQ);
  const uint64_t e = cm.epoch();
  const uint64_t tmo = cm.timeout_ns + cm.timeout_ns / 8;
  const int tid = threadIdx.x;
  const bool issuer = tid == 0;
  const int c = warpgroup::index();
  const int t_ = warpgroup::thread();
  const int lane = t_ % 32;
  const bool leader = t_ == 0;
  const float sl2 = dm.scale * LOG2E;
  const int nbeg = D / 2 * c;  // the warpgroup's first dQ column
  constexpr uint64_t REGION = 2ull * BN * D * sizeof(float);  // one item: dK then dV

  // Work item `id`: key tile id % q_tiles (keys 128 n..), K/V head, batch.
  auto key_tile = [&](int id) { return id % f.q_tiles; };
  auto kv_head = [&](int id) { return (id / f.q_tiles) % dm.hkv; };
  auto batch = [&](int id) { return id / (f.q_tiles * dm.hkv); };
  auto kind = [&](int t, int k0, int q0) -> int {
    if (!dm.causal) return FULL_TILE;
    const int owner = (rank - t + P) % P;
    const int2 ks = ring_attn::span(f, owner, k0, min(k0 + BN, dm.s));
    const int2 qs = ring_attn::span(f, rank, q0, min(q0 + BQ, dm.s));
    if (ks.x > qs.y) return HIDDEN;
    return ks.y <= qs.x ? FULL_TILE : PARTIAL;
  };
  using tile = stream_tile;
  auto advance = [&](tile x) {
    do {
      if (++x.qb == nq) {
        x.qb = 0;
        if (++x.h == group) {
          x.h = 0;
          if (++x.t == P) {
            x.t = 0;
            x.id += g.lanes;
          }
        }
      }
    } while (x.id < g.n_items && kind(x.t, key_tile(x.id) * BN, x.qb * BQ) == HIDDEN);
    return x;
  };
  // Stream tile x (number j) into its stage (free).
  using pipe = pipeline_state<STAGES>;
  auto issue = [&](const tile& x, int j) {
    const int st = pipe::stage_of(j);
    const int b = batch(x.id), h = kv_head(x.id) * group + x.h, q0 = x.qb * BQ;
    auto& stage = s.st[st];
    mbar_arrive_expect_tx(&s.full[st], CB::STAGE_BYTES);
    attn::load_rows(stage.q, &g.q64, &s.full[st], b, q0, h);
    attn::load_rows(stage.d_o, &g.do64, &s.full[st], b, q0, h);
    const int64_t at = (int64_t(b) * dm.h + h) * g.sp + q0;  // q0 + 64 <= sp: padded
    tma::load_1d(s.lse[st], g.lse + at, BQ * sizeof(float), &s.full[st]);
    tma::load_1d(s.delta[st], g.delta + at, BQ * sizeof(float), &s.full[st]);
  };
  // Warpgroup c's leader's cursor: the next tile to issue, and its number. In shared memory:
  // in registers the D = 128 kernel spilled until the tile loop's `opaque` below. With it both
  // forms compile without spills; this one ran on the H200.
  __shared__ tile next_tile[CONSUMERS];
  __shared__ int next_j[CONSUMERS];
  const tile first = advance(tile{ln, 0, 0, -1});
  if (issuer) {
    mbar_init(&s.kv_full, 1);
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&s.full[i], 1);
      s.released[i] = 0;
    }
    fence_mbar_init();
  }
  if (leader) {
    tile x = first;
    int k = 0;
    for (; k < STAGES && x.id < g.n_items; ++k, x = advance(x)) {
      if (issuer) issue(x, k);
    }
    next_tile[c] = x;
    next_j[c] = k;
  }
  __syncthreads();
  // The calling warpgroup is done with stream tile r (attn::release_stage, with the leader's
  // cursor in place of the tile number).
  auto release = [&](int r) {
    if (leader) {
      __threadfence_block();
      const int before = atomicAdd(&s.released[pipe::stage_of(r)], 1);
      const tile x = next_tile[c];
      if (x.id < g.n_items) {
        if (before % CONSUMERS == CONSUMERS - 1) issue(x, next_j[c]);
        ++next_j[c];
        next_tile[c] = advance(x);
      }
    }
    __syncwarp();
  };

  auto region = [&](int peer, int slot, int item_id) {
    return reinterpret_cast<float4*>(static_cast<char*>(cm.ws[peer]) + g.acc_off +
                                     uint64_t(slot - 1) * g.acc_slot_bytes +
                                     uint64_t(item_id) * REGION);
  };

  float dk[D / 2], dv[D / 2];
  attn::dkdv_step<CB> step;
  int j = 0;  // stream tiles consumed
  pipeline_state<1> kv;  // the one K/V buffer's barrier, refilled once per visible ring step
  tile cur = first;
  for (int wi = 0, it_id = ln; it_id < g.n_items; ++wi, it_id += g.lanes) {
    const int hk = kv_head(it_id), b = batch(it_id);
    const int k0 = key_tile(it_id) * BN;
    const int ch = key_tile(it_id) / f.chunk_tiles;
    const int key_lo = k0 + c * 64 + 16 * (t_ / 32) + lane / 4;  // keys key_lo, key_lo + 8
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
    for (int t = 0; t < P; ++t) {
      if (cur.id == it_id && cur.t == t) {  // a visible tile in this step: load its K/V tile
        __syncthreads();  // every consumer is done with the previous step's tile
        if (issuer) {
          if (t > 0) {
            wait(cm.sig[rank] + FULL + uint64_t(t) * MAX_CHUNKS + ch, e, tmo, cm.fail(), prev);
            fence_proxy_async_global();  // the acquire before the TMA reads of the slot
          }
          const CUtensorMap* km = t == 0 ? &f.k : &f.ks;
          const CUtensorMap* vm = t == 0 ? &f.v : &f.vs;
          const int bz = t == 0 ? b : (t - 1) * dm.b + b;
          mbar_arrive_expect_tx(&s.kv_full, 2 * CB::kv_tile::BYTES);
          attn::load_rows(s.k, km, &s.kv_full, bz, k0, hk);
          attn::load_rows(s.v, vm, &s.kv_full, bz, k0, hk);
        }
        mbar_wait(&s.kv_full, kv.phase);
        kv.advance();
        const int owner = (rank - t + P) % P;
        for (; cur.id == it_id && cur.t == t; cur = advance(cur), ++j) {
          const int st = pipe::stage_of(j);
          const int h = hk * group + cur.h, q0 = cur.qb * BQ;
          // The storage through an opaque pointer: else nvcc hoists the step's tile-invariant
          // shared-memory addresses (dS^T and dQ staging, lse and delta) out of the loop into
          // registers, and the D = 128 kernel spilled.
          auto& sm = *opaque(&s);
          mbar_wait(&sm.full[st], pipe::phase_of(j));
          step.scores(sm, sm.st[st], c);
          const int kg[2] = {ring_attn::global_pos(f, owner, key_lo),
                             ring_attn::global_pos(f, owner, key_lo + 8)};
          step.grad_scores(sm.lse[st], sm.delta[st], sl2, kind(t, k0, q0) == PARTIAL,
                           [&](int col) { return ring_attn::global_pos(f, rank, q0 + col); },
                           kg);
          step.issue(sm.st[st], dk, dv);
          attn::dq_part<CB> part;
          part.share(sm.ds[j & 1], step.dsa, key_lo - k0, lane);
          part.issue(sm.ds[j & 1], sm.k, nbeg);
          wgmma::wait<0>();
          wgmma::fence_regs(part.dq);
          step.finish(dk, dv);
          release(j);
          part.reduce(g, sm.dqs[c], b, h, q0, nbeg, t_, c);
        }
      }
      // The partial of this item: + the incoming one (slot t, from rank r-1), on to slot t+1
      // of rank r+1 (slot P: home).
      if (issuer) {
        if (t > 0) {
          wait(cm.sig[rank] + DKV + ln, code(e, wi, t), tmo, cm.fail(), prev);
        } else {
          // Rank r-1 raises FULL[1][ch] here after its entry barrier with every rank: rank
          // r+1 has entered this call, so none of its earlier kernels reads its workspace.
          wait(cm.sig[rank] + FULL + MAX_CHUNKS + ch, e, tmo, cm.fail(), prev);
        }
      }
      __syncthreads();
      {
        // Each float4 loaded, added and stored in turn: written as all the loads, then all the
        // stores (as before the one-pass lanes), the D = 128 kernel spilled.
        const float4* in = region(rank, t, it_id);
        float4* out = region(next, t + 1, it_id);
        auto pass = [&](float* acc, int at) {
          if (t > 0) {
            const float4 x = __ldcg(in + at);
            acc[0] += x.x;
            acc[1] += x.y;
            acc[2] += x.z;
            acc[3] += x.w;
          }
          __stcg(out + at, make_float4(acc[0], acc[1], acc[2], acc[3]));
        };
#pragma unroll
        for (int i4 = 0; i4 < D / 8; ++i4) {
          pass(dk + 4 * i4, i4 * THREADS + tid);
          pass(dv + 4 * i4, (D / 8 + i4) * THREADS + tid);
        }
      }
      __threadfence_system();
      cm.link.peer(next, rank).pace_block(REGION);  // the emulator's link throttle (else off)
      __syncthreads();
      if (issuer) signal(cm.sig[next] + DKV + ln, code(e, wi, t + 1));
#pragma unroll
      for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
    }
    // Home: the item's dK/dV summed over every rank's queries (slot P, from rank r-1).
    if (issuer) wait(cm.sig[rank] + DKV + ln, code(e, wi, P), tmo, cm.fail(), prev);
    __syncthreads();
    const float4* home = region(rank, P, it_id);
#pragma unroll
    for (int i4 = 0; i4 < D / 8; ++i4) {
      const float4 x = __ldcg(home + i4 * THREADS + tid);
      const float4 y = __ldcg(home + (D / 8 + i4) * THREADS + tid);
      dk[4 * i4] = x.x;
      dk[4 * i4 + 1] = x.y;
      dk[4 * i4 + 2] = x.z;
      dk[4 * i4 + 3] = x.w;
      dv[4 * i4] = y.x;
      dv[4 * i4 + 1] = y.y;
      dv[4 * i4 + 2] = y.z;
      dv[4 * i4 + 3] = y.w;
    }
    attn::store_rows<T, D>(g.dk, dk, dm.scale, dm.scale, b, k0 + c * 64, hk, dm.hkv, dm.s);
    attn::store_rows<T, D>(g.dv, dv, 1.f, 1.f, b, k0 + c * 64, hk, dm.hkv, dm.s);
  }
  if (leader) tma::store_wait<0>();  // the staging stays valid until the last reduction is done
}

template <class C>
__global__ void __launch_bounds__(THREADS, 1) kernel(const __grid_constant__ globals g) {
  const tp::comm& cm = g.f.c;
  if (threadIdx.x == 0) {
    // NOTES: mbarrier waits get a quarter more than the comm blocks' signal waits (and the
    // lanes' an eighth), so a missing peer is named by a signal wait (peer_wait_bound).
    block_wait_bound() = cm.bound();
  }
  const int idx = static_cast<int>(blockIdx.x);
  if (idx < g.f.comm_blocks) {
    __syncthreads();
    ring_attn::communicate<C>(g.f, idx, &dynamic_smem<typename C::CB::storage_t>());
    return;
  }
  lane<C>(g, idx - g.f.comm_blocks);
}

/** @brief Launches one call (after the caller's epoch kernel): dq_acc zeroed, the grid of C
 * comm blocks and L lanes, then dq = T(scale dq_acc). */
template <typename T, int D>
inline cudaError_t launch(const globals& g, cudaStream_t stream, int device) {
  using C = config<T, D>;
  static_assert(C::SMEM + sizeof(wait_bound) + CONSUMERS * (sizeof(stream_tile) + 4) <= 232448,
                "ring_attn_bwd: shared memory over the sm_90 limit of 227 KiB");
  const int64_t n = int64_t(g.f.d.b) * g.f.d.s * g.f.d.h * D;
  if (cudaError_t err = cudaMemsetAsync(g.dq_acc, 0, n * sizeof(float), stream);
      err != cudaSuccess) {
    return err;
  }
  const void* fn = reinterpret_cast<const void*>(&kernel<C>);
  if (cudaError_t err = opt_in_smem(fn, device, static_cast<int>(C::SMEM)); err != cudaSuccess) {
    return err;
  }
  kernel<C><<<static_cast<unsigned>(g.f.comm_blocks + g.lanes), THREADS, C::SMEM, stream>>>(g);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  return attention::launch_dq_convert<T>(g.dq_acc, g.dq, n, g.f.d.scale, stream);
}

}  // namespace pk::ring_attn_bwd
