/*
 * ring_attn: the forward of ring attention in one kernel: softmax(scale q k^T) v of the local
 * queries over the whole sequence, whose K/V blocks travel around the ring of P ranks while
 * the same kernel folds them into its online softmax (reference: pk_jax/ops/ring_attn.py).
 *
 * Shardings (rank r of P): q, o [B, Sl, H, D]; k, v [B, Sl, Hkv, D] (Sl = S / P, Hkv divides
 * H); lse float32 [B, H, Sl]. Rank r holds positions [r Sl, (r+1) Sl) (contiguous), or with
 * zigzag the chunks r and 2P-1-r of c = Sl / 2 positions each (local rows [0, c) and [c, Sl)).
 *
 * Schedule. One grid per call (after the epoch kernel): C communication blocks first (so they
 * are resident before any compute block spins on them), then one compute block per (q tile of
 * block_rows rows, head, batch), the attention forward's block (attn::fwd_block,
 * pk/attn/fwd_mainloop.cuh). At step t rank r holds the K/V block of rank j = (r - t) mod P:
 *
 *     step t    comm block cb of rank r (its chunks     compute block (any tile of rank r)
 *               ch = cb, cb + C, ... in order)
 *     ------    ------------------------------------    -----------------------------------
 *       0       barrier with every peer's block cb;     K/V tiles of the local k, v (TMA)
 *               push chunk ch of k, v into slot 1 of
 *               rank r+1; FULL[1][ch] there
 *     1..P-2    wait FULL[t][ch] here; forward chunk    wait FULL[t][ch] for the chunk of
 *               ch of slot t to slot t+1 of r+1;        the next tile it loads (the issuing
 *               FULL[t+1][ch] there                     thread); K/V tiles of slot t
 *      P-1      wait FULL[P-1][ch] here (the last       as above; then O / l and lse out
 *               block landed: after this kernel
 *               nobody writes my workspace)
 *
 * A chunk is CT consecutive 128-row tiles of a K/V block (all heads, every batch), CT the
 * smallest that gives at most MAX_CHUNKS chunks: a chunk is forwarded as soon as it has landed,
 * so a hop costs one chunk's copy, not a block's, and a compute block waits only for the
 * chunks of the tiles it loads.
 *
 * The compute block keeps Q, the running max and sum and the O accumulator in registers over
 * its steps: the K/V tiles of all steps form one stream through its mbarrier ring, and the
 * online softmax just continues. Without any mask (not causal), where each half has two
 * waves of compute blocks or more, a query tile is two blocks (step groups, below): the first
 * streams steps [0, P/2) and saves its softmax state, the second the rest and folds it in, and
 * the grid holds every first half before any second, so the first wave needs only the first
 * half of the exchange. With causal masking a (query tile, key tile) pair is full, partial
 * (masked element by element on global positions) or hidden; hidden pairs are never loaded,
 * so a block never waits for a step it does not need (the block is still forwarded).
 *
 * Workspace: P - 1 slots for K then P - 1 for V, each one K/V block [B, Sl, Hkv, D]: slot t
 * (t = 1..P-1) holds the block of rank (r - t) mod P; with step groups, the first groups' saved
 * states and their flags after them (state_bytes). All P - 1 blocks are kept (a full ring,
 * 2 (P-1) B Sl Hkv D sizeof(T) bytes), not double-buffered: a compute block keeps its O in
 * registers across every step, so a slot cannot be refilled before every compute block of the
 * rank has passed that step, and compute blocks that are not yet resident would never pass it.
 *
 * Signal protocol (slots SLOT_BASE.. of the pad; e = this call's epoch, pk/tp.cuh epoch_kernel):
 * ENTER[cb][s] (barrier of comm block cb with every peer: every peer's earlier kernels are over,
 * so none still reads a workspace I am about to write); FULL[t][ch], written by rank r-1's comm
 * block ch % C after chunk ch of slot t landed in my workspace (release at system scope), read
 * by my comm block ch % C and by the compute blocks that load a tile of chunk ch (acquire);
 * with step groups, STATES_CLEAR (local), raised by comm block 0 past its ENTER barrier once
 * this call's state flags are zeroed, acquired by every compute block before it raises or
 * reads one.
 * Every wait is bounded and names the peer; compute blocks wait 1/8 longer than the comm
 * blocks, whose timeouts name a dead rank.
 *
 * Masks (masked_kernel, section "Masks" below): segment ids, a local window, query and key
 * lengths on global positions and the logits soft cap; the same schedule and signals, each
 * step streaming only the key tiles that may hold a visible pair.
 *
 * Pitfalls: bulk copies and TMA loads are the async proxy, the signals the generic proxy: the
 * copying thread fences (fence.proxy.async.global) before and after its copies, the compute
 * block's issuing thread after its FULL wait. C (num_comm_sms) must be the same on every rank
 * (comm blocks pair across ranks): it is an attribute of the call. The TMA maps zero-fill rows
 * past Sl; the kernel masks those keys and stores no row past Sl.
 */
#pragma once

#include "kernels/attention.cuh"
#include "pk/attn/peers.cuh"
#include "pk/collective.cuh"
#include "pk/tp.cuh"

namespace pk::ring_attn {

namespace masks = attn::masks;

constexpr int MAX_PEERS = tp::MAX_PEERS;
constexpr int MAX_COMM = 16;    // communication blocks at most
// Rows of the tile that chunks are counted in (globals::chunk_tiles): the q tile's, also the
// key tile of every kernel but the non-causal forward at D = 128 (176 keys, block_keys).
constexpr int CHUNK_TILE_ROWS = 128;
// Chunks of a K/V block (signal granularity). 16 keeps FULL (and the backward's DKV,
// kernels/ring_attn_bwd.cuh) within 640 slots, the ring's range once Ulysses attention's slots
// follow it (kernels/ulysses_attn.cuh, branch uly).
constexpr int MAX_CHUNKS = 16;

// Signal pad: slots SLOT_BASE + these offsets (the host passes pads already offset). The range
// lies between the collectives' slots and the fused GEMMs' (pk/tp.cuh); Ulysses attention's
// (kernels/ulysses_attn.cuh) follows it.
constexpr uint64_t SLOT_BASE = 6400;
constexpr uint64_t OP_SLOTS = 640;
constexpr uint64_t EPOCH = tp::EPOCH;                          // local: calls so far
constexpr uint64_t STATES_CLEAR = 1;  // local: this call's step-group flags are zeroed
constexpr uint64_t ENTER = 16;                                 // [cb][s]
constexpr uint64_t FULL = ENTER + uint64_t(MAX_COMM) * MAX_PEERS;  // [t][ch]
constexpr uint64_t END = FULL + uint64_t(MAX_PEERS) * MAX_CHUNKS;
constexpr uint64_t SLOTS_NEEDED = SLOT_BASE + OP_SLOTS;
static_assert(EPOCH < STATES_CLEAR && STATES_CLEAR < ENTER && END <= OP_SLOTS,
              "ring_attn: slot layout");
static_assert(SLOT_BASE >= coll::SLOTS && SLOTS_NEEDED <= tp::SLOT_BASE,
              "ring_attn: the slot range must lie between the collectives' and the GEMMs'");

/** @brief Kernel arguments. Maps: {D, heads, Sl, batch} with boxes {64, 1, rows, 1}: rows
 * block_rows for q, block_keys for k, v, ks and vs (128 and 128 in the masked kernel). */
struct globals {
  CUtensorMap q, k, v;  // local operands
  CUtensorMap ks, vs;   // my workspace's slots: batch index (t - 1) B + b
  void* o;              // [B, Sl, H, D]
  float* lse;           // [B, H, Sl]
  const void* k_local;
  const void* v_local;
  tp::comm c;
  attn::dims d;          // s = Sl
  int zigzag;            // causal with the zigzag layout
  int comm_blocks;       // C
  int q_tiles;           // ceil(Sl / BM): query tiles of the kernel's BM rows
  int chunk_tiles;       // CT: 128-row tiles (CHUNK_TILE_ROWS) per chunk
  int n_chunks;          // ceil(ceil(Sl / 128) / CT)
  uint64_t block_bytes;  // of one K (or V) block: B Sl Hkv D sizeof(T)
  // Step groups (the unmasked non-causal kernel; 1 elsewhere): each query tile is G compute
  // blocks, group i streaming steps [i P / G, (i + 1) P / G); see "Step groups" below.
  int groups;            // G
  int items;             // q_tiles H B: compute blocks per group
  int first_step[MAX_PEERS + 1];  // group i streams steps [first_step[i], first_step[i + 1])
  float4* states;        // G > 1: group i < G - 1's softmax states (state_slot), in my workspace
  uint64_t* state_full;  // G > 1: one flag per state, zeroed by the kernel (clear_state_flags)
  int64_t state_flags;   // G > 1: how many
};

/** @brief The launchers' (forward and backward) chunking of a K/V block of Sl = s rows: CT,
 * the fewest 128-row tiles per chunk that give at most MAX_CHUNKS chunks, and the chunks. */
inline void set_chunks(globals& g, int64_t s) {
  const int tiles = static_cast<int>((s + CHUNK_TILE_ROWS - 1) / CHUNK_TILE_ROWS);
  g.chunk_tiles = (tiles + MAX_CHUNKS - 1) / MAX_CHUNKS;
  g.n_chunks = (tiles + g.chunk_tiles - 1) / g.chunk_tiles;
}

/** @brief Global position of local row `i` of rank `owner`'s shard. */
__device__ inline int global_pos(const globals& g, int owner, int i) {
  const int s = g.d.s;
  if (!g.zigzag) return owner * s + i;
  const int c = s / 2;
  return i < c ? owner * c + i : (2 * g.c.world - 1 - owner) * c + (i - c);
}

/** @brief Smallest and largest global position of local rows [lo, hi) (hi > lo). */
__device__ inline int2 span(const globals& g, int owner, int lo, int hi) {
  return make_int2(global_pos(g, owner, lo), global_pos(g, owner, hi - 1));
}

enum tile_kind : int { HIDDEN = 0, FULL_TILE = 1, PARTIAL = 2 };

/**
 * @brief A compute block's issuing thread, before its TMA reads of rows [r0, r1) of slot
 * `step` (> 0): FULL[step][ch] acquired for every chunk ch those rows touch. Chunks are counted
 * in 128-row tiles (CHUNK_TILE_ROWS) whatever the kernel's key tile, so a 176-key tile may
 * straddle two or three chunks. (w_t, w_ch): the thread's step and the last chunk it acquired
 * there; a step's tiles are streamed in key order, so chunks up to w_ch were acquired before.
 * At its first look at a step the thread reads each comm block's last chunk of the step (a comm
 * block signals its chunks in order, each after its copy, so that FULL covers its earlier
 * ones): where all had landed, the usual case once the exchange runs ahead of the attention,
 * one fence acquires the whole step, instead of 1-3 acquires per tile on a thread that also
 * computes (the issuer is a consumer: fwd_block's refills come from the last releaser).
 */
__device__ inline void acquire_rows(const globals& g, int step, int r0, int r1, int& w_t,
                                    int& w_ch, int prev) {
  const int rows = g.chunk_tiles * CHUNK_TILE_ROWS;
  const int c1 = (r1 - 1) / rows;
  if (step == w_t && c1 <= w_ch) return;
  const tp::comm& cm = g.c;
  const uint64_t e = cm.epoch();
  const uint64_t* full = cm.sig[cm.rank] + FULL + uint64_t(step) * MAX_CHUNKS;
  if (step != w_t) {
    w_t = step;
    w_ch = -1;
    bool landed = true;
    for (int cb = 0; cb < min(g.comm_blocks, g.n_chunks); ++cb) {
      const int last = cb + (g.n_chunks - 1 - cb) / g.comm_blocks * g.comm_blocks;
      landed &= ld_relaxed_sys(full + last) >= e;
    }
    if (landed) {
      fence_acq_rel_sys();
      fence_proxy_async_global();  // the acquire before the TMA reads of the slot
      w_ch = g.n_chunks - 1;
      return;
    }
  }
  for (int ch = max(r0 / rows, w_ch + 1); ch <= c1; ++ch) {
    wait(full + ch, e, cm.timeout_ns + cm.timeout_ns / 8, cm.fail(), prev);
  }
  fence_proxy_async_global();  // the acquire before the TMA reads of the slot
  w_ch = c1;
}

/** @brief Comm block 0, every thread, past its ENTER barrier (with step groups, "Step groups"
 * below): zeroes this call's state flags in my workspace, then raises STATES_CLEAR, which every
 * compute block acquires before it raises or reads a flag. Here and not before the launch: a
 * peer's kernel of the op before may read my workspace until that peer has entered this call,
 * and the barrier proves it has; stale flags of the call before read as not raised. */
__device__ inline void clear_state_flags(const globals& g, uint64_t e) {
  for (int64_t i = threadIdx.x; i < g.state_flags; i += blockDim.x) g.state_full[i] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    signal(g.c.sig[g.c.rank] + STATES_CLEAR, e);
  }
}

/** @brief One communication block (see the schedule): thread 0 moves its chunks with bulk
 * copies through the block's shared memory. */
template <class C>
__device__ void communicate(const globals& g, int cb, void* smem) {
  static_assert(sizeof(bulk_ring) + 1024 <= C::SMEM,
                "ring_attn: the bulk-copy ring must fit in the block's shared memory");
  bulk_ring& ring = *static_cast<bulk_ring*>(smem);
  const tp::comm& c = g.c;
  const int P = c.world, r = c.rank, next = (r + 1) % P, prev = (r + P - 1) % P;
  const int nc = g.comm_blocks;
  const uint64_t e = c.epoch();
  const bool lead = threadIdx.x == 0;
  if (lead) {
    ring.init();
    ring.link = c.link.peer(next, r);  // the emulator's link throttle paces the pushes
  }
  barrier<MAX_PEERS>(c.sig, P, r, ENTER + uint64_t(cb) * MAX_PEERS, e, c.timeout_ns, c.fail());
  if (cb == 0 && g.groups > 1) clear_state_flags(g, e);
  if (!lead) return;
  const uint64_t bb = g.block_bytes;
  const uint64_t row_bytes = uint64_t(g.d.hkv) * C::HEAD_DIM * sizeof(typename C::dtype);
  const int s = g.d.s, batch = g.d.b, chunk_rows = g.chunk_tiles * CHUNK_TILE_ROWS;
  char* const mine = static_cast<char*>(c.ws[r]);
  char* const theirs = static_cast<char*>(c.ws[next]);
  const uint64_t v_off = uint64_t(P - 1) * bb;
  for (int t = 0; t + 1 < P; ++t) {
    const char* src_k = t == 0 ? static_cast<const char*>(g.k_local) : mine + (t - 1) * bb;
    const char* src_v = t == 0 ? static_cast<const char*>(g.v_local) : mine + v_off + (t - 1) * bb;
    char* const dst = theirs + uint64_t(t) * bb;
    for (int ch = cb; ch < g.n_chunks; ch += nc) {
      if (t > 0) {
        wait(c.sig[r] + FULL + uint64_t(t) * MAX_CHUNKS + ch, e, c.timeout_ns, c.fail(), prev);
      }
      fence_proxy_async_global();  // the acquire (or barrier) before the bulk reads and writes
      const int r0 = ch * chunk_rows, r1 = min(r0 + chunk_rows, s);
      const uint64_t span = uint64_t(r1 - r0) * row_bytes;
      // Rows [r0, r1) of K, then of V, of every batch: 2 B contiguous pieces of `span` bytes.
      int part = 0;
      uint64_t done = 0;
      bulk_move<false, 2>(ring, [&](bulk_piece* pc) {
        if (done >= span) {
          ++part;
          done = 0;
        }
        if (part >= 2 * batch) return false;
        const int b = part / 2;
        const uint64_t off = (uint64_t(b) * s + r0) * row_bytes + done;
        const uint64_t n = span - done < bulk_ring::STAGE_BYTES ? span - done
                                                                : bulk_ring::STAGE_BYTES;
        pc->src = ((part % 2) ? src_v : src_k) + off;
        pc->dst = dst + ((part % 2) ? v_off : 0) + off;
        pc->bytes = static_cast<uint32_t>(n);
        pc->paced = true;
        done += n;
        return true;
      }, ring.link);
      fence_proxy_async_global();  // the bulk writes before the release
      __threadfence_system();
      signal(c.sig[next] + FULL + uint64_t(t + 1) * MAX_CHUNKS + ch, e);
    }
  }
  if (P > 1) {
    for (int ch = cb; ch < g.n_chunks; ch += nc) {
      wait(c.sig[r] + FULL + uint64_t(P - 1) * MAX_CHUNKS + ch, e, c.timeout_ns, c.fail(), prev);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Step groups. A compute block that streams every step needs the last step's K/V before it
// can finish, so the first wave of blocks waits for the whole exchange, and the attention
// overlaps it by one wave only (many waves per call). With G groups, the grid holds every
// query tile's group 0 (steps [0, P / G)) first, then every group 1, and so on: the early
// groups run while the later steps are still travelling. Group i < G - 1 ends by saving its
// online-softmax state (row max m, row sum l, unnormalised O: each thread's registers) to the
// workspace and raising a flag per warp; group i + 1 of the same tile, a later block, folds
// that state into its own before its epilogue (or its own save), so the last group writes o
// and lse from the state of all P steps, in fp32 throughout.
// measured: ring_attention_notes.md, "Step groups".

/** @brief A warp's saved state: 32 lanes x state_vecs(D) float4 (m, l; then O), interleaved
 * by lane. */
constexpr int state_vecs(int d) { return d / 8 + 1; }

/** @brief This block's index past the comm blocks, and the thread's lane and warp, read again
 * where they are needed: an asm volatile read is not merged with an earlier one, whose value
 * would otherwise be held in a register across the mainloop (the 176-key kernel has none to
 * spare: 255, and a spill). */
__device__ inline int compute_index(const globals& g) {
  unsigned x;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
  return static_cast<int>(x) - g.comm_blocks;
}
__device__ inline int thread_index() {
  unsigned x;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(x));
  return static_cast<int>(x);
}

/** @brief The step group of compute block `*idx` (its index past the comm blocks), which
 * becomes the block's item within the group (q tile, head, batch). By subtraction: a
 * division's setup would be hoisted out of the mainloop into a register the loop lacks. */
__device__ inline int group_of(const globals& g, int* idx) {
  int grp = 0;
  while (*idx >= g.items) {
    *idx -= g.items;
    ++grp;
  }
  return grp;
}

/** @brief Group i < G - 1 of compute item `item` (a query tile, head and batch), warp w's state
 * (warps of C::THREADS / 32 per block). */
template <class C>
__device__ inline int64_t state_slot(const globals& g, int i, int item, int w) {
  return (int64_t(i) * g.items + item) * (C::THREADS / 32) + w;
}

/** @brief Every consumer thread: saves its rows' state into `slot` and, per warp, raises the
 * slot's flag (release) once every lane's stores are done. The records and flags lie in my
 * workspace past the K/V slots, where a peer's earlier kernel (a pull of the op before this
 * one) may still read until that peer has entered this call: so first STATES_CLEAR is acquired
 * (clear_state_flags, after every peer's ENTER of comm block 0's barrier). */
template <class C>
__device__ inline void save_state(const globals& g, const attn::fwd_rows<C>& r, int64_t slot) {
  constexpr int D = C::HEAD_DIM;
  const int lane = thread_index() % 32;
  const tp::comm& c = g.c;
  if (lane == 0) {
    wait(c.sig[c.rank] + STATES_CLEAR, c.epoch(), c.timeout_ns + c.timeout_ns / 8, c.fail(),
         c.rank);
  }
  __syncwarp();
  float4* rec = g.states + slot * state_vecs(D) * 32 + lane;
  rec[0] = make_float4(r.m[0], r.m[1], r.l[0], r.l[1]);
#pragma unroll
  for (int v = 0; v < D / 8; ++v) {
    rec[(v + 1) * 32] = make_float4(r.o[4 * v], r.o[4 * v + 1], r.o[4 * v + 2], r.o[4 * v + 3]);
  }
  __threadfence();
  __syncwarp();
  if (lane == 0) signal(g.state_full + slot, 1);
}

/** @brief The issuing thread, before the block's first __syncthreads (load_q): acquires the
 * flags of group i's states of `item`, every warp's (their writers are earlier blocks of this
 * grid); the barrier then orders every thread's fold after them. Here and not at the fold: any
 * loop after the mainloop costs the 176-key kernel a spill (255 registers). The host picks step
 * groups only where a group's blocks start a wave after the group before's (step_groups), so
 * this rarely waits. */
template <class C>
__device__ inline void acquire_states(const globals& g, int i, int item) {
  const int64_t slot = state_slot<C>(g, i, item, 0);
  const tp::comm& c = g.c;
  // this call's flags are zeroed first (clear_state_flags): a flag raised by the call before
  // is not taken for this call's
  wait(c.sig[c.rank] + STATES_CLEAR, c.epoch(), c.timeout_ns + c.timeout_ns / 8, c.fail(),
       c.rank);
  for (int w = 0; w < C::THREADS / 32; ++w) {
    wait(g.state_full + slot + w, 1, g.c.timeout_ns + g.c.timeout_ns / 8, g.c.fail(), g.c.rank);
  }
}

/** @brief Every consumer thread, after acquire_states: folds the saved state of the same
 * rows into its own: one online-softmax step, with the saved (m, l, O) as the other operand.
 * Rows that saw no key (m = -inf) weigh 0. */
template <class C>
__device__ inline void fold_state(const globals& g, attn::fwd_rows<C>& r, int64_t slot) {
  constexpr int D = C::HEAD_DIM;
  const int lane = thread_index() % 32;
  const float4* rec = g.states + slot * state_vecs(D) * 32 + lane;
  const float4 ml = rec[0];
  const float m_in[2] = {ml.x, ml.y}, l_in[2] = {ml.z, ml.w};
  // exp((m - max) scale), not the mainloop's exp2 of scale log2(e): that product, merged with
  // the mainloop's, would stay live past the loop, where the 176-key kernel has no register left.
  const float scale = g.d.scale;
  float a_in[2], a_own[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float mx = fmaxf(m_in[i], r.m[i]);
    a_in[i] = m_in[i] == -INFINITY ? 0.f : expf((m_in[i] - mx) * scale);
    a_own[i] = r.m[i] == -INFINITY ? 0.f : expf((r.m[i] - mx) * scale);
    r.l[i] = r.l[i] * a_own[i] + l_in[i] * a_in[i];
    r.m[i] = mx;
  }
#pragma unroll
  for (int v = 0; v < D / 8; ++v) {
    const float4 x = rec[(v + 1) * 32];
    r.o[4 * v] = r.o[4 * v] * a_own[0] + x.x * a_in[0];
    r.o[4 * v + 1] = r.o[4 * v + 1] * a_own[0] + x.y * a_in[0];
    r.o[4 * v + 2] = r.o[4 * v + 2] * a_own[1] + x.z * a_in[1];
    r.o[4 * v + 3] = r.o[4 * v + 3] * a_own[1] + x.w * a_in[1];
  }
}

/**
 * @brief attn::fwd_block's source in a compute block (see the schedule): the local query
 * tile (q tile, head, batch from the block index), its K/V stream over the steps t = 0..P-1
 * (the block of rank (r - t) mod P: the local k, v at t = 0, workspace slot t after), causally
 * hidden tiles left out (a step's visible tiles are a prefix: key positions grow with the
 * local index in both layouts). Each thread has its own copy: the (step, chunk) whose FULL it
 * acquired last, and softmax's place in the stream (walked in order, no division per step).
 */
template <class C, bool CAUSAL>
struct ring_keys : attn::step_stream<ring_keys<C, CAUSAL>> {
  using attn::step_stream<ring_keys>::owner;
  int h, hk, b, q0, n_kv;
  int2 qspan;                        // smallest and largest global position of the block's rows
  mutable int w_t = 0, w_ch = -1;    // acquire_rows: the step and last chunk acquired
  mutable int it_t = 0, it_j = 0;    // causal: item's cursor (step it_t starts at tile it_j)

  __device__ explicit ring_keys(const globals& g) {
    const attn::dims& dm = g.d;
    int idx = blockIdx.x - g.comm_blocks;
    int t_lo = 0, t_hi = g.c.world;
    if constexpr (!CAUSAL) {  // step groups: group-major items (see "Step groups")
      const int grp = group_of(g, &idx);
      t_lo = g.first_step[grp];
      t_hi = g.first_step[grp + 1];
    }
    h = idx % dm.h;
    const int qb_raw = (idx / dm.h) % g.q_tiles;
    b = idx / (dm.h * g.q_tiles);
    // Contiguous causal: the longest rows first (as the attention forward).
    const int qb = CAUSAL && !g.zigzag ? g.q_tiles - 1 - qb_raw : qb_raw;
    q0 = qb * C::BM;
    hk = h / (dm.h / dm.hkv);
    n_kv = ceil_div(dm.s, C::BN);
    qspan = span(g, g.c.rank, q0, min(q0 + C::BM, dm.s));
    this->n = 0;
    for (int t = t_lo; t < t_hi; ++t) this->n += count(g, t);
    this->at_t = t_lo;
    this->at_n = count(g, t_lo);
    while (this->at_n == 0) this->at_n = count(g, ++this->at_t);
    this->at_o = owner(g, this->at_t);
  }
  /** @brief Step t's visible key tiles: those whose first key is at or before the block's last
   * row, a prefix (key positions grow with the local index), from the number of the owner's
   * keys at or before it (closed form: in zigzag, the owner's first half, then its second). */
  __device__ int count(const globals& g, int t) const {
    if (!CAUSAL) return n_kv;
    const int o = owner(g, t), s = g.d.s, y = qspan.y;
    int keys;
    if (!g.zigzag) {
      keys = min(max(y - o * s + 1, 0), s);
    } else {
      const int c = s / 2;
      keys = min(max(y - o * c + 1, 0), c) +
             min(max(y - (2 * g.c.world - 1 - o) * c + 1, 0), s - c);
    }
    return ceil_div(keys, C::BN);
  }
  /** @brief Stream tile j: key tile *kt of step t (returned). Causal: from this thread's cursor
   * (the first tile of step it_t is stream tile it_j), which only moves forward, as the tiles a
   * thread loads do; so a step's count is computed once per thread, not once per load. */
  __device__ int item(const globals& g, int j, int* kt) const {
    if (!CAUSAL) {  // the group's first step from the block index, not held in a register
      int idx = compute_index(g);
      const int t = j / n_kv;
      *kt = j - t * n_kv;
      return g.first_step[group_of(g, &idx)] + t;
    }
    if (j < it_j) it_t = it_j = 0;  // not reached (loads are in stream order); kept exact
    for (int c = count(g, it_t); j - it_j >= c; c = count(g, ++it_t)) it_j += c;
    *kt = j - it_j;
    return it_t;
  }
  __device__ int row0() const { return q0; }
  /** @brief The issuing thread, first: with step groups, the group before's states acquired. */
  __device__ void load_q(const globals& g, typename C::q_tile& t, mbarrier* bar) const {
    if constexpr (!CAUSAL) {
      int item = compute_index(g);
      const int grp = group_of(g, &item);
      if (grp > 0) acquire_states<C>(g, grp - 1, item);
    }
    attn::load_rows(t, &g.q, bar, b, q0, h);
  }
  /** @brief K (v = false) or V of stream tile j: the local k, v at step 0, else slot t once
   * its chunk's FULL is acquired. */
  __device__ void load_kv(const globals& g, typename C::kv_tile& t, mbarrier* bar, int j,
                          bool v) const {
    int kt;
    const int step = item(g, j, &kt);
    if (step > 0) {
      acquire_rows(g, step, kt * C::BN, min((kt + 1) * C::BN, g.d.s), w_t, w_ch, owner(g, 1));
    }
    const CUtensorMap* map = step == 0 ? (v ? &g.v : &g.k) : (v ? &g.vs : &g.ks);
    attn::load_rows(t, map, bar, step == 0 ? b : (step - 1) * g.d.b + b, kt * C::BN, hk);
  }
  __device__ void load_k(const globals& g, typename C::kv_tile& t, mbarrier* bar, int j) const {
    load_kv(g, t, bar, j, false);
  }
  __device__ void load_v(const globals& g, typename C::kv_tile& t, mbarrier* bar, int j) const {
    load_kv(g, t, bar, j, true);
  }
  /** @brief Masks keys past Sl and, on tiles whose last key comes after the block's first row,
   * keys at later global positions than the row; then the online-softmax update. Called for
   * stream tiles 0, 1, .. in order. */
  __device__ void softmax(const globals& g, attn::fwd_rows<C>& r, int /*j*/,
                          int /*wg_row0*/, const int (&rows)[2], float sl2) const {
    const int k0 = this->at_kt * C::BN;
    const bool tail = k0 + C::BN > g.d.s;
    const int o = this->at_o;
    const bool part = CAUSAL && global_pos(g, o, min(k0 + C::BN, g.d.s) - 1) > qspan.x;
    if (tail || part) {
      const int qg[2] = {global_pos(g, g.c.rank, rows[0]), global_pos(g, g.c.rank, rows[1])};
      r.mask(k0, g.d.s, part, [&](int key) { return global_pos(g, o, key); }, qg);
    }
    r.softmax(sl2);
    this->next(g);
  }
  /** @brief With step groups, the earlier group's state folded in first; a group before the
   * last saves its state instead of storing. */
  __device__ void store(const globals& g, attn::fwd_rows<C>& r, int wg_row0) const {
    const attn::dims& dm = g.d;
    if constexpr (!CAUSAL) {  // (group, item) again from the block index: no registers held
      int item = compute_index(g);
      const int grp = group_of(g, &item), w = thread_index() / 32;
      if (grp > 0) fold_state<C>(g, r, state_slot<C>(g, grp - 1, item, w));
      if (grp + 1 < g.groups) {
        save_state<C>(g, r, state_slot<C>(g, grp, item, w));
        return;
      }
    }
    r.store(g.o, g.lse + (int64_t(b) * dm.h + h) * dm.s, b, wg_row0, h, dm.h, dm.s, dm.scale);
  }
};

/** @brief The kernel (see the schedule); CAUSAL = g.d.causal. */
template <class C, bool CAUSAL>
__global__ void __launch_bounds__(C::THREADS, 1) kernel(const __grid_constant__ globals g) {
  attn::comm_or_compute<C, ring_keys<C, CAUSAL>>(
      g, [&](void* smem) { communicate<C>(g, blockIdx.x, smem); });
}

// ---------------------------------------------------------------------------------------------
// Masks (issue 38 section 3): masked_kernel, the forward with segment ids, a local window,
// query and key lengths and the logits soft cap on GLOBAL positions (pk/attn/masks.cuh says
// what each hides; the same functions decide here), and ring_attn_bwd.cuh's masked lanes.
//
// The ids are the whole sequence's, [B, sp] by global position (sp = S rounded up to 128, S =
// Sl P), with their 64-position chunks' ranges: the caller all-gathers every rank's ids along
// the axis, so a segment may cross chunk and rank boundaries and no ids travel with the
// blocks. A run of local rows maps to at most two runs of consecutive global positions (the
// zigzag halves), so a query tile's keys are the union of its runs' (masks::fwd_key_tiles),
// and a step streams the owner's local key tiles covering that hull (local_hull; in zigzag the
// hull of the two halves' parts, conservative): tiles outside it are never loaded, so a block
// never waits for a step it has no visible key in. Within a streamed tile a warpgroup's
// sub-tile runs the element masks unless both its rows and its keys are runs of consecutive
// global positions inside the shards that every mask lets through (needs_mask). Zigzag applies
// with any mask by position (the unmasked kernel's only with causal).

/** @brief The masked kernels' arguments: the unmasked ones and the masks over the whole
 * sequence (attn::mask_args: lengths [B], window, cap; ids and chunk ranges [B, sp] and
 * [B, sp / 64] by global position, sp = Sl P rounded up to 128). */
struct masked_globals : globals {
  attn::mask_args m;
};

/** @brief The hull of two spans (either may be empty). */
__device__ __forceinline__ masks::span hull(masks::span a, masks::span b) {
  if (a.empty()) return b;
  if (b.empty()) return a;
  return masks::span{min(a.lo, b.lo), max(a.hi, b.hi)};
}

/** @brief Local rows [lo, hi) (0 <= lo < hi <= Sl) of owner's shard as runs of consecutive
 * global positions: one (contiguous), or one per zigzag half they meet (empty: none). */
__device__ __forceinline__ void global_runs(const globals& g, int owner, int lo, int hi,
                                            masks::span (&out)[2]) {
  const int s = g.d.s;
  if (!g.zigzag) {
    out[0] = masks::span{owner * s + lo, owner * s + hi};
    out[1] = masks::span{0, 0};
    return;
  }
  const int c = s / 2, a1 = min(hi, c), b0 = max(lo, c);
  out[0] = lo < a1 ? masks::span{global_pos(g, owner, lo), global_pos(g, owner, a1 - 1) + 1}
                   : masks::span{0, 0};
  out[1] = b0 < hi ? masks::span{global_pos(g, owner, b0), global_pos(g, owner, hi - 1) + 1}
                   : masks::span{0, 0};
}

/** @brief The local positions of owner's shard whose global positions lie in x, as one span:
 * exact when contiguous, the hull of the two halves' parts in zigzag. */
__device__ __forceinline__ masks::span local_hull(const globals& g, int owner, masks::span x) {
  if (x.empty()) return masks::span{0, 0};
  const int s = g.d.s;
  if (!g.zigzag) return masks::intersect(masks::span{x.lo - owner * s, x.hi - owner * s},
                                         masks::span{0, s});
  const int c = s / 2, o2 = 2 * g.c.world - 1 - owner;
  const masks::span a =
      masks::intersect(masks::span{x.lo - owner * c, x.hi - owner * c}, masks::span{0, c});
  const masks::span b = masks::intersect(masks::span{x.lo - o2 * c + c, x.hi - o2 * c + c},
                                         masks::span{c, s});
  return hull(a, b);
}

/** @brief The positional masks of batch row b over the whole sequence. */
__device__ __forceinline__ masks::positions positions_of(const masked_globals& g, int b) {
  return masks::positions::of(g.d.s * g.c.world, g.m.q_len[b], g.m.kv_len[b], g.m.left,
                              g.m.right, g.d.causal != 0);
}

/** @brief Batch row b's chunk ranges (queries' or keys'). */
__device__ __forceinline__ const masks::chunk_info* chunks_of(const masks::chunk_info* info,
                                                              const masked_globals& g, int b) {
  return info + int64_t(b) * (g.m.sp / masks::CHUNK);
}

/** @brief Whether the sub-tile of local rows [r0, r0 + nr) of `rank` and local keys [k0, k0 +
 * nk) of `owner` needs its element masks: unless both are runs of consecutive global positions
 * inside the shards (not past Sl, not across the zigzag halves) that every mask lets through
 * (masks::all_visible; with segments masks::same_segment over their chunks, rounded outwards:
 * a run need not start on a chunk). */
__device__ __forceinline__ bool needs_mask(const masked_globals& g, const masks::positions& p,
                                           int b, int rank, int r0, int nr, int owner, int k0,
                                           int nk) {
  const int s = g.d.s;
  if (r0 + nr > s || k0 + nk > s) return true;
  if (g.zigzag) {
    const int c = s / 2;
    if ((r0 < c) != (r0 + nr <= c) || (k0 < c) != (k0 + nk <= c)) return true;
  }
  const int rg = global_pos(g, rank, r0), kg = global_pos(g, owner, k0);
  if (!masks::all_visible(p, rg, nr, kg, nk)) return true;
  constexpr int CH = masks::CHUNK;
  return g.m.segments &&
         !masks::same_segment(chunks_of(g.m.q_info, g, b), rg / CH, (rg + nr + CH - 1) / CH,
                              chunks_of(g.m.kv_info, g, b), kg / CH, (kg + nk + CH - 1) / CH);
}

/** @brief The global keys local rows [q0, q1) of `rank` may see: the hull of their runs'
 * masks::fwd_key_tiles (positions: tiles of one). */
__device__ __forceinline__ masks::span keys_of_rows(const masked_globals& g,
                                                    const masks::positions& p, int b, int rank,
                                                    int q0, int q1) {
  masks::span runs[2];
  global_runs(g, rank, q0, q1, runs);
  const masks::chunk_info* qi = chunks_of(g.m.q_info, g, b);
  masks::span out{0, 0};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!runs[i].empty()) {
      out = hull(out, masks::fwd_key_tiles(p, qi, g.m.segments != 0, runs[i].lo,
                                           runs[i].hi - runs[i].lo, 1));
    }
  }
  return out;
}

/** @brief The global rows that may see local keys [k0, k1) of `owner`: the hull of their runs'
 * masks::bwd_query_tiles (positions). */
__device__ __forceinline__ masks::span rows_of_keys(const masked_globals& g,
                                                    const masks::positions& p, int b, int owner,
                                                    int k0, int k1) {
  masks::span runs[2];
  global_runs(g, owner, k0, k1, runs);
  const masks::chunk_info* ki = chunks_of(g.m.kv_info, g, b);
  masks::span out{0, 0};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!runs[i].empty()) {
      out = hull(out, masks::bwd_query_tiles(p, ki, g.m.segments != 0, runs[i].lo,
                                             runs[i].hi - runs[i].lo, 1));
    }
  }
  return out;
}

/**
 * @brief attn::fwd_block's source in a masked compute block: ring_keys' query tile and K/V
 * stream, each step t streaming only the owner's key tiles `range(t)` that cover the keys the
 * block's rows may see (a step with none is left out, and so is its FULL wait); the scores
 * capped (CAP) and element-masked on global positions where needs_mask says so. Each thread
 * has its own copy: the loads' cursor (it_*) and softmax's place (at_*), both walked in order.
 */
template <class C, bool CAP>
struct masked_keys {
  int h, hk, b, q0, n, rank, world;
  masks::positions p;
  masks::span keys;                    // the global keys the block's rows may see
  mutable int w_t = 0, w_ch = -1;      // acquire_rows: the step and last chunk acquired
  mutable int it_t = 0, it_j = 0, it_lo, it_n;          // loads: step it_t from stream tile it_j
  mutable int at_t = 0, at_kt = 0, at_o, at_lo, at_n;   // softmax: step, its tile, owner, range

  __device__ explicit masked_keys(const masked_globals& g) {
    const attn::dims& dm = g.d;
    const int idx = blockIdx.x - g.comm_blocks;
    h = idx % dm.h;
    const int qb_raw = (idx / dm.h) % g.q_tiles;
    b = idx / (dm.h * g.q_tiles);
    const int qb = dm.causal && !g.zigzag ? g.q_tiles - 1 - qb_raw : qb_raw;
    q0 = qb * C::BM;
    hk = h / (dm.h / dm.hkv);
    rank = g.c.rank;
    world = g.c.world;
    p = positions_of(g, b);
    keys = keys_of_rows(g, p, b, rank, q0, min(q0 + C::BM, dm.s));
    n = 0;
    for (int t = 0; t < world; ++t) n += count(range(g, t));
    const masks::span r0 = range(g, 0);
    it_lo = r0.lo;
    it_n = count(r0);
    at_lo = r0.lo;
    at_n = it_n;
    while (at_n == 0 && at_t + 1 < world) {
      const masks::span r = range(g, ++at_t);
      at_lo = r.lo;
      at_n = count(r);
    }
    at_o = owner(at_t);
  }
  __device__ int owner(int t) const { return rank >= t ? rank - t : rank - t + world; }
  /** @brief Step t's key tiles (local to its owner). */
  __device__ masks::span range(const masked_globals& g, int t) const {
    return masks::tiles_of(local_hull(g, owner(t), keys), C::BN);
  }
  __device__ static int count(masks::span r) { return r.empty() ? 0 : r.hi - r.lo; }
  __device__ wait_bound bound(const masked_globals& g) const { return g.c.bound(); }
  __device__ int n_tiles() const { return n; }
  __device__ int row0() const { return q0; }
  /** @brief Stream tile j: local key tile *kt of step t (returned), from this thread's cursor,
   * which only moves forward (loads are in stream order). */
  __device__ int item(const masked_globals& g, int j, int* kt) const {
    while (j - it_j >= it_n) {
      it_j += it_n;
      const masks::span r = range(g, ++it_t);
      it_lo = r.lo;
      it_n = count(r);
    }
    *kt = it_lo + (j - it_j);
    return it_t;
  }
  __device__ void load_q(const masked_globals& g, typename C::q_tile& t, mbarrier* bar) const {
    attn::load_rows(t, &g.q, bar, b, q0, h);
  }
  /** @brief K (v = false) or V of stream tile j, as ring_keys::load_kv. */
  __device__ void load_kv(const masked_globals& g, typename C::kv_tile& t, mbarrier* bar, int j,
                          bool v) const {
    int kt;
    const int step = item(g, j, &kt);
    if (step > 0) {
      acquire_rows(g, step, kt * C::BN, min((kt + 1) * C::BN, g.d.s), w_t, w_ch, owner(1));
    }
    const CUtensorMap* map = step == 0 ? (v ? &g.v : &g.k) : (v ? &g.vs : &g.ks);
    attn::load_rows(t, map, bar, step == 0 ? b : (step - 1) * g.d.b + b, kt * C::BN, hk);
  }
  __device__ void load_k(const masked_globals& g, typename C::kv_tile& t, mbarrier* bar,
                         int j) const {
    load_kv(g, t, bar, j, false);
  }
  __device__ void load_v(const masked_globals& g, typename C::kv_tile& t, mbarrier* bar,
                         int j) const {
    load_kv(g, t, bar, j, true);
  }
  /** @brief The current tile's scores capped (CAP), their hidden pairs set to -inf where the
   * warpgroup's 64 rows from wg_row0 need it (the thread's local rows: `rows`; keys past Sl
   * always), then the online-softmax update; softmax's place moves on. */
  __device__ void softmax(const masked_globals& g, attn::fwd_rows<C>& r, int /*j*/,
                          int wg_row0, const int (&rows)[2], float sl2) const {
    constexpr int BN = C::BN;
    const int k0 = (at_lo + at_kt) * BN, o = at_o, s = g.d.s;
    if constexpr (CAP) attn::soft_cap(r.sc, g.m.cap_in, g.m.cap_out);
    if (needs_mask(g, p, b, rank, wg_row0, 64, o, k0, BN)) {
      const int lane = threadIdx.x % 32;
      const bool seg = g.m.segments != 0;
      const int* ids = g.m.kv_seg + int64_t(b) * g.m.sp;
      masks::span vis[2];
      int qs[2] = {0, 0};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        vis[i] = masks::span{0, 0};
        if (rows[i] < s) {
          const int qg = global_pos(g, rank, rows[i]);
          vis[i] = masks::keys_of_row(p, qg);
          if (seg) qs[i] = g.m.q_seg[int64_t(b) * g.m.sp + qg];
        }
      }
#pragma unroll
      for (int jj = 0; jj < BN / 8; ++jj) {
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const int key = k0 + 8 * jj + 2 * (lane % 4) + cc;
          const bool in = key < s;  // keys past Sl: the maps' zero fill
          const int kg = in ? global_pos(g, o, key) : -1;
          const int id = seg && in ? ids[kg] : 0;
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            if (!in || !vis[i].contains(kg) || id != qs[i]) r.sc[4 * jj + 2 * i + cc] = -INFINITY;
          }
        }
      }
    }
    r.softmax(sl2);
    if (++at_kt == at_n) {
      at_kt = 0;
      at_n = 0;
      while (at_n == 0 && at_t + 1 < world) {
        const masks::span rg = range(g, ++at_t);
        at_lo = rg.lo;
        at_n = count(rg);
      }
      at_o = owner(at_t);
    }
  }
  __device__ void store(const masked_globals& g, attn::fwd_rows<C>& r, int wg_row0) const {
    const attn::dims& dm = g.d;
    r.store(g.o, g.lse + (int64_t(b) * dm.h + h) * dm.s, b, wg_row0, h, dm.h, dm.s, dm.scale);
  }
};

/** @brief The masked kernel (the schedule's, over masked_keys; CAP: the soft cap). A compute
 * block whose rows see no key in any step streams no tile: the mainloop needs one, so it
 * writes its zeros (O = 0, lse = +inf) and returns; the comm blocks forward every chunk as in
 * the unmasked kernel. */
template <class C, bool CAP>
__global__ void __launch_bounds__(C::THREADS, 1)
    masked_kernel(const __grid_constant__ masked_globals g) {
  using Src = masked_keys<C, CAP>;
  if (static_cast<int>(blockIdx.x) >= g.comm_blocks) {
    const Src src(g);
    if (src.n_tiles() == 0) {
      attn::fwd_rows<C> none;  // O = 0, l = 0
      src.store(g, none, src.row0() + 64 * warpgroup::index());
      return;
    }
  }
  attn::comm_or_compute<C, Src>(g, [&](void* smem) { communicate<C>(g, blockIdx.x, smem); });
}

/** @brief The unmasked kernel's keys per streamed tile, also the rows of the k, v, ks and vs
 * maps' boxes: pk.attention's (attention::fwd_block_keys: 176 at D = 128 without a causal
 * mask), where a tile's fixed costs spread over more keys. The masked kernel keeps 128.
 * measured: ring_attention_notes.md, "176-key tiles at every P". */
constexpr int block_keys(int d, bool causal) { return attention::fwd_block_keys(d, causal); }

/** @brief The unmasked kernel's query rows per block, also the rows of the q map's box: 128
 * (two consumer warpgroups), but pk.attention's three (192 rows) at D = 64 without a causal
 * mask; with it, three spill (28 bytes at 168 registers, nvcc 13.0). The masked kernel keeps
 * 128. measured: ring_attention_notes.md, "176-key tiles at every P". */
constexpr int block_rows(int d, bool causal) {
  return d == 64 && !causal ? attention::fwd_block_rows(d) : 128;
}

/** @brief Step groups G of the unmasked kernel (see "Step groups") for `items` compute items
 * on `compute_sms` SMs (the rank's SMs less its comm blocks): 2 for a non-causal call at P >= 4
 * whose items make 2 to 16 waves, else 1.
 * - At least 2 waves per group: else a group 1 block is resident while its tile's group 0 is
 *   not yet, and waits at its start.
 * - P >= 4 and at most 16 waves: saving and folding the state has a cost, and what the groups
 *   hide is the exchange, which is short at P = 2 (one step travels) and small against the
 *   attention at many waves. Fit on the scale model; on held-out shapes it was right less often
 *   than its test asked, while faster than no groups (ring_attention_notes.md, "Step groups,
 *   measured"). */
inline int step_groups(int world, bool causal, int64_t items, int compute_sms) {
  const int64_t lo = 2 * int64_t(compute_sms), hi = 16 * int64_t(compute_sms);
  return world >= 4 && !causal && compute_sms > 0 && items >= lo && items <= hi ? 2 : 1;
}

/** @brief Workspace bytes of G step groups' states beyond the K/V slots (0 for G = 1): the
 * records, (G - 1) per item and warp of state_vecs(d) x 32 float4 each, then their flags. */
struct state_sizes {
  uint64_t records, flags;
};
inline state_sizes state_bytes(int groups, int64_t items, int d, bool causal) {
  if (groups <= 1) return {0, 0};
  const uint64_t recs = uint64_t(groups - 1) * items * (block_rows(d, causal) / 16);  // warps
  return {recs * uint64_t(state_vecs(d)) * 32 * sizeof(float4), recs * sizeof(uint64_t)};
}

/** @brief Launches the grid of one call (after the caller's epoch kernel): C comm blocks,
 * then q_tiles H B compute blocks (q_tiles = ceil(Sl / block_rows(D, CAUSAL))). */
template <typename T, int D, bool CAUSAL>
inline cudaError_t launch_as(const globals& g, cudaStream_t stream, int device) {
  using C = attention::fwd_config<T, D, block_rows(D, CAUSAL) / 64, block_keys(D, CAUSAL)>;
  static_assert(C::SMEM + sizeof(wait_bound) <= 232448,
                "ring_attn: shared memory over the sm_90 limit of 227 KiB");
  const void* fn = reinterpret_cast<const void*>(&kernel<C, CAUSAL>);
  if (cudaError_t err = opt_in_smem(fn, device, static_cast<int>(C::SMEM)); err != cudaSuccess) {
    return err;
  }
  static_assert(C::THREADS / 32 == block_rows(D, CAUSAL) / 16,
                "ring_attn: state_slot's warps per item are state_bytes'");
  const int groups = CAUSAL ? 1 : g.groups;
  const int64_t blocks = int64_t(g.comm_blocks) + int64_t(groups) * g.items;
  kernel<C, CAUSAL><<<static_cast<unsigned>(blocks), C::THREADS, C::SMEM, stream>>>(g);
  return cudaGetLastError();
}

template <typename T, int D>
inline cudaError_t launch(const globals& g, cudaStream_t stream, int device) {
  return g.d.causal ? launch_as<T, D, true>(g, stream, device)
                    : launch_as<T, D, false>(g, stream, device);
}

template <typename T, int D, bool CAP>
inline cudaError_t launch_masked_as(const masked_globals& g, cudaStream_t stream, int device) {
  using C = attention::fwd_config<T, D>;
  static_assert(C::SMEM + sizeof(wait_bound) <= 232448,
                "ring_attn: shared memory over the sm_90 limit of 227 KiB");
  const void* fn = reinterpret_cast<const void*>(&masked_kernel<C, CAP>);
  if (cudaError_t err = opt_in_smem(fn, device, static_cast<int>(C::SMEM)); err != cudaSuccess) {
    return err;
  }
  const int64_t blocks = int64_t(g.comm_blocks) + int64_t(g.q_tiles) * g.d.h * g.d.b;
  masked_kernel<C, CAP><<<static_cast<unsigned>(blocks), C::THREADS, C::SMEM, stream>>>(g);
  return cudaGetLastError();
}

/** @brief The masked forward (g.m.cap_in > 0: the soft cap), the grid of `launch`. */
template <typename T, int D>
inline cudaError_t launch_masked(const masked_globals& g, cudaStream_t stream, int device) {
  return g.m.cap_in > 0.f ? launch_masked_as<T, D, true>(g, stream, device)
                          : launch_masked_as<T, D, false>(g, stream, device);
}

}  // namespace pk::ring_attn
