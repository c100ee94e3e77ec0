/**
 * @file attn/masks.cuh
 * @brief The attention masks as pure functions of positions (namespace pk::attn::masks), for
 * the host and the device: which keys a query row sees, which rows a key is seen by, the key
 * tiles a query tile needs and the query tiles a key block needs, whether a whole sub-tile is
 * visible (so its element masks can be left out), the segment ids' per-chunk ranges, and the
 * logits soft cap. The masked kernels' sources (masked.cuh) are built on these, and
 * tests/cpp/masks.cc runs the same functions on a CPU against NumPy (tests/test_attention_masks.py).
 *
 * The masks, combined with AND (as pk_jax/ops/_attention.py's reference defines them), for query
 * row i and key j of one batch row b, both in 0..S-1:
 *   causal:    j <= i;
 *   window:    i - left <= j <= i + right (no window: left = right = S, which hides nothing);
 *   lengths:   i < q_len[b] (a row past it sees no key: output 0, lse +inf) and j < kv_len[b],
 *              both clamped to [0, S] (keys past S are the kernels' zero padding);
 *   segments:  q_seg[b, i] == kv_seg[b, j].
 * The positional masks give each row one contiguous range of keys (`keys_of_row`), whose ends
 * never decrease with the row; likewise each key's rows (`rows_of_key`). A span of rows therefore
 * needs the keys from its first row's first key to its last row's end, and a whole sub-tile is
 * visible when its first and its last row see all of its keys.
 *
 * Segments are taken per chunk of CHUNK positions: the caller (pk_jax/ops/attention.py
 * `segment_info`) gives each query chunk the [min, max] of its ids and the hull [first, end) of
 * the key chunks whose id ranges intersect it, and each key chunk the same the other way round.
 * Chunks whose ranges do not intersect share no id, so the hull is conservative for any ids and
 * exact for packed documents (ids that do not decrease along the sequence).
 *
 * Pitfalls: every function is pure and takes the lengths already clamped (`positions`); the
 * spans are [lo, hi), empty when hi <= lo; positions stay in int32 because S < 2^30 (the
 * launcher checks) and left, right <= S.
 */
#pragma once

#if defined(__CUDACC__)
#define PK_MASKS_FN __host__ __device__ __forceinline__
#else
#define PK_MASKS_FN inline
#endif

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace pk::attn::masks {

/** @brief The granularity of the segment ids' ranges: query and key chunks of 64 positions
 * (the backward's query tile; the forward's tiles are multiples of it). */
constexpr int CHUNK = 64;

/** @brief [lo, hi); empty when hi <= lo. */
struct span {
  int lo, hi;
  PK_MASKS_FN bool empty() const { return hi <= lo; }
  PK_MASKS_FN bool contains(int x) const { return lo <= x && x < hi; }
};

PK_MASKS_FN int imin(int a, int b) { return a < b ? a : b; }
PK_MASKS_FN int imax(int a, int b) { return a > b ? a : b; }
PK_MASKS_FN int clamp_len(int len, int s) { return imin(imax(len, 0), s); }

/** @brief The positional masks of one batch row: S, the clamped lengths, the window (left =
 * right = S without one) and causal. */
struct positions {
  int s;
  int q_len, kv_len;  // clamped to [0, s]
  int left, right;
  bool causal;

  /** @brief The masks of batch row with lengths q_len, kv_len (raw, clamped here). */
  PK_MASKS_FN static positions of(int s, int q_len, int kv_len, int left, int right,
                                  bool causal) {
    return positions{s, clamp_len(q_len, s), clamp_len(kv_len, s), imin(left, s),
                     imin(right, s), causal};
  }
};

/** @brief The keys row `row` sees by position: [max(0, row - left), min(kv_len, row + right + 1,
 * row + 1 when causal)); none for a row at or past q_len. lo and hi never decrease with row. */
PK_MASKS_FN span keys_of_row(const positions& p, int row) {
  if (row < 0 || row >= p.q_len) return span{0, 0};
  int hi = imin(p.kv_len, row + p.right + 1);
  if (p.causal) hi = imin(hi, row + 1);
  return span{imax(0, row - p.left), hi};
}

/** @brief The rows that see key `key` by position: [max(0, key - right, key when causal),
 * min(q_len, key + left + 1)); none for a key at or past kv_len. */
PK_MASKS_FN span rows_of_key(const positions& p, int key) {
  if (key < 0 || key >= p.kv_len) return span{0, 0};
  int lo = imax(0, key - p.right);
  if (p.causal) lo = imax(lo, key);
  return span{lo, imin(p.q_len, key + p.left + 1)};
}

/** @brief Whether row `row` sees key `key` by position (segments aside). */
PK_MASKS_FN bool visible(const positions& p, int row, int key) {
  return keys_of_row(p, row).contains(key);
}

/** @brief The hull of the keys rows [r0, r1) see by position: the first visible row's lo to
 * the last row's hi (the rows without keys are the ones at or past q_len, and the last ones,
 * whose lo passed kv_len; neither kind widens it). */
PK_MASKS_FN span keys_of_rows(const positions& p, int r0, int r1) {
  r0 = imax(r0, 0);
  r1 = imin(r1, p.q_len);
  if (r1 <= r0) return span{0, 0};
  const span a = keys_of_row(p, r0), b = keys_of_row(p, r1 - 1);
  return a.lo < b.hi ? span{a.lo, b.hi} : span{0, 0};
}

/** @brief The hull of the rows that see keys [k0, k1) by position. */
PK_MASKS_FN span rows_of_keys(const positions& p, int k0, int k1) {
  k0 = imax(k0, 0);
  k1 = imin(k1, p.kv_len);
  if (k1 <= k0) return span{0, 0};
  const span a = rows_of_key(p, k0), b = rows_of_key(p, k1 - 1);
  return a.lo < b.hi ? span{a.lo, b.hi} : span{0, 0};
}

/** @brief Whether every row of [r0, r0 + nr) sees every key of [k0, k0 + nk) by position (then
 * the sub-tile needs no element mask, segments aside): the first and the last row see them
 * all. */
PK_MASKS_FN bool all_visible(const positions& p, int r0, int nr, int k0, int nk) {
  const span a = keys_of_row(p, r0), b = keys_of_row(p, r0 + nr - 1);
  return a.lo <= k0 && k0 + nk <= a.hi && b.lo <= k0 && k0 + nk <= b.hi;
}

/** @brief The tiles of `tile` positions that cover positions `x` (empty stays empty). */
PK_MASKS_FN span tiles_of(span x, int tile) {
  if (x.empty()) return span{0, 0};
  return span{x.lo / tile, (x.hi + tile - 1) / tile};
}

PK_MASKS_FN span intersect(span a, span b) { return span{imax(a.lo, b.lo), imin(a.hi, b.hi)}; }

/** @brief A chunk's segment ids: their [min, max], and the hull [first, end) of the other
 * side's chunks whose id ranges intersect it (empty: none). 16 bytes, one vector load. */
struct alignas(16) chunk_info {
  int min, max, first, end;
};

/** @brief The id every position of the chunk has, or `none` when it has several. */
PK_MASKS_FN int uniform_id(const chunk_info& c, int none) { return c.min == c.max ? c.min : none; }

/** @brief The positions of the other side that chunks [c0, c1) of `info` (one batch row's)
 * may see through segments: the union of their hulls, in positions. */
PK_MASKS_FN span segment_span(const chunk_info* info, int c0, int c1) {
  span out{0, 0};
  for (int c = c0; c < c1; ++c) {
    const chunk_info x = info[c];
    if (x.end <= x.first) continue;
    out = out.empty() ? span{x.first, x.end} : span{imin(out.lo, x.first), imax(out.hi, x.end)};
  }
  return span{out.lo * CHUNK, out.hi * CHUNK};
}

/** @brief The key tiles (of bn keys) query rows [q0, q0 + bm) need: the positional hull,
 * intersected with the segments' (`seg`, positions; pass {0, s} without segments). */
PK_MASKS_FN span key_tiles(const positions& p, int q0, int bm, int bn, span seg) {
  return tiles_of(intersect(keys_of_rows(p, q0, q0 + bm), seg), bn);
}

/** @brief The query tiles (of bq rows) keys [k0, k0 + bn) need, likewise. */
PK_MASKS_FN span query_tiles(const positions& p, int k0, int bn, int bq, span seg) {
  return tiles_of(intersect(rows_of_keys(p, k0, k0 + bn), seg), bq);
}

/** @brief Whether every chunk of a's [a0, a1) and of b's [b0, b1) holds one and the same id
 * (then segments hide nothing between them). */
PK_MASKS_FN bool same_segment(const chunk_info* a, int a0, int a1, const chunk_info* b, int b0,
                              int b1) {
  const int id = a[a0].min;
  for (int c = a0; c < a1; ++c) {
    if (a[c].min != id || a[c].max != id) return false;
  }
  for (int c = b0; c < b1; ++c) {
    if (b[c].min != id || b[c].max != id) return false;
  }
  return true;
}

/** @brief The key tiles (of bn keys) the query tile of rows [q0, q0 + bm) streams: the
 * positional hull, and with segments the hull of its chunks' key chunks (q_info: the batch
 * row's query chunks, read for the chunks before S only). */
PK_MASKS_FN span fwd_key_tiles(const positions& p, const chunk_info* q_info, bool segments,
                               int q0, int bm, int bn) {
  span seg{0, p.s};
  if (segments) seg = segment_span(q_info, q0 / CHUNK, (imin(q0 + bm, p.s) + CHUNK - 1) / CHUNK);
  return key_tiles(p, q0, bm, bn, seg);
}

/** @brief The query tiles (of bq rows) the key block of keys [k0, k0 + bn) streams, likewise
 * (kv_info: the batch row's key chunks). */
PK_MASKS_FN span bwd_query_tiles(const positions& p, const chunk_info* kv_info, bool segments,
                                 int k0, int bn, int bq) {
  span seg{0, p.s};
  if (segments) {
    seg = segment_span(kv_info, k0 / CHUNK, (imin(k0 + bn, p.s) + CHUNK - 1) / CHUNK);
  }
  return query_tiles(p, k0, bn, bq, seg);
}

/** @brief Whether the sub-tile of rows [r0, r0 + nr) and keys [k0, k0 + nk) (both starting on
 * a chunk, nk and nr multiples of CHUNK) needs its element masks: not when every pair is
 * visible by position and, with segments, all its positions hold one id. The positional test
 * comes first: a sub-tile reaching past S always needs them, so the chunks read are inside
 * the batch row's. */
PK_MASKS_FN bool needs_mask(const positions& p, const chunk_info* q_info,
                            const chunk_info* kv_info, bool segments, int r0, int nr, int k0,
                            int nk) {
  if (!all_visible(p, r0, nr, k0, nk)) return true;
  return segments && !same_segment(q_info, r0 / CHUNK, (r0 + nr) / CHUNK, kv_info, k0 / CHUNK,
                                   (k0 + nk) / CHUNK);
}

/** @brief tanh(x), within about 1e-7 absolute: from one exp2 of -2|x| log2(e) (never
 * overflows) as (1 - e) / (1 + e) with x's sign. The soft cap c tanh(s / c) of a score s and its
 * derivative 1 - tanh^2 both come from it, forward and backward alike. */
PK_MASKS_FN float tanh_fast(float x) {
  constexpr float M2LOG2E = -2.f * 1.4426950408889634f;
#if defined(__CUDA_ARCH__)
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(fabsf(x) * M2LOG2E));
  return copysignf(__fdividef(1.f - e, 1.f + e), x);
#else
  const float e = std::exp2(std::fabs(x) * M2LOG2E);
  return std::copysign((1.f - e) / (1.f + e), x);
#endif
}

}  // namespace pk::attn::masks

#undef PK_MASKS_FN
