// The host conversions the CPU backend (and the tests) use: exact round trips and round to
// nearest even, checked against the neighbours of each result.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "reference.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/impl/numeric.h"

namespace tpfuse::impl {
namespace {

using testing::reference_e4m3;

template <typename T>
void expect_round_trips() {
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const T value{uint16_t(bits)};
    const float x = to_float(value);
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(to_float(from_float<T>(x))));
      continue;
    }
    EXPECT_EQ(from_float<T>(x).bits, bits) << std::hex << bits;
  }
}

TEST(Numeric, SixteenBitValuesRoundTripExactly) {
  expect_round_trips<BFloat16>();
  expect_round_trips<Float16>();
}

template <typename T>
void expect_nearest_even(float x) {
  const T rounded = from_float<T>(x);
  const double result = to_float(rounded);
  if (std::isinf(result)) return;  // overflow: checked by the caller's bounds
  // The two neighbours of the result must be no closer to x (ties: the result is even).
  for (int step : {-1, 1}) {
    const uint16_t neighbour_bits = uint16_t(rounded.bits + step);
    const double neighbour = to_float(T{neighbour_bits});
    if (std::isnan(neighbour) || std::isinf(neighbour)) continue;
    if ((neighbour_bits & 0x7fff) == 0 && (rounded.bits & 0x7fff) == 0x7fff) continue;
    const double error = std::fabs(double(x) - result);
    const double other = std::fabs(double(x) - neighbour);
    if ((rounded.bits & 0x7fff) == 0 && step == -1) continue;  // crossing zero's sign
    EXPECT_TRUE(error < other || (error == other && (rounded.bits & 1) == 0))
        << x << " -> " << result << " but " << neighbour << " is nearer or an even tie";
  }
}

// unpack_bf16_words (unpack<BFloat16> on the GPU) works on whole words (a shift and a mask):
// each element's bits must be to_float's of that element, as unpack<BFloat16>'s, every 16-bit
// pattern in every position beside another pattern.
TEST(Numeric, Bf16UnpackGivesToFloatOfEveryElement) {
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const uint32_t partner = (bits * 40503u + 0x9e37u) & 0xffffu;
    Vec16 v{};
    for (int w = 0; w < 4; ++w)
      v.word[w] = w % 2 == 0 ? bits | partner << 16 : partner | bits << 16;
    float lanes[8], words[8];
    unpack<BFloat16>(v, lanes);
    unpack_bf16_words(v, words);
    for (int e = 0; e < 8; ++e) {
      const uint16_t element = uint16_t(e % 4 == 0 || e % 4 == 3 ? bits : partner);
      const uint32_t want = float_bits(to_float(BFloat16{element}));
      ASSERT_EQ(float_bits(lanes[e]), want)
          << std::hex << "unpack: element bits 0x" << element << " at " << std::dec << e;
      ASSERT_EQ(float_bits(words[e]), want)
          << std::hex << "words: element bits 0x" << element << " at " << std::dec << e;
    }
  }
}

TEST(Numeric, RoundsToNearestEven) {
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = rng();
    float x = bits_float(bits);
    if (std::isnan(x) || std::isinf(x)) continue;
    expect_nearest_even<BFloat16>(x);
    if (std::fabs(x) < 65000.0f) expect_nearest_even<Float16>(x);
    if (std::fabs(x) < 65000.0f) expect_nearest_even<Float16>(x * 1e-3f);
  }
  EXPECT_EQ(from_float<Float16>(65520.0f).bits, 0x7c00);  // rounds up to Inf
  EXPECT_EQ(from_float<Float16>(65519.0f).bits, 0x7bff);
  EXPECT_EQ(from_float<Float16>(std::ldexp(1.0f, -25)).bits, 0x0000);  // tie to even zero
  EXPECT_EQ(from_float<Float16>(std::ldexp(1.5f, -25)).bits, 0x0001);
  EXPECT_EQ(from_float<BFloat16>(1.0f + std::ldexp(1.0f, -8)).bits, 0x3f80);  // tie to even
  EXPECT_EQ(from_float<BFloat16>(1.0f + std::ldexp(3.0f, -8)).bits, 0x3f82);
}

// The host conversions as they were first written, with branches; numeric.h's are selects (so
// that loops over them vectorize) and must give the same bits for every input. (E4M3's branchy
// form stays in numeric.h: the GPU test compares the hardware conversion with it.)
float branchy_to_float(Float16 x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1fu;
  uint32_t mantissa = x.bits & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return bits_float(sign);
    const float magnitude = float(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

uint16_t branchy_bfloat16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return uint16_t((u + rounding) >> 16);
}

uint16_t branchy_float16(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (magnitude >= 0x477ff000u) return uint16_t(sign | 0x7c00u);
  if (magnitude < 0x38800000u) {
    if (magnitude < 0x33000000u) return sign;
    const uint32_t exponent = magnitude >> 23;
    const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;
    uint32_t result = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
    return uint16_t(sign | result);
  }
  const uint32_t rebased = magnitude - (112u << 23);
  const uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
  return uint16_t(sign | (rounded >> 13));
}

TEST(Numeric, HostConversionsGiveTheBranchyFormsBitsForEveryInput) {
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    ASSERT_EQ(float_bits(to_float(Float16{uint16_t(bits)})),
              float_bits(branchy_to_float(Float16{uint16_t(bits)})))
        << std::hex << bits;
  }
  // Every fp32, in blocks: a loop of numeric.h's conversions (vectorized, as the CPU backend
  // runs them), then the branchy forms one by one.
  constexpr uint32_t kBlock = 1u << 16;
  std::vector<float> x(kBlock);
  std::vector<uint16_t> bf16(kBlock), fp16(kBlock);
  std::vector<uint8_t> e4m3(kBlock);
  for (uint64_t first = 0; first < (uint64_t(1) << 32); first += kBlock) {
    for (uint32_t i = 0; i < kBlock; ++i) x[i] = bits_float(uint32_t(first + i));
    for (uint32_t i = 0; i < kBlock; ++i) bf16[i] = from_float<BFloat16>(x[i]).bits;
    for (uint32_t i = 0; i < kBlock; ++i) fp16[i] = from_float<Float16>(x[i]).bits;
    for (uint32_t i = 0; i < kBlock; ++i) e4m3[i] = fp8_e4m3_from_float(x[i]).bits;
    for (uint32_t i = 0; i < kBlock; ++i) {
      if (bf16[i] != branchy_bfloat16(x[i]) || fp16[i] != branchy_float16(x[i]) ||
          e4m3[i] != fp8_e4m3_from_float_software(x[i]).bits) {
        FAIL() << std::hex << "fp32 " << float_bits(x[i]) << ": bf16 " << bf16[i] << " vs "
               << branchy_bfloat16(x[i]) << ", fp16 " << fp16[i] << " vs " << branchy_float16(x[i])
               << ", e4m3 " << int(e4m3[i]) << " vs "
               << int(fp8_e4m3_from_float_software(x[i]).bits);
      }
    }
  }
}

TEST(Numeric, Fp8E4M3CodesRoundTrip) {
  for (int code = 0; code < 256; ++code) {
    const float x = to_float(Fp8E4M3{uint8_t(code)});
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(x)) << code;
      EXPECT_EQ(fp8_e4m3_from_float(x).bits, kFp8E4M3NaN);
      continue;
    }
    EXPECT_EQ(fp8_e4m3_from_float(x).bits, code) << std::hex << code;
  }
  EXPECT_EQ(to_float(Fp8E4M3{0x7e}), 448.0f);
  EXPECT_EQ(to_float(Fp8E4M3{0x01}), std::ldexp(1.0f, -9));
  EXPECT_EQ(to_float(Fp8E4M3{0x08}), std::ldexp(1.0f, -6));
}

TEST(Numeric, Fp8E4M3RoundsToNearestEvenAndSaturates) {
  // Every exponent, every kept mantissa and the dropped bits' telling patterns (zero, one, just
  // below, at and above half, all ones), both signs; then random bit patterns.
  const uint32_t dropped[] = {0, 1, 0x3ffff, 0x7fffe, 0x7ffff, 0x80000, 0x80001, 0xfffff};
  int checked = 0;
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t exponent = 0; exponent < 256; ++exponent) {
      for (uint32_t kept = 0; kept < 8; ++kept) {
        for (const uint32_t low : dropped) {
          const float x = bits_float((sign << 31) | (exponent << 23) | (kept << 20) | low);
          ASSERT_EQ(fp8_e4m3_from_float(x).bits, reference_e4m3(x)) << std::hexfloat << x;
          ++checked;
        }
      }
    }
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 400000; ++i) {
    // Half the draws within E4M3's range, where the rounding happens.
    uint32_t bits = rng();
    if (i % 2) bits = (bits & 0x800fffffu) | ((110u + rng() % 30u) << 23);
    const float x = bits_float(bits);
    ASSERT_EQ(fp8_e4m3_from_float(x).bits, reference_e4m3(x)) << std::hexfloat << x;
  }
  EXPECT_GT(checked, 30000);
  // The boundaries by name.
  EXPECT_EQ(fp8_e4m3_from_float(448.0f).bits, 0x7e);
  EXPECT_EQ(fp8_e4m3_from_float(463.99997f).bits, 0x7e);
  EXPECT_EQ(fp8_e4m3_from_float(464.0f).bits, 0x7e);  // the tie goes to 448's even mantissa
  EXPECT_EQ(fp8_e4m3_from_float(1e30f).bits, 0x7e);
  EXPECT_EQ(fp8_e4m3_from_float(-INFINITY).bits, 0xfe);
  EXPECT_EQ(fp8_e4m3_from_float(-NAN).bits, kFp8E4M3NaN);
  EXPECT_EQ(fp8_e4m3_from_float(-0.0f).bits, 0x80);
  EXPECT_EQ(fp8_e4m3_from_float(std::ldexp(1.0f, -10)).bits, 0x00);  // half the smallest: even
  EXPECT_EQ(fp8_e4m3_from_float(std::ldexp(1.5f, -10)).bits, 0x01);
  EXPECT_EQ(fp8_e4m3_from_float(std::ldexp(1.0f, -149)).bits, 0x00);  // an fp32 subnormal
  EXPECT_EQ(fp8_e4m3_from_float(std::ldexp(15.0f, -10)).bits, 0x08);  // up into the normals
}

TEST(Lamport, SentinelIsComparedAsBits) {
  // -0.0f equals 0.0f as a value; only the bits tell the sentinel from a payload zero.
  const Vec16 negative_zeros = sentinel_vector();
  EXPECT_FALSE(has_arrived(negative_zeros));
  Vec16 positive_zeros{{0, 0, 0, 0}};
  EXPECT_TRUE(has_arrived(positive_zeros));
  Vec16 one_missing{{0x3f800000u, 0, kSentinel, 0}};
  EXPECT_FALSE(has_arrived(one_missing));
  const Vec16 rewritten = rewrite_sentinel(Vec16{{kSentinel, 0x80000001u, 0x00008000u, kSentinel}});
  EXPECT_EQ(rewritten.word[0], 0u);
  EXPECT_EQ(rewritten.word[1], 0x80000001u);
  EXPECT_EQ(rewritten.word[2], 0x00008000u);
  EXPECT_EQ(rewritten.word[3], 0u);
  EXPECT_TRUE(has_arrived(rewritten));
}

TEST(Lamport, SlotRotation) {
  uint32_t slot = 0;
  for (int call = 0; call < 10; ++call) {
    EXPECT_EQ(slot, uint32_t(call % 3));
    const uint32_t next = next_slot(slot);
    // A call clears the slot the previous call used: never its own, never the next call's.
    EXPECT_EQ(slot_to_clear(next), slot);
    EXPECT_NE(slot_to_clear(slot), slot);
    EXPECT_NE(slot_to_clear(slot), next);
    slot = next;
  }
}

}  // namespace
}  // namespace tpfuse::impl
