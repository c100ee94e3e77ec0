/**
 * @file smem.cuh
 * @brief Shared-memory tiles in the 128-byte-swizzled panel layout that TMA
 * (CU_TENSOR_MAP_SWIZZLE_128B) and wgmma descriptors use.
 *
 * A panel holds ROWS rows of 128 bytes (64 bf16/fp16 elements); 16-byte chunk c of row r sits
 * at chunk position c ^ (r % 8). Panels start on 1024-byte boundaries. A tile wider than 64
 * elements is COLS / 64 panels side by side in memory, PANEL_BYTES apart.
 */
#pragma once

#include "pk/common.cuh"

namespace pk {

/** @brief Byte offset of element (row, col) in a 128B-swizzled panel of 2-byte elements. */
__device__ __host__ constexpr uint32_t swizzle128_offset(int row, int col) {
  return row * 128 + ((((col * 2) >> 4) ^ (row & 7)) << 4) + ((col * 2) & 15);
}

/**
 * @brief The kernel's dynamic shared memory as an S, 1024-aligned (the launch adds 1 KiB of
 * slack). The view is the buffer plus an offset, not a pointer rebuilt from an integer, so the
 * compiler keeps knowing it is shared memory and emits LDS/STS/ATOMS for plain accesses through
 * it instead of generic loads and stores. (lcsc.cuh, grouped_matmul.cuh and the MoE kernels
 * still align through uintptr_t; their shared accesses are mostly explicit PTX.)
 */
template <class S>
__device__ inline S& dynamic_smem() {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  return *reinterpret_cast<S*>(smem_raw + ((1024u - (at & 1023u)) & 1023u));
}

/**
 * @brief A ROWS x COLS tile of 2-byte elements stored as COLS/64 swizzled panels.
 * @tparam T bf16 or fp16.
 */
template <typename T, int ROWS, int COLS>
struct alignas(1024) st_panels {
  static_assert(sizeof(T) == 2, "st_panels: 2-byte element types only");
  static_assert(COLS % 64 == 0 && ROWS % 8 == 0, "st_panels: COLS % 64 and ROWS % 8");
  static constexpr int PANELS = COLS / 64;
  static constexpr uint32_t PANEL_BYTES = ROWS * 128;
  static constexpr uint32_t BYTES = PANELS * PANEL_BYTES;
  T data[ROWS * COLS];

  __device__ T* panel(int p) { return data + p * (PANEL_BYTES / sizeof(T)); }
  __device__ const T* panel(int p) const { return data + p * (PANEL_BYTES / sizeof(T)); }
  /** @brief Address of element (row, col), col across panels. */
  __device__ char* at(int row, int col) {
    return reinterpret_cast<char*>(panel(col / 64)) + swizzle128_offset(row, col % 64);
  }
};

/**
 * @brief ROWS rows of PANELS 128-byte swizzled panels of raw bytes, PANEL_BYTES apart: the
 * same layout as st_panels for elements of any size (a panel holds 128 fp8, 64 bf16 or 32 fp32
 * columns). The fp8 GEMM's operand tiles and its bf16 / fp32 store staging.
 */
template <int ROWS, int PANELS_>
struct alignas(1024) st_bytes {
  static_assert(ROWS % 8 == 0 && PANELS_ >= 1, "st_bytes: whole 8-row swizzle atoms");
  static constexpr int PANELS = PANELS_;
  static constexpr uint32_t PANEL_BYTES = ROWS * 128;
  static constexpr uint32_t BYTES = PANELS * PANEL_BYTES;
  unsigned char data[BYTES];

  __device__ unsigned char* panel(int p) { return data + p * PANEL_BYTES; }
  __device__ const unsigned char* panel(int p) const { return data + p * PANEL_BYTES; }
};

}  // namespace pk
