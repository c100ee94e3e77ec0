// FFI handler for pk_matmul: y = x @ w on XLA's stream (see cuda/kernels/matmul.cuh).
//
// Tensor maps are encoded with cuTensorMapEncodeTiled, fetched once through
// cudaGetDriverEntryPointByVersion so that the module never links libcuda (it must import on a
// machine without a driver). A map embeds the buffer address, and XLA may hand a different
// address on every call, so maps are cached per (address, shape, box, dtype): steady-state
// calls on the same buffers (jitted loops, training steps) skip the encode.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <array>
#include <cstring>
#include <mutex>

#include "ffi_util.h"
#include "kernels/matmul.cuh"

namespace pk_ffi {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 EncodeFn() {
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

struct MapKey {
  const void* ptr;
  uint64_t rows, cols;
  uint32_t box_rows, box_cols;
  int dtype;
  bool operator==(const MapKey& o) const {
    return ptr == o.ptr && rows == o.rows && cols == o.cols && box_rows == o.box_rows &&
           box_cols == o.box_cols && dtype == o.dtype;
  }
};

// NOTES: a small round-robin cache; a miss costs one encode (about a microsecond of host time).
class MapCache {
 public:
  ffi::Error Get(const MapKey& key, CUtensorMap* out) {
    std::lock_guard<std::mutex> lock(mu_);
    for (int i = 0; i < kSize; ++i) {
      if (valid_[i] && keys_[i] == key) {
        *out = maps_[i];
        return ffi::Error::Success();
      }
    }
    PFN_cuTensorMapEncodeTiled_v12000 encode = EncodeFn();
    if (encode == nullptr) {
      return ffi::Error::Internal(
          "pk_matmul: cuTensorMapEncodeTiled is not available from the CUDA driver (needs a "
          "driver for CUDA 12.0 or newer).");
    }
    const cuuint64_t dims[2] = {key.cols, key.rows};
    const cuuint64_t strides[1] = {key.cols * 2};
    const cuuint32_t box[2] = {key.box_cols, key.box_rows};
    const cuuint32_t elem_strides[2] = {1, 1};
    CUtensorMap map;
    CUresult r = encode(&map,
                        key.dtype == 0 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                        2, const_cast<void*>(key.ptr), dims, strides, box, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
      return ffi::Error::Internal("pk_matmul: cuTensorMapEncodeTiled failed with CUresult " +
                                  std::to_string(static_cast<int>(r)) + " for a [" +
                                  std::to_string(key.rows) + ", " + std::to_string(key.cols) +
                                  "] operand.");
    }
    keys_[next_] = key;
    maps_[next_] = map;
    valid_[next_] = true;
    next_ = (next_ + 1) % kSize;
    *out = map;
    return ffi::Error::Success();
  }

 private:
  static constexpr int kSize = 48;
  std::mutex mu_;
  std::array<MapKey, kSize> keys_{};
  std::array<CUtensorMap, kSize> maps_{};
  std::array<bool, kSize> valid_{};
  int next_ = 0;
};

MapCache& Cache() {
  static MapCache* cache = new MapCache();
  return *cache;
}

ffi::Error NumSms(int device, int* out) {
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

template <typename T>
cudaError_t Launch(int64_t config, const pk::matmul::globals& g, cudaStream_t stream, int device,
                   int num_sms) {
  switch (config) {
    case pk::matmul::TILE_128x256:
      return pk::matmul::launch<pk::matmul::config_128x256<T>>(g, stream, device, num_sms);
    case pk::matmul::TILE_128x256_S3:
      return pk::matmul::launch<pk::matmul::config_128x256_s3<T>>(g, stream, device, num_sms);
    default:
      return pk::matmul::launch<pk::matmul::config_128x128<T>>(g, stream, device, num_sms);
  }
}

ffi::Error MatmulCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::Result<ffi::AnyBuffer> y, int64_t config, int64_t group_m) {
  const ffi::DataType dt = x.element_type();
  if ((dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) || w.element_type() != dt ||
      y->element_type() != dt) {
    return ffi::Error::InvalidArgument("pk_matmul: x, w and y must all be bf16 or all fp16.");
  }
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || xd[1] != wd[0] || yd[0] != xd[0] ||
      yd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("pk_matmul: expected x [M, K], w [K, N], y [M, N].");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  if (k % 8 != 0 || n % 8 != 0) {
    return ffi::Error::InvalidArgument(
        "pk_matmul: K and N must be multiples of 8 (16-byte TMA row strides); pk_jax pads N.");
  }
  if (config < 0 || config >= pk::matmul::NUM_CONFIGS) {
    return ffi::Error::InvalidArgument("pk_matmul: unknown tile config " + std::to_string(config));
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    PK_CUDA_CHECK(cudaMemsetAsync(y->untyped_data(), 0, y->size_bytes(), stream));
    return ffi::Error::Success();
  }
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
    return ffi::Error::InvalidArgument("pk_matmul: dimensions must be below 2^31.");
  }
  int bm, bn;
  pk::matmul::tile_shape(static_cast<int>(config), &bm, &bn);
  const int type = dt == ffi::DataType::BF16 ? 0 : 1;
  pk::matmul::globals g;
  g.m = static_cast<int>(m);
  g.n = static_cast<int>(n);
  g.k = static_cast<int>(k);
  g.group_m = static_cast<int>(group_m < 1 ? 1 : (group_m > 1024 ? 1024 : group_m));
  MapCache& cache = Cache();
  if (ffi::Error e = cache.Get({x.untyped_data(), uint64_t(m), uint64_t(k), uint32_t(bm), 64, type},
                               &g.x);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = cache.Get({w.untyped_data(), uint64_t(k), uint64_t(n), 64, 64, type}, &g.w);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = cache.Get({y->untyped_data(), uint64_t(m), uint64_t(n), 64, 64, type}, &g.y);
      e.failure()) {
    return e;
  }
  int num_sms = 0;
  if (ffi::Error e = NumSms(device, &num_sms); e.failure()) return e;
  if (type == 0) {
    PK_CUDA_CHECK((Launch<__nv_bfloat16>(config, g, stream, device, num_sms)));
  } else {
    PK_CUDA_CHECK((Launch<__half>(config, g, stream, device, num_sms)));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkMatmul, pk_ffi::MatmulCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()                     // x [M, K]
                                  .Arg<xla::ffi::AnyBuffer>()                     // w [K, N]
                                  .Ret<xla::ffi::AnyBuffer>()                     // y [M, N]
                                  .Attr<int64_t>("config")                        // tile config
                                  .Attr<int64_t>("group_m"));  // block-rows per band
