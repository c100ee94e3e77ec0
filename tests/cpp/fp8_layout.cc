// cuda/include/pk/fp8_layout.cuh on a CPU, for tests/test_fp8.py, which builds this file with
// the host compiler and runs it: the fp8 GEMM's index arithmetic against definitions written
// here independently (the wgmma accumulator layout of the PTX ISA, DeepSeek-V3's block scales,
// TMA's 128-byte swizzle). Prints "ok", or the first failed check, and exits non-zero on one.
#include <cstdint>
#include <cstdio>
#include <set>
#include <vector>

#include "pk/fp8_layout.cuh"

namespace fl = pk::fp8_layout;

namespace {

int failures = 0;

void Check(bool ok, const char* what, int a, int b, int c) {
  if (!ok && failures++ == 0) std::printf("FAILED %s (%d, %d, %d)\n", what, a, b, c);
}

// The m64nN fp32 accumulator: each of the 128 threads holds N / 2 elements d[4 j + 2 i + c];
// every (row, column) of 64 x N is held exactly once.
void AccumulatorCoversTheTileOnce(int n) {
  std::vector<int> seen(64 * n, 0);
  for (int t = 0; t < 128; ++t) {
    for (int j = 0; j < n / 8; ++j) {
      for (int i = 0; i < 2; ++i) {
        for (int c = 0; c < 2; ++c) {
          const int row = fl::frag_row(t, i), col = fl::frag_col(t, j, c);
          Check(row >= 0 && row < 64 && col >= 0 && col < n, "fragment in the tile", t, j, i);
          if (row >= 0 && row < 64 && col >= 0 && col < n) ++seen[row * n + col];
          // PTX ISA, wgmma D fragments: warp w holds rows 16 w .. 16 w + 15; lane l rows
          // l / 4 and l / 4 + 8, columns 2 (l % 4) + {0, 1} of each 8-column group.
          const int w = t / 32, l = t % 32;
          Check(row == 16 * w + l / 4 + 8 * i && col == 8 * j + 2 * (l % 4) + c,
                "fragment as the PTX ISA lays it out", t, j, i);
        }
      }
    }
  }
  for (int e = 0; e < 64 * n; ++e) Check(seen[e] == 1, "each element once", e, n, seen[e]);
}

// Blockwise scales: a tile whose first row is row0 (tile_m * BM in matmul_fp8, any row in
// gemm_rs_fp8 and the grouped GEMM), at column tile tile_n of BN, consumer c, fragment row r,
// column col reads x scale [row0 + 64 c + r, kb] (box of X_SCALE_BOX rows of x_scale transposed
// at inner coordinate x_scale_box_inner) and w scale [kb, (tile_n * BN + col) / 128] (box of 4 at
// w_scale_box_inner). TMA starts every box on 16 bytes: a multiple of 4 floats.
void ScaleIndices(int bn) {
  for (int row0 : {0, 1, 2, 3, 127, 128, 300, 4093}) {
    const int inner = fl::x_scale_box_inner(row0);
    Check(inner % 4 == 0 && inner <= row0, "x-scale box on 16 bytes, at or below row0", row0, 0,
          inner);
    for (int c = 0; c < 2; ++c) {
      for (int r = 0; r < 64; ++r) {
        const int slot = fl::x_scale_slot(row0, c, r);
        Check(slot >= 0 && slot < fl::X_SCALE_BOX, "x scale slot in the box", row0, c, slot);
        Check(inner + slot == row0 + 64 * c + r, "x scale of the output row", row0, c, r);
      }
    }
  }
  for (int tile_n = 0; tile_n < 9; ++tile_n) {
    const int inner = fl::w_scale_box_inner(tile_n, bn);
    Check(inner % 4 == 0, "w-scale box on 16 bytes", tile_n, bn, inner);
    for (int col = 0; col < bn; ++col) {
      const int slot = fl::w_scale_slot(tile_n, bn, col);
      Check(slot >= 0 && slot < fl::W_SCALE_BOX, "w scale slot in the box", tile_n, col, slot);
      Check(inner + slot == (tile_n * bn + col) / 128,
            "w scale of the output column's 128-block", tile_n, col, bn);
    }
  }
}

// TMA's CU_TENSOR_MAP_SWIZZLE_128B, as the CUDA programming guide defines it: within each
// 1024-byte group of 8 rows of 128 bytes, 16-byte chunk c of row r is stored at chunk c ^ r.
uint32_t SwizzledByte(int row, int byte) {
  return uint32_t(row) * 128 + uint32_t(((byte / 16) ^ (row % 8)) * 16 + byte % 16);
}

// The epilogue's staging of 64 rows x (256 / ELEM) columns of ELEM-byte elements: two panels
// of 128-byte rows, which the two TMA stores of a round read as boxes of 128 / ELEM columns.
template <int ELEM>
void StagingIsTheSwizzledPanels() {
  const int cols = 256 / ELEM, per_panel = 128 / ELEM;
  std::set<uint32_t> bytes;
  for (int row = 0; row < 64; ++row) {
    for (int col = 0; col < cols; ++col) {
      const uint32_t at = fl::staging_offset<ELEM, 64>(row, col);
      const int panel = col / per_panel;
      Check(at == uint32_t(panel) * 64 * 128 + SwizzledByte(row, (col % per_panel) * ELEM),
            "staging at the swizzled panel position", ELEM, row, col);
      Check(at % ELEM == 0 && at + ELEM <= 2 * 64 * 128, "staging aligned, in the buffer",
            ELEM, row, col);
      if (col % 2 == 0) Check(at % (2 * ELEM) == 0, "a column pair is one store", ELEM, row, col);
      for (int b = 0; b < ELEM; ++b) bytes.insert(at + b);
    }
  }
  Check(bytes.size() == 2 * 64 * 128, "staging fills its 16 KiB once", ELEM, 0, 0);
}

// The grouped fp8 GEMM: expert e's k-block kb of its w scales [E, KB, NB], row major, starts at
// element (e * KB + kb) * NB, the row grouped_w_scale_row names of [E * KB, NB].
void GroupedScaleIndices() {
  for (int kblocks : {1, 3, 8}) {
    const int experts = 5, nb = 4;
    std::vector<int> seen(experts * kblocks, 0);
    for (int e = 0; e < experts; ++e) {
      for (int kb = 0; kb < kblocks; ++kb) {
        const int row = fl::grouped_w_scale_row(e, kb, kblocks);
        Check(row >= 0 && row < experts * kblocks, "grouped w scale row in range", e, kb, row);
        if (row >= 0 && row < experts * kblocks) ++seen[row];
        Check(row * nb == ((e * kblocks) + kb) * nb, "grouped w scale row of [E, KB, NB]", e, kb,
              kblocks);
      }
    }
    for (int i = 0; i < experts * kblocks; ++i) {
      Check(seen[i] == 1, "each expert's k-block one row", i, kblocks, seen[i]);
    }
  }
}

// The grouped storer's boundary rows leave staging as 16-byte chunks at the offset of their
// first column: the chunk must hold 16 / ELEM consecutive columns of one row, in order.
template <int ELEM>
void StagedChunksAreConsecutiveColumns() {
  const int cols = 256 / ELEM, per_chunk = 16 / ELEM;
  for (int row = 0; row < 64; ++row) {
    for (int col = 0; col < cols; col += per_chunk) {
      const uint32_t at = fl::staging_offset<ELEM, 64>(row, col);
      Check(at % 16 == 0, "a staged chunk is 16-byte aligned", ELEM, row, col);
      for (int i = 1; i < per_chunk; ++i) {
        Check(fl::staging_offset<ELEM, 64>(row, col + i) == at + uint32_t(i * ELEM),
              "a staged chunk holds consecutive columns", ELEM, row, col + i);
      }
    }
  }
}

}  // namespace

int main() {
  AccumulatorCoversTheTileOnce(128);
  AccumulatorCoversTheTileOnce(256);
  ScaleIndices(128);
  ScaleIndices(256);  // a BN of 256 would still index its two w blocks right
  StagingIsTheSwizzledPanels<2>();
  StagingIsTheSwizzledPanels<4>();
  GroupedScaleIndices();
  StagedChunksAreConsecutiveColumns<2>();
  StagedChunksAreConsecutiveColumns<4>();
  if (failures == 0) std::printf("ok\n");
  return failures == 0 ? 0 : 1;
}
