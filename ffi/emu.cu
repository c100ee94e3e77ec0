// Kernels of the rank emulator (pk_jax/testing): a late rank and work that holds SMs. They are
// test instruments, started only by the emulator, never by an FFI handler.
#include "launch.h"
#include "pk/mbarrier.cuh"
#include "pk/sync.cuh"

namespace pk_ffi {
namespace {

// One thread spinning until `ns` nanoseconds of the global timer have passed.
__global__ void delay_kernel(uint64_t ns) {
  const uint64_t start = pk::globaltimer_ns();
  while (pk::globaltimer_ns() - start < ns) __nanosleep(1000);
}

// Every block holds its shared memory (so no other block fits beside it) while it spins.
__global__ void occupy_kernel(uint64_t ns) {
  extern __shared__ char held[];
  const uint64_t start = pk::globaltimer_ns();
  if (threadIdx.x == 0) held[0] = 0;
  while (pk::globaltimer_ns() - start < ns) __nanosleep(1000);
  if (threadIdx.x == 0 && held[0] != 0) held[1] = 1;  // keeps the allocation live
}

// An mbarrier that expects 16 transaction bytes no copy ever delivers: pk::mbar_wait must give
// up after the block's wait_bound, write the record and trap (the test of that bound).
__global__ void mbar_stall_kernel(pk::wait_bound bound) {
  __shared__ pk::mbarrier bar;
  if (threadIdx.x == 0) {
    pk::block_wait_bound() = bound;
    pk::mbar_init(&bar, 1);
    pk::fence_mbar_init();
    pk::mbar_arrive_expect_tx(&bar, 16);
  }
  __syncthreads();
  pk::mbar_wait(&bar, 0);
}

}  // namespace

Status LaunchMbarStall(cudaStream_t stream, int32_t* error, int op, int rank,
                       uint64_t timeout_ns) {
  mbar_stall_kernel<<<1, 32, 0, stream>>>(pk::wait_bound{error, op, rank, timeout_ns});
  return CudaStatus(cudaGetLastError(), "the emulator's mbarrier stall kernel");
}

Status LaunchDelay(cudaStream_t stream, uint64_t ns) {
  delay_kernel<<<1, 1, 0, stream>>>(ns);
  return CudaStatus(cudaGetLastError(), "the emulator's delay kernel");
}

Status LaunchOccupy(cudaStream_t stream, int blocks, int smem_bytes, uint64_t ns) {
  const void* fn = reinterpret_cast<const void*>(&occupy_kernel);
  if (Status s = CudaStatus(
          cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
          "the emulator's occupy kernel (shared memory)");
      !s.ok()) {
    return s;
  }
  occupy_kernel<<<blocks, 32, smem_bytes, stream>>>(ns);
  return CudaStatus(cudaGetLastError(), "the emulator's occupy kernel");
}

}  // namespace pk_ffi
