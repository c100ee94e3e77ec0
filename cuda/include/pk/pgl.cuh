/**
 * @file pgl.cuh
 * @brief Parallel global layouts: the same 2-D layout at the same offset of every peer's
 * symmetric workspace, addressed by (peer, tile row, tile column).
 *
 * The peer base pointers are kernel parameters (they live in the constant bank / registers),
 * so an access is one multiply-add: no table lookup per access. A pgl never owns memory; the
 * runtime (pk_jax/runtime) maps every peer's workspace into this process.
 */
#pragma once

#include "pk/common.cuh"

namespace pk {

/**
 * @brief A rows x cols row-major layout of T replicated on `world` peers.
 *
 * @tparam T element type.
 * @tparam MAX_PEERS capacity of the pointer table (the world size is a run-time value).
 */
template <typename T, int MAX_PEERS = 16>
struct pgl {
  T* ptr[MAX_PEERS];  ///< peer p's copy, as mapped in this process
  int world;          ///< number of peers
  int64_t rows;       ///< rows of the layout
  int64_t cols;       ///< columns (also the row stride, in elements)

  /** @brief Builds the layout at byte offset `offset` of every workspace in `bases`. */
  __host__ __device__ static pgl make(void* const* bases, int world, uint64_t offset,
                                      int64_t rows, int64_t cols) {
    pgl g{};
    for (int p = 0; p < MAX_PEERS; ++p) {
      g.ptr[p] = p < world ? reinterpret_cast<T*>(static_cast<char*>(bases[p]) + offset)
                           : nullptr;
    }
    g.world = world;
    g.rows = rows;
    g.cols = cols;
    return g;
  }

  /** @brief Bytes one peer's copy takes. */
  __host__ __device__ uint64_t bytes() const { return uint64_t(rows) * cols * sizeof(T); }

  /** @brief Element (row, col) on peer `p`. */
  __device__ T* at(int p, int64_t row, int64_t col) const { return ptr[p] + row * cols + col; }

  /** @brief First element of tile (tr, tc) of size TR x TC on peer `p`. */
  template <int TR, int TC>
  __device__ T* tile(int p, int64_t tr, int64_t tc) const {
    return ptr[p] + (tr * TR) * cols + tc * TC;
  }
};

}  // namespace pk
