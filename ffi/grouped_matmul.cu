// FFI handler for pk_grouped_matmul: the grouped GEMM of jax.lax.ragged_dot and the two
// products of its VJP on XLA's stream (see cuda/kernels/grouped_matmul.cuh). 2-D tensor maps
// come from the cache in tensor_map.h; the 3-D maps over [E, K, N] are encoded per call.
#include <string>

#include "ffi_util.h"
#include "kernels/grouped_matmul.cuh"
#include "tensor_map.h"

namespace pk_ffi {
namespace {

namespace gm = pk::grouped_matmul;
static_assert(gm::MAX_GROUPS == op_table::kMaxGroups, "op_table.h kMaxGroups");
static_assert(gm::FEW_MAX_ROWS == op_table::kGroupedFewMaxRows, "op_table.h kGroupedFewMaxRows");

// The 3-D maps over [E, K, N] (tensor_map.h TensorMap3d: dtype 0 bf16, 1 fp16, the MapType
// codes), 64 columns of 2 bytes a swizzled row.
ffi::Error TensorMap3d(const void* ptr, uint64_t depth, uint64_t rows, uint64_t cols,
                       uint32_t box_rows, int dtype, CUtensorMap* out) {
  return ToError(pk_ffi::TensorMap3d("grouped_matmul", ptr, depth, rows, cols, box_rows, 64,
                                     dtype == 0 ? kMapBF16 : kMapF16, out));
}

template <typename T>
cudaError_t Launch(int64_t mode, const gm::globals& g, cudaStream_t stream, int device,
                   int num_sms, long long max_tiles) {
  switch (mode) {
    case gm::DX:
      return gm::launch<gm::config<T, gm::DX>>(g, stream, device, num_sms, max_tiles);
    case gm::DW:
      return gm::launch<gm::config<T, gm::DW>>(g, stream, device, num_sms, max_tiles);
    case gm::FWD_PP:
      return gm::launch<gm::config_pingpong<T, gm::FWD>>(g, stream, device, num_sms, max_tiles);
    case gm::DX_PP:
      return gm::launch<gm::config_pingpong<T, gm::DX>>(g, stream, device, num_sms, max_tiles);
    default:
      return gm::launch<gm::config<T, gm::FWD>>(g, stream, device, num_sms, max_tiles);
  }
}

ffi::Error GroupedMatmulCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer a,
                             ffi::AnyBuffer b, ffi::Buffer<ffi::S32> group_sizes,
                             ffi::Result<ffi::AnyBuffer> out, int64_t mode, int64_t group_m) {
  const ffi::DataType dt = a.element_type();
  if ((dt != ffi::DataType::BF16 && dt != ffi::DataType::F16) || b.element_type() != dt ||
      out->element_type() != dt) {
    return ffi::Error::InvalidArgument(
        "pk_grouped_matmul: the operands and the result must all be bf16 or all fp16.");
  }
  if (mode < 0 || mode >= gm::NUM_MODES) {
    return ffi::Error::InvalidArgument("pk_grouped_matmul: unknown mode " + std::to_string(mode));
  }
  const auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  const auto gd = group_sizes.dimensions();
  if (ad.size() != 2 || gd.size() != 1) {
    return ffi::Error::InvalidArgument("pk_grouped_matmul: expected a [M, .], group_sizes [E].");
  }
  const int64_t m = ad[0], e = gd[0];
  int64_t k, n;  // the kernel's contraction (FWD/DX) or output rows per group (DW), columns
  bool ok;
  if (mode == gm::DW) {  // a = x [M, K], b = dy [M, N], out = dw [E, K, N]
    k = ad[1];
    n = bd.size() == 2 ? bd[1] : -1;
    ok = bd.size() == 2 && bd[0] == m && od.size() == 3 && od[0] == e && od[1] == k && od[2] == n;
  } else {  // b = w [E, K, N]; FWD: a = x [M, K], out [M, N]; DX: a = dy [M, N], out [M, K]
    ok = bd.size() == 3 && bd[0] == e && od.size() == 2 && od[0] == m;
    k = ad[1];
    const bool fwd = mode == gm::FWD || mode == gm::FEW || mode == gm::FWD_PP;
    n = fwd ? (ok ? bd[2] : -1) : (ok ? bd[1] : -1);
    ok = ok && (fwd ? bd[1] == k : bd[2] == k) && od[1] == n;
  }
  if (!ok) {
    return ffi::Error::InvalidArgument(
        "pk_grouped_matmul: shapes do not match mode " + std::to_string(mode) +
        " (FWD and FEW: x [M, K], w [E, K, N] -> [M, N]; DX: dy [M, N], w [E, K, N] -> "
        "[M, K]; DW: x [M, K], dy [M, N] -> [E, K, N]).");
  }
  if (mode == gm::FEW && m > gm::FEW_MAX_ROWS) {
    return ffi::Error::InvalidArgument("pk_grouped_matmul: mode FEW takes at most " +
                                       std::to_string(gm::FEW_MAX_ROWS) + " rows, got " +
                                       std::to_string(m) + ".");
  }
  if (k % 8 != 0 || n % 8 != 0) {
    return ffi::Error::InvalidArgument(
        "pk_grouped_matmul: K and N must be multiples of 8 (16-byte TMA row strides); pk_jax "
        "pads N and checks K.");
  }
  if (e < 1 || e > gm::MAX_GROUPS) {
    return ffi::Error::InvalidArgument("pk_grouped_matmul: 1 to " +
                                       std::to_string(gm::MAX_GROUPS) + " groups supported.");
  }
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || e * k > INT32_MAX) {
    return ffi::Error::InvalidArgument("pk_grouped_matmul: dimensions must be below 2^31.");
  }
  if (out->size_bytes() == 0) return ffi::Error::Success();
  if (k == 0 || m == 0) {  // no products: y (dx, dw) is all zeros
    PK_CUDA_CHECK(cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream));
    return ffi::Error::Success();
  }
  const int type = dt == ffi::DataType::BF16 ? 0 : 1;
  if (mode == gm::FEW) {
    const gm::few_globals f{a.untyped_data(), b.untyped_data(), out->untyped_data(),
                            group_sizes.typed_data(), static_cast<int>(m), static_cast<int>(n),
                            static_cast<int>(k), static_cast<int>(e)};
    PK_CUDA_CHECK(type == 0 ? gm::launch_few<__nv_bfloat16>(f, stream)
                            : gm::launch_few<__half>(f, stream));
    return ffi::Error::Success();
  }
  gm::globals g;
  g.y = out->untyped_data();
  g.group_sizes = group_sizes.typed_data();
  g.m = static_cast<int>(m);
  g.n = static_cast<int>(n);
  g.k = static_cast<int>(k);
  g.groups = static_cast<int>(e);
  g.group_m = static_cast<int>(group_m < 1 ? 1 : (group_m > 1024 ? 1024 : group_m));
  const char* op = "grouped_matmul";
  constexpr int BM = 128;
  // Output tile width: 128 for the ping-pong schedules, else 256 (the grid's upper bound below).
  const bool pingpong = mode == gm::FWD_PP || mode == gm::DX_PP;
  const int BN = pingpong ? 128 : 256;
  long long max_tiles;
  if (mode == gm::DW) {
    if (Status st = TensorMap(op, {a.untyped_data(), uint64_t(m), uint64_t(k), 64, 64, type},
                              &g.a);
        !st.ok()) {
      return ToError(st);
    }
    if (Status st = TensorMap(op, {b.untyped_data(), uint64_t(m), uint64_t(n), 64, 64, type},
                              &g.b);
        !st.ok()) {
      return ToError(st);
    }
    if (ffi::Error err = TensorMap3d(out->untyped_data(), e, k, n, 64, type, &g.out);
        err.failure()) {
      return err;
    }
    max_tiles = e * ((k + BM - 1) / BM) * ((n + BN - 1) / BN);
  } else {
    if (Status st = TensorMap(op, {a.untyped_data(), uint64_t(m), uint64_t(k), BM, 64, type},
                              &g.a);
        !st.ok()) {
      return ToError(st);
    }
    // w [E, K, N]: FWD reads {64 n, 64 k} boxes, DX {64 n (its contraction), BN k} boxes.
    const uint64_t wk = bd[1], wn = bd[2];
    const bool dx = mode == gm::DX || mode == gm::DX_PP;
    if (ffi::Error err = TensorMap3d(b.untyped_data(), e, wk, wn, dx ? BN : 64,
                                     type, &g.b);
        err.failure()) {
      return err;
    }
    if (Status st = TensorMap(op, {out->untyped_data(), uint64_t(m), uint64_t(n), 64, 64, type},
                              &g.out);
        !st.ok()) {
      return ToError(st);
    }
    max_tiles = ((m + BM - 1) / BM + e) * ((n + BN - 1) / BN);
  }
  int num_sms = 0;
  if (ffi::Error err = NumSms(device, &num_sms); err.failure()) return err;
  if (type == 0) {
    PK_CUDA_CHECK((Launch<__nv_bfloat16>(mode, g, stream, device, num_sms, max_tiles)));
  } else {
    PK_CUDA_CHECK((Launch<__half>(mode, g, stream, device, num_sms, max_tiles)));
  }
  return ffi::Error::Success();
}

}  // namespace

Status LaunchGroupedMatmul(const Where& at, const GroupedMatmulArgs& a) {
  const char* op = "grouped_matmul";
  if (a.dtype != DType::kBF16 && a.dtype != DType::kF16) {
    return Status::Invalid("pk.grouped_matmul: bf16 or fp16 operands");
  }
  if (a.k % 8 != 0 || a.n % 8 != 0 || a.k < 8 || a.n < 8 || a.groups < 1 ||
      a.groups > gm::MAX_GROUPS || a.m < 1 || a.m > INT32_MAX || a.n > INT32_MAX ||
      a.groups * a.k > INT32_MAX) {
    return Status::Invalid("pk.grouped_matmul: K and N multiples of 8, 1 to " +
                           std::to_string(gm::MAX_GROUPS) + " groups, M >= 1, below 2^31");
  }
  const int type = a.dtype == DType::kBF16 ? 0 : 1;
  constexpr int BM = 128, BN = 256;
  gm::globals g;
  g.y = a.y;
  g.group_sizes = a.group_sizes;
  g.m = static_cast<int>(a.m);
  g.n = static_cast<int>(a.n);
  g.k = static_cast<int>(a.k);
  g.groups = static_cast<int>(a.groups);
  g.group_m = static_cast<int>(a.group_m < 1 ? 1 : (a.group_m > 1024 ? 1024 : a.group_m));
  if (Status st = TensorMap(op, {a.x, uint64_t(a.m), uint64_t(a.k), BM, 64, type}, &g.a);
      !st.ok()) {
    return st;
  }
  if (ffi::Error err = TensorMap3d(a.w, a.groups, a.k, a.n, 64, type, &g.b); err.failure()) {
    return Status::Internal("pk.grouped_matmul: the 3-D tensor map of w failed");
  }
  if (Status st = TensorMap(op, {a.y, uint64_t(a.m), uint64_t(a.n), 64, 64, type}, &g.out);
      !st.ok()) {
    return st;
  }
  const long long max_tiles = ((a.m + BM - 1) / BM + a.groups) * ((a.n + BN - 1) / BN);
  const cudaError_t err =
      type == 0 ? Launch<__nv_bfloat16>(gm::FWD, g, at.stream, at.device, at.num_sms, max_tiles)
                : Launch<__half>(gm::FWD, g, at.stream, at.device, at.num_sms, max_tiles);
  return CudaStatus(err, "grouped_matmul");
}

}  // namespace pk_ffi

XLA_FFI_DEFINE_HANDLER_SYMBOL(PkGroupedMatmul, pk_ffi::GroupedMatmulCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Ctx<xla::ffi::DeviceOrdinal>()                 // device
                                  .Arg<xla::ffi::AnyBuffer>()    // a: x [M, K] or dy [M, N]
                                  .Arg<xla::ffi::AnyBuffer>()    // b: w [E, K, N] or dy [M, N]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // group_sizes [E]
                                  .Ret<xla::ffi::AnyBuffer>()    // y [M, N], dx [M, K], dw
                                  .Attr<int64_t>("mode")  // enum mode_id (grouped_matmul.cuh)
                                  .Attr<int64_t>("group_m"),     // block-rows per band
                              PK_FFI_CUDA_TRAITS);
PK_FFI_REGISTER(pk_ffi::kOpGroupedMatmul, "CUDA", PkGroupedMatmul);
