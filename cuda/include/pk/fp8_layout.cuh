/**
 * @file fp8_layout.cuh
 * @brief Index arithmetic of the fp8 GEMM (cuda/kernels/matmul_fp8.cuh), written once for the
 * device and the host: which output element an accumulator register holds, which scales the
 * blockwise promotion applies to it, and where the epilogue stages it for the TMA store.
 * Plain C++ when not compiled by nvcc, so tests/cpp/fp8_layout.cc checks it on a CPU.
 *
 * Blockwise scaling (pk_jax/fp8.py): x_scale[row, kb] per row and 128 columns of K, w_scale[kb,
 * nb] per 128 x 128 block of w [K, N]. The kernel loads, per k-block kb of a BM x BN tile at
 * (tile_m, tile_n), x_scale's column kb for the tile's BM rows (Python passes x_scale
 * transposed, [KB, M padded to 4], so that column is one contiguous TMA box) and
 * w_scale[kb, tile_n * BN / 128] (a 4-float box: TMA's smallest). Both boxes start on a
 * 16-byte boundary (box_start), so the scales sit box_skew floats into them. An output column
 * col of the tile lies in w block (tile_n * BN + col) / 128 = tile_n * BN / 128 + col / 128
 * because 128 divides BN.
 */
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define PK_LAYOUT_HD __host__ __device__
#else
#define PK_LAYOUT_HD
#endif

namespace pk::fp8_layout {

/** @brief Scale block side (pk_jax.fp8.BLOCK). */
constexpr int BLOCK = 128;

/**
 * @brief Floats between the 16-byte boundaries at which a scale box may start. TMA starts a
 * box's inner coordinate on 16 bytes: a box of fp32 scales at another float stopped the kernel
 * with CUDA_ERROR_ILLEGAL_INSTRUCTION on the H100 (bench/results/fp8_notes.md). So a scale box
 * starts at the multiple of SCALE_ALIGN at or below the first scale a tile needs, which then
 * sits at slot box_skew(first) of the box.
 */
constexpr int SCALE_ALIGN = 4;
/** @brief The x-scale box: a row tile's 128 rows and up to SCALE_ALIGN - 1 before them. */
constexpr int X_SCALE_BOX = BLOCK + SCALE_ALIGN;
/** @brief The w-scale box (TMA's smallest, 16 bytes): a 128-wide tile's block, skewed. */
constexpr int W_SCALE_BOX = SCALE_ALIGN;

/** @brief The 16-byte aligned inner coordinate of a box whose first needed scale is `first`. */
PK_LAYOUT_HD constexpr int box_start(int first) { return first - first % SCALE_ALIGN; }
/** @brief Where scale `first` sits in the box that box_start(first) starts. */
PK_LAYOUT_HD constexpr int box_skew(int first) { return first % SCALE_ALIGN; }

/**
 * @brief Row (0..63) of accumulator element d[4 j + 2 i + c] of thread t (0..127) of a
 * warpgroup's m64nN accumulator (wgmma.cuh).
 */
PK_LAYOUT_HD constexpr int frag_row(int t, int i) { return 16 * (t / 32) + (t % 32) / 4 + 8 * i; }

/** @brief Column (0..N-1) of accumulator element d[4 j + 2 i + c] of thread t. */
PK_LAYOUT_HD constexpr int frag_col(int t, int j, int c) { return 8 * j + 2 * (t % 4) + c; }

/**
 * @brief TMA coordinates (inner, outer = kb) of the x-scale box of a row tile whose first row
 * is `row0` (a multiple of BM in matmul_fp8; an owner's or a group's row in gemm_rs_fp8 and the
 * grouped GEMM), in x_scale transposed ([KB, M]).
 */
PK_LAYOUT_HD constexpr int x_scale_box_inner(int row0) { return box_start(row0); }

/** @brief Index in that x-scale box of consumer c's row r of the tile. */
PK_LAYOUT_HD constexpr int x_scale_slot(int row0, int consumer, int r) {
  return box_skew(row0) + 64 * consumer + r;
}

/** @brief Inner TMA coordinate of the w-scale box of tile column tile_n (outer: kb). */
PK_LAYOUT_HD constexpr int w_scale_box_inner(int tile_n, int bn) {
  return box_start(tile_n * (bn / BLOCK));
}

/** @brief Index in that w-scale box of tile column col (BN = 128 blockwise: one block). */
PK_LAYOUT_HD constexpr int w_scale_slot(int tile_n, int bn, int col) {
  return box_skew(tile_n * (bn / BLOCK)) + col / BLOCK;
}

/**
 * @brief The grouped fp8 GEMM: row of expert e's k-block kb in its w scales, [E, KB, NB] seen
 * as [E * KB, NB] (a w-scale box is 4 floats of one row: one expert's, one k-block's).
 */
PK_LAYOUT_HD constexpr int grouped_w_scale_row(int e, int kb, int kblocks) {
  return e * kblocks + kb;
}

/**
 * @brief Byte offset of byte `b` (0..127) of row `row` in a 128B-swizzled panel: 16-byte chunk
 * c of row r sits at chunk position c ^ (r % 8), what TMA's CU_TENSOR_MAP_SWIZZLE_128B writes
 * and reads (smem.cuh).
 */
PK_LAYOUT_HD constexpr uint32_t swizzle128_byte(int row, int b) {
  return uint32_t(row) * 128 + ((uint32_t((b >> 4) ^ (row & 7))) << 4) + uint32_t(b & 15);
}

/**
 * @brief Byte offset of element (row, col) of a ROWS-row staging buffer of 128-byte panels
 * holding ELEM-byte elements (128 / ELEM columns a panel, panels ROWS * 128 bytes apart).
 */
template <int ELEM, int ROWS>
PK_LAYOUT_HD constexpr uint32_t staging_offset(int row, int col) {
  return uint32_t(col * ELEM / 128) * (ROWS * 128) + swizzle128_byte(row, (col * ELEM) % 128);
}

}  // namespace pk::fp8_layout

#undef PK_LAYOUT_HD
