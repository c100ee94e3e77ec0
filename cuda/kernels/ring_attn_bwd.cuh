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
 * Schedule. One grid per call (after the epoch kernel), three kinds of block:
 *
 *   blocks       what                                   waits for
 *   ----------   ------------------------------------   ------------------------------------
 *   C comm       the forward's communication blocks     (see ring_attn.cuh): K/V travel
 *                (ring_attn::communicate): push K/V      through P - 1 slots, FULL[t][ch]
 *                chunks around the ring
 *   L lanes      dK/dV: work items (128-key tile n,     FULL[t][ch] of the tile's chunk; the
 *                K/V head, batch) l, l + L, ...; per     partial dK/dV of the item from rank
 *                item and step t: K/V tile of slot t,    r-1 (DKV[l] >= code(e, i, t));
 *                64-row q/dO tiles of every head of      FULL[1][ch] before the first write
 *                the group (as attention's dkdv pass),   to rank r+1 (rank r-1 signals it
 *                dK/dV in registers; + the incoming      after its entry barrier with every
 *                partial; the sum to slot t+1 of rank    rank, so r+1's earlier kernels are
 *                r+1, DKV[l] there. Slot P is home:      over)
 *                after the last step the lane waits for
 *                its item's sum, scales, stores dk, dv
 *   dq blocks    (128 query rows, head, batch): the      FULL[t][ch] of the chunks of the
 *                attention dq pass over every step's     tiles they load
 *                64-key tiles; dQ in registers
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
 * (i4 * 256 + tid) * 16 (coalesced; sender and receiver are the same lane of the same shape).
 *
 * Signals: the forward's slot range and EPOCH (a backward call is one more call of the family:
 * its epoch differs from every forward's), ENTER and FULL as there, plus DKV[lane] (one
 * sender: lane l of rank r-1), raised to code(e, i, s) = e << 24 | i << 5 | s for work item
 * iteration i and slot s: monotonic within a call (a lane sends its items in order and, per
 * item, slots 1..P in order) and across calls. Every wait is bounded and names the peer;
 * lane and dq waits get 1/8 longer than the comm blocks' (a dead rank is named by the entry
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

using attention::CONSUMERS;
using attention::LOG2E;
using attention::THREADS;
using ring_attn::FULL;
using ring_attn::FULL_TILE;
using ring_attn::HIDDEN;
using ring_attn::MAX_CHUNKS;
using ring_attn::MAX_PEERS;
using ring_attn::PARTIAL;

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
  static constexpr int BN = 128;  // key tile of the K/V ring chunks and of the dK/dV lanes
  using CQ = attention::dq_config<T, D>;
  using CK = attention::dkdv_config<T, D>;
  static constexpr size_t SMEM = CQ::SMEM > CK::SMEM ? CQ::SMEM : CK::SMEM;
};

/** @brief Kernel arguments. f: the K/V ring (f.q: 128-row q; f.k, f.v, f.ks, f.vs: 128-row
 * K/V maps); 64-row maps for the dq blocks' K/V and the lanes' q/dO. */
struct globals {
  ring_attn::globals f;
  CUtensorMap d_o;                    // 128 rows
  CUtensorMap q64, do64;              // 64 rows
  CUtensorMap k64, v64, ks64, vs64;   // 64 rows
  const float* lse;    // [B, H, sp]
  const float* delta;  // [B, H, sp]
  int sp;
  void* dq;  // [B, Sl, H, D]
  void* dk;  // [B, Sl, Hkv, D]
  void* dv;
  int lanes;
  int n_items;  // ceil(Sl / 128) Hkv B
  uint64_t acc_off, acc_slot_bytes;
};

/** @brief The dQ block `idx`: the forward's compute block with the attention dq pass. */
template <class C>
__device__ void dq_block(const globals& g, int idx) {
  using CQ = typename C::CQ;
  using T = typename C::dtype;
  constexpr int D = C::HEAD_DIM, BM = CQ::BM, BN = CQ::BN, STAGES = CQ::STAGES;
  auto& s = dynamic_smem<typename CQ::storage_t>();
  const ring_attn::globals& f = g.f;
  const attention::dims& dm = f.d;
  const tp::comm& cm = f.c;
  const int P = cm.world, rank = cm.rank;
  const int h = idx % dm.h;
  const int qb_raw = (idx / dm.h) % f.q_tiles;
  const int b = idx / (dm.h * f.q_tiles);
  const int qb = dm.causal && !f.zigzag ? f.q_tiles - 1 - qb_raw : qb_raw;
  const int q0 = qb * BM;
  const int hk = h / (dm.h / dm.hkv);
  const int n_kv = ceil_div(dm.s, BN);
  const int2 qspan = ring_attn::span(f, rank, q0, min(q0 + BM, dm.s));
  const uint64_t e = cm.epoch();

  auto kind = [&](int t, int n) -> int {
    if (!dm.causal) return FULL_TILE;
    const int owner = (rank - t + P) % P;
    const int2 ks = ring_attn::span(f, owner, n * BN, min(n * BN + BN, dm.s));
    if (ks.x > qspan.y) return HIDDEN;
    return ks.y <= qspan.x ? FULL_TILE : PARTIAL;
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

  const bool issuer = threadIdx.x == 0;
  item pit{0, -1};
  item waited{0, -1};
  auto issue = [&](int j) {
    const int st = j % STAGES;
    const item it = pit;
    const int ch = it.n * BN / (f.chunk_tiles * C::BN);
    if (it.t > 0 && (it.t != waited.t || ch != waited.n)) {
      wait(cm.sig[rank] + FULL + uint64_t(it.t) * MAX_CHUNKS + ch, e,
           cm.timeout_ns + cm.timeout_ns / 8, cm.fail(), (rank + P - 1) % P);
      fence_proxy_async_global();  // the acquire before the TMA reads of the slot
      waited = item{it.t, ch};
    }
    const CUtensorMap* km = it.t == 0 ? &g.k64 : &g.ks64;
    const CUtensorMap* vm = it.t == 0 ? &g.v64 : &g.vs64;
    const int bz = it.t == 0 ? b : (it.t - 1) * dm.b + b;
    mbar_arrive_expect_tx(&s.full[st], 2 * CQ::kv_tile::BYTES);
    attention::load_rows(s.k[st], km, &s.full[st], bz, it.n * BN, hk);
    attention::load_rows(s.v[st], vm, &s.full[st], bz, it.n * BN, hk);
    pit = advance(pit);
  };
  if (issuer) {
    pit = advance(pit);
    mbar_init(&s.q_full, 1);
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], CONSUMERS);
    }
    fence_mbar_init();
    mbar_arrive_expect_tx(&s.q_full, 2 * CQ::q_tile::BYTES);
    attention::load_rows(s.q, &f.q, &s.q_full, b, q0, h);
    attention::load_rows(s.d_o, &g.d_o, &s.q_full, b, q0, h);
    for (int j = 0; j < STAGES && pit.t < P; ++j) issue(j);
  }
  __syncthreads();

  const int c = warpgroup::index();
  const int t = warpgroup::thread();
  const int lane = t % 32;
  const bool leader = t == 0;
  auto release = [&](int r) {
    const int st = r % STAGES;
    if (leader) mbar_arrive(&s.empty[st]);
    if (issuer && pit.t < P) {
      mbar_wait(&s.empty[st], (r / STAGES) & 1);
      issue(r + STAGES);
    }
    __syncwarp();
  };
  const int row_lo = q0 + c * 64 + 16 * (t / 32) + lane / 4;
  const int qg[2] = {ring_attn::global_pos(f, rank, row_lo),
                     ring_attn::global_pos(f, rank, row_lo + 8)};
  const float sl2 = dm.scale * LOG2E;
  attention::dq_rows<CQ> r(g.lse, g.delta, b, h, dm.h, g.sp, row_lo);

  mbar_wait(&s.q_full, 0);
  int j = 0;
  for (item cur = advance(item{0, -1}); cur.t < P; cur = advance(cur), ++j) {
    const int st = j % STAGES;
    mbar_wait(&s.full[st], (j / STAGES) & 1);
    r.scores(s, c, st);
    const int k0 = cur.n * BN;
    const bool part = kind(cur.t, cur.n) == PARTIAL;
    const bool mask = part || k0 + BN > dm.s;
    const int owner = (rank - cur.t + P) % P;
    r.grad_scores(sl2, mask, k0, dm.s, part,
                  [&](int key) { return ring_attn::global_pos(f, owner, key); }, qg);
    r.accumulate(s, st);
    release(j);
  }
  attention::store_rows<T, D>(g.dq, r.dq, dm.scale, dm.scale, b, q0 + c * 64, h, dm.h, dm.s);
}

/** @brief Lane `ln`: the dK/dV of its work items over the P steps (see the schedule). */
template <class C>
__device__ void dkdv_lane(const globals& g, int ln) {
  using CK = typename C::CK;
  using T = typename C::dtype;
  constexpr int D = C::HEAD_DIM, BN = CK::BN, BQ = CK::BQ, STAGES = CK::STAGES;
  static_assert(BN == C::BN, "ring_attn_bwd: the lanes' key tile is the ring's chunk tile");
  auto& s = dynamic_smem<typename CK::storage_t>();
  const ring_attn::globals& f = g.f;
  const attention::dims& dm = f.d;
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
  constexpr uint64_t REGION = 2ull * BN * D * sizeof(float);  // one item: dK then dV

  int n = 0, hk = 0, b = 0, k0 = 0;
  auto kind = [&](int t, int q0) -> int {
    if (!dm.causal) return FULL_TILE;
    const int owner = (rank - t + P) % P;
    const int2 ks = ring_attn::span(f, owner, k0, min(k0 + BN, dm.s));
    const int2 qs = ring_attn::span(f, rank, q0, min(q0 + BQ, dm.s));
    if (ks.x > qs.y) return HIDDEN;
    return ks.y <= qs.x ? FULL_TILE : PARTIAL;
  };
  struct item {
    int t, h, qb;  // step, head within the group, 64-row q tile
  };
  auto advance = [&](item it) {
    do {
      if (++it.qb == nq) {
        it.qb = 0;
        if (++it.h == group) {
          it.h = 0;
          ++it.t;
        }
      }
    } while (it.t < P && kind(it.t, it.qb * BQ) == HIDDEN);
    return it;
  };

  item pit{0, 0, -1};
  int issued = 0;  // the issuer's: q/dO tiles issued so far (all work items)
  auto issue = [&]() {
    const int st = issued % STAGES;
    if (issued >= STAGES) mbar_wait(&s.empty[st], ((issued - STAGES) / STAGES) & 1);
    const int h = hk * group + pit.h;
    const int q0 = pit.qb * BQ;
    auto& stage = s.st[st];
    mbar_arrive_expect_tx(&s.full[st], CK::STAGE_BYTES);
    attention::load_rows(stage.q, &g.q64, &s.full[st], b, q0, h);
    attention::load_rows(stage.d_o, &g.do64, &s.full[st], b, q0, h);
    const int64_t at = (int64_t(b) * dm.h + h) * g.sp + q0;  // q0 + 64 <= sp: padded
    tma::load_1d(stage.lse, g.lse + at, BQ * sizeof(float), &s.full[st]);
    tma::load_1d(stage.delta, g.delta + at, BQ * sizeof(float), &s.full[st]);
    ++issued;
    pit = advance(pit);
  };
  auto release = [&](int r) {
    if (leader) mbar_arrive(&s.empty[r % STAGES]);
    if (issuer && pit.t < P) issue();
    __syncwarp();
  };
  if (issuer) {
    mbar_init(&s.kv_full, 1);
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], CONSUMERS);
    }
    fence_mbar_init();
  }
  __syncthreads();

  auto region = [&](int peer, int slot, int item_id) {
    return reinterpret_cast<float4*>(static_cast<char*>(cm.ws[peer]) + g.acc_off +
                                     uint64_t(slot - 1) * g.acc_slot_bytes +
                                     uint64_t(item_id) * REGION);
  };

  float dk[D / 2], dv[D / 2];
  attention::dkdv_step<CK> step;
  int j = 0;  // q/dO tiles consumed (all work items)
  uint32_t kv_phase = 0;
  for (int wi = 0, it_id = ln; it_id < g.n_items; ++wi, it_id += g.lanes) {
    n = it_id % f.q_tiles;
    hk = (it_id / f.q_tiles) % dm.hkv;
    b = it_id / (f.q_tiles * dm.hkv);
    k0 = n * BN;
    const int ch = n / f.chunk_tiles;
    const int key_lo = k0 + c * 64 + 16 * (t_ / 32) + lane / 4;  // keys key_lo, key_lo + 8
    if (issuer) {
      pit = advance(item{0, 0, -1});
      while (issued < j + STAGES && pit.t < P) issue();
    }
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
    item cur = advance(item{0, 0, -1});
    for (int t = 0; t < P; ++t) {
      if (cur.t == t) {  // a visible tile in this step: load the K/V tile of the step
        __syncthreads();  // every consumer is done with the previous step's tile
        if (issuer) {
          if (t > 0) {
            wait(cm.sig[rank] + FULL + uint64_t(t) * MAX_CHUNKS + ch, e, tmo, cm.fail(), prev);
            fence_proxy_async_global();  // the acquire before the TMA reads of the slot
          }
          const CUtensorMap* km = t == 0 ? &f.k : &f.ks;
          const CUtensorMap* vm = t == 0 ? &f.v : &f.vs;
          const int bz = t == 0 ? b : (t - 1) * dm.b + b;
          mbar_arrive_expect_tx(&s.kv_full, 2 * CK::kv_tile::BYTES);
          attention::load_rows(s.k, km, &s.kv_full, bz, k0, hk);
          attention::load_rows(s.v, vm, &s.kv_full, bz, k0, hk);
        }
        mbar_wait(&s.kv_full, kv_phase);
        kv_phase ^= 1;
        const int owner = (rank - t + P) % P;
        const int kg[2] = {ring_attn::global_pos(f, owner, key_lo),
                           ring_attn::global_pos(f, owner, key_lo + 8)};
        for (; cur.t == t; cur = advance(cur), ++j) {
          const int st = j % STAGES;
          const int q0 = cur.qb * BQ;
          auto& stage = s.st[st];
          mbar_wait(&s.full[st], (j / STAGES) & 1);
          step.scores(s, stage, c);
          const bool part = kind(t, q0) == PARTIAL;
          step.grad_scores(stage, sl2, part,
                           [&](int col) { return ring_attn::global_pos(f, rank, q0 + col); }, kg);
          step.accumulate(stage, dk, dv);
          release(j);
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
      if (t > 0) {
        const float4* in = region(rank, t, it_id);
#pragma unroll
        for (int i4 = 0; i4 < D / 8; ++i4) {
          const float4 x = __ldcg(in + i4 * THREADS + tid);
          const float4 y = __ldcg(in + (D / 8 + i4) * THREADS + tid);
          dk[4 * i4] += x.x;
          dk[4 * i4 + 1] += x.y;
          dk[4 * i4 + 2] += x.z;
          dk[4 * i4 + 3] += x.w;
          dv[4 * i4] += y.x;
          dv[4 * i4 + 1] += y.y;
          dv[4 * i4 + 2] += y.z;
          dv[4 * i4 + 3] += y.w;
        }
      }
      float4* out = region(next, t + 1, it_id);
#pragma unroll
      for (int i4 = 0; i4 < D / 8; ++i4) {
        __stcg(out + i4 * THREADS + tid,
               make_float4(dk[4 * i4], dk[4 * i4 + 1], dk[4 * i4 + 2], dk[4 * i4 + 3]));
        __stcg(out + (D / 8 + i4) * THREADS + tid,
               make_float4(dv[4 * i4], dv[4 * i4 + 1], dv[4 * i4 + 2], dv[4 * i4 + 3]));
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
    attention::store_rows<T, D>(g.dk, dk, dm.scale, dm.scale, b, k0 + c * 64, hk, dm.hkv,
                                dm.s);
    attention::store_rows<T, D>(g.dv, dv, 1.f, 1.f, b, k0 + c * 64, hk, dm.hkv, dm.s);
  }
}

template <class C>
__global__ void __launch_bounds__(THREADS, 1) kernel(const __grid_constant__ globals g) {
  const tp::comm& cm = g.f.c;
  if (threadIdx.x == 0) {
    // NOTES: mbarrier waits get a quarter more than the comm blocks' signal waits (and the
    // lanes' and dq blocks' an eighth), so a missing peer is named by a signal wait.
    block_wait_bound() = wait_bound{cm.error, cm.op, cm.rank, cm.timeout_ns + cm.timeout_ns / 4};
  }
  const int idx = static_cast<int>(blockIdx.x);
  if (idx < g.f.comm_blocks) {
    __syncthreads();
    ring_attn::communicate<C>(g.f, idx, &dynamic_smem<typename C::CK::storage_t>());
    return;
  }
  if (idx - g.f.comm_blocks < g.lanes) {
    dkdv_lane<C>(g, idx - g.f.comm_blocks);
  } else {
    dq_block<C>(g, idx - g.f.comm_blocks - g.lanes);
  }
}

/** @brief Launches one call's grid (after the caller's epoch kernel): C comm blocks, L lanes,
 * then ceil(Sl / 128) H B dq blocks. */
template <typename T, int D>
inline cudaError_t launch(const globals& g, cudaStream_t stream, int device) {
  using C = config<T, D>;
  static_assert(C::SMEM + sizeof(wait_bound) <= 232448,
                "ring_attn_bwd: shared memory over the sm_90 limit of 227 KiB");
  const void* fn = reinterpret_cast<const void*>(&kernel<C>);
  if (cudaError_t err = opt_in_smem(fn, device, static_cast<int>(C::SMEM)); err != cudaSuccess) {
    return err;
  }
  const int64_t blocks =
      int64_t(g.f.comm_blocks) + g.lanes + int64_t(g.f.q_tiles) * g.f.d.h * g.f.d.b;
  kernel<C><<<static_cast<unsigned>(blocks), THREADS, C::SMEM, stream>>>(g);
  return cudaGetLastError();
}

}  // namespace pk::ring_attn_bwd
