// The FP8 E4M3 steps the Output policies share (outputs.h): a vector's largest magnitude, the
// dynamic scale, and a vector's bytes at a scale. Host and device, the same bits on both.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "tpfuse/impl/config.h"
#include "tpfuse/impl/numeric.h"
#include "tpfuse/limits.h"

namespace tpfuse::impl {

// Per 16-byte vector of the norm output as stored, its largest magnitude. The dynamic scales come
// from the largest magnitude of a token or a group; max is exact in any order (fmaxf: a NaN lane
// does not win), so the scale does not depend on how a backend reduces.
template <typename T>
TPF_HOST_DEVICE float vector_amax(const Vec16& normalized) {
  float lanes[Packed<T>::kElements];
  unpack<T>(normalized, lanes);
  float amax = 0.0f;
  TPF_UNROLL
  for (int i = 0; i < Packed<T>::kElements; ++i) amax = fmaxf(amax, fabsf(lanes[i]));
  return amax;
}

TPF_HOST_DEVICE float dynamic_scale(float amax) {
  return fmaxf(amax, kQuantMinAmax) / kFp8E4M3Max;
}

// Division by one FP8 scale (a call's, a token's or a group's), with IEEE division's E4M3 bytes
// on the host and the device. The host divides. The device multiplies by the correctly rounded
// reciprocal and corrects once with the exact remainder (Markstein): the IEEE quotient wherever
// it can decide a byte (E4M3 rounds below 2^-10 to zero and saturates from 464; the quotient is
// IEEE's for every pair of significands and for every x whose quotient lies within 2^+-20),
// without a branch per element, so a vector's quotients issue together instead of one IEEE
// division after another (tests/gpu/test_numeric_gpu.cu checks all of this exhaustively). A
// scale that is not positive or lies outside [2^-60, 2^60] divides element by element.
struct Fp8Divisor {
  float scale;
  float reciprocal;    // RN(1 / scale): the device's
  bool by_reciprocal;  // scale within [2^-60, 2^60]
};

TPF_HOST_DEVICE Fp8Divisor fp8_divisor(float scale) {
#if TPF_ON_DEVICE
  return {scale, __frcp_rn(scale), scale >= 0x1p-60f && scale <= 0x1p60f};
#else
  return {scale, 0.0f, false};
#endif
}

#if defined(__CUDACC__)
// x / d.scale by the reciprocal (d.by_reciprocal). The remainder is taken negated, q * scale - x,
// so that the correction subtracting it keeps a zero quotient's sign (a positive scale). Finite q
// and x give a finite remainder; an infinite q (x is, or the quotient overflows) a NaN
// correction, where q stands (a NaN x gives NaN either way).
__device__ __forceinline__ float quotient_by_reciprocal(float x, const Fp8Divisor& d) {
  const float q = __fmul_rn(x, d.reciprocal);
  const float negated_remainder = __fmaf_rn(q, d.scale, -x);
  const float corrected = __fmaf_rn(-negated_remainder, d.reciprocal, q);
  return corrected != corrected ? q : corrected;
}
#endif

// The E4M3 bytes of one vector's elements divided by the scale, packed little-endian: 8 bytes
// for 16-bit T, 4 for fp32.
template <typename T>
struct QuantBytes {
  uint8_t bytes[Packed<T>::kElements];
};

template <typename T>
TPF_HOST_DEVICE QuantBytes<T> quantize_vector(const Vec16& normalized, const Fp8Divisor& divisor) {
  constexpr int kElements = Packed<T>::kElements;
  float lanes[kElements];
  unpack<T>(normalized, lanes);
  QuantBytes<T> out;
#if TPF_ON_DEVICE
  const auto convert = [&](auto quotient) {
    TPF_UNROLL
    for (int i = 0; i < kElements; i += 4) {
      const uint32_t word = fp8_e4m3x4_from_floats(quotient(lanes[i]), quotient(lanes[i + 1]),
                                                   quotient(lanes[i + 2]), quotient(lanes[i + 3]));
      memcpy(out.bytes + i, &word, 4);
    }
  };
  if (divisor.by_reciprocal) {
    convert([&](float x) { return quotient_by_reciprocal(x, divisor); });
  } else {
    convert([&](float x) { return __fdiv_rn(x, divisor.scale); });
  }
#else
  TPF_UNROLL
  for (int i = 0; i < kElements; ++i) {
    out.bytes[i] = fp8_e4m3_from_float(lanes[i] / divisor.scale).bits;
  }
#endif
  return out;
}

}  // namespace tpfuse::impl
