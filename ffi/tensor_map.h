// Host helpers shared by the handlers: TMA tensor maps (2-D for the GEMMs, 4-D for attention)
// and the SM count.
//
// Tensor maps are encoded with cuTensorMapEncodeTiled, fetched once through
// cudaGetDriverEntryPointByVersion so that the module never links libcuda (it must import on a
// machine without a driver). A map embeds the buffer address, and XLA may hand a different
// address on every call, so maps are cached per (address, shape, box, dtype): steady-state
// calls on the same buffers (jitted loops, training steps) skip the encode. The maps over the
// peers' workspaces (fixed while the communicator lives) are kept by the executable's FFI
// state instead (PeerMaps, comm_state.h).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <array>
#include <atomic>
#include <mutex>
#include <string>

#include "ffi_util.h"

namespace pk_ffi {

inline PFN_cuTensorMapEncodeTiled_v12000 EncodeFn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// Element type and smem layout of a TensorMap (MapKey::dtype): 2-byte and 4-byte floats and
// fp8 (copied as bytes) in 128B-swizzled panels, or float32 unswizzled (the fp8 GEMM's scales).
enum MapType : int { kMapBF16 = 0, kMapF16 = 1, kMapF32 = 2, kMapFp8 = 3, kMapF32Plain = 4 };

struct MapKey {
  const void* ptr;
  uint64_t rows, cols;
  uint32_t box_rows, box_cols;
  int dtype;  // MapType
  bool operator==(const MapKey& o) const {
    return ptr == o.ptr && rows == o.rows && cols == o.cols && box_rows == o.box_rows &&
           box_cols == o.box_cols && dtype == o.dtype;
  }
};

// A tensor map over a row-major [rows, cols] matrix of key.dtype (MapType: 128B-swizzled but
// for kMapF32Plain), from a small round-robin cache (a miss costs one encode, about a
// microsecond of host time).
inline Status TensorMap(const char* op, const MapKey& key, CUtensorMap* out) {
  static std::mutex mu;
  constexpr int kSize = 128;
  static std::array<MapKey, kSize> keys{};
  static std::array<CUtensorMap, kSize> maps{};
  static std::array<bool, kSize> valid{};
  static int next = 0;
  std::lock_guard<std::mutex> lock(mu);
  for (int i = 0; i < kSize; ++i) {
    if (valid[i] && keys[i] == key) {
      *out = maps[i];
      return Status::Ok();
    }
  }
  PFN_cuTensorMapEncodeTiled_v12000 encode = EncodeFn();
  if (encode == nullptr) {
    return Status::Internal(std::string("pk.") + op +
                            ": cuTensorMapEncodeTiled is not available from the CUDA driver.");
  }
  CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  cuuint64_t elem = 2;
  switch (key.dtype) {
    case kMapF16: type = CU_TENSOR_MAP_DATA_TYPE_FLOAT16; break;
    case kMapF32:
    case kMapF32Plain: type = CU_TENSOR_MAP_DATA_TYPE_FLOAT32, elem = 4; break;
    case kMapFp8: type = CU_TENSOR_MAP_DATA_TYPE_UINT8, elem = 1; break;  // TMA moves bytes
    default: break;
  }
  const cuuint64_t dims[2] = {key.cols, key.rows};
  const cuuint64_t strides[1] = {key.cols * elem};
  const cuuint32_t box[2] = {key.box_cols, key.box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  CUtensorMap map;
  CUresult r = encode(&map, type, 2, const_cast<void*>(key.ptr), dims, strides, box,
                      elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                      key.dtype == kMapF32Plain ? CU_TENSOR_MAP_SWIZZLE_NONE
                                                : CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal(std::string("pk.") + op +
                            ": cuTensorMapEncodeTiled failed with CUresult " +
                            std::to_string(static_cast<int>(r)) + " for a [" +
                            std::to_string(key.rows) + ", " + std::to_string(key.cols) +
                            "] operand.");
  }
  keys[next] = key;
  maps[next] = map;
  valid[next] = true;
  next = (next + 1) % kSize;
  *out = map;
  return Status::Ok();
}

// The tensor maps over every peer's symmetric workspace seen as one [rows, cols] matrix
// (box_rows x box_cols panels): they depend only on the communicator and the call's shapes,
// so an executable keeps them in its FFI state (comm_state.h) and encodes them once.
struct PeerMaps {
  std::mutex mu;
  bool valid = false;
  MapKey key{};  // key.ptr: peer 0's workspace
  int world = 0;
  CUtensorMap maps[kMaxPeers];
};

// Maps over ws[0..world) as [rows, cols] matrices of `dtype` with box_rows x box_cols panels,
// from `cache` when it holds them (and stored there otherwise); without a cache, through the
// process-wide cache of TensorMap.
inline Status PeerTensorMaps(const char* op, void* const* ws, int world, uint64_t rows,
                             uint64_t cols, uint32_t box_rows, uint32_t box_cols, int dtype,
                             PeerMaps* cache, CUtensorMap* out) {
  const MapKey key{ws[0], rows, cols, box_rows, box_cols, dtype};
  if (cache != nullptr) {
    std::lock_guard<std::mutex> lock(cache->mu);
    if (cache->valid && cache->world == world && cache->key == key) {
      for (int p = 0; p < world; ++p) out[p] = cache->maps[p];
      return Status::Ok();
    }
  }
  for (int p = 0; p < world; ++p) {
    if (Status s = TensorMap(op, {ws[p], rows, cols, box_rows, box_cols, dtype}, &out[p]);
        !s.ok()) {
      return s;
    }
  }
  if (cache != nullptr) {
    std::lock_guard<std::mutex> lock(cache->mu);
    for (int p = 0; p < world; ++p) cache->maps[p] = out[p];
    cache->key = key;
    cache->world = world;
    cache->valid = true;
  }
  return Status::Ok();
}

// A 128B-swizzled map over a row-major [depth, rows, cols] array of `dtype` (MapType: kMapBF16,
// kMapF16 or kMapFp8) with a box of depth 1, {box_cols, box_rows, 1}: one matrix of a stack
// (the grouped GEMMs' [E, K, N] weights, pk/tma_3d.cuh), so a box at an edge of one matrix
// zero-fills (loads) or drops (stores) instead of touching the next. Encoded on every call.
inline Status TensorMap3d(const char* op, const void* ptr, uint64_t depth, uint64_t rows,
                          uint64_t cols, uint32_t box_rows, uint32_t box_cols, int dtype,
                          CUtensorMap* out) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = EncodeFn();
  if (encode == nullptr) {
    return Status::Internal(std::string("pk.") + op +
                            ": cuTensorMapEncodeTiled is not available from the CUDA driver.");
  }
  const uint64_t elem = dtype == kMapFp8 ? 1 : 2;
  const CUtensorMapDataType type = dtype == kMapFp8   ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : dtype == kMapF16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                      : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const cuuint64_t dims[3] = {cols, rows, depth};
  const cuuint64_t strides[2] = {cols * elem, rows * cols * elem};
  const cuuint32_t box[3] = {box_cols, box_rows, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  CUresult r = encode(out, type, 3, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal(std::string("pk.") + op +
                            ": cuTensorMapEncodeTiled (3-D) failed with CUresult " +
                            std::to_string(static_cast<int>(r)) + ".");
  }
  return Status::Ok();
}

// A 128B-swizzled map over a [b, s, heads, d] tensor of 2-byte elements: dims {d, heads, s, b},
// box {64, 1, rows, 1} (one swizzled panel of `rows` positions of one head); the attention
// kernels' operands and workspace slots. dtype 0 bf16, 1 fp16, 2 float32 (box {32, 1, rows, 1}:
// a swizzled row is 128 bytes). Encoded on every call (not cached).
inline Status Map4d(const char* op, const void* ptr, int64_t b, int64_t s, int64_t heads,
                    int64_t d, uint32_t rows, int dtype, CUtensorMap* out) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = EncodeFn();
  if (encode == nullptr) {
    return Status::Internal(std::string("pk.") + op +
                            ": cuTensorMapEncodeTiled is not available.");
  }
  const cuuint64_t elem = dtype == 2 ? 4 : 2;
  const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(heads), cuuint64_t(s), cuuint64_t(b)};
  const cuuint64_t strides[3] = {cuuint64_t(d) * elem, cuuint64_t(heads * d) * elem,
                                 cuuint64_t(s * heads * d) * elem};
  const cuuint32_t box[4] = {uint32_t(128 / elem), 1, rows, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = dtype == 0   ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : dtype == 1 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  CUresult r = encode(out, type, 4, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal(std::string("pk.") + op +
                            ": cuTensorMapEncodeTiled failed with CUresult " +
                            std::to_string(static_cast<int>(r)));
  }
  return Status::Ok();
}

inline ffi::Error NumSms(int device, int* out) {
  static std::array<std::atomic<int>, 64> sms{};
  const int slot = device & 63;
  int v = sms[slot].load(std::memory_order_relaxed);
  if (v == 0) {
    PK_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device));
    sms[slot].store(v, std::memory_order_relaxed);
  }
  *out = v;
  return ffi::Error::Success();
}

}  // namespace pk_ffi
