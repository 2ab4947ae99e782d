// The device conversions and divisions against the host's forms, on every input: what makes the
// CPU backend and the GPU give the same bits (fp32 to E4M3 over all 2^32 fp32 bit patterns, one at
// a time and in pairs; the FP8 scale's division by its reciprocal against IEEE division); and the
// warp sums that trade half their values a step against one butterfly per value.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/device_ops.cuh"
#include "tpfuse/impl/epilogue.h"
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

// Every fp32 in every byte of a word of four, beside a partner that walks the bit patterns
// differently.
__global__ void compare_e4m3_words(Mismatches* out) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < (uint64_t(1) << 32);
       i += uint64_t(gridDim.x) * blockDim.x) {
    const uint32_t bits = uint32_t(i), partner = bits * 2654435761u;
    const float x = __uint_as_float(bits), y = __uint_as_float(partner);
    const uint32_t want = fp8_e4m3_from_float_software(x).bits;
    const uint32_t want_partner = fp8_e4m3_from_float_software(y).bits;
    // x in every byte of one of the two words.
    const uint32_t outer = fp8_e4m3x4_from_floats(x, y, y, x);
    const uint32_t inner = fp8_e4m3x4_from_floats(y, x, x, y);
    const uint32_t outer_want = want | want_partner << 8 | want_partner << 16 | want << 24;
    const uint32_t inner_want = want_partner | want << 8 | want << 16 | want_partner << 24;
    if ((outer != outer_want || inner != inner_want) && atomicAdd(&out->count, 1ull) == 0) {
      out->first_input = bits;
      out->first_hardware = outer;
      out->first_software = outer_want;
      out->first_software = want;
    }
  }
}

struct DivisionMismatches {
  unsigned long long count;
  unsigned long long exact;  // quotients held to IEEE's bits (not only its E4M3 byte)
  uint32_t first_x;
  uint32_t first_scale;
};

__device__ void record(float x, float scale, DivisionMismatches* out) {
  if (atomicAdd(&out->count, 1ull) == 0) {
    out->first_x = __float_as_uint(x);
    out->first_scale = __float_as_uint(scale);
  }
}

// Every significand of x in [1, 2) against the scales in [1, 2) whose significand is a multiple
// of `scale_stride` (1: all 2^46 pairs): IEEE's quotient, bit for bit. Where nothing under- or
// overflows a quotient's significand depends on the two significands alone.
__global__ void compare_significand_pairs(uint32_t scale_stride, DivisionMismatches* out) {
  unsigned long long exact = 0;
  for (uint32_t s = blockIdx.y * scale_stride; s < (1u << 23); s += gridDim.y * scale_stride) {
    const Fp8Divisor divisor = fp8_divisor(__uint_as_float(0x3f800000u | s));
    for (uint32_t m = blockIdx.x * blockDim.x + threadIdx.x; m < (1u << 23);
         m += gridDim.x * blockDim.x) {
      const float x = __uint_as_float(0x3f800000u | m);
      const bool same = __float_as_uint(quotient_by_reciprocal(x, divisor)) ==
                        __float_as_uint(__fdiv_rn(x, divisor.scale));
      exact += same;
      if (!same) record(x, divisor.scale, out);
    }
  }
  atomicAdd(&out->exact, exact);
}

// Every fp32 x against one scale: IEEE division's E4M3 byte always, and its quotient bit for bit
// wherever that lies within 2^+-20 (where every byte is decided).
__global__ void compare_every_float(float scale, DivisionMismatches* out) {
  const Fp8Divisor divisor = fp8_divisor(scale);
  unsigned long long exact = 0;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < (uint64_t(1) << 32);
       i += uint64_t(gridDim.x) * blockDim.x) {
    const float x = __uint_as_float(uint32_t(i));
    // As quantize_vector divides.
    const float q =
        divisor.by_reciprocal ? quotient_by_reciprocal(x, divisor) : __fdiv_rn(x, scale);
    const float ieee = __fdiv_rn(x, scale);
    const bool decided = fabsf(ieee) >= 0x1p-20f && fabsf(ieee) <= 0x1p20f;
    const bool same_bits = __float_as_uint(q) == __float_as_uint(ieee);
    exact += decided && same_bits;
    if ((decided && !same_bits) || fp8_e4m3_from_float(q).bits != fp8_e4m3_from_float(ieee).bits) {
      record(x, scale, out);
    }
  }
  atomicAdd(&out->exact, exact);
}

TEST(GpuNumeric, Fp8E4M3WordsMatchSoftwareOnEveryFloat) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  Mismatches* result = nullptr;
  ASSERT_EQ(cudaMallocManaged(&result, sizeof(Mismatches)), cudaSuccess);
  *result = Mismatches{};
  compare_e4m3_words<<<4096, 256>>>(result);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(result->count, 0ull) << "first: input bits 0x" << std::hex << result->first_input
                                 << " got 0x" << result->first_hardware << " want 0x"
                                 << result->first_software;
  cudaFree(result);
}

// TPFUSE_EVERY_SIGNIFICAND_PAIR=1 runs all 2^46 pairs (about 90 s on an H200); by default
// every 2048th scale significand (4096 scales x 2^23 values).
TEST(GpuNumeric, Fp8ScaleDivisionByReciprocalIsIeeeForEverySignificandPair) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  const char* every = std::getenv("TPFUSE_EVERY_SIGNIFICAND_PAIR");
  const uint32_t stride = every != nullptr && every[0] == '1' ? 1 : 2048;
  DivisionMismatches* result = nullptr;
  ASSERT_EQ(cudaMallocManaged(&result, sizeof(DivisionMismatches)), cudaSuccess);
  *result = DivisionMismatches{};
  compare_significand_pairs<<<dim3(1024, stride == 1 ? 512 : 64), 256>>>(stride, result);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const unsigned long long pairs = (uint64_t(1) << 23) * ((uint64_t(1) << 23) / stride);
  EXPECT_EQ(result->exact, pairs);
  EXPECT_EQ(result->count, 0ull) << "first: x bits 0x" << std::hex << result->first_x
                                 << " scale bits 0x" << result->first_scale;
  std::printf("%llu significand pairs, every one IEEE's quotient\n", pairs);
  cudaFree(result);
}

TEST(GpuNumeric, Fp8ScaleDivisionByReciprocalGivesIeeeBytesOnEveryFloat) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  // Scales at the ends of the range the reciprocal serves, FP8-like dynamic scales (amax / 448,
  // the floor's included), significands of all ones and of one, negative ones.
  const float scales[] = {
      0x1p-60f,      0x1p60f,       0x1.fffffep59f, 0x1.000002p-60f, 1.0f,
      0x1.fffffep0f, 1.0f / 448.0f, 3.0f / 448.0f,  1e-10f / 448.0f, 0.0173f,
      -0.0173f,      2.5e-4f,       -3.999f,        448.0f,          0x1.000002p0f,
      7.0f};
  DivisionMismatches* result = nullptr;
  ASSERT_EQ(cudaMallocManaged(&result, sizeof(DivisionMismatches)), cudaSuccess);
  for (const float scale : scales) {
    *result = DivisionMismatches{};
    compare_every_float<<<4096, 256>>>(scale, result);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(result->count, 0ull)
        << "scale " << scale << ": first x bits 0x" << std::hex << result->first_x;
    // The quotients within 2^+-20 (41 binades of each sign) are all exact: a floor on their count.
    EXPECT_GE(result->exact, 2ull * 40 * (1ull << 23)) << "scale " << scale;
  }
  cudaFree(result);
}

// Each warp: kValues values a lane from `input`; every lane's warp_sum_spread result against the
// butterfly of the value it holds (lane / (32 / kValues)), as bits. One count per mismatch.
template <int kValues>
__global__ void compare_warp_sums(const float* input, int warps, unsigned long long* mismatches) {
  const int lane = threadIdx.x % 32;
  for (int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; warp < warps;
       warp += gridDim.x * (blockDim.x / 32)) {
    float values[kValues];
    for (int j = 0; j < kValues; ++j) values[j] = input[(int64_t(warp) * 32 + lane) * kValues + j];
    const int held = lane / (32 / kValues);
    float butterfly = 0.0f;
    for (int j = 0; j < kValues; ++j) {
      float value = values[j];
      for (int offset = 16; offset > 0; offset /= 2)
        value += __shfl_xor_sync(0xffffffffu, value, offset);
      if (j == held) butterfly = value;
    }
    const float spread = warp_sum_spread(values);
    if (__float_as_uint(spread) != __float_as_uint(butterfly)) atomicAdd(mismatches, 1ull);
  }
}

template <int kValues>
unsigned long long warp_sum_mismatches(const std::vector<float>& values, int warps) {
  float* input = nullptr;
  unsigned long long* mismatches = nullptr;
  EXPECT_EQ(cudaMalloc(&input, values.size() * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMallocManaged(&mismatches, sizeof(unsigned long long)), cudaSuccess);
  *mismatches = 0;
  EXPECT_EQ(cudaMemcpy(input, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  compare_warp_sums<kValues><<<256, 256>>>(input, warps, mismatches);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const unsigned long long count = *mismatches;
  cudaFree(input);
  cudaFree(mismatches);
  return count;
}

// Values whose sum depends on the order of the additions (24-bit integers scaled by 2^-20 to
// 2^19, both signs: roundings and cancellations everywhere), with ±0, denormals, Inf and NaN.
TEST(GpuNumeric, WarpSumSpreadGivesEachValuesButterflyBits) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  constexpr int kWarps = 4096;
  std::vector<float> values(size_t(kWarps) * 32 * 32);
  uint64_t state = 0x243f6a8885a308d3ull;
  const float specials[] = {0.0f, -0.0f, 1e-45f, -1e-45f, 1e-40f, INFINITY, -INFINITY, NAN};
  for (float& x : values) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const uint32_t r = uint32_t(state >> 32);
    x = r % 97 == 0
            ? specials[(r >> 8) % 8]
            : std::ldexp(float(int32_t(r & 0xffffffu) - 0x800000), int((r >> 24) % 40) - 20);
  }
  EXPECT_EQ(warp_sum_mismatches<1>(values, kWarps), 0ull);
  EXPECT_EQ(warp_sum_mismatches<2>(values, kWarps), 0ull);
  EXPECT_EQ(warp_sum_mismatches<4>(values, kWarps), 0ull);
  EXPECT_EQ(warp_sum_mismatches<8>(values, kWarps), 0ull);
  EXPECT_EQ(warp_sum_mismatches<32>(values, kWarps), 0ull);
}

}  // namespace
}  // namespace tpfuse::impl
