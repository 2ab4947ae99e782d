// Element types and 16-byte packed vectors, host+device.
//
// Conversions round to nearest even. On the device they are the hardware instructions; on the
// host they are bit-exact software versions, so the CPU backend rounds the same way (NaN payloads
// aside: any NaN stays a NaN). The host versions are written without branches (selects and
// masks): the CPU backend's loops over rows of them vectorize (tests/cpu/test_numeric.cc holds
// them to the branchy forms they replaced, over every input).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tpfuse/impl/config.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

namespace tpfuse::impl {

TPF_HOST_DEVICE uint32_t float_bits(float x) {
#if TPF_ON_DEVICE
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

TPF_HOST_DEVICE float bits_float(uint32_t u) {
#if TPF_ON_DEVICE
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// Storage types: 16-bit floats are carried as their bits.
struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

TPF_HOST_DEVICE float to_float(float x) {
  return x;
}

TPF_HOST_DEVICE float to_float(BFloat16 x) {
  return bits_float(uint32_t{x.bits} << 16);
}

TPF_HOST_DEVICE float to_float(Float16 x) {
#if TPF_ON_DEVICE
  __half_raw raw;
  raw.x = x.bits;
  return __half2float(__half(raw));
#else
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu;
  const uint32_t mantissa = x.bits & 0x3ffu;
  const uint32_t special = sign | 0x7f800000u | (mantissa << 13);  // Inf, NaN
  // Zero or subnormal half: mantissa * 2^-24, exact in fp32.
  const uint32_t small = sign | float_bits(float(int32_t(mantissa)) * 5.9604644775390625e-8f);
  const uint32_t normal = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  // Masks, not selects: with a select the compiler moves the float multiply into a branch of its
  // own (it may not speculate a float operation), and a loop of these would not vectorize.
  const uint32_t is_special = 0u - uint32_t(exponent == 0x1fu);
  const uint32_t is_small = 0u - uint32_t(exponent == 0);
  const uint32_t finite = (is_small & small) | (~is_small & normal);
  return bits_float((is_special & special) | (~is_special & finite));
#endif
}

template <typename T>
TPF_HOST_DEVICE T from_float(float x);

template <>
TPF_HOST_DEVICE float from_float<float>(float x) {
  return x;
}

template <>
TPF_HOST_DEVICE BFloat16 from_float<BFloat16>(float x) {
#if TPF_ON_DEVICE
  __nv_bfloat16_raw raw = __nv_bfloat16(__float2bfloat16_rn(x));
  return BFloat16{raw.x};
#else
  const uint32_t u = float_bits(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return BFloat16{uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded)};
#endif
}

template <>
TPF_HOST_DEVICE Float16 from_float<Float16>(float x) {
#if TPF_ON_DEVICE
  __half_raw raw = __half(__float2half_rn(x));
  return Float16{raw.x};
#else
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t magnitude = u & 0x7fffffffu;
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const uint32_t rebased = magnitude - (112u << 23);
  const uint32_t normal = (rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13;
  // Subnormal or zero (below 2^-14): magnitude / 2^-24 rounded to an integer, ties to even. Adding
  // 0.5, whose ulp is 2^-24, is that rounding (round-to-nearest-even, the default mode every fp32
  // add here runs in); fp32 subnormals give 0 whether or not they are flushed.
  const uint32_t small = float_bits(bits_float(magnitude) + 0.5f) - 0x3f000000u;
  // Masks, not selects (as in to_float above).
  const uint32_t is_small = 0u - uint32_t(magnitude < 0x38800000u);
  const uint32_t is_infinite = 0u - uint32_t(magnitude >= 0x477ff000u);  // rounds to Inf
  const uint32_t is_nan = 0u - uint32_t(magnitude > 0x7f800000u);
  uint32_t result = (is_small & small) | (~is_small & normal);
  result = (is_infinite & 0x7c00u) | (~is_infinite & result);
  result = (is_nan & 0x7e00u) | (~is_nan & result);
  return Float16{uint16_t(sign | result)};
#endif
}

// FP8 E4M3 ("e4m3fn": bias 7, 3 mantissa bits, no infinities, 0x7f / 0xff NaN, largest finite
// 448): the quantized outputs' type, carried as its bits.
struct Fp8E4M3 {
  uint8_t bits;
};

constexpr float kFp8E4M3Max = 448.0f;
constexpr uint8_t kFp8E4M3NaN = 0x7f;

// Exact: every E4M3 value is an fp32 value.
TPF_HOST_DEVICE float to_float(Fp8E4M3 x) {
  const uint32_t sign = uint32_t(x.bits & 0x80u) << 24;
  const uint32_t exponent = (x.bits >> 3) & 0xfu;
  const uint32_t mantissa = x.bits & 0x7u;
  if (exponent == 0xf && mantissa == 0x7) return bits_float(0x7fc00000u | sign);
  if (exponent == 0) {
    const float magnitude = float(mantissa) * 0.001953125f;  // mantissa * 2^-9
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// fp32 to E4M3, round to nearest even, saturating: magnitudes that round past 448 (Inf
// included) give ±448; zeros keep their sign; any NaN gives 0x7f. This is the software form
// the host uses (and the GPU test compares the hardware conversion with, over every fp32).
TPF_HOST_DEVICE Fp8E4M3 fp8_e4m3_from_float_software(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return Fp8E4M3{kFp8E4M3NaN};
  // From 464 (448 and half its ulp; the tie rounds to 448's even mantissa) on: saturate.
  if (magnitude >= 0x43e80000u) return Fp8E4M3{uint8_t(sign | 0x7eu)};
  if (magnitude < 0x3c800000u) {
    // Below the smallest normal (2^-6): a multiple of 2^-9, the integer rounded to nearest even
    // (8 is the smallest normal's encoding, reached by rounding up).
    const uint32_t exponent = magnitude >> 23;
    if (exponent == 0) return Fp8E4M3{sign};  // fp32 zero or subnormal: far below 2^-10
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 141u - exponent;  // value / 2^-9 = mantissa * 2^(exponent - 141)
    if (shift > 25u) return Fp8E4M3{sign};   // below 2^-11: rounds to zero
    uint32_t result = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
    return Fp8E4M3{uint8_t(sign | result)};
  }
  // Normal: rebias the exponent (127 to 7), round the 20 dropped mantissa bits to nearest even;
  // a carry moves into the exponent as it should.
  const uint32_t rebased = magnitude - (120u << 23);
  const uint32_t rounded = rebased + 0x7ffffu + ((rebased >> 20) & 1u);
  return Fp8E4M3{uint8_t(sign | (rounded >> 20))};
}

// The software form without branches: the host's conversion (tests/cpu/test_numeric.cc holds it
// to the software form over every fp32). Masks rather than selects: with a select the compiler
// moves the fp32 add into a branch of its own (it may not speculate a float operation), and a
// loop of these would not vectorize.
inline Fp8E4M3 fp8_e4m3_from_float_host(float x) {
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t magnitude = u & 0x7fffffffu;
  const uint32_t rebased = magnitude - (120u << 23);
  const uint32_t normal = (rebased + 0x7ffffu + ((rebased >> 20) & 1u)) >> 20;
  // Below 2^-6: value / 2^-9 rounded to nearest even, as adding 2^14 (whose ulp is 2^-9) rounds
  // it (round-to-nearest-even, the default mode every fp32 add here runs in).
  const uint32_t small = float_bits(bits_float(magnitude) + 16384.0f) - 0x46800000u;
  const uint32_t below = 0u - uint32_t(magnitude < 0x3c800000u);
  const uint32_t saturated = 0u - uint32_t(magnitude >= 0x43e80000u);
  const uint32_t nan = 0u - uint32_t(magnitude > 0x7f800000u);
  uint32_t result = sign | (below & small) | (~below & normal);
  result = (saturated & (sign | 0x7eu)) | (~saturated & result);
  result = (nan & kFp8E4M3NaN) | (~nan & result);
  return Fp8E4M3{uint8_t(result)};
}

// The conversion the epilogues use: the hardware instruction on the device
// (cvt.rn.satfinite.e4m3x2.f32, NaN made 0x7f as the software form gives it), the software form
// on the host; the same bits for every fp32.
TPF_HOST_DEVICE Fp8E4M3 fp8_e4m3_from_float(float x) {
#if TPF_ON_DEVICE
  if (x != x) return Fp8E4M3{kFp8E4M3NaN};
  return Fp8E4M3{uint8_t(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3))};
#else
  return fp8_e4m3_from_float_host(x);
#endif
}

#if defined(__CUDACC__)
// E4M3's NaN is 0x7f (fp8_e4m3_from_float); the hardware conversion may give a NaN as 0xff, which
// no other input gives: each 0xff byte of `bytes` becomes 0x7f (a byte's low 7 bits plus one
// carry into its top bit only where they are all ones).
__device__ __forceinline__ uint32_t fp8_e4m3_canonical_nans(uint32_t bytes) {
  return bytes ^ (((bytes & 0x7f7f7f7fu) + 0x01010101u) & bytes & 0x80808080u);
}

// Four conversions, `x0` into the low byte, the NaN fix-up once for the four bytes.
__device__ __forceinline__ uint32_t fp8_e4m3x4_from_floats(float x0, float x1, float x2, float x3) {
  const uint32_t low = __nv_cvt_float2_to_fp8x2(make_float2(x0, x1), __NV_SATFINITE, __NV_E4M3);
  const uint32_t high = __nv_cvt_float2_to_fp8x2(make_float2(x2, x3), __NV_SATFINITE, __NV_E4M3);
  return fp8_e4m3_canonical_nans(low | high << 16);
}
#endif

// 16 bytes: the unit every load, store and packet moves (ld.128 / st.128 on the GPU).
struct alignas(16) Vec16 {
  uint32_t word[4];
};

template <typename T>
struct Packed {
  static constexpr int kElements = 16 / sizeof(T);
};

// The 8 bf16 lanes of a vector by whole words: to_float of each half of a word, one instruction
// each (a shift and a mask), the same bits. unpack<BFloat16> takes it on the GPU; on the host the
// element-wise form vectorizes better
// (cdd3d3d:bench/studies/h200-20261204-9c963c6-qk-instructions/, docs/notebook.md).
TPF_HOST_DEVICE void unpack_bf16_words(const Vec16& v, float (&out)[8]) {
  TPF_UNROLL
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = bits_float(v.word[i] << 16);
    out[2 * i + 1] = bits_float(v.word[i] & 0xffff0000u);
  }
}

// Unpack a 16-byte vector of T into fp32 lanes, and pack fp32 lanes back with one rounding.
template <typename T>
TPF_HOST_DEVICE void unpack(const Vec16& v, float (&out)[Packed<T>::kElements]) {
#if TPF_ON_DEVICE
  if constexpr (std::is_same_v<T, BFloat16>) {
    unpack_bf16_words(v, out);
    return;
  }
#endif
  T elements[Packed<T>::kElements];
  static_assert(sizeof(elements) == 16);
#if TPF_ON_DEVICE
  *reinterpret_cast<Vec16*>(elements) = v;
#else
  std::memcpy(elements, &v, 16);
#endif
  TPF_UNROLL
  for (int i = 0; i < Packed<T>::kElements; ++i) out[i] = to_float(elements[i]);
}

template <typename T>
TPF_HOST_DEVICE Vec16 pack(const float (&in)[Packed<T>::kElements]) {
  T elements[Packed<T>::kElements];
  TPF_UNROLL
  for (int i = 0; i < Packed<T>::kElements; ++i) elements[i] = from_float<T>(in[i]);
  Vec16 v;
#if TPF_ON_DEVICE
  v = *reinterpret_cast<const Vec16*>(elements);
#else
  std::memcpy(&v, elements, 16);
#endif
  return v;
}

TPF_HOST_DEVICE float reciprocal_sqrt(float x) {
#if TPF_ON_DEVICE
  return rsqrtf(x);
#else
  return 1.0f / __builtin_sqrtf(x);
#endif
}

}  // namespace tpfuse::impl
