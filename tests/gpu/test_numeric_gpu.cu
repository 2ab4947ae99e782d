// The device conversions against the host's software forms, on every input: what makes the CPU
// backend and the GPU give the same bits (fp32 to E4M3 over all 2^32 fp32 bit patterns).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>

#include "tpfuse/impl/numeric.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {
namespace {

struct Mismatches {
  unsigned long long count;
  uint32_t first_input;
  uint32_t first_hardware;
  uint32_t first_software;
};

__global__ void compare_e4m3(uint64_t begin, uint64_t end, Mismatches* out) {
  for (uint64_t i = begin + blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < end;
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float x = __uint_as_float(uint32_t(i));
    const uint8_t hardware = fp8_e4m3_from_float(x).bits;
    const uint8_t software = fp8_e4m3_from_float_software(x).bits;
    if (hardware != software && atomicAdd(&out->count, 1ull) == 0) {
      out->first_input = uint32_t(i);
      out->first_hardware = hardware;
      out->first_software = software;
    }
  }
}

TEST(GpuNumeric, Fp8E4M3HardwareMatchesSoftwareOnEveryFloat) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  Mismatches* result = nullptr;
  ASSERT_EQ(cudaMallocManaged(&result, sizeof(Mismatches)), cudaSuccess);
  *result = Mismatches{};
  compare_e4m3<<<4096, 256>>>(0, uint64_t(1) << 32, result);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(result->count, 0ull) << "first: input bits 0x" << std::hex << result->first_input
                                 << " hardware 0x" << result->first_hardware << " software 0x"
                                 << result->first_software;
  cudaFree(result);
}

}  // namespace
}  // namespace tpfuse::impl
