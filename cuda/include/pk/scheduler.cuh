/**
 * @file scheduler.cuh
 * @brief Persistent tile scheduler: a fixed grid (one block per compute SM) walks the output
 * tiles in a grouped order that keeps the operands of concurrently running tiles in L2.
 *
 * Tiles are numbered in bands of GROUP_M block-rows; inside a band the order is column-major,
 * so consecutive tile ids (which run at the same time on neighbouring blocks) share B columns
 * and a band's A rows stay hot. Block b of G takes ids b, b + G, b + 2G, ...
 */
#pragma once

#include "pk/common.cuh"

namespace pk {

/** @brief Output tile coordinates in tiles (not elements). */
struct tile_coord {
  int m;
  int n;
};

/** @brief Maps tile ids to coordinates for an (tiles_m x tiles_n) grid of output tiles. */
struct tile_scheduler {
  int tiles_m;
  int tiles_n;
  int group_m;

  __host__ __device__ tile_scheduler(int tiles_m_, int tiles_n_, int group_m_)
      : tiles_m(tiles_m_), tiles_n(tiles_n_), group_m(group_m_ < 1 ? 1 : group_m_) {}

  __host__ __device__ int num_tiles() const { return tiles_m * tiles_n; }

  __host__ __device__ tile_coord coord(int id) const {
    const int band_tiles = group_m * tiles_n;
    const int band = id / band_tiles;
    const int first_m = band * group_m;
    const int left = tiles_m - first_m;
    const int rows = left < group_m ? left : group_m;
    const int in_band = id - band * band_tiles;
    return {first_m + in_band % rows, in_band / rows};
  }
};

}  // namespace pk
